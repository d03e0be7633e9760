// What the paged decode-attention kernels (decode_attention_generic.h, decode_attention_widened.h)
// share: their per-thread scratch and how they ask for K/V blocks ahead of reading them.
#pragma once
#include "cpu_vec.h"

#include <vector>

namespace tritonlm {
namespace paged_decode {

// Blocks lie anywhere in the cache, beyond the hardware prefetcher's reach: each task asks for
// the blocks kAhead ahead of the one it reads. Into L2 (locality 2), not L1: with requests for
// every line of a block in flight at once, prefetching into L1 stalls on its few miss buffers
// (cold reads of a 30-layer decode step took 11.2 ms with L1, 8.4 ms with L2).
constexpr int64_t kAhead = 2;

// Always inlined: GCC drops a call that only prefetches as free of effects (packed_matmul.h).
__attribute__((always_inline)) inline void prefetch_rows(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i, 0, 2);
}

// Before a task's first block: its first kAhead blocks.
inline void prefetch_first_blocks(const void* key_cache, const void* value_cache,
                                  const int64_t* rows, int64_t first, int64_t last,
                                  int64_t block_bytes) {
  for (int64_t j = first; j < std::min(first + kAhead, last + 1); ++j) {
    prefetch_rows(static_cast<const char*>(key_cache) + rows[j] * block_bytes, block_bytes);
    prefetch_rows(static_cast<const char*>(value_cache) + rows[j] * block_bytes, block_bytes);
  }
}

// The K and V rows of the block read kAhead after block j of blocks [first, last] (rows): past
// the last, one of the first blocks of next_rows (the kv head the thread attends next; null:
// none); or nulls.
template <typename T>
struct BlockAhead {
  const T* k = nullptr;
  const T* v = nullptr;
  BlockAhead from_row(int64_t row, int64_t row_elems) const {  // its rows from `row` on
    return k == nullptr ? BlockAhead{} : BlockAhead{k + row * row_elems, v + row * row_elems};
  }
};
template <typename T>
inline BlockAhead<T> block_ahead(const T* key_cache, const T* value_cache, const int64_t* rows,
                                 const int64_t* next_rows, int64_t j, int64_t first, int64_t last,
                                 int64_t block_elems) {
  const int64_t past = j + kAhead - (last - first + 1);
  const int64_t row = j + kAhead <= last ? rows[j + kAhead]
                      : next_rows != nullptr && past <= last ? next_rows[past] : -1;
  if (row < 0) return {};
  return {key_cache + row * block_elems, value_cache + row * block_elems};
}

// Rows [i * bs / n, (i + 1) * bs / n) of the block ahead (of bs rows, row_elems each; nulls:
// none): called for each of the n keys a block reads, it asks for the block ahead a share at a
// time, where all of it at once stalled on the core's few miss buffers (30 layers, 32 x ~180
// keys: Zen 3's widened path 11.2 -> 7.5 ms, Zen 4's AVX512-BF16 one 9.8 -> 7.7).
template <typename T>
__attribute__((always_inline)) inline void prefetch_share(const BlockAhead<T>& ahead, int64_t i,
                                                          int64_t n, int64_t bs,
                                                          int64_t row_elems) {
  if (ahead.k == nullptr) return;
  const int64_t first = i * bs / n, rows = (i + 1) * bs / n - first;
  const int64_t bytes = rows * row_elems * sizeof(T);
  prefetch_rows(ahead.k + first * row_elems, bytes);
  prefetch_rows(ahead.v + first * row_elems, bytes);
}

// A thread's working memory for G query heads of dim D over blocks of bs keys.
struct Scratch {
  std::vector<float> q, acc, scores, probs, keys, values, max, sum, parts, lane_sums;
  Scratch(int64_t G, int64_t D, int64_t bs)
      : q(G * D), acc(G * D), scores(G * std::max<int64_t>(bs, 16)),
        probs(G * std::max<int64_t>(bs, 16)), keys(bs * D), values(bs * D),
        max(G), sum(G), parts(G * W * W), lane_sums(G * W) {}
};

}  // namespace paged_decode
}  // namespace tritonlm
