"""The adaptive policy's parts on their own: the online cost fit, the calibration, and
the controller's decisions for costs and acceptance given by construction."""

from __future__ import annotations

import numpy as np
import pytest

from proxy.adaptive import AdaptiveState, Calibration, CostModel
from proxy.adaptive.controller import (
    LEAVE_MARGIN,
    MIN_CALLS,
    ONE_ANSWER_TOKENS,
    PLAIN_PROBE_FIRST,
    PLAIN_PROBE_TOKENS,
    RETURN_MARGIN,
    RETURN_SHADOWS,
    SHADOW_EVERY,
    SHADOW_EVERY_MAX,
    STALE_ROUND_TOKENS,
    SURE_SHADOWS,
    TRIAL_CLOSE_TOKENS,
    TRIAL_FIRST_S,
    TRIAL_MAX_S,
    TRIAL_ROUNDS,
    WIDE_EVERY,
)
from proxy.tree import DraftDistribution, build_chain, build_tree


def test_cost_model_recovers_the_coefficients_and_follows_a_change():
    costs = CostModel()
    rng = np.random.default_rng(0)
    for _ in range(200):
        prompts, tokens = rng.integers(1, 33), rng.integers(1, 400)
        costs.observe_call(prompts, tokens, 0.030 + 0.004 * prompts + 0.0001 * tokens)
    snap = costs.snapshot()
    assert snap.per_call_s == pytest.approx(0.030, abs=1e-4)
    assert snap.per_prompt_s == pytest.approx(0.004, abs=1e-5)
    assert snap.per_token_s == pytest.approx(0.0001, abs=1e-6)
    # Load doubles every cost: the forgetting fit follows within a few dozen calls.
    for _ in range(150):
        prompts, tokens = rng.integers(1, 33), rng.integers(1, 400)
        costs.observe_call(prompts, tokens, 2 * (0.030 + 0.004 * prompts + 0.0001 * tokens))
    assert costs.call_seconds(np.array([9]), np.array([100]))[0] == pytest.approx(
        2 * (0.030 + 0.036 + 0.01), rel=0.02
    )


def test_cost_model_does_not_wind_up_on_calls_of_one_size():
    # Thousands of one-prompt calls (plain streams' openings) and no other size: the
    # fit cannot tell per-call from per-prompt cost, but must stay finite and right
    # where it has seen data.
    costs = CostModel()
    rng = np.random.default_rng(3)
    for _ in range(4000):
        tokens = rng.integers(1, 200)
        costs.observe_call(1, tokens, 0.050 + 0.0001 * tokens + rng.normal(0, 0.001))
    one, nine = costs.call_seconds(np.array([1, 9]), np.array([100, 100]))
    assert one == pytest.approx(0.060, abs=0.002)
    assert 0.055 < nine < 9 * 0.060
    snap = costs.snapshot()
    assert snap.per_token_s == pytest.approx(0.0001, rel=0.1)
    assert min(snap.per_call_s, snap.per_prompt_s, snap.per_token_s) >= 0


def test_cost_model_plain_latency():
    costs = CostModel()
    assert costs.plain_token_s() is None
    costs.observe_plain(64, 0.640, resumed=False)  # an opening: the only estimate so far
    assert costs.plain_token_s() == pytest.approx(0.010)
    costs.observe_plain(16, 0.080, resumed=True)  # a resumed stream of 16 replaces it
    assert costs.plain_token_s() == pytest.approx(0.005)
    costs.observe_plain(2, 0.020, resumed=True)  # a short one moves it by its share
    assert costs.plain_token_s() == pytest.approx(0.75 * 0.005 + 0.25 * 0.010)
    before = costs.plain_token_s()
    costs.observe_plain(64, 1.0, resumed=False)  # openings hold the prompt's prefill
    assert costs.plain_token_s() == before


def _tree(top_p: float, budget: int = 16, depth: int = 6):
    """A tree whose rank-0 tokens carry probability top_p at every depth."""
    rest = (1 - top_p) / (budget - 1)
    probs = np.array([top_p] + [rest] * (budget - 1))
    ids = np.tile(np.arange(budget, dtype=np.int64), (depth, 1)) + 10
    return build_tree(5, DraftDistribution(ids, np.tile(np.log(probs), (depth, 1))), budget, depth)


def _chain(depth: int):
    """A chain the drafter is sure of: probability 1 at every depth (an n-gram match)."""
    ids = np.arange(depth, dtype=np.int64)[:, None] + 10
    return build_chain(5, DraftDistribution(ids, np.zeros((depth, 1))), depth)


def test_calibration_learns_an_overconfident_drafter_edge_by_edge():
    calibration = Calibration()
    chain = _chain(6)
    # Before any evidence: the drafter's own probability (1 along the whole chain).
    assert calibration.acceptance(chain) == pytest.approx(np.ones(6))
    # Really, each token is right 60% of the time given the one before: the walk stops
    # at the first miss, so deeper nodes are seen less often.
    rng = np.random.default_rng(1)
    for _ in range(400):
        accepted = int(np.argmin(np.append(rng.random(6) < 0.6, False)))
        calibration.observe(chain, list(range(1, accepted + 1)))
    # A node is accepted when every edge on its path is: 0.6, 0.36, ... -- where a
    # calibration by path probability would give every depth the same rate.
    [(upper, rate, weight)] = calibration.table()
    assert upper == 1.0 and rate == pytest.approx(0.6, abs=0.05) and weight > 400
    assert calibration.acceptance(chain) == pytest.approx(
        calibration.edge_acceptance(np.zeros(1))[0] ** np.arange(1, 7)
    )


def test_calibration_keeps_the_drafters_order_within_a_tree():
    calibration = Calibration()
    tree = _tree(0.7)
    acceptance = calibration.acceptance(tree)
    # Best-first order: path probability, and so prior acceptance, never rises.
    assert np.all(np.diff(acceptance) <= 1e-12)
    assert acceptance[0] == pytest.approx(0.7)


class _Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _trained_state(
    per_call, per_prompt, per_token, plain_token_s=None, round_rate=None, clock=None
):
    state = AdaptiveState(costs=CostModel(clock or _Clock()))
    if round_rate is not None:
        state.costs.observe_round(1, 1 / round_rate, 0.0)
    rng = np.random.default_rng(2)
    for _ in range(3 * MIN_CALLS):
        prompts, tokens = rng.integers(1, 33), rng.integers(1, 200)
        state.costs.observe_call(
            prompts, tokens, per_call + per_prompt * prompts + per_token * tokens
        )
    if plain_token_s is not None:
        state.costs.observe_plain(32, 32 * plain_token_s, resumed=True)
    return state


def test_controller_verifies_more_nodes_when_nodes_are_cheap():
    tree = _tree(0.9)
    cheap = _trained_state(0.010, 0.0001, 0.0).controller(can_stream=False, seeded=False)
    dear = _trained_state(0.010, 0.010, 0.0).controller(can_stream=False, seeded=False)
    assert cheap.choose_nodes(tree, 1) > dear.choose_nodes(tree, 1) >= 1


def test_controller_verifies_the_root_alone_when_drafts_never_land():
    state = _trained_state(0.010, 0.002, 0.0)
    tree = _tree(0.9)
    for _ in range(30):
        state.calibration.observe(tree, [])  # not one node accepted
    controller = state.controller(can_stream=False, seeded=False)
    choices = [controller.choose_nodes(tree, 1) for _ in range(2 * WIDE_EVERY)]
    # ...but every WIDE_EVERY-th round the whole tree, so that the fit keeps seeing
    # calls of different sizes.
    assert choices == ([0] * (WIDE_EVERY - 1) + [tree.num_nodes]) * 2


def test_one_round_without_a_draft_does_not_step_aside():
    # Plain generation at 80 tokens/s; this runtime's rounds have made 150.
    state = _trained_state(0.030, 0.002, 0.0, plain_token_s=1 / 80, round_rate=150.0)
    controller = state.controller(can_stream=True, seeded=False)
    controller.start()
    assert not controller.plain
    switched = []
    for _ in range(9):  # rounds that find no draft: 1 token in 50 ms
        controller.choose_nodes(_tree(0.2), 1)
        controller.observe_rate(1, 0.050)
        switched.append(controller.plain)
    # Smoothed: 137, 125, ..., 76, 70 tokens/s; plain is 10% faster than the last only.
    assert switched == [False] * 8 + [True]
    assert controller.num_switches_to_plain == 1


def test_a_load_every_request_sees_sends_each_to_plain():
    # Plain generation at 80 tokens/s; this request's rounds make 150.
    state = _trained_state(0.030, 0.002, 0.0, plain_token_s=1 / 80, round_rate=150.0)
    controller = state.controller(can_stream=True, seeded=False)
    controller.start()
    controller.choose_nodes(_tree(0.9), 1)
    controller.observe_rate(6, 0.040)
    assert not controller.plain
    # Fifteen other clients arrive: another request's round takes 4x its predicted time.
    other = state.controller(can_stream=True, seeded=False)
    other.start()
    other.choose_nodes(_tree(0.9), 1)
    tokens, seconds = other._predicted
    other.observe_rate(round(tokens), 4 * seconds)
    assert state.costs.start_round_rate() * LEAVE_MARGIN < 80
    controller.choose_nodes(_tree(0.9), 1)
    controller.observe_rate(6, 0.040)  # its own text is as good as ever...
    assert controller.plain  # ...but the load decides


def test_a_round_far_slower_than_predicted_steps_aside_at_once():
    # Plain generation at 80 tokens/s; rounds have made 150, in the time the fit predicts.
    state = _trained_state(0.030, 0.002, 0.0, plain_token_s=1 / 80, round_rate=150.0)
    controller = state.controller(can_stream=True, seeded=False)
    controller.start()
    tree = _tree(0.9)
    controller.choose_nodes(tree, 1)
    tokens, seconds = controller._predicted
    controller.observe_rate(round(tokens), 1.9 * seconds)  # slower, but within 2x
    assert not controller.plain
    # Then a round at 2.5x its predicted time (say 16 clients where 4 were measured):
    # smoothed, the rate would still beat plain's; the load has changed under the fit.
    controller.choose_nodes(tree, 1)
    tokens, seconds = controller._predicted
    slow_rate = tokens / (2.5 * seconds)
    assert slow_rate * LEAVE_MARGIN < 80 < 0.9 * controller._rate + 0.1 * slow_rate
    before = state.costs.start_round_rate()
    controller.observe_rate(round(tokens), 2.5 * seconds)
    assert controller.plain
    # every round rate is scaled by the slowdown (not replaced by this round's)
    assert state.costs.start_round_rate() == pytest.approx(before / 2.5)
    late = state.controller(can_stream=True, seeded=False)
    late.start()
    assert late.plain  # a request arriving now starts plain: the rounds are slow now


def test_an_old_round_rate_does_not_decide_the_start():
    state = _trained_state(0.030, 0.002, 0.0, plain_token_s=1 / 80, round_rate=150.0)
    fresh = state.controller(can_stream=True, seeded=False)
    fresh.start()
    assert not fresh.plain  # rounds made 150 tokens/s, plain makes 80
    # Then plain generation only, for longer than STALE_ROUND_TOKENS: the round rate
    # may describe another load now.
    state.costs.observe_plain(STALE_ROUND_TOKENS, STALE_ROUND_TOKENS / 80, resumed=True)
    old = state.controller(can_stream=True, seeded=False)
    old.start()
    assert old.plain


def test_real_rounds_correct_the_predictions():
    state = _trained_state(0.030, 0.002, 0.0, plain_token_s=0.005)
    controller = state.controller(can_stream=False, seeded=False)
    tree = _tree(0.9)
    before = controller._round_rates(tree, 1)
    for _ in range(40):  # rounds return half the tokens predicted, in the predicted time
        controller.choose_nodes(tree, 1)
        tokens, seconds = controller._predicted
        controller.observe_rate(round(tokens / 2), seconds)
    assert state.costs.prediction_ratio() == pytest.approx(0.5, abs=0.1)
    assert controller._round_rates(tree, 1) == pytest.approx(
        state.costs.prediction_ratio() * before
    )


def test_a_stale_plain_estimate_is_measured_again():
    # Plain generation was last measured under load: 20 tokens/s; rounds make 100.
    state = _trained_state(0.010, 0.001, 0.0, plain_token_s=0.050, round_rate=100.0)
    controller = state.controller(can_stream=True, seeded=False)
    controller.start()
    assert not controller.plain

    def speculate(num_rounds: int) -> None:
        for _ in range(num_rounds):
            assert not controller.next_is_plain()
            controller.choose_nodes(_tree(0.9), 1)
            state.costs.observe_round(5, 0.050, 0.0)
            controller.observe_rate(5, 0.050)

    def plain_probe(gap_s: float) -> bool:
        assert controller.plain_length(1000) == PLAIN_PROBE_TOKENS
        state.costs.observe_plain(PLAIN_PROBE_TOKENS, PLAIN_PROBE_TOKENS * gap_s, resumed=True)
        committed = list(range(10, 20))
        ends = []
        for token in range(PLAIN_PROBE_TOKENS):
            committed.append(token)
            ends.append(controller.observe_plain_tokens(committed, 1))
        assert ends == [False] * (PLAIN_PROBE_TOKENS - 1) + [True]
        return controller.next_is_plain()  # who won

    speculate(PLAIN_PROBE_FIRST)
    assert controller.next_is_plain()  # the estimate is stale: a short plain stream
    assert not plain_probe(0.050)  # still 20 tokens/s: back to speculation...
    speculate(2 * PLAIN_PROBE_FIRST)  # ...and the next probe waits twice as long
    assert controller.next_is_plain()
    assert plain_probe(0.002)  # the load has gone: 500 tokens/s, the request stays plain
    assert controller.plain and controller.num_switches_to_plain == 1


def test_shadows_thin_out_while_far_from_paying():
    # Plain makes 200 tokens/s, rounds 50.
    state = _trained_state(0.030, 0.002, 0.0, plain_token_s=0.005, round_rate=50.0)
    controller = state.controller(can_stream=True, seeded=False)
    controller.start()
    assert controller.plain and controller.shadow_every == SHADOW_EVERY
    weak = _tree(0.2)
    committed = [1, 2, 3, 5]
    intervals = []
    for _ in range(4):  # shadows whose tokens never come: 1 token a round, ~30 tokens/s
        controller.add_shadow(weak, len(committed), 1)
        committed += [900 + len(committed) + i for i in range(weak.max_depth + 1)]
        controller.observe_plain_tokens(committed, weak.max_depth + 1)
        intervals.append(controller.shadow_every)
    assert intervals == [2 * SHADOW_EVERY, 4 * SHADOW_EVERY, SHADOW_EVERY_MAX, SHADOW_EVERY_MAX]


def test_controller_steps_aside_tries_again_and_comes_back():
    # Plain generation at 6 ms/token against 30 ms calls: a weak tree does not pay.
    clock = _Clock()
    state = _trained_state(0.030, 0.002, 0.0, plain_token_s=0.006, clock=clock)
    controller = state.controller(can_stream=True, seeded=False)
    controller.start()
    weak = _tree(0.2)

    def real_round(seconds_per_prompt: float = 0.002) -> None:
        num_nodes = controller.choose_nodes(weak, 1)
        seconds = 0.030 + seconds_per_prompt * (num_nodes + 1)
        new_tokens = num_nodes + 1 + int(weak.depths[: num_nodes + 1].sum())
        state.costs.observe_call(num_nodes + 1, new_tokens, seconds)
        state.costs.observe_round(1, seconds, 0.0)
        controller.observe_rate(1, seconds)

    real_round()  # the root alone was right: one token in 64 ms
    assert controller.plain and controller.num_switches_to_plain == 1
    assert controller.next_is_plain()
    assert controller.plain_length(1000) == 1000  # the rest of the output, one stream
    # Unpredictable text: the stream runs while the round measurements are fresh...
    committed = list(range(100, 110))
    assert not any(controller.observe_plain_tokens(committed, 1) for _ in range(300))
    clock.now += TRIAL_FIRST_S  # ...until no request has run a round for that long:
    assert controller.observe_plain_tokens(committed, 1)  # the stream closes for a trial
    assert state.costs.num_recent_calls == 0  # on fresh measurements only
    assert not controller.next_is_plain()
    assert not controller.plain
    real_round()  # 1 token in 32+ ms: under half plain's rate, the trial's first round
    assert controller.plain and controller.next_is_plain()  # ends it: plain won...
    controller.plain_length(1000)
    clock.now += TRIAL_FIRST_S
    # ...and the next waits twice as long.
    assert not any(controller.observe_plain_tokens(committed, 1) for _ in range(20))
    # Then a stream about to end by itself is not closed for it: the request may end.
    clock.now += TRIAL_FIRST_S
    controller.plain_length(TRIAL_CLOSE_TOKENS - 1)
    assert not controller.observe_plain_tokens(committed, 1)
    controller.plain_length(1000)  # a long one is: the trial is due
    assert controller.observe_plain_tokens(committed, 1)
    assert controller.num_switches_to_plain == 2 and controller.num_switches_to_speculation == 1
    # Other requests' rounds since the trial: the fit has fresh calls enough again.
    for num_prompts in range(2, 2 + MIN_CALLS):
        state.costs.observe_call(num_prompts, num_prompts, 0.030 + 0.002 * num_prompts)
    # Shadow rounds on text the drafter predicts perfectly: deep trees land -> back.
    strong = _tree(0.999, budget=16, depth=16)  # a chain of 16 likely tokens
    path = [int(t) for t in strong.token_ids[strong.path(int(np.argmax(strong.depths)))]]
    committed = [1, 2, 3, 5]
    leaves = []
    for _ in range(RETURN_SHADOWS):
        controller.add_shadow(strong, len(committed), 1)
        committed += path + [5]  # the predicted tokens came, then the next root
        leaves.append(controller.observe_plain_tokens(committed, len(path) + 1))
    assert leaves == [False] * (RETURN_SHADOWS - 1) + [True]  # the shadows' mean decides
    assert not controller.plain and controller.num_switches_to_speculation == 2


def test_two_shadows_sure_of_twice_plain_bring_a_request_back():
    # Plain makes 40 tokens/s; rounds made 30 -- plain -- but the text turns predictable.
    clock = _Clock()
    state = _trained_state(0.030, 0.002, 0.0, 0.025, round_rate=30.0, clock=clock)
    controller = state.controller(can_stream=True, seeded=False)
    controller.start()
    assert controller.plain
    controller.plain_length(1000)
    strong = _tree(0.999, budget=16, depth=16)
    path = [int(t) for t in strong.token_ids[strong.path(int(np.argmax(strong.depths)))]]
    committed = [1, 2, 3, 5]
    closes = []
    for _ in range(SURE_SHADOWS):  # each predicts far more than twice plain's rate
        controller.add_shadow(strong, len(committed), 1)
        committed += path + [5]
        closes.append(controller.observe_plain_tokens(committed, len(path) + 1))
    assert closes == [False] * (SURE_SHADOWS - 1) + [True]  # one lucky shadow is not enough
    assert SURE_SHADOWS < RETURN_SHADOWS and not controller.plain


def _started_plain(per_call: float, plain_token_s: float, round_rate: float):
    """(clock, state, a request that started plain) for per-prompt cost 2 ms."""
    clock = _Clock()
    state = _trained_state(per_call, 0.002, 0.0, plain_token_s, round_rate, clock=clock)
    controller = state.controller(can_stream=True, seeded=False)
    controller.start()
    assert controller.plain
    return clock, state, controller


def test_a_trial_that_speculation_wins_stays_on_fresh_measurements():
    # Rounds were measured under a load that made them slow (the fit: 200 ms per
    # call), and plain generation won; now the load has gone.
    clock, state, controller = _started_plain(0.200, plain_token_s=0.025, round_rate=10.0)
    committed = list(range(10, 40))
    controller.plain_length(1000)  # a stream opens...
    assert not any(controller.observe_plain_tokens(committed, 1) for _ in range(20))
    other = state.controller(can_stream=True, seeded=False)
    other.plain_length(1000)
    assert not any(other.observe_plain_tokens(committed, 1) for _ in range(20))
    clock.now += TRIAL_FIRST_S
    assert controller.observe_plain_tokens(committed, 1)  # this request claims the trial,
    assert not other.observe_plain_tokens(committed, 1)  # another does not
    other.start()
    assert other.plain  # nor does a request starting while the fit is measured again
    assert not controller.next_is_plain()
    tree = _tree(0.9)
    for _ in range(TRIAL_ROUNDS):  # rounds of 4 tokens in 20 ms now: 200 tokens/s
        num_nodes = controller.choose_nodes(tree, 1)
        state.costs.observe_call(num_nodes + 1, num_nodes + 1, 0.020)
        state.costs.observe_round(4, 0.020, 0.0)
        controller.observe_rate(4, 0.020)
    assert not controller.plain and controller.num_switches_to_plain == 0
    # The fit follows the new calls: what were 200 ms calls are now about 20 ms.
    assert state.costs.call_seconds(np.array([5]), np.array([5]))[0] < 0.05
    # The rate new requests start on, kept over ~50 rounds, is lifted to the trial's:
    # neither does the trial's request leave on its next round, nor does a new one
    # start plain, on the old 10 tokens/s.
    assert state.costs.start_round_rate() > RETURN_MARGIN * 40
    num_nodes = controller.choose_nodes(tree, 1)
    state.costs.observe_call(num_nodes + 1, num_nodes + 1, 0.020)
    state.costs.observe_round(4, 0.020, 0.0)
    controller.observe_rate(4, 0.020)
    assert not controller.plain
    late = state.controller(can_stream=True, seeded=False)
    late.start()
    assert not late.plain
    # A sure win: should speculation lose later, the next trial comes after the first
    # interval again.
    clock.now += TRIAL_FIRST_S
    assert state.costs.claim_trial(TRIAL_FIRST_S, TRIAL_MAX_S)


def test_a_trial_won_narrowly_keeps_its_request_but_starts_no_other():
    """A trial that beats plain by less than `SURE_MARGIN`: its request speculates on,
    but the rate new requests start on is lifted only as far as keeps that request
    (`LEAVE_MARGIN` times plain's), not to the trial's (one text's luck)."""
    clock, state, controller = _started_plain(0.200, plain_token_s=0.025, round_rate=10.0)
    committed = list(range(10, 40))
    controller.plain_length(1000)
    assert not any(controller.observe_plain_tokens(committed, 1) for _ in range(20))
    clock.now += TRIAL_FIRST_S
    assert controller.observe_plain_tokens(committed, 1)  # the trial
    assert not controller.next_is_plain()
    tree = _tree(0.9)
    round_s = 0.070  # 4 tokens: 57 tokens/s, 1.4x plain's 40
    for _ in range(TRIAL_ROUNDS):
        num_nodes = controller.choose_nodes(tree, 1)
        state.costs.observe_call(num_nodes + 1, num_nodes + 1, round_s)
        state.costs.observe_round(4, round_s, 0.0)
        controller.observe_rate(4, round_s)
    assert not controller.plain and controller.num_switches_to_plain == 0  # won
    assert state.costs.start_round_rate() == pytest.approx(LEAVE_MARGIN * 40)  # not 57
    num_nodes = controller.choose_nodes(tree, 1)  # ...and it does not leave on it
    state.costs.observe_call(num_nodes + 1, num_nodes + 1, round_s)
    state.costs.observe_round(4, round_s, 0.0)
    controller.observe_rate(4, round_s)
    assert not controller.plain
    # The next trial waits the interval the claim doubled, not the first one again.
    clock.now += TRIAL_FIRST_S
    assert not state.costs.claim_trial(TRIAL_FIRST_S, TRIAL_MAX_S)
    clock.now += TRIAL_FIRST_S
    assert state.costs.claim_trial(TRIAL_FIRST_S, TRIAL_MAX_S)
    late = state.controller(can_stream=True, seeded=False)
    late.start()
    assert late.plain


def test_a_trial_is_judged_on_the_calibrated_tokens_of_its_trees():
    # Plain makes 40 tokens/s; rounds were measured slow under another load.
    clock, state, controller = _started_plain(0.200, plain_token_s=0.025, round_rate=10.0)
    controller.plain_length(1000)
    committed = list(range(10, 40))
    assert not any(controller.observe_plain_tokens(committed, 1) for _ in range(20))
    clock.now += TRIAL_FIRST_S
    assert controller.observe_plain_tokens(committed, 1)  # the trial
    assert not controller.next_is_plain()
    tree = _tree(0.9)
    for _ in range(TRIAL_ROUNDS):
        # Rounds take 25 ms now; this text's opening gives 1 token each -- 40 tokens/s,
        # no better than plain -- though its trees are the kind the target accepts.
        num_nodes = controller.choose_nodes(tree, 1)
        assert 1.0 + state.calibration.acceptance(tree)[:num_nodes].sum() > 2
        state.costs.observe_call(num_nodes + 1, num_nodes + 1, 0.025)
        state.costs.observe_round(1, 0.025, 0.0)
        controller.observe_rate(1, 0.025)
    assert not controller.plain  # rounds at this load pay: the trial is won


@pytest.mark.parametrize("round_rate, joins", [(150.0, True), (60.0, False)])
def test_during_a_trial_rounds_at_twice_plain_let_requests_start(round_rate, joins):
    clock = _Clock()
    state = _trained_state(0.030, 0.002, 0.0, 1 / 40, clock=clock)
    state.costs.count_speculating(+2)  # the rounds were measured with two speculating
    state.costs.observe_round(1, 1 / round_rate, 0.0)
    state.costs.count_speculating(-2)
    clock.now += 2 * TRIAL_FIRST_S  # the measurements are old: the next start is a trial
    first = state.controller(can_stream=True, seeded=False)
    first.start()
    assert not first.plain and state.costs.num_recent_calls == 0  # its rounds: the trial
    second = state.controller(can_stream=True, seeded=False)
    second.start()
    assert second.plain != joins  # plain 40 tokens/s: 150 is sure enough, 60 is not
    if joins:  # ...on a trial of its own, which its first hopeless round ends
        second.choose_nodes(_tree(0.9), 1)
        second.observe_rate(1, 0.5)
        assert second.plain


def test_plain_comes_as_one_answer_only_where_a_stream_would_hardly_close():
    # Rounds make 30 tokens/s, plain 200: speculation does not pay.
    clock, state, controller = _started_plain(0.030, plain_token_s=0.005, round_rate=30.0)
    assert controller.plain_in_one_answer(client_streams=False)
    assert controller.plain_length(1000, one_answer=True) == ONE_ANSWER_TOKENS
    assert not controller.plain_in_one_answer(client_streams=True)  # tokens as they come
    clock.now += TRIAL_FIRST_S  # a trial is due: a short answer, then the trial
    assert controller.plain_in_one_answer(client_streams=False)
    assert controller.plain_length(1000, one_answer=True) == TRIAL_CLOSE_TOKENS
    other = state.controller(can_stream=True, seeded=False)  # arriving at the same time:
    other.start()
    assert other.plain_length(1000, one_answer=True) == ONE_ANSWER_TOKENS  # one trial
    controller.observe_plain_tokens(list(range(10, 10 + TRIAL_CLOSE_TOKENS)), TRIAL_CLOSE_TOKENS)
    assert not controller.next_is_plain() and not controller.plain  # the trial's rounds
    # Rounds make 220 tokens/s: too few to go back, enough to watch -- plain streams.
    near = _trained_state(0.030, 0.002, 0.0, plain_token_s=0.005, round_rate=220.0)
    assert not near.controller(can_stream=True, seeded=False).plain_in_one_answer(False)
    # A seeded request never switches: one answer whenever the client does not stream.
    assert near.controller(can_stream=True, seeded=True).plain_in_one_answer(False)


def test_speculation_grows_by_measured_steps():
    # Rounds make 150 tokens/s, plain 80 -- measured while no request speculated with
    # them (as in a trial: one request among plain ones).
    state = _trained_state(0.030, 0.002, 0.0, plain_token_s=1 / 80, round_rate=150.0)

    def arrive():
        controller = state.controller(can_stream=True, seeded=False)
        controller.start()
        return controller

    first, second = arrive(), arrive()
    assert not first.plain and second.plain  # one joins; the rates say nothing of two
    for _ in range(20):  # rounds measured with one request speculating
        state.costs.observe_round(6, 0.040, 0.0)
    third, fourth, fifth = arrive(), arrive(), arrive()
    assert [third.plain, fourth.plain, fifth.plain] == [False, False, True]  # up to 2x + 1
    first.finish()  # a request ends: its place is free
    assert not arrive().plain


def test_seeded_requests_are_plain_from_start_to_end():
    # Even where speculation would pay (fast rounds, slow plain generation): vLLM's own
    # seeded draws, whatever the policy has measured so far.
    state = _trained_state(0.001, 0.0001, 0.0, plain_token_s=0.050, round_rate=900.0)
    controller = state.controller(can_stream=True, seeded=True)
    controller.start()
    assert controller.plain  # the whole request is plain...
    controller.choose_nodes(_tree(0.999), 1)
    committed = list(range(10, 400))
    assert not any(controller.observe_plain_tokens(committed, 1) for _ in range(600))
    assert controller.plain and controller.num_switches_to_speculation == 0  # ...throughout
