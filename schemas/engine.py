"""Engine configuration: which models, which shape grid, how to sample.

Plain pydantic data; nothing here imports the engine, so flows and tasks can validate configs
without loading torch.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

PACKAGED_PREFIX = "packaged:"
# Names only (schemas import nothing of the project): generation/loading.py says where each lives.
PACKAGED_MODELS = (
    "smollm2-135m-instruct", "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct",
)
DType = Literal["float32", "bfloat16", "float16"]
# First-step widths of a model draft: how far its cache may lag the context (K auto runs plain
# steps that skip the draft). Here, not in generation/, so configs can be checked without torch.
CATCH_UP_WIDTHS = [2, 4, 8, 16, 32, 64]
MIN_TEMPERATURE = 1e-3  # below it logits / T overflow float32 (1e-40 gave NaN); 0 means greedy


class StrictModel(BaseModel):
    """Every config section: unknown fields are an error (a typo, or a secret that does not
    belong in a config), and a parsed config never changes."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSpec(StrictModel):
    """Where a model's weights come from.

    `path` is a local Hugging Face directory (config.json + safetensors + tokenizer), a `.gguf`
    file (dequantised once and cached as safetensors), or `packaged:<name>` (PACKAGED_MODELS).
    """

    path: str = Field(
        description="a Hugging Face directory, a .gguf file, or packaged:<name> "
        f"({', '.join(PACKAGED_MODELS)})"
    )
    dtype: DType = Field("float32", description="weights and activations")
    quantize: Literal["int8", "int4", "int4+int8"] | None = Field(
        None,
        description="int8: linears as int8 weights per output channel (7 bits and a sign on "
        "CPUs without AVX-512 VNNI, where 8 would saturate fbgemm's int16 sums) x per-row int8 "
        "activations, an exact integer GEMM (fbgemm's, else torch._int_mm), so results stay "
        "batch-invariant (fit for a target); activations smoothed per channel (SmoothQuant, "
        "from one forward of a fixed text at load); the fastest decode with AVX2 code and on "
        "an AVX-512 VNNI EPYC; dtype is the rest's. int4: "
        "4-bit weights (groups of 32) with bf16 activations (needs dtype bfloat16), each row "
        "computed alone, batch-invariant too; a GGUF keeps its own 4-bit blocks (Q4_0, Q4_1, "
        "Q4_K) and its other linears in bf16, a float checkpoint is rounded to 4 bits. "
        "int4+int8: int4, with a GGUF's other linears (Q5_0, Q6_K, Q8_0) re-rounded to int8 "
        "per output channel (~1-2 % of their RMS) for torch's int8 weight-only kernel: a "
        "quarter of the bytes they read where bf16 computes in fp32 (CPUs without AVX-512 BF16)",
    )

    @property
    def name(self) -> str:
        """The path, marked `#int8` / `#int4` when quantized: what metrics call this model."""
        return self.path + (f"#{self.quantize}" if self.quantize else "")

    @property
    def four_bit(self) -> bool:
        """Whether linears run 4-bit groups (quantize: int4 or int4+int8)."""
        return self.quantize in ("int4", "int4+int8")

    @model_validator(mode="after")
    def _int4_computes_in_bf16(self) -> ModelSpec:
        if self.four_bit and self.dtype != "bfloat16":
            raise ValueError(
                f"quantize: {self.quantize} multiplies bf16 activations (torch's CPU kernels), not "
                f"{self.dtype}; set dtype: bfloat16 beside it"
            )
        return self

    @field_validator("path")
    @classmethod
    def _known_packaged_model(cls, path: str) -> str:
        if path.startswith(PACKAGED_PREFIX) and path[len(PACKAGED_PREFIX) :] not in PACKAGED_MODELS:
            names = ", ".join(PACKAGED_PREFIX + name for name in PACKAGED_MODELS)
            raise ValueError(f"unknown packaged model {path!r}; available: {names}")
        return path


class DraftSpec(StrictModel):
    """What proposes the tokens the target verifies.

    kind="model": a separate, smaller model sharing the target's tokenizer (dtype int8: its
    linears quantized at load time; a draft's precision moves speed, never the tokens).
    kind="quantized": the target itself at lower precision, built at load time.
    kind="prompt_lookup": copy the continuation of the last n-gram match in the prompt/text so far.
    """

    kind: Literal["model", "quantized", "prompt_lookup"] = Field(
        description="model: a smaller model with the target's tokenizer; quantized: the "
        "target at lower precision; prompt_lookup: copies n-grams of the prompt and text"
    )
    model: ModelSpec | None = Field(None, description="kind=model: the draft model")
    dtype: Literal["int8", "int4", "bfloat16"] | None = Field(
        None,
        description="int8: W8A8 dynamic on x86; int4: 4-bit weights (groups of 32), bf16 "
        "activations. kind=quantized: int8 (the default), int4 or bfloat16; kind=model: int8, "
        "int4, or None for draft.model.dtype as loaded",
    )
    compile: bool | None = Field(
        None,
        description="torch.compile(dynamic=False) the draft's per-token steps ([b, 1] and a "
        "round's first [b, 2]; its prefills and catch-ups run eager); None: as "
        "EngineConfig.compile. On CPU an int8 draft gains from it where a packed bf16 target "
        "runs fastest eager (bench/README.md)",
    )
    ngram_max: int = Field(3, ge=1, le=8, description="prompt_lookup: longest n-gram matched")
    ngram_min: int = Field(1, ge=1, le=8, description="prompt_lookup: shortest n-gram matched")

    @model_validator(mode="after")
    def _model_iff_kind_model(self) -> DraftSpec:
        if self.kind == "model" and self.model is None:
            raise ValueError("draft.kind='model' needs draft.model (a ModelSpec)")
        if self.kind != "model" and self.model is not None:
            raise ValueError(f"draft.model is only used with kind='model', not {self.kind!r}")
        if self.kind == "model" and self.dtype == "bfloat16":
            raise ValueError("a model draft's bf16 is draft.model.dtype: bfloat16, not draft.dtype")
        for name in ("dtype", "compile"):  # prompt lookup has no weights and no forwards
            if self.kind == "prompt_lookup" and getattr(self, name) is not None:
                raise ValueError(
                    f"draft.{name} is for kind 'model' or 'quantized', not prompt_lookup"
                )
        if self.ngram_min > self.ngram_max:
            raise ValueError("draft.ngram_min must be <= draft.ngram_max")
        return self


def _ascending_unique(values: list[int], name: str) -> list[int]:
    if not values or any(v <= 0 for v in values):
        raise ValueError(f"{name} must be a non-empty list of positive integers")
    return sorted(set(values))


class BucketGrid(StrictModel):
    """The static shapes every forward is padded to, so compiled / HPU graphs are reused."""

    batch_sizes: list[int] = Field([1, 2, 4, 8], description="rows per forward")
    prompt_lengths: list[int] = Field(
        [32, 64, 128, 256], description="prefill lengths; a longer prompt is an error row"
    )
    cache_lengths: list[int] = Field(
        [128, 256, 512], description="KV cache lengths attended; the largest bounds prompt + "
        "completion (a row reaching it ends with finish_reason cache_full)"
    )
    draft_lengths: list[int] = Field(default=[2, 4, 6], description="K values speculation may use")

    @field_validator("batch_sizes", "prompt_lengths", "cache_lengths", "draft_lengths")
    @classmethod
    def _sorted(cls, values: list[int], info) -> list[int]:
        return _ascending_unique(values, info.field_name)

    @model_validator(mode="after")
    def _cache_holds_prompts(self) -> BucketGrid:
        if self.cache_lengths[-1] <= self.prompt_lengths[-1]:
            raise ValueError(
                "bucket_grid.cache_lengths: the largest cache length "
                f"({self.cache_lengths[-1]}) must exceed the largest prompt length "
                f"({self.prompt_lengths[-1]}) to leave room for generated tokens"
            )
        return self

    @property
    def max_batch(self) -> int:
        return self.batch_sizes[-1]

    @property
    def max_prompt(self) -> int:
        return self.prompt_lengths[-1]

    @property
    def max_cache(self) -> int:
        return self.cache_lengths[-1]

    @property
    def max_context(self) -> int:
        """Prompt + generated tokens a row may reach: the largest cache bucket, less room for
        the widest verify round (kept with or without a draft, so both stop at one length)."""
        return self.max_cache - self.draft_lengths[-1] - 1


class EngineConfig(StrictModel):
    """Everything needed to build an `Engine`."""

    target: ModelSpec = Field(description="the model whose distribution the output follows")
    draft: DraftSpec | None = Field(None, description="None: plain decoding")
    num_draft_tokens: int | Literal["auto"] = Field(
        "auto", description="K per speculation round: one of bucket_grid.draft_lengths, or auto"
    )
    stop_drafting_early: bool = Field(
        True,
        description="K auto: each round drafts up to the largest K and ends at a smaller grid "
        "K where the draft's confidence (prompt lookup: its n-gram match) says more would not pay",
    )
    device: Literal["auto", "cpu", "cuda", "hpu"] = Field(
        "auto", description="auto: a Gaudi card, else CUDA, else the CPU"
    )
    bucket_grid: BucketGrid = BucketGrid()
    compile: bool = Field(False, description="torch.compile(dynamic=False) on cpu/cuda")
    hpu_graphs: bool = Field(True, description="wrap_in_hpu_graph on Gaudi")
    cuda_graphs: bool = Field(
        False, description="on cuda: capture one CUDA graph per grid shape and replay it"
    )
    cpu_threads: int | None = Field(
        None,
        ge=1,
        description="torch intra-op threads on cpu; on a shared host 1 avoids waiting for a busy "
        "core in every parallel region. None keeps torch's default",
    )

    def draft_model_name(self) -> str | None:
        """The metrics' draft_model: its path (`path#int8` / `path#int4` quantized),
        `target#kind` for a target-derived draft, None."""
        if self.draft is None:
            return None
        if self.draft.kind == "model":
            return self.draft.model.name + (f"#{self.draft.dtype}" if self.draft.dtype else "")
        return f"{self.target.name}#{self.draft.kind}"

    @model_validator(mode="after")
    def _k_on_grid(self) -> EngineConfig:
        k = self.num_draft_tokens
        if k != "auto" and k not in self.bucket_grid.draft_lengths:
            raise ValueError(
                f"num_draft_tokens={k} is not on bucket_grid.draft_lengths "
                f"{self.bucket_grid.draft_lengths}; use one of those or 'auto'"
            )
        return self

    @model_validator(mode="after")
    def _quantized_draft_of_a_float_target(self) -> EngineConfig:
        """A quantized draft re-rounds the target's float linears; a target already int8 or
        int4 has none left (its copy would be the target itself)."""
        if self.draft is not None and self.draft.kind == "quantized" and self.target.quantize:
            raise ValueError(
                f"draft.kind: quantized copies a float target at lower precision, but the "
                f"target is already {self.target.quantize}; use draft.kind: model or "
                "prompt_lookup"
            )
        return self

    @model_validator(mode="after")
    def _cache_holds_draft_catch_up(self) -> EngineConfig:
        """A model draft under K auto may lag by up to the widest catch-up window."""
        model_draft = self.draft is not None and self.draft.kind != "prompt_lookup"
        widest, largest = CATCH_UP_WIDTHS[-1], self.bucket_grid.max_cache
        if model_draft and self.num_draft_tokens == "auto" and largest < widest:
            raise ValueError(
                f"bucket_grid.cache_lengths: the largest cache length ({largest}) is below the "
                f"draft catch-up width ({widest}) a {self.draft.kind!r} draft needs with "
                f"num_draft_tokens='auto'; add a cache length >= {widest} or fix "
                "num_draft_tokens to one of bucket_grid.draft_lengths"
            )
        return self


class JsonSchemaFormat(StrictModel):
    """OpenAI's `json_schema` object: the schema a record must validate against."""

    name: str = Field("record", description="a name for the schema (OpenAI's shape)")
    schema_: dict = Field(alias="schema", description="the JSON schema every record follows")
    strict: bool | None = Field(None, description="accepted as OpenAI has it; always strict")
    description: str | None = None

    model_config = ConfigDict(
        extra="forbid", frozen=True, populate_by_name=True, serialize_by_alias=True
    )


class ResponseFormat(StrictModel):
    """Structured output in OpenAI's shape: a JSON schema, any JSON object, a regex or one of
    fixed choices. Every completion then parses under it; a row cut before it closes is an
    error row (incomplete_structured_output)."""

    type: Literal["json_schema", "json_object", "regex", "choice"] = Field(
        description="what the completion must be"
    )
    json_schema: JsonSchemaFormat | None = Field(None, description="type json_schema: the schema")
    pattern: str | None = Field(None, description="type regex: the whole completion matches it")
    choices: list[str] | None = Field(None, description="type choice: the completion is one")

    @model_validator(mode="after")
    def _what_its_type_needs(self) -> ResponseFormat:
        needs = {"json_schema": "json_schema", "regex": "pattern", "choice": "choices"}
        for kind, name in needs.items():
            given = getattr(self, name) is not None
            if given != (self.type == kind):
                raise ValueError(f"response_format.{name} goes with type {kind!r} only"
                                 if given else f"response_format type {kind!r} needs {name}")
        if self.choices is not None and (not self.choices or "" in self.choices):
            raise ValueError("response_format.choices must be non-empty strings")
        if self.json_schema is not None:
            _check_json_schema(self.json_schema.schema_)
        error = _grammar_error(self.grammar())
        if error:
            raise ValueError(f"response_format {self.type} is not usable: {error}")
        return self

    def grammar(self) -> str:
        """The llguidance grammar: compact JSON (", " and ": " separators) for JSON types."""
        import json

        import llguidance

        if self.type == "regex":
            return llguidance.grammar_from("regex", self.pattern)
        if self.type == "choice":
            return llguidance.grammar_from("choice", json.dumps(self.choices))
        schema = self.json_schema.schema_ if self.json_schema else {"type": "object"}
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)


JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _check_json_schema(schema: dict) -> None:
    """A schema the records can be validated against (jsonschema's meta-schema check)."""
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as error:
        where = "/".join(str(part) for part in error.absolute_path) or "(root)"
        raise ValueError(f"response_format.json_schema.schema at {where}: "
                         f"{error.message}") from None


def _grammar_error(grammar: str) -> str:
    """llguidance's complaint about a grammar, on one line; empty when it compiles."""
    import llguidance

    return " ".join(llguidance.LLMatcher.validate_grammar(grammar, None).split())


class SamplingParams(StrictModel):
    """How to pick tokens. temperature 0 means greedy."""

    max_new_tokens: int = Field(64, ge=1, description="tokens per completion at most")
    temperature: float = Field(0.0, ge=0.0, description=f"0 (greedy) or >= {MIN_TEMPERATURE}")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling; 1 disables it")
    top_k: int = Field(0, ge=0, description="0 disables top-k")
    stop: list[str] = Field([], description="strings that end a completion (not kept)")
    stop_token_ids: list[int] = Field([], description="token ids that end a completion")
    seed: int = Field(0, description="engine API only: the pipeline seeds each record itself")
    response_format: ResponseFormat | None = Field(
        None, description="structured output (OpenAI's shape); None: free text"
    )
    logprobs: bool = Field(
        False, description="record each kept token's log-probability under the distribution "
        "sampled (temperature, top-k/top-p and response_format applied; greedy: temperature 1)",
    )
    verification: Literal["coupled", "rejection"] = Field(
        "coupled",
        description="coupled: per-position seeded noise, a completion is the same with any "
        "draft, K and batch; rejection: rejection sampling, higher acceptance, but "
        "completions depend on K and the draft",
    )

    @field_validator("temperature")
    @classmethod
    def _temperature_floor(cls, temperature: float) -> float:
        if 0.0 < temperature < MIN_TEMPERATURE:
            raise ValueError(
                f"temperature {temperature:g} is below {MIN_TEMPERATURE:g}, where logits / "
                "temperature overflow; use 0 for greedy decoding or a temperature "
                f">= {MIN_TEMPERATURE:g}"
            )
        return temperature

    @field_validator("stop")
    @classmethod
    def _no_empty_stop_string(cls, stop: list[str]) -> list[str]:
        if any(s == "" for s in stop):
            raise ValueError(
                f"stop contains an empty string (at index {stop.index('')}), which every "
                "text contains: it would end each completion after one token; remove it"
            )
        return stop

    @field_validator("stop_token_ids")
    @classmethod
    def _token_ids_not_negative(cls, ids: list[int]) -> list[int]:
        if any(i < 0 for i in ids):
            raise ValueError(f"stop_token_ids must be token ids >= 0, got {ids}")
        return ids

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
