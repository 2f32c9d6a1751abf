"""Model families as declarative records: what differs between decoder-only transformers.

The decoder (`engine.models.llama.LlamaModel`), the loaders (`engine.weights`), the GGUF
quantized loader (`engine.quant`) and tensor-parallel slicing read a `Family`; none of them
holds a per-family copy of the forward pass. Adding a family is a record here, plus any op it
names that does not exist yet.

The per-model numbers (sizes, RoPE bases, sliding windows per layer, expert counts) live in
`engine.weights.ModelConfig`; a record holds what is fixed for every model of the family.

Sources of each layout: the families' Hugging Face `transformers` model files (the reference
the tests compare to) and llama.cpp's GGUF converter for the GGUF tensor names and layouts.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

# Our per-layer tensor names (Hugging Face Llama's, where Llama has the tensor):
#   input_layernorm             the norm before attention
#   self_attn.{q,k,v,o}_proj    projections (q/k/v biases where the family has them)
#   self_attn.{q,k}_norm        RMSNorm over each head of q and k (Qwen3, Gemma 3)
#   attn_post_norm              the norm of the attention output before the residual add (Gemma)
#   post_attention_layernorm    the norm before the MLP (Llama's name)
#   mlp_post_norm               the norm of the MLP output before the residual add (Gemma)
#   mlp.{gate,up,down}_proj     a dense gated MLP
#   mlp.gate                    a mixture of experts' router [E, H]
#   mlp.experts.{e}.{gate,up,down}_proj   expert e's gated MLP
# Fused checkpoints (Phi-3's qkv_proj, gate_up_proj) are split into these at load.

_GGUF_COMMON = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    # stacked experts [E, out, in]: split per expert at load
    "ffn_gate_exps.weight": "mlp.experts.*.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.*.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.*.down_proj.weight",
}


@dataclass(frozen=True)
class Family:
    """One decoder family's fixed layout.

    Attributes:
        name: our name of the family.
        hf_model_types: config.json `model_type` values it serves.
        gguf_archs: GGUF `general.architecture` values it serves.
        norm_offset: RMSNorm multiplies by (norm_offset + w): 1.0 for Gemma (folded into the
            weights at load), 0.0 elsewhere.
        sandwich_norms: a norm of the attention output and of the MLP output before each
            residual add, beside the usual pre-norms (Gemma 2/3).
        activation: the gated MLP's gate activation: "silu" (SwiGLU, Shazeer 2020, arXiv
            2002.05202) or "gelu_tanh" (GeGLU with the tanh approximation of GELU).
        qk_norm: RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3).
        embed_scale: the embeddings are multiplied by sqrt(hidden_size) (Gemma).
        attention_bias: q/k/v biases when config.json does not say (Qwen2).
        hf_rename: Hugging Face per-layer suffix -> ours, where they differ.
        hf_fused: a fused Hugging Face tensor suffix -> the suffixes of its row blocks, in
            order ("qkv" sizes: q, k, v; "gate_up": gate, up), split at load (Phi-3).
        gguf_rename: GGUF per-layer suffix -> ours, beside the common map.
        gguf_fused: as hf_fused, for GGUF names.
        gguf_permuted_qk: llama.cpp's converter interleaved the q/k rows (Llama layout): undo it.
        gguf_norm_stored_offset: the converter stored norm weights as norm_offset + w already.
        moe: the MLP may be a mixture of experts (softmax over E router logits, top-k,
            renormalised when `ModelConfig.norm_topk_prob`: Qwen3-MoE, Mixtral).
    """

    name: str
    hf_model_types: tuple[str, ...]
    gguf_archs: tuple[str, ...] = ()
    norm_offset: float = 0.0
    sandwich_norms: bool = False
    activation: str = "silu"
    qk_norm: bool = False
    embed_scale: bool = False
    attention_bias: bool = False
    hf_rename: dict = field(default_factory=dict)
    hf_fused: dict = field(default_factory=dict)
    gguf_rename: dict = field(default_factory=dict)
    gguf_fused: dict = field(default_factory=dict)
    gguf_permuted_qk: bool = False
    gguf_norm_stored_offset: bool = False
    moe: bool = False

    def gguf_layer_names(self) -> dict:
        """GGUF per-layer suffix -> our suffix (the common map with this family's renames)."""
        return {**_GGUF_COMMON, **self.gguf_rename}


_GEMMA_HF = {
    "post_attention_layernorm.weight": "attn_post_norm.weight",
    "pre_feedforward_layernorm.weight": "post_attention_layernorm.weight",
    "post_feedforward_layernorm.weight": "mlp_post_norm.weight",
}
_GEMMA_GGUF = {
    "post_attention_norm.weight": "attn_post_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "mlp_post_norm.weight",
}
_MIXTRAL_HF = {"block_sparse_moe.gate.weight": "mlp.gate.weight",
               **{f"block_sparse_moe.experts.*.{a}.weight": f"mlp.experts.*.{b}_proj.weight"
                  for a, b in (("w1", "gate"), ("w2", "down"), ("w3", "up"))}}

FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("llama", ("llama",), ("llama",), gguf_permuted_qk=True),
    Family("mistral", ("mistral",), ("mistral",), gguf_permuted_qk=True),
    Family("qwen2", ("qwen2",), ("qwen2",), attention_bias=True),
    Family("qwen3", ("qwen3",), ("qwen3",), qk_norm=True),
    Family("gemma3", ("gemma3_text", "gemma3"), ("gemma3",), norm_offset=1.0, sandwich_norms=True,
           activation="gelu_tanh", qk_norm=True, embed_scale=True, hf_rename=_GEMMA_HF, gguf_rename=_GEMMA_GGUF,
           gguf_norm_stored_offset=True),
    Family("phi3", ("phi3",), ("phi3",),
           hf_fused={"self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                                   "self_attn.v_proj.weight"),
                     "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight")},
           gguf_fused={"attn_qkv.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                           "self_attn.v_proj.weight"),
                       "ffn_up.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight")}),
    Family("qwen3_moe", ("qwen3_moe",), ("qwen3moe",), qk_norm=True, moe=True),
    Family("mixtral", ("mixtral",), (), moe=True, hf_rename=_MIXTRAL_HF, gguf_permuted_qk=True),
)}
LLAMA = FAMILIES["llama"]


def supported_hf_types() -> list[str]:
    return sorted(t for f in FAMILIES.values() for t in f.hf_model_types)


def supported_gguf_archs() -> list[str]:
    return sorted(a for f in FAMILIES.values() for a in f.gguf_archs)


def family_for_hf(model_type: str, where: str = "") -> Family:
    """The family serving a config.json `model_type`.

    Raises:
        ValueError: one line naming the type and listing the supported ones.
    """
    for f in FAMILIES.values():
        if model_type in f.hf_model_types:
            return f
    raise ValueError(f"{where}model_type {model_type!r} is not supported; supported: "
                     f"{', '.join(supported_hf_types())}")


def family_for_gguf(arch: str, has_experts: bool = False, where: str = "") -> Family:
    """The family serving a GGUF `general.architecture` (a "llama" file with expert tensors is
    Mixtral's layout).

    Raises:
        ValueError: one line naming the architecture and listing the supported ones.
    """
    if arch == "llama" and has_experts:
        return FAMILIES["mixtral"]
    for f in FAMILIES.values():
        if arch in f.gguf_archs:
            return f
    raise ValueError(f"{where}GGUF architecture {arch!r} is not supported; supported: "
                     f"{', '.join(supported_gguf_archs())} (and Mixtral as llama with experts)")


def family_of(name: str) -> Family:
    """The record named `name` (`ModelConfig.family`)."""
    return FAMILIES[name]


def rename(suffix: str, table: dict) -> Optional[str]:
    """`suffix` mapped through `table`, whose keys may hold one "*" (an expert index) that is
    carried to the value; None when no key matches."""
    if suffix in table:
        return table[suffix]
    for k, v in table.items():
        if "*" in k:
            head, tail = k.split("*")
            if suffix.startswith(head) and suffix.endswith(tail):
                mid = suffix[len(head):len(suffix) - len(tail)]
                if mid.isdigit():
                    return v.replace("*", mid)
    return None
