"""OpenAI tool calling through the front end, read by the `openai` SDK: a required or named
tool_choice gives calls whose names are given tools and whose arguments validate against their
parameters (`jsonschema`), whole or streamed; "auto" on a model whose chat template has no
tool-call format is a 400; a Hermes-format template's calls are read from the reply."""
import json

import jsonschema
import openai
import pytest

from tritonlm_frontend.errors import APIError
from tritonlm_frontend.tool_calls import ToolCalling

WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 30},
                          "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
        "required": ["timezone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER,
                                           "description": "The weather in a city"}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(smollm2_server):
    return openai.OpenAI(base_url=f"{smollm2_server.frontend_url}/v1", api_key="none")


def assert_valid_calls(calls, names=SCHEMAS):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("seed,temperature", [(0, 0.0), (2, 1.0)])
def test_required_tool_choice_gives_valid_calls(client, seed, temperature):
    reply = client.chat.completions.create(model="llm", messages=MESSAGES, tools=TOOLS,
                                           tool_choice="required", max_tokens=120, seed=seed,
                                           temperature=temperature)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert_valid_calls(choice.message.tool_calls)


def test_named_tool_choice_calls_that_function(client):
    reply = client.chat.completions.create(
        model="llm", messages=MESSAGES, tools=TOOLS, max_tokens=80, temperature=0.7, seed=4,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert_valid_calls(reply.choices[0].message.tool_calls, names={"get_time"})


def test_streamed_tool_calls_add_up_to_valid_calls(client):
    # Greedy: sampled at the model's default temperature, a call's arguments can run past
    # max_tokens (finish_reason "length", as OpenAI reports it).
    stream = client.chat.completions.create(model="llm", messages=MESSAGES, tools=TOOLS,
                                            tool_choice="required", max_tokens=120, stream=True,
                                            temperature=0.0, seed=0)
    calls, finish = {}, None
    for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and calls
    for call in calls.values():
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


@pytest.mark.parametrize("tools,tool_choice,words", [
    (TOOLS, "auto", "chat template"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "names no given function"),
    ([{"type": "function"}], "required", r"tools\[0\] must be"),
    (None, "required", "needs tools"),
])
def test_bad_tool_requests_are_400(client, tools, tool_choice, words):
    with pytest.raises(openai.BadRequestError, match=words):
        client.chat.completions.create(model="llm", messages=MESSAGES, max_tokens=8,
                                       tool_choice=tool_choice, **({"tools": tools} if tools else {}))
    assert client.chat.completions.create(model="llm", messages=MESSAGES, max_tokens=2)


def test_auto_reads_hermes_calls_where_the_template_defines_them():
    template = "{% for tool in tools %}{{ tool | tojson }}{% endfor %} <tool_call>"
    tools = ToolCalling.from_request(TOOLS, "auto", template)
    assert tools.structured_outputs() is None
    calls, rest = tools.calls('Let me check. <tool_call>\n{"name": "get_weather", "arguments": '
                              '{"city": "Paris", "unit": "celsius"}}\n</tool_call>')
    assert rest == "Let me check."
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "unit": "celsius"}
    assert tools.calls("It is sunny.") is None
    with pytest.raises(APIError, match="chat template"):
        ToolCalling.from_request(TOOLS, "auto", "{{ messages }}")
