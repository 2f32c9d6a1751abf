"""Two builds of the CPU kernel library's W8A8 GEMM, timed interleaved in one process:
`python -m benchmarks.w8a8_ab OLD.so NEW.so [--threads 1] [--reps 60] [--m 32,64]`.

On a noisy shared machine two separate runs differ by more than a kernel change; here every
repetition times A, B and tokenmill's fp32 kernel (`CpuLinear`) back to back on the same
input, and each keeps its best. Each timing covers `tm_quantize_act` (the activations'
per-token, per-group quantization) and `tm_gemm_w8a8`, as a W8A8 layer runs them. Shapes:
SmolLM2-135M's decoder projections (qkv 960x576, o 576x576, gate/up 3072x576, down 576x1536)
and its LM head (49152x576, reported, not summed). Both builds get the same codes, in
[-63, 63] (`quantize_w8a8`), and their outputs must agree (to 1e-3 of the largest).

Build a library from another checkout with `python -c "from engine.kernels import cpu;
print(cpu.library()._name)"` run there (its path is printed); the current one likewise.
Prints GOP/s per shape (2 M N K / best seconds), B/A and B/fp32 time ratios, and their
sums over the four decoder projections.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import time

import torch

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576))  # (N, K)
GROUP = 64


def _load(path: str, threads: int) -> ctypes.CDLL:
    p, i64, i = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib = ctypes.CDLL(path)
    lib.tm_quantize_act.argtypes, lib.tm_quantize_act.restype = [p, i64, i64, i64, i64, i64, p, p], None
    lib.tm_pack_w8a8_size.argtypes, lib.tm_pack_w8a8_size.restype = [i64, i64, i64], i64
    lib.tm_pack_w8a8.argtypes, lib.tm_pack_w8a8.restype = [p, i64, p, i64, i64, i64, p], i
    lib.tm_gemm_w8a8.argtypes = [p, p, i64, i64, p, p, p, i64, i64, i64, i]
    lib.tm_gemm_w8a8.restype = i
    lib.tm_set_num_threads.argtypes = [i]
    lib.tm_set_num_threads(threads)
    return lib


def _layer(lib: ctypes.CDLL, q: torch.Tensor, s: torch.Tensor, x: torch.Tensor):
    """A callable running one W8A8 layer of `lib` on x, and its output tensor."""
    n, k = q.shape
    m, kp = x.shape[0], -(-k // 4) * 4
    packed = torch.empty(lib.tm_pack_w8a8_size(n, k, GROUP), dtype=torch.uint8)
    if lib.tm_pack_w8a8(q.data_ptr(), k, s.data_ptr(), n, k, GROUP, packed.data_ptr()):
        raise ValueError(f"{lib._name} refused the weight codes")
    codes, scales, y = torch.empty(m, kp, dtype=torch.uint8), torch.empty(m, -(-kp // GROUP)), torch.empty(m, n)

    def run():
        lib.tm_quantize_act(x.data_ptr(), k, m, k, kp, GROUP, codes.data_ptr(), scales.data_ptr())
        lib.tm_gemm_w8a8(codes.data_ptr(), scales.data_ptr(), kp, GROUP, packed.data_ptr(), None, y.data_ptr(), n,
                         m, n, 0)
    run.keep = packed  # the packed weight lives as long as the callable
    return run, y


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--m", default="32,64")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from engine.kernels import cpu
    from engine.kernels.cpu.layers import CpuLinear, quantize_w8a8

    cpu.set_num_threads(args.threads)
    libs = [_load(args.old, args.threads), _load(args.new, args.threads)]
    ms = [int(v) for v in args.m.split(",")]
    print(f"A = {args.old}\nB = {args.new}\n{args.threads} thread(s), best of {args.reps}, "
          f"load {os.getloadavg()[0]:.1f}")
    totals = {m: [0.0, 0.0, 0.0] for m in ms}
    torch.manual_seed(0)
    for n, k in SHAPES:
        w = torch.randn(n, k) * 0.05
        q, s = quantize_w8a8(w)
        fp32 = CpuLinear(w)
        for m in ms:
            x = torch.randn(m, k)
            (fa, ya), (fb, yb) = (_layer(lib, q, s, x) for lib in libs)
            fa(), fb()
            if (ya - yb).abs().max() > 1e-3 * yb.abs().max():
                raise SystemExit(f"the builds disagree at N={n} K={k} M={m}")
            best = [float("inf")] * 3
            for _ in range(args.reps):
                for i, f in enumerate((fa, fb, lambda: fp32(x))):
                    t0 = time.perf_counter()
                    f()
                    best[i] = min(best[i], time.perf_counter() - t0)
            g = 2 * m * n * k / 1e9
            if n != 49152:
                totals[m] = [t + b for t, b in zip(totals[m], best)]
            print(f"N={n:>5} K={k:>4} M={m:>3}: A {g / best[0]:6.1f}  B {g / best[1]:6.1f} GOP/s  "
                  f"fp32 {g / best[2]:6.1f} GFLOP/s  B/A {best[0] / best[1]:.2f}  B/fp32 {best[2] / best[1]:.2f}",
                  flush=True)
    for m in ms:
        a, b, f = totals[m]
        print(f"decoder projections, M={m}: B/A {a / b:.2f}  A/fp32 {f / a:.2f}  B/fp32 {f / b:.2f}")


if __name__ == "__main__":
    main()
