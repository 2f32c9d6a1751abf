"""The job's record under `OUTPUT/_job/`: manifest (fingerprint + shard plan) and per-shard done markers.

    OUTPUT/_job/manifest.json         {"fingerprint", "inputs", "spec", "plan", "shards", ...}
                                      (shards: rows as [offset, length] runs; plan: PlanStats;
                                      "constraint": the default output constraint as text, not
                                      hashed, for describe_change; absent without one)
    OUTPUT/_job/done/part-00000.json  one marker per committed shard, with its counts and the worker
                                      that committed it

The fingerprint is a SHA-256 of the input files (URL, size, ETag or mtime, rows,
columns) and the spec fields that shape the outputs (model, sampling,
templates, shard size, ...). Markers are separate files rather than a list
inside the manifest, so shard tasks running in parallel (threads, processes,
machines) never race on one file.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any

from pipeline import io
from pipeline.cost import TokenCounts

MANIFEST_VERSION = 2  # 2: shards are row lists (runs) of a prefix plan, plus plan statistics


@dataclass
class ShardResult:
    """What committing one shard produced (also the content of its done marker).

    Attributes:
        index: the shard's number.
        rows: rows in the shard.
        counts: ok/error rows and token counts of the shard.
        device: the engine's device name.
        seconds: wall seconds from reading the shard to its commit.
        worker: who ran it, i.e. wrote its part file: a Dask worker's address (tcp://HOST:PORT) on
            a cluster, else HOST:PID of the process ("" in markers written before workers were
            recorded). The marker's `committed_by` names who wrote the marker, another worker when
            it adopted a part file whose writer died before marking it (`adopted_part`).
    """

    index: int
    rows: int
    counts: TokenCounts
    device: str
    seconds: float
    worker: str = ""

    def to_json(self) -> dict:
        d = asdict(self)
        d["counts"] = asdict(self.counts)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "ShardResult":
        return cls(index=d["index"], rows=d["rows"], counts=TokenCounts(**d["counts"]),
                   device=d.get("device", ""), seconds=d.get("seconds", 0.0), worker=d.get("worker", ""))


def job_url(output: str, *parts: str) -> str:
    """URL of a file under OUTPUT/_job/."""
    return io.join(output, "_job", *parts)


def fingerprint(files: list[io.InputFile], spec_fields: dict[str, Any]) -> tuple[str, dict]:
    """(SHA-256 hex, the document hashed) for these input files and output-shaping spec fields."""
    doc = {"inputs": [f.identity() for f in files], "spec": spec_fields}
    doc = json.loads(json.dumps(doc, sort_keys=True, default=str))  # as it will read back from JSON
    digest = hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()
    return digest, doc


def describe_change(old: dict, new: dict) -> str:
    """Human-readable differences between a stored manifest and a new fingerprint document: each changed
    spec field with its old and new value (the output constraint as text, its hash as a detail), each
    input file added, removed or changed (with what changed: size, ETag or mtime, rows, columns)."""
    changes = []
    old_spec, new_spec = old.get("spec", {}), new.get("spec", {})
    for k in sorted(set(old_spec) | set(new_spec)):
        if old_spec.get(k) == new_spec.get(k):
            continue
        if k == "structured":
            changes.append(f"output constraint: {_constraint(old)} -> {_constraint(new)}")
        else:
            changes.append(f"{k}: {old_spec.get(k)!r} -> {new_spec.get(k)!r}")
    old_inputs = {f["path"]: f for f in old.get("inputs", [])}
    new_inputs = {f["path"]: f for f in new.get("inputs", [])}
    for p in sorted(set(old_inputs) | set(new_inputs)):
        if p not in new_inputs:
            changes.append(f"input removed: {p}")
        elif p not in old_inputs:
            changes.append(f"input added: {p}")
        elif old_inputs[p] != new_inputs[p]:
            a, b = old_inputs[p], new_inputs[p]
            what = ", ".join(f"{k} {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b))
                             if a.get(k) != b.get(k))
            changes.append(f"input changed: {p} ({what})")
    return "; ".join(changes) or "fingerprint differs"


def _constraint(doc: dict) -> str:
    """A manifest's (or fingerprint document's) output constraint: its text, then its hash; "none"."""
    key = doc.get("spec", {}).get("structured")
    if key is None:
        return "none"
    text = doc.get("constraint") or "(not recorded by this older manifest)"
    return f"{text} [sha256 {str(key)[:12]}]"


def read_manifest(output: str, storage_options: dict[str, Any], check_version: bool = True) -> dict | None:
    """The job's manifest at `output`, or None when there is none.

    Args:
        check_version: refuse a manifest of another version (off for a run that replaces the job).

    Raises:
        ValueError: a manifest of another version than MANIFEST_VERSION (its shard plan is laid out
            otherwise), naming the file, both versions and the way out (`--overwrite`).
        StorageError: the storage cannot be reached or denies access.
    """
    url = job_url(output, "manifest.json")
    doc = io.read_json(url, storage_options)
    if check_version and isinstance(doc, dict) and doc.get("version") != MANIFEST_VERSION:
        raise ValueError(f"{url} is a manifest of version {doc.get('version')!r}; this tokenmill reads version "
                         f"{MANIFEST_VERSION} only, so it cannot resume that job: re-run with --overwrite to start "
                         f"over, or choose another output")
    return doc


def write_manifest(output: str, manifest: dict, storage_options: dict[str, Any]) -> None:
    io.write_json_atomic({"version": MANIFEST_VERSION, **manifest}, job_url(output, "manifest.json"),
                         storage_options)


def part_files(output: str, storage_options: dict[str, Any]) -> list[str]:
    """Names of the part files at the output."""
    return [n for n in io.list_names(output, storage_options)
            if (n.startswith("part-") and n.endswith(".parquet")) or _batch_output(n)]


def _batch_output(name: str) -> bool:
    """An OpenAI Batch result or error file of a job (`pipeline.batch_files`)."""
    return name.startswith(("results-", "errors-")) and name.endswith(".jsonl")


def clear_output(output: str, storage_options: dict[str, Any], keep: tuple[str, ...] = ("lease",)) -> None:
    """Delete a job's part files, temp files of killed writes and its `_job/` folder (nothing else),
    except the `_job/` entries named in `keep` (the lease of the run doing the clearing)."""
    for name in io.list_names(output, storage_options):
        if (name.startswith("part-") and name.endswith(".parquet")) or name.startswith(io.TEMP_PREFIX) \
                or _batch_output(name):
            io.remove(io.join(output, name), storage_options)
    for name in io.list_names(job_url(output), storage_options):
        if name not in keep:
            io.remove(job_url(output, name), storage_options)


def marker_url(output: str, shard_name: str) -> str:
    return job_url(output, "done", shard_name.replace(".parquet", ".json"))


def mark_done(output: str, shard_name: str, result: ShardResult, extra: dict,
              storage_options: dict[str, Any]) -> ShardResult:
    """Write a shard's done marker (after its part file is committed), first writer wins.

    Returns:
        `result` when this call created the marker; else the result in the marker already there
        (another attempt of the same shard committed first).

    Raises:
        StorageError: the marker could not be written or read back.
    """
    url = marker_url(output, shard_name)
    data = json.dumps({**result.to_json(), **extra}, indent=2, sort_keys=True, default=str).encode()
    if io.create_exclusive(url, data, storage_options):
        return result
    existing = io.read_json(url, storage_options)
    return ShardResult.from_json(existing) if existing is not None else result


def read_marker(output: str, shard_name: str, storage_options: dict[str, Any]) -> ShardResult | None:
    """The shard's done marker, or None when the shard is not done."""
    d = io.read_json(marker_url(output, shard_name), storage_options)
    return ShardResult.from_json(d) if d is not None else None


def committed_by_run(output: str, shard_names: list[str], run_id: str,
                     storage_options: dict[str, Any]) -> list[ShardResult]:
    """The shards among `shard_names` whose done marker run `run_id` wrote (its `run_id` field), in the
    order given: what a run committed, read back from storage, for a run that books its cost without
    every window's result (a window task that failed or was interrupted after some commits returns
    none of them). One listing of the done folder, then one read per marker among `shard_names`.

    Raises:
        StorageError: the folder or a marker could not be read.
    """
    present = set(io.list_names(job_url(output, "done"), storage_options))
    out = []
    for name in shard_names:
        marker = name.replace(".parquet", ".json")
        if marker in present:
            d = io.read_json(job_url(output, "done", marker), storage_options)
            if d is not None and d.get("run_id") == run_id:
                out.append(ShardResult.from_json(d))
    return out


def shard_workers(output: str, storage_options: dict[str, Any]) -> dict[int, str]:
    """Which worker committed each done shard, by index (from the done markers)."""
    return {i: r.worker for i, r in done_shards(output, storage_options).items()}


def done_shards(output: str, storage_options: dict[str, Any]) -> dict[int, ShardResult]:
    """Shards with a done marker, by index."""
    out = {}
    for name in io.list_names(job_url(output, "done"), storage_options):
        if name.startswith("part-") and name.endswith(".json"):
            d = io.read_json(job_url(output, "done", name), storage_options)
            if d is not None:
                r = ShardResult.from_json(d)
                out[r.index] = r
    return out
