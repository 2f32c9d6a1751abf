"""Bad rows on the real model: each becomes an error row with a message; good rows are unaffected."""
from __future__ import annotations

import json
import os

import polars as pl
import pytest

from engine import SamplingParams
from pipeline import JobSpec, get_llm, read_metrics, run_job

try:
    from tests.s3_server import job_llm  # noqa: F401  (fixture)
except ImportError:  # tests/ is not a package: pytest puts it on sys.path
    from s3_server import job_llm  # noqa: F401

GOOD = ["Name a colour.", "Say hello.", "Count to three."]


def test_bad_rows_become_error_rows(job_llm, tmp_path):
    inp = tmp_path / "in"
    inp.mkdir()
    # prompt column rows: good, null, too long (> the model's 8192-token context), negative max_tokens, good, bad temperature
    pl.DataFrame({
        "id": [1, 2, 3, 4, 5, 6],
        "prompt": [GOOD[0], None, "many words " * 4500, GOOD[1], GOOD[2], GOOD[2]],
        "max_tokens": [None, None, None, -5, None, None],
        "temperature": [None, None, None, None, None, -1.0],
        "tag": ["a", "b", "c", "d", "e", "f"],
    }).write_parquet(inp / "a.parquet")
    # an integer prompt column
    pl.DataFrame({"id": [7], "prompt": [12345], "tag": ["g"]}).write_parquet(inp / "b.parquet")
    # messages column (JSON strings): good, broken JSON, bad role, not a list
    good_msgs = json.dumps([{"role": "user", "content": GOOD[1]}])
    pl.DataFrame({
        "id": [8, 9, 10, 11],
        "messages": [good_msgs, '[{"role": "user", "content": ', '[{"role": "robot", "content": "hi"}]', '{"a": 1}'],
        "tag": ["h", "i", "j", "k"],
    }).write_parquet(inp / "c.parquet")

    spec = JobSpec(input=str(inp), output=str(tmp_path / "out"), max_tokens=6, shard_size=4, progress=False,
                   )
    report = run_job(spec)  # the job succeeds
    out = tmp_path / "out"
    df = pl.concat([pl.read_parquet(out / p) for p in sorted(os.listdir(out)) if p.startswith("part-")],
                   how="diagonal_relaxed").sort("id")
    by_id = {r["id"]: r for r in df.to_dicts()}
    assert sorted(by_id) == list(range(1, 12))
    assert [by_id[i]["tag"] for i in range(1, 12)] == list("abcdefghijk")

    expected_errors = {
        2: "prompt is null",
        3: "too long",
        4: "max_tokens must be an integer >= 1",
        6: "temperature",
        7: "prompt must be a string, got int",
        9: "messages is not valid JSON",
        10: "role must be one of",
        11: "messages must be a non-empty list",
    }
    for i, message in expected_errors.items():
        row = by_id[i]
        assert row["error"] is not None and message in row["error"], (i, row["error"])
        assert row["finish_reason"] == "error" and row["generation"] is None and row["completion_tokens"] == 0

    # good rows: no error, and the same text as the engine gives them alone
    llm = get_llm(spec)
    alone = llm.generate(
        [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in GOOD],
        SamplingParams(max_tokens=6, temperature=0.0), use_tqdm=False)
    for i, expected in zip([1, 5, 8], [alone[0], alone[2], alone[1]]):
        row = by_id[i]
        assert row["error"] is None and row["finish_reason"] in ("stop", "length")
        assert row["generation"] == expected.outputs[0].text and row["generation"]
        assert row["prompt_tokens"] == len(expected.prompt_token_ids)

    m = read_metrics(spec.output).row(0, named=True)
    assert (m["rows_ok"], m["rows_error"], m["rows_total"]) == (3, 8, 11)
    assert report.rows_error == 8
    assert m["completion_tokens"] == df["completion_tokens"].sum()
