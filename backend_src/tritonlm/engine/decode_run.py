"""Sampled tokens from the device to the plan's results, speculative verification as decode
rows, and decode runs: a plan of several decode steps in a row (StepPlan.num_steps), each step's
input the token the step before sampled on the device. The host queues every step before it
reads any token, so the device goes from one step to the next without waiting for the host to
schedule, sample and fill inputs in between (what vLLM's multi-step scheduling does); the host
reads all the run's tokens at once after."""
import dataclasses
from collections.abc import Callable

import torch

from tritonlm.engine.decode_graphs import DecodeGraphs
from tritonlm.engine.sampling_inputs import SamplingInputs
from tritonlm.engine.step_plan import SampledToken, ScheduledChunk, StepPlan
from tritonlm.layers.sampler import SamplerOutput, sample

# The steps of a run on CUDA when engine.json leaves num_scheduler_steps unset: enough to hide
# the host's share of a step (~1.5 ms against a 4-6 ms 8B decode step on an H100 / H200) while a
# request arriving meanwhile waits at most this many steps to join.
CUDA_DECODE_RUN = 8


def decode_run(graphs: DecodeGraphs, model, sampling_inputs: SamplingInputs,
               chunks: list[ScheduledChunk], num_steps: int) -> list[SamplerOutput]:
    """The sampler's outputs of `num_steps` decode steps of `chunks` (decodes that all sample,
    whose KV slots for every step the scheduler gave), queued without reading one back."""
    outputs, tensors, tokens = [], None, None
    for step in range(num_steps):
        logits = model.compute_logits(graphs.run(chunks, step, tokens))
        if tensors is None:
            tensors = sampling_inputs.build(chunks, logits.shape[-1])
        else:  # the next output index: the noise of sampled rows moves on with it
            tensors = dataclasses.replace(tensors, steps=tensors.steps + 1)
        outputs.append(sample(logits, tensors))
        tokens = outputs[-1].tokens
    return outputs


def greedy_run(graphs: DecodeGraphs, greedy_head: Callable[[torch.Tensor], torch.Tensor],
               chunks: list[ScheduledChunk], num_steps: int) -> torch.Tensor:
    """[num_steps, len(chunks)]: a decode run's greedy tokens (`greedy_head`: hidden states ->
    tokens), for rows that need no sampling tensors (a draft model's: no logprobs), each step's
    the next one's input."""
    steps, tokens = [], None
    for step in range(num_steps):
        tokens = greedy_head(graphs.run(chunks, step, tokens))
        steps.append(tokens)
    return torch.stack(steps)


def verification_plan(plan: StepPlan) -> tuple[StepPlan, list[int]]:
    """`plan` with each chunk that ends in k draft tokens (a decode: 1 + k tokens) as 1 + k
    decode rows sharing its block table, row j sampled at output index + j: the same kernels
    (decode graphs included) and draws as decoding them one by one; and each chunk's position
    among its chunk's rows (sampled_tokens' `positions`). Every row writes its K/V before any
    attends, and row j attends to the keys up to its own."""
    if not any(c.num_draft_tokens for c in plan.chunks):
        return plan, [0] * len(plan.chunks)
    chunks, positions = [], []
    for chunk in plan.chunks:
        if not chunk.num_draft_tokens:
            chunks.append(chunk)
            positions.append(0)
            continue
        chunks += [dataclasses.replace(
            chunk, token_ids=[token], start_pos=chunk.start_pos + j, num_draft_tokens=0,
            draft_banned=(), sampling=dataclasses.replace(
                chunk.sampling, output_index=chunk.sampling.output_index + j,
                banned=chunk.draft_banned[j - 1] if j and chunk.draft_banned
                else chunk.sampling.banned))
            for j, token in enumerate(chunk.token_ids)]
        positions += range(len(chunk.token_ids))
    return dataclasses.replace(plan, chunks=chunks), positions


def sampled_tokens(chunks: list[ScheduledChunk], outputs: list[SamplerOutput],
                   positions: list[int] | None = None) -> list[dict[int, SampledToken]]:
    """Per step, each sampling chunk's token, its logprob and the top alternatives it asked for,
    read from the device in one transfer of each kind. `positions` (verification_plan's): rows
    sampled after a draft token go to the dicts of later steps."""
    tokens = torch.stack([o.tokens for o in outputs]).tolist()
    logprobs = torch.stack([o.logprobs for o in outputs]).tolist()
    top_ids = torch.stack([o.top_ids for o in outputs]).tolist()
    top_logprobs = torch.stack([o.top_logprobs for o in outputs]).tolist()
    counts = [c.sampling.params.logprobs or 0 for c in chunks]
    positions = positions or [0] * len(chunks)
    steps = [{} for _ in range(len(outputs) + max(positions, default=0))]
    for s in range(len(outputs)):
        for i, (chunk, n, position) in enumerate(zip(chunks, counts, positions)):
            steps[s + position][chunk.seq_id] = SampledToken(
                tokens[s][i], logprobs[s][i], list(zip(top_ids[s][i][:n], top_logprobs[s][i][:n])))
    return steps
