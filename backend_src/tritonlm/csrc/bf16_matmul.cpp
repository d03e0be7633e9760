// bfloat16 matmul with AVX512-BF16 dot products (vdpbf16ps) on weights packed once
// (tritonlm/layers/cpu_gemm.py) as [blocks, ceil(K/2), 32, 2]: per block of 32 output features,
// K/2 feature pairs of 32 columns x 2 consecutive k, so each block streams from memory in order.
// A block's first 16 columns are its "low" features, the next 16 its "high" ones: features
// 32j.. and 32j+16.. of a plain weight; in a gated one ([gate; up], I features each) gate features
// 16j.. and the up features I+16j.., so a tile can write act(gate) * up straight away.
// A tile of up to 12 rows x 32 columns keeps 24 float32 accumulators in registers and reads every
// weight byte once per tile. Measured here (2 Zen 4 cores, 30 SmolLM2 layers, cold
// weights): 1.8-2x oneDNN's bf16 matmul at 1-4 rows, 1.2-1.3x at 32, equal at 2048.
#include "cpu_vec.h"

#if defined(__AVX512BF16__) && defined(CPU_CAPABILITY_AVX512)
#define TRITONLM_BF16_MATMUL

#include <array>
#include <cstring>
#include <utility>

namespace tritonlm {
namespace {

constexpr int64_t kBlock = 32;        // output features per packed block
constexpr int kMaxRows = 12;          // rows per tile: 24 accumulators + 2 weight registers
constexpr int64_t kChunkRows = 192;   // rows per task: a chunk of x stays in L2 across a block
// Weight pairs (128 bytes each) prefetched ahead: 4 KB, about one memory latency of a tile's
// reads. 1 KB (8) left 32-row matmuls 5-15% slower and the 32-row LM head ~15% slower here.
constexpr int64_t kPrefetchPairs = 32;
constexpr int64_t kTasksPerGrab = 4;

inline __m512bh as_bf16(__m512i v) { return reinterpret_cast<__m512bh&>(v); }

// acc[r] += row r's feature pair (two bf16 in 32 bits: pair_of(r)) times the block's weight pair
// at w, for the block's 32 features.
template <int R, typename PairOf>
inline void accumulate_pair(__m512 (&acc)[R][2], const uint16_t* w, PairOf pair_of) {
  const __m512bh w0 = as_bf16(_mm512_loadu_si512(w));
  const __m512bh w1 = as_bf16(_mm512_loadu_si512(w + kBlock));
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) {
    const __m512bh x = as_bf16(_mm512_set1_epi32(pair_of(r)));
    acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, w0);
    acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, w1);
  }
}

struct Tile {
  const uint16_t* x;  // first row, features contiguous
  int64_t x_stride;
  const uint16_t* w;  // the block's [K/2, 32, 2]
  int64_t k;
  const uint16_t* bias_low;  // the low and high features' first bias values, or null
  const uint16_t* bias_high;
  uint16_t* out_low;   // first row's outputs of the low and high features (act(gate) * up: low)
  uint16_t* out_high;
  int64_t out_stride;
  int64_t cols_low;  // valid features (< 16 only in the last block)
  int64_t cols_high;
  const char* next;  // weights this tile pulls into L2 as it goes (see run_task), or null
  int64_t next_bytes_per_pair;
};

// kAct < 0: the matmul; else act(gate) * up with activate<kAct> (cpu_vec.h) on a gated weight,
// rounded as the unfused matmul then act_and_mul round.
template <int R, int kAct>
void matmul_tile(const Tile& t) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const int64_t pairs = t.k / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    const uint16_t* w = t.w + p * 2 * kBlock;
    _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetchPairs * 2 * kBlock), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetchPairs * 2 * kBlock + kBlock),
                 _MM_HINT_T0);
    if (t.next) {
      const char* line = t.next + p * t.next_bytes_per_pair;
      for (int64_t b = 0; b < t.next_bytes_per_pair; b += 64) _mm_prefetch(line + b, _MM_HINT_T1);
    }
    accumulate_pair<R>(acc, w, [&](int r) {
      int32_t pair;
      std::memcpy(&pair, t.x + r * t.x_stride + 2 * p, sizeof(pair));
      return pair;
    });
  }
  if (t.k & 1) {  // the last feature pairs with the packing's zero padding
    accumulate_pair<R>(acc, t.w + pairs * 2 * kBlock, [&](int r) {
      return static_cast<int32_t>(t.x[r * t.x_stride + t.k - 1]);
    });
  }
  const __mmask16 low = first_lanes(std::clamp<int64_t>(t.cols_low, 0, 16));
  const __mmask16 high = first_lanes(std::clamp<int64_t>(t.cols_high, 0, 16));
  Vec bias_low(0.f), bias_high(0.f);
  if (t.bias_low) {
    bias_low = widen_bf16(_mm256_maskz_loadu_epi16(low, t.bias_low));
    bias_high = widen_bf16(_mm256_maskz_loadu_epi16(high, t.bias_high));
  }
  for (int r = 0; r < R; ++r) {
    const Vec gate = Vec(acc[r][0]) + bias_low, up = Vec(acc[r][1]) + bias_high;
    if constexpr (kAct < 0) {
      _mm256_mask_storeu_epi16(t.out_low + r * t.out_stride, low, narrow_bf16(gate));
      _mm256_mask_storeu_epi16(t.out_high + r * t.out_stride, high, narrow_bf16(up));
    } else {
      const Vec act = rounded<c10::BFloat16>(
          activate<kAct>(rounded<c10::BFloat16>(gate)));
      _mm256_mask_storeu_epi16(t.out_low + r * t.out_stride, low,
                               narrow_bf16(act * rounded<c10::BFloat16>(up)));
    }
  }
}

using TileFn = void (*)(const Tile&);
template <int kAct, int... R>
constexpr std::array<TileFn, sizeof...(R)> tile_table(std::integer_sequence<int, R...>) {
  return {&matmul_tile<R + 1, kAct>...};
}
constexpr auto kRowCounts = std::make_integer_sequence<int, kMaxRows>{};
// [activation + 1][rows - 1]
constexpr std::array<std::array<TileFn, kMaxRows>, 3> kTiles = {
    tile_table<-1>(kRowCounts), tile_table<0>(kRowCounts), tile_table<1>(kRowCounts)};

}  // namespace

at::Tensor bf16_matmul(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                       bool gated, const std::optional<at::Tensor>& bias, int64_t activation) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1,
              "bf16_matmul: x must be [M, K] bfloat16 with contiguous features");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(!gated || out_features % 2 == 0, "bf16_matmul: a gated weight has an even number "
              "of features, got ", out_features);
  const int64_t half = gated ? out_features / 2 : kBlock / 2;  // high features' offset
  const int64_t blocks = gated ? (half + 15) / 16 : (out_features + kBlock - 1) / kBlock;
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 &&
                  packed.is_contiguous() && packed.size(0) == blocks &&
                  packed.size(1) == (k + 1) / 2 && packed.size(2) == kBlock &&
                  packed.size(3) == 2,
              "bf16_matmul: packed weight ", packed.sizes(), " does not hold ", out_features,
              " x ", k, gated ? " (gated)" : "");
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() &&
                        bias->numel() == out_features),
              "bf16_matmul: bias must be ", out_features, " contiguous bfloat16 values");
  TORCH_CHECK(activation == -1 || (gated && (activation == 0 || activation == 1)),
              "bf16_matmul: activation must be -1 (none), or 0 (silu) or 1 (gelu, tanh "
              "approximation) on a gated weight, got ", activation);
  const int64_t out_cols = activation < 0 ? out_features : half;
  auto out = at::empty({m, out_cols}, x.options());
  if (m == 0) return out;
  const auto* xs = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* ws = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  const auto* bs = bias ? reinterpret_cast<const uint16_t*>(bias->data_ptr()) : nullptr;
  auto* os = reinterpret_cast<uint16_t*>(out.data_ptr());
  const auto& tiles = kTiles[activation + 1];
  const int64_t pairs = packed.size(1), block_elems = pairs * 2 * kBlock;
  const int64_t chunks = (m + kChunkRows - 1) / kChunkRows;
  // Tasks run block-major, so a thread's consecutive tasks reuse one block of weights.
  auto run_task = [&](int64_t task) {
    const int64_t block = task / chunks, chunk = task % chunks;
    const int64_t row0 = chunk * kChunkRows, rows = std::min(kChunkRows, m - row0);
    const int64_t row_tiles = (rows + kMaxRows - 1) / kMaxRows;
    const int64_t per_tile = (rows + row_tiles - 1) / row_tiles;  // 32 rows: 11, 11, 10
    const int64_t low = block * (gated ? 16 : kBlock);  // the block's first low feature
    const int64_t cols_low = std::min<int64_t>(16, (gated ? half : out_features) - low);
    const int64_t cols_high = std::min<int64_t>(16, out_features - low - half);
    // The first tile streams the block from memory; the others compute from cache, so with x in
    // one chunk they pull the next block into L2 meanwhile, a share each, and the memory does not
    // idle (32 rows: the 30 SmolLM2 layers' matmuls 11.1 -> 10.4 ms here).
    const bool fetch_next = chunks == 1 && row_tiles > 1 && block + 1 < blocks;
    constexpr int64_t kPairBytes = 2 * kBlock * sizeof(uint16_t);
    const int64_t next_per_pair = fetch_next ? (kPairBytes + row_tiles - 2) / (row_tiles - 1) : 0;
    for (int64_t r = row0, i = 0; r < row0 + rows; r += per_tile, ++i) {
      const int64_t n = std::min(per_tile, row0 + rows - r);
      uint16_t* out_row = os + r * out_cols;
      const char* next = fetch_next && i > 0 ? reinterpret_cast<const char*>(
          ws + (block + 1) * block_elems) + (i - 1) * pairs * next_per_pair : nullptr;
      tiles[n - 1](Tile{xs + r * x.stride(0), x.stride(0), ws + block * block_elems, k,
                        bs ? bs + low : nullptr, bs ? bs + low + half : nullptr,
                        out_row + low, out_row + low + half, out_cols, cols_low, cols_high,
                        next, next_per_pair});
    }
  };
  // Threads take kTasksPerGrab tasks at a time rather than a fixed half each: on a machine that
  // also runs the server and its clients, a thread preempted mid-matmul then costs only its own
  // share, not the other threads' wait for it. (One task per grab interleaved the threads' weight
  // blocks and was ~8% slower here; four keep each thread's reads contiguous as a fixed half did.)
  const int64_t tasks = blocks * chunks;
  const int threads = region_threads(tasks);
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
#pragma omp for schedule(dynamic, kTasksPerGrab)
    for (int64_t task = 0; task < tasks; ++task) run_task(task);
  }
  return out;
}

}  // namespace tritonlm

#else

namespace tritonlm {
at::Tensor bf16_matmul(const at::Tensor&, const at::Tensor&, int64_t, bool,
                       const std::optional<at::Tensor>&, int64_t) {
  TORCH_CHECK(false, "bf16_matmul: built for a CPU without AVX512-BF16");
}
}  // namespace tritonlm

#endif

namespace tritonlm {
bool has_bf16_matmul() {
#ifdef TRITONLM_BF16_MATMUL
  return true;
#else
  return false;
#endif
}
}  // namespace tritonlm
