"""run_job with a stand-in engine: ids once, pass-through, resume, changed spec, atomic shards, S3."""
from __future__ import annotations

import os

import polars as pl
import pytest

from pipeline import JobSpec, JobSpecChanged, done_shards, read_metrics, run_job
from pipeline import io
from pipeline.testing import FakeLLM

try:
    from tests.s3_server import s3_bucket, s3_server  # noqa: F401  (pytest fixtures)
except ImportError:  # tests/ is not a package: pytest puts it on sys.path
    from s3_server import s3_bucket, s3_server  # noqa: F401


def dataset(n: int, start: int = 0) -> pl.DataFrame:
    return pl.DataFrame({
        "id": [f"r{i:03d}" for i in range(start, start + n)],
        "prompt": [f"Label item number {i}" for i in range(start, start + n)],
        "topic": [f"t{i % 3}" for i in range(start, start + n)],
        "score": [float(i) / 2 for i in range(start, start + n)],
    })


@pytest.fixture
def local_input(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    dataset(7).write_parquet(d / "a.parquet")
    dataset(5, 7).write_parquet(d / "b.parquet")
    return d


def spec_for(inp, out, **kw) -> JobSpec:
    return JobSpec(input=str(inp), output=str(out), max_tokens=4, shard_size=3, progress=False, **kw)


def read_output(out) -> pl.DataFrame:
    parts = sorted(p for p in os.listdir(out) if p.startswith("part-"))
    return pl.concat([pl.read_parquet(os.path.join(out, p)) for p in parts])


def test_run_job_local(local_input, tmp_path):
    out = tmp_path / "out"
    llm = FakeLLM()
    report = run_job(spec_for(local_input, out, price_per_hour=2.0), llm)
    df = read_output(out)
    # shards never span files: 7 rows -> 3+3+1, 5 rows -> 3+2
    assert sorted(p for p in os.listdir(out) if p.startswith("part-")) == [f"part-{i:05d}.parquet" for i in range(5)]
    assert df["id"].to_list() == [f"r{i:03d}" for i in range(12)]
    assert df.columns == ["id", "topic", "score", "generation", "finish_reason", "prompt_tokens",
                          "completion_tokens", "cached_tokens", "spec_draft_tokens", "spec_accepted_tokens", "ttft_s",
                          "latency_s", "error"]
    assert df["topic"].to_list() == dataset(12)["topic"].to_list()
    assert df["score"].to_list() == dataset(12)["score"].to_list()
    assert df["error"].null_count() == 12
    assert all(len(g) > 0 for g in df["generation"])
    assert set(df["completion_tokens"]) == {4}
    m = read_metrics(str(out))
    assert m.height == 1
    row = m.row(0, named=True)
    assert row["rows_total"] == 12 and row["rows_ok"] == 12 and row["rows_error"] == 0 and row["rows_skipped"] == 0
    assert row["prompt_tokens"] == df["prompt_tokens"].sum()
    assert row["completion_tokens"] == df["completion_tokens"].sum() == 48
    assert row["device"] == "fake" and row["price_per_device_hour"] == 2.0
    assert report.cost_usd == pytest.approx(report.wall_s / 3600 * 2.0)


def test_rerun_skips_done_shards(local_input, tmp_path):
    out = tmp_path / "out"
    run_job(spec_for(local_input, out), FakeLLM())
    llm = FakeLLM()
    report = run_job(spec_for(local_input, out), llm)
    assert llm.prompts_seen == 0
    assert report.rows_skipped == 12 and report.rows_ok == 0
    assert read_metrics(str(out)).height == 2


def test_read_metrics_skips_a_damaged_or_stray_run_file_with_a_warning_and_keeps_the_good_runs(local_input, tmp_path):
    out = tmp_path / "out"
    for _ in range(3):
        run_job(spec_for(local_input, out), FakeLLM())
    runs = out / "_job" / "runs"
    names = sorted(os.listdir(runs))
    assert len(names) == 3
    good = read_metrics(str(out))["run_id"].to_list()
    data = (runs / names[0]).read_bytes()
    (runs / names[0]).write_bytes(data[: len(data) // 2])  # truncated
    (runs / names[1]).write_bytes(b"not parquet at all")  # garbage
    pl.DataFrame({"x": [1], "started_at": ["yesterday"]}).write_parquet(runs / "run-stray.parquet")  # not a cost row
    with pytest.warns(UserWarning) as caught:
        m = read_metrics(str(out))
    assert m["run_id"].to_list() == good[2:]  # the one good run, still shown
    messages = sorted(str(w.message) for w in caught)
    assert len(messages) == 3
    assert messages[0].startswith(f"{runs / names[0]}: skipped, not a readable Parquet file (parquet: ")
    assert messages[1].startswith(f"{runs / names[1]}: skipped, not a readable Parquet file (parquet: ")
    assert messages[2] == (f"{runs / 'run-stray.parquet'}: skipped, not a run's cost row (column job_id (missing), "
                           f"run_id (missing), started_at (String), cost_usd (missing))")

    (runs / names[2]).write_bytes(b"")
    with pytest.warns(UserWarning), pytest.raises(ValueError) as exc:
        read_metrics(str(out))
    assert str(exc.value) == (f"no readable job metrics at {out / '_job'}: all 4 metrics file(s) were skipped "
                              f"(see the warnings)")


def test_read_metrics_gives_a_run_file_booked_before_rows_not_run_what_its_counts_leave(local_input, tmp_path):
    """A run row booked before `rows_not_run` was a column reads with it filled (rows_total minus the
    other row counts), as an Int64 without nulls beside today's rows."""
    out = tmp_path / "out"
    spec = spec_for(local_input, out, shards_in_flight=1)

    def die(result):
        raise RuntimeError("stopped")

    with pytest.raises(RuntimeError):
        run_job(spec, FakeLLM(), on_shard_done=die)  # commits shard 0 (3 of 12 rows), then fails
    run_job(spec, FakeLLM())
    runs = out / "_job" / "runs"
    first, second = sorted(runs.iterdir())
    assert read_metrics(str(out))["rows_not_run"].to_list() == [9, 0]
    pl.read_parquet(first).drop("rows_not_run").write_parquet(first)  # as an older tokenmill wrote it
    m = read_metrics(str(out))
    assert m["status"].to_list() == ["failed", "ok"]
    assert m["rows_not_run"].dtype == pl.Int64 and m["rows_not_run"].to_list() == [9, 0]
    assert (m["rows_ok"].to_list(), m["rows_skipped"].to_list()) == ([3, 9], [0, 3])


def test_resume_after_failure(local_input, tmp_path):
    out = tmp_path / "out"
    spec = spec_for(local_input, out, shards_in_flight=1)

    class Killed(Exception):
        pass

    def die(result):
        raise Killed

    with pytest.raises(Killed):
        run_job(spec, FakeLLM(), on_shard_done=die)
    assert list(done_shards(spec)) == [0]
    first = (out / "part-00000.parquet").read_bytes()
    llm = FakeLLM()
    report = run_job(spec, llm)
    assert llm.prompts_seen == 9  # shard 0 (3 rows) is not recomputed
    assert (out / "part-00000.parquet").read_bytes() == first
    ids = read_output(out)["id"].to_list()
    assert sorted(ids) == [f"r{i:03d}" for i in range(12)] and len(set(ids)) == 12
    assert report.rows_skipped == 3 and report.rows_ok == 9


def test_part_without_marker_is_recomputed(local_input, tmp_path):
    """Killed between the part commit and its marker: the shard runs again, rows appear once."""
    out = tmp_path / "out"
    spec = spec_for(local_input, out)
    run_job(spec, FakeLLM())
    os.remove(out / "_job" / "done" / "part-00001.json")
    llm = FakeLLM()
    run_job(spec, llm)
    assert llm.prompts_seen == 3
    ids = read_output(out)["id"].to_list()
    assert len(ids) == len(set(ids)) == 12


def test_changed_spec_refused(local_input, tmp_path):
    out = tmp_path / "out"
    run_job(spec_for(local_input, out), FakeLLM())
    with pytest.raises(JobSpecChanged, match=r"max_tokens: 4 -> 5.*--overwrite"):
        run_job(spec_for(local_input, out).model_copy(update={"max_tokens": 5}), FakeLLM())
    # price and progress do not change the outputs: allowed
    run_job(spec_for(local_input, out, price_per_hour=9.0), FakeLLM())
    # changed input is refused too
    dataset(6, 7).write_parquet(local_input / "b.parquet")
    with pytest.raises(JobSpecChanged, match=rf"input changed: file://{local_input}/b.parquet \(.*num_rows 5 -> 6"):
        run_job(spec_for(local_input, out), FakeLLM())
    report = run_job(spec_for(local_input, out, overwrite=True), FakeLLM())
    assert report.rows_total == 13 and report.rows_skipped == 0
    assert read_output(out).height == 13
    assert read_metrics(str(out)).height == 1  # overwrite starts the job's history over


def test_a_changed_constraint_is_refused_naming_old_and_new_not_only_a_hash(local_input, tmp_path):
    import json

    out = tmp_path / "out"
    run_job(spec_for(local_input, out, regex="a+"), FakeLLM())

    def key(**constraint) -> str:
        from engine.structured import StructuredOutputsParams

        return StructuredOutputsParams(**constraint).key()[:12]

    with pytest.raises(JobSpecChanged) as exc:
        run_job(spec_for(local_input, out, regex="b+"), FakeLLM())
    assert f"(output constraint: regex 'a+' [sha256 {key(regex='a+')}] -> regex 'b+' [sha256 {key(regex='b+')}])" \
        in str(exc.value)
    with pytest.raises(JobSpecChanged) as exc:
        run_job(spec_for(local_input, out, choice=["x", "y"]), FakeLLM())
    assert f"output constraint: regex 'a+' [sha256 {key(regex='a+')}] -> choice ['x', 'y'] [sha256 " \
           f"{key(choice=['x', 'y'])}]" in str(exc.value)
    with pytest.raises(JobSpecChanged, match=r"output constraint: regex 'a\+' \[sha256 \w{12}\] -> none\)"):
        run_job(spec_for(local_input, out), FakeLLM())

    schema = tmp_path / "label.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"topic": {"type": "string"}}}))
    out2 = tmp_path / "out2"
    run_job(spec_for(local_input, out2, json_schema=str(schema)), FakeLLM())
    schema.write_text(json.dumps({"type": "object", "properties": {"topic": {"enum": ["a", "b"]}}}))
    with pytest.raises(JobSpecChanged) as exc:
        run_job(spec_for(local_input, out2, json_schema=str(schema)), FakeLLM())
    assert (f'output constraint: json_schema {schema} {{"properties":{{"topic":{{"type":"string"}}}},"type":"object"}} '
            f'[sha256 ') in str(exc.value)
    assert f'-> json_schema {schema} {{"properties":{{"topic":{{"enum":["a","b"]}}}},"type":"object"}}' \
        in str(exc.value)

    # a manifest written before the text was kept: the hash, said to be all there is
    doc = json.loads((out / "_job" / "manifest.json").read_text())
    del doc["constraint"]
    (out / "_job" / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(JobSpecChanged, match=r"output constraint: \(not recorded by this older manifest\) "
                                             r"\[sha256 \w{12}\] -> regex 'b\+'"):
        run_job(spec_for(local_input, out, regex="b+"), FakeLLM())
    # the text is not hashed: the same job still resumes, with or without it in the manifest
    assert run_job(spec_for(local_input, out, regex="a+"), FakeLLM()).rows_skipped == 12


def test_stray_parts_refused(local_input, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "part-00000.parquet").write_bytes(b"junk")
    with pytest.raises(JobSpecChanged) as exc:
        run_job(spec_for(local_input, out), FakeLLM())
    # what was found, by name: files named like part files, and no manifest
    assert str(exc.value) == (f"{out} holds 1 file(s) named like a job's part files (part-00000.parquet) but no job "
                              f"manifest (_job/manifest.json), so they are not outputs this run can resume; re-run "
                              f"with --overwrite to delete them, or choose another output.")
    for i in range(1, 5):
        (out / f"part-{i:05d}.parquet").write_bytes(b"junk")
    with pytest.raises(JobSpecChanged, match=r"holds 5 file\(s\) named like a job's part files \(part-00000.parquet, "
                                             r"part-00001.parquet, part-00002.parquet and 2 more\) but no job manifest"):
        run_job(spec_for(local_input, out), FakeLLM())


def test_no_id_column_uses_row_index_and_n_gt_1(tmp_path):
    inp = tmp_path / "in.parquet"
    pl.DataFrame({"prompt": ["a b", "c d", None, "e f"], "max_tokens": [2, None, 3, -1]}).write_parquet(inp)
    out = tmp_path / "out"
    with pytest.warns(UserWarning, match="row index"):
        run_job(spec_for(inp, out, n=2, temperature=0.7), FakeLLM())
    df = read_output(out)
    assert df["id"].to_list() == [0, 1, 2, 3]
    assert df["generations"].to_list()[0] == ["b0", "b1"]
    assert df["generation"].to_list()[1] == "d0 d"
    assert df["error"].to_list()[2] == "prompt is null" and df["finish_reason"][2] == "error"
    assert "max_tokens" in df["error"].to_list()[3]
    assert df["completion_tokens"].to_list() == [4, 8, 0, 0]
    m = read_metrics(str(out)).row(0, named=True)
    assert (m["rows_ok"], m["rows_error"]) == (2, 2)


def test_limit(local_input, tmp_path):
    report = run_job(spec_for(local_input, tmp_path / "out", limit=8), FakeLLM())
    assert report.rows_total == 8 and read_output(tmp_path / "out").height == 8


def test_s3_to_s3(s3_bucket, tmp_path):
    so = {}
    for i, name in enumerate(["x/p0.parquet", "x/p1.parquet", "x/sub/p2.parquet"]):
        buf = tmp_path / f"{i}.parquet"
        dataset(4, 4 * i).write_parquet(buf)
        fs, path = io.filesystem(f"s3://{s3_bucket}/{name}", so)
        fs.put(str(buf), path)
    spec = JobSpec(input=f"s3://{s3_bucket}/x/", output=f"s3://{s3_bucket}/out", max_tokens=3, shard_size=3,
                   progress=False)
    run_job(spec, FakeLLM())
    names = io.list_names(spec.output)
    assert names == ["_job"] + [f"part-{i:05d}.parquet" for i in range(6)]
    df = pl.concat([io.read_parquet(io.join(spec.output, n)) for n in names if n.startswith("part-")])
    assert sorted(df["id"].to_list()) == [f"r{i:03d}" for i in range(12)]
    # polars can read the outputs directly with translated storage options
    opts = io.polars_storage_options(io.resolve_storage_options(spec.output))
    direct = pl.read_parquet(f"{spec.output}/part-*.parquet", storage_options=opts)
    assert direct.height == 12
    with pytest.raises(JobSpecChanged):
        run_job(spec.model_copy(update={"max_tokens": 4}), FakeLLM())


def test_job_level_mistakes_are_refused_before_anything_is_written(tmp_path):
    """A bad default sampling option or an output that is a file fails at once and leaves no manifest."""
    import polars as pl

    from pipeline.job import prepare_job
    from pipeline.spec import JobSpec

    src = tmp_path / "in.parquet"
    pl.DataFrame({"id": ["a"], "prompt": ["hello"]}).write_parquet(src)
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="max_tokens"):
        prepare_job(JobSpec(input=str(src), output=str(out), max_tokens=-3))
    assert not out.exists()
    with pytest.raises(ValueError, match="temperature"):
        prepare_job(JobSpec(input=str(src), output=str(out), temperature=float("inf")))
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        prepare_job(JobSpec(input=str(src), output=str(afile)))
    with pytest.raises(ValueError, match=f"lies under {afile}, which is a file"):
        prepare_job(JobSpec(input=str(src), output=str(afile / "sub")))
    # an output that is, or lies in, or contains the input folder: the next run would read its parts
    folder = tmp_path / "data"
    folder.mkdir()
    pl.DataFrame({"id": ["a"], "prompt": ["hello"]}).write_parquet(folder / "x.parquet")
    for output in (folder, folder / "out", tmp_path):
        with pytest.raises(ValueError, match="overlaps the input folder"):
            prepare_job(JobSpec(input=str(folder), output=str(output), overwrite=True))
    assert sorted(p.name for p in folder.iterdir()) == ["x.parquet"]
    # a single input file may sit beside (or above) the output
    prepare_job(JobSpec(input=str(folder / "x.parquet"), output=str(folder / "out")))
    assert (folder / "out" / "_job" / "manifest.json").exists()


def test_an_input_file_named_like_a_part_file_in_the_output_is_refused_never_deleted(tmp_path, monkeypatch):
    """`--output .` beside the input: a part-*.parquet input would be taken for a stray part file, and the
    advice (--overwrite) would delete it; refused instead, before anything is written."""
    monkeypatch.chdir(tmp_path)
    dataset(3).write_parquet(tmp_path / "part-00000.parquet")  # e.g. a Spark part file used as the input
    before = (tmp_path / "part-00000.parquet").read_bytes()
    for overwrite in (False, True):
        with pytest.raises(ValueError) as exc:
            run_job(spec_for("part-00000.parquet", ".", overwrite=overwrite), FakeLLM())
        assert str(exc.value) == (
            f"input file file://{tmp_path}/part-00000.parquet lies in the output folder . under a name the job "
            f"writes its own files by (part-00000.parquet): a run would take it for one of its part files, and "
            f"--overwrite would delete it; move the input, or choose another output")
    assert (tmp_path / "part-00000.parquet").read_bytes() == before and not (tmp_path / "_job").exists()
    # the same file inside a folder that holds the output's files, named with its full path
    (tmp_path / "out").mkdir()
    dataset(3).write_parquet(tmp_path / "out" / "part-00003.parquet")
    with pytest.raises(ValueError, match=rf"input file file://{tmp_path}/out/part-00003.parquet lies in the output "
                                         rf"folder {tmp_path}/out/ under a name"):
        run_job(spec_for(tmp_path / "out" / "part-00003.parquet", f"{tmp_path}/out/"), FakeLLM())


def test_output_dot_beside_a_single_input_file_works_and_keeps_it(tmp_path, monkeypatch):
    """`--output .` with the input file in the same folder: allowed; the job writes part files and `_job/`
    beside it, a resume keeps it, --overwrite deletes only the job's own files. With the input folder
    inside `.` (or `.` itself) the job is refused: its part files would be read as input."""
    monkeypatch.chdir(tmp_path)
    dataset(4).write_parquet(tmp_path / "prompts.parquet")
    before = (tmp_path / "prompts.parquet").read_bytes()
    assert run_job(spec_for("prompts.parquet", "."), FakeLLM()).rows_ok == 4
    assert run_job(spec_for("prompts.parquet", "."), FakeLLM()).rows_skipped == 4
    assert run_job(spec_for("prompts.parquet", ".", overwrite=True), FakeLLM()).rows_ok == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["_job", "part-00000.parquet", "part-00001.parquet",
                                                          "prompts.parquet"]
    assert (tmp_path / "prompts.parquet").read_bytes() == before
    (tmp_path / "data").mkdir()
    dataset(2).write_parquet(tmp_path / "data" / "x.parquet")
    for inp in ("data", "."):
        with pytest.raises(ValueError, match=rf"output \. overlaps the input folder {inp}: "):
            run_job(spec_for(inp, ".", overwrite=True), FakeLLM())
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["x.parquet"]


def test_a_nan_id_is_a_missing_id_not_a_value(tmp_path):
    """pandas writes an int id column with a missing value as float64 with NaN: that row is an error
    row and the warning counts it, as for a null id (it had been processed as the id NaN)."""
    inp = tmp_path / "ids.parquet"
    pl.DataFrame({"id": [1.0, float("nan"), 3.0], "prompt": ["p0", "p1", "p2"]}).write_parquet(inp)
    out = tmp_path / "out"
    with pytest.warns(UserWarning, match=r"1 row\(s\) with a null or NaN 'id' \(rows 1\); each becomes an error row"):
        report = run_job(spec_for(str(inp), out), FakeLLM())
    df = read_output(out).sort("generation", nulls_last=True)
    assert df["error"].to_list() == [None, None, "id is NaN (a missing value)"]
    assert (report.rows_ok, report.rows_error) == (2, 1)


def test_null_and_repeated_ids_warn_and_null_ids_become_error_rows(tmp_path):
    """Rows are numbered across the files in order: a.parquet holds rows 0-2, b.parquet rows 3-7."""
    from pipeline.plan import check_ids

    inp = tmp_path / "in"
    inp.mkdir()
    pl.DataFrame({"id": ["a", "b", None], "prompt": ["p0", "p1", "p2"]}).write_parquet(inp / "a.parquet")
    pl.DataFrame({"id": ["a", "c", "b", None, "a"], "prompt": [f"p{i}" for i in range(3, 8)]}).write_parquet(
        inp / "b.parquet")
    out = tmp_path / "out"
    with pytest.warns(UserWarning) as caught:
        report = run_job(spec_for(inp, out), FakeLLM())
    texts = [str(w.message) for w in caught]
    assert texts == [
        f"{inp}: 2 row(s) with a null or NaN 'id' (rows 2, 6); each becomes an error row",
        f"{inp}: 3 row(s) repeat an earlier row's 'id' (2 distinct ids; row 3 ('a'), row 5 ('b'), row 7 ('a')); "
        "they are processed, so the output holds those ids more than once",
    ]
    df = read_output(out).sort("generation", nulls_last=True)
    assert df["id"].to_list() == ["a", "b", "a", "c", "b", "a", None, None]  # p0 p1 p3 p4 p5 p7, then nulls
    assert df["error"].to_list() == [None] * 6 + ["id is null"] * 2
    assert (report.rows_ok, report.rows_error) == (6, 2)
    # only the first `limit` rows are checked; at most ID_EXAMPLES rows are named
    files = io.list_input_files(str(inp))
    assert check_ids(files, "id", limit=3) == ["1 row(s) with a null or NaN 'id' (rows 2); each becomes an error row"]
    many = tmp_path / "many.parquet"
    pl.DataFrame({"id": [1] * 8, "prompt": ["x"] * 8}).write_parquet(many)
    assert check_ids(io.list_input_files(str(many)), "id") == [
        "7 row(s) repeat an earlier row's 'id' (1 distinct ids; row 1 (1), row 2 (1), row 3 (1), row 4 (1), "
        "row 5 (1), ...); they are processed, so the output holds those ids more than once"]


def test_all_error_job_books_no_token_cost(tmp_path):
    """No token computed: the run's cost is neither input nor output cost."""
    inp = tmp_path / "in.parquet"
    pl.DataFrame({"id": [1, 2, 3], "prompt": [None, "  ", None]}).write_parquet(inp)
    report = run_job(spec_for(inp, tmp_path / "out", price_per_hour=3600.0), FakeLLM())
    assert (report.rows_ok, report.rows_error) == (0, 3)
    assert (report.prompt_tokens, report.completion_tokens) == (0, 0)
    assert report.cost_usd == pytest.approx(report.wall_s) and report.cost_usd > 0
    assert (report.input_cost_usd, report.output_cost_usd) == (0.0, 0.0)
    assert (report.usd_per_1m_input_tokens, report.usd_per_1m_output_tokens, report.usd_per_1m_tokens) == (
        None, None, None)
    m = read_metrics(str(tmp_path / "out")).row(0, named=True)
    assert (m["input_cost_usd"], m["output_cost_usd"]) == (0.0, 0.0)


def test_input_that_is_not_parquet_is_named(tmp_path):
    inp = tmp_path / "in"
    inp.mkdir()
    dataset(2).write_parquet(inp / "a.parquet")
    (inp / "b.parquet").write_text("id,prompt\n1,hello\n")
    with pytest.raises(ValueError) as exc:
        run_job(spec_for(inp, tmp_path / "out"), FakeLLM())
    assert str(exc.value) == (f"file://{inp}/b.parquet is not a Parquet file (Parquet magic bytes not found in "
                              "footer. Either the file is corrupted or this is not a parquet file.)")
    assert not (tmp_path / "out").exists()


def test_a_missing_local_input_says_it_does_not_exist(tmp_path, monkeypatch):
    """A local input path that does not exist had read "no Parquet files at <path>", as an empty folder
    does; it is named, with the folder a relative path was read from."""
    missing = tmp_path / "nope.parquet"
    with pytest.raises(FileNotFoundError) as exc:
        run_job(spec_for(missing, tmp_path / "out"), FakeLLM())
    assert str(exc.value) == f"input {missing} does not exist"
    assert not (tmp_path / "out").exists()
    with pytest.raises(FileNotFoundError) as exc:
        io.list_input_files(f"file://{missing}")
    assert str(exc.value) == f"input file://{missing} does not exist"
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as exc:
        io.list_input_files("in/")
    assert str(exc.value) == f"input in/ does not exist (read from the current folder, {tmp_path})"
    (tmp_path / "in").mkdir()  # a folder that exists but holds no Parquet file keeps its own message
    with pytest.raises(FileNotFoundError) as exc:
        io.list_input_files("in/")
    assert str(exc.value) == "no Parquet files at in/"


def test_an_unreachable_http_input_says_so_naming_the_url_and_the_error(tmp_path):
    """fsspec's HTTP file system reads a refused connection as "no such file"; the user is told the
    URL could not be reached. A server that answers 404 is named with its status (it had been "no
    Parquet files at <url>", as for an empty folder)."""
    import functools
    import http.server
    import socket
    import threading

    from pipeline.storage import StorageError

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/x.parquet"
    with pytest.raises(StorageError) as exc:
        io.list_input_files(url)
    message = str(exc.value)
    assert message.startswith(f"cannot read {url}: the URL could not be reached (ClientConnectorError: Cannot "
                              f"connect to host 127.0.0.1:{port}"), message
    assert "\n" not in message and "no Parquet files" not in message and exc.value.kind == "connect"
    with pytest.raises(StorageError, match="could not be reached"):
        run_job(spec_for(url, tmp_path / "out"), FakeLLM())

    served = tmp_path / "served"
    served.mkdir()
    dataset(3).write_parquet(served / "a.parquet")
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

    handler = functools.partial(Quiet, directory=str(served))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        with pytest.raises(StorageError) as exc:
            io.list_input_files(f"{base}/missing.parquet")  # the server answered 404
        assert str(exc.value) == f"cannot read {base}/missing.parquet: the server answered HTTP 404 (File not found)"
        assert exc.value.kind == "not-found"
        with pytest.raises(StorageError, match="the server answered HTTP 404"):
            run_job(spec_for(f"{base}/missing.parquet", tmp_path / "out"), FakeLLM())
        assert not (tmp_path / "out").exists()
        [f] = io.list_input_files(f"{base}/a.parquet")
        assert (f.path, f.num_rows) == (f"{base}/a.parquet", 3)
    finally:
        server.shutdown()
        server.server_close()


def test_an_http_input_that_never_answers_fails_within_the_read_timeout(tmp_path):
    """A server that accepts the connection and then says nothing: the job is refused once the read
    timeout (the same `config_kwargs` limits as for s3://, 1 s here) has passed, naming the URL,
    where it had waited for aiohttp's 5 minutes per request."""
    import socket
    import threading
    import time

    from pipeline.storage import StorageError

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    held = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])  # kept open, never answered
            except OSError:
                continue

    threading.Thread(target=accept, daemon=True).start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}/x.parquet"
    try:
        t0 = time.monotonic()
        with pytest.raises(StorageError) as exc:
            io.list_input_files(url, {"config_kwargs": {"read_timeout": 1}})
        waited = time.monotonic() - t0
    finally:
        stop.set()
        for c in held:
            c.close()
        listener.close()
    assert waited < 10, waited
    message = str(exc.value)
    assert message.startswith(f"cannot read {url}: the URL could not be reached (") and "Timeout" in message, message
    assert len(held) >= 1  # it did connect: the silence, not the connection, timed out


def _damaged_copies(tmp_path, good: bytes, page_start: int, page_end: int):
    """Copies of a Parquet file with a few bytes of one column's pages overwritten (fixed seeds), each
    with the message pyarrow itself gives when reading it (None when it still reads)."""
    import random

    import pyarrow.parquet as pq

    for seed in range(40):
        rng = random.Random(seed)
        data = bytearray(good)
        at = rng.randrange(page_start, page_end - 8)
        for k in range(at, at + rng.randrange(1, 8)):
            data[k] = rng.randrange(256)
        path = tmp_path / f"damaged-{seed}.parquet"
        path.write_bytes(bytes(data))
        try:
            for _ in pq.ParquetFile(path).iter_batches(columns=["prompt"]):  # as the planner reads it
                pass
            yield path, None
        except Exception as exc:  # noqa: BLE001 - whatever pyarrow raises is what the pipeline must quote
            yield path, str(exc)


def test_a_damaged_parquet_page_gives_a_printable_message_naming_the_file(tmp_path):
    """pyarrow quotes raw bytes of a damaged page header ("don't know what type: \\x0f"); the message
    that reaches the user names the file and escapes them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.storage import StorageError, printable

    good = tmp_path / "good.parquet"
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(200)], "prompt": [f"prompt {i} " * 5 for i in range(200)]}),
                   good, compression="NONE", use_dictionary=False)
    column = pq.ParquetFile(good).metadata.row_group(0).column(1)
    start = column.data_page_offset
    raw_unprintable = 0
    checked = 0
    for path, raw in _damaged_copies(tmp_path, good.read_bytes(), start, start + 200):  # header and first values
        if raw is None:
            continue
        quoted = raw.strip().splitlines()[0]  # the line a message quotes (a dump may follow it)
        raw_unprintable += not quoted.isprintable()
        with pytest.raises((StorageError, ValueError)) as exc:
            io.read_rows(str(path), 0, 200)
        message = str(exc.value)
        assert message.isprintable() and message.startswith(f"cannot read {path}: "), message
        assert message.endswith(printable(quoted)), (message, raw)
        with pytest.raises((StorageError, ValueError)) as exc:
            list(io.iter_batches(str(path), ["prompt"]))
        assert str(exc.value) == message
        checked += 1
    assert checked >= 10 and raw_unprintable >= 1, (checked, raw_unprintable)  # the case this test is about

    # one of them, through a job: the same one printable line
    path = next(p for p, raw in _damaged_copies(tmp_path, good.read_bytes(), start, start + 200)
                if raw is not None and not raw.strip().splitlines()[0].isprintable())
    with pytest.raises(StorageError) as exc:
        run_job(spec_for(path, tmp_path / "out"), FakeLLM())
    assert str(exc.value).isprintable() and "\\x" in str(exc.value), str(exc.value)


def test_a_job_refused_for_a_damaged_input_leaves_no_folder_behind(tmp_path):
    """The damage shows when the job plans, after it took the output's lease: the refusal left an empty
    `out/_job/lease/`. The folders the lease created go with it; one that was there before stays."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.storage import StorageError

    good = tmp_path / "good.parquet"
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(50)], "prompt": [f"prompt {i} " * 5 for i in range(50)]}),
                   good, compression="NONE", use_dictionary=False)
    start = pq.ParquetFile(good).metadata.row_group(0).column(1).data_page_offset
    data = bytearray(good.read_bytes())
    data[start + 20:start + 26] = b"\xff" * 6  # the prompt column's page header
    bad = tmp_path / "in" / "bad.parquet"
    bad.parent.mkdir()
    bad.write_bytes(bytes(data))
    out = tmp_path / "out"
    with pytest.raises(StorageError, match="cannot read .*bad.parquet"):
        run_job(spec_for(bad, out), FakeLLM())
    assert not out.exists()
    (out / "mine").mkdir(parents=True)  # the user's own folder, with something in it: left as it was
    with pytest.raises(StorageError, match="cannot read .*bad.parquet"):
        run_job(spec_for(bad, out), FakeLLM())
    assert sorted(p.name for p in out.iterdir()) == ["mine"]
    bad.write_bytes(good.read_bytes())  # repaired: the job runs there as usual
    run_job(spec_for(bad, out), FakeLLM())
    assert read_output(out).height == 50 and (out / "_job" / "manifest.json").exists()


def test_fake_llm_drops_a_character_cut_by_max_tokens_as_the_engine_does():
    """FakeLLM's one token per byte cut "é" (2 bytes) and "🎉" (4) after a byte and wrote U+FFFD; the
    engine's texts drop the cut character (`Tokenizer.decode_complete`), and so does FakeLLM's now."""
    from engine import SamplingParams

    def text(prompt: str, max_tokens: int) -> tuple[str, int]:
        [out] = FakeLLM().generate([prompt], SamplingParams(max_tokens=max_tokens))
        return out.outputs[0].text, len(out.outputs[0].token_ids)

    assert [text("Say é", n) for n in (1, 2, 3, 5)] == [("", 1), ("é", 2), ("é0", 3), ("é0 ", 5)]
    assert [text("Party 🎉", n) for n in (1, 3, 4)] == [("", 1), ("", 3), ("🎉", 4)]
    assert FakeLLM().tokenizer.decode_complete(FakeLLM().tokenizer.encode("a\ufffd")) == "a\ufffd"  # a whole U+FFFD stays


def test_printable_escapes_control_characters_and_caps_the_length():
    from pipeline.storage import printable

    assert printable("type: \x0f\x00 end\n\ttab") == "type: \\x0f\\x00 end\\n\\ttab"
    assert printable("café ✓") == "café ✓"  # printable non-ASCII stays as it is
    long = printable("\x01" * 500, max_chars=40)
    assert long == "\\x01" * 10 + "... (1960 more characters)" and long.isprintable()


def test_a_glob_input_reads_the_files_it_matches_sorted_and_resumes(tmp_path):
    d = tmp_path / "in"
    (d / "2026-02").mkdir(parents=True)
    (d / "2026-01").mkdir()
    dataset(4, 3).write_parquet(d / "2026-02" / "b.parquet")
    dataset(3).write_parquet(d / "2026-01" / "a.parquet")
    dataset(2, 50).write_parquet(d / "2026-01" / "skip.txt")  # not *.parquet: the pattern below does not take it
    dataset(2, 60).write_parquet(d / "old.parquet")  # one level up: not matched by */*.parquet
    (d / "2026-01" / "_tmp").mkdir()
    dataset(2, 70).write_parquet(d / "2026-01" / "_tmp" / "c.parquet")  # hidden: skipped under **
    files = io.list_input_files(f"{d}/*/*.parquet")
    assert [f.path for f in files] == [f"file://{d}/2026-01/a.parquet", f"file://{d}/2026-02/b.parquet"]
    assert [f.path for f in io.list_input_files(f"{d}/**/*.parquet")] == [
        f"file://{d}/2026-01/a.parquet", f"file://{d}/2026-02/b.parquet", f"file://{d}/old.parquet"]
    assert [f.path for f in io.list_input_files(f"{d}/2026-0[2]/*")] == [f"file://{d}/2026-02/b.parquet"]

    out = tmp_path / "out"
    spec = spec_for(f"{d}/*/*.parquet", out)
    report = run_job(spec, FakeLLM())
    assert report.rows_total == 7 and report.rows_ok == 7
    assert read_output(out)["id"].to_list() == [f"r{i:03d}" for i in range(7)]
    assert run_job(spec, FakeLLM()).rows_skipped == 7  # the same pattern resumes: every shard done

    with pytest.raises(FileNotFoundError) as exc:
        run_job(spec_for(f"{d}/*/*.json", tmp_path / "out2"), FakeLLM())
    assert str(exc.value) == f"no Parquet files match the pattern {d}/*/*.json"
    assert not (tmp_path / "out2").exists()
    # an output the pattern would read back on the next run is refused before anything is written
    with pytest.raises(ValueError) as exc:
        run_job(spec_for(f"{d}/*/*.parquet", d / "2026-03"), FakeLLM())
    assert str(exc.value) == (f"output {d}/2026-03 lies where the input pattern {d}/*/*.parquet matches: the part "
                              f"files written there would be read as input by the next run (a resume); choose an "
                              f"output the pattern does not match")
    assert not (d / "2026-03").exists()


def test_a_glob_input_on_s3(s3_bucket, s3_server, tmp_path):
    so = {"endpoint_url": s3_server, "key": "testing", "secret": "testing"}
    for name, frame in {"in/part-b.parquet": dataset(4, 3), "in/part-a.parquet": dataset(3),
                        "in/other.parquet": dataset(2, 60), "in/_meta/x.parquet": dataset(1, 80)}.items():
        buf = tmp_path / "f.parquet"
        frame.write_parquet(buf)
        io.write_bytes(f"s3://{s3_bucket}/{name}", buf.read_bytes(), so)
    pattern = f"s3://{s3_bucket}/in/part-*.parquet"
    assert [f.path for f in io.list_input_files(pattern, so)] == [
        f"s3://{s3_bucket}/in/part-a.parquet", f"s3://{s3_bucket}/in/part-b.parquet"]
    out = f"s3://{s3_bucket}/out"
    report = run_job(spec_for(pattern, out, storage_options=so), FakeLLM())
    assert report.rows_total == 7 and report.rows_ok == 7
    fs, path = io.filesystem(out, so)
    got = pl.concat([pl.read_parquet(fs.cat_file(p)) for p in sorted(fs.glob(f"{path}/part-*.parquet"))])
    assert got["id"].to_list() == [f"r{i:03d}" for i in range(7)]
    with pytest.raises(FileNotFoundError) as exc:
        io.list_input_files(f"s3://{s3_bucket}/in/*.csv", so)
    assert str(exc.value) == f"no Parquet files match the pattern s3://{s3_bucket}/in/*.csv"


def test_the_manifest_and_cost_report_record_the_resolved_dtype_and_a_resume_keeps_it(local_input, tmp_path,
                                                                                       monkeypatch):
    """dtype="auto" is resolved for this host when the job is planned (bf16 where the CPU has a bf16
    matrix unit, else fp32) and recorded in the manifest; the cost report names it and the host. A
    resume builds its engine with the recorded dtype, whatever this host would pick, and a manifest
    from before the dtype was recorded resumes with what "auto" meant then on the CPU (fp32)."""
    import json

    from engine.host import describe
    from pipeline import engines, job

    built = []

    def fake_get_llm(spec):
        built.append(spec.dtype)
        return FakeLLM()

    monkeypatch.setattr(job, "get_llm", fake_get_llm)
    out = tmp_path / "out"
    spec = spec_for(local_input, out, shards_in_flight=1)
    here = engines.host_dtype(spec)
    assert here in ("float32", "bfloat16")

    class Killed(Exception):
        pass

    def die(result):
        raise Killed

    with pytest.raises(Killed):
        run_job(spec, on_shard_done=die)
    doc = json.loads((out / "_job" / "manifest.json").read_text())
    assert doc["dtype"] == here and built == [here]
    row = read_metrics(str(out)).row(0, named=True)
    assert row["dtype"] == here and row["host"] == describe()
    # planned on another host: the resume computes in the recorded dtype
    other = "float32" if here == "bfloat16" else "bfloat16"
    doc["dtype"] = other
    (out / "_job" / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(Killed):
        run_job(spec, on_shard_done=die)
    assert built[-1] == other
    assert read_metrics(str(out)).sort("started_at")["dtype"].to_list()[-1] == other
    # an older manifest, without the dtype: "auto" meant fp32 on the CPU
    del doc["dtype"]
    (out / "_job" / "manifest.json").write_text(json.dumps(doc))
    report = run_job(spec)
    assert built[-1] == "float32" and report.dtype == "float32"
    assert report.rows_ok + report.rows_skipped == 12 and report.rows_skipped > 0
    # an explicit dtype is the spec's own (a new job)
    run_job(spec_for(local_input, tmp_path / "out2", dtype="float32"))
    assert built[-1] == "float32"
    assert json.loads((tmp_path / "out2" / "_job" / "manifest.json").read_text())["dtype"] == "float32"


def test_a_manifest_of_another_version_is_refused_by_name_and_overwrite_replaces_it(local_input, tmp_path):
    """The manifest records MANIFEST_VERSION (2: shards as row lists); a resume of a manifest of another
    version (or none) is refused in one message naming the file and both versions, before any shard
    runs; --overwrite replaces that job."""
    import json

    from pipeline.manifest import MANIFEST_VERSION

    out = tmp_path / "out"
    spec = spec_for(local_input, out)
    run_job(spec, FakeLLM())
    path = out / "_job" / "manifest.json"
    doc = json.loads(path.read_text())
    assert doc["version"] == MANIFEST_VERSION == 2
    for version in (1, None):
        doc["version"] = version
        path.write_text(json.dumps(doc))
        with pytest.raises(ValueError) as exc:
            run_job(spec, FakeLLM())
        assert str(exc.value) == (f"{path} is a manifest of version {version!r}; this tokenmill reads version 2 "
                                  f"only, so it cannot resume that job: re-run with --overwrite to start over, or "
                                  f"choose another output")
    assert read_metrics(str(out)).height == 1  # refused before the run booked anything
    report = run_job(spec.model_copy(update={"overwrite": True}), FakeLLM())
    assert report.rows_ok == 12 and json.loads(path.read_text())["version"] == 2
