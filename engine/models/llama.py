"""The Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2) over a flattened token batch.

One forward pass takes T tokens from any number of sequences (no padding in
the linear layers), their absolute positions, and the step's attention
metadata; it writes each token's K/V into the paged cache and returns the
logits of the requested positions only.

Blocks: RMSNorm (Zhang & Sennrich 2019, arXiv 1910.07467); rotary position
embedding in the "rotate half" layout (Su et al. 2021, arXiv 2104.09864), with
Llama 3.1's frequency scaling when configured; grouped-query attention
(Ainslie et al. 2023, arXiv 2305.13245); SwiGLU MLP (Shazeer 2020, arXiv 2002.05202).
q/k/v and gate/up projections are fused into one matmul each.

Tensor parallelism (Megatron-LM, Shoeybi et al. 2019, arXiv 1909.08053): a model built for
rank r of N (`shard`) holds that rank's slices (see `engine.parallel.sharding`) and its
forward pass, given the group (`tp`), runs the same code with three collectives: the
vocabulary-parallel embedding and each row-parallel projection (o, down) end in one
all-reduce of the [T, H] residual stream, and the LM head's vocabulary slices of the
logits are gathered on rank 0. Attention and the MLP activation run on the rank's own
heads and columns, reading and writing its own paged KV cache.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..attention import AttentionBackend, AttentionMetadata
from ..parallel.sharding import SINGLE, TPShard, local_shape, shard_fused, shard_tensor
from ..model_config import ModelConfig


def rope_inv_freq(cfg: ModelConfig, theta: Optional[float] = None, scaled: bool = True) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] float64 of RoPE base `theta` (default cfg.rope_theta),
    with the configured frequency scaling when `scaled`: Llama 3.1's "llama3", "linear"
    (positions divided by the factor: Chen et al. 2023, arXiv 2306.15595), or "longrope"'s
    short factors (Phi-3; `rope_long_inv_freq` gives the long ones)."""
    d = cfg.head_dim
    base = cfg.rope_theta if theta is None else theta
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    s = cfg.rope_scaling if scaled else None
    if not s:
        return inv
    kind = s.get("rope_type", "llama3")
    if kind == "linear":
        return inv / float(s["factor"])
    if kind == "longrope":
        return inv / torch.tensor(s["short_factor"], dtype=torch.float64)
    factor = float(s.get("factor", 8.0))
    lo = float(s.get("low_freq_factor", 1.0))
    hi = float(s.get("high_freq_factor", 4.0))
    old = float(s.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv
    low_wl, high_wl = old / lo, old / hi
    smooth = (old / wavelen - lo) / (hi - lo)
    scaled_inv = torch.where(wavelen > low_wl, inv / factor, inv)
    mid = (wavelen <= low_wl) & (wavelen >= high_wl)
    return torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled_inv)


def longrope_tables(cfg: ModelConfig, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [n, head_dim/2] float64 of Phi-3's "longrope" scaling (Ding et al. 2024, arXiv
    2402.13753): short factors at positions below `original_max_position_embeddings`, long ones
    from there on, both times the attention factor sqrt(1 + ln(s) / ln(original)), s = max
    positions / original (as transformers computes it)."""
    s, d = cfg.rope_scaling, cfg.head_dim
    orig = int(s.get("original_max_position_embeddings") or cfg.max_position_embeddings)
    base = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    factor = s.get("factor") or cfg.max_position_embeddings / orig
    attn = s.get("attention_factor")
    if attn is None:
        attn = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    t = torch.arange(n, dtype=torch.float64)
    short = torch.outer(t, base / torch.tensor(s["short_factor"], dtype=torch.float64))
    long = torch.outer(t, base / torch.tensor(s["long_factor"], dtype=torch.float64))
    f = torch.where((t < orig).unsqueeze(1), short, long)
    return f.cos() * attn, f.sin() * attn


class Linear(nn.Module):
    """y = x W^T + b over a flattened batch. The unit that quantization swaps
    (`engine.quant`): a quantized counterpart owns packed weights and scales and
    keeps this `forward(x) -> y` contract.

    Args:
        weight: [out_features, in_features]; bias: [out_features] or None.
    Shapes: x [T, in_features] -> y [T, out_features], in the weight's dtype. Every linear
    layer (this one, `engine.quant.QuantLinear`, the CPU kernel layers of
    `engine.kernels.cpu.layers`) takes `forward(x, out=None, residual=None)`.
    """

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]

    def forward(self, x: torch.Tensor, out: Optional[torch.Tensor] = None,
                residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [T, in] -> x W^T (+ b) [T, out], into `out` when given; with `residual`,
        residual += x W^T (+ b) in place (one GEMM with beta = 1) and residual is returned."""
        if residual is not None:
            if self.bias is not None:
                residual.add_(self.bias)
            return residual.addmm_(x, self.weight.t())
        if out is None:
            return F.linear(x, self.weight, self.bias)
        if self.bias is None:
            return torch.mm(x, self.weight.t(), out=out)
        return torch.addmm(self.bias, x, self.weight.t(), out=out)

    def weight_bytes(self) -> int:
        """Bytes this layer reads per forward pass (weights and bias)."""
        n = self.weight.numel() * self.weight.element_size()
        return n + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())


def _glu_fused(gate_up: nn.Module) -> bool:
    """Whether the layer loop may run gate/up with SwiGLU in its epilogue (`silu_mul`): a CPU
    kernel layer that fuses it, with no forward hook on it or on every module (a hook, such as
    SmoothQuant's calibration, sees the [T, 2I] product of a plain call)."""
    from torch.nn.modules import module as _m

    return (getattr(gate_up, "silu_fused", False) and not gate_up._forward_hooks
            and not gate_up._forward_pre_hooks and not _m._global_forward_hooks
            and not _m._global_forward_pre_hooks)


class DecoderLayer(nn.Module):
    """One block's weights: attention (fused q/k/v, output) and a gated MLP (fused gate/up, down)
    or a mixture of experts (`moe`), with the norms its family names (`engine.models.family`):
    pre-norms always; per-head q/k norms (`q_norm`, `k_norm` [head_dim]) and the norms of the
    attention and MLP outputs (`attn_post_norm`, `mlp_post_norm` [H]) where the family has them."""

    def __init__(self, attn_norm: torch.Tensor, qkv: Linear, o: Linear, mlp_norm: torch.Tensor,
                 gate_up: Optional[Linear] = None, down: Optional[Linear] = None, moe: Optional["MoEMLP"] = None,
                 q_norm: Optional[torch.Tensor] = None, k_norm: Optional[torch.Tensor] = None,
                 attn_post_norm: Optional[torch.Tensor] = None, mlp_post_norm: Optional[torch.Tensor] = None) -> None:
        super().__init__()
        p = lambda t: None if t is None else nn.Parameter(t, requires_grad=False)  # noqa: E731
        self.attn_norm = p(attn_norm)
        self.qkv, self.o, self.gate_up, self.down, self.moe = qkv, o, gate_up, down, moe
        self.mlp_norm = p(mlp_norm)
        self.q_norm, self.k_norm = p(q_norm), p(k_norm)
        self.attn_post_norm, self.mlp_post_norm = p(attn_post_norm), p(mlp_post_norm)

    def shell(self) -> "DecoderLayer":
        """A new layer sharing every tensor and linear layer of this one, whose linear layers
        (experts' too) can be swapped without touching this one."""
        d = lambda t: None if t is None else t.data  # noqa: E731
        moe = self.moe
        if moe is not None:
            moe = MoEMLP(moe.router.data, [Expert(e.gate_up, e.down) for e in moe.experts], moe.top_k,
                         moe.norm_topk_prob, moe.act)
        return DecoderLayer(d(self.attn_norm), self.qkv, self.o, d(self.mlp_norm), self.gate_up, self.down, moe,
                            d(self.q_norm), d(self.k_norm), d(self.attn_post_norm), d(self.mlp_post_norm))


class Expert(nn.Module):
    """One expert's gated MLP: fused gate/up [2I, H] and down [H, I]."""

    def __init__(self, gate_up: Linear, down: Linear) -> None:
        super().__init__()
        self.gate_up, self.down = gate_up, down


class MoEMLP(nn.Module):
    """A mixture-of-experts MLP with top-k routing (Shazeer et al. 2017, arXiv 1701.06538; the
    Mixtral and Qwen3-MoE layout): softmax over the E router logits in fp32, the k largest
    probabilities, renormalised to sum 1 when `norm_topk_prob`; each token's output is the
    weighted sum of its k experts' gated MLPs.

    The step's tokens are grouped by expert (one stable sort of the T x k choices), so each
    expert runs one GEMM over all of its tokens; the expert layers are ordinary linear layers,
    so the CPU kernels and every quantization scheme apply per expert.

    Args:
        router: [E, H] router weight (kept in float, never quantized).
        experts: E `Expert`s (on a tensor-parallel rank: their intermediate slices).
        top_k: experts per token. norm_topk_prob: renormalise the top-k weights.
        act: the gated activation, `ops.silu_mul`-like: (gu [n, 2I], out) -> [n, I].
    Shapes: forward(x [T, H]) -> [T, H] in x's dtype, with the `Linear` contract (`out=`,
    `residual=`: residual += result).
    """

    def __init__(self, router: torch.Tensor, experts: list[Expert], top_k: int, norm_topk_prob: bool, act) -> None:
        super().__init__()
        self.router = nn.Parameter(router, requires_grad=False)
        self.experts = nn.ModuleList(experts)
        self.top_k, self.norm_topk_prob, self.act = top_k, norm_topk_prob, act

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in x's dtype, expert ids [T, k] int64) of each token's top-k experts."""
        probs = torch.softmax(F.linear(x, self.router).float(), dim=-1)
        w, idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            w = w / w.sum(dim=-1, keepdim=True)
        return w.to(x.dtype), idx

    def forward(self, x: torch.Tensor, out: Optional[torch.Tensor] = None,
                residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        w, idx = self.route(x)
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)  # the T*k choices grouped by expert, token order kept
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        token = order // self.top_k
        xs = x.index_select(0, token)
        ys = torch.empty_like(xs)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            ex = self.experts[e]
            gu = ex.gate_up(xs[start:start + n])
            ex.down(self.act(gu), out=ys[start:start + n])
            start += n
        ys.mul_(w.reshape(-1, 1).index_select(0, order))
        y = torch.zeros_like(x).index_add_(0, token, ys)
        if residual is not None:
            return residual.add_(y)
        return y if out is None else out.copy_(y)

    def weight_bytes(self) -> int:
        """Bytes of the router and every expert."""
        n = self.router.numel() * self.router.element_size()
        return n + sum(ex.gate_up.weight_bytes() + ex.down.weight_bytes() for ex in self.experts)


class LlamaModel(nn.Module):
    """Decoder weights plus the varlen forward pass.

    Args:
        cfg: model shape (the whole model's, also on a tensor-parallel rank).
        dtype: weight and activation dtype.
        device: where weights live.
        shard: the tensor-parallel rank this model holds the slices of (default: all of it);
            `local` then holds the rank's head, MLP and vocabulary sizes.
    """

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, shard: TPShard = SINGLE) -> None:
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype
        self.device = device
        self.shard = shard
        self.local = local_shape(cfg, shard)
        from .family import family_of

        self.family = family_of(cfg.family)
        self.scale = cfg.attn_scale if cfg.attn_scale is not None else cfg.head_dim ** -0.5
        self.q_size = self.local.num_heads * cfg.head_dim
        self.kv_size = self.local.num_kv_heads * cfg.head_dim
        self._inv_freq = rope_inv_freq(cfg)
        # the sliding-window layers' own RoPE base (Gemma 3), unscaled
        self._local_inv_freq = None if cfg.rope_local_theta is None else rope_inv_freq(cfg, cfg.rope_local_theta, False)
        self._rope_len = 0
        self.cos = self.sin = self.cos_local = self.sin_local = None
        # weights, filled by load_state_dict / init_dummy
        self.embed: Optional[torch.Tensor] = None
        self.lm_head: Optional[Linear] = None
        self.final_norm: Optional[torch.Tensor] = None
        self.layers = nn.ModuleList()
        from .ops import select_ops

        self.ops = select_ops(device, dtype)  # how the small ops run (see models/ops.py)
        self._c_decoder = None  # engine.kernels.cpu.decoder.CpuDecoder, made on first use

    # ------------------------------------------------------------ weights
    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Fuse, cast and move a fp32 state dict (our names, `engine.models.family`): the
        whole model's tensors, or on a tensor-parallel rank its slices (the loaders of
        `engine.weights` read them so).

        Raises:
            KeyError: naming the first missing tensor.
        """
        def take(name: str) -> torch.Tensor:
            if name not in state:
                raise KeyError(f"weight {name!r} missing from the checkpoint")
            return state[name].to(device=self.device, dtype=self.dtype).contiguous()

        tied = self.cfg.tie_word_embeddings or "lm_head.weight" not in state
        self._build(take, None if tied else take("lm_head.weight"))

    def init_dummy(self, seed: int = 0) -> None:
        """Random weights of the configured shape, made directly on the device (for benchmarks).

        A tensor-parallel rank draws every full tensor in the same order as an unsharded
        model and keeps its slice (one full tensor exists at a time), so the N ranks together
        hold exactly the weights one device would: greedy outputs can be compared across N."""
        cfg, sh = self.cfg, self.shard
        gen = torch.Generator(device=self.device).manual_seed(seed)
        h, d = cfg.hidden_size, cfg.head_dim
        q, kv = cfg.num_heads * d, cfg.num_kv_heads * d

        def shape(name: str) -> tuple[int, ...]:
            if name.endswith("norm.weight"):
                return (d,) if ("q_norm" in name or "k_norm" in name) else (h,)
            if name in ("embed_tokens.weight", "lm_head.weight"):
                return (cfg.vocab_size, h)
            if name.endswith("mlp.gate.weight"):
                return (cfg.num_experts, h)
            i = cfg.moe_intermediate_size if ".experts." in name else cfg.intermediate_size
            proj = name.rsplit(".", 2)[-2]
            rows = {"q_proj": q, "k_proj": kv, "v_proj": kv, "o_proj": h, "gate_proj": i, "up_proj": i,
                    "down_proj": h}[proj]
            cols = {"o_proj": q, "down_proj": i}.get(proj, h)
            return (rows,) if name.endswith("bias") else (rows, cols)

        def take(name: str) -> torch.Tensor:
            if name.endswith("norm.weight"):
                return torch.ones(shape(name), device=self.device, dtype=self.dtype)
            t = torch.randn(*shape(name), generator=gen, device=self.device, dtype=self.dtype) * 0.02
            return shard_tensor(name, t, cfg, sh)

        self._build(take, None if cfg.tie_word_embeddings else "draw")

    def _build(self, take, lm_head) -> None:
        """Make the layers from `take(name) -> tensor` (our names, the rank's slice), in one fixed
        order of names; `lm_head` None: tied to the embedding; "draw": take it after the
        embedding; a tensor: that one."""
        cfg, fam = self.cfg, self.family
        self.embed = take("embed_tokens.weight")
        if isinstance(lm_head, str):
            lm_head = take("lm_head.weight")
        self.lm_head = Linear(self.embed if lm_head is None else lm_head)
        self.final_norm = take("norm.weight")
        act = self.ops.silu_mul if fam.activation == "silu" else self.ops.gelu_tanh_mul
        layers = []
        for li in range(cfg.num_layers):
            p = f"layers.{li}."
            qkv_bias = None
            if cfg.attention_bias:
                qkv_bias = torch.cat([take(p + f"self_attn.{x}_proj.bias") for x in "qkv"], 0)
            kw = {}
            if fam.qk_norm:
                kw.update(q_norm=take(p + "self_attn.q_norm.weight"), k_norm=take(p + "self_attn.k_norm.weight"))
            if fam.sandwich_norms:
                kw.update(attn_post_norm=take(p + "attn_post_norm.weight"), mlp_post_norm=take(p + "mlp_post_norm.weight"))
            attn_norm = take(p + "input_layernorm.weight")
            qkv = Linear(torch.cat([take(p + f"self_attn.{x}_proj.weight") for x in "qkv"], 0), qkv_bias)
            o = Linear(take(p + "self_attn.o_proj.weight"))
            mlp_norm = take(p + "post_attention_layernorm.weight")
            if cfg.is_moe_layer(li):
                router = take(p + "mlp.gate.weight")
                experts = []
                for e in range(cfg.num_experts):
                    ep = p + f"mlp.experts.{e}."
                    experts.append(Expert(Linear(torch.cat([take(ep + "gate_proj.weight"), take(ep + "up_proj.weight")], 0)),
                                          Linear(take(ep + "down_proj.weight"))))
                kw["moe"] = MoEMLP(router, experts, cfg.num_experts_per_tok, cfg.norm_topk_prob, act)
            else:
                kw["gate_up"] = Linear(torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")], 0))
                kw["down"] = Linear(take(p + "mlp.down_proj.weight"))
            layers.append(DecoderLayer(attn_norm, qkv, o, mlp_norm, **kw))
        self.layers = nn.ModuleList(layers)

    def linear_layers(self) -> list[tuple[str, Linear]]:
        """(name, layer) of every swappable linear layer, LM head last: per layer "qkv", "o" and
        "gate_up", "down", or per expert e "experts.{e}.gate_up", "experts.{e}.down" (a router
        stays in float)."""
        out = []
        for i, layer in enumerate(self.layers):
            out += [(f"layers.{i}.qkv", layer.qkv), (f"layers.{i}.o", layer.o)]
            if layer.moe is None:
                out += [(f"layers.{i}.gate_up", layer.gate_up), (f"layers.{i}.down", layer.down)]
            else:
                for e, ex in enumerate(layer.moe.experts):
                    out += [(f"layers.{i}.experts.{e}.gate_up", ex.gate_up), (f"layers.{i}.experts.{e}.down", ex.down)]
        out.append(("lm_head", self.lm_head))
        return out

    def set_linear(self, name: str, layer: nn.Module) -> None:
        """Replace the linear layer `name` (as `linear_layers` names it) by `layer`."""
        if name == "lm_head":
            self.lm_head = layer
            return
        parts = name.split(".")
        owner = self.layers[int(parts[1])]
        if parts[2] == "experts":
            owner = owner.moe.experts[int(parts[3])]
        setattr(owner, parts[-1], layer)

    def weight_bytes(self) -> int:
        """Bytes of all weights as stored (the tied embedding counted once)."""
        el = self.embed.element_size()
        n = self.embed.numel() * el + self.final_norm.numel() * el
        for name, lin in self.linear_layers():
            if name == "lm_head" and lin.weight.data_ptr() == self.embed.data_ptr():
                continue
            n += lin.weight_bytes()
        for layer in self.layers:
            for t in (layer.attn_norm, layer.mlp_norm, layer.q_norm, layer.k_norm, layer.attn_post_norm,
                      layer.mlp_post_norm):
                n += 0 if t is None else t.numel() * el
            if layer.moe is not None:
                n += layer.moe.router.numel() * layer.moe.router.element_size()
        return n

    # ------------------------------------------------------------ pieces
    def _rope_tables(self, max_pos: int) -> None:
        """Make the cos/sin tables [n, head_dim / 2] float32 cover positions < max_pos (grown, never
        shrunk); with a local RoPE base, the sliding-window layers' tables too."""
        if max_pos <= self._rope_len:
            return
        n = max(max_pos, 2 * self._rope_len, 4096)
        t = torch.arange(n, dtype=torch.float64)
        f32 = lambda x: x.to(self.device, torch.float32).contiguous()  # noqa: E731
        s = self.cfg.rope_scaling
        if s and s.get("rope_type") == "longrope":
            cos, sin = longrope_tables(self.cfg, n)
        else:
            freqs = torch.outer(t, self._inv_freq)
            cos, sin = freqs.cos(), freqs.sin()
        self.cos, self.sin = f32(cos), f32(sin)
        if self._local_inv_freq is not None:
            freqs = torch.outer(t, self._local_inv_freq)
            self.cos_local, self.sin_local = f32(freqs.cos()), f32(freqs.sin())
        self._rope_len = n

    @property
    def has_dense_mlp(self) -> bool:
        """Whether any layer has a dense MLP (else every MLP is a mixture of experts)."""
        return len(self.cfg.dense_layers) > 0 or not self.cfg.num_experts

    @property
    def plain_layers(self) -> bool:
        """Whether every layer is the Llama block (pre-norms, SwiGLU, dense MLP, one RoPE table; a
        sliding window allowed): the layout the C decoder driver runs."""
        f, c = self.family, self.cfg
        return not (f.qk_norm or f.sandwich_norms or f.activation != "silu" or f.embed_scale or c.num_experts
                    or c.rope_local_theta is not None)

    def _rms_norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """RMSNorm through the PyTorch reference ops (kept for callers outside the forward)."""
        from .ops import TorchOps

        return TorchOps.rms_norm(x, w, self.cfg.rms_norm_eps)

    # ------------------------------------------------------------ forward
    use_c_decoder = True  # run the layers through engine.kernels.cpu.decoder where it serves the step

    def _c_decoder_plan(self, q: torch.Tensor, kv_caches, backend: AttentionBackend, meta: AttentionMetadata):
        """The attention backend's kernel plan when `engine.kernels.cpu.decoder` can run this
        step's layers (C small ops and linear layers, and a backend whose `fused_decoder_plan` says the
        C kernel serves its attention this step), else None. The model's description is made on first use and
        remade after a layer swap."""
        if (not self.use_c_decoder or not self.plain_layers or getattr(self.ops, "name", "") != "cpu"
                or not kv_caches or meta.slot_mapping.dtype != torch.int64 or not meta.slot_mapping.is_contiguous()
                or meta.window_meta is not None):  # two KV groups (full and sliding layers): the loop
            return None
        plan = backend.fused_decoder_plan(q, kv_caches[0][0], meta)  # None: the backend's own forward runs
        if plan is None:
            return None
        from ..kernels.cpu.decoder import CpuDecoder

        drv = getattr(self, "_c_decoder", None)
        if drv is None or not drv.current(self, kv_caches):
            drv = None
            if CpuDecoder.describe(self, kv_caches) is not None:
                drv = CpuDecoder(self, kv_caches)
            self._c_decoder = drv
            if drv is None:
                return None
        return plan

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        backend: AttentionBackend,
        logits_indices: torch.Tensor,
        tp=None,
        argmax=None,
    ) -> Optional[torch.Tensor]:
        """Run the decoder over a flattened batch.

        Each step allocates its activation buffers once ([T, H] residual and norm output,
        [T, q + 2 kv] fused qkv, [T, Hq D] attention output, [T, 2I] gate/up, [T, I]
        activation) and every layer writes into them; residual adds are fused into the o
        and down projections (`layer(x, residual=h)`).

        Args:
            input_ids: [T] int64 token ids.
            positions: [T] int64 absolute positions.
            meta: the step's attention metadata (already `backend.prepare`d).
            kv_caches: per layer (k_cache, v_cache), in the backend's layout.
            backend: attention backend.
            logits_indices: [S] int64, which of the T positions need logits.
            tp: the tensor-parallel group (`engine.parallel.TPGroup`) of a sharded model, with
                every rank calling forward on the same inputs; None for an unsharded model.
            argmax: an `engine.sampler.FusedGreedy` when every row is plain greedy and the LM
                head can take the argmax in its GEMM (`fused_argmax_ok`): the logits are then
                never written.
        Returns:
            [S, vocab_size] float32 logits (on a tensor-parallel rank other than 0: None); with
            `argmax`, [S] int64 token ids instead.
        Raises:
            ValueError: a sharded model without its group.
        """
        cfg, ops = self.cfg, self.ops
        if self.shard.is_sharded and (tp is None or tp.world_size != self.shard.world_size):
            raise ValueError(f"this model holds rank {self.shard.rank} of {self.shard.world_size} tensor-parallel "
                             f"slices: forward needs its group (tp=)")
        tp = tp if self.shard.is_sharded else None
        T = input_ids.shape[0]
        if positions.device.type == "cpu":  # on CUDA the engine sizes the tables up front (no host sync)
            self._rope_tables(int(positions.max()) + 1)
        hq, hkv, d = self.local.num_heads, self.local.num_kv_heads, cfg.head_dim
        eps = cfg.rms_norm_eps
        h = self._embed(input_ids, tp)
        if self.family.embed_scale:  # Gemma: embeddings times sqrt(hidden), in the model's dtype
            h.mul_(torch.tensor(cfg.hidden_size ** 0.5, dtype=h.dtype))
        new = functools.partial(torch.empty, dtype=h.dtype, device=h.device)
        x = new(T, cfg.hidden_size)
        qkv = new(T, self.q_size + 2 * self.kv_size)
        a = new(T, hq * d)
        inter = self.local.intermediate_size if self.has_dense_mlp else 0
        gu = new(T, 2 * inter)
        act = new(T, inter)
        q = qkv[:, : self.q_size].view(T, hq, d)
        k = qkv[:, self.q_size: self.q_size + self.kv_size].view(T, hkv, d)
        v = qkv[:, self.q_size + self.kv_size:].view(T, hkv, d)
        # (a tensor-parallel rank runs the loop: its all-reduces sit between the C kernels)
        plan = self._c_decoder_plan(q, kv_caches, backend, meta) if tp is None else None
        if plan is not None:  # every layer in one C call: the same kernels as the loop below
            self._c_decoder.run(h, positions, self.cos, self.sin, meta.slot_mapping, plan, meta.block_size,
                                self.scale, (x, qkv, a, gu, act))
            kv_caches = ()
        fam = self.family
        for li, (layer, (kc, vc)) in enumerate(zip(self.layers, kv_caches)):
            layer.qkv(ops.rms_norm(h, layer.attn_norm, eps, out=x), out=qkv)
            if layer.q_norm is not None:  # per-head RMSNorm of q and k (Qwen3, Gemma 3)
                q.copy_(ops.rms_norm(q.reshape(-1, d), layer.q_norm, eps).view(T, hq, d))
                k.copy_(ops.rms_norm(k.reshape(-1, d), layer.k_norm, eps).view(T, hkv, d))
            window = cfg.window(li)
            if window and self.cos_local is not None:
                ops.rope_(q, k, positions, self.cos_local, self.sin_local)
            else:
                ops.rope_(q, k, positions, self.cos, self.sin)
            m = meta.window_meta if (window and meta.window_meta is not None) else meta
            backend.forward(q, k, v, kc, vc, m, self.scale, out=a.view(T, hq, d), window=window)
            if layer.attn_post_norm is not None:  # Gemma: norm the attention output, then add
                self._row_parallel(layer.o, a, x, tp, out_only=True)
                h.add_(ops.rms_norm(x, layer.attn_post_norm, eps))
            else:
                self._row_parallel(layer.o, a, h, tp)
            mlp_in = ops.rms_norm(h, layer.mlp_norm, eps, out=x)
            if layer.moe is not None:
                mlp = layer.moe
                src = mlp_in
            else:
                mlp = layer.down
                if fam.activation == "silu" and _glu_fused(layer.gate_up):  # SwiGLU in the gate/up GEMM's epilogue
                    layer.gate_up.silu_mul(mlp_in, out=act)
                elif fam.activation == "silu":
                    ops.silu_mul(layer.gate_up(mlp_in, out=gu), out=act)
                else:
                    ops.gelu_tanh_mul(layer.gate_up(mlp_in, out=gu), out=act)
                src = act
            if layer.mlp_post_norm is not None:
                y = new(T, cfg.hidden_size)
                self._row_parallel(mlp, src, y, tp, out_only=True)
                h.add_(ops.rms_norm(y, layer.mlp_post_norm, eps))
            else:
                self._row_parallel(mlp, src, h, tp)
        hn = ops.rms_norm(ops.take_rows(h, logits_indices), self.final_norm, eps)
        if argmax is not None and tp is None and self.fused_argmax_ok:
            return self.lm_head.argmax(hn, argmax.limit, argmax.ban)
        logits = self.lm_head(hn)
        if tp is not None:  # vocabulary-parallel LM head: rank 0 gathers the slices
            logits = tp.gather_vocab(logits, cfg.vocab_size)
        return None if logits is None else logits.float()

    @property
    def fused_argmax_ok(self) -> bool:
        """Whether forward can return greedy token ids taken in the LM head's GEMM epilogue (an
        unsharded model whose head is served by the CPU kernel library)."""
        return not self.shard.is_sharded and callable(getattr(self.lm_head, "argmax", None))

    def _embed(self, input_ids: torch.Tensor, tp) -> torch.Tensor:
        """[T, H] embeddings. Sharded: each rank looks up the ids in its vocabulary rows
        [vocab_start, vocab_end), zeros elsewhere, and one all-reduce sums the ranks."""
        if tp is None:
            return self.ops.take_rows(self.embed, input_ids)
        lo, hi = self.local.vocab_start, self.local.vocab_end
        outside = (input_ids < lo) | (input_ids >= hi)
        h = F.embedding((input_ids - lo).masked_fill_(outside, 0), self.embed)
        h.masked_fill_(outside.unsqueeze(1), 0.0)
        return tp.all_reduce_(h)

    @staticmethod
    def _row_parallel(layer, x: torch.Tensor, h: torch.Tensor, tp, out_only: bool = False) -> None:
        """h += x W^T for a row-parallel layer (`out_only`: h = x W^T). Unsharded: one GEMM with
        the residual add fused. Sharded (x and W hold the rank's input columns): rank 0 computes
        h + x_0 W_0^T, every other rank x_r W_r^T into h, and one all-reduce leaves
        h + sum_r x_r W_r^T everywhere."""
        if (tp is None or tp.rank == 0) and not out_only:
            layer(x, residual=h)
        else:
            layer(x, out=h)
        if tp is not None:
            tp.all_reduce_(h)
