"""A batch job: `JobSpec` and `run_job(spec)`.

A run goes: `prepare_job` (list inputs, plan shards, check or write the
manifest, find the shards already done) -> `run_shards` (read each shard,
validate rows, stream them through `LLM.iter_outputs`, commit each shard's
part file as soon as its last row finishes) -> `finish_job` (append the run's
cost report to `_job/metrics.parquet`). The Prefect flow calls the same three
steps with a task per shard.

Output layout:

    OUTPUT/part-00000.parquet ...     one per shard, written atomically
    OUTPUT/_job/manifest.json         fingerprint (inputs, spec, model) and shard plan
    OUTPUT/_job/done/part-00000.json  one marker per committed shard, with its counts
    OUTPUT/_job/metrics.parquet       one row per run (see pipeline.cost)

A shard is done when its marker exists; the marker is written after the part
file, so a run killed between the two recomputes that shard and replaces the
part with the same rows: every input row appears exactly once.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
import time
import uuid
import warnings
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable, Iterator, Literal, Optional

import polars as pl
from pydantic import BaseModel, ConfigDict, Field, field_validator

from engine.config import EngineConfig, SamplingParams
from pipeline import io, manifest
from pipeline.cost import CostReport, TokenCounts, cost_report
from pipeline.manifest import ShardResult
from pipeline.planner import PlanStats, Shard, TokenizedRows, plan_input_order, plan_prefix
from pipeline.schema import InputLayout, build_request, output_schema

# JobSpec fields that change what the outputs are; any change refuses a resume.
FINGERPRINT_FIELDS = (
    "model", "dtype", "quantization", "max_model_len", "seed", "engine_options",
    "max_tokens", "temperature", "top_p", "top_k", "stop", "sampling_options",
    "system_prompt", "chat_template", "n", "id_column", "shard_size", "limit", "plan", "decode_heavy_first",
)


class JobSpecChanged(RuntimeError):
    """The output folder holds a job with another spec or input; pass overwrite=True to replace it."""


class JobSpec(BaseModel):
    """Everything a job needs; shared by `run_job`, the CLI (`--kebab-case` flags) and the flow.

    Engine options (None means the engine's default): model, dtype, device,
    quantization, max_num_seqs, max_num_batched_tokens, max_model_len,
    kv_cache_memory_bytes, enable_prefix_caching, seed, num_threads, plus any
    other EngineConfig field in `engine_options`.

    Sampling defaults (a row's `max_tokens`, `temperature`, `top_p`, `seed`,
    `stop` columns override them): max_tokens, temperature, top_p, top_k,
    stop, n, plus any other SamplingParams field in `sampling_options`.
    """

    model_config = ConfigDict(extra="forbid")

    input: str = Field(description="Parquet file or folder/prefix: s3://, gs://, file:// or a local path")
    output: str = Field(description="output folder/prefix URL")

    model: str = Field("smollm2-135m-instruct", description="engine model name, .gguf path or HF folder")
    dtype: str = "auto"
    device: str = "auto"
    quantization: Optional[str] = None
    max_num_seqs: Optional[int] = None
    max_num_batched_tokens: Optional[int] = None
    max_model_len: Optional[int] = None
    kv_cache_memory_bytes: Optional[int] = None
    enable_prefix_caching: Optional[bool] = None
    seed: int = Field(0, description="engine seed: sampled runs are reproducible")
    num_threads: Optional[int] = None
    engine_options: dict[str, Any] = Field(default_factory=dict, description="other EngineConfig fields")

    max_tokens: int = Field(128, description="default new tokens per row")
    temperature: float = Field(0.0, description="default temperature (0 = greedy)")
    top_p: float = 1.0
    top_k: int = -1
    stop: list[str] = Field(default_factory=list, description="default stop strings")
    n: int = Field(1, description="completions per row; n > 1 adds a `generations` list column")
    sampling_options: dict[str, Any] = Field(default_factory=dict, description="other SamplingParams fields")
    system_prompt: Optional[str] = Field(None, description="system prompt for every row (a `system` column overrides)")
    chat_template: Optional[bool] = Field(None, description="apply the chat template (default: when the model has one)")

    id_column: str = "id"
    shard_size: int = Field(256, ge=1, description="rows per output part file")
    limit: Optional[int] = Field(None, ge=1, description="process only the first N rows")
    plan: Literal["prefix", "input"] = Field(
        "prefix", description="row order: 'prefix' groups rows sharing a prompt prefix (depth-first over the "
                              "dataset's prefix tree) so the engine computes each shared prefix once; 'input' keeps input order")
    decode_heavy_first: bool = Field(
        False, description="with plan='prefix': run groups with the most output per prompt token first")
    shards_in_flight: int = Field(2, ge=1, description="shards fed to the engine at once (memory vs. batch fill)")
    storage_options: dict[str, Any] = Field(
        default_factory=dict, repr=False,
        description="fsspec/s3fs options (endpoint_url, key, secret, ...); default: AWS environment variables")

    price_per_hour: float = Field(1.0, ge=0, description="USD per device-hour, for the cost report")
    device_name: Optional[str] = Field(None, description="device name in the report (default: the engine's)")
    device_count: int = Field(1, ge=1)
    output_token_weight: float = Field(4.0, gt=0, description="cost of one output token in uncached input tokens")
    overwrite: bool = Field(False, description="delete the job outputs already at the output and start over")
    progress: bool = Field(True, description="show a tqdm progress bar")

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else (v or [])

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `engine.LLM` (unset options are left to the engine)."""
        kw: dict[str, Any] = {}
        for name in ("dtype", "device", "quantization", "max_num_seqs", "max_num_batched_tokens",
                     "max_model_len", "kv_cache_memory_bytes", "enable_prefix_caching", "seed", "num_threads"):
            v = getattr(self, name)
            if v is not None:
                kw[name] = v
        kw.update(self.engine_options)
        return kw

    def sampling_params(self) -> SamplingParams:
        """The job's default SamplingParams."""
        return SamplingParams(n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              max_tokens=self.max_tokens, stop=list(self.stop), **self.sampling_options)

    @classmethod
    def from_file(cls, path: str, **overrides: Any) -> "JobSpec":
        """Load a spec from a YAML or JSON file (fields at the top level or under `spec:`).

        Other top-level keys (e.g. a `deployment:` section for `flows/deploy.py`) are ignored here.
        """
        return cls(**{**load_spec_file(path)[0], **overrides})

    def fingerprint_fields(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in FINGERPRINT_FIELDS}


def load_spec_file(path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(spec fields, the rest) from a YAML or JSON file.

    The file holds JobSpec fields, either at the top level or under a `spec`
    key; with `spec`, the other top-level keys (e.g. `deployment`) are returned
    as the rest.
    """
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if str(path).endswith(".json"):
        doc = json.loads(text)
    else:
        import yaml

        doc = yaml.safe_load(text)
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: expected a mapping of JobSpec fields, got {type(doc).__name__}")
    if "spec" in doc:
        rest = {k: v for k, v in doc.items() if k != "spec"}
        return dict(doc["spec"] or {}), rest
    rest = {k: doc.pop(k) for k in list(doc) if k == "deployment"}
    return doc, rest


# ---------------------------------------------------------------- the engine, once per process

_ENGINES: dict[str, Any] = {}
_ENGINE_LOCKS: dict[int, threading.Lock] = {}
_ENGINES_LOCK = threading.Lock()


def _engine_key(spec: JobSpec) -> str:
    return json.dumps([spec.model, spec.engine_kwargs()], sort_keys=True, default=str)


def get_llm(spec: JobSpec) -> Any:
    """The `engine.LLM` for this spec's model and engine options, loaded once per process and reused."""
    key = _engine_key(spec)
    with _ENGINES_LOCK:
        if key not in _ENGINES:
            from engine import LLM

            _ENGINES[key] = LLM(spec.model, **spec.engine_kwargs())
        return _ENGINES[key]


def cache_llm(spec: JobSpec, llm: Any) -> None:
    """Make `get_llm` return `llm` (an engine you already built) for this spec's model and engine options."""
    with _ENGINES_LOCK:
        _ENGINES[_engine_key(spec)] = llm


def _loaded_llm(spec: JobSpec) -> Any:
    """The engine `get_llm` already loaded (or `cache_llm` registered) for this spec, or None."""
    with _ENGINES_LOCK:
        return _ENGINES.get(_engine_key(spec))


def job_tokenizer(spec: JobSpec) -> Any:
    """The tokenizer of the spec's model: the loaded engine's when there is one, else the tokenizer alone
    (no model weights), for planning in a process that does not run the engine (the flow)."""
    llm = _loaded_llm(spec)
    if llm is not None:
        return llm.tokenizer
    from engine.tokenizer import Tokenizer

    return Tokenizer.from_model(spec.model)


def use_chat_template(spec: JobSpec, tokenizer: Any) -> bool:
    """Whether prompts go through the chat template: the spec's choice, else when the model has one."""
    if spec.chat_template is not None:
        return spec.chat_template
    return bool(getattr(tokenizer, "has_chat_template", False))


def engine_lock(llm: Any) -> threading.Lock:
    """A lock per engine object: one engine runs one batch at a time, so threads (e.g. Prefect's
    thread-pool task runner) take turns; separate worker processes each have their own engine."""
    with _ENGINES_LOCK:
        return _ENGINE_LOCKS.setdefault(id(llm), threading.Lock())


# ---------------------------------------------------------------- plan and manifest

@dataclass
class JobPlan:
    """A prepared run: the shard plan and which shards still need to run."""

    spec: JobSpec
    job_id: str
    run_id: str
    shards: list[Shard]
    pending: list[Shard]
    started_at: datetime
    stats: PlanStats = field(default_factory=PlanStats)
    rows_total: int = field(init=False)
    rows_skipped: int = field(init=False)

    def __post_init__(self) -> None:
        self.rows_total = sum(s.length for s in self.shards)
        pending = {s.index for s in self.pending}
        self.rows_skipped = sum(s.length for s in self.shards if s.index not in pending)


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
        max_model_len: the engine's context length (default: the loaded engine's, else
            `spec.max_model_len`); longer prompts will be error rows, so the plan's
            statistics leave them out like every other bad row.
    """
    if spec.plan == "input":
        shards = plan_input_order(files, spec.shard_size, spec.limit)
        return shards, PlanStats(order="input", rows=sum(s.length for s in shards))
    if tokenizer is None:
        tokenizer = job_tokenizer(spec)
    if max_model_len is None:
        loaded = _loaded_llm(spec)
        max_model_len = getattr(loaded, "max_model_len", None) if loaded is not None else spec.max_model_len
    block_size = int(spec.engine_kwargs().get("block_size", EngineConfig.block_size))
    rows = TokenizedRows(files, tokenizer, spec.sampling_params(), id_column=spec.id_column,
                         system_prompt=spec.system_prompt, use_chat_template=use_chat_template(spec, tokenizer),
                         limit=spec.limit, storage_options=spec.storage_options, max_model_len=max_model_len)
    return plan_prefix(rows, files, spec.shard_size, spec.limit, block_size=block_size,
                       decode_heavy_first=spec.decode_heavy_first)


def _refuse_output_overlapping_input(spec: JobSpec, out_fs, out_path: str) -> None:
    """Refuse, before anything is written, an output that cannot hold a job: a local path under a
    file, or a folder that is (or lies inside, or contains) the input folder, whose part files the
    next run (a resume) would read as input.

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
    if any(ch in str(spec.input) for ch in "*?["):
        return
    in_fs, in_path = io.filesystem(spec.input, spec.storage_options)
    if in_fs.protocol != out_fs.protocol or in_fs.isfile(in_path):
        return
    a, b = in_path.rstrip("/"), out_path.rstrip("/")
    if a == b or b.startswith(a + "/") or a.startswith(b + "/"):
        raise ValueError(f"output {spec.output} overlaps the input folder {spec.input}: the part files written "
                         f"there would be read as input by the next run (a resume); choose an output outside it")


def prepare_job(spec: JobSpec, tokenizer: Any = None, max_model_len: Optional[int] = None) -> JobPlan:
    """List inputs, check the manifest (refuse a changed job unless `overwrite`), plan shards.

    A new job (or `overwrite`) is planned (`plan_job`) and its plan written to the
    manifest; a resumed job reads its plan from the manifest, so the shards are
    exactly those of the first run. Planning also warns about null and repeated
    ids (`check_ids`).

    Args:
        tokenizer: for planning (default: `job_tokenizer(spec)`, loaded only when planning).
        max_model_len: the engine's context length, for planning (see `plan_job`).

    Raises:
        FileNotFoundError: no input files.
        JobSpecChanged: the output holds another job (other spec, input or model).
    """
    started_at = datetime.now(timezone.utc)
    so = spec.storage_options
    # job-level mistakes are refused before anything is written or loaded
    problem = spec.sampling_params().validate()
    if problem is not None:
        raise ValueError(f"invalid default sampling parameters: {problem}")
    out_fs, out_path = io.filesystem(spec.output, so)
    if out_fs.isfile(out_path):
        raise ValueError(f"output {spec.output} is a file; give a folder (or prefix) URL")
    _refuse_output_overlapping_input(spec, out_fs, out_path)
    files = io.list_input_files(spec.input, so)
    for f in files:
        try:
            layout = InputLayout.from_schema(f.columns, spec.id_column)
        except ValueError as exc:
            raise ValueError(f"{f.path}: {exc}") from None
        if not layout.id_in_input:
            warnings.warn(f"{f.path} has no {spec.id_column!r} column; using the row index as the id",
                          stacklevel=2)
    digest, doc = manifest.fingerprint(files, spec.fingerprint_fields())
    previous = manifest.read_manifest(spec.output, so)
    if spec.overwrite:
        manifest.clear_output(spec.output, so)
    elif previous is not None and previous.get("fingerprint") != digest:
        raise JobSpecChanged(
            f"{spec.output} already holds a job with a different spec or input "
            f"({manifest.describe_change(previous, doc)}). Re-run with --overwrite (overwrite=True) to "
            f"discard its outputs and start over, or choose another output."
        )
    elif previous is None and manifest.part_files(spec.output, so):
        raise JobSpecChanged(
            f"{spec.output} has part files but no job manifest; re-run with --overwrite to replace them, "
            f"or choose another output."
        )
    if spec.overwrite or previous is None:
        for message in check_ids(files, spec.id_column, spec.limit, so):
            warnings.warn(f"{spec.input}: {message}", stacklevel=2)
        shards, stats = plan_job(spec, files, tokenizer, max_model_len)
        manifest.write_manifest(spec.output, {"fingerprint": digest, **doc, "plan": stats.to_json(),
                                              "shards": [s.to_json() for s in shards],
                                              "created_at": started_at.isoformat()}, so)
    else:
        shards = [Shard.from_json(d) for d in previous["shards"]]
        stats = PlanStats(**previous.get("plan", {}))

    done = done_shards(spec)
    pending = [s for s in shards if s.index not in done]
    return JobPlan(spec=spec, job_id=digest[:16], run_id=uuid.uuid4().hex[:12], shards=shards,
                   pending=pending, started_at=started_at, stats=stats)


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
    null = ids.filter(pl.col("id").is_null())
    if null.height:
        rows = ", ".join(str(r) for r in null["row"].head(ID_EXAMPLES))
        problems.append(f"{null.height} row(s) with a null {id_column!r} (rows {rows}"
                        f"{', ...' if null.height > ID_EXAMPLES else ''}); each becomes an error row")
    valued = ids.filter(pl.col("id").is_not_null())
    repeat = valued.filter(~pl.col("id").is_first_distinct())
    if repeat.height:
        shown = ", ".join(f"row {r} ({v!r})" for r, v in repeat.head(ID_EXAMPLES).iter_rows())
        more = ", ..." if repeat.height > ID_EXAMPLES else ""
        problems.append(f"{repeat.height} row(s) repeat an earlier row's {id_column!r} "
                        f"({repeat['id'].n_unique()} distinct ids; {shown}{more}); "
                        f"they are processed, so the output holds those ids more than once")
    return problems


# ---------------------------------------------------------------- running shards

@dataclass
class _ShardState:
    shard: Shard
    frame: pl.DataFrame
    layout: InputLayout
    results: list[Optional[dict]]
    remaining: int
    started: float


_EMPTY = {"generation": None, "finish_reason": "error", "prompt_tokens": 0, "completion_tokens": 0,
          "cached_tokens": 0, "ttft_s": None, "latency_s": None}


def row_seed(job_seed: int, row_index: int) -> int:
    """A row's sampling seed when it has none: a hash of the job seed and the row's index in the dataset."""
    digest = hashlib.blake2b(f"{job_seed}:{row_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _error_row(message: str) -> dict:
    return {**_EMPTY, "error": message}


def _output_row(out: Any, n: int) -> dict:
    """Turn one engine RequestOutput into the generation columns of its row."""
    comps = list(out.outputs or [])
    err = out.error or next((c.error or "engine error" for c in comps if c.finish_reason == "error"), None)
    if err is not None or not comps:
        return _error_row(err or "engine returned no completion")
    m = out.metrics
    row = {
        "generation": comps[0].text,
        "finish_reason": comps[0].finish_reason,
        "prompt_tokens": len(out.prompt_token_ids) if out.prompt_token_ids is not None else (m.prompt_tokens if m else 0),
        "completion_tokens": sum(len(c.token_ids) for c in comps),
        "cached_tokens": int(out.num_cached_tokens or 0),
        "ttft_s": m.ttft if m else None,
        "latency_s": m.latency if m else None,
        "error": None,
    }
    if n > 1:
        row["generations"] = [c.text for c in comps]
    return row


def _commit(spec: JobSpec, state: _ShardState, device: str, run_id: str) -> ShardResult:
    """Write the shard's part file atomically, then its done marker."""
    shard, df, layout = state.shard, state.frame, state.layout
    so = spec.storage_options
    if layout.id_in_input:
        ids = df.get_column(layout.id_column)
    else:
        ids = pl.Series(layout.id_column, shard.dataset_rows(), pl.Int64)
    passthrough = {c: df.schema[c] for c in layout.passthrough}
    schema = output_schema(layout.id_column, ids.dtype, passthrough, spec.n)
    gen_cols = [c for c in schema if c != layout.id_column and c not in passthrough]
    gen = pl.DataFrame({c: [r.get(c) for r in state.results] for c in gen_cols},
                       schema={c: schema[c] for c in gen_cols})
    out = pl.concat([pl.DataFrame([ids.alias(layout.id_column)]), df.select(layout.passthrough), gen],
                    how="horizontal")
    io.write_parquet_atomic(out, io.join(spec.output, shard.name), so)

    err = gen.get_column("error").is_not_null()
    counts = TokenCounts(
        rows_ok=int((~err).sum()),
        rows_error=int(err.sum()),
        prompt_tokens=int(gen.get_column("prompt_tokens").sum()),
        cached_tokens=int(gen.get_column("cached_tokens").sum()),
        completion_tokens=int(gen.get_column("completion_tokens").sum()),
    )
    result = ShardResult(index=shard.index, rows=shard.length, counts=counts, device=device,
                         seconds=time.perf_counter() - state.started)
    manifest.mark_done(spec.output, shard.name, result,
                       {"run_id": run_id, "finished_at": datetime.now(timezone.utc).isoformat()}, so)
    return result


def read_shard(shard: Shard, storage_options: Optional[dict[str, Any]] = None) -> pl.DataFrame:
    """The shard's input rows, in shard order (one range read when the rows are consecutive)."""
    runs = shard.runs()
    if len(runs) == 1:
        return io.read_rows(shard.file, runs[0][0], runs[0][1], storage_options)
    return io.read_rows_at(shard.file, shard.rows, storage_options)


def run_shards(
    spec: JobSpec,
    shards: list[Shard],
    llm: Any,
    *,
    run_id: str = "",
    on_rows: Optional[Callable[[int, int], None]] = None,
) -> Iterator[ShardResult]:
    """Run `shards` through the engine together; yield each ShardResult as soon as it is committed.

    All rows of the given shards go to one `llm.iter_outputs` call, in shard
    order and each shard's planned row order (the engine admits requests first
    come, first served, so rows sharing a prefix run together while it is
    cached), so the engine's batch stays full across shard boundaries; a
    shard's part file is written as soon as its last row finishes. Memory
    holds these shards only.

    Args:
        on_rows: called with (rows finished, output tokens) as rows finish (progress bars).
    """
    tokenizer = llm.tokenizer
    use_chat = use_chat_template(spec, tokenizer)
    defaults = spec.sampling_params()
    problem = defaults.validate()
    if problem is not None:
        raise ValueError(f"invalid default sampling parameters: {problem}")
    device = spec.device_name or str(getattr(llm, "device_name", "unknown"))
    vocab_size = getattr(tokenizer, "vocab_size", None)
    max_model_len = getattr(llm, "max_model_len", None)

    states: list[_ShardState] = []
    prompts: list[list[int]] = []
    params: list[SamplingParams] = []
    owners: list[tuple[int, int]] = []  # request index -> (state index, row index)
    for shard in shards:
        t0 = time.perf_counter()
        df = read_shard(shard, spec.storage_options)
        seeds = shard.dataset_rows()
        layout = InputLayout.from_schema(df.columns, spec.id_column)
        state = _ShardState(shard, df, layout, [None] * df.height, 0, t0)
        row_cols = [c for c in (spec.id_column, "prompt", "messages", *layout.overrides) if c in df.columns]
        for i, row in enumerate(df.select(row_cols).iter_rows(named=True)):
            req = build_request(row, layout, tokenizer, defaults, system_prompt=spec.system_prompt,
                                use_chat_template=use_chat, max_model_len=max_model_len, vocab_size=vocab_size)
            if req.error is not None:
                state.results[i] = _error_row(req.error)
            else:
                p = req.params
                if p.seed is None:  # same samples for a row whatever the sharding, batch or resume
                    p = dataclasses.replace(p, seed=row_seed(spec.seed, seeds[i]))
                owners.append((len(states), i))
                prompts.append(req.prompt_token_ids)
                params.append(p)
                state.remaining += 1
        states.append(state)

    for state in states:
        errors = state.shard.length - state.remaining
        if errors and on_rows:
            on_rows(errors, 0)
        if state.remaining == 0:
            yield _commit(spec, state, device, run_id)
    if not prompts:
        return
    for out in llm.iter_outputs(prompts, params, use_tqdm=False):
        si, ri = owners[int(out.request_id)]
        state = states[si]
        row = _output_row(out, spec.n)
        state.results[ri] = row
        state.remaining -= 1
        if on_rows:
            on_rows(1, row["completion_tokens"])
        if state.remaining == 0:
            yield _commit(spec, state, device, run_id)
            states[si] = None  # type: ignore[call-overload]  # free the shard's rows


# ---------------------------------------------------------------- finishing

def finish_job(plan: JobPlan, results: list[ShardResult], *, model: str, quantization: Optional[str],
               device: str) -> CostReport:
    """Build this run's cost report and append it to `_job/metrics.parquet`."""
    spec = plan.spec
    counts = TokenCounts()
    for r in results:
        counts = counts + r.counts
    report = cost_report(
        job_id=plan.job_id, run_id=plan.run_id, model=model, quantization=quantization, device=device,
        device_count=spec.device_count, started_at=plan.started_at, finished_at=datetime.now(timezone.utc),
        price_per_device_hour=spec.price_per_hour, counts=counts, rows_total=plan.rows_total,
        rows_skipped=plan.rows_skipped, output_token_weight=spec.output_token_weight,
        ideal_prefix_hit_rate=plan.stats.ideal_hit_rate, plan=plan.stats.order,
    )
    url = manifest.job_url(spec.output, "metrics.parquet")
    row = pl.DataFrame([report.as_row()])
    if io.exists(url, spec.storage_options):
        row = pl.concat([io.read_parquet(url, spec.storage_options), row], how="diagonal_relaxed")
    io.write_parquet_atomic(row, url, spec.storage_options)
    return report


def read_metrics(output: str, storage_options: Optional[dict[str, Any]] = None) -> pl.DataFrame:
    """All runs' cost reports of the job at `output` (one row per run).

    Raises:
        FileNotFoundError: when the job has no metrics yet.
    """
    url = io.join(output, "_job", "metrics.parquet")
    if not io.exists(url, storage_options):
        raise FileNotFoundError(f"no job metrics at {url}")
    return io.read_parquet(url, storage_options)


def _windows(shards: list[Shard], k: int) -> Iterator[list[Shard]]:
    """Consecutive runs of `k` shards for one engine call each; a window grows (up to 2k shards) while
    the next shard continues the last one's prefix group, so a group stays within one engine call."""
    i = 0
    while i < len(shards):
        j = min(i + k, len(shards))
        while j < len(shards) and j < i + 2 * k and shards[j].continues_group \
                and shards[j].index == shards[j - 1].index + 1:
            j += 1
        yield shards[i:j]
        i = j


def run_job(
    spec: JobSpec,
    llm: Any = None,
    *,
    on_shard_done: Optional[Callable[[ShardResult], None]] = None,
) -> CostReport:
    """Run a whole job in this process: resume done shards, write outputs and the cost report.

    Args:
        spec: the job.
        llm: an `engine.LLM` to use (default: `get_llm(spec)`, loaded once per process).
        on_shard_done: called after each shard commits (progress, tests).

    Returns:
        This run's CostReport (also appended to `OUTPUT/_job/metrics.parquet`).
    """
    plan = prepare_job(spec, tokenizer=llm.tokenizer if llm is not None else None,
                       max_model_len=getattr(llm, "max_model_len", None) if llm is not None else None)
    if llm is None and plan.pending:
        llm = get_llm(spec)
    results: list[ShardResult] = []
    bar = None
    if spec.progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=plan.rows_total - plan.rows_skipped, unit="row", desc="tokenmill", dynamic_ncols=True)
    out_tokens = 0
    t0 = time.perf_counter()

    def on_rows(rows: int, tokens: int) -> None:
        nonlocal out_tokens
        out_tokens += tokens
        if bar is not None:
            bar.update(rows)
            bar.set_postfix_str(f"{out_tokens / max(time.perf_counter() - t0, 1e-9):.1f} out tok/s", refresh=False)

    try:
        for window in _windows(plan.pending, spec.shards_in_flight):
            for result in run_shards(spec, window, llm, run_id=plan.run_id, on_rows=on_rows):
                results.append(result)
                if on_shard_done is not None:
                    on_shard_done(result)
    finally:
        if bar is not None:
            bar.close()
    return finish_job(plan, results, model=spec.model,
                      quantization=spec.quantization or getattr(getattr(llm, "config", None), "quantization", None),
                      device=job_device(plan, results, llm))


def job_device(plan: JobPlan, results: list[ShardResult], llm: Any = None) -> str:
    """The device name for the report: the spec's, else the engine's, else the one done shards recorded."""
    if plan.spec.device_name:
        return plan.spec.device_name
    for r in results:
        if r.device:
            return r.device
    if llm is not None and getattr(llm, "device_name", None):
        return str(llm.device_name)
    for r in done_shards(plan.spec).values():
        if r.device:
            return r.device
    return "unknown"
