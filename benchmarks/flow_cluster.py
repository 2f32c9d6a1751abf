"""The Prefect flow against `tokenmill run`, and the same job on a 2-worker Dask cluster, on this machine.

    python -m benchmarks.flow_cluster [--rows 256] [--repeats 3] [--no-cluster]

Workload: the labelling demo job (`tokenmill demo --job labelling`: a shared few-shot
instruction plus one docstring per row, greedy, output constrained to six labels, at most 8
tokens, shards of 64 rows) on `--rows` rows: `data/labelling.parquet`'s 168 rows, repeated
with new ids up to that count. Every run uses the same spec, with a KV pool of 1 GiB (three
engines live at once in the cluster part).

Part 1, one process: `tokenmill run` (in process, `pipeline.cli.main`) and the flow
`batch_generate` on its default thread runner, in the order CLI, flow, flow, CLI, ...
(`--repeats` pairs, default 3), after one warm-up run of the whole job. Each run gets a fresh
engine built before its timing starts (the weights are loaded once per process; an empty
prefix cache, so no run reuses another's blocks) and starts once other processes keep fewer
than 0.3 cores busy (waiting up to 30 s). The flow reports to a temporary Prefect API
(`prefect_test_harness`) started before timing. Output tok/s = the run's completion tokens /
the wall time of the call (plan, run, report); the ratio is flow / CLI, medians. The part
files of every run are compared with the first CLI run's (ids, generations). Prefect's own
fixed cost of a flow run (an empty `@flow`, median of 3) is measured beside it.

Part 2, cluster: a `distributed.LocalCluster` of 2 process workers with 1 thread each
(TOKENMILL_NUM_THREADS=1), the job through the flow with `cluster=` its address, in shards of
32 rows and one shard per window (a window takes the next shard too when it continues the
prefix group), so that both workers get windows: a cold run (each worker loads its engine on
its first window) and a warm one (every worker given a fresh engine, loaded but with an
empty prefix cache, before the run: `client.run(fresh_engine, spec)`). Rows/s, and the
overhead: wall time minus the busiest worker's compute (the sum over its windows of the
window's time from reading its shards to its last commit, from the done markers). Two
workers of one thread each share the same 2 cores as the one 2-thread process of part 1: no
speed-up is possible here; the figure measures what the cluster costs, not what it gains.

Results: benchmarks/results/<host-id>/flow_cluster.{txt,json} (see benchmarks/record.py).
"""
from __future__ import annotations

import argparse
import contextlib
import io as _io
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")

ROOT = Path(__file__).resolve().parent.parent
KV_BYTES = 1 << 30


def machine_load() -> dict[str, Any]:
    from benchmarks.hf_compare import machine_load as load

    return load(0.5)


def wait_quiet(limit_s: float = 30.0, busy: float = 0.3) -> dict[str, Any]:
    """Wait (at most `limit_s`) until other processes keep fewer than `busy` cores busy (the Prefect
    server this benchmark starts settles after its start-up); returns the last load sample."""
    deadline = time.monotonic() + limit_s
    load = machine_load()
    while (load["other_busy_cores"] or 0.0) >= busy and time.monotonic() < deadline:
        load = machine_load()
    return load


def fmt_load(load: dict[str, Any]) -> str:
    from benchmarks.hf_compare import _fmt_load

    return _fmt_load(load)


def labelling_input(path: Path, rows: int) -> str:
    """`rows` labelling rows (the bundled 168, repeated with new ids) as one Parquet file; its path."""
    import polars as pl

    base = pl.read_parquet(ROOT / "data" / "labelling.parquet")
    reps = -(-rows // base.height)
    df = pl.concat([base.with_columns(pl.col("id") + f"-{r}") for r in range(reps)]).head(rows)
    df.write_parquet(path)
    return str(path)


def job_fields(inp: str, out: str) -> dict[str, Any]:
    from pipeline.demo import DEMO_JOBS

    fields = {k: v for k, v in DEMO_JOBS["labelling"].items() if k != "input"}
    return {**fields, "input": inp, "output": out, "kv_cache_memory_bytes": KV_BYTES, "progress": False}


def cli_args(fields: dict[str, Any]) -> list[str]:
    args = ["run"]
    for k, v in fields.items():
        flag = "--" + k.replace("_", "-")
        if isinstance(v, bool):
            args.append(flag if v else "--no-" + k.replace("_", "-"))
        elif isinstance(v, list):
            args += [flag, ",".join(v)]
        else:
            args += [flag, str(v)]
    return args


def read_rows(out: str):
    import polars as pl

    parts = sorted(Path(out).glob("part-*.parquet"))
    return pl.concat([pl.read_parquet(p) for p in parts]).sort("id").select(["id", "generation", "finish_reason"])


def fresh_engine(spec: Any) -> str:
    """Give this process a new engine for `spec` (weights from the per-process cache, an empty prefix
    cache): what `get_llm` returns from now on. Returns its device name (for `client.run`)."""
    from engine import LLM
    from pipeline import cache_llm

    llm = LLM(spec.model, **spec.engine_kwargs())
    cache_llm(spec, llm)
    return str(llm.device_name)


def empty_flow_s(repeats: int = 3) -> float:
    """Prefect's fixed cost of one flow run here: the median wall time of an empty flow."""
    from prefect import flow

    @flow(name="tokenmill-bench-empty")
    def empty() -> int:
        return 0

    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        empty()
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times), 3)


def timed(kind: str, fields: dict[str, Any]) -> dict[str, Any]:
    """One run of the job (kind "cli" or "flow") on a fresh engine; its wall time and the report's figures."""
    from pipeline import JobSpec, read_metrics
    from pipeline.cli import main

    fresh_engine(JobSpec(**fields))
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(_io.StringIO()):
        if kind == "cli":
            assert main(cli_args(fields)) == 0
        else:
            from flows import batch_generate

            batch_generate(JobSpec(**fields))
    wall = time.perf_counter() - t0
    m = read_metrics(fields["output"]).row(-1, named=True)
    return {"kind": kind, "wall_s": round(wall, 3), "report_wall_s": m["wall_s"], "rows": m["rows_ok"],
            "completion_tokens": m["completion_tokens"], "output_tok_s": round(m["completion_tokens"] / wall, 2),
            "quantization": m["quantization"], "device_count": m["device_count"], "cached_tokens": m["cached_tokens"]}


def worker_busy_s(out: str, shards_in_flight: int) -> dict[str, float]:
    """Per worker, the sum over its windows of the window's time (its slowest shard's read-to-commit seconds)."""
    from pipeline import plan_windows
    from pipeline.manifest import done_shards, read_manifest
    from pipeline.planner import Shard

    shards = [Shard.from_json(d) for d in read_manifest(out, {})["shards"]]
    done = done_shards(out, {})
    busy: dict[str, float] = {}
    for window in plan_windows(shards, shards_in_flight):
        results = [done[s.index] for s in window]
        busy[results[0].worker] = busy.get(results[0].worker, 0.0) + max(r.seconds for r in results)
    return busy


def cluster_part(inp: str, tmp: Path, api: str, reference) -> dict[str, Any]:
    import distributed

    from flows import batch_generate
    from pipeline import JobSpec, read_metrics

    env = {"PREFECT_API_URL": api, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_LOGGING_LEVEL": "WARNING",
           "TOKENMILL_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    with distributed.LocalCluster(n_workers=2, processes=True, threads_per_worker=1, host="127.0.0.1",
                                  dashboard_address=":0", env=env, silence_logs=40) as cluster:
        out["cluster_start_s"] = round(time.perf_counter() - t0, 2)
        client = distributed.Client(cluster, set_as_default=False)
        for name in ("cold", "warm"):
            # shards of 32 rows, one (two with their prefix group) per window: 4 windows for 2 workers
            fields = {**job_fields(inp, str(tmp / f"cluster-{name}")), "shard_size": 32, "shards_in_flight": 1}
            spec = JobSpec(**fields, cluster=cluster.scheduler_address)
            if name == "warm":  # every worker has a loaded engine, with an empty prefix cache
                client.run(fresh_engine, spec)
            load0 = wait_quiet()
            t0 = time.perf_counter()
            with contextlib.redirect_stdout(_io.StringIO()):
                batch_generate(spec)
            wall = time.perf_counter() - t0
            m = read_metrics(spec.output).row(-1, named=True)
            busy = worker_busy_s(spec.output, spec.shards_in_flight)
            out[name] = {"wall_s": round(wall, 3), "rows": m["rows_ok"], "rows_per_s": round(m["rows_ok"] / wall, 3),
                         "output_tok_s": round(m["completion_tokens"] / wall, 2), "device_count": m["device_count"],
                         "worker_busy_s": {w: round(s, 3) for w, s in busy.items()},
                         "overhead_s": round(wall - max(busy.values()), 3),
                         "same_rows_as_cli": read_rows(spec.output).equals(reference),
                         "load_before": load0, "load_after": machine_load()}
        client.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.flow_cluster", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=256, help="rows of the labelling input")
    parser.add_argument("--repeats", type=int, default=3, help="CLI/flow pairs (ABBA order)")
    parser.add_argument("--no-cluster", action="store_true", help="skip the 2-worker cluster part")
    parser.add_argument("--results", default=None,
                        help="path stem for .txt and .json (default: benchmarks/results/<host-id>/flow_cluster)")
    args = parser.parse_args(argv)
    if args.rows < 1 or args.repeats < 1:
        parser.error("--rows and --repeats must be at least 1")
    os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="tokenmill-bench-prefect-"))

    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    from pipeline import JobSpec, get_llm, run_job

    tmp = Path(tempfile.mkdtemp(prefix="tokenmill-flow-bench-"))
    inp = labelling_input(tmp / "labelling.parquet", args.rows)
    result: dict[str, Any] = {"rows": args.rows, "load_start": machine_load()}
    t0 = time.perf_counter()
    get_llm(JobSpec(**job_fields(inp, str(tmp / "x"))))
    result["engine_load_s"] = round(time.perf_counter() - t0, 2)
    run_job(JobSpec(**job_fields(inp, str(tmp / "warmup"))))  # kernels, allocator and prefix cache warm

    with prefect_test_harness(server_startup_timeout=120):
        result["empty_flow_s"] = empty_flow_s()
        runs = []
        order = [k for i in range(args.repeats) for k in (("cli", "flow") if i % 2 == 0 else ("flow", "cli"))]
        for i, kind in enumerate(order):
            load0 = wait_quiet()
            r = timed(kind, job_fields(inp, str(tmp / f"{kind}-{i}")))
            r["load_before"], r["load_after"] = load0, machine_load()
            runs.append(r)
            print(f"{kind:4} run {i}: {r['wall_s']:.2f} s, {r['output_tok_s']:.1f} output tok/s "
                  f"({fmt_load(load0)})", file=sys.stderr)
        reference = read_rows(str(tmp / "cli-0"))
        same = all(read_rows(str(tmp / f"{r['kind']}-{i}")).equals(reference) for i, r in enumerate(runs))
        cli = statistics.median(r["output_tok_s"] for r in runs if r["kind"] == "cli")
        flw = statistics.median(r["output_tok_s"] for r in runs if r["kind"] == "flow")
        result.update(runs=runs, cli_output_tok_s=cli, flow_output_tok_s=flw, ratio=round(flw / cli, 3),
                      same_rows=same)
        if not args.no_cluster:
            result["cluster"] = cluster_part(inp, tmp, PREFECT_API_URL.value(), reference)
    result["load_end"] = machine_load()

    lines = [f"flow vs tokenmill run, labelling job, {args.rows} rows ({len(runs)} runs, ABBA order), "
             f"engine loaded in {result['engine_load_s']} s before timing",
             f"  tokenmill run : {cli:.1f} output tok/s (median)",
             f"  flow (threads): {flw:.1f} output tok/s (median) = {result['ratio']:.3f}x the CLI; "
             f"same rows in every run: {same}",
             f"  Prefect's fixed cost of a flow run here (an empty flow): {result['empty_flow_s']:.2f} s"]
    for i, r in enumerate(runs):
        lines.append(f"    {r['kind']:4} {i}: {r['wall_s']:.2f} s wall, {r['completion_tokens']} tokens, "
                     f"{r['output_tok_s']:.1f} tok/s, quantization {r['quantization']}, cached {r['cached_tokens']}; "
                     f"{fmt_load(r['load_before'])}")
    if "cluster" in result:
        c = result["cluster"]
        lines.append(f"2-worker LocalCluster (1 thread each, same 2 cores), cluster start {c['cluster_start_s']} s:")
        for name in ("cold", "warm"):
            r = c[name]
            lines.append(f"  {name}: {r['rows_per_s']:.2f} rows/s ({r['wall_s']:.2f} s wall, "
                         f"{r['output_tok_s']:.1f} output tok/s, device_count {r['device_count']}); busiest "
                         f"worker computed {max(r['worker_busy_s'].values()):.2f} s, overhead {r['overhead_s']:.2f} s"
                         f"{' (includes each worker loading its engine)' if name == 'cold' else ''}; same rows as "
                         f"the CLI: {r['same_rows_as_cli']}; {fmt_load(r['load_before'])}")
        cli_rows = statistics.median(r["rows"] / r["wall_s"] for r in runs if r["kind"] == "cli")
        lines.append(f"  (one process, 2 threads: {cli_rows:.2f} rows/s; two 1-thread workers on 2 cores cannot "
                     f"be faster than that here)")
    lines.append(f"load at start: {fmt_load(result['load_start'])}; at end: {fmt_load(result['load_end'])}")
    text = "\n".join(lines)
    print(text)
    from benchmarks import record
    from engine.host import Host

    stem = args.results or str(record.result_path(Host.current().host_id, "flow_cluster").with_suffix(""))
    Path(stem).parent.mkdir(parents=True, exist_ok=True)
    Path(stem + ".txt").write_text(record.strip_paths(text) + "\n")
    record.write(Path(stem + ".json"), json.loads(json.dumps(result, default=str)), "flow_cluster")
    return 0


if __name__ == "__main__":
    sys.exit(main())
