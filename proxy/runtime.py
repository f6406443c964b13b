"""The composition root: everything a generation needs, built once from settings, for
the CLI, the server and the benchmarks alike.

Engine mode (no `target_url`): the local Transformers target, its tokenizer, the
drafter (the shipped dflash by default). Proxy mode: a vLLM server over HTTP, text
through the model's tokenizer.json on this host (`proxy.model_files` finds it; chat
prompts are still rendered by vLLM's /tokenize), or, with no tokenizer file here,
through vLLM's /tokenize and /detokenize; and a drafter that needs no target hidden
states (ngram by default, autoregressive, or `vllm:URL`, a draft model on a second vLLM
server). torch and transformers are imported only on the paths that need them, so
proxy mode with ngram runs on a plain `pip install`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Literal

import httpx

from proxy.adaptive.policy import Policy
from proxy.backend.base import Target, TargetError
from proxy.backend.replicas import ReplicaHttp, ReplicaSet
from proxy.backend.vllm import RetryPolicy, UnknownEOSError, VLLMHttp, VLLMTarget
from proxy.backend.vllm_tokens import VLLMTokens
from proxy.drafter import load_drafter, parse_drafter_spec
from proxy.drafter.base import Drafter, TargetInfo
from proxy.generation_defaults import GenerationDefaults, load_generation_defaults
from proxy.model_files import ModelFiles, find_model_files
from proxy.output import Detokenize
from proxy.settings import RuntimeSettings
from proxy.tokens import LocalTokens, TokenizerFile, Tokens

if TYPE_CHECKING:
    import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
# The embedded default: the shipped tiny family (see models/pycoder/MODEL_CARD.md).
DEFAULT_TARGET_DIR = REPO_ROOT / "models" / "pycoder" / "target"
DEFAULT_DRAFTER = f"dflash:{REPO_ROOT / 'models' / 'pycoder' / 'dflash'}"
PROXY_DEFAULT_DRAFTER = "ngram"
ENGINE_EXTRA_HINT = "install the engine extra: pip install 'ddtree-proxy[engine]'"
# The start-up check of a local tokenizer against the server's: this many ids spread
# over the vocabulary (decoded as one sequence), and a text of code, non-ASCII letters,
# whitespace runs and the added tokens (tokenized with special tokens added).
NUM_PROBE_IDS = 2048
PROBE_TEXT = (
    'def f(x):\n\treturn x  # \u00e9t\u00e9, \u4e2d\u6587, \u2603\n\n   end. "ok" n\'t 1,2,3'
)

logger = logging.getLogger("ddtree_proxy.runtime")

Mode = Literal["engine", "proxy"]


@dataclass
class Runtime:
    """A target, a drafter, and tokenization that matches the target."""

    target: Target
    drafter: Drafter | None
    tokens: Tokens
    model_name: str
    vocab_size: int | None  # None when unknown (remote tokenizer, no local config)
    # What the server applies to fields a request leaves unset (engine mode: the
    # target's temperature, top_p, top_k and max_new_tokens, applied by the proxy).
    generation_defaults: GenerationDefaults = field(default_factory=GenerationDefaults)
    # Proxy mode's vLLM server (or its replicas); None in engine mode (see `mode`,
    # `upstream`).
    upstream_http: VLLMHttp | ReplicaHttp | None = None
    replicas: ReplicaSet | None = None  # several upstream replicas, for /metrics
    # Where output text comes from, for the start-up log.
    text_source: str = "the target's tokenizer, in-process"
    # Text is decoded by the server, one HTTP call per decode (no tokenizer file here).
    remote_text: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    # The adaptive policy: what it learns while serving (costs, drafter calibration).
    policy: Policy = field(default_factory=Policy)
    restore_torch_threads: int | None = None  # torch's thread count before we set ours
    trace: TraceFile | None = None  # where the policy's decisions go (--policy-trace)
    # Proxy mode: loads another drafter for this target (shadow replays); the caller
    # closes it. None in engine mode.
    load_drafter: Callable[[str], Awaitable[Drafter]] | None = None

    @property
    def mode(self) -> Mode:
        """proxy: the target is a vLLM server, which also answers what DDTree does not
        serve (`upstream`); engine: the target runs in this process, nothing behind it."""
        return "engine" if self.upstream_http is None else "proxy"

    @property
    def upstream(self) -> VLLMHttp | ReplicaHttp:
        """Proxy mode's vLLM server, where requests DDTree does not serve go unchanged."""
        if self.upstream_http is None:
            raise RuntimeError("engine mode has no upstream server")
        return self.upstream_http

    @property
    def max_model_len(self) -> int:
        return self.target.max_model_len

    def detokenizer(self, skip_special_tokens: bool = True) -> Detokenize:
        async def detokenize(token_ids: list[int]) -> str:
            return await self.tokens.decode(token_ids, skip_special_tokens)

        return detokenize

    async def health(self) -> tuple[bool, dict[str, Any]]:
        healthy, details = await self.target.health()
        body: dict[str, Any] = {"status": "ok" if healthy else "unhealthy"}
        body["mode"] = self.target.label
        if details:
            body["upstream"] = details
        drafter = await self.drafter.health() if self.drafter is not None else None
        if drafter is not None:
            # A draft server's trouble degrades speed, never correctness: reported here,
            # but the proxy stays healthy while its target is.
            body["drafter"] = drafter
        return healthy, body

    async def aclose(self) -> None:
        await self.target.aclose()
        if self.drafter is not None:
            await self.drafter.aclose()
        if self.trace is not None:
            self.trace.close()
            self.trace = None
        if self.restore_torch_threads is not None:
            _torch().set_num_threads(self.restore_torch_threads)
            self.restore_torch_threads = None


class TraceFile:
    """JSON lines appended to a file, one per record, flushed as they come (a trace can
    be read while the server runs)."""

    def __init__(self, path: Path) -> None:
        try:
            self._file = path.open("a", encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"cannot write the policy trace {path}: {exc}") from exc

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, default=float) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _torch():
    try:
        import torch
    except ImportError as exc:
        raise ValueError(f"this configuration needs torch: {ENGINE_EXTRA_HINT}") from exc
    return torch


async def build_runtime(
    settings: RuntimeSettings, transport: httpx.AsyncBaseTransport | None = None
) -> Runtime:
    """Load models / connect upstream. `transport`: the upstream's HTTP transport (tests
    inject a mock; None = the network)."""
    if settings.proxy_mode:
        runtime = await _build_proxy(settings, transport)
    else:
        runtime = await asyncio.to_thread(_build_engine, settings)
    runtime.policy = Policy(half_life_s=settings.policy_half_life)
    if settings.policy_trace is not None:
        runtime.trace = TraceFile(Path(settings.policy_trace))
        runtime.policy.trace = runtime.trace.write
    threads = settings.torch_threads or (1 if settings.proxy_mode else None)
    # Only in-process models use torch; a proxy with the ngram drafter never imports it.
    if threads is not None and "torch" in sys.modules:
        torch = _torch()
        runtime.restore_torch_threads = torch.get_num_threads()
        torch.set_num_threads(threads)  # process-wide; put back by aclose()
    return runtime


def target_info(config: Any, model_dir: Path | None, model: torch.nn.Module | None) -> TargetInfo:
    return TargetInfo(
        vocab_size=int(config.vocab_size),
        num_hidden_layers=int(config.num_hidden_layers),
        hidden_size=int(config.hidden_size),
        model_dir=model_dir,
        model=model,
    )


def load_engine(
    target_dir: str | Path,
    drafter_spec: str | None,
    device: str | None = None,
    dtype: str | None = None,
) -> Runtime:
    """Engine mode from a model directory and a drafter spec (None: no drafter).

    device: auto (default: CUDA when present, else CPU), cpu, cuda, cuda:N; dtype: auto
    (default: bfloat16 on CUDA, float32 on CPU), float32, bfloat16, float16. Model
    drafters run on the target's device in its dtype."""
    try:
        from transformers import AutoTokenizer

        from proxy.backend.engine.local import LocalTarget
    except ImportError as exc:
        raise ValueError(f"engine mode needs torch and transformers: {ENGINE_EXTRA_HINT}") from exc
    target_dir = Path(target_dir)
    if drafter_spec:
        parse_drafter_spec(drafter_spec)  # an unknown name fails before any model loads
    target = LocalTarget.from_dir(target_dir, dtype=dtype, device=device)
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    drafter = None
    if drafter_spec:
        drafter = load_drafter(
            drafter_spec, target_info(target.model.config, target_dir, target.model)
        )
    return Runtime(
        target=target,
        drafter=drafter,
        tokens=LocalTokens(tokenizer),
        model_name=target.name,
        vocab_size=int(target.model.config.vocab_size),
        generation_defaults=engine_defaults(target_dir),
    )


def _build_engine(settings: RuntimeSettings) -> Runtime:
    if settings.tokenizer is not None:
        raise ValueError("--tokenizer is for proxy mode; engine mode uses the target's own")
    if settings.strategy is not None:
        raise ValueError("--strategy is for proxy mode (it says how vLLM verifies a tree)")
    if settings.generation_config != "auto":
        raise ValueError("--generation-config is for proxy mode (it mirrors vLLM's flag)")
    target_dir = Path(settings.target or DEFAULT_TARGET_DIR)
    drafter_spec = None if settings.tree.kind == "none" else settings.drafter or DEFAULT_DRAFTER
    if drafter_spec and parse_drafter_spec(drafter_spec)[0] == "vllm":
        raise ValueError("the vllm drafter is for proxy mode (serve with --target-url)")
    runtime = load_engine(target_dir, drafter_spec, settings.device, settings.dtype)
    runtime.model_name = settings.model or runtime.model_name
    return runtime


def _check_proxy_drafter(spec: str) -> None:
    name, _ = parse_drafter_spec(spec)
    if name == "dflash":
        raise ValueError(
            "the dflash drafter needs the target's hidden states, which a vLLM server does "
            "not expose over HTTP; use --drafter ngram, autoregressive:PATH or vllm:URL in "
            "proxy mode, or engine mode (serve without --target-url) for dflash"
        )


async def _build_proxy(
    settings: RuntimeSettings, transport: httpx.AsyncBaseTransport | None
) -> Runtime:
    assert settings.target_url is not None
    if settings.target is not None:
        raise ValueError("--target is for engine mode; in proxy mode the model is the upstream's")
    drafter_spec = settings.drafter or PROXY_DEFAULT_DRAFTER
    if settings.tree.kind != "none":
        _check_proxy_drafter(drafter_spec)
    find_model_files(None, settings.tokenizer)  # a --tokenizer without tokenizer.json fails first
    connection = dict(
        model_dir=settings.tokenizer,
        api_key=settings.upstream_api_key,
        connect_timeout=settings.connect_timeout,
        read_timeout=settings.read_timeout,
        retry=RetryPolicy(
            max_retries=settings.max_retries,
            backoff_s=settings.retry_backoff,
            max_backoff_s=settings.max_retry_backoff,
        ),
        transport=transport,
    )
    urls = settings.target_urls
    target: VLLMTarget | ReplicaSet
    try:
        if len(urls) == 1:
            target = await VLLMTarget.connect(urls[0], settings.model, **connection)
        else:
            target = await ReplicaSet.connect(
                urls,
                settings.model,
                affinity_tokens=settings.affinity_tokens,
                probe_text=PROBE_TEXT,
                **connection,
            )
    except UnknownEOSError as exc:
        raise ValueError(
            f"cannot tell the served model's EOS tokens: pass --tokenizer DIR (a local "
            f"copy of the model's tokenizer and config) ({exc})"
        ) from exc
    replicas = target.replicas if isinstance(target, ReplicaSet) else []
    for upstream in [replica.target for replica in replicas] or [target]:
        upstream.session_header = settings.session_header  # a router in front: its key
    drafter: Drafter | None = None
    try:
        files = find_model_files(target.root, settings.tokenizer)
        model_dir = files.model_dir or files.tokenizer_dir
        config = _read_config(model_dir)
        remote = VLLMTokens.of(target, files.tokenizer_dir)
        vocab_size = int(config["vocab_size"]) if "vocab_size" in config else None
        tokens, text_source = await _text_source(files, remote, vocab_size)
        info = TargetInfo(
            # Without a local config the bounds are unknown: 2**31 - 1 lets any
            # drafter vocabulary through, and vLLM rejects out-of-range ids itself.
            vocab_size=vocab_size or 2**31 - 1,
            num_hidden_layers=int(config.get("num_hidden_layers", 0)),
            hidden_size=int(config.get("hidden_size", 0)),
            model_dir=model_dir,
            model=None,
        )

        async def load(spec: str) -> Drafter:
            loaded = await asyncio.to_thread(load_drafter, spec, info)
            if loaded.target_layer_ids is not None:
                await loaded.aclose()
                raise ValueError(
                    f"the {loaded.name} drafter needs target hidden states, which vLLM's "
                    "HTTP API cannot give; use engine mode for it"
                )
            await loaded.connect(remote)  # a served drafter: reach it, check its tokenizer
            return loaded

        if settings.tree.kind != "none":
            drafter = await load(drafter_spec)
        return Runtime(
            target=target,
            drafter=drafter,
            tokens=tokens,
            model_name=target.name,
            vocab_size=vocab_size,
            generation_defaults=load_generation_defaults(settings.generation_config, model_dir),
            upstream_http=target.http,
            replicas=target if isinstance(target, ReplicaSet) else None,
            text_source=text_source,
            remote_text=tokens is remote,
            load_drafter=load,
        )
    except BaseException:
        await target.aclose()
        if drafter is not None:
            await drafter.aclose()
        raise


async def _text_source(
    files: ModelFiles, server: VLLMTokens, vocab_size: int | None
) -> tuple[Tokens, str]:
    """The model's tokenizer.json in this process when there is one here, checked
    against the server's tokenizer (`check_tokenizer`); else the server's /detokenize.
    (Tokens, a line for the start-up log.)"""
    if files.tokenizer_dir is None:
        logger.warning(
            "no tokenizer.json of the served model on this host: output text comes from "
            "vLLM's /detokenize, one call per round (and per new logprobs token); pass "
            "--tokenizer DIR (the model's tokenizer files) to decode here"
        )
        return server, "vLLM's /detokenize (no tokenizer.json on this host)"
    local = await asyncio.to_thread(TokenizerFile.load, files.tokenizer_dir, server)
    where = files.found_by["tokenizer_dir"]
    try:
        same_text, same_tokens = await check_tokenizer(local, server, vocab_size)
    except TargetError as exc:
        if exc.kind != "http" or exc.retriable:
            raise  # the upstream is failing: start-up fails as on any other call
        # A server that refuses the probe itself (4xx): nothing to compare with.
        logger.warning(
            "could not check the tokenizer.json in %s against the server: %s", where, exc
        )
        same_text = same_tokens = True
    if not same_text:
        logger.warning(
            "the tokenizer.json in %s does not decode as the server does: output text "
            "comes from vLLM's /detokenize, one call per round",
            where,
        )
        return server, f"vLLM's /detokenize ({where} decodes differently)"
    if not same_tokens:
        logger.warning(
            "the tokenizer.json in %s does not tokenize as the server does: prompts go "
            "through vLLM's /tokenize (one call per request)",
            where,
        )
        local.server_encodes = True
        return local, f"tokenizer.json in {where}; prompts through vLLM's /tokenize"
    return local, f"tokenizer.json in {where}; chat prompts through vLLM's /tokenize"


async def check_tokenizer(
    local: TokenizerFile, server: Tokens, vocab_size: int | None = None
) -> tuple[bool, bool]:
    """(same text, same tokens): does the server's tokenizer decode and tokenize as
    `local` does? One /detokenize of ids spread over the vocabulary (below `vocab_size`,
    the model's, when known) and one /tokenize of PROBE_TEXT with the added tokens in it
    (Transformers rebuilds the pipeline of some model-specific tokenizer classes from
    their vocabulary, so tokenizer.json alone is not proof)."""
    limit = min(local.vocab_size, vocab_size or local.vocab_size)
    ids = list(range(0, limit, max(1, limit // NUM_PROBE_IDS)))
    added = list(local.tokenizer.get_added_tokens_decoder().items())
    ids += [token_id for token_id, _ in added if token_id < limit]
    text = PROBE_TEXT + "".join(token.content for _, token in added)
    same_text = await server.decode(ids, False) == await local.decode(ids, False)
    same_tokens = await server.encode(text, True) == await local.encode(text, True)
    return same_text, same_tokens


def _read_config(model_dir: Path | None) -> dict[str, Any]:
    if model_dir is None or not (model_dir / "config.json").is_file():
        return {}
    return json.loads((model_dir / "config.json").read_text())


def engine_defaults(target_dir: Path) -> GenerationDefaults:
    """Engine mode's defaults: the target's generation_config.json, as vLLM would read it,
    less what the in-process sampler does not implement (penalties, min_p: logged)."""
    defaults = load_generation_defaults("auto", target_dir)
    applied = ("temperature", "top_p", "top_k", "max_tokens")
    ignored = sorted(set(defaults.values) - set(applied))
    if ignored:
        logger.warning("engine mode does not apply the target's default %s", ", ".join(ignored))
    values = {name: value for name, value in defaults.values.items() if name in applied}
    return GenerationDefaults(values, source=defaults.source)
