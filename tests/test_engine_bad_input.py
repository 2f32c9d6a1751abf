"""Bad input never kills a batch; bad engine configuration raises at once.

One batch mixes valid requests with one of every bad kind the spec lists. Each
bad request comes back in place with `finish_reason == "error"`, no tokens, and
an error naming the parameter; `generate` does not raise; and the valid
requests of the batch are identical to a clean run of just them.
"""
from __future__ import annotations

import math
import re

import pytest
import torch

from engine import LLM, SamplingParams

MODEL = "smollm2-135m-instruct"
MAX_MODEL_LEN = 64
KV_BYTES_PER_BLOCK = 30 * 2 * 3 * 64 * 4 * 16  # SmolLM2-135M, fp32, block_size 16


@pytest.fixture(scope="module")
def small_llm():
    """An engine with max_model_len=64, so that over-long prompts are cheap to build."""
    return LLM(MODEL, max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=64 * KV_BYTES_PER_BLOCK)


def test_bad_requests_become_error_outputs_and_spare_the_batch(small_llm):
    llm = small_llm
    assert llm.max_model_len == MAX_MODEL_LEN
    vocab = llm.tokenizer.vocab_size
    long_ids = llm.tokenizer.encode("Four score and seven years ago our fathers brought forth on this continent " * 12)
    assert len(long_ids) > MAX_MODEL_LEN + 10
    greedy = SamplingParams(temperature=0.0, max_tokens=6)

    good = {  # index in the batch -> (prompt, params)
        0: ("The capital of France is", greedy),
        5: ("def add(a, b):", greedy),
        9: (long_ids[: MAX_MODEL_LEN - 1], greedy),  # room for exactly one token
        14: ("Water boils at", SamplingParams(temperature=0.8, seed=11, max_tokens=6)),
    }
    bad = {  # index -> (prompt, params, words of which one must appear in the error)
        1: ("", greedy, ("prompt",)),
        2: ([], greedy, ("prompt",)),
        3: (long_ids[: MAX_MODEL_LEN + 10], greedy, ("prompt", "max_model_len")),
        4: (long_ids[:MAX_MODEL_LEN], greedy, ("prompt", "max_model_len")),  # no room for output
        6: ("Hello", SamplingParams(temperature=0.0, max_tokens=0), ("max_tokens",)),
        7: ("Hello", SamplingParams(temperature=0.0, min_tokens=5, max_tokens=3), ("min_tokens",)),
        8: ("Hello", SamplingParams(temperature=-0.5, max_tokens=6), ("temperature",)),
        10: ("Hello", SamplingParams(temperature=math.nan, max_tokens=6), ("temperature",)),
        11: ("Hello", SamplingParams(temperature=0.7, top_p=0.0, max_tokens=6), ("top_p",)),
        12: ("Hello", SamplingParams(temperature=0.7, top_p=1.5, max_tokens=6), ("top_p",)),
        13: ("Hello", SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=[vocab + 7]), ("stop_token_ids",)),
    }
    n = len(good) + len(bad)
    assert sorted(list(good) + list(bad)) == list(range(n))
    prompts = [good[i][0] if i in good else bad[i][0] for i in range(n)]
    params = [good[i][1] if i in good else bad[i][1] for i in range(n)]

    # prompt 9 leaves room for 1 of its 6 tokens: said once (this is the module engine's first batch)
    with pytest.warns(UserWarning, match=r"max_tokens=6 is more than the context leaves after the prompt "
                                         r"\(63 tokens of max_model_len=64, room for 1\)"):
        outs = llm.generate(prompts, params, use_tqdm=False)

    assert [o.request_id for o in outs] == [str(i) for i in range(n)]
    for i, (_, _, names) in bad.items():
        o = outs[i]
        assert len(o.outputs) == 1, i
        c = o.outputs[0]
        assert c.finish_reason == "error", (i, c)
        assert c.token_ids == [] and c.text == "", (i, c)
        assert c.error and any(name in c.error for name in names), f"request {i}: error {c.error!r} names none of {names}"
        assert o.error == c.error
    for i in good:
        assert outs[i].error is None and outs[i].outputs[0].error is None
        assert outs[i].outputs[0].finish_reason in ("stop", "length")
    # The one-token room is used, then the length limit ends the request.
    assert len(outs[9].outputs[0].token_ids) == 1 and outs[9].outputs[0].finish_reason == "length"

    clean = llm.generate([good[i][0] for i in good], [good[i][1] for i in good], use_tqdm=False)
    for i, c in zip(good, clean):
        got, want = outs[i].outputs[0], c.outputs[0]
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason), i
        assert len(want.token_ids) >= 1
    assert llm.num_free_blocks == llm.num_total_blocks


def test_bad_requests_through_iter_outputs_and_chat(small_llm):
    """iter_outputs yields error outputs too (each request exactly once); chat turns a bad params into an error."""
    llm = small_llm
    prompts = ["", "The sky is", "Hello"]
    params = [SamplingParams(temperature=0.0, max_tokens=4),
              SamplingParams(temperature=0.0, max_tokens=4),
              SamplingParams(temperature=0.0, top_p=2.0, max_tokens=4)]
    outs = {o.request_id: o for o in llm.iter_outputs(prompts, params, use_tqdm=False)}
    assert sorted(outs) == ["0", "1", "2"]
    assert outs["0"].outputs[0].finish_reason == "error" and "prompt" in outs["0"].outputs[0].error
    assert outs["2"].outputs[0].finish_reason == "error" and "top_p" in outs["2"].outputs[0].error
    assert outs["1"].outputs[0].finish_reason == "length" and len(outs["1"].outputs[0].token_ids) == 4

    chats = llm.chat([[{"role": "user", "content": "Hi"}]] * 2,
                     [SamplingParams(temperature=0.0, max_tokens=3),
                      SamplingParams(temperature=0.0, max_tokens=3, min_tokens=4)], use_tqdm=False)
    assert chats[0].outputs[0].finish_reason in ("stop", "length") and chats[0].outputs[0].token_ids
    assert chats[1].outputs[0].finish_reason == "error" and "min_tokens" in chats[1].outputs[0].error


def test_max_tokens_past_the_context_runs_to_its_end_and_warns_once_per_llm(small_llm):
    """As vLLM's offline LLM does, a max_tokens past the room the prompt leaves is no error: the request
    stops at the end of the context ("length"). The first such request says so (a job refuses the row
    unless --truncate); later ones, in this call or the next, do not repeat it."""
    import warnings

    llm = small_llm
    llm.input_processor.warned_max_tokens = False  # the module's engine may have warned already in another test
    ids = llm.tokenizer.encode("Four score and seven years ago our fathers brought forth on this continent " * 8)
    prompt = ids[: MAX_MODEL_LEN - 5]
    assert len(prompt) == MAX_MODEL_LEN - 5
    p = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    want = (f"max_tokens=1000 is more than the context leaves after the prompt ({MAX_MODEL_LEN - 5} tokens of "
            f"max_model_len={MAX_MODEL_LEN}, room for 5): such requests stop at the end of the context with "
            f"finish_reason 'length' (said once per LLM)")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = llm.generate([prompt, prompt[:-1]], p, use_tqdm=False)
        again = llm.generate([prompt], p, use_tqdm=False)
    assert [str(w.message) for w in caught if issubclass(w.category, UserWarning)] == [want]
    assert [(o.error, o.outputs[0].finish_reason, len(o.outputs[0].token_ids)) for o in outs] == [
        (None, "length", 5), (None, "length", 6)]
    assert again[0].outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_a_negative_seed_is_a_seed_and_minus_one_is_none_as_in_vllm(small_llm):
    """Any integer seeds a request, negative ones too (the same tokens each time); -1 is vLLM's "no seed"."""
    assert SamplingParams(seed=-1).seed is None
    assert SamplingParams(seed=-7).seed == -7 and SamplingParams(seed=-7).validate() is None
    p = SamplingParams(temperature=0.9, max_tokens=6, seed=-7, ignore_eos=True)
    first, again = (small_llm.generate(["Once upon a time"], p, use_tqdm=False)[0] for _ in range(2))
    assert first.error is None and len(first.outputs[0].token_ids) == 6
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_a_single_string_is_one_prompt_not_one_per_character(small_llm):
    p = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    one = small_llm.generate("Hello there", p, use_tqdm=False)
    want = small_llm.generate(["Hello there"], p, use_tqdm=False)
    assert len(one) == 1 and one[0].prompt == "Hello there"
    assert one[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    assert [o.prompt for o in small_llm.iter_outputs("Hi", p, use_tqdm=False)] == ["Hi"]


def test_sampling_params_list_must_match_prompts(small_llm):
    with pytest.raises(ValueError, match="sampling_params"):
        small_llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)


@pytest.mark.parametrize("model", ["no-such-model-xyz", "/nonexistent/dir/model.gguf"])
def test_unknown_model_raises(model):
    with pytest.raises((ValueError, FileNotFoundError)) as info:
        LLM(model)
    assert model in str(info.value) or "model" in str(info.value)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"block_size": 0}, "block_size"),
        ({"max_num_seqs": -1}, "max_num_seqs"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"dtype": "int3"}, "dtype"),
        ({"device": "tpu"}, "device"),
        ({"max_model_len": 0}, "max_model_len"),
        ({"kv_cache_memory_bytes": 10}, "kv_cache_memory_bytes"),  # smaller than one KV block
        ({"block_size": 100000}, r"block_size=100000 is larger than the model's context"),  # not the KV budget
        ({"max_num_seq": 8}, "max_num_seq"),  # a misspelt kwarg is not silently ignored
    ],
)
def test_invalid_engine_kwargs_raise(kwargs, name):
    with pytest.raises((ValueError, TypeError), match=name):
        LLM(MODEL, **kwargs)


def test_blank_prompts_are_error_outputs_in_the_words_of_a_jobs_error_row(small_llm):
    """A whitespace-only prompt is refused as an empty one is, by the API and by a job alike, and the two
    describe the same problem (empty, too long) in the same words."""
    from pipeline.schema import InputLayout, build_request

    llm = small_llm
    long_text = "Four score and seven years ago our fathers brought forth " * 8
    n_long = len(llm.tokenizer.encode(long_text))
    assert n_long > MAX_MODEL_LEN
    too_long = (f"prompt is too long: {n_long} tokens, and the engine's context (max_model_len) is {MAX_MODEL_LEN} "
                f"tokens, set by the max_model_len={MAX_MODEL_LEN} option, which leaves no room for output")
    outs = llm.generate(["   ", "\n\t ", "Hi", [], "", long_text], SamplingParams(temperature=0, max_tokens=2),
                        use_tqdm=False)
    assert [o.error for o in outs] == ["prompt is empty", "prompt is empty", None, "prompt is empty",
                                       "prompt is empty", too_long]
    for i in (0, 1, 3, 4, 5):
        assert outs[i].request_id == str(i) and [c.finish_reason for c in outs[i].outputs] == ["error"]
        assert outs[i].outputs[0].token_ids == [] and outs[i].outputs[0].error == outs[i].error
    assert outs[2].outputs[0].finish_reason in ("stop", "length") and outs[2].outputs[0].token_ids

    layout = InputLayout.from_schema(["id", "prompt"])
    rows = [build_request({"id": 1, "prompt": p}, layout, llm.tokenizer, SamplingParams(max_tokens=1),
                          use_chat_template=False, max_model_len=llm.max_model_len, vocab_size=llm.tokenizer.vocab_size,
                          context_bound=llm.context_bound)
            for p in ("   ", "\n\t ", "", long_text)]
    assert [r.error for r in rows] == ["prompt is empty", "prompt is empty", "prompt is empty", too_long]


def test_a_null_or_int_prompt_and_an_empty_stop_string_read_the_same_through_the_api_and_a_job(small_llm, tmp_path):
    """None, 12345 and stop="" give one message each, the same from LLM.generate (the error output) and from a
    job on the same engine (the error row): engine.config's prompt_type_error and stop_strings_error decide both."""
    import polars as pl

    from pipeline import JobSpec, run_job

    llm = small_llm
    want = ["prompt is null", "prompt must be a string, got int 12345", "stop cannot contain an empty string ('')"]
    p = SamplingParams(temperature=0, max_tokens=2)
    outs = llm.generate([None, 12345, "Hi", "Hi"], [p, p, SamplingParams(temperature=0, max_tokens=2, stop=""), p],
                        use_tqdm=False)
    assert [o.error for o in outs] == [*want, None]
    assert [o.outputs[0].finish_reason for o in outs[:3]] == ["error"] * 3

    inp = tmp_path / "in"
    inp.mkdir()
    pl.DataFrame({"id": [1, 3, 4], "prompt": [None, "Hi", "Hi"],
                  "stop": [None, "", None]}).write_parquet(inp / "a.parquet")
    pl.DataFrame({"id": [2], "prompt": [12345],
                  "stop": pl.Series([None], dtype=pl.String)}).write_parquet(inp / "b.parquet")
    report = run_job(JobSpec(input=str(inp), output=str(tmp_path / "out"), max_tokens=2, temperature=0,
                             chat_template=False, progress=False), llm)
    rows = pl.read_parquet(f"{tmp_path}/out/part-*.parquet").sort("id")
    assert rows["error"].to_list() == [*want, None]
    assert rows["finish_reason"].to_list()[:3] == ["error"] * 3
    assert (report.rows_ok, report.rows_error) == (1, 3)


def test_a_flat_list_of_token_ids_is_one_prompt_as_in_vllm(small_llm):
    """`generate([1, 2, 3])` gave three error outputs (`prompt must be a string, got int 1`, ...); vLLM
    reads a flat list of ints as one tokenized prompt, as `generate([[1, 2, 3]])` is here."""
    sp = SamplingParams(temperature=0, max_tokens=4)
    ids = small_llm.tokenizer.encode("The capital of France is", add_special_tokens=False)
    [want] = small_llm.generate([ids], sp, use_tqdm=False)
    for given in (ids, tuple(ids)):
        outs = small_llm.generate(given, sp, use_tqdm=False)
        assert len(outs) == 1 and outs[0].error is None
        assert outs[0].prompt_token_ids == want.prompt_token_ids == ids
        assert (outs[0].outputs[0].token_ids, outs[0].outputs[0].text) == (want.outputs[0].token_ids,
                                                                           want.outputs[0].text)
        assert len(want.outputs[0].token_ids) == 4
    [streamed] = list(small_llm.iter_outputs(ids, sp, use_tqdm=False))
    assert streamed.outputs[0].token_ids == want.outputs[0].token_ids
    # a list that mixes ints with other prompts is still a list of prompts: each int is refused as before
    mixed = small_llm.generate([ids[0], "Hello"], sp, use_tqdm=False)
    assert mixed[0].error == f"prompt must be a string, got int {ids[0]}" and mixed[1].error is None
    assert small_llm.generate([], sp, use_tqdm=False) == []


@pytest.mark.parametrize("conversations,said", [
    (None, "got NoneType None"),  # 'NoneType' object is not iterable
    ("hello", "got str 'hello'"),  # five conversations, one per character, each an error output
    (5, "got int 5"),  # 'int' object is not subscriptable
    ({"role": "user", "content": "x"}, "got one message dict {'content': 'x', 'role': 'user'}: wrap it in a list"),
])
def test_chat_refuses_what_is_not_a_conversation_list_naming_what_it_got(small_llm, conversations, said):
    with pytest.raises(TypeError) as exc:
        small_llm.chat(conversations, use_tqdm=False)
    assert str(exc.value).startswith("conversations must be a list of conversations or one conversation (a list of "
                                     "{role, content} dicts), ")
    assert str(exc.value).endswith(said)


def test_chat_refuses_unknown_roles_and_empty_contents_naming_the_message_like_a_job_row(small_llm):
    """A bogus role or an empty content makes that conversation an error output (at its index) naming the
    message, the field and the value; the job's `messages` rows say the same words for the same problem."""
    import json

    from pipeline.schema import InputLayout, build_request

    llm = small_llm
    roles = "['system', 'user', 'assistant']"  # SmolLM2's template handles no tool messages
    convs = [
        [{"role": "user", "content": "Hi"}],
        [{"role": "user", "content": "Hi"}, {"role": "wizard", "content": "Abracadabra"}],
        [{"role": "system", "content": ""}, {"role": "user", "content": "Hi"}],
        [{"role": "user", "content": "   "}],
        [{"role": "tool", "content": "42"}],
        [],
    ]
    want = [None,
            f"messages[1].role must be one of {roles}, got 'wizard'",
            "messages[0].content is empty ('')",
            "messages[0].content is empty ('   ')",
            f"messages[0].role must be one of {roles}, got 'tool'",
            "messages must be a non-empty list of {role, content}, got an empty list"]
    outs = llm.chat(convs, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert [o.request_id for o in outs] == [str(i) for i in range(len(convs))]
    assert [o.error for o in outs] == want
    assert outs[0].outputs[0].finish_reason in ("stop", "length") and outs[0].outputs[0].token_ids
    assert all(o.outputs[0].finish_reason == "error" and o.outputs[0].token_ids == [] for o in outs[1:])

    layout = InputLayout.from_schema(["id", "messages"])
    rows = [build_request({"id": i, "messages": json.dumps(c)}, layout, llm.tokenizer, SamplingParams(max_tokens=1),
                          max_model_len=llm.max_model_len).error for i, c in enumerate(convs)]
    assert rows == want


@pytest.mark.parametrize("n", [-1, 0, 1.5, True])
def test_a_bad_thread_count_is_refused_by_name_before_any_pool_is_touched(n):
    """num_threads must be a positive integer (None: the default); before, -1 reached
    torch.set_num_threads and came back as torch's own RuntimeError, after the job had written."""
    import torch

    from engine import LLM
    from engine.config import EngineConfig

    before = torch.get_num_threads()
    with pytest.raises(ValueError, match=r"num_threads must be a positive integer or None .*got " + re.escape(repr(n))):
        EngineConfig(model="smollm2-135m-instruct", num_threads=n)
    with pytest.raises(ValueError, match="num_threads must be a positive integer"):
        LLM(num_threads=n)
    assert torch.get_num_threads() == before
    from engine.threads import available_cpus

    cpus = available_cpus()
    assert EngineConfig(model="smollm2-135m-instruct", num_threads=cpus).num_threads == cpus
    with pytest.raises(ValueError, match=f"num_threads={cpus + 1} is more than the {cpus} CPUs this process may use"):
        LLM(num_threads=cpus + 1)
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("kw,why", [({"dtype": "bfloat16"}, "here: dtype bfloat16"),
                                    ({"cpu_kernels": False}, "here: cpu_kernels=False")])
def test_w8a8_where_it_cannot_run_says_which_setting_stops_it(kw, why):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: w8a8 runs there")
    with pytest.raises(ValueError) as exc:
        LLM("smollm2-135m-instruct", quantization="w8a8", device="cpu", **kw)
    assert str(exc.value).startswith("quantization='w8a8' runs on the CPU kernels") and why in str(exc.value)


def test_a_prompt_with_a_lone_surrogate_is_an_error_output_and_spares_the_batch(small_llm):
    """A str that is not valid Unicode ("\\ud800") made the tokenizer raise for the whole generate call."""
    sp = SamplingParams(temperature=0, max_tokens=3)
    bad, good = small_llm.generate(["ok\ud800bad", "Hello"], sp, use_tqdm=False)
    assert bad.error == "prompt is not valid Unicode text ('\\ud800' at character 2: surrogates not allowed)"
    assert bad.outputs[0].finish_reason == "error"
    ref = small_llm.generate(["Hello"], sp, use_tqdm=False)[0]
    assert good.error is None and good.outputs[0].token_ids == ref.outputs[0].token_ids


@pytest.mark.parametrize("kwargs,message", [
    ({"seed": "x"}, "seed must be an integer, got 'x'"),
    ({"seed": 1.5}, "seed must be an integer, got 1.5"),
    ({"enable_prefix_caching": "no"}, "enable_prefix_caching must be True or False, got 'no'"),
])
def test_engine_seed_and_switches_are_checked_at_construction(kwargs, message):
    from engine.config import EngineConfig

    with pytest.raises(ValueError, match=re.escape(message)):
        EngineConfig(**kwargs)


def test_a_seed_outside_64_bits_is_refused_naming_the_range(small_llm):
    """SamplingParams(seed=2**80) ran (the sampler mixes a seed modulo 2**64: it drew what seed 0 draws)
    while a job refused seeds above 2**62. Engine, request and job now take the same 64-bit range."""
    from engine.config import EngineConfig

    for seed in (2 ** 63 - 1, -(2 ** 63), 2 ** 62 + 1):
        assert SamplingParams(seed=seed).validate() is None
        assert EngineConfig(seed=seed).seed == seed
    for seed in (2 ** 80, 2 ** 63, -(2 ** 63) - 1):
        message = f"seed must be in [-2**63, 2**63 - 1] (a 64-bit integer), got {seed}"
        assert SamplingParams(seed=seed).validate() == message
        with pytest.raises(ValueError, match=re.escape(message)):
            EngineConfig(seed=seed)
    bad, good = small_llm.generate(["Hello", "Hello"], [SamplingParams(seed=2 ** 80, max_tokens=2),
                                                        SamplingParams(seed=2 ** 63 - 1, max_tokens=2)], use_tqdm=False)
    assert bad.error == "seed must be in [-2**63, 2**63 - 1] (a 64-bit integer), got 1208925819614629174706176"
    assert bad.outputs[0].finish_reason == "error"
    assert good.error is None and len(good.outputs[0].token_ids) == 2


def test_scoring_refuses_bad_token_ids_and_choices_naming_the_parameter(small_llm):
    """score and score_choices raise a TypeError or ValueError naming the parameter (and the item by
    index), where they raised IndexError, a bare int() ValueError, or returned {} / dropped a repeat."""
    import torch

    llm = small_llm
    vocab = llm.tokenizer.vocab_size
    ids = llm.tokenizer.encode("The answer is")
    free = llm.num_free_blocks

    def raised(kind, call) -> str:
        with pytest.raises(kind) as exc:
            call()
        return str(exc.value)

    outside = f"is outside the vocabulary [0, {vocab})"
    assert raised(ValueError, lambda: llm.score([10**9])) == f"token_ids[0]: token id 1000000000 {outside}"
    assert raised(ValueError, lambda: llm.score([1, -5])) == f"token_ids[1]: token id -5 {outside}"
    assert raised(TypeError, lambda: llm.score("hello")) == (
        "token_ids must be a list of token ids (ints), got str 'hello'; tokenize text first (llm.tokenizer.encode)")
    assert raised(ValueError, lambda: llm.score([[1, 2], []])) == "token_ids[1] is empty: give at least one token id"
    assert raised(TypeError, lambda: llm.score([[1, 2], [3, "a"]])) == (
        "token_ids[1][1] must be a token id (int), got str 'a'")
    assert llm.score([]) == []  # no sequences
    assert torch.equal(llm.score(torch.tensor(ids))[0], llm.score(ids)[0])  # a tensor of ids is taken too

    sc = "score_choices: "
    assert raised(ValueError, lambda: llm.score_choices([], ["yes"])) == (
        sc + "prompt_token_ids is empty: give at least one token id")
    assert raised(ValueError, lambda: llm.score_choices(ids, [])) == sc + "choices is empty: give at least one choice"
    assert raised(ValueError, lambda: llm.score_choices(ids, ["yes", "no", "yes"])) == (
        sc + "choices[2] 'yes' repeats choices[0]")
    assert raised(TypeError, lambda: llm.score_choices("hello", ["yes"])) == (
        sc + "prompt_token_ids must be a list of token ids (ints), got str 'hello'; tokenize text first "
             "(llm.tokenizer.encode)")
    assert raised(ValueError, lambda: llm.score_choices([10**9], ["yes"])) == (
        sc + f"prompt_token_ids[0]: token id 1000000000 {outside}")
    assert raised(TypeError, lambda: llm.score_choices(ids, "ab")) == sc + "choices must be a list of strings, got str 'ab'"
    assert raised(TypeError, lambda: llm.score_choices(ids, ["yes", 5])) == sc + "choices[1] must be a string, got int 5"

    good = llm.score_choices(ids, ["yes", "no"])
    out = llm.score_choices_batch([(ids, ["yes", "no"]), ([], ["a"]), (ids, []), (ids, ["x", "x"]), ("hello", ["a"]),
                                   ([10**9], ["a"]), "junk", (ids, ("yes", "no"))])
    assert out[1:7] == [
        sc + "items[1] prompt is empty: give at least one token id",
        sc + "items[2] choices is empty: give at least one choice",
        sc + "items[3] choices[1] 'x' repeats items[3] choices[0]",
        sc + "items[4] prompt must be a list of token ids (ints), got str 'hello'; tokenize text first "
             "(llm.tokenizer.encode)",
        sc + f"items[5] prompt[0]: token id 1000000000 {outside}",
        sc + "items[6] must be a (prompt token ids, choices) pair, got str 'junk'",
    ]
    assert list(good) == ["yes", "no"] and out[0] == out[7] == good  # the bad items spare the batch
    assert llm.num_free_blocks == free


def test_generate_refuses_prompts_and_sampling_params_of_the_wrong_type_naming_what_it_takes(small_llm):
    """A dict or a string as sampling_params, or None (a number, bytes) as prompts, is a TypeError; a dict was
    taken as its keys (one error output per key, or a length mismatch) and None was `'NoneType' object is not
    iterable`. (A dict as prompts is one vLLM prompt dict: test_vllm_prompt_dicts_...) A prompt inside the list that is None stays an error output (`prompt is null`), as a job row."""
    llm = small_llm
    sp = SamplingParams(temperature=0, max_tokens=1)

    def raised(call) -> str:
        with pytest.raises(TypeError) as exc:
            call()
        return str(exc.value)

    takes = "sampling_params must be a SamplingParams or a sequence of them, one per prompt (None: the defaults), got "
    assert raised(lambda: llm.generate(["Hi"], {"max_tokens": 2}, use_tqdm=False)) == (
        takes + "dict {'max_tokens': 2}; build one with SamplingParams(**...)")
    assert raised(lambda: llm.generate(["Hi", "Yo"], "ab", use_tqdm=False)) == takes + "str 'ab'"
    assert raised(lambda: llm.generate(["Hi"], 5, use_tqdm=False)) == takes + "int 5"
    prompts = ("prompts must be a string or a sequence of prompts (strings, lists of token ids or prompt dicts), "
               "got ")
    assert raised(lambda: llm.generate(None, sp, use_tqdm=False)) == prompts + "NoneType None"
    assert raised(lambda: llm.generate(5, sp, use_tqdm=False)) == prompts + "int 5"
    assert raised(lambda: llm.generate(b"Hi", sp, use_tqdm=False)) == prompts + "bytes b'Hi'"
    assert raised(lambda: list(llm.iter_outputs(None, sp, use_tqdm=False))) == prompts + "NoneType None"

    # what vLLM takes still works: one SamplingParams, a sequence of them (any kind), None for the defaults
    ref = llm.generate(["Hi"], sp, use_tqdm=False)[0].outputs[0].token_ids
    for params in ([sp], (sp,), (p for p in [sp])):
        assert llm.generate(("Hi",), params, use_tqdm=False)[0].outputs[0].token_ids == ref
    assert len(llm.generate((p for p in ["Hi"]), None, use_tqdm=False)) == 1
    outs = llm.generate([None, "Hi"], [sp, None], use_tqdm=False)
    assert [o.error for o in outs] == ["prompt is null", "sampling_params: expected SamplingParams, got NoneType"]


def test_a_huge_n_is_refused_naming_the_limit_in_the_api_and_a_job(small_llm, tmp_path):
    """n = 10**9 was accepted: a job took its lease and built a Sequence per completion until the
    machine ran out of memory. It is now an error output (API) and a refused option (job)."""
    from engine.config import MAX_N
    from pipeline import JobSpec, validate_spec

    assert SamplingParams(n=MAX_N).validate() is None
    message = f"n must be at most {MAX_N:,} (completions per prompt), got 1,000,000,000"
    assert SamplingParams(n=10 ** 9).validate() == message
    bad, good = small_llm.generate(["Hello", "Hello"], [SamplingParams(n=10 ** 9, max_tokens=2),
                                                        SamplingParams(n=2, max_tokens=2)], use_tqdm=False)
    assert bad.error == message and bad.outputs[0].finish_reason == "error"
    assert good.error is None and len(good.outputs) == 2
    with pytest.raises(ValueError, match=re.escape(message)):
        validate_spec(JobSpec(input=str(tmp_path / "in.parquet"), output=str(tmp_path / "out"), n=10 ** 9))


def test_vllm_prompt_dicts_get_tokenizer_and_cumulative_logprob(small_llm):
    """vLLM's prompt dicts work as its strings and token lists do: `{"prompt": text}` is the text,
    `{"prompt_token_ids": ids}` the ids (its "prompt", if given, only reported back), one dict alone is one
    prompt; a dict with another key or neither is an error output naming it. `get_tokenizer()` is the HF
    tokenizer. With logprobs, `cumulative_logprob` is the sum of the sampled tokens' logprobs; without, None."""
    llm = small_llm
    sp = SamplingParams(temperature=0, max_tokens=4)
    text = "The capital of France is"
    [want] = llm.generate([text], sp, use_tqdm=False)
    ids = want.prompt_token_ids
    outs = llm.generate([{"prompt": text}, {"prompt_token_ids": ids}, {"prompt_token_ids": tuple(ids), "prompt": "x"},
                         {"prompt": text, "multi_modal_data": {}}, {}, {"prompt_token_ids": "1 2"}, {"prompt": None}],
                        sp, use_tqdm=False)
    for o in outs[:3]:
        assert o.error is None and o.prompt_token_ids == ids and o.outputs[0].token_ids == want.outputs[0].token_ids
    assert [o.prompt for o in outs[:3]] == [text, None, "x"]
    assert [o.error for o in outs[3:]] == [
        "prompt: unsupported key(s) ['multi_modal_data']; a prompt dict takes 'prompt' (text) or 'prompt_token_ids'",
        "prompt: a prompt dict needs 'prompt' (text) or 'prompt_token_ids', got an empty dict",
        "prompt_token_ids: must be a list of token ids (ints), got '1 2'",
        "prompt is null"]
    [single] = llm.generate({"prompt_token_ids": ids}, sp, use_tqdm=False)
    assert single.outputs[0].token_ids == want.outputs[0].token_ids
    [streamed] = list(llm.iter_outputs({"prompt": text}, sp, use_tqdm=False))
    assert streamed.outputs[0].token_ids == want.outputs[0].token_ids

    hf = llm.get_tokenizer()
    assert hf is llm.tokenizer.hf and hf.encode(text) == llm.tokenizer.encode(text)
    assert hf.decode(want.outputs[0].token_ids) == want.outputs[0].text

    assert want.outputs[0].cumulative_logprob is None
    [lp] = llm.generate([text], SamplingParams(temperature=0, max_tokens=4, logprobs=2), use_tqdm=False)
    c = lp.outputs[0]
    assert c.token_ids == want.outputs[0].token_ids and len(c.logprobs) == 4
    picked = [step[t] for t, step in zip(c.token_ids, c.logprobs)]
    assert c.cumulative_logprob == pytest.approx(sum(picked), abs=1e-6) and c.cumulative_logprob < 0


def test_prompt_logprobs_match_score_and_the_logits_and_leave_generation_as_it_was(small_llm):
    """`SamplingParams(prompt_logprobs=k)`: per prompt token after the first, a dict of the token's own logprob
    (exactly `LLM.score`'s) and the k most likely tokens (those of log_softmax(compute_logits(prefix)));
    entry 0 is None, as in vLLM. The completion is the one generated without it; k outside [0, 20] is an
    error output naming the parameter."""
    llm = small_llm
    free = llm.num_free_blocks
    ids = llm.tokenizer.encode("The capital of France is Paris, and the capital of Spain is")
    other = llm.tokenizer.encode("Once upon a time")
    plain = llm.generate([ids], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    outs = llm.generate([ids, other, ids], [SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=3),
                                            SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=0),
                                            SamplingParams(temperature=0, max_tokens=4)], use_tqdm=False)
    got, zero, none = outs
    assert got.outputs[0].token_ids == plain.outputs[0].token_ids == none.outputs[0].token_ids
    assert none.prompt_logprobs is None and plain.prompt_logprobs is None
    assert len(got.prompt_logprobs) == len(ids) and got.prompt_logprobs[0] is None
    [want] = llm.score([ids])
    assert [d[t] for d, t in zip(got.prompt_logprobs[1:], ids[1:])] == want.tolist()
    [want_other] = llm.score([other])
    assert zero.prompt_logprobs[0] is None
    assert [list(d) for d in zero.prompt_logprobs[1:]] == [[t] for t in other[1:]]
    assert [d[t] for d, t in zip(zero.prompt_logprobs[1:], other[1:])] == want_other.tolist()
    for t in (1, 5, len(ids) - 1):
        ref = torch.log_softmax(llm.compute_logits(ids[:t]).float(), dim=-1).topk(3)
        d = got.prompt_logprobs[t]
        top = sorted(d.items(), key=lambda kv: -kv[1])
        assert set(ref.indices.tolist()) <= set(d) and len(d) in (3, 4)  # the prompt's token may be a 4th
        for tok, v in zip(ref.indices.tolist(), ref.values.tolist()):
            assert d[tok] == pytest.approx(v, abs=1e-4)
        assert top[0][0] == ref.indices[0].item()
    bad = llm.generate([ids] * 3, [SamplingParams(prompt_logprobs=v) for v in (-1, 21, "2")], use_tqdm=False)
    assert [o.error for o in bad] == [f"prompt_logprobs must be an integer in [0, 20] or None, got {v!r}"
                                      for v in (-1, 21, "2")]
    assert llm.num_free_blocks == free  # the scoring pass's scratch blocks are all returned


def test_a_max_model_len_past_the_models_context_is_refused_naming_both():
    """`LLM(max_model_len=10**8)` was capped to the model's 8192 tokens without a word (vLLM refuses it);
    the model's own context is accepted."""
    from engine import LLM

    with pytest.raises(ValueError) as exc:
        LLM("smollm2-135m-instruct", max_model_len=10 ** 8, kv_cache_memory_bytes=16 << 20, speculative=None)
    assert str(exc.value) == ("max_model_len=100000000 is more than the model's context (8192 tokens, its "
                              "max_position_embeddings); give at most 8192, or leave it unset for the model's")
    with LLM("smollm2-135m-instruct", max_model_len=8192, kv_cache_memory_bytes=16 << 20, speculative=None) as llm:
        # the model's 8192, or what the 16 MiB cache holds when that is less
        assert llm.max_model_len == min(8192, llm.num_total_blocks * llm.config.block_size)


def test_attention_settings_that_cannot_run_here_are_refused_in_one_line(monkeypatch):
    """Triton on a CPU outside its interpreter failed deep in Triton's launcher ("0 active drivers");
    the CPU's grouped bf16 cache with Triton or on CUDA is refused by the config."""
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: attention_backend='triton' runs here")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"^attention_backend='triton' runs on CUDA \(on the CPU only under "
                                         r"TRITON_INTERPRET=1, for tests\); use attention_backend='auto' or 'torch'"):
        LLM("smollm2-135m-instruct", attention_backend="triton", kv_cache_memory_bytes=16 << 20)
    for kw in ({"attention_backend": "triton"}, {"device": "cuda"}):
        with pytest.raises(ValueError, match=r"^kv_cache_dtype='bf16' is the CPU's grouped bf16 cache .* use "
                                             r"kv_cache_dtype='auto'$"):
            LLM("smollm2-135m-instruct", kv_cache_dtype="bf16", **kw)


def test_the_too_long_error_names_what_sets_the_context(small_llm):
    """A context cut by the KV budget was reported as "the model's context (max_model_len)", so users raised
    max_model_len in vain: the error names the bound that applies (`engine.loader.context_bound`), each of the
    four, and the API and a job's row say the same."""
    import dataclasses

    from engine.config import EngineConfig
    from engine.loader import context_bound, context_length, min_kv_cache_memory_bytes
    from engine.weights import PRESETS
    from pipeline.schema import InputLayout, build_request

    mcfg = dataclasses.replace(PRESETS["llama-tiny-4kv"], max_position_embeddings=256)
    cfg = EngineConfig(model="dummy:llama-tiny-4kv", device="cpu")
    block = min_kv_cache_memory_bytes(cfg, mcfg)
    cases = [(cfg, "the model's trained context", 256),
             (dataclasses.replace(cfg, max_model_len=100), "the max_model_len=100 option", 100),
             (dataclasses.replace(cfg, max_model_len=100, kv_cache_memory_bytes=3 * block),
              f"what the KV cache holds (kv_cache_memory_bytes={3 * block}; raise it for longer prompts)", 48),
             (dataclasses.replace(cfg, enable_chunked_prefill=False, max_num_batched_tokens=80),
              "max_num_batched_tokens=80, without chunked prefill", 80)]
    for c, words, length in cases:
        assert (context_bound(c, mcfg), context_length(c, mcfg)) == (words, length)

    # the API and a job's row on a real engine whose KV budget is the bound
    budget = 2 * KV_BYTES_PER_BLOCK
    llm = LLM(MODEL, kv_cache_memory_bytes=budget, kv_cache_dtype="fp32")
    assert llm.max_model_len == 32
    text = "Four score and seven years ago our fathers brought forth " * 4
    n = len(llm.tokenizer.encode(text))
    assert n > 32
    want = (f"prompt is too long: {n} tokens, and the engine's context (max_model_len) is 32 tokens, set by what the "
            f"KV cache holds (kv_cache_memory_bytes={budget}; raise it for longer prompts), which leaves no room for "
            f"output")
    [out] = llm.generate([text], SamplingParams(max_tokens=2), use_tqdm=False)
    assert out.error == want
    row = build_request({"id": 1, "prompt": text}, InputLayout.from_schema(["id", "prompt"]), llm.tokenizer,
                        SamplingParams(max_tokens=1), use_chat_template=False, max_model_len=llm.max_model_len,
                        vocab_size=llm.tokenizer.vocab_size, context_bound=llm.context_bound)
    assert row.error == want


def test_the_context_room_warning_counts_the_prompt_in_words():
    from engine.input_processor import max_tokens_past_context_warning

    assert max_tokens_past_context_warning(1, 10, 8) == (
        "max_tokens=10 is more than the context leaves after the prompt (1 token of max_model_len=8, room for 7): "
        "such requests stop at the end of the context with finish_reason 'length' (said once per LLM)")
    assert "(3 tokens of max_model_len=8, room for 5)" in max_tokens_past_context_warning(3, 10, 8)
    assert max_tokens_past_context_warning(3, 5, 8) is None and max_tokens_past_context_warning(3, None, 8) is None
