"""Where a benchmark's result goes and what it carries: one file per benchmark, variant and host.

Layout: `benchmarks/results/<host-id>/<benchmark>[-<variant>].json` (and the `.txt` beside it),
where host-id is `engine.host.Host.host_id` ("epyc-zen4-avx512bf16", "xeon-amx", ...) or
`gpu_host_id` for a GPU run. A new run of the same benchmark on the same kind of host replaces
the file; git keeps the history.

Every result carries `command` (the argv, relative to the repository), `date` (UTC, ISO 8601),
`commit` (the short hash of HEAD, "+dirty" when the tree has edits; None outside a checkout),
`host` (`Host.as_dict()`), `load` (the machine's load when the result was written) and
`notes` (free text: what the run shows and what it does not). Paths in a result are made
relative to the repository, a package or a cache folder, so no machine's folders are recorded.
"""
from __future__ import annotations

import datetime as _dt
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_]*(-[a-z0-9][a-z0-9_.-]*)?$")
HOST_RE = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")

# an absolute path (POSIX) inside a string: a slash at the start or after a non-path character
_ABS = re.compile(r"(?<![\w.~:/-])/(?:[\w.+@-]+/)*[\w.+@-]+/?")


def result_path(host_id: str, benchmark: str, variant: Optional[str] = None, ext: str = "json",
                root: Path = RESULTS) -> Path:
    """`root/<host_id>/<benchmark>[-<variant>].<ext>`; ValueError for a name with other characters.

    benchmark: the writer's module name ("throughput", "efficiency"); variant: what sets this
    run apart from the default one ("kv-int8", "batch1"), lower case, or None.
    """
    name = benchmark + (f"-{variant}" if variant else "")
    if not HOST_RE.match(host_id) or not NAME_RE.match(name):
        raise ValueError(f"result name {host_id!r}/{name!r}: use lower-case letters, digits, '_' and '-'")
    return root / host_id / f"{name}.{ext}"


def gpu_host_id(device_name: str) -> str:
    """A GPU's results folder: "NVIDIA H200" -> "gpu-nvidia-h200"."""
    slug = re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")
    return f"gpu-{slug or 'unknown'}"


def relative_path(path: str) -> str:
    """One absolute path made machine-free: repository-relative under the checkout, package-relative
    under site-packages, relative to the tokenmill cache under it, else the file's name."""
    p = path.rstrip("/")
    for marker in ("/site-packages/", "/.cache/tokenmill/peers/", "/.cache/tokenmill/"):
        if marker in p:
            return p.split(marker, 1)[1]
    try:
        return str(Path(p).relative_to(ROOT))
    except ValueError:
        pass
    m = re.search(r"/((?:engine|benchmarks|pipeline|flows|tests|data)/.*)$", p)
    if m and p.startswith(("/work/", "/home/", "/root/")):
        return m.group(1)
    return Path(p).name or p


def strip_paths(value: Any) -> Any:
    """`value` (JSON types, nested) with every absolute path in its strings and keys relativized."""
    if isinstance(value, str):
        return _ABS.sub(lambda m: relative_path(m.group(0)), value)
    if isinstance(value, dict):
        return {strip_paths(k): strip_paths(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strip_paths(v) for v in value]
    return value


def commit() -> Optional[str]:
    """HEAD's short hash, with "+dirty" when tracked files other than results differ from it (a run that
    follows another writes over the first one's result files); None outside a git checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                ":(exclude)benchmarks/results"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")


def _load() -> Optional[dict]:
    try:
        from benchmarks.hf_compare import machine_load

        return machine_load()
    except Exception:  # noqa: BLE001 - the load is context, never a reason to lose a result
        return None


def stamp(report: dict, benchmark: str, argv: Optional[list[str]] = None, notes: str = "") -> dict:
    """`report` with the record's keys (command, date, commit, host, load, notes) put first and
    every path relativized; keys the report already has win."""
    from engine.host import Host

    cmd = " ".join(["python", "-m", f"benchmarks.{benchmark}", *(sys.argv[1:] if argv is None else argv)])
    head = {"benchmark": benchmark,
            "command": cmd,
            "date": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
            "commit": commit(),
            "host": Host.current().as_dict(),
            "load": _load(),
            "notes": notes}
    return strip_paths({**head, **report})


def add_arguments(parser) -> None:
    """Add `--record [VARIANT]` to a benchmark's argument parser."""
    parser.add_argument("--record", nargs="?", const="", default=None, metavar="VARIANT",
                        help="also write the result to benchmarks/results/<host-id>/<benchmark>[-VARIANT].json")


def output_path(args, benchmark: str, host_id: Optional[str] = None) -> Optional[Path]:
    """Where a run's JSON goes: the results layout with `--record`, else `--output-json` (or None)."""
    if getattr(args, "record", None) is not None:
        from engine.host import Host

        return result_path(host_id or Host.current().host_id, benchmark, args.record or None)
    return getattr(args, "output_json", None)


def write(path: Optional[Path], report: dict, benchmark: str, notes: str = "") -> Optional[Path]:
    """Stamp `report` (see `stamp`) and write it to `path` as JSON (parents created); None: nothing."""
    if path is None:
        return None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(stamp(report, benchmark, notes=notes), indent=2, default=float) + "\n")
    print(f"wrote {relative_path(str(path.resolve()))}")
    return path


def main_benchmark() -> str:
    """The running benchmark's module name ("throughput" under `python -m benchmarks.throughput`)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    name = getattr(spec, "name", "") or ""
    return name.removeprefix("benchmarks.") if name.startswith("benchmarks.") else (name or "unknown")
