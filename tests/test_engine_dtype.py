"""The engine's weights dtype on the CPU: bf16 weights (`CpuBf16Linear`, fp32 activations; attention on
the bf16 unit over a grouped bf16 cache where the host has one) against the fp32 path, and what
`dtype="auto"` picks on this host."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.host import Host
from engine.kernels import cpu
from engine.kernels.cpu.layers import CpuBf16Linear, CpuLinear

pytestmark = pytest.mark.skipif(not cpu.available(), reason="bf16 weights run on the CPU kernel library")
GPL3 = Path("/usr/share/common-licenses/GPL-3")  # benchmarks.quality's corpus


@pytest.fixture(scope="module")
def bf16():
    return LLM("smollm2-135m-instruct", dtype="bfloat16", kv_cache_memory_bytes=64 << 20)


def test_bf16_weights_run_on_the_kernels_under_an_fp32_model(bf16):
    assert bf16.dtype == torch.bfloat16 and bf16.model.dtype == torch.float32  # activations stay fp32
    assert {type(lin) for _, lin in bf16.model.linear_layers()} == {CpuBf16Linear}
    # the cache: bf16 in the group layout where the kernels read it on VDPBF16PS, else fp16 halves
    assert bf16.kv_cache.layers[0][0].dtype == (torch.int16 if cpu.attention_bf16() else torch.float16)
    assert bf16.kv_bytes_per_token == 23040  # 16 bits either way: 30 layers x 2 x 3 heads x 64 x 2 bytes
    assert bf16.model.embed.dtype == torch.float32  # lookups stay exact; the LM head is its own bf16 copy


@pytest.mark.skipif(not GPL3.exists(), reason=f"{GPL3} (Debian base-files) is not on this machine")
def test_bf16_scores_within_half_a_percent_of_fp32_perplexity(bf16, llm_fp32):
    """Over 4 windows of 256 tokens (one text of 70 tokens moves by up to 1.5% either way, bf16 halves
    or not: benchmarks.quality scores 80 windows)."""
    ids = bf16.tokenizer.encode(GPL3.read_text())[1000:1000 + 4 * 256]
    lp16 = torch.cat([bf16.score(ids[i:i + 256])[0] for i in range(0, len(ids), 256)])
    lp32 = torch.cat([llm_fp32.score(ids[i:i + 256])[0] for i in range(0, len(ids), 256)])
    ppl16, ppl32 = torch.exp(-lp16.mean()).item(), torch.exp(-lp32.mean()).item()
    assert abs(ppl16 / ppl32 - 1) < 0.005
    assert 0 < (lp16 - lp32).abs().mean().item() < 0.05  # bf16 rounding is there, and small


def test_bf16_greedy_is_batch_invariant_and_answers(bf16):
    p = SamplingParams(temperature=0, max_tokens=12, logprobs=1, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    together = bf16.generate(prompts, p, use_tqdm=False)
    alone = [bf16.generate([q], p, use_tqdm=False)[0] for q in prompts]
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in alone]
    assert [o.outputs[0].logprobs for o in together] == [o.outputs[0].logprobs for o in alone]  # exact floats
    assert together[0].outputs[0].text.startswith(" Paris")


def test_auto_picks_bf16_exactly_where_the_host_has_a_bf16_unit():
    llm = LLM("smollm2-135m-instruct", kv_cache_memory_bytes=16 << 20)
    want = torch.bfloat16 if Host.current().bf16_unit else torch.float32
    assert llm.dtype == want
    assert {type(lin) for _, lin in llm.model.linear_layers()} == {CpuBf16Linear if want == torch.bfloat16 else CpuLinear}
    # quantized weights compute in fp32 whatever the host
    assert LLM("smollm2-135m-instruct", quantization="int8", kv_cache_memory_bytes=16 << 20).dtype == torch.float32
