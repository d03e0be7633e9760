"""The typed boundary between the scheduler and the model runner: plain values, no live objects."""
from dataclasses import dataclass, field

from tritonlm.sampling_params import SamplingParams


@dataclass(frozen=True)
class SamplingRow:
    params: SamplingParams
    seed: int
    output_index: int  # how many tokens this sequence has generated so far
    banned: tuple[int, ...]  # tokens that must not be chosen at this step


@dataclass(frozen=True)
class ScheduledChunk:
    """Compute KV for `token_ids` at positions start_pos.. of one sequence; maybe sample after."""
    seq_id: int
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sampling: SamplingRow | None  # None: a prefill chunk that does not reach the sequence's end
    num_prompt_tokens: int
    track_tokens: bool  # the sequence uses penalties: the runner keeps its token history
    history: list[int] = field(default_factory=list)  # tokens before start_pos, to (re)count
    # Encoder-decoder models: the encoder input, when this step must encode it, and the blocks
    # holding the cross-attention K/V of its encoder_len tokens.
    encoder_token_ids: list[int] | None = None
    cross_block_table: list[int] = field(default_factory=list)
    encoder_len: int = 0
    # prompt_logprobs: the prompt tokens that follow this chunk's first len(prompt_targets)
    # tokens, whose logprobs (and top num_prompt_logprobs alternatives) the request asked for.
    prompt_targets: list[int] = field(default_factory=list)
    num_prompt_logprobs: int = 0
    # Speculative decoding: token_ids ends with this many proposed tokens, sampled after each
    # position as well as the last (output indices on from sampling.output_index); the scheduler
    # keeps the proposals that equal the tokens sampled before them, then one sampled token more.
    num_draft_tokens: int = 0
    # The tokens banned at the draw after each proposal (bad words, min_tokens), as
    # sampling.banned is at the draw after token_ids' first: the proposals before it count.
    # Empty: sampling.banned at every draw.
    draft_banned: tuple[tuple[int, ...], ...] = ()
    lora_id: int = 0  # the sequence's adapter (engine/lora_registry.py); 0: the base model


@dataclass
class StepPlan:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted_seq_ids: list[int] = field(default_factory=list)
    finished_seq_ids: list[int] = field(default_factory=list)  # since the previous plan
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (source, target) blocks
    # Above 1, a decode run: every chunk decodes this many tokens in a row, each step's input the
    # token the one before sampled, with KV slots already given for all of them. The host sees
    # the tokens once, after the last step, so the device never waits on it in between.
    num_steps: int = 1

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass(frozen=True)
class SampledToken:
    """The runner's result for one sequence: the token, its logprob and the top alternatives."""
    token: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class StepResult:
    """What a step produced: the sampled tokens (by seq_id, a dict per step of a run or per
    position of a speculative verification), and prompt logprobs for the chunks asking."""
    sampled: list[dict[int, SampledToken]] = field(default_factory=list)
    prompt_logprobs: dict[int, list[SampledToken]] = field(default_factory=dict)  # by seq_id
