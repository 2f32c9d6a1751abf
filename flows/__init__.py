"""Prefect orchestration of tokenmill jobs: `batch_generate` (flows/batch_generate.py) and its scheduler (flows/deploy.py).

Without a configured Prefect server a flow starts Prefect's temporary local API,
which takes 14-28 s on a small machine, over Prefect's 20 s default; importing
`flows` raises `PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS` to 90 unless it
is already set (it must be set before `prefect` is first imported).
"""
import os

os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")

from pipeline.startup import interrupts_end_the_command  # noqa: E402

with interrupts_end_the_command():  # `python -m flows.deploy` imports this package first: prefect, torch
    from flows.batch_generate import batch_generate, generate_window  # noqa: E402

__all__ = ["batch_generate", "generate_window"]
