"""Automatic prefix caching: the block pool's index and LRU, and greedy equality
with caching off and on (second pass, shared prefixes of 1-3 blocks, exact block
multiples, preemption, n > 1)."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.kv_cache import BlockPool, block_key

BS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


# ------------------------------------------------------------------ pool unit tests

def test_pool_shares_registered_blocks_and_evicts_least_recently_used():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    ka, kb = block_key(None, [1] * BS), block_key(hash(block_key(None, [1] * BS)), [2] * BS)
    assert pool.register(a, ka) and pool.register(b, kb)
    assert not pool.register(pool.allocate(1)[0], ka)  # duplicate key stays private
    pool.acquire(pool.lookup(ka))  # a second owner
    assert pool.ref_counts[a] == 2
    pool.free([a, b])  # first owner leaves; b becomes idle-cached, a still owned
    assert pool.lookup(kb) == b and pool.ref_counts[b] == 0
    pool.free([a])  # a idle now too, used after b
    assert pool.num_free_blocks == 3  # the unregistered duplicate is still owned
    # one never-cached block is free: it goes first, then the LRU idle block (b)
    first = pool.allocate(1)
    assert pool.lookup(ka) == a and pool.lookup(kb) == b
    second = pool.allocate(1)
    assert second == [b] and pool.lookup(kb) is None and pool.lookup(ka) == a
    assert pool.num_evictions == 1 and first != second


def test_acquire_revives_an_idle_cached_block():
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    key = block_key(None, list(range(BS)))
    pool.register(a, key)
    pool.free([a])
    assert pool.num_free_blocks == 2
    pool.acquire(pool.lookup(key))
    assert pool.num_free_blocks == 1 and pool.ref_counts[a] == 1
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.allocate(2)


def test_blocks_wanted_by_waiting_sequences_are_evicted_last():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    keys = [block_key(None, [i] * BS) for i in range(3)]
    for blk, key in zip((a, b, c), keys):
        pool.register(blk, key)
    pool.free([a])
    pool.free([b])
    pool.free([c])  # LRU order a, b, c
    pool.want([keys[0]])  # a waiting sequence will read a
    pool.want([keys[0], keys[1]])  # and another one a and b
    assert pool.num_free_blocks == 3
    assert pool.allocate(1) == [c]  # plain LRU would take a
    pool.unwant([keys[0], keys[1]])  # b no longer wanted; a still by the first sequence
    assert pool.allocate(1) == [b]
    assert pool.allocate(1) == [a]  # only wanted blocks left: taken anyway
    assert pool.num_evictions == 3 and pool.num_cached_blocks == 0
    pool.unwant([keys[0]])
    assert pool.wanted == {}


def test_scheduler_marks_waiting_prompts_wanted_until_admitted():
    from engine.outputs import RequestMetrics
    from engine.request import Request, Sequence
    from engine.scheduler import Scheduler
    pool = BlockPool(8)
    sched = Scheduler(pool, BS, max_num_seqs=1, max_num_batched_tokens=1024)
    prompt = list(range(2 * BS + 3))  # two full blocks
    seqs = []
    for _ in range(2):
        req = Request(request_id=str(len(seqs)), index=len(seqs), prompt=None, prompt_token_ids=prompt,
                      params=GREEDY, metrics=RequestMetrics(arrival_time=0.0))
        seqs.append(Sequence(seq_id=len(seqs), request=req, index=0, token_ids=list(prompt)))
        sched.add(seqs[-1])
    assert sorted(pool.wanted.values()) == [2, 2]
    out = sched.schedule()  # one seat: the first is admitted, the second still waits
    assert [c.seq for c in out.chunks] == [seqs[0]] and sorted(pool.wanted.values()) == [1, 1]
    sched.clear_waiting()
    assert pool.wanted == {} and not sched.waiting


# ------------------------------------------------------------------ engine

@pytest.fixture(scope="module")
def engines():
    off = LLM("smollm2-135m-instruct", enable_prefix_caching=False, kv_cache_memory_bytes=64 << 20)
    on = LLM("smollm2-135m-instruct", enable_prefix_caching=True, kv_cache_memory_bytes=64 << 20)
    return off, on


def _ids(out):
    return [o.outputs[0].token_ids for o in out]


def _prompts_sharing(llm, n_blocks: int, count: int) -> list[list[int]]:
    base = llm.tokenizer.encode(
        "You are a careful annotator. Read the passage and give its topic in one word. " * 4)
    shared = base[: n_blocks * BS]
    tails = ["Cats sleep most of the day.", "The stock market fell sharply.", "Rain is expected tomorrow.",
             "The team won the final match.", "A new vaccine was approved.", "The bridge opened in 1937."]
    return [shared + llm.tokenizer.encode(" " + tails[i % len(tails)]) for i in range(count)]


@pytest.mark.parametrize("n_blocks", [1, 2, 3])
def test_greedy_equal_with_shared_prefixes(engines, n_blocks):
    off, on = engines
    prompts = _prompts_sharing(on, n_blocks, 6)
    ref = _ids(off.generate(prompts, GREEDY, use_tqdm=False))
    first = on.generate(prompts, GREEDY, use_tqdm=False)
    second = on.generate(prompts, GREEDY, use_tqdm=False)
    assert _ids(first) == ref and _ids(second) == ref
    # in the first pass all but the first prompt read the shared blocks from the cache
    assert [o.num_cached_tokens for o in first[1:]] == [n_blocks * BS] * 5
    # the second pass finds every full block of every prompt
    assert [o.num_cached_tokens for o in second] == [len(p) // BS * BS for p in prompts]
    assert on.num_free_blocks == on.num_total_blocks and not on.scheduler.pending


@pytest.mark.parametrize("delta", [-1, 0, 1])
def test_exact_block_multiples(engines, delta):
    off, on = engines
    words = on.tokenizer.encode("one two three four five six seven eight nine ten " * 8)
    prompt = words[: 3 * BS + delta]
    ref = _ids(off.generate([prompt], GREEDY, use_tqdm=False))[0]
    both = on.generate([prompt, prompt], GREEDY, use_tqdm=False)  # twice in one batch
    again = on.generate([prompt], GREEDY, use_tqdm=False)[0]  # and in a later batch
    assert _ids(both) == [ref, ref] and again.outputs[0].token_ids == ref
    full = len(prompt) // BS * BS
    # a fully cached prompt still recomputes its last position to get logits
    assert again.num_cached_tokens == min(full, len(prompt) - 1)


def test_preempted_requests_resume_through_cache_hits():
    # a pool of 12 blocks: 16 requests of 40 + 24 tokens cannot all run at once
    kv = LLM("smollm2-135m-instruct", enable_prefix_caching=False, kv_cache_memory_bytes=64 << 20)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = _prompts_sharing(kv, 2, 8)
    ref = _ids(kv.generate(prompts, params, use_tqdm=False))
    small = LLM("smollm2-135m-instruct", enable_prefix_caching=True, max_num_batched_tokens=64,
                kv_cache_memory_bytes=12 * 30 * 2 * 3 * 64 * 2 * BS)  # 12 blocks of fp16 K and V
    start = small.num_free_blocks
    out = small.generate(prompts, params, use_tqdm=False)
    assert small.stats.num_preemptions > 0
    assert _ids(out) == ref
    assert small.num_free_blocks == start and not small.scheduler.pending


def test_n_samples_share_prompt_blocks(engines):
    _, on = engines
    prompt = on.tokenizer.encode("A list of rivers of Europe, with their lengths and the seas they flow into: " * 2)
    assert len(prompt) % BS != 0
    before = on.stats.num_prompt_tokens_computed
    params = SamplingParams(temperature=1.0, n=4, max_tokens=4, seed=7)
    out = on.generate([prompt], params, use_tqdm=False)[0]
    computed = on.stats.num_prompt_tokens_computed - before
    # completion 0 computes the prompt; the other three reuse its full blocks and
    # compute only the tail after the last full block
    tail = len(prompt) - len(prompt) // BS * BS
    assert computed == len(prompt) + 3 * tail
    assert len(out.outputs) == 4 and len({tuple(c.token_ids) for c in out.outputs}) > 1
    again = on.generate([prompt], params, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
