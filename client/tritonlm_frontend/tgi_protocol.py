"""TGI's request bodies (its router's GenerateRequest and GenerateParameters: field names,
defaults, validation and messages) and their mapping onto the engine's sampling keys."""
from __future__ import annotations

import random
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from .errors import APIError

DEFAULT_GENERATION_LENGTH = 1024  # TGI checks the context against min(max_new_tokens, this)
MAX_SEED = 2**63  # the engine's seeds (TGI's are u64)


def invalid(message: str, param: str) -> APIError:
    """TGI's validation error: 422 naming the field."""
    return APIError(422, message, param)


class _Lenient(BaseModel):
    # Unknown fields are ignored (logged by read_body); types are checked strictly, as serde does.
    model_config = ConfigDict(extra="allow", strict=True)


class GenerateParameters(_Lenient):
    # null is accepted wherever TGI's clients send it for "unset"
    best_of: int | None = None
    decoder_input_details: bool | None = False
    details: bool | None = False
    do_sample: bool | None = False
    frequency_penalty: float | None = None
    max_new_tokens: int | None = None  # None: until EOS or the context limit (TGI's default)
    repetition_penalty: float | None = None
    return_full_text: bool | None = None
    seed: int | None = None
    stop: list[str] | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_n_tokens: int | None = None
    top_p: float | None = None
    truncate: int | None = None
    typical_p: float | None = None
    watermark: bool | None = False
    grammar: Any = None
    adapter_id: str | None = None
    ignore_eos: bool | None = None  # an extension (vLLM's key): benchmarks need exact lengths

    @property
    def wants_details(self) -> bool:
        return bool(self.details or self.decoder_input_details)

    @property
    def sampling(self) -> bool:
        """Whether tokens are sampled: do_sample or any logits warper (TGI's server's rule;
        best_of > 1 always samples)."""
        return bool(self.do_sample or (self.temperature is not None and self.temperature != 1.0)
                    or self.top_k or (self.top_p is not None and self.top_p < 1.0)
                    or (self.typical_p is not None and self.typical_p < 1.0)
                    or (self.best_of or 1) > 1)

    def check(self, stream: bool, limits: dict[str, int]) -> None:
        """TGI's router validation (messages as TGI words them); `limits`: the engine's
        max_best_of, max_stop_sequences, max_top_n_tokens where known (else the engine checks)."""
        best_of = 1 if self.best_of is None else self.best_of
        max_best_of = limits.get("max_best_of", best_of)
        if not 0 < best_of <= max_best_of:
            raise invalid(f"`best_of` must be > 0 and <= {max_best_of}. Given: {best_of}",
                          "parameters.best_of")
        warped = any(v is not None for v in (self.temperature, self.top_k, self.top_p,
                                             self.typical_p))
        if best_of > 1 and not (self.do_sample or warped):
            raise invalid("you must use sampling when `best_of` is > 1", "parameters.best_of")
        if best_of > 1 and self.seed is not None:
            raise invalid("`seed` must not be set when `best_of` > 1", "parameters.seed")
        if best_of > 1 and stream:
            raise invalid("`best_of` != 1 is not supported when streaming tokens",
                          "parameters.best_of")
        if self.decoder_input_details and stream:
            raise invalid("`decoder_input_details` == true is not supported when streaming tokens",
                          "parameters.decoder_input_details")
        self._check_ranges(limits)

    def _check_ranges(self, limits: dict[str, int]) -> None:
        max_top_n = limits.get("max_top_n_tokens", self.top_n_tokens)
        checks = (
            ("temperature", self.temperature, lambda v: v > 0, "must be strictly positive"),
            ("repetition_penalty", self.repetition_penalty, lambda v: v > 0,
             "must be strictly positive"),
            ("frequency_penalty", self.frequency_penalty, lambda v: -2.0 <= v <= 2.0,
             "must be >= -2.0 and <= 2.0"),
            ("top_p", self.top_p, lambda v: 0.0 < v < 1.0, "must be > 0.0 and < 1.0"),
            ("typical_p", self.typical_p, lambda v: 0.0 < v < 1.0, "must be > 0.0 and < 1.0"),
            ("top_k", self.top_k, lambda v: v > 0, "must be strictly positive"),
            ("max_new_tokens", self.max_new_tokens, lambda v: v > 0, "must be strictly positive"),
            ("seed", self.seed, lambda v: 0 <= v < MAX_SEED, f"must be >= 0 and < {MAX_SEED}"),
            ("top_n_tokens", self.top_n_tokens, lambda v: 0 <= v <= max_top_n,
             f"must be >= 0 and <= {max_top_n}"),
        )
        for name, value, ok, why in checks:
            if value is not None and not ok(value):
                raise invalid(f"`{name}` {why}. Given: {value}", f"parameters.{name}")
        stop = self.stop or []
        max_stop = limits.get("max_stop_sequences", len(stop))
        if len(stop) > max_stop:
            raise invalid(f"`stop` supports up to {max_stop} stop sequences. "
                          f"Given: {len(stop)}", "parameters.stop")
        if any(not s for s in stop):
            raise invalid("`stop` sequences must not be empty", "parameters.stop")

    def check_length(self, input_tokens: int | None, max_total_tokens: int) -> None:
        """TGI's context checks for a prompt of `input_tokens` tokens before truncation (None:
        unknown, the engine checks it)."""
        max_input = max_total_tokens - 1  # the engine needs room for one new token
        if self.truncate is not None:
            if not 0 < self.truncate <= max_input:
                raise invalid(f"`truncate` must be strictly positive and less than {max_input}. "
                              f"Given: {self.truncate}", "parameters.truncate")
            if input_tokens is not None:
                input_tokens = min(input_tokens, self.truncate)
        if input_tokens is None:
            return
        if self.max_new_tokens is not None:
            new = min(self.max_new_tokens, DEFAULT_GENERATION_LENGTH)
            if input_tokens + new > max_total_tokens:
                raise invalid(f"`inputs` tokens + `max_new_tokens` must be <= {max_total_tokens}. "
                              f"Given: {input_tokens} `inputs` tokens and {self.max_new_tokens} "
                              "`max_new_tokens`", "parameters.max_new_tokens")
        if input_tokens > max_input:
            raise invalid(f"`inputs` must have less than {max_input + 1} tokens. "
                          f"Given: {input_tokens}", "inputs")

    def engine_sampling(self, token_details: bool) -> dict[str, Any]:
        """The engine's sampling keys; `token_details`: report each token's logprob entry
        (with top_n_tokens alternatives). A sampled request without a seed gets a random one,
        which details report (TGI's behaviour)."""
        values: dict[str, Any] = {"include_stop_str_in_output": True}  # TGI keeps the stop text
        if self.sampling:
            for key in ("temperature", "top_k", "top_p", "typical_p"):
                if getattr(self, key) is not None:
                    values[key] = getattr(self, key)
            values["seed"] = self.seed if self.seed is not None else random.randrange(MAX_SEED)
        else:
            values["temperature"] = 0.0
        for key in ("repetition_penalty", "frequency_penalty", "stop", "ignore_eos", "watermark"):
            if getattr(self, key):
                values[key] = getattr(self, key)
        if self.max_new_tokens is not None:
            values["max_tokens"] = self.max_new_tokens
        if self.adapter_id is not None:
            values["lora_name"] = self.adapter_id
        if self.truncate is not None:
            values["truncate_prompt_tokens"] = self.truncate
        if (self.best_of or 1) > 1:
            values["n"] = self.best_of
        if token_details:
            values["logprobs"] = self.top_n_tokens or 0
        if self.decoder_input_details:
            values["prompt_logprobs"] = 0
        if self.grammar is not None:
            values["structured_outputs"] = self._structured_outputs()
        return values

    def _structured_outputs(self) -> dict[str, Any]:
        """TGI's grammar ({"type": json | json_schema | json_object | regex, "value"}) as the
        engine's structured_outputs."""
        grammar = self.grammar
        if not isinstance(grammar, dict) or "type" not in grammar:
            raise invalid("`grammar` must be {\"type\": ..., \"value\": ...}", "parameters.grammar")
        kind, value = grammar["type"], grammar.get("value")
        if kind == "regex":
            return {"regex": value}
        if kind == "json":
            return {"json": value}
        if kind == "json_schema":  # {"name": ..., "schema": {...}}, OpenAI's wrapping
            return {"json": value.get("schema") if isinstance(value, dict) else value}
        if kind == "json_object":
            return {"json": value} if value else {"json_object": True}
        raise invalid(f"`grammar.type` must be json, json_schema, json_object or regex. "
                      f"Given: {kind}", "parameters.grammar")


class GenerateBody(_Lenient):
    """POST /generate and /generate_stream. A body without `parameters` samples (TGI's
    default parameters set do_sample)."""
    inputs: str
    parameters: GenerateParameters = Field(
        default_factory=lambda: GenerateParameters(do_sample=True))

    def check(self, stream: bool, limits: dict[str, int]) -> None:
        if not self.inputs:
            raise invalid("`inputs` cannot be empty", "inputs")
        self.parameters.check(stream, limits)


class CompatBody(GenerateBody):
    """POST /: either route, by `stream`."""
    stream: bool = False


class TokenizeBody(_Lenient):
    inputs: str

