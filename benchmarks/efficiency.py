"""How close tokenmill gets to this machine's limits: linear layers per batch size, MFU end to end,
the non-linear share of a decode step, MBU at batch 1, KV utilisation.

Measured in one run, on the same machine state:

1. **Peak** (GFLOP/s): the best of a large `torch.mm` (``--matmul-size`` cube) in the engine's
   weights dtype (fp32, or bf16: oneDNN on AMX / AVX512-BF16), tokenmill's own linear kernel of that
   dtype on the same cube, and every linear-layer rate measured in section 2:
   a peak below what a kernel reaches in the same run would be a wrong peak (an MFU over
   100%). **Bandwidth**: a large copy, bytes read + written / s.
2. **Linear layers per M**: every linear layer of the model (the 120 decoder projections and
   the LM head) run once on an [M, in] input, for M in 1, 8, 32, 64, 128, 256, 1024, each into the one
   output buffer of its width (as the engine's step reuses its scratch; until 2026-12-03 every
   layer had an output tensor of its own, whose first-touch stores cost our kernel 10-15% at
   M = 128-1024 on a Xeon): GFLOP/s and
   its share of the peak; for M = 1 and 8 also the weight bytes streamed per second against
   the copy bandwidth (at small M a step is bound by reading the weights: the bandwidth
   bound is 2 M params / (weight bytes / bandwidth) FLOP/s); for larger M the roofline,
   min(peak, that bound at the best read rate of the run), and the share of it reached.
3. **End to end** on the ``in99-out64`` workload (64 prompts of about 99 tokens, 64 new tokens
   each, greedy, EOS ignored): linear FLOPs of the tokens run (2 x tokens x decoder weights
   + 2 x sampled rows x LM head) / wall / peak.
4. **Decode-step breakdown** at batch ``--batch`` (64): the wall time of decode-only steps split
   into linear layers, attention, the other model ops (embedding, RMSNorm, RoPE, SiLU x up,
   final norm), sampling, scheduling, input preparation and the rest of the loop. Timers
   wrap this run's engine objects from outside (the engine's code is untouched); the
   non-linear share is everything but the linear layers. This run uses the Python layer
   loop, not the C decoder driver, whose one call per step would hide the boundaries; a
   second run of the same shape with the driver times its decode-only steps, and its
   non-linear share is its step time less the loop run's linear-layer time.
5. **MBU of decode at batch 1**: step time = (wall with N new tokens - wall with 1) / (N - 1);
   bytes per step = weights read per decode step + the KV of the mean context;
   MBU = bytes / step time / copy bandwidth. For each of ``--schemes``.
6. **KV cache utilisation** of the batch run.
7. **Prefill-step breakdown**: one prompt of ``--prefill-tokens`` (4096) tokens in one step (the
   token budget raised to hold it), split as the decode step is.

Speculative decoding is off in every engine here: the figures are of plain steps.

Every figure is printed next to the machine load (load average and cores kept busy by
other processes), as in `benchmarks.hf_compare`.

Usage::

    python -m benchmarks.efficiency [--quick] [--batch 64] [--schemes fp32,bf16,int8,gguf,w8a8]
                                    [--dtype auto|float32|bfloat16] [--prefill-tokens 4096]
                                    [--kv-cache-dtype auto|fp16|fp32|bf16|int8] [--output-json F]

The host (`engine.host`) is printed first: every figure is read beside the CPU it ran on.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # 2 spinning OpenMP threads collapse under contention

import argparse  # noqa: E402
import collections  # noqa: E402
import copy  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable, Optional  # noqa: E402

import torch  # noqa: E402

from benchmarks import record  # noqa: E402
from benchmarks.hf_compare import BusyMeter, _fmt_load, machine_load, warn_if_busy, write_json_report  # noqa: E402
from benchmarks.throughput import DEFAULT_MODEL, make_llm, stats_delta  # noqa: E402
from benchmarks.workloads import build_workload  # noqa: E402

LINEAR_MS = (1, 8, 32, 64, 128, 256, 1024)
SCHEMES = {"fp32": {"dtype": "float32"}, "bf16": {"dtype": "bfloat16"}, "int8": {"quantization": "int8"}, "gguf": {"quantization": "gguf"},
           "int4": {"quantization": "int4"}, "w8a8": {"quantization": "w8a8"}}


# ----------------------------------------------------------------- machine peak
def best_time(fn: Callable[[], Any], reps: int) -> float:
    """The fastest of `reps` calls of fn, in seconds, after one untimed call."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def peak_matmul_gflops(n: int = 2048, reps: int = 3, dtype: torch.dtype = torch.float32) -> dict[str, float]:
    """GFLOP/s of an [n x n] @ [n x n] product (2 n^3 FLOPs) with `dtype` operands (fp32 or bf16):
    torch.mm, and tokenmill's linear kernel of that weight dtype (`engine.kernels.cpu`; bf16 weights
    take fp32 activations and round them in the call) where it builds."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    ad, bd = a.to(dtype), b.to(dtype)
    out = {"torch_mm": 2 * n ** 3 / best_time(lambda: torch.mm(ad, bd), reps) / 1e9}
    from engine.kernels import cpu

    if cpu.available():
        from engine.kernels.cpu.layers import CpuBf16Linear, CpuLinear

        lin, y = (CpuBf16Linear if dtype == torch.bfloat16 else CpuLinear)(b), torch.empty(n, n)
        out["tokenmill"] = 2 * n ** 3 / best_time(lambda: lin(a, out=y), reps) / 1e9
    return out


def peak_copy_gbps(mbytes: int = 256, reps: int = 5) -> float:
    """Best GB/s of a large fp32 copy, counting bytes read plus bytes written."""
    src = torch.randn(mbytes * (1 << 20) // 4)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / best_time(lambda: dst.copy_(src), reps) / 1e9


# ----------------------------------------------------------------- FLOPs and bytes
def linear_params(model: Any) -> tuple[int, int]:
    """(weights of the decoder's linear layers, weights of the LM head), as multiply-adds per token."""
    body = head = 0
    for name, lin in model.linear_layers():
        n = lin.in_features * lin.out_features
        if name == "lm_head":
            head += n
        else:
            body += n
    return body, head


def linear_flops(model: Any, num_tokens: int, num_logit_rows: int) -> float:
    """FLOPs of every linear layer for num_tokens tokens, num_logit_rows of them through the LM head."""
    body, head = linear_params(model)
    return 2.0 * (num_tokens * body + num_logit_rows * head)


def linear_sweep(model: Any, ms: tuple[int, ...] = LINEAR_MS, reps: int = 2) -> dict[int, dict[str, float]]:
    """Time all the model's linear layers on [M, in] inputs, for each M (weights as the engine holds
    them: for the decoder a different matrix each call, so small M streams them from memory; outputs,
    as in the engine's step, into one buffer per output width, written again by every layer of that
    width: the step's qkv, attention-output and MLP scratch, not 121 tensors never seen before)."""
    layers = [lin for _, lin in model.linear_layers()]
    wbytes = sum(lin.weight_bytes() for lin in layers)
    out = {}
    for m in ms:
        xs = {k: torch.randn(m, k) for k in {lin.in_features for lin in layers}}
        ys_by_width = {n: torch.empty(m, n) for n in {lin.out_features for lin in layers}}
        ys = [ys_by_width[lin.out_features] for lin in layers]

        def run() -> None:
            for lin, y in zip(layers, ys):
                lin(xs[lin.in_features], out=y)

        t = best_time(run, reps)
        flops = 2.0 * m * sum(lin.in_features * lin.out_features for lin in layers)
        out[m] = {"seconds": t, "gflops": flops / t / 1e9, "weight_gbps": wbytes / t / 1e9}
    return out


def torch_mm_sweep(model: Any, ms: tuple[int, ...] = LINEAR_MS, reps: int = 2,
                   dtype: torch.dtype = torch.float32) -> dict[int, float]:
    """GFLOP/s of torch.mm (MKL on this CPU build) over the same layer shapes and the same M, in
    the same order, each layer a different fp32 matrix of random values (the rate does not depend
    on them): the reference for the linear layers at each M. Both layouts are timed, [in, out]
    (x @ W) and [out, in] (x @ W^T, as nn.Linear holds it), and the faster is kept: on a 2-core
    Xeon [in, out] was 4-10% faster for M = 8-128 and [out, in] 27% faster at M = 1. With `dtype`
    bf16 the operands and outputs are bf16 (oneDNN's bf16 GEMM)."""
    shapes = [(lin.in_features, lin.out_features) for _, lin in model.linear_layers()]
    gen = torch.Generator().manual_seed(0)
    ws = [torch.randn(k, n, generator=gen).to(dtype) for k, n in shapes]
    out = {}
    for m in ms:
        xs = {k: torch.randn(m, k, generator=gen).to(dtype) for k, _ in shapes}
        ys_by_width = {n: torch.empty(m, n, dtype=dtype) for n in {n for _, n in shapes}}  # as linear_sweep's
        ys = [ys_by_width[n] for _, n in shapes]

        def run_in_out() -> None:
            for (k, _), w, y in zip(shapes, ws, ys):
                torch.mm(xs[k], w, out=y)

        def run_out_in() -> None:  # the same storage read as [out, in]
            for (k, n), w, y in zip(shapes, ws, ys):
                torch.mm(xs[k], w.view(n, k).t(), out=y)

        t = min(best_time(run_in_out, reps), best_time(run_out_in, reps))
        out[m] = 2.0 * m * sum(k * n for k, n in shapes) / t / 1e9
    return out


# ----------------------------------------------------------------- timers around one engine
class StepTimers:
    """Wall time per category, counted only in decode-only steps (when `decode_only`), by wrapping
    this engine's linear layers, attention backend, model ops, sampler, scheduler and runner.
    Instance attributes shadow the class methods; `close()` removes them.

    With `driver`, the model keeps the C decoder driver, whose own per-kernel counters
    (`engine.kernels.cpu.decoder.timings`, read around each step) give the layers' split, and the
    LM head, sampler, scheduler and input preparation are timed in Python as in the loop: the
    breakdown of the step the engine really runs, in one run."""

    def __init__(self, llm: Any, decode_only: bool = True, kernels: bool = True, driver: bool = False) -> None:
        self.t: dict[str, float] = collections.defaultdict(float)
        self.decode_only = decode_only
        self.in_decode_step = False
        self.steps = 0
        self._undo: list[tuple[Any, str]] = []
        self._sampler = None
        self._driver = None
        if driver:
            from engine.kernels.cpu import decoder as dec

            dec.set_timing(True)
            self._driver = dec
            self._wrap_outer(llm)
            self._wrap(llm.model.lm_head, "forward", "linear layers")
            if callable(getattr(llm.model.lm_head, "argmax", None)):  # greedy argmax in the head's GEMM
                self._wrap(llm.model.lm_head, "argmax", "linear layers")
        elif kernels:
            self._wrap_kernels(llm)
        run = llm.runner.run

        def run_step(inputs: Any, *a: Any, **k: Any) -> Any:
            self.in_decode_step = inputs.num_decodes == inputs.num_tokens
            return run(inputs, *a, **k)

        llm.runner.run = run_step
        self._undo.append((llm.runner, "run"))
        step = llm.core.step

        def timed_step() -> Any:
            c0 = self._driver.timings() if self._driver else None
            t0 = time.perf_counter()
            self.in_decode_step = False
            r = step()
            dt = time.perf_counter() - t0
            if self._driver and (self.in_decode_step or not self.decode_only):
                c1 = self._driver.timings()
                d = {k: c1[k] - c0[k] for k in c1}
                self.t["linear layers"] += d["linear layers"]
                self.t["attention"] += d["attention"]
                self.t["other model ops"] += d["kv write"] + d["rms norm"] + d["rope"] + d["silu mul"]
                for name in ("kv write", "rms norm", "rope", "silu mul"):
                    self.t["driver: " + name] += d[name]
                self.t["driver"] += sum(d.values())
            if self.in_decode_step or not self.decode_only:
                self.t["step"] += dt
                self.steps += 1
            else:  # a step with prefill: drop what it added
                for k in list(self._pending):
                    self.t[k] -= self._pending[k]
            self._pending.clear()
            return r

        self._pending: dict[str, float] = collections.defaultdict(float)
        llm.core.step = timed_step
        self._undo.append((llm.core, "step"))

    def _wrap_kernels(self, llm: Any) -> None:
        m = llm.model
        # the C decoder driver (engine.kernels.cpu.decoder) runs every layer in one call, which
        # would hide the kernel boundaries these timers need: the breakdown runs the Python layer
        # loop (the same kernels; it differs only by the dispatch the driver removes)
        m.use_c_decoder = False
        self._undo.append((m, "use_c_decoder"))
        for _, lin in m.linear_layers():
            self._wrap(lin, "forward", "linear layers")
            if callable(getattr(lin, "argmax", None)):
                self._wrap(lin, "argmax", "linear layers")
            if getattr(lin, "silu_fused", False):  # the gate/up GEMM with SwiGLU in its epilogue
                self._wrap(lin, "silu_mul", "linear layers")
        self._wrap(llm.backend, "forward", "attention")
        for name in ("rms_norm", "rope_", "silu_mul"):
            self._wrap(m.ops, name, "other model ops")
        self._wrap_outer(llm)

    def _wrap_outer(self, llm: Any) -> None:
        """The sampler, scheduler, input preparation and the model forward as a whole."""
        m = llm.model
        sampler = llm.sampler  # a call goes through the type's __call__: wrap the object itself

        class _TimedSampler:
            def __getattr__(_, name: str) -> Any:
                return getattr(sampler, name)

            def __call__(_, *a: Any, **k: Any) -> Any:
                t0 = time.perf_counter()
                r = sampler(*a, **k)
                dt = time.perf_counter() - t0
                self.t["sampler"] += dt
                self._pending["sampler"] += dt
                return r

        llm.core.sampler = _TimedSampler()
        self._sampler = (llm, sampler)
        self._wrap(llm.scheduler, "schedule", "scheduler")
        self._wrap(llm.runner, "prepare_scheduled", "input preparation")
        self._wrap(m, "forward", "model forward")

    def _wrap(self, obj: Any, attr: str, label: str) -> None:
        fn = getattr(obj, attr)

        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            r = fn(*a, **k)
            dt = time.perf_counter() - t0
            self.t[label] += dt
            self._pending[label] += dt
            return r

        setattr(obj, attr, timed)
        self._undo.append((obj, attr))

    def close(self) -> None:
        if self._driver is not None:
            self._driver.set_timing(False)
        if self._sampler is not None:
            llm, sampler = self._sampler
            llm.core.sampler = sampler
        for obj, attr in reversed(self._undo):
            try:
                delattr(obj, attr)
            except AttributeError:
                pass

    def fractions(self) -> dict[str, float]:
        """Shares of the counted steps' wall time; the model forward's remainder (embedding, final
        norm, buffers) joins "other model ops"."""
        t = self.t
        step = max(t["step"], 1e-12)
        inner = t["linear layers"] + t["attention"] + t["other model ops"]
        other_model = t["other model ops"] + max(0.0, t["model forward"] - inner)
        known = t["model forward"] + t["sampler"] + t["scheduler"] + t["input preparation"]
        out = {"linear layers": t["linear layers"], "attention": t["attention"], "other model ops": other_model,
               "sampler": t["sampler"], "scheduler": t["scheduler"], "input preparation": t["input preparation"],
               "rest of the loop (stop checks, detokenize, Python)": max(0.0, step - known)}
        return {k: v / step for k, v in out.items()}


# ----------------------------------------------------------------- main
def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.efficiency", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes (smoke run)")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--batch", type=int, default=None, help="concurrent requests of the breakdown run (64)")
    p.add_argument("--matmul-size", type=int, default=None, help="cube of the peak matmul (2048; quick 1024)")
    p.add_argument("--schemes", default="fp32,bf16,int8,gguf", help=f"MBU at batch 1 for these ({','.join(SCHEMES)})")
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--kv-cache-dtype", default="auto", help="KV cache of the end-to-end and breakdown runs: auto|fp16|fp32|bf16|int8")
    p.add_argument("--dtype", default="auto", help="weights of the end-to-end and breakdown runs: auto|float32|bfloat16")
    p.add_argument("--prefill-tokens", type=int, default=None, help="prompt of the prefill-step breakdown (4096)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--output-json", type=Path, default=None)
    record.add_arguments(p)
    args = p.parse_args(argv)
    schemes = [s.strip() for s in args.schemes.split(",") if s.strip()]
    bad = [s for s in schemes if s not in SCHEMES]
    if bad:
        p.error(f"unknown scheme(s) {bad}; choose from {list(SCHEMES)}")
    q = args.quick
    batch = args.batch or (16 if q else 64)
    report: dict[str, Any] = {"cpu_count": os.cpu_count(), "quick": q}
    loads: dict[str, Any] = {}
    busy_during: list[float] = []

    def measure(tag: str) -> BusyMeter:
        loads[tag] = machine_load()
        print(f"[{tag}] {_fmt_load(loads[tag])}", flush=True)
        return BusyMeter().start()

    def done(m: BusyMeter) -> float:
        b = m.stop()
        busy_during.append(b or 0.0)
        return b

    from engine import SamplingParams
    from engine.kernels import cpu
    from engine.tokenizer import Tokenizer

    # speculation off everywhere here: these figures are of plain steps (a verification step runs
    # more tokens per row, and the MBU runs repeat one prompt, whose output the job-wide suffix
    # proposer would learn and then draft whole)
    from engine.host import Host

    host = Host.current()
    print(f"host: {host.describe()}", flush=True)
    llm = make_llm(args.model, max_num_seqs=batch, max_num_batched_tokens=args.max_num_batched_tokens,
                   num_threads=args.threads, kv_cache_dtype=args.kv_cache_dtype, speculative=None, dtype=args.dtype)
    model = llm.model
    wdtype = llm.dtype  # the weights' dtype ("auto" resolved): the matmul peak is measured in it
    isa = cpu.isa() if cpu.available() else "none"
    print(f"tokenmill efficiency: torch {torch.__version__}, {torch.get_num_threads()} torch threads, "
          f"CPU kernels {isa} ({cpu.get_num_threads() if cpu.available() else 0} threads), "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, {os.cpu_count()} CPUs, weights "
          f"{str(wdtype).removeprefix('torch.')} (dtype={args.dtype}), KV cache "
          f"{args.kv_cache_dtype} ({llm.kv_bytes_per_token} bytes per token)", flush=True)
    report.update(torch_threads=torch.get_num_threads(), kernels_isa=isa, kv_bytes_per_token=llm.kv_bytes_per_token,
                  host=host.as_dict(), dtype=str(wdtype).removeprefix("torch."))

    # 1 + 2. peak and the linear layers per M
    m = measure("peak")
    n = args.matmul_size or (1024 if q else 2048)
    cube = peak_matmul_gflops(n, dtype=wdtype)
    bw = peak_copy_gbps(128 if q else 256)
    done(m)
    m = measure("linear")
    ms = (1, 8, 32, 64) if q else LINEAR_MS
    # the best of 5 passes per M (the peak is the best of 6 cubes): one pass at M = 32 lasts about 60 ms,
    # and with best of 2 a burst of other work on this shared host moved M = 32 between 65% and 87% of
    # the peak from one run to the next (2026-12-04, a 2-core Zen 3 VM)
    sweep = linear_sweep(model, ms, reps=5)
    mkl = torch_mm_sweep(model, ms, reps=5, dtype=wdtype)
    # the cube once more after the sweep, the best of the two kept: a burst of other work during one
    # measurement (torch.mm 2048^3 read 99 GFLOP/s once, against 366 in the next run) would lower the
    # peak and flatter every percentage below
    again = peak_matmul_gflops(n, dtype=wdtype)
    if any(abs(again[k] - cube[k]) > 0.2 * max(again[k], cube[k]) for k in cube):
        print(f"note: the {n}^3 product measured {', '.join(f'{k} {cube[k]:.0f} / {again[k]:.0f}' for k in cube)} "
              f"GFLOP/s before / after the sweep: the machine was busy during one of them; the best is used",
              flush=True)
    cube = {k: max(cube[k], again[k]) for k in cube}
    done(m)
    peak = max([*cube.values(), *(r["gflops"] for r in sweep.values()), *mkl.values()])
    report["peak"] = {"cube": cube, "matmul_size": n, "peak_gflops": peak, "copy_gbps": bw}
    print(f"peak: {n}^3 {str(wdtype).removeprefix('torch.')} product torch.mm {cube['torch_mm']:.0f} GFLOP/s, tokenmill "
          f"{cube.get('tokenmill', float('nan')):.0f}; peak used {peak:.0f} GFLOP/s (the best of everything measured "
          f"here); copy {bw:.1f} GB/s (read + write)", flush=True)
    body, head = linear_params(model)
    wbytes = sum(lin.weight_bytes() for _, lin in model.linear_layers())
    print(f"linear layers ({len(model.linear_layers())} of them, {(body + head) / 1e6:.1f} M weights, "
          f"{wbytes / 1e6:.0f} MB as held):")
    rows = {}
    # the fastest the weights were read in this run: the copy's read half, or a small-M sweep (which
    # can beat it where the last-level cache holds part of the weights between passes)
    best_read = max(bw / 2, max(r["weight_gbps"] for r in sweep.values()))
    for mm, r in sweep.items():
        line = f"  M={mm:<5} {r['gflops']:7.1f} GFLOP/s = {100 * r['gflops'] / peak:5.1f}% of peak"
        line += f" (torch.mm on the same shapes {mkl[mm]:6.1f}: {r['gflops'] / mkl[mm]:.2f}x)"
        row = {**r, "of_peak": r["gflops"] / peak, "torch_mm_gflops": mkl[mm]}
        if mm <= 8:
            bound = 2.0 * mm * (body + head) / (wbytes / (bw / 2 * 1e9)) / 1e9  # reads only: half the copy rate
            line += (f"; weights streamed at {r['weight_gbps']:.1f} GB/s = {100 * r['weight_gbps'] / (bw / 2):.0f}% "
                     f"of the copy's read rate ({bw / 2:.1f} GB/s); bandwidth bound {bound:.0f} GFLOP/s")
            row["bandwidth_bound_gflops"] = bound
        else:
            # the roofline (Williams, Waterman & Patterson 2009): 2 M FLOPs per weight read, at the best
            # read rate of the run, or the peak, whichever is lower
            bound = 2.0 * mm * (body + head) / (wbytes / (best_read * 1e9)) / 1e9
            roof = min(peak, bound)
            line += (f"; roofline {roof:.0f} ({'the peak' if roof == peak else 'reading the weights'}; weights "
                     f"read at {best_read:.1f} GB/s bound it at {bound:.0f}): {100 * r['gflops'] / roof:.0f}% of it")
            row["bandwidth_bound_gflops"], row["roofline_gflops"] = bound, roof
        rows[mm] = row
        print(line, flush=True)
    report["linear"] = rows

    # 3. end to end on the first workload
    tok = Tokenizer.from_model(args.model)
    wl = build_workload("in99-out64", tok, num_prompts=16 if q else None, seed=0,
                        max_output_tokens=16 if q else None)
    llm.generate([wl.prompt_token_ids[0][:32][::-1]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    m = measure("end-to-end")
    before = copy.copy(llm.stats)
    t0 = time.perf_counter()
    outs = llm.generate(wl.prompt_token_ids, wl.sampling_params(), use_tqdm=False)
    wall = time.perf_counter() - t0
    busy = done(m)
    st = stats_delta(before, llm.stats)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    tokens = st.num_prompt_tokens_computed + n_out  # every prompt token and each decode token once
    flops = linear_flops(model, tokens, n_out)
    e2e = {"workload": wl.summary(), "wall_s": wall, "tokens": tokens, "output_tokens": n_out,
           "output_tok_s": n_out / wall, "gflops": flops / wall / 1e9, "mfu": flops / wall / 1e9 / peak,
           "other_busy_during": busy}
    report["end_to_end"] = e2e
    print(f"end to end, {wl.summary()}: {wall:.2f} s, {n_out / wall:.0f} output tok/s, linear FLOPs at "
          f"{e2e['gflops']:.0f} GFLOP/s = {100 * e2e['mfu']:.0f}% of peak", flush=True)

    # 4 + 6. decode-step breakdown at batch `batch` and KV utilisation
    rnd = build_workload("in99-out64", tok, num_prompts=batch, seed=1, max_output_tokens=16 if q else None)
    timers = StepTimers(llm)
    m = measure("breakdown")
    before = copy.copy(llm.stats)
    try:
        llm.generate(rnd.prompt_token_ids, rnd.sampling_params(), use_tqdm=False)
    finally:
        timers.close()
    busy = done(m)
    st = stats_delta(before, llm.stats)
    split = timers.fractions()
    report["kv"] = {"kv_utilization": st.kv_utilization, "block_size": llm.config.block_size}
    step_ms = 1e3 * timers.t["step"] / max(timers.steps, 1)
    report["breakdown"] = {"batch": batch, "decode_steps": timers.steps, "ms_per_decode_step": step_ms,
                           "fractions": split, "non_linear": 1 - split["linear layers"], "other_busy_during": busy}
    print(f"KV cache utilisation (batch {batch}): {100 * st.kv_utilization:.1f}% of allocated slots used "
          f"(block size {llm.config.block_size})")
    print(f"decode-step breakdown, batch {batch} ({timers.steps} decode-only steps, {step_ms:.1f} ms each):")
    for k, v in split.items():
        print(f"  {k:<52} {100 * v:5.1f}%")
    print(f"  non-linear share (everything but the linear layers)   {100 * (1 - split['linear layers']):5.1f}%",
          flush=True)
    # the same workload (other prompts of the same shape) as the engine runs it, with the C decoder
    # driver: its own counters split the layers' time (linear, attention, small ops) inside the
    # driver, in the same run as the step times
    if llm.model.use_c_decoder:
        rnd2 = build_workload("in99-out64", tok, num_prompts=batch, seed=2, max_output_tokens=16 if q else None)
        m = measure("breakdown, C decoder driver")
        clock = StepTimers(llm, kernels=False, driver=True)
        try:
            llm.generate(rnd2.prompt_token_ids, rnd2.sampling_params(), use_tqdm=False)
        finally:
            clock.close()
        busy2 = done(m)
        drv_ms = 1e3 * clock.t["step"] / max(clock.steps, 1)
        if llm.model._c_decoder is not None and clock.steps and clock.t["driver"] > 0:
            dsplit = clock.fractions()
            share = 1 - dsplit["linear layers"]
            report["breakdown"]["c_decoder"] = {"decode_steps": clock.steps, "ms_per_decode_step": drv_ms,
                                                "fractions": dsplit, "non_linear": share,
                                                "other_busy_during": busy2}
            report["breakdown"]["non_linear_engine"] = share
            print(f"decode-step breakdown with the C decoder driver (the engine's path), batch {batch} "
                  f"({clock.steps} decode-only steps, {drv_ms:.1f} ms each; the driver's own kernel timers):")
            for k, v in dsplit.items():
                print(f"  {k:<52} {100 * v:5.1f}%")
            print(f"  non-linear share (everything but the linear layers)   {100 * share:5.1f}%", flush=True)
            small = {k[len("driver: "):]: 1e3 * v / clock.steps for k, v in clock.t.items() if k.startswith("driver: ")}
            report["breakdown"]["c_decoder"]["small_ops_ms"] = small
            print("  small ops inside the driver, ms per step: "
                  + ", ".join(f"{k} {v:.2f}" for k, v in small.items()), flush=True)
            # the floor set by memory: each decode step reads every running sequence's whole KV
            # cache (context tokens x bytes per token), at best at the fastest read rate seen here
            lens = [len(p) for p in rnd2.prompt_token_ids]
            kv_tokens = sum(n + j for n in lens for j in range(1, clock.steps + 1)) / clock.steps
            kv_mb = kv_tokens * llm.kv_bytes_per_token / 1e6
            read_gbps = max(bw / 2, max(r["weight_gbps"] for r in sweep.values()))
            floor_ms = kv_mb / read_gbps
            lin_ms = drv_ms * dsplit["linear layers"]
            floor_share = floor_ms / (floor_ms + lin_ms)
            report["breakdown"]["kv_floor"] = {"kv_mb_per_step": kv_mb, "read_gbps": read_gbps, "floor_ms": floor_ms,
                                               "attention_ms": drv_ms * dsplit["attention"],
                                               "non_linear_floor": floor_share}
            print(f"  attention reads about {kv_mb:.0f} MB of KV cache per step ({llm.kv_bytes_per_token} bytes per "
                  f"token): at the best read rate measured here ({read_gbps:.1f} GB/s) at least {floor_ms:.1f} ms "
                  f"(it took {drv_ms * dsplit['attention']:.1f}); with only that beside the linear layers' "
                  f"{lin_ms:.1f} ms, the non-linear share would be {100 * floor_share:.1f}%", flush=True)
        else:
            print("  (the C decoder driver did not serve these steps)", flush=True)

    # 7. one prefill step of a long prompt, split as the decode step is
    plen = args.prefill_tokens or (512 if q else 4096)
    pllm = make_llm(args.model, max_num_seqs=1, max_num_batched_tokens=plen, enable_prefix_caching=False,
                    num_threads=args.threads, kv_cache_dtype=args.kv_cache_dtype, speculative=None, dtype=args.dtype)
    if plen + 2 <= pllm.max_model_len:
        stream = [t for p in build_workload("random", tok, num_prompts=64, seed=3).prompt_token_ids for t in p]
        long_prompt = (stream * (plen // max(len(stream), 1) + 1))[:plen]
        pllm.generate([long_prompt[:64]], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        for label, use_driver in (("Python layer loop", False), ("C decoder driver", True)):
            if use_driver and not pllm.model.use_c_decoder:
                continue
            m = measure(f"prefill {plen}, {label}")
            ptimers = StepTimers(pllm, decode_only=False, kernels=not use_driver, driver=use_driver)
            try:
                pllm.generate([long_prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
            finally:
                ptimers.close()
            busy = done(m)
            psplit = ptimers.fractions()
            p_ms = 1e3 * ptimers.t["step"] / max(ptimers.steps, 1)
            report.setdefault("prefill", {})[label] = {"tokens": plen, "steps": ptimers.steps, "ms_per_step": p_ms,
                                                       "fractions": psplit, "non_linear": 1 - psplit["linear layers"],
                                                       "other_busy_during": busy}
            print(f"prefill-step breakdown, one prompt of {plen} tokens ({label}, {ptimers.steps} step(s), "
                  f"{p_ms:.0f} ms, {plen / p_ms * 1e3:.0f} prompt tok/s):")
            for k, v in psplit.items():
                print(f"  {k:<52} {100 * v:5.1f}%")
            print(f"  non-linear share (everything but the linear layers)   {100 * (1 - psplit['linear layers']):5.1f}%",
                  flush=True)
    del pllm

    # 5. MBU at batch 1, per scheme
    report["mbu"] = {}
    ndec = 16 if q else 64
    prompt = wl.prompt_token_ids[0][:32]
    for scheme in schemes:
        llm1 = make_llm(args.model, max_num_seqs=1, enable_prefix_caching=False, num_threads=args.threads,
                        speculative=None, **SCHEMES[scheme])
        llm1.generate([prompt[::-1]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        m = measure(f"mbu {scheme}")
        walls = {}
        for k in (1, ndec):
            walls[k] = best_time(lambda k=k: llm1.generate(
                [prompt], SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True), use_tqdm=False), 2)
        busy = done(m)
        step = (walls[ndec] - walls[1]) / (ndec - 1)
        from engine.quant import decode_weight_bytes

        kv_bytes = llm1.kv_bytes_per_token * (len(prompt) + ndec / 2)
        wb = decode_weight_bytes(llm1.model)
        r = {"decode_step_s": step, "decode_tok_s": 1 / step, "weight_bytes": wb, "kv_bytes": kv_bytes,
             "achieved_gbps": (wb + kv_bytes) / step / 1e9, "mbu": (wb + kv_bytes) / step / 1e9 / (bw / 2),
             "other_busy_during": busy}
        report["mbu"][scheme] = r
        print(f"MBU of decode at batch 1, {scheme}: {1e3 * step:.2f} ms/step ({1 / step:.0f} tok/s), reads "
              f"{wb / 1e6:.0f} MB weights + {kv_bytes / 1e6:.1f} MB KV -> {r['achieved_gbps']:.1f} GB/s = "
              f"{100 * r['mbu']:.0f}% of the copy's read rate", flush=True)
        del llm1

    report["machine_load"] = loads
    report["max_other_busy_cores"] = max([b for b in busy_during] + [
        (ld.get("other_busy_cores") or 0.0) for ld in loads.values()])
    print(f"machine at end: {_fmt_load(machine_load())}")
    warn_if_busy(report["max_other_busy_cores"], "peak and engine figures move differently under contention")
    write_json_report(record.output_path(args, "efficiency"), report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
