"""Reads one Triton request (input tensors and parameters) into engine terms. No Triton import:
the adapter passes a tensor getter, so this is testable on plain numpy arrays."""
import json
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tritonlm.errors import InvalidRequestError
from tritonlm.sampling_params import SamplingParams
from tritonlm.triton.contract import RETURN_FLAGS, SAMPLING_TENSORS

TensorGetter = Callable[[str], np.ndarray | None]
_LIST_KEYS = {"stop", "stop_token_ids", "bad_words", "stop_words"}
_TRTLLM_ALIASES = {"stop_words": "stop", "random_seed": "seed", "min_length": "min_tokens"}


@dataclass
class ParsedRequest:
    prompt: str | list[int] | None
    messages: list | None
    add_generation_prompt: bool
    chat_template_kwargs: dict | None
    params: SamplingParams
    stream: bool
    exclude_input_in_output: bool
    return_flags: frozenset[str]


def parse_request(get: TensorGetter, parameters_json: str | None,
                  defaults: dict | None = None) -> ParsedRequest:
    """Raises InvalidRequestError naming the offending input. `defaults`: sampling keys (the
    model's, LLMEngine.sampling_defaults) for those the request leaves unset."""
    prompt, messages = _read_prompt(get)
    sampling = _json_object(_text(get, "sampling_parameters"), "sampling_parameters")
    sampling.update(_request_parameters(parameters_json))
    sampling.update(_sampling_tensors(get))
    _resolve_trtllm_names(sampling)
    sampling = {**(defaults or {}), **sampling}
    template_kwargs = _text(get, "chat_template_kwargs")
    return_flags = frozenset(f for f in RETURN_FLAGS if _flag(get, f, False))
    if "return_logprobs" in return_flags:
        sampling.setdefault("logprobs", 0)  # the chosen tokens' logprobs at least
    return ParsedRequest(
        prompt=prompt,
        messages=messages,
        add_generation_prompt=_flag(get, "add_generation_prompt", True),
        chat_template_kwargs=(None if template_kwargs is None
                              else _json_object(template_kwargs, "chat_template_kwargs")),
        params=SamplingParams.from_dict(sampling),
        stream=_flag(get, "stream", False),
        exclude_input_in_output=_flag(get, "exclude_input_in_output", True),
        return_flags=return_flags,
    )


def _read_prompt(get: TensorGetter) -> tuple[str | list[int] | None, list | None]:
    text = _text(get, "text_input")
    ids = get("input_ids")
    messages = _text(get, "messages")
    given = [name for name, v in (("text_input", text), ("input_ids", ids), ("messages", messages))
             if v is not None]
    if len(given) != 1:
        raise InvalidRequestError(
            f"send exactly one of text_input, input_ids or messages (got {given or 'none'})")
    if messages is not None:
        return None, _json(messages, "messages")
    if ids is not None:
        ids = np.asarray(ids)
        if not np.issubdtype(ids.dtype, np.integer):
            raise InvalidRequestError(f"input_ids must be integers, got {ids.dtype}")
        return ids.reshape(-1).tolist(), None
    return text, None


def _decode(value, name: str) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidRequestError(f"{name} is not valid UTF-8: {exc}") from None
    return str(value)


def _text(get: TensorGetter, name: str) -> str | None:
    array = get(name)
    if array is None:
        return None
    flat = np.asarray(array, dtype=object).reshape(-1)
    if flat.size != 1:
        raise InvalidRequestError(f"{name} must hold exactly one string, got {flat.size}")
    return _decode(flat[0], name)


def _flag(get: TensorGetter, name: str, default: bool) -> bool:
    array = get(name)
    if array is None:
        return default
    flat = np.asarray(array).reshape(-1)
    if flat.size != 1:
        raise InvalidRequestError(f"{name} must hold exactly one boolean, got {flat.size} values")
    return bool(flat[0])


def _json(text: str, name: str):
    try:
        return json.loads(text)
    except ValueError as exc:  # JSONDecodeError, or an integer of more digits than Python reads
        raise InvalidRequestError(f"{name} is not valid JSON: {exc}") from None
    except RecursionError:
        raise InvalidRequestError(f"{name} is nested too deeply") from None


def _json_object(text: str | None, name: str) -> dict:
    if text is None or not text.strip():
        return {}
    value = _json(text, name)
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{name} must be a JSON object, got {type(value).__name__}")
    return value


def _request_parameters(parameters_json: str | None) -> dict:
    # Triton's HTTP generate endpoint passes JSON fields that are not inputs as parameters;
    # keys Triton itself adds start with "triton_".
    params = _json_object(parameters_json, "request parameters")
    return {k: v for k, v in params.items() if not k.startswith("triton_")}


def _resolve_trtllm_names(sampling: dict) -> None:
    for alias, key in _TRTLLM_ALIASES.items():
        if alias in sampling:
            value = sampling.pop(alias)
            if key in sampling and sampling[key] != value:
                raise InvalidRequestError(f"{alias} {value!r} conflicts with {key} {sampling[key]!r}")
            sampling[key] = value
    if "end_id" in sampling:
        end_id = sampling.pop("end_id")
        if isinstance(end_id, bool) or not isinstance(end_id, int):
            raise InvalidRequestError(f"end_id must be a token id, got {end_id!r}")
        stop_ids = sampling.get("stop_token_ids", [])
        sampling["stop_token_ids"] = [*stop_ids, end_id] if isinstance(stop_ids, list) else stop_ids
    beam_width = sampling.pop("beam_width", 1)
    if beam_width != 1:
        raise InvalidRequestError(f"beam_width must be 1 (beam search is not supported), "
                                  f"got {beam_width!r}")


def _sampling_tensors(get: TensorGetter) -> dict:
    values = {}
    for spec in SAMPLING_TENSORS:
        array = get(spec.name)
        if array is None:
            continue
        flat = [_decode(v, spec.name) if isinstance(v, bytes)
                else v.item() if isinstance(v, np.generic) else v
                for v in np.asarray(array).reshape(-1)]
        if spec.name in _LIST_KEYS:
            values[spec.name] = flat
        elif len(flat) != 1:
            raise InvalidRequestError(f"{spec.name} must hold one value, got {len(flat)}")
        else:
            values[spec.name] = flat[0]
    return values
