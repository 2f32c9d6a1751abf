"""All decoder layers of a step in one C call (`decoder.c`), for models served by the CPU kernels.

The Python layer loop of `engine.models.llama.LlamaModel.forward` makes about ten kernel
calls per layer (RMSNorm, the four linear layers, RoPE, the KV write, paged attention,
SiLU * up); each costs a few microseconds of interpreter, `nn.Module` and ctypes dispatch.
At batch 1 on SmolLM2-135M (30 layers) that is about 1 ms of a 6-7 ms decode step.
`CpuDecoder` describes the model once (weights, packed layouts, KV caches as raw pointers)
and runs the same kernels in the same order on the same buffers from C, so its output is
bit for bit the loop's.

It serves a step only when everything the loop would do is one of those kernels: every
linear layer a `CpuLinear`, `CpuBf16Linear`, `CpuQuantLinear` or `W8A8Linear` without hooks, `CpuOps` for
the small ops, fp32, fp16 or int8 KV caches and the torch attention backend (or its int8-cache
subclass) with its C kernel serving the step. Anything else (a hook observing a layer for
calibration, another backend, a layer of another class) runs the Python loop. Sliding-window
layers (`ModelConfig.window(i)` > 0) attend their window only, as the backend's `forward(...,
window=)` does, through the step's own block tables or the sliding-window group's
(`AttentionMetadata.window_meta`).
"""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

from . import W_Q4, W_Q8, _lib, kv_row_format

DEC_F32, DEC_Q, DEC_W8A8, DEC_BF16 = 0, 1, 2, 3


def _describe_linear(lin) -> Optional[list[int]]:
    """The 9 words of one linear layer (see decoder.c), or None for a layer the driver cannot run."""
    from .layers import CpuBf16Linear, CpuLinear, CpuQuantLinear, W8A8Linear

    if lin._forward_pre_hooks or lin._forward_hooks:
        return None
    bias = 0 if lin.bias is None else lin.bias.data_ptr()
    if type(lin) is CpuLinear:
        return [DEC_F32, 0, 0, lin.out_features, lin.in_features, lin.in_features, lin.in_features,
                lin.packed.data_ptr(), bias]
    if type(lin) is CpuBf16Linear:
        return [DEC_BF16, 0, 0, lin.out_features, lin.in_features, lin.in_features, lin.in_features,
                lin.packed.data_ptr(), bias]
    if type(lin) is CpuQuantLinear:
        return [DEC_Q, W_Q8 if lin.bits == 8 else W_Q4, int(lin.has_min), lin.out_features, lin.in_features,
                lin.padded_in, lin.group_size, lin.packed.data_ptr(), bias]
    if type(lin) is W8A8Linear:
        kp = -(-lin.in_features // 4) * 4
        return [DEC_W8A8, 0, 0, lin.out_features, lin.in_features, kp, lin.group_size, lin.packed.data_ptr(), bias]
    return None


class CpuDecoder:
    """The C description of a `LlamaModel`'s decoder layers and their KV caches.

    Args:
        model: the model (its `layers`, `cfg`).
        kv_caches: per layer (k_cache, v_cache), contiguous: fp32 or fp16 [Hkv, S, D], or int8 rows
            [Hkv, S, D + 4] (D codes and the fp32 scale, `TorchQuantKVAttentionBackend`'s layout).
        lib: a specific build (tests); default the native one.
    Attributes:
        desc: [num_layers * words] int64, the layer descriptions (pointers into the model's
            tensors, which this object keeps referenced through `modules` and `kv_caches`).
        windows: [num_layers] int64, each layer's sliding window in tokens (`model.cfg.window(i)`,
            0: full attention), or None when no layer has one.
        modules: the layer modules described, in order (a swap makes the description stale).
    Raises:
        ValueError: if some layer or cache cannot be described (check `CpuDecoder.describe`).
    """

    def __init__(self, model, kv_caches, lib: Optional[ctypes.CDLL] = None) -> None:
        desc = self.describe(model, kv_caches)
        if desc is None:
            raise ValueError("the model's layers or KV caches are not all served by the CPU kernels")
        cfg = model.cfg
        self.lib = _lib(lib)
        self._fn = self.lib.tm_decoder_forward
        self.desc = desc
        self.modules = self.layer_modules(model)
        self._layer_modules = [(*layer._modules.values(), *layer._parameters.values()) for layer in model.layers]
        self._hook_dicts = [d for lin in self.modules for d in (lin._forward_pre_hooks, lin._forward_hooks)]
        self.kv_caches = kv_caches
        self.num_layers = len(model.layers)
        wins = [int(cfg.window(i)) for i in range(self.num_layers)]
        self.windows = torch.tensor(wins, dtype=torch.int64) if any(wins) else None
        kc = kv_caches[0][0]
        self.dims = torch.tensor([cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                  cfg.intermediate_size, kc.shape[1], 0, kv_row_format(kc, cfg.head_dim)],
                                 dtype=torch.int64)
        self.eps = float(cfg.rms_norm_eps)
        self.w8a8 = [lin for lin in self.modules if desc_kind(lin) == DEC_W8A8]
        kps = [(-(-lin.in_features // 4) * 4, lin.group_size) for lin in self.w8a8]  # codes per row, group size
        self._scratch_k = max([kp for kp, _ in kps], default=0)
        self._scratch_g = max([-(-kp // gs) for kp, gs in kps], default=0)
        self._codes: Optional[torch.Tensor] = None
        self._scales: Optional[torch.Tensor] = None

    @staticmethod
    def layer_modules(model) -> list:
        """Per layer: its attn_norm, mlp_norm and qkv, o, gate_up, down modules (flat list)."""
        out = []
        for layer in model.layers:
            out += [layer.qkv, layer.o, layer.gate_up, layer.down]
        return out

    @staticmethod
    def describe(model, kv_caches) -> Optional[torch.Tensor]:
        """The int64 description of every layer (decoder.c's layout), or None when a layer or
        cache is something the driver does not run."""
        words = []
        d = model.cfg.head_dim
        for layer, (kc, vc) in zip(model.layers, kv_caches):
            if not (kv_row_format(kc, d) is not None and vc.dtype == kc.dtype and vc.shape == kc.shape and kc.is_contiguous()
                    and vc.is_contiguous() and kc.device.type == "cpu"):
                return None
            w = [layer.attn_norm.data_ptr(), layer.mlp_norm.data_ptr(), kc.data_ptr(), vc.data_ptr()]
            for lin in (layer.qkv, layer.o, layer.gate_up, layer.down):
                lw = _describe_linear(lin)
                if lw is None:
                    return None
                w += lw
            words += w
        if len(model.layers) != len(kv_caches) or not words:
            return None
        return torch.tensor(words, dtype=torch.int64)

    def current(self, model, kv_caches) -> bool:
        """Whether this description still matches the model's modules, norm weights and caches
        (no swap, no hook added since, the same cache tensors)."""
        if kv_caches is not self.kv_caches and any(
                a[0] is not b[0] or a[1] is not b[1] for a, b in zip(kv_caches, self.kv_caches)):
            return False
        # (module dicts and hook dicts read directly: this runs every step, about 10 us)
        if [(*layer._modules.values(), *layer._parameters.values())
                for layer in model.layers._modules.values()] != self._layer_modules:
            return False
        from torch.nn.modules import module as _m

        return not (any(map(len, self._hook_dicts)) or _m._global_forward_pre_hooks or _m._global_forward_hooks)

    def run(self, h: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            slot_mapping: torch.Tensor, plan: tuple, block_size: int, scale: float,
            bufs: tuple[torch.Tensor, ...], window_slot_mapping: Optional[torch.Tensor] = None,
            window_tables: Optional[torch.Tensor] = None) -> None:
        """Every decoder layer over the step's T tokens, h updated in place.

        Args:
            h: [T, hidden] float32 contiguous residual stream.
            positions: [T] int64; cos, sin: [max_pos, head_dim / 2] float32 RoPE tables.
            slot_mapping: [T] int64 KV slots.
            plan: the attention backend's kernel plan (block tables [rows, W] int32, row_seq [T]
                int32 or None, kv_len [T] int64, tiles [n, 2] int64).
            bufs: the forward's scratch (x, qkv, a, gu, act), contiguous float32.
            window_slot_mapping, window_tables: the sliding-window layers' own KV slots [T] int64 and
                block tables [rows, W'] int32 contiguous (from `AttentionMetadata.window_meta`, in the
                plan's row order: the same rows, positions and tiles), both or neither; None: those
                layers use `slot_mapping` and the plan's tables.
        Raises:
            ValueError: only one of window_slot_mapping and window_tables, or either in the wrong
                dtype, shape or layout.
            RuntimeError: a kernel refused a layer's shape (the layer is named).
        """
        tables, row_seq, kv_len, tiles = plan
        if (window_slot_mapping is None) != (window_tables is None):
            raise ValueError("window_slot_mapping and window_tables go together (both or neither)")
        w_slots = w_tables = None
        w_width = 0
        if window_tables is not None:
            if (window_slot_mapping.dtype != torch.int64 or not window_slot_mapping.is_contiguous()
                    or window_slot_mapping.shape != slot_mapping.shape):
                raise ValueError(f"window_slot_mapping must be contiguous int64 shaped like slot_mapping "
                                 f"{tuple(slot_mapping.shape)}, got {window_slot_mapping.dtype} "
                                 f"{tuple(window_slot_mapping.shape)}")
            if (window_tables.dtype != torch.int32 or not window_tables.is_contiguous()
                    or window_tables.dim() != 2 or window_tables.shape[0] != tables.shape[0]):
                raise ValueError(f"window_tables must be contiguous int32 [{tables.shape[0]}, W], got "
                                 f"{window_tables.dtype} {tuple(window_tables.shape)}")
            w_slots, w_tables = window_slot_mapping.data_ptr(), window_tables.data_ptr()
            w_width = window_tables.shape[1]
        t = h.shape[0]
        codes = scales = None
        if self.w8a8:
            if self._codes is None or self._codes.shape[0] < t:
                self._codes = torch.empty(max(t, 64), self._scratch_k, dtype=torch.uint8)
                self._scales = torch.empty(max(t, 64), self._scratch_g, dtype=torch.float32)
            codes, scales = self._codes.data_ptr(), self._scales.data_ptr()
        self.dims[6] = block_size
        x, qkv, a, gu, act = bufs
        rc = self._fn(self.desc.data_ptr(), self.num_layers, self.dims.data_ptr(), self.eps, float(scale),
                      h.data_ptr(), t, positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), slot_mapping.data_ptr(),
                      tables.data_ptr(), tables.shape[1], None if row_seq is None else row_seq.data_ptr(),
                      kv_len.data_ptr(), tiles.data_ptr(), tiles.shape[0], x.data_ptr(), qkv.data_ptr(),
                      a.data_ptr(), gu.data_ptr(), act.data_ptr(), codes, scales,
                      None if self.windows is None else self.windows.data_ptr(), w_slots, w_tables, w_width)
        if rc:
            raise RuntimeError(f"the C decoder: a kernel refused the shapes of layer {rc - 1}")


def desc_kind(lin) -> int:
    """The driver's kind of a linear layer (DEC_F32 / DEC_Q / DEC_W8A8 / DEC_BF16), -1 for others."""
    d = _describe_linear(lin)
    return -1 if d is None else d[0]


TIMER_NAMES = ("linear layers", "attention", "kv write", "rms norm", "rope", "silu mul")


def set_timing(on: bool, lib: Optional[ctypes.CDLL] = None) -> None:
    """Time every kernel call of the C decoder (on) or stop (off); the counters restart at 0.
    Costs about 20 ns per kernel call (11 per layer) while on; meant for benchmarks."""
    _lib(lib).tm_decoder_set_timing(int(bool(on)))


def timings(lib: Optional[ctypes.CDLL] = None) -> dict[str, float]:
    """Seconds the C decoder spent per kernel category since `set_timing` (keys `TIMER_NAMES`:
    linear layers with W8A8's activation quantization, attention, KV write, RMSNorm, RoPE,
    SiLU * up), summed over every step it ran."""
    lib = _lib(lib)
    n = lib.tm_decoder_num_timers()
    buf = (ctypes.c_double * n)()
    lib.tm_decoder_timings(ctypes.cast(buf, ctypes.c_void_p))
    return dict(zip(TIMER_NAMES, list(buf)))
