"""The shape of a model: `ModelConfig` (a Llama-family decoder's dimensions, RoPE, windows, MoE) and
`PRESETS`, named real shapes for dummy-weight benchmarks.

Below the weight loaders (`engine.weights`) and the tensor-parallel sharding rules
(`engine.parallel.sharding`), which both read it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2).

    Attributes:
        hidden_size, intermediate_size, num_layers: model dimensions.
        num_heads, num_kv_heads, head_dim: attention heads (GQA when num_kv_heads < num_heads).
        vocab_size: rows of the embedding / LM head.
        rope_theta: RoPE base (Su et al. 2021, arXiv 2104.09864).
        rope_scaling: None or a dict of Llama 3.1 "llama3" frequency scaling.
        rms_norm_eps: RMSNorm epsilon (Zhang & Sennrich 2019).
        max_position_embeddings: trained context length in tokens.
        tie_word_embeddings: LM head shares the embedding matrix.
        attention_bias: q/k/v projections have a bias (Qwen2).
        family: the family record's name (`engine.models.family.FAMILIES`): which layer the
            decoder builds (norm placement, activation, q/k norm, MoE, tensor names).
        layer_windows: per layer, the sliding-window length in tokens (a query at position p
            attends keys at positions p - w < j <= p); 0 means full attention. Empty: every
            layer attends to the whole sequence.
        rope_local_theta: RoPE base of the sliding-window layers (Gemma 3), None: rope_theta.
        attn_scale: the softmax scale of q k^T; None: head_dim ** -0.5.
        num_experts, num_experts_per_tok, moe_intermediate_size: a mixture-of-experts MLP
            (0: dense): E experts, top-k routing, each expert's intermediate size.
        norm_topk_prob: renormalise the top-k routing weights to sum to 1.
        dense_layers: indices of the layers whose MLP is dense in a mixture-of-experts model.
    """

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    head_dim: int = 0
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    name: str = "llama"
    family: str = "llama"
    layer_windows: tuple = ()
    rope_local_theta: Optional[float] = None
    attn_scale: Optional[float] = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    dense_layers: tuple = ()

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ValueError(f"layer_windows has {len(self.layer_windows)} entries for {self.num_layers} layers")

    def window(self, layer: int) -> int:
        """Sliding-window length of `layer` in tokens, 0 for full attention."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def max_window(self) -> int:
        """The longest sliding window of any layer (0: no sliding-window layer)."""
        return max(self.layer_windows, default=0)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether `layer`'s MLP is a mixture of experts."""
        return self.num_experts > 0 and layer not in self.dense_layers

    @property
    def num_params(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        layer = attn + 3 * h * i + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + emb + h

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V for one token over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


# Named real shapes for dummy-weight benchmarks (figures from each model's published config).
PRESETS: dict[str, ModelConfig] = {
    "smollm2-135m": ModelConfig(576, 1536, 30, 9, 3, 49152, rope_theta=100000.0,
                                max_position_embeddings=8192, tie_word_embeddings=True, name="smollm2-135m"),
    "llama-3-8b": ModelConfig(4096, 14336, 32, 32, 8, 128256, rope_theta=500000.0,
                              max_position_embeddings=8192, name="llama-3-8b"),
    "llama-3.2-1b": ModelConfig(2048, 8192, 16, 32, 8, 128256, rope_theta=500000.0,
                                max_position_embeddings=8192, tie_word_embeddings=True, name="llama-3.2-1b"),
    "llama-2-7b": ModelConfig(4096, 11008, 32, 32, 32, 32000, rope_theta=10000.0,
                              max_position_embeddings=4096, name="llama-2-7b"),
    "mistral-7b": ModelConfig(4096, 14336, 32, 32, 8, 32000, rope_theta=1000000.0,
                              max_position_embeddings=32768, name="mistral-7b"),
    "llama-3-70b": ModelConfig(8192, 28672, 80, 64, 8, 128256, rope_theta=500000.0,
                               max_position_embeddings=8192, name="llama-3-70b"),
    # a small Llama shape with 4 KV heads (8 query heads) and an untied LM head: tensor
    # parallelism at 2 and 4 in tests (SmolLM2's 3 KV heads allow only 3)
    "llama-tiny-4kv": ModelConfig(256, 768, 4, 8, 4, 49152, rope_theta=10000.0,
                                  max_position_embeddings=2048, name="llama-tiny-4kv"),
    "qwen2-0.5b": ModelConfig(896, 4864, 24, 14, 2, 151936, rope_theta=1000000.0, rms_norm_eps=1e-6,
                              max_position_embeddings=32768, tie_word_embeddings=True,
                              attention_bias=True, name="qwen2-0.5b"),
}
