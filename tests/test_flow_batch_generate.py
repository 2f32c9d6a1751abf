"""The Prefect flow end to end through S3 (moto), with retries, resume after a failed shard, and artifacts.

Runs on Prefect's temporary local API (no server configured), one per session.
"""
from __future__ import annotations

import contextlib
import glob
import json
import os
import signal
import sys
import tempfile
import threading
import time
import types

os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="tokenmill-prefect-"))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

import polars as pl  # noqa: E402
import pytest  # noqa: E402

import pipeline.bookkeeping  # noqa: E402
import pipeline.engines  # noqa: E402
from pipeline import JobSpec, JobSpecChanged, io, read_metrics  # noqa: E402

try:
    from tests.s3_server import job_llm, s3_bucket, s3_server  # noqa: F401  (fixtures)
except ImportError:  # tests/ is not a package: pytest puts it on sys.path
    from s3_server import job_llm, s3_bucket, s3_server  # noqa: F401

PROMPTS = ["Say yes.", "Say no.", "Name a fruit.", "Name a month.", "Say hi.", "Name a colour.", "Count to two.",
           "Name a dog.", "Say thanks."]


@pytest.fixture(scope="module")
def prefect_api():
    """One temporary Prefect API (SQLite) for this module's flows.

    Prefect's logging is set up first: set up lazily inside the harness, during a test that captures
    output (capsys), its console handler kept that test's stream, closed after it, and every later log
    line failed (a RecursionError in `-k` selections that began with such a test)."""
    from prefect.logging.configuration import ensure_logging_setup
    from prefect.testing.utilities import prefect_test_harness

    ensure_logging_setup()
    with prefect_test_harness(server_startup_timeout=120):
        yield


def upload_dataset(bucket: str, tmp_path) -> str:
    """Three Parquet files (3 rows each) under s3://bucket/prompts/; returns the prefix URL."""
    for f in range(3):
        local = tmp_path / f"{f}.parquet"
        pl.DataFrame({
            "id": [f"q{3 * f + i}" for i in range(3)],
            "prompt": PROMPTS[3 * f:3 * f + 3],
            "source": [f"file{f}"] * 3,
            "weight": [float(3 * f + i) for i in range(3)],
        }).write_parquet(local)
        fs, path = io.filesystem(f"s3://{bucket}/prompts/part{f}.parquet")
        fs.put(str(local), path)
    return f"s3://{bucket}/prompts/"


def read_parts(output: str) -> pl.DataFrame:
    names = [n for n in io.list_names(output) if n.startswith("part-")]
    return pl.concat([io.read_parquet(io.join(output, n)) for n in names])


def part_bytes(output: str, name: str) -> bytes:
    fs, path = io.filesystem(io.join(output, name))
    return fs.cat_file(path)


def test_flow_s3_to_s3(prefect_api, job_llm, s3_bucket, tmp_path, monkeypatch):
    from prefect.artifacts import Artifact

    from flows import batch_generate

    inp = upload_dataset(s3_bucket, tmp_path)
    spec = JobSpec(input=inp, output=f"s3://{s3_bucket}/out", max_tokens=4, shard_size=2, progress=False,
                   price_per_hour=3.0)

    # the first read of each of shards 1 and 3 fails: the task retries and succeeds
    real_read, failed = io.read_rows, set()

    def flaky_read(url, offset, length, storage_options=None):
        key = (url, offset)
        if key in {(f"s3://{s3_bucket}/prompts/part0.parquet", 2), (f"s3://{s3_bucket}/prompts/part1.parquet", 2)} \
                and key not in failed:
            failed.add(key)
            raise ConnectionError("injected S3 hiccup")
        return real_read(url, offset, length, storage_options)

    monkeypatch.setattr(io, "read_rows", flaky_read)
    report = batch_generate(spec, shard_retries=2, retry_delay_s=0)
    assert len(failed) == 2

    df = read_parts(spec.output)
    assert sorted(df["id"].to_list()) == sorted(f"q{i}" for i in range(9))  # every id exactly once
    assert df.height == 9
    src = {r["id"]: r for r in df.to_dicts()}
    for i in range(9):
        assert src[f"q{i}"]["source"] == f"file{i // 3}" and src[f"q{i}"]["weight"] == float(i)
    assert df["error"].null_count() == 9 and all(df["generation"].str.len_chars() > 0)

    m = read_metrics(spec.output).row(0, named=True)
    assert m["prompt_tokens"] == df["prompt_tokens"].sum() > 0
    assert m["completion_tokens"] == df["completion_tokens"].sum() > 0
    assert m["cached_tokens"] == df["cached_tokens"].sum()
    assert (m["rows_total"], m["rows_ok"], m["rows_error"], m["rows_skipped"]) == (9, 9, 0, 0)
    assert m["cost_usd"] == pytest.approx(m["wall_s"] / 3600 * 3.0)
    assert report["run_id"] == m["run_id"]

    table = Artifact.get("tokenmill-cost-report")
    assert table is not None and "usd_per_1m_tokens" in str(table.data)
    progress = Artifact.get("tokenmill-progress")
    assert progress is not None and float(progress.data) == pytest.approx(100.0)

    # a re-run with another spec is refused
    with pytest.raises(JobSpecChanged):
        batch_generate(spec.model_copy(update={"max_tokens": 5}), shard_retries=0)


# Cost-report fields that depend on the clock, and on what speculation did: the engine's default
# (speculative auto) drafts where the step times it measures make drafts pay, so two runs of the CLI
# itself may differ there (never in their generations: drafts are verified exactly).
CLOCK_FIELDS = {"run_id", "started_at", "finished_at", "wall_s", "device_s", "cost_usd", "rows_per_s",
                "input_tokens_per_s", "output_tokens_per_s", "input_cost_usd", "output_cost_usd",
                "usd_per_1m_input_tokens", "usd_per_1m_output_tokens", "usd_per_1m_tokens"}
SPEC_FIELDS = {"spec_draft_tokens", "spec_accepted_tokens", "spec_acceptance_rate", "spec_mean_accepted_per_verify",
               "spec_step_share"}
VARYING_COLUMNS = ["ttft_s", "latency_s", "spec_draft_tokens", "spec_accepted_tokens"]


def test_flow_and_cli_write_the_same_rows_and_report(prefect_api, job_llm, s3_bucket, tmp_path):
    from flows import batch_generate
    from pipeline.cli import main

    inp = upload_dataset(s3_bucket, tmp_path)
    args = ["run", "--input", inp, "--max-tokens", "4", "--shard-size", "2", "--no-progress"]
    # one warm-up run first, so that both measured runs find the same prefix-cache state
    assert main(args + ["--output", f"s3://{s3_bucket}/warm"]) == 0
    assert main(args + ["--output", f"s3://{s3_bucket}/cli"]) == 0
    flow_row = batch_generate(JobSpec(input=inp, output=f"s3://{s3_bucket}/flow", max_tokens=4, shard_size=2,
                                      progress=False), shard_retries=0)

    def parts(out: str) -> dict[str, pl.DataFrame]:
        return {n: io.read_parquet(io.join(out, n)).drop(VARYING_COLUMNS) for n in io.list_names(out)
                if n.startswith("part-")}

    cli_parts, flow_parts = parts(f"s3://{s3_bucket}/cli"), parts(f"s3://{s3_bucket}/flow")
    assert sorted(flow_parts) == sorted(cli_parts) == [f"part-{i:05d}.parquet" for i in range(6)]
    for name, df in cli_parts.items():
        assert flow_parts[name].equals(df), name  # the same rows in the same part files, cached tokens too

    cli_row = read_metrics(f"s3://{s3_bucket}/cli").row(0, named=True)
    same = {k: v for k, v in cli_row.items() if k not in CLOCK_FIELDS | SPEC_FIELDS}
    assert {k: v for k, v in flow_row.items() if k not in CLOCK_FIELDS | SPEC_FIELDS} == same
    assert same["quantization"] == "none" and same["device_count"] == 1 and same["rows_ok"] == 9
    assert same["cached_tokens"] > 0
    assert same["completion_tokens"] == sum(int(df["completion_tokens"].sum()) for df in cli_parts.values())


def test_flow_resume_after_failed_shard(prefect_api, job_llm, s3_bucket, tmp_path, monkeypatch):
    from flows import batch_generate

    inp = upload_dataset(s3_bucket, tmp_path)
    # one shard per window (input order: no prefix group joins two shards into one window), so the failing
    # reads of shards 1 and 2 leave shard 0's window untouched
    spec = JobSpec(input=inp, output=f"s3://{s3_bucket}/out", max_tokens=4, shard_size=3, shards_in_flight=1,
                   plan="input", progress=False)
    real_read = io.read_rows

    def broken_after_first(url, offset, length, storage_options=None):
        if not url.endswith("part0.parquet"):
            raise ConnectionError("injected: the job dies after its first shard")
        return real_read(url, offset, length, storage_options)

    monkeypatch.setattr(io, "read_rows", broken_after_first)
    with pytest.raises(ConnectionError):
        batch_generate(spec, shard_retries=0)
    assert [n for n in io.list_names(spec.output) if n.startswith("part-")] == ["part-00000.parquet"]
    first = part_bytes(spec.output, "part-00000.parquet")

    computed = []
    monkeypatch.setattr(io, "read_rows",
                        lambda url, o, n, so=None: computed.append(url) or real_read(url, o, n, so))
    report = batch_generate(spec, shard_retries=0)
    assert sorted(computed) == [f"{inp}part1.parquet", f"{inp}part2.parquet"]  # shard 0 is not recomputed
    assert part_bytes(spec.output, "part-00000.parquet") == first
    ids = read_parts(spec.output)["id"].to_list()
    assert sorted(ids) == sorted(f"q{i}" for i in range(9)) and len(ids) == 9
    assert report["rows_skipped"] == 3 and report["rows_ok"] == 6


def test_deploy_serves_spec_file_on_cron(tmp_path, monkeypatch):
    from flows import batch_generate, deploy

    spec_file = tmp_path / "job.yaml"
    spec_file.write_text(
        "spec:\n  input: s3://bucket/prompts/\n  output: s3://bucket/out/\n  max_tokens: 8\n"
        "deployment:\n  name: nightly\n  cron: '0 2 * * *'\n  shard_retries: 1\n")
    captured = {}
    monkeypatch.setattr(type(batch_generate), "serve", lambda self, **kw: captured.update(kw))
    assert deploy.main([str(spec_file), "--name", "labels"]) == 0
    assert captured["cron"] == "0 2 * * *" and captured["name"] == "labels"
    assert captured["parameters"]["spec"]["max_tokens"] == 8 and captured["parameters"]["shard_retries"] == 1
    JobSpec(**captured["parameters"]["spec"])  # the parameters round-trip into a JobSpec

    json_file = tmp_path / "job.json"
    json_file.write_text('{"input": "in.parquet", "output": "out"}')
    with pytest.raises(ValueError, match="cron"):
        deploy.load_deployment(str(json_file))
    spec, dep = deploy.load_deployment(str(json_file), cron="*/5 * * * *")
    assert spec.input == "in.parquet" and dep["cron"] == "*/5 * * * *"


def _stored_flow_run_parameters() -> list[dict]:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return [r.parameters for r in client.read_flow_runs()]


def test_flow_refuses_inline_secrets_and_stores_none(prefect_api, s3_bucket, tmp_path):
    from flows import batch_generate

    inp = upload_dataset(s3_bucket, tmp_path)
    spec = JobSpec(input=inp, output=f"s3://{s3_bucket}/out", max_tokens=2, progress=False,
                   storage_options={"key": "AKIAINLINE", "secret": "inline-s3cr3t"})
    with pytest.raises(ValueError) as exc:
        batch_generate(spec, shard_retries=0)
    assert str(exc.value).startswith("spec.storage_options holds credentials (key, secret); flow parameters are "
                                     "stored in Prefect's database")
    assert "storage_secret='NAME'" in str(exc.value)
    stored = json.dumps(_stored_flow_run_parameters())
    assert "inline-s3cr3t" not in stored and "AKIAINLINE" not in stored
    assert '"secret": "**********"' in stored  # the refused run was recorded, masked
    assert io.list_names(spec.output) == []


def test_flow_takes_storage_options_from_a_secret_block(prefect_api, job_llm, s3_server, s3_bucket, tmp_path,
                                                        monkeypatch):
    from prefect.blocks.system import Secret

    from flows import batch_generate

    inp = upload_dataset(s3_bucket, tmp_path)
    Secret(value={"endpoint_url": s3_server, "key": "AKIAFLOWTEST", "secret": "flow-s3cr3t"}).save(
        "tokenmill-test-s3", overwrite=True)
    for name in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)  # without the block the job could not reach the store at all
    spec = JobSpec(input=inp, output=f"s3://{s3_bucket}/out", max_tokens=2, shard_size=3, progress=False)
    report = batch_generate(spec, shard_retries=0, storage_secret="tokenmill-test-s3")
    assert report["rows_ok"] == 9 and report["status"] == "ok"
    so = {"endpoint_url": s3_server, "key": "x", "secret": "y"}
    names = [n for n in io.list_names(spec.output, so) if n.startswith("part-")]
    ids = [i for n in names for i in io.read_parquet(io.join(spec.output, n), so)["id"].to_list()]
    assert sorted(ids) == sorted(f"q{i}" for i in range(9))
    stored = json.dumps(_stored_flow_run_parameters())
    assert "flow-s3cr3t" not in stored and "AKIAFLOWTEST" not in stored and "tokenmill-test-s3" in stored


def test_deploy_refuses_credentials_in_the_spec_file_and_names_bad_fields(tmp_path, capsys):
    from flows import deploy

    leaky = tmp_path / "leaky.yaml"
    leaky.write_text("spec:\n  input: s3://b/in/\n  output: s3://b/out/\n  storage_options:\n"
                     "    client_kwargs: {aws_secret_access_key: abc}\ndeployment:\n  cron: '0 2 * * *'\n")
    with pytest.raises(ValueError, match=r"holds credentials \(client_kwargs.aws_secret_access_key\)"):
        deploy.load_deployment(str(leaky))
    bad = tmp_path / "bad.yaml"
    bad.write_text("spec:\n  input: in.parquet\n  output: out\n  shard_size: many\ndeployment:\n  cron: '* * * * *'\n")
    assert deploy.main([str(bad)]) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"flows.deploy: {bad}: invalid job spec:",
        "  line 4: shard_size must be an integer, got 'many'"]
    ok = tmp_path / "ok.yaml"
    ok.write_text("spec:\n  input: in.parquet\n  output: out\ndeployment:\n  cron: '0 2 * * *'\n"
                  "  storage_secret: tokenmill-s3\n")
    spec, dep = deploy.load_deployment(str(ok))
    assert dep["storage_secret"] == "tokenmill-s3" and spec.storage_options == {}


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_deploy_stopped_before_it_serves_says_so_in_one_line(tmp_path, capsys, monkeypatch, signum):
    """A Ctrl-C while the deployment registered printed the traceback of the Prefect call it interrupted;
    a SIGTERM then ended the process without a word. Both end in one line and 128 + the signal."""
    from flows import deploy

    def registering(path, **kw):  # the signal arrives while Prefect registers the deployment
        os.kill(os.getpid(), signum)
        time.sleep(5)
        raise AssertionError("the signal did not stop it")

    monkeypatch.setattr(deploy, "serve", registering)
    before = signal.getsignal(signal.SIGTERM)
    # a suite started with SIGINT ignored (`nohup pytest &`) would never see this test's SIGINT: Python's own
    # handler for the test, as the command has it when started from a terminal
    sigint = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        assert deploy.main([str(tmp_path / "job.yaml")]) == 128 + signum
    finally:
        signal.signal(signal.SIGINT, sigint)
    assert capsys.readouterr().err.splitlines() == [
        f"flows.deploy: stopped by {signal.Signals(signum).name} before the deployment was served"]
    assert signal.getsignal(signal.SIGTERM) == before  # the handler is the caller's again


def test_deploy_stopped_while_serving_ends_with_one_line(tmp_path, capsys, monkeypatch):
    """Prefect's runner handles the signal while it serves (it pauses the schedule and returns): the
    command then says so in one line of its own and exits 0."""
    from flows import deploy

    monkeypatch.setattr(deploy, "serve", lambda path, **kw: None)
    assert deploy.main([str(tmp_path / "job.yaml")]) == 0
    assert capsys.readouterr().err.splitlines() == [
        "flows.deploy: stopped; Prefect paused the deployment's schedule (serve it again to resume)"]


def test_deploy_refuses_what_every_run_would_refuse_in_one_line_and_serves_nothing(tmp_path, capsys, monkeypatch):
    from flows import batch_generate, deploy

    served = []
    monkeypatch.setattr(type(batch_generate), "serve", lambda self, **kw: served.append(kw))
    head = "spec:\n  input: in.parquet\n  output: out\n"
    cases = {
        "max_tokens: 0": "invalid default sampling parameters: max_tokens must be an integer >= 1, got 0",
        "engine_options: {bogus_option: 1}": "unknown engine option(s) ['bogus_option']; known: ",
    }
    for i, (line, message) in enumerate(cases.items()):
        f = tmp_path / f"bad{i}.yaml"
        f.write_text(f"{head}  {line}\ndeployment:\n  cron: '0 2 * * *'\n")
        assert deploy.main([str(f)]) == 1
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith(f"flows.deploy: {f}: {message}")
    f = tmp_path / "retries.yaml"
    for value in ("-1", "'3'", "true"):
        f.write_text(f"{head}deployment:\n  cron: '0 2 * * *'\n  shard_retries: {value}\n")
        assert deploy.main([str(f)]) == 1
        shown = {"-1": "-1", "'3'": "'3'", "true": "True"}[value]
        assert capsys.readouterr().err.splitlines() == [
            f"flows.deploy: {f}: shard_retries must be an integer >= 0 (retries per window task), got {shown}"]
    assert served == []
    f.write_text(f"{head}deployment:\n  cron: '0 2 * * *'\n  shard_retries: 0\n")
    assert deploy.main([str(f)]) == 0 and served[0]["parameters"]["shard_retries"] == 0

    # a prefix of an option is not taken for it (as the tokenmill command refuses one)
    with pytest.raises(SystemExit) as exc:
        deploy.main([str(f), "--cro", "* * * * *"])
    assert exc.value.code == 2 and "unrecognized arguments: --cro * * * * *" in capsys.readouterr().err
    assert len(served) == 1


def test_flow_refuses_negative_shard_retries_before_anything_is_written(prefect_api, tmp_path):
    from flows import batch_generate

    inp = tmp_path / "in.parquet"
    pl.DataFrame({"id": [1], "prompt": ["Hi."]}).write_parquet(inp)
    spec = JobSpec(input=str(inp), output=str(tmp_path / "out"), max_tokens=2, progress=False)
    with pytest.raises(ValueError) as exc:
        batch_generate(spec, shard_retries=-1)
    assert str(exc.value) == "shard_retries must be an integer >= 0 (retries per window task), got -1"
    assert not (tmp_path / "out").exists()
    for bad in (-1.5, float("inf")):  # a negative delay was taken as 0 (Prefect itself makes "5" a float)
        with pytest.raises(ValueError) as exc:
            batch_generate(spec, retry_delay_s=bad)
        assert str(exc.value) == f"retry_delay_s must be a number of seconds >= 0 (the first retry's delay), got {bad!r}"
    assert not (tmp_path / "out").exists()


def _fake_engine_job(tmp_path, monkeypatch, on_output, seed: int) -> JobSpec:
    """9 rows in tmp_path/in.parquet, 3 shards of 3, one shard per window (3 window tasks in plan order),
    run by a FakeLLM registered for this spec only (its own seed: no other test gets it)."""
    import pipeline.engines as engines
    from pipeline.testing import FakeLLM

    pl.DataFrame({"id": [f"q{i}" for i in range(9)], "prompt": [f"Name thing {i}." for i in range(9)]}).write_parquet(
        tmp_path / "in.parquet")
    spec = JobSpec(input=str(tmp_path / "in.parquet"), output=str(tmp_path / "out"), max_tokens=2 + seed % 3,
                   shard_size=3, shards_in_flight=1, plan="input", progress=False, seed=seed)
    monkeypatch.setitem(engines._ENGINES, engines._engine_key(spec), FakeLLM(on_output=on_output))
    return spec


def _parts_after_ctrl_c(spec, on_sigint) -> list[str]:
    """Run the flow with `on_sigint` as the SIGINT handler (restored after), expecting the KeyboardInterrupt
    it ends in; the names of the part files in the output then."""
    from flows import batch_generate

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        with pytest.raises(KeyboardInterrupt):
            batch_generate(spec, shard_retries=0)
    finally:
        signal.signal(signal.SIGINT, previous)
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(spec.output, "part-*.parquet")))


def _assert_booked_interrupted(spec, parts: list[str], rows: int) -> None:
    """The run is booked interrupted, with the rows and tokens of the part files `parts` exactly (`rows` of
    them, each with max_tokens completion tokens)."""
    got_rows, prompt_tokens, completion_tokens = _part_token_sums(spec.output, parts)
    m = read_metrics(spec.output)
    assert m["status"].to_list() == ["interrupted"]
    row = m.row(0, named=True)
    assert (row["rows_ok"], row["prompt_tokens"], row["completion_tokens"]) == (got_rows, prompt_tokens,
                                                                                completion_tokens)
    assert (got_rows, completion_tokens) == (rows, rows * spec.max_tokens)
    # the rows it did not commit are booked as not run, so the row columns add up to rows_total
    assert (row["rows_error"], row["rows_skipped"], row["rows_not_run"]) == (0, 0, row["rows_total"] - rows)
    assert row["rows_total"] > rows


def _part_token_sums(output: str, names: list[str]) -> tuple[int, int, int]:
    df = pl.concat([pl.read_parquet(os.path.join(output, n)) for n in names])
    return df.height, int(df["prompt_tokens"].sum()), int(df["completion_tokens"].sum())


def test_ctrl_c_mid_flow_books_every_row_the_interrupted_run_committed(prefect_api, tmp_path, monkeypatch):
    """A Ctrl-C while window 2 ran booked the run's cost from the windows collected so far (window 1),
    while window 2 went on and committed its part file: its rows were in no cost row, and a resume skipped
    them. The interrupted run's row now counts every shard it committed, and the resume books the rest."""
    import pipeline.manifest as manifest

    from flows import batch_generate

    flow_module = sys.modules["flows.batch_generate"]  # (`flows.batch_generate` is the flow itself)
    sigint_seen, window2_committed = threading.Event(), threading.Event()

    def on_sigint(signum, frame):
        sigint_seen.set()
        raise KeyboardInterrupt

    def ctrl_c_in_window_2(n):  # n: outputs so far; 3 is window 2's first (window 1 has committed)
        if n == 3:
            os.kill(os.getpid(), signal.SIGINT)  # the flow's thread (the main one) gets the KeyboardInterrupt
            assert sigint_seen.wait(10)

    real_mark_done, real_abort = manifest.mark_done, flow_module.abort_job

    def mark_done(output, name, *args, **kw):
        result = real_mark_done(output, name, *args, **kw)
        if name == "part-00001.parquet":
            window2_committed.set()
        return result

    def slow_booking(*args, **kw):  # window 2 commits while the interrupted run books (a slow store)
        assert window2_committed.wait(20), "window 2 did not commit"
        return real_abort(*args, **kw)

    spec = _fake_engine_job(tmp_path, monkeypatch, ctrl_c_in_window_2, seed=7301)
    monkeypatch.setattr(manifest, "mark_done", mark_done)
    monkeypatch.setattr(flow_module, "abort_job", slow_booking)
    parts = _parts_after_ctrl_c(spec, on_sigint)
    assert parts == ["part-00000.parquet", "part-00001.parquet"]  # window 3 never started
    _assert_booked_interrupted(spec, parts, rows=6)

    monkeypatch.setattr(flow_module, "abort_job", real_abort)
    report = batch_generate(spec, shard_retries=0)  # the resume computes and books only window 3
    rows3, prompt3, completion3 = _part_token_sums(spec.output, ["part-00002.parquet"])
    assert (report["status"], report["rows_skipped"], report["rows_ok"]) == ("ok", 6, 3)
    assert (report["prompt_tokens"], report["completion_tokens"]) == (prompt3, completion3)
    m = read_metrics(spec.output)
    everything = _part_token_sums(spec.output, [f"part-{i:05d}.parquet" for i in range(3)])
    assert (int(m["rows_ok"].sum()), int(m["prompt_tokens"].sum()), int(m["completion_tokens"].sum())) == everything


def test_sigterm_mid_flow_is_booked_as_interrupted_like_ctrl_c(prefect_api, tmp_path, monkeypatch):
    """A SIGTERM while window 2 ran booked the run "failed" (error "TerminationSignal", Prefect's exception
    for it). It is booked as Ctrl-C is: "interrupted", counting every shard the run committed, window 2's
    included; Prefect's TerminationSignal goes on up carrying the JobInterrupted, and the signal reaches the
    process's own SIGTERM handler (the default one ends a script with 143)."""
    from prefect.exceptions import TerminationSignal

    from flows import batch_generate

    flow_module = sys.modules["flows.batch_generate"]
    settling = threading.Event()
    real_settle = flow_module._settle_windows

    def settle(*args, **kw):  # the flow caught the signal with window 2 in flight
        settling.set()
        return real_settle(*args, **kw)

    def sigterm_in_window_2(n):
        if n == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # the flow (the main thread) gets Prefect's TerminationSignal
            assert settling.wait(10)

    spec = _fake_engine_job(tmp_path, monkeypatch, sigterm_in_window_2, seed=7302)
    monkeypatch.setattr(flow_module, "_settle_windows", settle)
    delivered = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: delivered.append(signum))
    try:
        with pytest.raises(TerminationSignal) as exc:
            batch_generate(spec, shard_retries=0)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert delivered == [signal.SIGTERM]  # Prefect passed it on to this process's handler
    parts = sorted(p.name for p in (tmp_path / "out").glob("part-*.parquet"))
    assert parts == ["part-00000.parquet", "part-00001.parquet"]  # window 3 never started
    rows, prompt_tokens, completion_tokens = _part_token_sums(spec.output, parts)
    m = read_metrics(spec.output)
    assert (m["status"].to_list(), m["error"].to_list()) == (["interrupted"], [None])  # was failed, TerminationSignal
    row = m.row(0, named=True)
    assert (row["rows_ok"], row["prompt_tokens"], row["completion_tokens"]) == (rows, prompt_tokens,
                                                                                completion_tokens)
    assert (rows, completion_tokens) == (6, 6 * spec.max_tokens)
    stopped = flow_module.interruption(exc.value)
    assert (stopped.shards_done, stopped.shards_total, stopped.signum) == (2, 3, signal.SIGTERM)
    assert str(stopped) == "interrupted after 2 of 3 shards"
    assert (stopped.report.status, stopped.report.rows_ok) == ("interrupted", 6)

    report = batch_generate(spec, shard_retries=0)  # the resume books only window 3
    assert (report["status"], report["rows_skipped"], report["rows_ok"]) == ("ok", 6, 3)
    assert read_metrics(spec.output)["status"].to_list() == ["interrupted", "ok"]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_tokenmill_run_cluster_as_it_stops_tokenmill_run(prefect_api, tmp_path, monkeypatch, capsys,
                                                                       signum):
    """`tokenmill run --cluster` (the flow) stopped by Ctrl-C or SIGTERM said "interrupted before the job
    started (nothing written)" with no cost report, after a run that had committed 2 shards (booked "failed"
    on SIGTERM). It ends as `tokenmill run` does: the partial cost report on stdout, one line on stderr
    naming the shards done, exit 128 + the signal. (The flow's windows run on this process's thread
    runner here: the cluster's connection is stood in for.)"""
    from flows.cli import main

    flow_module = sys.modules["flows.batch_generate"]
    settling = threading.Event()
    real_settle = flow_module._settle_windows

    def settle(*args, **kw):
        settling.set()
        return real_settle(*args, **kw)

    def signal_in_window_2(n):
        if n == 3:
            os.kill(os.getpid(), signum)
            assert settling.wait(10)

    @contextlib.contextmanager
    def no_cluster(spec):
        yield None

    seed = 7304 + signum
    spec = _fake_engine_job(tmp_path, monkeypatch, signal_in_window_2, seed=seed)
    monkeypatch.setattr(flow_module, "_settle_windows", settle)
    monkeypatch.setattr(flow_module, "_cluster_runner", no_cluster)
    monkeypatch.setattr(flow_module, "check_prefect_api", lambda spec: None)
    monkeypatch.setattr(flow_module, "_require_api_for_cluster", lambda spec: None)
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    rc = main(["run", "--input", spec.input, "--output", spec.output, "--max-tokens", str(spec.max_tokens),
               "--shard-size", "3", "--shards-in-flight", "1", "--plan", "input", "--no-progress", "--seed",
               str(seed), "--cluster", "tcp://127.0.0.1:8786"])
    assert {s: signal.getsignal(s) for s in before} == before
    out, err = capsys.readouterr()
    assert rc == 128 + signum
    assert err.splitlines()[-1] == ("tokenmill: interrupted after 2 of 3 shards; re-run the same command to "
                                    "resume")
    assert "cost report (partial: interrupted after 2 of 3 shards; counts are this run's committed shards" in out
    assert sorted(p.name for p in (tmp_path / "out").glob("part-*.parquet")) == ["part-00000.parquet",
                                                                                 "part-00001.parquet"]
    m = read_metrics(spec.output)
    assert (m["status"].to_list(), m["rows_ok"].to_list(), m["error"].to_list()) == (["interrupted"], [6], [None])


def test_ctrl_c_on_a_dask_cluster_waits_for_the_window_running_there_and_books_it(prefect_api, tmp_path,
                                                                                  monkeypatch):
    """On a Dask cluster a Ctrl-C cancelled every window's future and booked at once: the window running on
    a worker went on (a cancelled Dask task's thread runs to its end) and committed its shard after the
    run had read back its commits, so the cost row left that shard out (and a resume skipped it). The flow
    now waits until no worker runs one of its windows, then books every shard committed. The cluster is a
    one-worker, one-thread `LocalCluster` in this process (its tasks see this process's stand-in engine).
    Window 2 goes on once the flow reads back what the run committed (or after 3 s), and the booking is
    slow, as on a slow store, so that the running window commits before it ends."""
    import distributed

    import pipeline.manifest as manifest

    from flows import batch_generate

    flow_module = sys.modules["flows.batch_generate"]
    main_thread = threading.main_thread().ident
    sigint_seen, read_back, window2_committed = threading.Event(), threading.Event(), threading.Event()

    def on_sigint(signum, frame):
        sigint_seen.set()
        raise KeyboardInterrupt

    def ctrl_c_in_window_2(n):  # on the worker's thread: window 2's first output (window 1 has committed)
        if n == 3:
            signal.pthread_kill(main_thread, signal.SIGINT)
            assert sigint_seen.wait(10)
            read_back.wait(3)  # the flow read its commits back without waiting for this window: it goes on

    real_committed_by_run = flow_module.committed_by_run

    def committed_by_run(*args, **kw):
        read_back.set()
        return real_committed_by_run(*args, **kw)

    real_mark_done, real_finish = manifest.mark_done, pipeline.bookkeeping.finish_job

    def mark_done(output, name, *args, **kw):
        result = real_mark_done(output, name, *args, **kw)
        if name == "part-00001.parquet":
            window2_committed.set()
        return result

    def slow_booking(*args, **kw):  # (abort_job books through pipeline.bookkeeping.finish_job)
        window2_committed.wait(20)
        return real_finish(*args, **kw)

    spec = _fake_engine_job(tmp_path, monkeypatch, ctrl_c_in_window_2, seed=7310)
    llm = pipeline.engines._ENGINES[pipeline.engines._engine_key(spec)]
    monkeypatch.setattr(manifest, "mark_done", mark_done)
    monkeypatch.setattr(pipeline.bookkeeping, "finish_job", slow_booking)
    monkeypatch.setattr(flow_module, "committed_by_run", committed_by_run)
    with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                                  dashboard_address=":0") as cluster:
        spec = spec.model_copy(update={"cluster": cluster.scheduler_address})
        parts = _parts_after_ctrl_c(spec, on_sigint)
        assert parts == ["part-00000.parquet", "part-00001.parquet"]  # window 3 was cancelled before it ran
        assert (llm.calls, llm.prompts_seen) == (2, 6)
        _assert_booked_interrupted(spec, parts, rows=6)

        monkeypatch.setattr(pipeline.bookkeeping, "finish_job", real_finish)
        report = batch_generate(spec, shard_retries=0)  # the resume computes and books only window 3
        assert (report["status"], report["rows_skipped"], report["rows_ok"]) == ("ok", 6, 3)
        m = read_metrics(spec.output)
        everything = _part_token_sums(spec.output, [f"part-{i:05d}.parquet" for i in range(3)])
        assert (int(m["rows_ok"].sum()), int(m["prompt_tokens"].sum()),
                int(m["completion_tokens"].sum())) == everything


def test_a_second_ctrl_c_stops_waiting_for_the_window_in_flight():
    """After the first Ctrl-C the flow cancels the windows not started and waits for the running one; a
    second Ctrl-C during that wait ends the wait (one line says so) instead of escaping the booking."""
    import concurrent.futures

    import flows  # noqa: F401  (loads flows.batch_generate)

    settle = sys.modules["flows.batch_generate"]._settle_windows

    class Window:
        def __init__(self, started: bool):
            self.wrapped_future = concurrent.futures.Future()
            if started:
                self.wrapped_future.set_running_or_notify_cancel()  # running: cancel() refuses

        def result(self):
            raise KeyboardInterrupt  # the second Ctrl-C, while the flow waits for this window

    class Log:
        def __init__(self):
            self.lines = []

        def warning(self, msg, *args):
            self.lines.append(msg % args)

    running, queued, log = Window(started=True), Window(started=False), Log()
    settle([running, queued], lambda fut: fut.result(), log)
    assert queued.wrapped_future.cancelled() and not running.wrapped_future.cancelled()
    assert log.lines == [
        "interrupted: waiting for the 1 window(s) in flight to finish, so this run's cost counts every shard it "
        "commits (Ctrl-C again to stop waiting)",
        "interrupted again: not waiting for the window in flight; booking what this run committed so far and "
        "giving the output's lease back (the window commits nothing more)"]


def test_the_wait_for_dask_windows_ends_on_a_second_ctrl_c_or_a_lost_scheduler(monkeypatch):
    """The Dask side of the wait: every window's future is cancelled in one call, the workers are asked
    which windows still run until none does twice in a row; a second Ctrl-C while it polls, or workers
    that cannot be asked (the scheduler is gone), end the wait with one line each."""
    import flows  # noqa: F401  (loads flows.batch_generate)

    flow_module = sys.modules["flows.batch_generate"]
    monkeypatch.setattr(flow_module, "DASK_POLL_S", 0.01)

    class Client:
        def __init__(self, answers):
            self.answers, self.cancelled, self.asked = list(answers), [], 0

        def cancel(self, futures):
            self.cancelled.append([f.key for f in futures])

        def run(self, fn, keys, on_error):
            assert fn is flow_module._windows_running and on_error == "ignore"
            self.asked += 1
            answer = self.answers.pop(0)
            if isinstance(answer, BaseException):
                raise answer
            return {"tcp://w1:1": [k for k in keys if k in answer], "tcp://w2:1": OSError("gone")}

    class DaskWindow:
        def __init__(self, key, client):
            self.wrapped_future = types.SimpleNamespace(key=key, client=client)

    class Log:
        def __init__(self):
            self.lines = []

        def warning(self, msg, *args):
            self.lines.append(msg % args)

    waiting = ("interrupted: waiting for the 1 window(s) in flight to finish, so this run's cost counts every "
               "shard it commits (Ctrl-C again to stop waiting)")
    # w2 runs, then ends; two empty answers in a row end the wait
    client = Client([{"w2"}, {"w2"}, set(), set()])
    log = Log()
    flow_module._settle_windows([DaskWindow("w2", client), DaskWindow("w3", client)], None, log)
    assert (client.cancelled, client.asked, log.lines) == ([["w2", "w3"]], 4, [waiting])
    # a window seen only after the first empty answer (sent to a worker just before the cancel) is waited for
    client = Client([set(), {"w3"}, set(), set()])
    log = Log()
    flow_module._settle_windows([DaskWindow("w2", client), DaskWindow("w3", client)], None, log)
    assert (client.asked, log.lines) == (4, [])
    # a second Ctrl-C while it polls
    client = Client([{"w2"}, KeyboardInterrupt()])
    log = Log()
    flow_module._settle_windows([DaskWindow("w2", client)], None, log)
    assert log.lines == [waiting, "interrupted again: not waiting for the window in flight; booking what this "
                                  "run committed so far and giving the output's lease back (the window commits "
                                  "nothing more)"]
    # the scheduler is gone
    client = Client([{"w2"}, OSError("Timed out trying to connect to tcp://scheduler:8786")])
    log = Log()
    flow_module._settle_windows([DaskWindow("w2", client)], None, log)
    assert log.lines == [waiting, "could not ask the Dask workers whether this run's windows still run (OSError: "
                                  "Timed out trying to connect to tcp://scheduler:8786); booking what is committed"]
    client = Client([])
    client.cancel = lambda futures: (_ for _ in ()).throw(OSError("Timed out trying to connect"))
    log = Log()
    flow_module._settle_windows([DaskWindow("w2", client)], None, log)
    assert (client.asked, log.lines) == (0, ["could not cancel this run's windows on the Dask cluster (OSError: Timed "
                                             "out trying to connect); booking what is committed"])


def test_flow_runs_a_request_file_and_resumes_it_with_every_custom_id_once(prefect_api, job_llm, s3_bucket,
                                                                           tmp_path, monkeypatch):
    """An OpenAI Batch request file (good lines and bad ones) through the flow, killed after its first shard,
    then run again: every custom_id exactly once across results-*.jsonl and errors-*.jsonl, the same lines
    as `tokenmill run` writes."""
    from flows import batch_generate
    from pipeline.cli import main

    lines = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"messages": [{"role": "user", "content": p}], "max_tokens": 4, "temperature": 0}})
             for i, p in enumerate(PROMPTS[:5])]
    lines += ['{"custom_id": "broken", ', json.dumps({"custom_id": "r1", "url": "/v1/completions",
                                                      "body": {"prompt": "x"}}),
              json.dumps({"custom_id": "t", "url": "/v1/completions", "body": {"prompt": "x", "tools": [{}]}})]
    fs, path = io.filesystem(f"s3://{s3_bucket}/in/requests.jsonl")
    fs.pipe(path, ("\n".join(lines) + "\n").encode())
    inp = f"s3://{s3_bucket}/in/requests.jsonl"
    spec = JobSpec(input=inp, output=f"s3://{s3_bucket}/flow", shard_size=3, shards_in_flight=1, plan="input",
                   progress=False)
    real_read = io.read_rows

    def broken_after_first(url, offset, length, storage_options=None):
        if offset > 0:
            raise ConnectionError("injected: the job dies after its first shard")
        return real_read(url, offset, length, storage_options)

    monkeypatch.setattr(io, "read_rows", broken_after_first)
    with pytest.raises(ConnectionError):
        batch_generate(spec, shard_retries=0)
    names = io.list_names(spec.output)
    assert "results-00000.jsonl" in names and "results-00001.jsonl" not in names
    monkeypatch.setattr(io, "read_rows", real_read)
    report = batch_generate(spec, shard_retries=0)
    assert json.loads(report["request_counts"]) == {"total": 8, "completed": 5, "failed": 3}

    def lines_of(out: str, prefix: str) -> list[dict]:
        got = []
        for n in sorted(n for n in io.list_names(out) if n.startswith(prefix) and n.endswith(".jsonl")):
            got += [json.loads(x) for x in part_bytes(out, n).decode().splitlines()]
        return got

    results, errors = lines_of(spec.output, "results-"), lines_of(spec.output, "errors-")
    ids = [r["custom_id"] for r in results] + [e["custom_id"] for e in errors]
    assert sorted(map(str, ids)) == sorted(["r0", "r1", "r2", "r3", "r4", "t", "None", "None"])
    assert sorted(e["error"]["code"] for e in errors) == ["duplicate_custom_id", "invalid_json", "unsupported_field"]
    # the same lines as the CLI writes (greedy)
    assert main(["run", "--input", inp, "--output", f"s3://{s3_bucket}/cli", "--shard-size", "3", "--plan", "input",
                 "--no-progress"]) == 0

    def texts(out: str) -> dict[str, str]:
        return {r["custom_id"]: r["response"]["body"]["choices"][0]["message"]["content"]
                for r in lines_of(out, "results-")}

    assert texts(spec.output) == texts(f"s3://{s3_bucket}/cli") and all(texts(spec.output).values())
