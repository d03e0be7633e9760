// Writes a step's K/V into the paged cache: each (token, kv head) row of k and v is copied to
// its cache row. k and v come straight from the fused QKV projection's split (rows strided), so
// no contiguous copy is made first, and both caches are written in one pass (index_copy_ twice
// cost ~80 us a layer at batch 32, mostly its per-element indexing).
#include <ATen/core/Tensor.h>

#include <ATen/Parallel.h>

#include <cstring>

namespace tritonlm {

void write_kv_(at::Tensor& key_cache, at::Tensor& value_cache, const at::Tensor& k,
               const at::Tensor& v, const at::Tensor& rows) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes(), "k and v must be [N, Hkv, D] alike, got ",
              k.sizes(), " and ", v.sizes());
  const int64_t N = k.size(0), H = k.size(1), D = k.size(2);
  for (const at::Tensor* cache : {&key_cache, &value_cache}) {
    TORCH_CHECK(cache->dim() == 2 && cache->size(1) == D && cache->is_contiguous(),
                "caches must be contiguous [R, D] row views, got ", cache->sizes());
    TORCH_CHECK(cache->scalar_type() == k.scalar_type(), "cache dtype ", cache->scalar_type(),
                " differs from k's ", k.scalar_type());
  }
  TORCH_CHECK(value_cache.size(0) == key_cache.size(0), "the caches differ in rows");
  TORCH_CHECK(v.scalar_type() == k.scalar_type() && k.stride(2) == 1 && v.stride(2) == 1,
              "k and v must share a dtype and have contiguous features");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.is_contiguous() && rows.numel() == N * H,
              "rows must be [N * Hkv] int64, got ", rows.sizes(), " ", rows.scalar_type());
  const int64_t R = key_cache.size(0), bytes = D * k.element_size();
  const int64_t* row = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < N * H; ++i)
    TORCH_CHECK(row[i] >= 0 && row[i] < R, "cache row ", row[i], " out of range [0, ", R, ")");
  auto* kc = static_cast<char*>(key_cache.data_ptr());
  auto* vc = static_cast<char*>(value_cache.data_ptr());
  const auto* ks = static_cast<const char*>(k.data_ptr());
  const auto* vs = static_cast<const char*>(v.data_ptr());
  const int64_t es = k.element_size();
  at::parallel_for(0, N, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < H; ++h) {
        const int64_t dst = row[t * H + h] * bytes;
        std::memcpy(kc + dst, ks + (t * k.stride(0) + h * k.stride(1)) * es, bytes);
        std::memcpy(vc + dst, vs + (t * v.stride(0) + h * v.stride(1)) * es, bytes);
      }
  });
}

}  // namespace tritonlm
