"""The C decoder driver against the Python layer loop, at batch 1, in one run.

    python -m benchmarks.decoder_driver [--schemes fp32,gguf,int8,w8a8] [--rounds 2] [--output-json F]

For each weight scheme, one engine (speculation and prefix caching off, one sequence at a
time) decodes the same 32-token prompt; a decode step's time is (wall with 65 new tokens -
wall with 1) / 64, the best of 3 runs each, measured with `LlamaModel.use_c_decoder` on and
off in alternating rounds (so drift in the machine's state hits both). Both paths run the
same kernels on the same buffers (their outputs are bit for bit equal, see
tests/test_cpu_decoder.py); the difference is the interpreter's dispatch between kernels.
The machine load is printed before and after each scheme.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any, Optional

from benchmarks import record
from benchmarks.hf_compare import _fmt_load, machine_load

PROMPT = [1 + (j * 7) % 900 for j in range(32)]


def step_ms(llm: Any, reps: int = 3) -> float:
    """Milliseconds of one batch-1 decode step (see the module docstring)."""
    from engine import SamplingParams

    def best(k: int) -> float:
        p = SamplingParams(temperature=0, max_tokens=k, ignore_eos=True)
        llm.generate([PROMPT], p, use_tqdm=False)
        b = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            llm.generate([PROMPT], p, use_tqdm=False)
            b = min(b, time.perf_counter() - t0)
        return b

    return 1e3 * (best(65) - best(1)) / 64


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.decoder_driver", description=__doc__.split("\n\n")[0])
    p.add_argument("--schemes", default="fp32,gguf,int8,w8a8")
    p.add_argument("--rounds", type=int, default=2, help="alternating on/off rounds per scheme")
    p.add_argument("--output-json", type=Path, default=None)
    record.add_arguments(p)
    args = p.parse_args(argv)
    from engine import LLM
    from engine.models.llama import LlamaModel

    results = []
    for scheme in [s.strip() for s in args.schemes.split(",") if s.strip()]:
        llm = LLM("smollm2-135m-instruct", speculative=None, enable_prefix_caching=False, max_num_seqs=1,
                  quantization=None if scheme == "fp32" else scheme)
        load0 = machine_load()
        on, off = [], []
        try:
            for _ in range(args.rounds):
                for flag, out in ((True, on), (False, off)):
                    LlamaModel.use_c_decoder = flag
                    out.append(step_ms(llm))
        finally:
            LlamaModel.use_c_decoder = True
        load1 = machine_load()
        r = {"scheme": scheme, "c_decoder_ms": on, "python_loop_ms": off, "ratio": min(off) / min(on),
             "used": llm.model._c_decoder is not None}
        results.append(r)
        print(f"{scheme:5}: C decoder {' '.join(f'{x:.2f}' for x in on)} ms/step, Python loop "
              f"{' '.join(f'{x:.2f}' for x in off)} ms/step: {r['ratio']:.2f}x (best of each); "
              f"before: {_fmt_load(load0)}; after: {_fmt_load(load1)}", flush=True)
        del llm
    record.write(record.output_path(args, "decoder_driver"), {"rows": results}, "decoder_driver")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
