"""The host record (`engine.host`): ISA features read from /proc/cpuinfo, the matrix unit they give,
and what `dtype="auto"` resolves to on each CPU kind these machines come as."""
from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.host import ISA_FLAGS, Host
from engine.kernels import cpu

XEON_AMX = ("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz\nflags\t\t: fpu sse2 avx avx2 "
            "fma avx512f avx512bw avx512vl avx512_vnni avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8\n"
            "processor\t: 1\nmodel name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz\nflags\t\t: fpu\n")
ZEN_BF16 = "cpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC 9B14\nflags\t\t: avx avx2 fma avx512f avx512bw avx512vl avx512_bf16 avx512_vnni\n"
ZEN3 = "model name\t: AMD EPYC 7B13\nflags\t\t: sse4_2 avx avx2 fma bmi2\n"
SKYLAKE = "model name\t: Intel(R) Xeon(R) Gold 6148\nflags\t\t: avx2 fma avx512f avx512bw avx512vl\n"


@pytest.mark.parametrize("text,unit,dtype,isa", [
    (XEON_AMX, "amx-bf16", "bfloat16",
     "avx2,fma,avx512f,avx512bw,avx512vl,avx512_bf16,avx512_vnni,amx_tile,amx_bf16,amx_int8"),
    (ZEN_BF16, "avx512-bf16", "bfloat16", "avx2,fma,avx512f,avx512bw,avx512vl,avx512_bf16,avx512_vnni"),
    (ZEN3, "fp32-fma", "float32", "avx2,fma"),
    (SKYLAKE, "fp32-fma", "float32", "avx2,fma,avx512f,avx512bw,avx512vl"),
])
def test_cpu_kinds_give_their_matrix_unit_and_auto_dtype(text, unit, dtype, isa):
    h = Host.from_cpuinfo(text, "x86_64", cpus=2, caches={"L1d": 48 << 10, "L2": 2 << 20})
    assert h.matrix_unit == unit and h.auto_dtype() == dtype and h.isa == isa
    assert h.model_name == text.split("model name\t: ")[1].split("\n")[0]  # the first processor's
    line = h.describe()
    assert line.startswith(h.model_name) and f"ISA {isa}" in line and f"matrix unit {unit}" in line
    assert "L1d 48 KiB L2 2048 KiB" in line and "2 CPUs" in line
    assert h.as_dict()["matrix_unit"] == unit and h.as_dict()["isa"] == isa
    if text is ZEN_BF16:  # family and model numbers name the core generation a VM's model name hides
        assert (h.family, h.model) == (25, 17) and "(family 25 model 17, x86_64)" in line
    else:
        assert h.family is None and f"({h.machine})" in line


def test_this_host_agrees_with_the_kernel_build():
    h = Host.current()
    assert h is Host.current()  # read once per process
    assert h.cpus >= 1 and set(h.flags) <= set(ISA_FLAGS)
    if cpu.available():
        assert cpu.bf16_native() == h.avx512_bf16
        assert cpu.isa() == ("avx512" if {"avx512f", "avx512bw", "avx512vl"} <= h.flags else
                             "avx2" if {"avx2", "fma"} <= h.flags else "generic")


@pytest.mark.parametrize("text", [XEON_AMX, ZEN_BF16, ZEN3])
def test_auto_dtype_on_the_cpu_follows_the_host_for_unquantized_weights_only(text, monkeypatch):
    from engine import loader

    host = Host.from_cpuinfo(text)
    monkeypatch.setattr(Host, "current", staticmethod(lambda: host))
    serve = cpu.available()
    want = "bfloat16" if host.bf16_unit and serve else "float32"

    def resolved(**kw):
        return loader.resolve_settings(EngineConfig(model="m", device="cpu", **kw))[1]

    assert resolved() == getattr(torch, want)
    assert resolved(quantization="int8") == torch.float32  # quantized kernels compute in fp32
    assert resolved(quantization="w8a8") == torch.float32
    assert resolved(cpu_kernels=False) == torch.float32  # bf16 on the fast unit needs the C kernels
    assert resolved(dtype="float32") == torch.float32 and resolved(dtype="bfloat16") == torch.bfloat16
    assert loader.auto_dtype(torch.device("cuda"), None, True) == "bfloat16"
