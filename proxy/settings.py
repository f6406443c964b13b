"""What to run: the target, the drafter, the default tree and how to reach an upstream.
One validated object read by the composition root (`proxy.runtime`); the server's
settings (`proxy.server.settings`) extend it with the HTTP side.

Every setting has one flat name, under which the command line takes it (--NAME) and
`serve` reads it from the environment (DDTREE_NAME): a field's own name, and for the
default tree (a nested `TreeSettings`) its fields' names (kind, budget, depth, policy)."""

from __future__ import annotations

import re
from typing import Any, Mapping, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic.fields import FieldInfo

from proxy.adaptive.estimates import HALF_LIFE_S
from proxy.backend.vllm import Strategy
from proxy.decoding import TreeSettings
from proxy.drafter import DRAFTERS


class RuntimeSettings(BaseModel):
    """Proxy mode when `target_url` is set, else engine mode."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    target_url: str | None = Field(
        None,
        description="upstream vLLM base URL (proxy mode); several replicas of one model: "
        "a comma list, or the flag repeated; unset: engine mode",
    )
    affinity_tokens: int = Field(
        128,
        ge=1,
        description="several target URLs: requests whose first this many prompt tokens agree "
        "go to the same replica (its prefix cache)",
    )
    session_header: str | None = Field(
        None,
        description="proxy: a header sent with every call of a request, its value an id per "
        "request, so that a session-affinity router in front keeps the request on one "
        "backend (e.g. x-session-id for vllm-router --policy consistent_hash)",
    )
    target: str | None = Field(
        None, description="engine mode: local target model directory (unset: the shipped one)"
    )
    model: str | None = Field(
        None,
        description="proxy: the upstream model to serve (unset: its first); engine: its "
        "served name",
    )
    tokenizer: str | None = Field(
        None,
        description="proxy: a folder with the model's tokenizer files (unset: found from the "
        "served model's path or the Hugging Face cache here, else vLLM's /detokenize)",
    )
    generation_config: str = Field(
        "auto",
        description="proxy: as the upstream vLLM's --generation-config: auto (the model's "
        "generation_config.json), vllm (none), or the same folder on this host",
    )
    drafter: str | None = Field(
        None,
        description=f"NAME[:PATH], NAME one of {', '.join(sorted(DRAFTERS))} (unset: ngram "
        "in proxy mode, the shipped dflash in engine mode)",
    )
    tree: TreeSettings = Field(TreeSettings(), description="default tree shape per round")
    strategy: Strategy | None = Field(
        None, description="proxy: how a tree is verified upstream (unset: nodes)"
    )
    upstream_api_key: str | None = Field(None, description="key sent to the upstream vLLM")
    connect_timeout: float = Field(5.0, gt=0, description="upstream connect timeout, seconds")
    read_timeout: float = Field(120.0, gt=0, description="upstream read timeout, seconds")
    max_retries: int = Field(
        4, ge=0, le=20, description="retries of a failed idempotent upstream call (verification)"
    )
    retry_backoff: float = Field(
        0.05, ge=0, description="first retry's backoff, seconds; doubles per retry, jittered"
    )
    max_retry_backoff: float = Field(1.0, ge=0, description="cap on one retry's backoff, seconds")
    policy_half_life: float = Field(
        HALF_LIFE_S,
        gt=0,
        description="seconds after which what the adaptive policy measured weighs half "
        "(stretched alike behind an upstream with a stretched clock: the GPU simulator)",
    )
    policy_trace: str | None = Field(
        None,
        description="a file the adaptive policy appends one JSON line per decision to "
        "(docs/POLICY.md says how to read it)",
    )
    device: str | None = Field(
        None,
        description="in-process models: auto (cuda if present, else cpu), cpu, cuda[:N] "
        "(unset: auto)",
    )
    dtype: str | None = Field(
        None,
        description="in-process models: auto (bfloat16 on cuda, else float32), float32, "
        "bfloat16, float16 (unset: auto)",
    )
    torch_threads: int | None = Field(
        None,
        ge=1,
        description="intra-op threads of in-process models (unset: 1 in proxy mode, where "
        "more only fight vLLM for cores; torch's own in engine mode)",
    )

    @field_validator("target_url")
    @classmethod
    def _check_url(cls, url: str | None) -> str | None:
        if url is None:
            return None
        urls = [part.strip().rstrip("/") for part in url.split(",")]
        for part in urls:
            if not part.startswith(("http://", "https://")):
                raise ValueError(f"must start with http:// or https://, got {part!r}")
        if len(set(urls)) < len(urls):
            raise ValueError(f"a replica is listed twice: {url!r}")
        return ",".join(urls)

    @field_validator("session_header")
    @classmethod
    def _check_header(cls, name: str | None) -> str | None:
        if name and not re.fullmatch(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+", name):
            raise ValueError(f"not an HTTP header name: {name!r}")
        return name or None

    @field_validator("generation_config")
    @classmethod
    def _auto_when_empty(cls, value: str) -> str:
        return value or "auto"

    @field_validator("upstream_api_key", "model", "tokenizer", "drafter", "target", "policy_trace")
    @classmethod
    def _empty_is_none(cls, value: str | None) -> str | None:
        return value or None

    @property
    def proxy_mode(self) -> bool:
        return self.target_url is not None

    @property
    def target_urls(self) -> list[str]:
        """The upstream replicas' URLs (one, or several of one model); [] in engine mode."""
        return [] if self.target_url is None else self.target_url.split(",")


class Setting(NamedTuple):
    """One setting under its flat name."""

    name: str  # --NAME on the command line, DDTREE_NAME in serve's environment
    parent: str | None  # the nested model's field that holds it ("tree"), None: top level
    field: FieldInfo  # its type, bounds and description
    default: Any


def settings_of(model: type[BaseModel]) -> list[Setting]:
    """`model`'s settings by flat name: each field, a nested model's fields in its place."""
    found = []
    for name, field in model.model_fields.items():
        if isinstance(field.default, BaseModel):
            nested = type(field.default).model_fields
            found += [
                Setting(sub, name, nested[sub], getattr(field.default, sub)) for sub in nested
            ]
        else:
            found.append(Setting(name, None, field, field.default))
    names = [setting.name for setting in found]
    assert len(set(names)) == len(names), f"two settings share a flat name: {names}"
    return found


def nest(model: type[BaseModel], flat: Mapping[str, Any]) -> dict[str, Any]:
    """Values by flat name -> `model`'s keyword arguments ({"budget": 8} -> {"tree":
    {"budget": 8}}); names that are not settings of `model` are left out."""
    values: dict[str, Any] = {}
    for setting in settings_of(model):
        if setting.name not in flat:
            continue
        if setting.parent is None:
            values[setting.name] = flat[setting.name]
        else:
            values.setdefault(setting.parent, {})[setting.name] = flat[setting.name]
    return values
