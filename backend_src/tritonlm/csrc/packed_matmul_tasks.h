// How a packed matmul (packed_matmul.h) is split into tasks over the threads: chunks of rows by
// blocks of 32 output features, each chunk's rows in register tiles, and for a prompt's many
// tiles a quantized block widened once.
#pragma once
#include "packed_matmul_widen.h"

#ifdef TRITONLM_PACKED_MATMUL

#include <ATen/ops/linear.h>

#include <vector>

namespace tritonlm {
namespace packed_matmul {

struct Shape {
  int64_t m, out_features, out_cols, half, blocks;
  bool gated;
};

// How a quantized weight's integers become its values (both null for bfloat16 weights).
struct Dequant {
  const float* row_scales;  // [out_features]: a scale per feature, applied to its sums
  const void* groups;       // [blocks, groups, 2, 32] of Mul::P: Mul::kGroups' scales, biases
  int64_t group_pairs;      // pairs per group (the last group may be shorter)
  const float* x_sums;      // [m, groups]: x's sum over each group
  const float* x_scales;    // [m, groups, 2]: Mul::kIntegerDots: x's int8 scales, integer sums
};

template <typename T>
struct Type {
  using type = T;
};

// Block `block`'s group parameters in d.groups (null: none).
template <typename Mul>
const typename Mul::P* block_groups(const Dequant& d, int64_t pairs, int64_t block) {
  if constexpr (Mul::kGroups) {
    const int64_t groups_per_block = (pairs + d.group_pairs - 1) / d.group_pairs;
    return static_cast<const typename Mul::P*>(d.groups) + block * groups_per_block * 2 * kBlock;
  } else {
    return nullptr;
  }
}

// The packed weight as a dense float32 [out_features, k] in feature order, for float32 sgemm on
// prompts: each block widened and dequantized as prewiden does (int8 rows scaled here), its lanes
// written to their rows (non-gated lane l of block b is feature 32b + l; gated lanes 0..15 are
// gate features 16b.., lanes 16..31 up features half + 16b..).
template <typename Mul>
at::Tensor dense_weight(const typename Mul::W* ws, int64_t pairs, const Dequant& d,
                        const Shape& s, int64_t k) {
  using I = typename Mul::Isa;
  const int64_t block_elems = stored_pairs<typename Mul::W>(pairs) * kPairElems<typename Mul::W>;
  auto dense = at::empty({s.out_features, k}, at::kFloat);
  float* ds = dense.data_ptr<float>();
  at::parallel_for(0, s.blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> widened(pairs * 2 * kBlock);
    for (int64_t b = begin; b < end; ++b) {
      prewiden<Mul>(ws + b * block_elems, pairs, block_groups<Mul>(d, pairs, b), d.group_pairs,
                    widened.data());
      for (int64_t lane = 0; lane < kBlock; ++lane) {
        const int64_t in_half = (s.gated ? 16 * b : kBlock * b) + lane % 16;
        const int64_t feature = s.gated ? in_half + (lane < 16 ? 0 : s.half) : kBlock * b + lane;
        if ((s.gated && in_half >= s.half) || feature >= s.out_features) continue;
        const float scale = d.row_scales ? d.row_scales[feature] : 1.f;
        // the lane's even value in a widened pair row; its odd one kLanes further
        const float* even = widened.data() + lane / I::kLanes * 2 * I::kLanes + lane % I::kLanes;
        float* row = ds + feature * k;
        for (int64_t i = 0; i < k; ++i)
          row[i] = even[i / 2 * 2 * kBlock + i % 2 * I::kLanes] * scale;
      }
    }
  });
  return dense;
}

}  // namespace packed_matmul

at::Tensor act_and_mul(const at::Tensor& x, int64_t activation,
                       const std::optional<at::Tensor>& out);  // fused_ops.cpp

namespace packed_matmul {

// x [m, k] @ dense.T + bias in float32 sgemm, in x's dtype, then act(gate) * up where
// `activation` >= 0 (a gated weight's dense rows: gate, then up), into `out` where given.
inline at::Tensor sgemm_matmul(const at::Tensor& x, const at::Tensor& dense,
                               const std::optional<at::Tensor>& bias, int64_t activation,
                               const std::optional<at::Tensor>& out, const char* name) {
  const auto bias_f32 = bias ? std::optional<at::Tensor>(bias->to(at::kFloat)) : std::nullopt;
  const auto y = at::linear(x.to(at::kFloat), dense, bias_f32).to(x.scalar_type());
  return activation < 0 ? into_result(out, y, name) : act_and_mul(y, activation, out);
}

// Tasks per grab for tasks of several row tiles (bound by compute, not by the weights' stream):
// kTasksPerGrab, or fewer where that shares the grabs out evenly over the threads. 18 blocks on
// 2 threads ran 10 and 8 in grabs of 4, run 9 and 9 in grabs of 3 (Zen 4, 32 rows: SmolLM2's 30
// layers 2% faster; at 1-4 rows, one tile a task, grabs of 3 were 1% slower).
inline int64_t even_grab(int64_t tasks, int threads) {
  for (int64_t grab = kTasksPerGrab; grab > 1; --grab)
    if (tasks % (grab * threads) == 0) return grab;
  return kTasksPerGrab;
}

template <typename Mul, typename O>
void run_tasks(const typename Mul::X* xs, int64_t x_stride, const typename Mul::W* ws,
               int64_t pairs, const Dequant& d, const O* bs, O* os, const Shape& s,
               int64_t activation);

// Rows of several chunks on a weight Mul multiplies dequantized (Mul::Dequantized, AMX tiles):
// the whole weight dequantized first, into the calling thread's buffer (kept for the next
// matmul), then multiplied as such; one chunk's rows dequantize each block in its task. 2 Emerald
// Rapids cores, int4 SmolLM2's matmuls against bf16's, in one process, each block dequantized in
// its task (in chunks of up to 1 MB of x) / the weight dequantized first: 32 rows 1.11x / 1.54x
// the time, 64 1.16x / 1.52x, 200 1.21x / 1.21x, 512 1.18x / 1.08x, 2048 1.03-1.21x / 1.09-1.13x
// (the pass itself 2% of the gate/up projection's time there).
template <typename Mul, typename O>
void dequantized_then_run(const typename Mul::X* xs, int64_t x_stride, const typename Mul::W* ws,
                          int64_t pairs, const Dequant& d, const O* bs, O* os, const Shape& s,
                          int64_t activation) {
  using DW = typename Mul::Dequantized::W;
  const int64_t block_elems = stored_pairs<typename Mul::W>(pairs) * kPairElems<typename Mul::W>;
  const int64_t dequantized_elems = pairs * kPairElems<DW>;
  thread_local std::vector<DW> weight;
  weight.resize(s.blocks * dequantized_elems);
  DW* dw = weight.data();
  const int threads = region_threads(s.blocks);
#pragma omp parallel for num_threads(threads) if (threads > 1)
  for (int64_t b = 0; b < s.blocks; ++b)
    Mul::dequantize(ws + b * block_elems, pairs, block_groups<Mul>(d, pairs, b), d.group_pairs,
                    dw + b * dequantized_elems);
  run_tasks<typename Mul::Dequantized, O>(xs, x_stride, dw, pairs, {d.row_scales}, bs, os, s,
                                          activation);
}

// After a thread's share of a matmul: AMX tiles handed back.
template <typename Mul>
void finish_tiles() {
  if constexpr (kAmx<Mul>)
    Mul::finish();
  else if constexpr (requires { typename Mul::Dequantized; })
    finish_tiles<typename Mul::Dequantized>();
}

// xs: x [m, 2 * pairs] as Mul multiplies it, rows x_stride apart; the packed weight, how to
// dequantize it, the bias or null, out [m, out_cols].
template <typename Mul, typename O>
void run_tasks(const typename Mul::X* xs, int64_t x_stride, const typename Mul::W* ws,
               int64_t pairs, const Dequant& d, const O* bs, O* os, const Shape& s,
               int64_t activation) {
  using W = typename Mul::W;
  using Wide = WidenedFma<typename Mul::Isa, float, void, typename Mul::X>;
  TORCH_CHECK(activation < 0 || kActivates<O>, "packed matmul: an activation on float32 "
              "outputs, whose tiles apply none");
  const int64_t m = s.m, half = s.half, block_elems = stored_pairs<W>(pairs) * kPairElems<W>;
  const int64_t groups_per_block = d.groups ? (pairs + d.group_pairs - 1) / d.group_pairs : 0;
  const int64_t chunks = (m + kChunkRows - 1) / kChunkRows;
  if constexpr (requires { typename Mul::Dequantized; }) {
    // AMX tiles: each block dequantized once, not once a chunk. Dot products take long enough
    // over a chunk that dequantizing it there costs less than the weight's pass through a buffer
    // (2 Zen 5 cores, SmolLM2's shapes against bf16 weights' time, 256 / 384 / 512 / 1024 rows:
    // 1.07 / 1.05 / 1.02 / 1.02x -> 1.03-1.05 / 1.00-1.01 / 0.99-1.03 / 0.99-1.00x)
    if (chunks > 1 && kAmx<typename Mul::Dequantized>) {
      dequantized_then_run<Mul, O>(xs, x_stride, ws, pairs, d, bs, os, s, activation);
      return;
    }
  }
  // Tasks run chunk-major: a thread's consecutive tasks reuse one chunk of x from L2 while the
  // weight blocks stream by.
  auto run_task = [&](int64_t task) {
    const int64_t chunk = task / s.blocks, block = task % s.blocks;
    const int64_t row0 = chunk * kChunkRows, rows = std::min(kChunkRows, m - row0);
    const int64_t low = block * (s.gated ? 16 : kBlock);  // the block's first low feature
    const int64_t cols_low = std::min<int64_t>(16, (s.gated ? half : s.out_features) - low);
    const int64_t cols_high = std::min<int64_t>(16, s.out_features - low - half);
    const float* ss = d.row_scales;
    const W* w = ws + block * block_elems;
    const auto* groups = block_groups<Mul>(d, pairs, block);
    // The chunk's rows in tiles of M's rows, multiplying the block at `wm`.
    auto run_tiles = [&](auto type, const auto* wm) {
      using M = typename decltype(type)::type;
      const int64_t row_tiles = (rows + kTileRows<M> - 1) / kTileRows<M>;
      // The first tile streams the block from memory; the others compute from cache, so with x
      // in one chunk they pull the next block into L2 meanwhile, a share each, and the memory
      // does not idle (32 rows: the 30 SmolLM2 layers' matmuls 11.1 -> 10.4 ms on Zen 5). Not
      // AMX tiles: they leave it to the hardware (packed_matmul_amx.h).
      const bool fetch_next = std::is_same_v<M, Mul> && !kAmx<M> && chunks == 1 && row_tiles > 1 &&
                              block + 1 < s.blocks;
      constexpr int64_t kPairBytes = kPairElems<W> * sizeof(W);
      const int64_t next_per_pair =
          fetch_next ? (kPairBytes + row_tiles - 2) / (row_tiles - 1) : 0;
      const TileFn<M, O>* tiles = kTiles<M, O, -1>.data();
      if constexpr (kActivates<O>) {
        if (activation >= 0) tiles = activation ? kTiles<M, O, 1>.data() : kTiles<M, O, 0>.data();
      }
      // AMX tiles all take the chunk's largest tile, the last reaching back over rows the one
      // before computed (the same sums again): tiles of unequal rows load a tile configuration
      // each (30 SmolLM2 layers at 70 rows as 24 + 23 + 23: 6% slower than 69 or 72 rows).
      const int64_t even = (rows + row_tiles - 1) / row_tiles;
      for (int64_t i = 0, r = row0, n; i < row_tiles; ++i, r += n) {
        n = kAmx<M> ? even : rows / row_tiles + (i < rows % row_tiles);  // 32 by 6: 6, 6, 5, 5...
        if (kAmx<M> && i + 1 == row_tiles) r = row0 + rows - n;
        O* out_row = os + r * s.out_cols;
        const char* next = fetch_next && i > 0 ? reinterpret_cast<const char*>(
            ws + (block + 1) * block_elems) + (i - 1) * pairs * next_per_pair : nullptr;
        tiles[n - 1]({xs + r * x_stride, x_stride, wm, pairs,
                      ss ? ss + low : nullptr, ss ? ss + low + half : nullptr,
                      M::kGroups ? groups : nullptr, d.group_pairs,
                      M::kGroups ? d.x_sums + r * groups_per_block : nullptr,
                      M::kIntegerDots ? d.x_scales + 2 * r * groups_per_block : nullptr,
                      bs ? bs + low : nullptr, bs ? bs + low + half : nullptr,
                      out_row + low, out_row + low + half, s.out_cols, cols_low, cols_high,
                      row_tiles == 1, next, next_per_pair, chunks > 1});
      }
    };
    if constexpr (requires { typename Mul::Dequantized; }) {  // a prompt in AMX tiles
      using D = typename Mul::Dequantized;
      thread_local std::vector<typename D::W> dequantized;
      dequantized.resize(pairs * kPairElems<typename D::W>);
      Mul::dequantize(w, pairs, groups, d.group_pairs, dequantized.data());
      run_tiles(Type<D>{}, dequantized.data());
    } else {
      if constexpr (Mul::kPrewidens) {
        if (rows >= Mul::Isa::kPrewidenRows) {  // widened once for the chunk's many row tiles
          thread_local std::vector<float> widened;
          widened.resize(pairs * 2 * kBlock);
          prewiden<Mul>(w, pairs, groups, d.group_pairs, widened.data());
          run_tiles(Type<Wide>{}, widened.data());
          return;
        }
      }
      run_tiles(Type<Mul>{}, w);
    }
  };
  // Tasks of several row tiles: threads take kTasksPerGrab tasks at a time rather than a fixed
  // half each: on a machine that also runs the server and its clients, a thread preempted
  // mid-matmul then costs only its own share, not the other threads' wait for it. (One task per
  // grab interleaved the threads' weight blocks and was ~8% slower on Zen 5.) Tasks of one row
  // tile stream their weights: a grab is a thread's even share, so that its prefetches run
  // ahead through one contiguous range (in grabs of four they ran on into the other thread's
  // blocks, and each grab began its stream cold: Zen 4, with the prefetch distance in bytes, the
  // batch-1 decode step's op program of int4 SmolLM2 2.4-3.4 -> 2.1-2.3 ms, bf16's level or
  // faster); a thread that has not begun when the other ends its share still leaves it the rest.
  const int64_t tasks = s.blocks * chunks;
  const int threads = region_threads(tasks);
  const int64_t grab =
      m > kTileRows<Mul> ? even_grab(tasks, threads) : (tasks + threads - 1) / threads;
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
#pragma omp for schedule(dynamic, grab)
    for (int64_t task = 0; task < tasks; ++task) run_task(task);
    finish_tiles<Mul>();
  }
}

}  // namespace packed_matmul
}  // namespace tritonlm

#endif
