// LoRA updates of a step's tokens by the adapters in their slots (Punica's BGMV, on CPU):
// h = A_s x_t (R values), then y_t += B_s^T h, in float32, y rounded to its dtype once. For the
// few tokens of a decode step, where the batched matmuls of layers/lora.py cost more in launches
// than in arithmetic. Tokens come grouped by slot and go in blocks of kBlock, so that each load
// of A and B serves the whole block; a fused layer's B touches only its part's columns.
#include "cpu_vec.h"

#include <array>
#include <vector>

namespace tritonlm {
namespace {

constexpr int64_t kBlock = 4;

template <typename T>
void lora_blocks(at::Tensor& y, const at::Tensor& x, const at::Tensor& a_t, const at::Tensor& b,
                 const at::Tensor& rows, const at::Tensor& counts, const at::Tensor& part_cols) {
  const int64_t in = x.size(1), rank = a_t.size(2), out = y.size(1), width = rows.size(1);
  const int64_t parts = part_cols.numel() - 1, part_rank = rank / parts;
  const int64_t* row_of = rows.data_ptr<int64_t>();
  const int64_t* count = counts.data_ptr<int64_t>();
  const int64_t* cols = part_cols.data_ptr<int64_t>();
  std::vector<std::array<int64_t, 2>> tasks;  // (slot, first position in its group)
  for (int64_t s = 0; s < rows.size(0); ++s)
    for (int64_t j = 0; j < count[s]; j += kBlock) tasks.push_back({s, j});
  const float* a_data = a_t.data_ptr<float>();
  const float* b_data = b.data_ptr<float>();
  const T* x_data = x.data_ptr<T>();
  T* y_data = y.data_ptr<T>();
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> h(kBlock * rank);
    for (int64_t task = begin; task < end; ++task) {
      const auto [s, first] = tasks[task];
      const int64_t n_tokens = std::min(kBlock, count[s] - first);
      std::array<const T*, kBlock> xs;
      std::array<T*, kBlock> ys;
      for (int64_t j = 0; j < kBlock; ++j) {  // a short block repeats its first token, unstored
        const int64_t token = row_of[s * width + first + (j < n_tokens ? j : 0)];
        xs[j] = x_data + token * x.stride(0);
        ys[j] = y_data + token * y.stride(0);
      }
      const float* a = a_data + s * in * rank;  // [in, rank]
      for (int64_t r = 0; r < rank; r += W) {
        const int64_t n = std::min<int64_t>(W, rank - r);
        std::array<Vec, kBlock> acc{Vec(0.f), Vec(0.f), Vec(0.f), Vec(0.f)};
        for (int64_t i = 0; i < in; ++i) {
          const Vec column = Vec::loadu(a + i * rank + r, n);
          for (int64_t j = 0; j < kBlock; ++j)
            acc[j] = at::vec::fmadd(Vec(static_cast<float>(xs[j][i])), column, acc[j]);
        }
        for (int64_t j = 0; j < kBlock; ++j) acc[j].store(h.data() + j * rank + r, n);
      }
      const float* bs = b_data + s * rank * out;  // [rank, out]
      for (int64_t p = 0; p < parts; ++p) {
        for (int64_t o = cols[p]; o < cols[p + 1]; o += W) {
          const int64_t n = std::min<int64_t>(W, cols[p + 1] - o);
          std::array<Vec, kBlock> acc{Vec(0.f), Vec(0.f), Vec(0.f), Vec(0.f)};
          for (int64_t r = p * part_rank; r < (p + 1) * part_rank; ++r) {
            const Vec row = Vec::loadu(bs + r * out + o, n);
            for (int64_t j = 0; j < kBlock; ++j)
              acc[j] = at::vec::fmadd(Vec(h[j * rank + r]), row, acc[j]);
          }
          for (int64_t j = 0; j < n_tokens; ++j)
            store_float(ys[j] + o, load_float(ys[j] + o, n) + acc[j], n);
        }
      }
    }
  });
}

}  // namespace

void lora_add_(at::Tensor& y, const at::Tensor& x, const at::Tensor& a_t, const at::Tensor& b,
               const at::Tensor& rows, const at::Tensor& counts, const at::Tensor& part_cols) {
  const char* name = "lora_add_: ";
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1 && y.dim() == 2 &&
                  y.stride(1) == 1 && y.size(0) == x.size(0) && y.scalar_type() == x.scalar_type(),
              name, "x [T, in] and y [T, out] must be CPU rows of one dtype, got ", x.sizes(),
              " and ", y.sizes());
  TORCH_CHECK(a_t.is_contiguous() && b.is_contiguous() && a_t.scalar_type() == at::kFloat &&
                  b.scalar_type() == at::kFloat && a_t.dim() == 3 && b.dim() == 3 &&
                  a_t.size(0) == b.size(0) && a_t.size(1) == x.size(1) &&
                  a_t.size(2) == b.size(1) && b.size(2) == y.size(1),
              name, "a_t [slots, in, R] and b [slots, R, out] must be contiguous float32, got ",
              a_t.sizes(), " and ", b.sizes());
  TORCH_CHECK(rows.is_contiguous() && counts.is_contiguous() && part_cols.is_contiguous() &&
                  rows.scalar_type() == at::kLong && counts.scalar_type() == at::kLong &&
                  part_cols.scalar_type() == at::kLong && rows.dim() == 2 &&
                  rows.size(0) == a_t.size(0) && counts.numel() == rows.size(0) &&
                  part_cols.numel() >= 2 && a_t.size(2) % (part_cols.numel() - 1) == 0,
              name, "rows [slots, M], counts [slots] and part_cols [parts + 1] must be int64");
  const int64_t* row_of = rows.data_ptr<int64_t>();
  const int64_t* count = counts.data_ptr<int64_t>();
  for (int64_t s = 0; s < rows.size(0); ++s) {
    TORCH_CHECK(0 <= count[s] && count[s] <= rows.size(1), name, "slot ", s, " counts ",
                count[s], " tokens of ", rows.size(1));
    for (int64_t j = 0; j < count[s]; ++j)
      TORCH_CHECK(0 <= row_of[s * rows.size(1) + j] && row_of[s * rows.size(1) + j] < x.size(0),
                  name, "a token index of slot ", s, " is outside x");
  }
  const int64_t* cols = part_cols.data_ptr<int64_t>();
  for (int64_t p = 0; p + 1 < part_cols.numel(); ++p)
    TORCH_CHECK(0 <= cols[p] && cols[p] <= cols[p + 1] && cols[p + 1] <= y.size(1), name,
                "part_cols must ascend within y's ", y.size(1), " columns");
  dispatch_float_types(x.scalar_type(), name, [&](auto zero) {
    lora_blocks<decltype(zero)>(y, x, a_t, b, rows, counts, part_cols);
  });
}

}  // namespace tritonlm
