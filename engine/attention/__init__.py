"""Attention backends over the paged KV cache."""
from .base import AttentionBackend, AttentionMetadata
from .torch_ref import TorchAttentionBackend

__all__ = ["AttentionBackend", "AttentionMetadata", "TorchAttentionBackend", "get_backend"]


def get_backend(name: str = "torch") -> AttentionBackend:
    """Return an attention backend by name ("torch": the PyTorch reference).

    Raises:
        ValueError: for an unknown name.
    """
    if name == "torch":
        return TorchAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r} (available: torch)")
