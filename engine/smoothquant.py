"""W8A8 with SmoothQuant smoothing: calibration statistics, the smoothed copy of a model, its W8A8 layers.

SmoothQuant (Xiao et al. 2022, arXiv 2211.10438) moves the outliers of a linear
layer's input into its weights: with a per-input-channel factor
s_j = max|X_j|^alpha / max|W_:,j|^(1 - alpha), X W^T = (X / s)(W s)^T exactly, and
X / s quantizes with less error. The 1 / s is folded into whatever produces X, so
nothing is added at run time:

- qkv and gate_up (inputs from RMSNorm): into the norm's weight.
- down (input silu(gate) * up): into the up projection's rows.
- o (input: attention output): into the v projection's rows, one factor per KV-head
  channel shared by the query heads of its group (softmax weights leave a per-channel
  scale of V unchanged through attention).

Calibration needs activations of real text, and an engine at load time has none of
the user's data: the fp32 model writes its own, sampled (seeded) from a fixed list of
generic instructions, and the per-channel max |X| of every linear layer's input is
recorded over a prefill of those texts (data-free calibration from model-generated text
as in LLM-QAT, Liu et al. 2023, arXiv 2305.17888).

Measured on SmolLM2-135M (`python -m benchmarks.quality`): per-token activation scales
alone +5.4% perplexity; with smoothing +1.0-1.8% (depending on the calibration text);
per-token scales per group of 64 columns with smoothing (what `W8A8Linear` does) +0.2%;
with the weights' codes in [-63, 63] (what the AVX2 kernel needs, `quantize_w8a8`) +0.01%.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn

CALIBRATION_PROMPTS = (
    "Explain how a hash table works.", "Write a short story about a lighthouse keeper.",
    "List five uses of a spreadsheet.", "What causes the seasons on Earth?", "Describe a recipe for bread.",
    "Summarize the rules of chess.", "Write a Python function that reverses a string.",
    "Give advice for a job interview.", "Translate 'good morning' into French and Spanish.",
    "Why is the sky blue?", "Write a haiku about rain.", "How do vaccines work?",
    "Compare Python lists and tuples.", "Plan a three-day trip to Rome.", "What is the Pythagorean theorem?",
    "Describe the water cycle.",
)
ALPHA = 0.5
LAYER_KINDS = ("qkv", "o", "gate_up", "down")


def calibration_absmax(llm: Any, tokens_per_prompt: int = 200, seed: int = 1) -> dict[tuple[int, str], torch.Tensor]:
    """Per-input-channel max |x| of every decoder linear layer over model-written text.

    Args:
        llm: an fp32 `engine.LLM`; its model is observed through forward pre-hooks that are
            removed before returning.
        tokens_per_prompt: new tokens sampled per calibration prompt (temperature 0.8, seeded).
    Returns:
        {(layer index, "qkv" | "o" | "gate_up" | "down"): [in_features] float32}.
    """
    from .config import SamplingParams

    tok = llm.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in CALIBRATION_PROMPTS]
    outs = llm.generate(prompts, SamplingParams(temperature=0.8, max_tokens=tokens_per_prompt, seed=seed),
                        use_tqdm=False)
    texts = [o.prompt_token_ids + o.outputs[0].token_ids for o in outs]
    stats: dict[tuple[int, str], torch.Tensor] = {}
    hooks = []

    def observe(key):
        def hook(_module, args):
            a = args[0].detach().abs().amax(0).float()
            stats[key] = torch.maximum(stats[key], a) if key in stats else a
        return hook

    for i, layer in enumerate(llm.model.layers):
        for kind in LAYER_KINDS:
            hooks.append(getattr(layer, kind).register_forward_pre_hook(observe((i, kind))))
    try:
        llm.score(texts)
    finally:
        for h in hooks:
            h.remove()
    return stats


def _factors(absmax: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    """s_j = max|X_j|^alpha / max|W_:,j|^(1 - alpha) (both floored at 1e-5)."""
    wmax = weight.abs().amax(0).clamp_min(1e-5)
    return absmax.clamp_min(1e-5) ** alpha / wmax ** (1 - alpha)


def smoothed_copy(model: nn.Module, stats: dict[tuple[int, str], torch.Tensor], make_linear: Callable,
                  alpha: float = ALPHA):
    """A new model sharing `model`'s embedding, final norm and LM head, whose decoder layers hold
    the smoothed norms and `make_linear(weight, bias)` of the smoothed weights (`model` itself is
    untouched). With float layers it computes what `model` computes (the folding is exact).

    Args:
        model: an fp32 LlamaModel.
        stats: `calibration_absmax` of that model.
        make_linear: (weight [out, in] float32, bias [out] or None) -> a linear layer.
        alpha: migration strength (0.5, the paper's default).
    """
    from .models.llama import DecoderLayer, LlamaModel

    cfg = model.cfg
    hq, hkv, d, inter = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    g = hq // hkv
    q = LlamaModel(cfg, model.dtype, model.device)
    q.embed, q.final_norm, q.lm_head, q.ops = model.embed, model.final_norm, model.lm_head, model.ops
    layers = []
    for i, layer in enumerate(model.layers):
        w = {k: getattr(layer, k).weight.detach().float().clone() for k in LAYER_KINDS}
        bias = {k: None if getattr(layer, k).bias is None else getattr(layer, k).bias.detach().float().clone()
                for k in LAYER_KINDS}
        attn_norm, mlp_norm = layer.attn_norm.detach().clone(), layer.mlp_norm.detach().clone()
        s = _factors(stats[(i, "qkv")], w["qkv"], alpha)
        attn_norm /= s
        w["qkv"] *= s
        s = _factors(stats[(i, "gate_up")], w["gate_up"], alpha)
        mlp_norm /= s
        w["gate_up"] *= s
        s = _factors(stats[(i, "down")], w["down"], alpha)
        w["gate_up"][inter:] /= s[:, None]
        if bias["gate_up"] is not None:  # the up bias is scaled with its rows
            bias["gate_up"][inter:] /= s
        w["down"] *= s
        s_kv = _factors(stats[(i, "o")], w["o"], alpha).view(hkv, g, d).amax(1)  # one per KV channel
        w["qkv"][(hq + hkv) * d:] /= s_kv.reshape(-1)[:, None]
        if bias["qkv"] is not None:
            bias["qkv"][(hq + hkv) * d:] /= s_kv.reshape(-1)
        w["o"] *= s_kv.repeat_interleave(g, 0).reshape(-1)
        lin = {k: make_linear(w[k], bias[k]) for k in LAYER_KINDS}
        layers.append(DecoderLayer(attn_norm, lin["qkv"], lin["o"], mlp_norm, lin["gate_up"], lin["down"]))
    q.layers = nn.ModuleList(layers)
    return q


def smoothed_w8a8_copy(model: nn.Module, stats: dict[tuple[int, str], torch.Tensor], alpha: float = ALPHA,
                       group_size: int | None = None):
    """`smoothed_copy` with W8A8 layers: the CPU kernel library's `W8A8Linear` on the CPU, the
    Triton `W8A8TritonLinear` on CUDA (activation groups of `group_size`, default
    `engine.kernels.cpu.W8A8_GROUP`); the LM head stays in float."""
    from .kernels.cpu import W8A8_GROUP

    gs = group_size or W8A8_GROUP
    if model.device.type == "cuda":
        from .kernels.w8a8_gemm import W8A8TritonLinear

        def make(w, b):
            return W8A8TritonLinear.from_float(w, b, gs, model.dtype)
    else:
        from .kernels.cpu.layers import W8A8Linear

        def make(w, b):
            return W8A8Linear.from_float(w, b, gs)
    return smoothed_copy(model, stats, make, alpha)
