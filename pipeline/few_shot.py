"""The labelling demo for a base model (no chat template, e.g. Gemma 3 270M): few-shot prompts.

An instruction-tuned model answers the sample's instruction as it is; a base model continues
text, so each row becomes a document of worked examples that ends where the answer goes:

    <the sample's instruction>

    Docstring of glob.iglob:
    Return an iterator which yields the paths ...
    Topic: files

    ... (one worked example per label) ...

    Docstring of <the row's name>:
    <the row's docstring>
    Topic:

The worked examples are the first row of each label in the sample, left out of the rows that
are labelled and scored. The demo scores each label (`score_choices`) and also reports the
labels after contextual calibration (Zhao et al. 2021, "Calibrate Before Use", arXiv
2102.09690): a small base model leans to some labels whatever the item (often the last worked
example's); each label's probability is divided by its probability on content-free items
(`content_free_prompts`), and the largest quotient is the label.
The answer follows "Topic:" as " <label>" (one token with its leading space in SentencePiece
vocabularies), so the demo's labels carry a leading space (`LABEL_SPACE`) and the accuracy
strips it.
"""
from __future__ import annotations

import math
from pathlib import Path

LABEL_SPACE = " "
# content-free items (the paper's "N/A", "" and "[MASK]") in the sample's item format
CONTENT_FREE = ("Docstring of N/A:\nN/A", "Docstring of :\n", "Docstring of [MASK]:\n[MASK]")


def _split(src: str):
    """(rows with _instruction and _item columns, the worked examples' rows, the instruction)."""
    import polars as pl

    df = pl.read_parquet(src)
    missing = [c for c in ("id", "prompt", "reference_label") if c not in df.columns]
    if missing:
        raise ValueError(f"{src}: the few-shot labelling demo needs the column(s) {missing}")
    parts = pl.col("prompt").str.splitn("\n\n", 2)
    df = df.with_columns(parts.struct.field("field_0").alias("_instruction"),
                         parts.struct.field("field_1").alias("_item"))
    shots = df.group_by("reference_label", maintain_order=True).first()
    return df, shots, df["_instruction"][0]


def _document(instruction: str, shots) -> str:
    """The prompt up to the row's own item: the instruction and one worked example per label."""
    examples = "".join(f"{item}\nTopic:{LABEL_SPACE}{label}\n\n"
                       for item, label in zip(shots["_item"], shots["reference_label"]))
    return f"{instruction}\n\n{examples}"


def few_shot_labelling(src: str, dest: Path) -> tuple[Path, list[str]]:
    """Write the labelling sample `src` as few-shot prompts to the Parquet file `dest`.

    Args:
        src: the labelling sample (columns id, prompt = instruction, blank line, item; reference_label).
        dest: the file to write (its folder is created).
    Returns:
        (dest, the ids of the rows used as worked examples, left out of dest).
    Raises:
        ValueError: `src` lacks the prompt, id or reference_label column.
    """
    import polars as pl

    df, shots, instruction = _split(src)
    rest = df.filter(~pl.col("id").is_in(shots["id"].implode()))
    rest = rest.with_columns((pl.lit(_document(instruction, shots)) + pl.col("_item") + pl.lit("\nTopic:"))
                             .alias("prompt")).drop("_instruction", "_item")
    dest.parent.mkdir(parents=True, exist_ok=True)
    rest.write_parquet(dest)
    return dest, shots["id"].to_list()


def content_free_prompts(src: str) -> list[str]:
    """The few-shot document of `few_shot_labelling(src, ...)` ending in each `CONTENT_FREE` item.

    Raises:
        ValueError: as `few_shot_labelling`.
    """
    _, shots, instruction = _split(src)
    head = _document(instruction, shots)
    return [f"{head}{item}\nTopic:" for item in CONTENT_FREE]


def contextual_prior(scores: list[dict[str, float]]) -> dict[str, float]:
    """Log of each label's mean probability over the content-free prompts, the probabilities
    renormalised over the labels per prompt (Zhao et al. 2021, contextual calibration).

    Args:
        scores: per content-free prompt, {label: log-probability} (natural log), the same labels.
    Raises:
        ValueError: no scores.
    """
    if not scores:
        raise ValueError("contextual_prior needs the scores of at least one content-free prompt")
    labels = list(scores[0])
    probs = [[math.exp(s[c] - _logsumexp(s.values())) for c in labels] for s in scores]
    return {c: math.log(sum(p[i] for p in probs) / len(probs)) for i, c in enumerate(labels)}


def calibrated_label(scores: dict[str, float], prior: dict[str, float]) -> str:
    """The label whose log-probability less its `contextual_prior` is largest (the first of ties)."""
    return max(scores, key=lambda c: scores[c] - prior[c])


def _logsumexp(values) -> float:
    values = list(values)
    top = max(values)
    return top + math.log(sum(math.exp(v - top) for v in values))
