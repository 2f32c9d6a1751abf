"""The small per-layer ops of the decoder, behind one seam with an implementation per device.

`LlamaModel.forward` is written once against this interface; what differs
between devices is only how each op runs:

- `TorchOps`: PyTorch ops, any device and dtype; the reference the tests compare to.
- `CpuOps`: tokenmill's C kernels (`engine.kernels.cpu`), fp32 on the CPU: one call per
  op, no temporaries, writing into the caller's buffers.
- `TritonOps`: the Triton kernels on CUDA (RMSNorm, in-place RoPE), host-sync free, so
  the same forward can be captured in a CUDA graph.

Each op's contract (shapes for a step of T tokens):
    rms_norm(x [T, H], w [H], eps, out [T, H] or None) -> x / sqrt(mean(x^2) + eps) * w
    rope_(q [T, Hq, D], k [T, Hkv, D], positions [T], cos, sin [P, D/2]) rotates q and k in place
    silu_mul(gu [T, 2I], out [T, I] or None) -> silu(gu[:, :I]) * gu[:, I:]
    gelu_tanh_mul(gu [T, 2I], out [T, I] or None) -> gelu_tanh(gu[:, :I]) * gu[:, I:] (GeGLU with
        the tanh approximation of GELU, Hendrycks & Gimpel 2016, arXiv 1606.08415)
    take_rows(table [V, H], idx [S] int64) -> table[idx] [S, H] (the embedding lookup and the
        LM head's row gather); IndexError for an index outside [0, V)
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def _gelu_tanh_mul(gu: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    i = gu.shape[1] // 2
    y = F.gelu(gu[:, :i], approximate="tanh") * gu[:, i:]
    return y if out is None else out.copy_(y)


class TorchOps:
    """PyTorch reference implementation (statistics in fp32 whatever the dtype)."""

    name = "torch"

    @staticmethod
    def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        xf = x.float()
        y = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
        if out is None:
            return y
        return out.copy_(y)

    @staticmethod
    def rope_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor) -> None:
        c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
        for x in (q, k):
            half = x.shape[-1] // 2
            x1, x2 = x[..., :half].float(), x[..., half:].float()
            rot = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)
            x.copy_(rot)

    @staticmethod
    def silu_mul(gu: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        g, u = gu.chunk(2, dim=-1)
        if out is None:
            return F.silu(g) * u
        return torch.mul(F.silu(g), u, out=out)

    gelu_tanh_mul = staticmethod(_gelu_tanh_mul)

    @staticmethod
    def take_rows(table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return F.embedding(idx, table)


class CpuOps:
    """The C kernels of `engine.kernels.cpu` (fp32, CPU). Tensors the kernels read as given (fp32
    CPU rows with a contiguous last dim) go straight to the C function; anything else through
    the library's checked wrappers, which raise a clear error."""

    name = "cpu"

    def __init__(self, lib=None) -> None:
        from ..kernels import cpu

        self.k = cpu
        self.lib = lib
        raw = cpu._lib(lib)
        self._norm, self._rope, self._silu = raw.tm_rms_norm, raw.tm_rope, raw.tm_silu_mul

    @staticmethod
    def _rows(t: torch.Tensor) -> bool:
        return t.dtype is torch.float32 and t.is_cpu and t.dim() == 2 and t.stride(1) == 1

    def rms_norm(self, x, w, eps, out=None):
        m, k = x.shape
        if self._rows(x) and w.is_contiguous() and w.numel() == k and (out is None or (
                self._rows(out) and out.shape[0] == m and out.shape[1] == k)):
            y = torch.empty(m, k) if out is None else out
            self._norm(x.data_ptr(), x.stride(0), w.data_ptr(), y.data_ptr(), y.stride(0), m, k, eps)
            return y
        return self.k.rms_norm(x, w, eps, out, lib=self.lib)

    def rope_(self, q, k, positions, cos, sin):
        t, hq, d = q.shape
        hkv = k.shape[1]
        # q and k heads side by side in one fused qkv row: one pass over both
        # (one token: the row stride is never used, and torch may report any value for it)
        if (k.data_ptr() == q.data_ptr() + hq * d * q.element_size() and (t == 1 or q.stride(0) == k.stride(0))
                and q.stride(1) == d and k.stride(1) == d and q.stride(2) == 1 and q.dtype is torch.float32
                and positions.dtype is torch.int64 and positions.is_contiguous() and cos.dtype is torch.float32
                and cos.is_contiguous() and sin.is_contiguous()):
            self._rope(q.data_ptr(), q.stride(0), t, hq + hkv, d, positions.data_ptr(), cos.data_ptr(), sin.data_ptr())
            return
        for x in (q, k):
            self.k.rope_(x.reshape(t, -1), x.shape[1], d, positions, cos, sin, lib=self.lib)

    def silu_mul(self, gu, out=None):
        m, n2 = gu.shape
        if self._rows(gu) and (out is None or (self._rows(out) and out.shape[0] == m and out.shape[1] == n2 // 2)):
            y = torch.empty(m, n2 // 2) if out is None else out
            self._silu(gu.data_ptr(), gu.stride(0), y.data_ptr(), y.stride(0), m, n2 // 2)
            return y
        return self.k.silu_mul(gu, out, lib=self.lib)

    gelu_tanh_mul = staticmethod(_gelu_tanh_mul)

    @staticmethod
    def take_rows(table, idx):
        """table[idx] with numpy on the calling thread. Measured on a 2-core Xeon, 64 rows of
        SmolLM2's embedding: 27 against 78 microseconds for F.embedding alone, and in the
        engine's batch-64 decode steps the lookup went from 0.29 to 0.12 ms (line timings; both
        pay there for caches the layers just filled with weights)."""
        if table.is_cpu and idx.is_cpu and table.dim() == 2 and idx.dim() == 1 and idx.dtype is torch.int64 \
                and table.dtype in (torch.float32, torch.float16) and table.is_contiguous():
            ix = idx.numpy()
            if not ix.size:
                return table.new_empty((0, table.shape[1]))
            if ix.min() < 0 or ix.max() >= table.shape[0]:
                bad = int(ix[(ix < 0) | (ix >= table.shape[0])][0])
                raise IndexError(f"row index {bad} is outside the table's {table.shape[0]} rows")
            return torch.from_numpy(table.numpy().take(ix, axis=0))
        return F.embedding(idx, table)


class TritonOps(TorchOps):
    """Triton RMSNorm and RoPE on CUDA (SiLU x up stays a PyTorch op)."""

    name = "triton"

    @staticmethod
    def rms_norm(x, w, eps, out=None):
        from ..kernels import fused_add_rms_norm

        return fused_add_rms_norm(x, w, eps)  # its own output buffer; `out` is only a hint here

    @staticmethod
    def rope_(q, k, positions, cos, sin):
        from ..kernels import rope_inplace

        rope_inplace(q, k, cos, sin, positions)


def select_ops(device: torch.device, dtype: torch.dtype, prefer: str = "auto"):
    """The ops for a model: "auto" picks CpuOps (fp32 CPU, library available), TritonOps (CUDA) or TorchOps.

    Raises:
        ValueError: for an unknown `prefer`, or "cpu" where the library cannot serve.
    """
    if prefer == "torch":
        return TorchOps()
    if prefer == "triton":
        return TritonOps()
    if prefer not in ("auto", "cpu"):
        raise ValueError(f"unknown ops {prefer!r} (auto, cpu, triton, torch)")
    if device.type == "cpu" and dtype == torch.float32:
        from ..kernels import cpu

        if cpu.available():
            return CpuOps()
    if prefer == "cpu":
        raise ValueError("the CPU kernels need fp32 on the CPU and a C compiler")
    if device.type == "cuda":
        return TritonOps()
    return TorchOps()
