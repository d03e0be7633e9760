"""bfloat16 weights packed for a CPU matmul kernel (tritonlm's kernel, multiplying in AMX tiles,
with AVX512-BF16 dot products or widened float32 FMAs in AVX512 or AVX2 registers; oneDNN's
layout) compute what torch's F.linear computes on the plain weights: as close to float32 as
F.linear itself, and the same greedy tokens and logprobs for SmolLM2."""
import pytest
import torch
import torch.nn.functional as F

from tritonlm import LLM, SamplingParams
from tritonlm.layers import cpu_gemm, cpu_kernels
from tritonlm.layers.linear import ColumnParallelLinear


def _matmul_kernels():
    kernels = cpu_kernels.load()
    return kernels if kernels is not None and kernels.has_bf16_matmul else None


needs_bf16_matmul = pytest.mark.skipif(_matmul_kernels() is None,
                                       reason="this CPU has no AVX2 + FMA (the kernel's registers)")
needs_onednn_bf16 = pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                                       reason="oneDNN has no bfloat16 matmuls on this CPU")
# How the kernel multiplies: AMX tiles or bf16 dot products where the CPU has them, widened
# float32 FMAs, or the whole weight widened and handed to float32 sgemm (prompts, where that is
# faster). AMX tiles take K in multiples of 32 (other K: the vector tiles).
MULTIPLY = ["amx", "dot", "fma", "sgemm"]


def _packed(weight: torch.Tensor, multiply: str, gated: bool = False) -> cpu_gemm.PairBlockWeight:
    kernels = _matmul_kernels()
    if multiply == "dot" and not kernels.has_bf16_dot_products:
        pytest.skip("this CPU has no AVX512-BF16 dot products")
    if multiply == "amx" and not kernels.has_amx_tiles:
        pytest.skip("this CPU (or this build) has no AMX tiles")
    return cpu_gemm.PairBlockWeight(weight, kernels, gated, widen=multiply == "fma",
                                    sgemm_rows=1 if multiply == "sgemm" else 0,
                                    amx=multiply == "amx")


def _errors(out: torch.Tensor, exact: torch.Tensor) -> tuple[float, float]:
    diff = (out.float() - exact).abs()
    return diff.max().item(), diff.mean().item()


# rows around the kernel's tiles (AVX512: 12 rows; AVX2: 3 rows whole, 4-6 by half blocks; AMX:
# 16 and 32, and 70 as three tiles of 24, the last reaching back) and 192-row chunks; features
# not multiples of its 32-column blocks; odd inputs (the last feature pairs with padding)
@needs_bf16_matmul
@pytest.mark.parametrize("multiply", MULTIPLY)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 12, 13, 20, 32, 70, 200])
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (50, 33), (7, 1), (100, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_matmul_as_close_as_f_linear(multiply, rows, out_features, in_features, with_bias):
    torch.manual_seed(rows * 7 + in_features)
    weight = torch.randn(out_features, in_features, dtype=torch.bfloat16) / in_features ** 0.5
    bias = torch.randn(out_features, dtype=torch.bfloat16) if with_bias else None
    # rows of a wider tensor: the kernel reads them with their stride
    x = torch.randn(rows, in_features + 3, dtype=torch.bfloat16)[:, 2:2 + in_features]
    exact = x.float() @ weight.float().T + (bias.float() if with_bias else 0)
    packed = _packed(weight, multiply)
    ours_max, ours_mean = _errors(packed.matmul(x, bias), exact)
    torch_max, torch_mean = _errors(F.linear(x, weight, bias), exact)
    assert ours_max <= 2 * torch_max + 1e-6 and ours_mean <= 1.1 * torch_mean + 1e-7
    assert torch.equal(packed.dense(), weight)


@needs_bf16_matmul
@pytest.mark.parametrize("multiply", MULTIPLY)
@pytest.mark.parametrize("rows", [1, 13, 70, 200])
@pytest.mark.parametrize("intermediate", [1536, 40, 16])
@pytest.mark.parametrize("in_features", [72, 96])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gated_packing_applies_act_and_mul_as_the_separate_kernel_does(multiply, rows,
                                                                        intermediate, in_features,
                                                                        with_bias):
    """[gate; up] packed in pairs of 16 features: the same matmul as the plain packing, and
    act(gate) * up bit for bit what the separate act_and_mul kernel makes of that output."""
    torch.manual_seed(intermediate + rows)
    kernels = _matmul_kernels()
    weight = torch.randn(2 * intermediate, in_features, dtype=torch.bfloat16) / 8
    bias = torch.randn(2 * intermediate, dtype=torch.bfloat16) if with_bias else None
    x = torch.randn(rows, in_features, dtype=torch.bfloat16)
    plain = _packed(weight, multiply)
    gated = _packed(weight, multiply, gated=True)
    assert torch.equal(gated.dense(), weight)
    assert torch.equal(gated.matmul(x, bias), plain.matmul(x, bias))
    for code, act in ((0, F.silu), (1, lambda t: F.gelu(t, approximate="tanh"))):
        fused = gated.matmul(x, bias, code)
        assert torch.equal(fused, kernels.act_and_mul(plain.matmul(x, bias), code))
        gate, up = F.linear(x, weight, bias).chunk(2, dim=-1)
        torch.testing.assert_close(fused, act(gate) * up, rtol=2e-2, atol=2e-2)
    with pytest.raises(RuntimeError, match="activation"):
        plain.matmul(x, bias, 0)


@needs_bf16_matmul
@pytest.mark.parametrize("multiply", ["amx", "dot", "fma"])
@pytest.mark.parametrize("gated", [False, True])
def test_a_rows_output_does_not_depend_on_the_rows_beside_it(multiply, gated):
    """Each row count has its own tiles (AVX2: up to 3 rows over whole blocks, 4-6 over half
    blocks; AVX512: up to 12; AMX: 16 rows an A tile, two a tile), yet every row's sums are added
    in one order: a sequence's tokens do not depend on the batch it decodes in."""
    torch.manual_seed(3)
    packed = _packed(torch.randn(96, 192, dtype=torch.bfloat16) / 14, multiply, gated)
    x = torch.randn(40, 192, dtype=torch.bfloat16)
    activation = 0 if gated else None
    alone = torch.cat([packed.matmul(x[i:i + 1], None, activation) for i in range(len(x))])
    for rows in range(2, len(x) + 1):
        assert torch.equal(packed.matmul(x[:rows], None, activation), alone[:rows]), rows


@needs_bf16_matmul
@pytest.mark.parametrize("multiply", ["amx", "dot", "fma"])
@pytest.mark.parametrize("gated", [False, True])
def test_a_prompts_rows_are_the_rows_one_at_a_time(multiply, gated):
    """Past one 192-row chunk AMX tiles write each tile's outputs during the next tile's dot
    products, and each thread its last tile's at the end of its share: every row, in every
    block (the last one partial), with its bias and activation, comes out as computed alone."""
    torch.manual_seed(5)
    weight = torch.randn(200 if gated else 100, 192, dtype=torch.bfloat16) / 14
    bias = torch.randn(weight.shape[0], dtype=torch.bfloat16)
    packed = _packed(weight, multiply, gated)
    x = torch.randn(450, 192, dtype=torch.bfloat16)
    activation = 0 if gated else None
    alone = torch.cat([packed.matmul(x[i:i + 1], bias, activation) for i in range(len(x))])
    for rows in (193, 230, 450):
        assert torch.equal(packed.matmul(x[:rows], bias, activation), alone[:rows]), rows


@needs_bf16_matmul
@pytest.mark.parametrize("multiply", MULTIPLY)
def test_packed_matmul_takes_leading_dims_and_refuses_a_foreign_weight(multiply):
    weight = torch.randn(64, 48, dtype=torch.bfloat16)
    packed = _packed(weight, multiply)
    x = torch.randn(2, 3, 48, dtype=torch.bfloat16)
    torch.testing.assert_close(packed.matmul(x, None), F.linear(x, weight), rtol=1e-2, atol=1e-2)
    with pytest.raises(RuntimeError, match="does not hold"):
        _matmul_kernels().bf16_matmul(x[0], packed.data, 96, None)
    with pytest.raises(RuntimeError, match="bfloat16"):
        packed.matmul(x.float(), None)


@needs_onednn_bf16
@pytest.mark.parametrize("pack", ["pair_blocks", "onednn"])
def test_prepacked_linear_equals_f_linear_and_keeps_its_dense_weight(pack):
    kernels = _matmul_kernels()
    if pack == "pair_blocks" and (kernels is None or not kernels.has_amx_tiles
                                  and "amx_bf16" in cpu_kernels.cpu_flags()):
        pytest.skip("no kernels, or AMX without the kernels' tiles: prepack picks oneDNN")
    torch.manual_seed(0)
    layer = ColumnParallelLinear(96, 160, bias=True).to(torch.bfloat16)
    weight = layer.weight.detach().clone()
    x = torch.randn(7, 96, dtype=torch.bfloat16)
    expected = F.linear(x, weight, layer.bias)
    layer.prepack_for_cpu(batch_hint=32)
    if pack == "pair_blocks":
        assert isinstance(layer.packed, cpu_gemm.PairBlockWeight)
    if pack == "onednn":
        layer.packed = cpu_gemm.OneDnnWeight(weight, 32)
    assert layer.weight is None and layer.packed is not None
    torch.testing.assert_close(layer(x), expected, rtol=1e-2, atol=1e-2)
    assert torch.equal(layer.dense_weight(torch.bfloat16), weight)
    assert layer(x[:1]).shape == (1, 160)  # any row count, whatever the hint


def _packing_choice(monkeypatch, measured, variable: str, forced: str | None, attribute: str):
    """A new PairBlockWeight's `attribute` with `variable` set to `forced` (None: unset, so that
    the cached `measured` function measures afresh)."""
    measured.cache_clear()
    if forced is None:
        monkeypatch.delenv(variable, raising=False)
    else:
        monkeypatch.setenv(variable, forced)
    try:
        weight = torch.ones(32, 4, dtype=torch.bfloat16)
        return getattr(cpu_gemm.PairBlockWeight(weight, _matmul_kernels()), attribute)
    finally:
        measured.cache_clear()


@needs_bf16_matmul
def test_the_multiply_is_measured_unless_forced(monkeypatch):
    kernels = _matmul_kernels()
    has_dot = kernels.has_bf16_dot_products

    def choice(forced: str | None) -> bool:
        return _packing_choice(monkeypatch, cpu_gemm.widen_for_this_cpu, cpu_gemm.MULTIPLY_ENV,
                               forced, "widen")

    assert choice("fma") is True
    if has_dot:
        assert choice("dot") is False
        # float32 FLOPs per second of vdpbf16ps over FMAs: 0.5 on Intel Xeons, 2 on Zen 4/5
        assert 0.25 < kernels.bf16_dot_product_speedup() < 4
        assert choice(None) in (True, False)
    else:
        assert kernels.bf16_dot_product_speedup() == 0 and choice(None) is True
        with pytest.raises(ValueError, match="no AVX512-BF16"):
            choice("dot")
        with pytest.raises(RuntimeError, match="no AVX512-BF16"):
            kernels.bf16_matmul(torch.ones(1, 2, dtype=torch.bfloat16),
                                torch.zeros(1, 1, 32, 2, dtype=torch.bfloat16), 32)
    if kernels.has_amx_tiles:  # for K the tiles do not take, the vector tiles' measured way
        assert choice("amx") is choice(None)
    else:
        with pytest.raises(ValueError, match="no AMX tiles"):
            choice("amx")
    with pytest.raises(ValueError, match="must be one of"):
        choice("avx")


@needs_bf16_matmul
def test_amx_tiles_multiply_wherever_the_cpu_has_them_unless_forced(monkeypatch):
    kernels = _matmul_kernels()
    # -march=native builds them where the CPU has them (an AVX2 build of the variants has none)
    has_amx = "amx_bf16" in cpu_kernels.cpu_flags().split() and kernels.vector_lanes == 16
    assert kernels.has_amx_tiles == has_amx

    def choice(forced: str | None) -> bool:
        return _packing_choice(monkeypatch, cpu_gemm.amx_for_this_cpu, cpu_gemm.MULTIPLY_ENV,
                               forced, "amx")

    if has_amx:
        assert cpu_gemm.bf16_matmul_backend() == "tritonlm's packed matmul (AMX)"
        assert choice("amx") is True and choice("dot") is False
    assert choice(None) is has_amx and choice("fma") is False


@needs_bf16_matmul
def test_prompts_go_to_sgemm_where_measured_faster_unless_forced(monkeypatch):
    def rows(forced: str | None) -> int:
        return _packing_choice(monkeypatch, cpu_gemm.sgemm_rows_for_this_cpu,
                               cpu_gemm.SGEMM_ROWS_ENV, forced, "sgemm_rows")

    assert (rows("0"), rows("64")) == (0, 64)
    assert rows(None) in (0, cpu_gemm.PROMPT_ROWS)
    with pytest.raises(ValueError, match="row count"):
        rows("many")


TEXT = ("The history of the city begins in the Roman era, when a small settlement grew along the "
        "river. Over the centuries it became a centre of trade, and its merchants built bridges, "
        "markets and churches. Scientists measured the temperature of the lake every morning and "
        "found that it changed slowly with the seasons. def mean(values):\n    total = "
        "sum(values)\n    return total / len(values)\n")


@pytest.mark.skipif(cpu_gemm.prepack(torch.zeros(32, 32, dtype=torch.bfloat16), 32) is None,
                    reason="no bfloat16 packing for this CPU")
def test_bfloat16_engine_as_close_to_float32_with_prepacking_as_without(
        smollm2_repo, smollm2_tokenizer, monkeypatch):
    """Every prefix of a text, one greedy token each: against the same weights run in float32,
    the bf16 engine (the float32 repository's weights rounded on load, as a bfloat16 conversion
    rounds them) on packed weights agrees as often, with logprobs as close, as on plain F.linear
    (whose matmuls HF transformers runs)."""
    repo = str(smollm2_repo)
    ids = smollm2_tokenizer.encode(TEXT)
    prompts = [ids[:n] for n in range(4, len(ids))]
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    exact = LLM(repo, num_kv_blocks=256, dtype="float32").generate(prompts, params)

    def against_float32(llm: LLM) -> tuple[int, float]:
        agree, errors = 0, []
        for reference, out in zip(exact, llm.generate(prompts, params)):
            token = reference.token_ids[0]
            agree += out.token_ids[0] == token
            top = {entry["token_id"]: entry["logprob"] for entry in out.logprobs[0]["top_logprobs"]}
            errors.append(abs(top[token] - reference.logprobs[0]["logprob"]))
        return agree, sum(errors) / len(errors)

    packed = LLM(repo, num_kv_blocks=256, dtype="bfloat16")
    assert all(getattr(m, "packed", None) is not None
               for m in packed.engine.runner.model.modules() if isinstance(m, ColumnParallelLinear))
    agree, error = against_float32(packed)
    monkeypatch.setattr(cpu_gemm, "prepack", lambda weight, batch_hint, gated=False: None)
    plain_agree, plain_error = against_float32(LLM(repo, num_kv_blocks=256, dtype="bfloat16"))
    assert agree >= plain_agree - 3 and error <= 1.25 * plain_error + 0.005
