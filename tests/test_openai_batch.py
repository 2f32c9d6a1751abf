"""OpenAI Batch files through `tokenmill run`: request lines in, result and error lines out.

- A request file with every body field the job maps (chat and completions, text parts, token-id
  prompts, sampling fields, logprobs, response_format json_object / json_schema, vLLM's extra fields
  and guided_*), a line with `n` = 3 and a seed (3 choices), and bad lines: not JSON, no custom_id, a
  repeated custom_id, `tools`, a wrong model. Every good line has one result line that validates with
  the `openai` package's own types (ChatCompletion, Completion); every bad line one error line naming the
  problem and its line; greedy lines equal the same prompts given as Parquet; json_schema responses
  validate against their schema; usage adds up to the cost report, whose request_counts validate as
  `openai.types.BatchRequestCounts`.
- The same file on S3 (moto), the run interrupted after its first committed shard, then run again:
  every custom_id exactly once across results and errors.
"""
from __future__ import annotations

import json

import jsonschema
import polars as pl
import pytest
from openai.types import BatchRequestCounts, Completion
from openai.types.chat import ChatCompletion

from engine import SamplingParams
from pipeline import JobSpec, io, read_metrics, run_job
from pipeline.bookkeeping import JobInterrupted
from pipeline.cli import main
from pipeline.openai_batch import LineError, parse_request, parse_request_lines

try:
    from tests.s3_server import job_llm, s3_bucket, s3_server  # noqa: F401  (pytest fixtures)
except ImportError:  # tests/ is not a package: pytest puts it on sys.path
    from s3_server import job_llm, s3_bucket, s3_server  # noqa: F401

MODEL = "smollm2-135m-instruct"
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}, "sure": {"type": "boolean"}},
          "required": ["city", "sure"]}
GREEDY = ("g-chat", "g-parts", "g-text", "g-ids")


def _line(cid, url, body, **extra) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body, **extra})


def request_lines(tokenizer) -> tuple[list[str], dict[str, str]]:
    """(the file's lines, bad custom_id or line label -> the words its error must hold)."""
    user = [{"role": "user", "content": "Name the capital of France."}]
    good = [
        _line("g-chat", CHAT, {"model": MODEL, "messages": [{"role": "system", "content": "Be brief."}, *user],
                               "max_tokens": 6, "temperature": 0}),
        # text parts, a tiny temperature (greedy), max_completion_tokens, stop, seed, an unknown field
        _line("g-parts", CHAT, {"model": "HuggingFaceTB/SmolLM2-135M-Instruct", "messages": [
            {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
            {"role": "user", "content": [{"type": "text", "text": "Name the capital"},
                                         {"type": "text", "text": "of Italy."}]}],
            "max_completion_tokens": 6, "max_tokens": 99, "temperature": 1e-6, "stop": ["\n\n"], "seed": 3,
            "some_new_field": {"ignored": True}}),
        _line("g-text", COMPLETIONS, {"model": MODEL, "prompt": "The largest planet is", "max_tokens": 6,
                                      "temperature": 0, "logprobs": 2}),
        _line("g-ids", COMPLETIONS, {"prompt": tokenizer.encode("Water boils at"), "max_tokens": 4, "temperature": 0}),
        _line("sampled", CHAT, {"messages": user, "max_tokens": 6, "temperature": 0.8, "top_p": 0.9, "seed": 7,
                                "presence_penalty": 0.5, "frequency_penalty": 0.3, "top_k": 20, "min_p": 0.05,
                                "repetition_penalty": 1.1, "logprobs": True, "top_logprobs": 3}),
        _line("n3", CHAT, {"messages": [{"role": "user", "content": "Write one random word."}], "max_tokens": 5,
                           "n": 3, "seed": 11, "temperature": 1.5}),
        _line("schema", CHAT, {"messages": [{"role": "user", "content": "Which city is the capital of France? "
                                                                         "Answer in JSON."}],
                               "max_tokens": 30, "temperature": 0,
                               "response_format": {"type": "json_schema", "json_schema": {
                                   "name": "capital", "schema": SCHEMA, "strict": True}}}),
        _line("object", CHAT, {"messages": user, "max_tokens": 12, "temperature": 0,
                               "response_format": {"type": "json_object"}}),
        _line("g-choice", CHAT, {"messages": user, "max_tokens": 4, "temperature": 0, "guided_choice": ["yes", "no"]}),
        _line("g-regex", CHAT, {"messages": user, "max_tokens": 6, "temperature": 0, "guided_regex": "[0-9]{3}"}),
        _line("g-json", CHAT, {"messages": user, "max_tokens": 30, "temperature": 0, "guided_json": SCHEMA}),
        _line("so", COMPLETIONS, {"prompt": "My favourite colour is", "max_tokens": 4, "temperature": 0,
                                  "structured_outputs": {"choice": ["red", "blue"]}}),
    ]
    bad = {
        "line 13": "not valid JSON",
        "line 14": "no custom_id",
        "line 15": "custom_id 'g-chat' repeats line 1's",
        "tools": "body.tools is not supported",
        "wrong-model": "model 'gpt-4o' is not this job's model",
    }
    lines = good + [
        '{"custom_id": "broken", "body": {',
        _line(None, CHAT, {"messages": user}),
        _line("g-chat", CHAT, {"messages": user}),
        _line("tools", CHAT, {"messages": user, "tools": [{"type": "function", "function": {"name": "f"}}]}),
        _line("wrong-model", CHAT, {"model": "gpt-4o", "messages": user}),
    ]
    return lines, bad


def read_jsonl(output: str, prefix: str, so=None) -> list[dict]:
    names = sorted(n for n in io.list_names(output, so) if n.startswith(prefix) and n.endswith(".jsonl"))
    fs, _ = io.filesystem(output, so)
    out = []
    for n in names:
        _, path = io.filesystem(io.join(output, n), so)
        out += [json.loads(x) for x in fs.cat_file(path).decode().splitlines() if x.strip()]
    return out


def check_result(line: dict) -> ChatCompletion | Completion:
    assert set(line) == {"id", "custom_id", "response", "error"} and line["error"] is None
    assert line["response"]["status_code"] == 200 and line["response"]["request_id"]
    body = line["response"]["body"]
    model = ChatCompletion if body["object"] == "chat.completion" else Completion
    return model.model_validate(body, strict=True)


def test_a_request_file_through_tokenmill_run(tmp_path, job_llm, capsys):
    tok = job_llm.tokenizer
    lines, bad = request_lines(tok)
    (tmp_path / "requests.jsonl").write_text("\n".join(lines) + "\n\n")
    out = tmp_path / "out"
    rc = main(["run", "--input", str(tmp_path / "requests.jsonl"), "--output", str(out), "--no-progress",
               "--shard-size", "5", "--output-format", "parquet,jsonl"])
    assert rc == 0
    assert "results-*.jsonl" in capsys.readouterr().out
    results, errors = read_jsonl(str(out), "results-"), read_jsonl(str(out), "errors-")
    by_id = {r["custom_id"]: r for r in results}
    assert sorted(by_id) == sorted(["g-chat", "g-parts", "g-text", "g-ids", "sampled", "n3", "schema", "object",
                                    "g-choice", "g-regex", "g-json", "so"])
    assert len(results) == 12 and len(errors) == 5
    bodies = {cid: check_result(r) for cid, r in by_id.items()}
    # every bad line: one error line naming the problem (and the line), never a result
    for e in errors:
        assert e["response"]["status_code"] == 400 and e["error"]["message"] == \
            e["response"]["body"]["error"]["message"]
    messages = [e["error"]["message"] for e in errors]
    for key, words in bad.items():
        hits = [m for m in messages if words in m and (key in m if key.startswith("line") else True)]
        assert len(hits) == 1, (key, messages)
    assert {e["custom_id"] for e in errors} == {None, "tools", "wrong-model"}
    assert sorted(e["error"]["code"] for e in errors) == ["duplicate_custom_id", "invalid_json", "missing_custom_id",
                                                         "model_not_found", "unsupported_field"]
    # the fields arrived: choices, logprobs, constraints, stop
    assert len(bodies["n3"].choices) == 3 and len({c.message.content for c in bodies["n3"].choices}) > 1
    assert bodies["g-text"].choices[0].logprobs.top_logprobs[0] and \
        len(bodies["g-text"].choices[0].logprobs.tokens) == 6
    lp = bodies["sampled"].choices[0].logprobs.content
    assert len(lp) == bodies["sampled"].usage.completion_tokens and all(len(t.top_logprobs) == 3 for t in lp)
    assert bodies["g-choice"].choices[0].message.content in ("yes", "no")
    assert bodies["so"].choices[0].text in ("red", "blue")
    regex = bodies["g-regex"].choices[0].message.content
    assert len(regex) == 3 and regex.isdigit()
    for cid in ("schema", "g-json"):
        choice = bodies[cid].choices[0]
        assert choice.finish_reason == "stop", cid
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    assert isinstance(json.loads(bodies["object"].choices[0].message.content or "{}"), dict) or \
        bodies["object"].choices[0].finish_reason == "length"
    # usage adds up to the cost report; request_counts as OpenAI counts them
    report = read_metrics(str(out)).row(-1, named=True)
    assert sum(b.usage.prompt_tokens for b in bodies.values()) == report["prompt_tokens"]
    assert sum(b.usage.completion_tokens for b in bodies.values()) == report["completion_tokens"]
    assert sum(b.usage.prompt_tokens_details.cached_tokens for b in bodies.values()) == report["cached_tokens"] > 0
    counts = BatchRequestCounts.model_validate_json(report["request_counts"])
    assert (counts.total, counts.completed, counts.failed) == (17, 12, 5)
    # each part's lines follow the input lines
    parts = sorted(p.name for p in out.glob("results-*.jsonl"))
    for name in parts:
        ids = [json.loads(x)["custom_id"] for x in (out / name).read_text().splitlines()]
        order = [next(i for i, x in enumerate(lines) if f'"custom_id": "{c}"' in x) for c in ids]
        assert order == sorted(order)
    # greedy lines equal the same prompts given as Parquet
    rows = []
    for raw in lines[:3]:  # (g-ids, a token-id prompt, is compared with LLM.generate below)
        req = json.loads(raw)
        body, chat = req["body"], req["url"] == CHAT
        rows.append({"id": req["custom_id"], "messages": parse_request(req).get("messages"),
                     "prompt": None if chat else body["prompt"], "chat_template": None if chat else False,
                     "stop": [body["stop"]] if isinstance(body.get("stop"), str) else body.get("stop"),
                     "max_tokens": body.get("max_completion_tokens") or body["max_tokens"]})
    pl.DataFrame(rows, schema={"id": pl.Utf8, "messages": pl.Utf8, "prompt": pl.Utf8, "chat_template": pl.Boolean,
                               "stop": pl.List(pl.Utf8), "max_tokens": pl.Int64}).write_parquet(tmp_path / "same.parquet")
    assert main(["run", "--input", str(tmp_path / "same.parquet"), "--output", str(tmp_path / "pq"),
                 "--no-progress"]) == 0
    parquet = pl.read_parquet(tmp_path / "pq" / "part-*.parquet")
    for cid, text in zip(parquet["id"], parquet["generation"]):
        body = bodies[cid]
        got = body.choices[0].text if isinstance(body, Completion) else body.choices[0].message.content
        assert got == text and len(got) > 3, cid
    ids = tok.encode("Water boils at")
    want = job_llm.generate([ids], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0].outputs[0].text
    assert bodies["g-ids"].choices[0].text == want
    # the Parquet output holds the same rows, and the part files of a jsonl-only job go under _job/parts/
    assert sorted(pl.read_parquet(out / "part-*.parquet")["custom_id"].drop_nulls()) == \
        sorted([*by_id, "tools", "wrong-model"])


def test_the_same_file_on_s3_interrupted_after_a_shard_then_resumed(s3_bucket, tmp_path, job_llm):
    lines, _ = request_lines(job_llm.tokenizer)
    src = f"s3://{s3_bucket}/in/requests.jsonl.gz"
    import gzip

    io.write_bytes(src, gzip.compress(("\n".join(lines) + "\n").encode()))
    spec = JobSpec(input=f"s3://{s3_bucket}/in/", output=f"s3://{s3_bucket}/out", shard_size=4,
                   shards_in_flight=1, progress=False, plan="input")
    done = []

    def stop_after_first(result):
        done.append(result.index)
        raise KeyboardInterrupt

    with pytest.raises(JobInterrupted):
        run_job(spec, job_llm, on_shard_done=stop_after_first)
    assert done == [0]
    assert len(read_jsonl(spec.output, "results-")) + len(read_jsonl(spec.output, "errors-")) == 4
    report = run_job(spec, job_llm)
    assert report.rows_skipped == 4 and report.rows_ok + report.rows_error == len(lines) - 4
    results, errors = read_jsonl(spec.output, "results-"), read_jsonl(spec.output, "errors-")
    ids = [r["custom_id"] for r in results + errors if r["custom_id"] is not None]
    assert sorted(ids) == sorted(set(ids)) and len(results) == 12 and len(results) + len(errors) == len(lines)
    assert not any(n.startswith("part-") for n in io.list_names(spec.output))  # jsonl only: parts under _job/
    assert json.loads(report.request_counts) == {"total": 17, "completed": 12, "failed": 5}
    for r in results:
        check_result(r)


def test_an_error_line_names_its_request_line_whoever_refused_it():
    """A value the engine refuses (its message has no line) gets the request's line, as the parser's own
    messages have; a message that names its line already is kept as it is."""
    from pipeline.openai_batch import error_line

    engine = error_line({"custom_id": "q7", "line": 7, "error": "temperature must be a finite number >= 0, got -1"},
                        "k")
    assert engine["error"]["message"] == "line 7: temperature must be a finite number >= 0, got -1"
    assert engine["response"]["body"]["error"]["message"] == engine["error"]["message"]
    for parsed in ("line 3: not valid JSON (Expecting value at column 1)", "b.jsonl line 2: body must be a JSON object"):
        assert error_line({"custom_id": None, "line": 3, "error": parsed}, "k")["error"]["message"] == parsed


def test_parse_lines_names_each_problem_and_maps_the_body():
    lines = [b'{"custom_id": "a", "url": "/v1/embeddings", "body": {}}',
             _line("b", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}),
             _line("c", CHAT, {"messages": [{"role": "user", "content": "x"}], "stream": True}),
             _line("d", COMPLETIONS, {"prompt": "x", "logprobs": 3, "stop": "END", "max_tokens": 7})]
    rows = parse_request_lines(lines, {"m"})
    assert [r["error_code"] for r in rows] == ["invalid_url", "unsupported_field", "unsupported_field", None]
    assert "line 2: body.messages[0].content[0] is a 'image_url' part" in rows[1]["request_error"]
    assert rows[2]["request_error"] == "line 3: body.stream is not supported by tokenmill"
    assert json.loads(rows[3]["sampling_params"]) == {"logprobs": 3, "max_tokens": 7, "n": 1, "stop": ["END"],
                                                      "temperature": 1.0, "top_p": 1.0}
    with pytest.raises(LineError, match="at most one output constraint"):
        parse_request({"custom_id": "x", "url": CHAT, "body": {"messages": [{"role": "user", "content": "x"}],
                                                                "guided_regex": "a", "guided_choice": ["a"]}})


def test_a_custom_id_that_is_not_a_string_or_a_line_that_is_not_an_object_is_refused():
    """42 was made "42", so a later line whose custom_id was the string "42" lost its request as a duplicate,
    and the result line's custom_id changed type; OpenAI's custom_id is a string. A line holding an array
    was reported as having no custom_id."""
    lines = [_line(42, COMPLETIONS, {"prompt": "a"}), _line("42", COMPLETIONS, {"prompt": "a"}), "[1, 2, 3]",
             _line(True, COMPLETIONS, {"prompt": "a"}), _line(None, COMPLETIONS, {"prompt": "a"})]
    rows = parse_request_lines(lines, {"m"})
    assert [(r["custom_id"], r["error_code"], r["request_error"]) for r in rows] == [
        (None, "invalid_request", "line 1: custom_id must be a string, got number 42"),
        ("42", None, None),
        (None, "invalid_request", "line 3: a request line must be a JSON object, got array"),
        (None, "invalid_request", "line 4: custom_id must be a string, got boolean true"),
        (None, "missing_custom_id", "line 5: no custom_id (each request line needs a custom_id string)")]
    with pytest.raises(LineError, match="^a request line must be a JSON object, got array$"):
        parse_request([1, 2, 3])  # its own callers get the same words


def test_a_byte_order_mark_before_the_first_line_is_not_part_of_it(tmp_path):
    """A request file that a Windows tool wrote with a UTF-8 byte-order mark lost its first request
    (`line 1: not valid JSON (Unexpected UTF-8 BOM ...)`; found by a new-user trial); the mark is read as
    the file's, not the line's, in request and result files, and so is one that starts a later line."""
    from pipeline.convert import convert

    first, second = _line("a", COMPLETIONS, {"prompt": "x"}), _line("b", COMPLETIONS, {"prompt": "y"})
    rows = parse_request_lines([b"\xef\xbb\xbf" + first.encode(), b"\xef\xbb\xbf" + second.encode()], {"m"})
    # the second mark is where two such files were joined: the line is read too (it was an invalid_json row
    # without its custom_id, so "b" was in no output; found by a new-user trial)
    assert [(r["custom_id"], r["error_code"]) for r in rows] == [("a", None), ("b", None)]
    assert rows[0]["prompt"] == parse_request_lines([first], {"m"})[0]["prompt"] == "x"
    result = {"id": "batch_req_1", "custom_id": "a", "error": None, "response": {"status_code": 200, "body": {
        "id": "cmpl-1", "object": "text_completion", "created": 7, "model": "m",
        "choices": [{"index": 0, "text": "red", "finish_reason": "stop"}]}}}
    (tmp_path / "results.jsonl").write_bytes(b"\xef\xbb\xbf" + json.dumps(result).encode() + b"\n")
    done = convert(str(tmp_path / "results.jsonl"), str(tmp_path / "t.parquet"))
    assert done.errors == [] and pl.read_parquet(tmp_path / "t.parquet")["custom_id"].to_list() == ["a"]

