"""Transport-independent parts of the clients: request fields, response parsing, the public API."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping, Sequence

RETURN_FLAGS = ("return_finish_reason", "return_num_input_tokens", "return_num_output_tokens",
                "return_token_ids")

# Every return flag of the contract (the clients above ask for the first four; the HTTP front end
# for all of them).
ALL_RETURN_FLAGS = (*RETURN_FLAGS, "return_logprobs", "return_cumulative_logprob",
                    "return_stop_reason")

# Triton datatype of every request field a client sends (see shared/design/triton-io.md).
FIELD_TYPES = {"text_input": "BYTES", "input_ids": "INT64", "messages": "BYTES", "stream": "BOOL",
               "add_generation_prompt": "BOOL", "chat_template_kwargs": "BYTES",
               "exclude_input_in_output": "BOOL", "sampling_parameters": "BYTES",
               **{flag: "BOOL" for flag in ALL_RETURN_FLAGS}}


class TritonLMError(RuntimeError):
    """The server (or the transport) rejected or failed a request; str() is the server's message."""


@dataclass
class Delta:
    """One streamed chunk: the new text and token ids; finish_reason is set on the last one."""
    text: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class Completion:
    """A whole generation result; with n > 1, `texts` holds every sequence's text by index and
    `text` the first."""
    text: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    num_input_tokens: int | None = None
    num_output_tokens: int | None = None
    texts: list[str] = field(default_factory=list)


def request_fields(prompt: str | Sequence[int] | None = None, messages: Sequence[Mapping] | None = None,
                   stream: bool = False, sampling: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Request fields as plain Python values (str, list[int], bool), keyed by input name."""
    if messages is not None:
        fields: dict[str, Any] = {"messages": json.dumps(list(messages))}
    elif isinstance(prompt, str):
        fields = {"text_input": prompt}
    elif prompt is not None:
        fields = {"input_ids": [int(t) for t in prompt]}
    else:
        raise ValueError("a prompt (str or list of token ids) or messages is required")
    fields["stream"] = bool(stream)
    fields["sampling_parameters"] = json.dumps(dict(sampling or {}))
    fields.update({flag: True for flag in RETURN_FLAGS})
    return fields


def _items(value: Any) -> list:
    """A tensor value as a flat list (numpy array, JSON list or JSON scalar)."""
    if value is None:
        return []
    if hasattr(value, "tolist"):
        value = value.tolist()
    if not isinstance(value, list):
        return [value]
    flat = []
    for v in value:
        flat.extend(_items(v) if isinstance(v, list) else [v])
    return flat


def _text(value: Any) -> str:
    return "".join(v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in _items(value))


def parse_outputs(outputs: Mapping[str, Any]) -> Completion:
    """One response's output tensors (from gRPC as numpy or from HTTP as JSON) as a Completion."""
    n_in, n_out = _items(outputs.get("num_input_tokens")), _items(outputs.get("num_output_tokens"))
    texts = [_text(t) for t in _items(outputs.get("text_output"))]
    reasons = _items(outputs.get("finish_reason"))
    return Completion(text=texts[0] if texts else "", texts=texts,
                      token_ids=[int(t) for t in _items(outputs.get("token_ids"))],
                      finish_reason=(_text(reasons[0]) if reasons else "") or None,
                      num_input_tokens=int(n_in[0]) if n_in else None,
                      num_output_tokens=sum(int(n) for n in n_out) if n_out else None)


def merge(parts: Iterable[Completion]) -> Completion:
    """Concatenate the responses of one request into its Completion."""
    total = Completion(text="")
    for part in parts:
        total.texts += [""] * (len(part.texts) - len(total.texts))
        for index, text in enumerate(part.texts):
            total.texts[index] += text
        total.token_ids.extend(part.token_ids)
        total.finish_reason = part.finish_reason or total.finish_reason
        if part.num_input_tokens is not None:
            total.num_input_tokens = part.num_input_tokens
        if part.num_output_tokens is not None:
            total.num_output_tokens = (total.num_output_tokens or 0) + part.num_output_tokens
    total.text = total.texts[0] if total.texts else ""
    return total


def defaults_from_parameters(parameters: Mapping[str, Any]) -> dict[str, Any]:
    """Sampling defaults a model's config.pbtxt parameters name as `default_<key>` (a JSON value
    in string_value, e.g. default_temperature: "0.6")."""
    defaults = {}
    for name, value in parameters.items():
        if name.startswith("default_"):
            text = value.get("string_value", "") if isinstance(value, Mapping) else value
            try:
                defaults[name[len("default_"):]] = json.loads(text)
            except ValueError:
                continue
    return defaults


class BaseClient:
    """The public API; subclasses supply `_responses`, the transport."""

    def sampling_defaults(self) -> dict[str, Any]:
        """The sampling values the server applies where a request leaves a key unset (the
        model's generation_config), as far as this transport can read them; {} when unknown."""
        return {}

    def _responses(self, fields: dict[str, Any]) -> Iterator[Completion]:
        """Yield the parsed responses of one request until its final one; closing the iterator
        early cancels the request."""
        raise NotImplementedError

    def generate(self, prompt: str | Sequence[int], **sampling) -> Completion:
        """Complete `prompt` (text or token ids); `sampling` keys go to sampling_parameters as given."""
        return merge(self._responses(request_fields(prompt, stream=False, sampling=sampling)))

    def stream(self, prompt: str | Sequence[int], **sampling) -> Iterator[Delta]:
        """Like generate, yielding Deltas as the server produces them."""
        return self._deltas(request_fields(prompt, stream=True, sampling=sampling))

    def chat(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True,
             **sampling) -> Completion:
        """Answer a conversation ([{"role": ..., "content": ...}]) using the model's chat template;
        add_generation_prompt=False continues the last message instead."""
        fields = request_fields(messages=messages, stream=False, sampling=sampling)
        return merge(self._responses({**fields, "add_generation_prompt": add_generation_prompt}))

    def chat_stream(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True,
                    **sampling) -> Iterator[Delta]:
        """Like chat, yielding Deltas as they arrive."""
        fields = request_fields(messages=messages, stream=True, sampling=sampling)
        return self._deltas({**fields, "add_generation_prompt": add_generation_prompt})

    def _deltas(self, fields: dict[str, Any]) -> Iterator[Delta]:
        responses = self._responses(fields)
        try:
            for part in responses:
                if part.text or part.token_ids or part.finish_reason:
                    yield Delta(part.text, part.token_ids, part.finish_reason)
        finally:
            responses.close()  # cancels the request when the caller stopped early
