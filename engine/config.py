"""Engine and sampling configuration, with validation that names the bad parameter.

`EngineConfig` holds engine-level settings; a bad value raises `ValueError` at
construction (engine misconfiguration is the only thing allowed to raise).
`SamplingParams` holds one request's sampling settings; `SamplingParams.validate`
returns an error message instead of raising, so that one bad request becomes an
error output and never fails the batch.
"""
from __future__ import annotations

import dataclasses
import math
import reprlib
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from .structured.params import StructuredOutputsParams

SEED_MIN, SEED_MAX = -(1 << 63), (1 << 63) - 1
SEED_RANGE = "[-2**63, 2**63 - 1] (a 64-bit integer)"
"""The seeds the engine takes, an engine's (`EngineConfig.seed`), a request's (`SamplingParams.seed`)
and a job's alike: the sampler mixes a seed modulo 2**64 (`engine.input_processor.mix_seed`) and torch's
generators take 64 bits, so a larger seed would draw the same numbers as a smaller one."""


def seed_problem(name: str, value: Any, none_ok: bool = False) -> Optional[str]:
    """None for a seed in [SEED_MIN, SEED_MAX] (or None, when `none_ok`), else a message naming
    `name` and the range: `seed must be in [-2**63, 2**63 - 1] (a 64-bit integer), got 2**80`."""
    if value is None and none_ok:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        return f"{name} must be an integer{' or None' if none_ok else ''}, got {value!r}"
    if not SEED_MIN <= value <= SEED_MAX:
        return f"{name} must be in {SEED_RANGE}, got {value}"
    return None


SAMPLING_EPS = 1e-5
"""Temperatures below this are greedy (argmax), as vLLM's `_SAMPLING_EPS`: batch files send 0 or a tiny
value such as 1e-6 for "deterministic", and in that limit the distribution is the argmax; a draw at the
sampler's floor (`engine.sampler.MIN_TEMPERATURE`) would differ from greedy on near ties."""


# completions per prompt: n = 10**9 was accepted and built a Sequence per completion until memory ran out
MAX_N = 4096


SPECULATIVE_MODES = ("auto", "ngram", "suffix", "draft_model", "off", None)


def option(default: Any, help: str, *, changes_outputs: bool = False, choices: Optional[Sequence[Any]] = None,
           **rules: Any) -> Any:
    """An EngineConfig field that batch jobs take as an option of their own (`pipeline.spec.JobSpec`
    builds its engine fields, and the CLI its flags, from these).

    Args:
        default: the field's default.
        help: one line for a command's --help.
        changes_outputs: the value changes the tokens generated (a job fingerprints it, so a resume
            with another value is refused); speed-only options leave it False.
        choices: the values it may take (None among them: unset), where it is one of a few.
        rules: bounds the value must keep, as pydantic `Field` takes them (`ge=1`).
    """
    return field(default=default, metadata={"help": help, "changes_outputs": changes_outputs, "choices": choices,
                                            "rules": rules})


def declared_options() -> dict[str, dataclasses.Field]:
    """The EngineConfig fields declared with `option`, by name, in declaration order."""
    return {f.name: f for f in dataclasses.fields(EngineConfig) if "help" in f.metadata}


@dataclass
class EngineConfig:
    """Engine-level settings (vLLM-style names).

    Attributes:
        model: "smollm2-135m-instruct", a path to a .gguf file, a Hugging Face
            folder (config.json + *.safetensors + tokenizer files), or
            "dummy:<shape>" (random weights of a named real shape).
        dtype: "float32" | "bfloat16" | "float16" | "auto" (fp32 on CPU, bf16 on CUDA).
        device: "cpu" | "cuda" | "auto".
        block_size: tokens per KV block.
        kv_cache_memory_bytes: bytes for the K and V caches of all layers; None
            means derive from `kv_cache_memory_fraction`.
        kv_cache_memory_fraction: fraction of free device memory (CUDA) or of
            available RAM (CPU) given to the KV cache when no byte budget is set.
        max_num_seqs: most requests running at once (128: a decode step reads every weight
            once whatever the batch, so offline throughput grows with the batch; see the
            README sweep for the knee on this CPU).
        max_num_batched_tokens: the per-step token budget (prefill + decode tokens).
        max_model_len: longest sequence (prompt + output) in tokens; None means
            the model's trained context length.
        enable_chunked_prefill: spread long prompts over several steps.
        enable_prefix_caching: reuse KV blocks of identical prefixes.
        seed: engine seed; requests without their own seed draw from
            generators derived from it, so a run is reproducible. A 64-bit integer
            ([-2**63, 2**63 - 1], `SEED_RANGE`).
        num_threads: CPU threads of both PyTorch's pool and the C kernel library's
            (None: TOKENMILL_NUM_THREADS, else the CPUs this process may use; see
            `engine.threads`).
        quantization: None or "none" (weights as loaded) | "int8" (weight-only,
            per-output-channel) | "int4" (weight-only, groups of
            `quant_group_size` with scale and min) | "gguf" (keep a GGUF
            file's own quantized blocks) | "w8a8" (int8 weights per output
            channel x int8 activations per token, integer arithmetic; CPU
            kernels only). See `engine.quant`.
        quant_group_size: int4 group size, 32 | 64 | 128.
        kv_cache_dtype: "auto" ("bf16" where bf16 weights run on a CPU with
            a bf16 unit; else the model dtype, except fp16 for an fp32
            model, as on the CPU: `engine.loader.make_attention_backend` and
            `auto_kv_dtype` say why) |
            "fp16" (IEEE half: half the bytes of an fp32 cache, read and
            widened to fp32 by the CPU kernels; llama.cpp's default KV type) |
            "fp32" (exact: greedy parity with transformers in fp32) | "bf16"
            (CPU: bf16 laid out for the bf16 dot-product unit, which reads it
            in place, `engine.attention.bf16_kv`; block_size a multiple of 16) |
            "int8" (per-token per-head scale) | "fp8_e4m3" (CUDA only).
        attention_backend: "auto" (Triton kernels on CUDA, the PyTorch
            reference on CPU) | "torch" | "triton" (on CPU only under
            TRITON_INTERPRET=1, for tests).
        enforce_eager: never capture CUDA graphs (debugging); otherwise decode
            steps on CUDA replay graphs captured per batch-size bucket.
        cpu_kernels: on the CPU in fp32, run linear layers, norms, RoPE, the KV
            write and decode attention in tokenmill's C kernel library
            (`engine.kernels.cpu`, built on first use); False runs the PyTorch
            reference ops (as does a machine without a C compiler).
        speculative: speculative decoding: "auto" (the default: drafts from
            prompt lookup and the job's earlier outputs, as many per sequence as
            the measured step cost makes worth it, none when the batch already
            saturates the machine), "ngram" | "suffix" | "draft_model" (that
            proposer, `num_speculative_tokens` drafts whenever it has some), or
            None / "off". See `engine.spec_decode`.
        speculative_config: vLLM-style settings that override `speculative`: a
            dict of `SpeculativeConfig` fields (method, num_speculative_tokens,
            prompt_lookup_min, prompt_lookup_max, suffix_max_tokens,
            suffix_max_depth, draft_model).
        tensor_parallel_size: ranks the model is split over (Megatron-style tensor parallelism,
            `engine.parallel`): this process and N - 1 worker processes, gloo on the CPU,
            NCCL on CUDA (one device per rank). N must divide the model's KV heads.
            `kv_cache_memory_bytes` is then each rank's budget; `num_threads` each rank's
            threads (default: the CPUs split between the ranks).
        distributed_timeout_s: how long a tensor-parallel collective waits for a peer before
            it raises (a dead worker is detected within seconds regardless).
        structured_outputs_jump_forward: for constrained requests, append the tokens the
            grammar forces (its only legal continuation) without sampling each of them: a
            forced start with the prompt in the prefill, a forced run in the next step's
            forward pass as one chunk, and the end token of a complete grammar with no
            forward pass at all (counted in `EngineStats.structured_forced_tokens`). See
            `engine.core` and `engine.structured`.
        structured_outputs_backend: the grammar engine: "llguidance" (the default) or
            "xgrammar" (optional: `pip install 'tokenmill[xgrammar]'`; no end-token
            jump-forward, see `engine.structured.xgrammar_backend`).

    Raises:
        ValueError: naming the parameter, for any out-of-range value.
    """

    model: str = "smollm2-135m-instruct"
    dtype: str = option("auto", "weights dtype: auto | float32 | bfloat16 | float16 (auto: bf16 on CUDA and on CPUs "
                               "with AMX-BF16 or AVX512-BF16, else fp32; a resume keeps the dtype the job's "
                               "manifest recorded)", changes_outputs=True)
    device: str = option("auto", "auto | cpu | cuda | cuda:N")
    block_size: int = 16
    kv_cache_memory_bytes: Optional[int] = option(None, "bytes for the KV cache (default: a share of free memory)")
    kv_cache_memory_fraction: float = 0.25
    max_num_seqs: int = option(128, "most requests running at once")
    max_num_batched_tokens: int = option(1024, "per-step token budget")
    max_model_len: Optional[int] = option(None, "context length in tokens (default: the model's)",
                                          changes_outputs=True)
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = option(True, "reuse KV blocks of shared prefixes")
    seed: int = option(0, "engine seed: sampled runs are reproducible (a 64-bit integer, as a row's seed)",
                       changes_outputs=True)
    quantization: Optional[str] = option(None, "weight quantization: none | int8 | int4 | gguf | w8a8 (int8 x int8 "
                                               "arithmetic: CPU kernels, CUDA Triton) (default none)", changes_outputs=True)
    num_threads: Optional[int] = option(None, "CPU threads of torch and the C kernels (default: the CPUs this "
                                              "process may use)")
    quant_group_size: int = 32
    kv_cache_dtype: str = "auto"
    attention_backend: str = "auto"
    enforce_eager: bool = False
    cpu_kernels: bool = True
    speculative: Optional[str] = option("auto", "speculative decoding: auto (the engine default: drafts where the "
                                                "measured step cost makes them pay) | ngram | suffix | draft_model | "
                                                "off", choices=SPECULATIVE_MODES)
    speculative_config: Optional[dict] = None
    structured_outputs_jump_forward: bool = True
    structured_outputs_backend: str = "llguidance"
    tensor_parallel_size: int = option(1, "split the model over N devices (tensor parallelism; N processes, gloo on "
                                          "CPU, NCCL on CUDA); N must divide the model's KV heads", ge=1)
    distributed_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("model must be a non-empty string")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto|float32|bfloat16|float16, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise ValueError(f"device must be auto|cpu|cuda, got {self.device!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if (problem := seed_problem("seed", self.seed)) is not None:
            raise ValueError(problem)
        for name in ("enable_prefix_caching", "enable_chunked_prefill"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.num_threads is not None and (
                not isinstance(self.num_threads, int) or isinstance(self.num_threads, bool) or self.num_threads <= 0):
            raise ValueError(f"num_threads must be a positive integer or None (the default: TOKENMILL_NUM_THREADS, "
                             f"else the CPUs this process may use), got {self.num_threads!r}")
        if not isinstance(self.distributed_timeout_s, (int, float)) or not self.distributed_timeout_s > 0:
            raise ValueError(f"distributed_timeout_s must be a positive number, got {self.distributed_timeout_s!r}")
        if self.kv_cache_memory_bytes is not None and (
            not isinstance(self.kv_cache_memory_bytes, int) or self.kv_cache_memory_bytes <= 0
        ):
            raise ValueError(f"kv_cache_memory_bytes must be a positive integer, got {self.kv_cache_memory_bytes!r}")
        if not (0.0 < self.kv_cache_memory_fraction <= 1.0):
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len <= 1):
            raise ValueError(f"max_model_len must be an integer > 1, got {self.max_model_len!r}")
        if self.quantization not in (None, "none", "int8", "int4", "gguf", "w8a8"):
            raise ValueError(f"quantization must be None or none|int8|int4|gguf|w8a8, got {self.quantization!r}")
        if self.quant_group_size not in (32, 64, 128):
            raise ValueError(f"quant_group_size must be 32, 64 or 128, got {self.quant_group_size!r}")
        if self.structured_outputs_backend not in ("llguidance", "xgrammar"):
            raise ValueError(f"structured_outputs_backend must be llguidance|xgrammar, got "
                             f"{self.structured_outputs_backend!r}")
        if self.kv_cache_dtype not in ("auto", "fp16", "fp32", "bf16", "int8", "fp8_e4m3"):
            raise ValueError(f"kv_cache_dtype must be auto|fp16|fp32|bf16|int8|fp8_e4m3, got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype == "bf16" and self.block_size % 16:
            raise ValueError(f"kv_cache_dtype='bf16' keeps K/V in groups of 16 slots: block_size must be a multiple "
                             f"of 16, got {self.block_size}")
        if self.kv_cache_dtype == "bf16" and (self.attention_backend == "triton" or str(self.device).startswith("cuda")):
            raise ValueError("kv_cache_dtype='bf16' is the CPU's grouped bf16 cache (attention_backend 'torch' on the "
                             "CPU); on CUDA or with attention_backend='triton' use kv_cache_dtype='auto'")
        if self.kv_cache_dtype == "fp8_e4m3" and self.device == "cpu":
            raise ValueError("kv_cache_dtype='fp8_e4m3' needs a CUDA device (no fp8 arithmetic on this CPU); "
                             "use kv_cache_dtype='int8' on CPU")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"attention_backend must be auto|torch|triton, got {self.attention_backend!r}")
        if self.speculative not in SPECULATIVE_MODES:
            raise ValueError(f"speculative must be one of {[m for m in SPECULATIVE_MODES if m]} or None, "
                             f"got {self.speculative!r}")
        if self.speculative_config is not None:
            if self.speculative in (None, "off"):
                raise ValueError("speculative_config was given with speculative=None/'off': drop one "
                                 "(speculative_config alone turns speculation on with its method)")
            if not isinstance(self.speculative_config, dict):
                raise ValueError(f"speculative_config must be a dict of SpeculativeConfig fields, got "
                                 f"{type(self.speculative_config).__name__}")
            SpeculativeConfig.from_dict(self.speculative_config)  # raises naming the bad field
        if not self.enable_chunked_prefill and self.max_model_len is not None and self.max_model_len > self.max_num_batched_tokens:
            raise ValueError(
                "with enable_chunked_prefill=False, max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len})"
            )




@dataclass
class SpeculativeConfig:
    """Speculative decoding settings (vLLM's `speculative_config` names where they exist).

    Attributes:
        method: "auto" (adaptive: prompt lookup, then the job-wide suffix index, draft
            lengths chosen per step for goodput), or one proposer, "ngram" (prompt
            lookup), "suffix" (the job's earlier texts) or "draft_model", drafting
            `num_speculative_tokens` whenever it has drafts.
        num_speculative_tokens: most draft tokens per sequence and step.
        prompt_lookup_min / prompt_lookup_max: n-gram lengths of prompt lookup.
        suffix_max_tokens: tokens the job-wide suffix index holds (oldest evicted first).
        suffix_max_depth: longest context the suffix index matches, in tokens.
        draft_model: for method "draft_model": "self:<m>" (the target's first m layers
            with its final norm and LM head, LayerSkip-style), "target" (the target
            itself: every draft is accepted; for tests), or a model string sharing the
            target's tokenizer.

    Raises:
        ValueError: naming the field, for a bad value.
    """

    method: str = "auto"
    num_speculative_tokens: int = 6
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    suffix_max_tokens: int = 32768
    suffix_max_depth: int = 6
    draft_model: Optional[str] = None

    def __post_init__(self) -> None:
        if self.method not in ("auto", "ngram", "suffix", "draft_model"):
            raise ValueError(f"speculative_config.method must be auto|ngram|suffix|draft_model, got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "suffix_max_tokens",
                     "suffix_max_depth"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"speculative_config.{name} must be a positive integer, got {v!r}")
        if self.num_speculative_tokens > 16:
            raise ValueError(f"speculative_config.num_speculative_tokens must be <= 16, got "
                             f"{self.num_speculative_tokens}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        if self.method == "draft_model":
            d = self.draft_model or "self:8"
            if not isinstance(d, str) or (d.startswith("self:") and not d[5:].isdigit()):
                raise ValueError(f"speculative_config.draft_model must be 'self:<layers>', 'target' or a model, got {d!r}")
            self.draft_model = d

    @classmethod
    def from_dict(cls, d: dict) -> "SpeculativeConfig":
        """From a dict of fields; unknown keys are named in the error."""
        known = {f for f in cls.__dataclass_fields__}
        bad = sorted(set(d) - known)
        if bad:
            raise ValueError(f"unknown speculative_config field(s) {bad}; known: {sorted(known)}")
        return cls(**d)

    @classmethod
    def resolve(cls, speculative: Optional[str], speculative_config: Optional[dict]) -> Optional["SpeculativeConfig"]:
        """The settings `EngineConfig.speculative` / `speculative_config` mean (None: off)."""
        if speculative_config is not None:
            return cls.from_dict(speculative_config)
        if speculative in (None, "off"):
            return None
        return cls(method=speculative)


@dataclass
class SamplingParams:
    """Per-request sampling settings (the fields and meanings of vLLM's SamplingParams).

    Attributes:
        n: number of completions for the prompt, 1 to MAX_N (4096).
        temperature: below `SAMPLING_EPS` (1e-5; 0 included) means greedy (argmax), token for
            token; otherwise logits are divided by it, raised to 0.01 when it is smaller (as vLLM
            does: logits divided by 1e-39 overflow fp32; `engine.sampler.MIN_TEMPERATURE`).
        top_p: nucleus sampling mass in (0, 1] (Holtzman et al. 2019, arXiv 1904.09751).
        top_k: keep the k most likely tokens; -1 or 0 keeps all.
        min_p: drop tokens whose probability is below min_p x the top probability.
        seed: per-request seed; the same seed gives the same tokens whatever
            else is in the batch. With n > 1 the seed covers the whole set. Any 64-bit integer
            ([-2**63, 2**63 - 1], `SEED_RANGE`: the sampler uses 64 bits of it), negative ones
            too; -1 means None (no seed of its own: the request draws from the engine's seed),
            as in vLLM.
        max_tokens: most new tokens per completion.
        min_tokens: EOS and stop token ids are suppressed until this many tokens.
        stop: strings that end the completion; the text is cut before them.
        stop_token_ids: extra token ids that end the completion.
        ignore_eos: keep generating past EOS.
        repetition_penalty: CTRL-style penalty (Keskar et al. 2019) on tokens
            in the prompt or output; 1.0 is off.
        presence_penalty / frequency_penalty: OpenAI-style additive penalties
            on output tokens; 0.0 is off.
        logprobs: number of top log-probabilities returned per generated token.
        prompt_logprobs: number of top log-probabilities returned per prompt token (with the
            prompt's own token; 0: only that one), in `RequestOutput.prompt_logprobs`. They
            come from a scoring pass over the prompt before generation (one more prefill).
        skip_special_tokens: drop special tokens from the text.
        structured_outputs: a `StructuredOutputsParams` (json / regex / choice / grammar /
            json_object) the output must match, or None; a dict of its fields is accepted.
            A constraint that does not compile makes the request an error output.
        score_choices: instead of generating, score each of these strings as the completion
            (log-probability of its tokens given the prompt); the output's `label` is the most
            likely one and `label_logprobs` maps each choice to its log-probability.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: Optional[int] = None
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    stop: Optional[Sequence[str] | str] = None
    stop_token_ids: Optional[Sequence[int]] = None
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    skip_special_tokens: bool = True
    structured_outputs: Optional[StructuredOutputsParams] = None
    score_choices: Optional[Sequence[str]] = None

    def __post_init__(self) -> None:
        if isinstance(self.seed, int) and not isinstance(self.seed, bool) and self.seed == -1:
            self.seed = None  # vLLM's convention: -1 is no seed of its own
        so = self.structured_outputs
        if isinstance(so, dict) and set(so) <= set(StructuredOutputsParams.__dataclass_fields__):
            self.structured_outputs = StructuredOutputsParams(**so)
        if isinstance(self.score_choices, tuple):
            self.score_choices = list(self.score_choices)
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            try:
                self.stop = list(self.stop)
            except TypeError:  # not a sequence (stop=5): validate() names it
                pass
        self.stop_token_ids = list(self.stop_token_ids) if self.stop_token_ids else []

    @property
    def greedy(self) -> bool:
        """True when decoding is argmax (temperature below `SAMPLING_EPS`, 0 included, or top_k 1)."""
        t = self.temperature
        return (isinstance(t, (int, float)) and 0 <= t < SAMPLING_EPS) or self.top_k == 1

    def validate(self, vocab_size: Optional[int] = None) -> Optional[str]:
        """Check every field; return None if valid, else a message naming the parameter.

        Never raises: the engine turns a message into a `finish_reason="error"` output.
        """

        def is_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        if not is_int(self.n) or self.n < 1:
            return f"n must be an integer >= 1, got {self.n!r}"
        if self.n > MAX_N:
            return f"n must be at most {MAX_N:,} (completions per prompt), got {self.n:,}"
        if not is_num(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            return f"temperature must be a finite number >= 0, got {self.temperature!r}"
        if not is_num(self.top_p) or math.isnan(self.top_p) or not (0.0 < self.top_p <= 1.0):
            return f"top_p must be in (0, 1], got {self.top_p!r}"
        if not is_int(self.top_k) or self.top_k < -1:
            return f"top_k must be -1, 0 (all) or a positive integer, got {self.top_k!r}"
        if not is_num(self.min_p) or math.isnan(self.min_p) or not (0.0 <= self.min_p <= 1.0):
            return f"min_p must be in [0, 1], got {self.min_p!r}"
        if (problem := seed_problem("seed", self.seed, none_ok=True)) is not None:
            return problem
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            return f"max_tokens must be an integer >= 1, got {self.max_tokens!r}"
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            return f"min_tokens must be an integer >= 0, got {self.min_tokens!r}"
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            return f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
        problem = stop_strings_error(self.stop)
        if problem is not None:
            return problem
        for t in self.stop_token_ids:
            if not is_int(t) or t < 0 or (vocab_size is not None and t >= vocab_size):
                return f"stop_token_ids contains unknown token id {t!r} (vocab size {vocab_size})"
        if not is_num(self.repetition_penalty) or math.isnan(self.repetition_penalty) or self.repetition_penalty <= 0:
            return f"repetition_penalty must be > 0, got {self.repetition_penalty!r}"
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not is_num(v) or math.isnan(v) or not (-2.0 <= v <= 2.0):
                return f"{name} must be in [-2, 2], got {v!r}"
        if self.logprobs is not None and (not is_int(self.logprobs) or self.logprobs < 0 or self.logprobs > 20):
            return f"logprobs must be an integer in [0, 20] or None, got {self.logprobs!r}"
        pl = self.prompt_logprobs
        if pl is not None and (not is_int(pl) or pl < 0 or pl > 20):
            return f"prompt_logprobs must be an integer in [0, 20] or None, got {pl!r}"
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                return (f"structured_outputs must be a StructuredOutputsParams (or a dict of its fields), got "
                        f"{self.structured_outputs!r}")
            problem = self.structured_outputs.validate()
            if problem is not None:
                return problem
        if self.score_choices is not None:
            sc = self.score_choices
            if not isinstance(sc, list) or not sc or not all(isinstance(c, str) and c for c in sc):
                return f"score_choices must be a non-empty list of non-empty strings, got {sc!r}"
            dup = sorted({c for c in sc if sc.count(c) > 1})
            if dup:
                return f"score_choices: duplicate choice(s) {dup}"
            if self.structured_outputs is not None:
                return "score_choices and structured_outputs cannot both be set (scoring generates nothing)"
            if self.n != 1:
                return f"score_choices needs n == 1, got n={self.n}"
        return None


def prompt_type_error(prompt: Any) -> Optional[str]:
    """The rule for a prompt's type: None for a string, else the error message.

    A null prompt (None) is `prompt is null`; any other non-string (an int, a float, a dict) is
    `prompt must be a string, got int 12345`. The same function decides for `LLM.generate` (an error
    output) and for a job's row (an error row), so both refuse the same prompts with the same words;
    `LLM.generate` also takes a list of token ids, which it checks before asking this (a flat list
    of ints given as `prompts` is one such prompt, as in vLLM: its ints never reach this rule as
    prompts of their own).
    """
    if isinstance(prompt, str):
        return None
    if prompt is None:
        return "prompt is null"
    return f"prompt must be a string, got {type(prompt).__name__} {reprlib.repr(prompt)}"


def stop_strings_error(stop: Any) -> Optional[str]:
    """The rule for `stop`: None for a list of non-empty strings, else the error message.

    Args:
        stop: the stop strings as `SamplingParams` holds them (a single string already made a
            list of one, so `stop=""` arrives as `[""]`).

    An empty stop string would end every completion before its first character:
    `stop cannot contain an empty string ('')`. `SamplingParams.validate` (the API, a job's
    `--stop`) and a job row's `stop` column both apply it, in the same words.
    """
    if not isinstance(stop, (list, tuple)):
        return f"stop must be a string or a list of strings, got {type(stop).__name__} {reprlib.repr(stop)}"
    for s in stop:
        if not isinstance(s, str):
            return f"stop must be a string or a list of strings, got {type(s).__name__} {reprlib.repr(s)} in the list"
        if s == "":
            return "stop cannot contain an empty string ('')"
    return None


def prompt_text_error(prompt: str) -> Optional[str]:
    """The rule for a text prompt before tokenization: None if it may run, else the error message.

    An empty or all-blank prompt (`""`, `"   "`, `"\\n\\t"`) is refused: `prompt is empty`. The same
    function decides for `LLM.generate` (an error output) and for a job's row (an error row), so both
    refuse the same prompts with the same words.
    """
    if not prompt.strip():
        return "prompt is empty"
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate ("\ud800"): no tokenizer can take it
        return (f"prompt is not valid Unicode text ({exc.object[exc.start]!r} at character {exc.start}: "
                f"{exc.reason})")
    return None


def prompt_length_error(num_prompt_tokens: int, max_model_len: int, bound: Optional[str] = None) -> Optional[str]:
    """The context rule for a tokenized prompt: None if it leaves room for output, else the error message.

    Args:
        num_prompt_tokens: the prompt's length in tokens (chat template and special tokens included).
        max_model_len: the engine's context length in tokens.
        bound: what sets that length, in words (`engine.loader.context_bound`), so the message names
            the setting to change; None leaves it out.

    A prompt must be shorter than the context (`num_prompt_tokens < max_model_len`), so that at
    least one output token fits. `LLM.generate` and a job's rows (`pipeline.schema.length_rule`)
    both apply it.
    """
    if num_prompt_tokens >= max_model_len:
        why = f", set by {bound}" if bound else ""
        return (f"prompt is too long: {num_prompt_tokens} tokens, and the engine's context (max_model_len) is "
                f"{max_model_len} tokens{why}, which leaves no room for output")
    return None
