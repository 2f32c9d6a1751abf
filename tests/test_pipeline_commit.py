"""A shard committed by two attempts (a worker declared dead that was still running, a retried write): first wins.

Both the part file and the done marker are created only if absent (a
conditional PUT on S3, a hard link on a local disk): the first attempt's bytes
stay, the second attempt adopts them (its own rows are never written) and
returns the first one's result. Also: a worker's LeaseToken stops commits once
the run that handed out the work has ended.
"""
from __future__ import annotations

import threading

import polars as pl
import pytest

from pipeline import LeaseLost, io, prepare_job
from pipeline.engines import run_shards, run_window
from pipeline.plan import plan_windows
from pipeline.spec import JobSpec
from pipeline.manifest import done_shards, marker_url, read_marker
from pipeline.testing import FakeLLM

try:
    from tests.s3_server import s3_bucket, s3_server  # noqa: F401  (pytest fixtures)
except ImportError:  # tests/ is not a package: pytest puts it on sys.path
    from s3_server import s3_bucket, s3_server  # noqa: F401

IDS = [f"r{i}" for i in range(6)]


class ShoutingLLM(FakeLLM):
    """A FakeLLM whose generations are upper case: an attempt whose rows differ from the first one's."""

    def _one(self, i, prompt, params):
        out = super()._one(i, prompt, params)
        for c in out.outputs:
            c.text = c.text.upper()
        return out


@pytest.fixture(params=["local", "s3"])
def output(request, tmp_path):
    """(input URL, output URL) on a local disk or on the moto S3 server."""
    local = tmp_path / "in.parquet"
    pl.DataFrame({"id": IDS, "prompt": [f"Label item {i} now" for i in range(6)]}).write_parquet(local)
    if request.param == "local":
        return str(local), str(tmp_path / "out")
    bucket = request.getfixturevalue("s3_bucket")
    fs, path = io.filesystem(f"s3://{bucket}/in/a.parquet")
    fs.put(str(local), path)
    return f"s3://{bucket}/in/", f"s3://{bucket}/out"


def part(output: str, index: int) -> bytes:
    fs, path = io.filesystem(io.join(output, f"part-{index:05d}.parquet"))
    return fs.cat_file(path)


def test_the_second_commit_of_a_shard_keeps_the_first_ones_rows(output):
    inp, out = output
    spec = JobSpec(input=inp, output=out, max_tokens=3, shard_size=3, plan="input", progress=False)
    plan = prepare_job(spec, tokenizer=FakeLLM().tokenizer)
    try:
        shard = plan.pending[0]
        first = list(run_shards(spec, [shard], FakeLLM(device_name="a"), run_id=plan.run_id, columns=plan.columns,
                                worker="worker-a"))
        first_bytes = part(out, 0)
        # a second attempt with other rows (a zombie worker, or a retry after a lost answer) reaches the commit
        second = list(run_shards(spec, [shard], ShoutingLLM(device_name="b"), run_id=plan.run_id,
                                 columns=plan.columns, worker="worker-b"))
    finally:
        plan.close()
    assert part(out, 0) == first_bytes  # first wins, byte for byte
    df = io.read_parquet(io.join(out, "part-00000.parquet"))
    assert df["id"].to_list() == IDS[:3]
    assert all(g == g.lower() and g for g in df["generation"])  # none of the second attempt's rows
    assert second == first and first[0].worker == "worker-a"  # the second attempt returns the marker's result
    assert first[0].counts.completion_tokens == 9 == int(df["completion_tokens"].sum())
    marker = io.read_json(marker_url(out, "part-00000.parquet"))
    assert marker["worker"] == marker["committed_by"] == "worker-a" and marker["adopted_part"] is False
    assert [n for n in io.list_names(out) if n.startswith("part-")] == ["part-00000.parquet"]
    assert not [n for n in io.list_names(out) if n.startswith(io.TEMP_PREFIX)]


def test_a_part_file_without_its_marker_is_adopted_with_counts_from_the_file(output):
    """A worker killed between its part file and its marker: the next attempt marks that file done."""
    inp, out = output
    spec = JobSpec(input=inp, output=out, max_tokens=3, shard_size=3, plan="input", progress=False)
    plan = prepare_job(spec, tokenizer=FakeLLM().tokenizer)
    try:
        shard = plan.pending[1]
        list(run_shards(spec, [shard], FakeLLM(), run_id=plan.run_id, columns=plan.columns, worker="dead"))
        io.remove(marker_url(out, shard.name))  # as if the worker died before writing it
        killed_bytes = part(out, 1)
        assert read_marker(out, shard.name, {}) is None
        (result,) = run_shards(spec, [shard], ShoutingLLM(), run_id=plan.run_id, columns=plan.columns,
                               worker="heir")
    finally:
        plan.close()
    assert part(out, 1) == killed_bytes
    # the marker names the worker whose rows the part file holds, and the one that marked it
    assert result.worker == "dead" and result.counts.rows_ok == 3 and result.counts.completion_tokens == 9
    marker = io.read_json(marker_url(out, shard.name))
    assert marker["adopted_part"] is True and marker["committed_by"] == "heir"
    assert done_shards(out, {})[1] == result


def test_a_part_file_deleted_after_its_commit_is_computed_again_with_a_warning(output):
    """A resume trusted the done marker of a part file someone deleted: it said ok and the rows were gone."""
    from pipeline import run_job

    inp, out = output
    spec = JobSpec(input=inp, output=out, max_tokens=3, shard_size=2, plan="input", progress=False)
    first = run_job(spec, FakeLLM())
    before = io.read_parquet(io.join(out, "part-00001.parquet"))
    io.remove(io.join(out, "part-00001.parquet"))
    with pytest.warns(UserWarning) as caught:
        report = run_job(spec, FakeLLM())
    assert [str(w.message) for w in caught] == [
        f"{out}: part-00001.parquet missing though the job's done marker says committed (deleted since?): 2 rows "
        f"of 1 shard computed again"]
    assert (first.rows_ok, report.rows_skipped, report.rows_ok, report.status) == (6, 4, 2, "ok")
    assert io.read_parquet(io.join(out, "part-00001.parquet")).equals(before)
    names = sorted(n for n in io.list_names(out) if n.startswith("part-"))
    assert [i for n in names for i in io.read_parquet(io.join(out, n))["id"].to_list()] == IDS
    assert sorted(done_shards(out, {})) == [0, 1, 2]


def test_two_attempts_racing_to_commit_leave_one_part_file(output):
    inp, out = output
    spec = JobSpec(input=inp, output=out, max_tokens=3, shard_size=6, plan="input", progress=False)
    plan = prepare_job(spec, tokenizer=FakeLLM().tokenizer)
    barrier = threading.Barrier(2)
    results: dict[str, list] = {}

    def attempt(name: str, llm: FakeLLM) -> None:
        results[name] = list(run_shards(spec, plan.pending, llm, run_id=plan.run_id, columns=plan.columns,
                                        worker=name))

    def at_last_output(i: int) -> None:  # both attempts have computed every row before either commits
        if i == len(IDS) - 1:
            barrier.wait(10)

    try:
        threads = [threading.Thread(target=attempt, args=("a", FakeLLM(on_output=at_last_output))),
                   threading.Thread(target=attempt, args=("b", ShoutingLLM(on_output=at_last_output)))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    finally:
        plan.close()
    assert results["a"] == results["b"]  # both return the one committed result
    winner = results["a"][0].worker
    df = io.read_parquet(io.join(out, "part-00000.parquet"))
    assert df["id"].to_list() == IDS  # one part file, every row once
    shouted = all(g == g.upper() for g in df["generation"])
    assert shouted == (winner == "b")  # its rows are the winner's, whole
    marker = io.read_json(marker_url(out, "part-00000.parquet"))
    assert marker["worker"] == winner and marker["committed_by"] in ("a", "b")


def test_a_worker_commits_nothing_once_the_run_has_ended(tmp_path):
    local = tmp_path / "in.parquet"
    pl.DataFrame({"id": IDS, "prompt": [f"Label item {i} now" for i in range(6)]}).write_parquet(local)
    spec = JobSpec(input=str(local), output=str(tmp_path / "out"), max_tokens=2, shard_size=3, plan="input",
                   progress=False)
    plan = prepare_job(spec, tokenizer=FakeLLM().tokenizer)
    token = plan.lease.token().bind({})
    (w0, w1) = plan_windows(plan.pending, 1)
    run = run_window(spec, w0, FakeLLM(), run_id=plan.run_id, columns=plan.columns, lease=token, worker="w")
    assert [r.index for r in run.results] == [0] and run.worker == "w"
    plan.close()  # the run ends (or dies and its lease is taken over)
    with pytest.raises(LeaseLost, match="has ended or lost the output"):
        run_window(spec, w1, FakeLLM(), run_id=plan.run_id, columns=plan.columns, lease=token, worker="w")
    assert [n for n in io.list_names(spec.output) if n.startswith("part-")] == ["part-00000.parquet"]


def test_windows_keep_shards_consecutive_and_refuse_a_bad_size(tmp_path):
    local = tmp_path / "in.parquet"
    pl.DataFrame({"id": IDS, "prompt": [f"Label item {i} now" for i in range(6)]}).write_parquet(local)
    spec = JobSpec(input=str(local), output=str(tmp_path / "out"), shard_size=1, plan="input", progress=False)
    plan = prepare_job(spec, tokenizer=FakeLLM().tokenizer)
    plan.close()
    assert [[s.index for s in w] for w in plan_windows(plan.pending, 4)] == [[0, 1, 2, 3], [4, 5]]
    with pytest.raises(ValueError, match="shards_in_flight must be at least 1, got 0"):
        plan_windows(plan.pending, 0)
