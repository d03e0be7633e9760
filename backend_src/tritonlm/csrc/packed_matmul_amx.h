// bfloat16 matmuls in AMX tiles (Intel Sapphire Rapids and later), in the packed matmul's tasks
// and epilogue (packed_matmul_tasks.h, packed_matmul.h); quantized weights' prompts too, each block
// dequantized to bfloat16 first (AmxOnDequantized). The packed layout is the one TDPBF16PS
// multiplies: 16 pair rows of a block's 16 low (or high) features are a B tile as they lie (rows
// 128 bytes apart), and x's rows are A tiles read in place, 32 k a tile row. A tile of up to 32
// rows keeps its sums in four C tiles (16 rows x 16 features each). Used where K is a multiple of
// 32 (a whole B tile per step; other K run the vector tiles).
// On 2 Emerald Rapids cores against oneDNN's AMX matmul, which it replaced: see cpu_gemm.py.
#pragma once
#include "packed_matmul_dequantized.h"

#if defined(TRITONLM_PACKED_MATMUL) && defined(CPU_CAPABILITY_AVX512) && \
    defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define TRITONLM_AMX

namespace tritonlm {
namespace packed_matmul {

struct AmxTiles {
  using X = uint16_t;
  using W = uint16_t;
  using P = void;
  using Isa = Avx512;
  using O = uint16_t;  // bfloat16 outputs only
  static constexpr bool kAmxTiles = true;
  static constexpr bool kGroups = false;
  static constexpr bool kPrewidens = false;
  static constexpr bool kIntegerDots = false;
  static constexpr int kRows = 32;  // two A tiles of 16 rows
  static constexpr int kTileRows = 16;
  static constexpr int64_t kStepPairs = 16;  // pair rows in a B tile: 32 k
  static constexpr int64_t kRowBytes = 64;   // a tile row: 16 float32 or 16 bf16 pairs

  // Tiles 0-3: C, rows [0, 16) x low, x high; rows [16, R) x low, x high. 4, 5: A of those rows;
  // 6, 7: B, low and high. A thread keeps its configuration for R until R changes or its
  // matmul ends.
  static void configure(int rows) {
    if (configured() == rows) return;
    const uint8_t first = std::min(rows, kTileRows), second = rows - first;
    load_tile_config({first, first, second, second, first, second, kStepPairs, kStepPairs},
                     {kRowBytes, kRowBytes, kRowBytes, kRowBytes, kRowBytes, kRowBytes, kRowBytes,
                      kRowBytes});
    configured() = rows;
  }

  template <typename, int R, int kAct>
  static void tile(const Tile<AmxTiles, O>& t) {
    if (!t.prompt) {
      alignas(64) float sums[R][kBlock];  // row r: its 16 low features' sums, then the high ones'
      dot_products<R>(t, [] {});
      store_sums<R>(sums);
      write_outputs<kAct>(t, sums, 0, R);
      return;
    }
    Pending& before = pending();
    const int64_t steps = (t.pairs + kStepPairs - 1) / kStepPairs;
    const int64_t writing_steps = std::max<int64_t>(1, steps - 4);
    const int rows_a_step = static_cast<int>((before.rows + writing_steps - 1) / writing_steps);
    dot_products<R>(t, [&] { before.write_some(rows_a_step); });
    before.write_some(before.rows);
    store_sums<R>(before.sums);
    before.hold(t, R, &write_rows<kAct>);
  }

  // At the end of a thread's share of a matmul: its last tile's outputs written, and the tiles
  // handed back (their 8 KB of state no longer saved at each context switch).
  static void finish() {
    Pending& last = pending();
    last.write_some(last.rows);
    if (configured()) _tile_release();
    configured() = 0;
  }

 private:
  // The tile's sums in its C tiles, calling between(), for work of its own, once a step.
  template <int R, typename Between>
  __attribute__((always_inline)) static void dot_products(const Tile<AmxTiles, O>& t,
                                                          Between between) {
    constexpr bool kTwo = R > kTileRows;  // a second A tile and its two C tiles
    configure(R);
    _tile_zero(0);
    _tile_zero(1);
    if constexpr (kTwo) {
      _tile_zero(2);
      _tile_zero(3);
    }
    const int64_t x_bytes = t.x_stride * static_cast<int64_t>(sizeof(X));
    const X* x_second = t.x + kTileRows * t.x_stride;
    for (int64_t p = 0; p < t.pairs; p += kStepPairs) {
      // Only a lone tile, streaming its block from memory, asks for weights ahead: where a
      // chunk's rows take several tiles, asking for the block into L1 and for the next block
      // into L2 cost more than the hardware's own prefetches (2 cores of an AMX Xeon with 480 MiB
      // of L3, SmolLM2's 30 layers at 48 / 64 / 70 / 96 / 512 rows, interleaved in one process:
      // 21.7 / 23.5 / 25.6 / 27.3 / 99.5 ms with them, 20.5 / 21.7 / 24.6 / 26.2 / 93.3 without;
      // session 52 on Emerald Rapids: the same either way).
      if (t.streams)
        for (int64_t q = p; q < p + kStepPairs; ++q) prefetch_ahead(t, q);
      const W* w = t.w + p * kPairElems<W>;
      _tile_loadd(6, w, kPairElems<W> * sizeof(W));
      _tile_loadd(7, w + kBlock, kPairElems<W> * sizeof(W));
      _tile_loadd(4, t.x + 2 * p, x_bytes);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      if constexpr (kTwo) {
        _tile_loadd(5, x_second + 2 * p, x_bytes);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      between();
    }
  }

  // The C tiles of a tile of R rows into `sums`.
  template <int R>
  __attribute__((always_inline)) static void store_sums(float (*sums)[kBlock]) {
    constexpr bool kTwo = R > kTileRows;
    constexpr int64_t kStride = kBlock * sizeof(float);
    _tile_stored(0, &sums[0][0], kStride);
    _tile_stored(1, &sums[0][16], kStride);
    if constexpr (kTwo) {
      _tile_stored(2, &sums[kTileRows][0], kStride);
      _tile_stored(3, &sums[kTileRows][16], kStride);
    }
  }

  // A tile's sums whose outputs are still to be written. A prompt's tile (Tile::prompt) has its
  // epilogue (bias, rounding, the gated activation) run a few rows at a time inside the next
  // tile's dot products, where the vector units would idle, rather than after them. 2 cores of
  // an AMX Xeon, SmolLM2's 30 layers, as before / deferred, interleaved in one process: 2048 rows
  // 320 / 292 ms, 512 rows 89 / 81, 256 rows 50 / 48; 8 prompts of 1,024 tokens in the engine
  // 2.78 / 2.66 s. The last rows are written 4 steps before the tile's end: written up to its
  // last step, the LM head's outputs (rows 96 KB apart) came 1.04-1.10x slower at 256-2048 rows
  // (a tile store waits for the stores before it, the next epilogue's loads for the tile
  // store). Not at decode's sizes, a chunk's 1-6 tiles a block: deferred there, 68 and 128 rows
  // gained nothing (1.00, 0.98x) and the LM head at 96-128 rows came 1.08x slower.
  struct Pending {
    alignas(64) float sums[kRows][kBlock];  // row r: its 16 low features' sums, then the high
    Tile<AmxTiles, O> t{};
    int rows = 0;  // rows still to write are [next, rows)
    int next = 0;
    void (*write)(const Pending&, int, int) = nullptr;

    void write_some(int n) {
      if (next >= rows) return;
      const int end = std::min(rows, next + n);
      write(*this, next, end);
      next = end;
    }
    void hold(const Tile<AmxTiles, O>& tile, int r, void (*fn)(const Pending&, int, int)) {
      t = tile;
      rows = r;
      next = 0;
      write = fn;
    }
  };

  // Rows [begin, end) of a tile's outputs from its sums.
  template <int kAct>
  __attribute__((always_inline)) static void write_outputs(const Tile<AmxTiles, O>& t,
                                                           const float (*sums)[kBlock],
                                                           int begin, int end) {
    const Epilogue<AmxTiles, O> out(t);
    for (int r = begin; r < end; ++r) {
      __m512 acc[2] = {_mm512_load_ps(sums[r]), _mm512_load_ps(sums[r] + 16)};
      out.template write<kAct>(acc, r);
    }
  }

  template <int kAct>
  static void write_rows(const Pending& p, int begin, int end) {
    write_outputs<kAct>(p.t, p.sums, begin, end);
  }

  static Pending& pending() {
    thread_local Pending held;
    return held;
  }

  static int& configured() {  // the rows this thread's tiles are configured for, or 0
    thread_local int rows = 0;
    return rows;
  }
};

// Whether AMX tiles take a matmul over k input features here: whole B tiles, and the tile state.
inline bool amx_takes(int64_t k) {
  return k % (2 * AmxTiles::kStepPairs) == 0 && amx_permitted();
}

// A quantized weight's prompt in AMX tiles, each block dequantized to bfloat16 first.
template <typename Q>
using AmxOnDequantized = OnDequantized<Q, AmxTiles>;

}  // namespace packed_matmul
}  // namespace tritonlm

#endif
