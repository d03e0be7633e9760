// 4-bit grouped weights times int8 inputs (w4a8) in the packed matmul's tiling (packed_matmul.h):
// each row's inputs quantized per group of the weight (symmetric, a float scale each), then
// vpmaddubsw multiplies a pair row's 0..15 values by the int8 feature pair and sums the pair in
// int16, eight pair rows sum in int16 (8 x 2 x 15 x 127 < 2^15), and int32 sums hold the group.
// A group adds x's scale * (float(sum) * the weight's scale + the weight's bias * x's integer
// sum over the group): the float math on x rounded to int8. (Rounded x in the bias term too:
// then x's rounding errors meet q * scale + bias, centred on zero, not q * scale alone; on int4
// SmolLM2 the float sum there raised perplexity 8%, the rounded one 0.55%.) Widening 4 bits to
// float32 costs about four instructions a weight row vector per two FMAs; here a 32-byte pair row
// costs five integer instructions, then two multiply-adds per row (Zen 1: the float path is
// compute-bound at batch 1, reading int4 at a quarter of its memory bandwidth).
// The integer work is AVX2 on either build; only the conversion to the tile's float registers
// differs in width. CPUs with AVX512-VNNI take Int4Vnni and Int8Vnni instead, 4 bits in quad rows
// (packed_matmul_vnni_dots.h, which names what this build uses). The tiles inline every
// group_sums: a call per group left a tile's sums in memory (Zen 4, int4 at 32 rows 12-22%
// slower).
#pragma once
#include "packed_matmul.h"

#include <vector>

#ifdef TRITONLM_PACKED_MATMUL

namespace tritonlm {
namespace packed_matmul {

// Rows of x quantized for Int4Dots: int8 values [m, features], a scale and the integer sum per
// row and group, and the rounded x's sum over each group. Held in the calling thread's buffers,
// as float_rows holds widened x (packed_matmul_widen.h), not in three tensors a matmul (363
// allocations in a batch-1 step of int4 SmolLM2).
struct QuantizedRows {
  std::vector<int8_t> values;  // x's feature count (even) a row
  std::vector<float> scales;   // [m, groups, 2]: the scale, the group's integer sum (exact)
  std::vector<float> sums;     // [m, groups]: scale * the group's integer sum
};

// x [m, k] (float or bfloat16, k even) quantized per group of `group_size` features.
template <typename T>
const QuantizedRows& quantize_rows(const at::Tensor& x, int64_t groups, int64_t group_size) {
  const int64_t m = x.size(0), k = x.size(1);
  thread_local QuantizedRows q;
  q.values.resize(m * k);
  q.scales.resize(m * groups * 2);
  q.sums.resize(m * groups);
  const T* xs = reinterpret_cast<const T*>(x.data_ptr());
  int8_t* values = q.values.data();
  float* scales = q.scales.data();
  float* sums = q.sums.data();
  for (int64_t r = 0; r < m; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      const T* in = xs + r * x.stride(0) + g * group_size;
      int8_t* out = values + r * k + g * group_size;
      const int64_t n = g + 1 < groups ? group_size : k - g * group_size;  // with the padding
      Vec top(0.f);
      int64_t i = 0;
      for (; i + W <= n; i += W) top = at::vec::maximum(top, load_float(in + i).abs());
      float absmax = at::vec::vec_reduce_all<float>(
          [](const Vec& a, const Vec& b) { return at::vec::maximum(a, b); }, top);
      for (; i < n; ++i) absmax = std::max(absmax, std::abs(static_cast<float>(in[i])));
      const float scale = absmax / 127.f, inverse = absmax > 0.f ? 127.f / absmax : 0.f;
      int32_t sum = 0;
      for (i = 0; i < n; ++i) {  // nearest even, as the float32 -> int32 conversion rounds
        out[i] = static_cast<int8_t>(std::nearbyint(static_cast<float>(in[i]) * inverse));
        sum += out[i];
      }
      scales[2 * (r * groups + g)] = scale;
      scales[2 * (r * groups + g) + 1] = static_cast<float>(sum);
      sums[r * groups + g] = static_cast<float>(sum) * scale;
    }
  return q;
}

// A tile's int32 sums of features 0-7, 8-15, 16-23, 24-31 per row, as float32 times the row's
// x scale.
template <typename I, int R>
void scaled_sums(const __m256i (&wide)[R][4], const float* x_scales, int64_t x_scales_stride,
                 typename I::F (&sums)[R][kVecs<I>]) {
  for (int r = 0; r < R; ++r) {
    typename I::F features[kVecs<I>];
    I::int32_octets(wide[r], features);
    const typename I::F scale = I::splat(x_scales[r * x_scales_stride]);
    for (int v = 0; v < kVecs<I>; ++v) sums[r][v] = I::mul(features[v], scale);
  }
}

// The grouped 4-bit WidenedFma's layout, group parameters (P) and epilogue; its own group sums.
template <typename P>
struct Int4Dots : WidenedFma<Native, Int4Pair, P, int8_t> {
  using Base = WidenedFma<Native, Int4Pair, P, int8_t>;
  using typename Base::F;
  using typename Base::Isa;
  using Base::V;
  static constexpr bool kPrewidens = false;
  static constexpr bool kIntegerDots = true;
  static constexpr int kRows = 4;  // 8 int16 sums + 2 weight registers + x's pair: 16 registers
  static constexpr int64_t kPairsPerInt16 = 8;

  // sums[r] = x's scale for the group * sum over pairs [begin, end) of the 32 features' q * x;
  // w: the block, x: row 0's first feature; prefetch(p) asks for what pair row p's tile needs.
  template <int R, typename Prefetch>
  __attribute__((always_inline)) static void group_sums(
      F (&sums)[R][V], const Int4Pair* w, const int8_t* x, int64_t x_stride,
      const float* x_scales, int64_t x_scales_stride, int64_t begin, int64_t end,
      Prefetch prefetch) {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    // int16 sums [r][0]: features 0-7 in the low 128 bits, 16-23 in the high; [r][1]: 8-15,
    // 24-31 (vpunpck*bw interleave within 128-bit lanes); int32 sums [r]: 0-7, 8-15, 16-23, 24-31
    __m256i wide[R][4];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 4; ++c) wide[r][c] = _mm256_setzero_si256();
    for (int64_t p0 = begin; p0 < end; p0 += kPairsPerInt16) {
      __m256i narrow[R][2];
      for (int r = 0; r < R; ++r) narrow[r][0] = narrow[r][1] = _mm256_setzero_si256();
      const int64_t stop = std::min(end, p0 + kPairsPerInt16);
      for (int64_t p = p0; p < stop; ++p) {
        prefetch(p);
        const __m256i bytes =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * kBlock));
        const __m256i even = _mm256_and_si256(bytes, nibble);
        const __m256i odd = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
        const __m256i w0 = _mm256_unpacklo_epi8(even, odd), w1 = _mm256_unpackhi_epi8(even, odd);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          int16_t pair;
          std::memcpy(&pair, x + r * x_stride + 2 * p, sizeof(pair));
          const __m256i xs = _mm256_set1_epi16(pair);
          narrow[r][0] = _mm256_add_epi16(narrow[r][0], _mm256_maddubs_epi16(w0, xs));
          narrow[r][1] = _mm256_add_epi16(narrow[r][1], _mm256_maddubs_epi16(w1, xs));
        }
      }
      for (int r = 0; r < R; ++r)
        for (int h = 0; h < 2; ++h) {
          wide[r][h] = _mm256_add_epi32(
              wide[r][h], _mm256_cvtepi16_epi32(_mm256_castsi256_si128(narrow[r][h])));
          wide[r][2 + h] = _mm256_add_epi32(
              wide[r][2 + h], _mm256_cvtepi16_epi32(_mm256_extracti128_si256(narrow[r][h], 1)));
        }
    }
    scaled_sums<Isa>(wide, x_scales, x_scales_stride, sums);
  }
};

// Grouped int8 weights (w8a8; int8 with a scale per row is given groups too, see
// quantized_matmul.py): a 64-byte pair row sign-extended to int16 once, then per row vpmaddwd by
// x's feature pair, summing the pair in int32 (127 x 127 x 2 a pair: no group overflows).
// Widening int8 to float32 costs six instructions per eight weight pairs; this, one per sixteen.
template <typename P>
struct Int8Dots : WidenedFma<Native, int8_t, P, int8_t> {
  using Base = WidenedFma<Native, int8_t, P, int8_t>;
  using typename Base::F;
  using typename Base::Isa;
  using Base::V;
  static constexpr bool kPrewidens = false;
  static constexpr bool kIntegerDots = true;
  static constexpr int kRows = 3;  // 12 int32 sums + a weight register + 3 x pairs: 16 registers

  template <int R, typename Prefetch>
  __attribute__((always_inline)) static void group_sums(
      F (&sums)[R][V], const int8_t* w, const int8_t* x, int64_t x_stride,
      const float* x_scales, int64_t x_scales_stride, int64_t begin, int64_t end,
      Prefetch prefetch) {
    __m256i wide[R][4];  // int32 sums of features 0-7, 8-15, 16-23, 24-31
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 4; ++c) wide[r][c] = _mm256_setzero_si256();
    for (int64_t p = begin; p < end; ++p) {
      prefetch(p);
      const int8_t* row = w + p * kPairElems<int8_t>;
      __m256i xs[R];
      for (int r = 0; r < R; ++r) {
        int16_t pair;
        std::memcpy(&pair, x + r * x_stride + 2 * p, sizeof(pair));
        xs[r] = _mm256_cvtepi8_epi16(_mm_set1_epi16(pair));
      }
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        const __m256i pairs = _mm256_cvtepi8_epi16(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * c)));
        for (int r = 0; r < R; ++r)
          wide[r][c] = _mm256_add_epi32(wide[r][c], _mm256_madd_epi16(pairs, xs[r]));
      }
    }
    scaled_sums<Isa>(wide, x_scales, x_scales_stride, sums);
  }
};

}  // namespace packed_matmul
}  // namespace tritonlm

#endif
