"""quantization="int8" and "w8a8" start from a K-quant GGUF's dequantized weights.

A tiny llama-arch file (tests/gguf_families.py) whose matrices are random valid blocks laid out as a
Q4_K_M file lays them out: q, k, o, gate, up in Q4_K; v, down and the tied embedding in Q6_K.
- the float model the schemes copy holds exactly `gguf.quants.dequantize` of those blocks (q/k rows
  un-permuted);
- int8's layers are `quantize_int8` of those weights, code for code;
- w8a8's layers are `quantize_w8a8` of those weights after SmoothQuant's (exact) folding, code for code;
- quantization="gguf" keeps the blocks themselves (Q4_K as 4-bit codes, Q6_K as int8).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import gguf

try:
    from tests.gguf_families import write_gguf
except ImportError:  # tests/ is not a package: pytest puts it on sys.path
    from gguf_families import write_gguf

transformers = pytest.importorskip("transformers")

Q4_K_M = {r"attn_(q|k|output)\.|ffn_(gate|up)\.": "Q4_K", r"attn_v\.|ffn_down\.|token_embd\.": "Q6_K"}
KW = dict(dtype="float32", kv_cache_dtype="fp32", kv_cache_memory_bytes=16 << 20)


@pytest.fixture(scope="module")
def kquant_gguf(tmp_path_factory):
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                   bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    return write_gguf(model, tmp_path_factory.mktemp("kq") / "tiny-q4_k_m.gguf", random_blocks=Q4_K_M)


def _file_weights(path: str) -> dict[str, torch.Tensor]:
    """Our fused layer name -> the float weight the file's blocks dequantize to (q/k un-permuted)."""
    from engine.weights import unpermute_rope_rows

    r = gguf.GGUFReader(path)
    deq = {}
    for t in r.tensors:
        if len(t.shape) == 2:
            a = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(int(t.shape[1]), int(t.shape[0]))
            deq[t.name] = a
    out = {}
    for i in range(2):
        b = f"blk.{i}."
        q, k = unpermute_rope_rows(deq[b + "attn_q.weight"], 4), unpermute_rope_rows(deq[b + "attn_k.weight"], 2)
        out[f"layers.{i}.qkv"] = np.concatenate([q, k, deq[b + "attn_v.weight"]])
        out[f"layers.{i}.o"] = deq[b + "attn_output.weight"]
        out[f"layers.{i}.gate_up"] = np.concatenate([deq[b + "ffn_gate.weight"], deq[b + "ffn_up.weight"]])
        out[f"layers.{i}.down"] = deq[b + "ffn_down.weight"]
    out["embed"] = deq["token_embd.weight"]
    return {k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)) for k, v in out.items()}


def test_the_file_really_holds_q4_k_and_q6_k_blocks(kquant_gguf):
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(kquant_gguf).tensors}
    assert types["blk.0.attn_q.weight"] == types["blk.1.ffn_up.weight"] == "Q4_K"
    assert types["blk.0.attn_v.weight"] == types["blk.1.ffn_down.weight"] == types["token_embd.weight"] == "Q6_K"
    assert types["blk.0.attn_norm.weight"] == "F32"


def test_int8_starts_from_the_dequantized_kquant_weights(kquant_gguf):
    from engine import LLM
    from engine.quant import quantize_int8

    want = _file_weights(kquant_gguf)
    fp32 = LLM(kquant_gguf, **KW)
    layers = dict(fp32.model.linear_layers())
    for name, w in want.items():
        got = fp32.model.embed if name == "embed" else layers[name].weight
        assert torch.equal(got.float(), w), name
    int8 = LLM(kquant_gguf, quantization="int8", **KW)
    for name, lin in int8.model.linear_layers():
        if name == "lm_head":  # int8 keeps the (tied) head in float: the Q6_K embedding dequantized
            assert torch.equal(lin.weight.float(), want["embed"])
            continue
        ref = quantize_int8(want[name])
        assert torch.equal(lin.weight, ref.weight) and torch.equal(lin.scale if hasattr(lin, "scale")
                                                                   else lin.source.scale, ref.scale), name
        assert torch.equal(lin.dequantize(), ref.dequantize()), name


@pytest.mark.skipif(not __import__("engine.kernels.cpu", fromlist=["available"]).available(),
                    reason="W8A8 runs on the CPU kernels")
def test_w8a8_starts_from_the_dequantized_kquant_weights(kquant_gguf):
    from engine import LLM
    from engine.kernels.cpu.layers import quantize_w8a8
    from engine.loader import w8a8_calibration
    from engine.smoothquant import smoothed_copy
    from engine.weights import resolve_model

    w8 = LLM(kquant_gguf, quantization="w8a8", **KW)
    fp32 = LLM(kquant_gguf, **KW)
    want = _file_weights(kquant_gguf)
    assert all(torch.equal(l.weight.float(), want[n]) for n, l in fp32.model.linear_layers() if n != "lm_head")
    # the same calibration statistics (cached per source and settings), folded exactly in float
    stats = w8a8_calibration(resolve_model(kquant_gguf), torch.float32, "cpu", fp32.config.seed, True, LLM)
    smooth = smoothed_copy(fp32.model, stats, lambda w, b: _Holder(w))
    for (name, lin), (_, ref) in zip(w8.model.linear_layers(), smooth.linear_layers()):
        if name == "lm_head":
            continue
        q, s = quantize_w8a8(ref.weight)
        assert type(lin).__name__ == "W8A8Linear" and torch.equal(lin.weight, q) and torch.equal(lin.scale, s), name


class _Holder(torch.nn.Module):
    """A float weight as `smoothed_copy` hands it to its `make_linear`."""

    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.weight = w
        self.bias = None


def test_gguf_scheme_keeps_the_blocks(kquant_gguf):
    from engine import LLM

    g = LLM(kquant_gguf, quantization="gguf", **KW)
    layers = dict(g.model.linear_layers())
    want = _file_weights(kquant_gguf)
    assert layers["layers.0.o"].bits == 4 and layers["layers.0.down"].bits == 8  # Q4_K codes stay 4-bit
    for name in ("layers.0.qkv", "layers.1.gate_up", "layers.1.down"):
        assert torch.equal(layers[name].dequantize(), want[name]), name
