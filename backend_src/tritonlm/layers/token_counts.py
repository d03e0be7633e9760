"""Token history of the sequences that use penalties, kept on the device and updated from the
tokens each step computes (so chunked prefill and recompute after preemption stay consistent)."""
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
            row = self.rows.pop(seq_id, None)
            if row is not None:
                self.free_rows.append(row)

    def record(self, chunks) -> None:
        """Count the tokens of this step's chunks for the sequences that track them."""
        tracked = [c for c in chunks if c.track_tokens]
        if not tracked:
            return
        rows = np.array([self._row(c.seq_id) for c in tracked], dtype=np.int64)
        # A chunk may bring the tokens before it (history) when earlier KV was reused.
        firsts = [c.start_pos - len(c.history) for c in tracked]
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

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device)

    def history(self, seq_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(seen in prompt or output, output counts) as [len(seq_ids), V]; zeros if untracked."""
        seen = torch.zeros((len(seq_ids), self.vocab_size), dtype=torch.bool, device=self.device)
        counts = torch.zeros((len(seq_ids), self.vocab_size), dtype=torch.int32, device=self.device)
        index = [i for i, s in enumerate(seq_ids) if s in self.rows]
        if index:
            rows = [self.rows[seq_ids[i]] for i in index]
            counts[index] = self.output_counts[rows]
            seen[index] = self.prompt_seen[rows] | (counts[index] > 0)
        return seen, counts
