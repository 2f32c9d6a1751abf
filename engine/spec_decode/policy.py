"""How many tokens to draft for each sequence this step: goodput under a measured step-cost model.

A step's time grows with the tokens it runs, but not in proportion: at small batches a
step is bound by reading the weights (a few more tokens are almost free), at large
batches by arithmetic (every token costs its share). Drafting pays while the expected
accepted tokens it adds are worth more than the time they add. The policy maximises
goodput, expected generated tokens per second of step time (SmartSpec, Liu et al. 2024,
arXiv 2406.14066):

    goodput(k) = sum_i (1 + E_i(k_i)) / T(base + sum_i k_i),
    E_i(k) = a_i + a_i^2 + ... + a_i^k,

with a_i the sequence's acceptance rate per drafted position (an exponential moving
average of its verifications, starting from its proposer's average) and T the step-cost
model. Drafted tokens are ordered by expected gain, highest first; the plan is the prefix of
that order of highest goodput (every prefix is scored, as the step cost is not convex);
when a full batch already saturates the machine no draft pays and speculation turns
itself off.

T is measured: each step's (tokens, seconds) updates an exponential moving average per
power-of-two bucket of tokens, interpolated between buckets; buckets of up to 64 tokens
that no step has measured yet are seeded by one decode-like forward pass each.

In a job's tail (no request waiting) the job ends when its longest rows end: the decoder
then drafts only for those rows and counts only their tokens as the yield.
"""
from __future__ import annotations

import heapq
import math
from typing import Callable, Optional


class StepCostModel:
    """Seconds of a step as a function of its tokens: per power-of-two bucket of token counts, an
    EMA of the steps' token counts and seconds; piecewise linear between the buckets' points,
    and in proportion to tokens outside them (so an unmeasured size is never thought cheap).

    Args:
        decay: weight of the old values in each EMA update.
    """

    def __init__(self, decay: float = 0.8) -> None:
        self.decay = decay
        self.points: dict[int, tuple[float, float]] = {}  # bucket -> (tokens, seconds)
        self._sorted: Optional[list[tuple[float, float]]] = None  # the points in token order (cached)

    def observe(self, num_tokens: int, seconds: float) -> None:
        """Fold one measured step into the model."""
        if num_tokens <= 0 or seconds <= 0:
            return
        b = int(round(math.log2(num_tokens)))
        self._sorted = None
        old = self.points.get(b)
        if old is None:
            self.points[b] = (float(num_tokens), seconds)
        else:
            w = self.decay
            self.points[b] = (w * old[0] + (1 - w) * num_tokens, w * old[1] + (1 - w) * seconds)

    def has_bucket(self, num_tokens: int) -> bool:
        """Whether a step of about num_tokens tokens (its power-of-two bucket) was measured."""
        return num_tokens > 0 and int(round(math.log2(num_tokens))) in self.points

    def cost(self, num_tokens: int) -> Optional[float]:
        """Estimated seconds of a step of num_tokens tokens (None before any measurement)."""
        if not self.points:
            return None
        pts = self._sorted
        if pts is None:
            pts = self._sorted = sorted(self.points.values())
        n = float(num_tokens)
        if n <= pts[0][0]:  # in proportion below the smallest point too: never free tokens unmeasured
            return pts[0][1] * n / pts[0][0]
        for (n0, t0), (n1, t1) in zip(pts, pts[1:]):
            if n <= n1:
                return t0 + (n - n0) * (t1 - t0) / max(n1 - n0, 1e-9)
        n_last, t_last = pts[-1]
        return t_last * n / n_last


class AcceptanceTracker:
    """Per-sequence and per-proposer acceptance rate per drafted position (EMAs).

    The prior is optimistic (0.8, about what prompt lookup reaches on repetitive text
    here): a policy that starts pessimistic never drafts and so never learns. Estimates
    that stop being observed drift back towards the prior (`relax`, once per step), so a
    proposer that failed early is tried again later (exploration).
    """

    def __init__(self, prior: float = 0.8, decay: float = 0.7, relax_rate: float = 0.01) -> None:
        self.prior, self.decay, self.relax_rate = prior, decay, relax_rate
        self.by_proposer: dict[str, float] = {}
        self.by_seq: dict[tuple[int, str], float] = {}

    def rate(self, seq_id: int, proposer: str) -> float:
        """The estimate for seq_id's drafts from `proposer`."""
        r = self.by_seq.get((seq_id, proposer))
        return r if r is not None else self.by_proposer.get(proposer, self.prior)

    def observe(self, seq_id: int, proposer: str, drafted: int, accepted: int, per_seq: bool = True) -> None:
        """A verification: `accepted` of `drafted` positions kept (the first reject ends it);
        per_seq=False updates the proposer's estimate only (the sequence has finished)."""
        if drafted <= 0:
            return
        trials = accepted + (1 if accepted < drafted else 0)
        obs = accepted / max(trials, 1)
        tables = [(self.by_proposer, proposer)]
        if per_seq:
            tables.append((self.by_seq, (seq_id, proposer)))
        for table, key in tables:
            old = table.get(key)
            table[key] = obs if old is None else self.decay * old + (1 - self.decay) * obs

    def relax(self) -> None:
        """Move every estimate a step towards the prior (called once per engine step)."""
        a = self.relax_rate
        for table in (self.by_proposer, self.by_seq):
            for key, r in table.items():
                table[key] = r + a * (self.prior - r)

    def forget(self, seq_id: int) -> None:
        """Drop a finished sequence's estimates."""
        for key in [k for k in self.by_seq if k[0] == seq_id]:
            del self.by_seq[key]


def worth_drafting(best_rate: float, candidates: int, base_tokens: int, base_yield: float,
                   cost: Callable[[int], Optional[float]], budget: int, margin: float = 0.05) -> bool:
    """Whether any draft can pay this step: one token for each of `candidates` sequences at the
    best acceptance rate must raise goodput by more than `margin` (False also before any
    measurement). Checked before the proposers run, so a saturated step costs them nothing."""
    t0 = cost(base_tokens)
    m = min(candidates, budget)
    if t0 is None or t0 <= 0 or m <= 0 or best_rate <= 0:
        return False
    t1 = cost(base_tokens + m)
    return t1 is not None and (base_yield + m * best_rate) / t1 > (1 + margin) * base_yield / t0


def choose_lengths(rates: list[float], caps: list[int], base_tokens: int, base_yield: float,
                   cost: Callable[[int], Optional[float]], budget: int, margin: float = 0.05) -> list[int]:
    """Draft lengths maximising expected tokens per second of step time.

    Args:
        rates: acceptance rate per drafted position, per candidate sequence.
        caps: most draft tokens each candidate may get (its proposal length, max_tokens, ...).
        base_tokens: tokens the step runs without drafts.
        base_yield: tokens it produces without drafts (one per decoding sequence).
        cost: the step-cost model (seconds for a token count; None = unknown).
        budget: most draft tokens in all.
        margin: the plan is kept only if its expected goodput beats no drafts by this
            fraction (the model's error, and the drafts' own cost: logits for every drafted
            row, the proposers' time), else nothing is drafted.
    Returns:
        draft length per candidate.
    """
    ks = [0] * len(rates)
    t0 = cost(base_tokens)
    if t0 is None or t0 <= 0 or budget <= 0:
        return ks
    # the draft tokens in order of expected gain (a sequence's j-th token gains a_i^j, so each
    # sequence's tokens come in its own order): the best plan of n tokens is the first n of
    # them, so scan every n and keep the best (the step cost is not convex: a plan can pay only
    # past a bump in it, where stopping at the first token that lowers goodput would not draft)
    heap = [(-r, i) for i, r in enumerate(rates) if caps[i] > 0 and r > 0]
    heapq.heapify(heap)
    order: list[int] = []
    taken = [0] * len(rates)
    best_n, best_goodput, total_yield = 0, base_yield / t0, base_yield
    while heap and len(order) < budget:
        neg_gain, i = heapq.heappop(heap)
        gain = -neg_gain
        if gain < 1e-3:
            break  # expected to add a thousandth of a token: nothing after it pays
        order.append(i)
        taken[i] += 1
        total_yield += gain
        t = cost(base_tokens + len(order))
        if t is None:
            break
        if total_yield / t > best_goodput:
            best_n, best_goodput = len(order), total_yield / t
        if taken[i] < caps[i]:
            heapq.heappush(heap, (-(gain * rates[i]), i))
    if best_n == 0 or best_goodput <= (1 + margin) * base_yield / t0:
        return ks
    for i in order[:best_n]:
        ks[i] += 1
    return ks
    heap = [(-r, i) for i, r in enumerate(rates) if caps[i] > 0 and r > 0]
    heapq.heapify(heap)
    total_yield, extra = base_yield, 0
    t = t0
    while heap and extra < budget:
        neg_gain, i = heapq.heappop(heap)
        gain = -neg_gain
        t_next = cost(base_tokens + extra + 1)
        if t_next is None or (total_yield + gain) / t_next <= total_yield / t:
            break  # the best remaining draft token lowers goodput; every other one gains less
        ks[i] += 1
        extra += 1
        total_yield += gain
        t = t_next
        if ks[i] < caps[i]:
            heapq.heappush(heap, (-(gain * rates[i]), i))
    if extra and total_yield / t <= (1 + margin) * base_yield / t0:
        return [0] * len(rates)
    return ks

