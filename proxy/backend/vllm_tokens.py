"""Token ids <-> text through the vLLM server's own tokenizer (/tokenize, /detokenize).

Going through the server keeps the proxy's tokenization, chat templating and
detokenization identical to what the server itself would do for the same request.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, Sequence

from proxy.backend.base import TargetError
from proxy.backend.vllm import VLLMHttp, VLLMTarget


class VLLMTokens:
    """The `proxy.tokens.Tokens` of one served model, through its server.

    /detokenize keeps special tokens in the text (vLLM's completions skip them by
    default). With `special_ids` (read from the model's local tokenizer.json, see
    `special_token_ids`) `skip_special_tokens` drops those ids before decoding, which is
    what the tokenizer itself does; without them it cannot be honoured -- pass
    --tokenizer for exact text when the model emits special tokens."""

    def __init__(
        self, http: VLLMHttp, model: str, special_ids: frozenset[int] = frozenset()
    ) -> None:
        self.http = http
        self.model = model
        self.special_ids = special_ids
        self._strings: dict[int, str] = {}

    @classmethod
    def of(cls, target: VLLMTarget, model_dir: Path | None = None) -> VLLMTokens:
        """Share the target's pooled HTTP client and model name."""
        return cls(target.http, target.name, special_token_ids(model_dir))

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
        """Text of `token_ids`; special tokens stay unless skipped and known."""
        ids = [int(t) for t in token_ids]
        if skip_special_tokens and self.special_ids:
            ids = [t for t in ids if t not in self.special_ids]
            if not ids:
                return ""
        body = {"model": self.model, "tokens": ids}
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
        # vLLM decodes logprob tokens with their special tokens (convert_ids_list_to_tokens).
        texts = await asyncio.gather(*(self.decode([token_id], False) for token_id in missing))
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


def special_token_ids(model_dir: Path | None) -> frozenset[int]:
    """Ids of the added tokens marked special in `model_dir`/tokenizer.json (none if
    there is no such file): the ids a tokenizer drops for skip_special_tokens."""
    path = None if model_dir is None else Path(model_dir) / "tokenizer.json"
    if path is None or not path.is_file():
        return frozenset()
    added = json.loads(path.read_text()).get("added_tokens", [])
    return frozenset(int(token["id"]) for token in added if token.get("special"))
