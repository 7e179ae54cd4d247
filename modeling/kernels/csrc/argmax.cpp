// The greedy token of every row of a step's logits. torch's argmax over the last dimension tracks an index beside
// every comparison, and over a step's [rows, vocabulary] logits took as long as the LM head that made them. Here a
// row is read once for its largest value, a vector at a time, then up to that value's first place. bfloat16 logits are read as they are (widening them is
// exact, so the token is the float32 logits' own).
#include "ops.h"

#include <limits>

namespace {

// The first index of row's largest value; a NaN counts as larger than any number (torch's argmax and max
// propagate it), so the first NaN's index when there is one.
template <typename T>
int64_t argmax_row(const T* row, int64_t width) {
  using specserve::to_float;
  int64_t i = 0;
  float top = -std::numeric_limits<float>::infinity();
  bool nan = false;
#if defined(__AVX512F__)
  __m512 tops = _mm512_set1_ps(top);
  __mmask16 unordered = 0;
  for (; i + 16 <= width; i += 16) {
    const __m512 v = specserve::Lanes16::load(row + i);
    unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    tops = _mm512_max_ps(tops, v);
  }
  nan = unordered != 0;
  top = _mm512_reduce_max_ps(tops);
#endif
  for (; i < width; ++i) {
    const float v = to_float(row[i]);
    nan = nan || v != v;
    top = v > top ? v : top;
  }
  if (nan) {
    for (int64_t j = 0; j < width; ++j) {
      if (to_float(row[j]) != to_float(row[j])) return j;
    }
  }
  // Every value is a number here, so the largest is in the row (-inf for a row of -infs, whose first it finds).
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512 wanted = _mm512_set1_ps(top);
  for (; j + 16 <= width; j += 16) {
    const __mmask16 found = _mm512_cmp_ps_mask(specserve::Lanes16::load(row + j), wanted, _CMP_EQ_OQ);
    if (found != 0) return j + __builtin_ctz(found);
  }
#endif
  for (; j < width; ++j) {
    if (to_float(row[j]) == top) return j;
  }
  return 0;  // a row of width 0 is refused before this
}

}  // namespace

at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu() && (logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16) &&
                  logits.dim() == 2 && logits.stride(1) == 1 && logits.size(1) > 0,
              "logits must be a float32 or bfloat16 CPU tensor [rows, width > 0] with contiguous rows");
  const int64_t rows = logits.size(0), width = logits.size(1), stride = logits.stride(0);
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  int64_t* best = out.data_ptr<int64_t>();
  if (logits.scalar_type() == at::kFloat) {
    const float* data = logits.data_ptr<float>();
    specserve::for_each_share(rows, [&](int64_t r) { best[r] = argmax_row(data + r * stride, width); });
  } else {
    const c10::BFloat16* data = logits.data_ptr<c10::BFloat16>();
    specserve::for_each_share(rows, [&](int64_t r) { best[r] = argmax_row(data + r * stride, width); });
  }
  return out;
}
