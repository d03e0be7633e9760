// tritonlm's CPU kernels as torch ops in a library named after the extension (torch.ops.<name>,
// so a dispatch mode sees them: op programs record them), and the Python module of the CPU's
// features and op programs (tritonlm/layers/cpu_kernels.py builds it).
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

namespace tritonlm {
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_rows,
                            const at::Tensor& context_lens, double scale,
                            const std::optional<at::Tensor>& alibi_slopes, int64_t window,
                            const std::optional<at::Tensor>& out);
void prefill_attention(const at::Tensor& q, const at::Tensor& key_cache,
                       const at::Tensor& value_cache, const at::Tensor& block_rows,
                       const at::Tensor& query_starts, const at::Tensor& query_lens,
                       const at::Tensor& context_lens, double scale,
                       const std::optional<at::Tensor>& alibi_slopes, int64_t window,
                       at::Tensor& out);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                    const std::optional<at::Tensor>& residual, bool offset,
                    const std::optional<at::Tensor>& out);
at::Tensor act_and_mul(const at::Tensor& x, int64_t activation,
                       const std::optional<at::Tensor>& out);
void rotary_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
std::tuple<at::Tensor, at::Tensor> argmax_logsumexp(const at::Tensor& logits);
at::Tensor shortlist_argmax(const at::Tensor& approx, const at::Tensor& hidden,
                            const at::Tensor& head, int64_t k);
void write_kv_(at::Tensor& key_cache, at::Tensor& value_cache, const at::Tensor& k,
               const at::Tensor& v, const at::Tensor& rows);
at::Tensor bf16_matmul(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                       bool gated, const std::optional<at::Tensor>& bias, int64_t activation,
                       bool widen, int64_t sgemm_rows, bool amx,
                       const std::optional<at::Tensor>& out);
int64_t vector_lanes();
at::Tensor quantized_matmul(const at::Tensor& x, const at::Tensor& packed,
                            const std::optional<at::Tensor>& row_scales,
                            const std::optional<at::Tensor>& groups, int64_t group_size,
                            int64_t out_features, bool gated,
                            const std::optional<at::Tensor>& bias, int64_t activation,
                            int64_t sgemm_rows, int64_t int8_rows, int64_t bf16_rows, bool amx,
                            const std::optional<at::Tensor>& out);
void lora_add_(at::Tensor& y, const at::Tensor& x, const at::Tensor& a_t, const at::Tensor& b,
               const at::Tensor& rows, const at::Tensor& counts, const at::Tensor& part_cols);
double bf16_dot_product_speedup();
void bind_op_program(pybind11::module_& m);  // op_program.cpp
bool has_bf16_matmul();
bool has_bf16_dot_products();
bool has_amx_tiles();
bool multiplies_in_amx(const std::string& forced);
bool multiplies_by_bf16_dots(const std::string& forced);
bool has_vnni_dot_products();
bool has_int4_quads();
}  // namespace tritonlm


// TORCH_LIBRARY stringifies its namespace: one more expansion turns the macro into the name.
#define TRITONLM_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define TRITONLM_LIBRARY_IMPL(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)

TRITONLM_LIBRARY(TORCH_EXTENSION_NAME, m) {
  // An op with `out` returns its result there when given (the tensor its op-program recording
  // returned, engine/op_programs.py), else in a fresh tensor.
  // Paged decode attention: q [B, Hq, D], caches [R, bs, D], block_rows [B, Hkv, nb] int64,
  // context_lens [B] int64 -> [B, Hq, D].
  m.def("decode_attention(Tensor q, Tensor key_cache, Tensor value_cache, Tensor block_rows, "
        "Tensor context_lens, float scale, Tensor? alibi_slopes=None, int window=0, "
        "Tensor(a!)? out=None) -> Tensor");
  // Paged causal attention for rows of several queries: row b's query_lens[b] queries are
  // q[query_starts[b]:][:query_lens[b]] at the last positions of its context_lens[b] keys;
  // writes out (like q) at those tokens.
  m.def("prefill_attention(Tensor q, Tensor key_cache, Tensor value_cache, Tensor block_rows, "
        "Tensor query_starts, Tensor query_lens, Tensor context_lens, float scale, "
        "Tensor? alibi_slopes, int window, Tensor(a!) out) -> ()");
  // RMSNorm of x [T, H] (of residual += x when residual is given, updated in place) -> [T, H];
  // offset: Gemma's (1 + weight) scaling.
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor(a!)? residual=None, "
        "bool offset=False, Tensor(b!)? out=None) -> Tensor");
  // act(gate) * up for x [T, 2I] = [gate | up] -> [T, I]; activation 0 silu, 1 gelu (tanh).
  m.def("act_and_mul(Tensor x, int activation, Tensor(a!)? out=None) -> Tensor");
  // Rotates the first rotary_dim features of x [T, H, D] in place (rotate-half); cos, sin
  // [T, rotary_dim].
  m.def("rotary_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
  // Per row of logits [S, V]: the first index of the maximum (int64) and logsumexp (float32).
  m.def("argmax_logsumexp(Tensor logits) -> (Tensor, Tensor)");
  // Per row: of the k tokens with the largest approx [S, V] (the first k ids among equals), the
  // one whose row of head [V, D] has the largest dot product with hidden [S, D] (int64).
  m.def("shortlist_argmax(Tensor approx, Tensor hidden, Tensor head, int k) -> Tensor");
  // Copies k and v [N, Hkv, D] (features contiguous) to rows [N * Hkv] (token-major) of the
  // caches viewed as [R, D].
  m.def("write_kv_(Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor k, Tensor v, "
        "Tensor rows) -> ()");
  // x [M, K] bfloat16 @ a weight [N, K] packed as [blocks, ceil(K/2), 32, 2] (gated: [gate; up]
  // packed in pairs of 16 features) + bias [N] bfloat16 -> [M, N] bfloat16, or with an
  // activation (0 silu, 1 gelu-tanh) on a gated weight act(gate) * up [M, N / 2]; widen: float32
  // FMAs on widened weights instead of AVX512-BF16 dot products (has_bf16_dot_products); from
  // sgemm_rows rows (0: never) the weight widened whole and multiplied by float32 sgemm; amx:
  // in AMX tiles where K is a multiple of 32 (has_amx_tiles; ahead of widen and sgemm_rows);
  // needs AVX2 + FMA (has_bf16_matmul).
  m.def("bf16_matmul(Tensor x, Tensor packed, int out_features, bool gated=False, "
        "Tensor? bias=None, int activation=-1, bool widen=False, int sgemm_rows=0, "
        "bool amx=False, Tensor(a!)? out=None) -> Tensor");
  // x [M, K] float32 or bfloat16 @ a quantized weight [N, K] + bias [N] of x's dtype -> [M, N]
  // of x's dtype. The weight packed as bf16_matmul's: int8 [blocks, ceil(K/2), 32, 2] or 4-bit
  // pairs uint8 [blocks, ceil(K/2), 32] (even k in the low nibble); dequantized by row_scales
  // [N] float32 (int8) or by groups [blocks, G, 2, 32] float32 or float16 (per group of
  // group_size input features, the last one shorter, a scale and a bias per packed feature:
  // w = q * scale + bias); from sgemm_rows rows (0: never) the weight dequantized whole and
  // multiplied by float32 sgemm; below int8_rows rows 4-bit groups multiply x quantized to int8
  // per row and group (w4a8); from bf16_rows rows (0: never) of bfloat16 x, each block
  // dequantized to bfloat16 and multiplied as bf16_matmul's weights: in AMX tiles (amx,
  // has_amx_tiles; where K is a multiple of 32, other K run the other paths) or by AVX512-BF16
  // dot products (has_bf16_dot_products), ahead of the others; gated and activation as
  // bf16_matmul's (bfloat16 x); needs AVX2 + FMA (has_bf16_matmul).
  m.def("quantized_matmul(Tensor x, Tensor packed, Tensor? row_scales, Tensor? groups, "
        "int group_size, int out_features, bool gated=False, Tensor? bias=None, "
        "int activation=-1, int sgemm_rows=0, int int8_rows=0, int bf16_rows=0, bool amx=False, "
        "Tensor(a!)? out=None) -> Tensor");
  // y [T, out] += the LoRA update of x [T, in] (y's dtype) by a_t [slots, in, R] and b [slots,
  // R, out] (float32), in float32: slot s for the tokens rows[s, :counts[s]] (int64); B's rank
  // rows of part p (R / parts each) reach only y's columns part_cols[p]..part_cols[p + 1].
  m.def("lora_add_(Tensor(a!) y, Tensor x, Tensor a_t, Tensor b, Tensor rows, Tensor counts, "
        "Tensor part_cols) -> ()");
}

TRITONLM_LIBRARY_IMPL(TORCH_EXTENSION_NAME, CPU, m) {
  using namespace tritonlm;
  m.impl("decode_attention", &decode_attention);
  m.impl("prefill_attention", &prefill_attention);
  m.impl("rms_norm", &rms_norm);
  m.impl("act_and_mul", &act_and_mul);
  m.impl("rotary_", &rotary_);
  m.impl("argmax_logsumexp", &argmax_logsumexp);
  m.impl("shortlist_argmax", &shortlist_argmax);
  m.impl("write_kv_", &write_kv_);
  m.impl("bf16_matmul", &bf16_matmul);
  m.impl("quantized_matmul", &quantized_matmul);
  m.impl("lora_add_", &lora_add_);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace tritonlm;
  m.def("bf16_dot_product_speedup", &bf16_dot_product_speedup,
        "float32 FLOPs per second of vdpbf16ps over FMAs on one core, each measured on independent "
        "accumulators (0 without AVX512-BF16): above 1, dot products multiply bf16 faster",
        py::call_guard<py::gil_scoped_release>());
  m.attr("has_bf16_matmul") = has_bf16_matmul();
  m.attr("vector_lanes") = vector_lanes();
  m.attr("has_bf16_dot_products") = has_bf16_dot_products();
  m.attr("has_amx_tiles") = has_amx_tiles();  // bf16 matmuls in AMX tiles
  m.def("multiplies_in_amx", &multiplies_in_amx,
        "whether bf16 products run in AMX tiles, given the way TRITONLM_BF16_MATMUL forces "
        "('' for none)");
  m.def("multiplies_by_bf16_dots", &multiplies_by_bf16_dots,
        "whether bf16 products outside AMX tiles run as AVX512-BF16 dot products rather than "
        "float32 FMAs on widened values, given the way TRITONLM_BF16_MATMUL forces ('' for none; "
        "measures the dot products' speed unless forced)",
        py::call_guard<py::gil_scoped_release>());
  m.attr("has_vnni_dot_products") = has_vnni_dot_products();  // int8 inputs: AVX512-VNNI
  m.attr("has_int4_quads") = has_int4_quads();  // 4-bit weights packed in quad rows
  bind_op_program(m);
}
