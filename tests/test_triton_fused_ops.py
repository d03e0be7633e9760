"""The fused layer ops as OpenAI-Triton kernels (layers/triton_fused_ops.py, used on CUDA) against
Hugging Face's own modules and torch, as test_cpu_kernels_fused.py checks the C++ ones: on the GPU
where there is one, else under Triton's CPU interpreter. The interpreter truncates float32 to
bfloat16 where the GPU rounds to nearest even, so there bfloat16 results may differ by one unit
in the last place; everywhere else the kernels round where HF's ops round."""
import pytest
import torch
from transformers.activations import ACT2FN
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from conftest import TRITON_DEVICE
from test_cpu_kernels_fused import DTYPES, argmax_case, assert_matches, rotary_case
from tritonlm.layers import cpu_kernels, fused_ops
from tritonlm.layers import triton_fused_ops as ops
from tritonlm.layers.activation import FUSED_CODES

TRUNCATING = TRITON_DEVICE.type != "cuda"  # the interpreter's float32 -> bfloat16


def on_device(*tensors):
    return [t.to(TRITON_DEVICE, copy=True) for t in tensors]  # copies on the CPU too


def assert_close_as(actual: torch.Tensor, expected: torch.Tensor, one_ulp: bool = False):
    actual = actual.cpu()
    if TRUNCATING and actual.dtype == torch.bfloat16:  # each rounding may truncate instead
        eps = torch.finfo(torch.bfloat16).eps
        torch.testing.assert_close(actual.float(), expected.float(), rtol=2 * eps,
                                   atol=4 * eps * expected.float().abs().max().item())
    elif one_ulp and actual.dtype == torch.float16:  # also a few steps apart among subnormals
        torch.testing.assert_close(actual, expected, rtol=2 * torch.finfo(torch.float16).eps,
                                   atol=torch.finfo(torch.float16).smallest_normal / 16)
        assert (actual == expected).float().mean() > 0.99
    else:
        assert_matches(actual, expected, one_ulp)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 100, 13])
@pytest.mark.parametrize("offset,hf_cls", [(False, LlamaRMSNorm), (True, GemmaRMSNorm)])
def test_rms_norm_matches_hf(offset, hf_cls, hidden, dtype):
    torch.manual_seed(hidden)
    theirs = hf_cls(hidden, eps=1e-5)
    theirs.weight.data = torch.randn(hidden) * 0.5 + (0 if offset else 1)
    theirs.to(dtype)
    x, residual = (torch.randn(37, hidden, dtype=dtype) * 4 for _ in range(2))
    weight, dx, dres = on_device(theirs.weight.data, x, residual)
    assert_close_as(ops.rms_norm(dx, weight, 1e-5, None, offset), theirs(x), one_ulp=True)
    normed = ops.rms_norm(dx, weight, 1e-5, dres, offset)
    assert_close_as(dres, residual + x)  # in place, HF's `residual + hidden_states`
    assert_close_as(normed, theirs(residual + x), one_ulp=True)


def assert_close_with_gpu_math(actual, expected, gate, up):
    """On the GPU, exp and tanh are the GPU's, not torch's CPU ones (Sleef): a 16-bit value may
    round one step the other way (one in a 63-value tensor is over 1%), and where tanh nears -1,
    1 + tanh cancels: a few units of tanh's last place there (2^-24 each; the two saturate to -1
    at different inputs) move 0.5 * gate * (1 + tanh) * up by |gate * up| * 2^-25 each."""
    if TRITON_DEVICE.type != "cuda" or actual.dtype == torch.float32:
        assert_close_as(actual, expected, one_ulp=True)
        return
    actual, gate, up = actual.cpu().float(), gate.float(), up.float()
    finfo = torch.finfo(expected.dtype)
    tolerance = (2 * finfo.eps * expected.float().abs() + (gate * up).abs() * 2.0 ** -22
                 + finfo.smallest_normal / 16)
    assert ((actual - expected.float()).abs() <= tolerance).all()
    assert (actual != expected.float()).sum() <= max(1, expected.numel() // 100)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("width", [1536, 40, 7])
def test_act_and_mul_matches_hf(act, dtype, width):
    torch.manual_seed(width)
    gate_up = torch.randn(9, 2 * width, dtype=dtype) * 3
    gate, up = gate_up.chunk(2, dim=-1)
    (device_gate_up,) = on_device(gate_up)
    assert_close_with_gpu_math(ops.act_and_mul(device_gate_up, FUSED_CODES[act]),
                               ACT2FN[act](gate) * up, gate, up)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,rotary_dim", [(64, 64), (64, 16), (80, 20), (256, 256)])
def test_rotary_matches_hf(dtype, head_dim, rotary_dim):
    qkv, q, cos, sin, expected = rotary_case(dtype, head_dim, rotary_dim)
    tokens, heads = q.shape[:2]
    device_qkv, device_cos, device_sin = on_device(qkv, cos, sin)
    device_q = device_qkv[:, :heads * head_dim].view(tokens, heads, head_dim)
    ops.rotary_(device_q, device_cos, device_sin)
    assert_close_as(device_q.contiguous(), expected.contiguous())
    assert torch.equal(device_qkv[:, heads * head_dim:].cpu(), qkv[:, heads * head_dim:])


@pytest.mark.parametrize("dtype", DTYPES)
def test_cache_write_of_split_qkv_rows_equals_index_copy(dtype):
    tokens, heads, head_dim = 37, 3, 64
    qkv = torch.randn(tokens, (9 + 2 * heads) * head_dim).to(dtype)
    _, k, v = qkv.split([9 * head_dim, heads * head_dim, heads * head_dim], dim=-1)
    k, v = k.view(tokens, heads, head_dim), v.view(tokens, heads, head_dim)
    rows = torch.randperm(640 * heads)[:tokens * heads]
    expected = [torch.randn(640 * heads, head_dim).to(dtype) for _ in range(2)]
    caches = on_device(*expected)
    device_qkv, device_rows = on_device(qkv, rows)
    _, dk, dv = device_qkv.split([9 * head_dim, heads * head_dim, heads * head_dim], dim=-1)
    ops.write_kv_(*caches, dk.view(tokens, heads, head_dim), dv.view(tokens, heads, head_dim),
                  device_rows)
    for cache, new in zip(expected, (k, v)):
        cache.index_copy_(0, rows, new.reshape(-1, head_dim))
    assert all(torch.equal(a.cpu(), b) for a, b in zip(caches, expected))


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_logsumexp_matches_torch(dtype):
    logits = argmax_case(dtype)
    tokens, lse = ops.argmax_logsumexp(*on_device(logits))
    assert torch.equal(tokens.cpu(), logits.argmax(dim=-1))
    torch.testing.assert_close(lse.cpu(), torch.logsumexp(logits.float(), dim=-1), rtol=1e-6,
                               atol=1e-5, equal_nan=True)


def test_bad_arguments_are_refused_clearly():
    x = torch.randn(4, 8, device=TRITON_DEVICE)
    with pytest.raises(ValueError, match="weight must be"):
        ops.rms_norm(x, torch.randn(8, dtype=torch.bfloat16, device=TRITON_DEVICE), 1e-6)
    with pytest.raises(ValueError, match="residual must match"):
        ops.rms_norm(x, x[0], 1e-6, torch.randn(4, 9, device=TRITON_DEVICE))
    with pytest.raises(ValueError, match="contiguous features"):
        ops.rms_norm(x.t(), x[:, 0], 1e-6)
    with pytest.raises(ValueError, match="width even"):
        ops.act_and_mul(torch.randn(4, 7, device=TRITON_DEVICE), 0)
    with pytest.raises(ValueError, match="activation must be"):
        ops.act_and_mul(x, 2)
    with pytest.raises(ValueError, match="rotary_dim"):
        ops.rotary_(torch.randn(4, 2, 8, device=TRITON_DEVICE), x[:, :5], x[:, :5])
    with pytest.raises(ValueError, match="rows"):
        ops.write_kv_(x, x, x.view(4, 1, 8), x.view(4, 1, 8), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="float"):
        ops.argmax_logsumexp(torch.zeros(2, 3, dtype=torch.int64, device=TRITON_DEVICE))


def test_layers_get_the_cpp_kernels_or_these_by_device():
    x = torch.zeros(2, 8, dtype=torch.bfloat16)
    assert fused_ops.for_tensor(x) is cpu_kernels.for_tensor(x)
    if torch.cuda.is_available():
        assert fused_ops.for_tensor(x.cuda()) is ops
        assert fused_ops.for_tensor(x.cuda().to(torch.int64)) is None
