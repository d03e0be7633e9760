"""Prompt lookup (vLLM's `ngram` speculation): the longest n-gram ending the sequence that occurred
earlier in its prompt + output proposes the tokens that followed its most recent occurrence.
Plain numpy: each n is one comparison over the context's sliding windows, no Python scan."""
import logging

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from tritonlm.config import EngineConfig

logger = logging.getLogger(__name__)


def propose_ngram(token_ids: list[int], num_tokens: int, min_n: int, max_n: int) -> list[int]:
    """Up to `num_tokens` proposed continuations of `token_ids`; none when no n-gram of
    min_n..max_n tokens ending it occurred before."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # Windows starting before the suffix itself: each has a token after it.
        windows = sliding_window_view(tokens[:-1], n)
        matches = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
        if matches.size:
            start = int(matches[-1]) + n
            return tokens[start:start + num_tokens].tolist()
    return []


class NgramProposer:
    """vLLM's `ngram` proposer: up to `num_tokens` drafts per sequence from prompt lookup."""

    def __init__(self, num_tokens: int, min_n: int, max_n: int):
        self.num_tokens, self.min_n, self.max_n = num_tokens, min_n, max_n

    @classmethod
    def from_config(cls, config: EngineConfig) -> "NgramProposer | None":
        if config.speculative is None:
            return None
        logger.info("speculative decoding: %s, up to %d tokens a step (n-grams of %d..%d), "
                    "while fewer than %d sequences run", config.speculative,
                    config.num_speculative_tokens, config.prompt_lookup_min,
                    config.prompt_lookup_max, config.speculative_disable_by_batch_size)
        return cls(config.num_speculative_tokens, config.prompt_lookup_min,
                   config.prompt_lookup_max)

    def propose(self, token_ids: list[int], limit: int) -> list[int]:
        return propose_ngram(token_ids, min(self.num_tokens, limit), self.min_n, self.max_n)
