// Grouped int8 weights (GGUF Q8_0 blocks: int8 codes, an fp16 d per row and group of 32) times x in integers:
// kakeya::q8_linear, y = x W^T (+ b) with W = q * d; kakeya::q8_dequant, W rounded once to bf16.
//
// Why: Q8_0 is both bundled models' LM head (Gemma 3's, 262144 x 640, is 178 MB a decode step reads). Dequantizing
// it to bf16 before multiplying, as quant_linear.cpp does its formats, ran at ~21 GB/s on the Xeon, bound by the
// unpacking (per 16 x 32 tile: widen, convert, scale, round, pack, then the products), not by memory. Here a group's
// products are integer dot products of the codes as they lie in memory (vpdpbusd, or AMX int8 tiles).
//
// Layout (engine/weights.py's pack_q8_tiles): 16 x 32 tiles, tile (b, s) = rows 16b.., columns 32s.. at byte
// (b * K/32 + s) * 512, holding W[16b + n][32s + 4j + i] at byte (16 j + n) * 4 + i: each 64-byte line is one 4-column
// slice of the 16 rows, the operand layout of vpdpbusd (16 lanes, 4 bytes each) and of an AMX int8 B tile (8 rows of
// 64 bytes) alike. sz: (N/16, K/32, 16) fp16, a tile's 16 d's together.
//
// The numbers, one definition for every path and row count (so a row's bits depend on that row alone, and the
// paths below agree bit for bit):
// - each row of x is rounded per group of 32 to int16 on a power-of-two step: with the group's largest magnitude in
//   [2^e, 2^(e+1)), step = 2^(e-14) and x_q = nearbyint(x / step) (|x_q| <= 32640; a bf16 value 2^-7 of the largest
//   or larger is kept exactly, a smaller one to 15 bits of the largest). A group with a NaN or an infinity gets a
//   NaN step, so the row's outputs are NaN, as float products would make them;
// - G = the group's sum of q * x_q, exact in int32 (|G| < 2^28), however a path adds it up;
// - acc = fma(float(G), fp32(d) * step, acc) over the groups in order, from zero (float(G) rounded to nearest even);
// - plus bias, then one rounding to bf16 (nearest even), or none for fp32 logits.
// Paths: AMX (x_q's high and low bytes as A tiles, the code tiles as B, two tile products a pair of groups; calls of
// 3+ rows), AVX-512 VNNI (vpdpbusd, the same byte split), AVX2 (vpmaddwd on the codes widened to int16), and a
// scalar one a row at a time. A process can be held to one (q8_route) so the tests run each this CPU has.
// tests/models/test_q8_linear.py rebuilds the numbers in PyTorch and compares every path and row count with them.

#include "common.h"

#include <atomic>

namespace {

constexpr int64_t kRows = 16, kCols = 32;  // one code tile: 16 rows of a group
constexpr int64_t kTileBytes = kRows * kCols;
constexpr int64_t kPrefetchTiles = 24;     // as quant_linear.cpp's kPrefetchSteps: the head streams from DRAM
constexpr int64_t kChunk = 16;             // rows of x a pass over a block takes (AMX: kAmxRows)
constexpr int64_t kAmxMinRows = 3;  // calls of this many rows or more take the AMX path (results/engine/q8_paths_xeon_2026-12-03:
// at 2 rows vpdpbusd was the faster, 0.61 against 0.72 ms on SmolLM2's head; at 3 even; from 4 the tiles)

// A row of x rounded as the header defines: codes xq (K,) int16 and steps (K / 32,) fp32; with its high bytes
// hi = xq >> 8 (signed), hi + 128 (unsigned: vpdpbusd's operand) and low bytes lo = xq & 255, xq = 256 hi + lo.
void quantize_row(const c10::BFloat16* x, int64_t K, int16_t* xq, float* step, int8_t* hi, uint8_t* hi_u,
                  uint8_t* lo) {
  for (int64_t s = 0; s < K / kCols; ++s) {
    const c10::BFloat16* g = x + s * kCols;
    int16_t* out = xq + s * kCols;
    float big = 0.f;
    bool finite = true;
    for (int64_t c = 0; c < kCols; ++c) {
      const float v = std::fabs(static_cast<float>(g[c]));
      finite = finite && std::isfinite(v);
      big = std::max(big, v);
    }
    if (!finite || big == 0.f) {
      std::fill(out, out + kCols, int16_t{0});
      step[s] = finite ? 0.f : std::numeric_limits<float>::quiet_NaN();
    } else {
      const int e = std::ilogb(big);
      step[s] = std::ldexp(1.f, e - 14);
      for (int64_t c = 0; c < kCols; ++c)
        out[c] = static_cast<int16_t>(std::nearbyint(std::ldexp(static_cast<float>(g[c]), 14 - e)));
    }
  }
  for (int64_t c = 0; c < K; ++c) {
    hi[c] = static_cast<int8_t>(xq[c] >> 8);
    hi_u[c] = static_cast<uint8_t>(hi[c] + 128);
    lo[c] = static_cast<uint8_t>(xq[c] & 0xff);
  }
}

struct Call {
  const int8_t* q;     // code tiles (above)
  const uint16_t* d;   // fp16 bits (N/16, K/32, 16)
  const int16_t* xq;   // (M, K)
  const float* step;   // (M, K/32)
  const int8_t* hi;    // (M, K)
  const uint8_t* hi_u; // (M, K)
  const uint8_t* lo;   // (M, K)
  int64_t S, K;

  const int8_t* tile(int64_t b, int64_t s) const { return q + (b * S + s) * kTileBytes; }
  const uint16_t* ds(int64_t b, int64_t s) const { return d + (b * S + s) * kRows; }
};

inline float half_to_float(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }

// Ask for the tile kPrefetchTiles ahead of (b, s) and its d's (timing only; past the end is harmless).
inline void prefetch_ahead(const Call& c, int64_t b, int64_t s) {
  const int64_t t = b * c.S + s + kPrefetchTiles;
  const char* pf = reinterpret_cast<const char*>(c.q + t * kTileBytes);
  for (int64_t o = 0; o < kTileBytes; o += 64) prefetch_l2(pf + o);
  if ((t & 1) == 0) prefetch_l2(c.d + t * kRows);
}

// G for row r of block b, group s, x row m, from the tile (the definition, a row at a time).
inline int32_t group_dot(const Call& c, int64_t b, int64_t s, int r, int64_t m) {
  const int8_t* t = c.tile(b, s);
  const int16_t* xs = c.xq + m * c.K + s * kCols;
  int32_t g = 0;
#if defined(__AVX2__)
  // slice j's 4 codes of row r (bytes (16 j + r) * 4..) beside the next slice's: 8 codes, widened, times x_q
  __m256i acc = _mm256_setzero_si256();
  for (int j = 0; j < 8; j += 2) {
    const __m128i w = _mm_set_epi32(0, 0, *reinterpret_cast<const int32_t*>(t + (16 * (j + 1) + r) * 4),
                                    *reinterpret_cast<const int32_t*>(t + (16 * j + r) * 4));
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(xs + 4 * j));
    acc = _mm256_add_epi32(acc, _mm256_castsi128_si256(_mm_madd_epi16(_mm_cvtepi8_epi16(w), x)));
  }
  __m128i v = _mm256_castsi256_si128(acc);
  v = _mm_add_epi32(v, _mm_unpackhi_epi64(v, v));
  g = _mm_cvtsi128_si32(v) + _mm_extract_epi32(v, 1);
#else
  for (int j = 0; j < 8; ++j)
    for (int i = 0; i < 4; ++i) g += int32_t{t[(16 * j + r) * 4 + i]} * xs[4 * j + i];
#endif
  return g;
}

// Block b's 16 rows against x row m, a row at a time: sums[r].
void block_rows(const Call& c, int64_t b, int64_t m, float* sums) {
  for (int r = 0; r < kRows; ++r) {
    float acc = 0.f;
    for (int64_t s = 0; s < c.S; ++s) {
      if (m == 0 && r == 0) prefetch_ahead(c, b, s);
      const float scale = half_to_float(c.ds(b, s)[r]) * c.step[m * c.S + s];
      acc = std::fma(static_cast<float>(group_dot(c, b, s, r, m)), scale, acc);
    }
    sums[r] = acc;
  }
}

#if defined(__AVX2__) && defined(__FMA__)
constexpr bool kAvx2 = true;
constexpr int64_t kAvx2Rows = 4;  // rows of x a pass over a block takes here (eight accumulators)
// Block b's 16 rows against x rows m0 .. m0 + MC (MC <= kAvx2Rows) with AVX2 integer multiply-adds: a slice's 16 bytes
// for 4 rows (4 codes each) widened to int16 times x_q's 4 values repeated, so a lane holds one row's pair sum; the
// 8 slices added in int32, adjacent lanes added, G for 16 rows in two registers; then the chain (as block_vnni).
// CPUs without AVX-512 VNNI take it (the head had run at ~10 GB/s there on the bf16 route); sums (MC, 16).
void block_avx2(const Call& c, int64_t b, int64_t m0, int64_t MC, float* sums) {
  __m256 lo[kAvx2Rows], hi[kAvx2Rows];
  for (int64_t m = 0; m < MC; ++m) lo[m] = hi[m] = _mm256_setzero_ps();
  for (int64_t s = 0; s < c.S; ++s) {
    if (m0 == 0) prefetch_ahead(c, b, s);
    const int8_t* t = c.tile(b, s);
    const auto* dp = reinterpret_cast<const __m128i*>(c.ds(b, s));
    const __m256 dlo = _mm256_cvtph_ps(_mm_loadu_si128(dp)), dhi = _mm256_cvtph_ps(_mm_loadu_si128(dp + 1));
    for (int64_t m = 0; m < MC; ++m) {
      const int16_t* xs = c.xq + (m0 + m) * c.K + s * kCols;
      __m256i acc[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                        _mm256_setzero_si256()};
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        int64_t x4;
        std::memcpy(&x4, xs + 4 * j, 8);
        const __m256i xv = _mm256_set1_epi64x(x4);
#pragma GCC unroll 4
        for (int rb = 0; rb < 4; ++rb) {  // rows 4 rb .. 4 rb + 3: bytes 16 rb .. of slice j's line
          const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t + 64 * j + 16 * rb)));
          acc[rb] = _mm256_add_epi32(acc[rb], _mm256_madd_epi16(w, xv));
        }
      }
      // hadd: [r0 r1 r4 r5 | r2 r3 r6 r7] of the two row quads; the 64-bit quarters back in row order
      const __m256i g_lo = _mm256_permute4x64_epi64(_mm256_hadd_epi32(acc[0], acc[1]), _MM_SHUFFLE(3, 1, 2, 0));
      const __m256i g_hi = _mm256_permute4x64_epi64(_mm256_hadd_epi32(acc[2], acc[3]), _MM_SHUFFLE(3, 1, 2, 0));
      const __m256 st = _mm256_set1_ps(c.step[(m0 + m) * c.S + s]);
      lo[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(g_lo), _mm256_mul_ps(dlo, st), lo[m]);
      hi[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(g_hi), _mm256_mul_ps(dhi, st), hi[m]);
    }
  }
  for (int64_t m = 0; m < MC; ++m) {
    _mm256_storeu_ps(sums + m * kRows, lo[m]);
    _mm256_storeu_ps(sums + m * kRows + 8, hi[m]);
  }
}
#else
constexpr bool kAvx2 = false;
constexpr int64_t kAvx2Rows = 1;
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
// One group's step of the chain for 16 rows (lane r): acc = fma(float(G), d * step, acc).
__attribute__((always_inline)) inline __m512 chain(__m512 acc, __m512i g, const uint16_t* d, float step) {
  const __m512 d16 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d)));
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(g), _mm512_mul_ps(d16, _mm512_set1_ps(step)), acc);
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
constexpr bool kVnni = true;
// Block b's 16 rows against x rows m0 .. m0 + MC, on vpdpbusd: per 4-column slice j, lane r adds row r's 4 codes
// times x's 4 bytes (unsigned): the high bytes offset by 128 (G's high part = that sum - 128 * the codes' sum) and
// the low bytes. acc[m], lane r.
void block_vnni(const Call& c, int64_t b, int64_t m0, int64_t MC, __m512* acc) {
  const __m512i ones = _mm512_set1_epi8(1);
  for (int64_t m = 0; m < MC; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t s = 0; s < c.S; ++s) {
    if (m0 == 0) prefetch_ahead(c, b, s);
    const int8_t* t = c.tile(b, s);
    __m512i w[8];
    __m512i sum = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      w[j] = _mm512_load_si512(t + 64 * j);
      sum = _mm512_dpbusd_epi32(sum, ones, w[j]);
    }
    const __m512i offset = _mm512_slli_epi32(sum, 7);  // 128 * the codes' sum
    for (int64_t m = 0; m < MC; ++m) {
      const auto* hu = reinterpret_cast<const int32_t*>(c.hi_u + (m0 + m) * c.K + s * kCols);
      const auto* lo = reinterpret_cast<const int32_t*>(c.lo + (m0 + m) * c.K + s * kCols);
      __m512i h = _mm512_setzero_si512(), l = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        h = _mm512_dpbusd_epi32(h, _mm512_set1_epi32(hu[j]), w[j]);
        l = _mm512_dpbusd_epi32(l, _mm512_set1_epi32(lo[j]), w[j]);
      }
      const __m512i g = _mm512_add_epi32(_mm512_slli_epi32(_mm512_sub_epi32(h, offset), 8), l);
      acc[m] = chain(acc[m], g, c.ds(b, s), c.step[(m0 + m) * c.S + s]);
    }
  }
}
#else
constexpr bool kVnni = false;
#endif

#if defined(KAKEYA_AMX) && defined(__AMX_INT8__)
constexpr bool kAmxInt8 = true;
// A tile product sums over 64 bytes of K, two groups: a pair of groups goes through one, x rows m0 .. m0 + MC
// (MC <= kAmxRows) as A rows twice over: rows 0 .. MC hold group 2p's bytes in columns 0-31 (zeros beside), rows
// MC .. 2 MC group 2p + 1's in columns 32-63, so C row i < MC is group 2p's sums and MC + i group 2p + 1's; B is the
// two code tiles, which lie together. Half of A is zeros, but a group costs half the tile operations, and each
// stored C and its reading are what a group step waits on.
constexpr int64_t kAmxRows = 8;

// x rows m0 .. m0 + MC's bytes (hi signed, lo unsigned) as those A tiles, pair p's at p * 2 MC * 64 bytes.
void pack_pairs(const Call& c, int64_t m0, int64_t MC, int8_t* hi, uint8_t* lo) {
  for (int64_t p = 0; p < c.S / 2; ++p)
    for (int64_t half = 0; half < 2; ++half)
      for (int64_t i = 0; i < MC; ++i) {
        const int64_t row = (p * 2 * MC + half * MC + i) * 64, from = (m0 + i) * c.K + (2 * p + half) * kCols;
        std::memset(hi + row, 0, 64);
        std::memset(lo + row, 0, 64);
        std::memcpy(hi + row + half * kCols, c.hi + from, kCols);
        std::memcpy(lo + row + half * kCols, c.lo + from, kCols);
      }
}

// Tiles: a pair's sums, high and low parts (2 MC, 16) int32, for even pairs (0, 1) and odd ones (5, 6), so a pair's
// products run while the previous pair's sums go through the chain; A: the high and low bytes (2, 3); B: the two
// code tiles (4).
inline void configure_q8(int64_t MC) {
  kakeya_amx::TileConfig cfg;
  for (const int t : {0, 1, 2, 3, 5, 6}) cfg.rows[t] = static_cast<uint8_t>(2 * MC), cfg.colsb[t] = 64;
  cfg.rows[4] = 16, cfg.colsb[4] = 64;
  kakeya_amx::load_config(cfg);
}

// One pair's tile products into C tiles H (high bytes) and L (low), stored at gh, gl (a macro: tile numbers are
// immediates).
#define KAKEYA_Q8_PAIR_TILES(H, L, gh, gl)            \
  do {                                                \
    _tile_zero(H);                                    \
    _tile_zero(L);                                    \
    _tile_loadd(2, hi + p * 2 * MC * 64, 64);         \
    _tile_loadd(3, lo + p * 2 * MC * 64, 64);         \
    _tile_loadd(4, c.tile(b, 2 * p), 64);             \
    _tile_dpbssd(H, 2, 4);                            \
    _tile_dpbusd(L, 3, 4);                            \
    _tile_stored(H, gh, 64);                          \
    _tile_stored(L, gl, 64);                          \
  } while (0)

// Block b's 16 rows against x rows m0 .. m0 + MC on tiles (hi, lo: pack_pairs'): per group G = 256 (hi . q) + (lo . q),
// then the chain, the groups in order.
void block_amx(const Call& c, int64_t b, int64_t m0, int64_t MC, const int8_t* hi, const uint8_t* lo, __m512* acc) {
  alignas(64) int32_t gh[2][2 * kAmxRows * kRows], gl[2][2 * kAmxRows * kRows];
  for (int64_t m = 0; m < MC; ++m) acc[m] = _mm512_setzero_ps();
  const int64_t pairs = c.S / 2;
  for (int64_t p = 0; p <= pairs; ++p) {
    if (p < pairs) {
      if (m0 == 0) prefetch_ahead(c, b, 2 * p), prefetch_ahead(c, b, 2 * p + 1);
      if (p & 1) KAKEYA_Q8_PAIR_TILES(5, 6, gh[1], gl[1]);
      else KAKEYA_Q8_PAIR_TILES(0, 1, gh[0], gl[0]);
    }
    if (p == 0) continue;
    const int64_t buf = (p - 1) & 1;  // the previous pair's sums
    for (int64_t half = 0; half < 2; ++half) {
      const int64_t s = 2 * (p - 1) + half;
      const __m512 d16 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c.ds(b, s))));
      for (int64_t m = 0; m < MC; ++m) {
        const int64_t row = (half * MC + m) * kRows;
        const __m512i g = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(gh[buf] + row), 8),
                                           _mm512_load_si512(gl[buf] + row));
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(g), _mm512_mul_ps(d16, _mm512_set1_ps(c.step[(m0 + m) * c.S + s])),
                                 acc[m]);
      }
    }
  }
}
#else
constexpr bool kAmxInt8 = false;
#endif

// Which path calls take: Auto (AMX for 3+ rows where allowed, else VNNI, else AVX2, else a row at a time), or one
// forced for the whole process (tests run each path this CPU has; every path computes the same numbers).
enum class Route : int { Auto, Vnni, Avx2, Rows };
inline std::atomic<int> forced{static_cast<int>(Route::Auto)};
inline Route route() { return static_cast<Route>(forced.load()); }

// Whether a call of M rows runs on AMX tiles: where this process may use them for linears (the start-up calibration's
// choice, as quant_linear's), for kAmxMinRows rows or more (fewer run at memory speed on vpdpbusd). Every
// path computes the same numbers, so this decides time only.
inline bool use_amx(int64_t M, int64_t S) {
#if defined(KAKEYA_AMX) && defined(__AMX_INT8__)
  return route() == Route::Auto && M >= kAmxMinRows && S % 2 == 0 && kakeya_amx::permitted() &&
         kakeya_amx::linear_on.load();
#else
  (void)M, (void)S;
  return false;
#endif
}

// The path a call of M rows (S groups) takes here.
enum class Path { Amx, Vnni, Avx2, Rows };
inline Path path_for(int64_t M, int64_t S) {
  if (use_amx(M, S)) return Path::Amx;
  const Route r = route();
  if (kVnni && (r == Route::Auto || r == Route::Vnni)) return Path::Vnni;
  if (kAvx2 && r != Route::Rows) return Path::Avx2;
  return Path::Rows;
}

// Rows of x a pass over a block takes on `path`.
inline int64_t chunk_rows(Path path) {
  return path == Path::Amx ? kAmxRows : path == Path::Avx2 ? kAvx2Rows : path == Path::Vnni ? kChunk : 1;
}

// Block b against x rows m0 .. m0 + MC: sums (MC, 16).
inline void block_sums(const Call& c, int64_t b, int64_t m0, int64_t MC, Path path, int64_t& configured,
                       const int8_t* pairs_hi, const uint8_t* pairs_lo, float* sums) {
  (void)configured, (void)pairs_hi, (void)pairs_lo;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if (path == Path::Amx || path == Path::Vnni) {
    __m512 acc[kChunk];
#if defined(KAKEYA_AMX) && defined(__AMX_INT8__)
    if (path == Path::Amx) {
      if (configured != MC) configure_q8(MC), configured = MC;
      block_amx(c, b, m0, MC, pairs_hi + 2 * m0 * c.K, pairs_lo + 2 * m0 * c.K, acc);
    }
#endif
#if defined(__AVX512VNNI__)
    if (path == Path::Vnni) block_vnni(c, b, m0, MC, acc);
#endif
    for (int64_t m = 0; m < MC; ++m) _mm512_storeu_ps(sums + m * kRows, acc[m]);
    return;
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (path == Path::Avx2) {
    block_avx2(c, b, m0, MC, sums);
    return;
  }
#endif
  for (int64_t m = 0; m < MC; ++m) block_rows(c, b, m0 + m, sums + m * kRows);
}

// Rows n0 .. n0 + rows of W = bf16(q * d) (the product exact in fp32: an fp16 times an 8-bit integer), into out.
void dequant_row(const at::Tensor& q, const uint16_t* d, int64_t K, int64_t n, c10::BFloat16* out) {
  const auto* codes = reinterpret_cast<const int8_t*>(q.const_data_ptr<uint8_t>());
  const int64_t S = K / kCols, b = n / kRows, r = n % kRows;
  for (int64_t s = 0; s < S; ++s) {
    const int8_t* t = codes + (b * S + s) * kTileBytes;
    const float dv = half_to_float(d[(b * S + s) * kRows + r]);
    for (int j = 0; j < 8; ++j)
      for (int i = 0; i < 4; ++i) out[s * kCols + 4 * j + i] = c10::BFloat16(float(t[(16 * j + r) * 4 + i]) * dv);
  }
}

void check_weight(const at::Tensor& q, const at::Tensor& sz, const char* op) {
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kByte && q.dim() == 2 && q.is_contiguous(), op,
              ": q must be contiguous (N, K) uint8 codes in 16 x 32 tiles (engine/weights.py's pack_q8_tiles)");
  const int64_t N = q.size(0), K = q.size(1);
  TORCH_CHECK(N % kRows == 0 && K % kCols == 0, op, ": N must be a multiple of 16 and K of 32");
  TORCH_CHECK(sz.scalar_type() == at::kHalf && sz.dim() == 3 && sz.size(0) == N / kRows && sz.size(1) == K / kCols &&
                  sz.size(2) == kRows && sz.is_contiguous(),
              op, ": sz must be contiguous (N/16, K/32, 16) fp16 (engine/weights.py's pack_group_scales)");
}

}  // namespace

namespace kakeya_ops {

at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& sz,
                     const std::optional<at::Tensor>& bias, bool out_fp32) {
  check_weight(q, sz, "q8_linear");
  const int64_t N = q.size(0), K = q.size(1), S = K / kCols;
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) == K && x.scalar_type() == at::kBFloat16 &&
                  x.stride(1) == 1,
              "q8_linear: x must be (M, ", K, ") bf16 with contiguous rows");
  const float* bp = nullptr;
  at::Tensor b32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "q8_linear: bias must be (N,)");
    b32 = bias->to(at::kFloat).contiguous();
    bp = b32.const_data_ptr<float>();
  }
  const int64_t M = x.size(0);
  thread_local Reusable out;
  auto y = reusable_empty(out, {M, N}, x.options().dtype(out_fp32 ? at::kFloat : at::kBFloat16));
  if (M == 0) return y;

  thread_local std::vector<int16_t> xq;
  thread_local std::vector<float> step;
  thread_local std::vector<uint8_t> bytes;  // hi, hi + 128, lo: (M, K) each
  xq.resize(M * K);
  step.resize(M * S);
  bytes.resize(3 * M * K);
  auto* hi = reinterpret_cast<int8_t*>(bytes.data());
  uint8_t* hi_u = bytes.data() + M * K;
  uint8_t* lo = bytes.data() + 2 * M * K;
  const auto* xp = x.const_data_ptr<c10::BFloat16>();
  for (int64_t m = 0; m < M; ++m)
    quantize_row(xp + m * x.stride(0), K, xq.data() + m * K, step.data() + m * S, hi + m * K, hi_u + m * K,
                 lo + m * K);
  const Call c{reinterpret_cast<const int8_t*>(q.const_data_ptr<uint8_t>()),
               reinterpret_cast<const uint16_t*>(sz.const_data_ptr<at::Half>()),
               xq.data(), step.data(), hi, hi_u, lo, S, K};

  const int64_t blocks = N / kRows;
  const int64_t threads = std::min<int64_t>(blocks, at::get_num_threads());
  const int64_t run = std::max<int64_t>(1, blocks / (8 * threads));  // blocks a thread takes at a time
  std::atomic<int64_t> next{0};
  float* yf = out_fp32 ? y.data_ptr<float>() : nullptr;
  c10::BFloat16* yb = out_fp32 ? nullptr : y.data_ptr<c10::BFloat16>();
  const int64_t y_row = y.stride(0);
  const Path path = path_for(M, S);
  const bool amx = path == Path::Amx;
  const int64_t chunk = chunk_rows(path);
  thread_local std::vector<uint8_t> pairs;  // the AMX path's A tiles, hi then lo: (2 M K) each
  if (amx) {
    pairs.resize(4 * M * K);
#if defined(KAKEYA_AMX) && defined(__AMX_INT8__)
    for (int64_t m0 = 0; m0 < M; m0 += chunk)
      pack_pairs(c, m0, std::min(chunk, M - m0), reinterpret_cast<int8_t*>(pairs.data()) + 2 * m0 * K,
                 pairs.data() + 2 * M * K + 2 * m0 * K);
#endif
  }
  const auto* pairs_hi = reinterpret_cast<const int8_t*>(pairs.data());
  const uint8_t* pairs_lo = amx ? pairs.data() + 2 * M * K : nullptr;
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    alignas(64) float sums[kChunk * kRows];
    int64_t configured = 0;
    for (int64_t first = next.fetch_add(run); first < blocks; first = next.fetch_add(run)) {
      for (int64_t b = first; b < std::min(blocks, first + run); ++b) {
        for (int64_t m0 = 0; m0 < M; m0 += chunk) {
          const int64_t MC = std::min(chunk, M - m0);
          block_sums(c, b, m0, MC, path, configured, pairs_hi, pairs_lo, sums);
          for (int64_t m = 0; m < MC; ++m)
            for (int r = 0; r < kRows; ++r) {
              const int64_t n = b * kRows + r;
              const float v = bp ? sums[m * kRows + r] + bp[n] : sums[m * kRows + r];
              if (yf) yf[(m0 + m) * y_row + n] = v;
              else yb[(m0 + m) * y_row + n] = c10::BFloat16(v);
            }
        }
      }
    }
#if defined(KAKEYA_AMX) && defined(__AMX_INT8__)
    if (configured) _tile_release();
#endif
  });
  release_if_large(xq);
  release_if_large(step);
  release_if_large(bytes);
  release_if_large(pairs);
  return y;
}

// W (N, K) bf16, or its rows `rows` (R,) int64 only (R, K): bf16(q * d), the embedding lookup of a tied head.
at::Tensor q8_dequant(const at::Tensor& q, const at::Tensor& sz, const std::optional<at::Tensor>& rows) {
  check_weight(q, sz, "q8_dequant");
  const int64_t N = q.size(0), K = q.size(1);
  at::Tensor idx;
  if (rows.has_value()) {
    TORCH_CHECK(rows->scalar_type() == at::kLong && rows->dim() == 1, "q8_dequant: rows must be (R,) int64");
    idx = rows->contiguous();
    const int64_t* ip = idx.const_data_ptr<int64_t>();
    for (int64_t i = 0; i < idx.size(0); ++i)
      TORCH_CHECK(ip[i] >= 0 && ip[i] < N, "q8_dequant: row ", ip[i], " out of range");
  }
  const int64_t R = rows.has_value() ? idx.size(0) : N;
  const int64_t* ip = rows.has_value() ? idx.const_data_ptr<int64_t>() : nullptr;
  auto out = at::empty({R, K}, q.options().dtype(at::kBFloat16));
  auto* op = out.data_ptr<c10::BFloat16>();
  const auto* d = reinterpret_cast<const uint16_t*>(sz.const_data_ptr<at::Half>());
  at::parallel_for(0, R, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) dequant_row(q, d, K, ip ? ip[i] : i, op + i * K);
  });
  return out;
}

// Which path a call of `rows` rows takes here: "amx", "vnni", "avx2" or "rows".
std::string q8_path(int64_t rows) {
  static const char* names[] = {"amx", "vnni", "avx2", "rows"};
  return names[static_cast<int>(path_for(rows, 2))];
}

// Force one path for the process ("vnni", "avx2", "rows"; "auto" the default), for tests; returns the one before.
// A path this CPU lacks falls back as Auto does (q8_path says which runs).
std::string q8_route(const std::string& name) {
  static const char* names[] = {"auto", "vnni", "avx2", "rows"};
  const auto* found = std::find(std::begin(names), std::end(names), name);
  TORCH_CHECK(found != std::end(names), "q8_route: ", name, " is not one of auto, vnni, avx2, rows");
  return names[forced.exchange(static_cast<int>(found - std::begin(names)))];
}

}  // namespace kakeya_ops

TORCH_LIBRARY_FRAGMENT(kakeya, m) {
  m.def("q8_linear(Tensor x, Tensor q, Tensor sz, Tensor? bias=None, bool out_fp32=False) -> Tensor");
  m.def("q8_dequant(Tensor q, Tensor sz, Tensor? rows=None) -> Tensor");
  m.def("q8_path(int rows) -> str", &kakeya_ops::q8_path);
  m.def("q8_route(str name) -> str", &kakeya_ops::q8_route);
}

TORCH_LIBRARY_IMPL(kakeya, CPU, m) {
  m.impl("q8_linear", &kakeya_ops::q8_linear);
  m.impl("q8_dequant", &kakeya_ops::q8_dequant);
}
