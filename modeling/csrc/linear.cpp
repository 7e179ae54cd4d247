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
// last panel padded with zero columns. Weights are float32 or bfloat16; bfloat16 is
// widened to float32 as it is loaded (exactly), so both sum in float32.
//
// Or the weight is a GGUF file's own quantized blocks (Q4_1, Q8_0: 32 consecutive k of one
// output each), regrouped by modeling/cpu_kernels.py into panels of blocks: for panel p and
// block b, the kPanel outputs' float16 scales (d, then m for Q4_1) followed by their quants
// for each of the block's 32 k, [k][kPanel] (Q8_0: one int8 each; Q4_1: 8 bytes, byte j
// holding output j in its low nibble and output j + 8 in its high one). Q4_K's sub-blocks of
// 32 take Q4_1's layout with float32 scales: d * sc and -(dmin * m), products gguf rounds to
// float32 (modeling/quantized.py computes them as it regroups). They are widened as they are
// loaded, in registers, to the float32 values gguf's dequantization gives, d * q + m with
// each operation rounded (Q8_0: q * d), so a row's sums are those of the dense float32
// weights, bit for bit; no dequantized copy of a weight is ever held in memory.
//
// One build holds the tiles for every instruction set (AVX512F, AVX2 with FMA, and plain
// C++), each compiled for its own set; which one runs is chosen when the module loads, by
// asking the CPU (`linear_paths`), and a caller may name another the CPU has. All of them
// give the same bits: a fused multiply-add rounds once, whatever computes it.
#include "ops.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define SPECSERVE_X86 1
#endif

namespace {

constexpr int kPanel = 16;         // outputs per packed column panel
constexpr int64_t kDepthBlock = 256;  // k per pass over the rows: a float32 panel's block is 16 KiB
constexpr int64_t kQuantBlock = 32;   // k per GGUF block (Q4_1, Q8_0)

enum class WeightFormat { kFloat32, kBFloat16, kQ4_1, kQ8_0, kQ4_K };

// Bytes of one panel's block of kQuantBlock k: its scales, then its quants.
constexpr int64_t q4_bytes(int scale_bytes) { return 2 * scale_bytes * kPanel + kQuantBlock * kPanel / 2; }
constexpr int64_t kQ4_1Bytes = q4_bytes(2);                        // 320: float16 d and m
constexpr int64_t kQ4_KBytes = q4_bytes(4);                        // 384: float32 d and m
constexpr int64_t kQ8_0Bytes = 2 * kPanel + kQuantBlock * kPanel;  // 544

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
  const float* x;  // [num_rows, depth]
  int64_t num_rows, depth;
  int64_t num_out;
  const T* bias;  // [num_out] or null
  T* y;           // [num_rows, num_out]

  // Rows of sums `sums` ([num_rows, width], from column `first`) plus the bias, rounded to T.
  void store(const float* sums, int64_t first, int64_t width) const {
    const int64_t count = std::min(width, num_out - first);
    for (int64_t r = 0; r < num_rows; ++r) {
      for (int64_t c = 0; c < count; ++c) {
        float v = sums[r * width + c];
        if (bias != nullptr) v = v + specserve::to_float(bias[first + c]);
        y[r * num_out + first + c] = specserve::from_float<T>(v);
      }
    }
  }
};

#ifdef SPECSERVE_X86
#pragma GCC push_options
#pragma GCC target("avx512f")
namespace avx512f {
constexpr int kLanes = 16;
constexpr int kAccumulators = 24;  // of 32 vector registers
constexpr int kBlockTilePanels = 4;  // panels of a tile widening GGUF blocks
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
inline Vec vload_half(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
template <int kScaleBytes>
inline Vec vload_scales(const uint8_t* p) {
  if constexpr (kScaleBytes == 2) return vload_half(p);
  return vload(reinterpret_cast<const float*>(p));
}
template <int kScaleBytes>  // 2: Q4_1's float16 scales; 4: Q4_K's sub-blocks, float32
struct Q4Block {
  static constexpr int64_t kBytes = q4_bytes(kScaleBytes);
  const uint8_t* q;
  Vec d, m;
  Q4Block() = default;
  explicit Q4Block(const uint8_t* block)
      : q(block + 2 * kScaleBytes * kPanel),
        d(vload_scales<kScaleBytes>(block)),
        m(vload_scales<kScaleBytes>(block + kScaleBytes * kPanel)) {}
  void load(int64_t i, Vec* w) const {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + i * (kPanel / 2)));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i low = _mm_and_si128(bytes, mask), high = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    const Vec quants = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi64(low, high)));
    w[0] = _mm512_add_ps(_mm512_mul_ps(d, quants), m);
  }
};
using Q4_1Block = Q4Block<2>;
using Q4_KBlock = Q4Block<4>;
struct Q8_0Block {
  static constexpr int64_t kBytes = kQ8_0Bytes;
  const uint8_t* q;
  Vec d;
  Q8_0Block() = default;
  explicit Q8_0Block(const uint8_t* block) : q(block + 2 * kPanel), d(vload_half(block)) {}
  void load(int64_t i, Vec* w) const {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i * kPanel));
    w[0] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)), d);
  }
};
#include "linear_tiles.h"
}  // namespace avx512f
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
constexpr int kLanes = 8;
constexpr int kAccumulators = 12;  // of 16 vector registers
constexpr int kBlockTilePanels = 2;
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
template <int kScaleBytes>  // 2: Q4_1's float16 scales; 4: Q4_K's sub-blocks, float32
struct Q4Block {
  static constexpr int64_t kBytes = q4_bytes(kScaleBytes);
  const uint8_t* q;
  Vec d[2], m[2];
  Q4Block() = default;
  explicit Q4Block(const uint8_t* block)
      : q(block + 2 * kScaleBytes * kPanel),
        d{vload_scales<kScaleBytes>(block), vload_scales<kScaleBytes>(block + kScaleBytes * kLanes)},
        m{vload_scales<kScaleBytes>(block + kScaleBytes * kPanel),
          vload_scales<kScaleBytes>(block + kScaleBytes * (kPanel + kLanes))} {}
  void load(int64_t i, Vec* w) const {
    // The 8 bytes widened once to 8 lanes of 32 bits: output j's quant is the low nibble of lane j,
    // output j + 8's the rest of it (one widening shuffle for both halves, not one each).
    const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + i * (kPanel / 2))));
    const __m256i low = _mm256_and_si256(bytes, _mm256_set1_epi32(0x0F)), high = _mm256_srli_epi32(bytes, 4);
    w[0] = _mm256_add_ps(_mm256_mul_ps(d[0], _mm256_cvtepi32_ps(low)), m[0]);
    w[1] = _mm256_add_ps(_mm256_mul_ps(d[1], _mm256_cvtepi32_ps(high)), m[1]);
  }
};
using Q4_1Block = Q4Block<2>;
using Q4_KBlock = Q4Block<4>;
struct Q8_0Block {
  static constexpr int64_t kBytes = kQ8_0Bytes;
  const uint8_t* q;
  Vec d[2];
  Q8_0Block() = default;
  explicit Q8_0Block(const uint8_t* block) : q(block + 2 * kPanel), d{vload_half(block), vload_half(block + 2 * kLanes)} {}
  void load(int64_t i, Vec* w) const {
    const uint8_t* at = q + i * kPanel;  // each half of the 16 widened straight from memory
    w[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(at)))), d[0]);
    w[1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(at + 8)))),
                         d[1]);
  }
};
#include "linear_tiles.h"
}  // namespace avx2
#pragma GCC pop_options
#endif

// Any CPU: the same chains in plain C++ (std::fma rounds once, as the vector FMAs do).
namespace portable {
constexpr int kLanes = 8;
constexpr int kAccumulators = 12;
constexpr int kBlockTilePanels = 2;
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
template <int kScaleBytes>  // 2: Q4_1's float16 scales; 4: Q4_K's sub-blocks, float32
struct Q4Block {
  static constexpr int64_t kBytes = q4_bytes(kScaleBytes);
  const uint8_t* q;
  Vec d[2], m[2];
  Q4Block() = default;
  explicit Q4Block(const uint8_t* block)
      : q(block + 2 * kScaleBytes * kPanel),
        d{vload_scales<kScaleBytes>(block), vload_scales<kScaleBytes>(block + kScaleBytes * kLanes)},
        m{vload_scales<kScaleBytes>(block + kScaleBytes * kPanel),
          vload_scales<kScaleBytes>(block + kScaleBytes * (kPanel + kLanes))} {}
  void load(int64_t i, Vec* w) const {
    for (int l = 0; l < kLanes; ++l) {
      const uint8_t byte = q[i * (kPanel / 2) + l];
      const float low = d[0].v[l] * static_cast<float>(byte & 0x0F);
      const float high = d[1].v[l] * static_cast<float>(byte >> 4);
      w[0].v[l] = low + m[0].v[l];
      w[1].v[l] = high + m[1].v[l];
    }
  }
};
using Q4_1Block = Q4Block<2>;
using Q4_KBlock = Q4Block<4>;
struct Q8_0Block {
  static constexpr int64_t kBytes = kQ8_0Bytes;
  const uint8_t* q;
  Vec d[2];
  Q8_0Block() = default;
  explicit Q8_0Block(const uint8_t* block) : q(block + 2 * kPanel), d{vload_half(block), vload_half(block + 2 * kLanes)} {}
  void load(int64_t i, Vec* w) const {
    for (int l = 0; l < kPanel; ++l) {
      const float quant = static_cast<float>(static_cast<int8_t>(q[i * kPanel + l]));
      w[l / kLanes].v[l % kLanes] = quant * d[l / kLanes].v[l % kLanes];
    }
  }
};
#include "linear_tiles.h"
}  // namespace portable

// The instruction sets this CPU has, fastest first.
std::vector<std::string> available_paths() {
  std::vector<std::string> paths;
#ifdef SPECSERVE_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) paths.emplace_back("avx512f");
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
    paths.emplace_back("avx2");
  }
#endif
  paths.emplace_back("portable");
  return paths;
}

template <typename T>
void run_on(const std::string& path, const LinearCall<T>& call, WeightFormat format, const void* packed) {
#ifdef SPECSERVE_X86
  if (path == "avx512f") return avx512f::run_format<T>(call, format, packed);
  if (path == "avx2") return avx2::run_format<T>(call, format, packed);
#endif
  return portable::run_format<T>(call, format, packed);
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
  // The rows as contiguous float32 (bfloat16 widens exactly).
  const at::Tensor rows = x.to(at::kFloat).contiguous();
  const float* xf = rows.data_ptr<float>();
  if (x.scalar_type() == at::kFloat) {
    run_on<float>(chosen, {xf, num_rows, depth, num_out, bias ? bias->data_ptr<float>() : nullptr, y.data_ptr<float>()},
                  format, packed);
  } else if (x.scalar_type() == at::kBFloat16) {
    run_on<c10::BFloat16>(chosen, {xf, num_rows, depth, num_out, bias ? bias->data_ptr<c10::BFloat16>() : nullptr,
                                   y.data_ptr<c10::BFloat16>()},
                          format, packed);
  } else {
    TORCH_CHECK(false, "the linear kernel supports float32 and bfloat16 rows, not ", x.scalar_type());
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
