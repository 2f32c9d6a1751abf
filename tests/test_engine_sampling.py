"""Sampling, stop conditions and detokenization, observed through `LLM.generate`.

- Seeded sampling draws the same tokens whatever else is in the batch; `n=4`
  gives 4 samples that are not all equal; `top_k=1` is greedy.
- Stop strings are derived from an actual greedy output (never guessed): one
  inside a single token, one across two tokens, one that also appears in the
  prompt; the text is cut before the stop string, the token ids end at the
  token that completed it, `finish_reason == "stop"`.
- EOS, `ignore_eos`, `min_tokens` and `stop_token_ids`.
- Detokenization: the text of every output (emoji, CJK, accents) equals a
  one-shot decode of its token ids.

Each test batches its variants into one `generate` call (per-request
SamplingParams) to keep the suite fast on 2 CPU cores.
"""
from __future__ import annotations

from engine import SamplingParams

MAX_TOKENS = 12


def _chat(llm, text: str) -> str:
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": text}])


# ------------------------------------------------------------------ sampling
def test_same_seed_same_tokens_whatever_the_batch(llm):
    target = "Once upon a time, a dragon"
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=MAX_TOKENS)
    others = ["The weather today is", _chat(llm, "Name a color."), "def main():", "My favourite food is"]

    alone = llm.generate([target], seeded, use_tqdm=False)[0].outputs[0]
    batch_a = llm.generate(
        others[:2] + [target] + others[2:],
        [SamplingParams(temperature=1.0, seed=7, max_tokens=MAX_TOKENS),
         SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
         seeded,
         SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS),  # unseeded: engine's stream
         SamplingParams(temperature=0.5, top_k=5, seed=1234, max_tokens=MAX_TOKENS)],
        use_tqdm=False,
    )
    batch_b = llm.generate(
        [target] + others[::-1] + [target],
        [seeded] + [SamplingParams(temperature=1.2, max_tokens=MAX_TOKENS + 4)] * 4
        + [SamplingParams(temperature=0.9, top_p=0.95, seed=99, max_tokens=MAX_TOKENS)],
        use_tqdm=False,
    )
    for got in (batch_a[2].outputs[0], batch_b[0].outputs[0]):
        assert got.token_ids == alone.token_ids
        assert got.text == alone.text
    assert len(alone.token_ids) >= 1
    # The seed is what fixes the sample: other seeds give other samples.
    others_seeded = llm.generate(
        [target] * 4,
        [SamplingParams(temperature=0.9, top_p=0.95, seed=s, max_tokens=MAX_TOKENS) for s in (1, 2, 3, 4)],
        use_tqdm=False,
    )
    assert any(o.outputs[0].token_ids != alone.token_ids for o in others_seeded)


def test_n_samples_are_distinct_and_seeded_as_a_set(llm):
    prompt = "Write a creative name for a cafe:"
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=MAX_TOKENS)
    outs = llm.generate([prompt, "The sun rises in the", prompt],
                        [params, SamplingParams(temperature=0.0, max_tokens=4), params], use_tqdm=False)
    first, third = outs[0], outs[2]
    assert len(first.outputs) == 4
    assert [c.index for c in first.outputs] == [0, 1, 2, 3]
    assert all(1 <= len(c.token_ids) <= MAX_TOKENS for c in first.outputs)
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1, "n=4 gave 4 identical samples"
    # The seed covers the whole set: the same request again gives the same 4 samples.
    assert [c.token_ids for c in third.outputs] == [c.token_ids for c in first.outputs]
    assert [c.text for c in third.outputs] == [c.text for c in first.outputs]
    assert len(outs[1].outputs) == 1


def test_top_k_1_equals_greedy(llm):
    prompts = ["The capital of France is", _chat(llm, "Give me a synonym for fast."),
               "for i in range(10):", "Water boils at"]
    top1 = [SamplingParams(temperature=1.0, top_k=1, max_tokens=MAX_TOKENS),
            SamplingParams(temperature=1.5, top_k=1, seed=5, max_tokens=MAX_TOKENS)]
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    n = len(prompts)
    outs = llm.generate(prompts * 3, [top1[0]] * n + [top1[1]] * n + [greedy] * n, use_tqdm=False)
    for i in range(n):
        want = outs[2 * n + i].outputs[0]
        assert len(want.token_ids) >= 1
        for k in (0, 1):
            got = outs[k * n + i].outputs[0]
            assert got.token_ids == want.token_ids, f"prompt {i}, {top1[k]}"
            assert got.text == want.text


def test_a_temperature_below_the_sampling_epsilon_is_greedy_token_for_token(llm):
    """Batch files send temperature 0 or a tiny value (1e-6) for "deterministic". Below
    SAMPLING_EPS (1e-5, vLLM's `_SAMPLING_EPS`) a request is greedy: the same tokens as
    temperature=0 whatever its seed, also on near ties ("The largest planet is", where a draw at
    the sampler's 0.01 floor left greedy within 10 tokens for most seeds). Temperatures below fp32's
    range (1e-39, 5e-324), which once drew garbage through a NaN softmax, are greedy too. At 1e-5
    and above a request is drawn (at no less than MIN_TEMPERATURE)."""
    from engine.config import SAMPLING_EPS
    from engine.sampler import MIN_TEMPERATURE

    assert SAMPLING_EPS == 1e-5 and MIN_TEMPERATURE == 0.01
    assert SamplingParams(temperature=1e-6).greedy and SamplingParams(temperature=0).greedy
    assert not SamplingParams(temperature=1e-5).greedy and not SamplingParams(temperature=0.5).greedy
    prompts = ["The largest planet is", "The capital of France is", "for i in range(10):", "Water boils at"]
    greedy = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    want = [o.outputs[0].token_ids for o in greedy]
    assert all(len(w) == MAX_TOKENS for w in want)
    cases = [(t, seed) for t in (1e-6, 9.9e-6, 1e-39, 5e-324) for seed in (0, 1, 2, 3, 4)]
    outs = llm.generate(prompts * len(cases),
                        [SamplingParams(temperature=t, seed=seed, max_tokens=MAX_TOKENS)
                         for t, seed in cases for _ in prompts], use_tqdm=False)
    for k, (t, seed) in enumerate(cases):
        got = [o.outputs[0].token_ids for o in outs[k * len(prompts):(k + 1) * len(prompts)]]
        assert got == want, (t, seed)


# ------------------------------------------------------------------ stop strings
STOP_PROMPT = "Repeat after me: The quick brown fox jumps over the lazy dog."


def _token_spans(llm, ids: list[int]) -> tuple[str, list[tuple[int, int]]]:
    """Text of `ids` and each token's [start, end) character span in it (prefix decodes must be stable)."""
    texts = [llm.tokenizer.decode(ids[:k]) for k in range(len(ids) + 1)]
    for k in range(len(ids)):
        assert texts[k + 1].startswith(texts[k]), "prefix decodes are not stable; pick an ASCII prompt"
    return texts[-1], [(len(texts[k]), len(texts[k + 1])) for k in range(len(ids))]


def _expected_stop(full: str, spans: list[tuple[int, int]], ids: list[int], stop: str):
    """(text cut before the first occurrence, ids up to the token completing it)."""
    at = full.find(stop)
    assert at >= 0
    end = at + len(stop)
    k = next(i for i, (_, b) in enumerate(spans) if b >= end)
    return full[:at], ids[: k + 1]


def test_stop_strings(llm):
    prompt = _chat(llm, STOP_PROMPT)
    base = SamplingParams(temperature=0.0, max_tokens=32)
    ref = llm.generate([prompt], base, use_tqdm=False)[0].outputs[0]
    ids = ref.token_ids
    full, spans = _token_spans(llm, ids)
    assert ref.text == full
    assert len(full) > 20, full

    inside = across = None
    for i, (a, b) in enumerate(spans):
        piece = full[a:b]
        if inside is None and b - a >= 5 and piece[1:-1].isalpha():
            s = full[a + 1:b - 1]
            if full.find(s) == a + 1:
                inside = s
        if across is None and i + 1 < len(spans) and b - a >= 3 and spans[i + 1][1] - b >= 3:
            s = full[b - 2:b + 2]
            if full.find(s) == b - 2 and s.strip() == s:
                across = s
    prompt_words = {w.strip(".,:!?") for w in STOP_PROMPT.split()}
    shared = next((w for w in sorted(prompt_words, key=len, reverse=True) if len(w) >= 4 and w in full), None)
    absent = next((w for w in sorted(prompt_words) if len(w) >= 4 and w not in full), None)
    assert inside and across and shared and absent, (full, inside, across, shared, absent)
    assert shared in prompt and absent in prompt

    cases = {
        "inside one token": [inside],
        "across tokens": [across],
        "also in the prompt": [shared],
        "earliest of several": [across, inside, "zzqx"],
    }
    outs = llm.generate([prompt] * (len(cases) + 1),
                        [SamplingParams(temperature=0.0, max_tokens=32, stop=s) for s in cases.values()]
                        + [SamplingParams(temperature=0.0, max_tokens=32, stop=[absent])],
                        use_tqdm=False)
    for (name, stops), out in zip(cases.items(), outs):
        # Generation ends at the first token that completes any stop string; the text is cut before it.
        expected = {s: _expected_stop(full, spans, ids, s) for s in stops if s in full}
        k_min = min(len(e[1]) for e in expected.values())
        winners = {s for s, e in expected.items() if len(e[1]) == k_min}
        got = out.outputs[0]
        assert got.finish_reason == "stop", (name, got)
        assert got.stop_reason in winners, (name, got.stop_reason, winners)
        want_text, want_ids = expected[got.stop_reason]
        assert got.text == want_text, f"{name} stop={got.stop_reason!r}"
        assert got.token_ids == want_ids, f"{name} stop={got.stop_reason!r}"
    # A stop string present only in the prompt never fires: the output is the unstopped one.
    got = outs[-1].outputs[0]
    assert (got.text, got.token_ids, got.finish_reason) == (ref.text, ref.token_ids, ref.finish_reason)


def _natural_chat_answer(llm):
    """Greedy answer to a chat question that the model ends with EOS well within 32 tokens."""
    prompt = _chat(llm, "What is the capital of France?")
    natural = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)[0].outputs[0]
    return prompt, natural


def test_eos_ignore_eos_and_min_tokens(llm):
    prompt, natural = _natural_chat_answer(llm)
    eos = llm.tokenizer.eos_token_ids
    assert natural.finish_reason == "stop" and natural.token_ids[-1] in eos, natural
    body = natural.token_ids[:-1]
    assert len(body) >= 3
    assert natural.text == llm.tokenizer.decode(body)
    assert "<|im_end|>" not in natural.text

    need = len(natural.token_ids) + 3
    ignore, min_tok = (o.outputs[0] for o in llm.generate([prompt] * 2, [
        SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=32, min_tokens=need),
    ], use_tqdm=False))

    assert len(ignore.token_ids) == 32 and ignore.finish_reason == "length"
    assert ignore.token_ids[:len(body)] == body

    assert len(min_tok.token_ids) >= need
    assert not eos & set(min_tok.token_ids[:need]), "an EOS id was sampled before min_tokens"
    assert min_tok.token_ids[:len(body)] == body


def test_stop_token_ids(llm):
    """A stop token id ends the completion (finish_reason "stop", stop_reason the id).

    As in vLLM, the stop token's id is kept in token_ids but its text is not
    part of the output text (like EOS).
    """
    prompt, natural = _natural_chat_answer(llm)
    body = natural.token_ids[:-1]
    stop_id = body[2]
    j = body.index(stop_id)
    got = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=32, stop_token_ids=[stop_id]),
                       use_tqdm=False)[0].outputs[0]
    assert got.finish_reason == "stop" and got.stop_reason == stop_id, got
    assert got.token_ids == body[:j + 1]
    assert got.text == llm.tokenizer.decode(body[:j]), "the stop token's text leaked into the output text"


# ------------------------------------------------------------------ detokenization
DETOK_REQUESTS = [
    "Repeat exactly: 🎉🚀 Happy birthday! 🎂🎈",
    "Translate to Japanese: I love cherry blossoms.",
    "Repeat exactly: 你好，世界。我喜欢学习中文。",
    "Repeat exactly: Café, naïve, façade, jalapeño, Ångström, über, crème brûlée.",
]


def _has(text: str, lo: int, hi: int) -> bool:
    return any(lo <= ord(ch) <= hi for ch in text)


def test_streamed_text_equals_one_shot_decode(llm):
    prompts = [_chat(llm, r) for r in DETOK_REQUESTS]
    params = ([SamplingParams(temperature=0.0, max_tokens=24)] * len(prompts)
              + [SamplingParams(temperature=0.8, seed=3, max_tokens=24)] * len(prompts))
    outs = {int(o.request_id): o for o in llm.iter_outputs(prompts * 2, params, use_tqdm=False)}
    assert sorted(outs) == list(range(2 * len(prompts)))
    eos = llm.tokenizer.eos_token_ids
    texts, split_chars = [], 0
    for i in sorted(outs):
        c = outs[i].outputs[0]
        ids = list(c.token_ids)
        while ids and ids[-1] in eos:
            ids.pop()
        one_shot = llm.tokenizer.decode_complete(ids)
        assert c.text == one_shot, f"request {i}: streamed {c.text!r} != decode {one_shot!r}"
        # not even where max_tokens cut a character in half: its first bytes are left out
        assert "\ufffd" not in c.text, f"request {i}: {c.text!r}"
        split_chars += sum("\ufffd" in llm.tokenizer.decode([t]) for t in ids)
        texts.append(c.text)
    joined = "".join(texts)
    assert _has(joined, 0x1F300, 0x1FAFF), "no emoji in the outputs: the test would not exercise them"
    assert _has(joined, 0x3040, 0x9FFF), "no CJK in the outputs"
    assert _has(joined, 0xC0, 0x17F), "no accented Latin in the outputs"
    assert split_chars > 0, "no character was split across tokens"


def test_max_tokens_inside_a_character_leaves_it_out_of_the_text(llm):
    """A greedy answer full of emoji, cut by max_tokens at every point inside a character: the
    text is the complete characters only (no U+FFFD), the token ids are every token generated."""
    prompt = _chat(llm, DETOK_REQUESTS[0])
    full = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)[0].outputs[0]
    ids = list(full.token_ids)
    cuts = [k for k in range(1, len(ids)) if llm.tokenizer.decode(ids[:k]).endswith("\ufffd")]
    assert cuts, f"no cut falls inside a character of {full.text!r}"
    outs = llm.generate([prompt] * len(cuts), [SamplingParams(temperature=0.0, max_tokens=k) for k in cuts],
                        use_tqdm=False)
    for k, out in zip(cuts, outs):
        c = out.outputs[0]
        assert c.token_ids == ids[:k] and c.finish_reason == "length"
        assert c.text == llm.tokenizer.decode(ids[:k])[:-1], k  # the whole text, less the cut character
        assert "\ufffd" not in c.text and full.text.startswith(c.text)


def test_draws_follow_the_distribution_and_never_pick_a_zero_probability_token():
    """The sampler's inverse-transform draw: 20000 draws of a 6-token distribution land within
    4 standard deviations of each probability, a token of probability 0 is never drawn (neither
    a masked one nor one past the cumulative total), and the same generator state gives the
    same token."""
    from types import SimpleNamespace

    import torch

    from engine.sampler import SampleRow, Sampler

    probs = torch.tensor([0.5, 0.0, 0.2, 0.15, 0.15, 0.0])
    logits = probs.clamp_min(1e-30).log()
    logits[probs == 0] = float("-inf")
    gen = torch.Generator().manual_seed(7)
    seq = SimpleNamespace(request=SimpleNamespace(params=SamplingParams(temperature=1.0)), generator=gen)
    n = 20000
    sampler = Sampler(6, [])
    draws = sampler.draw(logits.repeat(n, 1), [SampleRow(seq)] * n)
    counts = torch.bincount(draws, minlength=6).double()
    assert counts[1] == 0 and counts[5] == 0
    sd = (n * probs.double() * (1 - probs.double())).sqrt()
    assert ((counts - n * probs.double()).abs() <= 4 * sd + 1e-9).all(), counts
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    a = sampler.draw(logits[None].clone(), [SampleRow(SimpleNamespace(request=seq.request, generator=g1))])
    b = sampler.draw(logits[None].clone(), [SampleRow(SimpleNamespace(request=seq.request, generator=g2))])
    assert torch.equal(a, b)


def test_greedy_argmax_in_the_lm_head_gives_the_samplers_tokens(llm, monkeypatch):
    """Steps whose rows are all plain greedy take the argmax in the LM head's GEMM (no logits
    written); the tokens equal the sampler's over written logits, EOS suppression included."""
    if not llm.runner.fused_argmax_ok:
        import pytest

        pytest.skip("the LM head is not served by the CPU kernel library here")
    prompt, natural = _natural_chat_answer(llm)
    need = len(natural.token_ids) + 3
    prompts = [prompt, prompt, "The capital of France is", _chat(llm, "Count to five.")]
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=24, min_tokens=need,
                             stop_token_ids=[natural.token_ids[1]]),
              SamplingParams(temperature=0.0, max_tokens=24),
              SamplingParams(temperature=0.0, max_tokens=24)]
    calls = []
    head = llm.model.lm_head
    argmax = head.argmax
    monkeypatch.setattr(head, "argmax", lambda *a, **k: calls.append(1) or argmax(*a, **k))
    fused = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    n_fused = len(calls)
    assert n_fused > 0  # steps without speculative verification rows took the fused path
    monkeypatch.setattr(type(llm.runner), "fused_argmax_ok", property(lambda self: False))
    plain = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert len(calls) == n_fused and [o.token_ids for o in fused] == [o.token_ids for o in plain]
    assert [o.finish_reason for o in fused] == [o.finish_reason for o in plain]
    assert not set(llm.tokenizer.eos_token_ids) & set(fused[1].token_ids[:need])


def test_fused_greedy_plan_only_for_plain_greedy_rows(llm):
    from engine.request import Request, RequestMetrics, Sequence

    def seq(**kw):
        req = Request("r", 0, None, [1, 2, 3], SamplingParams(max_tokens=4, **kw), RequestMetrics(0.0))
        return Sequence(0, req, 0, [1, 2, 3])

    s = llm.sampler
    eos = list(s.eos_token_ids)
    assert s.fused_greedy([]) is None
    for kw in ({"temperature": 0.7}, {"temperature": 0.0, "logprobs": 2},
               {"temperature": 0.0, "repetition_penalty": 1.2}, {"temperature": 0.0, "presence_penalty": 0.5}):
        assert s.fused_greedy([seq(temperature=0.0), seq(**kw)]) is None, kw
    plan = s.fused_greedy([seq(temperature=0.0), seq(temperature=0.0, ignore_eos=True),
                           seq(temperature=0.0, min_tokens=2, stop_token_ids=[7])])
    assert plan.limit == s.tokenizer_vocab_size
    width = len(eos) + 1
    assert plan.ban.shape == (3, width)
    assert plan.ban[0].tolist() == [-1] * width
    assert plan.ban[1].tolist() == eos + [-1]
    assert plan.ban[2].tolist() == eos + [7]
    assert s.fused_greedy([seq(temperature=0.0)]).ban is None
