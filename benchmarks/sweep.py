"""Concurrency sweep: tokenmill throughput and latency against `max_num_seqs`.

Runs the same workload (default: ``random``, ``--num-prompts`` 128 with outputs
capped at ``--max-output-tokens`` 48) once per ``max_num_seqs`` in
{1, 8, 32, 128}, every request submitted at t=0 (offline batch), and reports
output and total tokens/s, p50 and p95 per-request latency (arrival to last
token, so queueing counts), p50 TTFT and mean TPOT. Writes ``sweep.csv`` and
``sweep.png`` (throughput and p95 latency against concurrency) under
``--out-dir`` (default ``bench_results/sweep``, which git ignores), and prints
the machine load around every point (see `benchmarks.hf_compare`).

Usage::

    python -m benchmarks.sweep [--quick] [--workload random] [--num-prompts 128]
        [--max-output-tokens 48] [--concurrency 1,8,32,128] [--out-dir bench_results/sweep]
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # 2 spinning OpenMP threads collapse under contention

import argparse  # noqa: E402
import csv  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Optional  # noqa: E402

import torch  # noqa: E402

from benchmarks.hf_compare import BusyMeter, _fmt_load, machine_load, warn_if_busy  # noqa: E402
from benchmarks.throughput import DEFAULT_MODEL, make_llm, rates, run_tokenmill  # noqa: E402
from benchmarks.workloads import build_workload  # noqa: E402

COLUMNS = ["max_num_seqs", "requests", "input_tokens", "output_tokens", "wall_s", "requests_per_s",
           "output_tok_s", "total_tok_s", "latency_p50_s", "latency_p95_s", "ttft_p50_s", "tpot_mean_s",
           "steps", "mean_batched_tokens", "preemptions", "kv_utilization", "loadavg_1m",
           "other_busy_before", "other_busy_during"]


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """Throughput (left axis) and p95 latency (right axis) against max_num_seqs, log2 x axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["max_num_seqs"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    ax.plot(xs, [r["output_tok_s"] for r in rows], "o-", color="tab:blue", label="output tok/s")
    ax.plot(xs, [r["total_tok_s"] for r in rows], "s--", color="tab:cyan", label="total (in+out) tok/s")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("max_num_seqs (concurrent requests)")
    ax.set_ylabel("tokens / s", color="tab:blue")
    ax2 = ax.twinx()
    ax2.plot(xs, [r["latency_p95_s"] for r in rows], "^-", color="tab:red", label="p95 request latency")
    ax2.set_ylabel("p95 latency (s)", color="tab:red")
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="upper left", fontsize=8)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="8 prompts, 16 output tokens (smoke run)")
    p.add_argument("--workload", default="random")
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--max-output-tokens", type=int, default=None)
    p.add_argument("--concurrency", default="1,8,32,128")
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out-dir", type=Path, default=Path("bench_results/sweep"))
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    if not levels or min(levels) < 1:
        p.error("--concurrency needs positive integers")
    nprompts = args.num_prompts or (8 if args.quick else 128)
    max_out = args.max_output_tokens or (16 if args.quick else 48)

    from engine.tokenizer import Tokenizer

    print(f"tokenmill concurrency sweep: torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, {os.cpu_count()} CPUs", flush=True)
    print(f"machine at start: {_fmt_load(machine_load())}", flush=True)
    wl = build_workload(args.workload, Tokenizer.from_model(args.model), nprompts, args.seed,
                        max_output_tokens=max_out)
    print(wl.summary(), flush=True)
    rows = []
    for c in levels:
        llm = make_llm(args.model, max_num_seqs=c, max_num_batched_tokens=args.max_num_batched_tokens)
        load = machine_load()
        meter = BusyMeter().start()
        r = run_tokenmill(llm, wl)
        busy = meter.stop()
        del llm
        r.update(rates(wl, r["wall_s"], r["output_tokens"]))
        st = r["stats"]
        row = {"max_num_seqs": c, "requests": r["requests"], "input_tokens": wl.num_input_tokens,
               "output_tokens": r["output_tokens"], "steps": st["steps"],
               "mean_batched_tokens": st["mean_batched_tokens"], "preemptions": st["preemptions"],
               "kv_utilization": st["kv_utilization"], "loadavg_1m": load["loadavg_1m"],
               "other_busy_before": load["other_busy_cores"], "other_busy_during": busy}
        row.update({k: r[k] for k in COLUMNS if k in r and k not in row})
        rows.append(row)
        print(f"max_num_seqs {c:>4}: {r['output_tok_s']:7.1f} out tok/s, {r['total_tok_s']:7.1f} total tok/s, "
              f"latency p50 {r['latency_p50_s']:.1f} s p95 {r['latency_p95_s']:.1f} s, TPOT "
              f"{1e3 * r['tpot_mean_s']:.0f} ms  [{_fmt_load(load)}; busy during {busy}]", flush=True)

    args.out_dir.mkdir(parents=True, exist_ok=True)
    csv_path, png_path = args.out_dir / "sweep.csv", args.out_dir / "sweep.png"
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for row in rows:
            w.writerow({k: row.get(k) for k in COLUMNS})
    busiest = max(max(r["other_busy_before"] or 0.0, r["other_busy_during"] or 0.0) for r in rows)
    load1 = max(r["loadavg_1m"] for r in rows)
    title = (f"tokenmill, {wl.name}{' --quick' if args.quick else ''}: {wl.num_requests} requests x "
             f"<= {max_out} new tokens, {os.cpu_count()} CPUs, {torch.get_num_threads()} threads\n"
             f"machine load: loadavg up to {load1:.1f}, other processes kept up to {busiest:.1f} cores busy")
    plot(rows, png_path, title)
    print()
    print(f"{'max_num_seqs':>12} {'out tok/s':>9} {'total tok/s':>11} {'p50 lat s':>9} {'p95 lat s':>9} "
          f"{'TPOT ms':>8} {'tok/step':>8} {'load 1m':>7} {'busy':>5}")
    for r in rows:
        print(f"{r['max_num_seqs']:>12} {r['output_tok_s']:>9.1f} {r['total_tok_s']:>11.1f} "
              f"{r['latency_p50_s']:>9.1f} {r['latency_p95_s']:>9.1f} {1e3 * r['tpot_mean_s']:>8.0f} "
              f"{r['mean_batched_tokens']:>8.0f} {r['loadavg_1m']:>7.2f} {r['other_busy_during'] or 0:>5.2f}")
    print(f"wrote {csv_path} and {png_path}")
    warn_if_busy(busiest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
