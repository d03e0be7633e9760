"""prompt_logprobs: the logprob of every prompt token given the ones before it, and the top
alternatives, for the chunks whose request asked. Only their positions go through the LM head;
other chunks keep computing their last position's logits alone, in the sampler."""
import numpy as np
import torch

from tritonlm.engine.step_plan import SampledToken, ScheduledChunk

_ROWS_PER_PASS = 256  # positions per LM-head pass: bounds the [rows, vocab] float32 logits


def prompt_logprobs(model, chunks: list[ScheduledChunk],
                    hidden: torch.Tensor) -> dict[int, list[SampledToken]]:
    """seq_id -> one entry per prompt_targets token of its chunk; `hidden` holds the step's
    tokens in chunk order."""
    asking = [i for i, c in enumerate(chunks) if c.prompt_targets]
    if not asking:
        return {}
    lens = np.array([len(c.token_ids) for c in chunks], dtype=np.int64)
    chunks = [chunks[i] for i in asking]
    counts = np.array([len(c.prompt_targets) for c in chunks], dtype=np.int64)
    first = (np.cumsum(lens) - lens)[asking]  # each chunk's first row of `hidden`
    rows = np.repeat(first - (np.cumsum(counts) - counts), counts) + np.arange(counts.sum())
    rows = torch.from_numpy(rows).to(hidden.device)
    targets = torch.tensor([t for c in chunks for t in c.prompt_targets], device=hidden.device)
    k = max(c.num_prompt_logprobs for c in chunks)
    chosen, top_ids, top_logprobs = [], [], []
    for start in range(0, len(rows), _ROWS_PER_PASS):
        part = slice(start, start + _ROWS_PER_PASS)
        logprobs = torch.log_softmax(model.compute_logits(hidden[rows[part]]).float(), dim=-1)
        chosen.append(logprobs.gather(-1, targets[part, None]).squeeze(-1))
        values, ids = logprobs.topk(k, dim=-1)
        top_ids.append(ids)
        top_logprobs.append(values)
    chosen = torch.cat(chosen).tolist()
    top_ids, top_logprobs = torch.cat(top_ids).tolist(), torch.cat(top_logprobs).tolist()
    results, row = {}, 0
    for chunk in chunks:  # per token: the entries are Python objects anyway
        n = chunk.num_prompt_logprobs
        results[chunk.seq_id] = [
            SampledToken(token, chosen[r], list(zip(top_ids[r][:n], top_logprobs[r][:n])))
            for r, token in enumerate(chunk.prompt_targets, row)]
        row += len(chunk.prompt_targets)
    return results
