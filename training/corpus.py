"""The training corpus: the Python standard library's own `.py` files (PSF licence).

Selection is deterministic: every `.py` file under the stdlib directory, sorted by
relative path, minus test suites, IDLE, lib2to3, turtledemo and site-packages
(tests are large, repetitive fixtures rather than typical code). Every
`heldout_every`-th file of that sorted list (starting at `heldout_every // 2`) is held
out for evaluation and never seen in training -- not by the tokenizer either.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

EXCLUDED_DIRS = frozenset(
    {"test", "tests", "idlelib", "lib2to3", "turtledemo", "site-packages", "__pycache__"}
)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_source_files(root: Path) -> list[str]:
    """Relative posix paths of the corpus files under `root`, sorted."""
    files = []
    for path in root.rglob("*.py"):
        relative = path.relative_to(root)
        if EXCLUDED_DIRS.isdisjoint(relative.parts[:-1]):
            files.append(relative.as_posix())
    return sorted(files)


def split_heldout(files: list[str], heldout_every: int) -> tuple[list[str], list[str]]:
    """(train files, held-out files): every `heldout_every`-th file is held out."""
    if heldout_every < 2:
        raise ValueError(f"heldout_every must be >= 2, got {heldout_every}")
    offset = heldout_every // 2
    heldout = [name for file_idx, name in enumerate(files) if file_idx % heldout_every == offset]
    held = set(heldout)
    return [name for name in files if name not in held], heldout


def read_sources(root: Path, files: list[str]) -> list[str]:
    # A handful of stdlib files carry Latin-1 bytes in comments; replacing them keeps
    # the corpus text-only and the selection independent of the locale.
    return [(root / name).read_text(encoding="utf-8", errors="replace") for name in files]


def encode_documents(tokenizer, texts: list[str], eos_token_id: int) -> list[torch.Tensor]:
    """Each document as [EOS, tokens...] int64: EOS separates files, as a document
    boundary, so the model also learns how a file begins."""
    encodings = tokenizer.encode_batch(texts)
    return [torch.tensor([eos_token_id, *encoding.ids], dtype=torch.long) for encoding in encodings]


def chunk_documents(
    documents: list[torch.Tensor], max_len: int, min_len: int = 16
) -> list[torch.Tensor]:
    """Split every document into consecutive chunks of at most `max_len` tokens (chunks
    shorter than `min_len` are dropped): the evaluation windows."""
    chunks = []
    for document in documents:
        for start in range(0, len(document), max_len):
            chunk = document[start : start + max_len]
            if len(chunk) >= min_len:
                chunks.append(chunk)
    return chunks


@dataclass
class WindowSampler:
    """Random fixed-length windows from one token stream, reproducible from `seed`.

    Each epoch cuts the stream into non-overlapping windows at a random offset and
    visits them in a random order, so windows differ between epochs.
    """

    stream: torch.Tensor  # [num_tokens] int64, all training documents concatenated
    window_len: int
    batch_size: int
    seed: int

    def __post_init__(self):
        if len(self.stream) < 2 * self.window_len:
            raise ValueError("the token stream is shorter than two windows")
        self._generator = torch.Generator().manual_seed(self.seed)
        self._order = torch.empty(0, dtype=torch.long)
        self._offset = 0
        self.epoch = -1

    def _new_epoch(self) -> None:
        self.epoch += 1
        self._offset = int(torch.randint(self.window_len, (1,), generator=self._generator))
        num_windows = (len(self.stream) - self._offset) // self.window_len
        self._order = torch.randperm(num_windows, generator=self._generator)

    def next_batch(self) -> torch.Tensor:
        """[batch_size, window_len] int64."""
        if len(self._order) < self.batch_size:
            self._new_epoch()
        window_idx, self._order = self._order[: self.batch_size], self._order[self.batch_size :]
        starts = self._offset + window_idx * self.window_len
        return torch.stack([self.stream[start : start + self.window_len] for start in starts])
