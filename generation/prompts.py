"""Prompts to token ids: the one place a chat becomes its template text and ids, used by the
engine's `encode` and by the pipeline's rendering alike."""

from __future__ import annotations

from typing import Any

import torch

PROMPT_KINDS = "a prompt is a string, a list of chat messages, a list of token ids or a 1-D tensor"


def chat_text_and_ids(tokenizer: Any, messages: list[dict]) -> tuple[str, list[int]]:
    """The chat through the tokenizer's template, ready for the assistant's turn: its text and
    ids (the template holds the special tokens, so none are added)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return text, tokenizer(text, add_special_tokens=False).input_ids


def _tensor_token_ids(prompt: torch.Tensor) -> list[int]:
    """A tensor prompt is read as token ids: 1-D and of an integer dtype, or it is refused."""
    dtype = prompt.dtype
    if prompt.dim() != 1 or dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        raise TypeError(
            f"a tensor prompt must hold token ids: 1-D, integer dtype; got shape "
            f"{tuple(prompt.shape)} and dtype {prompt.dtype}"
        )
    return prompt.tolist()


def encode(tokenizer: Any, prompt: str | list | torch.Tensor) -> list[int]:
    """Token ids of a string (the tokenizer's own special tokens), a chat (its template),
    token ids as they are, or a 1-D integer tensor; TypeError for anything else."""
    if isinstance(prompt, str):
        return tokenizer(prompt).input_ids
    if isinstance(prompt, torch.Tensor):
        return _tensor_token_ids(prompt)
    if not isinstance(prompt, list | tuple):
        raise TypeError(f"{PROMPT_KINDS}; got a {type(prompt).__name__}")
    if prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    if prompt and all(isinstance(m, dict) for m in prompt):
        return chat_text_and_ids(tokenizer, list(prompt))[1]
    raise TypeError(PROMPT_KINDS)
