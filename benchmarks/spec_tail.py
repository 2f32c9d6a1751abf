"""A job's tail with and without speculation: makespan, and the time from the moment fewer than 8
rows remain to the end.

Every batch job ends in a tail where only a few rows are still decoding and a step reads all
the weights for a handful of tokens; speculation can turn those steps into several tokens
each. For each mode the same `random` rows (256 by default) run through `LLM.iter_outputs`,
and the report gives the makespan, the tail time and their ratios to speculation off, with the
machine load (as every benchmark here).

    python -m benchmarks.spec_tail [--rows 256] [--modes off,auto] [--tail-rows 8] [--output-json F]
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the other benchmarks

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Optional  # noqa: E402

from benchmarks import record  # noqa: E402
from benchmarks.hf_compare import BusyMeter, _fmt_load, machine_load, warn_if_busy, write_json_report  # noqa: E402
from benchmarks.workloads import build_workload  # noqa: E402


def run_mode(mode: str, wl: Any, tail_rows: int, model: str) -> dict[str, Any]:
    """One mode's makespan and tail (seconds) on the workload, and its speculation counters."""
    from engine import LLM, SamplingParams

    llm = LLM(model, speculative=mode)
    llm.generate([wl.prompt_token_ids[0][:16]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    load = machine_load()
    meter = BusyMeter().start()
    before = (llm.stats.spec_draft_tokens, llm.stats.spec_accepted_tokens)
    t0 = time.perf_counter()
    left = wl.num_requests
    t_tail = None
    for _ in llm.iter_outputs(wl.prompt_token_ids, wl.sampling_params(), use_tqdm=False):
        left -= 1
        if t_tail is None and left < tail_rows:
            t_tail = time.perf_counter()
    end = time.perf_counter()
    return {"mode": mode, "makespan_s": end - t0, "tail_s": end - (t_tail or end), "machine_load": load,
            "other_busy_during": meter.stop(), "spec_draft_tokens": llm.stats.spec_draft_tokens - before[0],
            "spec_accepted_tokens": llm.stats.spec_accepted_tokens - before[1]}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.spec_tail", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--modes", default="off,auto")
    p.add_argument("--tail-rows", type=int, default=8)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-output-tokens", type=int, default=None, help="cap every row's output length")
    p.add_argument("--output-json", type=Path, default=None)
    record.add_arguments(p)
    args = p.parse_args(argv)
    from engine.tokenizer import Tokenizer

    wl = build_workload("random", Tokenizer.from_model(args.model), num_prompts=args.rows, seed=args.seed,
                        max_output_tokens=args.max_output_tokens)
    print(wl.summary(), flush=True)
    results = []
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        r = run_mode(mode, wl, args.tail_rows, args.model)
        results.append(r)
        print(f"{mode:>6}: makespan {r['makespan_s']:.1f} s, last {args.tail_rows} rows {r['tail_s']:.1f} s, "
              f"{r['spec_accepted_tokens']} of {r['spec_draft_tokens']} drafted tokens accepted "
              f"({_fmt_load(r['machine_load'])}; busy during {r['other_busy_during']})", flush=True)
    off = next((r for r in results if r["mode"] == "off"), None)
    for r in results:
        if off is not None and r is not off:
            print(f"{r['mode']} / off: makespan {off['makespan_s'] / r['makespan_s']:.2f}x faster, "
                  f"tail {off['tail_s'] / max(r['tail_s'], 1e-9):.2f}x faster")
    warn_if_busy(max([r["other_busy_during"] or 0.0 for r in results] or [0.0]))
    write_json_report(record.output_path(args, "spec_tail"), {"workload": wl.summary(), "tail_rows": args.tail_rows, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
