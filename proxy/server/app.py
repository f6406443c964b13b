"""The OpenAI-compatible HTTP server (FastAPI + uvicorn): the app, its routes and
API-key guard, and `ddtree-proxy serve`. What a request does is in
`proxy.server.handlers`.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import secrets
from collections.abc import Coroutine
from contextlib import asynccontextmanager
from typing import Any

import httpx
import uvicorn
from fastapi import Depends, FastAPI, Request, Response
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse

from proxy.runtime import Runtime, build_runtime
from proxy.server.errors import RequestError, error_body
from proxy.server.handlers import Handlers
from proxy.server.request_models import REQUEST_MODELS
from proxy.server.settings import ServerSettings

logger = logging.getLogger("ddtree_proxy.server")
# The project's loggers: the server and the runtime log as ddtree_proxy.*, the other
# modules under their own names (proxy.*).
PROJECT_LOGGERS = ("ddtree_proxy", "proxy")
RELAYED_METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
VLLM_GUARDED_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")


def create_app(
    settings: ServerSettings,
    runtime: Runtime | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> FastAPI:
    """The app. Without `runtime`, it is built when the app starts and closed when it
    stops (so it lives in the server's event loop); `transport` then goes to
    `build_runtime` (tests inject a mock upstream)."""
    server = Handlers(settings, runtime)

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

    async def authorize_as_vllm(request: Request) -> None:
        # A relayed route is guarded as vLLM's own --api-key guards it: the paths under
        # its guarded prefixes, any method but OPTIONS (vllm/entrypoints/serve/
        # middleware/authenticate.py, AuthenticationMiddleware).
        if request.url.path.startswith(VLLM_GUARDED_PREFIXES) and request.method != "OPTIONS":
            await authorize(request)

    # The generation routes check the key themselves: a FastAPI dependency is solved on
    # every request, a cost per request as large as a few relayed events.
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        await authorize(request)
        return await server.generate(request, "completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        await authorize(request)
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

    @app.get("/ddtree/report", dependencies=guarded)
    async def ab_report() -> Response:
        return JSONResponse(await server.ab.report())

    @app.get("/ddtree/ab", dependencies=guarded)
    async def ab_state() -> Response:
        return JSONResponse(server.ab.state())

    @app.post("/ddtree/ab", dependencies=guarded)
    async def ab_change(request: Request) -> Response:
        return JSONResponse(server.ab.change(await request.body()))

    if settings.proxy_mode:
        # Last, so that it matches only what no route above does: every other route
        # vLLM serves (/tokenize, /v1/embeddings, /v1/responses, /version, ...).
        @app.api_route(
            "/{path:path}",
            methods=RELAYED_METHODS,
            dependencies=[Depends(authorize_as_vllm)],
            include_in_schema=False,
        )
        async def relayed(request: Request) -> Response:
            return await server.relay_route(request)

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


def configure_logging(level: str) -> None:
    """`--log-level` for the project's own loggers (uvicorn takes it from its config)."""
    for name in PROJECT_LOGGERS:
        logging.getLogger(name).setLevel(level.upper())


def run_server(settings: ServerSettings) -> int:
    """`ddtree-proxy serve`: build the service (clear one-line errors come from here),
    then serve until interrupted."""
    configure_logging(settings.log_level)
    return _run_loop(_serve(settings))


def _run_loop(main: Coroutine[Any, Any, int]) -> int:
    """`main` on uvloop where it is installed (not on Windows), else on asyncio's loop.
    128 concurrent pass-through streams ran at a median 0.95x of vLLM alone on uvloop
    against 0.60x on asyncio's loop (6 interleaved repetitions, 2 cores shared with
    vLLM): relaying an event per token is the proxy's busiest work."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


async def _serve(settings: ServerSettings) -> int:
    runtime = await build_runtime(settings)
    try:
        app = create_app(settings, runtime)
        # What starting made (modules, the tokenizer, the model's objects) lives as long
        # as the server. Collected once and frozen, it is left out of the collector's
        # passes while serving, which then walk only what requests allocate; else every
        # full pass walks all of it with every stream stopped (docs/PERFORMANCE.md). vLLM
        # does the same after its start (vllm/utils/gc_utils.py, freeze_gc_heap).
        gc.collect()
        gc.freeze()
        config = uvicorn.Config(
            app, host=settings.host, port=settings.port, log_level=settings.log_level
        )
        logger.warning(
            "ddtree-proxy (%s, target %s) serving %s on http://%s:%d; drafter: %s; tree: %s, "
            "budget %d, %s policy; text: %s; generation defaults: %s",
            runtime.target.label,
            settings.target_url or "in-process",
            runtime.model_name,
            settings.host,
            settings.port,
            runtime.drafter.name if runtime.drafter is not None else "none",
            settings.tree.kind,
            settings.tree.budget,
            settings.tree.policy,
            runtime.text_source,
            runtime.generation_defaults.describe(),
        )
        await uvicorn.Server(config).serve()
    finally:
        await runtime.aclose()
    return 0
