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
CALIBRATION_TOKENS = 200  # new tokens sampled per calibration prompt
CALIBRATION_SEED = 1  # the calibration text's sampling seed
LAYER_KINDS = ("qkv", "o", "gate_up", "down")


def calibration_absmax(llm: Any, tokens_per_prompt: int = CALIBRATION_TOKENS,
                       seed: int = CALIBRATION_SEED) -> dict[tuple[int, str], torch.Tensor]:
    """Per-input-channel max |x| of every decoder linear layer over model-written text.

    Args:
        llm: an fp32 `engine.LLM`; its model is observed through forward pre-hooks that are
            removed before returning.
        tokens_per_prompt: new tokens sampled per calibration prompt (temperature 0.8, seeded).
    Returns:
        {(layer index, "qkv" | "o" | "gate_up" | "down" | "experts.{e}.gate_up" | "experts.{e}.down"):
        [in_features] float32}; an expert no calibration token reached has no entry.
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

    for name, lin in llm.model.linear_layers():
        if name != "lm_head":  # "layers.{i}.{kind}", kind also "experts.{e}.gate_up" / ".down"
            _, i, kind = name.split(".", 2)
            hooks.append(lin.register_forward_pre_hook(observe((int(i), kind))))
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

    A mixture of experts: its experts and router share one input, so one factor per channel
    (from the largest weight of any expert) is folded into the MLP norm, every expert's gate/up
    columns and the router's columns (the router stays in float); each expert's down input is
    smoothed into its own up rows (an expert without calibration statistics keeps factor 1).

    Args:
        model: an fp32 LlamaModel.
        stats: `calibration_absmax` of that model.
        make_linear: (weight [out, in] float32, bias [out] or None) -> a linear layer.
        alpha: migration strength (0.5, the paper's default).
    """
    from .models.llama import DecoderLayer, Expert, LlamaModel, MoEMLP

    cfg = model.cfg
    hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    g = hq // hkv
    q = LlamaModel(cfg, model.dtype, model.device)
    q.embed, q.final_norm, q.lm_head, q.ops = model.embed, model.final_norm, model.lm_head, model.ops
    wb = lambda lin: (lin.weight.detach().float().clone(),  # noqa: E731
                      None if lin.bias is None else lin.bias.detach().float().clone())

    def glu(gate_up: torch.Tensor, up_bias, down: torch.Tensor, key) -> None:
        """Fold the down projection's factor into the up rows (in place)."""
        if key not in stats:
            return
        s = _factors(stats[key], down, alpha)
        inter = down.shape[1]
        gate_up[inter:] /= s[:, None]
        if up_bias is not None:  # the up bias is scaled with its rows
            up_bias[inter:] /= s
        down *= s

    layers = []
    for i, layer in enumerate(model.layers):
        (wqkv, bqkv), (wo, bo) = wb(layer.qkv), wb(layer.o)
        attn_norm, mlp_norm = layer.attn_norm.detach().clone(), layer.mlp_norm.detach().clone()
        s = _factors(stats[(i, "qkv")], wqkv, alpha)
        attn_norm /= s
        wqkv *= s
        s_kv = _factors(stats[(i, "o")], wo, alpha).view(hkv, g, d).amax(1)  # one per KV channel
        wqkv[(hq + hkv) * d:] /= s_kv.reshape(-1)[:, None]
        if bqkv is not None:
            bqkv[(hq + hkv) * d:] /= s_kv.reshape(-1)
        wo *= s_kv.repeat_interleave(g, 0).reshape(-1)
        kw = dict(q_norm=layer.q_norm, k_norm=layer.k_norm, attn_post_norm=layer.attn_post_norm,
                  mlp_post_norm=layer.mlp_post_norm)
        if layer.moe is None:
            (wgu, bgu), (wd, bd) = wb(layer.gate_up), wb(layer.down)
            s = _factors(stats[(i, "gate_up")], wgu, alpha)
            mlp_norm /= s
            wgu *= s
            glu(wgu, bgu, wd, (i, "down"))
            kw.update(gate_up=make_linear(wgu, bgu), down=make_linear(wd, bd))
        else:
            moe = layer.moe
            ws = [(wb(ex.gate_up), wb(ex.down)) for ex in moe.experts]
            seen = [stats[(i, f"experts.{e}.gate_up")] for e in range(len(ws)) if (i, f"experts.{e}.gate_up") in stats]
            router = moe.router.detach().float().clone()
            if seen:
                xmax = torch.stack(seen).amax(0)
                wmax = torch.stack([w.abs().amax(0) for (w, _), _ in ws]).amax(0)
                s = xmax.clamp_min(1e-5) ** alpha / wmax.clamp_min(1e-5) ** (1 - alpha)
                mlp_norm /= s
                router *= s
                for (wgu, _), _ in ws:
                    wgu *= s
            experts = []
            for e, ((wgu, bgu), (wd, bd)) in enumerate(ws):
                glu(wgu, bgu, wd, (i, f"experts.{e}.down"))
                experts.append(Expert(make_linear(wgu, bgu), make_linear(wd, bd)))
            kw["moe"] = MoEMLP(router.to(moe.router.dtype), experts, moe.top_k, moe.norm_topk_prob, moe.act)
        layers.append(DecoderLayer(attn_norm, make_linear(wqkv, bqkv), make_linear(wo, bo), mlp_norm, **kw))
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
