"""The engine's structured-output state: a compile cache and the per-step mask fill.

`StructuredOutputManager.matcher_for(params)` compiles a constraint the first time its
content hash (`StructuredOutputsParams.key`) is seen and hands each request a fresh
matcher from the cached grammar; a constraint that fails to compile is cached as its error
message, so a job with 100k rows and 3 schemas compiles 3 times, bad ones included.

`start_fill(rows)` allocates the step's one bitmask `[num_rows, ceil(vocab / 32)]` int32
and fills it on a worker thread (llguidance releases the GIL), so the fill runs while the
forward pass does; `StepMasks.result()` waits for it just before sampling. The time the
fill took and the time the sampler still had to wait are both kept, so how much of the
fill the forward hid can be reported.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from .backend import GrammarBackend, GrammarError, GrammarMatcher
from .bitmask import allocate_bitmask
from .params import StructuredOutputsParams


@dataclass
class StructuredStats:
    """Cumulative counts (seconds are wall time).

    Attributes:
        compiles: constraints compiled (cache misses, failed compiles included).
        cache_hits: requests served by an already compiled constraint.
        compile_s: seconds spent compiling.
        steps: steps that filled a bitmask; rows: constrained rows filled.
        fill_s: seconds the worker spent filling masks.
        wait_s: seconds the step waited for the fill after the forward pass (the unhidden part).
    """

    compiles: int = 0
    cache_hits: int = 0
    compile_s: float = 0.0
    steps: int = 0
    rows: int = 0
    fill_s: float = 0.0
    wait_s: float = 0.0

    @property
    def hidden_share(self) -> float:
        """Share of the fill time the forward pass hid (1.0 = none waited for)."""
        return 1.0 - min(self.wait_s / self.fill_s, 1.0) if self.fill_s > 0 else 1.0


@dataclass
class StepMasks:
    """The bitmask of one step, possibly still being filled.

    Attributes:
        bitmask: [num_rows, W] int32; rows of unconstrained sequences are all ones (-1).
        constrained: row indexes that carry a grammar mask.
    """

    bitmask: torch.Tensor
    constrained: list[int]
    future: Optional[Future] = None
    stats: Optional[StructuredStats] = None

    def result(self) -> torch.Tensor:
        """The filled bitmask (waits for the worker; re-raises its error)."""
        if self.future is not None:
            t0 = time.perf_counter()
            self.future.result()
            if self.stats is not None:
                self.stats.wait_s += time.perf_counter() - t0
            self.future = None
        return self.bitmask


class StructuredOutputManager:
    """Args:
        backend_factory: builds the grammar backend on first use (an engine that never sees a
            constraint never builds one).
        cache_size: compiled constraints kept (least recently used dropped first).
        async_fill: fill masks on a worker thread during the forward pass (False: inline).
    """

    def __init__(self, backend_factory: Callable[[], GrammarBackend], cache_size: int = 4096,
                 async_fill: bool = True) -> None:
        self._factory = backend_factory
        self._backend: Optional[GrammarBackend] = None
        self.cache: "OrderedDict[str, object]" = OrderedDict()
        self.cache_size = cache_size
        self.async_fill = async_fill
        self.stats = StructuredStats()
        self._pool: Optional[ThreadPoolExecutor] = None

    @classmethod
    def for_backend(cls, name: str, tokenizer) -> "StructuredOutputManager":
        """A manager whose grammar backend ("llguidance" or "xgrammar", the engine's
        `structured_outputs_backend`) is built over `tokenizer` on first use.

        Raises:
            ValueError: "xgrammar" when xgrammar is not installed.
        """
        if name == "xgrammar":
            from . import xgrammar_backend

            if not xgrammar_backend.available():
                raise ValueError("structured_outputs_backend='xgrammar': xgrammar is not installed "
                                 "(pip install 'tokenmill[xgrammar]')")

        def factory() -> GrammarBackend:  # holds the tokenizer only (no reference back to the engine)
            if name == "xgrammar":
                from .xgrammar_backend import XGrammarBackend

                return XGrammarBackend(tokenizer)
            from .llguidance_backend import LLGuidanceBackend

            return LLGuidanceBackend(tokenizer)

        return cls(factory)

    @property
    def backend(self) -> GrammarBackend:
        """The grammar backend (built on first use)."""
        if self._backend is None:
            self._backend = self._factory()
        return self._backend

    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar of a validated constraint, from the cache when its key was seen.

        Raises:
            GrammarError: the constraint does not compile (also cached: it is not retried).
        """
        key = params.key()
        hit = self.cache.get(key)
        if hit is not None:
            self.cache.move_to_end(key)
            self.stats.cache_hits += 1
        else:
            t0 = time.perf_counter()
            try:
                hit = self.backend.compile(params)
            except GrammarError as exc:
                hit = exc
            except Exception as exc:  # noqa: BLE001 - a backend failure on one constraint stays that row's
                hit = GrammarError(f"structured_outputs.{params.kind}: {type(exc).__name__}: {exc}")
            self.stats.compiles += 1
            self.stats.compile_s += time.perf_counter() - t0
            self.cache[key] = hit
            if len(self.cache) > self.cache_size:
                self.cache.popitem(last=False)
        if isinstance(hit, GrammarError):
            raise hit
        return hit

    def matcher_for(self, params: StructuredOutputsParams) -> tuple[Optional[GrammarMatcher], Optional[str]]:
        """(a fresh matcher, None), or (None, the error message) for a constraint that fails."""
        problem = params.validate()
        if problem is not None:
            return None, problem
        try:
            return self.compile(params).matcher(), None
        except GrammarError as exc:
            return None, str(exc)

    def start_fill(self, rows: Sequence[tuple[Optional[GrammarMatcher], Sequence[int]]]) -> Optional[StepMasks]:
        """Start filling the step's bitmask.

        Args:
            rows: per sequence in logits-row order, (its matcher or None, its draft): a sequence
                takes 1 + len(draft) consecutive rows (the masks after draft[:0..len]).
        Returns:
            StepMasks for every row (None when no row is constrained).
        """
        items, constrained, r = [], [], 0
        for m, draft in rows:
            n = 1 + len(draft)
            if m is not None and not m.is_error():
                items.append((m, r, list(draft)))
                constrained.extend(range(r, r + n))
            r += n
        if not items:
            return None
        bitmask = allocate_bitmask(r, self.backend.vocab_size)
        st = self.stats
        st.steps += 1
        st.rows += len(constrained)

        def fill() -> None:
            t0 = time.perf_counter()
            self.backend.fill_bitmasks(items, bitmask)
            st.fill_s += time.perf_counter() - t0

        masks = StepMasks(bitmask, constrained, stats=st)
        if self.async_fill:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenmill-mask")
            masks.future = self._pool.submit(fill)
        else:
            fill()
        return masks
