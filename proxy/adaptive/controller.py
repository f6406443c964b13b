"""Per-request decisions of the adaptive policy.

Each speculative round, the tree is built at the budget's upper bound; since the
best-first heap pops nodes in falling path probability, its first n nodes are the
tree a budget of n would build (`DraftTree.prefix`). For every n the controller
predicts the tokens the round returns, 1 + sum of the calibrated acceptance of the
first n nodes, and its cost, the drafting overhead plus the fitted call latency for
n + 1 prompts; it verifies the n with the most tokens per second. Every real round is
compared with its prediction; the ratio (summed over recent rounds) corrects the rates
that are compared with plain generation's.

Plain generation is the alternative: for a target that can stream (vLLM), the rest of
the output is asked of the target in one stream (or, for a client that does not
stream, where the stream would not be closed anyway, in answers of up to
`ONE_ANSWER_TOKENS`: `plain_in_one_answer`). The controller steps aside when the
request's measured round rate, smoothed over its recent rounds (`RATE_EWMA`), falls
`LEAVE_MARGIN` below plain generation's -- not on one round: a round without a draft (an n-gram
drafter that finds no match) says little about the next. A round that takes
`SLOW_ROUND_FACTOR` times its predicted time and loses to plain is different: the load
has changed under the fit (`CostModel.load_changed`), and every request hears of it. During the stream the
drafter proposes shadow trees, walked along the tokens that really came (no target
call): they keep the calibration current and predict what speculation would give.
The stream is closed, and the request goes back to speculation, as soon as the recent
shadows predict a rate `RETURN_MARGIN` above plain's (hysteresis; `RETURN_SHADOWS`
shadows at least, or the last `SURE_SHADOWS` each predicting `SURE_MARGIN` times plain's
rate).

Shadows predict from the verification costs and the round rate last measured, which
may describe another load (16 clients then, 1 now) or another text. So once no request
has run a real round for `TRIAL_FIRST_S` seconds (doubling up to `TRIAL_MAX_S` while
plain keeps winning; in seconds, not tokens, so that 16 plain clients do not probe 16
times as often), one plain request closes its stream and runs a trial of
`TRIAL_ROUNDS` real rounds on fresh measurements: it stays on speculation if they beat
plain generation by `TRIAL_MARGIN` (counting the calibrated expected tokens of the trees
verified: the trial measures the load, the request's own rate its text; a rate so far
under `TRIAL_HOPELESS` times plain's ends it), and goes back to plain otherwise (with no margin,
a run on vLLM-CPU, where rounds run 0.68x plain on code, speculated 11 % of the code
tokens at 1 client, 0.94x direct: four rounds are a small sample). Going to speculation at the start
or on shadows -- predictions -- takes a 25 % margin (`RETURN_MARGIN`), leaving it 10 %
(`LEAVE_MARGIN`): where the two are close (vLLM-CPU at 4 clients, code: fixed runs
0.92x direct), predictions' noise must not decide for speculation, and once
speculating only a clear loss sends it back. The other way round, plain
generation's estimate is only refreshed while it runs: once it is `PLAIN_PROBE_FIRST`
real rounds old (all requests together; doubling while speculation keeps winning), one
speculating request takes a plain probe of `PLAIN_PROBE_TOKENS` tokens, and stays plain
if plain now beats its rounds -- otherwise a load that has gone away would leave the
policy speculating against a plain rate measured under that load. A target that cannot stream (engine mode)
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
WIDE_EVERY = 8  # every 8th round of a request verifies the whole tree (keeps the fit honest)
RATE_EWMA = 0.1  # weight of the newest round in a request's smoothed round rate
LEAVE_MARGIN = 1.1  # to plain only when it is 10% faster than the recent rounds
SLOW_ROUND_FACTOR = 2.0  # a round this many times its predicted time: the load changed
RETURN_MARGIN = 1.25  # to speculation (start, shadows) only when 25% faster...
RETURN_SHADOWS = 3  # ...on the mean of the last three shadows,
SURE_MARGIN = 2.0  # ...or the last SURE_SHADOWS shadows each predicting twice plain's
SURE_SHADOWS = 2  # (one alone: a lucky n-gram match in random tokens sent requests back)
SHADOW_EVERY = 8  # plain tokens between two shadow rounds...
SHADOW_EVERY_MAX = 64  # ...doubling up to this while shadows predict under half of plain
SHADOW_WINDOW = 4  # recent shadow rounds whose mean predicts speculation's rate
EXPLORE_TOKENS = 16  # plain tokens between two exploring rounds, until the fit has data
# While plain: a trial of TRIAL_ROUNDS real rounds once no request has run one for
# TRIAL_FIRST_S seconds, doubling up to TRIAL_MAX_S while plain keeps winning.
TRIAL_ROUNDS = 4
TRIAL_FIRST_S = 1.0
TRIAL_MAX_S = 30.0
TRIAL_MARGIN = 1.1  # a trial's rounds must beat plain by 10% (measured, not predicted)
TRIAL_HOPELESS = 0.5  # ...and under half plain's rate so far ends it
TRIAL_CLOSE_TOKENS = 16  # no trial within this many plain tokens of a stream's start or end
ONE_ANSWER_TOKENS = 256  # plain tokens per answer, where plain comes as one (see there)
STALE_ROUND_TOKENS = 256  # plain tokens (all requests) after which the round rate is old
# While speculating: a plain probe of PLAIN_PROBE_TOKENS tokens once the plain estimate
# is PLAIN_PROBE_FIRST real rounds old (all requests), doubling up to PLAIN_PROBE_MAX
# while speculation keeps winning.
PLAIN_PROBE_TOKENS = 8
PLAIN_PROBE_FIRST = 128
PLAIN_PROBE_MAX = 1024


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
        self._trial_due = False
        self._trial_left = 0  # rounds left of a running trial...
        self._trial_sums = (0, 0.0)  # ...and its tokens and seconds so far
        self._num_explored = 0
        self._plain_since_round = 0  # plain tokens since the last real round
        self._stream_left = 0  # tokens the running plain stream was asked for, not yet come
        self._counted = False  # counted among the runtime's speculating requests
        self._shadows: list[Shadow] = []
        self._shadow_rates: list[float] = []
        self._rate: float | None = None  # smoothed measured rate of this request's rounds
        self._predicted: tuple[float, float] | None = None  # (tokens, seconds) of this round
        self._expected: float | None = None  # calibrated expected tokens of this round
        self._plain_probe: int | None = None  # plain tokens so far of a running plain probe
        self._num_chosen = 0  # rounds sized by the fit
        self.shadow_every = SHADOW_EVERY  # plain tokens between two shadow rounds now
        # Decisions made, for usage.ddtree and /metrics.
        self.num_switches_to_plain = 0
        self.num_switches_to_speculation = 0

    # ----- at the start ---------------------------------------------------------

    def start(self) -> None:
        """Pick the first path: plain when the last measurements say speculation does
        not pay by `RETURN_MARGIN`, or are old, or (unseeded) when plain generation was
        never measured: it is never slower than the target alone."""
        if not self.can_stream:
            return
        plain_rate = self._plain_rate()
        if plain_rate is None or self.seeded:
            self.plain = True
        elif not self._trusted():
            # Exploring at the very start speculates; during another request's trial
            # (the fit is being measured again) plain generation is the safe side --
            # unless rounds have made `SURE_MARGIN` times plain's rate over many texts
            # (GPU shim, 4 code clients: the three that started plain during the
            # first's trial spent their openings at plain's speed, 0.5-0.9x of fixed).
            sure = self.costs.start_round_rate() > SURE_MARGIN * plain_rate
            self.plain = not (self._exploring() or (sure and self.costs.may_join()))
            if not self.plain and not self._exploring():
                # With no fit to judge them by, its first rounds are a trial of their
                # own: at 16 random-token clients behind the shim, requests that
                # started so ran 1-token rounds of 0.2 s until their smoothed rates
                # fell (0.45x direct); a trial's first such round ends it.
                self._begin_trial()
        else:
            # A round rate measured `STALE_ROUND_TOKENS` plain tokens ago may come from
            # another load (16 clients then, 1 now, or the other way): start plain, and
            # let the shadows judge speculation on this text at this load.
            stale = self.costs.plain_tokens_since_round > STALE_ROUND_TOKENS
            slow = self.costs.start_round_rate() < RETURN_MARGIN * plain_rate
            self.plain = stale or slow or not self.costs.may_join()
            if not self.plain and self._claim_trial():
                # Speculation, on measurements a trial would refresh: this request's
                # first rounds are that trial (a fit from another load would size
                # them wrong: after 16 clients behind the GPU shim it verified the
                # root alone at 1 client, where the whole tree runs 2.1x).
                self._begin_trial()
        self._count()

    def finish(self) -> None:
        """The request has ended (however it ended)."""
        self.plain = True
        self._count()

    # ----- speculating ----------------------------------------------------------

    def choose_nodes(self, tree: DraftTree, new_tokens: int) -> int:
        """How many of `tree`'s nodes to verify this round (`new_tokens`: context the
        target has not seen yet, per prompt)."""
        self._plain_since_round = 0
        if not self._trusted():
            # Explore until the fit has data, varying the prompt count so that the
            # per-call and per-prompt costs can be told apart.
            self._num_explored += 1
            explored = tree.num_nodes
            if self._num_explored % 2 == 0:
                explored = min(tree.num_nodes, max(1, tree.num_nodes // 4))
            self._expected = 1.0 + float(self.calibration.acceptance(tree)[:explored].sum())
            return explored
        tokens, seconds = self._round_prediction(tree, new_tokens)
        best = int(np.argmax(tokens / seconds))
        self._num_chosen += 1
        if self._num_chosen % WIDE_EVERY == 0:
            # Now and then the whole tree: rounds of one size only would leave the fit
            # unable to tell per-call from per-prompt cost, and a per-prompt cost once
            # overestimated (under load) would keep every later tree small.
            best = tree.num_nodes
        self._predicted = (float(tokens[best]), float(seconds[best]))
        self._expected = float(tokens[best])
        return best

    def observe_round(self, tree: DraftTree, accepted_nodes: list[int]) -> None:
        """A verified (or shadow) round: which of its nodes were accepted."""
        self.calibration.observe(tree, accepted_nodes)

    def observe_rate(self, num_tokens: int, seconds: float) -> None:
        """A real round's measured rate (tokens it committed, its wall time), and its
        prediction's error. Speculation steps aside when the recent rounds, smoothed,
        fall `LEAVE_MARGIN` below plain generation's rate (`_leave_for`): one round
        without a draft says little about the next."""
        if seconds <= 0:
            return
        rate = num_tokens / seconds
        prior = self._rate if self._rate is not None else self.costs.start_round_rate()
        if self._predicted is not None:
            predicted_tokens, predicted_s = self._predicted
            self.costs.observe_prediction(predicted_tokens, predicted_s, num_tokens, seconds)
            self._predicted = None
            plain_rate = self._plain_rate()
            if (
                seconds > SLOW_ROUND_FACTOR * predicted_s
                and plain_rate is not None
                and predicted_tokens / seconds < plain_rate
            ):
                # The load has changed under the fit (more clients, or speculation's
                # own calls saturating the upstream: GPU shim, 16 clients after 4).
                # Smoothed rates would need many rounds to see it, each one delaying
                # every stream on that upstream; so every round rate (this request's,
                # all requests') is scaled by this round's slowdown at once -- where the
                # round, at its expected acceptance (one unlucky draft is not load),
                # loses to plain (a slow round that still wins changes no decision).
                # Scaled, not replaced: a round that verified the root alone has a low
                # rate at any load, and replacing every rate by its rate sent requests
                # making 70-100 tokens/s to plain's 22 (GPU shim, 4 clients).
                slowdown = predicted_s / seconds
                prior = prior * slowdown
                self.costs.load_changed(slowdown)
        self._rate = rate if not np.isfinite(prior) else (1 - RATE_EWMA) * prior + RATE_EWMA * rate
        expected, self._expected = self._expected, None
        if self._trial_left:
            # A trial asks whether rounds at this load pay, for texts like the recent
            # ones: it counts the calibrated expected tokens of the trees it verified,
            # not the tokens this one text gave (all three trials of a run at 4 code
            # clients behind the GPU shim fell on the same prompt's opening, where the
            # n-gram drafter finds little: 1-3 tokens a round, lost, and the repetition
            # ran plain where speculation runs 2.3x). The request's own rate, below,
            # still judges its own text.
            tokens = num_tokens if expected is None else expected
            self._trial_left -= 1
            self._trial_sums = (self._trial_sums[0] + tokens, self._trial_sums[1] + seconds)
            plain_rate = self._plain_rate()
            # Under half plain's rate so far ends the trial at once: at a load where
            # verification calls wait behind every stream (GPU shim, 16 clients: 0.2-2.4
            # s a round), four of them made the trial's request the last of its wave.
            # (So far, not this round alone: at 4 clients one round of 0.25-0.44 s in a
            # trial that paid ended three of them.)
            trial_rate = self._trial_sums[0] / self._trial_sums[1]
            hopeless = plain_rate is not None and trial_rate < TRIAL_HOPELESS * plain_rate
            if self._trial_left and not hopeless:
                return
            if plain_rate is not None and trial_rate < TRIAL_MARGIN * plain_rate:
                self._go_plain()
            else:
                # A sure win (`SURE_MARGIN` times plain's rate: the load has gone)
                # lifts the rate new requests start on to the trial's, and brings the
                # next trial soon should speculation lose later. A narrow one is four
                # rounds of one text: it lifts that rate to `LEAVE_MARGIN` times
                # plain's only, so that this request does not leave on it
                # (`_leave_for`) while new ones start speculating once rounds have
                # earned `RETURN_MARGIN`; and the next trial waits the interval the
                # claim doubled. Both were the sure win's for every win: on vLLM-CPU
                # at 1 code client, where the fixed budget ran 0.77-0.81x direct,
                # narrow wins sent the next requests to speculation (23 % of the
                # tokens, 0.89x direct), and with the first only, trials every second
                # or so still made 0.89x (31 switches in 72 requests).
                sure = plain_rate is None or trial_rate >= SURE_MARGIN * plain_rate
                if sure:
                    self.costs.trial_won(trial_rate, TRIAL_FIRST_S)
                else:
                    self.costs.trial_won(LEAVE_MARGIN * plain_rate, None)
                self._rate = trial_rate
            return
        if not self.plain and self._leave_for(self._plain_rate()):
            self._go_plain()

    def _leave_for(self, plain_rate: float | None) -> bool:
        """Does plain generation beat the recent rounds by `LEAVE_MARGIN` -- this
        request's (its text), or all requests' over many rounds (the load), whichever is
        lower? A load that jumps (16 clients where 4 were) makes rounds far slower than
        the fit predicts, and the first such round scales the second by its slowdown
        at once (`CostModel.load_changed`); smoothed over few rounds instead, it carried the
        last request's text into every other's decision (a request making 50 tokens/s
        left for plain's 23 after another's 1-token rounds)."""
        if self.seeded or plain_rate is None or not self._trusted():
            return False
        everyone = self.costs.start_round_rate()
        rate = everyone if self._rate is None else min(self._rate, everyone)
        return rate * LEAVE_MARGIN < plain_rate

    # ----- plain ----------------------------------------------------------------

    def next_is_plain(self) -> bool:
        """Plain generation next? (A probe, when due, is one real round in between --
        or, while speculating, one short plain stream.)"""
        if self._plain_probe is not None:  # a plain probe has just ended: who won?
            self._plain_probe = None
            if self._leave_for(self._plain_rate()):
                self.costs.plain_won_probe(PLAIN_PROBE_FIRST)
                self._go_plain()
                return True
            return False
        if not self.plain:
            if (
                self.can_stream
                and not self.seeded
                and self._trusted()
                and self.costs.claim_plain_probe(PLAIN_PROBE_FIRST, PLAIN_PROBE_MAX)
            ):
                self._plain_probe = 0
                return True
            return False
        if self._trial_due or (
            self._plain_since_round >= TRIAL_CLOSE_TOKENS and self._claim_trial()
        ):
            self._trial_due = False
            self._go_speculative()
            self._begin_trial()
            return False
        return True

    def plain_in_one_answer(self, client_streams: bool) -> bool:
        """Ask the target for the next plain stretch as one answer, not a stream? For a
        client that does not stream, where the stretch would hardly be closed anyway: a
        seeded request (one path), or rounds measured slower than plain generation (going
        back takes `RETURN_MARGIN` more). A stream costs the proxy host time per event --
        on a small host that competes with the target for the CPU: 0.86x direct vLLM-CPU
        at 16 clients, all plain -- where an answer costs it once; but an answer cannot
        be closed early, and shadows have no tokens to walk until it comes; so once a
        trial is due, the answer is cut short (`plain_length`) and the trial is claimed
        after it."""
        if client_streams or self._plain_probe is not None or self._exploring():
            return False
        if self.seeded:
            return True
        plain_rate = self._plain_rate()
        # The long-memory rate: a trial being claimed forgets the recent one, and 16
        # clients then streamed where answers were due (GPU shim: 0.51-0.77x direct,
        # all plain).
        return plain_rate is not None and self.costs.start_round_rate() < plain_rate

    def plain_length(self, remaining: int, one_answer: bool = False) -> int:
        """Tokens to ask one plain stream for: the rest of the output, or up to the end
        of a plain probe or of exploring's plain stretch -- the stream then ends there by
        itself, where closing it would make vLLM compute tokens nobody reads until the
        abort arrives."""
        if self.seeded:
            length = remaining
        elif one_answer:
            # A trial due: this request claims it, and its answer is as short as a trial
            # may follow (the text's opening says little, `TRIAL_CLOSE_TOKENS`); the
            # trial comes next. The other requests' answers stay whole (cut short for
            # all, every request paid a second call: GPU shim, 16 clients).
            if not self._trial_due and self._claim_trial():
                self._trial_due = True
            length = min(remaining, TRIAL_CLOSE_TOKENS if self._trial_due else ONE_ANSWER_TOKENS)
        elif self._plain_probe is not None:
            length = min(remaining, PLAIN_PROBE_TOKENS)
        elif self._exploring():
            length = max(1, min(remaining, EXPLORE_TOKENS - self._plain_since_round))
        else:
            length = remaining
        self._stream_left = length
        return length

    def add_shadow(self, tree: DraftTree, start: int, new_tokens: int) -> None:
        self._shadows.append(Shadow(tree, start, new_tokens))

    def observe_plain_tokens(self, committed: list[int], num_new: int) -> bool:
        """`num_new` plain tokens arrived (now the end of `committed`): walk the shadows
        they complete. Returns True when the stream should close now: speculation is
        predicted to pay again, or a trial (or, exploring, a round) is due."""
        waiting: list[Shadow] = []
        for shadow in self._shadows:
            span = shadow.tree.max_depth + 1
            if len(committed) < shadow.start + span:
                waiting.append(shadow)
                continue
            actual = committed[shadow.start : shadow.start + span]
            result = walk(shadow.tree, _target_tokens_along(shadow.tree, actual))
            self.observe_round(shadow.tree, result.accepted_nodes)
            rate = float(np.max(self._round_rates(shadow.tree, shadow.new_tokens)))
            self._shadow_rates = [*self._shadow_rates, rate][-SHADOW_WINDOW:]
            plain_rate = self._plain_rate()
            if plain_rate is not None and rate < plain_rate / 2:
                # Far from paying: fewer drafter calls (on a small host, the proxy's own
                # work per plain token competes with the upstream for the CPU).
                self.shadow_every = min(2 * self.shadow_every, SHADOW_EVERY_MAX)
            else:
                self.shadow_every = SHADOW_EVERY
        self._shadows = waiting
        if self.seeded:
            return False  # one path for the whole request
        if self._plain_probe is not None:
            self._plain_probe += num_new
            return self._plain_probe >= PLAIN_PROBE_TOKENS
        self._plain_since_round += num_new
        self._stream_left -= num_new
        plain_rate = self._plain_rate()
        shadows = self._shadow_rates
        if (
            self._trusted()
            and plain_rate is not None
            and shadows
            and self.costs.may_join()
            and (
                (
                    len(shadows) >= RETURN_SHADOWS
                    and float(np.mean(shadows)) > RETURN_MARGIN * plain_rate
                )
                or (
                    len(shadows) >= SURE_SHADOWS
                    and min(shadows[-SURE_SHADOWS:]) > SURE_MARGIN * plain_rate
                )
            )
        ):
            self._go_speculative(float(np.mean(shadows)))
            return True
        if self._exploring():
            if self._plain_since_round >= EXPLORE_TOKENS:
                self._go_speculative()
                return True
            return False
        # A trial closes the stream -- not in its first tokens (a text's opening, where an
        # n-gram drafter has nothing to match yet, says little of the rest: trials there
        # lost on random-token prompts where speculation runs 2.1x) nor near its end (the
        # request may have no tokens left for the trial).
        if (
            self._plain_since_round >= TRIAL_CLOSE_TOKENS
            and self._stream_left >= TRIAL_CLOSE_TOKENS
            and self._claim_trial()
        ):
            self._trial_due = True
            return True
        return False

    def stop_plain(self) -> None:
        """Plain generation failed mid-stream: go on speculating (verification calls
        are retried; a stream that broke is not)."""
        if self.plain:
            self._go_speculative()

    # ----- the numbers ----------------------------------------------------------

    def _trusted(self) -> bool:
        """Does the fit have calls enough (a trial has just forgotten the old ones)?"""
        return self.costs.num_recent_calls >= MIN_CALLS

    def _exploring(self) -> bool:
        """Has the fit never had calls enough (the runtime's first requests)?"""
        return self.costs.num_calls < MIN_CALLS

    def _begin_trial(self) -> None:
        """This request's next `TRIAL_ROUNDS` real rounds are a trial."""
        self._trial_left, self._trial_sums = TRIAL_ROUNDS, (0, 0.0)

    def _claim_trial(self) -> bool:
        return not self.seeded and self.costs.claim_trial(TRIAL_FIRST_S, TRIAL_MAX_S)

    def _go_plain(self) -> None:
        self.plain = True
        self.num_switches_to_plain += 1
        self._trial_due = False
        self._trial_left = 0
        self._shadow_rates = []
        self._count()

    def _go_speculative(self, predicted_rate: float | None = None) -> None:
        """Back to speculation; the request's smoothed round rate restarts at the rate
        that the decision predicted (the rounds before the switch described other text)."""
        self.plain = False
        self.num_switches_to_speculation += 1
        self._shadows = []
        self._shadow_rates = []
        self._rate = predicted_rate
        self._count()

    def _count(self) -> None:
        """Keep the runtime's count of speculating requests (`CostModel.may_join`)."""
        speculating = not self.plain and self.can_stream
        if speculating != self._counted:
            self.costs.count_speculating(+1 if speculating else -1)
            self._counted = speculating

    def _round_prediction(self, tree: DraftTree, new_tokens: int):
        """([num_nodes + 1] expected tokens, [num_nodes + 1] predicted seconds) of a round
        that verifies the first n nodes, n = 0 .. num_nodes."""
        accept = self.calibration.acceptance(tree)
        tokens = 1.0 + np.concatenate([[0.0], np.cumsum(accept)])
        num_prompts = np.arange(1, tree.num_nodes + 2)
        path_tokens = np.concatenate([[0], np.cumsum(tree.depths[1:])])
        seconds = self.costs.call_seconds(num_prompts, num_prompts * new_tokens + path_tokens)
        seconds = seconds + self.costs.round_overhead_s()
        return tokens, np.maximum(seconds, 1e-6)

    def _round_rates(self, tree: DraftTree, new_tokens: int) -> np.ndarray:
        """[num_nodes + 1] expected tokens per second when verifying the first n nodes,
        corrected by how real rounds compared with their predictions."""
        tokens, seconds = self._round_prediction(tree, new_tokens)
        return self.costs.prediction_ratio() * tokens / seconds

    def _plain_rate(self) -> float | None:
        if not self.can_stream:
            return None
        token_s = self.costs.plain_token_s()
        return None if token_s is None else 1.0 / token_s


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
