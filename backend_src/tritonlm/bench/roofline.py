"""Both limits of a run: how close a batch-1 decode step comes to the memory-bandwidth roofline
(every weight is read once per step, so a step cannot be faster than weight bytes ÷ memory
bandwidth), and the matmul FLOPs a workload needs against the measured matmul peak (CPU: float32;
GPU: the model's dtype), both measured on the engine's device."""
import time

import torch
from torch import nn

from tritonlm.bench.offline_runner import run_offline
from tritonlm.bench.workloads import fixed
from tritonlm.engine.llm_engine import LLMEngine


def _best_seconds(run, device: torch.device, repeats: int) -> float:
    """The fastest of `repeats` timed calls of `run` after one untimed (device work waited for)."""
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    run()
    best = float("inf")
    for _ in range(repeats):
        synchronize()
        start = time.perf_counter()
        run()
        synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def copy_bandwidth(device: torch.device = torch.device("cpu"), repeats: int = 5) -> float:
    """Bytes/s of a large tensor copy on `device` (1 GiB on CPU, 4 GiB on a GPU: several times
    its cache), counted as STREAM's copy does (bytes read + written)."""
    num_bytes = 4 << 30 if device.type == "cuda" else 1 << 30
    source = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    target = torch.empty_like(source)
    return 2 * num_bytes / _best_seconds(lambda: target.copy_(source), device, repeats)


def matmul_peak_flops(device: torch.device = torch.device("cpu"),
                      dtype: torch.dtype = torch.float32, repeats: int = 5) -> float:
    """FLOP/s of a large matmul: on CPU float32 (MKL) on every thread torch uses, the FMA peak a
    workload's matmuls can reach; on a GPU in the model's dtype (the tensor cores')."""
    size = 8192 if device.type == "cuda" else 2048
    a, b = (torch.randn(size, size, device=device).to(dtype) for _ in range(2))
    return 2 * size ** 3 / _best_seconds(lambda: torch.mm(a, b), device, repeats)


def matmul_flops_per_token(model: nn.Module) -> tuple[int, int]:
    """FLOPs (2 per multiply-add) of one token through the linear layers of one rank, and through
    the output head (a prompt's tokens but its last skip the head). Attention's products over the
    context are not counted."""
    head = model.output_head()
    body = sum(m.in_features * m.out_features for m in model.modules()
               if isinstance(m, nn.Linear) and m is not head)
    head_size = (head.in_features * head.out_features if isinstance(head, nn.Linear)
                 else head.weight.numel())  # the tied embedding
    return 2 * body, 2 * head_size


def workload_flops(roofline: dict, run: dict) -> dict:
    """The matmul FLOPs of a timed run (`metrics.summarize`'s) against the measured peak."""
    tokens = run["input_tokens"] + run["output_tokens"]
    flops = roofline["body_flops_per_token"] * tokens + roofline["head_flops_per_token"] * (
        run["output_tokens"])
    achieved = flops / run["duration_s"]
    return {"flops": flops, "achieved_gflops": achieved / 1e9,
            "fraction_of_peak": achieved / roofline["matmul_peak_flops"]}


def weight_bytes_per_step(model: torch.nn.Module) -> int:
    """Bytes of every weight a decode step reads in full: parameters, buffers and CPU-prepacked
    weights. An embedding table is read one row per token, unless the output head is that
    table (tied) and has no prepacked copy of its own, which reads it all."""
    packed_head = getattr(model, "packed_head", None)
    tied_head = model.output_head() if model.output_head() is model.input_embeddings() else None
    tensors = [packed_head.data] if packed_head is not None else []
    looked_up = {inner for module in model.modules() if isinstance(module, torch.nn.Embedding)
                 and (module is not tied_head or packed_head is not None) for inner in module.modules()}
    for module in model.modules():
        if module in looked_up:
            continue
        tensors += [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        if getattr(module, "packed", None) is not None:
            tensors.append(module.packed.data)
    return sum(t.numel() * t.element_size() for t in tensors)


def _kv_bytes_per_token(engine: LLMEngine) -> float:
    kv = engine.runner.kv_cache
    total = sum(t.numel() * t.element_size() for t in (kv.values, kv.scales) if t is not None)
    return total / (engine.runner.num_blocks * engine.config.block_size)


def measure(engine: LLMEngine, prompt_len: int = 128, output_len: int = 64,
            repeats: int = 3) -> dict:
    """Batch-1 decode against the copy bandwidth (the best of `repeats` requests: the first
    step of a batch size records its CPU op program, and a shared host's speed drifts), and what
    a workload's FLOPs are measured by."""
    model = engine.runner.model
    weights = weight_bytes_per_step(model)
    step = min(run_offline(engine, fixed(1, prompt_len, output_len, engine.vocab_size, seed))[0][0]
               .tpot for seed in range(11, 11 + repeats))
    kv_per_token = _kv_bytes_per_token(engine)
    context = prompt_len + output_len / 2  # the mean context a step attends over
    bytes_per_step = weights + kv_per_token * context
    device = engine.runner.device
    bandwidth = copy_bandwidth(device)
    body_flops, head_flops = matmul_flops_per_token(model)
    return {"weight_bytes": weights, "kv_bytes_per_step": kv_per_token * context,
            "decode_step_ms": step * 1e3, "copy_bandwidth_gb_s": bandwidth / 1e9,
            "achieved_gb_s": bytes_per_step / step / 1e9,
            "roofline_step_ms": bytes_per_step / bandwidth * 1e3,
            "fraction_of_roofline": bytes_per_step / step / bandwidth,
            "matmul_peak_flops": matmul_peak_flops(
                device, engine.runner.dtype if device.type == "cuda" else torch.float32),
            "body_flops_per_token": body_flops,
            "head_flops_per_token": head_flops}
