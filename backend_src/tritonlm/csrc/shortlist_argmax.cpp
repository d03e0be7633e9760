// Greedy tokens through a shortlist, for a draft model's head: each row's k best tokens by cheap
// logits (a 4-bit copy of the head, layers/shortlist_head.py), rescored exactly as hidden . head
// row; the best of them wins. One pass over the cheap logits picks the k with a running
// threshold, so only lanes above the k-th best so far are looked at one by one.
#include "cpu_vec.h"

#include <numeric>
#include <vector>

namespace tritonlm {
namespace {

// The k largest of row [V] (k <= V) into ids: a sorted list whose last value is the bar a lane
// must pass. NaN passes no bar; the first k ids start the list at -inf so every id is a token.
template <typename T>
void shortlist(const T* row, int64_t V, int64_t k, std::vector<int64_t>& ids,
               std::vector<float>& values) {
  std::iota(ids.begin(), ids.end(), 0);
  std::fill(values.begin(), values.end(), kNegInf);
  const auto offer = [&](float value, int64_t id) {
    if (!(value > values[k - 1])) return;
    int64_t at = k - 1;
    for (; at > 0 && value > values[at - 1]; --at) {
      values[at] = values[at - 1];
      ids[at] = ids[at - 1];
    }
    values[at] = value;
    ids[at] = id;
  };
  float lanes[W];
  const int64_t full = V - V % W;
  for (int64_t i = 0; i < full; i += W) {
    const Vec v = load_float(row + i);
    int above = ~(v > Vec(values[k - 1])).zero_mask() & ((1 << W) - 1);
    if (above == 0) continue;
    v.store(lanes);
    for (; above != 0; above &= above - 1) {
      const int lane = __builtin_ctz(above);
      offer(lanes[lane], i + lane);
    }
  }
  for (int64_t i = full; i < V; ++i) offer(static_cast<float>(row[i]), i);
}

template <typename T>
float dot(const T* a, const T* b, int64_t n) {
  Vec acc(0.f);
  for (int64_t i = 0; i < n; i += W) {
    const int64_t m = std::min<int64_t>(W, n - i);
    acc = at::vec::fmadd(load_float(a + i, m), load_float(b + i, m), acc);
  }
  return sum_lanes(acc);
}

template <typename T>
void shortlist_rows(const at::Tensor& approx, const at::Tensor& hidden, const at::Tensor& head,
                    int64_t k, int64_t* tokens) {
  const int64_t V = approx.size(1), D = hidden.size(1);
  const T* head_rows = head.data_ptr<T>();
  at::parallel_for(0, approx.size(0), 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> ids(k);
    std::vector<float> values(k);
    for (int64_t r = begin; r < end; ++r) {
      shortlist(approx.data_ptr<T>() + r * approx.stride(0), V, k, ids, values);
      const T* h = hidden.data_ptr<T>() + r * hidden.stride(0);
      int64_t best = -1;
      float best_score = 0.f;
      for (const int64_t id : ids) {  // the first id of the highest score, as torch.argmax
        const float score = dot(h, head_rows + id * D, D);
        if (best < 0 || score > best_score || (score == best_score && id < best)) {
          best = id;
          best_score = score;
        }
      }
      tokens[r] = best;
    }
  });
}

}  // namespace

at::Tensor shortlist_argmax(const at::Tensor& approx, const at::Tensor& hidden,
                            const at::Tensor& head, int64_t k) {
  const char* name = "shortlist_argmax: ";
  check_rows(approx, name, "approx");
  check_rows(hidden, name, "hidden");
  TORCH_CHECK(head.device().is_cpu() && head.dim() == 2 && head.is_contiguous(), name,
              "head must be a contiguous 2-D CPU tensor, got ", head.sizes());
  TORCH_CHECK(approx.size(0) == hidden.size(0) && approx.size(1) == head.size(0) &&
                  hidden.size(1) == head.size(1),
              name, "approx [S, V], hidden [S, D] and head [V, D] disagree: ", approx.sizes(),
              ", ", hidden.sizes(), ", ", head.sizes());
  TORCH_CHECK(approx.scalar_type() == hidden.scalar_type() &&
                  head.scalar_type() == hidden.scalar_type(),
              name, "approx, hidden and head must share a dtype, got ", approx.scalar_type(),
              ", ", hidden.scalar_type(), ", ", head.scalar_type());
  TORCH_CHECK(k > 0 && head.size(0) > 0, name, "k must be positive and the vocabulary not empty");
  at::Tensor tokens = at::empty({approx.size(0)}, approx.options().dtype(at::kLong));
  dispatch_float_types(approx.scalar_type(), name, [&](auto zero) {
    shortlist_rows<decltype(zero)>(approx, hidden, head, std::min(k, head.size(0)),
                                   tokens.data_ptr<int64_t>());
  });
  return tokens;
}

}  // namespace tritonlm
