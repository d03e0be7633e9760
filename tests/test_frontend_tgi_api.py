"""TGI's API of the HTTP front end: validation (422 naming the field, as TGI's router words it),
errors inside a stream, /info and /tokenize, against the real tritonserver and front end."""
import httpx
import pytest
from huggingface_hub import InferenceClient
from huggingface_hub.errors import ValidationError as HubValidationError
from text_generation import Client as TGIClient
from text_generation.errors import ValidationError as TGIValidationError

from conftest import SERVED_MAX_MODEL_LEN
from test_frontend_tgi import PROMPT, TIMEOUT, sse_events
from tritonlm_client import Client

LONG_PROMPT = "hello " * (SERVED_MAX_MODEL_LEN + 10)


@pytest.fixture(scope="module")
def http(smollm2_server):
    with httpx.Client(base_url=smollm2_server.frontend_url, timeout=TIMEOUT) as client:
        yield client


def params(**values) -> dict:
    return {"inputs": PROMPT, "parameters": {"max_new_tokens": 2, **values}}


# (request body, words the message must hold: the field's name first)
BAD_BODIES = [
    (b"{not json", ["JSON"]),
    (b"[1, 2]", ["JSON object"]),
    ({"parameters": {}}, ["inputs"]),
    ({"inputs": 5}, ["inputs", "string"]),
    ({"inputs": ""}, ["`inputs`", "empty"]),
    (LONG_PROMPT, ["`inputs`", f"less than {SERVED_MAX_MODEL_LEN} tokens"]),
    ({"inputs": PROMPT, "parameters": "fast"}, ["parameters"]),
    (params(temperature="hot"), ["parameters.temperature"]),
    (params(temperature=0), ["`temperature`", "strictly positive"]),
    (params(top_p=1.0), ["`top_p`"]),
    (params(top_p=0), ["`top_p`"]),
    (params(typical_p=1.5), ["`typical_p`"]),
    (params(top_k=0), ["`top_k`"]),
    (params(repetition_penalty=0), ["`repetition_penalty`"]),
    (params(frequency_penalty=2.5), ["`frequency_penalty`"]),
    (params(max_new_tokens=0), ["`max_new_tokens`"]),
    (params(max_new_tokens=2.5), ["parameters.max_new_tokens"]),
    (params(max_new_tokens=SERVED_MAX_MODEL_LEN), ["`max_new_tokens`", "<= 512"]),
    (params(stop=[str(i) for i in range(17)]), ["`stop`", "up to 16"]),
    (params(stop="a"), ["parameters.stop"]),
    (params(seed=-1), ["`seed`"]),
    (params(best_of=2), ["`best_of`", "sampling"]),
    (params(best_of=2, do_sample=True, seed=3), ["`seed`", "best_of"]),
    (params(best_of=17, do_sample=True), ["`best_of`", "<= 16"]),
    (params(top_n_tokens=21), ["`top_n_tokens`", "<= 20"]),
    (params(truncate=0), ["`truncate`"]),
    (params(truncate=SERVED_MAX_MODEL_LEN), ["`truncate`"]),
    (params(do_sample="yes"), ["parameters.do_sample"]),
    (params(grammar={"type": "xml", "value": "<a/>"}), ["`grammar.type`", "json"]),
    (params(grammar="[a-z]+"), ["`grammar`", "type"]),
    (params(adapter_id="my-lora"), ["unknown LoRA adapter 'my-lora'", "serves: none"]),
]


def _post(http, path: str, body) -> httpx.Response:
    if isinstance(body, bytes):
        return http.post(path, content=body, headers={"Content-Type": "application/json"})
    if isinstance(body, str):
        body = {"inputs": body}
    return http.post(path, json=body)


@pytest.mark.parametrize("body,words", BAD_BODIES, ids=[str(i) for i in range(len(BAD_BODIES))])
def test_bad_input_is_422_naming_the_field(http, body, words):
    for path in ("/generate", "/"):
        response = _post(http, path, body)
        assert response.status_code == 422, response.text
        error = response.json()
        assert error["error_type"] == "validation"
        assert all(word in error["error"] for word in words), error


def test_stream_only_rules_and_a_long_prompt_in_a_stream(http):
    for extra, field in (({"best_of": 2, "do_sample": True}, "`best_of`"),
                         ({"decoder_input_details": True}, "`decoder_input_details`")):
        response = http.post("/generate_stream", json=params(**extra))
        assert response.status_code == 422 and field in response.json()["error"]
        assert http.post("/generate", json=params(**extra)).status_code == 200
    response = http.post("/", json={"inputs": LONG_PROMPT, "stream": True})
    assert response.status_code == 422 and response.json()["error_type"] == "validation"


def test_clients_raise_validation_errors_and_the_server_keeps_serving(smollm2_server, http):
    tgi = TGIClient(smollm2_server.frontend_url, timeout=TIMEOUT)
    with pytest.raises(TGIValidationError, match="max_new_tokens"):
        tgi.generate(PROMPT, max_new_tokens=SERVED_MAX_MODEL_LEN)
    with pytest.raises(TGIValidationError, match="inputs"):
        list(tgi.generate_stream(LONG_PROMPT, max_new_tokens=2))
    hf = InferenceClient(base_url=smollm2_server.frontend_url, timeout=TIMEOUT)
    with pytest.raises(HubValidationError, match="unknown LoRA adapter 'my-lora'"):
        hf.text_generation(PROMPT, max_new_tokens=2, adapter_id="my-lora")
    with pytest.raises(HubValidationError, match="inputs"):
        list(hf.text_generation(LONG_PROMPT, max_new_tokens=2, stream=True))

    expected = Client(smollm2_server.grpc_url).generate(PROMPT, max_tokens=4, temperature=0)
    assert http.post("/generate", json=params(max_new_tokens=4)).json() == {
        "generated_text": expected.text}
    events = sse_events(http.post("/generate_stream", json=params(max_new_tokens=4)).text)
    assert events[-1]["generated_text"] == expected.text


def test_unknown_fields_and_nulls_are_ignored(http):
    body = {"inputs": PROMPT, "model": "whatever", "parameters": {
        "max_new_tokens": 2, "temperature": None, "top_k": None, "stop": None, "seed": None,
        "do_sample": None, "details": None, "grammar": None, "new_field": 1}}
    response = http.post("/generate", json=body)
    assert response.status_code == 200 and "details" not in response.json()


def test_info(http, smollm2_server):
    info = http.get("/info").json()
    assert info["model_id"] == "llm" and info["router"] == "tritonlm" and info["version"]
    assert info["model_dtype"] == "float32" and info["model_device_type"] == "cpu"
    assert info["max_total_tokens"] == SERVED_MAX_MODEL_LEN
    assert info["max_input_tokens"] == SERVED_MAX_MODEL_LEN - 1
    # the engine's defaults (engine.json; TGI's launcher defaults are 2, 4 and 5: test_limits.py)
    assert (info["max_best_of"], info["max_stop_sequences"], info["max_top_n_tokens"]) == (
        16, 16, 20)
    assert info["speculate"] == 0
    assert info["max_concurrent_requests"] > 0 and info["max_client_batch_size"] >= 1
    assert isinstance(info["sampling_defaults"], dict)


def test_tokenize_matches_transformers(http, smollm2_tokenizer):
    text = "Hello world, ça va? 🙂 1234"
    tokens = http.post("/tokenize", json={"inputs": text}).json()
    encoding = smollm2_tokenizer(text, return_offsets_mapping=True)
    assert [t["id"] for t in tokens] == encoding["input_ids"]
    assert [(t["start"], t["stop"]) for t in tokens] == encoding["offset_mapping"]
    assert all(t["text"] == text[t["start"]:t["stop"]] for t in tokens)
    truncated = http.post("/tokenize", json={"inputs": text, "parameters": {"truncate": 3}})
    assert [t["id"] for t in truncated.json()] == encoding["input_ids"][-3:]
    assert http.post("/tokenize", json={"text": text}).status_code == 422


def _entry(token_id: int, text: str, special: bool = False) -> dict:
    return {"token_id": token_id, "token": text, "logprob": -0.5, "special": special,
            "top_logprobs": []}


def test_an_error_mid_stream_is_an_error_event_and_tokens_share_out_the_text():
    """No server: what the stream makes of the gateway's chunks (a character split over byte
    tokens, an engine failure after the first token)."""
    import asyncio

    from tritonlm_frontend.errors import APIError
    from tritonlm_frontend.tgi_api import _stream_events
    from tritonlm_frontend.tgi_protocol import GenerateBody
    from tritonlm_frontend.triton_gateway import GenerateChunk, SequenceDelta

    split = SequenceDelta(0, " é", [1, 2, 3], [_entry(1, " "), _entry(2, "\ufffd"),
                                                _entry(3, "\ufffd")], None, None, None)

    async def chunks():
        yield 0, GenerateChunk([split], 4, None, False)
        raise APIError(500, "the engine stopped")

    async def events():
        body = GenerateBody.model_validate(params(details=True))
        return [e async for e in _stream_events(chunks(), body, None)]
    got = sse_events("".join(asyncio.run(events())))
    assert [e["token"]["text"] for e in got[:3]] == [" ", "", "é"]
    assert got[3] == {"error": "the engine stopped", "error_type": "generation"}
