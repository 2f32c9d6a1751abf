"""A batch job: `JobSpec` and `run_job(spec)`.

A run goes: `prepare_job` (validate every option and the input's columns
before anything is written, take the output's lease, plan shards, check or
write the manifest, find the shards already done) -> `plan_windows` (cut the
pending shards into windows of consecutive shards, `shards_in_flight` each,
never splitting a prefix group that fits) -> `run_window` for each window
(read its shards, validate rows, stream them all through one
`LLM.iter_outputs` call, commit each shard's part file as soon as its last row
finishes) -> `finish_job` (book the run's cost report), or `abort_job` when
the run failed or was interrupted (book it with that status) ->
`JobPlan.close()` (give the lease back). The Prefect flow calls the same
steps, with a task per window: on one machine the windows run in plan order
through one engine, exactly as here; on a Dask cluster each worker process
runs its windows through its own engine.

Output layout:

    OUTPUT/part-00000.parquet ...       one per shard, written atomically
    OUTPUT/_job/manifest.json           fingerprint (inputs, spec, model) and shard plan
    OUTPUT/_job/done/part-00000.json    one marker per committed shard, with its counts
    OUTPUT/_job/runs/run-<t>-<id>.parquet  one cost row per run, whatever its status (see pipeline.cost)
    OUTPUT/_job/lease/lease-NNNNNNNN.json  the running run's lease (see pipeline.lease)

A shard is done when its marker exists; the marker is written after the part
file. Both are written first-wins (`io.create_exclusive`: a conditional PUT on
S3, a hard link on a local disk), so of two attempts of one shard that both
reach the commit (a worker declared dead that was still running, a retried
PUT whose answer was lost) the first one's part file stays, whole, and the
second adopts it: it checks that the file holds this shard's ids, counts the
rows from the file, and writes the marker if there is none yet (the first
marker stays too). A run killed between part file and marker leaves the part
file; the re-run computes the shard again and adopts that file. Every input
row appears exactly once, in one part file, and a marker's counts are those of
the part file. A run commits only while it holds the output's lease (workers
check it through a `LeaseToken`), so two runs never compute one shard at the
same time.
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter
import hashlib
import json
import os
import signal
import socket
import sys
import threading
import time
import types
import typing
import uuid
import warnings
from dataclasses import dataclass, field
from io import BytesIO
from datetime import datetime, timezone
from typing import Any, Callable, Iterator, Literal, Optional, Union

import polars as pl
from pydantic import (
    BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_serializer, field_validator,
)

from engine.config import SEED_MAX, SEED_MIN, SEED_RANGE, EngineConfig, SamplingParams
from engine.structured.params import StructuredOutputsParams
from pipeline import io, manifest
from pipeline.cost import CostReport, TokenCounts, cost_report
from pipeline.lease import Lease, LeaseToken
from pipeline.manifest import ShardResult
from pipeline.planner import PlanStats, Shard, TokenizedRows, plan_input_order, plan_prefix
from pipeline.schema import (
    CONSTRAINT_COLUMNS, InputLayout, build_request, output_schema, parse_choices, unify_input_columns,
)
from pipeline.storage import StorageError, plural, mask_secrets, quick_options, storage_call

# JobSpec fields that change what the outputs are; any change refuses a resume.
FINGERPRINT_FIELDS = (
    "model", "dtype", "quantization", "max_model_len", "seed", "engine_options",
    "max_tokens", "temperature", "top_p", "top_k", "stop", "sampling_options",
    "system_prompt", "chat_template", "n", "id_column", "shard_size", "limit", "plan", "decode_heavy_first",
    "truncate", "structured", "score_choices",
)


# JobSpec fields passed to the engine under their own names (`engine_options` may set the others).
ENGINE_FIELDS = ("dtype", "device", "quantization", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
                 "kv_cache_memory_bytes", "enable_prefix_caching", "seed", "num_threads", "speculative",
                 "tensor_parallel_size")
# JobSpec fields always passed to SamplingParams under their own names: a `sampling_options` key may not
# set one again (their defaults count); nor `structured_outputs` when the job has a default constraint (one
# of CONSTRAINT_FIELDS), nor `score_choices` when it scores.
SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "max_tokens", "stop")
CONSTRAINT_FIELDS = ("json_schema", "regex", "choice", "grammar", "json_object")

# Dask's comm schemes a scheduler address may use (JobSpec.cluster).
CLUSTER_SCHEMES = ("tcp", "tls", "ucx", "ws", "wss", "inproc")


class JobSpecChanged(RuntimeError):
    """The output folder holds a job with another spec or input; pass overwrite=True to replace it.

    Attributes:
        cli_message: the message in a command-line user's words (`--overwrite` alone where the
            Python message also names `overwrite=True`); the message itself when they agree.
    """

    def __init__(self, message: str, cli_message: Optional[str] = None) -> None:
        super().__init__(message)
        self.cli_message = message if cli_message is None else cli_message


INT_OPTION_MAX = 2 ** 62
"""The largest magnitude an integer JobSpec option may have (int64 with headroom for sums)."""

NO_JOB_SAMPLING_OPTIONS = ("logprobs", "prompt_logprobs")
"""SamplingParams fields a job refuses: its output has no column for them (`logprobs=5` was computed for
every row and dropped)."""

LEASE_TTL_MAX_S = 7 * 24 * 3600.0
"""The longest `lease_ttl_s`: 7 days (1e300 s overflowed the lease's expiry time: an OverflowError traceback)."""

PRICE_PER_HOUR_MAX = 1e6
"""The highest `price_per_hour`, USD per device-hour (1e308 booked costs of inf, and negative ones)."""

_FLOAT_RANGES = {"lease_ttl_s": (LEASE_TTL_MAX_S, "[0.1, 604800] seconds (at most 7 days)"),
                 "price_per_hour": (PRICE_PER_HOUR_MAX, "[0, 1000000] USD per device-hour")}


class JobSpec(BaseModel):
    """Everything a job needs; shared by `run_job`, the CLI (`--kebab-case` flags) and the flow.

    Engine options (None means the engine's default): model, dtype, device,
    quantization, max_num_seqs, max_num_batched_tokens, max_model_len,
    kv_cache_memory_bytes, enable_prefix_caching, seed, num_threads, speculative,
    tensor_parallel_size, plus any other EngineConfig field in `engine_options` (e.g.
    speculative_config).

    Sampling defaults (a row's `max_tokens`, `temperature`, `top_p`, `seed`,
    `stop` columns override them): max_tokens, temperature, top_p, top_k,
    stop, n, plus any other SamplingParams field in `sampling_options`.

    Output constraint (at most one; a row's `json_schema` / `regex` / `choice` / `grammar`
    column replaces it): json_schema (a file, or in YAML the schema itself), regex, choice,
    grammar (a file). Or score_choices: score each choice instead of generating.
    """

    model_config = ConfigDict(extra="forbid")

    input: str = Field(description="Parquet file, folder/prefix, or glob pattern of files ('data/*.parquet', "
                                   "'s3://bucket/prefix/*.parquet'): s3://, gs://, file:// or a local path")
    output: str = Field(description="output folder/prefix URL")

    model: str = Field("smollm2-135m-instruct", description="engine model: smollm2-135m-instruct, gemma-3-270m, "
                                                            "a .gguf file, a Hugging Face folder, or dummy:<shape>")
    dtype: str = Field("auto", description="weights dtype: auto | float32 | bfloat16 | float16 (auto: bf16 on CUDA "
                                           "and on CPUs with AMX-BF16 or AVX512-BF16, else fp32; a resume keeps "
                                           "the dtype the job's manifest recorded)")
    device: str = Field("auto", description="auto | cpu | cuda | cuda:N")
    quantization: Optional[str] = Field(None, description="weight quantization: none | int8 | int4 | gguf | "
                                                          "w8a8 (int8 x int8 arithmetic, CPU) (default none)")
    max_num_seqs: Optional[int] = Field(None, description="most requests running at once (engine default 128)")
    max_num_batched_tokens: Optional[int] = Field(None, description="per-step token budget (engine default 1024)")
    max_model_len: Optional[int] = Field(None, description="context length in tokens (default: the model's)")
    kv_cache_memory_bytes: Optional[int] = Field(None, description="bytes for the KV cache (default: a share of "
                                                                   "free memory)")
    enable_prefix_caching: Optional[bool] = Field(None, description="reuse KV blocks of shared prefixes "
                                                                    "(engine default on)")
    seed: int = Field(0, description="engine seed: sampled runs are reproducible (a 64-bit integer, as a row's seed)")
    num_threads: Optional[int] = Field(None, description="CPU threads of torch and the C kernels (default: the "
                                                         "CPUs this process may use)")
    speculative: Optional[Literal["auto", "ngram", "suffix", "draft_model", "off"]] = Field(
        None, description="speculative decoding: auto (the engine default: drafts where the measured step cost "
                          "makes them pay) | ngram | suffix | draft_model | off")
    tensor_parallel_size: Optional[int] = Field(
        None, ge=1, description="split the model over N devices (tensor parallelism; N processes, gloo on CPU, "
                                "NCCL on CUDA); N must divide the model's KV heads (engine default 1)")
    engine_options: dict[str, Any] = Field(default_factory=dict, description="other EngineConfig fields")

    max_tokens: int = Field(128, description="default new tokens per row")
    temperature: float = Field(0.0, description="default temperature (0 = greedy)")
    top_p: float = Field(1.0, description="default nucleus mass, in (0, 1]")
    top_k: int = Field(-1, description="default top-k (-1 = all tokens)")
    stop: list[str] = Field(default_factory=list, description="default stop strings")
    n: int = Field(1, description="completions per row; n > 1 adds a `generations` list column")
    sampling_options: dict[str, Any] = Field(default_factory=dict, description="other SamplingParams fields")
    json_schema: Optional[Union[str, dict[str, Any]]] = Field(
        None, description="default output constraint: a JSON Schema file (in YAML also the schema itself); outputs "
                          "are compact JSON")
    regex: Optional[str] = Field(None, description="default output constraint: a regular expression the whole output "
                                                   "matches")
    choice: Optional[list[str]] = Field(None, description="default output constraint: the output is exactly one of "
                                                          "these (comma-separated: positive,negative)")
    grammar: Optional[str] = Field(None, description="default output constraint: a Lark (or GBNF) grammar file")
    json_object: bool = Field(False, description="default output constraint: any JSON object (compact), for when "
                                                 "there is no schema")
    score_choices: Optional[list[str]] = Field(
        None, description="score these labels instead of generating (comma-separated); writes label and "
                          "label_logprobs")
    system_prompt: Optional[str] = Field(None, description="system prompt for every row (a `system` column overrides)")
    chat_template: Optional[bool] = Field(None, description="apply the chat template (default: when the model has one)")
    truncate: bool = Field(False, description="a row whose prompt + max_tokens exceeds the context stops at the end "
                                              "of the context (default: such a row is an error row)")

    id_column: str = Field("id", description="the input column holding each row's id (default id; without an id "
                                             "column, the row index; a named column must exist)")
    shard_size: int = Field(256, ge=1, description="rows per output part file")
    limit: Optional[int] = Field(None, ge=1, description="process only the first N rows")
    plan: Literal["prefix", "input"] = Field(
        "prefix", description="row order: 'prefix' groups rows sharing a prompt prefix (depth-first over the "
                              "dataset's prefix tree) so the engine computes each shared prefix once; 'input' keeps input order")
    decode_heavy_first: bool = Field(
        False, description="with plan='prefix': run groups with the most output per prompt token first")
    shards_in_flight: int = Field(2, ge=1, description="shards fed to the engine at once (memory vs. batch fill); "
                                                       "a window of this many consecutive shards is one engine "
                                                       "call, and one flow task")
    cluster: Optional[str] = Field(None, description="Dask scheduler address (tcp://HOST:8786): run the windows on "
                                                     "that cluster through the Prefect flow, one engine per worker "
                                                     "(needs a Prefect server, PREFECT_API_URL)")
    storage_options: dict[str, Any] = Field(
        default_factory=dict, repr=False,
        description="fsspec/s3fs options (endpoint_url, key, secret, config_kwargs, ...); default: AWS environment "
                    "variables; secrets are masked in JSON dumps")
    # at least 0.1 s: a run renews its lease 4 times per TTL (1e-9 failed every run after the model loaded,
    # "could not renew its lease for 0 s"; the fault tests run 0.5 s); finite: an inf lease would never expire;
    # at most LEASE_TTL_MAX_S (`_float_in_range`)
    lease_ttl_s: float = Field(60.0, ge=0.1, allow_inf_nan=False,
                               description="seconds a run's lease on the output lasts without a heartbeat (a dead "
                                           "run's lease expires after it); 0.1 s to 7 days")

    # finite: an inf price gave a cost of inf and USD per token of nan in the report (nan was refused by ge=0);
    # at most PRICE_PER_HOUR_MAX (`_float_in_range`)
    price_per_hour: float = Field(1.0, ge=0, allow_inf_nan=False,
                                  description="USD per device-hour, for the cost report (at most 1000000)")
    device_name: Optional[str] = Field(None, description="device name in the report (default: the engine's)")
    device_count: Optional[int] = Field(None, ge=1, description="devices the job holds, for the cost report "
                                                                "(default: tensor_parallel_size, else 1)")
    output_token_weight: float = Field(4.0, gt=0, allow_inf_nan=False,
                                       description="cost of one output token in uncached input tokens")
    overwrite: bool = Field(False, description="delete the job outputs already at the output and start over")
    progress: bool = Field(True, description="show a tqdm progress bar and what the job is doing")

    @field_validator("input", "output")
    @classmethod
    def _a_path(cls, v: Any) -> Any:
        if isinstance(v, str) and not v.strip():  # "" is the current folder to fsspec, and "/" for the output
            raise ValueError("must be a path or URL, got an empty string")
        return v

    @field_validator("system_prompt")
    @classmethod
    def _system_text(cls, v: Any) -> Any:
        if isinstance(v, str) and not v.strip():
            raise ValueError("is empty: leave it unset for no system prompt")
        return v

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else (v or [])

    @field_validator("choice", "score_choices", mode="before")
    @classmethod
    def _choice_list(cls, v: Any) -> Any:
        return parse_choices(v) if isinstance(v, str) else v

    def structured_outputs(self) -> Optional[StructuredOutputsParams]:
        """The job's default output constraint (files read now), or None.

        Raises:
            ValueError: more than one of json_schema / regex / choice / grammar, or a file that
                cannot be read or is not valid JSON (named).
        """
        given = [k for k in ("json_schema", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if not given:
            return None
        if len(given) > 1:
            raise ValueError(f"set at most one of json_schema, regex, choice, grammar, json_object; got {given}")
        kind = given[0]
        if kind == "json_object":
            return StructuredOutputsParams(json_object=True)
        value = getattr(self, kind)
        if kind in ("json_schema", "grammar") and isinstance(value, str):
            import fsspec

            try:
                with fsspec.open(value, "r", encoding="utf-8") as f:
                    text = f.read()
            except (OSError, ValueError) as exc:
                raise ValueError(f"{kind}: cannot read {value}: {exc}") from None
            if kind == "json_schema":
                try:
                    value = json.loads(text)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"json_schema: {value} is not valid JSON: {exc.msg} at line {exc.lineno}") \
                        from None
            else:
                value = text
        return StructuredOutputsParams(**{"json" if kind == "json_schema" else kind: value})

    def constraint_text(self, width: int = 100) -> Optional[str]:
        """The job's default output constraint as its user wrote it: `regex 'a+'`, `choice ['x', 'y']`,
        `json_schema label.json {"type":"object",...}` (a file's name, then its content), `json_object`;
        the content cut to `width` characters. None without one (or with one that is not valid).

        The fingerprint holds the constraint's content hash (`structured`); the manifest keeps this
        text beside it, so that a changed-spec refusal can say what changed.

        Raises:
            ValueError: as `structured_outputs` (a file that cannot be read).
        """
        so = self.structured_outputs()
        if so is None or so.validate() is not None:
            return None
        kind = next(k for k in CONSTRAINT_FIELDS if getattr(self, k) not in (None, False))
        if kind == "json_object":
            return kind
        value, content = getattr(self, kind), so.spec()
        if kind == "json_schema":  # as written: spec() has its objects closed (additionalProperties: false)
            content = json.loads(so.json) if isinstance(so.json, str) else so.json
        text = json.dumps(content, sort_keys=True, separators=(",", ":")) if kind == "json_schema" else repr(content)
        if len(text) > width:
            text = text[:width - 3] + "..."
        source = f"{value} " if kind in ("json_schema", "grammar") and isinstance(value, str) else ""
        return f"{kind} {source}{text}"

    @property
    def constrained(self) -> bool:
        """True when the job has a default constraint or scores choices."""
        return self.score_choices is not None or self.json_object or any(
            getattr(self, k) is not None for k in ("json_schema", "regex", "choice", "grammar"))

    @field_validator("cluster")
    @classmethod
    def _cluster_address(cls, v: Optional[str]) -> Optional[str]:
        if v is None:
            return v
        scheme, sep, rest = v.partition("://")
        if not sep or scheme not in CLUSTER_SCHEMES or not rest or "/" in rest:
            raise ValueError(f"expected a Dask scheduler address such as tcp://HOST:8786 (schemes: "
                             f"{', '.join(CLUSTER_SCHEMES)})")
        return v

    @field_validator("*")
    @classmethod
    def _int_fits(cls, v: Any, info: ValidationInfo) -> Any:
        """Every integer option fits an int64 with room to spare: 10**23 tokens, bytes or devices overflowed
        in the planner, the KV cache sizing or the cost report ("int too big to convert"), after the lease.
        The seed is no count: it takes the engine's whole 64-bit range (`_seed_fits`)."""
        if info.field_name == "seed":
            return v
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > INT_OPTION_MAX:
            raise ValueError(f"too large: at most {INT_OPTION_MAX:,}")
        return v

    @field_validator("lease_ttl_s", "price_per_hour")
    @classmethod
    def _float_in_range(cls, v: float, info: ValidationInfo) -> float:
        """The upper bound of a float option whose lower bound and finiteness `Field` checks (`_FLOAT_RANGES`):
        the message gives the whole range."""
        high, allowed = _FLOAT_RANGES[info.field_name]
        if v > high:
            raise ValueError(f"must be in {allowed}")
        return v

    @field_validator("seed")
    @classmethod
    def _seed_fits(cls, v: int) -> int:
        """The seeds the engine takes (`engine.config.SEED_RANGE`), as `SamplingParams(seed=...)` does."""
        if not SEED_MIN <= v <= SEED_MAX:
            raise ValueError(f"must be in {SEED_RANGE}")
        return v

    @field_validator("speculative", mode="before")
    @classmethod
    def _speculative_off(cls, v: Any) -> Any:
        # YAML reads a bare `off` (or `false`, `no`) as False: it means speculation off
        return "off" if v is False else v

    @field_serializer("storage_options", when_used="json")
    def _mask_secrets(self, v: dict[str, Any]) -> dict[str, Any]:
        """JSON dumps (Prefect parameters, logs, files) never hold a secret value."""
        return mask_secrets(v)

    def devices(self) -> int:
        """Devices the cost report counts: device_count, else the engine's tensor_parallel_size
        (here or in engine_options), else 1."""
        if self.device_count is not None:
            return self.device_count
        return int(self.engine_kwargs().get("tensor_parallel_size") or 1)

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `engine.LLM` (unset options are left to the engine)."""
        kw: dict[str, Any] = {}
        for name in ENGINE_FIELDS:
            v = getattr(self, name)
            if v is not None:
                kw[name] = v
        kw.update(self.engine_options)
        return kw

    def sampling_option_clashes(self) -> list[tuple[str, str]]:
        """(key, field) for each `sampling_options` key that a field of the job sets already (see
        SAMPLING_FIELDS): `field` is that JobSpec field (for `structured_outputs`, the constraint field set)."""
        clashes = []
        for key in self.sampling_options:
            if key in SAMPLING_FIELDS:
                clashes.append((key, key))
            elif key == "structured_outputs":
                owner = next((k for k in CONSTRAINT_FIELDS if getattr(self, k) not in (None, False)), None)
                if owner is not None:
                    clashes.append((key, owner))
            elif key == "score_choices" and self.score_choices is not None:
                clashes.append((key, "score_choices"))
        return clashes

    def sampling_params(self) -> SamplingParams:
        """The job's default SamplingParams.

        Raises:
            ValueError: a `sampling_options` key that a field of the job sets too (the message names
                the key, both values and the field), or a default constraint that cannot be read
                (`structured_outputs`).
            TypeError: a `sampling_options` key that SamplingParams does not have.
        """
        clashes = self.sampling_option_clashes()
        if clashes:
            raise ValueError("; ".join(f"sampling_options sets {key} ({self.sampling_options[key]!r}), which the "
                                       f"job's {field} field sets too ({getattr(self, field)!r})"
                                       for key, field in clashes) + ": set each once, in its own field")
        extra: dict[str, Any] = {}
        so = self.structured_outputs()
        if so is not None:
            extra["structured_outputs"] = so
        if self.score_choices is not None:
            extra["score_choices"] = list(self.score_choices)
        return SamplingParams(n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              max_tokens=self.max_tokens, stop=list(self.stop), **extra, **self.sampling_options)

    @classmethod
    def from_file(cls, path: str, **overrides: Any) -> "JobSpec":
        """Load a spec from a YAML or JSON file (fields at the top level or under `spec:`).

        Other top-level keys (e.g. a `deployment:` section for `flows/deploy.py`) are ignored here.
        """
        return cls(**{**load_spec_file(path)[0], **overrides})

    def fingerprint_fields(self) -> dict[str, Any]:
        """The output-shaping fields, as the job's fingerprint hashes them. Fields added after jobs were
        already written (`truncate`, `structured`, `score_choices`) count only when set, so those jobs still resume."""
        fields = {k: getattr(self, k) for k in FINGERPRINT_FIELDS if k not in ("structured",)}
        so = self.structured_outputs()
        fields["structured"] = so.key() if so is not None and so.validate() is None else None
        for k in ("truncate", "structured", "score_choices"):
            if not fields[k]:
                del fields[k]
        # speculation changes speed, never outputs (greedy: the target's tokens; seeded rows: the same
        # uniforms), as --speculative (not fingerprinted) does: a resume may change it
        fields["engine_options"] = {k: v for k, v in fields["engine_options"].items() if k != "speculative_config"}
        return fields


def load_spec_file(path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(spec fields, the rest) from a YAML or JSON file.

    The file holds JobSpec fields, either at the top level or under a `spec`
    key; with `spec`, the other top-level keys (e.g. `deployment`) are returned
    as the rest.

    Raises:
        FileNotFoundError: no such file.
        ValueError: a directory or an unreadable file, not UTF-8 text, empty, not valid YAML/JSON, or not a
            mapping (the message names the file, and the line where the parser gives one).
    """
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise FileNotFoundError(f"spec file {path} not found") from None
    except IsADirectoryError:
        raise ValueError(f"spec file {path}: is a directory") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"spec file {path}: not UTF-8 text (byte {exc.object[exc.start]:#04x} at position "
                         f"{exc.start}); a spec file is YAML or JSON") from None
    except OSError as exc:  # a permission, a device error: said in the system's words, the file named
        raise ValueError(f"spec file {path}: cannot read it: {exc.strerror or exc}") from None
    if not text.strip():
        raise ValueError(f"spec file {path}: is empty; expected a mapping of JobSpec fields")
    if str(path).endswith(".json"):
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}") from None
    else:
        import yaml

        try:
            doc = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise ValueError(f"{path}: not valid YAML: {problem}{where}") from None
    if doc is None:  # only comments, `---` or `null`
        raise ValueError(f"{path}: expected a mapping of JobSpec fields, got an empty document")
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: expected a mapping of JobSpec fields, got {type(doc).__name__}")
    if "spec" in doc:
        if not isinstance(doc["spec"], (dict, type(None))):
            raise ValueError(f"{path}: 'spec' must be a mapping of JobSpec fields, got {type(doc['spec']).__name__}")
        rest = {k: v for k, v in doc.items() if k != "spec"}
        return dict(doc["spec"] or {}), rest
    rest = {k: doc.pop(k) for k in list(doc) if k == "deployment"}
    return doc, rest


def spec_field_lines(path: str) -> dict[str, int]:
    """The line (1-based) of each spec field's key in a YAML or JSON spec file (at the top level, or under
    `spec:` when there is one), for messages; empty when the file cannot be read or parsed (its loader
    says why)."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            node = yaml.compose(f.read())  # JSON is YAML here: one parser gives both files' lines
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return {}

    def keys(mapping: Any) -> dict[str, Any]:
        if not isinstance(mapping, yaml.MappingNode):
            return {}
        return {str(k.value): (k, v) for k, v in mapping.value if isinstance(k, yaml.ScalarNode)}

    top = keys(node)
    fields = keys(top["spec"][1]) if "spec" in top else top
    return {name: key.start_mark.line + 1 for name, (key, _) in fields.items()}


def spec_errors(exc: ValidationError, sources: Optional[dict[str, str]] = None, flag_style: bool = False,
                lines: Optional[dict[str, int]] = None) -> list[str]:
    """One line per problem of a JobSpec ValidationError: where the field came from, its name, what is wrong.

    Args:
        sources: field name -> where its value came from (a file name, "command line"); fields
            not in it are named without a source.
        flag_style: name fields as command-line options (`--max-tokens`) instead of `max_tokens`.
        lines: field name -> its line in the spec file (`spec_field_lines`), for fields from a file:
            `job.yaml:4: max_tokns: unknown option; ...`.
    """
    import difflib

    out = []
    for err in exc.errors():
        name = str(err["loc"][0]) if err.get("loc") else "?"
        shown = "--" + name.replace("_", "-") if flag_style and (sources or {}).get(name) == "command line" else name
        source, where = (sources or {}).get(name), ""
        if source != "command line":  # from a file (`job.yaml:4: `), or from where the caller knows
            line = (lines or {}).get(name)
            at = f"{source}:{line}" if source and line else source or (f"line {line}" if line else "")
            where = f"{at}: " if at else ""
        if err.get("type") == "extra_forbidden":
            close = difflib.get_close_matches(name, list(JobSpec.model_fields), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            out.append(f"{where}{shown}: unknown option{hint}")
            continue
        value = err.get("input")
        msg = _rule(name, err) or str(err.get("msg", "invalid")).removeprefix("Value error, ")
        if value is None or isinstance(value, dict) or "got " in msg:
            got = ""
        else:
            got = f", got {value!r}"
        if msg.startswith(("must ", "is ", "cannot ")):  # the engine's way: `max_tokens must be ..., got 0`
            out.append(f"{where}{shown} {msg}{got}")
        else:
            out.append(f"{where}{shown}: {msg}{got}")
    return out


def _rule(name: str, err: dict[str, Any]) -> Optional[str]:
    """A JobSpec field's rule that a pydantic error broke, in the words of the engine's checks
    (`SamplingParams.validate`, `EngineConfig`): "must be an integer >= 1", "must be prefix|input";
    None for an error without such words (its message is used)."""
    field = JobSpec.model_fields.get(name)
    annotation = field.annotation if field is not None else None
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if args and typing.get_origin(annotation) in (Union, types.UnionType):
        annotation = args[0]
    kind = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(annotation)
    ctx, typ = err.get("ctx") or {}, str(err.get("type", ""))
    bounds = {"greater_than_equal": (">=", "ge"), "greater_than": (">", "gt"), "less_than_equal": ("<=", "le"),
              "less_than": ("<", "lt")}
    if typ in bounds and bounds[typ][1] in ctx:
        op, key = bounds[typ]
        bound = ctx[key]
        return f"must be {kind or 'a number'} {op} {bound:g}" if isinstance(bound, (int, float)) else \
            f"must be {kind or 'a number'} {op} {bound}"
    if typ == "finite_number":
        return "must be a finite number"
    if typ in ("int_parsing", "int_type", "int_from_float"):
        return "must be an integer"
    if typ in ("float_parsing", "float_type"):
        return "must be a number"
    if typ in ("bool_parsing", "bool_type"):
        return "must be true or false"
    if typ == "string_type":
        return "must be a string"
    if typ == "literal_error" and typing.get_origin(annotation) is Literal:
        return f"must be {'|'.join(str(a) for a in typing.get_args(annotation))}"
    return None


# ---------------------------------------------------------------- the engine, once per process

_ENGINES: dict[str, Any] = {}
_ENGINE_LOCKS: dict[int, threading.Lock] = {}
_ENGINES_LOCK = threading.Lock()
_ENGINE_LOADS = 0  # engines get_llm built in this process


def _engine_key(spec: JobSpec) -> str:
    kw = spec.engine_kwargs()
    if kw.get("dtype") == "auto":  # the engine "auto" builds here is the one its resolved dtype names
        kw["dtype"] = host_dtype(spec)
    return json.dumps([spec.model, kw], sort_keys=True, default=str)


def host_dtype(spec: JobSpec) -> str:
    """The weights dtype the spec's engine runs with on this machine: `spec.dtype`, or for "auto" what
    the engine resolves it to here (`engine.loader.resolve_settings`: bf16 on CUDA and on CPUs with a bf16
    matrix unit, else float32). "auto" when the engine options are invalid (validation names them)."""
    if spec.dtype != "auto":
        return spec.dtype
    from engine.loader import resolve_settings

    try:
        _, dtype, _ = resolve_settings(EngineConfig(model=spec.model, **spec.engine_kwargs()))
    except (ValueError, TypeError):
        return "auto"
    return str(dtype).removeprefix("torch.")


def engine_spec(spec: JobSpec, dtype: Optional[str]) -> JobSpec:
    """The spec a run's engine is built from: `spec` with dtype "auto" replaced by the job's dtype
    (`JobPlan.dtype`: what the manifest recorded when the job was planned), so that a job resumed on
    another host computes with the dtype its first rows were computed with."""
    if spec.dtype != "auto" or dtype in (None, "auto"):
        return spec
    return spec.model_copy(update={"dtype": dtype})


def get_llm(spec: JobSpec) -> Any:
    """The `engine.LLM` for this spec's model and engine options, loaded once per process and reused."""
    global _ENGINE_LOADS
    key = _engine_key(spec)
    with _ENGINES_LOCK:
        if key not in _ENGINES:
            from engine import LLM

            _ENGINES[key] = LLM(spec.model, **spec.engine_kwargs())
            _ENGINE_LOADS += 1
        return _ENGINES[key]


def preload_engine(spec: JobSpec) -> str:
    """Load the spec's engine into this process now (`get_llm`); returns its device name. Small enough to
    come back from Dask's `client.run(preload_engine, spec)`, which loads every worker's engine before the
    first window."""
    return str(getattr(get_llm(spec), "device_name", "unknown"))


def engine_loads() -> int:
    """How many engines `get_llm` has loaded in this process (a Dask worker loads one per engine spec)."""
    return _ENGINE_LOADS


def cache_llm(spec: JobSpec, llm: Any) -> None:
    """Make `get_llm` return `llm` (an engine you already built) for this spec's model and engine options."""
    with _ENGINES_LOCK:
        _ENGINES[_engine_key(spec)] = llm


def _loaded_llm(spec: JobSpec) -> Any:
    """The engine `get_llm` already loaded (or `cache_llm` registered) for this spec, or None."""
    with _ENGINES_LOCK:
        return _ENGINES.get(_engine_key(spec))


def job_tokenizer(spec: JobSpec) -> Any:
    """The tokenizer of the spec's model: the loaded engine's when there is one, else the tokenizer alone
    (no model weights), for planning in a process that does not run the engine (the flow)."""
    llm = _loaded_llm(spec)
    if llm is not None:
        return llm.tokenizer
    from engine.tokenizer import Tokenizer

    return Tokenizer.from_model(spec.model)


def use_chat_template(spec: JobSpec, tokenizer: Any) -> bool:
    """Whether prompts go through the chat template: the spec's choice, else when the model has one."""
    if spec.chat_template is not None:
        return spec.chat_template
    return bool(getattr(tokenizer, "has_chat_template", False))


def engine_lock(llm: Any) -> threading.Lock:
    """A lock per engine object: one engine runs one batch at a time, so threads (e.g. Prefect's
    thread-pool task runner) take turns; separate worker processes each have their own engine."""
    with _ENGINES_LOCK:
        return _ENGINE_LOCKS.setdefault(id(llm), threading.Lock())


# ---------------------------------------------------------------- plan and manifest

@dataclass
class JobPlan:
    """A prepared run: the shard plan, which shards still need to run, and the run's lease on the output.

    Attributes:
        columns: the output type of each id / pass-through column (inputs of several files are
            unified to one type per column, `schema.unify_input_columns`); give it to `run_shards`.
        lease: this run's hold on the output (None only for plans built without one); `close()`
            gives it back.
        structured: the job constrains or scores outputs (a default constraint, `score_choices`, or
            a constraint column in any input file), so every part file has the `valid` and
            `parsed` columns; give it to `run_shards`.
        dtype: the weights dtype the job computes with ("float32", "bfloat16", ...): `spec.dtype`, or
            for "auto" the one the manifest recorded when the job was planned (a resume on another
            host keeps it); run the engine from `engine_spec(spec, plan.dtype)`.
    """

    spec: JobSpec
    job_id: str
    run_id: str
    shards: list[Shard]
    pending: list[Shard]
    started_at: datetime
    stats: PlanStats = field(default_factory=PlanStats)
    columns: dict[str, pl.DataType] = field(default_factory=dict)
    lease: Optional[Lease] = None
    structured: bool = False
    dtype: Optional[str] = None
    rows_total: int = field(init=False)
    rows_skipped: int = field(init=False)

    def __post_init__(self) -> None:
        self.rows_total = sum(s.length for s in self.shards)
        pending = {s.index for s in self.pending}
        self.rows_skipped = sum(s.length for s in self.shards if s.index not in pending)

    def close(self, quick: bool = False) -> None:
        """Give the output's lease back (never raises a StorageError; a lease left behind expires).

        Args:
            quick: the storage endpoint just failed: try once, with short timeouts.
        """
        if self.lease is not None:
            so = self.spec.storage_options
            self.lease.release(quick_options(so) if quick else so)


def done_shards(spec: JobSpec) -> dict[int, ShardResult]:
    """The job's shards that have a done marker, by index."""
    return manifest.done_shards(spec.output, spec.storage_options)


def plan_job(spec: JobSpec, files: list[io.InputFile], tokenizer: Any = None,
             max_model_len: Optional[int] = None) -> tuple[list[Shard], PlanStats]:
    """The shard plan of a job: prefix groups in depth-first order (`spec.plan == "prefix"`) or input order.

    The plan is a deterministic function of the input files and the spec (and the
    tokenizer); it is stored in the manifest, and a resume reads it from there.

    Args:
        tokenizer: the model's tokenizer (default: `job_tokenizer(spec)`); only prefix plans tokenise.
        max_model_len: the engine's context length (default: the loaded engine's, else the one
            the spec's engine will have, from the model's metadata: `planned_context_length`);
            longer prompts will be error rows, so the plan's statistics leave them out like every
            other bad row.
    """
    if spec.plan == "input":
        shards = plan_input_order(files, spec.shard_size, spec.limit)
        return shards, PlanStats(order="input", rows=sum(s.length for s in shards))
    if tokenizer is None:
        tokenizer = job_tokenizer(spec)
    if max_model_len is None:
        loaded = _loaded_llm(spec)
        max_model_len = getattr(loaded, "max_model_len", None) if loaded is not None else planned_context_length(spec)
    block_size = int(spec.engine_kwargs().get("block_size", EngineConfig.block_size))
    rows = TokenizedRows(files, tokenizer, spec.sampling_params(), id_column=spec.id_column,
                         system_prompt=spec.system_prompt, use_chat_template=use_chat_template(spec, tokenizer),
                         limit=spec.limit, storage_options=spec.storage_options, max_model_len=max_model_len,
                         truncate=spec.truncate)
    return plan_prefix(rows, files, spec.shard_size, spec.limit, block_size=block_size,
                       decode_heavy_first=spec.decode_heavy_first)


def planned_context_length(spec: JobSpec) -> Optional[int]:
    """The context length in tokens the spec's engine will have, before one is loaded: `engine.loader.
    context_length` over the model's metadata (no weights read): `max_model_len` if given, at most the
    model's own context, at most what an explicit `kv_cache_memory_bytes` holds. Not counted: a KV cache
    sized from free memory, which only the loaded engine knows (and a cluster's budget when its workers
    pick the device: their dtype decides a block's size). `spec.max_model_len` when the metadata cannot
    be read; the engine checks every prompt again either way.
    """
    from engine.loader import context_length
    from engine.weights import model_config, resolve_model

    kw = spec.engine_kwargs()
    if spec.cluster is not None and str(kw.get("device", "auto")) == "auto":
        kw["kv_cache_memory_bytes"] = None
    try:
        return context_length(EngineConfig(model=spec.model, **kw), model_config(resolve_model(spec.model)))
    except (ImportError, OSError, KeyError, ValueError, TypeError, RuntimeError):  # unreadable metadata
        return spec.max_model_len


def _refuse_output_overlapping_input(spec: JobSpec, out_fs, out_path: str) -> None:
    """Refuse, before anything is written, an output that cannot hold a job: a local path under a
    file, a folder that is (or lies inside, or contains) the input folder, or one whose part files an
    input glob pattern matches: the next run (a resume) would read its part files as input.

    Raises:
        ValueError: naming the output and the file or input in the way.
    """
    protocols = out_fs.protocol if isinstance(out_fs.protocol, tuple) else (out_fs.protocol,)
    if "file" in protocols or "local" in protocols:
        parent = out_path.rstrip("/")
        while True:
            up = parent.rsplit("/", 1)[0] if "/" in parent else ""
            if not up or up == parent:
                break
            parent = up
            if out_fs.isfile(parent):
                raise ValueError(f"output {spec.output} lies under {parent}, which is a file; give a folder URL")
    in_fs, in_path = io.filesystem(spec.input, spec.storage_options)
    if io.is_glob(in_path):  # a pattern: refuse an output whose part files it would match
        part = out_path.rstrip("/") + "/part-00000.parquet"
        if in_fs.protocol == out_fs.protocol and io.glob_matches(in_path.rstrip("/"), part):
            raise ValueError(f"output {spec.output} lies where the input pattern {spec.input} matches: the part files "
                             f"written there would be read as input by the next run (a resume); choose an output "
                             f"the pattern does not match")
        return
    if in_fs.protocol != out_fs.protocol or in_fs.isfile(in_path):
        return
    a, b = in_path.rstrip("/"), out_path.rstrip("/")
    if a == b or b.startswith(a + "/") or a.startswith(b + "/"):
        raise ValueError(f"output {spec.output} overlaps the input folder {spec.input}: the part files written "
                         f"there would be read as input by the next run (a resume); choose an output outside it")


def _refuse_inputs_the_job_would_replace(spec: JobSpec, files: list[io.InputFile], out_fs, out_path: str) -> None:
    """Refuse, before anything is written, an input file that lies in the output folder under a name
    the job owns (`part-*.parquet` beside the manifest, or anything under `_job/`): the job would write
    its own part file there, and `--overwrite` deletes such files, the input with them. (A single
    input file with another name may sit in the output folder: `--input prompts.parquet --output .`.)

    Raises:
        ValueError: naming the input file and the output.
    """
    out = out_path.rstrip("/")
    for f in files:
        fs, path = io.filesystem(f.path, spec.storage_options)
        if fs.protocol != out_fs.protocol or not path.startswith(out + "/"):
            continue
        rel = path[len(out) + 1:]
        if rel.startswith("_job/") or ("/" not in rel and rel.startswith("part-") and rel.endswith(".parquet")):
            raise ValueError(f"input file {f.path} lies in the output folder {spec.output} under a name the job "
                             f"writes its own files by ({rel}): a run would take it for one of its part files, and "
                             f"--overwrite would delete it; move the input, or choose another output")


class InvalidOption(ValueError):
    """A job option that the engine's rules refuse (`validate_spec`), in the engine's words:
    `invalid default sampling parameters: max_tokens must be an integer >= 1, got 0`.

    Attributes:
        problem: the engine's words, without the head (`max_tokens must be an integer >= 1, got 0`).
        field: the JobSpec field that `problem` starts with (`max_tokens`; `kv_cache_memory_bytes` for
            `kv_cache_memory_bytes=10 is below ...`), or None when it starts with none (the CLI names
            an option given on the command line as typed: `--max-tokens must be ...`).
    """

    def __init__(self, head: str, problem: str) -> None:
        super().__init__(f"{head}: {problem}")
        self.problem = problem
        name = problem.split(" ", 1)[0].split("=", 1)[0]
        self.field: Optional[str] = name if name in JobSpec.model_fields else None


def validate_spec(spec: JobSpec) -> None:
    """Check every option a job's spec sets, before anything is read or written: the sampling
    defaults, the engine options (known names, allowed values, the device being there, unless the
    job runs on a `cluster`, whose workers hold the devices; a `kv_cache_memory_bytes` of at least
    one KV block of the model, and on a CPU at most the machine's available memory), the model.

    Raises:
        InvalidOption: a sampling default or an engine option the engine's rules refuse (a ValueError).
        ValueError: naming the option and what is allowed.
    """
    try:
        params = spec.sampling_params()
    except TypeError as exc:  # an unknown sampling_options key
        names = {f.name for f in dataclasses.fields(SamplingParams)}
        unknown = sorted(k for k in spec.sampling_options if k not in names)
        # the keys a job field of its own sets (--top-k, --stop, ...) are not offered here
        known = sorted(names - set(SAMPLING_FIELDS) - set(NO_JOB_SAMPLING_OPTIONS))
        raise ValueError(f"invalid sampling option: {'unknown ' + ', '.join(map(repr, unknown)) if unknown else exc}; "
                         f"known: {known} (the rest have options of their own: "
                         f"{', '.join(sorted(SAMPLING_FIELDS))})") from None
    for name in NO_JOB_SAMPLING_OPTIONS:  # the engine would compute them for every row, and nothing writes them
        if getattr(params, name) is not None:
            raise ValueError(f"invalid sampling option: {name}: a job writes no {name.replace('_', ' ')} "
                             f"(LLM.generate returns them{', LLM.score too' if name == 'prompt_logprobs' else ''})")
    problem = params.validate()
    if problem is not None:
        raise InvalidOption("invalid default sampling parameters", problem)
    if params.structured_outputs is not None:  # a job-wide constraint that cannot compile fails the job now
        from engine.structured.llguidance_backend import check_constraint

        problem = check_constraint(params.structured_outputs)
        if problem is not None:
            raise ValueError(f"invalid default output constraint: {problem}")
    known = {f.name for f in dataclasses.fields(EngineConfig)} - {"model"}
    unknown = sorted(set(spec.engine_options) - known)
    if unknown:
        raise ValueError(f"unknown engine option(s) {unknown}; known: {sorted(known)}")
    kw = spec.engine_kwargs()
    device = str(kw.get("device", "auto"))
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available() and spec.cluster is None:
        # on a cluster the workers hold the GPUs, not the process that plans
        raise ValueError(f"device {device!r} was asked for, but no CUDA device is available here; "
                         f"use --device cpu (or auto)")
    resolved = device if device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        config = EngineConfig(model=spec.model, **{**kw, "device": resolved})
    except (ValueError, TypeError) as exc:
        raise InvalidOption("invalid engine option", str(exc)) from None
    from engine.weights import resolve_model

    try:
        source = resolve_model(spec.model)
    except (ValueError, FileNotFoundError) as exc:
        raise ValueError(str(exc)) from None
    _check_block_size(config, source)
    if spec.cluster is None:  # (a cluster's workers check their own CPUs)
        from engine.threads import check_num_threads

        try:
            check_num_threads(config.num_threads)
        except ValueError as exc:
            raise InvalidOption("invalid engine option", str(exc)) from None
    if config.kv_cache_memory_bytes is not None and not (spec.cluster is not None and device == "auto"):
        _check_kv_budget(spec, config, source)  # (a cluster's workers resolve "auto" to their own device)
    if spec.cluster is None:  # (a cluster's workers have memories of their own)
        from engine.loader import kv_budget_memory_error

        problem = kv_budget_memory_error(config, resolved)
        if problem is not None:
            raise ValueError(f"invalid engine option: {problem}")
    draft = (kw.get("speculative_config") or {}).get("draft_model") if isinstance(
        kw.get("speculative_config"), dict) else None
    if isinstance(draft, str) and draft.startswith("self:") and draft[5:].isdigit():
        from engine.weights import model_num_layers

        layers = model_num_layers(source)
        if layers is not None and not 1 <= int(draft[5:]) <= layers:
            raise ValueError(f"invalid engine option: speculative_config.draft_model {draft!r} needs 1..{layers} "
                             f"layers ({spec.model!r} has {layers})")
    tp = kw.get("tensor_parallel_size") or 1
    if tp > 1:  # the heads must split evenly: told now, before any worker starts or anything is written
        from engine.parallel import check_tp_options, check_tp_size
        from engine.weights import model_config

        sc = kw.get("speculative_config")
        method = sc.get("method") if isinstance(sc, dict) and sc.get("method") else kw.get("speculative")
        try:
            check_tp_size(model_config(source), int(tp))
            check_tp_options(int(tp), kw.get("quantization"), method)
        except (ValueError, OSError, KeyError) as exc:
            raise InvalidOption("invalid engine option", str(exc)) from None
    if kw.get("quantization") == "w8a8" and not (spec.cluster is not None and device == "auto"):
        from engine.loader import resolve_settings, w8a8_unservable

        dev, dtype, _ = resolve_settings(config)
        problem = w8a8_unservable(config.cpu_kernels, str(dev), dtype)
        if problem is not None:
            raise InvalidOption("invalid engine option", problem)
    if kw.get("quantization") == "gguf" and source.kind != "gguf":
        raise ValueError(f"quantization 'gguf' keeps a GGUF file's own blocks, so it needs a .gguf model; "
                         f"{spec.model!r} is a {source.kind} model (use int8 or int4)")


def _check_block_size(config: EngineConfig, source: Any) -> None:
    """Refuse a `max_model_len` past the model's context (`engine.loader.max_model_len_error`) and a KV block
    larger than the context (`--max-model-len 8` with block_size 16) before anything is written, in the
    engine's words (`engine.loader.block_size_error`, from the model's metadata); the engine would refuse
    them only at load, after the run's manifest.

    Raises:
        ValueError: naming max_model_len, or block_size and the context.
    """
    from engine.loader import block_size_error, max_model_len_error
    from engine.weights import model_config

    try:
        mcfg = model_config(source)
        problem = max_model_len_error(config, mcfg) or block_size_error(config, mcfg)
    except (ImportError, OSError, KeyError, ValueError):  # unreadable metadata: the engine checks it at load
        return
    if problem is not None:
        raise InvalidOption("invalid engine option", problem)


def _check_kv_budget(spec: JobSpec, config: EngineConfig, source: Any) -> None:
    """Refuse a `kv_cache_memory_bytes` below one KV block of the model, the least the engine's KV cache
    holds (`engine.loader.min_kv_cache_memory_bytes`, from the model's metadata: no weights read), before
    anything is written; the engine would refuse it only after the run's manifest.

    Raises:
        ValueError: naming the option, the value given and the minimum in bytes.
    """
    from engine.loader import min_kv_cache_memory_bytes
    from engine.weights import model_config

    try:
        shape = model_config(source)
        need = min_kv_cache_memory_bytes(config, shape)
    except (ImportError, OSError, KeyError, ValueError, RuntimeError):  # unreadable metadata, no Triton here:
        return  # the engine checks the budget again when it sizes the cache
    given = config.kv_cache_memory_bytes
    if given < need:
        raise InvalidOption("invalid engine option", f"kv_cache_memory_bytes={given} is below the minimum of "
                            f"{need} bytes, one KV block of {spec.model!r} (block_size={config.block_size} tokens "
                            f"x {shape.num_layers} layers x K and V); give at least {need}, or leave it unset for "
                            f"a share of the free memory")


def check_inputs(spec: JobSpec, files: list[io.InputFile]) -> dict[str, pl.DataType]:
    """Check the input files' columns before anything is written; warn about what is unified.

    Returns:
        The output type of each id / pass-through column (`schema.unify_input_columns`).

    Raises:
        ValueError: a file without a prompt column or with a column name twice, a named `id_column`
            (other than the default "id") that a file lacks, or files that disagree on an output column
            (the message names the file and the column).
    """
    for f in files:
        try:
            layout = InputLayout.from_schema(f.columns, spec.id_column)
        except ValueError as exc:
            raise ValueError(f"{f.path}: {exc}") from None
        if not layout.id_in_input:
            if spec.id_column != "id":  # a column the user named: a typo must not turn into row indexes
                raise ValueError(f"id_column: {f.path} has no {spec.id_column!r} column (columns: "
                                 f"{', '.join(f.columns)})")
            warnings.warn(f"{f.path} has no {spec.id_column!r} column; using the row index as the id",
                          stacklevel=3)
    unified = unify_input_columns(files, spec.id_column)
    for note in unified.notes:
        warnings.warn(f"{spec.input}: {note}", stacklevel=3)
    return unified.types


def prepare_job(spec: JobSpec, tokenizer: Any = None, max_model_len: Optional[int] = None) -> JobPlan:
    """Validate, take the output's lease, check the manifest (refuse a changed job unless `overwrite`), plan.

    Nothing is written before every option, the output location and the input's columns
    are checked (`validate_spec`, `io.check_bucket`, an output that overlaps the input,
    `check_inputs`). Then the run takes
    the output's lease (`pipeline.lease`): a second run on the same output refuses. A new
    job (or `overwrite`) is planned (`plan_job`) and its plan written to the manifest; a
    resumed job reads its plan from the manifest, so the shards are exactly those of the
    first run. Planning also warns about null and repeated ids (`check_ids`).

    The caller must end the run with `finish_job` / `abort_job` and `JobPlan.close()`
    (which gives the lease back); `run_job` does all of that. An interruption once the lease is
    held (while planning: loading the tokenizer, tokenising) books the run's cost here (status
    "interrupted", no rows, the wall time so far) and gives the lease back; one before it writes
    nothing.

    Args:
        tokenizer: for planning (default: `job_tokenizer(spec)`, loaded only when planning).
        max_model_len: the engine's context length, for planning (see `plan_job`).

    Raises:
        ValueError: a bad option, output or input (the message names it).
        FileNotFoundError: no input files.
        StorageError: the storage cannot be reached, denies access, or a bucket does not exist.
        JobLocked: another run holds the output's lease.
        JobSpecChanged: the output holds another job (other spec, input or model).
        JobInterrupted: a KeyboardInterrupt once the lease was held (`shards_total` None: the job
            was not planned yet); its `report` is the cost row booked for the run.
        KeyboardInterrupt: an interruption before the lease was taken (nothing was written).
    """
    started_at = datetime.now(timezone.utc)
    so = spec.storage_options
    validate_spec(spec)  # job-level mistakes are refused before anything is read or written
    io.check_bucket(spec.output, so, "write")
    out_fs, out_path = io.filesystem(spec.output, so)
    with storage_call("check", spec.output, io.resolve_storage_options(spec.output, so)):
        if out_fs.isfile(out_path):
            raise ValueError(f"output {spec.output} is a file; give a folder (or prefix) URL")
        _refuse_output_overlapping_input(spec, out_fs, out_path)
    files = io.list_input_files(spec.input, so)
    _refuse_inputs_the_job_would_replace(spec, files, out_fs, out_path)
    columns = check_inputs(spec, files)
    digest, doc = manifest.fingerprint(files, spec.fingerprint_fields())
    readable = {"constraint": text} if (text := spec.constraint_text()) is not None else {}  # not hashed
    run_id = uuid.uuid4().hex[:12]
    lease = Lease.acquire(spec.output, so, run_id=run_id, ttl_s=spec.lease_ttl_s)
    try:
        previous = manifest.read_manifest(spec.output, so)
        if spec.overwrite:
            manifest.clear_output(spec.output, so)
        elif previous is not None and previous.get("fingerprint") != digest:
            what = (f"{spec.output} already holds a job with a different spec or input "
                    f"({manifest.describe_change(previous, {**doc, **readable})}).")
            fix = "to discard its outputs and start over, or choose another output."
            raise JobSpecChanged(f"{what} Re-run with --overwrite (overwrite=True) {fix}",
                                 cli_message=f"{what} Re-run with --overwrite {fix}")
        elif previous is None and (stray := manifest.part_files(spec.output, so)):
            shown = ", ".join(stray[:3]) + (f" and {len(stray) - 3} more" if len(stray) > 3 else "")
            raise JobSpecChanged(
                f"{spec.output} holds {len(stray)} file(s) named like a job's part files ({shown}) but no job "
                f"manifest (_job/manifest.json), so they are not outputs this run can resume; re-run with "
                f"--overwrite to delete them, or choose another output."
            )
        if spec.overwrite or previous is None:
            for message in check_ids(files, spec.id_column, spec.limit, so):
                warnings.warn(f"{spec.input}: {message}", stacklevel=2)
            shards, stats = plan_job(spec, files, tokenizer, max_model_len)
            dtype = host_dtype(spec)
            manifest.write_manifest(spec.output, {"fingerprint": digest, **doc, **readable, "plan": stats.to_json(),
                                                  "shards": [s.to_json() for s in shards], "dtype": dtype,
                                                  "created_at": started_at.isoformat()}, so)
        else:
            shards = [Shard.from_json(d) for d in previous["shards"]]
            stats = PlanStats(**previous.get("plan", {}))
            dtype = recorded_dtype(spec, previous)
        done = done_shards(spec)
        if done:
            done = _drop_markers_of_lost_parts(spec, shards, done)
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt):  # the run holds the output: it books its cost as every run does
            plan = JobPlan(spec=spec, job_id=digest[:16], run_id=run_id, shards=[], pending=[], started_at=started_at,
                           lease=lease)
            booked = abort_job(plan, [], exc, model=spec.model, quantization=spec.quantization,
                               device=job_device(plan, [], look_up=False))  # gives the lease back
            raise JobInterrupted(0, None, int(getattr(exc, "signum", signal.SIGINT)), booked) from None
        # refused before any shard ran: the folders the lease created go too, where nothing else was written
        lease.release(quick_options(so) if isinstance(exc, StorageError) and exc.endpoint_failed else so, tidy=True)
        raise
    pending = [s for s in shards if s.index not in done]
    structured = spec.constrained or any(c in f.columns for f in files for c in CONSTRAINT_COLUMNS)
    return JobPlan(spec=spec, job_id=digest[:16], run_id=run_id, shards=shards, pending=pending,
                   started_at=started_at, stats=stats, columns=columns, lease=lease, structured=structured,
                   dtype=dtype)


def recorded_dtype(spec: JobSpec, manifest_doc: dict) -> str:
    """The dtype a resumed job computes with: `spec.dtype` when given; for "auto", the one its manifest
    recorded. A manifest written before the dtype was recorded was planned when "auto" meant fp32 on the
    CPU and bf16 on CUDA."""
    if spec.dtype != "auto":
        return spec.dtype
    if manifest_doc.get("dtype"):
        return str(manifest_doc["dtype"])
    from engine.loader import resolve_settings

    try:
        device, _, _ = resolve_settings(EngineConfig(model=spec.model, **spec.engine_kwargs()))
    except (ValueError, TypeError):
        return "auto"
    return "bfloat16" if device.type == "cuda" else "float32"


def _drop_markers_of_lost_parts(spec: JobSpec, shards: list[Shard], done: dict[int, ShardResult]
                                ) -> dict[int, ShardResult]:
    """`done` without the shards whose part file is gone (deleted after its commit): their done markers
    are removed, with a warning naming them, so this run computes them again. Called by the run that
    holds the output's lease, before any shard runs; one listing of the output folder."""
    present = set(io.list_names(spec.output, spec.storage_options))
    lost = [s for s in shards if s.index in done and s.name not in present]
    if not lost:
        return done
    names = ", ".join(s.name for s in lost[:5]) + (f" and {len(lost) - 5} more" if len(lost) > 5 else "")
    warnings.warn(f"{spec.output}: {names} missing though the job's done marker says committed (deleted "
                  f"since?): {sum(s.length for s in lost)} rows of {len(lost)} shard{'s' if len(lost) > 1 else ''} "
                  f"computed again", stacklevel=3)
    for s in lost:
        io.remove(manifest.marker_url(spec.output, s.name), spec.storage_options)
    return {i: r for i, r in done.items() if i not in {s.index for s in lost}}


def _sampled_tokens(llm: Any) -> Optional[int]:
    """Output tokens the engine has sampled so far (`EngineStats.num_output_tokens`, cumulative over the
    engine's life, rows not yet finished included); None for an engine without the counter."""
    n = getattr(getattr(llm, "stats", None), "num_output_tokens", None) if llm is not None else None
    return int(n) if isinstance(n, int) else None


ID_EXAMPLES = 5  # offending rows a warning names


def check_ids(files: list[io.InputFile], id_column: str, limit: Optional[int] = None,
              storage_options: Optional[dict[str, Any]] = None) -> list[str]:
    """Problems with the dataset's ids, as warning texts (empty when there are none).

    Reads only the id column of the first `limit` rows. Rows are numbered across
    the input files in order, from 0 (the numbering ids take when there is no id
    column). A null id makes its row an error row (`schema.build_request`); a
    repeated id is only reported: those rows are processed, so the output holds
    the id more than once.
    """
    pieces, start = [], 0
    for f in files:
        n = f.num_rows if limit is None else max(0, min(f.num_rows, limit - start))
        if n and id_column in f.columns:
            col = pl.concat([b.get_column(id_column) for b in io.iter_batches(f.path, [id_column],
                                                                               storage_options=storage_options)])
            pieces.append(pl.DataFrame({"row": pl.int_range(start, start + n, eager=True),
                                        "id": col.head(n)}))
        start += n
    if not pieces:
        return []
    try:
        ids = pl.concat(pieces, how="vertical_relaxed")
    except (pl.exceptions.SchemaError, pl.exceptions.ComputeError):  # files with unlike id types
        ids = pl.concat([p.with_columns(pl.col("id").cast(pl.Utf8)) for p in pieces])
    problems = []
    missing = pl.col("id").is_null()
    if ids.schema["id"].is_float():  # NaN: how pandas writes a missing value of an int column
        missing = missing | pl.col("id").is_nan()
    null = ids.filter(missing)
    if null.height:
        rows = ", ".join(str(r) for r in null["row"].head(ID_EXAMPLES))
        problems.append(f"{null.height} row(s) with a null or NaN {id_column!r} (rows {rows}"
                        f"{', ...' if null.height > ID_EXAMPLES else ''}); each becomes an error row")
    valued = ids.filter(~missing)
    repeat = valued.filter(~pl.col("id").is_first_distinct())
    if repeat.height:
        shown = ", ".join(f"row {r} ({v!r})" for r, v in repeat.head(ID_EXAMPLES).iter_rows())
        more = ", ..." if repeat.height > ID_EXAMPLES else ""
        problems.append(f"{repeat.height} row(s) repeat an earlier row's {id_column!r} "
                        f"({repeat['id'].n_unique()} distinct ids; {shown}{more}); "
                        f"they are processed, so the output holds those ids more than once")
    return problems


# ---------------------------------------------------------------- running shards

@dataclass
class _ShardState:
    shard: Shard
    frame: pl.DataFrame
    layout: InputLayout
    results: list[Optional[dict]]
    remaining: int
    started: float
    structured: bool = False
    scored: bool = False


_EMPTY = {"generation": None, "finish_reason": "error", "prompt_tokens": 0, "completion_tokens": 0,
          "cached_tokens": 0, "spec_draft_tokens": 0, "spec_accepted_tokens": 0, "ttft_s": None, "latency_s": None}


def row_seed(job_seed: int, row_index: int) -> int:
    """A row's sampling seed when it has none: a hash of the job seed and the row's index in the dataset."""
    digest = hashlib.blake2b(f"{job_seed}:{row_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _error_row(message: str) -> dict:
    return {**_EMPTY, "error": message}


def _output_row(out: Any, n: int, params: Optional[SamplingParams] = None) -> dict:
    """Turn one engine RequestOutput into the generation columns of its row.

    With a constraint (`params.structured_outputs`): `valid` is the engine's verdict, `parsed`
    the output as compact JSON text for JSON constraints (null when it does not parse), and a
    valid choice row's text is its label. With `params.score_choices`: `label`, and
    `label_logprobs` as a list of {choice, logprob} in the choices' order.
    """
    comps = list(out.outputs or [])
    err = out.error or next((c.error or "engine error" for c in comps if c.finish_reason == "error"), None)
    if err is not None or not comps:
        return _error_row(err or "engine returned no completion")
    extra: dict[str, Any] = {}
    so = params.structured_outputs if params is not None else None
    c0 = comps[0]
    if params is not None and params.score_choices is not None and c0.label_logprobs is not None:
        extra = {"valid": True, "label": c0.text, "_label": c0.text,
                 "label_logprobs": [{"choice": k, "logprob": float(v)} for k, v in c0.label_logprobs.items()]}
    elif so is not None:
        extra["valid"] = bool(c0.valid)
        if so.is_json:
            try:
                extra["parsed"] = json.dumps(json.loads(c0.text), separators=(",", ":"), ensure_ascii=False)
            except (json.JSONDecodeError, ValueError):
                extra["parsed"] = None
        if so.kind == "choice" and c0.valid:
            extra["_label"] = c0.text
    m = out.metrics
    row = {
        "generation": comps[0].text,
        "finish_reason": comps[0].finish_reason,
        "prompt_tokens": len(out.prompt_token_ids) if out.prompt_token_ids is not None else (m.prompt_tokens if m else 0),
        "completion_tokens": sum(len(c.token_ids) for c in comps),
        "cached_tokens": int(out.num_cached_tokens or 0),
        "spec_draft_tokens": int(getattr(m, "spec_draft_tokens", 0) or 0),
        "spec_accepted_tokens": int(getattr(m, "spec_accepted_tokens", 0) or 0),
        "ttft_s": m.ttft if m else None,
        "latency_s": m.latency if m else None,
        "error": None,
    }
    if n > 1:
        row["generations"] = [c.text for c in comps]
    row.update(extra)
    return row


def default_worker() -> str:
    """HOST:PID of this process: the worker name recorded for shards run outside a cluster."""
    return f"{socket.gethostname()}:{os.getpid()}"


def _counts(gen: pl.DataFrame, labels: list[str]) -> TokenCounts:
    """The token counts of a part file's generation columns (`labels`: the valid choice labels)."""
    err = gen.get_column("error").is_not_null()
    counts = TokenCounts(
        rows_ok=int((~err).sum()),
        rows_error=int(err.sum()),
        prompt_tokens=int(gen.get_column("prompt_tokens").sum()),
        cached_tokens=int(gen.get_column("cached_tokens").sum()),
        completion_tokens=int(gen.get_column("completion_tokens").sum()),
        spec_draft_tokens=int(gen.get_column("spec_draft_tokens").sum()),
        spec_accepted_tokens=int(gen.get_column("spec_accepted_tokens").sum()),
    )
    if "valid" in gen.columns:
        valid = gen.get_column("valid")
        counts.rows_valid = int(valid.eq(True).sum())
        counts.rows_invalid = int(valid.eq(False).sum())
        counts.labels = {k: int(v) for k, v in sorted(Counter(labels).items())}
    return counts


PART_WORKER_KEY = "tokenmill.worker"  # Parquet key-value metadata of a part file: the worker that wrote it


def _adopt_part(spec: JobSpec, shard: Shard, url: str, ids: pl.Series,
                structured: bool) -> tuple[pl.DataFrame, list[str], str]:
    """The part file another attempt of this shard committed first: (its rows, its valid choice labels,
    the worker that wrote it, from the file's metadata; "" if it has none).

    Labels are counted for a job-wide `choice` constraint or `score_choices`; the labels of rows
    constrained by their own `choice` column are not recovered from the file (only the marker's
    label distribution misses them; the rows are whole).

    Raises:
        JobSpecChanged: the file holds other ids than this shard (something else wrote the output).
        StorageError: it could not be read.
    """
    fs, path = io.filesystem(url, spec.storage_options)
    with storage_call("read", url, io.resolve_storage_options(url, spec.storage_options)):
        data = fs.cat_file(path)
    existing = pl.read_parquet(BytesIO(data))
    writer = pl.read_parquet_metadata(BytesIO(data)).get(PART_WORKER_KEY, "")
    theirs = existing.get_column(ids.name).to_list() if ids.name in existing.columns else None
    if theirs != ids.to_list():
        raise JobSpecChanged(f"{url} already exists and does not hold shard {shard.index}'s rows (was the output "
                             f"written by something else?); re-run with --overwrite to start over")
    labels: list[str] = []
    so = spec.structured_outputs()
    if structured and "valid" in existing.columns and (spec.score_choices is not None or (so and so.kind == "choice")):
        col = "label" if "label" in existing.columns else "generation"
        labels = [v for v, ok in zip(existing.get_column(col).to_list(), existing.get_column("valid").to_list())
                  if ok and v is not None]
    return existing, labels, writer


def _commit(spec: JobSpec, state: _ShardState, device: str, run_id: str,
            lease: Optional[Union[Lease, LeaseToken]] = None, worker: str = "") -> ShardResult:
    """Write the shard's part file, then its done marker (after checking the run still holds the output's
    lease), each first-wins: a part file another attempt committed first is kept and adopted (see the
    module docstring), and the returned result is the marker's.

    Raises:
        LeaseLost: another run took the output over, or the run ended; nothing is written.
        JobSpecChanged: a part file at this shard's name holds other rows.
        StorageError: the part file or the marker could not be written; the shard is not done.
    """
    if lease is not None:
        lease.check()
    shard, df, layout = state.shard, state.frame, state.layout
    so = spec.storage_options
    if layout.id_in_input:
        ids = df.get_column(layout.id_column)
    else:
        ids = pl.Series(layout.id_column, shard.dataset_rows(), pl.Int64)
    passthrough = {c: df.schema[c] for c in layout.passthrough}
    schema = output_schema(layout.id_column, ids.dtype, passthrough, spec.n, state.structured, state.scored)
    gen_cols = [c for c in schema if c != layout.id_column and c not in passthrough]
    gen = pl.DataFrame({c: [r.get(c) for r in state.results] for c in gen_cols},
                       schema={c: schema[c] for c in gen_cols})
    out = pl.concat([pl.DataFrame([ids.alias(layout.id_column)]), df.select(layout.passthrough), gen],
                    how="horizontal")
    url = io.join(spec.output, shard.name)
    worker = worker or default_worker()
    buf = BytesIO()
    out.write_parquet(buf, compression="zstd", metadata={PART_WORKER_KEY: worker})
    adopted = not io.create_exclusive(url, buf.getvalue(), so)
    writer = worker
    if adopted:  # an earlier attempt's part file (a worker lost mid-commit, a killed run): keep it
        out, labels, writer = _adopt_part(spec, shard, url, ids.alias(layout.id_column), state.structured)
        writer = writer or worker
        gen = out.select([c for c in gen_cols if c in out.columns])
    else:
        labels = [r.get("_label") for r in state.results if r is not None and r.get("_label") is not None]
    result = ShardResult(index=shard.index, rows=shard.length, counts=_counts(gen, labels), device=device,
                         seconds=time.perf_counter() - state.started, worker=writer)
    return manifest.mark_done(spec.output, shard.name, result,
                              {"run_id": run_id, "finished_at": datetime.now(timezone.utc).isoformat(),
                               "adopted_part": adopted, "committed_by": worker}, so)


def read_shard(shard: Shard, storage_options: Optional[dict[str, Any]] = None,
               columns: Optional[dict[str, pl.DataType]] = None) -> pl.DataFrame:
    """The shard's input rows, in shard order (one range read when the rows are consecutive).

    Args:
        columns: output types of the id / pass-through columns (`JobPlan.columns`); those
            columns are cast to them, so every part file has one schema.
    """
    runs = shard.runs()
    if len(runs) == 1:
        df = io.read_rows(shard.file, runs[0][0], runs[0][1], storage_options)
    else:
        df = io.read_rows_at(shard.file, shard.rows, storage_options)
    casts = {c: t for c, t in (columns or {}).items() if c in df.columns and df.schema[c] != t}
    return df.cast(casts) if casts else df


def run_shards(
    spec: JobSpec,
    shards: list[Shard],
    llm: Any,
    *,
    run_id: str = "",
    on_rows: Optional[Callable[[int, int], None]] = None,
    columns: Optional[dict[str, pl.DataType]] = None,
    lease: Optional[Union[Lease, LeaseToken]] = None,
    structured: Optional[bool] = None,
    worker: str = "",
) -> Iterator[ShardResult]:
    """Run `shards` through the engine together; yield each ShardResult as soon as it is committed.

    All rows of the given shards go to one `llm.iter_outputs` call, in shard
    order and each shard's planned row order (the engine admits requests first
    come, first served, so rows sharing a prefix run together while it is
    cached), so the engine's batch stays full across shard boundaries; a
    shard's part file is written as soon as its last row finishes. Memory
    holds these shards only.

    Stopping early (an exception, an interrupt, closing the iterator) abandons the shards
    in flight: the engine's iteration is closed, which aborts their requests, and nothing
    partial is committed.

    Args:
        on_rows: called with (rows finished, output tokens) as rows finish (progress bars).
        columns: output types of the id / pass-through columns (`JobPlan.columns`).
        lease: the run's lease (or a worker's `LeaseToken` of it), checked before each commit.
        structured: write the `valid` / `parsed` columns (`JobPlan.structured`; None: when the
            spec constrains outputs or these shards' files have a constraint column).
        worker: the name recorded in each done marker (default `default_worker()`, HOST:PID).

    Raises:
        LeaseLost: another run took the output over.
        StorageError: reading a shard or committing one failed.
    """
    tokenizer = llm.tokenizer
    use_chat = use_chat_template(spec, tokenizer)
    defaults = spec.sampling_params()
    problem = defaults.validate()
    if problem is not None:
        raise ValueError(f"invalid default sampling parameters: {problem}")
    device = spec.device_name or str(getattr(llm, "device_name", "unknown"))
    vocab_size = getattr(tokenizer, "vocab_size", None)
    max_model_len = getattr(llm, "max_model_len", None)

    states: list[_ShardState] = []
    prompts: list[list[int]] = []
    params: list[SamplingParams] = []
    owners: list[tuple[int, int]] = []  # request index -> (state index, row index)
    frames = [(shard, read_shard(shard, spec.storage_options, columns), time.perf_counter()) for shard in shards]
    if structured is None:
        structured = spec.constrained or any(c in df.columns for _, df, _ in frames for c in CONSTRAINT_COLUMNS)
    scored = spec.score_choices is not None
    for shard, df, t0 in frames:
        seeds = shard.dataset_rows()
        bad_text = df.get_column(io.INVALID_UTF8_COLUMN) if io.INVALID_UTF8_COLUMN in df.columns else None
        df = df.drop(io.INVALID_UTF8_COLUMN, strict=False)  # it names a row's bad text; never an output column
        layout = InputLayout.from_schema(df.columns, spec.id_column)
        state = _ShardState(shard, df, layout, [None] * df.height, 0, t0, structured, scored)
        row_cols = [c for c in (spec.id_column, "prompt", "messages", *layout.overrides) if c in df.columns]
        rows = df.select(row_cols) if bad_text is None else df.select(row_cols).with_columns(bad_text)
        for i, row in enumerate(rows.iter_rows(named=True)):
            req = build_request(row, layout, tokenizer, defaults, system_prompt=spec.system_prompt,
                                use_chat_template=use_chat, max_model_len=max_model_len, vocab_size=vocab_size,
                                truncate=spec.truncate)
            if req.error is not None:
                state.results[i] = _error_row(req.error)
            else:
                p = req.params
                if p.seed is None:  # same samples for a row whatever the sharding, batch or resume
                    p = dataclasses.replace(p, seed=row_seed(spec.seed, seeds[i]))
                owners.append((len(states), i))
                prompts.append(req.prompt_token_ids)
                params.append(p)
                state.remaining += 1
        states.append(state)

    for state in states:
        errors = state.shard.length - state.remaining
        if errors and on_rows:
            on_rows(errors, 0)
        if state.remaining == 0:
            yield _commit(spec, state, device, run_id, lease, worker)
    if not prompts:
        return
    outputs = llm.iter_outputs(prompts, params, use_tqdm=False)
    try:
        for out in outputs:
            si, ri = owners[int(out.request_id)]
            state = states[si]
            row = _output_row(out, spec.n, params[int(out.request_id)])
            state.results[ri] = row
            state.remaining -= 1
            if on_rows:
                on_rows(1, row["completion_tokens"])
            if state.remaining == 0:
                yield _commit(spec, state, device, run_id, lease, worker)
                states[si] = None  # type: ignore[call-overload]  # free the shard's rows
    finally:
        close = getattr(outputs, "close", None)
        if close is not None:  # abort the engine's requests now, not when the generator is collected
            close()


# ---------------------------------------------------------------- finishing

RUNS_DIR = "runs"  # OUTPUT/_job/runs/run-<started>-<run_id>.parquet: one cost row per run
LEGACY_METRICS = "metrics.parquet"  # one file with every run's row (jobs written before the runs/ folder)


def _engine_steps(llm: Any, since: Optional[dict] = None) -> Optional[dict]:
    """The engine's step counters (steps, speculative steps, verifies, accepted draft tokens), minus
    `since` when given; None without an engine that keeps them."""
    st = getattr(llm, "stats", None)
    if st is None or not hasattr(st, "num_spec_steps"):
        return None
    now = {"steps": st.num_steps, "spec_steps": st.num_spec_steps, "spec_verifies": st.spec_verifies,
           "spec_accepted_tokens": st.spec_accepted_tokens}
    if since is None:
        return now
    return {k: v - since.get(k, 0) for k, v in now.items()}


def finish_job(plan: JobPlan, results: list[ShardResult], *, model: str, quantization: Optional[str],
               device: str, status: str = "ok", error: Optional[str] = None,
               discarded_completion_tokens: int = 0,
               storage_options: Optional[dict[str, Any]] = None,
               engine_steps: Optional[dict] = None, device_count: Optional[int] = None) -> CostReport:
    """Build this run's cost report and book it: one Parquet row under `_job/runs/` (one put, so a
    failing or interrupted run can book its cost too).

    Args:
        results: the shards this run committed (their rows and tokens are the report's counts; the
            plan's pending shards not among them are the report's `rows_not_run`).
        status: "ok", "failed" or "interrupted".
        error: for a failed run, what failed (one line).
        discarded_completion_tokens: output tokens generated for shards that were not committed.
        storage_options: options for the write (default: the spec's).
        engine_steps: the engine's step counters over the run (see `cost.cost_report`).
        device_count: devices the run held (default `spec.devices()`; the flow on a cluster
            passes the number of workers that ran its shards).

    Raises:
        StorageError: the row could not be written.
    """
    spec = plan.spec
    counts = TokenCounts()
    for r in results:
        counts = counts + r.counts
    committed = {r.index for r in results}
    rows_not_run = sum(s.length for s in plan.pending if s.index not in committed)
    report = cost_report(
        job_id=plan.job_id, run_id=plan.run_id, model=model, quantization=quantization, device=device,
        device_count=device_count or spec.devices(), started_at=plan.started_at,
        finished_at=datetime.now(timezone.utc),
        price_per_device_hour=spec.price_per_hour, counts=counts, rows_total=plan.rows_total,
        rows_skipped=plan.rows_skipped, rows_not_run=rows_not_run, output_token_weight=spec.output_token_weight,
        ideal_prefix_hit_rate=plan.stats.ideal_hit_rate, plan=plan.stats.order, status=status, error=error,
        discarded_completion_tokens=discarded_completion_tokens, engine_steps=engine_steps,
        structured=plan.structured, dtype=plan.dtype or spec.dtype, host=_host_line(),
    )
    name = f"run-{plan.started_at.strftime('%Y%m%dT%H%M%S%fZ')}-{plan.run_id}.parquet"
    io.write_parquet_atomic(report.as_frame(), manifest.job_url(spec.output, RUNS_DIR, name),
                            storage_options if storage_options is not None else spec.storage_options)
    return report


def _host_line() -> str:
    """This process's host (`engine.host.describe`): the CPU a run's figures were measured on."""
    from engine.host import describe

    return describe()


def abort_job(plan: JobPlan, results: list[ShardResult], exc: BaseException, *, model: str,
              quantization: Optional[str], device: str, discarded_completion_tokens: int = 0,
              device_count: Optional[int] = None, interrupted: bool = False) -> Optional[CostReport]:
    """Book the cost of a run that ended with `exc` (status "interrupted" for KeyboardInterrupt and its
    subclasses, or with `interrupted`, else "failed") and give the lease back. After a storage failure
    both use short timeouts. Never raises: a row that cannot be booked is reported as a warning. The
    booked report goes with `exc` (`booked_report(exc)`), so whoever catches what the caller re-raises
    (the CLI) can show it.

    Args:
        interrupted: `exc` stopped the run as a signal does without being a KeyboardInterrupt (Prefect's
            TerminationSignal, raised in a flow run on SIGTERM): booked "interrupted", as Ctrl-C is.

    Returns:
        The booked report, or None when it could not be written.
    """
    so = plan.spec.storage_options
    quick = isinstance(exc, StorageError) and exc.endpoint_failed
    status = "interrupted" if interrupted or isinstance(exc, KeyboardInterrupt) else "failed"
    error = None if status == "interrupted" else (str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    report = None
    try:
        report = finish_job(plan, results, model=model, quantization=quantization, device=device, status=status,
                            error=error, discarded_completion_tokens=discarded_completion_tokens,
                            storage_options=quick_options(so) if quick else so, device_count=device_count)
    except StorageError as book_exc:
        warnings.warn(f"this run's cost was not booked ({book_exc.cause}); it ran "
                      f"{(datetime.now(timezone.utc) - plan.started_at).total_seconds():.1f} s", stacklevel=2)
    finally:
        plan.close(quick=quick)
    if report is not None:
        with contextlib.suppress(AttributeError, TypeError):  # an exception that takes no attributes
            exc.tokenmill_report = report  # type: ignore[attr-defined]
    return report


def booked_report(exc: BaseException) -> Optional[CostReport]:
    """The cost report booked for the run that `exc` ended (status "failed" or "interrupted"), as `run_job`
    and the flow re-raise it: a `JobInterrupted`'s `report`, else what `abort_job` attached. None when the
    run ended before it held the output's lease (nothing is booked then) or its row could not be written."""
    if isinstance(exc, JobInterrupted):
        return exc.report
    return getattr(exc, "tokenmill_report", None)


def read_metrics(output: str, storage_options: Optional[dict[str, Any]] = None) -> pl.DataFrame:
    """All runs' cost reports of the job at `output`, one row per run, oldest first (failed and
    interrupted runs included: their `status` says so; a row booked before `rows_not_run` was a column
    gets what its other row counts leave of `rows_total`). A run file that cannot be read (truncated,
    garbage) or is not a cost row (a stray Parquet file without `METRICS_KEY_COLUMNS`) is skipped with
    a warning naming it, so the good runs still show.

    Raises:
        FileNotFoundError: when the job has no metrics yet.
        ValueError: `output` is a file, not a job's output folder (the message names it); or every
            metrics file was skipped (the message says how many).
        StorageError: the storage cannot be reached or denies access.
    """
    fs, path = io.filesystem(output, storage_options)
    with storage_call("check", output, io.resolve_storage_options(output, storage_options)):
        if fs.isfile(path):
            raise ValueError(f"{output} is a file, not a job output folder: give the --output folder of a "
                             f"tokenmill run (it holds part-*.parquet and _job/)")
    urls = []
    legacy = manifest.job_url(output, LEGACY_METRICS)
    if io.exists(legacy, storage_options):
        urls.append(legacy)
    runs = manifest.job_url(output, RUNS_DIR)
    urls += [io.join(runs, name) for name in io.list_names(runs, storage_options)
             if name.startswith("run-") and name.endswith(".parquet")]
    if not urls:
        raise FileNotFoundError(f"no job metrics at {manifest.job_url(output)}")
    frames = []
    for url in urls:
        df = _read_metrics_file(url, storage_options)
        if df is not None:
            frames.append(df)
    if not frames:
        raise ValueError(f"no readable job metrics at {manifest.job_url(output)}: all {len(urls)} metrics "
                         f"file(s) were skipped (see the warnings)")
    df = pl.concat(frames, how="diagonal_relaxed")
    if "status" in df.columns:
        df = df.with_columns(pl.col("status").fill_null("ok"))
    counted = ("rows_total", "rows_ok", "rows_error", "rows_skipped")
    if all(c in df.columns for c in counted):  # rows booked before rows_not_run: what the other columns leave
        left = pl.col("rows_total") - pl.col("rows_ok") - pl.col("rows_error") - pl.col("rows_skipped")
        old = pl.col("rows_not_run") if "rows_not_run" in df.columns else pl.lit(None, dtype=pl.Int64)
        df = df.with_columns(old.fill_null(left.clip(lower_bound=0)).cast(pl.Int64).alias("rows_not_run"))
    return df.sort("started_at", maintain_order=True)


# The columns (and their kinds) that make a Parquet file a run's cost row: what a report sorts and sums by.
METRICS_KEY_COLUMNS = {"job_id": pl.String, "run_id": pl.String, "started_at": pl.Datetime, "cost_usd": pl.Float64}


def _read_metrics_file(url: str, storage_options: Optional[dict[str, Any]]) -> Optional[pl.DataFrame]:
    """One metrics file's rows, or None (with a warning naming the file) when it cannot be read as
    Parquet or does not hold cost rows (`METRICS_KEY_COLUMNS`). A storage failure still raises."""
    try:
        df = io.read_parquet(url, storage_options)
    except (pl.exceptions.PolarsError, pl.exceptions.PanicException) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        warnings.warn(f"{url}: skipped, not a readable Parquet file ({reason})", stacklevel=3)
        return None
    def fits(column: str, kind: Any) -> bool:
        dtype = df.schema.get(column)
        return dtype is not None and (dtype == kind or (kind == pl.Float64 and dtype.is_numeric()))

    wrong = [f"{c} ({df.schema[c] if c in df.columns else 'missing'})"
             for c, kind in METRICS_KEY_COLUMNS.items() if not fits(c, kind)]
    if wrong:
        warnings.warn(f"{url}: skipped, not a run's cost row (column {', '.join(wrong)})", stacklevel=3)
        return None
    return df


def plan_windows(shards: list[Shard], shards_in_flight: int) -> list[list[Shard]]:
    """The windows of a run: consecutive runs of `shards_in_flight` shards, each one engine call (and one
    flow task); a window grows (up to twice that) while the next shard continues the last one's prefix
    group, so a group that fits stays within one engine call. `run_job` and the flow cut them alike.

    Raises:
        ValueError: `shards_in_flight` below 1.
    """
    if shards_in_flight < 1:
        raise ValueError(f"shards_in_flight must be at least 1, got {shards_in_flight!r}")
    k, out, i = shards_in_flight, [], 0
    while i < len(shards):
        j = min(i + k, len(shards))
        while j < len(shards) and j < i + 2 * k and shards[j].continues_group \
                and shards[j].index == shards[j - 1].index + 1:
            j += 1
        out.append(shards[i:j])
        i = j
    return out


@dataclass
class WindowRun:
    """What running one window produced (`run_window`): a flow task's return value, as JSON.

    Attributes:
        results: the shards committed, in commit order.
        worker: who ran the window (see `ShardResult.worker`).
        quantization: the engine's weight quantization (None: full precision).
        engine_steps: the engine's step counters over this window (see `cost.cost_report`), or None.
        seconds: wall seconds of the window, reading to last commit.
    """

    results: list[ShardResult]
    worker: str
    quantization: Optional[str] = None
    engine_steps: Optional[dict] = None
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"results": [r.to_json() for r in self.results], "worker": self.worker,
                "quantization": self.quantization, "engine_steps": self.engine_steps, "seconds": self.seconds}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "WindowRun":
        return cls(results=[ShardResult.from_json(r) for r in d["results"]], worker=d.get("worker", ""),
                   quantization=d.get("quantization"), engine_steps=d.get("engine_steps"),
                   seconds=d.get("seconds", 0.0))


def engine_quantization(spec: JobSpec, llm: Any) -> Optional[str]:
    """The quantization a report names: the spec's, else the engine's own (e.g. a GGUF's default)."""
    return spec.quantization or getattr(getattr(llm, "config", None), "quantization", None)


def add_steps(a: Optional[dict], b: Optional[dict]) -> Optional[dict]:
    """Two windows' engine step counters added (None when neither has any)."""
    if a is None or b is None:
        return a if b is None else b
    return {k: a.get(k, 0) + b.get(k, 0) for k in {**a, **b}}


def run_window(
    spec: JobSpec,
    window: list[Shard],
    llm: Any,
    *,
    run_id: str,
    columns: Optional[dict[str, pl.DataType]] = None,
    structured: Optional[bool] = None,
    lease: Optional[Union[Lease, LeaseToken]] = None,
    worker: str = "",
    on_rows: Optional[Callable[[int, int], None]] = None,
    on_shard_done: Optional[Callable[[ShardResult], None]] = None,
) -> WindowRun:
    """Run one window (`plan_windows`) through `llm`, all its shards in flight at once (`run_shards`),
    committing each shard as it finishes; the one run loop of `run_job` and of the flow's tasks.

    The caller holds the engine for the window (`engine_lock` where threads share one).

    Args:
        run_id, columns, structured, lease, worker, on_rows: as for `run_shards`.
        on_shard_done: called with each ShardResult right after its commit.

    Returns:
        The WindowRun: the results, the worker, the engine's quantization and step counters.

    Raises:
        Whatever `run_shards` raises; the shards committed before stay committed.
    """
    worker = worker or default_worker()
    t0 = time.perf_counter()
    stats0 = _engine_steps(llm)
    results: list[ShardResult] = []
    with contextlib.closing(run_shards(spec, window, llm, run_id=run_id, on_rows=on_rows, columns=columns,
                                       lease=lease, structured=structured, worker=worker)) as committed:
        for result in committed:
            results.append(result)
            if on_shard_done is not None:
                on_shard_done(result)
    return WindowRun(results, worker, engine_quantization(spec, llm), _engine_steps(llm, stats0),
                     time.perf_counter() - t0)


class JobInterrupted(KeyboardInterrupt):
    """The run was interrupted (Ctrl-C, SIGTERM); its cost is booked and the shards done are kept.

    Attributes:
        shards_done: shards committed, this run and earlier ones.
        shards_total: shards in the job; None when the run was interrupted while it was being
            prepared (planned), before it knew them.
        signum: the signal that interrupted it (SIGINT for a plain KeyboardInterrupt).
        report: the run's partial cost report as booked under `_job/runs/` (status "interrupted":
            the wall time so far, the rows and tokens of the shards it committed, the output
            tokens it discarded), or None when it could not be booked.
        when: where the run stopped, for messages: "after 1 of 4 shards", or "while preparing
            the job, before any shard ran".
    """

    def __init__(self, shards_done: int, shards_total: Optional[int], signum: int,
                 report: Optional[CostReport] = None) -> None:
        self.when = (f"after {shards_done} of {shards_total} shards" if shards_total is not None
                     else "while preparing the job, before any shard ran")
        super().__init__(f"interrupted {self.when}")
        self.shards_done, self.shards_total, self.signum = shards_done, shards_total, signum
        self.report = report


def _say(spec: JobSpec, text: str) -> None:
    """A progress line on stderr (with the progress bar's `progress` option)."""
    if spec.progress:
        print(f"tokenmill: {text}", file=sys.stderr, flush=True)


def run_job(
    spec: JobSpec,
    llm: Any = None,
    *,
    on_shard_done: Optional[Callable[[ShardResult], None]] = None,
) -> CostReport:
    """Run a whole job in this process: resume done shards, write outputs and the cost report.

    However the run ends, its cost is booked (a `status` of "ok", "failed" or
    "interrupted") and its lease on the output given back; a failed or interrupted run
    keeps every shard it committed, and re-running the same spec resumes.

    Args:
        spec: the job.
        llm: an `engine.LLM` to use (default: `get_llm(spec)`, loaded once per process).
        on_shard_done: called after each shard commits (progress, tests).

    Returns:
        This run's CostReport (also booked under `OUTPUT/_job/runs/`).

    Raises:
        JobInterrupted: a KeyboardInterrupt (or a subclass carrying `signum`) stopped the run; its
            `report` is the partial cost report booked for it.
        ValueError: `spec.cluster` is set (a cluster job runs through the flow).
        Everything `prepare_job` raises, and whatever failed the run (e.g. StorageError, LeaseLost).
    """
    if spec.cluster is not None:
        raise ValueError(f"cluster={spec.cluster!r}: run_job runs in this process; a cluster job runs through the "
                         f"Prefect flow (flows.batch_generate(spec), or `tokenmill run --cluster ...`)")
    plan = prepare_job(spec, tokenizer=llm.tokenizer if llm is not None else None,
                       max_model_len=getattr(llm, "max_model_len", None) if llm is not None else None)
    spec = engine_spec(spec, plan.dtype)  # "auto" as the manifest recorded it (a resume keeps it)
    results: list[ShardResult] = []
    bar = None
    out_tokens = 0
    t0 = time.perf_counter()

    def on_rows(rows: int, tokens: int) -> None:
        nonlocal out_tokens
        out_tokens += tokens
        if bar is not None:
            bar.update(rows)
            bar.set_postfix_str(f"{out_tokens / max(time.perf_counter() - t0, 1e-9):.1f} out tok/s", refresh=False)

    def quantization() -> Optional[str]:
        return engine_quantization(spec, llm)

    def committed(result: ShardResult) -> None:
        results.append(result)
        if on_shard_done is not None:
            on_shard_done(result)

    steps: Optional[dict] = None
    sampled0: Optional[int] = None
    try:
        todo = plan.rows_total - plan.rows_skipped
        if plan.rows_total == 0:
            _say(spec, f"0 rows in {spec.input}: nothing to generate, no part files")
        elif plan.pending:
            done_before = len(plan.shards) - len(plan.pending)
            _say(spec, f"{plural(todo, 'row')} in {plural(len(plan.pending), 'shard')} to run"
                       + (f" ({plural(done_before, 'shard')} done before)" if plan.rows_skipped else ""))
        if llm is None and plan.pending:
            if _loaded_llm(spec) is None:
                _say(spec, f"loading model {spec.model} ...")
            loading = _loaded_llm(spec) is None
            t_load = time.perf_counter()
            llm = get_llm(spec)
            if loading:
                _say(spec, f"model loaded in {time.perf_counter() - t_load:.1f} s")
        if spec.progress and plan.pending:
            from tqdm.auto import tqdm

            bar = tqdm(total=todo, unit="row", desc="tokenmill", dynamic_ncols=True, smoothing=0.05)
        t0 = time.perf_counter()
        sampled0 = _sampled_tokens(llm)
        for window in plan_windows(plan.pending, spec.shards_in_flight):
            run = run_window(spec, window, llm, run_id=plan.run_id, columns=plan.columns, structured=plan.structured,
                             lease=plan.lease, on_rows=on_rows, on_shard_done=committed)
            steps = add_steps(steps, run.engine_steps)
        if bar is not None:
            bar.close()
            bar = None
        report = finish_job(plan, results, model=spec.model, quantization=quantization(),
                            device=job_device(plan, results, llm), engine_steps=steps)
    except BaseException as exc:
        if bar is not None:
            bar.close()
        kept = sum(r.counts.completion_tokens for r in results)
        sampled = _sampled_tokens(llm) if sampled0 is not None else None
        # rows that finished but whose shard was not committed, and the rows cut off mid-generation
        discarded = max(out_tokens - kept, (sampled - sampled0 - kept) if sampled is not None else 0, 0)
        booked = abort_job(plan, results, exc, model=spec.model, quantization=quantization(),
                           device=job_device(plan, results, llm, look_up=False),
                           discarded_completion_tokens=discarded)
        if isinstance(exc, KeyboardInterrupt) and not isinstance(exc, JobInterrupted):
            done = len(plan.shards) - len(plan.pending) + len(results)
            raise JobInterrupted(done, len(plan.shards), int(getattr(exc, "signum", signal.SIGINT)), booked) from None
        raise
    plan.close()
    return report


def job_device(plan: JobPlan, results: list[ShardResult], llm: Any = None, look_up: bool = True) -> str:
    """The device name for the report: the spec's, else the engine's, else the one done shards recorded
    (read from storage only with `look_up`)."""
    if plan.spec.device_name:
        return plan.spec.device_name
    for r in results:
        if r.device:
            return r.device
    if llm is not None and getattr(llm, "device_name", None):
        return str(llm.device_name)
    if look_up:
        for r in done_shards(plan.spec).values():
            if r.device:
                return r.device
    return "unknown"
