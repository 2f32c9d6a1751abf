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
import os
import time
import weakref
from typing import Iterator, Optional, Sequence as Seq, Union

import torch

from .attention import get_backend
from .attention.torch_quant_kv import TorchQuantKVAttentionBackend
from .config import EngineConfig, SamplingParams, SpeculativeConfig
from .core import EngineCore
from .kv_cache import BlockPool, KVCache
from .metrics import EngineStats
from .model_runner import ChunkSpec, ModelRunner
from .models.llama import LlamaModel
from .outputs import CompletionOutput, RequestMetrics, RequestOutput
from .request import Request, Sequence
from .sampler import Sampler
from .scheduler import Scheduler
from .spec_decode import SpecDecoder
from .threads import apply_num_threads
from .tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer
from .weights import DEFAULT_MODEL, load_model_weights, resolve_model

PromptType = Union[str, list[int]]
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_CPU_KV_DEFAULT_CAP = 2 << 30  # bytes


class _BadPrompt:
    """A prompt already known to be invalid (e.g. malformed chat messages)."""

    def __init__(self, message: str) -> None:
        self.message = message


def _mix_seed(base: int, index: int) -> int:
    """Deterministic 63-bit seed of completion `index` of a request seeded with `base`."""
    x = (base * 6364136223846793005 + (index + 1) * 1442695040888963407) & ((1 << 64) - 1)
    x ^= x >> 29
    return x & ((1 << 63) - 1)


def _available_memory_bytes() -> int:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 8 << 30


def _model_string(source) -> str:
    """The `model` argument that resolves to `source` (a .gguf path, a folder, or dummy:<preset>)."""
    return f"dummy:{source.preset}" if source.kind == "dummy" else source.path


def _cpu_kernels_serve(cpu_kernels: bool, device: str, dtype: torch.dtype) -> bool:
    """Whether the CPU kernel library runs a model: asked for, fp32 on the CPU, and it builds."""
    if not cpu_kernels or device != "cpu" or dtype != torch.float32:
        return False
    from .kernels import cpu

    return cpu.available()


@functools.lru_cache(maxsize=4)
def _load_model(source_key, dtype: torch.dtype, device: str, seed: int, quantization: Optional[str] = None,
                group_size: int = 32, cpu_kernels: bool = True) -> tuple[LlamaModel, Tokenizer]:
    """Load weights and tokenizer once per process; LLM instances share the read-only weights.
    `quantization` ("int8" | "int4" | "gguf" | "w8a8") builds a copy of the cached float model whose
    linear layers are swapped (`engine.quant.quantized_copy`); embedding and norms are shared.
    With `cpu_kernels` (fp32 on the CPU) the linear layers are then swapped for the CPU kernel
    library's (`engine.kernels.cpu.layers.use_cpu_kernels`) and the small ops run in C; without,
    the PyTorch reference ops run.

    Raises:
        ValueError: quantization="w8a8" where the CPU kernels cannot serve.
    """
    from .kernels.cpu.layers import use_cpu_kernels
    from .models.ops import TorchOps

    source = source_key
    use_c = _cpu_kernels_serve(cpu_kernels, device, dtype)
    if quantization is not None:
        from .quant import quantized_copy

        if quantization == "w8a8" and not (use_c or device.startswith("cuda")):
            raise ValueError("quantization='w8a8' runs on the CPU kernels (fp32 on the CPU, cpu_kernels=True and "
                             "a C compiler: see engine.kernels.cpu) or on CUDA (Triton)")
        # the same argument tuple as LLM.__init__'s float load, so both hit one cache entry
        base, tokenizer = _load_model(source, dtype, device, seed, None, 32, cpu_kernels)
        if quantization == "w8a8":  # SmoothQuant, calibrated on text the fp32 model writes itself
            from .smoothquant import calibration_absmax, smoothed_w8a8_copy

            dtype_name = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
            calib = LLM(_model_string(source), dtype=dtype_name, device=device, seed=seed, cpu_kernels=cpu_kernels,
                        kv_cache_memory_bytes=256 << 20, max_num_seqs=16)
            return smoothed_w8a8_copy(base, calibration_absmax(calib)), tokenizer
        gguf_path = source.path if quantization == "gguf" else None
        qmodel = quantized_copy(base, quantization, group_size, gguf_path)
        qmodel.ops = base.ops
        if use_c:
            use_cpu_kernels(qmodel)
        return qmodel, tokenizer
    mcfg, state = load_model_weights(source)
    if source.kind == "gguf":
        tokenizer = Tokenizer.from_gguf(source.path)
    elif source.kind == "hf":
        tokenizer = Tokenizer.from_pretrained(source.path)
    else:
        tokenizer = Tokenizer.default()
    model = LlamaModel(mcfg, dtype, torch.device(device))
    if state is None:
        model.init_dummy(seed)
    else:
        model.load_weights(state)
        del state
    if use_c:
        use_cpu_kernels(model)
    elif model.ops.name == "cpu":
        model.ops = TorchOps()
    return model, tokenizer


class LLM:
    """Offline batch generation.

    Args:
        model: "smollm2-135m-instruct" (default), a .gguf path, a Hugging Face
            folder, or "dummy:<shape>" (see `engine.weights.PRESETS`).
        **engine_kwargs: fields of `EngineConfig` (dtype, device, block_size,
            kv_cache_memory_bytes, kv_cache_memory_fraction, max_num_seqs,
            max_num_batched_tokens, max_model_len, enable_chunked_prefill,
            enable_prefix_caching, seed, num_threads).

    Raises:
        ValueError: unknown model, unknown or invalid engine kwargs.
        FileNotFoundError: the default model's wheel is not installed.
    """

    def __init__(self, model: str = DEFAULT_MODEL, **engine_kwargs) -> None:
        known = {f.name for f in dataclasses.fields(EngineConfig)} - {"model"}
        unknown = sorted(set(engine_kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine argument(s) {unknown}; known: {sorted(known)}")
        self.config = cfg = EngineConfig(model=model, **engine_kwargs)
        if self.config.device in ("auto", "cpu"):
            apply_num_threads(cfg.num_threads)  # PyTorch's and the C kernels' pools alike (engine/threads.py)
        elif cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        dev = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        self.device = torch.device(dev)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but no CUDA device is available")
        dtype_name = cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if self.device.type == "cuda" else "float32")
        self.dtype = _DTYPES[dtype_name]
        self.device_name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        self.attention_backend = cfg.attention_backend if cfg.attention_backend != "auto" else (
            "triton" if self.device.type == "cuda" else "torch")

        source = resolve_model(model)
        quant = None if cfg.quantization in (None, "none") else cfg.quantization
        if quant == "gguf" and source.kind != "gguf":
            raise ValueError(f"quantization='gguf' needs a .gguf model, got {model!r} ({source.kind})")
        if cfg.kv_cache_dtype == "fp8_e4m3" and self.device.type != "cuda":
            raise ValueError("kv_cache_dtype='fp8_e4m3' needs a CUDA device (no fp8 arithmetic on this CPU); "
                             "use kv_cache_dtype='int8' on CPU")
        t0 = time.perf_counter()
        self.model, self.tokenizer = _load_model(source, self.dtype, str(self.device), cfg.seed, quant,
                                                 cfg.quant_group_size if quant == "int4" else 32, cfg.cpu_kernels)
        mcfg = self.model_config = self.model.cfg
        self.load_time_s = time.perf_counter() - t0

        # KV cache sized from the memory budget
        bs = cfg.block_size
        if cfg.kv_cache_dtype == "auto":
            self.backend, kv_dtype = get_backend(self.attention_backend), self.dtype
        else:
            self.backend = TorchQuantKVAttentionBackend(cfg.kv_cache_dtype)
            kv_dtype = self.backend.storage_dtype
        if not cfg.cpu_kernels and hasattr(self.backend, "use_cpu_kernel"):
            self.backend.use_cpu_kernel = False
        per_block = 2 * mcfg.num_layers * kv_dtype.itemsize * math.prod(
            self.backend.cache_shape(1, bs, mcfg.num_kv_heads, mcfg.head_dim))
        budget = cfg.kv_cache_memory_bytes
        if budget is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                budget = int(free * cfg.kv_cache_memory_fraction)
            else:
                budget = min(int(_available_memory_bytes() * cfg.kv_cache_memory_fraction), _CPU_KV_DEFAULT_CAP)
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory_bytes={budget} is smaller than one KV block ({per_block} bytes)"
            )
        max_len = min(cfg.max_model_len or mcfg.max_position_embeddings, mcfg.max_position_embeddings)
        # a sequence may never need more blocks than the whole pool holds
        self.max_model_len = min(max_len, num_blocks * bs)
        shape = self.backend.cache_shape(num_blocks, bs, mcfg.num_kv_heads, mcfg.head_dim)
        self.kv_cache = KVCache(mcfg, num_blocks, bs, kv_dtype, self.device, shape)
        self.kv_bytes_per_token = per_block // bs  # K and V, all layers, scales included
        self.kv_capacity_tokens = num_blocks * bs
        self.block_pool = BlockPool(num_blocks, cfg.enable_prefix_caching)
        self.model._rope_tables(self.max_model_len + 1)  # the forward never resizes them on a device
        self.runner = ModelRunner(self.model, self.kv_cache, self.backend)
        if not cfg.enable_chunked_prefill:
            self.max_model_len = min(self.max_model_len, cfg.max_num_batched_tokens)
        self.sampler = Sampler(self.tokenizer.vocab_size, self.tokenizer.eos_token_ids)
        spec_cfg = SpeculativeConfig.resolve(cfg.speculative, cfg.speculative_config)
        self.spec = None
        if spec_cfg is not None:
            def draft_factory():
                from .spec_decode import DraftModelProposer

                return DraftModelProposer(self.model, spec_cfg.draft_model, num_blocks, bs, self.backend, kv_dtype,
                                          self.sampler)

            core_ref = []  # filled below; no reference back to this LLM, so dropping it frees the KV cache at once

            def profile(n: int, ctx: int) -> float:
                return core_ref[0].profile_step(n, ctx)

            self.spec = SpecDecoder(spec_cfg, self.max_model_len, draft_factory, profile=profile)
        self.scheduler = Scheduler(self.block_pool, bs, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                   cfg.enable_chunked_prefill, self.spec)
        if self.device.type == "cuda" and not cfg.enforce_eager and getattr(self.backend, "supports_cuda_graphs", False):
            from .cuda_graph import DecodeCudaGraphs  # decode steps replayed from graphs per batch bucket

            self.runner.cuda_graphs = DecodeCudaGraphs(self.model, self.kv_cache.layers, self.backend,
                                                       cfg.max_num_seqs, self.max_model_len, bs)
        self.core = EngineCore(self.scheduler, self.runner, self.sampler, self.max_model_len, self.spec)
        if self.spec is not None:
            core_ref.append(weakref.proxy(self.core))
        self._seq_counter = 0
        self._request_counter = 0

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
        nblocks = -(-len(prompt_token_ids) // self.config.block_size)
        if nblocks > self.num_free_blocks:
            raise ValueError(f"prompt of {len(prompt_token_ids)} tokens does not fit the free KV blocks")
        blocks = self.block_pool.allocate(nblocks)  # scratch, never registered in the prefix cache
        try:
            with torch.inference_mode():
                return self.runner.compute_logits(list(prompt_token_ids), blocks).float().cpu()
        finally:
            self.block_pool.free(blocks)

    def score(self, token_ids: Union[list[int], list[list[int]]], chunk_size: Optional[int] = None) -> list[torch.Tensor]:
        """Log-probability of every token given its prefix (for perplexity), prompts only.

        All sequences are prefilled together, in steps of at most `chunk_size`
        tokens (default: max_num_batched_tokens), in the model's forward pass
        with the engine's KV cache and attention backend; each step's inputs come from the
        model runner's one `prepare`.

        Args:
            token_ids: one sequence of token ids, or a list of them.
        Returns:
            per sequence, [len - 1] float32 on the CPU: entry t is log p(token t+1 | tokens 0..t).
        Raises:
            RuntimeError: if requests are in flight.
            ValueError: when the sequences do not fit the free KV blocks or exceed max_model_len.
        """
        if self.scheduler.has_unfinished():
            raise RuntimeError("score needs an idle engine")
        seqs = [list(token_ids)] if token_ids and isinstance(token_ids[0], int) else [list(s) for s in token_ids]
        bs, budget = self.config.block_size, chunk_size or self.config.max_num_batched_tokens
        if any(not s or len(s) > self.max_model_len for s in seqs):
            raise ValueError(f"each sequence must have 1..{self.max_model_len} tokens")
        need = [-(-len(s) // bs) for s in seqs]
        if sum(need) > self.num_free_blocks:
            raise ValueError(f"sequences need {sum(need)} KV blocks, {self.num_free_blocks} are free")
        tables = [self.block_pool.allocate(n) for n in need]  # scratch, never prefix-cached
        out: list[list[torch.Tensor]] = [[] for _ in seqs]
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
                        specs.append(ChunkSpec(s, done[i], n, tables[i], "all"))
                        chunks.append((i, done[i], n))
                    # every chunk as a prefill chunk (a 1-token chunk too), logits at every position
                    logits = self.runner.run(self.runner.prepare([], specs))
                    lp = torch.log_softmax(logits.float(), dim=-1)
                    row = 0
                    for i, p0, n in chunks:
                        m = min(n, len(seqs[i]) - 1 - p0)  # the last token predicts nothing
                        if m > 0:
                            tgt = torch.tensor(seqs[i][p0 + 1: p0 + 1 + m], device=lp.device)
                            out[i].append(lp[row: row + m].gather(1, tgt[:, None]).squeeze(1).cpu())
                        row += n
                        done[i] += n
        finally:
            for t in tables:
                self.block_pool.free(t)
        return [torch.cat(o) if o else torch.zeros(0) for o in out]

    # ------------------------------------------------------------ public API
    def generate(self, prompts: Seq[PromptType], sampling_params: Union[SamplingParams, Seq[SamplingParams], None] = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate completions for every prompt; outputs in input order.

        Args:
            prompts: strings, or lists of token ids.
            sampling_params: one SamplingParams for all, or one per prompt (default: SamplingParams()).
            use_tqdm: show a progress bar (requests done, input and output tokens/s).
        Raises:
            ValueError: only for a sampling_params list whose length differs from prompts.
        """
        outs: list[Optional[RequestOutput]] = [None] * len(prompts)
        for o in self.iter_outputs(prompts, sampling_params, use_tqdm):
            outs[int(o.request_id)] = o
        return outs  # type: ignore[return-value]

    def chat(self, conversations: Seq[list[dict]], sampling_params=None, use_tqdm: bool = True,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Apply the chat template to each conversation ({role, content} dicts), then generate.

        A malformed conversation becomes an error output; the others run.
        """
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # a single conversation
        prompts: list = []
        for conv in conversations:
            try:
                prompts.append(self.tokenizer.apply_chat_template(conv, add_generation_prompt=add_generation_prompt))
            except Exception as e:  # noqa: BLE001 - one bad conversation never fails the batch
                prompts.append(_BadPrompt(f"messages: {e}"))
        return self.generate(prompts, sampling_params, use_tqdm)

    def iter_outputs(self, prompts: Seq[PromptType], sampling_params=None,
                     use_tqdm: bool = True) -> Iterator[RequestOutput]:
        """Yield each RequestOutput as soon as its request finishes (request_id = str(prompt index)).

        Invalid requests are yielded first, as error outputs. Stopping the
        iteration early aborts the remaining requests and frees their blocks.
        """
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"sampling_params has {len(params_list)} entries but there are {len(prompts)} prompts"
                )
        requests = self.make_requests(prompts, params_list)
        pbar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            pbar = tqdm(total=len(requests), desc="Processed prompts", dynamic_ncols=True)
        start = time.perf_counter()
        in_tok = out_tok = 0
        last_update = 0.0
        try:
            for r in requests:
                if r.error is not None:
                    out = self._request_output(r)
                    if pbar:
                        pbar.update(1)
                    yield out
            self.core.add_requests(requests)
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
        texts = [(i, p) for i, p in enumerate(prompts) if isinstance(p, str) and p != ""]
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
                if not ids:
                    error = "prompt: empty prompt"
            elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                ids = list(prompt)
                if not ids:
                    error = "prompt: empty prompt"
                elif any(t < 0 or t >= vocab for t in ids):
                    bad = next(t for t in ids if t < 0 or t >= vocab)
                    error = f"prompt: token id {bad} is outside the vocabulary [0, {vocab})"
            else:
                error = f"prompt: must be a string or a list of token ids, got {type(prompt).__name__}"
            if error is None and not isinstance(params, SamplingParams):
                error = f"sampling_params: expected SamplingParams, got {type(params).__name__}"
            if error is None:
                error = params.validate(vocab)
            if error is None and len(ids) >= self.max_model_len:
                error = (
                    f"prompt: {len(ids)} tokens leaves no room for output within max_model_len={self.max_model_len}"
                    if len(ids) == self.max_model_len
                    else f"prompt: {len(ids)} tokens is longer than max_model_len={self.max_model_len}"
                )
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
                    self._seq_counter += 1
                    req.seqs.append(seq)
            reqs.append(req)
        return reqs

    def _request_output(self, req: Request) -> RequestOutput:
        m = req.metrics
        if req.error is not None:
            if m.finish_time is None:
                m.finish_time = time.time()
            outs = [CompletionOutput(index=j, text="", token_ids=[], finish_reason="error", error=req.error)
                    for j in range(max(1, req.params.n if isinstance(req.params.n, int) and req.params.n > 0 else 1))]
        else:
            outs = [CompletionOutput(index=s.index, text=s.text, token_ids=s.output_token_ids,
                                     finish_reason=s.finish_reason, logprobs=s.logprobs, stop_reason=s.stop_reason)
                    for s in req.seqs]
        m.output_tokens = sum(len(o.token_ids) for o in outs)
        cached = req.seqs[0].num_cached_tokens if req.seqs else 0
        return RequestOutput(request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
                             outputs=outs, finished=True, num_cached_tokens=cached, metrics=m, error=req.error)
