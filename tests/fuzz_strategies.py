"""Hypothesis strategies for what a client controls: tensors of any type and shape under the
contract's input names, sampling_parameters JSON (known keys with extreme values, unknown keys,
deep nesting, invalid UTF-8), chat messages, token ids in and out of range."""
import json
from dataclasses import fields

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from tritonlm.sampling_params import SamplingParams
from tritonlm.triton.contract import INPUTS

SAMPLING_KEYS = sorted(f.name for f in fields(SamplingParams) if f.init)
TENSOR_TYPES = {"BOOL": np.bool_, "INT32": np.int32, "INT64": np.int64, "FP32": np.float32,
                "STRING": np.object_}
ANY_DTYPES = (np.bool_, np.int8, np.int32, np.int64, np.uint64, np.float16, np.float32,
              np.float64, np.object_)

# Every character, lone surrogates included (JSON's "\ud800" escapes decode to them).
any_text = st.text(st.characters(codec=None, categories=None), max_size=12)
extreme_ints = st.one_of(st.integers(-3, 40), st.sampled_from(
    [2**31 - 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -2**63 - 1, 10**400]),
    st.integers(-2**70, 2**70))
extreme_floats = st.one_of(st.floats(-3, 3), st.floats(allow_nan=True, allow_infinity=True))
json_scalars = st.one_of(st.none(), st.booleans(), extreme_ints, extreme_floats, any_text)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(any_text, inner, max_size=3)),
    max_leaves=8)
sampling_value = st.one_of(extreme_ints, extreme_floats, json_values,
                           st.lists(st.one_of(extreme_ints, any_text), max_size=20))
sampling_dicts = st.dictionaries(st.one_of(st.sampled_from(SAMPLING_KEYS), any_text),
                                 sampling_value, max_size=6)


def deep_json(depth: int) -> str:
    return "[" * depth + "]" * depth


json_texts = st.one_of(
    sampling_dicts.map(json.dumps),
    st.builds(deep_json, st.integers(10, 200_000)),
    json_values.map(json.dumps),
    any_text)
raw_strings = st.one_of(
    json_texts.map(lambda t: t.encode("utf-8", "surrogatepass")),
    st.binary(max_size=24))


def messages_json(vocab_text=any_text) -> st.SearchStrategy[str]:
    message = st.one_of(
        st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool"]),
                               "content": vocab_text}),
        st.dictionaries(any_text, json_values, max_size=3))
    return st.one_of(st.lists(message, max_size=4), json_values).map(json.dumps)


def contract_tensor(spec, vocab_size: int) -> st.SearchStrategy[np.ndarray]:
    """A tensor of the declared type and shape (what tritonserver lets through) with values
    chosen to hurt: extreme numbers, NaN, bytes that are not UTF-8, JSON that is not an object."""
    dtype = TENSOR_TYPES[spec.data_type]
    shape = st.just((1,)) if spec.dims == (1,) else st.tuples(st.integers(0, 6))
    if spec.data_type == "STRING":
        elements = raw_strings
        if spec.name == "messages":
            elements = messages_json().map(lambda t: t.encode("utf-8", "surrogatepass"))
    elif spec.name == "input_ids":
        elements = st.one_of(st.integers(0, vocab_size - 1), st.integers(-2**63, 2**63 - 1))
    elif dtype is np.bool_:
        elements = st.booleans()
    elif np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        elements = st.one_of(st.integers(-3, 40), st.integers(int(info.min), int(info.max)))
    else:
        elements = st.floats(width=32, allow_nan=True, allow_infinity=True)
    return hnp.arrays(dtype, shape, elements=elements)


def any_tensor() -> st.SearchStrategy[np.ndarray]:
    """A tensor of any type and shape (a client that ignores the model's config)."""
    def array(dtype):
        shape = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=3)
        if dtype is np.object_:
            return hnp.arrays(dtype, shape, elements=raw_strings)
        return hnp.arrays(dtype, shape)
    return st.sampled_from(ANY_DTYPES).flatmap(array)


def triton_inputs(vocab_size: int, contract_only: bool) -> st.SearchStrategy[dict]:
    """A request's named input tensors: usually one prompt input, a few other inputs."""
    by_name = {spec.name: spec for spec in INPUTS}

    def tensor(name):
        declared = contract_tensor(by_name[name], vocab_size)
        return declared if contract_only else st.one_of(declared, any_tensor())

    prompt_names = st.sampled_from(["text_input", "input_ids", "messages"])
    # mostly one prompt input, sometimes none or several
    prompts = st.one_of(prompt_names.map(lambda n: [n]),
                        st.lists(prompt_names, max_size=3, unique=True))
    others = st.lists(st.sampled_from(sorted(set(by_name) - {"text_input", "input_ids",
                                                                "messages"})),
                      max_size=4, unique=True)
    return st.tuples(prompts, others).flatmap(
        lambda names: st.fixed_dictionaries({n: tensor(n) for n in names[0] + names[1]}))


def _body(required: dict, field_names) -> st.SearchStrategy[dict]:
    """A JSON body: the required fields (plausible or not), then any of the schema's fields."""
    keys = st.one_of(st.sampled_from(sorted(field_names)), any_text) if field_names else any_text
    extra = st.dictionaries(keys, sampling_value, max_size=5)
    return st.tuples(st.fixed_dictionaries(required), extra).map(lambda p: {**p[1], **p[0]})


def frontend_requests(model: str) -> st.SearchStrategy[tuple[str, bytes]]:
    """(route, body) for every POST route of the front end: bodies that follow its schemas with
    hostile values, and bodies that are not JSON objects at all."""
    from tritonlm_frontend.openai_protocol import ChatCompletionRequest, CompletionRequest
    from tritonlm_frontend.tgi_protocol import CompatBody, GenerateParameters

    name = st.one_of(st.just(model), any_text)
    text = st.one_of(st.text(min_size=1, max_size=30), any_text)
    message = st.one_of(
        st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                               "content": st.one_of(text, json_values)}),
        json_values)
    messages = st.one_of(st.lists(message, min_size=1, max_size=3), json_values)
    prompt = st.one_of(text, st.lists(extreme_ints, max_size=6), st.lists(text, max_size=3),
                       json_values)
    tgi_parameters = st.one_of(_body({}, GenerateParameters.model_fields), json_values)
    bodies = st.one_of(
        st.tuples(st.just("/v1/chat/completions"),
                  _body({"model": name, "messages": messages},
                        ChatCompletionRequest.model_fields)),
        st.tuples(st.just("/v1/completions"),
                  _body({"model": name, "prompt": prompt}, CompletionRequest.model_fields)),
        st.tuples(st.sampled_from(["/generate", "/generate_stream", "/"]),
                  _body({"inputs": st.one_of(text, json_values), "parameters": tgi_parameters},
                        CompatBody.model_fields)),
        st.tuples(st.just("/tokenize"), _body({"inputs": st.one_of(text, json_values)}, {})))
    routes = st.sampled_from(["/v1/chat/completions", "/v1/completions", "/generate",
                              "/generate_stream", "/", "/tokenize"])
    return st.one_of(
        bodies.map(lambda rb: (rb[0], json.dumps(rb[1]).encode("utf-8", "surrogatepass"))),
        st.tuples(routes, raw_strings))
