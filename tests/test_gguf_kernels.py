"""GGUF block types through our layers, on odd shapes, against PyTorch float64 references.

Every type `engine.quant.gguf_blocks_to_parts` maps (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) is
fed random valid blocks; the reference is y = x @ W.T in float64 with W = `gguf.quants.dequantize` of
the same blocks. M = 1, 3, 17 rows; N = 37 outputs (not a multiple of 16); K = 96 and 160 for the
32-element blocks, 256 and 768 for the K-quants (whose super-blocks are 256 wide).

Tolerances (max |y - ref| over max |ref|):
- fp32 arithmetic on the exact weights (`QuantLinear`'s PyTorch path; the C kernel for 8-bit codes,
  dequantized in registers): 5e-6, a few fp32 roundings of sums of at most 768 products.
- the C kernel for 4-bit codes (Q4_0, Q4_1, Q4_K) rounds x to int8 per row and group of 32 first
  (llama.cpp's Q4 x Q8 product): 2e-6 against `cpu.gemm_q4_reference` (that product in float64), and
  within 3% of the float product (the activations' rounding; measured up to 1.2% here).
Plus the C kernel's SwiGLU and argmax epilogues on K-quant layers, and a Q4_K_M-style fused qkv
(Q4_K, Q4_K, Q6_K).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import gguf
from engine.kernels import cpu
from engine.quant import GGUF_MAPPING, QuantLinear, concat_rows, gguf_blocks_to_parts, parts_to_layer, unpack_int4

# type -> (bytes per block, elements per block, byte offsets of its fp16 scale fields)
BLOCKS = {"Q8_0": (34, 32, [0]), "Q4_0": (18, 32, [0]), "Q4_1": (20, 32, [0, 2]), "Q5_0": (22, 32, [0]),
          "Q5_1": (24, 32, [0, 2]), "Q4_K": (144, 256, [0, 2]), "Q5_K": (176, 256, [0, 2]), "Q6_K": (210, 256, [208])}
SMALL, KQUANTS = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"], ["Q4_K", "Q5_K", "Q6_K"]
FP32_TOL, Q4_TOL, Q4_FLOAT_TOL = 5e-6, 2e-6, 0.03

needs_kernels = pytest.mark.skipif(not cpu.available(), reason=f"no CPU kernels: {cpu.why_unavailable()}")


def random_blocks(type_name: str, out: int, n_in: int, seed: int = 0) -> np.ndarray:
    """uint8 [out, bytes per row]: random bytes, with the fp16 scale fields finite in [-0.05, 0.05]."""
    size, per_block, fp16_at = BLOCKS[type_name]
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (out * n_in // per_block, size), dtype=np.uint8)
    for p in fp16_at:
        b[:, p : p + 2] = rng.uniform(-0.05, 0.05, len(b)).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return b.reshape(out, -1)


def reference_weight(blocks: np.ndarray, type_name: str, out: int, n_in: int) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[type_name]).reshape(out, n_in))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def _layer(type_name: str, out: int, n_in: int, seed: int = 0) -> tuple[QuantLinear, torch.Tensor]:
    blocks = random_blocks(type_name, out, n_in, seed)
    return parts_to_layer(gguf_blocks_to_parts(blocks, type_name, out, n_in)), reference_weight(blocks, type_name,
                                                                                                  out, n_in)


CASES = [(t, k) for t in SMALL for k in (96, 160)] + [(t, k) for t in KQUANTS for k in (256, 768)]


@pytest.mark.parametrize("type_name,k", CASES)
def test_blocks_reconstruct_bit_for_bit(type_name, k):
    layer, w = _layer(type_name, 37, k)
    assert torch.equal(layer.dequantize(), w)
    assert type_name in GGUF_MAPPING


@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("type_name,k", CASES)
def test_pytorch_quantlinear_matches_float64(type_name, k, m):
    layer, w = _layer(type_name, 37, k, seed=k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    assert _rel(layer(x), x.double() @ w.double().T) < FP32_TOL


@needs_kernels
@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("type_name,k", CASES)
def test_c_kernel_matches_float64(type_name, k, m):
    from engine.kernels.cpu.layers import CpuQuantLinear

    q, w = _layer(type_name, 37, k, seed=k + 1)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + 100))
    exact = x.double() @ w.double().T
    got = CpuQuantLinear(q)(x)
    if q.bits == 4:
        ref = cpu.gemm_q4_reference(x, unpack_int4(q.weight, q.group_size), q.scale, q.min, q.group_size)
        assert _rel(got, ref) < Q4_TOL
        assert _rel(got, exact) < Q4_FLOAT_TOL
    else:
        assert _rel(got, exact) < FP32_TOL
    # the residual add fused into the store
    r = torch.randn(m, 37, generator=torch.Generator().manual_seed(7))
    assert _rel(CpuQuantLinear(q)(x, residual=r.clone()), got.double() + r.double()) < FP32_TOL


@needs_kernels
@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("m", [1, 3, 17])
def test_swiglu_epilogue_on_a_kquant_gate_up(type_name, m):
    """silu(x Wg^T) * (x Wu^T) in the GEMM's epilogue: bit for bit silu_mul of the stored product, and
    the float64 SwiGLU of the dequantized weights within the layer's tolerance."""
    from engine.kernels.cpu.layers import CpuQuantLinear

    inter, k = 3 * cpu.nr(), 256
    gate, wg = _layer(type_name, inter, k, seed=1)
    up, wu = _layer(type_name, inter, k, seed=2)
    layer = CpuQuantLinear(parts_to_layer(concat_rows([gguf_blocks_to_parts(random_blocks(type_name, inter, k, s),
                                                                            type_name, inter, k) for s in (1, 2)])))
    assert layer.silu_fused
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    got = layer.silu_mul(x)
    assert torch.equal(got, cpu.silu_mul(layer(x)))
    g, u = x.double() @ wg.double().T, x.double() @ wu.double().T
    want = torch.nn.functional.silu(g) * u
    assert _rel(got, want) < (Q4_FLOAT_TOL if layer.bits == 4 else FP32_TOL)


@needs_kernels
@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("m", [1, 3, 17])
def test_argmax_epilogue_on_a_kquant_head(type_name, m):
    """The LM head's fused argmax over 1000 columns (not a multiple of the panel width): the token of
    argmax over the logits the layer stores, and the float64 argmax where its top-2 margin exceeds the
    layer's error."""
    from engine.kernels.cpu.layers import CpuQuantLinear

    q, w = _layer(type_name, 1000, 256, seed=5)
    layer = CpuQuantLinear(q)
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m))
    logits = layer(x)
    got = layer.argmax(x)
    assert torch.equal(got, cpu.argmax_rows(logits))
    exact = x.double() @ w.double().T
    top2 = exact.topk(2, dim=1).values
    err = (logits.double() - exact).abs().max().item()
    clear = (top2[:, 0] - top2[:, 1]) > 2 * err
    assert clear.any()
    assert torch.equal(got[clear], exact.argmax(dim=1)[clear])


@needs_kernels
@pytest.mark.parametrize("m", [1, 3, 17])
def test_mixed_q4_k_m_qkv_through_the_c_kernel(m):
    """A fused qkv as Q4_K_M files hold it (q, k in Q4_K, v in Q6_K): one layer of int8 codes, groups of
    16 with mins (concat_rows), equal to the three float64 products."""
    from engine.kernels.cpu.layers import CpuQuantLinear

    k, rows, types = 256, (36, 18, 18), ("Q4_K", "Q4_K", "Q6_K")
    blocks = [random_blocks(t, r, k, seed=i) for i, (t, r) in enumerate(zip(types, rows))]
    fused = concat_rows([gguf_blocks_to_parts(b, t, r, k) for b, t, r in zip(blocks, types, rows)])
    assert (fused.bits, fused.group_size, fused.min is not None) == (8, 16, True)
    w = torch.cat([reference_weight(b, t, r, k) for b, t, r in zip(blocks, types, rows)])
    layer = CpuQuantLinear(parts_to_layer(fused))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    assert _rel(layer(x), x.double() @ w.double().T) < FP32_TOL
    assert torch.equal(layer.dequantize(), w)
