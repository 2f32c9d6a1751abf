"""Continuous batching with chunked prefill under a per-step token budget.

Each step: decode tokens of running sequences first (one each), then prefill
chunks of sequences still reading their prompt, then newly admitted waiting
sequences, until the token budget (`max_num_batched_tokens`) or the sequence
limit (`max_num_seqs`) is reached. A sequence that cannot get a KV block
preempts the youngest running sequence by recompute: its blocks are freed and
it goes back to the front of the waiting queue with all its tokens (prompt
and generated so far), to be prefilled again later. Results do not change
(recompute of the same tokens), nothing is lost.
(Continuous batching: Yu et al. 2022, Orca; paged KV: Kwon et al. 2023,
arXiv 2309.06180; chunked prefill: Agrawal et al. 2023, arXiv 2308.16369.)
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .kv_cache import BlockPool
from .request import Sequence, SequenceStatus


@dataclass
class ScheduledChunk:
    """`num_tokens` tokens of `seq`, starting at `seq.num_computed_tokens`."""

    seq: Sequence
    num_tokens: int

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the sequence's last token, so a new token is sampled."""
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    """Chunks of one step, decodes first (query length 1), then prefill chunks."""

    decodes: list[ScheduledChunk]
    prefills: list[ScheduledChunk]
    num_preempted: int = 0

    @property
    def chunks(self) -> list[ScheduledChunk]:
        return self.decodes + self.prefills

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.decodes) + sum(c.num_tokens for c in self.prefills)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills


class Scheduler:
    """Two queues (waiting, running), a token budget, admission by free blocks.

    Args:
        block_pool: the KV block pool.
        block_size: tokens per block.
        max_num_seqs: most running sequences.
        max_num_batched_tokens: token budget per step.
        enable_chunked_prefill: if False a prompt must fit the budget in one step.
    """

    def __init__(self, block_pool: BlockPool, block_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int, enable_chunked_prefill: bool = True) -> None:
        self.pool = block_pool
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order, oldest first
        self.num_preemptions = 0

    # ------------------------------------------------------------ queues
    def add(self, seq: Sequence) -> None:
        """Queue a new sequence at the back of the waiting queue."""
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        """Mark a running sequence finished and free its blocks."""
        seq.status = SequenceStatus.FINISHED
        self.pool.free(seq.block_table)
        seq.block_table = []
        self.running.remove(seq)

    # ------------------------------------------------------------ blocks
    def _blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        total = seq.num_computed_tokens + num_tokens
        need = (total + self.block_size - 1) // self.block_size
        return max(0, need - len(seq.block_table))

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        n = self._blocks_needed(seq, num_tokens)
        if n > self.pool.num_free_blocks:
            return False
        if n:
            seq.block_table.extend(self.pool.allocate(n))
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.pool.free(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    # ------------------------------------------------------------ step
    def schedule(self) -> SchedulerOutput:
        """Pick this step's chunks.

        Returns:
            SchedulerOutput; empty only when nothing can run (the caller then
            checks for a request too large for the whole pool).
        """
        budget = self.max_num_batched_tokens
        decodes: list[ScheduledChunk] = []
        prefills: list[ScheduledChunk] = []
        preempted = 0
        scheduled: set[int] = set()

        # 1. running sequences: decodes first, then unfinished prefills
        order = [s for s in self.running if not s.is_prefill] + [s for s in self.running if s.is_prefill]
        for seq in order:
            if budget <= 0:
                break
            if seq.status != SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(seq.num_uncomputed_tokens, budget)
            while not self._grow(seq, n):
                victim = next((s for s in reversed(self.running) if s.seq_id not in scheduled), None)
                if victim is None:
                    break
                self._preempt(victim)
                preempted += 1
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING or self._blocks_needed(seq, n) > 0:
                continue
            chunk = ScheduledChunk(seq, n)
            (prefills if seq.is_prefill else decodes).append(chunk)
            scheduled.add(seq.seq_id)
            budget -= n

        # 2. admit waiting sequences while budget, seats and blocks allow
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            seq = self.waiting[0]
            n = seq.num_uncomputed_tokens
            if n > budget:
                if not self.enable_chunked_prefill:
                    break
                n = budget
            if not self._grow(seq, n):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chunk = ScheduledChunk(seq, n)
            (prefills if seq.is_prefill else decodes).append(chunk)
            scheduled.add(seq.seq_id)
            budget -= n
        return SchedulerOutput(decodes, prefills, preempted)

    def kv_utilization(self) -> float:
        """Used token slots / allocated slots of the blocks held by running sequences (1.0 = no waste)."""
        alloc = sum(len(s.block_table) for s in self.running) * self.block_size
        if alloc == 0:
            return 1.0
        used = sum(min(s.num_computed_tokens, len(s.block_table) * self.block_size) for s in self.running)
        return used / alloc
