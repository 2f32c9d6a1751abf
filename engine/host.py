"""The host record: which CPU this process runs on, what its matrix units are, and what that picks.

`Host.current()` reads the CPU once (`/proc/cpuinfo` and `/sys/devices/system/cpu`): the model
name, the ISA features the kernels care about, the CPUs this process may use and the cache
sizes. It decides two things and is printed beside every benchmark figure and in every cost
report, because a throughput figure means nothing without the host it ran on:

- `Host.matrix_unit`: the fastest unit for dense (unquantized) linear layers: "amx-bf16"
  (TDPBF16PS tiles), "avx512-bf16" (VDPBF16PS dot products), or "fp32-fma" (AVX2 / AVX-512 FMA
  in fp32, or plain C).
- `Host.auto_dtype()`: what `dtype="auto"` resolves to on the CPU: "bfloat16" where the host
  has AMX-BF16 or AVX512-BF16 (bf16 weights, fp32 accumulation and residual stream), else
  "float32" (on AVX2-only CPUs bf16 arithmetic is emulated and far slower than fp32).

Sources: the Linux `/proc/cpuinfo` flag names (arch/x86/include/asm/cpufeatures.h); Intel's
Architecture Instruction Set Extensions reference for AMX and AVX512_BF16.
"""
from __future__ import annotations

import functools
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

# the /proc/cpuinfo flags the kernels and the dtype choice read
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "avx_vnni",
             "amx_tile", "amx_bf16", "amx_int8")


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _cache_bytes(text: str) -> Optional[int]:
    """'32K' / '1024K' / '32M' (sysfs cache size) -> bytes; None for anything else."""
    text = text.strip().upper()
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if text and text[-1] in units and text[:-1].isdigit():
        return int(text[:-1]) * units[text[-1]]
    return int(text) if text.isdigit() else None


def _caches(cpu: int = 0) -> dict[str, int]:
    """Per-core cache sizes in bytes of one CPU from sysfs: {"L1d", "L2", "L3"} (those present)."""
    out: dict[str, int] = {}
    base = Path(f"/sys/devices/system/cpu/cpu{cpu}/cache")
    for idx in sorted(base.glob("index*")) if base.exists() else []:
        level, kind = _read(str(idx / "level")).strip(), _read(str(idx / "type")).strip()
        size = _cache_bytes(_read(str(idx / "size")))
        if size is None or kind == "Instruction":
            continue
        name = f"L{level}d" if level == "1" else f"L{level}"
        out[name] = size
    return out


@dataclass(frozen=True)
class Host:
    """One machine's CPU as the engine sees it.

    Attributes:
        model_name: the CPU's model name ("AMD EPYC", "Intel(R) Xeon(R) Platinum 8480+", ...).
        family, model: the CPU's family and model numbers (x86: AMD family 25 model 17 is Zen 4,
            family 26 Zen 5; None where not reported), which a VM's bare model name leaves out.
        machine: `platform.machine()` ("x86_64", "aarch64").
        flags: the ISA features of `ISA_FLAGS` this CPU reports.
        cpus: CPUs this process may run on (its affinity mask).
        caches: per-core data cache sizes in bytes ({"L1d", "L2", "L3"}; L3 is shared).
    """

    model_name: str
    machine: str
    flags: frozenset = field(default_factory=frozenset)
    family: Optional[int] = None
    model: Optional[int] = None
    cpus: int = 1
    caches: dict = field(default_factory=dict, compare=False, hash=False)

    @classmethod
    def from_cpuinfo(cls, cpuinfo: str, machine: str = "x86_64", cpus: int = 1,
                     caches: Optional[dict] = None) -> "Host":
        """A host from the text of /proc/cpuinfo (the first processor's model name and flags)."""
        name, flags, nums = "", set(), {}
        for line in cpuinfo.splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and not name:
                name = value.strip()
            elif key == "flags" and not flags:
                flags = set(value.split())
            elif key in ("cpu family", "model") and key not in nums and value.strip().isdigit():
                nums[key] = int(value.strip())
        return cls(model_name=name or platform.processor() or machine, machine=machine,
                   flags=frozenset(f for f in ISA_FLAGS if f in flags), family=nums.get("cpu family"),
                   model=nums.get("model"), cpus=cpus, caches=dict(caches or {}))

    @staticmethod
    @functools.lru_cache(maxsize=1)
    def current() -> "Host":
        """This machine (read once per process)."""
        from .threads import available_cpus

        return Host.from_cpuinfo(_read("/proc/cpuinfo"), platform.machine(), available_cpus(), _caches())

    def has(self, flag: str) -> bool:
        """Whether the CPU reports `flag` (a name of `ISA_FLAGS`)."""
        return flag in self.flags

    @property
    def amx_bf16(self) -> bool:
        """AMX tiles with bf16 products (TDPBF16PS)."""
        return {"amx_tile", "amx_bf16"} <= self.flags

    @property
    def avx512_bf16(self) -> bool:
        """AVX-512 with bf16 dot products (VDPBF16PS) and conversions (VCVTNE2PS2BF16)."""
        return {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} <= self.flags

    @property
    def bf16_unit(self) -> bool:
        """Whether bf16 linear layers beat fp32 here (a native bf16 dot product or tile unit)."""
        return self.amx_bf16 or self.avx512_bf16

    @property
    def matrix_unit(self) -> str:
        """The unit dense linear layers run on: "amx-bf16", "avx512-bf16" or "fp32-fma"."""
        if self.amx_bf16:
            return "amx-bf16"
        if self.avx512_bf16:
            return "avx512-bf16"
        return "fp32-fma"

    def auto_dtype(self) -> str:
        """What `dtype="auto"` means on this CPU for unquantized weights: "bfloat16" or "float32"."""
        return "bfloat16" if self.bf16_unit else "float32"

    @property
    def isa(self) -> str:
        """The ISA features present, in `ISA_FLAGS` order, comma separated ("" for none)."""
        return ",".join(f for f in ISA_FLAGS if f in self.flags)

    @property
    def host_id(self) -> str:
        """A short, stable name for this kind of host, used as its results folder.

        "<line>[-<core>]-<isa>": the product line from the model name ("epyc", "ryzen", "xeon",
        "core", else the machine), the AMD core generation from family and model (x86 family 23 is
        Zen to Zen 2, 25 Zen 3 or Zen 4 by model range, 26 Zen 5; Intel VMs report no usable
        generation, so none), and the widest matrix ISA ("amx", "avx512bf16", "avx512", "avx2").
        E.g. "epyc-zen4-avx512bf16", "epyc-zen3-avx2", "xeon-amx".
        """
        name = self.model_name.lower()
        line = next((w for w in ("epyc", "ryzen", "xeon") if w in name),
                    "core" if "intel" in name else (self.machine or "cpu").lower())
        core = None
        if self.family == 23:
            core = "zen2" if (self.model or 0) >= 0x30 else "zen"
        elif self.family == 25:
            # Zen 4 model ranges (Genoa, Raphael, Phoenix, Bergamo); the others of family 25 are Zen 3
            zen4 = any(lo <= (self.model or 0) <= lo + 0x0F for lo in (0x10, 0x60, 0x70, 0xA0))
            core = "zen4" if zen4 else "zen3"
        elif self.family == 26:
            core = "zen5"
        isa = ("amx" if self.amx_bf16 else "avx512bf16" if self.avx512_bf16 else
               "avx512" if self.has("avx512f") else "avx2" if self.has("avx2") else None)
        return "-".join(p for p in (line, core, isa) if p)

    def describe(self) -> str:
        """One line for reports: model name, CPUs, ISA features, matrix unit and caches."""
        caches = " ".join(f"{k} {v >> 10} KiB" for k, v in sorted(self.caches.items()))
        fm = f"family {self.family} model {self.model}, " if self.family is not None else ""
        return (f"{self.model_name} ({fm}{self.machine}), {self.cpus} CPUs, ISA {self.isa or 'none'}, "
                f"matrix unit {self.matrix_unit}" + (f", caches {caches}" if caches else ""))

    def as_dict(self) -> dict:
        """The record as plain JSON types (for benchmark reports and the cost report)."""
        return {"cpu": self.model_name, "family": self.family, "model": self.model, "machine": self.machine,
                "cpus": self.cpus, "isa": self.isa,
                "matrix_unit": self.matrix_unit, "host_id": self.host_id, "caches": dict(self.caches)}


def current() -> Host:
    """`Host.current()`."""
    return Host.current()


def describe() -> str:
    """`Host.current().describe()` (what benchmarks print under every table)."""
    return Host.current().describe()


if __name__ == "__main__":  # python -m engine.host
    print(describe())
