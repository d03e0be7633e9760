"""dtype "auto": the weight dtype that runs fastest where the engine loads, settled before any
rank loads weights (and sent to the other ranks), so a repository converted once serves at the
right dtype on every host it is moved to.

- CUDA: the checkpoint's half dtype; a float32 checkpoint in bfloat16 where the GPU has it, else
  float16 (vLLM's rule).
- CPU: bfloat16 where this CPU multiplies bfloat16 weights with a packed kernel (tritonlm's on
  AVX2 + FMA, AVX512 or AMX; oneDNN's AVX512 or AMX one without them): a decode step reads half
  the bytes, and the kernels accumulate in float32. Elsewhere float32: PyTorch's generic bfloat16
  matmul runs under 1 GFLOPS.

quantized_activations "auto" likewise: int8 inputs for quantized weights where tritonlm's CPU
kernels are built without AVX512 or with AVX512-VNNI (measured faster on both: the float path
widens each weight to float32), else float (AVX512 without VNNI: the integer dots run in AVX2's
width there, 0.98-1.23x the float tiles for 4 bits and 0.68-1.06x for int8 on Cascade Lake).
"""
import logging

import torch

from tritonlm.config import DTYPES
from tritonlm.layers import cpu_gemm, cpu_kernels

logger = logging.getLogger(__name__)
HALF_DTYPES = ("bfloat16", "float16")


def resolve_dtype(requested: str, device: torch.device, hf_config) -> str:
    """The dtype to load weights in: `requested` unless it is "auto"; `hf_config` (the
    converted config.json) says what the weight files hold."""
    if requested != "auto":
        return requested
    stored = str(getattr(hf_config, "dtype", None)).removeprefix("torch.")
    dtype, reason = _choose(device, stored if stored in DTYPES else None)
    logger.info("dtype auto: %s (%s)", dtype, reason)
    return dtype


def _choose(device: torch.device, stored: str | None) -> tuple[str, str]:
    if device.type == "cuda":
        if stored in HALF_DTYPES:
            return stored, "the checkpoint's dtype"
        if torch.cuda.is_bf16_supported():
            return "bfloat16", f"{stored or 'a float32'} checkpoint on a GPU with bfloat16"
        return "float16", f"{stored or 'a float32'} checkpoint on a GPU without bfloat16"
    if device.type != "cpu":
        return stored or "float32", f"the checkpoint's dtype on {device.type}"
    backend = cpu_gemm.bf16_matmul_backend()
    if backend is None:
        return "float32", "this CPU has no packed bfloat16 matmul"
    return "bfloat16", f"bfloat16 weights multiplied by {backend}"


def resolve_int8_activations(requested: str, device: torch.device) -> bool:
    """Whether quantized weights multiply inputs quantized to int8 (quantized_activations; the CPU
    kernel does it for inputs of under quantized_paths.int8_rows rows)."""
    if requested != "auto":
        return requested == "int8"
    kernels = cpu_kernels.load() if device.type == "cpu" else None
    int8 = kernels is not None and (kernels.vector_lanes == 8 or kernels.has_vnni_dot_products)
    logger.info("quantized_activations auto: %s",
                ("int8 (AVX512-VNNI kernels)" if kernels.has_vnni_dot_products else
                 "int8 (AVX2 kernels)") if int8 else "float")
    return int8
