"""Engine mode: the target in-process, loaded with HuggingFace Transformers.

Per round ONE forward pass over [root, node_1 .. node_B] (`decoder.Decoder`, a lean
forward over the model's own weights): position ids are the root's position plus
each node's depth, and a boolean mask lets every query see the whole cached context
plus its own ancestors in the tree (and itself). Afterwards only the root and the
accepted path stay in the KV cache: their entries move down to follow the context.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from proxy.backend.base import SessionOptions, TargetCounters, Verification
from proxy.backend.engine.decoder import Decoder
from proxy.backend.engine.hf import load_causal_lm, match_intra_op_threads
from proxy.backend.engine.token_choice import select_tokens
from proxy.sampling import SamplingParams
from proxy.tree import DraftTree, WalkResult

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str | torch.device | None) -> torch.device:
    """None or "auto": CUDA when present, else the CPU. Refuses a device torch lacks."""
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"unknown device {device!r}: use auto, cpu, cuda or cuda:N") from exc
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but this machine has no CUDA device")
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {device!r}: use auto, cpu, cuda or cuda:N")
    return resolved


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """None or "auto": bfloat16 on CUDA, float32 on the CPU (exact-equality territory)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: use auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


class LocalTarget:
    """A Transformers causal LM as the target. Forwards run one at a time in a worker
    thread so an async server stays responsive."""

    label = "engine"
    strategies: tuple[str, ...] = ()  # one forward pass verifies the whole tree

    def __init__(self, model: torch.nn.Module, name: str):
        self.model = model
        self.decoder = Decoder(model)
        self.name = name
        config = model.config
        self.max_model_len = int(config.max_position_embeddings)
        eos = config.eos_token_id
        self.eos_token_ids: tuple[int, ...] = tuple(
            [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        )
        self._lock = threading.Lock()
        # One long-lived thread runs every forward: a fresh thread per request (the
        # default executor of each asyncio.run) would redo its thread set-up each time.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ddtree-target")

    async def run(self, func, *args):
        """func(*args) on the target's worker thread, awaited."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, func, *args)

    @classmethod
    def from_dir(
        cls,
        model_dir: str | Path,
        dtype: str | torch.dtype | None = None,
        device: str | torch.device | None = None,
    ) -> "LocalTarget":
        """Load `model_dir` on `device` (default: CUDA when present, else CPU) in
        `dtype` (default: bfloat16 on CUDA, float32 on CPU)."""
        model_dir = Path(model_dir)
        resolved = resolve_device(device)
        model = load_causal_lm(model_dir, resolve_dtype(dtype, resolved)).to(resolved)
        return cls(model, name=model_dir.name)

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
        session = LocalSession(
            self, options.sampling, options.feature_layer_ids, options.want_logprobs
        )
        await self.run(session.prefill, list(prompt_ids))
        return session

    async def health(self) -> tuple[bool, dict[str, Any]]:
        return True, {}

    async def aclose(self) -> None:
        return None  # the model lives as long as the process


class LocalSession:
    plain = None  # plain decoding here is a round of the root alone
    relay = None  # no server to send a request to

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
        self.replica = None  # one target, in this process
        # KV entries of the committed tokens but the root; during a verify also the tree.
        self._cache = target.decoder.new_cache()
        self._tree_features: torch.Tensor | None = None  # [num_nodes + 1, F] of the last verify

    def _forward(
        self,
        input_ids: np.ndarray,  # [n] int64
        positions: np.ndarray,  # [n] int64
        attention_mask: np.ndarray | None,  # [n, cache length + n] bool, None = see all
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the decoder; return the final hidden state [n, H] and features [n, F]."""
        match_intra_op_threads()  # runs in a worker thread (see the helper)
        device = self.target.decoder.device
        mask = None
        if attention_mask is not None:
            mask = torch.from_numpy(attention_mask).to(device)
        with self.target._lock, torch.inference_mode():
            return self.target.decoder.forward(
                self._cache,
                torch.from_numpy(input_ids).to(device),
                torch.from_numpy(positions).to(device),
                mask,
                self.feature_layer_ids,
            )

    def prefill(self, prompt_ids: list[int]) -> None:
        context = prompt_ids[:-1]
        if not context:
            if self.feature_layer_ids is not None:
                decoder = self.target.decoder
                width = decoder.hidden_size * len(self.feature_layer_ids)
                self.prompt_features = torch.zeros(
                    0, width, dtype=decoder.dtype, device=decoder.device
                )
            return
        input_ids = np.asarray(context, dtype=np.int64)
        _, self.prompt_features = self._forward(input_ids, np.arange(len(context)), None)
        self._cache.length = len(context)
        self.counters.verify_prompt_tokens += len(context)

    def _verify(self, committed: Sequence[int], tree: DraftTree) -> Verification:
        cache_len = self._cache.length
        assert len(committed) == cache_len + 1, (len(committed), cache_len)
        assert int(tree.token_ids[0]) == committed[-1], "tree root is not the last committed token"
        num_rows = tree.num_nodes + 1
        visible = None  # root only: it sees the whole context, nothing to mask
        if num_rows > 1:
            visible = np.ones((num_rows, cache_len + num_rows), dtype=bool)
            visible[:, cache_len:] = tree.ancestor_mask()
        hidden, self._tree_features = self._forward(
            tree.token_ids, tree.depths + cache_len, visible
        )
        with torch.inference_mode():
            logits = self.target.decoder.logits(hidden)  # [num_rows, vocab] fp32
        if not self.params.greedy:
            # Seeded draws use CPU generators: the same draws whatever the device.
            logits = logits.cpu()
        positions = tree.depths + len(committed)
        tokens = select_tokens(logits, positions, self.params)
        logprobs = None
        if self.want_logprobs:
            logprobs = (
                torch.log_softmax(logits, dim=-1)
                .gather(-1, torch.from_numpy(tokens).to(logits.device)[:, None])
                .squeeze(-1)
                .double()
                .cpu()
                .numpy()
            )
        self.counters.verify_prompt_tokens += num_rows
        return Verification(tokens=tokens, logprobs=logprobs)

    def _accept(self, tree: DraftTree, result: WalkResult) -> torch.Tensor | None:
        keep_rows = [0, *result.accepted_nodes]  # root first, then the accepted path
        with torch.inference_mode():
            self._cache.keep(self._cache.length, keep_rows)
            features = None
            if self._tree_features is not None:
                features = self._tree_features[keep_rows]
        self._tree_features = None
        return features

    async def verify(self, committed: Sequence[int], tree: DraftTree) -> Verification:
        return await self.target.run(self._verify, committed, tree)

    async def accept(self, tree: DraftTree, result: WalkResult) -> torch.Tensor | None:
        return self._accept(tree, result)

    async def aclose(self) -> None:
        self._cache = None
        self._tree_features = None
