"""Offline batch generation: `LLM(path).generate(prompts, params)` without any server."""
import itertools
from dataclasses import dataclass, field

from tritonlm.engine.llm_engine import LLMEngine
from tritonlm.engine.request_state import SequenceOutput
from tritonlm.sampling_params import SamplingParams


@dataclass
class Choice:
    """One generated sequence."""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # finish_reason "stop": stop string or token id; None: EOS
    cumulative_logprob: float = 0.0
    logprobs: list[dict] | None = None  # per token, when SamplingParams.logprobs is set

    def extend(self, delta: SequenceOutput) -> None:
        self.text += delta.text
        self.token_ids += delta.token_ids
        self.finish_reason = delta.finish_reason
        self.stop_reason = delta.stop_reason
        self.cumulative_logprob = delta.cumulative_logprob
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.logprobs


@dataclass
class CompletionOutput(Choice):
    """A request's result: its first sequence's fields, and all n sequences in `choices`."""
    prompt_token_ids: list[int] = field(default_factory=list)
    choices: list[Choice] = field(default_factory=list)
    prompt_logprobs: list[dict] | None = None  # per prompt token, when SamplingParams asked


class LLM:
    """An engine in this process. `model` is a converted model directory (REPO/NAME or REPO/NAME/1);
    keyword arguments override engine.json settings (e.g. num_kv_blocks=64, dtype="float32")."""

    def __init__(self, model: str, **engine_overrides):
        self.engine = LLMEngine(model, **engine_overrides)
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks (they also exit when this process does)."""
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[CompletionOutput]:
        """Generate for a prompt or a list of prompts (text or token-id lists), in input order.
        Without params, the model's sampling defaults (generation_config.json) apply."""
        single = isinstance(prompts, str) or (prompts and isinstance(prompts[0], int))
        prompts = [prompts] if single else list(prompts)
        if not isinstance(params, list):
            params = [params or SamplingParams.from_dict(self.engine.sampling_defaults)
                      ] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        results = {}
        for prompt, p in zip(prompts, params):
            request = self.engine.make_request(f"offline-{next(self._ids)}", prompt, p)
            request.stream = False
            self.engine.add(request)
            results[request.request_id] = CompletionOutput(
                prompt_token_ids=request.prompt_token_ids,
                choices=[Choice() for _ in range(p.n)])
        while self.engine.has_unfinished:
            for out in self.engine.step():
                result = results[out.request_id]
                if out.prompt_logprobs is not None:
                    result.prompt_logprobs = out.prompt_logprobs
                for delta in out.sequences:
                    result.choices[delta.index].extend(delta)
                result.extend(out.sequences[0])
        return list(results.values())
