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
from ..weights import ModelConfig


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] float64, with Llama 3.1 "llama3" scaling if set."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    s = cfg.rope_scaling
    if s:
        factor = float(s.get("factor", 8.0))
        lo = float(s.get("low_freq_factor", 1.0))
        hi = float(s.get("high_freq_factor", 4.0))
        old = float(s.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv
        low_wl, high_wl = old / lo, old / hi
        smooth = (old / wavelen - lo) / (hi - lo)
        scaled = torch.where(wavelen > low_wl, inv / factor, inv)
        mid = (wavelen <= low_wl) & (wavelen >= high_wl)
        scaled = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
        inv = scaled
    return inv


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
    """One pre-norm block's weights: attention (fused q/k/v, output) and SwiGLU MLP (fused gate/up, down)."""

    def __init__(self, attn_norm: torch.Tensor, qkv: Linear, o: Linear, mlp_norm: torch.Tensor,
                 gate_up: Linear, down: Linear) -> None:
        super().__init__()
        self.attn_norm = nn.Parameter(attn_norm, requires_grad=False)
        self.qkv, self.o, self.gate_up, self.down = qkv, o, gate_up, down
        self.mlp_norm = nn.Parameter(mlp_norm, requires_grad=False)


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
        self.scale = cfg.head_dim ** -0.5
        self.q_size = self.local.num_heads * cfg.head_dim
        self.kv_size = self.local.num_kv_heads * cfg.head_dim
        inv = rope_inv_freq(cfg)
        self._inv_freq = inv
        self._rope_len = 0
        self.cos = self.sin = None
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
        """Fuse, cast and move a fp32 state dict (Hugging Face names without "model."): the
        whole model's tensors, or on a tensor-parallel rank its slices (the loaders of
        `engine.weights` read them so).

        Raises:
            KeyError: naming the first missing tensor.
        """
        cfg = self.cfg

        def take(name: str) -> torch.Tensor:
            if name not in state:
                raise KeyError(f"weight {name!r} missing from the checkpoint")
            return state[name]

        def put(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=self.device, dtype=self.dtype).contiguous()

        self.embed = put(take("embed_tokens.weight"))
        tied = cfg.tie_word_embeddings or "lm_head.weight" not in state
        self.lm_head = Linear(self.embed if tied else put(state["lm_head.weight"]))
        self.final_norm = put(take("norm.weight"))
        layers = []
        for i in range(cfg.num_layers):
            p = f"layers.{i}."
            qkv_bias = None
            if cfg.attention_bias:
                qkv_bias = put(torch.cat([take(p + f"self_attn.{x}_proj.bias") for x in "qkv"], 0))
            layers.append(DecoderLayer(
                attn_norm=put(take(p + "input_layernorm.weight")),
                qkv=Linear(put(torch.cat([take(p + f"self_attn.{x}_proj.weight") for x in "qkv"], 0)), qkv_bias),
                o=Linear(put(take(p + "self_attn.o_proj.weight"))),
                mlp_norm=put(take(p + "post_attention_layernorm.weight")),
                gate_up=Linear(put(torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")], 0))),
                down=Linear(put(take(p + "mlp.down_proj.weight"))),
            ))
        self.layers = nn.ModuleList(layers)

    def init_dummy(self, seed: int = 0) -> None:
        """Random weights of the configured shape, made directly on the device (for benchmarks).

        A tensor-parallel rank draws every full tensor in the same order as an unsharded
        model and keeps its slice (one full tensor exists at a time), so the N ranks together
        hold exactly the weights one device would: greedy outputs can be compared across N."""
        cfg, sh = self.cfg, self.shard
        gen = torch.Generator(device=self.device).manual_seed(seed)

        def rnd(*shape: int, std: float = 0.02) -> torch.Tensor:
            return (torch.randn(*shape, generator=gen, device=self.device, dtype=self.dtype) * std)

        h, i = cfg.hidden_size, cfg.intermediate_size
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        qkv_parts = [("self_attn.q_proj.weight", q), ("self_attn.k_proj.weight", kv), ("self_attn.v_proj.weight", kv)]
        qkv_bias_parts = [(n.replace("weight", "bias"), r) for n, r in qkv_parts]
        ones = lambda: torch.ones(h, device=self.device, dtype=self.dtype)  # noqa: E731
        self.embed = shard_tensor("embed_tokens.weight", rnd(cfg.vocab_size, h), cfg, sh)
        self.lm_head = Linear(self.embed if cfg.tie_word_embeddings else
                              shard_tensor("lm_head.weight", rnd(cfg.vocab_size, h), cfg, sh))
        self.final_norm = ones()
        layers = []
        for _ in range(cfg.num_layers):
            qkv = shard_fused(qkv_parts, rnd(q + 2 * kv, h), cfg, sh)
            qkv_b = shard_fused(qkv_bias_parts, rnd(q + 2 * kv), cfg, sh) if cfg.attention_bias else None
            layers.append(DecoderLayer(
                attn_norm=ones(),
                qkv=Linear(qkv, qkv_b),
                o=Linear(shard_tensor("self_attn.o_proj.weight", rnd(h, q), cfg, sh)),
                mlp_norm=ones(),
                gate_up=Linear(shard_fused([("mlp.gate_proj.weight", i), ("mlp.up_proj.weight", i)],
                                           rnd(2 * i, h), cfg, sh)),
                down=Linear(shard_tensor("mlp.down_proj.weight", rnd(h, i), cfg, sh)),
            ))
        self.layers = nn.ModuleList(layers)

    def linear_layers(self) -> list[tuple[str, Linear]]:
        """(name, layer) of every swappable linear layer, LM head last."""
        out = []
        for i, layer in enumerate(self.layers):
            for name in ("qkv", "o", "gate_up", "down"):
                out.append((f"layers.{i}.{name}", getattr(layer, name)))
        out.append(("lm_head", self.lm_head))
        return out

    def weight_bytes(self) -> int:
        """Bytes of all weights as stored (the tied embedding counted once)."""
        el = self.embed.element_size()
        n = self.embed.numel() * el + self.final_norm.numel() * el
        for name, lin in self.linear_layers():
            if name == "lm_head" and lin.weight.data_ptr() == self.embed.data_ptr():
                continue
            n += lin.weight_bytes()
        for layer in self.layers:
            n += (layer.attn_norm.numel() + layer.mlp_norm.numel()) * el
        return n

    # ------------------------------------------------------------ pieces
    def _rope_tables(self, max_pos: int) -> None:
        """Make the cos/sin tables [n, head_dim / 2] float32 cover positions < max_pos (grown, never shrunk)."""
        if max_pos <= self._rope_len:
            return
        n = max(max_pos, 2 * self._rope_len, 4096)
        t = torch.arange(n, dtype=torch.float64)
        freqs = torch.outer(t, self._inv_freq)
        self.cos = freqs.cos().to(self.device, torch.float32).contiguous()
        self.sin = freqs.sin().to(self.device, torch.float32).contiguous()
        self._rope_len = n

    def _rms_norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """RMSNorm through the PyTorch reference ops (kept for callers outside the forward)."""
        from .ops import TorchOps

        return TorchOps.rms_norm(x, w, self.cfg.rms_norm_eps)

    # ------------------------------------------------------------ forward
    use_c_decoder = True  # run the layers through engine.kernels.cpu.decoder where it serves the step

    def _c_decoder_plan(self, q: torch.Tensor, kv_caches, backend: AttentionBackend, meta: AttentionMetadata):
        """The attention backend's kernel plan when `engine.kernels.cpu.decoder` can run this
        step's layers (C small ops and linear layers, fp32, fp16 or int8 KV caches, the torch
        backend's C kernel serving the step), else None. The model's description is made on first use and
        remade after a layer swap."""
        if (not self.use_c_decoder or getattr(self.ops, "name", "") != "cpu" or not kv_caches
                or meta.slot_mapping.dtype != torch.int64 or not meta.slot_mapping.is_contiguous()):
            return None
        from ..attention.torch_quant_kv import TorchQuantKVAttentionBackend
        from ..attention.torch_ref import TorchAttentionBackend

        kc = kv_caches[0][0]
        kind = type(backend)
        if kind is TorchAttentionBackend:
            ok = kc.dtype in (torch.float32, torch.float16)
        else:  # the int8 cache (rows of codes and a scale) goes through the same C kernels
            ok = kind is TorchQuantKVAttentionBackend and backend.kv_cache_dtype == "int8" and kc.dtype == torch.int8
        if not (ok and backend.use_cpu_kernel and backend._kernel_serves(q, kc, meta)):
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
        return backend._kernel_plan(meta, q, kc)

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
        new = functools.partial(torch.empty, dtype=h.dtype, device=h.device)
        x = new(T, cfg.hidden_size)
        qkv = new(T, self.q_size + 2 * self.kv_size)
        a = new(T, hq * d)
        gu = new(T, 2 * self.local.intermediate_size)
        act = new(T, self.local.intermediate_size)
        q = qkv[:, : self.q_size].view(T, hq, d)
        k = qkv[:, self.q_size: self.q_size + self.kv_size].view(T, hkv, d)
        v = qkv[:, self.q_size + self.kv_size:].view(T, hkv, d)
        # (a tensor-parallel rank runs the loop: its all-reduces sit between the C kernels)
        plan = self._c_decoder_plan(q, kv_caches, backend, meta) if tp is None else None
        if plan is not None:  # every layer in one C call: the same kernels as the loop below
            self._c_decoder.run(h, positions, self.cos, self.sin, meta.slot_mapping, plan, meta.block_size,
                                self.scale, (x, qkv, a, gu, act))
            kv_caches = ()
        for layer, (kc, vc) in zip(self.layers, kv_caches):
            layer.qkv(ops.rms_norm(h, layer.attn_norm, eps, out=x), out=qkv)
            ops.rope_(q, k, positions, self.cos, self.sin)
            backend.forward(q, k, v, kc, vc, meta, self.scale, out=a.view(T, hq, d))
            self._row_parallel(layer.o, a, h, tp)
            mlp_in = ops.rms_norm(h, layer.mlp_norm, eps, out=x)
            if _glu_fused(layer.gate_up):  # SwiGLU in the gate/up GEMM's epilogue
                layer.gate_up.silu_mul(mlp_in, out=act)
            else:
                ops.silu_mul(layer.gate_up(mlp_in, out=gu), out=act)
            self._row_parallel(layer.down, act, h, tp)
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
    def _row_parallel(layer, x: torch.Tensor, h: torch.Tensor, tp) -> None:
        """h += x W^T for a row-parallel layer. Unsharded: one GEMM with the residual add fused.
        Sharded (x and W hold the rank's input columns): rank 0 computes h + x_0 W_0^T, every
        other rank x_r W_r^T into h, and one all-reduce leaves h + sum_r x_r W_r^T everywhere."""
        if tp is None or tp.rank == 0:
            layer(x, residual=h)
        else:
            layer(x, out=h)
        if tp is not None:
            tp.all_reduce_(h)
