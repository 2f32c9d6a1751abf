"""The paged KV cache: per-layer K/V tensors, the pool of fixed-size blocks and the block keys
of its prefix cache (the manager that gives each sequence one block table per layer group is
`engine.kv_cache_manager.KVCacheManager`).

Layer groups (after vLLM's hybrid KV cache allocator): layers with full attention form
the main group; layers with a sliding window form the window group, whose blocks a
sequence gives back once every token in them has left the window (`KVLayout`). Both
groups draw from one `BlockPool`: a pool block is the same bytes in either group, so a
block a window group frees can be taken by the main group of another sequence.
Block ownership is reference counted so that the prefix cache can share blocks.
"""
from __future__ import annotations

import functools
import math
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from .model_config import ModelConfig


BlockKey = tuple  # (parent block's hash, token ids of the block)


_MASK = (1 << 64) - 1
_P = 0x9E3779B97F4A7C15  # odd: invertible mod 2**64
_P_INV = pow(_P, -1, 1 << 64)


@functools.lru_cache(maxsize=8)
def _token_weights(block_size: int) -> np.ndarray:
    """Fixed odd 64-bit weights per token position of a block (a fixed seed: the same hashes in
    every process), uint64 [block_size]."""
    w = np.random.default_rng(20241203).integers(1, 1 << 63, size=block_size, dtype=np.uint64)
    return w * np.uint64(2) + np.uint64(1)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser (Steele et al. 2014), elementwise on uint64 (wraps mod 2**64)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def block_hashes(rows: Sequence[Sequence[int]], block_size: int) -> list[np.ndarray]:
    """The chained hash of every full block of each row: uint64 [len(row) // block_size] per row.

    H_k = H_{k-1} * P + mix(sum_i t_i * w_i) (mod 2**64), H_{-1} = 0, over the block's token ids
    t and fixed odd weights w: a polynomial hash of mixed block hashes, so equal hashes mean
    equal prefixes up to 64-bit collisions. All rows at once (H_k = P**k * sum_{j<=k} b_j * P**-j,
    a cumulative sum): the planner hashes whole datasets with it, and the engine's
    `chain_block_keys` extends one sequence a block at a time with the same values.
    """
    bs = block_size
    counts = np.fromiter((len(r) // bs for r in rows), dtype=np.int64, count=len(rows))
    out = [np.zeros(0, np.uint64)] * len(rows)
    full = [i for i, n in enumerate(counts.tolist()) if n]
    if not full:
        return out
    flat = np.concatenate([np.asarray(rows[i][:counts[i] * bs], dtype=np.int64) for i in full])
    b = _mix((flat.reshape(-1, bs).astype(np.uint64) * _token_weights(bs)).sum(axis=1, dtype=np.uint64))
    n = counts[full]
    start = np.repeat(np.cumsum(n) - n, n)  # per block: index of its row's first block
    local = np.arange(len(b), dtype=np.int64) - start
    kmax = int(n.max())
    pows = np.empty(kmax, dtype=np.uint64)
    invs = np.empty(kmax, dtype=np.uint64)
    p = q = 1
    for k in range(kmax):
        pows[k], invs[k] = p, q
        p, q = (p * _P) & _MASK, (q * _P_INV) & _MASK
    c = np.cumsum(b * invs[local], dtype=np.uint64)
    before = np.where(start > 0, c[np.maximum(start - 1, 0)], np.uint64(0))
    h = (c - before) * pows[local]
    for i, (lo, k) in zip(full, zip((np.cumsum(n) - n).tolist(), n.tolist())):
        out[i] = h[lo:lo + k]
    return out


def block_key(parent_hash: Optional[int], token_ids: Sequence[int]) -> BlockKey:
    """Prefix-cache key of a full block: chained over the parent block's hash, so equal
    keys mean equal token prefixes (the token tuple is compared exactly on lookup)."""
    return (parent_hash, tuple(token_ids))


def chain_block_keys(token_ids: Sequence[int], block_size: int, num_blocks: int,
                     known: Sequence[tuple[int, BlockKey]] = ()) -> list[tuple[int, BlockKey]]:
    """(hash, key) of full blocks len(known) .. num_blocks - 1 of `token_ids`: the hash is the
    block's `block_hashes` value (what the planner groups rows by), the key (`block_key`) is
    chained on the previous block's hash. The one rule by which the scheduler, scoring, the
    prefix cache and the job's planner name a block. `known` holds the pairs of the blocks
    before (continued, not returned); the token ids must cover num_blocks * block_size tokens."""
    lo = len(known)
    if num_blocks <= lo:
        return []
    bs = block_size
    parent = known[-1][0] if known else 0
    w = _token_weights(bs)
    blocks = np.asarray(token_ids[lo * bs:num_blocks * bs], dtype=np.int64).reshape(-1, bs).astype(np.uint64)
    mixed = _mix((blocks * w).sum(axis=1, dtype=np.uint64)).tolist()
    out = []
    for i, b in enumerate(mixed):
        h = (parent * _P + b) & _MASK
        out.append((h, block_key(parent if lo + i else None, token_ids[(lo + i) * bs:(lo + i + 1) * bs])))
        parent = h
    return out


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
        # 4 KiB pages every block is a TLB miss (engine/kernels/cpu/memory.py). Not populated: a
        # page is faulted in when a block on it is first written, so a job that uses a small part
        # of the default budget does not pay to fault in the rest at start-up
        if torch.device(device).type == "cpu":
            from .kernels.cpu.memory import huge_zeros

            def zeros() -> torch.Tensor:
                return huge_zeros(tuple(phys), dtype, populate=False)
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
