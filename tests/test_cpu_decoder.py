"""The C decoder driver (`engine.kernels.cpu.decoder`): all layers of a step in one call give bit
for bit what the Python layer loop gives, for every weight format, on prefill, mixed and decode
steps; it steps aside for what it does not run (a hook on a layer, a swapped layer)."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.kernels import cpu
from engine.models.llama import LlamaModel

pytestmark = pytest.mark.skipif(not cpu.available(), reason="the CPU kernel library is unavailable")

PROMPTS = [[1 + (i * 7 + j) % 900 for j in range(9 + 23 * i)] for i in range(5)]


def _run(llm, use: bool, params):
    LlamaModel.use_c_decoder = use
    try:
        return llm.generate(PROMPTS, params, use_tqdm=False)
    finally:
        LlamaModel.use_c_decoder = True


@pytest.mark.parametrize("quantization,kv,dtype", [(None, "auto", "float32"), ("gguf", "auto", "auto"),
                                                   ("int8", "auto", "auto"), ("w8a8", "auto", "auto"),
                                                   ("gguf", "int8", "auto"), (None, "fp16", "float32"),
                                                   (None, "auto", "bfloat16")])
def test_driver_equals_the_python_layer_loop_bit_for_bit(quantization, kv, dtype):
    # a small token budget splits prefills into chunks that share steps with decodes; no prefix
    # cache, so both runs compute the same rows in the same steps
    llm = LLM("smollm2-135m-instruct", speculative=None, quantization=quantization, enable_prefix_caching=False,
              max_num_batched_tokens=48, kv_cache_memory_bytes=64 << 20, kv_cache_dtype=kv, dtype=dtype)
    p = SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)
    steps0 = llm.stats.num_steps
    on = _run(llm, True, p)
    assert llm.model._c_decoder is not None and llm.stats.num_steps - steps0 > 6  # it ran, over several steps
    off = _run(llm, False, p)
    assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]
    assert [o.outputs[0].logprobs for o in on] == [o.outputs[0].logprobs for o in off]  # exact floats


@pytest.mark.skipif(not (cpu.available() and cpu.w8a8_amx()), reason="no AMX path for W8A8 here")
def test_w8a8_driver_gives_the_same_tokens_on_amx_tiles():
    """The driver's W8A8 layers (decoder.c calls tm_gemm_w8a8) with and without the AMX path: the same
    tokens and logprobs (exact floats); prefill chunks of up to 48 rows ran on the tiles."""
    llm = LLM("smollm2-135m-instruct", speculative=None, quantization="w8a8", enable_prefix_caching=False,
              max_num_batched_tokens=48, kv_cache_memory_bytes=64 << 20)
    p = SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)
    was = cpu.w8a8_amx()
    try:
        cpu.w8a8_amx(False)
        off = _run(llm, True, p)
        blocks = cpu.w8a8_amx_blocks()
        cpu.w8a8_amx(True)
        on = _run(llm, True, p)
    finally:
        cpu.w8a8_amx(was)
    assert llm.model._c_decoder is not None and cpu.w8a8_amx_blocks() > blocks
    assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]
    assert [o.outputs[0].logprobs for o in on] == [o.outputs[0].logprobs for o in off]


def test_driver_steps_aside_for_a_hook_and_for_a_swapped_layer():
    llm = LLM("smollm2-135m-instruct", speculative=None, enable_prefix_caching=False, kv_cache_memory_bytes=64 << 20)
    p = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in _run(llm, False, p)]
    model = llm.model
    seen = []
    handle = model.layers[3].o.register_forward_pre_hook(lambda mod, args: seen.append(args[0].shape[0]))
    try:
        got = [o.outputs[0].token_ids for o in _run(llm, True, p)]
    finally:
        handle.remove()
    assert got == want and len(seen) > 0  # the hook saw every step: the Python loop ran them
    assert [o.outputs[0].token_ids for o in _run(llm, True, p)] == want and model._c_decoder is not None
    first = model._c_decoder
    # a layer swapped for another module of the same weights (and class: CpuLinear, or CpuBf16Linear
    # under the default dtype on a bf16 host): the description is remade
    old = model.layers[0].down
    model.layers[0].down = type(old)(old.weight.data.clone())
    assert [o.outputs[0].token_ids for o in _run(llm, True, p)] == want
    assert model._c_decoder is not first and model._c_decoder.modules[3] is model.layers[0].down
    # a hook added after the description was made: the loop runs again while it is there
    seen.clear()
    handle = model.layers[7].gate_up.register_forward_hook(lambda mod, args, out: seen.append(out.shape[0]))
    try:
        assert [o.outputs[0].token_ids for o in _run(llm, True, p)] == want and len(seen) >= 4
    finally:
        handle.remove()


def test_describe_refuses_layers_it_cannot_run():
    from engine.kernels.cpu.decoder import CpuDecoder
    from engine.models.llama import Linear

    llm = LLM("smollm2-135m-instruct", speculative=None, kv_cache_memory_bytes=32 << 20)
    model = llm.model
    caches = llm.kv_cache.layers
    assert CpuDecoder.describe(model, caches) is not None
    old = model.layers[1].qkv
    model.layers[1].qkv = Linear(torch.zeros(old.out_features, old.in_features))
    try:
        assert CpuDecoder.describe(model, caches) is None
        with pytest.raises(ValueError, match="not all served"):
            CpuDecoder(model, caches)
    finally:
        model.layers[1].qkv = old


def test_driver_timers_split_its_time_and_stay_off_by_default():
    import time

    from engine.kernels.cpu import decoder as dec

    llm = LLM("smollm2-135m-instruct", speculative=None, enable_prefix_caching=False)
    p = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    dec.set_timing(False)
    _run(llm, True, p)
    assert set(dec.timings().values()) == {0.0}  # off: nothing counted
    dec.set_timing(True)
    try:
        t0 = time.perf_counter()
        _run(llm, True, p)
        wall = time.perf_counter() - t0
        t = dec.timings()
    finally:
        dec.set_timing(False)
    assert list(t) == list(dec.TIMER_NAMES)
    # every kernel kind ran and was counted; SwiGLU runs inside the gate/up GEMM where it fuses
    fused = all(layer.gate_up.silu_fused for layer in llm.model.layers)
    assert all(v > 0 for k, v in t.items() if k != "silu mul") and (t["silu mul"] == 0) == fused
    assert t["linear layers"] > t["attention"] and sum(t.values()) < wall
    assert set(dec.timings().values()) == {0.0}  # switching restarts the counters


def test_efficiency_breakdown_of_driver_steps_adds_up():
    from benchmarks.efficiency import StepTimers

    llm = LLM("smollm2-135m-instruct", speculative=None, enable_prefix_caching=False)
    clock = StepTimers(llm, kernels=False, driver=True)
    try:
        llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    finally:
        clock.close()
    f = clock.fractions()
    assert clock.steps >= 3 and clock.t["driver"] > 0  # decode-only steps, served by the driver
    assert 0.3 < f["linear layers"] < 1 and f["attention"] > 0 and f["other model ops"] > 0
    assert abs(sum(f.values()) - 1) < 0.02  # the categories partition the step (rest = what is left)
