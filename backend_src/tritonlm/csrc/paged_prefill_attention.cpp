// Paged causal attention on CPU for rows with several query tokens (prefill chunks, whole prompts,
// a prompt's uncached suffix): K/V are read where they lie in the paged cache (the layout of
// paged_decode_attention.cpp), with a streaming softmax in float32.
//
// Work is split into (row, kv head, tile of up to 16 queries). A tile's G query heads x 16 queries
// are scored against 16 keys at a time: the key chunk is transposed once into [D, 16] so each
// query's 16 scores are D broadcast-FMAs, and each value row then updates the query's output with
// D / W FMAs. Key chunks after a tile's last query are never visited. bfloat16 tiles take the
// AVX512-BF16 path of prefill_tile_bf16.cpp where the CPU has it.
#include "cpu_vec.h"
#include "prefill_tile_bf16.h"

#include <cmath>
#include <optional>
#include <vector>

namespace tritonlm {
namespace {

constexpr int64_t kTile = 16;  // queries per task
// Query rows scored and accumulated together (register tiles), P.V taking 2 vectors of features
// at a time: 16 accumulators on AVX-512, 8 in AVX2's 16 registers. AVX-512: 8 rows, so that
// scoring runs 8 FMA chains (2 Zen 4 cores, float32, SmolLM2's heads / Llama-shaped ones, 512-4,096
// keys: 0.83-0.92x the time of 4 rows by 4 vectors); AVX2: 4 rows (the AVX2 build on Zen 4: 4 by
// 2 vectors 0.90-0.99x the time of 4 by 4, whose 16 accumulators spilled; 8 rows by 1 level).
constexpr int64_t kGroup = W == 16 ? 8 : 4;
constexpr int kCols = 2;

// Per thread. Query rows (i * G + g) are padded to a multiple of kGroup, features to a multiple
// of W (zeros), so every vector load is whole.
struct TileScratch {
  int64_t Dp;
  std::vector<float> q, acc, max, sum, keys_t, values, probs;
  std::vector<int64_t> pos;
  TileScratch(int64_t rows, int64_t D)
      : Dp((D + W - 1) / W * W), q(rows * Dp), acc(rows * Dp), max(rows), sum(rows),
        keys_t(Dp * W), values(W * Dp), probs(rows * W), pos(rows) {}
};

// Scores of kGroup query rows against the chunk's W keys: kGroup independent FMA chains.
inline void score_group(const float* q, int64_t Dp, int64_t D, const float* keys_t, Vec* out) {
  Vec acc[kGroup];
  for (int64_t r = 0; r < kGroup; ++r) acc[r] = Vec(0.f);
  for (int64_t d = 0; d < D; ++d) {
    const Vec k = Vec::loadu(keys_t + d * W);
    for (int64_t r = 0; r < kGroup; ++r) acc[r] = at::vec::fmadd(Vec(q[r * Dp + d]), k, acc[r]);
  }
  for (int64_t r = 0; r < kGroup; ++r) out[r] = acc[r];
}

// acc[r] = acc[r] * alpha[r] + sum_t probs[r][t] * values[t] for kGroup rows, kC vectors of
// features from `c0` on, held in registers across the keys.
template <int kC>
inline void accumulate_group(float* acc, const float* alpha, const float* probs,
                             const float* values, int64_t n, int64_t Dp, int64_t c0) {
  Vec a[kGroup][kC];
  for (int64_t r = 0; r < kGroup; ++r) {
    for (int c = 0; c < kC; ++c) a[r][c] = Vec::loadu(acc + r * Dp + c0 + c * W) * Vec(alpha[r]);
  }
  for (int64_t t = 0; t < n; ++t) {
    Vec v[kC];
    for (int c = 0; c < kC; ++c) v[c] = Vec::loadu(values + t * Dp + c0 + c * W);
    for (int64_t r = 0; r < kGroup; ++r) {
      const Vec p(probs[r * W + t]);
      for (int c = 0; c < kC; ++c) a[r][c] = at::vec::fmadd(p, v[c], a[r][c]);
    }
  }
  for (int64_t r = 0; r < kGroup; ++r) {
    for (int c = 0; c < kC; ++c) a[r][c].store(acc + r * Dp + c0 + c * W);
  }
}

inline void accumulate(float* acc, const float* alpha, const float* probs, const float* values,
                       int64_t n, int64_t Dp) {
  for (int64_t c0 = 0; c0 < Dp; c0 += kCols * W) {
    if (Dp - c0 >= kCols * W)
      accumulate_group<kCols>(acc, alpha, probs, values, n, Dp, c0);
    else
      accumulate_group<1>(acc, alpha, probs, values, n, Dp, c0);  // Dp is a multiple of W
  }
}

template <typename T>
void attend_tile(const T* q, int64_t q_token_stride, const T* key_cache, const T* value_cache,
                 const PrefillRows& r, int64_t n_queries, const float* slopes, int64_t window,
                 float scale, int64_t G, int64_t D, int64_t bs, T* out, TileScratch& s) {
  const int64_t Dp = s.Dp;
  const int64_t rows = n_queries * G;  // query row i * G + g
  const int64_t padded_rows = (rows + kGroup - 1) / kGroup * kGroup;
  const int64_t pos0 = r.context - r.query_len + r.first_query;  // the tile's first position
  std::fill(s.q.begin(), s.q.begin() + padded_rows * Dp, 0.f);
  for (int64_t row = 0; row < padded_rows; ++row) {
    const int64_t i = std::min(row, rows - 1) / G;  // padding rows repeat the last position
    s.pos[row] = pos0 + i;
    if (row >= rows) continue;
    const T* src = q + i * q_token_stride + (row % G) * D;
    for (int64_t d = 0; d < D; ++d) s.q[row * Dp + d] = static_cast<float>(src[d]) * scale;
  }
  std::fill(s.acc.begin(), s.acc.begin() + padded_rows * Dp, 0.f);
  std::fill(s.max.begin(), s.max.begin() + padded_rows, kNegInf);
  std::fill(s.sum.begin(), s.sum.begin() + padded_rows, 0.f);
  std::fill(s.values.begin(), s.values.end(), 0.f);
  const int64_t last_pos = pos0 + n_queries - 1;
  const int64_t first_key = window > 0 ? std::max<int64_t>(0, pos0 - window + 1) : 0;
  const Vec lane = Vec::arange(0.f, 1.f);
  float tmp[W], alpha[kGroup];
  Vec scores[kGroup];
  int64_t n = 0;
  for (int64_t base = first_key; base <= last_pos; base += n) {
    const int64_t j = base / bs, offset = base % bs;  // a chunk never crosses a block
    n = std::min<int64_t>({W, bs - offset, last_pos + 1 - base});
    const T* k_rows = key_cache + (r.blocks[j] * bs + offset) * D;
    const T* v_rows = value_cache + (r.blocks[j] * bs + offset) * D;
    std::fill(s.keys_t.begin(), s.keys_t.end(), 0.f);
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t d = 0; d < D; d += W) {
        const int64_t m = std::min<int64_t>(W, D - d);
        load_float(v_rows + t * D + d, m).store(s.values.data() + t * Dp + d, m);
        load_float(k_rows + t * D + d, m).store(tmp, m);
        for (int64_t e = 0; e < m; ++e) s.keys_t[(d + e) * W + t] = tmp[e];
      }
    }
    for (int64_t t = n; t < W; ++t) {  // keys past the chunk: zero values (scores are masked)
      std::fill(s.values.begin() + t * Dp, s.values.begin() + (t + 1) * Dp, 0.f);
    }
    for (int64_t g0 = 0; g0 < padded_rows; g0 += kGroup) {
      if (base > s.pos[g0 + kGroup - 1]) continue;  // the chunk is after every row of the group
      score_group(s.q.data() + g0 * Dp, Dp, D, s.keys_t.data(), scores);
      for (int64_t k = 0; k < kGroup; ++k) {
        const int64_t row = g0 + k, pos = s.pos[row];
        float* p = s.probs.data() + k * W;
        Vec sc = scores[k];
        if (slopes != nullptr)
          sc = sc + Vec(slopes[row % G]) * (Vec(static_cast<float>(base - pos)) + lane);
        sc.store(p);
        const int64_t low = window > 0 ? pos - window + 1 : 0;  // first visible key position
        if (n < W || base + n - 1 > pos || base < low) {
          for (int64_t t = 0; t < W; ++t) {
            if (t >= n || base + t > pos || base + t < low) p[t] = kNegInf;
          }
        }
        const float chunk_max = at::vec::vec_reduce_all<float>(
            [](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, Vec::loadu(p));
        if (chunk_max == kNegInf) {  // nothing visible: the row is left as it is
          std::fill(p, p + W, 0.f);
          alpha[k] = 1.f;
          continue;
        }
        const float new_max = std::max(s.max[row], chunk_max);
        alpha[k] = std::exp(s.max[row] - new_max);  // 0 on the row's first chunk
        const Vec e = (Vec::loadu(p) - Vec(new_max)).exp();
        e.store(p);
        s.sum[row] = s.sum[row] * alpha[k] + sum_lanes(e);
        s.max[row] = new_max;
      }
      accumulate(s.acc.data() + g0 * Dp, alpha, s.probs.data(), s.values.data(), n, Dp);
    }
  }
  for (int64_t row = 0; row < rows; ++row) {
    const float inv = s.sum[row] > 0.f ? 1.f / s.sum[row] : 0.f;
    T* dst = out + (row / G) * q_token_stride + (row % G) * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(s.acc[row * Dp + d] * inv);
  }
}

}  // namespace

void prefill_attention(const at::Tensor& q, const at::Tensor& key_cache,
                       const at::Tensor& value_cache, const at::Tensor& block_rows,
                       const at::Tensor& query_starts, const at::Tensor& query_lens,
                       const at::Tensor& context_lens, double scale,
                       const std::optional<at::Tensor>& alibi_slopes, int64_t window,
                       at::Tensor& out) {
  const char* name = "prefill_attention: ";
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.device().is_cpu(), name,
              "q must be a contiguous CPU [T, Hq, D], got ", q.sizes());
  TORCH_CHECK(out.sizes() == q.sizes() && out.is_contiguous() &&
                  out.scalar_type() == q.scalar_type(),
              name, "out must be a contiguous tensor like q");
  TORCH_CHECK(key_cache.dim() == 3 && key_cache.sizes() == value_cache.sizes() &&
                  key_cache.size(2) == q.size(2) && key_cache.is_contiguous() &&
                  value_cache.is_contiguous(),
              name, "the caches must be contiguous [R, block_size, D] with q's D, got ",
              key_cache.sizes(), " and ", value_cache.sizes());
  TORCH_CHECK(key_cache.scalar_type() == q.scalar_type() &&
                  value_cache.scalar_type() == q.scalar_type(),
              name, "the caches must have q's dtype ", q.scalar_type());
  const int64_t B = block_rows.size(0);
  for (const auto* t : {&block_rows, &query_starts, &query_lens, &context_lens}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->device().is_cpu() &&
                    t->size(0) == B,
                name, "block_rows, query_starts, query_lens and context_lens must be contiguous "
                "int64 CPU tensors with one entry per row");
  }
  TORCH_CHECK(block_rows.dim() == 3, name, "block_rows must be [B, Hkv, nb]");
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t Hkv = block_rows.size(1), nb = block_rows.size(2);
  const int64_t R = key_cache.size(0), bs = key_cache.size(1);
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, name, "the query heads (", Hq,
              ") must be a multiple of the kv heads (", Hkv, ")");
  const float* slopes = nullptr;
  if (alibi_slopes.has_value() && alibi_slopes->defined()) {
    TORCH_CHECK(alibi_slopes->scalar_type() == at::kFloat && alibi_slopes->numel() == Hq &&
                    alibi_slopes->is_contiguous(),
                name, "alibi_slopes must be a contiguous float32 [", Hq, "]");
    slopes = alibi_slopes->data_ptr<float>();
  }
  const int64_t* starts = query_starts.data_ptr<int64_t>();
  const int64_t* lens = query_lens.data_ptr<int64_t>();
  const int64_t* ctx = context_lens.data_ptr<int64_t>();
  const int64_t* rows = block_rows.data_ptr<int64_t>();
  std::vector<int64_t> task_row, task_query;  // (row, first query) of each tile
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lens[b] >= 0 && starts[b] >= 0 && starts[b] + lens[b] <= T, name, "row ", b,
                "'s queries [", starts[b], ", ", starts[b] + lens[b], ") are outside q's ", T,
                " tokens");
    TORCH_CHECK(ctx[b] >= lens[b] && ctx[b] <= nb * bs, name, "row ", b, ": context ", ctx[b],
                " must hold its ", lens[b], " queries and fit its ", nb, " blocks of ", bs);
    for (int64_t j = 0; j < (ctx[b] + bs - 1) / bs; ++j) {
      for (int64_t h = 0; h < Hkv; ++h) {
        const int64_t row = rows[(b * Hkv + h) * nb + j];
        TORCH_CHECK(row >= 0 && row < R, name, "block_rows[", b, ", ", h, ", ", j, "] = ", row,
                    " is outside the cache's ", R, " rows");
      }
    }
    for (int64_t i = 0; i < lens[b]; i += kTile) {
      task_row.push_back(b);
      task_query.push_back(i);
    }
  }
  const int64_t G = Hq / Hkv;
  const int64_t tasks = static_cast<int64_t>(task_row.size()) * Hkv;
  if (tasks == 0) return;
  dispatch_float_types(q.scalar_type(), name, [&](auto zero) {
    using T_ = decltype(zero);
    const T_* q_ptr = q.data_ptr<T_>();
    const T_* k_ptr = key_cache.data_ptr<T_>();
    const T_* v_ptr = value_cache.data_ptr<T_>();
    T_* out_ptr = out.data_ptr<T_>();
    const int threads = region_threads(tasks);
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
      const int64_t tile_rows = (kTile * G + kGroup - 1) / kGroup * kGroup;
#ifdef TRITONLM_PREFILL_BF16
      const bool use_bf16 = std::is_same_v<T_, c10::BFloat16> && D % 32 == 0;
      PrefillScratchBf16 scratch_bf16(use_bf16 ? tile_rows : 0, D);
#else
      constexpr bool use_bf16 = false;
#endif
      TileScratch scratch(use_bf16 ? 0 : tile_rows, D);
#pragma omp for schedule(dynamic, 1)
      for (int64_t task = 0; task < tasks; ++task) {
        // Tiles in reverse: a row's last tiles, which see the most keys, are taken first.
        const int64_t tile = static_cast<int64_t>(task_row.size()) - 1 - task / Hkv;
        const int64_t h = task % Hkv, b = task_row[tile], first = task_query[tile];
        const PrefillRows r{ctx[b], lens[b], first, rows + (b * Hkv + h) * nb};
        const int64_t offset = ((starts[b] + first) * Hq + h * G) * D;  // the tile's first head
        const int64_t n_queries = std::min<int64_t>(kTile, lens[b] - first);
        const float* tile_slopes = slopes ? slopes + h * G : nullptr;
#ifdef TRITONLM_PREFILL_BF16
        if constexpr (std::is_same_v<T_, c10::BFloat16>) {
          if (use_bf16) {
            attend_tile_bf16(q_ptr + offset, Hq * D, k_ptr, v_ptr, r, n_queries, tile_slopes,
                             window, static_cast<float>(scale), G, D, bs, out_ptr + offset,
                             scratch_bf16);
            continue;
          }
        }
#endif
        attend_tile<T_>(q_ptr + offset, Hq * D, k_ptr, v_ptr, r, n_queries, tile_slopes, window,
                        static_cast<float>(scale), G, D, bs, out_ptr + offset, scratch);
      }
    }
  });
}

}  // namespace tritonlm
