"""The CPU kernel library's linear layers (engine/kernels/cpu/gemm.c, gemm_i8.c) against PyTorch references
(float64 products; for 4-bit weights, `cpu.gemm_q4_reference`, the integer product the kernel defines; for
bf16 weights, `cpu.gemm_bf16_reference`).

Every build the machine can run is checked: the native one (AVX-512 where present),
AVX2 (+ AVX-VNNI where present), AVX2 without VNNI (the vpmaddubsw W8A8 path) and plain C,
on odd shapes (M = 1, 3, 17; K and N not multiples of the vector width)."""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import subprocess
import sys

import pytest
import torch

from engine.host import Host
from engine.kernels import cpu
from engine.kernels.cpu import build
from engine.kernels.cpu.layers import (
    CpuBf16Linear, CpuLinear, CpuQuantLinear, W8A8Linear, quantize_w8a8,
)
from engine.models.cpu_layers import use_cpu_kernels
from engine.quant import QuantLinear, quantize_int4, quantize_int8, unpack_int4

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"no CPU kernels: {cpu.why_unavailable()}")

FLAGS = build.cpu_flags()
VARIANTS = [
    pytest.param("native", id="native"),
    pytest.param("avx2", id="avx2", marks=pytest.mark.skipif(not {"avx2", "fma"} <= FLAGS, reason="no AVX2/FMA")),
    pytest.param("avx2-novnni", id="avx2-novnni",
                 marks=pytest.mark.skipif(not {"avx2", "fma"} <= FLAGS, reason="no AVX2/FMA")),
    pytest.param("generic", id="generic"),
]
# (300, 70, 1000): two row blocks of x, and K in slices with a remainder (AVX-512 192, AVX2 256 rows)
SHAPES = [(1, 1, 1), (1, 17, 5), (3, 33, 64), (17, 100, 130), (13, 40, 576), (64, 96, 72), (300, 70, 1000)]


@pytest.fixture(scope="module", params=VARIANTS)
def lib(request):
    lib = cpu.library(request.param)
    if lib is None:
        pytest.skip(cpu.why_unavailable(request.param))
    return lib


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def _tol(k: int) -> float:
    """fp32 sums of k products against float64: 1e-6 of the largest value up to k = 600, growing with k past it."""
    return 1e-6 * max(1.0, k / 600)


def test_builds_report_their_instruction_set():
    assert cpu.isa(cpu.library("generic")) == "generic" and cpu.nr(cpu.library("generic")) == 16
    want = "avx512" if {"avx512f", "avx512bw", "avx512vl"} <= FLAGS else ("avx2" if {"avx2", "fma"} <= FLAGS else
                                                                         "generic")
    assert cpu.isa() == want
    assert cpu.nr() == (32 if want == "avx512" else 16)


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_f32_gemm_matches_float64(lib, m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
    x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    ref = x.double() @ w.double().t()
    layer = CpuLinear(w, b, lib=lib)
    assert _rel(layer(x), ref + b.double()) < _tol(k)
    # the residual add is fused: residual += x W^T + b
    r = torch.randn(m, n, generator=g)
    got = layer(x, residual=r.clone())
    assert _rel(got, ref + b.double() + r.double()) < _tol(k)
    # strided operands: x and y as column slices of wider buffers
    xs = torch.randn(m, k + 7, generator=g)
    xs[:, 3:3 + k] = x
    ys = torch.full((m, n + 5), 7.0)
    cpu.gemm_f32(xs[:, 3:3 + k], layer.packed, n, None, ys[:, 2:2 + n], lib=lib)
    assert _rel(ys[:, 2:2 + n], ref) < _tol(k)
    assert (ys[:, :2] == 7).all() and (ys[:, 2 + n:] == 7).all()  # nothing written outside the slice


@pytest.mark.parametrize("m,n,k", SHAPES[1:])
@pytest.mark.parametrize("scheme", ["int8", "int8-g32", "int4-g32", "int4-g64"])
def test_quantized_gemm_matches_dequantized_weights(lib, m, n, k, scheme):
    g = torch.Generator().manual_seed(k * 7 + n)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    if scheme == "int8":
        q = quantize_int8(w)
    elif scheme == "int8-g32":
        q = quantize_int8(w, group_size=32 if k % 32 == 0 else None)
    else:
        q = quantize_int4(w, int(scheme[-2:]))
    exact = x.double() @ q.dequantize().double().t()
    if q.bits == 4:
        # 4-bit codes times int8 activations: the integer product the kernel defines, to fp32
        # rounding of its per-group steps; and within the activations' rounding of the float one
        ref = cpu.gemm_q4_reference(x, unpack_int4(q.weight, q.group_size), q.scale, q.min, q.group_size)
        assert 1e-5 < _rel(ref, exact) < 0.03
    else:
        ref = exact
    assert _rel(CpuQuantLinear(q, lib=lib)(x), ref) < _tol(k)
    # and the layer serves QuantLinear's contract (out / residual)
    r = torch.randn(m, n, generator=g)
    assert _rel(CpuQuantLinear(q, lib=lib)(x, residual=r.clone()), ref + r.double()) < _tol(k)


@pytest.mark.parametrize("m,k", [(1, 5), (3, 64), (17, 130), (4, 257)])
def test_q4_activation_quantization_matches_its_reference(lib, m, k):
    """The int8 activations of the 4-bit path, seen through the product with one-hot weights: a
    weight row whose only nonzero code (1, scale 1, no min) sits at column c gives sa * qa[c]."""
    g = torch.Generator().manual_seed(m + k)
    x = torch.randn(m, k, generator=g) * torch.logspace(-2, 2, m)[:, None]
    x[0, : min(k, 32)] = 0.0  # an all-zero group: scale 0, codes 0
    gs = 32
    kpad = -(-k // gs) * gs
    codes = torch.zeros(k, kpad, dtype=torch.uint8)
    codes[torch.arange(k), torch.arange(k)] = 1
    scale = torch.ones(k, kpad // gs)
    layer_out = cpu.gemm_q(x, cpu.pack_q(codes, scale, None, 4, gs, lib=lib), k, kpad, 4, gs, False, lib=lib)
    qa, sa, _ = cpu.quantize_act_q4(x, gs)
    want = (qa.view(m, -1)[:, :k].float() * sa.repeat_interleave(gs, 1)[:, :k])
    assert torch.equal(layer_out, want)
    assert (qa.abs() <= 127).all() and (qa[0, 0] == 0).all()


def test_gguf_blocks_are_read_exactly_from_the_bundled_model():
    """The bundled GGUF's Q4_1 (decoder) and Q8_0 (LM head) blocks, packed: the kernel's products
    equal x times the exact gguf dequantization of those blocks."""
    from engine.quant import concat_rows, parts_to_layer, read_gguf_parts
    from engine.weights import default_gguf_path

    parts, types = read_gguf_parts(default_gguf_path())
    assert types["layers.0.self_attn.q_proj.weight"] == "Q4_1" and types["embed_tokens.weight"] == "Q8_0"
    qkv = parts_to_layer(concat_rows([parts[f"layers.0.self_attn.{p}_proj.weight"] for p in "qkv"]))
    head = parts_to_layer(parts["embed_tokens.weight"])
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(0))
    assert qkv.bits == 4 and head.bits == 8
    for q in (qkv, head):
        if q.bits == 4:  # Q4_1 codes times int8 activations, exactly as the reference defines them
            ref = cpu.gemm_q4_reference(x, unpack_int4(q.weight, q.group_size), q.scale, q.min, q.group_size)
        else:
            ref = x.double() @ q.dequantize().double().t()
        # fp32 sums of 576 products (or 18 group steps): about 1e-6 of the largest output (a wrongly
        # read block moves a whole group of 32 weights, orders of magnitude more)
        assert _rel(CpuQuantLinear(q)(x), ref) < 2e-6


def _signed(codes: torch.Tensor, lib) -> torch.Tensor:
    """Activation codes as the signed values they stand for."""
    return (codes.to(torch.int64) - 128) if cpu.act_offset(lib) == 128 else codes.view(torch.int8).to(torch.int64)


@pytest.mark.parametrize("group", [4, 16, 64])
def test_activation_quantization_is_round_half_even_per_row_and_group(lib, group):
    x = torch.randn(5, 37, generator=torch.Generator().manual_seed(11)) * torch.tensor([0.01, 1, 100, 3, 0.5])[:, None]
    x[3] = 0.0  # an all-zero row gets scale 0 and codes 0
    codes, scales = cpu.quantize_act(x, group, lib=lib)
    ng = -(-40 // group)
    assert codes.shape == (5, 40) and scales.shape == (5, ng)
    for gi in range(ng):
        xs = x[:, gi * group: min((gi + 1) * group, 37)]
        amax = xs.abs().amax(1)
        assert torch.equal(scales[:, gi], amax / 127)
        # 127.0 / amax as an IEEE division (a Python scalar over a tensor is reciprocal-then-multiply in torch)
        inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
        want = torch.round(xs * inv[:, None]).clamp(-127, 127).to(torch.int64)  # torch.round: half to even
        assert torch.equal(_signed(codes, lib)[:, gi * group: gi * group + xs.shape[1]], want)
    assert (_signed(codes, lib)[:, 37:] == 0).all()


@pytest.mark.parametrize("k", [8, 24, 37, 64])
def test_activation_scale_finds_the_maximum_at_every_position(lib, k):
    """The group's max |x| is found wherever it sits: in the 16- and 8-wide vector loops or the
    scalar tail (row i holds its largest magnitude, of either sign, at column i); a NaN is skipped."""
    x = torch.rand(k, k, generator=torch.Generator().manual_seed(k)) - 0.5
    big = torch.where(torch.arange(k) % 2 == 0, 1000.0, -1000.0) * (1 + torch.arange(k) / 64)
    x[torch.arange(k), torch.arange(k)] = big
    codes, scales = cpu.quantize_act(x, 64, lib=lib)
    assert torch.equal(scales[:, 0], big.abs() / 127)
    assert torch.equal(_signed(codes, lib)[torch.arange(k), torch.arange(k)], torch.sign(big).to(torch.int64) * 127)
    x[0, k - 1] = float("nan")
    _, scales = cpu.quantize_act(x[:1].contiguous(), 64, lib=lib)
    assert scales[0, 0] == big[0].abs() / 127


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("group", [8, 64])
def test_w8a8_gemm_equals_the_grouped_integer_product(lib, m, n, k, group):
    g = torch.Generator().manual_seed(n + k)
    x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    layer = W8A8Linear.from_float(w, b, group, lib=lib)
    codes, sa = cpu.quantize_act(x, group, lib=lib)
    qa, qw = _signed(codes, lib), layer.weight.to(torch.int64)
    ref = torch.zeros(m, n, dtype=torch.float64)
    for gi in range(sa.shape[1]):
        cols = slice(gi * group, min((gi + 1) * group, k))
        acc = qa[:, cols] @ qw[:, cols].t()  # exact integer sums of the group
        ref += acc.double() * sa[:, gi].double()[:, None]
    ref = ref * layer.scale.double()[None, :] + b.double()
    assert _rel(layer(x), ref) < 1e-6
    r = torch.randn(m, n, generator=g)
    assert _rel(layer(x, residual=r.clone()), ref + r.double()) < 1e-6


def test_w8a8_weight_quantization_and_error_bound():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(40, 64, generator=g)
    q, s = quantize_w8a8(w)
    # codes in [-63, 63], each row's largest |w| at 63 (the kernels' vpmaddubsw bound is 64)
    assert q.dtype == torch.int8 and torch.equal(q.abs().amax(1), torch.full((40,), 63, dtype=torch.int8))
    assert torch.allclose(s, w.abs().amax(1) / 63)
    assert ((q.float() * s[:, None] - w).abs() <= s[:, None] / 2 + 1e-7).all()
    # the whole layer: within int8 x int8 rounding of the float product
    x = torch.randn(8, 64, generator=g)
    rel = ((W8A8Linear.from_float(w)(x) - x @ w.t()).norm() / (x @ w.t()).norm()).item()
    assert 1e-4 < rel < 0.02


def test_w8a8_gemm_is_exact_at_the_extreme_codes(lib):
    """Every activation code at +-127 (bytes 255 and 1) against weight codes at +-64: the
    products vpmaddubsw adds in int16 pairs reach 2 * 255 * 64 = 32640 without saturating, so the
    int32 sums equal the exact integer product (a saturated pair would be off by thousands)."""
    m, n, k, gs = 5, 37, 136, 64
    g = torch.Generator().manual_seed(7)
    sign_a = torch.where(torch.rand(m, k, generator=g) < 0.5, -1.0, 1.0)
    sign_a[0] = 1.0  # a row of all +127 ...
    qw = torch.where(torch.rand(n, k, generator=g) < 0.5, -64, 64).to(torch.int8)
    qw[0] = 64  # ... times a column of all +64: the largest pair sums
    qw[1] = -64
    x = sign_a * 3.0  # every group's max |x| is 3: every code is +-127
    layer = W8A8Linear(qw, torch.ones(n), group_size=gs, lib=lib)
    codes, sa = cpu.quantize_act(x, gs, lib=lib)
    qa = _signed(codes, lib)
    assert set(qa[:, :k].unique().tolist()) == {-127, 127}
    ref = torch.zeros(m, n, dtype=torch.float64)
    for gi in range(sa.shape[1]):
        cols = slice(gi * gs, min((gi + 1) * gs, k))
        ref += (qa[:, cols] @ qw[:, cols].to(torch.int64).t()).double() * sa[:, gi].double()[:, None]
    out = layer(x)
    assert _rel(out, ref) < 1e-6
    assert out[0, 0].item() == pytest.approx(3.0 * 64 * k, rel=1e-6)


@pytest.mark.parametrize("bad", [65, -65, -128, 127])
def test_w8a8_weight_codes_outside_the_kernel_range_are_refused(lib, bad):
    q = torch.zeros(6, 10, dtype=torch.int8)
    q[4, 7] = bad
    with pytest.raises(ValueError, match=rf"\[-64, 64\].*row 4 column 7 holds {bad}"):
        W8A8Linear(q, torch.ones(6), group_size=8, lib=lib)
    q[4, 7] = 64
    W8A8Linear(q, torch.ones(6), group_size=8, lib=lib)  # the bound itself is accepted
    with pytest.raises(ValueError, match=r"scales must be finite; row 2 holds nan"):
        W8A8Linear(q, torch.tensor([1, 1, float("nan"), 1, 1, 1]), group_size=8, lib=lib)
    with pytest.raises(ValueError, match=r"q must be 2-D int8 codes \[out, in\], got torch.int8 of shape \(10,\)"):
        W8A8Linear(q[0], torch.ones(1), group_size=8, lib=lib)


AMX = pytest.mark.skipif(not (cpu.available() and cpu.w8a8_amx()),
                         reason="no AMX path for W8A8 here (no AMX-INT8, no tile grant from Linux, or TOKENMILL_AMX=0)")


@contextlib.contextmanager
def _amx(on: bool):
    """The native build's W8A8 GEMM with its AMX path on or off, restored after."""
    was = cpu.w8a8_amx()
    cpu.w8a8_amx(on)
    try:
        yield
    finally:
        cpu.w8a8_amx(was)


@AMX
@pytest.mark.parametrize("m", [1, 3, 17, 40, 64])
@pytest.mark.parametrize("n,k,group", [(33, 64, 64), (70, 130, 64), (100, 576, 64), (47, 1000, 64), (1000, 300, 128),
                                       (61, 200, 256)])
def test_w8a8_amx_path_equals_the_vpdpbusd_path_bit_for_bit(m, n, k, group):
    """The AMX tiles (TDPBUSD) and the AVX-512 VNNI kernel compute the same exact int32 group sums and
    the same fp32 operations in the same order, so W8A8Linear gives the same bits either way, with a
    bias and with a residual; N short of a panel, K short of 64 (the group's tail by vpdpbusd), one
    group or several, rows beyond the last whole 16 (by vpdpbusd). The tiles ran: for every whole 16
    rows, one block per panel and call."""
    g = torch.Generator().manual_seed(m * 7 + n + k)
    x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    layer = W8A8Linear.from_float(w, b, group)
    r = torch.randn(m, n, generator=g)
    with _amx(False):
        want, want_r = layer(x), layer(x, residual=r.clone())
    blocks = cpu.w8a8_amx_blocks()
    with _amx(True):
        got, got_r = layer(x), layer(x, residual=r.clone())
    assert torch.equal(got, want) and torch.equal(got_r, want_r)
    assert cpu.w8a8_amx_blocks() - blocks == 2 * (m // 16) * -(-n // cpu.nr())


@AMX
def test_w8a8_amx_path_is_exact_at_the_extreme_codes_and_on_two_threads():
    """Codes at +-127 x +-64 (the largest int32 group sums) and a call split over the pool's threads:
    still the same bits as the vpdpbusd path, and the integer product."""
    m, n, k, gs = 48, 130, 200, 64
    g = torch.Generator().manual_seed(9)
    x = torch.where(torch.rand(m, k, generator=g) < 0.5, -3.0, 3.0)
    qw = torch.where(torch.rand(n, k, generator=g) < 0.5, -64, 64).to(torch.int8)
    qw[0] = 64
    layer = W8A8Linear(qw, torch.ones(n), group_size=gs)
    cpu.set_num_threads(2)
    try:
        with _amx(False):
            want = layer(x)
        with _amx(True):
            got = layer(x)
    finally:
        cpu.set_num_threads(0)
    assert torch.equal(got, want)
    codes, sa = cpu.quantize_act(x, gs)
    qa = _signed(codes, None)[:, :k]
    ref = sum(((qa[:, c0:c0 + gs] @ qw[:, c0:c0 + gs].to(torch.int64).t()).double() * sa[:, c0 // gs].double()[:, None])
              for c0 in range(0, k, gs))
    assert _rel(got, ref) < 1e-6
    assert got[0, 0].item() == pytest.approx(64 * x[0].sum().item(), rel=1e-6)  # column 0: all +64


@AMX
def test_w8a8_amx_equals_a_build_without_amx():
    """The native build compiled without AMX (-mno-amx-tile -mno-amx-int8, as for a CPU that lacks it)
    compiles, has no AMX path, and its AVX-512 VNNI kernel gives the AMX path's bits."""
    noamx = cpu.library("native-noamx")
    if noamx is None:
        pytest.skip(cpu.why_unavailable("native-noamx"))
    assert not cpu.w8a8_amx(True, lib=noamx)
    g = torch.Generator().manual_seed(4)
    x, w, b = torch.randn(70, 300, generator=g), torch.randn(200, 300, generator=g), torch.randn(200, generator=g)
    q, s = quantize_w8a8(w)
    blocks = cpu.w8a8_amx_blocks()
    with _amx(True):
        got = W8A8Linear(q, s, b)(x)
    assert cpu.w8a8_amx_blocks() - blocks == 4 * 7  # 64 of the 70 rows on tiles, 7 panels
    assert torch.equal(got, W8A8Linear(q, s, b, lib=noamx)(x))


def test_w8a8_amx_switch_and_environment():
    """TOKENMILL_AMX=0 keeps a fresh process off the tiles; builds without AVX-512 never claim them."""
    assert not cpu.w8a8_amx(True, lib=cpu.library("generic"))
    code = "from engine.kernels import cpu; print(cpu.w8a8_amx())"
    env = {**os.environ, "TOKENMILL_AMX": "0"}
    off = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert off.stdout.strip() == "False"
    env.pop("TOKENMILL_AMX")
    on = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    with _amx(True):
        possible = cpu.w8a8_amx()
    assert on.stdout.strip() == str(possible)


@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (1, 17, 5), (3, 33, 64), (17, 1000, 130), (64, 4099, 72)])
@pytest.mark.parametrize("scheme", ["fp32", "int8", "int4-g32"])
def test_argmax_in_the_gemm_epilogue_equals_argmax_of_the_stored_logits(lib, m, n, k, scheme):
    """The LM head's fused greedy argmax sees the values the GEMM would store, bit for bit: the
    same token as argmax over the written logits, with the same columns masked to -inf."""
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    if scheme == "fp32":
        layer = CpuLinear(w, b, lib=lib)
    else:
        q = quantize_int8(w) if scheme == "int8" else quantize_int4(w, 32)
        q.bias = b
        layer = CpuQuantLinear(q, lib=lib)
    logits = layer(x)
    assert torch.equal(layer.argmax(x), cpu.argmax_rows(logits, lib=lib))
    # a vocabulary limit below n and per-row banned ids (an EOS suppressed), padded with -1
    limit = max(1, n - 7)
    top = cpu.argmax_rows(logits, lib=lib)
    ban = torch.full((m, 3), -1, dtype=torch.int64)
    ban[:, 0] = top
    ban[::2, 1] = 0
    want = logits.clone()
    want[:, limit:] = float("-inf")
    for r in range(m):
        for c in ban[r].tolist():
            if c >= 0:
                want[r, c] = float("-inf")
    assert torch.equal(layer.argmax(x, limit, ban), cpu.argmax_rows(want, lib=lib))


@pytest.mark.parametrize("m,k", [(1, 5), (3, 64), (17, 130), (64, 576), (270, 1000)])
@pytest.mark.parametrize("scheme", ["fp32", "fp32-bias", "int8", "int4-g32"])
def test_swiglu_in_the_gate_up_epilogue_equals_silu_mul_of_the_stored_product(lib, m, k, scheme):
    """gate/up with SwiGLU in its epilogue: bit for bit silu_mul over the stored [m, 2 inter]
    product (the Python layer loop and the C driver both take this path, so they still agree)."""
    nr = cpu.nr(lib)
    inter = 3 * nr
    g = torch.Generator().manual_seed(m * 31 + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(2 * inter, k, generator=g) * 2
    if scheme.startswith("fp32"):
        layer = CpuLinear(w, torch.randn(2 * inter, generator=g) if scheme == "fp32-bias" else None, lib=lib)
    else:
        q = quantize_int8(w) if scheme == "int8" else quantize_int4(w, 32)
        if scheme == "int4-g32" and k % 32:
            pytest.skip("int4 groups of 32 need k % 32 == 0")
        layer = CpuQuantLinear(q, lib=lib)
    assert layer.silu_fused
    want = cpu.silu_mul(layer(x), lib=lib)
    out = torch.full((m, inter + 3), 7.0)
    got = layer.silu_mul(x, out=out[:, :inter])
    assert torch.equal(got, want) and (out[:, inter:] == 7).all()


def test_swiglu_fusion_needs_a_half_width_of_whole_panels(lib):
    nr = cpu.nr(lib)
    odd = CpuLinear(torch.randn(2 * nr + 2, 8), lib=lib)
    assert not odd.silu_fused
    with pytest.raises(ValueError, match="cannot fuse SwiGLU"):
        odd.silu_mul(torch.randn(2, 8))
    with pytest.raises(ValueError, match="multiple of"):
        cpu.gemm_f32_silu(torch.randn(2, 8), odd.packed, nr + 1, lib=lib)


def test_fused_argmax_ties_nan_and_empty_rows(lib):
    x = torch.ones(1, 4)
    w = torch.zeros(70, 4)
    w[5] = w[66] = 1.0  # an exact tie between columns 5 and 66: the first wins, as torch.argmax
    assert CpuLinear(w, lib=lib).argmax(x).tolist() == [5]
    assert CpuLinear(w, lib=lib).argmax(x, ban=torch.tensor([[5]])).tolist() == [66]
    b = torch.full((70,), float("nan"))
    b[40] = -3.0  # a NaN never wins (the bias makes the logits NaN)
    assert CpuLinear(w, b, lib=lib).argmax(x).tolist() == [40]
    # nothing above -inf: 0, also when the only finite column is past the limit
    b = torch.full((70,), float("-inf"))
    assert CpuLinear(w, b, lib=lib).argmax(x).tolist() == [0]
    b[60] = 0.0
    assert CpuLinear(w, b, lib=lib).argmax(x, limit=50).tolist() == [0]
    lay = CpuLinear(w, lib=lib)
    with pytest.raises(ValueError, match="limit must be > 0"):
        lay.argmax(x, limit=0)
    with pytest.raises(ValueError, match="ban must be a contiguous int64"):
        lay.argmax(x, ban=torch.zeros(2, 1, dtype=torch.int64))


@pytest.mark.parametrize("scheme", ["fp32", "bf16", "int8", "int4-g32", "w8a8"])
def test_a_rows_result_does_not_depend_on_the_batch(lib, scheme):
    """Batch invariance: row r of x W^T is bit for bit the same computed alone or among M rows,
    for every tile height (speculative verification rows and plain decode rows of the same
    token must agree exactly)."""
    g = torch.Generator().manual_seed(11)
    k, n = 300, 97
    x, w = torch.randn(29, k, generator=g), torch.randn(n, k, generator=g)
    if scheme == "fp32":
        layer = CpuLinear(w, lib=lib)
    elif scheme == "bf16":
        layer = CpuBf16Linear(w, lib=lib)
    elif scheme == "w8a8":
        layer = W8A8Linear.from_float(w, lib=lib)
    else:
        layer = CpuQuantLinear(quantize_int8(w) if scheme == "int8" else quantize_int4(w, 32), lib=lib)
    alone = torch.cat([layer(x[i:i + 1]) for i in range(x.shape[0])])
    for m in (2, 3, 5, 10, 13, 29):
        assert torch.equal(layer(x[:m]), alone[:m]), m
    assert torch.equal(layer(x[7:20]), alone[7:20])


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_thread_count_does_not_change_a_bit(threads):
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(37, 300, generator=g), torch.randn(1000, 300, generator=g)
    layers = [CpuLinear(w), CpuBf16Linear(w), CpuQuantLinear(quantize_int4(w, 32)), W8A8Linear.from_float(w)]
    cpu.set_num_threads(1)
    one = [l(x) for l in layers]
    cpu.set_num_threads(threads)
    try:
        many = [l(x) for l in layers]
    finally:
        cpu.set_num_threads(0)
    assert all(torch.equal(a, b) for a, b in zip(one, many))


def _gemm_in_child(q):
    x, w = torch.ones(4, 64), torch.ones(80, 64)
    q.put(float(CpuLinear(w)(x).sum()))


def test_pool_works_in_a_forked_child():
    # the parent's pool has running workers; a forked child has none and must start its own
    CpuLinear(torch.ones(80, 64))(torch.ones(40, 64))
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_gemm_in_child, args=(q,))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    assert q.get(timeout=5) == 4 * 80 * 64


def test_bad_arguments_are_refused_with_names():
    lay = CpuLinear(torch.randn(8, 16))
    with pytest.raises(ValueError, match="x must be a 2-D torch.float32"):
        lay(torch.randn(2, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match="does not match n=8, k=15"):
        lay(torch.randn(2, 15))
    with pytest.raises(ValueError, match=r"out must be \[2, 8\]"):
        lay(torch.randn(2, 16), out=torch.empty(2, 9))
    with pytest.raises(ValueError, match="bad quantized weight"):
        cpu.pack_q(torch.zeros(4, 48, dtype=torch.int8), torch.ones(4, 1), None, 8, 32)
    with pytest.raises(ValueError, match="refused kpad=12, group_size=6"):  # 4-bit groups: a multiple of 4
        cpu.pack_q(torch.zeros(4, 12, dtype=torch.uint8), torch.ones(4, 2), None, 4, 6)
    with pytest.raises(ValueError, match="multiple of 4"):
        cpu.quantize_act(torch.zeros(2, 8), 6)
    with pytest.raises(ValueError, match="multiple of 4"):
        W8A8Linear.from_float(torch.zeros(4, 8), group_size=6)
    assert isinstance(quantize_int8(torch.randn(4, 8)), QuantLinear)


# ----------------------------------------------------------------- bf16 weights (TM_W_BF16, CpuBf16Linear)
# Their definition is `cpu.gemm_bf16_reference`: activations rounded to bf16 (`cpu.to_bf16`), the exact
# bf16 products summed in float64. Besides the builds above, AVX-512 without AVX512-BF16 (bf16 widened
# to fp32 in registers) where the host has AVX-512; odd shapes: M = 1, 3, 17, 300; K and N not
# multiples of 16 or 32.
HOST = Host.current()
AVX512 = {"avx512f", "avx512bw", "avx512vl"} <= FLAGS
BF16_VARIANTS = VARIANTS + [pytest.param("native-nobf16", id="avx512-widened",
                                         marks=pytest.mark.skipif(not AVX512, reason="no AVX-512 on this host"))]
BF16_SHAPES = [(1, 1, 1), (1, 5, 7), (3, 33, 17), (17, 130, 100), (300, 577, 65), (64, 1536, 70)]


@pytest.fixture(scope="module", params=BF16_VARIANTS)
def blib(request):
    lib = cpu.library(request.param)
    if lib is None:
        pytest.skip(cpu.why_unavailable(request.param))
    return lib


def test_the_native_build_uses_vdpbf16ps_exactly_where_the_host_has_it():
    assert cpu.bf16_native() == HOST.avx512_bf16
    assert not cpu.bf16_native(cpu.library("generic"))
    if AVX512:
        assert not cpu.bf16_native(cpu.library("native-nobf16"))


@pytest.mark.skipif(not HOST.avx512_bf16, reason="the host has no AVX512-BF16 (VDPBF16PS)")
def test_vdpbf16ps_path_agrees_with_the_widened_path():
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(37, 300, generator=g), torch.randn(90, 300, generator=g)
    native = CpuBf16Linear(w)(x)
    widened = CpuBf16Linear(w, lib=cpu.library("native-nobf16"))(x)
    assert _rel(native, widened) < 2 * _tol(300)


# AMX-BF16 tiles (gemm.c's amx_bf16_rows) take every call of a weight whose K is a multiple of 32
AMX_SHAPES = [(1, 32, 1), (1, 64, 33), (3, 96, 17), (17, 128, 100), (300, 576, 65), (64, 1536, 70)]
needs_amx_bf16 = pytest.mark.skipif(not cpu.bf16_amx(), reason="the host has no AMX-BF16 (or Linux did not "
                                    "grant the tile state)")


@contextlib.contextmanager
def _bf16_amx(on: bool):
    before = cpu.bf16_amx()
    cpu.bf16_amx(on)
    try:
        yield
    finally:
        cpu.bf16_amx(before)


def test_the_native_build_runs_bf16_on_amx_tiles_exactly_where_the_host_has_them():
    assert cpu.bf16_amx() == (HOST.amx_bf16 and os.environ.get("TOKENMILL_AMX") != "0")
    assert not cpu.bf16_amx(lib=cpu.library("generic"))
    if AVX512:
        assert not cpu.bf16_amx(lib=cpu.library("native-noamx"))


@needs_amx_bf16
@pytest.mark.parametrize("m,k,n", AMX_SHAPES)
def test_amx_bf16_gemm_matches_its_definition_and_the_vdpbf16ps_path(m, k, n):
    g = torch.Generator().manual_seed(m * 7 + k + n)
    x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    layer = CpuBf16Linear(w, b)
    calls = cpu.bf16_amx_calls()
    y = layer(x)
    assert cpu.bf16_amx_calls() == calls + 1
    ref = cpu.gemm_bf16_reference(x, w) + b.double()
    assert _rel(y, ref) < _tol(k)
    with _bf16_amx(False):
        vdp = layer(x)
    assert cpu.bf16_amx_calls() == calls + 1
    assert _rel(y, vdp) < 2 * _tol(k)
    # batch invariance: a row alone, and the rows in a call twice as tall, give the same bits
    for r in sorted({0, m // 2, m - 1}):
        assert torch.equal(layer(x[r:r + 1].clone())[0], y[r])
    assert torch.equal(layer(torch.cat([x, x.flip(0)]))[:m], y)
    # the fused epilogues on the tiles
    assert torch.equal(layer.argmax(x), cpu.argmax_rows(y))
    # without a bias whole panels go from the tiles into y, the residual add starting from y; the rows past
    # the last whole 16 take a staging tile with the same arithmetic
    plain = CpuBf16Linear(w)
    res = torch.randn(m, n, generator=g)
    got = plain(x, residual=res.clone())
    assert _rel(got, cpu.gemm_bf16_reference(x, w) + res.double()) < _tol(k)
    for r in sorted({0, m // 2, m - 1}):
        assert torch.equal(plain(x[r:r + 1].clone(), residual=res[r:r + 1].clone())[0], got[r])
    assert torch.equal(plain(x), plain(torch.cat([x, x]))[:m])


@needs_amx_bf16
def test_amx_bf16_swiglu_and_odd_k():
    inter = 2 * cpu.nr()
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(19, 64, generator=g), torch.randn(2 * inter, 64, generator=g)
    layer = CpuBf16Linear(w)
    assert torch.equal(layer.silu_mul(x), cpu.silu_mul(layer(x)))
    # K not a multiple of 32 stays on VDPBF16PS (every call of that weight alike)
    calls = cpu.bf16_amx_calls()
    odd = CpuBf16Linear(torch.randn(40, 48, generator=g))
    xo = torch.randn(33, 48, generator=g)
    assert _rel(odd(xo), cpu.gemm_bf16_reference(xo, odd.dequantize())) < _tol(48)
    assert cpu.bf16_amx_calls() == calls


@pytest.mark.parametrize("m,k,n", BF16_SHAPES)
def test_bf16_gemm_matches_its_float64_definition(blib, m, k, n):
    g = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
    x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    layer = CpuBf16Linear(w, b, lib=blib)
    ref = cpu.gemm_bf16_reference(x, w)
    assert _rel(layer(x), ref + b.double()) < _tol(k)
    # the bf16 rounding is real: the fp32 product differs by far more than the sum's rounding
    if k >= 33:
        assert _rel(x.double() @ w.double().t(), ref) > 100 * _tol(k)
    # the residual add is fused: residual += x W^T + b
    r = torch.randn(m, n, generator=g)
    assert _rel(layer(x, residual=r.clone()), ref + b.double() + r.double()) < _tol(k)
    # strided operands: x and y as column slices of wider buffers, nothing written outside
    xs = torch.randn(m, k + 7, generator=g)
    xs[:, 3:3 + k] = x
    ys = torch.full((m, n + 5), 7.0)
    cpu.gemm_bf16(xs[:, 3:3 + k], layer.packed, n, None, ys[:, 2:2 + n], lib=blib)
    assert _rel(ys[:, 2:2 + n], ref) < _tol(k)
    assert (ys[:, :2] == 7).all() and (ys[:, 2 + n:] == 7).all()


def test_activation_rounding_is_nearest_even_with_denormals_to_zero(blib):
    tiny = torch.finfo(torch.float32).tiny
    one_ulp = 2.0 ** -7  # bf16's spacing at 1.0
    special = torch.tensor([1.0 + one_ulp / 2, 1.0 + 3 * one_ulp / 2, -(1.0 + one_ulp / 2), 1.0 + one_ulp / 2 + 1e-6,
                            tiny / 4, -tiny / 8, tiny, 3.0e38, float("inf"), -float("inf"), 0.0, -0.0])
    x = torch.cat([special, torch.randn(45) * 100]).view(1, -1)  # 57 values: a vector body and a tail
    got, want = cpu.cast_bf16(x, lib=blib), cpu.to_bf16(x)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert got[0, :4].float().tolist() == [1.0, 1.0 + 2 * one_ulp, -1.0, 1.0 + one_ulp]  # ties to even
    assert got[0, 4].item() == 0.0 and str(got[0, 5].item()) == "-0.0"  # denormals flush to signed zero
    nan = cpu.cast_bf16(torch.tensor([[float("nan")]]), lib=blib)
    assert torch.isnan(nan).all()


def test_weights_are_packed_as_their_bf16_values(blib):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(45, 37, generator=g)
    layer = CpuBf16Linear(w, lib=blib)
    assert torch.equal(layer.dequantize(), w.bfloat16().float())
    assert layer.weight.dtype == torch.bfloat16
    assert layer.weight_bytes() == blib.tm_pack_bf16_size(45, 37)


@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (1, 17, 5), (3, 33, 64), (17, 1000, 130), (64, 4099, 72)])
def test_bf16_argmax_in_the_epilogue_equals_argmax_of_the_stored_logits(blib, m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    layer = CpuBf16Linear(w, b, lib=blib)
    logits = layer(x)
    assert torch.equal(layer.argmax(x), cpu.argmax_rows(logits, lib=blib))
    limit = max(1, n - 7)
    top = cpu.argmax_rows(logits, lib=blib)
    ban = torch.full((m, 2), -1, dtype=torch.int64)
    ban[:, 0] = top
    want = logits.clone()
    want[:, limit:] = float("-inf")
    want[torch.arange(m), top] = float("-inf")
    assert torch.equal(layer.argmax(x, limit, ban), cpu.argmax_rows(want, lib=blib))


@pytest.mark.parametrize("m,k", [(1, 5), (3, 64), (17, 131), (64, 576), (270, 1000)])
def test_bf16_swiglu_in_the_epilogue_equals_silu_mul_of_the_stored_product(blib, m, k):
    inter = 3 * cpu.nr(blib)
    g = torch.Generator().manual_seed(m * 31 + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(2 * inter, k, generator=g) * 2
    layer = CpuBf16Linear(w, torch.randn(2 * inter, generator=g), lib=blib)
    assert layer.silu_fused
    want = cpu.silu_mul(layer(x), lib=blib)
    out = torch.full((m, inter + 3), 7.0)
    got = layer.silu_mul(x, out=out[:, :inter])
    assert torch.equal(got, want) and (out[:, inter:] == 7).all()
    with pytest.raises(ValueError, match="multiple of"):
        cpu.gemm_bf16_silu(x, CpuBf16Linear(torch.randn(2 * inter + 2, k), lib=blib).packed, inter + 1, lib=blib)


def test_bf16_bad_arguments_are_refused_with_names():
    layer = CpuBf16Linear(torch.randn(40, 24))
    with pytest.raises(ValueError, match="packed bf16 weight of .* does not match n=40, k=25"):
        cpu.gemm_bf16(torch.randn(2, 25), layer.packed, 40)
    with pytest.raises(ValueError, match="x must be a 2-D torch.float32"):
        cpu.gemm_bf16(torch.randn(2, 24, dtype=torch.float64), layer.packed, 40)
    with pytest.raises(ValueError, match="accumulate needs out"):
        cpu.gemm_bf16(torch.randn(2, 24), layer.packed, 40, accumulate=True)
    with pytest.raises(ValueError, match="w must be a 2-D CPU tensor"):
        cpu.pack_bf16(torch.randn(3))


def test_use_cpu_kernels_swaps_in_bf16_layers_on_request():
    from engine.models.llama import LlamaModel
    from engine.weights import ModelConfig

    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=8, max_position_embeddings=128)
    model = LlamaModel(cfg, torch.float32, torch.device("cpu"))
    model.init_dummy(0)
    weights = {name: lin.weight.data.clone() for name, lin in model.linear_layers()}
    swapped = use_cpu_kernels(model, weight_dtype=torch.bfloat16)
    assert set(swapped.values()) == {"CpuBf16Linear"} and set(swapped) == set(weights)
    for name, lin in model.linear_layers():
        assert torch.equal(lin.dequantize(), weights[name].bfloat16().float())
    with pytest.raises(ValueError, match="float32 or bfloat16 weights"):
        use_cpu_kernels(model, weight_dtype=torch.float16)
    assert not isinstance(model.lm_head, CpuLinear)
