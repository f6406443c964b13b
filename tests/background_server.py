"""Serve an app with uvicorn in a daemon thread, for tests."""

from __future__ import annotations

import socket
import threading

import uvicorn
from fastapi import FastAPI


class BackgroundServer:
    """Serve an app with uvicorn in a daemon thread on a free loopback port; for tests
    and benchmarks. Use as a context manager; `url` is its base URL."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", start_timeout: float = 120.0):
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, 0))
        self.url = f"http://{host}:{self._socket.getsockname()[1]}"
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True
        )
        self._start_timeout = start_timeout

    def __enter__(self) -> "BackgroundServer":
        self._thread.start()
        waited = 0.0
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the server exited during start-up (see its log)")
            if waited > self._start_timeout:
                self.__exit__()
                raise RuntimeError(f"the server did not start within {self._start_timeout} s")
            self._thread.join(0.05)
            waited += 0.05
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._server.should_exit = True
        self._thread.join(30)
        self._socket.close()
