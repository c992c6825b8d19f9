"""The K chooser prices whole steps (host work included), the draft's catch-up and its prefill
against the tokens left; a draft is prefilled only while speculation pays, and a draft that was
skipped catches up exactly."""

from __future__ import annotations

import pytest
from engine_helpers import SMALL_GRID, engine_for, varied_prompts

from generation.draft_length import DraftLengthChooser
from schemas import DraftSpec, ModelSpec, SamplingParams


def target_seconds(t: int) -> float:
    """A [b, t] target forward: 1 s plus a little per extra token (verify is nearly free)."""
    return 1.0 + 0.05 * (t - 1)


def draft_seconds(k: int) -> float:
    return 0.1 * k


def sure_chooser(alpha: float = 0.8, **kwargs) -> DraftLengthChooser:
    """A chooser with strong evidence of `alpha` (its exploration pushed far away)."""
    chooser = DraftLengthChooser([2, 4], explore_every=1000, max_explore_every=1000, **kwargs)
    chooser.accepted, chooser.trials = 1e6 * alpha, 1e6
    return chooser


LONG = 1000.0  # tokens left: one-off costs are negligible over them


def test_forwards_alone_make_speculation_win():
    assert sure_chooser().choose(1, target_seconds, draft_seconds, 0.0, LONG) > 0


def test_measured_host_overhead_of_a_round_makes_plain_win():
    chooser = sure_chooser()
    chooser.observe_step(1, 0, seconds=1.0, forward_seconds=1.0)
    chooser.observe_step(1, 2, seconds=3.0, forward_seconds=1.25)  # sampling, bookkeeping, ...
    assert chooser.choose(1, target_seconds, draft_seconds, 0.0, LONG) == 0


def test_an_unmeasured_k_is_priced_with_the_overhead_measured_for_another():
    chooser = sure_chooser()
    chooser.observe_step(1, 2, seconds=2.5, forward_seconds=1.25)  # 2x its forwards
    assert chooser.step_cost(1, 4, 1.55) == pytest.approx(3.1)
    assert chooser.step_cost(8, 4, 1.55) == pytest.approx(1.55)  # another batch: unmeasured


def test_the_drafts_catch_up_is_charged_to_leaving_plain():
    chooser = sure_chooser()
    assert chooser.choose(1, target_seconds, draft_seconds, 0.0, LONG) > 0
    chooser = sure_chooser()
    assert chooser.choose(1, target_seconds, draft_seconds, 5000.0, LONG) == 0


def test_a_one_off_cost_is_paid_back_only_over_the_tokens_left():
    """Batch-8-like prices: a K=2 round costs 2.1 plain steps for 2.44 tokens at alpha 0.8
    (K=4: 3.6 for 3.36), and the draft's prefill costs 6 plain steps. That pays over 256
    tokens left, not over 32."""
    chooser = sure_chooser()
    for k, seconds in ((0, 1.0), (2, 2.1), (4, 3.6)):
        chooser.observe_step(8, k, seconds=seconds, forward_seconds=seconds)
    prices = (target_seconds, draft_seconds)
    assert chooser.wants_draft(8, *prices, prefill_seconds=0.0, horizon=32)
    assert not chooser.wants_draft(8, *prices, prefill_seconds=6.0, horizon=32)
    assert chooser.wants_draft(8, *prices, prefill_seconds=6.0, horizon=256)
    assert chooser.choose(8, *prices, 6.0, 32) == 0  # the same for a draft that lags
    assert chooser.choose(8, *prices, 6.0, 256) == 2


def test_exploring_speculation_waits_until_its_expected_loss_fits_the_budget():
    """A try loses its catch-up plus its round's cost over the plain steps its tokens replace:
    here a K=2 round costs 1.3 plain steps for 1 token (nothing is ever accepted). At a 5 %
    budget it waits for 0.3 / 0.05 = 6 plain seconds with no catch-up, 8 with 0.1 s of it,
    counted across explore intervals; so a paying draft is still found while plain wins."""

    def choices(switch_seconds: float) -> list[int]:
        chooser = DraftLengthChooser([2], explore_every=4, max_explore_every=4, explore_budget=0.05)
        chooser.accepted, chooser.trials = 0.0, 1e6  # nothing is ever accepted: plain wins
        prices = (target_seconds, draft_seconds, switch_seconds, LONG)
        return [chooser.choose(1, *prices) for _ in range(12)]

    assert choices(0.0) == [0] * 7 + [2] + [0] * 4  # 7 plain seconds at the second interval
    assert choices(0.1) == [0] * 11 + [2]  # 11 at the third


def test_a_try_is_charged_what_it_lost_in_wall_time():
    """Tries priced to lose 0.3 s (as above, 5 % budget, a try every 7 plain seconds) that
    really lose 1.3 s, e.g. a draft's first pass over a long prompt dearer than warm-up said:
    the next try waits until the plain steps since have paid for that loss, so what tries lose
    stays within the budget of the plain time (plus one try), however wrong their price."""

    def tries(realized_loss: float, steps: int = 200) -> list[int]:
        chooser = DraftLengthChooser([2], explore_every=4, max_explore_every=4,
                                     explore_budget=0.05, prior_alpha=0.0)  # never agrees
        chooser.observe_step(1, 0, seconds=1.0, forward_seconds=1.0)
        tried = []
        for step in range(steps):
            if chooser.choose(1, target_seconds, draft_seconds, 0.0, LONG):
                tried.append(step)
                chooser.settle_try(seconds=1.0 + realized_loss, tokens_per_row=1.0)
        return tried

    as_priced, dearer = tries(0.3), tries(1.3)
    assert len(as_priced) >= 20
    assert len(dearer) <= len(as_priced) / 3
    assert 1.3 * len(dearer) <= 0.05 * (200 - len(dearer)) + 1.3


GRID = SMALL_GRID.model_copy(update={"cache_lengths": [64, 192]})


def draft_engine(tiny_llama_dir, draft_dir):
    spec = DraftSpec(kind="model", model=ModelSpec(path=str(draft_dir)))
    engine = engine_for(tiny_llama_dir, bucket_grid=GRID, draft=spec, num_draft_tokens="auto")
    engine.warmup()
    return engine


def test_no_draft_prefill_while_plain_wins(tiny_llama_dir, tiny_llama_other_dir, monkeypatch):
    engine = draft_engine(tiny_llama_dir, tiny_llama_other_dir)
    policy = engine.draft_length
    # Sub-millisecond forwards of tiny models are noise on a busy host: price them fixed, a
    # draft step dearer than a target step, so no acceptance makes a round pay.
    prices = (target_seconds, lambda k: 1.5 * k)
    monkeypatch.setattr(policy, "_forward_prices", lambda width: prices)
    engine.generate(varied_prompts(4), SamplingParams(max_new_tokens=8))
    assert engine.stats.draft_forwards == 0
    assert engine.stats.steps_per_k == {0: engine.stats.steps_per_k[0]}


def test_a_skipped_draft_catches_up_exactly(tiny_llama_dir, monkeypatch):
    """Rows admitted without the draft run 110 plain steps (a lag past the widest catch-up
    window), then speculate: prefill + chunked catch-up. The target drafting for itself then
    accepts every token only if the draft's cache holds exactly the context; no new shape."""
    prompts = varied_prompts(3)
    params = SamplingParams(max_new_tokens=140)
    plain = engine_for(tiny_llama_dir, bucket_grid=GRID).generate(prompts, params)
    engine = draft_engine(tiny_llama_dir, tiny_llama_dir)
    draft_shapes = set(engine.proposer.runner.shapes)
    steps = iter(range(10_000))
    chooser = engine.draft_length.chooser
    monkeypatch.setattr(chooser, "wants_draft", lambda *args: False)
    monkeypatch.setattr(chooser, "choose", lambda *args: 0 if next(steps) < 110 else 2)
    completions = engine.generate(prompts, params)
    assert [c.token_ids for c in completions] == [c.token_ids for c in plain]
    # The round stopper, priced by measured times, may draft on past K=2: any round counts.
    assert sum(n for k, n in engine.stats.steps_per_k.items() if k) > 0
    assert engine.stats.acceptance_rate == 1.0
    assert set(engine.proposer.runner.shapes) == draft_shapes


def test_a_try_drafts_the_k_it_was_priced_at_whatever_the_stopper_says(
    tiny_llama_dir, tiny_llama_other_dir, monkeypatch
):
    """Plain wins (drafting costs more than any acceptance earns) and tries are made
    affordable; the round stopper would draft every round on to the largest grid K, but a try
    was priced as a K=2 round and drafts exactly 2. Its wall time, catch-up included, is
    charged."""
    engine = draft_engine(tiny_llama_dir, tiny_llama_other_dir)
    policy = engine.draft_length
    chooser = policy.chooser
    chooser.prior_alpha, chooser.explore_budget = 0.0, 100.0
    # Sub-millisecond steps of tiny models are noise: a drafted token priced at 1.5 plain
    # steps, so no acceptance makes a round win and every round is a try.
    monkeypatch.setattr(chooser, "step_cost", lambda b, k, forwards: 1.0 + 1.5 * k)
    chooser.base_interval = chooser.interval = chooser.max_interval = 3
    weigh = policy.stopper.keep_going
    monkeypatch.setattr(policy.stopper, "keep_going", lambda *args: weigh(*args) or True)
    charged = []
    settle = chooser.settle_try
    monkeypatch.setattr(chooser, "settle_try", lambda *args: charged.append(args) or settle(*args))
    engine.generate(varied_prompts(2), SamplingParams(max_new_tokens=24))
    steps = engine.stats.steps_per_k
    assert steps.get(2, 0) >= 3 and set(steps) == {0, 2}
    assert len(charged) == steps[2]


def test_a_new_calls_text_outweighs_what_earlier_calls_measured_within_a_few_rounds():
    """Batch-8 code accepted almost everything (alpha ~0.95, hundreds of trials); then one
    free-text prompt accepts half. Three rounds of it bring K down from the longest."""
    chooser = DraftLengthChooser([2, 4, 6], explore_every=1000, max_explore_every=1000)
    for _ in range(30):
        chooser.observe(6, [6, 6, 5, 6, 6, 6, 4, 6])
        chooser.choose(8, target_seconds, draft_seconds, 0.0, LONG)
    assert chooser.choose(1, target_seconds, draft_seconds, 0.0, LONG) == 6
    chooser.new_prompts()
    for accepted in (1, 0, 2):
        chooser.observe(6, [accepted])
    assert chooser.alpha < 0.75
    assert chooser.choose(1, target_seconds, draft_seconds, 0.0, LONG) < 6


def run_rounds(chooser: DraftLengthChooser, kept_per_round, steps: int,
               round_seconds: float = 3.2) -> list[int]:
    """Steps at batch 1 priced as measured: a plain step 1 s, a K=4 round `round_seconds`;
    round i keeps kept_per_round(i) drafted tokens. Returns the K chosen at each step."""
    chosen, rounds = [], 0
    for _ in range(steps):
        k = chooser.choose(1, target_seconds, draft_seconds, 0.0, LONG)
        chosen.append(k)
        if not k:
            chooser.observe_step(1, 0, seconds=1.0, forward_seconds=1.0)
            continue
        kept = kept_per_round(rounds)
        rounds += 1
        chooser.observe(k, [kept])
        chooser.observe_step(1, k, seconds=round_seconds, forward_seconds=round_seconds)
        chooser.observe_round_payoff(1, round_seconds, kept + 1)
    return chosen


def bursty(round_index: int) -> int:
    """All 4 drafted tokens kept, then none: 3 tokens a round on average, where a geometric
    alpha fitted to it (0.8) expects 3.36."""
    return 4 if round_index % 2 == 0 else 0


def test_a_round_that_does_not_pay_in_wall_time_turns_speculation_off_within_a_few_rounds():
    """The model expects 3.36 tokens for a 3.2 s round (1.05x plain); the rounds give 3
    (0.94x). After `payoff_rounds` rounds the chooser decodes plain; the model alone (its
    prior at the geometric fit, 0.8) would speculate to the end."""
    def chooser(payoff_rounds: int) -> DraftLengthChooser:
        chooser = DraftLengthChooser([4], explore_every=1000, max_explore_every=1000,
                                     payoff_rounds=payoff_rounds, prior_alpha=0.8)
        chooser.observe_step(1, 0, seconds=1.0, forward_seconds=1.0)
        return chooser

    model_only = run_rounds(chooser(payoff_rounds=10_000), bursty, 40)
    assert model_only[4:] == [4] * 36
    guarded = chooser(payoff_rounds=4)
    chosen = run_rounds(guarded, bursty, 40)
    assert chosen[:4] == [4] * 4 and chosen[4:] == [0] * 36
    assert 0.8 < guarded.realized_speedup(1, 1.0) < 1.0  # the last rounds weigh most
    assert guarded.realized_speedup(8, 1.0) is None  # another batch bucket: not measured


def test_a_first_round_that_keeps_nothing_does_not_end_a_draft_that_pays():
    """An int8 target with its 0.5B draft: a draft step costs 0.42 of a plain step, so a K=2
    round pays from alpha ~0.56. The first round keeps nothing, every later one keeps both
    tokens (alpha ~0.8 pays 1.3x). Read as a bare ratio, 0 of 1 trial stayed 0 for ~60 steps
    however the evidence aged; against the prior it ages back within a few plain steps."""
    chooser = DraftLengthChooser([2])
    chooser.observe_step(1, 0, seconds=1.0, forward_seconds=1.0)
    chosen, rounds = [], 0
    for _ in range(40):
        k = chooser.choose(1, target_seconds, lambda k: 0.42 * k, 0.0, LONG)
        chosen.append(k)
        if k:
            kept = 0 if rounds == 0 else 2
            rounds += 1
            chooser.observe(k, [kept])
            chooser.observe_step(1, k, seconds=1.89, forward_seconds=1.89)
            chooser.observe_round_payoff(1, 1.89, kept + 1)
        else:
            chooser.observe_step(1, 0, seconds=1.0, forward_seconds=1.0)
    assert chosen[0] == 2 and chosen[1] == 0
    assert 2 in chosen[1:12]  # tried again within a few steps
    assert chosen[12:].count(2) >= 26  # and speculating from then on
    assert chooser.realized_speedup(1, 1.0) > 1.3


def vetoed_after_a_bad_stretch(paid: float) -> DraftLengthChooser:
    """40 K=4 rounds of 4 s that paid `paid` x a 1 s plain step, then 8 that paid 0.5x."""
    chooser = DraftLengthChooser([4], explore_every=1000, max_explore_every=1000,
                                 prior_alpha=0.9)
    chooser.observe_step(1, 0, seconds=1.0, forward_seconds=1.0)
    for round_index in range(48):
        chooser.observe_round_payoff(1, 4.0, 4.0 * (paid if round_index < 40 else 0.5))
    return chooser


@pytest.mark.parametrize(("paid", "lifted"), [(1.6, True), (1.3, False), (0.5, False)])
def test_a_new_call_starts_from_what_rounds_paid_over_the_run(paid, lifted):
    """40 rounds that paid `paid` x plain (K=4 rounds of 4 s), then a stretch of 8 that paid
    0.5x vetoes speculation, and the call stays plain. The next call's prompts are other text:
    where rounds paid clearly over the run (1.6x, 1.34x with the stretch) it speculates again,
    the veto ready for its own rounds; one whose rounds paid 1.1x with the stretch would not
    earn back a new prompt's draft prefill and the rounds until the next veto, and one that
    never paid stays vetoed too."""
    chooser = vetoed_after_a_bad_stretch(paid)
    assert chooser.choose(1, target_seconds, draft_seconds, 0.0, LONG) == 0  # vetoed
    chooser.new_prompts()
    assert (chooser.choose(1, target_seconds, draft_seconds, 0.0, LONG) > 0) == lifted


def rounds_until_vetoed(chooser: DraftLengthChooser, paid: float, most: int = 12) -> int:
    """K=4 rounds of 4 s that pay `paid` x plain, run while the chooser speculates (at most
    `most`); how many ran."""
    rounds_run = 0
    while rounds_run < most and chooser.choose(1, target_seconds, draft_seconds, 0.0, LONG):
        chooser.observe_step(1, 4, seconds=4.0, forward_seconds=4.0)
        chooser.observe_round_payoff(1, 4.0, 4.0 * paid)
        rounds_run += 1
    return rounds_run


@pytest.mark.parametrize(("lifted_rate", "most_rounds"), [(0.7, 3), (1.1, 12)])
def test_a_lifted_call_is_vetoed_again_within_a_few_rounds_that_lose(lifted_rate, most_rounds):
    """Prompt lookup pays ~1.8x on copy tasks and ~0.7x on free text: lifted at a new free-text
    call, its rounds must turn it off within a few, not after the ~5 the last stretch weighs.
    Rounds that pay over plain keep the lift (12 rounds: as many as the loop runs)."""
    chooser = vetoed_after_a_bad_stretch(1.8)
    chooser.new_prompts()
    rounds_run = rounds_until_vetoed(chooser, lifted_rate)
    assert rounds_run <= most_rounds if lifted_rate < 1 else rounds_run == most_rounds


def test_every_lift_weighs_its_payoff_as_lift_rounds_rounds():
    """A second lift soon after a first one (the lifted call vetoed again after its 3 rounds
    at 0.7x) carries the run's payoff at the weight of `lift_rounds` mean rounds (4 s each),
    as the first did, not at the smaller weight its fading sums had left by then."""
    chooser = vetoed_after_a_bad_stretch(1.8)
    for _ in range(2):
        chooser.new_prompts()
        assert chooser.round_seconds[1] == pytest.approx(chooser.lift_rounds * 4.0)
        rounds_until_vetoed(chooser, 0.7)
        assert not chooser.choose(1, target_seconds, draft_seconds, 0.0, LONG)  # vetoed


def test_rounds_that_pay_are_never_vetoed():
    """Only interrupted, once plain's price is `stale_steps` old, by one plain step that
    measures it again."""
    chooser = DraftLengthChooser([4], explore_every=1000, max_explore_every=1000)
    chooser.observe_step(1, 0, seconds=1.0, forward_seconds=1.0)
    chosen = run_rounds(chooser, lambda i: 2 if i % 4 == 3 else 4, 80)
    assert chosen == ([4] * 32 + [0]) * 2 + [4] * 14
    assert chooser.realized_speedup(1, 1.0) > 1.3


def overrated_rounds(chooser: DraftLengthChooser, steps: int) -> list[int]:
    """Steps at batch 1 where the model's alpha stays 0.92 (a K=4 round of 3.2 s expects 4.26
    tokens) but rounds give 2.4 (0.75x a 1 s plain step). Returns the K chosen at each step."""
    chosen = []
    for _ in range(steps):
        chooser.accepted, chooser.trials = 0.92e6, 1e6
        k = chooser.choose(1, target_seconds, draft_seconds, 0.0, LONG)
        chosen.append(k)
        chooser.observe_step(1, k, seconds=3.2 if k else 1.0, forward_seconds=3.2 if k else 1.0)
        if k:
            chooser.observe_round_payoff(1, 3.2, 2.4)
    return chosen


@pytest.mark.parametrize("stale_steps", [32, 10**6])
def test_rounds_are_judged_against_a_plain_price_of_the_same_stretch(stale_steps):
    """Plain steps measured while the host was busy (1.5 s); then it is quiet: a plain step
    takes 1 s and a K=4 round 3.2 s for 2.4 tokens (0.75x). Against the old 1.5 s the rounds
    look a 1.13x win; once that price is `stale_steps` old, one plain step measures 1 s, which
    replaces it, and the payoff check vetoes the rounds. Never stale (10**6), they run on."""
    chooser = DraftLengthChooser([4], explore_every=1000, max_explore_every=1000,
                                 stale_steps=stale_steps)
    for _ in range(4):
        chooser.observe_step(1, 0, seconds=1.5, forward_seconds=1.5)
    chosen = overrated_rounds(chooser, 80)
    if stale_steps == 10**6:
        assert chosen == [4] * 80
        return
    assert chosen[:32] == [4] * 32 and chosen[32:] == [0] * 48
    assert chooser.step_seconds[(1, 0)] == 1.0


def test_the_veto_lifts_when_exploring_rounds_pay_again():
    """Bursty text vetoes speculation; then every drafted token is kept (the text changed):
    the rounds exploration still tries bring the realized payoff above plain again. Tries
    are priced at the loss the vetoed rounds realized, so at the 1 % budget they come ~50
    plain steps apart and the change (at the 8th round) is found by the 4th try."""
    chooser = DraftLengthChooser([4], explore_every=6, max_explore_every=12)
    chooser.observe_step(1, 0, seconds=1.0, forward_seconds=1.0)
    chosen = run_rounds(chooser, lambda i: bursty(i) if i < 8 else 4, 320)
    vetoed = next(i for i in range(len(chosen)) if chosen[i : i + 4] == [0] * 4)
    assert vetoed < 10
    assert chosen[-24:].count(4) >= 22  # speculating again, a plain step now and then


def test_a_vetoed_draft_is_tried_at_the_loss_its_rounds_realized():
    """The model expects a K=4 round (its step measured at 3.2 s) to give 4.26 tokens (alpha
    0.92): 1.33x plain. By wall time rounds give 2.4 tokens (0.75x), so after 4 the payoff
    check vetoes them. A try is then priced at what rounds realized, 3.2 s x 0.25 = 0.8 s
    lost, and at the 1 % budget comes once per 80 plain seconds (credit a try leaves unspent
    carries over). Priced by the model it would look free and come every explore interval (as
    on an AVX2 CPU's int4 target at batch 8)."""
    chooser = DraftLengthChooser([4], explore_every=6, max_explore_every=12)
    chooser.observe_step(1, 0, seconds=1.0, forward_seconds=1.0)
    chosen = overrated_rounds(chooser, 200)
    rounds = [step for step, k in enumerate(chosen) if k]
    assert rounds[:4] == [0, 1, 2, 3]
    tries = rounds[4:]
    assert 1 <= len(tries) <= 3
    assert (tries[-1] - rounds[3]) / len(tries) >= 80


@pytest.mark.parametrize("payoff_rounds", [4, 10**6])
def test_the_engine_stops_a_draft_the_model_overrates_by_its_wall_time(
    tiny_llama_dir, tiny_llama_other_dir, payoff_rounds
):
    """The chooser's model is misled, as warm-up prices can mislead it: it believes the draft
    is right 95 % of the time and a K round costs a plain step plus 10 % per drafted token. An
    unrelated draft as large as the target is almost never right: measured rounds give ~1
    token per row in several plain steps' time, so after `payoff_rounds` rounds the engine
    decodes plain; without the check (10**6) it speculates throughout."""
    engine = draft_engine(tiny_llama_dir, tiny_llama_other_dir)
    chooser = engine.draft_length.chooser
    chooser.payoff_rounds = payoff_rounds
    chooser.accepted, chooser.trials = 0.95e6, 1e6
    chooser.observe = lambda k, accepted: None  # the model never learns the truth
    measured_plain = chooser.step_cost
    chooser.step_cost = lambda b, k, forwards: measured_plain(b, 0, forwards) * (1 + 0.1 * k)
    engine.generate(varied_prompts(4), SamplingParams(max_new_tokens=48))
    steps = engine.stats.steps_per_k
    rounds = sum(n for k, n in steps.items() if k)
    if payoff_rounds == 4:
        assert rounds <= 4 + 2 and steps[0] >= 35  # 4 rounds, then a try or two
    else:
        assert rounds >= 35
