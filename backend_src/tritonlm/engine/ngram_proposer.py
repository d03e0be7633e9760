"""Prompt lookup (vLLM's `ngram` speculation): the longest n-gram ending the sequence that occurred
earlier in its prompt + output proposes the tokens that followed its most recent occurrence.
Plain numpy: each n is one comparison over the context's sliding windows, no Python scan."""
import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from tritonlm.engine.sequence import Sequence


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

    def propose(self, seqs: list[Sequence], limits: list[int]) -> dict[int, list[int]]:
        drafts = {}
        for seq, limit in zip(seqs, limits):
            if limit > 0:
                drafts[seq.seq_id] = propose_ngram(seq.token_ids, min(self.num_tokens, limit),
                                                   self.min_n, self.max_n)
        return drafts

    def release(self, seq_id: int) -> None:
        pass  # nothing is held per sequence
