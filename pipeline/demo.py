"""`tokenmill demo`: the bundled sample jobs (data/), run into ./demo_output/<job>/ and scored.

A re-run replaces the previous demo's output there (`overwrite` implied); an output folder that holds
another job's output, or part files without a manifest (`other_output`), is refused by the CLI (exit 2)
unless `--overwrite` is given. With a base model (no chat template) the labelling demo runs few-shot and is
compared with the default model on the same rows (`pipeline.few_shot`).
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any, Callable, Optional

from pipeline.spec import JobSpec

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
DEMO_JOBS: dict[str, dict[str, Any]] = {
    # one-word topic labels, constrained to the dataset's label set: a few tokens each, greedy
    "labelling": {"input": str(DATA_DIR / "labelling.parquet"), "max_tokens": 8, "temperature": 0.0,
                  "shard_size": 64, "choice": ["files", "network", "text", "math", "concurrency", "data"]},
    # short seeds, longer generations (each row sets its own max_tokens), sampled
    "synthetic": {"input": str(DATA_DIR / "synthetic.parquet"), "max_tokens": 64, "temperature": 0.8,
                  "top_p": 0.95, "shard_size": 16},
}
DEMO_OUTPUT = "demo_output"


def run_demo(spec: JobSpec, job: str, other: Optional[str], run: Callable[[JobSpec], int],
             echo: Callable[..., None], given: Optional[argparse.Namespace] = None) -> int:
    """Run demo `job` ("labelling" | "synthetic") as `spec`, print its first line and, for the labelling job,
    sample rows and the accuracy. A base model runs the few-shot labelling demo (`_demo_few_shot`).

    Args:
        other: what `spec.output` holds when it is not a previous demo's output (`other_output`), which
            the CLI lets this replace only when the user asked for `overwrite`; its first line says so.
        run: runs a job and prints its report, returning the exit code (the CLI's, which knows the cluster).
        echo: prints a line of the command's output.
        given: the command line's options; one the demo data sets per row (`shadowed_options`) gets a
            note after the first line.

    Returns: the exit code.
    """
    from pipeline import io
    from pipeline.manifest import job_url

    default_model = JobSpec.model_fields["model"].default
    if job == "labelling" and spec.model != default_model and not _has_chat_template(spec):
        return _demo_few_shot(spec, default_model, run, echo)
    replacing = spec.overwrite and io.exists(job_url(spec.output, "manifest.json"), spec.storage_options)
    what = (f" (replacing {other} there: overwrite is on)" if spec.overwrite and other else
            " (replacing the previous demo output there; --no-overwrite resumes it instead)" if replacing else "")
    echo(f"tokenmill demo: {job} job, {spec.input} -> {spec.output}, model {spec.model}{what}")
    for line in shadowed_options(spec.input, given):
        echo(f"tokenmill demo: note: {line}")
    rc = run(spec)
    if rc == 0 and job == "labelling":
        _print_label_accuracy(spec.output, echo)
    return rc


def shadowed_options(path: str, given: Optional[argparse.Namespace]) -> list[str]:
    """One line for each option on the command line (`given`) that the Parquet file at `path` also sets
    in a column of the same name: a row's non-null cell overrides the job's value (`pipeline.schema`), so
    the option applies only to rows where that cell is null."""
    import pyarrow.parquet as pq
    import polars as pl

    from pipeline.schema import OVERRIDE_COLUMNS

    if given is None:
        return []
    names = [c for c in pq.read_schema(path).names if c in OVERRIDE_COLUMNS and getattr(given, c, None) is not None]
    lines = []
    for name in names:
        column = pl.read_parquet(path, columns=[name])[name]
        values = column.drop_nulls().unique().sort().to_list()
        shown = ", ".join(map(str, values[:3])) + (", ..." if len(values) > 3 else "")
        lines.append(f"{Path(path).name} sets {name} per row ({shown}) in {len(column) - column.null_count()} of "
                     f"{len(column)} rows; --{name.replace('_', '-')} {getattr(given, name)} applies only where it "
                     f"is null")
    return lines


def overwrite_given(args: argparse.Namespace) -> bool:
    """Whether `--overwrite` / `--no-overwrite`, or the --spec file, sets `overwrite`."""
    if getattr(args, "overwrite", None) is not None:
        return True
    if getattr(args, "spec", None):
        from pipeline.spec import load_spec_file

        return "overwrite" in load_spec_file(args.spec)[0]
    return False


def other_output(spec: JobSpec) -> Optional[str]:
    """What the demo's output folder holds when it is not a previous demo's output, else None: another
    job's (a manifest whose inputs are not the bundled data nor the few-shot demo's `<output>-input`
    files), or part files without a manifest.

    Raises:
        StorageError: the output cannot be listed or read.
        ValueError: the output is a file (the words `tokenmill run` uses).
    """
    from pipeline import io
    from pipeline.manifest import read_manifest

    fs, path = io.filesystem(spec.output, spec.storage_options)
    if fs.isfile(path):  # (reading its manifest said "NotADirectoryError: [Errno 20] ...")
        raise ValueError(f"output {spec.output} is a file; give a folder (or prefix) URL")
    manifest = read_manifest(spec.output, spec.storage_options, check_version=False)
    if manifest is None:
        if not io.exists(spec.output, spec.storage_options):
            return None
        parts = [n for n in io.list_names(spec.output, spec.storage_options) if n.startswith("part-")]
        return f"part files ({parts[0]}, ...) and no job manifest" if parts else None

    def local(path: str) -> str:
        return os.path.realpath(path[len("file://"):] if path.startswith("file://") else path)

    demo_inputs = {local(job["input"]) for job in DEMO_JOBS.values()}
    few_shot_dir = local(spec.output.rstrip("/") + "-input") + os.sep
    inputs = [str(f.get("path", "")) for f in manifest.get("inputs") or [] if isinstance(f, dict)]
    foreign = [p for p in inputs if local(p) not in demo_inputs and not local(p).startswith(few_shot_dir)]
    return f"the output of another job (input {foreign[0]})" if foreign else None


def _has_chat_template(spec: JobSpec) -> bool:
    """Whether the job wraps prompts in the model's chat template (`chat_template`, else whether the
    model's tokenizer has one)."""
    if spec.chat_template is not None:
        return spec.chat_template
    from engine.tokenizer import Tokenizer

    return Tokenizer.from_model(spec.model).has_chat_template


def _demo_few_shot(spec: JobSpec, default_model: str, run: Callable[[JobSpec], int],
                   echo: Callable[..., None]) -> int:
    """The labelling demo on a base model (`pipeline.few_shot`): few-shot prompts whose labels are
    scored (`score_choices`), then the default model on the same rows as its demo runs them (its
    chat template, zero-shot, choice constraint), and the accuracies against `reference_label`: the
    base model's best-scored labels, its labels after contextual calibration, and the default
    model's. Returns the exit code."""
    from pipeline.few_shot import LABEL_SPACE, content_free_prompts, contextual_prior, few_shot_labelling

    out = Path(spec.output)
    data = out.parent / f"{out.name}-input"
    few_shot, shot_ids = few_shot_labelling(spec.input, data / "few_shot.parquet")
    import polars as pl

    same_rows = data / "rows.parquet"
    pl.read_parquet(spec.input).filter(~pl.col("id").is_in(shot_ids)).write_parquet(same_rows)
    labels = spec.choice or DEMO_JOBS["labelling"]["choice"]
    base_spec = spec.model_copy(update={"model": spec.model, "input": str(few_shot), "choice": None,
                                        "score_choices": [LABEL_SPACE + c for c in labels]})
    echo(f"tokenmill demo: labelling job on the base model {spec.model}: few-shot prompts ({len(shot_ids)} worked "
          f"examples, the first row of each label, left out), each label scored, {few_shot} -> {spec.output}")
    rc = run(base_spec)
    if rc != 0:
        return rc
    from engine import SamplingParams
    from pipeline.engines import get_llm

    cf = get_llm(base_spec).generate(content_free_prompts(spec.input),
                                     SamplingParams(score_choices=base_spec.score_choices), use_tqdm=False)
    prior = contextual_prior([o.outputs[0].label_logprobs for o in cf])
    ref_spec = spec.model_copy(update={"model": default_model, "input": str(same_rows),
                                       "output": str(out.parent / f"{out.name}-{default_model}"), "choice": labels})
    echo(f"\ntokenmill demo: the same rows on the default model {default_model} (chat template, zero-shot), "
          f"-> {ref_spec.output}")
    rc = run(ref_spec)
    if rc != 0:
        return rc
    _print_label_accuracy(spec.output, echo)
    rows = [(spec.model, "few-shot, scored", _label_accuracy(spec.output)),
            (spec.model, "few-shot, calibrated", _label_accuracy(spec.output, prior)),
            (default_model, "chat template, choice", _label_accuracy(ref_spec.output))]
    echo(f"\naccuracy against reference_label on the same {rows[0][2][1]} rows (calibrated: each label's probability "
          f"divided by its mean over {len(cf)} content-free items, Zhao et al. 2021):")
    for model, how, (right, n, valid) in rows:
        echo(f"  {model:24} ({how:21}) {right:4} of {n} ({right / max(n, 1):.1%}); valid labels {valid} of {n}")
    return 0


def _label_accuracy(output: str, prior: dict[str, float] | None = None) -> tuple[int, int, int]:
    """(rows whose label equals `reference_label`, rows, valid labels) of a labelling job's output
    (labels compared without surrounding spaces: a base model's labels carry a leading one). With
    `prior` (`pipeline.few_shot.contextual_prior`), a scored row's label is its calibrated one."""
    df = _label_rows(output)
    if df is None:
        return 0, 0, 0
    labels = df["generation"]
    if prior is not None and "label_logprobs" in df.columns:
        import polars as pl

        from pipeline.few_shot import calibrated_label

        labels = pl.Series([calibrated_label({d["choice"]: d["logprob"] for d in lp}, prior) if lp else g
                            for lp, g in zip(df["label_logprobs"].to_list(), df["generation"].to_list())],
                           dtype=pl.Utf8)
    right = int((labels.str.strip_chars() == df["reference_label"]).sum())
    return right, df.height, int(df["valid"].sum()) if "valid" in df.columns else 0


def _label_rows(output: str):
    import polars as pl

    parts = sorted(Path(output).glob("part-*.parquet"))
    if not parts:
        return None
    df = pl.concat([pl.read_parquet(p) for p in parts], how="diagonal_relaxed")
    return df if "reference_label" in df.columns else None


def _print_label_accuracy(output: str, echo: Callable[..., None]) -> None:
    """A few sample rows of the labelling demo and its accuracy against `reference_label`."""
    df = _label_rows(output)
    if df is None:
        return
    echo("\nsample rows (title, label, reference_label):")
    for row in df.head(5).iter_rows(named=True):
        echo(f"  {row.get('title')!s:40.40}  {str(row['generation']).strip():12}  {row['reference_label']}")
    right, n, valid = _label_accuracy(output)
    echo(f"\nvalid labels: {valid} of {n}; accuracy against reference_label: {right} of {n} ({right / n:.1%})")
