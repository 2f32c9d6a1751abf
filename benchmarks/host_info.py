"""The host line of the benchmark tables: the CPU's model name and the ISA flags that decide which
kernels and dtypes are fast on it (bf16 is fast only with AVX512-BF16 or AMX-BF16).

A stand-in until `engine.host` (the engine's `Host` record) lands: then `read_host` becomes
``Host.current()`` and `describe_host` its ``describe()``; nothing else reads /proc/cpuinfo here.
"""
from __future__ import annotations

import os
import platform
from typing import Any, Optional

HOST_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")  # /proc/cpuinfo names


def read_host(cpuinfo: Optional[str] = None) -> dict[str, Any]:
    """{"cpu": model name, "flags": the `HOST_FLAGS` present (in that order), "cpus": CPUs this process
    may use} from the text of /proc/cpuinfo (default: read it; off Linux the name is
    `platform.processor()` and no flag is known)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            cpuinfo = ""
    name, flags = "", set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not name:
            name = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return {"cpu": name or platform.processor() or platform.machine(), "flags": [f for f in HOST_FLAGS if f in flags],
            "cpus": cpus}


def describe_host(host: dict[str, Any]) -> str:
    """One line: ``host: AMD EPYC, 2 CPUs; avx2 avx512f avx512_bf16 avx512_vnni; no amx_bf16 amx_int8``."""
    missing = [f for f in HOST_FLAGS if f not in host["flags"]]
    return (f"host: {host['cpu']}, {host['cpus']} CPUs; {' '.join(host['flags']) or 'none of ' + ' '.join(HOST_FLAGS)}"
            + (f"; no {' '.join(missing)}" if missing and host["flags"] else ""))
