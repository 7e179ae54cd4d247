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

// One call's operands: x as contiguous float32 rows, the packed weight, the output.
template <typename T>
struct LinearCall {
  const float* x;  // [num_rows, depth]
  int64_t num_rows, depth;
  const T* packed;  // [panels, depth, kPanel]
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
}  // namespace avx512f
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
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
#include "linear_tiles.h"
}  // namespace avx2
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
#include "linear_tiles.h"
}  // namespace portable

// The instruction sets this CPU has, fastest first.
std::vector<std::string> available_paths() {
  std::vector<std::string> paths;
#ifdef SPECSERVE_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) paths.emplace_back("avx512f");
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) paths.emplace_back("avx2");
#endif
  paths.emplace_back("portable");
  return paths;
}

template <typename T>
void run_on(const std::string& path, const LinearCall<T>& call) {
#ifdef SPECSERVE_X86
  if (path == "avx512f") return avx512f::run<T>(call);
  if (path == "avx2") return avx2::run<T>(call);
#endif
  return portable::run<T>(call);
}

}  // namespace

std::vector<std::string> linear_paths() { return available_paths(); }

int64_t linear_panel_width() { return kPanel; }

// x [M, K] (float32 or bfloat16, rows may be strided) times a weight packed by
// modeling/cpu_kernels.py ([panels, K, kPanel], x's dtype) -> [M, num_out] in x's dtype;
// bias [num_out] or None. `path` names the instruction set ("": the fastest this CPU has).
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t num_out, const c10::optional<at::Tensor>& bias,
                  const std::string& path) {
  static const std::vector<std::string> paths = available_paths();
  const std::string& chosen = path.empty() ? paths.front() : path;
  TORCH_CHECK(std::find(paths.begin(), paths.end(), chosen) != paths.end(), "the linear kernel path ", chosen,
              " is not available on this CPU");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "the linear kernel runs on CPU tensors");
  TORCH_CHECK(x.dim() == 2, "x must be [rows, in_features]");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.is_contiguous(),
              "the weight must be packed [panels, in_features, ", kPanel, "]");
  TORCH_CHECK(x.size(1) == packed.size(1), "x has ", x.size(1), " features, the weight takes ", packed.size(1));
  TORCH_CHECK(num_out > 0 && (num_out + kPanel - 1) / kPanel == packed.size(0), "num_out ", num_out,
              " does not fit the packed weight");
  TORCH_CHECK(x.scalar_type() == packed.scalar_type(), "x and the weight must share a dtype");
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
    run_on<float>(chosen, {xf, num_rows, depth, packed.data_ptr<float>(), num_out,
                           bias ? bias->data_ptr<float>() : nullptr, y.data_ptr<float>()});
  } else if (x.scalar_type() == at::kBFloat16) {
    run_on<c10::BFloat16>(chosen, {xf, num_rows, depth, packed.data_ptr<c10::BFloat16>(), num_out,
                                   bias ? bias->data_ptr<c10::BFloat16>() : nullptr, y.data_ptr<c10::BFloat16>()});
  } else {
    TORCH_CHECK(false, "the linear kernel supports float32 and bfloat16, not ", x.scalar_type());
  }
  return y;
}
