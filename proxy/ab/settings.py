"""The A/B settings: one nested model of `ServerSettings`, its fields flat settings
(--ab-split, DDTREE_AB_SPLIT, ...)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from proxy.drafter import parse_drafter_spec


class ABSettings(BaseModel):
    """Traffic split between DDTree and vLLM, and shadow replays of direct answers."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ab_split: float | None = Field(
        None,
        ge=0,
        le=1,
        description="share of eligible requests served with DDTree, the others passed "
        "through to vLLM (unset: no split, all DDTree)",
    )
    ab_guardrail: bool = Field(
        False,
        description="set the split to 0 when DDTree's per-request tokens/s are "
        "significantly below direct's (a rank-sum test per block of 30 requests an arm, "
        "at levels that sum to 0.05 over a split)",
    )
    ab_window: float = Field(300.0, gt=0, description="the report's recent window, seconds")
    shadow: float = Field(
        0.0,
        ge=0,
        le=1,
        description="share of direct answers replayed through the shadow drafters and "
        "budgets",
    )
    shadow_drafters: str | None = Field(
        None, description="drafters to replay, comma-separated (unset: the serving drafter)"
    )
    shadow_budgets: str = Field("4,8,16", description="comma-separated budgets to replay")
    shadow_busy: float = Field(
        0.05,
        gt=0,
        le=1,
        description="share of the time replays may take (their CPU is taken from a local "
        "upstream): after a job of T seconds the worker rests T (1 / share - 1)",
    )
    shadow_probes: float = Field(
        0.0,
        ge=0,
        le=1,
        description="at most this share of upstream calls may be probe calls -- a "
        "replayed round's tree verified for real and timed -- to price the shadow's rounds "
        "while the DDTree arm has measured none (0: off)",
    )
    shadow_queue: int = Field(
        64, ge=1, description="answers waiting for a replay; beyond it, dropped (counted)"
    )

    @field_validator("shadow_drafters")
    @classmethod
    def _known_drafters(cls, value: str | None) -> str | None:
        if not value:
            return None
        specs = split_drafter_specs(value)
        for spec in specs:
            name, _ = parse_drafter_spec(spec)  # an unknown name raises, listing the valid ones
            if name == "dflash":
                raise ValueError("dflash needs the target's hidden states: it cannot replay")
        return ",".join(specs)

    @field_validator("shadow_budgets")
    @classmethod
    def _positive_budgets(cls, value: str) -> str:
        try:
            budgets = [int(part) for part in value.split(",") if part.strip()]
        except ValueError:
            raise ValueError(
                f"budgets must be integers separated by commas, got {value!r}"
            ) from None
        if not budgets or min(budgets) < 1 or max(budgets) > 4096:
            raise ValueError(f"budgets must be 1..4096, got {value!r}")
        return ",".join(str(budget) for budget in budgets)

    @property
    def drafter_specs(self) -> tuple[str, ...]:
        return tuple(split_drafter_specs(self.shadow_drafters or ""))

    @property
    def budgets(self) -> tuple[int, ...]:
        return tuple(int(part) for part in self.shadow_budgets.split(","))


def split_drafter_specs(text: str) -> list[str]:
    """ "ngram,vllm:URL,timeout=2,autoregressive:DIR" -> three specs: a part holding "="
    and no ":" is an OPTION=VALUE of the served drafter before it."""
    specs: list[str] = []
    for part in (part.strip() for part in text.split(",")):
        if not part:
            continue
        if specs and "=" in part and ":" not in part:
            specs[-1] += "," + part
        else:
            specs.append(part)
    return specs
