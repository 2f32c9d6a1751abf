"""How close tokenmill gets to this machine's limits: MFU, MBU, KV utilisation and a per-step breakdown.

Measured in one run, on the same machine state:

1. **Peak**: GFLOP/s of a large fp32 matmul (best of a few, ``--matmul-size``
   cube) and the bandwidth of a large copy (bytes read + written / s).
2. **MFU of the linear layers at large batch**: a prefill-heavy run (long
   prompts of real text, 1 output token, steps of ``max_num_batched_tokens``
   tokens). FLOPs of the linear layers = 2 x tokens x (q/k/v/o + MLP weights)
   + 2 x sampled rows x (LM head weights). Two figures: end to end (FLOPs /
   wall of the whole generate / peak) and linear-only (FLOPs / time spent in
   ``aten::linear`` as torch.profiler attributes it / peak).
3. **MBU of decode at batch 1**: one request; decode step time = (wall with N
   new tokens - wall with 1) / (N - 1); bytes read per step = all weights as
   stored + the K and V of the mean context; MBU = bytes / step time /
   measured copy bandwidth.
4. **KV cache utilisation**: the engine's mean over steps of used / allocated
   slots of running sequences (`EngineStats.kv_utilization`) on a batch run.
5. **Per-step breakdown** on a batch run of ``--batch`` (64) concurrent
   requests: the engine's own phase timers (schedule / model / sample /
   detokenize / other) with "model" split by torch.profiler into linear layers
   (``aten::linear``), attention (everything inside the attention backend's
   ``forward``, labelled here by wrapping that one bound method of this run's
   engine; the engine code is untouched) and other model ops (RMSNorm, RoPE,
   embedding, SiLU, residual adds).

Every figure is printed next to the machine load (load average and cores kept
busy by other processes), as in `benchmarks.hf_compare`.

Usage::

    python -m benchmarks.efficiency [--quick] [--batch 64] [--output-json F]
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # 2 spinning OpenMP threads collapse under contention

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Optional  # noqa: E402

import torch  # noqa: E402

from benchmarks.hf_compare import BusyMeter, _fmt_load, machine_load, warn_if_busy, write_json_report  # noqa: E402
from benchmarks.throughput import DEFAULT_MODEL, make_llm, stats_delta  # noqa: E402
from benchmarks.workloads import build_workload  # noqa: E402


# ----------------------------------------------------------------- machine peak
def peak_matmul_gflops(n: int = 2048, reps: int = 3) -> float:
    """Best GFLOP/s of an [n x n] @ [n x n] fp32 matmul (2 n^3 FLOPs)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best / 1e9


def peak_copy_gbps(mbytes: int = 256, reps: int = 5) -> float:
    """Best GB/s of a large fp32 copy, counting bytes read plus bytes written."""
    src = torch.randn(mbytes * (1 << 20) // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * 4 / best / 1e9


# ----------------------------------------------------------------- FLOPs and bytes
def linear_flops(model: Any, num_tokens: int, num_logit_rows: int) -> float:
    """FLOPs of every linear layer for a step of num_tokens tokens, num_logit_rows of them through the LM head."""
    per_token = head = 0
    for name, lin in model.linear_layers():
        n = lin.in_features * lin.out_features
        if name == "lm_head":
            head += n
        else:
            per_token += n
    return 2.0 * (num_tokens * per_token + num_logit_rows * head)


# ----------------------------------------------------------------- profiling
class _AttentionLabel:
    """Wrap one backend instance's `forward` in a profiler label (restored on exit; engine code untouched)."""

    def __init__(self, backend: Any, label: str = "tokenmill::attention") -> None:
        self.backend, self.label = backend, label

    def __enter__(self) -> "_AttentionLabel":
        orig = self.backend.forward
        label = self.label

        def forward(*a: Any, **k: Any) -> Any:
            with torch.profiler.record_function(label):
                return orig(*a, **k)

        self.backend.forward = forward
        return self

    def __exit__(self, *exc: Any) -> None:
        del self.backend.forward  # back to the class's method


def profile_split(llm: Any, prompts: list[list[int]], params: list[Any]) -> dict[str, Any]:
    """Run generate under torch.profiler; model time split into linear / attention / other model ops.

    Returns the engine's phase seconds of this run, and the profiler's
    seconds in aten::linear and in the attention backend.
    """
    from torch.profiler import ProfilerActivity, profile

    before = _copy_stats(llm)
    with _AttentionLabel(llm.runner.backend), profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
    st = stats_delta(before, llm.stats)
    linear_us = attn_us = 0.0
    top_ops: list[tuple[str, float]] = []
    for ev in prof.key_averages():
        if ev.key == "aten::linear":
            linear_us += ev.cpu_time_total
        elif ev.key == "tokenmill::attention":
            attn_us += ev.cpu_time_total
        if ev.key.startswith("aten::"):
            top_ops.append((ev.key, ev.self_cpu_time_total / 1e6))
    top_ops.sort(key=lambda x: -x[1])
    return {"wall_s": wall, "stats": st, "linear_s": linear_us / 1e6, "attention_s": attn_us / 1e6,
            "top_self_ops_s": top_ops[:8]}


def _copy_stats(llm: Any) -> Any:
    import copy

    return copy.copy(llm.stats)


def breakdown_table(prof: dict[str, Any]) -> dict[str, float]:
    """Fractions of loop time: linear, attention, other model ops, sampler, scheduler, detokenize, other Python."""
    st = prof["stats"]
    ph = st.breakdown()
    loop = max(st.time_total_s, 1e-9)
    linear = min(prof["linear_s"], ph["model"])
    attention = min(prof["attention_s"], ph["model"] - linear)
    return {
        "linear layers": linear / loop,
        "attention": attention / loop,
        "other model ops": max(0.0, ph["model"] - linear - attention) / loop,
        "sampler": ph["sample"] / loop,
        "scheduler": ph["schedule"] / loop,
        "detokenize + stop checks": ph["detokenize"] / loop,
        "other Python": ph["other"] / loop,
    }


# ----------------------------------------------------------------- main
def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.efficiency", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes (smoke run)")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--batch", type=int, default=None, help="concurrent requests of the breakdown run (64)")
    p.add_argument("--matmul-size", type=int, default=None, help="cube of the peak matmul (2048; quick 1024)")
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--output-json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    q = args.quick
    batch = args.batch or (16 if q else 64)
    report: dict[str, Any] = {"torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(), "quick": q}
    loads = {}

    def measure(tag: str) -> tuple[dict[str, Any], BusyMeter]:
        load = machine_load()
        loads[tag] = load
        print(f"[{tag}] {_fmt_load(load)}", flush=True)
        return load, BusyMeter().start()

    print(f"tokenmill efficiency: torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, {os.cpu_count()} CPUs", flush=True)

    # 1. peak
    _, m = measure("peak")
    n = args.matmul_size or (1024 if q else 2048)
    peak = peak_matmul_gflops(n)
    bw = peak_copy_gbps(128 if q else 256)
    report["peak"] = {"matmul_gflops": peak, "matmul_size": n, "copy_gbps": bw, "other_busy_during": m.stop()}
    print(f"peak: fp32 matmul {n}^3 {peak:.1f} GFLOP/s; copy {bw:.1f} GB/s (read + write)", flush=True)

    from engine import SamplingParams
    from engine.tokenizer import Tokenizer

    tok = Tokenizer.from_model(args.model)
    rnd = build_workload("random", tok, num_prompts=max(batch, 8), seed=0)

    # 2. MFU at large batch: prefill-heavy (long prompts, one output token each)
    llm = make_llm(args.model, max_num_seqs=batch, max_num_batched_tokens=args.max_num_batched_tokens,
                   enable_prefix_caching=False)
    model = llm.model
    nprompt = 4 if q else 16
    prompts = [p for p in sorted(rnd.prompt_token_ids, key=len, reverse=True)][:nprompt]
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate([prompts[0][:64][::-1]], one, use_tqdm=False)  # warm-up
    _, m = measure("mfu")
    prof = profile_split(llm, prompts, [one] * len(prompts))
    tokens = sum(map(len, prompts))
    flops = linear_flops(model, tokens, len(prompts))
    st = prof["stats"]
    mfu = {"tokens": tokens, "steps": st.num_steps, "mean_batched_tokens": st.mean_batched_tokens,
           "wall_s": prof["wall_s"], "linear_s": prof["linear_s"],
           "linear_gflops": flops / max(prof["linear_s"], 1e-9) / 1e9,
           "mfu_linear": flops / max(prof["linear_s"], 1e-9) / 1e9 / peak,
           "mfu_end_to_end": flops / prof["wall_s"] / 1e9 / peak, "other_busy_during": m.stop()}
    report["mfu"] = mfu
    print(f"MFU at large batch ({tokens} prompt tokens, {st.mean_batched_tokens:.0f} tokens/step): linear layers "
          f"{mfu['linear_gflops']:.1f} GFLOP/s = {100 * mfu['mfu_linear']:.0f}% of peak; end to end "
          f"{100 * mfu['mfu_end_to_end']:.0f}% (linear FLOPs / whole wall)", flush=True)
    if mfu["mfu_linear"] > 1.0:
        print("  (over 100%: the peak was measured while other processes took more of the CPU than during this "
              "run; compare figures only from a quiet machine)", flush=True)

    # 3. MBU of decode at batch 1
    llm1 = make_llm(args.model, max_num_seqs=1, enable_prefix_caching=False)
    ndec = 16 if q else 64
    prompt = rnd.prompt_token_ids[0][:32]
    llm1.generate([prompt[::-1]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    _, m = measure("mbu")
    walls = {}
    for k in (1, ndec):
        best = float("inf")
        for _ in range(2):
            t0 = time.perf_counter()
            llm1.generate([prompt], SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True), use_tqdm=False)
            best = min(best, time.perf_counter() - t0)
        walls[k] = best
    step = (walls[ndec] - walls[1]) / (ndec - 1)
    mean_ctx = len(prompt) + ndec / 2
    kv_bytes = llm1.model_config.kv_bytes_per_token(llm1.dtype.itemsize) * mean_ctx
    wbytes = model.weight_bytes()
    mbu = {"decode_step_s": step, "decode_tok_s": 1 / step, "weight_bytes": wbytes, "kv_bytes": kv_bytes,
           "achieved_gbps": (wbytes + kv_bytes) / step / 1e9, "mbu": (wbytes + kv_bytes) / step / 1e9 / bw,
           "other_busy_during": m.stop()}
    report["mbu"] = mbu
    print(f"MBU of decode at batch 1: {1e3 * step:.1f} ms/step ({1 / step:.1f} tok/s), reads "
          f"{wbytes / 1e6:.0f} MB weights + {kv_bytes / 1e6:.1f} MB KV -> {mbu['achieved_gbps']:.1f} GB/s = "
          f"{100 * mbu['mbu']:.0f}% of the measured copy bandwidth", flush=True)

    # 4 + 5. batch run: KV utilisation and the per-step breakdown
    llmb = make_llm(args.model, max_num_seqs=batch, max_num_batched_tokens=args.max_num_batched_tokens)
    nout = 16 if q else 64
    params = [SamplingParams(temperature=0.0, max_tokens=nout, ignore_eos=True)] * batch
    llmb.generate([rnd.prompt_token_ids[0][:64][::-1]], params[0], use_tqdm=False)
    _, m = measure("breakdown")
    prof = profile_split(llmb, rnd.prompt_token_ids[:batch], params)
    st = prof["stats"]
    split = breakdown_table(prof)
    report["kv"] = {"kv_utilization": st.kv_utilization, "waste": 1 - st.kv_utilization,
                    "block_size": llmb.config.block_size}
    report["breakdown"] = {"batch": batch, "output_tokens_each": nout, "steps": st.num_steps,
                           "mean_batched_tokens": st.mean_batched_tokens, "loop_s": st.time_total_s,
                           "wall_s": prof["wall_s"], "fractions": split, "top_self_ops_s": prof["top_self_ops_s"],
                           "other_busy_during": m.stop()}
    print(f"KV cache utilisation (batch {batch}): {100 * st.kv_utilization:.1f}% of allocated slots used "
          f"({100 * (1 - st.kv_utilization):.1f}% waste; block size {llmb.config.block_size})")
    print(f"per-step breakdown, batch {batch}, {nout} output tokens each ({st.num_steps} steps, "
          f"{st.mean_batched_tokens:.0f} tokens/step, {1e3 * st.time_total_s / max(st.num_steps, 1):.1f} ms/step, "
          "under torch.profiler):")
    for k, v in split.items():
        print(f"  {k:<26} {100 * v:5.1f}%")
    print("  top aten ops by self time: " + ", ".join(f"{k} {s:.2f}s" for k, s in prof["top_self_ops_s"][:6]))

    busy = [loads[k]["other_busy_cores"] or 0.0 for k in loads]
    busy += [x.get("other_busy_during") or 0.0 for x in (report["peak"], mfu, mbu, report["breakdown"])]
    report["machine_load"] = loads
    report["max_other_busy_cores"] = max(busy)
    print(f"machine at end: {_fmt_load(machine_load())}")
    warn_if_busy(max(busy), "peak and engine figures move differently under contention")
    write_json_report(args.output_json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
