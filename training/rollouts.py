"""The target's own greedy continuations of corpus prefixes.

At temperature 0 speculative decoding only ever verifies the target's greedy path, so
that is the text a drafter must predict. Corpus text differs from it (a small target
drifts into its own habits: repeated lines, long runs of comments), so the DFlash
recipe trains drafters on target-generated text; we do the same for the last drafter
stage, and measure drafters on held-out greedy continuations as well.
"""

from __future__ import annotations

import torch
from tqdm import tqdm
from transformers import DynamicCache

from training.corpus import WindowSampler


@torch.inference_mode()
def greedy_rollouts(
    model: torch.nn.Module,
    prefixes: torch.Tensor,  # [N, P] int64
    num_new_tokens: int,
    batch_size: int,
    desc: str = "rollouts",
) -> torch.Tensor:
    """[N, P + num_new_tokens] int64: each prefix followed by the model's greedy tokens
    (EOS included, no stopping: the rows stay rectangular)."""
    rows = []
    batches = prefixes.split(batch_size)
    progress = tqdm(total=len(batches) * num_new_tokens, desc=desc, mininterval=5.0)
    for batch in batches:
        cache = DynamicCache(config=model.config)
        logits = model(input_ids=batch, cache=cache, use_cache=True).logits
        generated = []
        for _ in range(num_new_tokens):
            next_ids = logits[:, -1].argmax(-1, keepdim=True)  # [B, 1]
            generated.append(next_ids)
            logits = model(input_ids=next_ids, cache=cache, use_cache=True).logits
            progress.update(1)
        rows.append(torch.cat([batch, *generated], dim=1))
    progress.close()
    return torch.cat(rows)


def sample_prefixes(stream: torch.Tensor, length: int, num: int, seed: int) -> torch.Tensor:
    """[num, length] int64: random windows of the stream (reproducible from seed)."""
    sampler = WindowSampler(stream, length, num, seed)
    return sampler.next_batch()


class RowSampler:
    """Batches of whole rows of a fixed [N, S] tensor, in a new random order each epoch."""

    def __init__(self, rows: torch.Tensor, batch_size: int, seed: int):
        if len(rows) < batch_size:
            raise ValueError(f"{len(rows)} rows cannot fill a batch of {batch_size}")
        self.rows = rows
        self.batch_size = batch_size
        self._generator = torch.Generator().manual_seed(seed)
        self._order = torch.empty(0, dtype=torch.long)

    def next_batch(self) -> torch.Tensor:
        """[batch_size, S] int64."""
        if len(self._order) < self.batch_size:
            self._order = torch.randperm(len(self.rows), generator=self._generator)
        row_idx, self._order = self._order[: self.batch_size], self._order[self.batch_size :]
        return self.rows[row_idx]
