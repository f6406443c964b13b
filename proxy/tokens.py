"""Token ids <-> text, as the target's server would do it.

`LocalTokens` wraps a HuggingFace tokenizer in this process (engine mode);
`TokenizerFile` reads the model's tokenizer.json with the light `tokenizers` library
(proxy mode: text without a call to vLLM, and without Transformers);
`proxy.backend.vllm_tokens.VLLMTokens` asks the vLLM server (/tokenize, /detokenize),
for a proxy with no tokenizer file on its host. The proxy renders chat prompts through
the server either way: its chat template may be its own.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

from tokenizers import Tokenizer


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


# Transformers' clean-up of decoded text (`clean_up_tokenization`), applied in this order.
_CLEAN_UP = (
    (" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
    (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"),
)  # fmt: skip


class TokenizerFile:
    """A model's tokenizer.json, read with the `tokenizers` library: the same tokenizer
    vLLM runs (through Transformers, which wraps this library), in this process.

    * `encode` is a completion prompt's tokenization (special tokens added or not); by
      `server` when `server_encodes` (a tokenizer.json that tokenizes differently).
    * `decode` is the text vLLM's detokenizer streams: it steps a `tokenizers`
      DecodeStream over this tokenizer (vllm/v1/engine/detokenizer.py,
      `FastIncrementalDetokenizer`), which yields the plain decode -- no clean-up of
      spaces; `skip_special_tokens` drops the added tokens marked special.
    * `token_strings` is the text vLLM reports for a logprobs token
      (vllm/tokenizers/detokenizer_utils.py, `convert_ids_list_to_tokens`):
      Transformers' decode of the token alone -- spaces cleaned up when
      tokenizer_config.json's `clean_up_tokenization_spaces` says so, never for a BPE
      model (transformers' `TokenizersBackend._decode`) -- with the leading spaces a
      Metaspace pre-tokenizer's decoder strips put back.
    * chat prompts are rendered by `server` (vLLM's /tokenize): the template is the
      server's, which it may override with --chat-template.
    """

    def __init__(
        self, tokenizer: Tokenizer, server: Tokens, config: dict[str, Any] | None = None
    ):
        self.tokenizer = tokenizer
        self.server = server
        config = config or {}
        model_type = type(tokenizer.model).__name__
        self.clean_up = bool(config.get("clean_up_tokenization_spaces")) and (
            model_type != "BPE"
            or bool(
                config.get(
                    "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"
                )
            )
        )
        self.space_marker = _metaspace_marker(json.loads(tokenizer.to_str()))
        self.server_encodes = False
        self._strings: dict[int, str] = {}

    @classmethod
    def load(cls, directory: str | Path, server: Tokens) -> TokenizerFile:
        directory = Path(directory)
        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        return cls(Tokenizer.from_file(str(directory / "tokenizer.json")), server, config)

    @property
    def vocab_size(self) -> int:
        """Ids this tokenizer knows (added tokens included)."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if self.server_encodes:
            return await self.server.encode(text, add_special_tokens)
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

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

    async def decode(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    async def token_strings(self, token_ids: list[int]) -> list[str]:
        for token_id in set(token_ids) - self._strings.keys():
            self._strings[token_id] = self._token_string(token_id)
        return [self._strings[token_id] for token_id in token_ids]

    def _token_string(self, token_id: int) -> str:
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        if self.clean_up:
            for old, new in _CLEAN_UP:
                text = text.replace(old, new)
        if self.space_marker is not None:
            raw = self.tokenizer.id_to_token(token_id) or ""
            num_markers = len(raw) - len(raw.lstrip(self.space_marker))
            missing = num_markers - (len(text) - len(text.lstrip(" ")))
            text = " " * missing + text if missing > 0 else text
        return text


def _metaspace_marker(config: dict[str, Any]) -> str | None:
    """The replacement character of a Metaspace pre-tokenizer (alone or in a
    sequence), whose decoder strips a leading space; None for any other."""
    pre = config.get("pre_tokenizer") or {}
    for step in [pre, *(pre.get("pretokenizers") or [])]:
        if step.get("type") == "Metaspace":
            return step.get("replacement", "\u2581")
    return None
