"""A tensor-parallel process group: the three collectives the sharded forward pass needs.

The group is a `torch.distributed` process group built directly on a `TCPStore` (gloo
on the CPU, NCCL on CUDA), not the process-wide default group, so that several engines
can live in one process (tests) and closing one never touches another. Rank 0 is the
driver (the process that owns the scheduler); it hosts the store.

Collectives (Megatron-LM, arXiv 1909.08053, section 3):
- `all_reduce_`: the sum of the ranks' partial outputs of a row-parallel layer (o, down)
  and of the vocabulary-parallel embedding, in place, on every rank;
- `gather_vocab`: the LM head's vocabulary slices of the logits, concatenated on rank 0;
- `broadcast_`: the driver's step inputs to every worker.

`comm_s` / `num_all_reduces`, `gather_s` and `broadcast_s` count the host wall time spent in
each kind of collective (on the CPU the wait for the slowest rank included; on CUDA only
the time to enqueue), for `benchmarks.tp_allreduce`.
"""
from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist


def store_location(private_dir: str) -> tuple:
    """Where the ranks meet: ("tcp", host, port) when MASTER_ADDR or MASTER_PORT is set (host
    default 127.0.0.1, port default 0: any free port, read back from the bound store), else
    ("file", path) in `private_dir`: a `FileStore`, so that nothing listens beyond the
    collectives' own sockets (a `TCPStore` server binds every interface)."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if host or port:
        return ("tcp", host or "127.0.0.1", int(port) if port else 0)
    return ("file", os.path.join(private_dir, "store"))


RENDEZVOUS_TIMEOUT_S = 120.0  # how long ranks wait for each other while the group forms


def make_store(rank: int, world_size: int, where: tuple, timeout_s: float = RENDEZVOUS_TIMEOUT_S) -> dist.Store:
    """The rendezvous store at `where` (`store_location`); over TCP rank 0 binds it (read `.port`).
    Its timeout bounds the group's formation only (the collectives have their own).

    Raises:
        RuntimeError (from torch): the port is taken, or the master cannot be reached in time.
    """
    if where[0] == "file":
        store = dist.FileStore(where[1], world_size)
        store.set_timeout(timedelta(seconds=timeout_s))
        return store
    _, host, port = where
    return dist.TCPStore(host, port, world_size, rank == 0, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


class TPGroup:
    """One rank's view of the tensor-parallel group.

    Args:
        store: the rendezvous store (`make_store`).
        rank, world_size: this rank and the group size.
        device: where the collectives' tensors live ("cpu" -> gloo, "cuda:i" -> NCCL).
        timeout_s: how long a collective may wait for a peer before it raises.
        host: the address gloo's sockets bind to (127.0.0.1, or MASTER_ADDR when set).
    Raises:
        RuntimeError: the rendezvous did not complete within the timeout.
    """

    def __init__(self, store: dist.Store, rank: int, world_size: int, device: torch.device,
                 timeout_s: float = 600.0, host: str = "127.0.0.1") -> None:
        self.rank, self.world_size, self.device = rank, world_size, torch.device(device)
        self.store = store
        if self.device.type == "cuda":
            self.backend = "nccl"
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timedelta(seconds=timeout_s)
            self.pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)
        else:
            self.backend = "gloo"
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = timedelta(seconds=timeout_s)
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
            self.pg = dist.ProcessGroupGloo(store, rank, world_size, opts)
        self.comm_s = 0.0
        self.num_all_reduces = 0
        self.gather_s = 0.0
        self.broadcast_s = 0.0

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks, in place on every rank (t contiguous, on the group's device)."""
        t0 = time.perf_counter()
        self.pg.allreduce([t]).wait()
        self.comm_s += time.perf_counter() - t0
        self.num_all_reduces += 1
        return t

    def all_reduce_max_(self, t: torch.Tensor) -> torch.Tensor:
        """The elementwise maximum of `t` over the ranks, in place on every rank (load time only:
        not counted in `comm_s`)."""
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        self.pg.allreduce([t], opts).wait()
        return t

    def gather_vocab(self, t: torch.Tensor, vocab_size: int) -> Optional[torch.Tensor]:
        """Rank 0: the ranks' [S, Vp] logits slices side by side, cut to [S, vocab_size];
        other ranks: None (they only send)."""
        t0 = time.perf_counter()
        t = t.contiguous()
        opts = dist.GatherOptions()
        opts.rootRank = 0
        out = None
        if self.rank == 0:
            parts = [torch.empty_like(t) for _ in range(self.world_size)]
            self.pg.gather([parts], [t], opts).wait()
            out = torch.cat(parts, dim=1)[:, :vocab_size]
        else:
            self.pg.gather([], [t], opts).wait()
        self.gather_s += time.perf_counter() - t0
        return out

    def broadcast_(self, t: torch.Tensor, timeout_s: Optional[float] = None) -> torch.Tensor:
        """Rank 0's `t` into every rank's `t` (same shape and dtype everywhere), in place;
        `timeout_s` overrides the group's timeout for this one call (a worker waiting for
        the next step waits as long as the engine stays idle)."""
        t0 = time.perf_counter()
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        if timeout_s is not None:
            opts.timeout = timedelta(seconds=timeout_s)
        self.pg.broadcast([t], opts).wait()
        self.broadcast_s += time.perf_counter() - t0
        return t

    def shutdown(self) -> None:
        """Drop the process group and the store (their sockets close; peers' pending ops fail)."""
        pg, self.pg = getattr(self, "pg", None), None
        if pg is not None and hasattr(pg, "shutdown"):
            try:
                pg.shutdown()
            except Exception:  # noqa: BLE001 - best effort: a peer may already be gone
                pass
        self.store = None
