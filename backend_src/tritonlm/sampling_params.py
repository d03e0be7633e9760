"""Per-request generation controls, validated once at the edge (vLLM names and defaults)."""
import math
from dataclasses import dataclass, field, fields

from tritonlm.errors import InvalidRequestError
from tritonlm.output_constraints import OutputConstraint, constraint_from
MAX_SEQUENCES = 16
MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    max_tokens: int | None = None  # None: until EOS or the context limit
    min_tokens: int = 0
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 disables
    top_p: float = 1.0
    min_p: float = 0.0
    typical_p: float = 1.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    bad_words: list[str] = field(default_factory=list)  # never generated
    logprobs: int | None = None  # top alternatives to report per generated token
    n: int = 1  # sequences returned
    best_of: int | None = None  # sequences generated, the n with the best cumulative logprob kept
    stream_interval: int | None = None  # new tokens per streamed output, at least the engine's
    prompt_logprobs: int | None = None  # top alternatives to report per prompt token
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last N tokens
    watermark: bool = False  # TGI's (tritonlm/watermark.py)
    speculative: bool = True  # false: no speculative decoding for this request
    # A fine-tuned adapter the model serves (its repository's multi_lora.json); None: the base
    lora_name: str | None = None
    # Structured output (vLLM's keys; output_constraints.py): one of them, as `constraint`
    structured_outputs: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    constraint: OutputConstraint | None = field(default=None, init=False)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.logit_bias is None:
            self.logit_bias = {}
        for f in fields(self):
            if f.init:
                _check_type(f.name, getattr(self, f.name))
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        self.bad_words = list(self.bad_words)
        for name in _FLOAT_FIELDS:
            setattr(self, name, _as_float(name, getattr(self, name)))
        self.logit_bias = _token_biases(self.logit_bias)
        self.constraint = constraint_from(self.structured_outputs, {
            key: getattr(self, key) for key in ("guided_json", "guided_regex", "guided_choice",
                                                "guided_grammar")})
        if self.max_tokens is not None and self.max_tokens < 1:
            _bad("max_tokens", self.max_tokens, "must be >= 1")
        if self.min_tokens < 0:
            _bad("min_tokens", self.min_tokens, "must be >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _bad("min_tokens", self.min_tokens, f"must be <= max_tokens ({self.max_tokens})")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            _bad("temperature", self.temperature, "must be a finite number >= 0")
        if not 0 <= self.top_k < 2**31:
            _bad("top_k", self.top_k, "must be in [0, 2**31) (0 disables it)")
        if not 0 < self.top_p <= 1:
            _bad("top_p", self.top_p, "must be in (0, 1]")
        if not 0 <= self.min_p <= 1:
            _bad("min_p", self.min_p, "must be in [0, 1]")
        if not 0 < self.typical_p <= 1:
            _bad("typical_p", self.typical_p, "must be in (0, 1]")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            _bad("repetition_penalty", self.repetition_penalty, "must be > 0")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                _bad(name, getattr(self, name), "must be in [-2, 2]")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            _bad("logprobs", self.logprobs, f"must be in [0, {MAX_LOGPROBS}]")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            _bad("prompt_logprobs", self.prompt_logprobs, f"must be in [0, {MAX_LOGPROBS}]")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < 1:
            _bad("truncate_prompt_tokens", self.truncate_prompt_tokens, "must be >= 1")
        if not 1 <= self.n <= MAX_SEQUENCES:
            _bad("n", self.n, f"must be in [1, {MAX_SEQUENCES}]")
        if self.best_of is not None and not self.n <= self.best_of <= MAX_SEQUENCES:
            _bad("best_of", self.best_of, f"must be in [n, {MAX_SEQUENCES}]")
        if (self.best_of or self.n) > 1 and self.temperature == 0:
            _bad("temperature", self.temperature, "must be > 0 when n or best_of exceed 1 "
                 "(greedy sequences would all be the same)")
        if self.stream_interval is not None and self.stream_interval < 1:
            _bad("stream_interval", self.stream_interval, "must be >= 1")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            _bad("seed", self.seed, "must be in [0, 2**63)")
        for name in ("stop", "bad_words"):
            if any(not s for s in getattr(self, name)):
                _bad(name, getattr(self, name), "must not contain empty strings")
        if any(t < 0 for t in self.stop_token_ids):
            _bad("stop_token_ids", self.stop_token_ids, "must be non-negative token ids")

    @property
    def uses_penalties(self) -> bool:
        return (self.repetition_penalty != 1 or self.presence_penalty != 0
                or self.frequency_penalty != 0)

    @classmethod
    def from_dict(cls, values: dict) -> "SamplingParams":
        """Build from a JSON-like dict; unknown keys and bad values raise InvalidRequestError."""
        known = {f.name for f in fields(cls) if f.init}
        for key in values:
            if key not in known:
                raise InvalidRequestError(
                    f"unknown sampling parameter {key!r}; known: {', '.join(sorted(known))}")
        return cls(**values)


_FIELD_TYPES = {
    "max_tokens": (int, type(None)), "min_tokens": int, "temperature": (int, float),
    "top_k": int, "top_p": (int, float), "min_p": (int, float), "typical_p": (int, float),
    "repetition_penalty": (int, float), "presence_penalty": (int, float),
    "frequency_penalty": (int, float), "logprobs": (int, type(None)), "n": int,
    "best_of": (int, type(None)), "stream_interval": (int, type(None)),
    "prompt_logprobs": (int, type(None)), "logit_bias": dict,
    "truncate_prompt_tokens": (int, type(None)),
    "seed": (int, type(None)), "stop": (list, tuple),
    "stop_token_ids": (list, tuple), "bad_words": (list, tuple),
    "include_stop_str_in_output": bool, "ignore_eos": bool,
    "skip_special_tokens": bool, "watermark": bool, "speculative": bool,
    "lora_name": (str, type(None)),
    "structured_outputs": (dict, type(None)), "guided_json": (dict, str, type(None)),
    "guided_regex": (str, type(None)), "guided_choice": (list, type(None)),
    "guided_grammar": (str, type(None)),
}
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "typical_p", "repetition_penalty",
                 "presence_penalty", "frequency_penalty")
_ELEMENT_TYPES = {"stop": str, "bad_words": str, "stop_token_ids": int}


def _check_type(name: str, value) -> None:
    expected = _FIELD_TYPES[name]
    wrong_bool = isinstance(value, bool) and expected is not bool
    if wrong_bool or not isinstance(value, expected):
        _bad(name, value, f"has the wrong type {type(value).__name__}")
    element = _ELEMENT_TYPES.get(name)
    if element and any(isinstance(v, bool) or not isinstance(v, element) for v in value):
        _bad(name, value, f"must be a list of {element.__name__}")


def _token_biases(bias: dict) -> dict[int, float]:
    """OpenAI's logit_bias ({"token id": bias}, keys strings or ints) as {int: float}."""
    out = {}
    for key, value in bias.items():
        token = _token_id(key)
        if token is None:
            _bad("logit_bias", key, "keys must be token ids")
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not -100 <= value <= 100:  # NaN fails too
            _bad(f"logit_bias[{key!r}]", value, "must be a number in [-100, 100]")
        out[token] = float(value)
    return out


def _as_float(name: str, value: int | float) -> float:
    try:
        return float(value)
    except OverflowError:
        _bad(name, value, "is out of range")


def _token_id(key) -> int | None:
    if isinstance(key, int) and not isinstance(key, bool):
        return key
    try:
        return int(key) if isinstance(key, str) else None
    except ValueError:
        return None


def _bad(name: str, value, why: str):
    shown = repr(value) if not isinstance(value, int) or abs(value) < 10**40 else "a huge integer"
    shown = shown if len(shown) <= 200 else shown[:200] + "..."
    raise InvalidRequestError(f"{name} {why}, got {shown}")
