"""Request traces: spans per phase from the engine's timeline (the SDK's in-memory exporter)."""
import pytest

pytest.importorskip("opentelemetry.sdk")
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

from tritonlm import SamplingParams  # noqa: E402
from tritonlm.tracing import RequestTracer  # noqa: E402

PARENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
PARENT = f"00-{PARENT_TRACE}-b7ad6b7169203331-01"


def test_each_request_gets_a_trace_with_its_phases(smollm2_llm):
    exporter = InMemorySpanExporter()
    tracer = RequestTracer(span_processor=SimpleSpanProcessor(exporter))
    engine = smollm2_llm.engine
    engine.observers.append(tracer)
    try:
        request = engine.make_request("traced", "Hello there", SamplingParams(
            temperature=0, max_tokens=5, ignore_eos=True))
        request.trace_parent = PARENT
        engine.add(request)
        while engine.has_unfinished:
            engine.step()
    finally:
        engine.observers.remove(tracer)
        tracer.shutdown()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"llm_request", "queue", "prefill", "decode", "detokenize"}
    root = spans["llm_request"]
    assert root.attributes["tritonlm.request_id"] == "traced"
    assert root.attributes["tritonlm.output_tokens"] == 5
    assert root.attributes["tritonlm.finish_reason"] == "length"
    assert root.attributes["tritonlm.prompt_tokens"] == len(request.prompt_token_ids)
    assert format(root.context.trace_id, "032x") == PARENT_TRACE  # continues the caller's trace
    for name in ("queue", "prefill", "decode", "detokenize"):
        span = spans[name]
        assert span.parent.span_id == root.context.span_id
        assert root.start_time <= span.start_time <= span.end_time <= root.end_time
    assert spans["queue"].end_time <= spans["prefill"].start_time
    assert spans["prefill"].end_time <= spans["decode"].start_time
