"""Turn a record's prompt into the exact text and token ids the engine is given.

Instruct models answer a bare string with little or nothing (39 of 40 completions came back
empty on SmolLM2-135M-Instruct), so plain prompts go through the tokenizer's chat template as
one user message unless `input.chat_template` is `off` (base models). The data table stores
the rendered text, so each row shows exactly what the model saw.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from generation.prompts import chat_text_and_ids
from reporting.estimate import PromptCounts, PromptShape
from schemas.run import OPENAI_BATCH, InputSpec, RunConfig
from tasks.batch_requests import read_records, shard_sampling
from tasks.planning import Shard
from tasks.records import BadRecord, Prompt, Record, truncate
from tasks.storage import filesystem

CHAT, RAW = "chat", "raw"


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def prompt_format(tokenizer: Any, spec: InputSpec) -> str:
    """`chat` when prompts go through the chat template, `raw` when they are sent as text."""
    chats = spec.messages_field or spec.format == OPENAI_BATCH
    if chats or (spec.chat_template == "auto" and has_chat_template(tokenizer)):
        return CHAT
    return RAW


def render_prompt(tokenizer: Any, prompt: Prompt, spec: InputSpec) -> tuple[str, list[int]]:
    """(text sent, its token ids); ValueError when a chat cannot be templated."""
    if prompt_format(tokenizer, spec) == RAW:
        text = prompt if spec.system_prompt is None else f"{spec.system_prompt}\n\n{prompt}"
        return text, tokenizer(text).input_ids  # the tokenizer's own BOS etc., as for raw text
    if isinstance(prompt, str):
        system = [] if spec.system_prompt is None else [
            {"role": "system", "content": spec.system_prompt}
        ]
        prompt = [*system, {"role": "user", "content": prompt}]
    if not has_chat_template(tokenizer):
        raise ValueError(
            "no_chat_template: the tokenizer has no chat template for chats (messages_field, "
            "openai_batch); use prompt_field/template with input.chat_template: off"
        )
    return chat_text_and_ids(tokenizer, prompt)


def render_records(
    tokenizer: Any, records: list[Record], spec: InputSpec
) -> tuple[list[Record], list[BadRecord]]:
    """Records whose prompt is now token ids and whose prompt_text is the text sent."""
    rendered, bad = [], []
    for record in records:
        try:
            text, ids = render_prompt(tokenizer, record.prompt, spec)
        except ValueError as error:
            bad.append(BadRecord(record.row, record.offset, record.record_id, str(error),
                                 truncate(record.prompt_text)))
            continue
        rendered.append(replace(record, prompt=ids, prompt_text=text,
                                input_prompt=record.prompt_text))
    return rendered, bad


def count_prompts(config: RunConfig, shards: list[Shard], tokenizer: Any) -> PromptCounts:
    """Read every shard and render its prompts as a shard would (the chat template included),
    with the target's tokenizer alone: what `corpusgen plan` estimates from."""
    input_fs, _ = filesystem(config.input.uri, config.storage)
    rows = bad_rows = 0
    prompts: list[PromptShape] = []
    samples = config.generation.samples_per_prompt
    for shard in shards:
        good, bad = read_records(input_fs, shard, config)
        rendered, unrenderable = render_records(tokenizer, good, config.input)
        rows += len(good) + len(bad)
        bad_rows += len(bad) + len(unrenderable)
        max_new_tokens = shard_sampling(shard, config).max_new_tokens
        prompts += [PromptShape(len(r.prompt), r.samples or samples, max_new_tokens)
                    for r in rendered]
    return PromptCounts(rows, bad_rows, prompts, prompt_format(tokenizer, config.input))
