"""Write a GGUF file from a tiny transformers model, as llama.cpp's `convert_hf_to_gguf.py` would.

A test utility: the parity tests build a random model of each family with transformers, save it, and
write the same weights here, so that the engine's GGUF loaders can be checked against transformers
without a download. The conventions follow llama.cpp's converter (its `TextModel.set_gguf_parameters`
and the per-family classes `LlamaModel`, `Qwen2Model`, `Qwen3Model`, `Qwen2MoeModel` / `Qwen3MoeModel`,
`Gemma3Model` and `Phi3MiniModel`), read from ggml-org/llama.cpp; the tensor names come from the
installed `gguf` package's own tables (`gguf.get_tensor_name_map`), which is what the converter uses.

Per family (`FAMILIES`):

| family   | GGUF arch | tensors beyond llama's                        | value transforms                    |
|----------|-----------|-----------------------------------------------|-------------------------------------|
| llama    | llama     | -                                             | q/k rows permuted (`permute_rope`)  |
| mistral  | llama     | -                                             | q/k rows permuted                   |
| mixtral  | llama     | ffn_gate_inp, ffn_{gate,up,down}_exps [E,..]  | q/k rows permuted                   |
| qwen2    | qwen2     | attn_{q,k,v}.bias                             | -                                   |
| qwen3    | qwen3     | attn_q_norm, attn_k_norm                      | -                                   |
| qwen3moe | qwen3moe  | attn_{q,k}_norm, ffn_gate_inp, *_exps         | -                                   |
| gemma3   | gemma3    | post_attention_norm, post_ffw_norm, q/k norms | every `*norm.weight` stored as 1 + w|
| phi3     | phi3      | attn_qkv ([q; k; v]), ffn_up ([gate; up])     | -                                   |

Layouts: a weight [out, in] is written as the numpy array [out, in] (the file's dims read {in, out});
experts are stacked as [E, I, H] for gate/up and [E, H, I] for down; the router is ffn_gate_inp [E, H]
(kept in F32 whatever the weight type, as llama.cpp does). A tied LM head writes no `output.weight`.

Metadata (key `{arch}.<name>`): block_count, context_length, embedding_length, feed_forward_length,
attention.head_count, attention.head_count_kv, rope.freq_base, attention.layer_norm_rms_epsilon, and
where the config has them: attention.key_length / value_length (an explicit head_dim), expert_count,
expert_used_count, expert_feed_forward_length (Qwen MoE: moe_intermediate_size), rope.freq_base_swa
(the sliding layers' base, Gemma 3), attention.sliding_window (Gemma 3; Phi-3 writes 0 for none),
vocab_size and rope.dimension_count (llama arch; rope.dimension_count also Phi-3),
rope.scaling.original_context_length (Phi-3), final_logit_softcapping (Gemma 3, when set).

Two choices of ours where llama.cpp's converter is silent:
- Mistral is written as arch "llama", as llama.cpp writes it (the `gguf` package knows no "mistral"
  arch; transformers 5.24 reads such a file as a Llama, and fails on a `general.name` of exactly
  "mistral", which it maps to an arch `gguf` does not know); where the
  config has a sliding window, `llama.attention.sliding_window` is written too, so that a reader can
  honour it (llama.cpp's converter drops it).
- The tokenizer is the default model's (SmolLM2's byte-level BPE, `tokenizer.ggml.model` "gpt2"),
  cut to the model's vocabulary: its first `vocab_size` tokens and the merges among them (or padded
  with `[PAD{i}]` tokens of type UNUSED, as llama.cpp pads, when the model's vocabulary is larger).

Weight types: "F32", "F16" or "Q8_0" (`gguf.quants.quantize`) for every tensor of two or more dims
(norms, biases and the router stay F32; a row not a multiple of 32 falls back to F16, as llama.cpp
does). `random_blocks` replaces chosen tensors by random valid blocks of any type `gguf_blocks_to_parts`
maps (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K): `gguf.quants` cannot quantize K-quants, and such a file is
for loader tests whose reference is the file itself (`gguf.quants.dequantize`), not the model.
"""
from __future__ import annotations

import functools
import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Optional, Union

import numpy as np
import torch

import gguf
from gguf import GGMLQuantizationType as QT

WEIGHT_TYPES = ("F32", "F16", "Q8_0")


@dataclass(frozen=True)
class Family:
    """How one family is written: the GGUF arch, whether q/k rows are permuted (llama.cpp's
    `LlamaModel.permute`), the offset added to norm weights, and the arch-specific metadata writer."""

    arch: str
    permute_rope: bool = False
    norm_shift: float = 0.0


FAMILIES = {
    "llama": Family("llama", permute_rope=True),
    "mistral": Family("llama", permute_rope=True),
    "mixtral": Family("llama", permute_rope=True),
    "qwen2": Family("qwen2"),
    "qwen3": Family("qwen3"),
    "qwen3moe": Family("qwen3moe"),
    "gemma3": Family("gemma3", norm_shift=1.0),
    "phi3": Family("phi3"),
}

# transformers model_type -> our family name
MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "mixtral": "mixtral", "qwen2": "qwen2", "qwen3": "qwen3",
               "qwen3_moe": "qwen3moe", "gemma3_text": "gemma3", "phi3": "phi3"}

# the blocks of each random-block type: (bytes, elements, byte offsets of the fp16 scales)
_BLOCKS = {"Q8_0": (34, 32, [0]), "Q4_0": (18, 32, [0]), "Q4_1": (20, 32, [0, 2]),
           "Q4_K": (144, 256, [0, 2]), "Q5_K": (176, 256, [0, 2]), "Q6_K": (210, 256, [208])}


def permute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order for the llama arch: within each head, rows [x0..x(d/2-1), y0..] become
    interleaved pairs [x0, y0, x1, y1, ...] (`LlamaModel.permute`). w: [n_head * d, ...]."""
    d = w.shape[0] // n_head
    return w.reshape(n_head, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_kquant_blocks(type_name: str, rows: int, cols: int, seed: int = 0, scale: float = 4e-4) -> np.ndarray:
    """Random valid blocks of `type_name` for a [rows, cols] weight: uint8 [rows, bytes per row].

    Every field is random, but the fp16 super-block scales (d, and dmin for Q4_1 / Q4_K / Q5_K) are
    drawn from [0, scale], so that the weights stay small (Q4_K: |w| <= scale * 63 * 15).

    Raises:
        ValueError: an unknown type, or cols not a multiple of its block.
    """
    if type_name not in _BLOCKS:
        raise ValueError(f"type_name must be one of {sorted(_BLOCKS)}, got {type_name!r}")
    size, per_block, fp16_at = _BLOCKS[type_name]
    if cols % per_block:
        raise ValueError(f"{type_name} needs cols a multiple of {per_block}, got {cols}")
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (rows * cols // per_block, size), dtype=np.uint8)
    for p in fp16_at:
        b[:, p : p + 2] = rng.uniform(0, scale, len(b)).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return b.reshape(rows, cols // per_block * size)


# ---------------------------------------------------------------- the tokenizer


@functools.lru_cache(maxsize=1)
def _default_vocab() -> tuple[list[str], list[int], list[str], Optional[int], Optional[int], str]:
    """The default tokenizer's (tokens, token types, merges, bos id, eos id, chat template)."""
    from engine.tokenizer import Tokenizer

    tk = Tokenizer.default()
    spec = json.loads(tk.backend.to_str())
    vocab = spec["model"]["vocab"]
    tokens = [""] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    types = [int(gguf.TokenType.NORMAL)] * len(tokens)
    for added in spec["added_tokens"]:
        tokens[added["id"]] = added["content"]
        types[added["id"]] = int(gguf.TokenType.CONTROL if added["special"] else gguf.TokenType.USER_DEFINED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    return tokens, types, merges, tk.bos_token_id, tk.eos_token_id, str(tk.hf.chat_template or "")


def _byte_alphabet() -> set[str]:
    """GPT-2's printable spelling of the 256 bytes (the byte-level BPE alphabet)."""
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(ord("¡"), ord("¬") + 1)) | set(range(ord("®"), ord("ÿ") + 1))
    chars, n = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + n))
            n += 1
    return set(chars)


def add_tokenizer(writer: gguf.GGUFWriter, vocab_size: int) -> None:
    """The default tokenizer's metadata for a model of `vocab_size` ids (see the module docstring).

    Raises:
        ValueError: vocab_size too small to hold the special tokens and the 256 byte tokens.
    """
    tokens, types, merges, bos, eos, template = _default_vocab()
    if vocab_size <= len(tokens):
        tokens, types = tokens[:vocab_size], types[:vocab_size]
        kept = set(tokens)
        missing = (_byte_alphabet() & set(_default_vocab()[0])) - kept  # 21 bytes never occur in UTF-8 text
        if missing:
            raise ValueError(f"vocab_size {vocab_size} leaves out {len(missing)} byte tokens of the default "
                             f"tokenizer; use a vocab_size of at least 256")
        merges = [m for m in merges if (lambda a, b: a in kept and b in kept and a + b in kept)(*m.split(" "))]
    else:
        tokens = tokens + [f"[PAD{i}]" for i in range(len(tokens), vocab_size)]
        types = types + [int(gguf.TokenType.UNUSED)] * (vocab_size - len(types))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    if bos is not None:
        writer.add_bos_token_id(bos)
    if eos is not None:
        writer.add_eos_token_id(eos)
        writer.add_pad_token_id(eos)
    writer.add_add_bos_token(False)
    if template:
        writer.add_chat_template(template)


# ---------------------------------------------------------------- weights


_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
                     r"(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
_FUSED_EXPERTS = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_ROUTER = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.gate\.weight$")
_W = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


def _load(source: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """(config, state dict) of a transformers model or of a folder written by save_pretrained."""
    if isinstance(source, (str, os.PathLike)):
        from safetensors.torch import load_file
        from transformers import AutoConfig

        folder = os.fspath(source)
        files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
        if not files:
            raise ValueError(f"source folder {folder} holds no .safetensors file")
        sd: dict[str, torch.Tensor] = {}
        for f in files:
            sd.update(load_file(os.path.join(folder, f)))
        return AutoConfig.from_pretrained(folder), sd
    return source.config, dict(source.state_dict())


def _gguf_tensors(fam: Family, cfg: Any, sd: dict[str, torch.Tensor]) -> list[tuple[str, np.ndarray]]:
    """(GGUF name, float32 array) of every tensor, in llama.cpp's layout and order of blocks."""
    n_layers = cfg.num_hidden_layers
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[fam.arch.upper()], n_layers)
    allowed = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[gguf.MODEL_ARCH[fam.arch.upper()]]}
    n_head, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    experts: dict[int, dict[str, dict[int, np.ndarray]]] = {}
    out: list[tuple[str, np.ndarray]] = []

    def emit(name: str, a: np.ndarray) -> None:
        stem = re.sub(r"^blk\.\d+\.", "blk.{bid}.", name.rsplit(".", 1)[0])
        if stem not in allowed:
            raise ValueError(f"{name} is not a tensor of GGUF arch {fam.arch!r}")
        out.append((name, np.ascontiguousarray(a, dtype=np.float32)))

    for hf, t in sd.items():
        a = t.detach().float().cpu().numpy()
        if hf == "lm_head.weight" and getattr(cfg, "tie_word_embeddings", False):
            continue
        if m := _EXPERT.match(hf):
            experts.setdefault(int(m[1]), {}).setdefault(_W[m[3]], {})[int(m[2])] = a
            continue
        if m := _FUSED_EXPERTS.match(hf):  # in-memory transformers 5: [E, 2I, H] (gate rows first), [E, H, I]
            per = experts.setdefault(int(m[1]), {})
            if m[2] == "down_proj":
                per["down"] = dict(enumerate(a))
            else:
                half = a.shape[1] // 2
                per["gate"], per["up"] = dict(enumerate(a[:, :half])), dict(enumerate(a[:, half:]))
            continue
        if m := _ROUTER.match(hf):
            emit(f"blk.{m[1]}.ffn_gate_inp.weight", a)
            continue
        base, suffix = hf.rsplit(".", 1)
        name = names.get_name(base)
        if name is None:
            raise ValueError(f"no GGUF name for {hf!r} in arch {fam.arch!r}")
        if fam.permute_rope and base.endswith(("q_proj", "k_proj")):
            a = permute_rope(a, n_head if base.endswith("q_proj") else n_kv)
        if fam.norm_shift and hf.endswith("norm.weight"):
            a = a + np.float32(fam.norm_shift)
        emit(f"{name}.{suffix}", a)
    for i, per in sorted(experts.items()):
        for w in ("gate", "up", "down"):
            stack = np.stack([per[w][e] for e in sorted(per[w])])
            emit(f"blk.{i}.ffn_{w}_exps.weight", stack)

    def rank(name: str) -> tuple[int, int, str]:  # token_embd, the blocks in order, then the rest
        if name.startswith("blk."):
            return (1, int(name.split(".")[1]), name)
        return (0 if name.startswith("token_embd.") else 2, 0, name)

    return sorted(out, key=lambda p: rank(p[0]))


# ---------------------------------------------------------------- metadata


def _rope(cfg: Any) -> tuple[dict, dict]:
    """(full-attention rope parameters, sliding-attention ones or {}) of a transformers 5 config."""
    rp = dict(getattr(cfg, "rope_parameters", None) or {})
    if "full_attention" in rp or "sliding_attention" in rp:
        return dict(rp.get("full_attention", {})), dict(rp.get("sliding_attention", {}))
    if "rope_theta" not in rp and getattr(cfg, "rope_theta", None) is not None:
        rp["rope_theta"] = cfg.rope_theta
    return rp, {}


def _add_metadata(w: gguf.GGUFWriter, family: str, cfg: Any, file_type: int) -> None:
    fam = FAMILIES[family]
    h = cfg.to_dict()
    rope, rope_swa = _rope(cfg)
    head_dim = h.get("head_dim")
    if family == "phi3":  # Phi3MiniModel.set_gguf_parameters replaces the base one
        n_embd, n_head = h["hidden_size"], h["num_attention_heads"]
        rot = rope.get("partial_rotary_factor", h.get("partial_rotary_factor") or 1.0)
        w.add_context_length(h["max_position_embeddings"])
        w.add_rope_scaling_orig_ctx_len(h["original_max_position_embeddings"])
        w.add_embedding_length(n_embd)
        w.add_feed_forward_length(h["intermediate_size"])
        w.add_block_count(h["num_hidden_layers"])
        w.add_head_count(n_head)
        w.add_head_count_kv(h["num_key_value_heads"])
        w.add_layer_norm_rms_eps(h["rms_norm_eps"])
        w.add_rope_dimension_count(int(rot * n_embd) // n_head)
        w.add_rope_freq_base(rope["rope_theta"])
        w.add_file_type(file_type)
        w.add_sliding_window(h.get("sliding_window") or 0)
        return
    # TextModel.set_gguf_parameters
    w.add_block_count(h["num_hidden_layers"])
    w.add_context_length(h["max_position_embeddings"])
    w.add_embedding_length(h["hidden_size"])
    w.add_feed_forward_length(h["intermediate_size"])
    w.add_head_count(h["num_attention_heads"])
    w.add_head_count_kv(h["num_key_value_heads"])
    rope_type, factor = rope.get("rope_type"), rope.get("factor")
    if rope_type == "linear" and factor is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(factor)
    elif rope_type == "yarn" and factor is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(factor)
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    elif rope_type not in (None, "default", "linear", "yarn"):
        raise ValueError(f"rope_type {rope_type!r} is not written by this utility (default, linear, yarn)")
    if rope.get("rope_theta") is not None:
        w.add_rope_freq_base(rope["rope_theta"])
    if rope_swa.get("rope_theta") is not None:
        w.add_rope_freq_base_swa(rope_swa["rope_theta"])
    w.add_layer_norm_rms_eps(h["rms_norm_eps"])
    n_exp = h.get("num_local_experts") or h.get("num_experts")
    if n_exp is not None:
        w.add_expert_count(n_exp)
    if h.get("num_experts_per_tok") is not None:
        w.add_expert_used_count(h["num_experts_per_tok"])
    if head_dim is not None:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_file_type(file_type)
    if fam.arch == "llama":  # LlamaModel.set_gguf_parameters
        w.add_vocab_size(h["vocab_size"])
        w.add_rope_dimension_count(head_dim or h["hidden_size"] // h["num_attention_heads"])
        if family == "mistral" and h.get("sliding_window"):
            w.add_sliding_window(h["sliding_window"])
    if family == "qwen3moe" and h.get("moe_intermediate_size") is not None:  # Qwen2MoeModel
        w.add_expert_feed_forward_length(h["moe_intermediate_size"])
    if family == "gemma3":  # Gemma3Model.set_gguf_parameters (after the base's)
        if h.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(h["final_logit_softcapping"])
        if h.get("sliding_window_pattern") != 1:
            w.add_sliding_window(h["sliding_window"])


_FILE_TYPES = {"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16,
               "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}


def _keep_f32(name: str, a: np.ndarray) -> bool:
    return a.ndim <= 1 or name.endswith("_norm.weight") or ".ffn_gate_inp." in name


def write_gguf(source: Any, path: Union[str, os.PathLike], weight_type: str = "F32",
               random_blocks: Optional[dict[str, str]] = None, family: Optional[str] = None, seed: int = 0) -> str:
    """Write `source` (a transformers causal LM, or a folder it was saved to) as a GGUF model file.

    Args:
        source: a `PreTrainedModel` of a family in `FAMILIES`, or its save_pretrained folder (experts
            under the per-expert names that save_pretrained writes, or the fused in-memory ones).
        path: the .gguf file to write.
        weight_type: "F32" | "F16" | "Q8_0", for every tensor of two or more dims (see the module docstring).
        random_blocks: {GGUF tensor-name pattern (a regex searched in the name): block type}: those
            tensors get random valid blocks (`random_kquant_blocks`) instead of the model's values.
        family: override of the family read from `config.model_type`.
        seed: the random blocks' seed (each tensor adds its index).
    Returns:
        the path written.
    Raises:
        ValueError: an unknown family or weight type, or a tensor with no GGUF name.
    """
    if weight_type not in WEIGHT_TYPES:
        raise ValueError(f"weight_type must be one of {WEIGHT_TYPES}, got {weight_type!r}")
    cfg, sd = _load(source)
    family = family or MODEL_TYPES.get(cfg.model_type)
    if family not in FAMILIES:
        raise ValueError(f"model_type {cfg.model_type!r} has no family here; known: {sorted(MODEL_TYPES)}")
    fam = FAMILIES[family]
    tensors = _gguf_tensors(fam, cfg, sd)
    w = gguf.GGUFWriter(os.fspath(path), fam.arch)
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(f"tiny-{family}")
    _add_metadata(w, family, cfg, _FILE_TYPES[weight_type])
    if weight_type != "F32" or random_blocks:
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_tokenizer(w, cfg.vocab_size)
    if family == "phi3":
        _add_longrope(w, cfg)
    for k, (name, a) in enumerate(tensors):
        rand = next((t for pat, t in (random_blocks or {}).items() if re.search(pat, name)), None)
        if rand is not None and not _keep_f32(name, a):
            rows, cols = math.prod(a.shape[:-1]), a.shape[-1]
            blocks = random_kquant_blocks(rand, rows, cols, seed + k).reshape(*a.shape[:-1], -1)
            w.add_tensor(name, blocks, raw_dtype=QT[rand])
        elif weight_type == "F32" or _keep_f32(name, a):
            w.add_tensor(name, a)
        elif weight_type == "Q8_0" and a.shape[-1] % 32 == 0:
            w.add_tensor(name, gguf.quants.quantize(a, QT.Q8_0), raw_dtype=QT.Q8_0)
        else:  # F16, or a Q8_0 row that is not whole blocks (llama.cpp's fallback)
            w.add_tensor(name, a.astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return os.fspath(path)


def _add_longrope(w: gguf.GGUFWriter, cfg: Any) -> None:
    """Phi-3's long-context RoPE (Phi3MiniModel.generate_extra_tensors): the attention factor and the
    rope_factors_long / rope_factors_short tensors, when the config has longrope scaling."""
    rope, _ = _rope(cfg)
    if rope.get("rope_type") not in ("longrope", "su"):
        return
    orig = cfg.original_max_position_embeddings
    scale = cfg.max_position_embeddings / orig
    w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1.0 else 1.0)
    w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
    w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))
