// bfloat16 matmul on weights packed once (tritonlm/layers/cpu_gemm.py), in the tiling of
// packed_matmul.h (in AMX tiles where the CPU has them: packed_matmul_amx.h). Measured on 2 Zen 4
// cores (30 SmolLM2 layers, cold weights): 1.8-2x oneDNN's bf16 matmul at 1-4 rows, 1.2-1.3x at
// 32, equal at 2048.
#include "packed_matmul_amx.h"

#ifdef TRITONLM_PACKED_MATMUL

#include <ATen/ops/constant_pad_nd.h>

#include <chrono>

namespace tritonlm {
namespace {
using namespace packed_matmul;

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
                       bool widen, int64_t sgemm_rows, bool amx,
                       const std::optional<at::Tensor>& out) {
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
  const Shape shape{m, out_features, out_cols, half, blocks, gated};
#ifdef TRITONLM_AMX
  amx = amx && amx_takes(k);
#else
  amx = false;
#endif
  if (!amx && sgemm_rows > 0 && m >= sgemm_rows) {
    // Prompt-sized inputs, where float32 sgemm keeps the FMA units busier than tiles that widen
    // as they go: the weight widened once, rounded to bfloat16 as the tiles' output is.
    using Wide = WidenedFma<Native, uint16_t>;
    const auto* ws = reinterpret_cast<const uint16_t*>(packed.data_ptr());
    return sgemm_matmul(x, dense_weight<Wide>(ws, packed.size(1), {}, shape, k), bias,
                        activation, out, "bf16_matmul: ");
  }
  auto result = result_tensor(out, {m, out_cols}, x.options(), "bf16_matmul: ");
  if (m == 0) return result;
  // An odd last feature pairs with the packing's zero padding.
  const at::Tensor even = k % 2 ? at::constant_pad_nd(x, {0, 1}) : x;
  const auto* ws = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  const auto* bs = bias ? reinterpret_cast<const uint16_t*>(bias->data_ptr()) : nullptr;
  auto* os = reinterpret_cast<uint16_t*>(result.data_ptr());
#ifdef TRITONLM_AMX
  if (amx) {
    run_tasks<AmxTiles>(reinterpret_cast<const uint16_t*>(x.data_ptr()), x.stride(0), ws,
                        packed.size(1), {}, bs, os, shape, activation);
    return result;
  }
#endif
  if (widen) {
    const FloatRows rows = float_rows(even);
    run_tasks<WidenedFma<Native, uint16_t>>(rows.data, rows.stride, ws, packed.size(1), {}, bs,
                                            os, shape, activation);
    return result;
  }
#ifdef __AVX512BF16__
  run_tasks<DotProducts>(reinterpret_cast<const uint16_t*>(even.data_ptr()), even.stride(0), ws,
                         packed.size(1), {}, bs, os, shape, activation);
#else
  TORCH_CHECK(false, "bf16_matmul: this build has no AVX512-BF16 dot products (widen=True runs)");
#endif
  return result;
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
                       const std::optional<at::Tensor>&, int64_t, bool, int64_t, bool,
                       const std::optional<at::Tensor>&) {
  TORCH_CHECK(false, "bf16_matmul: built for a CPU without AVX2 + FMA");
}
double bf16_dot_product_speedup() { return 0; }
}  // namespace tritonlm

#endif

namespace tritonlm {
bool has_bf16_matmul() {
#ifdef TRITONLM_PACKED_MATMUL
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
bool has_amx_tiles() {
#ifdef TRITONLM_AMX
  return amx_permitted();
#else
  return false;
#endif
}
bool has_bf16_dot_products() {
#if defined(TRITONLM_PACKED_MATMUL) && defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}
// How bf16 products are multiplied, given the way TRITONLM_BF16_MATMUL forces ("amx", "dot",
// "fma", or "" for none; cpu_gemm.py checks its values): in AMX tiles wherever the CPU has them,
// unless dot products or FMAs are forced; elsewhere (and for what the tiles do not take) with
// AVX512-BF16 dot products where they issue at least as many FLOPs as float32 FMAs on widened
// values (Zen 4/5; Intel Xeons issue them at half the rate), unless FMAs are forced. The
// matmul's caller and the attention kernels ask the same.
bool multiplies_in_amx(const std::string& forced) {
  return (forced.empty() || forced == "amx") && has_amx_tiles();
}
bool multiplies_by_bf16_dots(const std::string& forced) {
  return forced == "dot" ||
         (forced != "fma" && has_bf16_dot_products() && bf16_dot_product_speedup() >= 1);
}
}  // namespace tritonlm
