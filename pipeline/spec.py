"""A job's options: `JobSpec`, reading it from a file, and checking it before anything is read or written.

`JobSpec` is what `run_job`, the CLI (`--kebab-case` flags) and the flow share. `validate_spec` checks
every option against the engine's own rules (`engine.config`), in the engine's words; `spec_errors`
turns a pydantic ValidationError into one line per problem, naming where the value came from.
"""
from __future__ import annotations

import dataclasses
import json
import types
import typing
from typing import Any, Literal, Optional, Union

from pydantic import (
    BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, create_model, field_serializer,
    field_validator,
)

from engine.config import SEED_MAX, SEED_MIN, SEED_RANGE, EngineConfig, SamplingParams, declared_options
from engine.structured.params import StructuredOutputsParams
from pipeline.schema import parse_choices
from pipeline.storage import mask_secrets

# JobSpec fields passed to the engine under their own names (`engine_options` may set the others): the
# EngineConfig fields declared with `engine.config.option`, whose help text and rules they take.
ENGINE_FIELDS = tuple(declared_options())

# Engine options whose JobSpec default is the engine's value as written (the manifest fingerprints dtype
# and seed as given; "auto" is a device validation resolves); the others default to None, the engine's.
_WRITTEN_DEFAULTS = ("dtype", "device", "seed")

# JobSpec fields that change what the outputs are; any change refuses a resume. The engine's own say so
# (`option(..., changes_outputs=True)`).
FINGERPRINT_FIELDS = (
    "model", *(name for name, f in declared_options().items() if f.metadata["changes_outputs"]), "engine_options",
    "max_tokens", "temperature", "top_p", "top_k", "stop", "sampling_options",
    "system_prompt", "chat_template", "n", "id_column", "shard_size", "limit", "plan", "decode_heavy_first",
    "truncate", "structured", "score_choices", "output_format", "served_model_name",
)


# JobSpec fields always passed to SamplingParams under their own names: a `sampling_options` key may not
# set one again (their defaults count); nor `structured_outputs` when the job has a default constraint (one
# of CONSTRAINT_FIELDS), nor `score_choices` when it scores.
SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "max_tokens", "stop")


OUTPUT_FORMATS = ("parquet", "jsonl")


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


class _JobCore(BaseModel):
    """JobSpec's first fields: the input, the output and the model (see `JobSpec`)."""

    model_config = ConfigDict(extra="forbid")

    input: str = Field(description="Parquet or OpenAI Batch request (.jsonl, .jsonl.gz) file, folder/prefix or glob "
                                   "('data/*.parquet', 's3://bucket/p/*.jsonl'): s3://, gs://, file:// or local")
    output: str = Field(description="output folder/prefix URL")

    model: str = Field("smollm2-135m-instruct", description="engine model: smollm2-135m-instruct, gemma-3-270m, "
                                                            "a .gguf file, a Hugging Face folder, or dummy:<shape>")


def _engine_option_field(name: str, option: dataclasses.Field) -> tuple[Any, Any]:
    """(annotation, pydantic Field) of JobSpec's engine option `name`, from its EngineConfig field: its help
    text, its rules (`ge=1`), its allowed values (`choices`); its default is None (the engine's, named in
    the help) except for `_WRITTEN_DEFAULTS`."""
    help_text, rules, choices = option.metadata["help"], dict(option.metadata["rules"]), option.metadata["choices"]
    hint = typing.get_type_hints(EngineConfig)[name]
    annotation: Any = next((a for a in typing.get_args(hint) if a is not type(None)), hint)  # Optional[X] -> X
    if choices is not None:
        annotation = Literal[tuple(c for c in choices if c is not None)]  # type: ignore[misc]
    if name in _WRITTEN_DEFAULTS:
        return annotation, Field(option.default, description=help_text, **rules)
    if option.default is not None and "default" not in help_text:
        shown = ("on" if option.default else "off") if isinstance(option.default, bool) else option.default
        help_text = f"{help_text} (engine default {shown})"
    return Optional[annotation], Field(None, description=help_text, **rules)


_JobEngineOptions = create_model(
    "_JobEngineOptions", __base__=_JobCore, __module__=__name__,
    **{name: _engine_option_field(name, f) for name, f in declared_options().items()},
)


class JobSpec(_JobEngineOptions):
    """Everything a job needs; shared by `run_job`, the CLI (`--kebab-case` flags) and the flow.

    Engine options: model, the EngineConfig fields declared with `engine.config.option` (ENGINE_FIELDS:
    dtype, max_num_seqs, ...; None means the engine's default), plus any other EngineConfig field in
    `engine_options` (e.g. speculative_config).

    Sampling defaults (a row's `max_tokens`, `temperature`, `top_p`, `seed`,
    `stop` columns override them): max_tokens, temperature, top_p, top_k,
    stop, n, plus any other SamplingParams field in `sampling_options`.

    Output constraint (at most one; a row's `json_schema` / `regex` / `choice` / `grammar`
    column replaces it): json_schema (a file, or in YAML the schema itself), regex, choice,
    grammar (a file). Or score_choices: score each choice instead of generating.
    """

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

    output_format: Optional[str] = Field(
        None, description="what the job writes: parquet (part-*.parquet), jsonl (OpenAI Batch results-*.jsonl and "
                          "errors-*.jsonl; request-file inputs only) or parquet,jsonl; default jsonl for OpenAI Batch "
                          "request files (.jsonl), else parquet")
    served_model_name: Optional[list[str]] = Field(
        None, description="model names a request line's `model` may give besides the job's model (comma-separated)")
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

    @field_validator("output_format")
    @classmethod
    def _formats(cls, v: Optional[str]) -> Optional[str]:
        if v is None:
            return v
        parts = [p.strip() for p in v.split(",") if p.strip()]
        if not parts or any(p not in OUTPUT_FORMATS for p in parts):
            raise ValueError(f"must be parquet, jsonl or parquet,jsonl, got {v!r}")
        return ",".join(f for f in OUTPUT_FORMATS if f in parts)

    def output_formats(self) -> tuple[str, ...]:
        """What the job writes: ("parquet",), ("jsonl",) or both (`output_format`; unset: parquet)."""
        return tuple((self.output_format or "parquet").split(","))

    @field_validator("choice", "score_choices", "served_model_name", mode="before")
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
        for k in ("truncate", "structured", "score_choices", "output_format", "served_model_name"):
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
    if not (spec.cluster is not None and device == "auto"):  # (a cluster's workers resolve "auto" themselves)
        from engine.loader import attention_backend_error

        problem = attention_backend_error(config)
        if problem is not None:
            raise InvalidOption("invalid engine option", problem)
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
    _check_max_tokens(spec, params.max_tokens, config, source)  # (after the options that set the context)
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
    """Refuse, before anything is written, a `max_model_len` past the model's context and a KV block larger
    than the context (`engine.loader.max_model_len_error`, `block_size_error`, from the model's metadata).

    Raises:
        ValueError: naming max_model_len, or block_size and the context.
        UnreadableGGUF: the model's GGUF file is cut short or corrupt (`engine.gguf_index`).
    """
    from engine.gguf_index import UnreadableGGUF
    from engine.loader import block_size_error, max_model_len_error
    from engine.weights import model_config

    try:
        mcfg = model_config(source)
        problem = max_model_len_error(config, mcfg) or block_size_error(config, mcfg)
    except (ImportError, OSError, KeyError, ValueError) as exc:  # unreadable metadata: the engine checks it at load
        if isinstance(exc, UnreadableGGUF):  # a cut or corrupt model file: named now, before the tokenizer's parse
            raise
        return
    if problem is not None:
        raise InvalidOption("invalid engine option", problem)


def _check_max_tokens(spec: JobSpec, max_tokens: Optional[int], config: EngineConfig, source: Any) -> None:
    """Refuse, before anything is written, a job-wide `max_tokens` that no prompt leaves room for (at
    least the engine's context, `engine.loader.context_length`, from the model's metadata), which would
    make every row an error row; not with `truncate`, which stops each row at the context's end.

    Raises:
        InvalidOption: naming max_tokens, the context and what sets it.
    """
    if max_tokens is None or spec.truncate:
        return
    from engine.loader import context_bound, context_length
    from engine.weights import model_config

    try:
        mcfg = model_config(source)
        length, bound = context_length(config, mcfg), context_bound(config, mcfg)
    except (ImportError, OSError, KeyError, ValueError, RuntimeError):  # unreadable metadata: rows say it
        return
    if length >= 2 and max_tokens >= length:
        raise InvalidOption("invalid default sampling parameters",
                            f"max_tokens {max_tokens} does not fit the engine's context with any prompt: the "
                            f"context (max_model_len) is {length} tokens, set by {bound}, and a prompt takes at "
                            f"least 1 of them; give at most {length - 1}, or set truncate (--truncate) to stop "
                            f"at the end of the context")


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
