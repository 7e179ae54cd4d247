// The float32 and bfloat16 tiles of csrc/linear.cpp for one instruction set, included once per
// set inside a namespace that first defines: Vec, kLanes, kAccumulators (vector registers the
// tile may hold as sums), vzero, vbroadcast, vload (float32 and bfloat16), vfma.
//
// Every output element is one chain vfma(x[m, k], w[k, n], sum) from zero, over k = 0 .. K-1
// for float32 weights and, for bfloat16 weights, over the pairs of k in order, the second of
// each pair first: k = 1, 0, 3, 2, ... (a last k of an odd K alone). That is the order an
// AVX512-BF16 dot product (vdpbf16ps) adds a pair's two exact products in, each rounded, so
// the dot-product tiles (a Panels type with kDot) give these bits too. Tiles differ only in how
// many rows and panels they keep in registers.

constexpr int kVecs = kPanel / kLanes;  // vectors per panel
constexpr int kMaxRows = kAccumulators / kVecs;  // rows of a one-panel tile
constexpr int kMaxPanels = 8;

// Packed panels of plain float32 or bfloat16 weights: [panels, K, kPanel].
template <typename W>
struct DensePanels {
  static constexpr int64_t kBlock = kDepthBlock;  // any k in one block: a tile never crosses one
  static constexpr bool kPairs = std::is_same_v<W, c10::BFloat16>;  // k in pairs, the second first
  // Whether a call's rows take tiles of half the rows a one-panel tile could hold, each streaming two or more
  // panels: float32 weights and few rows. One tile of all the rows would stream one panel, and a core cannot
  // read one stream of weights at the memory's pace; the rows past the tile read the block of panels again from
  // cache. Not for bfloat16, whose every pass widens the weights again, nor for steps of many rows, which are
  // compute bound (measured: docs/benchmarks.md, the roofline).
  static constexpr bool split_rows(int64_t num_rows) { return std::is_same_v<W, float> && num_rows <= kMaxRows; }
  static constexpr bool kDot = false;
  const W* data;
  int64_t depth;  // k per panel

  struct Block {
    const W* at;  // the panel's weights from the block's first k
    void load(int64_t i, Vec* w) const {
#pragma GCC unroll 4
      for (int j = 0; j < kVecs; ++j) w[j] = vload(at + i * kPanel + j * kLanes);
    }
  };
  Block block(int64_t panel, int64_t k) const { return {data + panel * depth * kPanel + k * kPanel}; }
};

// kRows rows of x by kPanels consecutive panels from `first`, sums over k in [begin, end) added to
// `out` ([kRows, kPanels * kPanel], float32), which holds the chains' values after k = begin - 1
// (zero for begin = 0). Storing and reloading a float32 sum is exact, so splitting K this
// way keeps each chain as it is. `begin` is a multiple of the panels' block (an even k).
template <typename Panels, int kRows, int kPanels>
void fma_tile(const float* x, int64_t x_stride, const Panels& panels, int64_t first, int64_t begin, int64_t end,
              float* out) {
  constexpr int kSums = kRows * kPanels * kVecs;  // sum i: row i / (kPanels * kVecs), vector i % (kPanels * kVecs)
  constexpr int kRowVecs = kPanels * kVecs;
  Vec acc[kSums];
#pragma GCC unroll 32
  for (int i = 0; i < kSums; ++i) acc[i] = begin == 0 ? vzero() : vload(out + i * kLanes);
  for (int64_t start = begin; start < end; start += Panels::kBlock) {
    typename Panels::Block blocks[kPanels];
#pragma GCC unroll 8
    for (int p = 0; p < kPanels; ++p) blocks[p] = panels.block(first + p, start);
    const int64_t count = std::min(Panels::kBlock, end - start);
    const auto step = [&](int64_t i) __attribute__((always_inline)) {
      const int64_t k = start + i;
      Vec w[kRowVecs];
#pragma GCC unroll 8
      for (int p = 0; p < kPanels; ++p) blocks[p].load(i, w + p * kVecs);
#pragma GCC unroll 32
      for (int r = 0; r < kRows; ++r) {
        const Vec a = vbroadcast(x + r * x_stride + k);
#pragma GCC unroll 32
        for (int j = 0; j < kRowVecs; ++j) acc[r * kRowVecs + j] = vfma(a, w[j], acc[r * kRowVecs + j]);
      }
    };
    if constexpr (Panels::kPairs) {
      for (int64_t i = 0; i + 1 < count; i += 2) {
        step(i + 1);
        step(i);
      }
      if (count % 2 != 0) step(count - 1);
    } else {
      for (int64_t i = 0; i < count; ++i) step(i);
    }
  }
#pragma GCC unroll 32
  for (int i = 0; i < kSums; ++i) vstore(out + i * kLanes, acc[i]);
}

// The same for the rows from `row` of the call's rows x, on the panels' own tiles where they have them (kDot:
// panels that hold the rows as those tiles read them).
template <typename Panels, int kRows, int kPanels>
void tile(const float* x, int64_t x_stride, int64_t row, const Panels& panels, int64_t first, int64_t begin,
          int64_t end, float* out) {
  if constexpr (Panels::kDot) {
    return panels.template tile<kRows, kPanels>(x, x_stride, row, first, begin, end, out);
  } else {
    fma_tile<Panels, kRows, kPanels>(x + row * x_stride, x_stride, panels, first, begin, end, out);
  }
}

template <typename Panels, int kPanels, int kRows = 1>
void tile_rows(int rows, const float* x, int64_t x_stride, int64_t row, const Panels& panels, int64_t first,
               int64_t begin, int64_t end, float* out) {
  if constexpr (kRows <= kMaxRows && kRows * kPanels * kVecs <= kAccumulators) {
    if (rows == kRows) return tile<Panels, kRows, kPanels>(x, x_stride, row, panels, first, begin, end, out);
    return tile_rows<Panels, kPanels, kRows + 1>(rows, x, x_stride, row, panels, first, begin, end, out);
  }
}

template <typename Panels, int kPanels = 1>
void tile_any(int rows, int num_panels, const float* x, int64_t x_stride, int64_t row, const Panels& panels,
              int64_t first, int64_t begin, int64_t end, float* out) {
  if constexpr (kPanels <= kMaxPanels) {
    if (num_panels == kPanels) return tile_rows<Panels, kPanels>(rows, x, x_stride, row, panels, first, begin, end, out);
    return tile_any<Panels, kPanels + 1>(rows, num_panels, x, x_stride, row, panels, first, begin, end, out);
  }
}

// Panels a tile of `rows` rows holds: few rows leave registers for more panels, whose
// independent chains hide the FMA latency (a single decode row).
inline int panels_for(int rows) { return std::max(1, std::min(kMaxPanels, kAccumulators / (rows * kVecs))); }

template <typename T, typename Panels>
void run(const LinearCall<T>& call, const Panels& panels) {
  const int64_t num_panels = (call.num_out + kPanel - 1) / kPanel;
  const bool split = Panels::split_rows(call.num_rows);
  const int rows_per_tile = static_cast<int>(std::min<int64_t>(call.num_rows, split ? std::max(1, kMaxRows / 2) : kMaxRows));
  const int group = panels_for(rows_per_tile);
  const int64_t num_groups = (num_panels + group - 1) / group;
  // Threads take groups of panels as for_each_share hands them out: on a machine where another process holds a
  // core for a while, the other threads do the rest.
  for_each_share(num_groups, [&](int64_t g) {
    float* out = thread_scratch<float>(static_cast<size_t>(call.num_rows) * group * kPanel);  // [rows, width]
    const int64_t first_panel = g * group;
    const int count = static_cast<int>(std::min<int64_t>(group, num_panels - first_panel));
    const int64_t width = static_cast<int64_t>(count) * kPanel;
    // K in blocks, each over every row: the block of the panels stays in the nearest cache while the rows pass.
    for (int64_t begin = 0; begin < call.depth; begin += kDepthBlock) {
      const int64_t end = std::min(call.depth, begin + kDepthBlock);
      for (int64_t row = 0; row < call.num_rows; row += rows_per_tile) {
        const int rows = static_cast<int>(std::min<int64_t>(rows_per_tile, call.num_rows - row));
        tile_any<Panels>(rows, count, call.x, call.depth, row, panels, first_panel, begin, end, out + row * width);
      }
    }
    call.store(out, first_panel * kPanel, width);
  });
}

template <typename T>
void run_dense(const LinearCall<T>& call, WeightFormat format, const void* packed) {
  if (format == WeightFormat::kBFloat16) {
    return run(call, DensePanels<c10::BFloat16>{static_cast<const c10::BFloat16*>(packed), call.depth});
  }
  return run(call, DensePanels<float>{static_cast<const float*>(packed), call.depth});
}
