// A prefill tile in bfloat16: query rows against 16 keys at a time with vdpbf16ps (exact
// products, float32 sums), as PyTorch's CPU flash attention computes bf16: float32 scores and
// softmax, the probabilities rounded to bfloat16 for P.V, float32 accumulators.
//
// Each key chunk is restaged once for all of the tile's rows (G heads x up to 16 queries):
// - keys as [D / 2, 16] pairs of features, so a row's 16 scores are D / 2 dot products of a
//   broadcast query pair with one vector (no horizontal sums);
// - values as [8, D, 2] pairs of rows, so a probability pair and one vector update 16 features.
// The softmax is the lazy one of cpu_vec.h (kLazyMax), its sums kept per lane.
#include "prefill_tile_bf16.h"

#ifdef TRITONLM_PREFILL_BF16

#include <algorithm>
#include <cmath>
#include <cstring>

namespace tritonlm {
bool multiplies_in_amx(const std::string& forced);  // bf16_matmul.cpp

namespace {

// Query rows scored and accumulated together, and the 16-feature vectors of P.V each call
// accumulates: 16 accumulators either way. Each staged key or value vector is read for 8 rows
// (2 Zen 4 cores, SmolLM2's heads, 2,048 queries over 4,096 keys / 512 over 512: 0.89x / 0.81x
// the time of 4 rows by 4 vectors; 16 rows by 1 vector 1.02x / 0.96x).
constexpr int kRows = 8;
constexpr int kCols = 2;

inline __m512bh broadcast_pair(const uint16_t* p) {
  uint32_t pair;
  std::memcpy(&pair, p, sizeof(pair));
  return (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
}

// In place: r[i] lane j <- r[j] lane i for a 16 x 16 block of 32-bit values.
inline void transpose16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // r[4i + j], 128-bit lane L: rows 4i..4i+3 of column 4L + j
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    const __m512i low01 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x44);
    const __m512i high01 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x44);
    const __m512i low23 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xEE);
    const __m512i high23 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xEE);
    t[j] = _mm512_shuffle_i32x4(low01, high01, 0x88);
    t[4 + j] = _mm512_shuffle_i32x4(low01, high01, 0xDD);
    t[8 + j] = _mm512_shuffle_i32x4(low23, high23, 0x88);
    t[12 + j] = _mm512_shuffle_i32x4(low23, high23, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// keys[i * 16 + t] = feature pair i of key t; keys past n are zeros.
void stage_keys(const uint16_t* k, int64_t n, int64_t D, uint32_t* keys) {
  const auto* pairs = reinterpret_cast<const uint32_t*>(k);
  for (int64_t c0 = 0; c0 < D / 2; c0 += 16) {
    __m512i r[16];
    for (int t = 0; t < 16; ++t)
      r[t] = _mm512_maskz_loadu_epi32(t < n ? 0xFFFF : 0, pairs + t * (D / 2) + c0);
    transpose16(r);
    for (int i = 0; i < 16; ++i) _mm512_storeu_si512(keys + (c0 + i) * 16, r[i]);
  }
}

// values[p * 2D + 2d + e] = feature d of value row 2p + e; rows past n (of 16) are zeros.
void stage_values(const uint16_t* v, int64_t n, int64_t D, uint16_t* values) {
  alignas(64) uint16_t low[32], high[32];
  for (int i = 0; i < 16; ++i) {
    low[2 * i] = i, low[2 * i + 1] = 32 + i;
    high[2 * i] = 16 + i, high[2 * i + 1] = 48 + i;
  }
  const __m512i low_index = _mm512_load_si512(low), high_index = _mm512_load_si512(high);
  for (int64_t p = 0; 2 * p < n; ++p) {
    for (int64_t d = 0; d < D; d += 32) {
      const __m512i a = _mm512_loadu_si512(v + 2 * p * D + d);
      const __m512i b = _mm512_maskz_loadu_epi16(2 * p + 1 < n ? ~0u : 0u, v + (2 * p + 1) * D + d);
      _mm512_storeu_si512(values + p * 2 * D + 2 * d, _mm512_permutex2var_epi16(a, low_index, b));
      _mm512_storeu_si512(values + p * 2 * D + 2 * d + 32,
                          _mm512_permutex2var_epi16(a, high_index, b));
    }
  }
  // AMX's P.V reads all 8 pairs (times zero probabilities): none left from an earlier chunk
  std::fill(values + (n + 1) / 2 * 2 * D, values + 16 * D, 0);
}

// Raw scores of kRows query rows (D bf16 each) against the staged chunk.
inline void score_rows(const uint16_t* q, int64_t D, const uint32_t* keys, __m512* out) {
  __m512 even[kRows], odd[kRows];  // two chains per row hide the dot product's latency
  for (int r = 0; r < kRows; ++r) even[r] = odd[r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < D / 2; i += 2) {
    const __m512bh k0 = (__m512bh)_mm512_loadu_si512(keys + i * 16);
    const __m512bh k1 = (__m512bh)_mm512_loadu_si512(keys + (i + 1) * 16);
    for (int r = 0; r < kRows; ++r) {
      even[r] = _mm512_dpbf16_ps(even[r], broadcast_pair(q + r * D + 2 * i), k0);
      odd[r] = _mm512_dpbf16_ps(odd[r], broadcast_pair(q + r * D + 2 * i + 2), k1);
    }
  }
  for (int r = 0; r < kRows; ++r) out[r] = _mm512_add_ps(even[r], odd[r]);
}

// From m = m0: acc[r, 16m : 16m + 16 kCols] = acc * alpha[r] + P[r] . V over the chunk's row
// pairs.
inline void accumulate_rows(float* acc, int64_t D, const float* alpha, const uint16_t* probs,
                            const uint16_t* values, int64_t pairs, int64_t m0) {
  __m512 a[kRows][kCols];
  for (int r = 0; r < kRows; ++r) {
    const __m512 scale = _mm512_set1_ps(alpha[r]);
    for (int c = 0; c < kCols; ++c)
      a[r][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + (m0 + c) * 16), scale);
  }
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh v[kCols];
    for (int c = 0; c < kCols; ++c)
      v[c] = (__m512bh)_mm512_loadu_si512(values + p * 2 * D + (m0 + c) * 32);
    for (int r = 0; r < kRows; ++r) {
      const __m512bh pp = broadcast_pair(probs + r * 16 + 2 * p);
      for (int c = 0; c < kCols; ++c) a[r][c] = _mm512_dpbf16_ps(a[r][c], pp, v[c]);
    }
  }
  for (int r = 0; r < kRows; ++r) {
    for (int c = 0; c < kCols; ++c) _mm512_storeu_ps(acc + r * D + (m0 + c) * 16, a[r][c]);
  }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// AMX tiles (Sapphire Rapids on) take 16 query rows at a time, on the same staged chunks: keys
// [D / 2, 16] pairs are B tiles of scores = Q K^T as they lie, values [8, D, 2] row pairs B tiles
// of P V. Tiles: 0, 1: C (scores, a feature block's P V); 4: A (32 features of the queries);
// 5: A (the probabilities); 6: B (16 key pairs); 7: B (8 value row pairs, 16 features).
// Where the bf16 matmul multiplies in them (TRITONLM_BF16_MATMUL=dot or fma keeps dot products).
bool prefill_amx() {
  static const bool amx = multiplies_in_amx(forced_bf16_multiply());
  return amx;
}

void configure_amx() {
  load_tile_config({16, 16, 0, 0, 16, 16, 16, 8}, {64, 64, 0, 0, 64, 32, 64, 64});
}

// scores[16, 16] = 16 query rows (D bf16 each, D % 32 == 0) . the staged chunk's keys.
inline void amx_scores(const uint16_t* q, int64_t D, const uint32_t* keys, float* scores) {
  _tile_zero(0);
  for (int64_t pair = 0; pair < D / 2; pair += 16) {
    _tile_loadd(4, q + 2 * pair, D * sizeof(uint16_t));
    _tile_loadd(6, keys + pair * 16, 64);
    _tile_dpbf16ps(0, 4, 6);
  }
  _tile_stored(0, scores, 64);
}

// pv[16, D] = the probabilities [16, 16] (bf16) . the staged chunk's values.
inline void amx_values(const uint16_t* probs, const uint16_t* values, int64_t D, float* pv) {
  _tile_loadd(5, probs, 32);
  for (int64_t d = 0; d < D; d += 16) {
    _tile_zero(1);
    _tile_loadd(7, values + 2 * d, 2 * D * sizeof(uint16_t));
    _tile_dpbf16ps(1, 5, 7);
    _tile_stored(1, pv + d, D * sizeof(float));
  }
}
#endif

}  // namespace

PrefillScratchBf16::PrefillScratchBf16(int64_t rows, int64_t D)
    : q(padded(rows) * D), values(16 * D), probs(16 * 16), keys(D / 2 * 16),
      acc(padded(rows) * D), max(padded(rows)), sum(padded(rows) * 16), scores(16 * 16),
      pv(16 * D), pos(padded(rows)), amx(false) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  amx = rows > 0 && prefill_amx();
  if (amx) configure_amx();  // the matmuls configure their own
#endif
}

PrefillScratchBf16::~PrefillScratchBf16() {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (amx) _tile_release();  // its 8 KB of state no longer saved at each context switch
#endif
}

void attend_tile_bf16(const c10::BFloat16* q_, int64_t q_token_stride,
                      const c10::BFloat16* key_cache_, const c10::BFloat16* value_cache_,
                      const PrefillRows& r, int64_t n_queries, const float* slopes,
                      int64_t window, float scale, int64_t G, int64_t D, int64_t bs,
                      c10::BFloat16* out, PrefillScratchBf16& s) {
  const auto* q = reinterpret_cast<const uint16_t*>(q_);
  const auto* key_cache = reinterpret_cast<const uint16_t*>(key_cache_);
  const auto* value_cache = reinterpret_cast<const uint16_t*>(value_cache_);
  const int64_t rows = n_queries * G;  // query row i * G + g
  const bool amx = s.amx;
  const int64_t group = amx ? 16 : kRows;  // rows scored and accumulated together
  const int64_t padded_rows = (rows + group - 1) / group * group;
  const int64_t pos0 = r.context - r.query_len + r.first_query;  // the tile's first position
  for (int64_t row = 0; row < padded_rows; ++row) {
    s.pos[row] = pos0 + std::min(row, rows - 1) / G;  // padding rows repeat the last position
    uint16_t* dst = s.q.data() + row * D;
    if (row < rows)
      std::memcpy(dst, q + (row / G) * q_token_stride + (row % G) * D, D * sizeof(uint16_t));
    else
      std::fill(dst, dst + D, 0);
  }
  std::fill(s.acc.begin(), s.acc.begin() + padded_rows * D, 0.f);
  std::fill(s.max.begin(), s.max.begin() + padded_rows, kNegInf);
  std::fill(s.sum.begin(), s.sum.begin() + padded_rows * 16, 0.f);
  const int64_t last_pos = pos0 + n_queries - 1;
  const int64_t first_key = window > 0 ? std::max<int64_t>(0, pos0 - window + 1) : 0;
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 neg_inf = _mm512_set1_ps(kNegInf);
  int64_t n = 0;
  for (int64_t base = first_key; base <= last_pos; base += n) {
    const int64_t j = base / bs, offset = base % bs;  // a chunk never crosses a block
    n = std::min<int64_t>({16, bs - offset, last_pos + 1 - base});
    stage_keys(key_cache + (r.blocks[j] * bs + offset) * D, n, D, s.keys.data());
    stage_values(value_cache + (r.blocks[j] * bs + offset) * D, n, D, s.values.data());
    const __m512i key_pos = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(base)));
    // Row `row`'s raw scores to bf16 probabilities at p (the lazy online softmax); the factor
    // its accumulators are to be scaled by first.
    auto softmax_row = [&](int64_t row, __m512 raw, uint16_t* p) {
      const int64_t pos = s.pos[row];
      const int64_t low = window > 0 ? pos - window + 1 : 0;  // first visible key position
      const __mmask16 visible =
          first_lanes(n) &
          _mm512_cmple_epi32_mask(key_pos, _mm512_set1_epi32(static_cast<int>(pos))) &
          _mm512_cmpge_epi32_mask(key_pos, _mm512_set1_epi32(static_cast<int>(low)));
      float alpha = 1.f;
      if (visible == 0) {  // nothing visible: the row is left as it is
        std::fill(p, p + 16, 0);
        return alpha;
      }
      __m512 sc = _mm512_mul_ps(raw, _mm512_set1_ps(scale));
      if (slopes != nullptr) {
        const __m512i distance =
            _mm512_sub_epi32(key_pos, _mm512_set1_epi32(static_cast<int>(pos)));
        sc = _mm512_fmadd_ps(_mm512_set1_ps(slopes[row % G]), _mm512_cvtepi32_ps(distance), sc);
      }
      sc = _mm512_mask_blend_ps(visible, neg_inf, sc);
      float* sums = s.sum.data() + row * 16;
      if (_mm512_cmp_ps_mask(sc, _mm512_set1_ps(s.max[row] + kLazyMax), _CMP_GT_OQ)) {
        const float new_max = _mm512_reduce_max_ps(sc);
        alpha = std::exp(s.max[row] - new_max);  // 0 on the row's first chunk
        s.max[row] = new_max;
        _mm512_storeu_ps(sums, _mm512_mul_ps(_mm512_loadu_ps(sums), _mm512_set1_ps(alpha)));
      }
      const __m512 e = _mm512_maskz_mov_ps(
          visible, Vec(_mm512_sub_ps(sc, _mm512_set1_ps(s.max[row]))).exp_u20());
      _mm512_storeu_ps(sums, _mm512_add_ps(_mm512_loadu_ps(sums), e));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(e));
      return alpha;
    };
    for (int64_t g0 = 0; g0 < padded_rows; g0 += group) {
      if (base > s.pos[g0 + group - 1]) continue;  // the chunk is after every row of the group
      float alpha[16];
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
      if (amx) {
        amx_scores(s.q.data() + g0 * D, D, s.keys.data(), s.scores.data());
        for (int k = 0; k < 16; ++k)
          alpha[k] = softmax_row(g0 + k, _mm512_loadu_ps(s.scores.data() + k * 16),
                                 s.probs.data() + k * 16);
        amx_values(s.probs.data(), s.values.data(), D, s.pv.data());
        for (int k = 0; k < 16; ++k) {
          float* acc = s.acc.data() + (g0 + k) * D;
          const __m512 a = _mm512_set1_ps(alpha[k]);
          for (int64_t d = 0; d < D; d += 16)
            _mm512_storeu_ps(acc + d, _mm512_fmadd_ps(_mm512_loadu_ps(acc + d), a,
                                                      _mm512_loadu_ps(s.pv.data() + k * D + d)));
        }
        continue;
      }
#endif
      __m512 scores[kRows];
      score_rows(s.q.data() + g0 * D, D, s.keys.data(), scores);
      for (int k = 0; k < kRows; ++k)
        alpha[k] = softmax_row(g0 + k, scores[k], s.probs.data() + k * 16);
      for (int64_t m0 = 0; m0 < D / 16; m0 += kCols)  // D / 16 is even
        accumulate_rows(s.acc.data() + g0 * D, D, alpha, s.probs.data(), s.values.data(),
                        (n + 1) / 2, m0);
    }
  }
  for (int64_t row = 0; row < rows; ++row) {
    const float sum = _mm512_reduce_add_ps(_mm512_loadu_ps(s.sum.data() + row * 16));
    const Vec inv(sum > 0.f ? 1.f / sum : 0.f);
    auto* dst = out + (row / G) * q_token_stride + (row % G) * D;
    for (int64_t d = 0; d < D; d += 16)
      store_float(dst + d, Vec::loadu(s.acc.data() + row * D + d) * inv);
  }
}

}  // namespace tritonlm

#endif
