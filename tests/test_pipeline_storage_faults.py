"""Storage that stalls, resets, slows, refuses or is not there: bounded time, clear errors, nothing lost.

The job talks to a moto S3 server over HTTP through s3fs, through a loopback TCP
proxy (`tcp_proxy.FaultProxy`) that the tests switch between pass, stall, reset
and slow. Timeouts are scaled down (1 s) so that each scenario takes seconds.
"""
from __future__ import annotations

import json
import time

import boto3
import polars as pl
import pytest

from pipeline import JobSpec, done_shards, io, read_metrics, run_job
from pipeline.lease import JobLocked
from pipeline.storage import StorageError, stall_bound_s
from pipeline.testing import FakeLLM

try:
    from tests.s3_server import s3_bucket, s3_proxy, s3_server  # noqa: F401  (pytest fixtures)
except ImportError:  # tests/ is not a package: pytest puts it on sys.path
    from s3_server import s3_bucket, s3_proxy, s3_server  # noqa: F401

FAST = {"connect_timeout": 1, "read_timeout": 1, "retries": {"total_max_attempts": 2, "mode": "standard"}}
IDS = [f"r{i:02d}" for i in range(12)]


def upload(bucket: str, tmp_path, endpoint: str) -> str:
    """12 rows in one Parquet file at s3://bucket/in/; returns the prefix."""
    local = tmp_path / "in.parquet"
    pl.DataFrame({"id": IDS, "prompt": [f"Label item {i}" for i in range(12)],
                  "topic": [f"t{i % 3}" for i in range(12)]}).write_parquet(local)
    boto3.client("s3", endpoint_url=endpoint).upload_file(str(local), bucket, "in/a.parquet")
    return f"s3://{bucket}/in/"


def part_names(output: str, so=None) -> list[str]:
    return [n for n in io.list_names(output, so) if n.startswith("part-")]


def read_parts(output: str, so=None) -> pl.DataFrame:
    return pl.concat([io.read_parquet(io.join(output, n), so) for n in part_names(output, so)])


def spec_for(inp: str, out: str, so: dict, **kw) -> JobSpec:
    fields = dict(input=inp, output=out, max_tokens=3, shard_size=3, shards_in_flight=1, progress=False,
                  storage_options=so, lease_ttl_s=2.0)
    fields.update(kw)
    return JobSpec(**fields)


def run_when_free(spec: JobSpec, llm, wait_s: float = 6.0):
    """run_job, waiting while a lease left behind by a failed run has not expired yet."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return run_job(spec, llm)
        except JobLocked:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.25)


def test_stalled_endpoint_fails_within_the_bound_commits_nothing_partial_and_resumes(s3_bucket, s3_server, s3_proxy,
                                                                                   tmp_path):
    so = {"endpoint_url": s3_proxy.url, "config_kwargs": FAST}
    spec = spec_for(upload(s3_bucket, tmp_path, s3_server), f"s3://{s3_bucket}/out", so)

    def stall_after_first_commit(result):
        if result.index == 0:
            s3_proxy.mode = "stall"

    t0 = time.monotonic()
    with pytest.raises(StorageError) as exc, pytest.warns(UserWarning, match="cost was not booked"):
        run_job(spec, FakeLLM(), on_shard_done=stall_after_first_commit)
    elapsed = time.monotonic() - t0
    # one stalled operation, then clean-up with one short attempt per call
    assert elapsed < stall_bound_s(so) + 10, elapsed
    # shards 0 and 1 share a prefix group, so they run in one engine call: the stall hits part 1's write
    assert exc.value.kind == "timeout"
    assert str(exc.value).startswith(f"cannot write s3://{s3_bucket}/out/part-00001.parquet: no answer from "
                                     f"{s3_proxy.url} within the time limits (read_timeout 1 s, 2 attempts)")
    assert "Re-run the same command to resume" in str(exc.value)

    s3_proxy.mode = "pass"
    # nothing half-written was committed: the only part file is shard 0's, with its marker
    assert part_names(spec.output, so) == ["part-00000.parquet"] and list(done_shards(spec)) == [0]
    llm = FakeLLM()
    report = run_when_free(spec, llm)
    assert llm.prompts_seen == 9 and report.rows_skipped == 3 and report.rows_ok == 9
    ids = read_parts(spec.output, so)["id"].to_list()
    assert sorted(ids) == IDS and len(ids) == 12


def test_connections_reset_mid_job_are_retried(s3_bucket, s3_server, s3_proxy, tmp_path):
    so = {"endpoint_url": s3_proxy.url, "config_kwargs": {**FAST, "retries": {"total_max_attempts": 3}}}
    spec = spec_for(upload(s3_bucket, tmp_path, s3_server), f"s3://{s3_bucket}/out", so)
    clean = spec.model_copy(update={"output": f"s3://{s3_bucket}/clean"})
    run_job(clean, FakeLLM())

    def reset_after_commit(result):
        s3_proxy.reset_next(2)  # the next two connection events are reset (RST); attempt 3 gets through

    report = run_job(spec, FakeLLM(), on_shard_done=reset_after_commit)
    assert s3_proxy.resets >= 6  # resets really happened after several commits
    assert report.rows_ok == 12 and report.status == "ok"
    timings = ["ttft_s", "latency_s"]
    faulty, reference = read_parts(spec.output, so).drop(timings), read_parts(clean.output, so).drop(timings)
    assert faulty.equals(reference)  # the same rows, in the same part files, as a run without faults
    assert sorted(faulty["id"].to_list()) == IDS


def test_slow_connections_are_not_timeouts(s3_bucket, s3_server, s3_proxy, tmp_path):
    """Bytes trickle (256 bytes every 5 ms) but never stop for a read timeout: the job completes."""
    so = {"endpoint_url": s3_proxy.url, "config_kwargs": FAST}
    spec = spec_for(upload(s3_bucket, tmp_path, s3_server), f"s3://{s3_bucket}/out", so)
    s3_proxy.slow_chunk, s3_proxy.slow_delay_s, s3_proxy.mode = 256, 0.005, "slow"
    report = run_job(spec, FakeLLM())
    s3_proxy.mode = "pass"
    assert report.rows_ok == 12
    assert sorted(read_parts(spec.output, so)["id"].to_list()) == IDS


def test_denied_write_names_the_object_books_a_failed_run_and_resumes(s3_bucket, s3_server, tmp_path):
    s3 = boto3.client("s3", endpoint_url=s3_server)
    spec = spec_for(upload(s3_bucket, tmp_path, s3_server), f"s3://{s3_bucket}/out", {}, price_per_hour=3600.0)
    policy = {"Version": "2012-10-17", "Statement": [{
        "Effect": "Deny", "Principal": "*", "Action": "s3:PutObject",
        "Resource": f"arn:aws:s3:::{s3_bucket}/out/part-00002.parquet"}]}
    s3.put_bucket_policy(Bucket=s3_bucket, Policy=json.dumps(policy))
    with pytest.raises(StorageError) as exc:
        run_job(spec, FakeLLM())
    assert exc.value.kind == "denied"
    assert str(exc.value).startswith(f"cannot write s3://{s3_bucket}/out/part-00002.parquet: access denied")
    assert "bucket policy" in str(exc.value)
    assert part_names(spec.output) == ["part-00000.parquet", "part-00001.parquet"]
    assert [n for n in io.list_names(spec.output) if n.startswith(".")] == []  # the temp file was removed
    failed = read_metrics(spec.output).row(0, named=True)
    assert failed["status"] == "failed" and "access denied" in failed["error"]
    assert (failed["rows_ok"], failed["rows_skipped"]) == (6, 0)
    assert failed["cost_usd"] == pytest.approx(failed["wall_s"]) and failed["cost_usd"] > 0

    s3.delete_bucket_policy(Bucket=s3_bucket)
    report = run_job(spec, FakeLLM())
    assert (report.rows_skipped, report.rows_ok) == (6, 6)
    metrics = read_metrics(spec.output)
    assert metrics["status"].to_list() == ["failed", "ok"] and metrics["rows_ok"].sum() == 12
    assert sorted(read_parts(spec.output)["id"].to_list()) == IDS


def test_wrong_port_fails_fast_with_a_short_message(s3_bucket, s3_server, tmp_path):
    inp = upload(s3_bucket, tmp_path, s3_server)
    spec = spec_for(inp, f"s3://{s3_bucket}/out", {"endpoint_url": "http://127.0.0.1:9"})
    t0 = time.monotonic()
    with pytest.raises(StorageError) as exc:
        run_job(spec, FakeLLM())
    assert time.monotonic() - t0 < 10
    text = str(exc.value)
    assert exc.value.kind == "connect" and len(text.splitlines()) == 2
    assert text.startswith(f"cannot write s3://{s3_bucket}/out: cannot connect to http://127.0.0.1:9 "
                           f"(connection refused, 3 attempts)")
    assert io.list_names(f"s3://{s3_bucket}/out") == []


@pytest.mark.parametrize("region", ["us-east-1", "eu-west-1"])
def test_missing_buckets_are_named_and_never_created(s3_bucket, s3_server, tmp_path, monkeypatch, region):
    monkeypatch.setenv("AWS_DEFAULT_REGION", region)
    s3 = boto3.client("s3", endpoint_url=s3_server)
    before = sorted(b["Name"] for b in s3.list_buckets()["Buckets"])
    inp = upload(s3_bucket, tmp_path, s3_server)
    with pytest.raises(StorageError) as exc:
        run_job(spec_for(inp, "s3://typo-bucket-x/labels/", {}), FakeLLM())
    assert str(exc.value).splitlines() == [
        "cannot write s3://typo-bucket-x/labels/: bucket 'typo-bucket-x' does not exist",
        "  tokenmill never creates buckets: check the URL for a typo, or create the bucket first."]
    with pytest.raises(StorageError, match="cannot list s3://no-such-input/p/: bucket 'no-such-input' does not "
                                           "exist"):
        run_job(spec_for("s3://no-such-input/p/", f"s3://{s3_bucket}/out", {}), FakeLLM())
    assert sorted(b["Name"] for b in s3.list_buckets()["Buckets"]) == before
    assert io.list_names(f"s3://{s3_bucket}/out") == []


def test_a_web_url_has_no_bucket_so_no_bucket_is_blamed():
    """`--input http://127.0.0.1:1/x.parquet` said "bucket '127.0.0.1:1' does not exist ... tokenmill never
    creates buckets"; a web URL's host is no bucket."""
    from pipeline.storage import bucket_of

    assert [bucket_of(u) for u in ("s3://b/x", "gs://c/d.parquet", "http://127.0.0.1:1/x.parquet",
                                   "https://example.org/a", "ftp://h/f", "file:///tmp/x", "/tmp/x")] == [
        "b", "c", None, None, None, None, None]


def test_a_write_that_fails_half_way_leaves_no_temp_file(tmp_path, monkeypatch):
    """A full disk while the temp file is written: the error reaches the caller (as StorageError) and the
    half-written `.tmp-*` file is gone (they stayed in _job/done and _job/runs, also after a resume)."""
    import errno

    def half_then_full(fs, path, data, so, exclusive=False):
        with open(path, "wb") as f:
            f.write(data[:3])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(io, "_put", half_then_full)
    target = tmp_path / "done" / "part-00001.json"
    target.parent.mkdir()
    with pytest.raises(StorageError, match="No space left on device"):
        io.write_json_atomic({"rows": 3}, str(target))
    assert sorted(p.name for p in target.parent.iterdir()) == []


def test_a_local_output_that_is_not_writable_says_so_without_s3_advice(tmp_path, monkeypatch, capsys):
    """A permission error writing to a local folder advised checking "the bucket policy and IAM permissions
    (s3:ListBucket, ...)"; a local folder has neither. It says the folder is not writable (exit 1, nothing
    written), and the IAM advice stays for object stores."""
    import errno

    from fsspec.implementations.local import LocalFileSystem

    from pipeline import JobSpec, cache_llm
    from pipeline.cli import main
    from pipeline.storage import explain

    inp = tmp_path / "in.parquet"
    pl.DataFrame({"id": [1], "prompt": ["Say yes."]}).write_parquet(inp)
    out = tmp_path / "out"
    real_makedirs = LocalFileSystem.makedirs

    def read_only(self, path, exist_ok=False):  # the output folder's parent is not writable (as for a non-root user)
        if str(path).startswith(str(out)):
            raise PermissionError(errno.EACCES, "Permission denied", str(out))
        return real_makedirs(self, path, exist_ok=exist_ok)

    monkeypatch.setattr(LocalFileSystem, "makedirs", read_only)
    cache_llm(JobSpec(input="-", output="-", engine_options={"seed": 17}), FakeLLM())  # a key no other test uses
    assert main(["run", "--input", str(inp), "--output", str(out), "--no-progress", "--engine-option", "seed=17"]) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"tokenmill: cannot write {out}/_job/lease/lease-00000000.json: permission denied ([Errno 13] Permission "
        f"denied: '{out}')",
        "  The local folder is not writable by this user: check the permissions of the output folder and of the "
        "folders above it, or choose another output."]
    assert not out.exists()
    denied = PermissionError(errno.EACCES, "Permission denied")
    assert explain(denied, "read", f"file://{inp}", {}).hint == (
        "This user may not read it: check the permissions of the file and of the folders above it.")
    s3 = explain(denied, "write", "s3://b/out/part-00000.parquet", {})
    assert s3.kind == "denied" and "IAM permissions (s3:ListBucket, s3:GetObject, s3:PutObject" in s3.hint
