"""The sampling defaults vLLM applies to the fields a request leaves unset, as far as
the proxy can know them.

vLLM 0.32 (`--generation-config`, default `auto`) takes them from the model's
generation_config.json -- or, with no such file, from config.json, as Transformers'
`GenerationConfig.from_model_config` does -- reading eight keys, the non-null ones
(vllm/config/model.py, `ModelConfig.get_diff_sampling_param`): repetition_penalty,
presence_penalty, frequency_penalty, temperature, top_k, top_p, min_p, and
max_new_tokens (as max_tokens). `--generation-config vllm` reads none; a folder reads
that folder's file instead, and its max_new_tokens then caps every request (the
serving classes' `override_max_tokens`). A request's own value wins field by field
(`CompletionRequest.to_sampling_params`); a chat request without max_tokens gets the
default max_tokens, a completion request its own default of 16
(vllm/entrypoints/serve/utils/api_utils.py, `get_max_tokens`).

How the proxy honours each:
* applied by vLLM: every call the proxy makes carries only the sampling fields the
  client set (`proxy.backend.vllm`), so vLLM fills in the rest exactly as for a direct
  request -- temperature, top_p, top_k, min_p and repetition_penalty (which counts
  prompt and output tokens alike, so a node's prompt sees what a direct step sees);
* known to the proxy: temperature (greedy or not), max_tokens and the folder's cap (how
  far the proxy's own loop runs);
* passed through: presence_penalty and frequency_penalty count output tokens only,
  which a node's prompt does not have: a request that leaves a non-zero default in force
  goes to vLLM unchanged, as one that sets them itself does.
Where the model's files are not on the proxy's host (`auto` without them), the defaults
are unknown: vLLM still applies them on every call, but the proxy assumes neutral
values for what it must know itself, and says so at start-up.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The keys vLLM reads (ModelConfig.get_diff_sampling_param), by vLLM's request names.
SAMPLING_FIELDS = (
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
)
# Penalties over output tokens only: a node's prompt has none, so they cannot be honoured.
OUTPUT_PENALTIES = ("presence_penalty", "frequency_penalty")
# vLLM's own values for unset fields (CompletionRequest._DEFAULT_SAMPLING_PARAMS).
NEUTRAL: dict[str, float | int] = {
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
}
MODES = ("auto", "vllm")  # or a folder


@dataclass(frozen=True)
class GenerationDefaults:
    """What a server running `--generation-config <mode>` applies to unset fields."""

    # vLLM's request names (max_tokens for max_new_tokens); only the ones a file sets.
    values: dict[str, float | int] = field(default_factory=dict)
    known: bool = True  # False: the files are not on this host (values then empty)
    source: str = "--generation-config vllm"  # where they came from, for the log
    max_tokens_cap: int | None = None  # a folder's max_new_tokens caps every request

    def get(self, name: str) -> float | int:
        """The value vLLM uses for `name` when a request leaves it unset (assumed neutral
        when unknown)."""
        return self.values.get(name, NEUTRAL[name])

    def passthrough_reason(self, body: dict[str, Any]) -> str | None:
        """"default_<field>" for the first output penalty with a non-zero default that
        the request does not set itself (null counts as unset, as in vLLM), else None."""
        for name in OUTPUT_PENALTIES:
            if self.values.get(name, 0) != 0 and body.get(name) is None:
                return f"default_{name}"
        return None

    def describe(self) -> str:
        """One line for the start-up log."""
        if not self.known:
            return (
                f"unknown ({self.source}): vLLM applies its own, the proxy assumes neutral "
                "values for temperature and max_tokens; pass --tokenizer DIR or "
                "--generation-config DIR"
            )
        if not self.values:
            return f"none ({self.source})"
        shown = " ".join(f"{name}={value}" for name, value in self.values.items())
        passed = [name for name in OUTPUT_PENALTIES if self.values.get(name, 0) != 0]
        line = f"{shown} ({self.source}; applied by vLLM"
        if self.max_tokens_cap is not None:
            line += f"; max_tokens={self.max_tokens_cap} caps every request"
        if passed:
            line += f"; requests leaving {' or '.join(passed)} unset pass through"
        return line + ")"


def load_generation_defaults(mode: str, model_dir: Path | None) -> GenerationDefaults:
    """The defaults of a server started with `--generation-config mode` ("auto",
    "vllm", or a folder) on the model whose files are in `model_dir` here (None: not on
    this host). A folder must exist here (it names the server's folder: a copy of it)."""
    if mode == "vllm":
        return GenerationDefaults()
    if mode == "auto":
        if model_dir is None:
            return GenerationDefaults(known=False, source="the model's files are not on this host")
        values, source = _read(model_dir)
        return GenerationDefaults(values, source=f"{source}, --generation-config auto")
    folder = Path(mode)
    if not folder.is_dir():
        raise FileNotFoundError(f"--generation-config {mode}: no such directory here")
    values, source = _read(folder)
    return GenerationDefaults(
        values, source=f"{source}, --generation-config DIR", max_tokens_cap=values.get("max_tokens")
    )


def _read(directory: Path) -> tuple[dict[str, float | int], str]:
    """The non-null keys vLLM reads, from generation_config.json, else config.json (with
    its text_config's keys where the top level lacks them)."""
    for name in ("generation_config.json", "config.json"):
        path = directory / name
        if not path.is_file():
            continue
        config = json.loads(path.read_text())
        if name == "config.json":  # the decoder's keys where the top level has none
            top = {key: value for key, value in config.items() if value is not None}
            config = {**(config.get("text_config") or {}), **top}
        values = {key: config[key] for key in SAMPLING_FIELDS if config.get(key) is not None}
        if config.get("max_new_tokens") is not None:
            values["max_tokens"] = config["max_new_tokens"]
        return values, f"{path}"
    return {}, f"no generation_config.json or config.json in {directory}"
