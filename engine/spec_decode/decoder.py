"""The speculative decoder: which proposer drafts for which sequence, and how many tokens.

The scheduler calls `attach_drafts` after it has placed the step's decodes and prefill
chunks: for each decoding sequence it gets a draft (prompt lookup first, then the
job-wide suffix index, or the draft model), chooses the draft lengths (fixed, or by the
goodput policy of `policy.py` when adaptive), grows the sequence's blocks for them and
turns its one-token decode chunk into a (1 + k)-token verification chunk, counted in the
step's token budget. After the step the engine reports each verification (`verified`),
the step's size and time (`observe_step`) and finished sequences (`finished`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

from ..config import SpeculativeConfig
from .base import Proposer
from .ngram import NgramProposer
from .policy import AcceptanceTracker, StepCostModel, choose_lengths, worth_drafting
from .suffix import SuffixProposer


@dataclass
class SpecStats:
    """What the speculation policy itself spent (drafted, accepted and verified counts are the
    engine's: `EngineStats.spec_*`, per request `RequestMetrics.spec_*`).

    Attributes:
        profile_s: seconds spent profiling the step-cost model.
        steps_skipped: steps where no draft could pay, so no proposer ran (adaptive mode).
    """

    profile_s: float = 0.0
    steps_skipped: int = 0


class SpecDecoder:
    """Args:
        cfg: the speculative settings.
        max_model_len: longest sequence.
        draft_factory: builds the draft-model proposer (for method "draft_model").
        profile: runs the start-up profile: a callable (rows, context tokens) -> seconds of
            one decode-like step (`EngineCore.profile_step`).
    """

    def __init__(self, cfg: SpeculativeConfig, max_model_len: int,
                 draft_factory: Optional[Callable[[], Proposer]] = None,
                 profile: Optional[Callable[[int, int], float]] = None) -> None:
        self.cfg = cfg
        self.max_model_len = max_model_len
        self.adaptive = cfg.method == "auto"
        self.proposers: list[Proposer] = []
        if cfg.method in ("auto", "ngram"):
            self.proposers.append(NgramProposer(cfg.prompt_lookup_min, cfg.prompt_lookup_max))
        if cfg.method in ("auto", "suffix"):
            self.proposers.append(SuffixProposer(cfg.suffix_max_tokens, cfg.suffix_max_depth))
        if cfg.method == "draft_model":
            if draft_factory is None:
                raise ValueError("speculative method 'draft_model' needs a draft model")
            self.proposers.append(draft_factory())
        self.cost = StepCostModel()
        self.acceptance = AcceptanceTracker()
        self.stats = SpecStats()
        self._profile = profile
        self._profiled_sizes: set[int] = set()
        # draft_filter(seq, draft) -> how many leading draft tokens seq may verify (the engine sets
        # it for constrained sequences: the grammar's valid prefix); None keeps every draft whole
        self.draft_filter: Optional[Callable[[object, list[int]], int]] = None

    # ------------------------------------------------------------ scheduling
    def _cap(self, seq) -> int:
        """Most draft tokens seq may take: the config's k, its max_tokens and the context left."""
        p = seq.request.params
        cap = self.cfg.num_speculative_tokens
        if p.max_tokens is not None:
            cap = min(cap, p.max_tokens - seq.num_output_tokens - 1)
        return max(0, min(cap, self.max_model_len - seq.num_tokens - 1))

    def _remaining(self, seq) -> int:
        """Tokens seq may still generate (its max_tokens, or the context left)."""
        left = self.max_model_len - seq.num_tokens
        p = seq.request.params
        if p.max_tokens is not None:
            left = min(left, p.max_tokens - seq.num_output_tokens)
        return max(0, left)

    def _filtered(self, seq, draft: list[int]) -> list[int]:
        """draft cut by `draft_filter` for a constrained sequence (whole otherwise)."""
        if draft and self.draft_filter is not None and getattr(seq, "grammar", None) is not None:
            return list(draft[: self.draft_filter(seq, draft)])
        return draft

    def attach_drafts(self, decodes: list, budget: int, step_tokens: int, grow: Callable,
                      queue_empty: bool = False) -> None:
        """Turn some of this step's decode chunks into verification chunks (in place).

        Args:
            decodes: the step's one-token decode chunks (`ScheduledChunk`).
            budget: token budget left in the step.
            step_tokens: tokens the step runs without drafts.
            grow: grow(seq, num_tokens) -> bool, allocating the blocks for num_tokens tokens
                from the sequence's computed position (the scheduler's own).
            queue_empty: no request is waiting (the job's tail): the job then ends when its
                longest rows end, so the adaptive policy drafts only for the rows with at
                least 90% of the most tokens left, and counts only their tokens as goodput
                (the others' tokens no longer shorten the job); otherwise every row's count.
        """
        for p in self.proposers:
            p.step()
        if self.adaptive:
            self.acceptance.relax()
        if budget <= 0 or not decodes:
            return
        caps = [self._cap(c.seq) for c in decodes]
        cand = [(i, c) for i, c in enumerate(decodes) if caps[i] > 0]
        if not cand:
            return
        tail = self.adaptive and queue_empty
        if tail:  # only the rows that end last decide when the job ends
            rem = [self._remaining(c.seq) for _, c in cand]
            top = max(rem)
            cand = [ic for ic, r in zip(cand, rem) if r >= 0.9 * top]
        seqs = [c.seq for _, c in cand]
        # the goodput that counts: every row's tokens, or in the tail only the last rows'
        base_yield = float(len(seqs) if tail else len(decodes))
        cost = self.cost.cost
        if self.adaptive:
            if step_tokens != len(decodes):
                return  # a prefill chunk runs in this step: it is big already, and the cost model
                # (of decode and verification rows only) does not describe it
            ctx = sum(c.seq.num_tokens for c in decodes) // len(decodes)
            kcap = max(caps[i] for i, _ in cand)
            for n in (step_tokens, step_tokens + len(seqs), step_tokens + min(len(seqs) * kcap, budget)):
                self._ensure_point(n, ctx, len(decodes))
            best = max(max(self.acceptance.rate(s.seq_id, p.name) for p in self.proposers) for s in seqs)
            if not worth_drafting(best, len(seqs), step_tokens, base_yield, cost, budget):
                self.stats.steps_skipped += 1
                return
        props: list[tuple[Optional[Proposer], list[int]]] = [(None, [])] * len(cand)
        cheap = [p for p in self.proposers if p.cheap]
        kmax = [caps[i] for i, _ in cand]
        for p in cheap:  # the first proposer with a draft for a sequence drafts for it
            want = [j for j, (pp, d) in enumerate(props) if not d]
            if not want:
                break
            got = p.propose([seqs[j] for j in want], [kmax[j] for j in want])
            for j, d in zip(want, got):
                d = self._filtered(seqs[j], d)  # before sizing and blocks: only what may be verified
                if d:
                    props[j] = (p, d)
        expensive = [p for p in self.proposers if not p.cheap]
        if expensive:
            p = expensive[0]
            props = [(p, [0] * kmax[j]) if not d else (pp, d) for j, (pp, d) in enumerate(props)]
        # how many of each draft to run
        lens = [len(d) for _, d in props]
        if self.adaptive:
            rates = [self.acceptance.rate(s.seq_id, pp.name) if pp else 0.0 for s, (pp, _) in zip(seqs, props)]
            ks = choose_lengths(rates, lens, step_tokens, base_yield, cost, budget)
        else:
            ks, left = [], budget
            for n in lens:
                ks.append(min(n, left))
                left -= ks[-1]
        # blocks for the drafts; a sequence that cannot get them decodes plainly
        for j, k in enumerate(ks):
            if k and not grow(seqs[j], 1 + k):
                ks[j] = 0
        if expensive:
            p = expensive[0]
            idx = [j for j, (pp, _) in enumerate(props) if pp is p and ks[j] > 0]
            if idx:
                got = p.propose([seqs[j] for j in idx], [ks[j] for j in idx])
                for j, d in zip(idx, got):  # drafted after its blocks were grown: the rest is rolled back
                    props[j] = (p, self._filtered(seqs[j], d))
        for (i, c), (pp, d), k in zip(cand, props, ks):
            d = list(d[:k])
            if d:
                c.draft, c.num_tokens, c.proposer = d, 1 + len(d), pp.name

    # largest step profiled up front: a few small forwards (at most one per power-of-two bucket).
    # Without a point, a size is costed in proportion to tokens from the largest point below it;
    # at a small batch, where a step of 4 rows and one of 36 take about the same time, that made
    # every plan past 16 rows look 2x too dear, so the tail of a job never tried one (and so never
    # measured one): drafts stayed short where long ones were nearly free.
    MAX_PROFILED_ROWS = 64

    def _ensure_point(self, rows: int, context: int, num_seqs: int) -> None:
        """Profile a step of `rows` query rows from `num_seqs` sequences once (shaped as this
        step's verifications: the rows past one per sequence are drafts), if the cost model has
        no measurement near its size yet (later real steps refine every point)."""
        x = rows
        if (self._profile is None or not 0 < rows <= self.MAX_PROFILED_ROWS or self.cost.has_bucket(x)
                or rows in self._profiled_sizes):
            return  # bigger steps are learnt from the steps themselves (interpolated between them)
        self._profiled_sizes.add(rows)
        t0 = time.perf_counter()
        self._profile(1, context)  # first-use costs (buffers, pages) stay out of the measurement
        seconds = self._profile(rows, context, num_seqs) if num_seqs < rows else self._profile(rows, context)
        self.cost.observe(x, seconds)
        self.stats.profile_s += time.perf_counter() - t0

    # ------------------------------------------------------------ feedback
    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """A step of decode and verification rows only (every row with logits, no prefill chunk)
        of num_tokens tokens took `seconds` (model and sampling): it feeds the cost model."""
        self.cost.observe(num_tokens, seconds)

    def verified(self, seq, proposer: str, drafted: int, accepted: int) -> None:
        """A verification of seq's draft from `proposer`: `accepted` of `drafted` kept."""
        done = seq.is_finished  # `finished` already ran: keep no per-sequence state for it
        self.acceptance.observe(seq.seq_id, proposer, drafted, accepted, per_seq=not done)
        if not done:
            for p in self.proposers:
                if p.name == proposer:
                    p.on_verified(seq, drafted, accepted)

    def finished(self, seq) -> None:
        """seq finished: the proposers may learn from its tokens."""
        self.acceptance.forget(seq.seq_id)
        for p in self.proposers:
            p.on_finished(seq)

    def preempted(self, seq) -> None:
        """seq lost its blocks."""
        for p in self.proposers:
            p.on_preempted(seq)
