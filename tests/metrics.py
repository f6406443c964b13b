"""The tests' one reader of a Prometheus /metrics page (the proxy's or vLLM's), on
prometheus_client's own parser of the text format."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import httpx
from prometheus_client.parser import text_string_to_metric_families


class Metrics(Mapping[str, float]):
    """Every sample of one page, keyed as the text format writes it: `name`, or
    `name{a="x",b="y"}` with the labels in name order. `samples` keeps each one's name,
    labels and value; `families` names the metrics declared, with or without samples (a
    labelled counter has none until its first label set)."""

    def __init__(self, text: str):
        families = list(text_string_to_metric_families(text))
        self.families = {family.name for family in families}
        self.samples = [sample for family in families for sample in family.samples]
        self._values = {_key(sample.name, sample.labels): sample.value for sample in self.samples}

    def __getitem__(self, key: str) -> float:
        return self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def total(self, name: str, **labels: str) -> float:
        """The sum of `name`'s samples whose labels include `labels` (0 when none do)."""
        return sum(
            sample.value
            for sample in self.samples
            if sample.name == name and labels.items() <= sample.labels.items()
        )


def scrape(url: str, headers: dict[str, str] | None = None) -> Metrics:
    """The /metrics page of the server at `url`."""
    return Metrics(httpx.get(url + "/metrics", timeout=30, headers=headers).text)


def _key(name: str, labels: dict[str, str]) -> str:
    if not labels:
        return name
    return name + "{" + ",".join(f'{key}="{labels[key]}"' for key in sorted(labels)) + "}"
