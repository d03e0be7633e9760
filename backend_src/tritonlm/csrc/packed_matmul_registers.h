// The registers the packed matmul (packed_matmul.h) computes in, as this build targets them:
// the only code that differs between vector widths.
#pragma once
#include "cpu_vec.h"

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)

#include <cstring>

namespace tritonlm {
namespace packed_matmul {

// 4-bit weights (0..15) in one of two layouts (the build's Int4Weight, packed_matmul_vnni_dots.h):
// - Int4Pair: a feature pair per byte, the even k in the low nibble, the odd k in the high;
// - Int4Quads (AVX512-VNNI builds): two pair rows (k = 4q..4q+3) per 64-byte quad row of a
//   block; byte 4l + i holds feature l's k = 4q + i in its low nibble, feature 16 + l's in its
//   high one. Masked (or shifted and masked) a quad row is 16 features' four values a lane, as
//   vpdpbusd multiplies them: pairs took 14 instructions per 128 weights into that order, quads
//   take 4 (Zen 4, 2 threads, int4 g32 SmolLM2's matmuls: 1 row from L3 1.5x faster; from
//   memory, with the group parameters' prefetch, 1.09-1.18x at 1-256 rows). AVX2's vpmaddubsw
//   path keeps pairs: on quads its 4-row tiles ran out of registers (0.77-0.90x).
struct Int4Pair {
  uint8_t bits;
};
struct Int4Quads {
  uint8_t bits;
};
// Pair row 2q + second of a quad row, as the float tiles widen it.
struct Int4Row {
  const Int4Quads* quad;
  int second;
};

// Lane t of the result: the sum of v[t]'s 8 lanes (t < 8). Both builds: the AVX512-BF16 decode
// attention reduces in 256-bit registers too (paged_decode_attention.cpp).
inline __m256 reduce_lanes_256(const __m256* v) {
  // per 128-bit half: [v0 0-3, v1 0-3, v2 0-3, v3 0-3] (low), the same of 4-7 (high)
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// The registers a tile computes in, as this build targets them: AVX512 (16 float32 lanes) or AVX2
// + FMA (8). The tiling, the task schedule and the epilogue are written once over these; only the
// width differs.
#ifdef CPU_CAPABILITY_AVX512
struct Avx512 {
  using F = __m512;
  static constexpr int kLanes = 16;
  static constexpr int kAccumulators = 24;  // + the weight registers (32 in all)
  static constexpr int kMaxRows = 12;
  static constexpr int kMaxGroupedRows = 6;  // + 12 registers for a group's sums
  static constexpr int64_t kPrewidenRows = 48;  // rows from which a block is widened once
                                                // (not measured on AVX512 yet)
  static F zero() { return _mm512_setzero_ps(); }
  static F splat(float v) { return _mm512_set1_ps(v); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  // kLanes feature pairs (2 * kLanes bf16 or int8) as float32: the even-k weights, the odd-k ones.
  static void widen_pairs(const uint16_t* w, F& even, F& odd) {
    const __m512i pairs = _mm512_loadu_si512(w);
    even = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
    odd = _mm512_castsi512_ps(
        _mm512_and_si512(pairs, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
  }
  static void widen_pairs(const int8_t* w, F& even, F& odd) {
    const __m512i pairs =
        _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
    even = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(pairs, 16), 16));
    odd = _mm512_cvtepi32_ps(_mm512_srai_epi32(pairs, 16));
  }
  static void widen_pairs(const Int4Pair* w, F& even, F& odd) {
    const __m512i pairs =
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
    even = _mm512_cvtepi32_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(0xF)));
    odd = _mm512_cvtepi32_ps(_mm512_srli_epi32(pairs, 4));
  }
  // Register v's lanes (features 16v..) of a 4-bit pair row: nibbles of the quad row's lanes.
  static void widen_pairs(Int4Row row, int v, F& even, F& odd) {
    const __m512i lanes = _mm512_loadu_si512(row.quad);
    const unsigned shift = 16 * row.second + 4 * v;  // an immediate where the row's half is known
    const __m512i nibble = _mm512_set1_epi32(0xF);
    even = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(lanes, shift), nibble));
    odd = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(lanes, shift + 8), nibble));
  }
  static void widen_pairs(const float* w, F& even, F& odd) {  // widened already (prewiden)
    even = _mm512_loadu_ps(w);
    odd = _mm512_loadu_ps(w + kLanes);
  }
  // Four vectors of 8 int32 sums (features 0-7, 8-15, 16-23, 24-31) as float32 registers.
  // Lane t of the result: the sum of v[t]'s lanes (a lane never mixes with another vector's).
  static F reduce_lanes(const F (&v)[kLanes]) {
    __m512 l1[8], l2[4], l3[2];
    for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
      l1[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                            _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i)  // per 128-bit lane: [a, b, c, d] (that lane's sums)
      l2[i] = _mm512_add_ps(_mm512_shuffle_ps(l1[2 * i], l1[2 * i + 1], 0x44),
                            _mm512_shuffle_ps(l1[2 * i], l1[2 * i + 1], 0xEE));
    for (int i = 0; i < 2; ++i)  // [abcd lanes 0+1, abcd lanes 2+3, efgh 0+1, efgh 2+3]
      l3[i] = _mm512_add_ps(_mm512_shuffle_f32x4(l2[2 * i], l2[2 * i + 1], 0x88),
                            _mm512_shuffle_f32x4(l2[2 * i], l2[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(l3[0], l3[1], 0x88),
                         _mm512_shuffle_f32x4(l3[0], l3[1], 0xDD));
  }
  static void int32_octets(const __m256i (&sums)[4], F (&out)[2]) {
    for (int v = 0; v < 2; ++v)
      out[v] = _mm512_cvtepi32_ps(
          _mm512_inserti64x4(_mm512_castsi256_si512(sums[2 * v]), sums[2 * v + 1], 1));
  }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static F load(const c10::Half* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static F load(const uint16_t* p, int64_t n) {  // bfloat16
    return widen_bf16(_mm256_maskz_loadu_epi16(first_lanes(n), p));
  }
  static F load(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(first_lanes(n), p); }
  static void store(uint16_t* p, F v, int64_t n) {
    _mm256_mask_storeu_epi16(p, first_lanes(n), narrow_bf16(v));
  }
  static void store(float* p, F v, int64_t n) { _mm512_mask_storeu_ps(p, first_lanes(n), v); }
  static F round_bf16(F v) { return rounded<c10::BFloat16>(v); }
  template <int kAct>
  static F activate(F x) { return tritonlm::activate<kAct>(Vec(x)); }
};
using Native = Avx512;
#else
struct Avx2 {
  using F = __m256;
  static constexpr int kLanes = 8;
  static constexpr int kAccumulators = 12;  // + the weight registers and a broadcast (16)
  // From 4 rows a tile multiplies the block's low 16 features, then its high 16: 6 rows x 2
  // vectors broadcast each x value once per 2 FMAs instead of once per FMA.
  static constexpr int kMaxRows = 6;
  static constexpr int kMaxGroupedRows = 2;
  // Zen 1, SmolLM2's matmuls at 16 rows: int8 96 -> 85 ms, int4 106 -> 89; no gain at 8 or less.
  static constexpr int64_t kPrewidenRows = 16;
  static F zero() { return _mm256_setzero_ps(); }
  static F splat(float v) { return _mm256_set1_ps(v); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static void widen_pairs(const uint16_t* w, F& even, F& odd) {
    const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
    even = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
    odd = _mm256_castsi256_ps(
        _mm256_and_si256(pairs, _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
  }
  static void widen_pairs(const int8_t* w, F& even, F& odd) {
    const __m256i pairs =
        _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
    even = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(pairs, 16), 16));
    odd = _mm256_cvtepi32_ps(_mm256_srai_epi32(pairs, 16));
  }
  static void widen_pairs(const Int4Pair* w, F& even, F& odd) {
    const __m256i pairs =
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w)));
    even = _mm256_cvtepi32_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(0xF)));
    odd = _mm256_cvtepi32_ps(_mm256_srli_epi32(pairs, 4));
  }
  static void widen_pairs(const float* w, F& even, F& odd) {  // widened already (prewiden)
    even = _mm256_loadu_ps(w);
    odd = _mm256_loadu_ps(w + kLanes);
  }
  // Lane t of the result: the sum of v[t]'s lanes.
  static F reduce_lanes(const F (&v)[kLanes]) { return reduce_lanes_256(v); }
  static void int32_octets(const __m256i (&sums)[4], F (&out)[4]) {
    for (int v = 0; v < 4; ++v) out[v] = _mm256_cvtepi32_ps(sums[v]);
  }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static F load(const c10::Half* p) {  // F16C: every AVX2 CPU has it
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static __m256i first_lanes(int64_t n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(n)),
                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static F load(const float* p, int64_t n) { return _mm256_maskload_ps(p, first_lanes(n)); }
  static void store(float* p, F v, int64_t n) { _mm256_maskstore_ps(p, first_lanes(n), v); }
  static F load(const uint16_t* p, int64_t n) {  // bfloat16
    alignas(16) uint16_t lanes[kLanes] = {};
    std::memcpy(lanes, p, n * sizeof(uint16_t));
    const __m128i v = _mm_load_si128(reinterpret_cast<const __m128i*>(lanes));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
  }
  // float32 bits rounded to bfloat16 precision (nearest even, NaN kept), the low 16 bits zero.
  static __m256i round_bits(F v) {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i up = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(_mm256_and_si256(up, _mm256_set1_epi32(
                                  static_cast<int32_t>(0xFFFF0000u))),
                              _mm256_set1_epi32(0x7FC00000), nan);
  }
  static void store(uint16_t* p, F v, int64_t n) {  // bfloat16
    const __m256i high = _mm256_srli_epi32(round_bits(v), 16);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(high, high), 0x08);
    alignas(16) uint16_t lanes[kLanes];
    _mm_store_si128(reinterpret_cast<__m128i*>(lanes), _mm256_castsi256_si128(packed));
    std::memcpy(p, lanes, n * sizeof(uint16_t));
  }
  static F round_bf16(F v) { return _mm256_castsi256_ps(round_bits(v)); }
  template <int kAct>
  static F activate(F x) { return tritonlm::activate<kAct>(Vec(x)); }
};
using Native = Avx2;
#endif

}  // namespace packed_matmul
}  // namespace tritonlm

#endif
