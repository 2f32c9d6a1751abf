"""The paged KV cache: per-layer K/V tensors and the pool of fixed-size blocks.

All layers share one block numbering: block b of a sequence's block table
addresses rows b of every layer's cache. Block ownership is reference counted
so that a later prefix cache can share blocks between sequences.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from typing import Optional, Sequence

import torch

from .weights import ModelConfig


BlockKey = tuple  # (parent block's hash, token ids of the block)


def block_key(parent_hash: Optional[int], token_ids: Sequence[int]) -> BlockKey:
    """Prefix-cache key of a full block: chained over the parent block's hash, so equal
    keys mean equal token prefixes (the token tuple is compared exactly on lookup)."""
    return (parent_hash, tuple(token_ids))


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
    (`AttentionBackend.cache_shape`); a token's slot is block * block_size + offset.

    Args:
        cfg: model shape.
        num_blocks: blocks to allocate.
        block_size: tokens per block.
        dtype, device: storage dtype and device.
        shape: one layer's K (and V) shape.
    """

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, shape: tuple[int, ...]) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        # zeros, not empty: padded decode gathers read slot 0, which must be finite. On the CPU
        # in huge pages: decode reads a few blocks scattered over each layer's pool, and with
        # 4 KiB pages every block is a TLB miss (engine/kernels/cpu/memory.py)
        if torch.device(device).type == "cpu":
            from .kernels.cpu.memory import huge_zeros

            def zeros() -> torch.Tensor:
                return huge_zeros(tuple(shape), dtype)
        else:
            def zeros() -> torch.Tensor:
                return torch.zeros(shape, dtype=dtype, device=device)
        self.layers = [(zeros(), zeros()) for _ in range(cfg.num_layers)]
        slots = num_blocks * block_size
        self.slot_axis = 0 if shape[0] == slots else 1  # (slots, heads, dim) or (heads, slots, dim)

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy the K and V of blocks `src` into blocks `dst` (pairwise), in every layer."""
        bs = self.block_size
        dev = self.layers[0][0].device
        s = torch.tensor([b * bs + o for b in src for o in range(bs)], device=dev)
        d = torch.tensor([b * bs + o for b in dst for o in range(bs)], device=dev)
        for k, v in self.layers:
            for t in (k, v):
                t.index_copy_(self.slot_axis, d, t.index_select(self.slot_axis, s))

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """Bytes of one block over all layers, K and V."""
        return cfg.kv_bytes_per_token(torch.empty((), dtype=dtype).element_size()) * block_size
