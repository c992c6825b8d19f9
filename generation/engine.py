"""The engine: continuous batching over static shapes, with speculative decoding.

Each step reads top to bottom as: admit (free rows take waiting prompts, one prefill) -> propose
(the proposer drafts K tokens per row; the draft-length policy picks K, 0 for a plain step) ->
verify (the target scores [b, K + 1] tokens in one forward) -> accept (each row keeps the draft
tokens that equal the target's own choice, then the target's next token) -> collect (finished
rows leave; with no prompt waiting, live rows compact into a smaller batch bucket).

The host decides which row is live, how many tokens it keeps, when to refill or compact; the
device runs only grid-shaped forwards. Loading and assembly live in loading.py, K in
draft_length.py, the proposers in proposers.py, the verifier in rejection.py.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from generation import kernels, loading
from generation.draft_length import DraftLengthPolicy, StepRows, policy_for
from generation.grammar import DraftConstraint, Grammars, RowGrammar, masked, masks_after
from generation.loading import DTYPES, LoadedModel
from generation.metrics import EngineStats
from generation.prompts import encode
from generation.proposers import NoProposer, Proposer
from generation.rejection import verify
from generation.runner import WARM_CALLS, ModelRunner
from generation.sampling import RowRandom, choose, chosen_logprobs, step_draws
from generation.schedule import (
    batch_capacity,
    plain_decode_steps,
    rows_to_compact,
    slots_to_fill,
    step_width,
)
from generation.types import Completion, GenerationStopped
from schemas import EngineConfig, SamplingParams

ENGINE_VERSION = "0.1.0"
Prompt = str | list[dict] | list[int] | torch.Tensor  # a tensor: 1-D integer token ids
REPLACEMENT = "\ufffd"  # what a tokenizer decodes incomplete UTF-8 bytes to


@dataclass
class _Row:
    """One prompt in flight. `tokens` = prompt + generated; its last token is in no cache yet."""

    index: int
    tokens: list[int]
    prompt_len: int
    rng: RowRandom
    draft_seen: int = 0  # context tokens whose K/V the draft cache holds
    finish: str | None = None
    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    grammar: RowGrammar | None = None  # its response format's matcher, if it has one
    logprobs: list[float] | None = None  # of each kept token, when asked for

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]


def _waste(computed: int, useful: int) -> float | None:
    """Padded share of the token slots computed; None when none were."""
    return (computed - useful) / computed if computed else None


def _check_seeds(seeds: Sequence[int] | None, prompts: int) -> None:
    if seeds is None:
        return
    if len(seeds) != prompts:
        raise ValueError(
            f"seeds has {len(seeds)} entries for {prompts} prompts; pass one seed per prompt, "
            "or none (every prompt then uses params.seed)"
        )
    bad = next((i for i, seed in enumerate(seeds) if not isinstance(seed, int)), None)
    if bad is not None:
        raise TypeError(f"seeds[{bad}] is {seeds[bad]!r}; a seed is an int")


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        target: LoadedModel,
        device: torch.device,
        proposer: Proposer | None = None,
        draft: LoadedModel | None = None,
    ):
        self.config, self.grid, self.device = config, config.bucket_grid, device
        self.target_loaded, self.draft_loaded = target, draft
        self.tokenizer = target.tokenizer
        self.target = ModelRunner(
            target.model, self.grid, device, DTYPES[config.target.dtype], config.compile,
            config.hpu_graphs, config.cuda_graphs, exact_rows=True,
        )
        self.proposer = proposer or NoProposer()
        self.draft_length: DraftLengthPolicy = policy_for(config, self.target, self.proposer)
        self._stop_ids = target.eos_ids  # plus the call's stop_token_ids, set per generate()
        self._grammars: Grammars | None = None  # built on the first structured call
        self.reset_stats()

    @classmethod
    def from_config(cls, config: EngineConfig) -> Engine:
        return cls(config, *loading.assemble(config))

    # ---- public helpers -------------------------------------------------------------------
    @property
    def max_prompt_tokens(self) -> int:
        return self.grid.max_prompt

    @property
    def device_type(self) -> str:
        return self.device.type

    @property
    def draft_kind(self) -> str:
        return self.config.draft.kind if self.config.draft else "none"

    @property
    def model_info(self) -> dict:
        """Names and weight hashes for the metrics; a target-derived draft is `target#kind`."""
        return {
            "target_model": self.config.target.name,
            "target_weights_sha256": self.target_loaded.weights_sha256,
            "draft_model": self.config.draft_model_name(),
            "draft_weights_sha256": self.draft_loaded.weights_sha256 if self.draft_loaded else None,
        }

    @property
    def hardware_info(self) -> dict:
        """For the metrics: the linear kernels each model runs (on CPU), and the CPU."""
        runners = [("target", self.target), ("draft", self.proposer.runner)]
        kernels_used = " ".join(f"{role}={r.kernels}" for role, r in runners if r is not None)
        return {
            "cpu_kernels": kernels_used if self.device.type == "cpu" else None,
            "cpu_model": kernels.cpu_model(),
            "cpu_isa": kernels.cpu_isa(),
        }

    @property
    def grammars(self) -> Grammars:
        """llguidance's view of the tokenizer, for rows with a response format."""
        if self._grammars is None:
            vocab = self.target.model.config.vocab_size
            self._grammars = Grammars(self.tokenizer, vocab, self.target_loaded.eos_ids)
        return self._grammars

    def encode(self, prompt: Prompt) -> list[int]:
        return encode(self.tokenizer, prompt)

    def count_prompt_tokens(self, prompt: Prompt) -> int:
        return len(self.encode(prompt))

    def reset_stats(self) -> None:
        self._stats = EngineStats()
        self._base = self._runner_totals()

    @property
    def stats(self) -> EngineStats:
        """Counters since the last reset_stats(); shape counts are the models' lifetime totals."""
        stats = self._stats
        now = self._runner_totals()
        stats.target_forwards = now["target_forwards"] - self._base["target_forwards"]
        stats.draft_forwards = now["draft_forwards"] - self._base["draft_forwards"]
        computed = now["computed"] - self._base["computed"]
        useful = now["useful"] - self._base["useful"]
        stats.padding_waste = _waste(computed.total(), useful.total())
        stats.prefill_padding_waste = _waste(computed["prefill"], useful["prefill"])
        stats.decode_padding_waste = _waste(computed["decode"], useful["decode"])
        draft = self.proposer.runner
        stats.target_shapes = len(self.target.shapes)
        stats.draft_shapes = len(draft.shapes) if draft else 0
        stats.distinct_shapes = stats.target_shapes + stats.draft_shapes
        stats.compiles = sum(runner.compiles for runner in self._runners)
        stats.graph_captures = sum(runner.graph_captures for runner in self._runners)
        return stats

    @property
    def _runners(self) -> list[ModelRunner]:
        return [self.target] + ([self.proposer.runner] if self.proposer.runner else [])

    def _runner_totals(self) -> dict:
        runners = self._runners
        return {
            "target_forwards": self.target.forwards,
            "draft_forwards": self.proposer.forwards,
            "computed": sum((r.computed_slots for r in runners), Counter()),
            "useful": sum((r.useful_slots for r in runners), Counter()),
        }

    def warmup(self) -> None:
        """Run every grid shape: prefills once, decodes WARM_CALLS times (their timings price
        each K until it runs)."""
        grid = self.grid
        runners = [(self.target, [1, *self.draft_length.verify_widths()], False)]
        if self.proposer.runner:
            widths = sorted({1, *self.draft_length.catch_up_widths()})
            runners.append((self.proposer.runner, widths, True))
        for runner, lengths, last_logit_only in runners:
            # A prefill runs once in use per prompt, so one warm call prices it; where that
            # call built a graph, a second one prices the shape without the build (else a
            # compiled draft's prefill looks like seconds and never pays back).
            prefill_calls = 2 if runner.first_call_builds else 1
            for t, _ in itertools.product(grid.prompt_lengths, range(prefill_calls)):
                runner.prefill([[0] * t], [0])  # prompts prefill one by one: [1, t] shapes
            # Decode shapes take turns, so a busy spell of the host slows one call of each
            # shape rather than all calls of one: their fastest calls compare fairly.
            for _, b, t, s in itertools.product(
                range(WARM_CALLS), grid.batch_sizes, lengths, grid.cache_lengths
            ):
                tokens, starts = torch.zeros(b, t, dtype=torch.long), torch.full((b,), s - t)
                # A draft reads one logit per row: warm that shape, or compile meets it later.
                last = torch.zeros(b, 1, dtype=torch.long) if last_logit_only else None
                runner.decode(tokens, starts, b, logit_index=last)
            runner.warm_seconds = dict(runner.recent_seconds)
        self.reset_stats()

    # ---- generation ------------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams,
        seeds: Sequence[int] | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> list[Completion]:
        """One completion per prompt, in order. `should_stop` is asked before every step:
        True abandons the call (GenerationStopped), e.g. on Ctrl-C."""
        started = time.perf_counter()
        _check_seeds(seeds, len(prompts))
        self._stop_ids = self.target_loaded.eos_ids | set(params.stop_token_ids)
        results: list[Completion | None] = [None] * len(prompts)
        waiting: deque[_Row] = deque()
        for index, prompt in enumerate(prompts):
            ids, error = self._prompt_ids(prompt)
            if error is not None:  # this record only; the others go on
                results[index] = Completion([], "", "error", len(ids), error=error)
                continue
            seed = params.seed if seeds is None else seeds[index]
            row = _Row(index, ids, len(ids), RowRandom(seed), logprobs=[] if params.logprobs
                       else None)
            if params.response_format is not None:
                row.grammar = self.grammars.matcher(params.response_format)
            waiting.append(row)
        self.draft_length.new_prompts()
        admitted, load_mark = list(waiting), self.target.load_mark()
        capacity = batch_capacity(self.grid.batch_sizes, len(waiting))
        slots: list[_Row | None] = [None] * capacity
        self._stats.batch_bucket_max = max(self._stats.batch_bucket_max, capacity if waiting else 0)
        while waiting or any(slots):
            if should_stop is not None and should_stop():
                raise GenerationStopped(f"stopped with {len(waiting)} prompts not started")
            self._admit(slots, waiting, params)
            self._collect(slots, results, params)
            if not any(slots):
                continue
            if not waiting:
                self._compact(slots)
            batch = slots[: step_width(slots, self.grid.batch_sizes)]
            k, switch_seconds = self.draft_length.choose(self._step_rows(batch, params))
            forwards_before, step_started = self._forward_seconds(), time.perf_counter()
            live, tokens_before = sum(1 for row in batch if row), self._stats.tokens_generated
            k = self._step(batch, k, params)
            seconds = time.perf_counter() - step_started
            self._stats.record_step(k)
            if not (k and switch_seconds):  # a catch-up round prices the switch, not K
                self.draft_length.observe_step(
                    len(batch), k, seconds, self._forward_seconds() - forwards_before
                )
            tokens = self._stats.tokens_generated - tokens_before
            self.draft_length.observe_payoff(len(batch), k, seconds, switch_seconds, tokens / live)
            self._collect(slots, results, params)
        self._record_plain_estimate(admitted, load_mark)
        self._stats.wall_seconds += time.perf_counter() - started
        s = self._stats
        s.host_seconds = (
            s.wall_seconds - s.prefill_seconds - s.decode_seconds - s.draft_seconds
            - s.verify_seconds
        )
        return results

    def _prompt_ids(self, prompt: Prompt) -> tuple[list[int], str | None]:
        """A prompt's token ids, and why it cannot run (a reason class first), or None."""
        try:
            ids = self.encode(prompt)
        except Exception as error:  # a bad type, a chat template failing on a message
            return [], f"unusable_prompt: {error}"
        vocab = self.target.model.config.vocab_size
        if not ids:
            return ids, "empty_prompt: the prompt has 0 tokens"
        if len(ids) > self.grid.max_prompt:
            return ids, (
                f"prompt_too_long: {len(ids)} tokens > largest prompt bucket "
                f"{self.grid.max_prompt}; shorten it or raise bucket_grid.prompt_lengths"
            )
        if max(ids) >= vocab or min(ids) < 0:
            return ids, f"token_out_of_vocabulary: token ids must be in 0..{vocab - 1}"
        return ids, None

    def _step_rows(self, batch: list[_Row | None], params: SamplingParams) -> StepRows:
        return StepRows(
            contexts=[row.tokens if row else None for row in batch],
            seen=[row.draft_seen if row else 0 for row in batch],
            left=[params.max_new_tokens - len(row.generated) if row else 0 for row in batch],
        )

    def _admit(self, slots: list[_Row | None], waiting: deque[_Row], params: SamplingParams):
        """Free slots take waiting prompts: one target prefill; the draft's too while
        speculation pays at this batch, its prefill included (a later K round catches a
        skipped draft up); each row's first token from the prefill's logits."""
        admitted = [(slot, waiting.popleft()) for slot in slots_to_fill(slots, len(waiting))]
        if not admitted:
            return
        started = time.perf_counter()
        prompts = [row.tokens for _, row in admitted]
        rows = [slot for slot, _ in admitted]
        logits = self.target.prefill(prompts, rows)
        horizon = params.max_new_tokens - 1
        with_draft = self.draft_length.wants_draft(len(slots), prompts, horizon)
        if with_draft:
            draft_started = time.perf_counter()
            self.proposer.prefill(prompts, rows)
            self._stats.draft_prefill_seconds += time.perf_counter() - draft_started
        rows_in = [row for _, row in admitted]
        allowed = masks_after([row.grammar for row in rows_in], [[]] * len(rows_in))
        logits = masked(logits, None if allowed is None else allowed[:, 0])
        draws = self._draws(rows_in, 1, params)
        first = choose(logits, params, draws.at(0) if draws else None)
        logprobs = chosen_logprobs(logits, first, params).tolist() if params.logprobs else None
        for i, ((slot, row), token) in enumerate(zip(admitted, first.tolist(), strict=True)):
            slots[slot] = row
            row.draft_seen = row.prompt_len if with_draft else 0
            self._stats.prompt_tokens += row.prompt_len
            self._append(row, [token], params, logprobs[i : i + 1] if logprobs else None)
        self._stats.prefill_seconds += time.perf_counter() - started

    def _step(self, batch: list[_Row | None], k: int, params: SamplingParams) -> int:
        """Propose K tokens per row, verify [b, K + 1] in one target forward, accept per row;
        K = 0 is a plain step. With a stopper the round drafts up to the largest grid K and
        may end at a smaller one: the K drafted is returned."""
        started = time.perf_counter()
        stopper = self.draft_length.round_stopper(self._step_rows(batch, params)) if k else None
        k = self.grid.draft_lengths[-1] if stopper else k
        draws = self._draws(batch, k + 1, params)  # the K + 1 positions this step may fill
        grammars = [row.grammar if row else None for row in batch]
        draft_tokens, draft_probs = torch.zeros(len(batch), 0, dtype=torch.long), None
        if k:  # propose (under the rows' grammars)
            contexts = [row.tokens if row else None for row in batch]
            seen = [row.draft_seen if row else 0 for row in batch]
            constraint = DraftConstraint(grammars) if any(grammars) else None
            draft_tokens, draft_probs = self.proposer.propose(
                contexts, seen, k, params, draws, stopper, constraint
            )
            k = draft_tokens.shape[1]
            draws = draws.head(k + 1) if draws else None
        drafted = time.perf_counter()
        proposals = draft_tokens.tolist()
        draft_tokens = draft_tokens.to(self.device)  # verify, each position under its mask
        last = torch.tensor([[row.tokens[-1] if row else 0] for row in batch], device=self.device)
        starts = torch.tensor([len(row.tokens) - 1 if row else 0 for row in batch])
        live = sum(1 for row in batch if row)
        logits = self.target.decode(torch.cat([last, draft_tokens], 1), starts, live)
        logits = masked(logits, masks_after(grammars, proposals))
        accepted, next_token = verify(logits, draft_tokens, draft_probs, params, draws)
        accepted, next_token = accepted.tolist(), next_token.tolist()
        kept_tokens = [[*proposals[i][: accepted[i]], next_token[i]] for i in range(len(batch))]
        logprobs = self._kept_logprobs(logits, kept_tokens, params) if params.logprobs else None
        for i, row in enumerate(batch):  # accept
            if row is not None:
                if k:
                    self._count_round(row, k, accepted[i])
                self._append(row, kept_tokens[i], params, logprobs[i] if logprobs else None)
        done = time.perf_counter()
        if k:
            live_accepted = [accepted[i] if row else None for i, row in enumerate(batch)]
            self._stats.record_round(k, [n for n in live_accepted if n is not None])
            self.draft_length.observe_round(k, live_accepted)
            self._stats.draft_seconds += drafted - started
            self._stats.verify_seconds += done - drafted
        else:
            self._stats.decode_seconds += done - started
        return k

    @staticmethod
    def _kept_logprobs(
        logits: torch.Tensor, kept: list[list[int]], params: SamplingParams
    ) -> list[list[float]]:
        """Each row's kept tokens' log-probabilities, from the verify's logits [b, K + 1, V]
        (position j scored the token kept at j)."""
        width = logits.shape[1]
        tokens = torch.tensor([row + [0] * (width - len(row)) for row in kept],
                              device=logits.device)
        scores = chosen_logprobs(logits, tokens, params).tolist()
        return [scores[i][: len(row)] for i, row in enumerate(kept)]

    @staticmethod
    def _count_round(row: _Row, k: int, kept: int) -> None:
        row.rounds += 1
        row.draft_seen = len(row.tokens) + min(kept, k - 1)  # fed: context + d1..d(K-1)
        row.proposed += k
        row.accepted += kept
        row.accepted_per_position += [0] * (k - len(row.accepted_per_position))
        for position in range(kept):
            row.accepted_per_position[position] += 1

    def _record_plain_estimate(self, admitted: list[_Row], load_mark: tuple[float, float]):
        """What this call's rows would have cost decoded plain: the plain schedule's steps at
        their warm-up [b, 1] times, scaled by how much slower this call's forwards ran than in
        warm-up (the machine's load now). None before a warm-up."""
        steps = plain_decode_steps(
            [(row.prompt_len, len(row.generated)) for row in admitted],
            self.grid.batch_sizes,
            self.grid.cache_lengths,
        )
        self._stats.plain_decode_steps += steps.total()
        self._stats.record_plain_estimate(
            self.target.warm_priced_seconds(steps, self.target.load_since(load_mark))
        )

    def _forward_seconds(self) -> float:
        """Seconds spent inside model forwards so far, target and draft."""
        return sum(runner.busy_seconds for runner in self._runners)

    def _draws(self, batch: list[_Row | None], positions: int, params: SamplingParams):
        """The randomness for the next `positions` tokens of each row (None when greedy)."""
        rows = [(row.rng, len(row.tokens)) if row else None for row in batch]
        return step_draws(rows, positions, params, self.device)

    def _append(
        self,
        row: _Row,
        new_tokens: list[int],
        params: SamplingParams,
        logprobs: list[float] | None = None,
    ) -> None:
        """Commit tokens to a row, stopping at EOS / stop ids / stop strings / length limits,
        or where its response format's value is closed."""
        for j, token in enumerate(new_tokens):
            row.tokens.append(token)
            self._stats.tokens_generated += 1
            if logprobs is not None:
                row.logprobs.append(logprobs[j])
            if row.grammar is not None:
                row.grammar.consume([token])
            if token in self._stop_ids or (params.stop and self._hit_stop_string(row, params.stop)):
                row.finish = "stop"
            elif row.grammar is not None and row.grammar.stopped:
                row.finish = "stop"  # nothing but EOS may follow: the value is whole
            elif len(row.generated) >= params.max_new_tokens:
                row.finish = "length"
            elif len(row.tokens) >= self.grid.max_context:
                row.finish = "cache_full"
            if row.finish:
                return

    def _hit_stop_string(self, row: _Row, stops: list[str]) -> bool:
        window = max(len(s) for s in stops) + 2
        tail = self.tokenizer.decode(row.generated[-window:], skip_special_tokens=True)
        return any(s in tail for s in stops)

    def _collect(
        self, slots: list[_Row | None], results: list[Completion | None], params: SamplingParams
    ) -> None:
        for slot, row in enumerate(slots):
            if row and row.finish:
                results[row.index] = self._completion(row, params.stop)
                slots[slot] = None

    def _completion(self, row: _Row, stops: list[str]) -> Completion:
        text = self.tokenizer.decode(row.generated, skip_special_tokens=True)
        cuts = [text.find(s) for s in stops if s in text]
        if cuts:  # like vLLM, the stop string itself is not part of the text
            text = text[: min(cuts)]
        # A row cut by a limit may end inside a multi-byte character, which decodes to U+FFFD:
        # drop that partial character rather than publish a replacement mark.
        trimmed = row.finish in ("length", "cache_full") and text.endswith(REPLACEMENT)
        return Completion(
            token_ids=list(row.generated),
            text=text.rstrip(REPLACEMENT) if trimmed else text,
            trimmed_partial_character=trimmed,
            finish_reason=row.finish,
            prompt_tokens=row.prompt_len,
            rounds=row.rounds,
            proposed=row.proposed,
            accepted=row.accepted,
            accepted_per_position=row.accepted_per_position,
            structured_complete=None if row.grammar is None else row.grammar.complete,
            token_logprobs=row.logprobs,
        )

    def _compact(self, slots: list[_Row | None]) -> None:
        """With no prompt waiting, move live rows to the front when a smaller bucket fits them."""
        live = rows_to_compact(slots, self.grid.batch_sizes)
        if not live:
            return
        moves = [(s, d) for d, s in enumerate(live) if s != d]
        for runner in self._runners:
            runner.cache.move_rows([s for s, _ in moves], [d for _, d in moves])
        rows = [slots[i] for i in live]
        for i in range(len(slots)):
            slots[i] = rows[i] if i < len(rows) else None
