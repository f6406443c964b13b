"""Server settings: one validated object shared by the CLI flags, DDTREE_* environment
variables and the HTTP layer (which reads its per-request defaults from it)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, field_validator

from proxy.decoding import TreeSettings

ENV_PREFIX = "DDTREE_"
PROXY_DEFAULT_DRAFTER = "ngram"

Strategy = Literal["nodes", "paths"]


class ServerSettings(BaseModel):
    """How `ddtree-proxy serve` runs. Proxy mode when `target_url` is set, else engine mode."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    target_url: str | None = Field(
        None, description="upstream vLLM base URL (proxy mode); None serves engine mode"
    )
    target: str | None = Field(
        None, description="engine mode: local target model directory (default: the shipped one)"
    )
    model: str | None = Field(
        None, description="proxy: the upstream model to serve (default: its first); engine: name"
    )
    tokenizer: str | None = Field(
        None, description="proxy: local tokenizer directory; None uses vLLM's /tokenize"
    )
    drafter: str | None = Field(
        None, description="NAME[:PATH]; default ngram (proxy) or the shipped dflash (engine)"
    )
    tree: TreeSettings = Field(TreeSettings(), description="default tree shape per round")
    strategy: Strategy = Field("nodes", description="proxy: how a tree is verified upstream")
    host: str = Field("127.0.0.1", description="address to bind")
    port: int = Field(8000, ge=0, le=65535, description="port to bind (0: any free port)")
    api_key: str | None = Field(None, description="clients must send Authorization: Bearer KEY")
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
    request_timeout: float = Field(
        600.0, gt=0, description="deadline of one generation request, seconds (then 504)"
    )
    max_active: int = Field(64, ge=1, description="generation requests served at once")
    max_queue: int = Field(
        256, ge=0, description="requests waiting for a slot; beyond it, 429 with Retry-After"
    )
    max_body_bytes: int = Field(
        4 * 1024 * 1024, ge=1024, description="largest request body accepted (then 413)"
    )
    torch_threads: int | None = Field(
        None,
        ge=1,
        description="intra-op threads for in-process models; default 1 in proxy mode (small "
        "drafters: more threads only fight vLLM for cores), torch's own in engine mode",
    )
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field(
        "info", description="uvicorn log level"
    )

    @field_validator("target_url")
    @classmethod
    def _check_url(cls, url: str | None) -> str | None:
        if url is None:
            return None
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"must start with http:// or https://, got {url!r}")
        return url.rstrip("/")

    @field_validator("api_key", "upstream_api_key", "model", "tokenizer", "drafter", "target")
    @classmethod
    def _empty_is_none(cls, value: str | None) -> str | None:
        return value or None

    @property
    def proxy_mode(self) -> bool:
        return self.target_url is not None


# Flat names (CLI dest == lower-case env suffix) -> where they go in ServerSettings.
_TREE_FIELDS = ("budget", "depth", "kind")
_FLAT_FIELDS = tuple(name for name in ServerSettings.model_fields if name != "tree")


def settings_from_sources(
    cli: Mapping[str, Any], env: Mapping[str, str] | None = None
) -> ServerSettings:
    """Merge CLI values (None = not given) over DDTREE_<NAME> environment variables over
    the defaults, and validate the result (pydantic.ValidationError names the field)."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    for name in (*_FLAT_FIELDS, *_TREE_FIELDS):
        value = cli.get(name)
        if value is None:
            # An empty variable counts as unset (compose writes VAR: "" for "no value").
            value = env.get(ENV_PREFIX + name.upper()) or None
        if value is not None:
            values[name] = value
    tree = {name: values.pop(name) for name in _TREE_FIELDS if name in values}
    if tree:
        values["tree"] = TreeSettings(**tree)
    return ServerSettings(**values)


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
