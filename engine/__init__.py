"""tokenmill's inference engine: paged KV cache, continuous batching, chunked prefill.

Public API (vLLM's offline shape): `LLM`, `SamplingParams`, `RequestOutput`,
`CompletionOutput`, `EngineConfig`.
"""
from .threads import configure_before_torch

configure_before_torch()  # OMP_WAIT_POLICY must be set before torch loads OpenMP (engine/threads.py)

from .config import EngineConfig, SamplingParams  # noqa: E402
from .outputs import CompletionOutput, RequestMetrics, RequestOutput  # noqa: E402
from .llm import LLM  # noqa: E402

__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "CompletionOutput", "RequestMetrics"]
