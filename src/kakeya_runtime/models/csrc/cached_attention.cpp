// Attention of query rows over a KV cache on the CPU, with one fixed order of operations per query:
// kakeya::cached_attention.
//
// q (B, Hk, R, D): the R query rows that share K/V head h, ordered (group, token): row r is token r % T of
// query head h * (R / T) + r / T, T = q_pos.size(0). k, v (B, Hk, S, D) with k_pos (S,) their absolute
// positions (any order, each position once). Token t sees key j iff k_pos[j] <= q_pos[t] and, with a window,
// q_pos[t] - k_pos[j] < window or k_pos[j] < sink. Returns (B, Hk, R, D) in q's dtype.
//
// Invariance: the result for a query depends only on the keys it sees, never on how many other rows or keys
// share the call (a fresh prompt, a chunk over a cache, a decode step, a batch), nor on the thread count.
// - Keys are grouped by absolute position: blocks of BK positions (key p in lane p % BK) and superblocks of
//   SPLIT positions. A block's scores, its online-softmax update and its p . V run one fixed sequence per
//   row: dot products over D then one lane-reduction tree (every key alike), a masked exponential over all
//   lanes, lane sums by a fixed tree, p . V in lane order (bf16: lane pairs by position parity).
// - Superblocks are the parallel work items (with batch and head); their partial softmax states are merged
//   per row in position order, against the row's global max, skipping superblocks it does not see.
// - Rows run in tiles of at most ROW_TILE tokens (memory for the partial states stays bounded).
// Accumulation is fp32 throughout; in bf16 the probabilities are rounded to bf16 for p . V (as SDPA's bf16
// kernel does) and dot products use vdpbf16ps (exact bf16 products, fp32 sums) where the CPU has it.

#include "common.h"

#include <atomic>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int VS = Vec::size();
constexpr int BK = 32;           // positions per block
constexpr int64_t SPLIT = 512;   // positions per superblock (a work item); a multiple of BK
constexpr int64_t ROW_TILE = 512; // tokens per row tile
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

#if defined(__AVX512BF16__)
constexpr bool kBf16Dot = true;
#else
constexpr bool kBf16Dot = false;
#endif

// bf16 dot products in pairs (vdpbf16ps) for this head size.
template <typename T, int D>
constexpr bool kPairs = kBf16Dot && std::is_same_v<T, c10::BFloat16> && D % 32 == 0;

// How a key source is seen: cached_attention's keys are Plain; kakeya::sparse_attention's exact hot set is Hot;
// its cold blocks on AMX tiles are Cold (positions counted from `sink`, each token sees the blocks it selected;
// elsewhere each token's selected blocks are packed into lanes of their own, below).
enum class Kind : int { Plain = 0, Hot = 1, Cold = 2 };

// What the rows of a call see: positions, the window rule and, for sparse sources, the block split.
struct Rule {
  const int64_t* q_pos;  // (T,)
  int64_t T, window, sink;
  Kind kind = Kind::Plain;
  int64_t block = 0;  // Hot, Cold: positions per cold block, counted from `sink`
  int64_t row0 = 0;   // the work item's first query row among the call's (a hot item may take a slice of them)
  const uint64_t* sel = nullptr;  // Cold: the tokens' selection bitsets, (T, words)
  int64_t words = 0;
  const int64_t* below = nullptr;  // Cold: (T,) the blocks wholly below each token's hot range

  // The token of the item's query row r (rows are ordered (group, token)).
  inline int64_t token(int64_t r) const { return (row0 + r) % T; }

  // Cold: the lanes of the 32 cold positions [base, base + 32) (counted from `sink`) in blocks token t selected.
  inline uint32_t cold_lanes(int64_t t, int64_t base) const {
    const uint64_t* row = sel + t * words;
    const int64_t n = below[t];
    uint32_t m = 0u;
    for (int64_t c = base; c < base + 32;) {
      const int64_t j = c / block, end = std::min((j + 1) * block, base + 32);
      if (j < n && ((row[j >> 6] >> (j & 63)) & 1u)) {
        const int64_t lo = c - base, len = end - c;
        m |= (len >= 32 ? 0xFFFFFFFFu : ((1u << len) - 1)) << lo;
      }
      c = end;
    }
    return m;
  }

  // Hot: the first position of a query's hot range, the last `window` positions extended down to a block
  // boundary; every block below it lies wholly outside the window (a cold block).
  inline int64_t hot_lo(int64_t qp) const {
    const int64_t out = qp + 1 - window - sink;
    return out <= 0 ? sink : sink + out / block * block;
  }

  // Lanes of the 32 positions [base, base + 32) that token t sees, among the `present` ones.
  inline uint32_t lanes(int64_t t, int64_t base, uint32_t present) const {
    if (kind == Kind::Cold) return cold_lanes(t, base) & present;  // every selected block lies below the query
    const int64_t qp = q_pos[t], hi = qp - base;  // the last lane causality allows
    if (hi < 0) return 0u;
    uint32_t m = hi >= 31 ? 0xFFFFFFFFu : (1u << (hi + 1)) - 1;
    if (kind == Kind::Hot || window > 0) {
      // first lane in the window (the hot range); lanes below sink
      const int64_t lo = (kind == Kind::Hot ? hot_lo(qp) : qp - window + 1) - base, sk = sink - base;
      uint32_t w = lo <= 0 ? 0xFFFFFFFFu : (lo >= 32 ? 0u : ~((1u << lo) - 1));
      if (sk > 0) w |= sk >= 32 ? 0xFFFFFFFFu : (1u << sk) - 1;
      m &= w;
    }
    return m & present;
  }
};

// One block: up to BK keys whose positions share pos / BK, each with its lane.
struct Block {
  int64_t first;  // into the position-sorted key order
  int64_t count;
  int64_t min_pos, max_pos;
};

struct Partial {
  float* acc;  // (R, D) unnormalised sum of p * v
  float* m;    // (R,) running max score
  float* l;    // (R,) running sum of p
  float* n;    // (R,) keys seen (exact as a float up to 2^24)
};


// Rows to ask the cache for (into L2) while other work runs (timing only: a prefetch never faults): row i's
// `bytes` at base + (idx ? idx[i] : i) * stride bytes, for i < count.
struct Ahead {
  const char* base = nullptr;
  int64_t stride = 0, bytes = 0;
  const int64_t* idx = nullptr;
  int64_t count = 0;
  inline void ask(int64_t i) const {
    if (i >= count) return;
    const char* p = base + (idx != nullptr ? idx[i] : i) * stride;
    for (int64_t c = 0; c < bytes; c += 64) prefetch_l2(p + c);
  }
  // ask(i) for rows [i, i + N) of BYTES bytes (== bytes), the lines unrolled (block_few's loops)
  template <int N, int BYTES>
  inline void ask_rows(int64_t i) const {
    for (int n = 0; n < N && i + n < count; ++n) {
      const char* p = base + (idx != nullptr ? idx[i + n] : i + n) * stride;
      for (int c = 0; c < BYTES; c += 64) prefetch_l2(p + c);
    }
  }
};

// The K or V rows of block `blk` (keys order[blk.first..]) of a head starting at `base`, `row` elements apart.
template <typename T, int D>
inline Ahead block_ahead(const T* base, int64_t row, const int64_t* order, const Block& blk) {
  constexpr int64_t E = sizeof(T);
  return Ahead{reinterpret_cast<const char*>(base), row * E, D * E, order + blk.first, blk.count};
}

// Scores of one query row against the BK lanes of a block (empty lanes: nullptr, score 0, masked later); `ahead`:
// rows asked for, one per key (the next block's keys).
template <typename T, int D>
inline void block_scores(const T* q, const T* const* krow, float* s, const Ahead& ahead = Ahead{}) {
#if defined(__AVX512F__)
  constexpr bool pairs = kPairs<T, D>;
  if constexpr (pairs || (std::is_same_v<T, float> && D % 16 == 0)) {
    constexpr int CH = pairs ? 32 : 16;  // elements per vector step
    constexpr int NC = D / CH;
    static_assert(D % CH == 0, "head_dim must be a multiple of the vector step");
    __m512i qv[NC];
    for (int c = 0; c < NC; ++c) qv[c] = _mm512_loadu_si512(q + c * CH);
    for (int j0 = 0; j0 < BK; j0 += 16) {
      __m512 acc[16];
      for (int j = 0; j < 16; ++j) ahead.ask(j0 + j);  // before the 16 accumulators are live (no spills)
      for (int j = 0; j < 16; ++j) {
        acc[j] = _mm512_setzero_ps();
        const T* kr = krow[j0 + j];
        if (kr == nullptr) continue;
        for (int c = 0; c < NC; ++c) {
          const __m512i kv = _mm512_loadu_si512(kr + c * CH);
          if constexpr (pairs) {
#if defined(__AVX512BF16__)
            acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)qv[c], (__m512bh)kv);
#endif
          } else {
            acc[j] = _mm512_fmadd_ps(_mm512_castsi512_ps(qv[c]), _mm512_castsi512_ps(kv), acc[j]);
          }
        }
      }
      _mm512_storeu_ps(s + j0, reduce16(acc));
    }
    return;
  }
#endif
  float qf[D], kf[D];
  for (int d = 0; d < D; ++d) qf[d] = static_cast<float>(q[d]);
  for (int j = 0; j < BK; ++j) {
    if (krow[j] == nullptr) {
      s[j] = 0.f;
      continue;
    }
    for (int d = 0; d < D; ++d) kf[d] = static_cast<float>(krow[j][d]);
    Vec acc(0.f);
    for (int d = 0; d < D; d += VS) acc = at::vec::fmadd(Vec::loadu(qf + d), Vec::loadu(kf + d), acc);
    s[j] = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc);
  }
}

// Online softmax of one row over a block: s (BK lanes) scaled and masked to the `vis` lanes, folded into the
// running max and sum; leaves p in s (0 where masked) and returns alpha for the accumulator, or a negative
// value when the row sees nothing here (its state stays as it is). Every lane goes through the same vector
// exponential and the lane sum through one fixed tree, whichever lanes are visible.
inline float block_softmax(float* s, uint32_t vis, float scale, float& m, float& l) {
  static_assert(BK == 32, "two 16-lane halves");
  if (vis == 0u) return -1.f;
#if defined(__AVX512F__)
  const __m512 ninf = _mm512_set1_ps(NEG_INF), sc = _mm512_set1_ps(scale);
  const auto m0 = static_cast<__mmask16>(vis & 0xFFFFu), m1 = static_cast<__mmask16>(vis >> 16);
  const __m512 x0 = _mm512_mask_mul_ps(ninf, m0, _mm512_loadu_ps(s), sc);
  const __m512 x1 = _mm512_mask_mul_ps(ninf, m1, _mm512_loadu_ps(s + 16), sc);
  const float bmax = _mm512_reduce_max_ps(_mm512_max_ps(x0, x1));  // max is exact in any order
  const float m_new = std::max(m, bmax);
  const float alpha = std::exp(m - m_new);  // exp(-inf) = 0 on the row's first block
  const Vec mv(m_new);
  const __m512 p0 = _mm512_maskz_mov_ps(m0, static_cast<__m512>((Vec(x0) - mv).exp_u20()));
  const __m512 p1 = _mm512_maskz_mov_ps(m1, static_cast<__m512>((Vec(x1) - mv).exp_u20()));
  _mm512_storeu_ps(s, p0);
  _mm512_storeu_ps(s + 16, p1);
  const float sum = _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
#else
#if defined(CPU_CAPABILITY_AVX2)
  // the scalar loop below in 8 lanes: the same products, and max is exact in any order (a NaN score is passed over
  // as std::max(bmax, s) passes it: vmaxps returns its second operand when the first is NaN)
  const __m256 ninf = _mm256_set1_ps(NEG_INF), sc = _mm256_set1_ps(scale);
  const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  __m256 mx = ninf;
  for (int i = 0; i < BK; i += 8) {
    const __m256i lane = _mm256_and_si256(_mm256_set1_epi32(static_cast<int>(vis >> i)), bit);
    const __m256 x = _mm256_blendv_ps(ninf, _mm256_mul_ps(_mm256_loadu_ps(s + i), sc),
                                      _mm256_castsi256_ps(_mm256_cmpeq_epi32(lane, bit)));
    _mm256_storeu_ps(s + i, x);
    mx = _mm256_max_ps(x, mx);
  }
  mx = _mm256_max_ps(mx, _mm256_permute2f128_ps(mx, mx, 1));
  mx = _mm256_max_ps(mx, _mm256_shuffle_ps(mx, mx, 0x4E));
  const float bmax = _mm256_cvtss_f32(_mm256_max_ps(mx, _mm256_shuffle_ps(mx, mx, 0xB1)));
#else
  float bmax = NEG_INF;
  for (int j = 0; j < BK; ++j) {
    s[j] = (vis >> j) & 1u ? s[j] * scale : NEG_INF;
    bmax = std::max(bmax, s[j]);
  }
#endif
  const float m_new = std::max(m, bmax);
  const float alpha = m == m_new && m > NEG_INF ? 1.f : std::exp(m - m_new);  // exp(0) = 1 exactly: no libm call
  Vec vsum(0.f);
  for (int j = 0; j < BK; j += VS) {
    const Vec x = Vec::loadu(s + j);
    const Vec p = Vec::blendv(Vec(0.f), (x - Vec(m_new)).exp_u20(), x != Vec(NEG_INF));
    p.store(s + j);
    vsum = vsum + p;
  }
  const float sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, vsum);
#endif
  l = l * alpha + sum;
  m = m_new;
  return alpha;
}


// acc = alpha * acc + sum over lanes (in lane order) of p_j v_j.
template <typename T, int D>
inline void block_pv(const float* p, const T* const* vrow, const uint32_t* vt2, float* acc, float alpha) {
#if defined(__AVX512BF16__)
  if constexpr (kPairs<T, D>) {
    // p to bf16 pairs (lane 2i, 2i+1), against V interleaved by the same pairs: one vdpbf16ps per 16 dims.
    alignas(64) uint32_t p2[BK / 2];
    _mm512_storeu_si512(p2, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(p + 16), _mm512_loadu_ps(p)));
    constexpr int DV = D / 16;
    __m512 a[DV];
    for (int c = 0; c < DV; ++c) a[c] = _mm512_mul_ps(_mm512_loadu_ps(acc + c * 16), _mm512_set1_ps(alpha));
    for (int jp = 0; jp < BK / 2; ++jp) {
      if (p2[jp] == 0u) continue;  // both probabilities +0: adds exactly nothing
      const __m512i pv = _mm512_set1_epi32(static_cast<int>(p2[jp]));
      for (int c = 0; c < DV; ++c)
        a[c] = _mm512_dpbf16_ps(a[c], (__m512bh)pv, (__m512bh)_mm512_loadu_si512(vt2 + jp * D + c * 16));
    }
    for (int c = 0; c < DV; ++c) _mm512_storeu_ps(acc + c * 16, a[c]);
    return;
  }
#endif
  static_assert(D % VS == 0, "head_dim must be a multiple of the vector width");
  constexpr int DV = D / VS;
  Vec a[DV];
  for (int c = 0; c < DV; ++c) a[c] = Vec::loadu(acc + c * VS) * Vec(alpha);
  float vf[D];
  for (int j = 0; j < BK; ++j) {
    if (p[j] == 0.f || vrow[j] == nullptr) continue;  // p_j v_j = 0 adds exactly nothing
    const T* vr = vrow[j];
    const float* vp;
    if constexpr (std::is_same_v<T, float>) {
      vp = vr;
    } else {
      for (int d = 0; d < D; ++d) vf[d] = static_cast<float>(vr[d]);
      vp = vf;
    }
    const Vec pj(p[j]);
    for (int c = 0; c < DV; ++c) a[c] = at::vec::fmadd(pj, Vec::loadu(vp + c * VS), a[c]);
  }
  for (int c = 0; c < DV; ++c) a[c].store(acc + c * VS);
}

#if defined(CPU_CAPABILITY_AVX2) && !defined(__AVX512F__)
// ---------------------------------------------------------------- AVX2: block_scores' and block_pv's bits, blocked
// The portable block_scores and block_pv widen every key and value row of a block to fp32 again for each query row
// (a 512-token chunk's 1,536 rows each widened the block anew) and reduce each key's score on its own. Here a block's
// rows are widened once for all the rows of the work item, and 8 keys' scores are reduced together by at::vec's tree
// (reduce8): every score, probability and sum is the bits the portable path gives.

// A block's rows as fp32: bf16 rows widened into buf (lane j at buf + j * D), fp32 rows as they are; an absent
// lane reads `absent` (a zero row, or nullptr). `ahead`: rows to ask the cache for, one per lane (the next block's).
template <typename T, int D>
inline void widen_block(const T* const* row, float* buf, const float** out, const float* absent, const Ahead& ahead) {
  for (int j = 0; j < BK; ++j) {
    ahead.ask(j);
    if (row[j] == nullptr) {
      out[j] = absent;
    } else if constexpr (std::is_same_v<T, float>) {
      out[j] = row[j];
    } else {
      for (int d = 0; d < D; d += 8) _mm256_storeu_ps(buf + j * D + d, widen8(row[j] + d));
      out[j] = buf + j * D;
    }
  }
}

// block_scores over widened keys (an absent lane reads a zero row): per key the portable path's fused multiply-adds
// in the same order, then its reduction tree, 8 keys at a time with their accumulators in registers. An absent
// lane's score is 0 for a finite query (the portable path's 0) and never read: no row sees an absent lane.
template <typename T, int D>
inline void block_scores_wide(const T* q, const float* const* kf, float* s) {
  alignas(32) float qf[D];
  for (int d = 0; d < D; d += 8) _mm256_store_ps(qf + d, widen8(q + d));
  for (int j0 = 0; j0 < BK; j0 += 8) {
    __m256 acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
    for (int d = 0; d < D; d += 8) {
      const __m256 qv = _mm256_load_ps(qf + d);
      for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kf[j0 + j] + d), acc[j]);
    }
    _mm256_storeu_ps(s + j0, reduce8(acc));
  }
}

// block_pv over widened values: acc = alpha * acc, then p_j v_j added in lane order (lanes with p_j = 0 skipped),
// 64 dimensions at a time so the accumulators stay in registers at every head size.
template <int D>
inline void block_pv_wide(const float* p, const float* const* vf, float* acc, float alpha) {
  constexpr int CH = D <= 64 ? D : D % 64 == 0 ? 64 : 32;
  static_assert(D % CH == 0 && CH % 8 == 0, "head_dim must be a multiple of 8");
  const __m256 al = _mm256_set1_ps(alpha);
  for (int c0 = 0; c0 < D; c0 += CH) {
    __m256 a[CH / 8];
    for (int c = 0; c < CH / 8; ++c) a[c] = _mm256_mul_ps(_mm256_loadu_ps(acc + c0 + c * 8), al);
    for (int j = 0; j < BK; ++j) {
      if (p[j] == 0.f || vf[j] == nullptr) continue;
      const __m256 pj = _mm256_set1_ps(p[j]);
      for (int c = 0; c < CH / 8; ++c) a[c] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vf[j] + c0 + c * 8), a[c]);
    }
    for (int c = 0; c < CH / 8; ++c) _mm256_storeu_ps(acc + c0 + c * 8, a[c]);
  }
}
#endif

#if defined(CPU_CAPABILITY_AVX2) && !defined(__AVX512F__)
// ---------------------------------------------------------------- AVX2: a decode item's few rows, in registers
// A decode row's item holds its G query rows of one K/V head (SmolLM2: 3). The tiled path widens each block into
// buffers and reads them back per row: ~24 ns a key and K/V head on the EPYC from cache (a decode row over 4,096
// keys, one thread). Here each key's and value's 8 dims are widened once in a register and used by every row at
// once (~19 ns): the same fused multiply-adds in the same order per row, key and dim (each row's scores reduced by
// at::vec's tree, reduce4 below), so every score, probability and sum keeps its bits.

// Lanes 0-3: the sums of a[0..3]'s 8 lanes by reduce8's tree (((x0 + x4) + (x2 + x6)) + ((x1 + x5) + (x3 + x7))).
__attribute__((always_inline)) inline __m128 reduce4(const __m256* a) {
  const __m256 t0 = _mm256_add_ps(_mm256_permute2f128_ps(a[0], a[1], 0x20), _mm256_permute2f128_ps(a[0], a[1], 0x31));
  const __m256 t1 = _mm256_add_ps(_mm256_permute2f128_ps(a[2], a[3], 0x20), _mm256_permute2f128_ps(a[2], a[3], 0x31));
  // per half: (x0 + x2), (x1 + x3) of t0's, then of t1's (low half: a[0], a[2]; high half: a[1], a[3])
  const __m256 u = _mm256_add_ps(_mm256_shuffle_ps(t0, t1, 0x44), _mm256_shuffle_ps(t0, t1, 0xEE));
  const __m256 h = _mm256_hadd_ps(u, u);  // lanes 0, 1: a[0], a[2]; lanes 4, 5: a[1], a[3]
  return _mm256_castps256_ps128(_mm256_permutevar8x32_ps(h, _mm256_setr_epi32(0, 4, 1, 5, 0, 4, 1, 5)));
}

// The NR rows' scores against a block's BK lanes (qf: the rows widened, D apart; s: BK apart; an absent lane reads
// a zero row, its score never read): 4 keys at a time, each key's 8 dims widened once for all rows.
template <typename T, int D, int NR>
inline void block_scores_few(const float* qf, const T* const* krow, const T* zero, float* s, const Ahead& ahead) {
  for (int j0 = 0; j0 < BK; j0 += 4) {
    const T* kr[4];
    ahead.ask_rows<4, D * sizeof(T)>(j0);
    for (int j = 0; j < 4; ++j) kr[j] = krow[j0 + j] != nullptr ? krow[j0 + j] : zero;
    __m256 acc[NR][4];
    for (int r = 0; r < NR; ++r)
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_setzero_ps();
    for (int d = 0; d < D; d += 8)
      for (int j = 0; j < 4; ++j) {
        const __m256 kv = widen8(kr[j] + d);
        for (int r = 0; r < NR; ++r) acc[r][j] = _mm256_fmadd_ps(_mm256_load_ps(qf + r * D + d), kv, acc[r][j]);
      }
    for (int r = 0; r < NR; ++r) _mm_storeu_ps(s + r * BK + j0, reduce4(acc[r]));
  }
}

// acc_r = alpha_r acc_r + sum over lanes (in lane order) of p_rj v_j for the rows that see the block (live), lanes
// with p_rj = 0 skipped per row (as block_pv_wide): CH dims at a time, each value's 8 dims widened once for all rows.
template <typename T, int D, int NR>
inline void block_pv_few(const float* p, const T* const* vrow, float* const* acc, const float* alpha,
                         const bool* live, const Ahead& ahead) {
  // the lanes each live row adds (p != 0), and those every row adds
  uint32_t nz[NR], every = 0xFFFFFFFFu, some = 0u;
  for (int r = 0; r < NR; ++r) {
    nz[r] = 0u;
    if (live[r])
      for (int j = 0; j < BK; j += 8)
        nz[r] |= static_cast<uint32_t>(_mm256_movemask_ps(
                     _mm256_cmp_ps(_mm256_loadu_ps(p + r * BK + j), _mm256_setzero_ps(), _CMP_NEQ_UQ)))
                 << j;
    every &= nz[r];
    some |= nz[r];
  }
  ahead.ask_rows<BK, D * sizeof(T)>(0);
  constexpr int LIM = NR == 1 ? 64 : NR <= 3 ? 32 : 16;  // NR x CH / 8 accumulators in registers
  constexpr int CH = D % LIM == 0 ? LIM : D % 32 == 0 ? 32 : D % 16 == 0 ? 16 : 8;
  static_assert(D % CH == 0, "head_dim must be a multiple of 8");
  for (int c0 = 0; c0 < D; c0 += CH) {
    __m256 a[NR][CH / 8];
    for (int r = 0; r < NR; ++r)
      if (live[r])
        for (int c = 0; c < CH / 8; ++c)
          a[r][c] = _mm256_mul_ps(_mm256_loadu_ps(acc[r] + c0 + c * 8), _mm256_set1_ps(alpha[r]));
    if (some == every) {  // the usual block: every row adds the same lanes (so every row is live)
      for (uint32_t m = every; m != 0u; m &= m - 1) {
        const int j = __builtin_ctz(m);
        __m256 pj[NR];
        for (int r = 0; r < NR; ++r) pj[r] = _mm256_set1_ps(p[r * BK + j]);
        for (int c = 0; c < CH / 8; ++c) {
          const __m256 vv = widen8(vrow[j] + c0 + c * 8);
          for (int r = 0; r < NR; ++r) a[r][c] = _mm256_fmadd_ps(pj[r], vv, a[r][c]);
        }
      }
    } else {
      for (int r = 0; r < NR; ++r)
        for (uint32_t m = nz[r]; m != 0u; m &= m - 1) {  // p v = 0 adds exactly nothing
          const int j = __builtin_ctz(m);
          const __m256 pj = _mm256_set1_ps(p[r * BK + j]);
          for (int c = 0; c < CH / 8; ++c) a[r][c] = _mm256_fmadd_ps(pj, widen8(vrow[j] + c0 + c * 8), a[r][c]);
        }
    }
    for (int r = 0; r < NR; ++r)
      if (live[r])
        for (int c = 0; c < CH / 8; ++c) _mm256_storeu_ps(acc[r] + c0 + c * 8, a[r][c]);
  }
}

// One block for the item's NR rows (R <= 4): which rows see it, their scores, softmax and p . V, each row's bits
// those of the tiled path.
template <typename T, int D, int NR>
inline void block_few(const float* qf, const T* const* krow, const T* const* vrow, const T* zero, uint32_t present,
                      int64_t base, const Rule& rule, float scale, Partial st, const Ahead& next_k,
                      const Ahead& next_v) {
  uint32_t vis[NR];
  bool live[NR];
  bool any = false;
  for (int r = 0; r < NR; ++r) {
    vis[r] = rule.lanes(rule.token(r), base, present);
    live[r] = vis[r] != 0u;
    any = any || live[r];
  }
  if (!any) return;
  alignas(32) float s[NR * BK];
  block_scores_few<T, D, NR>(qf, krow, zero, s, next_k);
  float alpha[NR];
  float* acc[NR];
  for (int r = 0; r < NR; ++r) {
    acc[r] = st.acc + r * D;
    if (!live[r]) continue;
    st.n[r] += static_cast<float>(__builtin_popcount(vis[r]));
    alpha[r] = block_softmax(s + r * BK, vis[r], scale, st.m[r], st.l[r]);
  }
  block_pv_few<T, D, NR>(s, vrow, acc, alpha, live, next_v);
}
#endif

#if defined(__AVX512BF16__)
// V of a block of NL lanes interleaved by lane pairs, vt2 (NL/2, D) of (v[2i][d], v[2i+1][d]); empty lanes are zero.
// `ahead` (optional): rows to ask the cache for, two per lane pair, spread over the work so the requests overlap it
// instead of stalling it in one burst (timing only).
template <int D, int NL = BK>
inline void interleave_values(const c10::BFloat16* const* vrow, uint32_t* vt2, const Ahead& ahead = Ahead{}) {
  static const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                             39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  static const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int j = 0; j < NL; j += 2) {
    ahead.ask(j);
    ahead.ask(j + 1);
    for (int c = 0; c < D / 32; ++c) {
      const __m512i va = vrow[j] ? _mm512_loadu_si512(vrow[j] + c * 32) : _mm512_setzero_si512();
      const __m512i vb = vrow[j + 1] ? _mm512_loadu_si512(vrow[j + 1] + c * 32) : _mm512_setzero_si512();
      _mm512_storeu_si512(vt2 + (j / 2) * D + c * 32, _mm512_permutex2var_epi16(va, lo, vb));
      _mm512_storeu_si512(vt2 + (j / 2) * D + c * 32 + 16, _mm512_permutex2var_epi16(va, hi, vb));
    }
  }
}
#endif

template <typename T>
inline bool amx_enabled() {
#if defined(KAKEYA_AMX)
  return std::is_same_v<T, c10::BFloat16> && kakeya_amx::permitted() && kakeya_amx::attention_on.load();
#else
  return false;
#endif
}

// One work item: rows [0, R) of one (batch, head) over the blocks of one superblock.
template <typename T, int D>
void attend_superblock(const T* q, const T* k, const T* v, int64_t k_row, int64_t v_row, int64_t R,
                       const Rule& rule, const int64_t* order, const int64_t* pos,
                       const Block* blocks, int64_t nblocks, float scale, Partial st, bool in_order = false) {
  std::fill(st.acc, st.acc + R * D, 0.f);
  std::fill(st.m, st.m + R, NEG_INF);
  std::fill(st.l, st.l + R, 0.f);
  std::fill(st.n, st.n + R, 0.f);
  const T* krow[BK];
  const T* vrow[BK];
  constexpr int RT = 16;  // query rows per tile
  alignas(64) float s[RT * BK];
  alignas(64) uint32_t vt2[BK / 2 * D];
#if defined(CPU_CAPABILITY_AVX2) && !defined(__AVX512F__)
  alignas(32) float kbuf[BK * D];  // this block's K and V rows as fp32 (widen_block), for every row of the item
  alignas(32) float vbuf[BK * D];
  alignas(32) static const float kzero[D] = {};
  alignas(32) static const uint16_t tzero[D * sizeof(T) / 2] = {};  // a zero key row in T (block_few's absent lanes)
  const float* kf[BK];
  const float* vf[BK];
  alignas(32) float qf[4 * D];  // a few-row item's rows widened once (block_few)
  const bool few = R <= 4;
  for (int64_t r = 0; few && r < R; ++r)
    for (int d = 0; d < D; d += 8) _mm256_store_ps(qf + r * D + d, widen8(q + r * D + d));
#endif
  for (int64_t bi = 0; bi < nblocks; ++bi) {
    const Block& blk = blocks[bi];
    const int64_t base = blk.min_pos / BK * BK;
    std::fill(krow, krow + BK, nullptr);
    std::fill(vrow, vrow + BK, nullptr);
    uint32_t present = 0u;
    if (in_order && blk.max_pos - blk.min_pos == blk.count - 1) {  // consecutive keys stored in order: by address
      const int64_t lane0 = blk.min_pos - base;
      const T* kr = k + blk.first * k_row;
      const T* vr = v + blk.first * v_row;
      for (int64_t i = 0; i < blk.count; ++i) {
        krow[lane0 + i] = kr + i * k_row;
        vrow[lane0 + i] = vr + i * v_row;
      }
      present = (blk.count >= 32 ? 0xFFFFFFFFu : (1u << blk.count) - 1) << lane0;
    } else {
      for (int64_t i = 0; i < blk.count; ++i) {
        const int64_t j = order[blk.first + i], lane = pos[blk.first + i] - base;
        krow[lane] = k + j * k_row;
        vrow[lane] = v + j * v_row;
        present |= 1u << lane;
      }
    }
    // The next block's K and V, asked for while this one computes (its first visible row's scores, the V
    // interleave): a long cache's keys come from memory, and the loads stalled the loop without it (30 layers of
    // a decode row over 4,096 keys: ~6.4-7.2 -> ~5.5-6.5 ms, in one process; timing only).
    Ahead next_k, next_v;
    if (bi + 1 < nblocks) {
      const Block& nb = blocks[bi + 1];
      const bool by_address = in_order && nb.max_pos - nb.min_pos == nb.count - 1;
      const int64_t* idx = by_address ? nullptr : order + nb.first;
      const int64_t row0 = by_address ? nb.first : 0;
      next_k = Ahead{reinterpret_cast<const char*>(k + row0 * k_row), k_row * static_cast<int64_t>(sizeof(T)),
                     D * static_cast<int64_t>(sizeof(T)), idx, nb.count};
      next_v = Ahead{reinterpret_cast<const char*>(v + row0 * v_row), v_row * static_cast<int64_t>(sizeof(T)),
                     D * static_cast<int64_t>(sizeof(T)), idx, nb.count};
    }
#if defined(CPU_CAPABILITY_AVX2) && !defined(__AVX512F__)
    if (few) {
      const T* zero = reinterpret_cast<const T*>(tzero);
      switch (R) {
        case 1: block_few<T, D, 1>(qf, krow, vrow, zero, present, base, rule, scale, st, next_k, next_v); break;
        case 2: block_few<T, D, 2>(qf, krow, vrow, zero, present, base, rule, scale, st, next_k, next_v); break;
        case 3: block_few<T, D, 3>(qf, krow, vrow, zero, present, base, rule, scale, st, next_k, next_v); break;
        default: block_few<T, D, 4>(qf, krow, vrow, zero, present, base, rule, scale, st, next_k, next_v); break;
      }
      continue;
    }
#endif
    // The rows in tiles of RT, each stage over the tile's rows in turn (scores, softmax, p . V): every row runs its
    // own sequence as before (the same bits), and the rows' chains overlap instead of following one another (a
    // softmax's max, exponential and sums each wait on the last). On the EPYC a 4k prompt's attention took ~16% less
    // time and a 21-token chunk over 4,096 keys ~14% less; a decode row (3 rows, keys from memory) about the same.
    bool interleaved = false;
    for (int64_t r0 = 0; r0 < R; r0 += RT) {
      int64_t rows[RT];
      uint32_t vis[RT];
      int cnt = 0;
      for (int64_t r = r0; r < std::min(R, r0 + RT); ++r) {
        const uint32_t seen = rule.lanes(rule.token(r), base, present);
        if (seen == 0u) continue;
        st.n[r] += static_cast<float>(__builtin_popcount(seen));
#if defined(CPU_CAPABILITY_AVX2) && !defined(__AVX512F__)
        if (!interleaved && cnt == 0) widen_block<T, D>(krow, kbuf, kf, kzero, next_k);  // once, when a row sees it
        block_scores_wide<T, D>(q + r * D, kf, s + cnt * BK);
#else
        block_scores<T, D>(q + r * D, krow, s + cnt * BK, interleaved || cnt > 0 ? Ahead{} : next_k);
#endif
        rows[cnt] = r;
        vis[cnt++] = seen;
      }
      if (cnt == 0) continue;
      float alpha[RT];
      for (int i = 0; i < cnt; ++i) alpha[i] = block_softmax(s + i * BK, vis[i], scale, st.m[rows[i]], st.l[rows[i]]);
      if constexpr (kPairs<T, D>) {
#if defined(__AVX512BF16__)
        if (!interleaved) interleave_values<D>(vrow, vt2, next_v);
#endif
      }
#if defined(CPU_CAPABILITY_AVX2) && !defined(__AVX512F__)
      if (!interleaved) widen_block<T, D>(vrow, vbuf, vf, nullptr, next_v);
      interleaved = true;
      for (int i = 0; i < cnt; ++i) block_pv_wide<D>(s + i * BK, vf, st.acc + rows[i] * D, alpha[i]);
#else
      interleaved = true;
      for (int i = 0; i < cnt; ++i) block_pv<T, D>(s + i * BK, vrow, vt2, st.acc + rows[i] * D, alpha[i]);
#endif
    }
  }
}

#if defined(KAKEYA_AMX)
constexpr int BKA = 128;  // positions per block on the AMX path: four 32-lane words

// Online softmax of one row over an AMX block: the NB lanes of s scaled and masked to `vis` (one word per 32
// lanes), folded into the running max and sum; p left in s. The same vector ops and fixed trees for every row.
template <int NB = BKA>
inline float group_softmax(float* s, const uint32_t* vis, float scale, float& m, float& l) {
  constexpr int NV = NB / 16;
  const __m512 ninf = _mm512_set1_ps(NEG_INF), sc = _mm512_set1_ps(scale);
  __mmask16 mk[NV];
  __m512 x[NV];
  for (int i = 0; i < NV; ++i) {
    mk[i] = static_cast<__mmask16>((vis[i / 2] >> (16 * (i % 2))) & 0xFFFFu);
    x[i] = _mm512_mask_mul_ps(ninf, mk[i], _mm512_loadu_ps(s + 16 * i), sc);
  }
  __m512 mx = x[0];
  for (int i = 1; i < NV; ++i) mx = _mm512_max_ps(mx, x[i]);
  const float bmax = _mm512_reduce_max_ps(mx);  // max is exact in any order
  const float m_new = std::max(m, bmax);
  const float alpha = std::exp(m - m_new);
  const Vec mv(m_new);
  __m512 p[NV];
  for (int i = 0; i < NV; ++i) {
    p[i] = _mm512_maskz_mov_ps(mk[i], static_cast<__m512>((Vec(x[i]) - mv).exp_u20()));
    _mm512_storeu_ps(s + 16 * i, p[i]);
  }
  for (int w = NV / 2; w >= 1; w /= 2)  // pairwise: ((p0 + p4) + (p2 + p6)) + ... , one fixed tree
    for (int i = 0; i < w; ++i) p[i] = _mm512_add_ps(p[i], p[i + w]);
  l = l * alpha + _mm512_reduce_add_ps(p[0]);
  m = m_new;
  return alpha;
}

// 2^t for finite t: 2^n * P(f), n = t rounded to the nearest integer, f = t - n in [-1/2, 1/2], P the degree-6
// Taylor polynomial of 2^f (relative error below 2e-7), scaled by vscalefps (exact, underflowing to 0 as IEEE
// does); lanes outside `mk` are 0. Eleven vector operations, about half of at::vec's exp_u20 with its clamps.
inline __m512 exp2_masked(__mmask16 mk, __m512 t) {
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_maskz_scalef_ps(mk, p, n);
}

// group_softmax for scale > 0, writing p straight to `pout` in bf16 (nearest even): the row's block max is taken
// over the raw scores (scaling by a positive float is monotonic, so it is the max of the scaled scores) and each
// p = 2^(s * scale log2 e - m log2 e) by one FMA and exp2_masked. The same vector ops and fixed trees for every
// row, whichever lanes it sees: a row's bits depend on its own scores and visibility only.
template <int NB = BKA>
inline float group_softmax_bf16(const float* s, const uint32_t* vis, float scale, float& m, float& l,
                                c10::BFloat16* pout) {
  constexpr int NV = NB / 16;
  constexpr float kLog2e = 1.4426950408889634f;
  __mmask16 mk[NV];
  __m512 x[NV];
  __m512 mx = _mm512_set1_ps(NEG_INF);
  for (int i = 0; i < NV; ++i) {
    mk[i] = static_cast<__mmask16>((vis[i / 2] >> (16 * (i % 2))) & 0xFFFFu);
    x[i] = _mm512_loadu_ps(s + 16 * i);
    mx = _mm512_mask_max_ps(mx, mk[i], mx, x[i]);
  }
  const float m_new = std::max(m, _mm512_reduce_max_ps(mx) * scale);  // max is exact in any order
  const float alpha = m_new == m ? 1.f : std::exp(m - m_new);  // exp(0) is 1: no libm call when the max holds
  const __m512 c = _mm512_set1_ps(scale * kLog2e), b = _mm512_set1_ps(-m_new * kLog2e);
  __m512 p[NV];
  for (int i = 0; i < NV; ++i)  // 16 masked lanes give zeros: skip the exponential there (the same bits)
    p[i] = mk[i] != 0 ? exp2_masked(mk[i], _mm512_fmadd_ps(x[i], c, b)) : _mm512_setzero_ps();
  for (int j = 0; j < NV; j += 2)
    _mm512_storeu_si512(pout + 16 * j, (__m512i)_mm512_cvtne2ps_pbh(p[j + 1], p[j]));
  for (int w = NV / 2; w >= 1; w /= 2)  // pairwise: ((p0 + p4) + (p2 + p6)) + ... , one fixed tree
    for (int i = 0; i < w; ++i) p[i] = _mm512_add_ps(p[i], p[i + w]);
  l = l * alpha + _mm512_reduce_add_ps(p[0]);
  m = m_new;
  return alpha;
}

// Horizontal `op` of each of 16 vectors, r[i] -> lane i, by the tree _mm512_reduce_add_ps / _mm512_reduce_max_ps
// use on one vector (lanes i + 8, then + 4, then + 2, then + 1; GCC's __MM512_REDUCE_OP), run for 16 rows at once
// with shuffles between the steps: each lane gets the bits that reduction gives its row alone. `r` is clobbered.
template <typename Op>
inline __m512 reduce_rows16(__m512* r, Op op) {
  __m512 s1[8], s2[4];
  for (int k = 0; k < 8; ++k)  // rows 2k, 2k+1: lanes i + (i + 8)
    s1[k] = op(_mm512_shuffle_f32x4(r[2 * k], r[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
               _mm512_shuffle_f32x4(r[2 * k], r[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int g = 0; g < 4; ++g)  // rows 4g..4g+3, one per 128-bit lane: lanes j + (j + 4)
    s2[g] = op(_mm512_shuffle_f32x4(s1[2 * g], s1[2 * g + 1], _MM_SHUFFLE(2, 0, 2, 0)),
               _mm512_shuffle_f32x4(s1[2 * g], s1[2 * g + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  // lanes 0 + 2 and 1 + 3 of each row; 128-bit lane j: rows j, 4 + j (v01), 8 + j, 12 + j (v23)
  const __m512 v01 = op(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(s2[0]), _mm512_castps_pd(s2[1]))),
                        _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(s2[0]), _mm512_castps_pd(s2[1]))));
  const __m512 v23 = op(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(s2[2]), _mm512_castps_pd(s2[3]))),
                        _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(s2[2]), _mm512_castps_pd(s2[3]))));
  // the last pair: lane 4j + m holds row 4m + j; put row i in lane i
  const __m512 x = op(_mm512_shuffle_ps(v01, v23, _MM_SHUFFLE(2, 0, 2, 0)),
                      _mm512_shuffle_ps(v01, v23, _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(idx, x);
}

// The online softmax of the 16 rows of a tile over an AMX block, for scale > 0, writing P straight to `pout` in bf16
// (nearest even). s: the rows' raw scores [row][BKA lanes]; vis[row][word]: the lanes each row sees; m, l, n: the
// rows' running max, sum and key count; alpha: each row's factor for its accumulator, -1 where it sees nothing
// (its state stays as it is, its P row is 0). Per row: the block max over the raw scores (scaling by a positive
// float is monotonic), m_new = max(m, max * scale), alpha = exp(m - m_new) (libm, 1 when the max holds), each
// p = 2^(s * scale log2 e - m_new log2 e) by one FMA and exp2_masked, the lanes summed by a fixed pairwise tree and
// then _mm512_reduce_add_ps's tree, l = fma(l, alpha, sum). The horizontal max and sum of the 16 rows run together
// (reduce_rows16), so rows do not wait on each other's reduction chains; a row's bits depend on its own scores and
// visibility only, never on the other rows of its tile. Rows from `live` on are not in the tile (a narrow tile of a
// few rows): they see nothing, and their S and P rows are neither read nor written.
inline void tile_softmax_bf16(const float* s, const uint32_t (*vis)[BKA / 32], float scale, float* m, float* l,
                              float* n, c10::BFloat16* pout, float* alpha, int live = 16) {
  constexpr int NV = BKA / 16;
  constexpr float kLog2e = 1.4426950408889634f;
  __m512 rows[16];
  __mmask16 active = 0;
  for (int i = 0; i < 16; ++i) {
    if (i >= live) {
      rows[i] = _mm512_set1_ps(NEG_INF);
      continue;
    }
    __m512 mx[NV];
    int seen = 0;
    for (int v = 0; v < NV; ++v) {
      const auto mk = static_cast<__mmask16>((vis[i][v / 2] >> (16 * (v % 2))) & 0xFFFFu);
      mx[v] = _mm512_mask_mov_ps(_mm512_set1_ps(NEG_INF), mk, _mm512_loadu_ps(s + i * BKA + 16 * v));
    }
    for (int w = 0; w < BKA / 32; ++w) seen += __builtin_popcount(vis[i][w]);
    for (int w = NV / 2; w >= 1; w /= 2)  // max is exact in any order
      for (int v = 0; v < w; ++v) mx[v] = _mm512_max_ps(mx[v], mx[v + w]);
    rows[i] = mx[0];
    if (seen > 0) {
      active |= static_cast<__mmask16>(1u << i);
      n[i] += static_cast<float>(seen);
    }
  }
  const __m512 mv = _mm512_maskz_loadu_ps(active, m);  // masked: a short tile's state ends before 16 rows
  const __m512 y = _mm512_mul_ps(reduce_rows16(rows, [](__m512 a, __m512 b) { return _mm512_max_ps(a, b); }),
                                 _mm512_set1_ps(scale));
  const __m512 m_new = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(mv, y, _CMP_LT_OQ), mv, y);  // std::max(m, y)
  alignas(64) float mo[16], mn[16], bias[16];
  _mm512_store_ps(mo, mv);
  _mm512_store_ps(mn, m_new);
  _mm512_store_ps(bias, _mm512_mul_ps(_mm512_xor_ps(m_new, _mm512_set1_ps(-0.f)), _mm512_set1_ps(kLog2e)));
  const __m512 c = _mm512_set1_ps(scale * kLog2e);
  for (int i = 0; i < 16; ++i) {
    c10::BFloat16* po = pout + i * BKA;
    if (!((active >> i) & 1u)) {
      alpha[i] = -1.f;
      rows[i] = _mm512_setzero_ps();
      if (i < live) std::memset(po, 0, BKA * sizeof(c10::BFloat16));  // 0 for rows with nothing here
      continue;
    }
    alpha[i] = mn[i] == mo[i] ? 1.f : std::exp(mo[i] - mn[i]);  // exp(0) is 1: no libm call when the max holds
    const __m512 b = _mm512_set1_ps(bias[i]);
    __m512 p[NV];
    for (int v = 0; v < NV; ++v) {
      const auto mk = static_cast<__mmask16>((vis[i][v / 2] >> (16 * (v % 2))) & 0xFFFFu);
      p[v] = exp2_masked(mk, _mm512_fmadd_ps(_mm512_loadu_ps(s + i * BKA + 16 * v), c, b));
    }
    for (int v = 0; v < NV; v += 2)
      _mm512_storeu_si512(po + 16 * v, (__m512i)_mm512_cvtne2ps_pbh(p[v + 1], p[v]));
    for (int w = NV / 2; w >= 1; w /= 2)  // pairwise: ((p0 + p4) + (p2 + p6)) + ... , one fixed tree
      for (int v = 0; v < w; ++v) p[v] = _mm512_add_ps(p[v], p[v + w]);
    rows[i] = p[0];
  }
  const __m512 sum = reduce_rows16(rows, [](__m512 a, __m512 b) { return _mm512_add_ps(a, b); });
  alignas(64) float al[16];
  std::memcpy(al, alpha, sizeof(al));
  // l = l * alpha + sum, fused (one rounding): written out, not left to the compiler's contraction of `l * alpha + s`
  _mm512_mask_storeu_ps(l, active, _mm512_fmadd_ps(_mm512_maskz_loadu_ps(active, l), _mm512_load_ps(al), sum));
  _mm512_mask_storeu_ps(m, active, m_new);
}

// One block's key and value rows by lane (nullptr where empty) and its present lanes, one word per 32 lanes.
// `in_order`: the keys are stored in position order (order[i] == i), so a block of consecutive positions
// takes its rows by address arithmetic instead of one lookup per key (the same rows either way).
template <typename BFT, int NB = BKA>
inline void block_rows(const BFT* k, const BFT* v, int64_t k_row, int64_t v_row, const int64_t* order,
                       const int64_t* pos, const Block& blk, int64_t base, bool in_order, const BFT** krow,
                       const BFT** vrow, uint32_t* present) {
  constexpr int WORDS = NB / 32;
  if (in_order && blk.max_pos - blk.min_pos == blk.count - 1) {  // lanes [lane0, end) in order; only the rest cleared
    const int64_t lane0 = blk.min_pos - base, end = lane0 + blk.count;
    const BFT* kr = k + blk.first * k_row;
    const BFT* vr = v + blk.first * v_row;
    std::fill(krow, krow + lane0, nullptr);
    std::fill(vrow, vrow + lane0, nullptr);
    std::fill(krow + end, krow + NB, nullptr);
    std::fill(vrow + end, vrow + NB, nullptr);
    for (int64_t i = 0; i < blk.count; ++i) {
      krow[lane0 + i] = kr + i * k_row;
      vrow[lane0 + i] = vr + i * v_row;
    }
    for (int w = 0; w < WORDS; ++w) {  // bits [lane0, end) of word w
      const int64_t lo = std::clamp<int64_t>(lane0 - 32 * w, 0, 32), hi = std::clamp<int64_t>(end - 32 * w, 0, 32);
      const uint64_t upto_hi = (uint64_t{1} << hi) - 1, upto_lo = (uint64_t{1} << lo) - 1;
      present[w] = static_cast<uint32_t>(upto_hi & ~upto_lo);
    }
    return;
  }
  std::fill(krow, krow + NB, nullptr);
  std::fill(vrow, vrow + NB, nullptr);
  std::fill(present, present + WORDS, 0u);
  for (int64_t i = 0; i < blk.count; ++i) {
    const int64_t j = order[blk.first + i], lane = pos[blk.first + i] - base;
    present[lane / 32] |= 1u << (lane % 32);
    krow[lane] = k + j * k_row;
    vrow[lane] = v + j * v_row;
  }
}

// Keys of a block as K^T in pairs, kt2 (D/2, NB) of (k[lane][2p], k[lane][2p+1]) at [p][lane], zero lanes where
// empty: 16 x 16 transposes of 32-bit pairs read straight from the key rows (transpose16's shuffles).
// `pf` (optional): NB rows, `pf_row` bytes apart, to ask the cache for, spread over the transposes (timing only).
// Flattened: with transpose16_regs called, its 16 registers went through the stack (results/engine/transpose_inline_ab).
template <int D, int NB = BKA>
__attribute__((flatten)) inline void stage_keys(const c10::BFloat16* const* krow, uint32_t* kt2,
                                                const char* pf = nullptr, int64_t pf_row = 0) {
  constexpr int LINES = D * 2 / 64, STEPS = NB / 16 * (D / 32), PER = NB / STEPS;  // rows asked for per transpose
  for (int g = 0; g < NB / 16; ++g) {
    bool empty = pf == nullptr;  // 16 empty lanes (a sparse block): zeros, as the transposes would give
    for (int l = 0; l < 16 && empty; ++l) empty = krow[g * 16 + l] == nullptr;
    if (empty) {
      for (int p = 0; p < D / 2; ++p) _mm512_storeu_si512(kt2 + p * NB + g * 16, _mm512_setzero_si512());
      continue;
    }
    for (int p0 = 0; p0 < D / 2; p0 += 16) {
      if (pf != nullptr) {
        const int step = g * (D / 32) + p0 / 16;
        for (int i = step * PER; i < (step + 1) * PER; ++i)
          for (int c = 0; c < LINES; ++c) _mm_prefetch(pf + i * pf_row + 64 * c, _MM_HINT_T1);
      }
      __m512 r[16];  // 16 keys' 32-bit pairs p0..p0+15 as rows, transposed to pairs as rows
      for (int l = 0; l < 16; ++l) {
        const c10::BFloat16* kr = krow[g * 16 + l];
        r[l] = kr != nullptr ? _mm512_castsi512_ps(_mm512_loadu_si512(kr + 2 * p0)) : _mm512_setzero_ps();
      }
      transpose16_regs(r);
      float* out = reinterpret_cast<float*>(kt2) + p0 * NB + g * 16;  // row p of the tile: out + p * NB
      for (int c = 0; c < 16; ++c) _mm512_storeu_ps(out + NB * c, r[c]);
    }
  }
}

// The same work item on AMX tiles (bf16), blocks of NB positions: scores S = Q . K^T of a 16-row tile, one
// tdpbf16ps per 32 dims from a zeroed tile (Q rows in place as A, the block's keys staged once as K^T in pairs as
// B); p . V of a block as P . V, four tdpbf16ps (32 keys each, in order) from a zeroed tile, then
// acc = alpha * acc + that in fp32. Each element's sequence depends only on its own query row, so a decode row
// (in a 16-row tile with zero rows) and a prompt row compute alike. Fewer than 16 rows (decode: a KV head's query
// heads) run on tiles as narrow as the rows (the A and C tiles; kakeya_amx::configure(R)): each row's elements are
// computed by the same tile instructions, so the bits are the same, at a fraction of the tile work.
template <int D, int NB = BKA>
void attend_superblock_amx(const c10::BFloat16* q, const c10::BFloat16* k, const c10::BFloat16* v, int64_t k_row,
                           int64_t v_row, int64_t R, const Rule& rule, const int64_t* order, const int64_t* pos,
                           const Block* blocks, int64_t nblocks, float scale, Partial st, bool in_order = false,
                           bool packed = false, const Ahead& next_k = Ahead{}, const Ahead& next_v = Ahead{},
                           bool decode_tiles_set = false) {
  using BF = c10::BFloat16;
  static_assert(D % 32 == 0, "AMX path needs head_dim a multiple of 32");
  constexpr int KT = NB / 16;  // key tiles per block
  constexpr int WORDS = NB / 32;
  std::fill(st.acc, st.acc + R * D, 0.f);
  std::fill(st.m, st.m + R, NEG_INF);
  std::fill(st.l, st.l + R, 0.f);
  std::fill(st.n, st.n + R, 0.f);
  const int64_t RB = (R + 15) / 16;  // 16-row tiles
  const bool narrow = R < 16;
  if (narrow && !decode_tiles_set) kakeya_amx::configure_decode(static_cast<int>(R));
  // Q rows as A tiles: in place, but the last tile of a row count that is not a multiple of 16 is padded with zeros.
  const int64_t full_rows = R / 16 * 16;
  // Staging buffers from per-thread scratch (slots 0-5 of their types; one item runs at a time on a thread).
  BF* const qtail = scratch<BF>(0, 16 * D);
  if (!narrow) {
    std::memset(qtail, 0, 16 * D * sizeof(BF));
    if (full_rows < R) std::memcpy(qtail, q + full_rows * D, (R - full_rows) * D * sizeof(BF));
  }
  // Fewer than 16 rows (decode) take the scores as K . Q^T: the keys as A tiles straight from the cache (16 rows a
  // tile, k_row apart), Q^T in pairs as B, [pair][row]. A tile product computes each element from its own pairs in the
  // same sequence whichever operand holds them (measured: 9.6M elements, normal, wide-range and subnormal values, no
  // bit differs), so the scores are the staged path's bits, without staging each block's keys every step.
  uint32_t* const qt2 = scratch<uint32_t>(2, D / 2 * 16);  // Q^T in pairs: [pair][row]
  float* const ct = scratch<float>(3, NB * 16);             // scores as the tiles give them: [lane][row], 16 apart
  BF* const ka = scratch<BF>(2, 16 * D);                    // a key tile that is not 16 rows in order: its rows copied
  if (narrow)
    for (int64_t r = 0; r < R; ++r)
      for (int p = 0; p < D / 2; ++p)
        qt2[p * R + r] = static_cast<uint32_t>(q[r * D + 2 * p].x) | static_cast<uint32_t>(q[r * D + 2 * p + 1].x) << 16;
  // The first query position of each row tile: a block wholly at or below it is seen whole by every row there
  // (no window, plain keys), with no per-row masks to build.
  int64_t* const tile_min = scratch<int64_t>(0, RB);  // (a heap call per item measured on decode rows)
  for (int64_t rb = 0; rb < RB; ++rb) {
    int64_t mn = std::numeric_limits<int64_t>::max();
    for (int64_t r = rb * 16; r < std::min<int64_t>(R, rb * 16 + 16); ++r) mn = std::min(mn, rule.q_pos[rule.token(r)]);
    tile_min[rb] = mn;
  }
  const bool plain = rule.kind == Kind::Plain && rule.window <= 0;
  // Blocks are staged one ahead: a block's K^T and V are written while the previous block's tiles run, so the
  // tile loads do not wait on the stores that staged them. A row tile's P . V runs after the next row tile's
  // scores and softmax (possibly the next block's), so its P tile loads do not wait on the softmax's stores
  // either; V is kept for three blocks for that. Data movement and schedule only: each row's m, l and acc are
  // updated block by block in the same order.
  constexpr int NBUF = 3;
  uint32_t* const kt2s = scratch<uint32_t>(0, NBUF * D / 2 * NB);  // K^T in pairs: [pair][lane], zero lanes where empty
  uint32_t* const vt2s = scratch<uint32_t>(1, NBUF * NB / 2 * D);  // values interleaved by lane pairs
  float* const sb = scratch<float>(0, 16 * NB);                    // S of a row tile: [row][lane]
  BF* const pbs = scratch<BF>(1, 2 * 16 * NB);  // P of a row tile, bf16, (16 rows, NB lanes); two
  float* const ob = scratch<float>(1, 16 * D);   // P . V of a row tile, (16 rows, D)
  const BF* krows[NBUF][NB];
  const BF* vrows[NBUF][NB];
  uint32_t presents[NBUF][WORDS];
  float alphas[2][16];
  uint32_t vis[16][WORDS];
  // The row tile whose P . V is still to run: its P buffer, V and rows (its alphas in alphas[buf]).
  struct PendingPV {
    bool on = false;
    int buf = 0;
    const uint32_t* vt2 = nullptr;
    int64_t r0 = 0, rn = 0;
    int64_t block = 0;  // its V lives in staging buffer block % NBUF
  } pending;
  int buf = 0;  // the P buffer the next row tile's softmax writes
  auto run_pv = [&](const PendingPV& pv) {
    const BF* pb = pbs + pv.buf * (16 * NB);
    const uint32_t* vt2 = pv.vt2;
    const float* alpha = alphas[pv.buf];
    const int64_t rn = pv.rn;
    float* const acc0 = st.acc + pv.r0 * D;
    for (int d0 = 0; d0 < D && narrow; d0 += 32) {  // the decode layout: two 16-dim output tiles at a time
      _tile_zero(0);
      _tile_zero(1);
      for (int c = 0; c < NB / 32; ++c) {  // 32 keys (16 pairs) per step, in order
        _tile_loadd(4, pb + c * 32, NB * 2);
        const uint32_t* vb = vt2 + c * 16 * D + d0;
        _tile_loadd(6, vb, D * 4);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, vb + 16, D * 4);
        _tile_dpbf16ps(1, 4, 7);
      }
      _tile_stored(0, ob + d0, D * 4);
      _tile_stored(1, ob + d0 + 16, D * 4);
    }
    for (int d0 = 0; d0 < D && !narrow; d0 += 64) {  // up to four 16-dim output tiles at a time
      const int nt = std::min(4, (D - d0) / 16);
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int c = 0; c < NB / 32; ++c) {  // 32 keys (16 pairs) per step, in order
        _tile_loadd(4, pb + c * 32, NB * 2);
        const uint32_t* vb = vt2 + c * 16 * D + d0;
        _tile_loadd(6, vb, D * 4);
        _tile_dpbf16ps(0, 4, 6);
        if (nt > 1) {
          _tile_loadd(7, vb + 16, D * 4);
          _tile_dpbf16ps(1, 4, 7);
        }
        if (nt > 2) {
          _tile_loadd(6, vb + 32, D * 4);
          _tile_dpbf16ps(2, 4, 6);
        }
        if (nt > 3) {
          _tile_loadd(7, vb + 48, D * 4);
          _tile_dpbf16ps(3, 4, 7);
        }
      }
      _tile_stored(0, ob + d0, D * 4);
      if (nt > 1) _tile_stored(1, ob + d0 + 16, D * 4);
      if (nt > 2) _tile_stored(2, ob + d0 + 32, D * 4);
      if (nt > 3) _tile_stored(3, ob + d0 + 48, D * 4);
    }
    for (int64_t i = 0; i < rn; ++i) {
      if (alpha[i] < 0.f) continue;
      float* acc = acc0 + i * D;
      for (int d = 0; d < D; d += VS)
        (Vec::loadu(acc + d) * Vec(alpha[i]) + Vec::loadu(ob + i * D + d)).store(acc + d);
    }
  };
  auto stage = [&](int64_t bi) {
    const int64_t sb_i = bi % NBUF;
    // In order: ask for the next NB stored rows (next block, or the next superblock's first), spread over the
    // staging work (timing only; prefetches never fault, past the end of the cache too).
    // Packed blocks (a ColdSource's, NB rows stored together): a later block's rows.
    const char* kpf = nullptr;
    const char* vpf = nullptr;
    if (in_order) {
      kpf = reinterpret_cast<const char*>(k + (blocks[bi].first + NB) * k_row);
      vpf = reinterpret_cast<const char*>(v + (blocks[bi].first + NB) * v_row);
    } else if (packed && bi + 2 < nblocks) {  // two blocks ahead: scattered blocks come from memory
      kpf = reinterpret_cast<const char*>(k + order[blocks[bi + 2].first] * k_row);
      vpf = reinterpret_cast<const char*>(v + order[blocks[bi + 2].first] * v_row);
    }
    // The item's last block: the caller's next item's first keys instead (its first block would otherwise wait on
    // memory with nothing to overlap it: ~1-2 us an item, measured on decode rows of a few hundred keys).
    const bool hand_on = bi + 1 == nblocks && next_k.count > 0;
    if (hand_on) kpf = vpf = nullptr;
    block_rows<BF, NB>(k, v, k_row, v_row, order, pos, blocks[bi], blocks[bi].min_pos / NB * NB, in_order,
                   krows[sb_i], vrows[sb_i], presents[sb_i]);
    if (hand_on)
      for (int64_t i = 0; i < next_k.count; ++i) next_k.ask(i);
    if (!narrow) {
      stage_keys<D, NB>(krows[sb_i], kt2s + sb_i * (D / 2 * NB), kpf, k_row * 2);
    } else if (kpf != nullptr) {  // the keys are read in place: ask for the next ones
      for (int i = 0; i < NB; ++i)
        for (int c = 0; c < D * 2 / 64; ++c) _mm_prefetch(kpf + i * k_row * 2 + 64 * c, _MM_HINT_T1);
    }
    interleave_values<D, NB>(vrows[sb_i], vt2s + sb_i * (NB / 2 * D),
                             hand_on ? next_v : vpf != nullptr ? Ahead{vpf, v_row * 2, D * 2, nullptr, NB} : Ahead{});
  };
  if (packed && nblocks > 1)  // the second block's rows (stage(0) asks for the third)
    for (int64_t i = 0; i < blocks[1].count; ++i)
      for (int c = 0; c < D * 2 / 64; ++c) {
        _mm_prefetch(reinterpret_cast<const char*>(k + order[blocks[1].first + i] * k_row) + 64 * c, _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(v + order[blocks[1].first + i] * v_row) + 64 * c, _MM_HINT_T1);
      }
  if (nblocks > 0) stage(0);
  for (int64_t bi = 0; bi < nblocks; ++bi) {
    if (pending.on && pending.block + 1 < bi) {  // staging block bi + 1 reuses its V buffer: run it first
      run_pv(pending);
      pending.on = false;
    }
    if (bi + 1 < nblocks) stage(bi + 1);
    const Block& blk = blocks[bi];
    const int64_t base = blk.min_pos / NB * NB;
    const uint32_t* present = presents[bi % NBUF];
    const uint32_t* kt2 = kt2s + (bi % NBUF) * (D / 2 * NB);
    const uint32_t* vt2 = vt2s + (bi % NBUF) * (NB / 2 * D);
    for (int64_t rb = 0; rb < RB; ++rb) {
      const int64_t r0 = rb * 16, rn = std::min<int64_t>(16, R - r0);
      uint32_t any = 0u;
      if (plain && tile_min[rb] >= blk.max_pos) {
        for (int64_t i = 0; i < 16; ++i)
          for (int w = 0; w < WORDS; ++w) any |= vis[i][w] = i < rn ? present[w] : 0u;
      } else {
        for (int64_t i = 0; i < 16; ++i)
          for (int w = 0; w < WORDS; ++w)
            any |= vis[i][w] = i < rn ? rule.lanes(rule.token(r0 + i), base + 32 * w, present[w]) : 0u;
      }
      if (any == 0u) continue;
      const BF* qa = rn == 16 ? q + r0 * D : qtail;
      if (narrow) {
        const BF* const* kr = krows[bi % NBUF];
        for (int g = 0; g < KT; ++g) {
          const BF* const* gk = kr + g * 16;
          bool in_place = gk[0] != nullptr;
          for (int l = 1; l < 16 && in_place; ++l) in_place = gk[l] == gk[0] + l * k_row;
          const BF* a = gk[0];
          int64_t a_stride = k_row * 2;
          if (!in_place) {  // a partial or scattered tile: its rows (zero rows where empty), as staging gave them
            for (int l = 0; l < 16; ++l) {
              if (gk[l] != nullptr) std::memcpy(ka + l * D, gk[l], D * sizeof(BF));
              else std::memset(ka + l * D, 0, D * sizeof(BF));
            }
            a = ka;
            a_stride = D * 2;
          }
          _tile_zero(2);
          for (int sd = 0; sd < D / 32; ++sd) {
            _tile_loadd(5, a + sd * 32, a_stride);
            _tile_loadd(3, qt2 + sd * 16 * R, 4 * R);
            _tile_dpbf16ps(2, 5, 3);
          }
          _tile_stored(2, ct + g * 256, 64);
        }
        const __m512i lanes = _mm512_set_epi32(240, 224, 208, 192, 176, 160, 144, 128, 112, 96, 80, 64, 48, 32, 16, 0);
        for (int64_t r = 0; r < R; ++r)  // [lane][row] -> [row][lane]
          for (int g = 0; g < KT; ++g)
            _mm512_storeu_ps(sb + r * NB + g * 16, _mm512_i32gather_ps(lanes, ct + g * 256 + r, 4));
      }
      for (int pass = 0; pass < (KT + 3) / 4 && !narrow; ++pass) {  // up to four key tiles at a time in C tiles 0-3
        constexpr int NT4 = KT < 4 ? KT : 4;  // key tiles per pass (NB = 32: two)
        _tile_zero(0);
        _tile_zero(1);
        if constexpr (NT4 > 2) {
          _tile_zero(2);
          _tile_zero(3);
        }
        const uint32_t* kp = kt2 + pass * 64;
        for (int sd = 0; sd < D / 32; ++sd) {
          _tile_loadd(4, qa + sd * 32, D * 2);
          const uint32_t* kb2 = kp + sd * 16 * NB;
          _tile_loadd(6, kb2, NB * 4);
          _tile_dpbf16ps(0, 4, 6);
          _tile_loadd(7, kb2 + 16, NB * 4);
          _tile_dpbf16ps(1, 4, 7);
          if constexpr (NT4 > 2) {
            _tile_loadd(6, kb2 + 32, NB * 4);
            _tile_dpbf16ps(2, 4, 6);
            _tile_loadd(7, kb2 + 48, NB * 4);
            _tile_dpbf16ps(3, 4, 7);
          }
        }
        float* out = sb + pass * 64;
        _tile_stored(0, out, NB * 4);
        _tile_stored(1, out + 16, NB * 4);
        if constexpr (NT4 > 2) {
          _tile_stored(2, out + 32, NB * 4);
          _tile_stored(3, out + 48, NB * 4);
        }
      }
      float* const alpha = alphas[buf];
      BF* const pb = pbs + buf * (16 * NB);
      bool tiled = false;  // the tile's 16 rows together (BKA blocks, scale > 0); the same bits per row as below
      if constexpr (NB == BKA) {
        if (scale > 0.f) {  // rows rn.. of a short tile see nothing (vis 0): their m, l, n stay as they are
          tile_softmax_bf16(sb, vis, scale, st.m + r0, st.l + r0, st.n + r0, pb, alpha, narrow ? static_cast<int>(R) : 16);
          tiled = true;
        }
      }
      for (int64_t i = 0; i < 16 && !tiled; ++i) {
        alpha[i] = -1.f;
        float* s = sb + i * NB;
        uint32_t row_any = 0u;
        int seen = 0;
        for (int w = 0; w < WORDS; ++w) {
          row_any |= vis[i][w];
          seen += __builtin_popcount(vis[i][w]);
        }
        if (row_any != 0u) {
          st.n[r0 + i] += static_cast<float>(seen);
          if (scale > 0.f) {
            alpha[i] = group_softmax_bf16<NB>(s, vis[i], scale, st.m[r0 + i], st.l[r0 + i], pb + i * NB);
          } else {
            alpha[i] = group_softmax<NB>(s, vis[i], scale, st.m[r0 + i], st.l[r0 + i]);
            for (int j = 0; j < NB; j += 32)  // p rounded to bf16, nearest even
              _mm512_storeu_si512(pb + i * NB + j, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(s + j + 16),
                                                                                      _mm512_loadu_ps(s + j)));
          }
        } else {
          std::memset(pb + i * NB, 0, NB * sizeof(BF));  // 0 for rows with nothing here
        }
      }
      if (pending.on) run_pv(pending);
      pending = PendingPV{true, buf, vt2, r0, rn, bi};
      buf ^= 1;
    }
  }
  if (pending.on) run_pv(pending);
  if (narrow && !decode_tiles_set) kakeya_amx::configure();  // the callers' 16-row tiles again
}
#endif

#if defined(KAKEYA_AMX)
constexpr int COLD_AMX_BLOCK = 32;  // ColdSource's blocks: one word of lanes (a cold block of 32 fills one)
#else
constexpr int COLD_AMX_BLOCK = BK;
#endif

// One key source of a call: K/V (B, Hk, S, D) with their positions, cut into blocks and superblocks.
struct Source {
  const at::Tensor* k;
  const at::Tensor* v;
  Kind kind;
  std::vector<int64_t> order;        // keys in position order
  std::vector<int64_t> pos;          // their positions, in that order
  std::vector<Block> blocks;
  std::vector<int64_t> super_first;  // index of each superblock's first block, plus an end marker
  bool in_order = false;             // keys stored in position order (order is the identity)

  Source() = default;
  // The first `S` keys of k_ / v_ / k_pos (all of them when S < 0).
  Source(const at::Tensor& k_, const at::Tensor& v_, const at::Tensor& k_pos, Kind kind_, int64_t bk,
         int64_t S = -1) {
    build(k_, v_, k_pos, kind_, bk, S);
  }

  // (Re)builds this source in place, keeping its buffers (a decode step's rows reuse them: row_sources).
  void build(const at::Tensor& k_, const at::Tensor& v_, const at::Tensor& k_pos, Kind kind_, int64_t bk,
             int64_t S = -1) {
    k = &k_, v = &v_, kind = kind_;
    blocks.clear();
    super_first.clear();
    const int64_t* kp = k_pos.const_data_ptr<int64_t>();
    if (S < 0) S = k_.size(2);
    order.resize(S);
    std::iota(order.begin(), order.end(), 0);
    // A cache hands keys sorted, or as two sorted runs (a ring that wrapped): then a linear merge, not a sort.
    int64_t descents = 0, cut = 0;
    for (int64_t j = 1; j < S && descents < 2; ++j)
      if (kp[j] <= kp[j - 1]) ++descents, cut = j;
    const auto by_pos = [kp](int64_t a, int64_t b) { return kp[a] < kp[b]; };
    if (descents == 1) {  // std::inplace_merge's order, through the thread's kept buffer (it took a heap buffer)
      thread_local std::vector<int64_t> merged;
      merged.resize(S);
      std::merge(order.begin(), order.begin() + cut, order.begin() + cut, order.end(), merged.begin(), by_pos);
      std::copy(merged.begin(), merged.end(), order.begin());
      release_if_large(merged);
    }
    if (descents > 1) std::sort(order.begin(), order.end(), by_pos);
    in_order = descents == 0;
    pos.resize(S);
    if (in_order && S > 0 && SPLIT % bk == 0 && kp[0] >= 0 && kp[S - 1] - kp[0] == S - 1) {
      // Consecutive positions (a cache's usual keys): the same blocks and superblocks as the loop below gives,
      // cut by arithmetic at the multiples of bk and SPLIT instead of key by key (a decode step builds one Source
      // per row and layer).
      std::copy(kp, kp + S, pos.begin());
      const int64_t p0 = kp[0], p_end = kp[0] + S;
      int64_t super_end = -1;
      for (int64_t p = p0; p < p_end;) {
        if (p >= super_end) {
          super_first.push_back(blocks.size());
          super_end = (p / SPLIT + 1) * SPLIT;
        }
        const int64_t end = std::min(p_end, (p / bk + 1) * bk);
        blocks.push_back(Block{p - p0, end - p, p, end - 1});
        p = end;
      }
      super_first.push_back(blocks.size());
      return;
    }
    // The open block's end position and its superblock's (a new block starts at the first key past block_end).
    int64_t block_end = -1, super_end = -1;
    for (int64_t i = 0; i < S; ++i) {
      const int64_t p = pos[i] = kp[order[i]];
      TORCH_CHECK(p >= 0, "cached_attention: negative key position");
      TORCH_CHECK(i == 0 || p != pos[i - 1], "cached_attention: key position ", p, " given twice");
      if (p >= block_end) {  // positions increase: p / bk differs from the open block's
        if (p >= super_end) {
          super_first.push_back(blocks.size());
          super_end = (p / SPLIT + 1) * SPLIT;
        }
        blocks.push_back(Block{i, 0, p, p});
        block_end = (p / bk + 1) * bk;
      }
      blocks.back().count += 1;
      blocks.back().max_pos = p;
    }
    super_first.push_back(blocks.size());
  }
  int64_t supers() const { return static_cast<int64_t>(super_first.size()) - 1; }
  // A kept source lets a long prompt's buffers go after its call (common.h's release_if_large).
  void release_buffers() {
    release_if_large(order), release_if_large(pos), release_if_large(blocks), release_if_large(super_first);
  }
};

// The cold side of a sparse call: decoded blocks of `block` positions stacked in K/V (B, Hc, U * block, D) for
// the KV heads that have a cold tier (head[h]: KV head h's index there, -1: none),
// slot[j] the place in K/V of cold block j (positions sink + j * block ...; -1: not provided), and each token's
// selection bitsets (B, Hk, T, words). Only blocks wholly below a token's hot range count (n(t) of them).
//
// Without AMX (ColdSource below otherwise), a token's selected blocks, in position order, are packed into lanes of
// their own: superchunks of SPLIT lanes (the work items), cut into blocks of BK lanes. So its cold keys are grouped and reduced by one fixed
// sequence that depends on its own selection only, never on what other tokens of the call selected, and no
// lane is spent on a block it did not select.
struct Cold {
  const at::Tensor* k = nullptr;  // in q's dtype, or int8 codes with one fp16 scale per row (k_scale, v_scale)
  const at::Tensor* v = nullptr;
  const at::Tensor* k_scale = nullptr;
  const at::Tensor* v_scale = nullptr;
  const int64_t* slot = nullptr;  // (N,) one map for every head, or (Hc, N) one per cold head
  const int64_t* head = nullptr;  // (Hk,): each KV head's index in K/V's head dim, -1: no cold tier
  int64_t nslot = 0, block = 0;
  const uint64_t* sel = nullptr;
  int64_t words = 0;
  int64_t slot_stride = 0;  // between cold heads' maps: 0 (shared) or N

  int64_t blocks_below(int64_t qp, int64_t window, int64_t sink) const {
    return std::max<int64_t>(0, qp + 1 - window - sink) / block;
  }
  // Where cold head h holds block j (-1: not provided).
  int64_t slot_of(int64_t h, int64_t j) const { return slot[h * slot_stride + j]; }
  // The K/V rows of token t's cold lanes [first, first + count) for cold head h, in lane order, into `rows`.
  void lanes(const uint64_t* row, int64_t n, int64_t h, int64_t first, int64_t count,
             std::vector<int64_t>& rows) const {
    rows.clear();
    int64_t lane = 0;
    for (int64_t w = 0; w * 64 < n && static_cast<int64_t>(rows.size()) < count; ++w) {
      for (uint64_t bits = row[w]; bits != 0u; bits &= bits - 1) {
        const int64_t j = w * 64 + __builtin_ctzll(bits);
        if (j >= n) break;
        const int64_t lo = std::max<int64_t>(first - lane, 0), hi = std::min<int64_t>(first + count - lane, block);
        for (int64_t i = lo; i < hi; ++i) rows.push_back(slot_of(h, j) * block + i);
        lane += block;
        if (lane >= first + count) break;
      }
    }
  }
};

// Cold positions per superblock of a ColdSource: a token's selected blocks lie scattered over the history, so
// superblocks span more positions than a Source's (fewer work items and partial states, each still fixed by
// absolute positions).
constexpr int64_t COLD_SPLIT = 4 * SPLIT;

// Keys at increasing positions `pos` cut into blocks of `bk` positions (a new block at the first key past the open
// one's end) and superblocks of `split` positions; super_first gets each superblock's first block and an end marker.
inline void cut_blocks(const std::vector<int64_t>& pos, int64_t bk, int64_t split, std::vector<Block>& blocks,
                       std::vector<int64_t>& super_first) {
  int64_t block_end = -1, super_end = -1;
  for (int64_t i = 0; i < static_cast<int64_t>(pos.size()); ++i) {
    const int64_t p = pos[i];
    if (p >= block_end) {
      if (p >= super_end) {
        super_first.push_back(blocks.size());
        super_end = (p / split + 1) * split;
      }
      blocks.push_back(Block{i, 0, p, p});
      block_end = (p / bk + 1) * bk;
    }
    blocks.back().count += 1;
    blocks.back().max_pos = p;
  }
  super_first.push_back(blocks.size());
}

// The cold side of a sparse call on AMX tiles, for one KV head and one row tile: the blocks that any token of the
// tile selected (in any batch row), their keys at cold positions c = j * block + i (counted from `sink`, so
// absolute), cut into blocks of COLD_AMX_BLOCK and superblocks of COLD_SPLIT positions like a Source, with rows from every token
// of the tile in one 16-row tile. A token sees the blocks it selected only (Kind::Cold), so what each of its rows
// computes follows from its own selection: the lanes other tokens add are masked (p = 0, an exact 0 product in
// P . V), a block or superblock the row sees nothing of leaves its state as it was (skipped), and the blocks it
// sees sit at the same lanes of the same blocks and superblocks whichever tokens share the call. A decode step
// (its own selection alone) takes this same path, so a token's bits do not depend on the step it ran in.
struct ColdSource {
  std::vector<int64_t> order;  // rows of the head's cold K/V, in position order
  std::vector<int64_t> pos;    // their cold positions
  std::vector<Block> blocks;
  std::vector<int64_t> super_first;
  std::vector<char> picked;    // per cold block: selected by some token of the tile
  int64_t supers() const { return static_cast<int64_t>(super_first.size()) - 1; }

  // Refills this source (its buffers keep their capacity: a decode step's sources cost no heap call).
  void build(const Cold& cold, int64_t B, int64_t H, int64_t NT, int64_t h, int64_t t0, int64_t tn,
             const int64_t* below, int64_t bk) {
    order.clear();
    pos.clear();
    blocks.clear();
    super_first.clear();
    const int64_t ch = cold.head[h];
    if (ch >= 0) {
      const int64_t most = *std::max_element(below, below + tn);
      picked.assign(most, 0);
      for (int64_t b = 0; b < B; ++b)
        for (int64_t t = 0; t < tn; ++t) {
          const uint64_t* row = cold.sel + ((b * H + h) * NT + t0 + t) * cold.words;
          for (int64_t w = 0; w * 64 < below[t]; ++w)
            for (uint64_t bits = row[w]; bits != 0u; bits &= bits - 1) {
              const int64_t j = w * 64 + __builtin_ctzll(bits);
              if (j >= below[t]) break;
              picked[j] = 1;
            }
        }
      const int64_t lanes = std::count(picked.begin(), picked.end(), 1) * cold.block;
      order.resize(lanes);
      pos.resize(lanes);
      int64_t i0 = 0;
      for (int64_t j = 0; j < most; ++j) {
        if (!picked[j]) continue;
        const int64_t s = cold.slot_of(ch, j) * cold.block, p0 = j * cold.block;
        for (int64_t i = 0; i < cold.block; ++i) {
          order[i0 + i] = s + i;
          pos[i0 + i] = p0 + i;
        }
        i0 += cold.block;
      }
    }
    if (cold.block % bk != 0) {
      cut_blocks(pos, bk, COLD_SPLIT, blocks, super_first);
      return;
    }
    // Whole cold blocks of a multiple of bk positions, each starting at a multiple of bk: every run of bk lanes is
    // one block (what cut_blocks gives, without its walk over every lane).
    int64_t super_end = -1;
    for (int64_t i = 0; i < static_cast<int64_t>(pos.size()); i += bk) {
      const int64_t p = pos[i];
      if (p >= super_end) {
        super_first.push_back(blocks.size());
        super_end = (p / COLD_SPLIT + 1) * COLD_SPLIT;
      }
      blocks.push_back(Block{i, bk, p, p + bk - 1});
    }
    super_first.push_back(blocks.size());
  }
};

// The calling thread's ColdSources, kept across calls (a reference to them is what work items on other threads read:
// a thread_local named inside a lambda would be the running thread's own).
inline std::vector<ColdSource>& thread_cold_sources() {
  thread_local std::vector<ColdSource> sources;
  return sources;
}

// K/V rows of int8 codes, each times its fp16 scale in fp32 and rounded once to T, into dst (rows.size(), D).
template <typename T, int D>
void dequantize_rows(const at::Tensor& code, const at::Tensor& scale, int64_t b, int64_t h,
                     const std::vector<int64_t>& rows, T* dst) {
  const int8_t* c = code.const_data_ptr<int8_t>() + b * code.stride(0) + h * code.stride(1);
  const at::Half* s = scale.const_data_ptr<at::Half>() + b * scale.stride(0) + h * scale.stride(1);
  // the row strides read once (TensorBase::stride is a call: it took ~10% of this loop's time in a decode step)
  const int64_t c_row = code.stride(2), s_row = scale.stride(2), n = static_cast<int64_t>(rows.size());
  constexpr int64_t kAhead = 16;  // rows asked for ahead: a cold block's codes come from memory
  alignas(64) float row[D];
  for (int64_t i = 0; i < n; ++i) {
    if (i + kAhead < n) {
#if defined(__x86_64__)
      _mm_prefetch(reinterpret_cast<const char*>(c + rows[i + kAhead] * c_row), _MM_HINT_T0);
#endif
    }
    const int8_t* src = c + rows[i] * c_row;
#if defined(__F16C__)
    const float sc = _cvtsh_ss(s[rows[i] * s_row].x);  // exact, as the scalar conversion
#else
    const float sc = static_cast<float>(s[rows[i] * s_row]);
#endif
#if defined(__AVX512F__)
    if constexpr (D % 16 == 0) {
      const __m512 scv = _mm512_set1_ps(sc);
      for (int d = 0; d < D; d += 16) {
        const __m512 x = _mm512_mul_ps(
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + d)))),
            scv);
#if defined(__AVX512BF16__)
        if constexpr (std::is_same_v<T, c10::BFloat16>) {
          // nearest even, as at::vec::convert; a code times an fp16 scale is never an fp32 denormal
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i * D + d), (__m256i)_mm512_cvtneps_pbh(x));
          continue;
        }
#endif
        _mm512_store_ps(row + d, x);
      }
      if constexpr (kBf16Dot && std::is_same_v<T, c10::BFloat16>) continue;
    } else
#endif
      for (int d = 0; d < D; ++d) row[d] = static_cast<float>(src[d]) * sc;
    if constexpr (std::is_same_v<T, float>) {
      std::copy(row, row + D, dst + i * D);
    } else {
      at::vec::convert(row, dst + i * D, D);
    }
  }
}

inline int64_t popcount_below(const uint64_t* row, int64_t n) {
  int64_t c = 0;
  for (int64_t w = 0; w * 64 < n; ++w) {
    const int64_t left = n - w * 64;
    c += __builtin_popcountll(left >= 64 ? row[w] : row[w] & ((1ull << left) - 1));
  }
  return c;
}

// The order in which a call's work items are handed out: hot items (`splits` per (batch, head, superblock), a row
// slice each) by their estimated cost (visible (row, key) pairs), largest first, then the cold items in order.
// Threads take the next item when they finish one, so the short items (a chunk's diagonal superblock) fill in at
// the end instead of a fixed split leaving one thread idle. Only the schedule changes: each item computes its own
// partial state, merged per row in a fixed order after.
inline void item_schedule(const std::vector<Source>& sources, const std::vector<std::pair<int64_t, int64_t>>& supers,
                          int64_t BH, const int64_t* qpos, int64_t tn, int64_t items, int64_t splits,
                          std::vector<int64_t>& order) {
  const int64_t NSP = static_cast<int64_t>(supers.size()), hot_items = BH * NSP * splits;
  thread_local std::vector<int64_t> cost;  // kept: no heap call per step
  cost.assign(NSP, 0);
  for (int64_t i = 0; i < NSP; ++i) {
    const Source& src = sources[supers[i].first];
    const int64_t first = src.super_first[supers[i].second], last = src.super_first[supers[i].second + 1] - 1;
    const int64_t lo = src.blocks[first].min_pos, hi = src.blocks[last].max_pos;
    for (int64_t t = 0; t < tn; ++t) cost[i] += std::clamp<int64_t>(qpos[t] - lo + 1, 0, hi - lo + 1);
  }
  order.resize(items);
  std::iota(order.begin(), order.end(), 0);
  // stable_sort's order (ties by item) from std::sort, which takes no heap buffer
  std::sort(order.begin(), order.begin() + hot_items, [&](int64_t a, int64_t b) {
    const int64_t ca = cost[a / splits % NSP], cb = cost[b / splits % NSP];
    return ca > cb || (ca == cb && a < b);
  });
}

// Attention of q over every source (and the cold blocks, if any), one softmax: each (batch, head, source
// superblock) and each (batch, head, token, cold superchunk), or on AMX each (batch, head, ColdSource
// superblock), is a work item; a row's partial states are merged in (source, position) order, then its cold
// parts in order, against its global max. `seen` (B, Hk, R,
// 1 + has cold), when given, receives the keys each row saw per source.
template <typename T, int D>
void run(const at::Tensor& q, std::vector<Source>& sources, const at::Tensor& q_pos, int64_t window, int64_t sink,
         const Cold* cold, float scale, at::Tensor& out, int64_t* seen) {
  const int64_t B = q.size(0), H = q.size(1), R = q.size(2), NT = q_pos.size(0);
  const int64_t G = R / NT, NS = static_cast<int64_t>(sources.size()), NC = NS + (cold != nullptr);
  // AMX on CPUs that have it (bf16), for every call alike: the choice depends on the machine, never the shape.
  // Without AMX, cold work items hold one token's G rows on the dot-product path (one fixed sequence per token);
  // with it, cold_amx below.
  const bool use_amx = amx_enabled<T>() && D % 32 == 0;
  // On a machine whose attention runs on AMX the cold side shares the tiles too (ColdSource), in every call alike
  // (a decode step as a chunk); int8 codes are dequantized first, to the values they decode to.
  const bool cold_amx = use_amx && cold != nullptr;
  // The call's buffers, kept by the calling thread across calls (no heap call per step; work items on other threads
  // read them through these references).
  thread_local std::vector<std::pair<int64_t, int64_t>> kept_supers;
  thread_local std::vector<float> kept_cstate;
  thread_local std::vector<T> kept_qtile, kept_qtok, kept_cdeq;
  thread_local std::vector<int64_t> kept_nsel, kept_below, kept_cfirst, kept_cdeq_first, kept_lane_seq, kept_schedule;
  std::vector<std::pair<int64_t, int64_t>>& supers = kept_supers;  // (source, superblock) in merge order
  supers.clear();
  for (int64_t s = 0; s < NS; ++s)
    for (int64_t sp = 0; sp < sources[s].supers(); ++sp) supers.emplace_back(s, sp);
  const int64_t NSP = static_cast<int64_t>(supers.size());
  const int64_t* qpos = q_pos.const_data_ptr<int64_t>();
  static const int64_t kAll = std::numeric_limits<int64_t>::max() / 2;  // a query position that sees every lane
  // Cold lanes' own positions 0, 1, ... (their keys are all visible); built once per process.
  static const std::vector<int64_t> lane_pos = [] {
    std::vector<int64_t> v(SPLIT);
    std::iota(v.begin(), v.end(), 0);
    return v;
  }();

  const T* qp = q.const_data_ptr<T>();
  T* op = out.data_ptr<T>();
  constexpr int64_t W = D + 3;  // per row: acc (D), m, l, n
  std::vector<float>& cstate = kept_cstate;
  std::vector<T>&qtile = kept_qtile, &qtok = kept_qtok;
  std::vector<int64_t>& nsel = kept_nsel;    // (B, H, tn): cold lanes of each token
  std::vector<int64_t>& below = kept_below;  // (tn,): cold blocks wholly below each token's hot range
  std::vector<ColdSource>& csrc = thread_cold_sources();  // cold_amx: per KV head (kept, rebuilt in place)
  std::vector<int64_t>& cfirst = kept_cfirst;  // cold_amx: (B * H + 1,) the first cold item of each (batch, head)
  std::vector<T>& cdeq = kept_cdeq;  // cold_amx, int8 codes: (B * H, 2, lanes, D) the tile's cold K, V dequantized
  // where each (batch, head)'s rows start there; 0, 1, ...
  std::vector<int64_t>&cdeq_first = kept_cdeq_first, &lane_seq = kept_lane_seq, &schedule = kept_schedule;
  for (int64_t t0 = 0; t0 < NT; t0 += ROW_TILE) {
    const int64_t tn = std::min(ROW_TILE, NT - t0), Rt = G * tn;
    // This tile's rows, (B, H, G * tn, D) ordered (group, token) like q.
    qtile.resize(B * H * Rt * D);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t g = 0; g < G; ++g)
          std::memcpy(qtile.data() + ((b * H + h) * Rt + g * tn) * D,
                      qp + b * q.stride(0) + h * q.stride(1) + (g * NT + t0) * D, tn * D * sizeof(T));
    int64_t C = 0;  // cold superchunks of the token with the most
    if (cold != nullptr) {
      nsel.resize(B * H * tn);
      for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < H; ++h)
          for (int64_t t = 0; t < tn; ++t) {
            const int64_t n = cold->blocks_below(qpos[t0 + t], window, sink);
            const uint64_t* row = cold->sel + ((b * H + h) * NT + t0 + t) * cold->words;
            for (int64_t w = 0; w * 64 < n; ++w)
              for (uint64_t bits = row[w]; bits != 0u; bits &= bits - 1) {
                const int64_t j = w * 64 + __builtin_ctzll(bits);
                TORCH_CHECK(j >= n || (j < cold->nslot && cold->head[h] >= 0 && cold->slot_of(cold->head[h], j) >= 0),
                            "sparse_attention: cold block ", j, " selected by the query at position ", qpos[t0 + t],
                            " (KV head ", h, ") was not provided");
              }
            const int64_t lanes = popcount_below(row, n) * cold->block;
            nsel[(b * H + h) * tn + t] = lanes;
            C = std::max(C, (lanes + SPLIT - 1) / SPLIT);
          }
      if (cold_amx) {
        below.resize(tn);
        for (int64_t t = 0; t < tn; ++t) below[t] = cold->blocks_below(qpos[t0 + t], window, sink);
        csrc.resize(H);
        for (int64_t h = 0; h < H; ++h) csrc[h].build(*cold, B, H, NT, h, t0, tn, below.data(), COLD_AMX_BLOCK);
        cfirst.assign(B * H + 1, 0);
        for (int64_t bh = 0; bh < B * H; ++bh) cfirst[bh + 1] = cfirst[bh] + csrc[bh % H].supers();
        if (cold->k_scale != nullptr) {  // int8 codes: the rows of every (batch, head), in lane order
          cdeq_first.assign(B * H + 1, 0);
          int64_t most = 0;
          for (int64_t bh = 0; bh < B * H; ++bh) {
            const int64_t n = static_cast<int64_t>(csrc[bh % H].order.size());
            cdeq_first[bh + 1] = cdeq_first[bh] + 2 * n * D;
            most = std::max(most, n);
          }
          cdeq.resize(cdeq_first[B * H]);
          if (static_cast<int64_t>(lane_seq.size()) < most) {
            lane_seq.resize(most);
            std::iota(lane_seq.begin(), lane_seq.end(), 0);
          }
          at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
            for (int64_t bh = begin; bh < end; ++bh) {
              const std::vector<int64_t>& rows = csrc[bh % H].order;
              if (rows.empty()) continue;
              const int64_t b = bh / H, ch = cold->head[bh % H];
              T* dst = cdeq.data() + cdeq_first[bh];
              dequantize_rows<T, D>(*cold->k, *cold->k_scale, b, ch, rows, dst);
              dequantize_rows<T, D>(*cold->v, *cold->v_scale, b, ch, rows, dst + rows.size() * D);
            }
          });
        }
      } else {
        // Each token's G rows together, (B, H, tn, G, D): a cold work item's query rows.
        qtok.resize(B * H * tn * G * D);
        for (int64_t bh = 0; bh < B * H; ++bh)
          for (int64_t g = 0; g < G; ++g)
            for (int64_t t = 0; t < tn; ++t)
              std::memcpy(qtok.data() + ((bh * tn + t) * G + g) * D, qtile.data() + (bh * Rt + g * tn + t) * D,
                          D * sizeof(T));
      }
    }
    // A (batch, head, superblock) takes `splits` work items, a slice of its rows each (a multiple of 16, so the
    // tiles are the same): more, smaller items for the threads to share (a chunk's few superblocks left one idle).
    // Rows are independent, so only the schedule changes; the slices write one state, (Rt, W) per superblock.
    // Cold items are not sliced: an AMX one takes all Rt rows of its (batch, head, cold superblock).
    const int64_t splits = std::clamp<int64_t>(Rt / 256, 1, 4), slice = (Rt + 16 * splits - 1) / (16 * splits) * 16;
    const int64_t cold_items = cold_amx ? cfirst[B * H] : B * H * tn * C;
    const int64_t hot_items = B * H * NSP * splits, items = hot_items + cold_items;
    // Every item writes its whole state before the merge reads it: no zero-fill (megabytes per call at 4k keys).
    // (a decode step's few states from per-thread scratch, slot 2: no heap call per step)
    const int64_t state_n = B * H * NSP * Rt * W;
    const bool small_state = static_cast<size_t>(state_n) * sizeof(float) <= kScratchBytes;
    at::Tensor state_buf = small_state ? at::Tensor() : at::empty({state_n}, at::kFloat);
    float* const state_data = small_state ? scratch<float>(2, state_n) : state_buf.data_ptr<float>();
    cstate.resize(cold_items * (cold_amx ? Rt : G) * W);
    item_schedule(sources, supers, B * H, qpos + t0, tn, items, splits, schedule);
    // The rows of an item's first block (K, V), for the item before it to ask for: hot superblocks and AMX cold
    // superblocks (int8 cold rows are dequantized by then; a cold item of one token's rows: none).
    const auto first_rows = [&](int64_t item, Ahead& ak, Ahead& av) {
      const T *kb, *vb;
      int64_t k_row, v_row;
      const int64_t* order;
      const Block* blk;
      if (item < hot_items) {
        const int64_t bhs = item / splits, b = bhs / (H * NSP), h = (bhs / NSP) % H;
        const auto [si, sp] = supers[bhs % NSP];
        const Source& src = sources[si];
        if (src.super_first[sp] == src.super_first[sp + 1]) return;
        kb = src.k->template const_data_ptr<T>() + b * src.k->stride(0) + h * src.k->stride(1);
        vb = src.v->template const_data_ptr<T>() + b * src.v->stride(0) + h * src.v->stride(1);
        k_row = src.k->stride(2), v_row = src.v->stride(2);
        blk = &src.blocks[src.super_first[sp]];
        order = src.order.data();
      } else if (cold_amx) {
        const int64_t ci = item - hot_items;
        const int64_t bh = std::upper_bound(cfirst.begin(), cfirst.end(), ci) - cfirst.begin() - 1;
        const ColdSource& cs = csrc[bh % H];
        const int64_t sp = ci - cfirst[bh];
        if (cs.super_first[sp] == cs.super_first[sp + 1]) return;
        blk = &cs.blocks[cs.super_first[sp]];
        if (cold->k_scale != nullptr) {
          kb = cdeq.data() + cdeq_first[bh];
          vb = kb + cs.order.size() * D;
          k_row = v_row = D;
          order = lane_seq.data();
        } else {
          const int64_t b = bh / H, ch = cold->head[bh % H];
          kb = cold->k->template const_data_ptr<T>() + b * cold->k->stride(0) + ch * cold->k->stride(1);
          vb = cold->v->template const_data_ptr<T>() + b * cold->v->stride(0) + ch * cold->v->stride(1);
          k_row = cold->k->stride(2), v_row = cold->v->stride(2);
          order = cs.order.data();
        }
      } else {
        return;
      }
      ak = block_ahead<T, D>(kb, k_row, order, *blk);
      av = block_ahead<T, D>(vb, v_row, order, *blk);
    };
    std::atomic<int64_t> next{0};
    at::parallel_for(0, std::min<int64_t>(items, at::get_num_threads()), 1, [&](int64_t, int64_t) {
#if defined(KAKEYA_AMX)
      if (use_amx) kakeya_amx::configure();
#endif
      // this thread's own buffers, kept across calls (they grew by push_back in every region: ~15 heap calls a
      // sparse layer's decode step on each thread)
      thread_local std::vector<int64_t> rows;
      thread_local std::vector<Block> cblocks;
      thread_local std::vector<T> kscr, vscr;  // int8 cold rows, dequantized
      // Each thread claims its next item as it starts one, so the item's last block can ask for the next's first
      // keys (AMX items whose rows are known without work: hot superblocks and AMX cold superblocks).
      int64_t i = next.fetch_add(1);
      for (int64_t in = 0; i < items; i = in) {
        in = next.fetch_add(1);
        Ahead next_k, next_v;
        if (in < items && use_amx) first_rows(schedule[in], next_k, next_v);
        const int64_t item = schedule[i];
        const T* qrows;
        const T *kb, *vb;
        int64_t k_row, v_row, R_item, nblocks;
        const int64_t *order, *pos;
        const Block* blocks;
        Rule rule{qpos + t0, tn, window, sink, Kind::Plain, cold != nullptr ? cold->block : 0};
        bool amx_item = use_amx;  // cold items of one token's G rows (no AMX cold side) take the dot-product path
        bool in_order = false;    // keys stored in position order (a source that says so)
        Partial st;
        if (item < hot_items) {
          const int64_t bhs = item / splits, b = bhs / (H * NSP), h = (bhs / NSP) % H;
          const int64_t r_lo = std::min(Rt, item % splits * slice), r_hi = std::min(Rt, r_lo + slice);
          if (r_lo == r_hi) continue;  // fewer rows than slices
          const auto [si, sp] = supers[bhs % NSP];
          const Source& src = sources[si];
          rule.kind = src.kind;
          in_order = src.in_order;
          qrows = qtile.data() + ((b * H + h) * Rt + r_lo) * D;
          R_item = r_hi - r_lo;
          rule.row0 = r_lo;
          kb = src.k->template const_data_ptr<T>() + b * src.k->stride(0) + h * src.k->stride(1);
          vb = src.v->template const_data_ptr<T>() + b * src.v->stride(0) + h * src.v->stride(1);
          k_row = src.k->stride(2);
          v_row = src.v->stride(2);
          order = src.order.data();
          pos = src.pos.data();
          blocks = src.blocks.data() + src.super_first[sp];
          nblocks = src.super_first[sp + 1] - src.super_first[sp];
          float* const base = state_data + bhs * Rt * W;  // rows r_lo..r_hi of its (acc, m, l, n)
          st = Partial{base + r_lo * D, base + Rt * D + r_lo, base + Rt * D + Rt + r_lo, base + Rt * D + 2 * Rt + r_lo};
        } else if (cold_amx) {  // (batch, head, cold superblock): every row of the tile, its own blocks visible
          const int64_t ci = item - hot_items;
          const int64_t bh = std::upper_bound(cfirst.begin(), cfirst.end(), ci) - cfirst.begin() - 1;
          const int64_t b = bh / H, h = bh % H, ch = cold->head[h], sp = ci - cfirst[bh];
          const ColdSource& cs = csrc[h];
          rule.kind = Kind::Cold;
          rule.sel = cold->sel + (bh * NT + t0) * cold->words;
          rule.words = cold->words;
          rule.below = below.data();
          qrows = qtile.data() + bh * Rt * D;
          R_item = Rt;
          if (cold->k_scale != nullptr) {  // dequantized above, in lane order
            kb = cdeq.data() + cdeq_first[bh];
            vb = kb + cs.order.size() * D;
            k_row = v_row = D;
            order = lane_seq.data();
          } else {
            kb = cold->k->template const_data_ptr<T>() + b * cold->k->stride(0) + ch * cold->k->stride(1);
            vb = cold->v->template const_data_ptr<T>() + b * cold->v->stride(0) + ch * cold->v->stride(1);
            k_row = cold->k->stride(2);
            v_row = cold->v->stride(2);
            order = cs.order.data();
          }
          pos = cs.pos.data();
          blocks = cs.blocks.data() + cs.super_first[sp];
          nblocks = cs.super_first[sp + 1] - cs.super_first[sp];
          float* const base = cstate.data() + ci * Rt * W;  // rule.row0 stays 0: row r is token r % tn
          st = Partial{base, base + Rt * D, base + Rt * D + Rt, base + Rt * D + 2 * Rt};
        } else {
          const int64_t ci = item - hot_items, c = ci % C, bht = ci / C, t = bht % tn, bh = bht / tn;
          const int64_t b = bh / H, h = cold->head[bh % H];  // h: the head in cold K/V (>= 0 when it has lanes)
          float* const base = cstate.data() + ci * G * W;
          st = Partial{base, base + G * D, base + G * D + G, base + G * D + 2 * G};
          const int64_t first = c * SPLIT, count = std::min<int64_t>(SPLIT, nsel[bht] - first);
          if (count <= 0) {  // this token has fewer superchunks: an empty state
            std::fill(base, base + G * W, 0.f);
            std::fill(base + G * D, base + G * D + G, NEG_INF);
            continue;
          }
          cold->lanes(cold->sel + (bh * NT + t0 + t) * cold->words,
                      cold->blocks_below(qpos[t0 + t], window, sink), h, first, count, rows);
          cblocks.clear();
          for (int64_t i = 0; i < count; i += BK)
            cblocks.push_back(Block{i, std::min<int64_t>(BK, count - i), i, std::min<int64_t>(BK, count - i) + i - 1});
          amx_item = false;
          rule = Rule{&kAll, 1, 0, 0, Kind::Plain, 0};
          qrows = qtok.data() + (bh * tn + t) * G * D;
          R_item = G;
          if (cold->k_scale != nullptr) {  // int8 codes: this superchunk's rows dequantized, in lane order
            kscr.resize(count * D);
            vscr.resize(count * D);
            dequantize_rows<T, D>(*cold->k, *cold->k_scale, b, h, rows, kscr.data());
            dequantize_rows<T, D>(*cold->v, *cold->v_scale, b, h, rows, vscr.data());
            kb = kscr.data(), vb = vscr.data(), k_row = D, v_row = D;
            order = lane_pos.data();
          } else {
            kb = cold->k->template const_data_ptr<T>() + b * cold->k->stride(0) + h * cold->k->stride(1);
            vb = cold->v->template const_data_ptr<T>() + b * cold->v->stride(0) + h * cold->v->stride(1);
            k_row = cold->k->stride(2);
            v_row = cold->v->stride(2);
            order = rows.data();
          }
          pos = lane_pos.data();
          blocks = cblocks.data();
          nblocks = static_cast<int64_t>(cblocks.size());
        }
#if defined(KAKEYA_AMX)
        if constexpr (std::is_same_v<T, c10::BFloat16> && D % 32 == 0) {
          if (amx_item && rule.kind == Kind::Cold) {  // a ColdSource's blocks of COLD_AMX_BLOCK lanes
            attend_superblock_amx<D, COLD_AMX_BLOCK>(qrows, kb, vb, k_row, v_row, R_item, rule, order, pos, blocks,
                                                     nblocks, scale, st, false, true, next_k, next_v);
            continue;
          }
          if (amx_item) {  // head sizes that are not a multiple of 32 take the dot-product path everywhere
            attend_superblock_amx<D>(qrows, kb, vb, k_row, v_row, R_item, rule, order, pos, blocks, nblocks, scale,
                                     st, in_order, false, next_k, next_v);
            continue;
          }
        }
#endif
        attend_superblock<T, D>(qrows, kb, vb, k_row, v_row, R_item, rule, order, pos, blocks, nblocks, scale, st,
                                in_order);
      }
#if defined(KAKEYA_AMX)
      if (use_amx) _tile_release();
#endif
    });
    // Merge each row's partial states, in order, against its global max; normalise; write.
    at::parallel_for(0, B * H * Rt, 16, [&](int64_t begin, int64_t end) {
      float row[D];
      for (int64_t idx = begin; idx < end; ++idx) {
        const int64_t bh = idx / Rt, r = idx % Rt, g = r / tn, tt = r % tn;
        // (acc, m, l, n) of each partial state of this row: hot superblocks, then cold superchunks
        auto part = [&](int64_t i, const float*& acc, float& m, float& l, float& n) {
          if (i < NSP || cold_amx) {
            const float* base = i < NSP ? state_data + (bh * NSP + i) * Rt * W
                                        : cstate.data() + (cfirst[bh] + i - NSP) * Rt * W;
            acc = base + r * D, m = base[Rt * D + r], l = base[Rt * D + Rt + r], n = base[Rt * D + 2 * Rt + r];
          } else {
            const float* base = cstate.data() + ((bh * tn + tt) * C + (i - NSP)) * G * W;
            acc = base + g * D, m = base[G * D + g], l = base[G * D + G + g], n = base[G * D + 2 * G + g];
          }
        };
        const int64_t parts = NSP + (cold_amx ? cfirst[bh + 1] - cfirst[bh] : C);
        const float* acc;
        float ms, ls, ns;
        float m = NEG_INF;
        for (int64_t i = 0; i < parts; ++i) {
          part(i, acc, ms, ls, ns);
          m = std::max(m, ms);
        }
        float l = 0.f;
        std::fill(row, row + D, 0.f);
        int64_t counts[4] = {0, 0, 0, 0};
        for (int64_t i = 0; i < parts; ++i) {
          part(i, acc, ms, ls, ns);
          counts[i < NSP ? supers[i].first : NS] += static_cast<int64_t>(ns);
          if (ms == NEG_INF) continue;  // this part holds nothing the row sees
          const float w = std::exp(ms - m);
          l += w * ls;
          for (int d = 0; d < D; ++d) row[d] += w * acc[d];
        }
        const float inv = l > 0.f ? 1.f / l : 0.f;  // a row that sees no key at all gets zeros
        for (int d = 0; d < D; ++d) row[d] *= inv;
        const int64_t b = bh / H, h = bh % H, t = t0 + tt;
        T* dst = op + b * out.stride(0) + h * out.stride(1) + (g * NT + t) * out.stride(2);
        if constexpr (std::is_same_v<T, float>) {
          std::copy(row, row + D, dst);
        } else {
          at::vec::convert(row, dst, D);  // round to nearest even, as the scalar conversion does
        }
        if (seen != nullptr)
          for (int64_t s = 0; s < NC; ++s) seen[((bh * R) + g * NT + t) * NC + s] = counts[s];
      }
    });
  }
  // a prompt's buffers are let go, a decode step's kept
  release_if_large(cstate), release_if_large(qtile), release_if_large(qtok), release_if_large(cdeq);
  release_if_large(nsel), release_if_large(cdeq_first), release_if_large(lane_seq), release_if_large(schedule);
}

template <typename T>
void dispatch_dim(const at::Tensor& q, std::vector<Source>& sources, const at::Tensor& q_pos, int64_t window,
                  int64_t sink, const Cold* cold, float scale, at::Tensor& out, int64_t* seen) {
  switch (q.size(3)) {
    case 16: return run<T, 16>(q, sources, q_pos, window, sink, cold, scale, out, seen);
    case 32: return run<T, 32>(q, sources, q_pos, window, sink, cold, scale, out, seen);
    case 64: return run<T, 64>(q, sources, q_pos, window, sink, cold, scale, out, seen);
    case 96: return run<T, 96>(q, sources, q_pos, window, sink, cold, scale, out, seen);
    case 128: return run<T, 128>(q, sources, q_pos, window, sink, cold, scale, out, seen);
    case 256: return run<T, 256>(q, sources, q_pos, window, sink, cold, scale, out, seen);
    default: TORCH_CHECK(false, "cached_attention: head_dim ", q.size(3), " not in {16, 32, 64, 96, 128, 256}");
  }
}

// Positions per block of the path this machine runs (AMX: BKA, else BK).
template <typename T>
int64_t block_size() {
#if defined(KAKEYA_AMX)
  if (amx_enabled<T>()) return BKA;
#endif
  return BK;
}

// k_pos holds k's positions: exactly S (k's keys), or at least S with `pos_prefix` (a buffer's first S).
// A query of dtype `dt`, (B, Hk, R, D), against k, v (B, Hk, S, D) at positions k_pos. (A decode row's query
// is described, not narrowed: a narrow per row and layer was ~0.3 ms of an 8-row step in dispatcher calls.)
void check_source(at::ScalarType dt, int64_t B, int64_t Hk, int64_t D, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& k_pos, bool pos_prefix = false) {
  TORCH_CHECK(k.device().is_cpu() && v.device().is_cpu(), "cached_attention: CPU only");
  TORCH_CHECK(k.dim() == 4 && v.dim() == 4, "cached_attention: k, v must be 4-D");
  TORCH_CHECK(dt == k.scalar_type() && dt == v.scalar_type(), "cached_attention: q, k, v must share a dtype");
  TORCH_CHECK(k.sizes() == v.sizes(), "cached_attention: k and v differ in shape");
  TORCH_CHECK(B == k.size(0) && Hk == k.size(1) && D == k.size(3),
              "cached_attention: q (B, Hk, R, D) and k (B, Hk, S, D) disagree");
  TORCH_CHECK(k_pos.dim() == 1 && k_pos.scalar_type() == at::kLong && k_pos.is_contiguous() &&
                  k_pos.device().is_cpu(),
              "cached_attention: k_pos (S,) must be contiguous int64 on the CPU");
  TORCH_CHECK(pos_prefix ? k_pos.size(0) >= k.size(2) : k_pos.size(0) == k.size(2), "cached_attention: k_pos has ",
              k_pos.size(0), " positions for ",
              k.size(2), " keys");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "cached_attention: k/v last dim must have unit stride");
}

void check_source(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_pos,
                  bool pos_prefix = false) {
  check_source(q.scalar_type(), q.size(0), q.size(1), q.size(3), k, v, k_pos, pos_prefix);
}

void check_query(const at::Tensor& q, const at::Tensor& q_pos) {
  TORCH_CHECK(q.device().is_cpu(), "cached_attention: CPU only");
  TORCH_CHECK(q.dim() == 4, "cached_attention: q must be 4-D");
  TORCH_CHECK(q_pos.dim() == 1 && q_pos.scalar_type() == at::kLong && q_pos.is_contiguous() &&
                  q_pos.device().is_cpu(),
              "cached_attention: q_pos (T,) must be contiguous int64 on the CPU");
  TORCH_CHECK(q_pos.size(0) >= 1 && q.size(2) % q_pos.size(0) == 0,
              "cached_attention: the query rows must be a multiple of the new tokens (q_pos)");
  TORCH_CHECK(q.stride(3) == 1 && q.stride(2) == q.size(3), "cached_attention: q rows must be packed");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "cached_attention: dtype ",
              q.scalar_type(), " not supported (float32, bfloat16)");
}

void dispatch(const at::Tensor& q, std::vector<Source>& sources, const at::Tensor& q_pos, int64_t window,
              int64_t sink, const Cold* cold, double scale, at::Tensor& out, int64_t* seen) {
  const float s = static_cast<float>(scale);
  if (q.scalar_type() == at::kFloat) {
    dispatch_dim<float>(q, sources, q_pos, window, sink, cold, s, out, seen);
  } else {
    dispatch_dim<c10::BFloat16>(q, sources, q_pos, window, sink, cold, s, out, seen);
  }
}

int64_t path_block(const at::Tensor& q) {
  return q.scalar_type() == at::kBFloat16 && q.size(3) % 32 == 0 ? block_size<c10::BFloat16>() : BK;
}

// A call's one source, built in place in the calling thread's kept list (its buffers reused across calls: a
// sparse decode step built a fresh one per layer, a dozen heap calls each).
std::vector<Source>& one_source() {
  thread_local std::vector<Source> pool(1);
  return pool;
}

at::Tensor cached_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& q_pos,
                            const at::Tensor& k_pos, int64_t window, int64_t sink, double scale) {
  check_query(q, q_pos);
  check_source(q, k, v, k_pos);
  TORCH_CHECK(window >= 0 && sink >= 0, "cached_attention: window and sink must be >= 0 (window 0: none)");
  auto out = at::empty(q.sizes(), q.options());
  if (q.numel() == 0) return out;
  if (k.size(2) == 0) return out.zero_();
  std::vector<Source>& sources = one_source();
  sources[0].build(k, v, k_pos, Kind::Plain, path_block(q));
  dispatch(q, sources, q_pos, window, sink, nullptr, scale, out, nullptr);
  sources[0].release_buffers();
  return out;
}

// Sparse attention: the exact hot set (sinks and each query's hot range, hot_lo..q, the last `window` positions
// extended down to a multiple of `block` after the sinks) and the cold blocks each token selected (`select`
// (B, Hk, T, words) bitsets over blocks j = (p - sink) / block; only blocks wholly below the query's hot range
// count), one softmax over both. cold_k, cold_v (B, Hc, U * block, D) hold decoded blocks of the KV heads that
// have a cold tier (cold_head[h]: head h's index in them, -1: none), block j at
// cold_slot[j] for every head, or cold_slot[c, j] for cold head c (each head its own blocks) (-1: not provided;
// a selected block not provided is an error). Returns the output and the keys
// each row saw from each side, (B, Hk, R, 2) int64: [..., 0] hot, [..., 1] cold.
std::tuple<at::Tensor, at::Tensor> sparse_attention(const at::Tensor& q, const at::Tensor& hot_k,
                                                    const at::Tensor& hot_v, const at::Tensor& hot_pos,
                                                    const at::Tensor& cold_k, const at::Tensor& cold_v,
                                                    const std::optional<at::Tensor>& cold_k_scale,
                                                    const std::optional<at::Tensor>& cold_v_scale,
                                                    const at::Tensor& cold_slot, const at::Tensor& cold_head,
                                                    const at::Tensor& select,
                                                    const at::Tensor& q_pos, int64_t window, int64_t sink,
                                                    int64_t block, double scale) {
  check_query(q, q_pos);
  check_source(q, hot_k, hot_v, hot_pos);
  TORCH_CHECK(window >= 1 && sink >= 0 && block >= 1, "sparse_attention: need window >= 1, sink >= 0, block >= 1");
  const bool int8 = cold_k.scalar_type() == at::kChar;
  const auto cold_dtype = int8 ? at::kChar : q.scalar_type();
  TORCH_CHECK(cold_head.dim() == 1 && cold_head.scalar_type() == at::kLong && cold_head.is_contiguous() &&
                  cold_head.size(0) == q.size(1),
              "sparse_attention: cold_head must be contiguous int64 (Hk,)");
  const int64_t* ch = cold_head.const_data_ptr<int64_t>();
  for (int64_t h = 0; h < q.size(1); ++h)
    TORCH_CHECK(ch[h] < cold_k.size(1), "sparse_attention: KV head ", h, " maps to cold head ", ch[h], " of ",
                cold_k.size(1));
  TORCH_CHECK(cold_k.dim() == 4 && cold_k.sizes() == cold_v.sizes() && cold_k.scalar_type() == cold_dtype &&
                  cold_v.scalar_type() == cold_dtype && cold_k.size(0) == q.size(0) &&
                  cold_k.size(3) == q.size(3) && cold_k.size(2) % block == 0 &&
                  cold_k.stride(3) == 1 && cold_v.stride(3) == 1,
              "sparse_attention: cold_k, cold_v must be (B, Hc, U * block, D) in q's dtype or int8, unit last stride");
  TORCH_CHECK(cold_k_scale.has_value() == int8 && cold_v_scale.has_value() == int8,
              "sparse_attention: int8 cold K/V need their scales, other dtypes none");
  if (int8)
    for (const auto* sc : {&*cold_k_scale, &*cold_v_scale})
      TORCH_CHECK(sc->dim() == 3 && sc->scalar_type() == at::kHalf && sc->size(0) == cold_k.size(0) &&
                      sc->size(1) == cold_k.size(1) && sc->size(2) == cold_k.size(2),
                  "sparse_attention: cold scales must be fp16 (B, Hk, U * block)");
  TORCH_CHECK((cold_slot.dim() == 1 || (cold_slot.dim() == 2 && cold_slot.size(0) == cold_k.size(1))) &&
                  cold_slot.scalar_type() == at::kLong && cold_slot.is_contiguous(),
              "sparse_attention: cold_slot must be contiguous int64, (N,) or (Hc, N)");
  TORCH_CHECK(select.dim() == 4 && select.scalar_type() == at::kLong && select.is_contiguous() &&
                  select.size(0) == q.size(0) && select.size(1) == q.size(1) && select.size(2) == q_pos.size(0),
              "sparse_attention: select must be contiguous int64 (B, Hk, T, words)");
  // Every block a token may select lies below its hot range: the bitsets must cover them all.
  const int64_t* qp = q_pos.const_data_ptr<int64_t>();
  int64_t most = 0;
  for (int64_t t = 0; t < q_pos.size(0); ++t) most = std::max(most, (qp[t] + 1 - window - sink) / block);
  TORCH_CHECK(select.size(3) * 64 >= most, "sparse_attention: select has ", select.size(3) * 64,
              " block bits, a query may select among ", most);
  const int64_t units = cold_k.size(2) / block;
  const int64_t* sl = cold_slot.const_data_ptr<int64_t>();
  const int64_t nslot = cold_slot.size(-1);
  for (int64_t j = 0; j < cold_slot.numel(); ++j)
    TORCH_CHECK(sl[j] < units, "sparse_attention: cold block ", j % nslot, " at slot ", sl[j], " of ", units);
  // inside a stack step, the outputs its call site kept (common.h's reusable_empty)
  thread_local Reusable out_site, seen_site;
  auto out = reusable_empty(out_site, q.sizes(), q.options());
  auto seen = reusable_empty(seen_site, {q.size(0), q.size(1), q.size(2), 2}, q.options().dtype(at::kLong));
  seen.zero_();
  if (q.numel() == 0) return {out, seen};
  std::vector<Source>& sources = one_source();
  sources[0].build(hot_k, hot_v, hot_pos, Kind::Hot, path_block(q));
  const Cold cold{&cold_k, &cold_v, int8 ? &*cold_k_scale : nullptr, int8 ? &*cold_v_scale : nullptr, sl, ch,
                  nslot, block,
                  reinterpret_cast<const uint64_t*>(select.const_data_ptr<int64_t>()), select.size(3),
                  cold_slot.dim() == 2 ? nslot : 0};
  dispatch(q, sources, q_pos, window, sink, &cold, scale, out, seen.data_ptr<int64_t>());
  sources[0].release_buffers();
  return {out, seen};
}


// kakeya::cached_attention_rows: the decode rows of a batched step, each ONE token of its own sequence attending
// its own cache (its own keys, length, positions, window and sinks), in one call. q (N, Hk, G, D): row i's G query
// rows per K/V head, ordered like cached_attention's (group; one token); k[i], v[i] (1, Hk, S_i, D) at positions
// k_pos[i] (S_i,); q_pos (N,) each row's position; window[i] (0: none), sink[i]. Returns (N, Hk, G, D).
//
// Row i's result is the bits cached_attention gives it alone, (q[i:i+1], k[i], v[i], q_pos[i:i+1], k_pos[i],
// window[i], sink[i]): its work items are the same (K/V head, superblock) items over the same blocks, run by the
// same code (AMX tiles or dot products, per the process's route), and its partial states are merged in the same
// order by the same arithmetic. Only the scheduling differs: every row's items share one parallel region, and the
// merges another, instead of two regions per row (a decode step of N rows paid 2 N regions per layer).
template <typename T, int D>
void run_rows(const at::Tensor& q, std::vector<Source>& sources, const int64_t* qpos, const int64_t* window,
              const int64_t* sink, float scale, at::Tensor& out) {
  const int64_t N = q.size(0), H = q.size(1), G = q.size(2);
  const bool use_amx = amx_enabled<T>() && D % 32 == 0;
  // Work items in (row, head, superblock) order: the first item of each row, its superblocks.
  // The calling thread's buffers, kept across calls (no heap call per layer of a decode step); bound to references,
  // which the lambdas below capture (a thread_local named in a lambda would be the running thread's own).
  thread_local std::vector<int64_t> kept_first, kept_item_row, kept_cost, kept_schedule;
  thread_local std::vector<float> kept_state;
  std::vector<int64_t>&first = kept_first, &item_row = kept_item_row, &cost = kept_cost, &schedule = kept_schedule;
  std::vector<float>& state = kept_state;
  first.assign(N + 1, 0);
  item_row.clear();
  for (int64_t i = 0; i < N; ++i) {
    first[i + 1] = first[i] + H * sources[i].supers();
    item_row.insert(item_row.end(), H * sources[i].supers(), i);
  }
  const int64_t items = first[N];
  constexpr int64_t W = D + 3;  // per query row: acc (D), m, l, n
  state.resize(items * G * W);  // every item writes its whole state
  const T* qp = q.const_data_ptr<T>();
  T* op = out.data_ptr<T>();
  // Items handed out largest first (keys in the superblock), each thread taking the next when it finishes one: in
  // (row, head, superblock) order halved between two threads, a 1k-token row's three heads of two whole superblocks
  // and a short last one left one thread with twice the other's keys. Only the schedule changes (as run's).
  cost.assign(items, 0);
  schedule.resize(items);
  for (int64_t item = 0; item < items; ++item) {
    const Source& src = sources[item_row[item]];
    const int64_t sp = (item - first[item_row[item]]) % src.supers();
    for (int64_t b = src.super_first[sp]; b < src.super_first[sp + 1]; ++b) cost[item] += src.blocks[b].count;
  }
  std::iota(schedule.begin(), schedule.end(), 0);
  // stable_sort's order (ties by item) from std::sort, which takes no heap buffer
  std::sort(schedule.begin(), schedule.end(),
            [&](int64_t a, int64_t b) { return cost[a] > cost[b] || (cost[a] == cost[b] && a < b); });
  std::atomic<int64_t> next{0};
  // An item's source row, head and superblock.
  const auto locate = [&](int64_t item, int64_t& i, int64_t& h, int64_t& sp) {
    i = item_row[item];
    const int64_t NSP = sources[i].supers();
    h = (item - first[i]) / NSP, sp = (item - first[i]) % NSP;
  };
  at::parallel_for(0, std::min<int64_t>(items, at::get_num_threads()), 1, [&](int64_t, int64_t) {
#if defined(KAKEYA_AMX)
    // every item's rows are G < 16 query rows (decode): the narrow tiles once per thread, not per item
    const bool decode_tiles = use_amx && G < 16;
    if (decode_tiles) kakeya_amx::configure_decode(static_cast<int>(G));
    else if (use_amx) kakeya_amx::configure();
#endif
    // Each thread claims its next item as it starts one, so the item's last block can ask for the next's first keys.
    int64_t k = next.fetch_add(1);
    while (k < items) {
      const int64_t kn = next.fetch_add(1);
      const int64_t item = schedule[k];
      int64_t i, h, sp;
      locate(item, i, h, sp);
      const Source& src = sources[i];
      const Rule rule{qpos + i, 1, window[i], sink[i], src.kind, 0};
      const T* qrows = qp + (i * H + h) * G * D;
      const T* kb = src.k->template const_data_ptr<T>() + h * src.k->stride(1);
      const T* vb = src.v->template const_data_ptr<T>() + h * src.v->stride(1);
      const Block* blocks = src.blocks.data() + src.super_first[sp];
      const int64_t nblocks = src.super_first[sp + 1] - src.super_first[sp];
      float* base = state.data() + item * G * W;
      const Partial st{base, base + G * D, base + G * D + G, base + G * D + 2 * G};
#if defined(KAKEYA_AMX)
      if constexpr (std::is_same_v<T, c10::BFloat16> && D % 32 == 0) {
        if (use_amx) {
          Ahead next_k, next_v;  // the next item's first block's rows
          if (kn < items) {
            int64_t ni, nh, nsp;
            locate(schedule[kn], ni, nh, nsp);
            const Source& ns = sources[ni];
            const Block& nb = ns.blocks[ns.super_first[nsp]];
            next_k = block_ahead<T, D>(ns.k->template const_data_ptr<T>() + nh * ns.k->stride(1), ns.k->stride(2),
                                       ns.order.data(), nb);
            next_v = block_ahead<T, D>(ns.v->template const_data_ptr<T>() + nh * ns.v->stride(1), ns.v->stride(2),
                                       ns.order.data(), nb);
          }
          // in order (a full cache's keys): block rows by arithmetic and the next block asked for while staging,
          // as run's items do (decode rows went without); the same bits either way
          attend_superblock_amx<D>(qrows, kb, vb, src.k->stride(2), src.v->stride(2), G, rule, src.order.data(),
                                   src.pos.data(), blocks, nblocks, scale, st, src.in_order, false, next_k, next_v,
                                   decode_tiles);
          k = kn;
          continue;
        }
      }
#endif
      attend_superblock<T, D>(qrows, kb, vb, src.k->stride(2), src.v->stride(2), G, rule, src.order.data(),
                              src.pos.data(), blocks, nblocks, scale, st, src.in_order);
      k = kn;
    }
#if defined(KAKEYA_AMX)
    if (use_amx) _tile_release();
#endif
  });
  // Merge each query row's partial states, in position order, against its global max; normalise; write (as run).
  at::parallel_for(0, N * H * G, 16, [&](int64_t begin, int64_t end) {
    float row[D];
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t i = idx / (H * G), h = (idx / G) % H, g = idx % G, parts = sources[i].supers();
      const float* states = state.data() + (first[i] + h * parts) * G * W;
      float m = NEG_INF;
      for (int64_t p = 0; p < parts; ++p) m = std::max(m, states[p * G * W + G * D + g]);
      float l = 0.f;
      std::fill(row, row + D, 0.f);
      for (int64_t p = 0; p < parts; ++p) {
        const float* base = states + p * G * W;
        const float* acc = base + g * D;
        const float ms = base[G * D + g], ls = base[G * D + G + g];
        if (ms == NEG_INF) continue;  // this part holds nothing the row sees
        const float w = std::exp(ms - m);
        l += w * ls;
        for (int d = 0; d < D; ++d) row[d] += w * acc[d];
      }
      const float inv = l > 0.f ? 1.f / l : 0.f;  // a row that sees no key at all gets zeros
      for (int d = 0; d < D; ++d) row[d] *= inv;
      T* dst = op + i * out.stride(0) + h * out.stride(1) + g * out.stride(2);
      if constexpr (std::is_same_v<T, float>) {
        std::copy(row, row + D, dst);
      } else {
        at::vec::convert(row, dst, D);  // round to nearest even, as the scalar conversion does
      }
    }
  });
}

void check_rows_query(const at::Tensor& q, const at::Tensor& q_pos, int64_t n_k, int64_t n_v, int64_t n_pos,
                      int64_t n_window, int64_t n_sink) {
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 4 && q.is_contiguous(),
              "cached_attention_rows: q must be a contiguous CPU (N, Hk, G, D) tensor");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "cached_attention_rows: dtype ",
              q.scalar_type(), " not supported (float32, bfloat16)");
  const int64_t N = q.size(0);
  TORCH_CHECK(n_k == N && n_v == N && n_pos == N && n_window == N && n_sink == N,
              "cached_attention_rows: need one k, v, k_pos, window and sink per row");
  TORCH_CHECK(q_pos.dim() == 1 && q_pos.size(0) == N && q_pos.scalar_type() == at::kLong && q_pos.is_contiguous(),
              "cached_attention_rows: q_pos must be contiguous int64 (N,)");
}

// The rows' attention over their sources (one per row), as cached_attention_rows documents.
at::Tensor attend_rows(const at::Tensor& q, std::vector<Source>& sources, const at::Tensor& q_pos,
                       at::IntArrayRef window, at::IntArrayRef sink, double scale) {
  thread_local Reusable site;
  auto out = reusable_empty(site, q.sizes(), q.options());
  if (q.numel() == 0) return out;
  const int64_t* qp = q_pos.const_data_ptr<int64_t>();
  const float s = static_cast<float>(scale);
#define KAKEYA_ROWS(T, DIM) \
  case DIM: return run_rows<T, DIM>(q, sources, qp, window.data(), sink.data(), s, out), out;
  if (q.scalar_type() == at::kFloat) {
    switch (q.size(3)) {
      KAKEYA_ROWS(float, 16) KAKEYA_ROWS(float, 32) KAKEYA_ROWS(float, 64) KAKEYA_ROWS(float, 96)
      KAKEYA_ROWS(float, 128) KAKEYA_ROWS(float, 256)
    }
  } else {
    switch (q.size(3)) {
      KAKEYA_ROWS(c10::BFloat16, 16) KAKEYA_ROWS(c10::BFloat16, 32) KAKEYA_ROWS(c10::BFloat16, 64)
      KAKEYA_ROWS(c10::BFloat16, 96) KAKEYA_ROWS(c10::BFloat16, 128) KAKEYA_ROWS(c10::BFloat16, 256)
    }
  }
#undef KAKEYA_ROWS
  TORCH_CHECK(false, "cached_attention_rows: head_dim ", q.size(3), " not in {16, 32, 64, 96, 128, 256}");
}

// The rows' sources for a call, built in place in the calling thread's kept list (their buffers reused: a decode
// step builds one per row and layer); entries past the call's rows are stale and never read.
std::vector<Source>& row_sources(int64_t n) {
  thread_local std::vector<Source> pool;
  if (static_cast<int64_t>(pool.size()) < n) pool.resize(n);
  return pool;
}

at::Tensor cached_attention_rows(const at::Tensor& q, at::TensorList k, at::TensorList v, at::TensorList k_pos,
                                 const at::Tensor& q_pos, at::IntArrayRef window, at::IntArrayRef sink,
                                 double scale) {
  check_rows_query(q, q_pos, k.size(), v.size(), k_pos.size(), window.size(), sink.size());
  const int64_t N = q.size(0);
  std::vector<Source>& sources = row_sources(N);
  for (int64_t i = 0; i < N; ++i) {
    TORCH_CHECK(k[i].dim() == 4 && k[i].size(0) == 1, "cached_attention_rows: k[", i, "] must be (1, Hk, S, D)");
    check_source(q.scalar_type(), 1, q.size(1), q.size(3), k[i], v[i], k_pos[i]);
    TORCH_CHECK(window[i] >= 0 && sink[i] >= 0, "cached_attention_rows: window and sink must be >= 0");
    sources[i].build(k[i], v[i], k_pos[i], Kind::Plain, path_block(q));
  }
  return attend_rows(q, sources, q_pos, window, sink, scale);
}

// kakeya::cached_attention_rows_append: cached_attention_rows for decode rows whose caches are preallocated
// buffers (kv.cache's full and ring layers), with each row's cache write done here. Row i with slot[i] >= 0 first
// stores its new key and value, k_new[i] and v_new[i] (Hk, 1, D), at slot[i] of its buffers k[i], v[i]
// (1, Hk, A_i, D) and, when write_pos[i], its position q_pos[i] at k_pos[i][slot[i]]; then it attends the first
// count[i] slots (k_pos[i] (>= count[i],) their positions). A row with slot[i] < 0 attends k[i], v[i], k_pos[i] as
// given (a cache that handed out its keys itself). A write is a copy of the same bits, and the attention is
// cached_attention_rows' over the same keys: each row's result is the bits of its cache's update_and_fetch then
// cached_attention alone, without a Python write and views per row and layer.
at::Tensor cached_attention_rows_append(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new,
                                        at::TensorList k, at::TensorList v, at::TensorList k_pos,
                                        at::IntArrayRef slot, at::IntArrayRef count, at::IntArrayRef write_pos,
                                        const at::Tensor& q_pos, at::IntArrayRef window, at::IntArrayRef sink,
                                        double scale) {
  check_rows_query(q, q_pos, k.size(), v.size(), k_pos.size(), window.size(), sink.size());
  const int64_t N = q.size(0), Hk = q.size(1), D = q.size(3);
  TORCH_CHECK(static_cast<int64_t>(slot.size()) == N && static_cast<int64_t>(count.size()) == N &&
                  static_cast<int64_t>(write_pos.size()) == N,
              "cached_attention_rows_append: need one slot, count and write_pos per row");
  TORCH_CHECK(k_new.dim() == 4 && v_new.dim() == 4 && k_new.size(0) == N && k_new.size(1) == Hk &&
                  k_new.size(2) == 1 && k_new.size(3) == D && v_new.sizes() == k_new.sizes(),
              "cached_attention_rows_append: k_new, v_new must be (N, Hk, 1, D) like q's rows");
  TORCH_CHECK(k_new.scalar_type() == q.scalar_type() && v_new.scalar_type() == q.scalar_type() &&
                  k_new.device().is_cpu() && v_new.device().is_cpu() && k_new.stride(3) == 1 && v_new.stride(3) == 1,
              "cached_attention_rows_append: k_new, v_new must be CPU tensors of q's dtype, unit last stride");
  const int64_t* qp = q_pos.const_data_ptr<int64_t>();
  const size_t row_bytes = D * q.element_size();
  const char* kn = static_cast<const char*>(k_new.const_data_ptr());
  const char* vn = static_cast<const char*>(v_new.const_data_ptr());
  std::vector<Source>& sources = row_sources(N);
  for (int64_t i = 0; i < N; ++i) {
    TORCH_CHECK(k[i].dim() == 4 && k[i].size(0) == 1, "cached_attention_rows_append: k[", i,
                "] must be (1, Hk, S, D)");
    check_source(q.scalar_type(), 1, q.size(1), q.size(3), k[i], v[i], k_pos[i], /*pos_prefix=*/slot[i] >= 0);
    TORCH_CHECK(window[i] >= 0 && sink[i] >= 0, "cached_attention_rows_append: window and sink must be >= 0");
    int64_t n = k[i].size(2);
    if (slot[i] >= 0) {
      n = count[i];
      TORCH_CHECK(slot[i] < n && n <= k[i].size(2), "cached_attention_rows_append: row ", i, " slot ", slot[i],
                  " and count ", n, " outside its ", k[i].size(2), " slots");
      char* kb = static_cast<char*>(k[i].data_ptr());
      char* vb = static_cast<char*>(v[i].data_ptr());
      const int64_t es = q.element_size();
      for (int64_t h = 0; h < Hk; ++h) {
        std::memcpy(kb + (h * k[i].stride(1) + slot[i] * k[i].stride(2)) * es,
                    kn + (i * k_new.stride(0) + h * k_new.stride(1)) * es, row_bytes);
        std::memcpy(vb + (h * v[i].stride(1) + slot[i] * v[i].stride(2)) * es,
                    vn + (i * v_new.stride(0) + h * v_new.stride(1)) * es, row_bytes);
      }
      if (write_pos[i]) k_pos[i].data_ptr<int64_t>()[slot[i]] = qp[i];
    }
    sources[i].build(k[i], v[i], k_pos[i], Kind::Plain, path_block(q), n);
  }
  return attend_rows(q, sources, q_pos, window, sink, scale);
}

}  // namespace

namespace kakeya_ops {
std::tuple<at::Tensor, at::Tensor> sparse_attention(const at::Tensor& q, const at::Tensor& hot_k,
                                                    const at::Tensor& hot_v, const at::Tensor& hot_pos,
                                                    const at::Tensor& cold_k, const at::Tensor& cold_v,
                                                    const std::optional<at::Tensor>& cold_k_scale,
                                                    const std::optional<at::Tensor>& cold_v_scale,
                                                    const at::Tensor& cold_slot, const at::Tensor& cold_head,
                                                    const at::Tensor& select, const at::Tensor& q_pos, int64_t window,
                                                    int64_t sink, int64_t block, double scale) {
  return ::sparse_attention(q, hot_k, hot_v, hot_pos, cold_k, cold_v, cold_k_scale, cold_v_scale, cold_slot,
                            cold_head, select, q_pos, window, sink, block, scale);
}
at::Tensor cached_attention_rows_append(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new,
                                        at::TensorList k, at::TensorList v, at::TensorList k_pos,
                                        at::IntArrayRef slot, at::IntArrayRef count, at::IntArrayRef write_pos,
                                        const at::Tensor& q_pos, at::IntArrayRef window, at::IntArrayRef sink,
                                        double scale) {
  return ::cached_attention_rows_append(q, k_new, v_new, k, v, k_pos, slot, count, write_pos, q_pos, window, sink,
                                        scale);
}
at::Tensor cached_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& q_pos,
                            const at::Tensor& k_pos, int64_t window, int64_t sink, double scale) {
  return ::cached_attention(q, k, v, q_pos, k_pos, window, sink, scale);
}
}  // namespace kakeya_ops

TORCH_LIBRARY(kakeya, m) {
  m.def("cached_attention(Tensor q, Tensor k, Tensor v, Tensor q_pos, Tensor k_pos, int window, int sink, "
        "float scale) -> Tensor");
  m.def("sparse_attention(Tensor q, Tensor hot_k, Tensor hot_v, Tensor hot_pos, Tensor cold_k, Tensor cold_v, "
        "Tensor? cold_k_scale, Tensor? cold_v_scale, Tensor cold_slot, Tensor cold_head, Tensor select, Tensor q_pos, "
        "int window, "
        "int sink, int block, float scale) -> "
        "(Tensor, Tensor)");
  m.def("bf16_dot() -> bool", [] { return kBf16Dot; });  // built with AVX512-BF16 dot products
  m.def("bf16_amx() -> bool", [] { return amx_enabled<c10::BFloat16>(); });  // bf16 attention on AMX tiles
  // AMX tiles usable here at all (CPU, kernel, KAKEYA_AMX), and the per-process choice of which kernels use them.
  m.def("amx_available() -> bool", [] {
#if defined(KAKEYA_AMX)
    return kakeya_amx::permitted();
#else
    return false;
#endif
  });
  m.def("set_amx(bool attention, bool linear) -> ()", [](bool attention, bool linear) {
#if defined(KAKEYA_AMX)
    kakeya_amx::attention_on.store(attention);
    kakeya_amx::linear_on.store(linear);
#endif
  });
}

TORCH_LIBRARY_IMPL(kakeya, CPU, m) {
  m.impl("cached_attention", &cached_attention);
  m.impl("sparse_attention", &sparse_attention);
}

// The decode rows of a batched step in one call (cached_attention_rows above).
TORCH_LIBRARY_FRAGMENT(kakeya, m) {
  m.def("cached_attention_rows(Tensor q, Tensor[] k, Tensor[] v, Tensor[] k_pos, Tensor q_pos, int[] window, "
        "int[] sink, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(kakeya, CPU, m) { m.impl("cached_attention_rows", &cached_attention_rows); }

// The same with each row's cache write (cached_attention_rows_append above): k, v and k_pos are written in place.
TORCH_LIBRARY_FRAGMENT(kakeya, m) {
  m.def("cached_attention_rows_append(Tensor q, Tensor k_new, Tensor v_new, Tensor(a!)[] k, Tensor(b!)[] v, "
        "Tensor(c!)[] k_pos, int[] slot, int[] count, int[] write_pos, Tensor q_pos, int[] window, int[] sink, "
        "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(kakeya, CPU, m) { m.impl("cached_attention_rows_append", &cached_attention_rows_append); }
