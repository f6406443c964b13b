"""A lean forward pass over a Transformers Qwen3/Llama decoder's own weights.

Engine mode runs one small forward per round, so the per-op overhead of the
Transformers modules (mask builders, cache objects, output capture, ~60 calls per
layer) costs as much as the arithmetic on small targets. This forward does the same
math in about 25 tensor ops per layer over the model's own parameters:

* q/k/v and gate/up projections are each one matmul over a fused weight (the
  modules' own `weight`s become row slices of it, so fusing copies nothing and
  Transformers' own forward and `generate` keep working);
* one KV buffer holds every layer, so keeping the accepted path is one gather;
* RoPE comes from a table built once with the model's own rotary module;
* every matmul is a `proxy.backend.engine.linear.Linear`: on fp32 CPUs, oneDNN over a packed copy of
  the weight from 2 rows up (a tree, a prefill: about 2x MKL's speed here), MKL for one
  (one decoding step).

The math is Transformers' (RMSNorm in fp32, RoPE by halves, grouped-query SDPA), so
outputs agree with Transformers' forward to fp32 rounding (the lossless tests check
the tokens against `generate`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from proxy.backend.engine.hf import FEATURE_LAYER_OFFSET, select_target_features
from proxy.backend.engine.linear import Linear

SUPPORTED_MODEL_TYPES = ("llama", "qwen3")


class KVCache:
    """Keys and values of every layer in one buffer [layers, 2, 1, kv_heads, capacity,
    head_dim], grown by doubling. Positions [0, length) hold committed context."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, device, dtype):
        self.length = 0
        self.buffer = torch.empty(
            num_layers, 2, 1, num_kv_heads, 0, head_dim, device=device, dtype=dtype
        )
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []  # [1, kv_heads, cap, D] views

    def reserve(self, length: int) -> None:
        capacity = self.buffer.shape[4]
        if length <= capacity:
            return
        shape = list(self.buffer.shape)
        shape[4] = max(2 * capacity, length, 256)
        grown = self.buffer.new_empty(shape)
        grown[..., : self.length, :] = self.buffer[..., : self.length, :]
        self.buffer = grown
        # Per-layer views made once per growth, not once per layer and token.
        self.layers = [(layer[0], layer[1]) for layer in grown]

    def keep(self, start: int, rows: list[int]) -> None:
        """Keep rows `start + rows[i]` (i = 0, 1, ...) at `start + i`; drop the rest."""
        if rows != list(range(len(rows))):  # a prefix (chain, root only) is already in place
            src = torch.tensor(rows, device=self.buffer.device) + start
            # Gather first, then write: a kept row only moves down to its new slot.
            self.buffer[..., start : start + len(rows), :] = self.buffer.index_select(4, src)
        self.length = start + len(rows)


def _fuse(modules: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One [sum(out), in] weight (and bias) for Linears that read the same input; each
    module's parameters become row slices of it (contiguous views, no second copy)."""
    weight = torch.cat([module.weight.data for module in modules])
    bias = None
    if modules[0].bias is not None:
        bias = torch.cat([module.bias.data for module in modules])
    offset = 0
    for module in modules:
        rows = module.weight.shape[0]
        module.weight.data = weight[offset : offset + rows]
        if bias is not None:
            module.bias.data = bias[offset : offset + rows]
        offset += rows
    return weight, bias


class Decoder:
    """Runs a loaded Transformers causal LM (Qwen3 or Llama family) with few ops."""

    def __init__(self, model: torch.nn.Module):
        config = model.config
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"engine mode runs {', '.join(SUPPORTED_MODEL_TYPES)} targets; this one is "
                f"{model_type!r} (serve it in proxy mode)"
            )
        if config.hidden_act != "silu" or any(
            kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()
        ):
            raise ValueError(
                "engine mode needs SiLU MLPs and full attention in every layer "
                f"(hidden_act={config.hidden_act!r}, layer_types={config.layer_types})"
            )
        rope_type = config.rope_parameters.get("rope_type", "default")
        if "dynamic" in rope_type or rope_type == "longrope":
            raise ValueError(f"engine mode does not support length-dependent RoPE ({rope_type})")
        decoder = model.model
        self.num_layers = int(config.num_hidden_layers)
        self.hidden_size = int(config.hidden_size)
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or self.hidden_size // self.num_heads)
        self.intermediate_size = int(config.intermediate_size)
        self.eps = float(config.rms_norm_eps)
        self.embed = decoder.embed_tokens
        self.final_norm = decoder.norm.weight
        weight = self.embed.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.layers = [self._layer(layer) for layer in decoder.layers]
        self.lm_head = Linear.of(model.lm_head)
        positions = torch.arange(int(config.max_position_embeddings), device=self.device)
        with torch.inference_mode():
            cos, sin = decoder.rotary_emb(weight[:1], positions[None])
        half = self.head_dim // 2
        self.cos = cos[0].clone()  # [max_positions, head_dim]
        # rotate_half(x) * sin == roll(x, half) * [-sin_lo, sin_hi]
        self.sin_signed = torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1)

    def _layer(self, layer: torch.nn.Module) -> dict:
        attn, mlp = layer.self_attn, layer.mlp
        if getattr(mlp.gate_proj, "bias", None) is not None:
            raise ValueError("engine mode does not support MLP biases")
        qkv, qkv_bias = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
        gate_up, _ = _fuse([mlp.gate_proj, mlp.up_proj])
        qk_norm = None
        if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm per head on queries and keys
            qk_norm = torch.cat(
                [
                    attn.q_norm.weight.repeat(self.num_heads, 1),
                    attn.k_norm.weight.repeat(self.num_kv_heads, 1),
                ]
            )  # [heads + kv_heads, head_dim]
        return {
            "input_norm": layer.input_layernorm.weight,
            "qkv": Linear(qkv, qkv_bias),
            "qk_norm": qk_norm,
            "o": Linear.of(attn.o_proj),
            "post_norm": layer.post_attention_layernorm.weight,
            "gate_up": Linear(gate_up),
            "down": Linear.of(mlp.down_proj),
        }

    def new_cache(self) -> KVCache:
        return KVCache(self.num_layers, self.num_kv_heads, self.head_dim, self.device, self.dtype)

    def forward(
        self,
        cache: KVCache,
        input_ids: torch.Tensor,  # [n] int64, on self.device
        positions: torch.Tensor,  # [n] int64, on self.device
        attention_mask: torch.Tensor | None,  # [n, cache.length + n] bool (True = attend)
        feature_layer_ids: tuple[int, ...] | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Append the n tokens' keys/values after `cache.length` (the caller moves
        `cache.length`); return final-normed hidden states [n, H] and the features
        [n, F] of `feature_layer_ids` (as `select_target_features` defines them).

        attention_mask None: every query sees the whole cache, and, when the cache is
        empty, the n tokens causally (a prefill); else the mask says who sees whom."""
        num_tokens = input_ids.shape[0]
        start = cache.length
        end = start + num_tokens
        cache.reserve(end)
        num_heads, num_kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        num_qk = num_heads + num_kv_heads
        half = head_dim // 2
        cos = self.cos[positions][:, None]  # [n, 1, D]
        sin = self.sin_signed[positions][:, None]
        mask = None
        if attention_mask is not None:
            # Additive, made once: SDPA would convert a boolean mask in every layer.
            mask = torch.zeros(attention_mask.shape, device=self.device, dtype=self.dtype)
            mask.masked_fill_(~attention_mask, torch.finfo(self.dtype).min)
            mask = mask[None, None]
        causal = attention_mask is None and start == 0 and num_tokens > 1
        wanted = set()
        if feature_layer_ids is not None:
            # indices into the hidden_states sequence that select_target_features reads
            wanted = {layer_id + FEATURE_LAYER_OFFSET for layer_id in feature_layer_ids}
        states: list[torch.Tensor | None] = [None] * (self.num_layers + 1)

        hidden = self.embed(input_ids)  # [n, H]
        for layer_idx, w in enumerate(self.layers):
            x = F.rms_norm(hidden, (self.hidden_size,), w["input_norm"], self.eps)
            qkv = w["qkv"](x).view(num_tokens, num_qk + num_kv_heads, head_dim)
            qk = qkv[:, :num_qk]
            if w["qk_norm"] is not None:
                qk = F.rms_norm(qk, (head_dim,), None, self.eps) * w["qk_norm"]
            qk = torch.addcmul(qk * cos, qk.roll(half, -1), sin)  # RoPE
            keys, values = cache.layers[layer_idx]
            keys[0, :, start:end] = qk[:, num_heads:].transpose(0, 1)
            values[0, :, start:end] = qkv[:, num_qk:].transpose(0, 1)
            attn = F.scaled_dot_product_attention(
                qk[:, :num_heads].transpose(0, 1)[None],  # [1, heads, n, D]
                keys[:, :, :end],  # [1, kv_heads, end, D]
                values[:, :, :end],
                attn_mask=mask,
                is_causal=causal,
                enable_gqa=num_heads != num_kv_heads,
            )
            attn = attn[0].transpose(0, 1).reshape(num_tokens, num_heads * head_dim)
            hidden = hidden + w["o"](attn)
            x = F.rms_norm(hidden, (self.hidden_size,), w["post_norm"], self.eps)
            gate, up = w["gate_up"](x).split(self.intermediate_size, dim=-1)
            hidden = hidden + w["down"](F.silu(gate) * up)
            if layer_idx + 1 in wanted and layer_idx + 1 < self.num_layers:
                states[layer_idx + 1] = hidden  # hidden_states[i + 1]: decoder layer i's output
        hidden = F.rms_norm(hidden, (self.hidden_size,), self.final_norm, self.eps)
        # Transformers' last hidden_states entry is the final-norm output.
        states[self.num_layers] = hidden
        features = None
        if feature_layer_ids is not None:
            features = select_target_features(states, feature_layer_ids)
        return hidden, features

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, H] -> [n, vocab] fp32."""
        return self.lm_head(hidden).float()
