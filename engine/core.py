"""The engine core: the step loop behind the `LLM` facade.

One step: the scheduler picks decode tokens (some turned into verification chunks that
carry speculative drafts), then prefill chunks, under the token budget; the model runner
builds the step's inputs once and runs one forward pass; the sampler draws a token for
each plain row and verifies each draft; new tokens are checked one by one against EOS,
stop token ids, stop strings and length; blocks past a verification's accepted tokens
are given back; finished sequences free their blocks.

Constrained sequences (`engine.structured`) add three things to a step: the speculative
decoder cuts their drafts at the first token their grammar rejects (and, with jump-forward,
before a token after which the grammar forces its continuation, so that speculation never
changes what is appended), before it sizes them and grows their blocks;
one token bitmask for all the step's logits rows is filled on a worker thread while the
forward pass runs (a verification's row j gets the mask after draft[:j]) and applied
before sampling; every appended token advances the sequence's matcher, and with
jump-forward the tokens the grammar then forces are appended too, to be computed in the
next step's forward pass as one chunk. Jump-forward also appends the tokens a grammar
forces before the first sampled one (computed with the prompt in the prefill) and the end
token once the grammar is complete and allows nothing else (the row ends without a forward
pass for it).

`add_requests` / `step` / `has_unfinished` / `abort_all` are the public surface: the
facade, the benchmarks and the pipeline drive the engine through them only.
"""
from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field
from typing import Optional

import torch

from .metrics import EngineStats
from .model_runner import ChunkSpec, ModelRunner
from .request import Request, Sequence, SequenceStatus
from .sampler import Sampler
from .scheduler import Scheduler


@dataclass
class StepResult:
    """What one step did.

    Attributes:
        finished: requests that finished in it (or were refused: too large for the pool).
        prompt_tokens: prompt tokens computed.
        output_tokens: tokens appended to sequences (accepted drafts included).
    """

    finished: list[Request] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0


class EngineCore:
    """Args:
        scheduler, runner, sampler: the engine's parts.
        max_model_len: longest sequence in tokens.
        spec: an `engine.spec_decode.SpecDecoder` or None (the scheduler holds the same one).
    """

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, sampler: Sampler, max_model_len: int,
                 spec=None, structured=None, jump_forward: bool = True) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.sampler = sampler
        self.max_model_len = max_model_len
        self.spec = spec
        self.structured = structured  # an engine.structured.StructuredOutputManager, or None
        self.jump_forward = jump_forward
        self.stats = EngineStats()
        if spec is not None and structured is not None:  # drafts are cut to what the grammar allows
            method = weakref.WeakMethod(self._grammar_prefix)  # weak: no cycle keeps the engine alive
            spec.draft_filter = lambda seq, draft: method()(seq, draft)

    # ------------------------------------------------------------ public surface
    def add_requests(self, requests: list[Request]) -> None:
        """Queue every sequence of valid requests (error requests are the caller's to report).

        With jump-forward, a constrained sequence whose grammar forces its first tokens (the
        keys that open a JSON object, say) gets them appended now, so its prefill computes them
        with the prompt and its first sampled token is the first one the grammar leaves open.
        """
        for r in requests:
            if r.error is None:
                for s in r.seqs:
                    if s.grammar is not None and self.jump_forward:
                        self._force_start(s)
                    self.scheduler.add(s)

    def has_unfinished(self) -> bool:
        """True while any sequence waits or runs."""
        return self.scheduler.has_unfinished()

    def abort_all(self) -> None:
        """Drop every running and waiting sequence, freeing their blocks."""
        for s in list(self.scheduler.running):
            self.scheduler.finish(s)
        self.scheduler.clear_waiting()

    def profile_step(self, num_tokens: int, context: int = 0, num_seqs: Optional[int] = None) -> float:
        """Seconds of one decode-like forward pass for the speculation policy's step-cost model.

        num_tokens query rows over scratch blocks, every sequence attending to `context`
        earlier tokens: with num_seqs (< num_tokens), num_seqs sequences of about
        num_tokens / num_seqs rows each with logits for every row, shaped as a step whose
        sequences verify drafts (their rows share one KV read per tile, which separate
        sequences do not); else num_tokens one-token sequences (one table per row when the pool
        has the blocks, else one table shared by every row). 0.0 when the pool cannot hold
        even one table.

        The scratch K/V are garbage; the blocks go back to the pool unregistered."""
        kv = self.scheduler.kv
        hybrid = kv.layout.hybrid
        tables = []
        try:
            if num_seqs is not None and 0 < num_seqs < num_tokens:
                q = [num_tokens // num_seqs + (1 if i < num_tokens % num_seqs else 0) for i in range(num_seqs)]
                per_seq = [kv.scratch_blocks(context + qi) for qi in q]
                if sum(per_seq) > kv.num_free_blocks // 2:
                    return 0.0
                tables = [kv.allocate_scratch(context + qi) for qi in q]
                chunks = [ChunkSpec([1 + (j % 997) for j in range(context + qi)], context, qi, t[0], "all",
                                    window_table=t[1] if hybrid else None)
                          for qi, t in zip(q, tables)]
                inputs = self.runner.prepare([], chunks)  # multi-token chunks, as verifications run
            else:
                per_row = kv.scratch_blocks(context + 1)
                rows = num_tokens if num_tokens * per_row <= kv.num_free_blocks // 2 else 1
                if per_row > kv.num_free_blocks:
                    return 0.0
                tables = [kv.allocate_scratch(context + 1) for _ in range(rows)]
                ids = [1 + (i % 997) for i in range(context + 1)]
                specs = [ChunkSpec(ids, context, 1, tables[i % rows][0], "last",
                                   window_table=tables[i % rows][1] if hybrid else None)
                         for i in range(num_tokens)]
                inputs = self.runner.prepare(specs, [])
            t0 = time.perf_counter()
            with torch.inference_mode():
                self.runner.run(inputs)
            return time.perf_counter() - t0
        finally:
            for t in tables:
                kv.free_scratch(t)

    @torch.inference_mode()
    def step(self) -> StepResult:
        """Run one engine step."""
        st = self.stats
        res = StepResult()
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        t1 = time.perf_counter()
        st.time_schedule_s += t1 - t0
        st.num_preemptions = self.scheduler.num_preemptions
        if out.is_empty:
            self._refuse_head(res)
            st.time_total_s += time.perf_counter() - t0
            return res
        now = time.time()
        plain = [c for c in out.decodes if not c.draft]
        verify = [c for c in out.decodes if c.draft]
        # (a chunk of tokens jump-forward appended runs as a prefill chunk and is counted here too)
        res.prompt_tokens = sum(c.num_tokens for c in out.prefills) + sum(
            c.num_tokens for c in plain if c.seq.num_computed_tokens < c.seq.num_prompt_tokens)
        for c in out.chunks:
            m = c.seq.request.metrics
            if m.scheduled_time is None:
                m.scheduled_time = now
        # rows: plain decodes that sample, then each verification's 1 + k rows, then prefills that
        # sample (decided before the computed counts move)
        sample_plain = [c.seq for c in plain if c.samples]
        sample_pre = [c.seq for c in out.prefills if c.samples]
        masks = None
        if self.structured is not None:  # filled on a worker thread while the forward runs
            masks = self.structured.start_fill([(s.grammar, []) for s in sample_plain]
                                               + [(c.seq.grammar, c.draft) for c in verify]
                                               + [(s.grammar, []) for s in sample_pre])
        seqs = sample_plain + sample_pre
        # all rows plain greedy: the LM head takes the argmax in its GEMM, no logits are written
        fused = (self.sampler.fused_greedy(seqs) if not verify and masks is None and self.runner.fused_argmax_ok
                 else None)
        logits = self.runner.execute(out) if fused is None else self.runner.execute(out, argmax=fused)
        t2 = time.perf_counter()
        st.time_model_s += t2 - t1
        for c in plain + out.prefills:
            c.seq.num_computed_tokens += c.num_tokens
            self.scheduler.register_computed(c.seq)
        st.num_steps += 1
        st.num_batched_tokens_sum += out.num_tokens
        st.num_prompt_tokens_computed += res.prompt_tokens
        st.kv_utilization_sum += self.scheduler.kv_utilization()
        if logits is None:
            st.time_total_s += time.perf_counter() - t0
            return res
        n_plain, n_ver = len(sample_plain), sum(1 + len(c.draft) for c in verify)
        bitmask = masks.result() if masks is not None else None
        if fused is not None and logits.dim() == 1:  # greedy token ids, one per row of seqs
            for seq, tok in zip(seqs, logits.tolist()):
                res.output_tokens += self._append(seq, [tok], [None], res)
        elif seqs:
            rows = logits[:n_plain] if not sample_pre else torch.cat((logits[:n_plain], logits[n_plain + n_ver:]))
            bm = None
            if bitmask is not None:
                bm = bitmask[:n_plain] if not sample_pre else torch.cat((bitmask[:n_plain], bitmask[n_plain + n_ver:]))
            tokens, lps = self.sampler(rows, seqs, bm)
            for seq, tok, lp in zip(seqs, tokens, lps):
                res.output_tokens += self._append(seq, [tok], [lp], res)
        if verify:
            results = self.sampler.verify(logits[n_plain:n_plain + n_ver], [(c.seq, c.draft) for c in verify],
                                          None if bitmask is None else bitmask[n_plain:n_plain + n_ver])
            for c, (new, lps, accepted) in zip(verify, results):
                seq = c.seq
                seq.num_computed_tokens += 1 + accepted  # the last token and the accepted drafts have K/V
                m = seq.request.metrics
                m.spec_draft_tokens += len(c.draft)
                m.spec_accepted_tokens += accepted
                st.spec_draft_tokens += len(c.draft)
                st.spec_accepted_tokens += accepted
                st.spec_verifies += 1
                res.output_tokens += self._append(seq, new, lps, res)
                if self.spec is not None:
                    self.spec.verified(seq, c.proposer or "", len(c.draft), accepted)
                if not seq.is_finished:
                    self.scheduler.rollback(seq)
                    self.scheduler.register_computed(seq)
            st.num_spec_steps += 1
        t3 = time.perf_counter()
        st.time_sample_s += t3 - t2
        if self.spec is not None and not out.prefills:
            self.spec.observe_step(out.num_tokens, t3 - t1)
        st.num_output_tokens += res.output_tokens
        st.time_total_s += time.perf_counter() - t0
        return res

    # ------------------------------------------------------------ internals
    def _grammar_prefix(self, seq: Sequence, draft: list[int]) -> int:
        """How many leading tokens of a constrained sequence's draft may be verified (the
        speculative decoder's `draft_filter`): up to the first token its grammar rejects; with
        jump-forward also before the first token after which the grammar forces tokens or
        allows only the end (plain decoding would append those there, not the next draft or
        target token). The matcher is left where it was."""
        m = seq.grammar
        if m is None or not draft:
            return len(draft)
        k = m.validate_tokens(draft) if not m.is_error() else 0
        if self.jump_forward and k:
            took = 0
            for j in range(k):
                m.accept_token(draft[j])
                took += 1
                if m.forced_tokens() or m.is_stopped():
                    k = j  # keep the tokens before it; the target token lands where draft[j] was
                    break
            m.rollback(took)
        return k

    def _force_start(self, seq: Sequence) -> None:
        """Append the tokens seq's grammar forces before its first sampled token (jump-forward
        before the prefill). Kept to what can never finish the sequence, so that it is still
        queued like any other: at most max_tokens - 1 tokens, no end or stop token, and none
        for a request with stop strings (a stop string inside them would end it unscheduled)."""
        m = seq.grammar
        p = seq.request.params
        if m.is_error() or p.stop:
            return
        forced = m.forced_tokens()
        limit = min(p.max_tokens if p.max_tokens is not None else self.max_model_len,
                    self.max_model_len - seq.num_tokens) - 1
        ends = set(self.sampler.eos_token_ids) | set(p.stop_token_ids)
        take = []
        for tok in forced[:max(limit, 0)]:
            if tok in ends:
                break
            take.append(tok)
        kept = 0
        for tok in take:
            m.accept_token(tok)
            if m.is_error():  # the backend gave up on the grammar: the row ends after its prefill (`_append`)
                break
            seq.token_ids.append(tok)
            if seq.logprobs is not None:
                seq.logprobs.append(None)
            self._check_stop(seq, tok)
            kept += 1
        seq.num_forced_tokens += kept
        self.stats.structured_forced_tokens += kept

    def _forced_next(self, seq: Sequence) -> list[int]:
        """The tokens seq's grammar forces after its last token: its forced continuation, or
        the end token when the grammar is complete and allows nothing else (then the row ends
        without a forward pass for it; not when EOS is suppressed: ignore_eos, min_tokens)."""
        m = seq.grammar
        forced = m.forced_tokens()
        if forced or self.structured is None:
            return forced
        eos = self.structured.backend.eos_token_id
        p = seq.request.params
        if (eos is not None and m.is_stopped() and not p.ignore_eos
                and seq.num_output_tokens >= p.min_tokens):
            return [eos]
        return []

    def _refuse_head(self, res: StepResult) -> None:
        """Nothing fits even with nothing running: the head sequence can never be served."""
        sch = self.scheduler
        if not (sch.waiting and not sch.running):
            return
        seq = sch.pop_waiting()
        req = seq.request
        whole = sch.kv.num_blocks * sch.kv.layout.main_block_tokens  # (the pool's blocks all in one table)
        holds = sch.kv.max_tokens(sch.max_num_batched_tokens, max(whole, seq.num_tokens))
        req.error = f"prompt: needs {seq.num_tokens} tokens of KV cache but the pool holds {holds}"
        for s in req.seqs:
            if s in sch.waiting:
                sch.remove_waiting(s)
            elif s.status == SequenceStatus.RUNNING:
                sch.finish(s)
            s.status = SequenceStatus.FINISHED
        res.finished.append(req)

    def _append(self, seq: Sequence, tokens: list[int], lps: list, res: StepResult) -> int:
        """Append tokens to seq in order, checking stops after each; returns how many were kept."""
        req = seq.request
        now = time.time()
        kept = 0
        tokens, lps = list(tokens), list(lps)
        given = len(tokens)  # the tokens after these are forced ones (jump-forward), counted as they land
        i = 0
        while i < len(tokens):
            tok, lp = tokens[i], lps[i]
            i += 1
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            if seq.grammar is not None:
                seq.grammar.accept_token(tok)
                if seq.grammar.is_error():  # the grammar rejected tok, or the backend gave up on it
                    self._finish_grammar_error(seq)
                    break
            seq.token_ids.append(tok)
            if seq.logprobs is not None:
                seq.logprobs.append(lp)
            kept += 1
            if i > given:
                seq.num_forced_tokens += 1
                self.stats.structured_forced_tokens += 1
            self._check_stop(seq, tok)
            if seq.is_finished:
                break
            if i == len(tokens) and seq.grammar is not None and self.jump_forward and not seq.grammar.is_error():
                forced = self._forced_next(seq)  # jump-forward: appended without sampling each
                tokens += forced  # counted above as each lands: a run may be longer than max_tokens allows
                lps += [None] * len(forced)
        if seq.is_finished:
            if seq in self.scheduler.running:
                self.scheduler.finish(seq)
            if self.spec is not None:
                self.spec.finished(seq)
            if req.is_finished:
                req.metrics.finish_time = time.time()
                res.finished.append(req)
        return kept

    def _finish_grammar_error(self, seq: Sequence) -> None:
        """End a constrained sequence whose matcher is in error (a token its grammar rejected, or a
        grammar the backend gave up on part-way: llguidance's lexer budget) with finish_reason
        "error", before the token that failed: its text is what the grammar accepted, and it is not
        run on unconstrained (an errored matcher masks nothing) to max_tokens. `LLM` reports it as
        an error completion naming the constraint."""
        seq.detokenizer.finish()
        seq.text = seq.detokenizer.text
        seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens)  # drafts verified past it
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.stop_reason = "error", None

    def _check_stop(self, seq: Sequence, tok: int) -> None:
        """Update the text and decide whether `seq` is finished after appending `tok`.

        Order: EOS and stop token ids (their text is not added, as in vLLM),
        then stop strings in the new text (text cut before the stop string),
        then max_tokens / max_model_len ("length").
        """
        p = seq.request.params
        n_out = seq.num_output_tokens
        reason = None
        stop_reason: Optional[object] = None
        past_min = n_out >= p.min_tokens
        if past_min and not p.ignore_eos and tok in self.sampler.eos_token_ids:
            reason = "stop"
        elif past_min and tok in p.stop_token_ids:
            reason, stop_reason = "stop", tok
        if reason is None:
            new_text = seq.detokenizer.add([tok])
            if past_min and seq.stop_matcher and new_text:
                hit = seq.stop_matcher.find(seq.detokenizer.text, len(new_text))
                if hit is not None:
                    cut, s = hit
                    seq.text = seq.detokenizer.text[:cut]
                    seq.status = SequenceStatus.FINISHED
                    seq.finish_reason, seq.stop_reason = "stop", s
                    return
            max_tokens = p.max_tokens if p.max_tokens is not None else self.max_model_len
            if n_out >= max_tokens or seq.num_tokens >= self.max_model_len:
                reason = "length"
        if reason is not None:
            checked = len(seq.detokenizer.text)
            seq.detokenizer.finish()
            text = seq.detokenizer.text
            if seq.stop_matcher and len(text) > checked:  # text held back until now may hold a stop string
                hit = seq.stop_matcher.find(text, len(text) - checked)
                if hit is not None:
                    text, reason, stop_reason = text[: hit[0]], "stop", hit[1]
            seq.text = text
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason, seq.stop_reason = reason, stop_reason
        else:
            seq.text = seq.detokenizer.text
