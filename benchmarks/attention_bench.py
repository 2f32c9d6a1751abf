"""Decode attention on the CPU: the C paged kernel against the PyTorch gather-and-matmul path.

One decode step's attention of one layer, for the default model's shape (9 query
heads, 3 KV heads, head_dim 64, blocks of 16 tokens), over block tables scattered
in a pool the size of the engine's. Both paths run in this process on the same
tensors; the table prints milliseconds per layer call and the ratio.

Then one batch-64 decode step's attention over 30 layers through the C kernel alone, with one
layer's pool in cache ("hot") and over 30 pools ("cold"), and one layer's attention over a long
prompt, for each KV cache format: fp32, fp16 halves, bf16 in the group layout (where the bf16 unit
reads it) and int8 rows.

    python -m benchmarks.attention_bench [--repeats 20] [--prefill-tokens 4096] [--output-json F]
"""
from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

from engine.attention import AttentionMetadata, TorchAttentionBackend, cpu_kernel

from .hf_compare import BusyMeter, _fmt_load, machine_load, warn_if_busy, write_json_report

from benchmarks import record

HQ, HKV, D, BS = 9, 3, 64, 16


def _case(batch: int, lens: list[int], shared: int, num_blocks: int, seed: int):
    """Metadata and tensors of one decode step: `shared` leading tokens (a multiple of BS) are
    the same blocks for every sequence, the rest scattered at random in the pool."""
    rng = random.Random(seed)
    free = list(range(num_blocks))
    rng.shuffle(free)
    head = [free.pop() for _ in range(shared // BS)]
    max_blocks = (max(lens) + BS - 1) // BS
    tables = torch.zeros(batch, max_blocks, dtype=torch.int32)
    for b, n in enumerate(lens):
        own = [free.pop() for _ in range((n + BS - 1) // BS - len(head))]
        tables[b, :len(head) + len(own)] = torch.tensor(head + own, dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int64)
    last = tables.long().gather(1, ((seq_lens - 1) // BS)[:, None])[:, 0]
    meta = AttentionMetadata(
        slot_mapping=last * BS + (seq_lens - 1) % BS, num_decode_tokens=batch, decode_seq_lens=seq_lens,
        decode_block_tables=tables, prefill_query_starts=[], prefill_query_lens=[], prefill_seq_lens=[],
        prefill_block_tables=[], block_size=BS)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, HQ, D, generator=g)
    k = torch.randn(batch, HKV, D, generator=g)
    v = torch.randn(batch, HKV, D, generator=g)
    kc = torch.randn(HKV, num_blocks * BS, D, generator=g)
    vc = torch.randn(HKV, num_blocks * BS, D, generator=g)
    return meta, q, k, v, kc, vc


def _time(backend, meta, q, k, v, kc, vc, repeats: int) -> tuple[float, torch.Tensor]:
    backend.prepare(meta)
    out = backend.forward(q, k, v, kc, vc, meta, D ** -0.5)
    t0 = time.perf_counter()
    for _ in range(repeats):
        backend.prepare(meta)
        backend.forward(q, k, v, kc, vc, meta, D ** -0.5)
    return (time.perf_counter() - t0) / repeats, out


KV_FORMATS = ("fp32", "fp16", "bf16", "int8")  # the C kernel's cache formats (`engine.kernels.cpu.kv_row_format`)


def _pool(kv: str, num_blocks: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's K/V pool [HKV, num_blocks * BS, D] of random values in cache format `kv`: fp32, fp16
    halves, bf16 in the group layout (`engine.attention.bf16_kv`) or int8 rows with their scales."""
    from engine.attention.torch_quant_kv import TorchQuantKVAttentionBackend
    from engine.kernels import cpu

    k, v = torch.randn(HKV, num_blocks * BS, D, generator=g), torch.randn(HKV, num_blocks * BS, D, generator=g)
    if kv == "fp32":
        return k, v
    if kv == "int8":
        codec = TorchQuantKVAttentionBackend("int8")
        return tuple(codec.encode(c.transpose(0, 1)).contiguous() for c in (k, v))
    dtype = {"fp16": torch.float16, "bf16": torch.int16}[kv]
    kc, vc = torch.empty(k.shape, dtype=dtype), torch.empty(v.shape, dtype=dtype)
    cpu.kv_write(k.transpose(0, 1), v.transpose(0, 1), kc, vc, torch.arange(num_blocks * BS))
    return kc, vc


def decode_step_30_layers(kv: str, repeats: int, seed: int = 0) -> dict[str, float]:
    """ms of one batch-64 decode step's attention over 30 layers (contexts 100-165, the engine's
    C kernel called as the decoder driver calls it): "hot" runs one layer's pool 30 times,
    "cold" 30 pools in turn, as a real step finds them. KV cache in format `kv` (`KV_FORMATS`)."""
    from engine.kernels import cpu

    rng = random.Random(seed)
    batch, layers = 64, 30
    lens = [rng.randint(100, 165) for _ in range(batch)]
    num_blocks = sum(-(-n // BS) for n in lens) + 8
    g = torch.Generator().manual_seed(seed)
    pools = [_pool(kv, num_blocks, g) for _ in range(layers)]
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables = torch.zeros(batch, max(-(-n // BS) for n in lens), dtype=torch.int32)
    for b, n in enumerate(lens):
        for j in range(-(-n // BS)):
            tables[b, j] = ids.pop()
    q, out = torch.randn(batch, HQ, D, generator=g), torch.empty(batch, HQ, D)
    kv_len = torch.tensor(lens, dtype=torch.int64)
    tiles = torch.tensor([(b, 1) for b in range(batch)], dtype=torch.int64)
    res = {}
    for name, ps in (("hot", [pools[0]] * layers), ("cold", pools)):
        best = float("inf")
        for _ in range(repeats + 1):  # the first is a warm-up
            t0 = time.perf_counter()
            for kc, vc in ps:
                cpu.paged_attention(q, kc, vc, tables, None, kv_len, tiles, BS, D ** -0.5, out)
            best = min(best, time.perf_counter() - t0)
        res[f"{name}_ms"] = best * 1e3
    return res


def prefill_one_layer(kv: str, tokens: int, repeats: int, seed: int = 0) -> dict[str, float]:
    """ms and GFLOP/s of one layer's causal attention over a `tokens`-token prompt (one prefill chunk, tiles
    as the engine plans them, blocks scattered), KV cache in format `kv`; FLOPs are QK^T and PV's
    multiply-adds over the causal half, 2 * 2 * HQ * D * tokens * (tokens + 1) / 2."""
    from engine.kernels import cpu

    rng = random.Random(seed)
    nb = -(-tokens // BS)
    g = torch.Generator().manual_seed(seed)
    kc, vc = _pool(kv, nb + 8, g)
    ids = list(range(nb + 8))
    rng.shuffle(ids)
    tables = torch.tensor([ids[:nb]], dtype=torch.int32)
    q, out = torch.randn(tokens, HQ, D, generator=g), torch.empty(tokens, HQ, D)
    rows = cpu.attention_tile_rows(HQ // HKV)
    tiles = torch.tensor([(r, min(rows, tokens - r)) for r in range(0, tokens, rows)][::-1], dtype=torch.int64)
    kv_len, row_seq = torch.arange(1, tokens + 1), torch.zeros(tokens, dtype=torch.int32)
    best = float("inf")
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        cpu.paged_attention(q, kc, vc, tables, row_seq, kv_len, tiles, BS, D ** -0.5, out)
        best = min(best, time.perf_counter() - t0)
    flops = 2 * 2 * HQ * D * tokens * (tokens + 1) / 2
    return {"ms": best * 1e3, "gflops": flops / best / 1e9}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--prefill-tokens", type=int, default=4096)
    ap.add_argument("--output-json", default=None)
    record.add_arguments(ap)
    args = ap.parse_args(argv)
    if not cpu_kernel.available():
        print(f"C kernel unavailable: {cpu_kernel.why_unavailable()}")
        return 1
    load = machine_load()
    print(_fmt_load(load))
    meter = BusyMeter().start()
    rng = random.Random(0)
    cases = [
        ("batch 1, 512 tokens", [512], 0),
        ("batch 8, 64-768", [rng.randint(64, 768) for _ in range(8)], 0),
        ("random: batch 64, 64-768", [rng.randint(64, 768) for _ in range(64)], 0),
        ("labelling: batch 64, 400 shared + 50-170", [400 + rng.randint(50, 170) for _ in range(64)], 400),
        ("batch 128, 64-768", [rng.randint(64, 768) for _ in range(128)], 0),
    ]
    torch_path, kernel_path = TorchAttentionBackend(cpu_kernel=False), TorchAttentionBackend()
    rows = []
    print(f"{'case':42s} {'torch ms':>9s} {'C ms':>7s} {'speedup':>8s} {'max |diff|':>10s}")
    for i, (name, lens, shared) in enumerate(cases):
        num_blocks = max(4096, sum((n + BS - 1) // BS for n in lens) + 64)
        meta, q, k, v, kc, vc = _case(len(lens), lens, shared, num_blocks, seed=i)
        t_ref, o_ref = _time(torch_path, meta, q, k, v, kc, vc, args.repeats)
        t_c, o_c = _time(kernel_path, meta, q, k, v, kc, vc, args.repeats)
        diff = float((o_ref - o_c).abs().max())
        rows.append({"case": name, "batch": len(lens), "kv_tokens": sum(lens), "torch_ms": t_ref * 1e3,
                     "c_ms": t_c * 1e3, "speedup": t_ref / t_c, "max_abs_diff": diff})
        print(f"{name:42s} {t_ref * 1e3:9.3f} {t_c * 1e3:7.3f} {t_ref / t_c:7.2f}x {diff:10.2e}")
    from engine.kernels import cpu

    formats = [f for f in KV_FORMATS if f != "bf16" or cpu.attention_bf16()]  # bf16 where the bf16 unit reads it
    steps, prefill = {}, {}
    print("\none batch-64 decode step's attention over 30 layers (contexts 100-165), C kernel, best of "
          f"{max(3, args.repeats // 4)}:")
    for kv in formats:
        steps[kv] = decode_step_30_layers(kv, max(3, args.repeats // 4))
        print(f"  KV cache {kv}: {steps[kv]['hot_ms']:.2f} ms with one layer's pool in cache, "
              f"{steps[kv]['cold_ms']:.2f} ms over 30 pools in turn", flush=True)
    print(f"\none layer's attention over a {args.prefill_tokens}-token prompt (one prefill chunk), C kernel:")
    for kv in formats:
        prefill[kv] = prefill_one_layer(kv, args.prefill_tokens, 3)
        print(f"  KV cache {kv}: {prefill[kv]['ms']:.1f} ms, {prefill[kv]['gflops']:.0f} GFLOP/s", flush=True)
    if "bf16" in prefill:
        print(f"  bf16 cache on the bf16 unit against fp16 halves in fp32: prefill "
              f"{prefill['fp16']['ms'] / prefill['bf16']['ms']:.2f}x, decode step (cold) "
              f"{steps['fp16']['cold_ms'] / steps['bf16']['cold_ms']:.2f}x")
    busiest = meter.stop() or 0.0
    warn_if_busy(busiest)
    write_json_report(Path(p) if (p := record.output_path(args, "attention_bench")) else None,
                      {"threads": torch.get_num_threads(), "load": load, "other_busy_cores": busiest, "cases": rows,
                       "decode_step_30_layers": steps, "prefill_one_layer": prefill})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
