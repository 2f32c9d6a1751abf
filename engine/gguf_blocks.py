"""GGUF's quantized blocks as codes, scales and mins: what the quantized layers are built from
(`engine.quant`) and how a GGUF file's tensors become fp32 when it is loaded (`engine.weights`).

`gguf_blocks_to_parts` maps each type of GGUF_MAPPING onto `QuantParts` (int8 codes, or int4 in
`engine.kernels.int4`'s packing, with an fp32 scale and min per group); `dequantize_codes` is
code x scale (+ min) per group, the arithmetic of `gguf.quants.dequantize`, so that
`dequantize_gguf` returns its values bit for bit. The block layouts are those of ggml's
`ggml-quants.c` and gguf-py's `gguf/quants.py`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from .kernels.int4 import pack_int4, unpack_int4

# GGUF type -> how it maps onto QuantLinear; "exact" means the stored blocks map 1:1
# (same codes, same fp16 scale/min values widened to fp32); all listed types
# reconstruct bit-exactly to gguf.quants.dequantize.
GGUF_MAPPING = {
    "Q8_0": "exact: int8 codes, scale per 32 (fp16 d -> fp32)",
    "Q4_0": "exact: int4 group 32, bytes copied; scale d, min -8d ((q-8)d == qd - 8d exactly)",
    "Q4_1": "exact: int4 group 32, bytes copied; scale d, min m",
    "Q5_0": "converted: 5-bit codes widened to signed int8 (q-16), group 32; scale d",
    "Q5_1": "converted: 5-bit codes widened to int8, group 32; scale d, min m",
    "Q4_K": "converted: int4 group 32 (nibbles re-packed); 6-bit sub-scales folded: s = d*sc, m = -dmin*mn",
    "Q5_K": "converted: 5-bit codes widened to int8, group 32; s = d*sc, m = -dmin*mn",
    "Q6_K": "converted: 6-bit codes widened to signed int8 (q-32), group 16; s = d*sc",
}


@dataclass
class QuantParts:
    """A quantized matrix before it becomes a layer (numpy, rows = output features)."""

    codes: np.ndarray  # int8 [out, in] (bits 8) or uint8 [out, in // 2] (bits 4)
    scale: np.ndarray  # float32 [out, in // gs]
    min: Optional[np.ndarray]
    bits: int
    group_size: int

    def unpacked(self) -> np.ndarray:
        if self.bits == 8:
            return self.codes
        return unpack_int4(torch.from_numpy(self.codes), self.group_size).numpy().astype(np.int8)

    def permute_rows(self, fn) -> "QuantParts":
        return QuantParts(fn(self.codes), fn(self.scale), None if self.min is None else fn(self.min),
                          self.bits, self.group_size)

    def pad_rows(self, rows: int) -> "QuantParts":
        """Zero rows appended up to `rows` (codes, scales and mins 0: they dequantize to 0), for a
        vocabulary shard padded to ceil(V / N) rows."""
        extra = rows - self.codes.shape[0]
        if extra <= 0:
            return self
        return self.permute_rows(lambda a: np.concatenate((a, np.zeros((extra, *a.shape[1:]), a.dtype))))


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def gguf_blocks_to_parts(data: np.ndarray, type_name: str, out: int, n_in: int) -> Optional[QuantParts]:
    """Map one GGUF tensor's raw blocks ([out, bytes per row] uint8) onto QuantParts.

    Returns None for types without a mapping (the caller keeps those in fp32).
    """
    if type_name == "Q8_0":
        b = data.reshape(out, n_in // 32, 34)
        return QuantParts(np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(out, n_in),
                          _f16(b[..., :2]).reshape(out, -1), None, 8, 32)
    if type_name in ("Q4_0", "Q4_1"):
        hdr = 2 if type_name == "Q4_0" else 4
        b = data.reshape(out, n_in // 32, hdr + 16)
        d = _f16(b[..., :2]).reshape(out, -1)
        m = -8.0 * d if type_name == "Q4_0" else _f16(b[..., 2:4]).reshape(out, -1)
        return QuantParts(np.ascontiguousarray(b[..., hdr:]).reshape(out, n_in // 2), d, m.astype(np.float32), 4, 32)
    if type_name in ("Q5_0", "Q5_1"):  # d (, m) fp16, qh: bit j = high bit of element j, qs: Q4_0's nibbles
        hdr = 2 if type_name == "Q5_0" else 4
        b = data.reshape(out, n_in // 32, hdr + 20)
        d = _f16(b[..., :2]).reshape(out, -1)
        qh = np.ascontiguousarray(b[..., hdr : hdr + 4]).view("<u4")  # [out, blocks, 1]
        qs = b[..., hdr + 4 :]
        q = np.concatenate((qs & 15, qs >> 4), axis=-1).astype(np.int8)
        q |= (((qh >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.int8)
        if type_name == "Q5_0":
            return QuantParts(q.reshape(out, n_in) - np.int8(16), d, None, 8, 32)
        return QuantParts(q.reshape(out, n_in), d, _f16(b[..., 2:4]).reshape(out, -1), 8, 32)
    if type_name in ("Q4_K", "Q5_K"):
        from gguf.quants import Q4_K

        size = 144 if type_name == "Q4_K" else 176
        b = data.reshape(-1, size)
        n = b.shape[0]
        d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
        sc, mn = Q4_K.get_scale_min(np.ascontiguousarray(b[:, 4:16]))
        s = (d * sc.astype(np.float32)).reshape(out, -1)
        m = -(dmin * mn.astype(np.float32)).reshape(out, -1)
        if type_name == "Q4_K":
            qs = b[:, 16:].reshape(n, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
            q = (qs & 15).reshape(out, n_in)
            return QuantParts(pack_int4(torch.from_numpy(q), 32).numpy(), s, m, 4, 32)
        qh, qs = b[:, 16:48], b[:, 48:]
        ql = (qs.reshape(n, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 15
        qh = (qh.reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
        q = (ql.reshape(n, 8, 32) | (qh << 4)).astype(np.int8).reshape(out, n_in)
        return QuantParts(q, s, m, 8, 32)
    if type_name == "Q6_K":
        b = data.reshape(-1, 210)
        n = b.shape[0]
        ql, qh, sc, d = b[:, :128], b[:, 128:192], b[:, 192:208], _f16(b[:, 208:210])
        s = (d * np.ascontiguousarray(sc).view(np.int8).astype(np.float32)).reshape(out, -1)
        ql = (ql.reshape(n, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 15
        qh = (qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
        q = (ql.reshape(n, 2, 4, 32) | (qh << 4)).astype(np.int8) - np.int8(32)
        return QuantParts(q.reshape(out, n_in), s, None, 8, 16)
    return None


def dequantize_codes(codes: torch.Tensor, scale: torch.Tensor, min: Optional[torch.Tensor], bits: int,
                     group_size: int, out: torch.Tensor) -> torch.Tensor:
    """code x scale (+ min) per group of `group_size` columns, in fp32, into `out`.

    Args:
        codes: int8 [rows, n] (bits 8) or uint8 [rows, n // 2] (bits 4, `pack_int4`'s layout).
        scale, min: float32 [rows, n // group_size]; min None for symmetric codes.
        out: a float32 buffer of at least rows x n elements.
    Returns:
        float32 [rows, n], a view of `out`.
    """
    rows, gs = codes.shape[0], group_size
    n = codes.shape[1] * (2 if bits == 4 else 1)
    w = out[: rows * n].view(rows, n // gs, gs)
    s = scale.unsqueeze(-1)
    if bits == 8:
        torch.mul(codes.view(rows, n // gs, gs), s, out=w)
    else:
        p = codes.view(rows, n // gs, gs // 2)
        torch.mul(p & 15, s, out=w[..., : gs // 2])
        torch.mul(p >> 4, s, out=w[..., gs // 2:])
    if min is not None:
        w.add_(min.unsqueeze(-1))
    return w.view(rows, n)


def dequantize_gguf(data: np.ndarray, type_name: str) -> Optional[np.ndarray]:
    """fp32 values of raw GGUF blocks, bit for bit what `gguf.quants.dequantize` returns, through
    `gguf_blocks_to_parts` and `dequantize_codes` (torch, several threads, no per-block Python
    loop): `data` is uint8 [..., bytes per row], the result float32 [..., values per row].

    Returns None for a type without a mapping in GGUF_MAPPING (the caller falls back to
    `gguf.quants.dequantize`) or for data that is not uint8 rows of whole blocks."""
    import gguf

    if type_name not in GGUF_MAPPING or data.dtype != np.uint8 or data.ndim < 2:
        return None
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    if data.shape[-1] % size:
        return None
    n_in = data.shape[-1] // size * block
    rows = math.prod(data.shape[:-1])
    p = gguf_blocks_to_parts(np.ascontiguousarray(data).reshape(rows, -1), type_name, rows, n_in)
    out = torch.empty(rows * n_in, dtype=torch.float32)
    w = dequantize_codes(torch.from_numpy(np.ascontiguousarray(p.codes)), torch.from_numpy(p.scale),
                         None if p.min is None else torch.from_numpy(p.min), p.bits, p.group_size, out)
    return w.numpy().reshape(*data.shape[:-1], n_in)
