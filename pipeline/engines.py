"""The job's engine, loaded once per process, and running a window of shards through it.

`get_llm` builds (once per model and engine options) the `engine.LLM` a process's shards share;
`run_shards` streams every row of a window's shards through one `LLM.iter_outputs` call and commits
each shard as soon as its last row finishes (`pipeline.commit`); `run_window` is the run loop of
`run_job` and of the flow's tasks.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Union

import polars as pl

from engine.config import EngineConfig, SamplingParams
from pipeline import io
from pipeline.commit import ShardState, commit_shard, default_worker
from pipeline.lease import Lease, LeaseToken
from pipeline.manifest import ShardResult
from pipeline.planner import Shard
from pipeline.openai_batch import choices_cell
from pipeline.schema import CONSTRAINT_COLUMNS, InputLayout, build_request
from pipeline.spec import JobSpec


_ENGINES: dict[str, Any] = {}


_ENGINE_LOCKS: dict[int, threading.Lock] = {}


_ENGINES_LOCK = threading.Lock()


_ENGINE_LOADS = 0  # engines get_llm built in this process


def _engine_key(spec: JobSpec) -> str:
    kw = spec.engine_kwargs()
    if kw.get("dtype") == "auto":  # the engine "auto" builds here is the one its resolved dtype names
        kw["dtype"] = host_dtype(spec)
    return json.dumps([spec.model, kw], sort_keys=True, default=str)


def host_dtype(spec: JobSpec) -> str:
    """The weights dtype the spec's engine runs with on this machine: `spec.dtype`, or for "auto" what
    the engine resolves it to here (`engine.loader.resolve_settings`: bf16 on CUDA and on CPUs with a bf16
    matrix unit, else float32). "auto" when the engine options are invalid (validation names them)."""
    if spec.dtype != "auto":
        return spec.dtype
    from engine.loader import resolve_settings

    try:
        _, dtype, _ = resolve_settings(EngineConfig(model=spec.model, **spec.engine_kwargs()))
    except (ValueError, TypeError):
        return "auto"
    return str(dtype).removeprefix("torch.")


def engine_spec(spec: JobSpec, dtype: Optional[str]) -> JobSpec:
    """The spec a run's engine is built from: `spec` with dtype "auto" replaced by the job's dtype
    (`JobPlan.dtype`: what the manifest recorded when the job was planned), so that a job resumed on
    another host computes with the dtype its first rows were computed with."""
    if spec.dtype != "auto" or dtype in (None, "auto"):
        return spec
    return spec.model_copy(update={"dtype": dtype})


def get_llm(spec: JobSpec) -> Any:
    """The `engine.LLM` for this spec's model and engine options, loaded once per process and reused."""
    global _ENGINE_LOADS
    key = _engine_key(spec)
    with _ENGINES_LOCK:
        if key not in _ENGINES:
            from engine import LLM

            _ENGINES[key] = LLM(spec.model, **spec.engine_kwargs())
            _ENGINE_LOADS += 1
        return _ENGINES[key]


def preload_engine(spec: JobSpec) -> str:
    """Load the spec's engine into this process now (`get_llm`); returns its device name. Small enough to
    come back from Dask's `client.run(preload_engine, spec)`, which loads every worker's engine before the
    first window."""
    return str(getattr(get_llm(spec), "device_name", "unknown"))


def engine_loads() -> int:
    """How many engines `get_llm` has loaded in this process (a Dask worker loads one per engine spec)."""
    return _ENGINE_LOADS


def cache_llm(spec: JobSpec, llm: Any) -> None:
    """Make `get_llm` return `llm` (an engine you already built) for this spec's model and engine options."""
    with _ENGINES_LOCK:
        _ENGINES[_engine_key(spec)] = llm


def loaded_llm(spec: JobSpec) -> Any:
    """The engine `get_llm` already loaded (or `cache_llm` registered) for this spec, or None."""
    with _ENGINES_LOCK:
        return _ENGINES.get(_engine_key(spec))


def job_tokenizer(spec: JobSpec) -> Any:
    """The tokenizer of the spec's model: the loaded engine's when there is one, else the tokenizer alone
    (no model weights), for planning in a process that does not run the engine (the flow)."""
    llm = loaded_llm(spec)
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


def engine_quantization(spec: JobSpec, llm: Any) -> Optional[str]:
    """The quantization a report names: the spec's, else the engine's own (e.g. a GGUF's default)."""
    return spec.quantization or getattr(getattr(llm, "config", None), "quantization", None)


def sampled_tokens(llm: Any) -> Optional[int]:
    """Output tokens the engine has sampled so far (`EngineStats.num_output_tokens`, cumulative over the
    engine's life, rows not yet finished included); None for an engine without the counter."""
    n = getattr(getattr(llm, "stats", None), "num_output_tokens", None) if llm is not None else None
    return int(n) if isinstance(n, int) else None


def step_counters(llm: Any, since: Optional[dict] = None) -> Optional[dict]:
    """The engine's step counters (steps, speculative steps, verifies, accepted draft tokens), minus
    `since` when given; None without an engine that keeps them."""
    st = getattr(llm, "stats", None)
    if st is None or not hasattr(st, "num_spec_steps"):
        return None
    now = {"steps": st.num_steps, "spec_steps": st.num_spec_steps, "spec_verifies": st.spec_verifies,
           "spec_accepted_tokens": st.spec_accepted_tokens}
    if since is None:
        return now
    return {k: v - since.get(k, 0) for k, v in now.items()}


def add_steps(a: Optional[dict], b: Optional[dict]) -> Optional[dict]:
    """Two windows' engine step counters added (None when neither has any)."""
    if a is None or b is None:
        return a if b is None else b
    return {k: a.get(k, 0) + b.get(k, 0) for k in {**a, **b}}


_EMPTY = {"generation": None, "finish_reason": "error", "prompt_tokens": 0, "completion_tokens": 0,
          "cached_tokens": 0, "spec_draft_tokens": 0, "spec_accepted_tokens": 0, "ttft_s": None, "latency_s": None}


def row_seed(job_seed: int, row_index: int) -> int:
    """A row's sampling seed when it has none: a hash of the job seed and the row's index in the dataset."""
    digest = hashlib.blake2b(f"{job_seed}:{row_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _error_row(message: str) -> dict:
    return {**_EMPTY, "error": message}


def _output_row(out: Any, n: int, params: Optional[SamplingParams] = None) -> dict:
    """Turn one engine RequestOutput into the generation columns of its row.

    With a constraint (`params.structured_outputs`): `valid` is the engine's verdict, `parsed`
    the output as compact JSON text for JSON constraints (null when it does not parse), and a
    valid choice row's text is its label. With `params.score_choices`: `label`, and
    `label_logprobs` as a list of {choice, logprob} in the choices' order.
    """
    comps = list(out.outputs or [])
    err = out.error or next((c.error or "engine error" for c in comps if c.finish_reason == "error"), None)
    if err is not None or not comps:
        return _error_row(err or "engine returned no completion")
    extra: dict[str, Any] = {}
    so = params.structured_outputs if params is not None else None
    c0 = comps[0]
    if params is not None and params.score_choices is not None and c0.label_logprobs is not None:
        extra = {"valid": True, "label": c0.text, "_label": c0.text,
                 "label_logprobs": [{"choice": k, "logprob": float(v)} for k, v in c0.label_logprobs.items()]}
    elif so is not None:
        extra["valid"] = bool(c0.valid)
        if so.is_json:
            try:
                extra["parsed"] = json.dumps(json.loads(c0.text), separators=(",", ":"), ensure_ascii=False)
            except (json.JSONDecodeError, ValueError):
                extra["parsed"] = None
        if so.kind == "choice" and c0.valid:
            extra["_label"] = c0.text
    m = out.metrics
    row = {
        "generation": comps[0].text,
        "finish_reason": comps[0].finish_reason,
        "prompt_tokens": len(out.prompt_token_ids) if out.prompt_token_ids is not None else (m.prompt_tokens if m else 0),
        "completion_tokens": sum(len(c.token_ids) for c in comps),
        "cached_tokens": int(out.num_cached_tokens or 0),
        "spec_draft_tokens": int(getattr(m, "spec_draft_tokens", 0) or 0),
        "spec_accepted_tokens": int(getattr(m, "spec_accepted_tokens", 0) or 0),
        "ttft_s": m.ttft if m else None,
        "latency_s": m.latency if m else None,
        "error": None,
    }
    if n > 1:
        row["generations"] = [c.text for c in comps]
    row.update(extra)
    return row


def read_shard(shard: Shard, storage_options: Optional[dict[str, Any]] = None,
               columns: Optional[dict[str, pl.DataType]] = None) -> pl.DataFrame:
    """The shard's input rows, in shard order (one range read when the rows are consecutive).

    Args:
        columns: output types of the id / pass-through columns (`JobPlan.columns`); those
            columns are cast to them, so every part file has one schema.
    """
    runs = shard.runs()
    if len(runs) == 1:
        df = io.read_rows(shard.file, runs[0][0], runs[0][1], storage_options)
    else:
        df = io.read_rows_at(shard.file, shard.rows, storage_options)
    casts = {c: t for c, t in (columns or {}).items() if c in df.columns and df.schema[c] != t}
    return df.cast(casts) if casts else df


def run_shards(
    spec: JobSpec,
    shards: list[Shard],
    llm: Any,
    *,
    run_id: str = "",
    on_rows: Optional[Callable[[int, int], None]] = None,
    columns: Optional[dict[str, pl.DataType]] = None,
    lease: Optional[Union[Lease, LeaseToken]] = None,
    structured: Optional[bool] = None,
    worker: str = "",
) -> Iterator[ShardResult]:
    """Run `shards` through the engine together; yield each ShardResult as soon as it is committed.

    All rows of the given shards go to one `llm.iter_outputs` call, in shard
    order and each shard's planned row order (the engine admits requests first
    come, first served, so rows sharing a prefix run together while it is
    cached), so the engine's batch stays full across shard boundaries; a
    shard's part file is written as soon as its last row finishes. Memory
    holds these shards only.

    Stopping early (an exception, an interrupt, closing the iterator) abandons the shards
    in flight: the engine's iteration is closed, which aborts their requests, and nothing
    partial is committed.

    Args:
        on_rows: called with (rows finished, output tokens) as rows finish (progress bars).
        columns: output types of the id / pass-through columns (`JobPlan.columns`).
        lease: the run's lease (or a worker's `LeaseToken` of it), checked before each commit.
        structured: write the `valid` / `parsed` columns (`JobPlan.structured`; None: when the
            spec constrains outputs or these shards' files have a constraint column).
        worker: the name recorded in each done marker (default `default_worker()`, HOST:PID).

    Raises:
        LeaseLost: another run took the output over.
        StorageError: reading a shard or committing one failed.
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

    states: list[ShardState] = []
    prompts: list[list[int]] = []
    params: list[SamplingParams] = []
    owners: list[tuple[int, int]] = []  # request index -> (state index, row index)
    frames = [(shard, read_shard(shard, spec.storage_options, columns), time.perf_counter()) for shard in shards]
    if structured is None:
        structured = spec.constrained or any(c in df.columns for _, df, _ in frames for c in CONSTRAINT_COLUMNS)
    scored = spec.score_choices is not None
    choices = "jsonl" in spec.output_formats()  # OpenAI Batch result lines: every completion, with logprobs
    for shard, df, t0 in frames:
        seeds = shard.dataset_rows()
        bad_text = df.get_column(io.INVALID_UTF8_COLUMN) if io.INVALID_UTF8_COLUMN in df.columns else None
        df = df.drop(io.INVALID_UTF8_COLUMN, strict=False)  # it names a row's bad text; never an output column
        layout = InputLayout.from_schema(df.columns, spec.id_column)
        state = ShardState(shard, df, layout, [None] * df.height, 0, t0, structured, scored, choices)
        row_cols = [c for c in (spec.id_column, "prompt", "messages", *layout.overrides) if c in df.columns]
        rows = df.select(row_cols) if bad_text is None else df.select(row_cols).with_columns(bad_text)
        for i, row in enumerate(rows.iter_rows(named=True)):
            req = build_request(row, layout, tokenizer, defaults, system_prompt=spec.system_prompt,
                                use_chat_template=use_chat, max_model_len=max_model_len, vocab_size=vocab_size,
                                truncate=spec.truncate, context_bound=getattr(llm, "context_bound", None))
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
            yield commit_shard(spec, state, device, run_id, lease, worker)
    if not prompts:
        return
    outputs = llm.iter_outputs(prompts, params, use_tqdm=False)
    try:
        for out in outputs:
            si, ri = owners[int(out.request_id)]
            state = states[si]
            row = _output_row(out, spec.n, params[int(out.request_id)])
            if choices and row["error"] is None:
                row["choices"] = choices_cell(out, tokenizer, params[int(out.request_id)].logprobs or 0)
            state.results[ri] = row
            state.remaining -= 1
            if on_rows:
                on_rows(1, row["completion_tokens"])
            if state.remaining == 0:
                yield commit_shard(spec, state, device, run_id, lease, worker)
                states[si] = None  # type: ignore[call-overload]  # free the shard's rows
    finally:
        close = getattr(outputs, "close", None)
        if close is not None:  # abort the engine's requests now, not when the generator is collected
            close()


@dataclass
class WindowRun:
    """What running one window produced (`run_window`): a flow task's return value, as JSON.

    Attributes:
        results: the shards committed, in commit order.
        worker: who ran the window (see `ShardResult.worker`).
        quantization: the engine's weight quantization (None: full precision).
        engine_steps: the engine's step counters over this window (see `cost.cost_report`), or None.
        seconds: wall seconds of the window, reading to last commit.
    """

    results: list[ShardResult]
    worker: str
    quantization: Optional[str] = None
    engine_steps: Optional[dict] = None
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"results": [r.to_json() for r in self.results], "worker": self.worker,
                "quantization": self.quantization, "engine_steps": self.engine_steps, "seconds": self.seconds}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "WindowRun":
        return cls(results=[ShardResult.from_json(r) for r in d["results"]], worker=d.get("worker", ""),
                   quantization=d.get("quantization"), engine_steps=d.get("engine_steps"),
                   seconds=d.get("seconds", 0.0))


def run_window(
    spec: JobSpec,
    window: list[Shard],
    llm: Any,
    *,
    run_id: str,
    columns: Optional[dict[str, pl.DataType]] = None,
    structured: Optional[bool] = None,
    lease: Optional[Union[Lease, LeaseToken]] = None,
    worker: str = "",
    on_rows: Optional[Callable[[int, int], None]] = None,
    on_shard_done: Optional[Callable[[ShardResult], None]] = None,
) -> WindowRun:
    """Run one window (`plan_windows`) through `llm`, all its shards in flight at once (`run_shards`),
    committing each shard as it finishes; the one run loop of `run_job` and of the flow's tasks.

    The caller holds the engine for the window (`engine_lock` where threads share one).

    Args:
        run_id, columns, structured, lease, worker, on_rows: as for `run_shards`.
        on_shard_done: called with each ShardResult right after its commit.

    Returns:
        The WindowRun: the results, the worker, the engine's quantization and step counters.

    Raises:
        Whatever `run_shards` raises; the shards committed before stay committed.
    """
    worker = worker or default_worker()
    t0 = time.perf_counter()
    stats0 = step_counters(llm)
    results: list[ShardResult] = []
    with contextlib.closing(run_shards(spec, window, llm, run_id=run_id, on_rows=on_rows, columns=columns,
                                       lease=lease, structured=structured, worker=worker)) as committed:
        for result in committed:
            results.append(result)
            if on_shard_done is not None:
                on_shard_done(result)
    return WindowRun(results, worker, engine_quantization(spec, llm), step_counters(llm, stats0),
                     time.perf_counter() - t0)
