"""Quality, memory and speed of each quantization scheme: `python -m benchmarks.quality`.

Text: the licence texts Debian's `base-files` package ships in
/usr/share/common-licenses (GPL-3, GPL-2, Apache-2.0, MPL-2.0, GFDL-1.3, LGPL-2.1),
concatenated; the first `--tokens` tokens (>= 20,000) are cut into windows of
`--window` tokens, each scored from its first token (perplexity over every
predicted token, with `LLM.score`).

Per scheme: perplexity and its change vs fp32; batch independence (windows
scored one at a time vs 64 together); greedy agreement with fp32 on 50
prompts (position-wise, and the share of completions identical); weight
bytes (held, and read per decode step); KV bytes per token and capacity;
decode tokens/s at batch 1 and 64. The machine's load average is printed
next to every timing (2 shared cores: timings under load are not comparable).

    python -m benchmarks.quality [--tokens 20000] [--schemes fp32,bf16,int8,int4-g32,gguf,kv-int8] [--kernels]

The host (`engine.host`) is printed first: figures are read beside the CPU they ran on.
"""
from __future__ import annotations

import argparse
import math
import os
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from benchmarks import record  # noqa: E402
from benchmarks.hf_compare import write_json_report  # noqa: E402

LICENSES = ["GPL-3", "GPL-2", "Apache-2.0", "MPL-2.0", "GFDL-1.3", "LGPL-2.1"]
LICENSE_DIR = Path("/usr/share/common-licenses")
SCHEMES = {
    "fp32": dict(dtype="float32", kv_cache_dtype="fp32"),  # the reference: fp32 weights and KV cache
    "kv-fp16": dict(dtype="float32", kv_cache_dtype="fp16"),  # fp32 weights, the default fp16 cache
    "bf16": dict(dtype="bfloat16"),  # bf16 weights (fp32 activations), the default cache ("auto")
    "bf16-kv-fp16": dict(dtype="bfloat16", kv_cache_dtype="fp16"),  # bf16 weights over fp16 halves
    "kv-bf16": dict(dtype="float32", kv_cache_dtype="bf16"),  # fp32 weights, the grouped bf16 cache
    "default": dict(),  # dtype="auto": bf16 on hosts with AMX-BF16 or AVX512-BF16, else fp32
    "int8": dict(quantization="int8"),
    "int4-g32": dict(quantization="int4", quant_group_size=32),
    "gguf": dict(quantization="gguf"),
    "kv-int8": dict(kv_cache_dtype="int8"),
    "w8a8": dict(quantization="w8a8"),
}


def corpus_text() -> str:
    """The licence texts, concatenated (source: Debian base-files, /usr/share/common-licenses)."""
    return "\n\n".join((LICENSE_DIR / n).read_text() for n in LICENSES)


def load() -> str:
    return f"load {os.getloadavg()[0]:.1f}"


def perplexity(llm, windows: list[list[int]], batch: int) -> tuple[float, list[torch.Tensor]]:
    lps: list[torch.Tensor] = []
    for i in range(0, len(windows), batch):
        lps.extend(llm.score(windows[i : i + batch], chunk_size=2048))
    allv = torch.cat(lps)
    return math.exp(-allv.double().mean().item()), lps


def greedy(llm, prompts: list[list[int]], n: int) -> list[list[int]]:
    from engine import SamplingParams

    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def teacher_forced_agreement(llm, prompts: list[list[int]], ref_tokens: list[list[int]]) -> float:
    """Share of positions where `llm`'s greedy token equals the reference's, each position
    predicted from the prompt plus the reference's own tokens before it (so one early
    difference does not shift every later comparison, unlike free-running agreement).
    Runs one 1-token request per position; the prefix cache serves the shared context."""
    from engine import SamplingParams

    ctx = [p + r[:i] for p, r in zip(prompts, ref_tokens) for i in range(len(r))]
    want = [t for r in ref_tokens for t in r]
    outs = llm.generate(ctx, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    return sum(o.outputs[0].token_ids[0] == w for o, w in zip(outs, want)) / len(want)


def decode_tps(llm, prompt: list[int], batch: int, n: int) -> float:
    from engine import SamplingParams

    p = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    llm.generate([prompt] * batch, p, use_tqdm=False)  # warm
    t0 = time.perf_counter()
    llm.generate([prompt] * batch, p, use_tqdm=False)
    return batch * n / (time.perf_counter() - t0)


def kernels() -> None:
    """fp32 matmul vs our dequantize-then-matmul vs PyTorch's packed int8 kernel, [M x 576] x [576 x 1536]."""
    import torch.nn.functional as F

    from engine.quant import kernel_gflops, quantize_int4, quantize_int8

    w = torch.randn(1536, 576) * 0.02
    q8, q4 = quantize_int8(w), quantize_int4(w, 32)
    print(f"\nkernels, [M x 576] x [576 x 1536], {torch.get_num_threads()} threads, {load()}")
    print(f"{'M':>5} {'fp32':>8} {'int8 deq':>9} {'int4 deq':>9} {'aten int8pack':>14}  (GFLOP/s)")
    for m in (1, 16, 64, 256):
        x = torch.randn(m, 576)
        r = [kernel_gflops(m, 1536, 576, lambda: F.linear(x, w)),
             kernel_gflops(m, 1536, 576, lambda: q8(x)),
             kernel_gflops(m, 1536, 576, lambda: q4(x))]
        try:
            wi8 = q8.weight.contiguous()
            sc = q8.scale.view(-1).contiguous()
            r.append(kernel_gflops(m, 1536, 576, lambda: torch.ops.aten._weight_int8pack_mm(x, wi8, sc), reps=2))
        except Exception:  # noqa: BLE001 - report, never fail the table
            r.append(float("nan"))
        print(f"{m:>5} {r[0]:>8.1f} {r[1]:>9.1f} {r[2]:>9.1f} {r[3]:>14.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=20480)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--schemes", default=",".join(SCHEMES))
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-speed", action="store_true")
    ap.add_argument("--kernels", action="store_true")
    ap.add_argument("--output-json", default=None)
    record.add_arguments(ap)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from engine import LLM
    from engine.quant import decode_weight_bytes, model_weight_bytes

    from engine.host import describe

    print(f"host: {describe()}")
    if args.kernels:
        kernels()
    base = LLM("smollm2-135m-instruct", dtype="float32")
    ids = base.tokenizer.encode(corpus_text())
    if len(ids) < args.tokens:
        raise SystemExit(f"corpus has {len(ids)} tokens < {args.tokens}")
    ids = ids[: args.tokens - args.tokens % args.window]
    windows = [ids[i : i + args.window] for i in range(0, len(ids), args.window)]
    stride = len(ids) // args.prompts
    prompts = [ids[i * stride : i * stride + 24] for i in range(args.prompts)]
    print(f"text: {len(ids)} tokens of {', '.join(LICENSES)} (Debian base-files, {LICENSE_DIR}), "
          f"{len(windows)} windows of {args.window}; greedy: {args.prompts} prompts x {args.new_tokens} tokens")
    rows, ref_ppl, ref_tokens = [], None, None
    for name in args.schemes.split(","):
        t0 = time.perf_counter()
        # room for 64 windows at once (the batch-64 scoring)
        llm = LLM("smollm2-135m-instruct", kv_cache_memory_bytes=64 * (args.window + 16) * 46080, **SCHEMES[name])
        t_load = time.perf_counter() - t0
        l0 = os.getloadavg()[0]
        t0 = time.perf_counter()
        ppl, lps = perplexity(llm, windows, 64)
        t_ppl = time.perf_counter() - t0
        solo = [llm.score(w, chunk_size=2048)[0] for w in windows[:4]]
        batch_dev = max((a - b).abs().max().item() for a, b in zip(solo, lps[:4]))
        toks = greedy(llm, prompts, args.new_tokens)
        if ref_tokens is None:
            ref_ppl, ref_tokens = ppl, toks
        agree = sum(a == b for r, t in zip(ref_tokens, toks) for a, b in zip(r, t)) / sum(map(len, ref_tokens))
        agree_tf = teacher_forced_agreement(llm, prompts, ref_tokens)
        same = sum(r == t for r, t in zip(ref_tokens, toks)) / len(toks)
        tps1 = tps64 = float("nan")
        l1 = float("nan")
        if not args.no_speed:
            l1 = os.getloadavg()[0]
            tps1 = decode_tps(llm, prompts[0], 1, 32)
            tps64 = decode_tps(llm, prompts[0], 64, 32)
        rows.append((name, ppl, 100 * (ppl / ref_ppl - 1), batch_dev, 100 * agree_tf, 100 * agree, 100 * same,
                     model_weight_bytes(llm.model) / 2**20, decode_weight_bytes(llm.model) / 2**20,
                     llm.kv_bytes_per_token, tps1, tps64, t_ppl, l0, l1))
        print(f"  {name}: ppl {ppl:.4f} ({t_ppl:.0f} s, load {l0:.1f}, model load {t_load:.0f} s) row {rows[-1]}",
              flush=True)
        del llm
    print(f"\n{'scheme':<9} {'ppl':>8} {'Δppl%':>7} {'b1-b64':>8} {'tf agr%':>7} {'fr agr%':>7} {'same%':>6} {'W MiB':>7} "
          f"{'W/step':>7} {'KV B/tok':>9} {'tok/s b1':>9} {'tok/s b64':>9} {'ppl s':>6} {'load':>5} {'load2':>5}")
    for r in rows:
        print(f"{r[0]:<9} {r[1]:>8.4f} {r[2]:>+7.2f} {r[3]:>8.1e} {r[4]:>7.1f} {r[5]:>7.1f} {r[6]:>6.0f} {r[7]:>7.1f} "
              f"{r[8]:>7.1f} {r[9]:>9d} {r[10]:>9.1f} {r[11]:>9.1f} {r[12]:>6.0f} {r[13]:>5.1f} {r[14]:>5.1f}")
    print("W MiB: weights held (fp32 embedding for lookups included; int8 keeps the tied LM head as that fp32 "
          "table, so it is counted once there and read whole every step); W/step: weight bytes read per decode step; "
          "b1-b64: max |Δ logprob| of a window scored alone vs in a batch of 64; tf agr: greedy token "
          "agreement with fp32, each position predicted from fp32's own greedy tokens before it (teacher forced); "
          "fr agr: position-wise agreement of free-running greedy completions; same: completions identical; load: 1-min load average at the measurement "
          "(2 cores).")
    keys = ("scheme", "ppl", "dppl_pct", "b1_b64_max_dlogprob", "tf_agree_pct", "fr_agree_pct", "same_pct",
            "weights_mib", "weights_per_step_mib", "kv_bytes_per_token", "tok_s_b1", "tok_s_b64", "ppl_s", "load",
            "load2")
    write_json_report(record.output_path(args, "quality"),
                      {"tokens": len(ids), "window": args.window, "prompts": args.prompts,
                       "new_tokens": args.new_tokens, "schemes": {r[0]: dict(zip(keys, r)) for r in rows}})


if __name__ == "__main__":
    main()
