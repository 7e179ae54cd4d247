// y = x @ W^T (+ b) with every row computed exactly as it would be alone: the model's
// linear layers on CPU.
//
// Library GEMMs (oneDNN, MKL) pick their blocking, and with it the order in which they
// sum, by the number of rows, so a row's result depends on how many other rows share the
// step. Here each output element is one chain of fused multiply-adds over k = 0, 1, ...,
// K-1 in that order, started from zero, whatever the tile, the thread or the number of
// rows; the bias is added after the chain. Tiles differ only in how many rows and column
// panels they hold in registers at once, never in the order of a sum, so a row's bits do
// not depend on the step it is in (modeling/invariance.py checks it at start-up).
//
// The weight is packed once into column panels of kPanel outputs: [panels, K, kPanel], the
// last panel padded with zero columns (the AMX path's bfloat16 panels hold each pair of rows k,
// k + 1 as [kPanel, 2], the layout its tiles read). Weights are float32 or bfloat16; bfloat16 is
// widened to float32 as it is loaded (exactly), so both sum in float32.
//
// Or the weight is a GGUF file's own quantized blocks (Q4_1, Q8_0: 32 consecutive k of one
// output each), regrouped by modeling/cpu_kernels.py into panels of blocks: for panel p and
// block b, the kPanel outputs' float16 scales (d, then m for Q4_1) followed by their quants
// for each of the block's 32 k, [k][kPanel] (Q8_0: one int8 each; Q4_1: 8 bytes, byte j
// holding output j in its low nibble and output j + 8 in its high one, in fours of k: for
// k = 4u + t, t = 0 or 1, byte j of k then byte j of k + 2, for j = 0, 1, ...; so 16-bit word 2j + t
// holds the quants of outputs j and j + 8 at k and k + 2, four nibbles that shifts and masks
// widen in place, no shuffle across the vector's halves). Q4_K's sub-blocks of
// 32 take Q4_1's layout with float32 scales: d * sc and -(dmin * m), products gguf rounds to
// float32 (modeling/quantized.py computes them as it regroups). The weights stay in their
// blocks: no dequantized copy is ever held in memory. Each row's inputs are rounded to 16
// bits per block of 32 k (QuantizedRows: int16 quants and a float32 scale, |error| at most
// half a step of the block's largest |x| / 32767), each block's products are summed as exact
// integers (two quants by two inputs per instruction), and the blocks' sums are scaled and
// chained in float32 in block order (csrc/linear_blocks.h). A row's result is a function of
// that row alone, as above; it differs from the float32 sums over gguf's dequantized weights
// by the inputs' rounding, at most a 65534th of each block's largest |x| times the weights'
// absolute sum, and by float32's own.
//
// One build holds the tiles for every instruction set (AMX for bfloat16 weights, AVX512F and
// AVX2 with FMA for float32 and bfloat16 weights, AVX512 VNNI and AVX2 for blocks, and plain C++
// for both), each compiled for its own set; the paths a CPU has are found when the module loads,
// by asking it (`linear_paths`), and a caller names one (the AVX512VNNI path reads float32 and
// bfloat16 with the AVX512F tiles, the AVX512F path reads blocks with the AVX2 tiles).
// All of them give the same bits (a fused multiply-add rounds once, whatever computes it, and
// integer sums are exact) but two, for bfloat16 weights, batch invariant all the same: AMX tiles
// sum in an order of their own (see namespace amx), and AVX512-BF16's vdpbf16ps reads inputs
// below float32's normal range as zero and writes such sums as zero (cpu_kernels.same_bits).
#include "ops.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <immintrin.h>
#define SPECSERVE_X86 1
#endif
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

using specserve::for_each_share;

// tile.template operator()<rows>() for a `rows` of 1 to kMax known when compiled: the tiles hold their rows' sums in
// registers, so each row count is a function of its own.
template <int kMax, int kRows = 1, typename Tile>
void with_rows(int rows, const Tile& tile) {
  if constexpr (kRows <= kMax) {
    if (rows == kRows) return tile.template operator()<kRows>();
    return with_rows<kMax, kRows + 1>(rows, tile);
  }
}

constexpr int kPanel = 16;         // outputs per packed column panel
constexpr int64_t kDepthBlock = 256;  // k per pass over the rows: a float32 panel's block is 16 KiB
constexpr int64_t kQuantBlock = 32;   // k per GGUF block (Q4_1, Q8_0)

enum class WeightFormat { kFloat32, kBFloat16, kQ4_1, kQ8_0, kQ4_K };

// Bytes of one panel's block of kQuantBlock k: its scales, then its quants.
constexpr int64_t q4_bytes(int scale_bytes) { return 2 * scale_bytes * kPanel + kQuantBlock * kPanel / 2; }
constexpr int64_t kQ4_1Bytes = q4_bytes(2);                        // 320: float16 d and m
constexpr int64_t kQ4_KBytes = q4_bytes(4);                        // 384: float32 d and m
constexpr int64_t kQ8_0Bytes = 2 * kPanel + kQuantBlock * kPanel;  // 544

// A block tile asks for the lines kBlocksAhead bytes past each block it reads: the rest of its panel, then the next
// panels, which its thread takes next, and past a weight's end the next weight's first (the blocks lie in the order a
// step reads them). With the hardware's own prefetcher alone, one-row steps took up to a quarter longer; anywhere
// from 5 to 10 KB ahead serves as well.
constexpr int64_t kBlocksAhead = 8192;

template <int64_t kBytes>
inline void prefetch_block_ahead(const uint8_t* block) {
  const char* ahead = reinterpret_cast<const char*>(block) + kBlocksAhead;
#pragma GCC unroll 16
  for (int64_t at = 0; at < kBytes; at += 64) __builtin_prefetch(ahead + at, 0, 3);  // the next block, the rest
}

// An IEEE float16 (a GGUF scale) as float32, exactly.
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1Fu;
  uint32_t mantissa = h & 0x3FFu;
  uint32_t bits;
  if (exponent == 0x1Fu) {
    bits = sign | 0x7F800000u | (mantissa << 13);  // infinity or NaN
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: normalise it
    int shift = 0;
    while (!(mantissa & 0x400u)) {
      mantissa <<= 1;
      ++shift;
    }
    bits = sign | static_cast<uint32_t>(113 - shift) << 23 | ((mantissa & 0x3FFu) << 13);
  }
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// One call's operands: x as contiguous float32 rows and the output (the weight is the panels' business).
template <typename T>
struct LinearCall {
  const float* x;  // [num_rows, depth]; null for the dot-product tiles, which read x16 alone (an even depth), and
                   // for blocks, whose tiles read the rows' quants (QuantizedRows)
  int64_t num_rows, depth;
  int64_t num_out;
  const T* bias;  // [num_out] or null
  T* y;           // [num_rows, num_out]
  const c10::BFloat16* x16 = nullptr;  // the same rows as contiguous bfloat16, for bfloat16 rows and weights

  // Rows of sums `sums` ([num_rows, width], from column `first`) plus the bias, rounded to T.
  // Each row's loop is one with the bias and one without, so that the compiler vectorizes both (else it converts
  // element by element).
  // `rows_end` - `rows_begin` rows of sums (default: all the call's) from row `rows_begin`.
  void store(const float* sums, int64_t first, int64_t width, int64_t rows_begin = 0, int64_t rows_end = -1) const {
    const int64_t count = std::min(width, num_out - first);
    for (int64_t r = rows_begin; r < (rows_end < 0 ? num_rows : rows_end); ++r) {
      const float* in = sums + (r - rows_begin) * width;
      T* out = y + r * num_out + first;
      if (bias == nullptr) {
#pragma omp simd
        for (int64_t c = 0; c < count; ++c) out[c] = specserve::from_float<T>(in[c]);
      } else {
        const T* add = bias + first;
#pragma omp simd
        for (int64_t c = 0; c < count; ++c) out[c] = specserve::from_float<T>(in[c] + specserve::to_float(add[c]));
      }
    }
  }
};

// A block format's rows as the block tiles read them: each block of 32 k of a row rounded to int16
// quants of one float32 scale, x ~ scale * quant, the largest |x| of the block becoming 32767.
struct QuantizedRows {
  const int16_t* quants;  // [num_rows, depth]
  const float* scales;    // [num_rows, depth / 32]
  const int32_t* sums;    // [num_rows, depth / 32]: the sum of each block's quants
  int64_t depth;
};

// Rounds one block of 32 inputs into quants, a scale and the quants' sum (shaped as QuantizedRows says), by
// itself: the same bits whatever the other rows. A block with an infinite or NaN input keeps that as its scale and
// zero quants, so its outputs come out NaN, as float32 sums would.
void quantize_block(const float* in, int16_t* out, float* scale, int32_t* sum) {
  float largest = 0.0f;
  bool nan = false;
  for (int64_t i = 0; i < kQuantBlock; ++i) {
    largest = std::max(largest, std::fabs(in[i]));
    nan = nan || std::isnan(in[i]);
  }
  const float step = 32767.0f / largest;
  int32_t total = 0;
  if (nan || !std::isfinite(largest) || largest == 0.0f || !std::isfinite(step)) {
    // NaN, infinity or zero: zero quants and that as the scale. A largest so small (subnormal) that its step
    // overflows float32 rounds to zero too: at most 2^-126 of the weights' sum.
    std::fill(out, out + kQuantBlock, int16_t{0});
    *scale = nan ? std::numeric_limits<float>::quiet_NaN() : std::isfinite(largest) ? 0.0f : largest;
  } else {
    for (int64_t i = 0; i < kQuantBlock; ++i) {
      const float quant = std::nearbyint(in[i] * step);  // |quant| <= 32767.5 rounds within int16
      out[i] = static_cast<int16_t>(std::min(32767.0f, std::max(-32767.0f, quant)));
      total += out[i];
    }
    *scale = largest / 32767.0f;
  }
  *sum = total;
}

// A buffer of this thread's, kept for its next call: no allocation per call (a decode step makes hundreds).
template <typename T>
T* thread_scratch(size_t count) {
  static thread_local std::vector<T> buffer;
  if (buffer.size() < count) buffer.resize(count);
  return buffer.data();
}

#ifdef SPECSERVE_X86
#pragma GCC push_options
#pragma GCC target("avx512f")
namespace avx512f {
constexpr int kLanes = 16;
constexpr int kAccumulators = 24;  // of 32 vector registers
using Vec = __m512;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vbroadcast(const float* p) { return _mm512_set1_ps(*p); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vload(const c10::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
#include "linear_tiles.h"

// quantize_block in two vectors, for a block of finite inputs that are not all zero (false for any other, which
// the scalar code takes): the same operations, each rounding as the scalar one does, so the same bits. The scalar
// loops cost about 2% of a one-row step, run by the calling thread alone. bfloat16 inputs are widened in the
// vectors (exactly): widened into a buffer and loaded back, each load waited for the stores it overlapped.
template <typename T>
inline bool quantize_block(const T* in, int16_t* out, float* scale, int32_t* sum) {
  const __m512 a = vload(in), b = vload(in + kLanes);
  if ((_mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(b, b, _CMP_UNORD_Q)) != 0) return false;
  const float largest = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const float step = 32767.0f / largest;
  if (!std::isfinite(largest) || largest == 0.0f || !std::isfinite(step)) return false;
  const __m512 steps = _mm512_set1_ps(step), low = _mm512_set1_ps(-32767.0f), high = _mm512_set1_ps(32767.0f);
  const auto quants = [&](__m512 v) {
    const __m512 nearest = _mm512_roundscale_ps(_mm512_mul_ps(v, steps), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm512_cvtps_epi32(_mm512_min_ps(high, _mm512_max_ps(low, nearest)));
  };
  const __m512i first = quants(a), second = quants(b);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(first));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + kLanes), _mm512_cvtepi32_epi16(second));
  *sum = _mm512_reduce_add_epi32(_mm512_add_epi32(first, second));
  *scale = largest / 32767.0f;
  return true;
}
}  // namespace avx512f
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
constexpr int kLanes = 8;
constexpr int kAccumulators = 12;  // of 16 vector registers
using Vec = __m256;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vbroadcast(const float* p) { return _mm256_broadcast_ss(p); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vload(const c10::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec vload_half(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
template <int kScaleBytes>
inline Vec vload_scales(const uint8_t* p) {
  if constexpr (kScaleBytes == 2) return vload_half(p);
  return vload(reinterpret_cast<const float*>(p));
}
inline Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
using IVec = __m256i;
using WVec = __m256i;
using XPair = __m256i;
inline IVec ivzero() { return _mm256_setzero_si256(); }
inline IVec imadd(IVec sums, WVec w, XPair x) { return _mm256_add_epi32(sums, _mm256_madd_epi16(w, x)); }
inline IVec iadd(IVec a, IVec b) { return _mm256_add_epi32(a, b); }
inline Vec vcvt(IVec v) { return _mm256_cvtepi32_ps(v); }
// Two inputs of a row, as the pairs' tiles take them: x[k] and x[k + 1] in each 32-bit lane.
inline XPair inputs_of_pair(const int16_t* p) {
  int32_t both;
  std::memcpy(&both, p, sizeof(both));
  return _mm256_set1_epi32(both);
}
template <int kScaleBytes>  // 2: Q4_1's float16 scales; 4: Q4_K's sub-blocks, float32
struct Q4Pairs {
  static constexpr int64_t kBytes = q4_bytes(kScaleBytes);
  // Four k (32 bytes, 16 words of 4 nibbles) are widened to 4 vectors of 16-bit lanes: the pair
  // k = 4u, 4u + 1 for outputs 0-7 (bits 0-3 of each word) and 8-15 (bits 4-7), then the pair
  // 4u + 2, 4u + 3 (bits 8-11 and 12-15).
  const uint8_t* block;
  Q4Pairs() = default;
  explicit Q4Pairs(const uint8_t* at) : block(at) {}
  // The scales of outputs 0-7 (h = 0) or 8-15: read once the block's sums are done, not held in
  // registers through them (the tiles' sums need every register).
  Vec d(int h) const { return vload_scales<kScaleBytes>(block + kScaleBytes * kLanes * h); }
  Vec m(int h) const { return vload_scales<kScaleBytes>(block + kScaleBytes * (kPanel + kLanes * h)); }
  void load(int64_t quad, WVec* w) const {
    const uint8_t* q = block + 2 * kScaleBytes * kPanel;
    const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 2 * quad * kPanel));
    const __m256i mask = _mm256_set1_epi16(0x0F);
    w[0] = _mm256_and_si256(words, mask);
    w[1] = _mm256_and_si256(_mm256_srli_epi16(words, 4), mask);
    w[2] = _mm256_and_si256(_mm256_srli_epi16(words, 8), mask);
    w[3] = _mm256_srli_epi16(words, 12);
  }
};
using Q4_1Pairs = Q4Pairs<2>;
using Q4_KPairs = Q4Pairs<4>;
struct Q8_0Pairs {
  static constexpr int64_t kBytes = kQ8_0Bytes;
  const uint8_t* block;
  Q8_0Pairs() = default;
  explicit Q8_0Pairs(const uint8_t* at) : block(at) {}
  Vec d(int h) const { return vload_half(block + 2 * kLanes * h); }
  static Vec m(int) { return vzero(); }
  // The pairs of k 4u, 4u + 1 and 4u + 2, 4u + 3, each as outputs 0-7 and 8-15.
  void load(int64_t quad, WVec* w) const {
    const uint8_t* q = block + 2 * kPanel;
    for (int64_t pair = 0; pair < 2; ++pair) {
      const int64_t step = 2 * quad + pair;
      const __m128i first = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 2 * step * kPanel));
      const __m128i second = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + (2 * step + 1) * kPanel));
      w[2 * pair] = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(first, second));
      w[2 * pair + 1] = _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(first, second));
    }
  }
};
#include "linear_tiles.h"
constexpr int kBlockSums = 8;  // of 16 vector registers
constexpr int kVectorRegisters = 16;
#include "linear_blocks.h"

// quantize_block in four vectors, as avx512f::quantize_block does it in two: the same operations, each rounding as
// the scalar one does, so the same bits; false for a block the scalar code must take.
template <typename T>
inline bool quantize_block(const T* in, int16_t* out, float* scale, int32_t* sum) {
  __m256 v[4];
  for (int i = 0; i < 4; ++i) v[i] = vload(in + i * kLanes);
  const __m256 unordered = _mm256_or_ps(_mm256_or_ps(_mm256_cmp_ps(v[0], v[0], _CMP_UNORD_Q),
                                                     _mm256_cmp_ps(v[1], v[1], _CMP_UNORD_Q)),
                                        _mm256_or_ps(_mm256_cmp_ps(v[2], v[2], _CMP_UNORD_Q),
                                                     _mm256_cmp_ps(v[3], v[3], _CMP_UNORD_Q)));
  if (_mm256_movemask_ps(unordered) != 0) return false;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 top = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                             _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
  top = _mm256_max_ps(top, _mm256_permute2f128_ps(top, top, 1));
  top = _mm256_max_ps(top, _mm256_shuffle_ps(top, top, _MM_SHUFFLE(1, 0, 3, 2)));
  top = _mm256_max_ps(top, _mm256_shuffle_ps(top, top, _MM_SHUFFLE(2, 3, 0, 1)));
  const float largest = _mm256_cvtss_f32(top);
  const float step = 32767.0f / largest;
  if (!std::isfinite(largest) || largest == 0.0f || !std::isfinite(step)) return false;
  const __m256 steps = _mm256_set1_ps(step), low = _mm256_set1_ps(-32767.0f), high = _mm256_set1_ps(32767.0f);
  __m256i q[4];
  for (int i = 0; i < 4; ++i) {
    const __m256 nearest = _mm256_round_ps(_mm256_mul_ps(v[i], steps), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    q[i] = _mm256_cvtps_epi32(_mm256_min_ps(high, _mm256_max_ps(low, nearest)));
  }
  // packs interleaves the two inputs' 128-bit halves: 64-bit lanes 0, 2, 1, 3 put them back in order.
  for (int i = 0; i < 2; ++i) {
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2 * i], q[2 * i + 1]), _MM_SHUFFLE(3, 1, 2, 0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 2 * i * kLanes), packed);
  }
  __m256i total = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
  __m128i half = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  half = _mm_add_epi32(half, _mm_shuffle_epi32(half, _MM_SHUFFLE(1, 0, 3, 2)));
  half = _mm_add_epi32(half, _mm_shuffle_epi32(half, _MM_SHUFFLE(2, 3, 0, 1)));
  *sum = _mm_cvtsi128_si32(half);
  *scale = largest / 32767.0f;
  return true;
}
}  // namespace avx2
#pragma GCC pop_options

// Blocks on CPUs with AVX512 VNNI: a panel's 16 outputs in one vector of each kind, and each pair of
// quants times its inputs added to the sums in one instruction (vpdpwssd: the same exact integers
// as pmaddwd then paddd). Float32 and bfloat16 weights take the AVX512F tiles.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vnni,avx2,fma,f16c")
namespace avx512vnni {
constexpr int kLanes = 16;
constexpr int kVecs = kPanel / kLanes;
constexpr int kBlockSums = 8;  // of 32 vector registers
constexpr int kVectorRegisters = 32;
using Vec = __m512;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vbroadcast(const float* p) { return _mm512_set1_ps(*p); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec vload_half(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
template <int kScaleBytes>
inline Vec vload_scales(const uint8_t* p) {
  if constexpr (kScaleBytes == 2) return vload_half(p);
  return vload(reinterpret_cast<const float*>(p));
}
inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
using IVec = __m512i;
using WVec = __m512i;
using XPair = __m512i;
inline IVec ivzero() { return _mm512_setzero_si512(); }
inline IVec imadd(IVec sums, WVec w, XPair x) { return _mm512_dpwssd_epi32(sums, w, x); }
inline IVec iadd(IVec a, IVec b) { return _mm512_add_epi32(a, b); }
inline Vec vcvt(IVec v) { return _mm512_cvtepi32_ps(v); }
inline XPair inputs_of_pair(const int16_t* p) {
  int32_t both;
  std::memcpy(&both, p, sizeof(both));
  return _mm512_set1_epi32(both);
}
template <int kScaleBytes>
struct Q4Pairs {
  static constexpr int64_t kBytes = q4_bytes(kScaleBytes);
  // Four k (32 bytes, 16 words of 4 nibbles) are widened to 2 vectors of 16-bit lanes, each the
  // 32 bytes twice: the pair k = 4u, 4u + 1 (bits 0-3 of each word, outputs 0-7, in the low half;
  // bits 4-7, outputs 8-15, in the high half), then the pair 4u + 2, 4u + 3 (bits 8-11 and 12-15).
  const uint8_t* block;
  Q4Pairs() = default;
  explicit Q4Pairs(const uint8_t* at) : block(at) {}
  Vec d(int) const { return vload_scales<kScaleBytes>(block); }
  Vec m(int) const { return vload_scales<kScaleBytes>(block + kScaleBytes * kPanel); }
  void load(int64_t quad, WVec* w) const {
    const uint8_t* q = block + 2 * kScaleBytes * kPanel;
    const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 2 * quad * kPanel));
    const __m512i mask = _mm512_set1_epi16(0x0F);
    // The words in the low half and the words shifted by 4 in the high half, masked: bits 0-3 and 4-7 of each
    // word; shifted by 8 more, bits 8-11 and 12-15. Shifts by an immediate, not per lane (vpsrlvw), which is
    // slower.
    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(words), _mm256_srli_epi16(words, 4), 1);
    w[0] = _mm512_and_si512(both, mask);
    w[1] = _mm512_and_si512(_mm512_srli_epi16(both, 8), mask);
  }
};
using Q4_1Pairs = Q4Pairs<2>;
using Q4_KPairs = Q4Pairs<4>;
struct Q8_0Pairs {
  static constexpr int64_t kBytes = kQ8_0Bytes;
  const uint8_t* block;
  Q8_0Pairs() = default;
  explicit Q8_0Pairs(const uint8_t* at) : block(at) {}
  Vec d(int) const { return vload_half(block); }
  static Vec m(int) { return vzero(); }
  // The pairs of k 4u, 4u + 1 and 4u + 2, 4u + 3, each for the 16 outputs.
  void load(int64_t quad, WVec* w) const {
    const uint8_t* q = block + 2 * kPanel;
    for (int64_t pair = 0; pair < 2; ++pair) {
      const int64_t step = 2 * quad + pair;
      const __m128i first = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 2 * step * kPanel));
      const __m128i second = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + (2 * step + 1) * kPanel));
      w[pair] = _mm512_cvtepi8_epi16(_mm256_set_m128i(_mm_unpackhi_epi8(first, second), _mm_unpacklo_epi8(first, second)));
    }
  }
};
#include "linear_blocks.h"

// Few rows by Q4 panels on vpdpbusd, bytes by bytes: a step's sixteen outputs by four k in one vector where the
// 16-bit tiles above widen the same quants into two vectors of 16-bit lanes: three operations for two quads' 64
// bytes where they take five for one quad's 32. The rows' int16 quants split exactly into bytes, q = 256 * high +
// low (low unsigned, high signed): vpdpbusd multiplies unsigned bytes by signed ones, so the low bytes go first
// against the quants (0-15 as signed bytes), and the quants first against the high bytes. A block's sum is the
// same integer as the 16-bit tiles' (integer sums are exact in any order), so the outputs are the same bits, and a
// row's bits do not depend on which tile took it. Each row adds seven operations a block to join its sums, so the
// 16-bit tiles, which widen once for all their rows, take more rows than kByteRows: at 4 rows the byte tiles no
// longer gain (docs/benchmarks.md).
constexpr int kByteRows = 3;

// A row's inputs as the byte tile reads them: for each two quads u, u + 1 of the row, 16 bytes: the low bytes of quad
// u's four inputs, of quad u + 1's, then the high bytes of each; each quad's four in the order a Q4 panel's bytes
// hold their quants (k = 4u, 4u + 2, 4u + 1, 4u + 3: a 32-bit lane of the panel's bytes is words 2j and 2j + 1,
// bits 0-3 and 8-11 of each for output j, bits 4-7 and 12-15 for output j + 8). The tile spreads them over its
// lanes itself (a permute on a port its multiply-adds leave free): spread out here they were eight times the bytes,
// written by the calling thread and read again by the others, a cost of its own at one row.
struct alignas(16) BytePattern {
  uint8_t bytes[16];
};

void split_row(const int16_t* quants, int64_t depth, BytePattern* patterns) {
  const __m128i order = _mm_setr_epi8(0, 4, 2, 6, 8, 12, 10, 14, 1, 5, 3, 7, 9, 13, 11, 15);
  for (int64_t k = 0; k < depth; k += 8, ++patterns) {
    const __m128i eight = _mm_loadu_si128(reinterpret_cast<const __m128i*>(quants + k));
    _mm_store_si128(reinterpret_cast<__m128i*>(patterns->bytes), _mm_shuffle_epi8(eight, order));
  }
}

// The call's kRows rows by the panel: every block's sums added to `out` ([kRows, kPanel] float32, zeros to begin
// with). `patterns`: the rows' split_row, depth / 8 of them a row.
template <int kScaleBytes, int kRows>
void q4_byte_tile(const QuantizedRows& x, const BytePattern* patterns, const PackedBlocks<Q4Pairs<kScaleBytes>>& source,
                  int64_t panel, float* out) {
  const __m512i nibbles = _mm512_set1_epi8(0x0F);
  // Lanes 0-7 of each 32-bit sum hold outputs 0-7 (low nibbles) or 8-15 (high) over the even quads, lanes 8-15
  // the same outputs over the odd quads: these pick the halves to add.
  const __m512i first_halves = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
  const __m512i second_halves = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  // Lanes 0-7 of a pattern's spread take its first 32 bits (quad u's low bytes), lanes 8-15 its second (quad u + 1's).
  const __m512i low_lanes = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  const __m512i high_lanes = _mm512_setr_epi32(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const int64_t blocks = x.depth / kQuantBlock, row_patterns = x.depth / 8;
  Vec held[kRows];
#pragma GCC unroll 4
  for (int r = 0; r < kRows; ++r) held[r] = vload(out + r * kPanel);
  for (int64_t b = 0; b < blocks; ++b) {
    const Q4Pairs<kScaleBytes> reader = source.block(panel, b);
    const uint8_t* q = reader.block + 2 * kScaleBytes * kPanel;
    const BytePattern* pattern = patterns + b * kQuads / 2;  // one a pair of quads
    prefetch_block_ahead<Q4Pairs<kScaleBytes>::kBytes>(reader.block);
    // Per row: low nibbles by low bytes, low by high, high by low, high by high.
    __m512i sums[kRows][4];
#pragma GCC unroll 16
    for (int i = 0; i < kRows * 4; ++i) sums[i / 4][i % 4] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int pair = 0; pair < kQuads / 2; ++pair) {
      const __m512i quads = _mm512_loadu_si512(q + 2 * pair * 2 * kPanel);
      const __m512i low = _mm512_and_si512(quads, nibbles);
      const __m512i high = _mm512_and_si512(_mm512_srli_epi16(quads, 4), nibbles);
#pragma GCC unroll 4
      for (int r = 0; r < kRows; ++r) {
        const __m512i inputs = _mm512_castsi128_si512(
            _mm_load_si128(reinterpret_cast<const __m128i*>(pattern[r * row_patterns + pair].bytes)));
        const __m512i inputs_low = _mm512_permutexvar_epi32(low_lanes, inputs);
        const __m512i inputs_high = _mm512_permutexvar_epi32(high_lanes, inputs);
        sums[r][0] = _mm512_dpbusd_epi32(sums[r][0], inputs_low, low);
        sums[r][1] = _mm512_dpbusd_epi32(sums[r][1], low, inputs_high);
        sums[r][2] = _mm512_dpbusd_epi32(sums[r][2], inputs_low, high);
        sums[r][3] = _mm512_dpbusd_epi32(sums[r][3], high, inputs_high);
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) {
      const __m512i low = _mm512_add_epi32(sums[r][0], _mm512_slli_epi32(sums[r][1], 8));
      const __m512i high = _mm512_add_epi32(sums[r][2], _mm512_slli_epi32(sums[r][3], 8));
      const IVec total_sums = _mm512_add_epi32(_mm512_permutex2var_epi32(low, first_halves, high),
                                               _mm512_permutex2var_epi32(low, second_halves, high));
      // The block's scale and minimum as block_tile applies them, so the same bits.
      const int64_t at = r * blocks + b;
      const float total = static_cast<float>(x.sums[at]);
      const Vec scale = vbroadcast(x.scales + at), xsum = vbroadcast(&total);
      const Vec block = vfma(reader.d(0), vcvt(total_sums), vmul(reader.m(0), xsum));
      held[r] = vfma(block, scale, held[r]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < kRows; ++r) vstore(out + r * kPanel, held[r]);
}

template <typename T, int kScaleBytes>
void run_q4_bytes(const LinearCall<T>& call, const QuantizedRows& x, const uint8_t* data) {
  const int64_t row_patterns = x.depth / 8;
  auto* patterns = thread_scratch<BytePattern>(static_cast<size_t>(call.num_rows * row_patterns));
  for (int64_t r = 0; r < call.num_rows; ++r) split_row(x.quants + r * x.depth, x.depth, patterns + r * row_patterns);
  const PackedBlocks<Q4Pairs<kScaleBytes>> packed{data, x.depth / kQuantBlock};
  for_each_share((call.num_out + kPanel - 1) / kPanel, [&](int64_t panel) {
    alignas(64) float out[kByteRows * kPanel] = {};
    with_rows<kByteRows>(static_cast<int>(call.num_rows),
                         [&]<int kRows>() { q4_byte_tile<kScaleBytes, kRows>(x, patterns, packed, panel, out); });
    call.store(out, panel * kPanel, kPanel);
  });
}
}  // namespace avx512vnni
#pragma GCC pop_options

// Q8_0 panels on vpdpbusd for up to kByteRows rows, on CPUs with AVX512 VBMI as well: vpermb turns a quad's 64 bytes
// (four k by sixteen outputs) into the sixteen outputs' four k side by side, one instruction where the 16-bit tiles
// take eight to widen the same quants. The rows' int16 quants split into bytes as on the Q4 byte tile (low
// unsigned, high signed); vpdpbusd's unsigned operand must then be the quants for the high bytes, which are signed:
// they go in shifted by 128 (q ^ 0x80), and 128 times the block's high bytes' sum comes off again. The same
// integers, so the same bits as the 16-bit tiles.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vnni,avx512vbmi,avx2,fma,f16c")
namespace avx512vbmi {
using avx512vnni::kByteRows;
using avx512vnni::Vec;

bool usable() {
  static const bool has = __builtin_cpu_supports("avx512vbmi");
  return has;
}

// The rows' quants as the Q8_0 byte tile reads them: low bytes [rows, depth], high bytes [rows, depth], each
// block's high bytes' sum [rows, depth / 32].
struct SplitRows {
  const uint8_t* low;
  const int8_t* high;
  const int32_t* high_sums;
};

SplitRows split_rows(const int16_t* quants, int64_t count, uint8_t* scratch) {
  auto* low = scratch;
  auto* high = reinterpret_cast<int8_t*>(scratch + count);
  auto* sums = reinterpret_cast<int32_t*>(scratch + 2 * count);  // count is a whole number of blocks: aligned
  const __m512i ones = _mm512_set1_epi16(1);
  for (int64_t b = 0; b < count / kQuantBlock; ++b) {
    // A block's 32 quants in one vector: the low bytes by truncation, the high ones by an arithmetic shift
    // (q = 256 high + low), their sum in pairs, then across the lanes.
    const __m512i block = _mm512_loadu_si512(quants + b * kQuantBlock);
    const __m512i high_words = _mm512_srai_epi16(block, 8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(low + b * kQuantBlock), _mm512_cvtepi16_epi8(block));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(high + b * kQuantBlock), _mm512_cvtepi16_epi8(high_words));
    sums[b] = _mm512_reduce_add_epi32(_mm512_madd_epi16(high_words, ones));
  }
  return {low, high, sums};
}

inline __m512i broadcast_four(const void* p) {
  int32_t four;
  std::memcpy(&four, p, sizeof(four));
  return _mm512_set1_epi32(four);
}

// vpermb's indices: byte 4n + i of a quad's vector is k i of output n, which the panel holds at byte 16i + n.
struct alignas(64) Transpose {
  uint8_t bytes[64];
};
constexpr Transpose kTranspose = [] {
  Transpose order{};
  for (int n = 0; n < kPanel; ++n) {
    for (int i = 0; i < 4; ++i) order.bytes[4 * n + i] = static_cast<uint8_t>(kPanel * i + n);
  }
  return order;
}();

// The call's kRows rows by the panel, as q4_byte_tile.
template <int kRows>
void q8_0_byte_tile(const QuantizedRows& x, const SplitRows& split,
                    const avx512vnni::PackedBlocks<avx512vnni::Q8_0Pairs>& source, int64_t panel, float* out) {
  const __m512i transpose = _mm512_load_si512(kTranspose.bytes), shift = _mm512_set1_epi8(static_cast<char>(0x80));
  // One row alone keeps two chains of each kind, the even quads' and the odd ones': one would wait on its own
  // multiply-adds. More rows are chains enough.
  constexpr int kChains = kRows == 1 ? 2 : 1;
  const int64_t blocks = x.depth / kQuantBlock;
  Vec held[kRows];
#pragma GCC unroll 4
  for (int r = 0; r < kRows; ++r) held[r] = avx512vnni::vload(out + r * kPanel);
  for (int64_t b = 0; b < blocks; ++b) {
    const avx512vnni::Q8_0Pairs reader = source.block(panel, b);
    const uint8_t* q = reader.block + 2 * kPanel;
    prefetch_block_ahead<kQ8_0Bytes>(reader.block);
    __m512i low[kRows][kChains], high[kRows][kChains];
#pragma GCC unroll 8
    for (int i = 0; i < kRows * kChains; ++i) {
      low[i / kChains][i % kChains] = _mm512_setzero_si512();
      high[i / kChains][i % kChains] = _mm512_setzero_si512();
    }
#pragma GCC unroll 8
    for (int quad = 0; quad < kQuantBlock / 4; ++quad) {
      const __m512i quants = _mm512_permutexvar_epi8(transpose, _mm512_loadu_si512(q + quad * 4 * kPanel));
      const __m512i shifted = _mm512_xor_si512(quants, shift);
#pragma GCC unroll 4
      for (int r = 0; r < kRows; ++r) {
        const int64_t k = r * x.depth + b * kQuantBlock + 4 * quad;
        const int c = quad % kChains;
        low[r][c] = _mm512_dpbusd_epi32(low[r][c], broadcast_four(split.low + k), quants);
        high[r][c] = _mm512_dpbusd_epi32(high[r][c], shifted, broadcast_four(split.high + k));
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) {
      const int64_t at = r * blocks + b;
      __m512i low_sum = low[r][0], high_sum = high[r][0];
      if constexpr (kChains == 2) {
        low_sum = _mm512_add_epi32(low_sum, low[r][1]);
        high_sum = _mm512_add_epi32(high_sum, high[r][1]);
      }
      high_sum = _mm512_sub_epi32(high_sum, _mm512_set1_epi32(128 * split.high_sums[at]));
      const __m512i sums = _mm512_add_epi32(low_sum, _mm512_slli_epi32(high_sum, 8));
      // The block's scale as block_tile applies it, so the same bits.
      const float total = static_cast<float>(x.sums[at]);
      const Vec scale = avx512vnni::vbroadcast(x.scales + at), xsum = avx512vnni::vbroadcast(&total);
      const Vec block = avx512vnni::vfma(reader.d(0), avx512vnni::vcvt(sums), avx512vnni::vmul(reader.m(0), xsum));
      held[r] = avx512vnni::vfma(block, scale, held[r]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < kRows; ++r) avx512vnni::vstore(out + r * kPanel, held[r]);
}

template <typename T>
void run_q8_0_bytes(const LinearCall<T>& call, const QuantizedRows& x, const uint8_t* data) {
  const int64_t count = call.num_rows * x.depth;
  // Bytes: the thread's int32 scratch holds the rows' quants (linear_any).
  auto* scratch = thread_scratch<uint8_t>(static_cast<size_t>(2 * count + 4 * (count / kQuantBlock)));
  const SplitRows split = split_rows(x.quants, count, scratch);
  const avx512vnni::PackedBlocks<avx512vnni::Q8_0Pairs> packed{data, x.depth / kQuantBlock};
  for_each_share((call.num_out + kPanel - 1) / kPanel, [&](int64_t panel) {
    alignas(64) float out[kByteRows * kPanel] = {};
    with_rows<kByteRows>(static_cast<int>(call.num_rows),
                         [&]<int kRows>() { q8_0_byte_tile<kRows>(x, split, packed, panel, out); });
    call.store(out, panel * kPanel, kPanel);
  });
}
}  // namespace avx512vbmi
#pragma GCC pop_options

// The VNNI paths' block tiles: up to kByteRows rows on the byte tiles (Q8_0's on CPUs with VBMI alone), more on the
// 16-bit tiles.
template <typename T>
void run_vnni_blocks(const LinearCall<T>& call, WeightFormat format, const QuantizedRows& x, const void* packed) {
  const auto* data = static_cast<const uint8_t*>(packed);
  if (call.num_rows <= avx512vnni::kByteRows) {
    if (format == WeightFormat::kQ4_1) return avx512vnni::run_q4_bytes<T, 2>(call, x, data);
    if (format == WeightFormat::kQ4_K) return avx512vnni::run_q4_bytes<T, 4>(call, x, data);
    if (format == WeightFormat::kQ8_0 && avx512vbmi::usable()) return avx512vbmi::run_q8_0_bytes<T>(call, x, data);
  }
  return avx512vnni::run_block_format<T>(call, format, x, packed);
}

// bfloat16 rows times bfloat16 weights on CPUs with AVX512-BF16: a pair of k of 16 outputs in one
// vdpbf16ps, which adds the pair's two products (exact in float32) to the sums one after the
// other, the second k first, each rounded to nearest: the chain linear_tiles.h defines for
// bfloat16 weights, at the FMA tiles' bits (inputs and sums that are subnormal, which it flushes
// to zero, aside) and twice their multiply-adds an instruction. Float32 weights take the AVX512F
// tiles, blocks the AVX512 VNNI ones.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vnni,avx512bf16,avx2,fma,f16c")
namespace avx512bf16 {
using avx512f::kAccumulators;  // the AVX512F vectors, for the tiles' driver and an odd K's last k
using avx512f::kLanes;
using avx512f::vbroadcast;
using avx512f::Vec;
using avx512f::vfma;
using avx512f::vload;
using avx512f::vstore;
using avx512f::vzero;
#include "linear_tiles.h"

// Packed bfloat16 panels ([panels, K, kPanel], as DensePanels) read by dot-product tiles, with the call's rows
// as they read them: `pairs` [K / 2, rows], each x[r, 2j] and x[r, 2j + 1] in one 32-bit word (a tile's rows
// at a pair of k side by side, so that every row's broadcast is an offset from one address).
struct DotPanels {
  static constexpr bool kDot = true;
  // Half the rows at any count: a tile of two panels broadcasts each row's inputs once for both (64 rows: 1.3x
  // faster than one panel of 24 rows), and one panel at a time cannot stream the LM head from memory.
  static constexpr bool split_rows(int64_t) { return true; }
  const c10::BFloat16* data;
  int64_t depth;
  const int32_t* pairs;
  int64_t num_rows;

  // Rows k and k + 1 of a panel (32 contiguous bfloat16) as the 16 outputs' pairs: lane j holds output j's
  // weight at k in its low half, at k + 1 in its high half, as vdpbf16ps pairs them.
  static __m512bh weight_pairs(const c10::BFloat16* at) {
    const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                           21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return (__m512bh)_mm512_permutexvar_epi16(order, _mm512_loadu_si512(at));
  }

  template <int kRows, int kPanels>
  void tile(const float* x, int64_t x_stride, int64_t row, int64_t first, int64_t begin, int64_t end,
            float* out) const {
    constexpr int kSums = kRows * kPanels;
    __m512 acc[kSums];
#pragma GCC unroll 32
    for (int i = 0; i < kSums; ++i) acc[i] = begin == 0 ? vzero() : vload(out + i * kLanes);
    const c10::BFloat16* panel = data + first * depth * kPanel;
    const int64_t pairs_end = begin + (end - begin) / 2 * 2;
    for (int64_t k = begin; k < pairs_end; k += 2) {
      __m512bh w[kPanels];
#pragma GCC unroll 8
      for (int p = 0; p < kPanels; ++p) w[p] = weight_pairs(panel + (p * depth + k) * kPanel);
      const int32_t* inputs = pairs + k / 2 * num_rows + row;
#pragma GCC unroll 32
      for (int r = 0; r < kRows; ++r) {
        const __m512bh a = (__m512bh)_mm512_set1_epi32(inputs[r]);
#pragma GCC unroll 8
        for (int p = 0; p < kPanels; ++p) acc[r * kPanels + p] = _mm512_dpbf16_ps(acc[r * kPanels + p], w[p], a);
      }
    }
    if (pairs_end < end) {  // an odd K's last k, alone
#pragma GCC unroll 8
      for (int p = 0; p < kPanels; ++p) {
        const Vec w = vload(panel + (p * depth + pairs_end) * kPanel);
#pragma GCC unroll 32
        for (int r = 0; r < kRows; ++r) {
          acc[r * kPanels + p] = vfma(vbroadcast(x + (row + r) * x_stride + pairs_end), w, acc[r * kPanels + p]);
        }
      }
    }
#pragma GCC unroll 32
    for (int i = 0; i < kSums; ++i) vstore(out + i * kLanes, acc[i]);
  }
};

// v[i] (row i) to v[i] = column i, for 16 x 16 32-bit words: pairs of rows interleaved by word, then by two
// words, then the 128-bit lanes gathered, so that lane L of column c holds rows 4L..4L + 3.
inline void transpose_words(__m512i v[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]);  // lane L: row 2i and 2i + 1 at columns 4L, 4L + 1
    t[2 * i + 1] = _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]);  // ... at 4L + 2, 4L + 3
  }
  __m512i u[16];  // u[4i + c], lane L: rows 4i..4i + 3 at column 4L + c
  for (int i = 0; i < 4; ++i) {
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i low_front = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44);   // lanes 0, 1 of rows 0-3 and 4-7
    const __m512i low_back = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);    // lanes 2, 3
    const __m512i high_front = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);  // of rows 8-11 and 12-15
    const __m512i high_back = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
    v[c] = _mm512_shuffle_i32x4(low_front, high_front, 0x88);
    v[4 + c] = _mm512_shuffle_i32x4(low_front, high_front, 0xDD);
    v[8 + c] = _mm512_shuffle_i32x4(low_back, high_back, 0x88);
    v[12 + c] = _mm512_shuffle_i32x4(low_back, high_back, 0xDD);
  }
}

// Rows [begin, end) of the call's bfloat16 rows into `pairs` as DotPanels reads them ([K / 2, rows], x[r, 2j] and
// x[r, 2j + 1] in word j * rows + r): 16 rows by 16 pairs a transpose of vectors, the edges word by word.
template <typename T>
void pair_rows(const LinearCall<T>& call, int64_t begin, int64_t end, int32_t* pairs) {
  const int64_t num_pairs = call.depth / 2, num_rows = call.num_rows;
  const auto* x = reinterpret_cast<const char*>(call.x16);
  const auto word = [&](int64_t r, int64_t j) { return x + (r * call.depth + 2 * j) * sizeof(c10::BFloat16); };
  const auto copy = [&](int64_t r, int64_t j) { std::memcpy(pairs + j * num_rows + r, word(r, j), sizeof(int32_t)); };
  int64_t r = begin;
  for (; r + 16 <= end; r += 16) {
    int64_t j = 0;
    for (; j + 16 <= num_pairs; j += 16) {
      __m512i v[16];
      for (int i = 0; i < 16; ++i) v[i] = _mm512_loadu_si512(word(r + i, j));
      transpose_words(v);
      for (int i = 0; i < 16; ++i) _mm512_storeu_si512(pairs + (j + i) * num_rows + r, v[i]);
    }
    for (; j < num_pairs; ++j) {
      for (int i = 0; i < 16; ++i) copy(r + i, j);
    }
  }
  for (; r < end; ++r) {
    for (int64_t j = 0; j < num_pairs; ++j) copy(r, j);
  }
}

template <typename T>
void run_dense_dot(const LinearCall<T>& call, WeightFormat format, const void* packed) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (format == WeightFormat::kBFloat16 && call.x16 != nullptr) {
      auto* pairs = thread_scratch<int32_t>(static_cast<size_t>(call.depth / 2 * call.num_rows));
      // 32 rows at a time: their cache lines stay in the nearest cache while every pair is read from them.
      specserve::for_each_range(call.num_rows, 32, [&](int64_t begin, int64_t end) { pair_rows(call, begin, end, pairs); });
      return run(call, DotPanels{static_cast<const c10::BFloat16*>(packed), call.depth, pairs, call.num_rows});
    }
  }
  return run_dense<T>(call, format, packed);
}
}  // namespace avx512bf16
#pragma GCC pop_options

// bfloat16 rows times bfloat16 weights on CPUs with AMX: tdpbf16ps multiplies a tile of up to 16 rows by 32 k
// into a tile of those rows by a panel's 16 outputs. It adds the 32 products to each float32 sum in an order
// and with roundings of its own: measured, neither vdpbf16ps's chain nor any other chain of single roundings,
// so this path's bits are not the other paths' (they differ as two orders of a float32 sum differ). They are
// the same for a row in any tile, though: a row's sums are computed from that row's inputs alone, chunk after
// chunk of 32 k in order, whatever the other rows, so steps stay batch invariant on this path as on the
// others, and a bfloat16 model on a CPU with AMX always runs on this path (cpu_kernels.same_bits), so every
// process there computes the same bits. Float32 weights take the AVX512F tiles, blocks the AVX512 VNNI ones, as
// on the avx512bf16 path.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vnni,avx512bf16,avx2,fma,f16c,amx-tile,amx-bf16")
namespace amx {
constexpr int64_t kChunk = 32;  // k per tile product: 16 pairs
constexpr int kTileRows = 16;
constexpr int kGroup = 2;  // panels multiplied together, one weight tile each
constexpr int64_t kGroupsPerItem = 4;  // groups a work item takes at one tile of rows
constexpr int64_t kRowBlock = 256;     // rows a work item takes at most

// Tile registers: sums 0 and 1 (the first row tile by the group's two panels), 2 and 3 (the second row tile),
// rows 4 and 5, weights 6 and 7; every row 64 bytes (16 float32 sums, or 16 pairs of bfloat16).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t row_bytes[16] = {};
  uint8_t rows[16] = {};
};

// Loaded for each work item, not once a thread: torch's own matmuls (oneDNN) load theirs on the same threads.
// The tile instructions are statements the compiler orders only among themselves: the barriers keep the
// configuration's stores before the load and the load before the tiles' first use (without them GCC 12 moved a
// configuration past tile loads, which then faulted).
void configure(int first_rows, int second_rows) {
  TileConfig config;
  const int rows[8] = {first_rows, first_rows, second_rows, second_rows, first_rows, second_rows, kChunk / 2,
                       kChunk / 2};
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = static_cast<uint8_t>(std::max(1, rows[t]));
    config.row_bytes[t] = 64;
  }
  asm volatile("" ::: "memory");
  _tile_loadconfig(&config);
  asm volatile("" ::: "memory");
}

// The weight tile of a panel's last chunk of k when K is not a whole number of chunks: its pairs as packed (the
// AMX path packs bfloat16 panels in pairs: rows k and k + 1 stored as [kPanel, 2]), an odd K's last k beside a
// zero, zeros past K.
void last_weight_tile(const c10::BFloat16* panel, int64_t depth, int64_t from, c10::BFloat16* out) {
  const int64_t paired = depth / 2 * 2;
  std::fill(out, out + kChunk * kPanel, c10::BFloat16(0.0f));
  std::copy(panel + from * kPanel, panel + paired * kPanel, out);
  if (paired < depth) {
    for (int j = 0; j < kPanel; ++j) out[(paired - from) * kPanel + 2 * j] = panel[paired * kPanel + j];
  }
}

// Sums of up to two row tiles (`first` and `second` rows from `rows`, `stride` bytes apart) by `count` panels
// (each `panel_size` elements after the last) over K, into `out` ([rows, width] float32). Full chunks'
// weight tiles are read from the panels as packed, the last of a K that is not a whole number of chunks from
// `last` (kChunk * kPanel elements a panel).
void multiply(const c10::BFloat16* rows, int64_t stride, int first, int second, const c10::BFloat16* panels,
              int64_t panel_size, int count, int64_t depth, const c10::BFloat16* last, float* out, int64_t width) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const c10::BFloat16* second_rows = rows + kTileRows * (stride / static_cast<int64_t>(sizeof(c10::BFloat16)));
  for (int64_t k = 0; k < depth; k += kChunk) {
    const bool whole = k + kChunk <= depth;
    const c10::BFloat16* weights = whole ? panels + k * kPanel : last;
    const int64_t next = whole ? panel_size : kChunk * kPanel;
    if (k + 4 * kChunk < depth) {
      for (int p = 0; p < count; ++p) {
        const char* ahead = reinterpret_cast<const char*>(panels + p * panel_size + (k + 4 * kChunk) * kPanel);
#pragma GCC unroll 16
        for (int line = 0; line < 16; ++line) _mm_prefetch(ahead + 64 * line, _MM_HINT_T0);
      }
    }
    _tile_loadd(4, rows + k, stride);
    _tile_loadd(6, weights, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (count > 1) {
      _tile_loadd(7, weights + next, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if (second > 0) {
      _tile_loadd(5, second_rows + k, stride);
      _tile_dpbf16ps(2, 5, 6);
      if (count > 1) _tile_dpbf16ps(3, 5, 7);
    }
  }
  const int64_t sum_stride = width * static_cast<int64_t>(sizeof(float));
  _tile_stored(0, out, sum_stride);
  if (count > 1) _tile_stored(1, out + kPanel, sum_stride);
  if (second > 0) {
    _tile_stored(2, out + kTileRows * width, sum_stride);
    if (count > 1) _tile_stored(3, out + kTileRows * width + kPanel, sum_stride);
  }
}

template <typename T>
void run_dense_tiles(const LinearCall<T>& call, const c10::BFloat16* panels) {
  const int64_t depth = call.depth, num_rows = call.num_rows;
  const int64_t padded = (depth + kChunk - 1) / kChunk * kChunk;
  // The rows as tiles read them: the call's own, or a copy with zeros past K when K is not a whole number of
  // chunks (no model's shape; odd shapes in the tests).
  std::vector<c10::BFloat16> padded_rows;
  const c10::BFloat16* rows = call.x16;
  if (padded != depth) {
    padded_rows.assign(static_cast<size_t>(num_rows * padded), c10::BFloat16(0.0f));
    for (int64_t r = 0; r < num_rows; ++r) std::copy_n(call.x16 + r * depth, depth, padded_rows.data() + r * padded);
    rows = padded_rows.data();
  }
  const int64_t stride = padded * static_cast<int64_t>(sizeof(c10::BFloat16));
  const int64_t num_panels = (call.num_out + kPanel - 1) / kPanel, panel_size = depth * kPanel;
  const int64_t num_groups = (num_panels + kGroup - 1) / kGroup;
  const int64_t per_item = num_rows <= kTileRows ? kGroupsPerItem : 1;
  const int64_t items = (num_groups + per_item - 1) / per_item;
  // Many rows (a prefill) in blocks, each over every panel before the next: a block of rows stays in the core's
  // second-level cache while the weights pass (all of 2048 rows, read again for every pair of panels, held a
  // 3072 x 576 weight at 1.1 TFLOP/s).
  const int64_t row_block = std::min(num_rows, kRowBlock);
  const int64_t row_blocks = (num_rows + row_block - 1) / row_block;
  for_each_share(row_blocks * items, [&](int64_t index) {
    const int64_t rows_begin = index / items * row_block, rows_end = std::min(num_rows, rows_begin + row_block);
    const int64_t item = index % items;
    int configured_first = -1, configured_second = -1;
    for (int64_t g = item * per_item; g < std::min(num_groups, (item + 1) * per_item); ++g) {
      const int64_t first_panel = g * kGroup;
      const int count = static_cast<int>(std::min<int64_t>(kGroup, num_panels - first_panel));
      const int64_t width = count * kPanel;
      const c10::BFloat16* group = panels + first_panel * panel_size;
      float* out = thread_scratch<float>(static_cast<size_t>((rows_end - rows_begin) * width));  // [rows, width]
      alignas(64) c10::BFloat16 last[kGroup][kChunk * kPanel];
      if (padded != depth) {
        for (int p = 0; p < count; ++p) last_weight_tile(group + p * panel_size, depth, padded - kChunk, last[p]);
      }
      for (int64_t row = rows_begin; row < rows_end; row += 2 * kTileRows) {
        const int first = static_cast<int>(std::min<int64_t>(kTileRows, rows_end - row));
        const int second = static_cast<int>(std::clamp<int64_t>(rows_end - row - kTileRows, 0, kTileRows));
        if (first != configured_first || second != configured_second) {
          configure(first, second);
          configured_first = first;
          configured_second = second;
        }
        multiply(rows + row * padded, stride, first, second, group, panel_size, count, depth, last[0],
                 out + (row - rows_begin) * width, width);
      }
      call.store(out, first_panel * kPanel, width, rows_begin, rows_end);
    }
  });
}

template <typename T>
void run_dense(const LinearCall<T>& call, WeightFormat format, const void* packed) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (format == WeightFormat::kBFloat16 && call.x16 != nullptr) {
      return run_dense_tiles(call, static_cast<const c10::BFloat16*>(packed));
    }
  }
  return avx512f::run_dense<T>(call, format, packed);
}

// Whether this CPU has AMX's bfloat16 tiles and the kernel lets this process use them (Linux grants a process
// the tiles' state on request).
bool usable() {
#if defined(__linux__)
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  const bool bf16_tiles = (edx >> 22 & 1u) != 0, tiles = (edx >> 24 & 1u) != 0;
  constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
  return bf16_tiles && tiles && syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
#else
  return false;
#endif
}
}  // namespace amx
#pragma GCC pop_options
#endif

// Any CPU: the same chains in plain C++ (std::fma rounds once, as the vector FMAs do).
namespace portable {
constexpr int kLanes = 8;
constexpr int kAccumulators = 12;
struct Vec {
  float v[kLanes];
};
inline Vec vzero() { return Vec{}; }
inline Vec vbroadcast(const float* p) {
  Vec out;
  for (int i = 0; i < kLanes; ++i) out.v[i] = *p;
  return out;
}
inline Vec vload(const float* p) {
  Vec out;
  std::memcpy(out.v, p, sizeof(out.v));
  return out;
}
inline Vec vload(const c10::BFloat16* p) {
  Vec out;
  for (int i = 0; i < kLanes; ++i) out.v[i] = specserve::to_float(p[i]);
  return out;
}
inline Vec vfma(Vec a, Vec b, Vec c) {
  for (int i = 0; i < kLanes; ++i) c.v[i] = std::fma(a.v[i], b.v[i], c.v[i]);
  return c;
}
inline void vstore(float* p, Vec v) { std::memcpy(p, v.v, sizeof(v.v)); }
inline Vec vload_half(const uint8_t* p) {
  Vec out;
  for (int i = 0; i < kLanes; ++i) {
    uint16_t h;
    std::memcpy(&h, p + 2 * i, sizeof(h));
    out.v[i] = half_to_float(h);
  }
  return out;
}
template <int kScaleBytes>
inline Vec vload_scales(const uint8_t* p) {
  if constexpr (kScaleBytes == 2) return vload_half(p);
  return vload(reinterpret_cast<const float*>(p));  // memcpy: any alignment
}
inline Vec vmul(Vec a, Vec b) {
  for (int i = 0; i < kLanes; ++i) a.v[i] = a.v[i] * b.v[i];
  return a;
}
struct IVec {
  int32_t v[kLanes];
};
struct WVec {
  int16_t v[2 * kLanes];  // lanes 2j and 2j + 1: output j's quants at the pair's two k
};
struct XPair {
  int32_t first, second;
};
inline XPair inputs_of_pair(const int16_t* p) { return {p[0], p[1]}; }
inline IVec ivzero() { return IVec{}; }
inline IVec imadd(IVec sums, const WVec& w, XPair x) {
  for (int j = 0; j < kLanes; ++j) sums.v[j] += w.v[2 * j] * x.first + w.v[2 * j + 1] * x.second;
  return sums;
}
inline IVec iadd(IVec a, const IVec& b) {
  for (int j = 0; j < kLanes; ++j) a.v[j] += b.v[j];
  return a;
}
inline Vec vcvt(IVec v) {
  Vec out;
  for (int i = 0; i < kLanes; ++i) out.v[i] = static_cast<float>(v.v[i]);
  return out;
}
template <int kScaleBytes>  // 2: Q4_1's float16 scales; 4: Q4_K's sub-blocks, float32
struct Q4Pairs {
  static constexpr int64_t kBytes = q4_bytes(kScaleBytes);
  const uint8_t* block;
  Q4Pairs() = default;
  explicit Q4Pairs(const uint8_t* at) : block(at) {}
  Vec d(int h) const { return vload_scales<kScaleBytes>(block + kScaleBytes * kLanes * h); }
  Vec m(int h) const { return vload_scales<kScaleBytes>(block + kScaleBytes * (kPanel + kLanes * h)); }
  void load(int64_t quad, WVec* w) const {
    const uint8_t* q = block + 2 * kScaleBytes * kPanel + 2 * quad * kPanel;
    for (int i = 0; i < 2 * kLanes; ++i) {  // word i: outputs i / 2 and i / 2 + 8 at k = 4 quad + i % 2 and that + 2
      const int word = q[2 * i] | q[2 * i + 1] << 8;
      for (int v = 0; v < 4; ++v) w[v].v[i] = static_cast<int16_t>((word >> (4 * v)) & 0x0F);
    }
  }
};
using Q4_1Pairs = Q4Pairs<2>;
using Q4_KPairs = Q4Pairs<4>;
struct Q8_0Pairs {
  static constexpr int64_t kBytes = kQ8_0Bytes;
  const uint8_t* block;
  Q8_0Pairs() = default;
  explicit Q8_0Pairs(const uint8_t* at) : block(at) {}
  Vec d(int h) const { return vload_half(block + 2 * kLanes * h); }
  static Vec m(int) { return vzero(); }
  void load(int64_t quad, WVec* w) const {
    const uint8_t* q = block + 2 * kPanel;
    for (int64_t pair = 0; pair < 2; ++pair) {
      const int64_t step = 2 * quad + pair;
      for (int l = 0; l < kPanel; ++l) {
        w[2 * pair + l / kLanes].v[2 * (l % kLanes)] = static_cast<int8_t>(q[2 * step * kPanel + l]);
        w[2 * pair + l / kLanes].v[2 * (l % kLanes) + 1] = static_cast<int8_t>(q[(2 * step + 1) * kPanel + l]);
      }
    }
  }
};
#include "linear_tiles.h"
constexpr int kBlockSums = 8;
constexpr int kVectorRegisters = 32;  // plain arrays: what a compiler keeps where is its own business
#include "linear_blocks.h"
}  // namespace portable

// The instruction sets this CPU has, fastest first.
std::vector<std::string> available_paths() {
  std::vector<std::string> paths;
#ifdef SPECSERVE_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni")) {
    if (__builtin_cpu_supports("avx512bf16")) {
      if (amx::usable()) paths.emplace_back("amx");
      paths.emplace_back("avx512bf16");
    }
    paths.emplace_back("avx512vnni");
  }
  if (__builtin_cpu_supports("avx512f")) paths.emplace_back("avx512f");
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
    paths.emplace_back("avx2");
  }
#endif
  paths.emplace_back("portable");
  return paths;
}

// The vectors a path rounds block inputs in (each the same bits as the scalar code).
enum class Rounding { kScalar, kAvx2, kAvx512 };

// Rounds rows x [num_rows, depth] (float32 or bfloat16, contiguous) into quants, scales and sums (shaped as
// QuantizedRows says), each block by quantize_block, in the vectors of `rounding` where a block allows. bfloat16
// rows are widened a block at a time (exactly), not copied to float32 first: at one row that copy, a tensor op of
// its own, cost more than the rounding.
template <typename T>
void quantize_rows(const T* x, int64_t num_rows, int64_t depth, int16_t* quants, float* scales, int32_t* sums,
                   Rounding rounding) {
  const int64_t blocks = depth / kQuantBlock;
  specserve::for_each_range(num_rows * blocks, 256, [&](int64_t begin, int64_t end) {
    float widened[kQuantBlock];
    for (int64_t at = begin; at < end; ++at) {
      // Rows are contiguous: block `at` of all the rows' blocks.
      const T* block = x + at * kQuantBlock;
      int16_t* out = quants + at * kQuantBlock;
#ifdef SPECSERVE_X86
      if (rounding == Rounding::kAvx512 && avx512f::quantize_block(block, out, scales + at, sums + at)) continue;
      if (rounding == Rounding::kAvx2 && avx2::quantize_block(block, out, scales + at, sums + at)) continue;
#endif
      const float* in = widened;
      if constexpr (std::is_same_v<T, float>) {
        in = block;
      } else {
#pragma omp simd
        for (int64_t i = 0; i < kQuantBlock; ++i) widened[i] = specserve::to_float(block[i]);
      }
      quantize_block(in, out, scales + at, sums + at);
    }
  });
}

bool is_block_format(WeightFormat format) { return format != WeightFormat::kFloat32 && format != WeightFormat::kBFloat16; }

// The paths whose CPUs have AVX512F (each of them runs its float32 tiles and rounds block inputs in AVX512).
bool is_avx512_path(const std::string& path) {
  return path == "avx512f" || path == "avx512vnni" || path == "avx512bf16" || path == "amx";
}

// The vectors a path rounds block inputs in.
Rounding rounding_of(const std::string& path) {
  if (is_avx512_path(path)) return Rounding::kAvx512;
  return path == "avx2" ? Rounding::kAvx2 : Rounding::kScalar;
}

// `x`: the rows quantized, for a block format; null for float32 and bfloat16 weights.
template <typename T>
void run_on(const std::string& path, const LinearCall<T>& call, WeightFormat format, const QuantizedRows* x,
            const void* packed) {
#ifdef SPECSERVE_X86
  const bool vnni = path == "avx512vnni" || path == "avx512bf16" || path == "amx";
  if (x != nullptr && vnni) return run_vnni_blocks<T>(call, format, *x, packed);
  if (path == "amx") return amx::run_dense<T>(call, format, packed);
  if (path == "avx512bf16") return avx512bf16::run_dense_dot<T>(call, format, packed);
  if (x != nullptr && path != "portable") return avx2::run_block_format<T>(call, format, *x, packed);
  if (is_avx512_path(path)) return avx512f::run_dense<T>(call, format, packed);
  if (path == "avx2") return avx2::run_dense<T>(call, format, packed);
#endif
  if (x != nullptr) return portable::run_block_format<T>(call, format, *x, packed);
  return portable::run_dense<T>(call, format, packed);
}

}  // namespace

std::vector<std::string> linear_paths() { return available_paths(); }

int64_t linear_panel_width() { return kPanel; }

namespace {

const std::string& chosen_path(const std::string& path) {
  static const std::vector<std::string> paths = available_paths();
  const std::string& chosen = path.empty() ? paths.front() : path;
  TORCH_CHECK(std::find(paths.begin(), paths.end(), chosen) != paths.end(), "the linear kernel path ", chosen,
              " is not available on this CPU");
  return chosen;
}

// y = x @ W^T (+ b) for x [M, K] and a weight in `format` of `depth` inputs, checked by the caller.
at::Tensor linear_any(const at::Tensor& x, WeightFormat format, const void* packed, int64_t num_out,
                      const c10::optional<at::Tensor>& bias, const std::string& path) {
  const std::string& chosen = chosen_path(path);
  TORCH_CHECK(x.device().is_cpu(), "the linear kernel runs on CPU tensors");
  TORCH_CHECK(x.dim() == 2, "x must be [rows, in_features]");
  if (bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == num_out && bias->is_contiguous() && bias->device().is_cpu() &&
                    bias->scalar_type() == x.scalar_type(),
                "bias must be a contiguous [num_out] CPU tensor of x's dtype");
  }
  const int64_t num_rows = x.size(0), depth = x.size(1);
  at::Tensor y = at::empty({num_rows, num_out}, x.options());
  if (num_rows == 0) return y;
  // The rows as contiguous float32 (bfloat16 widens exactly) for the dense tiles; the dot-product tiles read
  // bfloat16 pairs alone (an even K), AMX tiles bfloat16 rows alone (any K), the block tiles the rows' quants alone.
  const bool bfloat16_pairs = format == WeightFormat::kBFloat16 && x.scalar_type() == at::kBFloat16;
  const bool pairs_only = bfloat16_pairs && (chosen == "amx" || (chosen == "avx512bf16" && depth % 2 == 0));
  const bool float_rows = !pairs_only && !is_block_format(format);
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "the linear kernel supports float32 and bfloat16 rows, not ", x.scalar_type());
  const at::Tensor rows = float_rows ? x.to(at::kFloat).contiguous() : at::Tensor();
  const float* xf = float_rows ? rows.data_ptr<float>() : nullptr;
  const at::Tensor source = float_rows && x.scalar_type() == at::kFloat ? rows : x.contiguous();  // in their dtype
  // For blocks, the rows rounded to 16-bit quants (see QuantizedRows).
  QuantizedRows quantized{};
  if (is_block_format(format)) {
    const int64_t blocks = num_rows * (depth / kQuantBlock);
    // One scratch: the quants, then the scales and the sums (4 bytes each, so all stay aligned).
    auto* scratch = thread_scratch<int32_t>(static_cast<size_t>((num_rows * depth + 1) / 2 + 2 * blocks));
    auto* quants = reinterpret_cast<int16_t*>(scratch);
    auto* scales = reinterpret_cast<float*>(scratch + (num_rows * depth + 1) / 2);
    int32_t* sums = scratch + (num_rows * depth + 1) / 2 + blocks;
    if (source.scalar_type() == at::kFloat) {
      quantize_rows(source.data_ptr<float>(), num_rows, depth, quants, scales, sums, rounding_of(chosen));
    } else {
      quantize_rows(source.data_ptr<c10::BFloat16>(), num_rows, depth, quants, scales, sums, rounding_of(chosen));
    }
    quantized = {quants, scales, sums, depth};
  }
  const QuantizedRows* blocks = is_block_format(format) ? &quantized : nullptr;
  if (x.scalar_type() == at::kFloat) {
    run_on<float>(chosen, {xf, num_rows, depth, num_out, bias ? bias->data_ptr<float>() : nullptr, y.data_ptr<float>()},
                  format, blocks, packed);
  } else {
    run_on<c10::BFloat16>(chosen, {xf, num_rows, depth, num_out, bias ? bias->data_ptr<c10::BFloat16>() : nullptr,
                                   y.data_ptr<c10::BFloat16>(), source.data_ptr<c10::BFloat16>()},
                          format, blocks, packed);
  }
  return y;
}

}  // namespace

// x [M, K] (float32 or bfloat16, rows may be strided) times a weight packed by
// modeling/cpu_kernels.py ([panels, K, kPanel], x's dtype) -> [M, num_out] in x's dtype;
// bias [num_out] or None. `path` names the instruction set ("": the fastest this CPU has).
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t num_out, const c10::optional<at::Tensor>& bias,
                  const std::string& path) {
  TORCH_CHECK(packed.device().is_cpu(), "the linear kernel runs on CPU tensors");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.is_contiguous(),
              "the weight must be packed [panels, in_features, ", kPanel, "]");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == packed.size(1), "x must be [rows, ", packed.size(1), "], not ", x.sizes());
  TORCH_CHECK(num_out > 0 && (num_out + kPanel - 1) / kPanel == packed.size(0), "num_out ", num_out,
              " does not fit the packed weight");
  TORCH_CHECK(x.scalar_type() == packed.scalar_type(), "x and the weight must share a dtype");
  const WeightFormat format = x.scalar_type() == at::kBFloat16 ? WeightFormat::kBFloat16 : WeightFormat::kFloat32;
  return linear_any(x, format, packed.data_ptr(), num_out, bias, path);
}

namespace {

WeightFormat block_format(const std::string& format) {
  if (format == "q4_1") return WeightFormat::kQ4_1;
  if (format == "q8_0") return WeightFormat::kQ8_0;
  if (format == "q4_k") return WeightFormat::kQ4_K;
  TORCH_CHECK(false, "no block format ", format, " (the kernel's: q4_1, q8_0, q4_k)");
}

}  // namespace

int64_t linear_block_bytes(const std::string& format) {
  switch (block_format(format)) {
    case WeightFormat::kQ4_1:
      return kQ4_1Bytes;
    case WeightFormat::kQ4_K:
      return kQ4_KBytes;
    default:
      return kQ8_0Bytes;
  }
}

// x [M, K] (float32 or bfloat16) times GGUF blocks regrouped by modeling/cpu_kernels.py into
// panels ([panels, K / 32, linear_block_bytes(format)], uint8) -> [M, num_out] in x's dtype.
at::Tensor linear_blocks(const at::Tensor& x, const at::Tensor& packed, int64_t num_out,
                         const c10::optional<at::Tensor>& bias, const std::string& format, const std::string& path) {
  const int64_t bytes = linear_block_bytes(format);
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kByte, "the blocks must be a uint8 CPU tensor");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == bytes && packed.is_contiguous(),
              "the blocks must be packed [panels, in_features / ", kQuantBlock, ", ", bytes, "]");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == packed.size(1) * kQuantBlock, "x must be [rows, ",
              packed.size(1) * kQuantBlock, "], not ", x.sizes());
  TORCH_CHECK(num_out > 0 && (num_out + kPanel - 1) / kPanel == packed.size(0), "num_out ", num_out,
              " does not fit the packed blocks");
  return linear_any(x, block_format(format), packed.data_ptr(), num_out, bias, path);
}

namespace {

// Rows `ids` of a weight packed as blocks, each widened by the portable path's own block reader:
// quant (output L, k = 4u + 2p + t) is lane 2 (L % kLanes) + t of the reader's vector 2p + L / kLanes of load u.
// `offset`: add m (Q4_1, Q4_K); Q8_0's values are q * d alone, as gguf computes them.
template <typename Reader>
void widen_rows(const uint8_t* data, int64_t num_blocks, const int64_t* ids, int64_t num_ids, bool offset,
                float* values) {
  using portable::kLanes;
  specserve::for_each_range(num_ids, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t half = ids[i] % kPanel / kLanes, lane = ids[i] % kLanes;
      for (int64_t b = 0; b < num_blocks; ++b) {
        const Reader reader(data + ((ids[i] / kPanel) * num_blocks + b) * Reader::kBytes);
        const float d = reader.d(half).v[lane], m = reader.m(half).v[lane];
        float* row = values + (i * num_blocks + b) * kQuantBlock;
        for (int64_t quad = 0; quad < kQuantBlock / 4; ++quad) {
          portable::WVec w[4];
          reader.load(quad, w);
          for (int64_t k = 0; k < 4; ++k) {
            const auto quant = static_cast<float>(w[2 * (k / 2) + half].v[2 * lane + k % 2]);
            row[4 * quad + k] = offset ? d * quant + m : quant * d;
          }
        }
      }
    }
  });
}

}  // namespace

// Rows `ids` ([n], int64) of a weight packed as blocks by modeling/cpu_kernels.py -> [n, K] float32, each
// value as gguf dequantizes it: d * q for Q8_0, d * q + m for Q4_1 and Q4_K (two roundings, no fused
// multiply-add), as modeling.quantized.panel_rows computes them. An embedding lookup on a tied LM head.
at::Tensor block_rows(const at::Tensor& packed, const at::Tensor& ids, const std::string& format) {
  const WeightFormat kind = block_format(format);
  const int64_t bytes = linear_block_bytes(format);
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kByte && packed.dim() == 3 &&
                  packed.size(2) == bytes && packed.is_contiguous(),
              "the blocks must be a contiguous uint8 CPU tensor [panels, in_features / ", kQuantBlock, ", ", bytes, "]");
  TORCH_CHECK(ids.device().is_cpu() && ids.scalar_type() == at::kLong && ids.dim() == 1, "ids must be a 1-d int64 CPU tensor");
  const at::Tensor rows = ids.contiguous();
  const int64_t num_ids = rows.numel(), num_blocks = packed.size(1), num_panels = packed.size(0);
  const int64_t* id_of = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < num_ids; ++i) {
    TORCH_CHECK(id_of[i] >= 0 && id_of[i] < num_panels * kPanel, "row ", id_of[i], " is outside the weight's ",
                num_panels * kPanel, " packed rows");
  }
  at::Tensor out = at::empty({num_ids, num_blocks * kQuantBlock}, at::kFloat);
  const uint8_t* data = packed.data_ptr<uint8_t>();
  float* values = out.data_ptr<float>();
  switch (kind) {
    case WeightFormat::kQ4_1:
      widen_rows<portable::Q4_1Pairs>(data, num_blocks, id_of, num_ids, true, values);
      break;
    case WeightFormat::kQ4_K:
      widen_rows<portable::Q4_KPairs>(data, num_blocks, id_of, num_ids, true, values);
      break;
    default:
      widen_rows<portable::Q8_0Pairs>(data, num_blocks, id_of, num_ids, false, values);
  }
  return out;
}
