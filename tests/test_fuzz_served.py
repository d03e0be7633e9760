"""Property-based fuzzing against the real tritonserver and the front end: raw gRPC tensors of
any type and shape under the contract's names (and request parameters), and any body on every
POST route of the front end. Each request gets one error (HTTP: a 4xx JSON error, never a 5xx) or
completes; a greedy request beside each keeps transformers' tokens; the model stays ready. A tiny
model with a 48-token context keeps every accepted request short."""
import json
import queue
import threading

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from hypothesis import given
from hypothesis import strategies as st
from tritonclient.utils import np_to_triton_dtype

from conftest import linked_repository
from family_check import random_prompts, reference_greedy, tiny_llama
from fuzz_strategies import frontend_requests, triton_inputs
from test_server import grpc_stream
from triton_server import start_server

GOOD_TOKENS = 12
# Request parameters tritonclient itself reserves (it refuses them before sending).
CLIENT_RESERVED = {"sequence_id", "sequence_start", "sequence_end", "priority",
                   "binary_data_output", "timeout", "headers"}


@pytest.fixture(scope="module")
def served(tmp_path_factory, smollm2_tokenizer):
    directory = tmp_path_factory.mktemp("fuzz-served")
    hf, model_dir = tiny_llama(directory / "model", smollm2_tokenizer)
    repo = linked_repository(model_dir, directory / "served", block_size=8, num_kv_blocks=64,
                             max_model_len=48)
    prompt = random_prompts(1, hf.config.vocab_size, max_len=12, seed=5)[0]
    with start_server(repo) as server:
        yield server, prompt, reference_greedy(hf, prompt, GOOD_TOKENS)


class GoodRequest:
    """A greedy request on its own thread, started beside a fuzzed one."""

    def __init__(self, server, prompt):
        self.result: dict = {}
        self.thread = threading.Thread(target=lambda: self.result.update(out=grpc_stream(
            server.grpc_url, prompt, {"temperature": 0, "max_tokens": GOOD_TOKENS,
                                      "ignore_eos": True})))
        self.thread.start()

    def tokens(self) -> list[int]:
        self.thread.join(timeout=120)
        results, error = self.result["out"]
        assert error is None, error
        return [t for r in results for t in r.as_numpy("token_ids").tolist()]


def grpc_raw(url: str, inputs: dict[str, np.ndarray], parameters: dict):
    """(responses, error) of one streamed request made of these tensors; raises on a hang."""
    client = grpcclient.InferenceServerClient(url)
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    tensors = []
    for name, array in inputs.items():
        tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    try:
        client.async_stream_infer("llm", tensors, parameters=parameters or None,
                                  enable_empty_final_response=True)
        count = 0
        while True:
            result, error = responses.get(timeout=120)
            if error is not None:
                return count, error
            count += 1
            final = result.get_response().parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                return count, None
    finally:
        client.stop_stream()
        client.close()


# gRPC carries parameters as protobuf strings: valid UTF-8 only (the client refuses the rest).
request_parameters = st.dictionaries(
    st.one_of(st.sampled_from(["max_tokens", "temperature", "seed", "stop", "logprobs", "n"]),
              st.text(max_size=12)).filter(lambda k: k and k not in CLIENT_RESERVED),
    st.one_of(st.booleans(), st.integers(-2**63, 2**63 - 1), st.text(max_size=12)), max_size=3)


@given(data=st.data())
def test_any_grpc_tensors_get_one_error_or_complete(served, data):
    server, good_prompt, good_tokens = served
    inputs = data.draw(triton_inputs(49152, contract_only=False))
    parameters = data.draw(request_parameters)
    good = GoodRequest(server, good_prompt)
    grpc_raw(server.grpc_url, inputs, parameters)
    assert good.tokens() == good_tokens


def check_http_response(response: httpx.Response, stream: bool) -> None:
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        assert "error" in response.json(), response.text
    elif stream:
        events = [line[len("data:"):].strip() for line in response.text.splitlines()
                  if line.startswith("data:")]
        assert events, response.text
        for event in events:
            assert event == "[DONE]" or isinstance(json.loads(event), (dict, list)), event


@given(request=frontend_requests("llm"))
def test_any_frontend_body_gets_one_error_or_completes(served, request):
    server, good_prompt, good_tokens = served
    route, body = request
    good = GoodRequest(server, good_prompt)
    response = httpx.post(f"{server.frontend_url}{route}", content=body, timeout=120,
                          headers={"Content-Type": "application/json"})
    stream = "text/event-stream" in response.headers.get("content-type", "")
    check_http_response(response, stream)
    assert good.tokens() == good_tokens
