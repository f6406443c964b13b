"""benchmarks.servers: the one way tests, scripts and benchmarks start a server process.
Real processes (a few lines of http.server), no mocks."""

from __future__ import annotations

import signal
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from benchmarks import servers

# A server answering GET /health 200 on argv[1], after printing argv[2] bytes (a chatty
# start-up) and starting a child process in its group (vLLM's engine core does so).
SERVER = textwrap.dedent(
    """
    import http.server, subprocess, sys
    sys.stdout.write("x" * int(sys.argv[2])); sys.stdout.flush()
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            print("request", *args, flush=True)

    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
    """
)


def _command(port: int, chatter_bytes: int = 0) -> list[str]:
    return [sys.executable, "-c", SERVER, str(port), str(chatter_bytes)]


def test_ready_logged_to_a_file_and_the_whole_group_stopped(tmp_path: Path):
    port = servers.free_port()
    log = tmp_path / "server.log"
    # 1 MiB of output before it listens: a pipe nobody reads would block it there.
    with servers.start(_command(port, 1 << 20), port=port, log_path=log, timeout_s=60) as server:
        assert httpx.get(server.url + "/health").status_code == 200
        assert servers.group_alive(server.pid)
        pgid = server.pid
    assert not servers.group_alive(pgid)  # the child it started went too
    assert server.proc.returncode == -signal.SIGTERM
    assert log.stat().st_size >= 1 << 20 and "request" in log.read_text()


def test_exit_before_ready_raises_with_the_log_tail(tmp_path: Path):
    port = servers.free_port()
    command = [sys.executable, "-c", "import sys; print('bad flag --nope'); sys.exit(3)"]
    with pytest.raises(servers.ServerError, match=r"status 3(.|\n)*bad flag --nope"):
        servers.start(command, port=port, log_path=tmp_path / "bad.log", name="bad")


def test_not_ready_in_time_is_stopped(tmp_path: Path):
    port = servers.free_port()
    calls = []

    def never(url: str) -> bool:
        calls.append(url)
        return False

    started = time.monotonic()
    with pytest.raises(servers.ServerError, match="not ready within 1 s"):
        servers.start(_command(port), port=port, log_path=tmp_path / "s.log", ready=never,
                      timeout_s=1)  # fmt: skip
    assert calls and calls[0] == f"http://127.0.0.1:{port}"
    assert time.monotonic() - started < 20
    with pytest.raises(httpx.TransportError):  # stopped: nothing listens any more
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
