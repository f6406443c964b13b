"""The adaptive policy through its interface: scripted costs, acceptance and clocks in,
decisions out (proxy.adaptive.estimates, proxy.adaptive.policy). No test reads a private
field or pins a trajectory; each states a behaviour the policy's doc promises."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.optimize import nnls

from proxy.adaptive.estimates import (
    HALF_LIFE_S,
    Calibration,
    LinearCost,
    nonnegative_ridge,
    ridge_system,
)
from proxy.adaptive.policy import (
    BAND,
    SHADOW_EVERY,
    SHADOW_SHARE,
    Finished,
    Plain,
    PlainTokens,
    Policy,
    RoundResult,
    Speculate,
)
from proxy.round import root_only
from proxy.tree import DraftDistribution, build_tree


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def tree_of(probs: list[list[float]], budget: int = 8, root: int = 1):
    """A best-first tree from per-depth candidate probabilities (token ids 10*depth+rank)."""
    depth = len(probs)
    width = max(len(row) for row in probs)
    tokens = np.array([[10 * (d + 1) + r for r in range(width)] for d in range(depth)])
    logp = np.full((depth, width), -np.inf)
    for d, row in enumerate(probs):
        logp[d, : len(row)] = np.log(row)
    return build_tree(root, DraftDistribution(tokens, logp), budget, depth)


SURE_CHAIN = [[0.95, 0.03]] * 4  # a drafter that is right and knows it


# ----- the fit ---------------------------------------------------------------------


@pytest.mark.parametrize("ridged", [None, np.array([False, True, True])])
@pytest.mark.parametrize("seed", range(6))
def test_nonnegative_ridge_is_the_nnls_optimum_of_its_system(seed, ridged):
    rng = np.random.default_rng(seed)
    num = 40
    prompts = rng.integers(1, 33, num)
    tokens = prompts * rng.integers(1, 9, num) + rng.integers(0, 30, num)
    # Some seeds make the per-prompt term negative in the unconstrained fit.
    seconds = 0.01 + (0.002 if seed % 2 else -0.0005) * prompts + 1e-4 * tokens
    seconds = seconds + rng.normal(0, 0.002, num)
    rows = np.column_stack([np.ones(num), prompts, tokens, seconds])
    weights = 2.0 ** -rng.uniform(0, 3, num)
    design, scale, target = ridge_system(rows, weights, ridged)
    expected = nnls(design, target)[0] / scale
    found = nonnegative_ridge(rows, weights, ridged)
    np.testing.assert_allclose(found, expected, rtol=1e-6, atol=1e-12)
    assert (found >= 0).all()


@pytest.mark.parametrize("ridged", [None, np.array([False, True, False])])
def test_nonnegative_ridge_with_a_feature_never_seen_is_the_nnls_optimum(ridged):
    """A column of zeros (every stretch at one load): unridged, the subsets holding it
    are singular; the fit is still scipy's."""
    rng = np.random.default_rng(11)
    num = 30
    tokens = rng.integers(1, 200, num)
    seconds = 0.02 + 1e-3 * tokens + rng.normal(0, 0.003, num)
    rows = np.column_stack([np.ones(num), tokens, np.zeros(num), seconds])
    weights = 2.0 ** -rng.uniform(0, 3, num)
    design, scale, target = ridge_system(rows, weights, ridged)
    expected = nnls(design, target)[0] / scale
    found = nonnegative_ridge(rows, weights, ridged)
    np.testing.assert_allclose(found, expected, rtol=1e-6, atol=1e-12)
    assert found[2] == 0


def test_call_cost_recovers_a_linear_latency_and_follows_a_change_of_load():
    clock = Clock()
    cost = LinearCost(2, clock)
    def latency(num_prompts: int, new_tokens: int) -> float:
        return 0.02 + 0.003 * num_prompts + 1e-4 * new_tokens

    # Calls of several sizes, some with much new context (after plain generation).
    calls = [(1, 1), (5, 20), (9, 300), (17, 60), (3, 900), (33, 120)]
    for num_prompts, new_tokens in calls:
        cost.observe(num_prompts, new_tokens, latency(num_prompts, new_tokens))
        clock.now += 0.1
    np.testing.assert_allclose(cost.coefficients(), [0.02, 0.003, 1e-4], rtol=0.05)
    # Five half-lives later the load doubled every cost: new calls soon outweigh the old.
    clock.now += 5 * HALF_LIFE_S
    for num_prompts, new_tokens in calls[::-1]:
        cost.observe(num_prompts, new_tokens, 2 * latency(num_prompts, new_tokens))
        clock.now += 0.1
    assert cost.seconds(9, 36) == pytest.approx(2 * latency(9, 36), rel=0.1)


def test_calibration_moves_from_the_drafters_word_to_the_targets_and_back():
    clock = Clock()
    calibration = Calibration(clock)
    tree = tree_of([[0.9]])  # one node the drafter gives 0.9
    assert calibration.acceptance(tree)[0] == pytest.approx(0.9)
    for _ in range(50):  # the target never takes it
        calibration.observe(tree, [])
    assert calibration.acceptance(tree)[0] < 0.1
    clock.now += 20 * HALF_LIFE_S  # old evidence fades: the prior is back
    assert calibration.acceptance(tree)[0] == pytest.approx(0.9, abs=0.01)


# ----- decisions -------------------------------------------------------------------


def measured(policy: Policy, clock: Clock, *, call_s: float, per_prompt_s: float,
             plain_token_s: float, plain_open_s: float = 0.0, overhead_s: float = 0.0) -> None:  # fmt: skip
    """Rounds and plain stretches measured just now: calls of several sizes (the sure
    chain accepted, as its drafter said; `overhead_s` of host time each beside the call),
    plain stretches of several lengths."""
    request = policy.request(can_plain=True, seeded=False, client_streams=True)
    tree = tree_of(SURE_CHAIN)
    chain = [1, 2, 3, 4]  # its first four nodes: the rank-0 token at each depth
    for num_prompts in (1, 5, 9):
        seconds = call_s + per_prompt_s * num_prompts
        request.record(RoundResult(tree, chain, 5, seconds + overhead_s, seconds, num_prompts,
                                   num_prompts))  # fmt: skip
    for num_tokens in (8, 64):
        request.record(PlainTokens([0] * num_tokens, num_tokens,
                                   plain_open_s + plain_token_s * num_tokens, ended=True))  # fmt: skip
    request.record(Finished())
    clock.now += 0.01


def busy(policy: Policy, clock: Clock, seconds: float) -> None:
    """`seconds` with a request in flight (one that measures nothing)."""
    request = policy.request(can_plain=True, seeded=False, client_streams=True)
    clock.now += seconds
    request.record(Finished())


def decide(policy: Policy, tree=None, *, seeded=False, streams=True, remaining=64, new=1,
           remote_text=False):  # fmt: skip
    """A new request's first decision (the request then ends)."""
    request = policy.request(can_plain=True, seeded=seeded, client_streams=streams,
                             remote_text=remote_text)  # fmt: skip
    decision = request.decide(tree or tree_of(SURE_CHAIN), position=100, unseen_tokens=new,
                              remaining=remaining, max_depth=4)  # fmt: skip
    request.record(Finished())
    return decision


def test_a_cold_start_is_plain_and_seeded_requests_stay_plain():
    clock = Clock()
    policy = Policy(clock=clock)
    first = decide(policy)
    assert isinstance(first, Plain) and first.max_tokens == 64
    measured(policy, clock, call_s=0.001, per_prompt_s=0.0001, plain_token_s=0.02)
    seeded = decide(policy, seeded=True, streams=False)
    assert seeded == Plain(64, False, None, "seeded")


def test_while_the_first_round_is_in_flight_other_requests_stay_plain():
    clock = Clock()
    policy = Policy(clock=clock)
    request = policy.request(can_plain=True, seeded=False, client_streams=True)
    request.record(PlainTokens([0] * 64, 64, 64 * 0.02, ended=True))  # plain measured
    probe = decide(policy)
    assert probe.reason == "remeasure_speculation"
    # Three more requests decide before that round comes back: no call has been timed,
    # so speculation's cost is unknown, not zero.
    others = [decide(policy) for _ in range(3)]
    assert all(isinstance(d, Plain) and d.reason == "speculation_unmeasured" for d in others)


def test_speculates_where_rounds_pay_and_steps_aside_where_they_do_not():
    clock = Clock()
    fast = Policy(clock=clock)  # rounds of 3-4 sure tokens at ~2 steps' cost
    measured(fast, clock, call_s=0.02, per_prompt_s=0.001, plain_token_s=0.015)
    assert isinstance(decide(fast), Speculate)
    slow = Policy(clock=clock)  # a round costs ten plain tokens
    measured(slow, clock, call_s=0.2, per_prompt_s=0.01, plain_token_s=0.02)
    assert isinstance(decide(slow), Plain)
    # A tree the drafter has no confidence in loses even where rounds are cheap.
    assert isinstance(decide(fast, tree_of([[0.05, 0.04]] * 4)), Plain)


def test_one_empty_tree_after_a_tree_is_verified_alone_a_second_goes_plain():
    """The drafter matched nothing at one token (an empty tree: the root alone is a
    plain step): right after a tree with nodes, the root alone, one token, and the next
    tree decides; two in a row, or at a request's start, the rates decide (plain)."""
    clock = Clock()
    fast = Policy(clock=clock)
    measured(fast, clock, call_s=0.02, per_prompt_s=0.001, plain_token_s=0.015)
    empty = root_only(1)
    assert isinstance(decide(fast, empty), Plain)  # a request's first tree
    request = fast.request(can_plain=True, seeded=False, client_streams=True)
    steps = [request.decide(tree, position=100 + i, unseen_tokens=1, remaining=64, max_depth=4)
             for i, tree in enumerate([tree_of(SURE_CHAIN), empty, tree_of(SURE_CHAIN), empty,
                                       empty])]  # fmt: skip
    assert [type(step) for step in steps] == [Speculate, Speculate, Speculate, Speculate, Plain]
    assert steps[1] == steps[3] == Speculate(0, "empty_after_tree")
    assert steps[4].reason == "plain_faster"


def test_rounds_that_pay_alone_lose_when_other_requests_share_the_steps():
    clock = Clock()
    policy = Policy(clock=clock)
    # Each prompt costs 4 ms of the engine's steps: alone, rounds of the sure chain win.
    measured(policy, clock, call_s=0.02, per_prompt_s=0.004, plain_token_s=0.015)
    assert isinstance(decide(policy), Speculate)
    # Three more requests in flight wait for every extra prompt too.
    others = [policy.request(can_plain=True, seeded=False, client_streams=True) for _ in range(3)]
    assert isinstance(decide(policy), Plain)
    for other in others:
        other.record(Finished())
    assert isinstance(decide(policy), Speculate)


def test_plain_stretches_are_timed_without_what_other_requests_rounds_added_calls_with_it():
    """Rounds are charged for the time every other request in flight waits for their
    extra prompts (`round_seconds`); the plain streams they slowed are not charged
    again, or plain would look slower the more others speculate, and more would. A
    round's call is learnt as it took: beside others' rounds, that is what one costs."""
    clock = Clock()
    policy = Policy(clock=clock)
    measured(policy, clock, call_s=0.02, per_prompt_s=0.004, plain_token_s=0.01)
    assert policy.stream_rate() == pytest.approx(100, rel=0.05)
    speculating = policy.request(can_plain=True, seeded=False, client_streams=True)
    for _ in range(3):
        streaming = policy.request(can_plain=True, seeded=False, client_streams=True)
        plain = streaming.decide(tree_of([[0.01]], budget=1), position=100, unseen_tokens=1,
                                 remaining=64, max_depth=4)  # fmt: skip
        assert isinstance(plain, Plain)
        # Meanwhile ten rounds of 9 prompts: each asks 8 prompts (32 ms) beyond one,
        # which the stream waited for too; its 64 tokens took 0.64 s + 0.32 s.
        for _ in range(10):
            speculating.record(RoundResult(tree_of(SURE_CHAIN), [1, 2, 3, 4], 5, 0.056,
                                           0.056, 9, 9))  # fmt: skip
        streaming.record(PlainTokens([0] * 164, 64, 0.64 + 0.32, ended=True))
        streaming.record(Finished())
    assert policy.stream_rate() == pytest.approx(100, rel=0.05)
    # A round's call waited for the other's rounds too, and is learnt with them.
    fresh_call_s = float(policy.calls.seconds(9, 9))
    assert fresh_call_s == pytest.approx(0.056, rel=0.05)
    for _ in range(3):
        verifying = policy.request(can_plain=False, seeded=False, client_streams=True)
        decision = verifying.decide(tree_of(SURE_CHAIN), position=100, unseen_tokens=1,
                                    remaining=64, max_depth=4)  # fmt: skip
        assert isinstance(decision, Speculate)
        for _ in range(10):
            speculating.record(RoundResult(tree_of(SURE_CHAIN), [1, 2, 3, 4], 5, 0.056,
                                           0.056, 9, 9))  # fmt: skip
        verifying.record(RoundResult(tree_of(SURE_CHAIN), [1, 2, 3, 4], 5, 0.056 + 0.32,
                                     0.056 + 0.32, 9, 9))  # fmt: skip
        verifying.record(Finished())
    # Three of the 33 calls since were 0.32 s slower: their mean rose by 0.029 s.
    assert float(policy.calls.seconds(9, 9)) > fresh_call_s + 0.01


def plain_stretches(policy: Policy, clock: Clock, in_flight: int, per_token_s: float) -> None:
    """`in_flight` requests, each timing plain stretches of 8 and 64 tokens, then ending."""
    requests = [policy.request(can_plain=True, seeded=False, client_streams=True)
                for _ in range(in_flight)]  # fmt: skip
    for request in requests:
        for tokens in (8, 64):
            request.record(PlainTokens([0] * 164, tokens, tokens * per_token_s, ended=True))
        clock.now += 0.05
    for request in requests:
        request.record(Finished())


def test_plain_is_predicted_at_the_present_load():
    """A plain stream's token takes longer the more requests share the engine's steps;
    after a drop from 16 requests to 4 plain is predicted at 4 (at the half-life's mix of
    both it would look slow for a half-life, and trees would win that lose). Measured at
    one load, a stretch is predicted the same at a higher one (nothing says how load
    matters); outside the loads observed plain is taken as fast as it could be: no
    slower above (an engine step of more sequences is never faster), in proportion
    below (a step of fewer takes no less than its share) -- so after a drop to a load
    never measured, plain is measured before trees are taken on the old load's word."""
    clock = Clock()
    policy = Policy(clock=clock)
    plain_stretches(policy, clock, 1, 0.01)
    streams = [policy.request(can_plain=True, seeded=False, client_streams=True) for _ in range(3)]
    assert policy.stream_rate() == pytest.approx(100, rel=0.01)
    for stream in streams:
        stream.record(Finished())
    plain_stretches(policy, clock, 16, 0.03)
    plain_stretches(policy, clock, 4, 0.01 + 0.02 * 3 / 15)
    streams = [policy.request(can_plain=True, seeded=False, client_streams=True) for _ in range(4)]
    assert policy.stream_rate() == pytest.approx(1 / 0.014, rel=0.05)
    streams += [policy.request(can_plain=True, seeded=False, client_streams=True)
                for _ in range(12)]  # fmt: skip
    assert policy.stream_rate() == pytest.approx(1 / 0.03, rel=0.05)
    streams += [policy.request(can_plain=True, seeded=False, client_streams=True)
                for _ in range(16)]  # fmt: skip
    assert policy.stream_rate() == pytest.approx(1 / 0.03, rel=0.05)  # 32: as at 16
    fresh = Policy(clock=clock)
    plain_stretches(fresh, clock, 16, 0.03)
    streams = [fresh.request(can_plain=True, seeded=False, client_streams=True) for _ in range(4)]
    assert fresh.stream_rate() == pytest.approx(4 / 0.03, rel=0.05)
    for stream in streams:
        stream.record(Finished())
    # Where load does not matter (a GPU's decode step barely grows with the batch), no
    # stretch is predicted slower for it.
    gpu = Policy(clock=clock)
    for in_flight in (1, 16, 4):
        plain_stretches(gpu, clock, in_flight, 0.02)
    for in_flight in (1, 4, 16):
        streams = [gpu.request(can_plain=True, seeded=False, client_streams=True)
                   for _ in range(in_flight)]  # fmt: skip
        assert gpu.stream_rate() == pytest.approx(50, rel=0.01)
        for stream in streams:
            stream.record(Finished())


def test_a_round_is_charged_for_the_requests_on_its_own_replica():
    """Replicas do not share steps: requests on another one cost a round nothing, and a
    request moved by a failover counts where it runs now."""
    clock = Clock()
    root = Policy(clock=clock)
    here, there = root.for_replica("http://a"), root.for_replica("http://b")
    measured(here, clock, call_s=0.02, per_prompt_s=0.004, plain_token_s=0.015)
    serving = {"url": "http://b"}
    others = [root.request(can_plain=True, seeded=False, client_streams=True,
                           replica=lambda: serving["url"]) for _ in range(3)]  # fmt: skip
    assert isinstance(decide(here), Speculate)
    serving["url"] = "http://a"  # failed over: counted here from their next decision
    for other in others:
        other.decide(tree_of(SURE_CHAIN), position=100, unseen_tokens=1, remaining=64, max_depth=4)
    assert isinstance(decide(here), Plain)
    for other in others:
        other.record(Finished())
    assert isinstance(decide(here), Speculate)
    assert here.in_flight == there.in_flight == root.in_flight == 0


def test_a_request_switches_only_past_the_band():
    clock = Clock()
    policy = Policy(clock=clock)
    # One sure node per round, one step per round: speculation's rate ~2 tokens per
    # round-time; plain's set to that rate times (1 + BAND/2), inside the band.
    tree = tree_of([[0.999]], budget=1)
    round_s = 0.02
    spec_rate = (1 + 0.999) / (round_s + 0.002)
    measured(policy, clock, call_s=round_s, per_prompt_s=0.001, plain_token_s=1 / (spec_rate * (1 + BAND / 2)))
    request = policy.request(can_plain=True, seeded=False, client_streams=True)
    kinds = [type(request.decide(tree, position=10, unseen_tokens=1, remaining=10_000, max_depth=4)) for _ in range(3)]
    assert len(set(kinds)) == 1  # no flapping inside the band, whichever side it starts on


def test_engine_mode_sizes_the_tree_and_never_goes_plain():
    clock = Clock()
    policy = Policy(clock=clock)
    request = policy.request(can_plain=False, seeded=False, client_streams=True)
    first = request.decide(tree_of(SURE_CHAIN), position=5, unseen_tokens=1, remaining=64, max_depth=4)
    assert first == Speculate(tree_of(SURE_CHAIN).num_nodes, "speculation_unmeasured")
    for num_prompts in (1, 3, 5, 9):  # each extra prompt nearly free
        request.record(RoundResult(tree_of([[0.5]]), [], 1, 0.01 + 1e-4 * num_prompts,
                             0.01 + 1e-4 * num_prompts, num_prompts, num_prompts))  # fmt: skip
    sure = request.decide(tree_of(SURE_CHAIN), position=5, unseen_tokens=1, remaining=64, max_depth=4)
    # The four sure nodes (the chain), not their 3 % siblings: a node must return more
    # tokens than its prompt costs at the round's rate.
    assert sure == Speculate(4, "no_plain_generation")
    # Each extra prompt costs as much as a whole round, and the drafter is never right:
    for num_prompts in (1, 3, 5, 9):
        request.record(RoundResult(tree_of([[0.5]]), [], 1, 0.01 * num_prompts, 0.01 * num_prompts,
                             num_prompts, num_prompts))  # fmt: skip
    hopeless = request.decide(tree_of([[0.01, 0.01]] * 4), position=5, unseen_tokens=1, remaining=64, max_depth=4)
    assert hopeless == Speculate(0, "no_plain_generation")


def stale_speculation() -> Policy:
    """A policy on which plain wins, its speculation estimate two half-lives older than
    plain's (just measured, by a request in flight all that time): due for a
    re-measurement."""
    clock = Clock()
    policy = Policy(clock=clock)
    measured(policy, clock, call_s=0.2, per_prompt_s=0.01, plain_token_s=0.02)
    request = policy.request(can_plain=True, seeded=False, client_streams=True)
    clock.now += 2 * HALF_LIFE_S
    request.record(PlainTokens([0] * 64, 64, 64 * 0.02, ended=True))
    return policy


def test_the_older_side_is_remeasured_by_one_request():
    policy = stale_speculation()
    claims = [decide(policy) for _ in range(4)]
    remeasured = [d for d in claims if d.reason == "remeasure_speculation"]
    assert len(remeasured) == 1 and isinstance(remeasured[0], Speculate)
    assert all(isinstance(d, Plain) for d in claims if d.reason != "remeasure_speculation")
    # The other way round: speculation measured lately, plain long ago -> a short stream.
    clock2 = Clock()
    other = Policy(clock=clock2)
    measured(other, clock2, call_s=0.01, per_prompt_s=0.0001, plain_token_s=0.05)
    request = other.request(can_plain=True, seeded=False, client_streams=True)
    clock2.now += 2 * HALF_LIFE_S
    request.record(RoundResult(tree_of(SURE_CHAIN), [1, 2], 3, 0.011, 0.0105, 5, 8))
    probe = request.decide(tree_of(SURE_CHAIN), position=9, unseen_tokens=3, remaining=64, max_depth=4)
    assert probe == Plain(SHADOW_EVERY, True, None, "remeasure_plain")
    assert isinstance(decide(other), Speculate)  # one request re-measures
    # A request that speculates re-measures plain too, once it is stale again.
    speculating = other.request(can_plain=True, seeded=False, client_streams=True)
    assert isinstance(speculating.decide(tree_of(SURE_CHAIN), position=9, unseen_tokens=3,
                                         remaining=64, max_depth=4), Speculate)  # fmt: skip
    clock2.now += 2 * HALF_LIFE_S
    speculating.record(RoundResult(tree_of(SURE_CHAIN), [1, 2], 3, 0.011, 0.0105, 5, 8))
    probe = speculating.decide(tree_of(SURE_CHAIN), position=12, unseen_tokens=3, remaining=64, max_depth=4)
    assert probe == Plain(SHADOW_EVERY, True, None, "remeasure_plain")


def test_a_pause_makes_no_estimate_stale():
    """Ages count only time with requests in flight: requests that come one at a time,
    1.5 half-lives apart, do not re-measure speculation (with wall-clock ages, every
    other one would: plain is measured by each, speculation by none); a half-life of
    serving does."""
    clock = Clock()
    policy = Policy(clock=clock)
    measured(policy, clock, call_s=0.2, per_prompt_s=0.01, plain_token_s=0.02)

    def plain_request(seconds: float) -> str:
        request = policy.request(can_plain=True, seeded=False, client_streams=True)
        decision = request.decide(tree_of(SURE_CHAIN), position=100, unseen_tokens=1,
                                  remaining=64, max_depth=4)  # fmt: skip
        clock.now += seconds
        request.record(PlainTokens([0] * 64, 64, seconds, ended=True))
        request.record(Finished())
        return decision.reason

    reasons = []
    for _ in range(6):
        clock.now += 1.5 * HALF_LIFE_S  # nothing in flight
        reasons.append(plain_request(64 * 0.02))
    assert reasons == ["plain_faster"] * 6
    plain_request(HALF_LIFE_S)  # served on for a half-life
    assert plain_request(64 * 0.02) == "remeasure_speculation"


def test_speculation_is_remeasured_by_two_rounds_of_two_sizes():
    # Calls of one size cannot tell the per-call cost from the per-prompt one, and an
    # empty tree (the drafter guessed nothing) is a one-prompt call whatever the load.
    # The re-measurement waits for a tree with nodes, takes it whole, then at most half as
    # many nodes of the next tree, whatever its size.
    policy = stale_speculation()
    empty = [decide(policy, root_only(1)) for _ in range(3)]
    assert all(isinstance(d, Plain) for d in empty)
    probe = policy.request(can_plain=True, seeded=False, client_streams=True)
    small, large = tree_of([[0.9]] * 3, budget=3), tree_of(SURE_CHAIN)
    assert small.num_nodes == 3 and large.num_nodes == 8
    rounds = [probe.decide(tree, position=100, unseen_tokens=1, remaining=64, max_depth=4)
              for tree in (small, large)]  # fmt: skip
    assert rounds == [Speculate(3, "remeasure_speculation"),
                      Speculate(1, "remeasure_speculation")]  # fmt: skip
    assert isinstance(decide(policy), Plain)  # one request re-measures


def test_speculation_is_remeasured_inside_an_answer_not_at_a_prompts_end():
    # At a prompt's end every prompt of a round computes the whole uncached prompt: a
    # round dearer than any after it. The re-measurement waits for a tree with no more
    # unseen context than a round commits (max_depth + 1 tokens).
    policy = stale_speculation()
    at_prompt_end = [decide(policy, new=200, streams=streams) for streams in (True, False)]
    assert all(isinstance(d, Plain) and d.reason == "plain_faster" for d in at_prompt_end)
    assert decide(policy, new=5) == Speculate(8, "remeasure_speculation")  # max_depth 4


def test_a_round_right_after_a_plain_stretch_prices_the_switch_not_the_rounds():
    # An engine that has decoded plain answers the next round slower than it answers a
    # round after a round: a cost of switching once, which the band covers, not a cost
    # of every round in the run it starts. Here it is ten times a round's.
    clock = Clock()
    policy = Policy(clock=clock)
    request = policy.request(can_plain=True, seeded=False, client_streams=True)
    tree, chain = tree_of(SURE_CHAIN), [1, 2, 3, 4]
    for num_prompts, plain_tokens in ((1, 8), (5, 64), (9, 8)):
        request.record(PlainTokens([0] * (100 + plain_tokens), plain_tokens,
                                   0.010 * plain_tokens, ended=True))  # fmt: skip
        for call_s in (0.2, 0.02):  # right after the stretch, then after a round
            seconds = call_s + 0.001 * num_prompts
            request.record(RoundResult(tree, chain, 5, seconds, seconds, num_prompts,
                                       num_prompts))  # fmt: skip
    request.record(Finished())
    # Rounds of ~4.6 tokens at ~25 ms against plain's 100 tokens/s.
    decision = decide(policy)
    assert isinstance(decision, Speculate) and decision.reason == "speculation_faster"


def test_short_plain_requests_do_not_make_long_ones_speculate():
    # Requests of one token measure plain generation only at that length: what a longer
    # stretch costs is unknown, and the policy must not guess it dear and leave plain.
    clock = Clock()
    policy = Policy(clock=clock)
    request = policy.request(can_plain=True, seeded=False, client_streams=True)
    for _ in range(16):  # a stream of one token: 40 ms, opening and token alike
        request.record(PlainTokens([0] * 101, 1, 0.040, ended=True, first=(1, 0.040)))
    # Speculation measured too: rounds of the sure chain at 30 ms (one token at 40 ms
    # plain, so on a one-token request a round wins).
    measured_rounds = policy.request(can_plain=True, seeded=False, client_streams=True)
    for num_prompts in (1, 5, 9):
        measured_rounds.record(RoundResult(tree_of(SURE_CHAIN), [1, 2, 3, 4], 5, 0.03, 0.03,
                                           num_prompts, num_prompts))  # fmt: skip
    assert isinstance(decide(policy, remaining=64), Plain)


def test_one_stream_measures_its_opening_and_its_tokens():
    # Every stretch has 64 tokens: only the stream's first event tells the opening (60 ms)
    # from the tokens (5 ms each), which decides a request that needs few tokens.
    clock = Clock()
    policy = Policy(clock=clock)
    request = policy.request(can_plain=True, seeded=False, client_streams=True)
    for _ in range(4):
        request.record(PlainTokens([0] * 164, 64, 0.060 + 64 * 0.005, ended=True,
                                   first=(1, 0.065)))  # fmt: skip
    assert policy.plain_rate(10, stream_open=False) == pytest.approx(10 / 0.110, rel=0.05)
    assert policy.plain_rate(10, stream_open=True) == pytest.approx(1 / 0.005, rel=0.05)


def test_shadows_teach_the_calibration_while_plain():
    clock = Clock()
    policy = Policy(clock=clock)
    # Rounds cheap enough that a tree all accepted would beat plain, this one not.
    measured(policy, clock, call_s=0.02, per_prompt_s=0.001, plain_token_s=0.01)
    doubtful = tree_of([[0.3, 0.2]] * 4, root=7)
    request = policy.request(can_plain=True, seeded=False, client_streams=True)
    before = policy.calibration.acceptance(doubtful)[0]
    for step in range(20):
        position = 100 + 8 * step
        decision = request.decide(doubtful, position=position, unseen_tokens=1, remaining=512, max_depth=4)
        if isinstance(decision, Speculate):
            break
        assert decision.recheck_after == policy.shadow_spacing()
        # The target always took the drafter's first guess at every depth.
        committed = [0] * (position - 1) + [7, 10, 20, 30, 40, 5, 5, 5, 5]
        request.record(PlainTokens(committed, 8 * (step + 1), 0.01 * 8 * (step + 1), ended=False))
    assert step > 0 and policy.calibration.acceptance(doubtful)[0] > before + 0.2
    # What the shadows taught brings the request back to speculation.
    assert decision == Speculate(decision.num_nodes, "speculation_faster")


def test_a_request_whose_own_trees_miss_steps_aside_while_a_fresh_one_speculates():
    """The calibration pools every request; within one, acceptance runs in streaks, so a
    request's own walks scale the pool's rates for it: after its tree missed it steps
    aside where another request still speculates on the same tree, and what its shadows
    then see accepted brings it back."""
    clock = Clock()
    policy = Policy(clock=clock)
    # Every round 20 ms whatever its size (no request's prompts delay another's), a plain
    # token 6.7 ms: the pool's rate for the tree below is ~4.1 tokens a round.
    measured(policy, clock, call_s=0.02, per_prompt_s=0.0, plain_token_s=1 / 150)
    tree = tree_of([[0.7]] * 4, root=7)  # a chain the drafter gives 0.7 at each depth
    chain = [1, 2, 3, 4]
    for i in range(100):  # the pool: 7 requests in 10 took the whole chain, 3 none of it
        policy.calibration.observe(tree, chain if i % 10 < 7 else [])
    missing = policy.request(can_plain=True, seeded=False, client_streams=True)
    first = missing.decide(tree, position=100, unseen_tokens=1, remaining=512, max_depth=4)
    assert first == Speculate(4, "speculation_faster")
    missing.record(RoundResult(tree, [], 1, 0.02, 0.02, 5, 5))  # nothing accepted
    assert isinstance(missing.decide(tree, position=101, unseen_tokens=1, remaining=511,
                                     max_depth=4), Plain)  # fmt: skip
    assert decide(policy, tree) == Speculate(4, "speculation_faster")  # the pool's word
    # The plain stream's tokens follow the chain: the shadow accepts all of it.
    committed = [0] * 100 + [7, 10, 20, 30, 40, 5, 5, 5]
    missing.record(PlainTokens(committed, 8, 0.05, ended=False))
    back = missing.decide(tree, position=109, unseen_tokens=1, remaining=503, max_depth=4)
    assert back == Speculate(4, "speculation_faster")
    missing.record(Finished())


def test_a_stream_no_tree_could_beat_is_read_on_without_drafting():
    clock = Clock()
    policy = Policy(clock=clock)
    # A round costs ten plain tokens: even four of four nodes accepted lose.
    measured(policy, clock, call_s=0.2, per_prompt_s=0.01, plain_token_s=0.02)
    decision = decide(policy, remaining=512)
    assert isinstance(decision, Plain) and decision.reason == "plain_faster"
    # The next look comes when the estimates have gone stale: a half-life of tokens.
    assert decision.recheck_after == pytest.approx(HALF_LIFE_S / 0.02, rel=0.05)
    # Where rounds are cheap enough that a better tree could win, every SHADOW_EVERY.
    cheap = Policy(clock=clock)
    measured(cheap, clock, call_s=0.02, per_prompt_s=0.001, plain_token_s=0.01)
    doubtful = decide(cheap, tree_of([[0.3, 0.2]] * 4), remaining=512)
    assert isinstance(doubtful, Plain) and doubtful.recheck_after == cheap.shadow_spacing()


def test_plain_is_timed_only_where_the_proxy_did_not_draft_beside_it():
    """Plain's rate is what stepping aside costs. A stream the proxy drafts shadows
    beside is slower by that drafting (on a host shared with the engine, by the engine's
    lost CPU too): timed, it would make plain look slow enough that drafting beside it
    kept seeming worth it. Its shadows teach the calibration; its time teaches nothing.
    The same stretch read without drafting (one answer) is plain's rate."""
    clock = Clock()
    policy = Policy(clock=clock)
    # Plain at ~133 tokens/s; a full chain all accepted would beat it by the band.
    measured(policy, clock, call_s=0.023, per_prompt_s=0.001, plain_token_s=0.0075)
    doubtful = tree_of([[0.3, 0.2]] * 4)
    rate = policy.stream_rate()
    assert policy.speculation_ceiling(4) > (1 + BAND) * rate
    drafting = policy.request(can_plain=True, seeded=False, client_streams=True)
    decision = drafting.decide(doubtful, position=100, unseen_tokens=1, remaining=512,
                               max_depth=4)  # fmt: skip
    assert isinstance(decision, Plain) and decision.recheck_after <= SHADOW_EVERY
    # The stream it drafted beside ran at 50 tokens/s. Its first piece came before any
    # drafting, but the fit already tells the opening from the tokens: untimed too (at
    # load such pieces, one token each, would teach the tokens the opening's time).
    opened = policy.plain_rate(512, stream_open=False)
    drafting.record(PlainTokens([0] * 612, 512, 512 * 0.02, ended=True, first=(1, 0.5),
                                rechecks=100, recheck_seconds=0.1))  # fmt: skip
    drafting.record(Finished())
    assert policy.stream_rate() == pytest.approx(rate)
    assert policy.plain_rate(512, stream_open=False) == pytest.approx(opened)
    looking = decide(policy, doubtful, streams=False, remaining=512)  # one per half-life
    assert looking.stream and looking.recheck_after <= SHADOW_EVERY
    one_answer = policy.request(can_plain=True, seeded=False, client_streams=False)
    decision = one_answer.decide(doubtful, position=100, unseen_tokens=1, remaining=512,
                                 max_depth=4)  # fmt: skip
    assert decision == Plain(512, False, None, "plain_faster")
    one_answer.record(PlainTokens([0] * 612, 512, 512 * 0.02, ended=True))
    one_answer.record(Finished())
    assert policy.stream_rate() < 0.5 * rate


@pytest.mark.parametrize(("overhead_s", "spacing"), [(0.0, 1), (0.0009, 2), (0.0031, 7), (0.01, 8)])
def test_shadows_are_spaced_by_what_drafting_costs_the_host(overhead_s, spacing):
    """A shadow costs about a round's host overhead; a stream drafts as often as keeps
    that within SHADOW_SHARE of its own time, every token where drafting is cheap next to
    a token, at most every SHADOW_EVERY."""
    clock = Clock()
    policy = Policy(clock=clock)
    measured(policy, clock, call_s=0.02, per_prompt_s=0.001, plain_token_s=0.01,
             overhead_s=overhead_s)  # fmt: skip
    assert SHADOW_EVERY == 8 and SHADOW_SHARE == 0.05  # the spacings below: 0.01 s a token
    decision = decide(policy, tree_of([[0.3, 0.2]] * 4), remaining=512)
    assert decision == Plain(512, True, spacing, "plain_faster")
    # Text from vLLM's /detokenize: every piece (one per decision) is a call.
    remote = decide(policy, tree_of([[0.3, 0.2]] * 4), remaining=512, remote_text=True)
    assert remote == Plain(512, True, SHADOW_EVERY, "plain_faster")


def test_a_stream_spaces_its_shadows_by_what_its_own_rechecks_cost():
    """A decision on an open stream also runs the policy and cuts a piece: once the loop
    has reported what its rechecks took, they, not a round's overhead, set the spacing;
    reported cumulatively, each recheck counts once. The requests in flight share the
    host's share."""
    clock = Clock()
    policy = Policy(clock=clock)
    measured(policy, clock, call_s=0.02, per_prompt_s=0.001, plain_token_s=0.01)
    assert policy.shadow_spacing() == 1  # a round's overhead: nothing measured
    request = policy.request(can_plain=True, seeded=False, client_streams=True)
    for rechecks in range(1, 11):  # 1.4 ms each: within 5 % of 0.01 s tokens every 3
        request.record(PlainTokens([0] * (100 + rechecks), rechecks, 0.01 * rechecks,
                                   ended=False, rechecks=rechecks,
                                   recheck_seconds=0.0014 * rechecks))  # fmt: skip
    request.record(Finished())
    assert policy.snapshot()["recheck_s"] == pytest.approx(0.0014)
    assert policy.shadow_spacing() == 3
    decision = decide(policy, tree_of([[0.3, 0.2]] * 4), remaining=512)
    assert decision == Plain(512, True, 3, "plain_faster")
    # Another request in flight may draft on the same host: the share is split in two.
    other = policy.request(can_plain=True, seeded=False, client_streams=True)
    decision = decide(policy, tree_of([[0.3, 0.2]] * 4), remaining=512)
    assert decision == Plain(512, True, 6, "plain_faster")
    other.record(Finished())
    assert policy.shadow_spacing() == 3


def test_a_client_that_does_not_stream_gets_one_answer_unless_trees_have_lately_won():
    """One answer cannot be closed early: the whole rest of the request stays plain. A
    tree that loses (the drafter had nothing here) does not decide that while trees
    elsewhere win, nor for the one request per half-life that looks for them; where no
    tree could win, nothing does."""
    clock = Clock()
    cheap = Policy(clock=clock)
    measured(cheap, clock, call_s=0.02, per_prompt_s=0.001, plain_token_s=0.01)
    nothing_drafted = tree_of([[0.01]], budget=1)
    drafted = Plain(512, True, cheap.shadow_spacing(), "plain_faster")
    one_answer = Plain(512, False, None, "plain_faster")
    # No request has speculated: one looks, the others get one answer ...
    looks = [decide(cheap, nothing_drafted, streams=False, remaining=512) for _ in range(3)]
    assert looks == [drafted, one_answer, one_answer]
    busy(cheap, clock, HALF_LIFE_S * 1.01)  # ... until a half-life of serving later
    assert decide(cheap, nothing_drafted, streams=False, remaining=512) == drafted
    assert decide(cheap, nothing_drafted, streams=False, remaining=512) == one_answer
    # A request speculated on its tree: every loser drafts on for a half-life.
    assert isinstance(decide(cheap), Speculate)
    assert decide(cheap, nothing_drafted, streams=False, remaining=512) == drafted
    assert decide(cheap, nothing_drafted, streams=False, remaining=512) == drafted
    busy(cheap, clock, HALF_LIFE_S * 1.01)
    assert decide(cheap, nothing_drafted, streams=False, remaining=512) == drafted  # the look
    assert decide(cheap, nothing_drafted, streams=False, remaining=512) == one_answer
    dear = Policy(clock=clock)
    measured(dear, clock, call_s=0.2, per_prompt_s=0.01, plain_token_s=0.02)
    assert decide(dear, streams=False, remaining=512) == Plain(512, False, None, "plain_faster")


def test_every_decision_is_counted_and_traced():
    clock = Clock()
    records = []
    policy = Policy(clock=clock, trace=records.append)
    decide(policy)
    measured(policy, clock, call_s=0.02, per_prompt_s=0.001, plain_token_s=0.02)
    decide(policy)
    assert policy.decisions[("plain", "plain_unmeasured")] == 1
    decided = [record for record in records if "decision" in record]  # not `outcome`s
    assert sum(policy.decisions.values()) == len(decided) == 2
    assert {"t", "request", "decision", "reason", "remaining"} <= set(decided[-1])
    assert decided[-1]["spec_rate"] > 0 and decided[-1]["plain_rate"] > 0
    # The round it compared: its call (0.02 s, and about 0.001 s a prompt of the 9 at
    # most timed), nothing for others (none in flight) or the host; its expected tokens,
    # 1 to best_nodes + 1.
    last = decided[-1]
    assert 0.02 < last["call_s"] < 0.02 + 0.002 * 9
    assert last["round_s"] == pytest.approx(last["call_s"])
    assert 0 < last["extra_s"] < last["call_s"] - 0.02
    assert 1 <= last["spec_rate"] * last["round_s"] <= last["best_nodes"] + 1


def test_every_timed_round_and_stretch_is_traced_beside_its_prediction():
    """Beside the decisions, the trace has each round and plain stretch as timed and what
    the estimates predicted for it before they learnt from it: a reader can check them."""
    clock = Clock()
    records = []
    policy = Policy(clock=clock, trace=records.append)
    measured(policy, clock, call_s=0.02, per_prompt_s=0.001, plain_token_s=0.02)
    assert not any("decision" in r for r in records)  # `measured` records, never decides
    rounds = [r for r in records if r["outcome"] == "round"]
    stretches = [r for r in records if r["outcome"] == "plain"]
    assert [(r["prompts"], r["tokens"]) for r in rounds] == [(1, 5), (5, 5), (9, 5)]
    assert [r["seconds"] for r in rounds] == pytest.approx([0.021, 0.025, 0.029])
    assert [(r["tokens"], r["seconds"]) for r in stretches] == [(8, 0.16), (64, 1.28)]
    assert rounds[0]["predicted_s"] == stretches[0]["predicted_s"] == 0  # nothing timed yet
    # Two call sizes fix the line: the third call is predicted as it then took.
    assert rounds[2]["predicted_s"] == pytest.approx(0.029, rel=0.01)
    assert all(r["slowed"] == 0 for r in stretches)  # no other request's round ran beside


def test_a_remeasuring_round_is_traced_with_the_nodes_it_verifies():
    policy = stale_speculation()
    records = []
    policy.trace = records.append
    probe = policy.request(can_plain=True, seeded=False, client_streams=True)
    for tree in (tree_of([[0.9]] * 3, budget=3), tree_of(SURE_CHAIN)):
        probe.decide(tree, position=100, unseen_tokens=1, remaining=64, max_depth=4)
    assert [(r["reason"], r["nodes"], r["best_nodes"]) for r in records] == [
        ("remeasure_speculation", 3, 3), ("remeasure_speculation", 8, 1)]


def scripted_decisions(stretch: float, half_life_s: float) -> list:
    """A scripted life of a policy whose upstream's clock runs `stretch` times slower
    (every call, stream and gap takes `stretch` times longer): speculation measured and
    then left stale while plain streams on, requests that do not stream, a stream no
    tree could beat. The decisions, their reasons and rechecks."""
    clock = Clock()
    policy = Policy(clock=clock, half_life_s=half_life_s)
    measured(policy, clock, call_s=0.2 * stretch, per_prompt_s=0.01 * stretch,
             plain_token_s=0.02 * stretch)  # fmt: skip
    decisions = []
    for _ in range(16):  # 16 s of plain streaming at the GPU's pace
        request = policy.request(can_plain=True, seeded=False, client_streams=True)
        clock.now += 1.0 * stretch
        request.record(PlainTokens([0] * 50, 50, 50 * 0.02 * stretch, ended=True))
        request.record(Finished())
        decisions += [decide(policy, remaining=512),
                      decide(policy, tree_of([[0.01]], budget=1), streams=False, remaining=512)]  # fmt: skip
    return decisions


def test_a_stretched_clock_with_a_half_life_stretched_alike_decides_the_same():
    """Behind the GPU simulator every duration is `dilation` times a GPU's; with
    `--policy-half-life` stretched alike the policy takes the decisions it would take on
    the GPU itself -- and on the default half-life it does not (it re-measures and looks
    for trees `dilation` times as often per simulated second)."""
    on_gpu = scripted_decisions(1.0, HALF_LIFE_S)
    assert {d.reason for d in on_gpu} >= {"plain_faster", "remeasure_speculation"}
    assert scripted_decisions(12.0, 12 * HALF_LIFE_S) == on_gpu
    assert scripted_decisions(12.0, HALF_LIFE_S) != on_gpu


def test_answers_of_one_length_do_not_hide_what_a_tree_could_win():
    """Plain timed only as one-answer stretches of one length cannot tell a stream's
    opening from its tokens (the fit charges it all to the opening: a stream would look
    free). What a tree could win is judged against plain's rate for the rest of the
    request, opening counted -- the rate the decision compared: a client that does not
    stream, whose drafter had nothing at its prompt, drafts while trees win; and its
    stream's first piece times the opening, so that a later tree can beat a stream."""
    clock = Clock()
    policy = Policy(clock=clock)
    request = policy.request(can_plain=True, seeded=False, client_streams=False)
    tree, chain = tree_of(SURE_CHAIN), [1, 2, 3, 4]
    for num_prompts in (1, 5, 9):  # rounds of 5 tokens in about 0.25 s
        seconds = 0.25 + 0.001 * num_prompts
        request.record(RoundResult(tree, chain, 5, seconds, seconds, num_prompts, num_prompts))
    for _ in range(3):  # 64-token answers at 5 tokens a second
        request.record(PlainTokens([0] * 64, 64, 12.8, ended=True))
    request.record(Finished())
    assert policy.plain_rate(64, stream_open=False) == pytest.approx(5.0)
    assert isinstance(decide(policy, streams=False), Speculate)  # trees win here
    nothing_drafted = tree_of([[0.01]], budget=1)
    decision = decide(policy, nothing_drafted, streams=False)
    assert decision == Plain(64, True, policy.shadow_spacing(), "plain_faster")
    # Such a stream's first piece came before any drafting beside it: it times the
    # opening (0.2 s), and the next request's open stream is 5 tokens a second, not free.
    first = policy.request(can_plain=True, seeded=False, client_streams=False)
    assert first.decide(nothing_drafted, position=100, unseen_tokens=1, remaining=64,
                        max_depth=4).recheck_after is not None  # fmt: skip
    first.record(PlainTokens([0] * 164, 64, 13.0, ended=True, first=(1, 0.4)))
    first.record(Finished())
    request = policy.request(can_plain=True, seeded=False, client_streams=False)
    request.decide(nothing_drafted, position=100, unseen_tokens=1, remaining=64, max_depth=4)
    request.record(PlainTokens([0] * 108, 8, 1.8, ended=False, first=(1, 0.4)))
    again = request.decide(tree, position=108, unseen_tokens=1, remaining=56, max_depth=4)
    assert again == Speculate(again.num_nodes, "speculation_faster")
