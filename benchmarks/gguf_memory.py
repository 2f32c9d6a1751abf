"""Bytes our layers hold per GGUF block type, against the file's own bytes.

    python -m benchmarks.gguf_memory [--gguf PATH]

Part 1: one [2048, 2048] matrix of random valid blocks per type: the file's bytes, `QuantLinear`'s
(`weight_bytes`: codes, fp32 scales and mins) and `CpuQuantLinear`'s (its packed panels), in bits
per weight. Part 2, with --gguf: every decoder matrix of a real file, fused as the engine fuses them
(qkv, gate_up: `engine.quant.concat_rows`), totalled per layer kind; an unmapped type is counted
at fp32 (4 bytes per weight: the engine keeps such a layer in float).
"""
from __future__ import annotations

import argparse
import collections

import numpy as np

import gguf
from engine.quant import concat_rows, gguf_blocks_to_parts, parts_to_layer

BLOCKS = {"Q8_0": (34, 32, [0]), "Q4_0": (18, 32, [0]), "Q4_1": (20, 32, [0, 2]), "Q5_0": (22, 32, [0]),
          "Q5_1": (24, 32, [0, 2]), "Q4_K": (144, 256, [0, 2]), "Q5_K": (176, 256, [0, 2]), "Q6_K": (210, 256, [208])}
KINDS = {"qkv": ("attn_q", "attn_k", "attn_v"), "o": ("attn_output",), "gate_up": ("ffn_gate", "ffn_up"),
         "down": ("ffn_down",)}


def _blocks(type_name: str, out: int, n_in: int) -> np.ndarray:
    size, per, f16 = BLOCKS[type_name]
    rng = np.random.default_rng(0)
    b = rng.integers(0, 256, (out * n_in // per, size), dtype=np.uint8)
    for p in f16:
        b[:, p : p + 2] = rng.uniform(-0.05, 0.05, len(b)).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return b.reshape(out, -1)


def _ours(parts) -> tuple[int, int]:
    """(QuantLinear bytes, CpuQuantLinear bytes or 0 where the CPU library is unavailable)."""
    layer = parts_to_layer(parts)
    try:
        from engine.kernels.cpu import available
        from engine.kernels.cpu.layers import CpuQuantLinear

        packed = CpuQuantLinear(layer).weight_bytes() if available() else 0
    except ImportError:
        packed = 0
    return layer.weight_bytes(), packed


def per_type(out: int = 2048, n_in: int = 2048) -> None:
    print(f"one [{out}, {n_in}] matrix, bits per weight")
    print(f"{'type':6} {'file':>6} {'QuantLinear':>12} {'CpuQuantLinear':>15} {'ratio':>6}")
    for t in BLOCKS:
        b = _blocks(t, out, n_in)
        ql, cq = _ours(gguf_blocks_to_parts(b, t, out, n_in))
        n = out * n_in
        print(f"{t:6} {b.nbytes * 8 / n:6.2f} {ql * 8 / n:12.2f} {cq * 8 / n:15.2f} {ql / b.nbytes:6.2f}")


def real_file(path: str) -> None:
    r = gguf.GGUFReader(path)
    tensors = {t.name: t for t in r.tensors}
    n_layers = 1 + max(int(n.split(".")[1]) for n in tensors if n.startswith("blk."))
    tot = collections.defaultdict(lambda: [0, 0, 0, ""])
    for i in range(n_layers):
        for kind, names in KINDS.items():
            ts = [tensors[f"blk.{i}.{n}.weight"] for n in names]
            file_bytes = sum(int(t.n_bytes) for t in ts)
            parts = [gguf_blocks_to_parts(np.asarray(t.data).reshape(int(t.shape[1]), -1), t.tensor_type.name,
                                          int(t.shape[1]), int(t.shape[0])) for t in ts]
            if any(p is None for p in parts):
                ql = cq = sum(int(t.shape[0]) * int(t.shape[1]) * 4 for t in ts)
            else:
                ql, cq = _ours(concat_rows(parts))
            row = tot[kind]
            row[0] += file_bytes
            row[1] += ql
            row[2] += cq
            row[3] = row[3] or "+".join(t.tensor_type.name for t in ts)
    print(f"\n{path}: decoder matrices of {n_layers} layers (layer 0's types shown)")
    print(f"{'layer':8} {'types':22} {'file MB':>8} {'QuantLinear MB':>15} {'CpuQuantLinear MB':>18} {'ratio':>6}")
    sums = [0, 0, 0]
    for kind, (fb, ql, cq, types) in tot.items():
        print(f"{kind:8} {types:22} {fb / 1e6:8.2f} {ql / 1e6:15.2f} {cq / 1e6:18.2f} {ql / fb:6.2f}")
        sums = [sums[0] + fb, sums[1] + ql, sums[2] + cq]
    fb, ql, cq = sums
    print(f"{'total':8} {'':22} {fb / 1e6:8.2f} {ql / 1e6:15.2f} {cq / 1e6:18.2f} {ql / fb:6.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", help="a GGUF file whose decoder matrices to total")
    args = ap.parse_args()
    per_type()
    if args.gguf:
        real_file(args.gguf)


if __name__ == "__main__":
    main()
