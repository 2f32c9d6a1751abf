"""The `tokenmill` command: run on local files, report, changed-spec refusal, demo."""
from __future__ import annotations

import os

import polars as pl

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


def test_pipeline_never_imports_prefect():
    import subprocess
    import sys

    code = "import sys, pipeline, pipeline.cli; assert 'prefect' not in sys.modules, 'pipeline imported prefect'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.dirname(os.path.dirname(__file__)))
