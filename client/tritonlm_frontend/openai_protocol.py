"""OpenAI request bodies (as vLLM's server accepts them) and their mapping onto the engine's
sampling keys. Fields a request leaves unset are not sent, so the model's own defaults apply."""
from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from .errors import APIError


# A prompt's token id: the engine checks the vocabulary; beyond int64 no tensor holds it.
TokenId = Annotated[int, Field(ge=0, lt=2**63)]


class _Lenient(BaseModel):
    # Unknown fields are kept (and logged by read_body), never rejected.
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Lenient):
    include_usage: bool = False


class ChatMessage(_Lenient):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class _SamplingFields(_Lenient):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)
    stream_interval: int | None = None  # tokens per streamed chunk (fewer events, less CPU)
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    response_format: dict[str, Any] | None = None
    speculative: bool | None = None  # tritonlm's: false turns speculative decoding off

    def sampling(self) -> dict[str, Any]:
        """The engine's sampling keys for the fields this request set."""
        values = {key: getattr(self, key) for key in _PASSED_THROUGH
                  if getattr(self, key) is not None}
        values.update(self._response_format())
        if isinstance(self.stop, str):
            values["stop"] = [self.stop]
        if self.top_k == -1:  # vLLM's spelling of "off"
            values["top_k"] = 0
        if self.n != 1:
            values["n"] = self.n
        return values

    def _response_format(self) -> dict[str, Any]:
        """OpenAI's response_format as the engine's structured_outputs."""
        kind = (self.response_format or {}).get("type", "text")
        if kind == "text":
            return {}
        if kind == "json_object":
            return {"structured_outputs": {"json_object": True}}
        if kind == "json_schema":
            spec = self.response_format.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise APIError(400, "response_format json_schema needs json_schema.schema, a "
                               "JSON schema object", "response_format")
            return {"structured_outputs": {"json": spec["schema"]}}
        raise APIError(400, f"response_format type {kind!r} is not one of text, json_object, "
                       "json_schema", "response_format")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed when stream is true",
                           "stream_options")


_PASSED_THROUGH = ("max_tokens", "temperature", "top_p", "stop", "seed", "presence_penalty",
                   "frequency_penalty", "logit_bias", "top_k", "min_p", "repetition_penalty",
                   "min_tokens", "stop_token_ids", "ignore_eos", "skip_special_tokens",
                   "include_stop_str_in_output", "truncate_prompt_tokens", "stream_interval",
                   "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                   "guided_grammar", "speculative")


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    def sampling(self) -> dict[str, Any]:
        values = super().sampling()
        if self.max_completion_tokens is not None:
            values["max_tokens"] = self.max_completion_tokens
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs set to true", "top_logprobs")
        if self.logprobs:
            values["logprobs"] = self.top_logprobs or 0
        return values

    def engine_messages(self) -> list[dict[str, str]]:
        """The messages with text-part lists joined, as the chat template takes them."""
        messages = []
        for position, message in enumerate(self.messages):
            content = message.content
            if isinstance(content, list):
                texts = []
                for part in content:
                    if part.get("type") != "text" or not isinstance(part.get("text"), str):
                        raise APIError(400, f"messages[{position}].content: only text parts are "
                                       f"supported, got {part.get('type')!r}",
                                       f"messages[{position}].content")
                    texts.append(part["text"])
                content = "\n".join(texts)
            messages.append({"role": message.role, "content": content or ""})
        if not messages:
            raise APIError(400, "messages must not be empty", "messages")
        return messages


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: int | None = 16  # OpenAI's and vLLM's default for completions
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0)
    best_of: int | None = None
    suffix: str | None = None

    def sampling(self) -> dict[str, Any]:
        values = super().sampling()
        if self.logprobs is not None:
            values["logprobs"] = self.logprobs
            if self.echo:
                values["prompt_logprobs"] = self.logprobs
        if self.best_of is not None:
            values["best_of"] = self.best_of
        return values

    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the request: a string or a list of token ids."""
        if self.suffix:
            raise APIError(400, "suffix is not supported", "suffix")
        prompt = self.prompt
        if isinstance(prompt, str):
            prompts = [prompt]
        elif prompt and all(isinstance(p, int) for p in prompt):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        if not prompts or any(len(p) == 0 for p in prompts):
            raise APIError(400, "prompt must not be empty", "prompt")
        return prompts

