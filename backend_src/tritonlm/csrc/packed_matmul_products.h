// The packed matmul's two ways of multiplying a block's weight pairs (packed_matmul.h has the
// layout and the tiles that run them), and what a pair row of each weight element holds.
#pragma once
#include "packed_matmul_registers.h"

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)

#include <cstring>
#include <type_traits>

namespace tritonlm {
namespace packed_matmul {

constexpr int64_t kBlock = 32;        // output features per packed block

template <typename Isa>
constexpr int kVecs = kBlock / Isa::kLanes;  // registers across a block's 32 features

// The two ways a tile adds x's feature pair times a block's weight pair to its accumulators
// (bf16 products are exact in float32; WidenedFma adds a pair's odd product, then its even one,
// each rounded once, which is how Intel documents vdpbf16ps):
// - DotProducts (AVX512-BF16): vdpbf16ps on x's bf16 pairs, 32 products an instruction;
// - WidenedFma: each weight pair split into its float32 halves (bf16: a shift, a mask; int8:
//   sign extensions and conversions), then two FMAs
//   per lane, on x widened to float32 once per matmul. Where vdpbf16ps issues at half the FMA
//   rate (Intel Xeons without AMX: 95 vs 193 GFLOPS a core measured), this doubles the peak; on
//   AVX2 it is the only way, and reads half the bytes of float32 weights.
// x points at row 0's pair; rows lie x_stride apart.
#ifdef __AVX512BF16__
struct DotProducts {
  using X = uint16_t;
  using W = uint16_t;
  using P = void;
  using Isa = Avx512;
  static constexpr bool kGroups = false;
  static constexpr bool kPrewidens = false;
  static constexpr bool kIntegerDots = false;
  template <int R>
  static void accumulate(__m512 (&acc)[R][2], const uint16_t* w, const X* x, int64_t x_stride) {
    const __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(w + kBlock);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * x_stride, sizeof(pair));
      const __m512i xs = _mm512_set1_epi32(pair);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], (__m512bh)xs, (__m512bh)w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], (__m512bh)xs, (__m512bh)w1);
    }
  }
};
#endif

// Elements of W per lane of a pair row: a pair of bf16, int8 or widened float32 values; one
// byte of 4 bits (Int4Quads: on average, half a quad row per pair row).
template <typename W>
constexpr bool kQuads = std::is_same_v<W, Int4Quads>;
template <typename W>
constexpr int64_t kLaneElems = std::is_same_v<W, Int4Pair> || kQuads<W> ? 1 : 2;
template <typename W>
constexpr int64_t kPairElems = kBlock * kLaneElems<W>;
// Pair rows a block stores: 4 bits in whole quad rows, a zero pair row after an odd count.
template <typename W>
constexpr int64_t stored_pairs(int64_t pairs) {
  return kQuads<W> ? pairs + pairs % 2 : pairs;
}
// Pair rows of W in `bytes`.
template <typename W>
constexpr int64_t pairs_in(int64_t bytes) {
  return bytes / (kPairElems<W> * static_cast<int64_t>(sizeof(W)));
}
// Pair row p of the block at w, as the tiles widen it.
template <typename W>
using PairRow = std::conditional_t<kQuads<W>, Int4Row, const W*>;
template <typename W>
PairRow<W> pair_row(const W* w, int64_t p) {
  if constexpr (kQuads<W>)
    return {w + (p - p % 2) * kBlock, static_cast<int>(p % 2)};
  else
    return w + p * kPairElems<W>;
}

// Params: the element of group parameters (float, or c10::Half where the weight's scales and
// biases are exact in float16: GGUF's and our converter's; at 4 bits in groups of 32 they are
// then a fifth of the bytes, not a third), where each group of input features has its own scale
// and bias per output feature (w = q * scale + bias): a tile sums q * x over a group, then adds
// scale * sum + bias * (x's sum over the group), so widening a weight costs no more than for
// bf16 or int8 rows. void: the weights are the values (bf16) or a per-feature scale multiplies
// the sums (int8 rows).
// XT: x's element: float (float_rows in packed_matmul_widen.h), or int8 for the integer dots.
template <typename I, typename Weight, typename Params = void, typename XT = float>
struct WidenedFma {
  using X = XT;
  using W = Weight;
  using P = Params;
  using Isa = I;
  using F = typename I::F;
  static constexpr int V = kVecs<I>;
  static constexpr bool kGroups = !std::is_void_v<Params>;
  // Whether a prompt's row tiles multiply a block widened once instead: quantized weights,
  // where widening costs more than a float32 load (bf16 measured slower so on Zen 1).
  static constexpr bool kPrewidens =
      std::is_same_v<Weight, int8_t> || std::is_same_v<Weight, Int4Pair> || kQuads<Weight>;
  static constexpr bool kIntegerDots = false;  // Int4Dots (packed_matmul_int8_dots.h)
  // Register v's lanes of a pair row as float32 (the stored values, not dequantized).
  static void widen(PairRow<W> w, int v, F& even, F& odd) {
    if constexpr (kQuads<W>)
      I::widen_pairs(w, v, even, odd);
    else
      I::widen_pairs(w + v * I::kLanes * kLaneElems<W>, even, odd);
  }
  // Register v's lanes of a group's [2, 32] scales and biases.
  static void group_params(const P* group, int v, F& scale, F& bias) {
    scale = I::load(group + v * I::kLanes);
    bias = I::load(group + kBlock + v * I::kLanes);
  }
  // Half kHalf of the block's features only (registers [kHalf * V/2, (kHalf + 1) * V/2)), for
  // tiles of more rows than registers for a whole block (AVX2): each row's x broadcast once per
  // half vector pair instead of once per vector, the odd products first as in accumulate.
  template <int R, int kHalf>
  static void accumulate_half(F (&acc)[R][V], PairRow<W> w, const X* x, int64_t x_stride) {
    constexpr int H = V / 2;
    F even[H], odd[H], unused;  // widened twice: 12 accumulators leave no registers for both
    for (int v = 0; v < H; ++v) widen(w, kHalf * H + v, unused, odd[v]);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const F xo = I::splat(x[r * x_stride + 1]);
      for (int v = 0; v < H; ++v)
        acc[r][kHalf * H + v] = I::fma(xo, odd[v], acc[r][kHalf * H + v]);
    }
    for (int v = 0; v < H; ++v) widen(w, kHalf * H + v, even[v], unused);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const F xe = I::splat(x[r * x_stride]);
      for (int v = 0; v < H; ++v)
        acc[r][kHalf * H + v] = I::fma(xe, even[v], acc[r][kHalf * H + v]);
    }
  }
  template <int R>
  static void accumulate(F (&acc)[R][V], PairRow<W> w, const X* x, int64_t x_stride) {
    if constexpr (V <= 2) {  // the pair row widened once, each row's x broadcast once
      F even[V], odd[V];
      for (int v = 0; v < V; ++v) widen(w, v, even[v], odd[v]);
#pragma GCC unroll 12
      for (int r = 0; r < R; ++r) {
        const F xe = I::splat(x[r * x_stride]), xo = I::splat(x[r * x_stride + 1]);
        for (int v = 0; v < V; ++v) acc[r][v] = I::fma(xe, even[v], I::fma(xo, odd[v], acc[r][v]));
      }
    } else {  // 16 registers hold no whole widened pair row beside the accumulators: a vector's
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) {
        F even, odd;
        widen(w, v, even, odd);
#pragma GCC unroll 12
        for (int r = 0; r < R; ++r)
          acc[r][v] = I::fma(I::splat(x[r * x_stride]), even,
                             I::fma(I::splat(x[r * x_stride + 1]), odd, acc[r][v]));
      }
    }
  }
};

}  // namespace packed_matmul
}  // namespace tritonlm

#endif
