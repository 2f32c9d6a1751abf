"""Where a workload's wall time goes, step by step: steps that carry prompt tokens (prefill,
with the decode rows that ride along) against decode-only steps, each split by the C decoder
driver's own kernel timers (linear layers of the decoder, attention, KV write, RMSNorm, RoPE;
`engine.kernels.cpu.decoder.timings`). "rest" is the step's wall time outside those kernels: the
LM head, the sampler, the scheduler, input preparation and the Python loop.

    python -m benchmarks.step_phases [--workload in99-out64] [--kv-cache-dtype auto|fp16|fp32|bf16|int8]
        [--max-num-batched-tokens 1024] [--num-prompts N] [--max-output-tokens N] [--steps]

Speculation is off (a verification step is neither phase). Times are seconds of one run after a
short warm-up, with the machine load printed before it: check it is quiet.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the other benchmarks

import argparse  # noqa: E402
import collections  # noqa: E402
import time  # noqa: E402
from typing import Any, Optional  # noqa: E402

from benchmarks.hf_compare import _fmt_load, machine_load  # noqa: E402
from benchmarks.throughput import DEFAULT_MODEL, make_llm  # noqa: E402
from benchmarks.workloads import WORKLOADS, build_workload  # noqa: E402


def run_phases(llm: Any, prompts: list, params: Any) -> list[dict[str, Any]]:
    """Generate `prompts` with `llm` and return one record per engine step: wall seconds
    (`wall_s`), `prompt_tokens` and `output_tokens` of the step, and the driver's kernel
    seconds by name (`kernels`). Raises RuntimeError if the C decoder driver is unavailable."""
    from engine.kernels import cpu

    if not cpu.available():
        raise RuntimeError(f"no C kernels: {cpu.why_unavailable()}")
    from engine.kernels.cpu import decoder

    core = llm.core
    step = core.step
    records: list[dict[str, Any]] = []

    def timed_step() -> Any:
        c0 = decoder.timings()
        t0 = time.perf_counter()
        r = step()
        dt = time.perf_counter() - t0
        c1 = decoder.timings()
        records.append({"wall_s": dt, "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens,
                        "kernels": {k: c1[k] - c0[k] for k in c1}})
        return r

    decoder.set_timing(True)
    core.step = timed_step
    try:
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        del core.step  # the instance attribute shadowed the method
        decoder.set_timing(False)
    return records


def _summary(name: str, recs: list[dict[str, Any]]) -> str:
    if not recs:
        return f"{name}: none"
    wall = sum(r["wall_s"] for r in recs)
    k = collections.defaultdict(float)
    for r in recs:
        for key, v in r["kernels"].items():
            k[key] += v
    rest = wall - sum(k.values())
    parts = ", ".join(f"{key} {v:.3f}" for key, v in k.items() if v > 0)
    return (f"{name}: {len(recs)} steps, {wall:.2f} s ({1e3 * wall / len(recs):.1f} ms each), "
            f"{sum(r['prompt_tokens'] for r in recs)} prompt and {sum(r['output_tokens'] for r in recs)} output "
            f"tokens; s in kernels: {parts}; rest {rest:.3f} ({100 * rest / wall:.0f}%)")


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.step_phases", description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="in99-out64", choices=WORKLOADS)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--kv-cache-dtype", default="auto", help="auto|fp16|fp32|bf16|int8")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--max-output-tokens", type=int, default=None, help="cap every request's output (tokens)")
    p.add_argument("--steps", action="store_true", help="also print every step that carries prompt tokens")
    args = p.parse_args(argv)
    from engine import SamplingParams

    llm = make_llm(args.model, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                   kv_cache_dtype=args.kv_cache_dtype, speculative=None)
    wl = build_workload(args.workload, llm.tokenizer, num_prompts=args.num_prompts, seed=0,
                        max_output_tokens=args.max_output_tokens)
    # warm-up on reversed text: no prefix-cache block of it can serve a measured prompt
    llm.generate([wl.prompt_token_ids[0][:32][::-1]], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    print(f"step phases: {wl.summary()}, KV cache {args.kv_cache_dtype}, token budget {args.max_num_batched_tokens}")
    print(f"machine: {_fmt_load(machine_load())}", flush=True)
    t0 = time.perf_counter()
    recs = run_phases(llm, wl.prompt_token_ids, wl.sampling_params())
    wall = time.perf_counter() - t0
    pre = [r for r in recs if r["prompt_tokens"] > 0]
    dec = [r for r in recs if r["prompt_tokens"] == 0]
    print(f"wall {wall:.2f} s, {len(recs)} steps, {sum(r['wall_s'] for r in recs):.2f} s in them")
    print(_summary("steps with prompt tokens", pre))
    print(_summary("decode-only steps", dec))
    if args.steps:
        for r in pre:
            ks = "  ".join(f"{key} {1e3 * v:.1f}" for key, v in r["kernels"].items() if v > 0)
            print(f"  {1e3 * r['wall_s']:7.1f} ms  prompt {r['prompt_tokens']:5d}  out {r['output_tokens']:3d}  {ks}")
    print(f"machine at end: {_fmt_load(machine_load())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
