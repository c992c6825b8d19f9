"""Structured output: a row's response format as an llguidance matcher, and the token masks it
allows, applied to logits before any token is chosen.

llguidance won on measurement against xgrammar and outlines-core (bench/grammar_libraries.py,
bench/README.md): a JSON schema to its first mask in ~1 ms (xgrammar 14-57 ms, outlines-core
0.15-1 s), masks for 8 rows of a 152k vocabulary in ~0.1 ms a step (a tie with xgrammar),
unbounded rollback, no Python dependencies, and special tokens refused inside strings. Tokens
that spell no text (padding rows of the embedding, `[PADn]` fillers) are refused here.

Under speculation every mask is the grammar's state after exactly the tokens before it: the
draft proposes under the masks of its own tokens (`DraftConstraint`), the verifier scores
each of the K + 1 positions under the mask after the drafted prefix before it
(`masks_after`), and only what the verifier keeps is consumed for good. Masks are a fixed
[rows, positions, vocab] bool tensor per bucket: no new shape appears.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np
import torch

from schemas.engine import ResponseFormat

_PAD_NAME = re.compile(r"\[PAD\d+\]|<\|.*\|>|<unk>|<s>|</s>")


class Grammars:
    """llguidance's view of the tokenizer (built once per engine), and a matcher per row."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: frozenset[int]):
        import llguidance.hf

        self.info = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.vocab = vocab_size
        self.eos = self.info.eos_token
        self.stop_ids = torch.tensor(sorted(stop_ids), dtype=torch.long)
        self.stop_set = frozenset(stop_ids)
        # Never inside a structured value: special and padding tokens that spell no text (a
        # model's embedding may have more rows than its tokenizer has tokens).
        never = torch.zeros(vocab_size, dtype=torch.bool)
        never[len(tokenizer):] = True
        special = set(tokenizer.all_special_ids)
        for text, token in tokenizer.get_vocab().items():
            if token < vocab_size and (token in special or _PAD_NAME.fullmatch(text)):
                never[token] = True
        self.never = never

    def words(self, rows: int) -> torch.Tensor:
        """An llguidance bitmask [rows, vocab / 32] with every token allowed."""
        return torch.full((rows, (self.vocab + 31) // 32), -1, dtype=torch.int32)

    def allowed(self, bits: torch.Tensor) -> torch.Tensor:
        """bool [rows, vocab] from llguidance bitmasks [rows, words]: never a token that spells
        no text, and every stop id where the grammar allows EOS."""
        flat = np.unpackbits(bits.numpy().view(np.uint8), axis=-1, bitorder="little")
        grammar_allows = torch.from_numpy(flat[:, : self.vocab]).bool()
        allowed = grammar_allows & ~self.never
        allowed[:, self.stop_ids] |= grammar_allows[:, self.eos, None]
        return allowed

    def matcher(self, response_format: ResponseFormat) -> RowGrammar:
        import llguidance

        matcher = llguidance.LLMatcher(self.info, response_format.grammar())
        if matcher.is_error():
            raise ValueError(f"response_format cannot be compiled: {matcher.get_error()}")
        return RowGrammar(matcher, self)


class RowGrammar:
    """One row's matcher: what it allows next, and the tokens it has consumed."""

    def __init__(self, matcher, grammars: Grammars):
        self.matcher, self.grammars = matcher, grammars

    def fill(self, bits: torch.Tensor, index: int) -> None:
        """Write what the grammar allows next into row `index` of an llguidance bitmask."""
        self.matcher.unsafe_compute_mask_ptr(bits[index].data_ptr(), bits.shape[1] * 4)

    def allowed(self) -> torch.Tensor:
        """bool [vocab]: the tokens the grammar allows next (every stop id where EOS is)."""
        bits = self.grammars.words(1)
        self.fill(bits, 0)
        return self.grammars.allowed(bits)[0]

    def consume(self, tokens: Sequence[int]) -> int:
        """Consume the tokens the grammar accepts, in order, up to the first it does not (a stop
        token other than the grammar's EOS ends the text, so it is not consumed). Returns how
        many were consumed."""
        consumed = 0
        for token in tokens:
            if token != self.grammars.eos and token in self.grammars.stop_set:
                break
            if self.matcher.try_consume_tokens([token]) != 1:
                break
            consumed += 1
        return consumed

    def rollback(self, tokens: int) -> None:
        if tokens:
            self.matcher.rollback(tokens)

    @property
    def complete(self) -> bool:
        """The text so far is a whole value (the grammar would accept EOS here, or has)."""
        return self.matcher.is_accepting() or self.matcher.is_stopped()

    @property
    def stopped(self) -> bool:
        """Nothing may follow but EOS: the value is closed."""
        return self.matcher.is_stopped()


def masks_after(
    grammars: Sequence[RowGrammar | None], drafts: Sequence[Sequence[int]]
) -> torch.Tensor | None:
    """bool [rows, K + 1, vocab]: position j allows what each row's grammar allows after its
    first j drafted tokens (all tokens for a row without one, and past a draft token the
    grammar refuses: the verifier rejects that token, so no later position is ever used).
    None when no row has a grammar."""
    shared = next((grammar.grammars for grammar in grammars if grammar is not None), None)
    if shared is None:
        return None
    positions = 1 + max((len(d) for d in drafts), default=0)
    bits = shared.words(len(grammars) * positions)
    for i, grammar in enumerate(grammars):
        if grammar is None:
            continue
        grammar.fill(bits, i * positions)
        consumed = 0
        for j, token in enumerate(drafts[i]):
            if grammar.consume([token]) != 1:
                break
            consumed += 1
            grammar.fill(bits, i * positions + j + 1)
        grammar.rollback(consumed)
    allowed = shared.allowed(bits).view(len(grammars), positions, -1)
    allowed[[i for i, grammar in enumerate(grammars) if grammar is None]] = True
    return allowed


class DraftConstraint:
    """A draft proposing under the grammars: each step's mask is the state after the tokens it
    drafted so far this round; `release` rolls every drafted token back afterwards."""

    def __init__(self, grammars: Sequence[RowGrammar | None]):
        self.grammars = list(grammars)
        self.shared = next(grammar.grammars for grammar in self.grammars if grammar is not None)
        self.drafted = [0] * len(self.grammars)

    def mask(self) -> torch.Tensor:
        """bool [rows, vocab] for the draft's next token."""
        bits = self.shared.words(len(self.grammars))
        for i, grammar in enumerate(self.grammars):
            if grammar is not None:
                grammar.fill(bits, i)
        allowed = self.shared.allowed(bits)
        allowed[[i for i, grammar in enumerate(self.grammars) if grammar is None]] = True
        return allowed

    def advance(self, tokens: Sequence[int]) -> None:
        for i, (grammar, token) in enumerate(zip(self.grammars, tokens, strict=True)):
            if grammar is not None:
                self.drafted[i] += grammar.consume([token])

    def release(self) -> None:
        for grammar, drafted in zip(self.grammars, self.drafted, strict=True):
            if grammar is not None:
                grammar.rollback(drafted)
        self.drafted = [0] * len(self.grammars)


def masked(logits: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """logits with every token the grammar refuses at -inf (unchanged without a grammar)."""
    if allowed is None:
        return logits
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))
