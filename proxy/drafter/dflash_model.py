"""The DFlash block-diffusion draft network, in z-lab/dflash's checkpoint format.

DFlash (z-lab/dflash, `dflash/model.py`) drafts a whole block in ONE forward pass.
The block is the root token followed by `block_size - 1` mask tokens, embedded with
the TARGET's `embed_tokens`; a few Qwen3-style layers run over it with
*bidirectional* attention, and the TARGET's `lm_head` turns block position d
(1 <= d < block_size) into the distribution of the d-th token after the root.

The target's context enters through attention only. The target's hidden states of
the context tokens at `target_layer_ids` are concatenated (in that order) and mapped
by `fc` + `hidden_norm` to one vector per context token. In every layer, keys and
values are [k/v_proj(context) ; k/v_proj(block)], with `k_norm` and RoPE applied to
both parts (the context is NOT passed through `input_layernorm`). Positions are
absolute: context token i sits at position i, block position j at
`num_context + j`, so the root sits at its own position in the sequence. Queries
come from the block alone. Because the context's keys/values depend only on the
context features and their positions -- not on any other layer's output -- they
can be computed once per token and cached (`context_kv`).

Checkpoint layout (what `load_state_dict(strict=True)` sees):
    fc.weight                                 [H, len(target_layer_ids) * H]
    hidden_norm.weight, norm.weight           [H]
    layers.{i}.input_layernorm.weight         [H]
    layers.{i}.post_attention_layernorm.weight [H]
    layers.{i}.self_attn.{q,k,v,o}_proj.weight (+ .bias when attention_bias)
    layers.{i}.self_attn.{q,k}_norm.weight    [head_dim]
    layers.{i}.mlp.{gate,up,down}_proj.weight
There is no embed_tokens / lm_head (the target's are used) and no rotary buffer.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from transformers import Qwen3Config
from transformers.activations import ACT2FN
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

# The feature-layer convention lives in proxy.backend.engine.hf (the backend hands features out by it);
# re-exported here because it is part of the DFlash checkpoint format.
from proxy.backend.engine.hf import FEATURE_LAYER_OFFSET, select_target_features  # noqa: F401

ARCHITECTURE = "DFlashDraftModel"


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """z-lab's default feature layers when a config gives none: the middle layer for
    a one-layer drafter, else layers spread evenly over [1, num_target_layers - 3]."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    first, last = 1, num_target_layers - 3
    span = last - first
    return tuple(
        int(round(first + layer_idx * span / (num_draft_layers - 1)))
        for layer_idx in range(num_draft_layers)
    )


def _dflash_field(raw: dict[str, Any], name: str) -> Any:
    """A DFlash-specific field: z-lab's Qwen3 checkpoints keep mask_token_id and
    target_layer_ids in `dflash_config` and block_size at top level; newer ones move
    block_size into `dflash_config` too; some third-party ones put all at top level."""
    dflash_config = raw.get("dflash_config") or {}
    if name in dflash_config:
        return dflash_config[name]
    return raw.get(name)


def _rope_parameters(raw: dict[str, Any]) -> dict[str, Any]:
    """Normalise rope_theta + rope_scaling (Transformers 4.x configs, as z-lab ships
    them) or rope_parameters (5.x) into one rope_parameters dict."""
    if raw.get("rope_parameters") is None and raw.get("rope_theta") is None:
        raise ValueError("DFlash config.json has neither rope_theta nor rope_parameters")
    keys = ("rope_theta", "rope_scaling", "rope_parameters", "head_dim", "hidden_size")
    keys += ("num_attention_heads", "max_position_embeddings")
    qwen3 = Qwen3Config(**{key: raw[key] for key in keys if raw.get(key) is not None})
    return dict(qwen3.rope_parameters)


@dataclass(frozen=True)
class DFlashConfig:
    """The fields of a z-lab DFlash `config.json` that define the network."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    block_size: int  # root + (block_size - 1) mask tokens; max depth = block_size - 1
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    rope_parameters: dict[str, Any]
    max_position_embeddings: int
    num_target_layers: int | None = None  # the target's layer count, when recorded
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    hidden_act: str = "silu"
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None
    dtype: str = "bfloat16"  # dtype the checkpoint is stored in
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def max_depth(self) -> int:
        return self.block_size - 1

    @property
    def feature_size(self) -> int:
        """Width F of the target features: one hidden vector per target layer."""
        return len(self.target_layer_ids) * self.hidden_size

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "DFlashConfig":
        architectures = raw.get("architectures") or [ARCHITECTURE]
        if architectures != [ARCHITECTURE]:
            raise ValueError(
                f"unsupported DFlash architecture {architectures}: this loader reads "
                f"z-lab {ARCHITECTURE} checkpoints"
            )
        required = ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size")
        for key in required + ("num_attention_heads", "num_key_value_heads"):
            if key not in raw:
                raise ValueError(f"DFlash config.json lacks {key!r}")
        if int(raw["num_hidden_layers"]) < 1:
            raise ValueError("DFlash config.json needs num_hidden_layers >= 1")
        block_size = _dflash_field(raw, "block_size")
        if block_size is None or int(block_size) < 2:
            raise ValueError(f"DFlash config.json needs block_size >= 2, got {block_size}")
        mask_token_id = _dflash_field(raw, "mask_token_id")
        if mask_token_id is None:
            raise ValueError("DFlash config.json lacks dflash_config.mask_token_id")
        num_target_layers = raw.get("num_target_layers")
        target_layer_ids = _dflash_field(raw, "target_layer_ids")
        if target_layer_ids is None:
            if num_target_layers is None:
                raise ValueError(
                    "DFlash config.json has neither dflash_config.target_layer_ids "
                    "nor num_target_layers"
                )
            target_layer_ids = build_target_layer_ids(num_target_layers, raw["num_hidden_layers"])
        hidden_size = int(raw["hidden_size"])
        num_heads = int(raw["num_attention_heads"])
        if raw.get("target_hidden_size", hidden_size) != hidden_size:
            raise ValueError(
                f"DFlash config.json: target_hidden_size={raw['target_hidden_size']} differs "
                f"from hidden_size={hidden_size}; such drafters are not supported"
            )
        layer_types = raw.get("layer_types")
        known = set(cls.__dataclass_fields__) | {"rope_theta", "rope_scaling", "torch_dtype"}
        known |= {"architectures", "dflash_config", "model_type"}
        return cls(
            hidden_size=hidden_size,
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=num_heads,
            num_key_value_heads=int(raw["num_key_value_heads"]),
            head_dim=int(raw.get("head_dim") or hidden_size // num_heads),
            vocab_size=int(raw["vocab_size"]),
            block_size=int(block_size),
            target_layer_ids=tuple(int(lid) for lid in target_layer_ids),
            mask_token_id=int(mask_token_id),
            rope_parameters=_rope_parameters(raw),
            max_position_embeddings=int(raw.get("max_position_embeddings", 40960)),
            num_target_layers=None if num_target_layers is None else int(num_target_layers),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            attention_bias=bool(raw.get("attention_bias", False)),
            hidden_act=str(raw.get("hidden_act", "silu")),
            layer_types=None if layer_types is None else tuple(layer_types),
            sliding_window=raw.get("sliding_window"),
            dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "bfloat16"),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=raw.get("eos_token_id"),
            extra={key: value for key, value in raw.items() if key not in known},
        )

    @classmethod
    def from_json(cls, path: str | Path) -> "DFlashConfig":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"DFlash checkpoint config {path} not found")
        return cls.from_dict(json.loads(path.read_text()))

    @classmethod
    def for_target(
        cls,
        target_config: Any,
        mask_token_id: int,
        num_hidden_layers: int = 1,
        block_size: int = 8,
        target_layer_ids: tuple[int, ...] | None = None,
        intermediate_size: int | None = None,
    ) -> "DFlashConfig":
        """A drafter shaped for `target_config` (a Transformers Qwen3/Llama config):
        the target's width, heads, vocabulary and RoPE; layers and block chosen here."""
        num_target_layers = int(target_config.num_hidden_layers)
        if target_layer_ids is None:
            target_layer_ids = build_target_layer_ids(num_target_layers, num_hidden_layers)
        hidden_size = int(target_config.hidden_size)
        num_heads = int(target_config.num_attention_heads)
        return cls(
            hidden_size=hidden_size,
            intermediate_size=intermediate_size or int(target_config.intermediate_size),
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=int(target_config.num_key_value_heads),
            head_dim=int(getattr(target_config, "head_dim", None) or hidden_size // num_heads),
            vocab_size=int(target_config.vocab_size),
            block_size=block_size,
            target_layer_ids=tuple(target_layer_ids),
            mask_token_id=mask_token_id,
            rope_parameters=dict(target_config.rope_parameters),
            max_position_embeddings=int(target_config.max_position_embeddings),
            num_target_layers=num_target_layers,
            rms_norm_eps=float(target_config.rms_norm_eps),
            attention_bias=bool(getattr(target_config, "attention_bias", False)),
            hidden_act=str(target_config.hidden_act),
            dtype="float32",
            bos_token_id=target_config.bos_token_id,
            eos_token_id=target_config.eos_token_id,
        )

    def to_dict(self) -> dict[str, Any]:
        """config.json in the layout of z-lab's Qwen3 checkpoints (Qwen3-8B-DFlash-b16):
        Transformers-4.x rope fields, block_size/num_target_layers at top level,
        mask_token_id/target_layer_ids in dflash_config."""
        rope = dict(self.rope_parameters)
        rope_theta = rope.pop("rope_theta")
        rope_scaling = rope if rope.get("rope_type", "default") != "default" else None
        raw: dict[str, Any] = {
            **self.extra,
            "architectures": [ARCHITECTURE],
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "block_size": self.block_size,
            "bos_token_id": self.bos_token_id,
            "dflash_config": {
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layer_ids),
            },
            "dtype": self.dtype,
            "eos_token_id": self.eos_token_id,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "layer_types": list(self.layer_types or ["full_attention"] * self.num_hidden_layers),
            "max_position_embeddings": self.max_position_embeddings,
            "model_type": "qwen3",
            "num_attention_heads": self.num_attention_heads,
            "num_hidden_layers": self.num_hidden_layers,
            "num_key_value_heads": self.num_key_value_heads,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_scaling": rope_scaling,
            "rope_theta": rope_theta,
            "sliding_window": self.sliding_window,
            "tie_word_embeddings": False,
            "use_cache": True,
            "use_sliding_window": False,
            "vocab_size": self.vocab_size,
        }
        if self.num_target_layers is not None:
            raw["num_target_layers"] = self.num_target_layers
        return raw


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, then scaled in the input dtype (as Qwen3's)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)  # one fused op
        return self.weight * normed.to(x.dtype)


class RotaryEmbedding:
    """Non-interleaved RoPE (Qwen3/Llama). inv_freq stays fp32 and outside the
    state dict; the Transformers initialisers cover the scaled variants (yarn, llama3,
    ...). Dynamic variants are used with their initial frequencies."""

    def __init__(self, config: DFlashConfig):
        rope_type = config.rope_parameters.get("rope_type", "default")
        if rope_type == "default":
            theta = float(config.rope_parameters["rope_theta"])
            # explicit CPU: the model may be built under a meta-device context
            exponents = torch.arange(0, config.head_dim, 2, dtype=torch.float32, device="cpu")
            exponents = exponents / config.head_dim
            self.inv_freq = 1.0 / theta**exponents  # [head_dim / 2] fp32
            self.attention_scaling = 1.0
        else:
            if rope_type not in ROPE_INIT_FUNCTIONS:
                raise ValueError(f"unsupported rope_type {rope_type!r} in DFlash config")
            hf_config = Qwen3Config(
                hidden_size=config.hidden_size,
                num_attention_heads=config.num_attention_heads,
                head_dim=config.head_dim,
                max_position_embeddings=config.max_position_embeddings,
                rope_parameters=dict(config.rope_parameters),
            )
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
            self.inv_freq = inv_freq.float()
            self.attention_scaling = float(scaling)

    def __call__(
        self, position_ids: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [B, S] int64 -> (cos, sin), each [B, 1, S, head_dim] in `dtype`."""
        inv_freq = self.inv_freq.to(position_ids.device)
        freqs = position_ids[..., None].float() * inv_freq  # [B, S, head_dim / 2]
        angles = torch.cat([freqs, freqs], dim=-1)[:, None]  # [B, 1, S, head_dim]
        cos = angles.cos() * self.attention_scaling
        sin = angles.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)

    def tables(
        self, position_ids: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin_signed) for `_apply_rope`: sin with its first half negated, so that
        rotate_half(x) * sin == x.roll(half) * sin_signed (one op instead of four)."""
        cos, sin = self(position_ids, dtype)
        half = sin.shape[-1] // 2
        return cos, torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x [B, heads, S, D]; cos/sin_signed [B, 1, S, D] from `RotaryEmbedding.tables`."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin_signed)


class DFlashAttention(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        bias = config.attention_bias
        hidden, head_dim = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(hidden, self.num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * head_dim, hidden, bias=bias)
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps)

    def project_kv(
        self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, S, H] -> keys (normed, rotated) and values, each [B, kv_heads, S, D]."""
        batch, length, _ = x.shape
        keys = self.k_norm(self.k_proj(x).view(batch, length, self.num_kv_heads, self.head_dim))
        values = self.v_proj(x).view(batch, length, self.num_kv_heads, self.head_dim)
        return _apply_rope(keys.transpose(1, 2), cos, sin_signed), values.transpose(1, 2)

    def forward(
        self,
        x: torch.Tensor,  # [B, Q, H] block hidden states (after input_layernorm)
        cos: torch.Tensor,  # [B, 1, Q, D] at the block positions
        sin_signed: torch.Tensor,
        context_keys: torch.Tensor,  # [B, kv_heads, C, D]
        context_values: torch.Tensor,  # [B, kv_heads, C, D]
        attention_mask: torch.Tensor | None,  # [B or 1, 1, Q, C + Q] bool (True = attend)
    ) -> torch.Tensor:
        batch, length, _ = x.shape
        queries = self.q_norm(self.q_proj(x).view(batch, length, self.num_heads, self.head_dim))
        queries = _apply_rope(queries.transpose(1, 2), cos, sin_signed)
        block_keys, block_values = self.project_kv(x, cos, sin_signed)
        keys = torch.cat([context_keys, block_keys], dim=2)
        values = torch.cat([context_values, block_values], dim=2)
        # No mask at inference: the block sees all context and itself, both ways.
        out = F.scaled_dot_product_attention(
            queries,
            keys,
            values,
            attn_mask=attention_mask,
            scale=1.0 / math.sqrt(self.head_dim),
            enable_gqa=self.num_heads != self.num_kv_heads,
        )  # [B, heads, Q, D]
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


class DFlashMLP(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.self_attn = DFlashAttention(config)
        self.mlp = DFlashMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden, cos, sin_signed, context_keys, context_values, attention_mask):
        attn_in = self.input_layernorm(hidden)
        hidden = hidden + self.self_attn(
            attn_in, cos, sin_signed, context_keys, context_values, attention_mask
        )
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DFlashDraftModel(nn.Module):
    """The draft network; parameter names equal z-lab's `DFlashDraftModel`."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(
            [DFlashDecoderLayer(config) for _ in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.fc = nn.Linear(config.feature_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config)

    @classmethod
    def random(cls, config: DFlashConfig, seed: int = 0, std: float = 0.02) -> "DFlashDraftModel":
        """Random weights (normal(0, std) matrices, unit norms), fp32, for tests/training."""
        generator = torch.Generator().manual_seed(seed)
        model = cls(config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.fill_(1.0)
                elif name.endswith(".bias"):
                    param.zero_()
                else:
                    param.copy_(torch.randn(param.shape, generator=generator) * std)
        return model

    def context_kv(
        self,
        target_hidden: torch.Tensor,  # [B, C, F] target features of the context tokens
        position_ids: torch.Tensor,  # [B, C] int64 their absolute positions
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the context's keys and values, each [B, kv_heads, C, D]."""
        context = self.hidden_norm(self.fc(target_hidden.to(self.fc.weight.dtype)))
        cos, sin_signed = self.rotary.tables(position_ids, context.dtype)
        return [layer.self_attn.project_kv(context, cos, sin_signed) for layer in self.layers]

    def forward_block(
        self,
        noise_embedding: torch.Tensor,  # [B, Q, H] target embeddings of [root, mask, ...]
        position_ids: torch.Tensor,  # [B, Q] int64 absolute positions of the block
        context_kv: list[tuple[torch.Tensor, torch.Tensor]],  # from `context_kv`
        attention_mask: torch.Tensor | None = None,  # [B or 1, 1, Q, C + Q] bool
    ) -> torch.Tensor:
        """Final-normed hidden states [B, Q, H]; the target's lm_head makes logits."""
        hidden = noise_embedding.to(self.fc.weight.dtype)
        cos, sin_signed = self.rotary.tables(position_ids, hidden.dtype)
        for layer, (context_keys, context_values) in zip(self.layers, context_kv, strict=True):
            hidden = layer(hidden, cos, sin_signed, context_keys, context_values, attention_mask)
        return self.norm(hidden)

    def forward(
        self,
        noise_embedding: torch.Tensor,  # [B, Q, H]
        target_hidden: torch.Tensor,  # [B, C, F]
        position_ids: torch.Tensor,  # [B, C + Q] int64: context positions, then block positions
        attention_mask: torch.Tensor | None = None,  # [B or 1, 1, Q, C + Q] bool; None = all
    ) -> torch.Tensor:
        """Batch forward (training, reference): same call shape as z-lab's, so a trainer
        can pack many blocks per sequence with a block mask (each block sees context
        before its root and itself). Returns final-normed hidden states [B, Q, H]."""
        num_context = target_hidden.shape[1]
        context_kv = self.context_kv(target_hidden, position_ids[:, :num_context])
        return self.forward_block(
            noise_embedding, position_ids[:, num_context:], context_kv, attention_mask
        )


def read_safetensors(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint in `directory` (model.safetensors or shards)."""
    directory = Path(directory)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in DFlash checkpoint {directory}")
    state: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():
                state[key] = handle.get_tensor(key)
    return state


def load_state(model: DFlashDraftModel, state: dict[str, torch.Tensor], source: str) -> None:
    """Strict load with a readable error for wrong key sets or shapes."""
    expected = set(model.state_dict())
    missing = sorted(expected - set(state))
    unexpected = sorted(set(state) - expected)
    if missing or unexpected:
        raise ValueError(
            f"{source}: tensors do not match a {ARCHITECTURE} of this config: "
            f"missing {missing[:6]}{'...' if len(missing) > 6 else ''}, "
            f"unexpected {unexpected[:6]}{'...' if len(unexpected) > 6 else ''}"
        )
    for key, param in model.state_dict().items():
        if tuple(state[key].shape) != tuple(param.shape):
            raise ValueError(
                f"{source}: tensor {key} has shape {list(state[key].shape)}, "
                f"config.json implies {list(param.shape)}"
            )
    # assign: a model built on the meta device takes the checkpoint's tensors as is
    model.load_state_dict(state, strict=True, assign=True)


def save_checkpoint(model: DFlashDraftModel, out_dir: str | Path) -> Path:
    """Write config.json + model.safetensors in z-lab's layout; returns out_dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype = next(model.parameters()).dtype
    raw = model.config.to_dict()
    raw["dtype"] = str(dtype).removeprefix("torch.")
    (out_dir / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    state = {key: value.detach().contiguous().cpu() for key, value in model.state_dict().items()}
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir
