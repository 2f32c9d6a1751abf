"""The CPU kernel library's C functions as ctypes calls them: each one's result and argument types.

`bind(lib)` sets them on a loaded build once (every build exports the same functions); the wrappers in
`engine.kernels.cpu` call only bound functions.
"""
from __future__ import annotations

import ctypes

_P, _I64, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
SIGNATURES = {
    "tm_set_num_threads": (_I, [_I]),
    "tm_get_num_threads": (_I, []),
    "tm_shutdown": (None, []),
    "tm_isa": (_I, []),
    "tm_gemm_nr": (_I, []),
    "tm_gemm_mr": (_I, []),
    "tm_pack_f32_size": (_I64, [_I64, _I64]),
    "tm_pack_f32": (None, [_P, _I64, _I64, _I64, _P]),
    "tm_gemm_f32": (None, [_P, _I64, _P, _P, _P, _I64, _I64, _I64, _I64, _I]),
    "tm_gemm_argmax_scratch": (_I64, [_I64]),
    "tm_pack_bf16_size": (_I64, [_I64, _I64]),
    "tm_pack_bf16": (None, [_P, _I64, _I64, _I64, _P]),
    "tm_to_bf16": (None, [_P, _I64, _I64, _I64, _P, _I64]),
    "tm_gemm_bf16": (_I, [_P, _I64, _P, _P, _P, _I64, _I64, _I64, _I64, _I]),
    "tm_gemm_bf16_silu": (_I, [_P, _I64, _P, _P, _P, _I64, _I64, _I64, _I64]),
    "tm_gemm_bf16_argmax": (_I, [_P, _I64, _P, _P, _I64, _I64, _I64, _I64, _P, _I64, _P, _P]),
    "tm_bf16_native": (_I, []),
    "tm_gemm_f32_argmax": (None, [_P, _I64, _P, _P, _I64, _I64, _I64, _I64, _P, _I64, _P, _P]),
    "tm_gemm_q_argmax": (_I, [_I, _I, _P, _I64, _P, _P, _I64, _I64, _I64, _I64, _I64, _I64, _P, _I64, _P, _P]),
    "tm_gemm_f32_silu": (_I, [_P, _I64, _P, _P, _P, _I64, _I64, _I64, _I64]),
    "tm_gemm_q_silu": (_I, [_I, _I, _P, _I64, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _I64]),
    "tm_pack_q_size": (_I64, [_I, _I, _I64, _I64, _I64]),
    "tm_pack_q": (_I, [_I, _P, _P, _P, _I64, _I64, _I64, _P]),
    "tm_gemm_q": (_I, [_I, _I, _P, _I64, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _I64, _I]),
    "tm_w8a8_act_offset": (_I, []),
    "tm_w8a8_weight_max": (_I, []),
    "tm_quantize_act": (None, [_P, _I64, _I64, _I64, _I64, _I64, _P, _P]),
    "tm_pack_w8a8_size": (_I64, [_I64, _I64, _I64]),
    "tm_pack_w8a8": (_I, [_P, _I64, _P, _I64, _I64, _I64, _P]),
    "tm_gemm_w8a8": (_I, [_P, _P, _I64, _I64, _P, _P, _P, _I64, _I64, _I64, _I]),
    "tm_w8a8_amx": (_I, [_I]),
    "tm_bf16_amx": (_I, [_I]),
    "tm_bf16_amx_calls": (_I64, []),
    "tm_amx_usable": (_I, []),
    "tm_w8a8_amx_blocks": (_I64, []),
    "tm_rms_norm": (None, [_P, _I64, _P, _P, _I64, _I64, _I64, _F]),
    "tm_rope": (None, [_P, _I64, _I64, _I64, _I64, _P, _P, _P]),
    "tm_silu_mul": (None, [_P, _I64, _P, _I64, _I64, _I64]),
    "tm_kv_write": (None, [_P, _I64, _P, _I64, _I64, _I64, _I64, _P, _P, _P, _I64, _I]),
    "tm_argmax_rows": (None, [_P, _I64, _I64, _I64, _P]),
    "tm_attention_tile_rows": (_I, [_I64]),
    "tm_attention_bf16": (_I, []),
    "tm_paged_attention": (_I, [_P, _I64, _P, _P, _I, _P, _I64, _P, _P, _P, _I64, _P, _I64] + [_I64] * 5
                           + [_F, _I64]),
    "tm_decoder_layer_words": (_I, []),
    "tm_decoder_set_timing": (None, [_I]),
    "tm_decoder_num_timers": (_I, []),
    "tm_decoder_timings": (None, [_P]),
    "tm_decoder_forward": (_I, [_P, _I64, _P, _F, _F, _P, _I64, _P, _P, _P, _P, _P, _I64, _P, _P, _P, _I64]
                           + [_P] * 7 + [_P, _P, _P, _I64]),
}
_bound: set[int] = set()


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """`lib` with every function of `SIGNATURES` typed (once per build); returns it."""
    if id(lib) not in _bound:
        for name, (res, args) in SIGNATURES.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = res, args
        _bound.add(id(lib))
    return lib
