// One prefill tile (a row's kv head, up to 16 queries) in bfloat16 with AVX512-BF16 dot products,
// or AMX tiles where the CPU has them (Sapphire Rapids on), called by paged_prefill_attention.cpp
// where the CPU has the dot products (Zen 4, Sapphire Rapids on).
#pragma once

#include "cpu_vec.h"

#include <cstdint>
#include <vector>

namespace tritonlm {

struct PrefillRows {  // one task's view of the inputs
  int64_t context, query_len, first_query;  // first_query: index within the row's queries
  const int64_t* blocks;  // this (row, kv head)'s cache rows
};

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
#define TRITONLM_PREFILL_BF16 1

// Per thread: the tile's query rows (bf16 bits; rows padded to 16, AMX's), the key chunk as
// [D / 2, 16] feature pairs, the value chunk as [8, D, 2] row pairs, bf16 probabilities, the
// float32 running state (the probabilities' sums per lane: [rows, 16]) and AMX tiles' outputs
// (16 rows' scores, their P.V). A scratch with rows holds the thread's AMX tiles configured for
// the tiles (where the CPU has them) until it goes: once per region, not per tile.
struct PrefillScratchBf16 {
  std::vector<uint16_t> q, values, probs;
  std::vector<uint32_t> keys;
  std::vector<float> acc, max, sum, scores, pv;
  std::vector<int64_t> pos;
  bool amx;
  PrefillScratchBf16(int64_t rows, int64_t D);
  ~PrefillScratchBf16();
  PrefillScratchBf16(const PrefillScratchBf16&) = delete;
  PrefillScratchBf16& operator=(const PrefillScratchBf16&) = delete;
  static int64_t padded(int64_t rows) { return (rows + 15) / 16 * 16; }
};

// For D % 32 == 0. Same contract as the float path's tile: out gets the tile's query rows.
void attend_tile_bf16(const c10::BFloat16* q, int64_t q_token_stride,
                      const c10::BFloat16* key_cache, const c10::BFloat16* value_cache,
                      const PrefillRows& r, int64_t n_queries, const float* slopes,
                      int64_t window, float scale, int64_t G, int64_t D, int64_t bs,
                      c10::BFloat16* out, PrefillScratchBf16& s);
#endif

}  // namespace tritonlm
