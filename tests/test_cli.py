"""The `tokenmill` command: run on local files, report, changed-spec refusal, demo."""
from __future__ import annotations

import os

import polars as pl
import pytest

from pipeline.cli import build_parser, main, spec_from_args

try:
    from tests.s3_server import job_llm  # noqa: F401  (fixture)
except ImportError:  # tests/ is not a package: pytest puts it on sys.path
    from s3_server import job_llm  # noqa: F401


def test_flags_mirror_jobspec(tmp_path):
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text("input: in.parquet\noutput: out\nmax_tokens: 9\nsystem_prompt: from file\n")
    args = build_parser().parse_args([
        "run", "--spec", str(spec_file), "--max-tokens", "5", "--temperature", "0.5", "--stop", "\n", "--stop", "END",
        "--shard-size", "10", "--price-per-hour", "2.5", "--no-chat-template", "--storage-option",
        "endpoint_url=http://x", "--engine-option", "block_size=32", "--n", "2"])
    spec = spec_from_args(args)
    assert (spec.max_tokens, spec.temperature, spec.stop, spec.shard_size, spec.price_per_hour) == (
        5, 0.5, ["\n", "END"], 10, 2.5)
    assert spec.system_prompt == "from file" and spec.chat_template is False and spec.n == 2
    assert spec.storage_options == {"endpoint_url": "http://x"} and spec.engine_kwargs()["block_size"] == 32


def test_run_report_and_refusal(job_llm, tmp_path, capsys):
    inp = tmp_path / "prompts.parquet"
    pl.DataFrame({"id": ["a", "b", "c", "d", "e"],
                  "prompt": ["Say yes.", "Say no.", "Name a fruit.", "Name a month.", "Say hi."],
                  "lang": ["en"] * 5}).write_parquet(inp)
    out = tmp_path / "out"
    args = ["run", "--input", str(inp), "--output", str(out), "--max-tokens", "4", "--shard-size", "2",
            "--price-per-hour", "0.10"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "cost report" in printed and "usd_per_1m_tokens" in printed and "output_tokens_per_s" in printed
    df = pl.concat([pl.read_parquet(out / p) for p in sorted(os.listdir(out)) if p.startswith("part-")])
    assert df["id"].to_list() == ["a", "b", "c", "d", "e"] and df["lang"].to_list() == ["en"] * 5
    assert df["error"].null_count() == 5 and all(df["generation"].str.len_chars() > 0)

    assert main(["report", str(out)]) == 0
    assert "rows_ok" in capsys.readouterr().out
    cost = float(pl.read_parquet(f"{out}/_job/runs/*.parquet")["cost_usd"].sum())
    assert main(["report", str(out), "--all"]) == 0  # the total heads the per-run reports too
    printed = capsys.readouterr().out
    assert printed.startswith(f"job at {out}: 1 run(s); cost of all runs {cost:.6f} USD; each run:\n")
    assert printed.count("rows_ok") == 1

    # a re-run finds every shard done and books a run of zeros: the report shows the run that did the work
    assert main(args) == 0
    capsys.readouterr()
    assert main(["report", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"job at {out}: 2 run(s); cost of all runs ")
    assert printed.splitlines()[0].endswith(" USD; the latest that ran rows, run 1 (1 later run committed none; "
                                            "--all shows each run):")
    assert main(["report", str(out), "--all"]) == 0
    runs = capsys.readouterr().out.split("\nrun ")[1:]
    assert [r.split("\n", 1)[0] for r in runs] == ["1 of 2", "2 of 2"]
    assert printed.split("\n", 1)[1] == runs[0].split("\n", 1)[1]  # run 1's report, as --all prints it

    assert main(args + ["--max-tokens", "5"]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "nothing")]) == 1


def test_demo(job_llm, tmp_path, capsys):
    out = tmp_path / "demo"
    rc = main(["demo", "--output", str(out), "--limit", "3", "--max-tokens", "2", "--no-progress",
               ])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "labelling job" in printed and "cost report" in printed
    df = pl.read_parquet(out / "part-00000.parquet")
    assert df.height == 3 and "reference_label" in df.columns and "title" in df.columns
    labels = {"files", "network", "text", "math", "concurrency", "data"}
    # a choice constraint over the label set: a valid row is a label; a row cut by the 2 tokens is not valid
    for g, v, f in zip(df["generation"], df["valid"], df["finish_reason"]):
        assert (v and g in labels and f == "stop") or (not v and f == "length")
    right = int((df["generation"] == df["reference_label"]).sum())
    assert f"accuracy against reference_label: {right} of 3" in printed


def test_pipeline_never_imports_prefect():
    import subprocess
    import sys

    code = "import sys, pipeline, pipeline.cli; assert 'prefect' not in sys.modules, 'pipeline imported prefect'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.dirname(os.path.dirname(__file__)))


def test_warnings_are_one_line_without_our_source(tmp_path, capsys):
    from pipeline import JobSpec, cache_llm
    from pipeline.testing import FakeLLM

    inp = tmp_path / "noid.parquet"
    pl.DataFrame({"prompt": ["Say yes.", "Say no."]}).write_parquet(inp)
    spec = JobSpec(input="-", output="-", engine_options={"seed": 7})  # a cache key no other test uses
    cache_llm(spec, FakeLLM())
    assert main(["run", "--input", str(inp), "--output", str(tmp_path / "out"), "--no-progress",
                 "--engine-option", "seed=7"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err == [f"tokenmill: warning: file://{inp} has no 'id' column; using the row index as the id"]
    # a named id column that is missing is a typo, not a fallback: refused before anything is written
    assert main(["run", "--input", str(inp), "--output", str(tmp_path / "out2"), "--no-progress",
                 "--engine-option", "seed=7", "--id-column", "nope"]) != 0
    err = capsys.readouterr().err
    assert "id_column" in err and "'nope'" in err and "prompt" in err and not (tmp_path / "out2").exists()


def test_spec_file_errors_name_the_file_line_and_field(tmp_path, capsys):
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("input: in.parquet\noutput: [unclosed\n")
    assert main(["run", "--spec", str(bad_yaml)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"tokenmill: {bad_yaml}: not valid YAML: ") and "at line 3, column 1" in err

    fields = tmp_path / "job.yaml"
    fields.write_text("input: in.parquet\noutput: out\nmax_token: 8\ntemperature: hot\n")
    assert main(["run", "--spec", str(fields), "--shard-size", "0"]) == 1
    assert capsys.readouterr().err.splitlines() == [  # file:line: field, as README's Reliability table says
        f"tokenmill run: error: {fields}:4: temperature must be a number, got 'hot'",
        "tokenmill run: error: --shard-size must be an integer >= 1, got 0",
        f"tokenmill run: error: {fields}:3: max_token: unknown option; did you mean 'max_tokens'?",
    ]
    nested = tmp_path / "nightly.yaml"  # fields under spec:, as flows.deploy reads them; JSON too
    nested.write_text("# nightly\nspec:\n  input: in.parquet\n\n  output: out\n  max_tokns: 8\n")
    as_json = tmp_path / "job.json"
    as_json.write_text('{\n  "input": "in.parquet",\n  "output": "out",\n  "shard_size": -1\n}\n')
    for path, line in ((nested, f"{nested}:6: max_tokns: unknown option; did you mean 'max_tokens'?"),
                       (as_json, f"{as_json}:4: shard_size must be an integer >= 1, got -1")):
        assert main(["run", "--spec", str(path)]) == 1
        assert capsys.readouterr().err.splitlines() == [f"tokenmill run: error: {line}"]


def test_a_spec_file_that_is_a_directory_binary_or_empty_is_one_line_naming_it(tmp_path, capsys):
    """Refused as a missing spec file is (exit 1, one line naming the file), never a traceback or a
    decoder's message without the file's name."""
    missing = tmp_path / "nope.yaml"
    assert main(["run", "--spec", str(missing)]) == 1
    assert capsys.readouterr().err.splitlines() == [f"tokenmill: spec file {missing} not found"]
    folder = tmp_path / "in"
    folder.mkdir()
    binary = tmp_path / "job.yaml"
    binary.write_bytes(b"a\x85b: 1\n")
    empty = tmp_path / "spec_empty.yaml"
    empty.write_text("")
    blank = tmp_path / "blank.json"
    blank.write_text("\n  \n")
    comments = tmp_path / "comments.yaml"
    comments.write_text("# nothing yet\n")
    for path, line in (
            (folder, f"spec file {folder}: is a directory"),
            (binary, f"spec file {binary}: not UTF-8 text (byte 0x85 at position 1); a spec file is YAML or JSON"),
            (empty, f"spec file {empty}: is empty; expected a mapping of JobSpec fields"),
            (blank, f"spec file {blank}: is empty; expected a mapping of JobSpec fields"),
            (comments, f"{comments}: expected a mapping of JobSpec fields, got an empty document")):
        assert main(["run", "--spec", str(path)]) == 1
        assert capsys.readouterr().err.splitlines() == [f"tokenmill: {line}"]
    assert main(["run", "--spec", str(folder), "--verbose"]) == 1  # the traceback only when asked for
    assert capsys.readouterr().err.startswith("Traceback (most recent call last):")


def test_relative_paths_in_a_spec_file_are_relative_to_the_current_directory(tmp_path, capsys, monkeypatch):
    """As README says: a spec file's `input`, `output`, `json_schema` are read from where the command runs,
    not from the spec file's folder."""
    from pipeline import JobSpec, cache_llm
    from pipeline.testing import FakeLLM

    cache_llm(JobSpec(input="-", output="-", engine_options={"seed": 14}), FakeLLM())  # a key no other test uses
    sub = tmp_path / "specs"
    sub.mkdir()
    pl.DataFrame({"id": [1], "prompt": ["Hi."]}).write_parquet(sub / "in.parquet")  # beside the spec: not read
    (sub / "label.json").write_text('{"type": "object"}')
    spec_file = sub / "job.yaml"
    spec_file.write_text("input: in.parquet\noutput: out\njson_schema: label.json\nengine_options:\n  seed: 14\n"
                         "progress: false\n")
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--spec", str(spec_file)]) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"tokenmill: json_schema: cannot read label.json: [Errno 2] No such file or directory: "
        f"'{tmp_path}/label.json'"]
    spec_file.write_text("input: in.parquet\noutput: out\nengine_options:\n  seed: 14\nprogress: false\n")
    assert main(["run", "--spec", str(spec_file)]) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"tokenmill: input in.parquet does not exist (read from the current folder, {tmp_path})"]
    (sub / "in.parquet").rename(tmp_path / "in.parquet")
    assert main(["run", "--spec", str(spec_file)]) == 0
    assert (tmp_path / "out" / "part-00000.parquet").exists() and not (sub / "out").exists()


def test_the_seed_range_is_the_engines_in_one_line_naming_the_range(tmp_path, capsys):
    """--seed refused anything above 2**62 with "Value error, too large: at most 4,611,686,018,427,387,904"
    while the Python API took 2**80; both now take the 64-bit range, and say which it is."""
    args = ["run", "--input", str(tmp_path / "in.parquet"), "--output", str(tmp_path / "out")]
    assert main([*args, "--seed", str(2 ** 63)]) == 1
    assert capsys.readouterr().err.splitlines() == [
        "tokenmill run: error: --seed must be in [-2**63, 2**63 - 1] (a 64-bit integer), got 9223372036854775808"]
    assert main([*args, "--seed", str(-(2 ** 63) - 1)]) == 1
    assert "--seed must be in [-2**63, 2**63 - 1]" in capsys.readouterr().err
    assert spec_from_args(build_parser().parse_args([*args, "--seed", str(2 ** 63 - 1)])).seed == 2 ** 63 - 1
    assert spec_from_args(build_parser().parse_args([*args, "--seed", str(-(2 ** 63))])).seed == -(2 ** 63)


def test_price_weight_and_lease_ttl_must_be_finite(tmp_path, capsys):
    """--price-per-hour inf gave a cost of inf and nan USD per token in the report (nan was refused, by ge=0,
    inf not); an inf --lease-ttl-s failed on the lease's expiry time. Refused as nan is, and from Python too."""
    import pytest
    from pydantic import ValidationError

    from pipeline import JobSpec

    run = ["run", "--input", str(tmp_path / "in.parquet"), "--output", str(tmp_path / "out")]
    for flag, value in (("--price-per-hour", "inf"), ("--price-per-hour", "nan"), ("--price-per-hour", "1e400"),
                        ("--price-per-hour=-inf", None), ("--output-token-weight", "inf"),
                        ("--lease-ttl-s", "inf")):
        assert main(run + [flag] + ([value] if value else [])) == 1
        name, _, given = flag.partition("=")
        assert capsys.readouterr().err.splitlines() == [
            f"tokenmill run: error: {name} must be a finite number, got {float(value or given)}"]
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text("input: in.parquet\noutput: out\nprice_per_hour: .inf\n")
    assert main(["run", "--spec", str(spec_file)]) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"tokenmill run: error: {spec_file}:3: price_per_hour must be a finite number, got inf"]
    for field in ("price_per_hour", "output_token_weight", "lease_ttl_s"):
        with pytest.raises(ValidationError) as exc:
            JobSpec(input="in.parquet", output="out", **{field: float("inf")})
        assert [(e["loc"], e["msg"]) for e in exc.value.errors()] == [((field,), "Input should be a finite number")]
    assert JobSpec(input="in.parquet", output="out", price_per_hour=0, lease_ttl_s=1e5).price_per_hour == 0.0


def test_lease_ttl_and_price_have_an_upper_bound_named_with_the_range(tmp_path, capsys):
    """--lease-ttl-s 1e300 failed with an OverflowError traceback (the lease's expiry time) and
    --price-per-hour 1e308 booked costs of inf; both are refused naming the option and its range,
    before anything is written; the bounds themselves are accepted."""
    import pytest
    from pydantic import ValidationError

    from pipeline import JobSpec

    out = tmp_path / "out"
    run = ["run", "--input", str(tmp_path / "in.parquet"), "--output", str(out)]
    assert main(run + ["--lease-ttl-s", "1e300", "--price-per-hour", "1e308"]) == 1
    assert capsys.readouterr().err.splitlines() == [
        "tokenmill run: error: --lease-ttl-s must be in [0.1, 604800] seconds (at most 7 days), got 1e+300",
        "tokenmill run: error: --price-per-hour must be in [0, 1000000] USD per device-hour, got 1e+308"]
    assert main(run + ["--lease-ttl-s", "604800.5"]) == 1
    assert capsys.readouterr().err.splitlines() == [
        "tokenmill run: error: --lease-ttl-s must be in [0.1, 604800] seconds (at most 7 days), got 604800.5"]
    assert not out.exists()
    with pytest.raises(ValidationError) as exc:
        JobSpec(input="in.parquet", output="out", price_per_hour=1e6 + 1)
    assert [(e["loc"], e["msg"]) for e in exc.value.errors()] == [
        (("price_per_hour",), "Value error, must be in [0, 1000000] USD per device-hour")]
    spec = JobSpec(input="in.parquet", output="out", price_per_hour=1e6, lease_ttl_s=7 * 24 * 3600)
    assert (spec.price_per_hour, spec.lease_ttl_s) == (1e6, 604800.0)


def test_errors_are_short_unless_verbose(tmp_path, capsys):
    inp = tmp_path / "in.parquet"
    pl.DataFrame({"id": [1], "prompt": ["Hi."]}).write_parquet(inp)
    args = ["run", "--input", str(inp), "--output", "s3://bucket/out", "--storage-option",
            "endpoint_url=http://127.0.0.1:9", "--storage-option", "key=x", "--storage-option", "secret=y"]
    assert main(args) == 1
    err = capsys.readouterr().err.splitlines()
    assert err == ["tokenmill: cannot write s3://bucket/out: cannot connect to http://127.0.0.1:9 (connection "
                   "refused, 3 attempts)",
                   "  Check the endpoint (AWS_ENDPOINT_URL or --storage-option endpoint_url=...) and that the "
                   "service is up."]
    assert main(args + ["--verbose"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):") and "EndpointConnectionError" in err


def test_a_bad_regex_or_grammar_is_one_line_with_its_position(tmp_path, capsys):
    inp = tmp_path / "in.parquet"
    pl.DataFrame({"id": [1], "prompt": ["Hi."]}).write_parquet(inp)
    grammar = tmp_path / "g.lark"
    grammar.write_text('start: item\nitem: "a" other\n')
    for flag, value, expected in [
        ("--regex", r"\d{4}-(\d{2}", 'structured_outputs.regex: invalid regex "\\d{4}-(\\d{2}": unclosed group at offset 6'),
        ("--grammar", str(grammar), 'structured_outputs.grammar: unknown name: "other" at line 2, column 7'),
    ]:
        assert main(["run", "--input", str(inp), "--output", str(tmp_path / "out"), flag, value]) == 1  # refused before anything is written
        err = capsys.readouterr().err
        assert err == f"tokenmill: invalid default output constraint: {expected}\n", err
        assert not (tmp_path / "out").exists()


def test_every_run_option_is_described():
    parser = build_parser()
    run = next(a for a in parser._subparsers._group_actions[0].choices.items() if a[0] == "run")[1]
    undocumented = [a.option_strings[0] for a in run._actions if a.option_strings and not (a.help or "").strip()]
    assert undocumented == []
    plan = next(a for a in run._actions if "--plan" in a.option_strings)
    assert plan.choices == ["prefix", "input"]
    quant = next(a for a in run._actions if "--quantization" in a.option_strings)
    assert "int8 | int4 | gguf" in quant.help


def test_each_engine_option_is_written_once_on_its_engine_config_field():
    """An engine option is declared once, on its EngineConfig field (`engine.config.option`); the job's field,
    its --flag, the fingerprint and the engine's keyword arguments follow from it."""
    from engine.config import declared_options
    from pipeline.spec import ENGINE_FIELDS, FINGERPRINT_FIELDS, JobSpec

    options = declared_options()
    assert set(options) == set(ENGINE_FIELDS) and {"dtype", "max_num_seqs", "tensor_parallel_size"} <= set(options)
    assert "block_size" not in options  # an EngineConfig field without `option`: through engine_options only
    run = next(a for a in build_parser()._subparsers._group_actions[0].choices.items() if a[0] == "run")[1]
    flags = {a.option_strings[0]: a for a in run._actions if a.option_strings}
    for name, f in options.items():
        assert JobSpec.model_fields[name].description.startswith(f.metadata["help"]), name
        assert flags["--" + name.replace("_", "-")].help.startswith(f.metadata["help"]), name
        assert (name in FINGERPRINT_FIELDS) == f.metadata["changes_outputs"], name
    assert [n for n in ("dtype", "quantization", "max_model_len", "seed", "device", "max_num_seqs")
            if n in FINGERPRINT_FIELDS] == ["dtype", "quantization", "max_model_len", "seed"]
    assert flags["--speculative"].choices == ["auto", "ngram", "suffix", "draft_model", "off"]
    assert flags["--max-num-seqs"].help == "most requests running at once (engine default 128)"
    spec = JobSpec(input="in", output="out", max_num_seqs=4, enable_prefix_caching=False)
    assert spec.engine_kwargs() == {"dtype": "auto", "device": "auto", "seed": 0, "max_num_seqs": 4,
                                    "enable_prefix_caching": False}
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        JobSpec(input="in", output="out", tensor_parallel_size=0)


def test_progress_says_what_the_job_is_doing_while_the_model_loads(tmp_path, capsys, monkeypatch):
    import engine

    from pipeline import JobSpec, run_job
    from pipeline.testing import FakeLLM

    monkeypatch.setattr(engine, "LLM", lambda model, **kw: FakeLLM())
    inp = tmp_path / "in.parquet"
    pl.DataFrame({"id": [1, 2, 3], "prompt": ["A.", "B.", "C."]}).write_parquet(inp)
    spec = JobSpec(input=str(inp), output=str(tmp_path / "out"), max_tokens=2, shard_size=2,
                   engine_options={"seed": 11}, plan="input")
    run_job(spec)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("tokenmill: ")]
    assert lines[0] == "tokenmill: 3 rows in 2 shards to run"
    assert lines[1] == "tokenmill: loading model smollm2-135m-instruct ..."
    assert lines[2].startswith("tokenmill: model loaded in ")
    assert err.index("model loaded") < err.index("3/3")  # the progress bar starts after the model is loaded


def test_the_rows_and_shards_to_run_are_counted_in_the_singular_for_one(tmp_path, capsys):
    from pipeline import JobSpec, run_job
    from pipeline.testing import FakeLLM

    inp = tmp_path / "in.parquet"
    pl.DataFrame({"id": [1, 2, 3], "prompt": ["A.", "B.", "C."]}).write_parquet(inp)

    def first_line(**fields) -> str:
        run_job(JobSpec(input=str(inp), output=str(tmp_path / "out"), max_tokens=2, plan="input", **fields), FakeLLM())
        return next(line for line in capsys.readouterr().err.splitlines() if line.startswith("tokenmill: "))

    assert first_line(shard_size=10, overwrite=True) == "tokenmill: 3 rows in 1 shard to run"
    assert first_line(shard_size=2, overwrite=True) == "tokenmill: 3 rows in 2 shards to run"
    (tmp_path / "out" / "_job" / "done" / "part-00001.json").unlink()  # its shard is to run again on resume
    assert first_line(shard_size=2) == "tokenmill: 1 row in 1 shard to run (1 shard done before)"


def _fake_job(tmp_path, name: str = "out", seed: int = 13) -> str:
    """A finished 2-row job at tmp_path/name, run on the FakeLLM (its metrics are what `report` reads)."""
    from pipeline import JobSpec, run_job
    from pipeline.testing import FakeLLM

    inp = tmp_path / "prompts.parquet"
    if not inp.exists():
        pl.DataFrame({"id": [1, 2], "prompt": ["Say yes.", "Say no."]}).write_parquet(inp)
    out = str(tmp_path / name)
    run_job(JobSpec(input=str(inp), output=out, max_tokens=2, progress=False, engine_options={"seed": seed}),
            FakeLLM())
    return out


def test_report_into_a_closed_pipe_exits_quietly(tmp_path):
    import subprocess
    import sys

    out = _fake_job(tmp_path)
    read_end, write_end = os.pipe()
    os.close(read_end)  # a reader already gone (a `head` that has exited): the first write meets a closed pipe
    try:
        proc = subprocess.run([sys.executable, "-m", "pipeline.cli", "report", out], stdout=write_end,
                              stderr=subprocess.PIPE, text=True, timeout=120,
                              cwd=os.path.dirname(os.path.dirname(__file__)))
    finally:
        os.close(write_end)
    assert proc.stderr == ""  # no BrokenPipeError traceback, no "Exception ignored" at exit
    assert proc.returncode == 141  # 128 + SIGPIPE, as a shell reports a tool whose pipe closed


def test_report_on_a_file_says_it_wants_a_job_output_folder(tmp_path, capsys):
    out = _fake_job(tmp_path)
    part = os.path.join(out, "part-00000.parquet")
    assert main(["report", part]) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"tokenmill: {part} is a file, not a job output folder: give the --output folder of a tokenmill run "
        f"(it holds part-*.parquet and _job/)"]
    assert main(["report", out]) == 0 and "rows_ok" in capsys.readouterr().out


def test_report_skips_a_damaged_run_file_and_says_so_in_one_line_when_none_is_readable(tmp_path, capsys):
    import warnings

    out = _fake_job(tmp_path)
    _fake_job(tmp_path)  # a second run of the same job: two run files
    runs = os.path.join(out, "_job", "runs")
    first, second = sorted(os.listdir(runs))
    with open(os.path.join(runs, first), "r+b") as f:
        f.truncate(100)
    with warnings.catch_warnings():
        warnings.simplefilter("always")  # the same warning again in this process
        assert main(["report", out]) == 0
        captured = capsys.readouterr()
        assert captured.out.startswith(f"job at {out}: 1 run(s); cost of all runs ")
        assert f"run_id                         {second.rsplit('-', 1)[1][:-len('.parquet')]}" in captured.out
        assert captured.err.splitlines() == [
            f"tokenmill: warning: {os.path.join(runs, first)}: skipped, not a readable Parquet file "
            f"(parquet: File out of specification: The file must end with PAR1 or PARE)"]

        with open(os.path.join(runs, second), "wb") as f:
            f.write(b"garbage")
        assert main(["report", out]) == 1
        captured = capsys.readouterr()
        assert captured.out == ""
        err = captured.err.splitlines()
        assert len(err) == 3 and all(line.startswith("tokenmill: warning: ") for line in err[:2])
        assert err[2] == (f"tokenmill: no readable job metrics at {out}/_job: all 2 metrics file(s) were skipped "
                          f"(see the warnings)")


def test_cluster_run_with_an_unreachable_prefect_server_is_one_line_naming_prefect_api_url(tmp_path):
    # in a child process: Prefect configures its logging once per process, on the streams of the
    # moment; in this one they would be this test's capture, closed when it ends, and every later
    # Prefect test's logs would then fail on a closed file
    import subprocess
    import sys
    import time

    import pytest

    import importlib.util

    if importlib.util.find_spec("prefect_dask") is None:  # found, not imported (see above)
        pytest.skip("prefect-dask is not installed")
    inp = tmp_path / "in.parquet"
    pl.DataFrame({"id": [1], "prompt": ["Hi."]}).write_parquet(inp)
    out = tmp_path / "out"
    api = "http://127.0.0.1:9/api"  # the discard port: nothing listens there, a connection is refused at once
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "flows.cli", "run", "--input", str(inp), "--output", str(out),
                           "--cluster", "tcp://127.0.0.1:1", "--no-progress"],
                          env={**os.environ, "PREFECT_API_URL": api}, capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(__file__)))
    assert proc.returncode == 1 and time.monotonic() - started < 60
    err = proc.stderr.splitlines()
    assert len(err) == 1, err  # no Prefect traceback
    assert err[0].startswith(f"tokenmill: cannot reach the Prefect server at PREFECT_API_URL={api} (ConnectError: ")
    assert "refused" in err[0] and err[0].endswith("start it (prefect server start) or set PREFECT_API_URL to the "
                                                   "server the Dask workers report to")
    assert not out.exists()


def test_pipeline_alone_refuses_cluster_in_one_line_before_anything_is_written(tmp_path, capsys):
    """`pipeline` never imports `flows`: `python -m pipeline` (pipeline.cli.main without a cluster runner)
    refuses --cluster in one line, exit 1, and writes nothing; the `tokenmill` script (flows.cli) runs it."""
    import sys

    inp = tmp_path / "in.parquet"
    pl.DataFrame({"id": [1], "prompt": ["Hi."]}).write_parquet(inp)
    out = tmp_path / "out"
    flows_before = {m for m in sys.modules if m == "flows" or m.startswith("flows.")}
    assert main(["run", "--input", str(inp), "--output", str(out), "--cluster", "tcp://127.0.0.1:1",
                 "--no-progress"]) == 1
    assert capsys.readouterr().err.splitlines() == [
        "tokenmill: --cluster runs the job through the Prefect flow, which `python -m pipeline` does not import: "
        "use the tokenmill command (or python -m flows.cli)"]
    assert not out.exists()
    assert {m for m in sys.modules if m == "flows" or m.startswith("flows.")} == flows_before


def test_colliding_sampling_and_engine_options_name_both_sources_and_the_parameter(tmp_path, capsys):
    from pipeline import JobSpec, run_job
    from pipeline.testing import FakeLLM

    inp = tmp_path / "in.parquet"
    pl.DataFrame({"id": [1], "prompt": ["Hi."]}).write_parquet(inp)
    out = tmp_path / "out"
    run = ["run", "--input", str(inp), "--output", str(out), "--no-progress"]

    def refused(*options: str) -> list[str]:
        assert main(run + list(options)) == 1
        err = capsys.readouterr().err.splitlines()
        assert all(line.startswith("tokenmill run: error: ") for line in err) and not out.exists()
        return [line.removeprefix("tokenmill run: error: ") for line in err]

    assert refused("--sampling-option", "top_k=5", "--top-k", "3") == [
        "--sampling-option top_k=5: top_k is also set by --top-k 3; give it once"]
    assert refused("--sampling-option", "top_k=5") == [
        "--sampling-option top_k=5: top_k has an option of its own, --top-k (here -1); use --top-k 5"]
    # a list as the command line takes it: --stop repeats, each value shell-quoted; an unset default said so
    # (an empty stop string, which --stop refuses too, is never suggested)
    assert refused("--sampling-option", 'stop=["END", "two words", ""]') == [
        "--sampling-option stop=[\"END\", \"two words\", \"\"]: stop has an option of its own, --stop (not set "
        "here); use --stop END --stop 'two words'"]
    assert refused("--sampling-option", "stop=") == [
        "--sampling-option stop=: stop has an option of its own, --stop (not set here); use --stop TEXT (an empty "
        "stop string is refused)"]
    assert refused("--sampling-option", "top_k=") == [  # the empty-stop wording is for stop alone
        "--sampling-option top_k=: top_k has an option of its own, --top-k (here -1); use --top-k ''"]
    assert refused("--sampling-option", "stop=", "--stop", "a b") == [
        "--sampling-option stop=: stop is also set by --stop 'a b'; give it once"]
    assert refused("--sampling-option", "min_tokens=2", "--sampling-option", "min_tokens=3") == [
        "--sampling-option: min_tokens is given twice (min_tokens=2 and min_tokens=3); give it once"]
    assert refused("--sampling-option", "structured_outputs={\"regex\": \"a+\"}", "--choice", "a,b") == [
        "--sampling-option structured_outputs={\"regex\": \"a+\"}: structured_outputs is also set by --choice a,b; "
        "give it once"]
    assert refused("--engine-option", "max_num_seqs=4", "--max-num-seqs", "3") == [
        "--engine-option max_num_seqs=4: max_num_seqs is also set by --max-num-seqs 3; give it once"]
    assert refused("--storage-option", "secret=a", "--storage-option", "secret=b") == [
        "--storage-option: secret is given twice (secret=********** and secret=**********); give it once"]
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text("sampling_options:\n  top_p: 0.5\n")
    assert refused("--spec", str(spec_file), "--top-p", "0.9") == [
        f"sampling_options.top_p: 0.5 in {spec_file}: top_p is also set by --top-p 0.9; give it once"]

    # a command-line key still replaces the same key of the spec file; one key twice with one value is fine
    spec_file.write_text("sampling_options:\n  min_tokens: 1\n")
    args = build_parser().parse_args(["run", "--spec", str(spec_file), "--input", "i", "--output", "o",
                                      "--sampling-option", "min_tokens=2", "--sampling-option", "min_tokens=2"])
    assert spec_from_args(args).sampling_options == {"min_tokens": 2}
    # from Python: both values and the field, instead of "got multiple values for keyword argument"
    spec = JobSpec(input=str(inp), output=str(out), top_k=3, sampling_options={"top_k": 5}, progress=False)
    try:
        run_job(spec, FakeLLM())
        raise AssertionError("not refused")
    except ValueError as exc:
        assert str(exc) == ("sampling_options sets top_k (5), which the job's top_k field sets too (3): set each "
                            "once, in its own field")
    assert not out.exists()


def test_an_option_value_that_looks_like_json_but_is_not_says_so(tmp_path, capsys):
    import pytest

    inp = tmp_path / "in.parquet"
    pl.DataFrame({"id": [1], "prompt": ["Hi."]}).write_parquet(inp)
    with pytest.raises(SystemExit) as e:
        main(["run", "--input", str(inp), "--output", str(tmp_path / "out"),
              "--engine-option", "speculative_config={not json"])
    assert e.value.code == 1  # a bad option, as every other (2 is only "the output holds another job")
    err = capsys.readouterr().err
    assert "speculative_config={not json: not valid JSON (Expecting property name enclosed in double quotes" in err
    assert not (tmp_path / "out").exists()
    # a plain word is still a string value
    from pipeline.cli import _kv

    assert _kv("quantization=gguf") == ("quantization", "gguf") and _kv("seed=7") == ("seed", 7)


def test_a_demo_rerun_replaces_the_previous_demo_output_unless_no_overwrite(tmp_path, capsys):
    from pipeline import JobSpec, cache_llm, read_metrics
    from pipeline.testing import FakeLLM

    cache_llm(JobSpec(input="-", output="-", engine_options={"seed": 13}), FakeLLM(max_model_len=4096))  # own key
    out = tmp_path / "demo"
    demo = ["demo", "--output", str(out), "--max-tokens", "2", "--no-progress", "--engine-option", "seed=13"]
    assert main(demo + ["--limit", "3"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.endswith(f"-> {out}, model smollm2-135m-instruct")  # nothing to replace yet
    assert pl.read_parquet(out / "part-00000.parquet").height == 3

    assert main(demo + ["--limit", "2"]) == 0  # another option: no refusal, the old output is replaced
    assert capsys.readouterr().out.splitlines()[0].endswith(
        "(replacing the previous demo output there; --no-overwrite resumes it instead)")
    assert sorted(p.name for p in out.glob("part-*")) == ["part-00000.parquet"]
    assert pl.read_parquet(out / "part-00000.parquet").height == 2
    m = read_metrics(str(out))
    assert m.height == 1 and m["rows_ok"].to_list() == [2]  # the first demo's cost rows went with it

    assert main(demo + ["--limit", "2", "--no-overwrite"]) == 0  # resumes, as `tokenmill run` does
    m = read_metrics(str(out))
    assert m["rows_skipped"].to_list() == [0, 2] and m["rows_ok"].to_list() == [2, 0]
    capsys.readouterr()
    assert main(demo + ["--limit", "3", "--no-overwrite"]) == 2  # a changed option without overwrite: refused
    assert "limit: 2 -> 3" in capsys.readouterr().err

    (tmp_path / "afile").write_text("keep")  # an output that is a file: run's one line (it was a NotADirectoryError)
    assert main(demo + ["--output", str(tmp_path / "afile")]) == 1
    assert capsys.readouterr().err.splitlines() == [f"tokenmill: output {tmp_path / 'afile'} is a file; give a folder "
                                                    f"(or prefix) URL"]
    assert (tmp_path / "afile").read_text() == "keep"
    # the synthetic data sets max_tokens per row, which --max-tokens does not change: said (it was silent)
    assert main(demo + ["--limit", "2", "--job", "synthetic", "--output", str(tmp_path / "syn")]) == 0
    assert capsys.readouterr().out.splitlines()[1] == (
        "tokenmill demo: note: synthetic.parquet sets max_tokens per row (64) in 30 of 30 rows; --max-tokens 2 "
        "applies only where it is null")
    assert pl.read_parquet(tmp_path / "syn" / "part-00000.parquet")["completion_tokens"].to_list() == [64, 64]


def test_a_demo_into_another_jobs_output_keeps_it_unless_overwrite(tmp_path, capsys):
    """`tokenmill demo --output DIR` replaced whatever DIR held, another job's part files and cost history
    or another tool's part files (found by a new-user trial); only a previous demo's output is replaced now,
    anything else is refused in one line (exit 2, as `tokenmill run` refuses it) and kept byte for byte."""
    from pipeline import JobSpec, cache_llm, read_metrics
    from pipeline.testing import FakeLLM

    cache_llm(JobSpec(input="-", output="-", engine_options={"seed": 29}), FakeLLM(max_model_len=4096))  # own key
    inp = tmp_path / "in.parquet"
    pl.DataFrame({"id": [1, 2], "prompt": ["Say yes.", "Say no."]}).write_parquet(inp)
    job = tmp_path / "job"
    opts = ["--max-tokens", "2", "--no-progress", "--engine-option", "seed=29"]
    assert main(["run", "--input", str(inp), "--output", str(job), *opts]) == 0
    before = {p.relative_to(job): p.read_bytes() for p in job.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert main(["demo", "--output", str(job), "--limit", "2", *opts]) == 2
    assert capsys.readouterr() == ("", (
        f"tokenmill: {job} holds the output of another job (input {inp.as_uri()}), not a previous demo's output: "
        f"the demo keeps it; --overwrite replaces it, or choose another --output\n"))
    assert {p.relative_to(job): p.read_bytes() for p in job.rglob("*") if p.is_file()} == before

    foreign = tmp_path / "foreign"  # another tool's part file, no manifest
    foreign.mkdir()
    pl.DataFrame({"x": [7]}).write_parquet(foreign / "part-00000.parquet")
    data = (foreign / "part-00000.parquet").read_bytes()
    assert main(["demo", "--output", str(foreign), "--limit", "2", *opts]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"tokenmill: {foreign} holds part files (part-00000.parquet, ...) and no job manifest, not a previous demo's "
        f"output: the demo keeps it; --overwrite replaces it, or choose another --output"]
    assert (foreign / "part-00000.parquet").read_bytes() == data

    assert main(["demo", "--output", str(job), "--limit", "2", "--overwrite", *opts]) == 0  # asked for: replaced
    assert capsys.readouterr().out.splitlines()[0].endswith(
        f"(replacing the output of another job (input {inp.as_uri()}) there: overwrite is on)")
    assert read_metrics(str(job))["rows_ok"].to_list() == [2]
    assert "reference_label" in pl.read_parquet(job / "part-00000.parquet").columns  # the demo's rows

