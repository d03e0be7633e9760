"""Turns what a client sent (text, token ids or chat messages, and sampling parameters) into a
validated, tokenized Request; every problem is an InvalidRequestError for that request alone."""
import time
from dataclasses import dataclass, field

import jinja2

from tritonlm.engine.block_manager import BlockManager
from tritonlm.engine.structured_output import Grammars
from tritonlm.errors import InvalidRequestError
from tritonlm.sampling_params import MAX_LOGPROBS, MAX_SEQUENCES, SamplingParams


@dataclass
class Request:
    """A validated, tokenized request, ready for the engine thread."""
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt_text: str | None = None
    bad_words_ids: list[list[int]] = field(default_factory=list)
    arrival: float = field(default_factory=time.time)
    trace_parent: str | None = None  # W3C traceparent to continue
    stream: bool = True  # False: one output, when the request ends (vLLM's FINAL_ONLY)
    grammar: object = None  # the compiled params.constraint (engine/structured_output.py)
    lora_id: int = 0  # params.lora_name's id; 0: the base model


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask for (engine.json's settings, TGI's names). max_total_tokens:
    set, a prompt plus its max_tokens beyond it is refused (TGI's rule); unset, max_tokens is
    cut to what max_model_len leaves."""
    max_input_tokens: int | None = None
    max_total_tokens: int | None = None
    max_best_of: int = MAX_SEQUENCES
    max_stop_sequences: int | None = None
    max_top_n_tokens: int = MAX_LOGPROBS


class RequestBuilder:
    """Safe to use from any thread: it only reads the tokenizer and the engine's limits."""

    def __init__(self, tokenizer, vocab_size: int, max_model_len: int,
                 block_manager: BlockManager, encoder_decoder: bool, grammars: Grammars,
                 limits: RequestLimits = RequestLimits(), lora_ids: dict[str, int] | None = None):
        """`lora_ids`: the adapters served, by name."""
        self.tokenizer = tokenizer
        self.grammars = grammars
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.limits = limits
        self.max_input_tokens = min(limits.max_input_tokens or max_model_len - 1,
                                    max_model_len - 1)
        self.blocks = block_manager
        self.encoder_decoder = encoder_decoder
        self.lora_ids = lora_ids or {}

    def build(self, request_id: str, prompt: str | list[int] | None = None,
              params: SamplingParams | None = None, messages: list[dict] | None = None,
              add_generation_prompt: bool = True,
              chat_template_kwargs: dict | None = None) -> Request:
        params = params or SamplingParams()
        if (prompt is None) == (messages is None):
            raise InvalidRequestError("give exactly one of a prompt (text or token ids) or messages")
        if params.prompt_logprobs is not None and self.encoder_decoder:
            raise InvalidRequestError("prompt_logprobs is not supported for encoder-decoder "
                                      "models: their prompt is encoded, not predicted")
        self._check_limits(params)
        lora_id = self._lora_id(params.lora_name)
        if messages is not None:
            prompt = self.render_chat(messages, add_generation_prompt, chat_template_kwargs)
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty")
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=messages is None)
            text = prompt
        else:
            token_ids, text = list(prompt), None
            if not all(isinstance(t, int) for t in token_ids):
                raise InvalidRequestError("a token-id prompt must be a list of integers")
            self._check_vocabulary("input_ids", token_ids)
        if not token_ids:
            raise InvalidRequestError("prompt is empty")
        if params.truncate_prompt_tokens is not None and \
                len(token_ids) > params.truncate_prompt_tokens:
            token_ids, text = token_ids[-params.truncate_prompt_tokens:], None
        self._check_vocabulary("stop_token_ids", params.stop_token_ids)
        self._check_vocabulary("logit_bias", list(params.logit_bias))
        if len(token_ids) > self.max_input_tokens:
            raise InvalidRequestError(
                f"prompt has {len(token_ids)} tokens, more than max_input_tokens "
                f"({self.max_input_tokens}; max_model_len is {self.max_model_len}, and a prompt "
                "leaves room for a new token)")
        max_total = self.limits.max_total_tokens
        if (max_total is not None and params.max_tokens is not None
                and not self.encoder_decoder
                and len(token_ids) + params.max_tokens > max_total):
            raise InvalidRequestError(
                f"prompt tokens + max_tokens must be <= max_total_tokens "
                f"({max_total}): given {len(token_ids)} prompt tokens and "
                f"{params.max_tokens} max_tokens")
        blocks_for = self.blocks.blocks_for
        # Encoder-decoder: the prompt fills cross blocks and the decoder needs one more.
        needed = (blocks_for(len(token_ids)) + 1 if self.encoder_decoder
                  else blocks_for(len(token_ids) + 1))
        if needed > self.blocks.num_blocks:
            raise InvalidRequestError(f"prompt of {len(token_ids)} tokens does not fit the KV cache")
        grammar = self.grammars.compile(params.constraint) if params.constraint else None
        return Request(request_id, token_ids, params, text, self._bad_words_ids(params.bad_words),
                       grammar=grammar, lora_id=lora_id)

    def _lora_id(self, name: str | None) -> int:
        if name is None:
            return 0
        if name not in self.lora_ids:
            served = ", ".join(sorted(self.lora_ids)) or "none"
            raise InvalidRequestError(f"unknown LoRA adapter {name!r}; this model serves: {served}")
        return self.lora_ids[name]

    def _check_limits(self, params: SamplingParams) -> None:
        limits = self.limits
        asked = [("n", params.n, "max_best_of", limits.max_best_of),
                 ("best_of", params.best_of, "max_best_of", limits.max_best_of),
                 ("stop sequences", len(params.stop), "max_stop_sequences",
                  limits.max_stop_sequences),
                 ("logprobs", params.logprobs, "max_top_n_tokens", limits.max_top_n_tokens),
                 ("prompt_logprobs", params.prompt_logprobs, "max_top_n_tokens",
                  limits.max_top_n_tokens)]
        for name, value, limit_name, limit in asked:
            if value is not None and limit is not None and value > limit:
                raise InvalidRequestError(f"{name} must be <= {limit_name} ({limit}), got {value}")

    def _check_vocabulary(self, name: str, token_ids: list[int]) -> None:
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"{name} {bad[:5]} are outside the vocabulary "
                                      f"[0, {self.vocab_size})")

    def _bad_words_ids(self, words: list[str]) -> list[list[int]]:
        # A word may start a text or follow a space, which byte-level vocabularies tell apart.
        variants = {tuple(self.tokenizer.encode(text, add_special_tokens=False))
                    for word in words for text in (word, " " + word.lstrip())}
        return [list(v) for v in variants if v]

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    chat_template_kwargs: dict | None = None) -> str:
        """The model's own chat template applied to `messages`; `chat_template_kwargs`: extra
        variables for the template (e.g. {"enable_thinking": false})."""
        if not isinstance(messages, list) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str) for m in messages) or not messages:
            raise InvalidRequestError("messages must be a non-empty list of {role, content} objects")
        kwargs = chat_template_kwargs or {}
        if not isinstance(kwargs, dict):
            raise InvalidRequestError(f"chat_template_kwargs must be a JSON object, got {kwargs!r}")
        reserved = sorted(_RESERVED_TEMPLATE_KWARGS.intersection(kwargs))
        if reserved:
            raise InvalidRequestError(f"chat_template_kwargs may not set {', '.join(reserved)}")
        if not self.tokenizer.chat_template:
            raise InvalidRequestError("this model has no chat template; send text_input instead")
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs)
        except (jinja2.TemplateError, ValueError) as exc:
            raise InvalidRequestError(f"the chat template failed: {exc}") from None


# apply_chat_template's own arguments that would change what it returns or which template runs
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "tokenize", "add_generation_prompt", "return_dict", "return_tensors",
    "padding", "truncation", "max_length", "tokenizer_kwargs", "chat_template",
    "return_assistant_tokens_mask"})
