"""CPU threads: how the engine's two thread pools (PyTorch's OpenMP pool and the C kernel
library's own) are set up, so that together they never oversubscribe the cores.

- OpenMP's wait policy is read once, when PyTorch loads its OpenMP runtime. Importing
  `engine` sets ``OMP_WAIT_POLICY=PASSIVE`` first (unless the variable is already set or
  torch was imported earlier): idle OpenMP threads then sleep instead of spinning.
  Measured on this 2-core machine: with two busy loops beside it a 2-row decode step went
  from 0.6 s to 4.7 s under spin-waiting, and to 1.3 s with PASSIVE.
- Both pools use the CPUs this process may run on (`os.sched_getaffinity`), one thread
  per CPU; the kernel library's idle workers spin for TOKENMILL_SPIN_US (50 us) and then
  sleep, and hand out work in small chunks, so a core shared with another process slows
  one thread down instead of the whole step.

Override with ``OMP_WAIT_POLICY`` (before importing engine or torch), ``TOKENMILL_NUM_THREADS``
or ``EngineConfig.num_threads`` / ``LLM(num_threads=...)`` (both pools), and
``TOKENMILL_SPIN_US``.
"""
from __future__ import annotations

import os
import sys
from typing import Optional


def configure_before_torch() -> bool:
    """Set OMP_WAIT_POLICY=PASSIVE if nobody chose a policy and torch is not loaded yet.
    Returns True if the policy now in force (or to be) is the environment's value."""
    if "torch" in sys.modules:
        return False
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return True


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, else the machine's count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def default_num_threads() -> int:
    """Threads per pool: TOKENMILL_NUM_THREADS, else the CPUs this process may use."""
    env = os.environ.get("TOKENMILL_NUM_THREADS")
    if env and env.isdigit() and int(env) > 0:
        return int(env)
    return available_cpus()


def check_num_threads(n: Optional[int]) -> None:
    """Refuse more threads than the CPUs this process may use (None: the default, always fine). A
    check of this machine, so a job for a cluster leaves it to the workers.

    Raises:
        ValueError: naming num_threads and the CPU count.
    """
    if n is not None and n > available_cpus():
        raise ValueError(f"num_threads={n} is more than the {available_cpus()} CPUs this process may use: threads "
                         f"beyond them only wait on one another (one 2-core run went 7x slower)")


def apply_num_threads(n: Optional[int] = None) -> int:
    """Give both pools `n` threads (default `default_num_threads()`); returns n.

    Raises:
        ValueError: n is more than the CPUs this process may use (`check_num_threads`).
    """
    import torch

    check_num_threads(n)
    n = n or default_num_threads()
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    from .kernels import cpu

    if cpu.available() and cpu.get_num_threads() != n:
        cpu.set_num_threads(n)
    return n
