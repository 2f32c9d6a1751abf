"""A command's first seconds: an interrupt while its heavy modules load ends it in one line.

`tokenmill` (the console script, or `python -m pipeline.cli`) and `python -m flows.deploy` import
torch, polars and prefect (1-5 s) before their `main` takes the signals over; a Ctrl-C in that
time printed the traceback of whatever module was loading (and a SIGTERM ended the process without
a word). `pipeline/__init__.py` and `flows/__init__.py` load those modules inside
`interrupts_end_the_command()`: in the process of one of these commands, a SIGINT or SIGTERM then
prints the line the command prints for an interrupt before it started and exits 128 + the signal
(130 for Ctrl-C). In any other process (a program importing `pipeline`, the tests) it changes
nothing. This module imports only the standard library.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Any, Iterator, Optional

# the command -> its line for an interrupt before it started (as its `main` prints it later)
LINES = {
    "tokenmill": "tokenmill: interrupted before the job started (nothing written); re-run the same command to start",
    "flows.deploy": "flows.deploy: stopped by {signal} before the deployment was served",
}
# `python -m MODULE` -> the command
_MODULES = {"pipeline.cli": "tokenmill", "flows.cli": "tokenmill", "flows.deploy": "flows.deploy"}


def running_command() -> Optional[str]:
    """The command this process runs: "tokenmill" (the console script, `python -m flows.cli` or `pipeline.cli`),
    "flows.deploy" (`python -m flows.deploy`), or None (anything else)."""
    argv = list(getattr(sys, "orig_argv", None) or [])
    for i, arg in enumerate(argv[1:], 1):
        if arg == "-m" and i + 1 < len(argv):
            return _MODULES.get(argv[i + 1])
        if arg.startswith("-m") and len(arg) > 2:
            return _MODULES.get(arg[2:])
    if sys.argv and os.path.basename(sys.argv[0]) == "tokenmill":
        return "tokenmill"
    return None


class _Interrupted(KeyboardInterrupt):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def interrupts_end_the_command() -> Iterator[None]:
    """In a command's process (`running_command`), end it on SIGINT or SIGTERM during the block: one
    line on stderr (`LINES`), exit status 128 + the signal (SystemExit). Elsewhere, or off the main
    thread, a no-op. A signal whose KeyboardInterrupt some module swallowed ends it after the block, and
    one that another exception wrapped (a RuntimeError from `__set_name__`) ends it as well.
    A signal the process ignores (SIG_IGN, e.g. under nohup) stays ignored."""
    command = running_command()
    if command is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []

    def on_signal(signum: int, frame: Any) -> None:
        received.append(signum)
        raise _Interrupted(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)
                if signal.getsignal(s) is not signal.SIG_IGN}
    try:
        yield
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt):
            _end(command, int(getattr(exc, "signum", signal.SIGINT)))
        if received:  # raised from a class body's __set_name__, Python wraps it in a RuntimeError
            _end(command, received[0])
        raise
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if received:
        _end(command, received[0])


def _end(command: str, signum: int) -> None:
    print(LINES[command].format(signal=signal.Signals(signum).name), file=sys.stderr, flush=True)
    sys.exit(128 + signum)
