"""Structured output: every spelling maps onto one constraint; the grammar masks equal
xgrammar's own application of them; SmolLM2's sampled outputs (many seeds and temperatures,
greedy too) validate against JSON schemas (the `jsonschema` package), full-match regexes, hit
choices exactly and hold an EBNF grammar; n sequences each keep their own matcher; unconstrained
rows of a batch are untouched; a constraint that does not compile fails its request alone."""
import json
import re

import jsonschema
import openai
import pytest
import torch
import xgrammar as xgr
from huggingface_hub import InferenceClient

from tritonlm import LLM, SamplingParams
from tritonlm.errors import InvalidRequestError
from tritonlm.layers.sampler import unpack_bitmask
from tritonlm.output_constraints import OutputConstraint

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,12}$"},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 20},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "scores": {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 10},
                   "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "role", "address", "scores"],
    "additionalProperties": False,
}
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
CHOICES = ["positive", "negative", "neutral", "it depends"]
# Balanced parentheses around digits: not a regular language.
NESTED = 'root ::= item ("," item)*\nitem ::= [0-9]+ | "(" root ")"'
SEEDS_AND_TEMPERATURES = [(0, 0.0), (1, 0.7), (2, 0.7), (3, 1.0), (4, 1.0), (5, 1.3)]


def balanced_digits(text: str) -> bool:
    depth = 0
    for i, ch in enumerate(text):
        depth += (ch == "(") - (ch == ")")
        if depth < 0 or (ch == "," and (i == 0 or text[i - 1] in "(,")):
            return False
    return depth == 0 and re.fullmatch(r"[0-9(),]+", text) is not None and "()" not in text


@pytest.mark.parametrize("params,expected", [
    (dict(guided_json=PERSON), OutputConstraint("json", json.dumps(PERSON))),
    (dict(guided_json=json.dumps(PERSON)), OutputConstraint("json", json.dumps(PERSON))),
    (dict(structured_outputs={"json": PERSON}), OutputConstraint("json", json.dumps(PERSON))),
    (dict(guided_regex=PHONE), OutputConstraint("regex", PHONE)),
    (dict(structured_outputs={"regex": PHONE}), OutputConstraint("regex", PHONE)),
    (dict(guided_choice=CHOICES), OutputConstraint("choice", json.dumps(CHOICES))),
    (dict(structured_outputs={"grammar": NESTED}), OutputConstraint("grammar", NESTED)),
    (dict(structured_outputs={"json_object": True}), OutputConstraint("json_object", "")),
])
def test_every_spelling_is_one_constraint(params, expected):
    assert SamplingParams.from_dict(params).constraint == expected


@pytest.mark.parametrize("params,words", [
    (dict(guided_json=PERSON, guided_regex="a"), "several"),
    (dict(structured_outputs={"regex": "a", "choice": ["a"]}), "several"),
    (dict(structured_outputs={"xml": "<a/>"}), "unknown keys"),
    (dict(guided_choice=[]), "non-empty list"),
    (dict(guided_json="{not json"), "not valid JSON"),
    (dict(guided_regex=""), "non-empty string"),
])
def test_bad_constraint_requests_are_invalid(params, words):
    with pytest.raises(InvalidRequestError, match=words):
        SamplingParams.from_dict(params)


def test_unpacked_masks_are_xgrammars():
    torch.manual_seed(0)
    vocab = 1000
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, (vocab + 31) // 32), dtype=torch.int32)
    logits = torch.randn(3, vocab)
    reference = logits.clone()
    xgr.apply_token_bitmask_inplace(reference, bitmask, vocab_size=vocab)
    ours = logits.masked_fill(~unpack_bitmask(bitmask, vocab), float("-inf"))
    assert torch.equal(ours, reference)


@pytest.fixture(scope="module")
def llm(smollm2_repo):
    return LLM(str(smollm2_repo), dtype="auto")


def chat(llm, text: str) -> str:
    return llm.engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)


def sampled(llm, prompt: str, max_tokens: int, **constraint) -> list:
    params = [SamplingParams(temperature=t, seed=s, max_tokens=max_tokens, **constraint)
              for s, t in SEEDS_AND_TEMPERATURES]
    return llm.generate([prompt] * len(params), params)


def test_json_schema_outputs_validate(llm):
    outputs = sampled(llm, chat(llm, "Give me a user record as JSON."), 160, guided_json=PERSON)
    for out in outputs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), PERSON)


def test_regex_choice_and_grammar_outputs_match(llm):
    prompt = chat(llm, "Answer briefly.")
    for out in sampled(llm, prompt, 30, guided_regex=PHONE):
        assert re.fullmatch(PHONE, out.text), out.text
    for out in sampled(llm, prompt, 30, guided_choice=CHOICES):
        assert out.text in CHOICES
    for out in sampled(llm, prompt, 40, structured_outputs={"grammar": NESTED}):
        assert out.finish_reason != "stop" or balanced_digits(out.text), out.text


def test_each_of_n_sequences_keeps_its_own_matcher(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=160, guided_json=PERSON)
    out, = llm.generate([chat(llm, "Three user records, please.")], params)
    assert len(out.choices) == 3
    for choice in out.choices:
        jsonschema.validate(json.loads(choice.text), PERSON)


def test_unconstrained_rows_are_untouched_and_cut_outputs_say_length(llm):
    prompt = chat(llm, "Tell me about the sea.")
    plain = SamplingParams(temperature=0, max_tokens=12)
    alone = llm.generate([prompt], plain)[0].token_ids
    mixed = llm.generate([prompt, prompt], [plain, SamplingParams(temperature=0, max_tokens=4,
                                                                  guided_json=PERSON)])
    assert mixed[0].token_ids == alone
    assert mixed[1].finish_reason == "length" and mixed[1].text.startswith("{")


@pytest.mark.parametrize("params,words", [
    (dict(guided_regex="(unclosed"), "regex"),
    (dict(structured_outputs={"grammar": "root ::= ("}), "grammar"),
    (dict(guided_json={"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}), "json"),
])
def test_a_constraint_that_does_not_compile_fails_its_request_alone(llm, params, words):
    with pytest.raises(InvalidRequestError, match=f"the {words} constraint does not compile"):
        llm.engine.make_request("bad", "Hi", SamplingParams(**params))
    assert re.fullmatch(PHONE, llm.generate(["Call me at"], SamplingParams(
        temperature=0, max_tokens=20, guided_regex=PHONE))[0].text)


def test_served_through_triton_tgi_and_openai(smollm2_server, grpc):
    choice = grpc.generate("Is the sky blue? Answer:", max_tokens=10, temperature=0.9, seed=1,
                           guided_choice=CHOICES)
    assert choice.text in CHOICES
    hf = InferenceClient(base_url=smollm2_server.frontend_url, timeout=300)
    person = hf.text_generation("A user record as JSON:", max_new_tokens=160, seed=2,
                                do_sample=True, grammar={"type": "json", "value": PERSON},
                                return_full_text=False)
    jsonschema.validate(json.loads(person), PERSON)
    phone = hf.text_generation("My number is", max_new_tokens=20, return_full_text=False,
                               grammar={"type": "regex", "value": PHONE})
    assert re.fullmatch(PHONE, phone)
    client = openai.OpenAI(base_url=f"{smollm2_server.frontend_url}/v1", api_key="none")
    messages = [{"role": "user", "content": "Give me a user record."}]
    reply = client.chat.completions.create(
        model="llm", messages=messages, max_tokens=160, temperature=0.8, seed=3,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)
    reply = client.chat.completions.create(model="llm", messages=messages, max_tokens=160,
                                           temperature=0, response_format={"type": "json_object"})
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    with pytest.raises(openai.BadRequestError, match="json_schema"):
        client.chat.completions.create(model="llm", messages=messages, max_tokens=8,
                                       response_format={"type": "json_schema"})


def test_preempted_constrained_sequences_keep_their_matchers(smollm2_repo):
    """A cache of 14 blocks for 6 sequences: they preempt one another (recomputed) and still
    give valid JSON."""
    llm = LLM(str(smollm2_repo), dtype="auto", num_kv_blocks=14, block_size=16, max_num_seqs=6)
    prompt = chat(llm, "A user record as JSON.")
    outputs = llm.generate([prompt] * 6, [SamplingParams(temperature=0.9, seed=s, max_tokens=160,
                                                         guided_json=PERSON) for s in range(6)])
    assert llm.engine.scheduler.num_preemptions > 0
    for out in outputs:
        jsonschema.validate(json.loads(out.text), PERSON)


def test_stop_strings_cut_constrained_output(llm):
    out, = llm.generate([chat(llm, "A user record as JSON.")], SamplingParams(
        temperature=0, max_tokens=160, guided_json=PERSON, stop=['"age"']))
    assert out.finish_reason == "stop" and out.stop_reason == '"age"'
    assert out.text.startswith('{"name": "') and '"age"' not in out.text
