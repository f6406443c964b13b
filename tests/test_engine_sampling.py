"""Engine-mode sampling is lossless.

With a client seed, the draw for the token at absolute position p is seeded by
(seed, p), so the output must not depend on the drafter, the budget or the tree.
Without depending on that, the first two generated tokens over thousands of seeds
must follow the target's own (filtered) distribution.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from conftest import run
from scipy.stats import chisquare

from proxy.backend.token_choice import filtered_probs
from proxy.decoding import GenerationRequest, TreeSettings, generate
from proxy.drafter import load_drafter
from proxy.runtime import Runtime, load_engine, target_info
from proxy.sampling import SamplingParams


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


def test_first_two_tokens_follow_the_target_distribution(target_dirs):
    target_dir = str(target_dirs["t2x64"])
    engine = _engine(target_dir)
    drafter = _drafters(engine, target_dir, target_dir)["agreeing"]
    params_of = functools.partial(SamplingParams, temperature=1.0, top_k=5)
    prompt = [17, 99, 23, 4, 200]
    model = engine.target.model

    # Exact joint distribution of (t1, t2) under the filtered target distribution.
    def probs_after(tokens: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            logits = model(torch.tensor([tokens])).logits[0, -1:]
        return filtered_probs(logits, params_of())[0].double()

    p1 = probs_after(prompt)
    expected: dict[tuple[int, int], float] = {}
    for t1 in torch.nonzero(p1).flatten().tolist():
        p2 = probs_after([*prompt, t1])
        for t2 in torch.nonzero(p2).flatten().tolist():
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
