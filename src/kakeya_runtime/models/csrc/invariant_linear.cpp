// y = x W^T (+ b) on the CPU whose every output element is computed by one fixed sequence of operations,
// whatever the number of rows in the call: kakeya::linear.
//
// Why: library GEMMs pick kernels, K blockings and thread splits by shape, so a token's projection
// changes in its last bits with the number of rows beside it (a decode step, a 21-token turn, a 512-token
// prefill chunk, a batch of sessions). Here y[m][n] depends only on row m of x and row n of W:
// - AMX (bf16, CPUs with AMX-BF16): tdpbf16ps over K in steps of 32, in order, from a zeroed tile. Rows of
//   x are the columns of the B tile (padded to 16 with zeros), rows of W the rows of the A tile, loaded in
//   place (no repacking of the weights, so a tied embedding serves as the head as it is). Calls of 32 rows or
//   more (prefill) take the same products the other way round, x W^T with x rows as A tiles in place and each
//   32-row panel of W packed per call as B tiles: no transposes, and bit-identical to the first (see
//   linear_amx_rows), so a row's bits still do not depend on M.
// - AVX-512 (fp32, and bf16 through vdpbf16ps): 16 fp32 partial sums per element over K in order, then one
//   fixed lane-reduction tree (reduce16: every input vector goes through the same adds).
// - elsewhere: at::vec partial sums over K in order, then at::vec's fixed reduction.
// Threads split the output rows and columns only, never K. Accumulation is fp32; bias is added in fp32
// before the one rounding to the output dtype.

#include "common.h"

namespace {

template <typename T>
inline float as_float(T x) {
  return static_cast<float>(x);
}

// acc (+ bias) rounded once to the output dtype; the same routine on every path, vector part and tail alike
// (at::vec's fp32 -> bf16 conversion rounds to nearest even, as c10's scalar one does).
template <typename T>
inline void store_row(float* acc, const float* bias, T* dst, int64_t n) {
  using Vec = at::vec::Vectorized<float>;
  if (bias) {
    int64_t j = 0;
    for (; j + Vec::size() <= n; j += Vec::size()) (Vec::loadu(acc + j) + Vec::loadu(bias + j)).store(acc + j);
    for (; j < n; ++j) acc[j] += bias[j];
  }
  convert_row(acc, dst, n);
}

#if defined(KAKEYA_AMX)
// ---------------------------------------------------------------- AMX (bf16)
constexpr bool kAmx = true;
using kakeya_amx::permitted;
inline bool linear_amx() { return kakeya_amx::linear_on.load(); }

// C^T tiles for NN blocks of 16 W rows and NM blocks of 16 x rows, over K in steps of 32. A tile s of W block i
// sits at wa + i * w_block + s * w_step with rows w_stride bytes apart (the weights in place, or a packed
// slice); xt: x^T in pairs, (Mp/16, K/2, 16) of uint32.
template <int NN, int NM>
inline void amx_block(const c10::BFloat16* wa, int64_t w_block, int64_t w_step, int64_t w_stride, int64_t K,
                      const uint32_t* xt, int64_t mb0, float* c) {
  _tile_zero(0);
  if constexpr (NM > 1) _tile_zero(1);
  if constexpr (NN > 1) _tile_zero(2);
  if constexpr (NN > 1 && NM > 1) _tile_zero(3);
  const int64_t pairs = K / 2;
  for (int64_t s = 0; s < K / 32; ++s) {
    _tile_loadd(4, wa + s * w_step, w_stride);
    if constexpr (NN > 1) _tile_loadd(5, wa + w_block + s * w_step, w_stride);
    _tile_loadd(6, xt + (mb0 * pairs + s * 16) * 16, 64);
    if constexpr (NM > 1) _tile_loadd(7, xt + ((mb0 + 1) * pairs + s * 16) * 16, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NM > 1) _tile_dpbf16ps(1, 4, 7);
    if constexpr (NN > 1) _tile_dpbf16ps(2, 5, 6);
    if constexpr (NN > 1 && NM > 1) _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, 64);  // c: tile (in, im) at (in * NM + im) * 256, element [n][m] at n * 16 + m
  if constexpr (NM > 1) _tile_stored(1, c + 256, 64);
  if constexpr (NN > 1) _tile_stored(2, c + NM * 256, 64);
  if constexpr (NN > 1 && NM > 1) _tile_stored(3, c + 3 * 256, 64);
}

// pack_x (common.h): x^T in pairs for the few-row path's B tiles.

template <typename T>
void linear_amx(const at::Tensor& x, const at::Tensor& w, const float* bias, at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const int64_t mblocks = (M + 15) / 16, pairs = K / 2, steps = K / 32;
  kakeya_amx::AlignedBuffer<uint32_t> xt(mblocks * pairs * 16);
  pack_x(reinterpret_cast<const uint32_t*>(x.const_data_ptr<c10::BFloat16>()), x.stride(0) / 2, M, pairs, xt.data);
  const auto* wp = w.const_data_ptr<c10::BFloat16>();
  auto* yp = y.data_ptr<T>();
  const int64_t n_items = (N + 31) / 32, m_items = (mblocks + 1) / 2;
  at::parallel_for(0, n_items * m_items, 1, [&](int64_t begin, int64_t end) {
    kakeya_amx::configure();
    alignas(64) float c[4 * 256];
    alignas(64) float ct[2 * 256];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t n0 = (item / m_items) * 32, mb0 = (item % m_items) * 2;
      const int nn = N - n0 >= 32 ? 2 : 1, nm = mblocks - mb0 >= 2 ? 2 : 1;
      const c10::BFloat16* wa = wp + n0 * K;  // W rows in place: tile s of block i at wa + i * 16K + 32s
      const int64_t w_block = 16 * K, w_step = 32, w_stride = K * 2;
      if (nn == 2 && nm == 2) amx_block<2, 2>(wa, w_block, w_step, w_stride, K, xt.data, mb0, c);
      else if (nn == 2) amx_block<2, 1>(wa, w_block, w_step, w_stride, K, xt.data, mb0, c);
      else if (nm == 2) amx_block<1, 2>(wa, w_block, w_step, w_stride, K, xt.data, mb0, c);
      else amx_block<1, 1>(wa, w_block, w_step, w_stride, K, xt.data, mb0, c);
      for (int im = 0; im < nm; ++im) {
        for (int in = 0; in < nn; ++in) transpose16(c + (in * nm + im) * 256, ct + in * 256);  // [m][n] tiles
        for (int mm = 0; mm < 16; ++mm) {
          const int64_t m = (mb0 + im) * 16 + mm;
          if (m >= M) break;
          for (int in = 0; in < nn; ++in) {  // + bias in fp32, then one rounding to bf16 (nearest even) or none
            __m512 v = _mm512_loadu_ps(ct + in * 256 + mm * 16);
            if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + n0 + in * 16));
            T* dst = yp + m * y.stride(0) + n0 + in * 16;
            if constexpr (std::is_same_v<T, float>) {
              _mm512_storeu_ps(dst, v);
            } else {
              _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(v));
            }
          }
        }
      }
    }
    _tile_release();
  });
}

// The many-row path (M >= kRowsMin): the same products in the other orientation, C = x W^T, so no transposes.
// x rows are the A tiles in place; each 32-row panel of W is packed once per call into B tiles (pair-rows of K,
// 16 W rows wide), then every 32-row block of x runs against it. C[m][n] takes the same tdpbf16ps sequence over
// K as on the path above (A and B swap roles, and a bf16 x bf16 product is exact in fp32), so the bits are the
// same on both paths, whatever M is.
constexpr int64_t kRowsMin = 32;

// amx_rows (common.h): the NM x NN C tiles of this path; quant_linear.cpp runs the same sequence on W'.

// B tiles of W rows n0..n0+16*nn: tile (in, s) row p = the 16 rows' K pairs 16s + p, i.e. 16 x 16 transposes of
// (rows, pairs) blocks of uint32.
inline void pack_w(const uint32_t* wp, int64_t pairs, int64_t n0, int nn, uint32_t* out) {
  const int64_t steps = pairs / 16;
  alignas(64) uint32_t in[256];
  for (int in_blk = 0; in_blk < nn; ++in_blk) {
    for (int64_t s = 0; s < steps; ++s) {
      for (int r = 0; r < 16; ++r) std::memcpy(in + r * 16, wp + (n0 + in_blk * 16 + r) * pairs + s * 16, 64);
      transpose16(reinterpret_cast<const float*>(in), reinterpret_cast<float*>(out + (in_blk * steps + s) * 256));
    }
  }
}

// Every panel of W packed as pack_w lays it out, panel p (W rows 32p..) at p * 2 * steps * 256 uint32: the B tiles
// of the many-row path computed once (at load) instead of per call. Same bytes as pack_w's, so the same bits.
inline int64_t packed_panel(int64_t K) { return 2 * (K / 32) * 256; }

void pack_all(const uint32_t* wp, int64_t K, int64_t N, uint32_t* out) {
  const int64_t n_items = (N + 31) / 32;
  at::parallel_for(0, n_items, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item)
      pack_w(wp, K / 2, item * 32, N - item * 32 >= 32 ? 2 : 1, out + item * packed_panel(K));
  });
}

template <typename T>
void linear_amx_rows(const at::Tensor& x, const at::Tensor& w, const float* bias, at::Tensor& y,
                     const uint32_t* prepacked) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), steps = K / 32, x_row = x.stride(0);
  const auto* xp = x.const_data_ptr<c10::BFloat16>();
  const auto* wp = reinterpret_cast<const uint32_t*>(w.const_data_ptr<c10::BFloat16>());
  auto* yp = y.data_ptr<T>();
  const int64_t full = M / 32 * 32;  // rows in whole 32-row blocks; the rest goes through a zero-padded copy
  const int64_t n_items = (N + 31) / 32;
  at::parallel_for(0, n_items, 1, [&](int64_t begin, int64_t end) {
    kakeya_amx::configure();
    kakeya_amx::AlignedBuffer<uint32_t> packed(prepacked ? 1 : 2 * steps * 256);
    kakeya_amx::AlignedBuffer<c10::BFloat16> tail(M > full ? 32 * K : 1);
    if (M > full) {
      std::memset(tail.data, 0, 32 * K * sizeof(c10::BFloat16));
      for (int64_t m = full; m < M; ++m) std::memcpy(tail.data + (m - full) * K, xp + m * x_row, K * 2);
    }
    alignas(64) float c[32 * 32];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t n0 = item * 32;
      const int nn = N - n0 >= 32 ? 2 : 1;
      if (!prepacked) pack_w(wp, K / 2, n0, nn, packed.data);
      const auto* b = reinterpret_cast<const c10::BFloat16*>(prepacked ? prepacked + item * packed_panel(K)
                                                                        : packed.data);
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
        for (int64_t mm = 0; mm < rows; ++mm) {
          for (int in = 0; in < nn; ++in) {  // + bias in fp32, then one rounding to bf16 (nearest even) or none
            __m512 v = _mm512_loadu_ps(c + mm * nn * 16 + in * 16);
            if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + n0 + in * 16));
            T* dst = yp + (m0 + mm) * y.stride(0) + n0 + in * 16;
            if constexpr (std::is_same_v<T, float>) {
              _mm512_storeu_ps(dst, v);
            } else {
              _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(v));
            }
          }
        }
      }
    }
    _tile_release();
  });
}
#else
constexpr bool kAmx = false;
inline bool permitted() { return false; }
inline bool linear_amx() { return false; }
#endif

#if defined(__AVX512F__)
// ---------------------------------------------------------------- AVX-512 dot products
// One K chunk of the partial sums: 16 fp32 elements (or 32 bf16 via vdpbf16ps), the tail masked to zero.
template <typename T>
struct Chunk;

template <>
struct Chunk<float> {
  static constexpr int size = 16;
  static inline __m512i load(const float* p, __mmask16 mask) { return _mm512_castps_si512(_mm512_maskz_loadu_ps(mask, p)); }
  static inline __mmask16 tail(int64_t left) { return static_cast<__mmask16>((1u << left) - 1); }
  static inline __m512 fma(__m512 acc, __m512i a, __m512i b) {
    return _mm512_fmadd_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(b), acc);
  }
};

template <>
struct Chunk<c10::BFloat16> {
  static constexpr int size = 32;
  static inline __m512i load(const c10::BFloat16* p, __mmask32 mask) { return _mm512_maskz_loadu_epi16(mask, p); }
  static inline __mmask32 tail(int64_t left) { return static_cast<__mmask32>((1ull << left) - 1); }
#if defined(__AVX512BF16__)
  static inline __m512 fma(__m512 acc, __m512i a, __m512i b) { return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b); }
#endif
};

// One chunk of K at p: all of it (mask std::nullopt), or the lanes of a tail mask, the rest zero (the same values a
// full mask gives: zeros add exactly nothing to a partial sum).
template <typename C, typename T, typename Mask>
inline __m512i load_chunk(const T* p, const Mask& mask) {
  if constexpr (std::is_same_v<Mask, std::nullopt_t>) return _mm512_loadu_si512(p);
  else return C::load(p, *mask);
}

// RM rows of x against NJ rows of W (RM * NJ == 16 partial-sum vectors), reduced once at the end.
// `ahead` (timing only): NJ rows of W, each asked for at the offset this step loads, as dot_row16 asks for them.
template <typename T, int RM, int NJ>
__attribute__((always_inline)) inline void dot_tile(const T* x, int64_t x_row, const T* w, int64_t K, float* out, int64_t out_row,
                     const T* ahead = nullptr) {
  using C = Chunk<T>;
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  // One chunk: every load masked to `mask`, or none (plain loads in the loop over whole chunks: with a mask computed
  // in the loop, GCC kept the accumulators on the stack, a store each per chunk, at a third of the speed).
  const auto step = [&](int64_t k0, auto mask) __attribute__((always_inline)) {
    __m512i xv[RM], wv[NJ];
    for (int r = 0; r < RM; ++r) xv[r] = load_chunk<C>(x + r * x_row + k0, mask);
    if (ahead != nullptr)
      for (int j = 0; j < NJ; ++j) prefetch_l2(ahead + j * K + k0);
    for (int j = 0; j < NJ; ++j) wv[j] = load_chunk<C>(w + j * K + k0, mask);
    for (int r = 0; r < RM; ++r)
      for (int j = 0; j < NJ; ++j) acc[r * NJ + j] = C::fma(acc[r * NJ + j], xv[r], wv[j]);
  };
  const int64_t whole = K / C::size * C::size;
  for (int64_t k0 = 0; k0 < whole; k0 += C::size) step(k0, std::nullopt);
  if (whole < K) step(whole, std::optional(C::tail(K - whole)));
  alignas(64) float sums[16];
  _mm512_store_ps(sums, reduce16(acc));
  for (int r = 0; r < RM; ++r)
    for (int j = 0; j < NJ; ++j) out[r * out_row + j] = sums[r * NJ + j];
}

// One row of x against `count` (<= 16) rows of W: each product's chain as dot_tile's, reduced by the same tree.
template <typename T>
inline void dot_row16(const T* x, const T* w, int64_t K, int64_t count, float* out, const T* ahead = nullptr) {
  using C = Chunk<T>;
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  // Always 16 chains (rows past `count` repeat the last row, their sums dropped): a loop bound known at compile time
  // keeps the accumulators in registers.
  const T* wr[16];
  for (int j = 0; j < 16; ++j) wr[j] = w + std::min<int64_t>(j, count - 1) * K;
  // `ahead`: the next 16 rows, each asked for at the offset this step loads (timing only): a row of a few hundred
  // elements is a stream too short for the hardware prefetcher to follow, and without this a decode row read
  // SmolLM2's head at 16.8 GB/s, with it 27.0 (results/engine/dot_row_ahead)
  const auto step = [&](int64_t k0, auto mask) __attribute__((always_inline)) {
    const __m512i xv = load_chunk<C>(x + k0, mask);
    if (ahead != nullptr)
      for (int j = 0; j < 16; ++j) prefetch_l2(ahead + j * K + k0);
    for (int j = 0; j < 16; ++j) acc[j] = C::fma(acc[j], xv, load_chunk<C>(wr[j] + k0, mask));
  };
  const int64_t whole = K / C::size * C::size;
  for (int64_t k0 = 0; k0 < whole; k0 += C::size) step(k0, std::nullopt);
  if (whole < K) step(whole, std::optional(C::tail(K - whole)));
  alignas(64) float sums[16];
  _mm512_store_ps(sums, reduce16(acc));
  std::copy(sums, sums + count, out);
}

// Up to kFewRowsMax rows (a decode step, a verifier step, a batch of sessions' decode rows): work items of 16 W rows
// instead of 64, so the threads share a small projection evenly (576 outputs: 36 items, 18 a thread, where 9 items
// of 64 split 5 : 4), each block read from memory once for all the rows: four rows at a time in 4 x 4 tiles
// (dot_tile), two or three left over in 2 x 8 or 3 x 4 tiles, a lone row against all 16 (dot_row16), the next block
// asked for during the first pass. Each element is the chain dot_row16 gives it in a 64-row item, rounded as that
// item rounds its column (round16_as_linear). Four rows and more took the prefill tiling before, which streams items
// of 64 W rows with no look-ahead: a 5-row verifier step read SmolLM2's projections at half a decode step's rate on
// the EPYC (results/engine/few_rows_epyc). From ~64 rows (prefill chunks) that tiling is as fast or faster.
constexpr int64_t kFewRowsMax = 64;

template <typename T, typename O>
void linear_dot_few(const T* xp, int64_t x_row, int64_t M, const T* wp, int64_t K, int64_t N, const float* bias,
                    O* yp, int64_t y_row) {
  at::parallel_for(0, (N + 15) / 16, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float acc[4 * 16];
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * 16, nn = std::min<int64_t>(16, N - n0);
      const bool wide = linear_rounds_wide(n0, N);
      // the next block's rows, asked for as this one's are read (the last block of the thread's range asks for none)
      const T* next = b + 1 < end && n0 + 32 <= N ? wp + (n0 + 16) * K : nullptr;
      const T* w = wp + n0 * K;
      const auto store = [&](int64_t m, const float* sums) {
        alignas(64) float row[16];
        std::copy(sums, sums + nn, row);
        if (bias)
          for (int64_t j = 0; j < nn; ++j) row[j] += bias[n0 + j];
        round16_as_linear(row, yp + m * y_row + n0, nn, wide);
      };
      const int64_t rows4 = nn == 16 ? M / 4 * 4 : 0;  // a partial last block goes one row at a time
      for (int64_t m0 = 0; m0 < rows4; m0 += 4) {
        for (int64_t j = 0; j < 16; j += 4)
          dot_tile<T, 4, 4>(xp + m0 * x_row, x_row, w + j * K, K, acc + j, 16,
                            m0 == 0 && next != nullptr ? next + j * K : nullptr);
        for (int64_t r = 0; r < 4; ++r) store(m0 + r, acc + r * 16);
      }
      const int64_t left = nn == 16 ? M - rows4 : 0;  // 2 or 3 rows: in 2 x 8 or 3 x 4 tiles, as dense
      const T* ahead = rows4 == 0 ? next : nullptr;
      if (left == 2 || left == 3) {
        for (int64_t j = 0; j < 16; j += left == 2 ? 8 : 4) {
          const T* a = ahead != nullptr ? ahead + j * K : nullptr;
          if (left == 2) dot_tile<T, 2, 8>(xp + rows4 * x_row, x_row, w + j * K, K, acc + j, 16, a);
          else dot_tile<T, 3, 4>(xp + rows4 * x_row, x_row, w + j * K, K, acc + j, 16, a);
        }
        for (int64_t r = 0; r < left; ++r) store(rows4 + r, acc + r * 16);
        continue;
      }
      for (int64_t m = rows4; m < M; ++m) {
        dot_row16<T>(xp + m * x_row, w, K, nn, acc, m == 0 ? next : nullptr);
        store(m, acc);
      }
    }
  });
}

template <typename T, typename O>
void linear_dot(const at::Tensor& x, const at::Tensor& w, const float* bias, at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const T* xp = x.const_data_ptr<T>();
  const T* wp = w.const_data_ptr<T>();
  O* yp = y.data_ptr<O>();
  const int64_t x_row = x.stride(0);
  if (M <= kFewRowsMax) return linear_dot_few<T, O>(xp, x_row, M, wp, K, N, bias, yp, y.stride(0));
  constexpr int64_t NB = kLinearItemCols;  // W rows per work item (output columns rounded together)
  constexpr int64_t MB = 32;  // x rows per work item
  const int64_t n_items = (N + NB - 1) / NB, m_items = (M + MB - 1) / MB;
  at::parallel_for(0, n_items * m_items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(MB * NB);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t n0 = (item / m_items) * NB, m0 = (item % m_items) * MB;
      const int64_t nn = std::min(NB, N - n0), mm = std::min(MB, M - m0);
      const int64_t full = nn / 4 * 4, rows4 = mm / 4 * 4;
      for (int64_t j = 0; j < full; j += 4)
        for (int64_t r = 0; r < rows4; r += 4)
          dot_tile<T, 4, 4>(xp + (m0 + r) * x_row, x_row, wp + (n0 + j) * K, K, acc.data() + r * NB + j, NB);
      // The rest one row at a time: rows past the last four against every W row, the first rows against W's last
      // few; 16 W rows to a call (one independent chain each: a single chain waited on each product's latency).
      for (int64_t r = 0; r < mm; ++r) {
        const int64_t j_from = r < rows4 ? full : 0;
        for (int64_t j = j_from; j < nn; j += 16)
          dot_row16<T>(xp + (m0 + r) * x_row, wp + (n0 + j) * K, K, std::min<int64_t>(16, nn - j),
                       acc.data() + r * NB + j);
      }
      for (int64_t r = 0; r < mm; ++r)
        store_row(acc.data() + r * NB, bias ? bias + n0 : nullptr, yp + (m0 + r) * y.stride(0) + n0, nn);
    }
  });
}

#endif

// ---------------------------------------------------------------- portable fallback
template <typename T, typename O>
void linear_generic(const at::Tensor& x, const at::Tensor& w, const float* bias, at::Tensor& y) {
  using Vec = at::vec::Vectorized<float>;
  constexpr int VS = Vec::size();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const T* xp = x.const_data_ptr<T>();
  const T* wp = w.const_data_ptr<T>();
  O* yp = y.data_ptr<O>();
  at::parallel_for(0, M * N, 256, [&](int64_t begin, int64_t end) {
    std::vector<float> xf(K + VS, 0.f), wf(K + VS, 0.f);
    int64_t cached_m = -1;
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t m = idx / N, n = idx % N;
      if (m != cached_m) {
        for (int64_t k = 0; k < K; ++k) xf[k] = as_float(xp[m * x.stride(0) + k]);
        cached_m = m;
      }
      for (int64_t k = 0; k < K; ++k) wf[k] = as_float(wp[n * K + k]);
      Vec acc(0.f);
      for (int64_t k = 0; k < K; k += VS) acc = at::vec::fmadd(Vec::loadu(xf.data() + k), Vec::loadu(wf.data() + k), acc);
      float s = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc);
      if (bias) s += bias[n];
      yp[m * y.stride(0) + n] = static_cast<O>(s);
    }
  });
}

#if defined(CPU_CAPABILITY_AVX2) && !defined(__AVX512F__)
// ---------------------------------------------------------------- AVX2: linear_generic's bits, blocked
// Every output element's sequence is linear_generic's (8 fp32 lanes, one fused multiply-add per K chunk of 8 in
// order from zero, K padded with zeros to whole chunks, at::vec's reduction, bias, one rounding), so the bits are
// too; only the order in which elements are computed differs. W rows are widened chunk by chunk as they are
// loaded (the portable path widened a whole W row per output element, and read it again for every x row) and each
// is used against several x rows, widened once per call: 5-9x faster on an AVX2-only EPYC.
// avx2_block (common.h): RM x rows against NJ W rows, the per-element sequence above.

template <typename T, typename O>
void linear_avx2(const at::Tensor& x, const at::Tensor& w, const float* bias, at::Tensor& y) {
  constexpr int64_t kRows = 64, kCols = 48;  // a work item: 64 x rows against 48 W rows
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), KP = (K + 7) / 8 * 8;
  const T* xp = x.const_data_ptr<T>();
  const T* wp = w.const_data_ptr<T>();
  O* yp = y.data_ptr<O>();
  // the strides read once: read per element (a call into the tensor each), the epilogue was ~15% of a prefill's
  // projection time
  const int64_t x_row = x.stride(0), y_row = y.stride(0);
  // x widened once, each row zero-padded to whole chunks (as linear_generic's xf); the buffer is kept per thread
  // (up to kScratchBytes), so a decode step allocates nothing here
  // A call of 2 or 3 rows (a verifier step, a small batch) runs each W row against all of them at once: x
  // zero-padded to `few` rows (2 or 4), 8 chains a block (the general blocks below four rows widened each W row
  // again per x row, on 3 latency-bound chains: two rows cost ~2.5x one). From 4 rows those blocks' 4 x 3 tiles
  // read fewer bytes per product than 8 x 1 ones (measured: 8 rows ~1.4x slower as 8 x 1).
  const int64_t few = M == 2 ? 2 : M == 3 ? 4 : 0;
  const int64_t x_rows = std::max(M, few);
  thread_local std::vector<float> xf;
  if (xf.size() < static_cast<size_t>(x_rows * KP)) xf.resize(x_rows * KP);
  float* const xw = xf.data();
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      for (int64_t k = 0; k < K; ++k) xw[m * KP + k] = as_float(xp[m * x_row + k]);
      std::fill(xw + m * KP + K, xw + (m + 1) * KP, 0.f);
    }
  });
  std::fill(xw + M * KP, xw + x_rows * KP, 0.f);
  const int64_t mb = (M + kRows - 1) / kRows, nb = (N + kCols - 1) / kCols;
  at::parallel_for(0, mb * nb, 1, [&](int64_t begin, int64_t end) {
    alignas(32) float pad[8 * 8];
    float sums[kRows * kCols];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t m0 = item % mb * kRows, n0 = item / mb * kCols;  // W-major: a W block stays in cache over x
      const int64_t mm = std::min(kRows, M - m0), nn = std::min(kCols, N - n0);
      // W rows' last partial chunks, zero-padded (as linear_generic's wf), 8 rows at a time
      const auto tails = [&](int64_t j0, int64_t count) {
        std::fill(pad, pad + 64, 0.f);
        if (K % 8)
          for (int64_t j = 0; j < count; ++j)
            for (int64_t k = K / 8 * 8; k < K; ++k) pad[j * 8 + k % 8] = as_float(wp[(n0 + j0 + j) * K + k]);
      };
      const float* xm = xw + m0 * KP;
      // NJ W rows from j against every x row of the item: four x rows at a time where the registers allow
      const auto cols = [&]<int NJ>(int64_t j) {
        tails(j, NJ);
        int64_t r = 0;
        if constexpr (NJ <= 3)
          for (; r + 4 <= mm; r += 4)
            avx2_block<T, 4, NJ>(xm + r * KP, KP, wp + (n0 + j) * K, K, pad, sums + r * kCols + j, kCols);
        for (; r < mm; ++r)
          avx2_block<T, 1, NJ>(xm + r * KP, KP, wp + (n0 + j) * K, K, pad, sums + r * kCols + j, kCols);
      };
      int64_t next = 0;  // the first W row of the item not yet done
      // 2 or 3 rows: 8 / RM W rows at a time against the `few` (padded) x rows, the next ones asked for meanwhile
      const auto rows_few = [&]<int RM>() {
        constexpr int NJ = 8 / RM;
        for (; next + NJ <= nn; next += NJ) {
          tails(next, NJ);
          const bool more = n0 + next + 2 * NJ <= N;
          avx2_block<T, RM, NJ>(xm, KP, wp + (n0 + next) * K, K, pad, sums + next, kCols,
                                more ? reinterpret_cast<const char*>(wp + (n0 + next + NJ) * K) : nullptr);
        }
      };
      if (few == 2) rows_few.template operator()<2>();
      else if (few == 4) rows_few.template operator()<4>();
      if (mm == 1)  // a decode row: 8 W rows at a time, the next 8 asked for meanwhile
        for (; next + 8 <= nn; next += 8) {
          tails(next, 8);
          const bool more = n0 + next + 16 <= N;
          avx2_block<T, 1, 8>(xm, KP, wp + (n0 + next) * K, K, pad, sums + next, kCols,
                              more ? reinterpret_cast<const char*>(wp + (n0 + next + 8) * K) : nullptr);
        }
      for (; next + 3 <= nn; next += 3) cols.template operator()<3>(next);
      for (; next < nn; ++next) cols.template operator()<1>(next);
      for (int64_t r = 0; r < mm; ++r) {
        O* const dst = yp + (m0 + r) * y_row + n0;
        for (int64_t j = 0; j < nn; ++j) {
          float s = sums[r * kCols + j];
          if (bias) s += bias[n0 + j];
          dst[j] = static_cast<O>(s);
        }
      }
    }
  });
  release_if_large(xf);  // a long prompt's widened rows are not kept for the thread's life
}
#endif

// Which path a (dtype, K, N) takes: fixed per weight, so every call on that weight computes alike.
enum class Path { Amx, Dot, Generic };

Path choose(at::ScalarType dtype, int64_t K, int64_t N) {
  if (dtype == at::kBFloat16 && kAmx && K % 32 == 0 && N % 16 == 0 && permitted() && linear_amx()) return Path::Amx;
#if defined(__AVX512F__)
  if (dtype == at::kFloat) return Path::Dot;
#if defined(__AVX512BF16__)
  if (dtype == at::kBFloat16) return Path::Dot;
#endif
#endif
  return Path::Generic;
}

template <typename O>
void dispatch(Path path, const at::Tensor& x, const at::Tensor& w, const float* bp, at::Tensor& y,
              const uint32_t* prepacked) {
  if (x.scalar_type() == at::kBFloat16) {
#if defined(KAKEYA_AMX)
    if (path == Path::Amx) {
      return x.size(0) >= kRowsMin ? linear_amx_rows<O>(x, w, bp, y, prepacked) : linear_amx<O>(x, w, bp, y);
    }
#endif
#if defined(__AVX512BF16__)
    if (path == Path::Dot) return linear_dot<c10::BFloat16, O>(x, w, bp, y);
#endif
#if defined(CPU_CAPABILITY_AVX2) && !defined(__AVX512F__)
    return linear_avx2<c10::BFloat16, O>(x, w, bp, y);
#endif
    return linear_generic<c10::BFloat16, O>(x, w, bp, y);
  }
#if defined(__AVX512F__)
  if (path == Path::Dot) return linear_dot<float, O>(x, w, bp, y);
#endif
#if defined(CPU_CAPABILITY_AVX2) && !defined(__AVX512F__)
  return linear_avx2<float, O>(x, w, bp, y);
#endif
  linear_generic<float, O>(x, w, bp, y);
}

// out_fp32: return the fp32 sums (+ bias) without the final rounding to x's dtype (the LM head's logits).
void linear_into(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                 const std::optional<at::Tensor>& packed, at::Tensor& y);

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias, bool out_fp32,
                  const std::optional<at::Tensor>& packed) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "linear: CPU only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "linear: x (M, K) and w (N, K) expected");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "linear: x and w must share a dtype");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "linear: dtype ", x.scalar_type(),
              " not supported (float32, bfloat16)");
  TORCH_CHECK(x.stride(1) == 1 && w.is_contiguous(), "linear: rows of x and w must be contiguous");
  const int64_t M = x.size(0), N = w.size(0);
  const bool fp32 = out_fp32 || x.scalar_type() == at::kFloat;
  thread_local Reusable out;
  auto y = reusable_empty(out, {M, N}, x.options().dtype(fp32 ? at::kFloat : x.scalar_type()));
  linear_into(x, w, bias, packed, y);
  return y;
}

// linear's products into y (M, N), fp32 or x's dtype, contiguous: a caller that keeps its own output buffer.
void linear_into(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                 const std::optional<at::Tensor>& packed, at::Tensor& y) {
  const int64_t M = x.size(0), N = w.size(0);
  const bool fp32 = y.scalar_type() == at::kFloat;
  TORCH_CHECK(y.is_contiguous() && y.size(0) == M && y.size(1) == N &&
                  (fp32 || y.scalar_type() == x.scalar_type()), "linear: y must be (M, N) fp32 or x's dtype");
  if (M == 0 || N == 0) return;
  at::Tensor b32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "linear: bias must be (N,)");
    b32 = bias->to(at::kFloat).contiguous();
  }
  const float* bp = bias.has_value() ? b32.const_data_ptr<float>() : nullptr;
  const Path path = choose(x.scalar_type(), x.size(1), N);
  const uint32_t* pp = nullptr;
  if (packed.has_value() && path == Path::Amx) {
    TORCH_CHECK(packed->scalar_type() == at::kInt && packed->is_contiguous() &&
                    packed->numel() == (N + 31) / 32 * 2 * (x.size(1) / 32) * 256,
                "linear: packed must be linear_pack(w)");
    pp = reinterpret_cast<const uint32_t*>(packed->const_data_ptr<int32_t>());
  }
  if (fp32) {
    dispatch<float>(path, x, w, bp, y, pp);
  } else {
    dispatch<c10::BFloat16>(path, x, w, bp, y, pp);
  }
}

// W's B tiles for the many-row AMX path, laid out once (the weights' second copy, int32 words of bf16 pairs), or
// an empty tensor where W does not take that path (dtype, shape, CPU or route).
at::Tensor linear_pack(const at::Tensor& w) {
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 2 && w.is_contiguous(), "linear_pack: contiguous (N, K) CPU weight");
  const int64_t N = w.size(0), K = w.size(1);
  if (choose(w.scalar_type(), K, N) != Path::Amx) return at::empty({0}, w.options().dtype(at::kInt));
  auto out = at::empty({(N + 31) / 32 * 2 * (K / 32) * 256}, w.options().dtype(at::kInt));
#if defined(KAKEYA_AMX)
  pack_all(reinterpret_cast<const uint32_t*>(w.const_data_ptr<c10::BFloat16>()), K, N,
           reinterpret_cast<uint32_t*>(out.data_ptr<int32_t>()));
#endif
  return out;
}

std::string linear_path(int64_t dtype_code, int64_t K, int64_t N) {
  const auto dtype = dtype_code == 1 ? at::kBFloat16 : at::kFloat;
  switch (choose(dtype, K, N)) {
    case Path::Amx: return "amx";
    case Path::Dot: return dtype == at::kBFloat16 ? "avx512-bf16" : "avx512";
#if defined(CPU_CAPABILITY_AVX2) && !defined(__AVX512F__)
    default: return "avx2";  // linear_avx2
#else
    default: return "generic";
#endif
  }
}

// The gated MLP's middle, act(gate) * up, in one pass: x (M, 2I) = [gate | up] rows (the fused projection's output),
// y (M, I). Each element in fp32 (the activation, then the product) and rounded once to x's dtype; the same vector
// code for every element of a row (a short tail through the same ops, masked), so it depends on its own inputs only.
// act 0: SiLU, 1: GELU (tanh approximation).
template <typename T>
void gated_rows(const T* xp, int64_t x_row, T* yp, int64_t I, int64_t M, int64_t act) {
  using Vec = at::vec::Vectorized<float>;
  constexpr int VS = Vec::size();
  at::parallel_for(0, M, row_grain(2 * I), [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> g, u;  // kept across calls: no heap call per step
    g.resize(I), u.resize(I);
    for (int64_t m = begin; m < end; ++m) {
      const T* row = xp + m * x_row;
      convert_row(row, g.data(), I);
      convert_row(row + I, u.data(), I);
      for (int64_t j = 0; j < I; j += VS) {
        const int n = static_cast<int>(std::min<int64_t>(VS, I - j));
        const Vec a = Vec::loadu(g.data() + j, n), b = Vec::loadu(u.data() + j, n);
        Vec h;
        if (act == 0) {
          h = a / (Vec(1.f) + a.neg().exp());
        } else {
          const Vec inner = Vec(0.7978845608028654f) * (a + Vec(0.044715f) * a * a * a);
          h = Vec(0.5f) * a * (Vec(1.f) + inner.tanh());
        }
        (h * b).store(g.data() + j, n);
      }
      T* dst = yp + m * I;
      convert_row(g.data(), dst, I);
    }
  });
}

at::Tensor gated_act(const at::Tensor& x, int64_t act) {
  TORCH_CHECK(x.device().is_cpu(), "gated_act: CPU only");
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0 && x.stride(1) == 1, "gated_act: x (M, 2I) with contiguous rows");
  TORCH_CHECK(act == 0 || act == 1, "gated_act: act 0 (silu) or 1 (gelu tanh)");
  const int64_t M = x.size(0), I = x.size(1) / 2;
  thread_local Reusable out;
  auto y = reusable_empty(out, {M, I}, x.options());
  if (M == 0 || I == 0) return y;
  if (x.scalar_type() == at::kFloat) {
    gated_rows<float>(x.const_data_ptr<float>(), x.stride(0), y.data_ptr<float>(), I, M, act);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "gated_act: float32 or bfloat16");
    gated_rows<c10::BFloat16>(x.const_data_ptr<c10::BFloat16>(), x.stride(0), y.data_ptr<c10::BFloat16>(), I, M,
                              act);
  }
  return y;
}

}  // namespace

namespace kakeya_ops {
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias, bool out_fp32) {
  return ::linear(x, w, bias, out_fp32, std::nullopt);
}
void linear_into(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias, at::Tensor& y) {
  ::linear_into(x, w, bias, std::nullopt, y);
}
at::Tensor gated_act(const at::Tensor& x, int64_t act) { return ::gated_act(x, act); }
}  // namespace kakeya_ops

TORCH_LIBRARY_FRAGMENT(kakeya, m) {
  m.def("gated_act(Tensor x, int act) -> Tensor");
  m.def("linear(Tensor x, Tensor w, Tensor? bias, bool out_fp32=False, Tensor? packed=None) -> Tensor");
  m.def("linear_pack(Tensor w) -> Tensor");
  m.def("linear_path(int dtype, int k, int n) -> str", &linear_path);  // dtype 1: bf16, else fp32
}

TORCH_LIBRARY_IMPL(kakeya, CPU, m) {
  m.impl("linear", &linear);
  m.impl("linear_pack", &linear_pack);
  m.impl("gated_act", &gated_act);
}
