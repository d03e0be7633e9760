"""OpenTelemetry spans per request (queue, prefill, decode, detokenize), exported over OTLP/HTTP.

Enabled by an endpoint: `otlp_endpoint` in engine.json or the TRITONLM_OTLP_ENDPOINT environment
variable. Without one nothing is imported or recorded. Spans are written when a request
finishes, from the engine's timeline, so the step loop never waits on the exporter.
"""
import os

from tritonlm.engine.stats import FinishedRequest, StepStats

ENDPOINT_VARIABLE = "TRITONLM_OTLP_ENDPOINT"


def otlp_endpoint(configured: str | None) -> str | None:
    return os.environ.get(ENDPOINT_VARIABLE) or configured


class RequestTracer:
    """An engine observer that turns each finished request into a trace."""

    def __init__(self, endpoint: str | None = None, span_processor=None,
                 service_name: str = "tritonlm"):
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        if span_processor is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            span_processor = BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint))
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self.provider.add_span_processor(span_processor)
        self.tracer = self.provider.get_tracer("tritonlm")
        self.propagator = TraceContextTextMapPropagator()

    def on_step(self, stats: StepStats) -> None:
        pass

    def on_request_error(self, kind: str) -> None:
        pass

    def on_request_finished(self, request: FinishedRequest) -> None:
        from opentelemetry import trace
        t = request.timeline
        parent = None
        if request.trace_parent:
            parent = self.propagator.extract({"traceparent": request.trace_parent})
        root = self.tracer.start_span("llm_request", context=parent, start_time=_ns(t.arrival),
                                      attributes={
                                          "tritonlm.request_id": request.request_id,
                                          "tritonlm.prompt_tokens": request.num_prompt_tokens,
                                          "tritonlm.output_tokens": request.num_output_tokens,
                                          "tritonlm.finish_reason": request.finish_reason})
        context = trace.set_span_in_context(root)
        phases = (("queue", t.arrival, t.scheduled), ("prefill", t.scheduled, t.first_token),
                  ("decode", t.first_token, t.finished),
                  ("detokenize", t.finished - t.detokenize_seconds, t.finished))
        for name, start, end in phases:
            if start is not None and end is not None:
                span = self.tracer.start_span(name, context=context, start_time=_ns(start))
                span.end(end_time=_ns(end))
        root.end(end_time=_ns(t.finished))

    def shutdown(self) -> None:
        """Export what is buffered and stop."""
        self.provider.shutdown()


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)
