"""LoRA adapters through the real tritonserver and the front end, each API with its own spelling:
`lora_name` in sampling_parameters (Triton vllm_backend), the adapter's name as the OpenAI model
(listed by /v1/models with its base as parent), TGI's `adapter_id`; greedy tokens equal the peft
library's merged model, and an unknown name fails that request alone."""
import threading
import time
import urllib.request

import openai
import pytest
from huggingface_hub import InferenceClient
from huggingface_hub.errors import ValidationError as HubValidationError

from lora_check import FAMILIES, NEW_TOKENS, build
from test_server import grpc_stream
from triton_server import start_server

pytestmark = pytest.mark.server
TEXT = "Summarise: the cat sat on the mat."
GREEDY = {"temperature": 0, "max_tokens": NEW_TOKENS, "ignore_eos": True}


@pytest.fixture(scope="module")
def served(tmp_path_factory, smollm2_tokenizer):
    tmp = tmp_path_factory.mktemp("lora_served")
    prompts = [smollm2_tokenizer.encode(TEXT)]
    model_dir, _, references = build(tmp, smollm2_tokenizer, "llama", prompts)
    with start_server(model_dir.parent) as server:
        yield server, prompts[0], {name: refs[0] for name, refs in references.items()}


def test_grpc_lora_name_per_request(served):
    server, prompt, references = served
    for name, expected in references.items():
        sampling = GREEDY if name is None else {**GREEDY, "lora_name": name}
        results, error = grpc_stream(server.grpc_url, prompt, sampling)
        assert error is None, error
        assert [int(t) for r in results for t in r.as_numpy("token_ids")] == expected, name
    results, error = grpc_stream(server.grpc_url, prompt, {**GREEDY, "lora_name": "nope"})
    assert "unknown LoRA adapter 'nope'; this model serves: all, some" in str(error)
    results, error = grpc_stream(server.grpc_url, prompt, {**GREEDY, "lora_name": "some"})
    assert error is None  # still serving


def test_openai_model_names_an_adapter(served, smollm2_tokenizer):
    server, _, references = served
    client = openai.OpenAI(base_url=f"{server.frontend_url}/v1", api_key="-")
    listed = {m.id: m.model_extra.get("parent") for m in client.models.list().data}
    assert listed == {"llm": None, "all": "llm", "some": "llm"}
    for name in ("all", "some", "llm"):
        reply = client.completions.create(model=name, prompt=TEXT, max_tokens=NEW_TOKENS,
                                          temperature=0, extra_body={"ignore_eos": True})
        expected = references[None if name == "llm" else name]
        assert reply.model == name
        assert reply.choices[0].text == smollm2_tokenizer.decode(expected,
                                                                 skip_special_tokens=True)
    with pytest.raises(openai.NotFoundError, match="nope.*served: llm, all, some"):
        client.completions.create(model="nope", prompt=TEXT, max_tokens=2)


def test_tgi_adapter_id(served, smollm2_tokenizer):
    server, _, references = served
    client = InferenceClient(base_url=server.frontend_url, timeout=120)
    for name in ("all", "some", None):
        text = client.text_generation(TEXT, max_new_tokens=NEW_TOKENS, adapter_id=name,
                                      return_full_text=False)
        assert text == smollm2_tokenizer.decode(references[name], skip_special_tokens=True)
    with pytest.raises(HubValidationError, match="unknown LoRA adapter 'nope'"):
        client.text_generation(TEXT, max_new_tokens=2, adapter_id="nope")


def test_metrics_name_the_running_adapters(served):
    server, prompt, _ = served
    worker = threading.Thread(target=grpc_stream, args=(
        server.grpc_url, prompt, {**GREEDY, "max_tokens": 400, "lora_name": "some"}))
    worker.start()
    try:
        deadline = time.monotonic() + 30
        while 'running_lora_adapters="some"' not in _lora_series(server):
            assert time.monotonic() < deadline, _lora_series(server)
            time.sleep(0.1)
        assert 'max_lora="4"' in _lora_series(server)
    finally:
        worker.join(120)
    deadline = time.monotonic() + 10
    while 'running_lora_adapters=""' not in _lora_series(server):
        assert time.monotonic() < deadline, _lora_series(server)
        time.sleep(0.1)


def _lora_series(server) -> str:
    text = urllib.request.urlopen(f"http://{server.metrics_url}/metrics").read().decode()
    return "\n".join(line for line in text.splitlines()
                     if line.startswith("tritonlm:lora_requests_info{"))
