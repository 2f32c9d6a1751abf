"""The Triton W8A8 GEMM and activation quantizer (engine/kernels/w8a8_gemm.py) under the interpreter,
against their PyTorch references and against the CPU kernel library's W8A8 on the same codes."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are decorated; compiled on CUDA

from engine.kernels.w8a8_gemm import (W8A8TritonLinear, quantize_act, quantize_act_ref, w8a8_matmul,  # noqa: E402
                                      w8a8_matmul_ref)

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("m,k,gs", [(1, 40, 32), (3, 64, 16), (17, 100, 64)])
def test_activation_codes_and_scales_equal_the_reference(m, k, gs):
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).to(DEV) * 3
    x[0, :4] = torch.tensor([0.5, -0.5, 1.5, 2.5]) * x[0, : min(gs, k)].abs().max().cpu() / 127  # near halves
    codes, scales = quantize_act(x, gs)
    ref_codes, ref_scales = quantize_act_ref(x, gs)
    assert codes.dtype == torch.int8 and scales.shape == (m, -(-k // gs))
    assert torch.equal(codes, ref_codes) and torch.equal(scales, ref_scales)


@pytest.mark.parametrize("m,n,k", [(1, 17, 40), (5, 70, 128), (17, 33, 100), (40, 64, 64)])
def test_gemm_equals_the_grouped_integer_product(m, n, k):
    g = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=g).to(DEV)
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8).to(DEV)
    ws, b = torch.rand(n, generator=g).to(DEV), torch.randn(n, generator=g).to(DEV)
    codes, scales = quantize_act(x, 32)
    got = w8a8_matmul(codes, scales, w, ws, 32, b)
    want = w8a8_matmul_ref(codes, scales, w, ws, 32, b)
    assert (got - want).abs().max().item() <= 1e-6 * want.abs().max().item()


def test_layer_matches_the_cpu_kernels_w8a8():
    """Same weight, same input: the Triton layer and the CPU kernel library's W8A8Linear agree
    (the same codes, the same int32 sums, fp32 epilogues)."""
    from engine.kernels import cpu

    if not cpu.available():
        pytest.skip(cpu.why_unavailable())
    from engine.kernels.cpu.layers import W8A8Linear

    g = torch.Generator().manual_seed(1)
    w, x, b = torch.randn(48, 128, generator=g), torch.randn(7, 128, generator=g), torch.randn(48, generator=g)
    tri = W8A8TritonLinear.from_float(w.to(DEV), b.to(DEV), 64)
    ref = W8A8Linear.from_float(w, b, 64)
    assert torch.equal(tri.weight.cpu(), ref.weight) and torch.equal(tri.scale.cpu(), ref.scale)
    got = tri(x.to(DEV)).cpu()
    assert (got - ref(x)).abs().max().item() < 1e-5 * ref(x).abs().max().item()
    r = torch.randn(7, 48, generator=g)
    assert torch.allclose(tri(x.to(DEV), residual=r.clone().to(DEV)).cpu(), got + r, atol=1e-5)


def test_bad_group_size_is_refused():
    codes, scales = quantize_act(torch.zeros(2, 48, device=DEV), 16)
    with pytest.raises(ValueError, match="power-of-two group_size"):
        w8a8_matmul(codes, scales, torch.zeros(4, 48, dtype=torch.int8, device=DEV), torch.ones(4, device=DEV), 24)
