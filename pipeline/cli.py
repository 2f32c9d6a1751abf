"""The `tokenmill` command.

    tokenmill run --input URL --output URL [--spec job.yaml] [JobSpec options]
    tokenmill run ... --cluster tcp://HOST:8786   (the Prefect flow, windows on a Dask cluster: `flows.cli`)
    tokenmill demo [--job labelling|synthetic] [JobSpec options]   (replaces its ./demo_output/JOB/: `pipeline.demo`)
    tokenmill demo --model gemma-3-270m   (a base model: few-shot labelling, beside the default model's accuracy)
    tokenmill report URL [--all]
    tokenmill convert SRC DST   (OpenAI Batch request JSONL <-> Parquet prompts; output JSONL -> Parquet: `pipeline.convert`)

Every JobSpec field is an option in kebab case (`--max-tokens`,
`--system-prompt`, `--shard-size`, `--price-per-hour`, ...); booleans take
`--x/--no-x`; `--stop` repeats; dict fields take KEY=VALUE pairs
(`--storage-option endpoint_url=http://...`, `--engine-option block_size=32`,
`--sampling-option min_tokens=2`, VALUE parsed as JSON when it can be).
Options override the fields of a `--spec` YAML/JSON file.

Errors print in a few lines naming what failed and what to do (`--verbose`
adds the traceback), after the run's booked cost row on stdout when the run had
started (headed `cost report (failed run: ...)`); a bad option value prints one line naming the option
as typed, in the engine's words where its rules have them (`tokenmill run: error: --max-tokens must be an
integer >= 1, got 0`; a --spec file's value by its file and line); another usage error prints `tokenmill
run: error: ...` and `see 'tokenmill run --help'` (not the usage); warnings print as `tokenmill: warning:
...`. Ctrl-C or
SIGTERM abandons the shards in flight (nothing partial is committed), books
the run's cost, prints that partial cost report on stdout (headed `cost report
(partial: ...)`) and one line on stderr; a second one exits at once.

Exit codes, one meaning each (a script may act on them):
    0    done
    1    refused or failed: a bad option or input (usage errors that argparse catches
         included: they exit 1, not argparse's usual 2), an output that cannot hold a job
         (a file, overlapping the input), a storage error, a failed run
    2    the output holds another job: a changed spec or input, or part files without a
         manifest; `--overwrite` replaces it (and only this refusal is fixed by it)
    3    another run holds the output's lease; wait, or let its lease expire
    4    done, but every row of the job is an error row (nothing generated): the job is complete and
         booked, and a re-run resumes nothing and exits 4 again; stderr names the most common error
         (or, when every row's error differs, how many there are and the first)
    130  interrupted by SIGINT (Ctrl-C); 143 by SIGTERM
    141  stdout's reader went away before everything was written (a pipe into a `head` that has
         exited), quietly (128 + SIGPIPE, as a shell reports a tool whose pipe closed); a reader
         that leaves after the first line (`tokenmill report OUT | head -1`) gives 141 too
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import traceback
import types
import typing
import warnings
from pathlib import Path
from typing import Any, Callable, Literal, Optional, Sequence

from pydantic import ValidationError

from pipeline.convert import add_parser as add_convert_parser
from pipeline.demo import DEMO_JOBS, DEMO_OUTPUT, other_output, overwrite_given, run_demo
from pipeline.cost import format_report
from pipeline.batch_files import result_names
from pipeline.bookkeeping import JobInterrupted, booked_report, read_metrics
from pipeline.commit import part_url
from pipeline.job import run_job
from pipeline.plan import done_shards
from pipeline.spec import ENGINE_FIELDS, InvalidOption, JobSpec, JobSpecChanged, spec_errors
from pipeline.lease import JobLocked, LeaseLost
from pipeline.storage import StorageError, plural, mask_secrets


_DICT_FLAGS = {"storage_options": "storage-option", "engine_options": "engine-option",
               "sampling_options": "sampling-option"}


def _kv(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    key, value = text.split("=", 1)
    try:
        return key, json.loads(value)
    except json.JSONDecodeError as e:
        if value.lstrip()[:1] in ("{", "["):  # meant as a JSON object or list: say why it is not one
            raise argparse.ArgumentTypeError(f"{key}={value}: not valid JSON ({e.msg} at character {e.pos})") \
                from None
        return key, value


def _scalar_type(annotation: Any) -> Any:
    """int/float/str for a field annotation (Optional[...] unwrapped)."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if args and typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return args[0]
    return annotation


def _choices(annotation: Any) -> Optional[list[str]]:
    """The allowed values of a Literal[...] field, else None."""
    if typing.get_origin(annotation) is Literal:
        return [str(a) for a in typing.get_args(annotation)]
    return None


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
            shown = f" (default {default})" if default is not None and "(default" not in help_text else ""
            choices = _choices(base)
            parser.add_argument(flag, dest=name, type=_option_type(flag, typ, choices), default=None, choices=choices,
                                help=help_text + shown)  # (the type refuses a value not in choices, in one line)


def _option_type(flag: str, typ: type, choices: Optional[list[str]]) -> Any:
    """An argparse `type` for an option: `typ(text)`, refused in the engine's words when it is not one
    (`--shard-size must be an integer, got 'x'`, `--plan must be prefix|input, got 'bogus'`), which the
    parser prints as one line (`_Parser.error`)."""
    def convert(text: str) -> Any:
        try:
            value = typ(text)
        except ValueError:
            kind = "an integer" if typ is int else "a number"
            raise argparse.ArgumentTypeError(f"{flag} must be {kind}, got {text!r}") from None
        if choices is not None and value not in choices:
            raise argparse.ArgumentTypeError(f"{flag} must be {'|'.join(choices)}, got {text!r}")
        return value

    convert.__name__ = typ.__name__
    return convert


class SpecError(ValueError):
    """Invalid job options, one line per problem (`problems`), each naming where the value came from:
    the option as typed (`--max-tokens must be an integer >= 1, got 0`) or the spec file, line and
    field (`job.yaml:4: max_tokens must be ...`)."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("invalid job options:\n  " + "\n  ".join(problems))
        self.problems = problems


def spec_from_args(args: argparse.Namespace, base: Optional[dict[str, Any]] = None) -> JobSpec:
    """JobSpec from (defaults) <- `base` <- --spec file <- the options given on the command line.

    A dict option (`--sampling-option` ...) merges key by key: a command-line key replaces the
    file's. A key given twice on the command line with two values, a `--sampling-option` that a
    flag of its own sets (`top_k=5` beside `--top-k`, or its default), and an `--engine-option`
    that repeats an engine flag given too (`max_num_seqs=4` and `--max-num-seqs 3`) are refused.

    Raises:
        SpecError: invalid fields or colliding options (each line names the file and line, or the
            option, it came from; a collision names both and the parameter).
        ValueError, FileNotFoundError: an unreadable --spec file (named).
    """
    fields: dict[str, Any] = dict(base or {})
    sources: dict[str, str] = {}
    key_sources: dict[str, dict[str, str]] = {}  # dict field -> key -> where it was set
    problems: list[str] = []
    lines: dict[str, int] = {}
    if getattr(args, "spec", None):
        from pipeline.spec import load_spec_file, spec_field_lines

        from_file = load_spec_file(args.spec)[0]
        lines = spec_field_lines(args.spec)
        fields.update(from_file)
        sources.update({k: str(args.spec) for k in from_file})
        for name in _DICT_FLAGS:
            if isinstance(from_file.get(name), dict):
                key_sources[name] = {k: str(args.spec) for k in from_file[name]}
    for name in JobSpec.model_fields:
        value = getattr(args, name, None)
        if value is None:
            continue
        if name in _DICT_FLAGS:
            given: dict[str, Any] = {}
            for key, v in value:
                if key in given and given[key] != v:
                    problems.append(f"--{_DICT_FLAGS[name]}: {key} is given twice ({_key_value(name, key, given[key])} "
                                    f"and {_key_value(name, key, v)}); give it once")
                given[key] = v
            value = {**fields.get(name, {}), **given}
            key_sources.setdefault(name, {}).update({k: "command line" for k in given})
        fields[name] = value
        sources[name] = "command line"
    try:
        spec = JobSpec(**fields)
    except ValidationError as exc:
        problems = spec_errors(exc, sources, flag_style=True, lines=lines) + problems
    else:
        problems += _collisions(spec, sources, key_sources)
    if problems:
        raise SpecError(problems)
    return spec


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _key_value(field: str, key: str, value: Any) -> str:
    """`key=value` as typed (a storage option's secret masked)."""
    if field == "storage_options":
        value = mask_secrets({key: value})[key]
    return f"{key}={_text(value)}"


def _where_key(field: str, key: str, value: Any, key_sources: dict[str, dict[str, str]]) -> str:
    """A dict option's key as its source spelt it: `--sampling-option top_k=5`, or
    `sampling_options.top_k: 5 in job.yaml`."""
    source = key_sources.get(field, {}).get(key)
    if source == "command line":
        return f"--{_DICT_FLAGS[field]} {_key_value(field, key, value)}"
    return f"{field}.{key}: {_text(value)}" + (f" in {source}" if source else "")


def _as_flag(name: str, value: Any) -> str:
    """A field's value as the command line takes it: `--top-k 3`, `--stop a --stop 'b c'` (--stop
    repeats), `--choice a,b`, `--no-progress`; a string that the shell would split or drop is quoted."""
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return flag if value else "--no-" + name.replace("_", "-")
    if name == "stop":
        values = value if isinstance(value, list) else [value]
        return " ".join(f"{flag} {shlex.quote(_text(v))}" for v in values)
    if isinstance(value, list):
        return f"{flag} {shlex.quote(','.join(_text(v) for v in value))}"
    return f"{flag} {shlex.quote(_text(value))}"


def _where_field(name: str, value: Any, sources: dict[str, str]) -> str:
    """A field as its source spelt it: `--top-k 3`, `top_k: 3 in job.yaml`."""
    source = sources.get(name)
    if source == "command line":
        return _as_flag(name, value)
    return f"{name}: {_text(value)}" + (f" in {source}" if source else "")


def _collisions(spec: JobSpec, sources: dict[str, str], key_sources: dict[str, dict[str, str]]) -> list[str]:
    """One line per dict option key that a field of its own sets too, naming both and the parameter."""
    lines = []
    for key, field in spec.sampling_option_clashes():
        mine = _where_key("sampling_options", key, spec.sampling_options[key], key_sources)
        value = getattr(spec, field)
        if field in sources:
            lines.append(f"{mine}: {key} is also set by {_where_field(field, value, sources)}; give it once")
        else:  # the field's default (or the demo job's value)
            flag = "--" + field.replace("_", "-")
            here = "not set here" if value in (None, [], "") else f"here {_text(value)}"
            given = spec.sampling_options[key]
            use = f"use {_as_flag(field, given)}"
            if field == "stop":  # an empty stop string is refused: never suggest one
                given = [v for v in (given if isinstance(given, list) else [given]) if v != ""]
                use = f"use {_as_flag(field, given)}" if given else f"use {flag} TEXT (an empty stop string is refused)"
            lines.append(f"{mine}: {key} has an option of its own, {flag} ({here}); {use}")
    for key, value in spec.engine_options.items():
        if key in ENGINE_FIELDS and key in sources and getattr(spec, key) != value:
            lines.append(f"{_where_key('engine_options', key, value, key_sources)}: {key} is also set by "
                         f"{_where_field(key, getattr(spec, key), sources)}; give it once")
    return lines


class StdoutClosed(Exception):
    """The reader of stdout went away before the command had written everything (a pipe into a `head`
    that has exited): the command ends quietly."""


def _echo(*parts: Any) -> None:
    """print() to stdout, flushed, so that a closed pipe is told here, as StdoutClosed, and never mistaken
    for another BrokenPipeError (a tensor-parallel worker's pipe, a socket).

    Raises:
        StdoutClosed: stdout is a pipe whose reader has closed it.
    """
    try:
        print(*parts, flush=True)
    except BrokenPipeError:
        raise StdoutClosed() from None


def _print_report(row: dict) -> None:
    _echo("\ncost report")
    _echo(format_report(row))


def _print_partial_report(exc: JobInterrupted) -> None:
    """The booked cost row of an interrupted run on stdout, headed as partial (a closed stdout is let be)."""
    try:
        _echo(f"\ncost report (partial: interrupted {exc.when}; counts are this run's committed shards, "
              f"discarded_completion_tokens the output it abandoned)")
        _echo(format_report(exc.report.as_row()))
    except StdoutClosed:
        _silence_stdout()


def _print_failed_report(exc: BaseException) -> None:
    """The booked cost row of a run that failed once it held the output on stdout, headed as failed (its
    error follows on stderr, from `main`); nothing when the run booked none (a closed stdout is let be)."""
    report = booked_report(exc)
    if report is None or report.status != "failed":
        return
    try:
        _echo("\ncost report (failed run: counts are this run's committed shards, discarded_completion_tokens the "
              "output it abandoned)")
        _echo(format_report(report.as_row()))
    except StdoutClosed:
        _silence_stdout()


ClusterRunner = Callable[[JobSpec], dict[str, Any]]
"""Runs a job with `spec.cluster` set (through the Prefect flow) and returns its cost report row:
`flows.cli.run_on_cluster`, which the `tokenmill` console script passes to `main`."""


def _run(spec: JobSpec, run_on_cluster: Optional[ClusterRunner] = None) -> int:
    """Run the job (on its cluster through `run_on_cluster`), print its report; returns the exit code.

    Raises:
        ValueError: `spec.cluster` is set and there is no `run_on_cluster` (`python -m pipeline`).
    """
    if spec.cluster and run_on_cluster is None:
        raise ValueError("--cluster runs the job through the Prefect flow, which `python -m pipeline` does not "
                         "import: use the tokenmill command (or python -m flows.cli)")
    try:
        row = run_on_cluster(spec) if spec.cluster else run_job(spec).as_row()
    except Exception as exc:  # a failed run: its booked row is printed as an interrupted run's is
        _print_failed_report(exc)
        raise
    _print_report(row)
    if row["rows_total"] == 0:
        _echo(f"\n0 rows in {spec.input}: nothing generated, no part files written   "
              f"metrics: tokenmill report {spec.output}")
    else:
        formats = _output_formats(spec, row)
        names = (["part-*.parquet"] if "parquet" in formats else []) + (
            ["results-*.jsonl", "errors-*.jsonl"] if "jsonl" in formats else [])
        out = spec.output.rstrip("/")
        _echo(f"\noutputs: {'  '.join(f'{out}/{n}' for n in names)}   metrics: tokenmill report {spec.output}")
    nothing = _every_row_an_error(spec, row)
    if nothing is not None:
        print(f"tokenmill: {nothing}", file=sys.stderr)
        return EXIT_ALL_ERRORS
    if row["rows_error"]:  # some rows failed, not all: said once, where a script's log keeps it
        ran = row["rows_ok"] + row["rows_error"]
        are = "is an error row" if row["rows_error"] == 1 else "are error rows"
        print(f"tokenmill: warning: {row['rows_error']} of this run's {plural(ran, 'row')} {are}; see "
              f"{_error_places(spec, _output_formats(spec, row))}", file=sys.stderr)
    return 0


def _output_formats(spec: JobSpec, row: dict[str, Any]) -> list[str]:
    """What the finished job wrote ("parquet", "jsonl"): its `output_format`, else jsonl for request files."""
    return (spec.output_format or ("jsonl" if row.get("request_counts") else "parquet")).split(",")


def _every_row_an_error(spec: JobSpec, row: dict[str, Any]) -> Optional[str]:
    """The stderr line for a finished job whose every row is an error row (this run's and the shards
    earlier runs committed), naming the most common error of its first part file, or, when each of that
    file's rows has an error of its own, how many and the first (with its id); None when any row of the
    job has a generation, or the job has no rows."""
    if row["rows_ok"] or not row["rows_total"]:
        return None
    import polars as pl

    from pipeline import io

    try:
        done = done_shards(spec)
    except StorageError:  # the job is done and booked: say nothing rather than fail it now
        return None
    if not done or any(r.counts.rows_ok for r in done.values()):
        return None
    rows = sum(r.counts.rows_error for r in done.values())
    formats = _output_formats(spec, row)
    part_name = f"part-{min(done):05d}.parquet"
    first = part_url(spec.model_copy(update={"output_format": ",".join(formats)}), part_name)
    # a job of request files writes its failed lines to errors-*.jsonl: name those (its part files, when it
    # writes no Parquet output, are only the commit's record under _job/parts/)
    jsonl_only = "parquet" not in formats
    name, unit = (result_names(part_name)[1], "line") if jsonl_only else (part_name, "row")
    id_column = "custom_id" if row.get("request_counts") else spec.id_column
    why = ""
    try:
        part = io.read_parquet(first, spec.storage_options).filter(pl.col("error").is_not_null())
        errors = part["error"]
        if errors.len():
            # errors alike but for the values they quote ("prompt must be a string, got int 5" and "... got
            # int 6"; "max_tokens 9000 does not fit ...: the prompt has 12 tokens" and "... has 15 tokens")
            # count as one: a column of the wrong type, or an option too large for every row, is one problem
            kinds = errors.str.replace(r"(, got \w+) .*$", "$1").str.replace_all(r"\d+", "#")
            kind, count = kinds.value_counts(sort=True).row(0)
            same = errors.filter(kinds == kind)
            top = same[0]
            first_id = part[id_column][0] if id_column in part.columns else None
            ident = f" (id {first_id!r})" if first_id is not None else ""  # a line without an id: its number says
            if errors.len() == 1:
                why = f"; the error of {name}'s one {unit}{ident}: {top}"
            elif count == 1:  # no error is more common than another: "1 of its 3 rows" would say nothing
                why = (f"; the {errors.len()} {unit}s of {name} have {errors.len()} distinct errors, the first"
                       f"{ident}: {errors[0]}")
            else:
                alike = ", alike but for the values quoted" if same.n_unique() > 1 else ""
                why = f"; the most common error of {name} ({count} of its {errors.len()} {unit}s{alike}): {top}"
    except (StorageError, OSError, KeyError, pl.exceptions.PolarsError):  # a courtesy: the column says it all
        pass
    return (f"every row of the job is an error row ({plural(rows, 'row')}, nothing generated){why}; see "
            f"{_error_places(spec, formats)} (exit {EXIT_ALL_ERRORS})")


def _error_places(spec: JobSpec, formats: list[str]) -> str:
    """Where a finished job's error rows are, for messages: its part files' error column, its errors-*.jsonl."""
    where = [f"the error column of {spec.output}/part-*.parquet"] if "parquet" in formats else []
    where += [f"the error lines of {spec.output}/errors-*.jsonl"] if "jsonl" in formats else []
    return " and ".join(where)


def cmd_run(args: argparse.Namespace) -> int:
    spec = spec_from_args(args)
    return _run(spec, args.run_on_cluster)


def cmd_demo(args: argparse.Namespace) -> int:
    """`tokenmill demo`: run a bundled job into ./demo_output/<job>/ (or --output) with `overwrite` on, so a
    re-run replaces the previous demo's outputs there (its part files and `_job/`, cost history included)
    and computes every row again, whatever options changed; `--no-overwrite` resumes it instead, as
    `tokenmill run` does (a changed option is then refused, exit 2). Another job's output there
    (`pipeline.demo.other_output`) is refused, exit 2, unless --overwrite. Returns the exit code."""
    default_model = JobSpec.model_fields["model"].default
    model = getattr(args, "model", None) or default_model
    name = args.job if model == default_model else f"{args.job}-{Path(model).name}"  # another model: its own folder
    spec = spec_from_args(args, {**DEMO_JOBS[args.job], "output": f"{DEMO_OUTPUT}/{name}", "overwrite": True})
    if not Path(spec.input).exists():
        print(f"tokenmill: demo data {spec.input} is missing (run from a checkout of tokenmill)", file=sys.stderr)
        return EXIT_REFUSED
    other = other_output(spec) if spec.overwrite else None
    if other is not None and not overwrite_given(args):  # the implied --overwrite replaces a previous demo only
        print(f"tokenmill: {spec.output} holds {other}, not a previous demo's output: the demo keeps it; "
              f"--overwrite replaces it, or choose another --output", file=sys.stderr)
        return EXIT_OTHER_JOB
    return run_demo(spec, args.job, other, lambda s: _run(s, args.run_on_cluster), _echo, args)


def cmd_report(args: argparse.Namespace) -> int:
    storage = dict(args.storage_options or [])
    metrics = read_metrics(args.url, storage)
    rows = metrics.to_dicts()
    statuses = [r.get("status") or "ok" for r in rows]
    extra = "".join(f", {statuses.count(k)} {k}" for k in ("failed", "interrupted") if k in statuses)
    total = sum(r.get("cost_usd") or 0.0 for r in rows)
    # without --all: the latest run that committed rows (a resume that found every shard done, run after
    # it, would show only zeros), else the latest
    ran = [i for i, r in enumerate(rows) if (r.get("rows_ok") or 0) + (r.get("rows_error") or 0) > 0]
    shown = ran[-1] if ran else len(rows) - 1
    after = len(rows) - 1 - shown
    which = "the latest:" if not after else (
        f"the latest that ran rows, run {shown + 1} ({plural(after, 'later run')} committed none; --all shows "
        f"each run):")
    _echo(f"job at {args.url}: {len(rows)} run(s){extra}; cost of all runs {total:.6f} USD; "
          f"{'each run:' if args.all else which}")
    if args.all:
        for i, row in enumerate(rows):
            _echo(f"\nrun {i + 1} of {len(rows)}")
            _echo(format_report(row))
    else:
        _echo(format_report(rows[shown]))
    return 0


EXIT_REFUSED = 1  # a bad option or input, a failure (see the module docstring)
EXIT_OTHER_JOB = 2  # the output holds another job: --overwrite replaces it
EXIT_LOCKED = 3  # another run holds the output's lease
EXIT_ALL_ERRORS = 4  # done, but every row of the job is an error row: nothing was generated


class _Parser(argparse.ArgumentParser):
    """argparse's parser whose usage errors exit EXIT_REFUSED, as every other bad option does: argparse's
    own 2 would read as EXIT_OTHER_JOB, and a script that re-runs with --overwrite on 2 would then
    delete a job's outputs over a mistyped flag.

    Prefixes of long options are not taken for the option (allow_abbrev=False, here and on the
    subcommands' parsers, which are of this class): `--max-token 5` is refused as an unrecognized
    argument, as `--max-tokns 5` is, instead of silently meaning `--max-tokens 5` (and a prefix
    that works today would turn ambiguous, or mean another option, when a flag is added)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> typing.NoReturn:
        """Print `PROG: error: MESSAGE` and where the options are (`see 'tokenmill run --help'`) on stderr,
        without the usage (`run`'s lists every option: 30 lines over a one-line mistake), then exit
        EXIT_REFUSED (raises SystemExit). A bad value of an option is one line, naming the option as
        typed: `tokenmill run: error: --plan must be prefix|input, got 'bogus'` (`_option_type`)."""
        flag, _, said = message.partition(": ")
        if flag.startswith("argument ") and said.startswith(flag.removeprefix("argument ") + " "):
            self.exit(EXIT_REFUSED, f"{self.prog}: error: {said}\n")
        self.exit(EXIT_REFUSED, f"{self.prog}: error: {message}\nsee '{self.prog} --help'\n")

    def parse_args(self, args: Optional[Sequence[str]] = None, namespace: Any = None) -> argparse.Namespace:
        """argparse's parse_args, except that arguments no parser knows are refused by the command they
        follow (`tokenmill run --bogus`: `tokenmill run: error: ...`, `see 'tokenmill run --help'`), where
        argparse has the top-level parser refuse them and point to `tokenmill --help`, which does not list
        run's options (raises SystemExit)."""
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            (getattr(ns, "command_parser", None) or self).error(f"unrecognized arguments: {' '.join(extras)}")
        return ns


def build_parser() -> argparse.ArgumentParser:
    """The `tokenmill` argument parser (run, demo, report, convert); a usage error exits 1 (SystemExit)."""
    parser = _Parser(prog="tokenmill", description="Offline batch LLM inference: Parquet in, "
                                     "generations and a cost report out.")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--verbose", "-v", action="store_true", help="print the traceback with an error")
    sub = parser.add_subparsers(dest="command", required=True)
    p_run = sub.add_parser("run", parents=[common],
                           help="run a job (resumes a killed one; --overwrite replaces a changed one)")
    add_spec_options(p_run)
    p_run.set_defaults(func=cmd_run, command_parser=p_run)
    p_demo = sub.add_parser("demo", parents=[common],
                            help=f"run a bundled sample job into ./{DEMO_OUTPUT}/JOB/ (replacing the previous demo "
                                 f"output there; --no-overwrite resumes it) and print the report")
    p_demo.add_argument("--job", choices=sorted(DEMO_JOBS), default="labelling", help="which sample job")
    add_spec_options(p_demo)
    p_demo.set_defaults(func=cmd_demo, command_parser=p_demo)
    p_rep = sub.add_parser("report", parents=[common], help="print the cost report of a job (every run: --all)")
    p_rep.add_argument("url", help="the job's output URL")
    p_rep.add_argument("--all", action="store_true", help="every run, not just the latest")
    p_rep.add_argument("--storage-option", dest="storage_options", type=_kv, action="append", metavar="KEY=VALUE",
                       help="fsspec/s3fs option, as for run")
    p_rep.set_defaults(func=cmd_report, command_parser=p_rep)
    add_convert_parser(sub, [common], _kv)
    return parser


class Interrupted(KeyboardInterrupt):
    """SIGTERM (or SIGINT), raised in the main thread by the CLI's signal handler; `signum` says which."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _on_signal(signum: int, frame: Any) -> None:
    """First SIGINT/SIGTERM: raise Interrupted, so the job abandons its shards in flight and books its cost.
    A second one while that clean-up runs: exit at once."""
    def again(signum2: int, frame2: Any) -> None:
        sys.stderr.write("tokenmill: interrupted again: exiting now (this run's cost may not be booked; its lease "
                         "expires on its own)\n")
        sys.stderr.flush()
        os._exit(128 + signum2)

    for s in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(s) is _on_signal:  # a signal the process ignores (nohup) stays ignored
            signal.signal(s, again)
    raise Interrupted(signum)


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """Warnings as one `tokenmill: warning: ...` line each, without our source line."""
    print(f"tokenmill: warning: {message}", file=file or sys.stderr)


def _fail(message: str, verbose: bool, code: int) -> int:
    if verbose:
        traceback.print_exc()
    print(f"tokenmill: {message}", file=sys.stderr)
    return code


def main(argv: Optional[Sequence[str]] = None, run_on_cluster: Optional[ClusterRunner] = None) -> int:
    """Run the `tokenmill` command; returns the exit code (see the module docstring).

    Args:
        run_on_cluster: what runs a `--cluster` job (`flows.cli.run_on_cluster`); without it, as in
            `python -m pipeline`, `--cluster` is refused in one line.
    """
    args = build_parser().parse_args(argv)
    args.run_on_cluster = run_on_cluster
    if args.command == "run" and not args.spec and (args.input is None or args.output is None):
        missing = [flag for flag, value in (("--input", args.input), ("--output", args.output)) if value is None]
        args.command_parser.error(f"the following arguments are required: {', '.join(missing)} (or a --spec file "
                                  f"that sets {'it' if len(missing) == 1 else 'them'})")
    verbose = bool(getattr(args, "verbose", False))
    old_handlers = {}
    if threading_is_main():  # a signal the process was started ignoring (nohup, `cmd &` in a script) stays ignored
        old_handlers = {s: signal.signal(s, _on_signal) for s in (signal.SIGINT, signal.SIGTERM)
                        if signal.getsignal(s) is not signal.SIG_IGN}
    old_show = warnings.showwarning
    warnings.showwarning = _show_warning
    try:
        return args.func(args)
    except StdoutClosed:
        _silence_stdout()
        return 128 + signal.SIGPIPE
    except JobInterrupted as exc:
        if exc.report is not None:
            _print_partial_report(exc)
        print(f"tokenmill: interrupted {exc.when}; re-run the same command to resume", file=sys.stderr)
        return 128 + exc.signum
    except KeyboardInterrupt as exc:  # before the run held the output: nothing written, no cost booked
        print("tokenmill: interrupted before the job started (nothing written); re-run the same command to start",
              file=sys.stderr)
        return 128 + int(getattr(exc, "signum", signal.SIGINT))
    except SpecError as exc:  # one line per problem, as a usage error's first line
        if verbose:
            traceback.print_exc()
        for problem in exc.problems:
            print(f"{args.command_parser.prog}: error: {problem}", file=sys.stderr)
        return EXIT_REFUSED
    except InvalidOption as exc:
        return _fail_option(exc, args, verbose)
    except JobSpecChanged as exc:
        return _fail(exc.cli_message, verbose, EXIT_OTHER_JOB)  # the flag, not the Python API's overwrite=True
    except JobLocked as exc:
        return _fail(str(exc), verbose, EXIT_LOCKED)
    except (StorageError, LeaseLost) as exc:
        return _fail(str(exc), verbose, EXIT_REFUSED)
    except (FileNotFoundError, ValueError) as exc:
        return _fail(str(exc), verbose, EXIT_REFUSED)
    except Exception as exc:  # anything else is a bug of ours or the engine's: one line, the traceback on --verbose
        detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return _fail(f"failed: {detail} (an internal error; --verbose prints the traceback; what the run committed is "
                     f"kept, and re-running the same command resumes)", verbose, EXIT_REFUSED)
    finally:
        warnings.showwarning = old_show
        for s, h in old_handlers.items():
            signal.signal(s, h)


def _fail_option(exc: InvalidOption, args: argparse.Namespace, verbose: bool) -> int:
    """An option the engine's rules refuse, in one line naming it where it was given: as typed on the
    command line (`tokenmill run: error: --max-tokens must be an integer >= 1, got 0`), or by the --spec
    file's line (`tokenmill run: error: job.yaml:3: max_tokens must be ...`); else the message as it is
    (`tokenmill: invalid default sampling parameters: ...`)."""
    field = exc.field
    if field is not None and getattr(args, field, None) is not None:
        rest = exc.problem[len(field):]
        said = "--" + field.replace("_", "-") + (" " + rest[1:] if rest.startswith("=") else rest)
    elif field is not None and getattr(args, "spec", None):
        from pipeline.spec import spec_field_lines

        line = spec_field_lines(args.spec).get(field)
        if line is None:
            return _fail(str(exc), verbose, EXIT_REFUSED)
        said = f"{args.spec}:{line}: {exc.problem}"
    else:
        return _fail(str(exc), verbose, EXIT_REFUSED)
    if verbose:
        traceback.print_exc()
    print(f"{args.command_parser.prog}: error: {said}", file=sys.stderr)
    return EXIT_REFUSED


def _silence_stdout() -> None:
    """Point stdout's file descriptor at /dev/null, so that the interpreter's last flush of what is still
    buffered does not fail again ("Exception ignored ... BrokenPipeError") after the command has ended."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, ValueError, OSError):  # not a real file (a test's capture): nothing to flush to a pipe
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def threading_is_main() -> bool:
    """Signal handlers can only be installed from the main thread."""
    import threading

    return threading.current_thread() is threading.main_thread()


if __name__ == "__main__":
    sys.exit(main())
