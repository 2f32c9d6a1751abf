"""Builds of the CPU kernel library's paged attention (`tm_paged_attention`), timed interleaved in
one process: `python -m benchmarks.attention_ab A.so [B.so ...] [--kv fp32|fp16|int8]
[--block-size 16] [--warm] [--reps 7]`.

What one timing covers: the decode attention of a batch-64 step of SmolLM2-135M (9 query heads,
3 KV heads, head_dim 64, 30 layers), contexts of 90-174 tokens (as the in99-out64 workload's
decode steps meet them), each layer reading a KV pool of its own at blocks scattered as a paged
cache leaves them. With `--prefill`, a prefill step's attention instead: 10 sequences of 100 new
rows each after a cached prefix of 400 tokens (as the labelling workload's prefill steps meet
them), in tiles of `attention_tile_rows` rows. Before every timing a 64 MB buffer is written, so the pools come from memory
(about 206 MB of fp16 K and V per step, 412 MB in fp32); `--warm` reads one layer's pool 30 times
instead (it then lies in the last-level cache). Every build reads the same pools, every repetition
times each build in turn, and the best time of each is printed with the bytes it read per second.

Make a build with `python -c "from engine.kernels import cpu; print(cpu.library()._name)"` (the
current tree's, cached under ~/.cache/tokenmill/kernels); copy it before changing the sources.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from engine.attention.torch_quant_kv import TorchQuantKVAttentionBackend  # noqa: E402
from engine.kernels import cpu  # noqa: E402
from engine.kernels.cpu.memory import huge_zeros  # noqa: E402

BATCH, HQ, HKV, HEAD_DIM, LAYERS = 64, 9, 3, 64, 30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("builds", nargs="+", help="paths of kernel library builds (.so)")
    ap.add_argument("--kv", default="fp16", choices=("fp32", "fp16", "int8"), help="the KV cache's row format")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    ap.add_argument("--warm", action="store_true", help="every layer reads the same pool (in cache)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill", action="store_true", help="a prefill step (10 x 100 rows after 400 cached tokens)")
    ap.add_argument("--no-check", action="store_true",
                    help="time builds whose outputs differ (ablations that leave a phase out)")
    args = ap.parse_args()
    libs = [ctypes.CDLL(p) for p in args.builds]
    for lib in libs:
        lib.tm_set_num_threads(args.threads)
    bs = args.block_size
    g = torch.Generator().manual_seed(0)
    prefix, new_rows = 400, 100
    seqs = 10 if args.prefill else BATCH
    lens = torch.full((seqs,), prefix + new_rows) if args.prefill else torch.randint(90, 175, (BATCH,), generator=g)
    nblk = [-(-int(n) // bs) for n in lens]
    num_blocks = sum(nblk) + 8
    codec = TorchQuantKVAttentionBackend("int8")

    def pool() -> torch.Tensor:
        x = torch.randn(HKV, num_blocks * bs, HEAD_DIM, generator=g)
        if args.kv == "fp16":
            x = x.half()
        elif args.kv == "int8":
            x = codec.encode(x.transpose(0, 1)).contiguous()
        # in huge-page memory, as the engine's KV cache (engine/kv_cache.py): with 4 KiB pages
        # every scattered block costs a TLB miss, which the engine never pays
        return huge_zeros(tuple(x.shape), x.dtype).copy_(x)

    first = (pool(), pool())
    pools = [first] * LAYERS if args.warm else [first] + [(pool(), pool()) for _ in range(LAYERS - 1)]
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.zeros(seqs, max(nblk), dtype=torch.int32)
    for b in range(seqs):
        for i in range(nblk[b]):
            tables[b, i] = perm.pop()
    row_seq = None
    if args.prefill:  # each sequence's new rows, causal: row i of a sequence sees prefix + i + 1 keys
        per = cpu.attention_tile_rows(HQ // HKV, lib=libs[0])
        row_seq = torch.arange(seqs, dtype=torch.int32).repeat_interleave(new_rows)
        kv_len = torch.arange(prefix + 1, prefix + new_rows + 1).repeat(seqs)
        tiles = torch.tensor([(b * new_rows + o, min(per, new_rows - o)) for b in range(seqs)
                              for o in range(0, new_rows, per)], dtype=torch.int64)
    else:
        kv_len = lens.to(torch.int64)
        tiles = torch.stack((torch.argsort(kv_len, descending=True), torch.ones(BATCH, dtype=torch.int64)), 1)
    tiles = tiles.contiguous()
    q = torch.randn(kv_len.numel(), HQ, HEAD_DIM, generator=g)
    out = torch.empty_like(q)
    evict = torch.empty(64 << 20, dtype=torch.uint8)

    def run(lib: ctypes.CDLL) -> None:
        for kc, vc in pools:
            cpu.paged_attention(q, kc, vc, tables, row_seq, kv_len, tiles, bs, HEAD_DIM ** -0.5, out, lib=lib)

    outs = []
    for lib in libs:  # the builds must agree (a change that does not is a different product)
        run(lib)
        outs.append(out.clone())
    for name, o in zip(args.builds[1:], outs[1:]):
        if not args.no_check and (o - outs[0]).abs().max().item() > 1e-4:
            raise SystemExit(f"{name}'s output differs from {args.builds[0]}'s")
    best = [float("inf")] * len(libs)
    for _ in range(args.reps):
        for i, lib in enumerate(libs):
            if not args.warm:
                evict.add_(1)
            t0 = time.perf_counter()
            run(lib)
            best[i] = min(best[i], time.perf_counter() - t0)
    row = pools[0][0].shape[-1] * pools[0][0].element_size()
    mb = sum(int(n) for n in lens) * HKV * row * 2 * LAYERS / 1e6
    # multiply-adds of QK and PV: every query head's row against the keys it sees
    gflop = 4.0 * HQ * HEAD_DIM * float(kv_len.sum()) * LAYERS / 1e9
    what = (f"prefill, {seqs} x {new_rows} rows after {prefix} cached tokens" if args.prefill
            else f"decode, batch {BATCH}")
    print(f"{args.kv} KV, block size {bs}, {'warm' if args.warm else 'cold'}, {args.threads} threads, best of "
          f"{args.reps}: {what}, {LAYERS} layers; {mb:.0f} MB of K and V, {gflop:.1f} GFLOP")
    for name, t in zip(args.builds, best):
        print(f"  {name}: {t * 1e3:.2f} ms ({mb / 1e3 / t:.1f} GB/s, {gflop / t:.0f} GFLOP/s)")


if __name__ == "__main__":
    main()
