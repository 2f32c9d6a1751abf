"""Attention backends over the paged KV cache."""
from .base import AttentionBackend, AttentionMetadata
from . import cpu_kernel
from .torch_ref import TorchAttentionBackend

__all__ = ["AttentionBackend", "AttentionMetadata", "TorchAttentionBackend", "get_backend"]


def get_backend(name: str = "torch") -> AttentionBackend:
    """Return an attention backend by name ("torch": the PyTorch reference; "triton": the
    Triton kernels, imported only when asked for, so that TRITON_INTERPRET can be set first).

    Raises:
        ValueError: for an unknown name.
    """
    if name == "torch":
        return TorchAttentionBackend()
    if name == "triton":
        from .triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r} (available: torch, triton)")
