"""SmoothQuant calibration statistics kept on disk between processes (`engine.disk_cache`, kind
"calibration").

`engine.loader.w8a8_calibration` generates text with a dedicated fp32 engine and records every
linear layer's per-channel max |x| over it (`engine.smoothquant.calibration_absmax`): tens of
seconds on 2 cores, paid by every process that builds a W8A8 engine (each run, each Dask worker).
The result is small (one vector per layer input), so it is kept here and read back by the next
process that asks with the same key.

The key is everything the statistics depend on: the model file's identity (resolved path, size
and mtime of the GGUF file, or of every file of an HF folder; the preset of a dummy model), the
calibration dtype, device, seed and kernel choice, `engine.smoothquant`'s source (which defines the
calibration text: prompts, tokens per prompt, sampling seed), the torch version and the host's kind
(`engine.host.Host.host_id`, ISA flags and model name: sampled text can part where two CPUs round
differently). An entry whose key differs, or
that cannot be read back whole, is ignored; deleting any entry at any time is safe.
"""
from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
from typing import Any, Optional

import torch

from .disk_cache import cache_root, write_entry

logger = logging.getLogger(__name__)

CALIBRATION_FORMAT = 1
"""Bump when what `calibration_absmax` records, or the entry's layout, changes."""


def _file_identity(path: str) -> list:
    st = os.stat(path)
    return [os.path.realpath(path), st.st_size, st.st_mtime_ns]


def calibration_key(source: Any, dtype: torch.dtype, device: str, seed: int, cpu_kernels: bool) -> dict[str, Any]:
    """The JSON-able key of one calibration (see the module docstring).

    Args:
        source: an `engine.weights.ModelSource`.

    Raises:
        OSError: the model's files cannot be listed or stat'ed.
    """
    from . import host, smoothquant

    if source.kind == "dummy":
        model: Any = ["dummy", source.preset]
    elif os.path.isdir(source.path):
        model = ["folder", sorted(_file_identity(os.path.join(source.path, n)) for n in os.listdir(source.path)
                                  if os.path.isfile(os.path.join(source.path, n)))]
    else:
        model = ["file", _file_identity(source.path)]
    h = host.current()
    return {"format": CALIBRATION_FORMAT, "model": model, "dtype": str(dtype), "device": device, "seed": seed,
            "cpu_kernels": bool(cpu_kernels), "torch": torch.__version__,
            "code": hashlib.sha256(inspect.getsource(smoothquant).encode()).hexdigest()[:16],
            "host": [h.host_id, h.isa, h.model_name]}


def entry_path(key: dict[str, Any]) -> Optional[str]:
    """Where the statistics of `key` are kept, or None with disk caches off."""
    root = cache_root("calibration")
    if root is None:
        return None
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return os.path.join(root, f"absmax-{digest}.pt")


def read_stats(entry: str, key: dict[str, Any]) -> Optional[dict[tuple[int, str], torch.Tensor]]:
    """The statistics kept in `entry` for `key` ({(layer, kind): [in_features] fp32}), or None when
    absent, written for another key, or unreadable (a warning names it)."""
    if not os.path.isfile(entry):
        return None
    try:
        doc = torch.load(entry, map_location="cpu", weights_only=True)
        if json.loads(doc["key"]) != json.loads(json.dumps(key)):
            return None
        stats = {}
        for name, value in doc["stats"].items():
            layer, _, kind = name.partition(":")
            if not (isinstance(value, torch.Tensor) and value.dtype == torch.float32 and value.dim() == 1):
                raise ValueError(f"entry {name!r} is not a 1-D fp32 tensor")
            stats[(int(layer), kind)] = value
        if not stats:
            raise ValueError("no statistics")
        return stats
    except Exception as exc:  # a bad entry must never block loading: calibrate again
        logger.warning("ignoring unreadable calibration cache entry %s: %s", entry, exc)
        return None


def write_stats(entry: str, key: dict[str, Any], stats: dict[tuple[int, str], torch.Tensor]) -> None:
    """Write atomically (`disk_cache.write_entry`); an unwritable folder is a warning, not an error."""
    doc = {"key": json.dumps(key, sort_keys=True),
           "stats": {f"{layer}:{kind}": v.float().contiguous() for (layer, kind), v in stats.items()}}
    write_entry(entry, lambda fh: torch.save(doc, fh), "calibration statistics")
