// The block tiles of csrc/linear.cpp for one instruction set, included once per set inside a
// namespace that first defines: Vec (kLanes float32 lanes, kVecs = kPanel / kLanes of them a
// panel), kBlockSums (the vector registers a tile may hold as sums), kVectorRegisters (the
// instruction set's vector registers), vbroadcast, vload,
// vstore, vfma, vmul; IVec (kLanes int32 sums), WVec (widened int16 quants), XPair (a row's
// inputs as imadd takes them), ivzero, imadd (sums += adjacent quants times their inputs, in
// pairs), vcvt (int32 to float32, rounded to nearest), inputs_of_pair (a row's two inputs at k
// and k + 1); and the block readers Q4_1Pairs, Q4_KPairs and Q8_0Pairs. A reader widens a
// block's quants four k at a time (`load`): for the pair k = 4u, 4u + 1 kVecs vectors (AVX2:
// outputs 0-7 and 8-15), then kVecs for the pair 4u + 2, 4u + 3; and it reads the block's scales
// d(h) and m(h) for the same parts, h < kVecs.
//
// For row r, output n and block b (32 k), with the row's quantized inputs (QuantizedRows), the
// block's sum is an integer, exact in any order:
//   s = sum over the block's k of q[n, k] * xq[r, k]
// and the output is one chain over b = 0, 1, ... from zero:
//   y = fma(fma(d[n, b], float(s), m[n, b] * float(xsum[r, b])), xscale[r, b], y)
// (Q8_0: m = 0). The operations are the same in every set, so every set gives the same bits, and
// a row's bits do not depend on the other rows of its step.

constexpr int kQuads = kQuantBlock / 4;  // a block's loads, two steps (pairs of k) each
constexpr int kQuadVecs = 2 * kVecs;     // the vectors of a load
static_assert(kVecs * kLanes == kPanel, "a step's widened vectors are a panel's kVecs parts");
static_assert(kQuads % 2 == 0, "the tiles take a block's quads in pairs");

// Rows of a tile: their sums (kVecs per row and panel) in kBlockSums vector registers, the rest
// left to the rows' input broadcasts, which the compiler hoists above the sums, and the weights.
// With more, it spills, and spilled sums cost more than the extra widening of fewer rows a tile (AVX2: 4 rows of a
// panel, 8 of 16 registers; AVX512: 8 sums of 32).
constexpr int kBlockMaxRows = kBlockSums / kVecs;

// A panel's blocks as they are in memory, each widened as a tile reads it.
template <typename Reader>
struct PackedBlocks {
  const uint8_t* data;
  int64_t blocks;  // per panel
  Reader block(int64_t panel, int64_t b) const { return Reader(data + (panel * blocks + b) * Reader::kBytes); }
};

// Independent chains a tile of kRows rows keeps for each sum (1, 2 or 4: the pairs of a block's k taken in
// turn), as many as kBlockSums registers hold: one row's sixteen multiply-adds a block would otherwise wait on
// each other. Integer sums are exact, so the chains add up to the same bits in any order.
template <int kRows>
constexpr int block_chains() {
  const int room = kBlockSums / (kRows * kVecs);
  return room >= 4 ? 4 : room >= 2 ? 2 : 1;
}

// kRows rows from `row` by the panel `panel`: every block's sums added to `out` ([kRows, kPanel] float32), which
// holds zeros to begin with. One panel a tile: its blocks are one stream in memory, which a core reads faster than
// several streams side by side.
template <typename Reader, int kRows>
void block_tile(const QuantizedRows& x, int64_t row, const PackedBlocks<Reader>& source, int64_t panel, float* out) {
  constexpr int kChains = block_chains<kRows>();
  // The outputs' float32 chains held in registers through the blocks where they fit beside the sums (a load and a
  // store a row and block fewer), else in `out`.
  constexpr bool kHold = kRows * kVecs * (kChains + 1) + 4 <= kVectorRegisters;
  Vec held[kHold ? kRows * kVecs : 1];
  if constexpr (kHold) {
#pragma GCC unroll 32
    for (int i = 0; i < kRows * kVecs; ++i) held[i] = vload(out + i * kLanes);
  }
  const int64_t blocks = x.depth / kQuantBlock;
  for (int64_t b = 0; b < blocks; ++b) {
    const Reader reader = source.block(panel, b);
    prefetch_block_ahead<Reader::kBytes>(reader.block);
    IVec sums[kChains][kRows * kVecs];
#pragma GCC unroll 4
    for (int c = 0; c < kChains; ++c) {
#pragma GCC unroll 32
      for (int i = 0; i < kRows * kVecs; ++i) sums[c][i] = ivzero();
    }
    const int16_t* quants = x.quants + row * x.depth + b * kQuantBlock;
    // Quads in pairs, each pair unrolled so that every step's chain is known when compiled; the pairs not unrolled
    // (a tile of many rows unrolled whole spilled its sums on AVX2: 16 and 64 rows 1.3-1.4x slower).
#pragma GCC unroll 1
    for (int pair = 0; pair < kQuads; pair += 2) {
#pragma GCC unroll 2
      for (int half = 0; half < 2; ++half) {
        const int quad = pair + half;
        WVec w[kQuadVecs];
        reader.load(quad, w);
#pragma GCC unroll 2
        for (int t = 0; t < 2; ++t) {
          IVec* chain = sums[(2 * half + t) % kChains];
#pragma GCC unroll 8
          for (int r = 0; r < kRows; ++r) {
            const XPair inputs = inputs_of_pair(quants + r * x.depth + 4 * quad + 2 * t);
#pragma GCC unroll 2
            for (int h = 0; h < kVecs; ++h) chain[r * kVecs + h] = imadd(chain[r * kVecs + h], w[t * kVecs + h], inputs);
          }
        }
      }
    }
#pragma GCC unroll 4
    for (int c = 1; c < kChains; ++c) {
#pragma GCC unroll 32
      for (int i = 0; i < kRows * kVecs; ++i) sums[0][i] = iadd(sums[0][i], sums[c][i]);
    }
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) {
      const int64_t at = (row + r) * blocks + b;
      const float total = static_cast<float>(x.sums[at]);
      const Vec scale = vbroadcast(x.scales + at), xsum = vbroadcast(&total);
#pragma GCC unroll 2
      for (int h = 0; h < kVecs; ++h) {
        const Vec block = vfma(reader.d(h), vcvt(sums[0][r * kVecs + h]), vmul(reader.m(h), xsum));
        if constexpr (kHold) {
          held[r * kVecs + h] = vfma(block, scale, held[r * kVecs + h]);
        } else {
          float* sum = out + r * kPanel + h * kLanes;
          vstore(sum, vfma(block, scale, vload(sum)));
        }
      }
    }
  }
  if constexpr (kHold) {
#pragma GCC unroll 32
    for (int i = 0; i < kRows * kVecs; ++i) vstore(out + i * kLanes, held[i]);
  }
}

template <typename T, typename Reader>
void run_blocks(const LinearCall<T>& call, const QuantizedRows& x, const uint8_t* data) {
  const int64_t num_panels = (call.num_out + kPanel - 1) / kPanel;
  const PackedBlocks<Reader> packed{data, x.depth / kQuantBlock};
  const int rows_per_tile = static_cast<int>(std::min<int64_t>(call.num_rows, kBlockMaxRows));
  // Every tile widens the panel's quants as it reads them, however many rows the call has: widening a panel once
  // into a scratch for all the row tiles to read was slower at every row count measured (docs/benchmarks.md, "What
  // was tried and rejected"): the scratch (18-48 KB a panel) leaves the first-level cache.
  for_each_share(num_panels, [&](int64_t panel) {
    float* out = thread_scratch<float>(static_cast<size_t>(call.num_rows) * kPanel);  // [rows, kPanel]
    std::fill(out, out + call.num_rows * kPanel, 0.0f);
    for (int64_t row = 0; row < call.num_rows; row += rows_per_tile) {
      const int rows = static_cast<int>(std::min<int64_t>(rows_per_tile, call.num_rows - row));
      with_rows<kBlockMaxRows>(rows,
                               [&]<int kRows>() { block_tile<Reader, kRows>(x, row, packed, panel, out + row * kPanel); });
    }
    call.store(out, panel * kPanel, kPanel);
  });
}

template <typename T>
void run_block_format(const LinearCall<T>& call, WeightFormat format, const QuantizedRows& x, const void* packed) {
  const auto* data = static_cast<const uint8_t*>(packed);
  switch (format) {
    case WeightFormat::kQ4_1:
      return run_blocks<T, Q4_1Pairs>(call, x, data);
    case WeightFormat::kQ4_K:
      return run_blocks<T, Q4_KPairs>(call, x, data);
    default:
      return run_blocks<T, Q8_0Pairs>(call, x, data);
  }
}
