"""Weight-only quantized linear layers: int8, int4, and a GGUF file's own blocks (read by
`engine.gguf_blocks`).

One representation serves every scheme: integer codes q, a scale s and an
optional min m per group of `group_size` consecutive input columns of a row,

    w[o, i] = q[o, i] * s[o, i // gs] (+ m[o, i // gs])        (fp32 arithmetic)

- `bits=8`: q is int8 [out, in] (signed, or unsigned values < 128).
- `bits=4`: q in 0..15, packed two per byte [out, in // 2]. Within each group,
  byte j holds element j (low nibble) and element j + gs/2 (high nibble): the
  byte layout of GGUF's Q4_0/Q4_1 blocks, so those blocks are copied as they are.

Schemes (`quantize_model`):
- "int8": per-output-channel symmetric, s = max|w_row| / 127, q = round(w / s).
  The LM head stays in float (for a tied head: the embedding table itself), as
  vLLM leaves `lm_head` unquantized for most weight-only schemes. Measured
  (`python -m benchmarks.int8_diagnosis`, benchmarks/results/epyc-zen5-avx512bf16/int8_diagnosis.txt):
  an int8 copy of SmolLM2's 49152 x 576 head alone costs 2.6 points of
  teacher-forced greedy agreement with fp32 (100 -> 97.4%), the whole int8 body
  4.4 (-> 95.6%), both 6.1 (-> 93.9%, under the 95% target); every miss is a
  near tie (fp32's top-2 logit margin < 1). A per-row scale minimising the
  weight MSE instead of absmax / 127 leaves the head's relative error at 1.17%.
- "int4": group-wise asymmetric (group 32/64/128), s = (max - min) / 15,
  m = min, q = round((w - m) / s) clamped to 0..15; the LM head too.
- "gguf": `load_gguf_linears` keeps the file's own blocks (see `GGUF_MAPPING`).

CPU kernel (CUDA inputs go to the Triton kernel `engine.kernels.quant_gemm`):
dequantize a tile of output rows into an fp32 buffer, then one fp32 matmul per tile. PyTorch's packed kernels
(`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`) run far below an fp32 matmul
on AVX2 CPUs (`python -m benchmarks.quality --kernels` measures both).
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from .kernels.int4 import pack_int4, unpack_int4  # noqa: F401 - the layers' packing (re-exported)
from .gguf_blocks import GGUF_MAPPING, QuantParts, dequantize_codes, gguf_blocks_to_parts  # noqa: F401 - re-exported

INT4_GROUP_SIZES = (32, 64, 128)


# ---------------------------------------------------------------- the layer

class QuantLinear(nn.Module):
    """Weight-only quantized drop-in for `models.llama.Linear` (same forward contract).

    Args:
        codes: int8 [out, in] (bits=8) or uint8 packed [out, in // 2] (bits=4).
        scale: fp32 [out, in // group_size].
        min: fp32 [out, in // group_size] or None (symmetric).
        bits: 8 or 4.
        group_size: input columns per scale; equal to `in` for per-channel.
        bias: [out] or None, in the activation dtype.
        dtype: dtype of the dequantized tile and of the output.
    Shapes: x [T, in] -> y [T, out].

    `weight` is the stored code tensor (so byte accounting that reads
    `layer.weight` sees the packed tensor), never a float matrix; use `dequantize()`.
    """

    # output rows per tile: small batches keep the fp32 tile in L2 (decode is
    # bandwidth-bound), large ones amortise the matmul call over a bigger tile
    SMALL_TILE_ELEMS = 1 << 17  # 512 KiB fp32
    LARGE_TILE_ELEMS = 1 << 22  # 16 MiB fp32
    SMALL_M = 32

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, min: Optional[torch.Tensor], bits: int,
                 group_size: int, bias: Optional[torch.Tensor] = None, dtype: torch.dtype = torch.float32,
                 in_features: Optional[int] = None) -> None:
        super().__init__()
        if bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {bits}")
        self.bits = bits
        self.group_size = group_size
        self.out_features = codes.shape[0]
        # stored columns: in_features rounded up to a whole group (padding codes are 0)
        self.padded_in = codes.shape[1] * (2 if bits == 4 else 1)
        self.in_features = in_features or self.padded_in
        if self.padded_in % group_size or not 0 <= self.padded_in - self.in_features < group_size:
            raise ValueError(f"stored width {self.padded_in} is not in_features {self.in_features} "
                             f"rounded up to a multiple of group_size {group_size}")
        if scale.shape != (self.out_features, self.padded_in // group_size):
            raise ValueError(f"scale shape {tuple(scale.shape)} does not match codes {tuple(codes.shape)}")
        self.dtype = dtype
        self.register_buffer("weight", codes.contiguous())
        self.register_buffer("scale", scale.float().contiguous())
        self.register_buffer("min", None if min is None else min.float().contiguous())
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    # ---------------------------------------------------------- dequantize
    def _dequant_rows(self, r0: int, r1: int, out: torch.Tensor) -> torch.Tensor:
        """fp32 weight rows [r1 - r0, in] into `out` (a buffer of at least that size)."""
        w = dequantize_codes(self.weight[r0:r1], self.scale[r0:r1], None if self.min is None else self.min[r0:r1],
                             self.bits, self.group_size, out)
        return w if self.padded_in == self.in_features else w[:, : self.in_features]

    def dequantize(self) -> torch.Tensor:
        """The full fp32 weight [out, in]."""
        buf = torch.empty(self.out_features * self.padded_in, dtype=torch.float32, device=self.weight.device)
        return self._dequant_rows(0, self.out_features, buf)

    def forward(self, x: torch.Tensor, out: Optional[torch.Tensor] = None,
                residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [T, in] -> y [T, out]; into `out` when given, or added to `residual` in place
        (the contract of `models.llama.Linear.forward`)."""
        y = self._matmul(x)
        if residual is not None:
            return residual.add_(y)
        return y if out is None else out.copy_(y)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:  # Triton dequantize-GEMM; imported here so CPU users never import triton
            from .kernels.quant_gemm import quant_matmul

            return quant_matmul(x, self.weight, self.scale, self.min, self.bits, self.group_size,
                                self.in_features, self.bias, self.dtype)
        m = x.shape[0]
        per_tile = self.SMALL_TILE_ELEMS if m <= self.SMALL_M else self.LARGE_TILE_ELEMS
        rows = max(1, min(self.out_features, per_tile // self.padded_in))
        buf = torch.empty(rows * self.padded_in, dtype=torch.float32, device=x.device)
        xf = x if x.dtype == torch.float32 else x.float()
        if rows >= self.out_features:
            y = F.linear(xf, self._dequant_rows(0, self.out_features, buf),
                         None if self.bias is None else self.bias.float())
            return y.to(self.dtype)
        y = torch.empty(m, self.out_features, dtype=torch.float32, device=x.device)
        for r0 in range(0, self.out_features, rows):
            r1 = min(r0 + rows, self.out_features)
            y[:, r0:r1] = torch.mm(xf, self._dequant_rows(r0, r1, buf).t())
        if self.bias is not None:
            y += self.bias.float()
        return y.to(self.dtype)

    def weight_bytes(self) -> int:
        """Bytes this layer reads per forward pass: codes, scales, mins, bias."""
        n = self.weight.numel() * self.weight.element_size() + self.scale.numel() * 4
        if self.min is not None:
            n += self.min.numel() * 4
        if self.bias is not None:
            n += self.bias.numel() * self.bias.element_size()
        return n

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, bits={self.bits}, "
                f"group_size={self.group_size}, min={self.min is not None}")


# ---------------------------------------------------------------- our quantizers

def quantize_int8(w: torch.Tensor, bias=None, dtype=torch.float32, group_size: Optional[int] = None) -> QuantLinear:
    """Symmetric int8, per output channel (group_size None) or per group of `group_size` columns:
    s = max|w| / 127 over the channel (group), q = round(w / s) in -127..127."""
    w = w.float()
    out, n = w.shape
    gs = n if group_size is None or n % group_size else group_size
    g = w.view(out, n // gs, gs)
    s = (g.abs().amax(dim=-1) / 127.0).clamp_min(1e-12)
    q = torch.round(g / s[..., None]).clamp_(-127, 127).to(torch.int8).view(out, n)
    return QuantLinear(q, s, None, 8, gs, bias, dtype)


def quantize_int4(w: torch.Tensor, group_size: int = 32, bias=None, dtype=torch.float32) -> QuantLinear:
    """Group-wise asymmetric int4: per group s = (max - min) / 15, m = min, q = round((w - m) / s) in 0..15."""
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group_size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    w = w.float()
    out, n_in = w.shape
    n = -(-n_in // group_size) * group_size
    g = F.pad(w, (0, n - n_in)).view(out, n // group_size, group_size)
    # a last partial group takes its range from its real columns only (padding codes are 0)
    valid = (torch.arange(n, device=w.device) < n_in).view(n // group_size, group_size)
    mn = torch.where(valid, g, torch.inf).amin(-1)
    s = ((torch.where(valid, g, -torch.inf).amax(-1) - mn) / 15.0).clamp_min(1e-12)
    q = torch.round((g - mn[..., None]) / s[..., None]).clamp_(0, 15)
    q = torch.where(valid, q, 0).view(out, n)
    return QuantLinear(pack_int4(q, group_size), s, mn, 4, group_size, bias, dtype, in_features=n_in)


def _swap(model, name: str, new: nn.Module) -> None:
    model.set_linear(name, new)


# whether `quantize_model` quantizes the LM head, per scheme (see the module docstring)
QUANTIZE_LM_HEAD = {"int8": False, "int4": True}


def quantize_model(model, scheme: str, group_size: int = 32, quantize_lm_head: Optional[bool] = None) -> None:
    """Replace the linear layers of `model` (`model.linear_layers()`) by their quantized
    counterparts, in place. The LM head is quantized when `quantize_lm_head` (default:
    `QUANTIZE_LM_HEAD[scheme]`, i.e. int4 yes, int8 no); a tied LM head then gets its own
    quantized copy, and the embedding lookup keeps the float table.

    Args:
        scheme: "int8" (per-channel) or "int4" (group-wise, `group_size` in 32/64/128);
            W8A8 is `engine.smoothquant`.
    Raises:
        ValueError: unknown scheme or group size.
    """
    if scheme not in ("int8", "int4"):
        raise ValueError(f"quantize_model scheme must be 'int8' or 'int4', got {scheme!r}")
    if quantize_lm_head is None:
        quantize_lm_head = QUANTIZE_LM_HEAD[scheme]
    for name, lin in model.linear_layers():
        if isinstance(lin, QuantLinear) or (name == "lm_head" and not quantize_lm_head):
            continue
        b = lin.bias
        if scheme == "int8":
            new = quantize_int8(lin.weight.data, b, model.dtype)
        else:
            new = quantize_int4(lin.weight.data, group_size, b, model.dtype)
        _swap(model, name, new.to(lin.weight.device))


def quantized_copy(model, scheme: str, group_size: int = 32, gguf_path: Optional[str] = None):
    """A new model sharing `model`'s embedding and norm tensors, with quantized linear layers
    (`model` itself is untouched, so a cached float model can serve other engines).

    Args:
        scheme: "int8" | "int4" (quantized from the float weights) | "gguf" (blocks read from `gguf_path`).
    """
    from .models.llama import LlamaModel

    q = LlamaModel(model.cfg, model.dtype, model.device, model.shard)  # a tensor-parallel rank quantizes its slices
    q.embed, q.final_norm, q.lm_head = model.embed, model.final_norm, model.lm_head
    q.layers = nn.ModuleList([layer.shell() for layer in model.layers])
    if scheme == "gguf":
        if gguf_path is None:
            raise ValueError("scheme 'gguf' needs gguf_path")
        load_gguf_linears(q, gguf_path)
    else:
        quantize_model(q, scheme, group_size)
    return q


def sync_row_parallel_int8(model, base, tp) -> int:
    """int8 on a tensor-parallel rank: requantize the row-parallel layers (o, down) with the
    scale of the whole row, so every rank's codes are exactly one device's.

    A rank holds only its input columns of o and down, so the per-output-channel absmax it
    would take from its slice alone is its share's, not the row's. Here every rank takes its
    slice's absmax per row from its float weights (`base`, the float shard `quantized_copy`
    started from), one all-reduce(max) per layer gives the row's, and the slice is quantized
    as `quantize_int8` quantizes the whole row. Every rank must call this, in the same order.

    Args:
        model: the rank's int8 model (its o and down layers are replaced).
        base: the rank's float model of the same shard.
        tp: the group (`engine.parallel.TPGroup`).
    Returns:
        the number of layers requantized.
    """
    from .kernels.cpu.layers import CpuQuantLinear

    n = 0
    for qlayer, flayer in zip(model.layers, base.layers):
        for name in ("o", "down"):
            lin, w = getattr(qlayer, name), getattr(flayer, name).weight.data.float()
            amax = tp.all_reduce_max_(w.abs().amax(dim=1).contiguous())
            s = (amax / 127.0).clamp_min(1e-12)[:, None]
            q = torch.round(w / s).clamp_(-127, 127).to(torch.int8)
            new: nn.Module = QuantLinear(q, s, None, 8, w.shape[1], lin.bias, model.dtype).to(w.device)
            if isinstance(lin, CpuQuantLinear):
                new = CpuQuantLinear(new, lib=lin.lib)
            setattr(qlayer, name, new)
            n += 1
    return n


def model_weight_bytes(model) -> int:
    """Bytes of all weights as held in memory: the embedding table, norms and every
    linear layer (a quantized LM head is a separate copy of the tied embedding; a
    float tied head is the embedding table, counted once)."""
    el = model.embed.element_size()
    n = model.embed.numel() * el + model.final_norm.numel() * el
    for name, lin in model.linear_layers():
        if name == "lm_head" and not isinstance(lin, QuantLinear) and lin.weight.data_ptr() == model.embed.data_ptr():
            continue
        n += lin.weight_bytes()
    for layer in model.layers:
        n += (layer.attn_norm.numel() + layer.mlp_norm.numel()) * el
    return n


def decode_weight_bytes(model) -> int:
    """Bytes read per decode step: every linear layer (incl. the LM head, in float when it is
    the tied embedding: the whole table) and norms; the embedding lookup contributes only
    the looked-up rows (ignored)."""
    el = model.embed.element_size()
    n = model.final_norm.numel() * el + sum(lin.weight_bytes() for _, lin in model.linear_layers())
    for layer in model.layers:
        n += (layer.attn_norm.numel() + layer.mlp_norm.numel()) * el
    return n


# ---------------------------------------------------------------- GGUF blocks

def concat_rows(parts: list[QuantParts]) -> QuantParts:
    """Stack matrices along output rows (fused qkv, gate_up). Differing layouts are
    brought to a common one without changing any value: int4 codes widened to int8,
    scales repeated to the smallest group, a missing min becomes 0 (q*s + 0 == q*s)."""
    p0 = parts[0]
    if all((p.bits, p.group_size, p.min is None) == (p0.bits, p0.group_size, p0.min is None) for p in parts):
        return QuantParts(np.concatenate([p.codes for p in parts]), np.concatenate([p.scale for p in parts]),
                          None if p0.min is None else np.concatenate([p.min for p in parts]), p0.bits, p0.group_size)
    gs = math.gcd(*[p.group_size for p in parts])
    codes, scales, mins = [], [], []
    for p in parts:
        r = p.group_size // gs
        codes.append(p.unpacked())
        scales.append(np.repeat(p.scale, r, axis=1))
        mins.append(np.zeros_like(scales[-1]) if p.min is None else np.repeat(p.min, r, axis=1))
    return QuantParts(np.concatenate(codes), np.concatenate(scales), np.concatenate(mins), 8, gs)


def parts_to_layer(p: QuantParts, bias=None, dtype=torch.float32, device="cpu") -> QuantLinear:
    codes = torch.from_numpy(np.ascontiguousarray(p.codes))
    return QuantLinear(codes, torch.from_numpy(np.ascontiguousarray(p.scale)),
                       None if p.min is None else torch.from_numpy(np.ascontiguousarray(p.min)),
                       p.bits, p.group_size, bias, dtype).to(device)


def _slice_parts_rows(p: QuantParts, r0: int, r1: int) -> QuantParts:
    return p.permute_rows(lambda a: np.ascontiguousarray(a[r0:r1]))


def read_gguf_parts(path: str, shard=None) -> tuple[dict[str, QuantParts], dict[str, str]]:
    """QuantParts of every mapped quantized GGUF matrix, under our names, with q/k rows
    un-permuted where the family's converter permuted them (like `weights.load_gguf`), fused
    tensors (Phi-3) split by rows and stacked experts split per expert; plus each matrix's GGUF
    type. With `shard` (an `engine.parallel.sharding.TPShard`) each part is that rank's slice,
    cut from the stored blocks (`weights.gguf_raw_slice`); a part whose column slice does not
    fall on its quantization blocks is left out (its layer stays in float)."""
    from .models.family import family_of
    from .parallel.sharding import SINGLE, slice_spec
    from .weights import _gguf_config, _gguf_tensor_parts, gguf_raw_slice, open_gguf, unpermute_rope_rows

    shard = shard or SINGLE
    index = open_gguf(path)
    cfg = _gguf_config(path)
    fam = family_of(cfg.family)
    n_heads, n_kv = cfg.num_heads // shard.world_size, cfg.num_kv_heads // shard.world_size
    parts: dict[str, QuantParts] = {}
    types: dict[str, str] = {}
    for t in index.tensors:
        if len(t.shape) not in (2, 3):
            continue
        shape = [int(x) for x in t.shape.tolist()]  # [in, out] or [in, out, E]
        n_in, out = shape[0], shape[1]
        for ours, rows, expert in _gguf_tensor_parts(t, cfg):
            if not ours.endswith("weight"):
                continue
            types[ours] = t.tensor_type.name
            spec = slice_spec(ours, cfg, shard)
            data = np.asarray(t.data)
            if data.dtype != np.uint8:
                continue
            if rows is None and expert is None:
                raw, sliced = gguf_raw_slice(t, spec)
                if not sliced:
                    continue
                o, i = out, n_in
                if spec is not None:
                    o, i = (spec.stop - spec.start, n_in) if spec.dim == 0 else (out, spec.stop - spec.start)
                p = gguf_blocks_to_parts(raw, t.tensor_type.name, o, i)
                if p is None:
                    continue
                if spec is not None and spec.pad_to is not None:
                    p = p.pad_rows(spec.pad_to)
            else:  # a fused tensor's rows or one expert's matrix: convert it, then cut the rank's slice
                data = data.reshape(-1, data.shape[-1])
                r0, r1 = rows if rows is not None else (expert * out, (expert + 1) * out)
                p = gguf_blocks_to_parts(np.ascontiguousarray(data[r0:r1]), t.tensor_type.name, r1 - r0, n_in)
                if p is None:
                    continue
                if spec is not None and spec.dim == 0:
                    p = _slice_parts_rows(p, spec.start, spec.stop)
                elif spec is not None:  # columns: only on whole groups
                    g = p.group_size
                    if spec.start % g or spec.stop % g:
                        continue
                    c0, c1 = (spec.start, spec.stop) if p.bits == 8 else (spec.start // 2, spec.stop // 2)
                    p = QuantParts(np.ascontiguousarray(p.codes[:, c0:c1]),
                                   np.ascontiguousarray(p.scale[:, spec.start // g:spec.stop // g]),
                                   None if p.min is None else np.ascontiguousarray(p.min[:, spec.start // g:spec.stop // g]),
                                   p.bits, g)
            if fam.gguf_permuted_qk and (ours.endswith("q_proj.weight") or ours.endswith("k_proj.weight")):
                nh = n_heads if "q_proj" in ours else n_kv
                p = p.permute_rows(lambda a, nh=nh: np.ascontiguousarray(unpermute_rope_rows(a, nh)))
            parts[ours] = p
    return parts, types


_FUSED = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "o": ("self_attn.o_proj",), "gate_up": ("mlp.gate_proj", "mlp.up_proj"), "down": ("mlp.down_proj",)}


def _gguf_sources(name: str) -> list[str]:
    """Our tensor names a linear layer (as `linear_layers` names it) is fused from."""
    if name == "lm_head":
        return ["lm_head.weight"]
    parts = name.split(".")
    if parts[2] == "experts":  # layers.{i}.experts.{e}.{gate_up|down}
        pre = f"layers.{parts[1]}.mlp.experts.{parts[3]}."
        return [pre + s + ".weight" for s in (("gate_proj", "up_proj") if parts[4] == "gate_up" else ("down_proj",))]
    return [f"layers.{parts[1]}.{s}.weight" for s in _FUSED[parts[2]]]


def load_gguf_linears(model, path: str) -> dict[str, str]:
    """quantization="gguf": swap each linear layer of a model loaded from `path` for one
    built from the file's own quantized blocks (see GGUF_MAPPING). Layers whose
    tensors are float or of an unmapped type stay fp32. A tied LM head uses the
    token embedding's blocks. A tensor-parallel rank's model (`model.shard`) gets its
    slices of the blocks. Returns {layer name: GGUF type(s) or "fp32"}."""
    parts, types = read_gguf_parts(path, model.shard)
    report = {}
    for name, lin in model.linear_layers():
        src = _gguf_sources(name)
        if name == "lm_head" and "lm_head.weight" not in parts:
            src = ["embed_tokens.weight"]
        if not all(s in parts for s in src):
            report[name] = "fp32"
            continue
        p = concat_rows([parts[s] for s in src])
        _swap(model, name, parts_to_layer(p, lin.bias, model.dtype, lin.weight.device))
        report[name] = "+".join(sorted({types[s] for s in src}))
    return report


def kernel_gflops(m: int, n: int, k: int, fn, reps: int = 5) -> float:
    """GFLOP/s of fn() computing an [m, k] x [k, n] product (best of reps)."""
    import time

    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return 2 * m * n * k / best / 1e9
