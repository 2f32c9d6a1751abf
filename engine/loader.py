"""Model loading and the sizing rules of an engine (as vLLM's model_loader): what `LLM`, the
tensor-parallel workers, the draft model and a job's planning import.

- settings: `resolve_settings` ("auto" device, dtype and attention backend), `compute_dtype`,
  `auto_kv_dtype`, `make_attention_backend`, `cpu_kernels_serve`, `w8a8_unservable`;
- memory and KV sizing: `memory_bytes`, `kv_block_bytes`, `kv_cache_budget`,
  `min_kv_cache_memory_bytes`, `context_length`, and the rules returning an error message as data
  (`kv_budget_memory_error`, `max_model_len_error`, `block_size_error`);
- loading: `load_model` (cached per process; quantized copies, the CPU kernels' layer swap), the
  W8A8 calibration (`w8a8_calibration`), `finish_sharded_quantization`.

Nothing here imports the `LLM` facade: the W8A8 calibration runs on an engine class its caller
passes in.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Optional

import torch

from .attention import bf16_kv, get_backend
from .attention.torch_quant_kv import TorchQuantKVAttentionBackend
from .attention.torch_ref import TorchAttentionBackend
from .config import EngineConfig
from .kv_cache import kv_layout
from .models.llama import LlamaModel
from .parallel.sharding import SINGLE, TPShard
from .tokenizer import Tokenizer
from .model_config import ModelConfig
from .weights import load_model_weights

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_KV_DEFAULT_CAP = 2 << 30  # bytes: a CPU engine's default KV budget is at most this


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


def model_string(source) -> str:
    """The `model` argument that resolves to `source` (a .gguf path, a folder, or dummy:<preset>)."""
    return f"dummy:{source.preset}" if source.kind == "dummy" else source.path


def cpu_kernels_serve(cpu_kernels: bool, device: str, dtype: torch.dtype, quantization: Optional[str] = None) -> bool:
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
    if dtype == torch.bfloat16 and cpu_kernels_serve(cpu_kernels, device, dtype, quantization):
        return torch.float32
    return dtype


def w8a8_unservable(cpu_kernels: bool, device: str, dtype: torch.dtype) -> Optional[str]:
    """Why quantization="w8a8" cannot run with these resolved settings, or None when it can (the CPU
    kernel library with fp32 on the CPU, or Triton on CUDA). The engine raises it at load, and a job
    before anything is written under `_job/`."""
    if device.startswith("cuda") or cpu_kernels_serve(cpu_kernels, device, dtype, "w8a8"):
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


def make_attention_backend(attention_backend: str, kv_cache_dtype: str, cpu_kernels: bool, dtype: torch.dtype,
                           weights_dtype: Optional[torch.dtype] = None, block_size: Optional[int] = None,
                           head_dim: Optional[int] = None):
    """(attention backend, KV cache storage dtype) for resolved engine settings (the driver and
    every tensor-parallel worker build theirs here): "fp16" IEEE halves (the float backends write
    `k.to(torch.float16)` and widen what they read), "fp32" fp32, "bf16" bf16 in the group layout
    that the bf16 dot-product unit reads in place (`engine.attention.bf16_kv`; CPU, the PyTorch
    backend), "int8" and "fp8_e4m3" codes with a scale per row (`TorchQuantKVAttentionBackend`).
    "auto" is "bf16" where bf16 weights run on the CPU kernels (`dtype`, the activations' dtype, is
    fp32 and `weights_dtype` bf16), the kernel library reads that cache on VDPBF16PS, and the KV
    shape suits it (`block_size` a multiple of 16, `head_dim` of 32); else the activations' dtype,
    fp16 for fp32 activations (`auto_kv_dtype`).

    Raises:
        ValueError: "bf16" with another attention backend, or with a block size that is not a
            multiple of 16.
    """
    if kv_cache_dtype in ("auto", "fp16", "fp32", "bf16"):
        backend = get_backend(attention_backend)
        grouped = type(backend) is TorchAttentionBackend
        if kv_cache_dtype == "bf16":
            if not grouped:
                raise ValueError(f"kv_cache_dtype='bf16' is the CPU's grouped bf16 cache (attention_backend "
                                 f"'torch' on the CPU), not for attention_backend {attention_backend!r}: use "
                                 f"kv_cache_dtype='auto'")
            if block_size is not None and block_size % bf16_kv.KV_GROUP:
                raise ValueError(f"kv_cache_dtype='bf16' keeps K/V in groups of {bf16_kv.KV_GROUP} slots: block_size "
                                 f"must be a multiple of {bf16_kv.KV_GROUP}, got {block_size}")
            kv_dtype = bf16_kv.STORAGE_DTYPE
        elif kv_cache_dtype == "auto" and grouped and auto_grouped_bf16(dtype, weights_dtype, cpu_kernels,
                                                                          block_size, head_dim):
            kv_dtype = bf16_kv.STORAGE_DTYPE
        else:
            kv_dtype = {"auto": auto_kv_dtype(dtype), "fp16": torch.float16, "fp32": torch.float32}[kv_cache_dtype]
    else:
        backend = TorchQuantKVAttentionBackend(kv_cache_dtype)
        kv_dtype = backend.storage_dtype
    if not cpu_kernels and hasattr(backend, "use_cpu_kernel"):
        backend.use_cpu_kernel = False
    return backend, kv_dtype


def auto_grouped_bf16(dtype: torch.dtype, weights_dtype: Optional[torch.dtype], cpu_kernels: bool,
                      block_size: Optional[int], head_dim: Optional[int]) -> bool:
    """Whether kv_cache_dtype="auto" keeps a grouped bf16 cache (see `make_attention_backend`): bf16
    weights with fp32 activations (the CPU kernels), a kernel library that reads that cache on
    VDPBF16PS, block_size a multiple of 16 and head_dim a multiple of 32."""
    if not (cpu_kernels and weights_dtype == torch.bfloat16 and dtype == torch.float32):
        return False
    if block_size is None or head_dim is None or block_size % bf16_kv.KV_GROUP or head_dim % 32 or head_dim > 256:
        return False
    from .kernels import cpu

    return cpu.available() and cpu.attention_bf16()


def auto_dtype(device: torch.device, quantization: Optional[str], cpu_kernels: bool) -> str:
    """What dtype="auto" resolves to: "bfloat16" on CUDA; on the CPU "bfloat16" where the host has a
    bf16 matrix unit (AMX-BF16 or AVX512-BF16: `engine.host.Host.auto_dtype`) and the CPU kernels
    serve unquantized bf16 weights, else "float32" (quantized weights compute in fp32 on the CPU)."""
    if device.type == "cuda":
        return "bfloat16"
    from .host import Host

    if (quantization in (None, "none") and Host.current().auto_dtype() == "bfloat16"
            and cpu_kernels_serve(cpu_kernels, device.type, torch.bfloat16)):
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
    return dev, DTYPES[dtype_name], backend


def attention_backend_error(cfg: EngineConfig) -> Optional[str]:
    """Why the settings' attention backend cannot run here, or None: Triton on the CPU runs only in its
    interpreter (TRITON_INTERPRET=1, for the kernel tests); without it Triton finds no driver and fails
    deep in its launcher. `LLM` raises it at load, a job before anything is written."""
    dev, _, backend = resolve_settings(cfg)
    if backend == "triton" and dev.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return ("attention_backend='triton' runs on CUDA (on the CPU only under TRITON_INTERPRET=1, for tests); "
                "use attention_backend='auto' or 'torch' on the CPU")
    return None


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
    backend, kv_dtype = make_attention_backend(backend_name, cfg.kv_cache_dtype, cfg.cpu_kernels, act, dtype,
                                               cfg.block_size, model_cfg.head_dim)
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


def context_bound(cfg: EngineConfig, model_cfg: ModelConfig, num_blocks: Optional[int] = None) -> str:
    """What sets `context_length(cfg, model_cfg, num_blocks)`, in words for an error message: the KV
    cache when it holds fewer tokens than the other bounds allow, else the token budget (without
    chunked prefill), the `max_model_len` option or the model's trained context, the tightest first."""
    length = context_length(cfg, model_cfg, num_blocks)
    trained = model_cfg.max_position_embeddings
    if length < context_length(dataclasses.replace(cfg, kv_cache_memory_bytes=None), model_cfg):
        budget = (f"kv_cache_memory_bytes={cfg.kv_cache_memory_bytes}" if cfg.kv_cache_memory_bytes is not None
                  else "the default share of memory")
        return f"what the KV cache holds ({budget}; raise it for longer prompts)"
    if not cfg.enable_chunked_prefill and length == cfg.max_num_batched_tokens < trained:
        return f"max_num_batched_tokens={cfg.max_num_batched_tokens}, without chunked prefill"
    if cfg.max_model_len is not None and cfg.max_model_len < trained:
        return f"the max_model_len={cfg.max_model_len} option"
    return "the model's trained context"


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




def num_kv_blocks(cfg: EngineConfig, model_cfg: ModelConfig, device: torch.device, per_block: int,
                  pages_per_block: int, worker_free: tuple[int, ...] = ()) -> int:
    """The KV blocks each rank of an engine with `cfg` allocates: its budget (`cfg.kv_cache_memory_bytes`,
    else `kv_cache_memory_fraction` of the free memory: on CUDA the least any rank has, `worker_free`
    being the other ranks' free bytes; on the CPU a share of the available memory, at most
    `CPU_KV_DEFAULT_CAP`, split over the ranks, which share it) divided by `per_block` bytes
    (`kv_block_bytes`, whose layers are `pages_per_block`).

    Raises:
        ValueError: `max_model_len_error`, `block_size_error` or `kv_budget_memory_error` applies, or the
            budget is smaller than one block (naming both).
    """
    budget = cfg.kv_cache_memory_bytes
    if budget is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            free = min((free, *worker_free))  # every rank's cache has the same blocks
            budget = int(free * cfg.kv_cache_memory_fraction)
        else:  # the ranks of a CPU engine share one memory
            budget = min(int(_available_memory_bytes() * cfg.kv_cache_memory_fraction),
                         CPU_KV_DEFAULT_CAP) // cfg.tensor_parallel_size
    problem = (max_model_len_error(cfg, model_cfg) or block_size_error(cfg, model_cfg)
               or kv_budget_memory_error(cfg, str(device)))
    if problem is not None:
        raise ValueError(problem)
    num_blocks = budget // per_block
    if num_blocks < 1:
        given = "" if cfg.kv_cache_memory_bytes is not None else " (the default share of free memory)"
        raise ValueError(
            f"kv_cache_memory_bytes={budget}{given} is smaller than one KV block ({per_block} bytes: "
            f"block_size={cfg.block_size} tokens x {pages_per_block} layers x K and V)"
        )
    return num_blocks


@functools.lru_cache(maxsize=4)
def w8a8_calibration(source_key, dtype: torch.dtype, device: str, seed: int, cpu_kernels: bool,
                     engine: type) -> dict[tuple[int, str], torch.Tensor]:
    """SmoothQuant's calibration statistics of a model (`smoothquant.calibration_absmax` on a
    dedicated fp32 engine), once per process and argument tuple, and kept on disk for the next
    process on this host (`engine.calibration_cache`; off with TOKENMILL_NO_DISK_CACHE=1).

    The calibration generates 200 seeded tokens for each calibration prompt (tens of seconds on 2
    cores) and its result is small (one vector per layer input, about 0.5 MB for SmolLM2-135M),
    so it is kept apart from `load_model`'s cache: a w8a8 model evicted from there (it keeps 4
    models) is rebuilt from these same statistics, without calibrating again. Callers must not
    modify the returned tensors (`smoothed_w8a8_copy` only reads them)."""
    from .calibration_cache import calibration_key, entry_path, read_stats, write_stats
    from .smoothquant import calibration_absmax

    try:
        key = calibration_key(source_key, dtype, device, seed, cpu_kernels)
        entry = entry_path(key)
    except OSError:  # the model's files cannot be stat'ed: no disk cache (loading it names the problem)
        key, entry = None, None
    if entry is not None and (kept := read_stats(entry, key)) is not None:
        return kept
    dtype_name = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
    # the model's own dtype in the cache too: the calibration text is sampled, and text sampled over an
    # fp16 cache diverges from the fp32 model's (SmolLM2-135M: W8A8 perplexity -0.24% of fp32 after
    # calibrating on fp32-cache text, +2.4% on fp16-cache text, tests/test_quant.py)
    calib = engine(model_string(source_key), dtype=dtype_name, device=device, seed=seed, cpu_kernels=cpu_kernels,
                   kv_cache_memory_bytes=256 << 20, max_num_seqs=16,
                   kv_cache_dtype="fp32" if dtype == torch.float32 else "auto")
    stats = calibration_absmax(calib)
    if entry is not None:
        write_stats(entry, key, stats)
    return stats


def load_model(source, dtype: torch.dtype, device: str, seed: int, quantization: Optional[str] = None,
               group_size: int = 32, cpu_kernels: bool = True, shard: TPShard = SINGLE, with_tokenizer: bool = True,
               calibration_engine: Optional[type] = None) -> tuple[LlamaModel, Optional[Tokenizer]]:
    """Load weights and tokenizer once per process; LLM instances share the read-only weights.

    `source` is a resolved model (`engine.weights.resolve_model`).
    `quantization` ("int8" | "int4" | "gguf" | "w8a8") builds a copy of the cached float model whose
    linear layers are swapped (`engine.quant.quantized_copy`); embedding and norms are shared.
    With `cpu_kernels` (fp32, or unquantized bf16 weights, on the CPU) the linear layers are then
    swapped for the CPU kernel library's (`engine.models.cpu_layers.use_cpu_kernels`; bf16 weights
    under an fp32 model) and the small ops run in C; without,
    the PyTorch reference ops run. With `shard`, the model holds one tensor-parallel rank's
    slices only (read so from the file; quantized from them); `with_tokenizer` False (a
    worker) skips the tokenizer and returns None for it. "w8a8" calibrates on an engine built by
    `calibration_engine` (the `LLM` class: `w8a8_calibration`). The cache key is the full argument
    tuple (`calibration_engine` only for "w8a8"), however the arguments were passed;
    `load_model.cache_clear()` empties it.

    Raises:
        ValueError: quantization="w8a8" where the CPU kernels cannot serve, with a shard, or without
            a calibration_engine.
    """
    return _load_model(source, dtype, device, seed, quantization, group_size, cpu_kernels, shard, with_tokenizer,
                       calibration_engine if quantization == "w8a8" else None)


@functools.lru_cache(maxsize=4)
def _load_model(source_key, dtype: torch.dtype, device: str, seed: int, quantization: Optional[str],
                group_size: int, cpu_kernels: bool, shard: TPShard, with_tokenizer: bool,
                calibration_engine: Optional[type]) -> tuple[LlamaModel, Optional[Tokenizer]]:
    """`load_model`, cached on its normalised argument tuple."""
    from .models.cpu_layers import use_cpu_kernels
    from .models.ops import TorchOps

    source = source_key
    use_c = cpu_kernels_serve(cpu_kernels, device, dtype, quantization)
    if quantization is not None:
        from .quant import quantized_copy

        problem = w8a8_unservable(cpu_kernels, device, dtype) if quantization == "w8a8" else None
        if problem is not None:
            raise ValueError(problem)
        if quantization == "w8a8" and shard.is_sharded:
            raise ValueError("quantization='w8a8' calibrates on the whole model in one process: it does not run "
                             "with tensor_parallel_size > 1 (int8, int4 and gguf do)")
        if quantization == "w8a8" and calibration_engine is None:
            raise ValueError("quantization='w8a8' needs a calibration_engine (the LLM class) to calibrate on")
        # the float model an unquantized engine with these settings loads: one cache entry for both
        base, tokenizer = load_model(source, dtype, device, seed, None, 32, cpu_kernels, shard, with_tokenizer)
        if quantization == "w8a8":  # SmoothQuant, calibrated on text the fp32 model writes itself
            from .smoothquant import smoothed_w8a8_copy

            return smoothed_w8a8_copy(base, w8a8_calibration(source, dtype, device, seed, cpu_kernels,
                                                             calibration_engine)), tokenizer
        gguf_path = source.path if quantization == "gguf" else None
        qmodel = quantized_copy(base, quantization, group_size, gguf_path)
        qmodel.ops = base.ops
        if cpu_kernels_serve(cpu_kernels, device, qmodel.dtype):  # (fp32 activations: also under bf16 weights)
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

    base, _ = load_model(source, dtype, device, seed, None, 32, cpu_kernels, shard, with_tokenizer)
    sync_row_parallel_int8(model, base, tp)


load_model.cache_clear = _load_model.cache_clear  # type: ignore[attr-defined]
