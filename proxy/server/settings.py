"""Server settings: the runtime's (`proxy.settings.RuntimeSettings`) plus the HTTP side.
One validated object shared by the CLI flags, DDTREE_* environment variables and the
handlers (which read their per-request defaults from it)."""

from __future__ import annotations

import os
from typing import Any, Literal, Mapping

from pydantic import Field, field_validator

from proxy.decoding import TreeSettings
from proxy.settings import RuntimeSettings

ENV_PREFIX = "DDTREE_"


class ServerSettings(RuntimeSettings):
    """How `ddtree-proxy serve` runs."""

    host: str = Field("127.0.0.1", description="address to bind")
    port: int = Field(8000, ge=0, le=65535, description="port to bind (0: any free port)")
    api_key: str | None = Field(None, description="clients must send Authorization: Bearer KEY")
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
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field(
        "info", description="uvicorn log level"
    )

    @field_validator("api_key")
    @classmethod
    def _empty_key_is_none(cls, value: str | None) -> str | None:
        return value or None


# Flat names (CLI dest == lower-case env suffix) -> where they go in ServerSettings.
_TREE_FIELDS = tuple(TreeSettings.model_fields)
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
