"""Quantized linear layers multiply with torch's fused CPU kernels where those take the layout,
and give what a matmul on the dequantized weight gives; other layouts dequantize per matmul."""
import pytest
import torch
import torch.nn.functional as F

from tritonlm.layers import cpu_kernels
from tritonlm.layers.quantization import QuantizedWeight, dequantize, pack_int4
from tritonlm.layers.quantized_matmul import Int4Groups, Int8PairBlocks

OUT, IN = 80, 224  # int4 groups of 64 and 128 leave a shorter last group


def storage(bits: int, group_size: int, act_order: bool = False, biases: bool = True,
            rows: int = OUT) -> QuantizedWeight:
    """A QuantizedWeight holding random values, scales and biases."""
    groups = -(-IN // group_size)
    layer = QuantizedWeight(rows, IN, bits, groups, biases, None)
    if bits == 4:
        layer.qweight.data = pack_int4(torch.randint(0, 16, (rows, IN)))
    else:
        layer.qweight.data = torch.randint(-127, 128, (rows, IN), dtype=torch.int8)
    layer.scales.data = torch.rand(rows, groups) * 0.02 + 0.001
    if biases:
        layer.biases.data = torch.randn(rows, groups) * 0.1
    g_idx = torch.arange(IN) // group_size
    layer.g_idx.data = (g_idx[torch.randperm(IN)] if act_order else g_idx).to(torch.int32)
    return layer


def reference(layer: QuantizedWeight, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    weight = dequantize(layer.qweight, layer.scales, layer.biases, layer.g_idx, torch.float32)
    return F.linear(x.float(), weight, bias)


FUSED = {  # name -> (bits, group size, act-order, biases)
    "int4-g32": (4, 32, False, True),
    "int4-g128-act-order": (4, 128, True, True),
    "int4-g64-symmetric": (4, 64, False, False),
    "int8-per-row": (8, IN, False, False),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", FUSED)
def test_fused_cpu_kernels_equal_the_dequantized_matmul(layout, dtype):
    torch.manual_seed(0)
    layer = storage(*FUSED[layout])
    x, bias = torch.randn(2, 5, IN), torch.randn(OUT)
    expected = reference(layer, x, bias)
    got = layer.matmul(x.to(dtype), bias.to(dtype))
    assert layer.fused is not None and got.dtype == dtype and got.shape == (2, 5, OUT)
    # bfloat16: the input and the weight are rounded to 8 bits of mantissa before multiplying.
    tolerance = 1e-5 if dtype == torch.float32 else 2 ** -7 * expected.abs().max().item()
    torch.testing.assert_close(got.float(), expected, atol=tolerance, rtol=1e-4)


def test_fused_int4_holds_the_only_copy_of_the_weight():
    layer = storage(4, 32)
    layer.matmul(torch.randn(3, IN), None)
    assert isinstance(layer.fused, Int4Groups)
    assert layer.qweight.numel() == 0 and layer.scales is None and layer.biases is None
    assert layer.fused.packed.numel() * layer.fused.packed.element_size() == OUT * IN // 2
    assert layer.fused.padding == 0


@pytest.mark.parametrize("bits,group_size,rows", [(4, 48, OUT), (4, 32, 72), (4, 96, OUT),
                                                   (8, 32, OUT)])
def test_other_layouts_dequantize_for_each_matmul(bits, group_size, rows):
    torch.manual_seed(0)
    layer = storage(bits, group_size, biases=bits == 4, rows=rows)
    x = torch.randn(4, IN)
    expected = reference(layer, x, None)
    got = layer.matmul(x, None)
    assert layer.fused is None
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not getattr(cpu_kernels.load(), "has_bf16_matmul", False),
                    reason="no AVX2 + FMA: torch's int8 kernel runs")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 13, 200])
@pytest.mark.parametrize("out_features,in_features", [(50, 33), (96, 224), (7, 1)])
def test_int8_rows_run_our_packed_kernel_for_any_shape(dtype, rows, out_features, in_features):
    """Rows around the kernel's row tiles (3 or 12) and 192-row chunks, features short of its
    32-column blocks, odd inputs (the last one pairs with padding); the packed copy replaces the
    storage."""
    torch.manual_seed(rows + in_features)
    layer = QuantizedWeight(out_features, in_features, 8, 1, False, None)
    layer.qweight.data = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8)
    layer.scales.data = torch.rand(out_features, 1) * 0.02 + 0.001
    layer.g_idx.data = torch.zeros(in_features, dtype=torch.int32)
    x = torch.randn(rows, in_features + 2)[:, 1:1 + in_features]  # rows with a stride
    expected = reference(layer, x, None)
    got = layer.matmul(x.to(dtype), None)
    assert isinstance(layer.fused, Int8PairBlocks) and layer.qweight.numel() == 0
    assert got.dtype == dtype and got.shape == (rows, out_features)
    tolerance = 1e-5 if dtype == torch.float32 else 2 ** -7 * expected.abs().max().item()
    torch.testing.assert_close(got.float(), expected, atol=tolerance, rtol=1e-4)
