"""The adaptive policy's parts on their own: the online cost fit, the calibration, and
the controller's decisions for costs and acceptance given by construction."""

from __future__ import annotations

import numpy as np
import pytest

from proxy.adaptive import AdaptiveState, Calibration, CostModel
from proxy.adaptive.controller import FIRST_CHUNK, MAX_CHUNK, MIN_CALLS, PROBE_FIRST
from proxy.tree import DraftDistribution, build_tree


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


def test_cost_model_plain_latency():
    costs = CostModel()
    assert costs.plain_seconds(10) is None
    for _ in range(50):
        costs.observe_plain(0.020, [0.005] * 16)
    assert costs.plain_seconds(10) == pytest.approx(0.020 + 9 * 0.005)


def test_calibration_learns_an_overconfident_drafter():
    calibration = Calibration()
    log_p = np.log(np.full(400, 0.8))
    # Before any evidence: the drafter's own probability.
    assert calibration.acceptance(log_p[:1])[0] == pytest.approx(0.8)
    rng = np.random.default_rng(1)
    calibration.observe(log_p, rng.random(400) < 0.3)  # really accepted 30% of the time
    assert calibration.acceptance(log_p[:1])[0] == pytest.approx(0.3, abs=0.06)


def _tree(top_p: float, budget: int = 16, depth: int = 6):
    """A tree whose rank-0 tokens carry probability top_p at every depth."""
    rest = (1 - top_p) / (budget - 1)
    probs = np.array([top_p] + [rest] * (budget - 1))
    ids = np.tile(np.arange(budget, dtype=np.int64), (depth, 1)) + 10
    return build_tree(5, DraftDistribution(ids, np.tile(np.log(probs), (depth, 1))), budget, depth)


def _trained_state(per_call, per_prompt, per_token, plain_token_s=None, round_rate=None):
    state = AdaptiveState()
    if round_rate is not None:
        state.costs.observe_round(1, 1 / round_rate, 0.0)
    rng = np.random.default_rng(2)
    for _ in range(3 * MIN_CALLS):
        prompts, tokens = rng.integers(1, 33), rng.integers(1, 200)
        state.costs.observe_call(prompts, tokens, per_call + per_prompt * prompts + per_token * tokens)
    if plain_token_s is not None:
        state.costs.observe_plain(plain_token_s, [plain_token_s] * 32)
    return state


def test_controller_verifies_more_nodes_when_nodes_are_cheap():
    tree = _tree(0.9)
    cheap = _trained_state(0.010, 0.0001, 0.0).controller(can_stream=False, seeded=False)
    dear = _trained_state(0.010, 0.010, 0.0).controller(can_stream=False, seeded=False)
    assert cheap.choose_nodes(tree, 1) > dear.choose_nodes(tree, 1) >= 1


def test_controller_verifies_the_root_alone_when_drafts_never_land():
    state = _trained_state(0.010, 0.002, 0.0)
    tree = _tree(0.9)
    state.calibration.observe(tree.path_log_probs[1:], np.zeros(tree.num_nodes, dtype=bool))
    for _ in range(30):
        state.calibration.observe(tree.path_log_probs[1:], np.zeros(tree.num_nodes, dtype=bool))
    assert state.controller(can_stream=False, seeded=False).choose_nodes(tree, 1) == 0


def test_controller_steps_aside_probes_and_comes_back():
    # Plain generation at 5 ms/token against 30 ms calls: a weak tree does not pay.
    state = _trained_state(0.030, 0.002, 0.0, plain_token_s=0.005)
    controller = state.controller(can_stream=True, seeded=False)
    controller.start()
    weak = _tree(0.2)
    controller.choose_nodes(weak, 1)
    assert controller.plain and controller.num_switches_to_plain == 1
    assert controller.next_is_plain()
    # Unpredictable text: the stream runs until a probe is due, then one real round...
    committed = list(range(100, 110))
    left_at = None
    for count in range(1, 200):
        committed.append(200 + count)
        if controller.observe_plain_tokens(committed, 1):
            left_at = count
            break
    assert left_at == PROBE_FIRST and not controller.next_is_plain()
    controller.choose_nodes(weak, 1)  # the probe round: plain still wins
    assert controller.plain and controller.next_is_plain()
    # ...and the next probe comes after twice as many plain tokens.
    left = [controller.observe_plain_tokens(committed, 1) for _ in range(2 * PROBE_FIRST)]
    assert left.index(True) == 2 * PROBE_FIRST - 1
    # Shadow rounds on text the drafter predicts perfectly: deep trees land -> back.
    controller.choose_nodes(weak, 1)
    strong = _tree(0.999, budget=16, depth=16)  # a chain of 16 likely tokens
    path = [int(t) for t in strong.token_ids[strong.path(int(np.argmax(strong.depths)))]]
    committed = [1, 2, 3, 5]
    leaves = []
    for _ in range(2):
        controller.add_shadow(strong, len(committed), 1)
        committed += path + [5]  # the predicted tokens came, then the next root
        leaves.append(controller.observe_plain_tokens(committed, len(path) + 1))
    assert leaves == [False, True]  # two shadow rounds make the prediction
    assert not controller.plain and controller.num_switches_to_speculation == 1


def test_plain_chunks_double_and_a_seeded_request_takes_the_rest_at_once():
    state = _trained_state(0.030, 0.002, 0.0, plain_token_s=0.005)
    controller = state.controller(can_stream=True, seeded=False)
    assert [controller.plain_chunk(1000) for _ in range(5)] == [
        FIRST_CHUNK, 2 * FIRST_CHUNK, 4 * FIRST_CHUNK, MAX_CHUNK, MAX_CHUNK
    ]
    assert controller.plain_chunk(10) == 10
    controller.choose_nodes(_tree(0.2), 1)  # steps aside: chunks start small again
    assert controller.plain and controller.plain_chunk(1000) == FIRST_CHUNK
    seeded = state.controller(can_stream=True, seeded=True)
    assert seeded.plain_chunk(1000) == 1000


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
