"""The flow's windows on a 2-worker Dask cluster, with a real Prefect server and the moto S3 server, all on 127.0.0.1.

The cluster is a `distributed.LocalCluster(n_workers=2, processes=True,
threads_per_worker=1)`: two worker processes (each under a nanny that restarts
it when it dies), each loading the real engine once. The Prefect server is a
`prefect server start` process (process workers report their task runs to it);
the S3 server is `tests/s3_server.py`'s, reached by the workers through the
AWS_* variables of their environment. The job is tiny (16 rows, 3 new tokens
each) so the whole module takes about a minute and a half on 2 busy cores.
"""
from __future__ import annotations

import contextvars
import os
import signal
import sys
import threading
import time
from pathlib import Path

import distributed  # a pinned dependency, like prefect-dask: a missing one fails here, it is not skipped
import polars as pl
import pytest

from pipeline import JobSpec, io, read_metrics
from pipeline.manifest import done_shards, marker_url

try:
    from tests.s3_server import job_llm, s3_bucket, s3_server  # noqa: F401  (fixtures)
    from tests.test_flow_deploy_server import _free_port, _get, _stop, _wait
except ImportError:  # tests/ is not a package: pytest puts it on sys.path
    from s3_server import job_llm, s3_bucket, s3_server  # noqa: F401
    from test_flow_deploy_server import _free_port, _get, _stop, _wait


ROOT = Path(__file__).resolve().parent.parent
ROWS = 16
PROMPTS = ["Say yes.", "Say no.", "Name a fruit.", "Name a month.", "Say hi.", "Name a colour.", "Count to two.",
           "Name a dog.", "Say thanks.", "Name a tree.", "Name a city.", "Say bye.", "Name a bird.", "Name a day.",
           "Say please.", "Name a fish."]
GENERATED = ["id", "generation", "finish_reason", "prompt_tokens", "completion_tokens", "error"]


@pytest.fixture(scope="module")
def prefect_api(tmp_path_factory):
    """A `prefect server start` process for this module; this process's flows report to it (PREFECT_API_URL)."""
    import subprocess

    from prefect.settings import PREFECT_API_URL, temporary_settings

    home = tmp_path_factory.mktemp("prefect-home")
    port = _free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_API_URL": api, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port",
                             str(port)], env=env, cwd=home, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        _wait("the Prefect server", lambda: _get(f"{api}/health")[0] == 200, 120, [proc])
        with temporary_settings(updates={PREFECT_API_URL: api}):
            yield api
            # send this process's queued events and logs while their server still runs: left queued, the
            # next Prefect user in this process (or its exit) waits on every one of them against a dead server
            from prefect.events.worker import EventsWorker
            from prefect.logging.handlers import APILogWorker

            EventsWorker.drain_all(timeout=30)
            APILogWorker.drain_all(timeout=30)
    finally:
        _stop(proc)


def start_cluster(api: str):
    """A LocalCluster of 2 process workers, 1 thread each, whose environment reaches the Prefect and S3 servers."""
    env = {k: os.environ[k] for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                      "AWS_DEFAULT_REGION")}
    env.update({"PREFECT_API_URL": api, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "TOKENMILL_NUM_THREADS": "1",
                "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE",
                "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
    return distributed.LocalCluster(n_workers=2, processes=True, threads_per_worker=1, host="127.0.0.1",
                                    dashboard_address=":0", env=env, silence_logs=40)


@pytest.fixture(scope="module")
def cluster(prefect_api, s3_server):
    """A 2-worker cluster and a client of it, shared by the tests that leave its workers as they found them."""
    with start_cluster(prefect_api) as c:
        client = distributed.Client(c, set_as_default=False)  # a default client would capture the flow's tasks
        try:
            yield c, client
        finally:
            client.close()


def upload(bucket: str, tmp_path) -> str:
    """16 rows in two Parquet files under s3://bucket/prompts/; returns the prefix."""
    for f in range(2):
        local = tmp_path / f"{f}.parquet"
        rows = range(8 * f, 8 * f + 8)
        pl.DataFrame({"id": [f"q{i:02d}" for i in rows], "prompt": [PROMPTS[i] for i in rows],
                      "source": [f"file{f}"] * 8}).write_parquet(local)
        fs, path = io.filesystem(f"s3://{bucket}/prompts/part{f}.parquet")
        fs.put(str(local), path)
    return f"s3://{bucket}/prompts/"


def job(inp: str, out: str, **kw) -> JobSpec:
    """8 shards of 2 rows, one shard per window (8 window tasks), 3 greedy tokens per row."""
    fields = dict(input=inp, output=out, max_tokens=3, shard_size=2, shards_in_flight=1, plan="input",
                  kv_cache_memory_bytes=64 << 20, progress=False)
    fields.update(kw)
    return JobSpec(**fields)


def read_parts(output: str) -> pl.DataFrame:
    names = [n for n in io.list_names(output) if n.startswith("part-")]
    return pl.concat([io.read_parquet(io.join(output, n)) for n in names]).sort("id")


def part_bytes(output: str) -> dict[str, bytes]:
    fs, _ = io.filesystem(output)
    return {n: fs.cat_file(io.filesystem(io.join(output, n))[1]) for n in io.list_names(output)
            if n.startswith("part-")}


def workers_of(client) -> dict[str, int]:
    """Worker address -> its process id."""
    return client.run(os.getpid)


def wait_for(what: str, ok, box: dict, timeout: float = 180.0) -> None:
    """Wait until ok() (the flow running in a thread fills `box` if it ends first)."""
    deadline = time.monotonic() + timeout
    while not ok():
        assert not box, f"the flow ended before {what}: {box}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def block_at_marker(flag: str, after: int):
    """A function for `client.run`: in that worker, the commit after the first `after` ones writes its part
    file, then `flag` (the shard's name), and hangs before its done marker, until the process dies."""
    def install() -> None:
        import pathlib
        import time as _time

        import pipeline.manifest as manifest

        real, calls = manifest.mark_done, [0]

        def mark_done(output, shard_name, result, extra, storage_options):
            calls[0] += 1
            if calls[0] > after:  # the name lands whole or not at all: the test reads it once the flag exists
                pathlib.Path(flag + ".tmp").write_text(shard_name)
                pathlib.Path(flag + ".tmp").replace(flag)
                _time.sleep(3600)
            return real(output, shard_name, result, extra, storage_options)

        manifest.mark_done = mark_done

    return install


def block_mid_shard(flag: str, after_rows: int):
    """A function for `client.run`: in that worker, the row after the first `after_rows` finished ones
    writes `flag` and hangs before it reaches its shard (so that shard is half computed), until the
    process dies."""
    def install() -> None:
        import pathlib
        import time as _time

        import pipeline.engines as engines

        real, calls = engines._output_row, [0]

        def output_row(*args, **kwargs):
            calls[0] += 1
            if calls[0] > after_rows:
                pathlib.Path(flag).write_text(str(calls[0]))
                _time.sleep(3600)
            return real(*args, **kwargs)

        engines._output_row = output_row

    return install


def in_thread(fn, *args, **kwargs):
    """Run fn in a thread, in this thread's context (Prefect's settings are context variables); returns
    (thread, box) where box gets "result" or "error"."""
    box: dict = {}
    ctx = contextvars.copy_context()

    def target():
        try:
            box["result"] = ctx.run(fn, *args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t, box


def test_two_workers_give_the_single_process_rows_and_a_rerun_computes_nothing(cluster, job_llm, s3_bucket,
                                                                              tmp_path):
    from flows import batch_generate
    from flows.cli import main

    c, client = cluster
    inp = upload(s3_bucket, tmp_path)
    ref = job(inp, f"s3://{s3_bucket}/single")
    assert main(["run", "--input", ref.input, "--output", ref.output, "--max-tokens", "3", "--shard-size", "2",
                 "--shards-in-flight", "1", "--plan", "input", "--no-progress"]) == 0

    # the cluster job as a user starts it: `tokenmill run ... --cluster tcp://HOST:PORT` runs the flow
    spec = job(inp, f"s3://{s3_bucket}/cluster", cluster=c.scheduler_address, price_per_hour=2.0)
    assert main(["run", "--input", spec.input, "--output", spec.output, "--max-tokens", "3", "--shard-size", "2",
                 "--shards-in-flight", "1", "--plan", "input", "--kv-cache-memory-bytes", str(64 << 20),
                 "--price-per-hour", "2", "--no-progress", "--cluster", c.scheduler_address]) == 0

    # the same rows, ids and greedy generations as the single-process run
    single, dist = read_parts(ref.output), read_parts(spec.output)
    assert dist["id"].to_list() == [f"q{i:02d}" for i in range(ROWS)]
    assert dist.select(GENERATED + ["source"]).equals(single.select(GENERATED + ["source"]))
    assert dist["completion_tokens"].to_list() == [3] * ROWS and dist["error"].null_count() == ROWS

    # both workers ran shards; each marker names its worker; each worker loaded the engine once for 4 windows
    workers = workers_of(client)
    ran = {r.worker for r in done_shards(spec.output, {}).values()}
    assert ran == set(workers) and len(ran) == 2
    from pipeline.engines import engine_loads

    assert client.run(engine_loads) == {w: 1 for w in workers}
    m = read_metrics(spec.output).row(0, named=True)
    assert (m["rows_total"], m["rows_ok"], m["rows_skipped"], m["device_count"]) == (ROWS, ROWS, 0, 2)
    assert m["completion_tokens"] == 3 * ROWS
    assert m["prompt_tokens"] == int(dist["prompt_tokens"].sum())
    assert m["cost_usd"] == pytest.approx(m["wall_s"] * 2 / 3600 * 2.0)

    # a second run resumes: nothing to compute, no part file rewritten, no engine loaded anew
    before = part_bytes(spec.output)
    again = batch_generate(spec, shard_retries=0)
    assert (again["rows_skipped"], again["rows_ok"], again["completion_tokens"]) == (ROWS, 0, 0)
    assert part_bytes(spec.output) == before and len(before) == 8
    assert client.run(engine_loads) == {w: 1 for w in workers}


def test_a_worker_killed_mid_shard_is_replaced_and_every_id_lands_once(cluster, s3_bucket, tmp_path):
    from flows import batch_generate

    c, client = cluster
    inp = upload(s3_bucket, tmp_path)
    spec = job(inp, f"s3://{s3_bucket}/killed", cluster=c.scheduler_address)
    pids = workers_of(client)
    victim = sorted(pids)[0]
    flag = tmp_path / "blocked"
    # the victim commits one shard, then hangs between its next part file and that shard's done marker
    client.run(block_at_marker(str(flag), after=1), workers=[victim])
    try:
        t, box = in_thread(batch_generate, spec, shard_retries=0)
        wait_for("the victim to hang mid-commit", flag.exists, box)
        stuck = flag.read_text()
        os.kill(pids[victim], signal.SIGKILL)
        t.join(240)
        assert not t.is_alive(), "the flow did not finish after the worker was killed"
    finally:
        if victim in workers_of(client):  # the victim never got killed: do not leave it hanging
            os.kill(pids[victim], signal.SIGKILL)
    assert "error" not in box, box.get("error")
    report = box["result"]
    assert report["status"] == "ok" and report["rows_ok"] == ROWS

    df = read_parts(spec.output)
    assert df["id"].to_list() == [f"q{i:02d}" for i in range(ROWS)]  # every id exactly once
    assert len([n for n in io.list_names(spec.output) if n.startswith("part-")]) == 8
    markers = done_shards(spec.output, {})
    assert sorted(markers) == list(range(8))
    # the stuck shard was finished by another worker, which kept the victim's part file (first wins)
    marker = io.read_json(marker_url(spec.output, stuck))
    assert marker["adopted_part"] is True and marker["worker"] == victim and marker["committed_by"] != victim
    assert markers[int(stuck[5:10])].counts.completion_tokens == 6  # counted from the adopted file
    assert sum(r.worker == victim for r in markers.values()) == 2  # its first commit and its orphaned part file


def test_a_rerun_after_the_whole_cluster_died_resumes_from_the_done_markers(prefect_api, s3_server, job_llm,
                                                                           s3_bucket, tmp_path):
    from flows import batch_generate

    inp = upload(s3_bucket, tmp_path)
    out = f"s3://{s3_bucket}/died"
    c = start_cluster(prefect_api)
    client = distributed.Client(c, set_as_default=False)
    try:
        spec = job(inp, out, cluster=c.scheduler_address)
        pids = workers_of(client)
        flags = {w: tmp_path / f"blocked-{i}" for i, w in enumerate(pids)}
        for w, flag in flags.items():  # each worker commits one shard (2 rows), then hangs halfway through the next
            client.run(block_mid_shard(str(flag), after_rows=3), workers=[w])
        t, box = in_thread(batch_generate, spec, shard_retries=0)
        wait_for("both workers to hang", lambda: all(f.exists() for f in flags.values()), box)
        for pid in pids.values():  # the whole cluster dies: workers, then scheduler
            os.kill(pid, signal.SIGKILL)
        client.close()
        c.close(timeout=30)
        t.join(120)
        assert not t.is_alive(), "the flow did not end when its cluster died"
    finally:
        client.close()
        c.close(timeout=30)
    assert "error" in box  # the run failed ...
    first = done_shards(out, {})
    assert 2 <= len(first) < 8  # ... after committing some shards
    failed = read_metrics(out).row(0, named=True)
    assert failed["status"] == "failed" and 2 <= failed["rows_ok"] <= 2 * len(first)

    assert not [m for m in io.list_names(out) if m.startswith("part-") and int(m[5:10]) not in first]  # no half shard
    # the re-run (here in this process, the cluster being gone) computes only the shards not done
    rerun = batch_generate(job(inp, out, kv_cache_memory_bytes=None), shard_retries=0)
    assert rerun["rows_skipped"] == 2 * len(first) and rerun["rows_ok"] == ROWS - 2 * len(first)
    after = done_shards(out, {})
    assert sorted(after) == list(range(8))
    assert all(after[i].worker == first[i].worker for i in first)  # done markers untouched
    assert read_parts(out)["id"].to_list() == [f"q{i:02d}" for i in range(ROWS)]


def test_cluster_options_are_checked_before_anything_runs(tmp_path, cluster):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows import deploy
    from flows.batch_generate import _cluster_runner, _require_api_for_cluster

    with pytest.raises(ValueError, match="expected a Dask scheduler address such as tcp://HOST:8786"):
        JobSpec(input="in.parquet", output="out", cluster="scheduler:8786")
    spec = JobSpec(input="in.parquet", output="out", cluster="tcp://127.0.0.1:1")
    with temporary_settings(updates={PREFECT_API_URL: None}):
        with pytest.raises(ValueError, match="needs a Prefect server"):
            _require_api_for_cluster(spec)
    c, _ = cluster
    with distributed.Client(c) as other:  # a default client of another scheduler would take the tasks
        with pytest.raises(ValueError, match=f"default Dask client is connected to {other.scheduler.address}"):
            with _cluster_runner(spec):
                pass
    import dask

    from flows.batch_generate import _resources

    with _resources(spec.model_copy(update={"device": "cuda"}), runner=object()):
        assert dask.get_annotations() == {"resources": {"GPU": 1}}  # one engine per GPU worker
    with _resources(spec, runner=object()):  # device auto: no resource asked for
        assert dask.get_annotations() == {}
    with pytest.raises(ValueError, match="a cluster job runs through the Prefect flow"):
        from pipeline import run_job

        run_job(spec)

    spec_file = tmp_path / "job.yaml"
    spec_file.write_text("spec:\n  input: s3://b/in/\n  output: s3://b/out/\n"
                         "deployment:\n  cron: '0 2 * * *'\n  cluster: tcp://10.0.0.5:8786\n")
    spec, dep = deploy.load_deployment(str(spec_file))
    assert spec.cluster == "tcp://10.0.0.5:8786" and "cluster" not in dep
    spec_file.write_text("spec:\n  input: s3://b/in/\n  output: s3://b/out/\n  cluster: tcp://10.0.0.5:8786\n"
                         "cluster: tcp://10.0.0.6:8786\ndeployment:\n  cron: '0 2 * * *'\n")
    with pytest.raises(ValueError, match=r"unknown top-level key\(s\) \['cluster'\]"):
        deploy.load_deployment(str(spec_file))


def test_a_request_file_on_the_cluster_lands_every_custom_id_once(cluster, job_llm, s3_bucket):
    """OpenAI Batch request lines (and a bad line) as a cluster job: the workers read the staged rows from
    OUTPUT/_job/requests/; every custom_id exactly once across results and errors, the single-process lines."""
    import json

    from flows import batch_generate
    from pipeline import run_job

    c, client = cluster
    lines = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"messages": [{"role": "user", "content": p}], "temperature": 0}})
             for i, p in enumerate(PROMPTS[:6])] + ["not json"]
    fs, path = io.filesystem(f"s3://{s3_bucket}/in/requests.jsonl")
    fs.pipe(path, ("\n".join(lines) + "\n").encode())
    inp = f"s3://{s3_bucket}/in/requests.jsonl"
    run_job(job(inp, f"s3://{s3_bucket}/single-requests"), job_llm)
    report = batch_generate(job(inp, f"s3://{s3_bucket}/cluster-requests", cluster=c.scheduler_address),
                            shard_retries=0)
    assert json.loads(report["request_counts"]) == {"total": 7, "completed": 6, "failed": 1}

    def lines_of(out: str, prefix: str) -> list[dict]:
        got = []
        for n in sorted(n for n in io.list_names(out) if n.startswith(prefix)):
            got += [json.loads(x) for x in fs.cat_file(io.filesystem(io.join(out, n))[1]).decode().splitlines()]
        return got

    out = f"s3://{s3_bucket}/cluster-requests"
    assert {r.worker for r in done_shards(out, {}).values()} <= set(workers_of(client))  # the workers ran them
    results, errors = lines_of(out, "results-"), lines_of(out, "errors-")
    assert [r["custom_id"] for r in results] == [f"r{i}" for i in range(6)]
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [(None, "invalid_json")]

    def texts(out: str) -> list[str]:
        return [r["response"]["body"]["choices"][0]["message"]["content"] for r in lines_of(out, "results-")]

    assert texts(out) == texts(f"s3://{s3_bucket}/single-requests") and all(texts(out))
