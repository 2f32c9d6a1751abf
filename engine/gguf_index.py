"""What the engine reads from a GGUF file's header, kept on disk so that a fresh process skips the parse.

`gguf.GGUFReader` parses every metadata field when it opens a file, the tokenizer's vocabulary
and merges included (49k + 49k strings for SmolLM2-135M: 2.6 s on this 2-core machine), and
every fresh process paid it: each CLI run, Dask worker and served flow run. The engine reads
only the tensor table and a few scalar fields (the model's shape, `general.name`), so
`open_gguf_index` keeps those in one small JSON file per GGUF file (`cache_root("gguf")`,
see `engine.disk_cache`) and, when that entry is valid, rebuilds the tensor table without
parsing. The tensor data is never copied: every `GGUFTensor.data` is a view of a read-only
memory map of the GGUF file at the recorded offset, the same array (dtype, shape, bytes) as
`GGUFReader`'s.

An entry is used only if all of these hold; otherwise it is ignored, the file is parsed and
the entry rewritten (atomically: a temp file, then `os.replace`):

- its format is `INDEX_FORMAT` and its checksum (sha256 of the entry's text) matches;
- the GGUF file's resolved path, size and mtime (ns) are those it was written for;
- the sha256 of the file's header (every byte before the tensor data: metadata and tensor
  table, 1.8 MB for SmolLM2, hashed in about 2 ms) equals the recorded one, so the entry is
  the parse of these very bytes;
- every tensor lies inside the file.

A cache folder that cannot be written (read-only, full, not a folder) costs only the parse.

Left out of the index: metadata arrays longer than `MAX_ARRAY_LEN` items (the tokenizer's
tokens, token types and merges) and fields whose strings are not UTF-8. The engine reads none
of them; the tokenizer is converted by transformers from the file itself, once per file, and
kept in its own disk cache (`engine.tokenizer`). Asking the index for one raises KeyError.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Optional

import numpy as np

from .disk_cache import cache_root, write_entry

if TYPE_CHECKING:
    from gguf import GGMLQuantizationType

logger = logging.getLogger(__name__)

#: Bump when the entry's layout or meaning changes; entries of another format are ignored.
INDEX_FORMAT = 1

#: Metadata arrays with more items than this are left out of the index (vocabularies, merges).
MAX_ARRAY_LEN = 1024


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file: the fields of `gguf.GGUFReader`'s `ReaderTensor`, same values.

    Attributes:
        name: GGUF tensor name, e.g. "blk.0.attn_q.weight".
        tensor_type: its `gguf.GGMLQuantizationType` (F32, Q4_1, Q8_0, ...).
        shape: uint64 [n_dims], GGML order (ne0, the innermost dimension, first): a [out, in]
            matrix has shape [in, out].
        n_elements: element count (product of `shape`).
        n_bytes: bytes of its data in the file.
        data_offset: absolute byte offset of its data in the file.
        data: read-only view of the memory-mapped file. F16/F32/F64/I8/I16/I32/I64 tensors:
            that dtype, shape `reversed(shape)`; quantized ones: uint8 [..., rows, bytes per row]
            (what `gguf.quants.dequantize` takes).
    """

    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


@dataclass(frozen=True)
class GGUFIndex:
    """A GGUF file's tensor table and metadata (all but long arrays), its data memory-mapped.

    Attributes:
        path: the file's resolved path.
        metadata: field name -> value as `ReaderField.contents()` gives it (int, float, bool,
            str, or a list of them), including GGUFReader's "GGUF.version", "GGUF.tensor_count"
            and "GGUF.kv_count".
        omitted: names of the fields left out (see the module docstring).
        tensors: in file order.
    """

    path: str
    metadata: dict[str, Any]
    omitted: frozenset[str]
    tensors: list[GGUFTensor]

    def field(self, key: str, default: Any = None) -> Any:
        """The value of metadata field `key`, or `default` when the file has no such field.

        Raises:
            KeyError: the file has the field but the index left it out (a long array).
        """
        if key in self.omitted:
            raise KeyError(f"{self.path}: GGUF field {key!r} is not kept by the GGUF index (an array longer "
                           f"than {MAX_ARRAY_LEN} items, or not UTF-8); read it with gguf.GGUFReader")
        return self.metadata.get(key, default)


@functools.cache
def gguf_reader_class() -> type:
    """`gguf.GGUFReader` with its field reads taken from a plain ndarray view of the file's memory map: the
    same fields, parts and tensors, parsed several times faster (each of a vocabulary's ~10^5 small reads
    sliced a `np.memmap`, whose subclass bookkeeping costs more than the read itself)."""
    from gguf.gguf_reader import GGUFReader

    class PlainViewGGUFReader(GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None):  # type: ignore[no-untyped-def]
            plain = self.__dict__.get("_plain")
            if plain is None:
                plain = self._plain = self.data.view(np.ndarray)
            dtype, count = np.dtype(dtype), int(count)
            arr = plain[offset:offset + dtype.itemsize * count].view(dtype)[:count]
            return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    return PlainViewGGUFReader


_READER_SWAP = threading.RLock()


@contextlib.contextmanager
def plain_view_gguf_reader() -> Iterator[None]:
    """For the block, `gguf.GGUFReader` is `gguf_reader_class()`, for a library that parses a GGUF file
    with it (transformers' GGUF loaders import it when called). Blocks in other threads wait: the name
    is swapped for the process.
    """
    import gguf

    with _READER_SWAP:
        previous = gguf.GGUFReader
        gguf.GGUFReader = gguf_reader_class()
        try:
            yield
        finally:
            gguf.GGUFReader = previous


def open_gguf_index(path: str) -> GGUFIndex:
    """The index of the GGUF file at `path`: from the disk cache when a valid entry exists,
    else parsed with `gguf.GGUFReader` (and the entry written for the next process).

    Raises:
        OSError: `path` cannot be read.
        TruncatedGGUF: the file is shorter than its header says (named, with both sizes).
        UnreadableGGUF: `path` is not a GGUF file `gguf.GGUFReader` can read (named).
    """
    real = os.path.realpath(path)
    st = os.stat(real)
    entry = cache_entry_path(real)
    if entry is not None:
        index = _read_entry(entry, real, st)
        if index is not None:
            return index
    index, text = _parse(real, st)
    if entry is not None:
        _write_entry(entry, text)
    return index


MAX_FIELD_OVERSHOOT = 64 << 20
"""Bytes past the end of a file cut inside its header that one metadata read may ask for (a string or an
array element); more is a garbage length: the file is corrupt, not short."""
MAX_GGUF_BYTES = 1 << 40
"""More tensor data than a GGUF file ever holds (1 TiB): a tensor table asking for it is corrupt."""
MAX_GGUF_COUNT = 1 << 20
"""More tensors or metadata keys than a GGUF file ever has."""


def _sane_header_start(path: str) -> bool:
    """Whether the file's first 24 bytes read as a GGUF header start: the magic, version 1-3 and tensor
    and metadata-key counts of at most MAX_GGUF_COUNT (a shorter file: whether what it has matches)."""
    with open(path, "rb") as fh:
        head = fh.read(24)
    if not b"GGUF".startswith(head[:4]):
        return False
    if len(head) >= 8 and int.from_bytes(head[4:8], "little") not in (1, 2, 3):
        return False
    if len(head) >= 16 and int.from_bytes(head[8:16], "little") > MAX_GGUF_COUNT:
        return False
    return not (len(head) >= 24 and int.from_bytes(head[16:24], "little") > MAX_GGUF_COUNT)


class UnreadableGGUF(ValueError):
    """A GGUF file that cannot be read: corrupt, not a GGUF file, or cut short (`TruncatedGGUF`)."""


class TruncatedGGUF(UnreadableGGUF):
    """A GGUF file shorter than its own header says it is: an interrupted download or copy."""


def truncation_error(path: str) -> Optional[TruncatedGGUF]:
    """The error for the GGUF file at `path` when it is shorter than its header says, else None.

    Reads the header (metadata and tensor table, as `gguf.GGUFReader` does: seconds for a
    vocabulary of 49k tokens), so it is for a file that has just failed to load, not for every load.
    The size a complete file needs is where its last tensor's data ends; a file cut inside its
    header gives only a lower bound. A file whose header does not parse otherwise is not called
    truncated (None): it is corrupt, or not a GGUF file.
    """
    import gguf

    size = os.path.getsize(path)
    if size == 0:
        return TruncatedGGUF(f"GGUF file {path!r} is empty (0 bytes): an interrupted download or copy? copy it again")
    if not _sane_header_start(path):
        return None  # corrupt: a cut file keeps its first bytes as they were

    class _Short(Exception):
        def __init__(self, needed: int, in_header: bool) -> None:
            super().__init__(needed)
            self.needed, self.in_header = needed, in_header

    class _Probe(gguf_reader_class()):  # type: ignore[misc]
        """Raises _Short at the first read past the end, or with where the tensor data ends."""

        def _get(self, offset, dtype, count=1, override_order=None):  # type: ignore[no-untyped-def]
            end = int(offset) + np.dtype(dtype).itemsize * int(count)
            if end > size:
                raise _Short(end, in_header=True)
            return super()._get(offset, dtype, count, override_order)

        def _build_tensors(self, start_offs, fields):  # type: ignore[no-untyped-def]
            needed = start_offs
            for field in fields:
                dims, raw_type, rel_offset = field.parts[3], field.parts[4], field.parts[5]
                block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(raw_type[0]))]
                n_bytes = int(np.prod(dims.astype(np.uint64))) * type_size // block_size
                needed = max(needed, start_offs + int(rel_offset[0]) + n_bytes)
            raise _Short(needed, in_header=False)

    try:
        _Probe(path)
    except _Short as short:
        if short.needed <= size:
            return None
        # a garbage length or count (a corrupt byte, not a cut) asks for far more than any one field or
        # model holds: the first read past the end of a cut header overshoots it by one field's bytes
        if short.needed - size > (MAX_FIELD_OVERSHOOT if short.in_header else MAX_GGUF_BYTES):
            return None
        if short.in_header:
            return TruncatedGGUF(f"GGUF file {path!r} is truncated: it ends at byte {size} inside its header "
                                 f"(an interrupted download or copy? copy it again)")
        return TruncatedGGUF(f"GGUF file {path!r} is truncated: {size} bytes, but its tensors need {short.needed} "
                             f"(an interrupted download or copy? copy it again)")
    except Exception:  # noqa: BLE001 - not a truncation: the caller says the file is unreadable
        return None
    return None


def unreadable_gguf(path: str, exc: BaseException) -> UnreadableGGUF:
    """The error for a GGUF file at `path` that `gguf.GGUFReader` (or transformers) failed to read with
    `exc`: a TruncatedGGUF when the file is short (`truncation_error`), else one naming the file as corrupt."""
    return truncation_error(path) or UnreadableGGUF(
        f"GGUF file {path!r} cannot be read, it is corrupt or not a GGUF file ({type(exc).__name__}: {exc})")


def cache_entry_path(real_path: str) -> Optional[str]:
    """Where the index of the GGUF file at (resolved) `real_path` is kept, or None with disk caches off.
    One entry per path: a stale entry is overwritten, never kept beside the new one."""
    root = cache_root("gguf")
    if root is None:
        return None
    digest = hashlib.sha256(real_path.encode()).hexdigest()[:20]
    stem = os.path.splitext(os.path.basename(real_path))[0]
    return os.path.join(root, f"{stem}-{digest}.json")


# ---------------------------------------------------------------- building

def _plain_dtypes() -> dict:
    import gguf

    T = gguf.GGMLQuantizationType
    return {T.F16: np.float16, T.F32: np.float32, T.F64: np.float64, T.I8: np.int8, T.I16: np.int16,
            T.I32: np.int32, T.I64: np.int64}


def _tensors(mm: np.memmap, byte_order: str, table: list) -> list[GGUFTensor]:
    """GGUFTensors over memory map `mm` from rows [name, GGML type id, GGML-order dims, absolute
    offset], exactly as `GGUFReader._build_tensors` derives them.

    Raises:
        ValueError: an unknown type id, or a tensor that does not lie inside the file.
    """
    import gguf
    from gguf.quants import quant_shape_to_byte_shape

    plain = _plain_dtypes()
    out = []
    for name, type_id, dims, offset in table:
        if not isinstance(name, str) or not isinstance(offset, int) or offset < 0:
            raise ValueError(f"bad tensor row {name!r}")
        ggml_type = gguf.GGMLQuantizationType(type_id)
        shape = np.array(dims, dtype=np.uint64)
        if shape.ndim != 1:
            raise ValueError(f"tensor {name}: bad dims {dims!r}")
        n_elements = int(np.prod(shape))
        block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
        n_bytes = n_elements * type_size // block_size
        np_dims = tuple(reversed(shape.tolist()))
        dtype = plain.get(ggml_type)
        if dtype is None:
            dtype, count, np_dims = np.uint8, n_bytes, quant_shape_to_byte_shape(np_dims, ggml_type)
        else:
            count = n_elements
        end = offset + count * np.dtype(dtype).itemsize
        if end > len(mm):
            raise ValueError(f"tensor {name}: bytes [{offset}, {end}) lie past the end of the file ({len(mm)} bytes)")
        arr = mm[offset:end].view(dtype)[:count]
        arr = arr.view(arr.dtype.newbyteorder(byte_order)).reshape(np_dims)
        out.append(GGUFTensor(name, ggml_type, shape, n_elements, n_bytes, offset, arr))
    return out


def _header_sha256(mm: np.memmap, header_bytes: int) -> str:
    return hashlib.sha256(memoryview(mm[:header_bytes])).hexdigest()


def _parse(real: str, st: os.stat_result) -> tuple[GGUFIndex, str]:
    """Parse the file with `gguf.GGUFReader` (`gguf_reader_class`): its index, and the text of its cache entry."""
    import gguf

    try:
        reader = gguf_reader_class()(real)
    except OSError:
        raise
    except Exception as exc:  # numpy's or gguf's words (`cannot reshape array ...`): say which file, and why
        raise unreadable_gguf(real, exc) from exc
    metadata: dict[str, Any] = {}
    omitted = []
    for key, f in reader.fields.items():
        if f.types and f.types[0] == gguf.GGUFValueType.ARRAY and len(f.data) > MAX_ARRAY_LEN:
            omitted.append(key)
            continue
        try:
            metadata[key] = f.contents()
        except (UnicodeDecodeError, ValueError, IndexError):
            omitted.append(key)
    table = [[t.name, int(t.tensor_type), t.shape.tolist(), int(t.data_offset)] for t in reader.tensors]
    header_bytes = int(reader.data_offset)
    byte_order = reader.byte_order
    del reader  # its parsed fields are the memory this index exists to not hold
    mm = np.memmap(real, mode="r")
    index = GGUFIndex(real, metadata, frozenset(omitted), _tensors(mm, byte_order, table))
    body = json.dumps({
        "format": INDEX_FORMAT, "path": real, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
        "header_bytes": header_bytes, "header_sha256": _header_sha256(mm, header_bytes), "byte_order": byte_order,
        "metadata": metadata, "omitted": omitted, "tensors": table,
    })
    return index, hashlib.sha256(body.encode()).hexdigest() + "\n" + body


# ---------------------------------------------------------------- the disk cache

def _read_entry(entry: str, real: str, st: os.stat_result) -> Optional[GGUFIndex]:
    """The index kept in `entry` if it is valid for the file (see the module docstring), else None."""
    try:
        with open(entry, encoding="utf-8") as fh:
            text = fh.read()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        logger.warning("ignoring unreadable GGUF index %s: %s", entry, exc)
        return None
    try:
        checksum, _, body = text.partition("\n")
        if hashlib.sha256(body.encode()).hexdigest() != checksum:
            raise ValueError("checksum mismatch")
        d = json.loads(body)
        if d["format"] != INDEX_FORMAT:
            return None
        if (d["path"], d["size"], d["mtime_ns"]) != (real, st.st_size, st.st_mtime_ns):
            return None  # stale: the file changed since (or another file now has this name's hash)
        mm = np.memmap(real, mode="r")
        header_bytes = d["header_bytes"]
        if not isinstance(header_bytes, int) or not 0 < header_bytes <= len(mm):
            raise ValueError(f"bad header length {header_bytes!r}")
        if _header_sha256(mm, header_bytes) != d["header_sha256"]:
            return None  # the header's bytes changed under the same size and mtime
        if d["byte_order"] not in ("I", "S"):
            raise ValueError(f"bad byte order {d['byte_order']!r}")
        metadata, omitted = d["metadata"], d["omitted"]
        if not isinstance(metadata, dict) or not isinstance(omitted, list):
            raise ValueError("bad metadata")
        return GGUFIndex(real, metadata, frozenset(omitted), _tensors(mm, d["byte_order"], d["tensors"]))
    except Exception as exc:  # noqa: BLE001 - a corrupt entry must never block loading: parse again
        logger.warning("ignoring corrupt GGUF index %s: %s: %s", entry, type(exc).__name__, exc)
        return None


def _write_entry(entry: str, text: str) -> None:
    """Write atomically (`disk_cache.write_entry`)."""
    write_entry(entry, lambda fh: fh.write(text.encode("utf-8")), "GGUF index")
