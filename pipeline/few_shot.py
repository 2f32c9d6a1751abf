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
are labelled and scored. The answer follows "Topic:" as " <label>" (one token with its leading
space in SentencePiece vocabularies), so the demo's choice constraint lists the labels with a
leading space (`LABEL_SPACE`) and the accuracy strips it. The prompts share everything up to
the row's own docstring, so the prefix cache computes the examples once.
"""
from __future__ import annotations

from pathlib import Path

LABEL_SPACE = " "


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

    df = pl.read_parquet(src)
    missing = [c for c in ("id", "prompt", "reference_label") if c not in df.columns]
    if missing:
        raise ValueError(f"{src}: the few-shot labelling demo needs the column(s) {missing}")
    parts = pl.col("prompt").str.splitn("\n\n", 2)
    df = df.with_columns(parts.struct.field("field_0").alias("_instruction"),
                         parts.struct.field("field_1").alias("_item"))
    shots = df.group_by("reference_label", maintain_order=True).first()
    instruction = df["_instruction"][0]
    examples = "".join(f"{item}\nTopic:{LABEL_SPACE}{label}\n\n"
                       for item, label in zip(shots["_item"], shots["reference_label"]))
    rest = df.filter(~pl.col("id").is_in(shots["id"].implode()))
    rest = rest.with_columns((pl.lit(f"{instruction}\n\n{examples}") + pl.col("_item") + pl.lit("\nTopic:"))
                             .alias("prompt")).drop("_instruction", "_item")
    dest.parent.mkdir(parents=True, exist_ok=True)
    rest.write_parquet(dest)
    return dest, shots["id"].to_list()
