"""OpenAI tool calling on the engine's structured output.

`tool_choice` "required" constrains the reply to a JSON array of one or more calls
([{"name", "arguments"}], each name one of the tools and its arguments valid against that tool's
parameters schema); a named function constrains it to that function's arguments. "auto" lets the
model answer freely and reads calls in the model's own format, where its chat template defines
one (Hermes-style `<tool_call>{"name", "arguments"}</tool_call>`, as Qwen's and others'); a
template without one is a 400. "none" ignores the tools. Tools go to the chat template as
`tools`, so templates that render them tell the model what it may call.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from .errors import APIError

HERMES_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)
ANY_OBJECT = {"type": "object"}


@dataclass
class ToolCalling:
    mode: str  # "required", "named" or "auto"
    tools: list[dict[str, Any]]  # the request's, for the chat template
    schemas: dict[str, dict] = field(default_factory=dict)  # function name -> parameters
    named: str | None = None

    @classmethod
    def from_request(cls, tools: list[dict] | None, tool_choice: Any,
                     chat_template: str | None) -> ToolCalling | None:
        """What `tools` and `tool_choice` ask (None: no tool calling); APIError 400 when they
        are malformed or ask what this model cannot do."""
        if not tools:
            if tool_choice not in (None, "none", "auto"):
                raise APIError(400, "tool_choice needs tools", "tool_choice")
            return None
        schemas = {}
        for i, tool in enumerate(tools):
            function = tool.get("function") if isinstance(tool, dict) else None
            if tool.get("type") != "function" or not isinstance(function, dict) \
                    or not isinstance(function.get("name"), str):
                raise APIError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": "
                               "{\"name\": ..., \"parameters\": {...}}}", f"tools[{i}]")
            parameters = function.get("parameters", ANY_OBJECT)
            if not isinstance(parameters, dict):
                raise APIError(400, f"tools[{i}].function.parameters must be a JSON schema",
                               f"tools[{i}]")
            schemas[function["name"]] = parameters
        if tool_choice == "none":
            return None
        if tool_choice == "required":
            return cls("required", tools, schemas)
        if isinstance(tool_choice, dict):
            name = (tool_choice.get("function") or {}).get("name")
            if tool_choice.get("type") != "function" or name not in schemas:
                raise APIError(400, f"tool_choice names no given function ({name!r})",
                               "tool_choice")
            return cls("named", tools, schemas, name)
        if tool_choice in (None, "auto"):
            if not chat_template or "<tool_call>" not in chat_template:
                raise APIError(400, "tool_choice \"auto\" needs a chat template that defines a "
                               "tool-call format, and this model's does not; use \"required\" "
                               "or name a function", "tool_choice")
            return cls("auto", tools, schemas)
        raise APIError(400, f"tool_choice must be none, auto, required or a function, got "
                       f"{tool_choice!r}", "tool_choice")

    def structured_outputs(self) -> dict | None:
        """The engine constraint: the calls' JSON (none for "auto")."""
        if self.mode == "named":
            return {"json": self.schemas[self.named]}
        if self.mode == "required":
            calls = [{"type": "object", "properties": {"name": {"const": name},
                                                        "arguments": parameters},
                      "required": ["name", "arguments"], "additionalProperties": False}
                     for name, parameters in self.schemas.items()]
            return {"json": {"type": "array", "items": {"anyOf": calls}, "minItems": 1}}
        return None

    def calls(self, text: str) -> tuple[list[dict], str | None] | None:
        """(OpenAI tool_calls, the text around them or None) of a finished reply; None when
        it holds no call (cut short, or "auto" answered in words)."""
        try:
            if self.mode == "named":
                return [_call(self.named, json.loads(text))], None
            if self.mode == "required":
                return [_call(c["name"], c["arguments"]) for c in json.loads(text)], None
        except (json.JSONDecodeError, KeyError, TypeError):
            return None
        found = []
        for match in HERMES_CALL.finditer(text):
            try:
                call = json.loads(match.group(1))
                found.append(_call(call["name"], call.get("arguments", {})))
            except (json.JSONDecodeError, KeyError, TypeError):
                return None
        if not found:
            return None
        rest = HERMES_CALL.sub("", text).strip()
        return found, rest or None


def _call(name: str, arguments: Any) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}
