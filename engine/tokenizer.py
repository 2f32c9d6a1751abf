"""Tokenizer, chat template, incremental detokenization and stop strings.

Three pieces the engine needs around the model:

- `Tokenizer`: a thin, typed wrapper over a Hugging Face fast tokenizer (the
  Rust `tokenizers.Tokenizer` for encode/decode, `transformers` for the Jinja
  chat template). It loads from a GGUF file's metadata or from a local Hugging
  Face folder; nothing is downloaded.
- `IncrementalDetokenizer`: turns generated token ids into text a few tokens
  at a time, decoding only a small window of recent ids per step, and never
  emitting U+FFFD for a character whose UTF-8 bytes are split across tokens
  (nor, at the end, for one that generation stopped inside).
- `StopStringMatcher`: finds the earliest stop string that overlaps newly
  appended text, searching only the tail window that can contain one.

Units: token ids are ints in [0, vocab_size); text offsets are Python `str`
indices (code points), never bytes.
"""
from __future__ import annotations

import codecs
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import struct
import tempfile
from typing import Any, Iterable, Optional, Sequence

from .disk_cache import cache_root
from .gguf_index import plain_view_gguf_reader, truncation_error, unreadable_gguf

from .model_zoo import (DEFAULT_MODEL_DIST, DEFAULT_MODEL_DIST_VERSION, DEFAULT_MODEL_NAME,  # noqa: F401
                         named_model_path, resolve_default_gguf)

#: Chat end-of-turn / end-of-text tokens that end generation when the vocab
#: has them (ChatML, Llama 3, Gemma, Phi-3, SentencePiece `</s>`).
END_OF_TURN_TOKENS: tuple[str, ...] = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<end_of_turn>",
    "<|end|>",
    "</s>",
)

_REPLACEMENT_CHAR = "\ufffd"

logger = logging.getLogger(__name__)


def _byte_level_alphabet() -> dict[str, int]:
    """The printable stand-in character of each byte in byte-level BPE vocabularies (GPT-2 style),
    mapped back to its byte value.

    Bytes that are printable Latin-1 characters ('!'..'~', '¡'..'¬', '®'..'ÿ') stand for
    themselves; every other byte, in ascending order, gets the next code point from U+0100 up
    (so the space 0x20 is 'Ġ' and the newline 0x0A is 'Ċ').
    """
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}
    extra = 0x100
    for b in range(256):
        if b not in printable:
            table[chr(extra)] = b
            extra += 1
    return table


_BYTE_LEVEL_CHARS = _byte_level_alphabet()
_BYTE_FALLBACK_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def incomplete_utf8_tail(data: bytes) -> int:
    """Number of bytes at the end of `data` that begin a UTF-8 character without finishing it (0-3).

    Only a valid start counts (a lead byte followed by fewer continuation bytes than it needs,
    each one allowed there), since a later byte could complete it; a byte that can never start
    or continue a character (0xC0, 0xFF, a stray continuation byte) is invalid already and
    counts 0, as does a complete character, U+FFFD's own bytes EF BF BD included.
    """
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    decoder.decode(data[-4:], final=False)  # a cut character is at most 3 bytes: 4 always reach its lead byte
    pending = decoder.getstate()[0]
    if not pending:
        return 0
    # Python's decoder also waits on starts no byte can finish (ED A0 opens a surrogate): keep only
    # those that some continuation completes (E0 needs A0.., F0 needs 90.., ED and F4 take 80..)
    need = 2 if pending[0] < 0xE0 else 3 if pending[0] < 0xF0 else 4
    for second in (0x80, 0x90, 0xA0):
        rest = bytes([second]) + b"\x80" * 2 if len(pending) == 1 else b"\x80" * 3
        try:
            (pending + rest[: need - len(pending)]).decode("utf-8")
            return len(pending)
        except UnicodeDecodeError:
            continue
    return 0


#: Bump when the cached tokenizer files' layout or conversion changes.
_CACHE_FORMAT = 1


def tokenizer_cache_root() -> Optional[str]:
    """Folder of converted GGUF tokenizers, or None when the disk cache is off.

    `$TOKENMILL_CACHE_DIR/tokenizers` if set, else
    `$XDG_CACHE_HOME/tokenmill/tokenizers` (default `~/.cache/...`).
    `TOKENMILL_NO_DISK_CACHE=1` turns the disk cache off.
    """
    return cache_root("tokenizers")


def _cache_dir_for(gguf_path: str) -> Optional[str]:
    """Cache entry of one GGUF file: keyed by its path, size, mtime and the HF library versions."""
    root = tokenizer_cache_root()
    if root is None:
        return None
    import tokenizers
    import transformers

    st = os.stat(gguf_path)
    key = f"{gguf_path}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}|{tokenizers.__version__}|{_CACHE_FORMAT}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:20]
    stem = os.path.splitext(os.path.basename(gguf_path))[0]
    return os.path.join(root, f"{stem}-{digest}")


def _load_from_cache(entry: str) -> Any:
    """The HF tokenizer saved in cache `entry`, or None if absent or unreadable."""
    if not os.path.isfile(os.path.join(entry, "tokenizer.json")):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(entry, local_files_only=True)
    except Exception as exc:  # a corrupt entry must never block loading: convert again
        logger.warning("ignoring unreadable tokenizer cache %s: %s", entry, exc)
        return None


def _save_to_cache(hf_tokenizer: Any, entry: str) -> None:
    """Save atomically (temp folder + rename); a concurrent writer or a read-only disk is not an error."""
    parent = os.path.dirname(entry)
    tmp: Optional[str] = None
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tmp-", dir=parent)
        hf_tokenizer.save_pretrained(tmp)
        os.rename(tmp, entry)
        tmp = None
    except OSError as exc:
        if not os.path.isdir(entry):
            logger.warning("could not cache the converted tokenizer in %s: %s", entry, exc)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _convert_gguf(path: str) -> Any:
    """Build the HF fast tokenizer from a GGUF file's metadata (reads the whole vocab: seconds).

    Raises:
        TruncatedGGUF: the file is shorter than its header says (named, with both sizes), where
            transformers' reader fails in numpy (`cannot reshape array of size ...`).
        ValueError: a header transformers' reader cannot parse (a garbage count or string length
            ends in `'utf-8' codec can't decode ...`): the file named as corrupt (`unreadable_gguf`).
    """
    from transformers import AutoTokenizer

    folder, name = os.path.split(path)
    try:
        with plain_view_gguf_reader():  # transformers parses the vocabulary with gguf.GGUFReader
            return AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    except Exception as exc:
        truncated = truncation_error(path)
        if truncated is not None:
            raise truncated from exc
        if isinstance(exc, (UnicodeDecodeError, struct.error, OverflowError, IndexError)):
            raise unreadable_gguf(path, exc) from exc
        raise


@functools.lru_cache(maxsize=8)
def _load_hf_gguf(path: str) -> Any:
    """The HF fast tokenizer of a GGUF file, once per process and path.

    Converting from GGUF takes seconds to tens of seconds (transformers walks the whole vocabulary,
    262k entries for Gemma 3); the converted tokenizer is also kept on disk (`tokenizer_cache_root()`),
    which loads faster.
    """
    entry = _cache_dir_for(path)
    if entry is not None:
        cached = _load_from_cache(entry)
        if cached is not None:
            return cached
    hf = _convert_gguf(path)
    if entry is not None:
        _save_to_cache(hf, entry)
    return hf


@functools.lru_cache(maxsize=8)
def _load_hf_folder(folder: str) -> Any:
    """Load (once per process and folder) the HF fast tokenizer of a local folder."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


def _generation_config_eos(folder: str) -> set[int]:
    """EOS ids listed in a folder's generation_config.json (int or list), if any."""
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        return set()
    try:
        with open(path, encoding="utf-8") as fh:
            value = json.load(fh).get("eos_token_id")
    except (OSError, ValueError):
        return set()
    if isinstance(value, int):
        return {value}
    if isinstance(value, list):
        return {v for v in value if isinstance(v, int)}
    return set()


CHAT_ROLES = ("system", "user", "assistant")  # every chat template renders these
TOOL_ROLE = "tool"  # accepted where the model's chat template handles tool messages (see Tokenizer.chat_roles)


def validate_messages(messages: Any, roles: Sequence[str] = (*CHAT_ROLES, TOOL_ROLE)) -> None:
    """Check a chat conversation: a non-empty list of {role, content} dicts, each role one of `roles`,
    each content a string that is not empty or all blank.

    The one rule for conversations: `LLM.chat` and a job's `messages` rows both apply it, so both refuse
    the same conversations in the same words (`messages is null`, `messages[1].role must be one of
    ['system', 'user', 'assistant'], got 'wizard'`, `messages[0].content is empty`).

    Args:
        roles: the roles accepted (`Tokenizer.chat_roles` for a model's template).

    Raises:
        ValueError: naming the index of the bad message, the field and the bad value.
    """
    if messages is None:  # a null `messages` cell reads the same as LLM.chat([None]), as `prompt is null` does
        raise ValueError("messages is null")
    if not isinstance(messages, (list, tuple)) or not messages:
        got = "an empty list" if isinstance(messages, (list, tuple)) else type(messages).__name__
        raise ValueError(f"messages must be a non-empty list of {{role, content}}, got {got}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be a {{role, content}} object, got {type(m).__name__}")
        for key in ("role", "content"):
            if key not in m:
                raise ValueError(f"messages[{i}] is missing {key!r}")
        role, content = m["role"], m["content"]
        if not isinstance(role, str) or role not in roles:
            raise ValueError(f"messages[{i}].role must be one of {list(roles)}, got {role!r}")
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string, got {type(content).__name__}")
        if not content.strip():
            raise ValueError(f"messages[{i}].content is empty ({content!r})")


class Tokenizer:
    """A Hugging Face fast tokenizer with the few operations the engine uses.

    Build it with `Tokenizer.from_gguf(path)`, `Tokenizer.from_pretrained(folder)`
    or `Tokenizer.default()`. Encode/decode run in the Rust `tokenizers`
    backend (no Python-side clean-up), so `decode` is exactly what the
    incremental detokenizer reproduces.

    Attributes:
        vocab_size: number of token ids, added/special tokens included.
        eos_token_ids: every id that should end generation: the tokenizer's
            EOS, chat end-of-turn tokens (`END_OF_TURN_TOKENS`) present in the
            vocab, and a folder's generation_config.json `eos_token_id`s.
        eos_token_id: the tokenizer's own EOS id, or None.
        bos_token_id: the tokenizer's BOS id, or None (whether it is *added*
            is the tokenizer's post-processor's business).
        has_chat_template: whether `apply_chat_template` can be used.
        chat_roles: the message roles `apply_chat_template` accepts: system, user, assistant, and
            tool when the chat template handles tool messages.
        name_or_path: where it was loaded from.
    """

    def __init__(self, hf_tokenizer: Any, name_or_path: str = "", extra_eos_ids: Iterable[int] = ()) -> None:
        """Wrap a loaded `transformers` fast tokenizer (one with a Rust backend).

        Raises:
            TypeError: `hf_tokenizer` has no fast (Rust) backend.
        """
        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise TypeError(f"{type(hf_tokenizer).__name__} has no fast backend_tokenizer; a fast tokenizer is required")
        self.hf = hf_tokenizer
        self.backend = backend
        self.name_or_path = name_or_path
        self.vocab_size: int = int(backend.get_vocab_size(with_added_tokens=True))
        self.eos_token_id: Optional[int] = hf_tokenizer.eos_token_id
        self.bos_token_id: Optional[int] = hf_tokenizer.bos_token_id
        eos: set[int] = set() if self.eos_token_id is None else {int(self.eos_token_id)}
        for tok in END_OF_TURN_TOKENS:
            tid = backend.token_to_id(tok)
            if tid is not None:
                eos.add(int(tid))
        eos.update(int(i) for i in extra_eos_ids if 0 <= int(i) < self.vocab_size)
        self.eos_token_ids: set[int] = eos
        self.has_chat_template: bool = bool(getattr(hf_tokenizer, "chat_template", None))
        # a template that handles tool messages tests for the role by name (`message.role == "tool"`:
        # Llama 3.1, Qwen2.5, Mistral); one that does not (SmolLM2's ChatML) renders any role verbatim,
        # `<|im_start|>tool` included, as if it were a turn the model knows
        template = str(getattr(hf_tokenizer, "chat_template", None) or "")
        self.chat_roles: tuple[str, ...] = CHAT_ROLES + (
            (TOOL_ROLE,) if re.search(rf"""["']{TOOL_ROLE}["']""", template) else ())
        self._byte_scheme: Optional[str] = _byte_scheme(backend)
        added = getattr(hf_tokenizer, "added_tokens_decoder", {})
        self._special_ids: frozenset[int] = frozenset(int(i) for i, t in added.items() if getattr(t, "special", False))

    # ---------------------------------------------------------------- loading
    @classmethod
    def from_gguf(cls, path: str) -> "Tokenizer":
        """Build the tokenizer (and chat template) from a GGUF file's metadata.

        The conversion reads the whole vocab from the file (10-25 s here); it
        is cached per resolved path for the life of the process, and on disk
        (see `tokenizer_cache_root`) for later processes (about 1 s).

        Raises:
            FileNotFoundError: `path` is not a file.
            TruncatedGGUF: the file is shorter than its header says (`engine.gguf_index`).
        """
        real = os.path.realpath(path)
        if not os.path.isfile(real):
            raise FileNotFoundError(f"GGUF file not found: {path}")
        return cls(_load_hf_gguf(real), name_or_path=real)

    @classmethod
    def from_pretrained(cls, folder: str) -> "Tokenizer":
        """Load from a local Hugging Face folder (tokenizer.json / tokenizer_config.json).

        Raises:
            FileNotFoundError: `folder` is not a directory.
            OSError / ValueError: from `transformers` when the folder holds no usable tokenizer.
        """
        real = os.path.realpath(folder)
        if not os.path.isdir(real):
            raise FileNotFoundError(f"tokenizer folder not found: {folder}")
        return cls(_load_hf_folder(real), name_or_path=real, extra_eos_ids=_generation_config_eos(real))

    @classmethod
    def from_model(cls, model: str) -> "Tokenizer":
        """Load for an engine `model` string: a named model (`engine.model_zoo`), a .gguf path or a folder.

        `"dummy:<shape>"` models (random weights) use the default model's
        tokenizer; ids at or above its `vocab_size` decode to nothing.

        Raises:
            FileNotFoundError: nothing usable at `model`.
        """
        if model == DEFAULT_MODEL_NAME or model.startswith("dummy:"):
            return cls.default()
        named = named_model_path(model)  # "gemma-3-270m" (engine.model_zoo)
        if named is not None:
            return cls.from_gguf(named)
        if os.path.isdir(model):
            return cls.from_pretrained(model)
        return cls.from_gguf(model)

    @classmethod
    def default(cls) -> "Tokenizer":
        """The default model's tokenizer (SmolLM2-135M-Instruct, from its GGUF)."""
        return cls.from_gguf(resolve_default_gguf())

    # ------------------------------------------------------------ encode/decode
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in the text (e.g. `<|im_start|>`) map to their ids.

        With `add_special_tokens`, BOS/EOS are added only if the model's
        tokenizer is configured to (SmolLM2 adds none). A text that already
        starts with the BOS token (a rendered chat template, e.g. Llama 3's
        `<|begin_of_text|>`) never gets a second one.

        Raises:
            TypeError: `text` is not a str.
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return self._dedupe_bos(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        """`encode` for many texts at once (one call into the Rust backend, which may use threads).

        Raises:
            TypeError: an item is not a str.
        """
        texts = list(texts)
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise TypeError(f"texts[{i}] must be a str, got {type(t).__name__}")
        if not texts:
            return []
        return [self._dedupe_bos(e.ids) for e in self.backend.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def _dedupe_bos(self, ids: list[int]) -> list[int]:
        """Drop an added BOS in front of a BOS the text itself wrote."""
        bos = self.bos_token_id
        if bos is not None and len(ids) >= 2 and ids[0] == bos and ids[1] == bos:
            return ids[1:]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids` (invalid UTF-8 byte runs become U+FFFD, as in Hugging Face)."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_complete(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids` without a last character whose UTF-8 bytes are not all in `ids`.

        Byte-level BPE spells one character as several tokens; ids that stop inside one (a
        generation cut by `max_tokens`) end, under `decode`, in a U+FFFD that no model wrote.
        This drops it and keeps everything before it (`' 🎉'` cut after its first bytes gives
        `' '`). A complete U+FFFD (bytes EF BF BD) and invalid bytes that no later byte could
        make valid still read as U+FFFD, as in `decode`. For tokenizers whose tokens do not
        map to bytes (neither byte-level nor `<0xHH>` byte fallback) this is `decode`.
        """
        ids = list(ids)
        text = self.decode(ids, skip_special_tokens)
        if not text.endswith(_REPLACEMENT_CHAR) or self._byte_scheme is None:
            return text
        tail, first = b"", len(ids)  # the last >= 4 bytes, and the index of the first token they come from
        while first > 0 and len(tail) < 4:
            first -= 1
            tail = self._token_bytes(ids[first], skip_special_tokens) + tail
        cut = incomplete_utf8_tail(tail)
        if cut == 0:
            return text
        if self._byte_scheme == "byte_level":  # one U+FFFD for the whole cut character (maximal-subpart rule)
            return text[:-1]
        # byte fallback: one `<0xHH>` token per cut byte, and a run that fails as a whole becomes
        # U+FFFD byte by byte; decoding without those tokens gives the complete characters back
        k, dropped = len(ids), 0
        while dropped < cut:
            k -= 1
            dropped += len(self._token_bytes(ids[k], skip_special_tokens))
        return self.decode(ids[:k], skip_special_tokens)

    def _token_bytes(self, token_id: int, skip_special_tokens: bool) -> bytes:
        """The bytes one id contributes to `decode`'s output (b"" for a skipped special token or an unknown id)."""
        if skip_special_tokens and token_id in self._special_ids:
            return b""
        token = self.backend.id_to_token(int(token_id))
        if token is None:
            return b""
        if self._byte_scheme == "byte_level":
            if all(ch in _BYTE_LEVEL_CHARS for ch in token):
                return bytes(_BYTE_LEVEL_CHARS[ch] for ch in token)
            return token.encode()  # an added token, written as it is
        m = _BYTE_FALLBACK_TOKEN.fullmatch(token)
        return bytes([int(m.group(1), 16)]) if m else token.encode()

    def decode_batch(self, batch: Sequence[Sequence[int]], skip_special_tokens: bool = True) -> list[str]:
        """`decode` for many id lists in one backend call."""
        return self.backend.decode_batch([list(x) for x in batch], skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[Optional[str]]:
        """Vocabulary strings of `ids` (byte-level tokens look like 'Ġhello'); None for unknown ids."""
        return [self.backend.id_to_token(int(i)) for i in ids]

    def token_to_id(self, token: str) -> Optional[int]:
        """Id of a vocabulary string, or None."""
        return self.backend.token_to_id(token)

    # ----------------------------------------------------------- chat template
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render a conversation with the model's chat template (e.g. ChatML for SmolLM2).

        Args:
            messages: list of {"role": str, "content": str}; roles from `chat_roles`, contents
                not empty.
            add_generation_prompt: append the assistant turn header so the
                model answers.

        Raises:
            ValueError: malformed `messages` (`validate_messages`: the message's index, the field
                and the bad value), or the tokenizer has no chat template.
        """
        validate_messages(messages, self.chat_roles)
        if not self.has_chat_template:
            raise ValueError(f"tokenizer {self.name_or_path!r} has no chat template; pass plain prompts instead")
        clean = [{"role": m["role"], "content": m["content"]} for m in messages]
        return self.hf.apply_chat_template(clean, tokenize=False, add_generation_prompt=add_generation_prompt)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the templated conversation (no extra BOS: templates write their own).

        Raises:
            ValueError: as `apply_chat_template`.
        """
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)

    def __repr__(self) -> str:
        return f"Tokenizer({self.name_or_path!r}, vocab_size={self.vocab_size}, eos_token_ids={sorted(self.eos_token_ids)})"


def _byte_scheme(backend: Any) -> Optional[str]:
    """How a Rust tokenizer's decoder turns tokens into bytes: "byte_level" (GPT-2 style: every
    token spells bytes), "byte_fallback" (SentencePiece: `<0xHH>` tokens for bytes), or None."""
    try:
        spec = json.loads(backend.decoder.__getstate__())
    except (ValueError, AttributeError, TypeError):  # no decoder, or one that does not serialize
        return None
    if not isinstance(spec, dict):
        return None
    kinds = {d.get("type") for d in spec.get("decoders", [])} if spec.get("type") == "Sequence" else {spec.get("type")}
    if "ByteLevel" in kinds:
        return "byte_level"
    if "ByteFallback" in kinds:
        return "byte_fallback"
    return None


class IncrementalDetokenizer:
    """Streams the text of generated tokens, a few ids at a time, UTF-8 safe.

    The usual prefix/read-offset scheme: `ids` holds a few prompt ids (for
    context) followed by the generated ids. `prefix_offset..read_offset` is a
    small window already turned into text; each `add` decodes only
    `ids[prefix_offset:]` and emits what lies beyond the window's text. Text
    ending in U+FFFD (a character whose bytes are not all generated yet) is
    held back until a later token completes it, so no chunk carries a split
    character. Cost per call: two decodes of about (window + new) ids, about
    14 us per token here for ordinary text.

    For byte-level BPE tokenizers (SmolLM2, Llama 3, Qwen2, GPT-2), the
    concatenated chunks plus `finish()` equal
    `tokenizer.decode_complete(generated_ids)`: `decode`'s text, less a last
    character that generation stopped inside (its ids stay in `token_ids`).
    (SentencePiece tokenizers drop a leading space when decoding ids alone;
    the prompt context here keeps it, as vLLM does.)

    Attributes:
        text: all generated text emitted so far (never any prompt text).
        token_ids: all generated ids added so far.
    """

    #: Prompt ids kept as decoding context (for the leading space of the
    #: first generated token in SentencePiece-style decoders).
    CONTEXT_TOKENS = 6

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids)[-self.CONTEXT_TOKENS :]
        # A prompt that ends inside a character would shift text offsets: drop its context.
        if context and tokenizer.decode(context, skip_special_tokens).endswith(_REPLACEMENT_CHAR):
            context = []
        self._ids: list[int] = context
        self._num_context = len(context)
        self._prefix_offset = 0
        self._read_offset = len(context)
        self.text = ""

    @property
    def token_ids(self) -> list[int]:
        """Generated ids added so far (a copy)."""
        return self._ids[self._num_context :]

    def add(self, token_ids: Sequence[int]) -> str:
        """Append generated ids; return only the newly completed text ('' if none yet).

        Text is held back while it ends in an incomplete UTF-8 character.
        """
        if not token_ids:
            return ""
        self._ids.extend(int(t) for t in token_ids)
        return self._advance(final=False)

    def finish(self) -> str:
        """Flush held-back text at the end of generation. A character that generation stopped
        inside (only some of its bytes generated) is left out rather than written as U+FFFD, as
        vLLM does; a U+FFFD the model wrote whole is kept. After it, `text` equals
        `tokenizer.decode_complete(token_ids)` for byte-level tokenizers."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        decode = self.tokenizer.decode
        skip = self.skip_special_tokens
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset], skip)
        if final:
            new_text = self.tokenizer.decode_complete(self._ids[self._prefix_offset :], skip)
        else:
            new_text = decode(self._ids[self._prefix_offset :], skip)
        if len(new_text) <= len(prefix_text):
            return ""
        if not final and new_text.endswith(_REPLACEMENT_CHAR):
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self.text += delta
        return delta


class StopStringMatcher:
    """Finds the earliest stop string that overlaps newly appended generated text.

    `find(text, num_new_chars)` looks only at the tail window
    `num_new_chars + len(stop) - 1` for each stop string, so a stop inside a
    single token, across tokens, or straddling old and new text is found, and
    a match lying wholly in text already checked is not re-reported. The
    matcher only ever sees generated text, so it never matches the prompt.

    Raises:
        ValueError: a stop string is empty or not a str.
    """

    def __init__(self, stops: Iterable[str]) -> None:
        stops = list(stops or ())
        for i, s in enumerate(stops):
            if not isinstance(s, str):
                raise ValueError(f"stop[{i}] must be a str, got {type(s).__name__}")
            if not s:
                raise ValueError(f"stop[{i}] is an empty string")
        # Deduplicate (order kept).
        self.stops: tuple[str, ...] = tuple(dict.fromkeys(stops))
        self.max_len: int = max((len(s) for s in self.stops), default=0)

    def __bool__(self) -> bool:
        return bool(self.stops)

    def find(self, text: str, num_new_chars: int) -> Optional[tuple[int, str]]:
        """Return `(cut_index, stop)` for the earliest stop string overlapping the
        last `num_new_chars` characters of `text`, or None.

        `cut_index` is the start of the stop string in `text` (keep
        `text[:cut_index]`). When two stops start at the same index the longer
        wins (same cut either way).
        """
        if not self.stops or num_new_chars <= 0:
            return None
        n = len(text)
        new_start = n - min(num_new_chars, n)
        best: Optional[tuple[int, str]] = None
        for s in self.stops:
            start = max(0, new_start - len(s) + 1)
            # Stop searching past the best match found so far.
            end = n if best is None else min(n, best[0] + len(s))
            idx = text.find(s, start, end)
            if idx < 0:
                continue
            if best is None or idx < best[0] or (idx == best[0] and len(s) > len(best[1])):
                best = (idx, s)
        return best
