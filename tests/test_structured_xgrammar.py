"""The optional xgrammar backend behind the same grammar interface: valid outputs for every
constraint kind (greedy and sampled), the same greedy text as llguidance with plain masked
decoding, bad constraints as error outputs naming the kind, speculation changes nothing, and a
clear error when xgrammar is missing."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from engine import LLM, SamplingParams
from engine.structured import StructuredOutputsParams as SO
from engine.structured import xgrammar_backend

pytestmark = pytest.mark.skipif(not xgrammar_backend.available(), reason="xgrammar is not installed")

KV = 64 << 20
LABELS = ["files", "network", "text", "math", "concurrency", "data"]
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
DATE = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"


@pytest.fixture(scope="module")
def xg():
    return LLM("smollm2-135m-instruct", speculative=None, kv_cache_memory_bytes=KV,
               structured_outputs_backend="xgrammar")


def _batch(llm, temperature: float):
    chat = lambda t: llm.tokenizer.apply_chat_template([{"role": "user", "content": t}])  # noqa: E731
    prompts = ([chat(f"Describe person {i} as JSON with name and age.") for i in range(6)]
               + [chat(f"Which topic is this about: reading file number {i}?") for i in range(6)]
               + [chat(f"On what date did event {i} happen?") for i in range(6)]
               + [chat(f"Say yes or no, number {i}.") for i in range(6)])
    sos = [SO(json=PERSON)] * 6 + [SO(choice=LABELS)] * 6 + [SO(regex=DATE)] * 6 + \
        [SO(grammar='start: "yes" | "no"')] * 6
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=40, structured_outputs=so)
              for i, so in enumerate(sos)]
    return prompts, params


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_kind_gives_valid_outputs(xg, temperature):
    prompts, params = _batch(xg, temperature)
    outs = [o.outputs[0] for o in xg.generate(prompts, params, use_tqdm=False)]
    for o in outs[:6]:
        if o.finish_reason == "stop":
            assert o.valid is True
            jsonschema.validate(json.loads(o.text), PERSON)
            assert ": " not in o.text and ", " not in o.text  # compact
        else:
            assert o.valid is False
    assert all(o.text in LABELS and o.valid for o in outs[6:12])
    assert all(re.fullmatch(DATE, o.text) and o.valid for o in outs[12:18])
    assert all(o.text in ("yes", "no") and o.valid for o in outs[18:])


def test_greedy_text_equals_llguidance_with_plain_masked_decoding(xg):
    """Without jump-forward both backends only mask the logits, so greedy decoding picks the same
    text (token boundaries may differ where the masks allow one token and not another spelling)."""
    prompts, params = _batch(xg, 0.0)
    want = [o.outputs[0] for o in LLM("smollm2-135m-instruct", speculative=None, kv_cache_memory_bytes=KV,
                                      structured_outputs_jump_forward=False).generate(prompts, params, use_tqdm=False)]
    plain = LLM("smollm2-135m-instruct", speculative=None, kv_cache_memory_bytes=KV,
                structured_outputs_backend="xgrammar", structured_outputs_jump_forward=False)
    got = [o.outputs[0] for o in plain.generate(prompts, params, use_tqdm=False)]
    assert [o.text for o in got] == [o.text for o in want]
    assert [o.valid for o in got] == [o.valid for o in want]
    assert [o.token_ids for o in got[6:]] == [o.token_ids for o in want[6:]]  # choice, regex, grammar rows


def test_jump_forward_counts_forced_tokens_and_keeps_outputs_valid(xg):
    prompts, params = _batch(xg, 0.0)
    f0 = xg.stats.structured_forced_tokens
    outs = [o.outputs[0] for o in xg.generate(prompts[:6], params[:6], use_tqdm=False)]
    forced = sum(o.num_forced_tokens for o in outs)
    assert forced > 0 and xg.stats.structured_forced_tokens - f0 == forced
    assert all(o.text.startswith('{"name":"') for o in outs)


def test_bad_constraints_are_error_outputs_naming_the_kind(xg):
    prompt = xg.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    bad = [SO(regex="a(b"), SO(json={"type": "nonsense"}), SO(grammar="start: undefined_rule")]
    outs = xg.generate([prompt] * 4, [SamplingParams(max_tokens=4, structured_outputs=so) for so in bad]
                       + [SamplingParams(temperature=0, max_tokens=4, structured_outputs=SO(choice=["hi", "ho"]))],
                       use_tqdm=False)
    errs = [o.error for o in outs]
    assert errs[0].startswith("structured_outputs.regex: ") and "parenthesis" in errs[0] and "[" not in errs[0][:30]
    assert errs[1].startswith("structured_outputs.json: ") and "nonsense" in errs[1]
    assert errs[2].startswith("structured_outputs.grammar: ") and "undefined_rule" in errs[2]
    assert errs[3] is None and outs[3].outputs[0].text in ("hi", "ho")


def test_speculation_does_not_change_xgrammar_output(xg):
    prompts, params = _batch(xg, 0.0)
    want = [o.outputs[0].token_ids for o in xg.generate(prompts, params, use_tqdm=False)]
    spec = LLM("smollm2-135m-instruct", kv_cache_memory_bytes=KV, structured_outputs_backend="xgrammar",
               speculative_config={"method": "draft_model", "draft_model": "target", "num_speculative_tokens": 4})
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)] == want
    assert spec.stats.spec_accepted_tokens > 0


def test_unknown_backend_and_missing_xgrammar_are_clear_errors(monkeypatch):
    with pytest.raises(ValueError, match="structured_outputs_backend must be llguidance|xgrammar"):
        LLM("smollm2-135m-instruct", structured_outputs_backend="outlines")
    monkeypatch.setattr(xgrammar_backend, "available", lambda: False)
    with pytest.raises(ValueError, match=r"xgrammar is not installed \(pip install 'tokenmill\[xgrammar\]'\)"):
        LLM("smollm2-135m-instruct", structured_outputs_backend="xgrammar")


def test_both_backends_close_objects_by_default(xg):
    """Without additionalProperties, extra keys are refused by xgrammar as by llguidance (vLLM's
    default); additionalProperties: true allows them in both."""
    from engine.structured.llguidance_backend import LLGuidanceBackend
    from engine.structured.xgrammar_backend import XGrammarBackend

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    open_schema = {**schema, "additionalProperties": True}
    ids = xg.tokenizer.encode('{"a":1,"b":2}', add_special_tokens=False)
    for backend in (LLGuidanceBackend(xg.tokenizer), XGrammarBackend(xg.tokenizer)):
        assert backend.compile(SO(json=schema)).matcher().validate_tokens(ids) < len(ids), backend.name
        assert backend.compile(SO(json=open_schema)).matcher().validate_tokens(ids) == len(ids), backend.name


def test_an_all_of_of_several_branches_is_refused_naming_where(xg):
    """xgrammar 0.2.9 compiles `allOf: [A, B]` with a warning and then accepts any object (a wrong type, a
    missing required key); the backend refuses such a schema, naming the path, instead of letting invalid
    outputs through. A single-branch allOf, which xgrammar enforces, still compiles."""
    two = {"type": "object", "properties": {"p": {"allOf": [
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        {"type": "object", "properties": {"b": {"type": "string"}}, "required": ["b"]}]}}, "required": ["p"]}
    one = {"allOf": [PERSON]}
    prompt = xg.tokenizer.apply_chat_template([{"role": "user", "content": "Describe a person as JSON."}])
    outs = xg.generate([prompt] * 2, [SamplingParams(temperature=0, max_tokens=40, structured_outputs=SO(json=s))
                                      for s in (two, one)], use_tqdm=False)
    assert outs[0].error == ("structured_outputs.json: an allOf of several branches (at #/properties/p/allOf) is "
                             "not enforced by the xgrammar backend; use structured_outputs_backend='llguidance' "
                             "(the default)")
    assert outs[1].error is None and outs[1].outputs[0].valid
    jsonschema.validate(json.loads(outs[1].outputs[0].text), PERSON)
