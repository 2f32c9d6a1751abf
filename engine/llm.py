"""The `LLM` facade: vLLM's offline API over our scheduler, model runner and sampler.

    llm = LLM("smollm2-135m-instruct")
    outs = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
    print(outs[0].outputs[0].text)

One step of the loop: the scheduler picks decode tokens then prefill chunks
under the token budget; the model runner runs one forward pass over them;
the sampler draws a token for each sequence that reached its end; new tokens
are detokenized incrementally and checked against EOS, stop token ids, stop
strings and length; finished sequences free their KV blocks.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import operator
import os
import reprlib
import time
import warnings
import weakref
from collections.abc import Mapping
from typing import Any, Iterator, Optional, Sequence as Seq, Union

import torch

from .attention import get_backend
from .attention.torch_quant_kv import TorchQuantKVAttentionBackend
from .config import (
    EngineConfig, SamplingParams, SpeculativeConfig, prompt_length_error, prompt_text_error, prompt_type_error,
)
from .core import EngineCore
from .kv_cache import BlockPool, KVCache, KVCacheManager, block_key, kv_layout
from .metrics import EngineStats
from .model_runner import ChunkSpec, ModelRunner
from .models.llama import LlamaModel
from .outputs import CompletionOutput, RequestMetrics, RequestOutput
from .parallel.sharding import SINGLE, TPShard, check_tp_size
from .request import Request, Sequence, SequenceStatus
from .sampler import Sampler
from .scheduler import Scheduler
from .spec_decode import SpecDecoder
from .structured import StructuredOutputManager
from .threads import apply_num_threads, default_num_threads
from .tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer
from .weights import DEFAULT_MODEL, ModelConfig, load_model_weights, model_config, resolve_model

PromptType = Union[str, list[int], Mapping]
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_CPU_KV_DEFAULT_CAP = 2 << 30  # bytes


def max_tokens_past_context_warning(num_prompt_tokens: int, max_tokens: Optional[int],
                                    max_model_len: int) -> Optional[str]:
    """The warning `LLM.generate` gives (once per LLM) for a `max_tokens` past the room the context
    leaves after the prompt, or None when it fits (or is None: up to the context).

    Such a request runs, as in vLLM, and stops at the end of the context with finish_reason
    "length"; a job refuses such a row instead (`pipeline.schema.length_rule`) unless `--truncate`.
    """
    room = max_model_len - num_prompt_tokens
    if max_tokens is None or max_tokens <= room:
        return None
    return (f"max_tokens={max_tokens} is more than the context leaves after the prompt ({num_prompt_tokens} "
            f"tokens of max_model_len={max_model_len}, room for {room}): such requests stop at the end of the "
            f"context with finish_reason 'length' (said once per LLM)")


class _BadPrompt:
    """A prompt already known to be invalid (e.g. malformed chat messages)."""

    def __init__(self, message: str) -> None:
        self.message = message


def _mix_seed(base: int, index: int) -> int:
    """Deterministic 63-bit seed of completion `index` of a request seeded with `base`."""
    x = (base * 6364136223846793005 + (index + 1) * 1442695040888963407) & ((1 << 64) - 1)
    x ^= x >> 29
    return x & ((1 << 63) - 1)


def memory_bytes() -> tuple[Optional[int], Optional[int]]:
    """(available, total) bytes of this machine's memory: `MemAvailable` of /proc/meminfo (what can be
    allocated without swapping, page cache included; the free pages where there is no such file), and
    the physical pages. None for what cannot be read."""
    available = None
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024  # kB
                    break
    except (OSError, ValueError, IndexError):
        pass
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        total = os.sysconf("SC_PHYS_PAGES") * page
        if available is None:
            available = os.sysconf("SC_AVPHYS_PAGES") * page
    except (ValueError, OSError, AttributeError):
        total = None
    return available, total


def _available_memory_bytes() -> int:
    """Bytes a CPU engine's default KV budget is a share of: `memory_bytes`'s available memory (the one the
    budget rule `kv_budget_memory_error` checks), 8 GiB where it cannot be read."""
    available, _ = memory_bytes()
    return available if available is not None else 8 << 30


def kv_budget_memory_error(cfg: EngineConfig, device: str) -> Optional[str]:
    """The rule that a CPU engine's `kv_cache_memory_bytes` fits in this machine's memory: None when it
    does (or is unset, or the engine is on a GPU, or the memory cannot be read), else the error message
    naming the option, the value and the machine's available and total memory (`memory_bytes`).

    The ranks of a tensor-parallel CPU engine share one memory: each holds `kv_cache_memory_bytes`. A
    job applies the rule before it writes anything, `LLM` before it allocates the cache: a budget past
    the memory was zero-filled until the kernel's OOM killer ended the process.
    """
    budget = cfg.kv_cache_memory_bytes
    if budget is None or not str(device).startswith("cpu"):
        return None
    available, total = memory_bytes()
    if available is None:
        return None
    ranks = cfg.tensor_parallel_size
    need = budget * ranks
    if need <= available:
        return None
    per = f" x {ranks} tensor-parallel ranks = {need} bytes" if ranks > 1 else " bytes"
    of_total = f" of {total} bytes ({total / 2**30:.1f} GiB) in all" if total is not None else ""
    return (f"kv_cache_memory_bytes={budget}{per} ({need / 2**30:.1f} GiB) is more than this machine's "
            f"available memory, {available} bytes ({available / 2**30:.1f} GiB){of_total}; give at most "
            f"{available // ranks}, or leave it unset for a share of the free memory")


def _model_string(source) -> str:
    """The `model` argument that resolves to `source` (a .gguf path, a folder, or dummy:<preset>)."""
    return f"dummy:{source.preset}" if source.kind == "dummy" else source.path


def _prompt_list(prompts) -> list:
    """prompts as a list: a single string is one prompt (iterating it would give one prompt per
    character), and so is a single prompt dict and a flat, non-empty list (or tuple) of ints, one
    tokenized prompt, as vLLM reads it (`generate([1, 2, 3])` is `generate([[1, 2, 3]])`, not three
    int prompts); anything else is taken as a sequence of prompts (each a string, a list of token
    ids or a prompt dict; a bad one becomes an error output, never an exception).

    Raises:
        TypeError: prompts is None, bytes or not iterable (the message says what is accepted).
    """
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and all(_is_token_id(t) for t in prompts):
        return [list(prompts)]
    try:
        if prompts is None or isinstance(prompts, (bytes, bytearray)):
            raise TypeError
        return list(prompts)
    except TypeError:
        raise TypeError(f"prompts must be a string or a sequence of prompts (strings, lists of token ids or "
                        f"prompt dicts), got "
                        f"{type(prompts).__name__} {reprlib.repr(prompts)}") from None


PROMPT_DICT_KEYS = ("prompt", "prompt_token_ids")


def _from_prompt_dict(prompt: Mapping) -> tuple[Any, Optional[str]]:
    """A vLLM-style prompt dict as (what make_requests reads, the text for RequestOutput.prompt).

    `{"prompt": text}` (vLLM's TextPrompt) is the text; `{"prompt_token_ids": ids}` (TokensPrompt)
    is the token ids, and takes precedence when both keys are given, as in vLLM (its "prompt" is
    then only reported back). Any other key (multi-modal data, ...) is refused, as a _BadPrompt
    naming it, and so is a dict with neither key.
    """
    extra = sorted(str(k) for k in prompt if k not in PROMPT_DICT_KEYS)
    if extra:
        return _BadPrompt(f"prompt: unsupported key(s) {extra}; a prompt dict takes 'prompt' (text) or "
                          f"'prompt_token_ids'"), None
    if "prompt_token_ids" in prompt:
        ids, text = prompt["prompt_token_ids"], prompt.get("prompt")
        if not isinstance(ids, (list, tuple)) or not all(_is_token_id(t) for t in ids):
            return _BadPrompt(f"prompt_token_ids: must be a list of token ids (ints), got {reprlib.repr(ids)}"), None
        return list(ids), text if isinstance(text, str) else None
    if "prompt" in prompt:
        return prompt["prompt"], None
    return _BadPrompt("prompt: a prompt dict needs 'prompt' (text) or 'prompt_token_ids', got an empty dict"), None


def _is_token_id(value: Any) -> bool:
    """An int that is not a bool (a token id's type; its range is checked per request)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _params_list(sampling_params, n: int) -> list:
    """One sampling_params entry per prompt: None is SamplingParams() for all, one SamplingParams is
    shared, a sequence gives one per prompt (as in vLLM). A bad entry of the sequence is left for
    `make_requests` to turn into an error output.

    Raises:
        TypeError: sampling_params is none of these (a dict, a string, a number).
        ValueError: a sequence whose length differs from the prompts'.
    """
    if sampling_params is None:
        sampling_params = SamplingParams()
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    try:
        if isinstance(sampling_params, (str, bytes, bytearray, Mapping)):
            raise TypeError
        params_list = list(sampling_params)
    except TypeError:
        hint = "; build one with SamplingParams(**...)" if isinstance(sampling_params, Mapping) else ""
        raise TypeError(f"sampling_params must be a SamplingParams or a sequence of them, one per prompt (None: "
                        f"the defaults), got {type(sampling_params).__name__} {reprlib.repr(sampling_params)}"
                        f"{hint}") from None
    if len(params_list) != n:
        raise ValueError(f"sampling_params has {len(params_list)} entries but there are {n} prompts")
    return params_list


def _cpu_kernels_serve(cpu_kernels: bool, device: str, dtype: torch.dtype, quantization: Optional[str] = None) -> bool:
    """Whether the CPU kernel library runs a model: asked for, on the CPU, the library builds, and
    fp32 weights, or bf16 weights that are not quantized (bf16 linear layers, fp32 activations)."""
    if not cpu_kernels or device != "cpu":
        return False
    if dtype != torch.float32 and not (dtype == torch.bfloat16 and quantization is None):
        return False
    from .kernels import cpu

    return cpu.available()


def compute_dtype(dtype: torch.dtype, device: str, cpu_kernels: bool, quantization: Optional[str] = None) -> torch.dtype:
    """The dtype of the activations (residual stream, attention, KV writes) of a model whose
    weights are `dtype`: fp32 where the CPU kernels serve bf16 weights (they take fp32 rows and
    round them to bf16 inside each linear layer), else the weights' dtype."""
    if dtype == torch.bfloat16 and _cpu_kernels_serve(cpu_kernels, device, dtype, quantization):
        return torch.float32
    return dtype


def w8a8_unservable(cpu_kernels: bool, device: str, dtype: torch.dtype) -> Optional[str]:
    """Why quantization="w8a8" cannot run with these resolved settings, or None when it can (the CPU
    kernel library with fp32 on the CPU, or Triton on CUDA). The engine raises it at load, and a job
    before anything is written under `_job/`."""
    if device.startswith("cuda") or _cpu_kernels_serve(cpu_kernels, device, dtype, "w8a8"):
        return None
    from .kernels import cpu

    if device != "cpu":
        why = f"device {device!r}"
    elif dtype != torch.float32:
        why = f"dtype {str(dtype).removeprefix('torch.')}"
    elif not cpu_kernels:
        why = "cpu_kernels=False"
    else:
        why = f"the CPU kernel library is unavailable ({cpu.why_unavailable()})"
    fix = "; use dtype='auto' or 'float32'" if device == "cpu" and dtype != torch.float32 else ""
    return (f"quantization='w8a8' runs on the CPU kernels (fp32 on the CPU with cpu_kernels=True and the "
            f"library built: see engine.kernels.cpu) or on CUDA (Triton); here: {why}{fix}")


def auto_kv_dtype(dtype: torch.dtype) -> torch.dtype:
    """The KV cache's storage dtype for kv_cache_dtype="auto" under a model computing in `dtype`:
    fp16 for an fp32 model, else the model dtype.

    Why fp16 and not fp32 (measured on SmolLM2-135M, 2-core Zen 3, 2026-12-04): decode attention
    reads the whole cache every step, 46,080 bytes per token in fp32, so at batch 64 and contexts
    of about 130 tokens it streams 385 MB per step, at least 15 ms at this machine's best read rate
    against 108 ms of linear layers: fp32 K/V alone hold attention above 12% of a decode step,
    whatever the kernel. fp16 halves that read (the kernels widen each half to fp32 as they load
    it; the arithmetic stays fp32), doubles the tokens a KV budget holds, and costs no measurable
    quality (perplexity -0.00%, mean |dlogprob| 0.0009: tests/test_quant.py). It is what the
    peers do by default: llama.cpp's cache type is f16, and vLLM runs an fp32 checkpoint in
    16 bits ("auto" dtype), its cache with it. kv_cache_dtype="fp32" keeps the exact fp32 cache
    (greedy parity with transformers in fp32: tests/test_engine_parity.py).
    """
    return torch.float16 if dtype == torch.float32 else dtype


def make_attention_backend(attention_backend: str, kv_cache_dtype: str, cpu_kernels: bool, dtype: torch.dtype):
    """(attention backend, KV cache storage dtype) for resolved engine settings (the driver and
    every tensor-parallel worker build theirs here): "fp16" IEEE halves (the float backends write
    `k.to(torch.float16)` and widen what they read), "fp32" fp32, "auto" the model dtype except
    that an fp32 model's cache is fp16 (`auto_kv_dtype`), "int8" and "fp8_e4m3" codes with a scale
    per row (`TorchQuantKVAttentionBackend`)."""
    if kv_cache_dtype in ("auto", "fp16", "fp32"):
        backend = get_backend(attention_backend)
        kv_dtype = {"auto": auto_kv_dtype(dtype), "fp16": torch.float16, "fp32": torch.float32}[kv_cache_dtype]
    else:
        backend = TorchQuantKVAttentionBackend(kv_cache_dtype)
        kv_dtype = backend.storage_dtype
    if not cpu_kernels and hasattr(backend, "use_cpu_kernel"):
        backend.use_cpu_kernel = False
    return backend, kv_dtype


def auto_dtype(device: torch.device, quantization: Optional[str], cpu_kernels: bool) -> str:
    """What dtype="auto" resolves to: "bfloat16" on CUDA; on the CPU "bfloat16" where the host has a
    bf16 matrix unit (AMX-BF16 or AVX512-BF16: `engine.host.Host.auto_dtype`) and the CPU kernels
    serve unquantized bf16 weights, else "float32" (quantized weights compute in fp32 on the CPU)."""
    if device.type == "cuda":
        return "bfloat16"
    from .host import Host

    if (quantization in (None, "none") and Host.current().auto_dtype() == "bfloat16"
            and _cpu_kernels_serve(cpu_kernels, device.type, torch.bfloat16)):
        return "bfloat16"
    return "float32"


def resolve_settings(cfg: EngineConfig) -> tuple[torch.device, torch.dtype, str]:
    """(device, weights dtype, attention backend name) that an engine with `cfg` runs with: "auto" resolved
    (CUDA when available; the dtype by `auto_dtype`; the Triton backend on CUDA and the PyTorch one on
    the CPU)."""
    dev = torch.device(cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype_name = cfg.dtype if cfg.dtype != "auto" else auto_dtype(dev, cfg.quantization, cfg.cpu_kernels)
    backend = cfg.attention_backend if cfg.attention_backend != "auto" else (
        "triton" if dev.type == "cuda" else "torch")
    return dev, _DTYPES[dtype_name], backend


def kv_block_bytes(backend, kv_dtype: torch.dtype, num_layers: int, num_kv_heads: int, head_dim: int,
                   block_size: int) -> int:
    """Bytes of one KV block on one rank: K and V of `block_size` tokens for every layer, in the cache's
    storage dtype, with the backend's layout (an int8 cache's per-row scales included). The engine's KV
    cache holds `kv_cache_memory_bytes // kv_block_bytes(...)` blocks.

    Args:
        num_layers: layers of one block: the model's, or for a model with sliding-window layers its
            pool block's pages (`engine.kv_cache.KVLayout.pages_per_block`).
        num_kv_heads: the rank's KV heads (the model's divided by tensor_parallel_size).
    """
    return 2 * num_layers * kv_dtype.itemsize * math.prod(backend.cache_shape(1, block_size, num_kv_heads, head_dim))


def min_kv_cache_memory_bytes(cfg: EngineConfig, model_cfg: ModelConfig) -> int:
    """The smallest `kv_cache_memory_bytes` an engine with `cfg` over a model of shape `model_cfg` accepts:
    one KV block per rank (`kv_block_bytes`), in bytes. Cheap: no weights are read, no memory is allocated
    (a job checks it before writing anything; `LLM` refuses a smaller budget when it sizes the cache).
    """
    dev, dtype, backend_name = resolve_settings(cfg)
    quant = None if cfg.quantization in (None, "none") else cfg.quantization
    act = compute_dtype(dtype, dev.type, cfg.cpu_kernels, quant)
    backend, kv_dtype = make_attention_backend(backend_name, cfg.kv_cache_dtype, cfg.cpu_kernels, act)
    return kv_block_bytes(backend, kv_dtype, kv_layout(model_cfg, cfg.block_size).pages_per_block,
                          model_cfg.num_kv_heads // cfg.tensor_parallel_size, model_cfg.head_dim, cfg.block_size)


def max_model_len_error(cfg: EngineConfig, model_cfg: ModelConfig) -> Optional[str]:
    """The rule that `max_model_len` is at most the model's trained context (`max_position_embeddings`):
    None when it is (or is unset), else the error message naming both. vLLM refuses a longer one too;
    capping it quietly left a job's manifest saying 100000000 while its rows were refused past 8192.
    `LLM` applies it when it sizes its cache, a job before it writes anything."""
    trained = model_cfg.max_position_embeddings
    if cfg.max_model_len is None or cfg.max_model_len <= trained:
        return None
    return (f"max_model_len={cfg.max_model_len} is more than the model's context ({trained} tokens, its "
            f"max_position_embeddings); give at most {trained}, or leave it unset for the model's")


def block_size_error(cfg: EngineConfig, model_cfg: ModelConfig) -> Optional[str]:
    """The rule that a KV block fits in the context: None when `cfg.block_size` is at most the context
    (`cfg.max_model_len`, at most the model's own), else the error message naming both. `LLM` refuses
    such a config when it sizes its cache, a job before it writes anything (from the model's metadata)."""
    trained = model_cfg.max_position_embeddings
    length = min(cfg.max_model_len or trained, trained)
    if cfg.block_size <= length:
        return None
    context = (f"the context (max_model_len={length} tokens)" if length < trained
               else f"the model's context ({length} tokens)")
    return (f"block_size={cfg.block_size} is larger than {context}: a KV block holds block_size tokens of one "
            f"sequence (16 is the usual size)")


def context_length(cfg: EngineConfig, model_cfg: ModelConfig, num_blocks: Optional[int] = None) -> int:
    """The context length in tokens (`LLM.max_model_len`) of an engine with `cfg` over a model of shape
    `model_cfg`: `cfg.max_model_len`, at most the model's trained context (`max_position_embeddings`), at
    most what its KV cache holds (`num_blocks` x block_size: a sequence never needs more blocks than the
    pool has; with sliding-window layers the longest sequence whose blocks of both groups fit,
    `engine.kv_cache.KVLayout.max_tokens`), and without chunked prefill at most the token budget
    (`max_num_batched_tokens`).

    Args:
        num_blocks: the KV cache's blocks. None: those an explicit `cfg.kv_cache_memory_bytes` buys
            (`min_kv_cache_memory_bytes` is one block); with no budget given the cache is a share of
            the free memory, unknown before the engine sizes it, and this bound is left out.

    Cheap when `num_blocks` is given or no budget is: no weights are read, nothing is allocated, so a
    job plans with the context its engine will have before it loads one.
    """
    length = min(cfg.max_model_len or model_cfg.max_position_embeddings, model_cfg.max_position_embeddings)
    if num_blocks is None and cfg.kv_cache_memory_bytes is not None:
        num_blocks = cfg.kv_cache_memory_bytes // min_kv_cache_memory_bytes(cfg, model_cfg)
    if num_blocks is not None:
        length = kv_layout(model_cfg, cfg.block_size).max_tokens(num_blocks, cfg.max_num_batched_tokens, length)
    if not cfg.enable_chunked_prefill:
        length = min(length, cfg.max_num_batched_tokens)
    return length


@functools.lru_cache(maxsize=4)
def _w8a8_calibration(source_key, dtype: torch.dtype, device: str, seed: int,
                      cpu_kernels: bool) -> dict[tuple[int, str], torch.Tensor]:
    """SmoothQuant's calibration statistics of a model (`smoothquant.calibration_absmax` on a
    dedicated fp32 engine), once per process and argument tuple.

    The calibration generates 200 seeded tokens for each calibration prompt (tens of seconds on 2
    cores) and its result is small (one vector per layer input, about 0.5 MB for SmolLM2-135M),
    so it is kept apart from `_load_model`'s cache: a w8a8 model evicted from there (it keeps 4
    models) is rebuilt from these same statistics, without calibrating again. Callers must not
    modify the returned tensors (`smoothed_w8a8_copy` only reads them)."""
    from .smoothquant import calibration_absmax

    dtype_name = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
    # the model's own dtype in the cache too: the calibration text is sampled, and text sampled over an
    # fp16 cache diverges from the fp32 model's (SmolLM2-135M: W8A8 perplexity -0.24% of fp32 after
    # calibrating on fp32-cache text, +2.4% on fp16-cache text, tests/test_quant.py)
    calib = LLM(_model_string(source_key), dtype=dtype_name, device=device, seed=seed, cpu_kernels=cpu_kernels,
                kv_cache_memory_bytes=256 << 20, max_num_seqs=16,
                kv_cache_dtype="fp32" if dtype == torch.float32 else "auto")
    return calibration_absmax(calib)


@functools.lru_cache(maxsize=4)
def _load_model(source_key, dtype: torch.dtype, device: str, seed: int, quantization: Optional[str] = None,
                group_size: int = 32, cpu_kernels: bool = True, shard: TPShard = SINGLE,
                with_tokenizer: bool = True) -> tuple[LlamaModel, Optional[Tokenizer]]:
    """Load weights and tokenizer once per process; LLM instances share the read-only weights.
    `quantization` ("int8" | "int4" | "gguf" | "w8a8") builds a copy of the cached float model whose
    linear layers are swapped (`engine.quant.quantized_copy`); embedding and norms are shared.
    With `cpu_kernels` (fp32, or unquantized bf16 weights, on the CPU) the linear layers are then
    swapped for the CPU kernel library's (`engine.kernels.cpu.layers.use_cpu_kernels`; bf16 weights
    under an fp32 model) and the small ops run in C; without,
    the PyTorch reference ops run. With `shard`, the model holds one tensor-parallel rank's
    slices only (read so from the file; quantized from them); `with_tokenizer` False (a
    worker) skips the tokenizer and returns None for it.

    Raises:
        ValueError: quantization="w8a8" where the CPU kernels cannot serve, or with a shard.
    """
    from .kernels.cpu.layers import use_cpu_kernels
    from .models.ops import TorchOps

    source = source_key
    use_c = _cpu_kernels_serve(cpu_kernels, device, dtype, quantization)
    if quantization is not None:
        from .quant import quantized_copy

        problem = w8a8_unservable(cpu_kernels, device, dtype) if quantization == "w8a8" else None
        if problem is not None:
            raise ValueError(problem)
        if quantization == "w8a8" and shard.is_sharded:
            raise ValueError("quantization='w8a8' calibrates on the whole model in one process: it does not run "
                             "with tensor_parallel_size > 1 (int8, int4 and gguf do)")
        # the same argument tuple as LLM.__init__'s float load, so both hit one cache entry
        base, tokenizer = _load_model(source, dtype, device, seed, None, 32, cpu_kernels, shard, with_tokenizer)
        if quantization == "w8a8":  # SmoothQuant, calibrated on text the fp32 model writes itself
            from .smoothquant import smoothed_w8a8_copy

            return smoothed_w8a8_copy(base, _w8a8_calibration(source, dtype, device, seed, cpu_kernels)), tokenizer
        gguf_path = source.path if quantization == "gguf" else None
        qmodel = quantized_copy(base, quantization, group_size, gguf_path)
        qmodel.ops = base.ops
        if _cpu_kernels_serve(cpu_kernels, device, qmodel.dtype):  # (fp32 activations: also under bf16 weights)
            use_cpu_kernels(qmodel)
        return qmodel, tokenizer
    mcfg, state = load_model_weights(source, shard)
    tokenizer = None
    if not with_tokenizer:
        pass
    elif source.kind == "gguf":
        tokenizer = Tokenizer.from_gguf(source.path)
    elif source.kind == "hf":
        tokenizer = Tokenizer.from_pretrained(source.path)
    else:
        tokenizer = Tokenizer.default()
    # bf16 weights on the CPU kernels: an fp32 model (activations, norms, embedding) whose linear
    # layers are then packed in bf16
    model = LlamaModel(mcfg, torch.float32 if use_c else dtype, torch.device(device), shard)
    if state is None:
        model.init_dummy(seed)
    else:
        model.load_weights(state)
        del state
    if use_c:
        use_cpu_kernels(model, weight_dtype=dtype)
    elif model.ops.name == "cpu":
        model.ops = TorchOps()
    return model, tokenizer


def finish_sharded_quantization(model: LlamaModel, source, dtype: torch.dtype, device: str, seed: int,
                                quantization: Optional[str], cpu_kernels: bool, shard: TPShard, with_tokenizer: bool,
                                tp) -> None:
    """What a tensor-parallel rank's quantization needs once its group exists: for "int8", the
    row-parallel layers' scales of whole rows (`engine.quant.sync_row_parallel_int8`; one
    all-reduce per layer, every rank in the same order). Nothing for other schemes: int4
    groups and GGUF blocks never straddle a shard boundary."""
    if quantization != "int8" or not shard.is_sharded:
        return
    from .quant import sync_row_parallel_int8

    base, _ = _load_model(source, dtype, device, seed, None, 32, cpu_kernels, shard, with_tokenizer)
    sync_row_parallel_int8(model, base, tp)


def _grammar_error(seq: Sequence) -> Optional[str]:
    """For a constrained sequence whose matcher ended in error, the error naming the constraint's kind
    (`structured_outputs.regex: lexer error: too many expressions constructed`); else None. The engine
    ends such a sequence at the token that failed (`EngineCore._finish_grammar_error`): its text is the
    part the grammar accepted, and its completion is an error, never a "stop" or "length" that reads
    as complete."""
    g = seq.grammar
    if g is None or not g.is_error():
        return None
    return f"structured_outputs.{seq.request.params.structured_outputs.kind}: {g.error_message()}"


def _cumulative_logprob(seq: Sequence) -> Optional[float]:
    """Sum of the sampled tokens' logprobs (natural log) when logprobs were asked for, else None
    (vLLM's `cumulative_logprob`); tokens a grammar forced (no logprob entry) add nothing."""
    if seq.logprobs is None:
        return None
    return float(sum(lp[tok] for tok, lp in zip(seq.output_token_ids, seq.logprobs) if lp is not None and tok in lp))


def _error_outputs(params: Any) -> int:
    """How many error completions a refused request gets: its n when that is a valid count (one
    per completion asked for), else 1 (an n of 10**9 is refused, not answered a billion times)."""
    from .config import MAX_N

    n = getattr(params, "n", 1)
    return n if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= MAX_N else 1


def _is_valid(seq: Sequence, tokenizer: Any) -> Optional[bool]:
    """For a constrained sequence (None for others): finished with "stop" and its grammar accepts
    the output text. A row cut by a stop string is valid only when the cut falls on a token
    boundary where the grammar was complete (`{"a":1` cut from `{"a":1}` by the stop string "}" is
    not); the matcher is left where it was."""
    g = seq.grammar
    if g is None:
        return None
    if seq.finish_reason != "stop" or g.is_error():
        return False
    if not isinstance(seq.stop_reason, str):
        return g.is_accepting()
    out = seq.output_token_ids
    skip = seq.request.params.skip_special_tokens
    k = len(out)
    while k >= 0:  # the longest output prefix whose text is the cut text (the cut is near the end)
        text = tokenizer.decode(out[:k], skip_special_tokens=skip)
        if text == seq.text:
            break
        if len(text) < len(seq.text):
            return False
        k -= 1
    if k < 0:
        return False
    try:
        g.rollback(len(out) - k)
    except Exception:  # noqa: BLE001 - a backend that cannot roll back that far: not provably valid
        return False
    ok = g.is_accepting()
    for tok in out[k:]:
        g.accept_token(tok)
    return ok



def _has_token_prefix(toks: list[list[int]]) -> bool:
    """True when some token list is a proper prefix of another (duplicates are refused earlier)."""
    seen = {tuple(t) for t in toks}
    return any(tuple(t[:j]) in seen for t in toks for j in range(1, len(t)))


def _token_id_list(ids: Any, name: str, vocab: int) -> list[int]:
    """`ids` (one prompt's token ids) as a list of ints, checked for the scoring API; `name` is the
    parameter as the caller wrote it (`token_ids[2]`, `items[0] prompt`).

    Raises:
        TypeError: not a sequence of ints (a string: tokenize it first), or an item that is not an int.
        ValueError: empty, or a token id outside the vocabulary [0, vocab).
    """
    if hasattr(ids, "tolist") and not isinstance(ids, (list, tuple)):  # a tensor or an array
        ids = ids.tolist()
    if isinstance(ids, (str, bytes, dict)) or not isinstance(ids, (list, tuple, Seq)):
        hint = "; tokenize text first (llm.tokenizer.encode)" if isinstance(ids, str) else ""
        raise TypeError(f"{name} must be a list of token ids (ints), got {type(ids).__name__} "
                        f"{reprlib.repr(ids)}{hint}")
    out = []
    for j, t in enumerate(ids):
        try:
            if isinstance(t, bool):
                raise TypeError
            t = operator.index(t)  # an int, a numpy or 0-d tensor integer
        except TypeError:
            raise TypeError(f"{name}[{j}] must be a token id (int), got {type(t).__name__} {reprlib.repr(t)}") from None
        if not 0 <= t < vocab:
            raise ValueError(f"{name}[{j}]: token id {t} is outside the vocabulary [0, {vocab})")
        out.append(t)
    if not out:
        raise ValueError(f"{name} is empty: give at least one token id")
    return out


def _choice_list(choices: Any, name: str) -> list[str]:
    """`choices` as a list of distinct strings, checked for the scoring API (`name` as for `_token_id_list`).

    Raises:
        TypeError: not a sequence of strings (a single string is refused, not taken per character).
        ValueError: empty, or a choice given twice (its score would be reported once).
    """
    if isinstance(choices, (str, bytes, dict)) or not isinstance(choices, (list, tuple, Seq)):
        raise TypeError(f"{name} must be a list of strings, got {type(choices).__name__} {reprlib.repr(choices)}")
    if not choices:
        raise ValueError(f"{name} is empty: give at least one choice")
    first: dict[str, int] = {}
    for j, c in enumerate(choices):
        if not isinstance(c, str):
            raise TypeError(f"{name}[{j}] must be a string, got {type(c).__name__} {reprlib.repr(c)}")
        if c in first:
            raise ValueError(f"{name}[{j}] {c!r} repeats {name}[{first[c]}]")
        first[c] = j
    return list(choices)


def _batches(items: list, size, budget: int):
    """Consecutive runs of items whose sizes (tokens) sum to at most budget (an item bigger than
    budget runs alone)."""
    part, n = [], 0
    for it in items:
        if part and n + size(it) > budget:
            yield part
            part, n = [], 0
        part.append(it)
        n += size(it)
    if part:
        yield part

class LLM:
    """Offline batch generation.

    Args:
        model: "smollm2-135m-instruct" (default), "gemma-3-270m" (the extra 'gemma'; see
            `engine.model_zoo`), a .gguf path, a Hugging Face
            folder, or "dummy:<shape>" (see `engine.weights.PRESETS`).
        **engine_kwargs: fields of `EngineConfig` (dtype, device, block_size,
            kv_cache_memory_bytes, kv_cache_memory_fraction, max_num_seqs,
            max_num_batched_tokens, max_model_len, enable_chunked_prefill,
            enable_prefix_caching, seed, num_threads, tensor_parallel_size, ...).

    With `tensor_parallel_size=N > 1` the model is split over this process and N - 1
    worker processes (`engine.parallel`); call `close()` (or use `with LLM(...) as llm:`) to
    stop them now, else they stop when the LLM is garbage collected or the interpreter
    exits. The workers are started with multiprocessing's "spawn", so a script that creates
    one must guard its entry point with `if __name__ == "__main__":` (as with vLLM).

    Raises:
        ValueError: unknown model, unknown or invalid engine kwargs (a tensor_parallel_size
            that does not divide the model's KV heads names both numbers).
        FileNotFoundError: the default model's wheel is not installed.
        engine.parallel.WorkerError: a tensor-parallel worker failed to start.
    """

    def __init__(self, model: str = DEFAULT_MODEL, **engine_kwargs) -> None:
        known = {f.name for f in dataclasses.fields(EngineConfig)} - {"model"}
        unknown = sorted(set(engine_kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine argument(s) {unknown}; known: {sorted(known)}")
        self.config = cfg = EngineConfig(model=model, **engine_kwargs)
        # threads per rank: the ranks of a CPU engine share its cores
        self.num_threads = cfg.num_threads or max(1, default_num_threads() // cfg.tensor_parallel_size)
        if self.config.device in ("auto", "cpu"):
            apply_num_threads(self.num_threads)  # PyTorch's and the C kernels' pools alike (engine/threads.py)
        elif cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        self.device, self.dtype, self.attention_backend = resolve_settings(cfg)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but no CUDA device is available")
        self.device_name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"

        source = resolve_model(model)
        quant = None if cfg.quantization in (None, "none") else cfg.quantization
        if quant == "gguf" and source.kind != "gguf":
            raise ValueError(f"quantization='gguf' needs a .gguf model, got {model!r} ({source.kind})")
        if cfg.kv_cache_dtype == "fp8_e4m3" and self.device.type != "cuda":
            raise ValueError("kv_cache_dtype='fp8_e4m3' needs a CUDA device (no fp8 arithmetic on this CPU); "
                             "use kv_cache_dtype='int8' on CPU")
        spec_cfg = SpeculativeConfig.resolve(cfg.speculative, cfg.speculative_config)
        tp = cfg.tensor_parallel_size
        group_size = cfg.quant_group_size if quant == "int4" else 32
        self.workers = None  # an engine.parallel.WorkerGroup when tensor_parallel_size > 1
        if tp > 1:
            self.workers = self._start_workers(source, quant, group_size, spec_cfg)
        try:
            self._build(source, quant, group_size, TPShard(0, tp), spec_cfg)
        except BaseException:
            if self.workers is not None:
                self.workers.close()
            raise

    def _build(self, source, quant: Optional[str], group_size: int, shard: TPShard,
               spec_cfg: Optional[SpeculativeConfig]) -> None:
        """Load (rank 0's shard of) the model, size and allocate the KV cache, build the engine's
        parts (with tensor parallelism, the workers load theirs meanwhile and join here)."""
        cfg = self.config
        bs = cfg.block_size
        t0 = time.perf_counter()
        self.model, self.tokenizer = _load_model(source, self.dtype, str(self.device), cfg.seed, quant, group_size,
                                                 cfg.cpu_kernels, shard)
        mcfg = self.model_config = self.model.cfg
        self.load_time_s = time.perf_counter() - t0

        # KV cache sized from the memory budget (per rank: each holds num_kv_heads / N heads of every block)
        # the activations' dtype picks the cache's (fp32 rows also under bf16 weights on the CPU kernels)
        self.backend, kv_dtype = make_attention_backend(self.attention_backend, cfg.kv_cache_dtype, cfg.cpu_kernels,
                                                        self.model.dtype)
        kv_heads = self.model.local.num_kv_heads
        layout = kv_layout(mcfg, bs)  # the layer groups: sliding-window layers give blocks back behind the window
        per_block = kv_block_bytes(self.backend, kv_dtype, layout.pages_per_block, kv_heads, mcfg.head_dim, bs)
        infos = self.workers.wait_ready() if self.workers is not None else []
        budget = cfg.kv_cache_memory_bytes
        if budget is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                free = min([free] + [i["free_memory"] for i in infos])  # every rank's cache has the same blocks
                budget = int(free * cfg.kv_cache_memory_fraction)
            else:  # the ranks of a CPU engine share one memory
                budget = min(int(_available_memory_bytes() * cfg.kv_cache_memory_fraction),
                             _CPU_KV_DEFAULT_CAP) // shard.world_size
        problem = (max_model_len_error(cfg, mcfg) or block_size_error(cfg, mcfg)
                   or kv_budget_memory_error(cfg, str(self.device)))
        if problem is not None:
            raise ValueError(problem)
        num_blocks = budget // per_block
        if num_blocks < 1:
            given = "" if cfg.kv_cache_memory_bytes is not None else " (the default share of free memory)"
            raise ValueError(
                f"kv_cache_memory_bytes={budget}{given} is smaller than one KV block ({per_block} bytes: "
                f"block_size={bs} tokens x {layout.pages_per_block} layers x K and V)"
            )
        self.max_model_len = context_length(cfg, mcfg, num_blocks)  # (a job plans with the same function)
        shape = self.backend.cache_shape(num_blocks, bs, kv_heads, mcfg.head_dim)
        self.kv_cache = KVCache(mcfg, num_blocks, bs, kv_dtype, self.device, shape, layout)
        # K and V, all layers, scales included (one rank's share); with sliding-window layers, of the
        # full-attention layers (per main-group token of a pool block)
        self.kv_bytes_per_token = per_block // layout.main_block_tokens
        self.kv_capacity_tokens = num_blocks * layout.main_block_tokens
        self.block_pool = BlockPool(num_blocks, cfg.enable_prefix_caching)
        self.kv_manager = KVCacheManager(self.block_pool, layout)
        self.model._rope_tables(self.max_model_len + 1)  # the forward never resizes them on a device
        tp_group = None
        if self.workers is not None:
            tp_group = self.workers.init(num_blocks, self.max_model_len, self.device)
            with self.workers.guard():
                finish_sharded_quantization(self.model, source, self.dtype, str(self.device), cfg.seed, quant,
                                            cfg.cpu_kernels, shard, True, tp_group)
        self.runner = ModelRunner(self.model, self.kv_cache, self.backend, tp=tp_group, workers=self.workers)
        self.sampler = Sampler(self.tokenizer.vocab_size, self.tokenizer.eos_token_ids,
                               cpu_kernels=_cpu_kernels_serve(cfg.cpu_kernels, str(self.device), self.dtype, quant))
        self.spec = None
        if spec_cfg is not None and spec_cfg.method == "draft_model" and layout.window:
            raise ValueError("speculative method 'draft_model' is not supported for a model with sliding-window "
                             "layers (its block tables give blocks back behind the window); use 'ngram' or 'suffix'")
        if spec_cfg is not None:
            def draft_factory():
                from .spec_decode import DraftModelProposer

                return DraftModelProposer(self.model, spec_cfg.draft_model, num_blocks, bs, self.backend, kv_dtype,
                                          self.sampler)

            core_ref = []  # filled below; no reference back to this LLM, so dropping it frees the KV cache at once

            def profile(n: int, ctx: int, seqs: Optional[int] = None) -> float:
                return core_ref[0].profile_step(n, ctx, seqs)

            self.spec = SpecDecoder(spec_cfg, self.max_model_len, draft_factory, profile=profile)
        self.scheduler = Scheduler(self.kv_manager, bs, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                   cfg.enable_chunked_prefill, self.spec)
        if (self.device.type == "cuda" and not cfg.enforce_eager and shard.world_size == 1 and not layout.hybrid
                and getattr(self.backend, "supports_cuda_graphs", False)):  # (graphs capture one table per row)
            from .cuda_graph import DecodeCudaGraphs  # decode steps replayed from graphs per batch bucket

            self.runner.cuda_graphs = DecodeCudaGraphs(self.model, self.kv_cache.layers, self.backend,
                                                       cfg.max_num_seqs, self.max_model_len, bs)
        tokenizer = self.tokenizer  # the factory holds no reference back to this LLM (freed by refcount)

        if cfg.structured_outputs_backend == "xgrammar":
            from .structured import xgrammar_backend

            if not xgrammar_backend.available():
                raise ValueError("structured_outputs_backend='xgrammar': xgrammar is not installed "
                                 "(pip install 'tokenmill[xgrammar]')")

        def grammar_backend():
            if cfg.structured_outputs_backend == "xgrammar":
                from .structured.xgrammar_backend import XGrammarBackend

                return XGrammarBackend(tokenizer)
            from .structured.llguidance_backend import LLGuidanceBackend

            return LLGuidanceBackend(tokenizer)

        self.structured = StructuredOutputManager(grammar_backend)  # the backend is built on first use
        self.core = EngineCore(self.scheduler, self.runner, self.sampler, self.max_model_len, self.spec,
                               self.structured, cfg.structured_outputs_jump_forward)
        if self.spec is not None:
            core_ref.append(weakref.proxy(self.core))
        self._seq_counter = 0
        self._request_counter = 0
        self._warned_max_tokens = False  # `max_tokens_past_context_warning` is given once per LLM

    def _start_workers(self, source, quant: Optional[str], group_size: int, spec_cfg):
        """Check that the model splits over tensor_parallel_size ranks, then start ranks 1..N-1
        (they load their shards while this process loads rank 0's).

        Raises:
            ValueError: N does not divide the heads (naming both), too few CUDA devices, or an
                option that does not run with tensor parallelism (w8a8, a draft model).
        """
        from .parallel import WorkerGroup, WorkerSpec, check_tp_options

        cfg, tp = self.config, self.config.tensor_parallel_size
        check_tp_size(model_config(source), tp)
        check_tp_options(tp, quant, spec_cfg.method if spec_cfg is not None else None)
        device = str(self.device)
        if self.device.type == "cuda":
            base = self.device.index or 0
            if torch.cuda.device_count() < base + tp:
                raise ValueError(f"tensor_parallel_size={tp} needs CUDA devices {base}..{base + tp - 1}; "
                                 f"{torch.cuda.device_count()} are visible")
            device = f"cuda:{base}"
            torch.cuda.set_device(base)  # NCCL works on the current device of each rank
        return WorkerGroup(WorkerSpec(
            source=source, dtype=self.dtype, device=device, seed=cfg.seed, quantization=quant, group_size=group_size,
            cpu_kernels=cfg.cpu_kernels, attention_backend=self.attention_backend, kv_cache_dtype=cfg.kv_cache_dtype,
            block_size=cfg.block_size, num_threads=self.num_threads, world_size=tp, timeout_s=cfg.distributed_timeout_s))

    # ------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Stop the tensor-parallel workers (and reap them); the engine cannot run afterwards.
        A no-op without tensor parallelism. Garbage collection and interpreter exit stop the
        workers too; `close` does it now."""
        if self.workers is not None:
            self.workers.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def tensor_parallel_size(self) -> int:
        """Ranks the model is split over (1: no tensor parallelism)."""
        return self.config.tensor_parallel_size

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the tensor-parallel workers (ranks 1..N-1; empty without)."""
        return self.workers.pids if self.workers is not None else []

    # ------------------------------------------------------------ info
    @property
    def stats(self) -> EngineStats:
        """The engine core's cumulative statistics."""
        return self.core.stats

    @property
    def num_free_blocks(self) -> int:
        """KV blocks not held by any sequence."""
        return self.block_pool.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        """KV blocks in the pool."""
        return self.block_pool.num_blocks

    def get_tokenizer(self) -> Any:
        """The Hugging Face tokenizer the engine encodes with (a `transformers` fast tokenizer), as
        vLLM's `LLM.get_tokenizer()` returns it: `apply_chat_template(messages, tokenize=False,
        add_generation_prompt=True)`, `encode`, `decode`. `LLM.tokenizer` is the engine's wrapper of
        it (EOS ids, incremental detokenizing)."""
        return self.tokenizer.hf

    def compute_logits(self, prompt_token_ids: list[int]) -> torch.Tensor:
        """Last-position logits of a prompt, [vocab_size] float32 on the CPU.

        Raises:
            RuntimeError: if requests are in flight.
            ValueError: for an empty prompt or one longer than max_model_len.
        """
        if self.scheduler.has_unfinished():
            raise RuntimeError("compute_logits needs an idle engine")
        if not prompt_token_ids or len(prompt_token_ids) > self.max_model_len:
            raise ValueError(f"prompt must have 1..{self.max_model_len} tokens")
        nblocks = self.kv_manager.scratch_blocks(len(prompt_token_ids))
        if nblocks > self.num_free_blocks:
            raise ValueError(f"prompt of {len(prompt_token_ids)} tokens does not fit the free KV blocks")
        tables = self.kv_manager.allocate_scratch(len(prompt_token_ids))  # never registered in the prefix cache
        try:
            with torch.inference_mode():
                return self.runner.compute_logits(list(prompt_token_ids), *tables).float().cpu()
        finally:
            self.kv_manager.free_scratch(tables)

    def score(self, token_ids: Union[list[int], list[list[int]]], chunk_size: Optional[int] = None) -> list[torch.Tensor]:
        """Log-probability of every token given its prefix (for perplexity), prompts only.

        All sequences are prefilled together, in steps of at most `chunk_size`
        tokens (default: max_num_batched_tokens), in the model's forward pass
        with the engine's KV cache and attention backend; each step's inputs come from the
        model runner's one `prepare`.

        Args:
            token_ids: one sequence of token ids, or a list of them (an empty list: no sequences).
        Returns:
            per sequence, [len - 1] float32 on the CPU: entry t is log p(token t+1 | tokens 0..t).
        Raises:
            RuntimeError: if requests are in flight.
            TypeError: token_ids (or one of its sequences, named by index) is not a list of ints, e.g. a string.
            ValueError: an empty sequence or a token id outside the vocabulary (named, with the vocab size),
                or sequences that do not fit the free KV blocks or exceed max_model_len.
        """
        if self.scheduler.has_unfinished():
            raise RuntimeError("score needs an idle engine")
        vocab = self.tokenizer.vocab_size
        if hasattr(token_ids, "tolist") and not isinstance(token_ids, (list, tuple)):  # a tensor or an array
            token_ids = token_ids.tolist()
        if isinstance(token_ids, (list, tuple)) and not token_ids:
            seqs = []  # no sequences
        elif isinstance(token_ids, (list, tuple)) and (isinstance(token_ids[0], (list, tuple, str))
                                                       or getattr(token_ids[0], "ndim", 0) >= 1):
            seqs = [_token_id_list(s, f"token_ids[{i}]", vocab) for i, s in enumerate(token_ids)]
        else:
            seqs = [_token_id_list(token_ids, "token_ids", vocab)]
        if any(len(s) > self.max_model_len for s in seqs):
            raise ValueError(f"each sequence must have 1..{self.max_model_len} tokens")
        need = [self.kv_manager.scratch_blocks(len(s)) for s in seqs]
        if sum(need) > self.num_free_blocks:
            raise ValueError(f"sequences need {sum(need)} KV blocks, {self.num_free_blocks} are free")
        return [lp for lp, _, _ in self._prefill_logprobs(seqs, chunk_size or self.config.max_num_batched_tokens)]

    def _prefill_logprobs(self, seqs: list[list[int]], budget: int, top_k: int = 0
                          ) -> list[tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]]:
        """Prefill `seqs` together (steps of at most `budget` tokens, scratch KV blocks never
        prefix-cached) with logits at every position; per sequence, over its positions t = 1..len-1:
        log p(token t | tokens < t) [len - 1] float32, and with top_k > 0 the k largest logprobs
        [len - 1, k] float32 and their token ids [len - 1, k] int64 (else None, None); all on the CPU.
        The caller checks that the sequences fit the free blocks and max_model_len."""
        tables = [self.kv_manager.allocate_scratch(len(s)) for s in seqs]
        out: list[list[tuple]] = [[] for _ in seqs]
        done = [0] * len(seqs)
        try:
            with torch.inference_mode():
                while any(d < len(s) for d, s in zip(done, seqs)):
                    specs, chunks = [], []
                    left = budget
                    for i, s in enumerate(seqs):
                        if done[i] >= len(s) or left == 0:
                            continue
                        n = min(len(s) - done[i], left)
                        left -= n
                        specs.append(ChunkSpec(s, done[i], n, tables[i][0], "all", window_table=tables[i][1]))
                        chunks.append((i, done[i], n))
                    # every chunk as a prefill chunk (a 1-token chunk too), logits at every position
                    logits = self.runner.run(self.runner.prepare([], specs))
                    lp = torch.log_softmax(logits.float(), dim=-1)
                    row = 0
                    for i, p0, n in chunks:
                        m = min(n, len(seqs[i]) - 1 - p0)  # the last token predicts nothing
                        if m > 0:
                            tgt = torch.tensor(seqs[i][p0 + 1: p0 + 1 + m], device=lp.device)
                            part = lp[row: row + m]
                            top = part.topk(top_k, dim=-1) if top_k > 0 else None
                            out[i].append((part.gather(1, tgt[:, None]).squeeze(1).cpu(),
                                           None if top is None else top.values.cpu(),
                                           None if top is None else top.indices.cpu()))
                        row += n
                        done[i] += n
        finally:
            for t in tables:
                self.kv_manager.free_scratch(t)
        res = []
        for o in out:
            if not o:
                res.append((torch.zeros(0), None if top_k <= 0 else torch.zeros(0, top_k),
                            None if top_k <= 0 else torch.zeros(0, top_k, dtype=torch.long)))
                continue
            res.append((torch.cat([a for a, _, _ in o]), None if top_k <= 0 else torch.cat([b for _, b, _ in o]),
                        None if top_k <= 0 else torch.cat([c for _, _, c in o])))
        return res

    def _add_prompt_logprobs(self, reqs: list[Request]) -> None:
        """Fill `prompt_logprobs` of the valid requests that ask for them (`SamplingParams.prompt_logprobs`),
        by a scoring pass over their prompts before generation, in groups that fit the free KV blocks; a
        prompt that alone does not fit them becomes an error output naming the blocks it needs."""
        todo = [r for r in reqs if r.error is None and r.params.prompt_logprobs is not None]
        blocks = self.kv_manager.scratch_blocks
        while todo:
            free, group = self.num_free_blocks, []
            while todo and blocks(len(todo[0].prompt_token_ids)) <= free:
                free -= blocks(len(todo[0].prompt_token_ids))
                group.append(todo.pop(0))
            if not group:
                r = todo.pop(0)
                r.error = (f"prompt_logprobs: the prompt needs {blocks(len(r.prompt_token_ids))} KV blocks, "
                           f"{self.num_free_blocks} are free")
                continue
            k = max(r.params.prompt_logprobs for r in group)
            results = self._prefill_logprobs([r.prompt_token_ids for r in group],
                                             self.config.max_num_batched_tokens, k)
            for r, (tok_lp, top_v, top_i) in zip(group, results):
                kr, ids = r.params.prompt_logprobs, r.prompt_token_ids
                rows: list[Optional[dict[int, float]]] = [None]
                for t in range(len(ids) - 1):
                    d = {} if kr == 0 else dict(zip(top_i[t, :kr].tolist(), top_v[t, :kr].tolist()))
                    d[ids[t + 1]] = float(tok_lp[t])
                    rows.append(d)
                r.prompt_logprobs = rows

    def score_choices(self, prompt_token_ids: list[int], choices: Seq[str]) -> dict[str, float]:
        """Log-probability of each choice as the continuation of one prompt (scoring mode);
        `score_choices_batch` for one prompt.

        Raises:
            RuntimeError: if requests are in flight.
            TypeError: prompt_token_ids is not a list of ints (a string: tokenize it first), or choices
                is not a list of strings (the message names the parameter, and the item by index).
            ValueError: an empty prompt_token_ids or choices, a token id outside the vocabulary (with
                the vocab size), a repeated choice, or what `score_choices_batch` reports for the prompt
                (a choice without tokens, past max_model_len, more KV blocks than the pool holds).
        """
        try:
            _token_id_list(prompt_token_ids, "prompt_token_ids", self.tokenizer.vocab_size)
            _choice_list(choices, "choices")
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"score_choices: {exc}") from None
        out = self.score_choices_batch([(prompt_token_ids, choices)])[0]
        if isinstance(out, str):
            raise ValueError(out)
        return out

    def score_choices_batch(self, items: Seq[tuple[list[int], Seq[str]]]) -> list[Union[dict[str, float], str]]:
        """Log-probability of each choice as the continuation of its prompt, for many prompts.

        Per prompt, its full KV blocks before its last token are taken from the prefix cache
        or computed (and then indexed there under the scheduler's own block keys, so later
        prompts and generation requests share them); prompts whose missing blocks do not
        overlap are computed together, up to the token budget per forward pass. Then every
        choice's tail (the prompt's last partial block, its last token and the choice's
        tokens) is computed once per prompt in a chunk of its own (its last position's logits
        score every choice's first token; many prompts per forward pass), then each choice of
        more than one token runs its remaining tokens over a copy of that block.
        A choice is tokenized on its own (`encode(c, add_special_tokens=False)`); its
        log-probability is the sum over its tokens (natural log). No end token is added, except
        when one choice's tokens are a proper prefix of another's ("pos" and "positive"): then
        every choice of that prompt is scored followed by the tokenizer's EOS, the probability
        that the answer is exactly that choice (without it a prefix always scores at least as
        high as each of its extensions).
        Each prompt's figures depend only on its own tokens: not on the other prompts, their
        order or whether the prefix cache served its blocks.

        Args:
            items: (prompt token ids, non-empty choice strings) per prompt.
        Returns:
            per prompt, {choice: log p(choice tokens | prompt)} in the choices' order, or an
            error message: a bad item never fails the others. The message names the item
            (`items[3] prompt`, `items[3] choices[1]`) when it is not a (prompt, choices) pair, its
            prompt is not a non-empty list of token ids in the vocabulary, or its choices are not a
            non-empty list of distinct strings; else a choice without tokens, prompt + choice past
            max_model_len, or more KV blocks than the pool holds.
        Raises:
            RuntimeError: if requests are in flight.
        """
        if self.scheduler.has_unfinished():
            raise RuntimeError("score_choices needs an idle engine")
        bs, pool = self.config.block_size, self.block_pool
        hybrid = self.kv_manager.layout.hybrid
        results: list[Union[dict[str, float], str, None]] = [None] * len(items)
        jobs = []  # (index, prompt, choice token lists, n_shared, block keys, tail blocks per choice)
        vocab = self.tokenizer.vocab_size
        for i, item in enumerate(items):
            try:
                if isinstance(item, (str, bytes, dict)) or not isinstance(item, (list, tuple, Seq)) or len(item) != 2:
                    raise TypeError(f"items[{i}] must be a (prompt token ids, choices) pair, got "
                                    f"{type(item).__name__} {reprlib.repr(item)}")
                P = _token_id_list(item[0], f"items[{i}] prompt", vocab)
                choices = _choice_list(item[1], f"items[{i}] choices")
            except (TypeError, ValueError) as exc:
                results[i] = f"score_choices: {exc}"
                continue
            toks = [self.tokenizer.encode(c, add_special_tokens=False) for c in choices]
            bad = next((c for c, t in zip(choices, toks) if not t), None)
            if bad is not None:
                results[i] = f"score_choices: {bad!r} has no tokens"
                continue
            eos = self.tokenizer.eos_token_id
            if eos is not None and _has_token_prefix(toks):
                toks = [t + [eos] for t in toks]  # "exactly this label": else a prefix outscores its extensions
            long = next((c for c, t in zip(choices, toks) if len(P) + len(t) > self.max_model_len), None)
            if long is not None:
                results[i] = (f"score_choices: the prompt ({len(P)} tokens) and {long!r} exceed "
                              f"max_model_len={self.max_model_len}")
                continue
            n_shared = (len(P) - 1) // bs  # full blocks before the prompt's last token
            keys, parent = [], None
            for b in range(n_shared):
                key = block_key(parent, P[b * bs:(b + 1) * bs])
                parent = hash(key)
                keys.append(key)
            tails = [-(-(len(P) + len(t)) // bs) - n_shared for t in toks]
            # a hybrid model: the prompt's scratch tables and one choice's tail blocks (`_score_job_hybrid`)
            need = (self.kv_manager.scratch_blocks(len(P) - 1) + max(self._tail_blocks(len(P) - 1, len(t))
                                                                       for t in toks) + 2 if hybrid
                    else n_shared + sum(tails) + 2)
            if need > pool.num_blocks:
                results[i] = f"score_choices: needs {need} KV blocks, the pool holds {pool.num_blocks}"
                continue
            jobs.append((i, P, list(choices), toks, n_shared, keys, tails))
        budget = self.config.max_num_batched_tokens
        with torch.inference_mode():
            start = 0
            if hybrid:
                for job in jobs:
                    self._score_job_hybrid(job, results, budget)
                start = len(jobs)
            while start < len(jobs):
                # a group whose blocks fit at once (its prefixes are held until its tails ran)
                end, need = start, 0
                while end < len(jobs):
                    j = jobs[end]
                    n = j[4] + sum(j[6]) + 1
                    if end > start and need + n > pool.num_free_blocks - 1:  # 1: the padding chunk's block
                        break
                    need += n
                    end += 1
                group = jobs[start:end]
                start = end
                self._score_group(group, results, bs, budget)
        return results  # type: ignore[return-value]

    def _tail_blocks(self, prefix_len: int, num_tokens: int) -> int:
        """Pool blocks a choice's tail of `num_tokens` tokens takes over a shared scratch prefix of
        `prefix_len` tokens: per layer group, its blocks past the prefix's full ones (the first a copy
        of the prefix's partial block)."""
        return sum(-(-(prefix_len + num_tokens) // g.block_tokens) - prefix_len // g.block_tokens
                   for g in self.kv_manager.groups)

    def _score_job_hybrid(self, job: tuple, results: list, budget: int) -> None:
        """One scoring job (see `score_choices_batch`) for a model that mixes full and sliding-window
        layers, outside the prefix cache: the prompt's tokens but its last are prefilled once over
        scratch tables (no logits); then each choice runs the prompt's last token and its own tokens
        but the last as one chunk over the prompt's full blocks plus, per layer group, a copy of
        the prompt's partial block and fresh blocks; row j predicts the choice's token j. All choices
        of the prompt share one forward pass (`_run_invariant`), as many as the free blocks hold.
        A choice's score sums the log-probabilities of its tokens."""
        i, P, choices, toks = job[:4]
        L = len(P) - 1
        mgr = self.kv_manager
        prefix = mgr.allocate_scratch(L) if L else ([], [])
        owned: list[list[int]] = []
        scores: dict[str, float] = {}
        try:
            for start in range(0, L, budget):
                n = min(budget, L - start)
                self.runner.run(self.runner.prepare([], [ChunkSpec(P, start, n, prefix[0], None,
                                                                   window_table=prefix[1])]))
            k = 0
            while k < len(toks):
                specs = []  # (choice, chunk); 2 blocks stay free for `_run_invariant`'s padding chunk
                while k < len(toks) and (not specs or self._tail_blocks(L, len(toks[k])) + 2 <= mgr.pool.num_free_blocks):
                    tables = []
                    for g, shared in zip(mgr.groups, prefix):
                        full = L // g.block_tokens
                        fresh = mgr.pool.allocate(-(-(L + len(toks[k])) // g.block_tokens) - full)
                        owned.append(fresh)
                        if L % g.block_tokens:
                            self.runner.copy_blocks([shared[full]], fresh[:1])
                        tables.append(list(shared[:full]) + fresh)
                    specs.append((choices[k], ChunkSpec(P + toks[k], L, len(toks[k]), tables[0], "all",
                                                        window_table=tables[1] if len(tables) > 1 else None)))
                    k += 1
                for part in _batches(specs, lambda cs: cs[1].num_tokens, budget):
                    lp = torch.log_softmax(self._run_invariant([spec for _, spec in part]).float(), dim=-1)
                    row = 0
                    for c, spec in part:
                        t = torch.tensor(spec.token_ids[len(P):], device=lp.device)
                        idx = torch.arange(row, row + len(t), device=lp.device)
                        scores[c] = float(lp[idx, t].double().sum())
                        row += spec.num_tokens
                for t in owned:
                    mgr.pool.free(t)
                owned.clear()
        finally:
            for t in owned:
                mgr.pool.free(t)
            mgr.free_scratch(prefix)
        results[i] = {c: scores[c] for c in choices}

    _ROW_MULTIPLE = 12  # the CPU GEMM's register tile is 12, 6 or 4 rows: multiples of 12 fill every tile

    def _run_invariant(self, specs: list[ChunkSpec]) -> Optional[torch.Tensor]:
        """One forward of prefill chunks whose every row comes out as it would in any other batch.

        The CPU GEMM computes a remainder tile of 1-3 rows with another summation order than a
        full tile, so a row's value could depend on how many rows shared its forward pass. Here
        the token count is padded with a scratch chunk, and the logits rows with repeats of
        the last one, to multiples of 12, so every tile is full: scores then depend on a
        prompt's own tokens only (not on its neighbours, their order, or the prefix cache).

        Returns:
            the logits of the chunks' requested rows [S, V] (padding rows dropped), or None.
        """
        m = self._ROW_MULTIPLE
        pad = -sum(c.num_tokens for c in specs) % m
        scratch = self.kv_manager.allocate_scratch(pad) if pad else None
        try:
            if pad:
                specs = specs + [ChunkSpec([0] * pad, 0, pad, scratch[0], None, window_table=scratch[1])]
            inputs = self.runner.prepare([], specs)
            n = int(inputs.logits_indices.shape[0])
            extra = -n % m
            if n and extra:
                idx = inputs.logits_indices
                inputs = dataclasses.replace(inputs, logits_indices=torch.cat((idx, idx[-1:].expand(extra))))
            logits = self.runner.run(inputs)
            return None if logits is None else logits[:n]
        finally:
            if scratch:
                self.kv_manager.free_scratch(scratch)

    def _score_group(self, group: list, results: list, bs: int, budget: int) -> None:
        """Prefix blocks, then choice tails, of a group of scoring jobs (see `score_choices_batch`)."""
        pool = self.block_pool
        shared: dict[int, list[int]] = {}
        owned: list[list[int]] = []
        try:
            # 1. prefixes: cached blocks are taken; missing ones computed, prompts together while no
            #    two of them would compute the same block
            batch: list[tuple[ChunkSpec, list, int]] = []
            pending: set = set()

            def flush() -> None:
                if batch:
                    self._run_invariant([c for c, _, _ in batch])
                    for c, keys, hits in batch:
                        for b in range(hits, len(keys)):
                            pool.register(c.block_table[b], keys[b])
                    batch.clear()
                    pending.clear()

            for i, P, _, _, n_shared, keys, _ in group:
                if any(k in pending for k in keys):
                    flush()
                table = []
                for key in keys:
                    b = pool.lookup(key)
                    if b is None:
                        break
                    pool.acquire(b)
                    table.append(b)
                hits = len(table)
                if pool.num_free_blocks < n_shared - hits:
                    flush()
                table += pool.allocate(n_shared - hits)
                shared[i] = table
                if hits < n_shared:
                    n = (n_shared - hits) * bs
                    if batch and sum(c.num_tokens for c, _, _ in batch) + n > budget:
                        flush()
                    batch.append((ChunkSpec(P, hits * bs, n, table, None), keys, hits))
                    pending.update(keys[hits:])
            flush()
            # 2. each prompt's last partial block and last token, in a chunk of the same shape whether
            #    or not the cache served its prefix: the last position's log-probabilities score every
            #    choice's first token
            scores: dict[int, dict[str, float]] = {i: {} for i, *_ in group}
            last: dict[int, list[int]] = {}
            heads: list[tuple[int, ChunkSpec]] = []
            for i, P, _, _, n_shared, _, _ in group:
                last[i] = pool.allocate(1)
                owned.append(last[i])
                S = n_shared * bs
                heads.append((i, ChunkSpec(P, S, len(P) - S, shared[i] + last[i], "last")))
            for part in _batches(heads, lambda h: h[1].num_tokens, budget):
                lp = torch.log_softmax(self._run_invariant([c for _, c in part]).float(), dim=-1)
                for row, (i, _) in enumerate(part):
                    job = next(j for j in group if j[0] == i)
                    for c, t in zip(job[2], job[3]):
                        scores[i][c] = float(lp[row, t[0]].double())
            # 3. choices of more than one token: their tokens after the first, over a copy of the prompt's
            #    last block (so choices never share a written block), logits at every position
            tails = []
            for i, P, choices, toks, n_shared, _, nb in group:
                for c, t, k in zip(choices, toks, nb):
                    if len(t) < 2:
                        continue
                    table = shared[i] + pool.allocate(k)
                    owned.append(table[n_shared:])
                    self.runner.copy_blocks(last[i], table[n_shared:n_shared + 1])
                    tails.append((i, c, t, ChunkSpec(P + t, len(P), len(t) - 1, table, "all")))
            for part in _batches(tails, lambda t: t[3].num_tokens, budget):
                lp = torch.log_softmax(self._run_invariant([s for *_, s in part]).float(), dim=-1)
                row = 0
                for i, c, t, spec in part:  # row j of a chunk (position len(P) + j) predicts t[j + 1]
                    idx = torch.arange(row, row + len(t) - 1, device=lp.device)
                    scores[i][c] += float(lp[idx, torch.tensor(t[1:], device=lp.device)].double().sum())
                    row += spec.num_tokens
            for i, *_ in group:
                results[i] = scores[i]
        finally:
            for t in owned:
                pool.free(t)
            for t in shared.values():
                pool.free(t)

    # ------------------------------------------------------------ public API
    def generate(self, prompts: Seq[PromptType], sampling_params: Union[SamplingParams, Seq[SamplingParams], None] = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate completions for every prompt; outputs in input order.

        Args:
            prompts: strings, lists of token ids, or vLLM's prompt dicts (`{"prompt": text}`,
                `{"prompt_token_ids": ids}`; see `_from_prompt_dict`); a single string or dict is one
                prompt (as in vLLM), not a sequence of one-character prompts, and a flat list of ints
                is one tokenized prompt (`[1, 2, 3]` is `[[1, 2, 3]]`, as in vLLM).
            sampling_params: one SamplingParams for all, or one per prompt (default: SamplingParams()).
            use_tqdm: show a progress bar (requests done, input and output tokens/s).

        Returns:
            One RequestOutput per prompt, in input order (`request_id` is the prompt's index).

        A bad request does not raise, as a job's bad row becomes an error row: its output has
        `finish_reason == "error"` in every completion, no tokens, and `.error` naming the problem,
        in the words a job's error row uses; the other prompts run. Bad requests are: a null or
        non-string prompt (`None`: `prompt is null`; `5`: `prompt must be a string, got int 5`), an
        empty or all-blank prompt (`""`, `"   "`, `[]`: `prompt is empty`), a token id outside the vocabulary,
        a prompt that leaves no room for output within `max_model_len` (`prompt is too long: ...`),
        and invalid sampling parameters (`SamplingParams.validate`, e.g. `max_tokens must be an
        integer >= 1, got 0`).

        A `max_tokens` larger than the context leaves after the prompt is not an error here (as in
        vLLM): the request stops at the end of the context with finish_reason "length", and the
        first such request warns (a UserWarning, once per LLM). A job refuses such a row instead,
        unless `--truncate`.

        Raises:
            TypeError: prompts that are not a string, a prompt dict or a sequence of prompts (None, a number), or
                sampling_params that is not a SamplingParams or a sequence of them (a dict, a string).
            ValueError: only for a sampling_params list whose length differs from prompts.
        """
        prompts = _prompt_list(prompts)
        outs: list[Optional[RequestOutput]] = [None] * len(prompts)
        for o in self.iter_outputs(prompts, sampling_params, use_tqdm):
            outs[int(o.request_id)] = o
        return outs  # type: ignore[return-value]

    def chat(self, conversations: Seq[list[dict]], sampling_params=None, use_tqdm: bool = True,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Apply the chat template to each conversation ({role, content} dicts), then generate.

        Args:
            conversations: a list of conversations, or one conversation (a list of dicts).
            sampling_params, use_tqdm: as for `generate`.
            add_generation_prompt: end the rendered text with the assistant turn's header.

        Returns:
            One RequestOutput per conversation, in input order (`request_id` is its index).

        A malformed conversation does not raise: its output is an error output (as in `generate`)
        whose `.error` names the message's index, the field and the bad value, in the words a job's
        `messages` error row uses (`engine.tokenizer.validate_messages`): a role other than
        `tokenizer.chat_roles` (system, user, assistant; tool when the model's chat template handles
        tool messages), e.g. `messages[1].role must be one of ['system', 'user', 'assistant'], got
        'wizard'`; an empty or all-blank content, `messages[0].content is empty ('')`; a content that
        is not a string; an empty conversation. The other conversations run.

        Raises:
            TypeError: conversations is not a list of conversations or one conversation (None, a
                string, a single message dict, a number); sampling_params as for `generate`.
        """
        if isinstance(conversations, Mapping):
            raise TypeError(f"conversations must be a list of conversations or one conversation (a list of "
                            f"{{role, content}} dicts), got one message dict {reprlib.repr(conversations)}: wrap "
                            f"it in a list")
        if conversations is None or isinstance(conversations, (str, bytes, bytearray)) or not isinstance(
                conversations, (list, tuple, Seq)):
            raise TypeError(f"conversations must be a list of conversations or one conversation (a list of "
                            f"{{role, content}} dicts), got {type(conversations).__name__} "
                            f"{reprlib.repr(conversations)}")
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # a single conversation
        prompts: list = []
        for conv in conversations:
            try:
                prompts.append(self.tokenizer.apply_chat_template(conv, add_generation_prompt=add_generation_prompt))
            except ValueError as e:  # validate_messages: already says which message and what is wrong
                prompts.append(_BadPrompt(str(e)))
            except Exception as e:  # noqa: BLE001 - one bad conversation never fails the batch
                prompts.append(_BadPrompt(f"messages: {type(e).__name__}: {e}"))
        return self.generate(prompts, sampling_params, use_tqdm)

    def iter_outputs(self, prompts: Seq[PromptType], sampling_params=None,
                     use_tqdm: bool = True) -> Iterator[RequestOutput]:
        """Yield each RequestOutput as soon as its request finishes (request_id = str(prompt index)).

        Invalid requests are yielded first, as error outputs. Stopping the
        iteration early aborts the remaining requests and frees their blocks. A single string
        is one prompt.

        Raises:
            TypeError: prompts or sampling_params of a type neither takes (see `generate`).
            ValueError: a sampling_params list whose length differs from prompts.
        """
        prompts = _prompt_list(prompts)
        params_list = _params_list(sampling_params, len(prompts))
        requests = self.make_requests(prompts, params_list)
        pbar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            pbar = tqdm(total=len(requests), desc="Processed prompts", dynamic_ncols=True)
        start = time.perf_counter()
        in_tok = out_tok = 0
        last_update = 0.0
        try:
            self._add_prompt_logprobs(requests)
            self._score_requests([r for r in requests if r.error is None and r.params.score_choices is not None])
            for r in requests:
                if r.error is not None or r.scores is not None:
                    out = self._request_output(r)
                    if pbar:
                        pbar.update(1)
                    yield out
            self.core.add_requests([r for r in requests if r.scores is None])
            while self.core.has_unfinished():
                step = self.core.step()
                finished, n_in, n_out = step.finished, step.prompt_tokens, step.output_tokens
                in_tok += n_in
                out_tok += n_out
                if pbar:
                    now = time.perf_counter()
                    if finished or now - last_update > 0.5:
                        el = max(now - start, 1e-9)
                        pbar.set_postfix_str(f"in {in_tok / el:.0f} tok/s, out {out_tok / el:.0f} tok/s", refresh=False)
                        last_update = now
                    pbar.update(len(finished))
                for r in finished:
                    yield self._request_output(r)
        finally:
            if pbar:
                pbar.close()
            self.core.abort_all()

    # ------------------------------------------------------------ internals

    def make_requests(self, prompts, params_list: list[SamplingParams]) -> list[Request]:
        """Validate and tokenize prompts into Requests for `core.add_requests` (the one place the
        prompt and parameter rules are checked).

        A bad prompt or parameter gives a Request whose `error` names it (never raises); each
        valid one gets its n Sequences, seeded (a request without a seed draws from the engine's).
        """
        vocab = self.tokenizer.vocab_size
        shown: dict[int, str] = {}  # a TokensPrompt's own "prompt" text, reported back as RequestOutput.prompt
        prompts = list(prompts)
        for i, p in enumerate(prompts):
            if isinstance(p, Mapping):
                prompts[i], text = _from_prompt_dict(p)
                if text is not None:
                    shown[i] = text
        texts = [(i, p) for i, p in enumerate(prompts) if isinstance(p, str) and prompt_text_error(p) is None]
        encoded = dict(zip((i for i, _ in texts), self.tokenizer.encode_batch([p for _, p in texts]))) if texts else {}
        now = time.time()
        reqs: list[Request] = []
        for i, (prompt, params) in enumerate(zip(prompts, params_list)):
            error = None
            text: Optional[str] = None
            ids: list[int] = []
            if isinstance(prompt, _BadPrompt):
                error = prompt.message
            elif isinstance(prompt, str):
                text = prompt
                ids = encoded.get(i, [])
                error = prompt_text_error(prompt)
                if error is None and not ids:
                    error = "prompt is empty after tokenization"
            elif isinstance(prompt, (list, tuple)) and all(_is_token_id(t) for t in prompt):
                ids = list(prompt)
                text = shown.get(i)
                if not ids:
                    error = "prompt is empty"
                elif any(t < 0 or t >= vocab for t in ids):
                    bad = next(t for t in ids if t < 0 or t >= vocab)
                    error = f"prompt: token id {bad} is outside the vocabulary [0, {vocab})"
            elif isinstance(prompt, (list, tuple)):
                error = f"prompt: must be a string or a list of token ids (ints), got {reprlib.repr(prompt)}"
            else:  # None, an int, ...: the words a job's row uses
                error = prompt_type_error(prompt)
            if error is None and not isinstance(params, SamplingParams):
                error = f"sampling_params: expected SamplingParams, got {type(params).__name__}"
            if error is None:
                error = params.validate(vocab)
            if error is None:
                error = prompt_length_error(len(ids), self.max_model_len)
            if error is None and not self._warned_max_tokens and params.score_choices is None:
                message = max_tokens_past_context_warning(len(ids), params.max_tokens, self.max_model_len)
                if message is not None:
                    self._warned_max_tokens = True
                    warnings.warn(message, stacklevel=3)
            grammar = None
            if error is None and params.structured_outputs is not None:
                grammar, error = self.structured.matcher_for(params.structured_outputs)
            metrics = RequestMetrics(arrival_time=now, prompt_tokens=len(ids))
            req = Request(str(i), i, text, ids, params if isinstance(params, SamplingParams) else SamplingParams(),
                          metrics, error=error)
            if error is None:
                base = params.seed if params.seed is not None else _mix_seed(self.config.seed, self._request_counter)
                self._request_counter += 1
                for j in range(params.n):
                    gen = None
                    if not params.greedy:
                        gen = torch.Generator(device=self.device)
                        gen.manual_seed(_mix_seed(base, j))
                    seq = Sequence(seq_id=self._seq_counter, request=req, index=j, token_ids=list(ids), generator=gen)
                    seq.detokenizer = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
                    seq.stop_matcher = StopStringMatcher(params.stop)
                    seq.logprobs = [] if params.logprobs is not None else None
                    if grammar is not None:  # one matcher per completion, all from one compiled grammar
                        seq.grammar = grammar if j == 0 else self.structured.matcher_for(params.structured_outputs)[0]
                    self._seq_counter += 1
                    req.seqs.append(seq)
            reqs.append(req)
        return reqs

    def _score_requests(self, reqs: list[Request]) -> None:
        """Score the `score_choices` requests now (one whose choices cannot be scored gets the reason
        as its error)."""
        if not reqs:
            return
        t0 = time.time()
        results = self.score_choices_batch([(r.prompt_token_ids, r.params.score_choices) for r in reqs])
        now = time.time()
        for r, res in zip(reqs, results):
            if isinstance(res, str):
                r.error = res
            else:
                r.scores = res
            r.metrics.scheduled_time, r.metrics.first_token_time, r.metrics.finish_time = t0, now, now
            for s in r.seqs:
                s.status = SequenceStatus.FINISHED

    def _request_output(self, req: Request) -> RequestOutput:
        m = req.metrics
        if req.error is None and req.scores is not None:
            label = max(req.scores, key=lambda c: req.scores[c])  # the first of equal maxima
            outs = [CompletionOutput(index=0, text=label, token_ids=[], finish_reason="stop", valid=True,
                                     label_logprobs=dict(req.scores))]
            return RequestOutput(request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
                                 outputs=outs, finished=True, num_cached_tokens=0, metrics=m,
                                 prompt_logprobs=req.prompt_logprobs)
        if req.error is not None:
            if m.finish_time is None:
                m.finish_time = time.time()
            outs = [CompletionOutput(index=j, text="", token_ids=[], finish_reason="error", error=req.error)
                    for j in range(_error_outputs(req.params))]
        else:
            outs = [CompletionOutput(index=s.index, text=s.text, token_ids=s.output_token_ids,
                                     finish_reason=s.finish_reason, logprobs=s.logprobs, stop_reason=s.stop_reason,
                                     valid=_is_valid(s, self.tokenizer), num_forced_tokens=s.num_forced_tokens,
                                     cumulative_logprob=_cumulative_logprob(s))
                    if (problem := _grammar_error(s)) is None else
                    CompletionOutput(index=s.index, text=s.text, token_ids=s.output_token_ids, finish_reason="error",
                                     logprobs=s.logprobs, error=problem, valid=False,
                                     num_forced_tokens=s.num_forced_tokens, cumulative_logprob=_cumulative_logprob(s))
                    for s in req.seqs]
        m.output_tokens = sum(len(o.token_ids) for o in outs)
        cached = req.seqs[0].num_cached_tokens if req.seqs else 0
        error = req.error
        if error is None and outs and all(o.finish_reason == "error" for o in outs):
            error = outs[0].error  # every completion failed (a grammar the backend gave up on)
        return RequestOutput(request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
                             outputs=outs, finished=True, num_cached_tokens=cached, metrics=m, error=error,
                             prompt_logprobs=req.prompt_logprobs if error is None else None)
