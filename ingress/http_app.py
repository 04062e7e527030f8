"""The HTTP surface (FastAPI): routes, API-key check, body-size cap, and OpenAI-shaped errors.

Every error, including unknown routes and unexpected failures, answers with
``{"error": {"message", "type", "param", "code"}}``; nothing internal (tracebacks, addresses) leaks.
``/v1/*``, vLLM's utility routes (``/tokenize``, ``/detokenize``, ``/version``) and the API description
(``/docs``, ``/redoc``, ``/openapi.json``) need the API key when one is configured; ``/health`` and
``/metrics`` do not (probes and scrapers), and reveal no request content.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp

from ingress.adapter_routes import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest, change_adapter
from ingress.asgi_routes import GenerationRoutes, answer, read_body, route_path
from ingress.openai_protocol import APIError, ChatCompletionRequest, CompletionRequest
from ingress.openai_serving import OpenAIServing
from ingress.request_timing import DEBUG_HEADER, wants_timing
from ingress.utility_routes import DetokenizeRequest, TokenizeRequest, detokenize, tokenize, version

logger = logging.getLogger(__name__)


_REF = "#/components/schemas/{model}"


def _body_schema(model) -> dict:
    """The request body's schema for OpenAPI (the body is parsed by hand, to control every error)."""
    schema = model.model_json_schema(ref_template=_REF)
    schema.pop("$defs", None)  # hoisted into components by _with_components
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _with_components(app: FastAPI, models) -> None:
    base = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = base()
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for m in models:
                components.update(m.model_json_schema(ref_template=_REF).get("$defs", {}))
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


class _Answered(Response):
    """A generation handler's result as FastAPI's routes send it, when they are reached (the front
    answers these routes first): the front's own ``answer``, so both send the same bytes."""

    def __init__(self, result) -> None:
        self.result, self.background = result, None

    async def __call__(self, scope, receive, send) -> None:
        await answer(self.result, scope, receive, send)


class _APIKeyGuard:
    """Refuses ``/v1/*`` and the ``guarded`` paths without ``Authorization: Bearer <key>`` (compared
    in constant time). Plain ASGI, not ``BaseHTTPMiddleware``: a streamed response's chunks go
    straight to the server, not through a memory stream and a task per request."""

    def __init__(self, app, key: bytes, guarded: tuple[str, ...]) -> None:
        self.app, self.key, self.guarded = app, key, guarded

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            path = route_path(scope)  # what routing matches: a mount's root_path stripped, as it is
            if path.startswith("/v1/") or path.startswith(self.guarded):
                header = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
                scheme, _, token = header.partition(b" ")
                if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                    err = APIError(401, "missing or invalid API key", code="invalid_api_key")
                    response = JSONResponse(
                        err.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"}
                    )
                    await response(scope, receive, send)
                    return
        await self.app(scope, receive, send)


def build_http_app(
    serving: OpenAIServing,
    api_key: str | None,
    health: Callable[[], Awaitable[tuple[bool, dict]]],
    metrics: Callable[[], Awaitable[bytes]],
) -> ASGIApp:
    """The ingress's ASGI app: FastAPI for every route, the generation routes answered in front of it
    (``ingress.asgi_routes``), behind the API-key check when a key is set."""
    app = FastAPI(title="pdserve", description="OpenAI-compatible disaggregated prefill/decode serving")
    key = api_key.encode() if api_key else None
    guarded = tuple(p for p in (app.docs_url, app.redoc_url, app.openapi_url) if p)
    guarded += ("/tokenize", "/detokenize", "/version")
    max_body = serving.options.max_body_bytes

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        err = APIError(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None)
        return JSONResponse(err.body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        logger.exception("unhandled error on %s", request.url.path)
        return JSONResponse(APIError(500, "internal server error", code="internal").body(), status_code=500)

    async def read_request(request: Request) -> bytes:
        return await read_body(request.headers.get("content-length"), request.stream(), max_body)

    @app.post("/v1/completions", openapi_extra=_body_schema(CompletionRequest))
    async def completions(request: Request):
        arrived, timing = time.perf_counter(), wants_timing(request.headers.get(DEBUG_HEADER))
        return _Answered(await serving.completions(await read_request(request), arrived, timing))

    @app.post("/v1/chat/completions", openapi_extra=_body_schema(ChatCompletionRequest))
    async def chat_completions(request: Request):
        arrived, timing = time.perf_counter(), wants_timing(request.headers.get(DEBUG_HEADER))
        return _Answered(await serving.chat(await read_request(request), arrived, timing))

    @app.get("/v1/models")
    async def models():
        return await serving.models()

    @app.post("/tokenize", openapi_extra=_body_schema(TokenizeRequest))
    async def tokenize_route(request: Request):
        return JSONResponse(await tokenize(serving, await read_request(request)))

    @app.post("/detokenize", openapi_extra=_body_schema(DetokenizeRequest))
    async def detokenize_route(request: Request):
        return JSONResponse(await detokenize(serving, await read_request(request)))

    @app.post("/v1/load_lora_adapter", openapi_extra=_body_schema(LoadLoRAAdapterRequest))
    async def load_lora_adapter(request: Request):
        return JSONResponse(await change_adapter(serving, await read_request(request), unload=False))

    @app.post("/v1/unload_lora_adapter", openapi_extra=_body_schema(UnloadLoRAAdapterRequest))
    async def unload_lora_adapter(request: Request):
        return JSONResponse(await change_adapter(serving, await read_request(request), unload=True))

    @app.get("/version")
    async def version_route():
        return version()

    @app.get("/health")
    async def health_check():
        ok, detail = await health()
        return JSONResponse(detail, status_code=200 if ok else 503)

    # Load balancers probe with HEAD too (one operation in the API description: GET's).
    app.add_api_route("/health", health_check, methods=["HEAD"], include_in_schema=False)

    @app.get("/metrics")
    async def prometheus():
        return Response(await metrics(), media_type="text/plain; version=0.0.4; charset=utf-8")

    _with_components(
        app,
        (
            CompletionRequest,
            ChatCompletionRequest,
            TokenizeRequest,
            DetokenizeRequest,
            LoadLoRAAdapterRequest,
            UnloadLoRAAdapterRequest,
        ),
    )
    # The generation routes in front of FastAPI (ingress.asgi_routes), the API key in front of both.
    front = GenerationRoutes(
        app, {"/v1/completions": serving.completions, "/v1/chat/completions": serving.chat}, max_body
    )
    return front if key is None else _APIKeyGuard(front, key, guarded)
