// Attention of a few new query rows over a KV cache, on the CPU: kakeya::cached_attention.
//
// q (B, Hk, R, D): the R query rows that share K/V head h, ordered (group, token): row r is token
// r % T of query head h * (R / T) + r / T, where T = num_new is the number of new tokens.
// k, v (B, Hk, S, D): every key the rows may see; the last T keys are the new tokens themselves, so
// token t sees keys [0, S - T + t] (T = 1, decode: every key). Returns (B, Hk, R, D) in q's dtype.
//
// Why not SDPA: its CPU flash kernel parallelises over (batch, head, query block), three work items for
// SmolLM2's three K/V heads on two threads, and reads a bf16 cache at ~6 GB/s in decode. Here every
// head's keys are split across threads (split-K), each split keeps an online softmax in fp32, and the
// splits are merged by log-sum-exp. Accumulation is fp32 throughout, probabilities included.

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define CPU_CAPABILITY_AVX512
#define CPU_CAPABILITY AVX512
#elif defined(__AVX2__) && defined(__FMA__)
#define CPU_CAPABILITY_AVX2
#define CPU_CAPABILITY AVX2
#endif

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>
#include <cstring>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <cmath>
#include <limits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int VS = Vec::size();
constexpr int BK = 32;          // keys per block: scores, probabilities and converted K/V stay in L1/L2
constexpr int MIN_SPLIT = 128;  // fewest keys worth a work item of their own
constexpr int TILE_ROWS = 8;    // from this many rows, scores come from a transposed K block (no reductions)
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::copy(src, src + n, dst);
  } else {
    at::vec::convert(src, dst, n);
  }
}

// Per work item: the partial softmax state of its R rows over its keys.
struct Partial {
  float* acc;  // (R, D) unnormalised sum of p * v
  float* m;    // (R,) running max score
  float* l;    // (R,) running sum of p
};

#if defined(__AVX512BF16__)
constexpr bool kBf16Dot = true;  // vdpbf16ps: bf16 products exact, accumulated in fp32
#else
constexpr bool kBf16Dot = false;
#endif

// Scores of a block, s[r][j] = q_r . k_j, from keys transposed to (D, BK): broadcast a query element,
// multiply a vector of keys, no horizontal reductions. Rows in fours share each key load.
template <int D>
inline void scores_tiled_f32(const float* qf, const float* kt, float* s, int64_t R) {
  constexpr int NV = BK / VS;
  int64_t r = 0;
  for (; r + 4 <= R; r += 4) {
    Vec acc[4][NV];
    for (int i = 0; i < 4; ++i)
      for (int c = 0; c < NV; ++c) acc[i][c] = Vec(0.f);
    const float* q0 = qf + r * D;
    for (int d = 0; d < D; ++d) {
      Vec kv[NV];
      for (int c = 0; c < NV; ++c) kv[c] = Vec::loadu(kt + d * BK + c * VS);
      for (int i = 0; i < 4; ++i) {
        const Vec qv(q0[i * D + d]);
        for (int c = 0; c < NV; ++c) acc[i][c] = at::vec::fmadd(qv, kv[c], acc[i][c]);
      }
    }
    for (int i = 0; i < 4; ++i)
      for (int c = 0; c < NV; ++c) acc[i][c].store(s + (r + i) * BK + c * VS);
  }
  for (; r < R; ++r) {
    Vec acc[NV];
    for (int c = 0; c < NV; ++c) acc[c] = Vec(0.f);
    for (int d = 0; d < D; ++d) {
      const Vec qv(qf[r * D + d]);
      for (int c = 0; c < NV; ++c) acc[c] = at::vec::fmadd(qv, Vec::loadu(kt + d * BK + c * VS), acc[c]);
    }
    for (int c = 0; c < NV; ++c) acc[c].store(s + r * BK + c * VS);
  }
}

#if defined(__AVX512BF16__)
// The same from bf16 keys in pairs, (D/2, BK) of (k[j][2i], k[j][2i+1]): one vdpbf16ps does two
// multiply-adds per lane, so half the instructions of the fp32 tile. q stays bf16 (unscaled).
template <int D>
inline void scores_tiled_bf16(const uint32_t* qp, const uint32_t* kt2, float* s, int64_t R) {
  constexpr int NV = BK / 16;
  constexpr int P = D / 2;
  int64_t r = 0;
  for (; r + 4 <= R; r += 4) {
    __m512 acc[4][NV];
    for (int i = 0; i < 4; ++i)
      for (int c = 0; c < NV; ++c) acc[i][c] = _mm512_setzero_ps();
    for (int p = 0; p < P; ++p) {
      __m512i kv[NV];
      for (int c = 0; c < NV; ++c) kv[c] = _mm512_loadu_si512(kt2 + p * BK + c * 16);
      for (int i = 0; i < 4; ++i) {
        const __m512i qv = _mm512_set1_epi32(static_cast<int>(qp[(r + i) * P + p]));
        for (int c = 0; c < NV; ++c)
          acc[i][c] = _mm512_dpbf16_ps(acc[i][c], (__m512bh)qv, (__m512bh)kv[c]);
      }
    }
    for (int i = 0; i < 4; ++i)
      for (int c = 0; c < NV; ++c) _mm512_storeu_ps(s + (r + i) * BK + c * 16, acc[i][c]);
  }
  for (; r < R; ++r) {
    __m512 acc[NV];
    for (int c = 0; c < NV; ++c) acc[c] = _mm512_setzero_ps();
    for (int p = 0; p < P; ++p) {
      const __m512i qv = _mm512_set1_epi32(static_cast<int>(qp[r * P + p]));
      for (int c = 0; c < NV; ++c)
        acc[c] = _mm512_dpbf16_ps(acc[c], (__m512bh)qv, (__m512bh)_mm512_loadu_si512(kt2 + p * BK + c * 16));
    }
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(s + r * BK + c * 16, acc[c]);
  }
}
#endif

#if defined(__AVX512BF16__)
// Sixteen vectors to one: lane j of the result is the sum of a[j]'s lanes (a transpose folded into adds,
// ~3 instructions per key instead of one full horizontal sum each).
inline __m512 reduce16(__m512 a[16]) {
  __m512 b[8], c[4];
  for (int i = 0; i < 8; ++i)  // each 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3]
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // each 128-bit lane: that lane's partial sums of four keys
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 e0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 e1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(e0, e1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(e0, e1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// Scores for few rows (decode) straight from bf16 key rows: vdpbf16ps per 32 dims, reduced 16 keys at a time.
// Keys past nb are read as zero.
template <int D>
inline void scores_dot_bf16(const c10::BFloat16* q, const c10::BFloat16* k, int64_t k_row, float* s, int64_t R,
                            int64_t nb) {
  constexpr int DC = D / 32;
  for (int64_t r = 0; r < R; ++r) {
    __m512i qv[DC];
    for (int c = 0; c < DC; ++c) qv[c] = _mm512_loadu_si512(q + r * D + c * 32);
    for (int64_t j0 = 0; j0 < nb; j0 += 16) {
      __m512 acc[16];
      for (int j = 0; j < 16; ++j) {
        acc[j] = _mm512_setzero_ps();
        if (j0 + j >= nb) continue;
        const c10::BFloat16* kr = k + (j0 + j) * k_row;
        for (int c = 0; c < DC; ++c)
          acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)qv[c], (__m512bh)_mm512_loadu_si512(kr + c * 32));
      }
      _mm512_storeu_ps(s + r * BK + j0, reduce16(acc));
    }
  }
}
#endif

// Scores from key rows (BK, D) by dot products: cheaper than transposing when rows are few (decode).
template <int D>
inline void scores_dot(const float* qf, const float* kb, float* s, int64_t R, int64_t nb) {
  constexpr int DV = D / VS;
  for (int64_t j = 0; j < nb; ++j) {
    Vec kv[DV];
    for (int c = 0; c < DV; ++c) kv[c] = Vec::loadu(kb + j * D + c * VS);
    for (int64_t r = 0; r < R; ++r) {
      Vec acc = Vec(0.f);
      for (int c = 0; c < DV; ++c) acc = at::vec::fmadd(Vec::loadu(qf + r * D + c * VS), kv[c], acc);
      s[r * BK + j] = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc);
    }
  }
}

// Online softmax of row r over a block: scale its n visible scores, fold them into the running max and
// sum, leave p = exp(score - max) in s (0 past n), and return the factor the row's accumulator needs.
inline float softmax_row(float* sr, int64_t n, int64_t nb, float score_scale, float& m, float& l) {
  int64_t j = 0;
  Vec vmax(NEG_INF);
  for (; j + VS <= n; j += VS) {
    const Vec x = Vec::loadu(sr + j) * Vec(score_scale);
    x.store(sr + j);
    vmax = at::vec::maximum(vmax, x);
  }
  float bmax = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, vmax);
  for (; j < n; ++j) {
    sr[j] *= score_scale;
    bmax = std::max(bmax, sr[j]);
  }
  const float m_new = std::max(m, bmax);
  const float alpha = std::exp(m - m_new);  // exp(-inf) = 0 on the row's first block
  j = 0;
  Vec vsum(0.f);
  for (; j + VS <= n; j += VS) {
    const Vec p = (Vec::loadu(sr + j) - Vec(m_new)).exp_u20();
    p.store(sr + j);
    vsum = vsum + p;
  }
  float sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, vsum);
  for (; j < n; ++j) {
    sr[j] = std::exp(sr[j] - m_new);
    sum += sr[j];
  }
  std::fill(sr + n, sr + nb, 0.f);
  l = l * alpha + sum;
  m = m_new;
  return alpha;
}

// acc_i = alpha_i * acc_i + sum_j p_ij v_j for NR rows at once: each V load feeds NR rows.
template <int D, int NR>
inline void pv_rows(const float* p, const float* vb, float* acc_rows, const float* alpha, int64_t n) {
  constexpr int DV = D / VS;
  Vec acc[NR][DV];
  for (int i = 0; i < NR; ++i)
    for (int c = 0; c < DV; ++c) acc[i][c] = Vec::loadu(acc_rows + i * D + c * VS) * Vec(alpha[i]);
  for (int64_t j = 0; j < n; ++j) {
    Vec pv[NR];  // broadcast once per row, then each V vector is loaded once for all NR rows
    for (int i = 0; i < NR; ++i) pv[i] = Vec(p[i * BK + j]);
    for (int c = 0; c < DV; ++c) {
      const Vec vv = Vec::loadu(vb + j * D + c * VS);
      for (int i = 0; i < NR; ++i) acc[i][c] = at::vec::fmadd(pv[i], vv, acc[i][c]);
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int c = 0; c < DV; ++c) acc[i][c].store(acc_rows + i * D + c * VS);
}

#if defined(__AVX512BF16__)
// The same with bf16 probabilities against values interleaved by key pairs, vt2 (BK/2, D) of
// (v[2i][d], v[2i+1][d]): one vdpbf16ps adds two keys' terms per lane. Like SDPA's own bf16 flash
// kernel, p is rounded to bf16 here (its sum l stays fp32); products are exact, accumulation fp32.
template <int D, int NR>
inline void pv_rows_bf16(const uint32_t* p2, const uint32_t* vt2, float* acc_rows, const float* alpha,
                         int64_t n) {
  constexpr int DV = D / 16;
  __m512 acc[NR][DV];
  for (int i = 0; i < NR; ++i)
    for (int c = 0; c < DV; ++c)
      acc[i][c] = _mm512_mul_ps(_mm512_loadu_ps(acc_rows + i * D + c * 16), _mm512_set1_ps(alpha[i]));
  for (int64_t jp = 0; jp < (n + 1) / 2; ++jp) {
    __m512i pv[NR];
    for (int i = 0; i < NR; ++i) pv[i] = _mm512_set1_epi32(static_cast<int>(p2[i * BK + jp]));  // row stride: BK floats
    for (int c = 0; c < DV; ++c) {
      const __m512i vv = _mm512_loadu_si512(vt2 + jp * D + c * 16);
      for (int i = 0; i < NR; ++i) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], (__m512bh)pv[i], (__m512bh)vv);
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int c = 0; c < DV; ++c) _mm512_storeu_ps(acc_rows + i * D + c * 16, acc[i][c]);
}

// Values of a block interleaved by key pairs; a missing odd key is zero (p is 0 there, and 0 * garbage
// could be NaN).
template <int D>
inline void interleave_values(const c10::BFloat16* v, int64_t v_row, int64_t nb, uint32_t* vt2) {
  static const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                             39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  static const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int64_t j = 0; j < nb; j += 2) {
    const auto* a = reinterpret_cast<const char*>(v + j * v_row);
    const auto* b = reinterpret_cast<const char*>(v + (j + 1) * v_row);
    for (int c = 0; c < D / 32; ++c) {  // 32 dims per step: two output vectors of 16 pairs
      const __m512i va = _mm512_loadu_si512(a + c * 64);
      const __m512i vb = j + 1 < nb ? _mm512_loadu_si512(b + c * 64) : _mm512_setzero_si512();
      _mm512_storeu_si512(vt2 + (j / 2) * D + c * 32, _mm512_permutex2var_epi16(va, lo, vb));
      _mm512_storeu_si512(vt2 + (j / 2) * D + c * 32 + 16, _mm512_permutex2var_epi16(va, hi, vb));
    }
  }
}
#endif

// One block for every row: softmax per row (a row sees keys below its causal limit only), then p . V in
// groups of RB rows. A row with no key in the block keeps its state (alpha 1, p 0).
template <int D, int RB, bool kBf16>
inline void softmax_pv(float* s, const float* vb, Partial st, int64_t R, int64_t jb, int64_t nb, int64_t S,
                       int64_t T_new, float score_scale, float* alpha) {
  int64_t n_max = 0;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t n = std::min<int64_t>(nb, S - T_new + (r % T_new) + 1 - jb);
    float* sr = s + r * BK;
    if (n <= 0) {
      std::fill(sr, sr + nb, 0.f);
      alpha[r] = 1.f;
      continue;
    }
    n_max = std::max(n_max, n);
    alpha[r] = softmax_row(sr, n, nb, score_scale, st.m[r], st.l[r]);
  }
  if (n_max == 0) return;
  int64_t r = 0;
#if defined(__AVX512BF16__)
  if constexpr (kBf16) {  // p rows to bf16 in place: row r's BK/2 pairs start at s + r * BK
    const auto* vt2 = reinterpret_cast<const uint32_t*>(vb);
    for (int64_t i = 0; i < R; ++i) {
      float* sr = s + i * BK;
      for (int c = 0; c < BK; c += 32)
        _mm512_storeu_si512(reinterpret_cast<uint32_t*>(sr) + c / 2,
                            (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(sr + c + 16), _mm512_loadu_ps(sr + c)));
    }
    const auto* p2 = reinterpret_cast<const uint32_t*>(s);
    for (; r + RB <= R; r += RB) pv_rows_bf16<D, RB>(p2 + r * BK, vt2, st.acc + r * D, alpha + r, n_max);
    const auto rest = [&](auto nr) { pv_rows_bf16<D, decltype(nr)::value>(p2 + r * BK, vt2, st.acc + r * D,
                                                                          alpha + r, n_max); };
    switch (R - r) {  // the last rows (decode's whole group) still share each V load
      case 1: rest(std::integral_constant<int, 1>{}); break;
      case 2: if constexpr (RB > 2) rest(std::integral_constant<int, 2>{}); break;
      case 3: if constexpr (RB > 3) rest(std::integral_constant<int, 3>{}); break;
      default: break;
    }
    return;
  }
#endif
  for (; r + RB <= R; r += RB) pv_rows<D, RB>(s + r * BK, vb, st.acc + r * D, alpha + r, n_max);
  for (; r < R; ++r) pv_rows<D, 1>(s + r * BK, vb, st.acc + r * D, alpha + r, n_max);
}

template <typename T, int D>
void attend_split(const T* q, const T* k, const T* v, int64_t k_row, int64_t v_row, int64_t R, int64_t T_new,
                  int64_t S, int64_t j0, int64_t j1, float scale, Partial st, std::vector<float>& scratch) {
  static_assert(D % VS == 0 && D % 2 == 0, "head_dim must be a multiple of the vector width");
  constexpr int RB = std::max(1, 16 / (D / VS));  // rows per p . V pass: RB * D / VS accumulators
  constexpr bool kPairs = kBf16Dot && std::is_same_v<T, c10::BFloat16>;
  const bool tile = R >= TILE_ROWS;
  // Scratch: qf (R, D) queries, kb (BK, D) key rows or their transpose, vb (BK, D) values, s (R, BK) scores.
  scratch.resize(R * D + 2 * BK * D + R * BK + R);
  float* qf = scratch.data();
  float* kb = qf + R * D;
  float* vb = kb + BK * D;
  float* s = vb + BK * D;
  float* alpha = s + R * BK;
  // With bf16 pairs the query stays bf16 and the scale goes on the scores; otherwise it goes on q.
  const bool pairs = kPairs;
  if (pairs) {
    std::memcpy(qf, q, R * D * sizeof(T));
  } else {
    to_float(q, qf, R * D);
    for (int64_t i = 0; i < R * D; i += VS) (Vec::loadu(qf + i) * Vec(scale)).store(qf + i);
  }
  std::fill(st.acc, st.acc + R * D, 0.f);
  std::fill(st.m, st.m + R, NEG_INF);
  std::fill(st.l, st.l + R, 0.f);

  for (int64_t jb = j0; jb < j1; jb += BK) {
    const int64_t nb = std::min<int64_t>(BK, j1 - jb);
    for (int64_t j = jb + BK; j < std::min<int64_t>(j1, jb + 2 * BK); ++j) {  // the next block, into cache
      for (int64_t off = 0; off < static_cast<int64_t>(D * sizeof(T)); off += 64) {
        __builtin_prefetch(reinterpret_cast<const char*>(k + j * k_row) + off);
        __builtin_prefetch(reinterpret_cast<const char*>(v + j * v_row) + off);
      }
    }
    if (pairs && !tile) {
      // decode: scores straight from the bf16 key rows (below)
    } else if (!tile) {
      for (int64_t j = 0; j < nb; ++j) to_float(k + (jb + j) * k_row, kb + j * D, D);
    } else if (pairs) {  // (D/2, BK) of 32-bit bf16 pairs; keys past nb are zero
      auto* kt2 = reinterpret_cast<uint32_t*>(kb);
      for (int64_t j = 0; j < BK; ++j) {
        const auto* row = reinterpret_cast<const uint32_t*>(k + (jb + j) * k_row);
        for (int p = 0; p < D / 2; ++p) kt2[p * BK + j] = j < nb ? row[p] : 0u;
      }
    } else {  // (D, BK) fp32; keys past nb are zero
      for (int64_t j = 0; j < BK; ++j) {
        float row[D];
        if (j < nb) {
          to_float(k + (jb + j) * k_row, row, D);
        } else {
          std::fill(row, row + D, 0.f);
        }
        for (int d = 0; d < D; ++d) kb[d * BK + j] = row[d];
      }
    }
    if (pairs) {
#if defined(__AVX512BF16__)
      interleave_values<D>(reinterpret_cast<const c10::BFloat16*>(v + jb * v_row), v_row, nb,
                           reinterpret_cast<uint32_t*>(vb));
#endif
    } else {
      for (int64_t j = 0; j < nb; ++j) to_float(v + (jb + j) * v_row, vb + j * D, D);
    }

    float score_scale = 1.f;
    if (pairs && !tile) {
#if defined(__AVX512BF16__)
      scores_dot_bf16<D>(reinterpret_cast<const c10::BFloat16*>(qf), reinterpret_cast<const c10::BFloat16*>(k + jb * k_row),
                         k_row, s, R, nb);
#endif
      score_scale = scale;
    } else if (!tile) {
      scores_dot<D>(qf, kb, s, R, nb);
    } else if (pairs) {
#if defined(__AVX512BF16__)
      scores_tiled_bf16<D>(reinterpret_cast<const uint32_t*>(qf), reinterpret_cast<const uint32_t*>(kb), s, R);
#endif
      score_scale = scale;
    } else {
      scores_tiled_f32<D>(qf, kb, s, R);
    }
    if (pairs) {
      softmax_pv<D, RB, true>(s, vb, st, R, jb, nb, S, T_new, score_scale, alpha);
    } else {
      softmax_pv<D, RB, false>(s, vb, st, R, jb, nb, S, T_new, score_scale, alpha);
    }
  }
}

template <typename T, int D>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out, int64_t T_new,
         float scale) {
  const int64_t B = q.size(0), H = q.size(1), R = q.size(2), S = k.size(2);
  // Splits per head: enough work items to keep every thread busy, each at least MIN_SPLIT keys, and a
  // multiple of the thread count so no thread idles for a head's worth of keys.
  const int64_t threads = at::get_num_threads();
  const int64_t max_splits = std::max<int64_t>(1, S / MIN_SPLIT);
  int64_t splits = std::min<int64_t>(max_splits, threads * ((2 * threads + B * H - 1) / (B * H)));
  splits = std::max<int64_t>(1, splits);
  const int64_t per = ((S + splits - 1) / splits + BK - 1) / BK * BK;  // keys per split, whole blocks
  splits = (S + per - 1) / per;
  const int64_t items = B * H * splits;

  std::vector<float> state(items * R * (D + 2));
  const T* qp = q.const_data_ptr<T>();
  const T* kp = k.const_data_ptr<T>();
  const T* vp = v.const_data_ptr<T>();
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / (H * splits), h = (item / splits) % H, sp = item % splits;
      const int64_t j0 = sp * per, j1 = std::min(S, j0 + per);
      float* base = state.data() + item * R * (D + 2);
      attend_split<T, D>(qp + b * q.stride(0) + h * q.stride(1), kp + b * k.stride(0) + h * k.stride(1),
                         vp + b * v.stride(0) + h * v.stride(1), k.stride(2), v.stride(2), R, T_new, S, j0, j1,
                         scale, Partial{base, base + R * D, base + R * D + R}, scratch);
    }
  });

  // Merge the splits of each (b, h, row) by log-sum-exp and normalise.
  T* op = out.data_ptr<T>();
  at::parallel_for(0, B * H * R, 16, [&](int64_t begin, int64_t end) {
    float row[D];
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t bh = idx / R, r = idx % R;
      float m = NEG_INF;
      for (int64_t sp = 0; sp < splits; ++sp) {
        const float* base = state.data() + (bh * splits + sp) * R * (D + 2);
        m = std::max(m, base[R * D + r]);
      }
      float l = 0.f;
      std::fill(row, row + D, 0.f);
      for (int64_t sp = 0; sp < splits; ++sp) {
        const float* base = state.data() + (bh * splits + sp) * R * (D + 2);
        const float ms = base[R * D + r];
        if (ms == NEG_INF) continue;  // this split lies wholly after the row's causal limit
        const float w = std::exp(ms - m);
        l += w * base[R * D + R + r];
        for (int d = 0; d < D; ++d) row[d] += w * base[r * D + d];
      }
      const float inv = 1.f / l;
      for (int d = 0; d < D; ++d) row[d] *= inv;
      const int64_t b = bh / H, h = bh % H;
      T* dst = op + b * out.stride(0) + h * out.stride(1) + r * out.stride(2);
      if constexpr (std::is_same_v<T, float>) {
        std::copy(row, row + D, dst);
      } else {
        at::vec::convert(row, dst, D);
      }
    }
  });
}

template <typename T>
void dispatch_dim(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out, int64_t T_new,
                  float scale) {
  switch (q.size(3)) {
    case 32: return run<T, 32>(q, k, v, out, T_new, scale);
    case 64: return run<T, 64>(q, k, v, out, T_new, scale);
    case 128: return run<T, 128>(q, k, v, out, T_new, scale);
    case 256: return run<T, 256>(q, k, v, out, T_new, scale);
    default: TORCH_CHECK(false, "cached_attention: head_dim ", q.size(3), " not in {32, 64, 128, 256}");
  }
}

at::Tensor cached_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t num_new,
                            double scale) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "cached_attention: CPU only");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "cached_attention: q, k, v must be 4-D");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "cached_attention: q, k, v must share a dtype");
  TORCH_CHECK(k.sizes() == v.sizes(), "cached_attention: k and v differ in shape");
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(1) == k.size(1) && q.size(3) == k.size(3),
              "cached_attention: q (B, Hk, R, D) and k (B, Hk, S, D) disagree");
  TORCH_CHECK(num_new >= 1 && num_new <= k.size(2) && q.size(2) % num_new == 0,
              "cached_attention: num_new must be in [1, S] and divide the query rows");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1 && q.stride(2) == q.size(3),
              "cached_attention: rows must be contiguous (q rows packed, k/v last dim unit stride)");
  auto out = at::empty(q.sizes(), q.options());
  if (q.numel() == 0) return out;
  const float s = static_cast<float>(scale);
  if (q.scalar_type() == at::kFloat) {
    dispatch_dim<float>(q, k, v, out, num_new, s);
  } else if (q.scalar_type() == at::kBFloat16) {
    dispatch_dim<c10::BFloat16>(q, k, v, out, num_new, s);
  } else {
    TORCH_CHECK(false, "cached_attention: dtype ", q.scalar_type(), " not supported (float32, bfloat16)");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(kakeya, m) {
  m.def("cached_attention(Tensor q, Tensor k, Tensor v, int num_new, float scale) -> Tensor");
  m.def("bf16_dot() -> bool", [] { return kBf16Dot; });  // built with AVX512-BF16 dot products
}

TORCH_LIBRARY_IMPL(kakeya, CPU, m) { m.impl("cached_attention", &cached_attention); }
