"""Step time against the rows in a decode step: where speculative tokens are cheap on this machine.

A verification chunk of 1 + k tokens costs what 1 + k decode rows cost, so speculation pays
only where adding rows to a step costs less than the step's average per row. This times one
forward pass of N one-token rows, each attending to --context earlier tokens in its own KV
blocks, for N in --rows, and prints the time per step, per row, and the marginal cost of the
rows added since the previous size (all in ms), with the machine load.

    python -m benchmarks.step_cost [--rows 1,2,4,8,16,32,64,128,256] [--context 128] [--output-json F]
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the other benchmarks

import argparse  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Callable, Optional  # noqa: E402

import torch  # noqa: E402

from benchmarks import record  # noqa: E402
from benchmarks.hf_compare import _fmt_load, machine_load, write_json_report  # noqa: E402


def decode_step_times(llm, rows: int, context: int, repeats: int,
                      after_warmup: Optional[Callable[[], None]] = None) -> list[float]:
    """Seconds of each of `repeats` forward passes of `rows` one-token decode rows, each attending
    to `context` earlier tokens in KV blocks of its own (two warm-up passes first, then
    `after_warmup()` if given, e.g. to read counters). The blocks are freed afterwards."""
    from engine.model_runner import ChunkSpec

    pool, bs = llm.block_pool, llm.config.block_size
    tables = [pool.allocate(context // bs + 1) for _ in range(rows)]
    try:
        ids = list(range(1, context + 2))
        inputs = llm.runner.prepare([ChunkSpec(ids, context, 1, t, "last") for t in tables], [])
        with torch.inference_mode():
            for _ in range(2):
                llm.runner.run(inputs)
            if after_warmup is not None:
                after_warmup()
            ts = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                llm.runner.run(inputs)
                ts.append(time.perf_counter() - t0)
        return ts
    finally:
        for t in tables:
            pool.free(t)


def step_ms(llm, rows: int, context: int, repeats: int) -> float:
    """Median milliseconds of one forward pass of `rows` decode rows at `context`."""
    ts = decode_step_times(llm, rows, context, repeats)
    return sorted(ts)[len(ts) // 2] * 1e3


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.step_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,2,4,8,16,32,64,128,256")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--output-json", type=Path, default=None)
    record.add_arguments(p)
    args = p.parse_args(argv)
    from engine import LLM

    llm = LLM(args.model, speculative=None)
    print(f"{args.model}, context {args.context} tokens per row; {_fmt_load(machine_load())}")
    print(f"{'rows':>6} {'step ms':>9} {'ms/row':>8} {'marginal ms/row':>16}")
    out, prev = [], None
    for n in [int(x) for x in args.rows.split(",") if x.strip()]:
        t = step_ms(llm, n, args.context, args.repeats)
        marg = (t - prev[1]) / (n - prev[0]) if prev and n > prev[0] else None
        out.append({"rows": n, "step_ms": t, "ms_per_row": t / n, "marginal_ms_per_row": marg})
        print(f"{n:>6} {t:>9.2f} {t / n:>8.3f} {'' if marg is None else f'{marg:.3f}':>16}", flush=True)
        prev = (n, t)
    print(f"machine at end: {_fmt_load(machine_load())}")
    write_json_report(record.output_path(args, "step_cost"), {"context": args.context, "model": args.model, "rows": out})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
