"""Property-based fuzzing of the request path, in process (the served path: test_fuzz_served.py).

Each generated request goes the way a Triton request goes (parse_request, make_request, the
engine, the response builder) next to a greedy request with known transformers tokens. Every case
ends in one InvalidRequestError or in a request the engine finishes; the good request keeps its
tokens, and the KV cache gets every block back."""
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from family_check import random_prompts, reference_greedy, tiny_llama
from fuzz_strategies import json_texts, messages_json, sampling_dicts, triton_inputs
from tritonlm import LLM
from tritonlm.errors import InvalidRequestError
from tritonlm.sampling_params import SamplingParams
from tritonlm.triton.request_parser import parse_request
from tritonlm.triton.response_builder import ResponseBuilder

GOOD_TOKENS = 12
# Keeps every accepted request short, however many tokens it asks for.
MAX_MODEL_LEN = 48


@pytest.fixture(scope="module")
def model(tmp_path_factory, smollm2_tokenizer):
    hf, model_dir = tiny_llama(tmp_path_factory.mktemp("fuzz"), smollm2_tokenizer)
    llm = LLM(str(model_dir), block_size=8, max_model_len=MAX_MODEL_LEN, num_kv_blocks=64)
    prompt = random_prompts(1, hf.config.vocab_size, max_len=12, seed=5)[0]
    return llm.engine, prompt, reference_greedy(hf, prompt, GOOD_TOKENS)


def run_with_good_request(engine, make_fuzzed, good_prompt, good_tokens) -> None:
    """Builds the fuzzed request (None: it was refused), runs it beside the good one to the end,
    turning each of its outputs into response arrays."""
    good = engine.make_request("good", good_prompt, SamplingParams(
        temperature=0, max_tokens=GOOD_TOKENS, ignore_eos=True))
    engine.add(good)
    try:
        _run(engine, make_fuzzed(), good_tokens)
    finally:  # a failed case leaves nothing behind for the next one
        engine.abort("good")
        engine.abort("fuzzed")


def _run(engine, fuzzed, good_tokens) -> None:
    finished, generated = set(), []
    if fuzzed is not None:
        request, builder = fuzzed
        engine.add(request)
    while engine.has_unfinished:
        for out in engine.step():
            if out.request_id == "good":
                generated += out.sequences[0].token_ids
            else:
                assert out.error is None, out.error
                arrays = builder.on_output(out)
                assert len(arrays["text_output"]) == len(out.sequences)
            if out.finished:
                finished.add(out.request_id)
    assert generated == good_tokens
    assert finished == {"good"} | ({"fuzzed"} if fuzzed is not None else set())
    blocks = engine.scheduler.block_manager
    assert blocks.num_free_blocks == blocks.num_blocks


def build(engine, inputs: dict, parameters: str | None):
    try:
        parsed = parse_request(inputs.get, parameters, engine.sampling_defaults)
        request = engine.make_request("fuzzed", parsed.prompt, parsed.params, parsed.messages,
                                      parsed.add_generation_prompt, parsed.chat_template_kwargs)
    except InvalidRequestError as exc:
        assert str(exc)
        return None
    request.stream = parsed.stream
    return request, ResponseBuilder(parsed, request.prompt_text or "")


@given(data=st.data())
def test_any_triton_inputs_get_one_clear_error_or_complete(model, data):
    engine, good_prompt, good_tokens = model
    vocab = engine.request_builder.vocab_size
    inputs = data.draw(triton_inputs(vocab, contract_only=False))
    parameters = data.draw(st.none() | json_texts)
    run_with_good_request(engine, lambda: build(engine, inputs, parameters), good_prompt,
                          good_tokens)


@given(sampling=sampling_dicts, prompt=st.text(min_size=1, max_size=40))
def test_any_sampling_parameters_get_one_clear_error_or_complete(model, sampling, prompt):
    engine, good_prompt, good_tokens = model
    inputs = {"text_input": [prompt.encode("utf-8", "surrogatepass")],
              "sampling_parameters": [json.dumps(sampling).encode()]}
    run_with_good_request(engine, lambda: build(engine, inputs, None), good_prompt, good_tokens)


@given(messages=messages_json(), template_kwargs=st.none() | json_texts)
def test_any_messages_get_one_clear_error_or_complete(model, messages, template_kwargs):
    engine, good_prompt, good_tokens = model
    inputs = {"messages": [messages.encode("utf-8", "surrogatepass")],
              "sampling_parameters": [b'{"max_tokens": 4}']}
    if template_kwargs is not None:
        inputs["chat_template_kwargs"] = [template_kwargs.encode("utf-8", "surrogatepass")]
    run_with_good_request(engine, lambda: build(engine, inputs, None), good_prompt, good_tokens)
