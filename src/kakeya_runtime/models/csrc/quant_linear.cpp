// Weight-only quantized y = x W^T (+ b) whose every output element is computed by one fixed sequence of
// operations, whatever the number of rows in the call: kakeya::quant_linear.
//
// The weights are stored quantized (int4 group-wise affine, int5 group-wise symmetric, or int8 per output channel)
// and dequantized inside the kernel to bf16 W' by one routine (QWeight::tile; int4, int5: W' = bf16(fp32 dequant);
// int8: W' = the codes, the scales applied to the sums), then multiplied as our bf16 projection kernel
// (invariant_linear.cpp) multiplies W': y's bits are kakeya::linear(x, W')'s (int8: then times the scales), so a
// row's result does not depend on the rows beside it (a decode step, a turn, a prefill chunk compute alike).
// - AMX: calls of fewer than 32 rows (decode; below 16, on tiles as narrow as the rows) dequantize each 16 x 32 A
//   tile of W' rows into an L1 buffer one step before its tdpbf16ps (x^T pairs are the B tiles); calls of 32 rows
//   or more (prefill) dequantize each 32-row
//   panel of W' once per call into B tiles and run every 32-row block of x (A tiles, in place) against it. The
//   tdpbf16ps sequence over K (steps of 32, in order, from zeroed tiles) is invariant_linear.cpp's on both paths.
// - elsewhere (no AMX, or the AVX-512 route): W' dequantized a panel of rows at a time and multiplied by
//   kakeya::linear (AVX-512 BF16 dot products or at::vec), whose result per element does not depend on M or N;
//   calls of few rows (decode) run the same dot products on blocks of 16 W' rows dequantized once per call. AVX2
//   without AVX-512: calls of up to 16 int8 / 8 int4 rows multiply the codes as they are unpacked (quant_rows_avx2),
//   more rows run kakeya::linear's AVX2 blocks over W' dequantized 48 rows at a time (quant_many_avx2).
//
// Layouts (engine/weights.py packs them): codes in tiles of 16 rows x 32 columns (one int4 group), tile (b, s) =
// rows 16b.., columns 32s.. at byte (b * K/32 + s) * 16 * bytes_per_row_of_tile:
// - int4: 16 bytes per tile row, column 32s + c in nibble slot int4_slot(c) (below: the order one byte-shuffle
//   instruction unpacks).
//   sz (N/16, K/32, 16, 2) fp32: scale, zero of row 16b + r in group s at [b][s][r], so a tile's 16 pairs lie
//   together in the order the codes' tiles do (a decode reads both as two forward streams; in (K/32, N, 2) each
//   step's pairs were a row of N apart: docs/evidence.md, "Scale layout"). w = (q - 8) * scale + zero (one fused
//   multiply-add in fp32), rounded once to bf16 (nearest even).
// - int5 (a GGUF Q5_0 block, exactly): 20 bytes per tile row, the codes' low nibbles as int4's 16 bytes, then a
//   32-bit word whose bit c is column c's fifth bit. sz (N/16, K/32, 16) fp16: the group's d, in the codes' tile
//   order. w = (q - 16) * d in fp32 (exact: an fp16 times an integer of 5 bits), rounded once to bf16.
// - int8: 32 bytes per tile row, column 32s + j at byte j. sz (N,) bf16 scales. W' = the codes (exact in bf16), and
//   y = fma(sum, scale, bias) per output column, rounded once: no rounding of the weights beyond int8's own (a
//   bf16 q * scale would add up to half of int8's step again near a row's largest weights).

#include "common.h"

#include <array>
#include <atomic>

namespace kakeya_ops {
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias, bool out_fp32);
// grouped int8 weights (q8_linear.cpp: multiplied in integers, in their own tile layout)
at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& sz,
                     const std::optional<at::Tensor>& bias, bool out_fp32);
at::Tensor q8_dequant(const at::Tensor& q, const at::Tensor& sz, const std::optional<at::Tensor>& rows);
}

namespace {

constexpr int64_t kTileRows = 16, kTileCols = 32;
// How many K steps ahead amx_block asks for the codes and scales it will read (timing only). A decode step's
// weights come from DRAM; the hardware prefetcher alone left them at ~13 GB/s. 24 steps (6 KB of int4 codes per
// stream): 30 layers' SmolLM2 int4 projections 5.9 -> 4.9 ms with the caches flushed (throwaway script; 12 steps
// helped less, 48 and 96 no more); SmolLM2 int4 decode +4-15% at 1k in the engine bench (results/engine/decode_v12_ab).
constexpr int64_t kPrefetchSteps = 24;

inline float bf16_bits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

// Where an int4 group's code c (column 32s + c) sits in its 16 bytes: in 64-bit half h = (c / 4) % 2, nibble slot
// 4 * (c / 8) + c % 4 (bits 4 * slot..), so one vpmultishiftqb over the 16 bytes (in every 128-bit lane) puts code c
// in the low bits of word c. int4_slot(c) = 16 * h + slot (engine/weights.py's pack_tiles lays the codes out so).
constexpr int int4_slot(int c) { return 16 * ((c / 4) % 2) + 4 * (c / 8) + c % 4; }

#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
#define KAKEYA_QUANT_VECTOR 1
// vpmultishiftqb control: the low byte of word w (qword w / 4) takes the 8 bits from bit 4 * slot(w) of its qword
inline const __m512i kInt4Shift = [] {
  alignas(64) uint8_t ctrl[64];
  for (int i = 0; i < 64; ++i) ctrl[i] = i % 2 ? 0 : uint8_t(4 * (int4_slot(i / 2) % 16));
  return _mm512_load_si512(ctrl);
}();
#endif

// The quantized weight: codes, scales and the shape. tile(): rows 16b..16b+15, columns 32s..32s+31 of W' as 16 rows
// of 32 bf16, 64 bytes apart (an A tile as AMX loads it). Every path's W' comes from here.
struct QWeight {
  const uint8_t* q;
  // int4: (N/16, K/32, 16, 2) fp32 (scale, zero); int5: (N/16, K/32, 16) fp16 d; int8: (N,) bf16 (per row, applied
  // to the sums). Grouped int8 (an fp16 d per group of 32: GGUF Q8_0) is q8_linear.cpp's.
  const void* sz;
  int64_t bits, N, K;

  inline int64_t tile_bytes() const { return kTileRows * kTileCols * bits / 8; }
  // Bytes of sz per code tile, in the tiles' order (int8's per-row scales are read after the sums).
  inline int64_t sz_tile_bytes() const { return bits == 4 ? kTileRows * 8 : bits == 5 ? kTileRows * 2 : 0; }

  // Inlined into its callers: as a call, each tile paid the call, the bits test and the unpack constants' reloads
  // (SmolLM2 int4 decode 4-16% slower in the engine bench, trees alternated: results/engine/decode_v9_ab).
  __attribute__((always_inline)) inline void tile(int64_t b, int64_t s, c10::BFloat16* out) const {
    const uint8_t* src = q + (b * (K / kTileCols) + s) * tile_bytes();
    if (bits == 4) {
      const float* sz_rows = static_cast<const float*>(sz) + (b * (K / kTileCols) + s) * kTileRows * 2;  // per row
#pragma GCC unroll 8
      for (int r = 0; r < kTileRows; r += 2) group4_pair(src + r * 16, sz_rows + 2 * r, out + r * kTileCols);
    } else if (bits == 5) {
      alignas(64) float d[kTileRows];
      widen_d(static_cast<const c10::Half*>(sz) + (b * (K / kTileCols) + s) * kTileRows, d);
#pragma GCC unroll 16
      for (int r = 0; r < kTileRows; ++r) group5(src + r * 20, d[r], out + r * kTileCols);
    } else {
#pragma GCC unroll 16
      for (int r = 0; r < kTileRows; ++r) group8(reinterpret_cast<const int8_t*>(src) + r * 32, out + r * kTileCols);
    }
  }

#if defined(KAKEYA_QUANT_VECTOR)
  // The group's 16 possible values, fma(c - 8, scale, zero) rounded to bf16, as a table (twice: entries 16..31 =
  // 0..15, so an index's bit 4 does not matter); one word permute picks each column's entry by its code. The same
  // values as computing every element, in fewer operations.
  __attribute__((always_inline)) static inline void group4(const uint8_t* src, const float* scale, const float* zero,
                                                          c10::BFloat16* out) {
    const __m512 codes = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    const __m512 values = _mm512_fmadd_ps(codes, _mm512_set1_ps(*scale), _mm512_set1_ps(*zero));
    const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(values, values);
    const __m512i bytes = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
    _mm512_storeu_si512(out, _mm512_permutexvar_epi16(_mm512_multishift_epi64_epi8(kInt4Shift, bytes), table));
  }
  // Two rows' groups (codes at src, src + 16; sz = scale, zero of the first row, then of the second): one table of
  // 32 entries, the first row's 16 values then the second's (one conversion for both), each row's codes looking up
  // its half (index bit 4 cleared, or set). The entries are group4's, so the bits are too, in fewer operations.
  __attribute__((always_inline)) static inline void group4_pair_regs(const uint8_t* src, const float* sz, __m512i& row0,
                                                                     __m512i& row1) {
    const __m512 codes = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    const __m512 first = _mm512_fmadd_ps(codes, _mm512_set1_ps(sz[0]), _mm512_set1_ps(sz[1]));
    const __m512 second = _mm512_fmadd_ps(codes, _mm512_set1_ps(sz[2]), _mm512_set1_ps(sz[3]));
    const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(second, first);
    const __m512i bit4 = _mm512_set1_epi16(16);
    const __m512i a = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
    const __m512i b = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16)));
    row0 = _mm512_permutexvar_epi16(_mm512_andnot_si512(bit4, _mm512_multishift_epi64_epi8(kInt4Shift, a)), table);
    row1 = _mm512_permutexvar_epi16(_mm512_or_si512(bit4, _mm512_multishift_epi64_epi8(kInt4Shift, b)), table);
  }
  __attribute__((always_inline)) static inline void group4_pair(const uint8_t* src, const float* sz, c10::BFloat16* out) {
    __m512i row0, row1;
    group4_pair_regs(src, sz, row0, row1);
    _mm512_storeu_si512(out, row0);
    _mm512_storeu_si512(out + kTileCols, row1);
  }
  // int8 codes as bf16, exactly (|q| <= 127 has 7 significant bits); the row's scale comes after the sum
  __attribute__((always_inline)) static inline __m512i group8_regs(const int8_t* src) {
    const __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
    const __m512i w = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16)));
    return (__m512i)_mm512_cvtne2ps_pbh(_mm512_cvtepi32_ps(w), _mm512_cvtepi32_ps(v));
  }
  __attribute__((always_inline)) static inline void group8(const int8_t* src, c10::BFloat16* out) {
    _mm512_storeu_si512(out, group8_regs(src));
  }
  // An int5 group: its 32 possible values (q - 16) * d rounded to bf16 as a table, each column's index its low
  // nibble (int4's unpack) plus 16 where the group's word has the column's fifth bit (one masked add).
  __attribute__((always_inline)) static inline __m512i group5_regs(const uint8_t* src, float d) {
    const __m512 dv = _mm512_set1_ps(d);
    const __m512 low = _mm512_setr_ps(-16, -15, -14, -13, -12, -11, -10, -9, -8, -7, -6, -5, -4, -3, -2, -1);
    const __m512 high = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(high, dv), _mm512_mul_ps(low, dv));
    const __m512i bytes = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
    const __m512i nibble = _mm512_and_si512(_mm512_multishift_epi64_epi8(kInt4Shift, bytes), _mm512_set1_epi16(15));
    const __mmask32 fifth = _load_mask32(reinterpret_cast<__mmask32*>(const_cast<uint8_t*>(src + 16)));
    return _mm512_permutexvar_epi16(_mm512_mask_add_epi16(nibble, fifth, nibble, _mm512_set1_epi16(16)), table);
  }
  __attribute__((always_inline)) static inline void group5(const uint8_t* src, float d, c10::BFloat16* out) {
    _mm512_storeu_si512(out, group5_regs(src, d));
  }
  // A tile's 16 d (fp16) as floats, converted in one instruction.
  __attribute__((always_inline)) static inline void widen_d(const c10::Half* d, float* out) {
    _mm512_store_ps(out, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d))));
  }
  // tile()'s rows r0..r0+RN (RN and r0 even) in registers, row r0 + r to f(r, row): the same values, for a caller
  // that uses them at once.
  template <int RN = kTileRows, typename F>
  __attribute__((always_inline)) inline void tile_regs(int64_t b, int64_t s, F&& f, int r0 = 0) const {
    const uint8_t* src = q + (b * (K / kTileCols) + s) * tile_bytes();
    if (bits == 4) {
      const float* sz_rows = static_cast<const float*>(sz) + (b * (K / kTileCols) + s) * kTileRows * 2;
#pragma GCC unroll 8
      for (int r = 0; r < RN; r += 2) {
        __m512i row0, row1;
        group4_pair_regs(src + (r0 + r) * 16, sz_rows + 2 * (r0 + r), row0, row1);
        f(r, row0);
        f(r + 1, row1);
      }
    } else if (bits == 5) {
      alignas(64) float d[kTileRows];
      widen_d(static_cast<const c10::Half*>(sz) + (b * (K / kTileCols) + s) * kTileRows, d);
#pragma GCC unroll 16
      for (int r = 0; r < RN; ++r) f(r, group5_regs(src + (r0 + r) * 20, d[r0 + r]));
    } else {
#pragma GCC unroll 16
      for (int r = 0; r < RN; ++r) f(r, group8_regs(reinterpret_cast<const int8_t*>(src) + (r0 + r) * 32));
    }
  }
#else
  // The same arithmetic element by element: std::fma is the fused multiply-add the vector path uses, and c10's
  // conversion rounds to nearest even as vcvtne2ps2bf16 does. With AVX2, the same operations 8 lanes at a time
  // (an int4 tile unpacked element by element took longer than the products it fed).
#if defined(__AVX2__) && defined(__FMA__)
  // 8 fp32 lanes rounded to bf16 as c10 rounds (nearest even; NaN as 0x7FC0), in the low 16 bits of each lane.
  __attribute__((always_inline)) static inline __m256i round_bf16(__m256 v) {
    const __m256i b = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7FFF)), lsb), 16);
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  }
  // 32 fp32 values (v[0..3], 8 each) as 32 bf16 at out.
  __attribute__((always_inline)) static inline void store_bf16x32(const __m256* v, c10::BFloat16* out) {
    for (int h = 0; h < 2; ++h) {
      const __m256i packed = _mm256_packus_epi32(round_bf16(v[2 * h]), round_bf16(v[2 * h + 1]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16 * h), _mm256_permute4x64_epi64(packed, 0xD8));
    }
  }
  // 32 int8 values as fp32 (v[0..3]).
  __attribute__((always_inline)) static inline void widen_i8x32(__m128i lo, __m128i hi, __m256* v) {
    v[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
    v[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
    v[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
    v[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
  }
  // An int4 group's 32 codes in column order (two 16-byte halves): byte i's nibbles interleaved are slots 2i, 2i + 1,
  // and int4_slot takes 4-byte runs from the two halves' interleavings in turn.
  __attribute__((always_inline)) static inline void int4_codes(const uint8_t* src, __m128i& lo, __m128i& hi) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
    const __m128i low = _mm_and_si128(bytes, _mm_set1_epi8(15));
    const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(15));
    const __m128i first = _mm_unpacklo_epi8(low, high), second = _mm_unpackhi_epi8(low, high);  // slots 0..15, 16..31
    lo = _mm_unpacklo_epi32(first, second);  // columns 0..15
    hi = _mm_unpackhi_epi32(first, second);  // columns 16..31
  }
#endif
  static inline void group4(const uint8_t* src, const float* scale_p, const float* zero_p, c10::BFloat16* out) {
    const float scale = *scale_p, zero = *zero_p;
#if defined(__AVX2__) && defined(__FMA__)
    __m128i lo, hi;
    int4_codes(src, lo, hi);
    __m256 v[4];
    widen_i8x32(lo, hi, v);  // codes 0..15 (as int8, exact)
    const __m256 s = _mm256_set1_ps(scale), z = _mm256_set1_ps(zero), eight = _mm256_set1_ps(8.f);
    for (int i = 0; i < 4; ++i) v[i] = _mm256_fmadd_ps(_mm256_sub_ps(v[i], eight), s, z);
    store_bf16x32(v, out);
    return;
#endif
    uint64_t half[2];
    std::memcpy(half, src, 16);
    for (int c = 0; c < 32; ++c) {
      const int slot = int4_slot(c);
      const int code = int((half[slot / 16] >> (4 * (slot % 16))) & 15);
      out[c] = c10::BFloat16(std::fma(float(code - 8), scale, zero));
    }
  }
  static inline void group4_pair(const uint8_t* src, const float* sz, c10::BFloat16* out) {
    group4(src, sz, sz + 1, out);
    group4(src + 16, sz + 2, sz + 3, out + kTileCols);
  }
  static inline void group8(const int8_t* src, c10::BFloat16* out) {
#if defined(__AVX2__) && defined(__FMA__)
    __m256 v[4];
    widen_i8x32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)),
                _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16)), v);
    store_bf16x32(v, out);
    return;
#endif
    for (int j = 0; j < 32; ++j) out[j] = c10::BFloat16(float(src[j]));
  }
  static inline void widen_d(const c10::Half* d, float* out) {
    for (int r = 0; r < kTileRows; ++r) out[r] = static_cast<float>(d[r]);
  }
  static inline void group5(const uint8_t* src, float d, c10::BFloat16* out) {
    uint64_t half[2];
    uint32_t fifth;
    std::memcpy(half, src, 16);
    std::memcpy(&fifth, src + 16, 4);
#if defined(__AVX2__) && defined(__FMA__)
    __m128i lo, hi;
    int4_codes(src, lo, hi);
    // column c's fifth bit (bit c of the word) as 16 in byte c
    const __m128i word = _mm_set1_epi32(static_cast<int>(fifth));
    const __m128i bit = _mm_setr_epi8(1, 2, 4, 8, 16, 32, 64, -128, 1, 2, 4, 8, 16, 32, 64, -128);
    const auto fifths = [&](__m128i select) {
      const __m128i set = _mm_and_si128(_mm_shuffle_epi8(word, select), bit);
      return _mm_and_si128(_mm_cmpeq_epi8(set, bit), _mm_set1_epi8(16));
    };
    lo = _mm_or_si128(lo, fifths(_mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1)));
    hi = _mm_or_si128(hi, fifths(_mm_setr_epi8(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3)));
    __m256 v[4];
    widen_i8x32(lo, hi, v);  // codes 0..31
    const __m256 dv = _mm256_set1_ps(d), sixteen = _mm256_set1_ps(16.f);
    for (int i = 0; i < 4; ++i) v[i] = _mm256_mul_ps(_mm256_sub_ps(v[i], sixteen), dv);
    store_bf16x32(v, out);
    return;
#endif
    for (int c = 0; c < 32; ++c) {
      const int slot = int4_slot(c);
      const int code = int((half[slot / 16] >> (4 * (slot % 16))) & 15) | int((fifth >> c) & 1) << 4;
      out[c] = c10::BFloat16(float(code - 16) * d);
    }
  }
#endif
};

// Rows n0..n0+rows (n0 % 16 == 0, rows % 16 == 0) of W' into out (rows, K) row-major.
void dequant_rows(const QWeight& w, int64_t n0, int64_t rows, c10::BFloat16* out) {
  const int64_t steps = w.K / kTileCols, blocks = rows / kTileRows;
  at::parallel_for(0, blocks * steps, 16, [&](int64_t begin, int64_t end) {
    alignas(64) c10::BFloat16 t[kTileRows * kTileCols];
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / steps, s = i % steps;
      w.tile(n0 / kTileRows + b, s, t);
      for (int r = 0; r < kTileRows; ++r)
        std::memcpy(out + (b * kTileRows + r) * w.K + s * kTileCols, t + r * kTileCols, kTileCols * 2);
    }
  });
}

#if defined(KAKEYA_AMX) && defined(__AVX512BF16__)
constexpr bool kAmx = true;
constexpr int64_t kRowsMin = 32;  // invariant_linear.cpp's switch to the many-row orientation

// pack_x (common.h): x^T in pairs, as kakeya::linear builds it.

// C^T tiles for NN blocks of 16 W' rows (from block b0) and NM blocks of x rows, over K in steps of 32: each A tile
// dequantized into `abuf` (two steps' worth, alternating) one step before it is loaded. B tile s of x block im at
// xb + im * xb_block + s * xb_step, rows xb_stride bytes apart (16-column x^T in pairs, or narrow: below); C tile
// (in, im) stored at c + (in * NM + im) * c_tile, rows c_stride bytes apart. The tile ops are invariant_linear.cpp's
// amx_block's, in its order.
template <int NN, int NM>
inline void amx_block(const QWeight& w, int64_t b0, const uint32_t* xb, int64_t xb_block, int64_t xb_step,
                      int64_t xb_stride, c10::BFloat16* abuf, float* c, int64_t c_tile, int64_t c_stride) {
  _tile_zero(0);
  if constexpr (NM > 1) _tile_zero(1);
  if constexpr (NN > 1) _tile_zero(2);
  if constexpr (NN > 1 && NM > 1) _tile_zero(3);
  const int64_t steps = w.K / 32;
  w.tile(b0, 0, abuf);
  if constexpr (NN > 1) w.tile(b0 + 1, 0, abuf + 512);
  // Block b0's tiles lie together and block b0 + 1's follow (then the next item's): two forward streams of codes,
  // and for int4 / int5 two of scales (128 / 32 bytes a tile), asked for kPrefetchSteps ahead into L2; past the end
  // is harmless.
  const int64_t tb = w.tile_bytes();
  const char* pf_code = reinterpret_cast<const char*>(w.q) + (b0 * steps + kPrefetchSteps) * tb;
  const int64_t szb = w.sz_tile_bytes();
  const char* pf_sz = szb ? static_cast<const char*>(w.sz) + (b0 * steps + kPrefetchSteps) * szb : nullptr;
  for (int64_t s = 0; s < steps; ++s) {
    for (int64_t c = 0; c < tb; c += 64) {
      _mm_prefetch(pf_code + s * tb + c, _MM_HINT_T1);
      if constexpr (NN > 1) _mm_prefetch(pf_code + (steps + s) * tb + c, _MM_HINT_T1);
    }
    if (szb) {
      for (int64_t c = 0; c < szb; c += 64) {
        _mm_prefetch(pf_sz + s * szb + c, _MM_HINT_T1);
        if constexpr (NN > 1) _mm_prefetch(pf_sz + (steps + s) * szb + c, _MM_HINT_T1);
      }
    }
    if (s + 1 < steps) {  // the next step's tiles first: its stores are then long done when they are loaded
      c10::BFloat16* next = abuf + ((s + 1) & 1) * 1024;
      w.tile(b0, s + 1, next);
      if constexpr (NN > 1) w.tile(b0 + 1, s + 1, next + 512);
    }
    const c10::BFloat16* a = abuf + (s & 1) * 1024;
    _tile_loadd(4, a, 64);
    if constexpr (NN > 1) _tile_loadd(5, a + 512, 64);
    _tile_loadd(6, xb + s * xb_step, xb_stride);
    if constexpr (NM > 1) _tile_loadd(7, xb + xb_block + s * xb_step, xb_stride);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NM > 1) _tile_dpbf16ps(1, 4, 7);
    if constexpr (NN > 1) _tile_dpbf16ps(2, 5, 6);
    if constexpr (NN > 1 && NM > 1) _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, c_stride);
  if constexpr (NM > 1) _tile_stored(1, c + c_tile, c_stride);
  if constexpr (NN > 1) _tile_stored(2, c + NM * c_tile, c_stride);
  if constexpr (NN > 1 && NM > 1) _tile_stored(3, c + 3 * c_tile, c_stride);
}

// One output vector: int8's fp32 sums times the rows' scales plus bias in one fused multiply-add, int4's plus bias;
// then one rounding to bf16 (nearest even).
inline void store16(__m512 v, const float* scale, const float* bias, c10::BFloat16* dst) {
  if (scale) v = _mm512_fmadd_ps(v, _mm512_loadu_ps(scale), bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps());
  else if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(v));
}

// Fewer than 16 rows (a decode step, a few batched rows): B and C tiles M columns wide, so x's pairs load as they
// lie (one row: x itself; M rows: pairs-major, M to a pair) and no zero columns are packed, multiplied or stored. A
// C element's tdpbf16ps sequence does not depend on the other columns of its tile, so the bits are amx_block's.
inline void configure_narrow(int64_t M) {
  kakeya_amx::TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = t == 4 || t == 5 ? 64 : static_cast<uint16_t>(4 * M);  // A tiles 4, 5 stay 32 bf16 wide
  }
  kakeya_amx::load_config(cfg);
}

void quant_amx_narrow(const at::Tensor& x, const QWeight& w, const float* scale, const float* bias, at::Tensor& y) {
  const int64_t M = x.size(0), N = w.N, pairs = w.K / 2;
  const auto* xp = reinterpret_cast<const uint32_t*>(x.const_data_ptr<c10::BFloat16>());
  const uint32_t* xb = xp;
  if (M > 1 || x.stride(0) != w.K) {  // pairs-major, M to a pair: 16 pairs of the M rows a 16 x 16 transpose
    // (the calling thread's scratch, read by the region's threads during this call; an element-wise loop here,
    // re-reading x's stride per element, cost an 8-row step ~0.5 ms over 120 calls)
    uint32_t* const packed = scratch<uint32_t>(5, (pairs + 15) / 16 * 16 * M);
    const int64_t x_row = x.stride(0) / 2;
    const __mmask16 rows = static_cast<__mmask16>((1u << M) - 1u);
    for (int64_t p0 = 0; p0 < pairs; p0 += 16) {
      const __mmask16 cols = static_cast<__mmask16>(pairs - p0 >= 16 ? 0xffffu : (1u << (pairs - p0)) - 1u);
      __m512 r[16];
      for (int64_t m = 0; m < 16; ++m)
        r[m] = m < M ? _mm512_castsi512_ps(_mm512_maskz_loadu_epi32(cols, xp + m * x_row + p0)) : _mm512_setzero_ps();
      transpose16_regs(r);  // r[j] = pair p0 + j of every row
      for (int64_t j = 0; j < std::min<int64_t>(16, pairs - p0); ++j)
        _mm512_mask_storeu_epi32(packed + (p0 + j) * M, rows, _mm512_castps_si512(r[j]));
    }
    xb = packed;
  }
  auto* yp = y.data_ptr<c10::BFloat16>();
  const int64_t items = (N + 31) / 32;
  const int64_t threads = std::min<int64_t>(items, at::get_num_threads());
  const int64_t run = std::max<int64_t>(1, items / (8 * threads));  // as quant_amx hands them out
  std::atomic<int64_t> next{0};
  const __mmask16 rows_mask = static_cast<__mmask16>((1u << M) - 1u);
  const int64_t y_row = y.stride(0);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    configure_narrow(M);
    alignas(64) c10::BFloat16 abuf[2 * 1024];
    alignas(64) float c[2 * 16 * 16];
    for (int64_t first = next.fetch_add(run); first < items; first = next.fetch_add(run)) {
      for (int64_t item = first; item < std::min(items, first + run); ++item) {
        const int64_t n0 = item * 32;
        const int nn = N - n0 >= 32 ? 2 : 1;
        // B tile s at xb + 16 M s, rows 4 M bytes apart; C tile in at c + 16 M in, element [n][m] at n * M + m
        if (nn == 2) amx_block<2, 1>(w, n0 / 16, xb, 0, 16 * M, 4 * M, abuf, c, 16 * M, 4 * M);
        else amx_block<1, 1>(w, n0 / 16, xb, 0, 16 * M, 4 * M, abuf, c, 16 * M, 4 * M);
        for (int in = 0; in < nn; ++in) {
          const float* sc = scale ? scale + n0 + in * 16 : nullptr;
          const float* bi = bias ? bias + n0 + in * 16 : nullptr;
          if (M == 1) {
            store16(_mm512_loadu_ps(c + in * 16), sc, bi, yp + n0 + in * 16);
            continue;
          }
          // C tile in: [n][m], M floats a row; transposed in registers to each row m's 16 outputs (same values)
          __m512 r[16];
          for (int n = 0; n < 16; ++n) r[n] = _mm512_maskz_loadu_ps(rows_mask, c + in * 16 * M + n * M);
          transpose16_regs(r);
          for (int64_t m = 0; m < M; ++m) store16(r[m], sc, bi, yp + m * y_row + n0 + in * 16);
        }
      }
    }
    _tile_release();
  });
}

void quant_amx(const at::Tensor& x, const QWeight& w, const float* scale, const float* bias, at::Tensor& y) {
  const int64_t M = x.size(0), K = w.K, N = w.N;
  if (M < 16) {
    quant_amx_narrow(x, w, scale, bias, y);
    return;
  }
  const int64_t mblocks = (M + 15) / 16, pairs = K / 2;
  kakeya_amx::AlignedBuffer<uint32_t> xt(mblocks * pairs * 16);
  pack_x(reinterpret_cast<const uint32_t*>(x.const_data_ptr<c10::BFloat16>()), x.stride(0) / 2, M, pairs, xt.data);
  auto* yp = y.data_ptr<c10::BFloat16>();
  const int64_t n_items = (N + 31) / 32, m_items = (mblocks + 1) / 2, items = n_items * m_items;
  // Items handed out in runs of about an eighth of a thread's share, to whichever thread is free: in equal halves,
  // the calling thread's half of a SmolLM2 decode step's int4 items took ~1.6x the other's time (perf, 1k context;
  // cause not pinned down), and the other waited. Each output element's operations are the same whoever runs it.
  const int64_t threads = std::min<int64_t>(items, at::get_num_threads());
  const int64_t run = std::max<int64_t>(1, items / (8 * threads));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    kakeya_amx::configure();
    alignas(64) c10::BFloat16 abuf[2 * 1024];
    alignas(64) float c[4 * 256];
    alignas(64) float ct[2 * 256];
    for (int64_t first = next.fetch_add(run); first < items; first = next.fetch_add(run)) {
      for (int64_t item = first; item < std::min(items, first + run); ++item) {
        const int64_t n0 = (item / m_items) * 32, mb0 = (item % m_items) * 2;
        const int nn = N - n0 >= 32 ? 2 : 1, nm = mblocks - mb0 >= 2 ? 2 : 1;
        const int64_t b0 = n0 / 16;
        const uint32_t* xb = xt.data + mb0 * pairs * 16;  // x^T in pairs: block im at im * pairs * 16
        if (nn == 2 && nm == 2) amx_block<2, 2>(w, b0, xb, pairs * 16, 256, 64, abuf, c, 256, 64);
        else if (nn == 2) amx_block<2, 1>(w, b0, xb, pairs * 16, 256, 64, abuf, c, 256, 64);
        else if (nm == 2) amx_block<1, 2>(w, b0, xb, pairs * 16, 256, 64, abuf, c, 256, 64);
        else amx_block<1, 1>(w, b0, xb, pairs * 16, 256, 64, abuf, c, 256, 64);
        for (int im = 0; im < nm; ++im) {
          for (int in = 0; in < nn; ++in) transpose16(c + (in * nm + im) * 256, ct + in * 256);  // [m][n] tiles
          for (int mm = 0; mm < 16; ++mm) {
            const int64_t m = (mb0 + im) * 16 + mm;
            if (m >= M) break;
            for (int in = 0; in < nn; ++in)
              store16(_mm512_loadu_ps(ct + in * 256 + mm * 16), scale ? scale + n0 + in * 16 : nullptr,
                      bias ? bias + n0 + in * 16 : nullptr,
                      yp + m * y.stride(0) + n0 + in * 16);
          }
        }
      }
    }
    _tile_release();
  });
}

// The B tiles of W' blocks b0..b0+nn: tile (in, s) row p = the 16 rows' K pairs 16s + p (a dequantized 16 x 32 tile
// is 16 rows of 16 pairs: one 16 x 16 transpose of uint32).
inline void pack_panel(const QWeight& w, int64_t b0, int nn, uint32_t* out) {
  const int64_t steps = w.K / 32;
  alignas(64) c10::BFloat16 t[512];
  for (int in = 0; in < nn; ++in) {
    for (int64_t s = 0; s < steps; ++s) {
      w.tile(b0 + in, s, t);
      transpose16(reinterpret_cast<const float*>(t), reinterpret_cast<float*>(out + (in * steps + s) * 256));
    }
  }
}

void quant_amx_rows(const at::Tensor& x, const QWeight& w, const float* scale, const float* bias, at::Tensor& y) {
  const int64_t M = x.size(0), K = w.K, N = w.N, steps = K / 32, x_row = x.stride(0);
  const auto* xp = x.const_data_ptr<c10::BFloat16>();
  auto* yp = y.data_ptr<c10::BFloat16>();
  const int64_t full = M / 32 * 32;  // rows in whole 32-row blocks; the rest goes through a zero-padded copy
  const int64_t n_items = (N + 31) / 32;
  at::parallel_for(0, n_items, 1, [&](int64_t begin, int64_t end) {
    kakeya_amx::configure();
    kakeya_amx::AlignedBuffer<uint32_t> packed(2 * steps * 256);
    kakeya_amx::AlignedBuffer<c10::BFloat16> tail(M > full ? 32 * K : 1);
    if (M > full) {
      std::memset(tail.data, 0, 32 * K * sizeof(c10::BFloat16));
      for (int64_t m = full; m < M; ++m) std::memcpy(tail.data + (m - full) * K, xp + m * x_row, K * 2);
    }
    alignas(64) float c[32 * 32];
    const auto* b = reinterpret_cast<const c10::BFloat16*>(packed.data);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t n0 = item * 32;
      const int nn = N - n0 >= 32 ? 2 : 1;
      pack_panel(w, n0 / 16, nn, packed.data);
      for (int64_t m0 = 0; m0 < M; m0 += 32) {
        const bool in_place = m0 < full;
        const c10::BFloat16* a = in_place ? xp + m0 * x_row : tail.data;
        const int64_t a_row = in_place ? x_row : K;
        const int64_t rows = std::min<int64_t>(32, M - m0);
        const int nm = rows > 16 ? 2 : 1;
        if (nn == 2 && nm == 2) amx_rows<2, 2>(a, 16 * a_row, a_row * 2, b, steps, c);
        else if (nn == 2) amx_rows<1, 2>(a, 16 * a_row, a_row * 2, b, steps, c);
        else if (nm == 2) amx_rows<2, 1>(a, 16 * a_row, a_row * 2, b, steps, c);
        else amx_rows<1, 1>(a, 16 * a_row, a_row * 2, b, steps, c);
        for (int64_t mm = 0; mm < rows; ++mm)
          for (int in = 0; in < nn; ++in)
            store16(_mm512_loadu_ps(c + mm * nn * 16 + in * 16), scale ? scale + n0 + in * 16 : nullptr,
                    bias ? bias + n0 + in * 16 : nullptr,
                    yp + (m0 + mm) * y.stride(0) + n0 + in * 16);
      }
    }
    _tile_release();
  });
}

inline bool on_amx() { return kakeya_amx::permitted() && kakeya_amx::linear_on.load(); }
#else
constexpr bool kAmx = false;
inline bool on_amx() { return false; }
#endif

// Off AMX: W' a panel of rows at a time, multiplied by kakeya::linear (per element, a sequence that depends on that
// row of x and row of W' only), each panel's columns copied into y (int8: the fp32 sums times the scales plus bias in
// one fused multiply-add, then rounded, as store16 does).
constexpr int64_t kPanelRows = 256;

void quant_panels(const at::Tensor& x, const QWeight& w, const float* scale, const float* bias,
                  const std::optional<at::Tensor>& bias_t, at::Tensor& y) {
  const int64_t M = x.size(0);
  auto* yp = y.data_ptr<c10::BFloat16>();
  // the panel from this thread's scratch (slot 6, no other kernel's): a decode step through here (every machine
  // without AVX-512 BF16) called the allocator for each projection's panel
  // (a buffer past kScratchBytes, a long prompt's, comes from the allocator: scratch keeps its largest for good)
  const auto buffer = [](int slot, int64_t rows, int64_t cols, const at::TensorOptions& options) {
    const size_t bytes = static_cast<size_t>(rows * cols) * options.dtype().itemsize();
    return bytes <= kScratchBytes ? at::from_blob(scratch<char>(slot, bytes), {rows, cols}, options)
                                  : at::empty({rows, cols}, options);
  };
  const int64_t panel_rows = std::min(kPanelRows, w.N);
  auto panel = buffer(6, panel_rows, w.K, x.options());
  for (int64_t n0 = 0; n0 < w.N; n0 += kPanelRows) {
    const int64_t rows = std::min(kPanelRows, w.N - n0);
    auto wp = panel.narrow(0, 0, rows);
    dequant_rows(w, n0, rows, wp.data_ptr<c10::BFloat16>());
    // each panel's products into this thread's scratch too (slot 5): linear's kept outputs are shared by every
    // call site, and a step's many panel shapes turned them over, an allocation each
    auto part = buffer(5, M, rows, x.options().dtype(scale ? at::kFloat : x.scalar_type()));
    if (scale) {
      kakeya_ops::linear_into(x, wp, std::nullopt, part);  // (M, rows) fp32
      const float* pp = part.const_data_ptr<float>();
      for (int64_t m = 0; m < M; ++m)
        for (int64_t j = 0; j < rows; ++j)
          yp[m * w.N + n0 + j] = c10::BFloat16(std::fma(pp[m * rows + j], scale[n0 + j], bias ? bias[n0 + j] : 0.f));
    } else {
      std::optional<at::Tensor> b;
      if (bias_t.has_value()) b = bias_t->narrow(0, n0, rows);
      kakeya_ops::linear_into(x, wp, b, part);  // (M, rows)
      for (int64_t m = 0; m < M; ++m)
        std::memcpy(yp + m * w.N + n0, part.const_data_ptr<c10::BFloat16>() + m * rows, rows * 2);
    }
  }
}

#if defined(KAKEYA_QUANT_VECTOR)
// M (1 to 3) x rows against block b's 16 W' rows: each tile's rows from the unpacking straight into the products,
// never stored, RN W' rows at a time so the M x RN chains stay in registers (for RN < 16 the tiles' codes are read
// again from L1 for the next RN). Each (x row, W' row) chain and reduce16's tree (per W' row, whatever the others)
// are the block path's, so the bits are too. sums: M x 16, row m's at sums + 16 m.
template <int M, int RN>
inline void few_rows_block(const QWeight& w, int64_t b, const c10::BFloat16* xp, int64_t x_row, float* sums) {
  const int64_t steps = w.K / kTileCols;
  alignas(64) float chains[M][kTileRows][16];
  for (int r0 = 0; r0 < kTileRows; r0 += RN) {
    __m512 acc[M][RN];
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < RN; ++r) acc[m][r] = _mm512_setzero_ps();
    for (int64_t s = 0; s < steps; ++s) {
      __m512i xv[M];
      for (int m = 0; m < M; ++m) xv[m] = _mm512_loadu_si512(xp + m * x_row + s * kTileCols);
      w.tile_regs<RN>(b, s, [&](int r, __m512i row) {
        for (int m = 0; m < M; ++m) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], (__m512bh)xv[m], (__m512bh)row);
      }, r0);
    }
    if constexpr (RN == kTileRows) {  // one pass: the chains go to the tree from registers
      for (int m = 0; m < M; ++m) _mm512_store_ps(sums + 16 * m, reduce16(acc[m]));
      return;
    }
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < RN; ++r) _mm512_store_ps(chains[m][r0 + r], acc[m][r]);
  }
  for (int m = 0; m < M; ++m) {
    __m512 a[kTileRows];
    for (int r = 0; r < kTileRows; ++r) a[r] = _mm512_load_ps(chains[m][r]);
    _mm512_store_ps(sums + 16 * m, reduce16(a));
  }
}

// Off AMX, calls of at most kDotRowsMax rows (decode, a few batched rows): quant_panels' numbers without its panel
// round trip and its two parallel regions per 256 rows. A work item takes a block of 16 W' rows (all K): one to three
// x rows straight from the unpacking (few_rows_block), more from the block dequantized once into a per-thread
// buffer. Either way, per (x row, W' row) one vdpbf16ps chain over K in steps
// of 32 from zero, then reduce16's tree, then bias or scale and one rounding — kakeya::linear's dot_tile sequence
// and quant_panels' epilogue, so the bits are quant_panels' (tests/models/test_quant_linear.py compares them).
constexpr int64_t kDotRowsMax = 16;

void quant_dot_rows(const at::Tensor& x, const QWeight& w, const float* scale, const float* bias, at::Tensor& y) {
  const int64_t M = x.size(0), K = w.K, N = w.N, steps = K / kTileCols, blocks = N / kTileRows;
  const auto* xp = x.const_data_ptr<c10::BFloat16>();
  const int64_t x_row = x.stride(0);
  auto* yp = y.data_ptr<c10::BFloat16>();
  // A few blocks per item at least: a step's small projections (N = 576: 36 blocks) still split over the threads.
  at::parallel_for(0, blocks, 4, [&](int64_t begin, int64_t end) {
    c10::BFloat16* const wb = scratch<c10::BFloat16>(0, kTileRows * K);  // tile s of the block at wb + s * 512
    alignas(64) float sums[kTileRows];
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * kTileRows;
      // Whether quant_panels rounds these 16 columns by at::vec's 32-wide conversion or one by one, as
      // kakeya::linear's items do (they differ on NaN only).
      const bool wide = linear_rounds_wide(n0, N);
      // x row m's 16 sums against the block's W' rows to y, rounded as quant_panels rounds them.
      const auto store = [&](int64_t m, float* sum) {
        c10::BFloat16* dst = yp + m * N + n0;
        if (scale) {
          for (int64_t i = 0; i < kTileRows; ++i)
            dst[i] = c10::BFloat16(std::fma(sum[i], scale[n0 + i], bias ? bias[n0 + i] : 0.f));
          return;
        }
        if (bias)
          for (int64_t i = 0; i < kTileRows; ++i) sum[i] += bias[n0 + i];
        round16_as_linear(sum, dst, kTileRows, wide);
      };
      // One to three rows (decode, a small batch, a short verify): from the unpacking straight into the products, a
      // lone row's 16 chains at once, two or three rows' eight W' rows at a time. The block path below stores and
      // reloads each block first (SmolLM2 int4-mixed's 2-row step took 10.3-11.2 ms that way on the EPYC, 8.6-9.1
      // this way: results/concurrent/epyc_few_rows_ab); from four rows on it stays ahead (4 x 4 chains at a time).
      if (M <= 3) {
        alignas(64) float few[3 * kTileRows];
        if (M == 1) few_rows_block<1, kTileRows>(w, b, xp, x_row, few);
        else if (M == 2) few_rows_block<2, 8>(w, b, xp, x_row, few);
        else few_rows_block<3, 8>(w, b, xp, x_row, few);
        for (int64_t m = 0; m < M; ++m) store(m, few + m * kTileRows);
        continue;
      }
      for (int64_t s = 0; s < steps; ++s) w.tile(b, s, wb + s * kTileRows * kTileCols);
      // The next block's codes and scales asked for into L2 while this block's products run (timing only): several
      // rows' products take longer than the read, which then stops stalling the unpacking (the EPYC's int8 head at 4
      // rows: 1.8-2.0 ms, was 2.2-3.0). A lone row is bound by the read itself, and asking ahead slowed it.
      if (b + 1 < end) {
        const int64_t tb = w.tile_bytes();
        const char* codes = reinterpret_cast<const char*>(w.q) + (b + 1) * steps * tb;
        for (int64_t c = 0; c < steps * tb; c += 64) prefetch_l2(codes + c);
        if (const int64_t szb = w.sz_tile_bytes()) {
          const char* sz = static_cast<const char*>(w.sz) + (b + 1) * steps * szb;
          for (int64_t c = 0; c < steps * szb; c += 64) prefetch_l2(sz + c);
        }
      }
      int64_t m = 0;
      // Four x rows against four W' rows at a time (8 loads for 16 products), while four rows are left.
      for (; m + 4 <= M; m += 4) {
        alignas(64) float rows4[4][kTileRows];
        for (int64_t j0 = 0; j0 < kTileRows; j0 += 4) {
          __m512 acc[16];
          for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
          for (int64_t s = 0; s < steps; ++s) {
            const c10::BFloat16* t = wb + s * kTileRows * kTileCols + j0 * kTileCols;
            __m512i xv[4], wv[4];
            for (int r = 0; r < 4; ++r) xv[r] = _mm512_loadu_si512(xp + (m + r) * x_row + s * kTileCols);
            for (int j = 0; j < 4; ++j) wv[j] = _mm512_loadu_si512(t + j * kTileCols);
            for (int r = 0; r < 4; ++r)
              for (int j = 0; j < 4; ++j)
                acc[r * 4 + j] = _mm512_dpbf16_ps(acc[r * 4 + j], (__m512bh)xv[r], (__m512bh)wv[j]);
          }
          _mm512_store_ps(sums, reduce16(acc));
          for (int r = 0; r < 4; ++r)
            for (int j = 0; j < 4; ++j) rows4[r][j0 + j] = sums[r * 4 + j];
        }
        for (int r = 0; r < 4; ++r) store(m + r, rows4[r]);
      }
      for (; m < M; ++m) {  // one x row against the block's 16 W' rows
        const c10::BFloat16* xr = xp + m * x_row;
        __m512 acc[kTileRows];
        for (int i = 0; i < kTileRows; ++i) acc[i] = _mm512_setzero_ps();
        for (int64_t s = 0; s < steps; ++s) {
          const __m512i xv = _mm512_loadu_si512(xr + s * kTileCols);
          const c10::BFloat16* t = wb + s * kTileRows * kTileCols;
#pragma GCC unroll 16
          for (int i = 0; i < kTileRows; ++i)
            acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)xv, (__m512bh)_mm512_loadu_si512(t + i * kTileCols));
        }
        _mm512_store_ps(sums, reduce16(acc));
        store(m, sums);
      }
    }
  });
}
#endif

#if defined(CPU_CAPABILITY_AVX2) && !defined(__AVX512F__)
// AVX2, calls of at most kFewRowsMax int8 / kFewInt4RowsMax int4 rows (decode, a batch of sessions' decode rows, a
// verifier step, decode rows with a prefill chunk): the codes widened straight into the products, never stored.
// W' = int8's codes (exact in fp32) with per-row scales, or int4's
// fma(q - 8, scale, zero), rounded to bf16 as group4 rounds them. Per (x row, W' row) linear_avx2's chain
// (one fused multiply-add per K chunk of 8, in order, from zero) and at::vec's tree (reduce8, eight chains at once),
// then quant_panels' epilogue: the bits are quant_panels'.
// That path dequantized each 256-row panel to bf16, stored it and multiplied it again, two parallel regions per panel:
// an int decode step ran at half bf16's speed though it reads a half or a quarter of the bytes. A work item: 16 W' rows
// (all K); the next item's codes are asked for into L2 a slice per K step.
constexpr int64_t kFewRowsMax = 16;     // int8; more rows: quant_many_avx2 (at 20-24 rows the two within noise)
constexpr int64_t kFewInt4RowsMax = 8;  // int4's unpack costs more: 12 rows here took ~1.2x the panel path's time
constexpr int64_t kInt5PanelRowsMax = 3;  // int5 has no few-row path: up to 3 rows on panels, more quant_many_avx2
enum class Codes { Int8Rows, Int4 };

// 8 fp32 lanes rounded to bf16 (round_bf16) and widened back; NaN-free input skips round_bf16's NaN case (the
// same bits: a lane that is not NaN never takes it).
template <bool MaybeNaN>
__attribute__((always_inline)) inline __m256 as_bf16(__m256 v) {
  if constexpr (MaybeNaN) return _mm256_castsi256_ps(_mm256_slli_epi32(QWeight::round_bf16(v), 16));
  const __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7FFF)), lsb);
  return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// M x rows (fp32, K each, x_row apart) against RN W' rows r0.. of block b: sums[m * RN + r]. M * RN = 8 or 12.
template <int M, int RN, Codes C>
inline void few_rows_avx2(const QWeight& w, int64_t b, int r0, const float* xw, int64_t x_row, float* sums,
                          const char* ahead) {
  static_assert(M * RN == 8 || M * RN == 12, "eight or twelve chains: reduce8 a time");
  constexpr int kChains = M * RN;
  const int64_t steps = w.K / kTileCols, tb = w.tile_bytes();
  constexpr int64_t row_bytes = C == Codes::Int4 ? 16 : kTileCols;  // one W' row's codes in a tile
  const uint8_t* block = w.q + b * steps * tb;
  // The prefetch a builtin and the small loops unrolled by pragma (avx2_block's lesson: prefetch_l2's volatile asm
  // in the loop kept the accumulators in memory, stored at every step).
  __m256 acc[kChains];
#pragma GCC unroll 12
  for (int i = 0; i < kChains; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t s = 0; s < steps; ++s) {
    if (ahead != nullptr)  // the next block's codes, a tile's worth per step
      for (int64_t c = 0; c < tb; c += 64) __builtin_prefetch(ahead + s * tb + c, 0, 2);
    const uint8_t* tile = block + s * tb + r0 * row_bytes;
    const float* xs = xw + s * kTileCols;
    if constexpr (C == Codes::Int8Rows) {
      // Each 8 codes widened straight from memory (vpmovsxbd's own load) and multiplied in turn. The loop loaded a
      // row's 32 codes as two halves and shifted each down before widening, six shuffles per 32 codes where four
      // are now: a one-row call was bound by them, not by memory (SmolLM2's gate/up, int8, 2 threads, out of L2:
      // 79.5 -> 56.3 us; in L2 it had run no faster, 81 us).
#pragma GCC unroll 8
      for (int r = 0; r < RN; ++r)
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) {
          const __m128i codes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(tile + r * kTileCols + 8 * i));
          const __m256 wv = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes));
#pragma GCC unroll 8
          for (int m = 0; m < M; ++m)
            acc[m * RN + r] = _mm256_fmadd_ps(_mm256_loadu_ps(xs + m * x_row + 8 * i), wv, acc[m * RN + r]);
        }
    }
    if constexpr (C == Codes::Int4) {  // a row's codes unpacked, scaled and rounded, then its products
#pragma GCC unroll 8
      for (int r = 0; r < RN; ++r) {
        __m256 wv[4];  // row r0 + r's 32 columns of this step, as W' in fp32
        const float* sz = static_cast<const float*>(w.sz) + ((b * steps + s) * kTileRows + r0 + r) * 2;
        __m128i lo, hi;
        QWeight::int4_codes(tile + r * row_bytes, lo, hi);
        QWeight::widen_i8x32(lo, hi, wv);  // codes 0..15 (as int8, exact)
        const __m256 sv = _mm256_set1_ps(sz[0]), zv = _mm256_set1_ps(sz[1]), eight = _mm256_set1_ps(8.f);
        const bool finite = std::isfinite(sz[0]) && std::isfinite(sz[1]);  // then no value is NaN (at most inf)
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) {
          const __m256 v = _mm256_fmadd_ps(_mm256_sub_ps(wv[i], eight), sv, zv);
          wv[i] = finite ? as_bf16<false>(v) : as_bf16<true>(v);
        }
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i)
#pragma GCC unroll 8
          for (int m = 0; m < M; ++m)
            acc[m * RN + r] = _mm256_fmadd_ps(_mm256_loadu_ps(xs + m * x_row + 8 * i), wv[i], acc[m * RN + r]);
      }
    }
  }
  _mm256_storeu_ps(sums, reduce8(acc));
  if constexpr (kChains == 12) {  // each chain's tree is its own: the last four beside four zeros
    const __m256 rest[8] = {acc[8], acc[9], acc[10], acc[11], _mm256_setzero_ps(), _mm256_setzero_ps(),
                            _mm256_setzero_ps(), _mm256_setzero_ps()};
    alignas(32) float tail[8];
    _mm256_store_ps(tail, reduce8(rest));
    for (int i = 0; i < 4; ++i) sums[8 + i] = tail[i];
  }
}

// One x row, as a function of its own: inlined beside the 2-8 row blocks, the one-row loop ran ~10% slower (a decode
// step's weights stream through it).
template <Codes C>
__attribute__((noinline)) void one_row_avx2(const QWeight& w, int64_t b, int r0, const float* xw, int64_t K,
                                            float* sums, const char* ahead) {
  few_rows_avx2<1, 8, C>(w, b, r0, xw, K, sums, ahead);
}

template <Codes C>
void quant_rows_avx2(const at::Tensor& x, const QWeight& w, const float* scale, const float* bias, at::Tensor& y) {
  const int64_t M = x.size(0), K = w.K, N = w.N, blocks = N / kTileRows;
  const auto* xp = x.const_data_ptr<c10::BFloat16>();
  auto* yp = y.data_ptr<c10::BFloat16>();
  // The x rows go in groups of `rows` (1, 2, 4, 6 or 8; zero-padded, padded rows' sums dropped), each W' row's codes
  // unpacked once per group, against all its rows at once (rows * RN = 8 or 12 chains), while they sit in L1.
  // Unpacking them per pair of rows, 4-8 rows cost 2-4x one; the panel path (W' dequantized to bf16, stored, widened
  // again per 4 rows) took 1.1-1.7x this at int8's 12-16 rows (a batched step carrying a prefill chunk). int8 from 5
  // rows: groups of 6 (6 x 2 blocks; the last padded from 5), then 1, 2 or 4 (3 padded): at every count 5-16 that
  // took 0-15% less than groups of 8 (8 x 1) with the rest as 4 + 1-2; 4 x 3 blocks ran no faster than 4 x 2 at
  // 4-8 rows. int4 pads 5-8 rows to 8: its unpacking costs more than the padded products (5 rows as 4 + 1: 870 ->
  // 1,110 us).
  struct Group {
    int64_t m0, mm, rows;  // x rows m0..m0 + mm, zero-padded to `rows` (1, 2, 4, 6 or 8)
  };
  std::array<Group, kFewRowsMax / 2 + 1> groups;
  int64_t n_groups = 0, m0 = 0;
  if constexpr (C == Codes::Int4) {
    if (M >= 5) groups[n_groups++] = {0, M, 8};  // M <= kFewInt4RowsMax = 8
    m0 = M >= 5 ? M : 0;
  } else {
    for (; M - m0 >= 5; m0 += 6) groups[n_groups++] = {m0, std::min<int64_t>(6, M - m0), 6};
  }
  if (M - m0 > 0) groups[n_groups++] = {m0, M - m0, M - m0 <= 2 ? M - m0 : 4};
  const int64_t padded = groups[n_groups - 1].m0 + groups[n_groups - 1].rows;
  // x widened once (exact), in this thread's scratch (slot 7, no other kernel's): the workers read it
  float* const xw = scratch<float>(7, padded * K);
  const int64_t x_row = x.stride(0);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; k += 8) _mm256_storeu_ps(xw + m * K + k, widen8(xp + m * x_row + k));
  std::fill(xw + M * K, xw + padded * K, 0.f);
  // A few blocks per item at least: a step's small projections (N = 576: 36 blocks) still split over the threads.
  at::parallel_for(0, blocks, 4, [&](int64_t begin, int64_t end) {
    alignas(32) float sums[16];
    for (int64_t b = begin; b < end; ++b) {
      const char* ahead = b + 1 < end ? reinterpret_cast<const char*>(w.q) + (b + 1) * (K / kTileCols) * w.tile_bytes()
                                      : nullptr;
      const int64_t n0 = b * kTileRows;
      // as quant_panels: per-row scales in one fused multiply-add with the bias; else the bias added, one rounding
      const auto store = [&](int64_t m, int r0, int rn, const float* sum) {
        for (int r = 0; r < rn; ++r) {
          const int64_t n = n0 + r0 + r;
          if constexpr (C == Codes::Int8Rows) {
            yp[m * N + n] = c10::BFloat16(std::fma(sum[r], scale[n], bias ? bias[n] : 0.f));
          } else {
            float v = sum[r];
            if (bias) v += bias[n];
            yp[m * N + n] = c10::BFloat16(v);
          }
        }
      };
      if (M == 1) {  // one x row against eight W' rows at a time
        for (int r0 = 0; r0 < kTileRows; r0 += 8) {
          one_row_avx2<C>(w, b, r0, xw, K, sums, r0 == 0 ? ahead : nullptr);
          store(0, r0, 8, sums);
        }
        continue;
      }
      for (int64_t g = 0; g < n_groups; ++g) {  // `rows` x rows against RN W' rows at a time
        const auto [g0, mm, rows] = groups[g];
        const char* next = g == 0 ? ahead : nullptr;
        const auto block = [&]<int RM>() {
          constexpr int RN = RM == 6 ? 2 : 8 / RM;
          for (int r0 = 0; r0 < kTileRows; r0 += RN) {
            few_rows_avx2<RM, RN, C>(w, b, r0, xw + g0 * K, K, sums, r0 == 0 ? next : nullptr);
            for (int64_t m = 0; m < mm; ++m) store(g0 + m, r0, RN, sums + m * RN);
          }
        };
        if (rows == 1) block.template operator()<1>();
        else if (rows == 2) block.template operator()<2>();
        else if (rows == 4) block.template operator()<4>();
        else if (rows == 6) block.template operator()<6>();
        else block.template operator()<8>();
      }
    }
  });
}

// AVX2, calls of more rows (prefill chunks, batched steps): linear_avx2's work items (64 x rows against 48 W' rows)
// over W' rows dequantized 48 at a time by the item that multiplies them, x widened once per call, the epilogue in
// the item. quant_panels runs kakeya::linear once per 256-row panel: x was widened again for each (12 times for a
// SmolLM2 gate/up projection), with two parallel regions and a one-thread epilogue per panel, and int prefill ran
// 1.1-1.4x bf16's time. Each element's chain and tree are linear_avx2's, the epilogue quant_panels': the same bits.
void quant_many_avx2(const at::Tensor& x, const QWeight& w, const float* scale, const float* bias, at::Tensor& y) {
  constexpr int64_t kRows = 64, kCols = 48;
  const int64_t M = x.size(0), K = w.K, N = w.N;
  const auto* xp = x.const_data_ptr<c10::BFloat16>();
  auto* yp = y.data_ptr<c10::BFloat16>();
  thread_local std::vector<float> xf;  // kept per thread up to kScratchBytes, as linear_avx2's
  if (xf.size() < static_cast<size_t>(M * K)) xf.resize(M * K);
  float* const xw = xf.data();
  const int64_t x_row = x.stride(0);  // read once (linear_avx2's lesson: a stride read per element costs)
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      for (int64_t k = 0; k < K; k += 8) _mm256_storeu_ps(xw + m * K + k, widen8(xp + m * x_row + k));
  });
  // A narrow weight's panels alone are too few items for the threads: x's rows are split too (each part
  // dequantizes its panel again).
  const int64_t nb = (N + kCols - 1) / kCols, mb = (M + kRows - 1) / kRows;
  const int64_t parts = std::clamp<int64_t>((4 * at::get_num_threads() + nb - 1) / nb, 1, mb);
  const int64_t part_rows = (mb + parts - 1) / parts * kRows;
  at::parallel_for(0, nb * parts, 1, [&](int64_t begin, int64_t end) {
    alignas(32) float pad[8 * 8] = {};  // K is whole chunks of 8 (K % 32 == 0): avx2_block never reads it
    float sums[kRows * kCols];
    c10::BFloat16* const panel = scratch<c10::BFloat16>(6, kCols * K);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t n0 = item / parts * kCols, nn = std::min(kCols, N - n0);
      const int64_t m_begin = item % parts * part_rows, m_end = std::min(M, m_begin + part_rows);
      if (m_begin >= m_end) continue;
      dequant_rows(w, n0, nn, panel);  // its parallel_for runs inline here (inside a parallel region)
      for (int64_t m0 = m_begin; m0 < m_end; m0 += kRows) {
        const int64_t mm = std::min(kRows, m_end - m0);
        const float* xm = xw + m0 * K;
        const auto cols = [&]<int NJ>(int64_t j) {  // NJ W' rows from j against the block's x rows, 4 at a time
          int64_t r = 0;
          for (; r + 4 <= mm; r += 4)
            avx2_block<c10::BFloat16, 4, NJ>(xm + r * K, K, panel + j * K, K, pad, sums + r * kCols + j, kCols);
          for (; r < mm; ++r)
            avx2_block<c10::BFloat16, 1, NJ>(xm + r * K, K, panel + j * K, K, pad, sums + r * kCols + j, kCols);
        };
        int64_t j = 0;
        for (; j + 3 <= nn; j += 3) cols.template operator()<3>(j);
        for (; j < nn; ++j) cols.template operator()<1>(j);
        for (int64_t r = 0; r < mm; ++r) {  // quant_panels' epilogue
          c10::BFloat16* const dst = yp + (m0 + r) * N + n0;
          const float* const src = sums + r * kCols;
          if (scale) {
            for (int64_t c = 0; c < nn; ++c)
              dst[c] = c10::BFloat16(std::fma(src[c], scale[n0 + c], bias ? bias[n0 + c] : 0.f));
          } else {
            for (int64_t c = 0; c < nn; ++c) dst[c] = c10::BFloat16(bias ? src[c] + bias[n0 + c] : src[c]);
          }
        }
      }
    }
  });
  release_if_large(xf);
}
#endif

// fp32_scales: an int8 weight's scales may also come as fp32 (N,), the exact widening of its bf16 ones, which the
// kernels read as they are (bf16 ones are widened into a fresh tensor every call: ~45 allocations a Gemma 3
// int4-mixed decode step, the head's 1 MB among them).
QWeight check_weight(const at::Tensor& q, const at::Tensor& sz, int64_t bits, bool fp32_scales = false) {
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 8, "quant_linear: bits must be 4, 5 or 8");
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kByte && q.dim() == 2 && q.is_contiguous(),
              "quant_linear: q must be contiguous (N, K * bits / 8) uint8");
  TORCH_CHECK(q.size(1) * 8 % bits == 0, "quant_linear: q's row of ", q.size(1), " bytes holds no whole ", bits,
              "-bit codes");
  const int64_t N = q.size(0), K = q.size(1) * 8 / bits;
  TORCH_CHECK(N % kTileRows == 0 && K % kTileCols == 0, "quant_linear: N must be a multiple of 16 and K of 32");
  TORCH_CHECK(sz.is_contiguous(), "quant_linear: sz must be contiguous");
  if (bits == 4) {
    TORCH_CHECK(sz.scalar_type() == at::kFloat && sz.dim() == 4 && sz.size(0) == N / 16 && sz.size(1) == K / 32 &&
                    sz.size(2) == 16 && sz.size(3) == 2,
                "quant_linear: int4 sz must be (N/16, K/32, 16, 2) fp32 (engine/weights.py's pack_scales)");
  } else if (bits == 5) {
    TORCH_CHECK(sz.scalar_type() == at::kHalf && sz.dim() == 3 && sz.size(0) == N / 16 && sz.size(1) == K / 32 &&
                    sz.size(2) == 16,
                "quant_linear: int5 sz must be (N/16, K/32, 16) fp16 (engine/weights.py's Int5Linear)");
  } else {
    TORCH_CHECK((sz.scalar_type() == at::kBFloat16 || (fp32_scales && sz.scalar_type() == at::kFloat)) &&
                    sz.dim() == 1 && sz.size(0) == N,
                "quant_linear: int8 sz must be (N,) bf16", fp32_scales ? " or fp32" : "",
                " (grouped int8, an fp16 d per group of 32, is kakeya::q8_linear's)");
  }
  return QWeight{q.const_data_ptr<uint8_t>(), sz.const_data_ptr(), bits, N, K};
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& sz, int64_t bits,
                        const std::optional<at::Tensor>& bias) {
  if (bits == 8 && sz.dim() == 3) return kakeya_ops::q8_linear(x, q, sz, bias, false);  // grouped int8 (Q8_0)
  const QWeight w = check_weight(q, sz, bits, /*fp32_scales=*/true);
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) == w.K && x.scalar_type() == at::kBFloat16,
              "quant_linear: x must be (M, K) bf16");
  TORCH_CHECK(x.stride(1) == 1, "quant_linear: rows of x must be contiguous");
  const int64_t M = x.size(0);
  thread_local Reusable out;
  auto y = reusable_empty(out, {M, w.N}, x.options());
  if (M == 0) return y;
  at::Tensor b32, s32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == w.N, "quant_linear: bias must be (N,)");
    b32 = bias->to(at::kFloat).contiguous();
  }
  const bool row_scales = bits == 8;  // applied to the sums
  if (row_scales) s32 = sz.scalar_type() == at::kFloat ? sz : sz.to(at::kFloat);
  const float* bp = bias.has_value() ? b32.const_data_ptr<float>() : nullptr;
  const float* sp = row_scales ? s32.const_data_ptr<float>() : nullptr;
  if (!kAmx || !on_amx()) {
#if defined(KAKEYA_QUANT_VECTOR)
    if (M <= kDotRowsMax) {
      quant_dot_rows(x, w, sp, bp, y);
      return y;
    }
#endif
#if defined(CPU_CAPABILITY_AVX2) && !defined(__AVX512F__)
    if ((bits == 8 && M <= kFewRowsMax) || (bits == 4 && M <= kFewInt4RowsMax)) {
      if (bits == 4) quant_rows_avx2<Codes::Int4>(x, w, sp, bp, y);
      else quant_rows_avx2<Codes::Int8Rows>(x, w, sp, bp, y);
      return y;
    }
    if (M > kInt5PanelRowsMax) {  // more rows than few_rows_avx2 takes, or int5's
      quant_many_avx2(x, w, sp, bp, y);
      return y;
    }
#endif
    quant_panels(x, w, sp, bp, bias, y);
    return y;
  }
#if defined(KAKEYA_AMX) && defined(__AVX512BF16__)
  if (M >= kRowsMin) quant_amx_rows(x, w, sp, bp, y);
  else quant_amx(x, w, sp, bp, y);
#endif
  return y;
}

// int8 rows of codes (as bf16) times their scales, rounded once to bf16: the weights' values.
void scale_rows(c10::BFloat16* out, const int64_t* rows, int64_t R, int64_t K, const void* sz_bf16) {
  const auto* sz = static_cast<const uint16_t*>(sz_bf16);
  for (int64_t r = 0; r < R; ++r) {
    const float s = bf16_bits(uint32_t(sz[rows ? rows[r] : r]) << 16);
    for (int64_t k = 0; k < K; ++k) out[r * K + k] = c10::BFloat16(float(out[r * K + k]) * s);
  }
}

// The weights (N, K) bf16, or their rows `rows` (R,) int64 only (R, K): int4, W' itself (what every path of
// quant_linear multiplies by); int8, the codes times their scales rounded once to bf16 (the kernel multiplies by the
// codes, exact in bf16, and applies the scales to the fp32 sums).
at::Tensor quant_dequant(const at::Tensor& q, const at::Tensor& sz, int64_t bits, const std::optional<at::Tensor>& rows) {
  if (bits == 8 && sz.dim() == 3) return kakeya_ops::q8_dequant(q, sz, rows);
  const QWeight w = check_weight(q, sz, bits);
  if (!rows.has_value()) {
    auto out = at::empty({w.N, w.K}, q.options().dtype(at::kBFloat16));
    dequant_rows(w, 0, w.N, out.data_ptr<c10::BFloat16>());
    if (bits == 8) scale_rows(out.data_ptr<c10::BFloat16>(), nullptr, w.N, w.K, w.sz);
    return out;
  }
  TORCH_CHECK(rows->scalar_type() == at::kLong && rows->dim() == 1, "quant_dequant: rows must be (R,) int64");
  auto idx = rows->contiguous();
  const int64_t R = idx.size(0), steps = w.K / kTileCols;
  const int64_t* ip = idx.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < R; ++i) TORCH_CHECK(ip[i] >= 0 && ip[i] < w.N, "quant_dequant: row ", ip[i], " out of range");
  auto out = at::empty({R, w.K}, q.options().dtype(at::kBFloat16));
  auto* op = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, R * steps, 64, [&](int64_t begin, int64_t end) {
    alignas(64) c10::BFloat16 t[kTileRows * kTileCols];
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / steps, s = i % steps, n = ip[r];
      w.tile(n / kTileRows, s, t);  // the whole tile, so the row's values come from the one routine
      std::memcpy(op + r * w.K + s * kTileCols, t + (n % kTileRows) * kTileCols, kTileCols * 2);
    }
  });
  if (bits == 8) scale_rows(op, ip, R, w.K, w.sz);
  return out;
}

std::string quant_path(int64_t bits) {
  (void)bits;
  if (kAmx && on_amx()) return "amx";
#if defined(CPU_CAPABILITY_AVX2) && !defined(__AVX512F__)
  return "avx2";  // quant_rows_avx2 / quant_many_avx2 (int5's calls of up to 3 rows: panels)
#else
  return "panels";
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kakeya, m) {
  m.def("quant_linear(Tensor x, Tensor q, Tensor sz, int bits, Tensor? bias=None) -> Tensor");
  m.def("quant_dequant(Tensor q, Tensor sz, int bits, Tensor? rows=None) -> Tensor");
  m.def("quant_path(int bits) -> str", &quant_path);
}

TORCH_LIBRARY_IMPL(kakeya, CPU, m) {
  m.impl("quant_linear", &quant_linear);
  m.impl("quant_dequant", &quant_dequant);
}
