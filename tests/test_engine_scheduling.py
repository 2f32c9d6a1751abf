"""Scheduling never changes a result: batch invariance, chunked prefill, preemption.

Greedy decoding makes each request's output a pure function of its prompt, so
whatever the scheduler does (which requests share a step, how a prompt is cut
into prefill chunks under the token budget, evicting and recomputing a request
when KV blocks run out) the token ids must be identical.
"""
from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams

MODEL = "smollm2-135m-instruct"

# SmolLM2-135M: 30 layers x (K, V) x 3 KV heads x 64 head_dim x 2 bytes per token (the default
# cache stores fp16 halves under the fp32 model).
KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 2
BLOCK_SIZE = 16
KV_BYTES_PER_BLOCK = KV_BYTES_PER_TOKEN * BLOCK_SIZE  # 368,640

# Real text (the Gettysburg Address), used whole, cut into prefixes and repeated.
GETTYSBURG = (
    "Four score and seven years ago our fathers brought forth on this continent, a new nation, "
    "conceived in Liberty, and dedicated to the proposition that all men are created equal. "
    "Now we are engaged in a great civil war, testing whether that nation, or any nation so "
    "conceived and so dedicated, can long endure. We are met on a great battle-field of that war. "
    "We have come to dedicate a portion of that field, as a final resting place for those who here "
    "gave their lives that that nation might live. It is altogether fitting and proper that we "
    "should do this. But, in a larger sense, we can not dedicate -- we can not consecrate -- we can "
    "not hallow -- this ground. The brave men, living and dead, who struggled here, have consecrated "
    "it, far above our poor power to add or detract. The world will little note, nor long remember "
    "what we say here, but it can never forget what they did here. "
)

QUESTIONS = [
    "What is the capital of Japan?",
    "Name a mammal that can fly.",
    "How many legs does a spider have?",
    "Give me a synonym for happy.",
    "What is the largest planet in the solar system?",
    "Why do leaves change color in autumn?",
    "Suggest a name for a pet goldfish.",
    "What is the square root of 81?",
]
RAW = [
    "The weather today is",
    "def add(a, b):\n    return",
    "My favourite book is",
    "1, 2, 3, 4,",
    "The recipe calls for two cups of",
    "x",
    "SELECT name FROM users WHERE",
    "The mitochondria is the powerhouse of",
]


def _batch_prompts(llm) -> list[str]:
    """32 prompts from 1 to ~200 tokens: chat questions, raw completions, prefixes of a long text."""
    words = GETTYSBURG.split()
    prefixes = [" ".join(words[:k]) for k in (1, 3, 6, 10, 15, 21, 28, 36, 45, 55, 66, 78, 92, 110, 135, 160)]
    chats = [llm.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    prompts = chats + RAW + prefixes
    assert len(prompts) == 32
    return prompts


def _ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_batch_invariance_greedy(llm):
    """Each request's greedy ids are the same alone, in a batch of 32 mixed lengths, and shuffled."""
    prompts = _batch_prompts(llm)
    lengths = [len(llm.tokenizer.encode(p)) for p in prompts]
    assert min(lengths) <= 2 and max(lengths) >= 150, lengths
    params = SamplingParams(temperature=0.0, max_tokens=5)

    batched = llm.generate(prompts, params, use_tqdm=False)
    assert [o.request_id for o in batched] == [str(i) for i in range(len(prompts))]
    assert [o.prompt for o in batched] == prompts

    order = list(range(len(prompts)))
    random.Random(0).shuffle(order)
    shuffled_prompts = [prompts[i] for i in order]
    seen: dict[int, list[int]] = {}
    for out in llm.iter_outputs(shuffled_prompts, params, use_tqdm=False):
        k = int(out.request_id)
        assert k not in seen, f"request {k} yielded twice"
        assert out.prompt == shuffled_prompts[k]
        seen[k] = out.outputs[0].token_ids
    assert sorted(seen) == list(range(len(prompts)))
    shuffled = [None] * len(prompts)
    for k, ids in seen.items():
        shuffled[order[k]] = ids

    alone = [_ids(llm.generate([p], params, use_tqdm=False))[0] for p in prompts]

    for i, p in enumerate(prompts):
        assert len(alone[i]) >= 1
        assert batched[i].outputs[0].token_ids == alone[i], f"prompt {i} ({lengths[i]} tokens): batch != alone"
        assert shuffled[i] == alone[i], f"prompt {i} ({lengths[i]} tokens): shuffled batch != alone"
    # Different prompts give different continuations: the comparison is not trivially true.
    assert len({tuple(a) for a in alone}) > 20


def _long_prompts(llm) -> list[list[int]]:
    """Two ~300-token prompts of real repeated text ending in different questions, plus a short one."""
    questions = ["\n\nWho gave this speech?", "\n\nSummarize the text above in one sentence:"]
    base = llm.tokenizer.encode(GETTYSBURG * 3)
    prompts = []
    for n, q in zip((300, 317), questions):
        tail = llm.tokenizer.encode(q)
        prompts.append(base[: n - len(tail)] + tail)
    prompts.append(llm.tokenizer.encode("The capital of France is"))
    return prompts


def test_chunked_prefill_invariance(llm):
    """Token budgets of 16, 64 and 2048 (and the default engine) give the same greedy outputs."""
    prompts = _long_prompts(llm)
    assert [len(p) for p in prompts[:2]] == [300, 317]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    reference = _ids(llm.generate(prompts, params, use_tqdm=False))
    assert all(len(r) == 6 for r in reference)
    for budget in (16, 64, 2048):
        engine = LLM(MODEL, max_num_batched_tokens=budget, max_num_seqs=16, max_model_len=512,
                     enable_chunked_prefill=True, kv_cache_memory_bytes=160 * KV_BYTES_PER_BLOCK)
        outs = engine.generate(prompts, params, use_tqdm=False)
        for i, (o, ref) in enumerate(zip(outs, reference)):
            assert o.prompt_token_ids == prompts[i]
            assert o.outputs[0].token_ids == ref, f"budget {budget}, prompt {i} ({len(prompts[i])} tokens)"
            assert o.outputs[0].finish_reason == "length"
        assert engine.num_free_blocks == engine.num_total_blocks


def test_preemption_by_recompute_keeps_results(llm):
    """A pool of ~2 sequences, 16 requests x 64 tokens: preemptions happen, results and blocks are intact."""
    prompts = QUESTIONS + RAW
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)

    small = LLM(MODEL, kv_cache_memory_bytes=12 * KV_BYTES_PER_BLOCK, block_size=BLOCK_SIZE)
    # ~2 sequences: each needs ceil((prompt + 64) / 16) = 5 blocks.
    assert 8 <= small.num_total_blocks <= 12, small.num_total_blocks
    start_free = small.num_free_blocks
    assert start_free == small.num_total_blocks
    before = small.stats.num_preemptions

    outs = small.generate(prompts, params, use_tqdm=False)

    ample_before = llm.stats.num_preemptions
    expected = llm.generate(prompts, params, use_tqdm=False)  # ample pool (thousands of blocks)
    assert llm.stats.num_preemptions == ample_before

    assert small.stats.num_preemptions > before, "the pool was meant to be too small for all 16 at once"
    for i, (o, e) in enumerate(zip(outs, expected)):
        assert o.outputs[0].finish_reason == "length", (i, o.outputs[0])
        assert len(o.outputs[0].token_ids) == 64, i
        assert o.outputs[0].token_ids == e.outputs[0].token_ids, f"request {i} changed by preemption"
        assert o.outputs[0].text == e.outputs[0].text
    assert small.num_free_blocks == start_free
