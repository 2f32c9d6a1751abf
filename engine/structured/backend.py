"""The grammar-backend seam: compile a constraint once, then one matcher per sequence.

A `GrammarBackend` turns a validated `StructuredOutputsParams` into a `CompiledGrammar`
(the expensive part, done once per distinct constraint); each constrained sequence gets
its own `GrammarMatcher` from it (cheap: a copy of the compiled start state). The engine
advances a matcher on every token it appends, asks it for token bitmasks before sampling,
and validates speculative drafts against it.

Bitmask layout (the field's convention, shared by llguidance and xgrammar): int32
`[num_rows, ceil(vocab_size / 32)]`, bit `t % 32` of word `t // 32` set when token `t`
is allowed. `llguidance_backend.LLGuidanceBackend` is the one implementation today; an
xgrammar backend would implement the same three classes.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional, Sequence

import torch

from .params import StructuredOutputsParams


class GrammarError(ValueError):
    """A constraint that does not compile (bad regex, schema or grammar); the message says why."""


class GrammarMatcher(ABC):
    """One sequence's position in its grammar."""

    @abstractmethod
    def accept_token(self, token: int) -> bool:
        """Advance by one token; False (and the matcher is in error) when the grammar forbids it."""

    @abstractmethod
    def validate_tokens(self, tokens: Sequence[int]) -> int:
        """How many leading tokens the grammar would accept from here (the state does not move)."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accepted tokens."""

    @abstractmethod
    def is_accepting(self) -> bool:
        """True when the output so far is a complete match (EOS is allowed)."""

    @abstractmethod
    def is_error(self) -> bool:
        """True after a forbidden token was accepted (the matcher stays in error)."""

    @abstractmethod
    def forced_tokens(self) -> list[int]:
        """Tokens the grammar forces next (the only legal continuation), possibly none."""

    def is_stopped(self) -> bool:
        """True when the output is complete and the grammar allows nothing but the end token
        (`GrammarBackend.eos_token_id`) next. Default False: never assumed."""
        return False

    def error_message(self) -> Optional[str]:
        """Why the matcher is in error (`is_error()`), in the backend's words; None when it is not.
        Besides a forbidden token, a backend may give up on its own while computing a mask or consuming
        a token the mask allowed (llguidance: "lexer error: too many expressions constructed" for
        `a{100000000}`), possibly part-way through an output. The engine ends the sequence there, before
        that token, and reports the completion as an error with this message."""
        return "the grammar rejected the output" if self.is_error() else None


class CompiledGrammar(ABC):
    """A compiled constraint; `matcher()` gives a fresh matcher at its start state."""

    @abstractmethod
    def matcher(self) -> GrammarMatcher:
        """A new matcher at the start of the grammar."""


class GrammarBackend(ABC):
    """Compiles constraints for one tokenizer and fills bitmasks.

    Attributes:
        name: "llguidance", ...
        vocab_size: tokens the bitmask covers (the tokenizer's vocabulary).
        eos_token_id: the one end token a complete match allows (None: the backend allows
            several and never reports `is_stopped`).
    """

    name = "backend"
    vocab_size: int = 0
    eos_token_id: "int | None" = None

    @property
    def bitmask_width(self) -> int:
        """int32 words per bitmask row: ceil(vocab_size / 32)."""
        return (self.vocab_size + 31) // 32

    @abstractmethod
    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """Compile a validated constraint.

        Raises:
            GrammarError: the regex, schema or grammar is invalid (the message names the problem).
        """

    @abstractmethod
    def fill_bitmasks(self, items: Sequence[tuple[GrammarMatcher, int, Sequence[int]]], bitmask: torch.Tensor) -> None:
        """Write bitmask rows from matcher states.

        Args:
            items: (matcher, first row, draft): rows first_row .. first_row + len(draft) get the
                masks after draft[:0], draft[:1], ..., draft[:len(draft)] (the matcher is left where
                it was). Every draft must be valid for its matcher (see `validate_tokens`).
            bitmask: [num_rows, bitmask_width] int32 on the CPU, contiguous; rows not named are
                left untouched.
        """
