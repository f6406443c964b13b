"""Engine mode: the target in-process with HuggingFace Transformers.

Per round ONE forward pass over [root, node_1 .. node_B]: position ids are the
root's position plus each node's depth, and a 4-D additive mask lets every query
see the whole cached context plus its own ancestors in the tree (and itself).
Afterwards only the root and the accepted path stay in the KV cache: their entries
are moved down to follow the context (compact), and the rest is cut off (crop).
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any, Sequence

import torch
from transformers import DynamicCache

from proxy.backend.base import SessionOptions, TargetCounters, Verification
from proxy.backend.token_choice import select_tokens
from proxy.hf import FEATURE_LAYER_OFFSET, crop_cache, load_causal_lm
from proxy.sampling import SamplingParams
from proxy.tree import DraftTree, WalkResult


class LocalTarget:
    """A Transformers causal LM as the target. Forwards run one at a time in a worker
    thread so an async server stays responsive."""

    label = "engine"
    strategies: tuple[str, ...] = ()  # one forward pass verifies the whole tree
    can_stream = False  # plain decoding here is a round of the root alone

    def __init__(self, model: torch.nn.Module, name: str):
        self.model = model
        self.name = name
        config = model.config
        self.max_model_len = int(config.max_position_embeddings)
        eos = config.eos_token_id
        self.eos_token_ids: tuple[int, ...] = tuple(
            [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        )
        self._lock = threading.Lock()

    @classmethod
    def from_dir(cls, model_dir: str | Path, dtype: torch.dtype = torch.float32) -> "LocalTarget":
        model_dir = Path(model_dir)
        return cls(load_causal_lm(model_dir, dtype), name=model_dir.name)

    def check_options(self, options: SessionOptions) -> None:
        if options.strategy is not None:
            raise ValueError(
                "only proxy mode has verification strategies (engine mode verifies a tree "
                "in one forward pass)"
            )
        num_layers = int(self.model.config.num_hidden_layers)
        for layer_id in options.feature_layer_ids or ():
            if not 0 <= layer_id < num_layers:
                raise ValueError(
                    f"feature layer {layer_id} out of range for a target with {num_layers} layers"
                )

    async def start(self, prompt_ids: Sequence[int], options: SessionOptions) -> "LocalSession":
        self.check_options(options)
        session = LocalSession(self, options.sampling, options.feature_layer_ids, options.want_logprobs)
        await asyncio.to_thread(session.prefill, list(prompt_ids))
        return session

    async def health(self) -> tuple[bool, dict[str, Any]]:
        return True, {}

    async def aclose(self) -> None:
        return None  # the model lives as long as the process


class LocalSession:
    def __init__(
        self,
        target: LocalTarget,
        params: SamplingParams,
        feature_layer_ids: tuple[int, ...] | None,
        want_logprobs: bool,
    ):
        self.target = target
        self.params = params
        self.feature_layer_ids = feature_layer_ids
        self.want_logprobs = want_logprobs
        self.counters = TargetCounters()
        self.prompt_features: torch.Tensor | None = None
        self._cache = DynamicCache(config=target.model.config)
        self._cache_len = 0  # committed tokens whose KV entries are cached (all but the root)
        self._tree_features: torch.Tensor | None = None  # [num_nodes + 1, F] of the last verify

    def _forward(
        self,
        input_ids: torch.Tensor,  # [1, n] int64
        position_ids: torch.Tensor,  # [1, n] int64
        attention_mask: torch.Tensor | None,  # [1, 1, n, cache_len + n] float or None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the decoder; return the last hidden state [n, H] and features [n, F]."""
        want_features = self.feature_layer_ids is not None
        with self.target._lock, torch.inference_mode():
            out = self.target.model.model(
                input_ids=input_ids,
                position_ids=position_ids,
                attention_mask=attention_mask,
                cache=self._cache,
                use_cache=True,
                output_hidden_states=want_features,
            )
        features = None
        if want_features:
            features = torch.cat(
                [out.hidden_states[lid + FEATURE_LAYER_OFFSET][0] for lid in self.feature_layer_ids],
                dim=-1,
            )
        return out.last_hidden_state[0], features

    def prefill(self, prompt_ids: list[int]) -> None:
        context = prompt_ids[:-1]
        if not context:
            if self.feature_layer_ids is not None:
                hidden = int(self.target.model.config.hidden_size)
                width = hidden * len(self.feature_layer_ids)
                self.prompt_features = torch.zeros(0, width, dtype=self.target.model.dtype)
            return
        input_ids = torch.tensor([context], dtype=torch.long)
        position_ids = torch.arange(len(context), dtype=torch.long)[None]
        # A 2-D all-ones mask lets Transformers build the ordinary causal mask.
        _, self.prompt_features = self._forward(input_ids, position_ids, None)
        self._cache_len = len(context)
        self.counters.verify_prompt_tokens += len(context)

    def _verify(self, committed: Sequence[int], tree: DraftTree) -> Verification:
        assert len(committed) == self._cache_len + 1, (len(committed), self._cache_len)
        assert int(tree.token_ids[0]) == committed[-1], "tree root is not the last committed token"
        num_rows = tree.num_nodes + 1
        model = self.target.model
        dtype = model.dtype
        input_ids = torch.from_numpy(tree.token_ids)[None]
        position_ids = torch.from_numpy(tree.depths + self._cache_len)[None]
        visible = torch.ones(num_rows, self._cache_len + num_rows, dtype=torch.bool)
        visible[:, self._cache_len :] = torch.from_numpy(tree.ancestor_mask())
        mask = torch.zeros(visible.shape, dtype=dtype).masked_fill(
            ~visible, torch.finfo(dtype).min
        )[None, None]
        hidden, self._tree_features = self._forward(input_ids, position_ids, mask)
        with torch.inference_mode():
            logits = model.lm_head(hidden).float()  # [num_rows, vocab]
        positions = tree.depths + len(committed)
        tokens = select_tokens(logits, positions, self.params)
        logprobs = None
        if self.want_logprobs:
            logprobs = (
                torch.log_softmax(logits, dim=-1)
                .gather(-1, torch.from_numpy(tokens)[:, None])
                .squeeze(-1)
                .double()
                .numpy()
            )
        self.counters.verify_prompt_tokens += num_rows
        return Verification(tokens=tokens, logprobs=logprobs)

    def _accept(self, tree: DraftTree, result: WalkResult) -> torch.Tensor | None:
        keep_rows = [0, *result.accepted_nodes]  # root first, then the accepted path
        start = self._cache_len
        src = torch.tensor([start + row for row in keep_rows], dtype=torch.long)
        new_len = start + len(keep_rows)
        with torch.inference_mode():
            for layer in self._cache.layers:
                # Gather first, then write: a kept row only moves down to its new slot.
                layer.keys[:, :, start:new_len] = layer.keys.index_select(-2, src)
                layer.values[:, :, start:new_len] = layer.values.index_select(-2, src)
        crop_cache(self._cache, new_len)
        self._cache_len = new_len
        features = None
        if self._tree_features is not None:
            features = self._tree_features[keep_rows]
        self._tree_features = None
        return features

    async def verify(self, committed: Sequence[int], tree: DraftTree) -> Verification:
        return await asyncio.to_thread(self._verify, committed, tree)

    async def accept(self, tree: DraftTree, result: WalkResult) -> torch.Tensor | None:
        return self._accept(tree, result)

    async def aclose(self) -> None:
        self._cache = None
        self._tree_features = None
