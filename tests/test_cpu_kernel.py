"""The C paged attention kernel (engine/kernels/cpu/attention.c) against dense float64
attention: decode rows, prefill chunks over a cached prefix (multi-row tiles, causal), int8
rows, every build the machine runs; and inside the engine against the PyTorch path."""
from __future__ import annotations

import pytest
import torch

from engine.attention import TorchAttentionBackend, cpu_kernel
from engine.attention.torch_quant_kv import TorchQuantKVAttentionBackend

from test_attention import BS, LENS, _decode_batch, _dense

pytestmark = pytest.mark.skipif(not cpu_kernel.available(), reason=f"no C kernel: {cpu_kernel.why_unavailable()}")

# int8 rows are computed in integer arithmetic where AVX-512 is present: a query and the softmax
# weights are rounded to int16 codes (a step of 1/32767 of the largest), far finer than the
# cache's own int8 codes (1/127); fp32 caches stay within 1e-5 of float64 attention
INT8_TOL = 2e-4


def _paged(lens, hkv, gqa, d, block_size, seed, scattered=True):
    """Random K/V for each sequence, written into a pool at scattered (or consecutive) blocks."""
    g = torch.Generator().manual_seed(seed)
    nblk = [-(-n // block_size) for n in lens]
    num_blocks = sum(nblk) + 3
    ids = torch.randperm(num_blocks, generator=g).tolist() if scattered else list(range(num_blocks))
    kc = torch.randn(hkv, num_blocks * block_size, d, generator=g)
    vc = torch.randn(hkv, num_blocks * block_size, d, generator=g)
    tables = torch.zeros(len(lens), max(nblk), dtype=torch.int32)
    keys, vals = [], []
    for b, n in enumerate(lens):
        blocks = torch.tensor([ids.pop() for _ in range(nblk[b])])
        tables[b, :nblk[b]] = blocks.to(torch.int32)
        slots = (blocks[:, None] * block_size + torch.arange(block_size)).reshape(-1)[:n]
        keys.append(kc[:, slots].transpose(0, 1))  # [n, Hkv, D]
        vals.append(vc[:, slots].transpose(0, 1))
    q = torch.randn(len(lens), hkv * gqa, d, generator=g)
    return q, kc, vc, tables, torch.tensor(lens), keys, vals


@pytest.fixture(scope="module")
def generic():
    return cpu_kernel.generic_build()


@pytest.mark.parametrize("hkv,gqa,d", [(3, 3, 64), (1, 1, 64), (2, 4, 128), (1, 8, 32), (2, 16, 64), (1, 2, 20)])
# 8 and 20: a group of a vector's width of keys spans two blocks (each block is read where it lies)
@pytest.mark.parametrize("block_size", [8, 16, 20, 32])
@pytest.mark.parametrize("build", ["default", "generic"])
def test_kernel_matches_dense(hkv, gqa, d, block_size, build, generic):
    # "default" is the AVX2 path on a CPU that has it (head_dim 20 takes the plain-C path there)
    # lengths at and around block ends, a single token, and a long sequence
    lens = [1, block_size - 1, block_size, block_size + 1, 3 * block_size, 201]
    q, kc, vc, tables, seq_lens, keys, vals = _paged(lens, hkv, gqa, d, block_size, seed=hkv * gqa + d)
    scale = d ** -0.5
    out = cpu_kernel.paged_decode_attention(q, kc, vc, tables, seq_lens, block_size, scale,
                                            lib=generic if build == "generic" else None)
    ref = torch.stack([_dense(q[i], keys[i], vals[i], scale) for i in range(len(lens))])
    assert out.shape == q.shape and out.dtype == torch.float32
    assert (out.double() - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("threads", [1, 2, 3, 7])
def test_kernel_thread_split_gives_identical_outputs(threads):
    # each (sequence, head) task is computed whole by one thread: any split gives the same bits
    lens = [5, 300, 17, 64, 129, 2, 90]
    q, kc, vc, tables, seq_lens, _, _ = _paged(lens, 3, 3, 64, 16, seed=1)
    one = cpu_kernel.paged_decode_attention(q, kc, vc, tables, seq_lens, 16, 0.125, num_threads=1)
    many = cpu_kernel.paged_decode_attention(q, kc, vc, tables, seq_lens, 16, 0.125, num_threads=threads)
    assert torch.equal(one, many)


def test_kernel_handles_large_scores_without_overflow():
    # scores of order 1e3: the running maximum keeps every exponent <= 0
    lens = [40, 100]
    q, kc, vc, tables, seq_lens, keys, vals = _paged(lens, 1, 2, 64, 16, seed=2)
    q = q * 300
    out = cpu_kernel.paged_decode_attention(q, kc, vc, tables, seq_lens, 16, 1.0)
    ref = torch.stack([_dense(q[i], keys[i], vals[i], 1.0) for i in range(len(lens))])
    assert torch.isfinite(out).all()
    assert (out.double() - ref).abs().max().item() < 1e-4


def test_supports_refuses_what_the_build_does_not_serve():
    kc = torch.zeros(2, 64, 64)
    assert cpu_kernel.supports(torch.zeros(1, 8, 64), kc, 16)
    assert not cpu_kernel.supports(torch.zeros(1, 8, 64, dtype=torch.bfloat16), kc, 16)
    assert not cpu_kernel.supports(torch.zeros(1, 34, 64), kc, 16)  # 17 query heads per KV head
    assert not cpu_kernel.supports(torch.zeros(1, 8, 64), kc, 128)  # block size over 64
    assert cpu_kernel.supports(torch.zeros(1, 8, 64), torch.zeros(2, 64, 68, dtype=torch.int8), 16)
    assert not cpu_kernel.supports(torch.zeros(1, 8, 64), torch.zeros(2, 64, 64, dtype=torch.int8), 16)
    with pytest.raises(ValueError, match="head_dim 32"):
        cpu_kernel.paged_decode_attention(torch.zeros(2, 8, 32), kc, kc, torch.zeros(2, 1, dtype=torch.int32),
                                          torch.ones(2, dtype=torch.int64), 16, 1.0)
    with pytest.raises(ValueError, match="shape mismatch"):
        cpu_kernel.paged_decode_attention(torch.zeros(3, 8, 64), kc, kc, torch.zeros(2, 1, dtype=torch.int32),
                                          torch.ones(2, dtype=torch.int64), 16, 1.0)


@pytest.mark.parametrize("gqa,d", [(3, 64), (4, 128), (2, 20)])
@pytest.mark.parametrize("build", ["default", "generic"])
def test_kernel_reads_int8_rows_like_their_decoded_values(gqa, d, build, generic):
    # the int8 cache's rows (D codes + fp32 scale): the kernel equals dense attention over
    # what the rows decode to, without expanding the cache
    codec = TorchQuantKVAttentionBackend("int8")
    lens = [1, 16, 17, 150]
    q, kc, vc, tables, seq_lens, _, _ = _paged(lens, 2, gqa, d, 16, seed=d)
    kq = codec.encode(kc.transpose(0, 1)).contiguous()  # [Hkv, S, D + 4] int8
    vq = codec.encode(vc.transpose(0, 1)).contiguous()
    kd, vd = codec.decode(kq, torch.float32), codec.decode(vq, torch.float32)
    assert (kd - kc).abs().max() > 0  # the codes are lossy: the check below reads the rows, not kc
    lib = generic if build == "generic" else None
    out = cpu_kernel.paged_decode_attention(q, kq, vq, tables, seq_lens, 16, d ** -0.5, lib=lib)
    ref = cpu_kernel.paged_decode_attention(q, kd, vd, tables, seq_lens, 16, d ** -0.5, lib=lib)
    for b, n in enumerate(lens):
        blocks = tables[b, :-(-n // 16)].long()
        slots = (blocks[:, None] * 16 + torch.arange(16)).reshape(-1)[:n]
        dense = _dense(q[b], kd[:, slots].transpose(0, 1), vd[:, slots].transpose(0, 1), d ** -0.5)
        assert (out[b].double() - dense).abs().max().item() < INT8_TOL
    assert (out - ref).abs().max().item() < INT8_TOL
    # the kernel's own rounding is a small part of what the int8 cache itself costs
    exact = cpu_kernel.paged_decode_attention(q, kc, vc, tables, seq_lens, 16, d ** -0.5, lib=lib)
    assert (out - ref).abs().max().item() < 0.05 * (ref - exact).abs().max().item()


def test_int8_kv_backend_decodes_through_kernel():
    backend = TorchQuantKVAttentionBackend("int8")
    out, ref, meta = _decode_batch(backend, LENS[5], shared_blocks=2, consecutive=False, seed=11)
    assert meta.cache["decode_kernel"] is not None
    assert (out.double() - ref).abs().max().item() < INT8_TOL
    assert TorchQuantKVAttentionBackend("fp8_e4m3").use_cpu_kernel is False


@pytest.mark.parametrize("n", [20, 5])
def test_backend_decode_through_kernel_matches_dense_with_shared_blocks(n):
    backend = TorchAttentionBackend()
    out, ref, meta = _decode_batch(backend, LENS[n], shared_blocks=3, consecutive=False, seed=n)
    assert meta.cache["decode_kernel"] is not None  # the kernel path was taken
    assert "decode_buckets" not in meta.cache
    assert (out.double() - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("kv", ["fp32", "auto"])
def test_engine_greedy_tokens_equal_with_and_without_kernel(monkeypatch, kv):
    """The real engine on a 2-layer dummy Llama: the same greedy tokens whether decode attention
    runs in the C kernel or the PyTorch path, over steps that mix decodes, chunked prefill and a
    prefix-cache hit; with an fp32 cache and with the default ("auto": fp16 halves under fp32 weights,
    written by the C kernel or by torch's conversion, read widened to fp32 by both paths)."""
    from engine import LLM, SamplingParams
    from engine.weights import PRESETS, ModelConfig

    monkeypatch.setitem(PRESETS, "tiny-gqa3", ModelConfig(384, 256, 2, 6, 2, 49152, rope_theta=10000.0,
                                                          tie_word_embeddings=True, name="tiny-gqa3"))

    g = torch.Generator().manual_seed(0)
    long = torch.randint(3, 49152, (40,), generator=g).tolist()
    prompts = [torch.randint(3, 49152, (7,), generator=g).tolist(), long, long[:32] + [5, 6, 7],
               torch.randint(3, 49152, (19,), generator=g).tolist()]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    kw = dict(dtype="float32", max_num_batched_tokens=24, max_num_seqs=4, block_size=BS, kv_cache_dtype=kv)
    runs = {}
    for use in (True, False):
        llm = LLM("dummy:tiny-gqa3", **kw)
        llm.backend.use_cpu_kernel = use
        runs[use] = llm.generate(prompts, params, use_tqdm=False)
        assert llm.kv_cache.layers[0][0].dtype == (torch.float32 if kv == "fp32" else torch.float16)
    assert [o.outputs[0].token_ids for o in runs[True]] == [o.outputs[0].token_ids for o in runs[False]]
    assert all(len(o.outputs[0].token_ids) == 12 for o in runs[True])
    # and the same logprobs to float rounding: both paths attend over what the cache holds (the
    # PyTorch path's first prefill chunk too, which takes its rows before they are stored)
    for a, b in zip(runs[True], runs[False]):
        for pa, pb, t in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, a.outputs[0].token_ids):
            assert abs(pa[t] - pb[t]) < 1e-5  # 3e-5 (fp16) when that chunk attended over unrounded rows
    assert runs[True][2].num_cached_tokens == 32


@pytest.mark.parametrize("variant", ["native", "avx2", "generic"])
@pytest.mark.parametrize("hkv,gqa,d", [(3, 3, 64), (2, 4, 128), (1, 2, 20), (2, 16, 32)])
@pytest.mark.parametrize("kv", ["float32", "int8", "float16"])
@pytest.mark.parametrize("bs", [16, 20])
def test_prefill_rows_attend_causally_over_their_cached_prefix(variant, hkv, gqa, d, kv, bs):
    """A step of decode rows and prefill chunks (one from position 0, one after a 37-token cached
    prefix, one of a single token), tiles of up to `attention_tile_rows` rows in any order: each
    row equals dense causal attention over its own sequence up to its position."""
    from engine.kernels import cpu
    from engine.kernels.cpu import build

    if variant == "avx2" and not {"avx2", "fma"} <= build.cpu_flags():
        pytest.skip("no AVX2/FMA")
    lib = cpu.library(variant)
    # (cached prefix, new tokens) per sequence: decodes (n = 1) first, then prefill chunks
    specs = [(40, 1), (5, 1), (0, 23), (37, 19), (64, 1), (3, 2)]
    lens = [p + n for p, n in specs]
    q_all, kc, vc, tables, _, keys, vals = _paged(lens, hkv, gqa, d, bs, seed=d + hkv)
    if kv == "int8":
        codec = TorchQuantKVAttentionBackend("int8")
        kc, vc = (codec.encode(c.transpose(0, 1)).contiguous() for c in (kc, vc))
        kd, vd = codec.decode(kc, torch.float32), codec.decode(vc, torch.float32)
        keys, vals = [], []
        for b, n in enumerate(lens):
            blocks = tables[b, :-(-n // bs)].long()
            slots = (blocks[:, None] * bs + torch.arange(bs)).reshape(-1)[:n]
            keys.append(kd[:, slots].transpose(0, 1))
            vals.append(vd[:, slots].transpose(0, 1))
    elif kv == "float16":  # the kernel widens the halves and computes in fp32: dense attention over them
        kc, vc = kc.half(), vc.half()
        keys, vals = [x.half().float() for x in keys], [x.half().float() for x in vals]
    g = torch.Generator().manual_seed(7)
    t = sum(n for _, n in specs)
    q = torch.randn(t, hkv * gqa, d, generator=g)
    row_seq, kv_len, tiles, row = [], [], [], 0
    rows_per_tile = cpu.attention_tile_rows(gqa, lib=lib)
    for i, (p, n) in enumerate(specs):
        row_seq += [i] * n
        kv_len += list(range(p + 1, p + n + 1))
        tiles += [(row + o, min(rows_per_tile, n - o)) for o in range(0, n, rows_per_tile)]
        row += n
    tiles = torch.tensor(tiles[::-1], dtype=torch.int64)  # any order
    out = torch.full_like(q, float("nan"))
    cpu.paged_attention(q, kc, vc, tables, torch.tensor(row_seq, dtype=torch.int32), torch.tensor(kv_len),
                        tiles, bs, d ** -0.5, out, lib=lib)
    for r in range(t):
        s, L = row_seq[r], kv_len[r]
        want = _dense(q[r], keys[s][:L], vals[s][:L], d ** -0.5)
        tol = INT8_TOL if kv == "int8" else 2e-5
        assert (out[r].double() - want).abs().max().item() < tol, (r, s, L)


def test_attention_refuses_tiles_beyond_its_limit():
    from engine.kernels import cpu

    q, kc, vc, tables, lens, _, _ = _paged([20], 1, 16, 32, 16, seed=0)
    q = torch.randn(2, 16, 32)
    too_many = torch.tensor([[0, 2]])  # 2 rows x 16 heads > 16 queries per task
    with pytest.raises(RuntimeError, match="refused"):
        cpu.paged_attention(q, kc, vc, tables, torch.zeros(2, dtype=torch.int32), torch.tensor([19, 20]),
                            too_many, 16, 1.0, torch.empty_like(q))


@pytest.mark.parametrize("variant", ["native", "avx2", "generic"])
@pytest.mark.parametrize("hkv,gqa,d", [(3, 3, 64), (2, 4, 128), (1, 2, 20), (2, 8, 32), (1, 1, 64)])
@pytest.mark.parametrize("kv", ["float32", "int8", "float16"])
def test_a_rows_attention_does_not_depend_on_its_tile(variant, hkv, gqa, d, kv):
    """Prefill rows computed in tiles of up to `attention_tile_rows` rows give, bit for bit, what the
    same rows give one per tile (as decode rows are run): a token's attention output must not
    depend on how the step grouped its rows, or a speculative verification step (several rows of a
    sequence) and plain decoding (one row) could part on a near tie, and a recomputed (preempted)
    sequence would not find its own cache again."""
    from engine.kernels import cpu
    from engine.kernels.cpu import build

    if variant == "avx2" and not {"avx2", "fma"} <= build.cpu_flags():
        pytest.skip("no AVX2/FMA")
    lib = cpu.library(variant)
    bs = 16
    specs = [(0, 23), (37, 19), (130, 70), (3, 2)]  # (cached prefix, new rows) per sequence
    lens = [p + n for p, n in specs]
    _, kc, vc, tables, _, _, _ = _paged(lens, hkv, gqa, d, bs, seed=d + gqa)
    if kv == "int8":
        codec = TorchQuantKVAttentionBackend("int8")
        kc, vc = (codec.encode(c.transpose(0, 1)).contiguous() for c in (kc, vc))
    elif kv == "float16":
        kc, vc = kc.half(), vc.half()
    t = sum(n for _, n in specs)
    q = torch.randn(t, hkv * gqa, d, generator=torch.Generator().manual_seed(3))
    row_seq, kv_len, row = [], [], 0
    for i, (p, n) in enumerate(specs):
        row_seq += [i] * n
        kv_len += list(range(p + 1, p + n + 1))
    rows_per_tile = cpu.attention_tile_rows(gqa, lib=lib)
    outs = []
    for per in (rows_per_tile, 1):
        tiles, row = [], 0
        for p, n in specs:
            tiles += [(row + o, min(per, n - o)) for o in range(0, n, per)]
            row += n
        out = torch.full_like(q, float("nan"))
        cpu.paged_attention(q, kc, vc, tables, torch.tensor(row_seq, dtype=torch.int32), torch.tensor(kv_len),
                            torch.tensor(tiles, dtype=torch.int64), bs, d ** -0.5, out, lib=lib)
        outs.append(out)
    assert rows_per_tile > 1
    assert not outs[0].isnan().any()
    assert torch.equal(outs[0], outs[1])
