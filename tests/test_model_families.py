"""Every model family against transformers: tiny random models built from a config (no
download), saved with `save_pretrained`, loaded by the engine from the folder.

Per family: the last-position logits of 10 prompts within fp32 rounding (prefill), the logits
of every decode step within the same bound, and greedy token ids equal to transformers'
`generate` on all 10 prompts, run as one batch with chunked prefill. Sliding-window families
get a window shorter than most prompts. The MoE families use 8 experts with top-2 routing.
"""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.tokenizer import Tokenizer

LOGITS_ATOL = 1e-3  # fp32 noise is ~1e-5 at these magnitudes (see test_engine_parity.py)
NEW_TOKENS = 10
WINDOW = 8  # sliding window of the tiny sliding-window models, in tokens

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return",
    "Bonjour, je m'appelle",
    "Label the sentiment of this review: the food was cold and the waiter ignored us for an hour.",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
    "Q: What is the capital of Italy?\nA:",
    "Hi",
    "Extract the city from: 'Our office moved from Berlin to Lisbon in March 2024, closer to the sea.'",
    "import numpy as np\nimport torch\n\nclass Model(torch.nn.Module):\n    def __init__(self):",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker",
]


def _common(tok: Tokenizer) -> dict:
    return dict(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                initializer_range=0.2, rms_norm_eps=1e-6)


def build(kind: str, tok: Tokenizer):
    """A tiny random transformers model of family `kind` (fp32, eval)."""
    import transformers as T

    torch.manual_seed(0)  # the same random model in every run
    c = _common(tok)
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if kind == "qwen3":
        model = T.Qwen3ForCausalLM(T.Qwen3Config(**c, head_dim=32, rope_parameters=rope, tie_word_embeddings=False))
    elif kind == "gemma3":
        cfg = T.Gemma3TextConfig(**{**c, "num_hidden_layers": 4}, head_dim=32, query_pre_attn_scalar=24,
                                 sliding_window=WINDOW,
                                 layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                              "sliding_attention"],
                                 rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                  "full_attention": {"rope_type": "default",
                                                                     "rope_theta": 1000000.0}})
        model = T.Gemma3ForCausalLM(cfg)
    elif kind == "gemma3_gguf":  # llama.cpp's Gemma 3: 5 sliding layers then a full one, scale 1/sqrt(head_dim)
        cfg = T.Gemma3TextConfig(**{**c, "num_hidden_layers": 6}, head_dim=32, query_pre_attn_scalar=32,
                                 sliding_window=WINDOW,
                                 layer_types=["sliding_attention"] * 5 + ["full_attention"],
                                 rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                  "full_attention": {"rope_type": "default",
                                                                     "rope_theta": 1000000.0}})
        model = T.Gemma3ForCausalLM(cfg)
    elif kind == "phi3":
        model = T.Phi3ForCausalLM(T.Phi3Config(**c, rope_parameters=rope, tie_word_embeddings=False,
                                               pad_token_id=0))
    elif kind == "phi3_longrope":
        n = 16 // 2  # head_dim 16: 8 frequencies
        rp = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + 0.1 * i for i in range(n)],
              "long_factor": [2.0 + 0.5 * i for i in range(n)], "original_max_position_embeddings": 128}
        model = T.Phi3ForCausalLM(T.Phi3Config(**c, rope_parameters=rp, original_max_position_embeddings=128,
                                               tie_word_embeddings=False, pad_token_id=0))
    elif kind == "mistral_sw":
        model = T.MistralForCausalLM(T.MistralConfig(**c, head_dim=16, sliding_window=WINDOW, rope_parameters=rope,
                                                     tie_word_embeddings=False))
    elif kind == "qwen3_moe":
        model = T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(**c, head_dim=16, num_experts=8, num_experts_per_tok=2,
                                                       moe_intermediate_size=32, norm_topk_prob=True,
                                                       rope_parameters=rope, tie_word_embeddings=False))
    elif kind == "mixtral":
        model = T.MixtralForCausalLM(T.MixtralConfig(**c, num_local_experts=8, num_experts_per_tok=2,
                                                     rope_parameters=rope, tie_word_embeddings=False))
    else:
        raise ValueError(kind)
    with torch.no_grad():  # random norms: a norm bug (offset, placement) must show in the logits
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0 if kind.startswith("gemma3") else 1.0, 0.3)
    return model.float().eval()


FAMILIES = ["qwen3", "gemma3", "phi3", "phi3_longrope", "mistral_sw", "qwen3_moe", "mixtral"]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.default()


def save(model, tok: Tokenizer, folder) -> str:
    model.save_pretrained(folder, safe_serialization=True)
    tok.hf.save_pretrained(folder)
    return str(folder)


def engine(path: str, **kw) -> LLM:
    return LLM(path, kv_cache_memory_bytes=16 << 20, max_num_batched_tokens=13, kv_cache_dtype="fp32",
               dtype="float32", **kw)


def hf_greedy(model, ids: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy continuation of `ids` and the logits of each step."""
    with torch.no_grad():
        g = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return g.sequences[0, len(ids):].tolist(), [x[0].float() for x in g.logits]


def check_family(llm: LLM, model, tok: Tokenizer) -> None:
    ids = [tok.encode(p) for p in PROMPTS]
    if llm.model_config.max_window:
        assert sum(len(i) > llm.model_config.max_window for i in ids) >= 5
    outs = llm.generate([{"prompt_token_ids": i} for i in ids],
                        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)
    worst = 0.0
    for i, o in zip(ids, outs):
        ref_ids, ref_logits = hf_greedy(model, i, NEW_TOKENS)
        assert o.outputs[0].token_ids == ref_ids
        # prefill logits, then the logits of decode steps (the engine re-scores the continuation)
        for step in (0, NEW_TOKENS // 2, NEW_TOKENS - 1):
            ours = llm.compute_logits(i + ref_ids[:step])
            worst = max(worst, (ours - ref_logits[step]).abs().max().item())
    assert worst < LOGITS_ATOL, worst


@pytest.mark.parametrize("kind", ["qwen3", "gemma3_gguf", "qwen3_moe", "mixtral"])
def test_family_from_gguf_matches_transformers(tmp_path, tok, kind):
    """The same model written as a GGUF file with the `gguf` library in llama.cpp's layout
    (tests/gguf_families.py: its names, Gemma's 1 + w norms, stacked experts, Mixtral as llama
    with experts) and loaded from that file: transformers' logits and greedy ids."""
    from gguf_families import write_gguf

    model = build(kind, tok)
    path = write_gguf(model, tmp_path / f"{kind}.gguf")
    llm = engine(path)
    assert llm.model_config.family == {"gemma3_gguf": "gemma3"}.get(kind, kind)
    if kind == "gemma3_gguf":
        assert llm.model_config.layer_windows == (WINDOW,) * 5 + (0,)
    check_family(llm, model, tok)


@pytest.mark.parametrize("kind", FAMILIES)
def test_family_matches_transformers(tmp_path, tok, kind):
    model = build(kind, tok)
    llm = engine(save(model, tok, tmp_path / kind))
    expect = {"phi3_longrope": "phi3", "mistral_sw": "mistral"}.get(kind, kind)
    assert llm.model_config.family == expect
    check_family(llm, model, tok)


def test_unsupported_family_is_named_in_one_line(tmp_path, tok):
    import transformers as T

    model = T.GPT2LMHeadModel(T.GPT2Config(vocab_size=tok.vocab_size, n_embd=32, n_layer=1, n_head=2))
    path = save(model, tok, tmp_path / "gpt2")
    with pytest.raises(ValueError) as e:
        LLM(path)
    msg = str(e.value)
    assert "'gpt2'" in msg and "qwen3" in msg and "gemma3_text" in msg and "\n" not in msg


NEAR_TIE = 1e-4


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_tensor_parallel_two_ranks_equal_one(tmp_path, tok, kind):
    """TP = 2 (heads, MLP columns and each expert's columns split; the router whole) gives one
    device's greedy ids; a difference is accepted only at a near tie of one device's logits."""
    path = save(build(kind, tok), tok, tmp_path / kind)
    ids = [tok.encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    one = engine(path)
    ref = [o.outputs[0].token_ids for o in one.generate([{"prompt_token_ids": i} for i in ids], params,
                                                         use_tqdm=False)]
    with engine(path, tensor_parallel_size=2) as two:
        got = [o.outputs[0].token_ids for o in two.generate([{"prompt_token_ids": i} for i in ids], params,
                                                             use_tqdm=False)]
    for i, r, g in zip(ids, ref, got):
        if r != g:
            j = next(n for n, (a, b) in enumerate(zip(r, g)) if a != b)
            top = torch.topk(one.compute_logits(i + r[:j]), 2).values
            assert (top[0] - top[1]).item() < NEAR_TIE, (i, r, g)
    assert sum(r == g for r, g in zip(ref, got)) >= 9


@pytest.mark.parametrize("kind", ["qwen3_moe", "gemma3"])
def test_smoothquant_folding_is_exact_for_the_family(tmp_path, tok, kind):
    """W8A8's smoothing on a family's layer (q/k norms, norms around the MLP, GeGLU; experts
    and router sharing one input factor): with float layers the smoothed model scores the same
    log-probabilities as the original."""
    from engine.models.llama import Linear
    from engine.smoothquant import calibration_absmax, smoothed_copy

    llm = engine(save(build(kind, tok), tok, tmp_path / kind))
    stats = calibration_absmax(llm, tokens_per_prompt=16)
    if kind == "qwen3_moe":
        assert (0, "experts.0.gate_up") in stats or (0, "experts.1.gate_up") in stats
        assert not any(k[1] in ("gate_up", "down") for k in stats)  # every MLP is a mixture here
    smooth = smoothed_copy(llm.model, stats, lambda w, b: Linear(w, b))
    ids = tok.encode(PROMPTS[-1] + " " + PROMPTS[3])
    want = llm.score(ids)[0]
    orig = llm.model
    llm.model = llm.runner.model = smooth
    try:
        got = llm.score(ids)[0]
    finally:
        llm.model = llm.runner.model = orig
    assert (got - want).abs().max().item() < 1e-3
    assert not torch.equal(smooth.layers[1].mlp_norm, orig.layers[1].mlp_norm)  # something was moved


@pytest.mark.parametrize("scheme", ["int8", "w8a8"])
def test_quantized_experts(tmp_path, tok, scheme):
    """int8 and W8A8 quantize every expert (the router stays in float). int8 weight-only: the
    engine scores what a float model holding the dequantized weights scores; W8A8 (activations
    rounded too) stays near fp32."""
    from engine.models.llama import Linear

    path = save(build("qwen3_moe", tok), tok, tmp_path / "moe")
    ref = engine(path)
    q = engine(path, quantization=scheme)
    names = [n for n, _ in q.model.linear_layers()]
    assert sum(".experts." in n for n in names) == 3 * 8 * 2
    for n, lin in q.model.linear_layers():
        if n != "lm_head":
            assert type(lin).__name__ in ("QuantLinear", "CpuQuantLinear", "W8A8Linear"), (n, type(lin))
    assert q.model.layers[0].moe.router.dtype == torch.float32
    ids = tok.encode(PROMPTS[-1])
    got = q.score(ids)[0]
    if scheme == "int8":
        deq = ref.model
        for n, lin in q.model.linear_layers():
            if n != "lm_head":
                deq.set_linear(n, Linear(lin.dequantize().float(), lin.bias))
        want = ref.score(ids)[0]
        assert (got - want).abs().max().item() < 1e-3
    else:
        # activations rounded per token too, on a random model with random norms (seeded): mean
        # |delta logprob| 0.13 when written; a wrong scale or factor moves it by whole units
        diff = (got - ref.score(ids)[0]).abs()
        assert 0 < diff.mean().item() < 0.25, diff


@pytest.mark.parametrize("kind", ["qwen3_moe", "gemma3_gguf"])
def test_gguf_blocks_per_expert_and_family(tmp_path, tok, kind):
    """quantization="gguf" reads the file's Q8_0 blocks in place for every linear layer, each
    expert's own (stacked in the file): the same log-probabilities as the float engine on the
    dequantized weights of that file."""
    from gguf_families import write_gguf

    path = write_gguf(build(kind, tok), tmp_path / f"{kind}.gguf", weight_type="Q8_0")
    ref = engine(path)
    q = engine(path, quantization="gguf")
    kinds = {n: type(lin).__name__ for n, lin in q.model.linear_layers()}
    assert all(k in ("QuantLinear", "CpuQuantLinear") for k in kinds.values()), kinds
    if kind == "qwen3_moe":
        assert sum(".experts." in n for n in kinds) == 3 * 8 * 2
    ids = tok.encode(PROMPTS[-1])
    assert (q.score(ids)[0] - ref.score(ids)[0]).abs().max().item() < 1e-3


def test_unsupported_gguf_architecture_is_named_in_one_line(tmp_path):
    import gguf
    import numpy as np

    path = tmp_path / "falcon.gguf"
    w = gguf.GGUFWriter(str(path), "falcon")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError) as e:
        LLM(str(path))
    msg = str(e.value)
    assert "'falcon'" in msg and "gemma3" in msg and "qwen3moe" in msg and "\n" not in msg
