"""The DFlash drafter: z-lab/dflash checkpoints behind the `Drafter` protocol.

One `propose` = one forward of the draft network (`dflash_model.py`) over the block
[root, mask * (block_size - 1)] placed at the root's position, attending to the
target features of every committed token before the root. Block position d gives
the distribution of depth d, so `max_depth = block_size - 1`; the full block is run
even for a smaller depth because that is the shape the drafter was trained on.

Features (see `FEATURE_LAYER_OFFSET` in `proxy.backend.engine.hf`): for each committed token
the target has processed, the outputs of target decoder layers `target_layer_ids`
(0-based; Transformers `hidden_states[l + 1]`), concatenated in that order.

Each session caches, per draft layer, the keys/values of its context (they depend
only on the features and their absolute positions), so a round projects only the
new tokens' features and then runs block_size queries against the cache. New
features are projected lazily, at the next `propose`.

The draft network's matmuls and the output head run through `proxy.backend.engine.linear` (packed
oneDNN weights on fp32 CPUs, as the engine's target forward). Embeddings and output
head are the target's: shared modules in engine mode, or
just the `embed_tokens` / `lm_head` tensors read from the target's safetensors in
proxy mode (`lm_head` = `embed_tokens` when the target ties them).

Sliding-window layers (`layer_types` entries "sliding_attention", newer z-lab
checkpoints) are run with full attention, as z-lab's own Transformers and MLX
reference code does by default; a warning says so at load time.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from safetensors import safe_open

from proxy.backend.engine.hf import match_intra_op_threads
from proxy.backend.engine.linear import Linear, pack_linears
from proxy.drafter.base import InProcessDrafter, TargetInfo
from proxy.drafter.dflash_model import (
    FEATURE_LAYER_OFFSET,
    DFlashConfig,
    DFlashDraftModel,
    load_state,
    read_safetensors,
    save_checkpoint,
    select_target_features,
)
from proxy.tree import DraftDistribution

logger = logging.getLogger(__name__)

__all__ = [
    "FEATURE_LAYER_OFFSET",
    "DFlashConfig",
    "DFlashDraftModel",
    "DFlashDrafter",
    "DFlashSession",
    "save_checkpoint",
    "select_target_features",
]


class _ContextCache:
    """Per draft layer, keys and values of the context, grown by doubling."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, device, dtype):
        self.length = 0
        self._capacity = 0
        self._shape = (num_layers, 2, 1, num_kv_heads)
        self._head_dim = head_dim
        self._device, self._dtype = device, dtype
        self._buffer = torch.empty(*self._shape, 0, head_dim, device=device, dtype=dtype)

    def append(self, context_kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """context_kv: per layer (keys, values), each [1, kv_heads, n, D]."""
        num_new = context_kv[0][0].shape[2]
        if self.length + num_new > self._capacity:
            self._capacity = max(2 * self._capacity, self.length + num_new, 64)
            grown = torch.empty(
                *self._shape, self._capacity, self._head_dim, device=self._device, dtype=self._dtype
            )
            grown[..., : self.length, :] = self._buffer[..., : self.length, :]
            self._buffer = grown
        for layer_idx, (keys, values) in enumerate(context_kv):
            self._buffer[layer_idx, 0, ..., self.length : self.length + num_new, :] = keys
            self._buffer[layer_idx, 1, ..., self.length : self.length + num_new, :] = values
        self.length += num_new

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (keys, values) views, each [1, kv_heads, length, D]."""
        view = self._buffer[..., : self.length, :]
        return [(view[layer_idx, 0], view[layer_idx, 1]) for layer_idx in range(view.shape[0])]


class DFlashSession:
    """One request's drafter state: the projected context of all committed tokens
    but the root (the cache), plus features received but not yet projected."""

    def __init__(self, drafter: "DFlashDrafter", num_committed: int, prompt_features: torch.Tensor):
        self._drafter = drafter
        config = drafter.config
        param = next(drafter.model.parameters())
        self._cache = _ContextCache(
            config.num_hidden_layers,
            config.num_key_value_heads,
            config.head_dim,
            param.device,
            param.dtype,
        )
        self._pending: list[torch.Tensor] = []  # [n, F] chunks not yet in the cache
        self._num_context = 0  # tokens whose features were received (cached + pending)
        self._take(prompt_features, num_committed)

    @property
    def num_context(self) -> int:
        return self._num_context

    def _take(self, features: torch.Tensor | None, num_committed: int) -> None:
        expected = num_committed - 1 - self._num_context
        width = self._drafter.config.feature_size
        if features is None:
            if expected == 0:
                return
            raise ValueError("the dflash drafter needs target features; the target gave none")
        if features.ndim != 2 or features.shape != (expected, width):
            raise ValueError(
                f"dflash expected target features [{expected}, {width}] for the tokens the "
                f"target processed since the last call, got {list(features.shape)}"
            )
        if expected:
            self._pending.append(features)
            self._num_context += expected

    def _flush(self) -> None:
        if not self._pending:
            return
        features = torch.cat(self._pending)
        self._pending.clear()
        param = next(self._drafter.model.parameters())
        start = self._cache.length
        positions = torch.arange(start, start + features.shape[0], device=param.device)
        features = features.to(device=param.device, dtype=param.dtype)[None]
        self._cache.append(self._drafter.model.context_kv(features, positions[None]))

    draft_calls = 0  # an in-process drafter calls no server

    async def propose(self, committed: Sequence[int], depth: int, top_k: int) -> DraftDistribution:
        # Milliseconds of torch kernels, which release the GIL: in a worker thread.
        return await asyncio.to_thread(self.compute, committed, depth, top_k)

    def compute(self, committed: Sequence[int], depth: int, top_k: int) -> DraftDistribution:
        """`propose`, in the calling thread."""
        drafter = self._drafter
        if not 1 <= depth <= drafter.max_depth:
            raise ValueError(
                f"dflash proposes depths 1..{drafter.max_depth} (block_size - 1), got {depth}"
            )
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        assert len(committed) - 1 == self._num_context, (len(committed), self._num_context)
        match_intra_op_threads()  # `propose` calls this in a worker thread
        with torch.inference_mode():
            self._flush()
            log_probs = drafter.block_log_probs(int(committed[-1]), self._cache.layers(), depth)
            num_ranks = min(top_k, log_probs.shape[-1])
            values, indices = torch.topk(log_probs, num_ranks, dim=-1)
        token_ids = np.zeros((depth, top_k), dtype=np.int64)
        out_log_probs = np.full((depth, top_k), -np.inf, dtype=np.float64)
        token_ids[:, :num_ranks] = indices.cpu().numpy()
        out_log_probs[:, :num_ranks] = values.double().cpu().numpy()
        return DraftDistribution(token_ids=token_ids, log_probs=out_log_probs)

    def advance(self, committed: Sequence[int], target_features: torch.Tensor | None) -> None:
        self._take(target_features, len(committed))


class DFlashDrafter(InProcessDrafter):
    """z-lab DFlash drafter. Load with `DFlashDrafter.load(checkpoint_dir, target)`."""

    name = "dflash"

    def __init__(
        self,
        model: DFlashDraftModel,
        embed: torch.nn.Module,
        lm_head: torch.nn.Module,
    ):
        self.model = model.eval()
        pack_linears(self.model)
        self.config: DFlashConfig = model.config
        self.max_depth: int | None = self.config.max_depth
        self.target_layer_ids: tuple[int, ...] | None = self.config.target_layer_ids
        self._embed = embed  # token ids [n] int64 -> [n, H]
        self._lm_head = Linear.of(lm_head)  # [n, H] -> logits [n, vocab]

    @classmethod
    def load(
        cls,
        path: str | None,
        target: TargetInfo,
        *,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> "DFlashDrafter":
        """Load the checkpoint in directory `path` (config.json + *.safetensors).

        device/dtype default to the target's embeddings in engine mode; in proxy mode
        to CUDA in the checkpoint's dtype when available, else CPU float32.
        """
        if not path:
            raise ValueError(
                "the dflash drafter needs a checkpoint directory: --drafter dflash:PATH"
            )
        checkpoint_dir = Path(path)
        config = DFlashConfig.from_json(checkpoint_dir / "config.json")
        validate_for_target(config, target, checkpoint_dir)
        if target.model is not None:
            embed_module, lm_head_module = _target_modules(target.model)
            weight = embed_module.weight
            embed, lm_head = embed_module, lm_head_module
            device = device or weight.device
            dtype = dtype or weight.dtype
        else:
            if device is None:
                device = "cuda" if torch.cuda.is_available() else "cpu"
            if dtype is None:
                on_cpu = torch.device(device).type == "cpu"
                dtype = torch.float32 if on_cpu else getattr(torch, config.dtype)
            embed_weight, lm_head_weight = read_target_head(target)
            embed_weight = embed_weight.to(device=device, dtype=dtype)
            lm_head_weight = lm_head_weight.to(device=device, dtype=dtype)
            embed = torch.nn.Embedding.from_pretrained(embed_weight, freeze=True)
            lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            lm_head.weight = torch.nn.Parameter(lm_head_weight, requires_grad=False)
        _check_head(embed, lm_head, config)
        if any(kind == "sliding_attention" for kind in config.layer_types or ()):
            logger.warning(
                "%s: sliding-window layers run with full attention (as in z-lab's reference)",
                checkpoint_dir,
            )
        with torch.device("meta"):  # no throw-away random init of a large drafter
            model = DFlashDraftModel(config)
        load_state(model, read_safetensors(checkpoint_dir), str(checkpoint_dir))
        model.to(device=device, dtype=dtype)
        model.requires_grad_(False)
        return cls(model, embed, lm_head)

    def start(
        self, prompt_ids: Sequence[int], prompt_features: torch.Tensor | None
    ) -> DFlashSession:
        if len(prompt_ids) < 1:
            raise ValueError("dflash needs a prompt of at least one token")
        return DFlashSession(self, len(prompt_ids), prompt_features)

    def block_log_probs(
        self, root: int, context_kv: list[tuple[torch.Tensor, torch.Tensor]], depth: int
    ) -> torch.Tensor:
        """Log-probs [depth, vocab] fp32 of depths 1..depth after `root`, given the
        context's cached keys/values (each [1, kv_heads, C, D])."""
        config = self.config
        param = next(self.model.parameters())
        num_context = context_kv[0][0].shape[2]
        block_ids = [root] + [config.mask_token_id] * (config.block_size - 1)
        block_ids = torch.tensor(block_ids, device=self._embed.weight.device)
        positions = torch.arange(num_context, num_context + config.block_size, device=param.device)
        noise = self._embed(block_ids)[None].to(param.device)  # [1, block_size, H]
        hidden = self.model.forward_block(noise, positions[None], context_kv)
        hidden = hidden[0, 1 : 1 + depth].to(self._lm_head.weight)
        logits = self._lm_head(hidden)  # [depth, vocab]
        return torch.log_softmax(logits.float(), dim=-1)


def validate_for_target(config: DFlashConfig, target: TargetInfo, source: Path) -> None:
    """Refuse a checkpoint made for another target, naming the field that disagrees."""
    num_layers = target.num_hidden_layers
    ids = list(config.target_layer_ids)
    if any(not 0 <= lid < num_layers for lid in ids):
        raise ValueError(
            f"dflash_config.target_layer_ids {ids} in {source}/config.json name layers the "
            f"target lacks: it has {num_layers} layers (valid ids 0..{num_layers - 1})"
        )
    if config.num_target_layers is not None and config.num_target_layers != num_layers:
        raise ValueError(
            f"num_target_layers={config.num_target_layers} in {source}/config.json, but the "
            f"target has {num_layers} layers: the drafter was made for another target"
        )
    if config.hidden_size != target.hidden_size:
        raise ValueError(
            f"hidden_size={config.hidden_size} in {source}/config.json, but the target's "
            f"hidden size is {target.hidden_size}: the drafter was made for another target"
        )
    if config.vocab_size != target.vocab_size:
        raise ValueError(
            f"vocab_size={config.vocab_size} in {source}/config.json, but the target's "
            f"vocabulary has {target.vocab_size} entries"
        )
    if not 0 <= config.mask_token_id < config.vocab_size:
        raise ValueError(
            f"dflash_config.mask_token_id={config.mask_token_id} in {source}/config.json is "
            f"outside the vocabulary (size {config.vocab_size})"
        )


def _target_modules(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The in-process target's input embedding and output head (engine mode: a
    Transformers causal LM)."""
    embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    if embed is None or lm_head is None:
        raise ValueError(
            f"dflash cannot find embed_tokens/lm_head on the target {type(model).__name__}"
        )
    return embed, lm_head


def _check_head(embed, lm_head, config: DFlashConfig) -> None:
    expected = [config.vocab_size, config.hidden_size]
    for name, module in (("embed_tokens", embed), ("lm_head", lm_head)):
        shape = list(module.weight.shape)
        if shape != expected:
            raise ValueError(
                f"the target's {name} has shape {shape}; the DFlash config expects {expected}"
            )


def read_target_head(target: TargetInfo) -> tuple[torch.Tensor, torch.Tensor]:
    """Only `embed_tokens` and `lm_head` from the target's safetensors (proxy mode).

    Returns (embed_tokens [vocab, H], lm_head [vocab, H]); the latter is the former
    when the checkpoint has no lm_head because the target ties its embeddings.
    """
    if target.model_dir is None:
        raise ValueError(
            "the dflash drafter needs the target's embed_tokens/lm_head: give the target's "
            "local model directory (TargetInfo.model_dir) in proxy mode"
        )
    model_dir = Path(target.model_dir)
    key_to_file = _safetensors_index(model_dir)
    embed_key = _pick_key(key_to_file, "embed_tokens.weight", model_dir)
    lm_head_key = _pick_key(key_to_file, "lm_head.weight", model_dir, required=False)
    if lm_head_key is None and not _ties_embeddings(model_dir):
        raise ValueError(
            f"{model_dir}: no lm_head.weight in the safetensors and the config does not "
            "set tie_word_embeddings"
        )
    tensors: dict[str, torch.Tensor] = {}
    for key in filter(None, (embed_key, lm_head_key)):
        with safe_open(str(key_to_file[key]), framework="pt") as handle:
            tensors[key] = handle.get_tensor(key)
    embed = tensors[embed_key]
    return embed, embed if lm_head_key is None else tensors[lm_head_key]


def _safetensors_index(model_dir: Path) -> dict[str, Path]:
    """tensor name -> file holding it, from the shard index or the files' headers."""
    index_path = model_dir / "model.safetensors.index.json"
    if index_path.is_file():
        weight_map = json.loads(index_path.read_text())["weight_map"]
        return {key: model_dir / filename for key, filename in weight_map.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in the target directory {model_dir}")
    key_to_file: dict[str, Path] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            key_to_file.update({key: path for key in handle.keys()})
    return key_to_file


def _pick_key(key_to_file: dict[str, Path], suffix: str, model_dir: Path, required: bool = True):
    """The one tensor named `suffix` at the top level or under the language model
    (`model.embed_tokens.weight`, `model.language_model.embed_tokens.weight`, ...)."""
    candidates = sorted(key for key in key_to_file if key == suffix or key.endswith("." + suffix))
    preferred = [key for key in candidates if "vision" not in key and "visual" not in key]
    language_model = [f"model.{suffix}", f"model.language_model.{suffix}", suffix]
    if len(preferred) > 1 and any(key in language_model for key in preferred):
        preferred = [key for key in preferred if key in language_model]
    if len(preferred) > 1:
        preferred = [
            key for key in preferred if key.count(".") == min(k.count(".") for k in preferred)
        ]
    if len(preferred) == 1:
        return preferred[0]
    if not preferred and not required:
        return None
    raise ValueError(
        f"{model_dir}: expected one tensor named *{suffix} in the safetensors, found {candidates}"
    )


def _ties_embeddings(model_dir: Path) -> bool:
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        return False
    raw = json.loads(config_path.read_text())
    tied = raw.get("tie_word_embeddings")
    if tied is None:
        tied = (raw.get("text_config") or {}).get("tie_word_embeddings", True)
    return bool(tied)
