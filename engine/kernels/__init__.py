"""Triton kernels for the hot small ops, each beside its PyTorch reference.

Run on CUDA; on the CPU they run only under Triton's interpreter
(`TRITON_INTERPRET=1` set before this package is imported), which the tests use.
"""
from .quant_gemm import quant_matmul, quant_matmul_ref
from .rmsnorm import fused_add_rms_norm, fused_add_rms_norm_ref
from .rope import rope_inplace, rope_inplace_ref

__all__ = ["fused_add_rms_norm", "fused_add_rms_norm_ref", "quant_matmul", "quant_matmul_ref", "rope_inplace",
           "rope_inplace_ref"]
