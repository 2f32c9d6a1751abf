"""Structured outputs: constrain generation to a JSON Schema, regex, choice or grammar.

- `params.StructuredOutputsParams`: what a request asks for (vLLM's names).
- `schema.close_objects`: JSON Schema objects closed by default (no keys beyond `properties`).
- `backend`: the grammar-backend seam (`GrammarBackend`, `CompiledGrammar`, `GrammarMatcher`).
- `llguidance_backend.LLGuidanceBackend`: the implementation (llguidance).
- `bitmask`: the int32 token bitmask and its vectorised apply to logits.
- `manager.StructuredOutputManager`: the engine's compile cache (one compile per distinct
  constraint, by content hash) and the per-step mask fill on a worker thread.
"""
from .backend import CompiledGrammar, GrammarBackend, GrammarError, GrammarMatcher
from .bitmask import allocate_bitmask, apply_token_bitmask_, unpack_bitmask
from .manager import StepMasks, StructuredOutputManager
from .params import StructuredOutputsParams

__all__ = ["CompiledGrammar", "GrammarBackend", "GrammarError", "GrammarMatcher", "StepMasks",
           "StructuredOutputManager", "StructuredOutputsParams", "allocate_bitmask", "apply_token_bitmask_",
           "unpack_bitmask"]
