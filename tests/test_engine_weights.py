"""Weight loading: Hugging Face safetensors folders (Llama with GQA and Llama 3.1 rope
scaling, Qwen2 with q/k/v bias, tied and untied heads) against transformers on the
same weights, the GGUF q/k row un-permutation, and dummy weights of a named shape."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.tokenizer import Tokenizer
from engine.weights import PRESETS, resolve_model, unpermute_rope_rows

PROMPTS = ["The quick brown fox jumps over the lazy dog.", "def add(a, b):\n    return", "Bonjour, je m'appelle"]


def _tiny_folder(tmp_path, kind: str):
    """Save a tiny random transformers model (+ the default tokenizer) as a HF folder."""
    import transformers

    tok = Tokenizer.default()
    common = dict(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  initializer_range=0.2, rms_norm_eps=1e-6)
    if kind == "llama3":
        cfg = transformers.LlamaConfig(**common, tie_word_embeddings=False,
                                       rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                        "original_max_position_embeddings": 64})
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "llama_tied":
        cfg = transformers.LlamaConfig(**common, tie_word_embeddings=True,
                                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=False,
                                       rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
        model = transformers.Qwen2ForCausalLM(cfg)
        with torch.no_grad():  # make the q/k/v biases matter
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    model = model.float().eval()
    folder = tmp_path / kind
    model.save_pretrained(folder, safe_serialization=True)
    tok.hf.save_pretrained(folder)
    return folder, model


@pytest.mark.parametrize("kind", ["llama3", "llama_tied", "qwen2"])
def test_hf_folder_matches_transformers(tmp_path, kind):
    folder, ref = _tiny_folder(tmp_path, kind)
    llm = LLM(str(folder), kv_cache_memory_bytes=8 << 20, max_num_batched_tokens=7)
    assert llm.model_config.attention_bias == (kind == "qwen2")
    assert llm.model_config.tie_word_embeddings == (kind == "llama_tied")
    for p in PROMPTS:
        ids = llm.tokenizer.encode(p)
        ours = llm.compute_logits(ids)
        with torch.no_grad():
            theirs = ref(torch.tensor([ids])).logits[0, -1].float()
        assert (ours - theirs).abs().max().item() < 1e-3
    # greedy generation, with chunked prefill (budget 7) and a batch of three
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    for p, o in zip(PROMPTS, outs):
        ids = llm.tokenizer.encode(p)
        with torch.no_grad():
            g = ref.generate(torch.tensor([ids]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        assert o.outputs[0].token_ids == g[0, len(ids):].tolist()


def test_unpermute_inverts_the_gguf_converter_permutation():
    # The converter's permutation of q/k rows: halves order -> interleaved pairs, per head.
    rng = np.random.default_rng(0)
    for n_heads, head_dim in [(9, 64), (3, 64), (4, 8)]:
        w = rng.standard_normal((n_heads * head_dim, 5)).astype(np.float32)
        permuted = w.reshape(n_heads, 2, head_dim // 2, 5).swapaxes(1, 2).reshape(w.shape)
        assert np.array_equal(unpermute_rope_rows(permuted, n_heads), w)
        # row 1 of each permuted head is row head_dim/2 of the original head
        assert np.array_equal(permuted[1], w[head_dim // 2])


def test_dummy_weights_run_and_are_reproducible():
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    a = LLM("dummy:smollm2-135m", kv_cache_memory_bytes=16 << 20, seed=3).generate(["hello world"], params, use_tqdm=False)
    b = LLM("dummy:smollm2-135m", kv_cache_memory_bytes=16 << 20, seed=3).generate(["hello world"], params, use_tqdm=False)
    assert len(a[0].outputs[0].token_ids) == 5
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids


def test_named_shapes_and_unknown_models():
    cfg = PRESETS["llama-3-8b"]
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_kv_heads, cfg.head_dim) == (32, 4096, 8, 128)
    assert 7.9e9 < cfg.num_params < 8.1e9  # Llama-3-8B has 8.03B parameters
    assert 1.30e8 < PRESETS["smollm2-135m"].num_params < 1.40e8  # 134.5M
    with pytest.raises(ValueError, match="unknown dummy shape"):
        resolve_model("dummy:no-such-shape")
    with pytest.raises(ValueError, match="unknown model"):
        LLM("/no/such/model.bin")
    with pytest.raises(ValueError, match="unknown engine argument"):
        LLM("smollm2-135m-instruct", max_num_seq=4)
