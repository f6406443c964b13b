"""The OpenAI-compatible requests: their models, which ones DDTree serves and which it
must pass through (responses are in `proxy.server.responses`).

A request field is one of three things:
* served: DDTree reproduces vLLM's output for it (prompt, max_tokens, sampling, stop...);
* pass-through: DDTree cannot honour it losslessly when it is active (n > 1, penalties,
  logit_bias, structured output, echo, prompt_logprobs, ...): the request goes to vLLM
  unchanged in proxy mode, and is refused with a 400 in engine mode;
* neutral: it does not change the output (user, priority, ...).
In proxy mode a field vLLM does not know is accepted and ignored, as vLLM does (clients
and SDKs add their own); engine mode refuses it (400). Every field vLLM 0.32 knows is one of the three
(tests/test_differential.py::test_every_vllm_field_is_classified). A served field of
the wrong type is a 400 naming it; values are judged as vLLM judges them (see
`proxy.server.plan` and docs/FIDELITY.md).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Callable, ClassVar, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from proxy.backend.vllm import Strategy
from proxy.decoding import BudgetPolicy, TreeKind
from proxy.server.errors import RequestError

Endpoint = Literal["completions", "chat"]
TokenId = Annotated[int, Field(ge=0)]


class DDTreeOptions(BaseModel):
    """Per-request `"ddtree": {...}` overrides of the server's defaults."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(True, description="false: pass the request to vLLM unchanged")
    kind: TreeKind | None = Field(None, description="tree shape")
    budget: int | None = Field(None, description="tree nodes per round")
    depth: int | None = Field(None, description="levels per round")
    strategy: Strategy | None = Field(None, description="proxy verification")
    policy: BudgetPolicy | None = Field(
        None, description="adaptive: budget is the upper bound; fixed: always the budget"
    )


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


def _is_set(value: Any) -> bool:
    return value is not None


def _is_true(value: Any) -> bool:
    return bool(value)


def _not_zero(value: Any) -> bool:
    return value is not None and value != 0


def _not_one(value: Any) -> bool:
    return value is not None and value != 1


def _not_text_format(value: Any) -> bool:
    return value is not None and not (isinstance(value, dict) and value.get("type") == "text")


# field -> "is it active" for fields DDTree cannot honour losslessly.
_PASSTHROUGH_COMMON: dict[str, Callable[[Any], bool]] = {
    "n": _not_one,
    "best_of": _not_one,
    "presence_penalty": _not_zero,
    "frequency_penalty": _not_zero,
    "repetition_penalty": _not_one,
    "logit_bias": _is_true,
    "response_format": _not_text_format,
    "structured_outputs": _is_set,
    "guided_json": _is_set,
    "guided_regex": _is_set,
    "guided_choice": _is_set,
    "guided_grammar": _is_set,
    "guided_decoding_backend": _is_set,
    "guided_whitespace_pattern": _is_set,
    "echo": _is_true,
    "prompt_logprobs": _is_set,
    "min_p": _not_zero,
    "min_tokens": _not_zero,
    "use_beam_search": _is_true,
    "length_penalty": _not_one,
    "allowed_token_ids": _is_set,
    "bad_words": _is_true,
    "logprob_token_ids": _is_set,
    "include_stop_str_in_output": _is_true,
    "spaces_between_special_tokens": lambda value: value is False,
    "truncate_prompt_tokens": _is_set,
    "truncation_side": _is_set,
    "prompt_embeds": _is_set,
    "watermarking": _is_true,
    "kv_transfer_params": _is_set,
    "ec_transfer_params": _is_set,
    "vllm_xargs": _is_set,
    "repetition_detection": _is_set,
    "thinking_token_budget": _is_set,
    "return_tokens_as_token_ids": _is_true,
    "return_token_offsets": _is_true,
    "mm_payload": _is_set,
    "return_mm_kwargs": _is_true,
    "stream_interval": _not_one,
    "routed_experts_prompt_start": _not_zero,
    "cache_salt": _is_set,
}


def _is_prompt_batch(prompt: Any) -> bool:
    """Several prompts ([str, ...] or [[int, ...], ...]): one choice each."""
    return isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], (str, list))


def _has_non_text_content(messages: Any) -> bool:
    """Images, audio, ... in chat content parts: vLLM's multimodal path."""
    if not isinstance(messages, list):
        return False
    return any(
        isinstance(message, dict)
        and isinstance(message.get("content"), list)
        and any(
            not isinstance(part, dict)
            or part.get("type") != "text"
            or not isinstance(part.get("text"), str)
            for part in message["content"]
        )
        for message in messages
    )


_PASSTHROUGH_COMPLETION = {
    **_PASSTHROUGH_COMMON,
    "prompt": _is_prompt_batch,
    # Top alternatives: a node's answer reports only the chosen token's log-prob.
    "logprobs": _not_zero,
    "suffix": _is_set,
}
_PASSTHROUGH_CHAT = {
    **_PASSTHROUGH_COMMON,
    "messages": _has_non_text_content,
    "top_logprobs": _not_zero,
    "tools": _is_true,
    "tool_choice": lambda value: value not in (None, "none"),
    "functions": _is_true,
    "function_call": _is_set,
    "documents": _is_set,
    "chat_template": _is_set,
    "media_io_kwargs": _is_set,
    "mm_processor_kwargs": _is_set,
    "reasoning_effort": _is_set,
    "return_prompt_text": _is_true,
    "audio": _is_set,
    "modalities": lambda value: value not in (None, ["text"]),
    "prediction": _is_set,
    "web_search_options": _is_set,
    "verbosity": _is_set,
}
# Accepted and ignored: they do not change the generated output.
_NEUTRAL = frozenset(
    {
        "user",
        "request_id",
        "session_id",
        "priority",
        "parallel_tool_calls",
        "include_reasoning",
        "store",
        "metadata",
        "service_tier",
        "prompt_cache_key",
        "safety_identifier",
    }
)


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# An integer outside int64 is written with at least 19 digits in a row.
_LONG_DIGITS = re.compile(rb"[0-9]{19}")


def out_of_range_integer(body: Any, raw: bytes) -> str | None:
    """The dotted path of the first JSON integer in the request `body` (parsed from
    `raw`) that a 64-bit integer cannot hold, or None. Checked before a request is served
    or passed on: vLLM answers such a top_k with a 500 and an empty message (vLLM 0.32),
    where the field is the client's mistake.

    Such an integer is written with at least 19 digits in a row: a regular-expression
    scan of `raw` first, so that the walk of `body` runs only when it may find one (on a
    long token-id prompt it costs milliseconds of Python). A body in UTF-16 or UTF-32 (a
    zero byte among the first four, as `json.loads` detects them) is always walked."""
    if b"\x00" in raw[:4] or _LONG_DIGITS.search(raw) is not None:
        return _outside_int64(body, "")
    return None


def _outside_int64(value: Any, path: str) -> str | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return path if not INT64_MIN <= value <= INT64_MAX else None
    if isinstance(value, dict):
        items = ((f"{path}.{key}" if path else str(key), item) for key, item in value.items())
    elif isinstance(value, list):
        items = ((f"{path}[{index}]", item) for index, item in enumerate(value))
    else:
        return None
    for name, item in items:
        found = _outside_int64(item, name)
        if found is not None:
            return found
    return None


def _is_union_tag(part: str | int) -> bool:
    """pydantic names the member of a union that failed in an error's location
    ('prompt', 'list[int]', 0); the field a client wrote is the rest."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part)


class _GenerationRequest(BaseModel):
    """Fields both endpoints serve with DDTree. Pass-through, neutral and unknown fields
    land in `model_extra`."""

    model_config = ConfigDict(extra="allow")
    passthrough_rules: ClassVar[dict[str, Callable[[Any], bool]]] = _PASSTHROUGH_COMMON

    model: str | None = None
    # Its bound (>= 1) is checked on the value in force (`plan`), as vLLM does: a chat
    # request's max_tokens is not looked at when max_completion_tokens is given.
    max_tokens: int | None = None
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = False
    skip_special_tokens: bool = True
    ddtree: DDTreeOptions | None = None

    @classmethod
    def parse(cls, body: dict[str, Any], refuse_unknown: bool = False):
        """Validate a JSON body; RequestError (400) names the offending field.
        `refuse_unknown`: a field no endpoint knows is a 400 too (engine mode, which has
        no vLLM to be faithful to, catches typos; proxy mode ignores it, as vLLM does)."""
        if refuse_unknown:
            for name in body.keys() - cls.known_fields():
                raise RequestError(f"Unknown field {name!r}", param=name)
        if body.get("stream_options") and not body.get("stream"):
            # vLLM's CompletionRequest/ChatCompletionRequest.validate_stream_options.
            raise RequestError(
                "Stream options can only be defined when `stream=True`.",
                param="stream_options",
            )
        try:
            return cls.model_validate(body)
        except pydantic.ValidationError as exc:
            err = exc.errors()[0]
            param = ".".join(str(part) for part in err["loc"] if not _is_union_tag(part))
            raise RequestError(f"{param}: {err['msg']}", param=param or None) from None

    @classmethod
    def known_fields(cls) -> frozenset[str]:
        """Every field this endpoint serves, passes through or knows to be neutral."""
        return frozenset(cls.model_fields.keys() | cls.passthrough_rules.keys() | _NEUTRAL)

    @classmethod
    def passthrough_reason(cls, body: dict[str, Any]) -> str | None:
        """The first active field of a raw JSON body that DDTree cannot honour
        losslessly, or None. Works before validation: a request that goes to vLLM is
        vLLM's to validate."""
        for name, value in body.items():
            rule = cls.passthrough_rules.get(name)
            if rule is not None and rule(value):
                return name
        return None

    @property
    def stop_strings(self) -> tuple[str, ...]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in stop):
            raise RequestError("stop: stop strings must be non-empty", param="stop")
        return tuple(stop)

    @property
    def stream_usage(self) -> tuple[bool, bool]:
        """(include_usage, continuous usage): continuous_usage_stats counts only with
        include_usage (vLLM's `should_include_usage`)."""
        options = self.stream_options or StreamOptions()
        include = bool(options.include_usage)
        return include, include and bool(options.continuous_usage_stats)


class CompletionRequest(_GenerationRequest):
    passthrough_rules: ClassVar[dict[str, Callable[[Any], bool]]] = _PASSTHROUGH_COMPLETION

    # Token ids are >= 0 by type, as in vLLM's CompletionRequest (a 400 before anything
    # runs); ids past the vocabulary are the engine's to refuse (`proxy.server.errors`).
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    max_tokens: int | None = 16  # null means the default too (vLLM's normalize_null_max_tokens)
    logprobs: int | None = Field(None, ge=0, le=20)
    add_special_tokens: bool = True

    @property
    def single_prompt(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        return prompt


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_GenerationRequest):
    passthrough_rules: ClassVar[dict[str, Callable[[Any], bool]]] = _PASSTHROUGH_CHAT

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @property
    def message_dicts(self) -> list[dict[str, Any]]:
        return [message.model_dump(exclude_unset=True) for message in self.messages]


REQUEST_MODELS: dict[Endpoint, type[_GenerationRequest]] = {
    "completions": CompletionRequest,
    "chat": ChatCompletionRequest,
}
