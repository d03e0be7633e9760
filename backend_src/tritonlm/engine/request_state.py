"""One request's sequences (n / best_of), their detokenizers, and the outputs sent so far."""
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tritonlm.engine.detokenizer import IncrementalDetokenizer
from tritonlm.engine.sequence import Sequence
from tritonlm.engine.stats import RequestTimeline
from tritonlm.engine.step_plan import SampledToken


@dataclass
class SequenceOutput:
    """What one step added to one sequence of a request (all of it for best_of results)."""
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # finish_reason "stop": stop string or token id; None: EOS
    num_output_tokens: int = 0  # total so far
    cumulative_logprob: float = 0.0
    logprobs: list[dict] | None = None  # one entry per new token when logprobs were asked for


@dataclass
class RequestOutput:
    request_id: str
    sequences: list[SequenceOutput]  # index order, n of them (empty deltas included)
    finished: bool
    num_prompt_tokens: int
    error: str | None = None
    # On the request's first output, when it asked for prompt_logprobs: one entry per prompt
    # token (the first's logprob is None).
    prompt_logprobs: list[dict] | None = None


class RequestState:
    def __init__(self, first: Sequence, make_detokenizer: Callable[[], IncrementalDetokenizer],
                 logprob_entries: Callable[[list[SampledToken]], list[dict]],
                 timeline: RequestTimeline,
                 trace_parent: str | None = None, stream_interval: int | None = 1):
        params = first.params
        self.request_id = first.request_id
        self.num_prompt_tokens = first.num_input_tokens
        self.n = params.n
        self.num_sequences = params.best_of or params.n
        self.make_detokenizer = make_detokenizer
        self.logprob_entries = logprob_entries
        self.prompt_logprobs_due = params.prompt_logprobs is not None
        self.timeline = timeline
        self.trace_parent = trace_parent
        self.stream_interval = stream_interval  # None: output only at the end
        self.seqs: list[Sequence] = []
        self.detokenizers: list[IncrementalDetokenizer] = []
        self.num_sent: list[int] = []
        self.add_sequence(first)

    def add_sequence(self, seq: Sequence) -> None:
        self.seqs.append(seq)
        self.detokenizers.append(self.make_detokenizer())
        self.num_sent.append(0)

    @property
    def needs_fork(self) -> bool:
        return len(self.seqs) < self.num_sequences

    @property
    def finished(self) -> bool:
        return not self.needs_fork and all(s.is_finished for s in self.seqs)

    def on_new_token(self, seq: Sequence) -> str | None:
        """The stop string that `seq`'s latest token completed, if one did. Text without stop
        strings to watch waits for the next output (non-streamed: one decode at the end)."""
        detokenizer = self.detokenizers[seq.index]
        if not detokenizer.stop:
            return None
        return detokenizer.matched_stop if self._detokenize(seq) else None

    def _detokenize(self, seq: Sequence) -> bool:
        start = time.perf_counter()
        stopped = self.detokenizers[seq.index].add_tokens(seq.token_ids, final=seq.is_finished)
        self.timeline.detokenize_seconds += time.perf_counter() - start
        return stopped

    def output(self) -> RequestOutput | None:
        """Deltas since the last call; best_of > n reports only once, the n best at the end."""
        if self.num_sequences > self.n:
            if not self.finished:
                return None
            best = sorted(self.seqs, key=lambda s: s.cumulative_logprob, reverse=True)[:self.n]
            deltas = [self._delta(seq, index) for index, seq in enumerate(best)]
        elif not self._due():
            return None
        else:
            deltas = [self._delta(seq, seq.index) for seq in self.seqs]
            deltas += [SequenceOutput(i) for i in range(len(deltas), self.n)]
        return RequestOutput(self.request_id, deltas, self.finished, self.num_prompt_tokens,
                             prompt_logprobs=self._take_prompt_logprobs())

    def _take_prompt_logprobs(self) -> list[dict] | None:
        """The prompt logprobs, once (None if aborted before the prompt was computed)."""
        if not self.prompt_logprobs_due:
            return None
        self.prompt_logprobs_due = False
        first = self.seqs[0]
        if first.needs_prompt_logprobs:
            return None
        # The first prompt token has no logprob: nothing comes before it.
        entries = self.logprob_entries([SampledToken(first.token_ids[0], 0.0, []),
                                        *first.prompt_logprobs])
        entries[0]["logprob"] = None
        return entries

    def _due(self) -> bool:
        """Output now: a sequence's first tokens, its end, or stream_interval tokens unsent."""
        if self.stream_interval == 1 or self.finished:
            return True
        if self.stream_interval is None:
            return False
        return any(sent == 0 or seq.is_finished or unsent >= self.stream_interval
                   for seq, sent in zip(self.seqs, self.num_sent)
                   if (unsent := seq.num_output_tokens - sent))

    def _delta(self, seq: Sequence, index: int) -> SequenceOutput:
        sent = self.num_sent[seq.index]
        self.num_sent[seq.index] = seq.num_output_tokens
        logprobs = None
        if seq.params.logprobs is not None:
            logprobs = self.logprob_entries(seq.logprobs[sent:])
        self._detokenize(seq)
        return SequenceOutput(index, self.detokenizers[seq.index].take_delta(seq.is_finished),
                              seq.output_token_ids[sent:], seq.finish_reason, seq.stop_reason,
                              seq.num_output_tokens, seq.cumulative_logprob, logprobs)
