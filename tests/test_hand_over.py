"""Handing a request over (`proxy.decoding.HandOver`), end to end against the session's
REAL vLLM: where the policy leaves a streaming request to vLLM from its first token
with no decision on the way, the proxy relays the client's own request, and the client
gets vLLM's own answer byte for byte; one that breaks goes on from the tokens the
client has, and the output is still vLLM's.

The policy is put where it hands requests over through its own estimators (a stream
at 1 ms a token, a verification call at 10 s: no tree could beat the stream), as
scripted traces are put in the policy's unit tests.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Iterator

import httpx
import pytest
from background_server import BackgroundServer
from fault_shim import LOSE_USAGE, STALL, FaultShim
from metrics import scrape
from tcp_relay import TcpRelay

from proxy.decoding import TreeSettings
from proxy.server.app import create_app
from proxy.server.settings import ServerSettings

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

PROMPTS = ["def fib(n):\n", "import os\n\n", "# sort a list\n", "class Stack:\n"]
HANDED_OVER = "ddtree_handed_over_total"


def _leave_to_vllm(app) -> None:
    """Plain streams measured at 1 ms a token, verification calls at 10 s."""
    policy = app.state.server.runtime.policy
    for tokens in (8, 32, 64):
        policy.plain.observe(tokens, 1.0, 0.005 + 0.001 * tokens)
    for prompts in (1, 9, 17):
        policy.calls.observe(prompts, 4 * prompts, 10.0)
    policy.note_measured("plain")
    policy.note_measured("speculate")


@contextlib.contextmanager
def _proxy(target_url: str, vllm_server, **settings) -> Iterator[BackgroundServer]:
    """A proxy before `target_url` (a shim or relay in front of vLLM) that leaves every
    request to vLLM (`_leave_to_vllm`); `settings` over the tests' common ones."""
    common = {"target_url": target_url, "tokenizer": str(vllm_server.model_dir),
              "drafter": "ngram", "tree": TreeSettings(budget=8), "log_level": "warning"}  # fmt: skip
    app = create_app(ServerSettings(**(common | settings)))
    with BackgroundServer(app) as proxy:
        _leave_to_vllm(app)
        yield proxy


def _stream(url: str, path: str, body: dict, headers: dict | None = None) -> bytes:
    with httpx.stream("POST", url + path, json=body, headers=headers, timeout=300) as response:
        assert response.status_code == 200, response.read()
        return response.read()


def _events(content: bytes) -> list:
    return [
        "[DONE]" if line == b"data: [DONE]" else json.loads(line[len(b"data: ") :])
        for line in content.split(b"\n\n")
        if line
    ]


def _output(events: list) -> tuple[list[int], str]:
    """The token ids and text of a stream's events (completion text or chat content)."""
    tokens, text = [], ""
    for event in events:
        for choice in event["choices"] if isinstance(event, dict) else ():
            tokens += choice.get("token_ids") or []
            text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return tokens, text


def _bodies(model: str) -> list[tuple[str, dict]]:
    out = []
    for idx, prompt in enumerate(PROMPTS):
        common = {"model": model, "max_tokens": 24, "temperature": 0, "stream": True,
                  "request_id": f"hand-over-{idx}"}  # fmt: skip
        if idx >= 2:  # the last two with a usage event
            common["stream_options"] = {"include_usage": True}
        if idx % 2:
            chat = {"messages": [{"role": "user", "content": prompt}], "stop": ["\n\n"]}
            out.append(("/v1/chat/completions", common | chat))
        else:
            out.append(("/v1/completions", common | {"prompt": prompt}))
    return out


def test_a_request_left_to_vllm_gets_vllms_own_answer(vllm_server):
    """The client gets the events vLLM sent for its request, byte for byte -- token ids
    null where it did not ask for them, the usage event with the proxy's statistics
    added -- and so the output vLLM gives the same request asked directly. (Event by
    event, two streams of one request can differ: vLLM merges tokens into one event
    when its reader falls behind.)"""
    with FaultShim(vllm_server.url, record=True) as shim:
        with _proxy(shim.url, vllm_server, read_timeout=120) as proxy:
            bodies = _bodies(vllm_server.model)
            path, body = bodies[0]
            bodies.append((path, body | {"return_token_ids": True, "request_id": "ids"}))
            unnamed = {key: value for key, value in body.items() if key != "model"}
            bodies.append((path, unnamed | {"request_id": "no-model"}))
            for path, body in bodies:
                relayed = _stream(proxy.url, path, body)
                sent = [(json.loads(call), answer) for route, call, answer in shim.stats.relayed
                        if route == path and json.loads(call)["request_id"] == body["request_id"]]  # fmt: skip
                assert len(sent) == 1, body
                call, answer = sent[0]
                # The model the proxy's own calls name, where the client named none.
                assert call["model"] == vllm_server.model, body
                expected = answer if body.get("return_token_ids") else _unasked(answer)
                *events, usage, done = relayed.split(b"\n\n")[:-1]
                if body.get("stream_options"):
                    usage = json.loads(usage[len(b"data: ") :])
                    assert usage["usage"].pop("ddtree")["plain_calls"] == 1
                    events.append(b"data: " + json.dumps(usage, separators=(",", ":")).encode())
                else:
                    events.append(usage)
                assert b"\n\n".join([*events, done, b""]) == expected, body
                direct = _events(_stream(vllm_server.url, path, body))
                assert _output(_events(relayed)) == _output(direct), body
            # An X-Request-Id header names vLLM's answer (before a request_id field).
            path, body = bodies[0]
            named = {"x-request-id": "named-by-header"}
            relayed = _events(_stream(proxy.url, path, body, named))
            assert {event["id"] for event in relayed[:-1]} == {"cmpl-named-by-header"}
            metrics = scrape(proxy.url)
    assert metrics.get(f'{HANDED_OVER}{{outcome="whole"}}') == len(bodies) + 1


def _unasked(content: bytes) -> bytes:
    """vLLM's events as it writes them without `return_token_ids`."""
    return re.sub(rb'"(prompt_)?token_ids":\[[0-9,]*\]', rb'"\1token_ids":null', content)


def test_a_relayed_answer_that_breaks_goes_on_from_its_tokens(vllm_server):
    """Every stream is cut after half its events (no [DONE]): the relayed answer, then
    the plain streams the loop opens after it. The client's tokens and text are still
    vLLM's greedy answer, without an error event."""
    # No request ids: the proxy's own events after the break take vLLM's names.
    bodies = [(path, {key: value for key, value in body.items() if key != "request_id"})
              for path, body in _bodies(vllm_server.model)]  # fmt: skip
    asked = [(path, body | {"return_token_ids": True, "max_tokens": 48}) for path, body in bodies]
    cut = {"rate": 1.0, "faults": ("truncate",), "only_streams": True,
           "paths": ("/v1/completions", "/v1/chat/completions")}  # fmt: skip
    with FaultShim(vllm_server.url, **cut) as shim:
        with _proxy(shim.url, vllm_server, read_timeout=120, max_retries=2) as proxy:
            answers = [_events(_stream(proxy.url, path, body)) for path, body in asked]
            metrics = scrape(proxy.url)
    assert shim.stats.stream_faults["truncate"] >= len(PROMPTS)
    assert metrics.get(f'{HANDED_OVER}{{outcome="resumed"}}') == len(PROMPTS)
    for (path, body), events in zip(asked, answers, strict=True):
        whole = {key: value for key, value in body.items() if key != "stream_options"}
        direct = httpx.post(vllm_server.url + path, json=whole | {"stream": False}, timeout=300)
        choice = direct.json()["choices"][0]
        assert events[-1] == "[DONE]"
        assert not [event for event in events if isinstance(event, dict) and "error" in event]
        tokens, text = _output(events)
        assert tokens == choice["token_ids"], body
        assert text == (choice.get("text") or choice["message"]["content"]), body
        # One stream, one name: the events after the break have the id and the creation
        # time of vLLM's events before it.
        assert len({(event["id"], event["created"]) for event in events[:-1]}) == 1, body


def test_a_relay_that_does_not_open_is_served_by_the_loop_and_not_counted(vllm_server):
    """vLLM answers the handed-over request itself with 503s (its retries too): nothing
    went out, so the loop serves the request -- a round, then a plain stream of its own
    -- and the output is vLLM's; the usage counts the plain calls that were made, not
    the relay that never opened."""
    path, body = _bodies(vllm_server.model)[2]  # a completion, with a usage event
    body = body | {"request_id": "never-opens"}
    refuse = {"rate": 1.0, "faults": ("http503",), "only_streams": True, "record": True,
              "match": b'"never-opens"'}  # fmt: skip
    with FaultShim(vllm_server.url, **refuse) as shim:
        with _proxy(shim.url, vllm_server, read_timeout=120) as proxy:
            *answer, usage, done = _events(_stream(proxy.url, path, body))
            metrics = scrape(proxy.url)
    assert shim.stats.stream_faults["http503"] >= 1
    assert metrics.get(f'{HANDED_OVER}{{outcome="unopened"}}') == 1
    direct = _events(_stream(vllm_server.url, path, body))
    assert done == "[DONE]" and _output(answer) == _output(direct[:-2])
    streams = [call for route, call, _ in shim.stats.relayed
               if route == path and json.loads(call).get("stream")]  # fmt: skip
    stats = usage["usage"]["ddtree"]
    assert streams and stats["plain_calls"] == len(streams), (stats, len(streams))
    assert stats["upstream_calls"] >= 1  # the round after the relay that did not open


def test_a_relayed_answer_that_stalls_ends_at_the_deadline(vllm_server):
    """vLLM stops mid-answer (the fault shim sends the first half of its answer, then
    nothing): the client has vLLM's first events, then the deadline's error event and
    [DONE] -- at the deadline, not when the read times out."""
    deadline_s = 4.0
    stall = {"rate": 1.0, "faults": (STALL,), "only_streams": True, "delay_s": 30.0}
    path, body = _bodies(vllm_server.model)[0]
    body = body | {"max_tokens": 48, "return_token_ids": True}
    with FaultShim(vllm_server.url, **stall) as shim:
        with _proxy(shim.url, vllm_server, read_timeout=60, request_timeout=deadline_s) as proxy:
            start = time.monotonic()
            events = _events(_stream(proxy.url, path, body))
            elapsed = time.monotonic() - start
            metrics = scrape(proxy.url)
    assert shim.stats.stream_faults[STALL] == 1
    *answer, error, done = events
    assert done == "[DONE]" and error["error"]["type"] == "timeout_error", events
    tokens, _ = _output(answer)
    direct = httpx.post(vllm_server.url + path, json=body | {"stream": False}, timeout=300)
    assert tokens and tokens == direct.json()["choices"][0]["token_ids"][: len(tokens)]
    assert deadline_s - 0.5 < elapsed < deadline_s + 1.0, elapsed
    assert metrics["ddtree_deadline_exceeded_total"] == 1


def test_a_relayed_answer_cut_before_its_usage_still_ends_with_one(vllm_server):
    """vLLM's answer reaches its last token and finish reason, then its connection closes
    before the usage event the client asked for: the client still gets one, with vLLM's
    counts and the names of vLLM's events, then [DONE]."""
    lose = {"rate": 1.0, "faults": (LOSE_USAGE,), "only_streams": True,
            "paths": ("/v1/completions", "/v1/chat/completions")}  # fmt: skip
    asked = [(path, body) for path, body in _bodies(vllm_server.model) if "stream_options" in body]
    with FaultShim(vllm_server.url, **lose) as shim:
        with _proxy(shim.url, vllm_server, read_timeout=120) as proxy:
            answers = [_events(_stream(proxy.url, path, body)) for path, body in asked]
            metrics = scrape(proxy.url)
    assert asked and shim.stats.stream_faults[LOSE_USAGE] == len(asked)
    assert metrics.get(f'{HANDED_OVER}{{outcome="whole"}}') == len(asked)
    for (path, body), events in zip(asked, answers, strict=True):
        *answer, usage, done = events
        direct = _events(_stream(vllm_server.url, path, body))
        assert done == "[DONE]" and usage["choices"] == [], events
        assert _output(answer) == _output(direct[:-2]), body
        expected = {key: direct[-2]["usage"][key]
                    for key in ("prompt_tokens", "completion_tokens", "total_tokens")}  # fmt: skip
        assert {key: usage["usage"][key] for key in expected} == expected, body
        assert usage["usage"]["ddtree"]["plain_calls"] == 1
        assert {(event["id"], event["created"]) for event in events[:-1]} == {
            (answer[0]["id"], answer[0]["created"])
        }, body


def test_handed_over_answers_leave_their_connection_pooled(vllm_server):
    """Each answer is read to its end (vLLM's chunked terminator comes after [DONE]), so
    every later hand-over goes on the same connection to vLLM: one closed unread is
    dropped, and each request would pay a new connection on both hosts."""
    with TcpRelay(vllm_server.url) as relay:
        with _proxy(relay.url, vllm_server) as proxy:
            bodies = _bodies(vllm_server.model)
            _stream(proxy.url, *bodies[0])  # the streams' connection opens
            opened = relay.connections
            for path, body in bodies * 2:
                _stream(proxy.url, path, body)
            assert relay.connections == opened
            metrics = scrape(proxy.url)
    assert metrics.get(f'{HANDED_OVER}{{outcome="whole"}}') == 1 + 2 * len(bodies)
