"""Row validation: every bad row becomes a clear error, good rows become requests."""
from __future__ import annotations

import dataclasses

import pytest

from engine.config import SamplingParams
from pipeline.schema import InputLayout, build_request, parse_messages
from pipeline.testing import FakeTokenizer

TOK = FakeTokenizer()
DEFAULTS = SamplingParams(max_tokens=8, temperature=0.0)


def req(row, cols=("id", "prompt"), **kw):
    layout = InputLayout.from_schema(list(cols) + [c for c in row if c not in cols])
    return build_request(row, layout, TOK, DEFAULTS, max_model_len=kw.pop("max_model_len", 200), **kw)


def test_layout_roles():
    lay = InputLayout.from_schema(["id", "prompt", "max_tokens", "topic", "stop", "source"])
    assert lay.id_in_input and lay.has_prompt and not lay.has_messages
    assert lay.overrides == ("max_tokens", "stop")
    assert lay.passthrough == ("topic", "source")
    assert not InputLayout.from_schema(["prompt"]).id_in_input


def test_layout_needs_a_prompt_column():
    with pytest.raises(ValueError, match="prompt") as e:
        InputLayout.from_schema(["id", "text"])
    assert "meant to be" not in str(e.value)  # nothing near: no guess
    with pytest.raises(ValueError, match=r"found columns \['id', 'promt'\] \(is 'promt' meant to be one of them\?\)"):
        InputLayout.from_schema(["id", "promt"])
    with pytest.raises(ValueError, match="is 'mesages' meant"):
        InputLayout.from_schema(["id", "mesages"])
    with pytest.raises(ValueError, match="collide"):
        InputLayout.from_schema(["id", "prompt", "generation"])


def test_good_prompt_row():
    r = req({"id": 1, "prompt": "hello"})
    assert r.error is None and r.params.max_tokens == 8
    assert TOK.decode(r.prompt_token_ids) == "<|user|>hello\n<|assistant|>"


@pytest.mark.parametrize("row, message", [
    ({"prompt": None}, "prompt is null"),
    ({"prompt": 42}, "prompt must be a string, got int"),
    ({"prompt": ""}, "prompt is empty"),
    ({"prompt": "   "}, "prompt is empty"),
    ({"prompt": "x" * 500}, "too long"),
    ({"prompt": "hi", "max_tokens": -3}, "max_tokens must be an integer >= 1"),
    ({"prompt": "hi", "max_tokens": "ten"}, "max_tokens must be an integer"),
    ({"prompt": "hi", "temperature": -1.0}, "temperature"),
    ({"prompt": "hi", "top_p": 1.5}, "top_p"),
    ({"prompt": "hi", "seed": 1.5}, "seed must be an integer"),
    ({"prompt": "hi", "stop": [""]}, "stop cannot contain an empty string ('')"),
    ({"prompt": "hi", "stop": ["a", 5]}, "stop must be a string or a list of strings, got int 5 in the list"),
    ({"prompt": "hi", "stop": 5}, "stop must be a string or a list of strings, got int 5"),
    ({"prompt": "hi", "system": 7}, "system must be a string"),
])
def test_bad_prompt_rows(row, message):
    r = req(row)
    assert r.prompt_token_ids is None and r.error is not None
    assert message in r.error


@pytest.mark.parametrize("field, value", [
    ("temperature", float("nan")), ("temperature", "hot"), ("temperature", True), ("temperature", -1),
    ("top_p", float("nan")), ("top_p", "all"), ("max_tokens", "ten"), ("max_tokens", 2.5), ("seed", 1.5),
    ("seed", "7"),
])
def test_a_bad_row_parameter_reads_as_the_api_words_it(field, value):
    """A row's override and the API's SamplingParams are refused by one rule (`SamplingParams.validate`), in
    the same words: a NaN temperature was `must be a finite number >= 0` from the API and `must be a number,
    got float nan` from a job."""
    api = dataclasses.replace(DEFAULTS, **{field: value}).validate()
    assert api is not None and api.startswith(f"{field} must be ")
    assert req({"prompt": "hi", field: value}).error == api
    if field == "temperature" and value != value:
        assert api == "temperature must be a finite number >= 0, got nan"


def test_overrides_apply():
    r = req({"prompt": "hi", "max_tokens": 3, "temperature": 0.5, "top_p": 0.9, "seed": 7, "stop": "x",
             "system": "be brief"})
    assert r.error is None
    p = r.params
    assert (p.max_tokens, p.temperature, p.top_p, p.seed, p.stop) == (3, 0.5, 0.9, 7, ["x"])
    assert TOK.decode(r.prompt_token_ids).startswith("<|system|>be brief\n<|user|>hi")
    assert req({"prompt": "hi", "max_tokens": None}).params.max_tokens == 8  # null = job default


def test_messages_rows():
    cols = ("id", "messages")
    good = req({"messages": [{"role": "user", "content": "hi"}]}, cols, system_prompt="sys")
    assert TOK.decode(good.prompt_token_ids) == "<|system|>sys\n<|user|>hi\n<|assistant|>"
    assert req({"messages": '[{"role": "user", "content": "hi"}]'}, cols).error is None
    assert "not valid JSON" in req({"messages": '[{"role": "user"'}, cols).error
    assert "role must be one of" in req({"messages": [{"role": "wizard", "content": "hi"}]}, cols).error
    assert "content must be a string" in req({"messages": [{"role": "user", "content": None}]}, cols).error
    assert "non-empty list" in req({"messages": []}, cols).error
    assert "messages is null" in req({"messages": None}, cols).error
    no_template = req({"messages": [{"role": "user", "content": "hi"}]}, cols, use_chat_template=False)
    assert "chat template" in no_template.error


def test_a_row_without_a_prompt_or_a_conversation_names_what_it_lacks():
    """README's words: a null cell is `prompt is null` or `messages is null` when the input has only that
    column, and `prompt and messages are both null` when it has both (either one alone would do)."""
    both = ("id", "prompt", "messages")
    assert req({"prompt": None}).error == "prompt is null"
    assert req({"messages": None}, ("id", "messages")).error == "messages is null"
    assert req({"messages": "null"}, ("id", "messages")).error == "messages is null"  # JSON text null
    assert req({"prompt": None, "messages": None}, both).error == "prompt and messages are both null"
    assert req({"prompt": "hi", "messages": None}, both).error is None
    assert req({"prompt": None, "messages": [{"role": "user", "content": "hi"}]}, both).error is None


def test_a_null_conversation_reads_the_same_from_llm_chat_and_a_job():
    """`LLM.chat` renders each conversation through `validate_messages`; a job's null `messages` cell is
    refused by the same rule in the same words (it was `messages must be a non-empty list of {role,
    content}, got NoneType` from the API and `messages is null` from a job)."""
    from engine.tokenizer import validate_messages

    with pytest.raises(ValueError) as api:
        validate_messages(None)
    assert str(api.value) == "messages is null" == req({"messages": None}, ("id", "messages")).error


def test_raw_prompt_without_template():
    r = req({"prompt": "hi"}, use_chat_template=False, system_prompt="S")
    assert TOK.decode(r.prompt_token_ids) == "S\n\nhi"


def test_parse_messages_normalises():
    assert parse_messages([{"role": "user", "content": "a", "extra": 1}]) == [{"role": "user", "content": "a"}]


def test_tokenizer_exception_becomes_error_row():
    class Broken(FakeTokenizer):
        def encode(self, text):
            raise RuntimeError("boom")

    layout = InputLayout.from_schema(["prompt"])
    r = build_request({"prompt": "hi"}, layout, Broken(), DEFAULTS)
    assert r.error == "RuntimeError: boom"
