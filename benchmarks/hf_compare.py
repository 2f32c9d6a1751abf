"""tokenmill against Hugging Face transformers `generate`, in one run, on the same weights.

Workload: ``--num-prompts`` prompts of real text (the docstrings of
``data/labelling.parquet``, without the shared instruction, so neither side
gets a prefix-cache advantage: about 50-170 tokens each), ``--max-tokens`` new
tokens per prompt, greedy, EOS ignored, so both sides produce exactly
``num_prompts * max_tokens`` output tokens.

- tokenmill: ``LLM(model).generate(prompt_token_ids, SamplingParams(temperature=0,
  max_tokens=N, ignore_eos=True))``: continuous batching over all prompts.
- transformers: ``AutoModelForCausalLM.from_pretrained(folder, dtype=...)`` on a dense Hugging
  Face folder written once from the same GGUF (`benchmarks.throughput.load_hf_model`), in the
  host's best dtype (``--hf-dtype auto``: bf16 where
  the CPU has AMX-BF16 or AVX512-BF16, as `engine.host` says, else fp32), static batches of
  ``--batch-size`` prompts in input order, left padding, ``min_new_tokens = max_new_tokens = N``.

Both sides get the same prompt token ids (tokenised once by tokenmill's
tokenizer). Only ``generate`` is timed (a short warm-up runs first); loading is
reported separately. Before each measurement the script prints the machine
load: ``os.getloadavg()`` (whose 1-minute figure also counts this process's
own recent work) and the CPU cores that *other* processes kept busy over a
one-second sample while this one slept; after each, the cores other processes
kept busy *during* it. On this 2-core machine any other load slows both sides
a lot: trust a run only when those figures are near 0.

Usage::

    python -m benchmarks.hf_compare [--num-prompts 64] [--max-tokens 64] [--hf-dtype auto|float32|bfloat16]
                                    [--batch-size 32] [--wait-quiet SECONDS]
                                    [--output-json PATH]

Prints a table of output tokens/s and the ratio tokenmill / transformers.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch

from benchmarks import record

DATA = Path(__file__).resolve().parent.parent / "data" / "labelling.parquet"
DEFAULT_MODEL = "smollm2-135m-instruct"


# ----------------------------------------------------------------- machine load
def _cpu_busy_jiffies() -> Optional[tuple[int, int]]:
    """(busy, total) CPU jiffies of the whole machine from /proc/stat, or None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal (guest is inside user)
    return total - idle, total


def machine_load(sample_s: float = 1.0) -> dict[str, Any]:
    """Load averages, and the cores other processes keep busy (sampled while this process sleeps)."""
    load1, load5, load15 = os.getloadavg()
    other_busy = None
    before = _cpu_busy_jiffies()
    if before is not None:
        time.sleep(sample_s)
        after = _cpu_busy_jiffies()
        if after is not None and after[1] > before[1]:
            ncpu = os.cpu_count() or 1
            other_busy = round(ncpu * (after[0] - before[0]) / (after[1] - before[1]), 2)
    return {"loadavg_1m": round(load1, 2), "loadavg_5m": round(load5, 2), "loadavg_15m": round(load15, 2),
            "other_busy_cores": other_busy}


class BusyMeter:
    """CPU cores kept busy by *other* processes while a measurement runs.

    Machine-wide busy jiffies from /proc/stat minus this process's own CPU time and
    that of its waited-for children (os.times: a peer run in a child process is ours),
    over the wall time between ``start`` and ``stop``; None off Linux.
    """

    @staticmethod
    def _own_cpu() -> float:
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system

    def start(self) -> "BusyMeter":
        self._machine = _cpu_busy_jiffies()
        self._own = self._own_cpu()
        return self

    def stop(self) -> Optional[float]:
        after = _cpu_busy_jiffies()
        own_now = self._own_cpu()
        if self._machine is None or after is None or after[1] <= self._machine[1]:
            return None
        hz = os.sysconf("SC_CLK_TCK")
        own = (own_now - self._own) * hz
        ncpu = os.cpu_count() or 1
        return round(max(0.0, ncpu * (after[0] - self._machine[0] - own) / (after[1] - self._machine[1])), 2)


def wait_for_quiet(timeout_s: float, threshold: float = 0.3) -> dict[str, Any]:
    """Sample the load until other processes keep fewer than ``threshold`` cores busy, or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    load = machine_load()
    while (load["other_busy_cores"] or 0.0) >= threshold and time.monotonic() < deadline:
        time.sleep(4.0)
        load = machine_load()
    return load


def _fmt_load(load: dict[str, Any]) -> str:
    busy = "n/a" if load["other_busy_cores"] is None else f"{load['other_busy_cores']:.2f}"
    return (f"loadavg {load['loadavg_1m']:.2f} / {load['loadavg_5m']:.2f} / {load['loadavg_15m']:.2f}, "
            f"other processes busy: {busy} of {os.cpu_count()} cores")


def warn_if_busy(busiest: float, consequence: str = "these are not the figures of a quiet machine") -> None:
    """Print a warning to stderr when other processes kept more than 0.3 cores busy around a measurement."""
    if busiest > 0.3:
        print(f"WARNING: other processes kept up to {busiest:.2f} of {os.cpu_count()} cores busy around a "
              f"measurement; {consequence}", file=sys.stderr)


def write_json_report(path: Optional[Path], report: dict[str, Any]) -> None:
    """Write a benchmark's report as JSON with its record (`benchmarks.record.write`), if a path is given."""
    record.write(path, report, record.main_benchmark())


# ----------------------------------------------------------------- workload
def load_prompt_texts(num_prompts: int, path: Path = DATA) -> list[str]:
    """The first ``num_prompts`` docstrings of the labelling set (cycled if more are asked for)."""
    import pyarrow.parquet as pq

    prompts = pq.read_table(path, columns=["prompt"]).column("prompt").to_pylist()
    # drop the shared instruction: keep "Docstring of <name>:\n<text>"
    texts = [p.split("\n\n", 1)[1] if "\n\n" in p else p for p in prompts]
    return [texts[i % len(texts)] for i in range(num_prompts)]


# ----------------------------------------------------------------- the two sides
def run_tokenmill(llm: Any, prompt_ids: list[list[int]], max_tokens: int) -> dict[str, Any]:
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompt_ids[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    t0 = time.perf_counter()
    outputs = llm.generate(prompt_ids, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    errors = [o.outputs[0].finish_reason for o in outputs if o.outputs[0].finish_reason == "error"]
    if errors:
        raise RuntimeError(f"tokenmill returned {len(errors)} error outputs")
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    return {"wall_s": wall, "output_tokens": sum(map(len, tokens)), "token_ids": tokens}


def run_transformers(model: Any, prompt_ids: list[list[int]], max_tokens: int, batch_size: int,
                     pad_id: int) -> dict[str, Any]:
    def batch_generate(batch: list[list[int]], n: int) -> list[list[int]]:
        width = max(map(len, batch))
        input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, ids in enumerate(batch):  # left padding
            input_ids[row, width - len(ids):] = torch.tensor(ids)
            mask[row, width - len(ids):] = 1
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=mask, do_sample=False,
                                 max_new_tokens=n, min_new_tokens=n, pad_token_id=pad_id)
        return out[:, width:].tolist()

    batch_generate(prompt_ids[:2], 4)  # warm-up
    t0 = time.perf_counter()
    tokens: list[list[int]] = []
    for i in range(0, len(prompt_ids), batch_size):
        tokens += batch_generate(prompt_ids[i:i + batch_size], max_tokens)
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "output_tokens": sum(map(len, tokens)), "token_ids": tokens}


def _agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    """How many greedy sequences are identical, and the mean length of the common prefix."""
    same = sum(x == y for x, y in zip(a, b))
    prefixes = []
    for x, y in zip(a, b):
        k = 0
        while k < min(len(x), len(y)) and x[k] == y[k]:
            k += 1
        prefixes.append(k)
    return {"identical_sequences": same, "num_sequences": len(a),
            "mean_common_prefix_tokens": round(sum(prefixes) / max(len(prefixes), 1), 1)}


# ----------------------------------------------------------------- main
def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hf_compare",
                                     description="tokenmill vs transformers generate, output tokens/s, one run.")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt (EOS ignored)")
    parser.add_argument("--batch-size", type=int, default=32, help="transformers static batch size")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="tokenmill model name (the default model's GGUF "
                        "is also what transformers loads)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument("--hf-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="transformers' dtype (auto: bf16 on hosts with a bf16 unit, else fp32)")
    parser.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                        help="before each measurement, wait up to this long for other processes to go quiet")
    parser.add_argument("--output-json", type=Path, default=None, help="also write the results here")
    record.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.num_prompts < 2 or args.max_tokens < 1 or args.batch_size < 1:
        parser.error("need --num-prompts >= 2, --max-tokens >= 1, --batch-size >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)

    from engine import LLM
    from engine.host import Host
    from engine.weights import default_gguf_path

    host = Host.current()
    hf_dtype = getattr(torch, host.auto_dtype() if args.hf_dtype == "auto" else args.hf_dtype)
    print(f"host: {host.describe()}", flush=True)
    print(f"tokenmill vs transformers: {args.num_prompts} prompts x {args.max_tokens} new tokens, greedy, "
          f"ignore_eos; torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs", flush=True)
    load_start = machine_load()
    print(f"machine at start: {_fmt_load(load_start)}", flush=True)

    t0 = time.perf_counter()
    llm = LLM(args.model)
    tm_load_s = time.perf_counter() - t0
    texts = load_prompt_texts(args.num_prompts)
    prompt_ids = [llm.tokenizer.encode(t) for t in texts]
    lens = [len(p) for p in prompt_ids]
    print(f"prompts: {sum(lens)} tokens, {min(lens)}-{max(lens)} per prompt (mean {sum(lens) / len(lens):.0f})",
          flush=True)

    from benchmarks.throughput import load_hf_model  # the dense folder: a GGUF load computes in fp32 whatever dtype

    gguf = Path(default_gguf_path())
    t0 = time.perf_counter()
    hf_model = load_hf_model(hf_dtype)
    hf_model.eval()
    hf_load_s = time.perf_counter() - t0
    pad_id = hf_model.generation_config.pad_token_id
    if pad_id is None:
        pad_id = 0  # <|endoftext|>; masked out anyway

    results: dict[str, dict[str, Any]] = {}
    load_tm = wait_for_quiet(args.wait_quiet)
    print(f"before tokenmill: {_fmt_load(load_tm)}", flush=True)
    meter = BusyMeter().start()
    results["tokenmill"] = run_tokenmill(llm, prompt_ids, args.max_tokens)
    results["tokenmill"].update(load_s=tm_load_s, machine_load=load_tm, other_busy_during=meter.stop())
    print(f"  tokenmill: {results['tokenmill']['wall_s']:.1f} s", flush=True)

    load_hf = wait_for_quiet(args.wait_quiet)
    print(f"before transformers: {_fmt_load(load_hf)}", flush=True)
    meter = BusyMeter().start()
    results["transformers"] = run_transformers(hf_model, prompt_ids, args.max_tokens, args.batch_size, pad_id)
    results["transformers"].update(load_s=hf_load_s, machine_load=load_hf, other_busy_during=meter.stop())
    print(f"  transformers: {results['transformers']['wall_s']:.1f} s", flush=True)

    for r in results.values():
        r["output_tok_s"] = r["output_tokens"] / r["wall_s"]
        r["total_tok_s"] = (r["output_tokens"] + sum(lens)) / r["wall_s"]
    agree = _agreement(results["tokenmill"]["token_ids"], results["transformers"]["token_ids"])
    ratio = results["tokenmill"]["output_tok_s"] / results["transformers"]["output_tok_s"]

    names = {"tokenmill": f"tokenmill LLM.generate ({str(llm.dtype).removeprefix('torch.')})",
             "transformers": f"transformers generate ({str(hf_dtype).removeprefix('torch.')}, batch {args.batch_size})"}
    print()
    def cores(x: Optional[float]) -> str:
        return "n/a" if x is None else f"{x:.2f}"

    print(f"{'engine':<34} {'out tokens':>10} {'wall s':>8} {'out tok/s':>10} {'in+out tok/s':>13} "
          f"{'load 1m':>8} {'busy before':>11} {'busy during':>11} {'model load s':>13}")
    for key, r in results.items():
        print(f"{names[key]:<34} {r['output_tokens']:>10} {r['wall_s']:>8.1f} {r['output_tok_s']:>10.1f} "
              f"{r['total_tok_s']:>13.1f} {r['machine_load']['loadavg_1m']:>8.2f} "
              f"{cores(r['machine_load']['other_busy_cores']):>11} {cores(r['other_busy_during']):>11} "
              f"{r['load_s']:>13.1f}")
    print("(busy before/during: cores of this machine kept busy by other processes; 'load 1m' is os.getloadavg)")
    print(f"\nratio tokenmill / transformers (output tok/s): {ratio:.2f}x")
    print(f"greedy agreement: {agree['identical_sequences']}/{agree['num_sequences']} sequences identical, "
          f"mean common prefix {agree['mean_common_prefix_tokens']} of {args.max_tokens} tokens")
    print(f"torch threads: {torch.get_num_threads()}")
    busiest = max(max(r["machine_load"]["other_busy_cores"] or 0.0, r["other_busy_during"] or 0.0)
                  for r in results.values())
    warn_if_busy(busiest)

    if record.output_path(args, "hf_compare"):
        report = {
            "num_prompts": args.num_prompts, "max_tokens": args.max_tokens, "batch_size": args.batch_size,
            "model": args.model, "gguf": str(gguf), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(), "host": host.as_dict(),
            "hf_dtype": str(hf_dtype).removeprefix("torch."), "tokenmill_dtype": str(llm.dtype).removeprefix("torch."),
            "prompt_tokens": sum(lens), "prompt_tokens_min": min(lens), "prompt_tokens_max": max(lens),
            "machine_load_start": load_start, "ratio_output_tok_s": ratio, "agreement": agree,
            "results": {k: {kk: vv for kk, vv in v.items() if kk != "token_ids"} for k, v in results.items()},
        }
        write_json_report(record.output_path(args, "hf_compare"), report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
