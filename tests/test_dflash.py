"""DFlash drafter: z-lab checkpoint format, validation, proposals, feature layout.

The reference checkpoint layout below is written from z-lab/dflash `dflash/model.py`
(module tree of `DFlashDraftModel`) and the published Qwen3-8B-DFlash-b16-style
config.json, not from our module, so a drift in our parameter names fails here.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    apply_rotary_pos_emb,
    repeat_kv,
)

from proxy.drafter.base import TargetInfo
from proxy.drafter.dflash import DFlashDrafter
from proxy.drafter.dflash_model import (
    FEATURE_LAYER_OFFSET,
    DFlashConfig,
    DFlashDraftModel,
    save_checkpoint,
    select_target_features,
)
from training.modelgen import MASK_TOKEN, qwen3_config, random_qwen3

NUM_TARGET_LAYERS = 4
HIDDEN = 64
BLOCK_SIZE = 6


def zlab_tensor_shapes(raw: dict) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of a z-lab DFlashDraftModel checkpoint for config `raw`:
    fc + hidden_norm + norm, and per layer a Qwen3 decoder layer (q/k/v/o_proj,
    q_norm/k_norm, gate/up/down_proj, input/post_attention layernorms)."""
    hidden, head_dim = raw["hidden_size"], raw["head_dim"]
    q_width = raw["num_attention_heads"] * head_dim
    kv_width = raw["num_key_value_heads"] * head_dim
    inter = raw["intermediate_size"]
    num_features = len(raw["dflash_config"]["target_layer_ids"])
    shapes = {
        "fc.weight": (hidden, num_features * hidden),
        "hidden_norm.weight": (hidden,),
        "norm.weight": (hidden,),
    }
    for layer_idx in range(raw["num_hidden_layers"]):
        prefix = f"layers.{layer_idx}."
        shapes.update(
            {
                prefix + "input_layernorm.weight": (hidden,),
                prefix + "post_attention_layernorm.weight": (hidden,),
                prefix + "self_attn.q_proj.weight": (q_width, hidden),
                prefix + "self_attn.k_proj.weight": (kv_width, hidden),
                prefix + "self_attn.v_proj.weight": (kv_width, hidden),
                prefix + "self_attn.o_proj.weight": (hidden, q_width),
                prefix + "self_attn.q_norm.weight": (head_dim,),
                prefix + "self_attn.k_norm.weight": (head_dim,),
                prefix + "mlp.gate_proj.weight": (inter, hidden),
                prefix + "mlp.up_proj.weight": (inter, hidden),
                prefix + "mlp.down_proj.weight": (hidden, inter),
            }
        )
        if raw["attention_bias"]:  # z-lab: bias=config.attention_bias on q/k/v/o_proj
            for name, width in (("q", q_width), ("k", kv_width), ("v", kv_width), ("o", hidden)):
                shapes[prefix + f"self_attn.{name}_proj.bias"] = (width,)
    return shapes


def zlab_config(mask_token_id: int, vocab_size: int, **overrides) -> dict:
    """A config.json laid out like z-lab/Qwen3-8B-DFlash-b16's, scaled down."""
    raw = {
        "architectures": ["DFlashDraftModel"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "block_size": BLOCK_SIZE,
        "bos_token_id": 0,
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": [1, 2]},
        "dtype": "bfloat16",
        "eos_token_id": 0,
        "head_dim": HIDDEN // 4,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "initializer_range": 0.02,
        "intermediate_size": 96,
        "layer_types": ["full_attention", "full_attention"],
        "max_position_embeddings": 2048,
        "max_window_layers": 2,
        "model_type": "qwen3",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "num_target_layers": NUM_TARGET_LAYERS,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "transformers_version": "4.57.1",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": vocab_size,
    }
    raw.update(overrides)
    return raw


def write_zlab_checkpoint(
    out_dir: Path, raw: dict, shapes: dict[str, tuple[int, ...]], seed: int = 0
) -> dict[str, torch.Tensor]:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(raw, indent=2))
    generator = torch.Generator().manual_seed(seed)
    tensors = {
        name: (torch.randn(shape, generator=generator) * 0.1).to(torch.bfloat16)
        for name, shape in shapes.items()
    }
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return tensors


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return random_qwen3(
        tmp_path_factory.mktemp("target"), num_layers=NUM_TARGET_LAYERS, hidden_size=HIDDEN
    )


@pytest.fixture(scope="module")
def target_model(target_dir) -> Qwen3ForCausalLM:
    return Qwen3ForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def mask_token_id(target_dir) -> int:
    return AutoTokenizer.from_pretrained(str(target_dir)).convert_tokens_to_ids(MASK_TOKEN)


def target_info(model: Qwen3ForCausalLM, model_dir: Path | None, engine: bool) -> TargetInfo:
    config = model.config
    return TargetInfo(
        vocab_size=config.vocab_size,
        num_hidden_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        model_dir=model_dir,
        model=model if engine else None,
    )


def write_random_drafter(
    out_dir: Path, target_config, mask_token_id: int, target_layer_ids=(2, 0), seed: int = 0
) -> Path:
    config = DFlashConfig.for_target(
        target_config,
        mask_token_id=mask_token_id,
        num_hidden_layers=2,
        block_size=BLOCK_SIZE,
        target_layer_ids=target_layer_ids,
        intermediate_size=96,
    )
    return save_checkpoint(DFlashDraftModel.random(config, seed=seed, std=0.2), out_dir)


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory, target_model, mask_token_id) -> Path:
    return write_random_drafter(
        tmp_path_factory.mktemp("drafter"), target_model.config, mask_token_id
    )


@pytest.fixture(scope="module")
def drafter(drafter_dir, target_model, target_dir) -> DFlashDrafter:
    return DFlashDrafter.load(str(drafter_dir), target_info(target_model, target_dir, engine=True))


def target_features(model, token_ids: list[int], layer_ids) -> torch.Tensor:
    """[len(token_ids), F] features of `token_ids` in one plain forward of the target."""
    if not token_ids:
        return torch.zeros(0, len(layer_ids) * model.config.hidden_size)
    with torch.no_grad():
        out = model.model(torch.tensor([token_ids]), output_hidden_states=True)
    return select_target_features(out.hidden_states, layer_ids)[0]


# --- checkpoint format ---------------------------------------------------------------


@pytest.mark.parametrize("attention_bias", [False, True])
def test_zlab_checkpoint_loads_with_strict_keys(
    tmp_path, target_model, target_dir, mask_token_id, attention_bias
):
    raw = zlab_config(mask_token_id, target_model.config.vocab_size, attention_bias=attention_bias)
    tensors = write_zlab_checkpoint(tmp_path / "zlab", raw, zlab_tensor_shapes(raw))
    drafter = DFlashDrafter.load(
        str(tmp_path / "zlab"), target_info(target_model, target_dir, engine=True)
    )
    assert drafter.max_depth == BLOCK_SIZE - 1
    assert drafter.target_layer_ids == (1, 2)
    assert drafter.config.mask_token_id == mask_token_id
    assert drafter.config.rope_parameters["rope_theta"] == 1000000
    state = drafter.model.state_dict()
    assert set(state) == set(tensors)
    for name, tensor in tensors.items():
        assert torch.equal(state[name], tensor.float()), name


@pytest.mark.parametrize("change", ["extra", "missing"])
def test_checkpoint_with_wrong_keys_is_refused(
    tmp_path, target_model, target_dir, mask_token_id, change
):
    raw = zlab_config(mask_token_id, target_model.config.vocab_size)
    shapes = zlab_tensor_shapes(raw)
    if change == "extra":
        shapes["embed_tokens.weight"] = (target_model.config.vocab_size, HIDDEN)
        culprit = "embed_tokens.weight"
    else:
        culprit = "layers.1.self_attn.k_norm.weight"
        del shapes[culprit]
    write_zlab_checkpoint(tmp_path / "bad", raw, shapes)
    with pytest.raises(ValueError, match=culprit.replace(".", r"\.")):
        DFlashDrafter.load(str(tmp_path / "bad"), target_info(target_model, target_dir, True))


def test_checkpoint_with_wrong_shape_is_refused(tmp_path, target_model, target_dir, mask_token_id):
    raw = zlab_config(mask_token_id, target_model.config.vocab_size)
    shapes = zlab_tensor_shapes(raw)
    shapes["fc.weight"] = (HIDDEN, 3 * HIDDEN)  # three feature layers, config names two
    write_zlab_checkpoint(tmp_path / "bad", raw, shapes)
    with pytest.raises(ValueError, match=r"fc\.weight has shape \[64, 192\]"):
        DFlashDrafter.load(str(tmp_path / "bad"), target_info(target_model, target_dir, True))


def test_saved_checkpoint_has_zlab_layout(drafter_dir, mask_token_id):
    raw = json.loads((drafter_dir / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"]
    assert raw["model_type"] == "qwen3"
    assert raw["block_size"] == BLOCK_SIZE
    assert raw["num_target_layers"] == NUM_TARGET_LAYERS
    assert raw["dflash_config"] == {"mask_token_id": mask_token_id, "target_layer_ids": [2, 0]}
    assert raw["rope_theta"] == Qwen3Config().rope_parameters["rope_theta"]
    from safetensors import safe_open

    with safe_open(str(drafter_dir / "model.safetensors"), framework="pt") as handle:
        names = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
    assert names == zlab_tensor_shapes(raw)


def test_config_variants_are_read(mask_token_id):
    """block_size inside dflash_config (newer z-lab checkpoints), rope_parameters
    (Transformers 5), and target_layer_ids derived from num_target_layers as z-lab does."""
    raw = zlab_config(mask_token_id, 260)
    del raw["block_size"], raw["rope_theta"], raw["rope_scaling"]
    raw["dflash_config"] = {"block_size": 16, "mask_token_id": 7}
    raw["num_target_layers"] = 36
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": 5e6}
    config = DFlashConfig.from_dict(raw)
    assert config.block_size == 16 and config.mask_token_id == 7
    assert config.target_layer_ids == (1, 33)  # z-lab: spread over [1, 36 - 3]
    assert config.rope_parameters["rope_theta"] == 5e6
    with pytest.raises(ValueError, match="DFlash2DraftModel"):
        DFlashConfig.from_dict({**raw, "architectures": ["DFlash2DraftModel"]})


# --- validation against the target ----------------------------------------------------


def test_target_layer_ids_beyond_target_are_refused(
    tmp_path, target_model, target_dir, mask_token_id
):
    raw = zlab_config(mask_token_id, target_model.config.vocab_size)
    raw["dflash_config"]["target_layer_ids"] = [1, 9]
    write_zlab_checkpoint(tmp_path / "ckpt", raw, zlab_tensor_shapes(raw))
    with pytest.raises(ValueError) as excinfo:
        DFlashDrafter.load(str(tmp_path / "ckpt"), target_info(target_model, target_dir, True))
    message = str(excinfo.value)
    assert "\n" not in message
    assert "target_layer_ids [1, 9]" in message
    assert f"{NUM_TARGET_LAYERS} layers" in message


@pytest.mark.parametrize(
    ("field", "value", "pattern"),
    [
        ("num_target_layers", 36, "num_target_layers=36"),
        ("vocab_size", 300, "vocab_size=300"),
    ],
)
def test_mismatched_target_is_refused(
    tmp_path, target_model, target_dir, mask_token_id, field, value, pattern
):
    raw = zlab_config(mask_token_id, target_model.config.vocab_size)
    raw[field] = value
    write_zlab_checkpoint(tmp_path / "ckpt", raw, zlab_tensor_shapes(raw))
    with pytest.raises(ValueError, match=pattern):
        DFlashDrafter.load(str(tmp_path / "ckpt"), target_info(target_model, target_dir, True))


def test_hidden_size_mismatch_is_refused(drafter_dir, target_model, target_dir):
    info = target_info(target_model, target_dir, engine=True)
    wider = TargetInfo(info.vocab_size, info.num_hidden_layers, 2 * HIDDEN, target_dir, None)
    with pytest.raises(ValueError, match="hidden_size=64 .* hidden size is 128"):
        DFlashDrafter.load(str(drafter_dir), wider)


def test_missing_path_and_missing_target_weights_are_refused(drafter_dir, target_model):
    info = target_info(target_model, None, engine=False)  # proxy mode without a directory
    with pytest.raises(ValueError, match="dflash:PATH"):
        DFlashDrafter.load(None, info)
    with pytest.raises(ValueError, match="model_dir"):
        DFlashDrafter.load(str(drafter_dir), info)


# --- proposals ------------------------------------------------------------------------


def test_propose_shapes_sorting_and_normalisation(drafter, target_model):
    prompt = [5, 17, 99, 3, 42]
    feats = target_features(target_model, prompt[:-1], drafter.target_layer_ids)
    session = drafter.start(prompt, feats)
    vocab = target_model.config.vocab_size

    dist = session.compute(prompt, depth=3, top_k=4)
    assert dist.token_ids.shape == (3, 4) and dist.log_probs.shape == (3, 4)
    assert dist.token_ids.dtype == np.int64 and dist.log_probs.dtype == np.float64
    assert np.all(np.diff(dist.log_probs, axis=1) <= 0)
    assert np.all(dist.log_probs <= 0) and np.all(np.isfinite(dist.log_probs))

    full = session.compute(prompt, depth=drafter.max_depth, top_k=vocab)
    assert full.token_ids.shape == (BLOCK_SIZE - 1, vocab)
    for row in range(full.max_depth):  # log_softmax over the whole vocabulary
        assert sorted(full.token_ids[row].tolist()) == list(range(vocab))
        assert math.isclose(np.logaddexp.reduce(full.log_probs[row]), 0.0, abs_tol=1e-5)
    # a shallower call returns the same rows: always the full block, sliced
    np.testing.assert_array_equal(full.token_ids[:3, :4], dist.token_ids)
    np.testing.assert_allclose(full.log_probs[:3, :4], dist.log_probs, rtol=0, atol=1e-6)

    padded = session.compute(prompt, depth=1, top_k=vocab + 3)
    assert np.all(np.isneginf(padded.log_probs[0, vocab:]))
    with pytest.raises(ValueError, match="depths 1..5"):
        session.compute(prompt, depth=BLOCK_SIZE, top_k=2)
    with pytest.raises(ValueError, match="depths 1..5"):
        session.compute(prompt, depth=0, top_k=2)


def test_empty_context_then_advance(drafter, target_model):
    feature_size = drafter.config.feature_size
    committed = [42]
    for features in (None, torch.zeros(0, feature_size)):
        session = drafter.start(committed, features)
        dist = session.compute(committed, depth=drafter.max_depth, top_k=3)
        assert dist.token_ids.shape == (BLOCK_SIZE - 1, 3)
    # one round later: the target processed the old root and one accepted token
    committed = [42, 7, 8]
    session.advance(
        committed, target_features(target_model, committed[:-1], drafter.target_layer_ids)
    )
    assert session.compute(committed, depth=2, top_k=3).token_ids.shape == (2, 3)
    with pytest.raises(ValueError, match=r"features \[2, 128\]"):
        session.advance([42, 7, 8, 9, 10], torch.zeros(1, feature_size))
    with pytest.raises(ValueError, match="needs target features"):
        drafter.start([1, 2, 3], None)


def reference_log_probs(drafter, target_model, committed: list[int]) -> torch.Tensor:
    """Independent reference of z-lab's draft forward, from Transformers' Qwen3 pieces
    (RMSNorm, RoPE, repeat_kv) and eager attention, recomputing the whole context."""
    model, config = drafter.model, drafter.config
    hf_config = qwen3_config(config.vocab_size, 1, config.hidden_size)
    hf_config.rope_parameters = dict(config.rope_parameters)
    rotary = Qwen3RotaryEmbedding(hf_config)

    def rms(weight, x):
        norm = Qwen3RMSNorm(weight.shape[0], eps=config.rms_norm_eps)
        norm.weight.data = weight
        return norm(x)

    features = target_features(target_model, committed[:-1], config.target_layer_ids)[None]
    context = rms(model.hidden_norm.weight, features @ model.fc.weight.T)  # [1, C, H]
    num_context = context.shape[1]
    block = [committed[-1]] + [config.mask_token_id] * (config.block_size - 1)
    hidden = target_model.model.embed_tokens(torch.tensor([block]))
    positions = torch.arange(num_context + config.block_size)[None]
    cos, sin = rotary(hidden, positions)
    heads, kv_heads, head_dim = (
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
    )
    with torch.no_grad():
        for layer in model.layers:
            attn = layer.self_attn
            normed = rms(layer.input_layernorm.weight, hidden)
            both = torch.cat([context, normed], dim=1)
            q = rms(attn.q_norm.weight, attn.q_proj(normed).view(1, -1, heads, head_dim))
            k = rms(attn.k_norm.weight, attn.k_proj(both).view(1, -1, kv_heads, head_dim))
            v = attn.v_proj(both).view(1, -1, kv_heads, head_dim).transpose(1, 2)
            k = k.transpose(1, 2)
            q, _ = apply_rotary_pos_emb(
                q.transpose(1, 2), q.transpose(1, 2), cos[:, num_context:], sin[:, num_context:]
            )
            k, _ = apply_rotary_pos_emb(k, k, cos, sin)
            k, v = repeat_kv(k, heads // kv_heads), repeat_kv(v, heads // kv_heads)
            weights = torch.softmax(q @ k.transpose(2, 3) / math.sqrt(head_dim), dim=-1)
            out = (weights @ v).transpose(1, 2).reshape(1, config.block_size, -1)
            hidden = hidden + attn.o_proj(out)
            hidden = hidden + layer.mlp(rms(layer.post_attention_layernorm.weight, hidden))
        hidden = rms(model.norm.weight, hidden)
        return torch.log_softmax(target_model.lm_head(hidden[0, 1:]), dim=-1)


def test_cached_session_matches_reference_over_rounds(drafter, target_model):
    """The session's context cache over several advances gives what a fresh
    recomputation over the whole context gives."""
    vocab = target_model.config.vocab_size
    tokens = [11, 200, 3, 64, 9, 250, 31, 7, 77, 120, 5, 18]
    committed = tokens[:1]  # starts with an empty context
    session = drafter.start(committed, target_features(target_model, [], (2, 0)))
    for step in (2, 1, 4, 2):
        dist = session.compute(committed, depth=drafter.max_depth, top_k=vocab)
        expected = reference_log_probs(drafter, target_model, committed)
        ours = torch.full_like(expected, float("nan"))
        ours.scatter_(1, torch.from_numpy(dist.token_ids), torch.from_numpy(dist.log_probs).float())
        torch.testing.assert_close(ours, expected, rtol=0, atol=1e-5)
        new = tokens[len(committed) : len(committed) + step]
        # the target has now processed the old root and all new tokens but the last
        processed = committed[-1:] + new[:-1]
        all_feats = target_features(target_model, committed + new[:-1], (2, 0))
        committed = committed + new
        session.advance(committed, all_feats[-len(processed) :])
    assert session.num_context == len(committed) - 1


def test_feature_concatenation_order(drafter, target_model):
    """Slice j of the features (and of fc's input) is target layer target_layer_ids[j],
    i.e. Transformers hidden_states[target_layer_ids[j] + 1]; order as configured."""
    assert FEATURE_LAYER_OFFSET == 1
    tokens = [4, 8, 15, 16, 23]
    with torch.no_grad():
        out = target_model.model(torch.tensor([tokens]), output_hidden_states=True)
        layer2 = target_model.model.layers[2]
    assert drafter.target_layer_ids == (2, 0)
    feats = select_target_features(out.hidden_states, drafter.target_layer_ids)[0]
    assert torch.equal(feats[:, :HIDDEN], out.hidden_states[3][0])
    assert torch.equal(feats[:, HIDDEN:], out.hidden_states[1][0])

    # hidden_states[3] is the output of decoder layer 2 (0-based): check with a hook
    captured = {}
    handle = layer2.register_forward_hook(lambda mod, args, output: captured.update(out=output))
    with torch.no_grad():
        target_model.model(torch.tensor([tokens]))
    handle.remove()
    layer_out = captured["out"][0] if isinstance(captured["out"], tuple) else captured["out"]
    torch.testing.assert_close(layer_out[0], feats[:, :HIDDEN], rtol=0, atol=0)

    # The drafter reads the slices in that order: fc's first H input columns act
    # on layer 2. Swapping the halves of the features changes the proposals.
    fc = drafter.model.fc.weight
    projected = feats @ fc.T
    by_slice = (
        out.hidden_states[3][0] @ fc[:, :HIDDEN].T + out.hidden_states[1][0] @ fc[:, HIDDEN:].T
    )
    torch.testing.assert_close(projected, by_slice)
    prompt = tokens + [42]
    swapped = torch.cat([feats[:, HIDDEN:], feats[:, :HIDDEN]], dim=-1)
    right = drafter.start(prompt, feats).compute(prompt, 3, 4)
    wrong = drafter.start(prompt, swapped).compute(prompt, 3, 4)
    assert not np.allclose(right.log_probs, wrong.log_probs)


# --- proxy mode (weights from the target's safetensors) -------------------------------


def proposals(drafter: DFlashDrafter, target_model, prompt: list[int]) -> np.ndarray:
    feats = target_features(target_model, prompt[:-1], drafter.target_layer_ids)
    dist = drafter.start(prompt, feats).compute(prompt, drafter.max_depth, top_k=8)
    return np.stack([dist.token_ids.astype(np.float64), dist.log_probs])


@pytest.mark.parametrize("variant", ["untied", "tied", "sharded"])
def test_proxy_mode_matches_engine_mode(tmp_path, target_dir, mask_token_id, variant):
    if variant == "untied":
        model_dir = target_dir
        model = Qwen3ForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    else:
        config = qwen3_config(260, NUM_TARGET_LAYERS, HIDDEN)
        config.tie_word_embeddings = variant == "tied"
        torch.manual_seed(1)
        model = Qwen3ForCausalLM(config).eval()
        model_dir = tmp_path / "target"
        model.save_pretrained(
            str(model_dir), max_shard_size="100KB" if variant == "sharded" else "5GB"
        )
        assert (model_dir / "model.safetensors.index.json").is_file() == (variant == "sharded")
    drafter_dir = write_random_drafter(tmp_path / "drafter", model.config, mask_token_id)
    engine = DFlashDrafter.load(str(drafter_dir), target_info(model, model_dir, engine=True))
    proxy = DFlashDrafter.load(str(drafter_dir), target_info(model, model_dir, engine=False))
    assert proxy._embed is not model.model.embed_tokens
    if variant == "tied":
        assert torch.equal(proxy._lm_head.weight, model.model.embed_tokens.weight)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    np.testing.assert_array_equal(proposals(engine, model, prompt), proposals(proxy, model, prompt))


# --- the nn.Module as a trainer uses it ------------------------------------------------


def test_batch_forward_with_block_mask_trains(drafter, target_model):
    """Two sequences, two blocks each, packed as a trainer would: each block sees the
    context strictly before its root and itself (bidirectionally)."""
    config = drafter.config
    model = DFlashDraftModel(config)
    model.load_state_dict(drafter.model.state_dict())
    seq_len, block = 10, config.block_size
    input_ids = torch.randint(0, 256, (2, seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = target_model.model(input_ids, output_hidden_states=True)
    feats = select_target_features(out.hidden_states, config.target_layer_ids)  # [2, S, F]
    anchors = torch.tensor([[1, 4], [0, 3]])  # root positions of the blocks
    block_pos = (anchors[:, :, None] + torch.arange(block)).reshape(2, -1)  # [2, 2 * block]
    noise_ids = torch.full_like(block_pos, config.mask_token_id)
    noise_ids[:, ::block] = torch.gather(input_ids, 1, anchors)
    noise = target_model.model.embed_tokens(noise_ids).detach()
    positions = torch.cat([torch.arange(seq_len).expand(2, -1), block_pos], dim=1)
    q_block = torch.arange(2 * block) // block
    sees_context = torch.arange(seq_len)[None, None, :] < anchors[:, q_block][:, :, None]
    sees_block = q_block[:, None] == q_block[None, :]
    mask = torch.cat([sees_context, sees_block.expand(2, -1, -1)], dim=2)[:, None]  # [2,1,Q,S+Q]

    hidden = model(noise, feats, positions, mask)
    assert hidden.shape == (2, 2 * block, HIDDEN)
    loss = target_model.lm_head(hidden).logsumexp(-1).mean()
    loss.backward()
    assert model.fc.weight.grad is not None and model.fc.weight.grad.abs().sum() > 0

    # block 1 of sequence 0 (root at position 4) equals an inference-time proposal
    prompt = input_ids[0, :5].tolist()
    dist = drafter.start(prompt, feats[0, :4]).compute(prompt, block - 1, top_k=1)
    with torch.no_grad():
        logits = target_model.lm_head(hidden[0, block + 1 : 2 * block])
    np.testing.assert_array_equal(logits.argmax(-1).numpy(), dist.token_ids[:, 0])


def test_scaled_rope_matches_transformers(mask_token_id):
    """Checkpoints with rope_scaling (yarn) get Transformers' frequencies and scaling."""
    from proxy.drafter.dflash_model import RotaryEmbedding

    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}
    raw = zlab_config(mask_token_id, 260, rope_scaling=scaling, rope_theta=1e6)
    config = DFlashConfig.from_dict(raw)
    ours = RotaryEmbedding(config)
    hf_config = qwen3_config(260, 1, HIDDEN)
    hf_config.rope_parameters = {**scaling, "rope_theta": 1e6}
    theirs = Qwen3RotaryEmbedding(hf_config)
    torch.testing.assert_close(ours.inv_freq, theirs.inv_freq)
    positions = torch.arange(700)[None]
    cos, sin = ours(positions, torch.float32)
    hf_cos, hf_sin = theirs(torch.zeros(1), positions)
    torch.testing.assert_close(cos[:, 0], hf_cos)
    torch.testing.assert_close(sin[:, 0], hf_sin)
    assert DFlashConfig.from_dict(config.to_dict()).rope_parameters == config.rope_parameters


def test_bfloat16_drafter_with_float32_target(drafter_dir, target_model, target_dir):
    info = target_info(target_model, target_dir, engine=True)
    low = DFlashDrafter.load(str(drafter_dir), info, dtype=torch.bfloat16)
    assert next(low.model.parameters()).dtype == torch.bfloat16
    full = DFlashDrafter.load(str(drafter_dir), info)
    prompt = [9, 8, 7, 6, 5]
    feats = target_features(target_model, prompt[:-1], full.target_layer_ids)
    dist_low = low.start(prompt, feats).compute(prompt, full.max_depth, top_k=1)
    dist_full = full.start(prompt, feats).compute(prompt, full.max_depth, top_k=1)
    np.testing.assert_allclose(dist_low.log_probs, dist_full.log_probs, atol=0.1)
