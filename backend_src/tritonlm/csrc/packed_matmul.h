// The packed-weight matmul's tiling, shared by the bfloat16 (bf16_matmul.cpp) and int8
// (int8_matmul.cpp) weights. Weights are packed once (tritonlm/layers/cpu_gemm.py) as
// [blocks, ceil(K/2), 32, 2]: per block of 32 output features, K/2 feature pairs of 32 columns x 2
// consecutive k, so each block streams from memory in order.
// A block's first 16 columns are its "low" features, the next 16 its "high" ones: features
// 32j.. and 32j+16.. of a plain weight; in a gated one ([gate; up], I features each) gate features
// 16j.. and the up features I+16j.., so a tile can write act(gate) * up straight away.
// A tile of up to 12 rows x 32 columns (AVX512; 3 rows with AVX2's 16 registers) keeps its
// float32 accumulators in registers and reads every weight byte once per tile.
#pragma once
#include "packed_matmul_registers.h"

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#define TRITONLM_PACKED_MATMUL

#include <array>
#include <cstring>
#include <utility>

namespace tritonlm {
namespace packed_matmul {

constexpr int64_t kBlock = 32;        // output features per packed block
constexpr int64_t kChunkRows = 192;   // rows per task: a chunk of x stays in L2 across blocks
// Weight pairs (128 bytes each) prefetched ahead: 4 KB, about one memory latency of a tile's
// reads. 1 KB (8) left 32-row matmuls 5-15% slower and the 32-row LM head ~15% slower on Zen 5.
constexpr int64_t kPrefetchPairs = 32;
// A task of one row tile (up to 12 rows) is bound by the weights' stream from memory: its tile
// also asks for the weights 16 KB ahead into L2, which keeps enough reads in flight for DRAM's
// latency (Emerald Rapids, 1 row: 30 SmolLM2 layers' matmuls 15% faster; in every first tile
// it made 32- and 256-row matmuls 2-5% slower, and 16 KB ahead into L1 slowed them too).
constexpr int64_t kStreamAheadPairs = 128;
constexpr int64_t kTasksPerGrab = 4;

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
  using Isa = Avx512;
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

template <typename I, typename Weight>
struct WidenedFma {
  using X = float;
  using W = Weight;
  using Isa = I;
  using F = typename I::F;
  static constexpr int V = kVecs<I>;
  template <int R>
  static void accumulate(F (&acc)[R][V], const W* w, const X* x, int64_t x_stride) {
    if constexpr (V <= 2) {  // the pair row widened once, each row's x broadcast once
      F even[V], odd[V];
      for (int v = 0; v < V; ++v) I::widen_pairs(w + v * 2 * I::kLanes, even[v], odd[v]);
#pragma GCC unroll 12
      for (int r = 0; r < R; ++r) {
        const F xe = I::splat(x[r * x_stride]), xo = I::splat(x[r * x_stride + 1]);
        for (int v = 0; v < V; ++v) acc[r][v] = I::fma(xe, even[v], I::fma(xo, odd[v], acc[r][v]));
      }
    } else {  // 16 registers hold no whole widened pair row beside the accumulators: a vector's
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) {
        F even, odd;
        I::widen_pairs(w + v * 2 * I::kLanes, even, odd);
#pragma GCC unroll 12
        for (int r = 0; r < R; ++r)
          acc[r][v] = I::fma(I::splat(x[r * x_stride]), even,
                             I::fma(I::splat(x[r * x_stride + 1]), odd, acc[r][v]));
      }
    }
  }
};

// O: the output's element, float or bfloat16 (uint16_t).
template <typename Mul, typename O>
struct Tile {
  const typename Mul::X* x;  // first row, features contiguous (an even number of them)
  int64_t x_stride;
  const typename Mul::W* w;  // the block's [ceil(K/2), 32, 2]
  int64_t pairs;
  const float* scale_low;  // the low and high features' first scales (int8 rows), or null
  const float* scale_high;
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
};

// kAct < 0: the matmul (times each feature's scale, plus bias); else act(gate) * up with
// activate<kAct> (cpu_vec.h) on a gated bfloat16 weight, rounded as the unfused matmul then
// act_and_mul round. Registers [0, V/2) hold a block's low features, [V/2, V) its high ones.
template <typename Mul, typename O, int R, int kAct>
void matmul_tile(const Tile<Mul, O>& t) {
  using I = typename Mul::Isa;
  using F = typename I::F;
  constexpr int V = kVecs<I>, H = V / 2;
  F acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = I::zero();
  for (int64_t p = 0; p < t.pairs; ++p) {
    const typename Mul::W* w = t.w + p * 2 * kBlock;
    _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetchPairs * 2 * kBlock), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetchPairs * 2 * kBlock + kBlock),
                 _MM_HINT_T0);
    if (t.streams) {
      _mm_prefetch(reinterpret_cast<const char*>(w + kStreamAheadPairs * 2 * kBlock), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(w + kStreamAheadPairs * 2 * kBlock + kBlock),
                   _MM_HINT_T1);
    }
    if (t.next) {
      const char* line = t.next + p * t.next_bytes_per_pair;
      for (int64_t b = 0; b < t.next_bytes_per_pair; b += 64) _mm_prefetch(line + b, _MM_HINT_T1);
    }
    Mul::template accumulate<R>(acc, w, t.x + 2 * p, t.x_stride);
  }
  int64_t cols[V];  // valid lanes of each register
  F bias[V], scale[V];
  for (int v = 0; v < V; ++v) {
    const int64_t first = (v % H) * I::kLanes;
    cols[v] = std::clamp<int64_t>((v < H ? t.cols_low : t.cols_high) - first, 0, I::kLanes);
    const O* b = v < H ? t.bias_low : t.bias_high;
    bias[v] = b ? I::load(b + first, cols[v]) : I::zero();
    const float* s = v < H ? t.scale_low : t.scale_high;
    scale[v] = s ? I::load(s + first, cols[v]) : I::zero();
  }
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < V; ++v)
      acc[r][v] = t.scale_low ? I::fma(acc[r][v], scale[v], bias[v]) : I::add(acc[r][v], bias[v]);
    if constexpr (kAct < 0) {
      for (int v = 0; v < V; ++v)
        I::store((v < H ? t.out_low : t.out_high) + r * t.out_stride + (v % H) * I::kLanes,
                 acc[r][v], cols[v]);
    } else {
      for (int v = 0; v < H; ++v) {
        const F act = I::round_bf16(I::template activate<kAct>(I::round_bf16(acc[r][v])));
        I::store(t.out_low + r * t.out_stride + v * I::kLanes,
                      I::mul(act, I::round_bf16(acc[r][v + H])), cols[v]);
      }
    }
  }
}

template <typename Mul, typename O>
using TileFn = void (*)(const Tile<Mul, O>&);
template <typename Mul, typename O, int kAct, int... R>
constexpr std::array<TileFn<Mul, O>, sizeof...(R)> tile_table(std::integer_sequence<int, R...>) {
  return {&matmul_tile<Mul, O, R + 1, kAct>...};
}
template <typename Mul>
constexpr int kTileRows = Mul::Isa::kMaxRows;
template <typename Mul>
constexpr auto kRowCounts = std::make_integer_sequence<int, kTileRows<Mul>>{};
// [activation + 1][rows - 1]; activations only on bfloat16 outputs
template <typename Mul, typename O>
constexpr std::array<std::array<TileFn<Mul, O>, kTileRows<Mul>>, 3> kTiles = {
    tile_table<Mul, O, -1>(kRowCounts<Mul>), tile_table<Mul, O, 0>(kRowCounts<Mul>),
    tile_table<Mul, O, 1>(kRowCounts<Mul>)};

struct Shape {
  int64_t m, out_features, out_cols, half, blocks;
  bool gated;
};

// x [m, 2 * pairs] as Mul multiplies it, the packed weight, per-feature scales or null, the bias
// or null, out [m, out_cols].
template <typename Mul, typename O>
void run_tasks(const at::Tensor& x, const typename Mul::W* ws, int64_t pairs, const float* ss,
               const O* bs, O* os, const Shape& s, int64_t activation) {
  const auto* xs = reinterpret_cast<const typename Mul::X*>(x.data_ptr());
  const auto& tiles = kTiles<Mul, O>[activation + 1];
  const int64_t m = s.m, half = s.half, block_elems = pairs * 2 * kBlock;
  const int64_t chunks = (m + kChunkRows - 1) / kChunkRows;
  // Tasks run chunk-major: a thread's consecutive tasks reuse one chunk of x from L2 while the
  // weight blocks stream by.
  auto run_task = [&](int64_t task) {
    const int64_t chunk = task / s.blocks, block = task % s.blocks;
    const int64_t row0 = chunk * kChunkRows, rows = std::min(kChunkRows, m - row0);
    const int64_t row_tiles = (rows + kTileRows<Mul> - 1) / kTileRows<Mul>;
    const int64_t per_tile = (rows + row_tiles - 1) / row_tiles;  // 32 rows: 11, 11, 10
    const int64_t low = block * (s.gated ? 16 : kBlock);  // the block's first low feature
    const int64_t cols_low = std::min<int64_t>(16, (s.gated ? half : s.out_features) - low);
    const int64_t cols_high = std::min<int64_t>(16, s.out_features - low - half);
    // The first tile streams the block from memory; the others compute from cache, so with x in
    // one chunk they pull the next block into L2 meanwhile, a share each, and the memory does not
    // idle (32 rows: the 30 SmolLM2 layers' matmuls 11.1 -> 10.4 ms on Zen 5).
    const bool fetch_next = chunks == 1 && row_tiles > 1 && block + 1 < s.blocks;
    constexpr int64_t kPairBytes = 2 * kBlock * sizeof(typename Mul::W);
    const int64_t next_per_pair = fetch_next ? (kPairBytes + row_tiles - 2) / (row_tiles - 1) : 0;
    for (int64_t r = row0, i = 0; r < row0 + rows; r += per_tile, ++i) {
      const int64_t n = std::min(per_tile, row0 + rows - r);
      O* out_row = os + r * s.out_cols;
      const char* next = fetch_next && i > 0 ? reinterpret_cast<const char*>(
          ws + (block + 1) * block_elems) + (i - 1) * pairs * next_per_pair : nullptr;
      tiles[n - 1]({xs + r * x.stride(0), x.stride(0), ws + block * block_elems, pairs,
                    ss ? ss + low : nullptr, ss ? ss + low + half : nullptr,
                    bs ? bs + low : nullptr, bs ? bs + low + half : nullptr,
                    out_row + low, out_row + low + half, s.out_cols, cols_low, cols_high,
                    row_tiles == 1, next, next_per_pair});
    }
  };
  // Threads take kTasksPerGrab tasks at a time rather than a fixed half each: on a machine that
  // also runs the server and its clients, a thread preempted mid-matmul then costs only its own
  // share, not the other threads' wait for it. (One task per grab interleaved the threads' weight
  // blocks and was ~8% slower on Zen 5; four keep each thread's reads contiguous as a fixed half
  // did.)
  const int64_t tasks = s.blocks * chunks;
  const int threads = region_threads(tasks);
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
#pragma omp for schedule(dynamic, kTasksPerGrab)
    for (int64_t task = 0; task < tasks; ++task) run_task(task);
  }
}

}  // namespace packed_matmul
}  // namespace tritonlm

#endif
