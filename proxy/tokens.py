"""Token ids <-> text, as the target's server would do it.

`LocalTokens` wraps a HuggingFace tokenizer in this process (engine mode, or proxy
mode with --tokenizer); `proxy.backend.vllm_tokens.VLLMTokens` asks the vLLM server
(/tokenize, /detokenize); `ServerChatTemplate` tokenizes locally but renders chat
prompts through the server, whose chat template may be its own.
"""

from __future__ import annotations

from typing import Any, Protocol


class Tokens(Protocol):
    async def encode(self, text: str, add_special_tokens: bool) -> list[int]: ...

    async def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        continue_final_message: bool,
        chat_template_kwargs: dict[str, Any] | None,
    ) -> list[int]:
        """Token ids of chat `messages` after the chat template; ValueError if the
        messages do not fit the template."""
        ...

    async def decode(self, token_ids: list[int], skip_special_tokens: bool) -> str: ...

    async def token_strings(self, token_ids: list[int]) -> list[str]:
        """The text of each token on its own (for logprobs entries)."""
        ...


class LocalTokens:
    """A HuggingFace tokenizer in this process."""

    def __init__(self, tokenizer: Any):  # a transformers PreTrainedTokenizerBase
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
        import jinja2  # comes with transformers, which a local tokenizer needs anyway

        if self.tokenizer.chat_template is None:
            raise ValueError("the model's tokenizer has no chat template")
        # Render, then tokenize without adding special tokens: the template holds them
        # (this is what vLLM does for /v1/chat/completions).
        try:
            text = self.tokenizer.apply_chat_template(
                [_flatten_text_content(message) for message in messages],
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **(chat_template_kwargs or {}),
            )
        except (TypeError, KeyError, jinja2.TemplateError) as exc:
            raise ValueError(str(exc)) from exc
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


class ServerChatTemplate(LocalTokens):
    """Local encode/decode, but chat prompts through `server` (the vLLM server's
    /tokenize), so the prompt equals what vLLM builds (it may run its own
    --chat-template)."""

    def __init__(self, tokenizer: Any, server: Tokens):
        super().__init__(tokenizer)
        self.server = server

    async def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        continue_final_message: bool,
        chat_template_kwargs: dict[str, Any] | None,
    ) -> list[int]:
        return await self.server.encode_chat(
            messages, add_generation_prompt, continue_final_message, chat_template_kwargs
        )
