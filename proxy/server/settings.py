"""Server settings: the runtime's (`proxy.settings.RuntimeSettings`) plus the HTTP side.
One validated object read from `serve`'s flags (`proxy.cli`) over DDTREE_<NAME>
environment variables over the defaults, and by the handlers (which read their
per-request defaults from it)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from proxy.ab.settings import ABSettings
from proxy.settings import RuntimeSettings, nest, settings_of

ENV_PREFIX = "DDTREE_"
LogLevel = Literal["critical", "error", "warning", "info", "debug"]


class ServerSettings(RuntimeSettings, BaseSettings):
    """How `ddtree-proxy serve` runs. Constructing one reads the DDTREE_* variables
    (pydantic-settings); keyword arguments win over them."""

    # An empty variable counts as unset (compose writes VAR: "" for "no value").
    model_config = SettingsConfigDict(env_ignore_empty=True, extra="forbid", frozen=True)

    host: str = Field("127.0.0.1", description="address to bind")
    port: int = Field(8080, ge=0, le=65535, description="port to bind (0: any free port)")
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
    log_level: LogLevel = Field(
        "info", description="log level of the proxy's own loggers and of uvicorn's"
    )
    ab: ABSettings = Field(ABSettings(), description="A/B split and shadow replays")

    @field_validator("api_key")
    @classmethod
    def _empty_key_is_none(cls, value: str | None) -> str | None:
        return value or None

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Keyword arguments (the flags), then the variables; no .env file, no secrets.
        return init_settings, _FlatEnvironment(settings_cls)


def env_var(name: str) -> str:
    """The environment variable of the setting with this flat name."""
    return ENV_PREFIX + name.upper()


class _FlatEnvironment(EnvSettingsSource):
    """DDTREE_<NAME> under each setting's flat name (`proxy.settings.settings_of`):
    DDTREE_BUDGET rather than pydantic-settings' DDTREE_TREE__BUDGET for the tree's.
    `env_vars` holds the variables' names in lower case: names match in any case."""

    def __call__(self) -> dict[str, Any]:
        names = {env_var(s.name).lower(): s.name for s in settings_of(self.settings_cls)}
        flat = {names[key]: value for key, value in self.env_vars.items() if key in names}
        return nest(self.settings_cls, flat)
