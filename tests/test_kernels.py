"""Triton kernels against their PyTorch references.

On a machine without CUDA the kernels run in Triton's interpreter
(TRITON_INTERPRET=1, set here before any kernel module is imported); with CUDA
the same tests run compiled on the GPU (fp32 and bf16). Shapes are small: the
interpreter's cost grows with the number of programs.

Covered: odd lengths, lengths that are exact block multiples, GQA ratios
1/4/8, head dims 64 and 128, split-K decode, prefill chunks with and without a
cached prefix, the cache write, and the Triton backend inside the real engine.
"""
from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # before the @triton.jit kernels are defined

from engine.attention import AttentionMetadata, TorchAttentionBackend  # noqa: E402
from engine.attention.triton_backend import (  # noqa: E402
    TritonAttentionBackend, decode_attention, num_decode_splits, write_kv,
)
from engine.cuda_graph import DecodeCudaGraphs, decode_buckets  # noqa: E402
from engine.kernels import fused_add_rms_norm, fused_add_rms_norm_ref, rope_inplace, rope_inplace_ref  # noqa: E402

DEV = torch.device("cuda" if CUDA else "cpu")
DTYPES = [torch.float32, torch.bfloat16] if CUDA else [torch.float32]
TOL = {torch.float32: 1e-2 if CUDA else 1e-4, torch.bfloat16: 3e-2}  # CUDA fp32 tl.dot uses TF32


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(a.float(), b.float(), atol=TOL[dtype], rtol=TOL[dtype])


# ---------------------------------------------------------------- RMSNorm + residual


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,h", [(5, 64), (3, 100), (1, 576)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_fused_add_rms_norm(t, h, with_residual, dtype):
    g = torch.Generator().manual_seed(t * h)
    x = torch.randn(t, h, generator=g).to(DEV, dtype)
    w = (1 + 0.1 * torch.randn(h, generator=g)).to(DEV, dtype)
    res = torch.randn(t, h, generator=g).to(DEV, dtype) if with_residual else None
    res_ref = res.clone() if with_residual else None
    out = fused_add_rms_norm(x, w, 1e-5, res)
    ref = fused_add_rms_norm_ref(x, w, 1e-5, res_ref)
    _close(out, ref, dtype)
    if with_residual:
        _close(res, res_ref, dtype)


# ---------------------------------------------------------------- RoPE


def _rope_tables(d: int, n: int = 64, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    f = torch.outer(torch.arange(n, dtype=torch.float64), inv)
    return f.cos().float().to(DEV), f.sin().float().to(DEV)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("hq,hkv", [(2, 2), (8, 2), (8, 1)])
def test_rope_inplace_on_fused_qkv_views(hq, hkv, d, dtype):
    t = 7
    g = torch.Generator().manual_seed(hq * d)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(DEV, dtype)
    pos = torch.tensor([0, 1, 5, 17, 18, 40, 63], device=DEV)
    cos, sin = _rope_tables(d)
    ref = qkv.clone()
    q, k, _ = qkv.split([hq * d, hkv * d, hkv * d], -1)
    qr, kr, _ = ref.split([hq * d, hkv * d, hkv * d], -1)
    q, k = q.view(t, hq, d), k.view(t, hkv, d)  # strided views into qkv
    qr, kr = qr.reshape(t, hq, d), kr.reshape(t, hkv, d)
    rope_inplace(q, k, cos, sin, pos)
    rope_inplace_ref(qr, kr, cos, sin, pos)
    _close(q, qr, dtype)
    _close(k, kr, dtype)
    _close(qkv[:, (hq + hkv) * d:], ref[:, (hq + hkv) * d:], dtype)  # v untouched


# ---------------------------------------------------------------- paged attention helpers


def _dense_ref(q, keys, vals, scale, qpos):
    """q [M, Hq, D] at absolute positions qpos [M] over keys/vals [L, Hkv, D], causal by position."""
    hq, hkv = q.shape[1], keys.shape[1]
    k = keys.float().repeat_interleave(hq // hkv, 1)
    v = vals.float().repeat_interleave(hq // hkv, 1)
    s = torch.einsum("mhd,lhd->hml", q.float(), k) * scale
    mask = torch.arange(keys.shape[0], device=q.device)[None, :] <= qpos[:, None]
    s = s.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hml,lhd->mhd", s.softmax(-1), v)


def _paged(seq_lens, bs, num_blocks, hkv, d, dtype, seed):
    """A cache [num_blocks*bs, Hkv, D] holding each sequence's KV in shuffled blocks."""
    g = torch.Generator().manual_seed(seed)
    kc = torch.zeros(num_blocks * bs, hkv, d, dtype=dtype, device=DEV)
    vc = torch.zeros_like(kc)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, kv = [], []
    for n in seq_lens:
        nb = -(-n // bs)
        tables.append([perm.pop() for _ in range(nb)])
        k = torch.randn(n, hkv, d, generator=g).to(DEV, dtype)
        v = torch.randn(n, hkv, d, generator=g).to(DEV, dtype)
        slots = torch.tensor([tables[-1][i // bs] * bs + i % bs for i in range(n)], device=DEV)
        kc[slots], vc[slots] = k, v
        kv.append((k, v))
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=DEV)
    return kc, vc, bt, kv


# ---------------------------------------------------------------- decode


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("gqa", [1, 4, 8])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_attention_split_k(gqa, d, num_splits, dtype):
    bs, hkv = 16, 2
    hq = hkv * gqa
    lens = [1, 16, 37, 48]  # a single token, exact block multiples, odd
    kc, vc, bt, kv = _paged(lens, bs, 12, hkv, d, dtype, seed=gqa * d + num_splits)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(len(lens), hq, d, generator=g).to(DEV, dtype)
    scale = d ** -0.5
    out = decode_attention(q, kc, vc, bt, torch.tensor(lens, device=DEV), scale, bs, num_splits, block_n=16)
    for i, n in enumerate(lens):
        ref = _dense_ref(q[i:i + 1], kv[i][0], kv[i][1], scale, torch.tensor([n - 1], device=DEV))
        _close(out[i:i + 1], ref, dtype)


def test_decode_zero_length_gives_zeros_and_split_heuristic():
    kc, vc, bt, _ = _paged([5], 16, 2, 1, 64, torch.float32, seed=0)
    q = torch.randn(2, 1, 64, device=DEV)
    bt2 = torch.cat([bt, bt])
    out = decode_attention(q, kc, vc, bt2, torch.tensor([0, 5], device=DEV), 0.125, 16, num_splits=2, block_n=16)
    assert torch.all(out[0] == 0) and torch.isfinite(out).all()
    assert num_decode_splits(256, 8, 2048, 132) == 1
    assert num_decode_splits(1, 8, 32768, 132) == 16
    assert num_decode_splits(4, 8, 300, 132) == 2


def test_write_kv_skips_negative_slots():
    t, hkv, d = 5, 3, 64
    k = torch.randn(t, hkv, d, device=DEV)
    v = torch.randn(t, hkv, d, device=DEV)
    kc = torch.zeros(32, hkv, d, device=DEV)
    vc = torch.zeros_like(kc)
    slots = torch.tensor([3, 17, -1, 31, 0], device=DEV)
    write_kv(k, v, kc, vc, slots)
    keep = slots >= 0
    assert torch.equal(kc[slots[keep]], k[keep]) and torch.equal(vc[slots[keep]], v[keep])
    assert int((kc.abs().sum((1, 2)) > 0).sum()) == 4


# ---------------------------------------------------------------- the backend on a mixed step


def _mixed_step(backend_cls, hkv, gqa, d, dtype, bs=16, cache_dtype=None, **kw):
    """One step: 2 decodes + 3 prefill chunks (no prefix / odd; prefix 32 = 2 blocks + 7;
    prefix 5 + a chunk of exactly one block), run through the backend's write + attention, with
    a KV cache of `cache_dtype` (default: `dtype`, the model's).
    Returns (output, [(keys, vals) per sequence], queries' positions, and the layout's cache)."""
    backend = backend_cls(**kw)
    g = torch.Generator().manual_seed(gqa * 1000 + d)
    hq = hkv * gqa
    # (cached tokens before the step, new tokens)
    specs = [(20, 1), (47, 1), (0, 13), (32, 7), (5, 16)]
    num_blocks = 24
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, full = [], []
    for pre, new in specs:
        n = pre + new
        tables.append([perm.pop() for _ in range(-(-n // bs))])
        full.append((torch.randn(n, hkv, d, generator=g).to(DEV, dtype), torch.randn(n, hkv, d, generator=g).to(DEV, dtype)))
    shape = backend.cache_shape(num_blocks, bs, hkv, d)
    kc = torch.zeros(shape, dtype=cache_dtype or dtype, device=DEV)
    vc = torch.zeros_like(kc)
    # the cached prefixes, written by the backend itself as an earlier step would have
    pre_slots, pre_k, pre_v = [], [], []
    for (pre, _), t, (k, v) in zip(specs, tables, full):
        pre_slots += [t[i // bs] * bs + i % bs for i in range(pre)]
        pre_k.append(k[:pre])
        pre_v.append(v[:pre])
    if isinstance(backend, TorchAttentionBackend):
        sl = torch.tensor(pre_slots, device=DEV)
        kc.index_copy_(1, sl, torch.cat(pre_k).transpose(0, 1).to(kc.dtype))
        vc.index_copy_(1, sl, torch.cat(pre_v).transpose(0, 1).to(vc.dtype))
    else:
        write_kv(torch.cat(pre_k), torch.cat(pre_v), kc, vc, torch.tensor(pre_slots, device=DEV))
    slots, ks, vs, qpos = [], [], [], []
    for (pre, new), t, (k, v) in zip(specs, tables, full):
        slots += [t[i // bs] * bs + i % bs for i in range(pre, pre + new)]
        ks.append(k[pre:])
        vs.append(v[pre:])
        qpos += list(range(pre, pre + new))
    T = len(slots)
    q = torch.randn(T, hq, d, generator=g).to(DEV, dtype)
    width = max(len(t) for t in tables[:2])
    starts, lens, seqs = [], [], []
    off = 2
    for pre, new in specs[2:]:
        starts.append(off)
        lens.append(new)
        seqs.append(pre + new)
        off += new
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=DEV),
        num_decode_tokens=2,
        decode_seq_lens=torch.tensor([specs[0][0] + 1, specs[1][0] + 1], device=DEV),
        decode_block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables[:2]], device=DEV),
        prefill_query_starts=starts, prefill_query_lens=lens, prefill_seq_lens=seqs,
        prefill_block_tables=[torch.tensor(t, device=DEV) for t in tables[2:]],
        block_size=bs,
    )
    backend.prepare(meta)
    out = backend.forward(q, torch.cat(ks), torch.cat(vs), kc, vc, meta, d ** -0.5)
    return out, q, full, torch.tensor(qpos, device=DEV), specs


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gqa,d", [(1, 64), (4, 128), (8, 64)])
def test_triton_backend_matches_torch_backend_on_mixed_step(gqa, d, dtype):
    out, q, full, qpos, specs = _mixed_step(TritonAttentionBackend, 2, gqa, d, dtype,
                                            num_splits=2, block_m=16, block_n=16, decode_block_n=16)
    ref, *_ = _mixed_step(TorchAttentionBackend, 2, gqa, d, dtype)
    _close(out, ref, dtype)
    # and against dense attention per sequence (independent of both backends)
    row = 0
    for (pre, new), (k, v) in zip(specs, full):
        want = _dense_ref(q[row:row + new], k, v, d ** -0.5, qpos[row:row + new])
        _close(out[row:row + new], want, dtype)
        row += new


def test_triton_backend_reads_an_fp16_cache_for_fp32_queries():
    """kv_cache_dtype="fp16" under an fp32 model: the Triton kernels store halves and widen them as
    they read, and agree with the PyTorch backend over the same cache and with dense attention over
    the half-rounded keys and values."""
    out, q, full, qpos, specs = _mixed_step(TritonAttentionBackend, 2, 4, 64, torch.float32,
                                            cache_dtype=torch.float16, num_splits=2, block_m=16, block_n=16,
                                            decode_block_n=16)
    ref, *_ = _mixed_step(TorchAttentionBackend, 2, 4, 64, torch.float32, cache_dtype=torch.float16)
    exact, *_ = _mixed_step(TorchAttentionBackend, 2, 4, 64, torch.float32)
    assert out.dtype == torch.float32
    _close(out, ref, torch.float32)
    assert (ref - exact).abs().max().item() > 1e-5  # the halves' rounding is visible: the caches differ
    row = 0
    for (pre, new), (k, v) in zip(specs, full):
        want = _dense_ref(q[row:row + new], k.half().float(), v.half().float(), 64 ** -0.5, qpos[row:row + new])
        _close(out[row:row + new], want, torch.float32)
        row += new


# ---------------------------------------------------------------- inside the engine


def test_engine_greedy_tokens_match_torch_backend(monkeypatch):
    """A 2-layer dummy Llama (GQA 4, head dim 64) in the real engine: the Triton backend
    (interpreted on CPU) gives the same greedy tokens as the PyTorch reference backend, over
    steps that mix decodes, chunked prefill (a 16-token budget cuts the 23-token prompt, so its
    second chunk extends a cached prefix) and a prefix-cache hit; decode-only steps go through
    the CUDA-graph runner (padded to a bucket of 4)."""
    from engine import LLM, SamplingParams
    from engine.weights import PRESETS, ModelConfig

    monkeypatch.setitem(PRESETS, "tiny-gqa4", ModelConfig(512, 256, 2, 8, 2, 49152, rope_theta=10000.0,
                                                          tie_word_embeddings=True, name="tiny-gqa4"))
    g = torch.Generator().manual_seed(0)
    long = torch.randint(3, 49152, (23,), generator=g).tolist()
    prompts = [torch.randint(3, 49152, (7,), generator=g).tolist(), long, long[:16] + [5, 6, 7]]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    kw = dict(device=DEV.type, dtype="float32", max_num_batched_tokens=16, kv_cache_memory_bytes=32 * 2 * 2 * 16 * 2 * 64 * 4)
    llm = LLM("dummy:tiny-gqa4", attention_backend="triton", max_num_seqs=4, **kw)
    # decode-only steps through the CUDA-graph runner's padded static buffers and fused kernels
    # (no graph on a CPU: the capture itself runs only on CUDA)
    graphs = DecodeCudaGraphs(llm.model, llm.kv_cache.layers, llm.backend, 4, llm.max_model_len, 16,
                              use_graphs=CUDA, buckets=[4])  # one bucket: every decode step is padded
    llm.runner.cuda_graphs = graphs
    got = llm.generate(prompts, params, use_tqdm=False)
    assert graphs.num_steps >= 1
    want = LLM("dummy:tiny-gqa4", attention_backend="torch", **kw).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert got[2].num_cached_tokens == 16


def test_decode_buckets():
    assert decode_buckets(4) == [1, 2, 4]
    assert decode_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert decode_buckets(40) == [1, 2, 4, 8, 16, 32, 40]


def test_config_attention_backend_and_enforce_eager():
    from engine.attention import get_backend
    from engine.config import EngineConfig

    assert EngineConfig().attention_backend == "auto" and EngineConfig().enforce_eager is False
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(attention_backend="flash")
    assert isinstance(get_backend("triton"), TritonAttentionBackend)
    assert TritonAttentionBackend.supports_cuda_graphs
