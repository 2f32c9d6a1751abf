"""Scoring: log-probabilities of given tokens, over the engine's KV cache and model runner.

`Scorer` is what `LLM.score`, `LLM.score_choices(_batch)`, `LLM.compute_logits` and a request's
`prompt_logprobs` / `score_choices` run on: prefills of scratch KV blocks (never prefix-cached) with
logits at every position, and for choices the prompt's full blocks shared through the prefix cache
under the scheduler's block keys (`engine.kv_cache.chain_block_keys`). Every forward pass is padded so a
row's figures never depend on its neighbours (`Scorer._run_invariant`).
"""
from __future__ import annotations

import dataclasses
import operator
import reprlib
import time
from typing import Any, Optional, Sequence as Seq, Union

import torch

from .kv_cache import BlockKey, chain_block_keys
from .model_runner import ChunkSpec
from .request import Request, SequenceStatus


@dataclasses.dataclass
class ScoringJob:
    """One prompt of `Scorer.score_choices_batch`, checked and tokenized.

    Attributes:
        index: the item's index in the batch (where its result goes).
        prompt: the prompt's token ids.
        choices: the choice strings, in the caller's order.
        choice_tokens: per choice, its token ids (EOS appended when one choice's tokens are a
            proper prefix of another's).
        num_shared_blocks: full KV blocks before the prompt's last token (shared via the prefix cache).
        block_keys: the prefix cache keys of those blocks.
        tail_blocks: per choice, the blocks of prompt + choice past the shared ones.
    """

    index: int
    prompt: list[int]
    choices: list[str]
    choice_tokens: list[list[int]]
    num_shared_blocks: int
    block_keys: list[BlockKey]
    tail_blocks: list[int]

    @property
    def num_blocks(self) -> int:
        """Blocks the job holds at once: its shared ones, every choice's tail, and its last block."""
        return self.num_shared_blocks + sum(self.tail_blocks) + 1


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


class Scorer:
    """Scoring passes of one engine (see the module docstring).

    Args:
        scheduler: the engine's scheduler (scoring needs it idle).
        runner: the engine's `ModelRunner`.
        kv_manager: the engine's `KVCacheManager` (scratch tables, blocks, the prefix cache).
        tokenizer: the engine's `Tokenizer`.
        block_size: tokens per KV block.
        max_num_batched_tokens: the token budget of one forward pass.
        max_model_len: the engine's context length in tokens.
    """

    _ROW_MULTIPLE = 12  # the CPU GEMM's register tile is 12, 6 or 4 rows: multiples of 12 fill every tile

    def __init__(self, scheduler: Any, runner: Any, kv_manager: Any, tokenizer: Any, block_size: int,
                 max_num_batched_tokens: int, max_model_len: int) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.kv_manager = kv_manager
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len

    @property
    def num_free_blocks(self) -> int:
        """KV blocks not held by any sequence."""
        return self.kv_manager.num_free_blocks

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
        return [lp for lp, _, _ in self._prefill_logprobs(seqs, chunk_size or self.max_num_batched_tokens)]

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

    def add_prompt_logprobs(self, reqs: list[Request]) -> None:
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
                                             self.max_num_batched_tokens, k)
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
        bs, kv = self.block_size, self.kv_manager
        hybrid = self.kv_manager.layout.hybrid
        results: list[Union[dict[str, float], str, None]] = [None] * len(items)
        jobs: list[ScoringJob] = []
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
            keys = [key for _, key in chain_block_keys(P, bs, n_shared)]
            tails = [-(-(len(P) + len(t)) // bs) - n_shared for t in toks]
            # a hybrid model: the prompt's scratch tables and one choice's tail blocks (`_score_job_hybrid`)
            need = (self.kv_manager.scratch_blocks(len(P) - 1) + max(self._tail_blocks(len(P) - 1, len(t))
                                                                       for t in toks) + 2 if hybrid
                    else n_shared + sum(tails) + 2)
            if need > kv.num_blocks:
                results[i] = f"score_choices: needs {need} KV blocks, the pool holds {kv.num_blocks}"
                continue
            jobs.append(ScoringJob(i, P, list(choices), toks, n_shared, keys, tails))
        budget = self.max_num_batched_tokens
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
                    n = jobs[end].num_blocks
                    if end > start and need + n > kv.num_free_blocks - 1:  # 1: the padding chunk's block
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

    def _score_job_hybrid(self, job: ScoringJob, results: list, budget: int) -> None:
        """One scoring job (see `score_choices_batch`) for a model that mixes full and sliding-window
        layers, outside the prefix cache: the prompt's tokens but its last are prefilled once over
        scratch tables (no logits); then each choice runs the prompt's last token and its own tokens
        but the last as one chunk over the prompt's full blocks plus, per layer group, a copy of
        the prompt's partial block and fresh blocks; row j predicts the choice's token j. All choices
        of the prompt share one forward pass (`_run_invariant`), as many as the free blocks hold.
        A choice's score sums the log-probabilities of its tokens."""
        P, choices, toks = job.prompt, job.choices, job.choice_tokens
        L = len(P) - 1
        kv = self.kv_manager
        prefix = kv.allocate_scratch(L) if L else ([], [])
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
                while k < len(toks) and (not specs or self._tail_blocks(L, len(toks[k])) + 2 <= kv.num_free_blocks):
                    tables = []
                    for g, shared in zip(kv.groups, prefix):
                        full = L // g.block_tokens
                        fresh = kv.allocate_blocks(-(-(L + len(toks[k])) // g.block_tokens) - full)
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
                    kv.free_blocks(t)
                owned.clear()
        finally:
            for t in owned:
                kv.free_blocks(t)
            kv.free_scratch(prefix)
        results[job.index] = {c: scores[c] for c in choices}

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

    def _score_group(self, group: list[ScoringJob], results: list, bs: int, budget: int) -> None:
        """Prefix blocks, then choice tails, of a group of scoring jobs (see `score_choices_batch`)."""
        kv = self.kv_manager
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
                            kv.register_block(c.block_table[b], keys[b])
                    batch.clear()
                    pending.clear()

            for job in group:
                i, P, n_shared, keys = job.index, job.prompt, job.num_shared_blocks, job.block_keys
                if any(k in pending for k in keys):
                    flush()
                table = kv.take_cached(keys)
                hits = len(table)
                if kv.num_free_blocks < n_shared - hits:
                    flush()
                table += kv.allocate_blocks(n_shared - hits)
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
            scores: dict[int, dict[str, float]] = {job.index: {} for job in group}
            last: dict[int, list[int]] = {}
            heads: list[tuple[int, ChunkSpec]] = []
            for job in group:
                i, P, n_shared = job.index, job.prompt, job.num_shared_blocks
                last[i] = kv.allocate_blocks(1)
                owned.append(last[i])
                S = n_shared * bs
                heads.append((i, ChunkSpec(P, S, len(P) - S, shared[i] + last[i], "last")))
            for part in _batches(heads, lambda h: h[1].num_tokens, budget):
                lp = torch.log_softmax(self._run_invariant([c for _, c in part]).float(), dim=-1)
                for row, (i, _) in enumerate(part):
                    job = next(j for j in group if j.index == i)
                    for c, t in zip(job.choices, job.choice_tokens):
                        scores[i][c] = float(lp[row, t[0]].double())
            # 3. choices of more than one token: their tokens after the first, over a copy of the prompt's
            #    last block (so choices never share a written block), logits at every position
            tails = []
            for job in group:
                i, P, n_shared = job.index, job.prompt, job.num_shared_blocks
                for c, t, k in zip(job.choices, job.choice_tokens, job.tail_blocks):
                    if len(t) < 2:
                        continue
                    table = shared[i] + kv.allocate_blocks(k)
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
            for job in group:
                results[job.index] = scores[job.index]
        finally:
            for t in owned:
                kv.free_blocks(t)
            for t in shared.values():
                kv.free_blocks(t)

    def score_requests(self, reqs: list[Request]) -> None:
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
