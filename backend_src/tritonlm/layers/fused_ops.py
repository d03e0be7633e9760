"""The fused per-token layer ops (RMSNorm with its residual add, activation-times-up, rotary in
place, the K/V cache write, greedy argmax with its log-normaliser) for a tensor's device: the C++
kernels on CPU (csrc/fused_ops.cpp, kv_cache_write.cpp), the OpenAI-Triton ones on CUDA
(triton_fused_ops.py). Both take the same arguments and round alike, so a layer calls either."""
import torch

from tritonlm.layers import cpu_kernels, triton_fused_ops, triton_support


def for_tensor(x: torch.Tensor):
    """The kernels that can take x (a float tensor), or None where neither set runs (the C++
    extension not built, Triton not installed): the layer's PyTorch path."""
    if x.device.type == "cuda":
        usable = triton_support.available(x.device) and x.dtype in triton_fused_ops.FLOAT_DTYPES
        return triton_fused_ops if usable else None
    return cpu_kernels.for_tensor(x)
