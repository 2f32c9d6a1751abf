"""What tensor parallelism costs in communication on this machine: all-reduce time per step and its share.

A sharded Llama step does 2 L + 1 all-reduces of the [T, H] fp32 residual stream (the
embedding, then o and down in each of L layers: Megatron-LM, arXiv 1909.08053), one
gather of the LM head's vocabulary slices on rank 0, and one broadcast of the step's
inputs (header + packed payload). This measures, for decode steps of N rows (each row
attending to --context tokens in its own KV blocks):

1. the engine's step at TP = 1 (with 1 thread, the compute one rank has at TP = N on N
   cores, and with all the machine's threads) and at TP = N (1 thread per rank), and on
   the driver the time spent in all-reduces, the gather and the broadcasts per step, and
   the all-reduce share of the step. On the CPU a collective's wall time includes waiting
   for the slowest rank, so "all-reduce" here is communication plus rank skew;
2. the bare gloo all-reduce of a [T, H] fp32 tensor between N processes doing nothing
   else (median of --repeats), times 2 L + 1: the communication floor of one step;
3. end to end: `LLM.generate` output tokens/s at TP = 1 and TP = N on a small batch.

On a 2-core machine tensor parallelism cannot speed anything up (the ranks share the cores
that one process would use); the point is the measured cost of communication.

    python -m benchmarks.tp_allreduce [--model dummy:qwen2-0.5b] [--tp 2] [--rows 1,8,32,128]
        [--context 128] [--repeats 5] [--kv-cache-memory-bytes N] [--output-json F]
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the other benchmarks

import argparse  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Optional  # noqa: E402

import torch  # noqa: E402

from benchmarks import record  # noqa: E402
from benchmarks.hf_compare import _fmt_load, machine_load, write_json_report  # noqa: E402


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def step_figures(llm, rows: int, context: int, repeats: int) -> dict:
    """Median ms of one forward pass of `rows` decode rows at `context`, and on a TP driver the
    ms per step in all-reduces, the logits gather and the input broadcasts (means)."""
    from benchmarks.step_cost import decode_step_times

    g = llm.runner.tp
    c0: list = []

    def counters() -> None:  # after the warm-up passes
        if g is not None:
            c0[:] = [g.comm_s, g.gather_s, g.broadcast_s, g.num_all_reduces]

    ts = decode_step_times(llm, rows, context, repeats, after_warmup=counters)
    out = {"rows": rows, "step_ms": _median(ts) * 1e3, "mean_step_ms": sum(ts) / len(ts) * 1e3}
    if g is not None:
        out["all_reduce_ms"] = (g.comm_s - c0[0]) / repeats * 1e3
        out["gather_ms"] = (g.gather_s - c0[1]) / repeats * 1e3
        out["broadcast_ms"] = (g.broadcast_s - c0[2]) / repeats * 1e3
        out["all_reduces_per_step"] = (g.num_all_reduces - c0[3]) // repeats
        out["all_reduce_share"] = out["all_reduce_ms"] / out["mean_step_ms"]
    return out


def _micro_worker(rank: int, world: int, where: tuple, shapes: list[tuple[int, int]], repeats: int) -> None:
    """Rank > 0 of the bare all-reduce measurement (1 thread): the same all-reduces as rank 0."""
    torch.set_num_threads(1)
    from engine.parallel.group import TPGroup, make_store

    g = TPGroup(make_store(rank, world, where, 60.0), rank, world, torch.device("cpu"), 60.0)
    for t, h in shapes:
        x = torch.randn(t, h)
        for _ in range(3):
            g.all_reduce_(x)
        for _ in range(repeats):
            g.all_reduce_(x)
    g.shutdown()


def bare_all_reduce(world: int, shapes: list[tuple[int, int]], repeats: int) -> list[float]:
    """Median seconds of one gloo all-reduce per [T, H] fp32 shape between `world` processes."""
    import tempfile

    import torch.multiprocessing as mp

    from engine.parallel.group import make_store

    tmp = tempfile.TemporaryDirectory(prefix="tokenmill-tp-bench-")
    where = ("file", os.path.join(tmp.name, "store"))
    store = make_store(0, world, where, 60.0)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_micro_worker, args=(r, world, where, shapes, repeats), daemon=True)
             for r in range(1, world)]
    for p in procs:
        p.start()
    # rank 0 runs here, on the store it already bound
    from engine.parallel.group import TPGroup

    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    g = TPGroup(store, 0, world, torch.device("cpu"), 60.0)
    res = []
    for t, h in shapes:
        x = torch.randn(t, h)
        for _ in range(3):
            g.all_reduce_(x)
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            g.all_reduce_(x)
            ts.append(time.perf_counter() - t0)
        res.append(_median(ts))
    for p in procs:
        p.join(30)
    g.shutdown()
    tmp.cleanup()
    torch.set_num_threads(torch_threads)
    return res


def generate_tok_s(llm, prompts: list[str], max_tokens: int) -> float:
    """Output tokens per second of one greedy generate (EOS ignored)."""
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tp_allreduce", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="dummy:qwen2-0.5b")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--rows", default="1,8,32,128")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=1 << 30, help="per rank")
    p.add_argument("--output-json", type=Path, default=None)
    record.add_arguments(p)
    args = p.parse_args(argv)
    from engine import LLM
    from engine.threads import default_num_threads

    rows = [int(x) for x in args.rows.split(",") if x.strip()]
    cores = default_num_threads()
    load0 = machine_load()
    print(f"{args.model}, TP = {args.tp} vs 1, decode rows at context {args.context}; {cores} cores; {_fmt_load(load0)}")
    kw = dict(speculative=None, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
              max_num_seqs=max(rows + [args.prompts]))
    prompts = [f"Item {i}: the quick brown fox jumps over the lazy dog, and then" for i in range(args.prompts)]
    report: dict = {"model": args.model, "tp": args.tp, "context": args.context, "cores": cores, "load_start": load0}
    for label, threads in (("tp1_1thread", 1), (f"tp1_{cores}threads", cores)):
        llm = LLM(args.model, num_threads=threads, **kw)
        report[label] = [step_figures(llm, n, args.context, args.repeats) for n in rows]
        report[label + "_generate_tok_s"] = generate_tok_s(llm, prompts, args.max_tokens)
        del llm
    with LLM(args.model, tensor_parallel_size=args.tp, num_threads=1, **kw) as llm:
        layers = llm.model_config.num_layers
        hidden = llm.model_config.hidden_size
        report[f"tp{args.tp}"] = [step_figures(llm, n, args.context, args.repeats) for n in rows]
        report[f"tp{args.tp}_generate_tok_s"] = generate_tok_s(llm, prompts, args.max_tokens)
    bare = bare_all_reduce(args.tp, [(n, hidden) for n in rows], max(args.repeats, 20))
    report["bare_all_reduce_ms"] = {n: b * 1e3 for n, b in zip(rows, bare)}
    report["all_reduces_per_step"] = 2 * layers + 1

    one, full, tp = report["tp1_1thread"], report[f"tp1_{cores}threads"], report[f"tp{args.tp}"]
    print(f"\nstep ms (median of {args.repeats}); TP = {args.tp} driver's time in collectives per step (means)")
    print(f"{'rows':>5} {'TP1 1thr':>9} {f'TP1 {cores}thr':>9} {f'TP{args.tp}':>8} {'all-red':>8} {'share':>6} "
          f"{'gather':>7} {'bcast':>6} {'bare x' + str(2 * layers + 1):>9}")
    for a, b, c in zip(one, full, tp):
        floor = report["bare_all_reduce_ms"][a["rows"]] * (2 * layers + 1)
        print(f"{a['rows']:>5} {a['step_ms']:>9.2f} {b['step_ms']:>9.2f} {c['step_ms']:>8.2f} "
              f"{c['all_reduce_ms']:>8.2f} {c['all_reduce_share']:>6.0%} {c['gather_ms']:>7.2f} "
              f"{c['broadcast_ms']:>6.2f} {floor:>9.2f}")
    print(f"\nbare gloo all-reduce of [T, {hidden}] fp32 between {args.tp} processes (ms): "
          + ", ".join(f"T={n}: {v:.3f}" for n, v in report["bare_all_reduce_ms"].items()))
    print(f"generate, {args.prompts} prompts x {args.max_tokens} tokens, output tok/s: "
          f"TP1 1 thread {report['tp1_1thread_generate_tok_s']:.1f}, TP1 {cores} threads "
          f"{report[f'tp1_{cores}threads_generate_tok_s']:.1f}, TP{args.tp} {report[f'tp{args.tp}_generate_tok_s']:.1f}")
    report["load_end"] = machine_load()
    print(f"machine at end: {_fmt_load(report['load_end'])}")
    write_json_report(record.output_path(args, "tp_allreduce"), report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
