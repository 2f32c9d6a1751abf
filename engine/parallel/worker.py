"""A tensor-parallel worker process (ranks 1..N-1): its shard of the model, its KV cache, a step loop.

A worker is started once per engine by `engine.parallel.WorkerGroup` (torch.multiprocessing,
"spawn") and lives as long as the engine. Its life:

1. load: build its shard of the model (`engine.loader.load_model` with its `TPShard`: only its
   slices are read from GGUF or safetensors, or drawn for dummy weights; quantization, if
   any, is applied to its slices), then send ("ready", {"free_memory": bytes}) on its pipe,
   or ("error", traceback) and exit 1;
2. init: receive ("init", num_blocks, max_model_len) from the driver, allocate its paged KV
   cache (its num_kv_heads / N heads, the driver's block count, so the driver's block tables
   address it), join the process group (and, for int8, agree on the row-parallel scales:
   `engine.loader.finish_sharded_quantization`);
3. loop: receive a header [command, payload length] broadcast by the driver (waiting as
   long as the engine is idle: the group's timeout applies within a step), then the
   payload: RUN (a packed `StepInputs`: the same forward as the driver's, whose collectives
   meet the driver's), COPY (KV blocks src -> dst), STOP (leave the group, exit 0).

It never outlives the driver: SIGINT is ignored (the driver decides, e.g. on Ctrl-C), and a
watchdog thread exits the process within half a second of its parent's death (its parent
pid changes), even while the main thread waits in a collective; a collective whose peer is
gone also fails ("connection closed"). Any exception is sent to the driver before exiting 1.
"""
from __future__ import annotations

import os
import signal
import threading
import traceback
from dataclasses import dataclass
from typing import Optional

CMD_STOP, CMD_RUN, CMD_COPY = 0, 1, 2
HEADER_LEN = 4  # [command, payload length, a, b]
IDLE_TIMEOUT_S = 365 * 24 * 3600.0  # waiting for the next step: no timeout (the driver's death ends it)


@dataclass(frozen=True)
class WorkerSpec:
    """What every rank builds (picklable: sent to the spawned workers).

    Attributes:
        source: the resolved model (`engine.weights.ModelSource`).
        dtype: a torch dtype; device: "cpu" or "cuda:<index of rank 0>" (rank r uses index + r).
        seed, quantization, group_size, cpu_kernels: as `engine.loader.load_model` takes them.
        attention_backend, kv_cache_dtype: as `EngineConfig` has them (resolved).
        block_size: tokens per KV block.
        num_threads: CPU threads of each rank (PyTorch's pool and the C kernels').
        world_size: ranks, driver included.
        store: where the ranks meet (`engine.parallel.group.store_location`; a TCP port is the
            one rank 0 bound).
        host: the address the collectives' sockets bind to.
        timeout_s: how long a collective waits for a peer.
    """

    source: object
    dtype: object
    device: str
    seed: int
    quantization: Optional[str]
    group_size: int
    cpu_kernels: bool
    attention_backend: str
    kv_cache_dtype: str
    block_size: int
    num_threads: int
    world_size: int
    store: tuple = ()
    host: str = "127.0.0.1"
    timeout_s: float = 600.0

    def rank_device(self, rank: int) -> str:
        """The device of `rank`: the CPU, or the CUDA device after rank 0's by `rank`."""
        if not self.device.startswith("cuda"):
            return "cpu"
        base = int(self.device.split(":")[1]) if ":" in self.device else 0
        return f"cuda:{base + rank}"


def _watch_parent(parent: int) -> None:
    """Exit this process at once when the parent (the driver) is gone."""
    import time

    while True:
        if os.getppid() != parent:
            os._exit(1)
        time.sleep(0.5)


def build_shard(spec: WorkerSpec, rank: int):
    """(model shard, attention backend, KV storage dtype) of `rank`."""
    import torch

    from ..loader import load_model, make_attention_backend
    from .sharding import TPShard

    device = spec.rank_device(rank)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    model, _ = load_model(spec.source, spec.dtype, device, spec.seed, spec.quantization, spec.group_size,
                           spec.cpu_kernels, TPShard(rank, spec.world_size), False)
    backend, kv_dtype = make_attention_backend(spec.attention_backend, spec.kv_cache_dtype, spec.cpu_kernels,
                                               model.dtype, spec.dtype, spec.block_size, model.cfg.head_dim)
    return model, backend, kv_dtype


def worker_main(rank: int, spec: WorkerSpec, conn) -> None:
    """The worker process: load, init, loop (see the module docstring)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True, name="tp-watchdog").start()
    try:
        import torch

        from ..kv_cache import KVCache
        from ..loader import finish_sharded_quantization
        from ..model_runner import ModelRunner, StepInputs
        from .sharding import TPShard
        from ..threads import apply_num_threads
        from .group import RENDEZVOUS_TIMEOUT_S, TPGroup, make_store

        if spec.device == "cpu":
            apply_num_threads(spec.num_threads)
        model, backend, kv_dtype = build_shard(spec, rank)
        dev = torch.device(spec.rank_device(rank))
        free = torch.cuda.mem_get_info(dev)[0] if dev.type == "cuda" else 0
        conn.send(("ready", {"free_memory": int(free), "pid": os.getpid()}))
        msg = conn.recv()
        if msg[0] != "init":
            return
        _, num_blocks, max_model_len = msg
        cfg = model.cfg
        shape = backend.cache_shape(num_blocks, spec.block_size, model.local.num_kv_heads, cfg.head_dim)
        kv = KVCache(cfg, num_blocks, spec.block_size, kv_dtype, dev, shape)
        model._rope_tables(max_model_len + 1)
        store = make_store(rank, spec.world_size, spec.store, min(spec.timeout_s, RENDEZVOUS_TIMEOUT_S))
        group = TPGroup(store, rank, spec.world_size, dev, spec.timeout_s, spec.host)
        finish_sharded_quantization(model, spec.source, spec.dtype, str(dev), spec.seed, spec.quantization,
                                    spec.cpu_kernels, TPShard(rank, spec.world_size), False, group)
        runner = ModelRunner(model, kv, backend, tp=group)
        header = torch.zeros(HEADER_LEN, dtype=torch.int64, device=dev)
        with torch.inference_mode():
            while True:
                group.broadcast_(header, IDLE_TIMEOUT_S)  # the engine may stay idle for hours
                cmd, n, a, _ = header.tolist()
                if cmd == CMD_STOP:
                    break
                payload = group.broadcast_(torch.empty(n, dtype=torch.int64, device=dev))
                if cmd == CMD_RUN:
                    runner.run(StepInputs.unpack(payload))
                elif cmd == CMD_COPY:
                    flat = payload.tolist()
                    kv.copy_blocks(flat[:a], flat[a:])
        group.shutdown()
    except BaseException:  # noqa: BLE001 - whatever it was, the driver hears of it
        try:
            conn.send(("error", traceback.format_exc()))
        except (OSError, ValueError):
            pass
        os._exit(1)
