// The packed-weight matmul's tiling, shared by the bfloat16 (bf16_matmul.cpp) and quantized
// (quantized_matmul.cpp: int8, 4 bits) weights. Weights are packed once (tritonlm/layers/
// cpu_gemm.py) as [blocks, ceil(K/2), 32, 2]: per block of 32 output features, K/2 feature pairs
// of 32 columns x 2 consecutive k (4 bits: a pair in one byte), so each block streams from memory
// in order.
// A block's first 16 columns are its "low" features, the next 16 its "high" ones: features
// 32j.. and 32j+16.. of a plain weight; in a gated one ([gate; up], I features each) gate features
// 16j.. and the up features I+16j.., so a tile can write act(gate) * up straight away.
// A tile of up to 12 rows x 32 columns (AVX512; fewer for grouped weights, which also keep a
// group's sums) keeps its float32 accumulators in registers and reads every weight byte once per
// tile; AVX2's 16 registers hold 3 rows x 32 columns, or 6 rows x a block's 16 low features, then
// its 16 high ones, which reads the block twice, the second time from cache (Zen 3, 32 rows:
// passes over 8 KB or 128 KB of pair rows at a time, to keep a large K's block in L1 or L2,
// made SmolLM2's matmuls 7-20% slower than whole-block passes).
#pragma once
#include "packed_matmul_products.h"

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#define TRITONLM_PACKED_MATMUL

#include <array>
#include <type_traits>
#include <utility>

namespace tritonlm {
namespace packed_matmul {

constexpr int64_t kChunkRows = 192;   // rows per task: a chunk of x stays in L2 across blocks
// Weight bytes prefetched ahead: 4 KB, about one memory latency of a tile's reads. 1 KB left
// bf16's 32-row matmuls 5-15% slower and the 32-row LM head ~15% slower on Zen 5.
constexpr int64_t kPrefetchBytes = 4096;
// A task of one row tile (up to 12 rows) is bound by the weights' stream from memory: its tile
// also asks for the weights 16 KB ahead into L2, which keeps enough reads in flight for DRAM's
// latency (Emerald Rapids, bf16, 1 row: 30 SmolLM2 layers' matmuls 15% faster; in every first
// tile it made 32- and 256-row matmuls 2-5% slower, and 16 KB ahead into L1 slowed them too).
// In bytes, not pairs: 4-bit weights asked for 4 KB ahead (a quarter of bf16's) waited on their
// loads for a third of their tile's samples (Zen 4).
constexpr int64_t kStreamAheadBytes = 16384;
constexpr int64_t kTasksPerGrab = 4;

// Asks for the cache lines of one pair row. Always inlined, as every function that prefetches
// must be here: GCC finds a call that only prefetches free of effects and drops it before it
// would inline it (the tiles ran without any of their prefetches so).
template <int kHint, typename W>
__attribute__((always_inline)) inline void prefetch_pair(const W* row) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t b = 0; b < kPairElems<W> * static_cast<int64_t>(sizeof(W)); b += 64)
    _mm_prefetch(bytes + b, static_cast<_mm_hint>(kHint));
}

// O: the output's element, float or bfloat16 (uint16_t).
template <typename Mul, typename O>
struct Tile {
  const typename Mul::X* x;  // first row, features contiguous (an even number of them)
  int64_t x_stride;
  const typename Mul::W* w;  // the block's [ceil(K/2), 32, 2]
  int64_t pairs;
  const float* scale_low;  // the low and high features' first scales (int8 rows), or null
  const float* scale_high;
  const typename Mul::P* groups;  // Mul::kGroups: the block's [groups, 2, 32] scales, biases
  int64_t group_pairs;  // pairs per group
  const float* x_sums;  // Mul::kGroups: row 0's sums of x over each group, then row 1's, ...
  const float* x_scales;  // Mul::kIntegerDots: row 0's (int8 scale, integer sum) per group, ...
  const O* bias_low;  // the low and high features' first bias values, or null
  const O* bias_high;
  O* out_low;   // first row's outputs of the low and high features (act(gate) * up: low)
  O* out_high;
  int64_t out_stride;
  int64_t cols_low;  // valid features (< 16 only in the last block)
  int64_t cols_high;
  bool streams;      // the task's only tile: its weights come from memory
  const char* next;  // weights this tile pulls into L2 as it goes (see run_tasks), or null
  int64_t next_bytes_per_pair;
  bool prompt;  // one of a prompt's many tiles (rows past one chunk): AMX tiles defer its epilogue
};

// Asks for the weights ahead of pair row p: into L1, into L2 where the tile streams them from
// memory, and its share of the next block where it computes from cache (see run_tasks).
template <typename Mul, typename O>
__attribute__((always_inline)) inline void prefetch_ahead(const Tile<Mul, O>& t, int64_t p) {
  using W = typename Mul::W;
  const W* w = t.w + p * kPairElems<W>;
  prefetch_pair<_MM_HINT_T0>(w + pairs_in<W>(kPrefetchBytes) * kPairElems<W>);
  if (t.streams) prefetch_pair<_MM_HINT_T1>(w + pairs_in<W>(kStreamAheadBytes) * kPairElems<W>);
  if (t.next) {
    const char* line = t.next + p * t.next_bytes_per_pair;
    for (int64_t b = 0; b < t.next_bytes_per_pair; b += 64) _mm_prefetch(line + b, _MM_HINT_T1);
  }
}

// Adds pair rows [begin, end) times x to sums, the tile's float32 accumulators.
template <typename Mul, int R, typename O, typename Prefetch>
void add_pairs(typename Mul::Isa::F (&sums)[R][kVecs<typename Mul::Isa>], const Tile<Mul, O>& t,
               int64_t begin, int64_t end, Prefetch prefetch) {
  for (int64_t p = begin; p < end; ++p) {
    prefetch(p);
    Mul::template accumulate<R>(sums, pair_row(t.w, p), t.x + 2 * p, t.x_stride);
  }
}

// A tile's float32 sums as its outputs, a row at a time: times each feature's scale (int8 rows),
// plus bias; kAct < 0: stored; else act(gate) * up with activate<kAct> (cpu_vec.h) on a gated
// bfloat16 weight, rounded as the unfused matmul then act_and_mul round. Registers [0, V/2) hold
// a block's low features, [V/2, V) its high ones.
template <typename Mul, typename O>
struct Epilogue {
  using I = typename Mul::Isa;
  using F = typename I::F;
  static constexpr int V = kVecs<I>, H = V / 2;
  const Tile<Mul, O>& t;
  int64_t cols[V];  // valid lanes of each register
  F bias[V], scale[V];

  explicit Epilogue(const Tile<Mul, O>& tile) : t(tile) {
    for (int v = 0; v < V; ++v) {
      const int64_t first = (v % H) * I::kLanes;
      cols[v] = std::clamp<int64_t>((v < H ? t.cols_low : t.cols_high) - first, 0, I::kLanes);
      const O* b = v < H ? t.bias_low : t.bias_high;
      bias[v] = b ? I::load(b + first, cols[v]) : I::zero();
      const float* s = v < H ? t.scale_low : t.scale_high;
      scale[v] = s ? I::load(s + first, cols[v]) : I::zero();
    }
  }

  template <int kAct>
  void write(F (&acc)[V], int64_t r) const {
    for (int v = 0; v < V; ++v)
      acc[v] = t.scale_low ? I::fma(acc[v], scale[v], bias[v]) : I::add(acc[v], bias[v]);
    if constexpr (kAct < 0) {
      for (int v = 0; v < V; ++v)
        I::store((v < H ? t.out_low : t.out_high) + r * t.out_stride + (v % H) * I::kLanes,
                 acc[v], cols[v]);
    } else {
      for (int v = 0; v < H; ++v) {
        const F act = I::round_bf16(I::template activate<kAct>(I::round_bf16(acc[v])));
        I::store(t.out_low + r * t.out_stride + v * I::kLanes,
                 I::mul(act, I::round_bf16(acc[v + H])), cols[v]);
      }
    }
  }
};

// The tile of R rows of x (kAct: see Epilogue) in registers.
template <typename Mul, typename O, int R, int kAct>
void matmul_tile(const Tile<Mul, O>& t) {
  using I = typename Mul::Isa;
  using F = typename I::F;
  constexpr int V = kVecs<I>;
  using W = typename Mul::W;
  F acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = I::zero();
  auto prefetch = [&](int64_t p) __attribute__((always_inline)) { prefetch_ahead(t, p); };
  if constexpr (Mul::kGroups) {
    const int64_t groups = (t.pairs + t.group_pairs - 1) / t.group_pairs;
    const typename Mul::P* group = t.groups;
    // A streaming tile asks for the scales and biases as far ahead as for the weights, and for
    // the next group's into L1: at 4 bits in groups of 32 a group's 256 bytes (float32) come
    // every 512 weight bytes, and a fifth of the 1-row tile's samples waited on them (Zen 4:
    // 1.1x faster).
    const int64_t params_ahead =
        2 * kBlock * std::max<int64_t>(1, pairs_in<W>(kStreamAheadBytes) / t.group_pairs);
    for (int64_t g = 0; g < groups; ++g, group += 2 * kBlock) {
      if (t.streams)
        for (int64_t b = 0; b < 2 * kBlock * static_cast<int64_t>(sizeof(*group)); b += 64) {
          _mm_prefetch(reinterpret_cast<const char*>(group + params_ahead) + b, _MM_HINT_T1);
          _mm_prefetch(reinterpret_cast<const char*>(group + 2 * kBlock) + b, _MM_HINT_T0);
        }
      F sums[R][V];
      for (int r = 0; r < R; ++r)
        for (int v = 0; v < V; ++v) sums[r][v] = I::zero();
      const int64_t begin = g * t.group_pairs, end = std::min(t.pairs, begin + t.group_pairs);
      if constexpr (Mul::kIntegerDots)
        Mul::template group_sums<R>(sums, t.w, t.x, t.x_stride, t.x_scales + 2 * g, 2 * groups,
                                    begin, end, prefetch);
      else
        add_pairs<Mul, R>(sums, t, begin, end, prefetch);
      for (int v = 0; v < V; ++v) {
        F scale, bias;
        Mul::group_params(group, v, scale, bias);
        for (int r = 0; r < R; ++r)
          acc[r][v] = I::fma(sums[r][v], scale,
                             I::fma(I::splat(t.x_sums[r * groups + g]), bias, acc[r][v]));
      }
    }
  } else if constexpr (R * V > I::kAccumulators) {  // the block's low features, then its high
    for (int64_t p = 0; p < t.pairs; ++p) {
      prefetch(p);
      Mul::template accumulate_half<R, 0>(acc, pair_row(t.w, p), t.x + 2 * p, t.x_stride);
    }
    for (int64_t p = 0; p < t.pairs; ++p) {  // the first pass pulled these lines into L2 or L1
      const W* w = t.w + p * kPairElems<W>;
      prefetch_pair<_MM_HINT_T0>(w + pairs_in<W>(kPrefetchBytes) * kPairElems<W>);
      Mul::template accumulate_half<R, 1>(acc, pair_row(t.w, p), t.x + 2 * p, t.x_stride);
    }
  } else {
    add_pairs<Mul, R>(acc, t, 0, t.pairs, prefetch);
  }
  const Epilogue<Mul, O> out(t);
  for (int r = 0; r < R; ++r) out.template write<kAct>(acc[r], r);
}

template <typename Mul, typename O>
using TileFn = void (*)(const Tile<Mul, O>&);
// Whether Mul multiplies in AMX tiles (packed_matmul_amx.h) rather than vector registers.
template <typename Mul>
constexpr bool kAmx = requires { Mul::kAmxTiles; };
template <typename Mul, typename O, int kAct, int... R>
constexpr std::array<TileFn<Mul, O>, sizeof...(R)> tile_table(std::integer_sequence<int, R...>) {
  if constexpr (kAmx<Mul>)
    return {&Mul::template tile<O, R + 1, kAct>...};
  else
    return {&matmul_tile<Mul, O, R + 1, kAct>...};
}
template <typename Mul>
constexpr int tile_rows() {
  if constexpr (Mul::kIntegerDots || kAmx<Mul>) return Mul::kRows;
  else if constexpr (Mul::kGroups) return Mul::Isa::kMaxGroupedRows;
  else return Mul::Isa::kMaxRows;
}
template <typename Mul>
constexpr int kTileRows = tile_rows<Mul>();
template <typename Mul>
constexpr auto kRowCounts = std::make_integer_sequence<int, kTileRows<Mul>>{};
// [rows - 1]: the tiles applying activation kAct (-1: none)
template <typename Mul, typename O, int kAct>
constexpr std::array<TileFn<Mul, O>, kTileRows<Mul>> kTiles =
    tile_table<Mul, O, kAct>(kRowCounts<Mul>);
// Whether tiles with outputs of O may apply an activation: a gated weight's, bfloat16 outputs
// only (the epilogue rounds as the unfused bfloat16 matmul and act_and_mul do). Float32 outputs'
// tiles are built without, a third of their tiles.
template <typename O>
constexpr bool kActivates = std::is_same_v<O, uint16_t>;

}  // namespace packed_matmul
}  // namespace tritonlm

#endif
