"""Weight loading: Hugging Face safetensors folders (Llama with GQA and Llama 3.1 rope
scaling, Qwen2 with q/k/v bias, tied and untied heads) against transformers on the
same weights, the GGUF q/k row un-permutation, and dummy weights of a named shape."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.tokenizer import Tokenizer
from engine.weights import PRESETS, resolve_model, unpermute_rope_rows

PROMPTS = ["The quick brown fox jumps over the lazy dog.", "def add(a, b):\n    return", "Bonjour, je m'appelle"]


def _tiny_folder(tmp_path, kind: str):
    """Save a tiny random transformers model (+ the default tokenizer) as a HF folder."""
    import transformers

    tok = Tokenizer.default()
    common = dict(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  initializer_range=0.2, rms_norm_eps=1e-6)
    if kind == "llama3":
        cfg = transformers.LlamaConfig(**common, tie_word_embeddings=False,
                                       rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                        "original_max_position_embeddings": 64})
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "llama_tied":
        cfg = transformers.LlamaConfig(**common, tie_word_embeddings=True,
                                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=False,
                                       rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
        model = transformers.Qwen2ForCausalLM(cfg)
        with torch.no_grad():  # make the q/k/v biases matter
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    model = model.float().eval()
    folder = tmp_path / kind
    model.save_pretrained(folder, safe_serialization=True)
    tok.hf.save_pretrained(folder)
    return folder, model


@pytest.mark.parametrize("kind", ["llama3", "llama_tied", "qwen2"])
def test_hf_folder_matches_transformers(tmp_path, kind):
    folder, ref = _tiny_folder(tmp_path, kind)
    # an fp32 cache: the checkpoint is fp32, and parity with transformers is held to fp32 rounding
    llm = LLM(str(folder), kv_cache_memory_bytes=8 << 20, max_num_batched_tokens=7, kv_cache_dtype="fp32",
              dtype="float32")
    assert llm.model_config.attention_bias == (kind == "qwen2")
    assert llm.model_config.tie_word_embeddings == (kind == "llama_tied")
    for p in PROMPTS:
        ids = llm.tokenizer.encode(p)
        ours = llm.compute_logits(ids)
        with torch.no_grad():
            theirs = ref(torch.tensor([ids])).logits[0, -1].float()
        assert (ours - theirs).abs().max().item() < 1e-3
    # greedy generation, with chunked prefill (budget 7) and a batch of three
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    for p, o in zip(PROMPTS, outs):
        ids = llm.tokenizer.encode(p)
        with torch.no_grad():
            g = ref.generate(torch.tensor([ids]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        assert o.outputs[0].token_ids == g[0, len(ids):].tolist()


def test_unpermute_inverts_the_gguf_converter_permutation():
    # The converter's permutation of q/k rows: halves order -> interleaved pairs, per head.
    rng = np.random.default_rng(0)
    for n_heads, head_dim in [(9, 64), (3, 64), (4, 8)]:
        w = rng.standard_normal((n_heads * head_dim, 5)).astype(np.float32)
        permuted = w.reshape(n_heads, 2, head_dim // 2, 5).swapaxes(1, 2).reshape(w.shape)
        assert np.array_equal(unpermute_rope_rows(permuted, n_heads), w)
        # row 1 of each permuted head is row head_dim/2 of the original head
        assert np.array_equal(permuted[1], w[head_dim // 2])


def test_dummy_weights_run_and_are_reproducible():
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    a = LLM("dummy:smollm2-135m", kv_cache_memory_bytes=16 << 20, seed=3).generate(["hello world"], params, use_tqdm=False)
    b = LLM("dummy:smollm2-135m", kv_cache_memory_bytes=16 << 20, seed=3).generate(["hello world"], params, use_tqdm=False)
    assert len(a[0].outputs[0].token_ids) == 5
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids


def test_named_shapes_and_unknown_models():
    cfg = PRESETS["llama-3-8b"]
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_kv_heads, cfg.head_dim) == (32, 4096, 8, 128)
    assert 7.9e9 < cfg.num_params < 8.1e9  # Llama-3-8B has 8.03B parameters
    assert 1.30e8 < PRESETS["smollm2-135m"].num_params < 1.40e8  # 134.5M
    with pytest.raises(ValueError, match="unknown dummy shape"):
        resolve_model("dummy:no-such-shape")
    with pytest.raises(ValueError, match="unknown model"):
        LLM("/no/such/model.bin")
    with pytest.raises(ValueError, match="^model file '/no/such/model.gguf' does not exist$"):
        resolve_model("/no/such/model.gguf")
    with pytest.raises(ValueError, match="^model folder '/' has no config.json"):
        resolve_model("/")
    with pytest.raises(ValueError, match="unknown engine argument"):
        LLM("smollm2-135m-instruct", max_num_seq=4)


# ---------------------------------------------------------------- the on-disk GGUF index

def _write_tiny_gguf(path, name: str = "tiny-a", n_tokens: int = 1500) -> None:
    """A small GGUF with every tensor kind the index maps (F32 1-D and 3-D, F16, I32, Q8_0, Q4_1) and a
    vocabulary-sized array (`n_tokens` strings: left out of the index when above MAX_ARRAY_LEN)."""
    import gguf

    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_uint32("llama.block_count", 1)
    w.add_float32("llama.rope.freq_base", 100000.0)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_string("general.name", name)
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    w.add_array("general.languages", ["en", "fr"])
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(n_tokens)])
    Q = gguf.GGMLQuantizationType
    for tname, qtype, x in [
        ("token_embd.weight", Q.Q8_0, rng.standard_normal((6, 64)).astype(np.float32)),
        ("blk.0.attn_q.weight", Q.Q4_1, rng.standard_normal((4, 96)).astype(np.float32)),
        ("blk.0.attn_norm.weight", Q.F32, rng.standard_normal(64).astype(np.float32)),
        ("blk.0.ffn_up.weight", Q.F16, rng.standard_normal((3, 8)).astype(np.float16)),
        ("cube", Q.F32, rng.standard_normal((2, 3, 4)).astype(np.float32)),
        ("ids", Q.I32, np.arange(10, dtype=np.int32)),
    ]:
        if qtype in (Q.Q8_0, Q.Q4_1):
            w.add_tensor(tname, gguf.quants.quantize(x, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(tname, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture
def gguf_cache(tmp_path, monkeypatch):
    """TOKENMILL_CACHE_DIR in tmp_path (disk caches on); `engine.weights.open_gguf`'s per-process
    cache emptied before and after, so every open in the test goes through the disk cache."""
    from engine.weights import open_gguf

    cache = tmp_path / "cache"
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(cache))
    monkeypatch.delenv("TOKENMILL_NO_DISK_CACHE", raising=False)
    open_gguf.cache_clear()
    yield cache
    open_gguf.cache_clear()


@pytest.fixture
def parses(monkeypatch):
    """The list of paths the engine has parsed (`engine.gguf_index.gguf_reader_class`) since the test began."""
    import engine.gguf_index

    seen: list[str] = []
    real_reader = engine.gguf_index.gguf_reader_class()

    def counting_reader(path, *args, **kwargs):
        seen.append(str(path))
        return real_reader(path, *args, **kwargs)

    monkeypatch.setattr(engine.gguf_index, "gguf_reader_class", lambda: counting_reader)
    return seen


def _assert_index_is_the_parse(index, reader) -> None:
    """Every tensor of `index` has `reader`'s (a gguf.GGUFReader's) name, type, shape, offsets, and data
    of the same array class, dtype, shape and bytes; every field it keeps has the reader's value."""
    assert [t.name for t in index.tensors] == [t.name for t in reader.tensors]
    for ours, theirs in zip(index.tensors, reader.tensors):
        assert (ours.tensor_type, ours.shape.tolist(), ours.n_elements, ours.n_bytes, ours.data_offset) == \
            (theirs.tensor_type, theirs.shape.tolist(), theirs.n_elements, theirs.n_bytes, theirs.data_offset)
        assert type(ours.data) is type(theirs.data) and ours.data.dtype == theirs.data.dtype
        assert ours.data.shape == theirs.data.shape
        assert np.array_equal(ours.data.view(np.uint8), theirs.data.view(np.uint8)), ours.name
    kept = {k: f.contents() for k, f in reader.fields.items() if k not in index.omitted}
    assert index.metadata == kept


def _reader(path):
    """A gguf.GGUFReader of `path` that the `parses` fixture does not count."""
    import gguf.gguf_reader

    return gguf.gguf_reader.GGUFReader(str(path))


def test_the_plain_view_reader_reads_what_gguf_reader_reads(tmp_path):
    """`gguf_reader_class` reads every field (types, parts, data indices, offsets) and tensor (type, shape,
    offsets, bytes) that `gguf.GGUFReader` reads, from the same file."""
    from engine.gguf_index import gguf_reader_class

    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(path)
    ours, theirs = gguf_reader_class()(str(path)), _reader(path)
    assert list(ours.fields) == list(theirs.fields) and len(ours.fields) > 5
    for key, f in theirs.fields.items():
        g = ours.fields[key]
        assert (g.offset, g.types, g.data, g.name) == (f.offset, f.types, f.data, f.name), key
        assert [(p.dtype, p.tolist()) for p in g.parts] == [(p.dtype, p.tolist()) for p in f.parts], key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors] and theirs.tensors
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.tensor_type, a.shape.tolist(), a.n_bytes, a.data_offset) == \
            (b.tensor_type, b.shape.tolist(), b.n_bytes, b.data_offset)
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
        assert np.array_equal(a.data.view(np.uint8), b.data.view(np.uint8)), a.name
    assert ours.data_offset == theirs.data_offset and ours.byte_order == theirs.byte_order


def test_the_reader_swap_covers_its_block_only_and_survives_an_error(tmp_path):
    """`plain_view_gguf_reader` (the engine's tokenizer conversion runs transformers under it) makes
    `gguf.GGUFReader` the plain-view reader inside the block, and puts gguf's own back after it, also
    when the block raises."""
    import gguf

    from engine.gguf_index import gguf_reader_class, plain_view_gguf_reader

    original = gguf.GGUFReader
    with plain_view_gguf_reader():
        assert gguf.GGUFReader is gguf_reader_class() and gguf.GGUFReader is not original
    assert gguf.GGUFReader is original
    with pytest.raises(KeyError), plain_view_gguf_reader():
        raise KeyError("x")
    assert gguf.GGUFReader is original


def test_cached_gguf_index_of_the_bundled_model_gives_the_same_tensors_and_config(gguf_cache, parses):
    """The first load parses the file and writes the index; the next (a fresh process's: per-process
    cache emptied) parses nothing. Both indexes hold GGUFReader's tensors and fields, only the
    tokenizer's vocabulary arrays left out, and both loads give the same config and weights."""
    from engine.gguf_index import cache_entry_path
    from engine.weights import ModelSource, default_gguf_path, load_gguf, model_num_layers, open_gguf

    path = os.path.realpath(default_gguf_path())
    cfg_parsed, parsed = load_gguf(path)
    cold = open_gguf(path)
    assert parses == [path] and cache_entry_path(path).startswith(str(gguf_cache / "gguf"))
    assert os.path.isfile(cache_entry_path(path))
    open_gguf.cache_clear()
    cfg, state = load_gguf(path)
    warm = open_gguf(path)
    assert model_num_layers(ModelSource("gguf", path)) == 30
    assert parses == [path]  # the second load read the index
    assert warm is not cold
    reader = _reader(path)
    for index in (cold, warm):
        _assert_index_is_the_parse(index, reader)
        assert index.omitted == {"tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges"}
    assert warm.field("llama.block_count") == 30 and warm.field("llama.rope.freq_base") == 100000.0
    assert warm.field("llama.no_such_key", 7) == 7
    with pytest.raises(KeyError, match="tokenizer.ggml.tokens"):
        warm.field("tokenizer.ggml.tokens")
    assert cfg == cfg_parsed and cfg.num_layers == 30 and cfg.vocab_size == 49152 and cfg.tie_word_embeddings
    assert state.keys() == parsed.keys() and len(state) == 30 * 9 + 2
    for k in parsed:
        assert torch.equal(state[k], parsed[k]), k


def test_tiny_gguf_index_maps_every_tensor_kind_like_gguf_reader(tmp_path, gguf_cache, parses):
    from engine.gguf_index import MAX_ARRAY_LEN, open_gguf_index

    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(path)
    for _ in range(2):  # cold, then warm
        index = open_gguf_index(str(path))
        _assert_index_is_the_parse(index, _reader(path))
        assert index.omitted == {"tokenizer.ggml.tokens"} and index.field("general.languages") == ["en", "fr"]
    assert len(parses) == 1
    _write_tiny_gguf(path, n_tokens=MAX_ARRAY_LEN)  # an array of MAX_ARRAY_LEN items is kept
    index = open_gguf_index(str(path))
    assert index.omitted == frozenset() and len(index.field("tokenizer.ggml.tokens")) == MAX_ARRAY_LEN


def _entry_record(path) -> dict:
    import json

    from engine.gguf_index import cache_entry_path

    with open(cache_entry_path(os.path.realpath(path)), encoding="utf-8") as fh:
        return json.loads(fh.read().partition("\n")[2])


def test_changed_mtime_size_or_header_invalidates_the_entry(tmp_path, gguf_cache, parses):
    from engine.gguf_index import open_gguf_index

    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(path)
    open_gguf_index(str(path))
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # touched: same bytes, new mtime
    open_gguf_index(str(path))
    assert len(parses) == 2 and _entry_record(path)["mtime_ns"] == st.st_mtime_ns + 1_000_000_000  # rewritten
    open_gguf_index(str(path))
    assert len(parses) == 2
    with open(path, "ab") as fh:  # grown: same header, one more byte
        fh.write(b"\0")
    open_gguf_index(str(path))
    assert len(parses) == 3 and _entry_record(path)["size"] == st.st_size + 1
    # a different file of the same size and mtime: only the header's checksum tells
    st = os.stat(path)
    _write_tiny_gguf(path, name="tiny-b")
    with open(path, "ab") as fh:
        fh.write(b"\0")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_size == st.st_size
    index = open_gguf_index(str(path))
    assert len(parses) == 4 and index.field("general.name") == "tiny-b"


def _corrupt_truncated(text: str) -> str:
    return text[: len(text) // 2]


def _corrupt_shifted_offset(text: str) -> str:
    """One tensor's offset one byte off (still inside the file), the checksum left as it was."""
    import json

    offset = json.loads(text.partition("\n")[2])["tensors"][0][3]
    assert text.count(f"], {offset}]") == 1
    return text.replace(f"], {offset}]", f"], {offset + 1}]")


def _corrupt_offset_past_the_end(text: str) -> str:
    """Checksum recomputed: an entry that is well-formed and self-consistent, but wrong."""
    import hashlib
    import json

    d = json.loads(text.partition("\n")[2])
    d["tensors"][0][3] = d["size"] + 4096
    body = json.dumps(d)
    return hashlib.sha256(body.encode()).hexdigest() + "\n" + body


def _corrupt_wrong_type(text: str) -> str:
    import hashlib
    import json

    d = json.loads(text.partition("\n")[2])
    d["tensors"][1][1] = 1234  # no such GGML type
    body = json.dumps(d)
    return hashlib.sha256(body.encode()).hexdigest() + "\n" + body


@pytest.mark.parametrize("corrupt", [_corrupt_truncated, _corrupt_shifted_offset, _corrupt_offset_past_the_end,
                                     _corrupt_wrong_type, lambda t: "", lambda t: "\udcff not utf-8"])
def test_corrupt_entry_is_ignored_and_rewritten(tmp_path, gguf_cache, parses, corrupt, caplog):
    from engine.gguf_index import cache_entry_path, open_gguf_index

    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(path)
    open_gguf_index(str(path))
    entry = cache_entry_path(os.path.realpath(path))
    with open(entry, encoding="utf-8") as fh:
        good = fh.read()
    with open(entry, "wb") as fh:
        fh.write(corrupt(good).encode("utf-8", errors="surrogateescape"))
    index = open_gguf_index(str(path))
    assert len(parses) == 2 and "ignoring" in caplog.text  # parsed again, and said why
    _assert_index_is_the_parse(index, _reader(path))
    with open(entry, encoding="utf-8") as fh:
        assert fh.read() == good  # rewritten
    open_gguf_index(str(path))
    assert len(parses) == 2


def test_unwritable_or_disabled_cache_does_not_fail_the_load(tmp_path, monkeypatch, parses, caplog):
    from engine.gguf_index import cache_entry_path, open_gguf_index

    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(path)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(blocker / "cache"))  # under a file: no folder can be made
    monkeypatch.delenv("TOKENMILL_NO_DISK_CACHE", raising=False)
    for _ in range(2):
        _assert_index_is_the_parse(open_gguf_index(str(path)), _reader(path))
    assert len(parses) == 2 and "could not cache the GGUF index" in caplog.text
    monkeypatch.setenv("TOKENMILL_NO_DISK_CACHE", "1")
    assert cache_entry_path(str(path)) is None
    assert open_gguf_index(str(path)).field("general.name") == "tiny-a" and len(parses) == 3


def test_a_truncated_gguf_is_named_with_its_size_and_the_size_its_tensors_need(tmp_path, gguf_cache):
    """A GGUF file cut short (an interrupted download or copy) failed in numpy, `cannot reshape array of
    size ...`, naming neither the file nor why; the index and the tokenizer both name it now."""
    from engine.gguf_index import TruncatedGGUF, UnreadableGGUF, open_gguf_index
    from engine.tokenizer import Tokenizer

    full = tmp_path / "full.gguf"
    _write_tiny_gguf(full)
    needed = max(t.data_offset + t.n_bytes for t in _reader(full).tensors)
    data = full.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 100])  # inside the last tensor's data
    want = (f"GGUF file {str(cut)!r} is truncated: {len(data) - 100} bytes, but its tensors need {needed} "
            f"(an interrupted download or copy? copy it again)")
    with pytest.raises(TruncatedGGUF) as exc:
        open_gguf_index(str(cut))
    assert str(exc.value) == want
    with pytest.raises(TruncatedGGUF) as exc:
        Tokenizer.from_gguf(str(cut))
    assert str(exc.value) == want
    cut.write_bytes(data[:200])  # inside the metadata
    with pytest.raises(TruncatedGGUF, match=r"^GGUF file '.*cut\.gguf' is truncated: it ends at byte 200 inside "
                                            r"its header "):
        open_gguf_index(str(cut))
    cut.write_bytes(b"")
    with pytest.raises(TruncatedGGUF, match=r"cut\.gguf' is empty \(0 bytes\)"):
        open_gguf_index(str(cut))
    corrupt = "cannot be read, it is corrupt or not a GGUF file"
    # full-size files with garbage bytes were called truncated: a metadata count of 2**64 - 1 (the parse ran to
    # the end of the file), and a string length read as garbage
    for at, junk in ((16, b"\xff" * 8), (24, b"\xff" * 8)):
        cut.write_bytes(data[:at] + junk + data[at + len(junk):])
        with pytest.raises(ValueError) as exc:
            open_gguf_index(str(cut))
        assert type(exc.value) is UnreadableGGUF and corrupt in str(exc.value), (at, str(exc.value))
    # garbage in the tensor count: transformers' tokenizer reader failed decoding a name as UTF-8, and that
    # was all the user saw (`'utf-8' codec can't decode byte ...`), with no file named
    cut.write_bytes(data[:8] + b"\xff" * 8 + data[16:])
    with pytest.raises(ValueError) as exc:
        Tokenizer.from_gguf(str(cut))
    assert type(exc.value) is UnreadableGGUF and corrupt in str(exc.value) and repr(str(cut)) in str(exc.value)
    cut.write_bytes(b"not a gguf file" * 10)  # corrupt, not short: named, and not called truncated
    with pytest.raises(ValueError) as exc:
        open_gguf_index(str(cut))
    assert type(exc.value) is UnreadableGGUF
    assert str(exc.value) == (f"GGUF file {str(cut)!r} cannot be read, it is corrupt or not a GGUF file "
                              f"(ValueError: GGUF magic invalid)")
