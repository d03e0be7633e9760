"""The front end's own Prometheus metrics (requests by route and status, their latency), served on
/metrics followed by the engine's, read from tritonserver's metrics endpoint."""
from __future__ import annotations

import time

import httpx
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

CONFIG_INFO = "tritonlm:model_config_info"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class FrontendMetrics:
    """The front end's metrics and the /metrics text."""

    def __init__(self, triton_metrics_url: str | None):
        self.registry = CollectorRegistry()
        self.requests = Counter("tritonlm_frontend_requests", "HTTP requests by route and status",
                                ["route", "method", "status"], registry=self.registry)
        self.latency = Histogram("tritonlm_frontend_request_duration_seconds",
                                 "Time from a request's arrival to its response's last byte",
                                 ["route", "method"], buckets=LATENCY_BUCKETS,
                                 registry=self.registry)
        self.triton_metrics_url = triton_metrics_url
        self.http = httpx.AsyncClient(timeout=5)

    async def render(self) -> str:
        """Our metrics, then tritonserver's (its `tritonlm:` engine metrics among them)."""
        text = generate_latest(self.registry).decode()
        if self.triton_metrics_url:
            try:
                response = await self.http.get(self.triton_metrics_url)
                text += response.text
            except httpx.HTTPError as exc:
                text += f"# tritonserver metrics unavailable: {exc}\n"
        return text

    async def engine_settings(self, model: str) -> dict[str, str]:
        """The settings `model`'s engine loaded with (its `tritonlm:model_config_info` labels:
        the dtype "auto" chose...); empty when tritonserver's metrics cannot be read."""
        if not self.triton_metrics_url:
            return {}
        try:
            text = (await self.http.get(self.triton_metrics_url)).text
        except httpx.HTTPError:
            return {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == CONFIG_INFO and sample.labels.get("model") == model:
                    return sample.labels
        return {}

    async def close(self) -> None:
        await self.http.aclose()


class MetricsMiddleware:
    """Counts and times every request, a streamed response until its last byte (a pure ASGI
    middleware: BaseHTTPMiddleware would re-stream every SSE body through a queue)."""

    def __init__(self, app, metrics: FrontendMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), [500]

        async def observed_send(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, observed_send)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            self.metrics.requests.labels(route, scope["method"], str(status[0])).inc()
            self.metrics.latency.labels(route, scope["method"]).observe(time.perf_counter() - start)
