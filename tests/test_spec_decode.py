"""Speculative decoding: verification is exact (greedy output identical to speculation off, the
rejection sampler keeps the target distribution), rollback, stops and max_tokens, the proposers
and the goodput policy."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from engine import LLM, SamplingParams
from engine.sampler import Sampler
from engine.spec_decode import NgramProposer, SuffixIndex
from engine.spec_decode.policy import AcceptanceTracker, StepCostModel, choose_lengths, worth_drafting

KV = 96 << 20


def _prompts(tok) -> list[list[int]]:
    """40+ prompts: real text, repetitive ones, code repeating an earlier block, a word 50 times."""
    texts = [
        "The capital of France is", "Once upon a time there was a small robot who", "def fibonacci(n):",
        "List the planets of the solar system:", "The quick brown fox jumps over the lazy dog. " * 3,
        "apple " * 50, "1, 2, 3, 4, 5, 6, 7, 8,", "for i in range(10):\n    print(i)\nfor i in range(10):\n",
        "Translate to French: good morning, good night, good morning,", "A B C D E F G A B C D E F G A B C",
        "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\nclass Vector:\n",
        "Write a haiku about the sea.", "Q: What is 2 + 2?\nA: 4\nQ: What is 3 + 3?\nA:",
        "Monday, Tuesday, Wednesday,", "The mitochondria is the powerhouse of the",
        "import numpy as np\nimport numpy as np\nimport", "red green blue red green blue red green",
        "To be or not to be, that is the", "SELECT name FROM users WHERE id = 1; SELECT name FROM users WHERE",
        "x = 1\ny = 2\nz = x + y\nprint(z)\nx = 1\ny = 2\n",
    ]
    ids = [tok.encode(t) for t in texts]
    chat = [tok.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    return ids + [tok.encode(c) for c in chat]


@pytest.fixture(scope="module")
def base():
    llm = LLM("smollm2-135m-instruct", speculative=None, kv_cache_memory_bytes=KV)
    prompts = _prompts(llm.tokenizer)
    assert len(prompts) >= 40
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return llm, prompts, params, [o.outputs[0].token_ids for o in outs]


def _near_tie_or_equal(llm, prompts, want, got) -> int:
    """Number of differing completions; each difference must be a near tie (top-2 gap < 1e-4)."""
    diffs = 0
    for p, a, b in zip(prompts, want, got):
        if a == b:
            continue
        i = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        top = llm.compute_logits(p + a[:i]).topk(2).values
        assert float(top[0] - top[1]) < 1e-4, (p[:8], i)
        diffs += 1
    return diffs


@pytest.mark.parametrize("config", [
    {"method": "ngram", "num_speculative_tokens": 1},
    # ngram with k = 4 is checked against speculation off by test_preemption_and_prefix_caching_with_speculation
    {"method": "ngram", "num_speculative_tokens": 8},
    {"method": "suffix", "num_speculative_tokens": 2},
    {"method": "draft_model", "draft_model": "self:10", "num_speculative_tokens": 4},
    {"method": "auto", "num_speculative_tokens": 8},
], ids=lambda c: f"{c['method']}-k{c['num_speculative_tokens']}")
def test_greedy_output_equals_speculation_off(base, config):
    ref_llm, prompts, params, want = base
    if config["method"] == "draft_model":  # a 10-layer draft of 4 tokens costs 2-3x a plain step: half the prompts
        prompts, want = prompts[::2], want[::2]
    llm = LLM("smollm2-135m-instruct", speculative_config=config, kv_cache_memory_bytes=KV)
    if config["method"] == "suffix":  # give the job-wide index some earlier outputs to draft from
        llm.generate(prompts[:10], params, use_tqdm=False)
    outs = llm.generate(prompts, params, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    assert _near_tie_or_equal(ref_llm, prompts, want, got) <= 1
    st = llm.stats
    if config["method"] != "auto":
        assert st.spec_draft_tokens > 0 and st.spec_accepted_tokens > 0
    assert sum(o.metrics.spec_draft_tokens for o in outs) <= st.spec_draft_tokens
    assert all(len(o.outputs[0].token_ids) == 40 for o in outs)


def test_target_as_its_own_draft_accepts_everything(base):
    _, prompts, params, want = base
    llm = LLM("smollm2-135m-instruct", kv_cache_memory_bytes=KV,
              speculative_config={"method": "draft_model", "draft_model": "target", "num_speculative_tokens": 4})
    outs = llm.generate(prompts[:12], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want[:12]
    assert llm.stats.spec_accepted_tokens == llm.stats.spec_draft_tokens > 0


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_and_prefix_caching_with_speculation(base, prefix_caching):
    """A pool of 24 blocks for 10 sequences of 70+ tokens forces preemption; greedy tokens still
    equal speculation off, and no block leaks."""
    ref_llm, prompts, params, want = base
    small = LLM("smollm2-135m-instruct", kv_cache_memory_bytes=24 * 16 * 23040,  # 24 blocks of fp16 K/V max_num_seqs=10,
                enable_prefix_caching=prefix_caching,
                speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    outs = small.generate(prompts[:10], params, use_tqdm=False)
    assert small.stats.num_preemptions > 0
    assert _near_tie_or_equal(ref_llm, prompts[:10], want[:10], [o.outputs[0].token_ids for o in outs]) <= 1
    assert small.num_free_blocks == small.num_total_blocks


def test_seeded_sampling_reproduces_and_max_tokens_is_exact(base):
    """Seeded sampled rows give the same tokens in every run, and the same tokens as with
    speculation off (verification draws one uniform per emitted token, as plain decoding does)."""
    ref_llm = base[0]
    llm = LLM("smollm2-135m-instruct", kv_cache_memory_bytes=KV,
              speculative_config={"method": "ngram", "num_speculative_tokens": 8})
    p = llm.tokenizer.encode("apple " * 30)
    q = llm.tokenizer.encode("for i in range(10):\n    print(i)\nfor i in range(10):\n")
    sp = SamplingParams(temperature=0.3, seed=5, max_tokens=48, ignore_eos=True)
    a = llm.generate([p, p, q], sp, use_tqdm=False)
    b = llm.generate([p, q], sp, use_tqdm=False)
    off = ref_llm.generate([p, q], sp, use_tqdm=False)
    assert a[0].outputs[0].token_ids == a[1].outputs[0].token_ids == b[0].outputs[0].token_ids
    assert a[2].outputs[0].token_ids == b[1].outputs[0].token_ids
    assert [o.outputs[0].token_ids for o in b] == [o.outputs[0].token_ids for o in off]
    assert sum(o.metrics.spec_accepted_tokens for o in a) > 0
    for n in (1, 2, 3):
        o = llm.generate([p], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)[0]
        assert len(o.outputs[0].token_ids) == n and o.outputs[0].finish_reason == "length"
    assert llm.stats.spec_accepted_tokens > 0


def test_stop_string_inside_an_accepted_run_cuts_where_speculation_off_cuts(base):
    ref_llm = base[0]
    prompt = ref_llm.tokenizer.encode("one two three four five six seven eight nine ten one two three four five")
    free = ref_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    text = free[0].outputs[0].text
    words = text.split()
    assert len(words) >= 4
    stop = " " + words[3]  # a word a few tokens in: drafted and accepted in one run with k = 8
    sp = SamplingParams(temperature=0, max_tokens=30, stop=[stop])
    off = ref_llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
    spec = LLM("smollm2-135m-instruct", kv_cache_memory_bytes=KV,
               speculative_config={"method": "ngram", "num_speculative_tokens": 8})
    on = spec.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
    assert on.text == off.text and on.finish_reason == off.finish_reason == "stop"
    assert spec.stats.spec_accepted_tokens > 0


# ---------------------------------------------------------------- the rejection sampler

def _toy_seq(gen, temperature=1.0):
    params = SamplingParams(temperature=temperature)
    return SimpleNamespace(request=SimpleNamespace(params=params), generator=gen, token_ids=[0],
                           output_token_ids=[], num_output_tokens=0)


CHI2_999 = {7: 24.32}  # chi-square critical value at p = 0.001, 7 degrees of freedom


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = float(counts.sum())
    exp = probs * n
    keep = exp > 0
    return float((((counts - exp) ** 2)[keep] / exp[keep]).sum())


@pytest.mark.parametrize("draft_token", [0, 3, 6])
def test_rejection_sampler_keeps_the_target_distribution(draft_token):
    """A fixed 8-token target p and a deterministic two-token draft (x, x): the first emitted
    token follows p (chi-square at p = 0.001 over 20000 draws), x is accepted with probability
    p(x), and the token after an accepted x follows p again. A sampler that always accepted
    would fail by orders of magnitude."""
    p = torch.tensor([0.30, 0.05, 0.15, 0.10, 0.20, 0.0, 0.12, 0.08])
    logits = p.clamp_min(1e-30).log()
    logits[p == 0] = float("-inf")
    sampler = Sampler(8, [])
    gen = torch.Generator().manual_seed(draft_token)
    seq = _toy_seq(gen)
    n = 20000
    first = torch.zeros(8)
    second = torch.zeros(8)
    accepted = 0
    for _ in range(n):
        (new, _, a), = sampler.verify(logits.repeat(3, 1), [(seq, [draft_token, draft_token])])
        first[new[0]] += 1
        assert (a > 0) == (new[0] == draft_token) and len(new) == a + 1
        if a > 0:
            accepted += 1
            second[new[1]] += 1
    assert first[5] == 0 and second[5] == 0
    assert _chi2(first, p) < CHI2_999[7]
    assert _chi2(second, p) < CHI2_999[7]
    sd = math.sqrt(n * p[draft_token] * (1 - p[draft_token]))
    assert abs(accepted - n * float(p[draft_token])) < 4 * sd
    always_accept = torch.zeros(8)
    always_accept[draft_token] = n
    assert _chi2(always_accept, p) > 100 * CHI2_999[7]


def test_greedy_verification_accepts_the_matching_prefix_then_one_target_token():
    logits = torch.full((4, 6), -5.0)
    for row, t in enumerate([2, 4, 1, 5]):
        logits[row, t] = 5.0
    seq = _toy_seq(torch.Generator(), temperature=0.0)
    sampler = Sampler(6, [])
    (new, _, a), = sampler.verify(logits.clone(), [(seq, [2, 4, 3])])
    assert (new, a) == ([2, 4, 1], 2)  # draft 0 is checked against row 0: no off-by-one
    (new, _, a), = sampler.verify(logits.clone(), [(seq, [2, 4, 1])])
    assert (new, a) == ([2, 4, 1, 5], 3)  # full accept: the bonus token
    (new, _, a), = sampler.verify(logits.clone(), [(seq, [0, 4, 1])])
    assert (new, a) == ([2], 0)


# ---------------------------------------------------------------- proposers and policy

def test_ngram_proposer_copies_what_followed_the_latest_match():
    prop = NgramProposer(2, 3)
    seq = SimpleNamespace(seq_id=1, token_ids=[5, 6, 7, 8, 9, 5, 6, 7])
    assert prop.propose([seq], [3]) == [[8, 9, 5]]
    seq.token_ids += [1, 2]
    assert prop.propose([seq], [3]) == [[]]  # (7, 1, 2) / (1, 2) never seen before
    seq.token_ids += [5, 6]
    assert prop.propose([seq], [2]) == [[7, 1]]  # the most recent (5, 6) was followed by 7, 1


def test_suffix_index_drafts_from_earlier_texts_within_its_memory_bound():
    idx = SuffixIndex(max_tokens=40, max_depth=4)
    for _ in range(3):
        idx.add([1, 2, 3, 4, 5, 6, 7, 8])
    idx.add([9, 2, 3, 4, 10, 11, 12])
    idx.work()
    # (2, 3) -> 4 four times (p 0.8); (2, 3, 4) -> 5 three times of four (p 0.6): 0.48; then
    # (3, 4, 5) -> 6 (p 0.75): 0.36; then 0.36 * 0.75 < 0.3 stops
    assert idx.propose([7, 7, 2, 3], 5) == [4, 5, 6]
    assert idx.propose([100], 3) == []
    for i in range(10):  # push the first texts out
        idx.add([50 + i] * 6)
    idx.work()
    assert idx.num_tokens <= 40 + 6 and len(idx.texts) <= 8
    assert idx.propose([1, 2, 3], 2) == []  # the evicted texts' continuations are gone
    assert all(v > 0 for c in idx.table.values() for v in c.values())
    amb = SuffixIndex(max_tokens=100, max_depth=4)
    for nxt in (1, 2, 3, 4):  # (8, 9) was followed by four different tokens: p = 0.25 < 0.3
        amb.add([8, 9, nxt])
    amb.add([5, 6, 7])
    amb.work()
    assert amb.propose([8, 9], 2) == [] and amb.propose([5, 6], 2) == [7]
    assert amb.propose([6], 2) == []  # one matching token is too short a context


def test_policy_drafts_when_tokens_are_cheap_and_not_when_the_machine_is_saturated():
    flat = StepCostModel()
    for n, t in ((1, 0.010), (8, 0.0105), (32, 0.012), (128, 0.040)):
        flat.observe(n, t)
    ks = choose_lengths([0.8, 0.8], [6, 6], base_tokens=2, base_yield=2.0, cost=flat.cost, budget=100)
    assert sum(ks) >= 8  # almost free: draft a lot
    linear = StepCostModel()
    for n, t in ((32, 0.032), (64, 0.064), (128, 0.128)):
        linear.observe(n, t)
    ks = choose_lengths([0.5] * 64, [6] * 64, base_tokens=64, base_yield=64.0, cost=linear.cost, budget=1000)
    assert sum(ks) == 0  # every token costs its share: a 50% draft never pays
    assert not worth_drafting(1.0, 64, 64, 64.0, linear.cost, 1000)  # not even a sure one: proposers skipped
    assert worth_drafting(0.5, 2, 2, 2.0, flat.cost, 100)
    # a bump in the step cost (3 tokens cost far more than 2, 8 hardly more than 3): the first draft
    # token alone lowers goodput, six of them raise it 2x; the plan is the best prefix, not the first stop
    bump = StepCostModel()
    for n, t in ((2, 0.010), (3, 0.016), (8, 0.017)):
        bump.observe(n, t)
    ks = choose_lengths([0.9, 0.9], [6, 6], base_tokens=2, base_yield=2.0, cost=bump.cost, budget=100)
    assert sum(ks) >= 6 and abs(ks[0] - ks[1]) <= 1
    y = 2.0 + sum(sum(0.9 ** j for j in range(1, k + 1)) for k in ks)
    assert y / bump.cost(2 + sum(ks)) > 2 * (2.0 / 0.010)
    assert not worth_drafting(0.5, 2, 2, 2.0, StepCostModel().cost, 100)  # nothing measured yet
    acc = AcceptanceTracker(prior=0.5)
    assert acc.rate(7, "ngram") == 0.5
    acc.observe(7, "ngram", drafted=4, accepted=4)
    assert acc.rate(7, "ngram") == 1.0 and acc.rate(8, "ngram") == 1.0
    acc.observe(7, "ngram", drafted=4, accepted=0)
    low = acc.rate(7, "ngram")
    assert low == pytest.approx(0.7) and acc.rate(7, "suffix") == 0.5
    for _ in range(200):  # unobserved estimates drift back to the prior: the proposer is tried again
        acc.relax()
    assert acc.rate(7, "ngram") == pytest.approx(0.5, abs=0.05)
    assert StepCostModel().cost(5) is None


def test_small_batches_profile_the_long_plans_they_would_otherwise_never_try():
    """At batch 4 a step of 36 rows costs about what one of 4 does; without a measured point that
    size was costed in proportion to tokens from the 16-row point, so long drafts never looked
    worth it and were never run (and so never measured)."""
    from engine.config import SpeculativeConfig
    from engine.spec_decode.decoder import SpecDecoder

    calls = []

    def profile(rows, context, num_seqs=None):  # a memory-bound machine: every size costs the same
        calls.append(rows)
        return 0.010 + 1e-5 * rows

    dec = SpecDecoder(SpeculativeConfig.resolve("auto", None), 2048, profile=profile)
    for rows in (4, 8, 16, 36, 36, 40):
        dec._ensure_point(rows, 100, 4)
    assert 36 in calls and 40 not in calls and calls.count(36) == 1  # one pass per power-of-two bucket
    dec._ensure_point(200, 100, 4)
    assert 200 not in calls  # big steps are learnt from the steps themselves
    ks = choose_lengths([0.85] * 4, [8] * 4, base_tokens=4, base_yield=4.0, cost=dec.cost.cost, budget=1000)
    assert sum(ks) == 32  # nearly free tokens at 85%: every draft runs
    early = StepCostModel()  # what the policy knew before: nothing past 16 rows
    for n in (4, 8, 16):
        early.observe(n, 0.010 + 1e-5 * n)
    assert sum(choose_lengths([0.85] * 4, [8] * 4, 4, 4.0, early.cost, 1000)) < 32


# ---------------------------------------------------------------- the job

def test_job_reports_speculation_per_row_and_per_run(tmp_path):
    """A job with speculative='ngram' writes each row's drafted / accepted counts; the run's cost
    report sums them, gives their ratio and the share of steps that verified drafts; greedy
    generations equal the same job with speculation off."""
    import polars as pl

    from pipeline import JobSpec, read_metrics, run_job

    inp = tmp_path / "in.parquet"
    prompts = ["Repeat after me: red green blue red green blue red green blue",
               "Count: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,", "apple " * 20, "Say hello."]
    pl.DataFrame({"id": list(range(len(prompts))), "prompt": prompts}).write_parquet(inp)
    outs = {}
    for mode in ("ngram", "off"):
        spec = JobSpec(input=str(inp), output=str(tmp_path / mode), max_tokens=24, temperature=0.0,
                       shard_size=2, progress=False, speculative=mode, kv_cache_memory_bytes=KV)
        report = run_job(spec)
        df = pl.concat([pl.read_parquet(p) for p in sorted((tmp_path / mode).glob("part-*.parquet"))]).sort("id")
        outs[mode] = (report, df, read_metrics(spec.output).row(0, named=True))
    report, df, m = outs["ngram"]
    assert df["generation"].to_list() == outs["off"][1]["generation"].to_list()
    drafted, accepted = int(df["spec_draft_tokens"].sum()), int(df["spec_accepted_tokens"].sum())
    assert drafted > 0 and 0 < accepted <= drafted
    assert (m["spec_draft_tokens"], m["spec_accepted_tokens"]) == (drafted, accepted)
    assert m["spec_acceptance_rate"] == pytest.approx(accepted / drafted)
    assert 0 < m["spec_step_share"] <= 1 and m["spec_mean_accepted_per_verify"] > 0
    off = outs["off"][2]
    assert off["spec_draft_tokens"] == 0 and off["spec_acceptance_rate"] is None


def test_dropping_an_engine_frees_its_kv_cache_without_gc():
    """The speculation policy's profile hook holds the engine core weakly: an LLM with speculation
    is freed (its KV cache with it) by reference counting alone, as one without it is."""
    import gc
    import weakref

    gc.disable()
    try:
        for mode in ("auto", None):
            llm = LLM("smollm2-135m-instruct", speculative=mode, kv_cache_memory_bytes=32 << 20)
            llm.generate(["hello " * 20], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
            refs = weakref.ref(llm), weakref.ref(llm.kv_cache)
            del llm
            assert [r() is None for r in refs] == [True, True], mode
    finally:
        gc.enable()


def test_draft_model_with_the_int8_kv_cache():
    """The draft model keeps its own KV cache in the engine's storage dtype (int8 with scales here):
    the target as its own draft still accepts everything and gives speculation off's tokens."""
    ps = ["apple " * 20, "for i in range(10):\n    print(i)\nfor i in range(10):\n"]
    p = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    off = LLM("smollm2-135m-instruct", kv_cache_dtype="int8", speculative=None, kv_cache_memory_bytes=64 << 20)
    on = LLM("smollm2-135m-instruct", kv_cache_dtype="int8", kv_cache_memory_bytes=64 << 20,
             speculative_config={"method": "draft_model", "draft_model": "target", "num_speculative_tokens": 4})
    want = [o.outputs[0].token_ids for o in off.generate(ps, p, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in on.generate(ps, p, use_tqdm=False)] == want
    assert on.stats.spec_accepted_tokens == on.stats.spec_draft_tokens > 0


def test_speculation_options_are_checked_before_a_job_writes_anything(tmp_path):
    """YAML's bare `off` (read as False) means off; speculative off together with a
    speculative_config is refused; a self-draft deeper than the model is refused by
    validate_spec (before any manifest), naming the layer count."""
    import yaml

    from pipeline import JobSpec
    from pipeline.spec import validate_spec

    base = {"input": str(tmp_path / "in.parquet"), "output": str(tmp_path / "out")}
    spec = JobSpec.model_validate({**base, **yaml.safe_load("speculative: off")})
    assert spec.speculative == "off" and spec.engine_kwargs()["speculative"] == "off"
    with pytest.raises(ValueError, match="speculative_config was given with speculative"):
        validate_spec(JobSpec(**base, speculative="off", engine_options={"speculative_config": {"method": "ngram"}}))
    with pytest.raises(ValueError, match=r"'self:99' needs 1\.\.30 layers"):
        validate_spec(JobSpec(**base, engine_options={"speculative_config": {"method": "draft_model",
                                                                             "draft_model": "self:99"}}))
    validate_spec(JobSpec(**base, engine_options={"speculative_config": {"method": "draft_model",
                                                                         "draft_model": "self:4"}}))
    assert not (tmp_path / "out").exists()
    a = JobSpec(**base, engine_options={"speculative_config": {"method": "ngram"}, "block_size": 16})
    b = JobSpec(**base, speculative="off", engine_options={"block_size": 16})
    assert a.fingerprint_fields() == b.fingerprint_fields()  # a resume may change speculation
