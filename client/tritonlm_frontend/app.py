"""The ASGI app: the OpenAI API under /v1, TGI's routes at the root, the chat page at GET /,
/health and /metrics; every route is a Triton client of the same tritonserver."""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from . import chat_page, openai_api, tgi_api
from .errors import APIError
from .metrics import FrontendMetrics, MetricsMiddleware
from .served_models import ModelCatalog
from .replica_pool import ReplicaPool
from .triton_gateway import TritonGateway

logger = logging.getLogger("tritonlm.frontend")


@dataclass
class FrontendSettings:
    triton_url: str | list[str] = "localhost:8001"  # tritonserver's gRPC endpoint, or replicas
    triton_metrics_url: str | None = "http://localhost:8002/metrics"
    model_repository: Path | None = None  # read for tokenizers and sampling defaults
    routing: str = "prefix-affinity"  # over several tritonservers: replica_pool.ROUTINGS


def error_body(request: Request, error: APIError) -> dict:
    """OpenAI's error object under /v1, TGI's {"error", "error_type"} elsewhere."""
    if request.url.path.startswith("/v1"):
        return {"error": {"message": error.message, "type": error.kind, "param": error.param,
                          "code": error.status}}
    return {"error": error.message, "error_type": tgi_api.error_type(error)}


def create_app(settings: FrontendSettings) -> FastAPI:
    urls = [settings.triton_url] if isinstance(settings.triton_url, str) else list(settings.triton_url)
    gateway = TritonGateway(urls[0]) if len(urls) == 1 else ReplicaPool(urls, settings.routing)
    catalog = ModelCatalog(gateway, settings.model_repository)
    metrics = FrontendMetrics(settings.triton_metrics_url)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        try:
            await catalog.refresh()
            logger.info("serving %s from tritonserver at %s", ", ".join(catalog.models) or "no model",
                        gateway.url)
        except Exception as exc:  # tritonserver may come up later; routes refresh on demand
            logger.warning("tritonserver at %s not reachable yet: %s", gateway.url, exc)
        yield
        await gateway.close()
        await metrics.close()

    app = FastAPI(title="tritonlm", lifespan=lifespan, docs_url="/docs", redoc_url=None)
    app.state.gateway, app.state.catalog, app.state.metrics = gateway, catalog, metrics

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError):
        return JSONResponse(error_body(request, error), status_code=error.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": str(exc)}
        where = ".".join(str(p) for p in first["loc"] if p != "body")
        status = 400 if request.url.path.startswith("/v1") else 422
        return await api_error(request, APIError(status, f"{where}: {first['msg']}", where or None))

    @app.get("/health")
    async def health():
        if not await gateway.is_ready():
            raise APIError(503, f"tritonserver at {gateway.url} is not ready")
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus_metrics():
        return PlainTextResponse(await metrics.render(),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    app.include_router(openai_api.router)
    app.include_router(tgi_api.router)
    app.include_router(chat_page.router)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    return app
