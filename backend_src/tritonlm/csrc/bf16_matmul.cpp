// bfloat16 matmul on weights packed once (tritonlm/layers/cpu_gemm.py) as
// [blocks, ceil(K/2), 32, 2]: per block of 32 output features, K/2 feature pairs of 32 columns x 2
// consecutive k, so each block streams from memory in order.
// A block's first 16 columns are its "low" features, the next 16 its "high" ones: features
// 32j.. and 32j+16.. of a plain weight; in a gated one ([gate; up], I features each) gate features
// 16j.. and the up features I+16j.., so a tile can write act(gate) * up straight away.
// A tile of up to 12 rows x 32 columns (AVX512; 3 rows with AVX2's 16 registers) keeps its float32
// accumulators in registers and reads every weight byte once per tile. Measured on 2 Zen 4 cores (30 SmolLM2 layers, cold weights):
// 1.8-2x oneDNN's bf16 matmul at 1-4 rows, 1.2-1.3x at 32, equal at 2048.
#include "cpu_vec.h"

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#define TRITONLM_BF16_MATMUL

#include <array>
#include <chrono>
#include <cstring>
#include <utility>

namespace tritonlm {
namespace {

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

// The registers a tile computes in, as this build targets them: AVX512 (16 float32 lanes) or AVX2
// + FMA (8). The tiling, the task schedule and the epilogue are written once over these; only the
// width differs.
#ifdef CPU_CAPABILITY_AVX512
struct Avx512 {
  using F = __m512;
  static constexpr int kLanes = 16;
  static constexpr int kMaxRows = 12;  // 24 accumulators + the weight registers (32 in all)
  static F zero() { return _mm512_setzero_ps(); }
  static F splat(float v) { return _mm512_set1_ps(v); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  // kLanes feature pairs (2 * kLanes bf16) as float32: the even-k weights and the odd-k ones.
  static void widen_pairs(const uint16_t* w, F& even, F& odd) {
    const __m512i pairs = _mm512_loadu_si512(w);
    even = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
    odd = _mm512_castsi512_ps(
        _mm512_and_si512(pairs, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
  }
  static F load_bf16(const uint16_t* p, int64_t n) {
    return widen_bf16(_mm256_maskz_loadu_epi16(first_lanes(n), p));
  }
  static void store_bf16(uint16_t* p, F v, int64_t n) {
    _mm256_mask_storeu_epi16(p, first_lanes(n), narrow_bf16(v));
  }
  static F round_bf16(F v) { return rounded<c10::BFloat16>(v); }
  template <int kAct>
  static F activate(F x) { return tritonlm::activate<kAct>(Vec(x)); }
};
using Native = Avx512;
#else
struct Avx2 {
  using F = __m256;
  static constexpr int kLanes = 8;
  static constexpr int kMaxRows = 3;  // 12 accumulators; one vector's weights widened at a time
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
  static F load_bf16(const uint16_t* p, int64_t n) {
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
  static void store_bf16(uint16_t* p, F v, int64_t n) {
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

template <typename Isa>
constexpr int kVecs = kBlock / Isa::kLanes;  // registers across a block's 32 features

// The two ways a tile adds x's feature pair times a block's weight pair to its accumulators
// (bf16 products are exact in float32; WidenedFma adds a pair's odd product, then its even one,
// each rounded once, which is how Intel documents vdpbf16ps):
// - DotProducts (AVX512-BF16): vdpbf16ps on x's bf16 pairs, 32 products an instruction;
// - WidenedFma: each weight pair split into its float32 halves (a shift, a mask), then two FMAs
//   per lane, on x widened to float32 once per matmul. Where vdpbf16ps issues at half the FMA
//   rate (Intel Xeons without AMX: 95 vs 193 GFLOPS a core measured), this doubles the peak; on
//   AVX2 it is the only way, and reads half the bytes of float32 weights.
// x points at row 0's pair; rows lie x_stride apart.
#ifdef __AVX512BF16__
struct DotProducts {
  using X = uint16_t;
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

template <typename I>
struct WidenedFma {
  using X = float;
  using Isa = I;
  using F = typename I::F;
  static constexpr int V = kVecs<I>;
  template <int R>
  static void accumulate(F (&acc)[R][V], const uint16_t* w, const X* x, int64_t x_stride) {
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

template <typename X>
struct Tile {
  const X* x;  // first row, features contiguous (an even number of them)
  int64_t x_stride;
  const uint16_t* w;  // the block's [ceil(K/2), 32, 2]
  int64_t pairs;
  const uint16_t* bias_low;  // the low and high features' first bias values, or null
  const uint16_t* bias_high;
  uint16_t* out_low;   // first row's outputs of the low and high features (act(gate) * up: low)
  uint16_t* out_high;
  int64_t out_stride;
  int64_t cols_low;  // valid features (< 16 only in the last block)
  int64_t cols_high;
  bool streams;      // the task's only tile: its weights come from memory
  const char* next;  // weights this tile pulls into L2 as it goes (see run_tasks), or null
  int64_t next_bytes_per_pair;
};

// kAct < 0: the matmul; else act(gate) * up with activate<kAct> (cpu_vec.h) on a gated weight,
// rounded as the unfused matmul then act_and_mul round. Registers [0, V/2) hold a block's low
// features, [V/2, V) its high ones.
template <typename Mul, int R, int kAct>
void matmul_tile(const Tile<typename Mul::X>& t) {
  using I = typename Mul::Isa;
  using F = typename I::F;
  constexpr int V = kVecs<I>, H = V / 2;
  F acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = I::zero();
  for (int64_t p = 0; p < t.pairs; ++p) {
    const uint16_t* w = t.w + p * 2 * kBlock;
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
  F bias[V];
  for (int v = 0; v < V; ++v) {
    const int64_t valid = (v < H ? t.cols_low : t.cols_high) - (v % H) * I::kLanes;
    cols[v] = std::clamp<int64_t>(valid, 0, I::kLanes);
    const uint16_t* b = v < H ? t.bias_low : t.bias_high;
    bias[v] = b ? I::load_bf16(b + (v % H) * I::kLanes, cols[v]) : I::zero();
  }
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < V; ++v) acc[r][v] = I::add(acc[r][v], bias[v]);
    if constexpr (kAct < 0) {
      for (int v = 0; v < V; ++v)
        I::store_bf16((v < H ? t.out_low : t.out_high) + r * t.out_stride + (v % H) * I::kLanes,
                      acc[r][v], cols[v]);
    } else {
      for (int v = 0; v < H; ++v) {
        const F act = I::round_bf16(I::template activate<kAct>(I::round_bf16(acc[r][v])));
        I::store_bf16(t.out_low + r * t.out_stride + v * I::kLanes,
                      I::mul(act, I::round_bf16(acc[r][v + H])), cols[v]);
      }
    }
  }
}

template <typename Mul>
using TileFn = void (*)(const Tile<typename Mul::X>&);
template <typename Mul, int kAct, int... R>
constexpr std::array<TileFn<Mul>, sizeof...(R)> tile_table(std::integer_sequence<int, R...>) {
  return {&matmul_tile<Mul, R + 1, kAct>...};
}
template <typename Mul>
constexpr int kTileRows = Mul::Isa::kMaxRows;
template <typename Mul>
constexpr auto kRowCounts = std::make_integer_sequence<int, kTileRows<Mul>>{};
// [activation + 1][rows - 1]
template <typename Mul>
constexpr std::array<std::array<TileFn<Mul>, kTileRows<Mul>>, 3> kTiles = {
    tile_table<Mul, -1>(kRowCounts<Mul>), tile_table<Mul, 0>(kRowCounts<Mul>),
    tile_table<Mul, 1>(kRowCounts<Mul>)};

struct Shape {
  int64_t m, out_features, out_cols, half, blocks;
  bool gated;
};

// x [m, 2 * pairs] as Mul multiplies it, the packed weight, the bias or null, out [m, out_cols].
template <typename Mul>
void run_tasks(const at::Tensor& x, const uint16_t* ws, int64_t pairs, const uint16_t* bs,
               uint16_t* os, const Shape& s, int64_t activation) {
  const auto* xs = reinterpret_cast<const typename Mul::X*>(x.data_ptr());
  const auto& tiles = kTiles<Mul>[activation + 1];
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
    constexpr int64_t kPairBytes = 2 * kBlock * sizeof(uint16_t);
    const int64_t next_per_pair = fetch_next ? (kPairBytes + row_tiles - 2) / (row_tiles - 1) : 0;
    for (int64_t r = row0, i = 0; r < row0 + rows; r += per_tile, ++i) {
      const int64_t n = std::min(per_tile, row0 + rows - r);
      uint16_t* out_row = os + r * s.out_cols;
      const char* next = fetch_next && i > 0 ? reinterpret_cast<const char*>(
          ws + (block + 1) * block_elems) + (i - 1) * pairs * next_per_pair : nullptr;
      tiles[n - 1]({xs + r * x.stride(0), x.stride(0), ws + block * block_elems, pairs,
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

#ifdef __AVX512BF16__
// Instructions per second of a loop over 12 independent accumulators: the issue rate.
template <typename Step>
double issue_rate(Step step) {
  __m512 acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_ps(static_cast<float>(i));
  constexpr int64_t kIterations = 50000;
  const auto start = std::chrono::steady_clock::now();
  for (int64_t it = 0; it < kIterations; ++it) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) acc[i] = step(acc[i]);
  }
  // A volatile store of every chain's result before the clock is read again: all of the loop
  // runs inside the timed interval (accumulators stay in registers, unlike under an asm barrier).
  __m512 sum = acc[0];
  for (int i = 1; i < 12; ++i) sum = _mm512_add_ps(sum, acc[i]);
  volatile float sink = _mm512_reduce_add_ps(sum);
  (void)sink;
  const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
  return kIterations * 12 / took.count();
}
#endif

}  // namespace

at::Tensor bf16_matmul(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                       bool gated, const std::optional<at::Tensor>& bias, int64_t activation,
                       bool widen) {
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
  // x as the multiply takes it; an odd last feature pairs with the packing's zero padding.
  const at::Tensor xs = widen ? x.to(at::kFloat) : x;
  const at::Tensor even = k % 2 ? at::constant_pad_nd(xs, {0, 1}) : xs;
  const auto* ws = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  const auto* bs = bias ? reinterpret_cast<const uint16_t*>(bias->data_ptr()) : nullptr;
  auto* os = reinterpret_cast<uint16_t*>(out.data_ptr());
  const Shape shape{m, out_features, out_cols, half, blocks, gated};
  if (widen) {
    run_tasks<WidenedFma<Native>>(even, ws, packed.size(1), bs, os, shape, activation);
    return out;
  }
#ifdef __AVX512BF16__
  run_tasks<DotProducts>(even, ws, packed.size(1), bs, os, shape, activation);
#else
  TORCH_CHECK(false, "bf16_matmul: this build has no AVX512-BF16 dot products (widen=True runs)");
#endif
  return out;
}

double bf16_dot_product_speedup() {
#ifdef __AVX512BF16__
  const __m512 w = _mm512_set1_ps(0.999f), x = _mm512_set1_ps(1.001f);
  const __m512i pairs = _mm512_set1_epi32(0x3F803F80);  // (1, 1) in bf16
  double fma = 0, dot = 0;
  for (int round = 0; round < 5; ++round) {  // best of 5: a preempted round only loses
    fma = std::max(fma, 32 * issue_rate([&](__m512 a) { return _mm512_fmadd_ps(x, w, a); }));
    dot = std::max(dot, 64 * issue_rate([&](__m512 a) {
      return _mm512_dpbf16_ps(a, (__m512bh)pairs, (__m512bh)pairs); }));
  }
  return dot / fma;
#else
  return 0;
#endif
}

}  // namespace tritonlm

#else

namespace tritonlm {
at::Tensor bf16_matmul(const at::Tensor&, const at::Tensor&, int64_t, bool,
                       const std::optional<at::Tensor>&, int64_t, bool) {
  TORCH_CHECK(false, "bf16_matmul: built for a CPU without AVX2 + FMA");
}
double bf16_dot_product_speedup() { return 0; }
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
int64_t vector_lanes() {
#if defined(CPU_CAPABILITY_AVX512)
  return 16;
#elif defined(CPU_CAPABILITY_AVX2)
  return 8;
#else
  return 0;  // at::vec's generic code
#endif
}
bool has_bf16_dot_products() {
#if defined(TRITONLM_BF16_MATMUL) && defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}
}  // namespace tritonlm
