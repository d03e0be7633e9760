"""CPU matmuls on bfloat16 weights packed once for the kernel that runs them (F.linear on a plain
[out, in] weight reorders it on every call, which costs as much as a small-batch matmul):

- tritonlm's kernel (csrc/bf16_matmul.cpp) in AMX tiles where the CPU has them (Intel Sapphire
  Rapids and later; the packed layout is AMX's). 2 Emerald Rapids cores, SmolLM2's 30 layers of
  matmuls, rows 1 / 8 / 32 / 128 / 512: 9.2 / 9.7 / 12.5 / 26.7 / 85 ms against oneDNN's AMX
  matmul's 13.2 / 13.1 / 18.5 / 24.7 / 127 and the AVX512 FMA tiles' 9.7 / 12.1 / 34 / 113 / 543;
- the same kernel's vector tiles elsewhere, and on AMX CPUs where K is not a multiple of 32:
  with AVX512-BF16, bf16 dot products or float32 FMAs on widened weights, whichever this CPU
  issues faster (Zen 4/5: dot products, twice the FLOPs; Intel Xeons: FMAs, twice the FLOPs of
  their dot products). Measured on Zen 4: 1.8-2x oneDNN at 1-4 rows, 1.2-1.3x at 32 (decode),
  equal at prompt sizes. Where its tiles widen as they go, a prompt's matmul may run faster as
  float32 sgemm on the weight widened once (sgemm_rows_for_this_cpu measures it);
- the widened FMAs on AVX512 CPUs without AVX512-BF16, where oneDNN emulates bf16
  (Cascade Lake, SmolLM2's matmuls: 1.3x oneDNN at 1 row, 2.2-2.6x at 16-32, 2.2x at 512), and
  its AVX2 build (8 lanes) on CPUs without AVX512, where oneDNN has no bf16 matmul and PyTorch's
  runs under 1 GFLOPS;
- oneDNN's blocked layout where no kernels are built (or an AMX CPU's kernels cannot use its
  tiles).

float32 keeps F.linear (MKL), which is as fast as either.
"""
import functools
import os
import time

import torch
import torch.nn.functional as F

from tritonlm.layers import cpu_kernels, huge_pages

# "amx", "dot" or "fma" forces how the kernel multiplies (benchmarks, tests); unset: AMX tiles
# where the CPU has them, else the measured faster of the other two. Decode attention on a bf16
# cache reads it the dot or fma way by the same rule (csrc/paged_decode_attention.cpp).
MULTIPLY_ENV = "TRITONLM_BF16_MATMUL"
MULTIPLY_WAYS = ("amx", "dot", "fma")
# From how many rows the kernels hand a widened weight to float32 sgemm (0: never), bf16 and
# quantized weights alike; unset, they measure.
SGEMM_ROWS_ENV = "TRITONLM_BF16_SGEMM_ROWS"
PROMPT_ROWS = 512


def _forced_multiply(kernels) -> str:
    forced = os.environ.get(MULTIPLY_ENV, "")
    if forced not in ("", *MULTIPLY_WAYS):
        raise ValueError(f"{MULTIPLY_ENV} must be one of {MULTIPLY_WAYS}, got {forced!r}")
    if forced == "dot" and not kernels.has_bf16_dot_products:
        raise ValueError(f"{MULTIPLY_ENV}=dot: this CPU has no AVX512-BF16 dot products")
    if forced == "amx" and not kernels.has_amx_tiles:
        raise ValueError(f"{MULTIPLY_ENV}=amx: this CPU (or this build) has no AMX tiles")
    return forced


@functools.cache
def amx_for_this_cpu(kernels) -> bool:
    """Whether the kernel multiplies in AMX tiles (where K is a multiple of 32): wherever the
    CPU has them, unless MULTIPLY_ENV names another way (the kernels' rule, which their
    attention follows too)."""
    return kernels.multiplies_in_amx(_forced_multiply(kernels))


@functools.cache
def widen_for_this_cpu(kernels) -> bool:
    """Whether the kernel should multiply with float32 FMAs rather than bf16 dot products: the
    way that does more FLOPs per second on this CPU, measured once per process (a few ms), or
    the one MULTIPLY_ENV names (read once; the kernels' rule, which their attention follows
    too)."""
    return not kernels.multiplies_by_bf16_dots(_forced_multiply(kernels))


@functools.cache
def sgemm_rows_for_this_cpu(kernels, widen: bool) -> int:
    """From how many rows bf16_matmul widens the whole weight to float32 and runs sgemm (MKL)
    instead of its own tiles: see measured_sgemm_rows. Tiles that widen as they go (AVX2,
    Intel's AVX512 FMAs) may lose to sgemm on prompts; bf16 dot products do twice the FLOPs of
    float32 FMAs. Measured once per process on a SmolLM2-sized weight (~0.2 s)."""
    def bf16_matmul():
        seeded = torch.Generator().manual_seed(0)
        packed = pack_pair_blocks(torch.randn(1536, 576, generator=seeded, dtype=torch.bfloat16))
        x = torch.randn(PROMPT_ROWS, 576, generator=seeded, dtype=torch.bfloat16)
        return lambda sgemm_rows: kernels.bf16_matmul(x, packed, 1536, False, None, -1, widen,
                                                      sgemm_rows)

    return measured_sgemm_rows(bf16_matmul)


def measured_sgemm_rows(make_matmul) -> int:
    """What SGEMM_ROWS_ENV says; else PROMPT_ROWS where `matmul(sgemm_rows)` (`make_matmul()`
    builds it) on PROMPT_ROWS rows runs clearly faster handing them to sgemm
    (sgemm_rows=PROMPT_ROWS) than in the kernel's tiles (0), else 0 (never)."""
    forced = os.environ.get(SGEMM_ROWS_ENV, "")
    if forced:
        if not forced.isdigit():
            raise ValueError(f"{SGEMM_ROWS_ENV} must be a row count (0: never), got {forced!r}")
        return int(forced)
    return PROMPT_ROWS if runs_faster(make_matmul(), PROMPT_ROWS, 0) else 0


def runs_faster(call, tried, base) -> bool:
    """Whether call(tried) runs over 10% faster than call(base): the best of five each, after
    a warm-up, interleaved (a host's slow moments slow both; the first warms caches and
    sgemm's threads)."""
    def seconds(argument) -> float:
        start = time.perf_counter()
        call(argument)
        return time.perf_counter() - start

    runs: list[list[float]] = [[], []]
    for _ in range(6):
        for argument, times in zip((tried, base), runs):
            times.append(seconds(argument))
    return min(runs[0][1:]) < 0.9 * min(runs[1][1:])


class PairBlockWeight:
    """A weight [N, K] as [blocks, ceil(K/2), 32, 2]: per block of 32 output features, pairs of
    consecutive input features (zero padded), the layout vdpbf16ps multiplies (and the kernel's
    FMAs widen with a shift and a mask). A block holds features 32j.. and 32j+16.. (16 each); of a
    `gated` weight ([gate; up], I features each) gate features 16j.. and up features I+16j.., so
    the kernel can apply act(gate) * up. `widen`: FMAs (default: this CPU's faster way)."""
    block = 32

    def __init__(self, weight: torch.Tensor, kernels, gated: bool = False,
                 widen: bool | None = None, sgemm_rows: int | None = None,
                 amx: bool | None = None):
        self.out_features, self.in_features = weight.shape
        self.gated, self.kernels = gated, kernels
        self.amx = amx_for_this_cpu(kernels) if amx is None else amx
        self.widen = widen_for_this_cpu(kernels) if widen is None else widen
        self.sgemm_rows = (sgemm_rows_for_this_cpu(kernels, self.widen) if sgemm_rows is None
                           else sgemm_rows)
        self.data = huge_pages.place(pack_pair_blocks(weight, gated))

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None,
               activation: int | None = None) -> torch.Tensor:
        """x @ weight.T + bias; with an `activation` code (a gated weight): act(gate) * up."""
        rows = x.reshape(-1, self.in_features)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        if bias is not None:
            bias = bias.to(torch.bfloat16).contiguous()
        out = self.kernels.bf16_matmul(rows, self.data, self.out_features, self.gated, bias,
                                       -1 if activation is None else activation, self.widen,
                                       self.sgemm_rows, self.amx)
        return out.view(*x.shape[:-1], out.shape[-1])

    def dense(self) -> torch.Tensor:
        blocks, pairs = self.data.shape[:2]
        packed = self.data.transpose(1, 2).reshape(blocks * self.block, pairs * 2)
        rows = _block_rows(self.out_features, self.gated)
        valid = rows < self.out_features
        dense = packed.new_empty(self.out_features, self.in_features)
        dense[rows[valid]] = packed[valid, :self.in_features]
        return dense


def pack_pair_blocks(weight: torch.Tensor, gated: bool = False) -> torch.Tensor:
    """weight [N, K] (any dtype) as [blocks, ceil(K/2), 32, 2] (PairBlockWeight's layout)."""
    rows = _block_rows(weight.shape[0], gated)
    padded = F.pad(weight.detach(), (0, weight.shape[1] % 2, 0, 1))[rows]  # row N: zeros
    return padded.view(-1, PairBlockWeight.block, padded.shape[1] // 2, 2).transpose(1, 2).contiguous()


def pack_block_features(per_feature: torch.Tensor, gated: bool = False) -> torch.Tensor:
    """Values per output feature [N, ...] in the order pack_pair_blocks packs the features:
    [blocks, 32, ...], zeros past N."""
    rows = _block_rows(per_feature.shape[0], gated)
    padded = torch.cat([per_feature, per_feature.new_zeros(1, *per_feature.shape[1:])])[rows]
    return padded.view(-1, PairBlockWeight.block, *per_feature.shape[1:])


def _block_rows(out_features: int, gated: bool) -> torch.Tensor:
    """For each packed row, the weight row it holds (out_features: padding): per block, 16 low
    features, then the 16 high ones `offset` further."""
    half = out_features // 2
    low_end, step, offset = (half, 16, half) if gated else (out_features, 32, 16)
    low = torch.arange(0, low_end, step)[:, None] + torch.arange(16)
    high = low + offset
    return torch.cat([low.masked_fill(low >= low_end, out_features),
                      high.masked_fill(high >= out_features, out_features)], dim=1).flatten()


class OneDnnWeight:
    """A weight in oneDNN's blocked layout for inputs of about `batch_hint` rows (any row count
    works)."""
    gated = False  # its matmul applies no activation

    def __init__(self, weight: torch.Tensor, batch_hint: int):
        self.data = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.data, bias, "none", [], "")

    def dense(self) -> torch.Tensor:
        return self.data.to_dense()


PackedWeight = PairBlockWeight | OneDnnWeight


def prepack(weight: torch.Tensor, batch_hint: int, gated: bool = False) -> PackedWeight | None:
    """`weight` [out, in] packed for this CPU's fastest bfloat16 matmul, or None where F.linear
    on the plain weight is as fast (float32, GPUs, CPUs without bf16 support in oneDNN). `gated`:
    the weight is [gate; up], and the packing may let `matmul` apply act(gate) * up itself."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
        return None
    backend = bf16_matmul_backend()
    if backend is None:
        return None
    if backend.startswith("oneDNN"):
        return OneDnnWeight(weight, batch_hint)
    return PairBlockWeight(weight, cpu_kernels.load(), gated)


def bf16_matmul_backend() -> str | None:
    """What multiplies bfloat16 weights on this CPU (prepack's choice), in words; None where
    only PyTorch's generic bfloat16 matmul would."""
    kernels = cpu_kernels.load()
    amx = "amx_bf16" in cpu_kernels.cpu_flags()
    if kernels is not None and (kernels.has_amx_tiles or not amx):
        if amx_for_this_cpu(kernels):
            return "tritonlm's packed matmul (AMX)"
        if kernels.has_bf16_dot_products:
            return "tritonlm's packed matmul (AVX512-BF16)"
        width = "AVX2" if kernels.vector_lanes == 8 else "AVX512"
        return f"tritonlm's packed matmul ({width} + FMA)"
    if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "oneDNN (AMX)" if amx else "oneDNN"
    return None
