"""The base-model labelling demo's few-shot prompts (`pipeline.few_shot`)."""
from __future__ import annotations

import os

import polars as pl
import pytest

from pipeline.few_shot import few_shot_labelling

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "labelling.parquet")


def test_one_worked_example_per_label_left_out_of_the_scored_rows(tmp_path):
    src = pl.read_parquet(DATA)
    path, shots = few_shot_labelling(DATA, tmp_path / "sub" / "few_shot.parquet")
    out = pl.read_parquet(path)
    firsts = [src.filter(pl.col("reference_label") == lab)["id"][0] for lab in dict.fromkeys(src["reference_label"])]
    assert shots == firsts and len(shots) == 6
    assert out.height == src.height - 6 and not set(shots) & set(out["id"])
    assert out.columns == src.columns  # pass-through columns kept
    instruction = src["prompt"][0].split("\n\n", 1)[0]
    examples = "".join(f"{src.filter(pl.col('id') == i)['prompt'][0].split(chr(10) * 2, 1)[1]}\nTopic: "
                       f"{src.filter(pl.col('id') == i)['reference_label'][0]}\n\n" for i in shots)
    for row in out.head(3).iter_rows(named=True):
        item = src.filter(pl.col("id") == row["id"])["prompt"][0].split("\n\n", 1)[1]
        assert row["prompt"] == f"{instruction}\n\n{examples}{item}\nTopic:"


def test_a_sample_without_labels_is_refused_naming_the_column(tmp_path):
    pl.DataFrame({"id": ["a"], "prompt": ["x\n\ny"]}).write_parquet(tmp_path / "in.parquet")
    with pytest.raises(ValueError, match="reference_label"):
        few_shot_labelling(str(tmp_path / "in.parquet"), tmp_path / "out.parquet")
