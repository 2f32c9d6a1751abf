"""The attention backend interface: one step's metadata and the paged-KV attention call."""
from __future__ import annotations

import operator
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class AttentionMetadata:
    """Per-step description of the flattened ("varlen") token batch, shared by all layers.

    Tokens are laid out decode tokens first (one per decoding sequence), then
    the prefill chunks, each contiguous.

    Attributes:
        slot_mapping: [T] int64, cache slot (block * block_size + offset) of each new token.
        num_decode_tokens: Bd, the first Bd tokens are decodes (query length 1).
        decode_seq_lens: [Bd] int64, KV length of each decoding sequence (including its new token).
        decode_block_tables: [Bd, max_blocks] int32, padded with 0.
        prefill_query_starts / prefill_query_lens / prefill_seq_lens: python lists,
            per prefill chunk: offset in the flattened batch, chunk length, KV
            length after the chunk (tokens already cached + chunk).
        prefill_block_tables: python list of [num_blocks] int64 tensors.
        block_size: tokens per KV block.
    """

    slot_mapping: torch.Tensor
    num_decode_tokens: int
    decode_seq_lens: torch.Tensor
    decode_block_tables: torch.Tensor
    prefill_query_starts: list[int]
    prefill_query_lens: list[int]
    prefill_seq_lens: list[int]
    prefill_block_tables: list[torch.Tensor]
    block_size: int
    # Filled by a backend's `prepare` and reused by every layer of the step.
    cache: Optional[dict] = None
    # The sliding-window layers' own metadata (their block tables and slot mapping, from the
    # KV cache manager's sliding-window group), or None when they share this one.
    window_meta: Optional["AttentionMetadata"] = None


def check_window(window) -> int:
    """`window` as an int, validated: a sliding window of >= 0 tokens (0: full attention).

    Raises:
        ValueError: a negative or non-integer window.
    """
    try:
        w = operator.index(window)  # int, numpy integers
    except TypeError:
        w = -1
    if isinstance(window, bool) or w < 0:
        raise ValueError(f"window must be an int >= 0 (tokens; 0: full attention), got {window!r}")
    return w


class AttentionBackend(ABC):
    """Computes attention of a varlen batch against a paged KV cache.

    Each backend chooses its KV cache layout (`cache_shape`); a token's slot
    is block * block_size + offset in every layout.
    """

    @abstractmethod
    def cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """Shape of one layer's K (and V) cache tensor."""

    @abstractmethod
    def prepare(self, meta: AttentionMetadata) -> None:
        """Precompute, once per step, whatever all layers reuse (gather indices, masks)."""

    def fused_decoder_plan(self, q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata):
        """Whether the CPU C decoder (`engine.kernels.cpu.decoder`), which runs a step's layers and
        their attention in C, may stand in for this backend's `forward` on this step: the kernel's
        plan it takes (block tables, row -> sequence, KV lengths, tiles), or None where it may not.
        None here: a backend whose attention the C kernel does not compute.

        Args:
            q: [T, num_heads, head_dim], the step's queries (their dtype and layout).
            k_cache: layer 0's K cache (its dtype: the row format the kernel reads).
            meta: the step's attention metadata (already `prepare`d).
        """
        return None

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: Optional[torch.Tensor] = None,
        window: int = 0,
    ) -> torch.Tensor:
        """Write k, v into the cache at `meta.slot_mapping`, then attend.

        Args:
            q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] (may be strided
                views into one fused qkv buffer).
            out: optional [T, num_heads, head_dim] destination (the result is written there).
            window: sliding-window length in tokens: a query at position p attends only keys at
                positions p - window < j <= p (Beltagy et al. 2020, arXiv 2004.05150; Mistral,
                Gemma 3); 0: every key up to p.
        Returns:
            [T, num_heads, head_dim] (`out` when given), causal attention of each token over
            its sequence's cached prefix and the new tokens up to itself.
        """
