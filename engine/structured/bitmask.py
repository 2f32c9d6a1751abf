"""Token bitmasks: allocation and the vectorised apply to logits."""
from __future__ import annotations

import torch

_BITS = torch.arange(32, dtype=torch.int32)


def allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """An all-allowed bitmask [num_rows, ceil(vocab_size / 32)] int32 (every bit set, i.e. -1)."""
    return torch.full((num_rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, W] int32 bitmask -> [R, vocab_size] bool (True = allowed); ids past 32 * W are False.

    One shift-and-and over a [R, W, 32] view: no Python loop over rows or the vocabulary.
    """
    R, W = bitmask.shape
    bits = _BITS.to(bitmask.device)
    allowed = ((bitmask[:, :, None] >> bits) & 1).to(torch.bool).reshape(R, W * 32)
    if W * 32 >= vocab_size:
        return allowed[:, :vocab_size]
    pad = torch.zeros((R, vocab_size - W * 32), dtype=torch.bool, device=bitmask.device)
    return torch.cat((allowed, pad), dim=1)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set the logits of disallowed tokens to -inf, in place.

    Args:
        logits: [R, V] float (any device).
        bitmask: [R, W] int32 (moved to the logits' device); tokens at or past 32 * W are
            disallowed.
    Raises:
        ValueError: when the row counts differ.
    """
    if logits.shape[0] != bitmask.shape[0]:
        raise ValueError(f"logits have {logits.shape[0]} rows but the bitmask has {bitmask.shape[0]}")
    allowed = unpack_bitmask(bitmask.to(logits.device, non_blocking=True), logits.shape[1])
    logits.masked_fill_(~allowed, float("-inf"))
