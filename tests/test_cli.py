"""The command line as a user runs it: a real subprocess, real model directories."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer

from proxy.drafter.dflash_model import DFlashConfig, DFlashDraftModel, save_checkpoint
from training.modelgen import MASK_TOKEN


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "proxy.cli", *args], capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def dflash_dir(target_dirs, tmp_path_factory) -> Path:
    target_dir = target_dirs["t2x64"]
    config = DFlashConfig.for_target(
        AutoConfig.from_pretrained(target_dir),
        mask_token_id=AutoTokenizer.from_pretrained(target_dir).convert_tokens_to_ids(MASK_TOKEN),
        block_size=4,
    )
    return save_checkpoint(DFlashDraftModel.random(config, seed=3), tmp_path_factory.mktemp("df"))


def test_generate_json_is_lossless(target_dirs):
    target_dir = target_dirs["t2x64"]
    proc = _cli(
        "generate", "--prompt", "def add(a, b):", "--target", str(target_dir),
        "--drafter", f"autoregressive:{target_dir}", "--budget", "8", "--max-tokens", "20", "--json",
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert {"text", "token_ids", "stats"} <= out.keys()
    assert out["stats"]["rounds"] >= 1 and out["stats"]["mean_acceptance_length"] > 1
    from proxy.runtime import load_engine

    engine = load_engine(target_dir, None)
    prompt = engine.tokens.tokenizer("def add(a, b):", add_special_tokens=False)["input_ids"]
    ref = engine.target.model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False)
    assert out["token_ids"] == ref[0, len(prompt) :].tolist()
    assert out["text"] == engine.tokens.tokenizer.decode(
        [t for t in out["token_ids"] if t not in engine.target.eos_token_ids],
        skip_special_tokens=True,
    )


def test_generate_with_dflash_chain(target_dirs, dflash_dir):
    proc = _cli(
        "generate", "--prompt", "x = 1", "--target", str(target_dirs["t2x64"]),
        "--drafter", f"dflash:{dflash_dir}", "--chain", "--max-tokens", "8",
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("x = 1")
    assert "mean acceptance length" in proc.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--drafter", "bogus"], "unknown drafter 'bogus'"),
        (["--drafter", "ngram", "--budget", "-3"], "budget"),
        (["--drafter", "DFLASH", "--depth", "9"], "exceeds the dflash drafter's maximum of 3"),
        (["--drafter", "ngram", "--target", "/nonexistent/model"], "/nonexistent/model not found"),
        (["--drafter", "ngram", "--prompt", ""], "prompt is empty"),
        (["--drafter", "ngram", "--torch-threads", "0"], "torch_threads: Input should be greater"),
    ],
)
def test_bad_input_is_one_line_error(args, message, target_dirs, dflash_dir):
    args = [a.replace("DFLASH", f"dflash:{dflash_dir}") for a in args]
    base = ["generate", "--prompt", "hello", "--target", str(target_dirs["t2x64"])]
    proc = _cli(*base, *args)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("ddtree-proxy: error:")]
    assert len(lines) == 1 and message in lines[0], proc.stderr
