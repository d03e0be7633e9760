// Paged decode attention on a bfloat16 cache (paged_decode_attention.cpp's layout) where the
// CPU has AVX512-BF16 (Zen 4, Sapphire Rapids and later), keys 16 at a time:
// - q.k straight from the bf16 cache with vdpbf16ps (exact products, float32 sums), the 16 keys'
//   dot products reduced together; in 256-bit registers, whose lane sums take half the shuffles
//   (Zen 4 runs a 512-bit op as two 256-bit halves: 30 layers, 32 x ~180 keys 0.84x the time);
// - a lazy online softmax: the running maximum moves (and the sums are rescaled) only when a
//   score exceeds it by more than kLazyMax, so most blocks need no horizontal max or exp of a
//   scalar; probabilities stay below e^kLazyMax and their sums are kept per lane;
// - P.V with vdpbf16ps on the probabilities rounded to bfloat16 (as PyTorch's bf16 path rounds
//   them) against pairs of V rows, float32 accumulators held in registers for up to 4 heads.
//   The accumulators hold each 32 features in the order the pair interleaving gives them
//   (d = 8L+i in lane 4L+i of the first 16, d = 8L+4+i in lane 4L+i of the next 16), put back
//   in order at the end.
#pragma once
#include "decode_attention_blocks.h"
#include "packed_matmul_registers.h"

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
#define TRITONLM_AVX512_BF16 1

namespace tritonlm {
namespace paged_decode {

// For heads g < GT: acc[g, d0:d0+32] = acc * alpha[g] + sum over valid rows t of
// p[g, t] * v[t, d0:d0+32] (rows lo..hi-1; the other rows of a pair are read as zeros, so stale
// cache contents, even inf or NaN, never reach the sums).
template <int GT, int kD>
inline void accumulate_bf16(float* acc, const float* alpha, const uint16_t* p, const uint16_t* v,
                            int lo, int hi, int d0) {
  __m512 a[GT][2];
  for (int g = 0; g < GT; ++g) {
    const __m512 al = _mm512_set1_ps(alpha[g]);
    a[g][0] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * kD + d0), al);
    a[g][1] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * kD + d0 + 16), al);
  }
  for (int t = lo & ~1; t < hi; t += 2) {
    const __m512i ra = _mm512_maskz_loadu_epi32(t >= lo ? 0xFFFF : 0, v + t * kD + d0);
    const __m512i rb = _mm512_maskz_loadu_epi32(t + 1 < hi ? 0xFFFF : 0, v + (t + 1) * kD + d0);
    const __m512bh lo_pairs = (__m512bh)_mm512_unpacklo_epi16(ra, rb);
    const __m512bh hi_pairs = (__m512bh)_mm512_unpackhi_epi16(ra, rb);
    for (int g = 0; g < GT; ++g) {
      uint32_t pair;
      std::memcpy(&pair, p + g * 16 + t, sizeof(pair));
      const __m512bh pp = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      a[g][0] = _mm512_dpbf16_ps(a[g][0], pp, lo_pairs);
      a[g][1] = _mm512_dpbf16_ps(a[g][1], pp, hi_pairs);
    }
  }
  for (int g = 0; g < GT; ++g) {
    _mm512_storeu_ps(acc + g * kD + d0, a[g][0]);
    _mm512_storeu_ps(acc + g * kD + d0 + 16, a[g][1]);
  }
}

// kD % 32 == 0 and bs % 16 == 0.
// next_rows: the block rows of the kv head this thread attends next for the same sequence (see
// run), whose first blocks it prefetches as it ends this one; or null.
template <int kD>
void attend_group_bf16(const c10::BFloat16* q_, const c10::BFloat16* key_cache_,
                       const c10::BFloat16* value_cache_, const int64_t* rows, int64_t context,
                       const float* slopes, int64_t window, float scale, int64_t G, int64_t bs,
                       c10::BFloat16* out, Scratch& s, const int64_t* next_rows) {
  static_assert(kD % 32 == 0, "head dim must be a multiple of 32");
  constexpr int QH = kD / 16;  // 256-bit registers of bf16 per head
  const auto* q = reinterpret_cast<const uint16_t*>(q_);
  const auto* key_cache = reinterpret_cast<const uint16_t*>(key_cache_);
  const auto* value_cache = reinterpret_cast<const uint16_t*>(value_cache_);
  if (context <= 0) {
    for (int64_t i = 0; i < G * kD; ++i) out[i] = c10::BFloat16(0.f);
    return;
  }
  const int64_t query_pos = context - 1;
  const int64_t first_key = window > 0 ? std::max<int64_t>(0, query_pos - window + 1) : 0;
  std::fill(s.acc.begin(), s.acc.end(), 0.f);
  std::fill(s.max.begin(), s.max.end(), kNegInf);
  float* sums = s.scores.data();  // [G, 16]: per-lane sums of the probabilities
  std::fill(sums, sums + G * 16, 0.f);
  float* alpha = s.sum.data();    // [G]: this chunk's rescaling of the running sums
  auto* probs = reinterpret_cast<uint16_t*>(s.probs.data());  // [G, 16] bf16
  const int64_t block_elems = bs * kD;
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 neg_inf = _mm512_set1_ps(kNegInf);
  const __m512 vscale = _mm512_set1_ps(scale);
  const int64_t first_block = first_key / bs, last_block = (context - 1) / bs;

  prefetch_first_blocks(key_cache, value_cache, rows, first_block, last_block, block_elems * 2);
  for (int64_t j = first_block; j <= last_block; ++j) {
    const auto ahead =
        block_ahead(key_cache, value_cache, rows, next_rows, j, first_block, last_block,
                    block_elems);
    for (int64_t c = 0; c < bs; c += 16) {
      const int64_t base = j * bs + c;
      const int lo = static_cast<int>(std::max<int64_t>(first_key - base, 0));
      const int hi = static_cast<int>(std::min<int64_t>(context - base, 16));
      if (lo >= hi) continue;
      const uint16_t* k = key_cache + rows[j] * block_elems + c * kD;
      const uint16_t* v = value_cache + rows[j] * block_elems + c * kD;
      const __mmask16 valid = static_cast<__mmask16>(((1u << hi) - 1) & ~((1u << lo) - 1));
      const __m512 distance =
          _mm512_add_ps(iota, _mm512_set1_ps(static_cast<float>(base - query_pos)));
      for (int64_t g = 0; g < G; ++g) {
        __m256i qv[QH];
        for (int i = 0; i < QH; ++i)
          qv[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + g * kD + i * 16));
        __m256 part[16];
        for (int t = 0; t < 16; ++t) {  // all 16 rows: the invalid lanes are replaced below
          if (g == 0) prefetch_share(ahead, c + t, bs, bs, kD);
          __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
          for (int i = 0; i < QH; i += 2) {
            a = _mm256_dpbf16_ps(a, (__m256bh)qv[i], (__m256bh)_mm256_loadu_si256(
                reinterpret_cast<const __m256i*>(k + t * kD + i * 16)));
            b = _mm256_dpbf16_ps(b, (__m256bh)qv[i + 1], (__m256bh)_mm256_loadu_si256(
                reinterpret_cast<const __m256i*>(k + t * kD + i * 16 + 16)));
          }
          part[t] = _mm256_add_ps(a, b);
        }
        const __m512 reduced = _mm512_insertf32x8(
            _mm512_castps256_ps512(packed_matmul::reduce_lanes_256(part)),
            packed_matmul::reduce_lanes_256(part + 8), 1);
        __m512 sc = _mm512_mul_ps(reduced, vscale);
        if (slopes != nullptr) sc = _mm512_fmadd_ps(_mm512_set1_ps(slopes[g]), distance, sc);
        sc = _mm512_mask_blend_ps(valid, neg_inf, sc);
        alpha[g] = 1.f;
        if (_mm512_cmp_ps_mask(sc, _mm512_set1_ps(s.max[g] + kLazyMax), _CMP_GT_OQ)) {
          const float new_max = _mm512_reduce_max_ps(sc);
          alpha[g] = std::exp(s.max[g] - new_max);  // 0 on the first chunk
          s.max[g] = new_max;
          _mm512_storeu_ps(sums + g * 16,
                           _mm512_mul_ps(_mm512_loadu_ps(sums + g * 16), _mm512_set1_ps(alpha[g])));
        }
        const __m512 p = _mm512_maskz_mov_ps(
            valid, Vec(_mm512_sub_ps(sc, _mm512_set1_ps(s.max[g]))).exp_u20());
        _mm512_storeu_ps(sums + g * 16, _mm512_add_ps(_mm512_loadu_ps(sums + g * 16), p));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(probs + g * 16),
                            (__m256i)_mm512_cvtneps_pbh(p));
      }
      for (int64_t g0 = 0; g0 < G; g0 += 4) {
        float* acc = s.acc.data() + g0 * kD;
        const float* a = alpha + g0;
        const uint16_t* p = probs + g0 * 16;
        for (int d0 = 0; d0 < kD; d0 += 32) {
          switch (std::min<int64_t>(4, G - g0)) {
            case 4: accumulate_bf16<4, kD>(acc, a, p, v, lo, hi, d0); break;
            case 3: accumulate_bf16<3, kD>(acc, a, p, v, lo, hi, d0); break;
            case 2: accumulate_bf16<2, kD>(acc, a, p, v, lo, hi, d0); break;
            default: accumulate_bf16<1, kD>(acc, a, p, v, lo, hi, d0);
          }
        }
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    const float inv = 1.f / _mm512_reduce_add_ps(_mm512_loadu_ps(sums + g * 16));
    const float* acc = s.acc.data() + g * kD;
    c10::BFloat16* o = out + g * kD;
    for (int d0 = 0; d0 < kD; d0 += 32) {  // undo the pair interleaving's order
      for (int L = 0; L < 4; ++L) {
        for (int i = 0; i < 4; ++i) {
          o[d0 + 8 * L + i] = c10::BFloat16(acc[d0 + 4 * L + i] * inv);
          o[d0 + 8 * L + 4 + i] = c10::BFloat16(acc[d0 + 16 + 4 * L + i] * inv);
        }
      }
    }
  }
}

}  // namespace paged_decode
}  // namespace tritonlm

#endif
