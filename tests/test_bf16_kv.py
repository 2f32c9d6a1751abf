"""The grouped bf16 KV cache (`engine.attention.bf16_kv`) and the attention kernel that reads it on the bf16
dot-product unit (attention.c, `TM_KV_BF16`): the C writer against the PyTorch one, the kernel against the
float64 definition on odd shapes in every build, a row's output against its tile, slots never written,
refusals, and the engine's choice of cache."""
from __future__ import annotations

import contextlib

import pytest
import torch

from engine.attention import bf16_kv, cpu_kernel
from engine.host import Host
from engine.kernels import cpu
from engine.kernels.cpu import build

pytestmark = pytest.mark.skipif(not cpu.available(), reason="the CPU kernel library is not built here")

NATIVE_BF16 = cpu.available() and cpu.attention_bf16()


AMX = cpu.available() and cpu.bf16_amx()


@contextlib.contextmanager
def _products(variant):
    """"native-vdpbf16": the native build with its AMX-BF16 tiles off (its VDPBF16PS task); others as they are."""
    before = cpu.bf16_amx() if cpu.available() else False
    if variant == "native-vdpbf16":
        cpu.bf16_amx(False)
    try:
        yield
    finally:
        if variant == "native-vdpbf16":
            cpu.bf16_amx(before)


def _lib(variant):
    if variant == "native-vdpbf16":
        if not AMX:
            pytest.skip("the host has no AMX-BF16: the native build runs VDPBF16PS already")
        variant = "native"
    if variant == "native" and not Host.current().avx512_bf16:
        pytest.skip("the host has no AVX512-BF16: the native build reads the cache one value at a time")
    if variant == "avx2" and not {"avx2", "fma"} <= build.cpu_flags():
        pytest.skip("no AVX2/FMA")
    return cpu.library(variant)


def _step(specs, hkv, gqa, d, bs, seed, lib, tile_rows=None, window=0, fill=0):
    """A paged step: sequences of (cached prefix, new rows), their K/V written by `tm_kv_write` into a
    grouped cache of shuffled blocks (the other slots hold `fill` bits), tiles of `tile_rows` rows.
    Returns (out, q, keys, vals, row_seq, kv_len) with keys/vals per sequence [L, Hkv, D] fp32."""
    g = torch.Generator().manual_seed(seed)
    lens = [p + n for p, n in specs]
    nbs = [-(-n // bs) for n in lens]
    nb = sum(nbs) + 2
    kc = torch.full((hkv, nb * bs, d), fill, dtype=torch.int16)
    vc = kc.clone()
    perm = torch.randperm(nb, generator=g).to(torch.int32)
    tables = torch.zeros(len(specs), max(nbs), dtype=torch.int32)
    keys, vals, at = [], [], 0
    for i, n in enumerate(lens):
        tables[i, :nbs[i]] = perm[at:at + nbs[i]]
        at += nbs[i]
        slots = (tables[i, :nbs[i]].long()[:, None] * bs + torch.arange(bs)).reshape(-1)[:n].contiguous()
        k, v = torch.randn(n, hkv, d, generator=g), torch.randn(n, hkv, d, generator=g)
        cpu.kv_write(k, v, kc, vc, slots, lib=lib)
        keys.append(k)
        vals.append(v)
    t = sum(n for _, n in specs)
    q = torch.randn(t, hkv * gqa, d, generator=g)
    rows = tile_rows or cpu.attention_tile_rows(gqa, lib=lib)
    row_seq, kv_len, tiles, row = [], [], [], 0
    for i, (p, n) in enumerate(specs):
        row_seq += [i] * n
        kv_len += list(range(p + 1, p + n + 1))
        tiles += [(row + o, min(rows, n - o)) for o in range(0, n, rows)]
        row += n
    out = torch.full_like(q, float("nan"))
    row_seq, kv_len = torch.tensor(row_seq, dtype=torch.int32), torch.tensor(kv_len)
    cpu.paged_attention(q, kc, vc, tables, row_seq, kv_len, torch.tensor(tiles[::-1], dtype=torch.int64), bs,
                        d ** -0.5, out, lib=lib, window=window)
    return out, q, keys, vals, row_seq, kv_len


def _definition(q, keys, vals, row_seq, kv_len, gqa, window=0):
    """float64 attention over the bf16 values of K and V, the scaled queries rounded to bf16 [T, Hq, D]."""
    d = q.shape[-1]
    qs = (q * d ** -0.5).bfloat16().double()
    out = torch.empty(q.shape, dtype=torch.float64)
    for r in range(q.shape[0]):
        s, n = int(row_seq[r]), int(kv_len[r])
        lo = max(0, n - window) if window else 0
        k = keys[s][lo:n].bfloat16().double().repeat_interleave(gqa, dim=1)  # [L, Hq, D]
        v = vals[s][lo:n].bfloat16().double().repeat_interleave(gqa, dim=1)
        p = torch.softmax(torch.einsum("hd,lhd->hl", qs[r], k), dim=-1)
        out[r] = torch.einsum("hl,lhd->hd", p, v)
    return out


def test_the_c_writer_and_the_pytorch_writer_lay_out_the_same_bits():
    g = torch.Generator().manual_seed(0)
    for d in (32, 64, 96):
        rows_k, rows_v = torch.randn(37, 2, d, generator=g) * 3, torch.randn(37, 2, d, generator=g)
        rows_k[0, 0, :4] = torch.tensor([1e-40, -0.0, 65504.0, 3.0e38])  # a denormal (to zero), -0, large values
        slots = torch.randperm(64, generator=g)[:37].contiguous()
        kc, vc = torch.zeros(2, 64, d, dtype=torch.int16), torch.zeros(2, 64, d, dtype=torch.int16)
        cpu.kv_write(rows_k, rows_v, kc, vc, slots)
        kp, vp = torch.zeros_like(kc), torch.zeros_like(vc)
        bf16_kv.write_rows(kp, slots, rows_k, "k")
        bf16_kv.write_rows(vp, slots, rows_v, "v")
        assert torch.equal(kc, kp) and torch.equal(vc, vp)
        # read back in slot order: the rows rounded to bf16 (nearest even), and the layout is not row order
        back_k, back_v = bf16_kv.read_rows(kc, "k")[:, slots], bf16_kv.read_rows(vc, "v")[:, slots]
        want_k = rows_k.bfloat16().transpose(0, 1)
        want_k[0, 0, 0] = 0.0  # VCVTNE2PS2BF16 flushes a denormal to zero; torch keeps it
        assert torch.equal(back_k, want_k) and torch.equal(back_v, rows_v.bfloat16().transpose(0, 1))
        assert not torch.equal(kc.view(torch.bfloat16)[:, slots], rows_k.bfloat16().transpose(0, 1))


def test_the_group_index_is_the_documented_layout():
    idx = bf16_kv.value_index(torch.tensor([0, 1, 17, 31]), 64, "k")
    assert idx[0, :4].tolist() == [0, 1, 32, 33]  # dims 0, 1 of slot 0; dims 2, 3 one pair row (16 slots) on
    assert idx[1, 0].item() == 2 and idx[2, 0].item() == 16 * 64 + 2  # slot 1; slot 17 = group 1, lane 1
    v = bf16_kv.value_index(torch.tensor([0, 1, 2, 31]), 64, "v")
    assert v[0, :2].tolist() == [0, 2] and v[1, 0].item() == 1  # slots 0 and 1 share a pair per dim
    assert v[2, 0].item() == 2 * 64 and v[3, 63].item() == 16 * 64 + (7 * 64 + 63) * 2 + 1
    with pytest.raises(ValueError, match="which"):
        bf16_kv.value_index(torch.tensor([0]), 64, "q")


@pytest.mark.parametrize("variant", ["native", "native-vdpbf16", "avx2", "generic"])
@pytest.mark.parametrize("hkv,gqa,d,bs", [(3, 3, 64, 16), (2, 4, 128, 32), (1, 16, 32, 16), (2, 1, 96, 48),
                                          (1, 2, 64, 64)])
def test_attention_over_a_bf16_cache_equals_its_float64_definition(variant, hkv, gqa, d, bs):
    """Decode rows and prefill chunks (M = 1, 3, 17 and 300 rows, one after a 37-token cached prefix):
    each row equals float64 attention over the cache's bf16 values with bf16 queries, up to the bf16
    rounding of the probabilities (a relative 2^-8 of the values); the native build rounds them, the
    others compute in fp32 over the same values."""
    lib = _lib(variant)
    specs = [(40, 1), (5, 1), (0, 3), (37, 17), (11, 300)]
    with _products(variant):
        out, q, keys, vals, row_seq, kv_len = _step(specs, hkv, gqa, d, bs, seed=d + gqa, lib=lib)
    want = _definition(q, keys, vals, row_seq, kv_len, gqa)
    err = (out.double() - want).abs().max().item()
    assert err < 2 ** -7 * max(v.abs().max().item() for v in vals), err


@pytest.mark.parametrize("variant", ["native", "native-vdpbf16", "generic"])
def test_a_sliding_window_over_a_bf16_cache(variant):
    lib = _lib(variant)
    specs = [(90, 1), (0, 70), (50, 33)]
    with _products(variant):
        out, q, keys, vals, row_seq, kv_len = _step(specs, 2, 3, 64, 16, seed=5, lib=lib, window=24)
    want = _definition(q, keys, vals, row_seq, kv_len, 3, window=24)
    assert (out.double() - want).abs().max().item() < 2 ** -7 * 5


@pytest.mark.skipif(not NATIVE_BF16, reason="the host has no AVX512-BF16")
def test_the_native_build_rounds_to_bf16_and_the_plain_c_build_does_not():
    """The same step in both builds: each within the definition's bound, but not equal (the native build
    rounds the queries and probabilities to bf16 and sums on VDPBF16PS; plain C sums fp32 products)."""
    specs = [(30, 1), (0, 40)]
    a = _step(specs, 3, 3, 64, 16, seed=2, lib=cpu.library("native"))[0]
    b = _step(specs, 3, 3, 64, 16, seed=2, lib=cpu.library("generic"))[0]
    assert not torch.equal(a, b)
    assert (a - b).abs().max().item() < 2 ** -6 * 5


@pytest.mark.parametrize("variant", ["native", "native-vdpbf16", "generic"])
def test_a_rows_output_over_a_bf16_cache_does_not_depend_on_its_tile(variant):
    """Bit for bit: tiles of 5, 2 and 1 rows (as decode rows run), so speculative verification and a
    recomputed sequence find what plain decoding found."""
    lib = _lib(variant)
    specs = [(0, 23), (37, 19), (130, 70), (3, 2)]
    with _products(variant):
        outs = [_step(specs, 3, 3, 64, 16, seed=11, lib=lib, tile_rows=r)[0] for r in (5, 2, 1)]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("variant", ["native", "native-vdpbf16", "generic"])
def test_slots_never_written_are_never_used(variant):
    """Slots past a sequence's length hold anything (here NaN bits, K and V): the outputs are finite and
    equal to those over a zeroed cache, odd lengths included (the partner of the last key in a pair)."""
    lib = _lib(variant)
    specs = [(0, 17), (20, 1), (44, 3)]
    nan_bits = torch.tensor(float("nan"), dtype=torch.bfloat16).view(torch.int16).item()
    with _products(variant):
        a = _step(specs, 2, 3, 64, 16, seed=4, lib=lib)[0]
        b = _step(specs, 2, 3, 64, 16, seed=4, lib=lib, fill=nan_bits)[0]
    assert torch.isfinite(b).all() and torch.equal(a, b)


@pytest.mark.skipif(not AMX, reason="the host has no AMX-BF16 (or Linux did not grant the tile state)")
@pytest.mark.parametrize("d", [64, 128, 256])
def test_the_amx_task_differs_from_the_vdpbf16ps_task_only_in_rounding(d):
    """The same step with the tiles on and off: not the same bits (the tiles ran), both within the
    definition's bound; head_dim 256 (Gemma 3) takes the C tiles in two passes of 4 columns."""
    specs = [(37, 17), (0, 5), (20, 1)]
    a = _step(specs, 1, 4, d, 32, seed=d, lib=cpu.library())[0]
    with _products("native-vdpbf16"):
        b, q, keys, vals, row_seq, kv_len = _step(specs, 1, 4, d, 32, seed=d, lib=cpu.library())
    want = _definition(q, keys, vals, row_seq, kv_len, 4)
    bound = 2 ** -7 * max(v.abs().max().item() for v in vals)
    assert not torch.equal(a, b)
    assert (a.double() - want).abs().max().item() < bound and (b.double() - want).abs().max().item() < bound


def test_the_kernel_refuses_a_bf16_cache_it_cannot_read():
    q = torch.randn(1, 3, 64)
    kc = torch.zeros(1, 24, 64, dtype=torch.int16)
    args = (torch.zeros(1, 3, dtype=torch.int32), None, torch.tensor([5]), torch.tensor([[0, 1]]))
    with pytest.raises(RuntimeError, match="refused"):  # blocks of 8 slots split the groups of 16
        cpu.paged_attention(q, kc, kc.clone(), *args, 8, 0.125, torch.empty_like(q))
    assert not cpu_kernel.supports(q, kc, 8)
    assert not cpu_kernel.supports(torch.randn(1, 3, 48), torch.zeros(1, 32, 48, dtype=torch.int16), 16)
    assert cpu_kernel.supports(q, torch.zeros(1, 32, 64, dtype=torch.int16), 16)


def test_the_engine_keeps_a_bf16_cache_where_bf16_weights_meet_a_bf16_unit():
    from engine import LLM

    kw = dict(kv_cache_memory_bytes=16 << 20)
    bf = LLM("smollm2-135m-instruct", dtype="bfloat16", **kw)
    assert bf.kv_cache.layers[0][0].dtype == (torch.int16 if NATIVE_BF16 else torch.float16)
    assert bf.kv_cache_dtype == ("bf16" if NATIVE_BF16 else "fp16")  # what "auto" resolved to
    fp = LLM("smollm2-135m-instruct", dtype="float32", **kw)
    assert fp.kv_cache.layers[0][0].dtype == torch.float16 and fp.kv_cache_dtype == "fp16"  # fp32 weights: halves
    odd = LLM("smollm2-135m-instruct", dtype="bfloat16", block_size=8, **kw)
    assert odd.kv_cache.layers[0][0].dtype == torch.float16  # blocks that split a group: halves
    asked = LLM("smollm2-135m-instruct", dtype="float32", kv_cache_dtype="bf16", **kw)
    assert asked.kv_cache.layers[0][0].dtype == torch.int16
    with pytest.raises(ValueError, match="block_size must be a multiple of 16, got 8"):
        LLM("smollm2-135m-instruct", kv_cache_dtype="bf16", block_size=8, **kw)


def test_the_pytorch_path_reads_a_bf16_cache_as_the_kernel_does():
    """Greedy tokens: the C kernel and the PyTorch path (which writes the group layout with `write_rows`
    and reads whole blocks back with `read_rows`) over grouped bf16 caches, through decodes, chunked
    prefill and a prefix-cache hit, agree; their logprobs within the bf16 rounding of the kernel's
    queries and probabilities."""
    from engine import LLM, SamplingParams

    text = ("The GNU General Public License is a free, copyleft license for software and other kinds of "
            "works. The licenses for most software are designed to take away your freedom to share")
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)
    runs = {}
    for use in (True, False):
        llm = LLM("smollm2-135m-instruct", dtype="float32", kv_cache_dtype="bf16", max_num_batched_tokens=24,
                  max_num_seqs=4, kv_cache_memory_bytes=16 << 20)
        llm.backend.use_cpu_kernel = use
        ids = llm.tokenizer.encode(text)
        prompts = [ids[:7], ids, ids[:32] + llm.tokenizer.encode(" and change")]
        runs[use] = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(runs[True], runs[False]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for pa, pb, t in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, a.outputs[0].token_ids):
            assert abs(pa[t] - pb[t]) < 0.05
    assert runs[True][2].num_cached_tokens == 32
