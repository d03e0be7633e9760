"""The fused CPU layer kernels (csrc/fused_ops.cpp, csrc/kv_cache_write.cpp) against Hugging Face's
own modules and torch: RMSNorm (Llama's and Gemma's, with the residual add), activation-times-up,
rotary embeddings, greedy argmax with logsumexp, and the KV cache write (against index_copy_). In 16-bit dtypes the kernels round where HF's ops round, so they are
compared bit for bit; in float32 only summation order differs."""
import pytest
import torch
from transformers.activations import ACT2FN
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from tritonlm.layers import cpu_kernels
from tritonlm.layers.activation import FUSED_CODES
from tritonlm.layers.kv_cache import LayerKV
from tritonlm.layers.mlp import GatedMLP
from tritonlm.layers.norm import OffsetRMSNorm, RMSNorm
from tritonlm.layers.rotary import apply_rotary
from tritonlm.layers.sampler import sample
from test_sampler import tensors as sampling_tensors

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module")
def kernels():
    return cpu_kernels.build()  # raises with the compiler's output if it cannot build


@pytest.fixture
def no_kernels(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "_loaded", {"module": None})


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, one_ulp: bool = False):
    """Bit for bit in 16-bit dtypes. `one_ulp`: after a float32 sum in another order, or another
    tanh approximation, a value may round one step the other way (which a later product can
    double): within two units in the last place, in under 1% of values."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=2e-6, atol=2e-6)
    elif not one_ulp:
        assert torch.equal(actual, expected), (actual.float() - expected.float()).abs().max()
    else:
        torch.testing.assert_close(actual, expected, rtol=2 * torch.finfo(actual.dtype).eps,
                                   atol=1e-6)
        assert (actual == expected).float().mean() > 0.99


def _norm_pair(cls, hf_cls, hidden: int, dtype):
    ours, theirs = cls(hidden, 1e-5), hf_cls(hidden, eps=1e-5)
    weight = torch.randn(hidden) * 0.5 + (0 if cls is OffsetRMSNorm else 1)
    for module in (ours, theirs):
        module.weight.data = weight.clone()
        module.to(dtype)
    return ours, theirs


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 100, 13])
@pytest.mark.parametrize("cls,hf_cls", [(RMSNorm, LlamaRMSNorm), (OffsetRMSNorm, GemmaRMSNorm)])
def test_rms_norm_matches_hf(kernels, cls, hf_cls, hidden, dtype):
    torch.manual_seed(hidden)
    ours, theirs = _norm_pair(cls, hf_cls, hidden, dtype)
    x, residual = (torch.randn(37, hidden, dtype=dtype) * 4 for _ in range(2))
    assert_matches(ours(x), theirs(x), one_ulp=True)
    normed, new_residual = ours(x, residual.clone())
    assert_matches(new_residual, residual + x)  # HF's `hidden_states = residual + hidden_states`
    assert_matches(normed, theirs(residual + x), one_ulp=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sums_round_as_torch_at_ties_denormals_and_nan(kernels, dtype):
    """The kernels' own float32 -> 16-bit rounding (the residual sums) against torch's cast on
    the hard cases: exact halfway sums (to even), subnormal results, overflow, inf and NaN."""
    info = torch.finfo(dtype)
    # 1 + these (k > 0): halfway between two neighbours, so ties to even; below 1 they are exact
    halfway = [info.eps / 2 * k for k in (1, 3, 5, -1, -3)]
    cases = [(1.0, h) for h in halfway] + [
        (info.smallest_normal / 4, info.smallest_normal / 8), (info.max, info.max),
        (float("inf"), float("-inf")), (float("nan"), 1.0), (-info.max, -info.max),
        (info.tiny * 3, -info.tiny)]
    residual = torch.tensor([[r for r, _ in cases] * 3], dtype=dtype)  # full and partial vectors
    x = torch.tensor([[v for _, v in cases] * 3], dtype=dtype)
    expected = residual + x
    _, total = RMSNorm(x.shape[1], 1e-5).to(dtype)(x, residual.clone())
    assert torch.equal(total.isnan(), expected.isnan())
    assert torch.equal(total[~total.isnan()], expected[~expected.isnan()])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_without_kernel_is_the_same_function(kernels, no_kernels, dtype):
    torch.manual_seed(0)
    ours, theirs = _norm_pair(RMSNorm, LlamaRMSNorm, 64, dtype)
    x, residual = torch.randn(5, 64, dtype=dtype), torch.randn(5, 64, dtype=dtype)
    normed, total = ours(x, residual)
    assert torch.equal(total, residual + x)
    assert_matches(normed, theirs(residual + x), one_ulp=True)


def test_rms_norm_takes_leading_dims_and_non_contiguous_residual(kernels):
    torch.manual_seed(1)
    ours, theirs = _norm_pair(RMSNorm, LlamaRMSNorm, 32, torch.bfloat16)
    x = torch.randn(2, 3, 32, dtype=torch.bfloat16)
    residual = torch.randn(32, 6, dtype=torch.bfloat16).t().reshape(2, 3, 32)
    strided = torch.randn(2, 3, 64, dtype=torch.bfloat16)[..., ::2]
    assert_matches(ours(x), theirs(x), one_ulp=True)
    normed, total = ours(x, strided)
    assert_matches(total, strided + x)
    assert_matches(normed, theirs(strided + x), one_ulp=True)
    assert_matches(ours(x, residual)[0], theirs(residual + x), one_ulp=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("width", [1536, 40, 7])
def test_act_and_mul_matches_hf(kernels, act, dtype, width):
    torch.manual_seed(width)
    gate_up = torch.randn(9, 2 * width, dtype=dtype) * 3
    gate, up = gate_up.chunk(2, dim=-1)
    expected = ACT2FN[act](gate) * up
    assert_matches(kernels.act_and_mul(gate_up, FUSED_CODES[act]), expected,
                   one_ulp=act != "silu")


@pytest.mark.parametrize("act", ["silu", "gelu"])  # gelu (erf): no fused kernel
def test_gated_mlp_fused_or_not_gives_the_same(kernels, monkeypatch, act):
    torch.manual_seed(3)
    mlp = GatedMLP(24, 40, act, bias=False).to(torch.bfloat16)
    for p in mlp.parameters():
        p.data = torch.randn_like(p) * 0.2
    x = torch.randn(6, 24, dtype=torch.bfloat16)
    fused = mlp(x)
    monkeypatch.setattr(cpu_kernels, "_loaded", {"module": None})
    assert torch.equal(fused, mlp(x))


def rotary_case(dtype, head_dim: int, rotary_dim: int, tokens: int = 11, heads: int = 5):
    """Random q/k/v rows [tokens, 3 * heads * head_dim], the q part as [tokens, heads, head_dim]
    (a strided view, as in models), cos and sin [tokens, rotary_dim], and HF's rotated q."""
    torch.manual_seed(head_dim + rotary_dim)
    qkv = torch.randn(tokens, 3 * heads * head_dim, dtype=dtype)
    q = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)
    angles = torch.rand(tokens, rotary_dim // 2) * 100
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    # HF: [batch, heads, seq, dim] with cos/sin [batch, seq, rotary_dim]
    expected, _ = apply_rotary_pos_emb(q.transpose(0, 1)[None], q.transpose(0, 1)[None],
                                       cos[None], sin[None])
    return qkv, q, cos, sin, expected[0].transpose(0, 1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,rotary_dim", [(64, 64), (64, 16), (80, 20), (256, 256)])
def test_rotary_matches_hf(kernels, dtype, head_dim, rotary_dim):
    qkv, q, cos, sin, expected = rotary_case(dtype, head_dim, rotary_dim)
    heads = q.shape[1]
    before = qkv.clone()
    actual = apply_rotary(q, cos.unsqueeze(1), sin.unsqueeze(1))
    assert_matches(actual.contiguous(), expected.contiguous())
    assert torch.equal(qkv[:, heads * head_dim:], before[:, heads * head_dim:])  # k, v untouched


def argmax_case(dtype) -> torch.Tensor:
    """Logits with the hard rows: a tie, the maximum in a ragged tail, all -inf, a NaN, an inf,
    and a NaN after an inf (torch.argmax takes the NaN)."""
    torch.manual_seed(5)
    logits = (torch.randn(7, 49157) * 5).to(dtype)
    logits[1, 100] = logits[1, 40000] = 60  # a tie: the first index wins
    logits[2, 49156] = 70
    logits[3] = float("-inf")
    logits[4, 7] = float("nan")
    logits[5, 3] = float("inf")
    logits[6, 9], logits[6, 20000] = float("inf"), float("nan")
    return logits


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_logsumexp_matches_torch(kernels, dtype):
    logits = argmax_case(dtype)
    tokens, lse = kernels.argmax_logsumexp(logits)
    assert torch.equal(tokens, logits.argmax(dim=-1))
    torch.testing.assert_close(lse, torch.logsumexp(logits.float(), dim=-1), rtol=1e-6, atol=1e-5,
                               equal_nan=True)


def test_greedy_sampling_with_and_without_kernel_agree(kernels, monkeypatch):
    torch.manual_seed(6)
    logits = (torch.randn(4, 1000) * 3).to(torch.bfloat16)
    t = sampling_tensors(4, temperature=0.0, num_logprobs=3)
    fused = sample(logits, t)
    monkeypatch.setattr(cpu_kernels, "_loaded", {"module": None})
    reference = sample(logits, t)
    assert torch.equal(fused.tokens, reference.tokens)
    assert torch.equal(fused.top_ids, reference.top_ids)
    torch.testing.assert_close(fused.logprobs, reference.logprobs, rtol=0, atol=1e-5)
    torch.testing.assert_close(fused.top_logprobs, reference.top_logprobs, rtol=0, atol=1e-5)


def test_results_do_not_depend_on_threads(kernels):
    torch.manual_seed(7)
    x = torch.randn(64, 200, dtype=torch.bfloat16)
    weight = torch.randn(200, dtype=torch.bfloat16)
    previous = torch.get_num_threads()
    try:
        outputs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outputs.append((kernels.rms_norm(x, weight, 1e-6, None, False),
                            kernels.act_and_mul(x, 0), kernels.argmax_logsumexp(x)))
    finally:
        torch.set_num_threads(previous)
    for a, b in zip(*outputs):
        assert all(torch.equal(u, v) for u, v in zip(*(a, b) if isinstance(a, tuple)
                                                        else ((a,), (b,))))


@pytest.mark.parametrize("dtype", DTYPES)
def test_cache_write_of_split_qkv_rows_equals_index_copy(kernels, dtype):
    tokens, heads, head_dim, block_size = 37, 3, 64, 16
    # k and v as the fused QKV projection's split leaves them: rows strided by the q+k+v width.
    qkv = torch.randn(tokens, (9 + 2 * heads) * head_dim).to(dtype)
    _, k, v = qkv.split([9 * head_dim, heads * head_dim, heads * head_dim], dim=-1)
    k, v = k.view(tokens, heads, head_dim), v.view(tokens, heads, head_dim)
    rows = torch.randperm(40 * heads * block_size)[:tokens * heads]
    expected = [torch.randn(40, heads, block_size, head_dim).to(dtype) for _ in range(2)]
    caches = [c.clone() for c in expected]
    LayerKV(*caches).write(k, v, rows, head_dim)
    for cache, new in zip(expected, (k, v)):
        cache.view(-1, head_dim).index_copy_(0, rows, new.reshape(-1, head_dim))
    assert all(torch.equal(a, b) for a, b in zip(caches, expected))
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.write_kv_(caches[0].view(-1, head_dim), caches[1].view(-1, head_dim), k, v,
                          torch.full((tokens * heads,), 40 * heads * block_size))


def test_bad_inputs_are_refused_clearly(kernels):
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="weight must be"):
        kernels.rms_norm(x, torch.randn(8, dtype=torch.bfloat16), 1e-6, None, False)
    with pytest.raises(RuntimeError, match="residual must match"):
        kernels.rms_norm(x, torch.randn(8), 1e-6, torch.randn(4, 9), False)
    with pytest.raises(RuntimeError, match="contiguous features"):
        kernels.rms_norm(torch.randn(8, 4).t(), torch.randn(8), 1e-6, None, False)
    with pytest.raises(RuntimeError, match=r"out must be a contiguous CPU \[4, 8\] of Float"):
        kernels.rms_norm(x, torch.randn(8), 1e-6, None, False, out=torch.empty(4, 9))
    with pytest.raises(RuntimeError, match="out must be"):
        kernels.act_and_mul(x, 0, out=torch.empty(4, 4, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="even count"):
        kernels.act_and_mul(torch.randn(4, 7), 0)
    with pytest.raises(RuntimeError, match="activation must be"):
        kernels.act_and_mul(x, 2)
    with pytest.raises(RuntimeError, match="rotary_dim"):
        kernels.rotary_(torch.randn(4, 2, 8), torch.randn(4, 10), torch.randn(4, 10))
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        kernels.argmax_logsumexp(torch.zeros(2, 3, dtype=torch.int64))
