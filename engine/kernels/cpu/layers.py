"""Linear layers backed by the CPU kernel library, swapped in for `Linear` / `QuantLinear` at load time
(the swap itself: `engine.models.cpu_layers.use_cpu_kernels`).

Quantization and kernel choice are module swaps (as in gpt-fast): the model's
forward calls `layer(x, out=..., residual=...)` and never knows which layer it
holds. Every layer here keeps that contract:

    forward(x [T, in] float32, out: [T, out] or None, residual: [T, out] or None)
        residual given: residual += x W^T (+ b), returned (the residual add fused
        into the GEMM's store); else out (or a new tensor) = x W^T (+ b).

- `CpuLinear`: fp32 weights packed into panels (`gemm.c`).
- `CpuBf16Linear`: the same weights rounded to bf16 (VDPBF16PS where the CPU has AVX512-BF16);
  x is rounded to bf16 per call, the products are summed in fp32, and y (the residual stream
  it is added to included) stays fp32.
- `CpuQuantLinear`: the codes and scales of a `QuantLinear` (int8 per channel or per
  group, int4 / GGUF Q4_0 / Q4_1 / Q8_0 groups) packed; int8 codes are dequantized in
  registers, 4-bit codes multiply int8 activations (per token and group, quantized in the
  call) in integer arithmetic, as llama.cpp's Q4 x Q8 dot product.
- `W8A8Linear`: int8 weights per output channel times int8 activations per token
  (`gemm_i8.c`); built from float weights by `quantize_w8a8`.

A fused [gate | up] layer whose half width is a multiple of the panel width (`silu_fused`)
also serves `silu_mul(x, out)`: SwiGLU in its GEMM's epilogue, [T, inter] out, the [T, 2 inter]
product never written (`CpuLinear`, `CpuQuantLinear`; the C decoder driver applies the same rule).
"""
from __future__ import annotations

import ctypes
import threading
from typing import Optional

import torch
import torch.nn as nn

from . import (W8A8_GROUP, W_Q4, W_Q8, _lib, gemm_bf16, gemm_bf16_argmax, gemm_bf16_silu, gemm_f32,
               gemm_f32_argmax, gemm_f32_silu, gemm_q, gemm_q_argmax, gemm_q_error, gemm_q_silu, gemm_w8a8,
               pack_bf16, pack_f32, pack_q, pack_w8a8, quantize_act)

_F32 = torch.float32


def _silu_fusable(out_features: int, lib: Optional[ctypes.CDLL]) -> bool:
    """Whether a layer of `out_features` = 2 inter rows can take SwiGLU in its epilogue."""
    nr = _lib(lib).tm_gemm_nr()
    return out_features % 2 == 0 and (out_features // 2) % nr == 0


def _fast_ok(x: torch.Tensor, k: int, y: Optional[torch.Tensor], n: int) -> bool:
    """Whether x [m, k] and y [m, n] (or None) are what the kernels read as given (fp32 CPU
    rows with a contiguous last dim): the layers then call the C function directly; anything
    else goes through the checked wrappers, which raise a clear error."""
    if not (x.dtype is _F32 and x.is_cpu and x.dim() == 2 and x.shape[1] == k and x.stride(1) == 1):
        return False
    return y is None or (y.dtype is _F32 and y.is_cpu and y.dim() == 2 and y.shape[0] == x.shape[0]
                         and y.shape[1] == n and y.stride(1) == 1)


class _PanelLinear(nn.Module):
    """What `CpuLinear` and `CpuBf16Linear` share: a weight packed into panels by `_pack`, and the
    forward / silu_mul / argmax calls of its format (`_gemm`, `_silu`, `_argmax`, `_raw`: the checked
    wrappers and the raw C function of `engine.kernels.cpu`)."""

    _pack = _gemm = _silu = _argmax = None  # set by each subclass
    _raw = ""

    def _setup(self, weight: torch.Tensor, bias: Optional[torch.Tensor], lib: Optional[ctypes.CDLL]) -> None:
        self.lib = lib
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else nn.Parameter(bias.float().contiguous(), requires_grad=False)
        self.register_buffer("packed", type(self)._pack(weight, lib=lib), persistent=False)
        # the hot path's raw call: the packed panels are never replaced after construction
        self._call = (getattr(_lib(lib), self._raw), self.packed.data_ptr(),
                      None if self.bias is None else self.bias.data_ptr())
        self.silu_fused = _silu_fusable(self.out_features, lib)

    def forward(self, x: torch.Tensor, out: Optional[torch.Tensor] = None,
                residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        y = residual if residual is not None else out
        n, k = self.out_features, self.in_features
        if _fast_ok(x, k, y, n):
            m = x.shape[0]
            if y is None:
                y = torch.empty(m, n)
            fn, w, b = self._call
            if fn(x.data_ptr(), x.stride(0), w, b, y.data_ptr(), y.stride(0), m, n, k, residual is not None):
                raise ValueError(f"{self._raw} could not allocate its scratch ({m} x {k})")
            return y
        return type(self)._gemm(x, self.packed, n, self.bias, y, residual is not None, lib=self.lib)

    def silu_mul(self, x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """For a fused [gate | up] weight: silu(x Wg^T) * (x Wu^T), [T, out / 2] float32, in the GEMM's
        epilogue (`engine.kernels.cpu.gemm_f32_silu` / `gemm_bf16_silu`). Raises ValueError unless
        `silu_fused`."""
        if not self.silu_fused:
            raise ValueError(f"a layer of {self.out_features} outputs cannot fuse SwiGLU (half width not a "
                             f"multiple of {_lib(self.lib).tm_gemm_nr()})")
        return type(self)._silu(x, self.packed, self.out_features // 2, self.bias, out, lib=self.lib)

    def argmax(self, x: torch.Tensor, limit: Optional[int] = None, ban: Optional[torch.Tensor] = None
               ) -> torch.Tensor:
        """Greedy argmax of each row of x [T, in] W^T (+ b) without writing the logits: [T] int64
        (`engine.kernels.cpu.gemm_f32_argmax` / `gemm_bf16_argmax`: limit, ban as there)."""
        return type(self)._argmax(x.contiguous(), self.packed, self.out_features, self.bias, limit, ban,
                                  lib=self.lib)

    def weight_bytes(self) -> int:
        """Bytes read per forward pass: the packed panels (padding columns included) and the bias."""
        return self.packed.numel() + (0 if self.bias is None else self.bias.numel() * 4)


class CpuLinear(_PanelLinear):
    """fp32 linear layer over a packed copy of its weight.

    Args:
        weight: [out, in] float32 (kept, so the layer can be re-quantized or inspected).
        bias: [out] float32 or None.
        lib: a specific build (tests); default the native one.
    """

    _pack, _gemm, _silu, _argmax, _raw = pack_f32, gemm_f32, gemm_f32_silu, gemm_f32_argmax, "tm_gemm_f32"

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                 lib: Optional[ctypes.CDLL] = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.float().contiguous(), requires_grad=False)
        self._setup(self.weight.data, bias, lib)


class CpuBf16Linear(_PanelLinear):
    """Linear layer with bf16 weights and fp32 activations: x [T, in] float32 is rounded to bf16 in
    the call, the exact bf16 products are summed in fp32 (`engine.kernels.cpu.gemm_bf16_reference`
    is the definition), y [T, out] is float32.

    Args:
        weight: [out, in], any float dtype (rounded to bf16, nearest even).
        bias: [out] or None (kept in float32).
        lib: a specific build (tests); default the native one.
    """

    _pack, _gemm, _silu, _argmax, _raw = pack_bf16, gemm_bf16, gemm_bf16_silu, gemm_bf16_argmax, "tm_gemm_bf16"

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                 lib: Optional[ctypes.CDLL] = None) -> None:
        super().__init__()
        self._setup(weight, bias, lib)

    def dequantize(self) -> torch.Tensor:
        """The weight [out, in] as float32 (the bf16 values the kernel multiplies), from the packed panels."""
        nr = _lib(self.lib).tm_gemm_nr()
        kp, n, k = -(-self.in_features // 2), self.out_features, self.in_features
        panels = self.packed.view(torch.bfloat16).view(-1, kp, nr, 2)  # [panel, pair, column, 2]
        w = panels.permute(0, 2, 1, 3).reshape(-1, 2 * kp)[:n, :k]
        return w.float().contiguous()

    @property
    def weight(self) -> torch.Tensor:
        """The bf16 weight [out, in] (unpacked from the panels; for inspection and byte accounting)."""
        return self.dequantize().to(torch.bfloat16)


class CpuQuantLinear(nn.Module):
    """Weight-only quantized linear layer: a `QuantLinear`'s exact codes and scales, packed.

    Args:
        q: the `engine.quant.QuantLinear` to serve (its values are copied bit for bit).
        lib: a specific build (tests); default the native one.
    """

    def __init__(self, q: nn.Module, lib: Optional[ctypes.CDLL] = None) -> None:
        super().__init__()
        from ..int4 import unpack_int4

        self.lib = lib
        self.bits, self.group_size = q.bits, q.group_size
        self.in_features, self.out_features, self.padded_in = q.in_features, q.out_features, q.padded_in
        codes = q.weight if q.bits == 8 else unpack_int4(q.weight, q.group_size)
        self.has_min = q.min is not None
        self.register_buffer("packed", pack_q(codes, q.scale, q.min, q.bits, q.group_size, lib=lib),
                             persistent=False)
        self.bias = None if q.bias is None else nn.Parameter(q.bias.float().contiguous(), requires_grad=False)
        self.source = q  # the reference layer (dequantize(), byte accounting of the original layout)
        self._call = (_lib(lib).tm_gemm_q, W_Q8 if q.bits == 8 else W_Q4, int(self.has_min), self.packed.data_ptr(),
                      None if self.bias is None else self.bias.data_ptr())
        self.silu_fused = _silu_fusable(self.out_features, lib)

    @property
    def weight(self) -> torch.Tensor:
        """The stored codes (as `QuantLinear.weight`), for byte accounting."""
        return self.source.weight

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight [out, in] these codes represent."""
        return self.source.dequantize()

    def forward(self, x: torch.Tensor, out: Optional[torch.Tensor] = None,
                residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        y = residual if residual is not None else out
        n, k = self.out_features, self.in_features
        if _fast_ok(x, k, y, n):
            m = x.shape[0]
            if y is None:
                y = torch.empty(m, n)
            fn, kind, has_min, w, b = self._call
            rc = fn(kind, has_min, x.data_ptr(), x.stride(0), w, b, y.data_ptr(), y.stride(0), m, n, k,
                    self.padded_in, self.group_size, residual is not None)
            if rc:
                raise ValueError(gemm_q_error(rc, k, self.padded_in, self.group_size))
            return y
        return gemm_q(x, self.packed, n, self.padded_in, self.bits, self.group_size, self.has_min,
                      self.bias, y, residual is not None, lib=self.lib)

    def silu_mul(self, x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """For a fused [gate | up] layer: silu(x Wg^T) * (x Wu^T), [T, out / 2] float32, in the GEMM's
        epilogue (`engine.kernels.cpu.gemm_q_silu`). Raises ValueError unless `silu_fused`."""
        if not self.silu_fused:
            raise ValueError(f"a layer of {self.out_features} outputs cannot fuse SwiGLU (half width not a "
                             f"multiple of {_lib(self.lib).tm_gemm_nr()})")
        return gemm_q_silu(x, self.packed, self.out_features // 2, self.padded_in, self.bits, self.group_size,
                           self.has_min, self.bias, out, lib=self.lib)

    def argmax(self, x: torch.Tensor, limit: Optional[int] = None, ban: Optional[torch.Tensor] = None
               ) -> torch.Tensor:
        """Greedy argmax of each row of x [T, in] W^T (+ b) without writing the logits: [T] int64
        (`engine.kernels.cpu.gemm_q_argmax`: limit, ban as there)."""
        return gemm_q_argmax(x.contiguous(), self.packed, self.out_features, self.padded_in, self.bits,
                             self.group_size, self.has_min, self.bias, limit, ban, lib=self.lib)

    def weight_bytes(self) -> int:
        """Bytes read per forward pass (packed codes, scales, mins, bias)."""
        return self.packed.numel() + (0 if self.bias is None else self.bias.numel() * 4)


W8A8_WEIGHT_LEVELS = 63  # codes in [-63, 63]: within the kernels' [-64, 64] (gemm_i8.c's header)


def quantize_w8a8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel quantization of a weight [out, in] to codes in [-63, 63] held
    in int8: s = max|w_row| / 63, q = round(w / s). The 7-bit range lets AVX2's vpmaddubsw take
    the unsigned activation bytes without int16 saturation (see gemm_i8.c); measured on SmolLM2
    with SmoothQuant, perplexity +0.01% over fp32 against +0.23% with [-127, 127].

    Returns (q int8 [out, in], s float32 [out])."""
    w = w.float()
    s = (w.abs().amax(dim=1) / W8A8_WEIGHT_LEVELS).clamp_min(1e-12)
    q = torch.round(w / s[:, None]).clamp_(-W8A8_WEIGHT_LEVELS, W8A8_WEIGHT_LEVELS).to(torch.int8)
    return q.contiguous(), s


_tls = threading.local()


def _act_buffers(m: int, k: int, gs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-thread scratch for one layer's quantized activations ([m, kp] codes, [m, groups] scales),
    reused by every W8A8 layer of a step (they run one after another), grown when a step has more rows."""
    kp = -(-k // 4) * 4
    ng = -(-kp // gs)
    bufs = getattr(_tls, "bufs", None)
    if bufs is None:
        bufs = _tls.bufs = {}
    codes, scales = bufs.get((kp, ng), (None, None))
    if codes is None or codes.shape[0] < m:
        codes = torch.empty(max(m, 64), kp, dtype=torch.uint8)
        scales = torch.empty(max(m, 64), ng, dtype=torch.float32)
        bufs[(kp, ng)] = (codes, scales)
    return codes[:m], scales[:m]


class W8A8Linear(nn.Module):
    """int8 weights (per output channel) x int8 activations (per token and group of `group_size`
    input columns, quantized each step), exact int32 sums within a group.

    Args:
        q: int8 codes [out, in] in [-64, 64] (`quantize_w8a8`); scale: [out] float32 (w = q * scale).
        bias: [out] float32 or None.
        group_size: activation columns per scale (a multiple of 4).
        lib: a specific build (tests); default the native one.
    """

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor] = None,
                 group_size: int = W8A8_GROUP, lib: Optional[ctypes.CDLL] = None) -> None:
        super().__init__()
        self.lib = lib
        self.group_size = group_size
        if q.dim() != 2 or q.dtype != torch.int8:
            raise ValueError(f"q must be 2-D int8 codes [out, in], got {q.dtype} of shape {tuple(q.shape)}")
        self.out_features, self.in_features = q.shape
        self.register_buffer("weight", q.contiguous())
        self.register_buffer("scale", scale.float().contiguous())
        self.register_buffer("packed", pack_w8a8(self.weight, self.scale, group_size, lib=lib), persistent=False)
        lib_ = _lib(lib)
        self._call = (lib_.tm_quantize_act, lib_.tm_gemm_w8a8, self.packed.data_ptr())
        self.bias = None if bias is None else nn.Parameter(bias.float().contiguous(), requires_grad=False)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                   group_size: int = W8A8_GROUP, lib: Optional[ctypes.CDLL] = None) -> "W8A8Linear":
        """Quantize a float weight [out, in] per output channel (`quantize_w8a8`)."""
        q, s = quantize_w8a8(weight)
        return cls(q, s, bias, group_size, lib)

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight [out, in] the codes represent."""
        return self.weight.float() * self.scale[:, None]

    def forward(self, x: torch.Tensor, out: Optional[torch.Tensor] = None,
                residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        gs = self.group_size
        y = residual if residual is not None else out
        n, k = self.out_features, self.in_features
        codes, scales = _act_buffers(x.shape[0], k, gs)
        if _fast_ok(x, k, y, n):
            m = x.shape[0]
            if y is None:
                y = torch.empty(m, n)
            quant, gemm, w = self._call
            kp = codes.shape[1]
            quant(x.data_ptr(), x.stride(0), m, k, kp, gs, codes.data_ptr(), scales.data_ptr())
            gemm(codes.data_ptr(), scales.data_ptr(), kp, gs, w, None if self.bias is None else self.bias.data_ptr(),
                 y.data_ptr(), y.stride(0), m, n, residual is not None)
            return y
        codes, scales = quantize_act(x, gs, codes, scales, lib=self.lib)
        return gemm_w8a8(codes, scales, self.packed, n, gs, self.bias, y, residual is not None, lib=self.lib)

    def weight_bytes(self) -> int:
        """Bytes read per forward pass (packed codes, scales, column sums, bias)."""
        return self.packed.numel() + (0 if self.bias is None else self.bias.numel() * 4)
