"""Which slice of each weight a tensor-parallel rank holds (Megatron-LM sharding).

Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter Language Models Using
Model Parallelism" (arXiv 1909.08053), section 3: in each transformer layer the first
matmul of a block is split by output features ("column parallel": q/k/v, gate/up) and the
second by input features ("row parallel": o, down), so that a block needs one all-reduce
of its output and nothing in between (the attention heads and the SwiGLU activation are
computed on the rank's own slice). The embedding and the LM head are split by vocabulary
rows (section 3, "input embedding ... parallelized along the vocabulary dimension").

Rank r of N holds, with Hq query heads, Hkv KV heads, head dim D, intermediate size I and
vocabulary V:

| weight (Hugging Face name)          | split | rank r keeps                              |
| ----------------------------------- | ----- | ----------------------------------------- |
| self_attn.q_proj.weight [Hq D, H]   | rows  | heads [r Hq/N, (r+1) Hq/N)                |
| self_attn.k_proj / v_proj [Hkv D, H]| rows  | KV heads [r Hkv/N, (r+1) Hkv/N)           |
| self_attn.o_proj.weight [H, Hq D]   | cols  | the columns of its query heads            |
| mlp.gate_proj / up_proj [I, H]      | rows  | [r I/N, (r+1) I/N)                        |
| mlp.down_proj [H, I]                | cols  | [r I/N, (r+1) I/N)                        |
| mlp.experts.e.* (each expert)       | as the dense MLP, over its own I          |                                           |
| embed_tokens / lm_head [V, H]       | rows  | [r Vp, (r+1) Vp), Vp = ceil(V / N), zero-padded |
| norms                               | -     | everything (replicated)                   |

Query head i reads KV head i // (Hq / Hkv) (GQA), so a rank's Hq/N query heads read exactly
its Hkv/N KV heads: the groups stay whole and attention needs no communication. A rank's
paged KV cache holds its Hkv/N heads only, addressed by the same block tables as every
other rank's. A bias of a row-parallel layer is kept by rank 0 only (it is added once,
before the all-reduce sums the ranks' partial outputs).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..model_config import ModelConfig


@dataclass(frozen=True)
class TPShard:
    """Rank `rank` of a tensor-parallel group of `world_size` ranks (rank 0: the driver)."""

    rank: int = 0
    world_size: int = 1

    @property
    def is_sharded(self) -> bool:
        return self.world_size > 1


SINGLE = TPShard(0, 1)


def check_tp_size(cfg: ModelConfig, n: int) -> None:
    """Refuse a tensor-parallel size the model's heads (or MLP) cannot be split by.

    Raises:
        ValueError: naming N and the head counts (e.g. "tensor_parallel_size=2 does not divide
            the model's 3 KV heads (9 query heads)").
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {n!r}")
    if n == 1:
        return
    if cfg.num_kv_heads % n or cfg.num_heads % n:
        divisors = [d for d in range(1, cfg.num_kv_heads + 1) if cfg.num_kv_heads % d == 0]
        raise ValueError(
            f"tensor_parallel_size={n} does not divide the model's {cfg.num_kv_heads} KV heads "
            f"({cfg.num_heads} query heads): each rank holds whole KV heads with their query groups; "
            f"use one of {divisors}")
    if cfg.intermediate_size % n:
        raise ValueError(f"tensor_parallel_size={n} does not divide the model's intermediate size "
                         f"{cfg.intermediate_size}")
    if cfg.moe_intermediate_size % n:
        raise ValueError(f"tensor_parallel_size={n} does not divide the model's expert intermediate size "
                         f"{cfg.moe_intermediate_size}")


@dataclass(frozen=True)
class LocalShape:
    """The sizes one rank computes with (all equal to the model's when world_size == 1).

    Attributes:
        num_heads, num_kv_heads: the rank's query and KV heads.
        intermediate_size: the rank's slice of the MLP.
        vocab_start, vocab_end: the vocabulary rows [start, end) it holds.
        vocab_shard: rows of its embedding / LM head shard (end - start, zero-padded to
            ceil(V / N) on the last rank when N does not divide V).
    """

    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_start: int
    vocab_end: int
    vocab_shard: int


def local_shape(cfg: ModelConfig, shard: TPShard) -> LocalShape:
    """Rank `shard.rank`'s sizes (see the table in the module docstring)."""
    n, r = shard.world_size, shard.rank
    vp = -(-cfg.vocab_size // n)
    start = min(r * vp, cfg.vocab_size)
    return LocalShape(cfg.num_heads // n, cfg.num_kv_heads // n, cfg.intermediate_size // n,
                      start, min(start + vp, cfg.vocab_size), vp)


@dataclass(frozen=True)
class SliceSpec:
    """Slice [start, stop) along `dim` of a full tensor, zero-padded to `pad_to` along it
    (`pad_to` None: no padding)."""

    dim: int
    start: int
    stop: int
    pad_to: Optional[int] = None

    def apply(self, t: torch.Tensor) -> torch.Tensor:
        """The rank's slice of the full tensor `t` (a copy, contiguous)."""
        s = t.narrow(self.dim, self.start, self.stop - self.start)
        if self.pad_to is not None and self.pad_to > s.shape[self.dim]:
            shape = list(s.shape)
            shape[self.dim] = self.pad_to - s.shape[self.dim]
            return torch.cat((s, s.new_zeros(shape)), dim=self.dim)
        return s.clone(memory_format=torch.contiguous_format)  # a copy: the full tensor can be freed


def slice_spec(name: str, cfg: ModelConfig, shard: TPShard) -> Optional[SliceSpec]:
    """How rank `shard.rank` slices the full tensor `name` (Hugging Face Llama names without
    "model."); None: the rank holds it whole (norms, and everything at world_size 1).
    A row-parallel bias (none in the supported models) is "drop" on ranks > 0: see
    `keeps_tensor`."""
    if not shard.is_sharded:
        return None
    loc, r, d = local_shape(cfg, shard), shard.rank, cfg.head_dim
    if name in ("embed_tokens.weight", "lm_head.weight"):
        return SliceSpec(0, loc.vocab_start, loc.vocab_end, loc.vocab_shard)
    if name.endswith("self_attn.q_proj.weight") or name.endswith("self_attn.q_proj.bias"):
        return SliceSpec(0, r * loc.num_heads * d, (r + 1) * loc.num_heads * d)
    if any(name.endswith(f"self_attn.{x}_proj.{p}") for x in "kv" for p in ("weight", "bias")):
        return SliceSpec(0, r * loc.num_kv_heads * d, (r + 1) * loc.num_kv_heads * d)
    if name.endswith("self_attn.o_proj.weight"):
        return SliceSpec(1, r * loc.num_heads * d, (r + 1) * loc.num_heads * d)
    i = cfg.moe_intermediate_size // shard.world_size if ".experts." in name else loc.intermediate_size
    if name.endswith(".gate_proj.weight") or name.endswith(".up_proj.weight"):  # dense MLP or an expert
        return SliceSpec(0, r * i, (r + 1) * i)
    if name.endswith(".down_proj.weight"):
        return SliceSpec(1, r * i, (r + 1) * i)
    return None


def keeps_tensor(name: str, shard: TPShard) -> bool:
    """False for a row-parallel bias on ranks > 0 (rank 0 adds it once)."""
    return not (shard.rank > 0 and (name.endswith("o_proj.bias") or name.endswith("down_proj.bias")))


def shard_tensor(name: str, t: torch.Tensor, cfg: ModelConfig, shard: TPShard) -> torch.Tensor:
    """Rank `shard.rank`'s slice of the full tensor `t` named `name` (`t` itself unsharded)."""
    spec = slice_spec(name, cfg, shard)
    return t if spec is None else spec.apply(t)


def shard_fused(parts: list[tuple[str, int]], t: torch.Tensor, cfg: ModelConfig, shard: TPShard) -> torch.Tensor:
    """Rank slice of a fused tensor whose rows are the named parts stacked in order
    ([(name, rows), ...], e.g. q, k, v of the fused qkv projection): each part is sliced
    on its own and the slices are stacked again."""
    if not shard.is_sharded:
        return t
    out, row = [], 0
    for name, rows in parts:
        out.append(shard_tensor(name, t[row:row + rows], cfg, shard))
        row += rows
    return torch.cat(out, 0).contiguous()


def check_tp_options(tensor_parallel_size: int, quantization: Optional[str] = None,
                     speculative_method: Optional[str] = None) -> None:
    """Refuse the engine options that do not run with tensor parallelism (checked by the engine
    and, before anything is written, by a job).

    Raises:
        ValueError: W8A8 weights (SmoothQuant calibrates on the whole model in one process) or
            the draft_model speculative method (its draft runs in the driver only) with
            tensor_parallel_size > 1.
    """
    if tensor_parallel_size <= 1:
        return
    if quantization == "w8a8":
        raise ValueError("quantization='w8a8' calibrates on the whole model in one process: it does not run "
                         "with tensor_parallel_size > 1 (int8, int4 and gguf do)")
    if speculative_method == "draft_model":
        raise ValueError("speculative method 'draft_model' runs its draft in the driver only: it does not run "
                         "with tensor_parallel_size > 1 (auto, ngram and suffix do)")

