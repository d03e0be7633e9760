"""Quantized linear layers multiply with a fused CPU kernel where one takes the layout (ours with
AVX2 or AVX512, else torch's), and give what a matmul on the dequantized weight gives; other
layouts dequantize per matmul."""
import pytest
import torch
import torch.nn.functional as F

from tritonlm.layers import cpu_gemm, cpu_kernels, fused_ops, quantized_paths
from tritonlm.layers.mlp import GatedMLP
from tritonlm.layers.quantization import QuantizedWeight, dequantize, integer_values, pack_int4
from tritonlm.layers.quantized_matmul import ROW_GROUP_SIZE, Int4Groups, PairBlocks
from tritonlm.layers.quantized_paths import int8_rows

OUT, IN = 80, 224  # int4 groups of 64 and 128 leave a shorter last group
OURS = getattr(cpu_kernels.load(), "has_bf16_matmul", False)  # else torch's kernels run


def random_storage(out_features: int, in_features: int, bits: int, group_size: int | None,
                   act_order: bool, biases: bool, half: bool, gated: bool = False
                   ) -> QuantizedWeight:
    """A QuantizedWeight of random values, scales and biases (in float16 precision if `half`)."""
    group_size = group_size or in_features
    groups = -(-in_features // group_size)
    layer = QuantizedWeight(out_features, in_features, bits, groups, biases, None, gated)
    if bits == 4:
        layer.qweight.data = pack_int4(torch.randint(0, 16, (out_features, in_features)))
    else:
        layer.qweight.data = torch.randint(-127, 128, (out_features, in_features),
                                           dtype=torch.int8)
    precision = (lambda t: t.half().float()) if half else (lambda t: t)
    layer.scales.data = precision(torch.rand(out_features, groups) * 0.02 + 0.001)
    if biases:
        layer.biases.data = precision(torch.randn(out_features, groups) * 0.1)
    g_idx = torch.arange(in_features) // group_size
    layer.g_idx.data = (g_idx[torch.randperm(in_features)] if act_order else g_idx).int()
    return layer


def storage(bits: int, group_size: int, act_order: bool = False, biases: bool = True,
            rows: int = OUT) -> QuantizedWeight:
    """random_storage of IN input features, its parameters in float32."""
    return random_storage(rows, IN, bits, group_size, act_order, biases, half=False)


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
    weight = dequantize(layer.qweight, layer.scales, layer.biases, layer.g_idx, torch.float64)
    got = layer.matmul(x.to(dtype), bias.to(dtype))
    assert layer.fused is not None and got.dtype == dtype and got.shape == (2, 5, OUT)
    if dtype == torch.float32:  # sums of IN float32 terms, rounded in another order than MKL's:
        # within sqrt(IN) roundings of the terms' magnitude
        magnitude = F.linear(x.abs().double(), weight.abs()) + bias.abs().double()
        error = (got.double() - F.linear(x.double(), weight, bias.double())).abs()
        assert (error <= 2 * IN ** 0.5 * 2 ** -24 * magnitude).all(), error.max()
    else:  # the input and the weight are rounded to 8 bits of mantissa before multiplying
        torch.testing.assert_close(got.float(), expected, rtol=1e-4,
                                   atol=2 ** -7 * expected.abs().max().item())


@pytest.mark.skipif(not OURS, reason="no AVX2 + FMA: torch's kernels run")
@pytest.mark.parametrize("layout", FUSED)
def test_a_rows_output_does_not_depend_on_the_rows_beside_it(layout):
    """Float inputs under the rows from which a prompt's blocks are dequantized once (16 on
    AVX2): each row count has its own tiles, each row's sums one order."""
    torch.manual_seed(5)
    layer = storage(*FUSED[layout])
    x = torch.randn(15, IN)
    alone = torch.cat([layer.matmul(x[i:i + 1], None) for i in range(len(x))])
    assert isinstance(layer.fused, PairBlocks)
    for rows in range(2, len(x) + 1):
        assert torch.equal(layer.matmul(x[:rows], None), alone[:rows]), rows


def test_fused_int4_holds_the_only_copy_of_the_weight():
    layer = storage(4, 32)
    layer.matmul(torch.randn(3, IN), None)
    assert isinstance(layer.fused, PairBlocks if OURS else Int4Groups)
    assert layer.qweight.numel() == 0 and layer.scales is None and layer.biases is None
    rows = -(-OUT // 32) * 32 if OURS else OUT  # ours packs blocks of 32 output features
    assert layer.fused.packed.numel() * layer.fused.packed.element_size() == rows * IN // 2


# (bits, group size, rows) no fused kernel of this host takes: ours needs an even group size
# (or one group), torch's int4 groups of 32-256 and rows in 16s, its int8 one scale per row.
UNFUSED = [(4, 7, OUT), (8, 7, OUT)] if OURS else [(4, 48, OUT), (4, 32, 72), (4, 96, OUT),
                                                    (8, 32, OUT)]


@pytest.mark.parametrize("bits,group_size,rows", UNFUSED)
def test_other_layouts_dequantize_for_each_matmul(bits, group_size, rows):
    torch.manual_seed(0)
    layer = storage(bits, group_size, biases=bits == 4, rows=rows)
    x = torch.randn(4, IN)
    expected = reference(layer, x, None)
    got = layer.matmul(x, None)
    assert layer.fused is None
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


# (bits, group size or None: one scale per row, act-order, biases, scales and biases exact in
# float16: the kernel reads them in 2 bytes, else in 4)
LAYOUTS = {
    "int8-rows": (8, None, False, False, False),
    "int8-g6-biases": (8, 6, False, True, False),
    "int8-g6-biases-half": (8, 6, False, True, True),
    "int4-g32-act-order": (4, 32, True, True, False),
    "int4-g32-act-order-half": (4, 32, True, True, True),
    "int4-g16-symmetric": (4, 16, False, False, False),
    "int4-one-group": (4, None, False, True, False),
}


def assert_packed_params(layer: QuantizedWeight, half: bool) -> None:
    """The kernel's group parameters are float16 where every one is exact in it."""
    params = [t for t in (layer.fused.groups, layer.fused.row_groups) if t is not None]
    assert all(t.dtype == (torch.float16 if half else torch.float32) for t in params)


def multiply_bf16_prompts(multiply: str, monkeypatch) -> None:
    """How layers made next multiply bfloat16 inputs on each block dequantized to bfloat16: in
    AMX tiles ("amx") or by AVX512-BF16 dot products ("dot") from one row (skipped where this
    build has neither), or never (anything else)."""
    kernels = cpu_kernels.load()
    if multiply == "amx" and not kernels.has_amx_tiles:
        pytest.skip("this CPU (or this build) has no AMX tiles")
    if multiply == "dot" and not kernels.has_bf16_dot_products:
        pytest.skip("this CPU (or this build) has no AVX512-BF16 dot products")
    monkeypatch.setattr(quantized_paths, "AMX_ROWS", 1 if multiply == "amx" else 0)
    monkeypatch.setattr(quantized_paths, "dot_rows_for_this_cpu",
                        lambda kernels, bits: 1 if multiply == "dot" else 0)
    if multiply == "dot":  # where AMX tiles or widened FMAs are this CPU's way
        monkeypatch.setattr(cpu_gemm, "amx_for_this_cpu", lambda kernels: False)
        monkeypatch.setattr(cpu_gemm, "widen_for_this_cpu", lambda kernels: False)


@pytest.mark.skipif(not OURS, reason="no AVX2 + FMA: torch's kernels run")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,multiply", [(1, "tiles"), (3, "tiles"), (13, "tiles"),
                                           (200, "tiles"), (3, "sgemm"), (200, "sgemm"),
                                           (1, "amx"), (13, "amx"), (40, "amx"), (200, "amx"),
                                           (2400, "amx"), (1, "dot"), (13, "dot"), (200, "dot"),
                                           (2400, "dot")])
@pytest.mark.parametrize("out_features,in_features", [(50, 34), (96, 224), (7, 2), (40, 33)])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_our_packed_kernel_takes_any_shape(layout, dtype, rows, out_features, in_features,
                                           multiply, monkeypatch):
    """Rows around the kernel's row tiles (AVX2: 2-6, AVX512: 6-12; a prompt's several tiles share
    a block widened once; AMX: 16 and 32, and past the 192-row chunk from which the whole weight
    is dequantized first) and 192-row chunks, features short of its 32-column
    blocks, an odd input (the last one pairs with padding), groups shorter at the end; the packed
    copy replaces the storage. sgemm: the weight dequantized whole for float32 sgemm, as prompts
    run where that is faster; amx / dot: each block dequantized to bfloat16 for AMX tiles (K a
    multiple of 32; the others run the tiles) or AVX512-BF16 dot products (bfloat16 inputs)."""
    if multiply in ("amx", "dot") and dtype == torch.float32 and rows > 200:
        pytest.skip("float32 inputs run the tiles, which 200 rows cover")
    multiply_bf16_prompts(multiply, monkeypatch)
    monkeypatch.setenv(cpu_gemm.SGEMM_ROWS_ENV, "1" if multiply == "sgemm" else "0")
    monkeypatch.setattr(quantized_paths, "sgemm_rows_for_this_cpu",  # read it, cache nothing
                        quantized_paths.sgemm_rows_for_this_cpu.__wrapped__)
    bits, half = LAYOUTS[layout][0], LAYOUTS[layout][-1]
    if bits == 4 and in_features % 2:
        pytest.skip("4-bit storage packs input columns in pairs")
    torch.manual_seed(rows + in_features)
    layer = random_storage(out_features, in_features, *LAYOUTS[layout])
    x = torch.randn(rows, in_features + 2)[:, 1:1 + in_features]  # rows with a stride
    # What blocks dequantized to bfloat16 compute: products of x and the weight rounded to
    # bfloat16 (int8 rows' values are exact in it, their scales applied to the sums), summed in
    # float32
    rounded = dtype == torch.bfloat16 and (
        multiply == "dot" or (multiply == "amx" and in_features % 32 == 0))
    weight = dequantize(layer.qweight, layer.scales, layer.biases, layer.g_idx, torch.float32)
    got = layer.matmul(x.to(dtype), None)
    if rounded and layer.fused.row_scales is None:
        weight = weight.to(dtype).float()
    expected = F.linear(x.to(dtype).float() if rounded else x, weight)
    assert isinstance(layer.fused, PairBlocks) and layer.qweight.numel() == 0
    assert_packed_params(layer, half)
    assert got.dtype == dtype and got.shape == (rows, out_features)
    tolerance = (1e-5 if dtype == torch.float32 else
                 2 ** (-8 if rounded else -7) * expected.abs().max().item())
    torch.testing.assert_close(got.float(), expected, atol=tolerance, rtol=1e-4)


ACTIVATIONS = {0: F.silu, 1: lambda t: F.gelu(t, approximate="tanh")}  # FUSED_CODES'


@pytest.mark.skipif(not OURS, reason="no AVX2 + FMA: torch's kernels run")
@pytest.mark.parametrize("rows,multiply", [(1, "tiles"), (13, "tiles"), (200, "tiles"),
                                           (200, "sgemm"), (1, "int8"), (13, "int8"),
                                           (40, "int8"), (40, "amx"), (200, "amx"),
                                           (2400, "amx"), (40, "dot"), (2400, "dot")])
@pytest.mark.parametrize("intermediate,in_features", [(40, 64), (96, 224)])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gated_quantized_weights_apply_act_and_mul_as_the_separate_kernel_does(
        layout, intermediate, in_features, rows, multiply, monkeypatch):
    """[gate; up] packed in pairs of 16 features, every way the kernel multiplies (its float
    tiles, sgemm on the dequantized weight, int8 inputs, AMX tiles or bf16 dot products on
    blocks dequantized to bfloat16): the same outputs as the plain packing, and act(gate) * up
    bit for bit what the separate act_and_mul kernel makes of them, close to the activation of
    the dequantized matmul; float32 inputs are left to the unfused path."""
    multiply_bf16_prompts(multiply, monkeypatch)
    monkeypatch.setenv(cpu_gemm.SGEMM_ROWS_ENV, "1" if multiply == "sgemm" else "0")
    monkeypatch.setattr(quantized_paths, "sgemm_rows_for_this_cpu",
                        quantized_paths.sgemm_rows_for_this_cpu.__wrapped__)
    plain, gated = (random_storage(2 * intermediate, in_features, *LAYOUTS[layout], gated=gated)
                    for gated in (False, True) if torch.manual_seed(rows + intermediate))
    weight = dequantize(plain.qweight, plain.scales, plain.biases, plain.g_idx, torch.float32)
    plain.int8_inputs = gated.int8_inputs = multiply == "int8"
    x = torch.randn(rows, in_features, dtype=torch.bfloat16)
    bias = torch.randn(2 * intermediate, dtype=torch.bfloat16)
    assert gated.act_and_mul(x.float(), bias.float(), 0) is None
    separate = plain.matmul(x, bias)
    assert torch.equal(gated.matmul(x, bias), separate)
    assert isinstance(gated.fused, PairBlocks) and gated.fused.gated
    for code, act in ACTIVATIONS.items():
        fused = gated.act_and_mul(x, bias, code)
        assert torch.equal(fused, cpu_kernels.load().act_and_mul(separate, code))
        gate, up = F.linear(x.float(), weight, bias.float()).chunk(2, dim=-1)
        torch.testing.assert_close(fused.float(), act(gate) * up, rtol=0.05,
                                   atol=0.05 * (act(gate) * up).abs().max().item())


@pytest.mark.skipif(not OURS, reason="no AVX2 + FMA: torch's kernels run")
@pytest.mark.parametrize("rows", [1, 40])
def test_a_quantized_gated_mlp_applies_its_activation_in_the_matmul(rows, monkeypatch):
    """A gated MLP's quantized [gate; up] on bfloat16 inputs: act(gate) * up straight from the
    matmul (the separate act_and_mul kernel never runs), close to the dequantized weights' MLP."""
    torch.manual_seed(rows)
    mlp = GatedMLP(64, 80, "silu", bias=False)
    weights = {}
    for name, layer in (("gate_up", mlp.gate_up_proj), ("down", mlp.down_proj)):
        storage = random_storage(layer.out_features, layer.in_features, 4, 32, False, True, True)
        weights[name] = dequantize(storage.qweight, storage.scales, storage.biases,
                                   storage.g_idx, torch.float32)
        layer.use_quantized_weight(4, storage.scales.shape[1], True)
        layer.quantized.load_state_dict(storage.state_dict())
    x = torch.randn(rows, 64, dtype=torch.bfloat16)
    monkeypatch.setattr(fused_ops, "for_tensor", lambda tensor: pytest.fail("act_and_mul ran"))
    got = mlp(x)
    assert mlp.gate_up_proj.quantized.fused.gated
    gate, up = F.linear(x.float(), weights["gate_up"]).chunk(2, dim=-1)
    expected = F.linear(F.silu(gate) * up, weights["down"])
    torch.testing.assert_close(got.float(), expected, rtol=0.05,
                               atol=0.02 * expected.abs().max().item())


def int8_input_reference(layer: QuantizedWeight, x: torch.Tensor) -> torch.Tensor:
    """What quantized weights give int8 inputs, in float64: per row and group (int8 weights with
    a scale per row: per ROW_GROUP_SIZE columns), x rounded to round(x * 127 / max|x|) (in
    float32, to nearest even) times max|x| / 127, multiplied by the dequantized weights
    (q * scale + bias)."""
    weight = dequantize(layer.qweight, layer.scales, layer.biases, layer.g_idx, torch.float64)
    g_idx = layer.g_idx.long()
    if layer.scales.shape[1] == 1 and layer.biases is None:
        g_idx = torch.arange(x.shape[1]) // ROW_GROUP_SIZE
    x = x.float()
    expected = torch.zeros(x.shape[0], weight.shape[0], dtype=torch.float64)
    for group in g_idx.unique():
        columns = (g_idx == group).nonzero()[:, 0]
        xs = x[:, columns]
        absmax = xs.abs().amax(1, keepdim=True)
        # a division (127 / tensor would multiply by the reciprocal, another rounding)
        inverse = torch.where(absmax > 0, torch.full_like(absmax, 127).div(absmax), 0)
        rounded = torch.round(xs * inverse).double() * (absmax / 127).double()
        expected += rounded @ weight[:, columns].T
    return expected


INT8_INPUT_LAYOUTS = {  # name -> as LAYOUTS'
    "int4-g32-act-order": (4, 32, True, True, False),
    "int4-g32-half": (4, 32, False, True, True),
    "int4-g16-symmetric": (4, 16, False, False, False),
    "int4-one-group": (4, None, False, True, False),
    "int4-g6": (4, 6, False, True, False),  # fewer pairs than the 4-bit kernel's int16 run
    "int4-g6-half": (4, 6, False, True, True),
    "int8-per-row": (8, None, False, False, False),  # x scaled per ROW_GROUP_SIZE features
    "int8-per-row-half": (8, None, False, False, True),
    "int8-g32-act-order": (8, 32, True, True, False),
    "int8-g16-symmetric": (8, 16, False, False, False),
}


@pytest.mark.skipif(not OURS, reason="no AVX2 + FMA: torch's kernels run")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 13, 63, 255])
@pytest.mark.parametrize("out_features,in_features", [(50, 34), (96, 224), (7, 2), (40, 33),
                                                      (33, 300)])
@pytest.mark.parametrize("layout", INT8_INPUT_LAYOUTS)
def test_int8_inputs_give_quantized_weights_the_int8_math(layout, out_features, in_features, rows,
                                                          dtype, monkeypatch):
    """Inputs under int8_rows(bits) rows (decode sizes; every size for 4 bits with AVX512-VNNI)
    quantized per row and group: every group size class, a group of zeros, features short of a
    32-column block, int8 rows wider than ROW_GROUP_SIZE; from int8_rows rows the float math.
    (bfloat16 inputs multiplied on blocks dequantized to bfloat16, AMX's and dot products', off.)"""
    multiply_bf16_prompts("tiles", monkeypatch)
    limit = int8_rows(cpu_kernels.load(), INT8_INPUT_LAYOUTS[layout][0])
    if rows >= limit:
        pytest.skip(f"these weights take int8 inputs under {limit} rows")
    torch.manual_seed(rows * in_features)
    bits, half = INT8_INPUT_LAYOUTS[layout][0], INT8_INPUT_LAYOUTS[layout][-1]
    if bits == 4 and in_features % 2:
        pytest.skip("4-bit storage packs input columns in pairs")
    layer = random_storage(out_features, in_features, *INT8_INPUT_LAYOUTS[layout])
    layer.int8_inputs = True
    x = (torch.randn(rows, in_features) * 3).to(dtype)
    x[0, layer.g_idx == 0] = 0
    prompt = torch.randn(min(limit, 600), in_features).to(dtype)  # 600: past sgemm's 512 rows
    expected, unrounded = int8_input_reference(layer, x), reference(layer, x, None)
    prompt_in_int8 = len(prompt) < limit
    expected_prompt = (int8_input_reference(layer, prompt) if prompt_in_int8 else
                       reference(layer, prompt, None))
    got = layer.matmul(x, None)
    assert isinstance(layer.fused, PairBlocks) and layer.fused.int8_rows == limit
    assert_packed_params(layer, half)
    tolerance = 1e-5 if dtype == torch.float32 else 2 ** -7 * expected.abs().max().item()
    torch.testing.assert_close(got.double(), expected, atol=tolerance, rtol=1e-4)
    # x's rounding moves the float math by a few steps of 1/127 of the inputs' scale
    assert (got.float() - unrounded).abs().max() <= 0.05 * unrounded.abs().max()
    # the prompt: the int8 math again, or the float math summed in another order than F.linear's
    # over up to 300 features
    scale = expected_prompt.abs().max().item()
    if dtype == torch.bfloat16:
        tolerance = 2 ** -7 * scale
    else:
        tolerance = 1e-5 if prompt_in_int8 else 2 ** -20 * scale
    torch.testing.assert_close(layer.matmul(prompt, None).to(expected_prompt.dtype),
                               expected_prompt, atol=tolerance, rtol=1e-4)


@pytest.mark.skipif(not OURS, reason="no AVX2 + FMA: torch's kernels run")
def test_quantized_prompts_go_to_sgemm_where_measured_faster_unless_forced(monkeypatch):
    """Measured apart from bf16 weights' choice (their tiles widen in registers, these dequantize
    a block into a buffer first), on this CPU, once per process."""
    def rows(forced: str | None) -> int:
        quantized_paths.sgemm_rows_for_this_cpu.cache_clear()
        if forced is None:
            monkeypatch.delenv(cpu_gemm.SGEMM_ROWS_ENV, raising=False)
        else:
            monkeypatch.setenv(cpu_gemm.SGEMM_ROWS_ENV, forced)
        try:
            layer = storage(8, IN, biases=False)
            return PairBlocks(integer_values(layer.qweight), layer.scales, None, layer.g_idx,
                              IN, cpu_kernels.load()).sgemm_rows
        finally:
            quantized_paths.sgemm_rows_for_this_cpu.cache_clear()

    assert (rows("0"), rows("64")) == (0, 64)
    assert rows(None) in (0, cpu_gemm.PROMPT_ROWS)
    with pytest.raises(ValueError, match="row count"):
        rows("many")


@pytest.mark.skipif(not OURS, reason="no AVX2 + FMA: torch's kernels run")
def test_bf16_prompts_on_dequantized_blocks_only_where_this_build_multiplies_bf16(monkeypatch):
    """Without AMX tiles or AVX512-BF16 dot products (AVX2 builds, Cascade Lake) quantized
    prompts keep the other paths, and the kernel refuses to be asked for dot products."""
    kernels = cpu_kernels.load()
    if kernels.has_bf16_dot_products:
        pytest.skip("this build multiplies bfloat16 by dot products (the 'dot' tests cover it)")
    assert quantized_paths.dequantized_bf16_rows(kernels, 4) == (0, False)
    layer = random_storage(OUT, IN, 4, 32, False, True, True)
    layer.matmul(torch.randn(1, IN), None)
    with pytest.raises(RuntimeError, match="no AVX512-BF16 dot products"):
        kernels.quantized_matmul(torch.randn(64, IN, dtype=torch.bfloat16), layer.fused.packed,
                                 None, layer.fused.groups, 32, OUT, bf16_rows=1)


@pytest.mark.skipif(not OURS, reason="no AVX2 + FMA: torch's kernels run")
def test_the_kernel_refuses_group_parameters_it_cannot_read():
    """Group parameters are float32 or float16; another dtype is a clear error, not a misread."""
    layer = random_storage(OUT, IN, 4, 32, False, True, True)
    layer.matmul(torch.randn(1, IN), None)
    fused = layer.fused
    for dtype in (torch.bfloat16, torch.float64):
        with pytest.raises(RuntimeError, match="groups must be float32 or float16"):
            cpu_kernels.load().quantized_matmul(torch.randn(1, IN), fused.packed, None,
                                                fused.groups.to(dtype), 32, OUT)
