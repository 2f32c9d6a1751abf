"""Build tokenmill's sample datasets from the Python standard library's docstrings.

The text is CPython's own documentation (docstrings of public functions,
classes and methods of the standard library), as shipped with the Python
interpreter that runs this script; nobody in this project wrote it. It is
distributed under the PSF License Agreement (see data/README.md).

Two jobs are written:

- ``labelling.parquet``: each row asks the model to label one docstring with
  one of six topics. Every prompt starts with the same instruction (a shared
  prefix, so the prefix cache and the planner have something to find),
  followed by the docstring (without its doctest examples), cut to at most ``MAX_CHARS`` characters at a word
  boundary (about 50-150 tokens). Columns: ``id``, ``prompt``, ``source``,
  ``module``, ``title`` and ``reference_label`` (the topic of the module the
  docstring comes from; a pass-through column for scoring the answers).
- ``synthetic.parquet``: short seed prompts for a synthetic-data job (one
  shared instruction plus the first line of a docstring), with a per-row
  ``max_tokens`` override.

The output is deterministic for a given Python version (the docstrings change
between Python releases): rows are chosen in sorted order and shuffled with a
fixed seed. Run with the project's virtualenv::

    .venv/bin/python data/build_samples.py            # writes data/*.parquet
    .venv/bin/python data/build_samples.py --check    # rebuilds and compares
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import platform
import random
import re
import sys
from pathlib import Path
from typing import Iterator

import pyarrow as pa
import pyarrow.parquet as pq

DATA_DIR = Path(__file__).resolve().parent

# Topic -> standard-library modules whose docstrings carry that topic.
TOPICS: dict[str, list[str]] = {
    "files": ["shutil", "pathlib", "tempfile", "zipfile", "tarfile", "io", "filecmp", "glob"],
    "network": ["socket", "urllib.request", "urllib.parse", "http.client", "http.server",
                "ftplib", "smtplib", "ipaddress", "ssl"],
    "text": ["difflib", "textwrap", "re", "unicodedata", "string", "html", "html.parser"],
    "math": ["statistics", "math", "random", "decimal", "cmath"],
    "concurrency": ["asyncio", "threading", "concurrent.futures", "queue", "sched"],
    "data": ["json", "pickle", "sqlite3", "collections", "base64", "csv", "bisect", "heapq"],
}
LABELS = list(TOPICS)

ROWS_PER_LABEL = 28          # 6 labels x 28 = 168 labelling rows
SYNTHETIC_ROWS = 30
SYNTHETIC_MAX_TOKENS = 64
SEED_MAX_CHARS = 240         # a synthetic seed is the docstring's first paragraph, cut here
MIN_CHARS = 200              # docstrings shorter than this are skipped
MAX_CHARS = 400              # longer ones are cut at a word boundary
SEED = 20261130

INSTRUCTION = (
    "You are labelling documentation from the Python standard library. "
    "Read the docstring below and decide which topic it is mostly about. "
    "The topics are: " + ", ".join(LABELS) + ". "
    "Answer with a single word: the topic's name, in lower case, and nothing else.\n\n"
)

SYNTHETIC_INSTRUCTION = (
    "Write a short, friendly tip (two or three sentences) for a Python beginner "
    "about the function or class described below. Mention when it is useful.\n\n"
)


def _defined_in(obj: object, modname: str) -> bool:
    """True if ``obj`` belongs to ``modname`` (or its C accelerator ``_name`` or a submodule), not an import."""
    owner = getattr(obj, "__module__", None)
    return (owner is None or owner == modname or owner.startswith(modname + ".")
            or owner.lstrip("_") == modname.rsplit(".", 1)[-1])


def _members(module: object, modname: str) -> Iterator[tuple[str, object]]:
    """Public functions and classes defined in a module, and the public methods of those classes."""
    for name in sorted(vars(module)):
        if name.startswith("_"):
            continue
        obj = getattr(module, name)
        if not _defined_in(obj, modname):
            continue
        if inspect.isfunction(obj) or inspect.isbuiltin(obj):
            yield f"{modname}.{name}", obj
        elif inspect.isclass(obj):
            yield f"{modname}.{name}", obj
            for attr in sorted(vars(obj)):
                if attr.startswith("_"):
                    continue
                raw = vars(obj)[attr]
                if (inspect.isfunction(raw) or inspect.ismethoddescriptor(raw)
                        or isinstance(raw, (classmethod, staticmethod))):
                    yield f"{modname}.{name}.{attr}", getattr(obj, attr)


def _clean(doc: str) -> str:
    """Normalise a docstring: drop doctest examples (from the first ``>>>`` line on),
    strip trailing spaces, collapse runs of blank lines."""
    lines = []
    for line in doc.strip().splitlines():
        if line.lstrip().startswith(">>>"):
            break
        lines.append(line.rstrip())
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


_SIGNATURE = re.compile(r"^[\w.]+\(.*\)\s*(-+>.*)?$")


def _first_paragraph(text: str) -> str:
    """The docstring's first paragraph on one line, skipping a C function's signature line."""
    paragraphs = [" ".join(p.split()) for p in text.split("\n\n") if p.strip()]
    prose = [p for p in paragraphs if not _SIGNATURE.match(p)]
    return (prose or paragraphs)[0]


def _truncate(text: str, limit: int) -> str:
    """Cut ``text`` to at most ``limit`` characters at a word boundary, marking the cut."""
    if len(text) <= limit:
        return text
    cut = text[:limit]
    space = max(cut.rfind(" "), cut.rfind("\n"))
    if space > limit // 2:
        cut = cut[:space]
    return cut.rstrip() + " ..."


def collect() -> dict[str, list[dict[str, str]]]:
    """Docstrings per topic, each topic's modules interleaved round-robin, duplicates dropped."""
    seen: set[str] = set()
    per_topic: dict[str, list[dict[str, str]]] = {}
    for label, modnames in TOPICS.items():
        queues: list[list[dict[str, str]]] = []
        for modname in modnames:
            module = importlib.import_module(modname)
            queue = []
            for title, obj in _members(module, modname):
                doc = inspect.getdoc(obj)
                if not doc:
                    continue
                doc = _clean(doc)
                if len(doc) < MIN_CHARS or doc in seen:
                    continue
                seen.add(doc)
                queue.append({"module": modname, "title": title, "text": doc, "label": label})
            queues.append(queue)
        interleaved = []
        while any(queues):
            for queue in queues:
                if queue:
                    interleaved.append(queue.pop(0))
        per_topic[label] = interleaved
    return per_topic


def build() -> tuple[pa.Table, pa.Table]:
    """Return the (labelling, synthetic) tables."""
    source = f"CPython {platform.python_version()} standard library docstrings"
    per_topic = collect()
    chosen, rest = [], []
    for label in LABELS:
        items = per_topic[label]
        if len(items) < ROWS_PER_LABEL:
            raise SystemExit(f"topic {label!r} has only {len(items)} docstrings, need {ROWS_PER_LABEL}")
        chosen += items[:ROWS_PER_LABEL]
        rest += items[ROWS_PER_LABEL:]
    rng = random.Random(SEED)
    rng.shuffle(chosen)

    labelling = {
        "id": [f"doc-{i:04d}" for i in range(len(chosen))],
        "prompt": [INSTRUCTION + f"Docstring of {it['title']}:\n" + _truncate(it["text"], MAX_CHARS)
                   for it in chosen],
        "source": [source] * len(chosen),
        "module": [it["module"] for it in chosen],
        "title": [it["title"] for it in chosen],
        "reference_label": [it["label"] for it in chosen],
    }

    # Synthetic seeds: docstrings not used for labelling, one topic after another.
    rest.sort(key=lambda it: it["title"])
    seeds = random.Random(SEED + 1).sample(rest, SYNTHETIC_ROWS)
    synthetic = {
        "id": [f"seed-{i:03d}" for i in range(len(seeds))],
        "prompt": [SYNTHETIC_INSTRUCTION + f"{it['title']}: " + _truncate(_first_paragraph(it["text"]), SEED_MAX_CHARS)
                   for it in seeds],
        "max_tokens": [SYNTHETIC_MAX_TOKENS] * len(seeds),
        "source": [source] * len(seeds),
        "title": [it["title"] for it in seeds],
    }
    labelling_schema = pa.schema([(name, pa.string()) for name in labelling])
    synthetic_schema = pa.schema([("id", pa.string()), ("prompt", pa.string()), ("max_tokens", pa.int32()),
                                  ("source", pa.string()), ("title", pa.string())])
    return (pa.Table.from_pydict(labelling, schema=labelling_schema),
            pa.Table.from_pydict(synthetic, schema=synthetic_schema))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DATA_DIR, help="output folder (default: data/)")
    parser.add_argument("--check", action="store_true",
                        help="rebuild and compare with the files in --out instead of writing")
    args = parser.parse_args(argv)
    if sys.version_info[:2] != (3, 11):
        print(f"warning: the committed files were built with Python 3.11; this is {platform.python_version()}",
              file=sys.stderr)
    tables = dict(zip(["labelling", "synthetic"], build()))
    status = 0
    for name, table in tables.items():
        path = args.out / f"{name}.parquet"
        if args.check:
            same = path.exists() and pq.read_table(path).equals(table)
            print(f"{path}: {'same' if same else 'DIFFERENT'} ({table.num_rows} rows)")
            status |= not same
        else:
            pq.write_table(table, path, compression="zstd")
            print(f"wrote {path}: {table.num_rows} rows, {path.stat().st_size} bytes")
    return status


if __name__ == "__main__":
    sys.exit(main())
