// Fused per-token layer ops for CPU: RMSNorm (with the residual add before it), the gated MLP's
// activation-times-up, rotary embeddings in place, and greedy argmax with the log-normaliser.
//
// Each equals the unfused PyTorch ops of Hugging Face's models: where those round an intermediate
// result to the model dtype (every bfloat16/float16 op does), the kernel rounds it too; the math
// runs in float32 as PyTorch's CPU kernels run it. One pass over each row instead of several
// full-tensor passes with a float32 copy between them.
#include "cpu_vec.h"

#include <cmath>
#include <limits>

namespace tritonlm {
namespace {

template <typename T>
void rms_norm_rows(const at::Tensor& x, const at::Tensor& weight, T* residual,
                   int64_t residual_stride, at::Tensor& out, float eps, bool offset) {
  const int64_t rows = x.size(0), H = x.size(1);
  const T* xp = x.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, elementwise_grain(H), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* src = xp + r * x.stride(0);
      Vec squares(0.f);
      if (residual != nullptr) {  // residual += x, rounded as HF's `residual + hidden_states`
        T* sum = residual + r * residual_stride;
        for (int64_t i = 0; i < H; i += W) {
          const int64_t n = std::min<int64_t>(W, H - i);
          const Vec h = rounded<T>(load_float(src + i, n) + load_float(sum + i, n));
          store_float(sum + i, h, n);
          squares = at::vec::fmadd(h, h, squares);
        }
        src = sum;
      } else {
        for (int64_t i = 0; i < H; i += W) {
          const Vec h = load_float(src + i, std::min<int64_t>(W, H - i));
          squares = at::vec::fmadd(h, h, squares);
        }
      }
      const Vec scale(1.f / std::sqrt(sum_lanes(squares) / static_cast<float>(H) + eps));
      T* dst = op + r * out.stride(0);
      for (int64_t i = 0; i < H; i += W) {
        const int64_t n = std::min<int64_t>(W, H - i);
        const Vec normed = load_float(src + i, n) * scale;
        const Vec w = load_float(wp + i, n);
        // Llama casts the normalised row to the dtype, then scales; Gemma scales by 1 + w first.
        store_float(dst + i, offset ? normed * (Vec(1.f) + w) : rounded<T>(normed) * w, n);
      }
    }
  });
}

template <typename T, int kAct>
void act_and_mul_rows(const at::Tensor& x, at::Tensor& out) {
  const int64_t rows = x.size(0), I = out.size(1);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, elementwise_grain(2 * I), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = xp + r * x.stride(0);
      const T* up = gate + I;
      T* dst = op + r * out.stride(0);
      for (int64_t i = 0; i < I; i += W) {
        const int64_t n = std::min<int64_t>(W, I - i);
        const Vec a = rounded<T>(activate<kAct>(load_float(gate + i, n)));
        store_float(dst + i, a * load_float(up + i, n), n);
      }
    }
  });
}

template <typename T>
void rotary_rows(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t tokens = x.size(0), heads = x.size(1), half = cos.size(1) / 2;
  T* xp = x.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  at::parallel_for(0, tokens * heads, elementwise_grain(2 * half), [&](int64_t begin, int64_t end) {
    for (int64_t index = begin; index < end; ++index) {
      const int64_t t = index / heads;
      T* p = xp + t * x.stride(0) + (index % heads) * x.stride(1);
      const T* c = cp + t * cos.stride(0);
      const T* s = sp + t * sin.stride(0);
      for (int64_t i = 0; i < half; i += W) {
        const int64_t n = std::min<int64_t>(W, half - i);
        const Vec a = load_float(p + i, n), b = load_float(p + half + i, n);
        // x * cos + rotate_half(x) * sin, each product rounded as HF's ops round it.
        const Vec low = rounded<T>(a * load_float(c + i, n)) -
                        rounded<T>(b * load_float(s + i, n));
        const Vec high = rounded<T>(b * load_float(c + half + i, n)) +
                         rounded<T>(a * load_float(s + half + i, n));
        store_float(p + i, low, n);
        store_float(p + half + i, high, n);
      }
    }
  });
}

template <typename T>
void argmax_logsumexp_rows(const at::Tensor& logits, int64_t* tokens, float* lse) {
  const int64_t rows = logits.size(0), V = logits.size(1);
  const T* lp = logits.data_ptr<T>();
  constexpr float kInf = std::numeric_limits<float>::infinity();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = lp + r * logits.stride(0);
      const int64_t full = V - V % W;
      Vec vmax(-kInf);
      for (int64_t i = 0; i < full; i += W) vmax = at::vec::maximum(vmax, load_float(row + i));
      float max = at::vec::vec_reduce_all<float>(
          [](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, vmax);
      for (int64_t i = full; i < V; ++i) {
        const float v = static_cast<float>(row[i]);
        max = (std::isnan(v) || v > max) ? v : max;
      }
      int64_t best = 0;
      if (std::isnan(max)) {  // torch.argmax picks the first NaN
        while (!std::isnan(static_cast<float>(row[best]))) ++best;
        tokens[r] = best;
        lse[r] = max;
        continue;
      }
      const Vec target(max);
      int64_t i = 0;
      for (; i < full; i += W) {  // the first index holding the maximum, as torch.argmax
        const int mask = (load_float(row + i) == target).zero_mask();
        if (mask != (1 << W) - 1) {
          best = i + __builtin_ctz(~mask);
          break;
        }
      }
      if (i >= full) {
        for (best = full; best < V && static_cast<float>(row[best]) != max; ++best) {}
      }
      tokens[r] = best;
      if (std::isinf(max)) {  // all -inf: -inf; any +inf: +inf (as torch.logsumexp)
        lse[r] = max;
        continue;
      }
      Vec sum(0.f);
      for (int64_t j = 0; j < full; j += W) sum = sum + (load_float(row + j) - target).exp();
      float total = sum_lanes(sum);
      for (int64_t j = full; j < V; ++j) total += std::exp(static_cast<float>(row[j]) - max);
      lse[r] = max + std::log(total);
    }
  });
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                    const std::optional<at::Tensor>& residual, bool offset,
                    const std::optional<at::Tensor>& out) {
  const char* name = "rms_norm: ";
  check_rows(x, name, "x");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type() && weight.device().is_cpu(),
              name, "weight must be a contiguous CPU [", x.size(1), "] of x's dtype ",
              x.scalar_type(), ", got ", weight.scalar_type(), " ", weight.sizes());
  const bool has_residual = residual.has_value() && residual->defined();
  if (has_residual) {
    check_rows(*residual, name, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(),
                name, "residual must match x (", x.scalar_type(), " ", x.sizes(), "), got ",
                residual->scalar_type(), " ", residual->sizes());
  }
  at::Tensor result = result_tensor(out, x.sizes(), x.options(), name);
  dispatch_float_types(x.scalar_type(), name, [&](auto zero) {
    using T = decltype(zero);
    rms_norm_rows<T>(x, weight, has_residual ? residual->data_ptr<T>() : nullptr,
                     has_residual ? residual->stride(0) : 0, result, static_cast<float>(eps),
                     offset);
  });
  return result;
}

at::Tensor act_and_mul(const at::Tensor& x, int64_t activation,
                       const std::optional<at::Tensor>& out) {
  const char* name = "act_and_mul: ";
  check_rows(x, name, "x");
  TORCH_CHECK(x.size(1) % 2 == 0, name, "x must hold gate then up features (an even count), got ",
              x.size(1));
  TORCH_CHECK(activation == 0 || activation == 1, name,
              "activation must be 0 (silu) or 1 (gelu, tanh approximation), got ", activation);
  at::Tensor result = result_tensor(out, {x.size(0), x.size(1) / 2}, x.options(), name);
  dispatch_float_types(x.scalar_type(), name, [&](auto zero) {
    using T = decltype(zero);
    if (activation == 0) act_and_mul_rows<T, 0>(x, result);
    else act_and_mul_rows<T, 1>(x, result);
  });
  return result;
}

void rotary_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const char* name = "rotary_: ";
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.stride(2) == 1, name,
              "x must be a CPU [tokens, heads, head_dim] with contiguous features, got ",
              x.sizes(), " strides ", x.strides());
  check_rows(cos, name, "cos");
  check_rows(sin, name, "sin");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(0) == x.size(0) &&
                  cos.size(1) % 2 == 0 && cos.size(1) <= x.size(2),
              name, "cos and sin must be [", x.size(0), ", an even rotary_dim <= ", x.size(2),
              "], got ", cos.sizes(), " and ", sin.sizes());
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(), name,
              "cos and sin must have x's dtype ", x.scalar_type());
  dispatch_float_types(x.scalar_type(), name, [&](auto zero) {
    rotary_rows<decltype(zero)>(x, cos, sin);
  });
}

std::tuple<at::Tensor, at::Tensor> argmax_logsumexp(const at::Tensor& logits) {
  const char* name = "argmax_logsumexp: ";
  check_rows(logits, name, "logits");
  TORCH_CHECK(logits.size(1) > 0, name, "logits must have at least one column");
  at::Tensor tokens = at::empty({logits.size(0)}, logits.options().dtype(at::kLong));
  at::Tensor lse = at::empty({logits.size(0)}, logits.options().dtype(at::kFloat));
  dispatch_float_types(logits.scalar_type(), name, [&](auto zero) {
    argmax_logsumexp_rows<decltype(zero)>(logits, tokens.data_ptr<int64_t>(),
                                          lse.data_ptr<float>());
  });
  return {tokens, lse};
}

}  // namespace tritonlm
