"""End to end against the real tritonserver started by tritonlm-serve, through tritonclient."""
import json
import queue
import threading
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from conftest import hf_greedy

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def grpc_inputs(prompt, sampling: dict, stream: bool, **flags):
    arrays = {"sampling_parameters": np.array([json.dumps(sampling).encode()], dtype=np.object_),
              "stream": np.array([stream])}
    if isinstance(prompt, (str, bytes)):
        text = prompt.encode() if isinstance(prompt, str) else prompt
        arrays["text_input"] = np.array([text], dtype=np.object_)
    else:
        arrays["input_ids"] = np.array(prompt, dtype=np.int64)
    for name, value in flags.items():
        arrays[name] = np.array([value])
    inputs = []
    for name, array in arrays.items():
        dtype = {np.object_: "BYTES", np.int64: "INT64", np.bool_: "BOOL"}[array.dtype.type]
        tensor = grpcclient.InferInput(name, list(array.shape), dtype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def grpc_stream(url, prompt, sampling, stream=True, model="llm", **flags):
    """All responses of one request over tritonclient's gRPC stream: (results, error)."""
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    flags = {"return_token_ids": True, "return_finish_reason": True,
             "return_num_input_tokens": True, "return_num_output_tokens": True, **flags}
    client.async_stream_infer(model, grpc_inputs(prompt, sampling, stream, **flags),
                              enable_empty_final_response=True)
    results = []
    while True:
        result, error = responses.get(timeout=120)
        if error is not None:
            client.stop_stream()
            return results, error
        final = result.get_response().parameters.get("triton_final_response")
        if result.as_numpy("text_output") is not None:
            results.append(result)
        if final is not None and final.bool_param:
            client.stop_stream()
            return results, None


def text_of(result) -> str:
    return b"".join(result.as_numpy("text_output")).decode()


def http_post(url, path, body: dict):
    request = urllib.request.Request(f"http://{url}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_grpc_streaming_matches_transformers_greedy(smollm2_server, smollm2_hf, smollm2_tokenizer):
    prompt = smollm2_tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True,
                                                   return_dict=False)
    sampling = {"temperature": 0, "max_tokens": 24, "ignore_eos": True}
    results, error = grpc_stream(smollm2_server.grpc_url, prompt, sampling)
    assert error is None
    assert len(results) == 24  # one response per generated token
    tokens = [int(t) for r in results for t in r.as_numpy("token_ids")]
    assert tokens == hf_greedy(smollm2_hf, prompt, 24)
    assert "".join(text_of(r) for r in results) == smollm2_tokenizer.decode(
        tokens, skip_special_tokens=True)
    assert [r.as_numpy("finish_reason").tolist() for r in results[-2:]] == [[], [b"length"]]
    assert all(int(r.as_numpy("num_input_tokens")[0]) == len(prompt) for r in results)


def test_chat_question_gets_a_sensible_answer_over_grpc(smollm2_server, smollm2_tokenizer):
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(smollm2_server.grpc_url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    inputs = []
    for name, array, dtype in (
            ("messages", np.array([json.dumps(QUESTION).encode()], dtype=np.object_), "BYTES"),
            ("stream", np.array([False]), "BOOL"),
            ("return_num_input_tokens", np.array([True]), "BOOL"),
            ("sampling_parameters", np.array([b'{"temperature": 0, "max_tokens": 40}'],
                                             dtype=np.object_), "BYTES")):
        tensor = grpcclient.InferInput(name, list(array.shape), dtype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    client.async_stream_infer("llm", inputs)
    result, error = responses.get(timeout=120)
    client.stop_stream()
    assert error is None
    assert "Paris" in text_of(result)
    rendered = smollm2_tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True,
                                                     return_dict=False)
    assert int(result.as_numpy("num_input_tokens")[0]) == len(rendered)


def test_non_streaming_sends_exactly_one_response(smollm2_server):
    sampling = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
    results, error = grpc_stream(smollm2_server.grpc_url, "Once upon a time", sampling,
                                 stream=False)
    assert error is None and len(results) == 1
    assert results[0].get_response().parameters["triton_final_response"].bool_param
    assert len(results[0].as_numpy("token_ids")) == 12
    assert results[0].as_numpy("num_output_tokens").tolist() == [12]
    streamed, _ = grpc_stream(smollm2_server.grpc_url, "Once upon a time", sampling)
    assert "".join(text_of(r) for r in streamed) == text_of(results[0])


def test_http_generate_and_generate_stream(smollm2_server):
    body = {"text_input": "The capital of Japan is", "max_tokens": 10, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "return_finish_reason": True}
    status, text = http_post(smollm2_server.http_url, "/v2/models/llm/generate", body)
    assert status == 200, text
    whole = json.loads(text)
    assert whole["finish_reason"] == "length" and len(whole["token_ids"]) == 10
    status, text = http_post(smollm2_server.http_url, "/v2/models/llm/generate_stream",
                             {**body, "stream": True})
    assert status == 200, text
    events = [json.loads(line[len("data: "):]) for line in text.splitlines()
              if line.startswith("data: ")]
    assert len(events) == 10
    assert "".join(e["text_output"] for e in events) == whole["text_output"]
    assert [e["token_ids"] for e in events] == whole["token_ids"]


def test_stream_interval_groups_tokens_per_response_over_grpc_and_sse(smollm2_server):
    sampling = {"temperature": 0, "max_tokens": 10, "ignore_eos": True}
    whole, _ = grpc_stream(smollm2_server.grpc_url, "Once upon a time", sampling, stream=False)
    grouped, error = grpc_stream(smollm2_server.grpc_url, "Once upon a time",
                                 {**sampling, "stream_interval": 4})
    assert error is None
    assert [len(r.as_numpy("token_ids")) for r in grouped] == [1, 4, 4, 1]
    assert [r.as_numpy("num_output_tokens").tolist() for r in grouped] == [[1], [4], [4], [1]]
    assert "".join(text_of(r) for r in grouped) == text_of(whole[0])
    body = {"text_input": "Once upon a time", "stream": True, "return_token_ids": True,
            "stream_interval": 4, **sampling}  # a request parameter this time
    status, text = http_post(smollm2_server.http_url, "/v2/models/llm/generate_stream", body)
    assert status == 200, text
    events = [json.loads(line[len("data: "):]) for line in text.splitlines()
              if line.startswith("data: ")]
    # the generate endpoint sends a one-element output as a scalar
    assert [np.size(e["token_ids"]) for e in events] == [1, 4, 4, 1]
    assert "".join(e["text_output"] for e in events) == text_of(whole[0])


def test_exclude_input_in_output_false_echoes_the_prompt(smollm2_server):
    prompt = "Roses are red,"
    results, error = grpc_stream(smollm2_server.grpc_url, prompt,
                                 {"temperature": 0, "max_tokens": 5}, stream=False,
                                 exclude_input_in_output=False)
    assert error is None and text_of(results[0]).startswith(prompt)
    assert len(text_of(results[0])) > len(prompt)


def test_logprobs_and_cumulative_logprob_outputs(smollm2_server):
    sampling = {"temperature": 0, "max_tokens": 6, "ignore_eos": True, "logprobs": 3}
    results, error = grpc_stream(smollm2_server.grpc_url, "The sun is", sampling, stream=False,
                                 return_logprobs=True, return_cumulative_logprob=True)
    assert error is None
    entries = [json.loads(e) for e in results[0].as_numpy("logprobs")]
    assert [e["token_id"] for e in entries] == results[0].as_numpy("token_ids").tolist()
    assert all(len(e["top_logprobs"]) == 3 and e["top_logprobs"][0]["token_id"] == e["token_id"]
               for e in entries)  # greedy picks the most likely token
    assert float(results[0].as_numpy("cumulative_logprob")[0]) == pytest.approx(
        sum(e["logprob"] for e in entries), abs=1e-4)


def test_streamed_stop_string_and_trtllm_names(smollm2_server):
    sampling = {"temperature": 0, "max_tokens": 30, "ignore_eos": True}
    full, _ = grpc_stream(smollm2_server.grpc_url, "One, two, three, four,", sampling, stream=False)
    text = text_of(full[0])
    stop = text[8:14]
    streamed, error = grpc_stream(smollm2_server.grpc_url, "One, two, three, four,",
                                  {**sampling, "stop_words": [stop]})
    assert error is None
    assert "".join(text_of(r) for r in streamed) == text[:text.index(stop)]
    assert streamed[-1].as_numpy("finish_reason").tolist() == [b"stop"]
    body = {"text_input": "One, two, three, four,", "temperature": 0, "ignore_eos": True,
            "max_tokens": 30, "min_length": 30, "end_id": full[0].as_numpy("token_ids")[3].item(),
            "return_token_ids": True}
    status, reply = http_post(smollm2_server.http_url, "/v2/models/llm/generate", body)
    assert status == 200, reply
    assert len(json.loads(reply)["token_ids"]) == 30  # end_id is banned until min_length


def test_n_sequences_in_one_response_and_streamed_by_index(smollm2_server):
    sampling = {"temperature": 1.2, "seed": 7, "max_tokens": 8, "n": 2, "ignore_eos": True}
    whole, error = grpc_stream(smollm2_server.grpc_url, "My favourite animal is", sampling,
                               stream=False)
    assert error is None and len(whole) == 1
    texts = [t.decode() for t in whole[0].as_numpy("text_output")]
    assert len(texts) == 2 and texts[0] != texts[1]
    assert whole[0].as_numpy("num_output_tokens").tolist() == [8, 8]
    assert len(whole[0].as_numpy("token_ids")) == 16
    assert whole[0].as_numpy("finish_reason").tolist() == [b"length", b"length"]
    streamed, error = grpc_stream(smollm2_server.grpc_url, "My favourite animal is", sampling)
    assert error is None
    assert ["".join(r.as_numpy("text_output")[i].decode() for r in streamed) for i in (0, 1)] \
        == texts


@pytest.mark.parametrize("add", [True, False])
def test_messages_with_and_without_the_generation_prompt(smollm2_server, smollm2_tokenizer, add):
    body = {"messages": json.dumps(QUESTION), "add_generation_prompt": add, "max_tokens": 1,
            "return_num_input_tokens": True}
    status, text = http_post(smollm2_server.http_url, "/v2/models/llm/generate", body)
    assert status == 200, text
    rendered = smollm2_tokenizer.apply_chat_template(QUESTION, add_generation_prompt=add,
                                                     return_dict=False)
    assert json.loads(text)["num_input_tokens"] == len(rendered)


def test_streamed_chinese_and_emoji_never_break_utf8(smollm2_server):
    prompt = "请用中文回答：今天天气怎么样？😀🎉"
    sampling = {"temperature": 0, "max_tokens": 24, "ignore_eos": True}
    streamed, error = grpc_stream(smollm2_server.grpc_url, prompt, sampling)
    assert error is None
    chunks = [text_of(r) for r in streamed]  # each chunk decodes as UTF-8 on its own
    assert all("\ufffd" not in c for c in chunks)
    whole, _ = grpc_stream(smollm2_server.grpc_url, prompt, sampling, stream=False)
    assert "".join(chunks) == text_of(whole[0])
    assert any(ord(ch) > 0x2E80 for ch in "".join(chunks))  # the model did emit CJK or emoji
