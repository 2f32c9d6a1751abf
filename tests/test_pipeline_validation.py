"""Validation before any write: bad options, mixed input schemas, max_tokens past the context, empty input."""
from __future__ import annotations

import os
import re

import polars as pl
import pytest

from pipeline import JobSpec, read_metrics, run_job
from pipeline.job import prepare_job
from pipeline.testing import FakeLLM


def write_input(path, n: int = 4, **columns) -> str:
    df = pl.DataFrame({"id": list(range(n)), "prompt": [f"Say {i}." for i in range(n)], **columns})
    df.write_parquet(path)
    return str(path)


def parts(out) -> list[str]:
    return sorted(p for p in os.listdir(out) if p.startswith("part-")) if os.path.isdir(out) else []


BAD_OPTIONS = [
    ({"quantization": "int9"}, "invalid engine option: quantization must be None or none|int8|int4|gguf|w8a8, got "
                                  "'int9'"),
    ({"dtype": "fp8"}, "invalid engine option: dtype must be auto|float32|bfloat16|float16, got 'fp8'"),
    ({"model": "smollm-nope", "plan": "input"}, "unknown model 'smollm-nope': expected a named model "
                                                "(smollm2-135m-instruct, gemma-3-270m), a .gguf file"),
    ({"model": "smollm-nope"}, "unknown model 'smollm-nope'"),
    ({"engine_options": {"block_sz": 32}}, "unknown engine option(s) ['block_sz']; known: ['attention_backend', "
                                           "'block_size'"),
    ({"sampling_options": {"top_q": 0.5}}, "invalid sampling option: unknown 'top_q'; known: ['frequency_penalty', "
                                           "'ignore_eos', 'min_p', 'min_tokens', "),
    ({"sampling_options": {"logprobs": 5}}, "invalid sampling option: logprobs: a job writes no logprobs "
                                            "(LLM.generate returns them)"),
    ({"sampling_options": {"prompt_logprobs": 2}}, "invalid sampling option: prompt_logprobs: a job writes no "
                                                   "prompt logprobs (LLM.generate returns them, LLM.score too)"),
    ({"engine_options": {"kv_cache_dtype": "fp9"}}, "kv_cache_dtype must be auto|fp16|fp32|bf16|int8|fp8_e4m3"),
    ({"num_threads": -1}, "invalid engine option: num_threads must be a positive integer or None"),
    ({"num_threads": 0}, "invalid engine option: num_threads must be a positive integer or None"),
    # the engine refused it only at load, after the manifest was written: the fix then needed --overwrite
    ({"max_model_len": 8}, "invalid engine option: block_size=16 is larger than the context (max_model_len=8 "
                           "tokens): a KV block holds block_size tokens of one sequence"),
    ({"engine_options": {"block_size": 16384}}, "invalid engine option: block_size=16384 is larger than the "
                                                "model's context (8192 tokens)"),
    # it was capped quietly: the manifest said 100000000 while rows were refused past 8192
    ({"max_model_len": 100000000}, "invalid engine option: max_model_len=100000000 is more than the model's "
                                   "context (8192 tokens, its max_position_embeddings); give at most 8192"),
]


@pytest.mark.parametrize("bad,message", BAD_OPTIONS, ids=[str(b) for b, _ in BAD_OPTIONS])
def test_bad_option_is_refused_before_anything_is_written_and_the_fix_runs(tmp_path, bad, message):
    """A refused option leaves no `_job/`, so the corrected command is not refused as 'a different spec'."""
    inp = write_input(tmp_path / "in.parquet")
    out = tmp_path / "out"
    with pytest.raises(ValueError) as exc:
        prepare_job(JobSpec(input=inp, output=str(out), progress=False, **bad))
    assert message in str(exc.value)
    assert not out.exists()
    report = run_job(JobSpec(input=inp, output=str(out), progress=False, max_tokens=2), FakeLLM())
    assert report.rows_ok == 4 and parts(out) == ["part-00000.parquet"]


@pytest.mark.parametrize("bad,why", [({"dtype": "bfloat16"}, "here: dtype bfloat16"),
                                     ({"engine_options": {"cpu_kernels": False}}, "here: cpu_kernels=False")])
def test_w8a8_where_it_cannot_run_is_refused_before_anything_is_written(tmp_path, bad, why):
    """W8A8 on the CPU needs the kernel library with fp32: a job asking otherwise is told before its
    manifest, so the corrected command runs without --overwrite (it used to fail at load, after)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: w8a8 runs there in any dtype")
    inp = write_input(tmp_path / "in.parquet")
    out = tmp_path / "out"
    with pytest.raises(ValueError) as exc:
        prepare_job(JobSpec(input=inp, output=str(out), progress=False, quantization="w8a8", **bad))
    assert str(exc.value).startswith("invalid engine option: quantization='w8a8' runs on the CPU kernels")
    assert why in str(exc.value)
    assert not out.exists()


def test_an_attention_setting_that_cannot_run_here_is_refused_before_an_overwrite_deletes_anything(
        tmp_path, monkeypatch):
    """Triton on a CPU outside its interpreter, and the CPU's grouped bf16 cache with Triton, were refused
    only at load: after --overwrite had deleted the finished outputs. Now before, and they stay."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: attention_backend='triton' runs here")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    inp = write_input(tmp_path / "in.parquet")
    out = tmp_path / "out"
    run_job(JobSpec(input=inp, output=str(out), progress=False, max_tokens=2), FakeLLM())
    before = {p.name: p.read_bytes() for p in out.glob("*.parquet")}
    for bad, message in [({"attention_backend": "triton"}, "attention_backend='triton' runs on CUDA (on the CPU "
                                                            "only under TRITON_INTERPRET=1"),
                         ({"kv_cache_dtype": "bf16", "attention_backend": "triton"},
                          "kv_cache_dtype='bf16' is the CPU's grouped bf16 cache")]:
        with pytest.raises(ValueError) as exc:
            prepare_job(JobSpec(input=inp, output=str(out), progress=False, overwrite=True, engine_options=bad))
        assert message in str(exc.value)
        assert {p.name: p.read_bytes() for p in out.glob("*.parquet")} == before and len(before) == 1


def test_cuda_device_without_cuda_is_refused_before_writing(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: device='cuda' is valid here")
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="device 'cuda' was asked for, but no CUDA device is available"):
        prepare_job(JobSpec(input=write_input(tmp_path / "in.parquet"), output=str(out), device="cuda"))
    assert not out.exists()


def test_mixed_id_types_are_refused_naming_the_file_and_column(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    write_input(d / "a.parquet")
    pl.DataFrame({"id": ["x", "y"], "prompt": ["Hi.", "Yo."]}).write_parquet(d / "b.parquet")
    out = tmp_path / "out"
    with pytest.raises(ValueError) as exc:
        run_job(JobSpec(input=str(d), output=str(out), progress=False), FakeLLM())
    # the two input files are named as input files; "part files" are the output's, which would not read together
    assert str(exc.value) == (f"file://{d}/b.parquet: column 'id' is String here but Int64 in file://{d}/a.parquet; "
                              f"these types cannot be unified, so the output's part files would not read together "
                              f"as one table. Cast the column to one type in every input file.")
    assert not out.exists()


def test_missing_passthrough_column_is_refused_naming_the_file_and_column(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    write_input(d / "a.parquet", topic=["a", "b", "c", "d"])
    write_input(d / "b.parquet")
    with pytest.raises(ValueError) as exc:
        run_job(JobSpec(input=str(d), output=str(tmp_path / "out"), progress=False), FakeLLM())
    assert str(exc.value) == (f"file://{d}/b.parquet lacks column 'topic', which file://{d}/a.parquet has: every "
                              f"input file must have the same id and pass-through columns, or the output's part files "
                              f"would not read together as one table. Add or drop the column, or run the files as "
                              f"separate jobs.")
    assert not (tmp_path / "out").exists()


def test_duplicate_column_names_are_refused_naming_the_file_and_columns(tmp_path, capsys):
    """Parquet allows two columns of one name (pyarrow writes them); a job reads columns by name, so it
    refuses them before anything is written, as a missing prompt column, instead of a KeyError."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.cli import main

    d = tmp_path / "in"
    d.mkdir()
    write_input(d / "a.parquet")
    ints = pa.array([1, 2])
    pq.write_table(pa.Table.from_arrays([ints, pa.array(["A.", "B."]), ints, ints, ints, pa.array(["x", "y"]), ints],
                                        names=["id", "prompt", "dup", "dup", "dup", "note", "note"]), d / "b.parquet")
    out = tmp_path / "out"
    message = (f"file://{d}/b.parquet: input has duplicate column names: 'dup' (3 times), 'note' (2 times); rename "
               f"the columns so that each name appears once")
    with pytest.raises(ValueError) as exc:
        run_job(JobSpec(input=str(d), output=str(out), progress=False), FakeLLM())
    assert str(exc.value) == message
    assert main(["run", "--input", str(d), "--output", str(out), "--no-progress"]) == 1
    assert capsys.readouterr().err.splitlines() == [f"tokenmill: {message}"]
    assert not out.exists()


def test_castable_types_are_unified_said_so_and_the_parts_read_together(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    pl.DataFrame({"id": pl.Series([0, 1], dtype=pl.Int32), "prompt": ["A.", "B."],
                  "note": pl.Series([None, None], dtype=pl.Null)}).write_parquet(d / "a.parquet")
    pl.DataFrame({"id": [2, 3], "prompt": ["C.", "D."], "note": ["x", "y"],
                  "max_tokens": [1, 2]}).write_parquet(d / "b.parquet")  # an override column in one file only
    out = tmp_path / "out"
    with pytest.warns(UserWarning) as caught:
        run_job(JobSpec(input=str(d), output=str(out), progress=False, max_tokens=3), FakeLLM())
    notes = sorted(str(w.message) for w in caught)
    assert notes == [f"{d}: column 'id' is Int32 in file://{d}/a.parquet, Int64 in file://{d}/b.parquet: unified "
                     f"to Int64 in the output",
                     f"{d}: column 'note' is Null in file://{d}/a.parquet, String in file://{d}/b.parquet: unified "
                     f"to String in the output"]
    df = pl.read_parquet(f"{out}/part-*.parquet")  # raised SchemaError before
    assert df.schema["id"] == pl.Int64 and df.schema["note"] == pl.String
    assert df.sort("id")["id"].to_list() == [0, 1, 2, 3]
    assert df.sort("id")["note"].to_list() == [None, None, "x", "y"]
    assert df.sort("id")["completion_tokens"].to_list() == [3, 3, 1, 2]


def test_max_tokens_past_the_context_is_an_error_row_unless_truncate(tmp_path):
    inp = tmp_path / "in.parquet"
    pl.DataFrame({"id": [1, 2, 3], "prompt": ["Short one.", "Another.", "Third."],
                  "max_tokens": [None, 10**12, 5]}).write_parquet(inp)
    out = tmp_path / "out"
    llm = FakeLLM(max_model_len=512)
    report = run_job(JobSpec(input=str(inp), output=str(out), progress=False, max_tokens=4), llm)
    df = pl.read_parquet(f"{out}/part-*.parquet").sort("id")
    prompt_len = len(llm.tokenizer.encode(llm.tokenizer.apply_chat_template([{"role": "user", "content": "Another."}])))
    assert df["error"].to_list() == [
        None,
        f"max_tokens 1000000000000 does not fit the engine's context: the prompt has {prompt_len} tokens and the "
        f"context (max_model_len) is 512, which leaves {512 - prompt_len}; lower max_tokens, or pass --truncate to "
        f"stop at the end of the context",
        None]
    assert df["completion_tokens"].to_list() == [4, 0, 5] and (report.rows_ok, report.rows_error) == (2, 1)

    out2 = tmp_path / "truncated"
    run_job(JobSpec(input=str(inp), output=str(out2), progress=False, max_tokens=4, truncate=True), FakeLLM())
    df2 = pl.read_parquet(f"{out2}/part-*.parquet").sort("id")
    assert df2["error"].null_count() == 3
    assert df2["completion_tokens"].to_list()[1] == min(512 - prompt_len, len("Another.0 ") * 64)
    assert df2["finish_reason"].to_list() == ["length"] * 3


def test_empty_input_is_a_zero_row_report_with_no_part_files(tmp_path, capsys):
    from pipeline.cli import main

    inp = tmp_path / "empty.parquet"
    pl.DataFrame({"id": pl.Series([], dtype=pl.Int64), "prompt": pl.Series([], dtype=pl.String)}).write_parquet(inp)
    out = tmp_path / "out"
    llm = FakeLLM()
    report = run_job(JobSpec(input=str(inp), output=str(out), progress=False), llm)
    assert (report.rows_total, report.rows_ok, report.rows_error) == (0, 0, 0)
    assert llm.calls == 0 and parts(out) == []
    assert main(["run", "--input", str(inp), "--output", str(tmp_path / "cli"), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert f"0 rows in {inp}: nothing generated, no part files written" in printed
    assert "part-*.parquet" not in printed
    assert read_metrics(str(tmp_path / "cli"))["rows_total"].to_list() == [0]


def test_default_storage_limits_bound_a_stall_under_two_minutes():
    from pipeline.storage import quick_options, stall_bound_s, write_deadline_s

    assert stall_bound_s() == 86.0 and stall_bound_s(file_read=False) == 44.0
    assert write_deadline_s(0) == 36.0
    quick = quick_options({})
    cleanup = write_deadline_s(0, quick) + stall_bound_s(quick, file_read=False)  # book the cost, drop the lease
    assert stall_bound_s() + cleanup < 120
    # a config_kwargs option overrides the defaults key by key
    assert stall_bound_s({"config_kwargs": {"read_timeout": 20}}) == 4 * 3 * 22 + 2


def test_truncate_joins_the_fingerprint_only_when_set(tmp_path):
    from pipeline import JobSpecChanged

    inp = write_input(tmp_path / "in.parquet")
    spec = JobSpec(input=inp, output=str(tmp_path / "out"), progress=False, max_tokens=2)
    assert "truncate" not in spec.fingerprint_fields()  # jobs written before the option resume unchanged
    run_job(spec.model_copy(update={"truncate": True}), FakeLLM())
    with pytest.raises(JobSpecChanged, match="truncate: True -> None"):
        run_job(spec, FakeLLM())


def test_an_empty_prompt_is_an_error_row_saying_so(tmp_path):
    """As the README's Error rows say: "" and "   " give finish_reason error, no generation, no tokens."""
    inp = tmp_path / "in.parquet"
    pl.DataFrame({"id": [1, 2, 3], "prompt": ["", "Hi.", "   "]}).write_parquet(inp)
    out = tmp_path / "out"
    report = run_job(JobSpec(input=str(inp), output=str(out), progress=False, max_tokens=2), FakeLLM())
    df = pl.read_parquet(f"{out}/part-*.parquet").sort("id")
    assert df["error"].to_list() == ["prompt is empty", None, "prompt is empty"]
    assert df["finish_reason"].to_list() == ["error", "length", "error"]
    assert df["generation"].to_list()[0] is None and df["generation"].to_list()[2] is None
    assert df["prompt_tokens"].to_list()[::2] == [0, 0] and df["completion_tokens"].to_list()[::2] == [0, 0]
    assert (report.rows_ok, report.rows_error) == (1, 2)


def test_a_kv_cache_budget_below_one_block_is_refused_before_anything_is_written(tmp_path, capsys):
    """--kv-cache-memory-bytes 10 fails up front, naming the option and the minimum (one KV block of the
    model, from its metadata), which is the engine's own: one byte less is refused by the engine too."""
    from engine import LLM
    from pipeline.cli import main

    inp = write_input(tmp_path / "in.parquet")
    out = tmp_path / "out"
    block = 2 * 30 * 3 * 64 * 2 * 16  # K and V x 30 layers x 3 KV heads x head_dim 64 x fp16 (the default) x 16 tokens

    def refused(**options) -> str:
        with pytest.raises(ValueError) as exc:
            prepare_job(JobSpec(input=inp, output=str(out), progress=False, dtype="float32", **options))
        assert not out.exists()
        return str(exc.value)

    def message(given: int, need: int, block_size: int = 16) -> str:
        return (f"invalid engine option: kv_cache_memory_bytes={given} is below the minimum of {need} bytes, one "
                f"KV block of 'smollm2-135m-instruct' (block_size={block_size} tokens x 30 layers x K and V); give "
                f"at least {need}, or leave it unset for a share of the free memory")

    assert refused(kv_cache_memory_bytes=10) == message(10, block)
    assert refused(kv_cache_memory_bytes=block - 1) == message(block - 1, block)
    assert refused(kv_cache_memory_bytes=10, engine_options={"block_size": 32}) == message(10, 2 * block, 32)
    int8_block = 2 * 30 * 3 * (64 + 4) * 1 * 16  # int8 codes and each row's fp32 scale
    assert refused(kv_cache_memory_bytes=10, engine_options={"kv_cache_dtype": "int8"}) == message(10, int8_block)
    assert refused(kv_cache_memory_bytes=10, engine_options={"kv_cache_dtype": "fp32"}) == message(10, 2 * block)

    assert main(["run", "--input", inp, "--output", str(out), "--no-progress", "--dtype", "float32",
                 "--kv-cache-memory-bytes", "10"]) == 1
    assert capsys.readouterr().err.splitlines() == [  # the option as typed
        "tokenmill run: error: --kv-cache-memory-bytes 10" + message(10, block).split("kv_cache_memory_bytes=10", 1)[1]]
    assert not out.exists()

    with pytest.raises(ValueError, match=rf"kv_cache_memory_bytes={block - 1} is smaller than one KV block "
                                         rf"\({block} bytes"):
        LLM("smollm2-135m-instruct", dtype="float32", kv_cache_memory_bytes=block - 1)
    prepare_job(JobSpec(input=inp, output=str(out), progress=False, dtype="float32", max_tokens=8,
                        kv_cache_memory_bytes=block)).close()  # the minimum itself passes (a 16-token context)


def test_a_kv_cache_budget_past_the_machines_memory_is_refused_before_anything_is_written(tmp_path, capsys,
                                                                                           monkeypatch):
    """--kv-cache-memory-bytes 10**12 on a 24 GiB machine wrote `_job/` (manifest and lease), then the engine
    zero-filled the cache until the kernel's OOM killer ended the process (exit 137). It is refused up front,
    naming the option, the value and the machine's available and total memory; the engine refuses it too,
    before it allocates. (The machine's memory is a stand-in here: nothing is allocated.)"""
    import engine.loader
    from engine import LLM
    from pipeline.cli import main

    gib = 2 ** 30
    monkeypatch.setattr(engine.loader, "memory_bytes", lambda: (3 * gib, 8 * gib))
    inp = write_input(tmp_path / "in.parquet")
    out = tmp_path / "out"
    why = (f"kv_cache_memory_bytes={4 * gib} bytes (4.0 GiB) is more than this machine's available memory, "
           f"{3 * gib} bytes (3.0 GiB) of {8 * gib} bytes (8.0 GiB) in all; give at most {3 * gib}, or leave it "
           f"unset for a share of the free memory")
    assert main(["run", "--input", inp, "--output", str(out), "--no-progress", "--device", "cpu",
                 "--kv-cache-memory-bytes", str(4 * gib)]) == 1
    assert capsys.readouterr().err.splitlines() == [f"tokenmill: invalid engine option: {why}"]
    assert not out.exists()  # no manifest, no lease, no failed run booked
    with pytest.raises(ValueError, match=re.escape(f"kv_cache_memory_bytes={2 * gib} x 2 tensor-parallel ranks = "
                                                   f"{4 * gib} bytes (4.0 GiB) is more than")):
        prepare_job(JobSpec(input=inp, output=str(out), progress=False, device="cpu", kv_cache_memory_bytes=2 * gib,
                            tensor_parallel_size=2))
    assert not out.exists()
    with pytest.raises(ValueError) as exc:
        LLM("dummy:llama-tiny-4kv", device="cpu", kv_cache_memory_bytes=4 * gib)
    assert str(exc.value) == why
    report = run_job(JobSpec(input=inp, output=str(out), progress=False, device="cpu", max_tokens=2,
                             kv_cache_memory_bytes=gib), FakeLLM())  # within the memory: runs
    assert report.rows_ok == 4


def test_negative_seeds_are_seeds_and_minus_one_is_no_seed_of_its_own_as_in_vllm(tmp_path):
    """A job's --seed and a row's seed take any integer; a row seed of -1 (vLLM's "unseeded") is a null
    seed: the row gets the one derived from --seed and its index, as a row without a seed does."""
    from pipeline.engines import row_seed

    class Recording(FakeLLM):
        def iter_outputs(self, prompts, sampling_params=None, use_tqdm=True):
            self.seeds = [p.seed for p in sampling_params]
            return super().iter_outputs(prompts, sampling_params, use_tqdm)

    inp = write_input(tmp_path / "in.parquet", 4, seed=[None, -1, -7, 5])
    llm = Recording()
    report = run_job(JobSpec(input=inp, output=str(tmp_path / "out"), progress=False, max_tokens=2, temperature=0.8,
                             seed=-3, plan="input"), llm)
    assert llm.seeds == [row_seed(-3, 0), row_seed(-3, 1), -7, 5]
    assert (report.rows_ok, report.rows_error) == (4, 0)


@pytest.mark.parametrize("plan", ["input", "prefix"])
def test_text_that_is_not_utf8_makes_its_row_an_error_row_and_the_rest_run(tmp_path, plan):
    """pyarrow writes whatever bytes a string column is given; polars panicked on them when it built the
    row (the whole job died). The row becomes an error row naming the column; other rows run; the
    output stays valid Parquet, the bad bytes read as U+FFFD."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def text(values):
        return pa.array(values, pa.binary()).cast(pa.string(), safe=False)  # no UTF-8 check, as a writer may do

    inp = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": ["a", "b", "c", "d"],
                             "prompt": text([b"Say a.", b"\xff\xfe\xfd", b"Say c.", b"Say d\xc3."]),
                             "src": text([b"x", b"y", b"z\x80", b"w"])}), inp)
    out = tmp_path / "out"
    report = run_job(JobSpec(input=str(inp), output=str(out), progress=False, max_tokens=2, plan=plan), FakeLLM())
    df = pl.read_parquet(f"{out}/part-*.parquet").sort("id")
    why = "not valid UTF-8 text (the Parquet file holds other bytes in a string column)"
    assert df["error"].to_list() == [None, f"prompt is {why}", f"src is {why}", f"prompt is {why}"]
    clean = tmp_path / "clean.parquet"
    pl.DataFrame({"id": ["a"], "prompt": ["Say a."], "src": ["x"]}).write_parquet(clean)
    run_job(JobSpec(input=str(clean), output=str(tmp_path / "ref"), progress=False, max_tokens=2, plan=plan),
            FakeLLM())
    ref = pl.read_parquet(f"{tmp_path}/ref/part-*.parquet")
    assert df["generation"].to_list() == [ref["generation"][0], None, None, None] and ref["generation"][0]
    assert df["finish_reason"].to_list() == ["length", "error", "error", "error"]
    assert df["src"].to_list() == ["x", "y", "z\ufffd", "w"]
    assert df.columns == ref.columns  # the marker column never reaches the output
    assert (report.rows_ok, report.rows_error) == (1, 3)


def test_text_that_is_not_utf8_inside_messages_makes_its_row_an_error_row(tmp_path):
    """The same bytes nested in a messages column (a list of {role, content} structs): the row is an
    error row naming the column, the other rows run, and the output keeps the messages with U+FFFD."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    as_bytes = pa.list_(pa.struct([("role", pa.binary()), ("content", pa.binary())]))
    chats = pa.array([[{"role": b"user", "content": b"Say a."}], [{"role": b"user", "content": b"Say \xff."}],
                      [{"role": b"system", "content": b"Be brief."}, {"role": b"user", "content": b"Say c."}]],
                     as_bytes).cast(pa.list_(message), safe=False)
    inp = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": ["a", "b", "c"], "messages": chats}), inp)
    out = tmp_path / "out"
    report = run_job(JobSpec(input=str(inp), output=str(out), progress=False, max_tokens=2), FakeLLM())
    df = pl.read_parquet(f"{out}/part-*.parquet").sort("id")
    why = "not valid UTF-8 text (the Parquet file holds other bytes in a string column)"
    assert df["error"].to_list() == [None, f"messages is {why}", None]
    assert df["finish_reason"].to_list() == ["length", "error", "length"]
    assert (report.rows_ok, report.rows_error) == (2, 1)


@pytest.mark.parametrize("plan", ["input", "prefix"])
@pytest.mark.parametrize("binary", ["binary", "large_binary"])
def test_a_binary_prompt_column_is_read_as_utf8_text_and_a_bad_row_is_an_error_row(tmp_path, plan, binary):
    """A BINARY (or LARGE_BINARY) prompt column, as some writers store text, was refused row by row as
    `prompt must be a string, got bytes b'Say a.'`: every row an error row. Its UTF-8 bytes are the prompt
    now, as a string column's are; a row whose bytes are not UTF-8 is an error row naming the column and
    the byte, the others run, and a binary pass-through column reaches the output as it was."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    kind = getattr(pa, binary)()
    inp = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": ["a", "b", "c"],
                             "prompt": pa.array([b"Say a.", b"Say \xff.", "Sag \u00e4.".encode()], kind),
                             "blob": pa.array([b"\x00\x01", b"\xff", b""], kind)}), inp)
    out = tmp_path / "out"
    report = run_job(JobSpec(input=str(inp), output=str(out), progress=False, max_tokens=2, plan=plan), FakeLLM())
    df = pl.read_parquet(f"{out}/part-*.parquet").sort("id")
    assert df["error"].to_list() == [None, "prompt is not valid UTF-8 text (a binary column; byte 0xff at "
                                           "position 4)", None]
    assert df["finish_reason"].to_list() == ["length", "error", "length"]
    assert df["blob"].to_list() == [b"\x00\x01", b"\xff", b""] and df.schema["blob"] == pl.Binary
    assert (report.rows_ok, report.rows_error) == (2, 1)
    clean = tmp_path / "clean.parquet"
    pl.DataFrame({"id": ["a", "c"], "prompt": ["Say a.", "Sag \u00e4."]}).write_parquet(clean)
    run_job(JobSpec(input=str(clean), output=str(tmp_path / "ref"), progress=False, max_tokens=2, plan=plan),
            FakeLLM())
    ref = pl.read_parquet(f"{tmp_path}/ref/part-*.parquet").sort("id")
    assert df["generation"].to_list() == [ref["generation"][0], None, ref["generation"][1]]
    assert df["prompt_tokens"].to_list() == [ref["prompt_tokens"][0], 0, ref["prompt_tokens"][1]]


@pytest.mark.parametrize("field", ["max_tokens", "limit", "kv_cache_memory_bytes", "device_count", "shard_size"])
def test_an_integer_option_too_large_for_int64_is_refused_naming_it(tmp_path, field):
    """10**23 passed every bound and overflowed later ("int too big to convert"), after the lease was taken."""
    fields = {"input": write_input(tmp_path / "in.parquet"), "output": str(tmp_path / "out"), field: 10 ** 23}
    with pytest.raises(ValueError, match=re.escape(f"{field}\n  Value error, too large: at most 4,611,686,018,427,387,904")):
        JobSpec(**fields)
    assert JobSpec(**{**fields, field: 2 ** 62}).model_dump()[field] == 2 ** 62


def test_the_job_seed_takes_the_engines_64_bit_range(tmp_path):
    """The job's seed was held to 2**62 (the bound of counts) while `SamplingParams(seed=...)` took any
    integer; both now take [-2**63, 2**63 - 1], what the sampler uses without losing bits."""
    fields = {"input": write_input(tmp_path / "in.parquet"), "output": str(tmp_path / "out")}
    for seed in (2 ** 63 - 1, 2 ** 62 + 1, -(2 ** 63)):
        assert JobSpec(**fields, seed=seed).seed == seed
    for seed in (2 ** 63, -(2 ** 63) - 1, 2 ** 80):
        with pytest.raises(ValueError, match=re.escape("seed\n  Value error, must be in [-2**63, 2**63 - 1] "
                                                       "(a 64-bit integer)")):
            JobSpec(**fields, seed=seed)


def test_a_lease_shorter_than_a_tenth_of_a_second_is_refused(tmp_path):
    fields = {"input": write_input(tmp_path / "in.parquet"), "output": str(tmp_path / "out")}
    with pytest.raises(ValueError, match="lease_ttl_s\n  Input should be greater than or equal to 0.1"):
        JobSpec(**fields, lease_ttl_s=1e-9)
    assert JobSpec(**fields, lease_ttl_s=0.1).lease_ttl_s == 0.1


@pytest.mark.parametrize("field,value,message", [
    ("output", "", "output\n  Value error, must be a path or URL, got an empty string"),  # it wrote into /
    ("input", "  ", "input\n  Value error, must be a path or URL, got an empty string"),
    ("system_prompt", "", "system_prompt\n  Value error, is empty: leave it unset for no system prompt"),
])
def test_an_empty_path_or_system_prompt_is_refused(tmp_path, field, value, message):
    fields = {"input": write_input(tmp_path / "in.parquet"), "output": str(tmp_path / "out"), field: value}
    with pytest.raises(ValueError, match=re.escape(message)):
        JobSpec(**fields)


def test_a_damaged_job_file_is_named_with_the_way_out(tmp_path):
    inp = write_input(tmp_path / "in.parquet")
    out = tmp_path / "out"
    spec = JobSpec(input=inp, output=str(out), progress=False, max_tokens=2, shard_size=2, plan="input")
    run_job(spec, FakeLLM())
    marker = out / "_job" / "done" / "part-00000.json"
    marker.write_text("{garbage")
    with pytest.raises(ValueError) as exc:
        run_job(spec, FakeLLM())
    assert str(exc.value) == (f"{marker} is not valid JSON (Expecting property name enclosed in double quotes: "
                              f"line 1 column 2 (char 1)); --overwrite starts the job over")
    run_job(spec.model_copy(update={"overwrite": True}), FakeLLM())
    assert pl.read_parquet(f"{out}/part-*.parquet")["id"].to_list() == [0, 1, 2, 3]


def test_a_blank_system_value_makes_its_row_an_error_row_naming_the_system_column(tmp_path):
    """A row's `system` of '' or spaces was reported as `messages[0].content is empty`, a column the
    input did not have; a null system still takes the job's system prompt."""
    inp = tmp_path / "in.parquet"
    pl.DataFrame({"id": [1, 2, 3], "prompt": ["Hi", "Hi", "Hi"], "system": ["Be brief.", "   ", None]}).write_parquet(inp)
    report = run_job(JobSpec(input=str(inp), output=str(tmp_path / "out"), progress=False, max_tokens=2), FakeLLM())
    df = pl.read_parquet(f"{tmp_path}/out/part-*.parquet").sort("id")
    assert df["error"].to_list() == [None, "system is empty ('   '): leave it null for the job's system prompt, if any",
                                     None]
    assert (report.rows_ok, report.rows_error) == (2, 1)


def test_more_threads_than_cpus_is_refused_for_a_local_job_not_for_a_cluster(tmp_path):
    """This machine's CPU count bounds num_threads only where the job runs here: a cluster's workers
    may have more CPUs than the process that plans (they check their own when the engine starts)."""
    from engine.threads import available_cpus
    from pipeline.spec import validate_spec

    cpus = available_cpus()
    fields = {"input": write_input(tmp_path / "in.parquet"), "output": str(tmp_path / "out"), "num_threads": cpus + 1}
    with pytest.raises(ValueError, match=re.escape(f"invalid engine option: num_threads={cpus + 1} is more than the "
                                                   f"{cpus} CPUs this process may use")):
        validate_spec(JobSpec(**fields))
    validate_spec(JobSpec(**fields, cluster="tcp://127.0.0.1:8786"))  # not refused here


def test_runs_cost_rows_read_together_with_one_read_parquet(tmp_path):
    """A run's unset report fields were written as polars Null columns, so after a run that used speculation
    (a float there) `pl.read_parquet("OUT/_job/runs/*.parquet")` failed with a SchemaError; they keep their
    declared types now (Float64, Int64, Utf8)."""
    import dataclasses

    inp = write_input(tmp_path / "in.parquet")
    out = tmp_path / "out"
    report = run_job(JobSpec(input=inp, output=str(out), progress=False, max_tokens=2), FakeLLM())
    frame = report.as_frame()
    assert report.spec_mean_accepted_per_verify is None and report.rows_valid is None and report.error is None
    assert (frame.schema["spec_mean_accepted_per_verify"], frame.schema["rows_valid"], frame.schema["error"]) == (
        pl.Float64, pl.Int64, pl.Utf8)
    runs = out / "_job" / "runs"
    other = dataclasses.replace(report, run_id="other", spec_mean_accepted_per_verify=1.5, rows_valid=3, error="x")
    other.as_frame().write_parquet(runs / "run-other.parquet")
    both = pl.read_parquet(str(runs / "*.parquet")).sort("run_id")
    assert both.height == 2 and sorted(both["spec_mean_accepted_per_verify"].to_list(), key=str) == [1.5, None]


@pytest.mark.parametrize("column,role", [("prompt", "the prompt"), ("max_tokens", "a per-row sampling option"),
                                         ("generation", "an output")])
def test_an_id_column_naming_the_prompt_or_an_option_or_output_column_is_refused_before_anything_is_written(
        tmp_path, column, role):
    """--id-column prompt made the output hold `prompt` twice: polars refused it after the manifest was
    written, and the corrected command then met "another job's output". Refused up front now."""
    inp = write_input(tmp_path / "in.parquet", max_tokens=[4, 4, 4, 4])
    out = tmp_path / "out"
    with pytest.raises(ValueError) as exc:
        prepare_job(JobSpec(input=inp, output=str(out), progress=False, id_column=column))
    assert f"id_column {column!r} is {role} column" in str(exc.value)
    assert not out.exists()


def test_a_max_tokens_no_prompt_leaves_room_for_is_refused_before_anything_is_written(tmp_path, capsys):
    """--max-tokens 1000000 loaded the model and wrote every row as an error row (exit 4); a job-wide
    max_tokens of at least the engine's context now fails up front, naming the context and what sets it.
    One token less passes, and so does any value with truncate, which stops each row at the context's end."""
    from pipeline.cli import main

    inp = write_input(tmp_path / "in.parquet")
    out = tmp_path / "out"

    def refused(max_tokens: int, **options) -> str:
        with pytest.raises(ValueError) as exc:
            prepare_job(JobSpec(input=inp, output=str(out), progress=False, max_tokens=max_tokens, **options))
        assert not out.exists()
        return str(exc.value)

    def message(given: int, length: int, bound: str) -> str:
        return (f"max_tokens {given} does not fit the engine's context with any prompt: the context (max_model_len) "
                f"is {length} tokens, set by {bound}, and a prompt takes at least 1 of them; give at most "
                f"{length - 1}, or set truncate (--truncate) to stop at the end of the context")

    assert refused(8192) == "invalid default sampling parameters: " + message(8192, 8192, "the model's trained context")
    assert refused(64, max_model_len=64) == ("invalid default sampling parameters: "
                                             + message(64, 64, "the max_model_len=64 option"))
    assert main(["run", "--input", inp, "--output", str(out), "--no-progress", "--max-tokens", "1000000"]) == 1
    assert capsys.readouterr().err.splitlines() == [
        "tokenmill run: error: --max-tokens 1000000" + message(1000000, 8192, "the model's trained context")
        .split("max_tokens 1000000", 1)[1]]
    assert not out.exists()
    prepare_job(JobSpec(input=inp, output=str(out), progress=False, max_tokens=63, max_model_len=64)).close()
    prepare_job(JobSpec(input=inp, output=str(tmp_path / "out2"), progress=False, max_tokens=10 ** 6,
                        truncate=True)).close()
