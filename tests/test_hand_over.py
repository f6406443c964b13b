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

import json
import re

import httpx
import pytest
from background_server import BackgroundServer
from fault_shim import FaultShim
from metrics import scrape

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
        settings = ServerSettings(
            target_url=shim.url, tokenizer=str(vllm_server.model_dir), drafter="ngram",
            tree=TreeSettings(budget=8), read_timeout=120, log_level="warning",
        )  # fmt: skip
        app = create_app(settings)
        with BackgroundServer(app) as proxy:
            _leave_to_vllm(app)
            bodies = _bodies(vllm_server.model)
            path, body = bodies[0]
            bodies.append((path, body | {"return_token_ids": True, "request_id": "ids"}))
            for path, body in bodies:
                relayed = _stream(proxy.url, path, body)
                sent = [answer for route, call, answer in shim.stats.relayed
                        if route == path and json.loads(call)["request_id"] == body["request_id"]]  # fmt: skip
                assert len(sent) == 1, body
                expected = sent[0] if body.get("return_token_ids") else _unasked(sent[0])
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
    bodies = _bodies(vllm_server.model)
    asked = [(path, body | {"return_token_ids": True, "max_tokens": 48}) for path, body in bodies]
    cut = {"rate": 1.0, "faults": ("truncate",), "only_streams": True,
           "paths": ("/v1/completions", "/v1/chat/completions")}  # fmt: skip
    with FaultShim(vllm_server.url, **cut) as shim:
        settings = ServerSettings(
            target_url=shim.url, tokenizer=str(vllm_server.model_dir), drafter="ngram",
            tree=TreeSettings(budget=8), read_timeout=120, max_retries=2, log_level="warning",
        )  # fmt: skip
        app = create_app(settings)
        with BackgroundServer(app) as proxy:
            _leave_to_vllm(app)
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
