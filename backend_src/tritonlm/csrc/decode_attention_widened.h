// Paged decode attention on a bfloat16 cache where the CPU has no bf16 dot product (AVX2 + FMA;
// AVX512 without AVX512-BF16): K and V rows widened in registers as the packed matmul widens bf16
// weights (packed_matmul_registers.h: a feature pair's even value by a shift, its odd one by a
// mask), float32 FMAs, one group's keys per register width at a time:
// - q.k: each key row widened once for the heads that share it, against q split into its even
//   and odd features (scaled once); a register's worth of keys' dot products reduced together;
// - the lazy online softmax of the AVX512-BF16 kernel (cpu_vec.h's kLazyMax), once per block;
// - P.V on float32 probabilities, V rows widened once per head tile, accumulators in registers
//   for up to 4 heads, each feature pair kept split (even, odd) until the output is written.
// The float path it replaces widened every block into scratch first and reduced each key's dot
// product alone (Zen 3, 30 layers of SmolLM2's heads, 32 sequences x 152-192 keys: 12.8 -> 7.5
// ms from memory, 8.4 -> 5.8 ms from cache; 8 x 1024 keys 18.5 -> 10.5 ms; 1 x 180 0.57 -> 0.44).
#pragma once
#include "decode_attention_blocks.h"
#include "packed_matmul_registers.h"

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#define TRITONLM_WIDENED_ATTENTION 1

namespace tritonlm {
namespace paged_decode {

using Isa = packed_matmul::Native;
constexpr int kLanes = Isa::kLanes;

// Whether attend_widened takes this head dim and block size.
template <int kD>
constexpr bool kWidenedHeadDim = kD > 0 && kD % (2 * kLanes) == 0;
inline bool widened_block_size(int64_t bs) { return bs % kLanes == 0; }

// parts[g][t] = the lanes of q_g . k_t (q split and scaled in qs [G][chunks][even, odd][lanes])
// for the kLanes keys from k, heads g < GT; asks for the same rows of the block ahead
// (prefetch_share).
template <int GT, int kD>
inline void key_dots(const float* qs, const uint16_t* k, float* parts,
                     const BlockAhead<uint16_t>& ahead) {
  constexpr int C = kD / (2 * kLanes);
  for (int t = 0; t < kLanes; ++t) {
    prefetch_share(ahead, t, kLanes, kLanes, kD);
    Isa::F a[GT];
    for (int g = 0; g < GT; ++g) a[g] = Isa::zero();
    for (int c = 0; c < C; ++c) {
      Isa::F even, odd;
      Isa::widen_pairs(k + t * kD + c * 2 * kLanes, even, odd);
      for (int g = 0; g < GT; ++g) {
        const float* q = qs + (g * C + c) * 2 * kLanes;
        a[g] = Isa::fma(Isa::load(q), even, Isa::fma(Isa::load(q + kLanes), odd, a[g]));
      }
    }
    for (int g = 0; g < GT; ++g) Isa::store(parts + (g * kLanes + t) * kLanes, a[g]);
  }
}

// Pair chunks of a head a P.V pass holds in registers for GT heads: the most that fit beside
// the widened V chunk and a broadcast, dividing the head's chunks evenly.
template <int GT, int C>
constexpr int value_chunks() {
  int cc = std::max(1, Isa::kAccumulators / (2 * GT));
  while (C % cc) --cc;
  return cc;
}

// acc[g] += sum over rows t in [lo, hi) of p[g][t] * v[t] for heads g < GT (acc and v split
// into pair chunks as qs is; p rows bs apart).
template <int GT, int kD>
inline void add_values(float* acc, const float* p, int64_t bs, const uint16_t* v, int lo,
                       int hi) {
  constexpr int C = kD / (2 * kLanes), CC = value_chunks<GT, C>();
  for (int c0 = 0; c0 < C; c0 += CC) {
    Isa::F a[GT][CC][2];
    for (int g = 0; g < GT; ++g)
      for (int c = 0; c < CC; ++c)
        for (int h = 0; h < 2; ++h)
          a[g][c][h] = Isa::load(acc + ((g * C + c0 + c) * 2 + h) * kLanes);
    for (int t = lo; t < hi; ++t) {
      for (int c = 0; c < CC; ++c) {
        Isa::F even, odd;
        Isa::widen_pairs(v + t * kD + (c0 + c) * 2 * kLanes, even, odd);
        for (int g = 0; g < GT; ++g) {
          const Isa::F pt = Isa::splat(p[g * bs + t]);
          a[g][c][0] = Isa::fma(pt, even, a[g][c][0]);
          a[g][c][1] = Isa::fma(pt, odd, a[g][c][1]);
        }
      }
    }
    for (int g = 0; g < GT; ++g)
      for (int c = 0; c < CC; ++c)
        for (int h = 0; h < 2; ++h)
          Isa::store(acc + ((g * C + c0 + c) * 2 + h) * kLanes, a[g][c][h]);
  }
}

// Calls fn(std::integral_constant<int, GT>{}, g0) over head tiles of up to 4 heads.
template <typename Fn>
inline void head_tiles(int64_t G, Fn fn) {
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    switch (std::min<int64_t>(4, G - g0)) {
      case 4: fn(std::integral_constant<int, 4>{}, g0); break;
      case 3: fn(std::integral_constant<int, 3>{}, g0); break;
      case 2: fn(std::integral_constant<int, 2>{}, g0); break;
      default: fn(std::integral_constant<int, 1>{}, g0);
    }
  }
}

// The G query heads at q sharing the kv head whose blocks are `rows`; bs % kLanes == 0.
// next_rows: the kv head this thread attends next for the same sequence, or null.
template <int kD>
void attend_widened(const c10::BFloat16* q_, const c10::BFloat16* key_cache_,
                    const c10::BFloat16* value_cache_, const int64_t* rows, int64_t context,
                    const float* slopes, int64_t window, float scale, int64_t G, int64_t bs,
                    c10::BFloat16* out, Scratch& s, const int64_t* next_rows) {
  static_assert(kWidenedHeadDim<kD>, "head dim must be a multiple of two registers");
  constexpr int C = kD / (2 * kLanes);
  const auto* q = reinterpret_cast<const uint16_t*>(q_);
  const auto* key_cache = reinterpret_cast<const uint16_t*>(key_cache_);
  const auto* value_cache = reinterpret_cast<const uint16_t*>(value_cache_);
  if (context <= 0) {  // no keys: a zero output, not NaN
    for (int64_t i = 0; i < G * kD; ++i) out[i] = c10::BFloat16(0.f);
    return;
  }
  float* qs = s.q.data();
  for (int64_t g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) {
      Isa::F even, odd;
      Isa::widen_pairs(q + g * kD + c * 2 * kLanes, even, odd);
      Isa::store(qs + (g * C + c) * 2 * kLanes, Isa::mul(even, Isa::splat(scale)));
      Isa::store(qs + (g * C + c) * 2 * kLanes + kLanes, Isa::mul(odd, Isa::splat(scale)));
    }
  std::fill(s.acc.begin(), s.acc.end(), 0.f);
  std::fill(s.max.begin(), s.max.end(), kNegInf);
  float* sums = s.lane_sums.data();  // [G, kLanes]: per-lane sums of the probabilities
  std::fill(s.lane_sums.begin(), s.lane_sums.end(), 0.f);
  float* scores = s.scores.data();  // [G, bs], then the probabilities in place
  const int64_t query_pos = context - 1;
  const int64_t first_key = window > 0 ? std::max<int64_t>(0, query_pos - window + 1) : 0;
  const int64_t first_block = first_key / bs, last_block = query_pos / bs;
  const int64_t block_elems = bs * kD;
  const Vec iota = Vec::arange(0.f, 1.f);

  prefetch_first_blocks(key_cache, value_cache, rows, first_block, last_block, block_elems * 2);
  for (int64_t j = first_block; j <= last_block; ++j) {
    const auto ahead =
        block_ahead(key_cache, value_cache, rows, next_rows, j, first_block, last_block,
                    block_elems);
    const uint16_t* k = key_cache + rows[j] * block_elems;
    const uint16_t* v = value_cache + rows[j] * block_elems;
    const int64_t base = j * bs;
    const int lo = static_cast<int>(std::max<int64_t>(first_key - base, 0));
    const int hi = static_cast<int>(std::min<int64_t>(context - base, bs));
    for (int t0 = 0; t0 < bs; t0 += kLanes) {
      if (t0 >= hi || t0 + kLanes <= lo) {
        for (int64_t g = 0; g < G; ++g) Vec(kNegInf).store(scores + g * bs + t0);
        continue;
      }
      const Vec key = iota + Vec(static_cast<float>(t0));
      const Vec valid = (key >= Vec(static_cast<float>(lo))) & (key < Vec(static_cast<float>(hi)));
      head_tiles(G, [&](auto tile, int64_t g0) {
        constexpr int GT = decltype(tile)::value;
        key_dots<GT, kD>(qs + g0 * kD, k + t0 * kD, s.parts.data(),
                         g0 == 0 ? ahead.from_row(t0, kD) : BlockAhead<uint16_t>{});
        for (int g = 0; g < GT; ++g) {
          Isa::F part[kLanes];
          for (int t = 0; t < kLanes; ++t)
            part[t] = Isa::load(s.parts.data() + (g * kLanes + t) * kLanes);
          Vec sc(Isa::reduce_lanes(part));
          if (slopes != nullptr)
            sc = sc + Vec(slopes[g0 + g]) * (key + Vec(static_cast<float>(base - query_pos)));
          Vec::blendv(Vec(kNegInf), sc, valid).store(scores + (g0 + g) * bs + t0);
        }
      });
    }
    for (int64_t g = 0; g < G; ++g) {
      float* sc = scores + g * bs;
      Vec top(kNegInf);
      for (int t0 = 0; t0 < bs; t0 += kLanes) top = at::vec::maximum(top, Vec::loadu(sc + t0));
      const float block_max = at::vec::vec_reduce_all<float>(
          [](const Vec& a, const Vec& b) { return at::vec::maximum(a, b); }, top);
      if (block_max > s.max[g] + kLazyMax) {  // every block has a key: the first one moves it
        const float alpha = std::exp(s.max[g] - block_max);
        s.max[g] = block_max;
        for (int64_t i = 0; i < kD; i += kLanes)
          (Vec::loadu(s.acc.data() + g * kD + i) * Vec(alpha)).store(s.acc.data() + g * kD + i);
        (Vec::loadu(sums + g * kLanes) * Vec(alpha)).store(sums + g * kLanes);
      }
      Vec lane_sums = Vec::loadu(sums + g * kLanes);
      for (int t0 = 0; t0 < bs; t0 += kLanes) {
        const Vec sc_t = Vec::loadu(sc + t0);
        // masked keys (-inf) to 0 whatever exp_u20 makes of -inf
        const Vec p = Vec::blendv(Vec(0.f), (sc_t - Vec(s.max[g])).exp_u20(),
                                  sc_t > Vec(kNegInf));
        p.store(sc + t0);
        lane_sums = lane_sums + p;
      }
      lane_sums.store(sums + g * kLanes);
    }
    head_tiles(G, [&](auto tile, int64_t g0) {
      constexpr int GT = decltype(tile)::value;
      add_values<GT, kD>(s.acc.data() + g0 * kD, scores + g0 * bs, bs, v, lo, hi);
    });
  }
  for (int64_t g = 0; g < G; ++g) {
    const float inv = 1.f / sum_lanes(Vec::loadu(sums + g * kLanes));
    const float* acc = s.acc.data() + g * kD;
    c10::BFloat16* o = out + g * kD;
    for (int c = 0; c < C; ++c)  // undo the split: lane i of a chunk's halves is pair i
      for (int i = 0; i < kLanes; ++i) {
        o[c * 2 * kLanes + 2 * i] = c10::BFloat16(acc[c * 2 * kLanes + i] * inv);
        o[c * 2 * kLanes + 2 * i + 1] = c10::BFloat16(acc[c * 2 * kLanes + kLanes + i] * inv);
      }
  }
}

}  // namespace paged_decode
}  // namespace tritonlm

#endif
