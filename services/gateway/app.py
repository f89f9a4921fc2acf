"""The gateway's HTTP app (FastAPI): the generation APIs, models, health, metrics.

Every generation API is a module of its own on the shared pipeline (pipeline.py): OpenAI's
completions (completions.py), chat completions (chat_completions.py) and Responses
(responses_api.py), and Anthropic's Messages (messages_api.py). Each adds its routes in `ROUTES`
below; errors the framework raises itself (unknown path, wrong method) are written in the shape of
the API the path belongs to.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandem.services.gateway import chat_completions, completions, messages_api, responses_api
from tandem.services.gateway.errors import APIError, bad_request
from tandem.services.gateway.lora_admin import add_lora_admin_routes
from tandem.services.gateway.pipeline import Gateway, owned_by

__all__ = ["Gateway", "create_app"]

log = logging.getLogger(__name__)

# Each API module: its `API` (errors on its paths are in `API.error`'s shape) and `add_routes(app, gateway)`.
ROUTES = (completions, chat_completions, responses_api, messages_api)


def _error(request: Request, err: APIError) -> Response:
    for module in ROUTES:
        if owned_by(module.API, request.url.path):
            return module.API.error(err)
    return err.response()


def create_app(gateway: Gateway) -> FastAPI:
    app = FastAPI(title="Tandem gateway",
                  description="OpenAI- and Anthropic-compatible APIs in front of the Tandem router")
    app.state.gateway = gateway

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        return _error(request, exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return _error(request, APIError.from_http(exc.status_code, str(exc.detail), request.method,
                                                  request.url.path, exc.headers))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        return _error(request, bad_request(str(exc)))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unhandled gateway error")
        return _error(request, APIError(500, f"gateway error: {type(exc).__name__}: {exc}"))

    for module in ROUTES:
        module.add_routes(app, gateway)
    add_lora_admin_routes(app, gateway)   # POST /v1/load_lora_adapter, /v1/unload_lora_adapter (opt-in)

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        gateway.authorize(request)
        return await gateway.list_models()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> dict:
        gateway.authorize(request)
        return await gateway.get_model(model_id)

    @app.get("/health")
    async def health() -> Response:
        if await gateway.router.serving():
            return JSONResponse({"status": "ok"})
        return APIError(503, f"router {gateway.router.addr} is unreachable or has no workers to route to").response()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(gateway.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
