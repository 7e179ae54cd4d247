// The elementwise parts of a decoder layer, fused: each replaces 3 to 8 torch ops whose
// per-op cost dominated the non-matmul time of a step. Each rounds where torch's bfloat16
// ops round (after every op) unless noted, so the fused model stays close to the plain one.
#include "ops.h"

#include <immintrin.h>

#include <type_traits>

#include <ATen/Parallel.h>

#include <vector>

namespace {

using specserve::exp_float;
using specserve::from_float;
using specserve::round_to;
using specserve::sum_of_squares;
using specserve::to_float;
#if defined(__AVX512F__)
using specserve::Lanes16;
#endif

// Rows per parallel task: small steps (a decode of a few sequences) stay on one thread.
constexpr int64_t kRowGrain = 8;

// work(begin, end) for blocks of kRowGrain rows, shared among the threads as specserve::for_each_share shares
// them (a thread held up by another process leaves its blocks to the others); each row is computed alone, so
// which thread takes it changes no bits.
template <typename Work>
void for_each_row_block(int64_t rows, const Work& work) {
  specserve::for_each_share((rows + kRowGrain - 1) / kRowGrain, [&](int64_t block) {
    work(block * kRowGrain, std::min(rows, (block + 1) * kRowGrain));
  });
}

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, " must be [rows, width] with contiguous rows");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, name, " must be float32 or bfloat16");
}

// out = weight * to_T(x * rsqrt(mean(x^2) + eps)), the statistics in float32 (as HF's LlamaRMSNorm; the squares
// summed in sum_of_squares' order). A float32 weight for a bfloat16 x is Gemma's convention instead: the product
// taken in float32 and rounded once, to_T(x * rsqrt(...) * weight).
template <typename T, typename W>
inline float normed(float x, float inverse, W weight) {
  if constexpr (std::is_same<W, float>::value && !std::is_same<T, float>::value) {
    return x * inverse * weight;
  } else {
    return to_float(weight) * round_to<T>(x * inverse);
  }
}

template <typename T, typename W>
void norm_row(const T* x, const W* weight, T* out, int64_t width, float eps) {
  const float inverse = 1.0f / std::sqrt(sum_of_squares(x, width) / static_cast<float>(width) + eps);
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 scale = _mm512_set1_ps(inverse);
  for (; i + 16 <= width; i += 16) {
    const __m512 v = _mm512_mul_ps(Lanes16::load(x + i), scale);
    if constexpr (std::is_same<W, float>::value && !std::is_same<T, float>::value) {
      Lanes16::store(out + i, _mm512_mul_ps(v, Lanes16::load(weight + i)));
    } else {
      Lanes16::store(out + i, _mm512_mul_ps(Lanes16::load(weight + i), Lanes16::round(v, out)));
    }
  }
#endif
  for (; i < width; ++i) out[i] = from_float<T>(normed<T>(to_float(x[i]), inverse, weight[i]));
}

// row = to_T(row + delta), element by element.
template <typename T>
void add_row(T* row, const T* delta, int64_t width) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= width; i += 16) Lanes16::store(row + i, _mm512_add_ps(Lanes16::load(row + i), Lanes16::load(delta + i)));
#endif
  for (; i < width; ++i) row[i] = from_float<T>(to_float(row[i]) + to_float(delta[i]));
}

template <typename T, typename W>
void norm_rows(at::Tensor* x, const at::Tensor* delta, const at::Tensor& weight, at::Tensor& out, float eps) {
  const int64_t rows = x->size(0), width = x->size(1);
  const int64_t x_stride = x->stride(0), delta_stride = delta ? delta->stride(0) : 0;
  T* x_data = x->data_ptr<T>();
  const T* delta_data = delta ? delta->data_ptr<T>() : nullptr;
  const W* w = weight.data_ptr<W>();
  T* out_data = out.data_ptr<T>();
  for_each_row_block(rows, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* row = x_data + r * x_stride;
      if (delta_data) add_row(row, delta_data + r * delta_stride, width);
      norm_row(row, w, out_data + r * width, width, eps);
    }
  });
}

at::Tensor norm_dispatch(at::Tensor* x, const at::Tensor* delta, const at::Tensor& weight, double eps) {
  check_rows(*x, "x");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x->size(1) && weight.is_contiguous() &&
                  (weight.scalar_type() == x->scalar_type() || weight.scalar_type() == at::kFloat),
              "weight must be contiguous [width] in x's dtype or float32");
  if (delta) {
    check_rows(*delta, "delta");
    TORCH_CHECK(delta->sizes() == x->sizes() && delta->scalar_type() == x->scalar_type(), "delta must match x");
  }
  at::Tensor out = at::empty(x->sizes(), x->options());
  if (x->scalar_type() == at::kFloat) {
    norm_rows<float, float>(x, delta, weight, out, static_cast<float>(eps));
  } else if (weight.scalar_type() == at::kFloat) {
    norm_rows<c10::BFloat16, float>(x, delta, weight, out, static_cast<float>(eps));
  } else {
    norm_rows<c10::BFloat16, c10::BFloat16>(x, delta, weight, out, static_cast<float>(eps));
  }
  return out;
}

// x * cos + rotate_half(x) * sin on the first num_heads heads of each row, rounding each
// product and the sum as torch does; cos and sin are [rows, head_dim] in x's dtype.
template <typename T>
void rope_rows(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads, int64_t dim) {
  const int64_t rows = qkv.size(0), stride = qkv.stride(0), half = dim / 2;
  T* data = qkv.data_ptr<T>();
  const T* cos_data = cos.data_ptr<T>();
  const T* sin_data = sin.data_ptr<T>();
  for_each_row_block(rows, [&](int64_t begin, int64_t end) {
    std::vector<float> head(dim);
    for (int64_t r = begin; r < end; ++r) {
      const T* c = cos_data + r * dim;
      const T* s = sin_data + r * dim;
      for (int64_t h = 0; h < num_heads; ++h) {
        T* x = data + r * stride + h * dim;
#if defined(__AVX512F__)
        if (half % 16 == 0) {  // 16 dimensions of each half at a time, both read before either is written
          for (int64_t i = 0; i < half; i += 16) {
            const __m512 low = Lanes16::load(x + i), high = Lanes16::load(x + half + i);
            const __m512 negated_high = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(high), _mm512_set1_epi32(INT32_MIN)));
            const __m512 new_low = _mm512_add_ps(Lanes16::round(_mm512_mul_ps(low, Lanes16::load(c + i)), x),
                                                 Lanes16::round(_mm512_mul_ps(negated_high, Lanes16::load(s + i)), x));
            const __m512 new_high = _mm512_add_ps(Lanes16::round(_mm512_mul_ps(high, Lanes16::load(c + half + i)), x),
                                                  Lanes16::round(_mm512_mul_ps(low, Lanes16::load(s + half + i)), x));
            Lanes16::store(x + i, new_low);
            Lanes16::store(x + half + i, new_high);
          }
          continue;
        }
#endif
        for (int64_t i = 0; i < dim; ++i) head[i] = to_float(x[i]);
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          x[i] = from_float<T>(round_to<T>(head[i] * to_float(c[i])) + round_to<T>(-head[i + half] * to_float(s[i])));
        }
#pragma omp simd
        for (int64_t i = half; i < dim; ++i) {
          x[i] = from_float<T>(round_to<T>(head[i] * to_float(c[i])) + round_to<T>(head[i - half] * to_float(s[i])));
        }
      }
    }
  });
}

// silu(g) * up, silu rounded to T, then the product rounded: one element.
template <typename T>
inline T silu_times(T gate, T up) {
  const float g = to_float(gate);
  return from_float<T>(round_to<T>(g / (1.0f + exp_float(-g))) * to_float(up));
}

// silu(gate) * up for each [gate | up] row: silu rounded, then the product rounded.
template <typename T>
void silu_mul_rows(const at::Tensor& gate_up, at::Tensor& out) {
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2, stride = gate_up.stride(0);
  const T* in = gate_up.data_ptr<T>();
  T* out_data = out.data_ptr<T>();
  for_each_row_block(rows, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = in + r * stride;
      const T* up = gate + width;
      T* o = out_data + r * width;
      int64_t i = 0;
#if defined(__AVX512F__)
      // 16 elements at a time, in the operations of exp_float (its exp_reduced) and silu_times, so their bits. The
      // compiler's vectorization of silu_times' loop spilled and masked, at about twice this loop's time.
      for (; i + 16 <= width; i += 16) {
        const __m512 g = Lanes16::load(gate + i);
        const __m512 e = specserve::exp_lanes<Lanes16>(_mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(g), _mm512_set1_epi32(INT32_MIN))));
        const __m512 silu = Lanes16::round(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), o);
        Lanes16::store(o + i, _mm512_mul_ps(silu, Lanes16::load(up + i)));
      }
#endif
      for (; i < width; ++i) o[i] = silu_times(gate[i], up[i]);
    }
  });
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  at::Tensor input = x;
  return norm_dispatch(&input, nullptr, weight, eps);
}

at::Tensor add_rms_norm_(at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight, double eps) {
  return norm_dispatch(&x, &delta, weight, eps);
}

void rope_(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads, int64_t head_dim) {
  check_rows(qkv, "qkv");
  TORCH_CHECK(head_dim % 2 == 0 && num_heads * head_dim <= qkv.size(1), "num_heads x head_dim does not fit a qkv row");
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->dim() == 2 && t->is_contiguous() && t->size(0) == qkv.size(0) && t->size(1) == head_dim &&
                    t->scalar_type() == qkv.scalar_type(),
                "cos and sin must be contiguous [rows, head_dim] in qkv's dtype");
  }
  if (qkv.scalar_type() == at::kFloat) {
    rope_rows<float>(qkv, cos, sin, num_heads, head_dim);
  } else {
    rope_rows<c10::BFloat16>(qkv, cos, sin, num_heads, head_dim);
  }
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up's width must be even");
  at::Tensor out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  if (gate_up.scalar_type() == at::kFloat) {
    silu_mul_rows<float>(gate_up, out);
  } else {
    silu_mul_rows<c10::BFloat16>(gate_up, out);
  }
  return out;
}
