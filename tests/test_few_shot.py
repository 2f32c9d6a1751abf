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


def test_content_free_prompts_end_the_same_document_in_each_content_free_item(tmp_path):
    from pipeline.few_shot import CONTENT_FREE, content_free_prompts

    path, _ = few_shot_labelling(DATA, tmp_path / "few_shot.parquet")
    row = pl.read_parquet(path)["prompt"][0]
    head = row[:row.index("Docstring of", row.rindex("Topic: ") )]
    cf = content_free_prompts(DATA)
    assert cf == [f"{head}{item}\nTopic:" for item in CONTENT_FREE]


def test_contextual_prior_averages_probabilities_renormalised_over_the_labels():
    import math

    from pipeline.few_shot import calibrated_label, contextual_prior

    # per prompt, probabilities over the two labels: (0.8, 0.2) and (0.4, 0.6) (log-probs shifted by a constant)
    scores = [{"a": math.log(0.8) - 3, "b": math.log(0.2) - 3}, {"a": math.log(0.4), "b": math.log(0.6)}]
    prior = contextual_prior(scores)
    assert math.isclose(math.exp(prior["a"]), 0.6) and math.isclose(math.exp(prior["b"]), 0.4)
    # raw: "a" (0.55 > 0.45); calibrated: 0.55 / 0.6 < 0.45 / 0.4, so "b"
    row = {"a": math.log(0.55), "b": math.log(0.45)}
    assert max(row, key=row.get) == "a" and calibrated_label(row, prior) == "b"
    with pytest.raises(ValueError, match="content-free"):
        contextual_prior([])
