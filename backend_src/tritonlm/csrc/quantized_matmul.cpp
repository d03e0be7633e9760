// Weight-only quantized matmuls in the tiling of packed_matmul.h, packed once as the bfloat16
// weights are (tritonlm/layers/quantized_matmul.py): int8 pairs [blocks, ceil(K/2), 32, 2] or
// 4 bits [blocks, ceil(K/2), 32] (a byte per pair), or in quad rows [blocks, ceil(K/4) * 2, 32]
// where has_int4_quads (Int4Quads: AVX512-VNNI builds), widened to float32 in registers,
// float32 FMAs. Dequantized either
// - by one scale per output feature, applied once to its sums (int8 rows), or
// - by a scale and a bias per output feature and group of input features (w = q * scale + bias:
//   GPTQ, round-to-nearest and GGUF groups): a tile adds scale * (its sum of q * x over the
//   group) + bias * (x's sum over the group). The parameters are float32, or float16 where
//   they are exact in it (WidenedFma's Params).
// A prompt's row tiles share a block widened once (prewiden in packed_matmul_widen.h), or, where
// the caller measured float32 sgemm faster (sgemm_rows), the whole weight is dequantized once for
// it.
// Below int8_rows rows, grouped weights multiply x quantized to int8 (packed_matmul_int8_dots.h,
// packed_matmul_vnni_dots.h); from bf16_rows rows of bfloat16 x, each block is dequantized to
// bfloat16 and multiplied as bfloat16 weights are: in AMX tiles (packed_matmul_amx.h) or by
// AVX512-BF16 dot products (packed_matmul_dequantized.h).
#include "packed_matmul_amx.h"
#include "packed_matmul_vnni_dots.h"

#include <ATen/ops/constant_pad_nd.h>

namespace tritonlm {

#ifdef TRITONLM_PACKED_MATMUL
namespace {
using namespace packed_matmul;

// x's sum over each group of `group_size` features: [m, groups].
std::vector<float> group_sums(const FloatRows& x, int64_t m, int64_t k, int64_t groups,
                              int64_t group_size) {
  std::vector<float> sums(m * groups);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      const float* begin = x.data + r * x.stride + g * group_size;
      const int64_t n = std::min(k - g * group_size, group_size);
      Vec acc(0.f);
      int64_t i = 0;
      for (; i + W <= n; i += W) acc = acc + load_float(begin + i);
      if (i < n) acc = acc + load_float(begin + i, n - i);
      sums[r * groups + g] = at::vec::vec_reduce_all<float>(
          [](const Vec& a, const Vec& b) { return a + b; }, acc);
    }
  return sums;
}

// O: the output's element (float, or bfloat16 as uint16_t).
template <typename Mul, typename O>
void run_on(const typename Mul::X* xs, int64_t x_stride, const at::Tensor& packed, int64_t pairs,
            const Dequant& dequant, const std::optional<at::Tensor>& bias, at::Tensor& out,
            const Shape& shape, int64_t activation) {
  const auto* ws = reinterpret_cast<const typename Mul::W*>(packed.data_ptr());
  const auto* bs = bias ? reinterpret_cast<const O*>(bias->data_ptr()) : nullptr;
  run_tasks<Mul, O>(xs, x_stride, ws, pairs, dequant, bs, reinterpret_cast<O*>(out.data_ptr()),
                    shape, activation);
}

// Calls run(Type<P>{}) with the element of the group parameters (void: none).
template <typename Run>
void with_params(const std::optional<at::Tensor>& groups, Run run) {
  if (!groups)
    run(Type<void>{});
  else if (groups->scalar_type() == at::kHalf)
    run(Type<c10::Half>{});
  else
    run(Type<float>{});
}

// Calls run(Type<WidenedFma<...>>{}) with the multiply of the packed weight's layout.
template <typename Run>
void with_layout(bool int4, const std::optional<at::Tensor>& groups, Run run) {
  with_params(groups, [&](auto params) {
    using P = typename decltype(params)::type;
    if constexpr (std::is_void_v<P>)
      run(Type<WidenedFma<Native, int8_t>>{});  // int8 rows (4 bits always have groups)
    else if (int4)
      run(Type<WidenedFma<Native, Int4Weight, P>>{});
    else
      run(Type<WidenedFma<Native, int8_t, P>>{});
  });
}

Dequant dequant_of(const std::optional<at::Tensor>& row_scales,
                   const std::optional<at::Tensor>& groups, int64_t group_size,
                   const float* x_sums, const float* x_scales = nullptr) {
  return {row_scales ? row_scales->data_ptr<float>() : nullptr,
          groups ? groups->data_ptr() : nullptr, (group_size + 1) / 2, x_sums, x_scales};
}

// O: the output's element, x's (float, or bfloat16 as uint16_t).
template <typename O>
void run_for(const at::Tensor& x, const at::Tensor& packed, bool int4, bool int8_dots, bool bf16,
             bool amx, const std::optional<at::Tensor>& row_scales,
             const std::optional<at::Tensor>& groups, int64_t group_size,
             const std::optional<at::Tensor>& bias, at::Tensor& out, const Shape& shape,
             int64_t activation) {
  using T = std::conditional_t<std::is_same_v<O, float>, float, c10::BFloat16>;
  const int64_t pairs = x.size(1) / 2;
#ifdef TRITONLM_DEQUANTIZED_BF16
  if constexpr (std::is_same_v<O, uint16_t>) {
    if (bf16) {
      const auto* rows = reinterpret_cast<const uint16_t*>(x.data_ptr());
      const Dequant dequant = dequant_of(row_scales, groups, group_size, nullptr);
      with_layout(int4, groups, [&](auto type) {
        using Q = typename decltype(type)::type;
#ifdef TRITONLM_AMX
        if (amx) {
          run_on<AmxOnDequantized<Q>, O>(rows, x.stride(0), packed, pairs, dequant, bias, out,
                                         shape, activation);
          return;
        }
#endif
        run_on<DotsOnDequantized<Q>, O>(rows, x.stride(0), packed, pairs, dequant, bias, out,
                                        shape, activation);
      });
      return;
    }
  }
#endif
  if (int8_dots) {
    const QuantizedRows& q = quantize_rows<T>(x, groups->size(1), group_size);
    const Dequant dequant =
        dequant_of(row_scales, groups, group_size, q.sums.data(), q.scales.data());
    const int8_t* values = q.values.data();
    with_params(groups, [&](auto params) {
      using P = typename decltype(params)::type;
      if constexpr (!std::is_void_v<P>) {  // int8 dots always have groups
        if (int4)
          run_on<Int4Integer<P>, O>(values, x.size(1), packed, pairs, dequant, bias, out, shape,
                                    activation);
        else
          run_on<Int8Integer<P>, O>(values, x.size(1), packed, pairs, dequant, bias, out, shape,
                                    activation);
      }
    });
    return;
  }
  const FloatRows rows = float_rows(x);
  const std::vector<float> x_sums =
      groups ? group_sums(rows, x.size(0), x.size(1), groups->size(1), group_size)
             : std::vector<float>();
  const Dequant dequant = dequant_of(row_scales, groups, group_size, x_sums.data());
  with_layout(int4, groups, [&](auto type) {
    run_on<typename decltype(type)::type, O>(rows.data, rows.stride, packed, pairs, dequant,
                                             bias, out, shape, activation);
  });
}
}  // namespace

at::Tensor quantized_matmul(const at::Tensor& x, const at::Tensor& packed,
                            const std::optional<at::Tensor>& row_scales,
                            const std::optional<at::Tensor>& groups, int64_t group_size,
                            int64_t out_features, bool gated,
                            const std::optional<at::Tensor>& bias, int64_t activation,
                            int64_t sgemm_rows, int64_t int8_rows, int64_t bf16_rows, bool amx,
                            const std::optional<at::Tensor>& out) {
  using namespace packed_matmul;
  const auto dtype = x.scalar_type();
  TORCH_CHECK(x.dim() == 2 && (dtype == at::kFloat || dtype == at::kBFloat16) &&
                  x.stride(1) == 1,
              "quantized_matmul: x must be [M, K] float32 or bfloat16 with contiguous features");
  const int64_t m = x.size(0), k = x.size(1), pairs = (k + 1) / 2;
  TORCH_CHECK(!gated || out_features % 2 == 0, "quantized_matmul: a gated weight has an even "
              "number of features, got ", out_features);
  const int64_t half = gated ? out_features / 2 : kBlock / 2;  // high features' offset
  const int64_t blocks = gated ? (half + 15) / 16 : (out_features + kBlock - 1) / kBlock;
  const bool int4 = packed.scalar_type() == at::kByte;
  TORCH_CHECK((int4 || packed.scalar_type() == at::kChar) && packed.is_contiguous() &&
                  packed.dim() == (int4 ? 3 : 4) && packed.size(0) == blocks &&
                  packed.size(1) == (int4 ? stored_pairs<Int4Weight>(pairs) : pairs) &&
                  packed.size(2) == kBlock &&
                  (int4 || packed.size(3) == 2),
              "quantized_matmul: packed weight ", packed.sizes(), " (", packed.scalar_type(),
              ") does not hold ", out_features, " x ", k, " int8 or 4-bit values",
              gated ? " (gated)" : "");
  TORCH_CHECK(row_scales.has_value() != groups.has_value() && !(int4 && row_scales),
              "quantized_matmul: give row_scales (int8) or groups, not both");
  TORCH_CHECK(!row_scales || (row_scales->scalar_type() == at::kFloat &&
                              row_scales->is_contiguous() && row_scales->numel() == out_features),
              "quantized_matmul: row_scales must be ", out_features, " contiguous float32 values");
  const int64_t group_pairs = (group_size + 1) / 2;
  TORCH_CHECK(!groups || ((groups->scalar_type() == at::kFloat ||
                           groups->scalar_type() == at::kHalf) && groups->is_contiguous() &&
                          groups->dim() == 4 && groups->size(0) == blocks && group_size > 0 &&
                          groups->size(1) == (pairs + group_pairs - 1) / group_pairs &&
                          (group_size % 2 == 0 || groups->size(1) == 1) &&
                          groups->size(2) == 2 && groups->size(3) == kBlock),
              "quantized_matmul: groups must be float32 or float16 [", blocks,
              ", G, 2, 32]: G groups of ", group_size, " (even, or one group) of the ", k,
              " input features");
  TORCH_CHECK(!bias || (bias->scalar_type() == dtype && bias->is_contiguous() &&
                        bias->numel() == out_features),
              "quantized_matmul: bias must be ", out_features, " contiguous values of x's dtype");
  TORCH_CHECK(activation == -1 || (gated && (activation == 0 || activation == 1) &&
                                    dtype == at::kBFloat16),
              "quantized_matmul: activation must be -1 (none), or 0 (silu) or 1 (gelu, tanh "
              "approximation) on a gated weight and bfloat16 x, got ", activation);
  const int64_t out_cols = activation < 0 ? out_features : half;
  const Shape shape{m, out_features, out_cols, half, blocks, gated};
  // bfloat16 rows multiplied as bfloat16 weights are: in AMX tiles where K is a multiple of 32
  // (other K keep the paths below), else by bf16 dot products
#ifdef TRITONLM_AMX
  const bool amx_fits = !amx || amx_takes(k);
#else
  TORCH_CHECK(!amx, "quantized_matmul: amx: this build has no AMX tiles");
  const bool amx_fits = true;
#endif
#ifdef TRITONLM_DEQUANTIZED_BF16
  const bool bf16 = bf16_rows > 0 && m >= bf16_rows && dtype == at::kBFloat16 && amx_fits;
#else
  TORCH_CHECK(bf16_rows == 0, "quantized_matmul: bf16_rows: this build has no AVX512-BF16 "
              "dot products");
  const bool bf16 = false;
#endif
  const bool int8_dots = !bf16 && groups && m < int8_rows;
  // prompts on float inputs: the weight dequantized once, sgemm
  if (!bf16 && !int8_dots && sgemm_rows > 0 && m >= sgemm_rows) {
    at::Tensor dense;
    with_layout(int4, groups, [&](auto type) {
      using Mul = typename decltype(type)::type;
      dense = dense_weight<Mul>(reinterpret_cast<const typename Mul::W*>(packed.data_ptr()),
                                pairs, dequant_of(row_scales, groups, group_size, nullptr),
                                shape, k);
    });
    return sgemm_matmul(x, dense, bias, activation, out, "quantized_matmul: ");
  }
  auto result = result_tensor(out, {m, out_cols}, x.options(), "quantized_matmul: ");
  if (m == 0) return result;
  const at::Tensor even = k % 2 ? at::constant_pad_nd(x, {0, 1}) : x;
  if (dtype == at::kFloat)
    run_for<float>(even, packed, int4, int8_dots, bf16, amx, row_scales, groups, group_size,
                   bias, result, shape, activation);
  else
    run_for<uint16_t>(even, packed, int4, int8_dots, bf16, amx, row_scales, groups, group_size,
                      bias, result, shape, activation);
  return result;
}
bool has_vnni_dot_products() { return packed_matmul::kVnniDots; }
bool has_int4_quads() {
  return std::is_same_v<packed_matmul::Int4Weight, packed_matmul::Int4Quads>;
}
#else
at::Tensor quantized_matmul(const at::Tensor&, const at::Tensor&,
                            const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                            int64_t, int64_t, bool, const std::optional<at::Tensor>&, int64_t,
                            int64_t, int64_t, int64_t, bool, const std::optional<at::Tensor>&) {
  TORCH_CHECK(false, "quantized_matmul: built for a CPU without AVX2 + FMA");
}
bool has_vnni_dot_products() { return false; }
bool has_int4_quads() { return false; }
#endif

}  // namespace tritonlm
