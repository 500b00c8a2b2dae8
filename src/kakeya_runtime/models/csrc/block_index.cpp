// The indexer of the sparse KV policy: kakeya::block_select scores every cold block of a KV head against each
// query token and keeps the top-k, with one fixed order of operations per (token, block), so a token selects
// the same blocks in a decode step, a chunk or a prompt.
//
// q (B, Hk, R, D): the R = G * T query rows sharing K/V head h, ordered (group, token) as in cached_attention.
// head_topk (Hk,): blocks each KV head keeps (0: a streaming head, no cold tier; at least N: every block).
// kmin, kmax (B, Hc, N, D): per block and cold head (the heads with head_topk > 0, in order), the per-channel min
// and max of its keys (Quest's summary).
// A query row q's estimate of its largest logit in a block is sum_d max(q_d lo_d, q_d hi_d) over the block's box
// shrunk about its centre by BOX (lo, hi = mid -/+ half, mid = (kmin + kmax) / 2, half = BOX * (kmax - kmin) / 2;
// BOX = 1 is Quest's bound, which over-rates spread blocks at head_dim 256), computed as the equal
// q . mid + |q| . half: two dot products, 16 blocks to a vector. A token's share of a block is its estimated share
// of the attention, summed over the G query heads sharing the K/V head: sum_g softmax_j(scale * e_gj), each head's
// softmax over the blocks the token may select (so no one head's logit range decides for the others). Its score
// is the larger of that share from the shrunk box and from the whole box (Quest's bound, q . mid + |q| . half /
// BOX): a block whose one outlying key a head attends to sharply (a needle's digits) ranks low by the shrunk box.
// Token t (position p) may select among the blocks wholly outside its window, n(p) = max(0, p + 1 - window -
// sink) / block of them (blocks j cover positions sink + j * block ...); it keeps kept(topk, n(p), budget) =
// min(n(p), max(topk, ceil(budget * n(p)))) of them (0 for a streaming head), the highest scores first, ties
// to the lower block: the budget grows the selection with the history. With per-head counts (a fitted head
// profile) `budget_topk` is the policy's topk and a head's share is scaled by its topk / budget_topk. Missing summaries (N < n(p)) are an
// error, never a smaller choice. Returns select (B, Hk, T, words) int64 bitsets and scored (B, Hk, T) int64 =
// n(p) (0 for a streaming head: it scores nothing).

#include "common.h"

#include <atomic>
#include <cstring>
#include <memory>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int VS = Vec::size();

constexpr int64_t CHUNK = 64;  // blocks per scoring work item
constexpr int64_t TG = 64;     // tokens per scoring work item (a prompt's chunk spreads over the threads)
constexpr float BOX = 0.5f;  // the summary box's shrink about its centre (1: Quest's upper bound)
constexpr float HALF = 0.5f * BOX;  // half = HALF * (kmax - kmin)
constexpr int64_t LANES = 16;  // blocks per vector of terms

// Blocks a query keeps of the n it may select: a head's topk (0: streaming), grown to its share of the budget,
// ceil(budget * n) scaled by topk / ref for a head whose topk is not the policy's `ref` (per-head counts: the
// budget keeps their proportions as the history grows; ref 0 or topk == ref: ceil(budget * n), the same bits).
inline int64_t kept(int64_t topk, int64_t n, double budget, int64_t ref) {
  if (topk == 0) return 0;
  const double dn = static_cast<double>(n);
  const double want = ref > 0 && topk != ref ? budget * dn * static_cast<double>(topk) / static_cast<double>(ref)
                                             : budget * dn;
  const int64_t share = budget > 0 ? static_cast<int64_t>(std::ceil(want)) : 0;
  return std::min(n, std::max(topk, share));
}

// Widen D values of T to fp32 (exact).
template <typename T>
inline void widen(const T* src, float* dst, int64_t D) {
  at::vec::convert(src, dst, D);
}

// The terms of blocks [j0, j1) (row_stride apart in mn, mx; j0 a multiple of LANES) by groups of LANES blocks:
// group j / LANES holds mid (D, LANES) then half (D, LANES), block j in lane j % LANES; lanes past j1 in its last
// group are 0. Computed once per call and read by every token's estimates (the same bits as per token).
template <typename T>
__attribute__((flatten)) void block_terms(const T* mn, const T* mx, int64_t row_stride, int64_t D, int64_t j0,
                                          int64_t j1, float* terms) {
#if defined(__AVX512F__)
  if (D % 16 == 0) {  // 16 blocks x 16 dims at a time, transposed in registers (the same values as below)
    // 16 values of T widened to fp32 (exact): bf16 is the high half of the float
    const auto load16 = [](const T* src) {
      if constexpr (std::is_same_v<T, float>) {
        return _mm512_loadu_ps(src);
      } else {
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src))), 16));
      }
    };
    for (int64_t jg = j0; jg < j1; jg += LANES) {
      float* const mid = terms + jg / LANES * 2 * D * LANES;
      float* const half = mid + D * LANES;
      const int64_t nb = std::min<int64_t>(LANES, j1 - jg);
      for (int64_t d0 = 0; d0 < D; d0 += 16) {
        __m512 rm[16], rh[16];
        for (int64_t i = 0; i < 16; ++i) {
          if (i >= nb) {
            rm[i] = rh[i] = _mm512_setzero_ps();
            continue;
          }
          const __m512 a = load16(mn + (jg + i) * row_stride + d0), b = load16(mx + (jg + i) * row_stride + d0);
          rm[i] = _mm512_mul_ps(_mm512_set1_ps(0.5f), _mm512_add_ps(a, b));
          rh[i] = _mm512_mul_ps(_mm512_set1_ps(HALF), _mm512_sub_ps(b, a));
        }
        transpose16_regs(rm);
        transpose16_regs(rh);
        for (int c = 0; c < 16; ++c) {
          _mm512_storeu_ps(mid + (d0 + c) * LANES, rm[c]);
          _mm512_storeu_ps(half + (d0 + c) * LANES, rh[c]);
        }
      }
    }
    return;
  }
#elif defined(CPU_CAPABILITY_AVX2)
  if (D % 8 == 0) {  // 8 blocks x 8 dims at a time, transposed in registers (the same values as below)
    for (int64_t jg = j0; jg < j1; jg += LANES) {
      float* const mid = terms + jg / LANES * 2 * D * LANES;
      float* const half = mid + D * LANES;
      const int64_t nb = std::min<int64_t>(LANES, j1 - jg);
      for (int64_t d0 = 0; d0 < D; d0 += 8)
        for (int64_t i0 = 0; i0 < LANES; i0 += 8) {  // blocks jg + i0.. into lanes i0..i0 + 7
          __m256 rm[8], rh[8];
          for (int64_t i = 0; i < 8; ++i) {
            if (i0 + i >= nb) {
              rm[i] = rh[i] = _mm256_setzero_ps();
              continue;
            }
            const int64_t row = (jg + i0 + i) * row_stride + d0;
            const __m256 a = widen8(mn + row), b = widen8(mx + row);
            rm[i] = _mm256_mul_ps(_mm256_set1_ps(0.5f), _mm256_add_ps(a, b));
            rh[i] = _mm256_mul_ps(_mm256_set1_ps(HALF), _mm256_sub_ps(b, a));
          }
          transpose8(rm);
          transpose8(rh);
          for (int c = 0; c < 8; ++c) {
            _mm256_storeu_ps(mid + (d0 + c) * LANES + i0, rm[c]);
            _mm256_storeu_ps(half + (d0 + c) * LANES + i0, rh[c]);
          }
        }
    }
    return;
  }
#endif
  std::vector<float> a(D), b(D);
  const int64_t end = (j1 + LANES - 1) / LANES * LANES;
  for (int64_t j = j0; j < end; ++j) {
    float* mid = terms + j / LANES * 2 * D * LANES + j % LANES;
    float* half = mid + D * LANES;
    if (j >= j1) {  // padding lanes of the last group
      for (int64_t d = 0; d < D; ++d) mid[d * LANES] = half[d * LANES] = 0.f;
      continue;
    }
    widen(mn + j * row_stride, a.data(), D);
    widen(mx + j * row_stride, b.data(), D);
    for (int64_t d = 0; d < D; ++d) {
      mid[d * LANES] = 0.5f * (a[d] + b[d]);
      half[d * LANES] = HALF * (b[d] - a[d]);
    }
  }
}

#if defined(__AVX512F__)
// GN rows (qf, qa = |qf|, D apart) against one group of 16 blocks: per row and block, (sum_d q_d mid_d) + (sum_d
// |q_d| half_d) with the shrunk box, and with the whole box (Quest's bound: twice the half-width term, one fused
// multiply-add); each sum one fused multiply-add per d in order (so each row's bits are its own, whatever GN).
template <int GN>
inline void score_group(const float* qf, const float* qa, int64_t D, const float* mid, __m512* out, __m512* whole) {
  const float* half = mid + D * LANES;
  __m512 am[GN], ah[GN];
  for (int i = 0; i < GN; ++i) am[i] = ah[i] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    const __m512 m = _mm512_loadu_ps(mid + d * LANES), h = _mm512_loadu_ps(half + d * LANES);
    for (int i = 0; i < GN; ++i) {
      am[i] = _mm512_fmadd_ps(_mm512_set1_ps(qf[i * D + d]), m, am[i]);
      ah[i] = _mm512_fmadd_ps(_mm512_set1_ps(qa[i * D + d]), h, ah[i]);
    }
  }
  for (int i = 0; i < GN; ++i) {
    out[i] = _mm512_add_ps(am[i], ah[i]);
    whole[i] = _mm512_fmadd_ps(_mm512_set1_ps(1.f / BOX), ah[i], am[i]);
  }
}
#elif defined(CPU_CAPABILITY_AVX2)
// score_group's AVX2 form: GN rows against one group of 16 blocks as two halves of 8 lanes, the same chains.
template <int GN>
inline void score_group8(const float* qf, const float* qa, int64_t D, const float* mid, __m256 (*out)[2],
                         __m256 (*whole)[2]) {
  const float* half = mid + D * LANES;
  __m256 am[GN][2], ah[GN][2];
  for (int i = 0; i < GN; ++i) am[i][0] = am[i][1] = ah[i][0] = ah[i][1] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    const __m256 m0 = _mm256_loadu_ps(mid + d * LANES), m1 = _mm256_loadu_ps(mid + d * LANES + 8);
    const __m256 h0 = _mm256_loadu_ps(half + d * LANES), h1 = _mm256_loadu_ps(half + d * LANES + 8);
    for (int i = 0; i < GN; ++i) {
      const __m256 qv = _mm256_set1_ps(qf[i * D + d]), av = _mm256_set1_ps(qa[i * D + d]);
      am[i][0] = _mm256_fmadd_ps(qv, m0, am[i][0]);
      am[i][1] = _mm256_fmadd_ps(qv, m1, am[i][1]);
      ah[i][0] = _mm256_fmadd_ps(av, h0, ah[i][0]);
      ah[i][1] = _mm256_fmadd_ps(av, h1, ah[i][1]);
    }
  }
  for (int i = 0; i < GN; ++i)
    for (int h = 0; h < 2; ++h) {
      out[i][h] = _mm256_add_ps(am[i][h], ah[i][h]);
      whole[i][h] = _mm256_fmadd_ps(_mm256_set1_ps(1.f / BOX), ah[i][h], am[i][h]);
    }
}
#endif

// Estimates of blocks [j0, j1) (j0 a multiple of LANES) of one token against its G query rows (qf (G, D) fp32, qa
// = |qf|) into score[g * most + j] (the shrunk box) and bound[g * most + j] (the whole box) (NaN: -inf), from
// block_terms' groups. Every path computes each (row, block) as two in-order fused multiply-add chains, then one
// add (shrunk) and one fused multiply-add (whole), so the estimates are one set of bits on every machine.
inline void score_blocks(const float* qf, const float* qa, int64_t G, int64_t D, const float* terms, int64_t j0,
                         int64_t j1, float* score, float* bound, int64_t most) {
  constexpr float NINF = -std::numeric_limits<float>::infinity();
#if defined(__AVX512F__)
  for (int64_t jb = j0; jb < j1; jb += LANES) {
    const int64_t nb = std::min<int64_t>(LANES, j1 - jb);
    const float* mid = terms + jb / LANES * 2 * D * LANES;
    for (int64_t g0 = 0; g0 < G; g0 += 4) {
      const int64_t gn = std::min<int64_t>(4, G - g0);
      __m512 sv[4], bv[4];
      const float* q0 = qf + g0 * D;
      const float* a0 = qa + g0 * D;
      if (gn == 4) score_group<4>(q0, a0, D, mid, sv, bv);
      else if (gn == 3) score_group<3>(q0, a0, D, mid, sv, bv);
      else if (gn == 2) score_group<2>(q0, a0, D, mid, sv, bv);
      else score_group<1>(q0, a0, D, mid, sv, bv);
      for (int64_t i = 0; i < gn; ++i) {
        for (auto [x, dst] : {std::pair{sv[i], score}, std::pair{bv[i], bound}}) {
          const __m512 v = _mm512_mask_mov_ps(x, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_ps(NINF));
          alignas(64) float sg[LANES];
          _mm512_store_ps(sg, v);
          std::copy(sg, sg + nb, dst + (g0 + i) * most + jb);
        }
      }
    }
  }
#elif defined(CPU_CAPABILITY_AVX2)
  for (int64_t jb = j0; jb < j1; jb += LANES) {
    const int64_t nb = std::min<int64_t>(LANES, j1 - jb);
    const float* mid = terms + jb / LANES * 2 * D * LANES;
    for (int64_t g0 = 0; g0 < G; g0 += 2) {
      const int64_t gn = std::min<int64_t>(2, G - g0);
      __m256 sv[2][2], bv[2][2];
      if (gn == 2) score_group8<2>(qf + g0 * D, qa + g0 * D, D, mid, sv, bv);
      else score_group8<1>(qf + g0 * D, qa + g0 * D, D, mid, sv, bv);
      for (int64_t i = 0; i < gn; ++i)
        for (auto [x, dst] : {std::pair{sv[i], score}, std::pair{bv[i], bound}}) {
          alignas(32) float sg[LANES];
          for (int h = 0; h < 2; ++h)  // NaN -> -inf, as the other paths
            _mm256_store_ps(sg + 8 * h,
                            _mm256_blendv_ps(x[h], _mm256_set1_ps(NINF), _mm256_cmp_ps(x[h], x[h], _CMP_UNORD_Q)));
          std::copy(sg, sg + nb, dst + (g0 + i) * most + jb);
        }
    }
  }
#else
  for (int64_t j = j0; j < j1; ++j) {
    const float* mid = terms + j / LANES * 2 * D * LANES + j % LANES;
    const float* half = mid + D * LANES;
    for (int64_t g = 0; g < G; ++g) {
      float am = 0.f, ah = 0.f;
      for (int64_t d = 0; d < D; ++d) {
        am = std::fma(qf[g * D + d], mid[d * LANES], am);
        ah = std::fma(qa[g * D + d], half[d * LANES], ah);
      }
      const float sc = am + ah, bd = std::fma(1.f / BOX, ah, am);
      score[g * most + j] = std::isnan(sc) ? NINF : sc;
      bound[g * most + j] = std::isnan(bd) ? NINF : bd;
    }
  }
#endif
}

// The k of n blocks with the highest scores, ties to the lower block, as bits of `row`: the k-th highest score is
// found bit by bit on an order-preserving integer map of the scores (32 counting passes, no data-dependent
// branches), then every block above it is kept and the lowest blocks equal to it fill the rest. The same set as
// sorting by (score descending, block ascending), in a time that does not depend on the scores.
inline void keep_top(const float* score, int64_t n, int64_t k, std::vector<uint32_t>& u, uint64_t* row) {
  u.resize(n);
  for (int64_t j = 0; j < n; ++j) {
    uint32_t x;
    std::memcpy(&x, score + j, sizeof(x));
    u[j] = (x >> 31) != 0u ? ~x : (x | 0x80000000u);
  }
  const uint32_t* up = u.data();
  uint32_t t = 0;
  for (int bit = 31; bit >= 0; --bit) {
    const uint32_t cand = t | (1u << bit);
    int64_t count = 0;
    for (int64_t j = 0; j < n; ++j) count += up[j] >= cand;
    if (count >= k) t = cand;
  }
  int64_t above = 0;
  for (int64_t j = 0; j < n; ++j) above += up[j] > t;
  int64_t ties = k - above;  // >= 1: t is the k-th highest
  for (int64_t j = 0; j < n; ++j)
    if (up[j] > t || (up[j] == t && ties-- > 0)) row[j >> 6] |= 1ull << (j & 63);
}

// The cold blocks a query at position p may select: those wholly outside its window (none for a streaming head).
inline int64_t selectable_blocks(int64_t topk, int64_t p, int64_t window, int64_t sink, int64_t block) {
  return topk == 0 ? 0 : std::max<int64_t>(0, p + 1 - window - sink) / block;
}

template <typename T>
void run(const at::Tensor& q, const at::Tensor& kmin, const at::Tensor& kmax, const at::Tensor& q_pos,
         int64_t window, int64_t sink, int64_t block, const std::vector<int64_t>& head_topk,
         const std::vector<int64_t>& cold_head, double scale, double budget, int64_t ref, at::Tensor& select,
         at::Tensor& scored) {
  const int64_t B = q.size(0), H = q.size(1), R = q.size(2), D = q.size(3), NT = q_pos.size(0);
  const int64_t G = R / NT, words = select.size(3);
  const int64_t* qp = q_pos.const_data_ptr<int64_t>();
  const T* qd = q.const_data_ptr<T>();
  const T* mn = kmin.const_data_ptr<T>();
  const T* mx = kmax.const_data_ptr<T>();
  auto* sel = reinterpret_cast<uint64_t*>(select.data_ptr<int64_t>());
  int64_t* nsc = scored.data_ptr<int64_t>();
  // Per (batch, head, token): blocks it may select (n), and whether it must score them (n > kept).
  const int64_t items = B * H * NT;
  int64_t most = 0;
  for (int64_t item = 0; item < items; ++item) {
    const int64_t topk = head_topk[(item / NT) % H];
    const int64_t n = nsc[item] = selectable_blocks(topk, qp[item % NT], window, sink, block);
    if (n > kept(topk, n, budget, ref)) most = std::max(most, n);
  }
  // Estimating: work items of CHUNK blocks of one (batch, head) for up to TG of its tokens. Only the (batch,
  // head)s that score anything.
  const int64_t chunks = (most + CHUNK - 1) / CHUNK, tgroups = (NT + TG - 1) / TG;
  // the call's buffers, kept by the calling thread (no heap call per step; the items read them through these)
  thread_local std::vector<char> kept_any;
  thread_local std::vector<std::atomic<int64_t>> kept_done;
  std::vector<char>& scores_any = kept_any;
  scores_any.assign(B * H, 0);
  for (int64_t item = 0; item < items; ++item) {
    const int64_t n = nsc[item];
    if (n > kept(head_topk[(item / NT) % H], n, budget, ref)) scores_any[item / NT] = 1;
  }
  // (2, items, G, most): the shrunk box's estimates, then the whole box's; every read entry is written
  // (slot 4 of the per-thread scratch when small: no heap call per decode step)
  const int64_t per_est = std::max<int64_t>(1, items * G * most);
  const bool small_est = 2 * per_est * sizeof(float) <= kScratchBytes;
  std::unique_ptr<float[]> scores_heap(small_est ? nullptr : new float[2 * per_est]);
  float* const scores = small_est ? scratch<float>(4, 2 * per_est) : scores_heap.get();

  // Work item (bh, c, tg): the terms of chunk c of (batch, head) bh (the same values for every item that computes
  // them, kept in L1 by the thread), then the estimates of group tg's tokens against them.
  const auto estimate = [&](int64_t bh, int64_t c, int64_t tg) {
    thread_local std::vector<float> qf, qa, terms;  // kept across calls: no heap call per step
    if (!scores_any[bh]) return;
    const int64_t b = bh / H, h = bh % H, j0 = c * CHUNK;
    bool have_terms = false;
    for (int64_t t = tg * TG; t < std::min(NT, (tg + 1) * TG); ++t) {
      const int64_t item = bh * NT + t, n = nsc[item];
      if (n <= kept(head_topk[h], n, budget, ref) || j0 >= n) continue;
      if (!have_terms) {
        const int64_t off = b * kmin.stride(0) + cold_head[h] * kmin.stride(1) + j0 * kmin.stride(2);
        terms.resize(CHUNK / LANES * 2 * D * LANES);
        block_terms<T>(mn + off, mx + off, kmin.stride(2), D, 0, std::min<int64_t>(most, j0 + CHUNK) - j0,
                       terms.data());
        qf.resize(G * D);
        qa.resize(G * D);
        have_terms = true;
      }
      for (int64_t g = 0; g < G; ++g)
        widen(qd + b * q.stride(0) + h * q.stride(1) + (g * NT + t) * q.stride(2), qf.data() + g * D, D);
      for (int64_t i = 0; i < G * D; ++i) qa[i] = std::fabs(qf[i]);
      score_blocks(qf.data(), qa.data(), G, D, terms.data(), 0, std::min<int64_t>(n, j0 + CHUNK) - j0,
                   scores + item * G * most + j0, scores + per_est + item * G * most + j0, most);
    }
  };
  // Work item `item` (batch, head, token): its kept blocks from the estimates of every chunk.
  const auto choose = [&](int64_t item) {
    thread_local std::vector<uint32_t> keys;  // kept across calls: no heap call per step
    thread_local std::vector<float> share, whole, w, ev;
    const int64_t n = nsc[item], topk = kept(head_topk[(item / NT) % H], n, budget, ref);
    uint64_t* row = sel + item * words;
    std::fill(row, row + words, 0ull);
    if (n == 0) return;
    if (n <= topk) {  // every block: no scores needed
      for (int64_t j = 0; j < n; ++j) row[j >> 6] |= 1ull << (j & 63);
      return;
    }
    // The token's score per block: its estimated attention share summed over the G rows, one fixed order, from
    // the shrunk box and from the whole box; a block keeps the larger of its two shares. The shrunk box ranks
    // blocks whose keys spread as the query's attention does; the whole box (an upper bound) keeps a block with
    // one outlying key that a query attends to sharply (a needle), which the shrunk box ranks low.
    const int64_t padded = (n + VS - 1) / VS * VS;
    w.resize(padded);
    ev.resize(padded);
    // Per row: exponentials VS blocks at a time (lanes past n: -inf, so 0), their sum by VS lane sums in block
    // order and one fixed lane tree; the order depends on n alone.
    const auto shares = [&](const float* est, std::vector<float>& out) {
      out.assign(padded, 0.f);
      for (int64_t g = 0; g < G; ++g) {
        std::copy(est + g * most, est + g * most + n, ev.begin());
        std::fill(ev.begin() + n, ev.end(), -std::numeric_limits<float>::infinity());
        Vec vtop(-std::numeric_limits<float>::infinity());
        for (int64_t j = 0; j < padded; j += VS) vtop = at::vec::maximum(vtop, Vec::loadu(ev.data() + j));
        const float top = at::vec::vec_reduce_all<float>([](Vec& a, Vec& c) { return at::vec::maximum(a, c); },
                                                         vtop);  // max is exact in any order
        if (!std::isfinite(top)) continue;  // every estimate NaN (-inf) or inf: the row adds nothing
        const Vec sc(static_cast<float>(scale)), tv(top);
        Vec zv(0.f);
        for (int64_t j = 0; j < padded; j += VS) {
          const Vec x = (sc * (Vec::loadu(ev.data() + j) - tv)).exp();
          x.store(w.data() + j);
          zv = zv + x;
        }
        const float z = at::vec::vec_reduce_all<float>([](Vec& a, Vec& c) { return a + c; }, zv);
        const Vec inv(1.f / z);
        for (int64_t j = 0; j < padded; j += VS)
          (Vec::loadu(out.data() + j) + Vec::loadu(w.data() + j) * inv).store(out.data() + j);
      }
    };
    shares(scores + item * G * most, share);
    shares(scores + per_est + item * G * most, whole);
    for (int64_t j = 0; j < padded; j += VS)
      at::vec::maximum(Vec::loadu(share.data() + j), Vec::loadu(whole.data() + j)).store(share.data() + j);
    keep_top(share.data(), n, topk, keys, row);
  };
  // The estimating items, then the choosing ones, from one queue in one parallel region: a token's choice waits
  // for its (batch, head)'s chunks (every one already taken by a running thread, so the wait ends), with no
  // barrier between the stages and the threads sharing both (a decode step's 3 heads on 2 threads). Only a call
  // with a few dozen blocks runs on its own thread: inside a decode loop a long history's summaries come from
  // the last-level cache, and two threads read them faster than one. Each item's work is the same whichever
  // thread does it, so the bits are the same.
  const int64_t per_head = chunks * tgroups, n_est = B * H * per_head, n_items = n_est + items;
  const auto estimate_item = [&](int64_t i) { estimate(i / per_head, i / tgroups % chunks, i % tgroups); };
  if (items * most * G * D < (1 << 15) || at::get_num_threads() == 1) {
    for (int64_t i = 0; i < n_est; ++i) estimate_item(i);
    for (int64_t item = 0; item < items; ++item) choose(item);
    return;
  }
  if (static_cast<int64_t>(kept_done.size()) < B * H) kept_done = std::vector<std::atomic<int64_t>>(B * H);
  std::atomic<int64_t>* const done = kept_done.data();
  for (int64_t bh = 0; bh < B * H; ++bh) done[bh].store(0, std::memory_order_relaxed);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(n_items, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    for (int64_t i = next.fetch_add(1); i < n_items; i = next.fetch_add(1)) {
      if (i < n_est) {
        // counted even if the item throws, so no thread waits for it forever (parallel_for rethrows the error)
        struct Count {
          std::atomic<int64_t>& n;
          ~Count() { n.fetch_add(1, std::memory_order_release); }
        } count{done[i / per_head]};
        estimate_item(i);
        continue;
      }
      const int64_t item = i - n_est;
      while (done[item / NT].load(std::memory_order_acquire) < per_head) {
#if defined(__x86_64__)
        _mm_pause();
#endif
      }
      choose(item);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> block_select(const at::Tensor& q, const at::Tensor& kmin, const at::Tensor& kmax,
                                                const at::Tensor& q_pos, int64_t window, int64_t sink, int64_t block,
                                                const at::Tensor& head_topk, double scale, double budget,
                                                int64_t budget_topk) {
  TORCH_CHECK(q.device().is_cpu() && kmin.device().is_cpu() && kmax.device().is_cpu(), "block_select: CPU only");
  TORCH_CHECK(q.dim() == 4 && kmin.dim() == 4 && kmin.sizes() == kmax.sizes(),
              "block_select: q (B, Hk, R, D), kmin and kmax (B, Hk, N, D)");
  TORCH_CHECK(q.scalar_type() == kmin.scalar_type() && q.scalar_type() == kmax.scalar_type(),
              "block_select: q and the summaries must share a dtype");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "block_select: float32 or bfloat16");
  TORCH_CHECK(head_topk.dim() == 1 && head_topk.scalar_type() == at::kLong && head_topk.size(0) == q.size(1) &&
                  head_topk.is_contiguous(),
              "block_select: head_topk must be contiguous int64 (Hk,)");
  const int64_t* tk = head_topk.const_data_ptr<int64_t>();
  thread_local std::vector<int64_t> topks, cold_head;  // kept: no heap call per step
  topks.assign(tk, tk + q.size(1));
  cold_head.clear();
  int64_t hc = 0;
  for (const int64_t k : topks) {
    TORCH_CHECK(k >= 0, "block_select: head_topk must be >= 0");
    cold_head.push_back(k > 0 ? hc++ : -1);
  }
  TORCH_CHECK(kmin.size(0) == q.size(0) && kmin.size(1) == hc && kmin.size(3) == q.size(3),
              "block_select: the summaries (B, Hc, N, D) disagree with q in batch or head_dim, or hold ",
              kmin.size(1), " heads for ", hc, " cold heads");
  TORCH_CHECK(q.size(3) % VS == 0, "block_select: head_dim must be a multiple of ", VS);
  TORCH_CHECK(q.stride(3) == 1 && kmin.stride(3) == 1 && kmax.stride(3) == 1 && kmin.strides() == kmax.strides(),
              "block_select: the last dims must have unit stride, kmin and kmax the same layout");
  TORCH_CHECK(q_pos.dim() == 1 && q_pos.scalar_type() == at::kLong && q_pos.is_contiguous() && q_pos.size(0) >= 1 &&
                  q.size(2) % q_pos.size(0) == 0,
              "block_select: q_pos (T,) contiguous int64, the query rows a multiple of T");
  TORCH_CHECK(window >= 1 && sink >= 0 && block >= 1, "block_select: need window, block >= 1");
  TORCH_CHECK(budget >= 0 && budget <= 1, "block_select: budget must be in [0, 1], got ", budget);
  TORCH_CHECK(budget_topk >= 0, "block_select: budget_topk must be >= 0, got ", budget_topk);
  if (scale <= 0) scale = 1.0 / std::sqrt(static_cast<double>(q.size(3)));  // 0: the usual 1 / sqrt(head_dim)
  const int64_t* qp = q_pos.const_data_ptr<int64_t>();
  int64_t most = 0;
  for (int64_t t = 0; t < q_pos.size(0); ++t) most = std::max(most, (qp[t] + 1 - window - sink) / block);
  TORCH_CHECK(hc == 0 || most <= kmin.size(2), "block_select: a query may select among ", most,
              " cold blocks but only ", kmin.size(2), " have summaries");
  const int64_t words = std::max<int64_t>(1, (most + 63) / 64);
  // inside a stack step, the outputs its call site kept (common.h's reusable_empty)
  thread_local Reusable select_site, scored_site;
  auto select = reusable_empty(select_site, {q.size(0), q.size(1), q_pos.size(0), words}, q.options().dtype(at::kLong));
  auto scored = reusable_empty(scored_site, {q.size(0), q.size(1), q_pos.size(0)}, q.options().dtype(at::kLong));
  if (q.scalar_type() == at::kFloat) {
    run<float>(q, kmin, kmax, q_pos, window, sink, block, topks, cold_head, scale, budget, budget_topk, select,
               scored);
  } else {
    run<c10::BFloat16>(q, kmin, kmax, q_pos, window, sink, block, topks, cold_head, scale, budget, budget_topk,
                       select, scored);
  }
  return {select, scored};
}

// The sparse step's tripwire, on the counts the attention kernel kept in its own loops (kakeya::sparse_attention's
// `seen` (B, Hk, R, 2): hot, cold): every query row saw exactly its sinks and hot range, and kept(topk, scored,
// budget) whole cold blocks (what block_select keeps). Raises otherwise. Then adds the step to `counters`, int64 (8,): [0] steps, [1] query tokens
// x KV heads, [2] blocks scored, [3] blocks selected, [4] keys attended, [5] keys causally visible (first query
// head of each group, summed); [6], [7] are set (not summed) to the keys the newest token attended and the keys
// it could see, summed over batch and KV heads (the layer's attended share: [6] / [7]).
void sparse_check(const at::Tensor& seen, const at::Tensor& scored, const at::Tensor& q_pos, int64_t window,
                  int64_t sink, int64_t block, const at::Tensor& head_topk, const at::Tensor& counters,
                  double budget, int64_t budget_topk) {
  TORCH_CHECK(seen.dim() == 4 && seen.size(3) == 2 && seen.scalar_type() == at::kLong && seen.is_contiguous(),
              "sparse_check: seen (B, Hk, R, 2) contiguous int64");
  TORCH_CHECK(q_pos.dim() == 1 && q_pos.scalar_type() == at::kLong && q_pos.is_contiguous() && q_pos.size(0) >= 1 &&
                  seen.size(2) % q_pos.size(0) == 0,
              "sparse_check: q_pos (T,) contiguous int64, the rows a multiple of T");
  TORCH_CHECK(scored.dim() == 3 && scored.scalar_type() == at::kLong && scored.is_contiguous() &&
                  scored.size(0) == seen.size(0) && scored.size(1) == seen.size(1) && scored.size(2) == q_pos.size(0),
              "sparse_check: scored (B, Hk, T) contiguous int64");
  TORCH_CHECK(window >= 1 && sink >= 0 && block >= 1, "sparse_check: need window, block >= 1");
  TORCH_CHECK(head_topk.dim() == 1 && head_topk.scalar_type() == at::kLong && head_topk.size(0) == seen.size(1) &&
                  head_topk.is_contiguous(),
              "sparse_check: head_topk must be contiguous int64 (Hk,)");
  TORCH_CHECK(counters.dim() == 1 && counters.size(0) == 8 && counters.scalar_type() == at::kLong &&
                  counters.is_contiguous() && counters.device().is_cpu(),
              "sparse_check: counters must be contiguous int64 (8,)");
  const int64_t* tks = head_topk.const_data_ptr<int64_t>();
  const int64_t B = seen.size(0), H = seen.size(1), R = seen.size(2), T = q_pos.size(0), G = R / T;
  const int64_t* sn = seen.const_data_ptr<int64_t>();
  const int64_t* sc = scored.const_data_ptr<int64_t>();
  const int64_t* qp = q_pos.const_data_ptr<int64_t>();
  int64_t scored_sum = 0, selected = 0, attended = 0, visible = 0, newest = 0;
  for (int64_t bh = 0; bh < B * H; ++bh)
    for (int64_t t = 0; t < T; ++t) {
      const int64_t p = qp[t], out = p + 1 - window - sink;
      const int64_t lo = out <= 0 ? sink : sink + out / block * block;  // the hot range's first position
      const int64_t want_hot = std::min(p + 1, sink) + std::max<int64_t>(0, p + 1 - lo);
      const int64_t topk = tks[bh % H], n = sc[bh * T + t];
      const int64_t want_cold = kept(topk, n, budget, budget_topk) * block;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t* row = sn + ((bh * R) + g * T + t) * 2;
        TORCH_CHECK(row[0] == want_hot, "the query at position ", p, " saw ", row[0],
                    " keys of its sinks and hot range, not ", want_hot);
        TORCH_CHECK(row[1] == want_cold, "the indexer's blocks were not attended: the query at position ", p, " saw ",
                    row[1], " cold keys, not ", want_cold, " (", want_cold / block, " of ", n, " blocks of ", block,
                    ": top-", topk, ", budget ", budget, " of top-", budget_topk, ")");
      }
      scored_sum += n;
      selected += want_cold / block;
      attended += want_hot + want_cold;
      visible += p + 1;
      if (t == T - 1) newest += want_hot + want_cold;
    }
  int64_t* o = counters.data_ptr<int64_t>();
  o[0] += 1, o[1] += B * H * T, o[2] += scored_sum, o[3] += selected, o[4] += attended, o[5] += visible;
  o[6] = newest, o[7] = B * H * (qp[T - 1] + 1);
}

}  // namespace

// The fused steps are the ops themselves and what decoder_layer.cpp calls (common.h).
namespace kakeya_ops {

// One sparse step for a cold tier the attention reads as stored (bf16 or int8 codes): the indexer over the first
// n_blocks summaries, the attention over the hot set and the selected blocks, and the tripwire with its counters,
// in one call (no Python between them). Returns the output and the selection bitsets.
std::tuple<at::Tensor, at::Tensor> sparse_step(
    const at::Tensor& q, const at::Tensor& hot_k, const at::Tensor& hot_v, const at::Tensor& hot_pos,
    const at::Tensor& cold_k, const at::Tensor& cold_v, const std::optional<at::Tensor>& cold_k_scale,
    const std::optional<at::Tensor>& cold_v_scale, const at::Tensor& cold_slot, const at::Tensor& cold_head,
    const at::Tensor& kmin, const at::Tensor& kmax, int64_t n_blocks, const at::Tensor& head_topk,
    const at::Tensor& q_pos, int64_t window, int64_t sink, int64_t block, double scale, const at::Tensor& counters,
    double budget, int64_t budget_topk) {
  TORCH_CHECK(kmin.dim() == 4 && n_blocks >= 0 && n_blocks <= kmin.size(2), "sparse_step: ", n_blocks,
              " blocks, summaries (B, Hc, N, D) for ", kmin.dim() == 4 ? kmin.size(2) : -1);
  auto [select, scored] = block_select(q, kmin.narrow(2, 0, n_blocks), kmax.narrow(2, 0, n_blocks), q_pos, window,
                                       sink, block, head_topk, scale, budget, budget_topk);
  auto [out, seen] = kakeya_ops::sparse_attention(q, hot_k, hot_v, hot_pos, cold_k, cold_v, cold_k_scale,
                                                  cold_v_scale, cold_slot, cold_head, select, q_pos, window, sink,
                                                  block, scale);
  sparse_check(seen, scored, q_pos, window, sink, block, head_topk, counters, budget, budget_topk);
  return {out, select};
}

}  // namespace kakeya_ops

namespace {

// The decoded-block cache of a lattice (D4) cold tier: per cold head, `slots` decoded blocks (dec_k, dec_v (B, Hc,
// slots * block, D)), block_slot (Hc, >= N) block -> slot (-1: not held), slot_block (Hc, slots) slot -> block (-1:
// free), slot_used (Hc, slots) the step a slot was last read. Marks the blocks the step selected (select's union over
// batch rows and tokens, per cold head) as read at `step` and decodes the (head, block) pairs not held into that
// head's least recently read slots (ties: the lower slot; never one read this step), updating the maps. The decode is
// kakeya::d4_points, kakeya::linear with the Hadamard `rot` (D, D) fp32, times the norm, rounded once to the cache's
// dtype: kv/lattice.py's arithmetic, so a block reads the bits a fresh decode gives. Returns (hits, misses); misses
// -1 when some head selected more blocks than it has slots (then nothing was changed).
template <typename O>
void store_decoded(const at::Tensor& y, const at::Half* sc, const at::Tensor& dec, const std::vector<int64_t>& dst_off,
                   int64_t block, int64_t D) {
  const float* yp = y.const_data_ptr<float>();
  O* out = dec.data_ptr<O>();
  const int64_t rows = y.size(0);
  // Vectors of 16 (the same fp32 product per element, rounded by at::vec::convert to nearest even as the scalar cast
  // rounds); a decode step's few blocks on one thread (two split ~300 rows slower than one runs them).
  at::parallel_for(0, rows, 2048, [&](int64_t lo, int64_t hi) {
    thread_local std::vector<float> row;  // this thread's, kept
    row.resize(D);
    const int64_t vd = D / VS * VS;
    for (int64_t r = lo; r < hi; ++r) {
      const float norm = static_cast<float>(sc[2 * r]);
      const float* src = yp + r * D;
      const Vec nv(norm);
      for (int64_t d = 0; d < vd; d += VS) (Vec::loadu(src + d) * nv).store(row.data() + d);
      for (int64_t d = vd; d < D; ++d) row[d] = src[d] * norm;
      convert_row(row.data(), out + dst_off[r / block] + (r % block) * D, D);
    }
  });
}

std::pair<int64_t, int64_t> decoded_fill(const at::Tensor& select, const at::Tensor& cold_head, int64_t n_blocks,
                                         const at::Tensor& block_slot, const at::Tensor& slot_block,
                                         const at::Tensor& slot_used, int64_t step, const at::Tensor& k_code,
                                         const at::Tensor& k_scale, const at::Tensor& v_code,
                                         const at::Tensor& v_scale, const at::Tensor& rot, const at::Tensor& dec_k,
                                         const at::Tensor& dec_v, int64_t q, int64_t bits, int64_t codes) {
  const int64_t B = select.size(0), H = select.size(1), T = select.size(2), W = select.size(3);
  const int64_t Hc = slot_block.size(0), C = slot_block.size(1);
  TORCH_CHECK(block_slot.dim() == 2 && block_slot.size(0) == Hc && block_slot.size(1) >= n_blocks &&
                  block_slot.is_contiguous() && slot_block.is_contiguous() && slot_used.is_contiguous() &&
                  slot_used.sizes() == slot_block.sizes() && block_slot.scalar_type() == at::kLong &&
                  slot_block.scalar_type() == at::kLong && slot_used.scalar_type() == at::kLong,
              "decoded cache: block_slot (Hc, >= N), slot_block and slot_used (Hc, slots), contiguous int64");
  TORCH_CHECK(cold_head.dim() == 1 && cold_head.size(0) == H && cold_head.scalar_type() == at::kLong &&
                  cold_head.is_contiguous(),
              "decoded cache: cold_head (Hk,) contiguous int64");
  TORCH_CHECK(k_code.dim() == 5 && k_code.sizes() == v_code.sizes() && k_code.is_contiguous() &&
                  v_code.is_contiguous() && k_code.scalar_type() == at::kByte && v_code.scalar_type() == at::kByte &&
                  k_code.size(0) == B && k_code.size(1) == Hc && k_code.size(2) >= n_blocks,
              "decoded cache: codes (B, Hc, >= N, block, nbytes) contiguous uint8");
  const int64_t blk = k_code.size(3), nbytes = k_code.size(4);
  TORCH_CHECK(k_scale.dim() == 5 && k_scale.sizes() == v_scale.sizes() && k_scale.is_contiguous() &&
                  v_scale.is_contiguous() && k_scale.scalar_type() == at::kHalf && v_scale.scalar_type() == at::kHalf &&
                  k_scale.size(0) == B && k_scale.size(1) == Hc && k_scale.size(2) == k_code.size(2) &&
                  k_scale.size(3) == blk && k_scale.size(4) == 2,
              "decoded cache: scales (B, Hc, N, block, 2) contiguous fp16");
  TORCH_CHECK(dec_k.dim() == 4 && dec_k.sizes() == dec_v.sizes() && dec_k.is_contiguous() && dec_v.is_contiguous() &&
                  dec_k.scalar_type() == dec_v.scalar_type() && dec_k.size(0) == B && dec_k.size(1) == Hc &&
                  dec_k.size(2) == C * blk &&
                  (dec_k.scalar_type() == at::kFloat || dec_k.scalar_type() == at::kBFloat16),
              "decoded cache: dec_k, dec_v (B, Hc, slots * block, D) contiguous fp32 or bf16");
  const int64_t D = dec_k.size(3);
  TORCH_CHECK(rot.dim() == 2 && rot.size(0) == D && rot.size(1) == D && rot.scalar_type() == at::kFloat &&
                  rot.is_contiguous() && codes * 4 == D,
              "decoded cache: rot (D, D) contiguous fp32, 4 * codes == D");
  const auto* sel = reinterpret_cast<const uint64_t*>(select.const_data_ptr<int64_t>());
  const int64_t* ch = cold_head.const_data_ptr<int64_t>();
  int64_t* bs = block_slot.data_ptr<int64_t>();
  int64_t* sb = slot_block.data_ptr<int64_t>();
  int64_t* su = slot_used.data_ptr<int64_t>();
  const int64_t bsr = block_slot.size(1), nw = std::min(W, (n_blocks + 63) / 64);
  // the call's buffers, kept by the calling thread (no heap call per step)
  thread_local std::vector<std::vector<int64_t>> chosen;
  thread_local std::vector<uint64_t> words;
  thread_local std::vector<int64_t> mh, mj, ms, order, dst;  // the misses: cold head, block, slot; slot order
  if (static_cast<int64_t>(chosen.size()) < Hc) chosen.resize(Hc);
  for (int64_t c = 0; c < Hc; ++c) chosen[c].clear();
  words.resize(nw);
  for (int64_t h = 0; h < H; ++h) {
    const int64_t c = ch[h];
    if (c < 0) continue;
    TORCH_CHECK(c < Hc, "decoded cache: cold head ", c, " of ", Hc);
    std::fill(words.begin(), words.end(), 0ull);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < T; ++t)
        for (int64_t w = 0; w < nw; ++w) words[w] |= sel[((b * H + h) * T + t) * W + w];
    for (int64_t w = 0; w < nw; ++w)
      for (uint64_t x = words[w]; x; x &= x - 1) {
        const int64_t j = w * 64 + __builtin_ctzll(x);
        if (j < n_blocks) chosen[c].push_back(j);
      }
    if (static_cast<int64_t>(chosen[c].size()) > C) return {0, -1};
  }
  int64_t hits = 0;
  mh.clear(), mj.clear(), ms.clear();
  order.resize(C);
  for (int64_t c = 0; c < Hc; ++c) {
    const size_t first = mj.size();
    for (const int64_t j : chosen[c]) {
      const int64_t s = bs[c * bsr + j];
      if (s >= 0) {
        su[c * C + s] = step, ++hits;
      } else {
        mh.push_back(c), mj.push_back(j);
      }
    }
    const int64_t n = static_cast<int64_t>(mj.size() - first);
    if (n == 0) continue;
    std::iota(order.begin(), order.end(), 0);
    const int64_t* used = su + c * C;
    std::partial_sort(order.begin(), order.begin() + n, order.end(), [&](int64_t a, int64_t b) {
      return used[a] < used[b] || (used[a] == used[b] && a < b);
    });
    for (int64_t i = 0; i < n; ++i) {
      const int64_t s = order[i], j = mj[first + i], old = sb[c * C + s];
      TORCH_CHECK(used[s] != step, "decoded cache: no free slot for a miss (a slot read this step)");
      if (old >= 0) bs[c * bsr + old] = -1;
      sb[c * C + s] = j, bs[c * bsr + j] = s, su[c * C + s] = step;
      ms.push_back(s);
    }
  }
  const int64_t m = static_cast<int64_t>(mj.size());
  if (m == 0) return {hits, 0};
  // The misses' codes, K then V, gathered (2, B, m, block) -> rows, decoded in one d4_points and one linear call
  // (each row's bits do not depend on the rows beside it), and written into their slots.
  const int64_t rows = B * m * blk;
  dst.resize(B * m);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < m; ++i) dst[b * m + i] = ((b * Hc + mh[i]) * C + ms[i]) * blk * D;
  // the misses' buffers, kept by the calling thread at their largest (the misses' count changes every step: a heap
  // call for each of four buffers per layer otherwise, ~1.5% of a d4 decode step's CPU time in malloc); made in the
  // caller's inference mode
  thread_local at::Tensor code_buf, scale_buf, points_buf, rotated_buf;
  const auto kept = [](at::Tensor& buf, int64_t n, int64_t width, const at::TensorOptions& options) {
    if (!buf.defined() || buf.size(0) < n || buf.size(1) != width || buf.scalar_type() != options.dtype() ||
        buf.is_inference() != c10::InferenceMode::is_enabled())
      buf = at::empty({std::max<int64_t>(n, buf.defined() ? 2 * buf.size(0) : n), width}, options);
    return buf.narrow(0, 0, n);
  };
  auto code = kept(code_buf, 2 * rows, nbytes, k_code.options());
  auto scale = kept(scale_buf, 2 * rows, 2, k_scale.options());
  uint8_t* co = code.data_ptr<uint8_t>();
  at::Half* so = scale.data_ptr<at::Half>();
  for (int side = 0; side < 2; ++side) {
    const at::Tensor& cs = side ? v_code : k_code;
    const uint8_t* cp = cs.const_data_ptr<uint8_t>();
    const at::Half* sp = (side ? v_scale : k_scale).const_data_ptr<at::Half>();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < m; ++i) {
        const int64_t src = (b * Hc + mh[i]) * cs.size(2) + mj[i], r = side * rows + (b * m + i) * blk;
        std::memcpy(co + r * nbytes, cp + src * blk * nbytes, blk * nbytes);
        std::memcpy(so + r * 2, sp + src * blk * 2, blk * 2 * sizeof(at::Half));
      }
  }
  auto points = kept(points_buf, 2 * rows, D, k_code.options().dtype(at::kFloat));
  kakeya_ops::d4_points_into(code, scale, q, bits, codes, points);
  auto y = kept(rotated_buf, 2 * rows, D, points.options());
  kakeya_ops::linear_into(points, rot, std::nullopt, y);
  for (int side = 0; side < 2; ++side) {
    const at::Tensor& dec = side ? dec_v : dec_k;
    const auto ys = y.narrow(0, side * rows, rows);
    if (dec.scalar_type() == at::kFloat) {
      store_decoded<float>(ys, so + side * rows * 2, dec, dst, blk, D);
    } else {
      store_decoded<c10::BFloat16>(ys, so + side * rows * 2, dec, dst, blk, D);
    }
  }
  for (at::Tensor* buf : {&code_buf, &scale_buf, &points_buf, &rotated_buf})  // a long prompt's are let go
    if (buf->nbytes() > kScratchBytes) *buf = at::Tensor();
  return {hits, m};
}

// The blocks each query may select, as block_select's `scored` (B, Hk, T): n(p), 0 for a streaming head.
at::Tensor selectable(const at::Tensor& q, const at::Tensor& q_pos, int64_t window, int64_t sink, int64_t block,
                      const at::Tensor& head_topk) {
  const int64_t B = q.size(0), H = q.size(1), NT = q_pos.size(0);
  auto scored = at::empty({B, H, NT}, q.options().dtype(at::kLong));
  const int64_t* qp = q_pos.const_data_ptr<int64_t>();
  const int64_t* tk = head_topk.const_data_ptr<int64_t>();
  int64_t* nsc = scored.data_ptr<int64_t>();
  for (int64_t item = 0; item < B * H * NT; ++item)
    nsc[item] = selectable_blocks(tk[(item / NT) % H], qp[item % NT], window, sink, block);
  return scored;
}

}  // namespace

namespace kakeya_ops {

// One sparse step for a D4 cold tier with its decoded-block cache: the indexer, the cache fill (decoded_fill), the
// attention over the hot set and the cached blocks (block_slot's first n_blocks entries as the per-head slot map)
// and the tripwire, in one call. Returns the output, the selection bitsets and (hits, misses) (B, Hc) summed; when
// some head selected more blocks than it has slots, misses is -1, the output is empty and nothing was changed
// (the caller decodes afresh). `selected`: the selection a refused call of the same step returned, reused instead of
// running the indexer again (the tripwire still checks every query's counts, from its position).
std::tuple<at::Tensor, at::Tensor, int64_t, int64_t> sparse_step_decoded(
    const at::Tensor& q, const at::Tensor& hot_k, const at::Tensor& hot_v, const at::Tensor& hot_pos,
    const at::Tensor& cold_head, const at::Tensor& kmin, const at::Tensor& kmax, int64_t n_blocks,
    const at::Tensor& head_topk, const at::Tensor& q_pos, int64_t window, int64_t sink, int64_t block, double scale,
    const at::Tensor& counters, double budget, const at::Tensor& block_slot, const at::Tensor& slot_block,
    const at::Tensor& slot_used, int64_t step, const at::Tensor& k_code, const at::Tensor& k_scale,
    const at::Tensor& v_code, const at::Tensor& v_scale, const at::Tensor& rot, const at::Tensor& dec_k,
    const at::Tensor& dec_v, int64_t lattice_q, int64_t bits, int64_t codes,
    const std::optional<at::Tensor>& selected, int64_t budget_topk) {
  TORCH_CHECK(kmin.dim() == 4 && n_blocks >= 0 && n_blocks <= kmin.size(2), "sparse_step_decoded: ", n_blocks,
              " blocks, summaries (B, Hc, N, D) for ", kmin.dim() == 4 ? kmin.size(2) : -1);
  TORCH_CHECK(k_code.dim() == 5 && k_code.size(3) == block, "sparse_step_decoded: codes of ", block, "-position blocks");
  at::Tensor select, scored;
  if (selected.has_value()) {
    TORCH_CHECK(selected->dim() == 4 && selected->scalar_type() == at::kLong && selected->is_contiguous() &&
                    selected->size(0) == q.size(0) && selected->size(1) == q.size(1) &&
                    selected->size(2) == q_pos.size(0) && head_topk.dim() == 1 && head_topk.size(0) == q.size(1),
                "sparse_step_decoded: selected must be block_select's (B, Hk, T, words) int64 for these queries");
    select = *selected;
    scored = selectable(q, q_pos, window, sink, block, head_topk);
  } else {
    std::tie(select, scored) = block_select(q, kmin.narrow(2, 0, n_blocks), kmax.narrow(2, 0, n_blocks), q_pos,
                                            window, sink, block, head_topk, scale, budget, budget_topk);
  }
  const auto [hits, misses] = decoded_fill(select, cold_head, n_blocks, block_slot, slot_block, slot_used, step,
                                           k_code, k_scale, v_code, v_scale, rot, dec_k, dec_v, lattice_q, bits,
                                           codes);
  if (misses < 0) return {at::empty({0}, q.options()), select, hits, misses};
  // block_slot's first n_blocks columns as one contiguous map, in the calling thread's kept buffer (a fresh copy
  // every step otherwise); read by this call only
  thread_local at::Tensor slot_buf;
  const int64_t Hc = block_slot.size(0);
  if (!slot_buf.defined() || slot_buf.numel() < Hc * n_blocks ||
      slot_buf.is_inference() != c10::InferenceMode::is_enabled())  // written here, so made in the caller's mode
    slot_buf = at::empty({std::max<int64_t>(64, 2 * Hc * n_blocks)}, block_slot.options());
  const auto slot = slot_buf.narrow(0, 0, Hc * n_blocks).view({Hc, n_blocks});
  slot.copy_(block_slot.narrow(1, 0, n_blocks));
  auto [out, seen] = kakeya_ops::sparse_attention(q, hot_k, hot_v, hot_pos, dec_k, dec_v, std::nullopt, std::nullopt,
                                                  slot, cold_head, select, q_pos, window, sink, block, scale);
  sparse_check(seen, scored, q_pos, window, sink, block, head_topk, counters, budget, budget_topk);
  return {out, select, hits, misses};
}

// A decode step's new K/V (B, Hk, 1, D) into one slot of the sparse layer's hot ring (k_hot, v_hot (B, Hk, S, D),
// hot_pos (S,)): one call instead of three indexing copies.
void ring_write(const at::Tensor& k_hot, const at::Tensor& v_hot, const at::Tensor& hot_pos, const at::Tensor& k,
                const at::Tensor& v, const at::Tensor& positions, int64_t slot) {
  TORCH_CHECK(k_hot.dim() == 4 && k_hot.sizes() == v_hot.sizes() && k.dim() == 4 && k.sizes() == v.sizes() &&
                  k.size(0) == k_hot.size(0) && k.size(1) == k_hot.size(1) && k.size(2) == 1 &&
                  k.size(3) == k_hot.size(3) && k.scalar_type() == k_hot.scalar_type() &&
                  v.scalar_type() == k_hot.scalar_type() && v_hot.scalar_type() == k_hot.scalar_type() &&
                  k.stride(3) == 1 && v.stride(3) == 1 && k_hot.stride(3) == 1 && v_hot.stride(3) == 1,
              "ring_write: k, v (B, Hk, 1, D) and the ring (B, Hk, S, D), one dtype, unit last stride");
  TORCH_CHECK(hot_pos.dim() == 1 && hot_pos.size(0) == k_hot.size(2) && hot_pos.scalar_type() == at::kLong &&
                  positions.numel() == 1 && positions.scalar_type() == at::kLong && 0 <= slot &&
                  slot < k_hot.size(2),
              "ring_write: hot_pos (S,) int64, one position, a slot in range");
  const int64_t B = k.size(0), H = k.size(1), D = k.size(3);
  const size_t bytes = D * k.element_size();
  auto* kd = static_cast<char*>(k_hot.data_ptr());
  auto* vd = static_cast<char*>(v_hot.data_ptr());
  const auto* ks = static_cast<const char*>(k.const_data_ptr());
  const auto* vs = static_cast<const char*>(v.const_data_ptr());
  const int64_t es = k.element_size();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      std::memcpy(kd + (b * k_hot.stride(0) + h * k_hot.stride(1) + slot * k_hot.stride(2)) * es,
                  ks + (b * k.stride(0) + h * k.stride(1)) * es, bytes);
      std::memcpy(vd + (b * v_hot.stride(0) + h * v_hot.stride(1) + slot * v_hot.stride(2)) * es,
                  vs + (b * v.stride(0) + h * v.stride(1)) * es, bytes);
    }
  hot_pos.data_ptr<int64_t>()[slot * hot_pos.stride(0)] = positions.const_data_ptr<int64_t>()[0];
}

}  // namespace kakeya_ops

TORCH_LIBRARY_FRAGMENT(kakeya, m) {
  m.def("block_select(Tensor q, Tensor kmin, Tensor kmax, Tensor q_pos, int window, int sink, int block, "
        "Tensor head_topk, float scale=0., float budget=0., int budget_topk=0) -> (Tensor, Tensor)");
  m.def("sparse_check(Tensor seen, Tensor scored, Tensor q_pos, int window, int sink, int block, Tensor head_topk, "
        "Tensor(a!) counters, float budget=0., int budget_topk=0) -> ()");
  m.def("sparse_step(Tensor q, Tensor hot_k, Tensor hot_v, Tensor hot_pos, Tensor cold_k, Tensor cold_v, "
        "Tensor? cold_k_scale, Tensor? cold_v_scale, Tensor cold_slot, Tensor cold_head, Tensor kmin, Tensor kmax, "
        "int n_blocks, Tensor head_topk, Tensor q_pos, int window, int sink, int block, float scale, "
        "Tensor(a!) counters, float budget=0., int budget_topk=0) -> (Tensor, Tensor)");
  m.def("sparse_step_decoded(Tensor q, Tensor hot_k, Tensor hot_v, Tensor hot_pos, Tensor cold_head, Tensor kmin, "
        "Tensor kmax, int n_blocks, Tensor head_topk, Tensor q_pos, int window, int sink, int block, float scale, "
        "Tensor(a!) counters, float budget, Tensor(b!) block_slot, Tensor(c!) slot_block, Tensor(d!) slot_used, "
        "int step, Tensor k_code, Tensor k_scale, Tensor v_code, Tensor v_scale, Tensor rot, Tensor(e!) dec_k, "
        "Tensor(f!) dec_v, int lattice_q, int bits, int codes, Tensor? selected=None, int budget_topk=0) -> "
        "(Tensor, Tensor, int, int)");
  m.def("ring_write(Tensor(a!) k_hot, Tensor(b!) v_hot, Tensor(c!) hot_pos, Tensor k, Tensor v, Tensor positions, "
        "int slot) -> ()");
}

TORCH_LIBRARY_IMPL(kakeya, CPU, m) {
  m.impl("block_select", &block_select);
  m.impl("sparse_check", &sparse_check);
  m.impl("sparse_step", &kakeya_ops::sparse_step);
  m.impl("ring_write", &kakeya_ops::ring_write);
  m.impl("sparse_step_decoded", &kakeya_ops::sparse_step_decoded);
}
