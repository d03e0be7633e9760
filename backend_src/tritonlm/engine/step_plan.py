"""The typed boundary between the scheduler and the model runner: plain values, no live objects."""
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingRow:
    temperature: float
    top_k: int
    top_p: float
    seed: int
    output_index: int  # how many tokens this sequence has generated so far


@dataclass(frozen=True)
class ScheduledChunk:
    """Compute KV for `token_ids` at positions start_pos.. of one sequence; maybe sample after."""
    seq_id: int
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sampling: SamplingRow | None  # None: a prefill chunk that does not reach the sequence's end


@dataclass
class StepPlan:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted_seq_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks
