// Paged decode attention for any cache element (float32, float16; bfloat16 where neither the
// AVX512-BF16 nor the widened kernel applies) and head dim: each block's K and V rows converted
// to float32 in the thread's scratch, vectorized dots per key, the online softmax per block.
// paged_decode_attention.cpp has the layout and picks the kernel.
#pragma once
#include "decode_attention_blocks.h"

#include <algorithm>
#include <cmath>

namespace tritonlm {
namespace paged_decode {

// n contiguous values to float32.
template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + W <= n; i += W) load_float(src + i).store(dst + i);
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// Dot product of a and b over D (kD > 0: D known at compile time, loops fully unrolled).
template <int kD>
inline float dot(const float* a, const float* b, int runtime_d) {
  const int n = kD > 0 ? kD : runtime_d;
  Vec acc0(0.f), acc1(0.f);
  int d = 0;
  for (; d + 2 * W <= n; d += 2 * W) {
    acc0 = at::vec::fmadd(Vec::loadu(a + d), Vec::loadu(b + d), acc0);
    acc1 = at::vec::fmadd(Vec::loadu(a + d + W), Vec::loadu(b + d + W), acc1);
  }
  if (d + W <= n) {
    acc0 = at::vec::fmadd(Vec::loadu(a + d), Vec::loadu(b + d), acc0);
    d += W;
  }
  float sum = sum_lanes(acc0 + acc1);
  for (; d < n; ++d) sum += a[d] * b[d];
  return sum;
}

// acc[0:D] = acc * alpha + sum_t p[t] * v[t, 0:D] for n rows v of D floats (row stride D).
// D is walked in chunks of up to 4 vectors held in registers across the rows.
template <int kD>
inline void accumulate(float* acc, float alpha, const float* p, const float* v, int n,
                       int runtime_d) {
  const int D = kD > 0 ? kD : runtime_d;
  constexpr int C = 4;
  const Vec valpha(alpha);
  int d = 0;
  for (; d + C * W <= D; d += C * W) {
    Vec a[C];
    for (int i = 0; i < C; ++i) a[i] = Vec::loadu(acc + d + i * W) * valpha;
    for (int t = 0; t < n; ++t) {
      const Vec pt(p[t]);
      const float* row = v + static_cast<int64_t>(t) * D + d;
      for (int i = 0; i < C; ++i) a[i] = at::vec::fmadd(pt, Vec::loadu(row + i * W), a[i]);
    }
    for (int i = 0; i < C; ++i) a[i].store(acc + d + i * W);
  }
  for (; d + W <= D; d += W) {
    Vec a = Vec::loadu(acc + d) * valpha;
    for (int t = 0; t < n; ++t)
      a = at::vec::fmadd(Vec(p[t]), Vec::loadu(v + static_cast<int64_t>(t) * D + d), a);
    a.store(acc + d);
  }
  for (; d < D; ++d) {
    float a = acc[d] * alpha;
    for (int t = 0; t < n; ++t) a += p[t] * v[static_cast<int64_t>(t) * D + d];
    acc[d] = a;
  }
}

// p[0:n] = exp(s[0:n] - max); returns their sum.
inline float exp_sum(const float* s, float* p, int n, float max) {
  const Vec vmax(max);
  Vec vsum(0.f);
  int t = 0;
  for (; t + W <= n; t += W) {
    Vec e = (Vec::loadu(s + t) - vmax).exp_u20();
    e.store(p + t);
    vsum = vsum + e;
  }
  float sum = sum_lanes(vsum);
  if (t < n) {
    Vec e = (Vec::loadu(s + t, n - t) - vmax).exp_u20();
    e.store(p + t, n - t);
    for (int i = t; i < n; ++i) sum += p[i];
  }
  return sum;
}

template <typename T, int kD>
void attend_group(const T* q, const T* key_cache, const T* value_cache, const int64_t* rows,
                  int64_t context, const float* slopes, int64_t window, float scale, int64_t G,
                  int64_t D, int64_t bs, T* out, Scratch& s, const int64_t* next_rows) {
  if (context <= 0) {  // no keys: a zero output, not NaN
    for (int64_t i = 0; i < G * D; ++i) out[i] = static_cast<T>(0.f);
    return;
  }
  const int64_t query_pos = context - 1;
  const int64_t first_key = window > 0 ? std::max<int64_t>(0, query_pos - window + 1) : 0;
  float* qf = s.q.data();
  for (int64_t i = 0; i < G * D; ++i) qf[i] = static_cast<float>(q[i]) * scale;
  std::fill(s.acc.begin(), s.acc.end(), 0.f);
  std::fill(s.max.begin(), s.max.end(), kNegInf);
  std::fill(s.sum.begin(), s.sum.end(), 0.f);
  const int64_t block_elems = bs * D;

  const int64_t last_block = (context - 1) / bs;
  const int64_t first_block = first_key / bs;
  prefetch_first_blocks(key_cache, value_cache, rows, first_block, last_block,
                        block_elems * sizeof(T));
  for (int64_t j = first_block; j <= last_block; ++j) {
    const auto ahead =
        block_ahead(key_cache, value_cache, rows, next_rows, j, first_block, last_block,
                    block_elems);
    const int64_t base = j * bs;
    const int t0 = static_cast<int>(std::max<int64_t>(first_key - base, 0));
    const int t1 = static_cast<int>(std::min<int64_t>(context - base, bs));
    const int n = t1 - t0;
    const T* k_rows = key_cache + rows[j] * block_elems + t0 * D;
    const T* v_rows = value_cache + rows[j] * block_elems + t0 * D;
    const float* kf;
    const float* vf;
    if constexpr (std::is_same_v<T, float>) {
      kf = k_rows;
      vf = v_rows;
    } else {
      to_float(k_rows, s.keys.data(), n * D);
      kf = s.keys.data();
    }
    // Scores [G, n], each K row loaded once for the G heads.
    for (int t = 0; t < n; ++t) {
      prefetch_share(ahead, t, n, bs, D);
      const float* k = kf + static_cast<int64_t>(t) * D;
      for (int64_t g = 0; g < G; ++g) s.scores[g * bs + t] = dot<kD>(qf + g * D, k, D);
    }
    if (slopes != nullptr) {
      for (int64_t g = 0; g < G; ++g) {
        for (int t = 0; t < n; ++t)
          s.scores[g * bs + t] += slopes[g] * static_cast<float>(base + t0 + t - query_pos);
      }
    }
    if constexpr (!std::is_same_v<T, float>) {
      to_float(v_rows, s.values.data(), n * D);
      vf = s.values.data();
    }
    for (int64_t g = 0; g < G; ++g) {
      const float* sc = s.scores.data() + g * bs;
      float block_max = sc[0];
      for (int t = 1; t < n; ++t) block_max = std::max(block_max, sc[t]);
      const float new_max = std::max(s.max[g], block_max);
      // exp(-inf) = 0 on the first block: acc and sum start at 0 anyway.
      const float alpha = std::exp(s.max[g] - new_max);
      float* p = s.probs.data() + g * bs;
      const float block_sum = exp_sum(sc, p, n, new_max);
      s.sum[g] = s.sum[g] * alpha + block_sum;
      s.max[g] = new_max;
      accumulate<kD>(s.acc.data() + g * D, alpha, p, vf, n, D);
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    const float inv = 1.f / s.sum[g];
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = static_cast<T>(s.acc[g * D + d] * inv);
  }
}

}  // namespace paged_decode
}  // namespace tritonlm
