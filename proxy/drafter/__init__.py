"""Drafters behind one interface (`proxy.drafter.base`), chosen by name."""

from __future__ import annotations

import importlib

from proxy.drafter.base import Drafter, DraftError, DraftSession, TargetInfo

# name -> "module:Class"; imported on use so a drafter's heavy imports stay lazy.
DRAFTERS: dict[str, str] = {
    "dflash": "proxy.drafter.dflash:DFlashDrafter",
    "autoregressive": "proxy.drafter.autoregressive:AutoregressiveDrafter",
    "ngram": "proxy.drafter.ngram:NgramDrafter",
    "vllm": "proxy.drafter.served:ServedDrafter",  # a draft model on its own vLLM server
}


def parse_drafter_spec(spec: str) -> tuple[str, str | None]:
    """'NAME' or 'NAME:PATH' -> (name, path or None); unknown names raise ValueError."""
    name, _, path = spec.partition(":")
    if name not in DRAFTERS:
        raise ValueError(f"unknown drafter {name!r}; valid drafters: {', '.join(sorted(DRAFTERS))}")
    return name, path or None


def drafter_class(name: str) -> type:
    module_name, _, class_name = DRAFTERS[name].partition(":")
    return getattr(importlib.import_module(module_name), class_name)


def load_drafter(spec: str, target: TargetInfo) -> Drafter:
    name, path = parse_drafter_spec(spec)
    return drafter_class(name).load(path, target)


__all__ = ["DRAFTERS", "DraftError", "DraftSession", "Drafter", "TargetInfo", "load_drafter", "parse_drafter_spec"]
