"""Layer swapping: a model's torch linear layers replaced, in place, by the CPU kernel library's
(`engine.kernels.cpu.layers`), as a quantizer swaps in quantized layers. The kernels never see the
model; the model's forward never knows which layer class serves it.
"""
from __future__ import annotations

import ctypes
from typing import Optional

import torch
import torch.nn as nn

from ..kernels.cpu import library
from ..kernels.cpu.layers import CpuBf16Linear, CpuLinear, CpuQuantLinear, W8A8Linear
from ..quant import QuantLinear, _swap
from .llama import Linear


def available_for(model: nn.Module) -> bool:
    """Whether the CPU layers can serve `model`: on the CPU, fp32, and the library builds."""
    return model.device.type == "cpu" and model.dtype == torch.float32 and library() is not None


def use_cpu_kernels(model: nn.Module, lib: Optional[ctypes.CDLL] = None,
                    weight_dtype: torch.dtype = torch.float32) -> dict[str, str]:
    """Swap every linear layer of `model` (`model.linear_layers()`) for its CPU-kernel
    counterpart, in place: `Linear` -> `CpuLinear` (`CpuBf16Linear` with weight_dtype
    torch.bfloat16: the weights rounded to bf16, activations kept fp32), `QuantLinear` ->
    `CpuQuantLinear`; layers already served by the library are kept. Returns {layer name: new
    class name}.

    Raises:
        RuntimeError: if the library is unavailable.
        ValueError: weight_dtype is neither float32 nor bfloat16.
    """
    if weight_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"the CPU kernels take float32 or bfloat16 weights, got {weight_dtype}")
    if (lib or library()) is None:
        raise RuntimeError("the CPU kernel library is unavailable")
    done = {}
    for name, lin in model.linear_layers():
        if isinstance(lin, (CpuLinear, CpuBf16Linear, CpuQuantLinear, W8A8Linear)):
            continue
        if isinstance(lin, QuantLinear):
            new: nn.Module = CpuQuantLinear(lin, lib=lib)
        elif isinstance(lin, Linear) and weight_dtype == torch.bfloat16:
            new = CpuBf16Linear(lin.weight.data, None if lin.bias is None else lin.bias.data, lib=lib)
        elif isinstance(lin, Linear):
            new = CpuLinear(lin.weight.data, None if lin.bias is None else lin.bias.data, lib=lib)
        else:
            continue
        _swap(model, name, new)
        done[name] = type(new).__name__
    return done
