"""OpenAI Triton for our kernels (triton_quant_matmul.py, triton_paged_attention.py): optional,
imported on first use. The kernels run on CUDA, and under TRITON_INTERPRET=1 on CPU tensors too
(that is how the tests run them)."""
import functools
import os

import torch


@functools.cache
def triton_modules():
    """(triton, triton.language), or None when Triton is not installed."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None
    return triton, tl


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def available(device: torch.device) -> bool:
    return triton_modules() is not None and (torch.device(device).type == "cuda" or interpreting())
