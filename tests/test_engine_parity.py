"""The engine computes the real model: parity with Hugging Face `transformers`.

The reference is `transformers` loading the same GGUF (SmolLM2-135M-Instruct,
Q4_1), dequantized to fp32: the weights are identical, so every difference is
fp32 rounding from a different order of operations.

Tolerance for logits. Measured on this machine (2026-11-30):
- transformers fp32 vs transformers with fp64 norms/softmax/residuals: max abs
  diff 3.5e-5 .. 4.6e-5 on last-position logits of magnitude 25 .. 35,
  i.e. fp32 noise is a few 1e-5 here;
- tokenmill vs transformers: see `test_logits_match_transformers` (printed).
The bound `LOGITS_ATOL = 1e-3` is ~20x the fp32 noise and ~1e4x smaller than
the gap a real bug produces (a wrong RoPE layout, GQA grouping or norm eps moves
logits by 1e-1 .. 1e1), so it separates rounding from mistakes.

Greedy parity compares token ids exactly, against transformers' greedy tokens
(the argmax of its logits over the prompt and the engine's tokens, teacher
forced; `generate` gives the same ids on two of the prompts). EOS is handled
twice: once with EOS suppressed on both sides (engine `min_tokens=32`; EOS
masked before transformers' argmax, as `min_new_tokens=32` masks it) so that
all 32 tokens are compared, and once with EOS allowed (the chat prompts, where
the model ends its turn), comparing up to and including the first EOS.
"""
from __future__ import annotations

import time

import pytest
import torch

from engine import SamplingParams

LOGITS_ATOL = 1e-3
NEW_TOKENS = 32

# Chat conversations: formatted by the engine's chat template (llm.chat).
CHAT_PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the ocean."}],
    [{"role": "user", "content": "Explain photosynthesis in one sentence."}],
    [{"role": "user", "content": "List three prime numbers."}],
    [{"role": "user", "content": "Translate 'good morning' into Spanish."}],
    [{"role": "user", "content": "What is 12 times 7?"}],
    [
        {"role": "system", "content": "You are a terse assistant. Answer in five words or fewer."},
        {"role": "user", "content": "Why is the sky blue?"},
    ],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help you today?"},
        {"role": "user", "content": "Tell me a fun fact about cats."},
    ],
]
# Raw completions: prose, code, Q&A, a single-token prompt.
RAW_PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):\n    ",
    "The three primary colors are",
    "Q: What is the boiling point of water?\nA:",
    "import numpy as np\n\n",
    "In 1969, the first humans",
    "A",
]

LONG_TEXT = (
    "Four score and seven years ago our fathers brought forth on this continent, a new nation, "
    "conceived in Liberty, and dedicated to the proposition that all men are created equal. "
    "Now we are engaged in a great civil war, testing whether that nation, or any nation so "
    "conceived and so dedicated, can long endure. We are met on a great battle-field of that war. "
    "We have come to dedicate a portion of that field, as a final resting place for those who here "
    "gave their lives that that nation might live. It is altogether fitting and proper that we "
    "should do this. "
)


@pytest.fixture(scope="module")
def llm(llm_fp32):
    """Parity is a property of the fp32 arithmetic: these tests run the engine with an fp32 KV cache
    (the default stores fp16 halves; `tests/test_quant.py` bounds what that costs)."""
    return llm_fp32


def _prompt_ids(llm) -> list[tuple[str, list[int]]]:
    """(label, prompt token ids) for the 16 greedy-parity prompts, tokenized by the engine."""
    out = [(f"chat{i}", llm.tokenizer.encode(llm.tokenizer.apply_chat_template(c))) for i, c in enumerate(CHAT_PROMPTS)]
    out += [(f"raw{i}", llm.tokenizer.encode(p)) for i, p in enumerate(RAW_PROMPTS)]
    return out


def test_chat_template_is_chatml_with_generation_prompt(llm):
    """llm.chat feeds the model ChatML ending in the assistant header (the format it was tuned on)."""
    text = llm.tokenizer.apply_chat_template(CHAT_PROMPTS[0])
    assert text.startswith("<|im_start|>system\n")
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    ids = llm.tokenizer.encode(text)
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 2  # <|im_start|> x3, <|im_end|> x2
    assert 2 in llm.tokenizer.eos_token_ids  # <|im_end|> ends a chat turn


def test_logits_match_transformers(llm, hf_model):
    """Last-position logits agree with transformers fp32 to LOGITS_ATOL, for short, chat and long prompts."""
    prompts = [
        llm.tokenizer.encode("The capital of France is"),
        llm.tokenizer.encode(llm.tokenizer.apply_chat_template(CHAT_PROMPTS[2])),
        llm.tokenizer.encode("A"),
        llm.tokenizer.encode(LONG_TEXT * 3)[:300],  # several KV blocks, long-range RoPE positions
    ]
    vocab = llm.tokenizer.vocab_size
    diffs = []
    for ids in prompts:
        got = llm.compute_logits(ids)
        with torch.no_grad():
            ref = hf_model(torch.tensor([ids])).logits[0, -1].float()
        assert got.shape == (vocab,) and got.dtype == torch.float32
        assert torch.isfinite(got).all()
        diff = (got - ref).abs().max().item()
        diffs.append((len(ids), diff))
        assert diff < LOGITS_ATOL, f"{len(ids)}-token prompt: max |engine - transformers| = {diff:.3g} >= {LOGITS_ATOL}"
        assert got.argmax().item() == ref.argmax().item()
    print("logits max abs diff (prompt tokens, diff):", [(n, f"{d:.2e}") for n, d in diffs])


def _hf_greedy(hf_model, ids: list[int], eos: list[int]) -> list[int]:
    """transformers `generate`, greedy, one prompt, no padding, EOS suppressed for NEW_TOKENS tokens: the
    new token ids."""
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            eos_token_id=eos,
            pad_token_id=eos[0],
        )
    return out[0, len(ids):].tolist()


def _hf_step_logits(hf_model, ids: list[int], new: list[int]) -> torch.Tensor:
    """transformers' raw logits at each of the engine's steps, [len(new), vocab] fp32: one forward over the
    prompt and the engine's tokens but the last (teacher forcing). Up to the first step whose argmax (EOS
    masked, as `min_new_tokens` masks it) is not the engine's token, transformers' greedy run sees the
    same prefix as the engine, so the argmaxes are its greedy tokens and that step's top-2 gap says how
    near a tie the difference is."""
    with torch.no_grad():
        return hf_model(torch.tensor([ids + new[:-1]]), logits_to_keep=len(new)).logits[0].float()


def _margin(scores: torch.Tensor) -> float:
    top = scores.float().topk(2).values
    return (top[0] - top[1]).item()


def test_greedy_matches_transformers_generate(llm, hf_model):
    """16 prompts (8 chat-formatted, 8 raw) x 32 greedy tokens: token ids identical to transformers' greedy
    decoding. The reference for all 16 is one teacher-forced forward each (`_hf_step_logits`); `generate`
    itself runs on one chat and one raw prompt and must give the same ids (32 decode steps per prompt cost
    about 4 s, one forward a fraction of that)."""
    eos = sorted(llm.tokenizer.eos_token_ids)
    labelled = _prompt_ids(llm)
    assert len(labelled) >= 16

    # Engine: all 16 as one batch of text prompts (chat ones rendered by the engine's template); the
    # EOS-allowed run goes through llm.chat.
    forced = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    natural = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    texts = [llm.tokenizer.apply_chat_template(c) for c in CHAT_PROMPTS] + RAW_PROMPTS
    forced_outs = llm.generate(texts, forced, use_tqdm=False)
    # EOS allowed: the chat prompts (where the model ends its turn); raw completions rarely stop within 32 tokens.
    natural_outs = llm.chat(CHAT_PROMPTS, natural, use_tqdm=False)

    t0 = time.perf_counter()
    problems = []
    for j, ((label, ids), f_out) in enumerate(zip(labelled, forced_outs)):
        assert f_out.prompt_token_ids == ids, f"{label}: engine tokenized the prompt differently"
        got = f_out.outputs[0].token_ids
        assert len(got) == NEW_TOKENS and f_out.outputs[0].finish_reason == "length"
        raw_logits = _hf_step_logits(hf_model, ids, got)
        scores = raw_logits.clone()
        scores[:, eos] = float("-inf")
        ref = scores.argmax(-1).tolist()
        if got != ref:
            k = next(i for i, (a, b) in enumerate(zip(got, ref)) if a != b)
            problems.append(f"{label} (EOS suppressed): first difference at token {k}: engine {got[k:k + 4]} vs "
                            f"transformers {ref[k]} (transformers top-2 logit margin there {_margin(scores[k]):.2e})")
            continue
        if label in ("chat0", "raw0"):
            assert _hf_greedy(hf_model, ids, eos) == ref, f"{label}: generate differs from its own forward's argmax"

        if j >= len(natural_outs):
            continue
        n_out = natural_outs[j]
        # With EOS allowed, transformers stops at the first step whose raw argmax is an EOS id.
        stop_at = next((t for t, lg in enumerate(raw_logits) if lg.argmax().item() in eos), None)
        ref_natural = ref if stop_at is None else ref[:stop_at] + [raw_logits[stop_at].argmax().item()]
        got_natural = n_out.outputs[0].token_ids
        if got_natural != ref_natural:
            problems.append(f"{label} (EOS allowed): engine {got_natural} vs transformers {ref_natural}")
        want_reason = "length" if stop_at is None else "stop"
        if n_out.outputs[0].finish_reason != want_reason:
            problems.append(f"{label}: finish_reason {n_out.outputs[0].finish_reason!r}, expected {want_reason!r}")
    print(f"transformers reference: {len(labelled)} x {NEW_TOKENS} tokens in {time.perf_counter() - t0:.1f} s")
    assert not problems, "\n".join(problems)
    # The set must exercise both endings, or the EOS half of the test proves nothing.
    reasons = {o.outputs[0].finish_reason for o in natural_outs}
    assert "stop" in reasons, reasons
