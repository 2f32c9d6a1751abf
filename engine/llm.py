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
import time
import weakref
from typing import Any, Iterator, Optional, Sequence as Seq, Union

import torch

from .config import EngineConfig, SamplingParams, SpeculativeConfig
from .core import EngineCore
from .input_processor import InputProcessor, PromptType, params_list, prompt_list
from .kv_cache import BlockPool, KVCache, kv_layout
from .kv_cache_manager import KVCacheManager
from .loader import (
    attention_backend_error, context_bound, context_length, cpu_kernels_serve, finish_sharded_quantization,
    kv_block_bytes, load_model, make_attention_backend, num_kv_blocks, resolve_settings,
)
from .metrics import EngineStats
from .model_runner import ModelRunner
from .output_processor import OutputProcessor
from .outputs import RequestOutput
from .parallel.sharding import TPShard
from .request import Request
from .sampler import Sampler
from .scheduler import Scheduler
from .scoring import Scorer
from .spec_decode import SpecDecoder
from .structured import StructuredOutputManager
from .threads import apply_num_threads, default_num_threads
from .weights import DEFAULT_MODEL, resolve_model

__all__ = ["LLM", "PromptType"]


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
    exits. The workers are started with multiprocessing's "spawn" without re-running the
    caller's script, so a plain script with no `if __name__ == "__main__":` guard works too.

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
        if (problem := attention_backend_error(cfg)) is not None:
            raise ValueError(problem)
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
            from .parallel import start_workers

            self.workers = start_workers(cfg, source, self.device, self.dtype, self.attention_backend, quant,
                                         group_size, spec_cfg.method if spec_cfg is not None else None,
                                         self.num_threads)
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
        self.model, self.tokenizer = load_model(source, self.dtype, str(self.device), cfg.seed, quant, group_size,
                                                cfg.cpu_kernels, shard, calibration_engine=LLM)
        mcfg = self.model_config = self.model.cfg
        self.load_time_s = time.perf_counter() - t0

        # KV cache sized from the memory budget (per rank: num_kv_heads / N heads of every block); the
        # activations' dtype picks the cache's (fp32 rows also under bf16 weights on the CPU kernels)
        self.backend, kv_dtype = make_attention_backend(self.attention_backend, cfg.kv_cache_dtype, cfg.cpu_kernels,
                                                        self.model.dtype, self.dtype, bs, mcfg.head_dim)
        kv_heads = self.model.local.num_kv_heads
        layout = kv_layout(mcfg, bs)  # the layer groups: sliding-window layers give blocks back behind the window
        per_block = kv_block_bytes(self.backend, kv_dtype, layout.pages_per_block, kv_heads, mcfg.head_dim, bs)
        infos = self.workers.wait_ready() if self.workers is not None else []
        num_blocks = num_kv_blocks(cfg, mcfg, self.device, per_block, layout.pages_per_block,
                                   tuple(i["free_memory"] for i in infos))
        self.max_model_len = context_length(cfg, mcfg, num_blocks)  # (a job plans with the same function)
        self.context_bound = context_bound(cfg, mcfg, num_blocks)  # what sets it, for the too-long prompt error
        shape = self.backend.cache_shape(num_blocks, bs, kv_heads, mcfg.head_dim)
        self.kv_cache = KVCache(mcfg, num_blocks, bs, kv_dtype, self.device, shape, layout)
        # K and V of all layers, scales included, one rank's share (hybrid models: per main-group token)
        self.kv_bytes_per_token = per_block // layout.main_block_tokens
        # what kv_cache_dtype resolved to: "bf16" (the grouped cache on the CPU, or bf16 rows on CUDA),
        # "fp16", "fp32", "int8" or "fp8_e4m3"
        self.kv_cache_dtype = (cfg.kv_cache_dtype if cfg.kv_cache_dtype in ("int8", "fp8_e4m3") else
                               {torch.int16: "bf16", torch.bfloat16: "bf16", torch.float16: "fp16",
                                torch.float32: "fp32"}.get(kv_dtype, str(kv_dtype).removeprefix("torch.")))
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
                               cpu_kernels=cpu_kernels_serve(cfg.cpu_kernels, str(self.device), self.dtype, quant))
        self.spec = None
        if spec_cfg is not None and spec_cfg.method == "draft_model" and layout.window:
            raise ValueError("speculative method 'draft_model' is not supported for a model with sliding-window "
                             "layers (its block tables give blocks back behind the window); use 'ngram' or 'suffix'")
        if spec_cfg is not None:
            model, backend, sampler = self.model, self.backend, self.sampler  # (no reference back to this LLM)
            core_ref = []  # filled below; dropping this LLM frees its KV cache at once

            def draft_factory():
                from .spec_decode import DraftModelProposer

                return DraftModelProposer(model, spec_cfg.draft_model, num_blocks, bs, backend, kv_dtype, sampler)

            self.spec = SpecDecoder(spec_cfg, self.max_model_len, draft_factory,
                                    profile=lambda n, ctx, seqs=None: core_ref[0].profile_step(n, ctx, seqs))
        self.scheduler = Scheduler(self.kv_manager, bs, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                   cfg.enable_chunked_prefill, self.spec)
        if (self.device.type == "cuda" and not cfg.enforce_eager and shard.world_size == 1 and not layout.hybrid
                and getattr(self.backend, "supports_cuda_graphs", False)):  # (graphs capture one table per row)
            from .cuda_graph import DecodeCudaGraphs  # decode steps replayed from graphs per batch bucket

            self.runner.cuda_graphs = DecodeCudaGraphs(self.model, self.kv_cache.layers, self.backend,
                                                       cfg.max_num_seqs, self.max_model_len, bs)
        self.structured = StructuredOutputManager.for_backend(cfg.structured_outputs_backend, self.tokenizer)
        self.core = EngineCore(self.scheduler, self.runner, self.sampler, self.max_model_len, self.spec,
                               self.structured, cfg.structured_outputs_jump_forward)
        if self.spec is not None:
            core_ref.append(weakref.proxy(self.core))
        self.input_processor = InputProcessor(self.tokenizer, self.structured, self.max_model_len, cfg.seed,
                                              self.device, self.context_bound)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.scorer = Scorer(self.scheduler, self.runner, self.kv_manager, self.tokenizer, bs,
                             cfg.max_num_batched_tokens, self.max_model_len)

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
        return self.kv_manager.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        """KV blocks in the pool."""
        return self.kv_manager.num_blocks

    def get_tokenizer(self) -> Any:
        """The Hugging Face tokenizer the engine encodes with (a `transformers` fast tokenizer), as
        vLLM's `LLM.get_tokenizer()` returns it: `apply_chat_template(messages, tokenize=False,
        add_generation_prompt=True)`, `encode`, `decode`. `LLM.tokenizer` is the engine's wrapper of
        it (EOS ids, incremental detokenizing)."""
        return self.tokenizer.hf

    def compute_logits(self, prompt_token_ids: list[int]) -> torch.Tensor:
        """Last-position logits of a prompt, [vocab_size] float32 on the CPU (`Scorer.compute_logits`).

        Raises:
            RuntimeError: if requests are in flight.
            ValueError: for an empty prompt or one longer than max_model_len.
        """
        return self.scorer.compute_logits(prompt_token_ids)

    def score(self, token_ids: Union[list[int], list[list[int]]], chunk_size: Optional[int] = None) -> list[torch.Tensor]:
        """Log-probability of every token given its prefix (for perplexity), prompts only: per sequence,
        [len - 1] float32 on the CPU, entry t is log p(token t+1 | tokens 0..t). See `Scorer.score`.

        Raises:
            RuntimeError: if requests are in flight.
            TypeError: token_ids (or one of its sequences, named by index) is not a list of ints, e.g. a string.
            ValueError: an empty sequence or a token id outside the vocabulary (named, with the vocab size),
                or sequences that do not fit the free KV blocks or exceed max_model_len.
        """
        return self.scorer.score(token_ids, chunk_size)

    def score_choices(self, prompt_token_ids: list[int], choices: Seq[str]) -> dict[str, float]:
        """Log-probability (natural log) of each choice as the continuation of one prompt
        (`Scorer.score_choices`).

        Raises:
            RuntimeError: if requests are in flight.
            TypeError: prompt_token_ids is not a list of ints, or choices is not a list of strings.
            ValueError: an empty prompt or choices, a token id outside the vocabulary, a repeated choice,
                or what `score_choices_batch` reports for the prompt.
        """
        return self.scorer.score_choices(prompt_token_ids, choices)

    def score_choices_batch(self, items: Seq[tuple[list[int], Seq[str]]]) -> list[Union[dict[str, float], str]]:
        """Per (prompt token ids, choices) item, {choice: log p(choice tokens | prompt)} in the choices'
        order, or an error message naming the item (`Scorer.score_choices_batch` says how).

        Raises:
            RuntimeError: if requests are in flight.
        """
        return self.scorer.score_choices_batch(items)

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
        prompts = prompt_list(prompts)
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
        prompts = self.input_processor.chat_prompts(conversations, add_generation_prompt)
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
        prompts = prompt_list(prompts)
        requests = self.input_processor.make_requests(prompts, params_list(sampling_params, len(prompts)))
        pbar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            pbar = tqdm(total=len(requests), desc="Processed prompts", dynamic_ncols=True)
        start = time.perf_counter()
        in_tok = out_tok = 0
        last_update = 0.0
        try:
            self.scorer.add_prompt_logprobs(requests)
            self.scorer.score_requests([r for r in requests if r.error is None and r.params.score_choices is not None])
            for r in requests:
                if r.error is not None or r.scores is not None:
                    out = self.output_processor.make_output(r)
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
                    yield self.output_processor.make_output(r)
        finally:
            if pbar:
                pbar.close()
            self.core.abort_all()

    # ------------------------------------------------------------ internals
    def make_requests(self, prompts: list, params_list: list[SamplingParams]) -> list[Request]:
        """Validated, tokenized Requests for `core.add_requests` (`InputProcessor.make_requests`: a bad
        prompt or parameter gives a Request whose `error` names it, never an exception)."""
        return self.input_processor.make_requests(prompts, params_list)
