"""tokenmill's inference engine: paged KV cache, continuous batching, chunked prefill.

Public API (vLLM's offline shape): `LLM`, `SamplingParams`, `RequestOutput`,
`CompletionOutput`, `EngineConfig`.
"""
from .config import EngineConfig, SamplingParams
from .outputs import CompletionOutput, RequestMetrics, RequestOutput
from .llm import LLM

__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "CompletionOutput", "RequestMetrics"]
