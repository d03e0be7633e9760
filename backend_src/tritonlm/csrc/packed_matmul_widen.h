// A packed block's weights widened (and dequantized) to float32 outside the tiles' registers:
// pair row by pair row for a caller's store, or into a buffer that a chunk's many row tiles read
// (prewiden); and x's bfloat16 rows widened once for the widening tiles (float_rows).
#pragma once
#include "packed_matmul.h"

#ifdef TRITONLM_PACKED_MATMUL

#include <vector>

namespace tritonlm {
namespace packed_matmul {

// A block's pair rows widened and dequantized to float32 (int8 rows keep their values: the
// tiles scale the sums), each register's even and odd values handed to store(p, v, even, odd).
// A group's parameters are read once for its pair rows (read for each, they were a third of
// the instructions at 4 bits in groups of 32).
template <typename Mul, typename Store>
void dequantize_block(const typename Mul::W* w, int64_t pairs, const typename Mul::P* groups,
                      int64_t group_pairs, Store store) {
  using I = typename Mul::Isa;
  using W = typename Mul::W;
  const int64_t step = Mul::kGroups ? group_pairs : pairs;
  for (int64_t begin = 0; begin < pairs; begin += step) {
    typename I::F scale[Mul::V], bias[Mul::V];
    if constexpr (Mul::kGroups)
      for (int v = 0; v < Mul::V; ++v)
        Mul::group_params(groups + begin / group_pairs * 2 * kBlock, v, scale[v], bias[v]);
    auto dequantize_pair = [&](int64_t p, PairRow<W> row) __attribute__((always_inline)) {
      prefetch_pair<_MM_HINT_T0>(w + (p + pairs_in<W>(kPrefetchBytes)) * kPairElems<W>);
      for (int v = 0; v < Mul::V; ++v) {
        typename I::F even, odd;
        Mul::widen(row, v, even, odd);
        if constexpr (Mul::kGroups) {
          even = I::fma(even, scale[v], bias[v]);
          odd = I::fma(odd, scale[v], bias[v]);
        }
        store(p, v, even, odd);
      }
    };
    for (int64_t p = begin; p < std::min(pairs, begin + step); ++p) {
      if constexpr (kQuads<W>) {  // a constant half of the quad row: shifts by immediates
        if (p % 2 == 0)
          dequantize_pair(p, Int4Row{pair_row(w, p).quad, 0});
        else
          dequantize_pair(p, Int4Row{pair_row(w, p).quad, 1});
      } else {
        dequantize_pair(p, pair_row(w, p));
      }
    }
  }
}

// The block dequantized to float32 at `out` [pairs, 64], in the order WidenedFma<Isa, float, ...>
// reads it.
template <typename Mul>
void prewiden(const typename Mul::W* w, int64_t pairs, const typename Mul::P* groups,
              int64_t group_pairs, float* out) {
  using I = typename Mul::Isa;
  dequantize_block<Mul>(w, pairs, groups, group_pairs,
                        [&](int64_t p, int v, typename I::F even, typename I::F odd) {
    I::store(out + p * 2 * kBlock + v * 2 * I::kLanes, even);
    I::store(out + p * 2 * kBlock + v * 2 * I::kLanes + I::kLanes, odd);
  });
}

// x [m, k] (k even, features contiguous) as the widening tiles read it: float32 rows. bfloat16 x
// is widened once per matmul into the calling thread's buffer, so that a tile's broadcast of an x
// value is one load (widening a bfloat16 value as it is broadcast took three instructions on the
// vector ports the FMAs need: Cascade Lake, SmolLM2's bf16 matmuls at 8 rows 23.8 -> 20.3 ms).
struct FloatRows {
  const float* data;
  int64_t stride;
};
inline FloatRows float_rows(const at::Tensor& x) {
  if (x.scalar_type() == at::kFloat) return {x.data_ptr<float>(), x.stride(0)};
  const int64_t m = x.size(0), k = x.size(1);
  thread_local std::vector<float> widened;
  widened.resize(m * k);
  float* rows = widened.data();  // the threads below would each name their own `widened`
  const auto* xs = reinterpret_cast<const c10::BFloat16*>(x.data_ptr());
  at::parallel_for(0, m, std::max<int64_t>(1, (1 << 16) / k), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const c10::BFloat16* in = xs + r * x.stride(0);
      float* out = rows + r * k;
      int64_t i = 0;
      for (; i + W <= k; i += W) load_float(in + i).store(out + i);
      if (i < k) load_float(in + i, k - i).store(out + i, k - i);
    }
  });
  return {rows, k};
}

}  // namespace packed_matmul
}  // namespace tritonlm

#endif
