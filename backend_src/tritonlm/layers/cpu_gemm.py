"""CPU matmuls on weights prepacked once into oneDNN's blocked layout: F.linear on a plain
[out, in] weight reorders it on every call, which costs as much as the small-batch matmul itself."""
import torch

_LOW_PRECISION = (torch.bfloat16,)


def can_prepack(weight: torch.Tensor) -> bool:
    """oneDNN prepacking pays off for bfloat16 on CPUs with native bf16 dot products (AVX512-BF16,
    AMX); float32 keeps MKL's own path, which is as fast."""
    return (weight.device.type == "cpu" and weight.dtype in _LOW_PRECISION
            and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def prepack(weight: torch.Tensor, batch_hint: int) -> torch.Tensor:
    """`weight` [out, in] in oneDNN's layout for inputs of about `batch_hint` rows (any row
    count works)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
                  ) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
