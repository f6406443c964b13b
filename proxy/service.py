"""What the HTTP layer generates with: a target, a drafter, and tokenization that
matches the target -- assembled for engine mode or for proxy mode.

Engine mode: the local Transformers target, its tokenizer, the drafter (dflash by
default). Proxy mode: a vLLM server over HTTP, tokenization through a local
tokenizer (`--tokenizer`) or through vLLM's own /tokenize and /detokenize, and a
drafter that needs no target hidden states (ngram by default, or autoregressive).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import httpx
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from proxy.backend.base import Target, TargetError
from proxy.backend.vllm import RetryPolicy, VLLMHttp, VLLMTarget
from proxy.backend.vllm_tokens import VLLMTokens
from proxy.config import PROXY_DEFAULT_DRAFTER, ServerSettings, sampling_defaults
from proxy.decoding import Detokenize
from proxy.drafter import load_drafter, parse_drafter_spec
from proxy.drafter.base import Drafter, TargetInfo
from proxy.engine import DEFAULT_DRAFTER, DEFAULT_TARGET_DIR, Engine

Mode = Literal["engine", "proxy"]


class Tokens(Protocol):
    """Token ids <-> text, as the target's server would do it."""

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]: ...

    async def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        continue_final_message: bool,
        chat_template_kwargs: dict[str, Any] | None,
    ) -> list[int]: ...

    async def decode(self, token_ids: list[int], skip_special_tokens: bool) -> str: ...

    async def token_strings(self, token_ids: list[int]) -> list[str]:
        """The text of each token on its own (for logprobs entries)."""
        ...


class LocalTokens:
    """A HuggingFace tokenizer in this process."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = tokenizer

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    async def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        continue_final_message: bool,
        chat_template_kwargs: dict[str, Any] | None,
    ) -> list[int]:
        if self.tokenizer.chat_template is None:
            raise ValueError("messages: the model's tokenizer has no chat template")
        # Render, then tokenize without adding special tokens: the template holds them
        # (this is what vLLM does for /v1/chat/completions).
        text = self.tokenizer.apply_chat_template(
            [_flatten_text_content(message) for message in messages],
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **(chat_template_kwargs or {}),
        )
        return await self.encode(text, add_special_tokens=False)

    async def decode(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    async def token_strings(self, token_ids: list[int]) -> list[str]:
        return [self.tokenizer.decode([token_id]) for token_id in token_ids]


def _flatten_text_content(message: dict[str, Any]) -> dict[str, Any]:
    """OpenAI content parts [{"type": "text", "text": ...}, ...] -> one string, joined
    with newlines as vLLM does for string-content chat templates."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    texts = [part["text"] for part in content]  # the API layer admits text parts only
    return {**message, "content": "\n".join(texts)}


class RemoteTokens:
    """vLLM's /tokenize and /detokenize. /detokenize keeps special tokens in the text
    (vLLM's completions skip them by default); `skip_special_tokens` cannot be honoured
    here -- pass --tokenizer for exact text when the model emits special tokens."""

    def __init__(self, tokens: VLLMTokens):
        self.tokens = tokens
        self._strings: dict[int, str] = {}

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return await self.tokens.encode(text, add_special_tokens=add_special_tokens)

    async def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        continue_final_message: bool,
        chat_template_kwargs: dict[str, Any] | None,
    ) -> list[int]:
        return await self.tokens.encode_chat(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template_kwargs=chat_template_kwargs,
        )

    async def decode(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        return await self.tokens.decode(token_ids)

    async def token_strings(self, token_ids: list[int]) -> list[str]:
        missing = sorted(set(token_ids) - self._strings.keys())
        texts = await asyncio.gather(*(self.tokens.decode([token_id]) for token_id in missing))
        self._strings.update(zip(missing, texts, strict=True))
        return [self._strings[token_id] for token_id in token_ids]


class ChatTokens(LocalTokens):
    """Proxy mode with --tokenizer: local encode/decode, but chat templates through the
    server's /tokenize, so the prompt equals what vLLM builds (it may run its own
    --chat-template)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, remote: RemoteTokens):
        super().__init__(tokenizer)
        self.remote = remote

    async def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        continue_final_message: bool,
        chat_template_kwargs: dict[str, Any] | None,
    ) -> list[int]:
        return await self.remote.encode_chat(
            messages, add_generation_prompt, continue_final_message, chat_template_kwargs
        )


@dataclass
class Service:
    """Everything a request needs; built once per server by `build_service`."""

    mode: Mode
    model_name: str
    max_model_len: int
    targets: dict[str, Target]  # verification strategy -> target ("default" in engine mode)
    drafter: Drafter | None
    tokens: Tokens
    vocab_size: int | None  # None when unknown (remote tokenizer, no local config)
    sampling_defaults: dict[str, float | int] = field(default_factory=dict)
    upstream: VLLMHttp | None = None  # proxy mode: the pooled client to vLLM
    created: int = field(default_factory=lambda: int(time.time()))
    restore_torch_threads: int | None = None  # torch's thread count before we set ours

    def target(self, strategy: str | None) -> Target:
        if self.mode == "engine":
            return self.targets["default"]
        return self.targets[strategy or "nodes"]

    def detokenizer(self, skip_special_tokens: bool) -> Detokenize:
        async def detokenize(token_ids: list[int]) -> str:
            return await self.tokens.decode(token_ids, skip_special_tokens)

        return detokenize

    async def health(self) -> tuple[bool, dict[str, Any]]:
        if self.upstream is None:
            return True, {"status": "ok", "mode": self.mode}
        try:
            # Short: /health must turn unhealthy within seconds of the upstream dying.
            response = await self.upstream.client.get("/health", timeout=2.0)
        except Exception as exc:  # any failure to reach it means "unhealthy"
            return False, {
                "status": "unhealthy",
                "mode": self.mode,
                "upstream": {
                    "url": self.upstream.base_url,
                    "error": f"{type(exc).__name__}: {exc}",
                },
            }
        healthy = response.status_code == 200
        return healthy, {
            "status": "ok" if healthy else "unhealthy",
            "mode": self.mode,
            "upstream": {"url": self.upstream.base_url, "status_code": response.status_code},
        }

    async def aclose(self) -> None:
        if self.upstream is not None:
            await self.upstream.aclose()
        if self.restore_torch_threads is not None:
            torch.set_num_threads(self.restore_torch_threads)
            self.restore_torch_threads = None


async def build_service(
    settings: ServerSettings, transport: httpx.AsyncBaseTransport | None = None
) -> Service:
    """Load models / connect upstream. `transport`: the upstream's HTTP transport (tests
    inject a mock; None = the network)."""
    threads = settings.torch_threads or (1 if settings.proxy_mode else None)
    previous = torch.get_num_threads()
    if threads is not None:
        # Process-wide; the service puts the old value back when it closes.
        torch.set_num_threads(threads)
    try:
        if settings.proxy_mode:
            service = await _build_proxy(settings, transport)
        else:
            service = await asyncio.to_thread(_build_engine, settings)
    except BaseException:
        torch.set_num_threads(previous)
        raise
    service.restore_torch_threads = previous if threads is not None else None
    return service


def _build_engine(settings: ServerSettings) -> Service:
    if settings.tokenizer is not None:
        raise ValueError("--tokenizer is for proxy mode; engine mode uses the target's own")
    if settings.strategy != "nodes":
        raise ValueError("--strategy is for proxy mode (it says how vLLM verifies a tree)")
    target_dir = Path(settings.target or DEFAULT_TARGET_DIR)
    drafter_spec = settings.drafter or DEFAULT_DRAFTER
    if settings.tree.kind == "none":
        drafter_spec = None
    else:
        parse_drafter_spec(drafter_spec)  # an unknown name fails before any model loads
    engine = Engine.load(target_dir, drafter_spec)
    return Service(
        mode="engine",
        model_name=settings.model or target_dir.name,
        max_model_len=engine.target.max_model_len,
        targets={"default": engine.target},
        drafter=engine.drafter,
        tokens=LocalTokens(engine.tokenizer),
        vocab_size=int(engine.target.model.config.vocab_size),
        sampling_defaults=sampling_defaults(target_dir),
    )


def _check_proxy_drafter(spec: str) -> None:
    name, _ = parse_drafter_spec(spec)
    if name == "dflash":
        raise ValueError(
            "the dflash drafter needs the target's hidden states, which a vLLM server does "
            "not expose over HTTP; use --drafter ngram or autoregressive:PATH in proxy mode, "
            "or engine mode (serve without --target-url) for dflash"
        )


async def _build_proxy(
    settings: ServerSettings, transport: httpx.AsyncBaseTransport | None
) -> Service:
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
            strategy="nodes",
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
    try:
        targets: dict[str, Target] = {
            strategy: VLLMTarget(
                target.http, target.name, target.max_model_len, target.eos_token_ids, strategy
            )
            for strategy in ("nodes", "paths")
        }
        model_dir = tokenizer_dir or _local_model_root(target)
        config = _read_config(model_dir)
        remote = RemoteTokens(VLLMTokens.of(target))
        tokens: Tokens = remote
        if tokenizer_dir is not None:
            local = await asyncio.to_thread(AutoTokenizer.from_pretrained, str(tokenizer_dir))
            tokens = ChatTokens(local, remote)
        vocab_size = int(config["vocab_size"]) if "vocab_size" in config else None
        drafter = None
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
        return Service(
            mode="proxy",
            model_name=target.name,
            max_model_len=target.max_model_len,
            targets=targets,
            drafter=drafter,
            tokens=tokens,
            vocab_size=vocab_size,
            sampling_defaults=sampling_defaults(model_dir),
            upstream=target.http,
        )
    except BaseException:
        await target.aclose()
        raise


def _local_model_root(target: VLLMTarget) -> Path | None:
    """The served model's directory, when vLLM serves a path that exists here too."""
    path = Path(target.name)
    return path if (path / "config.json").is_file() else None


def _read_config(model_dir: Path | None) -> dict[str, Any]:
    if model_dir is None or not (model_dir / "config.json").is_file():
        return {}
    return json.loads((model_dir / "config.json").read_text())


__all__ = ["Service", "TargetError", "build_service"]
