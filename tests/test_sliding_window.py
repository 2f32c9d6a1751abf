"""Sliding-window attention (`AttentionBackend.forward(..., window=w)`: a query at position p attends
keys p - w < j <= p) in every backend, against dense float64 attention over the same keys and
values: mixed steps of decodes and prefill chunks that start mid-sequence over a cached prefix,
GQA (4 query heads over 2 KV heads), block size 16, odd lengths, windows below, at and above one
block. The kernels must not read the blocks wholly before a window (the KV cache frees them): those
blocks are filled with NaN (1-byte caches: values no read can hide) and their table entries pointed
at a placeholder block filled the same way. At window 0
(full attention) nothing changes: windows longer than every sequence give the same bits. The C
decoder driver runs a model with sliding-window layers as the Python layer loop does.

Without CUDA the Triton kernels run in Triton's interpreter (TRITON_INTERPRET=1, set before the
kernels are defined)."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from engine.attention import TorchAttentionBackend, cpu_kernel  # noqa: E402
from engine.attention.torch_quant_kv import TorchQuantKVAttentionBackend  # noqa: E402
from engine.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from engine.kernels import cpu as _cpu  # noqa: E402

from sliding_window_cases import BS, dense_reference, make_step, run  # noqa: E402

C = cpu_kernel.available()
needs_c = pytest.mark.skipif(not C, reason=f"no C kernel: {cpu_kernel.why_unavailable()}")


def _triton():
    return TritonAttentionBackend(num_splits=2, block_m=16, block_n=16, decode_block_n=16)


# name: (backend factory, cache dtype, head_dim, needs the C kernel)
BACKENDS = {
    "torch": (lambda: TorchAttentionBackend(cpu_kernel=False), torch.float32, 64, False),
    "torch-fp16-cache": (lambda: TorchAttentionBackend(cpu_kernel=False), torch.float16, 64, False),
    "c": (TorchAttentionBackend, torch.float32, 64, True),
    "c-fp16-cache": (TorchAttentionBackend, torch.float16, 64, True),
    "c-head-dim-48": (TorchAttentionBackend, torch.float32, 48, True),  # a head_dim chosen at run time
    "int8": (lambda: _no_kernel(TorchQuantKVAttentionBackend("int8")), torch.int8, 64, False),
    "c-int8": (lambda: TorchQuantKVAttentionBackend("int8"), torch.int8, 64, True),
    "fp8": (lambda: TorchQuantKVAttentionBackend("fp8_e4m3"), torch.int8, 64, False),
    "triton": (_triton, torch.float32, 64, False),
}
# below a block, exactly a block, above a block and below most sequences; 1: each row itself only
WINDOWS = [5, BS, 37, 1]
# int8 rows through the C kernel round a query and the weights to int16 codes (test_cpu_kernel.py)
TOL = 2e-4


def _no_kernel(backend):
    backend.use_cpu_kernel = False
    return backend


def _make(name: str, window_for_poison: int = 0, seed: int = 0):
    factory, cache_dtype, d, c_only = BACKENDS[name]
    if c_only and not C:
        pytest.skip(f"no C kernel: {cpu_kernel.why_unavailable()}")
    backend = factory()
    step = make_step(backend, seed=seed + d, d=d, cache_dtype=cache_dtype, poison_window=window_for_poison)
    if hasattr(backend, "_kernel_serves"):  # the path under test: the C kernel's, or the PyTorch one's
        assert backend._kernel_serves(step.q, step.k_cache, step.meta) == c_only
    return backend, step


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("name", list(BACKENDS))
def test_window_matches_dense_reference(name, window):
    backend, step = _make(name, seed=window)
    out = run(backend, step, window)
    ref = dense_reference(step, window)
    assert out.shape == step.q.shape and out.dtype == torch.float32
    assert (out.double() - ref).abs().max().item() < TOL
    # the window changed the result (every row past it attends fewer keys than full attention)
    assert (dense_reference(step, 0) - ref).abs().max().item() > 1e-2


@pytest.mark.filterwarnings("ignore:All-NaN slice encountered")  # Triton's interpreter, at full attention
@pytest.mark.parametrize("window", [5, BS, 37])
@pytest.mark.parametrize("name", list(BACKENDS))
def test_blocks_before_the_window_are_not_read(name, window):
    # (the C kernel's int8 rows in integer arithmetic give a masked key exactly zero weight and never
    # touch its V scale, so there a read of a block would not show; the tile's first block is the
    # same code for every row format, and the float caches' runs would show a read)
    backend, step = _make(name, window_for_poison=window, seed=100 + window)
    poisoned = sum(t.count(step.placeholder) for t in step.tables)  # entries on the placeholder
    assert poisoned > 3
    out = run(backend, step, window)
    assert torch.isfinite(out).all()
    assert (out.double() - dense_reference(step, window)).abs().max().item() < TOL
    # the same step at full attention reads the poisoned blocks: a read would show
    full = run(backend, step, 0)
    assert not torch.isfinite(full).all() or (full.double() - dense_reference(step, 0)).abs().max().item() > 1e-2


@pytest.mark.parametrize("name", ["c", "c-fp16-cache", "c-head-dim-48", "c-int8", "triton"])
def test_a_window_longer_than_every_sequence_gives_full_attentions_bits(name):
    backend, step = _make(name, seed=7)
    full = run(backend, step, 0).clone()
    assert torch.equal(run(backend, step, max(step.row_pos) + 1), full)
    assert torch.equal(run(backend, step, 10_000), full)
    assert torch.equal(run(backend, step, None), full)  # the call without the argument is window 0


@needs_c
@pytest.mark.parametrize("cache", ["fp32", "fp16", "int8"])
@pytest.mark.parametrize("window", [0, 5, BS, 37])
@pytest.mark.parametrize("build", ["generic", "avx2"])
def test_other_c_builds_window_without_reading_earlier_blocks(build, window, cache):
    """The plain-C path (-DTM_GENERIC) and the AVX2 build through the kernel's own entry point."""
    lib = _cpu.library(build)
    if lib is None:
        pytest.skip(f"no {build} build: {_cpu.why_unavailable(build)}")
    backend = TorchQuantKVAttentionBackend("int8") if cache == "int8" else TorchAttentionBackend()
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "int8": torch.int8}[cache]
    step = make_step(backend, seed=3, cache_dtype=dtype, poison_window=window)
    backend._write_kv(step.k, step.v, step.k_cache, step.v_cache, step.meta)
    tables, row_seq, kv_len, tiles = backend._kernel_plan(step.meta, step.q, step.k_cache)
    out = torch.empty_like(step.q)
    _cpu.paged_attention(step.q, step.k_cache, step.v_cache, tables, row_seq, kv_len, tiles, BS, step.scale, out,
                         lib=lib, window=window)
    assert torch.isfinite(out).all()
    assert (out.double() - dense_reference(step, window)).abs().max().item() < 1e-5


@needs_c
def test_c_decode_entry_point_takes_a_window():
    backend = TorchAttentionBackend()
    step = make_step(backend, seed=4, prefills=[], poison_window=BS)
    backend._write_kv(step.k, step.v, step.k_cache, step.v_cache, step.meta)
    m = step.meta
    out = cpu_kernel.paged_decode_attention(step.q, step.k_cache, step.v_cache, m.decode_block_tables,
                                            m.decode_seq_lens, BS, step.scale, window=BS)
    assert (out.double() - dense_reference(step, BS)).abs().max().item() < 1e-5


@pytest.mark.parametrize("name", ["torch", "triton"] + (["c"] if C else []))
@pytest.mark.parametrize("bad", [-1, 2.5, "5", True])
def test_a_bad_window_is_refused_naming_it(name, bad):
    backend, step = _make(name)
    with pytest.raises(ValueError, match="window"):
        run(backend, step, bad)


@needs_c
def test_kernel_binding_refuses_a_negative_window():
    backend = TorchAttentionBackend()
    step = make_step(backend, seed=5)
    tables, row_seq, kv_len, tiles = backend._kernel_plan(step.meta, step.q, step.k_cache)
    with pytest.raises(ValueError, match="window"):
        _cpu.paged_attention(step.q, step.k_cache, step.v_cache, tables, row_seq, kv_len, tiles, BS, step.scale,
                             torch.empty_like(step.q), window=-3)


def test_window_layers_metadata_is_prepared_with_the_step():
    """`AttentionMetadata.window_meta` (the sliding-window group's tables) is prepared by the same
    `prepare` call, and a window layer attends through it."""
    backend = TorchAttentionBackend(cpu_kernel=False)
    step = make_step(backend, seed=6)
    other = make_step(TorchAttentionBackend(cpu_kernel=False), seed=6)
    step.meta.cache = None
    step.meta.window_meta = other.meta
    other.meta.cache = None
    backend.prepare(step.meta)
    assert step.meta.cache is not None and other.meta.cache is not None
    out = backend.forward(other.q, other.k, other.v, other.k_cache, other.v_cache, step.meta.window_meta,
                          other.scale, window=BS)
    assert (out.double() - dense_reference(other, BS)).abs().max().item() < TOL


# ---------------------------------------------------------------- the C decoder driver


WINDOWS_PER_LAYER = (5, 0, BS, 37)
# every layer slides (each with its own window): one KV group, which the C driver serves; a
# model mixing full and sliding layers has two groups (engine.kv_cache.KVLayout) and runs the loop
ALL_SLIDING = (5, 9, BS, 37)
PROMPTS = [[1 + (i * 7 + j) % 900 for j in range(9 + 23 * i)] for i in range(4)]


def _tiny_sw_llm(monkeypatch, windows=WINDOWS_PER_LAYER):
    """A 4-layer dummy Llama (GQA 2, head_dim 64) with these per-layer windows, fp32 weights and
    cache, chunked prefills sharing steps with decodes, no prefix cache."""
    import dataclasses

    from engine import LLM
    from engine.loader import load_model
    from engine.weights import PRESETS, ModelConfig

    base = ModelConfig(256, 512, 4, 4, 2, 49152, rope_theta=10000.0, max_position_embeddings=512,
                       tie_word_embeddings=True, name="tiny-sw")
    monkeypatch.setitem(PRESETS, "tiny-sw", dataclasses.replace(base, layer_windows=windows))
    load_model.cache_clear()  # the loaded model is cached by name: another test's windows must not be reused
    llm = LLM("dummy:tiny-sw", speculative=None, enable_prefix_caching=False, max_num_batched_tokens=40,
              dtype="float32", kv_cache_dtype="fp32", kv_cache_memory_bytes=16 << 20)
    assert llm.model.cfg.layer_windows == windows
    return llm, base


def _generate(llm, monkeypatch, use_c: bool):
    from engine import SamplingParams
    from engine.models.llama import LlamaModel

    monkeypatch.setattr(LlamaModel, "use_c_decoder", use_c)
    params = SamplingParams(temperature=0, max_tokens=5, logprobs=2, ignore_eos=True)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@needs_c
def test_c_decoder_runs_sliding_window_layers_as_the_layer_loop(monkeypatch):
    """The driver (all layers in one C call) gives the same tokens and logprobs, bit for bit, as the
    Python layer loop calling the backend with each layer's window; and not those of the model
    without windows."""
    windows = ALL_SLIDING
    llm, base = _tiny_sw_llm(monkeypatch, windows)
    backend = llm.backend
    forward = type(backend).forward
    calls = []

    def with_layer_window(q, k, v, kc, vc, meta, scale, out=None, window=None):
        i = len(calls) % len(windows)
        calls.append(i)
        assert window in (None, 0, windows[i])
        return forward(backend, q, k, v, kc, vc, meta, scale, out=out, window=windows[i])

    monkeypatch.setattr(backend, "forward", with_layer_window)
    loop = _generate(llm, monkeypatch, False)
    assert calls  # the loop ran through the windowed backend
    calls.clear()
    driver = _generate(llm, monkeypatch, True)
    assert llm.model._c_decoder is not None and llm.model._c_decoder.windows.tolist() == list(windows)
    assert not calls  # every step went through the driver
    assert driver == loop
    # the same weights without windows give other logprobs
    monkeypatch.setattr(backend, "forward", lambda *a, **k: forward(backend, *a, **k))
    monkeypatch.setattr(llm.model, "cfg", base)  # (the model is cached for the process: restored after)
    monkeypatch.setattr(llm.model, "_c_decoder", None)
    assert _generate(llm, monkeypatch, True) != loop


@needs_c
def test_c_decoder_sliding_window_layers_use_their_own_block_tables(monkeypatch):
    """With the sliding-window group's slots and tables (here every block moved by half the pool) the
    window layers write and read only the moved blocks, and the tokens and logprobs are those of
    the shared tables, bit for bit."""
    from engine.kernels.cpu.decoder import CpuDecoder

    llm, _ = _tiny_sw_llm(monkeypatch, ALL_SLIDING)
    caches = llm.kv_cache.layers
    bs = llm.kv_cache.block_size
    nb = caches[0][0].shape[1] // bs
    for kc, vc in caches:
        kc.zero_()
        vc.zero_()
    shared = _generate(llm, monkeypatch, True)

    def used(i):  # the blocks layer i wrote
        return set(torch.nonzero(caches[i][0].view(caches[i][0].shape[0], nb, -1).abs().sum((0, 2))).flatten().tolist())

    before = [used(i) for i in range(len(caches))]
    perm = (torch.arange(nb) + nb // 2) % nb
    run_shared = CpuDecoder.run

    written = set()  # the blocks the engine's own slots name in the moved run

    def run_moved(self, h, positions, cos, sin, slot_mapping, plan, block_size, scale, bufs, **kw):
        assert not kw
        written.update((slot_mapping // block_size).tolist())
        slots = (perm[slot_mapping // block_size] * block_size + slot_mapping % block_size).contiguous()
        tables = perm[plan[0].long()].to(torch.int32).contiguous()
        return run_shared(self, h, positions, cos, sin, slot_mapping, plan, block_size, scale, bufs,
                          window_slot_mapping=slots, window_tables=tables)

    monkeypatch.setattr(CpuDecoder, "run", run_moved)
    for kc, vc in caches:
        kc.zero_()
        vc.zero_()
    assert _generate(llm, monkeypatch, True) == shared
    moved = {int(perm[b]) for b in written}
    for i in range(len(caches)):
        assert before[i] and used(i) == moved and moved != written
    with pytest.raises(ValueError, match="both or neither"):
        run_shared(llm.model._c_decoder, None, None, None, None, torch.zeros(1, dtype=torch.int64),
                   (None, None, None, None), BS, 1.0, (), window_tables=torch.zeros(1, 1, dtype=torch.int32))


def test_scoring_a_hybrid_model_equals_the_log_probabilities_of_each_choice(monkeypatch):
    """`score_choices_batch` on a model mixing full and sliding-window layers (prompts longer than
    every window, choices of one to several tokens) gives, per choice, the sum of the choice tokens'
    log-probabilities that `score` gives for prompt + choice; a prompt's scores do not depend on the
    other prompts; no KV block is kept."""
    llm, _ = _tiny_sw_llm(monkeypatch)
    assert llm.kv_manager.layout.hybrid
    tok = llm.get_tokenizer()
    choices = ["yes", "no", " maybe later", "positive sentiment overall"]
    prompts = [PROMPTS[2], PROMPTS[3], PROMPTS[0][:1]]
    free = llm.num_free_blocks
    got = llm.score_choices_batch([(p, choices) for p in prompts])
    assert llm.num_free_blocks == free
    for p, scores in zip(prompts, got):
        assert list(scores) == choices
        for c in choices:
            t = tok.encode(c, add_special_tokens=False)
            want = float(llm.score([p + t])[0][len(p) - 1:].double().sum())
            assert abs(scores[c] - want) < 1e-3, (c, scores[c], want)
    alone = llm.score_choices_batch([(prompts[1], choices)])[0]
    assert alone == got[1]
