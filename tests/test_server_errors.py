"""Bad input and cancellation against the real tritonserver: errors stay with their request."""
import json
import queue
import re
import threading
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from conftest import SERVED_KV_BLOCKS, SERVED_MAX_MODEL_LEN
from test_server import grpc_inputs, grpc_stream, http_post

BAD_SAMPLING = [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"max_tokens": "ten"}, "max_tokens"),
    ({"no_such_key": 1}, "no_such_key"),
    ({"min_p": 1.5}, "min_p"),
    ({"typical_p": 0}, "typical_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"logprobs": 50}, "logprobs"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"stop": "x", "bad_words": [""]}, "bad_words"),
    ({"n": 0}, "n must"),
    ({"n": 2, "best_of": 1}, "best_of"),
    ({"n": 2, "temperature": 0}, "temperature"),
    ({"stream_interval": 0}, "stream_interval"),
    ({"guided_regex": "(unclosed"}, "regex constraint does not compile"),
    ({"guided_json": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}},
     "json constraint does not compile"),
    ({"guided_choice": []}, "guided_choice"),
]


def bad_http_requests():
    yield {"text_input": ""}, "empty"
    yield {"text_input": "hello " * (SERVED_MAX_MODEL_LEN + 10)}, "max_model_len"
    yield {"text_input": "hi", "sampling_parameters": "{not json"}, "sampling_parameters"
    yield {"text_input": "hi", "sampling_parameters": "[1, 2]"}, "sampling_parameters"
    for sampling, field in BAD_SAMPLING:
        yield {"text_input": "hi", "sampling_parameters": json.dumps(sampling)}, field
    yield {"text_input": "hi", "max_tokens": 0}, "max_tokens"  # as a tensor
    yield {"text_input": "hi", "top_p": 2.0}, "top_p"
    yield {"text_input": "hi", "bogus_parameter": 1}, "bogus_parameter"  # request parameter
    yield {"text_input": "hi", "beam_width": 4}, "beam_width"  # a TensorRT-LLM tensor
    yield {"text_input": "hi", "random_seed": 1, "seed": 2}, "random_seed"


def test_every_bad_input_gets_an_error_while_a_good_request_completes(smollm2_server):
    sampling = {"temperature": 0, "max_tokens": 48, "ignore_eos": True}
    good: dict = {}
    worker = threading.Thread(target=lambda: good.update(result=grpc_stream(
        smollm2_server.grpc_url, "Tell me a long story about a dragon.", sampling)))
    worker.start()
    for body, field in bad_http_requests():
        status, text = http_post(smollm2_server.http_url, "/v2/models/llm/generate", body)
        assert status == 400, (body, text)
        assert field in json.loads(text)["error"], (body, text)
    results, error = grpc_stream(smollm2_server.grpc_url, b"caf\xe9 \xff\xfe", {"max_tokens": 4})
    assert results == [] and "UTF-8" in str(error)
    results, error = grpc_stream(smollm2_server.grpc_url, [5, 10**9], {"max_tokens": 4})
    assert results == [] and "input_ids" in str(error)
    worker.join(timeout=300)
    results, error = good["result"]
    assert error is None
    assert sum(len(r.as_numpy("token_ids")) for r in results) == 48
    assert results[-1].as_numpy("finish_reason").tolist() == [b"length"]


def finished_line(server, request_id: str, timeout: float = 60) -> dict:
    pattern = re.compile(rf"request {re.escape(request_id)}-\w+ finished: (.*)")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        match = pattern.search(server.logs())
        if match:
            return dict(item.split("=") for item in match.group(1).split())
        time.sleep(0.2)
    raise AssertionError(f"no finish line for {request_id} in the server log")


def test_cancelling_a_stream_stops_the_request_and_frees_its_blocks(smollm2_server):
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(smollm2_server.grpc_url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    sampling = {"temperature": 0, "max_tokens": 400, "ignore_eos": True}
    client.async_stream_infer("llm", grpc_inputs("Count to one thousand:", sampling, True,
                                                 return_token_ids=True),
                              request_id="cancel-me")
    for _ in range(3):
        result, error = responses.get(timeout=120)
        assert error is None
    client.stop_stream(cancel_requests=True)
    line = finished_line(smollm2_server, "cancel-me")
    assert line["reason"] == "abort"
    assert int(line["output_tokens"]) < 100
    assert line["free_blocks"] == f"{SERVED_KV_BLOCKS}/{SERVED_KV_BLOCKS}"
    results, error = grpc_stream(smollm2_server.grpc_url, "After cancel:", {"max_tokens": 4,
                                                                          "ignore_eos": True})
    assert error is None and sum(len(r.as_numpy("token_ids")) for r in results) == 4
