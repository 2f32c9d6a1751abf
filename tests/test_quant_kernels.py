"""The Triton dequantize-GEMM (`engine.kernels.quant_gemm`) against its PyTorch oracle and QuantLinear.

Without CUDA the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set
before any kernel module is imported); with CUDA the same tests run compiled.
Shapes are tiny (K <= 256, N <= 96): the interpreter's cost grows with the
number of programs and K-steps.

Covered: bits 8 and 4 (GGUF Q4_0 nibble layout), with and without min, group
sizes 32/64/128 and per-channel (and unusual ones: 16, 24, 48), both launch
shapes (M 1 and 3: decode; 17 and 40: prefill), odd N spanning two N-tiles, a
stored width padded past in_features, bias, split-K, weights made by our own
quantizers, fp16 activations, and the ValueErrors. bf16 runs only on CUDA:
Triton 3.7's interpreter computes bf16 `tl.dot` wrongly (checked with a bare
16x16 bf16 dot), so it cannot serve as a CPU oracle there.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # before the @triton.jit kernels are defined

from engine.kernels import quant_matmul, quant_matmul_ref  # noqa: E402
from engine.kernels.quant_gemm import _tile  # noqa: E402
from engine.quant import QuantLinear, quantize_int4, quantize_int8  # noqa: E402

DEV = torch.device("cuda" if CUDA else "cpu")
# fp16 runs on the CPU too (the interpreter's fp16 dot is right; its bf16 dot is not)
DTYPES = [torch.float32, torch.float16, torch.bfloat16] if CUDA else [torch.float32, torch.float16]
# relative to max|reference|: fp32 differs only in summation order; 16-bit outputs by their final rounding
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}

# group size -> (stored width K_pad, in_features): every grid case pads K past in_features
# except per-channel ("pc": one group of 100 columns, not a multiple of any K-step)
SHAPES = {32: (96, 90), 64: (192, 180), 128: (256, 250), "pc": (100, 100)}


def _close(y: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert y.shape == ref.shape and y.dtype == ref.dtype
    tol = TOL[dtype] * ref.float().abs().max().item()
    torch.testing.assert_close(y.float(), ref.float(), rtol=TOL[dtype], atol=tol)


def _random_layer(bits: int, gs: int, k_pad: int, n: int, with_min: bool, g: torch.Generator):
    """Random codes (padding columns included, nonzero), scales, mins and bias on DEV."""
    if bits == 8:
        codes = torch.randint(-128, 128, (n, k_pad), generator=g, dtype=torch.int8)
    else:
        codes = torch.randint(0, 256, (n, k_pad // 2), generator=g, dtype=torch.uint8)
    scale = 0.01 + 0.05 * torch.rand(n, k_pad // gs, generator=g)
    mn = 0.2 * torch.randn(n, k_pad // gs, generator=g) if with_min else None
    bias = torch.randn(n, generator=g)
    return (codes.to(DEV), scale.to(DEV), None if mn is None else mn.to(DEV), bias.to(DEV))


@pytest.mark.parametrize("m", [1, 3, 17, 40])
@pytest.mark.parametrize("gs_key", [32, 64, 128, "pc"])
@pytest.mark.parametrize("with_min", [False, True])
@pytest.mark.parametrize("bits", [8, 4])
def test_kernel_matches_reference_and_quantlinear(bits, with_min, gs_key, m):
    k_pad, k = SHAPES[gs_key]
    gs = k_pad if gs_key == "pc" else gs_key
    n = 71  # odd, two 64-wide N-tiles
    g = torch.Generator().manual_seed(1000 * bits + 10 * m + with_min)
    codes, scale, mn, bias = _random_layer(bits, gs, k_pad, n, with_min, g)
    x = torch.randn(m, k, generator=g).to(DEV)
    y = quant_matmul(x, codes, scale, mn, bits, gs, k, bias)
    ref = quant_matmul_ref(x, codes, scale, mn, bits, gs, k, bias)
    _close(y, ref, torch.float32)
    # QuantLinear's own CPU kernel (its dequantization is written independently of the oracle's)
    layer = QuantLinear(codes.cpu(), scale.cpu(), None if mn is None else mn.cpu(), bits, gs, bias.cpu(),
                        in_features=k)
    _close(y.cpu(), layer(x.cpu()), torch.float32)


@pytest.mark.parametrize("split_k", [2, 3, 1000])
@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("bits", [8, 4])
def test_split_k_decode(bits, m, split_k):
    """Partial sums over K-splits (bias added once, after the reduction); 1000 is clamped to the steps."""
    k_pad, k, gs, n = 256, 250, 32, 45
    g = torch.Generator().manual_seed(7 * split_k + m)
    codes, scale, mn, bias = _random_layer(bits, gs, k_pad, n, True, g)
    x = torch.randn(m, k, generator=g).to(DEV)
    y = quant_matmul(x, codes, scale, mn, bits, gs, k, bias, split_k=split_k)
    _close(y, quant_matmul_ref(x, codes, scale, mn, bits, gs, k, bias), torch.float32)


@pytest.mark.parametrize("bits,gs", [(8, 16), (4, 16), (8, 48), (4, 24)])
@pytest.mark.parametrize("m", [1, 3, 20])
def test_group_sizes_below_or_off_the_k_step(bits, gs, m):
    """Q6_K's group 16, and groups with no power-of-two divisor >= 16 (masked K-steps)."""
    k_pad, n = 96 if gs != 16 else 64, 33
    g = torch.Generator().manual_seed(gs * m + bits)
    codes, scale, mn, bias = _random_layer(bits, gs, k_pad, n, bits == 4, g)
    x = torch.randn(m, k_pad - 1, generator=g).to(DEV)
    y = quant_matmul(x, codes, scale, mn, bits, gs, k_pad - 1, bias)
    _close(y, quant_matmul_ref(x, codes, scale, mn, bits, gs, k_pad - 1, bias), torch.float32)


@pytest.mark.parametrize("m", [1, 20])
@pytest.mark.parametrize("scheme", ["int8", "int8-g32", "int4-g32", "int4-g64", "int4-g128"])
def test_kernel_on_our_quantizers(scheme, m):
    """Layers from quantize_int8 / quantize_int4 (int4 pads 200 columns to whole groups), no bias:
    the kernel equals F.linear with the layer's own dequantized weight."""
    n, k = 45, 200
    g = torch.Generator().manual_seed(len(scheme) * m)
    w = torch.randn(n, k, generator=g) * 0.05
    if scheme == "int8":  # per output channel: one group of 200
        layer = quantize_int8(w)
    elif scheme == "int8-g32":  # int8 groups must divide the width: 192 columns
        layer = quantize_int8(w[:, :192], group_size=32)
    else:
        layer = quantize_int4(w, group_size=int(scheme.split("-g")[1]))
    layer = layer.to(DEV)
    x = torch.randn(m, layer.in_features, generator=g).to(DEV)
    y = quant_matmul(x, layer.weight, layer.scale, layer.min, layer.bits, layer.group_size, layer.in_features)
    _close(y, F.linear(x, layer.dequantize()), torch.float32)
    # and the quantized weight is close to w itself (the layer is a real quantization of it)
    assert (layer.dequantize().cpu() - w[:, : layer.in_features]).abs().max() < 0.1 * w.abs().max()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3, 40])
@pytest.mark.parametrize("bits", [8, 4])
def test_activation_dtypes(bits, m, dtype):
    """x in fp16/bf16: codes enter the dot in x's dtype (exact), fp32 accumulation, y in x's dtype."""
    k_pad, k, gs, n = 128, 128, 32, 37
    g = torch.Generator().manual_seed(bits + m)
    codes, scale, mn, bias = _random_layer(bits, gs, k_pad, n, bits == 4, g)
    x = torch.randn(m, k, generator=g).to(DEV, dtype)
    y = quant_matmul(x, codes, scale, mn, bits, gs, k, bias.to(dtype))
    _close(y, quant_matmul_ref(x, codes, scale, mn, bits, gs, k, bias.to(dtype)), dtype)
    y32 = quant_matmul(x, codes, scale, mn, bits, gs, k, out_dtype=torch.float32)
    assert y32.dtype == torch.float32


def test_empty_batch_and_strided_rows():
    g = torch.Generator().manual_seed(3)
    codes, scale, mn, bias = _random_layer(4, 32, 64, 9, True, g)
    assert quant_matmul(torch.empty(0, 64, device=DEV), codes, scale, mn, 4, 32, 64).shape == (0, 9)
    xs = torch.randn(3, 128, generator=g).to(DEV)[:, ::2]  # x with a non-unit column stride
    _close(quant_matmul(xs, codes, scale, mn, 4, 32, 64), quant_matmul_ref(xs, codes, scale, mn, 4, 32, 64),
           torch.float32)


def test_quantlinear_forward_cuda_uses_kernel():
    """On CUDA, QuantLinear.forward is the kernel: equal to its own CPU path."""
    if not CUDA:
        pytest.skip("needs CUDA (the CPU path never imports triton)")
    w = torch.randn(45, 200) * 0.05
    layer = quantize_int4(w, 64, bias=torch.randn(45))
    x = torch.randn(5, 200)
    _close(layer.to(DEV)(x.to(DEV)).cpu(), layer.cpu()(x), torch.float32)


def test_k_step_choice():
    assert _tile(16, 4, 64) == 16  # int4 group 32: 16 bytes per step
    assert _tile(64, 2, 64) == 64 and _tile(128, 2, 64) == 64
    assert _tile(48, 2, 64) == 16 and _tile(12, 2, 64) == 16  # no power-of-two divisor >= 16: masked steps
    assert _tile(4096, 1, 128) == 128 and _tile(50, 1, 64) == 64 and _tile(12, 1, 64) == 16


def _good_args():
    g = torch.Generator().manual_seed(0)
    codes, scale, mn, bias = _random_layer(4, 32, 64, 5, True, g)
    return dict(x=torch.randn(2, 60, generator=g).to(DEV), codes=codes, scale=scale, min=mn, bits=4,
                group_size=32, in_features=60, bias=bias)


@pytest.mark.parametrize("fn", [quant_matmul, quant_matmul_ref])
@pytest.mark.parametrize("bad,word", [
    (dict(bits=3), "bits"),
    (dict(bits=8), "codes"),  # uint8 packed codes are not int8 codes
    (dict(group_size=48), "group_size"),  # does not divide the stored width 64
    (dict(group_size=0), "group_size"),
    (dict(in_features=32), "in_features"),  # a whole group of padding
    (dict(in_features=65), "in_features"),
    (dict(x="wide"), "x"),
    (dict(scale="short"), "scale"),
    (dict(min="short"), "min"),
    (dict(bias="short"), "bias"),
])
def test_bad_arguments_raise_value_error(fn, bad, word):
    kw = _good_args()
    for key, val in bad.items():
        if val == "wide":
            val = torch.randn(2, 61, device=DEV)
        elif val == "short":
            val = kw[key][..., :-1]
        kw[key] = val
    with pytest.raises(ValueError, match=word):
        fn(**kw)
    odd = _good_args()
    odd["codes"], odd["group_size"] = odd["codes"][:, :3], 3  # int4 group of odd size
    with pytest.raises(ValueError, match="group_size"):
        fn(**odd)
