"""Structured-output requests in every spelling the APIs use, as one `OutputConstraint`.

vLLM's keys (`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`, and its current
`structured_outputs: {json | json_object | regex | choice | grammar}`) reach SamplingParams; the
front end maps TGI's `grammar` and OpenAI's `response_format` onto them. The engine compiles the
constraint once per distinct (kind, spec) (engine/structured_output.py).
"""
import json
from dataclasses import dataclass

from tritonlm.errors import InvalidRequestError

KINDS = ("json", "json_object", "regex", "choice", "grammar")
LEGACY_KEYS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
               "guided_grammar": "grammar"}


@dataclass(frozen=True)
class OutputConstraint:
    """What the output must match. `spec`: the JSON schema as JSON text ("json"), the
    regex, the choices as a JSON list, the EBNF grammar; "" for any JSON object."""
    kind: str
    spec: str

    @property
    def choices(self) -> list[str]:
        return json.loads(self.spec)


def constraint_from(structured_outputs: dict | None, legacy: dict) -> OutputConstraint | None:
    """The one constraint a request asks for, from `structured_outputs` and the guided_* keys
    (`legacy`: key -> value, None when unset); InvalidRequestError when several or a bad one."""
    given = {LEGACY_KEYS[key]: value for key, value in legacy.items() if value is not None}
    if structured_outputs is not None:
        if not isinstance(structured_outputs, dict):
            _bad("structured_outputs", "must be an object with one of " + ", ".join(KINDS))
        unknown = set(structured_outputs) - set(KINDS)
        if unknown:
            _bad("structured_outputs", f"has unknown keys {sorted(unknown)}; known: "
                 + ", ".join(KINDS))
        given.update({k: v for k, v in structured_outputs.items()
                      if v is not None and v is not False})
    if not given:
        return None
    if len(given) > 1:
        _bad("structured_outputs", f"asks for several constraints ({', '.join(sorted(given))}); "
             "give one")
    (kind, value), = given.items()
    return OutputConstraint(kind, _spec(kind, value))


def _spec(kind: str, value) -> str:
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                _bad("guided_json", f"is not valid JSON ({e})")
        if not isinstance(value, (dict, bool)):
            _bad("guided_json", "must be a JSON schema (an object)")
        return json.dumps(value)
    if kind == "json_object":
        if value is not True:
            _bad("structured_outputs.json_object", "must be true")
        return ""
    if kind == "choice":
        if (not isinstance(value, list) or not value
                or not all(isinstance(c, str) and c for c in value)):
            _bad("guided_choice", "must be a non-empty list of non-empty strings")
        return json.dumps(value)
    if not isinstance(value, str) or not value:
        _bad(f"guided_{kind}", "must be a non-empty string")
    return value


def _bad(name: str, why: str):
    raise InvalidRequestError(f"{name} {why}")
