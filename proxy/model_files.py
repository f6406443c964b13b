"""The served model's files on the proxy's host: where they are, found once at start-up.

The proxy reads three things from them: the tokenizer (`tokenizer.json`, so text is
decoded here and never by a call to vLLM per token), the EOS ids, and the generation
defaults vLLM applies (`proxy.generation_defaults`). Where to look, first hit wins:

1. `--tokenizer DIR`: the user's own pointer (a copy of the model's files, or just its
   tokenizer files);
2. the served model's `root` in vLLM's /v1/models -- the path or hub id vLLM loaded,
   whatever `--served-model-name` calls it -- when it is a directory here;
3. the same hub id's snapshot in the Hugging Face cache here (`HF_HUB_CACHE`, else
   `HF_HOME/hub`, else `~/.cache/huggingface/hub`), where a vLLM on the same host
   downloaded it.

A file found in none of them is `None`: the caller says what it does without it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "config.json"


@dataclass(frozen=True)
class ModelFiles:
    """Where the served model's files are here (None: not on this host)."""

    model_dir: Path | None  # holds config.json (and generation_config.json, if any)
    tokenizer_dir: Path | None  # holds tokenizer.json (and tokenizer_config.json)
    # Where each was found, for the start-up log: "--tokenizer", "served path", "HF cache".
    found_by: dict[str, str]


def find_model_files(root: str | None, tokenizer: str | Path | None = None) -> ModelFiles:
    """The model's files for a served model whose /v1/models `root` is `root`;
    `tokenizer`: the --tokenizer directory (FileNotFoundError if it has no
    tokenizer.json: the user named it, so a wrong path is an error, not a fallback)."""
    candidates: list[tuple[str, Path]] = []
    if tokenizer is not None:
        tokenizer = Path(tokenizer)
        if not (tokenizer / TOKENIZER_FILE).is_file():
            raise FileNotFoundError(
                f"tokenizer directory {tokenizer} not found (no {TOKENIZER_FILE})"
            )
        candidates.append(("--tokenizer", tokenizer))
    if root:
        if Path(root).is_dir():
            candidates.append(("served path", Path(root)))
        snapshot = hub_snapshot(root)
        if snapshot is not None:
            candidates.append(("HF cache", snapshot))
    found_by: dict[str, str] = {}
    model_dir = _first_with(candidates, CONFIG_FILE, found_by, "model_dir")
    tokenizer_dir = _first_with(candidates, TOKENIZER_FILE, found_by, "tokenizer_dir")
    return ModelFiles(model_dir, tokenizer_dir, found_by)


def _first_with(
    candidates: list[tuple[str, Path]], name: str, found_by: dict[str, str], key: str
) -> Path | None:
    for how, directory in candidates:
        if (directory / name).is_file():
            found_by[key] = f"{directory} ({how})"
            return directory
    return None


def hub_cache_dirs() -> list[Path]:
    """Where the Hugging Face hub keeps downloaded models on this host (as its own
    client resolves it: HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub)."""
    if os.environ.get("HF_HUB_CACHE"):
        return [Path(os.environ["HF_HUB_CACHE"])]
    home = os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface"
    return [Path(home) / "hub"]


def hub_snapshot(model_id: str) -> Path | None:
    """The cached snapshot of hub model `model_id` ("org/name"): the one `refs/main`
    names, else the only snapshot there is; None if not cached here."""
    parts = model_id.split("/")
    if len(parts) != 2 or not all(parts) or model_id.startswith((".", "/")):
        return None
    for cache in hub_cache_dirs():
        repo = cache / f"models--{parts[0]}--{parts[1]}"
        main = repo / "refs" / "main"
        if main.is_file():
            snapshot = repo / "snapshots" / main.read_text().strip()
            if snapshot.is_dir():
                return snapshot
        snapshots = sorted(p for p in (repo / "snapshots").glob("*") if p.is_dir())
        if len(snapshots) == 1:
            return snapshots[0]
    return None
