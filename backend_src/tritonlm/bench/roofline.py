"""How close a batch-1 decode step comes to the memory-bandwidth roofline: every weight is read
once per step, so a step cannot be faster than weight bytes ÷ memory bandwidth."""
import time

import torch

from tritonlm.bench.offline_runner import run_offline
from tritonlm.bench.workloads import fixed
from tritonlm.engine.llm_engine import LLMEngine


def copy_bandwidth(num_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes/s of a large tensor copy, counted as STREAM's copy does (bytes read + written)."""
    source = torch.ones(num_bytes // 4, dtype=torch.float32)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - start)
    return 2 * num_bytes / best


def weight_bytes_per_step(model: torch.nn.Module) -> int:
    """Bytes of every weight a decode step reads in full: parameters, buffers and CPU-prepacked
    weights. An embedding table is read one row per token, unless the output head is that
    table (tied) and has no prepacked copy of its own, which reads it all."""
    packed_head = getattr(model, "packed_head", None)
    tied_head = model.input_embeddings() if model.tie_word_embeddings else None
    tensors = [packed_head.data] if packed_head is not None else []
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding) and (module is not tied_head
                                                       or packed_head is not None):
            continue
        tensors += [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        if getattr(module, "packed", None) is not None:
            tensors.append(module.packed.data)
    return sum(t.numel() * t.element_size() for t in tensors)


def _kv_bytes_per_token(engine: LLMEngine) -> float:
    kv = engine.runner.kv_cache
    total = sum(t.numel() * t.element_size() for t in (kv.values, kv.scales) if t is not None)
    return total / (engine.runner.num_blocks * engine.config.block_size)


def measure(engine: LLMEngine, prompt_len: int = 128, output_len: int = 64) -> dict:
    """Batch-1 decode against the copy bandwidth."""
    model = engine.runner.model
    weights = weight_bytes_per_step(model)
    (record,), _ = run_offline(engine, fixed(1, prompt_len, output_len, engine.vocab_size, 11))
    step = record.tpot
    kv_per_token = _kv_bytes_per_token(engine)
    context = prompt_len + output_len / 2  # the mean context a step attends over
    bytes_per_step = weights + kv_per_token * context
    bandwidth = copy_bandwidth()
    return {"weight_bytes": weights, "kv_bytes_per_step": kv_per_token * context,
            "decode_step_ms": step * 1e3, "copy_bandwidth_gb_s": bandwidth / 1e9,
            "achieved_gb_s": bytes_per_step / step / 1e9,
            "roofline_step_ms": bytes_per_step / bandwidth * 1e3,
            "fraction_of_roofline": bytes_per_step / step / bandwidth}
