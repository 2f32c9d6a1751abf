"""The CPU kernel library's small ops (engine/kernels/cpu/ops.c) and the model's ops seam:
each op against its PyTorch reference (`engine.models.ops.TorchOps`) in every build the
machine runs, and the model forward with the C ops against the reference forward."""
from __future__ import annotations

import pytest
import torch

from engine.attention.torch_quant_kv import TorchQuantKVAttentionBackend
from engine.kernels import cpu
from engine.models.ops import CpuOps, TorchOps, select_ops

from test_cpu_gemm import VARIANTS

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"no CPU kernels: {cpu.why_unavailable()}")


@pytest.fixture(scope="module", params=VARIANTS)
def lib(request):
    lib = cpu.library(request.param)
    if lib is None:
        pytest.skip(cpu.why_unavailable(request.param))
    return lib


@pytest.mark.parametrize("m,k", [(1, 1), (3, 17), (17, 64), (40, 576), (2000, 33)])
def test_rms_norm(lib, m, k):
    g = torch.Generator().manual_seed(k)
    x, w = torch.randn(m, k, generator=g) * 3, torch.randn(k, generator=g)
    got = CpuOps(lib).rms_norm(x, w, 1e-5)
    want = TorchOps.rms_norm(x.double(), w.double(), 1e-5)
    assert (got.double() - want).abs().max().item() < 1e-5 * want.abs().max().item()
    # strided rows in, a column slice of a wider buffer out
    xs = torch.randn(m, k + 3, generator=g)
    out = torch.zeros(m, k + 4)
    cpu.rms_norm(xs[:, 1:1 + k], w, 1e-5, out=out[:, 2:2 + k], lib=lib)
    assert torch.allclose(out[:, 2:2 + k], TorchOps.rms_norm(xs[:, 1:1 + k], w, 1e-5), rtol=1e-5, atol=1e-6)
    assert (out[:, :2] == 0).all() and (out[:, 2 + k:] == 0).all()


@pytest.mark.parametrize("m,n", [(1, 1), (3, 17), (64, 1536), (1500, 40)])
def test_silu_mul(lib, m, n):
    gu = torch.randn(m, 2 * n, generator=torch.Generator().manual_seed(n)) * 6
    got = CpuOps(lib).silu_mul(gu)
    want = TorchOps.silu_mul(gu.double())
    assert (got.double() - want).abs().max().item() < 1e-5 * max(1.0, want.abs().max().item())


@pytest.mark.parametrize("t,hq,hkv,d", [(1, 1, 1, 2), (5, 9, 3, 64), (17, 4, 2, 20), (1200, 2, 1, 128)])
def test_rope_in_place_on_fused_qkv_rows(lib, t, hq, hkv, d):
    g = torch.Generator().manual_seed(t + d)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g)
    positions = torch.randint(0, 5000, (t,), generator=g)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = torch.outer(torch.arange(5000, dtype=torch.float64), inv)
    cos, sin = ang.cos().float().contiguous(), ang.sin().float().contiguous()

    def views(buf):
        return (buf[:, : hq * d].view(t, hq, d), buf[:, hq * d: (hq + hkv) * d].view(t, hkv, d))

    ref = qkv.clone()
    TorchOps.rope_(*views(ref), positions, cos, sin)
    got = qkv.clone()
    CpuOps(lib).rope_(*views(got), positions, cos, sin)
    assert (got - ref).abs().max().item() < 1e-5
    assert torch.equal(got[:, (hq + hkv) * d:], qkv[:, (hq + hkv) * d:])  # v untouched


@pytest.mark.parametrize("dtype", ["float32", "int8", "float16"])
@pytest.mark.parametrize("t,d", [(7, 64), (37, 64), (5, 20)])
def test_kv_write_matches_the_reference_codec(lib, dtype, t, d):
    g = torch.Generator().manual_seed(1)
    hkv, slots = 3, 64
    qkv = torch.randn(t, (9 + 2 * hkv) * d, generator=g) * 4
    qkv[1, 9 * d: (9 + hkv) * d] = 0.0  # all-zero K rows: the scale's floor
    k = qkv[:, 9 * d: (9 + hkv) * d].view(t, hkv, d)
    v = qkv[:, (9 + hkv) * d:].view(t, hkv, d)
    slot_mapping = torch.tensor([3, 0, 63, 17, 18, 40, 5]) if t == 7 else torch.randperm(slots, generator=g)[:t]
    if dtype == "float32":
        kc, vc = torch.zeros(hkv, slots, d), torch.zeros(hkv, slots, d)
        want_k, want_v = kc.clone(), vc.clone()
        want_k.index_copy_(1, slot_mapping, k.transpose(0, 1))
        want_v.index_copy_(1, slot_mapping, v.transpose(0, 1))
    elif dtype == "float16":  # the bits torch's conversion gives (round to nearest even)
        kc, vc = torch.zeros(hkv, slots, d, dtype=torch.float16), torch.zeros(hkv, slots, d, dtype=torch.float16)
        want_k, want_v = kc.clone(), vc.clone()
        want_k.index_copy_(1, slot_mapping, k.transpose(0, 1).half())
        want_v.index_copy_(1, slot_mapping, v.transpose(0, 1).half())
    else:
        codec = TorchQuantKVAttentionBackend("int8")
        kc = torch.zeros(hkv, slots, d + 4, dtype=torch.int8)
        vc = kc.clone()
        want_k, want_v = kc.clone(), vc.clone()
        want_k.index_copy_(1, slot_mapping, codec.encode(k))
        want_v.index_copy_(1, slot_mapping, codec.encode(v))
    cpu.kv_write(k, v, kc, vc, slot_mapping, lib=lib)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)  # bit for bit, scales included


def test_fp16_kv_write_rounds_every_kind_of_value_as_torch(lib):
    """Values at the edges of binary16: ties between two halves (to even), the largest half and what
    rounds past it (inf), subnormals and what underflows to zero, signed zeros, infinities, and
    random values over the whole exponent range; d = 21 runs the vector loop and its scalar tail."""
    g = torch.Generator().manual_seed(3)
    special = torch.tensor([1 + 2 ** -11, 1 + 3 * 2 ** -11, 2049.0, 2051.0, 65504.0, 65519.99, 65520.0, 1e6,
                            2 ** -24, 2 ** -25, 2 ** -25 * 1.0001, 3 * 2 ** -25, 2 ** -14 - 2 ** -25, 1e-10, 0.0, -0.0,
                            float("inf"), float("-inf"), -65520.0, -(2 ** -24) * 1.5, 6.1e-5])
    rand = torch.randn(6, 21, generator=g) * torch.pow(2.0, torch.randint(-26, 17, (6, 21), generator=g).float())
    rows = torch.cat([special.view(1, 21), -special.view(1, 21), rand])  # [8, 21]
    t, hkv, d = rows.shape[0], 1, rows.shape[1]
    kc = torch.zeros(hkv, 16, d, dtype=torch.float16)
    vc = torch.zeros_like(kc)
    slots = torch.arange(t) * 2
    cpu.kv_write(rows.view(t, 1, d), (-rows).view(t, 1, d), kc, vc, slots, lib=lib)
    assert torch.equal(kc[0, slots].view(torch.int16), rows.half().view(torch.int16))
    assert torch.equal(vc[0, slots].view(torch.int16), (-rows).half().view(torch.int16))
    assert torch.isinf(kc[0, 0, 6]) and kc[0, 0, 5].item() == 65504.0  # 65520 rounds up to inf, 65519.99 down


@pytest.mark.parametrize("m,n", [(1, 1), (3, 15), (17, 16), (5, 17), (64, 49152 + 5)])
def test_argmax_rows_matches_torch(lib, m, n):
    g = torch.Generator().manual_seed(m * n)
    x = torch.randn(m, n, generator=g)
    assert torch.equal(cpu.argmax_rows(x, lib=lib), x.argmax(dim=-1))
    # strided rows; ties go to the first index (as torch); -inf everywhere gives 0
    xs = torch.randn(m, n + 7, generator=g)[:, 3:3 + n]
    if n > 2:
        xs[:, n // 3] = xs[:, -1] = 1e9
    xs[0, :] = float("-inf")
    got = cpu.argmax_rows(xs, lib=lib)
    assert torch.equal(got, xs.argmax(dim=-1))
    assert got[0].item() == 0 and (n <= 2 or (got[1:] == n // 3).all())


def test_sampler_greedy_rows_take_the_c_argmax():
    from engine.sampler import Sampler

    x = torch.randn(9, 1000)
    on, off = Sampler(1000, [], cpu_kernels=True), Sampler(1000, [])
    assert on._argmax_rows is not None and off._argmax_rows is None
    for idx in (list(range(9)), [0, 4, 8]):
        assert torch.equal(on.greedy_argmax(x, idx), off.greedy_argmax(x, idx))
        assert torch.equal(on.greedy_argmax(x, idx), x[idx].argmax(dim=-1))


def test_select_ops():
    assert select_ops(torch.device("cpu"), torch.float32).name == "cpu"
    assert select_ops(torch.device("cpu"), torch.bfloat16).name == "torch"
    assert select_ops(torch.device("cpu"), torch.float32, "torch").name == "torch"
    with pytest.raises(ValueError, match="unknown ops"):
        select_ops(torch.device("cpu"), torch.float32, "fast")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_take_rows_gathers_as_torch_does(dtype):
    g = torch.Generator().manual_seed(0)
    table = torch.randn(1000, 37, generator=g).to(dtype)
    for idx in (torch.randint(0, 1000, (64,), generator=g), torch.tensor([999, 0, 0, 5]), torch.zeros(0, dtype=torch.int64)):
        got = CpuOps.take_rows(table, idx)
        assert got.dtype == dtype and got.shape == (idx.shape[0], 37)
        assert torch.equal(got, table[idx]) and torch.equal(TorchOps.take_rows(table, idx), table[idx])
        assert got.stride() == (37, 1)  # rows the C kernels can take, even with no rows
    for bad in (1000, -1):  # torch refuses both; numpy would wrap -1 to the last row
        with pytest.raises(IndexError, match=f"row index {bad} is outside the table's 1000 rows"):
            CpuOps.take_rows(table, torch.tensor([3, bad, 4]))
    # a table numpy cannot view (bfloat16) and int32 ids go through torch
    bf = table.to(torch.bfloat16)
    assert torch.equal(CpuOps.take_rows(bf, torch.tensor([2, 1], dtype=torch.int32)), bf[[2, 1]])


def test_forward_with_c_ops_and_layers_matches_the_reference_forward():
    """The dummy SmolLM2-shaped model (30 layers, random weights): greedy tokens and logprobs over steps (two prefills, one of
    that mix prefill chunks, a cached prefix and decodes, with the C kernels vs the PyTorch reference."""
    from engine import LLM, SamplingParams

    outs = {}
    for ck in (True, False):
        llm = LLM("dummy:smollm2-135m", cpu_kernels=ck, kv_cache_memory_bytes=64 << 20, max_num_batched_tokens=64,
                  dtype="float32")
        assert llm.model.ops.name == ("cpu" if ck else "torch")
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (5, 70, 33)]
        prompts.append(prompts[1][:48] + [7, 8, 9])
        res = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0),
                           use_tqdm=False)
        outs[ck] = res
    for a, b in zip(outs[True], outs[False]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            (ta, va), = la.items()
            assert abs(va - lb[ta]) < 1e-3
    assert outs[True][3].num_cached_tokens == 48
