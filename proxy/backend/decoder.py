"""A lean forward pass over a Transformers Qwen3/Llama decoder's own weights.

Engine mode runs one small forward per round, so the per-op overhead of the
Transformers modules (mask builders, cache objects, output capture, ~60 calls per
layer) costs as much as the arithmetic on small targets. This forward does the same
math in about 25 tensor ops per layer over the model's own parameters:

* q/k/v and gate/up projections are each one matmul over a fused weight;
* every weight is stored input-major (`[in, out]` contiguous; the module's
  `weight` becomes a transposed view of it, so Transformers' own forward and
  `generate` keep working on the same memory): MKL's small-M GEMM runs up to 1.7x
  faster on that layout than on the `[out, in]` one `F.linear` gets;
* one KV buffer holds every layer, so keeping the accepted path is one gather;
* RoPE comes from a table built once with the model's own rotary module.

The math is Transformers' (RMSNorm in fp32, RoPE by halves, grouped-query SDPA), so
outputs agree with Transformers' forward to fp32 rounding (the lossless tests check
the tokens against `generate`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from proxy.hf import select_target_features

SUPPORTED_MODEL_TYPES = ("llama", "qwen3")


class KVCache:
    """Keys and values of every layer: [layers, 2, kv_heads, capacity, head_dim],
    grown by doubling. Positions [0, length) hold committed context."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, device, dtype):
        self.length = 0
        self.buffer = torch.empty(
            num_layers, 2, num_kv_heads, 0, head_dim, device=device, dtype=dtype
        )

    def reserve(self, length: int) -> None:
        capacity = self.buffer.shape[3]
        if length <= capacity:
            return
        shape = list(self.buffer.shape)
        shape[3] = max(2 * capacity, length, 256)
        grown = self.buffer.new_empty(shape)
        grown[:, :, :, : self.length] = self.buffer[:, :, :, : self.length]
        self.buffer = grown

    def keep(self, start: int, rows: list[int]) -> None:
        """Keep rows `start + rows[i]` (i = 0, 1, ...) at `start + i`; drop the rest."""
        if rows != list(range(len(rows))):  # a prefix (chain, root only) is already in place
            src = torch.tensor(rows, device=self.buffer.device) + start
            # Gather first, then write: a kept row only moves down to its new slot.
            self.buffer[:, :, :, start : start + len(rows)] = self.buffer.index_select(3, src)
        self.length = start + len(rows)


def _input_major(weights: list[torch.Tensor]) -> torch.Tensor:
    """[in, sum(out)] contiguous copy of Linear weights [out_i, in] stacked along out."""
    return torch.cat(weights, dim=0).t().contiguous()


def _share(module: torch.nn.Linear, fused_t: torch.Tensor, start: int) -> None:
    """Point `module.weight` at its columns of `fused_t` (one copy of the weights)."""
    out = module.weight.shape[0]
    module.weight.data = fused_t[:, start : start + out].t()


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
        lm_head = model.lm_head
        if lm_head.weight is not self.embed.weight:  # tied: keep the embedding table row-major
            lm_head_t = lm_head.weight.t().contiguous()
            lm_head.weight.data = lm_head_t.t()
        self.lm_head_t = lm_head.weight.t()  # [H, vocab]
        self.lm_head_bias = lm_head.bias
        positions = torch.arange(int(config.max_position_embeddings), device=self.device)
        with torch.inference_mode():
            cos, sin = decoder.rotary_emb(weight[:1], positions[None])
        half = self.head_dim // 2
        self.cos = cos[0].clone()  # [max_positions, head_dim]
        # rotate_half(x) * sin == roll(x, half) * [-sin_lo, sin_hi]
        self.sin_signed = torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1)

    def _layer(self, layer: torch.nn.Module) -> dict:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
        qkv_t = _input_major([proj.weight.data for proj in qkv])
        offset = 0
        for proj in qkv:
            _share(proj, qkv_t, offset)
            offset += proj.weight.shape[0]
        qkv_bias = None
        if attn.q_proj.bias is not None:
            qkv_bias = torch.cat([proj.bias for proj in qkv])
        if getattr(mlp.gate_proj, "bias", None) is not None:
            raise ValueError("engine mode does not support MLP biases")
        gate_up_t = _input_major([mlp.gate_proj.weight.data, mlp.up_proj.weight.data])
        _share(mlp.gate_proj, gate_up_t, 0)
        _share(mlp.up_proj, gate_up_t, self.intermediate_size)
        for proj in (attn.o_proj, mlp.down_proj):
            proj.weight.data = proj.weight.data.t().contiguous().t()
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
            "qkv_t": qkv_t,
            "qkv_bias": qkv_bias,
            "qk_norm": qk_norm,
            "o_t": attn.o_proj.weight.t(),
            "o_bias": attn.o_proj.bias,
            "post_norm": layer.post_attention_layernorm.weight,
            "gate_up_t": gate_up_t,
            "down_t": mlp.down_proj.weight.t(),
        }

    def new_cache(self) -> KVCache:
        return KVCache(self.num_layers, self.num_kv_heads, self.head_dim, self.device, self.dtype)

    def forward(
        self,
        cache: KVCache,
        input_ids: torch.Tensor,  # [n] int64, on self.device
        positions: torch.Tensor,  # [n] int64, on self.device
        attention_mask: torch.Tensor | None,  # [n, cache.length + n] bool (True = attend) or None
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
        buffer = cache.buffer
        num_heads, num_kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        num_qk = num_heads + num_kv_heads
        half = head_dim // 2
        cos = self.cos[positions][:, None]  # [n, 1, D]
        sin = self.sin_signed[positions][:, None]
        mask = None if attention_mask is None else attention_mask[None, None]
        causal = attention_mask is None and start == 0 and num_tokens > 1
        wanted = set()
        if feature_layer_ids is not None:
            wanted = {layer_id + 1 for layer_id in feature_layer_ids}  # hidden_states indices
        states: list[torch.Tensor | None] = [None] * (self.num_layers + 1)

        hidden = self.embed(input_ids)  # [n, H]
        for layer_idx, w in enumerate(self.layers):
            x = F.rms_norm(hidden, (self.hidden_size,), w["input_norm"], self.eps)
            qkv = x @ w["qkv_t"]
            if w["qkv_bias"] is not None:
                qkv = qkv + w["qkv_bias"]
            qkv = qkv.view(num_tokens, num_qk + num_kv_heads, head_dim)
            qk = qkv[:, :num_qk]
            if w["qk_norm"] is not None:
                qk = F.rms_norm(qk, (head_dim,), None, self.eps) * w["qk_norm"]
            qk = torch.addcmul(qk * cos, qk.roll(half, -1), sin)  # RoPE
            buffer[layer_idx, 0, :, start:end] = qk[:, num_heads:].transpose(0, 1)
            buffer[layer_idx, 1, :, start:end] = qkv[:, num_qk:].transpose(0, 1)
            attn = F.scaled_dot_product_attention(
                qk[:, :num_heads].transpose(0, 1)[None],  # [1, heads, n, D]
                buffer[layer_idx, 0, :, :end][None],  # [1, kv_heads, end, D]
                buffer[layer_idx, 1, :, :end][None],
                attn_mask=mask,
                is_causal=causal,
                enable_gqa=num_heads != num_kv_heads,
            )
            attn = attn[0].transpose(0, 1).reshape(num_tokens, num_heads * head_dim) @ w["o_t"]
            if w["o_bias"] is not None:
                attn = attn + w["o_bias"]
            hidden = hidden + attn
            x = F.rms_norm(hidden, (self.hidden_size,), w["post_norm"], self.eps)
            gate, up = (x @ w["gate_up_t"]).split(self.intermediate_size, dim=-1)
            hidden = hidden + (F.silu(gate) * up) @ w["down_t"]
            if layer_idx + 1 in wanted and layer_idx + 1 < self.num_layers:
                states[layer_idx + 1] = hidden
        hidden = F.rms_norm(hidden, (self.hidden_size,), self.final_norm, self.eps)
        # Transformers' last hidden_states entry is the final-norm output.
        states[self.num_layers] = hidden
        features = None
        if feature_layer_ids is not None:
            features = select_target_features(states, feature_layer_ids)
        return hidden, features

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, H] -> [n, vocab] fp32."""
        logits = hidden @ self.lm_head_t
        if self.lm_head_bias is not None:
            logits = logits + self.lm_head_bias
        return logits.float()
