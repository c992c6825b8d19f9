"""Plain prompts through the model's chat template, with SmolLM2's real tokenizer."""

from __future__ import annotations

import copy

import pytest

from schemas.run import ConfigError, InputSpec, parse_run_config
from tasks.prompting import prompt_format, render_prompt, render_records
from tasks.records import Record


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from generation.loading import load_tokenizer

    return load_tokenizer(smollm2_dir)


def plain(**fields) -> InputSpec:
    return InputSpec(uri="x.jsonl", prompt_field="text", **fields)


def test_plain_prompt_goes_through_the_chat_template_by_default(tokenizer):
    text, ids = render_prompt(tokenizer, "Name a river.", plain())
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nName a river.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert ids == tokenizer(text, add_special_tokens=False).input_ids
    assert prompt_format(tokenizer, plain()) == "chat"


def test_system_prompt_replaces_the_template_default(tokenizer):
    text, _ = render_prompt(tokenizer, "Name a river.", plain(system_prompt="Answer tersely."))
    assert text.startswith("<|im_start|>system\nAnswer tersely.<|im_end|>\n<|im_start|>user\n")
    assert "SmolLM" not in text


def test_off_sends_the_raw_text(tokenizer):
    text, ids = render_prompt(tokenizer, "Once upon a time", plain(chat_template="off"))
    assert text == "Once upon a time"
    assert ids == tokenizer("Once upon a time").input_ids
    assert prompt_format(tokenizer, plain(chat_template="off")) == "raw"


def test_tokenizer_without_template_gets_raw_text_and_chats_become_error_rows(tokenizer):
    base = copy.deepcopy(tokenizer)
    base.chat_template = None
    assert render_prompt(base, "Once", plain())[0] == "Once"
    chat = InputSpec(uri="x.jsonl", messages_field="messages")
    records = [Record(0, 0, "a", [{"role": "user", "content": "hi"}], "[...]", 1)]
    good, bad = render_records(base, records, chat)
    assert not good
    assert bad[0].reason.startswith("no_chat_template:") and bad[0].record_id == "a"


def test_chats_are_stored_as_the_rendered_text(tokenizer):
    chat = InputSpec(uri="x.jsonl", messages_field="messages")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    (record,), bad = render_records(tokenizer, [Record(3, 0, "a", messages, "[...]", 1)], chat)
    assert not bad
    assert record.prompt_text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert record.prompt == tokenizer(record.prompt_text, add_special_tokens=False).input_ids


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"prompt_field": "t", "chat_template": "off", "system_prompt": "x"},
         "input.system_prompt needs input.chat_template: auto"),
        ({"messages_field": "m", "system_prompt": "x"}, "system_prompt applies to prompt_field"),
        ({"messages_field": "m", "chat_template": "off"}, "messages_field chats need the template"),
        ({"prompt_field": "t", "chat_template": "never"}, "input.chat_template"),
    ],
)
def test_contradictory_template_settings_are_config_errors(fields, message):
    config = {"input": {"uri": "x.jsonl", **fields}, "output": "out",
              "generation": {"engine": {"target": {"path": "m"}}}}
    with pytest.raises(ConfigError, match=message):
        parse_run_config(config)
