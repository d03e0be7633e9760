"""The C++ paged prefill-attention kernel (csrc/paged_prefill_attention.cpp): rows of several
queries (whole prompts, chunks after cached tokens) attend causally over blocks read in place, as
plain PyTorch computes on the gathered keys; and PagedAttention sends each row of a step to the
decode or the prefill kernel."""
import numpy as np
import pytest
import torch

from tritonlm.layers import cpu_kernels, triton_paged_attention
from tritonlm.layers.attention import PagedAttention, PagedKernels
from tritonlm.layers.attention_metadata import AttentionSpec, StepLayout, build_metadata
from tritonlm.layers.kv_cache import LayerKV

# (new query tokens, tokens already cached) per row: a 1-token row, whole prompts shorter and
# longer than a 16-query tile, and chunks after a cached prefix that ends mid-block.
ROWS = [(5, 0), (1, 3), (40, 60), (17, 0), (16, 9), (100, 21)]


def make_case(hq, hkv, head_dim, block_size, dtype=torch.float32, rows=ROWS, seed=0):
    """q [T, Hq, D] with two unused tokens before and after the rows' tokens; caches
    [num_blocks * Hkv, bs, D]; shuffled distinct blocks per row."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor([n for n, _ in rows])
    context = lens + torch.tensor([c for _, c in rows])
    starts = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)[:-1]]) + 2
    nb = int(-(-context.max() // block_size))
    num_blocks = len(rows) * nb + 3
    shape = (num_blocks * hkv, block_size, head_dim)
    key_cache, value_cache = (torch.randn(shape, generator=g).to(dtype) for _ in range(2))
    tables = torch.randperm(num_blocks, generator=g)[:len(rows) * nb].view(len(rows), nb)
    blocks = (tables[:, None, :] * hkv + torch.arange(hkv)[None, :, None]).contiguous()
    q = torch.randn(int(lens.sum()) + 4, hq, head_dim, generator=g).to(dtype)
    return q, key_cache, value_cache, blocks, starts, lens, context


def per_row(q, key_cache, value_cache, blocks, starts, lens, context, slopes, window, attend,
            dtype):
    """Per row and kv head: attend(queries [Q, G, D], keys and values [L, D] gathered, visible
    [Q, L] (causal, within the window), ALiBi bias [G, Q, L] or None) -> [Q, G, D]; tokens of no
    row stay zero."""
    out = torch.zeros(q.shape, dtype=dtype)
    hq, head_dim = q.shape[1:]
    hkv = blocks.shape[1]
    group = hq // hkv
    for b in range(len(starts)):
        length, n, first = int(context[b]), int(lens[b]), int(starts[b])
        query_pos = torch.arange(length - n, length)[:, None]
        key_pos = torch.arange(length)[None, :]
        visible = key_pos <= query_pos
        if window:
            visible &= query_pos - key_pos < window
        for h in range(hkv):
            keys, values = (cache[blocks[b, h]].reshape(-1, head_dim)[:length]
                            for cache in (key_cache, value_cache))
            heads = slice(h * group, (h + 1) * group)
            bias = (None if slopes is None
                    else slopes[heads, None, None] * (key_pos - query_pos)[None])
            out[first:first + n, heads] = attend(q[first:first + n, heads], keys, values,
                                                 visible, bias)
    return out


def reference(q, key_cache, value_cache, blocks, starts, lens, context, scale, slopes=None,
              window=0):
    """[G, Q, L] scores masked, softmax, matmul, in float32."""
    def attend(q, keys, values, visible, bias):
        scores = torch.einsum("qgd,kd->gqk", q.float(), keys.float()) * scale
        if bias is not None:
            scores += bias
        probs = scores.masked_fill(~visible[None], float("-inf")).softmax(-1)
        return torch.einsum("gqk,kd->qgd", probs, values.float())
    return per_row(q, key_cache, value_cache, blocks, starts, lens, context, slopes, window,
                   attend, torch.float32)


def sdpa_bfloat16(q, key_cache, value_cache, blocks, starts, lens, context, scale, slopes=None,
                  window=0):
    """PyTorch's own bfloat16 attention (SDPA, kv heads repeated) as Hugging Face's models run it:
    the rounding error a bf16 kernel may have."""
    def attend(q, keys, values, visible, bias):
        group = q.shape[1]
        mask = torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))[None]
        if bias is not None:
            mask = mask + bias
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1)[None], keys.expand(group, -1, -1)[None],
            values.expand(group, -1, -1)[None], attn_mask=mask[None].bfloat16(), scale=scale)
        return o[0].transpose(0, 1)
    return per_row(q, key_cache, value_cache, blocks, starts, lens, context, slopes, window,
                   attend, torch.bfloat16)


@pytest.fixture(scope="module")
def kernel():
    return cpu_kernels.build()  # raises with the compiler's output if it cannot build


def run(kernel, q, k, v, blocks, starts, lens, context, scale, slopes=None, window=0):
    out = torch.zeros_like(q)
    kernel.prefill_attention(q, k, v, blocks, starts, lens, context, scale, slopes, window, out)
    return out


@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (80, 8), (20, 24), (128, 32)])
@pytest.mark.parametrize("hq,hkv", [(9, 3), (4, 4), (6, 1)], ids=["gqa", "mha", "mqa"])
@pytest.mark.parametrize("variant", ["plain", "alibi", "window"])
def test_float32_matches_reference(kernel, head_dim, block_size, hq, hkv, variant):
    case = make_case(hq, hkv, head_dim, block_size)
    slopes = torch.linspace(0.05, 0.5, hq) if variant == "alibi" else None
    window = 23 if variant == "window" else 0
    out = run(kernel, *case, head_dim ** -0.5, slopes, window)
    expected = reference(*case, head_dim ** -0.5, slopes, window)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("variant", ["plain", "alibi", "window"])
def test_half_precision_within_rounding(kernel, dtype, variant):
    case = make_case(9, 3, 64, 16, dtype=dtype)
    slopes = torch.linspace(0.05, 0.5, 9) if variant == "alibi" else None
    window = 30 if variant == "window" else 0
    out = run(kernel, *case, 0.125, slopes, window)
    assert out.dtype == dtype
    # float32 math on the rounded inputs: only the output's rounding differs
    torch.testing.assert_close(out.float(), reference(*case, 0.125, slopes, window),
                               atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (128, 32), (96, 8), (80, 16)])
@pytest.mark.parametrize("hq,hkv", [(9, 3), (4, 4), (6, 1)], ids=["gqa", "mha", "mqa"])
@pytest.mark.parametrize("variant", ["plain", "alibi", "window"])
def test_bfloat16_as_close_as_pytorch_bfloat16(kernel, head_dim, block_size, hq, hkv, variant):
    """Head dims that are multiples of 32 take the AVX512-BF16 tiles (bf16 dot products, bf16
    probabilities) where the CPU has them, 80 the float32 tiles: either way no further from the
    float32 result than PyTorch's own bf16 attention is."""
    case = make_case(hq, hkv, head_dim, block_size, dtype=torch.bfloat16, seed=head_dim)
    slopes = torch.linspace(0.05, 0.5, hq) if variant == "alibi" else None
    window = 23 if variant == "window" else 0
    scale = head_dim ** -0.5
    exact = reference(*case, scale, slopes, window)
    ours = (run(kernel, *case, scale, slopes, window).float() - exact).abs()
    pytorch = (sdpa_bfloat16(*case, scale, slopes, window).float() - exact).abs()
    # on average as close; at worst an output rounded a bf16 step the other way
    assert ours.mean() <= 1.25 * pytorch.mean(), (ours.mean(), pytorch.mean())
    assert ours.max() <= 2 * pytorch.max(), (ours.max(), pytorch.max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stale_cache_contents_never_reach_the_output(kernel, dtype):
    """Keys after a row's context, in blocks it owns, may hold anything a freed sequence left."""
    q, k, v, blocks, starts, lens, context = make_case(6, 2, 64, 16, dtype=dtype)
    expected = run(kernel, q, k, v, blocks, starts, lens, context, 0.125)
    torch.testing.assert_close(expected.float(),
                               reference(q, k, v, blocks, starts, lens, context, 0.125),
                               atol=1e-5 if dtype == torch.float32 else 1e-2, rtol=1e-2)
    for b, length in enumerate(context.tolist()):
        for pos in range(length, blocks.shape[2] * 16):
            rows = blocks[b, :, pos // 16]
            k[rows, pos % 16] = float("nan")
            v[rows, pos % 16] = float("inf")
    assert torch.equal(run(kernel, q, k, v, blocks, starts, lens, context, 0.125), expected)


def test_two_threads_match_one(kernel):
    case = make_case(9, 3, 64, 16, dtype=torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        outputs = []
        for n in (1, 2):
            torch.set_num_threads(n)
            outputs.append(run(kernel, *case, 0.125))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(*outputs)


def test_bad_inputs_raise_clear_errors(kernel):
    q, k, v, blocks, starts, lens, context = make_case(4, 2, 64, 16)
    out = torch.zeros_like(q)

    def call(**changes):
        args = dict(q=q, key_cache=k, value_cache=v, block_rows=blocks, query_starts=starts,
                    query_lens=lens, context_lens=context, scale=0.1, alibi_slopes=None,
                    window=0, out=out)
        kernel.prefill_attention(**{**args, **changes})
    with pytest.raises(RuntimeError, match="must be contiguous int64"):
        call(query_lens=lens.int())
    with pytest.raises(RuntimeError, match="outside q's"):
        call(query_starts=starts + q.shape[0])
    with pytest.raises(RuntimeError, match="must hold its"):
        call(context_lens=lens - 1)
    bad = blocks.clone()
    bad[0, 0, 0] = k.shape[0]
    with pytest.raises(RuntimeError, match="outside the cache"):
        call(block_rows=bad)
    with pytest.raises(RuntimeError, match="multiple of the kv heads"):
        call(q=q[:, :3].contiguous(), out=out[:, :3].contiguous())
    with pytest.raises(RuntimeError, match="caches must have q's dtype"):
        call(key_cache=k.bfloat16(), value_cache=v.bfloat16())


@pytest.mark.parametrize("window", [0, 7])
@pytest.mark.parametrize("kernels", ["cpu", "triton-decode"])
def test_paged_attention_sends_each_row_to_its_kernel(kernel, window, kernels):
    """A step of decodes, a whole prompt and a chunk after cached tokens: with the kernels the
    metadata sends the decodes (blocks, context lengths) to the decode kernel and, where there is
    a prefill kernel (the CPU's; on CUDA the Triton decode kernel has none), the prefill rows'
    token ranges and contexts instead of padded masks; the output is the PyTorch path's (batched
    matmuls for decodes, SDPA for prefill)."""
    hq, hkv, head_dim, bs, num_blocks = 9, 3, 64, 16, 40
    lens = np.array([1, 21, 1, 5, 1])
    context = np.array([1, 21, 17, 45, 32])
    rng = np.random.default_rng(0)
    tables = np.stack([rng.permutation(num_blocks)[:3] for _ in context])
    first = np.cumsum(lens) - lens
    positions = np.concatenate([np.arange(c - n, c) for c, n in zip(context, lens)])
    layout = StepLayout(lens=lens, starts=context - lens, first=first, positions=positions,
                        tables=tables, block_size=bs)
    spec = AttentionSpec(num_kv_heads=hkv, sliding_window=window or None)
    attn = PagedAttention(hq, hkv, head_dim, head_dim ** -0.5, sliding_window=window or None)
    g = torch.Generator().manual_seed(1)
    shape = (num_blocks, hkv, bs, head_dim)
    attn.kv = LayerKV(torch.randn(shape, generator=g), torch.randn(shape, generator=g))
    q = torch.randn(int(lens.sum()), hq, head_dim, generator=g)
    expected = attn.attend(q, build_metadata(layout, spec, False, torch.from_numpy))
    prefill_kernel = kernels == "cpu"
    meta = build_metadata(layout, spec, False, torch.from_numpy, decode_kernel=True,
                          prefill_kernel=prefill_kernel)
    (decode,) = meta.decode
    assert decode.token_index.tolist() == first[lens == 1].tolist()
    assert decode.context_lens.tolist() == context[lens == 1].tolist()
    if prefill_kernel:
        assert meta.prefill_token_index is None and meta.prefill_mask is None
        prefill = meta.prefill_rows
        assert prefill.query_starts.tolist() == first[lens > 1].tolist()
        assert prefill.query_lens.tolist() == [21, 5]
        assert prefill.context_lens.tolist() == [21, 45]
        attn.kernels = PagedKernels(kernel.decode_attention, kernel.prefill_attention)
    else:
        assert meta.prefill_rows is None and meta.prefill_mask is not None
        attn.kernels = PagedKernels(decode=triton_paged_attention.decode_attention)
    torch.testing.assert_close(attn.attend(q, meta), expected, atol=1e-5, rtol=1e-5)
