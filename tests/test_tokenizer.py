"""Spec of engine/tokenizer.py, against the real default tokenizer (SmolLM2-135M-Instruct GGUF).

Expected values are derived from the Hugging Face tokenizer built from the
same GGUF, or from the token stream itself; nothing is hard-coded except the
facts of the model card (ChatML markers, `<|im_end|>` is EOS).
"""
from __future__ import annotations

import copy
import json
import os
import random

import pytest

from engine import tokenizer as tokenizer_module
from engine.tokenizer import (
    IncrementalDetokenizer,
    StopStringMatcher,
    Tokenizer,
    incomplete_utf8_tail,
    resolve_default_gguf,
)

FFFD = "\ufffd"

TEXTS = {
    "ascii": "The capital of France is Paris. It has 2,148,271 residents!",
    "emoji": "Party time 🎉🎉 with family 👨‍👩‍👧‍👦 and a thumbs up 👍🏽.",
    "cjk": "東京は日本の首都です。北京是中国的首都。서울은 한국의 수도입니다.",
    "accented": "Crème brûlée, naïve café, São Paulo, Zürich, Ångström, żółć.",
    "mixed": "Price: 5€ — 日本語 mixed with émojis 🚀✨ and math ∑x² ≤ ∞.\n\tTabs & newlines\n",
}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.default()


@pytest.fixture(scope="module")
def chat_prompt_ids(tok: Tokenizer) -> list[int]:
    return tok.encode_chat([{"role": "user", "content": "Say something."}])


def stream(tok: Tokenizer, prompt: list[int], ids: list[int], chunk: int = 1, skip: bool = True):
    """Feed `ids` `chunk` at a time; return (chunks, detokenizer)."""
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    chunks = [detok.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    chunks.append(detok.finish())
    return chunks, detok


# --------------------------------------------------------------------- loading
def test_resolve_default_gguf_finds_the_wheel_file():
    path = resolve_default_gguf()
    assert path.endswith(".gguf") and os.path.isfile(path)


def test_loading_is_cached_per_path(tok: Tokenizer):
    again = Tokenizer.from_gguf(resolve_default_gguf())
    assert again.hf is tok.hf  # the conversion ran once


def test_disk_cache_round_trip(tok: Tokenizer, tmp_path, monkeypatch):
    """The converted tokenizer saved to the disk cache loads back identical."""
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TOKENMILL_NO_DISK_CACHE", raising=False)
    entry = tokenizer_module._cache_dir_for(resolve_default_gguf())
    assert entry is not None and entry.startswith(str(tmp_path))
    assert tokenizer_module._load_from_cache(entry) is None  # empty cache
    tokenizer_module._save_to_cache(tok.hf, entry)
    tokenizer_module._save_to_cache(tok.hf, entry)  # a second writer is harmless
    assert [p.name for p in tmp_path.joinpath("tokenizers").iterdir()] == [os.path.basename(entry)]
    back = Tokenizer(tokenizer_module._load_from_cache(entry))
    assert back.backend.to_str() == tok.backend.to_str()
    assert back.hf.chat_template == tok.hf.chat_template
    assert (back.vocab_size, back.eos_token_ids, back.bos_token_id) == (tok.vocab_size, tok.eos_token_ids, tok.bos_token_id)
    texts = list(TEXTS.values())
    assert back.encode_batch(texts) == tok.encode_batch(texts)
    msgs = [{"role": "user", "content": "Hi"}]
    assert back.apply_chat_template(msgs) == tok.apply_chat_template(msgs)


def test_corrupt_cache_entry_is_ignored(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    assert tokenizer_module._load_from_cache(str(tmp_path)) is None


def test_disk_cache_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("TOKENMILL_NO_DISK_CACHE", "1")
    assert tokenizer_module.tokenizer_cache_root() is None
    assert tokenizer_module._cache_dir_for(resolve_default_gguf()) is None


def test_from_model_names(tok: Tokenizer):
    assert Tokenizer.from_model("smollm2-135m-instruct").hf is tok.hf
    assert Tokenizer.from_model(resolve_default_gguf()).hf is tok.hf
    assert Tokenizer.from_model("dummy:llama-3-8b").hf is tok.hf  # dummy weights borrow the default tokenizer
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_model("/nonexistent/model.gguf")


def test_from_pretrained_folder_and_generation_config_eos(tok: Tokenizer, tmp_path):
    """A Hugging Face folder loads; generation_config.json's eos_token_id list joins eos_token_ids."""
    tok.hf.save_pretrained(tmp_path)
    extra = tok.token_to_id("<|im_start|>")  # any in-vocab id the folder declares as an end token
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [tok.eos_token_id, extra]}))
    folder = Tokenizer.from_pretrained(str(tmp_path))
    assert folder.encode(TEXTS["mixed"]) == tok.encode(TEXTS["mixed"])
    assert folder.eos_token_ids == tok.eos_token_ids | {extra}
    assert Tokenizer.from_model(str(tmp_path)).hf is folder.hf
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_pretrained(str(tmp_path / "missing"))


def test_vocab_and_eos(tok: Tokenizer):
    assert tok.vocab_size == len(tok.hf)
    assert tok.eos_token_id == tok.hf.eos_token_id
    assert tok.token_to_id("<|im_end|>") == tok.eos_token_id
    assert 2 in tok.eos_token_ids  # <|im_end|>, the model card's EOS
    assert tok.token_to_id("<|endoftext|>") in tok.eos_token_ids
    assert tok.token_to_id("<|im_start|>") not in tok.eos_token_ids
    assert all(0 <= i < tok.vocab_size for i in tok.eos_token_ids)


# --------------------------------------------------------------- encode/decode
@pytest.mark.parametrize("name", sorted(TEXTS))
def test_encode_decode_round_trip_matches_hf(tok: Tokenizer, name: str):
    text = TEXTS[name]
    ids = tok.encode(text)
    assert ids == tok.hf.encode(text)
    assert tok.decode(ids) == text
    assert tok.decode(ids) == tok.hf.decode(ids, skip_special_tokens=True)


def test_no_bos_added(tok: Tokenizer):
    ids = tok.encode("Hello world")
    assert ids == tok.encode("Hello world", add_special_tokens=False)
    assert tok.bos_token_id not in ids


def test_bos_added_only_when_configured_and_never_twice(tok: Tokenizer):
    """A tokenizer whose post-processor adds BOS (Llama-style): BOS once, even before a templated BOS."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    bos = tok.hf.bos_token
    rust = RustTokenizer.from_str(tok.backend.to_str())
    rust.post_processor = TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tok.bos_token_id)])
    llama_like = Tokenizer(PreTrainedTokenizerFast(tokenizer_object=rust, bos_token=bos, eos_token=tok.hf.eos_token))
    plain = tok.encode("Hello world")
    assert llama_like.encode("Hello world") == [tok.bos_token_id] + plain
    assert llama_like.encode("Hello world", add_special_tokens=False) == plain
    assert llama_like.encode(bos + "Hello world") == [tok.bos_token_id] + plain
    assert llama_like.encode_batch([bos + "Hello world", "Hello world"]) == [[tok.bos_token_id] + plain] * 2


def test_encode_batch_equals_encode(tok: Tokenizer):
    texts = list(TEXTS.values()) + ["", "a"]
    assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]
    assert tok.encode_batch([]) == []
    assert tok.decode_batch(tok.encode_batch(texts)) == texts


def test_encode_rejects_non_str(tok: Tokenizer):
    with pytest.raises(TypeError):
        tok.encode(123)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"texts\[1\]"):
        tok.encode_batch(["ok", None])  # type: ignore[list-item]


def test_special_tokens_skipped_or_kept(tok: Tokenizer):
    ids = tok.encode("Hi<|im_end|>")
    assert ids[-1] == tok.token_to_id("<|im_end|>")  # parsed as one special token
    assert tok.decode(ids) == "Hi"
    assert tok.decode(ids, skip_special_tokens=False) == "Hi<|im_end|>"
    assert tok.convert_ids_to_tokens(ids[-1:]) == ["<|im_end|>"]


# ---------------------------------------------------------------- chat template
def test_chat_template_chatml(tok: Tokenizer):
    assert tok.has_chat_template
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    text = tok.apply_chat_template(msgs)
    assert "<|im_start|>system\n" in text  # the template's default system prompt
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert text == tok.hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)

    no_gen = tok.apply_chat_template(msgs, add_generation_prompt=False)
    assert not no_gen.endswith("<|im_start|>assistant\n") and text.startswith(no_gen)


def test_chat_template_keeps_given_system_and_turns(tok: Tokenizer):
    msgs = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    text = tok.apply_chat_template(msgs)
    assert text.count("<|im_start|>system") == 1 and "Be terse." in text
    positions = [text.index(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>") for m in msgs]
    assert positions == sorted(positions)


def test_encode_chat_parses_markers(tok: Tokenizer):
    msgs = [{"role": "user", "content": "Hi"}]
    ids = tok.encode_chat(msgs)
    im_start = tok.token_to_id("<|im_start|>")
    assert ids[0] == im_start  # no BOS in front of the template's own marker
    assert ids.count(im_start) == 3  # system, user, assistant header
    assert tok.decode(ids, skip_special_tokens=False) == tok.apply_chat_template(msgs)


ROLES = "['system', 'user', 'assistant']"  # SmolLM2's ChatML template has no tool messages


@pytest.mark.parametrize(
    "messages, problem",
    [
        (None, "messages is null"),  # a job's null `messages` cell says the same
        ("hello", "messages must be a non-empty list of {role, content}, got str"),
        ({"role": "user", "content": "hi"}, "messages must be a non-empty list of {role, content}, got dict"),
        ([], "messages must be a non-empty list of {role, content}, got an empty list"),
        (["hi"], "messages[0] must be a {role, content} object, got str"),
        ([{"content": "hi"}], "messages[0] is missing 'role'"),
        ([{"role": "user", "content": "a"}, {"role": "user"}], "messages[1] is missing 'content'"),
        ([{"role": "user", "content": 5}], "messages[0].content must be a string, got int"),
        ([{"role": None, "content": "hi"}], f"messages[0].role must be one of {ROLES}, got None"),
        ([{"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}],
         f"messages[1].role must be one of {ROLES}, got 'wizard'"),
        ([{"role": "tool", "content": "42"}], f"messages[0].role must be one of {ROLES}, got 'tool'"),
        ([{"role": "system", "content": "Be terse."}, {"role": "user", "content": ""}],
         "messages[1].content is empty ('')"),
        ([{"role": "user", "content": " \n"}], "messages[0].content is empty (' \\n')"),
    ],
)
def test_malformed_messages_raise_value_error(tok: Tokenizer, messages, problem):
    with pytest.raises(ValueError) as exc:
        tok.apply_chat_template(messages)
    assert str(exc.value) == problem


def test_the_tool_role_is_accepted_where_the_chat_template_handles_it(tok: Tokenizer):
    assert tok.chat_roles == ("system", "user", "assistant")  # ChatML as SmolLM2 ships it: no tool turns
    tool_template = ("{% for m in messages %}{% if m['role'] == 'tool' %}<tool>{{ m['content'] }}</tool>"
                     "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}")
    hf = copy.deepcopy(tok.hf)
    hf.chat_template = tool_template
    with_tools = Tokenizer(hf, "with-tools")
    assert with_tools.chat_roles == ("system", "user", "assistant", "tool")
    assert with_tools.apply_chat_template([{"role": "user", "content": "2*21?"}, {"role": "tool", "content": "42"}],
                                          add_generation_prompt=False) == "<|im_start|>user\n2*21?<|im_end|>\n<tool>42</tool>"


# --------------------------------------------------------- incremental detokenize
@pytest.mark.parametrize("name", sorted(TEXTS))
@pytest.mark.parametrize("chunk", [1, 3])
def test_streamed_text_equals_one_shot_decode(tok: Tokenizer, chat_prompt_ids, name: str, chunk: int):
    ids = tok.encode(TEXTS[name])
    chunks, detok = stream(tok, chat_prompt_ids, ids, chunk)
    assert "".join(chunks) == tok.decode(ids) == TEXTS[name]
    assert detok.text == TEXTS[name]
    assert detok.token_ids == ids
    assert not any(FFFD in c for c in chunks)


@pytest.mark.parametrize("name", ["emoji", "cjk", "mixed"])
def test_split_characters_are_held_back(tok: Tokenizer, name: str):
    """The texts really split characters across tokens, and streaming holds them back."""
    ids = tok.encode(TEXTS[name])
    partial = [i for i in ids if FFFD in tok.decode([i])]
    assert partial, "test text must contain a character split across byte-level tokens"
    detok = IncrementalDetokenizer(tok, [])
    held = 0
    for i in ids:
        out = detok.add([i])
        assert FFFD not in out
        assert TEXTS[name].startswith(detok.text)  # emitted text is always a correct prefix
        held += out == ""
    assert held > 0


def test_streaming_random_byte_heavy_sequences(tok: Tokenizer):
    """Property: for random ids rich in partial-UTF-8 byte tokens, random prompts (which may end
    inside a character) and random chunk sizes, streamed text + finish() == one-shot decode."""
    rng = random.Random(1234)
    byte_ids = [i for i in range(tok.vocab_size) if FFFD in tok.decode([i])]
    assert byte_ids
    for _ in range(150):
        ids = [rng.choice(byte_ids) if rng.random() < 0.5 else rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 30))]
        prompt = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(0, 8))]
        skip = rng.random() < 0.5
        detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
        out, i = "", 0
        while i < len(ids):
            k = rng.randint(1, 3)
            out += detok.add(ids[i : i + k])
            i += k
        out += detok.finish()
        assert out == detok.text == tok.decode_complete(ids, skip_special_tokens=skip)
        full = tok.decode(ids, skip_special_tokens=skip)
        # at most the one U+FFFD of a character cut at the end is left out
        assert full == out or (full == out + FFFD and detok.token_ids == ids)


def test_stream_never_emits_prompt_text(tok: Tokenizer):
    prompt = tok.encode("The prompt says café and 🎉")
    ids = tok.encode(" and the answer continues.")
    chunks, detok = stream(tok, prompt, ids)
    assert detok.text == tok.decode(ids) == " and the answer continues."


def test_prompt_ending_inside_a_character(tok: Tokenizer):
    """A prompt cut in the middle of a multi-byte character must not shift the generated text."""
    ids = tok.encode("🎉 done")
    cut = next(k for k in range(1, len(ids)) if FFFD in tok.decode(ids[:k]))
    chunks, detok = stream(tok, ids[:cut], ids[cut:])
    assert "".join(chunks) == tok.decode(ids[cut:])


def test_finish_leaves_out_a_character_cut_by_the_end_of_generation(tok: Tokenizer):
    """Generation stopped inside a character (max_tokens): the final text omits its bytes instead of
    ending in U+FFFD; the token ids keep every token."""
    ids = tok.encode("ok 🎉")
    assert [tok.decode([i]) for i in ids] == ["ok", " " + FFFD, FFFD, FFFD]  # 🎉 spans three ids
    for cut in (2, 3):  # after F0 9F, after F0 9F 8E
        assert tok.decode(ids[:cut]) == "ok " + FFFD  # what the final text used to be
        chunks, detok = stream(tok, [], ids[:cut])
        assert chunks == ["ok"] + [""] * (cut - 1) + [" "]  # the space comes out, the cut emoji never does
        assert detok.text == "ok " == tok.decode_complete(ids[:cut])
        assert detok.token_ids == ids[:cut]
    chunks, detok = stream(tok, [], ids)
    assert detok.text == "ok 🎉"


def test_finish_leaves_out_a_cut_cjk_character(tok: Tokenizer):
    ids = tok.encode("東京")
    cut = next(k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith(FFFD))
    assert tok.decode(ids[:cut]).rstrip(FFFD) in ("", "東")
    chunks, detok = stream(tok, [], ids[:cut])
    assert detok.text == tok.decode(ids[:cut])[:-1]
    assert FFFD not in detok.text


def test_a_whole_replacement_character_is_kept(tok: Tokenizer):
    """U+FFFD written whole by the model (bytes EF BF BD, one token here) is text, not a cut character."""
    ids = tok.encode("a" + FFFD)
    assert tok.convert_ids_to_tokens(ids) == ["a", "ï¿½"]  # the byte-level spelling of EF BF BD
    chunks, detok = stream(tok, [], ids)
    assert "".join(chunks) == detok.text == tok.decode_complete(ids) == "a" + FFFD
    # so is a byte no later byte could complete (a lone continuation byte)
    lone = tok.encode("🎉")[-1]
    assert tok.decode_complete([*tok.encode("x"), lone]) == "x" + FFFD


def test_a_cut_character_with_sentencepiece_byte_fallback():
    """SentencePiece-style tokenizers spell a rare character as `<0xHH>` tokens and decode a
    failing byte run as one U+FFFD per byte, the complete characters in the run included."""
    from tokenizers import Tokenizer as RustTokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    vocab.update({"▁": 256, "a": 257, "▁a": 258})
    rust = RustTokenizer(models.BPE(vocab=vocab, merges=[("▁", "a")], byte_fallback=True))
    rust.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    rust.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                      decoders.Strip(" ", 1, 0)])
    sp = Tokenizer(PreTrainedTokenizerFast(tokenizer_object=rust))
    ids = sp.encode("a 🎉🎉")
    assert sp.convert_ids_to_tokens(ids)[2:] == ["<0xF0>", "<0x9F>", "<0x8E>", "<0x89>"] * 2
    assert sp.decode(ids[:8]) == "a " + FFFD * 6  # the first, complete, emoji is lost too
    for cut in (7, 8, 9):
        assert sp.decode_complete(ids[:cut]) == "a 🎉"
        chunks, detok = stream(sp, [], ids[:cut])
        assert "".join(chunks) == detok.text == "a 🎉"
    assert sp.decode_complete(ids) == "a 🎉🎉"


@pytest.mark.parametrize("data,cut", [
    (b"ok", 0), (b"\xf0\x9f", 2), (b"a\xe4\xb8", 2), (b"\xc3", 1), (b"\xf4\x8f\x80", 3),
    (b"\xef\xbf\xbd", 0),  # U+FFFD itself
    (b"\xe0\x80", 0), (b"\xed\xa0", 0), (b"\xf4\x90", 0), (b"\xc0", 0), (b"\x80", 0),  # no byte completes these
    (b"\x80\x80\x80\xf0", 1),
])
def test_incomplete_utf8_tail(data: bytes, cut: int):
    assert incomplete_utf8_tail(data) == cut


def test_special_tokens_in_stream(tok: Tokenizer):
    ids = tok.encode("Done.<|im_end|>")
    assert "".join(stream(tok, [], ids)[0]) == "Done."
    assert "".join(stream(tok, [], ids, skip=False)[0]) == "Done.<|im_end|>"


def test_detokenizer_decodes_a_small_window(tok: Tokenizer, chat_prompt_ids):
    """Per-token cost is bounded: each decode sees a few recent ids, not the whole output."""
    ids = tok.encode(" ".join(TEXTS.values()) * 4)
    seen: list[int] = []

    class Spy:
        def decode(self, x, skip_special_tokens=True):
            seen.append(len(x))
            return tok.decode(x, skip_special_tokens)

    detok = IncrementalDetokenizer(Spy(), chat_prompt_ids)  # type: ignore[arg-type]
    for i in ids:
        detok.add([i])
    assert detok.text == tok.decode(ids)
    assert len(ids) > 200 and max(seen) <= 16


# ---------------------------------------------------------------- stop strings
def run_with_stops(tok: Tokenizer, ids: list[int], stops: list[str]):
    """Engine-style loop: detokenize token by token, check stops on each delta."""
    detok = IncrementalDetokenizer(tok, [])
    matcher = StopStringMatcher(stops)
    for n, i in enumerate(ids, 1):
        delta = detok.add([i])
        hit = matcher.find(detok.text, len(delta))
        if hit is not None:
            return n, hit, detok.text[: hit[0]]
    return None


def test_stop_inside_one_token(tok: Tokenizer):
    text = "The capital of France is Paris."
    ids = tok.encode(text)
    k = next(k for k, i in enumerate(ids) if len(tok.decode([i]).strip()) >= 5)
    word = tok.decode([ids[k]])
    stop = word.strip()[1:-1]  # strictly inside that token's text
    n, (cut, s), kept = run_with_stops(tok, ids, [stop])
    assert n == k + 1 and s == stop
    assert kept == text[: text.index(stop)]


def test_stop_across_tokens(tok: Tokenizer):
    text = "The capital of France is Paris."
    ids = tok.encode(text)
    a, b = tok.decode(ids[3:4]), tok.decode(ids[4:5])
    stop = a[-2:] + b[:2]  # tail of one token + head of the next
    n, (cut, s), kept = run_with_stops(tok, ids, [stop])
    assert n == 5 and s == stop
    assert kept == text[: text.index(stop)]


def test_multiple_stops_earliest_wins():
    m = StopStringMatcher(["world", "lo w", "xyz"])
    assert m.find("hello world", 11) == (3, "lo w")
    # Same start: longer wins, cut is the same.
    assert StopStringMatcher(["ab", "abc"]).find("xxabc", 3) == (2, "abc")


def test_stop_spanning_old_and_new_text():
    m = StopStringMatcher(["STOP"])
    assert m.find("abcST", 2) is None  # only a prefix of the stop so far
    assert m.find("abcSTOP", 2) == (3, "STOP")  # old "ST" + new "OP"
    assert m.find("abcSTOPxyz", 3) is None  # lies wholly in text already checked


def test_stop_only_in_window():
    m = StopStringMatcher(["end"])
    text = "the end is near; " + "x" * 50
    assert m.find(text, 10) is None  # an old match is never re-reported
    assert m.find(text + "the end", 7) == (len(text) + 4, "end")
    assert m.find("", 0) is None and m.find("end", 0) is None


def test_stop_with_unicode_and_repeats():
    m = StopStringMatcher(["🎉", "。"])
    text = "東京です。🎉"
    assert m.find(text, 2) == (4, "。")
    assert StopStringMatcher(["aa"]).find("xaaa", 3) == (1, "aa")


def test_empty_or_bad_stop_raises():
    with pytest.raises(ValueError, match="empty"):
        StopStringMatcher(["ok", ""])
    with pytest.raises(ValueError, match=r"stop\[0\]"):
        StopStringMatcher([3])  # type: ignore[list-item]
    assert not StopStringMatcher([])
    assert StopStringMatcher([]).find("anything", 3) is None
