"""`tokenmill convert`: OpenAI Batch request JSONL <-> a Parquet prompt table, output JSONL -> a Parquet table.

- The request file with every mapped field (`test_openai_batch.request_lines`) to Parquet and back
  parses to the same requests; its bad lines are error rows naming their line, never a crash.
- The converted table run as a job gives the same greedy texts (and the same error rows) as the
  request file run as a job.
- A job's output folder, and an output file with bad lines, to one row per line, one column per field.
- A native prompt table (prompt, system, a constraint column) to request lines; rows that cannot be
  requests are left out and named; an existing DST is refused without --overwrite.
"""
from __future__ import annotations

import json

import polars as pl
import pytest

from pipeline import io
from pipeline.cli import main
from pipeline.convert import RESULT_SCHEMA, convert
from pipeline.openai_batch import parse_request_lines

try:
    from tests.s3_server import job_llm  # noqa: F401  (pytest fixture)
    from tests.test_openai_batch import CHAT, COMPLETIONS, MODEL, _line, read_jsonl, request_lines
except ImportError:  # tests/ is not a package: pytest puts it on sys.path
    from s3_server import job_llm  # noqa: F401
    from test_openai_batch import CHAT, COMPLETIONS, MODEL, _line, read_jsonl, request_lines


class _Tokenizer:
    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]


def _requests(rows: list[dict]) -> dict[str, dict]:
    """Parsed request rows by custom_id, without their line numbers, JSON cells as values."""
    out = {}
    for r in rows:
        r = {k: v for k, v in r.items() if k != "line"}
        for k in ("messages", "sampling_params"):
            r[k] = json.loads(r[k]) if r[k] is not None else None
        out[r["custom_id"]] = r
    return out


def test_requests_to_parquet_and_back_are_the_same_requests(tmp_path, capsys):
    lines, _ = request_lines(_Tokenizer())
    src = tmp_path / "requests.jsonl"
    src.write_text("\n".join(lines) + "\n")
    assert main(["convert", str(src), str(tmp_path / "prompts.parquet")]) == 0
    out, err = capsys.readouterr()
    assert "requests -> prompts: 17 rows from 1 file" in out
    # the bad lines are error rows naming their line (any model is accepted: the table's job does not check it)
    assert "4 bad lines (kept as error rows)" in err
    table = pl.read_parquet(tmp_path / "prompts.parquet")
    assert table.height == 17
    errors = table.filter(pl.col("request_error").is_not_null())
    assert errors["request_error"][0].startswith("requests.jsonl line 13: not valid JSON (")
    assert errors["request_error"].to_list()[1:] == [
        "requests.jsonl line 14: no custom_id (each request line needs a custom_id string)",
        "requests.jsonl line 15: custom_id 'g-chat' repeats requests.jsonl line 1's; each request needs its own "
        "custom_id",
        "requests.jsonl line 16: body.tools is not supported by tokenmill"]
    assert errors["id"].to_list() == [None, None, None, "tools"]
    # the sampling fields a job reads as columns, the rest as sampling_params
    g_parts = table.filter(pl.col("id") == "g-parts").row(0, named=True)
    assert (g_parts["max_tokens"], g_parts["temperature"], g_parts["seed"], g_parts["stop"]) == (6, 1e-6, 3, ["\n\n"])
    assert g_parts["messages"][0] == {"role": "system", "content": "Be brief."}
    assert g_parts["model"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and g_parts["chat_template"] is None
    assert json.loads(g_parts["sampling_params"]) == {"n": 1}
    g_ids = table.filter(pl.col("id") == "g-ids").row(0, named=True)
    assert g_ids["prompt_token_ids"] == [ord(c) for c in "Water boils at"] and g_ids["chat_template"] is False
    # and back: one request line per good row, the bad rows left out and named
    assert main(["convert", str(tmp_path / "prompts.parquet"), str(tmp_path / "back.jsonl.gz")]) == 0
    out, err = capsys.readouterr()
    assert "prompts -> requests: 13 lines" in out and "4 bad rows (left out)" in err
    assert "prompts.parquet row 15 (id 'tools'): request_error: requests.jsonl line 16: body.tools is not supported" in err
    back = [ln for ln in io.filesystem(str(tmp_path / "back.jsonl.gz"))[0].open(
        str(tmp_path / "back.jsonl.gz"), "rb", compression="gzip").read().splitlines()]
    before = _requests([r for r in parse_request_lines(lines) if r["request_error"] is None])
    after = _requests(parse_request_lines(back))
    assert list(after) == list(before) and len(after) == 13
    assert after == before
    assert json.loads(back[0])["url"] == CHAT and json.loads(back[2])["url"] == COMPLETIONS
    schema_body = next(json.loads(b)["body"] for b in back if b'"schema"' in b[:30])
    assert schema_body["response_format"]["type"] == "json_schema"


def test_the_converted_table_runs_as_the_request_file_does(tmp_path, job_llm, capsys):
    user = [{"role": "user", "content": "Name the capital of France."}]
    lines = [
        _line("chat", CHAT, {"model": MODEL, "messages": [{"role": "system", "content": "Be brief."}, *user],
                             "max_tokens": 5, "temperature": 0}),
        _line("parts", CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "Name a"},
                                                                         {"type": "text", "text": "colour."}]}],
                              "max_completion_tokens": 4, "temperature": 1e-6, "stop": "\n"}),
        _line("text", COMPLETIONS, {"prompt": "The largest planet is", "max_tokens": 5, "temperature": 0}),
        _line("ids", COMPLETIONS, {"prompt": job_llm.tokenizer.encode("Water boils at"), "max_tokens": 4,
                                   "temperature": 0}),
        _line("choice", CHAT, {"messages": user, "max_tokens": 3, "temperature": 0, "guided_choice": ["Paris", "Rome"]}),
        _line("tools", CHAT, {"messages": user, "tools": [{"type": "function", "function": {"name": "f"}}]}),
        "not json",
    ]
    (tmp_path / "requests.jsonl").write_text("\n".join(lines) + "\n")
    assert main(["run", "--input", str(tmp_path / "requests.jsonl"), "--output", str(tmp_path / "a"),
                 "--no-progress", "--max-tokens", "8"]) == 0
    assert main(["convert", str(tmp_path / "requests.jsonl"), str(tmp_path / "prompts.parquet")]) == 0
    assert main(["run", "--input", str(tmp_path / "prompts.parquet"), "--output", str(tmp_path / "b"),
                 "--no-progress", "--max-tokens", "8"]) == 0
    capsys.readouterr()
    results = read_jsonl(str(tmp_path / "a"), "results-")
    texts = {r["custom_id"]: (c.get("message") or {}).get("content", c.get("text"))
             for r in results for c in r["response"]["body"]["choices"][:1]}
    assert sorted(texts) == ["chat", "choice", "ids", "parts", "text"]
    parquet = pl.read_parquet(tmp_path / "b" / "part-*.parquet")
    got = dict(zip(parquet.filter(pl.col("error").is_null())["id"], parquet.filter(pl.col("error").is_null())[
        "generation"]))
    assert got == texts and all(texts.values())
    assert texts["choice"] in ("Paris", "Rome")
    # the bad lines are error rows in both jobs
    errors = read_jsonl(str(tmp_path / "a"), "errors-")
    assert sorted(str(e["custom_id"]) for e in errors) == ["None", "tools"]
    bad = parquet.filter(pl.col("error").is_not_null())
    assert sorted(bad["error"].to_list()) == sorted(e["error"]["message"].replace("line", "requests.jsonl line", 1)
                                                   for e in errors)
    # the job's output folder to one row per line, one column per field
    assert main(["convert", str(tmp_path / "a"), str(tmp_path / "results.parquet")]) == 0
    assert "results -> table: 7 rows from 2 files" in capsys.readouterr().out
    table = pl.read_parquet(tmp_path / "results.parquet")
    assert table.columns == RESULT_SCHEMA.names
    by_id = {r["custom_id"]: r for r in table.filter(pl.col("status_code") == 200).iter_rows(named=True)}
    for line in results:
        row, body = by_id[line["custom_id"]], line["response"]["body"]
        assert row["content"] == texts[line["custom_id"]] and row["id"] == line["id"]
        assert (row["object"], row["model"], row["finish_reason"]) == (
            body["object"], body["model"], body["choices"][0]["finish_reason"])
        assert (row["prompt_tokens"], row["completion_tokens"], row["cached_tokens"]) == (
            body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"],
            body["usage"]["prompt_tokens_details"]["cached_tokens"])
        assert row["choices"] == [{"content": row["content"], "finish_reason": row["finish_reason"]}]
    failed = table.filter(pl.col("status_code") == 400)
    assert sorted(failed["error_code"].to_list()) == ["invalid_json", "unsupported_field"]
    assert failed["content"].to_list() == [None, None] and failed["file"].to_list() == ["errors-00000.jsonl"] * 2


def test_an_output_file_with_bad_lines_is_rows_never_a_crash(tmp_path):
    good = {"id": "batch_req_1", "custom_id": "q1", "error": None, "response": {
        "status_code": 200, "request_id": "r1", "body": {
            "id": "cmpl-1", "object": "text_completion", "created": 7, "model": "m",
            "choices": [{"index": 0, "text": "red", "finish_reason": "stop"},
                        {"index": 1, "text": "blue", "finish_reason": "length"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}}}
    failed = {"id": "batch_req_2", "custom_id": "q2", "response": {"status_code": 400, "request_id": "r2", "body": {
        "error": {"message": "bad model", "type": "invalid_request_error", "code": "model_not_found"}}}, "error": None}
    lines = [json.dumps(good), "{oops", "", json.dumps({"custom_id": "q3"}), json.dumps(failed),
             json.dumps({"custom_id": "q4", "response": {"status_code": 200, "body": {"usage": {"prompt_tokens": "x"}}}})]
    (tmp_path / "results.jsonl").write_text("\n".join(lines) + "\n")
    done = convert(str(tmp_path / "results.jsonl"), str(tmp_path / "t.parquet"))
    assert done.kind == "results -> table" and done.rows == 5
    assert done.errors == ["results.jsonl line 2: not valid JSON (Expecting property name enclosed in double quotes "
                           "at column 2)",
                           "results.jsonl line 4: neither a response nor an error object",
                           "results.jsonl line 6: usage.prompt_tokens must be an integer, got 'x'"]
    rows = pl.read_parquet(tmp_path / "t.parquet").to_dicts()
    assert [r["line"] for r in rows] == [1, 2, 4, 5, 6]
    assert {k: rows[0][k] for k in (
        "custom_id", "id", "request_id", "status_code", "object", "model", "created", "content", "finish_reason",
        "prompt_tokens", "completion_tokens", "total_tokens", "cached_tokens", "error_code")} == {
        "custom_id": "q1", "id": "batch_req_1", "request_id": "r1", "status_code": 200, "object": "text_completion",
        "model": "m", "created": 7, "content": "red", "finish_reason": "stop", "prompt_tokens": 5,
        "completion_tokens": 3, "total_tokens": 8, "cached_tokens": None, "error_code": None}
    assert rows[0]["choices"] == [{"content": "red", "finish_reason": "stop"},
                                  {"content": "blue", "finish_reason": "length"}]
    assert [r["error_code"] for r in rows[1:]] == ["invalid_json", "invalid_result", "model_not_found",
                                                   "invalid_result"]
    assert rows[3]["error_message"] == "bad model" and rows[3]["custom_id"] == "q2"
    assert rows[2]["custom_id"] is None and rows[2]["error_message"] == done.errors[1]


def test_a_prompt_table_to_request_lines(tmp_path, capsys):
    pl.DataFrame({
        "id": [1, 2, 3, 4, 5],
        "prompt": ["Hello", "Hi", None, "Count", "Score"],
        "system": ["Be brief.", None, None, None, None],
        "json_schema": ['{"type": "object"}', None, None, None, None],
        "chat_template": [None, False, None, None, None],
        "temperature": [0.0, 0.5, None, None, None],
        "sampling_params": [None, '{"top_k": 5, "presence_penalty": 0.1}', None, None, '{"score_choices": ["a"]}'],
    }).write_parquet(tmp_path / "p.parquet")
    (tmp_path / "r.jsonl").write_text("keep me\n")
    assert main(["convert", str(tmp_path / "p.parquet"), str(tmp_path / "r.jsonl")]) == 1
    assert "r.jsonl exists; pass --overwrite to replace it" in capsys.readouterr().err
    assert (tmp_path / "r.jsonl").read_text() == "keep me\n"
    assert main(["convert", str(tmp_path / "p.parquet"), str(tmp_path / "r.jsonl"), "--overwrite",
                 "--model", "smollm2"]) == 0
    err = capsys.readouterr().err
    assert "p.parquet row 2 (id '3'): prompt and messages are both null" in err
    assert "p.parquet row 4 (id '5'): sampling field score_choices has no OpenAI Batch body field" in err
    got = [json.loads(x) for x in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert got == [
        {"custom_id": "1", "method": "POST", "url": CHAT, "body": {
            "model": "smollm2", "messages": [{"role": "system", "content": "Be brief."},
                                             {"role": "user", "content": "Hello"}],
            "temperature": 0.0, "response_format": {"type": "json_schema", "json_schema": {
                "name": "output", "schema": {"type": "object"}, "strict": True}}}},
        {"custom_id": "2", "method": "POST", "url": COMPLETIONS, "body": {
            "model": "smollm2", "prompt": "Hi", "temperature": 0.5, "top_k": 5, "presence_penalty": 0.1}},
        {"custom_id": "4", "method": "POST", "url": CHAT, "body": {
            "model": "smollm2", "messages": [{"role": "user", "content": "Count"}]}},
    ]
    assert "without body.model" not in err
    pl.DataFrame({"id": [1.0, float("nan")], "prompt": ["a", "b"]}).write_parquet(tmp_path / "nan.parquet")
    assert main(["convert", str(tmp_path / "nan.parquet"), str(tmp_path / "n.jsonl"), "--model", "m"]) == 0
    assert "nan.parquet row 1: id is NaN (a missing value)" in capsys.readouterr().err  # a job's words (it said null)
    # no --model: the lines have no body.model, which OpenAI's Batch API requires: said (it was silent)
    assert main(["convert", str(tmp_path / "p.parquet"), str(tmp_path / "r.jsonl"), "--overwrite"]) == 0
    assert capsys.readouterr().err.splitlines()[-1] == (
        "tokenmill convert: warning: 3 lines without body.model (OpenAI's Batch API requires it; --model sets it, "
        "a `model` column sets it per row)")
    assert [json.loads(x)["body"].get("model") for x in (tmp_path / "r.jsonl").read_text().splitlines()] == [None] * 3


def test_a_prompt_row_a_job_refuses_is_left_out_in_the_jobs_words(tmp_path, capsys):
    # an empty or blank prompt became a request ("content": ""), which a job then made an error row
    pl.DataFrame({"id": ["a", "b", "c"], "prompt": ["", "  \n", "ok"],
                  "chat_template": [True, False, True]}).write_parquet(tmp_path / "p.parquet")
    assert main(["convert", str(tmp_path / "p.parquet"), str(tmp_path / "r.jsonl"), "--model", "m"]) == 0
    err = capsys.readouterr().err
    assert "p.parquet row 0 (id 'a'): prompt is empty" in err
    assert "p.parquet row 1 (id 'b'): prompt is empty" in err
    assert [json.loads(x)["custom_id"] for x in (tmp_path / "r.jsonl").read_text().splitlines()] == ["c"]


def test_a_destination_of_another_kind_is_refused(tmp_path):
    with pytest.raises(ValueError, match="convert writes .parquet, .jsonl or .jsonl.gz files"):
        convert(str(tmp_path / "x.jsonl"), str(tmp_path / "x.csv"))


def test_a_conversion_into_the_kind_src_already_is_refused(tmp_path, capsys):
    """Parquet to .parquet read the table's bytes as request lines and wrote a table of invalid_json rows,
    exit 0; request lines to .jsonl said the JSONL file `is not a Parquet file` (both found by a new-user
    trial). Each is refused in one line naming what SRC is, and nothing is written."""
    pl.DataFrame({"id": ["a"], "prompt": ["hi"]}).write_parquet(tmp_path / "p.parquet")
    assert main(["convert", str(tmp_path / "p.parquet"), str(tmp_path / "q.parquet")]) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"tokenmill: {tmp_path / 'p.parquet'} is a Parquet table already: a job reads it as it is; convert "
        f"writes a prompt table as request lines to a .jsonl DST"]
    (tmp_path / "r.jsonl").write_text(_line("a", COMPLETIONS, {"prompt": "x"}) + "\n")
    assert main(["convert", str(tmp_path / "r.jsonl"), str(tmp_path / "again.jsonl")]) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"tokenmill: {tmp_path / 'r.jsonl'} holds request lines already: a job reads them as they are; convert "
        f"writes them as a prompt table to a .parquet DST"]
    assert not (tmp_path / "q.parquet").exists() and not (tmp_path / "again.jsonl").exists()


def test_a_parquet_jobs_output_as_src_is_named_as_a_table_already(tmp_path, capsys):
    """`tokenmill convert OUT t.parquet` on a Parquet job's output said only `no JSONL (.jsonl, .jsonl.gz) files
    at OUT` (found by a new-user trial); it now says what the folder holds and what convert reads."""
    out = tmp_path / "out"
    out.mkdir()
    pl.DataFrame({"id": [1], "generation": ["yes"]}).write_parquet(out / "part-00000.parquet")
    assert main(["convert", str(out), str(tmp_path / "t.parquet")]) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"tokenmill: no JSONL (.jsonl, .jsonl.gz) files at {out}: it holds a job's Parquet part files "
        f"(part-00000.parquet, ...), which are a table already; convert reads OpenAI Batch request or results "
        f"JSONL into one"]
    (out / "part-00000.parquet").unlink()
    with pytest.raises(FileNotFoundError, match=r"^no JSONL \(\.jsonl, \.jsonl\.gz\) files at .*out$"):
        convert(str(out), str(tmp_path / "t.parquet"))
    assert not (tmp_path / "t.parquet").exists()


def test_a_jobs_output_to_one_jsonl_file_in_the_order_of_the_request_lines(tmp_path, job_llm, capsys):
    """Prefix planning puts the rows sharing a prefix together, so the part files are in input order
    each but not across each other; `convert OUTPUT merged.jsonl` writes every output and error line
    once, in the request lines' order."""
    heads = {"a": "Answer as a careful geographer who checks every fact twice before writing it down: ",
             "b": "Answer as a cheerful cook who turns every question into a recipe with three steps: "}
    lines = []
    for i in range(3):
        for h in ("a", "b"):
            lines.append(_line(f"{h}{i}", COMPLETIONS, {"prompt": heads[h] + f"question {i}?", "max_tokens": 2,
                                                      "temperature": 0}))
    lines.insert(3, "not json")
    (tmp_path / "requests.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    assert main(["run", "--input", str(tmp_path / "requests.jsonl"), "--output", str(out), "--no-progress",
                 "--shard-size", "3"]) == 0
    parts = [r["custom_id"] for r in read_jsonl(str(out), "results-")]  # part by part
    want = ["a0", "b0", "a1", "b1", "a2", "b2"]
    assert sorted(parts) == sorted(want) and parts != want  # regrouped by prefix across the part files
    assert main(["convert", str(out), str(tmp_path / "merged.jsonl")]) == 0
    assert "results -> jsonl: 7 lines from 4 files" in capsys.readouterr().out
    merged = [json.loads(x) for x in (tmp_path / "merged.jsonl").read_text().splitlines()]
    assert [m["custom_id"] for m in merged] == want[:3] + [None] + want[3:]
    assert merged[3]["error"]["code"] == "invalid_json"
