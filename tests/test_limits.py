"""Request limits (TGI's names): concurrency refused at once, token limits with their numbers,
a queue timeout; in the engine, and through the real tritonserver and front end."""
import threading
import time
import urllib.error
import urllib.request

import httpx
import openai
import pytest

from conftest import linked_repository
from family_check import tiny_llama
from test_async_engine import Collector
from test_server import grpc_stream, text_of
from tritonlm import LLM, SamplingParams
from tritonlm.config import EngineConfig
from tritonlm.engine.async_engine import AsyncEngine
from tritonlm.errors import InvalidRequestError, OverloadedError
from triton_server import start_server

LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_repo(tmp_path_factory, smollm2_tokenizer):
    return tiny_llama(tmp_path_factory.mktemp("limits"), smollm2_tokenizer)[1]


def started(llm: LLM) -> AsyncEngine:
    engine = AsyncEngine(llm.engine)
    engine.start()
    return engine


def submit(engine: AsyncEngine, request_id: str, prompt, params: SamplingParams) -> Collector:
    collector = Collector()
    engine.submit(engine.engine.make_request(request_id, prompt, params), collector)
    return collector


@pytest.mark.parametrize("settings, message", [
    ({"max_concurrent_requests": 0}, "max_concurrent_requests"),
    ({"max_total_tokens": 4096}, "max_total_tokens"),
    ({"max_total_tokens": 64, "max_input_tokens": 64}, "max_input_tokens"),
    ({"queue_timeout": 0}, "queue_timeout"),
    ({"max_best_of": 0}, "max_best_of"),
    ({"max_best_of": 17}, "max_best_of"),
    ({"max_top_n_tokens": 21}, "max_top_n_tokens"),
    ({"max_stop_sequences": -1}, "max_stop_sequences"),
])
def test_limits_out_of_range_are_refused_at_load(settings, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(max_model_len=2048, **settings)


def test_token_limits_refuse_with_their_numbers(tiny_repo):
    llm = LLM(str(tiny_repo), max_input_tokens=8, max_total_tokens=16)
    engine = llm.engine
    with pytest.raises(InvalidRequestError, match=r"prompt has 9 tokens, more than max_input_tokens \(8"):
        engine.make_request("a", list(range(10, 19)), SamplingParams(max_tokens=1))
    with pytest.raises(InvalidRequestError,
                       match=r"max_total_tokens \(16\): given 8 prompt tokens and 9 max_tokens"):
        engine.make_request("b", list(range(10, 18)), SamplingParams(max_tokens=9))
    full = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert len(llm.generate([list(range(10, 18))], full)[0].token_ids) == 8
    unset = SamplingParams(temperature=0, ignore_eos=True)  # max_tokens: what the limit leaves
    assert len(llm.generate([list(range(10, 15))], unset)[0].token_ids) == 11


@pytest.mark.parametrize("params, message", [
    (SamplingParams(n=3, temperature=1), r"n must be <= max_best_of \(2\), got 3"),
    (SamplingParams(n=1, best_of=3, temperature=1), r"best_of must be <= max_best_of \(2\)"),
    (SamplingParams(stop=["a", "b", "c", "d", "e"]),
     r"stop sequences must be <= max_stop_sequences \(4\), got 5"),
    (SamplingParams(logprobs=6), r"logprobs must be <= max_top_n_tokens \(5\), got 6"),
    (SamplingParams(prompt_logprobs=6), r"prompt_logprobs must be <= max_top_n_tokens \(5\)"),
])
def test_per_request_limits_refuse_with_their_numbers(tiny_repo, params, message):
    llm = LLM(str(tiny_repo), max_best_of=2, max_stop_sequences=4, max_top_n_tokens=5)
    with pytest.raises(InvalidRequestError, match=message):
        llm.engine.make_request("over", [10, 11], params)
    within = SamplingParams(n=2, temperature=1, max_tokens=2, stop=["a", "b", "c", "d"],
                            logprobs=5, prompt_logprobs=5)
    assert len(llm.generate([[10, 11]], within)[0].choices) == 2


def test_requests_over_max_concurrent_are_refused_then_admitted_again(tiny_repo):
    engine = started(LLM(str(tiny_repo), max_concurrent_requests=2))
    try:
        running = [submit(engine, f"r{i}", [5, 6, 7], LONG) for i in range(2)]
        with pytest.raises(OverloadedError, match="overloaded: 2 requests are in flight"):
            submit(engine, "refused", [5, 6, 7], LONG)
        for collector in running:
            assert collector.done.wait(60)
            assert collector.outputs[-1].error is None
            assert collector.outputs[-1].sequences[0].num_output_tokens == 400
        again = [submit(engine, f"again{i}", [5, 6], SamplingParams(max_tokens=4)) for i in range(2)]
        assert all(c.done.wait(60) and c.outputs[-1].error is None for c in again)
    finally:
        engine.shutdown()


def test_a_request_not_scheduled_within_queue_timeout_fails_and_the_others_run_on(tiny_repo):
    engine = started(LLM(str(tiny_repo), max_num_seqs=1, queue_timeout=0.2))
    try:
        first = submit(engine, "first", [5, 6, 7], LONG)
        queued = submit(engine, "queued", [8, 9], LONG)
        assert queued.done.wait(60)
        assert first.done.wait(60) and first.outputs[-1].error is None
        assert first.outputs[-1].sequences[0].num_output_tokens == 400
        assert queued.outputs[-1].finished
        assert "waited 0.2 s (queue_timeout)" in queued.outputs[-1].error
        assert "overloaded" in queued.outputs[-1].error
        # an idle engine schedules at once: no timeout however long the request then runs
        alone = submit(engine, "alone", [8, 9], LONG)
        assert alone.done.wait(60) and alone.outputs[-1].error is None
        assert engine.engine.block_manager.num_free_blocks == engine.engine.block_manager.num_blocks
    finally:
        engine.shutdown()


@pytest.mark.server
def test_served_over_max_concurrent_requests_gets_unavailable_and_429(smollm2_repo, tmp_path):
    repo = linked_repository(smollm2_repo, tmp_path / "repo", num_kv_blocks=64,
                             max_concurrent_requests=1, max_total_tokens=512,
                             max_best_of=2, max_stop_sequences=4, max_top_n_tokens=5)
    long = {"temperature": 0, "max_tokens": 400, "ignore_eos": True}
    with start_server(repo) as server:
        first: dict = {}
        worker = threading.Thread(target=lambda: first.update(result=grpc_stream(
            server.grpc_url, "Tell me a story.", long)))
        worker.start()
        time.sleep(3)  # the first request is generating its 400 tokens (~20 ms each here)
        results, error = grpc_stream(server.grpc_url, "Hi", {"max_tokens": 4})
        assert results == [] and "overloaded" in str(error)
        request = urllib.request.Request(
            f"http://{server.http_url}/v2/models/llm/generate",
            data=b'{"text_input": "Hi", "max_tokens": 4}', headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request)
        # tritonserver 2.51 answers every error of a decoupled model's generate with 400 and
        # carries no status in a gRPC stream's error: the message says overloaded, which the
        # front end turns into 429
        assert b"overloaded" in refused.value.read()
        tgi = httpx.post(f"{server.frontend_url}/generate",
                         json={"inputs": "Hi", "parameters": {"max_new_tokens": 4}})
        assert tgi.status_code == 429 and tgi.json()["error_type"] == "overloaded"
        client = openai.OpenAI(base_url=f"{server.frontend_url}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model="llm", prompt="Hi", max_tokens=4)
        info = httpx.get(f"{server.frontend_url}/info").json()
        assert (info["max_concurrent_requests"], info["max_total_tokens"],
                info["max_input_tokens"]) == (1, 512, 511)
        worker.join(120)
        results, error = first["result"]
        assert error is None and results
        assert (info["max_best_of"], info["max_stop_sequences"], info["max_top_n_tokens"]) == (
            2, 4, 5)
        results, error = grpc_stream(server.grpc_url, "Hi", {"n": 3, "temperature": 1})
        assert results == [] and "n must be <= max_best_of (2)" in str(error)
        tgi = httpx.post(f"{server.frontend_url}/generate", json={"inputs": "Hi", "parameters": {
            "max_new_tokens": 4, "best_of": 3, "do_sample": True}})
        assert tgi.status_code == 422 and "`best_of` must be > 0 and <= 2" in tgi.json()["error"]
        chat = httpx.post(f"{server.frontend_url}/v1/completions", json={
            "model": "llm", "prompt": "Hi", "max_tokens": 2, "logprobs": 6})
        assert chat.status_code == 400 and "max_top_n_tokens (5)" in chat.json()["error"]["message"]
        results, error = grpc_stream(server.grpc_url, "Hi", {"max_tokens": 4}, stream=False)
        assert error is None and text_of(results[-1])  # admitted again once the first ended
