"""Prometheus metrics in the `tritonlm:` namespace through the Python backend's metric API, served
on Triton's metrics endpoint. Names, meanings and buckets follow vLLM's `vllm:` metrics.

NOTE: a failing metric call can abort tritonserver, so names, labels and buckets here are fixed,
buckets ascend, counters only grow and histograms are only observed."""
import time

import triton_python_backend_utils as pb_utils

from tritonlm.engine.stats import FinishedRequest, StepStats

_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0]
FINISH_REASONS = ("stop", "length", "abort")
ERROR_KINDS = ("invalid", "cancelled", "internal", "overloaded", "timeout")


def token_buckets(max_model_len: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to the context limit (vLLM's 1-2-5 buckets)."""
    return [float(m * 10 ** e) for e in range(len(str(max_model_len)))
            for m in (1, 2, 5) if m * 10 ** e <= max_model_len]


class TritonMetrics:
    """An engine observer that updates Triton's Prometheus metrics."""

    def __init__(self, model: str, version: str, max_model_len: int, settings: dict[str, str],
                 max_loras: int | None = None):
        """`max_loras`: where the model serves LoRA adapters, how many a step may serve."""
        self._labels = {"model": model, "version": version}
        self._families = []  # a family must outlive its metrics
        # vLLM's *_config_info idiom: the engine's settings as loaded (the dtype "auto" chose)
        self._gauge("model_config_info", "Engine settings as labels (value 1)", settings).set(1)
        tokens = token_buckets(max_model_len)
        self.ttft = self._histogram("time_to_first_token_seconds", "Time to first token",
                                    _TTFT_BUCKETS)
        self.tpot = self._histogram("time_per_output_token_seconds",
                                    "Time per output token after the first", _TPOT_BUCKETS)
        self.e2e = self._histogram("e2e_request_latency_seconds", "End-to-end request latency",
                                   _LATENCY_BUCKETS)
        self.queue = self._histogram("request_queue_time_seconds",
                                     "Time from arrival to the first step", _LATENCY_BUCKETS)
        self.prompt_lengths = self._histogram("request_prompt_tokens", "Prompt tokens per request",
                                              tokens)
        self.output_lengths = self._histogram("request_generation_tokens",
                                              "Generated tokens per request", tokens)
        self.prompt_tokens = self._counter("prompt_tokens_total", "Prompt tokens processed")
        self.generation_tokens = self._counter("generation_tokens_total", "Tokens generated")
        self.preemptions = self._counter("num_preemptions_total", "Sequences preempted")
        self.prefix_hits = self._counter("prefix_cache_hits_total",
                                         "Prompt tokens found in the prefix cache")
        self.prefix_queries = self._counter("prefix_cache_queries_total",
                                            "Prompt tokens looked up in the prefix cache")
        self.draft_tokens = self._counter("spec_decode_num_draft_tokens_total",
                                          "Speculative tokens proposed and verified")
        self.accepted_tokens = self._counter("spec_decode_num_accepted_tokens_total",
                                             "Speculative tokens accepted")
        self.finished = {reason: self._counter("request_success_total", "Finished requests",
                                               {"finished_reason": reason})
                         for reason in FINISH_REASONS}
        self.errors = {kind: self._counter("request_errors_total", "Failed requests by kind",
                                           {"kind": kind}) for kind in ERROR_KINDS}
        self.running = self._gauge("num_requests_running", "Sequences in the running batch")
        self.waiting = self._gauge("num_requests_waiting", "Sequences waiting to be scheduled")
        self.preempted = self._gauge("num_requests_swapped",
                                     "Preempted sequences waiting to be recomputed")
        self.blocks_used = self._gauge("kv_cache_blocks_used", "KV cache blocks in use")
        self.blocks_free = self._gauge("kv_cache_blocks_free", "KV cache blocks free")
        self.blocks_total = self._gauge("kv_cache_blocks_total", "KV cache blocks allocated")
        self.usage = self._gauge("kv_cache_usage_perc", "Fraction of the KV cache in use (0 to 1)")
        self._step_gauges = (self.running, self.waiting, self.preempted, self.blocks_used,
                             self.blocks_free, self.blocks_total, self.usage)
        self._step_values = (None,) * len(self._step_gauges)  # as last set
        # vLLM's lora_requests_info (what LoRA-aware routers read): one series, its labels the
        # adapters now running and waiting, its value when they last changed
        self._lora_family = None
        if max_loras:
            self._lora_family = pb_utils.MetricFamily(
                name="tritonlm:lora_requests_info", kind=pb_utils.MetricFamily.GAUGE,
                description="Running and waiting LoRA adapters (labels); value: when they changed")
            self._families.append(self._lora_family)
        self._max_loras = str(max_loras)
        self._lora_state, self._lora_info = None, None

    def _metric(self, kind, name: str, description: str, buckets=None, labels=None):
        family = pb_utils.MetricFamily(name=f"tritonlm:{name}", description=description, kind=kind)
        self._families.append(family)
        labels = {**self._labels, **(labels or {})}
        return family.Metric(labels=labels) if buckets is None else family.Metric(
            labels=labels, buckets=buckets)

    def _histogram(self, name, description, buckets):
        # pb_utils.MetricFamily exists only once the stub runs the model, not at import time
        return self._metric(pb_utils.MetricFamily.HISTOGRAM, name, description, buckets)

    def _counter(self, name, description, labels=None):
        return self._metric(pb_utils.MetricFamily.COUNTER, name, description, labels=labels)

    def _gauge(self, name, description, labels=None):
        return self._metric(pb_utils.MetricFamily.GAUGE, name, description, labels=labels)

    def on_step(self, stats: StepStats) -> None:
        values = (stats.num_running, stats.num_waiting, stats.num_preempted_waiting,
                  stats.kv_blocks_used, stats.kv_blocks_total - stats.kv_blocks_used,
                  stats.kv_blocks_total, stats.kv_blocks_used / stats.kv_blocks_total)
        # Each metric call is a round trip to the server process: gauges are set as they change
        # (a few times a request), not every step.
        for gauge, value, last in zip(self._step_gauges, values, self._step_values):
            if value != last:
                gauge.set(value)
        self._step_values = values
        if stats.num_preemptions:
            self.preemptions.increment(stats.num_preemptions)
        if stats.prefix_cache_queries:
            self.prefix_queries.increment(stats.prefix_cache_queries)
            self.prefix_hits.increment(stats.prefix_cache_hits)
        if stats.num_draft_tokens:
            self.draft_tokens.increment(stats.num_draft_tokens)
            self.accepted_tokens.increment(stats.num_accepted_tokens)
        lora_state = (stats.running_adapters, stats.waiting_adapters)
        if self._lora_family and lora_state != self._lora_state:
            self._lora_state = lora_state
            self._lora_info = None  # its series goes before the next one comes
            self._lora_info = self._lora_family.Metric(labels={
                **self._labels, "max_lora": self._max_loras,
                "running_lora_adapters": ",".join(stats.running_adapters),
                "waiting_lora_adapters": ",".join(stats.waiting_adapters)})
            self._lora_info.set(time.time())

    def on_request_finished(self, request: FinishedRequest) -> None:
        t = request.timeline
        self.e2e.observe(t.finished - t.arrival)
        if t.scheduled is not None:
            self.queue.observe(t.scheduled - t.arrival)
        if t.first_token is not None:
            self.ttft.observe(t.first_token - t.arrival)
            if request.num_output_tokens > 1:
                self.tpot.observe((t.finished - t.first_token) / (request.num_output_tokens - 1))
        self.prompt_lengths.observe(request.num_prompt_tokens)
        self.output_lengths.observe(request.num_output_tokens)
        self.prompt_tokens.increment(request.num_prompt_tokens)
        self.generation_tokens.increment(request.num_output_tokens)
        if request.finish_reason in self.finished:
            self.finished[request.finish_reason].increment(1)

    def on_request_error(self, kind: str) -> None:
        self.errors[kind].increment(1)
