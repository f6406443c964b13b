"""The OpenAI-compatible HTTP server (FastAPI + uvicorn): the app, its routes and
API-key guard, `ddtree-proxy serve`, and a background server for tests and benchmarks.
What a request does is in `proxy.serving` (and `proxy.passthrough`).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
import threading
from contextlib import asynccontextmanager
from typing import Any, Mapping

import httpx
import uvicorn
from fastapi import Depends, FastAPI, Request, Response
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse

from proxy.api import REQUEST_MODELS, RequestError, error_body
from proxy.config import ServerSettings, settings_from_sources
from proxy.service import Service, build_service
from proxy.serving import Serving

logger = logging.getLogger("ddtree_proxy.server")


def create_app(
    settings: ServerSettings,
    service: Service | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> FastAPI:
    """The app. Without `service`, it is built when the app starts and closed when it
    stops (so it lives in the server's event loop); `transport` then goes to
    `build_service` (tests inject a mock upstream)."""
    server = Serving(settings, service)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await server.start(transport)
        try:
            yield
        finally:
            await server.stop()

    app = FastAPI(title="ddtree-proxy", lifespan=lifespan)
    app.state.server = server
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]

    async def authorize(request: Request) -> None:
        key = settings.api_key
        if key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {key}".encode()):
            raise RequestError(
                "Unauthorized: send Authorization: Bearer <api key>",
                status=401,
                err_type="authentication_error",
            )

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("request failed")
        return JSONResponse(
            error_body(f"internal error: {exc}", "internal_error", 500), status_code=500
        )

    guarded = [Depends(authorize)]

    @app.post("/v1/completions", dependencies=guarded)
    async def completions(request: Request) -> Response:
        return await server.generate(request, "completions")

    @app.post("/v1/chat/completions", dependencies=guarded)
    async def chat_completions(request: Request) -> Response:
        return await server.generate(request, "chat")

    @app.get("/v1/models", dependencies=guarded)
    async def models(request: Request) -> Response:
        return await server.models(request)

    @app.get("/health")
    async def health() -> Response:
        return await server.health()

    @app.get("/metrics")
    async def metrics() -> Response:
        return server.metrics_text()

    return app


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema plus the request bodies of the generation routes (their handlers
    read the raw body, so FastAPI cannot see the models): clients and schema-driven
    fuzzers (schemathesis) get the real request shapes."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for path, endpoint in (("/v1/completions", "completions"), ("/v1/chat/completions", "chat")):
        model = REQUEST_MODELS[endpoint]
        body = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(body.pop("$defs", {}))
        components[model.__name__] = body
        schema["paths"][path]["post"]["requestBody"] = {
            "required": True,
            "content": {
                "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}
            },
        }
    app.openapi_schema = schema
    return schema


def settings_from_args(args: Any, env: Mapping[str, str] | None = None) -> ServerSettings:
    """`serve` flags over DDTREE_* variables of `env` (default: os.environ)."""
    cli = dict(vars(args))
    cli["kind"] = "chain" if cli.get("chain") else "none" if cli.get("no_draft") else None
    return settings_from_sources(cli, env)


def run_server(args: Any) -> int:
    """`ddtree-proxy serve`: build the service (clear one-line errors come from here),
    then serve until interrupted."""
    settings = settings_from_args(args)
    return asyncio.run(_serve(settings))


async def _serve(settings: ServerSettings) -> int:
    service = await build_service(settings)
    try:
        app = create_app(settings, service)
        config = uvicorn.Config(
            app, host=settings.host, port=settings.port, log_level=settings.log_level
        )
        mode = f"proxy for {settings.target_url}" if settings.proxy_mode else "engine"
        logger.warning(
            "ddtree-proxy (%s) serving %s on http://%s:%d",
            mode,
            service.model_name,
            settings.host,
            settings.port,
        )
        await uvicorn.Server(config).serve()
    finally:
        await service.aclose()
    return 0


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
