"""Engine-mode sampling is lossless.

With a client seed, the draw for the token at absolute position p is seeded by
(seed, p), so the output must not depend on the drafter, the budget or the tree.
Without depending on that, the first two generated tokens over thousands of seeds
must follow the target's own filtered distribution, computed here by `oracle_probs`
from the definitions (not by the implementation's filter, which is checked against
the oracle and against hand-computed answers).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch
from conftest import run
from scipy.stats import chisquare

from proxy.backend.engine.token_choice import filtered_probs
from proxy.decoding import GenerationRequest, TreeSettings, generate
from proxy.drafter import load_drafter
from proxy.runtime import Runtime, load_engine, target_info
from proxy.sampling import SamplingParams


def oracle_probs(
    logits: list[float], temperature: float, top_k: int = 0, top_p: float = 1.0
) -> np.ndarray:  # [vocab] float64
    """vLLM's filtered distribution, from the definitions: softmax of logits / temperature;
    top-k keeps the k largest logits (every token tied with the k-th largest too; k = 0
    or k >= vocab keeps all); top-p then keeps the smallest prefix of the renormalised
    distribution, sorted by probability, whose mass reaches top_p (at least one token)."""
    scaled = [logit / temperature for logit in logits]
    if 0 < top_k < len(scaled):
        kth_largest = sorted(scaled, reverse=True)[top_k - 1]
        scaled = [value if value >= kth_largest else -math.inf for value in scaled]
    peak = max(scaled)
    weights = [math.exp(value - peak) for value in scaled]
    probs = [weight / sum(weights) for weight in weights]
    kept, mass = [], 0.0
    for token in sorted(range(len(probs)), key=lambda token: -probs[token]):
        kept.append(token)
        mass += probs[token]
        if mass >= top_p:
            break
    kept_mass = sum(probs[token] for token in kept)
    out = np.zeros(len(probs))
    for token in kept:
        out[token] = probs[token] / kept_mass
    return out


def _logits_for(weights: list[float]) -> list[float]:
    """Logits whose softmax is proportional to `weights` (0 -> -inf)."""
    return [math.log(weight) if weight else -math.inf for weight in weights]


# (logits, temperature, top_k, top_p, the filtered distribution worked out by hand)
HAND_CASES = [
    (_logits_for([1, 2, 5]), 1.0, 0, 1.0, [1 / 8, 2 / 8, 5 / 8]),  # no filter
    (_logits_for([1, 2, 5]), 1.0, 10, 1.0, [1 / 8, 2 / 8, 5 / 8]),  # top_k > vocab
    (_logits_for([1, 2, 5]), 1.0, 3, 1.0, [1 / 8, 2 / 8, 5 / 8]),  # top_k == vocab
    ([1.0, 3.0, 2.0], 0.7, 1, 1.0, [0, 1, 0]),  # top_k = 1: the argmax
    (_logits_for([4, 2, 2, 1, 1]), 1.0, 2, 1.0, [1 / 2, 1 / 4, 1 / 4, 0, 0]),  # tie at k
    (_logits_for([4, 1, 1]), 1.0, 2, 1.0, [4 / 6, 1 / 6, 1 / 6]),  # tie at k, all kept
    (_logits_for([1, 4]), 2.0, 0, 1.0, [1 / 3, 2 / 3]),  # temperature 2: weights 1, 2
    ([0.0, 2.0], 0.5, 0, 1.0, [1 / (1 + math.e**4), math.e**4 / (1 + math.e**4)]),
    (_logits_for([1, 2, 3, 4]), 1.0, 0, 0.5, [0, 0, 3 / 7, 4 / 7]),  # 0.4 < 0.5 <= 0.7
    (_logits_for([1, 2, 3, 4]), 1.0, 0, 0.35, [0, 0, 0, 1]),  # 0.4 reaches 0.35
    (_logits_for([1, 2, 3, 4]), 1.0, 0, 0.01, [0, 0, 0, 1]),  # at least one token
    (_logits_for([1, 2, 3, 4]), 1.0, 0, 0.95, [1 / 10, 2 / 10, 3 / 10, 4 / 10]),
    (_logits_for([8, 4, 2, 1, 1]), 1.0, 3, 0.8, [2 / 3, 1 / 3, 0, 0, 0]),  # k, then p
    (_logits_for([3, 0, 1]), 1.0, 0, 0.9, [3 / 4, 0, 1 / 4]),  # -inf logit
]


def test_filter_matches_hand_computed_distributions():
    for logits, temperature, top_k, top_p, want in HAND_CASES:
        case = (logits, temperature, top_k, top_p)
        np.testing.assert_allclose(oracle_probs(*case), want, atol=1e-12, err_msg=str(case))
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
        got = filtered_probs(torch.tensor([logits]), params)[0].double().numpy()
        np.testing.assert_allclose(got, want, atol=1e-6, err_msg=str(case))


def test_filter_matches_the_oracle_on_random_logits():
    rng = np.random.default_rng(0)
    for _ in range(300):
        vocab = int(rng.integers(1, 40))
        logits = (rng.normal(size=vocab) * rng.uniform(0.1, 5)).astype(np.float32)
        temperature = float(rng.uniform(0.2, 2.0))
        top_k = int(rng.integers(0, vocab + 3))
        top_p = float(rng.choice([1.0, rng.uniform(0.05, 1.0)]))
        if top_p == 1.0:  # a tie (top-p may keep either of two tied tokens: no tie there)
            logits[rng.integers(vocab)] = logits[rng.integers(vocab)]
        want = oracle_probs(logits.astype(np.float64).tolist(), temperature, top_k, top_p)
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
        got = filtered_probs(torch.from_numpy(logits)[None], params)[0].double().numpy()
        np.testing.assert_allclose(got, want, atol=1e-5, err_msg=str((logits, params)))


@functools.lru_cache(maxsize=None)
def _engine(target_dir: str) -> Runtime:
    return load_engine(target_dir, None)


def _drafters(engine: Runtime, target_dir: str, small_drafter_dir) -> dict:
    info = target_info(engine.target.model.config, None, engine.target.model)
    return {
        "ngram": load_drafter("ngram", info),
        "autoregressive": load_drafter(f"autoregressive:{small_drafter_dir}", info),
        "agreeing": load_drafter(f"autoregressive:{target_dir}", info),
    }


def test_seeded_output_is_identical_across_budgets_and_drafters(target_dirs, small_drafter_dir):
    target_dir = str(target_dirs["t2x64"])
    engine = _engine(target_dir)
    drafters = _drafters(engine, target_dir, small_drafter_dir)
    configs = [
        (None, TreeSettings(kind="none")),
        ("ngram", TreeSettings(kind="chain", depth=5)),
        ("ngram", TreeSettings(budget=16, depth=5)),
        ("autoregressive", TreeSettings(budget=4, depth=3)),
        ("agreeing", TreeSettings(kind="chain", depth=6)),
        ("agreeing", TreeSettings(budget=1, depth=2)),
        ("agreeing", TreeSettings(budget=64, depth=6)),
    ]
    prompts = [[42], [10, 20, 30, 40], list(range(50, 90))]
    for prompt in prompts:
        for seed in (0, 1, 12345):
            params = SamplingParams(temperature=0.9, top_p=0.95, seed=seed)
            outputs = set()
            for drafter_name, tree in configs:
                drafter = drafters[drafter_name] if drafter_name else None
                request = GenerationRequest(
                    prompt_ids=prompt, max_tokens=24, sampling=params, tree=tree, ignore_eos=True
                )
                result = run(generate(engine.target, drafter, request, engine.detokenizer()))
                outputs.add(tuple(result.token_ids))
            assert len(outputs) == 1, (prompt, seed, outputs)
    # Different seeds do give different samples (the test above is not vacuous).
    seeds_out = {
        tuple(
            run(
                generate(
                    engine.target,
                    None,
                    GenerationRequest(
                        prompt_ids=[42],
                        max_tokens=8,
                        sampling=SamplingParams(temperature=1.0, seed=seed),
                        tree=TreeSettings(kind="none"),
                    ),
                    engine.detokenizer(),
                )
            ).token_ids
        )
        for seed in range(5)
    }
    assert len(seeds_out) > 1


# Every filter on: top-k cuts the tail, then top-p cuts the renormalised distribution.
TEMPERATURE, TOP_K, TOP_P = 0.8, 8, 0.9


def test_first_two_tokens_follow_the_target_distribution(target_dirs):
    target_dir = str(target_dirs["t2x64"])
    engine = _engine(target_dir)
    drafter = _drafters(engine, target_dir, target_dir)["agreeing"]
    filters = dict(temperature=TEMPERATURE, top_k=TOP_K, top_p=TOP_P)
    params_of = functools.partial(SamplingParams, **filters)
    prompt = [17, 99, 23, 4, 200]
    model = engine.target.model

    # Exact joint distribution of (t1, t2) under the filtered target distribution.
    def probs_after(tokens: list[int]) -> np.ndarray:
        with torch.inference_mode():
            logits = model(torch.tensor([tokens])).logits[0, -1]
        return oracle_probs(logits.double().tolist(), **filters)

    p1 = probs_after(prompt)
    expected: dict[tuple[int, int], float] = {}
    for t1 in np.flatnonzero(p1).tolist():
        p2 = probs_after([*prompt, t1])
        for t2 in np.flatnonzero(p2).tolist():
            expected[(t1, t2)] = float(p1[t1] * p2[t2])

    num_draws = 2000
    counts: dict[tuple[int, int], int] = {}
    tree = TreeSettings(budget=8, depth=2)
    for seed in range(num_draws):
        request = GenerationRequest(
            prompt_ids=prompt, max_tokens=2, sampling=params_of(seed=seed), tree=tree,
            ignore_eos=True,
        )
        result = run(generate(engine.target, drafter, request, engine.detokenizer()))
        key = tuple(result.token_ids)
        assert key in expected, key  # never a pair the target cannot produce
        counts[key] = counts.get(key, 0) + 1

    # Chi-square over cells with expected count >= 5; the rest pooled into one cell.
    cells = sorted(expected, key=lambda k: -expected[k])
    big = [k for k in cells if expected[k] * num_draws >= 5]
    small = [k for k in cells if expected[k] * num_draws < 5]
    observed = [counts.get(k, 0) for k in big]
    wanted = [expected[k] * num_draws for k in big]
    if small:
        observed.append(sum(counts.get(k, 0) for k in small))
        wanted.append(sum(expected[k] for k in small) * num_draws)
    wanted = np.asarray(wanted) * (num_draws / np.sum(wanted))
    assert len(big) >= 5
    assert chisquare(observed, wanted).pvalue > 0.001
