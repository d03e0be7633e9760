"""One request's generation state, mutated only by the engine thread."""
from enum import Enum, auto

from tritonlm.engine.step_plan import SampledToken
from tritonlm.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class FinishReason:
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


class Sequence:
    def __init__(self, seq_id: int, request_id: str, prompt_token_ids: list[int],
                 params: SamplingParams, seed: int, max_total_tokens: int,
                 bad_words_ids: list[list[int]] = (), index: int = 0,
                 encoder_token_ids: list[int] | None = None, lora_id: int = 0):
        self.seq_id = seq_id
        self.index = index  # among the request's n / best_of sequences
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.lora_id = lora_id  # its adapter; 0: the base model
        # Sampling noise depends only on (seed, output index): batch-independent and resumable.
        self.seed = seed
        # min(max_model_len, prompt + max_tokens)
        self.max_total_tokens = max_total_tokens
        self.bad_words_ids = list(bad_words_ids)
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.num_cached_blocks = 0  # its first blocks the prefix cache knows
        # Prefix-chain hashes of its full blocks of tokens, computed once: token_ids only grow.
        self.content_hashes: list[int] = []
        # Encoder-decoder models: the prompt goes to the encoder, whose output becomes the
        # cross-attention K/V held in `cross_block_table`; token_ids are the decoder's.
        self.encoder_token_ids = encoder_token_ids
        self.cross_block_table: list[int] = []
        self.encoder_computed = False
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        # finish_reason "stop": the stop string or stop token id that ended it; None for EOS.
        self.stop_reason: str | int | None = None
        self.cumulative_logprob = 0.0
        # Per output token when the request asked for logprobs: (token, logprob, top alternatives)
        self.logprobs: list[SampledToken] = []
        # prompt_logprobs: entry i for prompt token i + 1 (the first token has none)
        self.prompt_logprobs: list[SampledToken] = []
        # Speculative decoding: tokens proposed for it, of those the ones accepted, and how many
        # its last verification accepted (None before the first)
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.last_accepted: int | None = None

    def append(self, sampled: SampledToken) -> None:
        self.token_ids.append(sampled.token)
        self.cumulative_logprob += sampled.logprob
        if self.params.logprobs is not None:
            self.logprobs.append(sampled)

    def add_prompt_logprobs(self, start_pos: int, entries: list[SampledToken]) -> None:
        """The prompt logprobs of a chunk starting at `start_pos` (a recomputed one replaces)."""
        del self.prompt_logprobs[start_pos:]
        self.prompt_logprobs += entries

    @property
    def needs_prompt_logprobs(self) -> bool:
        """The request asked for prompt logprobs and this (its first) sequence lacks some."""
        return (self.params.prompt_logprobs is not None and self.index == 0
                and len(self.prompt_logprobs) < self.num_prompt_tokens - 1)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_input_tokens(self) -> int:
        """The request's prompt length: the encoder's input, or the decoder prompt."""
        return len(self.encoder_token_ids) if self.encoder_token_ids else self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, status={self.status.name})")
