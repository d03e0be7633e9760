// A quantized weight (Q: its vector multiply, for its layout and dequantization) multiplied as a
// bfloat16 weight on a prompt's bfloat16 rows: run_tasks dequantizes each block into bfloat16
// pairs (in each chunk's task, or, for AMX tiles past one chunk, the whole weight first), the
// packed layout both AMX tiles and AVX512-BF16 dot products multiply (int8 rows keep their
// values, exact in bfloat16: the epilogue scales the sums; grouped values are rounded to
// bfloat16), then multiplies the chunk's rows by D (AmxTiles, or DotProducts where vdpbf16ps is
// the CPU's faster way: Zen 4/5).
#pragma once
#include "packed_matmul_tasks.h"

#if defined(TRITONLM_PACKED_MATMUL) && defined(__AVX512BF16__)
#define TRITONLM_DEQUANTIZED_BF16

namespace tritonlm {
namespace packed_matmul {

template <typename Q, typename D>
struct OnDequantized : Q {
  using X = uint16_t;  // bfloat16 rows
  using Dequantized = D;
  static void dequantize(const typename Q::W* w, int64_t pairs, const typename Q::P* groups,
                         int64_t group_pairs, uint16_t* out) {
    // [even 0..15, odd 0..15] as bf16 to pairs (even l, odd l)
    alignas(64) static constexpr uint16_t kInterleave[32] = {
        0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
        8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i interleave = _mm512_load_si512(kInterleave);
    dequantize_block<Q>(w, pairs, groups, group_pairs, [&](int64_t p, int v, __m512 even,
                                                           __m512 odd) {
      const __m512i halves = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(odd, even));
      _mm512_storeu_si512(out + p * kPairElems<uint16_t> + v * 2 * Avx512::kLanes,
                          _mm512_permutexvar_epi16(interleave, halves));
    });
  }
};

template <typename Q>
using DotsOnDequantized = OnDequantized<Q, DotProducts>;

}  // namespace packed_matmul
}  // namespace tritonlm

#endif
