"""Structured outputs: constraint parameters, the bitmask, and constrained generation on the real model
(every output satisfies its constraint, greedy and sampled; masks stay in their rows; a constraint
the unconstrained answer already satisfies changes nothing; speculation and jump-forward change
nothing; one compile per distinct constraint; bad constraints are error outputs), and the scoring
mode against a direct computation."""
from __future__ import annotations

import json
import random
import re
from pathlib import Path

import jsonschema
import polars as pl
import pytest
import torch
from pydantic import BaseModel

from engine import LLM, SamplingParams
from engine.structured import StructuredOutputsParams as SO
from engine.structured import apply_token_bitmask_, unpack_bitmask

KV = 96 << 20
DATA = Path(__file__).resolve().parent.parent / "data" / "labelling.parquet"
LABELS = ["files", "network", "text", "math", "concurrency", "data"]
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "job": {"enum": ["engineer", "doctor", "teacher", "artist"]}},
          "required": ["name", "age", "job"], "additionalProperties": False}


@pytest.fixture(scope="module")
def eng():
    return LLM("smollm2-135m-instruct", speculative=None, kv_cache_memory_bytes=KV)


def _chat(llm, text: str) -> str:
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def _labelling_prompts(llm, n: int = 60) -> list[str]:
    df = pl.read_parquet(DATA).head(n)
    return [_chat(llm, p) for p in df["prompt"]]


def _person_prompts(llm, n: int = 50) -> list[str]:
    names = ["Ada", "Bo", "Cy", "Di", "Ed", "Flo", "Gus", "Hal", "Ivy", "Jo"]
    return [_chat(llm, f"Describe a person called {names[i % 10]} number {i} as JSON with name, age and job.")
            for i in range(n)]


# ---------------------------------------------------------------- parameters and the bitmask

def test_params_validate_name_the_field():
    assert SO(choice=["a", "b"]).validate() is None
    assert "exactly one" in SO().validate()
    assert "exactly one" in SO(regex="a", choice=["a"]).validate()
    assert SO(choice=[]).validate().startswith("structured_outputs.choice")
    assert "duplicate" in SO(choice=["a", "b", "a"]).validate()
    assert "non-empty string" in SO(choice=["a", ""]).validate()
    assert SO(json="{not json").validate().startswith("structured_outputs.json: not valid JSON")
    assert SO(json=[1, 2]).validate().startswith("structured_outputs.json")
    assert SO(regex="").validate().startswith("structured_outputs.regex")
    assert SamplingParams(structured_outputs="x").validate().startswith("structured_outputs must be")
    assert SamplingParams(structured_outputs={"regex": "[0-9]+"}).structured_outputs == SO(regex="[0-9]+")
    assert "duplicate" in SamplingParams(score_choices=["a", "a"]).validate()
    assert "cannot both" in SamplingParams(score_choices=["a"], structured_outputs=SO(regex="a")).validate()


def test_key_is_a_content_hash_and_pydantic_models_become_schemas():
    class Person(BaseModel):
        name: str
        age: int

    p = SO(json=Person)
    assert p.json["properties"]["age"]["type"] == "integer" and p.json["required"] == ["name", "age"]
    a = SO(json={"type": "object", "properties": {"x": {"type": "integer"}}})
    b = SO(json='{"properties": {"x": {"type": "integer"}}, "type": "object"}')
    assert a.key() == b.key()
    assert a.key() != SO(json=a.json, disable_any_whitespace=False).key()
    assert SO(choice=["a", "b"]).key() != SO(choice=["b", "a"]).key() != SO(regex="a|b").key()
    assert SO(json_object=True).spec() == {"type": "object"}


def test_objects_are_closed_by_default_everywhere_in_a_schema():
    obj = lambda **props: {"type": "object", "properties": props}  # noqa: E731
    user = {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": obj(k={"type": "string"})},
            "pair": {"type": "array", "prefixItems": [obj(a={}), {"type": "integer"}]},
            "either": {"anyOf": [obj(x={}), {"oneOf": [obj(y={}), {"type": "null"}]}]},
            "free": {**obj(z={}), "additionalProperties": True},  # explicit: kept open
            "typed": {**obj(z={}), "additionalProperties": obj(v={})},  # a schema: kept, its object closed
            "pattern": {**obj(z={}), "patternProperties": {"^x": obj(w={})}},
            "ref": {"$ref": "#/$defs/Inner"},
        },
        "required": ["tags"],
        "$defs": {"Inner": obj(deep=obj(d={}))},
        "definitions": {"Old": obj(o={})},
    }
    before = json.loads(json.dumps(user))
    closed = lambda **props: {"type": "object", "properties": props, "additionalProperties": False}  # noqa: E731
    assert SO(json=user).spec() == {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": closed(k={"type": "string"})},
            "pair": {"type": "array", "prefixItems": [closed(a={}), {"type": "integer"}]},
            "either": {"anyOf": [closed(x={}), {"oneOf": [closed(y={}), {"type": "null"}]}]},
            "free": {**obj(z={}), "additionalProperties": True},
            "typed": closed(z={}) | {"additionalProperties": closed(v={})},
            "pattern": {**obj(z={}), "patternProperties": {"^x": closed(w={})}},
            "ref": {"$ref": "#/$defs/Inner"},
        },
        "required": ["tags"],
        "$defs": {"Inner": closed(deep=closed(d={}))},
        "definitions": {"Old": closed(o={})},
        "additionalProperties": False,
    }
    assert user == before  # the caller's dict is untouched
    assert SO(json=json.dumps(user)).spec() == SO(json=user).spec()  # JSON text alike
    assert SO(json=user).key() == SO(json=SO(json=user).spec()).key()  # the same constraint, one compile
    assert SO(json=True).spec() is True and SO(json_object=True).spec() == {"type": "object"}


def test_an_intersection_is_closed_as_a_whole_its_parts_stay_open():
    """Closing one part of an `allOf` would forbid the keys the other parts declare; the schema holding
    the `allOf` lists every part's keys and is closed instead (it had stayed open)."""
    base = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    user = {"allOf": [{"$ref": "#/$defs/Base"}, {"properties": {"b": {"properties": {"c": {}}}}}],
            "$defs": {"Base": base, "Other": base}}
    got = SO(json=user).spec()
    assert got["$defs"]["Base"] == base  # named by an allOf branch: open
    assert got["$defs"]["Other"] == {**base, "additionalProperties": False}
    part = got["allOf"][1]
    assert "additionalProperties" not in part
    assert part["properties"]["b"] == {"properties": {"c": {}}, "additionalProperties": False}
    assert (got["properties"], got["additionalProperties"]) == ({"a": {}, "b": {}}, False)  # a by the $ref
    # a part that opens objects itself keeps the whole open; an allOf of no objects is left alone
    opened = {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}, "additionalProperties": True}]}
    assert SO(json=opened).spec() == opened
    strings = {"allOf": [{"type": "string", "minLength": 2}, {"maxLength": 4}]}
    assert SO(json=strings).spec() == strings


def test_an_intersection_accepts_what_every_part_accepts_and_no_other_key(eng):
    """Two allOf parts that each define one property: an object with both keys is valid, one with a
    key neither part defines is not (it was: the intersection stayed open), and each part's rule holds."""
    from engine.structured.llguidance_backend import LLGuidanceBackend

    schema = {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                        {"type": "object", "properties": {"b": {"type": "string"}}, "required": ["b"]}]}
    backend = LLGuidanceBackend(eng.tokenizer)

    def accepts(text: str) -> bool:
        ids = eng.tokenizer.encode(text, add_special_tokens=False)
        return backend.compile(SO(json=schema)).matcher().validate_tokens(ids) == len(ids)

    assert accepts('{"a":1,"b":"x"}')
    assert not accepts('{"a":1,"b":"x","c":2}')
    assert not accepts('{"a":"one","b":"x"}')
    for text in ('{"a":1,"b":"x"}', '{"a":1,"b":"x","c":2}'):  # what a validator says of the schema as written
        valid = jsonschema.Draft202012Validator(SO(json=schema).spec()).is_valid(json.loads(text))
        assert valid == (text == '{"a":1,"b":"x"}')


def test_readme_label_example_gives_exactly_its_keys(eng):
    """README's pydantic `Label`, asked for extra keys by the prompt: the model wrote `reason` and
    `language` while the schema was read as open; closed by default, the keys are the schema's."""
    class Label(BaseModel):
        topic: str
        confidence: float

    prompt = _chat(eng, "Label this text with a topic and a confidence, as JSON with keys topic, confidence, "
                        "reason and language: 'import socket'")
    p = SamplingParams(temperature=0, max_tokens=32, structured_outputs=SO(json=Label))
    c = eng.generate([prompt], p, use_tqdm=False)[0].outputs[0]
    assert c.finish_reason == "stop" and c.valid is True, c
    assert set(json.loads(c.text)) == {"topic", "confidence"}, c.text
    open_label = {**Label.model_json_schema(), "additionalProperties": True}  # how to allow extra keys
    c = eng.generate([prompt], SamplingParams(temperature=0, max_tokens=32, structured_outputs=SO(json=open_label)),
                     use_tqdm=False)[0].outputs[0]
    assert set(json.loads(c.text)) > {"topic", "confidence"}, c.text


def test_unpack_matches_a_bit_by_bit_reference_and_apply_masks_in_place():
    g = torch.Generator().manual_seed(0)
    bm = torch.randint(-2**31, 2**31 - 1, (3, 5), generator=g, dtype=torch.int64).to(torch.int32)
    V = 150  # not a multiple of 32: the last word is cut; ids past 32 * W would be disallowed
    got = unpack_bitmask(bm, V)
    want = torch.tensor([[(int(bm[r, t // 32]) >> (t % 32)) & 1 == 1 for t in range(V)] for r in range(3)])
    assert torch.equal(got, want)
    wide = unpack_bitmask(bm, 200)
    assert torch.equal(wide[:, :160], unpack_bitmask(bm, 160)) and not wide[:, 160:].any()
    logits = torch.randn(3, V, generator=g)
    before = logits.clone()
    apply_token_bitmask_(logits, bm)
    assert torch.equal(logits[want], before[want]) and torch.isneginf(logits[~want]).all()


# ---------------------------------------------------------------- constrained generation

@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_choice_output_is_one_of_the_choices(eng, temperature):
    prompts = _labelling_prompts(eng, 60)
    p = SamplingParams(temperature=temperature, seed=7, max_tokens=8, structured_outputs=SO(choice=LABELS))
    outs = eng.generate(prompts, p, use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    assert all(t in LABELS for t in texts), texts
    assert all(o.outputs[0].finish_reason == "stop" and o.outputs[0].valid is True for o in outs)
    if temperature:
        assert len(set(texts)) > 1  # sampled: not all one label


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_regex_output_matches(eng, temperature):
    prompts = [_chat(eng, f"On what date did event number {i} happen? Answer with a date.") for i in range(50)]
    rx = r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
    p = SamplingParams(temperature=temperature, seed=3, max_tokens=16, structured_outputs=SO(regex=rx))
    outs = eng.generate(prompts, p, use_tqdm=False)
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "stop" and c.valid is True, c
        assert re.fullmatch(rx, c.text) and c.text.isascii(), c.text  # \d is [0-9]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_json_output_validates_or_is_marked_invalid(eng, temperature):
    prompts = _person_prompts(eng, 50)
    p = SamplingParams(temperature=temperature, seed=11, max_tokens=40, structured_outputs=SO(json=PERSON))
    outs = eng.generate(prompts, p, use_tqdm=False)
    ok = 0
    for o in outs:
        c = o.outputs[0]
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.text), PERSON)
            assert c.valid is True and " " not in c.text.replace(json.loads(c.text)["name"], "")  # compact
            ok += 1
        else:
            assert c.finish_reason == "length" and c.valid is False
    assert ok >= 25, ok
    # cut by max_tokens inside the object: every row invalid, none silently truncated into a label
    short = eng.generate(prompts[:10], SamplingParams(temperature=temperature, seed=1, max_tokens=4,
                                                      structured_outputs=SO(json=PERSON)), use_tqdm=False)
    assert all(o.outputs[0].finish_reason == "length" and o.outputs[0].valid is False for o in short)


def test_grammar_and_json_object_constraints(eng):
    lark = 'start: "The answer is " NUM "."\nNUM: /[0-9]+/'
    prompts = [_chat(eng, f"What is {i} plus {i}?") for i in range(6)]
    outs = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=16, structured_outputs=SO(grammar=lark)),
                        use_tqdm=False)
    assert all(re.fullmatch(r"The answer is [0-9]+\.", o.outputs[0].text) and o.outputs[0].valid for o in outs)
    outs = eng.generate(_person_prompts(eng, 4), SamplingParams(temperature=0, max_tokens=48,
                                                                structured_outputs=SO(json_object=True)),
                        use_tqdm=False)
    for o in outs:
        if o.outputs[0].finish_reason == "stop":
            assert isinstance(json.loads(o.outputs[0].text), dict)


def test_constrained_rows_do_not_leak_masks_into_other_rows(eng):
    plain = [_chat(eng, t) for t in ("Write a haiku about the sea.", "What is the capital of France?",
                                     "List three colours.")]
    labelled = _labelling_prompts(eng, 2)
    g = SamplingParams(temperature=0, max_tokens=24)
    c = SamplingParams(temperature=0, max_tokens=8, structured_outputs=SO(choice=LABELS))
    alone_plain = [o.outputs[0].text for o in eng.generate(plain, g, use_tqdm=False)]
    alone_c = [o.outputs[0].text for o in eng.generate(labelled, c, use_tqdm=False)]
    mixed = eng.generate([plain[0], labelled[0], plain[1], labelled[1], plain[2]], [g, c, g, c, g], use_tqdm=False)
    got = [o.outputs[0].text for o in mixed]
    assert [got[0], got[2], got[4]] == alone_plain
    assert [got[1], got[3]] == alone_c
    assert [o.outputs[0].valid for o in mixed] == [None, True, None, True, None]


def test_greedy_constrained_equals_unconstrained_where_that_already_satisfies_it(eng):
    """Rows whose unconstrained greedy answer already matches a pattern give the same answer under that
    pattern as a constraint, jump-forward on and off (off: token for token)."""
    countries = ["France", "Germany", "Japan", "Egypt", "Peru", "Kenya", "Norway", "Poland", "Chile", "Italy", "Spain"]
    prompts = [_chat(eng, f"What is the capital of {c}?") for c in countries]
    prompts += [_chat(eng, f"What is {a} + {b}? Answer with the number only.") for a in range(1, 5) for b in range(1, 3)]
    patterns = [r"The capital of [A-Z][a-z]+ is [A-Z][a-z]+\.", r"[0-9] \+ [0-9] = [0-9]+", r"The answer is [0-9]+\."]
    free = [o.outputs[0] for o in eng.generate(prompts, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)]
    cases = []  # (prompt, constraint, unconstrained completion)
    for p, c in zip(prompts, free):
        rx = next((r for r in patterns if re.fullmatch(r, c.text)), None)
        if c.finish_reason == "stop" and rx is not None:
            cases.append((p, SO(regex=rx), c))
    assert len(cases) >= 10, [c.text for c in free]
    no_jf = LLM("smollm2-135m-instruct", speculative=None, kv_cache_memory_bytes=KV,
                structured_outputs_jump_forward=False)
    for llm in (eng, no_jf):
        outs = llm.generate([p for p, _, _ in cases],
                            [SamplingParams(temperature=0, max_tokens=16, structured_outputs=so) for _, so, _ in cases],
                            use_tqdm=False)
        assert [o.outputs[0].text for o in outs] == [c.text for _, _, c in cases]
        if llm is no_jf:  # without jump-forward every token is the model's own: token for token
            assert [o.outputs[0].token_ids for o in outs] == [c.token_ids for _, _, c in cases]


def test_bad_constraints_are_error_outputs_and_the_other_rows_run(eng):
    prompt = _labelling_prompts(eng, 1)[0]
    bad = [SO(regex="a(b"), SO(choice=["x", "y", "x"]), SO(json={"type": "nonsense"}),
           SO(grammar="start: undefined_rule")]
    params = [SamplingParams(max_tokens=4, structured_outputs=so) for so in bad]
    params += [SamplingParams(max_tokens=4, structured_outputs=SO(choice=[])),
               SamplingParams(temperature=0, max_tokens=8, structured_outputs=SO(choice=LABELS))]
    outs = eng.generate([prompt] * len(params), params, use_tqdm=False)
    errors = [o.error for o in outs]
    assert errors[0] == 'structured_outputs.regex: invalid regex "a(b": unclosed group at offset 1'
    assert all("\n" not in e for e in errors[:5]), errors
    assert errors[1].startswith("structured_outputs.choice") and "duplicate" in errors[1]
    assert errors[2].startswith("structured_outputs.json") and "nonsense" in errors[2]
    assert errors[3].startswith("structured_outputs.grammar") and "undefined_rule" in errors[3]
    assert errors[4].startswith("structured_outputs.choice: must be a non-empty list")
    assert all(o.outputs[0].finish_reason == "error" for o in outs[:5])
    assert errors[5] is None and outs[5].outputs[0].text in LABELS


@pytest.mark.parametrize("so,message", [
    (SO(regex="(ab"), 'regex: invalid regex "(ab": unclosed group at offset 0'),
    # the offset is in the pattern as written, though llguidance compiles \d as [0-9]
    (SO(regex=r"\d\d[z-a]"), r'regex: invalid regex "\d\d[z-a]": invalid character class range, the start must '
                                r'be <= the end at offset 5'),
    (SO(regex="a\n("), 'regex: invalid regex "a\\n(": unclosed group at offset 2'),  # the newline escaped
    # a lone backslash at the end (llguidance's rewrite dropped it and compiled "abc"); an escaped one is fine
    (SO(regex="abc\\"), 'regex: invalid regex "abc\\": incomplete escape at offset 3'),
    (SO(regex="\\"), 'regex: invalid regex "\\": incomplete escape at offset 0'),
    (SO(regex="a\\\\\\"), 'regex: invalid regex "a\\\\\\": incomplete escape at offset 3'),
    (SO(grammar='start: x\nx: "a" y'), 'grammar: unknown name: "y" at line 2, column 4'),
    (SO(grammar="start: /[/"), 'grammar: invalid regex "[": unclosed character class at offset 0 (line 1, column 8 '
                               'of the grammar)'),
    # llguidance's Lark lexer says only "lexer error" and a position: the text there is named
    (SO(grammar='start: "yes" | "no'), 'grammar: lexer error at line 1, column 19: unclosed string \'"no\''),
    (SO(grammar='start: "a" $'), "grammar: lexer error at line 1, column 12: unexpected '$'"),
    (SO(grammar="start: x\nx: 'a'"), 'grammar: lexer error at line 2, column 4: unexpected "\'a\'" (strings take double '
                                     'quotes)'),
    # GBNF: positions in the text as written (llguidance quoted 20 characters each side, or none)
    (SO(grammar='root ::= "a" | "b'), 'grammar: read as GBNF (no start: rule): Unexpected end of input at line 1, '
                                      'column 18: unclosed string \'"b\''),
    (SO(grammar='start "a"'), 'grammar: read as GBNF (no start: rule): Expected ::= at line 1, column 7: unexpected '
                              '\'"a"\''),
    (SO(grammar='root ::= "y" x\nx ::= "a" | "b" y'), "grammar: read as GBNF (no start: rule): unknown rule 'y' at "
                                                     "line 2, column 17"),
    # converted, then refused by llguidance at a line of its Lark text: the GBNF rule and its line
    (SO(grammar='root ::= "a" foo-bar\nfoo-bar ::= "b"{3,1}'), "grammar: read as GBNF (no start: rule): range end "
                                                             "must be >= start, got (3, 1) in rule foo-bar (line 2)"),
    # JSON Schema: the path inside the schema
    (SO(json={"type": "object", "properties": {"age": {"type": "integr"}}}),
     "json: Invalid type: integr (at properties.age.type)"),
    (SO(json={"anyOf": [{"type": "string"}, {"type": "integr"}]}), "json: Invalid type: integr (at anyOf[1].type)"),
    (SO(json={"properties": {"a": {"$ref": "#/$defs/A"}}, "$defs": {"A": {"type": "number", "minimum": "x"}}}),
     "json: Expected f64 for 'minimum', got \"x\" (at $defs.A.minimum)"),
    (SO(json={"properties": {"a": {"$ref": "#/$defs/gone"}}}), "json: Pointer '/$defs/gone' does not exist (at "
                                                               "properties.a.$ref)"),
    (SO(json={"properties": {"a b": {"type": "string", "pattern": "(ab"}}}),
     'json: invalid regex "(ab": unclosed group at offset 0 (at properties["a b"].pattern)'),
    # behind "required property 'a' is unsatisfiable": why it is
    (SO(json={"type": "object", "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 2}},
              "required": ["a"]}),
     "json: Unsatisfiable schema: minimum (5) is greater than maximum (2) (at properties.a.minimum)"),
])
def test_a_constraint_that_does_not_compile_is_one_line_naming_the_problem_and_where(eng, so, message):
    """llguidance reports six lines with carets; the error a user sees is one, the position kept."""
    from engine.structured import GrammarError
    from engine.structured.llguidance_backend import LLGuidanceBackend, check_constraint

    assert check_constraint(so) == "structured_outputs." + message
    with pytest.raises(GrammarError) as exc:
        LLGuidanceBackend(eng.tokenizer).compile(so)
    assert str(exc.value) == "structured_outputs." + message and isinstance(exc.value, ValueError)


def test_a_constraint_the_grammar_engine_gives_up_on_is_an_error_completion_not_an_empty_stop(eng):
    """llguidance compiles `a{100000000}` lazily and gives up while computing a mask ("too many expressions
    constructed"); its masks then allow only the end token, which came back as an empty "stop" with no
    error. Each such completion is an error naming the constraint; the unconstrained row runs as usual."""
    prompt = _labelling_prompts(eng, 1)[0]
    huge = SamplingParams(temperature=0, max_tokens=8, structured_outputs=SO(regex="a{100000000}"))
    plain = SamplingParams(temperature=0, max_tokens=8)
    outs = eng.generate([prompt, prompt, prompt], [huge, huge, plain], use_tqdm=False)
    for o in outs[:2]:
        c = o.outputs[0]
        assert (c.finish_reason, c.valid) == ("error", False)
        assert c.error == "structured_outputs.regex: lexer error: too many expressions constructed" == o.error
        assert (c.text, c.token_ids) == ("", [])  # it gives up on the first "a": nothing was accepted
    ref = eng.generate([prompt], [plain], use_tqdm=False)[0].outputs[0]
    assert (outs[2].outputs[0].text, outs[2].outputs[0].finish_reason) == (ref.text, ref.finish_reason)
    assert outs[2].outputs[0].error is None


GIVES_UP_AFTER_HELL = "(hello|hi) a{100000000}"  # llguidance accepts "h", "ell", then gives up on "o"


def test_a_grammar_the_engine_gives_up_on_part_way_ends_the_completion_there_as_an_error(eng):
    """Part-way through an output llguidance's lexer gives up (budget) consuming a token its mask
    allowed. The completion ends there, jump-forward on or off: finish_reason "error", `.error` naming
    the constraint, its text what the grammar accepted, no token after. (An errored matcher masks
    nothing: the row ran on, unconstrained, to max_tokens: 'hello, welcome to my office. ...')"""
    prompt = _chat(eng, "Say hello then many a letters.")
    p = SamplingParams(temperature=0, max_tokens=16, structured_outputs=SO(regex=GIVES_UP_AFTER_HELL))
    plain = SamplingParams(temperature=0, max_tokens=16)
    no_jf = LLM("smollm2-135m-instruct", speculative=None, kv_cache_memory_bytes=KV,
                structured_outputs_jump_forward=False)
    ref = eng.generate([prompt], plain, use_tqdm=False)[0].outputs[0]
    for llm in (eng, no_jf):
        o, free = llm.generate([prompt, prompt], [p, plain], use_tqdm=False)
        c = o.outputs[0]
        assert (c.text, c.finish_reason, c.valid, c.stop_reason) == ("hell", "error", False, None)
        assert [llm.tokenizer.decode([t]) for t in c.token_ids] == ["h", "ell"]
        assert c.error == "structured_outputs.regex: lexer error: too many expressions constructed" == o.error
        assert o.metrics.output_tokens == 2 and c.num_forced_tokens == 0  # "o" was forced, and refused
        assert (free.outputs[0].text, free.outputs[0].token_ids, free.error) == (ref.text, ref.token_ids, None)


def test_one_compile_per_distinct_constraint(eng):
    """60 requests over 3 schemas (their keys in different orders) and a bad regex compile 4 times."""
    schemas = [PERSON, {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
               {"type": "array", "items": {"type": "integer"}, "maxItems": 3}]
    prompts = _person_prompts(eng, 60)
    rng = random.Random(0)
    params = []
    for i in range(60):
        s = schemas[i % 3]
        shuffled = dict(rng.sample(list(s.items()), len(s)))  # same content, another key order
        params.append(SamplingParams(temperature=0, max_tokens=2, structured_outputs=SO(json=shuffled)))
    params += [SamplingParams(max_tokens=2, structured_outputs=SO(regex="(")) for _ in range(5)]
    st = eng.structured.stats
    c0, h0 = st.compiles, st.cache_hits
    fresh = [s for s in schemas if SO(json=s).key() not in eng.structured.cache]
    bad_new = SO(regex="(").key() not in eng.structured.cache
    outs = eng.generate(prompts + prompts[:5], params, use_tqdm=False)
    assert st.compiles - c0 == len(fresh) + bad_new
    assert st.cache_hits - h0 == 65 - len(fresh) - bad_new
    assert sum(o.error is not None for o in outs) == 5
    again = eng.generate(prompts, params[:60], use_tqdm=False)
    assert st.compiles - c0 == len(fresh) + bad_new and len(again) == 60  # nothing recompiled


def _mixed_batch(llm):
    prompts = _labelling_prompts(llm, 8) + _person_prompts(llm, 8) + [
        _chat(llm, f"On what date did event {i} happen?") for i in range(8)]
    sos = [SO(choice=LABELS)] * 8 + [SO(json=PERSON)] * 8 + [SO(regex=r"[0-9]{4}-[0-9]{2}-[0-9]{2}")] * 8
    greedy = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=so) for so in sos]
    sampled = [SamplingParams(temperature=1.0, seed=i, max_tokens=40, structured_outputs=so)
               for i, so in enumerate(sos)]
    return prompts + prompts, greedy + sampled


@pytest.fixture(scope="module")
def mixed_batch_without_speculation(eng):
    """(prompts, params, the token ids speculation off gives) of `_mixed_batch`, once per module."""
    prompts, params = _mixed_batch(eng)
    return prompts, params, [o.outputs[0].token_ids for o in eng.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("config", [
    {"method": "draft_model", "draft_model": "target", "num_speculative_tokens": 4},
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
], ids=["target-draft", "ngram"])
def test_speculation_does_not_change_constrained_output(mixed_batch_without_speculation, config):
    prompts, params, want = mixed_batch_without_speculation
    spec = LLM("smollm2-135m-instruct", kv_cache_memory_bytes=KV, speculative_config=config)
    outs = spec.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert spec.stats.spec_accepted_tokens > 0
    assert all(o.outputs[0].valid is not None for o in outs)


def test_jump_forward_appends_forced_tokens_and_counts_them(eng):
    prompts = _person_prompts(eng, 8)
    p = SamplingParams(temperature=0, max_tokens=40, structured_outputs=SO(json=PERSON))
    f0 = eng.stats.structured_forced_tokens
    outs = eng.generate(prompts, p, use_tqdm=False)
    forced = sum(o.outputs[0].num_forced_tokens for o in outs)
    assert forced > 0 and eng.stats.structured_forced_tokens - f0 == forced
    # the object's keys are forced: '{"name":"' at least starts every output
    assert all(o.outputs[0].text.startswith('{"name":"') for o in outs)
    st = eng.structured.stats
    assert st.fill_s > 0 and 0.0 <= st.hidden_share <= 1.0


def test_jump_forward_counts_only_the_forced_tokens_it_appended(eng):
    """A forced run longer than max_tokens leaves room for: `num_forced_tokens` (and the engine's count)
    are the forced tokens in the output, not the whole run the grammar forced (that counted 12,497
    for a row of 16 tokens)."""
    prompt = _chat(eng, "Answer yes or no.")
    so = SO(regex="(yes|no), and this sentence is forced by the grammar from here to its very end")
    f0 = eng.stats.structured_forced_tokens
    c = eng.generate([prompt], SamplingParams(temperature=0, max_tokens=4, structured_outputs=so),
                     use_tqdm=False)[0].outputs[0]
    assert (len(c.token_ids), c.finish_reason, c.num_forced_tokens) == (4, "length", 3)
    assert [eng.tokenizer.decode([t]) for t in c.token_ids] == ["yes", ",", " and", " this"]  # "yes" sampled
    assert eng.stats.structured_forced_tokens - f0 == 3


def test_a_row_cut_by_a_stop_string_is_valid_only_where_its_grammar_was_complete(eng):
    prompts = [_chat(eng, f"Give me a three digit number, then a semicolon. Number {i}.") for i in range(4)]
    # EOS is suppressed below 4 tokens, so after three digits the only legal token is ';': the stop string
    digits = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=8, min_tokens=4, stop=[";"],
                                                  structured_outputs=SO(regex=r"[0-9]{3};?")), use_tqdm=False)
    for o in digits:
        c = o.outputs[0]
        assert re.fullmatch(r"[0-9]{3}", c.text) and c.stop_reason == ";" and c.valid is True, c
    needs = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=8, stop=[";"],
                                                 structured_outputs=SO(regex=r"[0-9]{3};[0-9]")), use_tqdm=False)
    for o in needs:
        c = o.outputs[0]
        assert re.fullmatch(r"[0-9]{3}", c.text) and c.stop_reason == ";" and c.valid is False, c
    labelled = _labelling_prompts(eng, 4)
    schema = {"type": "object", "properties": {"topic": {"enum": LABELS}}, "required": ["topic"],
              "additionalProperties": False}
    cut = eng.generate(labelled, SamplingParams(temperature=0, max_tokens=16, stop=["}"],
                                                structured_outputs=SO(json=schema)), use_tqdm=False)
    for o in cut:
        c = o.outputs[0]
        assert c.stop_reason == "}" and c.text.startswith('{"topic":"') and c.valid is False, c


def test_jump_forward_equals_plain_decoding_and_skips_forced_forward_passes(eng):
    """Jump-forward (the forced start computed with the prompt, forced runs in one chunk, the end
    token appended once the grammar is complete) gives token for token what plain masked greedy
    decoding gives, and computes fewer tokens: no forward pass for any row's final EOS. (Sampled
    rows differ by design: a forced run is the grammar's own tokenization, where a sampler may
    spell the same text in other tokens, and forced tokens draw no random numbers; they stay
    valid.)"""
    prompts, params = _mixed_batch(eng)
    no_jf = LLM("smollm2-135m-instruct", speculative=None, kv_cache_memory_bytes=KV,
                structured_outputs_jump_forward=False)
    runs = {}
    for name, llm in (("on", eng), ("off", no_jf)):
        t0 = llm.stats.num_batched_tokens_sum
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs[name] = ([o.outputs[0] for o in outs], llm.stats.num_batched_tokens_sum - t0)
    (on, on_tokens), (off, off_tokens) = runs["on"], runs["off"]
    half = len(on) // 2  # greedy rows, then the same prompts sampled
    assert [o.token_ids for o in on[:half]] == [o.token_ids for o in off[:half]]
    assert [o.valid for o in on[:half]] == [o.valid for o in off[:half]]
    assert all(o.valid == (o.finish_reason == "stop") for o in on)
    assert all(o.num_forced_tokens == 0 for o in off)
    ended = [o for o in on if o.finish_reason == "stop"]
    assert len(ended) >= 40 and all(o.token_ids[-1] == eng.tokenizer.eos_token_id for o in ended)
    assert all(o.num_forced_tokens >= 1 for o in ended)  # the final EOS at least
    # every forced token skipped a forward pass of its own; each ended row's EOS was never computed
    assert off_tokens - on_tokens >= len(ended)


def test_jump_forward_computes_a_forced_start_in_the_prefill(eng):
    """A JSON row alone: its forced opening ('{"name":') is appended before the prefill, so
    every step samples exactly one token; a max_tokens shorter than the forced run keeps one token
    to sample and ends with "length" as plain decoding does."""
    prompt = _person_prompts(eng, 1)[0]
    so = SO(json=PERSON)
    s0 = eng.stats.num_steps
    out = eng.generate([prompt], SamplingParams(temperature=0, max_tokens=40, structured_outputs=so),
                       use_tqdm=False)[0].outputs[0]
    steps = eng.stats.num_steps - s0
    ids = eng.structured.matcher_for(so)[0].forced_tokens()
    assert eng.tokenizer.decode(ids).startswith('{"name') and out.token_ids[:len(ids)] == ids
    assert out.finish_reason == "stop" and out.valid
    assert steps == len(out.token_ids) - out.num_forced_tokens  # no step for a forced token
    no_jf = LLM("smollm2-135m-instruct", speculative=None, kv_cache_memory_bytes=KV,
                structured_outputs_jump_forward=False)
    for n in (1, 2):
        p = SamplingParams(temperature=0, max_tokens=n, structured_outputs=so)
        a = eng.generate([prompt], p, use_tqdm=False)[0].outputs[0]
        b = no_jf.generate([prompt], p, use_tqdm=False)[0].outputs[0]
        assert a.token_ids == b.token_ids and len(a.token_ids) == n and a.finish_reason == "length"
        assert a.valid is False


# ---------------------------------------------------------------- scoring mode

def test_scoring_equals_a_direct_computation_and_ignores_caching_and_order():
    prompts_text = pl.read_parquet(DATA).head(12)["prompt"].to_list()
    on = LLM("smollm2-135m-instruct", speculative=None, kv_cache_memory_bytes=KV)
    off = LLM("smollm2-135m-instruct", speculative=None, kv_cache_memory_bytes=KV, enable_prefix_caching=False)
    prompts = [_chat(on, t) for t in prompts_text]
    p = SamplingParams(score_choices=LABELS)
    ref = [o.outputs[0].label_logprobs for o in on.generate(prompts, p, use_tqdm=False)]
    assert all(list(r) == LABELS for r in ref)
    order = list(range(12))
    random.Random(5).shuffle(order)
    permuted = on.generate([prompts[i] for i in order], p, use_tqdm=False)
    assert [permuted[j].outputs[0].label_logprobs for j in range(12)] == [ref[i] for i in order]
    no_cache = off.generate(prompts, p, use_tqdm=False)
    assert [o.outputs[0].label_logprobs for o in no_cache] == ref
    for o, r in zip(no_cache, ref):
        assert o.outputs[0].text == max(r, key=r.get) and o.outputs[0].valid is True
    # direct: the whole prompt + choice through LLM.score (scratch blocks, no prefix cache)
    for prompt, r in zip(prompts[:3], ref):
        ids = on.tokenizer.encode(prompt)
        for c in LABELS:
            t = on.tokenizer.encode(c, add_special_tokens=False)
            direct = float(on.score(ids + t)[0][-len(t):].double().sum())
            assert r[c] == pytest.approx(direct, abs=2e-4)
    assert on.block_pool.num_free_blocks == on.block_pool.num_blocks  # nothing held after scoring


def test_scoring_choices_that_are_token_prefixes_of_each_other_scores_them_with_the_end_token(eng):
    """"yes" is a token prefix of "yes please": both are scored followed by EOS (the answer is exactly
    that choice), equal to the direct computation; without the end token "yes" could never lose."""
    choices = ["yes", "yes please", "no"]
    toks = [eng.tokenizer.encode(c, add_special_tokens=False) for c in choices]
    assert toks[1][:len(toks[0])] == toks[0]
    eos = eng.tokenizer.eos_token_id
    prompts = [_chat(eng, q) for q in ("Say yes please.", "Do you want tea? Answer yes or no.", "Say no.")]
    outs = eng.generate(prompts, SamplingParams(score_choices=choices), use_tqdm=False)
    for prompt, o in zip(prompts, outs):
        ids = eng.tokenizer.encode(prompt)
        r = o.outputs[0].label_logprobs
        for c, t in zip(choices, toks):
            t = t + [eos]
            direct = float(eng.score(ids + t)[0][-len(t):].double().sum())
            assert r[c] == pytest.approx(direct, abs=2e-4), (c, r)
        assert o.outputs[0].text == max(r, key=r.get)
