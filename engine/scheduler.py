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
from dataclasses import dataclass, field
from typing import Optional

from .kv_cache import BlockPool
from .kv_cache_manager import KVCacheManager
from .request import Sequence, SequenceStatus


@dataclass
class ScheduledChunk:
    """`num_tokens` tokens of `seq`, starting at `seq.num_computed_tokens`.

    A verification chunk also carries `draft`: speculative tokens after the sequence's last
    token, counted in `num_tokens` (1 + len(draft)); `proposer` names where they came from.
    """

    seq: Sequence
    num_tokens: int
    draft: list = field(default_factory=list)
    proposer: Optional[str] = None

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the sequence's last token, so a new token is sampled."""
        return self.seq.num_computed_tokens + self.num_tokens - len(self.draft) == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    """Chunks of one step, decodes first (query length 1), then prefill chunks."""

    decodes: list[ScheduledChunk]
    prefills: list[ScheduledChunk]

    @property
    def chunks(self) -> list[ScheduledChunk]:
        return self.decodes + self.prefills

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.decodes) + sum(c.num_tokens for c in self.prefills)

    @property
    def num_draft_tokens(self) -> int:
        return sum(len(c.draft) for c in self.decodes)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills


class Scheduler:
    """Two queues (waiting, running), a token budget, admission by free blocks.

    Blocks come from a `KVCacheManager` (one block table per layer group of each sequence;
    sliding-window groups give blocks back behind the window as the sequence advances).

    Args:
        kv: the KV cache manager, or a bare `BlockPool` (a model without sliding-window layers).
        block_size: tokens per block (block_size tokens is the prefix cache's block).
        max_num_seqs: most running sequences.
        max_num_batched_tokens: token budget per step.
        enable_chunked_prefill: if False a prompt must fit the budget in one step.
        spec: an `engine.spec_decode.SpecDecoder`, or None (no speculation). With one, the
            budget left after decodes and prefill chunks goes to drafts for decoding sequences.
    """

    def __init__(self, kv, block_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int, enable_chunked_prefill: bool = True, spec=None) -> None:
        if isinstance(kv, BlockPool):
            kv = KVCacheManager.full_attention(kv, block_size)
        self.kv: KVCacheManager = kv
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.spec = spec
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order, oldest first
        self.num_preemptions = 0
        # keys of full blocks that admitted sequences will compute but have not registered yet
        self.pending: dict = {}

    # ------------------------------------------------------------ queues
    def add(self, seq: Sequence) -> None:
        """Queue a new sequence at the back of the waiting queue (its full blocks become wanted)."""
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        self._want(seq)

    def remove_waiting(self, seq: Sequence) -> None:
        """Drop a waiting sequence (an aborted or failed request)."""
        self.waiting.remove(seq)
        self._unwant(seq)

    def pop_waiting(self) -> Sequence:
        """Take the head of the waiting queue."""
        seq = self.waiting.popleft()
        self._unwant(seq)
        return seq

    def clear_waiting(self) -> None:
        """Drop every waiting sequence."""
        while self.waiting:
            self.pop_waiting()

    def _want(self, seq: Sequence) -> None:
        """Tell the pool which cached blocks this waiting sequence will read, so
        eviction keeps them over blocks nobody waits for."""
        if self.kv.enable_prefix_caching:
            self._update_hashes(seq, seq.num_tokens)
            seq.num_wanted_blocks = len(seq.block_keys)
            self.kv.want([k for _, k in seq.block_keys])

    def _unwant(self, seq: Sequence) -> None:
        if seq.num_wanted_blocks:
            self.kv.unwant([k for _, k in seq.block_keys[:seq.num_wanted_blocks]])
            seq.num_wanted_blocks = 0

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        """Mark a running sequence finished and free its blocks."""
        seq.status = SequenceStatus.FINISHED
        self.kv.free(seq)
        self._drop_pending(seq)
        self.running.remove(seq)

    # ------------------------------------------------------------ blocks
    def _blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        return self.kv.num_blocks_needed(seq, num_tokens)

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.kv.allocate_slots(seq, num_tokens)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        self._drop_pending(seq)
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self._want(seq)
        self.num_preemptions += 1
        if self.spec is not None:
            self.spec.preempted(seq)

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
            hits = self._match_prefix(seq)
            if hits < len(seq.block_keys) and seq.block_keys[hits][1] in self.pending:
                # its next block is being computed by a running sequence: admit it next
                # step and read that block from the cache instead of computing it twice
                self._release_prefix(seq, hits)
                break
            n = seq.num_uncomputed_tokens
            if n > budget:
                if not self.enable_chunked_prefill:
                    self._release_prefix(seq, hits)
                    break
                n = budget
            if not self._grow(seq, n):
                self._release_prefix(seq, hits)
                break
            self.pop_waiting()
            self._add_pending(seq)
            if not seq.was_admitted:  # prompt tokens served from the cache, counted once
                seq.was_admitted = True
                seq.num_cached_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chunk = ScheduledChunk(seq, n)
            (prefills if seq.is_prefill else decodes).append(chunk)
            scheduled.add(seq.seq_id)
            budget -= n

        # 3. drafts for decoding sequences from what is left of the budget (speculation)
        if self.spec is not None and decodes:
            plain = [c for c in decodes if c.num_tokens == 1 and not c.seq.is_prefill]
            self.spec.attach_drafts(plain, budget, self.max_num_batched_tokens - budget, self._grow,
                                    queue_empty=not self.waiting)
        return SchedulerOutput(decodes, prefills)

    def rollback(self, seq: Sequence) -> None:
        """After a verification: free the blocks past the sequence's computed tokens (they held
        only drafts, never registered in the prefix cache)."""
        self.kv.rollback(seq)

    # ------------------------------------------------------------ prefix cache
    def _add_pending(self, seq: Sequence) -> None:
        """Mark the keys of the full blocks seq will compute as in flight."""
        if self.kv.enable_prefix_caching:
            seq.pending_range = (seq.num_registered_blocks, len(seq.block_keys))
            for _, key in seq.block_keys[seq.pending_range[0]:seq.pending_range[1]]:
                self.pending[key] = self.pending.get(key, 0) + 1

    def _drop_pending(self, seq: Sequence, upto: Optional[int] = None) -> None:
        """Forget seq's in-flight keys below block index `upto` (all if None)."""
        lo, hi = seq.pending_range
        stop = hi if upto is None else min(upto, hi)
        for _, key in seq.block_keys[lo:stop]:
            c = self.pending.get(key, 0) - 1
            if c <= 0:
                self.pending.pop(key, None)
            else:
                self.pending[key] = c
        seq.pending_range = (max(lo, stop), hi)

    def _match_prefix(self, seq: Sequence) -> int:
        """Point a fresh sequence's block tables at the cached blocks of its longest usable cached
        prefix (`KVCacheManager.get_computed_blocks`); returns the prefix in blocks."""
        return self.kv.get_computed_blocks(seq)

    def _release_prefix(self, seq: Sequence, hits: int) -> None:
        """Undo `_match_prefix` for a sequence that could not be admitted after all."""
        self.kv.free(seq)
        seq.num_computed_tokens = 0

    def _update_hashes(self, seq: Sequence, upto: int) -> None:
        """Extend `seq.block_keys` with the keys of its full blocks within the first `upto` tokens."""
        self.kv.update_hashes(seq, upto)

    def register_computed(self, seq: Sequence) -> None:
        """After a forward pass: index the sequence's newly full, computed blocks in the prefix cache."""
        before = seq.num_registered_blocks
        self.kv.register_computed(seq)
        if seq.num_registered_blocks > before:
            self._drop_pending(seq, seq.num_registered_blocks)

    def kv_utilization(self) -> float:
        """Used token slots / allocated slots of the blocks held by running sequences (1.0 = no waste)."""
        per = self.kv.groups[0].block_tokens  # the main group's tables
        alloc = sum(len(s.block_table) for s in self.running) * per
        if alloc == 0:
            return 1.0
        used = sum(min(s.num_computed_tokens, len(s.block_table) * per) for s in self.running)
        return used / alloc
