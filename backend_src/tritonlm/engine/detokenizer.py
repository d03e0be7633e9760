"""Incremental detokenization with stop strings: never emits a broken UTF-8 sequence, and holds
back only the tail of the text that could still become a stop string."""
from tokenizers import Tokenizer

# Decode a few tokens before the new ones so merges across the boundary render as in full text.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int],
                 skip_special_tokens: bool, stop: list[str], include_stop_str_in_output: bool):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self.prefix_offset = max(len(prompt_token_ids) - _CONTEXT_TOKENS, 0)
        self.read_offset = len(prompt_token_ids)
        self.text = ""
        self.num_emitted_chars = 0
        self.matched_stop: str | None = None  # the stop string that ended the text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_tokens(self, token_ids: list[int], final: bool) -> bool:
        """Extend the text with the sequence's latest tokens; True if a stop string matched.

        Until `final`, text ending in an incomplete UTF-8 sequence waits for the next token."""
        if self.read_offset == len(token_ids):
            return False
        prefix = self._decode(token_ids[self.prefix_offset:self.read_offset])
        full = self._decode(token_ids[self.prefix_offset:])
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return False
        previous_len = len(self.text)
        self.text += full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(token_ids)
        return self._truncate_at_stop(previous_len)

    def _truncate_at_stop(self, previous_len: int) -> bool:
        if not self.stop:
            return False
        best = None
        for stop in self.stop:
            index = self.text.find(stop, max(0, previous_len - len(stop) + 1))
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return False
        index, stop = best
        self.text = self.text[:index + len(stop) if self.include_stop else index]
        self.matched_stop = stop
        return True

    def _held_back(self) -> int:
        """Length of the longest text suffix that is a proper prefix of some stop string."""
        longest = 0
        for stop in self.stop:
            for n in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:n]):
                    longest = n
                    break
        return longest

    def take_delta(self, finished: bool) -> str:
        """New text since the last call; all of it once the sequence has finished."""
        end = len(self.text) if finished else len(self.text) - self._held_back()
        delta = self.text[self.num_emitted_chars:end]
        self.num_emitted_chars = max(self.num_emitted_chars, end)
        return delta
