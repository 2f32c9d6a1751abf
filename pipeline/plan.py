"""Planning a job: check its inputs and output location, cut the dataset into shards (prefix groups in
depth-first order, or input order), and the shards into windows; `JobPlan` is a prepared run.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Optional

import polars as pl

from engine.config import EngineConfig
from pipeline import io, manifest
from pipeline.engines import job_tokenizer, loaded_llm, use_chat_template
from pipeline.cost import TokenCounts
from pipeline.lease import Lease
from pipeline.manifest import ShardResult
from pipeline.planner import PlanStats, Shard, TokenizedRows, plan_input_order, plan_prefix
from pipeline.schema import InputLayout, unify_input_columns
from pipeline.spec import JobSpec
from pipeline.storage import quick_options


@dataclass
class JobPlan:
    """A prepared run: the shard plan, which shards still need to run, and the run's lease on the output.

    Attributes:
        columns: the output type of each id / pass-through column (inputs of several files are
            unified to one type per column, `schema.unify_input_columns`); give it to `run_shards`.
        lease: this run's hold on the output (None only for plans built without one); `close()`
            gives it back.
        structured: the job constrains or scores outputs (a default constraint, `score_choices`, or
            a constraint column in any input file), so every part file has the `valid` and
            `parsed` columns; give it to `run_shards`.
        dtype: the weights dtype the job computes with ("float32", "bfloat16", ...): `spec.dtype`, or
            for "auto" the one the manifest recorded when the job was planned (a resume on another
            host keeps it); run the engine from `engine_spec(spec, plan.dtype)`.
        done_before: the counts of the shards earlier runs committed (their done markers).
    """

    spec: JobSpec
    job_id: str
    run_id: str
    shards: list[Shard]
    pending: list[Shard]
    started_at: datetime
    stats: PlanStats = field(default_factory=PlanStats)
    columns: dict[str, pl.DataType] = field(default_factory=dict)
    lease: Optional[Lease] = None
    structured: bool = False
    dtype: Optional[str] = None
    done_before: TokenCounts = field(default_factory=TokenCounts)
    rows_total: int = field(init=False)
    rows_skipped: int = field(init=False)

    def __post_init__(self) -> None:
        self.rows_total = sum(s.length for s in self.shards)
        pending = {s.index for s in self.pending}
        self.rows_skipped = sum(s.length for s in self.shards if s.index not in pending)

    def close(self, quick: bool = False) -> None:
        """Give the output's lease back (never raises a StorageError; a lease left behind expires).

        Args:
            quick: the storage endpoint just failed: try once, with short timeouts.
        """
        if self.lease is not None:
            so = self.spec.storage_options
            self.lease.release(quick_options(so) if quick else so)


def done_shards(spec: JobSpec) -> dict[int, ShardResult]:
    """The job's shards that have a done marker, by index."""
    return manifest.done_shards(spec.output, spec.storage_options)


def plan_job(spec: JobSpec, files: list[io.InputFile], tokenizer: Any = None,
             max_model_len: Optional[int] = None) -> tuple[list[Shard], PlanStats]:
    """The shard plan of a job: prefix groups in depth-first order (`spec.plan == "prefix"`) or input order.

    The plan is a deterministic function of the input files and the spec (and the
    tokenizer); it is stored in the manifest, and a resume reads it from there.

    Args:
        tokenizer: the model's tokenizer (default: `job_tokenizer(spec)`); only prefix plans tokenise.
        max_model_len: the engine's context length (default: the loaded engine's, else the one
            the spec's engine will have, from the model's metadata: `planned_context_length`);
            longer prompts will be error rows, so the plan's statistics leave them out like every
            other bad row.
    """
    if spec.plan == "input":
        shards = plan_input_order(files, spec.shard_size, spec.limit)
        return shards, PlanStats(order="input", rows=sum(s.length for s in shards))
    if tokenizer is None:
        tokenizer = job_tokenizer(spec)
    if max_model_len is None:
        loaded = loaded_llm(spec)
        max_model_len = getattr(loaded, "max_model_len", None) if loaded is not None else planned_context_length(spec)
    block_size = int(spec.engine_kwargs().get("block_size", EngineConfig.block_size))
    rows = TokenizedRows(files, tokenizer, spec.sampling_params(), id_column=spec.id_column,
                         system_prompt=spec.system_prompt, use_chat_template=use_chat_template(spec, tokenizer),
                         limit=spec.limit, storage_options=spec.storage_options, max_model_len=max_model_len,
                         truncate=spec.truncate)
    return plan_prefix(rows, files, spec.shard_size, spec.limit, block_size=block_size,
                       decode_heavy_first=spec.decode_heavy_first)


def planned_context_length(spec: JobSpec) -> Optional[int]:
    """The context length in tokens the spec's engine will have, before one is loaded: `engine.loader.
    context_length` over the model's metadata (no weights read): `max_model_len` if given, at most the
    model's own context, at most what an explicit `kv_cache_memory_bytes` holds. Not counted: a KV cache
    sized from free memory, which only the loaded engine knows (and a cluster's budget when its workers
    pick the device: their dtype decides a block's size). `spec.max_model_len` when the metadata cannot
    be read; the engine checks every prompt again either way.
    """
    from engine.loader import context_length
    from engine.weights import model_config, resolve_model

    kw = spec.engine_kwargs()
    if spec.cluster is not None and str(kw.get("device", "auto")) == "auto":
        kw["kv_cache_memory_bytes"] = None
    try:
        return context_length(EngineConfig(model=spec.model, **kw), model_config(resolve_model(spec.model)))
    except (ImportError, OSError, KeyError, ValueError, TypeError, RuntimeError):  # unreadable metadata
        return spec.max_model_len


def plan_windows(shards: list[Shard], shards_in_flight: int) -> list[list[Shard]]:
    """The windows of a run: consecutive runs of `shards_in_flight` shards, each one engine call (and one
    flow task); a window grows (up to twice that) while the next shard continues the last one's prefix
    group, so a group that fits stays within one engine call. `run_job` and the flow cut them alike.

    Raises:
        ValueError: `shards_in_flight` below 1.
    """
    if shards_in_flight < 1:
        raise ValueError(f"shards_in_flight must be at least 1, got {shards_in_flight!r}")
    k, out, i = shards_in_flight, [], 0
    while i < len(shards):
        j = min(i + k, len(shards))
        while j < len(shards) and j < i + 2 * k and shards[j].continues_group \
                and shards[j].index == shards[j - 1].index + 1:
            j += 1
        out.append(shards[i:j])
        i = j
    return out


def check_inputs(spec: JobSpec, files: list[io.InputFile]) -> dict[str, pl.DataType]:
    """Check the input files' columns before anything is written; warn about what is unified.

    Returns:
        The output type of each id / pass-through column (`schema.unify_input_columns`).

    Raises:
        ValueError: a file without a prompt column or with a column name twice, a named `id_column`
            (other than the default "id") that a file lacks, or files that disagree on an output column
            (the message names the file and the column).
    """
    for f in files:
        try:
            layout = InputLayout.from_schema(f.columns, spec.id_column)
        except ValueError as exc:
            raise ValueError(f"{f.path}: {exc}") from None
        if not layout.id_in_input:
            if spec.id_column != "id":  # a column the user named: a typo must not turn into row indexes
                raise ValueError(f"id_column: {f.path} has no {spec.id_column!r} column (columns: "
                                 f"{', '.join(f.columns)})")
            warnings.warn(f"{f.path} has no {spec.id_column!r} column; using the row index as the id",
                          stacklevel=3)
    unified = unify_input_columns(files, spec.id_column)
    for note in unified.notes:
        warnings.warn(f"{spec.input}: {note}", stacklevel=3)
    return unified.types


ID_EXAMPLES = 5  # offending rows a warning names


def check_ids(files: list[io.InputFile], id_column: str, limit: Optional[int] = None,
              storage_options: Optional[dict[str, Any]] = None) -> list[str]:
    """Problems with the dataset's ids, as warning texts (empty when there are none).

    Reads only the id column of the first `limit` rows. Rows are numbered across
    the input files in order, from 0 (the numbering ids take when there is no id
    column). A null id makes its row an error row (`schema.build_request`); a
    repeated id is only reported: those rows are processed, so the output holds
    the id more than once.
    """
    pieces, start = [], 0
    for f in files:
        n = f.num_rows if limit is None else max(0, min(f.num_rows, limit - start))
        if n and id_column in f.columns:
            col = pl.concat([b.get_column(id_column) for b in io.iter_batches(f.path, [id_column],
                                                                               storage_options=storage_options)])
            pieces.append(pl.DataFrame({"row": pl.int_range(start, start + n, eager=True),
                                        "id": col.head(n)}))
        start += n
    if not pieces:
        return []
    try:
        ids = pl.concat(pieces, how="vertical_relaxed")
    except (pl.exceptions.SchemaError, pl.exceptions.ComputeError):  # files with unlike id types
        ids = pl.concat([p.with_columns(pl.col("id").cast(pl.Utf8)) for p in pieces])
    problems = []
    missing = pl.col("id").is_null()
    if ids.schema["id"].is_float():  # NaN: how pandas writes a missing value of an int column
        missing = missing | pl.col("id").is_nan()
    null = ids.filter(missing)
    if null.height:
        rows = ", ".join(str(r) for r in null["row"].head(ID_EXAMPLES))
        problems.append(f"{null.height} row(s) with a null or NaN {id_column!r} (rows {rows}"
                        f"{', ...' if null.height > ID_EXAMPLES else ''}); each becomes an error row")
    valued = ids.filter(~missing)
    repeat = valued.filter(~pl.col("id").is_first_distinct())
    if repeat.height:
        shown = ", ".join(f"row {r} ({v!r})" for r, v in repeat.head(ID_EXAMPLES).iter_rows())
        more = ", ..." if repeat.height > ID_EXAMPLES else ""
        problems.append(f"{repeat.height} row(s) repeat an earlier row's {id_column!r} "
                        f"({repeat['id'].n_unique()} distinct ids; {shown}{more}); "
                        f"they are processed, so the output holds those ids more than once")
    return problems


def recorded_dtype(spec: JobSpec, manifest_doc: dict) -> str:
    """The dtype a resumed job computes with: `spec.dtype` when given; for "auto", the one its manifest
    recorded. A manifest written before the dtype was recorded was planned when "auto" meant fp32 on the
    CPU and bf16 on CUDA."""
    if spec.dtype != "auto":
        return spec.dtype
    if manifest_doc.get("dtype"):
        return str(manifest_doc["dtype"])
    from engine.loader import resolve_settings

    try:
        device, _, _ = resolve_settings(EngineConfig(model=spec.model, **spec.engine_kwargs()))
    except (ValueError, TypeError):
        return "auto"
    return "bfloat16" if device.type == "cuda" else "float32"


def refuse_output_overlapping_input(spec: JobSpec, out_fs, out_path: str) -> None:
    """Refuse, before anything is written, an output that cannot hold a job: a local path under a
    file, a folder that is (or lies inside, or contains) the input folder, or one whose part files an
    input glob pattern matches: the next run (a resume) would read its part files as input.

    Raises:
        ValueError: naming the output and the file or input in the way.
    """
    protocols = out_fs.protocol if isinstance(out_fs.protocol, tuple) else (out_fs.protocol,)
    if "file" in protocols or "local" in protocols:
        parent = out_path.rstrip("/")
        while True:
            up = parent.rsplit("/", 1)[0] if "/" in parent else ""
            if not up or up == parent:
                break
            parent = up
            if out_fs.isfile(parent):
                raise ValueError(f"output {spec.output} lies under {parent}, which is a file; give a folder URL")
    in_fs, in_path = io.filesystem(spec.input, spec.storage_options)
    if io.is_glob(in_path):  # a pattern: refuse an output whose part files it would match
        parts = [out_path.rstrip("/") + name for name in ("/part-00000.parquet", "/results-00000.jsonl",
                                                           "/errors-00000.jsonl")]
        if in_fs.protocol == out_fs.protocol and any(io.glob_matches(in_path.rstrip("/"), p) for p in parts):
            raise ValueError(f"output {spec.output} lies where the input pattern {spec.input} matches: the part files "
                             f"written there would be read as input by the next run (a resume); choose an output "
                             f"the pattern does not match")
        return
    if in_fs.protocol != out_fs.protocol or in_fs.isfile(in_path):
        return
    a, b = in_path.rstrip("/"), out_path.rstrip("/")
    if a == b or b.startswith(a + "/") or a.startswith(b + "/"):
        raise ValueError(f"output {spec.output} overlaps the input folder {spec.input}: the part files written "
                         f"there would be read as input by the next run (a resume); choose an output outside it")


def refuse_inputs_the_job_would_replace(spec: JobSpec, files: list[io.InputFile], out_fs, out_path: str) -> None:
    """Refuse, before anything is written, an input file that lies in the output folder under a name
    the job owns (`part-*.parquet` beside the manifest, or anything under `_job/`): the job would write
    its own part file there, and `--overwrite` deletes such files, the input with them. (A single
    input file with another name may sit in the output folder: `--input prompts.parquet --output .`.)

    Raises:
        ValueError: naming the input file and the output.
    """
    out = out_path.rstrip("/")
    for f in files:
        fs, path = io.filesystem(f.path, spec.storage_options)
        if fs.protocol != out_fs.protocol or not path.startswith(out + "/"):
            continue
        rel = path[len(out) + 1:]
        if rel.startswith("_job/") or ("/" not in rel and rel.startswith("part-") and rel.endswith(".parquet")):
            raise ValueError(f"input file {f.path} lies in the output folder {spec.output} under a name the job "
                             f"writes its own files by ({rel}): a run would take it for one of its part files, and "
                             f"--overwrite would delete it; move the input, or choose another output")
