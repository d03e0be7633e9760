"""Other families through the real tritonserver: FLAN-T5 (encoder-decoder) and BLOOM (ALiBi),
served side by side from one repository, text in and text out, greedy-exact against transformers."""
import json

import pytest
from transformers import BloomConfig, BloomForCausalLM, T5ForConditionalGeneration

from family_check import random_prompts, reference_greedy, save_tiny
from test_family_t5 import tiny_t5_config
from test_server import grpc_stream, http_post
from triton_server import start_server

NEW_TOKENS = 16
GREEDY = {"temperature": 0, "max_tokens": NEW_TOKENS, "ignore_eos": True}


@pytest.fixture(scope="module")
def family_server(tmp_path_factory, smollm2_tokenizer):
    from tritonlm_convert.convert import convert
    tmp = tmp_path_factory.mktemp("families")
    vocab = len(smollm2_tokenizer)
    configs = {
        "flan_t5": (T5ForConditionalGeneration, tiny_t5_config(smollm2_tokenizer)),
        "bloom": (BloomForCausalLM, BloomConfig(vocab_size=vocab, hidden_size=64, n_layer=2,
                                                n_head=4, initializer_range=0.1)),
    }
    references = {}
    for name, (model_class, config) in configs.items():
        references[name] = save_tiny(tmp / name, model_class, config, smollm2_tokenizer)
        convert(str(tmp / name), tmp / "repo", name=name, dtype="float32")
    with start_server(tmp / "repo") as server:
        yield server, references


@pytest.mark.parametrize("model", ["flan_t5", "bloom"])
def test_grpc_stream_of_ids_matches_transformers(family_server, model):
    server, references = family_server
    prompt = random_prompts(1, references[model].config.vocab_size, seed=3)[0]
    results, error = grpc_stream(server.grpc_url, prompt, GREEDY, model=model)
    assert error is None, error
    tokens = [int(t) for r in results for t in r.as_numpy("token_ids")]
    assert tokens == reference_greedy(references[model], prompt, NEW_TOKENS)
    assert all(int(r.as_numpy("num_input_tokens")[0]) == len(prompt) for r in results)


@pytest.mark.parametrize("model", ["flan_t5", "bloom"])
def test_http_text_in_text_out(family_server, smollm2_tokenizer, model):
    server, references = family_server
    text = "Translate to German: the house is small."
    status, body = http_post(server.http_url, f"/v2/models/{model}/generate",
                             {"text_input": text, "sampling_parameters": json.dumps(GREEDY),
                              "return_token_ids": True})
    assert status == 200, body
    reply = json.loads(body)
    expected = reference_greedy(references[model], smollm2_tokenizer.encode(text), NEW_TOKENS)
    assert reply["token_ids"] == expected
    assert reply["text_output"] == smollm2_tokenizer.decode(expected, skip_special_tokens=True)


def test_bad_request_to_one_family_leaves_both_serving(family_server):
    server, references = family_server
    _, error = grpc_stream(server.grpc_url, [10 ** 9], GREEDY, model="flan_t5")
    assert error is not None and "outside the vocabulary" in str(error)
    for model in ("flan_t5", "bloom"):
        results, error = grpc_stream(server.grpc_url, [5, 6, 7], {**GREEDY, "max_tokens": 2},
                                     model=model)
        assert error is None and sum(len(r.as_numpy("token_ids")) for r in results) == 2
