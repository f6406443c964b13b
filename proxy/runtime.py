"""The composition root: everything a generation needs, built once from settings, for
the CLI, the server and the benchmarks alike.

Engine mode (no `target_url`): the local Transformers target, its tokenizer, the
drafter (the shipped dflash by default). Proxy mode: a vLLM server over HTTP,
tokenization through a local tokenizer (`--tokenizer`) or through vLLM's own
/tokenize and /detokenize, and a drafter that needs no target hidden states (ngram by
default, autoregressive, or `vllm:URL`, a draft model on a second vLLM server).
torch and transformers are imported only on the paths
that need them, so proxy mode with ngram runs on a plain `pip install`.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from proxy.adaptive import AdaptiveState
from proxy.backend.base import Target
from proxy.backend.vllm import RetryPolicy, VLLMHttp, VLLMTarget
from proxy.backend.vllm_tokens import VLLMTokens
from proxy.drafter import load_drafter, parse_drafter_spec
from proxy.drafter.base import Drafter, TargetInfo
from proxy.output import Detokenize
from proxy.settings import RuntimeSettings
from proxy.tokens import LocalTokens, ServerChatTemplate, Tokens

if TYPE_CHECKING:
    import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
# The embedded default: the shipped tiny family (see models/pycoder/MODEL_CARD.md).
DEFAULT_TARGET_DIR = REPO_ROOT / "models" / "pycoder" / "target"
DEFAULT_DRAFTER = f"dflash:{REPO_ROOT / 'models' / 'pycoder' / 'dflash'}"
PROXY_DEFAULT_DRAFTER = "ngram"
ENGINE_EXTRA_HINT = "install the engine extra: pip install 'ddtree-proxy[engine]'"


@dataclass
class Runtime:
    """A target, a drafter, and tokenization that matches the target."""

    target: Target
    drafter: Drafter | None
    tokens: Tokens
    model_name: str
    vocab_size: int | None  # None when unknown (remote tokenizer, no local config)
    sampling_defaults: dict[str, float | int] = field(default_factory=dict)
    # Where requests DDTree does not serve go unchanged; None: nowhere (engine mode).
    upstream: VLLMHttp | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    # What the adaptive policy learns while serving (costs, drafter calibration).
    adaptive: AdaptiveState = field(default_factory=AdaptiveState)
    restore_torch_threads: int | None = None  # torch's thread count before we set ours

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
        drafter_health = getattr(self.drafter, "health", None)
        if drafter_health is not None:
            # A draft server's trouble degrades speed, never correctness: reported here,
            # but the proxy stays healthy while its target is.
            body["drafter"] = await drafter_health()
        return healthy, body

    async def aclose(self) -> None:
        await self.target.aclose()
        drafter_close = getattr(self.drafter, "aclose", None)
        if drafter_close is not None:
            await drafter_close()
        if self.restore_torch_threads is not None:
            _torch().set_num_threads(self.restore_torch_threads)
            self.restore_torch_threads = None


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
    threads = settings.torch_threads or (1 if settings.proxy_mode else None)
    # Only in-process models use torch; a proxy with the ngram drafter never imports it.
    if threads is not None and "torch" in sys.modules:
        torch = _torch()
        runtime.restore_torch_threads = torch.get_num_threads()
        torch.set_num_threads(threads)  # process-wide; put back by aclose()
    return runtime


def target_info(
    config: Any, model_dir: Path | None, model: torch.nn.Module | None
) -> TargetInfo:
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
        drafter = load_drafter(drafter_spec, target_info(target.model.config, target_dir, target.model))
    return Runtime(
        target=target,
        drafter=drafter,
        tokens=LocalTokens(tokenizer),
        model_name=target.name,
        vocab_size=int(target.model.config.vocab_size),
        sampling_defaults=sampling_defaults(target_dir),
    )


def _build_engine(settings: RuntimeSettings) -> Runtime:
    if settings.tokenizer is not None:
        raise ValueError("--tokenizer is for proxy mode; engine mode uses the target's own")
    if settings.strategy is not None:
        raise ValueError("--strategy is for proxy mode (it says how vLLM verifies a tree)")
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
    tokenizer_dir = Path(settings.tokenizer) if settings.tokenizer else None
    if tokenizer_dir is not None and not (tokenizer_dir / "tokenizer_config.json").is_file():
        raise FileNotFoundError(
            f"tokenizer directory {tokenizer_dir} not found (no tokenizer_config.json)"
        )
    try:
        target = await VLLMTarget.connect(
            settings.target_url,
            settings.model,
            model_dir=tokenizer_dir,
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
    except ValueError as exc:
        if "eos_token_ids" in str(exc):
            raise ValueError(
                f"cannot tell the served model's EOS tokens: pass --tokenizer DIR (a local "
                f"copy of the model's tokenizer and config) ({exc})"
            ) from exc
        raise
    drafter: Drafter | None = None
    try:
        model_dir = tokenizer_dir or _local_model_root(target)
        config = _read_config(model_dir)
        remote = VLLMTokens.of(target, model_dir)
        tokens: Tokens = remote
        if tokenizer_dir is not None:
            try:
                from transformers import AutoTokenizer
            except ImportError as exc:
                raise ValueError(f"--tokenizer needs transformers: {ENGINE_EXTRA_HINT}") from exc
            local = await asyncio.to_thread(AutoTokenizer.from_pretrained, str(tokenizer_dir))
            tokens = ServerChatTemplate(local, remote)
        vocab_size = int(config["vocab_size"]) if "vocab_size" in config else None
        if settings.tree.kind != "none":
            info = TargetInfo(
                # Without a local config the bounds are unknown: 2**31 - 1 lets any
                # drafter vocabulary through, and vLLM rejects out-of-range ids itself.
                vocab_size=vocab_size or 2**31 - 1,
                num_hidden_layers=int(config.get("num_hidden_layers", 0)),
                hidden_size=int(config.get("hidden_size", 0)),
                model_dir=model_dir,
                model=None,
            )
            drafter = await asyncio.to_thread(load_drafter, drafter_spec, info)
            if drafter.target_layer_ids is not None:
                raise ValueError(
                    f"the {drafter.name} drafter needs target hidden states, which vLLM's "
                    "HTTP API cannot give; use engine mode for it"
                )
            connect = getattr(drafter, "connect", None)
            if connect is not None:  # a served drafter: reach it, check its tokenizer
                await connect(remote)
        return Runtime(
            target=target,
            drafter=drafter,
            tokens=tokens,
            model_name=target.name,
            vocab_size=vocab_size,
            sampling_defaults=sampling_defaults(model_dir),
            upstream=target.http,
        )
    except BaseException:
        await target.aclose()
        drafter_close = getattr(drafter, "aclose", None)
        if drafter_close is not None:
            await drafter_close()
        raise


def _local_model_root(target: VLLMTarget) -> Path | None:
    """The served model's directory, when vLLM serves a path that exists here too."""
    path = Path(target.name)
    return path if (path / "config.json").is_file() else None


def _read_config(model_dir: Path | None) -> dict[str, Any]:
    if model_dir is None or not (model_dir / "config.json").is_file():
        return {}
    return json.loads((model_dir / "config.json").read_text())


def sampling_defaults(model_dir: str | Path | None) -> dict[str, float | int]:
    """Sampling defaults a vLLM server applies for this model when a request leaves them
    out: the temperature / top_p / top_k of its generation_config.json, if any."""
    if model_dir is None:
        return {}
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    config = json.loads(path.read_text())
    return {name: config[name] for name in ("temperature", "top_p", "top_k") if name in config}
