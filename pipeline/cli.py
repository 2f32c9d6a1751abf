"""The `tokenmill` command.

    tokenmill run --input URL --output URL [--spec job.yaml] [JobSpec options]
    tokenmill demo [--job labelling|synthetic] [JobSpec options]
    tokenmill report URL [--all]

Every JobSpec field is an option in kebab case (`--max-tokens`,
`--system-prompt`, `--shard-size`, `--price-per-hour`, ...); booleans take
`--x/--no-x`; `--stop` repeats; dict fields take KEY=VALUE pairs
(`--storage-option endpoint_url=http://...`, `--engine-option block_size=32`,
`--sampling-option min_tokens=2`, VALUE parsed as JSON when it can be).
Options override the fields of a `--spec` YAML/JSON file.

Exit codes: 0 done, 1 bad input or failure, 2 the output holds a job with
another spec (pass --overwrite).
"""
from __future__ import annotations

import argparse
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any, Optional, Sequence

from pydantic import ValidationError

from pipeline.cost import format_report
from pipeline.job import JobSpec, JobSpecChanged, read_metrics, run_job

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
DEMO_JOBS: dict[str, dict[str, Any]] = {
    # one-word topic labels: a few tokens each, greedy
    "labelling": {"input": str(DATA_DIR / "labelling.parquet"), "max_tokens": 8, "temperature": 0.0,
                  "shard_size": 64},
    # short seeds, longer generations (each row sets its own max_tokens), sampled
    "synthetic": {"input": str(DATA_DIR / "synthetic.parquet"), "max_tokens": 64, "temperature": 0.8,
                  "top_p": 0.95, "shard_size": 16},
}
DEMO_OUTPUT = "demo_output"

_DICT_FLAGS = {"storage_options": "storage-option", "engine_options": "engine-option",
               "sampling_options": "sampling-option"}


def _kv(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    key, value = text.split("=", 1)
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def _scalar_type(annotation: Any) -> Any:
    """int/float/str for a field annotation (Optional[...] unwrapped)."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if args and typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return args[0]
    return annotation


def add_spec_options(parser: argparse.ArgumentParser, required: Sequence[str] = ()) -> None:
    """Add one option per JobSpec field (kebab case); unset options stay None (not given)."""
    parser.add_argument("--spec", help="YAML or JSON file of JobSpec fields; options below override it")
    for name, field in JobSpec.model_fields.items():
        help_text = field.description or ""
        if name in _DICT_FLAGS:
            parser.add_argument(f"--{_DICT_FLAGS[name]}", dest=name, type=_kv, action="append", metavar="KEY=VALUE",
                                help=help_text)
            continue
        flag = "--" + name.replace("_", "-")
        base = _scalar_type(field.annotation)
        if base is bool:
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif name == "stop":
            parser.add_argument(flag, dest=name, action="append", metavar="TEXT", help=help_text + " (repeatable)")
        else:
            typ = base if base in (int, float) else str
            default = None if field.is_required() else field.default
            shown = f" (default {default})" if default is not None else ""
            parser.add_argument(flag, dest=name, type=typ, default=None, help=help_text + shown)


def spec_from_args(args: argparse.Namespace, base: Optional[dict[str, Any]] = None) -> JobSpec:
    """JobSpec from (defaults) <- `base` <- --spec file <- the options given on the command line."""
    fields: dict[str, Any] = dict(base or {})
    if getattr(args, "spec", None):
        from pipeline.job import load_spec_file

        fields.update(load_spec_file(args.spec)[0])
    for name in JobSpec.model_fields:
        value = getattr(args, name, None)
        if value is None:
            continue
        if name in _DICT_FLAGS:
            value = {**fields.get(name, {}), **dict(value)}
        fields[name] = value
    return JobSpec(**fields)


def _print_report(row: dict, out: Any = None) -> None:
    out = out or sys.stdout
    print("\ncost report", file=out)
    print(format_report(row), file=out)


def _run(spec: JobSpec) -> int:
    try:
        report = run_job(spec)
    except JobSpecChanged as exc:
        print(f"tokenmill: {exc}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError) as exc:
        print(f"tokenmill: {exc}", file=sys.stderr)
        return 1
    _print_report(report.as_row())
    print(f"\noutputs: {spec.output}/part-*.parquet   metrics: {spec.output}/_job/metrics.parquet")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    spec = spec_from_args(args)
    return _run(spec)


def cmd_demo(args: argparse.Namespace) -> int:
    job = DEMO_JOBS[args.job]
    base = {**job, "output": f"{DEMO_OUTPUT}/{args.job}", "overwrite": True}
    spec = spec_from_args(args, base)
    if not Path(spec.input).exists():
        print(f"tokenmill: demo data {spec.input} is missing (run from a checkout of tokenmill)", file=sys.stderr)
        return 1
    print(f"tokenmill demo: {args.job} job, {spec.input} -> {spec.output}, model {spec.model}")
    return _run(spec)


def cmd_report(args: argparse.Namespace) -> int:
    storage = dict(args.storage_options or [])
    try:
        metrics = read_metrics(args.url, storage)
    except FileNotFoundError as exc:
        print(f"tokenmill: {exc}", file=sys.stderr)
        return 1
    rows = metrics.to_dicts()
    if args.all:
        for i, row in enumerate(rows):
            print(f"\nrun {i + 1} of {len(rows)}")
            print(format_report(row))
    else:
        print(f"job at {args.url}: {len(rows)} run(s); the latest:")
        print(format_report(rows[-1]))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description="Offline batch LLM inference: Parquet in, "
                                     "generations and a cost report out.")
    sub = parser.add_subparsers(dest="command", required=True)
    p_run = sub.add_parser("run", help="run a job (resumes a killed one; --overwrite replaces a changed one)")
    add_spec_options(p_run)
    p_run.set_defaults(func=cmd_run)
    p_demo = sub.add_parser("demo", help=f"run a bundled sample job into ./{DEMO_OUTPUT}/ and print the report")
    p_demo.add_argument("--job", choices=sorted(DEMO_JOBS), default="labelling", help="which sample job")
    add_spec_options(p_demo)
    p_demo.set_defaults(func=cmd_demo)
    p_rep = sub.add_parser("report", help="print the cost report of a finished job")
    p_rep.add_argument("url", help="the job's output URL")
    p_rep.add_argument("--all", action="store_true", help="every run, not just the latest")
    p_rep.add_argument("--storage-option", dest="storage_options", type=_kv, action="append", metavar="KEY=VALUE")
    p_rep.set_defaults(func=cmd_report)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "run" and not args.spec and (args.input is None or args.output is None):
        build_parser().error("run needs --input and --output (or a --spec file that sets them)")
    try:
        return args.func(args)
    except ValidationError as exc:
        print(f"tokenmill: invalid job options:\n{exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
