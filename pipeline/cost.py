"""The cost model: device-hour price x measured wall time, split over input and output tokens.

    device_s  = wall_s x device_count
    cost_usd  = device_s / 3600 x price_per_device_hour

The total is split between input (prompt) and output (completion) tokens by
weighted token counts, because one forward pass serves both and cannot be
timed apart in a mixed (chunked-prefill) step:

    input_weight  = prompt_tokens - cached_tokens         (cached tokens are not recomputed)
    output_weight = output_token_weight x completion_tokens
    input_cost    = cost_usd x input_weight / (input_weight + output_weight)
    output_cost   = cost_usd - input_cost

A run that computed no token (every row an error row, or every shard already
done) has nothing to split the cost over: both parts are 0 and `cost_usd`
alone holds what the run cost (reading, validating, loading).

`output_token_weight` (default 4) says how many uncomputed prompt tokens one
decode token costs: a decode token runs in a small, bandwidth-bound batch
while prompt tokens run in large, compute-bound ones. USD per 1M input tokens
divides the input cost by all prompt tokens (cached ones included), so prefix
caching lowers it; USD per 1M tokens divides the whole cost by all tokens.

Prefix sharing: `prompt_tokens_computed` = prompt - cached tokens;
`prefix_cache_hit_rate` = cached / prompt tokens of this run;
`ideal_prefix_hit_rate` = the whole dataset's best possible hit rate,
1 - distinct block-level prefix-tree tokens / prompt tokens (see
pipeline.planner); `plan` says how rows were ordered.
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime
from typing import Optional


@dataclass
class TokenCounts:
    """Rows and tokens of (part of) a job run. Adds with `+`.

    `rows_valid` / `rows_invalid` count constrained (or scored) rows whose output did / did not
    satisfy its constraint (error rows are neither); `labels` counts each label of choice and
    score rows.
    """

    rows_ok: int = 0
    rows_error: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    rows_valid: int = 0
    rows_invalid: int = 0
    labels: dict[str, int] = field(default_factory=dict)

    def __add__(self, other: "TokenCounts") -> "TokenCounts":
        nums = {f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self) if f.name != "labels"}
        return TokenCounts(**nums, labels=dict(Counter(self.labels) + Counter(other.labels)))


@dataclass
class CostReport:
    """One row of the job's metrics (`_job/runs/`): a job run's volume, speed and cost.

    `status` is "ok", "failed" (with `error`) or "interrupted"; a failed or interrupted run's
    counts are those of the shards it committed, and `discarded_completion_tokens` are the
    output tokens it generated for shards it did not commit (its wall time still counts).
    Every row of the job is in exactly one of four columns: `rows_total` = `rows_ok` +
    `rows_error` (this run committed them) + `rows_skipped` (an earlier run did) +
    `rows_not_run` (in shards this run was to run but did not commit: 0 unless the run failed
    or was interrupted; a resume runs them).
    Structured outputs (jobs with constraints or scoring; None otherwise): `rows_valid` and
    `rows_invalid`, and for choice and score jobs `label_distribution`, a JSON object
    {label: rows}, most frequent first.
    `dtype` is the weights dtype the job computed with ("auto" resolved, as the manifest recorded
    it); `host` the CPU of the process that booked the run (`engine.host.describe`; on a cluster
    the workers' may differ). Speculative decoding: drafted and accepted tokens of the committed rows, their ratio
    (the acceptance rate), and, from the engine's counters over the run when it ran in
    this process, accepted tokens per verified draft and the share of steps that verified
    drafts (None when not known).
    `request_counts` (jobs over OpenAI Batch request files; None otherwise): the job's requests as
    OpenAI's Batch API counts them, JSON {"total", "completed", "failed"}, over every run so far.
    """

    job_id: str
    run_id: str
    model: str
    quantization: str
    device: str
    device_count: int
    started_at: datetime
    finished_at: datetime
    wall_s: float
    device_s: float
    price_per_device_hour: float
    cost_usd: float
    rows_total: int
    rows_ok: int
    rows_error: int
    rows_skipped: int
    rows_not_run: int
    prompt_tokens: int
    cached_tokens: int
    prompt_tokens_computed: int
    completion_tokens: int
    prefix_cache_hit_rate: float
    ideal_prefix_hit_rate: Optional[float]
    plan: str
    rows_per_s: float
    input_tokens_per_s: float
    output_tokens_per_s: float
    input_cost_usd: float
    output_cost_usd: float
    usd_per_1m_input_tokens: Optional[float]
    usd_per_1m_output_tokens: Optional[float]
    usd_per_1m_tokens: Optional[float]
    output_token_weight: float
    status: str = "ok"
    error: Optional[str] = None
    discarded_completion_tokens: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_acceptance_rate: Optional[float] = None
    spec_mean_accepted_per_verify: Optional[float] = None
    spec_step_share: Optional[float] = None
    rows_valid: Optional[int] = None
    rows_invalid: Optional[int] = None
    label_distribution: Optional[str] = None
    dtype: Optional[str] = None
    host: Optional[str] = None
    request_counts: Optional[str] = None

    def as_row(self) -> dict:
        return asdict(self)

    def as_frame(self) -> "pl.DataFrame":
        """The report as a one-row polars DataFrame whose unset (None) fields keep their declared type
        (Float64, Int64, Utf8) instead of polars' Null: runs' files then read together with one
        `pl.read_parquet("OUT/_job/runs/*.parquet")` (a Null beside a Float64 column was a SchemaError)."""
        import typing

        import polars as pl

        kinds = {float: pl.Float64, int: pl.Int64, str: pl.Utf8, bool: pl.Boolean}
        df = pl.DataFrame([self.as_row()])
        casts = []
        for name, hint in typing.get_type_hints(type(self)).items():
            if df.schema.get(name) == pl.Null:
                args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
                if args[0] in kinds:
                    casts.append(pl.col(name).cast(kinds[args[0]]))
        return df.with_columns(casts) if casts else df


def _per_1m(cost: float, tokens: int) -> Optional[float]:
    return cost / tokens * 1e6 if tokens > 0 else None


def split_cost(cost_usd: float, counts: TokenCounts, output_token_weight: float) -> tuple[float, float]:
    """(input_cost, output_cost) of a total; see the module docstring. (0, 0) when no token was
    computed: the cost of a run that generated nothing is not booked as output (or input) tokens."""
    w_in = max(counts.prompt_tokens - counts.cached_tokens, 0)
    w_out = output_token_weight * counts.completion_tokens
    if w_in + w_out <= 0:
        return 0.0, 0.0
    input_cost = cost_usd * w_in / (w_in + w_out)
    return input_cost, cost_usd - input_cost


def cost_report(
    *,
    job_id: str,
    run_id: str,
    model: str,
    quantization: Optional[str],
    device: str,
    device_count: int,
    started_at: datetime,
    finished_at: datetime,
    price_per_device_hour: float,
    counts: TokenCounts,
    rows_total: int,
    rows_skipped: int,
    rows_not_run: int,
    output_token_weight: float = 4.0,
    ideal_prefix_hit_rate: Optional[float] = None,
    plan: str = "input",
    status: str = "ok",
    error: Optional[str] = None,
    discarded_completion_tokens: int = 0,
    engine_steps: Optional[dict] = None,
    structured: bool = False,
    dtype: Optional[str] = None,
    host: Optional[str] = None,
) -> CostReport:
    """Build a run's CostReport from its wall time and token counts (see CostReport for `status`).

    Args:
        rows_skipped: rows of shards an earlier run committed.
        rows_not_run: rows of shards this run was to run and did not commit (a failed or
            interrupted run's; 0 for a run that finished).
        engine_steps: the engine's counters over the run, {"steps", "spec_steps", "spec_verifies",
            "spec_accepted_tokens"}, or None when not known (e.g. shards run by other processes).
        structured: the job constrains or scores its outputs (fills rows_valid / rows_invalid).
        dtype: the weights dtype the run computed with; host: the host line of the booking process.
    """
    es = engine_steps or {}
    wall_s = max((finished_at - started_at).total_seconds(), 1e-9)
    device_s = wall_s * device_count
    cost = device_s / 3600.0 * price_per_device_hour
    input_cost, output_cost = split_cost(cost, counts, output_token_weight)
    rows_done = counts.rows_ok + counts.rows_error
    return CostReport(
        job_id=job_id,
        run_id=run_id,
        model=model,
        quantization=quantization or "none",
        device=device,
        device_count=device_count,
        started_at=started_at,
        finished_at=finished_at,
        wall_s=wall_s,
        device_s=device_s,
        price_per_device_hour=price_per_device_hour,
        cost_usd=cost,
        rows_total=rows_total,
        rows_ok=counts.rows_ok,
        rows_error=counts.rows_error,
        rows_skipped=rows_skipped,
        rows_not_run=rows_not_run,
        prompt_tokens=counts.prompt_tokens,
        cached_tokens=counts.cached_tokens,
        prompt_tokens_computed=counts.prompt_tokens - counts.cached_tokens,
        completion_tokens=counts.completion_tokens,
        prefix_cache_hit_rate=counts.cached_tokens / counts.prompt_tokens if counts.prompt_tokens else 0.0,
        ideal_prefix_hit_rate=ideal_prefix_hit_rate,
        plan=plan,
        rows_per_s=rows_done / wall_s,
        input_tokens_per_s=counts.prompt_tokens / wall_s,
        output_tokens_per_s=counts.completion_tokens / wall_s,
        input_cost_usd=input_cost,
        output_cost_usd=output_cost,
        usd_per_1m_input_tokens=_per_1m(input_cost, counts.prompt_tokens),
        usd_per_1m_output_tokens=_per_1m(output_cost, counts.completion_tokens),
        usd_per_1m_tokens=_per_1m(cost, counts.prompt_tokens + counts.completion_tokens),
        output_token_weight=output_token_weight,
        status=status,
        error=error,
        discarded_completion_tokens=discarded_completion_tokens,
        spec_draft_tokens=counts.spec_draft_tokens,
        spec_accepted_tokens=counts.spec_accepted_tokens,
        spec_acceptance_rate=(counts.spec_accepted_tokens / counts.spec_draft_tokens
                              if counts.spec_draft_tokens else None),
        spec_mean_accepted_per_verify=(es["spec_accepted_tokens"] / es["spec_verifies"]
                                       if es.get("spec_verifies") else None),
        spec_step_share=es["spec_steps"] / es["steps"] if es.get("steps") else None,
        rows_valid=counts.rows_valid if structured else None,
        rows_invalid=counts.rows_invalid if structured else None,
        label_distribution=(json.dumps(dict(sorted(counts.labels.items(), key=lambda kv: (-kv[1], kv[0]))))
                            if counts.labels else None),
        dtype=dtype,
        host=host,
    )


def format_report(row: dict) -> str:
    """The cost report as a two-column text table."""
    def fmt(v) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            if v == 0:
                return "0"
            return f"{v:.6f}" if abs(v) < 0.01 else f"{v:,.3f}" if abs(v) < 1000 else f"{v:,.1f}"
        if isinstance(v, int) and not isinstance(v, bool):
            return f"{v:,}"
        if isinstance(v, datetime):
            return v.strftime("%Y-%m-%d %H:%M:%S UTC")
        return str(v)

    width = max(len(k) for k in row)
    lines = [f"{'metric'.ljust(width)}  value", f"{'-' * width}  {'-' * 24}"]
    lines += [f"{k.ljust(width)}  {fmt(v)}" for k, v in row.items()]
    return "\n".join(lines)
