"""The engine thread: callbacks per delta, cancellation frees blocks, shutdown aborts in flight."""
import threading
import time
from pathlib import Path

import pytest
import torch

from tritonlm.engine import cancellation_watch
from tritonlm.engine.async_engine import AsyncEngine
from tritonlm.sampling_params import SamplingParams


class Collector:
    def __init__(self):
        self.outputs = []
        self.done = threading.Event()

    def __call__(self, output):
        self.outputs.append(output)
        if output.finished:
            self.done.set()


@pytest.fixture
def async_engine(smollm2_llm):
    engine = AsyncEngine(smollm2_llm.engine)
    engine.start()
    yield engine
    engine.shutdown()
    assert not engine.is_alive


def submit(async_engine, request_id, prompt, cancelled=None, **params):
    collector = Collector()
    request = async_engine.engine.make_request(request_id, prompt, SamplingParams(**params))
    async_engine.submit(request, collector, cancelled)
    return collector


def test_streams_deltas_and_finishes(async_engine, smollm2_llm):
    collector = submit(async_engine, "a", "Hello", temperature=0, max_tokens=8, ignore_eos=True)
    assert collector.done.wait(120)
    offline = smollm2_llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8,
                                                             ignore_eos=True))[0]
    assert [t for o in collector.outputs for t in o.sequences[0].token_ids] == offline.token_ids
    assert "".join(o.sequences[0].text for o in collector.outputs) == offline.text
    assert [o.finished for o in collector.outputs] == [False] * 7 + [True]


def test_its_threads_are_named_for_the_os_and_the_engine_passes_its_name_to_its_workers(
        async_engine):
    """top -H, perf and /proc show which thread is which; the engine's OpenMP workers, started
    by the engine thread, carry its name."""
    collector = submit(async_engine, "n", "Hello", temperature=0, max_tokens=4, ignore_eos=True)
    assert collector.done.wait(120)
    names = [(task / "comm").read_text().strip() for task in Path("/proc/self/task").iterdir()]
    assert {"tritonlm-engine", "tritonlm-sender", "tritonlm-cancel"} <= set(names)
    assert names.count("tritonlm-engine") >= min(2, torch.get_num_threads())


def test_cancellation_stops_the_request_and_frees_its_blocks(async_engine):
    blocks = async_engine.engine.block_manager
    cancel = threading.Event()
    asked_on = set()

    def cancelled():  # in Triton a round trip to the server, so never asked on the engine thread
        asked_on.add(threading.current_thread().name)
        return cancel.is_set()

    collector = submit(async_engine, "c", "Count:", cancelled=cancelled, temperature=0,
                       max_tokens=500, ignore_eos=True)
    while len(collector.outputs) < 3:
        assert not collector.done.wait(0.01)
    cancel.set()
    assert collector.done.wait(60)
    assert collector.outputs[-1].sequences[0].finish_reason == "abort"
    assert len(collector.outputs) < 100
    assert blocks.num_free_blocks == blocks.num_blocks
    assert asked_on and "tritonlm-engine" not in asked_on


@pytest.mark.parametrize("streams", [1, 32])
def test_cancellation_questions_are_bounded_per_second_and_one_stream_is_asked_often(streams):
    """Each is_cancelled() is a round trip through tritonserver: at most CANCEL_POLLS_PER_SECOND
    a second however many requests are in flight, and a lone request still every
    CANCEL_POLL_INTERVAL."""
    ended, asked = threading.Event(), []
    watch = cancellation_watch.CancellationWatch(ended, lambda ids: None)
    for index in range(streams):
        watch.watch(str(index), lambda: asked.append(time.monotonic()) or False)
    watch.thread.start()
    time.sleep(2.0)
    ended.set()
    watch.thread.join()
    per_second = cancellation_watch.CANCEL_POLLS_PER_SECOND
    if streams == 1:
        assert len(asked) >= 0.5 * 2.0 / cancellation_watch.CANCEL_POLL_INTERVAL
    else:  # whole sweeps, the last may start just before the end
        assert streams * 2 <= len(asked) <= 2.0 * per_second + streams


def test_cancellation_is_never_asked_once_the_last_output_is_being_sent(async_engine,
                                                                        monkeypatch):
    """Triton frees a request's response factory when its final response is sent; asking
    is_cancelled() after that reads freed memory (tritonserver died with SIGSEGV)."""
    monkeypatch.setattr(cancellation_watch, "CANCEL_POLL_INTERVAL", 0.0005)
    monkeypatch.setattr(cancellation_watch, "CANCEL_POLL_DUTY", 1.0)  # sweep without a pause
    monkeypatch.setattr(cancellation_watch, "CANCEL_POLLS_PER_SECOND", float("inf"))
    asked_after_final = []
    collectors = []
    for index in range(24):
        final_sent = threading.Event()
        collector = Collector()

        def cancelled(final_sent=final_sent, index=index):
            time.sleep(0.0005)  # a round trip to Triton: widens the window
            if final_sent.is_set():
                asked_after_final.append(index)
            return False

        def on_output(output, final_sent=final_sent, collector=collector):
            if output.finished:
                final_sent.set()
            collector(output)
        request = async_engine.engine.make_request(
            f"r{index}", "Hi", SamplingParams(temperature=0, max_tokens=1 + index,
                                              ignore_eos=True))
        async_engine.submit(request, on_output, cancelled)
        collectors.append(collector)
    assert all(c.done.wait(120) for c in collectors)
    time.sleep(0.05)  # the watcher's sweep in progress ends
    assert asked_after_final == []


def test_a_failing_callback_aborts_only_its_request(async_engine):
    def explode(output):
        raise RuntimeError("client went away")
    request = async_engine.engine.make_request("bad", "Hi", SamplingParams(max_tokens=50))
    async_engine.submit(request, explode)
    good = submit(async_engine, "good", "Hi", temperature=0, max_tokens=6, ignore_eos=True)
    assert good.done.wait(120)
    assert sum(len(o.sequences[0].token_ids) for o in good.outputs) == 6
    assert async_engine.engine.block_manager.num_free_blocks == \
        async_engine.engine.block_manager.num_blocks


def test_observers_run_on_the_sender_thread_and_count_a_request_before_its_last_output(
        async_engine):
    """Triton's metric calls are round trips to the server: they must not hold up the step loop,
    and a scrape after a response must already count its request."""
    events = []

    class SlowObserver:  # a failing call is logged, not fatal to the loop or the other calls
        def on_step(self, stats):
            events.append(("step", threading.current_thread().name))
            time.sleep(0.05)
            raise RuntimeError("metric call failed")

        def on_request_finished(self, request):
            events.append(("finished", request.request_id, threading.current_thread().name))

        def on_request_error(self, kind):
            events.append(("error", kind))

    observers_before = list(async_engine.engine.observers)
    async_engine.observe(SlowObserver())
    collector = Collector()
    request = async_engine.engine.make_request("m", "Hi", SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True))

    def on_output(output):
        if output.finished:
            events.append(("last output", output.request_id))
        collector(output)
    started = time.monotonic()
    async_engine.submit(request, on_output)
    assert collector.done.wait(120)
    # the observer's 50 ms per step ran on the sender, in order with the outputs
    assert time.monotonic() - started >= 0.3
    assert len(async_engine.engine.observers) == len(observers_before) + 1
    threads = {e[-1] for e in events if e[0] in ("step", "finished")}
    assert threads == {"tritonlm-sender"}
    order = [e[0] for e in events if e[0] != "step"]
    assert order == ["finished", "last output"]
    assert sum(e[0] == "step" for e in events) >= 6
    async_engine.engine.report_error("invalid")
    deadline = time.monotonic() + 10
    while ("error", "invalid") not in events and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ("error", "invalid") in events


def test_shutdown_ends_requests_in_flight_with_abort(smollm2_llm):
    engine = AsyncEngine(smollm2_llm.engine)
    engine.start()
    collector = submit(engine, "s", "Story:", max_tokens=500, ignore_eos=True)
    while not collector.outputs:
        assert not collector.done.wait(0.01)
    engine.shutdown()
    assert collector.done.is_set()
    assert collector.outputs[-1].sequences[0].finish_reason == "abort"
    assert not engine.is_alive
    with pytest.raises(RuntimeError):
        engine.submit(smollm2_llm.engine.make_request("late", "x", SamplingParams()), Collector())


def test_an_engine_built_by_start_runs_on_the_step_loop_thread(smollm2_llm):
    """Given a factory, start() builds the engine on the loop thread (the only thread then that
    runs its torch work) and serves with it."""
    built_on = []

    def make_engine():
        built_on.append(threading.current_thread().name)
        return smollm2_llm.engine
    engine = AsyncEngine(make_engine)
    engine.start()
    try:
        assert built_on == ["tritonlm-engine"] and engine.engine is smollm2_llm.engine
        collector = submit(engine, "built", "Hi", temperature=0, max_tokens=3, ignore_eos=True)
        assert collector.done.wait(120)
        assert sum(len(o.sequences[0].token_ids) for o in collector.outputs) == 3
    finally:
        engine.shutdown()
    assert not engine.is_alive


def test_a_failed_build_is_raised_by_start_and_leaves_no_thread():
    def make_engine():
        raise FileNotFoundError("no model here")
    engine = AsyncEngine(make_engine)
    with pytest.raises(FileNotFoundError, match="no model here"):
        engine.start()
    assert not [t.name for t in threading.enumerate() if t.name.startswith("tritonlm-")]


def _token_counts(outputs, index=0):
    return [len(o.sequences[index].token_ids) for o in outputs]


def test_stream_interval_sends_the_first_token_then_every_interval_and_the_end(async_engine,
                                                                                smollm2_llm):
    params = dict(temperature=0, max_tokens=11, ignore_eos=True)
    collector = submit(async_engine, "s", "Hello", stream_interval=4, **params)
    assert collector.done.wait(120)
    assert _token_counts(collector.outputs) == [1, 4, 4, 2]  # vLLM's stream_interval
    offline = smollm2_llm.generate(["Hello"], SamplingParams(**params))[0]
    assert [t for o in collector.outputs for t in o.sequences[0].token_ids] == offline.token_ids
    assert "".join(o.sequences[0].text for o in collector.outputs) == offline.text


def test_the_engine_stream_interval_is_a_floor_for_the_request(async_engine, monkeypatch):
    monkeypatch.setattr(async_engine.engine.config, "stream_interval", 3)
    params = dict(temperature=0, max_tokens=8, ignore_eos=True)
    lower = submit(async_engine, "lower", "Hello", stream_interval=2, **params)
    higher = submit(async_engine, "higher", "Hello", stream_interval=5, **params)
    assert lower.done.wait(120) and higher.done.wait(120)
    assert _token_counts(lower.outputs) == [1, 3, 3, 1]
    assert _token_counts(higher.outputs) == [1, 5, 2]


def test_stream_interval_with_several_sequences_delivers_each_whole(async_engine, smollm2_llm):
    params = dict(temperature=1.0, seed=11, n=2, max_tokens=9, ignore_eos=True)
    collector = submit(async_engine, "n", "Once upon a time", stream_interval=4, **params)
    assert collector.done.wait(120)
    offline, = smollm2_llm.generate(["Once upon a time"], SamplingParams(**params))
    for index in range(2):
        tokens = [t for o in collector.outputs for t in o.sequences[index].token_ids]
        assert tokens == offline.choices[index].token_ids
    # the second sequence forks a step later; both flush together: 5 outputs instead of 10
    assert len(collector.outputs) <= 5 and collector.outputs[-1].finished


def test_a_request_that_does_not_stream_gets_one_output_with_everything(async_engine):
    params = SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=9, logprobs=2,
                            ignore_eos=True, stop=[" be"])
    outputs = {}
    for stream in (True, False):
        collector = Collector()
        request = async_engine.engine.make_request(f"stream-{stream}", "The weather today", params)
        request.stream = stream
        async_engine.submit(request, collector)
        assert collector.done.wait(120)
        outputs[stream] = collector.outputs
    (whole,) = outputs[False]
    assert whole.finished and len(outputs[True]) > 1
    # this seed's sequences: one ends on the stop string, the other runs to max_tokens
    assert sorted(s.finish_reason for s in whole.sequences) == ["length", "stop"]
    for index in range(2):
        pieces = [o.sequences[index] for o in outputs[True]]
        assert whole.sequences[index].token_ids == [t for p in pieces for t in p.token_ids]
        assert whole.sequences[index].text == "".join(p.text for p in pieces)
        assert whole.sequences[index].logprobs == [e for p in pieces for e in p.logprobs or []]
        assert whole.sequences[index].finish_reason == pieces[-1].finish_reason


def test_offline_generate_gets_one_engine_output_per_request(smollm2_llm, monkeypatch):
    outputs = []
    step = smollm2_llm.engine.step

    def recorded_step():
        outputs.extend(step_outputs := step())
        return step_outputs
    monkeypatch.setattr(smollm2_llm.engine, "step", recorded_step)
    results = smollm2_llm.generate(["Hello", "Good morning"],
                                   SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert len(outputs) == 2 and all(o.finished for o in outputs)
    assert [len(r.token_ids) for r in results] == [6, 6]
