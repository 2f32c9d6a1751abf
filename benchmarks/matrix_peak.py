"""The linear layers alone against the host's matrix roof: `python -m benchmarks.matrix_peak [--record]`.

For SmolLM2-135M's four decoder projections (qkv 960x576, o 576x576, gate/up 3072x576, down 576x1536;
N x K) and each M, in one run:

- bf16: tokenmill's bf16 GEMM (`CpuBf16Linear`: fp32 rows in, rounded to bf16 per call, fp32 out;
  AMX-BF16 tiles where the host has them) against torch's bf16 `mm` (oneDNN; bf16 in and out, the
  faster of the [K, N] and [N, K] weight layouts);
- int8: tokenmill's W8A8 (`W8A8Linear`: the call's activation quantization included, fp32 out; AMX-INT8
  tiles where present) against `torch._int_mm` (int8 x int8 -> int32, no quantization, no scaling).

Rates are 2 M N K / best seconds over the four shapes (GFLOP/s for bf16, GOP/s for int8), and each is
set against the nominal peak: cores x the clock /proc/cpuinfo reports x operations per cycle per
core (AMX: 1,024 bf16 and 2,048 int8, Intel's published TDPBF16PS / TDPBUSD rates of 16 x 16 x 32 and
16 x 16 x 64 multiply-adds per 16 cycles; AVX512-BF16 without AMX: 64 bf16, one 512-bit VDPBF16PS of
32 multiply-adds per cycle; else fp32 FMA: 64 per AVX-512 cycle, 32 with AVX2). A virtual machine's reported clock is its
nominal one, so the percentages read "of what the clock says", not of a measured roof.
"""
from __future__ import annotations

import argparse
from typing import Any, Optional

import torch

from benchmarks import record
from benchmarks.efficiency import best_time
from benchmarks.hf_compare import BusyMeter, _fmt_load, machine_load, warn_if_busy

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # (N, K)
MS = (1, 8, 32, 64, 128, 256, 1024)


def clock_ghz() -> Optional[float]:
    """The clock /proc/cpuinfo reports ("cpu MHz" of the first CPU), in GHz; None where unreadable."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("cpu MHz"):
                    return float(line.split(":", 1)[1]) / 1000.0
    except (OSError, ValueError):
        pass
    return None


def peak_ops_per_cycle(host: Any) -> tuple[int, int]:
    """(bf16 FLOPs, int8 OPs) per cycle per core of the host's fastest unit for each (see the module doc)."""
    if host.amx_bf16:
        bf16 = 1024
    elif host.avx512_bf16:
        bf16 = 64
    else:
        bf16 = 64 if "avx512f" in host.flags else 32
    if "amx_int8" in host.flags:
        int8 = 2048
    elif "avx512_vnni" in host.flags:
        int8 = 256  # two VPDPBUSD of 64 multiply-adds each per cycle
    else:
        int8 = 128 if "avx512f" in host.flags else 64
    return bf16, int8


def sweep(ms: tuple[int, ...], reps: int) -> list[dict[str, Any]]:
    """One row per M: seconds over the four shapes for each of the four GEMMs (see the module doc)."""
    from engine.kernels.cpu.layers import CpuBf16Linear, W8A8Linear, quantize_w8a8

    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(n, k, generator=g) * 0.05 for n, k in SHAPES]
    ours_bf16 = [CpuBf16Linear(w) for w in ws]
    ours_w8a8 = [W8A8Linear(*quantize_w8a8(w)) for w in ws]
    t_kn = [w.t().contiguous().bfloat16() for w in ws]  # [K, N]
    t_nk = [w.bfloat16() for w in ws]  # [N, K]
    i8_kn = [quantize_w8a8(w)[0].t().contiguous() for w in ws]
    rows = []
    for m in ms:
        xs = {k: torch.randn(m, k, generator=g) for k in {k for _, k in SHAPES}}
        xb = {k: x.bfloat16() for k, x in xs.items()}
        xi = {k: torch.randint(-127, 128, (m, k), generator=g, dtype=torch.int8) for k in xs}
        ys = {n: torch.empty(m, n) for n in {n for n, _ in SHAPES}}
        yb = {n: torch.empty(m, n, dtype=torch.bfloat16) for n in ys}

        def ours(layers):
            def run():
                for lin, (n, k) in zip(layers, SHAPES):
                    lin(xs[k], out=ys[n])
            return run

        def torch_kn():
            for w, (n, k) in zip(t_kn, SHAPES):
                torch.mm(xb[k], w, out=yb[n])

        def torch_nk():
            for w, (n, k) in zip(t_nk, SHAPES):
                torch.mm(xb[k], w.t(), out=yb[n])

        def int_mm():
            for w, (n, k) in zip(i8_kn, SHAPES):
                torch._int_mm(xi[k], w)

        row = {"m": m, "ours_bf16_s": best_time(ours(ours_bf16), reps),
               "torch_bf16_s": min(best_time(torch_kn, reps), best_time(torch_nk, reps)),
               "ours_w8a8_s": best_time(ours(ours_w8a8), reps)}
        try:
            row["torch_int_mm_s"] = best_time(int_mm, reps)
        except RuntimeError as e:  # shapes torch._int_mm refuses on this build
            row["torch_int_mm_s"], row["torch_int_mm_error"] = None, str(e).splitlines()[0]
        rows.append(row)
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.matrix_peak", description=__doc__.split("\n")[0])
    ap.add_argument("--ms", default=",".join(map(str, MS)), help="rows per call, a comma list")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--output-json", default=None)
    record.add_arguments(ap)
    args = ap.parse_args(argv)
    from engine.host import Host
    from engine.kernels import cpu

    if not cpu.available():
        print(f"the CPU kernels are unavailable: {cpu.why_unavailable()}")
        return 1
    host = Host.current()
    threads = cpu.get_num_threads()
    torch.set_num_threads(threads)
    ghz = clock_ghz()
    per_bf16, per_int8 = peak_ops_per_cycle(host)
    peak_bf16 = threads * ghz * per_bf16 if ghz else None
    peak_int8 = threads * ghz * per_int8 if ghz else None
    print(f"host: {host.describe()}")
    clock = "no clock reported" if ghz is None else f"{ghz:.2f} GHz reported"
    print(f"{threads} threads; bf16 on AMX tiles: {cpu.bf16_amx()}, W8A8 on AMX tiles: {cpu.w8a8_amx()}; "
          f"nominal peak ({clock}): bf16 {peak_bf16 or float('nan'):.0f} GFLOP/s, "
          f"int8 {peak_int8 or float('nan'):.0f} GOP/s")
    load = machine_load()
    print(_fmt_load(load))
    meter = BusyMeter().start()
    flops_per_m = 2.0 * sum(n * k for n, k in SHAPES)
    rows = sweep(tuple(int(v) for v in args.ms.split(",")), args.reps)
    print(f"{'M':>5s} | {'bf16 ours':>9s} {'torch mm':>9s} {'ours/torch':>10s} {'% peak':>7s} | "
          f"{'W8A8 ours':>9s} {'_int_mm':>9s} {'ours/int_mm':>11s} {'% peak':>7s}")
    for r in rows:
        f = flops_per_m * r["m"] / 1e9
        r["ours_bf16_gflops"], r["torch_bf16_gflops"] = f / r["ours_bf16_s"], f / r["torch_bf16_s"]
        r["ours_w8a8_gops"] = f / r["ours_w8a8_s"]
        r["torch_int_mm_gops"] = f / r["torch_int_mm_s"] if r["torch_int_mm_s"] else None
        pb = f"{100 * r['ours_bf16_gflops'] / peak_bf16:6.1f}%" if peak_bf16 else "    n/a"
        pi = f"{100 * r['ours_w8a8_gops'] / peak_int8:6.1f}%" if peak_int8 else "    n/a"
        im = r["torch_int_mm_gops"]
        print(f"{r['m']:5d} | {r['ours_bf16_gflops']:9.0f} {r['torch_bf16_gflops']:9.0f} "
              f"{r['ours_bf16_gflops'] / r['torch_bf16_gflops']:9.2f}x {pb} | {r['ours_w8a8_gops']:9.0f} "
              f"{im if im is None else round(im):>9} "
              f"{'n/a' if im is None else format(r['ours_w8a8_gops'] / im, '.2f') + 'x':>11s} {pi}")
    busy = meter.stop() or 0.0
    warn_if_busy(busy)
    path = record.output_path(args, "matrix_peak")
    record.write(path, {"shapes_n_k": SHAPES, "threads": threads, "load": load, "clock_ghz": ghz,
                        "peak_bf16_gflops": peak_bf16, "peak_int8_gops": peak_int8, "other_busy_cores": busy,
                        "bf16_amx": cpu.bf16_amx(), "w8a8_amx": cpu.w8a8_amx(), "rows": rows}, "matrix_peak")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
