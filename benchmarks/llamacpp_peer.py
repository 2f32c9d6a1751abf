"""llama.cpp as a throughput peer: its batched mode through llama-cpp-python's low-level API.

A throughput user of llama.cpp does not run one request after another: they
decode many sequences in one batch, as llama.cpp's ``parallel`` and
``batched`` examples and its server do. This module runs llama.cpp that way,
on exactly the work tokenmill gets (the same prompt token ids, the same
number of new tokens per request, EOS ignored), so that a ratio against it is
a ratio against the peer at its best:

- **P parallel sequences** (`LlamaCppConfig.parallel`; 1 is one request at a
  time). Slot ``s`` owns sequence id ``s`` of the KV cache.
- **Continuous refill.** When a sequence reaches its output length its slot is
  cleared (``llama_memory_seq_rm``) and the next waiting request takes it in
  the same step: the new prompt's prefill goes into the same ``llama_batch`` as
  the other sequences' decode tokens. Each step takes every decoding
  sequence's next token first, then prompt tokens up to ``n_batch`` (a prompt
  longer than what is left is split over steps, like a chunked prefill).
- **Sampling in C.** Each slot has a ``llama_sampler`` chain (greedy, or
  temperature + seeded ``dist`` for a sampled workload) and every token comes
  from ``llama_sampler_sample`` on the logits of its batch row; Python never
  touches the logits.
- **Split KV streams** (``kv_unified=False``, llama.cpp's default and its
  high-throughput mode): each sequence attends only to its own cache, so
  attention cost does not grow with the other sequences. ``kv_unified=True``
  is kept as an option for measuring.
- **Shared prefix once.** When every prompt starts with the same tokens
  (`Workload.shared_prefix_tokens`, the labelling workload) the prefix is
  computed once into an extra sequence and copied into each slot with
  ``llama_memory_seq_cp``, as the ``parallel`` example does with its system
  prompt; tokenmill's prefix cache gets the same saving.
- ``n_threads`` = ``n_threads_batch`` = the cores given (the benchmark passes
  torch's thread count, the machine's cores by default).

The timed region is the step loop from the first prefill to the last token;
loading the model and creating the context are not timed. The result also
splits the wall time into ``llama_decode``, sampling and the rest (Python and
batch building), so a reader can check the peer is not held back by its glue.

Requires ``llama-cpp-python`` 0.3.36, built from source, never in CI nor in the
project's venv: `peer_python` uses it when it imports in the benchmark's own
interpreter, else a venv of its own (`default_venv_dir`: ``<tokenmill cache>/peers/
llama-cpp-python-0.3.36``) that `build_venv` makes when it is missing: ``python3.11 -m
venv``, then ``pip install llama-cpp-python==0.3.36 numpy`` (5-14 minutes on 2 cores;
natively, or on an AMX host without AMX code generation, whose build segfaults on
quantized types; `build_env`), an import check and a marker file (`READY_MARKER`) that
records the build. The child side of this module imports only the standard library,
llama_cpp and numpy, so ``VENV/bin/python -m benchmarks.llamacpp_peer`` runs it from the
repository root.
"""
from __future__ import annotations

import ctypes
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from benchmarks import peer_venv
from benchmarks.peer_venv import READY_MARKER, read_marker, venv_python  # noqa: F401 (this module's API)

WEIGHTS = ("q4_1", "f16", "f32", "bf16", "q8_0", "q4_0")  # q4_1: the bundled file; the others: gguf_f16 copies
# the benchmarked model's own GGUF file as it is (`--model gemma-3-270m`: its Q4_K_M file); not in
# WEIGHTS, which is what `llamacpp` alone expands to (the default model's file and its copies)
MODEL_WEIGHTS = "model"
DEFAULT_PARALLEL = (1, 8, 32, 64)
_CTX_ALIGN = 256  # llama.cpp rounds context sizes up to this
REPO = Path(__file__).resolve().parent.parent  # the child runs from here (``-m benchmarks.llamacpp_peer``)


@dataclass(frozen=True)
class LlamaCppConfig:
    """One llama.cpp peer configuration.

    Attributes:
        weights: "q4_1" (the bundled GGUF), or one of `benchmarks.gguf_f16`'s copies of it: "f16",
            "f32", "bf16", "q8_0", "q4_0"; or "model": the benchmarked model's own GGUF file.
        parallel: sequences decoded together (1 = one request at a time).
        n_batch: most tokens per ``llama_decode`` call (decode tokens + prompt tokens).
        n_ubatch: most tokens llama.cpp computes in one graph (it splits a batch into these).
        kv_unified: one KV buffer for all sequences instead of one stream per sequence.
        share_prefix: compute a workload's shared prompt prefix once and copy it to each slot.
    """

    weights: str
    parallel: int
    n_batch: int = 2048
    n_ubatch: int = 256
    kv_unified: bool = False
    share_prefix: bool = True

    @property
    def name(self) -> str:
        """The row name: ``llamacpp-<weights>-p<P>``, or ``llamacpp-<weights>-serial`` for P = 1."""
        return f"llamacpp-{self.weights}-" + ("serial" if self.parallel == 1 else f"p{self.parallel}")

    def describe(self) -> dict[str, Any]:
        """The settings as a plain dict, for the JSON report."""
        return {"weights": self.weights, "parallel": self.parallel, "n_batch": self.n_batch,
                "n_ubatch": self.n_ubatch, "kv_unified": self.kv_unified, "share_prefix": self.share_prefix}


def all_configs(weights: Sequence[str] = WEIGHTS, parallel: Sequence[int] = DEFAULT_PARALLEL,
                **kwargs: Any) -> list[LlamaCppConfig]:
    """Every (weights, parallel) pair, weights-major; `kwargs` go to each `LlamaCppConfig`.

    Raises:
        ValueError: an unknown weights name or a parallel below 1.
    """
    bad = [w for w in weights if w not in WEIGHTS]
    if bad:
        raise ValueError(f"unknown llama.cpp weights {bad}; choose from {list(WEIGHTS)}")
    if any(p < 1 for p in parallel):
        raise ValueError(f"parallel sequences must be >= 1, got {list(parallel)}")
    return [LlamaCppConfig(w, p, **kwargs) for w in weights for p in parallel]


def parse_config_name(name: str, **kwargs: Any) -> LlamaCppConfig:
    """``llamacpp-<weights>-<serial|pN>`` (weights: one of `WEIGHTS`, or `MODEL_WEIGHTS`) -> its `LlamaCppConfig`.

    Raises:
        ValueError: a name of another shape.
    """
    parts = name.split("-")
    if len(parts) == 3 and parts[0] == "llamacpp" and (parts[1] in WEIGHTS or parts[1] == MODEL_WEIGHTS):
        mode = parts[2]
        if mode == "serial":
            return LlamaCppConfig(parts[1], 1, **kwargs)
        if mode.startswith("p") and mode[1:].isdigit() and int(mode[1:]) >= 1:
            return LlamaCppConfig(parts[1], int(mode[1:]), **kwargs)
    raise ValueError(f"unknown llama.cpp configuration {name!r}; expected llamacpp-<{'|'.join(WEIGHTS + (MODEL_WEIGHTS,))}>-<serial|pN>")


def available(omp_wait_policy: Optional[str] = None) -> Optional[str]:
    """None if llama-cpp-python imports, else the reason it does not.

    llama.cpp's threads come from its own OpenMP runtime, which reads OMP_WAIT_POLICY once,
    when llama_cpp is first imported. tokenmill's benchmarks set PASSIVE for torch; for
    llama.cpp the first import here sets `omp_wait_policy` instead (None: unset, i.e. its
    own default of spinning before sleeping) and restores the variable afterwards. Measured
    here (SmolLM2 Q4_1, one sequence, 2 threads): 185 decode tok/s with its default, 48 with
    PASSIVE, so PASSIVE would handicap the peer.
    """

    if "llama_cpp" not in sys.modules:
        saved = os.environ.get("OMP_WAIT_POLICY")
        if omp_wait_policy is None:
            os.environ.pop("OMP_WAIT_POLICY", None)
        else:
            os.environ["OMP_WAIT_POLICY"] = omp_wait_policy
        try:
            import llama_cpp  # noqa: F401
        except Exception as e:  # noqa: BLE001 - any import failure means "not available"
            return f"{type(e).__name__}: {e}"
        finally:
            if saved is None:
                os.environ.pop("OMP_WAIT_POLICY", None)
            else:
                os.environ["OMP_WAIT_POLICY"] = saved
    return None


LLAMACPP_VERSION = "0.3.36"
LLAMA_CPP_PYTHON = f"llama-cpp-python=={LLAMACPP_VERSION}"  # the `bench` extra's pin
VENV_PACKAGES = (LLAMA_CPP_PYTHON, "numpy")  # all the child imports besides the standard library
VENV_PYTHON = "python3.11"
BUILD_LOG = "tokenmill-build.log"  # pip's output of the last build, in the venv
AMX_FLAGS = ("amx_tile", "amx_int8", "amx_bf16")
_NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


class PeerUnavailable(RuntimeError):
    """llama-cpp-python cannot be used here (not importable, its venv missing or not buildable); the message
    says why."""


def host_has_amx(flags: Optional[Sequence[str]] = None) -> bool:
    """Whether the CPU has AMX (any of `AMX_FLAGS`; `flags` default: this host's, from /proc/cpuinfo)."""
    if flags is None:
        flags = []
        try:
            with open("/proc/cpuinfo") as f:
                for line in f:
                    if line.startswith("flags"):
                        flags = line.split(":", 1)[1].split()
                        break
        except OSError:
            pass
    return any(f in flags for f in AMX_FLAGS)


def build_env(amx: bool) -> dict[str, str]:
    """Environment variables of the llama-cpp-python build: on an AMX host, ``CMAKE_ARGS`` turning AMX
    code generation off (its AMX build segfaults on every quantized type at the first decode, seen on
    the AMX Xeon); elsewhere none (a native build)."""
    if amx:
        return {"CMAKE_ARGS": f"-DCMAKE_C_FLAGS='{_NO_AMX}' -DCMAKE_CXX_FLAGS='{_NO_AMX}'"}
    return {}


def build_kind(amx: bool) -> str:
    """How the build is described in the venv's marker and the benchmark's report."""
    return f"built from source without AMX (CMAKE_ARGS {_NO_AMX})" if amx else "built from source, native"


def default_venv_dir() -> Path:
    """``<tokenmill cache>/peers/llama-cpp-python-<LLAMACPP_VERSION>`` (`engine.disk_cache.cache_base`)."""

    from engine.disk_cache import cache_base

    return Path(cache_base()) / "peers" / f"llama-cpp-python-{LLAMACPP_VERSION}"


def build_steps(venv: Path, python: str = VENV_PYTHON) -> list[list[str]]:
    """The build as argument lists: ``<python> -m venv VENV``, then ``VENV/bin/pip install
    llama-cpp-python==<version> numpy`` (run with `build_env`)."""

    return [[python, "-m", "venv", str(venv)], [str(Path(venv) / "bin" / "pip"), "install", *VENV_PACKAGES]]


def build_command(amx: bool, venv: Path, python: str = VENV_PYTHON) -> str:
    """The shell command that builds llama-cpp-python from source into its own venv at `venv`
    (5-14 minutes on 2 cores); with the AMX-off ``CMAKE_ARGS`` on an AMX host (`build_env`)."""

    make, install = (" ".join(shlex.quote(a) for a in step) for step in build_steps(venv, python))
    env = "".join(f"{k}=\"{v}\" " for k, v in build_env(amx).items())
    return f"{make} && {env}{install}"


def venv_missing(venv: Path) -> Optional[str]:
    """None when `venv` is a built llama.cpp venv (`peer_venv.venv_missing`), else why not (one line)."""
    return peer_venv.venv_missing(venv, "llama_cpp_python", LLAMACPP_VERSION, "llama.cpp")


def mark_ready(venv: Path, amx: bool, install_s: float, timeout_s: float = 300.0) -> dict[str, Any]:
    """Check that llama_cpp (and numpy) import with the venv's python, then write its `READY_MARKER`:
    llama_cpp_python and numpy versions, build (`build_kind`), cmake_args, install_s.

    Raises:
        PeerUnavailable: they do not import (the last lines of the error).
    """

    out = _run_step([str(venv_python(venv)), "-c", "import json, llama_cpp, numpy; print(json.dumps("
                     "{'llama_cpp_python': llama_cpp.__version__, 'numpy': numpy.__version__}))"],
                    "import llama_cpp in its venv", timeout_s)
    record = {**json.loads(out.strip().splitlines()[-1]), "build": build_kind(amx),
              "cmake_args": build_env(amx).get("CMAKE_ARGS"), "install_s": round(install_s, 1)}
    (Path(venv) / READY_MARKER).write_text(json.dumps(record) + "\n")
    return record


def _run_step(cmd: list[str], what: str, timeout_s: float, env: Optional[dict[str, str]] = None,
              log_path: Optional[str] = None) -> str:
    """Run one build step (output appended to `log_path` when given); its output, or PeerUnavailable
    with its last lines."""
    full_env = {**os.environ, **(env or {})}
    try:
        if log_path is None:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=tempfile.gettempdir(),
                               env=full_env)
            out = (p.stdout or "") + (p.stderr or "")
        else:
            with open(log_path, "a") as f:
                f.write(f"$ {' '.join(cmd)}\n")
                f.flush()
                p = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, text=True, timeout=timeout_s,
                                   cwd=tempfile.gettempdir(), env=full_env)
            with open(log_path, errors="replace") as f:
                out = f.read()
    except FileNotFoundError as e:
        raise PeerUnavailable(f"{what}: {e}") from None
    except subprocess.TimeoutExpired:
        raise PeerUnavailable(f"{what}: no result after {timeout_s:.0f} s") from None
    if p.returncode != 0:
        tail = " | ".join(ln for ln in out.strip().splitlines()[-6:])
        raise PeerUnavailable(f"{what} failed (exit code {p.returncode}): {tail}")
    return out


def build_venv(venv: Path, amx: Optional[bool] = None, python: str = VENV_PYTHON, log: Any = print,
               timeout_s: float = 2400.0) -> dict[str, Any]:
    """Build llama-cpp-python from source into a venv of its own at `venv` (`build_steps`, with
    `build_env`; pip's output goes to ``VENV/tokenmill-build.log``), check it imports and write its
    `READY_MARKER` (`mark_ready`).

    Args:
        amx: build without AMX (default: whether this host has it, `host_has_amx`).
        python: the interpreter that creates the venv.
        timeout_s: limit per step, seconds.
    Returns:
        the marker's record.
    Raises:
        PeerUnavailable: a step failed (its last output lines are in the message).
    """

    venv = Path(venv)
    amx = host_has_amx() if amx is None else amx
    make, install = build_steps(venv, python)
    t0 = time.perf_counter()
    venv.parent.mkdir(parents=True, exist_ok=True)
    log(f"building llama-cpp-python {LLAMACPP_VERSION} into {venv} ({build_kind(amx)}; 5-14 minutes on 2 cores): "
        f"{build_command(amx, venv, python)}")
    if not venv_python(venv).exists():
        _run_step(make, f"{python} -m venv", timeout_s)
    _run_step(install, f"pip install {' '.join(VENV_PACKAGES)}", timeout_s, env=build_env(amx),
              log_path=str(venv / BUILD_LOG))
    record = mark_ready(venv, amx, time.perf_counter() - t0)
    log(f"llama.cpp venv ready in {record['install_s']:.0f} s: llama-cpp-python {record['llama_cpp_python']}, "
        f"{record['build']}")
    return record


def ensure_venv(venv: Optional[Path] = None, build: bool = True, log: Any = print) -> Path:
    """The interpreter of a ready llama.cpp venv at `venv` (default `default_venv_dir()`), building it
    first when `build` and it is missing or incomplete.

    Raises:
        PeerUnavailable: it is not ready and `build` is False (with the command that builds it), or building failed.
    """

    venv = Path(venv) if venv is not None else default_venv_dir()
    why = venv_missing(venv)
    if why is not None:
        if not build:
            raise PeerUnavailable(f"{why}; build it with: {build_command(host_has_amx(), venv)}")
        build_venv(venv, log=log)
        why = venv_missing(venv)
        if why is not None:
            raise PeerUnavailable(why)
    return venv_python(venv)


def peer_python(venv: Optional[Path] = None, build: bool = True, omp_wait_policy: Optional[str] = None,
                log: Any = print) -> dict[str, Any]:
    """The interpreter the llama.cpp child runs with, and how its llama-cpp-python was built.

    When llama_cpp imports in this interpreter (`available`) the child uses it, as before; else the
    llama.cpp venv's python (`ensure_venv`, building it when `build`).
    Returns:
        {"python", "source" ("this interpreter" | "venv"), "venv" (None for this interpreter),
        "build" (the marker's description; "unknown" for this interpreter), "marker" (the venv's record)}.
    Raises:
        PeerUnavailable: neither is usable (the reasons of both, and the command that builds the venv).
    """

    why_here = available(omp_wait_policy)
    if why_here is None:
        return {"python": sys.executable, "source": "this interpreter", "venv": None,
                "build": "unknown (llama-cpp-python installed in the benchmark's own interpreter)", "marker": {}}

    venv = Path(venv) if venv is not None else default_venv_dir()
    try:
        python = ensure_venv(venv, build=build, log=log)
    except PeerUnavailable as e:
        raise PeerUnavailable(f"llama_cpp does not import here ({why_here}) and {e}") from None
    marker = read_marker(venv)
    return {"python": str(python), "source": "venv", "venv": str(venv),
            "build": marker.get("build", "unknown"), "marker": marker}


_LOG_CALLBACK = None  # kept alive: llama.cpp holds the pointer


def _quiet_logs() -> None:
    """Route llama.cpp's log lines to stderr only at ERROR level (its loader prints hundreds of lines)."""
    global _LOG_CALLBACK

    import llama_cpp as L

    if _LOG_CALLBACK is None:
        @L.llama_log_callback
        def cb(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
            if level == 4:  # GGML_LOG_LEVEL_ERROR
                print(text.decode("utf-8", errors="replace"), end="", file=sys.stderr, flush=True)

        _LOG_CALLBACK = cb
    L.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))


class LlamaCppModel:
    """A llama.cpp model loaded from a GGUF file (mmap; weights stay in the file's type).

    Call `close` (or use as a context manager) to free it.
    """

    def __init__(self, path: str) -> None:
        import llama_cpp as L

        _quiet_logs()
        L.llama_backend_init()
        params = L.llama_model_default_params()
        params.n_gpu_layers = 0
        self.path = str(path)
        self.model = L.llama_model_load_from_file(self.path.encode(), params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {self.path}")
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))

    def close(self) -> None:
        import llama_cpp as L

        if self.model:
            L.llama_model_free(self.model)
            self.model = None

    def __enter__(self) -> "LlamaCppModel":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _new_context(model: LlamaCppModel, n_seq: int, ctx_per_seq: int, cfg: LlamaCppConfig, threads: int) -> Any:
    import llama_cpp as L

    p = L.llama_context_default_params()
    per_seq = -(-ctx_per_seq // _CTX_ALIGN) * _CTX_ALIGN
    p.n_ctx = per_seq * n_seq
    p.n_seq_max = n_seq
    p.n_batch = cfg.n_batch
    p.n_ubatch = min(cfg.n_ubatch, cfg.n_batch)
    p.n_threads = threads
    p.n_threads_batch = threads
    p.kv_unified = cfg.kv_unified
    p.no_perf = True
    ctx = L.llama_init_from_model(model.model, p)
    if not ctx:
        raise RuntimeError(f"llama.cpp could not create a context (n_ctx {p.n_ctx}, {n_seq} sequences)")
    return ctx


def _sampler(temperature: float, seed: int) -> Any:
    """A sampler chain: greedy at temperature 0, else temperature then a seeded draw (top_p 1, no top_k)."""
    import llama_cpp as L

    chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
    if temperature == 0.0:
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_greedy())
    else:
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_temp(temperature))
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_dist(seed & 0xFFFFFFFF))
    return chain


@dataclass
class _Slot:
    """The request a batch slot is serving (slot index = KV sequence id)."""

    request: int
    prompt: list[int]
    target: int  # new tokens to generate
    fed: int  # prompt tokens already in the KV cache
    sampler: Any
    out: list[int]
    row: int = -1  # batch row whose logits give this slot's next token this step, -1 if none

    @property
    def prefilling(self) -> bool:
        return self.fed < len(self.prompt)


def generate_batched(model: LlamaCppModel, prompts: Sequence[Sequence[int]], output_lens: Sequence[int],
                     cfg: LlamaCppConfig, threads: int, temperature: float = 0.0,
                     seeds: Optional[Sequence[int]] = None, shared_prefix_tokens: int = 0,
                     warmup: bool = True) -> dict[str, Any]:
    """Generate ``output_lens[i]`` tokens after ``prompts[i]`` for every request, `cfg.parallel` at a time.

    EOS is ignored (a sequence stops on its count). Requests are admitted in
    input order as slots free up.

    Args:
        model: a loaded `LlamaCppModel`.
        prompts: token ids per request (no BOS is added).
        output_lens: new tokens per request, each >= 1.
        cfg: the configuration (`parallel`, `n_batch`, ...).
        threads: llama.cpp threads for decode and batch work.
        temperature: 0 is greedy; otherwise sampled with ``seeds[i]`` per request.
        seeds: one seed per request (needed when temperature > 0).
        shared_prefix_tokens: leading tokens every prompt shares (computed once when `cfg.share_prefix`).
        warmup: decode a few tokens once before timing.
    Returns:
        wall_s (the timed loop, s), output_tokens, requests, token_ids (per request, in input order),
        steps (``llama_decode`` calls), mean_batch_tokens, decode_s / sample_s / other_s (split of wall_s),
        decode_only_tok_s (tokens/s over the steps that carried no prompt token, NaN if none did),
        prefix_tokens_shared (0 when the prefix was not shared), threads, config.
    Raises:
        RuntimeError: ``llama_decode`` failed (e.g. the KV cache is full).
        ValueError: a prompt is empty or an output length is below 1.
    """
    import numpy as np

    import llama_cpp as L

    n_req = len(prompts)
    if len(output_lens) != n_req or any(n < 1 for n in output_lens) or any(len(p) == 0 for p in prompts):
        raise ValueError("every request needs a non-empty prompt and an output length >= 1")
    if temperature > 0 and (seeds is None or len(seeds) != n_req):
        raise ValueError("a sampled run needs one seed per request")
    P = min(cfg.parallel, n_req)
    prefix = list(prompts[0][:shared_prefix_tokens]) if cfg.share_prefix and shared_prefix_tokens > 0 else []
    if prefix and any(list(p[:len(prefix)]) != prefix or len(p) <= len(prefix) for p in prompts):
        raise ValueError("shared_prefix_tokens is not a prefix of every prompt (with at least one token after it)")
    tmpl = P if prefix else -1  # sequence id holding the shared prefix
    n_seq = P + (1 if prefix else 0)
    ctx_per_seq = max(len(p) + n for p, n in zip(prompts, output_lens)) + 1
    ctx = _new_context(model, n_seq, ctx_per_seq, cfg, threads)
    mem = L.llama_get_memory(ctx)
    cap = cfg.n_batch
    batch = L.llama_batch_init(cap, 0, 1)
    tokens = np.ctypeslib.as_array(batch.token, shape=(cap,))
    pos = np.ctypeslib.as_array(batch.pos, shape=(cap,))
    n_seq_id = np.ctypeslib.as_array(batch.n_seq_id, shape=(cap,))
    logits = np.ctypeslib.as_array(batch.logits, shape=(cap,))
    n_seq_id[:] = 1
    seq_ptrs = [batch.seq_id[i] for i in range(cap)]

    def put(n: int, ids: Sequence[int], start_pos: int, seq: int, want_last: bool) -> int:
        """Write ids as batch rows n.. of sequence seq; returns the new row count."""
        k = len(ids)
        tokens[n:n + k] = ids
        pos[n:n + k] = np.arange(start_pos, start_pos + k)
        logits[n:n + k] = 0
        if want_last:
            logits[n + k - 1] = 1
        for i in range(n, n + k):
            seq_ptrs[i][0] = seq
        return n + k

    decode_s = 0.0

    def decode(n: int) -> None:
        nonlocal decode_s
        batch.n_tokens = n
        t = time.perf_counter()
        rc = L.llama_decode(ctx, batch)
        decode_s += time.perf_counter() - t
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} ({n} tokens in the batch)")

    samplers: list[Any] = []
    try:
        if warmup:
            w = list(prompts[0][:8])
            decode(put(0, w, 0, 0, True))
            s = _sampler(0.0, 0)
            L.llama_sampler_sample(s, ctx, len(w) - 1)
            L.llama_sampler_free(s)
            L.llama_memory_clear(mem, True)
            decode_s = 0.0

        waiting = deque(range(n_req))
        slots: list[Optional[_Slot]] = [None] * P
        results: list[list[int]] = [[] for _ in range(n_req)]
        steps = 0
        batch_tokens = 0
        sample_s = 0.0
        decode_only_s, decode_only_tokens = 0.0, 0  # steps without prompt tokens: the decode rate
        t0 = time.perf_counter()
        if prefix:
            for i in range(0, len(prefix), cap):
                chunk = prefix[i:i + cap]
                decode(put(0, chunk, i, tmpl, False))
                steps += 1
                batch_tokens += len(chunk)
        done = 0
        while done < n_req:
            for s in range(P):  # refill free slots with the next requests, in input order
                if slots[s] is None and waiting:
                    r = waiting.popleft()
                    L.llama_memory_seq_rm(mem, s, -1, -1)
                    if prefix:
                        L.llama_memory_seq_cp(mem, tmpl, s, -1, -1)
                    sm = _sampler(temperature, seeds[r] if seeds is not None else 0)
                    samplers.append(sm)
                    slots[s] = _Slot(r, list(prompts[r]), int(output_lens[r]), len(prefix), sm, results[r])
            t_step = time.perf_counter()
            n = 0
            for s, sl in enumerate(slots):  # decode tokens of the running sequences first
                if sl is not None and not sl.prefilling:
                    sl.row = n
                    n = put(n, [sl.out[-1]], len(sl.prompt) + len(sl.out) - 1, s, True)
                elif sl is not None:
                    sl.row = -1
            n_decode = n
            for s, sl in enumerate(slots):  # then prompt tokens, while the batch has room
                if sl is not None and sl.prefilling and n < cap:
                    take = min(len(sl.prompt) - sl.fed, cap - n)
                    last = sl.fed + take == len(sl.prompt)
                    n = put(n, sl.prompt[sl.fed:sl.fed + take], sl.fed, s, last)
                    sl.fed += take
                    sl.row = n - 1 if last else -1
            decode(n)
            steps += 1
            batch_tokens += n
            t = time.perf_counter()
            for s, sl in enumerate(slots):
                if sl is not None and sl.row >= 0:
                    sl.out.append(int(L.llama_sampler_sample(sl.sampler, ctx, sl.row)))
                    if len(sl.out) == sl.target:
                        slots[s] = None
                        done += 1
            sample_s += time.perf_counter() - t
            if n == n_decode:
                decode_only_s += time.perf_counter() - t_step
                decode_only_tokens += n
        wall = time.perf_counter() - t0
    finally:
        for sm in samplers:
            L.llama_sampler_free(sm)
        L.llama_batch_free(batch)
        L.llama_free(ctx)
    return {"wall_s": wall, "output_tokens": sum(len(o) for o in results), "requests": n_req,
            "token_ids": results, "steps": steps, "mean_batch_tokens": batch_tokens / max(steps, 1),
            "decode_s": decode_s, "sample_s": sample_s, "other_s": max(0.0, wall - decode_s - sample_s),
            "decode_only_tok_s": decode_only_tokens / decode_only_s if decode_only_s > 0 else float("nan"),
            "prefix_tokens_shared": len(prefix), "threads": threads, "config": cfg.describe()}


def _child_main() -> None:
    """The child side of `generate_in_child`: a pickled (path, args, kwargs) on stdin, a pickled
    ("ok", result) or ("error", message) on stdout. The result also names the llama-cpp-python
    version (``versions``) and the interpreter (``python``). Imports only the standard library,
    llama_cpp and numpy."""
    import pickle

    path, args, kwargs = pickle.load(sys.stdin.buffer)
    try:
        import llama_cpp

        with LlamaCppModel(path) as model:
            result = generate_batched(model, *args, **kwargs)
        result.update(versions={"llama_cpp_python": getattr(llama_cpp, "__version__", "?")}, python=sys.executable)
        out: tuple[str, Any] = ("ok", result)
    except Exception as e:  # noqa: BLE001 - reported to the parent
        out = ("error", f"{type(e).__name__}: {e}")
    sys.stdout.buffer.write(pickle.dumps(out))
    sys.stdout.flush()


def child_command(python: Optional[str] = None) -> list[str]:
    """The child's command line: ``<python> -m benchmarks.llamacpp_peer`` (`python` default: this
    interpreter), run from the repository root (`REPO`)."""
    return [str(python or sys.executable), "-m", "benchmarks.llamacpp_peer"]


def child_env(omp_wait_policy: Optional[str] = None, python: Optional[str] = None,
              base: Optional[dict[str, str]] = None) -> dict[str, str]:
    """The child's environment: `base` (default os.environ) with OMP_WAIT_POLICY = `omp_wait_policy`
    (None: unset); for an interpreter other than this one (the llama.cpp venv's) also without the
    project's Python settings (PYTHONPATH, VIRTUAL_ENV, PYTHONHOME)."""
    env = dict(os.environ if base is None else base)
    env.pop("OMP_WAIT_POLICY", None)
    if omp_wait_policy is not None:
        env["OMP_WAIT_POLICY"] = omp_wait_policy
    if python is not None and os.path.abspath(str(python)) != os.path.abspath(sys.executable):
        for k in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME"):
            env.pop(k, None)
    return env


def generate_in_child(path: str, prompts: Sequence[Sequence[int]], output_lens: Sequence[int], cfg: "LlamaCppConfig",
                      threads: int, omp_wait_policy: Optional[str] = None, python: Optional[str] = None,
                      **kwargs: Any) -> dict[str, Any]:
    """`generate_batched` on the GGUF at `path`, in a fresh Python process of its own.

    llama.cpp's threads share the process's OpenMP runtime with torch (the dynamic loader
    resolves its libgomp to the one torch already loaded), and that runtime reads
    OMP_WAIT_POLICY once. tokenmill's benchmarks run torch with PASSIVE; llama.cpp is
    fastest with its own default (measured here, one sequence, 2 threads: 185-190 decode
    tok/s against 48-53 under PASSIVE). So the peer runs in a child (`python -m
    benchmarks.llamacpp_peer` from the repository root, which imports only the standard
    library, llama_cpp and numpy: neither torch nor tokenmill) whose environment has
    `omp_wait_policy` (None: the variable unset; `child_env`). `python` is the child's
    interpreter: the llama.cpp venv's (`peer_python`), or this one (default). Loading happens
    before the timed part; the result is `generate_batched`'s dict plus ``versions`` and ``python``.

    Raises:
        RuntimeError: the child failed (its error message) or died.
    """
    import pickle

    payload = pickle.dumps((path, ([list(p) for p in prompts], list(output_lens), cfg, threads), kwargs))
    proc = subprocess.run(child_command(python), input=payload, capture_output=True,
                          env=child_env(omp_wait_policy, python), cwd=str(REPO))
    try:
        status, out = pickle.loads(proc.stdout)
    except Exception:  # noqa: BLE001 - no result: report how the child ended
        raise RuntimeError(f"the llama.cpp child process failed (exit code {proc.returncode}): "
                           f"{proc.stderr.decode(errors='replace')[-800:]}") from None
    if status != "ok":
        raise RuntimeError(f"llama.cpp failed: {out}")
    return out


if __name__ == "__main__":
    _child_main()
