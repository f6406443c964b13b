"""A small causal LM that shares the target's tokenizer, rolled out greedily.

Each request keeps its own KV cache over the tokens it has seen. The cache holds
the committed tokens plus the drafted chain of the last round; at the next round
only the longest prefix that still agrees with the committed tokens is kept, so a
fully accepted draft costs no recomputation.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from transformers import DynamicCache

from proxy.backend.engine.hf import crop_cache, load_causal_lm, match_intra_op_threads
from proxy.drafter.base import InProcessDrafter, TargetInfo
from proxy.tree import DraftDistribution


class AutoregressiveSession:
    def __init__(self, drafter: "AutoregressiveDrafter"):
        self.model = drafter.model
        self._cache = DynamicCache(config=self.model.config)
        self._cached_tokens: list[int] = []  # tokens whose KV entries are in the cache

    def _feed(self, tokens: list[int]) -> torch.Tensor:
        """Append `tokens` to the cache; return the log-probs [vocab] after the last one."""
        start = len(self._cached_tokens)
        device = self.model.device
        out = self.model(
            input_ids=torch.tensor([tokens], dtype=torch.long, device=device),
            position_ids=torch.arange(start, start + len(tokens), device=device)[None],
            cache=self._cache,
            use_cache=True,
            logits_to_keep=1,
        )
        self._cached_tokens.extend(tokens)
        return torch.log_softmax(out.logits[0, -1].float(), dim=-1)

    draft_calls = 0  # an in-process drafter calls no server

    async def propose(self, committed: Sequence[int], depth: int, top_k: int) -> DraftDistribution:
        # Milliseconds of torch kernels, which release the GIL: in a worker thread.
        return await asyncio.to_thread(self.compute, committed, depth, top_k)

    def compute(self, committed: Sequence[int], depth: int, top_k: int) -> DraftDistribution:
        """`propose`, in the calling thread."""
        match_intra_op_threads()  # `propose` calls this in a worker thread
        committed = list(committed)
        keep = 0
        limit = min(len(self._cached_tokens), len(committed) - 1)  # re-feed at least the root
        while keep < limit and self._cached_tokens[keep] == committed[keep]:
            keep += 1
        if keep < len(self._cached_tokens):
            crop_cache(self._cache, keep)
            del self._cached_tokens[keep:]
        # Ranks past the drafter's vocabulary stay token 0 with log-prob -inf (base.py).
        token_ids = np.zeros((depth, top_k), dtype=np.int64)
        log_probs = np.full((depth, top_k), -np.inf, dtype=np.float64)
        with torch.inference_mode():
            step_logprobs = self._feed(committed[keep:])
            num_ranks = min(top_k, step_logprobs.shape[-1])
            for depth_idx in range(depth):
                values, indices = torch.topk(step_logprobs, num_ranks)
                token_ids[depth_idx, :num_ranks] = indices.cpu().numpy()
                log_probs[depth_idx, :num_ranks] = values.double().cpu().numpy()
                if depth_idx + 1 < depth:
                    step_logprobs = self._feed([int(indices[0])])
        return DraftDistribution(token_ids=token_ids, log_probs=log_probs)

    def advance(self, committed: Sequence[int], target_features: torch.Tensor | None) -> None:
        return None


class AutoregressiveDrafter(InProcessDrafter):
    name = "autoregressive"
    max_depth: int | None = None
    target_layer_ids: tuple[int, ...] | None = None

    def __init__(self, model: torch.nn.Module):
        self.model = model

    @classmethod
    def load(cls, path: str | None, target: TargetInfo) -> "AutoregressiveDrafter":
        if not path:
            raise ValueError(
                "the autoregressive drafter needs a model directory: "
                "--drafter autoregressive:PATH"
            )
        # Engine mode: the target's device and dtype; proxy mode: CPU float32.
        param = None if target.model is None else next(target.model.parameters())
        model = load_causal_lm(Path(path), torch.float32 if param is None else param.dtype)
        if param is not None:
            model.to(param.device)
        vocab_size = int(model.config.vocab_size)
        if vocab_size > target.vocab_size:
            raise ValueError(
                f"drafter vocab_size {vocab_size} exceeds the target's {target.vocab_size}: "
                "the drafter must share the target's tokenizer"
            )
        return cls(model)

    def start(
        self, prompt_ids: Sequence[int], prompt_features: torch.Tensor | None
    ) -> AutoregressiveSession:
        return AutoregressiveSession(self)
