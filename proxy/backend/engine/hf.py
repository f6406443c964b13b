"""Small helpers around HuggingFace Transformers models, shared by the local backend
and the model-based drafters."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch
from transformers import AutoModelForCausalLM, DynamicCache

# Feature-layer convention (the one source; DFlash and the local backend use it). A
# target_layer_id `l` means "the output of decoder layer l" (0-based). In the
# `hidden_states` tuple of a Transformers forward with output_hidden_states=True,
# index 0 is the embedding output, so layer l's output is hidden_states[l + 1]
# (z-lab's `extract_context_feature` uses exactly this offset). For the last layer
# Transformers returns the final-norm output at that index; z-lab's reference does
# the same, so we follow it.
FEATURE_LAYER_OFFSET = 1


def select_target_features(
    hidden_states: Sequence[torch.Tensor | None], target_layer_ids: tuple[int, ...]
) -> torch.Tensor:
    """Concatenate a Transformers `hidden_states` sequence into DFlash features.

    hidden_states: num_layers + 1 tensors [..., H] (index 0 = embeddings; entries
    that no id selects may be None). Returns [..., len(target_layer_ids) * H],
    layers in `target_layer_ids` order.
    """
    return torch.cat([hidden_states[lid + FEATURE_LAYER_OFFSET] for lid in target_layer_ids], -1)


def match_intra_op_threads() -> None:
    """Give the calling thread the intra-op thread count `torch.set_num_threads` chose.

    OpenMP keeps that count per thread: a worker thread (`asyncio.to_thread`, where the
    loop and the local backend run every forward) starts at the OpenMP default -- all
    cores -- whatever the main thread set, and MKL's matmuls there fan out. Measured
    on the 2-core machines: a 64x512x2048 matmul loop ran 3-10x slower in a worker than
    in the main thread with `torch.set_num_threads(1)`, until the worker set it too.
    """
    torch.set_num_threads(torch.get_num_threads())


def load_causal_lm(model_dir: str | Path, dtype: torch.dtype = torch.float32):
    """Load a local causal LM directory for inference, with a clear error if it is absent."""
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"model directory {model_dir} not found (no config.json in it)")
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=dtype, attn_implementation="sdpa"
    )
    return model.eval()


def crop_cache(cache: DynamicCache, length: int) -> None:
    """Keep the first `length` positions of every layer of `cache`."""
    for layer in cache.layers:
        if getattr(layer, "keys", None) is not None and layer.keys.numel():
            layer.keys = layer.keys[:, :, :length]
            layer.values = layer.values[:, :, :length]
