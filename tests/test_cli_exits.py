"""The `tokenmill` command's exit codes and one-line errors: bad options and flags, jobs whose rows all
fail (exit 4), internal errors, signals, and model files that cannot be read."""
from __future__ import annotations

import os
import signal

import polars as pl
import pytest

from pipeline.cli import build_parser, main, spec_from_args


def test_exit_codes_have_one_meaning_each(tmp_path, capsys):
    """0 done; 1 any bad option or input, argparse's usage errors included; 2 only for an output holding
    another job (what --overwrite fixes); 3 only for an output another run holds."""
    import pytest

    from pipeline import JobSpec, JobSpecChanged, cache_llm, run_job
    from pipeline.testing import FakeLLM

    inp = tmp_path / "in.parquet"
    pl.DataFrame({"id": [1, 2], "prompt": ["Say yes.", "Say no."]}).write_parquet(inp)
    out = tmp_path / "out"
    cache_llm(JobSpec(input="-", output="-", engine_options={"seed": 23}), FakeLLM())  # a key no other test uses
    run = ["run", "--input", str(inp), "--output", str(out), "--no-progress", "--engine-option", "seed=23"]

    def usage_error(*argv: str) -> str:
        with pytest.raises(SystemExit) as exc:
            main(list(argv))
        assert exc.value.code == 1, argv
        return capsys.readouterr().err

    # a bad value: one line naming the option (test_a_bad_option_value_is_one_line_naming_the_option)
    assert usage_error(*run, "--plan", "bogus").splitlines() == [
        "tokenmill run: error: --plan must be prefix|input, got 'bogus'"]
    assert usage_error(*run, "--shard-size", "x").splitlines() == [
        "tokenmill run: error: --shard-size must be an integer, got 'x'"]
    # a usage error: one line saying what is wrong and one saying where the options are, not run's 30-line
    # usage first
    assert usage_error("run", "--output", str(out)).splitlines() == [  # the run command's error, not tokenmill's
        "tokenmill run: error: the following arguments are required: --input (or a --spec file that sets it)",
        "see 'tokenmill run --help'"]
    assert usage_error("run", "--no-progress").splitlines()[0] == (
        "tokenmill run: error: the following arguments are required: --input, --output (or a --spec file that "
        "sets them)")
    frob = usage_error("frobnicate").splitlines()
    assert len(frob) == 2 and frob[0].startswith("tokenmill: error: argument command: invalid choice: 'frobnicate'")
    assert frob[1] == "see 'tokenmill --help'"
    assert main(run + ["--shard-size", "0"]) == 1  # the same option, refused by the spec's validation
    assert capsys.readouterr().err.splitlines() == ["tokenmill run: error: --shard-size must be an integer >= 1, got 0"]
    assert not out.exists()

    assert main(run + ["--max-tokens", "3"]) == 0
    capsys.readouterr()
    assert main(run + ["--max-tokens", "4"]) == 2
    err = capsys.readouterr().err
    assert "max_tokens: 3 -> 4" in err and "overwrite=True" not in err  # the flag, not the Python API's words
    assert err.rstrip().endswith("Re-run with --overwrite to discard its outputs and start over, or choose another "
                                 "output.")
    with pytest.raises(JobSpecChanged, match=r"Re-run with --overwrite \(overwrite=True\) to discard"):
        run_job(spec_from_args(build_parser().parse_args(run + ["--max-tokens", "4"])))  # Python: both spellings
    assert main(run + ["--max-tokens", "4", "--output", str(inp)]) == 1  # an output that is a file: not 2
    assert capsys.readouterr().err.startswith(f"tokenmill: output {inp} is a file")
    assert main(run + ["--max-tokens", "4", "--overwrite"]) == 0
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0


def test_a_bad_option_value_is_one_line_naming_the_option(tmp_path, capsys, monkeypatch):
    """A bad value printed two lines (`tokenmill: invalid job options:` then the problem, or argparse's
    `argument --plan: invalid choice: ...` then `see ...`) in pydantic's words (`Input should be greater
    than or equal to 1 (got 0)`), or named the field rather than the option (`invalid default sampling
    parameters: max_tokens must be ...`). Now one line, the option as typed, in the words of the engine's
    rules (`SamplingParams.validate`, `EngineConfig`) where they have one; exit 1, nothing written."""
    from engine import SamplingParams

    inp = tmp_path / "in.parquet"
    pl.DataFrame({"id": [1], "prompt": ["Hi."]}).write_parquet(inp)
    out = tmp_path / "out"
    monkeypatch.chdir(tmp_path)

    def refused(*argv: str) -> list[str]:
        try:
            code = main(list(argv))
        except SystemExit as exc:  # argparse's own checks (types, choices)
            code = exc.code
        assert code == 1, argv
        assert not out.exists() and not (tmp_path / "demo_output").exists()
        return capsys.readouterr().err.splitlines()

    run = ["run", "--input", str(inp), "--output", str(out), "--no-progress"]
    cases = {
        ("--temperature", "-1"): "--temperature must be a finite number >= 0, got -1.0",
        ("--temperature", "hot"): "--temperature must be a number, got 'hot'",
        ("--max-tokens", "0"): "--max-tokens must be an integer >= 1, got 0",
        ("--max-tokens", "1.5"): "--max-tokens must be an integer, got '1.5'",
        ("--top-p", "2"): "--top-p must be in (0, 1], got 2.0",
        ("--top-k", "-5"): "--top-k must be -1, 0 (all) or a positive integer, got -5",
        ("--n", "0"): "--n must be an integer >= 1, got 0",
        ("--stop", ""): "--stop cannot contain an empty string ('')",
        ("--shard-size", "0"): "--shard-size must be an integer >= 1, got 0",
        ("--shards-in-flight", "0"): "--shards-in-flight must be an integer >= 1, got 0",
        ("--price-per-hour", "-1"): "--price-per-hour must be a number >= 0, got -1.0",
        ("--output-token-weight", "0"): "--output-token-weight must be a number > 0, got 0.0",
        ("--lease-ttl-s", "0"): "--lease-ttl-s must be a number >= 0.1, got 0.0",
        ("--plan", "bogus"): "--plan must be prefix|input, got 'bogus'",
        ("--speculative", "fast"): "--speculative must be auto|ngram|suffix|draft_model|off, got 'fast'",
        ("--dtype", "fp7"): "--dtype must be auto|float32|bfloat16|float16, got 'fp7'",
        ("--device", "tpu"): "--device must be auto|cpu|cuda, got 'tpu'",
        ("--quantization", "q9"): "--quantization must be None or none|int8|int4|gguf|w8a8, got 'q9'",
        ("--max-num-seqs", "0"): "--max-num-seqs must be a positive integer, got 0",
        ("--max-model-len", "0"): "--max-model-len must be an integer > 1, got 0",
    }
    for (flag, value), line in cases.items():
        assert refused(*run, flag, value) == [f"tokenmill run: error: {line}"], flag
    assert refused("run", "--input", "", "--output", str(out)) == [
        "tokenmill run: error: --input must be a path or URL, got an empty string"]
    [budget] = refused(*run, "--kv-cache-memory-bytes", "10")
    assert budget.startswith("tokenmill run: error: --kv-cache-memory-bytes 10 is below the minimum of 368640 bytes")
    # the engine's own words, the field's name given as the option
    assert SamplingParams(max_tokens=0).validate() == "max_tokens must be an integer >= 1, got 0"
    assert SamplingParams(top_p=2.0).validate() == "top_p must be in (0, 1], got 2.0"
    # a value from a --spec file: its file and line; two bad options: a line each; `tokenmill demo` too
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text(f"input: {inp}\noutput: {out}\nmax_tokens: 0\n")
    assert refused("run", "--spec", str(spec_file)) == [
        f"tokenmill run: error: {spec_file}:3: max_tokens must be an integer >= 1, got 0"]
    assert refused(*run, "--shard-size", "0", "--lease-ttl-s", "0") == [
        "tokenmill run: error: --shard-size must be an integer >= 1, got 0",
        "tokenmill run: error: --lease-ttl-s must be a number >= 0.1, got 0.0"]
    assert refused("demo", "--top-p", "0")[-1] == "tokenmill demo: error: --top-p must be in (0, 1], got 0.0"


def test_an_unknown_flag_is_refused_by_the_command_it_follows(tmp_path, capsys):
    """`tokenmill run --bogus` points to `tokenmill run --help`, which lists run's options, not to
    `tokenmill --help` (argparse's top-level parser used to report it); exit 1 like every usage error."""
    import pytest

    def usage_error(*argv: str) -> list[str]:
        with pytest.raises(SystemExit) as exc:
            main(list(argv))
        assert exc.value.code == 1, argv
        return capsys.readouterr().err.splitlines()

    assert usage_error("run", "--bogus") == ["tokenmill run: error: unrecognized arguments: --bogus",
                                             "see 'tokenmill run --help'"]
    assert usage_error("run", "--input", "a", "--output", "b", "--bogus", "x") == [
        "tokenmill run: error: unrecognized arguments: --bogus x", "see 'tokenmill run --help'"]
    assert usage_error("demo", "--bogus") == ["tokenmill demo: error: unrecognized arguments: --bogus",
                                              "see 'tokenmill demo --help'"]
    assert usage_error("report", str(tmp_path), "--bogus") == [
        "tokenmill report: error: unrecognized arguments: --bogus", "see 'tokenmill report --help'"]


def test_a_prefix_of_an_option_is_refused_as_an_unknown_option(tmp_path, capsys):
    """argparse took `--max-token 5` for `--max-tokens 5` (prefix matching): now it is refused as the typo
    `--max-tokns 5` is, so that what a command means cannot change when a flag is added."""
    import pytest

    def usage_error(*argv: str) -> list[str]:
        with pytest.raises(SystemExit) as exc:
            main(list(argv))
        assert exc.value.code == 1, argv
        return capsys.readouterr().err.splitlines()

    run = ["run", "--input", "in.parquet", "--output", "out"]
    for typo in ("--max-tokns", "--max-token", "--price"):
        assert usage_error(*run, typo, "5") == [f"tokenmill run: error: unrecognized arguments: {typo} 5",
                                                "see 'tokenmill run --help'"]
    assert usage_error(*run, "--no-prog") == ["tokenmill run: error: unrecognized arguments: --no-prog",
                                              "see 'tokenmill run --help'"]
    assert usage_error("demo", "--jo", "synthetic") == ["tokenmill demo: error: unrecognized arguments: --jo synthetic",
                                                        "see 'tokenmill demo --help'"]
    assert usage_error("report", str(tmp_path), "--al") == ["tokenmill report: error: unrecognized arguments: --al",
                                                            "see 'tokenmill report --help'"]
    args = build_parser().parse_args(run + ["--max-tokens=5", "--no-progress", "-v"])  # the full names still work
    assert (args.max_tokens, args.progress, args.verbose) == (5, False, True)


def test_a_job_whose_every_row_is_an_error_row_exits_4_naming_the_most_common_error(tmp_path, capsys):
    """Exit 4: the job ran to the end and is booked, but nothing was generated (every row an error row: a
    job-level mistake such as a context too small for every prompt). A re-run resumes nothing and says
    the same; one good row, or an empty input, is exit 0 (some rows failed: one warning line, which said
    nothing before; found by a new-user trial)."""
    from pipeline import JobSpec, cache_llm, read_metrics
    from pipeline.testing import FakeLLM

    cache_llm(JobSpec(input="-", output="-", engine_options={"seed": 12}), FakeLLM())  # a key no other test uses
    inp = tmp_path / "in.parquet"
    pl.DataFrame({"id": [1, 2, 3, 4], "prompt": ["", "   ", None, ""]}).write_parquet(inp)
    out = tmp_path / "out"
    run = ["run", "--input", str(inp), "--output", str(out), "--no-progress", "--engine-option", "seed=12",
           "--shard-size", "2", "--plan", "input"]
    for _ in range(2):  # the run, then a re-run that finds every shard done
        assert main(run) == 4
        captured = capsys.readouterr()
        assert "cost report" in captured.out
        assert captured.err.splitlines()[-1] == (
            f"tokenmill: every row of the job is an error row (4 rows, nothing generated); the most common error "
            f"of part-00000.parquet (2 of its 2 rows): prompt is empty; see the error column of {out}/part-*.parquet "
            f"(exit 4)")
    assert read_metrics(str(out))["status"].to_list() == ["ok", "ok"]  # done and booked, not failed

    pl.DataFrame({"id": [1, 2], "prompt": ["", "Say yes."]}).write_parquet(inp)
    assert main(run + ["--overwrite"]) == 0  # one error row of two: a warning, exit 0
    assert capsys.readouterr().err.splitlines() == [
        f"tokenmill: warning: 1 of this run's 2 rows is an error row; see the error column of {out}/part-*.parquet"]
    pl.DataFrame({"id": [], "prompt": []}, schema={"id": pl.Int64, "prompt": pl.String}).write_parquet(inp)
    assert main(run + ["--overwrite"]) == 0


def test_exit_4_names_the_first_error_when_no_error_is_more_common_than_another(tmp_path, capsys):
    """'the most common error (1 of its 3 rows)' said nothing when each row's error differs: then the line
    counts the distinct errors and gives the first, with its id; one row's error is that row's."""
    from pipeline import JobSpec, cache_llm
    from pipeline.testing import FakeLLM

    cache_llm(JobSpec(input="-", output="-", engine_options={"seed": 12}), FakeLLM())
    inp = tmp_path / "in.parquet"
    out = tmp_path / "out"
    run = ["run", "--input", str(inp), "--output", str(out), "--no-progress", "--engine-option", "seed=12",
           "--plan", "input", "--overwrite"]
    end = f"; see the error column of {out}/part-*.parquet (exit 4)"
    for frame, line in (
            ({"id": ["a", "b"], "prompt": [None, ""]},
             "(2 rows, nothing generated); the 2 rows of part-00000.parquet have 2 distinct errors, the first "
             "(id 'a'): prompt is null"),
            # errors alike but for the value they quote are one error: a column of the wrong type
            ({"id": ["a", "b", "c"], "prompt": [1, 2, 3]},
             "(3 rows, nothing generated); the most common error of part-00000.parquet (3 of its 3 rows, alike but "
             "for the values quoted): prompt must be a string, got int 1"),
            # and so are those that differ in several numbers: one max_tokens too large for every prompt
            ({"id": ["a", "b"], "prompt": ["Hi.", "Say something longer."], "max_tokens": [10 ** 6, 10 ** 6]},
             "(2 rows, nothing generated); the most common error of part-00000.parquet (2 of its 2 rows, alike but "
             "for the values quoted): max_tokens 1000000 does not fit the engine's context: the prompt has"),
            ({"id": [7], "prompt": [""]},
             "(1 row, nothing generated); the error of part-00000.parquet's one row (id 7): prompt is empty"),
            ({"id": [1, 2, 3], "prompt": [None, "", ""]},  # one error is the most common: said as before
             "(3 rows, nothing generated); the most common error of part-00000.parquet (2 of its 3 rows): prompt "
             "is empty")):
        pl.DataFrame(frame).write_parquet(inp)
        assert main(run) == 4
        last = capsys.readouterr().err.splitlines()[-1]
        head = f"tokenmill: every row of the job is an error row {line}"
        if line.endswith("the prompt has"):  # (the rest quotes the first prompt's length and what it leaves)
            assert last.startswith(head + " ") and last.endswith(end), last
        else:
            assert last == head + end


def test_exit_4_of_a_request_file_job_names_its_errors_jsonl_files(tmp_path, capsys):
    """A request-file job that writes only jsonl has no part-*.parquet in its output: the last line names
    the errors-*.jsonl files and the error of its first one (with its custom_id)."""
    import json

    from pipeline import JobSpec, cache_llm
    from pipeline.testing import FakeLLM

    cache_llm(JobSpec(input="-", output="-", engine_options={"seed": 19}), FakeLLM())  # a key no other test uses
    inp, out = tmp_path / "requests.jsonl", tmp_path / "out"
    inp.write_text("".join(json.dumps({"custom_id": c, "url": "/v1/chat/completions", "body": {
        "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}}) + "\n" for c in "ab"))
    run = ["run", "--input", str(inp), "--output", str(out), "--no-progress", "--engine-option", "seed=19"]
    assert main(run) == 4
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"tokenmill: every row of the job is an error row (2 rows, nothing generated); the most common error of "
        f"errors-00000.jsonl (2 of its 2 lines, alike but for the values quoted): line 1: body.tools is not "
        f"supported by tokenmill; see the error lines of {out}/errors-*.jsonl (exit 4)")
    assert not list(out.glob("part-*.parquet")) and (out / "errors-00000.jsonl").exists()
    assert main(run[:-2] + ["--engine-option", "seed=19", "--output-format", "parquet,jsonl", "--overwrite"]) == 4
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        f"values quoted): line 1: body.tools is not supported by tokenmill; see the error column of "
        f"{out}/part-*.parquet and the error lines of {out}/errors-*.jsonl (exit 4)")
    # a first line without an id: its line number names it, never "(id None)"
    inp.write_text("{not json\n" + inp.read_text().splitlines(keepends=True)[0])
    assert main(run + ["--overwrite"]) == 4
    assert capsys.readouterr().err.splitlines()[-1].startswith(
        "tokenmill: every row of the job is an error row (2 rows, nothing generated); the 2 lines of "
        "errors-00000.jsonl have 2 distinct errors, the first: line 1: not valid JSON (")


def test_an_internal_error_is_one_line_with_the_traceback_on_verbose(tmp_path, capsys, monkeypatch):
    """An exception other than the refusals (a bug in the engine, a MemoryError) exits 1 with one
    line naming it; --verbose adds the traceback."""
    import pipeline.cli as cli

    pl.DataFrame({"prompt": ["a", "b"]}).write_parquet(tmp_path / "in.parquet")

    def broken(spec):
        raise RuntimeError("the kernel exploded")

    monkeypatch.setattr(cli, "run_job", broken)
    argv = ["run", "--input", str(tmp_path / "in.parquet"), "--output", str(tmp_path / "out")]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "tokenmill: failed: RuntimeError: the kernel exploded (an internal error;" in err
    assert "Traceback" not in err
    assert main([*argv, "--verbose"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "RuntimeError: the kernel exploded" in err


# Put first on PYTHONPATH as sitecustomize.py: holds the process at its first `import torch` (the heavy
# imports every command starts with) once it has written GATE_READY, until a signal ends the wait.
IMPORT_GATE = """
import os, sys, time

class _Gate:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            open(os.environ["GATE_READY"], "w").close()
            while True:
                time.sleep(0.02)
        return None

sys.meta_path.insert(0, _Gate())
"""
# what pip writes for the `tokenmill` console script
CONSOLE_SCRIPT = """import re
import sys
from flows.cli import main
if __name__ == '__main__':
    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])
    sys.exit(main())
"""


def default_sigint() -> None:
    """A child's SIGINT back to the default (a KeyboardInterrupt in Python): a suite started with SIGINT
    ignored (`nohup pytest &`, a background job) passes SIG_IGN on to its children, which would then
    never see the Ctrl-C these tests send."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("command,signum", [("tokenmill", signal.SIGINT), ("tokenmill", signal.SIGTERM),
                                            ("flows.deploy", signal.SIGINT)])
def test_an_interrupt_while_the_command_imports_torch_ends_in_one_line(tmp_path, command, signum):
    """A Ctrl-C in the first second or two of `tokenmill run` or `python -m flows.deploy` (while torch,
    polars and prefect load) printed a Python traceback (a SIGTERM ended it without a word); it now
    prints the line of an interrupt before the job started, exit 128 + the signal."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    gate = tmp_path / "gate"
    gate.mkdir()
    (gate / "sitecustomize.py").write_text(IMPORT_GATE)
    (tmp_path / "tokenmill").write_text(CONSOLE_SCRIPT)
    ready = tmp_path / "ready"
    env = {**os.environ, "GATE_READY": str(ready),
           "PYTHONPATH": os.pathsep.join([str(gate), str(root), os.environ.get("PYTHONPATH", "")])}
    args = ([str(tmp_path / "tokenmill"), "run", "--input", "in.parquet", "--output", "out"]
            if command == "tokenmill" else ["-m", "flows.deploy", "job.yaml"])
    proc = subprocess.Popen([sys.executable, *args], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():  # a file the child writes: nothing to wait on but the file system
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the command never reached `import torch`"
            time.sleep(0.02)
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    line = {"tokenmill": "tokenmill: interrupted before the job started (nothing written); re-run the same "
                         "command to start",
            "flows.deploy": f"flows.deploy: stopped by {signal.Signals(signum).name} before the deployment was "
                            f"served"}[command]
    assert (proc.returncode, err.splitlines(), out) == (128 + signum, [line], "")
    assert not (tmp_path / "out").exists()


def test_a_truncated_model_file_is_one_line_naming_it_before_anything_is_written(tmp_path, capsys):
    """The bundled GGUF cut to half its size (an interrupted copy) failed with numpy's `cannot reshape
    array of size 66784 into shape (576,360)`; now the file is named, truncated, with both sizes."""
    from engine.weights import default_gguf_path

    data = open(default_gguf_path(), "rb").read()
    half = tmp_path / "half.gguf"
    half.write_bytes(data[: len(data) // 2])
    inp = tmp_path / "in.parquet"
    pl.DataFrame({"id": [1], "prompt": ["Say yes."]}).write_parquet(inp)
    out = tmp_path / "out"
    assert main(["run", "--input", str(inp), "--output", str(out), "--model", str(half), "--no-progress"]) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"tokenmill: GGUF file {str(half)!r} is truncated: {len(data) // 2} bytes, but its tensors need {len(data)} "
        f"(an interrupted download or copy? copy it again)"]
    assert not out.exists()
    bad = tmp_path / "bad.gguf"  # full size, garbage in the tensor count: named as corrupt, before the tokenizer
    bad.write_bytes(data[:8] + b"\xff" * 8 + data[16:])
    assert main(["run", "--input", str(inp), "--output", str(out), "--model", str(bad), "--no-progress"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"tokenmill: GGUF file {str(bad)!r} cannot be read, it is corrupt or not a GGUF file ("), err
    assert not out.exists()


def test_python_dash_m_pipeline_is_the_tokenmill_command(tmp_path):
    """`python -m pipeline` was `No module named pipeline.__main__`; it is now the `tokenmill` command, the
    same usage and the same one-line errors and exit codes, for a virtualenv whose scripts are not on PATH."""
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    helped = subprocess.run([sys.executable, "-m", "pipeline", "--help"], capture_output=True, text=True, env=env,
                            cwd=tmp_path, timeout=300)
    assert helped.returncode == 0 and helped.stdout.startswith("usage: tokenmill ")
    bad = subprocess.run([sys.executable, "-m", "pipeline", "run", "--output", str(tmp_path / "o")],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert bad.returncode == 1 and bad.stderr.splitlines() == [
        "tokenmill run: error: the following arguments are required: --input (or a --spec file that sets it)",
        "see 'tokenmill run --help'"]


def test_a_command_started_with_a_signal_ignored_keeps_ignoring_it(monkeypatch):
    """A job started with SIGINT ignored (`nohup tokenmill run ... &`, a background job in a script) ran
    on through a Ctrl-C only until `main` installed its handler; now a signal the process ignores
    stays ignored for the whole command, and one it does not (SIGTERM here) ends the job cleanly."""
    import pipeline.cli as cli

    seen = {}

    def report(args) -> int:  # the command's body: which handlers hold while it runs
        seen.update({s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)})
        return 0

    monkeypatch.setattr(cli, "cmd_report", report)
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        assert main(["report", "some-output"]) == 0
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN

        def sigterm(args) -> int:  # a SIGTERM while it runs: its handler armed the exit-now handler on SIGINT too
            cli._on_signal(signal.SIGTERM, None)
            return 0

        monkeypatch.setattr(cli, "cmd_report", sigterm)
        assert main(["report", "some-output"]) == 128 + signal.SIGTERM
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)
    assert seen == {signal.SIGINT: signal.SIG_IGN, signal.SIGTERM: cli._on_signal}
