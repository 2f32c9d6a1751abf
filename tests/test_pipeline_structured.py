"""Structured outputs in a job: job defaults (CLI, YAML), per-row constraint columns (null = the
default), the `valid` / `parsed` / `label` / `label_logprobs` columns, bad constraints as error
rows, one compile per distinct constraint, the cost report's counts, and an S3 -> S3 job that is
killed and resumes with every id exactly once."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jsonschema
import polars as pl
import pytest

from engine import LLM
from pipeline import JobSpec, done_shards, io, read_metrics, run_job, validate_spec
from pipeline.cli import build_parser, spec_from_args

try:
    from tests.s3_server import s3_bucket, s3_server  # noqa: F401  (pytest fixtures)
except ImportError:  # tests/ is not a package: pytest puts it on sys.path
    from s3_server import s3_bucket, s3_server  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent
KV = 96 << 20
LABELS = ["files", "network", "text", "math", "concurrency", "data"]
SCHEMAS = [
    {"type": "object", "properties": {"topic": {"enum": LABELS}}, "required": ["topic"], "additionalProperties": False},
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16}, "n": {"type": "integer"}},
     "required": ["name", "n"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 3},
]
DATE = r"20[0-9][0-9]-[01][0-9]-[0-3][0-9]"


@pytest.fixture(scope="module")
def eng():
    return LLM("smollm2-135m-instruct", speculative=None, kv_cache_memory_bytes=KV)


def _input(path: Path, n: int = 24) -> pl.DataFrame:
    """n rows: a third with one of 3 schemas (JSON text), some regex and choice rows, the rest null
    (the job's default choice), and three bad rows."""
    prompts = pl.read_parquet(ROOT / "data" / "labelling.parquet")["prompt"].head(n).to_list()
    schema, regex, choice = [None] * n, [None] * n, [None] * n
    for i in range(n):
        if i % 3 == 0:
            schema[i] = json.dumps(SCHEMAS[(i // 3) % 3])
        elif i % 6 == 1:
            regex[i] = DATE
        elif i % 6 == 4:
            choice[i] = ["yes", "no"]
    regex[2] = "a(b"                  # does not compile
    choice[5] = ["yes", "yes"]        # duplicates
    regex[0] = DATE                   # two constraint columns in one row (row 0 has a schema)
    df = pl.DataFrame({"id": [f"r{i:03d}" for i in range(n)], "prompt": prompts, "json_schema": schema,
                       "regex": regex, "choice": choice}, schema_overrides={"choice": pl.List(pl.Utf8)})
    df.write_parquet(path)
    return df


def _check_rows(out: pl.DataFrame, inp: pl.DataFrame) -> None:
    rows = {r["id"]: r for r in out.iter_rows(named=True)}
    assert sorted(rows) == inp["id"].to_list()
    assert "unclosed group" in rows["r002"]["error"] and rows["r002"]["finish_reason"] == "error"
    assert "duplicate" in rows["r005"]["error"]
    assert "at most one constraint column" in rows["r000"]["error"]
    for r_in in inp.iter_rows(named=True):
        r = rows[r_in["id"]]
        if r["error"] is not None:
            assert r["valid"] is None and r["parsed"] is None
            continue
        g = r["generation"]
        assert r["valid"] == (r["finish_reason"] == "stop"), r
        if r_in["json_schema"] is not None:
            if r["valid"]:
                obj = json.loads(g)
                jsonschema.validate(obj, json.loads(r_in["json_schema"]))
                assert r["parsed"] == json.dumps(obj, separators=(",", ":"))
        else:
            assert r["parsed"] is None
            if r["valid"]:
                assert g in (r_in["choice"] or LABELS) if r_in["regex"] is None else re.fullmatch(DATE, g)


def test_per_row_constraint_columns_job_defaults_and_the_cost_report(eng, tmp_path):
    inp = _input(tmp_path / "in.parquet")
    spec = JobSpec(input=str(tmp_path / "in.parquet"), output=str(tmp_path / "out"), max_tokens=24,
                   choice=",".join(LABELS), shard_size=8, progress=False, plan="input")
    c0 = eng.structured.stats.compiles
    report = run_job(spec, eng)
    # distinct constraints: 3 schemas, the date regex, ["yes", "no"], the default choice, the bad regex
    # (rows with validation errors, the duplicate choice and two columns, never reach a compile)
    assert eng.structured.stats.compiles - c0 == 7
    out = pl.concat([pl.read_parquet(p) for p in sorted((tmp_path / "out").glob("part-*.parquet"))])
    assert out.columns[out.columns.index("generation"):][:3] == ["generation", "valid", "parsed"]
    _check_rows(out, inp)
    ok = out.filter(pl.col("error").is_null())
    assert report.rows_valid == int(ok["valid"].sum()) and report.rows_invalid == ok.height - report.rows_valid
    assert report.rows_valid >= 12, out.select("id", "generation", "finish_reason").to_dicts()
    choice_rows = ok.join(inp.select("id", "json_schema", "regex"), on="id").filter(
        pl.col("valid") & pl.col("json_schema").is_null() & pl.col("regex").is_null())
    assert choice_rows.height >= 4
    dist = json.loads(report.label_distribution)
    assert dist == {k: v for k, v in choice_rows["generation"].value_counts(sort=True).iter_rows()}
    m = read_metrics(spec.output)
    assert m["rows_valid"].to_list() == [report.rows_valid] and m["label_distribution"].to_list() == [
        report.label_distribution]


def test_a_row_whose_grammar_the_engine_gives_up_on_part_way_is_an_error_row_and_the_job_runs_on(eng, tmp_path):
    """llguidance gives up on `(hello|hi) a{100000000}` after "hell" (its lexer's budget): that row is an
    error row naming the cause (no generation: the engine stopped it there, and "hell" is no output
    of the constraint), the rows beside it run as usual, and the job finishes "ok"."""
    prompts = ["Say hello then many a letters.", "Say hello.", "Say hello then many a letters."]
    regex = ["(hello|hi) a{100000000}", None, "hello"]
    pl.DataFrame({"id": ["a", "b", "c"], "prompt": prompts, "regex": regex}).write_parquet(tmp_path / "in.parquet")
    spec = JobSpec(input=str(tmp_path / "in.parquet"), output=str(tmp_path / "out"), max_tokens=16,
                   progress=False, plan="input")
    report = run_job(spec, eng)
    out = {r["id"]: r for r in pl.read_parquet(tmp_path / "out" / "part-00000.parquet").iter_rows(named=True)}
    gave_up = out["a"]
    assert gave_up["error"] == "structured_outputs.regex: lexer error: too many expressions constructed"
    assert (gave_up["generation"], gave_up["finish_reason"], gave_up["valid"]) == (None, "error", None)
    assert out["b"]["error"] is None and out["b"]["valid"] is None and out["b"]["generation"]
    assert (out["c"]["generation"], out["c"]["valid"], out["c"]["error"]) == ("hello", True, None)
    assert (report.status, report.rows_ok, report.rows_error, report.rows_valid, report.rows_invalid) == (
        "ok", 2, 1, 1, 0)


def test_score_job_writes_label_and_label_logprobs(eng, tmp_path):
    prompts = pl.read_parquet(ROOT / "data" / "labelling.parquet").head(8)
    prompts.select("id", "prompt", "reference_label").write_parquet(tmp_path / "in.parquet")
    spec = JobSpec(input=str(tmp_path / "in.parquet"), output=str(tmp_path / "out"), score_choices=",".join(LABELS),
                   progress=False)
    report = run_job(spec, eng)
    out = pl.read_parquet(tmp_path / "out" / "part-00000.parquet")
    for r in out.iter_rows(named=True):
        lps = {d["choice"]: d["logprob"] for d in r["label_logprobs"]}
        assert list(lps) == LABELS and r["label"] == max(lps, key=lps.get) == r["generation"] and r["valid"]
        assert all(v < 0 for v in lps.values())
    assert sum(json.loads(report.label_distribution).values()) == 8 == report.rows_valid


def test_cli_and_yaml_give_the_constraint_fields(tmp_path):
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(SCHEMAS[1]))
    parser = build_parser()
    base = ["run", "--input", "in.parquet", "--output", "out"]
    spec = spec_from_args(parser.parse_args(base + ["--choice", "a, b,c"]))
    assert spec.choice == ["a", "b", "c"] and spec.sampling_params().structured_outputs.choice == ["a", "b", "c"]
    spec = spec_from_args(parser.parse_args(base + ["--json-schema", str(schema)]))
    assert spec.structured_outputs().json == SCHEMAS[1]
    assert spec_from_args(parser.parse_args(base + ["--score-choices", "yes,no"])).score_choices == ["yes", "no"]
    grammar = tmp_path / "g.lark"
    grammar.write_text('start: "x" | "y"')
    assert spec_from_args(parser.parse_args(base + ["--grammar", str(grammar)])).structured_outputs().grammar == \
        'start: "x" | "y"'
    yaml_file = tmp_path / "job.yaml"
    yaml_file.write_text("input: in.parquet\noutput: out\njson_schema:\n  type: object\n  properties:\n"
                         "    ok: {type: boolean}\n")
    assert JobSpec.from_file(str(yaml_file)).structured_outputs().json["properties"] == {"ok": {"type": "boolean"}}
    # the default changes the fingerprint; its content (not its file name) is what counts
    a = JobSpec(input="i", output="o", json_schema=str(schema)).fingerprint_fields()["structured"]
    schema.write_text(json.dumps(SCHEMAS[0]))
    assert JobSpec(input="i", output="o", json_schema=str(schema)).fingerprint_fields()["structured"] != a
    assert "structured" not in JobSpec(input="i", output="o").fingerprint_fields()


def test_json_object_job_default_writes_parsed_objects(eng, tmp_path):
    """--json-object (any JSON object, compact): every row that ends with "stop" parses to a dict,
    `parsed` holds the same object, the flag changes the fingerprint, and it conflicts with a
    second default constraint."""
    names = ["Ada", "Bo", "Cy", "Di", "Ed", "Flo"]
    pl.DataFrame({"id": [f"p{i}" for i in range(6)],
                  "prompt": [f"Describe a person called {n} as JSON with name and age." for n in names]}
                 ).write_parquet(tmp_path / "in.parquet")
    args = ["run", "--input", str(tmp_path / "in.parquet"), "--output", str(tmp_path / "out"), "--json-object",
            "--max-tokens", "48", "--no-progress"]
    spec = spec_from_args(build_parser().parse_args(args))
    assert spec.json_object and spec.structured_outputs().json_object is True
    assert spec.fingerprint_fields()["structured"] != JobSpec(input="i", output="o").fingerprint_fields().get(
        "structured")
    report = run_job(spec, eng)
    out = pl.read_parquet(tmp_path / "out" / "part-00000.parquet").sort("id")
    assert out["id"].to_list() == [f"p{i}" for i in range(6)]
    for r in out.iter_rows(named=True):
        assert r["valid"] == (r["finish_reason"] == "stop")
        if r["valid"]:
            obj = json.loads(r["generation"])
            assert isinstance(obj, dict) and json.loads(r["parsed"]) == obj
            if "\\" not in r["generation"]:  # compact: no whitespace outside strings
                assert r["generation"] == json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    assert report.rows_valid == int(out["valid"].sum()) >= 3
    with pytest.raises(ValueError, match="at most one of"):
        JobSpec(input="i", output="o", json_object=True, regex="x").structured_outputs()


@pytest.mark.parametrize("fields,message", [
    ({"regex": "a(b"}, "invalid default output constraint: structured_outputs.regex"),
    ({"choice": "a,a"}, "duplicate"),
    ({"choice": "a", "regex": "b"}, "at most one of"),
    ({"json_schema": "/nonexistent/s.json"}, "json_schema: cannot read /nonexistent/s.json"),
])
def test_a_bad_job_default_is_refused_before_anything_runs(tmp_path, fields, message):
    spec = JobSpec(input=str(tmp_path / "in.parquet"), output=str(tmp_path / "out"), **fields)
    with pytest.raises(ValueError, match=re.escape(message)):
        validate_spec(spec)


CHILD = textwrap.dedent("""
    import sys
    from pipeline.cli import main
    sys.exit(main(sys.argv[1:]))
""")


def test_s3_job_with_schema_columns_is_killed_and_resumes_with_every_id_once(eng, s3_bucket, s3_server, tmp_path):
    n = 24
    inp = _input(tmp_path / "in.parquet", n)
    so = {"endpoint_url": s3_server, "key": "testing", "secret": "testing"}
    io.write_bytes(f"s3://{s3_bucket}/in/a.parquet", (tmp_path / "in.parquet").read_bytes(), so)
    spec = JobSpec(input=f"s3://{s3_bucket}/in/", output=f"s3://{s3_bucket}/out", max_tokens=24,
                   choice=",".join(LABELS), shard_size=3, shards_in_flight=1, progress=False, plan="input",
                   speculative="off", kv_cache_memory_bytes=KV, storage_options=so, lease_ttl_s=1.0)
    args = ["run", "--input", spec.input, "--output", spec.output, "--max-tokens", "24", "--choice",
            ",".join(LABELS), "--shard-size", "3", "--shards-in-flight", "1", "--no-progress", "--plan", "input",
            "--speculative", "off", "--kv-cache-memory-bytes", str(KV), "--lease-ttl-s", "1.0",
            "--storage-option", f"endpoint_url={s3_server}", "--storage-option", "key=testing",
            "--storage-option", "secret=testing"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENMILL_NUM_THREADS": "1"}
    child = subprocess.Popen([sys.executable, "-c", CHILD, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not done_shards(spec):
        assert child.poll() is None, child.communicate()
        assert time.monotonic() < deadline, "no shard committed in time"
        time.sleep(0.2)
    os.kill(child.pid, signal.SIGKILL)
    child.communicate()
    killed_with = len(done_shards(spec))
    assert 1 <= killed_with < n // 3
    time.sleep(1.2)  # the killed run's lease expires
    # the resume holds its own lease with the default TTL: under 1 s, one slow step on a busy machine lost it
    # (LeaseLost in a clean-clone CI run)
    report = run_job(spec.model_copy(update={"lease_ttl_s": JobSpec.model_fields["lease_ttl_s"].default}), eng)
    names = sorted(x for x in io.list_names(spec.output, so) if x.startswith("part-"))
    out = pl.concat([io.read_parquet(io.join(spec.output, x), so) for x in names])
    assert sorted(out["id"].to_list()) == inp["id"].to_list() and out.height == n  # every id exactly once
    assert report.rows_skipped == 3 * killed_with
    _check_rows(out, inp)
