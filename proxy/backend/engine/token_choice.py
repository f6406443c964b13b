"""Engine mode's token choice at each verified row: argmax, or an independent draw from
the target's filtered distribution, seeded per absolute position (`proxy.sampling`)."""

from __future__ import annotations

import numpy as np
import torch

from proxy.sampling import SamplingParams, derive_seed


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[n, vocab] float32 probabilities after temperature, top-k and top-p."""
    scaled = logits.float() / params.temperature
    if params.top_k > 0 and params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, sorted_idx = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, sorted_idx, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def select_tokens(
    logits: torch.Tensor,  # [n, vocab] float
    positions: np.ndarray,  # [n] int64: absolute position of the token being chosen
    params: SamplingParams,
) -> np.ndarray:  # [n] int64
    """The target's token for each row: argmax, or one independent draw per row."""
    assert logits.ndim == 2 and positions.shape == (logits.shape[0],)
    if params.greedy:
        return logits.argmax(dim=-1).cpu().numpy().astype(np.int64)
    probs = filtered_probs(logits, params)
    if params.seed is None:
        return torch.multinomial(probs, 1).squeeze(-1).cpu().numpy().astype(np.int64)
    tokens = np.empty(len(positions), dtype=np.int64)
    for row, position in enumerate(positions.tolist()):
        generator = torch.Generator().manual_seed(derive_seed(params.seed, position))
        tokens[row] = int(torch.multinomial(probs[row], 1, generator=generator))
    return tokens
