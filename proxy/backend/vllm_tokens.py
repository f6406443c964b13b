"""Token ids <-> text through the vLLM server's own tokenizer (/tokenize, /detokenize).

Going through the server keeps the proxy's tokenization, chat templating and
detokenization identical to what the server itself would do for the same request.
"""

from __future__ import annotations

import asyncio
from typing import Any, Sequence

from proxy.backend.base import TargetError
from proxy.backend.vllm import VLLMHttp, VLLMTarget


class VLLMTokens:
    """The `proxy.tokens.Tokens` of one served model, through its server.

    /detokenize keeps special tokens in the text (vLLM's completions skip them by
    default); `skip_special_tokens` cannot be honoured here -- pass --tokenizer for
    exact text when the model emits special tokens."""

    def __init__(self, http: VLLMHttp, model: str) -> None:
        self.http = http
        self.model = model
        self._strings: dict[int, str] = {}

    @classmethod
    def of(cls, target: VLLMTarget) -> VLLMTokens:
        """Share the target's pooled HTTP client and model name."""
        return cls(target.http, target.name)

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a plain completion prompt, as /v1/completions would see it."""
        body = {"model": self.model, "prompt": text, "add_special_tokens": add_special_tokens}
        return self._tokens(await self.http.request_json("POST", "/tokenize", body))

    async def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of chat `messages` after the server's chat template."""
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
            # As /v1/chat/completions does: the template already holds any special tokens.
            "add_special_tokens": False,
        }
        if chat_template_kwargs:
            body["chat_template_kwargs"] = chat_template_kwargs
        return self._tokens(await self.http.request_json("POST", "/tokenize", body))

    async def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `token_ids` (special tokens included, as vLLM's /detokenize gives it)."""
        body = {"model": self.model, "tokens": [int(t) for t in token_ids]}
        answer = await self.http.request_json("POST", "/detokenize", body)
        try:
            text = answer["prompt"]
        except (KeyError, TypeError) as exc:
            raise TargetError(f"unexpected /detokenize answer: {answer!r:.300}") from exc
        if not isinstance(text, str):
            raise TargetError(f"unexpected /detokenize answer: {answer!r:.300}")
        return text

    async def token_strings(self, token_ids: list[int]) -> list[str]:
        missing = sorted(set(token_ids) - self._strings.keys())
        texts = await asyncio.gather(*(self.decode([token_id]) for token_id in missing))
        self._strings.update(zip(missing, texts, strict=True))
        return [self._strings[token_id] for token_id in token_ids]

    @staticmethod
    def _tokens(answer: Any) -> list[int]:
        try:
            tokens = answer["tokens"]
            if not all(isinstance(t, int) for t in tokens):
                raise TypeError("non-integer token")
        except (KeyError, TypeError) as exc:
            raise TargetError(f"unexpected /tokenize answer: {answer!r:.300}") from exc
        return list(tokens)
