"""The global prefix planner: planning time for 100k prompts, ideal hit rate, and (optionally) a job on
the real model with and without the plan.

Part 1, tokens (always): ``--rows`` (100,000) synthetic prompts as token ids, built like real batch
jobs: one system header (30 tokens) shared by all; 24 tasks, each with an instruction of 150-400
tokens and 1-4 few-shot variants of 50-200 tokens; a unique item of 50-150 tokens per row; rows
shuffled. Times `PrefixTree` (hashing full blocks), the tree, the depth-first order and the shard
cuts (`plan_prefix`, shard size 256).

Part 2, text (``--text-rows``, default 100,000; 0 skips it): the same shape in words (the docstrings
of ``data/labelling.parquet`` as items), written to a Parquet file and planned the way a job does it:
read the prompt column, apply SmolLM2's chat template, tokenise in batches (`TokenizedRows`), plan.

Part 3, engine (``--engine``): a labelling job on SmolLM2-135M on this CPU (``--job-rows`` rows, two
shared instructions of about 400 tokens alternating row by row, items of 50-150 tokens, 16 output
tokens, greedy, a KV pool smaller than the job). Runs (a) no prefix caching, input order; (b) prefix
caching, input order; (c) prefix caching + the planner; and (d) the planner with decode-heavy groups
first on a variant whose two instructions ask for 4 and 48 output tokens (EOS ignored), against (c)
on the same variant. Prints throughput, prompt tokens computed, hit rate vs ideal, and c/a, c/b.

Usage::

    python -m benchmarks.planner_bench [--rows 100000] [--text-rows 100000] [--engine]
                                       [--job-rows 128]
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

DATA = Path(__file__).resolve().parent.parent / "data" / "labelling.parquet"


def machine_load() -> str:
    from benchmarks.hf_compare import _fmt_load, machine_load as load

    return _fmt_load(load(0.5))


# ---------------------------------------------------------------- part 1: token ids

def synthetic_token_rows(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    rand = lambda k: [rng.randrange(3, 49152) for _ in range(k)]  # noqa: E731
    header = rand(30)
    tasks = []
    for _ in range(24):
        instruction = rand(rng.randrange(150, 401))
        tasks.append([header + instruction + rand(rng.randrange(50, 201)) for _ in range(rng.randrange(1, 5))])
    rows = [rng.choice(rng.choice(tasks)) + rand(rng.randrange(50, 151)) for _ in range(n)]
    rng.shuffle(rows)
    return rows


def bench_tokens(n: int) -> None:
    from pipeline.io import InputFile
    from pipeline.planner import plan_prefix

    t0 = time.perf_counter()
    rows = synthetic_token_rows(n)
    gen_s = time.perf_counter() - t0
    files = [InputFile(path="synthetic.parquet", size=0, etag=None, num_rows=n)]
    t0 = time.perf_counter()
    shards, stats = plan_prefix(((r, 16) for r in rows), files, shard_size=256)
    plan_s = time.perf_counter() - t0
    print(f"part 1, token ids: {n:,} prompts, {stats.prompt_tokens:,} prompt tokens "
          f"(made in {gen_s:.1f} s, not timed)")
    print(f"  plan (tree + depth-first order + shard cuts): {plan_s:.2f} s  "
          f"({n / plan_s:,.0f} prompts/s, {stats.prompt_tokens / plan_s / 1e6:.1f} M tokens/s)")
    print(f"  groups {stats.groups}, grouped rows {stats.grouped_rows:,}, shards {len(shards)}, "
          f"distinct tokens {stats.distinct_tokens:,}, ideal hit rate {stats.ideal_hit_rate:.4f}")


# ---------------------------------------------------------------- part 2: text through the tokenizer

def synthetic_text_rows(n: int, seed: int = 0) -> list[str]:
    import polars as pl

    docs = pl.read_parquet(DATA)["prompt"].to_list()
    items = [d.split("\n\n", 1)[-1] for d in docs]
    words = " ".join(docs).split()
    rng = random.Random(seed)
    text = lambda k: " ".join(rng.choice(words) for _ in range(k))  # noqa: E731
    tasks = []
    for t in range(24):
        instruction = f"Task {t}. " + text(rng.randrange(100, 280))
        tasks.append([instruction + "\n\nExamples:\n" + text(rng.randrange(35, 140)) for _ in range(rng.randrange(1, 5))])
    rows = [rng.choice(rng.choice(tasks)) + "\n\nItem:\n" + rng.choice(items)[:600] + f" #{i}" for i in range(n)]
    rng.shuffle(rows)
    return rows


def bench_text(n: int) -> None:
    import polars as pl

    from engine.config import SamplingParams
    from engine.tokenizer import Tokenizer
    from pipeline import io
    from pipeline.planner import TokenizedRows, plan_prefix

    tok = Tokenizer.default()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "prompts.parquet")
        pl.DataFrame({"id": list(range(n)), "prompt": synthetic_text_rows(n)}).write_parquet(path, row_group_size=16384)
        files = io.list_input_files(path)
        rows = TokenizedRows(files, tok, SamplingParams(max_tokens=16), use_chat_template=True)
        t0 = time.perf_counter()
        shards, stats = plan_prefix(rows, files, shard_size=256)
        total = time.perf_counter() - t0
    print(f"part 2, text: {n:,} prompts from Parquet, {stats.prompt_tokens:,} prompt tokens after the chat template")
    print(f"  read + chat template + batch tokenise: {stats.tokenize_s:.2f} s; plan: {stats.plan_s:.2f} s; "
          f"total {total:.2f} s ({n / total:,.0f} prompts/s)")
    print(f"  groups {stats.groups}, shards {len(shards)}, ideal hit rate {stats.ideal_hit_rate:.4f}")


# ---------------------------------------------------------------- part 3: the engine

INSTRUCTIONS = [
    "You are labelling documentation from the Python standard library. Read the docstring below and decide "
    "which topic it is mostly about. The topics are: files, network, text, math, concurrency, data. ",
    "You are reviewing documentation from the Python standard library for a style guide. Read the docstring "
    "below and say whether it explains its arguments, its return value and its errors. ",
]


def job_dataset(rows: int, seed: int = 0) -> list[dict]:
    """Two ~400-token instructions (with few-shot examples) alternating; items of 50-150 tokens."""
    import polars as pl

    docs = pl.read_parquet(DATA)
    rng = random.Random(seed)
    items = [p.split("\n\n", 1)[-1][:500] for p in docs["prompt"].to_list()]
    shots = [f"Example {k}:\n{items[k][:300]}\nAnswer: {docs['reference_label'][k]}\n" for k in range(6)]
    heads = [ins + "Here are examples.\n" + "".join(shots[3 * i:3 * i + 3]) for i, ins in enumerate(INSTRUCTIONS)]
    out = []
    for i in range(rows):
        out.append({"id": i, "prompt": heads[i % 2] + "\nNow this one:\n" + rng.choice(items) + f"\n(item {i})",
                    "task": i % 2})
    return out


def run_job_config(name: str, table: list[dict], out_dir: str, llm: Any, **spec_kw: Any) -> dict:
    import polars as pl

    from pipeline import JobSpec, read_metrics, run_job

    inp = os.path.join(out_dir, f"{name}.parquet")
    pl.DataFrame(table).write_parquet(inp)
    spec = JobSpec(input=inp, output=os.path.join(out_dir, name), progress=False, overwrite=True, **spec_kw)
    t0 = time.perf_counter()
    run_job(spec, llm)
    wall = time.perf_counter() - t0
    m = read_metrics(spec.output).row(-1, named=True)
    df = pl.concat([pl.read_parquet(os.path.join(spec.output, p)) for p in sorted(os.listdir(spec.output))
                    if p.startswith("part-")]).sort("id")
    st = llm.stats  # cumulative over the engine's life: each config runs on a fresh engine
    return {"name": name, "wall_s": wall, "m": m, "gens": df["generation"].to_list(), "steps": st.num_steps,
            "model_s": st.time_model_s}


def bench_engine(job_rows: int, configs: str = "abc,d") -> int:
    from engine import LLM

    common = dict(max_num_seqs=16, max_num_batched_tokens=2048, num_threads=2)
    # about 400 prompt tokens + 16 output tokens per row at 16 seqs: a pool of 240 blocks (3,840 tokens)
    # holds about 8 rows, far less than the job
    pool = dict(kv_cache_memory_bytes=240 * 16 * 30 * 2 * 3 * 64 * 4)
    llm_off = LLM("smollm2-135m-instruct", enable_prefix_caching=False, **common, **pool)
    fresh = lambda: LLM("smollm2-135m-instruct", enable_prefix_caching=True, **common, **pool)  # noqa: E731
    llm_on = fresh()
    table = job_dataset(job_rows)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        kw = dict(max_tokens=16, shard_size=64, shards_in_flight=2)
        print(f"part 3, engine: {job_rows} rows, KV pool {llm_on.num_total_blocks} blocks of 16; {machine_load()}")
        if "abc" in configs:
            # each config on a fresh engine (shared weights): no blocks cached by an earlier config
            rows.append(run_job_config("a_nocache_input", table, d, llm_off, plan="input", **kw))
            rows.append(run_job_config("b_cache_input", table, d, fresh(), plan="input", **kw))
            rows.append(run_job_config("c_cache_planned", table, d, fresh(), plan="prefix", **kw))
        if "d" in configs:
            # decode-heavy-first: the second instruction's rows decode 48 tokens, the first's 4; measured
            # twice, alternating, on fresh engines
            var = [{**r, "max_tokens": 48 if r["task"] == 1 else 4} for r in table]
            kw2 = dict(max_tokens=16, shard_size=job_rows, shards_in_flight=1, sampling_options={"ignore_eos": True})
            for rep in range(2):
                rows.append(run_job_config(f"c2_dfs_mixed_decode#{rep}", var, d, fresh(), plan="prefix", **kw2))
                rows.append(run_job_config(f"d_decode_heavy_first#{rep}", var, d, fresh(), plan="prefix",
                                           decode_heavy_first=True, **kw2))
    print(f"{'config':<26}{'wall s':>8}{'steps':>7}{'out tok/s':>10}{'prompt tok':>11}{'computed':>10}{'hit rate':>9}"
          f"{'ideal':>7}")
    for r in rows:
        m = r["m"]
        ideal = m["ideal_prefix_hit_rate"]
        print(f"{r['name']:<26}{r['wall_s']:>8.1f}{r['steps']:>7}{m['completion_tokens'] / r['wall_s']:>10.1f}{m['prompt_tokens']:>11,}"
              f"{m['prompt_tokens_computed']:>10,}{m['prefix_cache_hit_rate']:>9.3f}"
              f"{ideal if ideal is not None else float('nan'):>7.3f}")
    same = True
    if "abc" in configs:
        a, b, c = rows[0], rows[1], rows[2]
        print(f"c/a throughput {a['wall_s'] / c['wall_s']:.2f}x, c/b {b['wall_s'] / c['wall_s']:.2f}x; hit rate "
              f"c / ideal {c['m']['prefix_cache_hit_rate'] / max(c['m']['ideal_prefix_hit_rate'] or 1e-9, 1e-9):.3f}")
        same = a["gens"] == b["gens"] == c["gens"]
        print(f"greedy generations identical across a, b, c: {same}")
    if "d" in configs:
        dfs = [r["wall_s"] for r in rows if r["name"].startswith("c2_")]
        dhf = [r["wall_s"] for r in rows if r["name"].startswith("d_")]
        steps = {r["name"][:2]: r["steps"] for r in rows}
        print(f"decode-heavy first vs depth-first, mixed decode lengths (wall s per repeat): depth-first "
              f"{[round(x, 1) for x in dfs]}, decode-heavy first {[round(x, 1) for x in dhf]}; ratio of sums "
              f"{sum(dfs) / sum(dhf):.3f}x; engine steps {steps.get('c2')} vs {steps.get('d_')}")
    print(machine_load())
    return 0 if same else 1


def simulate_steps(prompts: list[list[int]], max_tokens: list[int], *, max_num_seqs: int = 16,
                   budget: int = 2048, num_blocks: int = 240, block_size: int = 16) -> dict[str, Any]:
    """Replay the engine's own Scheduler and BlockPool (prefix caching on) without the model: every
    sampled token is a dummy, every row decodes exactly its max_tokens. Returns steps, batched tokens,
    prompt tokens computed, and a CPU step-time model for SmolLM2-135M here (about 18 ms per step to
    stream the weights + 2 ms per token of compute; ENVIRONMENT.md's matmul rates)."""
    from types import SimpleNamespace

    from engine.kv_cache import BlockPool
    from engine.request import Sequence
    from engine.scheduler import Scheduler

    sched = Scheduler(BlockPool(num_blocks, True), block_size, max_num_seqs, budget, True)
    for i, (ids, mt) in enumerate(zip(prompts, max_tokens)):
        req = SimpleNamespace(prompt_token_ids=list(ids), max_tokens=mt)
        sched.add(Sequence(seq_id=i, request=req, index=0, token_ids=list(ids)))
    steps = tokens = computed = 0
    while sched.has_unfinished():
        out = sched.schedule()
        if out.is_empty:
            raise RuntimeError("simulation stalled")
        steps += 1
        tokens += out.num_tokens
        computed += sum(c.num_tokens for c in out.prefills)
        for c in out.chunks:
            sampled = c.samples
            c.seq.num_computed_tokens += c.num_tokens
            sched.register_computed(c.seq)
            if sampled:
                c.seq.token_ids.append(7)
                if c.seq.num_output_tokens >= c.seq.request.max_tokens:
                    sched.finish(c.seq)
    return {"steps": steps, "batched_tokens": tokens, "prefill_tokens": computed,
            "model_s": steps * 0.018 + tokens * 0.002}


def bench_decode_heavy(rows: int) -> None:
    """Depth-first vs decode-heavy-first on the engine's scheduler: two ~400-token instructions, the
    first asking for 4 output tokens, the second for 48 (the first group comes first in input order)."""
    from engine.tokenizer import Tokenizer
    from pipeline.planner import PrefixTree

    tok = Tokenizer.default()
    table = job_dataset(rows)
    ids = tok.encode_batch([tok.apply_chat_template([{"role": "user", "content": r["prompt"]}]) for r in table])
    for short, long in ((4, 48), (16, 64), (1, 128)):
        mts = [long if r["task"] == 1 else short for r in table]
        tree = PrefixTree(16)
        for x, m in zip(ids, mts):
            tree.add(x, m)
        res = {}
        for name, dhf in (("depth-first", False), ("decode-heavy first", True)):
            order, _ = tree.order(decode_heavy_first=dhf)
            res[name] = simulate_steps([ids[r] for r in order], [mts[r] for r in order])
        a, b = res["depth-first"], res["decode-heavy first"]
        print(f"  max_tokens {short}/{long}: depth-first {a['steps']} steps, {a['batched_tokens']:,} tokens, "
              f"model {a['model_s']:.1f} s; decode-heavy first {b['steps']} steps, {b['batched_tokens']:,} tokens, "
              f"model {b['model_s']:.1f} s; speedup {a['model_s'] / b['model_s']:.3f}x")


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=100_000, help="prompts of part 1 (token ids)")
    ap.add_argument("--text-rows", type=int, default=100_000, help="prompts of part 2 (text; 0 skips)")
    ap.add_argument("--engine", action="store_true", help="also run part 3 on the real model (minutes)")
    ap.add_argument("--job-rows", type=int, default=128, help="rows of part 3's job")
    ap.add_argument("--configs", default="abc,d", help="part 3's configurations: abc (caching/plan), d (decode-heavy)")
    ap.add_argument("--simulate-rows", type=int, default=256,
                    help="rows of the decode-heavy-first scheduler replay (0 skips it)")
    args = ap.parse_args(argv)
    print(f"machine: {os.cpu_count()} cores; {machine_load()}")
    if args.rows:
        bench_tokens(args.rows)
    if args.text_rows:
        bench_text(args.text_rows)
    if args.simulate_rows:
        print(f"decode-heavy first, replayed on the engine's scheduler ({args.simulate_rows} rows, 16 seqs, "
              f"budget 2048, 240 blocks):")
        bench_decode_heavy(args.simulate_rows)
    if args.engine:
        return bench_engine(args.job_rows, args.configs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
