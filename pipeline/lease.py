"""One job per output: a lease under `OUTPUT/_job/lease/` that a second concurrent run refuses on.

    OUTPUT/_job/lease/lease-00000003.json   {"owner", "run_id", "acquired_at", "heartbeat_at", "expires_at", ...}

A run takes the lease before it touches anything else under `_job/` and
gives it back when it ends, however it ends. The lease file of generation
`g` is created only if absent (a conditional put, `If-None-Match: *`, on S3;
`O_EXCL` on a local disk), so of two runs racing for the same generation
exactly one wins. The holder is the highest generation present.

- Held: a live lease (its `expires_at`, UTC seconds, is in the future) makes
  `Lease.acquire` raise `JobLocked`, naming the owner and when it expires.
- Expired: a run that died without giving the lease back (killed, machine
  lost) stops renewing it; once `expires_at` has passed, the next run creates
  generation `g + 1` (again create-if-absent, so one taker wins) and deletes
  the older files. A holder known dead counts as expired at once: one that ran
  on this machine, in this process namespace, since this boot (the lease
  records Linux's boot id and pid namespace), and whose process is gone (a
  SIGKILLed run re-run on the same host does not wait out its lease).
- Heartbeat: the holder rewrites its own file every `ttl_s / 4` seconds with a
  new `expires_at = now + ttl_s`. A holder that finds a higher generation, or
  that could not renew before its own expiry (storage down), has lost the
  lease: `check()` then raises `LeaseLost`, and the job commits nothing more.

Expiry compares the owner's clock (written in the file) with the reader's:
machines sharing an output should keep their clocks within a small fraction
of `ttl_s` (NTP does).
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Any, Optional

from pipeline import io
from pipeline.storage import StorageError

DEFAULT_TTL_S = 60.0
LEASE_DIR = "lease"
_PREFIX, _SUFFIX = "lease-", ".json"


class JobLocked(RuntimeError):
    """Another run holds the output's lease (its owner and expiry are in the message and `holder`)."""

    def __init__(self, message: str, holder: Optional[dict[str, Any]] = None) -> None:
        super().__init__(message)
        self.holder = holder or {}


class LeaseLost(RuntimeError):
    """This run's lease expired or was taken over; it must not commit anything more."""


def lease_dir(output: str) -> str:
    """URL of the folder holding the lease files."""
    return io.join(output, "_job", LEASE_DIR)


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="seconds")


def _generations(output: str, so: dict[str, Any]) -> list[int]:
    gens = []
    for name in io.list_names(lease_dir(output), so):
        if name.startswith(_PREFIX) and name.endswith(_SUFFIX):
            try:
                gens.append(int(name[len(_PREFIX):-len(_SUFFIX)]))
            except ValueError:
                continue
    return sorted(gens)


def _url(output: str, gen: int) -> str:
    return io.join(lease_dir(output), f"{_PREFIX}{gen:08d}{_SUFFIX}")


def _process_space() -> Optional[str]:
    """This process's boot id and pid namespace (Linux): two processes with the same value see the
    same pids, so one can tell whether the other is alive; None where they cannot be read."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return None


def holder_is_dead(doc: dict[str, Any]) -> bool:
    """True only if the lease's holder ran on this machine, in this pid namespace, since this boot,
    and its process no longer exists. Anything unknown (another host, an older lease file, a pid
    reused by a live process, a zombie, another user's process) counts as alive."""
    space = _process_space()
    if space is None or doc.get("process_space") != space:
        return False
    host, _, pid = str(doc.get("owner", "")).rpartition(":")
    if host != socket.gethostname() or not pid.isdigit() or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:  # PermissionError: a live process of another user
        return False
    return False


def describe_holder(doc: dict[str, Any], now: Optional[float] = None) -> str:
    """"run R (owner host:pid, heartbeat 3 s ago, expires in 57 s)" for messages."""
    now = time.time() if now is None else now
    beat = now - float(doc.get("heartbeat_at", now))
    left = float(doc.get("expires_at", now)) - now
    return (f"run {doc.get('run_id', '?')} (owner {doc.get('owner', '?')}, last heartbeat {beat:.0f} s ago, "
            f"expires in {max(left, 0):.0f} s)")


@dataclass(frozen=True)
class LeaseToken:
    """A picklable reference to a run's lease, for the processes that commit shards for it (Dask
    workers): `check` reads the lease file, so a worker of a run that ended or lost the output
    commits nothing. It never renews the lease; the run that holds it does.

    Attributes:
        output: the job's output URL.
        run_id: the holding run.
        generation: the lease file's generation.
        storage_options: options to read the lease file with; left empty when the token travels
            (they may hold credentials) and bound on the worker with `bind`.
    """

    output: str
    run_id: str
    generation: int
    storage_options: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def bind(self, storage_options: dict[str, Any]) -> "LeaseToken":
        """This token with the worker's storage options."""
        return replace(self, storage_options=dict(storage_options))

    def check(self) -> None:
        """Raise unless the run still holds the lease (its file is there, names it and has not expired).

        Raises:
            LeaseLost: the lease was given back, taken over or expired.
            StorageError: the lease file could not be read.
        """
        doc = io.read_json(_url(self.output, self.generation), self.storage_options)
        if doc is None or doc.get("run_id") != self.run_id:
            why = "the run that handed out this work has ended or lost the output"
        elif float(doc.get("expires_at", 0)) < time.time():
            why = "the lease of the run that handed out this work expired (that run stopped renewing it)"
        else:
            return
        raise LeaseLost(f"{self.output}: {why} (run {self.run_id}); this worker commits nothing more.")


class Lease:
    """This run's hold on an output; see the module docstring.

    Use `Lease.acquire(...)`, then `check()` before each commit and `release()` at the end.
    """

    def __init__(self, output: str, storage_options: dict[str, Any], run_id: str, generation: int,
                 ttl_s: float, doc: dict[str, Any]) -> None:
        self.output, self.storage_options, self.run_id = output, storage_options, run_id
        self.generation, self.ttl_s, self.doc = generation, ttl_s, doc
        self.lost: Optional[str] = None
        self.created_folders: list[str] = []  # local folders the acquire created, innermost first
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @property
    def url(self) -> str:
        return _url(self.output, self.generation)

    def token(self) -> LeaseToken:
        """A picklable `LeaseToken` for workers that commit shards for this run."""
        return LeaseToken(self.output, self.run_id, self.generation)

    @classmethod
    def acquire(cls, output: str, storage_options: Optional[dict[str, Any]] = None, *, run_id: str,
                ttl_s: float = DEFAULT_TTL_S, heartbeat: bool = True) -> "Lease":
        """Take the output's lease, or raise.

        Args:
            ttl_s: seconds the lease stays valid without a heartbeat (a dead run's lease expires after it).
            heartbeat: renew it from a background thread every `ttl_s / 4` seconds.

        Raises:
            JobLocked: another run holds a live lease (the message names it and says when it expires).
            StorageError: the lease could not be read or written.
        """
        so = dict(storage_options or {})
        missing = _missing_local_folders(output, so)
        for _ in range(5):
            gens = _generations(output, so)
            nxt = 0
            if gens:
                top = gens[-1]
                holder = io.read_json(_url(output, top), so)
                if holder is None:  # released or taken over between the listing and the read
                    continue
                now = time.time()
                if float(holder.get("expires_at", 0)) > now and not holder_is_dead(holder):
                    raise JobLocked(
                        f"{output} is being written by another {describe_holder(holder, now)}. Only one run may "
                        f"write an output at a time: wait for it to finish, or, if it died, re-run after its "
                        f"lease expires.", holder)
                nxt = top + 1
            now = time.time()
            doc = {"owner": f"{socket.gethostname()}:{os.getpid()}", "run_id": run_id, "generation": nxt,
                   "ttl_s": ttl_s, "acquired_at": now, "heartbeat_at": now, "expires_at": now + ttl_s,
                   "expires_at_utc": _iso(now + ttl_s), "process_space": _process_space()}
            if io.create_exclusive(_url(output, nxt), json.dumps(doc).encode(), so):
                lease = cls(output, so, run_id, nxt, ttl_s, doc)
                lease.created_folders = missing
                for g in gens:  # a dead run's lease, now superseded
                    try:
                        io.remove(_url(output, g), so)
                    except StorageError:
                        pass
                if heartbeat:
                    lease._start()
                return lease
        raise JobLocked(f"{output}: could not take the lease (other runs keep racing for it); try again")

    # ------------------------------------------------------------ holding
    def _start(self) -> None:
        self._thread = threading.Thread(target=self._beat_loop, name=f"tokenmill-lease-{self.run_id}", daemon=True)
        self._thread.start()

    def _beat_loop(self) -> None:
        while not self._stop.wait(self.ttl_s / 4):
            try:
                self.renew()
            except StorageError:
                pass  # retried at the next beat; check() fails once the lease has expired unrenewed
            if self.lost == "released":
                # released while this renewal was in flight (a slow store): do not leave a live lease behind
                try:
                    io.remove(self.url, self.storage_options)
                except StorageError:
                    pass
            if self.lost:
                return

    def renew(self) -> None:
        """Extend the lease by `ttl_s` from now (the heartbeat); marks it lost if another run took over.

        Raises:
            StorageError: the lease file could not be read or written.
        """
        if self.lost:
            return
        if any(g > self.generation for g in _generations(self.output, self.storage_options)):
            self.lost = "another run took the output over after this run's lease expired"
            return
        now = time.time()
        doc = {**self.doc, "heartbeat_at": now, "expires_at": now + self.ttl_s, "expires_at_utc": _iso(now + self.ttl_s)}
        io.write_bytes(self.url, json.dumps(doc).encode(), self.storage_options)
        self.doc = doc

    def check(self) -> None:
        """Raise unless this run still holds the lease (call before each commit).

        Raises:
            LeaseLost: the lease was taken over, or expired without a heartbeat (storage unreachable).
        """
        if self.lost is None and time.time() > float(self.doc["expires_at"]):
            self.lost = f"this run could not renew its lease for {self.ttl_s:.0f} s (storage unreachable?)"
        if self.lost is not None:
            raise LeaseLost(f"{self.output}: {self.lost}; this run stops without committing more. "
                            f"Re-run the same command to resume.")

    def release(self, storage_options: Optional[dict[str, Any]] = None, tidy: bool = False) -> None:
        """Stop the heartbeat and delete this run's lease file (if it is still ours), then, on a local disk,
        the lease's folder `_job/lease/` if that left it empty (a finished job left it behind, empty; a
        folder holding anything, such as another run's lease, stays). Never raises a StorageError: a lease
        that cannot be deleted expires after `ttl_s`.

        Args:
            storage_options: options for the delete (e.g. quick limits after a storage failure).
            tidy: also remove the local folders `acquire` created (`_job/lease/`, `_job/`, the output
                folder itself), each only while it is empty: a run refused before it wrote anything
                leaves the output as it found it. Object stores have no folders to remove.
        """
        held = self.lost is None
        self.lost = self.lost or "released"  # a renewal still in flight removes what it wrote (_beat_loop)
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=1.0)
        if held:
            try:
                io.remove(self.url, storage_options if storage_options is not None else self.storage_options)
            except StorageError:
                pass
            else:
                remove_empty_folder(lease_dir(self.output), self.storage_options)
        if held and tidy:
            for url in self.created_folders:
                fs, path = io.filesystem(url, self.storage_options)
                try:
                    fs.rmdir(path)  # only an empty folder: anything another run wrote there stays
                except FileNotFoundError:  # gone already (the lease's folder, above)
                    continue
                except OSError:
                    break


def remove_empty_folder(url: str, storage_options: dict[str, Any]) -> bool:
    """Remove the local folder `url` if it is empty (`rmdir`: a folder that holds anything, another run's
    lease or the temp file it is about to link into place, stays; `io.create_exclusive` makes the folder
    again when it went between its `makedirs` and its write). Nothing to do on an object store, whose
    folders are only prefixes of the objects there. Returns True when the folder was removed."""
    fs, path = io.filesystem(url, storage_options)
    if not io.is_local(fs):
        return False
    try:
        fs.rmdir(path)
    except OSError:  # not empty, gone already, or not ours to remove
        return False
    return True


def _missing_local_folders(output: str, storage_options: dict[str, Any]) -> list[str]:
    """Of the lease's folder, `_job/` and the output folder (innermost first), those that do not
    exist yet on a local disk, which taking the lease creates; [] for an object store."""
    fs, _ = io.filesystem(output, storage_options)
    if not io.is_local(fs):
        return []
    urls = [lease_dir(output), io.join(output, "_job"), output]
    return [u for u in urls if not fs.exists(io.filesystem(u, storage_options)[1])]
