// Paged decode attention on CPU: one query token per sequence, K/V read where they lie in the
// paged cache (no gather), float32 accumulation with a streaming (online) softmax per block.
//
// Layout (tritonlm's PyTorch backend): a layer's key/value caches [num_blocks, Hkv, bs, D] viewed
// as [R = num_blocks * Hkv, bs, D]; block_rows[b, h, j] is the row holding keys j*bs .. j*bs+bs-1
// of sequence b for kv head h. Query heads h*G .. h*G+G-1 (G = Hq / Hkv) share kv head h; they are
// processed together so each K/V row is loaded once for the whole group (GQA / MQA).

#include "decode_attention_bf16.h"
#include "decode_attention_generic.h"
#include "decode_attention_widened.h"

#include <optional>

namespace tritonlm {
bool multiplies_by_bf16_dots(const std::string& forced);  // bf16_matmul.cpp

namespace {
using namespace paged_decode;

// Whether a bf16 cache is read with AVX512-BF16 dot products (attend_group_bf16) or widened for
// float32 FMAs (attend_widened): as the bf16 matmul multiplies. Intel Xeons issue dot products at
// half the FMAs' rate (2 Emerald Rapids cores, 30 SmolLM2 layers, 64 sequences x 500 keys: 53 ms
// with dot products, 41 widened; 1 x 200: 0.60 / 0.52); Zen 4 at twice.
bool bf16_attention_dots() {
  static const bool dots = multiplies_by_bf16_dots(forced_bf16_multiply());
  return dots;
}

template <typename T, int kD>
void run(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
         const at::Tensor& block_rows, const at::Tensor& context_lens, double scale,
         const float* slopes, int64_t window, at::Tensor& out) {
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t Hkv = block_rows.size(1), nb = block_rows.size(2), bs = key_cache.size(1);
  const int64_t G = Hq / Hkv;
  const T* q_ptr = q.data_ptr<T>();
  const int64_t q_stride = q.stride(0);  // a row's [Hq, D] lie together, rows anywhere
  const T* k_ptr = key_cache.data_ptr<T>();
  const T* v_ptr = value_cache.data_ptr<T>();
  const int64_t* rows_ptr = block_rows.data_ptr<int64_t>();
  const int64_t* ctx_ptr = context_lens.data_ptr<int64_t>();
  T* out_ptr = out.data_ptr<T>();
  const int64_t tasks = B * Hkv;
  const int threads = region_threads(tasks);
  // With sequences enough to share out, a thread takes all kv heads of one: their rows of a block
  // lie side by side in the cache (row = block * Hkv + head) and it prefetches the next head's
  // first blocks as it ends a head. Split between threads, each fetched lines beside the other's:
  // 32 sequences x 192 keys, 30 layers, 7.4-8.1 -> 5.0-5.5 ms; 8 x 1024 8.5-9.7 -> 7.1 ms.
  const int64_t grab = B >= 4 * threads ? Hkv : 1;
  [[maybe_unused]] const bool dots = bf16_attention_dots();  // AVX512-BF16 builds
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    Scratch scratch(G, D, bs);
#pragma omp for schedule(dynamic, grab)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t b = task / Hkv, h = task % Hkv;
      const int64_t head = h * G;
      const int64_t* next_rows = h + 1 < grab ? rows_ptr + (task + 1) * nb : nullptr;
#ifdef TRITONLM_AVX512_BF16
      if constexpr (std::is_same_v<T, c10::BFloat16> && kD > 0 && kD % 32 == 0) {
        if (bs % 16 == 0 && dots) {
          attend_group_bf16<kD>(q_ptr + b * q_stride + head * D, k_ptr, v_ptr,
                                rows_ptr + task * nb, ctx_ptr[b],
                                slopes ? slopes + head : nullptr, window,
                                static_cast<float>(scale), G, bs,
                                out_ptr + (b * Hq + head) * D, scratch, next_rows);
          continue;
        }
      }
#endif
#ifdef TRITONLM_WIDENED_ATTENTION
      if constexpr (std::is_same_v<T, c10::BFloat16> && kWidenedHeadDim<kD>) {
        if (widened_block_size(bs)) {
          attend_widened<kD>(q_ptr + b * q_stride + head * D, k_ptr, v_ptr,
                             rows_ptr + task * nb, ctx_ptr[b],
                             slopes ? slopes + head : nullptr, window,
                             static_cast<float>(scale), G, bs, out_ptr + (b * Hq + head) * D,
                             scratch, next_rows);
          continue;
        }
      }
#endif
      attend_group<T, kD>(q_ptr + b * q_stride + head * D, k_ptr, v_ptr,
                          rows_ptr + task * nb, ctx_ptr[b],
                          slopes ? slopes + head : nullptr, window,
                          static_cast<float>(scale), G, D, bs, out_ptr + (b * Hq + head) * D,
                          scratch, next_rows);
    }
  }
}

template <typename T>
void dispatch_head_dim(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& rows, const at::Tensor& ctx, double scale,
                       const float* slopes, int64_t window, at::Tensor& out) {
  switch (q.size(2)) {
    case 64: return run<T, 64>(q, k, v, rows, ctx, scale, slopes, window, out);
    case 80: return run<T, 80>(q, k, v, rows, ctx, scale, slopes, window, out);
    case 96: return run<T, 96>(q, k, v, rows, ctx, scale, slopes, window, out);
    case 128: return run<T, 128>(q, k, v, rows, ctx, scale, slopes, window, out);
    case 256: return run<T, 256>(q, k, v, rows, ctx, scale, slopes, window, out);
    default: return run<T, 0>(q, k, v, rows, ctx, scale, slopes, window, out);
  }
}

}  // namespace

at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_rows,
                            const at::Tensor& context_lens, double scale,
                            const std::optional<at::Tensor>& alibi_slopes, int64_t window,
                            const std::optional<at::Tensor>& out) {
  const char* name = "decode_attention: ";
  for (const auto* t : {&query, &key_cache, &value_cache, &block_rows, &context_lens})
    TORCH_CHECK(t->device().is_cpu(), name, "all tensors must be on the CPU");
  TORCH_CHECK(query.dim() == 3, name, "q must be [B, Hq, D], got ", query.sizes());
  // q's rows may lie apart (the query part of a fused QKV output, read in place); heads apart
  // within a row (QKV interleaved per head, as GPT-NeoX and BLOOM fuse it) are copied together.
  const bool rows_in_place = (query.size(2) == 1 || query.stride(2) == 1) &&
                             (query.size(1) == 1 || query.stride(1) == query.size(2));
  const at::Tensor q = rows_in_place ? query : query.contiguous();
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16 ||
                  q.scalar_type() == at::kHalf,
              name, "q must be float32, bfloat16 or float16, got ", q.scalar_type());
  TORCH_CHECK(key_cache.scalar_type() == q.scalar_type() &&
                  value_cache.scalar_type() == q.scalar_type(),
              name, "key_cache and value_cache must have q's dtype ", q.scalar_type(), ", got ",
              key_cache.scalar_type(), " and ", value_cache.scalar_type());
  TORCH_CHECK(key_cache.dim() == 3 && key_cache.sizes() == value_cache.sizes(), name,
              "key_cache and value_cache must both be [R, block_size, D], got ",
              key_cache.sizes(), " and ", value_cache.sizes());
  TORCH_CHECK(key_cache.size(2) == q.size(2), name, "head dim of the caches (",
              key_cache.size(2), ") differs from q's (", q.size(2), ")");
  TORCH_CHECK(block_rows.scalar_type() == at::kLong, name, "block_rows must be int64, got ",
              block_rows.scalar_type());
  TORCH_CHECK(context_lens.scalar_type() == at::kLong, name,
              "context_lens must be int64, got ", context_lens.scalar_type());
  TORCH_CHECK(block_rows.dim() == 3 && block_rows.size(0) == q.size(0), name,
              "block_rows must be [B, Hkv, nb] with B = ", q.size(0), ", got ",
              block_rows.sizes());
  TORCH_CHECK(context_lens.dim() == 1 && context_lens.size(0) == q.size(0), name,
              "context_lens must be [B] with B = ", q.size(0), ", got ", context_lens.sizes());
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t Hkv = block_rows.size(1), nb = block_rows.size(2);
  const int64_t R = key_cache.size(0), bs = key_cache.size(1);
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, name, "the query heads (", Hq,
              ") must be a multiple of the kv heads (", Hkv, ")");
  TORCH_CHECK(D > 0 && bs > 0, name, "head dim and block size must be positive");
  for (const auto* t : {&key_cache, &value_cache, &block_rows, &context_lens})
    TORCH_CHECK(t->is_contiguous(), name, "the caches, block_rows and context_lens must be "
                "contiguous");
  TORCH_CHECK(window >= 0, name, "window must be >= 0 (0: none), got ", window);
  const float* slopes = nullptr;
  if (alibi_slopes.has_value() && alibi_slopes->defined()) {
    const at::Tensor& a = *alibi_slopes;
    TORCH_CHECK(a.device().is_cpu() && a.scalar_type() == at::kFloat && a.dim() == 1 &&
                    a.size(0) == Hq && a.is_contiguous(),
                name, "alibi_slopes must be a contiguous float32 CPU tensor [Hq = ", Hq,
                "], got ", a.scalar_type(), " ", a.sizes());
    slopes = a.data_ptr<float>();
  }
  // Every row a sequence reads must exist: checked here, outside the parallel region.
  const int64_t* ctx = context_lens.data_ptr<int64_t>();
  const int64_t* rows = block_rows.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(ctx[b] <= nb * bs, name, "context_lens[", b, "] = ", ctx[b], " exceeds the ",
                nb, " blocks of ", bs, " keys in block_rows");
    if (ctx[b] <= 0) continue;
    const int64_t first =
        window > 0 ? std::max<int64_t>(0, ctx[b] - window) / bs : 0;  // first visible block
    const int64_t last = (ctx[b] - 1) / bs;
    for (int64_t h = 0; h < Hkv; ++h) {
      for (int64_t j = first; j <= last; ++j) {
        const int64_t row = rows[(b * Hkv + h) * nb + j];
        TORCH_CHECK(row >= 0 && row < R, name, "block_rows[", b, ", ", h, ", ", j, "] = ", row,
                    " is outside the cache's ", R, " rows");
      }
    }
  }
  at::Tensor result = result_tensor(out, q.sizes(), q.options(), name);
  if (B == 0 || Hq == 0) return result;
  switch (q.scalar_type()) {
    case at::kFloat:
      dispatch_head_dim<float>(q, key_cache, value_cache, block_rows, context_lens, scale, slopes,
                               window, result);
      break;
    case at::kBFloat16:
      dispatch_head_dim<c10::BFloat16>(q, key_cache, value_cache, block_rows, context_lens, scale,
                                       slopes, window, result);
      break;
    default:
      dispatch_head_dim<c10::Half>(q, key_cache, value_cache, block_rows, context_lens, scale,
                                   slopes, window, result);
  }
  return result;
}

}  // namespace tritonlm
