"""TGI's API of the HTTP front end (generation), against the real tritonserver and front end, with
`huggingface_hub.InferenceClient`, the `text-generation` client, curl and raw HTTP as clients.
Validation, /info and /tokenize are in test_frontend_tgi_api.py."""
import json
import subprocess

import httpx
import pytest
import torch
from huggingface_hub import InferenceClient
from text_generation import Client as TGIClient


PROMPT = "The capital of France is"
CHAT_PROMPT = ("<|im_start|>user\nSay only the word yes.<|im_end|>\n"
               "<|im_start|>assistant\n")
TIMEOUT = 300  # the shared test host can be slow


@pytest.fixture(scope="module")
def http(smollm2_server):
    with httpx.Client(base_url=smollm2_server.frontend_url, timeout=TIMEOUT) as client:
        yield client


@pytest.fixture(scope="module")
def hf(smollm2_server):
    return InferenceClient(base_url=smollm2_server.frontend_url, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def tgi(smollm2_server):
    return TGIClient(smollm2_server.frontend_url, timeout=TIMEOUT)


def sse_events(text: str) -> list[dict]:
    return [json.loads(line[len("data:"):]) for line in text.splitlines()
            if line.startswith("data:")]


def test_greedy_generate_equals_grpc_with_details(http, grpc, hf, tgi):
    expected = grpc.generate(PROMPT, max_tokens=10, temperature=0)
    body = http.post("/generate", json={"inputs": PROMPT, "parameters": {
        "max_new_tokens": 10, "details": True}}).json()
    assert body["generated_text"] == expected.text
    details = body["details"]
    assert details["finish_reason"] == "length" and details["generated_tokens"] == 10
    assert details["seed"] is None and details["prefill"] == []  # greedy; no prompt details
    assert [t["id"] for t in details["tokens"]] == expected.token_ids
    assert "".join(t["text"] for t in details["tokens"]) == expected.text
    assert all(t["logprob"] <= 0 and t["special"] is False for t in details["tokens"])
    assert "top_tokens" not in details and "best_of_sequences" not in details

    without = http.post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 10}})
    assert without.json() == {"generated_text": expected.text}

    out = hf.text_generation(PROMPT, details=True, max_new_tokens=10, return_full_text=False)
    assert out.generated_text == expected.text and out.details.finish_reason == "length"
    assert [t.id for t in out.details.tokens] == expected.token_ids
    # POST / returns the full text unless told otherwise (TGI's compat route does)
    assert hf.text_generation(PROMPT, max_new_tokens=10) == PROMPT + expected.text
    response = tgi.generate(PROMPT, max_new_tokens=10)
    assert response.generated_text == expected.text
    assert [t.id for t in response.details.tokens] == expected.token_ids


def test_finish_reasons_eos_and_stop_sequence(http, grpc):
    expected = grpc.generate(CHAT_PROMPT, max_tokens=30, temperature=0)
    details = http.post("/generate", json={"inputs": CHAT_PROMPT, "parameters": {
        "max_new_tokens": 30, "details": True}}).json()["details"]
    assert details["finish_reason"] == "eos_token"
    eos = details["tokens"][-1]
    assert eos["special"] is True and eos["text"] == "<|im_end|>"
    assert [t["id"] for t in details["tokens"]] == expected.token_ids

    whole = grpc.generate(PROMPT, max_tokens=10, temperature=0).text  # " Paris.\n\nThe answer..."
    stop = whole.split()[2]
    body = http.post("/generate", json={"inputs": PROMPT, "parameters": {
        "max_new_tokens": 10, "stop": [stop, "never"], "details": True}}).json()
    # TGI keeps the stop sequence in the text
    assert body["generated_text"] == whole[:whole.index(stop) + len(stop)]
    assert body["details"]["finish_reason"] == "stop_sequence"
    assert body["details"]["generated_tokens"] < 10


def test_stream_events_add_up_to_the_generated_text(http, grpc, hf, tgi):
    expected = grpc.generate(PROMPT, max_tokens=8, temperature=0)
    response = http.post("/generate_stream", json={"inputs": PROMPT, "parameters": {
        "max_new_tokens": 8, "details": True}})
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text)
    assert [e["index"] for e in events] == list(range(1, 9))
    assert [e["token"]["id"] for e in events] == expected.token_ids
    assert "".join(e["token"]["text"] for e in events) == expected.text
    assert all(e["generated_text"] is None and e["details"] is None for e in events[:-1])
    assert events[-1]["generated_text"] == expected.text
    assert events[-1]["details"] == {"finish_reason": "length", "generated_tokens": 8,
                                     "seed": None, "input_length": 5}
    assert "[DONE]" not in response.text

    streamed = list(hf.text_generation(PROMPT, max_new_tokens=8, stream=True, details=True,
                                       return_full_text=False))
    assert "".join(e.token.text for e in streamed) == streamed[-1].generated_text == expected.text
    assert streamed[-1].details.finish_reason == "length"
    chat = list(tgi.generate_stream(CHAT_PROMPT, max_new_tokens=30))
    text = "".join(e.token.text for e in chat if not e.token.special)
    assert chat[-1].token.special and chat[-1].details.finish_reason == "eos_token"
    assert text == chat[-1].generated_text == grpc.generate(CHAT_PROMPT, max_tokens=30,
                                                            temperature=0).text


def test_compat_route_with_curl(smollm2_server, grpc):
    expected = grpc.generate(PROMPT, max_tokens=6, temperature=0).text
    url = smollm2_server.frontend_url + "/"

    def curl(body: dict) -> str:
        return subprocess.run(["curl", "-sN", url, "-H", "Content-Type: application/json",
                               "-d", json.dumps(body)], capture_output=True, text=True,
                              check=True, timeout=TIMEOUT).stdout

    whole = json.loads(curl({"inputs": PROMPT, "parameters": {"max_new_tokens": 6}}))
    assert whole == [{"generated_text": PROMPT + expected}]  # a list; the full text by default
    events = sse_events(curl({"inputs": PROMPT, "stream": True, "parameters": {
        "max_new_tokens": 6, "return_full_text": False}}))
    assert len(events) == 6 and events[-1]["generated_text"] == expected
    assert events[-1]["details"] is None  # details were not asked for


def test_decoder_input_details_match_transformers(http, smollm2_hf, smollm2_tokenizer):
    details = http.post("/generate", json={"inputs": PROMPT, "parameters": {
        "max_new_tokens": 1, "decoder_input_details": True}}).json()["details"]
    prefill = details["prefill"]
    ids = smollm2_tokenizer(PROMPT)["input_ids"]
    assert [t["id"] for t in prefill] == ids
    assert "".join(t["text"] for t in prefill) == PROMPT
    assert prefill[0]["logprob"] is None
    with torch.inference_mode():
        logits = smollm2_hf(torch.tensor([ids])).logits[0].float()
    reference = torch.log_softmax(logits[:-1], dim=-1)[torch.arange(len(ids) - 1), ids[1:]]
    torch.testing.assert_close(torch.tensor([t["logprob"] for t in prefill[1:]]), reference,
                               atol=2e-3, rtol=1e-3)


def test_top_n_tokens(http, tgi):
    details = http.post("/generate", json={"inputs": PROMPT, "parameters": {
        "max_new_tokens": 4, "details": True, "top_n_tokens": 3}}).json()["details"]
    assert len(details["top_tokens"]) == 4
    for chosen, top in zip(details["tokens"], details["top_tokens"]):
        assert len(top) == 3
        assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
        assert top[0]["id"] == chosen["id"]  # greedy picks the most likely
    events = list(tgi.generate_stream(PROMPT, max_new_tokens=2, top_n_tokens=2))
    assert all(len(e.top_tokens) == 2 for e in events)


def test_sampling_reports_its_seed_and_best_of(http):
    params = {"max_new_tokens": 6, "do_sample": True, "temperature": 1.5, "details": True}
    first = http.post("/generate", json={"inputs": PROMPT, "parameters": params}).json()
    seed = first["details"]["seed"]
    assert isinstance(seed, int)
    again = http.post("/generate", json={"inputs": PROMPT, "parameters": {**params,
                                                                         "seed": seed}}).json()
    assert again["generated_text"] == first["generated_text"]

    body = http.post("/generate", json={"inputs": PROMPT, "parameters": {
        "max_new_tokens": 6, "best_of": 2, "temperature": 1.5, "details": True,
        "return_full_text": True}}).json()
    others = body["details"]["best_of_sequences"]
    assert len(others) == 1 and others[0]["generated_text"].startswith(PROMPT)
    assert body["generated_text"].startswith(PROMPT)
    assert sum(t["logprob"] for t in body["details"]["tokens"]) >= \
        sum(t["logprob"] for t in others[0]["tokens"]) - 1e-3
    assert others[0]["generated_tokens"] == len(others[0]["tokens"])


def test_truncate_keeps_the_last_tokens(http, smollm2_tokenizer):
    prompt = "One two three four five six seven eight nine ten"
    ids = smollm2_tokenizer(prompt)["input_ids"]
    events = sse_events(http.post("/generate_stream", json={"inputs": prompt, "parameters": {
        "max_new_tokens": 1, "truncate": 4, "details": True}}).text)
    assert events[-1]["details"]["input_length"] == 4
    details = http.post("/generate", json={"inputs": prompt, "parameters": {
        "max_new_tokens": 1, "truncate": 4, "decoder_input_details": True}}).json()["details"]
    assert [t["id"] for t in details["prefill"]] == ids[-4:]
