// The integer dots of packed_matmul_int8_dots.h in AVX512-VNNI's vpdpbusd, where the CPU has it:
// Int4Vnni (4-bit weights in quad rows) and Int8Vnni; and the names of what this build uses,
// these or the AVX2 ones: Int4Integer, Int4Weight, Int8Integer, kVnniDots.
#pragma once
#include "packed_matmul_int8_dots.h"

#ifdef TRITONLM_PACKED_MATMUL

namespace tritonlm {
namespace packed_matmul {

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512VNNI__)
// A tile's int32 sums of features 0-15 and 16-31 per row, as float32 times the row's x scale.
template <int R>
void scaled_sums(const __m512i (&wide)[R][2], const float* x_scales, int64_t x_scales_stride,
                 __m512 (&sums)[R][2]) {
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 2; ++v)
      sums[r][v] = _mm512_mul_ps(_mm512_cvtepi32_ps(wide[r][v]),
                                 _mm512_set1_ps(x_scales[r * x_scales_stride]));
}

// Calls add(u, second, xs) for each unit of pair rows u and u + 1 that meets [begin, end):
// xs(r), row r's four int8 x values of the unit's features (an int32), zero for a pair row
// outside [begin, end); `second`: whether pair row u + 1 is inside. kQuadRows: units start at
// even pair rows (4-bit quad rows; a group of an odd number of pairs begins or ends mid-row), else
// at begin. x points at row 0's first feature. (xs loads as the tile broadcasts: R values held in
// registers at once spilled the 6-row tile's.)
template <bool kQuadRows, typename Add>
__attribute__((always_inline)) inline void pair_units(const int8_t* x, int64_t x_stride,
                                                      int64_t begin, int64_t end, Add add) {
  auto unit = [&](int64_t u, bool first, bool second) __attribute__((always_inline)) {
    add(u, second, [=](int r) __attribute__((always_inline)) {
      const int8_t* values = x + r * x_stride + 2 * u;
      int32_t xs = 0;
      if (first && second)
        std::memcpy(&xs, values, 4);
      else if (first)
        std::memcpy(&xs, values, 2);
      else
        std::memcpy(reinterpret_cast<char*>(&xs) + 2, values + 2, 2);
      return xs;
    });
  };
  int64_t u = begin;
  if (kQuadRows && u % 2) {
    unit(u - 1, false, true);
    ++u;
  }
  for (; u + 1 < end; u += 2) unit(u, true, true);
  if (u < end) unit(u, true, false);
}

// wide[r] = the sums over pair rows [begin, end) of vpdpbusd(four weight values a lane, row r's
// four int8 x values), over pair_units<kQuadRows>. quads(u, second, low, high) gives pair
// rows u and u + 1 (where `second`; else zeros may stand for u + 1) as two registers of 16
// features' four values.
template <int R, bool kQuadRows, typename Quads, typename Prefetch>
__attribute__((always_inline)) inline void vnni_sums(__m512i (&wide)[R][2], const int8_t* x,
                                                     int64_t x_stride, int64_t begin,
                                                     int64_t end, Quads quads,
                                                     Prefetch prefetch) {
  for (int r = 0; r < R; ++r) wide[r][0] = wide[r][1] = _mm512_setzero_si512();
  pair_units<kQuadRows>(x, x_stride, begin, end,
                        [&](int64_t u, bool second, auto xs) __attribute__((always_inline)) {
    prefetch(u);
    prefetch(u + 1);
    __m512i low, high;
    quads(u, second, low, high);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m512i xr = _mm512_set1_epi32(xs(r));
      wide[r][0] = _mm512_dpbusd_epi32(wide[r][0], low, xr);
      wide[r][1] = _mm512_dpbusd_epi32(wide[r][1], high, xr);
    }
  });
}

// Int4Dots with AVX512-VNNI's vpdpbusd: a quad row's four values of a feature times x's four
// int8 values, summed into the feature's int32 lane, 64 products an instruction: the quad row
// masked is features 0-15, shifted and masked 16-31.
template <typename P>
struct Int4Vnni : WidenedFma<Avx512, Int4Quads, P, int8_t> {
  using Base = WidenedFma<Avx512, Int4Quads, P, int8_t>;
  using typename Base::F;
  using Base::V;
  static constexpr bool kPrewidens = false;
  static constexpr bool kIntegerDots = true;
  static constexpr int kRows = 6;  // 12 int32 sums beside the tile's 12 accumulators

  template <int R, typename Prefetch>
  __attribute__((always_inline)) static void group_sums(
      F (&sums)[R][V], const Int4Quads* w, const int8_t* x, int64_t x_stride,
      const float* x_scales, int64_t x_scales_stride, int64_t begin, int64_t end,
      Prefetch prefetch) {
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    __m512i wide[R][2];  // int32 sums of features 0-15, 16-31
    auto quad_row = [&](int64_t u, bool, __m512i& low, __m512i& high)
                        __attribute__((always_inline)) {
      const __m512i quad = _mm512_loadu_si512(w + u * kBlock);
      low = _mm512_and_si512(quad, nibble);
      high = _mm512_and_si512(_mm512_srli_epi16(quad, 4), nibble);
    };
    vnni_sums<R, true>(wide, x, x_stride, begin, end, quad_row, prefetch);
    scaled_sums(wide, x_scales, x_scales_stride, sums);
  }
};

// Int8Dots with AVX512-VNNI's vpdpbusd: the stored q multiplied as q + 128 (unsigned, its first
// operand), 128 times x's integer sum over the group taken back from each int32 sum (exact),
// four values a lane from two pair rows interleaved by 16 bits (vpunpck*wd: features 0-3, 8-11,
// 16-19, 24-27 in one register, put back in order once per group). Per row, two instructions
// per two pair rows; vpdpwssd took four, and measured no faster than the float tiles.
template <typename P>
struct Int8Vnni : WidenedFma<Avx512, int8_t, P, int8_t> {
  using Base = WidenedFma<Avx512, int8_t, P, int8_t>;
  using typename Base::F;
  using Base::V;
  static constexpr bool kPrewidens = false;
  static constexpr bool kIntegerDots = true;
  static constexpr int kRows = 6;

  template <int R, typename Prefetch>
  __attribute__((always_inline)) static void group_sums(
      F (&sums)[R][V], const int8_t* w, const int8_t* x, int64_t x_stride,
      const float* x_scales, int64_t x_scales_stride, int64_t begin, int64_t end,
      Prefetch prefetch) {
    const __m512i offset = _mm512_set1_epi8(static_cast<char>(0x80));
    __m512i wide[R][2];  // int32 sums of features 0-3, 8-11, 16-19, 24-27; 4-7, 12-15, ...
    auto pair_rows = [&](int64_t u, bool two, __m512i& low, __m512i& high)
                         __attribute__((always_inline)) {
      const int8_t* row = w + u * kPairElems<int8_t>;
      const __m512i first = _mm512_loadu_si512(row);
      const __m512i second = two ? _mm512_loadu_si512(row + kPairElems<int8_t>)
                                 : _mm512_setzero_si512();
      low = _mm512_xor_si512(_mm512_unpacklo_epi16(first, second), offset);
      high = _mm512_xor_si512(_mm512_unpackhi_epi16(first, second), offset);
    };
    vnni_sums<R, false>(wide, x, x_stride, begin, end, pair_rows, prefetch);
    const __m512i first_half =
        _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second_half =
        _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int r = 0; r < R; ++r) {
      const __m512i offsets = _mm512_set1_epi32(
          128 * static_cast<int32_t>(x_scales[r * x_scales_stride + 1]));
      const __m512i a = _mm512_sub_epi32(wide[r][0], offsets);
      const __m512i b = _mm512_sub_epi32(wide[r][1], offsets);
      wide[r][0] = _mm512_permutex2var_epi32(a, first_half, b);
      wide[r][1] = _mm512_permutex2var_epi32(a, second_half, b);
    }
    scaled_sums(wide, x_scales, x_scales_stride, sums);
  }
};
template <typename P>
using Int4Integer = Int4Vnni<P>;
using Int4Weight = Int4Quads;
template <typename P>
using Int8Integer = Int8Vnni<P>;
constexpr bool kVnniDots = true;
#else
template <typename P>
using Int4Integer = Int4Dots<P>;
using Int4Weight = Int4Pair;
template <typename P>
using Int8Integer = Int8Dots<P>;
constexpr bool kVnniDots = false;
#endif

}  // namespace packed_matmul
}  // namespace tritonlm

#endif
