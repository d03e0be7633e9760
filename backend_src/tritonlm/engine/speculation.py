"""Speculative decoding's proposers behind one interface: prompt lookup (ngram_proposer.py) or a
draft model (draft_proposer.py). The scheduler asks for proposals; one target step verifies
them (decode_run.verification_plan), keeping each while it equals the token the target drew."""
import logging
from pathlib import Path
from typing import Protocol

from tritonlm.config import EngineConfig
from tritonlm.engine.ngram_proposer import NgramProposer
from tritonlm.engine.sequence import Sequence

logger = logging.getLogger(__name__)


class Proposer(Protocol):
    def propose(self, seqs: list[Sequence], limits: list[int]) -> dict[int, list[int]]:
        """Draft tokens for each of the running `seqs` whose limit is above 0 (at most that
        many); a proposer holding state per sequence lets go of sequences not in `seqs`."""

    def release(self, seq_id: int) -> None:
        """`seq_id` finished: let go of what is held for it."""


def make_proposer(config: EngineConfig, model_dir: Path, tokenizer) -> Proposer | None:
    """The proposer engine.json's `speculative` names: "ngram", or a draft model's converted
    repository (a path, relative to the target's model version directory or absolute) with the
    target's vocabulary."""
    if config.speculative is None:
        return None
    logger.info("speculative decoding: %s, up to %d tokens a step, while fewer than %d "
                "sequences run", config.speculative, config.speculative_tokens,
                config.speculative_disable_by_batch_size)
    if config.speculative == "ngram":
        return NgramProposer(config.speculative_tokens, config.prompt_lookup_min,
                             config.prompt_lookup_max)
    from tritonlm.engine.draft_proposer import DraftModelProposer
    return DraftModelProposer(model_dir / config.speculative, config, tokenizer)
