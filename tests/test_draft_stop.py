"""A round's drafting ends at a smaller grid K once more draft tokens would not pay: priced
for the whole batch from the draft's confidence, calibrated by what the target kept, and never
changing greedy tokens."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import engine_for, varied_prompts

from generation.draft_length import DraftStopper, RoundPrices
from generation.proposers import PromptLookupProposer
from schemas import DraftSpec, ModelSpec, SamplingParams

# From K=2, drafting on to K=4 costs 0.5 s and a token is worth 1 s. Before any round is
# verified, a token the draft gives probability p is kept with odds p (bin centres), and so
# is the one after it: 2 more tokens earn P(kept so far) x (p + p^2).
ONWARD = {2: (2, 0.5)}
FAR = 100  # tokens left: more than any round can use


def round_of(
    stopper: DraftStopper,
    left: list[int],
    confidences: list[list[float]],
    onward: dict = ONWARD,
) -> bool:
    """Feed one round's draft probabilities (per step, per row) to rows with `left` tokens
    to go (0: idle); whether drafting reached the end."""
    stopper.start_round(RoundPrices(onward, seconds_per_token=1.0, tokens_left=left))
    return all(
        stopper.keep_going(step, torch.tensor(row))
        for step, row in enumerate(confidences, start=1)
    )


def test_a_sure_row_drafts_on_and_an_unsure_one_stops():
    assert round_of(DraftStopper(), [FAR], [[0.95], [0.95]])  # 0.90 x 1.85 > 0.5
    assert not round_of(DraftStopper(), [FAR], [[0.95], [0.3]])  # 0.33 x 0.47 < 0.5


def test_a_row_near_its_end_gains_nothing_from_drafting_on():
    assert round_of(DraftStopper(), [4], [[0.95], [0.95]])  # token 3 of 4 can still be kept
    assert not round_of(DraftStopper(), [3], [[0.95], [0.95]])  # its 3rd token is the target's


def test_the_batch_drafts_on_while_its_sure_rows_pay_and_idle_rows_count_for_nothing():
    unsure_and_sure = [[0.3, 0.95], [0.3, 0.95]]
    assert round_of(DraftStopper(), [FAR, FAR], unsure_and_sure)
    assert not round_of(DraftStopper(), [FAR, 0], unsure_and_sure)


def test_an_overconfident_draft_is_corrected_by_what_the_target_kept():
    stopper = DraftStopper()
    for _ in range(40):  # the draft is 95 % sure, the target rejects its first token every time
        round_of(stopper, [FAR], [[0.95], [0.95], [0.95], [0.95]])
        stopper.observe([0])
    assert float(stopper.kept(torch.tensor([0.95]))) < 0.1
    assert not round_of(stopper, [FAR], [[0.95], [0.95]])


def test_only_tokens_the_verifier_reached_are_counted():
    stopper = DraftStopper()
    kept_before, onward_before = stopper.kept.trials.clone(), stopper.onward.trials.clone()
    steps = [[0.15, 0.15], [0.55, 0.55], [0.75, 0.75], [0.95, 0.95]]
    assert round_of(stopper, [FAR, FAR], steps, onward={})  # nowhere to stop
    stopper.observe([1, 4])  # row 0: 1st kept, 2nd rejected, 3rd and 4th never tested
    def added(odds, before):
        return (odds.trials - before * odds.decay).round(decimals=6).tolist()

    assert added(stopper.kept, kept_before) == [0, 2, 0, 0, 0, 2, 0, 1, 0, 1]
    # the token after m was tested where m was kept: row 0's 1st, row 1's 1st to 3rd
    assert added(stopper.onward, onward_before) == [0, 2, 0, 0, 0, 1, 0, 1, 0, 0]


def lookup_round(stopper: DraftStopper, context: list[int]) -> list[int]:
    stopper.start_round(RoundPrices(ONWARD, seconds_per_token=1.0, tokens_left=[FAR]))
    proposer = PromptLookupProposer(ngram_max=3, ngram_min=1)
    drafts, _ = proposer.propose([context], [0], 4, SamplingParams(), None, stopper)
    return drafts[0].tolist()


def test_prompt_lookup_drafts_on_while_it_copies_and_stops_where_it_only_guesses():
    """A row whose last 3 tokens occurred before copies what followed them, to K=4; a row
    with no match proposes filler and ends at K=2; copies the target keeps rejecting end at 2."""
    copying = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3]
    stopper = DraftStopper()
    assert lookup_round(stopper, copying) == [4, 5, 6, 7]
    assert lookup_round(stopper, [10, 11, 12, 13]) == [13, 13]
    for _ in range(20):
        lookup_round(stopper, copying)
        stopper.observe([0])
    assert lookup_round(stopper, copying) == [4, 5]


@pytest.mark.parametrize("draft", ["same-model", "independent-model"])
def test_the_engine_drafts_on_only_where_tokens_are_kept_and_tokens_stay_plain(
    draft, tiny_llama_dir, tiny_llama_other_dir, monkeypatch
):
    """Speculation is forced (K budget 4, grid [2, 4]) and prices fixed: the target drafting
    for itself learns its tokens are all kept and drafts to 4; a noisy copy stops at 2."""
    draft_dir = tiny_llama_dir if draft == "same-model" else tiny_llama_other_dir
    engine = engine_for(
        tiny_llama_dir, draft=DraftSpec(kind="model", model=ModelSpec(path=str(draft_dir)))
    )
    policy = engine.draft_length
    monkeypatch.setattr(policy.chooser, "choose", lambda *args: 2)
    monkeypatch.setattr(
        policy,
        "round_prices",
        lambda rows: RoundPrices(ONWARD, 1.0, [FAR if ctx else 0 for ctx in rows.contexts]),
    )
    prompts, params = varied_prompts(8), SamplingParams(max_new_tokens=24)
    completions = engine.generate(prompts, params)
    plain = engine_for(tiny_llama_dir).generate(prompts, params)
    assert [c.token_ids for c in completions] == [c.token_ids for c in plain]
    steps = engine.stats.steps_per_k
    if draft == "same-model":
        assert engine.stats.acceptance_rate == 1.0 and steps[4] > 3 * steps.get(2, 0)
    else:
        assert engine.stats.acceptance_rate < 0.5 and steps[2] > 3 * steps.get(4, 0)
