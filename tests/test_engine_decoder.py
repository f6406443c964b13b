"""The engine's lean decoder forward (`proxy.backend.engine.decoder`), its device/dtype options
and the worker-thread intra-op setting.

The decoder reruns a Transformers model's own weights with fewer ops; these tests hold
it to Transformers' forward (logits, features, KV cache) on Qwen3 and Llama targets,
check that engine mode stays lossless on a Llama target too, and that bad device/dtype
choices fail with a clear message.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import subprocess
import sys

import pytest
import torch
from conftest import run
from transformers import LlamaConfig, LlamaForCausalLM

from proxy.backend.engine.decoder import Decoder
from proxy.backend.engine.hf import load_causal_lm, match_intra_op_threads, select_target_features
from proxy.backend.engine.local import LocalTarget, resolve_device, resolve_dtype
from proxy.decoding import GenerationRequest, TreeSettings, generate
from proxy.drafter import load_drafter
from proxy.runtime import load_engine, target_info

HAS_CUDA = torch.cuda.is_available()


@pytest.fixture(scope="module")
def llama_model() -> torch.nn.Module:
    torch.manual_seed(3)
    config = LlamaConfig(
        vocab_size=260,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.2,
        attention_bias=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return LlamaForCausalLM(config).float().eval()


def _hf_forward(model, token_ids: list[int]):
    with torch.inference_mode():
        out = model.model(torch.tensor([token_ids]), output_hidden_states=True)
    return out.hidden_states, model.lm_head(out.last_hidden_state[0])


def _check_against_transformers(model, layer_ids: tuple[int, ...]) -> None:
    """Prefill, then a tree of 3 nodes (two siblings and a child), vs plain forwards."""
    decoder = Decoder(model)
    cache = decoder.new_cache()
    context = [5, 17, 33, 8, 90, 41, 7, 3, 11, 64]  # >= MIN_PACKED_ROWS: both CPU kernels
    with torch.inference_mode():
        hidden, features = decoder.forward(
            cache, torch.tensor(context), torch.arange(len(context)), None, layer_ids
        )
        cache.length = len(context)
        hf_states, hf_logits = _hf_forward(model, context)
        torch.testing.assert_close(decoder.logits(hidden), hf_logits, rtol=0, atol=1e-4)
        torch.testing.assert_close(
            features, select_target_features(hf_states, layer_ids)[0], rtol=0, atol=1e-4
        )
        # root 12 after the context; nodes: 20 (parent root), 21 (parent root), 22 (parent 20)
        tokens = torch.tensor([12, 20, 21, 22])
        depths = torch.tensor([0, 1, 1, 2])
        visible = torch.ones(4, len(context) + 4, dtype=torch.bool)
        visible[:, len(context) :] = torch.tensor(
            [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool
        )
        hidden, _ = decoder.forward(cache, tokens, depths + len(context), visible, None)
        logits = decoder.logits(hidden)
        for row, path in enumerate([[12], [12, 20], [12, 21], [12, 20, 22]]):
            _, hf_logits = _hf_forward(model, context + path)
            torch.testing.assert_close(logits[row], hf_logits[-1], rtol=0, atol=1e-4)
        # keep root + node 1 + node 3 (the path 12 -> 20 -> 22), then decode one token
        cache.keep(cache.length, [0, 1, 3])
        assert cache.length == len(context) + 3
        hidden, _ = decoder.forward(
            cache, torch.tensor([9]), torch.tensor([cache.length]), None, None
        )
        _, hf_logits = _hf_forward(model, context + [12, 20, 22, 9])
        torch.testing.assert_close(decoder.logits(hidden)[0], hf_logits[-1], rtol=0, atol=1e-4)


def test_decoder_matches_transformers_qwen3(target_dirs):
    model = load_causal_lm(target_dirs["t3x96"])
    _check_against_transformers(model, (0, 2))  # 2 = last layer: final-norm output


def test_decoder_matches_transformers_llama(llama_model):
    _check_against_transformers(llama_model, (1,))


def test_decoder_keeps_transformers_forward_working(target_dirs):
    """Fused weights are shared with the modules: Transformers' own forward is unchanged."""
    model = load_causal_lm(target_dirs["t2x64"])
    prompt = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.inference_mode():
        before = model(prompt).logits
        Decoder(model)
        after = model(prompt).logits
    torch.testing.assert_close(after, before, rtol=0, atol=1e-5)


def test_engine_is_lossless_on_llama(llama_model, target_dirs):
    target = LocalTarget(llama_model, name="llama")
    info = target_info(llama_model.config, None, llama_model)
    drafter = load_drafter("ngram", info)
    prompt = [5, 6, 7, 5, 6, 7, 5, 6, 30, 31, 32, 5, 6]
    with torch.inference_mode():
        expected = llama_model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[
            0, len(prompt) :
        ].tolist()

    async def detokenize(ids):
        return " ".join(map(str, ids))

    for tree in (TreeSettings(kind="ddtree", budget=8, depth=4), TreeSettings(kind="none")):
        request = GenerationRequest(prompt_ids=prompt, max_tokens=24, tree=tree, ignore_eos=True)
        result = run(generate(target, drafter, request, detokenize))
        assert result.token_ids == expected, tree


def test_unsupported_architecture_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match="engine mode runs llama, qwen3 targets"):
        Decoder(model)


# --- device and dtype ---------------------------------------------------------------


def test_default_device_and_dtype():
    device = resolve_device(None)
    assert device.type == ("cuda" if HAS_CUDA else "cpu")
    assert resolve_device("auto") == device
    assert resolve_dtype(None, torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("float16", torch.device("cpu")) == torch.float16


def test_engine_loads_on_the_default_device_and_dtype(target_dirs):
    """CPU in float32 here (and in CI); CUDA in bfloat16 on a machine with a GPU."""
    engine = load_engine(target_dirs["t2x64"], None)
    param = next(engine.target.model.parameters())
    if HAS_CUDA:
        assert param.device.type == "cuda" and param.dtype == torch.bfloat16
    else:
        assert param.device.type == "cpu" and param.dtype == torch.float32
    explicit = load_engine(target_dirs["t2x64"], None, device="cpu", dtype="float32")
    assert engine.target.decoder.dtype == explicit.target.decoder.dtype == torch.float32


@pytest.mark.parametrize(
    ("device", "message"),
    [("tpu", "unknown device 'tpu'"), ("meta", "unsupported device 'meta'")]
    + ([] if HAS_CUDA else [("cuda", "has no CUDA device")]),
)
def test_bad_device_is_refused(device, message):
    with pytest.raises(ValueError, match=message):
        resolve_device(device)


def test_bad_dtype_is_refused():
    with pytest.raises(ValueError, match="unknown dtype 'fp8': use auto, float32, bfloat16"):
        resolve_dtype("fp8", torch.device("cpu"))


def test_cli_reports_a_bad_dtype(target_dirs):
    proc = subprocess.run(
        [sys.executable, "-m", "proxy.cli", "generate", "--prompt", "x", "--no-draft",
         "--target", str(target_dirs["t2x64"]), "--dtype", "fp8"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "ddtree-proxy: error: unknown dtype 'fp8': use auto, float32, bfloat16, float16"
    )


def test_bfloat16_engine_runs(target_dirs):
    """bfloat16 (the CUDA default) works end to end; exactness is only claimed in fp32."""
    engine = load_engine(target_dirs["t2x64"], None, device="cpu", dtype="bfloat16")
    request = GenerationRequest(prompt_ids=[5, 6, 7], max_tokens=6, tree=TreeSettings(kind="none"))
    result = run(generate(engine.target, None, request, engine.detokenizer()))
    assert len(result.token_ids) >= 1
    assert engine.target.decoder.dtype == torch.bfloat16


# --- worker threads ---------------------------------------------------------------


def test_worker_threads_get_the_intra_op_setting():
    """OpenMP's thread count is per thread: a fresh worker starts at the OpenMP default
    whatever torch.set_num_threads said; match_intra_op_threads brings it in line."""
    # torch's CPU wheel links an OpenMP runtime (its intra-op pool): the symbol is there.
    omp_get_max_threads = ctypes.CDLL(None).omp_get_max_threads
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:

        def in_worker() -> tuple[int, int]:
            fresh = omp_get_max_threads()
            match_intra_op_threads()
            return fresh, omp_get_max_threads()

        fresh, matched = asyncio.run(asyncio.to_thread(in_worker))
        assert matched == 1
        if (os.cpu_count() or 1) > 1 and "OMP_NUM_THREADS" not in os.environ:
            assert fresh > 1  # the trap the helper exists for
    finally:
        torch.set_num_threads(before)
