"""Kernels for the hot ops, each beside its PyTorch reference.

- `engine.kernels.cpu`: tokenmill's C kernel library for the CPU (packed and quantized
  GEMMs, W8A8, the small per-layer ops, paged decode attention), built on first use.
- The Triton kernels (`quant_gemm`, `rmsnorm`, `rope`) run on CUDA; on the CPU only
  under Triton's interpreter (`TRITON_INTERPRET=1` set before they are imported),
  which the tests use. They are imported lazily, so that using the CPU library never
  imports Triton.
"""
from __future__ import annotations

import importlib

_LAZY = {
    "quant_matmul": "quant_gemm", "quant_matmul_ref": "quant_gemm",
    "fused_add_rms_norm": "rmsnorm", "fused_add_rms_norm_ref": "rmsnorm",
    "rope_inplace": "rope", "rope_inplace_ref": "rope",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
