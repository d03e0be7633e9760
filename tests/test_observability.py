"""Metrics, traces and readiness of the served model, against the real tritonserver."""
import http.server
import json
import queue
import threading
import time
import urllib.request

import pytest
import tritonclient.grpc as grpcclient
from prometheus_client.parser import text_string_to_metric_families

from conftest import linked_repository
from test_server import grpc_inputs, grpc_stream, http_post
from triton_server import start_server


def scrape(server) -> dict:
    """{(sample name, frozenset(labels)): value} for the tritonlm: samples on /metrics."""
    with urllib.request.urlopen(f"http://{server.metrics_url}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {(s.name, frozenset((k, v) for k, v in s.labels.items() if k not in ("model", "version"))):
            s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name.startswith("tritonlm:")}


def value(samples, name, **labels):
    return samples.get((f"tritonlm:{name}", frozenset(labels.items())), 0.0)


def delta(before, after, name, **labels):
    return value(after, name, **labels) - value(before, name, **labels)


def test_metrics_count_what_was_sent_and_return_to_idle(smollm2_server, smollm2_tokenizer):
    prompts = ["Hello", "The sky is", "Count: one, two,"]
    before = scrape(smollm2_server)
    for prompt in prompts:
        _, error = grpc_stream(smollm2_server.grpc_url, prompt,
                               {"max_tokens": 5, "ignore_eos": True}, stream=False)
        assert error is None
    after = scrape(smollm2_server)
    prompt_tokens = sum(len(smollm2_tokenizer.encode(p)) for p in prompts)
    assert delta(before, after, "prompt_tokens_total") == prompt_tokens
    assert delta(before, after, "generation_tokens_total") == 15
    assert delta(before, after, "request_success_total", finished_reason="length") == 3
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                      "request_queue_time_seconds", "time_per_output_token_seconds",
                      "request_prompt_tokens", "request_generation_tokens"):
        assert delta(before, after, f"{histogram}_count") == 3, histogram
    assert delta(before, after, "request_generation_tokens_sum") == 15
    assert delta(before, after, "request_generation_tokens_bucket", le="5") == 3
    assert delta(before, after, "request_generation_tokens_bucket", le="2") == 0
    assert value(after, "num_requests_running") == 0 and value(after, "num_requests_waiting") == 0
    assert value(after, "kv_cache_blocks_used") == 0 and value(after, "kv_cache_usage_perc") == 0
    assert value(after, "kv_cache_blocks_free") == value(after, "kv_cache_blocks_total") > 0

    status, _ = http_post(smollm2_server.http_url, "/v2/models/llm/generate",
                          {"text_input": "hi", "top_p": 5.0})
    assert status == 400
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(smollm2_server.grpc_url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    client.async_stream_infer("llm", grpc_inputs("Count to a thousand:", {"max_tokens": 400}, True))
    responses.get(timeout=60)
    client.stop_stream(cancel_requests=True)
    deadline = time.monotonic() + 30
    while delta(after, scrape(smollm2_server), "request_success_total", finished_reason="abort") < 1:
        assert time.monotonic() < deadline, "the cancelled request never finished"
        time.sleep(0.2)
    final = scrape(smollm2_server)
    assert delta(after, final, "request_errors_total", kind="invalid") == 1
    assert delta(after, final, "request_errors_total", kind="cancelled") == 1
    assert value(final, "num_requests_running") == 0 and value(final, "kv_cache_blocks_used") == 0


class _Collector(http.server.BaseHTTPRequestHandler):
    """An OTLP/HTTP receiver: protobuf from the Python SDK (ours), JSON from Triton's C++ one.
    Spans arrive as (name, trace id hex, span id hex, parent span id hex, attributes)."""
    protocol_version = "HTTP/1.1"
    received: "queue.Queue" = queue.Queue()

    def do_POST(self):
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest, ExportTraceServiceResponse)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        request = ExportTraceServiceRequest()
        if "json" in self.headers.get("Content-Type", ""):
            request = _parse_otlp_json(json.loads(body))
        else:
            request.ParseFromString(body)
        for resource in request.resource_spans:
            for scope in resource.scope_spans:
                for span in scope.spans:
                    self.received.put(span)
        body = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def _parse_otlp_json(document: dict):
    """OTLP/JSON carries ids as hex; the protobuf JSON mapping expects base64 bytes."""
    import base64
    from google.protobuf.json_format import ParseDict
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    for resource in document.get("resourceSpans", []):
        for scope in resource.get("scopeSpans", []):
            for span in scope.get("spans", []):
                for key in ("traceId", "spanId", "parentSpanId"):
                    if span.get(key):
                        span[key] = base64.b64encode(bytes.fromhex(span[key])).decode()
    return ParseDict(document, ExportTraceServiceRequest(), ignore_unknown_fields=True)


def test_served_requests_export_spans_continuing_tritons_trace(smollm2_repo, tmp_path,
                                                               monkeypatch):
    collector = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{collector.server_address[1]}/v1/traces"
    monkeypatch.setenv("TRITONLM_OTLP_ENDPOINT", url)
    repo = linked_repository(smollm2_repo, tmp_path / "repo", num_kv_blocks=32)
    triton_tracing = ("--exit-timeout-secs=5", "--trace-config", "mode=opentelemetry",
                      "--trace-config", f"opentelemetry,url={url}", "--trace-config", "rate=1",
                      "--trace-config", "level=TIMESTAMPS")
    try:
        with start_server(repo, extra_args=triton_tracing) as server:
            client = grpcclient.InferenceServerClient(server.grpc_url)
            done = queue.Queue()
            client.start_stream(callback=lambda result, error: done.put(error))
            client.async_stream_infer("llm", grpc_inputs("Hi", {"max_tokens": 3}, False),
                                      request_id="traced-request")
            assert done.get(timeout=60) is None
            client.stop_stream()
            spans = {}
            ours = {"llm_request", "queue", "prefill", "decode", "detokenize"}
            deadline = time.monotonic() + 30
            while not (ours <= set(spans) and "llm" in spans) and time.monotonic() < deadline:
                try:
                    span = _Collector.received.get(timeout=1)
                    spans[span.name] = span
                except queue.Empty:
                    pass
    finally:
        collector.shutdown()
    assert ours <= set(spans)
    # Triton's own span for the model ("llm") is the parent of our request span.
    assert spans["llm_request"].trace_id == spans["llm"].trace_id
    assert spans["llm_request"].parent_span_id == spans["llm"].span_id
    attributes = {a.key: a.value for a in spans["llm_request"].attributes}
    assert attributes["tritonlm.request_id"].string_value.startswith("traced-request-")
    assert attributes["tritonlm.output_tokens"].int_value == 3
    assert all(spans[name].parent_span_id == spans["llm_request"].span_id
               for name in ours - {"llm_request"})


BROKEN_MODEL = '''
from tritonlm.triton.adapter import TritonPythonModel as Served

POISON = [7, 7, 7, 7]


class TritonPythonModel(Served):
    """The served model, with an engine that breaks for good once it sees POISON (a device that
    failed, say): every step from then on raises."""

    def initialize(self, args):
        super().initialize(args)
        engine, add, step = self.engine, self.engine.add, self.engine.step
        broken = []

        def poisoned_add(request):
            if request.prompt_token_ids == POISON:
                broken.append(True)
            add(request)

        def failing_step():
            if broken:
                raise RuntimeError("device lost")
            return step()
        engine.add, engine.step = poisoned_add, failing_step
'''


def test_a_dead_engine_makes_the_model_not_ready(smollm2_repo, tmp_path):
    repo = linked_repository(smollm2_repo, tmp_path / "repo", num_kv_blocks=32)
    (repo / "llm" / "1" / "model.py").write_text(BROKEN_MODEL)
    with start_server(repo) as server:
        ready = f"http://{server.http_url}/v2/models/llm/ready"
        _, error = grpc_stream(server.grpc_url, "fine", {"max_tokens": 2})
        assert error is None
        errors = [grpc_stream(server.grpc_url, [7, 7, 7, 7], {"max_tokens": 2})[1]]
        errors += [grpc_stream(server.grpc_url, "after", {"max_tokens": 2})[1] for _ in range(3)]
        assert all(e is not None for e in errors)
        assert "device lost" in str(errors[0])
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(ready, timeout=2)
            except urllib.error.HTTPError:
                break  # not ready
            assert time.monotonic() < deadline, "the model still reports ready"
            time.sleep(0.2)
        assert server.logs().count("the engine loop died") == 1
