"""The paged KV cache: per-layer K/V tensors, the pool of fixed-size blocks, and the
KV cache manager that gives each sequence one block table per layer group.

Layer groups (after vLLM's hybrid KV cache allocator): layers with full attention form
the main group; layers with a sliding window form the window group, whose blocks a
sequence gives back once every token in them has left the window (`KVLayout`). Both
groups draw from one `BlockPool`: a pool block is the same bytes in either group, so a
block a window group frees can be taken by the main group of another sequence.
Block ownership is reference counted so that the prefix cache can share blocks.
"""
from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from .model_config import ModelConfig


BlockKey = tuple  # (parent block's hash, token ids of the block)


def block_key(parent_hash: Optional[int], token_ids: Sequence[int]) -> BlockKey:
    """Prefix-cache key of a full block: chained over the parent block's hash, so equal
    keys mean equal token prefixes (the token tuple is compared exactly on lookup)."""
    return (parent_hash, tuple(token_ids))


NULL_BLOCK = -1  # a freed window block's place in a block table (its positions are never read again)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVLayout:
    """How a model's layers map onto KV groups, pool blocks and physical cache tensors.

    Attributes:
        block_size: tokens per page, the block every attention backend addresses.
        num_layers: the model's layers.
        main_layers: the main group (`Sequence.block_table`): the full-attention layers, or every
            layer when none has full attention (then the main group slides: `main_window` > 0).
        window_layers: the window group (`Sequence.window_table`) when full and sliding-window
            layers are mixed ("hybrid"), else empty.
        window: the sliding window in tokens of the sliding layers (the longest when they differ:
            one block table serves them all, each layer still masks to its own); 0: none slides.
        rows: pages per pool block in each physical tensor: ceil(S / F) when hybrid (F main, S
            window layers), else 1.
        num_tensors: physical K (and V) tensors: F when hybrid, else one per layer.

    Hybrid layouts (vLLM's hybrid allocator gives each group the same number of layers so
    that a block means the same bytes in every group; here one window table must serve every
    sliding layer, the one `AttentionMetadata.window_meta`, so the groups keep their sizes and
    the pool block is cut differently by each): the F physical tensors hold c * M pages each
    (c = rows, M pool blocks). Pool block x is the "column" of pages x, x + M, ..., x + (c-1) M
    of every tensor. The main group puts c consecutive pages of one sequence in a column
    (c * block_size tokens per pool block, page table `KVCache.main_pages`); the window group
    puts one page of tokens for all its layers in a column: window layer k reads row k // F of
    tensor k % F, a contiguous view whose page x lies in column x (`KVCache`). Either way a
    pool block is F * c pages of one layer (`pages_per_block`), so a block the window group
    frees is a whole block for the main group. Gemma 3 (3 full, 15 sliding layers): c = 5,
    a pool block is 80 tokens of the 3 full layers or 16 tokens of the 15 sliding ones.
    """

    block_size: int
    num_layers: int
    main_layers: tuple
    window_layers: tuple
    window: int
    rows: int
    num_tensors: int

    @property
    def hybrid(self) -> bool:
        """Full and sliding-window layers mixed: two groups, two block tables per sequence."""
        return bool(self.window_layers)

    @property
    def main_window(self) -> int:
        """The main group's window: 0 (full attention) unless every layer slides."""
        return 0 if self.hybrid else self.window

    @property
    def main_block_tokens(self) -> int:
        """Tokens of one sequence in one main-group pool block (rows pages)."""
        return self.rows * self.block_size

    @property
    def pages_per_block(self) -> int:
        """One layer's pages (block_size tokens of K and V) that make up one pool block's bytes."""
        return self.num_tensors * self.rows

    def layer_view(self, layer: int) -> tuple[int, Optional[int]]:
        """(physical tensor, row) of a layer's K/V cache; row None: the whole tensor."""
        if not self.hybrid:
            return layer, None
        if layer in self.main_layers:
            return self.main_layers.index(layer), None
        k = self.window_layers.index(layer)
        return k % self.num_tensors, k // self.num_tensors

    def peak_blocks(self, num_tokens: int, chunk: int) -> int:
        """Most pool blocks one sequence of `num_tokens` tokens holds at any step when no step
        runs more than `chunk` of its tokens (a chunk's first query still needs the window
        before it): ceil(n / main_block_tokens) for a full main group, plus for a sliding group
        min(ceil(n / bs), ceil((window - 1 + chunk) / bs) + 1)."""
        bs, n = self.block_size, num_tokens
        held = _cdiv(n, self.main_block_tokens) if self.main_window == 0 else 0
        if self.window:
            held += min(_cdiv(n, bs), _cdiv(self.window - 1 + min(chunk, n), bs) + 1)
        return held

    def max_tokens(self, num_blocks: int, chunk: int, limit: int) -> int:
        """The longest sequence, at most `limit` tokens, whose `peak_blocks` fit `num_blocks`
        (num_blocks * block_size for a model without sliding layers)."""
        lo, hi = 0, limit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.peak_blocks(mid, chunk) <= num_blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo


def kv_layout(cfg: ModelConfig, block_size: int) -> KVLayout:
    """The `KVLayout` of a model: one group when every layer has full attention or every layer
    slides (Mistral v0.1); a main and a window group when they are mixed."""
    n = cfg.num_layers
    wins = [cfg.window(i) for i in range(n)]
    full = tuple(i for i, w in enumerate(wins) if w <= 0)
    slide = tuple(i for i, w in enumerate(wins) if w > 0)
    if not slide:
        return KVLayout(block_size, n, full, (), 0, 1, n)
    if not full:
        return KVLayout(block_size, n, slide, (), max(wins), 1, n)
    return KVLayout(block_size, n, full, slide, max(wins), _cdiv(len(slide), len(full)), len(full))


def kv_bytes_per_sequence(cfg: ModelConfig, num_tokens: int, block_size: int = 16,
                          dtype_bytes: int = 2) -> tuple[int, int]:
    """K and V bytes one sequence of `num_tokens` tokens holds while its last token is computed
    (its query at position n - 1): (under `kv_layout`, window blocks behind the window given
    back; with every layer keeping every block). Pool blocks are whole (a partly filled one
    counts in full); `dtype_bytes` per element (2: an fp16 or bf16 cache; int8 scales not
    counted).

    Raises:
        ValueError: num_tokens < 1 or block_size < 1.
    """
    if num_tokens < 1 or block_size < 1:
        raise ValueError(f"num_tokens ({num_tokens}) and block_size ({block_size}) must be >= 1")
    lay = kv_layout(cfg, block_size)
    page = block_size * 2 * cfg.num_kv_heads * cfg.head_dim * dtype_bytes  # one layer, K and V
    n, bs = num_tokens, block_size
    blocks = _cdiv(n, lay.main_block_tokens) if lay.main_window == 0 else 0
    if lay.window:
        blocks += _cdiv(n, bs) - max(0, (n - lay.window) // bs)
    return blocks * lay.pages_per_block * page, _cdiv(n, bs) * cfg.num_layers * page


class BlockPool:
    """Free list, reference counts and the prefix-cache index of `num_blocks` KV blocks.

    A full block whose K/V are computed can be registered under its `block_key`;
    identical prefixes then map to the same physical block, shared by reference
    count. A registered block whose count falls to zero is not wiped: it stays
    in an LRU of idle cached blocks and is evicted (its key forgotten) only when
    a fresh block is needed and no never-cached block is free. (Automatic prefix
    caching as in vLLM; hash-chained block keys as in its design.)

    Eviction is told what is still wanted: the scheduler marks the block keys of
    every waiting sequence (`want` / `unwant`, counted). Idle cached blocks that
    no waiting sequence wants are evicted first, least recently used first;
    wanted ones only when nothing else is left. An offline engine sees its whole
    queue, so a prefix that later requests of the plan will read is kept over
    blocks nobody will read again (explicit prefix management instead of LRU
    alone, after BatchLLM, arXiv 2412.03594).

    Raises:
        RuntimeError: on allocating from an exhausted pool or freeing a free
            block (engine bugs, never user errors).
    """

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))  # idle, not in the cache index
        self.idle_cached: OrderedDict[int, None] = OrderedDict()  # idle, cached, unwanted; oldest use first
        self.idle_wanted: OrderedDict[int, None] = OrderedDict()  # idle, cached, wanted by a waiting sequence
        self.wanted: dict[BlockKey, int] = {}  # key -> number of waiting sequences that will read it
        self.cached: dict[BlockKey, int] = {}
        self.block_keys: list[Optional[BlockKey]] = [None] * num_blocks
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks not owned by any sequence (never-cached free blocks plus idle cached ones)."""
        return len(self.free_blocks) + len(self.idle_cached) + len(self.idle_wanted)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix-cache index (owned or idle)."""
        return len(self.cached)

    def allocate(self, n: int) -> list[int]:
        """Take `n` fresh blocks (ref count 1 each): never-cached free blocks first, then
        idle cached blocks no waiting sequence wants, then wanted ones (each least recently used first)."""
        if n > self.num_free_blocks:
            raise RuntimeError(f"KV block pool exhausted: asked {n}, {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            if self.free_blocks:
                b = self.free_blocks.popleft()
            else:
                lru = self.idle_cached if self.idle_cached else self.idle_wanted
                b, _ = lru.popitem(last=False)
                del self.cached[self.block_keys[b]]
                self.block_keys[b] = None
                self.num_evictions += 1
            self.ref_counts[b] = 1
            out.append(b)
        return out

    def lookup(self, key: BlockKey) -> Optional[int]:
        """The cached block holding `key`, or None."""
        return self.cached.get(key) if self.enable_prefix_caching else None

    def acquire(self, block: int) -> None:
        """Take one more reference to a cached block (reviving it if idle)."""
        if self.ref_counts[block] == 0:
            self._idle_list(block).pop(block)
        self.ref_counts[block] += 1

    def _idle_list(self, block: int) -> OrderedDict:
        return self.idle_wanted if self.wanted.get(self.block_keys[block], 0) > 0 else self.idle_cached

    def want(self, keys: Sequence[BlockKey]) -> None:
        """Count one more waiting sequence that will read the blocks of `keys`."""
        for key in keys:
            c = self.wanted.get(key, 0)
            self.wanted[key] = c + 1
            if c == 0:
                b = self.cached.get(key)
                if b is not None and b in self.idle_cached:
                    del self.idle_cached[b]
                    self.idle_wanted[b] = None

    def unwant(self, keys: Sequence[BlockKey]) -> None:
        """Undo one `want(keys)` (the sequence was admitted or dropped)."""
        for key in keys:
            c = self.wanted[key] - 1
            if c > 0:
                self.wanted[key] = c
                continue
            del self.wanted[key]
            b = self.cached.get(key)
            if b is not None and b in self.idle_wanted:
                del self.idle_wanted[b]
                self.idle_cached[b] = None

    def register(self, block: int, key: BlockKey) -> bool:
        """Index a full, computed block under `key`. Returns False if the key is
        already held by another block (the duplicate stays private)."""
        if not self.enable_prefix_caching or key in self.cached or self.block_keys[block] is not None:
            return False
        self.cached[key] = block
        self.block_keys[block] = key
        return True

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; at zero a cached block becomes idle-cached
        (most recently used), any other block returns to the free list."""
        for b in reversed(blocks):
            if self.ref_counts[b] <= 0:
                raise RuntimeError(f"double free of KV block {b}")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                if self.block_keys[b] is not None:
                    self._idle_list(b)[b] = None
                else:
                    self.free_blocks.append(b)


class KVCache:
    """K and V tensors of every layer, in the layout the attention backend chooses
    (`AttentionBackend.cache_shape`); a token's slot is page * block_size + offset.

    Without sliding-window layers (or with every layer sliding) each layer has its own
    tensors of `num_blocks` pages, page = pool block. A hybrid `KVLayout` has `num_tensors`
    physical tensors of rows * num_blocks pages; the main layers use them whole (pages from
    `main_pages`), window layer k the contiguous view of row k // F of tensor k % F (its own
    `num_blocks` pages, page x in pool block x). The views are contiguous in both layouts the
    backends use ([slots, heads, D] and [heads, slots, D]): row r is elements r * n .. (r+1) * n
    of the tensor, n = one view's elements.

    Args:
        cfg: model shape.
        num_blocks: pool blocks to allocate.
        block_size: tokens per page.
        dtype, device: storage dtype and device.
        shape: the K (and V) shape of `num_blocks` pages of one layer.
        layout: the layer groups; None: `kv_layout(cfg, block_size)`.
    """

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, shape: tuple[int, ...],
                 layout: Optional[KVLayout] = None) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.layout = layout if layout is not None else kv_layout(cfg, block_size)
        slots = num_blocks * block_size
        self.slot_axis = 0 if shape[0] == slots else 1  # (slots, heads, dim) or (heads, slots, dim)
        phys = list(shape)
        phys[self.slot_axis] *= self.layout.rows
        # zeros, not empty: padded decode gathers read slot 0, which must be finite. On the CPU
        # in huge pages: decode reads a few blocks scattered over each layer's pool, and with
        # 4 KiB pages every block is a TLB miss (engine/kernels/cpu/memory.py)
        if torch.device(device).type == "cpu":
            from .kernels.cpu.memory import huge_zeros

            def zeros() -> torch.Tensor:
                return huge_zeros(tuple(phys), dtype)
        else:
            def zeros() -> torch.Tensor:
                return torch.zeros(phys, dtype=dtype, device=device)
        self.tensors = [(zeros(), zeros()) for _ in range(self.layout.num_tensors)]
        n = math.prod(shape)

        def view(t: torch.Tensor, row: Optional[int]) -> torch.Tensor:
            return t if row is None else t.view(-1)[row * n:(row + 1) * n].view(tuple(shape))

        self.layers = []
        for i in range(cfg.num_layers):
            j, row = self.layout.layer_view(i)
            k, v = self.tensors[j]
            self.layers.append((view(k, row), view(v, row)))

    def main_pages(self, table) -> np.ndarray:
        """The page table ([n * rows] int64, what the backends address) of a main-group table of
        pool blocks: pool block x holds pages x, x + M, ..., x + (rows - 1) M (M = num_blocks).
        Placeholders (`NULL_BLOCK`) become page 0, never read (behind the window)."""
        t = np.asarray(table, dtype=np.int64)
        if self.layout.rows > 1:
            t = (t[:, None] + np.arange(self.layout.rows, dtype=np.int64) * self.num_blocks).reshape(-1)
        return np.maximum(t, 0)

    def window_pages(self, table) -> np.ndarray:
        """The page table of a window-group table (page x of each window view is pool block x);
        placeholders become page 0."""
        return np.maximum(np.asarray(table, dtype=np.int64), 0)

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy the K and V of pool blocks `src` into pool blocks `dst` (pairwise), every page of
        them in every physical tensor (so in every layer of either group)."""
        bs = self.block_size
        dev = self.tensors[0][0].device
        ps, pd = self.main_pages(src), self.main_pages(dst)
        s = torch.tensor([b * bs + o for b in ps.tolist() for o in range(bs)], device=dev)
        d = torch.tensor([b * bs + o for b in pd.tolist() for o in range(bs)], device=dev)
        for k, v in self.tensors:
            for t in (k, v):
                t.index_copy_(self.slot_axis, d, t.index_select(self.slot_axis, s))


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
        """Extend `seq.block_keys` with the keys of its full block_size blocks within the first `upto` tokens."""
        bs = self.block_size
        keys = seq.block_keys
        while (len(keys) + 1) * bs <= upto:
            i = len(keys)
            parent = keys[-1][0] if keys else None
            key = block_key(parent, seq.token_ids[i * bs:(i + 1) * bs])
            keys.append((hash(key), key))

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
