"""The global prefix planner: tree, depth-first order, shard cuts, ideal hit rate, determinism, and a
job on the real model where the planned order beats input order on cached tokens.

Small hand-checked examples use block_size=2: a row [1, 2, 3, 4, 5] has full blocks (1, 2), (3, 4)
and a partial last block (5).
"""
from __future__ import annotations

import os
import random
import subprocess
import sys

import polars as pl
import pytest

from pipeline import JobSpec, io, read_metrics, run_job
from pipeline.io import InputFile
from pipeline.planner import PrefixTree, Shard, cut_shards, plan_input_order, plan_prefix
from pipeline.testing import FakeLLM

# r0 and r2 share 2 blocks, r3 shares 1 with them; r1 and r4 share 1; r5 has no full block
ROWS = [
    [1, 2, 3, 4, 5],
    [9, 9, 8],
    [1, 2, 3, 4, 6, 7],
    [1, 2, 5, 5],
    [9, 9, 7, 7],
    [4],
]


def tree_of(rows, bs=2) -> PrefixTree:
    t = PrefixTree(bs)
    for r in rows:
        t.add(r)
    return t


def fake_files(*sizes: int) -> list[InputFile]:
    return [InputFile(path=f"f{i}.parquet", size=0, etag=None, num_rows=n) for i, n in enumerate(sizes)]


# ---------------------------------------------------------------- tree and order

def test_groups_and_depth_first_order():
    t = tree_of(ROWS)
    assert t.groups() == [[0, 2, 3], [1, 4]]
    order, lcp = t.order()
    assert order == [0, 2, 3, 1, 4, 5]
    assert lcp == [0, 2, 1, 0, 1, 0]  # blocks shared with the previous row


def test_rows_sharing_nothing_keep_input_order():
    rows = [[i, i + 1, i + 2] for i in range(0, 30, 3)] + [[5]]
    order, lcp = tree_of(rows).order()
    assert order == list(range(len(rows))) and set(lcp) == {0}


def test_interleaved_prefixes_become_adjacent():
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    rows = [(a if i % 2 == 0 else b) + [100 + i, 200 + i] for i in range(6)]
    order, lcp = tree_of(rows).order()
    assert order == [0, 2, 4, 1, 3, 5]
    assert lcp == [0, 2, 2, 0, 2, 2]


def test_identical_rows_share_their_whole_prompt():
    t = tree_of([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4, 5]])
    assert t.groups() == [[0, 1, 2]]
    assert t.order() == ([0, 1, 2], [0, 2, 2])
    # distinct: blocks (1,2), (3,4) once = 4 tokens, + r2's partial block (5) = 5; total 13
    assert t.distinct_tokens == 5 and t.ideal_hit_rate == pytest.approx(1 - 5 / 13)


def test_ideal_hit_rate_by_hand():
    t = tree_of(ROWS)
    # total tokens 5+3+6+4+4+1 = 23; distinct full blocks: (1,2) (1,2|3,4) (1,2|3,4|6,7) (1,2|5,5)
    # (9,9) (9,9|7,7) = 6 blocks = 12 tokens; partial blocks: r0 (5), r1 (8), r5 (4) = 3 tokens
    assert t.prompt_tokens == 23 and t.distinct_tokens == 15
    assert t.ideal_hit_rate == pytest.approx(8 / 23)  # = r2 reuses 4, r3 reuses 2, r4 reuses 2


def test_decode_heavy_first_reorders_items_at_every_node():
    t = PrefixTree(2)
    for i, r in enumerate(ROWS):
        t.add(r, max_tokens=100 if i in (1, 4) else 1)  # the (9, 9) group decodes the most
    order, lcp = t.order(decode_heavy_first=True)
    # at every node, items by output/prompt tokens: root: group (9, 9) 200/7, lone row 5 1/1,
    # group (1, 2) 3/15; in (1, 2): row 3 1/4 before sub-group (3, 4) 2/11; in it: row 0 1/5, row 2 1/6
    assert order == [1, 4, 5, 3, 0, 2] and lcp == [0, 1, 0, 0, 1, 2]


# ---------------------------------------------------------------- shard cuts

def test_cuts_keep_groups_whole():
    order, lcp = tree_of(ROWS).order()
    files = [0] * len(order)
    # size 3: group [0, 2, 3] fits whole; then group [1, 4] + the lone row 5
    assert cut_shards(files, lcp, 3) == [(0, 3), (3, 6)]
    # size 2: group [0, 2, 3] is larger than a shard: cut at its shallowest boundary (after 0, 2,
    # which share 2 blocks); group [1, 4] is never split
    assert cut_shards(files, lcp, 2) == [(0, 2), (2, 3), (3, 5), (5, 6)]


def test_group_larger_than_a_shard_is_split_into_full_shards():
    lcp = [0] + [1] * 9 + [0, 1, 1]  # a group of 10 rows, then a group of 3
    assert cut_shards([0] * 13, lcp, 4) == [(0, 4), (4, 8), (8, 10), (10, 13)]
    # what is left of a split group shares a shard with the next group when both fit
    assert cut_shards([0] * 13, lcp, 5) == [(0, 5), (5, 10), (10, 13)]
    assert cut_shards([0] * 12, lcp[:12], 4) == [(0, 4), (4, 8), (8, 12)]


def test_cuts_never_span_files():
    lcp = [0, 1, 1, 1, 1, 1]
    assert cut_shards([0, 0, 0, 1, 1, 1], lcp, 4) == [(0, 3), (3, 6)]


def test_plan_prefix_shards_and_row_numbers():
    # two files: f0 rows 0..3 = dataset 0..3, f1 rows 0..1 = dataset 4..5
    rows = [(r, 1) for r in ROWS]
    shards, stats = plan_prefix(rows, fake_files(4, 2), shard_size=3, block_size=2)
    # depth-first order [0, 2, 3, 1, 4, 5]: rows 4 and 5 live in f1, so row 1 (f0) is cut off
    assert [(s.file, s.rows, s.file_start) for s in shards] == [
        ("f0.parquet", (0, 2, 3), 0), ("f0.parquet", (1,), 0), ("f1.parquet", (0, 1), 4)]
    assert [s.continues_group for s in shards] == [False, False, True]
    assert [s.dataset_rows() for s in shards] == [[0, 2, 3], [1], [4, 5]]
    assert (stats.rows, stats.groups, stats.grouped_rows) == (6, 2, 5)
    assert stats.ideal_hit_rate == pytest.approx(8 / 23) and stats.order == "prefix"


def test_shard_json_round_trip_and_runs():
    s = Shard(3, "x.parquet", (5, 6, 7, 2, 9, 10), 100, True)
    assert s.runs() == [(5, 3), (2, 1), (9, 2)]
    assert Shard.from_json(s.to_json()) == s
    assert s.name == "part-00003.parquet" and s.length == 6


def test_input_order_plan_with_limit():
    shards = plan_input_order(fake_files(7, 5), 3, limit=9)
    assert [(s.file, s.rows, s.file_start) for s in shards] == [
        ("f0.parquet", (0, 1, 2), 0), ("f0.parquet", (3, 4, 5), 0), ("f0.parquet", (6,), 0),
        ("f1.parquet", (0, 1), 7)]


# ---------------------------------------------------------------- properties

def random_dataset(seed: int, n: int = 300) -> list[list[int]]:
    rng = random.Random(seed)
    templates = [[rng.randrange(50) for _ in range(rng.randrange(0, 40))] for _ in range(6)]
    subs = [[rng.randrange(50) for _ in range(rng.randrange(0, 12))] for _ in range(4)]
    return [rng.choice(templates) + rng.choice(subs) + [rng.randrange(50) for _ in range(rng.randrange(0, 20))]
            for _ in range(n)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_plan_properties(seed):
    bs, size = 4, 16
    data = random_dataset(seed)
    files = fake_files(120, 180)
    shards, stats = plan_prefix([(r, 1) for r in data], files, shard_size=size, block_size=bs)
    flat = [r for s in shards for r in s.dataset_rows()]
    assert sorted(flat) == list(range(len(data)))  # every row exactly once
    assert all(1 <= s.length <= size for s in shards)
    assert all(r < files[0].num_rows for s in shards if s.file == "f0.parquet" for r in s.dataset_rows())

    def shared_blocks(a, b):
        k = 0
        while (k + 1) * bs <= min(len(a), len(b)) and a[k * bs:(k + 1) * bs] == b[k * bs:(k + 1) * bs]:
            k += 1
        return k

    # groups (first block) are contiguous in the order, and the order is depth-first within a file's
    # part of a group: the blocks shared by rows i and j (i < j) are shared by every row between them
    file_of = [0] * 120 + [1] * 180
    first = [tuple(data[r][:bs]) if len(data[r]) >= bs else ("lone", r) for r in flat]
    seen: set = set()
    for i, g in enumerate(first):
        assert g not in seen or first[i - 1] == g
        seen.add(g)
    for i in range(len(flat)):
        for j in range(i + 2, min(i + 12, len(flat))):
            if len({file_of[flat[m]] for m in range(i, j + 1)}) > 1:
                break
            k = shared_blocks(data[flat[i]], data[flat[j]])
            assert all(shared_blocks(data[flat[i]], data[flat[m]]) >= k for m in range(i + 1, j))
    # a group no larger than a shard, within one file, is never split
    tree = tree_of(data, bs)
    shard_of = {r: s.index for s in shards for r in s.dataset_rows()}
    for g in tree.groups():
        for f in (0, 1):
            part = [r for r in g if file_of[r] == f]
            if part and len(part) <= size:
                assert len({shard_of[r] for r in part}) == 1


def test_shuffled_dataset_reaches_the_same_ideal_and_grouping():
    data = random_dataset(7)
    shuffled = data[:]
    random.Random(1).shuffle(shuffled)
    a, b = tree_of(data, 4), tree_of(shuffled, 4)
    assert a.ideal_hit_rate == b.ideal_hit_rate
    groups = lambda t, d: sorted(sorted(map(tuple, (d[r] for r in g))) for g in t.groups())  # noqa: E731
    assert groups(a, data) == groups(b, shuffled)


def test_plan_is_deterministic_across_processes():
    code = ("from tests.test_planner import random_dataset, fake_files\n"
            "from pipeline.planner import plan_prefix\n"
            "s, _ = plan_prefix([(r, 1) for r in random_dataset(3)], fake_files(300), 16, block_size=4)\n"
            "print([x.to_json() for x in s])")
    outs = set()
    for hashseed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hashseed}
        outs.add(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                env=env, cwd=os.path.dirname(os.path.dirname(__file__))).stdout)
    shards, _ = plan_prefix([(r, 1) for r in random_dataset(3)], fake_files(300), 16, block_size=4)
    assert outs == {str([x.to_json() for x in shards]) + "\n"}


# ---------------------------------------------------------------- jobs

INSTRUCTIONS = [
    "You label short product reviews. Read the review and answer with one word: positive, negative or "
    "neutral. Do not explain your answer and do not repeat the review. Reviews may be short.",
    "You translate short sentences from English into French. Write only the French sentence, with no quotes, "
    "no notes and no other text. Keep names as they are and keep the punctuation.",
]
ITEMS = ["Tea was cold.", "I love this lamp.", "Broke after a day.", "Fine, nothing special.",  # distinct
         "Great value.", "Opened box.", "Works as described.", "Loud."]  # first letters: no deeper sharing


def interleaved(n: int) -> pl.DataFrame:
    """Two shared instructions alternating row by row (the worst case for input order)."""
    return pl.DataFrame({
        "id": [f"r{i:02d}" for i in range(n)],
        "prompt": [f"{INSTRUCTIONS[i % 2]}\n\n{ITEMS[i // 2 % len(ITEMS)]} ({i})" for i in range(n)],
        "task": [i % 2 for i in range(n)],
    })


def read_parts(out) -> pl.DataFrame:
    parts = sorted(p for p in os.listdir(out) if p.startswith("part-"))
    return pl.concat([pl.read_parquet(os.path.join(out, p)).with_columns(pl.lit(p).alias("part")) for p in parts])


def test_job_groups_interleaved_prefixes_and_resumes_exactly(tmp_path):
    inp = tmp_path / "in.parquet"
    interleaved(12).write_parquet(inp)
    spec = JobSpec(input=str(inp), output=str(tmp_path / "out"), max_tokens=4, shard_size=3, progress=False,
                   shards_in_flight=1)
    full = run_job(spec.model_copy(update={"output": str(tmp_path / "full")}), FakeLLM())
    df = read_parts(tmp_path / "full")
    # each part holds rows of one instruction, in input order within it: 0 2 4 | 6 8 10 | 1 3 5 | 7 9 11
    assert df["id"].to_list() == [f"r{i:02d}" for i in (0, 2, 4, 6, 8, 10, 1, 3, 5, 7, 9, 11)]
    assert df.group_by("part").agg(pl.col("task").n_unique())["task"].to_list() == [1, 1, 1, 1]
    assert df.sort("id")["task"].to_list() == interleaved(12)["task"].to_list()  # pass-through follows its row
    assert full.plan == "prefix" and 0.5 < full.ideal_prefix_hit_rate < 1
    manifest = io.read_json(str(tmp_path / "full" / "_job" / "manifest.json"))
    assert manifest["plan"]["groups"] == 2 and manifest["shards"][0]["runs"] == [[0, 1], [2, 1], [4, 1]]

    class Killed(Exception):
        pass

    def die(result):
        raise Killed

    with pytest.raises(Killed):
        run_job(spec, FakeLLM(), on_shard_done=die)
    llm = FakeLLM()
    report = run_job(spec, llm)
    assert llm.prompts_seen == 9 and report.rows_skipped == 3
    timing = ["ttft_s", "latency_s"]
    assert read_parts(tmp_path / "out").drop(timing).equals(df.drop(timing))


def test_input_order_plan_keeps_contiguous_shards(tmp_path):
    inp = tmp_path / "in.parquet"
    interleaved(7).write_parquet(inp)
    run_job(JobSpec(input=str(inp), output=str(tmp_path / "out"), max_tokens=2, shard_size=3, progress=False,
                    plan="input"), FakeLLM())
    df = read_parts(tmp_path / "out")
    assert df["id"].to_list() == [f"r{i:02d}" for i in range(7)]
    m = read_metrics(str(tmp_path / "out")).row(0, named=True)
    assert m["plan"] == "input" and m["ideal_prefix_hit_rate"] is None


def test_planned_order_beats_input_order_on_the_real_model(llm, tmp_path):
    """A KV pool of 7 blocks (a row needs 6) and one sequence at a time: in input order each instruction's blocks are
    evicted by the other's before they are used again; planned, each is computed about once."""
    from engine import LLM
    from pipeline.plan import planned_context_length

    block_bytes = llm.kv_bytes_per_token * 16  # the default cache's block (fp16 K and V)
    inp = tmp_path / "in.parquet"
    interleaved(10).write_parquet(inp)
    runs = {}
    for plan in ("input", "prefix"):
        # a fresh engine (the weights are shared) for each run: no cached blocks from the other run
        small = LLM("smollm2-135m-instruct", kv_cache_memory_bytes=7 * block_bytes, max_num_seqs=1)
        out = tmp_path / plan
        spec = JobSpec(input=str(inp), output=str(out), max_tokens=4, shard_size=5, progress=False, plan=plan)
        # a job that plans before its engine loads takes the context this engine has: 7 blocks of 16
        assert planned_context_length(spec.model_copy(update={"kv_cache_memory_bytes": 7 * block_bytes})) == \
            small.max_model_len == 7 * 16
        report = run_job(spec, small)
        runs[plan] = (report, read_parts(out).sort("id"))
    (r_in, df_in), (r_pl, df_pl) = runs["input"], runs["prefix"]
    assert r_pl.cached_tokens > r_in.cached_tokens
    assert r_pl.prompt_tokens_computed < r_in.prompt_tokens_computed
    assert r_pl.prompt_tokens == r_in.prompt_tokens
    assert r_pl.prefix_cache_hit_rate <= r_pl.ideal_prefix_hit_rate + 1e-9
    assert r_pl.prefix_cache_hit_rate >= 0.9 * r_pl.ideal_prefix_hit_rate
    assert r_in.prefix_cache_hit_rate < 0.9 * r_pl.ideal_prefix_hit_rate
    assert df_pl["generation"].to_list() == df_in["generation"].to_list()  # greedy: same text per id
    assert df_pl["error"].null_count() == 10


def test_a_plan_made_before_the_engine_loads_knows_the_models_context(tmp_path):
    """`tokenmill run` plans before it loads the model, so the plan takes the context from the model's
    metadata (`planned_context_length`): prompts longer than it are error rows and count in no statistic.
    It used to count them when --max-model-len was not given (a trial's report: ideal 0.007 against an
    achieved 0.48).

    dummy:llama-tiny-4kv has a 2,048-token context; FakeTokenizer: one token per byte, the template 22.
    Good rows: 42 tokens, the first block (16) shared, the second (16) and the last 10 their own; a
    1,022-token row shares nothing; two rows of 2,122 tokens do not fit.
    """
    from pipeline.plan import plan_job, planned_context_length
    from pipeline.testing import FakeTokenizer

    inp = tmp_path / "in.parquet"
    good = ["S" * 18 + f"-{i}" for i in range(4)]  # 22 + 20 = 42 tokens
    pl.DataFrame({"id": list(range(7)), "prompt": [good[0], "L" * 2100, good[1], good[2], "M" * 2100, good[3],
                                                   "N" * 1000]}).write_parquet(inp)
    files = io.list_input_files(str(inp))
    spec = JobSpec(input=str(inp), output=str(tmp_path / "out"), model="dummy:llama-tiny-4kv", max_tokens=2)
    assert planned_context_length(spec) == 2048
    _, stats = plan_job(spec, files, FakeTokenizer())
    assert (stats.prompt_tokens, stats.distinct_tokens) == (4 * 42 + 1022, 16 + 4 * (16 + 10) + 1022)
    _, explicit = plan_job(spec, files, FakeTokenizer(), max_model_len=2048)  # what a loaded engine would say
    assert stats.ideal_hit_rate == explicit.ideal_hit_rate == pytest.approx(1 - 1142 / 1190)

    shorter = spec.model_copy(update={"max_model_len": 512})  # the option, within the model's context
    assert planned_context_length(shorter) == 512
    assert plan_job(shorter, files, FakeTokenizer())[1].prompt_tokens == 4 * 42
    assert planned_context_length(spec.model_copy(update={"max_model_len": 4096})) == 2048  # capped by the model
    from engine.config import EngineConfig
    from engine.loader import min_kv_cache_memory_bytes
    from engine.weights import dummy_config

    block = min_kv_cache_memory_bytes(EngineConfig(model=spec.model), dummy_config("llama-tiny-4kv"))
    budget = spec.model_copy(update={"kv_cache_memory_bytes": 3 * block})  # 3 blocks of 16: a 48-token context
    assert planned_context_length(budget) == 48
    assert plan_job(budget, files, FakeTokenizer())[1].prompt_tokens == 4 * 42


def test_ideal_hit_rate_leaves_out_error_rows(tmp_path):
    """Rows that will be error rows (too long for the engine, null prompt, null id) add no prompt tokens.

    FakeTokenizer: one token per byte, and the template adds 22 ("<|user|>" ... "\\n<|assistant|>").
    Good rows: "Q" * 26 + digit = 49 tokens: blocks 0-1 (32 tokens) shared by all four, block 2
    (tokens 32-47) and the last token their own: distinct 2 * 16 + 4 * 16 + 4 = 100 of 4 * 49 = 196.
    """
    inp = tmp_path / "in.parquet"
    good = ["Q" * 26 + str(i) for i in range(4)]
    too_long = ["Q" * 26 + "x" * 40 + str(i) for i in range(2)]  # 89 tokens >= max_model_len 64
    pl.DataFrame({
        "id": ["g0", "g1", "long0", "g2", "null-prompt", None, "long1", "g3"],
        "prompt": [good[0], good[1], too_long[0], good[2], None, "Q" * 26 + "9", too_long[1], good[3]],
    }).write_parquet(inp)
    with pytest.warns(UserWarning, match="null or NaN 'id'"):
        report = run_job(JobSpec(input=str(inp), output=str(tmp_path / "out"), max_tokens=2, progress=False),
                         FakeLLM(max_model_len=64))
    assert (report.rows_ok, report.rows_error) == (4, 4)
    assert report.prompt_tokens == 4 * 49
    assert report.ideal_prefix_hit_rate == pytest.approx(96 / 196)
    m = io.read_json(str(tmp_path / "out" / "_job" / "manifest.json"))["plan"]
    assert (m["prompt_tokens"], m["distinct_tokens"], m["rows"]) == (196, 100, 8)


def test_the_planner_groups_rows_by_the_engines_block_hashes():
    """The planner's block keys are the hashes under which the engine's prefix cache keeps the
    blocks (`engine.kv_cache.chain_block_keys`): one rule, whether a sequence grows a block at a
    time or a dataset is hashed at once; rows that differ in one token of block 1 share block 0 only."""
    from engine.kv_cache import block_hashes, chain_block_keys

    bs = 4
    a = [5, 9, 2, 7, 1, 1, 3, 8, 4, 6, 0]
    b = a[:5] + [2] + a[6:]
    rows = block_hashes([a, b, a[:3]], bs)
    assert [len(r) for r in rows] == [2, 2, 0]
    engine_a = chain_block_keys(a, bs, 1)
    engine_a += chain_block_keys(a, bs, 2, engine_a)  # extended a block at a time
    assert rows[0].tolist() == [h for h, _ in engine_a]
    assert engine_a[0][1] == (None, tuple(a[:4])) and engine_a[1][1] == (engine_a[0][0], tuple(a[4:8]))
    assert rows[1][0] == rows[0][0] and rows[1][1] != rows[0][1]
    tree = PrefixTree(bs)
    for r in (a, b):
        tree.add(r)
    tree._ensure()
    assert tree._allh.tolist() == rows[0].tolist() + rows[1].tolist()
