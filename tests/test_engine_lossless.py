"""Engine mode is lossless: token ids equal Transformers' own greedy `generate`.

Every (target shape, drafter, budget) combination decodes the same prompts and must
reproduce plain greedy decoding exactly. The target used as its own autoregressive
drafter always agrees, so deep paths are accepted round after round and the KV
compaction after each round is exercised; a random small drafter agrees sometimes;
the ngram drafter mostly proposes repeats.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from conftest import TARGET_SHAPES, run

from proxy.decoding import GenerationRequest, TreeSettings, generate
from proxy.drafter import load_drafter
from proxy.runtime import Runtime, load_engine, target_info

MAX_NEW_TOKENS = 24
BUDGETS = ["chain", 1, 4, 16, 64]


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(1234)
    prompts = [[42]]  # a 1-token prompt: nothing to prefill
    for length in [2, 3, 5, 8, 13, 21, 34, 55, 89, 120]:
        prompts.append(rng.integers(4, 260, size=length).tolist())
    texts = [
        "def fib(n):\n    return",
        "import os\nimport sys\n",
        "for i in range(10):\n",
        "class Node:\n    def __init__(self",
        "x = [1, 2, 3]\nprint(",
        "# a comment\n",
        "while True:\n    pass\n",
        "return self.value",
        "aaaaaaaaaaaaaaaa",
        "if __name__ == '__main__':\n    main()",
        "héllo wörld ✓",
    ]
    prompts += [list(text.encode("utf-8")) for text in texts]  # byte ids (+4 offset below)
    prompts[-len(texts) :] = [[b + 4 for b in p] for p in prompts[-len(texts) :]]
    return prompts


PROMPTS = _prompts()


@functools.lru_cache(maxsize=None)
def _engine(target_dir: str) -> Runtime:
    return load_engine(target_dir, None)


@functools.lru_cache(maxsize=None)
def _reference(target_dir: str, prompt: tuple[int, ...]) -> list[int]:
    model = _engine(target_dir).target.model
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False
        )
    return out[0, len(prompt) :].tolist()


def _drafter(kind: str, engine: Runtime, target_dir: str, small_drafter_dir, dflash_dir):
    info = target_info(engine.target.model.config, None, engine.target.model)
    specs = {
        "dflash": f"dflash:{dflash_dir}",
        "ngram": "ngram",
        "autoregressive": f"autoregressive:{small_drafter_dir}",
        "agreeing": f"autoregressive:{target_dir}",  # the target drafts for itself
    }
    return load_drafter(specs[kind], info)


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("drafter_kind", ["dflash", "ngram", "autoregressive", "agreeing"])
@pytest.mark.parametrize("shape", list(TARGET_SHAPES))
def test_greedy_equals_generate(
    shape, drafter_kind, budget, target_dirs, small_drafter_dir, dflash_dirs
):
    target_dir = str(target_dirs[shape])
    engine = _engine(target_dir)
    drafter = _drafter(drafter_kind, engine, target_dir, small_drafter_dir, dflash_dirs[shape])
    tree = (
        TreeSettings(kind="chain", depth=6)
        if budget == "chain"
        else TreeSettings(kind="ddtree", budget=budget, depth=6)
    )
    taus = []
    for prompt in PROMPTS:
        request = GenerationRequest(prompt_ids=prompt, max_tokens=MAX_NEW_TOKENS, tree=tree)
        result = run(generate(engine.target, drafter, request, engine.detokenizer()))
        assert result.token_ids == _reference(target_dir, tuple(prompt)), (prompt, budget)
        taus.append(result.stats.mean_acceptance_length)
    if drafter_kind == "agreeing":
        # Accepted paths really were long, round after round, so the KV compaction
        # ran on deep paths. (A wide ddtree over a random model's flat drafts spends
        # its budget near the root, so its paths are shorter than the chain's.)
        assert np.mean(taus) > (4.0 if budget == "chain" else 1.9), taus


def test_no_draft_equals_generate(target_dirs):
    target_dir = str(target_dirs["t2x64"])
    engine = _engine(target_dir)
    for prompt in PROMPTS[:6]:
        request = GenerationRequest(
            prompt_ids=prompt, max_tokens=MAX_NEW_TOKENS, tree=TreeSettings(kind="none")
        )
        result = run(generate(engine.target, None, request, engine.detokenizer()))
        assert result.token_ids == _reference(target_dir, tuple(prompt))
        assert all(length == 1 for length in result.stats.acceptance_lengths)


class _RecordingDrafter:
    """Forwards to `drafter`; keeps (depth, top_k, proposal) of every propose call."""

    def __init__(self, drafter):
        self._drafter = drafter
        self.proposals: list = []

    def __getattr__(self, name: str):
        return getattr(self._drafter, name)

    def start(self, prompt_ids, prompt_features):
        session = self._drafter.start(prompt_ids, prompt_features)
        propose = session.propose

        async def recorded(committed, depth: int, top_k: int):
            dist = await propose(committed, depth, top_k)
            self.proposals.append((depth, top_k, dist))
            return dist

        session.propose = recorded
        return session


@pytest.mark.parametrize("drafter_kind", ["dflash", "ngram", "autoregressive"])
def test_budget_beyond_the_vocabulary(drafter_kind, target_dirs, small_drafter_dir, dflash_dirs):
    """Asked for more ranks than the vocabulary has (top_k = budget > vocab), a drafter
    returns [depth, top_k] with every token once and -inf past them (base.py's contract),
    and the output is still plain greedy."""
    target_dir = str(target_dirs["t2x64"])
    engine = _engine(target_dir)
    vocab_size = int(engine.target.model.config.vocab_size)
    drafter = _RecordingDrafter(
        _drafter(drafter_kind, engine, target_dir, small_drafter_dir, dflash_dirs["t2x64"])
    )
    tree = TreeSettings(kind="ddtree", budget=vocab_size + 40, depth=3)
    for prompt in PROMPTS[:4] + PROMPTS[-3:-2]:  # the last: "aaa...", for ngram matches
        request = GenerationRequest(prompt_ids=prompt, max_tokens=MAX_NEW_TOKENS, tree=tree)
        result = run(generate(engine.target, drafter, request, engine.detokenizer()))
        assert result.token_ids == _reference(target_dir, tuple(prompt)), prompt
    assert drafter.proposals
    for depth, top_k, dist in drafter.proposals:
        assert top_k == vocab_size + 40
        assert dist.token_ids.shape == dist.log_probs.shape == (depth, top_k)
        assert np.isneginf(dist.log_probs[:, vocab_size:]).all()
        assert ((0 <= dist.token_ids) & (dist.token_ids < vocab_size)).all()
        assert (dist.log_probs[:, :-1] >= dist.log_probs[:, 1:]).all()  # best first
        for token_ids, log_probs in zip(dist.token_ids, dist.log_probs, strict=True):
            filled = token_ids[np.isfinite(log_probs)]
            assert len(set(filled.tolist())) == len(filled)  # no token twice
            if drafter_kind != "ngram":  # a model ranks its whole vocabulary
                assert sorted(filled.tolist()) == list(range(vocab_size))
    if drafter_kind == "ngram":
        assert any(np.isfinite(dist.log_probs).any() for _, _, dist in drafter.proposals)
