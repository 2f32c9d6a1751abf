"""The paged KV cache: per-layer K/V tensors and the pool of fixed-size blocks.

All layers share one block numbering: block b of a sequence's block table
addresses rows b of every layer's cache. Block ownership is reference counted
so that a later prefix cache can share blocks between sequences.
"""
from __future__ import annotations

from collections import deque

import torch

from .weights import ModelConfig


class BlockPool:
    """Free list and reference counts of `num_blocks` KV blocks.

    Raises:
        RuntimeError: on allocating from an empty pool or freeing a free block
            (both are engine bugs, never user errors).
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        """Blocks not owned by any sequence."""
        return len(self.free_blocks)

    def allocate(self, n: int) -> list[int]:
        """Take `n` free blocks (ref count 1 each)."""
        if n > len(self.free_blocks):
            raise RuntimeError(f"KV block pool exhausted: asked {n}, {len(self.free_blocks)} free")
        out = [self.free_blocks.popleft() for _ in range(n)]
        for b in out:
            self.ref_counts[b] = 1
        return out

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; blocks reaching zero return to the free list."""
        for b in reversed(blocks):
            if self.ref_counts[b] <= 0:
                raise RuntimeError(f"double free of KV block {b}")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free_blocks.append(b)


class KVCache:
    """K and V tensors of every layer, each [num_blocks, block_size, num_kv_heads, head_dim].

    Args:
        cfg: model shape.
        num_blocks: blocks to allocate.
        block_size: tokens per block.
        dtype, device: storage dtype and device.
    """

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        # zeros, not empty: padded decode gathers read slot 0, which must be finite
        self.layers = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(cfg.num_layers)
        ]

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """Bytes of one block over all layers, K and V."""
        return cfg.kv_bytes_per_token(torch.empty((), dtype=dtype).element_size()) * block_size
