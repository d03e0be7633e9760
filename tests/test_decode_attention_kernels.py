"""The paged decode-attention kernels, the C++ one (csrc/paged_decode_attention.cpp) and the
OpenAI-Triton one for CUDA (layers/triton_paged_attention.py: on the GPU where there is one, else
by Triton's CPU interpreter), compute what plain PyTorch computes on the gathered blocks: GQA /
MHA / MQA, several head dims and block sizes, shuffled blocks, ALiBi, sliding windows. (How
PagedAttention routes a step's rows to them: test_cpu_kernels_prefill and
test_cuda_decode_path.)"""
from types import SimpleNamespace

import pytest
import torch

from conftest import TRITON_DEVICE
from tritonlm.layers import cpu_kernels, triton_paged_attention, triton_support


@pytest.fixture(scope="module")
def cpu_kernel():
    return cpu_kernels.build()  # raises with the compiler's output if it cannot build


@pytest.fixture(scope="module", params=["cpu", "triton"])
def kernel(request):
    if request.param == "cpu":
        return request.getfixturevalue("cpu_kernel")
    assert triton_support.available(TRITON_DEVICE)  # no GPU: TRITON_INTERPRET=1 (conftest)

    def on_triton_device(*args):
        moved = (a.to(TRITON_DEVICE) if isinstance(a, torch.Tensor) else a for a in args)
        return triton_paged_attention.decode_attention(*moved).cpu()
    return SimpleNamespace(decode_attention=on_triton_device)


def make_case(num_seqs, hq, hkv, head_dim, context_lens, dtype=torch.float32, block_size=16,
              num_blocks=64, seed=0):
    """Random q and caches [num_blocks * Hkv, bs, D]; each sequence gets distinct blocks in
    shuffled order (rows of the [num_blocks * Hkv, bs, D] view, as in DecodeRows.blocks)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(num_seqs, hq, head_dim, generator=g).to(dtype)
    shape = (num_blocks * hkv, block_size, head_dim)
    key_cache = torch.randn(shape, generator=g).to(dtype)
    value_cache = torch.randn(shape, generator=g).to(dtype)
    nb = -(-max(context_lens) // block_size)
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:nb] for _ in range(num_seqs)])
    rows = tables[:, None, :] * hkv + torch.arange(hkv)[None, :, None]  # [B, Hkv, nb]
    return q, key_cache, value_cache, rows.contiguous(), torch.tensor(context_lens)


def reference(q, key_cache, value_cache, rows, context_lens, scale, slopes=None, window=0):
    """Gather the blocks, [B, Hq, L] scores masked to each context (and window), softmax, matmul;
    all in float32."""
    num_seqs, hq, head_dim = q.shape
    hkv, nb = rows.shape[1:]
    bs = key_cache.shape[1]
    keys, values = (cache.float().index_select(0, rows.reshape(-1))
                    .view(num_seqs, hkv, nb * bs, head_dim).repeat_interleave(hq // hkv, dim=1)
                    for cache in (key_cache, value_cache))
    scores = torch.einsum("bhd,bhld->bhl", q.float(), keys) * scale
    distance = torch.arange(nb * bs)[None, :] - (context_lens - 1)[:, None]  # [B, L]
    if slopes is not None:
        scores += slopes[None, :, None] * distance[:, None, :]
    visible = distance <= 0
    if window:
        visible &= distance > -window
    scores.masked_fill_(~visible[:, None, :], float("-inf"))
    return torch.einsum("bhl,bhld->bhd", torch.softmax(scores, dim=-1), values)


CONTEXTS = [1, 16, 17, 5, 48, 33, 100, 64, 2, 31]  # 1, multiples of block_size, and between


@pytest.mark.parametrize("head_dim", [64, 80])
@pytest.mark.parametrize("hq,hkv", [(9, 3), (4, 4), (6, 1)], ids=["gqa", "mha", "mqa"])
@pytest.mark.parametrize("variant", ["plain", "alibi", "window"])
def test_float32_matches_reference(kernel, head_dim, hq, hkv, variant):
    q, k, v, rows, ctx = make_case(len(CONTEXTS), hq, hkv, head_dim, CONTEXTS)
    scale = head_dim ** -0.5
    slopes = torch.linspace(0.05, 0.5, hq) if variant == "alibi" else None
    window = 20 if variant == "window" else 0
    out = kernel.decode_attention(q, k, v, rows, ctx, scale, slopes, window)
    assert out.dtype == torch.float32 and out.shape == q.shape
    torch.testing.assert_close(out, reference(q, k, v, rows, ctx, scale, slopes, window),
                               atol=1e-5, rtol=1e-5)


def torch_decode_path(q, k, v, rows, ctx, scale):
    """PagedAttention._decode's arithmetic in q's dtype: gathered K/V, batched matmuls, float32
    softmax whose probabilities are cast back to q's dtype."""
    num_seqs, hq, head_dim = q.shape
    hkv, nb = rows.shape[1:]
    bs = k.shape[1]
    keys, values = (c.index_select(0, rows.view(-1)).view(num_seqs, hkv, nb * bs, head_dim)
                    for c in (k, v))
    qg = q.view(num_seqs, hkv, hq // hkv, head_dim)
    scores = torch.matmul(keys, qg.transpose(-1, -2)).float() * scale  # [B, Hkv, L, G]
    visible = torch.arange(nb * bs)[None, :] < ctx[:, None]
    scores.masked_fill_(~visible[:, None, :, None], float("-inf"))
    probs = torch.softmax(scores, dim=-2).to(q.dtype)
    return torch.matmul(probs.transpose(-1, -2), values).view(num_seqs, hq, head_dim)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 80])
@pytest.mark.parametrize("hq,hkv", [(9, 3), (4, 4), (6, 1)], ids=["gqa", "mha", "mqa"])
def test_half_precision_within_rounding_of_float32(kernel, dtype, head_dim, hq, hkv):
    q, k, v, rows, ctx = make_case(len(CONTEXTS), hq, hkv, head_dim, CONTEXTS, dtype=dtype)
    scale = head_dim ** -0.5
    expected = reference(q, k, v, rows, ctx, scale)  # float32 on the same (rounded) inputs
    out = kernel.decode_attention(q, k, v, rows, ctx, scale)
    assert out.dtype == dtype
    ours = (out.float() - expected).abs().max().item()
    theirs = (torch_decode_path(q, k, v, rows, ctx, scale).float() - expected).abs().max().item()
    assert ours < 1e-2
    assert ours <= theirs + 2e-3  # no worse than the PyTorch path (float32 probabilities)


# bfloat16 with D a multiple of 32 and bs a multiple of 16 takes the AVX512-BF16 path where the
# CPU has it, else (D a multiple of two registers, bs of a register's lanes) the widened path of
# decode_attention_widened.h: ALiBi, windows starting mid-block, several key groups per block, up
# to 4 heads per register tile and beyond.
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (128, 32), (256, 16), (96, 48)])
@pytest.mark.parametrize("hq,hkv", [(9, 3), (4, 4), (7, 1)], ids=["gqa", "mha", "mqa"])
@pytest.mark.parametrize("variant", ["plain", "alibi", "window"])
def test_bfloat16_variants(kernel, head_dim, block_size, hq, hkv, variant):
    # 9 sequences: with 2 threads the CPU kernel hands out a sequence's kv heads together
    contexts = [1, block_size, block_size + 1, 3 * block_size, 70, 9, 2 * block_size - 1,
                4 * block_size + 3, 5]
    q, k, v, rows, ctx = make_case(len(contexts), hq, hkv, head_dim, contexts,
                                   dtype=torch.bfloat16, block_size=block_size, num_blocks=24)
    scale = head_dim ** -0.5
    slopes = torch.linspace(0.05, 0.5, hq) if variant == "alibi" else None
    window = 21 if variant == "window" else 0
    out = kernel.decode_attention(q, k, v, rows, ctx, scale, slopes, window)
    expected = reference(q, k, v, rows, ctx, scale, slopes, window)
    torch.testing.assert_close(out.float(), expected, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fused", ["rows", "heads"])
def test_query_may_be_a_view_of_fused_qkv(kernel, dtype, fused):
    """q as the query part of a fused QKV output: rows further apart ([q | k | v] per token, read
    in place) or heads too ([q k v] per head, as GPT-NeoX fuses them)."""
    contexts = [1, 16, 17, 70, 9, 33, 5, 48, 2]
    q, k, v, rows, ctx = make_case(len(contexts), 9, 3, 64, contexts, dtype=dtype)
    if fused == "rows":
        qkv = torch.cat([q.flatten(1), torch.randn(len(contexts), 6 * 64).to(dtype)], dim=1)
        q_view = qkv[:, :9 * 64].view(-1, 9, 64)
    else:
        qkv = torch.cat([q, torch.randn(len(contexts), 9, 128).to(dtype)], dim=2)
        q_view = qkv[:, :, :64]
    assert not q_view.is_contiguous()
    expected = reference(q, k, v, rows, ctx, 0.125)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(kernel.decode_attention(q_view, k, v, rows, ctx, 0.125).float(),
                               expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("head_dim", [72, 20, 128, 256])  # a vector tail, less than a vector
def test_other_head_dims_and_block_size(kernel, head_dim):
    q, k, v, rows, ctx = make_case(5, 4, 2, head_dim, [1, 9, 16, 40, 23], block_size=8)
    slopes = torch.linspace(0.1, 0.4, 4)
    out = kernel.decode_attention(q, k, v, rows, ctx, 0.1, slopes, 12)
    torch.testing.assert_close(out, reference(q, k, v, rows, ctx, 0.1, slopes, 12),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype,head_dim", [(torch.float32, 64), (torch.bfloat16, 64),
                                             (torch.bfloat16, 80)])
def test_stale_cache_contents_never_reach_the_output(kernel, dtype, head_dim):
    """Keys past a context or before a window, in blocks the sequence owns, may hold anything a
    freed sequence left there (inf, NaN): they must not reach the output (0 * NaN is NaN)."""
    contexts, window, hkv, bs = [1, 16, 19, 37, 50], 13, 2, 16
    q, k, v, _, ctx = make_case(len(contexts), 6, hkv, head_dim, contexts, dtype=dtype)
    nb = -(-max(contexts) // bs)
    tables = torch.randperm(64, generator=torch.Generator().manual_seed(3))[:len(contexts) * nb]
    rows = (tables.view(-1, nb)[:, None, :] * hkv + torch.arange(hkv)[None, :, None]).contiguous()
    expected = reference(q, k, v, rows, ctx, 0.125, None, window)
    poisoned_k, poisoned_v = k.clone(), v.clone()
    for b, context in enumerate(contexts):
        for pos in range(nb * bs):
            if pos >= context or pos <= context - 1 - window:
                row = rows[b, :, pos // bs]
                poisoned_k[row, pos % bs] = float("nan")
                poisoned_v[row, pos % bs] = float("inf") if pos % 2 else float("nan")
    out = kernel.decode_attention(q, poisoned_k, poisoned_v, rows, ctx, 0.125, None, window)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)


def test_empty_context_gives_zeros(kernel):
    q, k, v, rows, _ = make_case(2, 4, 2, 64, [16, 16], dtype=torch.bfloat16)
    out = kernel.decode_attention(q, k, v, rows, torch.tensor([0, 16]), 0.125)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and out[1].isfinite().all()


@pytest.mark.parametrize("splits", [2, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("variant", ["plain", "alibi", "window"])
def test_triton_context_splits_match_reference(dtype, variant, splits):
    """The Triton kernel with each row's context split over several programs (few rows on a
    GPU), merged by the second kernel: splits that get no key (short contexts, blocks before a
    window), an empty context, GQA and MQA."""
    contexts = [1, 16, 17, 100, 0, 64, 33, 5]
    for hq, hkv in ((9, 3), (6, 1)):
        q, k, v, rows, ctx = make_case(len(contexts), hq, hkv, 64, contexts, dtype=dtype)
        slopes = torch.linspace(0.05, 0.5, hq) if variant == "alibi" else None
        window = 20 if variant == "window" else 0
        moved = [t.to(TRITON_DEVICE) for t in (q, k, v, rows, ctx)]
        out = triton_paged_attention.decode_attention(
            *moved, 0.125, None if slopes is None else slopes.to(TRITON_DEVICE), window,
            splits=splits).cpu()
        expected = reference(q, k, v, rows, ctx, 0.125, slopes, window)
        tolerance = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out.float(), expected.nan_to_num(0.0), atol=tolerance,
                                   rtol=tolerance)
        assert torch.equal(out[4], torch.zeros_like(out[4]))  # the empty context


def test_two_threads_match_one(cpu_kernel):
    kernel = cpu_kernel
    q, k, v, rows, ctx = make_case(8, 9, 3, 64, [1, 200, 37, 16, 90, 5, 128, 64],
                                   dtype=torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel.decode_attention(q, k, v, rows, ctx, 0.125)
        torch.set_num_threads(2)
        two = kernel.decode_attention(q, k, v, rows, ctx, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_bad_inputs_raise_clear_errors(cpu_kernel):
    kernel = cpu_kernel
    q, k, v, rows, ctx = make_case(3, 4, 2, 64, [5, 16, 20])
    with pytest.raises(RuntimeError, match="block_rows must be int64, got Int"):
        kernel.decode_attention(q, k, v, rows.int(), ctx, 0.1)
    with pytest.raises(RuntimeError, match="context_lens must be int64"):
        kernel.decode_attention(q, k, v, rows, ctx.int(), 0.1)
    with pytest.raises(RuntimeError, match="must have q's dtype"):
        kernel.decode_attention(q, k.bfloat16(), v, rows, ctx, 0.1)
    with pytest.raises(RuntimeError, match="the caches, block_rows and context_lens must be"):
        kernel.decode_attention(q, k, v, rows.transpose(1, 2).contiguous().transpose(1, 2),
                                ctx, 0.1)
    with pytest.raises(RuntimeError, match="multiple of the kv heads"):
        kernel.decode_attention(q[:, :3].contiguous(), k, v, rows, ctx, 0.1)
    with pytest.raises(RuntimeError, match="exceeds the 2 blocks"):
        kernel.decode_attention(q, k, v, rows, torch.tensor([5, 16, 33]), 0.1)
    bad_rows = rows.clone()
    bad_rows[1, 0, 0] = k.shape[0]
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernel.decode_attention(q, k, v, bad_rows, ctx, 0.1)
    with pytest.raises(RuntimeError, match="alibi_slopes must be"):
        kernel.decode_attention(q, k, v, rows, ctx, 0.1, torch.ones(3))


def test_load_returns_none_when_turned_off(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    monkeypatch.setenv("TRITONLM_CPU_KERNELS", "0")
    assert cpu_kernels.load() is None


def test_triton_kernel_rejects_shapes_that_do_not_fit():
    q, k, v, rows, ctx = make_case(3, 4, 2, 64, [5, 16, 20])
    with pytest.raises(ValueError, match="do not fit together"):
        triton_paged_attention.decode_attention(q[:, :3], k, v, rows, ctx, 0.1, None, 0)
    with pytest.raises(ValueError, match="do not fit together"):
        triton_paged_attention.decode_attention(q, k[..., :32], v[..., :32], rows, ctx, 0.1, None, 0)
