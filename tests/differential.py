"""Differential testing: the same requests to vLLM and to the proxy in front of it.

`generate_cases` draws a seeded mix of valid and invalid `/v1/completions` and
`/v1/chat/completions` requests (streaming and not); `run_cases` sends each to both
servers; `compare` reduces both answers to what a client can observe and lists every
difference that is not one of the intended differences (docs/FIDELITY.md):

* sampled output (temperature > 0): the proxy's draws follow the target's
  distribution but are not vLLM's draws, so only status and shape are compared;
* text after a prompt of token ids: vLLM's detokenizer starts from the decoded prompt
  and its text does not match its own `token_ids`; token ids are compared instead, and
  where stop strings (matched against that text) are asked for too, only status and
  shape;
* `usage.ddtree` (the proxy's own statistics), `id` and `created`.

Used by tests/test_differential.py (a few hundred cases in CI) and
scripts/differential.py (thousands, before a release).
"""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass, field
from typing import Any

import httpx

CODE = [
    "def fib(n):\n",
    "import os\n\n",
    "class Stack:\n    def push(self, x):",
    "# add two numbers\ndef add(a, b):\n    return",
    "1, 2, 3,",
    "for i in range(10):\n    print(",
    'print("héllo wörld ☃")',
    "x",
]
WHITESPACE = ["\n\n", " ", "\t", "    ", "\n", " \n \n"]
MESSAGES = [
    [{"role": "user", "content": "Write a function that reverses a string."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "def add(a, b):"}],
    [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": [{"type": "text", "text": "Now subtract."}]},
    ],
    [{"role": "user", "content": "\n\n"}],
]


@dataclass
class Case:
    endpoint: str  # "completions" or "chat"
    body: dict[str, Any] | bytes
    labels: tuple[str, ...]  # what the case exercises, for reports

    @property
    def path(self) -> str:
        return "/v1/completions" if self.endpoint == "completions" else "/v1/chat/completions"

    @property
    def stream(self) -> bool:
        return isinstance(self.body, dict) and self.body.get("stream") is True

    @property
    def greedy(self) -> bool:
        if not isinstance(self.body, dict):
            return True
        temperature = self.body.get("temperature")
        return isinstance(temperature, (int, float)) and temperature < 1e-5

    @property
    def text_dependent(self) -> bool:
        """Stop strings after a token-id prompt: vLLM matches them in its garbled text."""
        return self.token_id_prompt and bool(self.body.get("stop"))

    @property
    def token_id_prompt(self) -> bool:
        prompt = self.body.get("prompt") if isinstance(self.body, dict) else None
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
            prompt = prompt[0]
        return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], int)


def _token_ids(rng: random.Random, vocab_size: int) -> list[int]:
    # Ids of the test models' byte-level vocabulary, specials (< 4) left out.
    return [rng.randrange(4, vocab_size) for _ in range(rng.randint(1, 40))]


def _valid_case(rng: random.Random, model: str, vocab_size: int) -> tuple[Case, list[str]]:
    labels: list[str] = []
    endpoint = "completions" if rng.random() < 0.6 else "chat"
    body: dict[str, Any] = {"model": model}
    if endpoint == "completions":
        shape = rng.random()
        if shape < 0.4:
            body["prompt"] = rng.choice(CODE)
        elif shape < 0.5:
            body["prompt"] = rng.choice(WHITESPACE)
            labels.append("whitespace_prompt")
        elif shape < 0.75:
            body["prompt"] = _token_ids(rng, vocab_size)
            labels.append("token_id_prompt")
        elif shape < 0.85:
            body["prompt"] = [_token_ids(rng, vocab_size)]
            labels.append("batch_of_one_ids")
        elif shape < 0.92:
            body["prompt"] = [rng.choice(CODE + WHITESPACE)]
            labels.append("batch_of_one_text")
        else:
            body["prompt"] = [rng.choice(CODE), rng.choice(CODE)]
            labels.append("batch_of_two")
        body["max_tokens"] = rng.choice([1, 2, 4, 6, 8])
    else:
        body["messages"] = rng.choice(MESSAGES)
        if body["messages"][-1]["content"] == "\n\n":
            labels.append("whitespace_prompt")
        key = "max_tokens" if rng.random() < 0.5 else "max_completion_tokens"
        body[key] = rng.choice([1, 2, 4, 6, 8])
    if rng.random() < 0.7:
        body["temperature"] = 0
    elif rng.random() < 0.5:
        body["temperature"] = rng.choice([0.5, 0.8, 1.0])
        body["seed"] = rng.randrange(1000)
        labels.append("sampled")
    else:
        labels.append("sampled")  # the server's default temperature
    if rng.random() < 0.6:
        body["return_token_ids"] = True
    if rng.random() < 0.15:
        body["stop"] = rng.choice([["\n"], [")"], "e", ["return", " "]])
        labels.append("stop")
    if rng.random() < 0.15:
        body["stop_token_ids"] = [rng.randrange(4, vocab_size) for _ in range(rng.randint(1, 3))]
        labels.append("stop_token_ids")
    if rng.random() < 0.25:
        body["ignore_eos"] = True
    if rng.random() < 0.1:
        body["skip_special_tokens"] = False
        labels.append("keep_special_tokens")
    if rng.random() < 0.15:
        if endpoint == "completions":
            body["logprobs"] = 0
        else:
            body["logprobs"] = True
        labels.append("logprobs")
    if rng.random() < 0.1:
        body["user"] = "someone"
    if rng.random() < 0.1:
        body[rng.choice(["x_client_trace", "metadata_extra", "foo"])] = rng.choice([1, "a", {}])
        labels.append("unknown_field")
    if rng.random() < 0.05:
        body["n"] = 2
        labels.append("passthrough")
    if rng.random() < 0.4:
        body["stream"] = True
        labels.append("stream")
        if rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
            if rng.random() < 0.3:
                body["stream_options"]["continuous_usage_stats"] = True
    return Case(endpoint, body, ()), labels


# name -> (endpoints it applies to, what it does to a valid body)
def _invalid_mutations(vocab_size: int, max_model_len: int) -> dict[str, tuple[str, Any]]:
    return {
        "bad_stop_token_ids": ("both", lambda b, r: b.update(stop_token_ids=[r.choice([-1, vocab_size, 10**6])])),
        "logprobs_over_limit": ("completions", lambda b, r: b.update(logprobs=r.choice([-1, 21, 100]))),
        "logprobs_negative": ("completions", lambda b, r: b.update(logprobs=-2)),
        "top_logprobs_over_limit": ("chat", lambda b, r: b.update(logprobs=True, top_logprobs=r.choice([-1, 21, 50]))),
        "temperature_out_of_range": ("both", lambda b, r: b.update(temperature=r.choice([-1, 2.5, 100]))),
        "temperature_wrong_type": ("both", lambda b, r: b.update(temperature="hot")),
        "top_p_out_of_range": ("both", lambda b, r: b.update(top_p=r.choice([0, 1.5, -0.1]))),
        "top_k_out_of_range": ("both", lambda b, r: b.update(top_k=r.choice([-2, -100]))),
        "max_tokens_nonpositive": ("both", lambda b, r: b.update(max_tokens=r.choice([0, -1]))),
        "max_tokens_wrong_type": ("both", lambda b, r: b.update(max_tokens="ten")),
        "max_tokens_too_large": ("both", lambda b, r: b.update(max_tokens=r.choice([max_model_len + 1, 10**6]))),
        "stop_empty_string": ("both", lambda b, r: b.update(stop=[""])),
        "seed_out_of_range": ("both", lambda b, r: b.update(seed=2**64)),
        "stream_options_without_stream": ("both", lambda b, r: (b.pop("stream", None), b.update(stream_options={"include_usage": True}))),
        "unknown_model": ("both", lambda b, r: b.update(model="no-such-model")),
        "n_zero": ("both", lambda b, r: b.update(n=0)),
        "min_tokens_over_max": ("both", lambda b, r: b.update(min_tokens=50)),
        "empty_prompt": ("completions", lambda b, r: b.update(prompt=r.choice(["", []]))),
        "prompt_wrong_type": ("completions", lambda b, r: b.update(prompt=r.choice([5, None, {"a": 1}]))),
        "prompt_bad_token_id": ("completions", lambda b, r: b.update(prompt=[5, r.choice([-1, vocab_size, 10**6])])),
        "prompt_too_long": ("completions", lambda b, r: b.update(prompt=[5] * r.choice([max_model_len, max_model_len + 7]))),
        "messages_empty": ("chat", lambda b, r: b.update(messages=[])),
        "messages_wrong_type": ("chat", lambda b, r: b.update(messages="hi")),
        "message_without_role": ("chat", lambda b, r: b.update(messages=[{"content": "hi"}])),
        "presence_penalty_out_of_range": ("both", lambda b, r: b.update(presence_penalty=5)),
    }  # fmt: skip


def generate_cases(
    seed: int,
    num_cases: int,
    model: str,
    vocab_size: int,
    max_model_len: int,
    invalid_share: float = 0.4,
) -> list[Case]:
    """`num_cases` requests; about `invalid_share` of them carry one invalid field or
    value (the same seed and share give the same cases)."""
    rng = random.Random(seed)
    mutations = _invalid_mutations(vocab_size, max_model_len)
    cases = []
    for _ in range(num_cases):
        case, labels = _valid_case(rng, model, vocab_size)
        assert isinstance(case.body, dict)
        if rng.random() < invalid_share:
            names = [n for n, (ep, _) in mutations.items() if ep in ("both", case.endpoint)]
            name = rng.choice(names)
            mutations[name][1](case.body, rng)
            labels.append(name)
        elif rng.random() < 0.02:
            case.body = rng.choice([b"{not json", b"[1, 2]", b'"text"'])
            labels.append("not_an_object")
        case.labels = tuple(labels) or ("plain",)
        cases.append(case)
    return cases


# ----- what a client observes -----------------------------------------------------------


@dataclass
class Observed:
    status: int
    content_type: str  # "json", "sse" or the raw content type
    error: dict[str, Any] | None = None  # the error object (a body's, or a stream's first)
    num_errors: int = 0
    choices: dict[int, dict[str, Any]] = field(default_factory=dict)
    usage: tuple[int, int, int] | None = None
    shape: tuple[str, ...] = ()  # SSE: event kinds, content chunks left out
    raw: str = ""

    def summary(self) -> str:
        return f"{self.status} {self.content_type} {self.raw[:400]!r}"


def _error_shape_ok(error: Any) -> bool:
    return (
        isinstance(error, dict)
        and set(error) >= {"message", "type", "param", "code"}
        and isinstance(error["message"], str)
        and isinstance(error["type"], str)
        and isinstance(error["code"], int)
    )


def _add_choice(choices: dict[int, dict[str, Any]], raw: dict[str, Any], chat: bool) -> None:
    index = raw.get("index", 0)
    entry = choices.setdefault(
        index,
        {"text": "", "token_ids": None, "finish_reason": None, "stop_reason": None,
         "logprob_tokens": [], "logprobs": []},
    )  # fmt: skip
    if chat:
        part = raw.get("delta") if "delta" in raw else raw.get("message")
        entry["text"] += (part or {}).get("content") or ""
    else:
        entry["text"] += raw.get("text") or ""
    if raw.get("token_ids") is not None:
        entry["token_ids"] = (entry["token_ids"] or []) + list(raw["token_ids"])
    if raw.get("finish_reason") is not None:
        entry["finish_reason"] = raw["finish_reason"]
        entry["stop_reason"] = raw.get("stop_reason")
    logprobs = raw.get("logprobs")
    if logprobs:
        if chat:
            for item in logprobs.get("content") or []:
                entry["logprob_tokens"].append(item["token"])
                entry["logprobs"].append(item["logprob"])
        else:
            entry["logprob_tokens"] += logprobs.get("tokens") or []
            entry["logprobs"] += logprobs.get("token_logprobs") or []


def _usage(raw: Any) -> tuple[int, int, int] | None:
    if not isinstance(raw, dict):
        return None
    return (raw.get("prompt_tokens"), raw.get("completion_tokens"), raw.get("total_tokens"))


def observe(case: Case, status: int, content_type: str, content: bytes) -> Observed:
    chat = case.endpoint == "chat"
    text = content.decode("utf-8", errors="replace")
    if content_type.startswith("text/event-stream"):
        seen = Observed(status, "sse", raw=text)
        shape: list[str] = []
        finished: set[int] = set()
        for line in text.split("\n"):  # not splitlines: the JSON may hold \x1c, \u2028...
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                shape.append("done")
                continue
            event = json.loads(data)
            if "error" in event:
                seen.num_errors += 1
                seen.error = seen.error or event["error"]
                shape.append("error")
                continue
            choices = event.get("choices") or []
            if not choices:
                shape.append("usage" if event.get("usage") else "empty")
                seen.usage = _usage(event.get("usage")) or seen.usage
                continue
            for raw in choices:
                delta = raw.get("delta") or {}
                if chat and delta.get("role"):
                    shape.append("role")
                if raw.get("index", 0) in finished:
                    shape.append("after_finish")
                _add_choice(seen.choices, raw, chat)
                if raw.get("finish_reason") is not None:
                    finished.add(raw.get("index", 0))
                    shape.append("finish+usage" if event.get("usage") else "finish")
            if event.get("usage"):
                seen.usage = _usage(event["usage"])
        seen.shape = tuple(shape)
        return seen
    if content_type.startswith("application/json"):
        seen = Observed(status, "json", raw=text)
        try:
            body = json.loads(text)
        except json.JSONDecodeError:
            return seen
        if isinstance(body, dict) and "error" in body:
            seen.error, seen.num_errors = body["error"], 1
            return seen
        if isinstance(body, dict):
            for raw in body.get("choices") or []:
                _add_choice(seen.choices, raw, chat)
            seen.usage = _usage(body.get("usage"))
        return seen
    return Observed(status, content_type, raw=text)


def compare(case: Case, want: Observed, got: Observed) -> list[str]:
    """Differences a client could see, less the intended ones (module docstring)."""
    diffs = []
    if want.status != got.status:
        return [f"status {want.status} != {got.status}"]
    if want.content_type != got.content_type:
        return [f"content type {want.content_type} != {got.content_type}"]
    if (want.error is None) != (got.error is None) or want.num_errors != got.num_errors:
        return [f"errors {want.num_errors} != {got.num_errors}"]
    if got.error is not None and not _error_shape_ok(got.error):
        diffs.append(f"error shape {got.error!r}")
    if got.error is not None and want.error is not None and got.error.get("code") != want.error.get("code"):
        diffs.append(f"error code {want.error.get('code')} != {got.error.get('code')}")
    if want.shape != got.shape:
        diffs.append(f"stream shape {want.shape} != {got.shape}")
    if sorted(want.choices) != sorted(got.choices):
        diffs.append(f"choice indices {sorted(want.choices)} != {sorted(got.choices)}")
        return diffs
    if (want.usage is None) != (got.usage is None):
        diffs.append(f"usage {want.usage} != {got.usage}")
    elif want.usage is not None and got.usage is not None and want.usage[0] != got.usage[0]:
        diffs.append(f"usage.prompt_tokens {want.usage[0]} != {got.usage[0]}")
    if not case.greedy or case.text_dependent:
        for index, entry in got.choices.items():
            if entry["finish_reason"] not in ("stop", "length"):
                diffs.append(f"choice {index}: finish_reason {entry['finish_reason']!r}")
            if (want.choices[index]["token_ids"] is None) != (entry["token_ids"] is None):
                diffs.append(f"choice {index}: token_ids present differs")
        return diffs
    if want.usage != got.usage:
        diffs.append(f"usage {want.usage} != {got.usage}")
    for index, expected in want.choices.items():
        actual = got.choices[index]
        for key in ("token_ids", "finish_reason", "stop_reason", "logprob_tokens"):
            if expected[key] != actual[key]:
                diffs.append(f"choice {index}: {key} {expected[key]!r} != {actual[key]!r}")
        if not case.token_id_prompt and expected["text"] != actual["text"]:
            diffs.append(f"choice {index}: text {expected['text']!r} != {actual['text']!r}")
        if len(expected["logprobs"]) != len(actual["logprobs"]) or any(
            abs(a - b) > 1e-3 for a, b in zip(expected["logprobs"], actual["logprobs"], strict=False)
        ):
            diffs.append(f"choice {index}: logprobs {expected['logprobs']} != {actual['logprobs']}")
    return diffs


@dataclass
class Result:
    case: Case
    want: Observed
    got: Observed
    diffs: list[str]


async def _send(client: httpx.AsyncClient, url: str, case: Case) -> Observed:
    kwargs: dict[str, Any] = (
        {"content": case.body, "headers": {"content-type": "application/json"}}
        if isinstance(case.body, bytes)
        else {"json": case.body}
    )
    response = await client.post(url + case.path, **kwargs)
    return observe(case, response.status_code, response.headers.get("content-type", ""), response.content)


async def run_cases(
    vllm_url: str, proxy_url: str, cases: list[Case], concurrency: int = 4, timeout: float = 300
) -> list[Result]:
    semaphore = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=timeout) as client:

        async def one(case: Case) -> Result:
            async with semaphore:
                want = await _send(client, vllm_url, case)
                got = await _send(client, proxy_url, case)
            return Result(case, want, got, compare(case, want, got))

        return await asyncio.gather(*(one(case) for case in cases))


def compared_exactly(results: list[Result]) -> list[Result]:
    """The results whose output was compared token for token (greedy, answered)."""
    return [
        r for r in results
        if r.want.status == 200 and r.want.error is None and r.case.greedy
        and not r.case.text_dependent
    ]  # fmt: skip


def report(results: list[Result], max_shown: int = 20) -> str:
    """Counts per label, then the first differing cases in full."""
    per_label: dict[str, list[int]] = {}
    for result in results:
        for label in result.case.labels:
            counts = per_label.setdefault(label, [0, 0])
            counts[0] += 1
            counts[1] += bool(result.diffs)
    ok = [r for r in results if r.want.status == 200 and r.want.error is None]
    refused = [r for r in results if not (r.want.status == 200 and r.want.error is None)]
    exact = compared_exactly(results)
    lines = [
        f"{len(results)} cases, {sum(bool(r.diffs) for r in results)} differ",
        f"  vLLM answered {len(ok)} with output ({len(exact)} greedy, compared token for "
        f"token; {sum(r.want.content_type == 'sse' for r in ok)} streamed) and refused "
        f"{len(refused)} ({sum(r.want.content_type == 'sse' for r in refused)} inside a stream)",
    ]
    lines += [f"  {label}: {n} cases, {bad} differ" for label, (n, bad) in sorted(per_label.items())]
    for result in [r for r in results if r.diffs][:max_shown]:
        body = result.case.body
        lines.append(f"--- {result.case.path} {result.case.labels}")
        lines.append(f"    body: {body if isinstance(body, bytes) else json.dumps(body)[:400]}")
        lines.append(f"    diffs: {result.diffs}")
        lines.append(f"    vllm:  {result.want.summary()}")
        lines.append(f"    proxy: {result.got.summary()}")
    return "\n".join(lines)
