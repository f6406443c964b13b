"""Measure one configuration: a target, a drafter and tree settings over a prompt set.

Every configuration goes through the product's one decoding loop
(`proxy.decoding.generate`), with the target wrapped in a `RecordingTarget` that
notes the shape of every verified tree (context length, nodes, depths, leaves) and
how long the verification took. The cost model (`benchmarks/cost_model.py`) needs
those shapes to say what the same rounds would cost on a GPU.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Sequence

import numpy as np
import torch

from proxy.backend.base import SessionOptions, Target, TargetCounters, Verification
from proxy.decoding import GenerationRequest, GenerationStats, TreeSettings, generate
from proxy.drafter.base import Drafter
from proxy.sampling import SamplingParams
from proxy.tree import DraftTree, WalkResult

Detokenize = Callable[[list[int]], Awaitable[str]]


@dataclass
class RoundLog:
    """Per verification round, in round order across all prompts of a configuration."""

    context_len: list[int] = field(default_factory=list)  # len(committed) at the round
    # Tokens of `committed` that an earlier prompt of this request already sent to the
    # target (0 in the first round): what a prefix cache can hold at best.
    seen_len: list[int] = field(default_factory=list)
    num_nodes: list[int] = field(default_factory=list)  # tree nodes, root excluded
    sum_node_depth: list[int] = field(default_factory=list)  # over the nodes
    num_leaves: list[int] = field(default_factory=list)  # root alone counts as one leaf
    sum_leaf_depth: list[int] = field(default_factory=list)
    acceptance: list[int] = field(default_factory=list)  # accepted + 1
    verify_s: list[float] = field(default_factory=list)  # wall time of verify()

    def arrays(self) -> dict[str, np.ndarray]:
        return {name: np.asarray(values) for name, values in vars(self).items()}


class _RecordingSession:
    def __init__(self, inner, log: RoundLog):
        self.inner = inner
        self.log = log
        self._seen = 0
        # Plain generation where the inner session offers it, passed through.
        self.plain = self._plain if inner.plain is not None else None
        self.relay = None  # no client request here to hand over

    @property
    def counters(self) -> TargetCounters:
        return self.inner.counters

    @property
    def prompt_features(self) -> torch.Tensor | None:
        return self.inner.prompt_features

    async def verify(self, committed: Sequence[int], tree: DraftTree) -> Verification:
        start = time.perf_counter()
        verification = await self.inner.verify(committed, tree)
        elapsed = time.perf_counter() - start
        has_child = np.zeros(tree.num_nodes + 1, dtype=bool)
        has_child[tree.parents[1:]] = True
        log = self.log
        log.context_len.append(len(committed))
        log.seen_len.append(self._seen)
        log.num_nodes.append(tree.num_nodes)
        log.sum_node_depth.append(int(tree.depths.sum()))
        log.num_leaves.append(int((~has_child).sum()))
        log.sum_leaf_depth.append(int(tree.depths[~has_child].sum()))
        log.verify_s.append(elapsed)
        return verification

    async def accept(self, tree: DraftTree, result: WalkResult) -> torch.Tensor | None:
        self.log.acceptance.append(result.acceptance_length)
        # The deepest accepted node's prompt (or, in engine mode, its KV row) holds the
        # old context plus the accepted path: everything now committed but the bonus.
        self._seen = self.log.context_len[-1] + len(result.accepted_nodes)
        return await self.inner.accept(tree, result)

    async def _plain(self, committed: Sequence[int], max_tokens: int, stream: bool = True):
        # Plain generation has no tree to log; the next round's context starts after it.
        assert self.inner.plain is not None
        events = self.inner.plain(committed, max_tokens, stream)
        self._seen = len(committed)
        try:
            async for tokens, logprobs in events:
                self._seen += len(tokens)
                yield tokens, logprobs
        finally:
            await events.aclose()

    async def aclose(self) -> None:
        await self.inner.aclose()


class RecordingTarget:
    """A `Target` that forwards to another and logs every round's tree shape."""

    def __init__(self, inner: Target):
        self.inner = inner
        self.name = inner.name
        self.label = inner.label
        self.max_model_len = inner.max_model_len
        self.eos_token_ids = inner.eos_token_ids
        self.strategies = inner.strategies
        self.check_options = inner.check_options
        self.health = inner.health
        self.aclose = inner.aclose
        self.log = RoundLog()

    async def start(self, prompt_ids: Sequence[int], options: SessionOptions) -> _RecordingSession:
        session = await self.inner.start(prompt_ids, options)
        return _RecordingSession(session, self.log)


@dataclass
class Measurement:
    """One configuration over the whole prompt set (timed runs only)."""

    outputs: list[list[int]]  # [num_prompts] generated token ids
    wall_s: float  # sum over prompts of each generation's wall-clock time
    stats: list[GenerationStats]  # [num_prompts]
    rounds: RoundLog

    @property
    def generated_tokens(self) -> int:
        return sum(len(output) for output in self.outputs)

    @property
    def num_rounds(self) -> int:
        return sum(stats.rounds for stats in self.stats)


async def measure(
    target: Target,
    drafter: Drafter | None,
    tree: TreeSettings,
    prompts: list[list[int]],
    max_tokens: int,
    detokenize: Detokenize,
    warmup_tokens: int,
    before_timing: Callable[[], None] = lambda: None,
    progress=None,
    strategy: str | None = None,
) -> Measurement:
    """Warm up on the first prompt, call `before_timing`, then time every prompt in turn
    (one request at a time: the latency-bound setting speculative decoding is for).

    Greedy, EOS ignored: every configuration generates exactly `max_tokens` per prompt,
    so wall-clock times compare like for like.
    """
    recorder = RecordingTarget(target)

    async def one(prompt_ids: list[int], num_tokens: int):
        request = GenerationRequest(
            prompt_ids=prompt_ids,
            max_tokens=num_tokens,
            sampling=SamplingParams(temperature=0.0),
            tree=tree,
            ignore_eos=True,
            strategy=strategy,
        )
        start = time.perf_counter()
        result = await generate(recorder, drafter, request, detokenize)
        return result, time.perf_counter() - start

    await one(prompts[0], min(warmup_tokens, max_tokens))
    before_timing()
    recorder.log = RoundLog()
    outputs, stats, wall_s = [], [], 0.0
    for prompt_ids in prompts:
        result, elapsed = await one(prompt_ids, max_tokens)
        outputs.append(result.token_ids)
        stats.append(result.stats)
        wall_s += elapsed
        if progress is not None:
            progress.update(1)
    return Measurement(outputs=outputs, wall_s=wall_s, stats=stats, rounds=recorder.log)


def output_digest(outputs: list[list[int]]) -> str:
    """A short fingerprint of all outputs: equal digests = identical tokens (reruns)."""
    return hashlib.sha256(json.dumps(outputs).encode()).hexdigest()[:16]


def count_mismatches(outputs: list[list[int]], baseline: list[list[int]]) -> tuple[int, int]:
    """(prompts whose output differs from the baseline's, tokens after the first divergence)."""
    assert len(outputs) == len(baseline)
    prompts, tokens = 0, 0
    for output, reference in zip(outputs, baseline, strict=True):
        if output == reference:
            continue
        prompts += 1
        diverge = next(
            (pos for pos, (a, b) in enumerate(zip(output, reference, strict=False)) if a != b),
            min(len(output), len(reference)),
        )
        tokens += max(len(output), len(reference)) - diverge
    return prompts, tokens
