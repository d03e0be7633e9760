"""The fused Triton dequantize-and-matmul kernel against dequantize() + F.linear (in float32 on
the CPU): on the GPU where there is one (the tensor cores' rounding included), else on CPU tensors
by Triton's interpreter (which checks the kernel's indexing, masking, nibble order and group
gathers, not the tensor cores)."""
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import TRITON_DEVICE
from tritonlm.layers import triton_quant_matmul as tqm
from tritonlm.layers import triton_support
from tritonlm.layers.quantization import dequantize, pack_int4

# (bits, out features, in features, group size, act-order, asymmetric)
CASES = {
    "4bit-g32": (4, 72, 256, 32, False, True),
    "4bit-g128-short-last-group": (4, 100, 200, 128, False, True),
    "4bit-act-order": (4, 100, 256, 32, True, True),
    "8bit-per-channel-symmetric": (8, 72, 200, None, False, False),
}
# Relative to the output's RMS. fp32 differs from the reference only in summation order.
# fp16/bf16 round x, each dequantized weight and the output to the dtype (half an eps each);
# the weight errors are independent, so over K they add to about eps/2 * RMS, and ~4 eps
# leaves room for the output rounding and the tails of 10^3+ elements.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def make_quantized(bits, out_features, in_features, group_size, act_order, asymmetric, seed=0):
    gen = torch.Generator().manual_seed(seed)
    if group_size is None:
        g_idx = torch.zeros(in_features, dtype=torch.int32)
    else:
        g_idx = (torch.arange(in_features) // group_size).to(torch.int32)
        if act_order:
            g_idx = g_idx[torch.randperm(in_features, generator=gen)]
    groups = int(g_idx.max()) + 1
    if bits == 4:
        values = torch.randint(0, 16, (out_features, in_features), generator=gen)
        qweight = pack_int4(values)
    else:
        qweight = torch.randint(-128, 128, (out_features, in_features), generator=gen,
                                dtype=torch.int8)
    scales = torch.rand(out_features, groups, generator=gen) * 0.02 + 0.005
    biases = None
    if asymmetric:
        zeros = torch.randint(0, 2 ** bits, (out_features, groups), generator=gen)
        biases = -scales * zeros
    return qweight, scales, biases, g_idx


def on_triton_device(*args):
    """quantized_matmul of the CPU tensors `args` on TRITON_DEVICE, the result back on the CPU."""
    moved = [a.to(TRITON_DEVICE) if isinstance(a, torch.Tensor) else a for a in args]
    assert triton_support.available(moved[0].device)
    return tqm.quantized_matmul(*moved).cpu()


def reference(x, qweight, scales, biases, g_idx):
    weight = dequantize(qweight, scales, biases, g_idx, torch.float32)
    return F.linear(x.float(), weight)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("m", [1, 5, 33])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_dequantize_then_linear(case, m, dtype):
    qweight, scales, biases, g_idx = make_quantized(*CASES[case])
    x = torch.randn(m, g_idx.shape[0], generator=torch.Generator().manual_seed(1)).to(dtype)
    out = on_triton_device(x, qweight, scales, biases, g_idx)
    expected = reference(x, qweight, scales, biases, g_idx)
    assert out.dtype == dtype and out.shape == expected.shape
    tol = TOLERANCE[dtype]
    scale = expected.pow(2).mean().sqrt().item()
    torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol * scale)


def test_leading_dims_and_strided_input():
    qweight, scales, biases, g_idx = make_quantized(*CASES["4bit-act-order"])
    x = torch.randn(2, g_idx.shape[0], 3).transpose(1, 2)  # [2, 3, K], not contiguous
    out = tqm.quantized_matmul(*(t.to(TRITON_DEVICE) for t in (x, qweight, scales, biases, g_idx)))
    out = out.cpu()
    assert out.shape == (2, 3, qweight.shape[0])
    expected = reference(x, qweight, scales, biases, g_idx)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())


def test_wrong_shapes_raise_value_error():
    qweight, scales, biases, g_idx = make_quantized(*CASES["4bit-g32"])
    with pytest.raises(ValueError, match="x has 200 input features, the weight has 256"):
        tqm.quantized_matmul(torch.randn(4, 200), qweight, scales, biases, g_idx)
    with pytest.raises(ValueError, match="does not match g_idx"):
        tqm.quantized_matmul(torch.randn(4, 256), qweight[:, :100], scales, biases, g_idx)
    with pytest.raises(ValueError, match="biases"):
        tqm.quantized_matmul(torch.randn(4, 256), qweight, scales, biases[:, :2], g_idx)
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        tqm.quantized_matmul(torch.ones(4, 256, dtype=torch.int32), qweight, scales, biases,
                             g_idx)


def test_unavailable_without_triton(monkeypatch):
    triton_support.triton_modules.cache_clear()
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` now raises ImportError
    try:
        assert not triton_support.available(torch.device("cpu"))
        with pytest.raises(RuntimeError, match="cannot run"):
            tqm.quantized_matmul(torch.randn(1, 256), *make_quantized(*CASES["4bit-g32"]))
    finally:
        triton_support.triton_modules.cache_clear()
