"""Several vLLM replicas of one model behind one `Target` (proxy mode with more than
one --target-url).

Routing: a request is pinned, at `start`, to one replica, and every call of it
(verification rounds, plain streams) goes there, so each round reads the context the
previous one left in that replica's prefix cache. The replica is chosen by prefix
affinity: rendezvous hashing of the prompt's first `affinity_tokens` tokens over the
admitted replicas (requests that share those tokens -- a system prompt, a repository
-- rank the replicas alike and meet on the first), bounded by load: a replica takes
a new request only while it holds fewer than LOAD_FACTOR x the mean in-flight
requests (counting the new one); past that, the next in the request's ranking does.

Health: every HEALTH_INTERVAL_S each replica's /health is asked; EJECT_AFTER
consecutive failures (checks or calls that failed after their own retries) eject it,
and a passing check re-admits it once it still serves the model.

Failover (docs/SCALE_OUT.md): verification is stateless (every call carries the whole
context), so a round that fails on its replica is sent again to the next admitted
replica of the request's ranking; a plain stream that breaks ends, the decoding loop
goes on from the committed tokens with a round, and that round moves. What cannot move
without changing the output -- a seeded request's plain stream, which vLLM draws in
one call from the client's seed -- moves only before its first token; after it the
request fails (`PlainStreamLost`, as with one upstream). When no replica is left, the
last failure is the request's (502 / 504, or mid-stream an error event). The policy's
estimates follow a moved request to its new replica (`Policy.request`'s `replica`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import math
from collections import Counter
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence, TypeVar

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from proxy.backend.base import (
    SessionOptions,
    TargetCounters,
    TargetError,
    Verification,
)
from proxy.backend.vllm import STRATEGIES, VLLMSession, VLLMTarget
from proxy.tree import DraftTree, WalkResult

# A replica takes a new request while its in-flight requests stay under this many times
# the mean over the admitted replicas (bounded-load consistent hashing, Mirrokni et al.
# 2018): 1.25 keeps every replica within 25% of the mean, and spills a shared prefix only
# when its replica is clearly busier than the rest.
LOAD_FACTOR = 1.25
# Seconds between two health checks of a replica: an ejection or a re-admission shows
# within a few of them.
HEALTH_INTERVAL_S = 1.0
# Consecutive failures that eject a replica: one failed call may be a request's bad
# luck (a connection reset); three in a row, each after its own retries, are not.
EJECT_AFTER = 3
# A replica's /metrics (prefix-cache counters) is read every this many health checks.
METRICS_EVERY = 5
# Ids decoded by the start-up check of the replicas' tokenizers (every vocabulary has
# them), besides the tokens of the probe text.
NUM_PROBE_IDS = 256
PREFIX_HITS = "vllm:prefix_cache_hits_total"
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
T = TypeVar("T")

logger = logging.getLogger("ddtree_proxy.replicas")


def affinity_key(prompt_ids: Sequence[int], affinity_tokens: int) -> bytes:
    """The bytes a request is routed by: its first `affinity_tokens` token ids."""
    return np.asarray(prompt_ids[:affinity_tokens], dtype="<i8").tobytes()


def rendezvous_order(key: bytes, names: Sequence[str]) -> list[int]:
    """Indices of `names` from the highest rendezvous score for `key` to the lowest.
    Each (key, name) pair scores independently, so removing a name moves only the keys
    it ranked first."""

    def score(name: str) -> int:
        digest = hashlib.blake2b(key, digest_size=8, person=b"ddtree-rdv", key=name.encode()[:64])
        return int.from_bytes(digest.digest(), "big")

    return sorted(range(len(names)), key=lambda idx: score(names[idx]), reverse=True)


def pick(order: Sequence[int], in_flight: Sequence[int], load_factor: float = LOAD_FACTOR) -> int:
    """The first index of `order` whose in-flight requests are under the load bound
    ceil(load_factor * (total + 1) / len(order)), the new request counted; some always is."""
    total = sum(in_flight[idx] for idx in order)
    bound = math.ceil(load_factor * (total + 1) / len(order))
    return next(idx for idx in order if in_flight[idx] < bound)


def movable(exc: TargetError) -> bool:
    """Is `exc` the replica's trouble, so that another replica may do better: the call
    did not complete, or the server answered 429/5xx (`TargetError.retriable`)? An
    answer that does not fit the request is the request's or the proxy's, anywhere."""
    return exc.retriable and exc.kind != "malformed"


@dataclass
class Replica:
    """One upstream vLLM server and what the proxy knows about it."""

    target: VLLMTarget
    admitted: bool = True  # False while ejected: it gets no new requests
    failures: int = 0  # consecutive failures (calls and health checks)
    in_flight: int = 0  # requests on it now: pinned, and relayed ones until their answer ends
    requests: int = 0  # requests ever sent to it (relayed ones and moves included)
    errors: int = 0  # failed calls and failed health checks
    ejections: int = 0
    readmissions: int = 0
    # vLLM's own prefix-cache counters, as last read from its /metrics (None: not read)
    prefix_cache: tuple[float, float] | None = None  # (hits, queries), tokens
    error: str | None = None  # the latest failure, for /health

    @property
    def url(self) -> str:
        return self.target.http.base_url

    def status(self) -> dict[str, Any]:
        hits_queries = self.prefix_cache
        return {
            "url": self.url,
            "status": "ok" if self.admitted else "ejected",
            "in_flight": self.in_flight,
            "requests": self.requests,
            "calls": dict(self.target.http.num_calls),
            "errors": self.errors,
            "ejections": self.ejections,
            "readmissions": self.readmissions,
            "prefix_cache_hit_ratio": (
                hits_queries[0] / hits_queries[1]
                if hits_queries is not None and hits_queries[1] > 0
                else None
            ),
            **({"error": self.error} if self.error is not None else {}),
        }


class ReplicaSet:
    """A `Target` over several vLLM replicas serving one model (see the module doc).
    Build it with `await ReplicaSet.connect(urls, ...)`."""

    label = "proxy"
    strategies = STRATEGIES

    def __init__(self, targets: Sequence[VLLMTarget], affinity_tokens: int) -> None:
        if len(targets) < 2:
            raise ValueError("a replica set needs at least two replicas")
        first = targets[0]
        self.replicas = [Replica(target) for target in targets]
        self.name = first.name
        self.root = first.root
        self.max_model_len = first.max_model_len
        self.eos_token_ids = first.eos_token_ids
        self.affinity_tokens = affinity_tokens
        self.http = ReplicaHttp(self)
        self._names = [replica.url for replica in self.replicas]
        self._checks: asyncio.Task[None] | None = None

    @classmethod
    async def connect(
        cls,
        urls: Sequence[str],
        model: str | None,
        *,
        affinity_tokens: int,
        probe_text: str,
        **options: Any,
    ) -> ReplicaSet:
        """Connect to every replica (`VLLMTarget.connect` with `options`), check that
        they serve the same model alike (`check_alike` with `probe_text`), and start the
        health checks."""
        targets: list[VLLMTarget] = []
        try:
            first = await VLLMTarget.connect(urls[0], model, **options)
            targets.append(first)
            for url in urls[1:]:
                try:
                    targets.append(
                        await VLLMTarget.connect(
                            url, first.name, eos_token_ids=first.eos_token_ids, **options
                        )
                    )
                except ValueError as exc:
                    raise ValueError(
                        f"replica {url} does not serve {urls[0]}'s model {first.name!r}: {exc}"
                    ) from exc
            replicas = cls(targets, affinity_tokens)
            await replicas.check_alike(probe_text)
        except BaseException:
            for target in targets:
                await target.aclose()
            raise
        replicas._checks = asyncio.create_task(replicas._check_forever())
        return replicas

    async def check_alike(self, probe_text: str) -> None:
        """ValueError naming the first replica that differs from the first one in its
        context length or its tokenizer (`_fingerprint`)."""
        fingerprints = [await _fingerprint(r.target, probe_text) for r in self.replicas]
        first = self.replicas[0]
        for replica, fingerprint in zip(self.replicas[1:], fingerprints[1:], strict=True):
            if replica.target.max_model_len != self.max_model_len:
                raise ValueError(
                    f"replica {replica.url} serves {self.name!r} with max_model_len "
                    f"{replica.target.max_model_len}, {first.url} with {self.max_model_len}: "
                    "every replica must serve the same model alike"
                )
            if fingerprint != fingerprints[0]:
                raise ValueError(
                    f"replica {replica.url} tokenizes differently from {first.url} "
                    f"(same served name {self.name!r}, another tokenizer or model): every "
                    "replica must serve the same model"
                )

    # ----- routing ----------------------------------------------------------------

    def choose(self, key: bytes, tried: frozenset[str] = frozenset()) -> Replica | None:
        """The replica for a request routed by `key` (`affinity_key`), skipping the
        replicas in `tried`: the admitted ones first; when none is admitted, the
        others (their health check may lag, and a refused call costs little). None when
        every replica has been tried."""
        order = rendezvous_order(key, self._names)
        for admitted in (True, False):
            candidates = [
                idx
                for idx in order
                if self.replicas[idx].admitted == admitted and self._names[idx] not in tried
            ]
            if candidates:
                in_flight = [replica.in_flight for replica in self.replicas]
                return self.replicas[pick(candidates, in_flight)]
        return None

    def succeeded(self, replica: Replica) -> None:
        replica.failures = 0

    def failed(self, replica: Replica, reason: str) -> None:
        """Count a failure of `replica`; eject it after EJECT_AFTER in a row."""
        replica.failures += 1
        replica.errors += 1
        replica.error = reason
        if replica.admitted and replica.failures >= EJECT_AFTER:
            replica.admitted = False
            replica.ejections += 1
            logger.warning("replica %s ejected after %d failures: %s", replica.url,
                           replica.failures, reason)  # fmt: skip

    async def check(self, replica: Replica, read_metrics: bool) -> None:
        """One health check: /health (and with `read_metrics`, vLLM's prefix-cache
        counters); an ejected replica that passes and still serves the model is
        re-admitted."""
        healthy, details = await replica.target.health()
        if not healthy:
            self.failed(replica, str(details.get("error") or f"/health: {details}"))
            return
        if not replica.admitted:
            try:
                served = await replica.target.http.served_models()
            except TargetError as exc:
                self.failed(replica, str(exc))
                return
            if self.name not in served:
                self.failed(replica, f"no longer serves {self.name!r}: {list(served)}")
                return
            replica.admitted = True
            replica.readmissions += 1
            logger.warning("replica %s re-admitted", replica.url)
        replica.failures = 0
        replica.error = None
        if read_metrics:
            # A /metrics that fails or does not parse leaves the last reading.
            with contextlib.suppress(TargetError, ValueError):
                replica.prefix_cache = await _prefix_cache(replica.target)

    async def _check_forever(self) -> None:
        num_checks = 0
        while True:
            await asyncio.sleep(HEALTH_INTERVAL_S)
            read_metrics = num_checks % METRICS_EVERY == 0
            checks = [self.check(replica, read_metrics) for replica in self.replicas]
            for outcome in await asyncio.gather(*checks, return_exceptions=True):
                if isinstance(outcome, Exception):  # a bug: logged, the checks go on
                    logger.error("replica health check failed", exc_info=outcome)
            num_checks += 1

    # ----- the Target protocol ----------------------------------------------------

    def check_options(self, options: SessionOptions) -> None:
        self.replicas[0].target.check_options(options)

    async def start(self, prompt_ids: Sequence[int], options: SessionOptions) -> ReplicaSession:
        self.check_options(options)
        return ReplicaSession(self, affinity_key(prompt_ids, self.affinity_tokens), options)

    async def health(self) -> tuple[bool, dict[str, Any]]:
        """Healthy while one replica is admitted; each replica's state."""
        statuses = [replica.status() for replica in self.replicas]
        return any(replica.admitted for replica in self.replicas), {"replicas": statuses}

    async def aclose(self) -> None:
        if self._checks is not None:
            self._checks.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._checks
            self._checks = None
        for replica in self.replicas:
            await replica.target.aclose()


class ReplicaSession:
    """One request's calls, all to its pinned replica until that replica fails.
    `replica` names it (the policy keeps estimates per replica)."""

    def __init__(self, replicas: ReplicaSet, key: bytes, options: SessionOptions) -> None:
        self.replicas = replicas
        self.options = options
        self.counters = TargetCounters()
        self.prompt_features = None
        self._key = key
        self._tried: set[str] = set()
        self._pinned: Replica | None = None
        self._inner: VLLMSession | None = None
        self._pin(replicas.choose(key))  # some replica: none is tried yet

    @property
    def replica(self) -> str | None:
        return None if self._pinned is None else self._pinned.url

    def _pin(self, replica: Replica | None) -> None:
        if self._pinned is not None:
            self._pinned.in_flight -= 1
        self._pinned = replica
        if replica is None:
            self._inner = None
            return
        replica.in_flight += 1
        replica.requests += 1
        self._inner = VLLMSession(replica.target, self.options)
        self._inner.counters = self.counters  # one request's counts, wherever it runs

    def _move(self, exc: TargetError) -> None:
        """After `exc` on the pinned replica: count it and pin the next replica of the
        request's ranking not yet tried; with none left, stay and raise `exc`."""
        failed = self._current()[0]
        self.replicas.failed(failed, str(exc))
        self._tried.add(failed.url)
        replica = self.replicas.choose(self._key, frozenset(self._tried))
        if replica is None:
            raise exc
        self._pin(replica)
        logger.info("request moved from replica %s to %s: %s", failed.url, replica.url, exc)

    def _current(self) -> tuple[Replica, VLLMSession]:
        assert self._pinned is not None and self._inner is not None, "session closed"
        return self._pinned, self._inner

    async def verify(self, committed: Sequence[int], tree: DraftTree) -> Verification:
        while True:
            replica, inner = self._current()
            try:
                verification = await inner.verify(committed, tree)
            except TargetError as exc:
                if not movable(exc):
                    raise
                self._move(exc)
                continue
            self.replicas.succeeded(replica)
            return verification

    async def accept(self, tree: DraftTree, result: WalkResult) -> None:
        return None  # no features over HTTP; the replica's prefix cache keeps the context

    async def plain(
        self, committed: Sequence[int], max_tokens: int, stream: bool = True
    ) -> AsyncIterator[tuple[list[int], list[float] | None]]:
        """The pinned replica's plain generation (`VLLMSession.plain`). A call that fails
        before its first tokens moves to the next replica; one that breaks after them
        ends (the decoding loop goes on with a round, which moves), and a seeded
        request's fails the request (`PlainStreamLost`, raised by `VLLMSession.plain`)."""
        while True:
            replica, inner = self._current()
            started = False
            try:
                # Closed with this generator: vLLM aborts a stream whose connection closes.
                events = inner.plain(committed, max_tokens, stream)
                async with contextlib.aclosing(events):
                    async for tokens, logprobs in events:
                        started = True
                        yield tokens, logprobs
            except TargetError as exc:
                if not movable(exc):
                    raise
                if not started:
                    self._move(exc)
                    continue
                self._move_or_keep(exc)
                raise
            self.replicas.succeeded(replica)
            return

    async def relay(self, path: str, body: bytes, headers: dict[str, str]) -> httpx.Response:
        """The pinned replica's `VLLMSession.relay`. A relay that fails is not moved:
        the decoding loop goes on without it, and its calls move."""
        return await self._current()[1].relay(path, body, headers)

    def _move_or_keep(self, exc: TargetError) -> None:
        """`_move`, but with no replica left the request stays: the round that follows
        gets its own failure."""
        with contextlib.suppress(TargetError):
            self._move(exc)

    async def aclose(self) -> None:
        self._pin(None)


class ReplicaHttp:
    """What the server and the tokenizer call on "the upstream" when it is several
    replicas: auxiliary JSON calls (/tokenize, /detokenize, /v1/models) to the
    least-loaded admitted replica, moving to the next on a failure; relayed requests
    (pass-through, other routes) routed by their prompt like a served request, moved
    only while nothing has come back (`open_stream`)."""

    def __init__(self, replicas: ReplicaSet) -> None:
        self.replicas = replicas
        self.num_calls: Counter[str] = Counter()
        self._on_retry: Callable[[str], None] | None = None

    @property
    def on_retry(self) -> Callable[[str], None] | None:
        return self._on_retry

    @on_retry.setter
    def on_retry(self, callback: Callable[[str], None] | None) -> None:
        self._on_retry = callback
        for replica in self.replicas.replicas:
            replica.target.http.on_retry = callback

    def _least_loaded(self, tried: set[str]) -> Replica | None:
        candidates = [r for r in self.replicas.replicas if r.url not in tried]
        if not candidates:
            return None
        return min(candidates, key=lambda r: (not r.admitted, r.in_flight, r.url))

    async def request_json(
        self, method: str, path: str, body: Any = None, *, retry: bool = True
    ) -> Any:
        self.num_calls[path] += 1
        _, answer = await self._on_one_replica(
            self._least_loaded,
            lambda replica: replica.target.http.request_json(method, path, body, retry=retry),
        )
        return answer

    async def open_stream(
        self, method: str, path: str, content: bytes | None, headers: dict[str, str]
    ) -> httpx.Response:
        """`VLLMHttp.open_stream` on the replica the body's prompt routes to; a call
        that fails before any answer moves to the next replica. The request counts in
        its replica's in-flight requests (the load bound) until the response closes."""
        key = _relay_key(content, self.replicas.affinity_tokens)
        replica, response = await self._on_one_replica(
            lambda tried: self.replicas.choose(key, frozenset(tried)),
            lambda replica: replica.target.http.open_stream(method, path, content, headers),
        )
        replica.in_flight += 1
        replica.requests += 1
        response.stream = _HeldStream(response.stream, replica)
        return response

    async def _on_one_replica(
        self,
        pick: Callable[[set[str]], Replica | None],
        call: Callable[[Replica], Awaitable[T]],
    ) -> tuple[Replica, T]:
        """`call` on the replica `pick` names, then on the next one `pick` names with the
        tried ones left out, while the failure is the replica's (`movable`); the last
        failure is raised once every replica was tried. The replica that answered, and
        its answer."""
        tried: set[str] = set()
        while True:
            replica = pick(tried)
            assert replica is not None
            try:
                answer = await call(replica)
            except TargetError as exc:
                if not movable(exc):
                    raise
                self.replicas.failed(replica, str(exc))
                tried.add(replica.url)
                if len(tried) == len(self.replicas.replicas):
                    raise
                continue
            self.replicas.succeeded(replica)
            return replica, answer


class _HeldStream(httpx.AsyncByteStream):
    """A relayed response's body that holds one in-flight request on `replica` until
    it is closed (read to its end, or closed early: `httpx.Response.aclose`)."""

    def __init__(self, stream: httpx.AsyncByteStream, replica: Replica) -> None:
        self._stream = stream
        self._replica: Replica | None = replica

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._stream:
            yield chunk

    async def aclose(self) -> None:
        try:
            await self._stream.aclose()
        finally:
            if self._replica is not None:
                self._replica.in_flight -= 1
                self._replica = None


def _relay_key(content: bytes | None, affinity_tokens: int) -> bytes:
    """A relayed body's routing key: its prompt or messages, as JSON, cut to about
    `affinity_tokens` tokens' worth of bytes (4 bytes a token); empty without one."""
    try:
        body = json.loads(content or b"")
    except (json.JSONDecodeError, UnicodeDecodeError):
        return b""
    if not isinstance(body, dict):
        return b""
    prompt = body.get("prompt", body.get("messages"))
    return b"" if prompt is None else json.dumps(prompt).encode()[: 4 * affinity_tokens]


async def _fingerprint(target: VLLMTarget, probe_text: str) -> tuple[list[int], str]:
    """How a server tokenizes: its /tokenize of `probe_text` (special tokens added) and
    its /detokenize of the first NUM_PROBE_IDS ids and of that tokenization."""
    http = target.http
    body = {"model": target.name, "prompt": probe_text, "add_special_tokens": True}
    encoded = await http.request_json("POST", "/tokenize", body)
    try:
        tokens = [int(token) for token in encoded["tokens"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise TargetError(f"unexpected /tokenize answer from {http.base_url}: {exc}") from exc
    ids = list(range(NUM_PROBE_IDS)) + tokens
    decoded = await http.request_json("POST", "/detokenize", {"model": target.name, "tokens": ids})
    if not isinstance(decoded, dict) or not isinstance(decoded.get("prompt"), str):
        raise TargetError(f"unexpected /detokenize answer from {http.base_url}: {decoded!r:.200}")
    return tokens, decoded["prompt"]


async def _prefix_cache(target: VLLMTarget) -> tuple[float, float] | None:
    """vLLM's prefix-cache (hits, queries) in tokens from its /metrics; None when it
    exports neither counter."""
    http = target.http
    try:
        response = await http.client.get("/metrics", timeout=2.0)
    except httpx.HTTPError as exc:
        raise TargetError(f"{http.base_url}/metrics: {exc}", "network") from exc
    if response.status_code != 200:
        return None
    totals = {PREFIX_HITS: 0.0, PREFIX_QUERIES: 0.0}
    found = False
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += float(sample.value)
                found = True
    return (totals[PREFIX_HITS], totals[PREFIX_QUERIES]) if found else None
