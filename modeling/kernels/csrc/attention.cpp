// Attention of every row of a step over the paged KV cache, reading the pages in place.
//
// The cache is [pages, kv heads, page_size, head_dim]; a sequence's block table lists its
// pages in order, so its position p lies in page table[p / page_size] at p % page_size.
// torch's batched matmul would need those rows gathered into one block per sequence (a
// copy of the whole context every step); here each (query row, kv head) pair is one task
// that reads its keys and values where they lie. Every row is computed alone, by the same
// code, whatever else is in the step and however its sequence was chunked: a verify row
// gives bit for bit what the decode step it stands for gives, and a prefill row what a
// decode step at its place would, which keeps greedy speculation and the prefix cache lossless.
#include "ops.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SPECSERVE_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512DQ__) && defined(__AVX512BW__)
#define SPECSERVE_AVX512 1
#endif
#endif

namespace {

using specserve::exp_float;
using specserve::for_each_share_with;
using specserve::from_float;
using specserve::to_float;

// One attend call's inputs as sizes and raw pointers. Task t is query row t / num_kv_heads
// with kv head t % num_kv_heads: that row's query heads of that kv head over its sequence.
template <typename T>
struct AttendCall {
  int64_t num_rows, num_heads, num_kv_heads, page_size, table_width, max_len, dim, q_row_stride, q_head_stride;
  const T* q;
  const T* keys;
  const T* values;
  const int64_t* tables;    // [sequences, table_width] block tables
  const int64_t* table_of;  // [num_rows] each row's block table
  const int64_t* position_of;
  const int64_t* first_of;  // [num_rows] or null: the first position of each row's run (a sliding window), else 0
  const int64_t* extra_of;  // [num_rows, extra_width] or null: see `attend`
  int64_t extra_width;
  T* out;

  AttendCall(const at::Tensor& q_, const at::Tensor& keys_, const at::Tensor& values_, const at::Tensor& tables_,
             const at::Tensor& rows, const at::Tensor& positions, const c10::optional<at::Tensor>& firsts,
             const c10::optional<at::Tensor>& extra, at::Tensor& out_)
      : num_rows(q_.size(0)), num_heads(q_.size(1)), num_kv_heads(keys_.size(1)), page_size(keys_.size(2)),
        table_width(tables_.size(1)), max_len(tables_.size(1) * keys_.size(2)), dim(q_.size(2)),
        q_row_stride(q_.stride(0)), q_head_stride(q_.stride(1)), q(q_.data_ptr<T>()), keys(keys_.data_ptr<T>()),
        values(values_.data_ptr<T>()), tables(tables_.data_ptr<int64_t>()), table_of(rows.data_ptr<int64_t>()),
        position_of(positions.data_ptr<int64_t>()), first_of(firsts ? firsts->data_ptr<int64_t>() : nullptr), extra_of(extra ? extra->data_ptr<int64_t>() : nullptr),
        extra_width(extra ? extra->size(1) : 0), out(out_.data_ptr<T>()) {}

  int64_t num_tasks() const { return num_rows * num_kv_heads; }
  int64_t row(int64_t task) const { return task / num_kv_heads; }
  int64_t kv_head(int64_t task) const { return task % num_kv_heads; }
  // The row's run starts here: position 0, or the first position inside its sliding window.
  int64_t first(int64_t r) const { return first_of ? first_of[r] : 0; }
  // Positions first .. the row's own (its run), then its extra positions (a tree row's ancestors and itself).
  int64_t length(int64_t task) const {
    const int64_t r = row(task);
    int64_t n = position_of[r] + 1 - first(r);
    for (int64_t e = 0; e < extra_width && extra_of[r * extra_width + e] >= 0; ++e) ++n;
    return n;
  }
  // The sequence position of the task's l-th attended key.
  int64_t key_position(int64_t task, int64_t l) const {
    const int64_t r = row(task);
    const int64_t run = position_of[r] + 1 - first(r);
    return l < run ? first(r) + l : extra_of[r * extra_width + l - run];
  }
  // Where the task's l-th key (and value) starts in the cache, in elements: through the row's block table.
  int64_t key_offset(int64_t task, int64_t l) const {
    const int64_t position = key_position(task, l);
    const int64_t page = tables[table_of[row(task)] * table_width + position / page_size];
    return ((page * num_kv_heads + kv_head(task)) * page_size + position % page_size) * dim;
  }
  // Every attended key's offset, in order, into `offset` (at least length(task) long): the row's run
  // page by page, then its extra positions one by one.
  void key_offsets(int64_t task, int64_t length, int64_t* offset) const {
    // Locals, not members: the stores into `offset` could alias them and make the loop reload each.
    const int64_t r = row(task), size = page_size, row_size = dim, head = kv_head(task), heads = num_kv_heads;
    const int64_t* table = tables + table_of[r] * table_width;
    const int64_t begin = first(r), end = position_of[r] + 1;
    for (int64_t start = begin; start < end;) {
      const int64_t page_end = (start / size + 1) * size;
      const int64_t stop = page_end < end ? page_end : end;
      const int64_t base = ((table[start / size] * heads + head) * size + start % size) * row_size;
      int64_t* out = offset + (start - begin);
      for (int64_t p = 0; p < stop - start; ++p) out[p] = base + p * row_size;
      start = stop;
    }
    for (int64_t l = end - begin; l < length; ++l) offset[l] = key_offset(task, l);
  }
  const T* query(int64_t task, int64_t head) const { return q + row(task) * q_row_stride + head * q_head_stride; }
  T* output(int64_t task, int64_t head) const { return out + (row(task) * num_heads + head) * dim; }
};

// A thread's key offsets: its task's, and those of the task it takes next, found a task ahead so that their
// keys can be asked for while this task's values are summed.
struct TaskOffsets {
  std::vector<int64_t> offset, next_offset;
  int64_t prepared = -1, next_length = 0;

  explicit TaskOffsets(int64_t max_len) : offset(max_len), next_offset(max_len) {}

  // Puts task's offsets in `offset` and returns its length; then `next`'s (-1: none) in `next_offset`, its length
  // in next_length (0 for none). The next task may go to another thread: then the next call finds its own.
  template <typename T>
  int64_t start(const AttendCall<T>& call, int64_t task, int64_t next) {
    int64_t length;
    if (task == prepared) {
      offset.swap(next_offset);
      length = next_length;
    } else {
      length = call.length(task);
      call.key_offsets(task, length, offset.data());
    }
    prepared = next;
    next_length = next >= 0 ? call.length(next) : 0;
    if (next_length > 0) call.key_offsets(next, next_length, next_offset.data());
    return length;
  }
};

// The softmax of a row's `length` scores, in place, in float32. With AVX2 the order of every sum is written out
// (the exponentials' total in 8 lanes, 8 positions at a time, then across the lanes, then the last few positions):
// the same bits from an AVX2 or an AVX512 build, whichever width the compiler would have chosen.
inline void softmax_(float* scores, int64_t length) {
#ifdef SPECSERVE_AVX2
  // The largest score, in 8 lanes then across them (the same value in any order; vmaxps(a, b) is a > b ? a : b).
  __m256 largest = _mm256_set1_ps(scores[0]);
  int64_t l = 0;
  for (; l + 8 <= length; l += 8) largest = _mm256_max_ps(_mm256_loadu_ps(scores + l), largest);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, largest);
  for (; l < length; ++l) lanes[0] = scores[l] > lanes[0] ? scores[l] : lanes[0];
  float top = lanes[0];
  for (int64_t i = 1; i < 8; ++i) top = lanes[i] > top ? lanes[i] : top;
  __m256 sums = _mm256_setzero_ps();
  l = 0;
#ifdef SPECSERVE_AVX512
  for (const __m512 shift = _mm512_set1_ps(top); l + 16 <= length; l += 16) {
    const __m512 e = specserve::exp_lanes<specserve::Lanes16>(_mm512_sub_ps(_mm512_loadu_ps(scores + l), shift));
    _mm512_storeu_ps(scores + l, e);
    sums = _mm256_add_ps(sums, _mm512_castps512_ps256(e));
    sums = _mm256_add_ps(sums, _mm512_extractf32x8_ps(e, 1));
  }
#endif
  for (const __m256 shift = _mm256_set1_ps(top); l + 8 <= length; l += 8) {
    const __m256 e = specserve::exp_lanes<specserve::Lanes8>(_mm256_sub_ps(_mm256_loadu_ps(scores + l), shift));
    _mm256_storeu_ps(scores + l, e);
    sums = _mm256_add_ps(sums, e);
  }
  float rest = 0.0f;  // the last few positions' exponentials, in one vector, then added one by one
  if (l < length) {
    alignas(32) float tail[8] = {};
    std::memcpy(tail, scores + l, static_cast<size_t>(length - l) * sizeof(float));
    _mm256_store_ps(tail, specserve::exp_lanes<specserve::Lanes8>(_mm256_sub_ps(_mm256_load_ps(tail), _mm256_set1_ps(top))));
    std::memcpy(scores + l, tail, static_cast<size_t>(length - l) * sizeof(float));
    for (int64_t i = 0; i < length - l; ++i) rest += tail[i];
  }
  _mm256_store_ps(lanes, sums);
  const float total = specserve::sum_lane_tree(lanes) + rest;
#else
  // The largest score, in 8 lanes then across them (the same value in any order).
  float lanes[8];
  for (int64_t i = 0; i < 8; ++i) lanes[i] = scores[0];
  int64_t l = 0;
  for (; l + 8 <= length; l += 8) {
    for (int64_t i = 0; i < 8; ++i) lanes[i] = scores[l + i] > lanes[i] ? scores[l + i] : lanes[i];
  }
  for (; l < length; ++l) lanes[0] = scores[l] > lanes[0] ? scores[l] : lanes[0];
  float top = lanes[0];
  for (int64_t i = 1; i < 8; ++i) top = lanes[i] > top ? lanes[i] : top;
  float total = 0.0f;
#pragma omp simd reduction(+ : total)
  for (int64_t l = 0; l < length; ++l) {
    scores[l] = exp_float(scores[l] - top);
    total += scores[l];
  }
#endif
  const float inverse = 1.0f / total;
#pragma omp simd
  for (int64_t l = 0; l < length; ++l) scores[l] *= inverse;
}

// kDim and kGroup, when not 0, fix head_dim and the query heads per kv head at compile
// time, so the per-position loops unroll into a few vector instructions. Every row, with
// extra positions or not, reads its keys through one list of offsets (its pages', through
// its block table), so a tree row stays bit for bit its decode step.
template <typename T, int64_t kDim, int64_t kGroup>
void attend_rows(const AttendCall<T>& call, double scale) {
  const int64_t dim = kDim ? kDim : call.dim;
  const int64_t group = kGroup ? kGroup : call.num_heads / call.num_kv_heads;
  const int64_t max_len = call.max_len;
  const float softmax_scale = static_cast<float>(scale);

  for_each_share_with(call.num_tasks(), [&] {
    return [&, query = std::vector<float>(group * dim), scores = std::vector<float>(group * max_len),
            acc = std::vector<float>(group * dim), row = std::vector<float>(dim),
            offset = std::vector<int64_t>(max_len)](int64_t task, int64_t) mutable {  // offset: the l-th key's
      const int64_t kv_head = call.kv_head(task), length = call.length(task);
      const T* k_rows = call.keys;
      const T* v_rows = call.values;
      call.key_offsets(task, length, offset.data());
      float* qf = query.data();
      float* rf = row.data();
      float* sf = scores.data();
      float* af = acc.data();
      for (int64_t g = 0; g < group; ++g) {
        const T* src = call.query(task, kv_head * group + g);
        for (int64_t d = 0; d < dim; ++d) qf[g * dim + d] = to_float(src[d]) * softmax_scale;
      }
      for (int64_t l = 0; l < length; ++l) {
        const T* k = k_rows + offset[l];
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) rf[d] = to_float(k[d]);
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qf + g * dim;
          float s = 0.0f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < dim; ++d) s += qg[d] * rf[d];
          sf[g * max_len + l] = s;
        }
      }
      for (int64_t g = 0; g < group; ++g) softmax_(sf + g * max_len, length);
      for (int64_t i = 0; i < group * dim; ++i) af[i] = 0.0f;
      for (int64_t l = 0; l < length; ++l) {
        const T* v = v_rows + offset[l];
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) rf[d] = to_float(v[d]);
        for (int64_t g = 0; g < group; ++g) {
          const float p = sf[g * max_len + l];
          float* ag = af + g * dim;
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) ag[d] += p * rf[d];
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        T* dst = call.output(task, kv_head * group + g);
        for (int64_t d = 0; d < dim; ++d) dst[d] = from_float<T>(af[g * dim + d]);
      }
    };
  });
}

// Whether the vector paths take heads of this shape: head_dim 64 or 128, 1 to 8 query heads a kv head (others
// take the generic loops).
bool vector_shape(int64_t dim, int64_t group) { return (dim == 64 || dim == 128) && group >= 1 && group <= 8; }

#ifdef SPECSERVE_AVX2
// The path for head_dim 64 and 128 on CPUs with AVX2 and FMA (kGroup query heads per kv
// head): scores 8 positions at a time, each a chain of FMAs over the head dimension in 8
// lanes, the 8 positions' lanes then summed in one transposing tree (each key vector widened
// once for up to 3 heads, 4 positions a pass, in the same order); the softmax as the
// generic path's; then the weighted sum of values, 8 positions at a time, in tiles of heads and
// dimensions held in registers. The same order for every row, tree rows included.
//
// The cache is read from memory, a task's pages at a few KiB each: too short a run for the
// hardware's prefetcher to reach full speed. So each block of keys asks for its values (read
// once the softmax is done), and each block of values for the next task's keys: two
// streams in flight where the loops alone would have one.

using specserve::Lanes8;

// r[j] = sum of a[j]'s 8 lanes, for j = 0..7.
inline __m256 sum_lanes_8(const __m256* a) {
  const __m256 h01 = _mm256_hadd_ps(a[0], a[1]), h23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 h45 = _mm256_hadd_ps(a[4], a[5]), h67 = _mm256_hadd_ps(a[6], a[7]);
  // Low 128 bits: the low halves' sums of a[0..3] (of a[4..7]); high 128 bits: the high halves'.
  const __m256 low = _mm256_hadd_ps(h01, h23), high = _mm256_hadd_ps(h45, h67);
  return _mm256_add_ps(_mm256_permute2f128_ps(low, high, 0x20), _mm256_permute2f128_ps(low, high, 0x31));
}

// r[j] = sum of a[j]'s 8 lanes, for j = 0..3, in sum_lanes_8's order.
inline __m128 sum_lanes_4(const __m256* a) {
  const __m256 sums = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  return _mm_add_ps(_mm256_castps256_ps128(sums), _mm256_extractf128_ps(sums, 1));
}

// The scores of kGroup heads at the 8 positions from k[0], kPositions positions at a time: each key
// vector is widened once for all kGroup heads. Each score is the chain of FMAs over the head dimension
// in 8 lanes, then its lanes' tree, whatever kPositions is.
template <typename T, int64_t kDim, int64_t kGroup, int64_t kPositions>
inline void score_block(const T* const* k, const float (*query)[kDim], float* scores, int64_t stride) {
  static_assert(kPositions == 4 || kPositions == 8, "4 or 8 positions a pass");
  for (int64_t first = 0; first < 8; first += kPositions) {
    __m256 a[kGroup][kPositions];
    for (int64_t g = 0; g < kGroup; ++g) {
      for (int64_t j = 0; j < kPositions; ++j) a[g][j] = _mm256_setzero_ps();
    }
    for (int64_t c = 0; c < kDim / 8; ++c) {
      for (int64_t j = 0; j < kPositions; ++j) {
        const __m256 key = Lanes8::load(k[first + j] + 8 * c);
        for (int64_t g = 0; g < kGroup; ++g) a[g][j] = _mm256_fmadd_ps(key, _mm256_load_ps(query[g] + 8 * c), a[g][j]);
      }
    }
    for (int64_t g = 0; g < kGroup; ++g) {
      if constexpr (kPositions == 8) {
        _mm256_storeu_ps(scores + g * stride, sum_lanes_8(a[g]));
      } else {
        _mm_storeu_ps(scores + g * stride + first, sum_lanes_4(a[g]));
      }
    }
  }
}

// The scores of all kGroup heads at the 8 positions from k[0]: up to 3 heads a pass by 4 positions (12 sums
// and a key vector of the 16 registers), a head left alone by 8.
template <typename T, int64_t kDim, int64_t kGroup, int64_t kFirst = 0>
inline void score_heads(const T* const* k, const float (*query)[kDim], float* scores, int64_t stride) {
  constexpr int64_t kLeft = kGroup - kFirst;
  if constexpr (kLeft > 0) {
    constexpr int64_t kHeads = kLeft < 3 ? kLeft : 3;
    score_block<T, kDim, kHeads, kHeads == 1 ? 8 : 4>(k, query + kFirst, scores + kFirst * stride, stride);
    score_heads<T, kDim, kGroup, kFirst + kHeads>(k, query, scores, stride);
  }
}

// The weighted sums of positions [l0, stop) of the values for dimensions L::kLanes * c0 .. L::kLanes * (c0 +
// kTile) - 1 of kGroup heads, added to sums[g * stride + d] (zero for l0 = 0): each sum one chain over the
// positions in order, in 8 lanes a vector or 16 (Lanes8, Lanes16), so the same bits.
template <typename L, typename T, int64_t kGroup, int64_t kTile>
inline void sum_values(const T* values, const int64_t* offset, const float* weights, int64_t weights_stride, int64_t l0,
                       int64_t stop, int64_t c0, float* sums, int64_t stride) {
  constexpr int64_t kLanes = L::kLanes;
  typename L::V acc[kGroup][kTile];
  for (int64_t g = 0; g < kGroup; ++g) {
    for (int64_t c = 0; c < kTile; ++c) {
      acc[g][c] = l0 == 0 ? L::zero() : L::load_aligned(sums + g * stride + kLanes * (c0 + c));
    }
  }
  for (int64_t l = l0; l < stop; ++l) {
    const T* v = values + offset[l] + kLanes * c0;
    typename L::V row[kTile];
    for (int64_t c = 0; c < kTile; ++c) row[c] = L::load(v + kLanes * c);
    for (int64_t g = 0; g < kGroup; ++g) {
      const typename L::V p = L::set1(weights[g * weights_stride + l]);
      for (int64_t c = 0; c < kTile; ++c) acc[g][c] = L::fma(p, row[c], acc[g][c]);
    }
  }
  for (int64_t g = 0; g < kGroup; ++g) {
    for (int64_t c = 0; c < kTile; ++c) L::store_aligned(sums + g * stride + kLanes * (c0 + c), acc[g][c]);
  }
}

// Asks for a cache row's lines to be brought into the second-level cache.
template <typename T, int64_t kDim>
inline void prefetch_row(const T* row) {
  for (int64_t line = 0; line < kDim * static_cast<int64_t>(sizeof(T)); line += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(row) + line, _MM_HINT_T1);
  }
}

// The AVX2 path's kernels: 8 lanes a vector.
struct Avx2 {
  using Lanes = Lanes8;
  static constexpr int64_t kRegisters = 16;

  template <typename T, int64_t kDim, int64_t kGroup>
  static void scores(const T* const* k, const float (*query)[kDim], float* out, int64_t stride) {
    score_heads<T, kDim, kGroup>(k, query, out, stride);
  }
};

#ifdef SPECSERVE_AVX512
// The AVX512 path: the AVX2 path's sums, lane for lane, two positions' (scores) or 16 dimensions' (values) in each
// 16-lane vector, so half the instructions for the same bits.

// Dimensions 8 * c .. 8 * c + 7 of two keys in one vector: the first's in the low 8 lanes, the second's in the high.
inline __m512 load8x2(const float* a, const float* b) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(a)), _mm256_loadu_ps(b), 1);
}
inline __m512 load8x2(const c10::BFloat16* a, const c10::BFloat16* b) {
  const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))),
                                               _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(both), 16));
}

// score_block's scores for kHeads heads at 8 positions: position 2p's 8 lanes of a sum in the low half of a[g][p],
// 2p + 1's in the high half, each lane the same chain of FMAs as there, then the same tree over the 8 lanes.
template <typename T, int64_t kDim, int64_t kHeads>
inline void score_block_avx512(const T* const* k, const float (*query)[kDim], float* scores, int64_t stride) {
  __m512 a[kHeads][4];
  for (int64_t g = 0; g < kHeads; ++g) {
    for (int64_t p = 0; p < 4; ++p) a[g][p] = _mm512_setzero_ps();
  }
  for (int64_t c = 0; c < kDim / 8; ++c) {
    __m512 q[kHeads];
    for (int64_t g = 0; g < kHeads; ++g) q[g] = _mm512_broadcast_f32x8(_mm256_load_ps(query[g] + 8 * c));
    for (int64_t p = 0; p < 4; ++p) {
      const __m512 keys = load8x2(k[2 * p] + 8 * c, k[2 * p + 1] + 8 * c);
      for (int64_t g = 0; g < kHeads; ++g) a[g][p] = _mm512_fmadd_ps(keys, q[g], a[g][p]);
    }
  }
  for (int64_t g = 0; g < kHeads; ++g) {
    __m256 lanes[8];
    for (int64_t p = 0; p < 4; ++p) {
      lanes[2 * p] = _mm512_castps512_ps256(a[g][p]);
      lanes[2 * p + 1] = _mm512_extractf32x8_ps(a[g][p], 1);
    }
    _mm256_storeu_ps(scores + g * stride, sum_lanes_8(lanes));
  }
}

// Up to 6 heads a pass (24 sums, their queries and a key vector of the 32 registers).
template <typename T, int64_t kDim, int64_t kGroup, int64_t kFirst = 0>
inline void score_heads_avx512(const T* const* k, const float (*query)[kDim], float* scores, int64_t stride) {
  constexpr int64_t kLeft = kGroup - kFirst;
  if constexpr (kLeft > 0) {
    constexpr int64_t kHeads = kLeft < 6 ? kLeft : 6;
    score_block_avx512<T, kDim, kHeads>(k, query + kFirst, scores + kFirst * stride, stride);
    score_heads_avx512<T, kDim, kGroup, kFirst + kHeads>(k, query, scores, stride);
  }
}

struct Avx512 {
  using Lanes = specserve::Lanes16;
  static constexpr int64_t kRegisters = 32;

  template <typename T, int64_t kDim, int64_t kGroup>
  static void scores(const T* const* k, const float (*query)[kDim], float* out, int64_t stride) {
    score_heads_avx512<T, kDim, kGroup>(k, query, out, stride);
  }
};
#endif

template <typename Isa, typename T, int64_t kDim, int64_t kGroup>
void attend_rows_simd(const AttendCall<T>& call, double scale) {
  constexpr int64_t kChunks = kDim / Isa::Lanes::kLanes;
  // The values' tiles: kGroup heads by kTile vectors of dimensions (the last tile what is left),
  // their sums, the value row's vectors and a weight in the vector registers.
  constexpr int64_t kFits = (Isa::kRegisters - 1) / (kGroup + 1);
  constexpr int64_t kTile = kFits < kChunks ? kFits : kChunks;
  const float softmax_scale = static_cast<float>(scale);
  const int64_t padded_len = (call.max_len + 7) / 8 * 8;

  for_each_share_with(call.num_tasks(), [&] {
    return [&, scores = std::vector<float>(kGroup * padded_len), offsets = TaskOffsets(call.max_len)](
               int64_t task, int64_t next) mutable {
      // The task's l-th key and value row, from the cache's start; and the next task's.
      const int64_t kv_head = call.kv_head(task), length = offsets.start(call, task, next);
      const int64_t* offset = offsets.offset.data();
      const int64_t* next_offset = offsets.next_offset.data();
      const int64_t next_length = offsets.next_length;
      alignas(64) float query[kGroup][kDim];
      for (int64_t g = 0; g < kGroup; ++g) {
        const T* src = call.query(task, kv_head * kGroup + g);
        for (int64_t d = 0; d < kDim; ++d) query[g][d] = to_float(src[d]) * softmax_scale;
      }
      // Scores, 8 positions at a time (a last block's missing positions score 0 and are never read).
      for (int64_t l0 = 0; l0 < length; l0 += 8) {
        const int64_t count = length - l0 < 8 ? length - l0 : 8;
        const T* k[8];
        for (int64_t j = 0; j < 8; ++j) k[j] = call.keys + offset[j < count ? l0 + j : l0];
        for (int64_t j = 0; j < count; ++j) prefetch_row<T, kDim>(call.values + offset[l0 + j]);
        Isa::template scores<T, kDim, kGroup>(k, query, scores.data() + l0, padded_len);
      }
      for (int64_t g = 0; g < kGroup; ++g) softmax_(scores.data() + g * padded_len, length);
      // The values a block of positions at a time, every tile of the block before the next block, the
      // tiles' sums kept in `sums` between blocks (storing a float32 and loading it back is exact, so
      // each sum is still one chain over the positions in order): each value row is read from memory
      // once, while the block's sums are computed, rather than in the first of kChunks / kTile passes.
      constexpr int64_t kBlock = 8;
      const T* values = call.values;
      const float* weights = scores.data();
      alignas(64) float sums[kGroup][kDim];
      if (length == 0) std::fill(&sums[0][0], &sums[0][0] + kGroup * kDim, 0.0f);  // a run left empty: zeros
      for (int64_t l0 = 0; l0 < length; l0 += kBlock) {
        const int64_t stop = length - l0 < kBlock ? length : l0 + kBlock;
        for (int64_t l = l0; l < stop && l < next_length; ++l) prefetch_row<T, kDim>(call.keys + next_offset[l]);
        using Lanes = typename Isa::Lanes;
        for (int64_t c0 = 0; c0 + kTile <= kChunks; c0 += kTile) {
          sum_values<Lanes, T, kGroup, kTile>(values, offset, weights, padded_len, l0, stop, c0, &sums[0][0], kDim);
        }
        if constexpr (kChunks % kTile != 0) {
          sum_values<Lanes, T, kGroup, kChunks % kTile>(values, offset, weights, padded_len, l0, stop,
                                                        kChunks - kChunks % kTile, &sums[0][0], kDim);
        }
      }
      for (int64_t g = 0; g < kGroup; ++g) {
        T* dst = call.output(task, kv_head * kGroup + g);
        for (int64_t d = 0; d < kDim; ++d) dst[d] = from_float<T>(sums[g][d]);
      }
    };
  });
}

template <typename Isa, typename T, int64_t kDim, int64_t kGroup = 1>
bool attend_simd_group(const AttendCall<T>& call, double scale, int64_t group) {
  if constexpr (kGroup <= 8) {
    if (group == kGroup) {
      attend_rows_simd<Isa, T, kDim, kGroup>(call, scale);
      return true;
    }
    return attend_simd_group<Isa, T, kDim, kGroup + 1>(call, scale, group);
  }
  return false;
}

template <typename Isa, typename T>
bool attend_simd(const AttendCall<T>& call, double scale) {
  const int64_t group = call.num_heads / call.num_kv_heads;
  if (!vector_shape(call.dim, group)) return false;
  return (call.dim == 64 && attend_simd_group<Isa, T, 64>(call, scale, group)) ||
         (call.dim == 128 && attend_simd_group<Isa, T, 128>(call, scale, group));
}
#endif

// The paths this build has on this CPU, fastest first. "avx512" and "avx2" give the same bits (the same sums, lane for
// lane); "generic" is the compiler's vectorization of plain loops, for any head_dim and any CPU.
const std::vector<std::string>& paths_here() {
  static const std::vector<std::string> paths = [] {
    std::vector<std::string> found;
#ifdef SPECSERVE_AVX512
    found.emplace_back("avx512");
#endif
#ifdef SPECSERVE_AVX2
    found.emplace_back("avx2");
#endif
    found.emplace_back("generic");
    return found;
  }();
  return paths;
}

// A path named by a caller: one of paths_here(), or "" for the first.
std::string chosen_path(const std::string& path) {
  const std::vector<std::string>& paths = paths_here();
  if (path.empty()) return paths.front();
  std::string known;
  for (const std::string& name : paths) {
    if (name == path) return name;
    known += (known.empty() ? "" : ", ") + name;
  }
  TORCH_CHECK(false, "attention path '", path, "' is not one of this build's: ", known);
}

template <typename T>
void attend_dispatch(const AttendCall<T>& call, double scale, const std::string& path) {
  const int64_t dim = call.dim, group = call.num_heads / call.num_kv_heads;
#ifdef SPECSERVE_AVX512
  if (path == "avx512" && attend_simd<Avx512>(call, scale)) return;
#endif
#ifdef SPECSERVE_AVX2
  if ((path == "avx512" || path == "avx2") && attend_simd<Avx2>(call, scale)) return;
#endif
  if (dim == 64 && group == 3) {
    attend_rows<T, 64, 3>(call, scale);
  } else if (dim == 64 && group == 4) {
    attend_rows<T, 64, 4>(call, scale);
  } else if (dim == 128 && group == 4) {
    attend_rows<T, 128, 4>(call, scale);
  } else if (dim == 64) {
    attend_rows<T, 64, 0>(call, scale);
  } else if (dim == 128) {
    attend_rows<T, 128, 0>(call, scale);
  } else {
    attend_rows<T, 0, 0>(call, scale);
  }
}

void check_cache(const at::Tensor& keys, const at::Tensor& values) {
  TORCH_CHECK(keys.device().is_cpu() && values.device().is_cpu(), "the cache kernels run on CPU tensors");
  TORCH_CHECK(keys.dim() == 4 && keys.size(1) > 0 && keys.is_contiguous() && values.sizes() == keys.sizes() &&
                  values.is_contiguous(),
              "keys and values must be contiguous [pages, kv_heads, page_size, head_dim] with kv_heads > 0");
  TORCH_CHECK(values.scalar_type() == keys.scalar_type(), "keys and values must share a dtype");
}

void check_index(const at::Tensor& index, int64_t num_rows, const char* name) {
  TORCH_CHECK(index.device().is_cpu() && index.scalar_type() == at::kLong && index.dim() == 1 && index.is_contiguous() &&
                  index.numel() == num_rows,
              name, " must be a contiguous int64 CPU tensor with one entry per row");
}

// Every row names a block table, and every position it attends lies inside that table's pages.
void check_rows(const at::Tensor& keys, const at::Tensor& tables, const at::Tensor& rows, const at::Tensor& positions,
                int64_t num_rows) {
  TORCH_CHECK(tables.device().is_cpu() && tables.scalar_type() == at::kLong && tables.dim() == 2 && tables.is_contiguous() &&
                  tables.size(1) > 0,
              "block tables must be a contiguous int64 CPU tensor [sequences, pages]");
  check_index(rows, num_rows, "rows");
  check_index(positions, num_rows, "positions");
  const int64_t num_pages = keys.size(0), width = tables.size(1), max_len = width * keys.size(2);
  const int64_t* page = tables.data_ptr<int64_t>();
  for (int64_t i = 0; i < tables.numel(); ++i) {
    TORCH_CHECK(page[i] >= 0 && page[i] < num_pages, "block table entry ", page[i], " is outside the cache's ", num_pages, " pages");
  }
  const int64_t* table_of = rows.data_ptr<int64_t>();
  const int64_t* position_of = positions.data_ptr<int64_t>();
  for (int64_t row = 0; row < num_rows; ++row) {
    TORCH_CHECK(table_of[row] >= 0 && table_of[row] < tables.size(0), "row ", row, ": block table ", table_of[row],
                " does not exist");
    TORCH_CHECK(position_of[row] >= 0 && position_of[row] < max_len, "row ", row, ": position ", position_of[row],
                " is outside its block table's ", max_len, " positions");
  }
}

// A row's run starts at or after position 0 and at most one past its last position (a tree
// node's run may be empty when its window starts among its ancestors).
void check_firsts(const at::Tensor& firsts, const at::Tensor& positions, int64_t num_rows) {
  check_index(firsts, num_rows, "firsts");
  const int64_t* first_of = firsts.data_ptr<int64_t>();
  const int64_t* position_of = positions.data_ptr<int64_t>();
  for (int64_t row = 0; row < num_rows; ++row) {
    TORCH_CHECK(first_of[row] >= 0 && first_of[row] <= position_of[row] + 1, "row ", row, ": first position ",
                first_of[row], " is outside 0 .. ", position_of[row] + 1);
  }
}

// A tree row's extra positions: ascending, past the row's contiguous run and inside its
// block table, then -1s only (the padding of rows with fewer).
void check_extra(const at::Tensor& extra, const at::Tensor& positions, int64_t num_rows, int64_t max_len) {
  TORCH_CHECK(extra.device().is_cpu() && extra.scalar_type() == at::kLong && extra.dim() == 2 && extra.is_contiguous() &&
                  extra.size(0) == num_rows,
              "extra must be a contiguous int64 CPU tensor [rows, width]");
  const int64_t width = extra.size(1);
  const int64_t* extra_of = extra.data_ptr<int64_t>();
  const int64_t* position_of = positions.data_ptr<int64_t>();
  for (int64_t row = 0; row < num_rows; ++row) {
    int64_t last = position_of[row];
    bool padding = false;
    for (int64_t e = 0; e < width; ++e) {
      const int64_t at = extra_of[row * width + e];
      if (at < 0) {
        TORCH_CHECK(at == -1, "row ", row, ": extra position ", at, " (padding is -1)");
        padding = true;
        continue;
      }
      TORCH_CHECK(!padding && at > last && at < max_len, "row ", row, ": extra position ", at,
                  " must follow the row's earlier positions, before any padding, inside its block table");
      last = at;
    }
  }
}

at::Tensor attend_with(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& tables,
                       const at::Tensor& rows, const at::Tensor& positions, double scale,
                       const c10::optional<at::Tensor>& firsts, const c10::optional<at::Tensor>& extra,
                       const std::string& path_name) {
  const std::string path = chosen_path(path_name);
  check_cache(keys, values);
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 3 && q.stride(2) == 1,
              "q must be a CPU tensor [rows, heads, head_dim] with head_dim contiguous");
  TORCH_CHECK(q.scalar_type() == keys.scalar_type(), "q and the cache must share a dtype");
  TORCH_CHECK(keys.size(3) == q.size(2) && q.size(1) % keys.size(1) == 0, "q's heads and head_dim do not fit the cache");
  check_rows(keys, tables, rows, positions, q.size(0));
  if (firsts) check_firsts(*firsts, positions, q.size(0));
  if (extra) check_extra(*extra, positions, q.size(0), tables.size(1) * keys.size(2));
  at::Tensor out = at::empty({q.size(0), q.size(1) * q.size(2)}, q.options());
  const c10::optional<at::Tensor> with_extra = extra && extra->numel() > 0 ? extra : c10::nullopt;
  if (q.scalar_type() == at::kFloat) {
    attend_dispatch<float>(AttendCall<float>(q, keys, values, tables, rows, positions, firsts, with_extra, out), scale, path);
  } else if (q.scalar_type() == at::kBFloat16) {
    attend_dispatch<c10::BFloat16>(AttendCall<c10::BFloat16>(q, keys, values, tables, rows, positions, firsts, with_extra, out),
                                   scale, path);
  } else {
    TORCH_CHECK(false, "the attention kernel supports float32 and bfloat16, not ", q.scalar_type());
  }
  return out;
}

}  // namespace

// q [N, H, D] (rows and heads may be strided, head_dim contiguous) over keys, values
// [pages, KVH, page_size, D]: row n attends positions firsts[n] (0 without firsts: a
// sliding window's start otherwise) .. positions[n] of the sequence whose block table is
// tables[rows[n]]. Returns [N, H * D] in q's dtype; scores, softmax and sums in float32.
at::Tensor attend(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& tables,
                  const at::Tensor& rows, const at::Tensor& positions, double scale, const c10::optional<at::Tensor>& firsts,
                  const std::string& path) {
  return attend_with(q, keys, values, tables, rows, positions, scale, firsts, c10::nullopt, path);
}

// Like attend, and then row n attends the positions in extra [N, E] up to its first -1,
// in order. A token tree's node attends that way to the sequence's standing positions and
// then to its ancestors' and its own, which lie further on among other branches'.
at::Tensor attend_tree(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& tables,
                       const at::Tensor& rows, const at::Tensor& positions, const at::Tensor& extra, double scale,
                       const c10::optional<at::Tensor>& firsts, const std::string& path) {
  return attend_with(q, keys, values, tables, rows, positions, scale, firsts, extra, path);
}

std::vector<std::string> attention_paths() { return paths_here(); }

// The path `attend` takes for heads of this shape when asked for `path` ("" for the fastest): that path, or
// "generic" where the vector paths do not take the shape.
std::string attention_path_for(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, const std::string& path) {
  TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0 && head_dim > 0,
              "heads must be whole groups of query heads a kv head, and head_dim positive");
  const std::string chosen = chosen_path(path);
  return vector_shape(head_dim, num_heads / num_kv_heads) ? chosen : "generic";
}

// Writes k, v [N, KVH, D] (rows and heads may be strided) at (pages[n], :, offsets[n]).
void store(const at::Tensor& k, const at::Tensor& v, at::Tensor& keys, at::Tensor& values, const at::Tensor& pages,
           const at::Tensor& offsets) {
  check_cache(keys, values);
  TORCH_CHECK(k.device().is_cpu() && v.device().is_cpu(), "the cache store runs on CPU tensors");
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.sizes() == v.sizes() && k.stride(2) == 1 && v.stride(2) == 1,
              "k and v must be [rows, kv_heads, head_dim] with head_dim contiguous");
  TORCH_CHECK(k.scalar_type() == keys.scalar_type() && v.scalar_type() == keys.scalar_type(), "k, v and the cache must share a dtype");
  TORCH_CHECK(k.size(1) == keys.size(1) && k.size(2) == keys.size(3), "k's heads and head_dim do not fit the cache");
  const int64_t num_rows = k.size(0), num_kv_heads = k.size(1), dim = k.size(2), page_size = keys.size(2);
  check_index(pages, num_rows, "pages");
  check_index(offsets, num_rows, "offsets");
  const int64_t* page_of = pages.data_ptr<int64_t>();
  const int64_t* offset_of = offsets.data_ptr<int64_t>();
  for (int64_t row = 0; row < num_rows; ++row) {
    TORCH_CHECK(page_of[row] >= 0 && page_of[row] < keys.size(0) && offset_of[row] >= 0 && offset_of[row] < page_size,
                "row ", row, ": page ", page_of[row], " offset ", offset_of[row], " is outside the cache");
  }
  const int64_t bytes = dim * k.element_size();
  const char* k_data = static_cast<const char*>(k.data_ptr());
  const char* v_data = static_cast<const char*>(v.data_ptr());
  char* keys_data = static_cast<char*>(keys.data_ptr());
  char* values_data = static_cast<char*>(values.data_ptr());
  const int64_t item = k.element_size();
  // Blocks of 16 rows shared among the threads (the writes miss the cache, so a second thread gains little, and
  // nothing for a few rows); a decode step of a few rows stays on the calling thread. A step's rows name
  // distinct (page, offset) places (the worker checks that no two sequences write one page).
  constexpr int64_t kRowsEach = 16;
  specserve::for_each_share((num_rows + kRowsEach - 1) / kRowsEach, [&](int64_t block) {
    for (int64_t row = block * kRowsEach; row < std::min(num_rows, (block + 1) * kRowsEach); ++row) {
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        const int64_t dst = ((page_of[row] * num_kv_heads + h) * page_size + offset_of[row]) * bytes;
        std::memcpy(keys_data + dst, k_data + (row * k.stride(0) + h * k.stride(1)) * item, bytes);
        std::memcpy(values_data + dst, v_data + (row * v.stride(0) + h * v.stride(1)) * item, bytes);
      }
    }
  });
}
