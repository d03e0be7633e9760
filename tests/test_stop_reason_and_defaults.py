"""stop_reason, the `special` flag of logprob entries, chat_template_kwargs, and sampling defaults
from generation_config.json (and from a GGUF's general.sampling.* metadata), through the offline
engine, the Triton request parser and the response builder."""
import json
import shutil

import gguf
import numpy as np
import pytest
from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

from conftest import hf_greedy, run_convert, smollm2_gguf
from tritonlm import LLM, SamplingParams
from tritonlm.engine.generation_config import sampling_defaults
from tritonlm.errors import InvalidRequestError
from tritonlm.triton.request_parser import parse_request
from tritonlm.triton.response_builder import ResponseBuilder

QUESTION = [{"role": "user", "content": "What is 2 + 2?"}]
STORY = "Once upon a time, in a land far away, there lived a king who had three daughters. The"


def getter(**inputs):
    """Triton input tensors as the adapter's getter sees them."""
    arrays = {name: np.array([v.encode() if isinstance(v, str) else v],
                             dtype=object if isinstance(v, str) else None)
              for name, v in inputs.items()}
    return arrays.get


def test_stop_reason_names_what_stopped_a_sequence(smollm2_llm):
    engine = smollm2_llm.engine
    eos, = smollm2_llm.generate(engine.request_builder.render_chat(QUESTION),
                                [SamplingParams(temperature=0, max_tokens=64)])
    assert eos.finish_reason == "stop" and eos.stop_reason is None
    assert eos.token_ids[-1] in engine.scheduler.eos_token_ids
    greedy = dict(temperature=0, max_tokens=12, ignore_eos=True)
    free, = smollm2_llm.generate([STORY], SamplingParams(**greedy))
    assert free.finish_reason == "length" and free.stop_reason is None
    token = free.token_ids[4]
    by_token, = smollm2_llm.generate([STORY], SamplingParams(stop_token_ids=[token], **greedy))
    assert by_token.finish_reason == "stop" and by_token.stop_reason == token
    word = free.text.split()[2]
    by_text, = smollm2_llm.generate([STORY], SamplingParams(stop=["zzz", word], **greedy))
    assert by_text.finish_reason == "stop" and by_text.stop_reason == word
    assert by_text.text == free.text[:free.text.index(word)]


def run_parsed(engine, get, parameters=None, defaults=None):
    """One request through parse_request, the engine and the response builder: its responses."""
    parsed = parse_request(get, parameters, defaults)
    request = engine.make_request("rb", parsed.prompt, parsed.params, parsed.messages,
                                  parsed.add_generation_prompt, parsed.chat_template_kwargs)
    request.stream = parsed.stream
    engine.add(request)
    builder, responses = ResponseBuilder(parsed, ""), []
    while engine.has_unfinished:
        responses += [builder.on_output(out) for out in engine.step()]
    return responses


def test_response_builder_sends_stop_reasons_and_prompt_logprobs_once(smollm2_llm,
                                                                      smollm2_tokenizer):
    engine = smollm2_llm.engine
    free, = smollm2_llm.generate([STORY], SamplingParams(temperature=0, max_tokens=8))
    word, token = free.text.split()[3], free.token_ids[5]
    flags = dict(stream=True, return_stop_reason=True, return_finish_reason=True)
    responses = run_parsed(engine, getter(text_input=STORY, **flags, sampling_parameters=json.dumps(
        {"max_tokens": 8, "temperature": 0, "prompt_logprobs": 1, "stop": [word]})))
    assert len(responses) > 2
    first, *rest = responses
    prompt = smollm2_tokenizer.encode(STORY)
    entries = [json.loads(e) for e in first["prompt_logprobs"]]
    assert [e["token_id"] for e in entries] == prompt
    assert entries[0]["logprob"] is None and all(len(e["top_logprobs"]) == 1 for e in entries[1:])
    assert all(r["prompt_logprobs"].size == 0 for r in rest)
    assert all(r["stop_reason"].size == 0 for r in responses[:-1])
    assert list(responses[-1]["stop_reason"]) == [json.dumps(word).encode()]
    by_token = run_parsed(engine, getter(text_input=STORY, **flags, sampling_parameters=json.dumps(
        {"max_tokens": 8, "temperature": 0, "stop_token_ids": [token]})))
    assert list(by_token[-1]["stop_reason"]) == [str(token).encode()]
    # n = 2: a value per sequence, null where it ran out of tokens
    two = run_parsed(engine, getter(text_input=STORY, **flags, sampling_parameters=json.dumps(
        {"max_tokens": 3, "temperature": 0.7, "seed": 1, "n": 2})))
    assert list(two[-1]["stop_reason"]) == [b"null", b"null"]
    assert list(two[-1]["finish_reason"]) == [b"length", b"length"]
    # a request that did not ask gets neither output
    plain = run_parsed(engine, getter(text_input=STORY, sampling_parameters='{"max_tokens": 2}'))
    assert all("prompt_logprobs" not in r and "stop_reason" not in r for r in plain)


def test_special_flags_follow_the_tokenizer(smollm2_llm, smollm2_tokenizer):
    engine = smollm2_llm.engine
    special = set(smollm2_tokenizer.all_special_ids)
    assert special
    out, = smollm2_llm.generate([engine.request_builder.render_chat(QUESTION)], SamplingParams(
        temperature=0, max_tokens=64, logprobs=3, prompt_logprobs=3))
    entries = out.prompt_logprobs + out.logprobs
    alternatives = [a for e in entries for a in e["top_logprobs"]]
    for entry in entries + alternatives:
        assert entry["special"] == (entry["token_id"] in special), entry
    assert any(e["special"] for e in out.prompt_logprobs)  # <|im_start|> and <|im_end|>
    assert out.logprobs[-1]["special"]  # the EOS that ended it


TEMPLATE = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
            "{% if enable_thinking is defined and not enable_thinking %}/no_think\n{% endif %}")


def test_chat_template_kwargs_reach_the_template(smollm2_llm):
    builder = smollm2_llm.engine.request_builder
    saved, builder.tokenizer.chat_template = builder.tokenizer.chat_template, TEMPLATE
    try:
        parsed = parse_request(getter(messages=json.dumps(QUESTION),
                                      chat_template_kwargs='{"enable_thinking": false}'), None)
        assert parsed.chat_template_kwargs == {"enable_thinking": False}
        assert builder.render_chat(QUESTION, True, parsed.chat_template_kwargs) == \
            "user: What is 2 + 2?\n/no_think\n"
        assert builder.render_chat(QUESTION) == "user: What is 2 + 2?\n"
        with pytest.raises(InvalidRequestError, match="chat_template_kwargs may not set tokenize"):
            builder.render_chat(QUESTION, True, {"tokenize": True})
    finally:
        builder.tokenizer.chat_template = saved


@pytest.mark.parametrize("value", ["[1, 2]", "not json", '"text"'])
def test_bad_chat_template_kwargs(value):
    with pytest.raises(InvalidRequestError, match="chat_template_kwargs"):
        parse_request(getter(messages=json.dumps(QUESTION), chat_template_kwargs=value), None)


def test_invalid_generation_config_values_are_left_out():
    config = {"temperature": 0.6, "top_p": 0, "top_k": 20, "max_new_tokens": 0, "do_sample": True,
              "min_p": 0.05, "repetition_penalty": 1.1, "bos_token_id": 1}
    assert sampling_defaults(config) == {"temperature": 0.6, "top_k": 20, "min_p": 0.05,
                                         "repetition_penalty": 1.1}


@pytest.fixture(scope="module")
def greedy_by_default(smollm2_repo, tmp_path_factory):
    """SmolLM2 (weights linked) whose generation_config.json asks for greedy, 6 tokens, top_k 5."""
    directory = tmp_path_factory.mktemp("defaults") / "llm"
    source = smollm2_repo / "1"
    weights = directory / "1" / "weights"
    weights.mkdir(parents=True)
    for path in (source / "weights").iterdir():
        if path.name != "generation_config.json":
            (weights / path.name).symlink_to(path.resolve())
    config = json.loads((source / "weights" / "generation_config.json").read_text())
    config.update(temperature=0.0, top_k=5, max_new_tokens=6)
    (weights / "generation_config.json").write_text(json.dumps(config))
    for name in ("engine.json", "model.py"):
        shutil.copy(source / name, directory / "1" / name)
    return LLM(str(directory), num_kv_blocks=64)


def test_generation_config_sets_the_defaults(greedy_by_default, smollm2_hf, smollm2_tokenizer):
    engine = greedy_by_default.engine
    assert engine.sampling_defaults == {"temperature": 0.0, "top_k": 5, "max_tokens": 6}
    out, = greedy_by_default.generate([STORY])  # no SamplingParams: the model's defaults
    assert out.token_ids == hf_greedy(smollm2_hf, smollm2_tokenizer.encode(STORY), 6)
    assert out.finish_reason == "length"


def test_triton_requests_get_the_defaults_under_their_own_keys(greedy_by_default):
    defaults = greedy_by_default.engine.sampling_defaults
    unset = parse_request(getter(text_input=STORY), None, defaults).params
    assert (unset.temperature, unset.top_k, unset.max_tokens) == (0, 5, 6)
    as_tensor = parse_request(getter(text_input=STORY, temperature=np.float32(0.8)), None,
                              defaults).params
    assert (as_tensor.temperature, as_tensor.top_k) == (pytest.approx(0.8), 5)
    as_json = parse_request(getter(text_input=STORY, sampling_parameters=json.dumps(
        {"temperature": 1.2, "max_tokens": 9, "seed": 4})), None, defaults).params
    assert (as_json.temperature, as_json.max_tokens) == (1.2, 9)
    as_parameter = parse_request(getter(text_input=STORY), '{"top_k": 0}', defaults).params
    assert (as_parameter.top_k, as_parameter.temperature) == (0, 0)
    # a request leaving temperature unset answers greedily through the whole path
    responses = run_parsed(greedy_by_default.engine, getter(text_input=STORY,
                                                            return_token_ids=True), None, defaults)
    greedy, = greedy_by_default.generate([STORY], SamplingParams(temperature=0, max_tokens=6))
    assert [t for r in responses for t in r["token_ids"]] == greedy.token_ids
    sampled = run_parsed(greedy_by_default.engine, getter(
        text_input=STORY, return_token_ids=True,
        sampling_parameters='{"temperature": 1.5, "top_k": 0, "seed": 11}'), None, defaults)
    assert [t for r in sampled for t in r["token_ids"]] != greedy.token_ids


def test_gguf_sampling_metadata_becomes_generation_config(tmp_path):
    source = gguf.GGUFReader(smollm2_gguf())
    path = tmp_path / "sampling.gguf"
    writer = gguf.GGUFWriter(path, arch=source.fields[gguf.Keys.General.ARCHITECTURE].contents(),
                             endianess=source.endianess)
    f32, u32 = gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.UINT32
    keys = gguf.Keys.General
    copy_with_new_metadata(source, writer, {
        keys.SAMPLING_TEMP: MetadataDetails(f32, 0.6),
        keys.SAMPLING_TOP_K: MetadataDetails(u32, 20),
        keys.SAMPLING_TOP_P: MetadataDetails(f32, 0.95),
        keys.SAMPLING_MIN_P: MetadataDetails(f32, 0.05),
        keys.SAMPLING_PENALTY_REPEAT: MetadataDetails(f32, 1.1)}, [])
    model_dir = run_convert(path, tmp_path / "repo")
    config = json.loads((model_dir / "1" / "weights" / "generation_config.json").read_text())
    assert {k: config[k] for k in ("temperature", "top_k", "top_p", "min_p",
                                   "repetition_penalty")} == {
        "temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.05, "repetition_penalty": 1.1}
    assert sampling_defaults(config) == {"temperature": 0.6, "top_k": 20, "top_p": 0.95,
                                         "min_p": 0.05, "repetition_penalty": 1.1}
    assert "eos_token_id" in config
