"""Token history of the sequences that use penalties, kept on the device and updated from the
tokens each step computes (so chunked prefill and recompute after preemption stay consistent).

A speculative verification computes a sequence's input token and its proposals in one step (a
row each): all are counted, each row's history leaves out the proposals after its own input,
and the next step of the sequence uncounts those it did not keep (its first token stands where
the first refused proposal stood)."""
from collections import defaultdict

import numpy as np
import torch


class TokenCounts:
    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size = vocab_size
        self.device = device
        self.rows: dict[int, int] = {}
        self.free_rows: list[int] = []
        self.prompt_seen = torch.zeros((0, vocab_size), dtype=torch.bool, device=device)
        self.output_counts = torch.zeros((0, vocab_size), dtype=torch.int32, device=device)
        # seq_id -> (position, tokens): the proposals its last verification counted
        self.proposals: dict[int, tuple[int, list[int]]] = {}

    def _row(self, seq_id: int) -> int:
        if seq_id not in self.rows:
            if not self.free_rows:
                self._grow()
            self.rows[seq_id] = self.free_rows.pop()
        return self.rows[seq_id]

    def _grow(self) -> None:
        old = self.prompt_seen.shape[0]
        new = max(8, 2 * old)
        self.prompt_seen = torch.cat([self.prompt_seen, torch.zeros(
            (new - old, self.vocab_size), dtype=torch.bool, device=self.device)])
        self.output_counts = torch.cat([self.output_counts, torch.zeros(
            (new - old, self.vocab_size), dtype=torch.int32, device=self.device)])
        self.free_rows.extend(range(new - 1, old - 1, -1))

    def release(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self.proposals.pop(seq_id, None)
            row = self.rows.pop(seq_id, None)
            if row is not None:
                self.free_rows.append(row)

    def record(self, chunks) -> None:
        """Count the tokens of this step's chunks (a verification: a chunk per row) for the
        sequences that track them."""
        tracked = [c for c in chunks if c.track_tokens]
        if not tracked:
            return
        rows = np.array([self._row(c.seq_id) for c in tracked], dtype=np.int64)
        # A chunk may bring the tokens before it (history) when earlier KV was reused.
        firsts = [c.start_pos - len(c.history) for c in tracked]
        self._uncount_refused(tracked, firsts)
        restarted = [r for r, first in zip(rows, firsts) if first == 0]
        if restarted:  # first chunk, or a recompute after preemption
            self.prompt_seen[restarted] = False
            self.output_counts[restarted] = 0
        lens = np.array([len(c.history) + len(c.token_ids) for c in tracked])
        starts = np.repeat(firsts, lens)
        positions = starts + np.arange(lens.sum()) - np.repeat(np.cumsum(lens) - lens, lens)
        token_rows = np.repeat(rows, lens)
        tokens = np.concatenate([c.history + c.token_ids for c in tracked])
        in_prompt = positions < np.repeat([c.num_prompt_tokens for c in tracked], lens)
        self.prompt_seen[self._tensor(token_rows[in_prompt]), self._tensor(tokens[in_prompt])] = True
        out_rows, out_tokens = self._tensor(token_rows[~in_prompt]), self._tensor(tokens[~in_prompt])
        self.output_counts.index_put_((out_rows, out_tokens),
                                      torch.ones_like(out_rows, dtype=torch.int32), accumulate=True)
        for seq_id, verification in verifications(tracked).items():
            self.proposals[seq_id] = (verification[1].start_pos,
                                      [c.token_ids[0] for c in verification[1:]])

    def _uncount_refused(self, tracked, firsts: list[int]) -> None:
        """Uncount the proposals of each sequence's last verification at or after the position
        its chunk now starts from (a restart recounts everything anyway)."""
        starts = {}
        for chunk, first in zip(tracked, firsts):
            starts[chunk.seq_id] = min(first, starts.get(chunk.seq_id, first))
        rows, tokens = [], []
        for seq_id, first in starts.items():
            position, proposed = self.proposals.pop(seq_id, (first, []))
            if first > 0:
                refused = proposed[max(0, first - position):]
                rows += [self.rows[seq_id]] * len(refused)
                tokens += refused
        if tokens:
            self.output_counts.index_put_(
                (self._tensor(np.array(rows)), self._tensor(np.array(tokens))),
                torch.full((len(tokens),), -1, dtype=torch.int32, device=self.device),
                accumulate=True)

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device)

    def history(self, chunks) -> tuple[torch.Tensor, torch.Tensor]:
        """(seen in prompt or output, output counts) as [len(chunks), V] for the sampling rows
        `chunks`; zeros if untracked. A verification's row leaves out the proposals after its
        input (the inputs of its sequence's later rows)."""
        seen = torch.zeros((len(chunks), self.vocab_size), dtype=torch.bool, device=self.device)
        counts = torch.zeros((len(chunks), self.vocab_size), dtype=torch.int32, device=self.device)
        index = [i for i, c in enumerate(chunks) if c.seq_id in self.rows]
        if index:
            rows = [self.rows[chunks[i].seq_id] for i in index]
            counts[index] = self.output_counts[rows]
            position = {id(c): i for i, c in enumerate(chunks)}
            later = [(position[id(row)], after.token_ids[0])
                     for verification in verifications([chunks[i] for i in index]).values()
                     for j, row in enumerate(verification) for after in verification[j + 1:]]
            if later:
                at, tokens = zip(*later)
                counts.index_put_((self._tensor(np.array(at)), self._tensor(np.array(tokens))),
                                  torch.full((len(at),), -1, dtype=torch.int32,
                                             device=self.device), accumulate=True)
            seen[index] = self.prompt_seen[rows] | (counts[index] > 0)
        return seen, counts


def verifications(chunks) -> dict[int, list]:
    """seq_id -> its rows, by position, for the sequences with more than one row in `chunks`
    (a verification's: the input token, then each proposal)."""
    by_seq = defaultdict(list)
    for chunk in chunks:
        by_seq[chunk.seq_id].append(chunk)
    return {seq_id: sorted(rows, key=lambda c: c.start_pos)
            for seq_id, rows in by_seq.items() if len(rows) > 1}
