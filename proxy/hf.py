"""Small helpers around HuggingFace Transformers models, shared by the local backend
and the model-based drafters."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache

# hidden_states[0] of a Transformers forward is the embedding output, so the output
# of decoder layer `layer_id` is hidden_states[layer_id + 1] (z-lab DFlash convention).
FEATURE_LAYER_OFFSET = 1


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
