"""Offline throughput of tokenmill against transformers and llama.cpp, one run, same model and prompts.

For each workload (see `benchmarks.workloads`: labelling, synthetic, random)
every engine gets the same prompt token ids and generates exactly the same
number of tokens per request (EOS ignored):

- ``tokenmill``: ``LLM(model, **engine kwargs).generate(token ids, per-request
  SamplingParams)``, continuous batching over all requests, prefix caching on
  (the default).
- ``hf``: ``transformers`` ``generate`` on the same GGUF dequantized to fp32
  (the fastest dtype on this CPU: bf16 matmuls are far slower here), static
  batches of ``--hf-batch-size`` (32) requests in input order, left-padded,
  ``min_new_tokens = max_new_tokens`` = the longest output of the batch (static
  batching generates that many for every row; only the requested tokens are
  counted as output).
- ``llamacpp``: ``llama-cpp-python`` on the same GGUF (Q4_1), one request after
  another, when it is installed (``pip install '.[bench]'``); skipped with a
  message otherwise.

Only generation is timed (after a short warm-up); model loading is reported
apart. Before and during each measurement the machine load is recorded (the
load average and the cores other processes kept busy, as in
`benchmarks.hf_compare`): on this 2-core machine any other load slows every
engine a lot, so trust a figure only when those are near 0.

Usage::

    python -m benchmarks.throughput --workload labelling|synthetic|random|all
        [--engines tokenmill,hf,llamacpp] [--num-prompts N] [--quick] [--seed 0]
        [--max-num-seqs 128] [--max-num-batched-tokens 1024] [--hf-batch-size 32]
        [--quantization int8|int4|gguf] [--kv-cache-dtype auto|int8]
        [--wait-quiet SECONDS] [--output-json F]

Prints one table per workload: requests/s, input, output and total tokens/s,
and the ratio of tokenmill to each peer (output tokens/s).
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # 2 spinning OpenMP threads collapse under contention

import argparse  # noqa: E402
import copy  # noqa: E402
import dataclasses  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Optional  # noqa: E402

import torch  # noqa: E402

from benchmarks.hf_compare import (  # noqa: E402
    BusyMeter, _fmt_load, machine_load, wait_for_quiet, warn_if_busy, write_json_report,
)
from benchmarks.workloads import Workload, build_workload, parse_workloads  # noqa: E402

DEFAULT_MODEL = "smollm2-135m-instruct"
ENGINES = ("tokenmill", "hf", "llamacpp")


# ----------------------------------------------------------------- result helpers
def rates(wl: Workload, wall_s: float, output_tokens: int) -> dict[str, float]:
    """requests/s, input, output and total tokens/s of a run that took wall_s."""
    w = max(wall_s, 1e-9)
    return {"requests_per_s": wl.num_requests / w, "input_tok_s": wl.num_input_tokens / w,
            "output_tok_s": output_tokens / w, "total_tok_s": (wl.num_input_tokens + output_tokens) / w}


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = min(len(s) - 1, max(0, round(q * (len(s) - 1))))
    return s[k]


# ----------------------------------------------------------------- tokenmill
def stats_delta(before: Any, after: Any) -> Any:
    """EngineStats of the work between two snapshots (every field is a cumulative number)."""
    return type(after)(**{f.name: getattr(after, f.name) - getattr(before, f.name)
                          for f in dataclasses.fields(after)})


def make_llm(model: str = DEFAULT_MODEL, **engine_kwargs: Any) -> Any:
    """A fresh `LLM` (weights are shared per process, so this is cheap after the first)."""
    from engine import LLM

    return LLM(model, **engine_kwargs)


def run_tokenmill(llm: Any, wl: Workload, warmup: bool = True) -> dict[str, Any]:
    """Time `llm.generate` over the workload; counts, rates, latencies and the engine's step breakdown.

    Returns a dict with wall_s, output_tokens, cached_tokens, per-request
    latency / TTFT / TPOT percentiles, and `stats` (steps, preemptions, KV
    utilisation, phase seconds) of this run only.
    Raises:
        RuntimeError: an output came back as an error.
    """
    from engine import SamplingParams

    if warmup:
        # reversed text: no prefix-cache block of the warm-up can serve a measured prompt
        llm.generate([wl.prompt_token_ids[0][:32][::-1]], SamplingParams(temperature=0.0, max_tokens=4,
                                                                         ignore_eos=True), use_tqdm=False)
    before = copy.copy(llm.stats)
    t0 = time.perf_counter()
    outs = llm.generate(wl.prompt_token_ids, wl.sampling_params(), use_tqdm=False)
    wall = time.perf_counter() - t0
    bad = [o.error or o.outputs[0].error for o in outs if o.outputs[0].finish_reason == "error"]
    if bad:
        raise RuntimeError(f"tokenmill returned {len(bad)} error outputs, e.g. {bad[0]}")
    out_tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    lat, ttft, tpot = [], [], []
    for o in outs:
        m = o.metrics
        if m is None or m.finish_time is None:
            continue
        lat.append(m.finish_time - m.arrival_time)
        if m.first_token_time is not None:
            ttft.append(m.first_token_time - m.arrival_time)
            n = len(o.outputs[0].token_ids)
            if n > 1:
                tpot.append((m.finish_time - m.first_token_time) / (n - 1))
    st = stats_delta(before, llm.stats)
    return {
        "wall_s": wall, "output_tokens": out_tokens, "requests": len(outs),
        "cached_tokens": sum(o.num_cached_tokens for o in outs),
        "latency_p50_s": _pct(lat, 0.5), "latency_p95_s": _pct(lat, 0.95),
        "ttft_p50_s": _pct(ttft, 0.5), "tpot_mean_s": statistics.fmean(tpot) if tpot else float("nan"),
        "stats": {"steps": st.num_steps, "preemptions": st.num_preemptions,
                  "prompt_tokens_computed": st.num_prompt_tokens_computed,
                  "mean_batched_tokens": st.mean_batched_tokens, "kv_utilization": st.kv_utilization,
                  "time_s": st.breakdown(), "loop_s": st.time_total_s},
    }


# ----------------------------------------------------------------- transformers
def load_hf_model() -> Any:
    """transformers' Llama from the default GGUF, dequantized to fp32."""
    from transformers import AutoModelForCausalLM

    from engine.weights import default_gguf_path

    gguf = Path(default_gguf_path())
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    return model.eval()


def run_hf(model: Any, wl: Workload, batch_size: int = 32, warmup: bool = True) -> dict[str, Any]:
    """transformers generate in static, left-padded batches of `batch_size`, in input order.

    Each batch generates max(output_lens of the batch) tokens for every row
    (min_new_tokens = max_new_tokens); `output_tokens` counts the requested
    ones, `generated_tokens` all of them.
    """
    pad_id = model.generation_config.pad_token_id
    pad_id = 0 if pad_id is None else pad_id

    def batch_generate(batch: list[list[int]], n: int, seed: int) -> int:
        width = max(map(len, batch))
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, p in enumerate(batch):
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        kw: dict[str, Any] = {"do_sample": False}
        if wl.temperature > 0:
            torch.manual_seed(seed)
            kw = {"do_sample": True, "temperature": wl.temperature, "top_p": 1.0, "top_k": 0}
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                 pad_token_id=pad_id, **kw)
        return int(out[:, width:].numel())

    if warmup:
        batch_generate([wl.prompt_token_ids[0][:32]], 4, 0)
    t0 = time.perf_counter()
    generated = 0
    for i in range(0, wl.num_requests, batch_size):
        outs = wl.output_lens[i:i + batch_size]
        generated += batch_generate(wl.prompt_token_ids[i:i + batch_size], max(outs), wl.request_seed(i))
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "output_tokens": wl.num_output_tokens, "generated_tokens": generated,
            "requests": wl.num_requests}


# ----------------------------------------------------------------- llama.cpp
def llamacpp_available() -> Optional[str]:
    """None if llama-cpp-python imports, else the reason it does not."""
    try:
        import llama_cpp  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means "skip"
        return f"{type(e).__name__}: {e}"
    return None


def load_llamacpp(n_ctx: int, threads: int) -> Any:
    from llama_cpp import Llama

    from engine.weights import default_gguf_path

    return Llama(model_path=default_gguf_path(), n_ctx=n_ctx, n_threads=threads, n_batch=512, verbose=False)


def run_llamacpp(llm: Any, wl: Workload) -> dict[str, Any]:
    """One request after another through llama.cpp's token generator (EOS ignored: we stop on count).

    llama-cpp-python keeps the previous request's KV for a common prefix, so
    the labelling workload's shared instruction is reused as a prefix cache.
    """
    def one(prompt: list[int], n: int, seed: int) -> int:
        if wl.temperature > 0:
            llm.set_seed(seed)
        got = 0
        for _tok in llm.generate(prompt, temp=wl.temperature, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0,
                                 reset=True):
            got += 1
            if got >= n:
                break
        return got

    one(wl.prompt_token_ids[0][:32], 4, 0)  # warm-up
    t0 = time.perf_counter()
    out = sum(one(p, n, wl.request_seed(i)) for i, (p, n) in enumerate(zip(wl.prompt_token_ids, wl.output_lens)))
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "output_tokens": out, "requests": wl.num_requests}


# ----------------------------------------------------------------- table
def format_table(name: str, wl: Workload, results: dict[str, dict[str, Any]]) -> str:
    """The per-workload table: rates, load around each measurement, and ratios of tokenmill to each peer."""
    def cores(x: Optional[float]) -> str:
        return "n/a" if x is None else f"{x:.2f}"

    lines = [f"== {name}: {wl.summary()}",
             f"{'engine':<10} {'wall s':>8} {'req/s':>7} {'in tok/s':>9} {'out tok/s':>9} {'total tok/s':>11} "
             f"{'load 1m':>7} {'busy before':>11} {'busy during':>11}"]
    for eng, r in results.items():
        lines.append(f"{eng:<10} {r['wall_s']:>8.1f} {r['requests_per_s']:>7.2f} {r['input_tok_s']:>9.1f} "
                     f"{r['output_tok_s']:>9.1f} {r['total_tok_s']:>11.1f} {r['machine_load']['loadavg_1m']:>7.2f} "
                     f"{cores(r['machine_load']['other_busy_cores']):>11} {cores(r['other_busy_during']):>11}")
    tm = results.get("tokenmill")
    if tm:
        for eng, r in results.items():
            if eng != "tokenmill":
                lines.append(f"ratio tokenmill / {eng}: output tok/s {tm['output_tok_s'] / r['output_tok_s']:.2f}x, "
                             f"total tok/s {tm['total_tok_s'] / r['total_tok_s']:.2f}x")
        st = tm.get("stats")
        if st:
            t = st["time_s"]
            loop = max(st["loop_s"], 1e-9)
            split = ", ".join(f"{k} {100 * v / loop:.0f}%" for k, v in t.items())
            lines.append(f"tokenmill: {st['steps']} steps, {st['mean_batched_tokens']:.0f} tokens/step, "
                         f"{tm['cached_tokens']} cached prompt tokens, {st['preemptions']} preemptions, KV utilisation "
                         f"{100 * st['kv_utilization']:.1f}%; step time: {split}")
    return "\n".join(lines)


# ----------------------------------------------------------------- main
def parse_engines(spec: str) -> list[str]:
    names = [s.strip() for s in spec.split(",") if s.strip()]
    bad = [n for n in names if n not in ENGINES]
    if bad or not names:
        raise ValueError(f"unknown engine(s) {bad}; choose from {list(ENGINES)}")
    return names


def run_benchmark(workloads: list[Workload], engines: list[str], engine_kwargs: dict[str, Any],
                  hf_batch_size: int = 32, wait_quiet_s: float = 0.0, model: str = DEFAULT_MODEL,
                  log: Any = print) -> dict[str, Any]:
    """Run every engine on every workload; returns {"workloads": {name: {...}}, "skipped": {...}}.

    Each engine result has wall_s, output_tokens, requests, the four rates, the
    machine load before (`machine_load`) and the cores other processes kept
    busy during (`other_busy_during`).
    """
    skipped: dict[str, str] = {}
    peers: dict[str, Any] = {}
    load_s: dict[str, float] = {}
    if "hf" in engines:
        t0 = time.perf_counter()
        peers["hf"] = load_hf_model()
        load_s["hf"] = time.perf_counter() - t0
    if "llamacpp" in engines:
        why = llamacpp_available()
        if why is not None:
            skipped["llamacpp"] = f"llama-cpp-python is not installed ({why}); pip install '.[bench]' to compare"
            log(f"skipping llamacpp: {skipped['llamacpp']}")
        else:
            t0 = time.perf_counter()
            ctx = max(len(p) + n for p, n in ((p, n) for w in workloads
                                               for p, n in zip(w.prompt_token_ids, w.output_lens)))
            peers["llamacpp"] = load_llamacpp(ctx + 16, torch.get_num_threads())
            load_s["llamacpp"] = time.perf_counter() - t0
    report: dict[str, Any] = {"workloads": {}, "skipped": skipped, "model_load_s": load_s}
    for wl in workloads:
        results: dict[str, dict[str, Any]] = {}
        for eng in engines:
            if eng in skipped:
                continue
            load = wait_for_quiet(wait_quiet_s)
            log(f"[{wl.name}] {eng}: {_fmt_load(load)}")
            meter = BusyMeter().start()
            if eng == "tokenmill":
                t0 = time.perf_counter()
                llm = make_llm(model, **engine_kwargs)
                load_s.setdefault("tokenmill", time.perf_counter() - t0)
                r = run_tokenmill(llm, wl)
                del llm
            elif eng == "hf":
                r = run_hf(peers["hf"], wl, hf_batch_size)
            else:
                r = run_llamacpp(peers["llamacpp"], wl)
            r["other_busy_during"] = meter.stop()
            r["machine_load"] = load
            r.update(rates(wl, r["wall_s"], r["output_tokens"]))
            log(f"[{wl.name}] {eng}: {r['wall_s']:.1f} s, {r['output_tok_s']:.1f} output tok/s")
            results[eng] = r
        ratios = {}
        if "tokenmill" in results:
            for eng, r in results.items():
                if eng != "tokenmill":
                    ratios[eng] = results["tokenmill"]["output_tok_s"] / r["output_tok_s"]
        report["workloads"][wl.name] = {
            "summary": wl.summary(), "num_requests": wl.num_requests, "input_tokens": wl.num_input_tokens,
            "output_tokens": wl.num_output_tokens, "shared_prefix_tokens": wl.shared_prefix_tokens,
            "results": results, "ratio_output_tok_s": ratios}
    return report


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.throughput", description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="all", help="labelling|synthetic|random|all, or a comma list")
    p.add_argument("--engines", default="tokenmill,hf,llamacpp", help="comma list of tokenmill,hf,llamacpp")
    p.add_argument("--num-prompts", type=int, default=None, help="requests per workload (default per workload)")
    p.add_argument("--quick", action="store_true", help="few prompts, outputs capped at 32 tokens (smoke run)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--quantization", default=None, help="tokenmill's weights: int8|int4|gguf (default: as loaded)")
    p.add_argument("--kv-cache-dtype", default="auto", help="tokenmill's KV cache: auto|int8")
    p.add_argument("--hf-batch-size", type=int, default=32)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    p.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                   help="before each measurement wait up to this long for other processes to go quiet")
    p.add_argument("--output-json", type=Path, default=None)
    args = p.parse_args(argv)
    try:
        names = parse_workloads(args.workload)
        engines = parse_engines(args.engines)
    except ValueError as e:
        p.error(str(e))
    if args.threads:
        torch.set_num_threads(args.threads)
    from engine.tokenizer import Tokenizer

    print(f"tokenmill throughput: torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs", flush=True)
    start_load = machine_load()
    print(f"machine at start: {_fmt_load(start_load)}", flush=True)
    tok = Tokenizer.from_model(args.model)
    workloads = [build_workload(n, tok, args.num_prompts, args.seed, quick=args.quick) for n in names]
    for w in workloads:
        print(w.summary(), flush=True)
    engine_kwargs = {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
                     "enable_prefix_caching": not args.no_prefix_caching, "quantization": args.quantization,
                     "kv_cache_dtype": args.kv_cache_dtype}
    report = run_benchmark(workloads, engines, engine_kwargs, args.hf_batch_size, args.wait_quiet, args.model,
                           log=lambda s: print(s, flush=True))
    print()
    for w in workloads:
        print(format_table(w.name, w, report["workloads"][w.name]["results"]))
        print()
    for eng, why in report["skipped"].items():
        print(f"{eng}: skipped ({why})")
    busiest = max([max(r["machine_load"]["other_busy_cores"] or 0.0, r["other_busy_during"] or 0.0)
                   for wr in report["workloads"].values() for r in wr["results"].values()] or [0.0])
    print("(busy before/during: cores of this machine kept busy by other processes; 'load 1m' is os.getloadavg)")
    warn_if_busy(busiest)
    report.update(machine_load_start=start_load, machine_load_end=machine_load(), max_other_busy_cores=busiest,
                  torch=torch.__version__, torch_threads=torch.get_num_threads(), cpu_count=os.cpu_count(),
                  model=args.model, engine_kwargs=engine_kwargs, hf_batch_size=args.hf_batch_size,
                  quick=args.quick, seed=args.seed)
    write_json_report(args.output_json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
