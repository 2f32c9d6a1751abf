"""Per-layer-group KV block tables: sliding-window layers give their blocks back behind the window.

Most tests run the real scheduler, KV cache manager, KV cache tensors and `ModelRunner.prepare`
under a stand-in forward pass (`_Probe`): every layer writes each new token's (position + 1, id)
into its K cache through the step's slot mapping (the window layers through `meta.window_meta`),
then every query reads back the keys its layer attends to (p - w < j <= p, or j <= p) through the
step's block tables and checks each one is the right token. A wrong table, a block freed too early,
a stale prefix-cache block or two groups aliasing the same bytes fails the read. The next token is
a function of the tokens read, so the outputs equal `_reference`'s whenever every read is right.

The whole-engine test runs a dummy model with sliding-window layers through `LLM` and compares its
greedy tokens with an engine whose cache keeps every block in one table: over `_WindowReference`
(plain PyTorch paged attention honouring `window=`) always, and over the engine's PyTorch backend
once that backend honours `window=` (skipped until then).
"""
from __future__ import annotations

import dataclasses
import inspect
import math
import os

import numpy as np
import pytest
import torch

from engine.attention import AttentionMetadata
from engine.attention.torch_ref import TorchAttentionBackend
from engine.config import SamplingParams
from engine.kv_cache import (NULL_BLOCK, BlockPool, KVCache, KVLayout, kv_bytes_per_sequence,
                             kv_layout)
from engine.kv_cache_manager import KVCacheManager
from engine.model_runner import ChunkSpec, ModelRunner, StepInputs
from engine.outputs import RequestMetrics
from engine.request import Request, Sequence, SequenceStatus
from engine.scheduler import Scheduler
from engine.weights import PRESETS

BS = 4
W = 10  # the sliding window: not a multiple of BS, so the window straddles blocks
VOCAB = 50


def _cfg(windows: tuple):
    return dataclasses.replace(PRESETS["llama-tiny-4kv"], num_layers=len(windows), layer_windows=windows)


LAYOUTS = {
    "hybrid-3:1": (W, W, 0, W),  # 1 full layer, 3 sliding: rows = 3
    "gemma-like": (W, W, W, W, W, 0),  # 5 sliding : 1 full, rows = 5
    "mixed-windows": (W, 6, 0, 0, W),  # two windows (one table: the longest), 2 full layers, rows = 2
    "all-sliding": (W, W, W),  # Mistral v0.1: one group, and it slides
}


def _gemma3_270m():
    """Gemma 3 270M's KV shape: 18 layers, 1 KV head of 256, window 512 except layers 5, 11, 17."""
    windows = tuple(0 if i % 6 == 5 else 512 for i in range(18))
    return dataclasses.replace(PRESETS["llama-tiny-4kv"], hidden_size=640, num_heads=4, num_kv_heads=1, head_dim=256,
                               num_layers=18, layer_windows=windows)


# ------------------------------------------------------------------ layout and tensors

def test_layout_of_gemma3_groups_and_block_bytes():
    cfg = _gemma3_270m()
    assert cfg.head_dim == 256
    lay = kv_layout(cfg, 16)
    assert lay.main_layers == (5, 11, 17) and len(lay.window_layers) == 15 and lay.window == 512
    assert (lay.rows, lay.num_tensors, lay.pages_per_block, lay.main_block_tokens) == (5, 3, 15, 80)
    # window layer k reads row k // 3 of tensor k % 3: each (tensor, row) once
    assert sorted(lay.layer_view(i) for i in lay.window_layers) == sorted((j, r) for r in range(5) for j in range(3))
    assert [lay.layer_view(i) for i in lay.main_layers] == [(0, None), (1, None), (2, None)]
    full = kv_layout(PRESETS["llama-tiny-4kv"], 16)
    assert not full.hybrid and full.window == 0 and full.pages_per_block == 4
    slide = kv_layout(_cfg((W, W, W)), BS)
    assert not slide.hybrid and slide.main_window == W and slide.pages_per_block == 3


@pytest.mark.parametrize("shape_of", ["heads-first", "slots-first"])
def test_window_views_alias_exactly_their_pool_block(shape_of):
    """Pool block x is the same bytes in both groups: the window layers' page x and the main layers'
    pages `main_pages([x])` cover the same elements of the physical tensors, and nothing else."""
    cfg = dataclasses.replace(_cfg(LAYOUTS["gemma-like"]), num_kv_heads=2)  # 2 KV heads: the head-major case
    M, h, d = 7, 2, 3
    shape = (h, M * BS, d) if shape_of == "heads-first" else (M * BS, h, d)
    kv = KVCache(cfg, M, BS, torch.float32, torch.device("cpu"), shape)
    lay = kv.layout
    axis = kv.slot_axis
    assert all(k.is_contiguous() and tuple(k.shape) == shape for i, (k, _) in enumerate(kv.layers)
               if i in lay.window_layers)
    whole = list(shape)
    whole[axis] *= lay.rows
    assert all(kv.layers[i][0] is kv.tensors[j][0] for j, i in enumerate(lay.main_layers))
    assert all(tuple(t.shape) == tuple(whole) for t, _ in kv.tensors)
    for x in range(M):
        for t, _ in kv.tensors:
            t.zero_()
        for i in lay.window_layers:  # the window group writes its block x in every window layer
            k = kv.layers[i][0]
            k.narrow(axis, x * BS, BS).fill_(i + 1)
        pages = kv.main_pages([x])
        for j, i in enumerate(lay.main_layers):  # seen by the main layers: exactly their pages of block x
            k = kv.layers[i][0]
            inside = torch.cat([k.narrow(axis, p * BS, BS) for p in pages.tolist()], dim=axis)
            assert bool((inside != 0).all())
            assert int((k != 0).sum()) == inside.numel()
        flat = torch.cat([t.reshape(-1) for t, _ in kv.tensors])
        counts = {v: int((flat == v).sum()) for v in flat[flat != 0].unique().tolist()}
        page = math.prod(shape) // M
        assert counts == {float(i + 1): page for i in lay.window_layers}  # no window layer overwrote another


def test_block_bytes_match_the_tensors_and_the_budget():
    from engine.loader import kv_block_bytes

    cfg = _gemma3_270m()
    backend = TorchAttentionBackend()
    lay = kv_layout(cfg, 16)
    per_block = kv_block_bytes(backend, torch.float16, lay.pages_per_block, cfg.num_kv_heads, cfg.head_dim, 16)
    assert per_block == 15 * 16 * 2 * 256 * 2 == lay.pages_per_block * 16 * cfg.kv_bytes_per_token(2) // cfg.num_layers
    budget = 3 * per_block + per_block // 2
    num_blocks = budget // per_block
    kv = KVCache(cfg, num_blocks, 16, torch.float16, torch.device("cpu"),
                 backend.cache_shape(num_blocks, 16, cfg.num_kv_heads, cfg.head_dim))
    held = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv.tensors)
    assert held == num_blocks * per_block <= budget


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="resident memory is read from Linux's /proc")
def test_cpu_cache_pages_are_faulted_in_when_first_written():
    """The CPU KV pool is not faulted in at start-up (a job using a few blocks of the default budget
    paid seconds for the rest): 2 x 64 MiB of pool add well under their size to the resident memory,
    read as zeros, and a written block holds its values; `huge_empty`'s populate=True holds it all."""
    from engine.kernels.cpu.memory import huge_empty

    cfg = dataclasses.replace(PRESETS["llama-tiny-4kv"], num_layers=1)
    backend = TorchAttentionBackend()
    pool = 64 << 20
    num_blocks = pool // (16 * cfg.num_kv_heads * cfg.head_dim * 4)
    before = _resident_bytes()
    kv = KVCache(cfg, num_blocks, 16, torch.float32, torch.device("cpu"),
                 backend.cache_shape(num_blocks, 16, cfg.num_kv_heads, cfg.head_dim))
    k, v = kv.layers[0]
    assert k.numel() * 4 == pool and _resident_bytes() - before < pool // 4
    k.view(-1)[:16 * cfg.num_kv_heads * cfg.head_dim] = 1.5
    assert float(k.view(-1)[0]) == 1.5 and float(k.view(-1)[-1]) == 0.0 and float(v.view(-1)[0]) == 0.0
    assert _resident_bytes() - before < pool // 4
    before = _resident_bytes()
    held = huge_empty(pool)
    assert _resident_bytes() - before >= pool * 9 // 10 and int(held[-1]) == 0


def test_kv_bytes_per_sequence_counts_the_blocks_the_manager_holds():
    """Gemma 3 270M at 8192 tokens: the bytes reported equal the blocks one sequence holds when the
    manager runs it token by token, against 18 layers x 8192 tokens under full attention."""
    cfg = _gemma3_270m()
    mgr = KVCacheManager(BlockPool(10_000, enable_prefix_caching=False), kv_layout(cfg, 16))
    seq = _seq(0, [1] * 8191)
    assert mgr.allocate_slots(seq, 8191)
    seq.num_computed_tokens = 8191
    assert mgr.allocate_slots(seq, 1)  # the last token's step
    held = sum(mgr.num_held_blocks(seq))
    ours, full = kv_bytes_per_sequence(cfg, 8192, 16, 2)
    assert full == 8192 * 18 * 2 * 256 * 2
    assert ours == held * 15 * 16 * 2 * 256 * 2  # 15 pages (layers) of 16 tokens per block, K and V in fp16
    assert mgr.num_held_blocks(seq) == [math.ceil(8192 / 80), 512 // 16]
    assert ours < full / 4


# ------------------------------------------------------------------ the probe engine

def _seq(i: int, prompt: list[int]) -> Sequence:
    req = Request(request_id=str(i), index=i, prompt=None, prompt_token_ids=list(prompt),
                  params=SamplingParams(temperature=0.0), metrics=RequestMetrics(arrival_time=0.0))
    seq = Sequence(seq_id=i, request=req, index=0, token_ids=list(prompt))
    req.seqs.append(seq)
    return seq


def _next_token(tokens: list[int], p: int, windows: tuple) -> int:
    """The stand-in model: a function of the tokens each layer attends to from position p."""
    acc = 0
    for w in windows:
        lo = max(0, p - w + 1) if w else 0
        acc += sum(t * (j % 5 + 1) for j, t in enumerate(tokens[lo:p + 1], start=lo))
    return acc % (VOCAB - 1) + 1


def _reference(prompt: list[int], n: int, windows: tuple) -> list[int]:
    toks = list(prompt)
    for _ in range(n):
        toks.append(_next_token(toks, len(toks) - 1, windows))
    return toks[len(prompt):]


class _Model:
    device = torch.device("cpu")


class _Probe:
    """A scheduler, manager, cache and runner over a model config with sliding-window layers, and a
    step loop (as `EngineCore.step`, greedy, no stops) whose forward pass is the read check."""

    def __init__(self, windows: tuple, num_blocks: int, budget: int = 16, max_num_seqs: int = 8,
                 prefix_caching: bool = False) -> None:
        self.cfg = _cfg(windows)
        self.windows = windows
        shape = (1, num_blocks * BS, 2)  # 1 KV head of 2: (position + 1, token id)
        self.kv = KVCache(self.cfg, num_blocks, BS, torch.float32, torch.device("cpu"), shape)
        self.pool = BlockPool(num_blocks, prefix_caching)
        self.mgr = KVCacheManager(self.pool, self.kv.layout)
        self.sched = Scheduler(self.mgr, BS, max_num_seqs, budget)
        self.runner = ModelRunner(_Model(), self.kv, None)
        self.steps: list[dict] = []  # per step: seq_id -> (first query, tokens, held blocks per group)

    def _forward(self, out, inputs: StepInputs) -> list[int]:
        meta = inputs.meta
        lay = self.kv.layout
        assert (meta.window_meta is not None) == lay.hybrid
        rows = [c.seq for c in out.decodes] + [c.seq for c in out.prefills for _ in range(c.num_tokens)]
        pos = inputs.positions
        ids = inputs.input_ids.float()
        for i, w in enumerate(self.windows):  # write every layer's new K first
            m = meta.window_meta if i in lay.window_layers else meta
            k = self.kv.layers[i][0]
            k[0, m.slot_mapping, 0] = pos.float() + 1
            k[0, m.slot_mapping, 1] = ids
        tables = []  # per row, per layer: its block table
        for i in range(len(self.windows)):
            m = meta.window_meta if i in lay.window_layers else meta
            per = [m.decode_block_tables[r] for r in range(m.num_decode_tokens)]
            for t, n in zip(m.prefill_block_tables, m.prefill_query_lens):
                per += [t] * n
            tables.append(per)
        for r, (seq, p) in enumerate(zip(rows, pos.tolist())):
            for i, w in enumerate(self.windows):
                js = torch.arange(max(0, p - w + 1) if w else 0, p + 1)
                slots = tables[i][r][js // BS] * BS + js % BS
                got = self.kv.layers[i][0][0, slots]
                want = torch.tensor([[j + 1, seq.token_ids[j]] for j in js.tolist()], dtype=torch.float32)
                assert torch.equal(got, want), f"seq {seq.seq_id} layer {i} position {p}: wrong keys"
        out_rows = inputs.logits_indices.tolist()
        return [_next_token(rows[r].token_ids, pos[r].item(), self.windows) for r in out_rows]

    def run(self, prompts: list[list[int]], max_tokens: int, start_id: int = 0) -> list[list[int]]:
        seqs = [_seq(start_id + i, p) for i, p in enumerate(prompts)]
        for s in seqs:
            self.sched.add(s)
        while self.sched.has_unfinished():
            out = self.sched.schedule()
            assert not out.is_empty
            self.steps.append({c.seq.seq_id: (c.seq.num_computed_tokens, c.num_tokens,
                                              self.mgr.num_held_blocks(c.seq)) for c in out.chunks})
            self.steps[-1]["free"] = self.pool.num_free_blocks
            self.steps[-1]["tables"] = {s.seq_id: (list(s.block_table), list(s.window_table))
                                        for s in self.sched.running}
            sample = [c.seq for c in out.decodes if c.samples] + [c.seq for c in out.prefills if c.samples]
            toks = self._forward(out, self.runner.prepare_scheduled(out))
            for c in out.chunks:
                c.seq.num_computed_tokens += c.num_tokens
                self.sched.register_computed(c.seq)
            for s, t in zip(sample, toks):
                s.token_ids.append(t)
                if s.num_output_tokens >= max_tokens:
                    self.sched.finish(s)
        assert all(s.status == SequenceStatus.FINISHED for s in seqs)
        self.seqs = seqs
        return [s.output_token_ids for s in seqs]


def _prompt(n: int, seed: int) -> list[int]:
    g = np.random.default_rng(seed)
    return g.integers(1, VOCAB, n).tolist()


# ------------------------------------------------------------------ block counts

@pytest.mark.parametrize("name", list(LAYOUTS))
def test_long_sequence_holds_the_window_and_the_full_group_its_length(name):
    windows = LAYOUTS[name]
    probe = _Probe(windows, num_blocks=200, budget=16)
    prompt = _prompt(45, 1)
    assert probe.run([prompt], 120) == [_reference(prompt, 120, windows)]
    lay, w = probe.kv.layout, max(windows)
    decode_steps = 0
    for step in probe.steps:
        p0, n, held = step[0]
        total = p0 + n
        lo, hi = max(0, (p0 - w + 1) // BS), math.ceil(total / BS)  # the window before the first query, the chunk
        if lay.hybrid:
            assert held == [math.ceil(total / lay.main_block_tokens), hi - lo]
        else:
            assert held == [hi - lo]
        if n == 1 and total > w:
            decode_steps += 1
            assert held[-1] <= math.ceil(w / BS) + 1
        assert step["free"] == 200 - sum(held)  # (no prefix caching: every other block is free)
    assert decode_steps > 100
    assert probe.pool.num_free_blocks == 200


def test_freed_window_blocks_are_taken_by_other_sequences():
    """A pool too small for three sequences under full attention runs them together without preempting:
    blocks the window group of one gives back are allocated to another while the first still runs."""
    windows = LAYOUTS["gemma-like"]
    lay = kv_layout(_cfg(windows), BS)
    prompts = [_prompt(30 + 7 * i, 10 + i) for i in range(3)]
    # full attention would hold ceil(total / BS) blocks of every layer: 6 pages per block instead of 5
    full_pages = sum(math.ceil((len(p) + 90) / BS) * len(windows) for p in prompts)
    num_blocks = 3 * (math.ceil(130 / lay.main_block_tokens) + math.ceil((W - 1 + 16) / BS) + 1) + 2
    assert num_blocks * lay.pages_per_block < full_pages / 2
    probe = _Probe(windows, num_blocks=num_blocks, budget=16, max_num_seqs=3)
    outs = probe.run(prompts, 90)
    assert outs == [_reference(p, 90, windows) for p in prompts]
    assert probe.sched.num_preemptions == 0
    # some block left one sequence's window table and later sat in another sequence's table
    owner_then: dict[int, int] = {}
    reused = 0
    for step in probe.steps:
        for sid, (main, win) in step["tables"].items():
            for b in main + [b for b in win if b != NULL_BLOCK]:
                if owner_then.get(b, sid) != sid:
                    reused += 1
                owner_then[b] = sid
    assert reused > 0
    assert probe.pool.num_free_blocks == num_blocks


# ------------------------------------------------------------------ prefix caching and preemption

@pytest.mark.parametrize("name", ["gemma-like", "all-sliding"])
def test_prefix_hit_gives_the_tokens_of_a_fresh_run(name):
    windows = LAYOUTS[name]
    probe = _Probe(windows, num_blocks=120, budget=64, prefix_caching=True)
    shared = _prompt(60, 3)
    a = shared + _prompt(5, 4)
    b = shared + _prompt(9, 5)
    assert probe.run([a], 20) == [_reference(a, 20, windows)]
    assert probe.run([b], 20, start_id=1) == [_reference(b, 20, windows)]
    hit = probe.seqs[0].num_cached_tokens
    lay = probe.kv.layout
    assert hit == (60 // lay.main_block_tokens) * lay.main_block_tokens if lay.hybrid else hit == 60
    # the whole prompt cached (in whole main-group blocks); at least its last token is recomputed
    assert probe.run([a], 20, start_id=2) == [_reference(a, 20, windows)]
    whole = (len(a) // lay.main_block_tokens) * lay.main_block_tokens
    assert probe.seqs[0].num_cached_tokens == min(len(a) - 1, whole)


def test_prefix_hit_without_its_window_blocks_is_cut_back():
    """Evict the cached window blocks at the end of a prefix (the main group's stay): the hit falls
    back to where the window's blocks are still cached (here none), and the tokens are unchanged."""
    windows = LAYOUTS["hybrid-3:1"]
    probe = _Probe(windows, num_blocks=60, budget=64, prefix_caching=True)
    prompt = _prompt(48, 7)
    assert probe.run([prompt], 4) == [_reference(prompt, 4, windows)]
    win_keys = [("w", k) for _, k in probe.seqs[0].block_keys]
    last = probe.pool.lookup(win_keys[(len(prompt) - 1) // BS - 1])
    assert last is not None
    taken = []
    while probe.pool.lookup(win_keys[(len(prompt) - 1) // BS - 1]) is not None:  # evict, LRU first
        taken += probe.pool.allocate(1)
    main_key = probe.seqs[0].block_keys[probe.kv.layout.rows - 1][1]  # the main group's first block
    assert probe.pool.lookup(main_key) is not None
    probe.pool.free(taken)
    again = probe.run([prompt], 4, start_id=1)
    assert again == [_reference(prompt, 4, windows)]
    assert probe.seqs[0].num_cached_tokens == 0


@pytest.mark.parametrize("caching", [False, True])
def test_preemption_recomputes_to_the_same_tokens(caching):
    windows = LAYOUTS["hybrid-3:1"]
    prompts = [_prompt(20 + 3 * i, 20 + i) for i in range(5)]
    probe = _Probe(windows, num_blocks=16, budget=16, max_num_seqs=5, prefix_caching=caching)
    outs = probe.run(prompts, 40)
    assert probe.sched.num_preemptions > 0
    assert outs == [_reference(p, 40, windows) for p in prompts]
    assert probe.pool.num_free_blocks == 16


def test_scratch_tables_and_packed_steps_carry_the_window_group():
    windows = LAYOUTS["gemma-like"]
    probe = _Probe(windows, num_blocks=40)
    main, win = probe.mgr.allocate_scratch(23)
    assert (len(main), len(win)) == (math.ceil(23 / 20), math.ceil(23 / BS))
    assert probe.pool.num_free_blocks == 40 - len(main) - len(win)
    runner = probe.runner
    with pytest.raises(ValueError, match="window_table"):
        runner.prepare([], [ChunkSpec(list(range(23)), 0, 23, main, "last")])
    dec = ChunkSpec(list(range(23)), 22, 1, main, "last", window_table=win)
    pre = ChunkSpec(list(range(23)), 5, 18, main, "all", window_table=win)
    inputs = runner.prepare([dec], [pre])
    m, w = inputs.meta, inputs.meta.window_meta
    assert w is not None and w.window_meta is None
    pages = probe.kv.main_pages(main)
    assert m.decode_block_tables[0].tolist() == pages.tolist()
    assert m.slot_mapping[0].item() == pages[22 // BS] * BS + 22 % BS
    assert w.slot_mapping[0].item() == win[22 // BS] * BS + 22 % BS
    back = StepInputs.unpack(inputs.pack())
    for a, b in ((m, back.meta), (w, back.meta.window_meta)):
        assert torch.equal(a.slot_mapping, b.slot_mapping)
        assert torch.equal(a.decode_block_tables, b.decode_block_tables)
        assert [t.tolist() for t in a.prefill_block_tables] == [t.tolist() for t in b.prefill_block_tables]
    probe.mgr.free_scratch((main, win))
    assert probe.pool.num_free_blocks == 40


def test_backend_prepare_runs_on_both_groups(monkeypatch):
    windows = LAYOUTS["hybrid-3:1"]
    probe = _Probe(windows, num_blocks=20)
    seen = []

    class Backend:
        def prepare(self, meta: AttentionMetadata) -> None:
            seen.append(meta)

    class Model:
        device = torch.device("cpu")

        def forward(self, ids, pos, meta, layers, backend, logits_idx, tp):
            assert seen == [meta, meta.window_meta]
            return torch.zeros(int(logits_idx.shape[0]), VOCAB)

    runner = ModelRunner(Model(), probe.kv, Backend())
    main, win = probe.mgr.allocate_scratch(9)
    runner.compute_logits(list(range(9)), main, win)
    assert len(seen) == 2


# ------------------------------------------------------------------ the whole engine

class _WindowReference(TorchAttentionBackend):
    """Paged attention in plain PyTorch, one query row at a time, honouring `window` (keys at
    positions p - window < j <= p): the engine test's oracle, independent of the kernels."""

    def prepare(self, meta: AttentionMetadata) -> None:
        pass

    def forward(self, q, k, v, k_cache, v_cache, meta, scale, out=None, window=0):
        slots = meta.slot_mapping
        k_cache[:, slots] = k.transpose(0, 1).to(k_cache.dtype)
        v_cache[:, slots] = v.transpose(0, 1).to(v_cache.dtype)
        rows = [(meta.decode_block_tables[i], int(meta.decode_seq_lens[i]) - 1)
                for i in range(meta.num_decode_tokens)]
        for t, n, sl in zip(meta.prefill_block_tables, meta.prefill_query_lens, meta.prefill_seq_lens):
            rows += [(t, sl - n + j) for j in range(n)]
        res = torch.empty_like(q)
        bs, g = meta.block_size, q.shape[1] // k_cache.shape[0]
        for r, (table, p) in enumerate(rows):
            js = torch.arange(max(0, p - window + 1) if window else 0, p + 1)
            sl = table.to(torch.int64)[js // bs] * bs + js % bs
            kk = k_cache[:, sl].float().repeat_interleave(g, 0)  # [Hq, n, D]
            vv = v_cache[:, sl].float().repeat_interleave(g, 0)
            att = torch.softmax((kk @ q[r].float().unsqueeze(-1)).squeeze(-1) * scale, dim=-1)
            res[r] = (att.unsqueeze(1) @ vv).squeeze(1).to(q.dtype)
        if out is not None:
            out.copy_(res)
            return out
        return res


def _torch_backend_honours_windows() -> bool:
    """Whether the engine's PyTorch backend masks to `window` (another change brings it)."""
    be = TorchAttentionBackend()
    if "window" not in inspect.signature(be.forward).parameters:
        return False
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(8, 2, 4, generator=g) for _ in range(3))
    outs = []
    for w in (0, 3):
        kc, vc = torch.zeros(2, 16, 4), torch.zeros(2, 16, 4)
        meta = AttentionMetadata(slot_mapping=torch.arange(8), num_decode_tokens=0, decode_seq_lens=torch.zeros(0),
                                 decode_block_tables=torch.zeros(0, 1, dtype=torch.int64), prefill_query_starts=[0],
                                 prefill_query_lens=[8], prefill_seq_lens=[8],
                                 prefill_block_tables=[torch.arange(4)], block_size=4)
        be.prepare(meta)
        outs.append(be.forward(q, k, v, kc, vc, meta, 0.5, window=w))
    return not torch.allclose(outs[0], outs[1])


_MODEL_USES_WINDOWS = "window_meta" in inspect.getsource(__import__("engine.models.llama", fromlist=["x"]))


@pytest.mark.skipif(not _MODEL_USES_WINDOWS,
                    reason="the model does not pick meta.window_meta for its sliding-window layers yet")
@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("windows", [(24, 24, 24, 0), (24, 24, 24, 24)])
def test_engine_with_window_groups_equals_engine_keeping_every_block(monkeypatch, windows, backend):
    """The whole engine on a dummy model with sliding-window layers: greedy tokens with the window
    groups (blocks given back, a prefix hit, preemption) equal an engine whose cache keeps every block
    of every layer in one table (the model still masks each layer to its window)."""
    import engine.llm as llm_mod
    import engine.loader as loader_mod
    from engine.config import EngineConfig
    from engine.llm import LLM
    from engine.loader import min_kv_cache_memory_bytes

    if backend == "reference":
        monkeypatch.setattr(loader_mod, "get_backend", lambda name: _WindowReference(cpu_kernel=False))
    elif not _torch_backend_honours_windows():
        pytest.skip("the PyTorch attention backend does not honour window= yet")
    name = "llama-tiny-swa-" + "-".join(map(str, windows))  # (loaded models are cached by name)
    cfg = dataclasses.replace(PRESETS["llama-tiny-4kv"], layer_windows=windows, name=name)
    monkeypatch.setitem(PRESETS, name, cfg)
    prompts = [_prompt(40 + 9 * i, 30 + i) for i in range(4)]
    prompts += [prompts[0][:36] + _prompt(12, 40)]  # a prefix hit
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    kw = dict(block_size=8, max_num_batched_tokens=32, dtype="float32", kv_cache_dtype="fp32", cpu_kernels=False)

    def run(blocks: int):
        block = min_kv_cache_memory_bytes(EngineConfig(model=f"dummy:{name}", **kw), cfg)
        llm = LLM(f"dummy:{name}", kv_cache_memory_bytes=blocks * block, **kw)
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        return llm, outs

    grouped, got = run(400)
    assert grouped.scheduler.kv.layout.window == 24
    assert grouped.scheduler.kv.layout.hybrid == (0 in windows)
    hits = [o.num_cached_tokens for o in grouped.generate(prompts[-1:], params, use_tqdm=False)]
    assert hits[0] > 0
    tight, preempted = run(20)
    assert tight.stats.num_preemptions > 0
    n = len(windows)
    one_table = lambda c, bs: KVLayout(bs, n, tuple(range(n)), (), 0, 1, n)  # noqa: E731
    monkeypatch.setattr(llm_mod, "kv_layout", one_table)
    monkeypatch.setattr(loader_mod, "kv_layout", one_table)
    plain, want = run(400)
    assert not plain.scheduler.kv.layout.window
    assert got == want and preempted == want


def test_draft_model_speculation_is_refused_for_a_sliding_window_model(monkeypatch):
    from engine.llm import LLM

    cfg = dataclasses.replace(PRESETS["llama-tiny-4kv"], layer_windows=(8, 8, 8, 0), name="llama-tiny-swa-refuse")
    monkeypatch.setitem(PRESETS, cfg.name, cfg)
    with pytest.raises(ValueError, match="'draft_model' is not supported for a model with sliding-window layers"):
        LLM(f"dummy:{cfg.name}", kv_cache_memory_bytes=1 << 20, dtype="float32",
            speculative_config={"method": "draft_model", "draft_model": "self:1", "num_speculative_tokens": 2})
