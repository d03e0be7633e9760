"""How much memory the KV cache gets. On CPU: kv_cache_memory. On CUDA (vLLM's
--gpu-memory-utilization): the instance may use that fraction of the GPU for everything, so the
cache gets what is left of it after the weights, the peak of the largest steps the scheduler can
plan (run once on a temporary cache to measure it) and what CUDA, cuBLAS and NCCL hold outside
torch's allocator."""
import logging
from collections.abc import Callable

import torch

from tritonlm.engine.step_plan import SamplingRow, ScheduledChunk, StepPlan
from tritonlm.sampling_params import MAX_LOGPROBS, SamplingParams

logger = logging.getLogger(__name__)
GIB = 1 << 30

# The costliest sampling a row can ask for: truncation (sorts over the vocabulary), penalties
# (per-sequence token counts), a logit bias and the most logprobs (prompt logprobs too).
_PROFILE_SAMPLING = SamplingRow(
    SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.01, typical_p=0.95,
                   repetition_penalty=1.1, presence_penalty=0.1, frequency_penalty=0.1,
                   logprobs=MAX_LOGPROBS, prompt_logprobs=MAX_LOGPROBS, logit_bias={0: 1.0}),
    seed=0, output_index=0, banned=())


def cuda_kv_cache_budget(total: int, free_at_start: int, free_now: int, reserved_now: int,
                         peak_reserved: int, utilization: float, graph_bytes: int = 0) -> int:
    """Bytes for the KV cache: `utilization` of the GPU's `total` memory, less the peak torch
    reserved (weights and the profiled steps), what this process holds outside torch's allocator
    (what it took since it started, `free_at_start - free_now`, beyond torch's `reserved_now`) and
    what the decode step's CUDA graphs will hold (`graph_bytes`)."""
    requested = int(total * utilization)
    if requested > free_at_start:
        raise ValueError(
            f"gpu_memory_utilization {utilization} asks for {requested / GIB:.2f} GiB but only "
            f"{free_at_start / GIB:.2f} of {total / GIB:.2f} GiB were free when the engine started "
            f"(other processes hold the rest); lower gpu_memory_utilization")
    outside_torch = max(0, free_at_start - free_now - reserved_now)
    budget = requested - peak_reserved - outside_torch - graph_bytes
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization {utilization} ({requested / GIB:.2f} GiB) leaves nothing for "
            f"the KV cache: the weights and the largest step peak at {peak_reserved / GIB:.2f} "
            f"GiB, {outside_torch / GIB:.2f} GiB is held outside torch and the CUDA graphs take "
            f"{graph_bytes / GIB:.2f} GiB; raise it, or lower max_num_batched_tokens or "
            f"max_num_seqs")
    return budget


def measured_cuda_budget(device: torch.device, free_at_start: int, utilization: float,
                         profile: Callable[[], int], graph_bytes: Callable[[], int]) -> int:
    """cuda_kv_cache_budget from measurements: the peak torch reserves while `profile` runs the
    largest steps (on a temporary cache: it returns that cache's bytes) and what the decode graphs
    will hold (`graph_bytes`, measured after it)."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    cache_bytes = profile()
    torch.cuda.synchronize(device)
    # Reserved, not allocated: what the driver counts, the allocator's rounding and fragmentation
    # included.
    peak = torch.cuda.max_memory_reserved(device) - cache_bytes
    torch.cuda.empty_cache()
    free_now, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    graphs = graph_bytes()
    budget = cuda_kv_cache_budget(total, free_at_start, free_now, reserved, peak, utilization,
                                  graphs)
    logger.info(
        "KV cache sizing: GPU %.2f GiB, %.2f free at start, %.2f free now; torch holds %.2f "
        "(%.2f allocated), peaked at %.2f in the profile steps besides their %.2f GiB cache; "
        "decode graphs %.2f GiB; cache budget %.2f GiB", total / GIB, free_at_start / GIB,
        free_now / GIB, reserved / GIB, torch.cuda.memory_allocated(device) / GIB, peak / GIB,
        cache_bytes / GIB, graphs / GIB, budget / GIB)
    return budget


def most_blocks_in_use(num_seqs: int, max_len: int, block_size: int, lookahead: int = 0,
                       encoder_decoder: bool = False) -> int:
    """The most KV blocks `num_seqs` running sequences can hold at once: each at its longest
    (`max_len` tokens and a speculation step's `lookahead` slots) and, for an encoder-decoder, as
    many again for its encoder's K/V. A larger cache would only keep freed prefixes longer."""
    per_seq = -(-(max_len + lookahead) // block_size)
    return num_seqs * per_seq * (2 if encoder_decoder else 1)


def profile_steps(max_num_batched_tokens: int, max_model_len: int, max_num_seqs: int,
                  block_size: int, encoder_decoder: bool = False) -> tuple[list[StepPlan], int]:
    """The two largest steps the scheduler can plan, and the KV blocks they need: a prefill of
    max_num_batched_tokens tokens (prompts of at most max_model_len), then a decode of as many
    sequences as may run at once; every row samples with the costliest settings, and prompts
    compute prompt logprobs. Encoder-decoder rows encode their prompt too (their cross-attention
    K/V take blocks of their own)."""
    lengths = [min(max_model_len, max_num_batched_tokens - start)
               for start in range(0, max_num_batched_tokens, max_model_len)][:max_num_seqs]
    decodes = min(max_num_seqs, max_num_batched_tokens)
    next_block = 0

    def take(count: int) -> list[int]:
        nonlocal next_block
        next_block += count
        return list(range(next_block - count, next_block))

    def chunk(seq_id: int, length: int, decode: bool) -> ScheduledChunk:
        """A prompt of `length` tokens, or (decode) one token after such a prompt."""
        blocks = -(-(length + decode) // block_size)
        cross = {}
        if encoder_decoder:
            cross = {"encoder_token_ids": None if decode else [0] * length,
                     "encoder_len": length, "cross_block_table": take(blocks)}
        prompt_logprobs = {} if decode or encoder_decoder else {
            "prompt_targets": [0] * (length - 1), "num_prompt_logprobs": MAX_LOGPROBS}
        return ScheduledChunk(seq_id, [0] * (1 if decode else length), length if decode else 0,
                              take(blocks), _PROFILE_SAMPLING, length, True,
                              history=[0] * length if decode else [], **cross, **prompt_logprobs)

    prefill = StepPlan([chunk(i, n, False) for i, n in enumerate(lengths)])
    decode = StepPlan([chunk(len(lengths) + i, 1, True) for i in range(decodes)],
                      finished_seq_ids=list(range(len(lengths))))
    return [prefill, decode], next_block
