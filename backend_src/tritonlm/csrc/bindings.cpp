// The Python module of tritonlm's CPU kernels (tritonlm/layers/cpu_kernels.py builds it).
#include <torch/extension.h>

#include <optional>
#include <tuple>

namespace tritonlm {
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_rows,
                            const at::Tensor& context_lens, double scale,
                            const std::optional<at::Tensor>& alibi_slopes, int64_t window);
void prefill_attention(const at::Tensor& q, const at::Tensor& key_cache,
                       const at::Tensor& value_cache, const at::Tensor& block_rows,
                       const at::Tensor& query_starts, const at::Tensor& query_lens,
                       const at::Tensor& context_lens, double scale,
                       const std::optional<at::Tensor>& alibi_slopes, int64_t window,
                       at::Tensor& out);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                    const std::optional<at::Tensor>& residual, bool offset);
at::Tensor act_and_mul(const at::Tensor& x, int64_t activation);
void rotary_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
std::tuple<at::Tensor, at::Tensor> argmax_logsumexp(const at::Tensor& logits);
void write_kv_(at::Tensor& key_cache, at::Tensor& value_cache, const at::Tensor& k,
               const at::Tensor& v, const at::Tensor& rows);
at::Tensor bf16_matmul(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                       bool gated, const std::optional<at::Tensor>& bias, int64_t activation,
                       bool widen, int64_t sgemm_rows);
int64_t vector_lanes();
at::Tensor quantized_matmul(const at::Tensor& x, const at::Tensor& packed,
                            const std::optional<at::Tensor>& row_scales,
                            const std::optional<at::Tensor>& groups, int64_t group_size,
                            int64_t out_features, const std::optional<at::Tensor>& bias,
                            int64_t sgemm_rows);
double bf16_dot_product_speedup();
bool has_bf16_matmul();
bool has_bf16_dot_products();
}  // namespace tritonlm

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace tritonlm;
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("decode_attention", &decode_attention,
        "Paged decode attention: q [B, Hq, D], caches [R, bs, D], block_rows [B, Hkv, nb] int64, "
        "context_lens [B] int64 -> [B, Hq, D]",
        py::arg("q"), py::arg("key_cache"), py::arg("value_cache"), py::arg("block_rows"),
        py::arg("context_lens"), py::arg("scale"), py::arg("alibi_slopes") = py::none(),
        py::arg("window") = 0, nogil);
  m.def("prefill_attention", &prefill_attention,
        "Paged causal attention for rows of several queries: row b's query_lens[b] queries are "
        "q[query_starts[b]:][:query_lens[b]] at the last positions of its context_lens[b] keys; "
        "writes out (like q) at those tokens",
        py::arg("q"), py::arg("key_cache"), py::arg("value_cache"), py::arg("block_rows"),
        py::arg("query_starts"), py::arg("query_lens"), py::arg("context_lens"), py::arg("scale"),
        py::arg("alibi_slopes"), py::arg("window"), py::arg("out"), nogil);
  m.def("rms_norm", &rms_norm,
        "RMSNorm of x [T, H] (of residual += x when residual is given, updated in place) -> "
        "[T, H]; offset: Gemma's (1 + weight) scaling",
        py::arg("x"), py::arg("weight"), py::arg("eps"), py::arg("residual") = py::none(),
        py::arg("offset") = false, nogil);
  m.def("act_and_mul", &act_and_mul,
        "act(gate) * up for x [T, 2I] = [gate | up] -> [T, I]; activation 0 silu, 1 gelu (tanh "
        "approximation)",
        py::arg("x"), py::arg("activation"), nogil);
  m.def("rotary_", &rotary_,
        "Rotates the first rotary_dim features of x [T, H, D] in place (rotate-half); cos, sin "
        "[T, rotary_dim]",
        py::arg("x"), py::arg("cos"), py::arg("sin"), nogil);
  m.def("argmax_logsumexp", &argmax_logsumexp,
        "Per row of logits [S, V]: the first index of the maximum (int64) and logsumexp (float32)",
        py::arg("logits"), nogil);
  m.def("write_kv_", &write_kv_,
        "Copies k and v [N, Hkv, D] (features contiguous) to rows [N * Hkv] (token-major) of "
        "the caches viewed as [R, D]",
        py::arg("key_cache"), py::arg("value_cache"), py::arg("k"), py::arg("v"),
        py::arg("rows"), nogil);
  m.def("bf16_matmul", &bf16_matmul,
        "x [M, K] bfloat16 @ a weight [N, K] packed as [blocks, ceil(K/2), 32, 2] (gated: [gate; "
        "up] packed in pairs of 16 features) + bias [N] bfloat16 -> [M, N] bfloat16, or with an "
        "activation (0 silu, 1 gelu-tanh) on a gated weight act(gate) * up [M, N / 2]; widen: "
        "float32 FMAs on widened weights instead of AVX512-BF16 dot products "
        "(has_bf16_dot_products); from sgemm_rows rows (0: never) the weight widened whole "
        "and multiplied by float32 sgemm; needs AVX2 + FMA (has_bf16_matmul)",
        py::arg("x"), py::arg("packed"), py::arg("out_features"), py::arg("gated") = false,
        py::arg("bias") = py::none(), py::arg("activation") = -1, py::arg("widen") = false,
        py::arg("sgemm_rows") = 0, nogil);
  m.def("quantized_matmul", &quantized_matmul,
        "x [M, K] float32 or bfloat16 @ a quantized weight [N, K] + bias [N] of x's dtype -> "
        "[M, N] of x's dtype. The weight packed as bf16_matmul's: int8 [blocks, ceil(K/2), 32, 2] "
        "or 4-bit pairs uint8 [blocks, ceil(K/2), 32] (even k in the low nibble); dequantized "
        "by row_scales [N] float32 (int8) or by groups [blocks, G, 2, 32] float32 (per group "
        "of group_size input features, the last one shorter, a scale and a bias per packed "
        "feature: w = q * scale + bias); from sgemm_rows rows (0: never) the weight dequantized "
        "whole and multiplied by float32 sgemm; needs AVX2 + FMA (has_bf16_matmul)",
        py::arg("x"), py::arg("packed"), py::arg("row_scales"), py::arg("groups"),
        py::arg("group_size"), py::arg("out_features"), py::arg("bias") = py::none(),
        py::arg("sgemm_rows") = 0, nogil);
  m.def("bf16_dot_product_speedup", &bf16_dot_product_speedup,
        "float32 FLOPs per second of vdpbf16ps over FMAs on one core, each measured on independent "
        "accumulators (0 without AVX512-BF16): above 1, dot products multiply bf16 faster",
        nogil);
  m.attr("has_bf16_matmul") = has_bf16_matmul();
  m.attr("vector_lanes") = vector_lanes();
  m.attr("has_bf16_dot_products") = has_bf16_dot_products();
}
