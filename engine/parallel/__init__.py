"""Tensor parallelism: one model split over N ranks (Megatron-LM, arXiv 1909.08053).

- `sharding`: which slice of every weight a rank holds, and the divisibility rules.
- `group`: the process group and the collectives of the sharded forward pass.
- `worker`: ranks 1..N-1, each a process with its shard and its KV cache.
- `executor`: the driver's `WorkerGroup`: start, per-step broadcast, failure, stop.

The scheduler, KV block manager, sampler and tokenizer stay in the driver (rank 0); the
model runner hands each step to the workers and runs its own shard of the same forward.
"""
from .executor import WorkerError, WorkerGroup, start_workers
from .group import TPGroup
from .sharding import TPShard, check_tp_options, check_tp_size
from .worker import WorkerSpec

__all__ = ["TPGroup", "TPShard", "WorkerError", "WorkerGroup", "WorkerSpec", "check_tp_options", "check_tp_size",
           "start_workers"]
