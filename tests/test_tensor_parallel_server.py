"""Tensor-parallel models in the real tritonserver: two tp=2 models side by side (each with its
own rendezvous), and a rank killed mid-generation: the in-flight request errors, the model reports
not ready, the other keeps serving, and stopping the server leaves no worker behind."""
import time
import urllib.error
import urllib.request

import psutil
import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from family_check import random_prompts, reference_greedy, save_tiny
from test_server import grpc_stream
from triton_server import start_server

GREEDY = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
MODELS = ("llm_a", "llm_b")


@pytest.fixture(scope="module")
def tp_server(tmp_path_factory, smollm2_tokenizer):
    from tritonlm_convert.convert import convert
    tmp = tmp_path_factory.mktemp("tp")
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1,
                         vocab_size=len(smollm2_tokenizer), max_position_embeddings=4096)
    hf = save_tiny(tmp / "hf", LlamaForCausalLM, config, smollm2_tokenizer)
    for name in MODELS:
        convert(str(tmp / "hf"), tmp / "repo", name=name, dtype="float32", tp=2)
    with start_server(tmp / "repo") as server:
        yield server, hf


def _workers(server, model: str) -> list[psutil.Process]:
    procs = psutil.Process(server.process.pid).children(recursive=True)
    return [p for p in procs if "tritonlm.distributed.worker" in " ".join(p.cmdline())
            and f"/{model}/" in " ".join(p.cmdline())]


def _ready(server, model: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{server.http_url}/v2/models/{model}/ready", timeout=5):
            return True
    except urllib.error.HTTPError:
        return False


def test_two_tp2_models_serve_side_by_side(tp_server):
    server, hf = tp_server
    prompt = random_prompts(1, hf.config.vocab_size, seed=1)[0]
    expected = reference_greedy(hf, prompt, GREEDY["max_tokens"])
    for model in MODELS:
        assert len(_workers(server, model)) == 1  # rank 1 of each; rank 0 is the Triton stub
        results, error = grpc_stream(server.grpc_url, prompt, GREEDY, model=model)
        assert error is None, error
        assert [int(t) for r in results for t in r.as_numpy("token_ids")] == expected


def test_killed_rank_fails_in_flight_request_and_model_stops(tp_server):
    server, hf = tp_server
    victim, = _workers(server, "llm_a")
    long_run = {**GREEDY, "max_tokens": 3000}
    prompt = random_prompts(1, hf.config.vocab_size, seed=2)[0]

    import threading
    outcome = {}
    thread = threading.Thread(target=lambda: outcome.update(
        zip(("results", "error"), grpc_stream(server.grpc_url, prompt, long_run, model="llm_a"))))
    thread.start()
    time.sleep(2)  # generating by now
    victim.kill()
    thread.join(timeout=120)
    assert not thread.is_alive(), "the in-flight request hung"
    assert outcome["error"] is not None and "rank" in str(outcome["error"])
    assert len(outcome["results"]) < long_run["max_tokens"]
    deadline = time.monotonic() + 60
    while _ready(server, "llm_a") and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _ready(server, "llm_a")
    assert _ready(server, "llm_b")
    results, error = grpc_stream(server.grpc_url, prompt, GREEDY, model="llm_b")
    assert error is None and len(results) == GREEDY["max_tokens"]


def test_stopping_the_server_leaves_no_worker(tmp_path, tp_server):
    server, _ = tp_server
    workers = _workers(server, "llm_b")
    assert workers
    server.process.terminate()
    server.process.wait(60)
    gone, alive = psutil.wait_procs(workers, timeout=30)
    assert not alive
