"""Benchmark workloads built from real text, deterministic from a seed.

Workloads (issues 5 and 12), all as token ids so that every engine measured gets
exactly the same prompts, and with fixed output lengths (``ignore_eos``) so
that every engine does the same work:

- ``labelling``: a shared instruction of about 400 tokens (the labelling
  instruction of ``data/labelling.parquet`` plus few-shot examples, each a
  docstring and its topic), then one item of 50-150 tokens (a docstring the
  few-shot part does not use), 16 output tokens, greedy. Every prompt shares
  the instruction, so prefix caching serves it after the first request.
- ``synthetic``: short seed prompts of 20-60 tokens (an instruction and the
  start of a docstring), 256 output tokens, sampled at temperature 0.8 with a
  per-request seed.
- ``random``: input lengths uniform in [64, 512] and output lengths uniform in
  [32, 256] (vLLM ``bench throughput``'s random dataset), greedy. The prompt
  text is a window of the right length at a random offset of a stream of real
  text (all docstrings of ``data/`` and the licence texts in
  ``/usr/share/common-licenses`` when present), not random token ids.

Two fixed shapes (issue 12), the work the llama.cpp comparison was first
measured on, from the same text stream as ``random`` (raw text, no chat
template, greedy, EOS ignored):

- ``in99-out64``: 64 prompts of 90-108 tokens (about 99 on average), 64 new
  tokens each: prefill and decode both matter.
- ``in45-out256``: 32 prompts of 40-50 tokens (about 45), 256 new tokens each:
  decode-heavy, 32 sequences decoding together for most of the run.

Text sources: CPython 3.11 standard-library docstrings (PSF licence; see
``data/README.md``) and the licence texts shipped with the OS. Lengths are
counted with the engine's tokenizer (SmolLM2's by default).

Usage::

    from engine.tokenizer import Tokenizer
    wl = build_workload("random", Tokenizer.default(), num_prompts=64, seed=0)
    wl.prompt_token_ids, wl.output_lens, wl.sampling_params()
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
LICENSE_DIR = Path("/usr/share/common-licenses")
WORKLOADS = ("labelling", "synthetic", "synthetic-greedy", "random", "in99-out64", "in45-out256")

# Spec of each workload: token ranges and defaults (issue 5).
LABELLING_PREFIX_TOKENS = 400  # "about 400": built to within [385, 420]
LABELLING_ITEM_RANGE = (50, 150)
LABELLING_OUTPUT = 16
SYNTHETIC_PROMPT_RANGE = (20, 60)
SYNTHETIC_OUTPUT = 256
SYNTHETIC_TEMPERATURE = 0.8
RANDOM_INPUT_RANGE = (64, 512)
RANDOM_OUTPUT_RANGE = (32, 256)
# Fixed shapes (issue 12): name -> (prompts, prompt token range, new tokens per prompt)
FIXED_SHAPES = {"in99-out64": (64, (90, 108), 64), "in45-out256": (32, (40, 50), 256)}
DEFAULT_NUM_PROMPTS = {"labelling": 128, "synthetic": 32, "synthetic-greedy": 32, "random": 64,
                       **{n: s[0] for n, s in FIXED_SHAPES.items()}}
QUICK_NUM_PROMPTS = {"labelling": 16, "synthetic": 4, "synthetic-greedy": 4, "random": 8, "in99-out64": 8,
                     "in45-out256": 4}
QUICK_MAX_OUTPUT = 32  # --quick caps every output length at this


@dataclass
class Workload:
    """A list of requests as token ids with their output lengths and sampling settings.

    Attributes:
        name: one of WORKLOADS.
        prompt_token_ids: one list of token ids per request.
        output_lens: new tokens per request (generated exactly: ignore_eos).
        temperature: 0.0 is greedy; otherwise sampled with top_p = 1, no top_k.
        seed: the seed the workload was built from (also seeds sampling).
        shared_prefix_tokens: tokens every prompt starts with (0 if none).
        ignore_eos: keep generating past EOS, so every engine produces output_lens tokens.
    """

    name: str
    prompt_token_ids: list[list[int]]
    output_lens: list[int]
    temperature: float
    seed: int
    shared_prefix_tokens: int = 0
    ignore_eos: bool = True
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def num_requests(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_input_tokens(self) -> int:
        return sum(len(p) for p in self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Output tokens requested (= generated, since EOS is ignored)."""
        return sum(self.output_lens)

    def request_seed(self, i: int) -> int:
        """Sampling seed of request i (the same for every engine that takes a seed)."""
        return (self.seed * 1_000_003 + i) & 0x7FFFFFFF

    def sampling_params(self) -> list[Any]:
        """One tokenmill `SamplingParams` per request."""
        from engine import SamplingParams

        return [
            SamplingParams(temperature=self.temperature, top_p=1.0, top_k=-1, max_tokens=n,
                           ignore_eos=self.ignore_eos,
                           seed=None if self.temperature == 0.0 else self.request_seed(i))
            for i, n in enumerate(self.output_lens)
        ]

    def summary(self) -> str:
        lens = [len(p) for p in self.prompt_token_ids]
        return (f"{self.name}: {self.num_requests} requests, input {min(lens)}-{max(lens)} tokens "
                f"(total {self.num_input_tokens}, shared prefix {self.shared_prefix_tokens}), output "
                f"{min(self.output_lens)}-{max(self.output_lens)} tokens (total {self.num_output_tokens}), "
                f"{'greedy' if self.temperature == 0 else f'temperature {self.temperature}'}, seed {self.seed}")


# ------------------------------------------------------------------ text sources
def _read_rows(name: str) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    return pq.read_table(DATA_DIR / name).to_pylist()


def _labelling_parts() -> tuple[str, list[tuple[str, str, str]]]:
    """The shared instruction, and (title, docstring, label) of each labelling row."""
    rows = _read_rows("labelling.parquet")
    instruction = rows[0]["prompt"].split("\n\n", 1)[0]
    items = []
    for r in rows:
        body = r["prompt"].split("\n\n", 1)[1]  # "Docstring of <title>:\n<text>"
        text = body.split("\n", 1)[1] if "\n" in body else body
        items.append((r["title"], text, r["reference_label"]))
    return instruction, items


def _synthetic_parts() -> tuple[str, list[tuple[str, str]]]:
    """The synthetic-data instruction, and (title, first paragraph) of each synthetic row."""
    rows = _read_rows("synthetic.parquet")
    instruction = rows[0]["prompt"].split("\n\n", 1)[0]
    seeds = []
    for r in rows:
        body = r["prompt"].split("\n\n", 1)[1]  # "<title>: <paragraph>"
        seeds.append((r["title"], body.split(": ", 1)[1] if ": " in body else body))
    return instruction, seeds


def real_text_documents() -> list[str]:
    """All texts the workloads draw from, in a fixed order: docstrings, then licence texts."""
    _, items = _labelling_parts()
    _, seeds = _synthetic_parts()
    docs = [f"{t}\n{text}" for t, text, _ in items] + [f"{t}: {text}" for t, text in seeds]
    if LICENSE_DIR.is_dir():
        for p in sorted(LICENSE_DIR.iterdir()):
            if p.is_file():
                docs.append(p.read_text(errors="replace"))
    return docs


# ------------------------------------------------------------------ builders
def build_labelling(tokenizer: Any, num_prompts: int, seed: int = 0,
                    max_output_tokens: Optional[int] = None) -> Workload:
    """Shared ~400-token few-shot instruction + an item of 50-150 tokens; 16 output tokens, greedy."""
    rng = random.Random(seed)
    instruction, items = _labelling_parts()
    order = list(range(len(items)))
    rng.shuffle(order)
    # few-shot examples from the front of the shuffled order, until the prefix is about 400 tokens
    prefix_text = instruction + "\n\nExamples:\n\n"
    closing = "Now label this one.\n\n"
    shots: list[int] = []
    lo, hi = LABELLING_PREFIX_TOKENS - 15, LABELLING_PREFIX_TOKENS + 20
    for idx in order:
        title, text, label = items[idx]
        cand = prefix_text + f"Docstring of {title}:\n{text}\nTopic: {label}\n\n"
        n = len(tokenizer.encode(cand + closing))
        if n > hi:  # too long to fit: try a shorter example
            continue
        prefix_text = cand
        shots.append(idx)
        if n >= lo:
            break
    prefix = tokenizer.encode(prefix_text + closing)
    if len(prefix) < lo:  # no whole example fits: end with one cut to reach about 400 tokens
        idx = next(i for i in order if i not in shots)
        title, text, label = items[idx]
        head = tokenizer.encode(prefix_text + f"Docstring of {title}:\n")
        tail = tokenizer.encode(f" ...\nTopic: {label}\n\n{closing}")
        prefix = head + tokenizer.encode(text)[: max(0, LABELLING_PREFIX_TOKENS - len(head) - len(tail))] + tail
        shots.append(idx)
    used = set(shots)
    pool = [i for i in order if i not in used]
    lo_item, hi_item = LABELLING_ITEM_RANGE
    suffix = tokenizer.encode("\nTopic:")
    item_ids: list[list[int]] = []
    for k in range(num_prompts):
        title, text, _ = items[pool[k % len(pool)]]
        # "Item k" keeps prompts distinct when the pool is cycled (no whole-prompt cache hits)
        head = tokenizer.encode(f"Item {k + 1}. Docstring of {title}:\n")
        body = tokenizer.encode(text)
        room = hi_item - len(head) - len(suffix)
        ids = head + body[:room] + suffix
        while len(ids) < lo_item:  # too short: continue with the next docstring's text
            ids = ids[:-len(suffix)] + tokenizer.encode(" " + items[pool[(k + 1) % len(pool)]][1])
            ids = ids[: hi_item - len(suffix)] + suffix
        item_ids.append(ids)
    out = LABELLING_OUTPUT if max_output_tokens is None else min(LABELLING_OUTPUT, max_output_tokens)
    return Workload("labelling", [prefix + ids for ids in item_ids], [out] * num_prompts, 0.0, seed,
                    shared_prefix_tokens=len(prefix),
                    notes={"prefix_tokens": len(prefix), "few_shot_examples": len(shots)})


def build_synthetic(tokenizer: Any, num_prompts: int, seed: int = 0,
                    max_output_tokens: Optional[int] = None) -> Workload:
    """Seed prompts of 20-60 tokens, 256 output tokens at temperature 0.8."""
    rng = random.Random(seed)
    _, seeds = _synthetic_parts()
    _, items = _labelling_parts()
    texts = [(t, x) for t, x in seeds] + [(t, x) for t, x, _ in items]
    lo, hi = SYNTHETIC_PROMPT_RANGE
    prompts = []
    for _ in range(num_prompts):
        title, text = texts[rng.randrange(len(texts))]
        target = rng.randint(lo, hi)
        ids = tokenizer.encode(f"Write a short tip for a Python beginner about {title}: {text}")
        while len(ids) < target:  # pad with more real text
            ids += tokenizer.encode(" " + texts[rng.randrange(len(texts))][1])
        prompts.append(ids[:target])
    out = SYNTHETIC_OUTPUT if max_output_tokens is None else min(SYNTHETIC_OUTPUT, max_output_tokens)
    return Workload("synthetic", prompts, [out] * num_prompts, SYNTHETIC_TEMPERATURE, seed)


def _text_stream(tokenizer: Any) -> list[int]:
    """All of `real_text_documents` tokenised and concatenated, in order."""
    stream: list[int] = []
    for ids in tokenizer.encode_batch(real_text_documents()):
        stream += ids
    return stream


def _windows(stream: list[int], rng: random.Random, num: int, length_range: tuple[int, int]) -> list[list[int]]:
    """`num` windows of `stream`, each of a length uniform in `length_range` at a uniform offset."""
    lo, hi = length_range
    if len(stream) < hi:
        raise RuntimeError(f"only {len(stream)} tokens of text found; need {hi}")
    out = []
    for _ in range(num):
        n = rng.randint(lo, hi)
        start = rng.randrange(len(stream) - n + 1)
        out.append(stream[start:start + n])
    return out


def build_random(tokenizer: Any, num_prompts: int, seed: int = 0,
                 max_output_tokens: Optional[int] = None) -> Workload:
    """Windows of real text, input uniform in [64, 512] tokens, output uniform in [32, 256], greedy."""
    rng = random.Random(seed)
    stream = _text_stream(tokenizer)
    olo, ohi = RANDOM_OUTPUT_RANGE
    prompts, outs = [], []
    for _ in range(num_prompts):  # one prompt, then its output length: the order seeds have always drawn in
        prompts += _windows(stream, rng, 1, RANDOM_INPUT_RANGE)
        o = rng.randint(olo, ohi)
        outs.append(o if max_output_tokens is None else min(o, max_output_tokens))
    return Workload("random", prompts, outs, 0.0, seed, notes={"text_stream_tokens": len(stream)})


def _fixed_shape_builder(name: str) -> Any:
    """The builder of one FIXED_SHAPES workload: windows of real text, a fixed output length, greedy."""
    _, length_range, output = FIXED_SHAPES[name]

    def build(tokenizer: Any, num_prompts: int, seed: int = 0, max_output_tokens: Optional[int] = None) -> Workload:
        rng = random.Random(f"{name}/{seed}")  # its own draws: no window shared with `random` or the other shape
        stream = _text_stream(tokenizer)
        out = output if max_output_tokens is None else min(output, max_output_tokens)
        return Workload(name, _windows(stream, rng, num_prompts, length_range), [out] * num_prompts, 0.0, seed,
                        notes={"text_stream_tokens": len(stream), "prompt_range": list(length_range)})

    build.__doc__ = (f"{FIXED_SHAPES[name][0]} (default) windows of real text of {length_range[0]}-{length_range[1]} "
                     f"tokens, {output} new tokens each, greedy.")
    return build


def build_synthetic_greedy(tokenizer: Any, num_prompts: int, seed: int = 0,
                           max_output_tokens: Optional[int] = None) -> Workload:
    """`synthetic`'s prompts and output lengths, decoded greedily."""
    wl = build_synthetic(tokenizer, num_prompts, seed, max_output_tokens)
    return Workload("synthetic-greedy", wl.prompt_token_ids, wl.output_lens, 0.0, seed)


_BUILDERS = {"labelling": build_labelling, "synthetic": build_synthetic, "synthetic-greedy": build_synthetic_greedy,
             "random": build_random,
             **{name: _fixed_shape_builder(name) for name in FIXED_SHAPES}}


def build_workload(name: str, tokenizer: Any, num_prompts: Optional[int] = None, seed: int = 0,
                   quick: bool = False, max_output_tokens: Optional[int] = None) -> Workload:
    """Build a named workload.

    Args:
        name: one of WORKLOADS.
        tokenizer: anything with `encode(str) -> list[int]` and `encode_batch`.
        num_prompts: requests; default DEFAULT_NUM_PROMPTS (QUICK_NUM_PROMPTS with `quick`).
        seed: the same seed gives the same token ids.
        quick: fewer prompts and outputs capped at QUICK_MAX_OUTPUT tokens.
        max_output_tokens: cap on every output length (overrides the quick cap).
    Raises:
        ValueError: unknown name or num_prompts < 1.
    """
    if name not in _BUILDERS:
        raise ValueError(f"unknown workload {name!r}; known: {list(WORKLOADS)}")
    if num_prompts is None:
        num_prompts = (QUICK_NUM_PROMPTS if quick else DEFAULT_NUM_PROMPTS)[name]
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    if max_output_tokens is None and quick:
        max_output_tokens = QUICK_MAX_OUTPUT
    return _BUILDERS[name](tokenizer, num_prompts, seed, max_output_tokens)


def parse_workloads(spec: str) -> list[str]:
    """'all' or a comma-separated list of workload names."""
    names = list(WORKLOADS) if spec == "all" else [s.strip() for s in spec.split(",") if s.strip()]
    bad = [n for n in names if n not in WORKLOADS]
    if bad or not names:
        raise ValueError(f"unknown workload(s) {bad}; choose from {list(WORKLOADS)} or 'all'")
    return names


def describe(workloads: Sequence[Workload]) -> str:
    return "\n".join(w.summary() for w in workloads)
