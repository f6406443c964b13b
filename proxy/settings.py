"""What to run: the target, the drafter, the default tree and how to reach an upstream.
One validated object read by the composition root (`proxy.runtime`); the server's
settings (`proxy.server.settings`) extend it with the HTTP side."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from proxy.backend.vllm import Strategy
from proxy.decoding import TreeSettings


class RuntimeSettings(BaseModel):
    """Proxy mode when `target_url` is set, else engine mode."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    target_url: str | None = Field(
        None, description="upstream vLLM base URL (proxy mode); None runs engine mode"
    )
    target: str | None = Field(
        None, description="engine mode: local target model directory (default: the shipped one)"
    )
    model: str | None = Field(
        None, description="proxy: the upstream model to serve (default: its first); engine: name"
    )
    tokenizer: str | None = Field(
        None,
        description="proxy: the model's tokenizer files here; None: found from the served "
        "model (proxy.model_files), else vLLM's /detokenize",
    )
    generation_config: str = Field(
        "auto",
        description="proxy: the upstream vLLM's --generation-config (auto: the model's "
        "generation_config.json; vllm: none; or the same folder, here), for the defaults "
        "the proxy must know",
    )
    drafter: str | None = Field(
        None, description="NAME[:PATH]; default ngram (proxy) or the shipped dflash (engine)"
    )
    tree: TreeSettings = Field(TreeSettings(), description="default tree shape per round")
    strategy: Strategy | None = Field(
        None, description="proxy: how a tree is verified upstream (default nodes)"
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
    policy_trace: str | None = Field(
        None,
        description="a file the adaptive policy appends one JSON line per decision to "
        "(docs/POLICY.md says how to read it)",
    )
    device: str | None = Field(
        None, description="in-process models: auto (cuda if present, else cpu), cpu, cuda[:N]"
    )
    dtype: str | None = Field(
        None, description="in-process models: auto (bfloat16 on cuda, else float32), float32, ..."
    )
    torch_threads: int | None = Field(
        None,
        ge=1,
        description="intra-op threads for in-process models; default 1 in proxy mode (small "
        "drafters: more threads only fight vLLM for cores), torch's own in engine mode",
    )

    @field_validator("target_url")
    @classmethod
    def _check_url(cls, url: str | None) -> str | None:
        if url is None:
            return None
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"must start with http:// or https://, got {url!r}")
        return url.rstrip("/")

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
