"""Per-request decisions of the adaptive policy.

Each speculative round, the tree is built at the budget's upper bound; since the
best-first heap pops nodes in falling path probability, its first n nodes are the
tree a budget of n would build (`DraftTree.prefix`). For every n the controller
predicts the tokens the round returns, 1 + sum of the calibrated acceptance of the
first n nodes, and its cost, the drafting overhead plus the fitted call latency for
n + 1 prompts; it verifies the n with the most tokens per second.

Plain generation is the alternative: for a target that can stream (vLLM), the rest of
the output is asked of the target in one stream. The controller steps aside when the
best round's expected rate falls below plain generation's. During the stream the
drafter proposes shadow trees, walked along the tokens that really came (no target
call): they keep the calibration current and predict what speculation would give.
The stream is closed, and the request goes back to speculation, as soon as the recent
shadows predict a rate `RETURN_MARGIN` above plain's (hysteresis). After
`PROBE_FIRST` plain tokens (doubling up to `PROBE_MAX` while plain keeps winning) the
stream is closed for one real round, which refreshes the verification costs, and a
new stream goes on if plain still wins. A target that cannot stream (engine mode)
just verifies fewer nodes, down to the root alone.

A seeded request never switches: plain generation draws with vLLM's own seeded
generator and speculation with per-position seeds (`proxy.sampling`); both follow the
target's distribution, but a switch -- or a start that depended on what the policy has
measured -- would make the output depend on timing. So where the target can stream, a
seeded request is generated plainly from its first token to its last, in one call:
the same seed then gives exactly vLLM's own output, every time. (`policy: fixed`
speculates seeded requests, with per-position seeds: identical across budgets.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from proxy.adaptive.calibration import Calibration
from proxy.adaptive.costs import CostModel
from proxy.tree import DraftTree, walk

MIN_CALLS = 4  # verification calls to see before the fit is trusted
RETURN_MARGIN = 1.1  # back to speculation only when it is predicted 10% faster
SHADOW_EVERY = 8  # plain tokens between two shadow rounds
SHADOW_WINDOW = 4  # recent shadow rounds whose mean predicts speculation's rate
EXPLORE_TOKENS = 16  # plain tokens between two exploring rounds, until the fit has data
PROBE_FIRST = 64  # plain tokens before the first probe round; doubles up to PROBE_MAX
PROBE_MAX = 512
PLAIN_RATE_TOKENS = 64  # the stream length over which plain's first-token wait is spread
# Plain chunks for a client that does not stream: 32 tokens, doubling while plain wins.
FIRST_CHUNK = 32
MAX_CHUNK = 256
MAX_CHUNK_SHADOWS = 4  # shadow rounds within one chunk (each is a drafter call)


@dataclass
class AdaptiveState:
    """What the adaptive policy learns while serving, shared by every request of one
    runtime (one target, one drafter)."""

    costs: CostModel = field(default_factory=CostModel)
    calibration: Calibration = field(default_factory=Calibration)

    def controller(self, can_stream: bool, seeded: bool) -> Controller:
        return Controller(self.costs, self.calibration, can_stream, seeded)


@dataclass
class Shadow:
    """A tree proposed during plain generation, waiting for the tokens it predicts."""

    tree: DraftTree
    start: int  # committed length when it was proposed (its root is committed[start-1])
    new_tokens: int  # context tokens a real round at that point would have sent anew


class Controller:
    def __init__(
        self,
        costs: CostModel,
        calibration: Calibration,
        can_stream: bool,
        seeded: bool,
    ):
        self.costs = costs
        self.calibration = calibration
        self.can_stream = can_stream
        self.seeded = seeded
        self.plain = False
        self._probe_due = False
        self._num_explored = 0
        self._plain_since_round = 0  # plain tokens since the last real round
        self._probe_after = PROBE_FIRST
        self._chunk = FIRST_CHUNK
        self._shadows: list[Shadow] = []
        self._shadow_rates: list[float] = []
        # Decisions made, for usage.ddtree and /metrics.
        self.num_switches_to_plain = 0
        self.num_switches_to_speculation = 0

    # ----- at the start ---------------------------------------------------------

    def start(self) -> None:
        """Pick the first path: plain when the last measurements say speculation does
        not pay, or (unseeded) when plain generation was never measured: it is never
        slower than the target alone."""
        if not self.can_stream:
            return
        plain_rate = self._plain_rate()
        if plain_rate is None or self.seeded:
            self.plain = True
        elif self._trusted():
            self.plain = self.costs.recent_round_rate() < plain_rate

    # ----- speculating ----------------------------------------------------------

    def choose_nodes(self, tree: DraftTree, new_tokens: int) -> int:
        """How many of `tree`'s nodes to verify this round (`new_tokens`: context the
        target has not seen yet, per prompt)."""
        self._plain_since_round = 0
        if not self._trusted():
            # Explore until the fit has data, varying the prompt count so that the
            # per-call and per-prompt costs can be told apart.
            self._num_explored += 1
            if self._num_explored % 2:
                return tree.num_nodes
            return min(tree.num_nodes, max(1, tree.num_nodes // 4))
        rates = self._round_rates(tree, new_tokens)
        best = int(np.argmax(rates))
        plain_rate = self._plain_rate()
        if plain_rate is not None and not self.seeded:
            if self.plain and rates[best] > RETURN_MARGIN * plain_rate:
                self._go_speculative()  # a probe round found speculation paying again
            elif not self.plain and rates[best] < plain_rate:
                self._go_plain()
        return best

    def observe_round(self, tree: DraftTree, accepted_nodes: list[int]) -> None:
        """A verified (or shadow) round: which of its nodes were accepted."""
        if tree.num_nodes:
            accepted = np.zeros(tree.num_nodes, dtype=bool)
            accepted[np.asarray(accepted_nodes, dtype=np.int64) - 1] = True
            self.calibration.observe(tree.path_log_probs[1:], accepted)

    # ----- plain ----------------------------------------------------------------

    def next_is_plain(self) -> bool:
        """Plain generation next? (A probe, when due, is one real round in between.)"""
        if not self.plain:
            return False
        if self._probe_due:
            self._probe_due = False
            return False
        return True

    def plain_chunk(self, remaining: int) -> int:
        """Tokens to ask for at once when the client does not stream: chunks double
        while plain keeps winning (closing a chunk early is not possible). A seeded
        request takes the rest in one call: re-seeding each chunk would not give vLLM's
        own draws."""
        if self.seeded:
            return remaining
        chunk, self._chunk = self._chunk, min(2 * self._chunk, MAX_CHUNK)
        return min(chunk, remaining)

    def add_shadow(self, tree: DraftTree, start: int, new_tokens: int) -> None:
        self._shadows.append(Shadow(tree, start, new_tokens))

    def observe_plain_tokens(self, committed: list[int], num_new: int) -> bool:
        """`num_new` plain tokens arrived (now the end of `committed`): walk the shadows
        they complete. Returns True when the stream should close now: speculation is
        predicted to pay again, or a probe round is due."""
        waiting: list[Shadow] = []
        for shadow in self._shadows:
            span = shadow.tree.max_depth + 1
            if len(committed) < shadow.start + span:
                waiting.append(shadow)
                continue
            actual = committed[shadow.start : shadow.start + span]
            result = walk(shadow.tree, _target_tokens_along(shadow.tree, actual))
            self.observe_round(shadow.tree, result.accepted_nodes)
            rates = self._round_rates(shadow.tree, shadow.new_tokens)
            self._shadow_rates = [*self._shadow_rates, float(np.max(rates))][-SHADOW_WINDOW:]
        self._shadows = waiting
        if self.seeded:
            return False  # one path for the whole request
        self._plain_since_round += num_new
        plain_rate = self._plain_rate()
        if (
            self._trusted()
            and plain_rate is not None
            and len(self._shadow_rates) >= 2
            and float(np.mean(self._shadow_rates)) > RETURN_MARGIN * plain_rate
        ):
            self._go_speculative()
            return True
        limit = self._probe_after if self._trusted() else EXPLORE_TOKENS
        if self._plain_since_round >= limit:
            self._probe_due = True
            if self._trusted():
                self._probe_after = min(2 * self._probe_after, PROBE_MAX)
            return True
        return False

    def stop_plain(self) -> None:
        """Plain generation failed mid-stream: go on speculating (verification calls
        are retried; a stream that broke is not)."""
        if self.plain:
            self._go_speculative()

    # ----- the numbers ----------------------------------------------------------

    def _trusted(self) -> bool:
        return self.costs.num_calls >= MIN_CALLS

    def _go_plain(self) -> None:
        self.plain = True
        self.num_switches_to_plain += 1
        self._probe_due = False
        self._probe_after = PROBE_FIRST
        self._chunk = FIRST_CHUNK
        self._shadow_rates = []

    def _go_speculative(self) -> None:
        self.plain = False
        self.num_switches_to_speculation += 1
        self._shadows = []
        self._shadow_rates = []

    def _round_rates(self, tree: DraftTree, new_tokens: int) -> np.ndarray:
        """[num_nodes + 1] expected tokens per second when verifying the first n nodes."""
        accept = self.calibration.acceptance(tree.path_log_probs[1:])
        tokens = 1.0 + np.concatenate([[0.0], np.cumsum(accept)])
        num_prompts = np.arange(1, tree.num_nodes + 2)
        path_tokens = np.concatenate([[0], np.cumsum(tree.depths[1:])])
        seconds = self.costs.call_seconds(num_prompts, num_prompts * new_tokens + path_tokens)
        seconds = seconds + self.costs.round_overhead_s()
        return tokens / np.maximum(seconds, 1e-6)

    def _plain_rate(self) -> float | None:
        if not self.can_stream:
            return None
        seconds = self.costs.plain_seconds(PLAIN_RATE_TOKENS)
        return None if seconds is None else PLAIN_RATE_TOKENS / seconds


def _target_tokens_along(tree: DraftTree, actual: list[int]) -> np.ndarray:
    """Target tokens for a shadow walk: at every node on the actual path the next actual
    token; elsewhere a token no child has (those nodes were never reached)."""
    tokens = np.full(tree.num_nodes + 1, -1, dtype=np.int64)
    node_idx = 0
    for depth, token in enumerate(actual):
        tokens[node_idx] = token
        child = tree.children[node_idx].get(int(token))
        if child is None or depth + 1 >= len(actual):
            break
        node_idx = child
    return tokens
