"""tests/gguf_families.py, the GGUF writer of the family parity tests: its files load in transformers as
the model they were written from, and follow llama.cpp's converter's names, layouts and metadata.

- transformers 5.24 reads gemma3, qwen3, qwen3moe and phi3 GGUF files (and llama, qwen2): the model
  loaded from our F32 file gives the original model's logits, bit for bit here (asserted within 1e-5),
  on a prompt longer than Gemma 3's sliding window; from our Q8_0 file, the logits of the original
  model with its weights rounded through `gguf.quants` Q8_0.
- Mixtral (no transformers GGUF loader): the stacked experts, router and permuted q/k rows, read back.
- The metadata keys of each family, Gemma's 1 + w norms, Phi-3's fused tensors, the tokenizer.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import gguf
try:
    from tests.gguf_families import FAMILIES, permute_rope, random_kquant_blocks, write_gguf
except ImportError:  # tests/ is not a package: pytest puts it on sys.path
    from gguf_families import FAMILIES, permute_rope, random_kquant_blocks, write_gguf

transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, bos_token_id=1, eos_token_id=2, pad_token_id=None)


def tiny_config(family: str):
    """A 2-layer, hidden-64 config of `family` that transformers' GGUF reader rebuilds as it is: the values it
    does not read from a GGUF are left at its defaults (Qwen3's head_dim 128, Qwen3-MoE's moe_intermediate_size
    768, Gemma 3's query_pre_attn_scalar 256 and its sliding pattern of 5 sliding layers then a full one, hence
    6 layers and head_dim 256 = query_pre_attn_scalar for Gemma 3)."""
    T = transformers
    if family == "qwen3":
        return T.Qwen3Config(head_dim=128, **COMMON)
    if family == "qwen3moe":
        return T.Qwen3MoeConfig(head_dim=16, moe_intermediate_size=768, num_experts=8, num_experts_per_tok=2,
                                norm_topk_prob=True, **COMMON)
    if family == "gemma3":
        return T.Gemma3TextConfig(head_dim=256, query_pre_attn_scalar=256, sliding_window=8,
                                  **{**COMMON, "num_hidden_layers": 6})
    if family == "phi3":
        return T.Phi3Config(**COMMON)
    if family == "mixtral":
        return T.MixtralConfig(num_local_experts=8, num_experts_per_tok=2, **COMMON)
    if family == "mistral":  # the default window (4096) is longer than the prompts: read as a Llama, the same model
        return T.MistralConfig(**COMMON)
    return {"llama": T.LlamaConfig, "qwen2": T.Qwen2Config}[family](**COMMON)


def tiny_model(family: str, seed: int = 0):
    """A random tiny model of `family` (norm weights moved off their initial values, so that a norm
    convention that is off shows)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(family)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """family -> (model, folder it was saved to); built on first use."""
    cache: dict = {}

    def get(family: str):
        if family not in cache:
            model = tiny_model(family)
            folder = tmp_path_factory.mktemp(family)
            model.save_pretrained(folder)
            cache[family] = (model, str(folder))
        return cache[family]

    return get


def _load_hf(path: str):
    folder, name = os.path.split(path)
    return transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()


def _read(path: str) -> tuple[dict, dict]:
    """(metadata {key: value}, tensors {name: ReaderTensor}) of a GGUF file."""
    r = gguf.GGUFReader(path)
    meta = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    return meta, {t.name: t for t in r.tensors}


def _prompt(n: int = 20) -> torch.Tensor:
    return torch.randint(3, 512, (2, n), generator=torch.Generator().manual_seed(n))


@pytest.mark.parametrize("family", ["gemma3", "qwen3", "qwen3moe", "phi3", "llama", "qwen2", "mistral"])
def test_transformers_reads_the_f32_file_as_the_original_model(saved, tmp_path, family):
    model, folder = saved(family)
    path = write_gguf(folder, tmp_path / f"{family}.gguf")
    loaded = _load_hf(path)
    ids = _prompt()  # 20 tokens: past Gemma 3's window of 8
    with torch.no_grad():
        want, got = model(ids).logits, loaded(ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    if family == "gemma3":
        assert loaded.config.layer_types.count("full_attention") == 1 and loaded.config.sliding_window == 8


def test_q8_0_file_holds_gguf_quantized_weights_and_transformers_reads_them(saved, tmp_path):
    model, folder = saved("qwen3")
    path = write_gguf(folder, tmp_path / "q8.gguf", weight_type="Q8_0")
    _, tensors = _read(path)
    sd = model.state_dict()
    q = tensors["blk.1.attn_q.weight"]
    want = gguf.quants.quantize(sd["model.layers.1.self_attn.q_proj.weight"].numpy(), gguf.GGMLQuantizationType.Q8_0)
    assert q.tensor_type == gguf.GGMLQuantizationType.Q8_0 and np.array_equal(np.asarray(q.data), want)
    assert tensors["blk.1.attn_q_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    assert tensors["token_embd.weight"].tensor_type == gguf.GGMLQuantizationType.Q8_0
    # the original model with every matrix rounded through Q8_0 is what transformers loads
    rounded = tiny_model("qwen3")
    with torch.no_grad():
        for name, p in rounded.named_parameters():
            if p.dim() == 2:
                blocks = gguf.quants.quantize(p.numpy(), gguf.GGMLQuantizationType.Q8_0)
                p.copy_(torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q8_0)))
        ids = _prompt()
        torch.testing.assert_close(_load_hf(path)(ids).logits, rounded(ids).logits, rtol=0, atol=1e-5)
        assert (rounded(ids).logits - model(ids).logits).abs().max() > 1e-4  # the rounding is really there


def test_mixtral_experts_router_and_permuted_rows(saved, tmp_path):
    model, folder = saved("mixtral")
    meta, tensors = _read(write_gguf(folder, tmp_path / "mixtral.gguf"))
    assert meta["general.architecture"] == "llama"
    assert (meta["llama.expert_count"], meta["llama.expert_used_count"], meta["llama.vocab_size"]) == (8, 2, 512)
    assert meta["llama.rope.dimension_count"] == 16 and "llama.expert_feed_forward_length" not in meta
    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    gate_up, down = sd["model.layers.1.mlp.experts.gate_up_proj"], sd["model.layers.1.mlp.experts.down_proj"]
    E, I, H = 8, 128, 64
    assert gate_up.shape == (E, 2 * I, H) and down.shape == (E, H, I)
    arr = lambda n: np.asarray(tensors[n].data)  # noqa: E731
    assert list(tensors["blk.1.ffn_gate_exps.weight"].shape) == [H, I, E]  # the file's dims, fastest first
    assert np.array_equal(arr("blk.1.ffn_gate_exps.weight"), gate_up[:, :I])
    assert np.array_equal(arr("blk.1.ffn_up_exps.weight"), gate_up[:, I:])
    assert np.array_equal(arr("blk.1.ffn_down_exps.weight"), down)
    assert np.array_equal(arr("blk.1.ffn_gate_inp.weight"), sd["model.layers.1.mlp.gate.weight"])
    # q/k rows in llama.cpp's interleaved order, undone by the engine's loader
    from engine.weights import unpermute_rope_rows

    for ours, g, heads in [("q_proj", "attn_q", 4), ("k_proj", "attn_k", 2)]:
        stored = arr(f"blk.0.{g}.weight")
        assert not np.array_equal(stored, sd[f"model.layers.0.self_attn.{ours}.weight"])
        assert np.array_equal(unpermute_rope_rows(stored, heads), sd[f"model.layers.0.self_attn.{ours}.weight"])
        assert np.array_equal(stored, permute_rope(sd[f"model.layers.0.self_attn.{ours}.weight"], heads))


@pytest.mark.parametrize("family", ["mixtral", "qwen3moe"])
def test_the_saved_folder_and_the_model_in_memory_write_the_same_file(saved, tmp_path, family):
    """save_pretrained writes experts one by one (legacy names); transformers 5 holds them fused."""
    model, folder = saved(family)
    _, a = _read(write_gguf(folder, tmp_path / "a.gguf"))
    _, b = _read(write_gguf(model, tmp_path / "b.gguf"))
    assert sorted(a) == sorted(b)
    assert all(np.array_equal(np.asarray(a[n].data), np.asarray(b[n].data)) for n in a)


EXPECTED_KEYS = {  # llama.cpp's converter, per family (beyond general.*, tokenizer.* and file_type)
    "qwen3": {"block_count", "context_length", "embedding_length", "feed_forward_length", "attention.head_count",
              "attention.head_count_kv", "rope.freq_base", "attention.layer_norm_rms_epsilon",
              "attention.key_length", "attention.value_length"},
    "qwen2": {"block_count", "context_length", "embedding_length", "feed_forward_length", "attention.head_count",
              "attention.head_count_kv", "rope.freq_base", "attention.layer_norm_rms_epsilon"},
    "phi3": {"context_length", "rope.scaling.original_context_length", "embedding_length", "feed_forward_length",
             "block_count", "attention.head_count", "attention.head_count_kv", "attention.layer_norm_rms_epsilon",
             "rope.dimension_count", "rope.freq_base", "attention.sliding_window"},
}
EXPECTED_KEYS["qwen3moe"] = EXPECTED_KEYS["qwen3"] | {"expert_count", "expert_used_count", "expert_feed_forward_length"}
EXPECTED_KEYS["gemma3"] = EXPECTED_KEYS["qwen3"] | {"rope.freq_base_swa", "attention.sliding_window"}
EXPECTED_KEYS["llama"] = EXPECTED_KEYS["qwen3"] | {"vocab_size", "rope.dimension_count"}
EXPECTED_KEYS["mistral"] = EXPECTED_KEYS["llama"] | {"attention.sliding_window"}
EXPECTED_KEYS["mixtral"] = EXPECTED_KEYS["qwen2"] | {"vocab_size", "rope.dimension_count", "expert_count",
                                                     "expert_used_count"}


@pytest.mark.parametrize("family", sorted(EXPECTED_KEYS))
def test_metadata_keys_per_family(saved, tmp_path, family):
    model, folder = saved(family)
    meta, tensors = _read(write_gguf(folder, tmp_path / "m.gguf"))
    arch = FAMILIES[family].arch
    assert meta["general.architecture"] == arch
    assert {k[len(arch) + 1:] for k in meta if k.startswith(arch + ".")} == EXPECTED_KEYS[family]
    cfg = model.config
    assert meta[f"{arch}.block_count"] == cfg.num_hidden_layers
    assert meta[f"{arch}.attention.head_count_kv"] == cfg.num_key_value_heads
    assert meta["general.file_type"] == gguf.LlamaFileType.ALL_F32
    assert ("output.weight" in tensors) == (not cfg.tie_word_embeddings)
    if family == "gemma3":
        assert meta["gemma3.attention.sliding_window"] == 8
        assert (meta["gemma3.rope.freq_base"], meta["gemma3.rope.freq_base_swa"]) == (1e6, 1e4)
        assert meta["gemma3.attention.key_length"] == 256
    if family == "phi3":
        assert meta["phi3.attention.sliding_window"] == 0 and meta["phi3.rope.dimension_count"] == 16
    if family == "mistral":
        assert meta["llama.attention.sliding_window"] == 4096


def test_gemma3_norms_are_stored_as_one_plus_w(saved, tmp_path):
    model, folder = saved("gemma3")
    _, tensors = _read(write_gguf(folder, tmp_path / "g.gguf"))
    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    for gname, ours in [("blk.2.attn_norm", "input_layernorm"),
                        ("blk.2.post_attention_norm", "post_attention_layernorm"),
                        ("blk.2.ffn_norm", "pre_feedforward_layernorm"),
                        ("blk.2.post_ffw_norm", "post_feedforward_layernorm"),
                        ("blk.2.attn_q_norm", "self_attn.q_norm"), ("blk.2.attn_k_norm", "self_attn.k_norm")]:
        assert np.array_equal(np.asarray(tensors[gname + ".weight"].data), sd[f"model.layers.2.{ours}.weight"] + 1)
    assert np.array_equal(np.asarray(tensors["output_norm.weight"].data), sd["model.norm.weight"] + 1)
    assert np.array_equal(np.asarray(tensors["blk.2.attn_q.weight"].data), sd["model.layers.2.self_attn.q_proj.weight"])


def test_phi3_keeps_its_fused_tensors(saved, tmp_path):
    model, folder = saved("phi3")
    _, tensors = _read(write_gguf(folder, tmp_path / "p.gguf"))
    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    qkv = sd["model.layers.0.self_attn.qkv_proj.weight"]
    assert np.array_equal(np.asarray(tensors["blk.0.attn_qkv.weight"].data), qkv)
    assert np.array_equal(np.asarray(tensors["blk.0.ffn_up.weight"].data), sd["model.layers.0.mlp.gate_up_proj.weight"])
    assert not any(n.endswith(("attn_q.weight", "ffn_gate.weight")) for n in tensors)


def test_the_tokenizer_is_the_default_ones_cut_to_the_vocabulary(saved, tmp_path):
    from engine.tokenizer import Tokenizer

    _, folder = saved("qwen3")
    path = write_gguf(folder, tmp_path / "t.gguf")
    meta, _ = _read(path)
    assert meta["tokenizer.ggml.model"] == "gpt2" and len(meta["tokenizer.ggml.tokens"]) == 512
    tok, default = Tokenizer.from_gguf(path), Tokenizer.default()
    assert tok.vocab_size == 512 and tok.eos_token_id == default.eos_token_id == 2
    text = "The quick brown fox, 1234 times: naïve café!"
    ids = tok.encode(text)
    assert max(ids) < 512 and tok.decode(ids) == text
    assert len(ids) > len(default.encode(text))  # fewer merges survive the cut


def test_random_blocks_and_bad_arguments(saved, tmp_path):
    _, folder = saved("llama")
    path = write_gguf(folder, tmp_path / "k.gguf", random_blocks={r"ffn_(gate|up)": "Q4_0"}, seed=3)
    _, tensors = _read(path)
    t = tensors["blk.0.ffn_gate.weight"]
    assert t.tensor_type == gguf.GGMLQuantizationType.Q4_0 and list(t.shape) == [64, 128]
    w = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
    assert w.shape == (128, 64) and 0 < np.abs(w).max() <= 4e-4 * 8  # |q - 8| * d, d <= 4e-4
    assert tensors["blk.0.ffn_down.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    with pytest.raises(ValueError, match="weight_type"):
        write_gguf(folder, tmp_path / "x.gguf", weight_type="Q4_K")
    with pytest.raises(ValueError, match="cols a multiple of 256"):
        random_kquant_blocks("Q6_K", 4, 64)
