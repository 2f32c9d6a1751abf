"""Benchmark harness: workloads are deterministic and within spec; the runners count consistently.

No timing assertions: the machine is shared, only counts and shapes are checked.
"""
from __future__ import annotations

import pytest

from benchmarks import workloads as W


@pytest.fixture(scope="module")
def tok():
    from engine.tokenizer import Tokenizer

    return Tokenizer.default()


@pytest.mark.parametrize("name", W.WORKLOADS)
def test_workload_is_deterministic_from_its_seed(tok, name):
    a = W.build_workload(name, tok, num_prompts=6, seed=3)
    b = W.build_workload(name, tok, num_prompts=6, seed=3)
    assert a.prompt_token_ids == b.prompt_token_ids and a.output_lens == b.output_lens
    c = W.build_workload(name, tok, num_prompts=6, seed=4)
    assert c.prompt_token_ids != a.prompt_token_ids or name == "labelling" and c.shared_prefix_tokens


def test_labelling_shared_prefix_and_item_lengths(tok):
    wl = W.build_workload("labelling", tok, num_prompts=40, seed=0)
    p = wl.shared_prefix_tokens
    assert 385 <= p <= 420  # "about 400"
    prefix = wl.prompt_token_ids[0][:p]
    for ids in wl.prompt_token_ids:
        assert ids[:p] == prefix
        assert W.LABELLING_ITEM_RANGE[0] <= len(ids) - p <= W.LABELLING_ITEM_RANGE[1]
    assert wl.output_lens == [16] * 40 and wl.temperature == 0.0
    assert len({tuple(ids) for ids in wl.prompt_token_ids}) == 40  # no whole-prompt duplicates
    assert "Topic:" in tok.decode(wl.prompt_token_ids[0][-4:])


def test_labelling_cycles_the_pool_with_distinct_prompts(tok):
    wl = W.build_workload("labelling", tok, num_prompts=200, seed=1)
    assert len({tuple(ids) for ids in wl.prompt_token_ids}) == 200


def test_synthetic_lengths_and_sampling(tok):
    wl = W.build_workload("synthetic", tok, num_prompts=30, seed=0)
    assert all(20 <= len(p) <= 60 for p in wl.prompt_token_ids)
    assert wl.output_lens == [256] * 30 and wl.temperature == 0.8
    params = wl.sampling_params()
    assert all(sp.seed is not None and sp.ignore_eos and sp.max_tokens == 256 for sp in params)
    assert len({sp.seed for sp in params}) == 30


def test_random_lengths_are_uniform_ranges_of_real_text(tok):
    wl = W.build_workload("random", tok, num_prompts=200, seed=0)
    ins = [len(p) for p in wl.prompt_token_ids]
    assert 64 <= min(ins) and max(ins) <= 512 and max(ins) - min(ins) > 300
    assert 32 <= min(wl.output_lens) and max(wl.output_lens) <= 256 and max(wl.output_lens) - min(wl.output_lens) > 150
    assert all(sp.ignore_eos and sp.temperature == 0.0 for sp in wl.sampling_params())
    text = tok.decode(wl.prompt_token_ids[0])
    assert sum(ch.isalpha() for ch in text) > len(text) / 2  # real text, not random ids


def test_quick_caps_prompts_and_outputs(tok):
    wl = W.build_workload("random", tok, quick=True)
    assert wl.num_requests == W.QUICK_NUM_PROMPTS["random"]
    assert max(wl.output_lens) <= W.QUICK_MAX_OUTPUT


def test_parse_workloads_and_errors(tok):
    assert W.parse_workloads("all") == list(W.WORKLOADS)
    assert W.parse_workloads("random, labelling") == ["random", "labelling"]
    with pytest.raises(ValueError):
        W.parse_workloads("nope")
    with pytest.raises(ValueError):
        W.build_workload("random", tok, num_prompts=0)


def test_tokenmill_runner_counts_match_the_workload(llm, tok):
    from benchmarks.throughput import rates, run_tokenmill

    wl = W.build_workload("labelling", tok, num_prompts=3, seed=0, max_output_tokens=3)
    steps_before = llm.stats.num_steps
    r = run_tokenmill(llm, wl, warmup=False)
    assert r["requests"] == 3 and r["output_tokens"] == wl.num_output_tokens == 9
    assert r["stats"]["steps"] == llm.stats.num_steps - steps_before > 0
    assert r["stats"]["prompt_tokens_computed"] + r["cached_tokens"] == wl.num_input_tokens
    assert 0.0 < r["stats"]["kv_utilization"] <= 1.0
    assert set(r["stats"]["time_s"]) == {"schedule", "model", "sample", "detokenize", "other"}
    rt = rates(wl, 2.0, r["output_tokens"])
    assert rt["output_tok_s"] == 4.5 and rt["total_tok_s"] == (wl.num_input_tokens + 9) / 2.0


def test_hf_runner_counts_requested_tokens(hf_model, tok):
    from benchmarks.throughput import run_hf

    wl = W.build_workload("random", tok, num_prompts=3, seed=0, max_output_tokens=4)
    wl.prompt_token_ids = [p[:20] for p in wl.prompt_token_ids]
    wl.output_lens = [2, 4, 3]
    r = run_hf(hf_model, wl, batch_size=2, warmup=False)
    assert r["output_tokens"] == 9 and r["generated_tokens"] == 2 * 4 + 3  # static batches pad to the longest


def test_llamacpp_missing_is_a_skip_not_an_error():
    from benchmarks.throughput import llamacpp_available, parse_engines

    assert llamacpp_available() is None or isinstance(llamacpp_available(), str)
    assert parse_engines("tokenmill,hf") == ["tokenmill", "hf"]
    with pytest.raises(ValueError):
        parse_engines("vllm")


def test_int8_diagnosis_hidden_states_reproduce_the_engines_scores(llm):
    """benchmarks.int8_diagnosis scores heads on captured final hidden states: the fp32 head on them
    gives LLM.score's log-probabilities, and the quantizers match engine.quant."""
    import torch

    from benchmarks.int8_diagnosis import final_hidden, int8_absmax, int8_mse_clip
    from engine.quant import quantize_int8

    seqs = [llm.tokenizer.encode("The licence grants you the right to copy"), [1, 2, 3, 4, 5, 6, 7]]
    hs = final_hidden(llm, seqs, chunk_size=8)  # chunked like a long prefill
    w = llm.model.lm_head.weight.data
    for s, h, ref in zip(seqs, hs, llm.score(seqs)):
        assert h.shape == (len(s), w.shape[1])
        lp = torch.log_softmax(h[:-1] @ w.T, -1).gather(1, torch.tensor(s[1:])[:, None]).squeeze(1)
        torch.testing.assert_close(lp, ref, rtol=1e-5, atol=1e-4)  # chunks of 8 vs one prefill: float noise
    x = w[:64]
    torch.testing.assert_close(int8_absmax(x), quantize_int8(x).dequantize(), rtol=0, atol=0)
    d, r = int8_mse_clip(x)
    assert ((d - x).pow(2).sum(1) <= (int8_absmax(x) - x).pow(2).sum(1) + 1e-12).all()  # never worse per row
    assert ((r >= 0.70) & (r <= 1.0)).all()
