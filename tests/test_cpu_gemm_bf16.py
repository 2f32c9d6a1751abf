"""bf16 linear layers of the CPU kernel library (`gemm.c`'s TM_W_BF16, `CpuBf16Linear`) against their
definition, `cpu.gemm_bf16_reference`: activations rounded to bf16 (`cpu.to_bf16`), the exact bf16
products summed in float64.

Every build this machine runs is checked: the native one (VDPBF16PS where the CPU has AVX512-BF16),
AVX-512 without AVX512-BF16 (bf16 widened to fp32 in registers), AVX2 and plain C, on odd shapes
(M = 1, 3, 17, 300; K and N not multiples of 16 or 32)."""
from __future__ import annotations

import pytest
import torch

from engine.host import Host
from engine.kernels import cpu
from engine.kernels.cpu import build
from engine.kernels.cpu.layers import CpuBf16Linear, CpuLinear, use_cpu_kernels

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"no CPU kernels: {cpu.why_unavailable()}")

HOST = Host.current()
FLAGS = build.cpu_flags()
AVX512 = {"avx512f", "avx512bw", "avx512vl"} <= FLAGS
VARIANTS = [
    pytest.param("native", id="native"),
    pytest.param("native-nobf16", id="avx512-widened",
                 marks=pytest.mark.skipif(not AVX512, reason="no AVX-512 on this host")),
    pytest.param("avx2", id="avx2", marks=pytest.mark.skipif(not {"avx2", "fma"} <= FLAGS, reason="no AVX2/FMA")),
    pytest.param("generic", id="generic"),
]
# odd M, K and N; (300, 577, 65): two row blocks and K in slices with a remainder
SHAPES = [(1, 1, 1), (1, 5, 7), (3, 33, 17), (17, 130, 100), (300, 577, 65), (64, 1536, 70)]


@pytest.fixture(scope="module", params=VARIANTS)
def lib(request):
    lib = cpu.library(request.param)
    if lib is None:
        pytest.skip(cpu.why_unavailable(request.param))
    return lib


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def _tol(k: int) -> float:
    """fp32 sums of k exact products against float64: 1e-6 of the largest value up to k = 600."""
    return 1e-6 * max(1.0, k / 600)


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


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_bf16_gemm_matches_its_float64_definition(lib, m, k, n):
    g = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
    x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    layer = CpuBf16Linear(w, b, lib=lib)
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
    cpu.gemm_bf16(xs[:, 3:3 + k], layer.packed, n, None, ys[:, 2:2 + n], lib=lib)
    assert _rel(ys[:, 2:2 + n], ref) < _tol(k)
    assert (ys[:, :2] == 7).all() and (ys[:, 2 + n:] == 7).all()


def test_activation_rounding_is_nearest_even_with_denormals_to_zero(lib):
    tiny = torch.finfo(torch.float32).tiny
    one_ulp = 2.0 ** -7  # bf16's spacing at 1.0
    special = torch.tensor([1.0 + one_ulp / 2, 1.0 + 3 * one_ulp / 2, -(1.0 + one_ulp / 2), 1.0 + one_ulp / 2 + 1e-6,
                            tiny / 4, -tiny / 8, tiny, 3.0e38, float("inf"), -float("inf"), 0.0, -0.0])
    x = torch.cat([special, torch.randn(45) * 100]).view(1, -1)  # 57 values: a vector body and a tail
    got, want = cpu.cast_bf16(x, lib=lib), cpu.to_bf16(x)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert got[0, :4].float().tolist() == [1.0, 1.0 + 2 * one_ulp, -1.0, 1.0 + one_ulp]  # ties to even
    assert got[0, 4].item() == 0.0 and str(got[0, 5].item()) == "-0.0"  # denormals flush to signed zero
    nan = cpu.cast_bf16(torch.tensor([[float("nan")]]), lib=lib)
    assert torch.isnan(nan).all()


def test_weights_are_packed_as_their_bf16_values(lib):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(45, 37, generator=g)
    layer = CpuBf16Linear(w, lib=lib)
    assert torch.equal(layer.dequantize(), w.bfloat16().float())
    assert layer.weight.dtype == torch.bfloat16
    assert layer.weight_bytes() == lib.tm_pack_bf16_size(45, 37)


@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (1, 17, 5), (3, 33, 64), (17, 1000, 130), (64, 4099, 72)])
def test_argmax_in_the_epilogue_equals_argmax_of_the_stored_logits(lib, m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    layer = CpuBf16Linear(w, b, lib=lib)
    logits = layer(x)
    assert torch.equal(layer.argmax(x), cpu.argmax_rows(logits, lib=lib))
    limit = max(1, n - 7)
    top = cpu.argmax_rows(logits, lib=lib)
    ban = torch.full((m, 2), -1, dtype=torch.int64)
    ban[:, 0] = top
    want = logits.clone()
    want[:, limit:] = float("-inf")
    want[torch.arange(m), top] = float("-inf")
    assert torch.equal(layer.argmax(x, limit, ban), cpu.argmax_rows(want, lib=lib))


@pytest.mark.parametrize("m,k", [(1, 5), (3, 64), (17, 131), (64, 576), (270, 1000)])
def test_swiglu_in_the_epilogue_equals_silu_mul_of_the_stored_product(lib, m, k):
    inter = 3 * cpu.nr(lib)
    g = torch.Generator().manual_seed(m * 31 + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(2 * inter, k, generator=g) * 2
    layer = CpuBf16Linear(w, torch.randn(2 * inter, generator=g), lib=lib)
    assert layer.silu_fused
    want = cpu.silu_mul(layer(x), lib=lib)
    out = torch.full((m, inter + 3), 7.0)
    got = layer.silu_mul(x, out=out[:, :inter])
    assert torch.equal(got, want) and (out[:, inter:] == 7).all()
    with pytest.raises(ValueError, match="multiple of"):
        cpu.gemm_bf16_silu(x, CpuBf16Linear(torch.randn(2 * inter + 2, k), lib=lib).packed, inter + 1, lib=lib)


def test_a_rows_result_does_not_depend_on_the_batch(lib):
    """Batch invariance, as the fp32 kernel: row r is bit for bit the same alone or among M rows
    (speculative verification and plain decoding of the same token agree exactly)."""
    g = torch.Generator().manual_seed(11)
    x, w = torch.randn(29, 301, generator=g), torch.randn(97, 301, generator=g)
    layer = CpuBf16Linear(w, lib=lib)
    alone = torch.cat([layer(x[i:i + 1]) for i in range(x.shape[0])])
    for m in (2, 3, 5, 10, 13, 29):
        assert torch.equal(layer(x[:m]), alone[:m]), m
    assert torch.equal(layer(x[7:20]), alone[7:20])


@pytest.mark.parametrize("threads", [1, 3])
def test_thread_count_does_not_change_a_bit(threads):
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(37, 300, generator=g), torch.randn(1000, 300, generator=g)
    layer = CpuBf16Linear(w)
    cpu.set_num_threads(1)
    one = layer(x)
    cpu.set_num_threads(threads)
    try:
        many = layer(x)
    finally:
        cpu.set_num_threads(0)
    assert torch.equal(one, many)


def test_bad_arguments_are_refused_with_names():
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
