"""Verify draft trees against an unmodified vLLM server over its OpenAI HTTP API.

Strategies, chosen per request (`SessionOptions.strategy`); the measurements behind
them are in docs/PERFORMANCE.md ("Proxy mode on a CPU") and the benchmark report:

* ``nodes`` (default, any sampling): one ``max_tokens=1`` prompt per tree node, root
  included -- node n's prompt is ``committed + tree.path_tokens(n)`` -- all in one
  batched ``/v1/completions`` call. Each prompt reads the committed context from
  vLLM's prefix cache and recomputes only its tail. With a client seed, vLLM seeds
  every prompt of a call alike, so the nodes are split into one call per tree depth
  (sent concurrently), each seeded for the absolute position its draws land on.
* ``paths`` (greedy only): one prompt per leaf, ``committed + path(leaf)``, with
  ``prompt_logprobs=1``; the target's argmax after every prefix along the path is read
  from the prompt logprobs and the leaf's own next token from the completion. Fewer
  prompts, but ``prompt_logprobs`` turns off vLLM's prefix cache for the request, so
  the whole context is recomputed every round.

Log-probs (when asked for) are what vLLM itself reports for that token -- by default
its raw log-softmax before temperature/top-k/top-p (``--logprobs-mode raw_logprobs``),
so a client sees the same numbers as from vLLM directly.

Positions: committed[-1] is the root. The token the target draws at a node of depth d
lands at absolute (0-based) position ``len(committed) + d``; the root's draw lands at
``len(committed)``.
"""

from __future__ import annotations

import asyncio
import functools
import json
import random
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Literal, Sequence, get_args

import httpx
import numpy as np

from proxy.backend.aiohttp_transport import AiohttpTransport
from proxy.backend.base import (
    PlainStreamLost,
    SessionOptions,
    TargetCounters,
    TargetError,
    Verification,
)
from proxy.model_files import find_model_files
from proxy.sampling import derive_seed
from proxy.tree import DraftTree, WalkResult

Strategy = Literal["nodes", "paths"]
STRATEGIES: tuple[str, ...] = get_args(Strategy)
DEFAULT_STRATEGY: Strategy = "nodes"
KEEPALIVE_EXPIRY_S = 2.0  # < vLLM's (uvicorn's) 5 s keep-alive timeout


@dataclass(frozen=True)
class RetryPolicy:
    """Retries of idempotent upstream calls. Verification calls are idempotent: greedy
    answers are deterministic, seeded ones are seeded per node, and an unseeded draw
    whose answer never arrived was never used, so a fresh draw is just as valid."""

    max_retries: int = 4  # attempts = max_retries + 1
    backoff_s: float = 0.05  # before the first retry; doubles each time
    max_backoff_s: float = 1.0

    def delay(self, retry_idx: int, rng: random.Random) -> float:
        """Backoff before retry `retry_idx` (0-based), with jitter in [50%, 100%]."""
        base = min(self.max_backoff_s, self.backoff_s * 2**retry_idx)
        return base * (0.5 + 0.5 * rng.random())


def transport_failure(where: str, exc: httpx.HTTPError) -> TargetError:
    """The TargetError for a call that did not complete (timeout, connect, network)."""
    if isinstance(exc, httpx.TimeoutException):
        return TargetError(f"{where} timed out ({type(exc).__name__})", "timeout")
    if isinstance(exc, httpx.ConnectError):
        return TargetError(f"{where}: cannot connect ({exc})", "connect")
    return TargetError(f"{where} failed: {type(exc).__name__}: {exc}", "network")


class VLLMHttp:
    """A pooled keep-alive client for one vLLM server; maps every failure to TargetError.
    This is the only place that talks HTTP to the upstream.

    `request_json` retries idempotent calls (`retry=True`) on connection failures,
    timeouts, 429/5xx answers and malformed JSON, with bounded exponential backoff;
    `on_retry(kind)` is called before each retry (the server counts them).
    `num_calls` counts its calls (JSON and streams) by path, retries not included (the
    server exports those to /tokenize and /detokenize, so that a call per token shows).
    """

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        connect_timeout: float = 5.0,
        read_timeout: float = 120.0,
        max_connections: int = 64,
        retry: RetryPolicy | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        timeout = httpx.Timeout(read_timeout, connect=connect_timeout)

        def client(max_connections: int | None) -> httpx.AsyncClient:
            # Pooled connections expire before vLLM's own keep-alive timeout (uvicorn's
            # 5 s): reusing one the server has just closed fails with a ReadError.
            pool = transport or AiohttpTransport(max_connections, KEEPALIVE_EXPIRY_S)
            return httpx.AsyncClient(
                base_url=self.base_url, headers=headers, timeout=timeout, transport=pool
            )

        # Short calls (verification, tokenization) share one bounded pool. Streams
        # (plain generation, pass-through relays) hold a connection for a request's
        # whole length and get their own pool: in one pool, 64 open streams whose
        # requests each wait for a /detokenize call would starve each other.
        self.client = client(max_connections)
        self.stream_client = client(None)
        self._stream_headers = headers
        self._stream_extensions = {"timeout": timeout.as_dict()}
        # Each path's URL, parsed once (parsing one costs half of building a request).
        self._urls = functools.lru_cache(maxsize=64)(lambda path: httpx.URL(self.base_url + path))
        self.retry = retry or RetryPolicy()
        self.on_retry: Callable[[str], None] | None = None
        self.num_calls: Counter[str] = Counter()
        self._rng = random.Random()

    async def request_json(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        retry: bool = True,
        headers: dict[str, str] | None = None,
    ) -> Any:
        """Send one request; return the decoded JSON body or raise TargetError (an
        with its kind) after the last attempt."""
        attempts = self.retry.max_retries + 1 if retry else 1
        self.num_calls[path] += 1
        for attempt in range(attempts):
            try:
                return await self._request_once(method, path, body, headers)
            except TargetError as exc:
                if attempt + 1 == attempts or not exc.retriable:
                    if attempt:
                        exc.args = (f"{exc.args[0]} (after {attempt + 1} attempts)",)
                    raise
                if self.on_retry is not None:
                    self.on_retry(exc.kind)
                await asyncio.sleep(self.retry.delay(attempt, self._rng))
        raise AssertionError("unreachable")

    def _where(self, method: str, path: str) -> str:
        """A call's name in its errors."""
        return f"vLLM {method} {self.base_url}{path}"

    async def _request_once(
        self, method: str, path: str, body: Any, headers: dict[str, str] | None = None
    ) -> Any:
        where = self._where(method, path)
        try:
            response = await self.client.request(method, path, json=body, headers=headers)
        except httpx.HTTPError as exc:
            raise transport_failure(where, exc) from exc
        if response.status_code != 200:
            raise TargetError(
                f"{where} returned HTTP {response.status_code}: {response.text[:500]}",
                "http",
                response.status_code,
                _error_object(response),
            )
        try:
            return response.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise TargetError(
                f"{where} returned malformed JSON: {response.text[:200]!r}", "malformed"
            ) from exc

    async def served_models(self) -> dict[str, dict[str, Any]]:
        """/v1/models as {model id: its entry}; TargetError if it serves none."""
        listing = await self.request_json("GET", "/v1/models")
        try:
            entries = {entry["id"]: entry for entry in listing["data"]}
        except (KeyError, TypeError) as exc:
            raise TargetError(
                f"unexpected /v1/models answer from {self.base_url}: {listing!r:.300}"
            ) from exc
        if not entries:
            raise TargetError(f"vLLM at {self.base_url} serves no model")
        return entries

    async def open_stream(
        self, method: str, path: str, content: bytes | None, headers: dict[str, str]
    ) -> httpx.Response:
        """Send a request as given and return the response with its body unread (the
        caller relays it and closes it); no retries: it may not be idempotent."""
        where = self._where(method, path)
        try:
            # On the client's transport directly: the client's own layers (URL merging,
            # cookies, auth and redirect flows, a wrapped body) cost about 130 us of CPU
            # a request, as much as relaying a few events. `_transport_for_url` is
            # where httpx picks it (and where respx puts its mock).
            request = httpx.Request(
                method, self._urls(path), content=content,
                headers={**self._stream_headers, **headers}, extensions=self._stream_extensions,
            )  # fmt: skip
            transport = self.stream_client._transport_for_url(request.url)
            return await transport.handle_async_request(request)
        except httpx.HTTPError as exc:
            raise transport_failure(where, exc) from exc

    async def post_stream(
        self, path: str, content: bytes, headers: dict[str, str] | None = None
    ) -> httpx.Response:
        """POST a JSON body whose answer streams; the open 200 response (body unread).
        Failures before it are retried like `request_json`'s (vLLM aborts a request
        whose connection closed); TargetError once they are not worth another try."""
        self.num_calls[path] += 1
        where = self._where("POST", path)
        headers = {"content-type": "application/json", **(headers or {})}
        attempt = 0
        while True:
            try:
                response = await self.open_stream("POST", path, content, headers)
                if response.status_code != 200:
                    text = (await response.aread()).decode(errors="replace")
                    await response.aclose()
                    raise TargetError(
                        f"{where} returned HTTP {response.status_code}: {text[:500]}",
                        "http",
                        response.status_code,
                    )
                return response
            except TargetError as exc:
                if attempt == self.retry.max_retries or not exc.retriable:
                    raise
                if self.on_retry is not None:
                    self.on_retry(exc.kind)
                await asyncio.sleep(self.retry.delay(attempt, self._rng))
                attempt += 1

    async def stream_events(
        self, path: str, body: Any, headers: dict[str, str] | None = None
    ) -> AsyncIterator[Any]:
        """POST a streaming request; yield each server-sent event's JSON until [DONE].
        Opening the stream is retried like `request_json`; a failure after the first
        event is raised as it is (the caller holds what already arrived), and a stream
        that ends without [DONE] is one: its connection closed before vLLM finished.
        After [DONE] the body is read to its end (the chunked terminator), so that the
        connection goes back to the pool: one closed unread is dropped, and the next
        stream pays a new connection on both sides."""
        where = self._where("POST", path)
        response = await self.post_stream(path, json.dumps(body).encode(), headers)
        done = False
        try:
            async for line in response.aiter_lines():
                if done or not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    done = True
                    continue
                try:
                    yield json.loads(data)
                except json.JSONDecodeError as exc:
                    raise TargetError(f"{where} sent malformed JSON: {data[:200]!r}") from exc
            if not done:
                raise TargetError(f"{where}: the stream ended without [DONE]", "network")
        except httpx.HTTPError as exc:
            if done:
                return  # every event came; the body's end did not (the connection is dropped)
            raise transport_failure(where, exc) from exc
        finally:
            await response.aclose()

    async def health(self) -> tuple[bool, dict[str, Any]]:
        try:
            # Short: /health must turn unhealthy within seconds of the upstream dying.
            response = await self.client.get("/health", timeout=2.0)
        except Exception as exc:  # any failure to reach it means "unhealthy"
            return False, {"url": self.base_url, "error": f"{type(exc).__name__}: {exc}"}
        return response.status_code == 200, {
            "url": self.base_url,
            "status_code": response.status_code,
        }

    async def aclose(self) -> None:
        await self.client.aclose()
        await self.stream_client.aclose()


def _error_object(response: httpx.Response) -> dict[str, Any] | None:
    """vLLM's `{"error": {message, type, param, code}}` object of a failed call, if any."""
    try:
        error = response.json().get("error")
    except (ValueError, AttributeError):
        return None
    return error if isinstance(error, dict) and isinstance(error.get("message"), str) else None


def max_model_len_of(entry: dict[str, Any], url: str) -> int:
    """A /v1/models entry's max_model_len (TargetError if it has none)."""
    max_model_len = entry.get("max_model_len")
    if not isinstance(max_model_len, int):
        raise TargetError(f"/v1/models at {url} gives no max_model_len for {entry.get('id')!r}")
    return max_model_len


def eos_token_ids_from_model_dir(model_dir: str | Path) -> tuple[int, ...]:
    """The ids vLLM stops on for a local HF model dir: the tokenizer's EOS plus the
    ``eos_token_id`` of config.json and generation_config.json (int or list)."""
    model_dir = Path(model_dir)
    ids: list[int] = []

    def add(value: Any) -> None:
        for token_id in value if isinstance(value, list) else [value]:
            if isinstance(token_id, int) and token_id not in ids:
                ids.append(token_id)

    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if path.is_file():
            add(json.loads(path.read_text()).get("eos_token_id"))
    tokenizer_config = model_dir / "tokenizer_config.json"
    tokenizer_json = model_dir / "tokenizer.json"
    if tokenizer_config.is_file() and tokenizer_json.is_file():
        eos = json.loads(tokenizer_config.read_text()).get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        for added in json.loads(tokenizer_json.read_text()).get("added_tokens", []):
            if added.get("content") == eos:
                add(added.get("id"))
    if not ids:
        raise ValueError(f"no eos_token_id found in {model_dir}")
    return tuple(ids)


@dataclass(frozen=True)
class _Choice:
    token: int  # the completion's one generated token
    logprob: float | None  # its log-prob, when logprobs were asked for
    # [len(prompt)] the argmax after prompt[:p]; [0] unused (no prefix)
    prompt_argmax: list[int] | None


class UnknownEOSError(ValueError):
    """The served model's EOS token ids are nowhere to be found on this host."""


class VLLMTarget:
    """A `Target` served by a vLLM OpenAI-compatible server.

    Build it with `await VLLMTarget.connect(url)`, which reads the served model name and
    ``max_model_len`` from ``/v1/models``. One pooled HTTP client is shared by every
    session; close it with `aclose()`. The verification strategy is each session's
    (`SessionOptions.strategy`, default "nodes").
    """

    label = "proxy"
    strategies = STRATEGIES

    def __init__(
        self,
        http: VLLMHttp,
        model: str,
        max_model_len: int,
        eos_token_ids: Sequence[int],
        root: str | None = None,
    ) -> None:
        if not eos_token_ids:
            raise ValueError("eos_token_ids must not be empty")
        self.http = http
        self.name = model
        self.max_model_len = int(max_model_len)
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        # What vLLM loaded (its /v1/models `root`: a path or hub id), whatever name it
        # serves the model under.
        self.root = root or model
        # A header sent with every call of a request, its value one id per request, so
        # that a session-affinity router in front keeps the request on one backend.
        self.session_header: str | None = None

    @classmethod
    async def connect(
        cls,
        url: str,
        model: str | None = None,
        *,
        eos_token_ids: Sequence[int] | None = None,
        model_dir: str | Path | None = None,
        api_key: str | None = None,
        connect_timeout: float = 5.0,
        read_timeout: float = 120.0,
        retry: RetryPolicy | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> VLLMTarget:
        """Query ``/v1/models`` and build the target.

        model: the served model name; None takes the server's only (first) model.
        eos_token_ids: given explicitly, or read from `model_dir`, or from the served
        model's files on this machine (`proxy.model_files`: its ``root`` when that is a
        directory here, or its snapshot in the Hugging Face cache); otherwise ValueError
        -- without them the output could not stop where vLLM's own would.
        """
        http = VLLMHttp(
            url,
            api_key=api_key,
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            retry=retry,
            transport=transport,
        )
        try:
            entries = await http.served_models()
            if model is None:
                model = next(iter(entries))
            if model not in entries:
                raise ValueError(f"model {model!r} not served at {url}; served: {list(entries)}")
            entry = entries[model]
            root = entry.get("root") or model
            if eos_token_ids is None:
                files = find_model_files(root)
                local = Path(model_dir) if model_dir else files.model_dir or files.tokenizer_dir
                if local is None or not local.is_dir():
                    raise UnknownEOSError(
                        f"cannot find eos_token_ids for {model!r}: pass eos_token_ids= or "
                        f"model_dir= (the model's local config/tokenizer dir)"
                    )
                eos_token_ids = eos_token_ids_from_model_dir(local)
            return cls(http, model, max_model_len_of(entry, url), eos_token_ids, root)
        except BaseException:
            await http.aclose()
            raise

    def check_options(self, options: SessionOptions) -> None:
        if options.feature_layer_ids is not None:
            raise ValueError(
                "the vLLM HTTP backend cannot return target hidden states "
                f"(feature_layer_ids={options.feature_layer_ids}); use engine mode for this "
                "drafter"
            )
        strategy = options.strategy or DEFAULT_STRATEGY
        if strategy not in STRATEGIES:
            raise ValueError(
                f"Unknown vLLM verification strategy: {strategy!r}; valid: {STRATEGIES}"
            )
        if strategy == "paths" and not options.sampling.greedy:
            raise ValueError("'paths' reads argmaxes from prompt logprobs: greedy only")
        if strategy == "paths" and options.want_logprobs:
            # Its log-probs would come from prompt logprobs, which can differ from what
            # vLLM reports for the same token in a completion.
            raise ValueError("'paths' serves requests without logprobs only; use 'nodes'")

    async def start(self, prompt_ids: Sequence[int], options: SessionOptions) -> VLLMSession:
        self.check_options(options)
        return VLLMSession(self, options)

    async def health(self) -> tuple[bool, dict[str, Any]]:
        return await self.http.health()

    async def aclose(self) -> None:
        await self.http.aclose()


class VLLMSession:
    """One request's verifications. Stateless beyond counters: vLLM's prefix cache is
    the only thing carried between rounds."""

    def __init__(self, target: VLLMTarget, options: SessionOptions) -> None:
        self.target = target
        self.params = options.sampling
        self.want_logprobs = options.want_logprobs
        self.strategy: Strategy = options.strategy or DEFAULT_STRATEGY
        self.stop_token_ids = [int(t) for t in options.stop_token_ids]
        self.stop_at_eos = options.stop_at_eos
        self.sampling_fields = options.sampling_fields
        self.counters = TargetCounters()
        self.prompt_features = None
        self.replica = None
        header = target.session_header
        self.headers = {header: uuid.uuid4().hex} if header else None  # on every call

    async def verify(self, committed: Sequence[int], tree: DraftTree) -> Verification:
        committed = [int(t) for t in committed]
        if not committed or committed[-1] != int(tree.token_ids[0]):
            raise ValueError("committed[-1] must be the tree's root token")
        longest = len(committed) + tree.max_depth + 1
        if longest > self.target.max_model_len:
            raise TargetError(
                f"verification needs {longest} tokens, over the target's "
                f"max_model_len {self.target.max_model_len}"
            )
        paths = _node_paths(tree)
        if self.strategy == "paths":
            return await self._verify_paths(committed, tree, paths)
        return await self._verify_nodes(committed, tree, paths)

    async def _verify_nodes(
        self, committed: list[int], tree: DraftTree, paths: list[list[int]]
    ) -> Verification:
        num_slots = tree.num_nodes + 1
        if self.params.seed is None:
            groups = [list(range(num_slots))]  # greedy or unseeded: one call
            seeds: list[int | None] = [None]
        else:
            groups = [
                np.flatnonzero(tree.depths == depth).tolist() for depth in range(tree.max_depth + 1)
            ]
            seeds = [
                derive_seed(self.params.seed, len(committed) + depth)
                for depth in range(tree.max_depth + 1)
            ]
        answers = await asyncio.gather(
            *(
                self._complete([committed + paths[idx] for idx in group], seed=seed)
                for group, seed in zip(groups, seeds, strict=True)
            )
        )
        tokens = np.full(num_slots, -1, dtype=np.int64)
        logprobs = np.zeros(num_slots, dtype=np.float64) if self.want_logprobs else None
        for group, choices in zip(groups, answers, strict=True):
            for node_idx, choice in zip(group, choices, strict=True):
                tokens[node_idx] = choice.token
                if logprobs is not None:
                    assert choice.logprob is not None
                    logprobs[node_idx] = choice.logprob
        assert (tokens >= 0).all()
        return Verification(tokens=tokens, logprobs=logprobs)

    async def _verify_paths(
        self, committed: list[int], tree: DraftTree, paths: list[list[int]]
    ) -> Verification:
        has_child = np.zeros(tree.num_nodes + 1, dtype=bool)
        has_child[tree.parents[1:]] = True
        leaves = np.flatnonzero(~has_child).tolist()  # [0] alone when the tree is empty
        choices = await self._complete(
            [committed + paths[leaf] for leaf in leaves], prompt_logprobs=True
        )
        tokens = np.full(tree.num_nodes + 1, -1, dtype=np.int64)
        context_len = len(committed)
        for leaf, choice in zip(leaves, choices, strict=True):
            tokens[leaf] = choice.token
            assert choice.prompt_argmax is not None
            # The ancestors of `leaf` at depth d (root at 0): their next token is the
            # argmax after prompt[: context_len + d], i.e. prompt_argmax[context_len + d].
            for depth, node_idx in enumerate([0, *tree.path(leaf)[:-1]]):
                if tokens[node_idx] < 0:
                    tokens[node_idx] = choice.prompt_argmax[context_len + depth]
        assert (tokens >= 0).all()
        # No log-probs: `check_options` refuses "paths" for requests that want them.
        return Verification(tokens=tokens)

    def _body(self, prompt: Any, max_tokens: int) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.target.name,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "return_token_ids": True,
            "ignore_eos": True,
            "skip_special_tokens": False,
        }
        if self.sampling_fields is not None:
            # The client's own fields only: vLLM fills in its defaults (the model's
            # generation_config.json) exactly as for the client's direct request.
            body.update(self.sampling_fields)
        else:
            # SamplingParams is the whole rule: neutral values override any defaults.
            params = self.params
            body.update(
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=params.top_k if params.top_k > 0 else -1,
                min_p=0.0,
                repetition_penalty=1.0,
                presence_penalty=0.0,
                frequency_penalty=0.0,
            )
        if self.stop_token_ids:
            # Harmless for one token (a stop token still comes back in token_ids), and
            # vLLM then refuses out-of-vocabulary ids as it would the client's request,
            # before the proxy has answered anything. A plain stream ends at one, as the
            # output processor does.
            body["stop_token_ids"] = self.stop_token_ids
        if self.want_logprobs:
            body["logprobs"] = 1
        return body

    async def _complete(
        self,
        prompts: list[list[int]],
        seed: int | None = None,
        prompt_logprobs: bool = False,
    ) -> list[_Choice]:
        """One batched /v1/completions call, max_tokens=1; choices in prompt order."""
        body = self._body(prompts, 1)
        if seed is not None:
            body["seed"] = seed
        if prompt_logprobs:
            body["prompt_logprobs"] = 1
        counters = self.counters
        counters.upstream_calls += 1
        counters.verify_prompt_tokens += sum(len(prompt) for prompt in prompts)
        answer = await self.target.http.request_json(
            "POST", "/v1/completions", body, headers=self.headers
        )
        return _parse_choices(answer, prompts, self.want_logprobs, prompt_logprobs)

    async def accept(self, tree: DraftTree, result: WalkResult) -> None:
        return None  # no features over HTTP; vLLM's prefix cache keeps the context

    async def relay(self, path: str, body: bytes, headers: dict[str, str]) -> httpx.Response:
        """POST the client's own request `body` (with `headers`) to `path`
        (`VLLMHttp.post_stream`, opening retried); the open 200 response for the caller
        to read and close."""
        self.counters.upstream_calls += 1
        return await self.target.http.post_stream(path, body, headers | (self.headers or {}))

    async def plain(
        self, committed: Sequence[int], max_tokens: int, stream: bool = True
    ) -> AsyncIterator[tuple[list[int], list[float] | None]]:
        """Plain generation: vLLM's own decoding of up to `max_tokens` tokens after
        `committed`; yields (token ids, their log-probs or None) as they come -- streamed,
        or with `stream` False as one answer (one call, retried like a verification:
        nothing of a failed call was used). Closing a stream early closes it, and vLLM
        aborts the request. vLLM's own EOS is ignored: the output processor decides
        where the output stops, and the call stops at the same tokens. The client's
        seed is vLLM's own, so a request that is plain from its first token draws
        exactly what vLLM alone would."""
        body = self._body([int(t) for t in committed], max_tokens)
        if self.stop_at_eos:
            # A stream that ends where the output does finishes whole (no abort, and its
            # connection is pooled) instead of generating on until the proxy closes it.
            stops = self.stop_token_ids + list(self.target.eos_token_ids)
            body["stop_token_ids"] = list(dict.fromkeys(stops))
        if self.params.seed is not None:
            body["seed"] = self.params.seed
        self.counters.upstream_calls += 1
        self.counters.verify_prompt_tokens += len(committed)
        if not stream:
            answer = await self.target.http.request_json(
                "POST", "/v1/completions", body, headers=self.headers
            )
            tokens, logprobs = self._plain_choice(answer)
            if tokens:
                yield tokens, logprobs
            return
        body["stream"] = True
        events = self.target.http.stream_events("/v1/completions", body, self.headers)
        started = False
        last: tuple[list[int], list[float] | None] | None = None
        try:
            async for event in events:
                tokens, logprobs = self._plain_choice(event)
                if tokens:
                    started = True
                    if event["choices"][0].get("finish_reason") is not None:
                        # The stream's last tokens wait for its end: a caller that stops
                        # on them would otherwise close the stream unread.
                        last = tokens, logprobs
                        continue
                    yield tokens, logprobs
            if last is not None:
                yield last
        except TargetError as exc:
            if started and self.params.seed is not None:
                raise PlainStreamLost(
                    f"the seeded stream from {self.target.http.base_url} broke after its "
                    f"first tokens; vLLM draws it in one call from the seed, so it cannot "
                    f"go on in another call unchanged: {exc}",
                    exc.kind,
                    exc.status,
                ) from exc
            raise

    def _plain_choice(self, answer: Any) -> tuple[list[int], list[float] | None]:
        """(token ids, log-probs or None) of a plain answer or stream event."""
        try:
            (choice,) = answer["choices"]
            tokens = [int(t) for t in choice.get("token_ids") or []]
            logprobs = None
            if self.want_logprobs and tokens:
                logprobs = [float(lp) for lp in choice["logprobs"]["token_logprobs"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise TargetError(f"unexpected plain answer from vLLM: {answer!r:.300}") from exc
        return tokens, logprobs

    async def aclose(self) -> None:
        return None  # the pooled client belongs to the target


def _node_paths(tree: DraftTree) -> list[list[int]]:
    """[num_nodes + 1] drafted tokens from the root (excluded) down to each node."""
    paths: list[list[int]] = [[]]
    for node_idx in range(1, tree.num_nodes + 1):
        # Parents precede children (DraftTree's order), so the parent's path exists.
        paths.append(paths[int(tree.parents[node_idx])] + [int(tree.token_ids[node_idx])])
    return paths


def _parse_choices(
    answer: Any, prompts: list[list[int]], want_logprobs: bool, prompt_logprobs: bool
) -> list[_Choice]:
    try:
        raw_choices = answer["choices"]
        if len(raw_choices) != len(prompts):
            raise TargetError(
                f"vLLM returned {len(raw_choices)} choices for {len(prompts)} prompts"
            )
        choices: list[_Choice | None] = [None] * len(prompts)
        for raw in raw_choices:
            prompt_idx = raw["index"]
            if not isinstance(prompt_idx, int) or not 0 <= prompt_idx < len(prompts):
                raise TargetError(f"vLLM returned choice index {prompt_idx!r} out of range")
            if choices[prompt_idx] is not None:
                raise TargetError(f"vLLM returned choice index {prompt_idx} twice")
            token_ids = raw["token_ids"]
            if not isinstance(token_ids, list) or len(token_ids) != 1:
                raise TargetError(
                    f"vLLM returned token_ids {token_ids!r} for a max_tokens=1 prompt"
                )
            logprob = None
            if want_logprobs:
                logprob = float(raw["logprobs"]["token_logprobs"][0])
            prompt_argmax = None
            if prompt_logprobs:
                prompt_argmax = _prompt_argmax(raw["prompt_logprobs"], prompts[prompt_idx])
            choices[prompt_idx] = _Choice(int(token_ids[0]), logprob, prompt_argmax)
    except TargetError:
        raise
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise TargetError(
            f"unexpected /v1/completions answer ({type(exc).__name__}: {exc}): {answer!r:.300}"
        ) from exc
    return [choice for choice in choices if choice is not None]


def _prompt_argmax(entries: list[Any], prompt: list[int]) -> list[int]:
    """[len(prompt)]: at position p the argmax after prompt[:p] ([0] is -1: no prefix).

    With prompt_logprobs=1 vLLM returns, per position, the actual prompt token and the
    top-1 token, each with its rank (1 = best). The actual token may be ranked 1 too
    (it is the argmax, or tied with it); we take the rank-1 entry that is not the
    prompt token when there is one, which is the one vLLM's top-k picked.
    """
    if len(entries) != len(prompt):
        raise TargetError(f"vLLM returned {len(entries)} prompt logprobs for {len(prompt)} tokens")
    argmax = [-1]
    for position in range(1, len(prompt)):
        best = [int(token) for token, info in entries[position].items() if info["rank"] == 1]
        if not best:
            raise TargetError(f"no rank-1 token in prompt logprobs at position {position}")
        others = [token for token in best if token != prompt[position]]
        argmax.append(others[0] if others else best[0])
    return argmax
