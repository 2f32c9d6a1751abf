"""Builds of the CPU kernel library's fp32 GEMM (`tm_gemm_f32`), timed interleaved in one process:
`python -m benchmarks.gemm_ab A.so B.so [C.so ...] [--threads 2] [--reps 15] [--m 32,64,128,1024] [--warm]`.

What one timing covers: SmolLM2-135M's linear layers as a decode or prefill step meets them,
`--layers` (30) distinct matrices of each decoder projection (qkv 960x576, o 576x576, gate/up
3072x576, down 576x1536) and the LM head (49152x576), each called once on an [M, in] input, so
that the weights stream from memory (538 MB, more than the caches) as in `benchmarks.efficiency`'s
linear sweep; `--warm` calls one matrix of each projection `--layers` times instead (the LM head
stays cold). torch.mm (MKL on this build) on the same shapes is timed beside them.

On a noisy shared VM two separate runs differ by more than a kernel change, and so do two
copies of the same weights: where a buffer lies in memory moved the same build's rate by up to
15% here. So every build reads the same packed weights (the panel layout is the builds' common
format), every repetition times every build back to back in a rotating order, and the ratios
printed are of best times (`B/A`) and the median of per-repetition ratios (`med`). The builds'
outputs must be bit for bit equal (a kernel change that is not is a different product).

Make a build with `python -c "from engine.kernels import cpu; print(cpu.library()._name)"` (the
current tree's, cached under ~/.cache/tokenmill/kernels); copy it before changing the sources.
Prints GFLOP/s per build (2 M N K summed over the layers / best seconds).
"""
from __future__ import annotations

import argparse
import ctypes
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from engine.kernels.cpu.memory import huge_empty  # noqa: E402

DECODER = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # (N, K) per decoder projection
HEAD = (49152, 576)
_P, _I64, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


def _load(path: str, threads: int) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    lib.tm_pack_f32_size.argtypes, lib.tm_pack_f32_size.restype = [_I64, _I64], _I64
    lib.tm_pack_f32.argtypes, lib.tm_pack_f32.restype = [_P, _I64, _I64, _I64, _P], None
    lib.tm_gemm_f32.argtypes, lib.tm_gemm_f32.restype = [_P, _I64, _P, _P, _P, _I64, _I64, _I64, _I64, _I], None
    lib.tm_gemm_nr.restype = _I
    lib.tm_set_num_threads.argtypes = [_I]
    lib.tm_set_num_threads(threads)
    return lib


def _pack(lib: ctypes.CDLL, w: torch.Tensor) -> torch.Tensor:
    """w [n, k] -> packed panels in huge-page memory, as `engine.kernels.cpu.pack_f32` holds them."""
    n, k = w.shape
    out = huge_empty(lib.tm_pack_f32_size(n, k))
    lib.tm_pack_f32(w.data_ptr(), k, n, k, out.data_ptr())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("libs", nargs="+", help="built libraries (.so), the first is A")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--m", default="32,64,128,1024")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--warm", action="store_true", help="one matrix per projection, called --layers times")
    args = ap.parse_args()
    libs = [_load(p, args.threads) for p in args.libs]
    if len({lib.tm_gemm_nr() for lib in libs}) != 1:
        raise SystemExit("the builds pack panels of different widths (one is AVX-512, another not)")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    ws = {s: [torch.randn(*s) * 0.05 for _ in range(1 if args.warm else args.layers)] for s in DECODER}
    head = torch.randn(*HEAD) * 0.05
    packed = {s: [_pack(libs[0], w) for w in v] * (args.layers if args.warm else 1) for s, v in ws.items()}
    head_packed = _pack(libs[0], head)
    mm_w = {s: [w.t().contiguous() for w in v] * (args.layers if args.warm else 1) for s, v in ws.items()}
    head_mm = head.t().contiguous()
    names = [chr(ord("A") + i) for i in range(len(libs))]
    print(f"{args.threads} threads, best of {args.reps}, load {os.getloadavg()[0]:.2f}, "
          f"{'warm' if args.warm else 'cold'}; " + ", ".join(f"{c} = {p}" for c, p in zip(names, args.libs)))
    flops_per_m = 2 * (args.layers * sum(n * k for n, k in DECODER) + HEAD[0] * HEAD[1])
    for m in [int(v) for v in args.m.split(",")]:
        xs = {k: torch.randn(m, k) for k in {k for _, k in DECODER}}
        ys = [{n: torch.empty(m, n) for n in {n for n, _ in (*DECODER, HEAD)}} for _ in range(len(libs) + 1)]

        def run_lib(lib: ctypes.CDLL, y: dict) -> None:
            for (n, k), mats in packed.items():
                for w in mats:
                    lib.tm_gemm_f32(xs[k].data_ptr(), k, w.data_ptr(), None, y[n].data_ptr(), n, m, n, k, 0)
            lib.tm_gemm_f32(xs[576].data_ptr(), 576, head_packed.data_ptr(), None, y[HEAD[0]].data_ptr(), HEAD[0],
                            m, HEAD[0], HEAD[1], 0)

        def run_mm() -> None:
            y = ys[-1]
            for (n, k), mats in mm_w.items():
                for w in mats:
                    torch.mm(xs[k], w, out=y[n])
            torch.mm(xs[576], head_mm, out=y[HEAD[0]])

        fns = [lambda lib=lib, y=y: run_lib(lib, y) for lib, y in zip(libs, ys)] + [run_mm]
        for f in fns:
            f()
        for y in ys[1:-1]:
            if any(not torch.equal(y[n], ys[0][n]) for n in y):
                raise SystemExit(f"the builds' outputs differ at M={m}")
        times: list[list[float]] = [[] for _ in fns]
        for rep in range(args.reps):
            order = list(range(len(fns)))
            order = order[rep % len(order):] + order[:rep % len(order)]
            for j in order:
                t0 = time.perf_counter()
                fns[j]()
                times[j].append(time.perf_counter() - t0)
        best = [min(t) for t in times]
        rates = "  ".join(f"{c} {flops_per_m * m / b / 1e9:6.1f}" for c, b in zip(names, best))
        ratios = "  ".join(
            f"{c}/A {best[0] / best[j]:.3f} (med {sorted(a / b for a, b in zip(times[0], times[j]))[args.reps // 2]:.3f})"
            for j, c in enumerate(names) if j)
        print(f"M={m:5d}: {rates}  torch.mm {flops_per_m * m / best[-1] / 1e9:6.1f} GFLOP/s   {ratios}", flush=True)


if __name__ == "__main__":
    main()
