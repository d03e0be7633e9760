"""A step's per-row sampling parameters as the sampler's tensors (layers/sampler.py)."""
import dataclasses

import torch

from tritonlm.engine.structured_output import GrammarMatchers
from tritonlm.layers.sampler import SamplingTensors
from tritonlm.layers.token_counts import TokenCounts, verifications
from tritonlm.watermark import GreenLists

_FLOAT_PARAMS = ("temperature", "top_p", "min_p", "typical_p", "repetition_penalty",
                 "presence_penalty", "frequency_penalty")


class SamplingInputs:
    def __init__(self, token_counts: TokenCounts, watermark_gamma: float,
                 watermark_delta: float, device: torch.device):
        self.token_counts = token_counts
        self.watermark_gamma, self.watermark_delta = watermark_gamma, watermark_delta
        self.device = device
        self.green_lists: GreenLists | None = None  # made on the first watermarked request
        self.matchers: GrammarMatchers | None = None  # the engine's (the driver's runner only)
        self._greedy: dict[int, SamplingTensors] = {}  # by row count (see build)

    def build(self, chunks, vocab_size: int) -> SamplingTensors:
        """The tensors of the sampling `chunks` (one row each) over logits of `vocab_size`."""
        if all(_takes_the_argmax(c) for c in chunks):
            # The sampler reads none of these rows' values (its one-pass argmax), so their
            # tensors are made once per row count (Zen 4: 57 -> 4 us a 1-row step).
            greedy = self._greedy.get(len(chunks))
            if greedy is None:
                greedy = self._greedy[len(chunks)] = self._build(chunks, vocab_size)
            num_logprobs = max(c.sampling.params.logprobs or 0 for c in chunks)
            return dataclasses.replace(greedy, num_logprobs=num_logprobs)
        return self._build(chunks, vocab_size)

    def _build(self, chunks, vocab_size: int) -> SamplingTensors:
        rows = [c.sampling for c in chunks]
        # One host-to-device copy per dtype: on a GPU each copy costs the host a transfer call.
        floats = torch.tensor([[getattr(r.params, name) for r in rows] for name in _FLOAT_PARAMS],
                              dtype=torch.float32)
        ints = torch.tensor([[r.params.top_k for r in rows], [r.seed for r in rows],
                             [r.output_index for r in rows]], dtype=torch.int64)
        bans = torch.tensor([(i, t) for i, r in enumerate(rows) for t in r.banned],
                            dtype=torch.int64).reshape(-1, 2).T.contiguous()  # rows, tokens
        host = dict(zip(_FLOAT_PARAMS, floats))
        truncating = ((ints[0] > 0) | (host["top_p"] < 1) | (host["min_p"] > 0)
                      | (host["typical_p"] < 1))
        floats, ints, bans = (t.to(self.device) for t in (floats, ints, bans))
        tensors = SamplingTensors(
            **dict(zip(_FLOAT_PARAMS, floats)), top_k=ints[0], seeds=ints[1], steps=ints[2],
            num_logprobs=max(r.params.logprobs or 0 for r in rows),
            banned_rows=bans[0], banned_tokens=bans[1],
            **self._bias_tensors(rows),
            all_greedy=bool((host["temperature"] == 0).all()),
            needs_truncation=bool(truncating.any()))
        if any(c.track_tokens for c in chunks):
            tensors.seen, tensors.output_counts = self.token_counts.history(chunks)
        self._add_watermark(tensors, chunks, vocab_size)
        self._add_token_bitmask(tensors, chunks)
        return tensors

    def _add_token_bitmask(self, tensors: SamplingTensors, chunks) -> None:
        """The grammar masks of the constrained rows, filled in one batched call (a
        verification's rows: each after the proposals before it)."""
        rows = [i for i, c in enumerate(chunks) if c.sampling.params.constraint is not None]
        if not rows:
            return
        tensors.bitmask_rows = torch.tensor(rows, dtype=torch.int64, device=self.device)
        before = {id(row): [c.token_ids[0] for c in verification[1:j + 1]]
                  for verification in verifications([chunks[i] for i in rows]).values()
                  for j, row in enumerate(verification)}
        bitmask = self.matchers.token_bitmask(
            [(chunks[i].seq_id, before.get(id(chunks[i]), [])) for i in rows])
        tensors.token_bitmask = bitmask.to(self.device)

    def _add_watermark(self, tensors: SamplingTensors, chunks, vocab_size: int) -> None:
        """The green lists of the rows that ask for the watermark, each seeded by the token
        before the one sampled: the chunk's last (a prompt's last token, or the decode input)."""
        rows = [i for i, c in enumerate(chunks) if c.sampling.params.watermark]
        if not rows:
            return
        if self.green_lists is None:
            self.green_lists = GreenLists(vocab_size, self.watermark_gamma, self.device)
        tensors.watermark_rows = torch.tensor(rows, dtype=torch.int64, device=self.device)
        tensors.green_lists = self.green_lists.masks_for([chunks[i].token_ids[-1] for i in rows])
        tensors.watermark_delta = self.watermark_delta

    def _bias_tensors(self, rows) -> dict:
        """logit_bias as (row, token, value) index tensors; none when no row has a bias."""
        if not any(r.params.logit_bias for r in rows):
            return {}
        entries = [(i, token, value) for i, r in enumerate(rows)
                   for token, value in r.params.logit_bias.items()]
        row_ids, tokens, values = zip(*entries)
        return {"bias_rows": torch.tensor(row_ids, dtype=torch.int64, device=self.device),
                "bias_tokens": torch.tensor(tokens, dtype=torch.int64, device=self.device),
                "bias_values": torch.tensor(values, dtype=torch.float32, device=self.device)}


def _takes_the_argmax(chunk) -> bool:
    """Greedy on the model's own logits: nothing banned, biased, watermarked, constrained or
    penalised (the token history a penalty needs is tracked exactly for those)."""
    row, params = chunk.sampling, chunk.sampling.params
    return (params.temperature == 0 and not row.banned and not params.logit_bias
            and not params.watermark and params.constraint is None and not chunk.track_tokens)
