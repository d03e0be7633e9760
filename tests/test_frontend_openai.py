"""The OpenAI API of the HTTP front end, against the real tritonserver and front end, with the
`openai` SDK (sync and async), curl and raw HTTP as the clients."""
import asyncio
import json
import subprocess
import threading

import httpx
import openai
import pytest
import torch

from conftest import SERVED_KV_BLOCKS, SERVED_MAX_MODEL_LEN
from test_server_errors import finished_line

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0, "max_tokens": 24}


@pytest.fixture(scope="module")
def sdk(smollm2_server):
    return openai.OpenAI(base_url=f"{smollm2_server.frontend_url}/v1", api_key="none")


def test_chat_and_completions_greedy_equal_grpc(sdk, grpc, smollm2_tokenizer):
    chat = sdk.chat.completions.create(model="llm", messages=QUESTION, **GREEDY)
    expected = grpc.chat(QUESTION, **GREEDY)
    assert chat.choices[0].message.content == expected.text
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].finish_reason in ("stop", "length")
    assert chat.usage.prompt_tokens == expected.num_input_tokens
    assert chat.usage.completion_tokens == expected.num_output_tokens
    assert chat.object == "chat.completion" and chat.system_fingerprint

    prompt = "The three primary colors are"
    completion = sdk.completions.create(model="llm", prompt=prompt, max_tokens=12, temperature=0,
                                        extra_body={"ignore_eos": True})
    assert completion.choices[0].text == grpc.generate(prompt, max_tokens=12, temperature=0).text
    assert completion.usage.prompt_tokens == len(smollm2_tokenizer.encode(prompt))
    assert completion.usage.completion_tokens == 12
    assert completion.choices[0].finish_reason == "length"


def test_streamed_chat_joins_to_the_whole_answer_with_role_first_and_usage_last(sdk):
    whole = sdk.chat.completions.create(model="llm", messages=QUESTION, **GREEDY)
    chunks = list(sdk.chat.completions.create(model="llm", messages=QUESTION, stream=True,
                                              stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == [whole.choices[0].finish_reason]
    assert all(c.usage is None for c in chunks[:-1])


def test_async_client_serves_concurrent_requests_each_as_over_grpc(smollm2_server, grpc):
    prompts = ["Once upon a time", "The best way to learn is", "Water boils at", "In 1492,"]

    async def run():
        client = openai.AsyncOpenAI(base_url=f"{smollm2_server.frontend_url}/v1", api_key="x")
        results = await asyncio.gather(*(client.completions.create(
            model="llm", prompt=p, max_tokens=16, temperature=0) for p in prompts))
        streamed = [c async for c in await client.completions.create(
            model="llm", prompt=prompts[0], max_tokens=16, temperature=0, stream=True)]
        await client.close()
        return results, streamed

    results, streamed = asyncio.run(run())
    for prompt, result in zip(prompts, results):
        assert result.choices[0].text == grpc.generate(prompt, max_tokens=16, temperature=0).text
    assert "".join(c.choices[0].text for c in streamed) == results[0].choices[0].text


def test_n_sequences_seeded_and_several_prompts(sdk):
    def ask():
        return sdk.chat.completions.create(model="llm", messages=QUESTION, n=2, temperature=1.0,
                                           seed=7, max_tokens=8, extra_body={"ignore_eos": True})
    chat, again = ask(), ask()
    assert [c.index for c in chat.choices] == [0, 1]
    assert [c.message.content for c in again.choices] == [c.message.content for c in chat.choices]
    assert chat.usage.completion_tokens == 16  # both choices
    batch = sdk.completions.create(model="llm", prompt=["Hello", "Goodbye"], n=2, max_tokens=4,
                                   temperature=0.8, seed=1, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in batch.choices) == [0, 1, 2, 3]
    assert batch.usage.completion_tokens == 16


def test_logprobs_are_the_models_own(sdk, smollm2_hf, smollm2_tokenizer):
    prompt = "The capital of Germany is"
    completion = sdk.completions.create(model="llm", prompt=prompt, max_tokens=6, temperature=0,
                                        logprobs=3, echo=True)
    logprobs = completion.choices[0].logprobs
    ids = smollm2_tokenizer.encode(prompt)
    assert completion.choices[0].text.startswith(prompt)
    assert len(logprobs.tokens) == len(ids) + 6 and logprobs.token_logprobs[0] is None
    generated = smollm2_tokenizer.encode(completion.choices[0].text[len(prompt):],
                                         add_special_tokens=False)
    with torch.inference_mode():
        logits = smollm2_hf(torch.tensor([ids + generated])).logits[0, :-1]
    reference = torch.log_softmax(logits.float(), -1)
    every = ids + generated
    expected = [reference[i, every[i + 1]].item() for i in range(len(every) - 1)]
    ours = logprobs.token_logprobs[1:len(every)]
    assert ours == pytest.approx(expected, abs=2e-3)
    assert all(len(top) == 3 for top in logprobs.top_logprobs[1:])

    chat = sdk.chat.completions.create(model="llm", messages=QUESTION, logprobs=True,
                                       top_logprobs=2, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob == t.logprob
               for t in content)  # greedy: the chosen token is the most likely one
    tokens = "".join(t.token for t in content)  # the EOS token, if it ended the answer, too
    assert tokens in (chat.choices[0].message.content, chat.choices[0].message.content + "<|im_end|>")


def test_stop_strings_end_the_text_without_leaking(sdk, grpc):
    prompt = "List: apples, pears, plums, cherries, grapes, lemons"
    completion = sdk.completions.create(model="llm", prompt=prompt, max_tokens=40, temperature=0,
                                        stop=[","])
    text = completion.choices[0].text
    assert "," not in text and completion.choices[0].finish_reason == "stop"
    assert text == grpc.generate(prompt, max_tokens=40, temperature=0, stop=[","]).text
    streamed = "".join(c.choices[0].text for c in sdk.completions.create(
        model="llm", prompt=prompt, max_tokens=40, temperature=0, stop=",", stream=True))
    assert streamed == text


def test_curl_unknown_fields_models_health_and_metrics(smollm2_server):
    body = {"model": "llm", "messages": QUESTION, "max_tokens": 4, "temperature": 0,
            "some_future_field": {"x": 1}}
    out = subprocess.run(["curl", "-sS", f"{smollm2_server.frontend_url}/v1/chat/completions",
                          "-H", "Content-Type: application/json", "-d", json.dumps(body)],
                         capture_output=True, text=True, check=True).stdout
    assert json.loads(out)["usage"]["completion_tokens"] == 4
    url = smollm2_server.frontend_url
    models = httpx.get(f"{url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["llm"]
    assert models["data"][0]["max_model_len"] > 0
    assert httpx.get(f"{url}/health").status_code == 200
    metrics = httpx.get(f"{url}/metrics").text
    assert 'tritonlm_frontend_requests_total{method="POST",route="/v1/chat/completions",status="200"}' in metrics
    assert "tritonlm:generation_tokens_total" in metrics  # the engine's, from tritonserver


BAD_REQUESTS = [
    (b"{not json", 400, "JSON"),
    (b"[1, 2]", 400, "object"),
    ({"model": "llm", "messages": QUESTION, "max_tokens": "ten"}, 400, "max_tokens"),
    ({"model": "llm", "messages": QUESTION, "temperature": -1}, 400, "temperature"),
    ({"model": "llm", "messages": QUESTION, "top_p": 7}, 400, "top_p"),
    ({"model": "llm", "messages": QUESTION, "n": 0}, 400, "n"),
    ({"model": "llm", "messages": QUESTION, "logit_bias": {"10": 500}}, 400, "logit_bias"),
    ({"model": "llm", "messages": QUESTION, "top_logprobs": 2}, 400, "top_logprobs"),
    ({"model": "llm", "messages": "hi"}, 400, "messages"),
    ({"model": "llm", "messages": []}, 400, "messages"),
    ({"model": "llm", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "image_url"),
    ({"model": "llm", "messages": QUESTION,
      "response_format": {"type": "json_schema", "json_schema": {}}}, 400, "response_format"),
    ({"model": "llm", "messages": QUESTION, "tools": [{"type": "function"}]}, 400, "tools"),
    ({"model": "nope", "messages": QUESTION}, 404, "nope"),
    ({"messages": QUESTION}, 400, "model"),
    ({"model": "llm", "messages": QUESTION, "stream": True, "temperature": -1}, 400, "temperature"),
]
BAD_COMPLETIONS = [
    ({"model": "llm", "prompt": ""}, 400, "prompt"),
    ({"model": "llm", "prompt": []}, 400, "prompt"),
    ({"model": "llm", "prompt": "hello " * (SERVED_MAX_MODEL_LEN + 10)}, 400, "max_model_len"),
    ({"model": "llm", "prompt": [5, 10**9]}, 400, "input_ids"),
    ({"model": "llm", "prompt": "hi", "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
]


def test_every_bad_request_gets_one_clear_error_while_others_stream(smollm2_server, grpc):
    url = smollm2_server.frontend_url
    long_request: dict = {}

    def stream_long():
        with httpx.stream("POST", f"{url}/v1/completions", timeout=300, json={
                "model": "llm", "prompt": "Tell me a story.", "max_tokens": 48, "stream": True,
                "temperature": 0, "ignore_eos": True}) as response:
            long_request["lines"] = [line for line in response.iter_lines() if line]

    worker = threading.Thread(target=stream_long)
    worker.start()
    cases = [("/v1/chat/completions", *c) for c in BAD_REQUESTS]
    cases += [("/v1/completions", *c) for c in BAD_COMPLETIONS]
    for path, body, status, needle in cases:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        response = httpx.post(f"{url}{path}", content=content, timeout=60)
        assert response.status_code == status, (body, response.text)
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert needle in error["message"] + str(error["param"]), (body, error)
    worker.join(timeout=300)
    events = [json.loads(line[6:]) for line in long_request["lines"] if line != "data: [DONE]"]
    assert long_request["lines"][-1] == "data: [DONE]"
    assert "".join(e["choices"][0]["text"] for e in events) == grpc.generate(
        "Tell me a story.", max_tokens=48, temperature=0, ignore_eos=True).text


def test_a_client_that_disconnects_cancels_its_request_and_frees_its_blocks(smollm2_server):
    url = smollm2_server.frontend_url
    for path, body in (("/v1/completions", {"prompt": "Count to one thousand:"}),
                       ("/v1/chat/completions", {"messages": QUESTION})):
        request_id = f"disconnect-{path.rsplit('/', 1)[1]}"
        with httpx.stream("POST", f"{url}{path}", headers={"X-Request-Id": request_id},
                          timeout=120, json={"model": "llm", "max_tokens": 400, "stream": True,
                                             "ignore_eos": True, "temperature": 0,
                                             **body}) as response:
            lines = response.iter_lines()
            for _ in range(3):
                next(line for line in lines if line)
        line = finished_line(smollm2_server, request_id)
        assert line["reason"] == "abort" and int(line["output_tokens"]) < 200
        assert line["free_blocks"] == f"{SERVED_KV_BLOCKS}/{SERVED_KV_BLOCKS}"
    # a whole (not streamed) request is cancelled too when its client goes away
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", headers={"X-Request-Id": "disconnect-whole"},
                   timeout=2, json={"model": "llm", "prompt": "Count:", "max_tokens": 400,
                                    "ignore_eos": True})
    line = finished_line(smollm2_server, "disconnect-whole")
    assert line["reason"] == "abort" and int(line["output_tokens"]) < 400


def test_huggingface_inference_client_chat_completion(smollm2_server, grpc):
    from huggingface_hub import InferenceClient
    client = InferenceClient(base_url=smollm2_server.frontend_url)
    french = [{"role": "user", "content": "Say 'a coffee with milk, please' in French."}]
    answer = client.chat_completion(french, max_tokens=32, temperature=0)
    assert answer.choices[0].message.content == grpc.chat(french, max_tokens=32, temperature=0).text
    deltas = [c.choices[0].delta.content or "" for c in client.chat_completion(
        french, max_tokens=32, temperature=0, stream=True) if c.choices]
    assert "".join(deltas) == answer.choices[0].message.content
    assert not any("\ufffd" in d for d in deltas)  # no character split across deltas
