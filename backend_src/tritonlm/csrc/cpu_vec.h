// Shared by the CPU kernels: at::vec at this CPU's width, and float32 loads/stores of the model
// dtypes. Built with -march=native (tritonlm/layers/cpu_kernels.py): at::vec's AVX512 / AVX2
// specialisations are enabled here when the compiler targets them, else its generic code runs.
#pragma once
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512DQ__)
#define CPU_CAPABILITY AVX512
#define CPU_CAPABILITY_AVX512
#elif defined(__AVX2__) && defined(__FMA__)
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#endif

// The tensor and its methods, not ATen.h's every operator (5-7 s less to compile per source);
// a kernel includes the ATen/ops headers of the operators it calls.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <cstdlib>
#include <optional>
#include <string>
#include <type_traits>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace tritonlm {

// How TRITONLM_BF16_MATMUL (tritonlm/layers/cpu_gemm.py's MULTIPLY_ENV, which checks its
// values) forces bf16 products, read once: "amx", "dot", "fma", or "" (unset: each kernel's
// own choice). The attention kernels follow it as the matmul does.
inline const std::string& forced_bf16_multiply() {
  static const std::string forced = [] {
    const char* value = std::getenv("TRITONLM_BF16_MATMUL");
    return std::string(value ? value : "");
  }();
  return forced;
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// Whether this process may use AMX: Linux gives a process the tiles' state only once it asks
// (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA); without it the first tile instruction faults.
inline bool amx_permitted() {
  constexpr int kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  static const bool permitted = syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  return permitted;
}

// Loads palette 1 with tiles 0-7 of rows[t] rows of colsb[t] bytes (0: unused).
inline void load_tile_config(const uint8_t (&rows)[8], const uint16_t (&colsb)[8]) {
  struct alignas(64) {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  } config;
  for (int tile = 0; tile < 8; ++tile) {
    config.rows[tile] = rows[tile];
    config.colsb[tile] = rows[tile] ? colsb[tile] : 0;
  }
  // GCC 12 dropped the stores to colsb as dead before the ldtilecfg (which then faulted on
  // zero-width tiles); the barrier makes them land.
  asm volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}
#endif

using Vec = at::vec::Vectorized<float>;
constexpr int W = Vec::size();
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Lazy online softmax (the bf16 attention kernels): a running maximum moves only when a score
// passes it by more than this, so most chunks need no horizontal max and no scalar exp;
// unnormalised probabilities stay below e^kLazyMax.
constexpr float kLazyMax = 8.f;

// at::parallel_for grain (rows) for an elementwise kernel over rows of `row_elements` values: a
// decode step's few rows run on the calling thread. Splitting a few microseconds of work gains
// less than the fork and join cost, and where the server shares the cores, a preempted worker
// holds the whole region up until it runs again.
inline int64_t elementwise_grain(int64_t row_elements) {
  constexpr int64_t kMinParallelElements = 32768;
  return std::max<int64_t>(1, kMinParallelElements / std::max<int64_t>(1, row_elements));
}

// Where an op puts its result: `out` when the caller gives one (an op program's replay passes
// the tensor its recording returned, so no copy follows each op: SmolLM2's 32-row decode step
// copied 11.5 MB of results, ~2 ms of 37 on Zen 4), else a fresh tensor.
inline at::Tensor result_tensor(const std::optional<at::Tensor>& out, at::IntArrayRef sizes,
                                const at::TensorOptions& options, const char* name) {
  if (!out.has_value() || !out->defined()) return at::empty(sizes, options);
  TORCH_CHECK(out->device().is_cpu() && out->scalar_type() == options.dtype() &&
                  out->sizes() == sizes && out->is_contiguous(),
              name, "out must be a contiguous CPU ", sizes, " of ",
              c10::typeMetaToScalarType(options.dtype()), ", got ", out->scalar_type(), " ",
              out->sizes());
  return *out;
}

// A 2-D CPU tensor [rows, features] whose rows each hold contiguous features, any stride apart.
inline void check_rows(const at::Tensor& t, const char* name, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), name, what, " must be on the CPU");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, what,
              " must be 2-D [rows, features] with contiguous features (contiguous rows, any "
              "stride apart), got ", t.sizes(), " strides ", t.strides());
}

// A result computed elsewhere (a fallback path) put where result_tensor would have put it.
inline at::Tensor into_result(const std::optional<at::Tensor>& out, const at::Tensor& result,
                              const char* name) {
  if (!out.has_value() || !out->defined()) return result;
  return result_tensor(out, result.sizes(), result.options(), name).copy_(result);
}

// Threads for an OpenMP region that hands out `tasks` tasks dynamically (one when already inside
// a parallel region).
inline int region_threads(int64_t tasks) {
  return at::in_parallel_region()
      ? 1 : static_cast<int>(std::min<int64_t>(at::get_num_threads(), tasks));
}

#ifdef CPU_CAPABILITY_AVX512
// bfloat16 in registers, exactly as torch's casts: widening is a shift; narrowing rounds to
// nearest even and keeps NaN a NaN (at::vec's generic conversions go through two vectors and a
// stack copy for partial stores, which made the fused ops several times slower).
inline __mmask16 first_lanes(int64_t n) { return static_cast<__mmask16>((1u << n) - 1); }
inline Vec widen_bf16(__m256i v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
// float32 bits rounded to bfloat16 precision, the low 16 bits zero.
inline __m512i round_bf16_bits(const Vec& v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i up = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_mov_epi32(_mm512_and_si512(up, _mm512_set1_epi32(0xFFFF0000)), nan,
                               _mm512_set1_epi32(0x7FC00000));
}
inline __m256i narrow_bf16(const Vec& v) {
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(round_bf16_bits(v), 16));
}
#endif

inline Vec load_float(const float* p) { return Vec::loadu(p); }
inline Vec load_float(const c10::BFloat16* p) {
#ifdef CPU_CAPABILITY_AVX512
  return widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#else
  Vec out;
  at::vec::load_fp32_from_bf16(p, out);
  return out;
#endif
}
inline Vec load_float(const c10::Half* p) {
  Vec out;
  at::vec::load_fp32_from_fp16(p, out);
  return out;
}

// The first n <= W values at p as float32; the other lanes are zero.
template <typename T>
inline Vec load_float(const T* p, int64_t n) {
  if (n == W) return load_float(p);
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(p, n);
  } else {
#ifdef CPU_CAPABILITY_AVX512
    if constexpr (std::is_same_v<T, c10::BFloat16>)
      return widen_bf16(_mm256_maskz_loadu_epi16(first_lanes(n), p));
#endif
    return std::get<0>(at::vec::convert_to_float<T>(at::vec::Vectorized<T>::loadu(p, n)));
  }
}

// Stores the first n <= W lanes of v as T, rounded to nearest even as torch's casts round.
template <typename T>
inline void store_float(T* p, const Vec& v, int64_t n = W) {
  if constexpr (std::is_same_v<T, float>) {
    v.store(p, n);
  } else {
#ifdef CPU_CAPABILITY_AVX512
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      _mm256_mask_storeu_epi16(p, first_lanes(n), narrow_bf16(v));
      return;
    }
#endif
    at::vec::convert_from_float<T>(v, v).store(p, n);
  }
}

// v rounded to T's precision and back: what storing an intermediate result as T gives.
template <typename T>
inline Vec rounded(const Vec& v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
#ifdef CPU_CAPABILITY_AVX512
    if constexpr (std::is_same_v<T, c10::BFloat16>)
      return _mm512_castsi512_ps(round_bf16_bits(v));
#endif
    return std::get<0>(at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(v, v)));
  }
}

// The activations fused with "* up" (act_and_mul, the gated bf16 matmul): 0 silu, 1 gelu with the
// tanh approximation.
template <int kAct>
inline Vec activate(const Vec& x) {
  if constexpr (kAct == 0) {
    return x / (Vec(1.f) + x.neg().exp());
  } else {
    const Vec beta(static_cast<float>(M_SQRT2 * M_2_SQRTPI * 0.5));
    const Vec inner = beta * (x + Vec(0.044715f) * x * x * x);
    return Vec(0.5f) * x * (Vec(1.f) + inner.tanh());
  }
}

inline float sum_lanes(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, v);
}

// Runs fn.template operator()<T>() for a float32, bfloat16 or float16 tensor's dtype.
template <typename Fn>
inline void dispatch_float_types(at::ScalarType dtype, const char* name, Fn&& fn) {
  switch (dtype) {
    case at::kFloat: fn(float{}); break;
    case at::kBFloat16: fn(c10::BFloat16{}); break;
    case at::kHalf: fn(c10::Half{}); break;
    default: TORCH_CHECK(false, name, "float32, bfloat16 or float16 expected, got ", dtype);
  }
}

}  // namespace tritonlm
