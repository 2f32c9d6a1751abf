"""Engine-wide statistics: steps, tokens, preemptions, KV utilisation and time split."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineStats:
    """Cumulative over an LLM's life.

    Attributes:
        num_steps: forward passes run.
        num_preemptions: sequences preempted (recompute).
        num_prompt_tokens_computed: prefill tokens run through the model (recomputes included).
        num_output_tokens: tokens sampled.
        kv_utilization_sum: sum over steps of used / allocated slots (see `kv_utilization`).
        time_schedule_s, time_model_s, time_sample_s, time_detok_s: seconds in each phase.
        time_total_s: seconds inside the step loop.
        num_spec_steps: steps that verified speculative drafts.
        spec_verifies, spec_draft_tokens, spec_accepted_tokens: verified chunks, drafted
            tokens and accepted ones.
        structured_forced_tokens: tokens appended by jump-forward (forced by a grammar, never
            sampled one by one).
    """

    num_steps: int = 0
    num_preemptions: int = 0
    num_prompt_tokens_computed: int = 0
    num_output_tokens: int = 0
    num_batched_tokens_sum: int = 0
    kv_utilization_sum: float = 0.0
    time_schedule_s: float = 0.0
    time_model_s: float = 0.0
    time_sample_s: float = 0.0
    time_detok_s: float = 0.0
    time_total_s: float = 0.0
    num_spec_steps: int = 0
    spec_verifies: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    structured_forced_tokens: int = 0

    @property
    def kv_utilization(self) -> float:
        """Mean over steps of used token slots / allocated slots of running sequences."""
        return self.kv_utilization_sum / self.num_steps if self.num_steps else 0.0

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted / drafted speculative tokens (0 when none were drafted)."""
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else 0.0

    @property
    def mean_batched_tokens(self) -> float:
        """Mean tokens per forward pass."""
        return self.num_batched_tokens_sum / self.num_steps if self.num_steps else 0.0

    def breakdown(self) -> dict[str, float]:
        """Seconds per phase, plus "other" (Python overhead of the loop)."""
        known = self.time_schedule_s + self.time_model_s + self.time_sample_s + self.time_detok_s
        return {
            "schedule": self.time_schedule_s,
            "model": self.time_model_s,
            "sample": self.time_sample_s,
            "detokenize": self.time_detok_s,
            "other": max(0.0, self.time_total_s - known),
        }
