// The CPU kernels of modeling/native.py: declarations and the scalar helpers they share.
#pragma once

// ATen's own headers, not torch/extension.h (pybind11 and the C++ frontend: module.cpp alone needs
// those): each source file compiles in a third of the time.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <atomic>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "team.h"

namespace pybind11 {
class module_;
}  // namespace pybind11

namespace specserve {

inline float to_float(float x) { return x; }

inline float to_float(c10::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// The bfloat16 nearest to x (ties to even; NaN stays NaN), as torch rounds, in a form the
// compiler vectorizes (c10's conversion branches).
inline uint16_t bf16_bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return (bits & 0x7FFFFFFFu) > 0x7F800000u ? static_cast<uint16_t>(0x7FC0u) : static_cast<uint16_t>(rounded);
}

template <typename T>
inline T from_float(float x);

template <>
inline float from_float<float>(float x) {
  return x;
}

template <>
inline c10::BFloat16 from_float<c10::BFloat16>(float x) {
  return c10::BFloat16(bf16_bits(x), c10::BFloat16::from_bits());
}

// x rounded to T and back, as torch rounds the result of every bfloat16 op.
template <typename T>
inline float round_to(float x) {
  return to_float(from_float<T>(x));
}

// Cephes' range reduction and degree-6 polynomial for exp(x), x already clamped to [-87, 88], on a
// float or on a vector of floats (GCC's vector operators, a float operand broadcast): returns
// p ~ exp(x - n ln 2), with n, the nearest integer to x / ln 2, in `n`. Each operation rounds by
// itself (ISO C++ builds do not fuse a multiply and an add), so both give the same bits.
template <typename V>
inline V exp_reduced(V x, V& n) {
  // Adding and taking away 1.5 x 2^23 rounds a float to an integer. Built without -ffast-math, so kept as written.
  n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  V r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  V p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return p * r * r + r + 1.0f;
}

// exp(x) in a form the compiler vectorizes: exp_reduced times 2^n, within 2 ulp of expf over
// [-87, 88] (clamped outside it).
#pragma omp declare simd
inline float exp_float(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);  // min and max, not branches: the loops around it vectorize
  float n;
  const float p = exp_reduced(x, n);
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

#if defined(__AVX2__) && defined(__FMA__)
// A float vector's operations, for code written once for 8 lanes (AVX2) and 16 (AVX512); bfloat16 loads widen
// exactly.
struct Lanes8 {
  using V = __m256;
  static constexpr int64_t kLanes = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V min(V a, V b) { return _mm256_min_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load(const c10::BFloat16* p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  static V load_aligned(const float* p) { return _mm256_load_ps(p); }
  static void store_aligned(float* p, V v) { _mm256_store_ps(p, v); }
  static V pow2(V n) {  // 2^n for whole n in range, from its bits
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23));
  }
};
#endif

#if defined(__AVX512F__)
struct Lanes16 {
  using V = __m512;
  static constexpr int64_t kLanes = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V min(V a, V b) { return _mm512_min_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load(const c10::BFloat16* p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  static V load_aligned(const float* p) { return _mm512_load_ps(p); }
  static void store_aligned(float* p, V v) { _mm512_store_ps(p, v); }
  static V pow2(V n) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23));
  }

  // bf16_bits of each lane, in 32-bit lanes, in bf16_bits' operations.
  static __m512i bf16_bits_wide(V v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF)),
                                                  _mm512_set1_epi32(0x7F800000));
    return _mm512_mask_blend_epi32(nan, rounded, _mm512_set1_epi32(0x7FC0));
  }
  // bf16_bits of each lane, packed. AVX512-BF16's conversion rounds a lane as bf16_bits does unless it is a NaN
  // (its payload kept) or subnormal (made a zero); lanes like that, rare in a model's activations, are made
  // again in bf16_bits' operations, so the bits are the same with the instruction or without it.
  static __m256i bf16_bits(V v) {
#if defined(__AVX512BF16__)
    const __m256i fast = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
    constexpr int kNanOrSubnormal = 0x01 | 0x20 | 0x80;  // vfpclassps: quiet NaN, subnormal, signalling NaN
    const __mmask16 odd = _mm512_fpclass_ps_mask(v, kNanOrSubnormal);
    if (__builtin_expect(odd == 0, 1)) return fast;
    return _mm256_mask_blend_epi16(odd, fast, _mm512_cvtepi32_epi16(bf16_bits_wide(v)));
#else
    return _mm512_cvtepi32_epi16(bf16_bits_wide(v));
#endif
  }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static void store(c10::BFloat16* p, V v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_bits(v)); }
  // Each lane rounded to T and back, as round_to<T>.
  static V round(V v, const float*) { return v; }
  static V round(V v, const c10::BFloat16*) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_bits(v)), 16));
  }
};
#endif

// Eight lanes' sums added in one tree, ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)): the last step of every sum whose
// order the kernels write out.
inline float sum_lane_tree(const float* lanes) {
  return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}

// The sum of x[i] * x[i] over a row, in an order written out: 8 sums, the i-th square added to sum i % 8 in
// turn for the row's whole blocks of 8, then the 8 in a tree, then the last few squares one by one. Every build,
// with AVX512 or without, adds them in that order, so gives the same bits.
template <typename T>
inline float sum_of_squares(const T* x, int64_t width) {
  const int64_t blocks = width / 8 * 8;
  int64_t i = 0;
  float sums[8] = {};
#if defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
  __m256 lanes = _mm256_setzero_ps();
  for (; i + 16 <= blocks; i += 16) {
    const __m512 v = Lanes16::load(x + i);
    const __m512 squares = _mm512_mul_ps(v, v);
    lanes = _mm256_add_ps(lanes, _mm512_castps512_ps256(squares));
    lanes = _mm256_add_ps(lanes, _mm512_extractf32x8_ps(squares, 1));
  }
  for (; i < blocks; i += 8) {
    const __m256 v = Lanes8::load(x + i);
    lanes = _mm256_add_ps(lanes, _mm256_mul_ps(v, v));
  }
  _mm256_storeu_ps(sums, lanes);
#else
  for (; i < blocks; i += 8) {
    for (int64_t j = 0; j < 8; ++j) {
      const float v = to_float(x[i + j]);
      sums[j] = sums[j] + v * v;
    }
  }
#endif
  float total = sum_lane_tree(sums);
  for (; i < width; ++i) {
    const float v = to_float(x[i]);
    total = total + v * v;
  }
  return total;
}

// exp_float of each lane (Lanes8, Lanes16), in its operations (exp_reduced, then 2^n from n's bits), so its bits.
template <typename L>
inline typename L::V exp_lanes(typename L::V x) {
  x = L::min(L::set1(88.0f), L::max(L::set1(-87.0f), x));  // NaN stays, as in exp_float
  typename L::V n;
  const typename L::V p = exp_reduced(x, n);
  return L::mul(p, L::pow2(n));
}

// work(i, next) for i = 0 .. count - 1 on the call's team (team.h), one `work` made by make_work() for each thread
// (its buffers, its state between items): each thread takes the items of its own contiguous share in order, then
// helps with the others' shares from where they stand; `next` is the item after i in i's share (-1 past its end),
// the one this thread takes next unless another takes it first. A thread reading one stream in order reads it at
// about twice the pace of pieces taken in turn with another thread (docs/benchmarks.md). A helper the OS has not run by the
// time the others reach its share never gets it: they do it, and the call returns without waiting for that helper.
template <typename MakeWork>
void for_each_share_with(int64_t count, const MakeWork& make_work) {
  const int64_t shares = std::min<int64_t>(team_threads(), count);
  if (shares <= 0) return;
  if (shares == 1 || in_team_work() || at::in_parallel_region()) {  // one share (a one-row step's elementwise ops)
    c10::ParallelGuard guard(true);  // as parallel_for runs a range it does not split
    auto work = make_work();
    for (int64_t item = 0; item < count; ++item) work(item, item + 1 < count ? item + 1 : -1);
    return;
  }
  // Each share's counter on a cache line of its own: where two shared one, every item a thread took moved the line
  // from the other core, and items as short as one row's Q4_1 panel waited on it.
  struct alignas(64) Counter {
    std::atomic<int64_t> value;
  };
  std::vector<Counter> counters(static_cast<size_t>(shares));
  const auto next = [&](int64_t s) -> std::atomic<int64_t>& { return counters[static_cast<size_t>(s)].value; };
  for (int64_t s = 0; s < shares; ++s) next(s).store(s * count / shares, std::memory_order_relaxed);
  run_with_team(shares, [&](int64_t slot) {
    std::optional<decltype(make_work())> work;  // made at this thread's first item: a helper that came late makes none
    for (int64_t i = 0; i < shares; ++i) {
      const int64_t s = (slot + i) % shares, end = (s + 1) * count / shares;
      for (int64_t item; (item = next(s).fetch_add(1, std::memory_order_relaxed)) < end;) {
        if (!work) work.emplace(make_work());
        (*work)(item, item + 1 < end ? item + 1 : -1);
      }
    }
  });
}

// work(i) for i = 0 .. count - 1, shared among the threads as for_each_share_with shares them.
template <typename Work>
void for_each_share(int64_t count, const Work& work) {
  for_each_share_with(count, [&] { return [&](int64_t item, int64_t) { work(item); }; });
}

// for (begin, end) over [0, count) in ranges of `grain` (the last shorter), shared as for_each_share shares items.
template <typename Body>
void for_each_range(int64_t count, int64_t grain, const Body& body) {
  const int64_t ranges = (count + grain - 1) / grain;
  for_each_share(ranges, [&](int64_t range) { body(range * grain, std::min(count, (range + 1) * grain)); });
}

}  // namespace specserve

at::Tensor attend(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& tables,
                  const at::Tensor& rows, const at::Tensor& positions, double scale, const c10::optional<at::Tensor>& firsts,
                  const std::string& path = "");
at::Tensor attend_tree(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& tables,
                       const at::Tensor& rows, const at::Tensor& positions, const at::Tensor& extra, double scale,
                       const c10::optional<at::Tensor>& firsts, const std::string& path = "");
std::vector<std::string> attention_paths();
std::string attention_path_for(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, const std::string& path = "");
void store(const at::Tensor& k, const at::Tensor& v, at::Tensor& keys, at::Tensor& values, const at::Tensor& pages,
           const at::Tensor& offsets);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor add_rms_norm_(at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight, double eps);
void rope_(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads, int64_t head_dim);
at::Tensor silu_mul(const at::Tensor& gate_up);
at::Tensor argmax_rows(const at::Tensor& logits);
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t num_out, const c10::optional<at::Tensor>& bias,
                  const std::string& path);
at::Tensor linear_blocks(const at::Tensor& x, const at::Tensor& packed, int64_t num_out,
                         const c10::optional<at::Tensor>& bias, const std::string& format, const std::string& path);
int64_t linear_block_bytes(const std::string& format);
at::Tensor block_rows(const at::Tensor& packed, const at::Tensor& ids, const std::string& format);
int64_t linear_panel_width();
std::vector<std::string> linear_paths();
void bind_decoder_stack(pybind11::module_& m);
