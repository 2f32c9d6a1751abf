"""The KV cache manager (as vLLM v1's KVCacheManager): what the scheduler, scoring and step
profiling ask for KV blocks, between them and the `BlockPool`.

It keeps each sequence's block tables, one per layer group (`KVLayout`): `allocate_slots`,
`get_computed_blocks` (prefix-cache hits), `free`, `rollback`; scratch tables for passes outside
the scheduler (`allocate_scratch`); and the prefix cache's side for them (`want` / `unwant`,
`take_cached`, `register_block`), so no caller touches the pool itself.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from .kv_cache import NULL_BLOCK, BlockKey, BlockPool, KVLayout, chain_block_keys


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVGroup:
    """One block table of every sequence.

    Attributes:
        attr: the `Sequence` field that holds it ("block_table" or "window_table").
        block_tokens: tokens of one sequence per pool block.
        window: > 0: blocks whose tokens all lie at or before p - window (p the sequence's next
            query position) are given back to the pool.
        tag: prefix-cache keys of this group are (tag, block key); None: the block key itself.
    """

    attr: str
    block_tokens: int
    window: int
    tag: Optional[str]

    def key(self, key: BlockKey):
        return key if self.tag is None else (self.tag, key)


class KVCacheManager:
    """The scheduler's view of the KV cache: each sequence's block tables, one per layer group
    (`KVLayout`), drawn from one `BlockPool` (as vLLM v1's KVCacheManager and its hybrid
    coordinator, arXiv 2309.06180 for the paging).

    A sliding group gives a block back (placeholder `NULL_BLOCK` in the table) once every token
    in it is at a position <= p - window for the sequence's next query position p (the first
    query of its next chunk), so a long sequence holds at most ceil(window / block_size) + 1
    window blocks in a decode step.

    Prefix caching: the main group's full blocks are indexed under their block keys (`block_key`,
    of the last block_size block a pool block holds); the window group's under ("w", key). A
    cached prefix of T tokens is usable when the main group has all its blocks and a sliding
    group has the blocks of the window before the next query (vLLM's rule); the longest such T
    is taken, in whole main-group blocks.

    Args:
        pool: the block pool.
        layout: the layer groups.
    """

    def __init__(self, pool: BlockPool, layout: KVLayout) -> None:
        self.pool = pool
        self.layout = layout
        self.block_size = layout.block_size
        self.groups = [KVGroup("block_table", layout.main_block_tokens, layout.main_window, None)]
        if layout.hybrid:
            self.groups.append(KVGroup("window_table", layout.block_size, layout.window, "w"))

    @classmethod
    def full_attention(cls, pool: BlockPool, block_size: int) -> "KVCacheManager":
        """A manager of one full-attention group (a model without sliding-window layers)."""
        return cls(pool, KVLayout(block_size, 0, (), (), 0, 1, 0))

    def _tables(self, seq) -> list[tuple[KVGroup, list[int]]]:
        return [(g, getattr(seq, g.attr)) for g in self.groups]

    def max_tokens(self, chunk: int, limit: int) -> int:
        """The longest sequence (at most `limit` tokens) the whole pool holds (`KVLayout.max_tokens`)."""
        return self.layout.max_tokens(self.pool.num_blocks, chunk, limit)

    # ------------------------------------------------------------ the pool, for callers
    @property
    def num_blocks(self) -> int:
        """Blocks in the pool."""
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence or scratch table holds (idle cached ones included)."""
        return self.pool.num_free_blocks

    @property
    def enable_prefix_caching(self) -> bool:
        """Whether full blocks are indexed in the prefix cache."""
        return self.pool.enable_prefix_caching

    def want(self, keys: Sequence[BlockKey]) -> None:
        """A waiting sequence will read the cached blocks of `keys` (evicted last; `BlockPool.want`)."""
        self.pool.want(keys)

    def unwant(self, keys: Sequence[BlockKey]) -> None:
        """Undo one `want(keys)`."""
        self.pool.unwant(keys)

    def take_cached(self, keys: Sequence[BlockKey]) -> list[int]:
        """The cached blocks of the longest run of `keys` from the first, each with a reference taken
        (give them back with `free_blocks`); empty when the first is not cached."""
        out = []
        for key in keys:
            b = self.pool.lookup(key)
            if b is None:
                break
            self.pool.acquire(b)
            out.append(b)
        return out

    def allocate_blocks(self, n: int) -> list[int]:
        """n fresh blocks outside any sequence's tables (scoring's shared prefixes and tails).

        Raises:
            RuntimeError: the pool has fewer than n free blocks.
        """
        return self.pool.allocate(n)

    def register_block(self, block: int, key: BlockKey) -> None:
        """Index a computed full block under `key` in the prefix cache."""
        self.pool.register(block, key)

    def free_blocks(self, blocks: Sequence[int]) -> None:
        """Give back blocks of `allocate_blocks` or `take_cached` (cached ones stay indexed)."""
        self.pool.free(blocks)

    # ------------------------------------------------------------ allocation
    def num_blocks_needed(self, seq, num_tokens: int) -> int:
        """Pool blocks seq needs beyond its tables to hold `num_tokens` more tokens."""
        total = seq.num_computed_tokens + num_tokens
        return sum(max(0, _cdiv(total, g.block_tokens) - len(t)) for g, t in self._tables(seq))

    def free_behind_window(self, seq) -> int:
        """Give back the sliding groups' blocks of seq whose tokens all lie at positions
        <= p - window, p = seq.num_computed_tokens (its next query); returns how many."""
        p = seq.num_computed_tokens
        freed = 0
        for g, t in self._tables(seq):
            if g.window <= 0:
                continue
            upto = min(len(t), max(0, (p - g.window + 1) // g.block_tokens))
            drop = []
            i = upto - 1
            while i >= 0 and t[i] != NULL_BLOCK:  # freed blocks form a prefix of the table
                drop.append(t[i])
                t[i] = NULL_BLOCK
                i -= 1
            if drop:
                self.pool.free(drop)  # (freed oldest first: evicted first if cached)
                freed += len(drop)
        return freed

    def allocate_slots(self, seq, num_tokens: int) -> bool:
        """Free seq's blocks behind the window, then extend its tables to hold `num_tokens`
        more tokens. Returns False (tables not extended) when the pool lacks the blocks."""
        self.free_behind_window(seq)
        if self.num_blocks_needed(seq, num_tokens) > self.pool.num_free_blocks:
            return False
        total = seq.num_computed_tokens + num_tokens
        for g, t in self._tables(seq):
            n = _cdiv(total, g.block_tokens) - len(t)
            if n > 0:
                t.extend(self.pool.allocate(n))
        return True

    def free(self, seq) -> None:
        """Give back every block of seq (window group first: its blocks are evicted first)."""
        for g, t in reversed(self._tables(seq)):
            held = [b for b in t if b != NULL_BLOCK]
            if held:
                self.pool.free(held)
            setattr(seq, g.attr, [])

    def rollback(self, seq) -> None:
        """Free the blocks past seq's computed tokens (a verification's rejected drafts)."""
        for g, t in self._tables(seq):
            keep = _cdiv(seq.num_computed_tokens, g.block_tokens)
            if len(t) > keep:
                extra = [b for b in t[keep:] if b != NULL_BLOCK]
                del t[keep:]
                if extra:
                    self.pool.free(extra)

    def num_held_blocks(self, seq) -> list[int]:
        """Blocks seq holds now, per group (placeholders not counted)."""
        return [sum(1 for b in t if b != NULL_BLOCK) for _, t in self._tables(seq)]

    # ------------------------------------------------------------ scratch tables
    def scratch_blocks(self, num_tokens: int) -> int:
        """Pool blocks `allocate_scratch(num_tokens)` takes."""
        return sum(_cdiv(num_tokens, g.block_tokens) for g in self.groups)

    def allocate_scratch(self, num_tokens: int) -> tuple[list[int], Optional[list[int]]]:
        """(main table, window table or None) holding `num_tokens` tokens, nothing freed behind
        the window: scratch for a pass outside the scheduler (scoring, profiling), never
        prefix-cached. Give them back with `free_scratch`.

        Raises:
            RuntimeError: the pool lacks the blocks (nothing is taken).
        """
        need = self.scratch_blocks(num_tokens)
        if need > self.pool.num_free_blocks:
            raise RuntimeError(f"KV block pool exhausted: asked {need}, {self.pool.num_free_blocks} free")
        tables = [self.pool.allocate(_cdiv(num_tokens, g.block_tokens)) for g in self.groups]
        return tables[0], (tables[1] if len(tables) > 1 else None)

    def free_scratch(self, tables: tuple[list[int], Optional[list[int]]]) -> None:
        """Give back the tables of `allocate_scratch`."""
        for t in tables:
            if t:
                self.pool.free(t)

    # ------------------------------------------------------------ prefix cache
    def update_hashes(self, seq, upto: int) -> None:
        """Extend `seq.block_keys` with the keys of its full block_size blocks within the first `upto`
        tokens (`chain_block_keys`)."""
        keys = seq.block_keys
        keys.extend(chain_block_keys(seq.token_ids, self.block_size, upto // self.block_size, keys))

    def _window_span(self, g: KVGroup, t_eff: int) -> tuple[int, int]:
        """The blocks [lo, hi) of a sliding group that a next query at position t_eff reads from
        the cache (the tokens before it within the window)."""
        lo = max(0, (t_eff - g.window + 1) // g.block_tokens)
        return lo, _cdiv(t_eff, g.block_tokens)

    def get_computed_blocks(self, seq) -> int:
        """Point a fresh sequence's tables at the cached blocks of its longest usable cached
        prefix (taking a reference to each) and set its computed tokens. If every token is
        cached the last one is still recomputed, for the logits of the next sample. Returns the
        prefix length in block_size blocks (0: no hit, or prefix caching off)."""
        if seq.num_computed_tokens > 0 or not self.pool.enable_prefix_caching:
            return 0
        bs, n = self.block_size, len(seq.token_ids)
        self.update_hashes(seq, n)
        keys = seq.block_keys
        main = self.groups[0]
        r = main.block_tokens // bs
        hits: list[int] = []
        if main.window == 0:
            for i in range(len(keys) // r):
                b = self.pool.lookup(main.key(keys[(i + 1) * r - 1][1]))
                if b is None:
                    break
                hits.append(b)
            limit = len(hits) * r
        else:
            limit = len(keys)
        slide = next((g for g in self.groups if g.window > 0), None)
        found = limit
        cached: list[Optional[int]] = []
        if slide is not None and limit:
            cached = [self.pool.lookup(slide.key(keys[i][1])) for i in range(limit)]
            have = np.concatenate(([0], np.cumsum([b is not None for b in cached])))
            found = 0
            for t in range(limit, 0, -r):  # whole main-group blocks
                lo, hi = self._window_span(slide, min(t * bs, n - 1))
                if have[hi] - have[lo] == hi - lo:
                    found = t
                    break
        if found == 0:
            return 0
        t_eff = min(found * bs, n - 1)
        if main.window == 0:
            for b in hits[:found // r]:
                self.pool.acquire(b)
                seq.block_table.append(b)
        if slide is not None:
            table = getattr(seq, slide.attr)
            lo, hi = self._window_span(slide, t_eff)
            table.extend([NULL_BLOCK] * lo)
            for b in cached[lo:hi]:
                self.pool.acquire(b)
                table.append(b)
        seq.num_computed_tokens = t_eff
        return found

    def register_computed(self, seq) -> None:
        """Index seq's newly full, computed blocks of every group in the prefix cache (a main
        block once all its block_size blocks are computed); advances `seq.num_registered_blocks`
        (in block_size blocks)."""
        if not self.pool.enable_prefix_caching:
            return
        bs = self.block_size
        n_full = seq.num_computed_tokens // bs
        if n_full <= seq.num_registered_blocks:
            return
        self.update_hashes(seq, n_full * bs)
        tables = self._tables(seq)
        for b in range(seq.num_registered_blocks, n_full):
            key = seq.block_keys[b][1]
            for g, t in tables:
                r = g.block_tokens // bs
                if (b + 1) % r:
                    continue
                i = b // r
                if i < len(t) and t[i] != NULL_BLOCK:
                    self.pool.register(t[i], g.key(key))
        seq.num_registered_blocks = n_full
