"""The driver's side of tensor parallelism: starting, feeding, watching and stopping the workers.

The driver (rank 0) is the engine's own process: it keeps the scheduler, the KV block
manager, the sampler and the tokenizer, holds rank 0's shard of the model and KV cache,
and computes its part of every step. `WorkerGroup` starts ranks 1..N-1 once
(torch.multiprocessing, "spawn"; see `engine.parallel.worker`), and per step broadcasts
the step's flattened inputs once (`StepInputs.pack`: a fixed header, then one int64
payload); every rank then runs the same forward pass, whose collectives meet, and the
logits come back on rank 0 (the vocabulary slices gathered there). This is vLLM's
driver-worker design.

Lifecycle:
- start: the ranks meet in a `FileStore` in a private temporary folder, or, when
  MASTER_ADDR / MASTER_PORT are set, a `TCPStore` there (default host 127.0.0.1, default
  port any free one); gloo's sockets bind 127.0.0.1 (or MASTER_ADDR). The
  workers load their shards while the driver loads its own; `wait_ready` raises
  `WorkerError` (naming the rank, its pid and its traceback or exit code) if one fails
  or dies before it is ready, or is not ready within `start_timeout_s`; `init` sends the
  KV geometry and forms the group.
- watch: a monitor thread waits on the workers' process sentinels; when one dies, it
  records which and kills the others, so that a collective the driver waits in fails
  within a second ("connection closed by peer") instead of waiting for the timeout;
  `guard` turns that failure into a `WorkerError` naming the dead rank. After a failure
  the engine raises the same error on every further step.
- stop: `close` broadcasts STOP, waits up to 5 s, then terminates and kills; a
  `weakref.finalize` does the same (without the broadcast) when the group is garbage
  collected or the interpreter exits. No worker outlives the driver: see the worker's
  parent watchdog.
"""
from __future__ import annotations

import contextlib
import dataclasses
import shutil
import sys
import tempfile
import threading
import time
import types
import weakref
from multiprocessing.connection import wait
from typing import Callable, Iterator, Optional

import torch

from .group import RENDEZVOUS_TIMEOUT_S, TPGroup, make_store, store_location
from .worker import CMD_COPY, CMD_RUN, CMD_STOP, HEADER_LEN, WorkerSpec, worker_main


class WorkerError(RuntimeError):
    """A tensor-parallel worker failed to start, died or raised; the engine cannot continue."""


def _describe_exit(code: Optional[int]) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        import signal

        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class _State:
    """What the monitor thread and the driver share (no reference to the WorkerGroup itself,
    so that dropping the engine collects the group and runs its finalizer)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.error: Optional[str] = None
        self.closing = False


def _stop_processes(procs: list, conns: list, grace_s: float = 2.0, folder: Optional[str] = None) -> None:
    """Terminate (SIGTERM), then kill, then reap every worker; close the pipes; remove `folder`."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(5.0)
    for c in conns:
        with contextlib.suppress(OSError):
            c.close()
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


def _read_error(conn) -> Optional[str]:
    """A worker's last ("error", traceback) message, if it sent one."""
    out = None
    try:
        while conn.poll():
            msg = conn.recv()
            if msg and msg[0] == "error":
                out = msg[1]
    except (EOFError, OSError):
        pass
    return out


def _monitor(procs: list, conns: list, state: _State, wake) -> None:
    """Wait for a worker to die; then record it and stop the others (see the module docstring)."""
    sentinels = {p.sentinel: (rank, p) for rank, p in enumerate(procs, start=1)}
    ready = wait(list(sentinels) + [wake])
    if wake in ready:
        return
    with state.lock:
        if state.closing:
            return
        rank, p = sentinels[ready[0]]
        p.join(0.1)
        tb = _read_error(conns[rank - 1])
        state.error = (f"tensor-parallel worker rank {rank} (pid {p.pid}) {_describe_exit(p.exitcode)}"
                       + (f":\n{tb}" if tb else ""))
    _stop_processes([q for q in procs if q is not p], [])


@contextlib.contextmanager
def _main_not_rerun() -> Iterator[None]:
    """While worker processes start: a stand-in `__main__` module (no file, no spec), so that "spawn"
    does not re-run the user's script in each worker. A script without an `if __name__ ==
    "__main__":` guard would otherwise build the engine again inside every worker (and fail there,
    starting processes during bootstrap). The workers need nothing from the script: their target
    and arguments are engine objects, imported by module name."""
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if main is not None:
            sys.modules["__main__"] = main


class WorkerGroup:
    """Ranks 1..N-1 of a tensor-parallel engine, seen from the driver.

    Args:
        spec: what each rank builds (`WorkerSpec`; its store address is filled in here).
        target: the worker entry point, called as target(rank, spec, pipe) in the new
            process (default `worker_main`).
    Raises:
        RuntimeError: the TCP store cannot bind (MASTER_PORT taken).
    """

    def __init__(self, spec: WorkerSpec, target: Callable = worker_main) -> None:
        import torch.multiprocessing as mp

        self.world_size = spec.world_size
        self._dir = tempfile.mkdtemp(prefix="tokenmill-tp-")
        where = store_location(self._dir)
        try:
            self.store = make_store(0, spec.world_size, where, min(spec.timeout_s, RENDEZVOUS_TIMEOUT_S))
        except BaseException as e:
            shutil.rmtree(self._dir, ignore_errors=True)
            if isinstance(e, RuntimeError) and where[0] == "tcp":
                raise RuntimeError(f"tensor parallelism: the rendezvous store cannot listen on {where[1]}:{where[2]} "
                                   f"(MASTER_ADDR / MASTER_PORT): {str(e).splitlines()[0]}") from None
            raise
        if where[0] == "tcp":
            where = ("tcp", where[1], self.store.port)
        self.spec = spec = dataclasses.replace(spec, store=where, host=where[1] if where[0] == "tcp" else "127.0.0.1")
        ctx = mp.get_context("spawn")
        self.procs, self.conns = [], []
        for rank in range(1, spec.world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=target, args=(rank, spec, child), daemon=True, name=f"tokenmill-tp-rank{rank}")
            with _main_not_rerun():
                p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)
        self.group: Optional[TPGroup] = None
        self._state = _State()
        self._wake_r, self._wake_w = ctx.Pipe(duplex=False)
        self._monitor: Optional[threading.Thread] = None
        self._finalizer = weakref.finalize(self, _stop_processes, self.procs, self.conns, 2.0, self._dir)

    # ------------------------------------------------------------ info
    @property
    def pids(self) -> list[int]:
        """Process ids of ranks 1..N-1."""
        return [p.pid for p in self.procs]

    # ------------------------------------------------------------ start
    def wait_ready(self, timeout_s: float = 600.0) -> list[dict]:
        """Each worker's ("ready", info) message, in rank order.

        Raises:
            WorkerError: a worker sent an error, died, or was not ready in time (all are stopped).
        """
        infos: dict[int, dict] = {}
        deadline = time.monotonic() + timeout_s
        by_conn = {c: r for r, c in enumerate(self.conns, start=1)}
        by_sentinel = {p.sentinel: r for r, p in enumerate(self.procs, start=1)}
        while len(infos) < len(self.procs):
            left = deadline - time.monotonic()
            pending = [c for c, r in by_conn.items() if r not in infos]
            ready = wait(pending + [s for s, r in by_sentinel.items() if r not in infos], max(0.0, left))
            if not ready:
                self._abort(f"tensor-parallel workers {sorted(set(by_conn.values()) - set(infos))} were not "
                            f"ready within {timeout_s:.0f} s")
            for obj in ready:
                rank = by_conn.get(obj) or by_sentinel[obj]
                p, conn = self.procs[rank - 1], self.conns[rank - 1]
                msg = None
                if obj in by_conn:
                    try:
                        msg = conn.recv()
                    except (EOFError, OSError):
                        msg = None
                if msg is not None and msg[0] == "ready":
                    infos[rank] = msg[1]
                    continue
                if msg is None and rank in infos:
                    continue
                p.join(1.0)
                tb = msg[1] if msg is not None and msg[0] == "error" else _read_error(conn)
                self._abort(f"tensor-parallel worker rank {rank} (pid {p.pid}) failed to start: it "
                            f"{_describe_exit(p.exitcode)}" + (f"\n{tb}" if tb else ""))
        return [infos[r] for r in sorted(infos)]

    def init(self, num_blocks: int, max_model_len: int, device: torch.device) -> TPGroup:
        """Send the KV geometry, form the process group (rank 0 here), start the monitor.

        Raises:
            WorkerError: a worker died while the group formed.
        """
        for c in self.conns:
            c.send(("init", num_blocks, max_model_len))
        try:
            self.group = TPGroup(self.store, 0, self.world_size, device, self.spec.timeout_s, self.spec.host)
        except RuntimeError as e:
            self._abort(f"tensor-parallel group did not form: {e}")
        self._monitor = threading.Thread(target=_monitor, args=(self.procs, self.conns, self._state, self._wake_r),
                                         daemon=True, name="tp-monitor")
        self._monitor.start()
        self._header = torch.zeros(HEADER_LEN, dtype=torch.int64, device=device)
        return self.group

    def _abort(self, message: str) -> None:
        with self._state.lock:
            self._state.error = self._state.error or message
            self._state.closing = True
        _stop_processes(self.procs, [])
        raise WorkerError(message)

    # ------------------------------------------------------------ steps
    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Run driver work that meets the workers in collectives; a failure there (or an
        earlier one) raises `WorkerError` naming the worker that died.

        Raises:
            WorkerError: see above.
        """
        if self._state.error is not None:
            raise WorkerError(self._state.error)
        try:
            yield
        except BaseException as e:
            if isinstance(e, WorkerError):
                raise
            # the monitor names a dead rank within moments of its death
            deadline = time.monotonic() + 3.0
            while self._state.error is None and self._monitor is not None and time.monotonic() < deadline:
                time.sleep(0.05)
            with self._state.lock:
                if self._state.error is None:  # the driver failed mid-step: the ranks are out of step now
                    self._state.error = (f"a tensor-parallel step failed on the driver ({type(e).__name__}: {e}); "
                                         f"the workers were stopped: create a new LLM")
                self._state.closing = True
            _stop_processes(self.procs, [])
            if not isinstance(e, RuntimeError):
                raise  # the driver's own error (or KeyboardInterrupt), as it was
            raise WorkerError(self._state.error) from e

    def _send(self, cmd: int, payload: Optional[torch.Tensor], a: int = 0) -> None:
        h = self._header
        h.copy_(torch.tensor([cmd, 0 if payload is None else payload.numel(), a, 0]))
        self.group.broadcast_(h)
        if payload is not None:
            self.group.broadcast_(payload)

    def run_step(self, inputs) -> None:
        """Hand one step (`StepInputs`) to every worker: header, then the packed inputs."""
        self._send(CMD_RUN, inputs.pack().to(self._header.device))

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Every worker copies the K/V of blocks src into dst (pairwise), as the driver does."""
        self._send(CMD_COPY, torch.tensor(list(src) + list(dst), dtype=torch.int64, device=self._header.device),
                   len(src))

    # ------------------------------------------------------------ stop
    def close(self, timeout_s: float = 5.0) -> None:
        """Stop every worker (STOP, then SIGTERM, then SIGKILL) and reap it; idempotent."""
        with self._state.lock:
            healthy = self._state.error is None and not self._state.closing
            self._state.closing = True
        with contextlib.suppress(OSError):
            self._wake_w.send(None)
        if healthy and self.group is not None:
            with contextlib.suppress(RuntimeError):
                self._send(CMD_STOP, None)
            deadline = time.monotonic() + timeout_s
            for p in self.procs:
                p.join(max(0.0, deadline - time.monotonic()))
        self._finalizer()  # terminate / kill what is left, reap, close the pipes
        with self._state.lock:
            self._state.error = self._state.error or "the LLM was closed: its tensor-parallel workers are stopped"
        if self.group is not None:
            self.group.shutdown()
        self.store = None


def start_workers(cfg, source, device: torch.device, dtype: torch.dtype, attention_backend: str,
                  quantization: Optional[str], group_size: int, spec_method: Optional[str],
                  num_threads: int) -> WorkerGroup:
    """Check that the model `source` splits over `cfg.tensor_parallel_size` ranks, then start ranks
    1..N-1 (they load their shards while the caller loads rank 0's). `cfg` is the `EngineConfig`;
    device, dtype and attention_backend are its resolved settings (`engine.loader.resolve_settings`).

    Raises:
        ValueError: N does not divide the heads (naming both), too few CUDA devices, or an
            option that does not run with tensor parallelism (w8a8, a draft model).
        WorkerError: a worker failed to start.
    """
    from ..weights import model_config
    from .sharding import check_tp_options, check_tp_size

    tp = cfg.tensor_parallel_size
    check_tp_size(model_config(source), tp)
    check_tp_options(tp, quantization, spec_method)
    where = str(device)
    if device.type == "cuda":
        base = device.index or 0
        if torch.cuda.device_count() < base + tp:
            raise ValueError(f"tensor_parallel_size={tp} needs CUDA devices {base}..{base + tp - 1}; "
                             f"{torch.cuda.device_count()} are visible")
        where = f"cuda:{base}"
        torch.cuda.set_device(base)  # NCCL works on the current device of each rank
    return WorkerGroup(WorkerSpec(
        source=source, dtype=dtype, device=where, seed=cfg.seed, quantization=quantization, group_size=group_size,
        cpu_kernels=cfg.cpu_kernels, attention_backend=attention_backend, kv_cache_dtype=cfg.kv_cache_dtype,
        block_size=cfg.block_size, num_threads=num_threads, world_size=tp, timeout_s=cfg.distributed_timeout_s))
