"""From a validated OpenAI request to what the decoding loop runs: prompt token ids
(through the target's own tokenizer and chat template), the output limit, sampling
parameters and the tree shape (server defaults + the request's `ddtree` overrides)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pydantic
from fastapi import Request

from proxy.backend.base import SessionOptions
from proxy.decoding import GenerationRequest, PromptError, TreeSettings, resolve_depth
from proxy.generation_defaults import SAMPLING_FIELDS, GenerationDefaults
from proxy.runtime import Runtime
from proxy.sampling import SamplingParams
from proxy.server.errors import RequestError
from proxy.server.request_models import (
    ChatCompletionRequest,
    CompletionRequest,
    DDTreeOptions,
    Endpoint,
)
from proxy.server.responses import ResponseWriter
from proxy.server.settings import ServerSettings

PATHS: dict[Endpoint, str] = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}

# Headers of the client's that a handed-over request takes to vLLM: they change its answer.
_PASSED_ON = frozenset({"x-request-id"})

# vLLM treats temperatures below this as greedy (its _SAMPLING_EPS); so do we.
GREEDY_TEMPERATURE = 1e-5


@dataclass
class Plan:
    """A validated request, ready for the decoding loop."""

    endpoint: Endpoint
    generation: GenerationRequest
    writer: ResponseWriter
    skip_special_tokens: bool
    stream: bool
    include_usage: bool
    continuous_usage: bool
    # Proxy mode answers exactly as the vLLM behind it: no usage on the finishing chunk
    # without continuous usage, log-prob token texts as vLLM reports them. Engine mode
    # (no vLLM to match) keeps its own conventions: the finishing chunk carries usage
    # (and usage.ddtree), a token's log-prob text is its own decode.
    mirror_vllm: bool
    # The client's body, sent to vLLM as it is if the request is handed over
    # (`generation.hand_over`); None: it cannot be. With it, the client's headers that
    # change vLLM's answer (X-Request-Id names it).
    client_body: dict[str, Any] | None = None
    client_headers: dict[str, str] = field(default_factory=dict)


async def plan_request(
    runtime: Runtime,
    settings: ServerSettings,
    request: Request,
    endpoint: Endpoint,
    parsed: CompletionRequest | ChatCompletionRequest,
    disabled: bool,
    client_body: dict[str, Any] | None = None,
) -> Plan:
    """Tokenize the prompt and settle every knob of the generation. RequestError (400)
    names the field at fault; TargetError means the upstream failed to tokenize.
    `disabled`: the request opted out of speculation (engine mode: the target alone).
    `client_body` (proxy mode): the body as the client sent it, for a hand-over. A
    streaming request can be handed over unless it asks for log-probs or sets a seed
    (vLLM's answer would do, but one that broke could not go on as it would) or wants
    usage on every event (`usage.ddtree` in each, which vLLM's events lack)."""
    if isinstance(parsed, CompletionRequest):
        prompt = parsed.single_prompt
        if prompt == "":
            # vLLM's validate_prompt_and_prompt_embeds; whitespace is a prompt like any
            # other (code models continue blank lines all the time).
            raise RequestError(
                "Either prompt or prompt_embeds must be provided and non-empty.", param="prompt"
            )
        if isinstance(prompt, str):
            prompt_ids = await runtime.tokens.encode(prompt, parsed.add_special_tokens)
        else:
            prompt_ids = list(prompt)
        prompt_field = "prompt"
    else:
        assert isinstance(parsed, ChatCompletionRequest)
        try:
            prompt_ids = await runtime.tokens.encode_chat(
                parsed.message_dicts,
                parsed.add_generation_prompt,
                parsed.continue_final_message,
                parsed.chat_template_kwargs,
            )
        except ValueError as exc:
            raise RequestError(f"messages: {exc}", param="messages") from None
        prompt_field = "messages"
    max_tokens, max_tokens_field = requested_max_tokens(parsed)
    vocab_size = runtime.vocab_size
    if vocab_size is not None and prompt_ids:
        # vLLM's Renderer.validate_token_ids (it names the lowest id if negative, else the
        # highest); a streaming client gets it inside the stream, as from vLLM.
        low, high = min(prompt_ids), max(prompt_ids)
        if low < 0 or high >= vocab_size:
            raise RequestError(
                f"{prompt_field}: Token id {low if low < 0 else high} is out of vocabulary "
                f"(token ids lie in [0, {vocab_size}))",
                param=prompt_field,
            )
    stop_token_ids = tuple(parsed.stop_token_ids or ())
    if runtime.mode == "engine" and vocab_size is not None:
        # vLLM's SamplingParams._validate_stop_token_ids. In proxy mode vLLM itself rules:
        # the ids ride along with the first verification call (VLLMSession._complete).
        invalid = [t for t in stop_token_ids if not 0 <= t < vocab_size]
        if invalid:
            raise RequestError(
                f"token_id(s) {invalid} in stop_token_ids contain out-of-vocab token ids. "
                f"Vocabulary size: {vocab_size}",
                param="stop_token_ids",
            )
    limit = runtime.max_model_len
    if max_tokens is not None and max_tokens < 1:
        # vLLM's SamplingParams._verify_args, on the value in force.
        raise RequestError(
            f"{max_tokens_field}: must be at least 1, got {max_tokens}.", param=max_tokens_field
        )
    if max_tokens is not None and max_tokens > limit:
        # No prompt leaves room for it: vLLM's renderer refuses it too (TokenizeParams).
        raise RequestError(
            f"{max_tokens_field}: {max_tokens} is more than this model's maximum context "
            f"length of {limit} tokens",
            param=max_tokens_field,
        )
    if len(prompt_ids) >= limit:
        raise RequestError(
            f"{prompt_field}: this model's maximum context length is {limit} tokens, and "
            f"the prompt has {len(prompt_ids)}: no room for output",
            param=prompt_field,
        )
    defaults = runtime.generation_defaults
    max_tokens = max_tokens_in_force(max_tokens, limit - len(prompt_ids), defaults)
    sampling = _sampling(parsed, defaults)
    want_logprobs = (
        parsed.logprobs is not None
        if isinstance(parsed, CompletionRequest)
        else bool(parsed.logprobs)
    )
    tree, strategy = _tree(runtime, settings, parsed.ddtree, disabled, sampling, want_logprobs)
    include_usage, continuous_usage = parsed.stream_usage
    hand_over = client_body is not None and bool(parsed.stream) and not continuous_usage
    hand_over &= not want_logprobs and sampling.seed is None
    try:
        generation = GenerationRequest(
            prompt_ids=prompt_ids,
            max_tokens=max_tokens,
            sampling=sampling,
            tree=tree,
            stop=parsed.stop_strings,
            stop_token_ids=stop_token_ids,
            ignore_eos=parsed.ignore_eos,
            logprobs=want_logprobs,
            strategy=strategy,
            stream=bool(parsed.stream),
            remote_text=runtime.remote_text,
            sampling_fields=_client_sampling(parsed) if runtime.mode == "proxy" else None,
            hand_over=hand_over,
        )
    except PromptError as exc:
        raise RequestError(f"{prompt_field}: {exc}", param=prompt_field) from None
    except ValueError as exc:
        raise RequestError(str(exc)) from None
    # vLLM's `_base_request_id`: the X-Request-Id header, else the body's request_id.
    body_id = (parsed.model_extra or {}).get("request_id")
    request_id = request.headers.get("x-request-id")
    if request_id is None:
        request_id = body_id if isinstance(body_id, str) else ResponseWriter.new_request_id()
    return Plan(
        endpoint=endpoint,
        generation=generation,
        writer=ResponseWriter(
            endpoint=endpoint,
            model=runtime.model_name,
            request_id=request_id,
            return_token_ids=bool(parsed.return_token_ids),
            want_logprobs=want_logprobs,
        ),
        skip_special_tokens=parsed.skip_special_tokens,
        stream=bool(parsed.stream),
        include_usage=include_usage,
        continuous_usage=continuous_usage,
        mirror_vllm=runtime.mode == "proxy",
        client_body=client_body if hand_over else None,
        client_headers={
            name: value for name, value in request.headers.items() if name in _PASSED_ON
        },
    )


def requested_max_tokens(
    parsed: CompletionRequest | ChatCompletionRequest,
) -> tuple[int | None, str]:
    """The request's own output limit and the field it came from, as vLLM reads them: a
    completion's max_tokens (unset or null: 16); a chat's max_completion_tokens when
    given (even 0), else its deprecated max_tokens (None: the defaults decide)."""
    if isinstance(parsed, CompletionRequest):
        return (16 if parsed.max_tokens is None else parsed.max_tokens), "max_tokens"
    if parsed.max_completion_tokens is not None:
        return parsed.max_completion_tokens, "max_completion_tokens"
    return parsed.max_tokens, "max_tokens"


def max_tokens_in_force(requested: int | None, room: int, defaults: GenerationDefaults) -> int:
    """The output limit vLLM would run to (vllm/entrypoints/serve/utils/api_utils.py,
    `get_max_tokens`): the request's, else the default max_tokens, else the room left;
    never past the room (the output stops there with "length" rather than refusing) nor
    a server-wide cap."""
    if requested is None:
        requested = defaults.values.get("max_tokens")
    limits = [room, requested, defaults.max_tokens_cap]
    return int(min(limit for limit in limits if limit is not None))


def _sampling(
    parsed: CompletionRequest | ChatCompletionRequest, defaults: GenerationDefaults
) -> SamplingParams:
    """The sampling rule in force: the request's fields, else the server's defaults
    (the proxy decides greedy or not on it; engine mode samples with it)."""
    temperature = parsed.temperature
    if temperature is None:
        temperature = float(defaults.get("temperature"))
    if temperature < GREEDY_TEMPERATURE:
        return SamplingParams(temperature=0.0, seed=parsed.seed)
    top_p = parsed.top_p if parsed.top_p is not None else float(defaults.get("top_p"))
    top_k = parsed.top_k if parsed.top_k is not None else int(defaults.get("top_k"))
    return SamplingParams(
        temperature=temperature, top_p=top_p, top_k=max(top_k, 0), seed=parsed.seed
    )


def _client_sampling(parsed: CompletionRequest | ChatCompletionRequest) -> dict[str, Any]:
    """The sampling fields the client set itself, as it set them (null is unset, as in
    vLLM): the proxy's calls to vLLM carry these and no others, so vLLM applies its own
    defaults to the rest. Penalties and min_p reach here only with neutral values (any
    other is passed through), which still override a server default."""
    given = parsed.model_dump(include={"temperature", "top_p", "top_k"})
    given.update(parsed.model_extra or {})
    return {name: given[name] for name in SAMPLING_FIELDS if given.get(name) is not None}


def _tree(
    runtime: Runtime,
    settings: ServerSettings,
    options: DDTreeOptions | None,
    disabled: bool,
    sampling: SamplingParams,
    want_logprobs: bool,
) -> tuple[TreeSettings, str | None]:
    """Server defaults + the request's overrides; errors name the ddtree.* field."""
    options = options or DDTreeOptions()
    overrides = options.model_dump(exclude_none=True, exclude={"enabled", "strategy"})
    if disabled:
        overrides["kind"] = "none"  # engine mode's opt-out: the target alone
    try:
        tree = TreeSettings(**{**settings.tree.model_dump(), **overrides})
    except pydantic.ValidationError as exc:
        raise _ddtree_error(exc) from None
    strategy = options.strategy or settings.strategy
    if strategy is not None:
        session = SessionOptions(sampling=sampling, want_logprobs=want_logprobs, strategy=strategy)
        try:
            runtime.target.check_options(session)
            defaults = runtime.generation_defaults
            if strategy == "paths" and (
                not defaults.known or defaults.get("repetition_penalty") != 1.0
            ):
                # Prompt logprobs are the raw distribution: their argmax is not the
                # choice a repetition penalty in force makes (nor one nobody can rule out).
                raise ValueError(
                    "'paths' reads argmaxes of raw prompt logprobs, which a default "
                    "repetition_penalty (or unknown defaults) would not pick; use 'nodes'"
                )
        except ValueError as exc:
            raise RequestError(f"ddtree.strategy: {exc}", param="ddtree.strategy") from None
    if tree.kind != "none":
        if runtime.drafter is None:
            raise RequestError(
                f"ddtree.kind: {tree.kind!r} needs a drafter, and this server runs without "
                "one; use kind 'none'",
                param="ddtree.kind",
            )
        try:
            resolve_depth(tree, runtime.drafter)
        except ValueError as exc:
            raise RequestError(f"ddtree.depth: {exc}", param="ddtree.depth") from None
    return tree, strategy


def _ddtree_error(exc: pydantic.ValidationError) -> RequestError:
    err = exc.errors()[0]
    param = ".".join(["ddtree", *(str(part) for part in err["loc"])])
    return RequestError(f"{param}: {err['msg']}", param=param)


def opted_out(request: Request, body: dict[str, Any]) -> bool:
    """`x-ddtree: off` or `"ddtree": {"enabled": false}`; validates the ddtree field."""
    options = body.get("ddtree")
    if options is not None:
        try:
            options = DDTreeOptions.model_validate(options)
        except pydantic.ValidationError as exc:
            raise _ddtree_error(exc) from None
    header = request.headers.get("x-ddtree", "").strip().lower()
    if header and header not in ("on", "off", "true", "false", "1", "0"):
        raise RequestError(
            f"header x-ddtree must be 'on' or 'off', got {header!r}", param="x-ddtree"
        )
    return header in ("off", "false", "0") or (options is not None and not options.enabled)
