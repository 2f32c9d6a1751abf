"""Structured outputs: constrained against unconstrained throughput on the labelling workload.

    python -m benchmarks.structured --structured choice,json,score [--num-prompts 128] [--output-json F]
    python -m benchmarks.throughput --workload labelling --structured choice,json   (the same)

For each mode, on the `labelling` workload (shared ~400-token few-shot instruction + a
docstring, greedy):

- the constrained run: `choice` over the six labels, or `json`, an object
  {"topic": <label>, "why": <string of at most 40 characters>}; EOS ends a row;
- the matched unconstrained run: the same prompts, each row generating exactly as many
  tokens as its constrained row did (ignore_eos), so both runs decode the same token counts;
- the ratio of output tokens/s (constrained / unconstrained), the mask fill time per step,
  the share of it the forward pass hid (fill time the sampler did not wait for), and the
  tokens jump-forward appended; for `score`: rows/s of the scoring mode against generating
  the label under the choice constraint.

Every measurement gets a fresh engine (the weights are shared per process) and a warm-up,
so no run reads prefix-cache blocks another one computed. The 1-minute load average is
printed before and after each: trust a run on a quiet machine only.
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any, Optional

from benchmarks import record

LABELS = ["files", "network", "text", "math", "concurrency", "data"]
JSON_SCHEMA = {"type": "object", "properties": {"topic": {"enum": LABELS}, "why": {"type": "string", "maxLength": 40}},
               "required": ["topic", "why"], "additionalProperties": False}


def _engine(**kw: Any) -> Any:
    """A fresh engine, warmed up: one forward pass, and its grammar backend built (the token trie,
    about 0.3 s once per engine, not per job) with a throwaway regex, so that the timed runs
    still include compiling their own constraint (a once-per-job cost)."""
    from engine import LLM, SamplingParams
    from engine.structured import StructuredOutputsParams

    llm = LLM("smollm2-135m-instruct", **kw)
    llm.generate([[1, 2, 3, 4, 5, 6, 7, 8][::-1]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                 use_tqdm=False)
    llm.generate([[8, 7, 6, 5, 4, 3, 2, 1]], SamplingParams(
        temperature=0, max_tokens=2, structured_outputs=StructuredOutputsParams(regex="[a-z]{2}")), use_tqdm=False)
    return llm


def _timed(llm: Any, prompts: list, params: Any) -> tuple[list, float]:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return outs, time.perf_counter() - t0


def run_mode(mode: str, prompts: list[list[int]], engine_kwargs: dict[str, Any], max_tokens: int = 24) -> dict:
    """Measure one mode ("choice", "json" or "score"); returns its figures (see the module docstring)."""
    from engine import SamplingParams
    from engine.structured import StructuredOutputsParams

    load0 = os.getloadavg()[0]
    if mode == "score":
        llm = _engine(**engine_kwargs)
        outs, wall = _timed(llm, prompts, SamplingParams(score_choices=LABELS))
        gen = _engine(**engine_kwargs)
        g_outs, g_wall = _timed(gen, prompts, SamplingParams(
            temperature=0, max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(choice=LABELS)))
        agree = sum(a.outputs[0].text == b.outputs[0].text for a, b in zip(outs, g_outs))
        return {"mode": mode, "rows": len(prompts), "score_rows_per_s": len(prompts) / wall,
                "generate_rows_per_s": len(prompts) / g_wall, "ratio": g_wall / wall,
                "labels_agree": agree, "load_before": load0, "load_after": os.getloadavg()[0]}
    so = StructuredOutputsParams(choice=LABELS) if mode == "choice" else StructuredOutputsParams(json=JSON_SCHEMA)
    llm = _engine(**engine_kwargs)
    st0 = llm.stats.num_steps
    ss = llm.structured.stats
    fill0, wait0, steps0, comp0 = ss.fill_s, ss.wait_s, ss.steps, ss.compile_s
    forced0 = llm.stats.structured_forced_tokens
    outs, wall = _timed(llm, prompts, SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=so))
    lens = [len(o.outputs[0].token_ids) for o in outs]
    fill, wait, mask_steps = ss.fill_s - fill0, ss.wait_s - wait0, ss.steps - steps0
    steps = llm.stats.num_steps - st0
    free = _engine(**engine_kwargs)
    fs0 = free.stats.num_steps
    f_outs, f_wall = _timed(free, prompts, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                                            for n in lens])
    f_tokens = sum(len(o.outputs[0].token_ids) for o in f_outs)
    tokens = sum(lens)
    return {
        "mode": mode, "rows": len(prompts), "output_tokens": tokens, "unconstrained_output_tokens": f_tokens,
        "constrained_tok_s": tokens / wall, "unconstrained_tok_s": f_tokens / f_wall,
        "ratio": (tokens / wall) / (f_tokens / f_wall), "constrained_wall_s": wall, "unconstrained_wall_s": f_wall,
        "valid_rows": sum(bool(o.outputs[0].valid) for o in outs), "steps": steps,
        "mask_fill_ms_per_step": 1e3 * fill / max(mask_steps, 1), "mask_wait_ms_per_step": 1e3 * wait / max(mask_steps, 1),
        "fill_hidden_share": 1.0 - min(wait / fill, 1.0) if fill > 0 else 1.0,
        "forced_tokens": llm.stats.structured_forced_tokens - forced0, "compile_s": ss.compile_s - comp0,
        "unconstrained_steps": free.stats.num_steps - fs0,
        "load_before": load0, "load_after": os.getloadavg()[0],
    }


def format_result(r: dict) -> str:
    if r["mode"] == "score":
        return (f"score  : {r['rows']} rows, scoring {r['score_rows_per_s']:.2f} rows/s vs generating the label "
                f"{r['generate_rows_per_s']:.2f} rows/s ({r['ratio']:.2f}x); labels agree on {r['labels_agree']}; "
                f"load {r['load_before']:.2f} -> {r['load_after']:.2f}")
    return (f"{r['mode']:7}: {r['rows']} rows, {r['output_tokens']} tokens ({r['forced_tokens']} forced), "
            f"valid {r['valid_rows']}, steps {r['steps']} vs {r.get('unconstrained_steps', '?')}; constrained {r['constrained_tok_s']:.1f} vs unconstrained "
            f"{r['unconstrained_tok_s']:.1f} output tok/s = {r['ratio']:.2f}x; mask fill "
            f"{r['mask_fill_ms_per_step']:.3f} ms/step, compile {1e3 * r.get('compile_s', 0.0):.0f} ms, waited {r['mask_wait_ms_per_step']:.3f} ms/step "
            f"({100 * r['fill_hidden_share']:.0f}% hidden by the forward); load {r['load_before']:.2f} -> "
            f"{r['load_after']:.2f}")


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.structured", description=__doc__.split("\n\n")[0])
    p.add_argument("--structured", default="choice,json,score", help="comma list of choice|json|score")
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--speculative", default="off", help="the engines' speculative mode (default off)")
    p.add_argument("--output-json", type=Path, default=None)
    record.add_arguments(p)
    args = p.parse_args(argv)
    from benchmarks.workloads import build_labelling
    from engine.tokenizer import Tokenizer

    wl = build_labelling(Tokenizer.default(), args.num_prompts, args.seed)
    kw = {"speculative": None if args.speculative in ("off", "none") else args.speculative}
    results = []
    for mode in [m.strip() for m in args.structured.split(",") if m.strip()]:
        if mode not in ("choice", "json", "score"):
            p.error(f"--structured: unknown mode {mode!r} (choice|json|score)")
        r = run_mode(mode, wl.prompt_token_ids, kw, args.max_tokens)
        print(format_result(r), flush=True)
        results.append(r)
    record.write(record.output_path(args, "structured"), {"rows": results}, "structured")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
