"""Run configuration: what to read, how to generate, where to commit, what it may cost.

Loaded from YAML or JSON, overridable with `--set a.b=value`. The config never holds
credentials: S3 keys come from the environment or a named Prefect Secret block, so a config
(and its hash) can be written next to the outputs safely.
"""

from __future__ import annotations

import hashlib
import json
import string
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from schemas.engine import EngineConfig, ResponseFormat, SamplingParams, StrictModel
from schemas.pricing import UnknownDeviceError, load_prices, price_for

InputFormat = Literal["auto", "jsonl", "jsonl.gz", "parquet", "openai_batch", "run"]
OPENAI_BATCH = "openai_batch"
RUN_OUTPUT = "run"  # another corpusgen run's <output>/data: a chain step (tasks/chains.py)


class ConfigError(ValueError):
    """A config that cannot run; the message lists every bad field and what is expected."""


class InputSpec(StrictModel):
    """Where records come from and how a record becomes a prompt.

    Exactly one of `prompt_field` (plain text), `template` (`{field}` placeholders filled from the
    record) or `messages_field` (a chat: list of {"role", "content"}) says how to build the prompt,
    except for `format: openai_batch`, whose lines say it themselves (custom_id, body.messages).
    Plain prompts are sent as one user message through the model's chat template (`auto`, when
    the tokenizer has one: instruct models answer raw text with nothing), or as raw text (`off`,
    for base models).
    """

    uri: str = Field(description="file, directory or glob; local path or s3://bucket/key")
    format: InputFormat = Field(
        "auto", description="auto = from the file extension; openai_batch: an OpenAI Batch API "
        "file (.jsonl) of /v1/chat/completions requests: custom_id is the id, body.messages the "
        "chat, and body's sampling fields override generation.sampling; run: another "
        "run's `<output>/data` (auto when input.uri is one): a chain step",
    )
    id_field: str | None = Field(None, description="stable record id; default source:offset")
    prompt_field: str | None = Field(None, description="the field holding a plain-text prompt")
    template: str | None = Field(
        None, description="a prompt made of the record's fields: `Summarise {title}: {body}`"
    )
    messages_field: str | None = Field(
        None, description="the field holding a chat: a list of {role, content} messages"
    )
    chat_template: Literal["auto", "off"] = Field(
        "auto", description="auto: plain prompts go through the tokenizer's chat template if any"
    )
    system_prompt: str | None = Field(
        None, description="system message for plain prompts sent through the chat template"
    )
    model_name: str | None = Field(
        None, description="openai_batch: the body.model requests may name besides the target's "
        "path and that path's last part (packaged:<name>: <name>)",
    )
    run_id: str | None = Field(
        None, pattern=r"^[A-Za-z0-9_-]+$", description="a chain step (input.uri is another "
        "run's `<output>/data`): the upstream run it reads; default the newest complete one, "
        "pinned when the step starts",
    )
    on_invalid_utf8: Literal["error", "replace"] = Field(
        "error",
        description="a JSONL line that is not UTF-8: an error row `invalid_utf8` naming its "
        "byte offset, or read with U+FFFD in place of the bad bytes",
    )

    @model_validator(mode="after")
    def _one_prompt_source(self) -> InputSpec:
        given = [f for f in ("prompt_field", "template", "messages_field") if getattr(self, f)]
        if self.format == OPENAI_BATCH:
            return self._batch_file_alone(given)
        if self.model_name is not None:
            raise ValueError("input.model_name applies to input.format: openai_batch only")
        if self.format == RUN_OUTPUT and self.id_field is not None:
            raise ValueError("input.id_field: a chain step's ids come from the upstream "
                             "records (parent_id, #sample_index); remove it")
        if len(given) != 1:
            raise ValueError(
                "set exactly one of input.prompt_field, input.template, input.messages_field "
                f"(got {given or 'none'})"
            )
        if self.template is not None:
            fields = template_fields(self.template)
            if not fields:
                raise ValueError("input.template needs at least one {field} placeholder")
        if self.system_prompt is not None and self.messages_field:
            raise ValueError(
                "input.system_prompt applies to prompt_field/template inputs; with "
                "messages_field put a {'role': 'system'} message first in each chat"
            )
        if self.system_prompt is not None and self.chat_template == "off":
            raise ValueError("input.system_prompt needs input.chat_template: auto")
        if self.messages_field and self.chat_template == "off":
            raise ValueError(
                "input.chat_template: off sends raw text, but messages_field chats need the "
                "template; use prompt_field/template for raw text"
            )
        return self

    def _batch_file_alone(self, given: list[str]) -> InputSpec:
        """A batch file's lines hold the id, the chat and the sampling overrides."""
        given += [f for f in ("id_field", "system_prompt") if getattr(self, f) is not None]
        if given:
            raise ValueError(
                f"input.format: openai_batch takes the id from custom_id and the chat from "
                f"body.messages; remove input.{', input.'.join(given)}"
            )
        if self.chat_template == "off":
            raise ValueError("input.format: openai_batch chats need input.chat_template: auto")
        return self


def template_fields(template: str) -> list[str]:
    """The `{field}` names a template uses; raises ValueError on a malformed template."""
    names = []
    for _, name, spec, conversion in string.Formatter().parse(template):
        if name is None:
            continue
        if not name.isidentifier() or spec or conversion:
            raise ValueError(
                f"input.template placeholder {{{name}}} must be a plain field name like {{title}}"
            )
        names.append(name)
    return names


class GenerationSpec(StrictModel):
    """What generates: the engine (models, shapes) and how it samples."""

    engine: EngineConfig
    sampling: SamplingParams = SamplingParams()
    warmup: bool = Field(True, description="compile/run every grid shape once per worker")
    samples_per_prompt: int = Field(
        1, ge=1, description="completions per record, each with its own derived seed"
    )
    response_format: ResponseFormat | None = Field(
        None, description="structured records, in OpenAI's shape: {type: json_schema, "
        "json_schema: {name, schema}} | {type: json_object} | {type: regex, pattern} | "
        "{type: choice, choices}; null: free text",
    )

    @model_validator(mode="after")
    def _response_format_in_one_place(self) -> GenerationSpec:
        if self.sampling.response_format is not None:
            raise ValueError("set generation.response_format, not "
                             "generation.sampling.response_format")
        return self

    @property
    def engine_sampling(self) -> SamplingParams:
        """What the engine is called with: `sampling` under the run's response format."""
        return self.sampling.model_copy(update={"response_format": self.response_format})


class ShardingSpec(StrictModel):
    """How the input is cut into shards: one Prefect task and one commit each."""

    rows_per_shard: int = Field(
        256, ge=1, description="a target, not an exact count: JSONL is cut at byte offsets "
        "sized from a sample of its lines (shards vary with line lengths), Parquet at whole "
        "row groups, a .gz file is one shard",
    )


class StorageSpec(StrictModel):
    """How to reach object storage. Holds no secrets: only where to find them."""

    endpoint_url: str | None = Field(
        None, description="an S3-compatible endpoint (MinIO, a moto server); None: AWS"
    )
    key_env: str = Field("AWS_ACCESS_KEY_ID", description="env var holding the access key")
    secret_env: str = Field("AWS_SECRET_ACCESS_KEY", description="env var holding the secret")
    prefect_secret_block: str | None = Field(
        None, description='Prefect Secret block whose value is {"key": ..., "secret": ...}'
    )


class PricingSpec(StrictModel):
    """What a device-hour costs, for cost per 1M tokens (prices are configuration)."""

    device_type: str = Field("cpu", description="key into the price table")
    usd_per_device_hour: float | None = Field(None, ge=0, description="overrides the price table")
    prices_file: str | None = Field(
        None, description="your price table (schemas/prices.yaml's format); default that file"
    )

    @model_validator(mode="after")
    def _priced(self) -> PricingSpec:
        if self.usd_per_device_hour is None:
            try:
                self.usd_per_hour()
            except UnknownDeviceError as error:
                raise ValueError(f"{error}; or set pricing.usd_per_device_hour") from None
            except OSError as error:
                raise ValueError(f"pricing.prices_file: {error}") from None
        return self

    def usd_per_hour(self) -> float:
        if self.usd_per_device_hour is not None:
            return self.usd_per_device_hour
        return price_for(load_prices(self.prices_file), self.device_type).usd_per_hour


class DispatchSpec(StrictModel):
    """local: shard tasks run in this flow's process. deployment: batches of shards are sent to
    a `generate_shards` deployment (one flow run per batch, e.g. one pod per accelerator)."""

    mode: Literal["local", "deployment"] = Field(
        "local", description="local: shards run in this flow's process; deployment: batches "
        "of shards go to `dispatch.deployment`'s workers"
    )
    deployment: str = Field(
        "generate-shards/default", description="the generate_shards deployment (flow/name)"
    )
    shards_per_run: int = Field(4, ge=1, description="shards per deployment flow run")


FilterOp = Literal[">=", ">", "<=", "<", "==", "!="]


class KeepFilter(StrictModel):
    """Keep a record when `field op value` holds; the run's filter step sends any other record
    to `filtered/` with the reason and this rule. `field` is a key of this run's structured
    record (the parsed completion), else a column or structured field of the upstream record
    (a chain step)."""

    kind: Literal["keep"] = Field(description="keep: the records the comparison holds for")
    field: str = Field(description="a key of the parsed completion or an upstream column")
    op: FilterOp = Field(description="how the record's value compares with `value`")
    value: float | int | str | bool = Field(description="what the field is compared with")

    def describe(self) -> str:
        return f"keep {self.field} {self.op} {json.dumps(self.value)}"


class DedupFilter(StrictModel):
    """Drop records whose completion duplicates another's, keeping one record of each cluster.

    Completions are compared normalised (NFKC, case-folded, punctuation dropped, whitespace
    collapsed). `exact` drops identical normalised text; `minhash` also drops near-duplicates:
    Jaccard similarity of their 3-word shingle sets at about `threshold` or more (MinHash LSH),
    clustered transitively. Each cluster keeps its smallest (id, sample_index), or the record an
    earlier run already kept (scope output)."""

    kind: Literal["dedup"] = Field(description="which filter; dedup: drop duplicate completions")
    method: Literal["exact", "minhash"] = Field(
        "minhash", description="exact: identical normalised text; minhash: near-duplicates too"
    )
    threshold: float = Field(
        0.85, ge=0.5, le=0.95, description="minhash: the similarity (Jaccard of the two "
        "completions' 3-word shingle sets) from which they are duplicates; LSH catches pairs "
        "above it with high probability",
    )
    scope: Literal["run", "output"] = Field(
        "run", description="run: duplicates within this run; output: also against the records "
        "earlier runs with this rule kept in this output (an index beside it)",
    )

    @model_validator(mode="after")
    def _threshold_is_minhash_only(self) -> DedupFilter:
        if self.method == "exact" and "threshold" in self.model_fields_set:
            raise ValueError(
                "threshold applies to method minhash only (exact drops identical normalised "
                "text); remove it or set method: minhash"
            )
        return self


# One entry of `filters`, told apart by `kind`: a new kind of filter is one more model in this
# union and one more name in FILTER_KINDS.
FilterSpec = Annotated[DedupFilter | KeepFilter, Field(discriminator="kind")]
FILTER_KINDS = ("dedup", "keep")


class RunConfig(StrictModel):
    """A corpus run: input, generation, output and what it may cost."""

    input: InputSpec
    generation: GenerationSpec
    output: str = Field(description="output root, local path or s3://bucket/prefix")
    sharding: ShardingSpec = ShardingSpec()
    storage: StorageSpec = StorageSpec()
    accelerator_slots: int = Field(
        1, ge=1, description="deployment workers generating at once; local: shards in flight"
    )
    devices_per_slot: int = Field(1, ge=1, description="devices one engine occupies (for cost)")
    concurrency_limit: str = Field(
        "corpusgen-accelerators", description="Prefect global concurrency limit name"
    )
    seed: int = Field(0, description="with each record's id, seeds its sampling (stable reruns)")
    max_error_fraction: float = Field(
        0.5, ge=0, le=1, description="fail the run when more of its rows are error rows"
    )
    max_empty_fraction: float = Field(
        0.5, ge=0, le=1, description="fail the run when more of its completions are blank"
    )
    max_looping_fraction: float = Field(
        0.5, ge=0, le=1, description="fail the run when more of its completions end in a loop: "
        "one unit of text (up to 200 characters) said 4 or more times in a row to the end, "
        "making up half the completion or more"
    )
    pricing: PricingSpec = PricingSpec()
    cost_cap_usd: float | None = Field(
        None, gt=0, description="no new shard starts once the projected cost would pass it"
    )
    dispatch: DispatchSpec = DispatchSpec()
    shard_timeout_seconds: float = Field(3600, gt=0, description="a shard task's time limit")
    shard_retries: int = Field(2, ge=0, description="retries on I/O errors, exponential backoff")
    shard_lease_seconds: float = Field(
        60, ge=1, description="a shard's lease: a second run of this config skips a shard "
        "leased by a live run, and takes it over once the lease expires (its holder died)",
    )
    filters: list[FilterSpec] = Field(
        [], description="applied in order once the whole run is generated, each to the records "
        'the earlier ones kept (e.g. {kind: keep, field: score, op: ">=", value: 4}, then a '
        "dedup): kept records go to data/, dropped ones to filtered/ with the rule and why. "
        "Part of the run's identity",
    )
    run_id: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9_-]+$",
        description="default: derived from what determines the output, so reruns resume; "
        "set one to start a separate run (`--set run_id=nightly-2`)",
    )

    @field_validator("filters")
    @classmethod
    def _one_dedup(cls, filters: list[FilterSpec]) -> list[FilterSpec]:
        if sum(f.kind == "dedup" for f in filters) > 1:
            raise ValueError("at most one dedup entry (minhash also drops exact duplicates)")
        return filters

    def resolved_run_id(self) -> str:
        """Same input/generation/sharding/seed/output (and filters, when set) -> same run id
        -> a rerun resumes. Filters decide what data/ holds, so they are part of the run."""
        if self.run_id:
            return self.run_id
        # Fields a version added count only when set, so earlier runs keep their ids.
        identity = self.model_dump(
            mode="json", include={"input", "generation", "sharding", "seed", "output"}
        )
        if identity["input"]["run_id"] is None:
            del identity["input"]["run_id"]
        if self.filters:
            identity["filters"] = [rule.model_dump(mode="json") for rule in self.filters]
        return "r" + _sha256_json(identity)[:12]

    def config_hash(self) -> str:
        """Hash of the whole config; it holds no secrets by construction."""
        return _sha256_json(self.model_dump(mode="json"))[:16]


def _sha256_json(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def format_validation_error(error: ValidationError) -> str:
    lines = [f"invalid run config ({error.error_count()} problem(s)):"]
    for item in error.errors():
        loc = item["loc"]
        if loc[:1] == ("filters",) and len(loc) > 2:  # drop the `kind` tag pydantic adds
            loc = loc[:2] + loc[3:]
        where = ".".join(str(part) for part in loc) or "(top level)"
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            message = "unknown field; remove it (credentials belong in the environment)"
        elif item["type"] in ("union_tag_invalid", "union_tag_not_found"):
            message = f"kind must be one of: {', '.join(FILTER_KINDS)}"
        lines.append(f"  - {where}: {message}")
    return "\n".join(lines)


def set_override(data: dict[str, Any], assignment: str) -> None:
    """Apply one `a.b=value` override in place; value is parsed as YAML (numbers, lists, null)."""
    if "=" not in assignment:
        raise ConfigError(f"--set {assignment!r}: expected KEY=VALUE, e.g. seed=3")
    key, raw = assignment.split("=", 1)
    parts = key.strip().split(".")
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {key}: {part!r} is not a section")
        node = child
    node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else ""


def parse_run_config(
    source: RunConfig | dict[str, Any] | str | Path, overrides: tuple[str, ...] | list[str] = ()
) -> RunConfig:
    """Build a RunConfig from a dict or a YAML/JSON file path; ConfigError lists all problems."""
    if isinstance(source, RunConfig) and not overrides:
        return source
    if isinstance(source, RunConfig):
        data = source.model_dump(mode="json")
    elif isinstance(source, dict):
        data = json.loads(json.dumps(source))
    else:
        path = Path(source)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} not found")
        try:
            data = yaml.safe_load(path.read_text())  # JSON is YAML too
        except yaml.YAMLError as error:
            raise ConfigError(f"config file {str(path)!r} is not YAML/JSON: {error}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {str(path)!r} must hold a mapping at the top level")
    for assignment in overrides:
        set_override(data, assignment)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as error:
        raise ConfigError(format_validation_error(error)) from None
