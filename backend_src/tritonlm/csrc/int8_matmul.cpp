// int8 weights with one scale per output feature (round-to-nearest int8, GPTQ 8-bit without
// groups), packed once as the bfloat16 weights are (tritonlm/layers/quantized_matmul.py), in the
// tiling of packed_matmul.h: pairs widened to float32 in registers, float32 FMAs, each feature's
// scale applied once to its sum. A quarter of float32's bytes per weight.
#include "packed_matmul.h"

namespace tritonlm {

#ifdef TRITONLM_PACKED_MATMUL
at::Tensor int8_matmul(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                       int64_t out_features, const std::optional<at::Tensor>& bias) {
  using namespace packed_matmul;
  const auto dtype = x.scalar_type();
  TORCH_CHECK(x.dim() == 2 && (dtype == at::kFloat || dtype == at::kBFloat16) &&
                  x.stride(1) == 1,
              "int8_matmul: x must be [M, K] float32 or bfloat16 with contiguous features");
  const int64_t m = x.size(0), k = x.size(1);
  const int64_t blocks = (out_features + kBlock - 1) / kBlock;
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kChar && packed.is_contiguous() &&
                  packed.size(0) == blocks && packed.size(1) == (k + 1) / 2 &&
                  packed.size(2) == kBlock && packed.size(3) == 2,
              "int8_matmul: packed weight ", packed.sizes(), " does not hold ", out_features,
              " x ", k);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.numel() == out_features,
              "int8_matmul: scales must be ", out_features, " contiguous float32 values");
  TORCH_CHECK(!bias || (bias->scalar_type() == dtype && bias->is_contiguous() &&
                        bias->numel() == out_features),
              "int8_matmul: bias must be ", out_features, " contiguous values of x's dtype");
  auto out = at::empty({m, out_features}, x.options());
  if (m == 0) return out;
  const at::Tensor xs = dtype == at::kFloat ? x : x.to(at::kFloat);
  const at::Tensor even = k % 2 ? at::constant_pad_nd(xs, {0, 1}) : xs;
  const auto* ws = reinterpret_cast<const int8_t*>(packed.data_ptr());
  const Shape shape{m, out_features, out_features, kBlock / 2, blocks, false};
  using Mul = WidenedFma<Native, int8_t>;
  if (dtype == at::kFloat) {
    run_tasks<Mul, float>(even, ws, packed.size(1), scales.data_ptr<float>(),
                          bias ? bias->data_ptr<float>() : nullptr, out.data_ptr<float>(), shape,
                          -1);
  } else {
    const auto* bs = bias ? reinterpret_cast<const uint16_t*>(bias->data_ptr()) : nullptr;
    run_tasks<Mul, uint16_t>(even, ws, packed.size(1), scales.data_ptr<float>(), bs,
                             reinterpret_cast<uint16_t*>(out.data_ptr()), shape, -1);
  }
  return out;
}
#else
at::Tensor int8_matmul(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                       const std::optional<at::Tensor>&) {
  TORCH_CHECK(false, "int8_matmul: built for a CPU without AVX2 + FMA");
}
#endif

}  // namespace tritonlm
