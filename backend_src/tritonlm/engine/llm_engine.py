"""The step loop: the scheduler picks sequences, the model runner runs them, the outputs go back."""
import dataclasses
import itertools
import logging
import random
import time
import weakref
from pathlib import Path

from tokenizers import Tokenizer
from transformers import AutoTokenizer

from tritonlm.config import WEIGHTS_DIR, EngineConfig
from tritonlm.engine.auto_dtype import resolve_dtype
from tritonlm.engine.block_manager import BlockManager
from tritonlm.engine.detokenizer import IncrementalDetokenizer
from tritonlm.engine.engine_reports import EngineReports
from tritonlm.engine.generation_config import read_generation_config, sampling_defaults
from tritonlm.distributed.ranks import RankGroup
from tritonlm.engine.model_runner import ModelRunner, resolve_device
from tritonlm.engine.request_builder import Request, RequestBuilder, RequestLimits
from tritonlm.engine.request_state import RequestOutput, RequestState
from tritonlm.engine.scheduler import Scheduler
from tritonlm.engine.sequence import FinishReason, Sequence
from tritonlm.engine.speculation import make_proposer
from tritonlm.engine.stats import RequestTimeline
from tritonlm.engine.step_plan import SampledToken
from tritonlm.engine.structured_output import GrammarMatchers, Grammars
from tritonlm.errors import InvalidRequestError
from tritonlm.models.loader import load_config
from tritonlm.models.registry import context_limit, kv_depends_only_on_prefix
from tritonlm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def resolve_model_dir(path: str | Path) -> Path:
    """A model version directory (holding weights/) from it, its model directory or the default."""
    path = Path(path)
    if (path / WEIGHTS_DIR).is_dir():
        return path
    versions = sorted((p for p in path.glob("*") if p.name.isdigit() and (p / WEIGHTS_DIR).is_dir()),
                      key=lambda p: int(p.name))
    if not versions:
        raise FileNotFoundError(f"{path} holds no converted model (no {WEIGHTS_DIR}/ directory)")
    return versions[-1]


class LLMEngine:
    def __init__(self, model_dir: str | Path, **overrides):
        model_dir = resolve_model_dir(model_dir)
        weights_dir = model_dir / WEIGHTS_DIR
        self.config = EngineConfig.load(model_dir, **overrides)
        self.hf_config = load_config(weights_dir)
        self.config.dtype = resolve_dtype(self.config.dtype, resolve_device(self.config.device),
                                          self.hf_config)
        self.tokenizer = AutoTokenizer.from_pretrained(weights_dir)
        # Requests are tokenized on Triton's threads; the engine thread decodes with its own copy.
        self._decoder = Tokenizer.from_str(self.tokenizer.backend_tokenizer.to_str())
        self.max_model_len = min(self.config.max_model_len, context_limit(self.hf_config))
        self.config.max_model_len = self.max_model_len
        self.ranks = self._stop_ranks = None
        if self.config.tensor_parallel_size > 1:
            self.ranks = RankGroup(model_dir, self.config.tensor_parallel_size,
                                   dataclasses.asdict(self.config),
                                   resolve_device(self.config.device))
            # An engine dropped without shutdown() (`del llm`) still stops its ranks and leaves
            # this process single-rank for the next engine. Not at exit: another thread may be
            # inside a collective then, and the workers leave when this process does.
            self._stop_ranks = weakref.finalize(self, self.ranks.shutdown)
            self._stop_ranks.atexit = False
        try:
            self.runner = ModelRunner(self.config, self.hf_config, weights_dir, self.ranks)
            if self.ranks is not None:
                self.ranks.wait_until_loaded()
        except Exception:
            self.shutdown()
            raise
        # Encoder-decoder: the prompt is encoded and the decoder starts from this one token.
        self._decoder_start = ([self.hf_config.decoder_start_token_id]
                               if self.hf_config.is_encoder_decoder else None)
        self.block_manager = BlockManager(self.runner.num_blocks, self.config.block_size,
                                          self.config.enable_prefix_caching
                                          and kv_depends_only_on_prefix(self.hf_config))
        generation_config = read_generation_config(weights_dir)
        self.scheduler = Scheduler(self.block_manager, self.config.max_num_seqs,
                                   self.config.max_num_batched_tokens,
                                   self._eos_token_ids(generation_config),
                                   self.runner.max_decode_run,
                                   make_proposer(self.config, model_dir, self.tokenizer),
                                   self.config.speculative_disable_by_batch_size,
                                   self.config.max_loras, self.config.admission_headroom_blocks)
        # The model's recommended sampling keys, for requests that leave them unset.
        self.sampling_defaults = sampling_defaults(generation_config)
        if self.sampling_defaults:
            logger.info("sampling defaults from generation_config.json: %s",
                        self.sampling_defaults)
        self.special_token_ids = frozenset(self.tokenizer.all_special_ids) | {
            i for i, token in self.tokenizer.added_tokens_decoder.items() if token.special}
        self.vocab_size = self.hf_config.vocab_size
        self._lora_names = {adapter.lora_id: adapter.name for adapter in self.runner.adapters}
        self.request_builder = RequestBuilder(
            self.tokenizer, self.vocab_size, self.max_model_len, self.block_manager,
            self._decoder_start is not None,
            Grammars(self.tokenizer, self.vocab_size, self.scheduler.eos_token_ids),
            RequestLimits(self.config.input_token_limit, self.config.max_total_tokens,
                          self.config.max_best_of, self.config.max_stop_sequences,
                          self.config.max_top_n_tokens),
            {name: lora_id for lora_id, name in self._lora_names.items()})
        self.matchers = GrammarMatchers(self.vocab_size)
        self.runner.sampling_inputs.matchers = self.matchers
        self._seq_ids = itertools.count()
        self._requests: dict[str, RequestState] = {}
        self._seq_requests: dict[int, RequestState] = {}
        self.reports = EngineReports(self.scheduler, self.block_manager, self._lora_names)
        self.observers = self.reports.observers

    def _eos_token_ids(self, generation_config: dict) -> frozenset[int]:
        ids = set()
        sources = [getattr(self.hf_config, "eos_token_id", None), self.tokenizer.eos_token_id,
                   generation_config.get("eos_token_id")]
        for value in sources:
            ids.update(value if isinstance(value, list) else [value] if value is not None else [])
        return frozenset(ids)

    def make_request(self, request_id: str, prompt: str | list[int] | None = None,
                     params: SamplingParams | None = None, messages: list[dict] | None = None,
                     add_generation_prompt: bool = True,
                     chat_template_kwargs: dict | None = None) -> Request:
        """Validate and tokenize; raises InvalidRequestError. Safe to call from any thread."""
        return self.request_builder.build(request_id, prompt, params, messages,
                                          add_generation_prompt, chat_template_kwargs)

    def add(self, request: Request) -> None:
        """Queue a prepared request; it joins the running batch at the next step."""
        if request.request_id in self._requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already running")
        p = request.params
        prompt, encoder_input = request.prompt_token_ids, None
        if self._decoder_start is not None:
            prompt, encoder_input = self._decoder_start, request.prompt_token_ids
        max_total = self.config.total_token_limit
        if p.max_tokens is not None:
            max_total = min(max_total, len(prompt) + p.max_tokens)
        seed = p.seed if p.seed is not None else random.getrandbits(63)
        seq = Sequence(next(self._seq_ids), request.request_id, prompt, p, seed, max_total,
                       request.bad_words_ids, encoder_token_ids=encoder_input,
                       lora_id=request.lora_id)

        def make_detokenizer():
            return IncrementalDetokenizer(self._decoder, prompt,
                                          p.skip_special_tokens, p.stop,
                                          p.include_stop_str_in_output)
        state = RequestState(seq, make_detokenizer, self._logprob_entries,
                             RequestTimeline(request.arrival), request.trace_parent,
                             max(p.stream_interval or 1, self.config.stream_interval)
                             if request.stream else None)
        self._requests[request.request_id] = state
        self._seq_requests[seq.seq_id] = state
        if request.grammar is not None:
            self.matchers.add(seq.seq_id, request.grammar)
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request at once and free its blocks; its final output, if it was running."""
        state = self._requests.get(request_id)
        if state is None:
            return None
        state.num_sequences = len(state.seqs)  # sequences not forked yet never will be
        for seq in state.seqs:
            self.scheduler.finish(seq, FinishReason.ABORT)
        output = state.output()
        self._finished(state)
        return output

    def report_error(self, kind: str) -> None:
        """Count a request that failed outside the step loop ("invalid", "cancelled", ...)."""
        self.reports.error(kind)

    def shutdown(self, step_running: bool = False) -> None:
        """Stop the other tensor-parallel ranks, if any; `step_running`: a step that did not
        return (hung in a collective) still uses them, so they are killed without a word."""
        if self.ranks is None:
            return
        if step_running:
            self._stop_ranks.detach()
            self.ranks.kill()
        else:
            self._stop_ranks()
        self.ranks = None

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def step(self) -> list[RequestOutput]:
        """One iteration over the running batch; outputs for every request that advanced."""
        outputs = self._expire_queued() if self.config.queue_timeout is not None else []
        plan = self.scheduler.schedule()
        if plan.is_empty:
            self.reports.step(plan)
            return outputs
        start = time.time()
        for chunk in plan.chunks:
            timeline = self._seq_requests[chunk.seq_id].timeline
            timeline.scheduled = timeline.scheduled or start
        result = self.runner.execute(plan)
        advanced: dict[str, RequestState] = {}
        # A run's (or a verification's) later tokens of a finished sequence are dropped.
        for step, sampled in enumerate(result.sampled):
            for seq in self.scheduler.update(plan, sampled, result.prompt_logprobs, step):
                state = advanced.setdefault(seq.request_id, self._requests[seq.request_id])
                state.timeline.first_token = state.timeline.first_token or time.time()
                stop = state.on_new_token(seq)
                if stop is not None:
                    self.scheduler.finish(seq, FinishReason.STOP, stop)
                if not self.matchers.accept(seq.seq_id, seq.token_ids[-1]):
                    self.scheduler.finish(seq, FinishReason.STOP)  # the grammar is complete
                if state.needs_fork and seq.num_output_tokens == 1:
                    self._fork(state, seq)
        for state in advanced.values():
            output = state.output()
            if output is not None:
                outputs.append(output)
            if state.finished:
                self._finished(state)
        self.reports.step(plan)  # after the step, so an idle engine reports idle values
        return outputs

    def _expire_queued(self) -> list[RequestOutput]:
        """Fail the requests that waited queue_timeout seconds for their first step."""
        cutoff = time.time() - self.config.queue_timeout
        expired = {state.request_id: state for seq in self.scheduler.waiting
                   if (state := self._seq_requests[seq.seq_id]).timeline.scheduled is None
                   and state.timeline.arrival < cutoff}
        for request_id, state in expired.items():
            self.abort(request_id)
            self.report_error("timeout")
        return [RequestOutput(request_id, [], True, state.num_prompt_tokens,
                              error=f"the model is overloaded: the request waited "
                                    f"{self.config.queue_timeout:g} s (queue_timeout) without "
                                    "being scheduled; retry later")
                for request_id, state in expired.items()]

    def _fork(self, state: RequestState, first: Sequence) -> None:
        """n / best_of: the other sequences share the prompt's KV blocks with the first."""
        for index in range(len(state.seqs), state.num_sequences):
            seed = (first.seed + index * _SEED_STRIDE) % (1 << 63)
            child = Sequence(next(self._seq_ids), first.request_id, first.prompt_token_ids,
                             first.params, seed, first.max_total_tokens, first.bad_words_ids, index,
                             first.encoder_token_ids, first.lora_id)
            state.add_sequence(child)
            self._seq_requests[child.seq_id] = state
            self.matchers.fork(first.seq_id, child.seq_id)
            self.scheduler.fork(first, child)

    def _finished(self, state: RequestState) -> None:
        del self._requests[state.request_id]
        for seq in state.seqs:
            del self._seq_requests[seq.seq_id]
        self.matchers.release(seq.seq_id for seq in state.seqs)
        state.timeline.finished = time.time()
        self.reports.finished(state)

    def _logprob_entries(self, sampled: list[SampledToken]) -> list[dict]:
        """Logprob entries (token id, its text alone, logprob, whether it is a special token,
        and the top alternatives alike) for tokens; their texts are decoded in one batch."""
        ids = [t for s in sampled for t in (s.token, *(t for t, _ in s.top))]
        texts = iter(self._decoder.decode_batch([[t] for t in ids], skip_special_tokens=False))

        def token(token_id: int, logprob: float) -> dict:
            return {"token_id": token_id, "token": next(texts), "logprob": logprob,
                    "special": token_id in self.special_token_ids}
        return [{**token(s.token, s.logprob), "top_logprobs": [token(t, lp) for t, lp in s.top]}
                for s in sampled]


_SEED_STRIDE = 0x9E3779B97F4A7C15  # spreads the seeds of a request's sequences
