// The indexer of the sparse KV policy: kakeya::block_select scores every cold block of a KV head against each
// query token and keeps the top-k, with one fixed order of operations per (token, block), so a token selects
// the same blocks in a decode step, a chunk or a prompt.
//
// q (B, Hk, R, D): the R = G * T query rows sharing K/V head h, ordered (group, token) as in cached_attention.
// head_topk (Hk,): blocks each KV head keeps (0: a streaming head, no cold tier; at least N: every block).
// kmin, kmax (B, Hc, N, D): per block and cold head (the heads with head_topk > 0, in order), the per-channel min
// and max of its keys (Quest's summary).
// The bound of a query q on a block is sum_d max(q_d * kmin_d, q_d * kmax_d) >= q . k for every key k of the
// block; a token's score for a block is the largest bound over the G query heads that share the K/V head.
// Token t (position p) may select among the blocks wholly outside its window, n(p) = max(0, p + 1 - window -
// sink) / block of them (blocks j cover positions sink + j * block ...); it keeps min(topk, n(p)) of them, the
// highest scores first, ties to the lower block. Missing summaries (N < n(p)) are an error, never a smaller
// choice. Returns select (B, Hk, T, words) int64 bitsets and scored (B, Hk, T) int64 = n(p) (0 for a streaming
// head: it scores nothing).

#include "common.h"

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int VS = Vec::size();

template <typename T>
void run(const at::Tensor& q, const at::Tensor& kmin, const at::Tensor& kmax, const at::Tensor& q_pos,
         int64_t window, int64_t sink, int64_t block, const std::vector<int64_t>& head_topk,
         const std::vector<int64_t>& cold_head, at::Tensor& select, at::Tensor& scored) {
  const int64_t B = q.size(0), H = q.size(1), R = q.size(2), D = q.size(3), NT = q_pos.size(0);
  const int64_t G = R / NT, N = kmin.size(2), words = select.size(3);
  const int64_t* qp = q_pos.const_data_ptr<int64_t>();
  const T* qd = q.const_data_ptr<T>();
  const T* mn = kmin.const_data_ptr<T>();
  const T* mx = kmax.const_data_ptr<T>();
  auto* sel = reinterpret_cast<uint64_t*>(select.data_ptr<int64_t>());
  int64_t* nsc = scored.data_ptr<int64_t>();
  at::parallel_for(0, B * H * NT, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), lo(D), hi(D), score;
    std::vector<int64_t> idx;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t bh = item / NT, t = item % NT, b = bh / H, h = bh % H, topk = head_topk[h];
      const int64_t n = topk == 0 ? 0 : std::max<int64_t>(0, qp[t] + 1 - window - sink) / block;
      nsc[item] = n;
      uint64_t* row = sel + item * words;
      std::fill(row, row + words, 0ull);
      if (n == 0) continue;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          qf[g * D + d] = static_cast<float>(qd[b * q.stride(0) + h * q.stride(1) + (g * NT + t) * q.stride(2) + d]);
      if (n <= topk) {  // every block: no scores needed
        for (int64_t j = 0; j < n; ++j) row[j >> 6] |= 1ull << (j & 63);
        continue;
      }
      score.resize(n);
      for (int64_t j = 0; j < n; ++j) {
        const int64_t off = b * kmin.stride(0) + cold_head[h] * kmin.stride(1) + j * kmin.stride(2);
        at::vec::convert(mn + off, lo.data(), D);  // exact widening (bf16 -> fp32) or a copy
        at::vec::convert(mx + off, hi.data(), D);
        float best = -std::numeric_limits<float>::infinity();
        for (int64_t g = 0; g < G; ++g) {
          Vec acc(0.f);  // D / VS vector steps in order, then one fixed lane tree
          for (int64_t d = 0; d < D; d += VS) {
            const Vec qv = Vec::loadu(qf.data() + g * D + d);
            acc = acc + at::vec::maximum(qv * Vec::loadu(lo.data() + d), qv * Vec::loadu(hi.data() + d));
          }
          const float s = at::vec::vec_reduce_all<float>([](Vec& a, Vec& c) { return a + c; }, acc);
          best = std::max(best, std::isnan(s) ? -std::numeric_limits<float>::infinity() : s);
        }
        score[j] = best;
      }
      idx.resize(n);
      std::iota(idx.begin(), idx.end(), 0);
      // A strict total order (score, then the lower block), so the kept set is one set whatever the sort does.
      std::nth_element(idx.begin(), idx.begin() + topk, idx.end(), [&](int64_t a, int64_t c) {
        return score[a] > score[c] || (score[a] == score[c] && a < c);
      });
      for (int64_t i = 0; i < topk; ++i) row[idx[i] >> 6] |= 1ull << (idx[i] & 63);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> block_select(const at::Tensor& q, const at::Tensor& kmin, const at::Tensor& kmax,
                                                const at::Tensor& q_pos, int64_t window, int64_t sink, int64_t block,
                                                const at::Tensor& head_topk) {
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
  std::vector<int64_t> topks(tk, tk + q.size(1)), cold_head;
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
  const int64_t* qp = q_pos.const_data_ptr<int64_t>();
  int64_t most = 0;
  for (int64_t t = 0; t < q_pos.size(0); ++t) most = std::max(most, (qp[t] + 1 - window - sink) / block);
  TORCH_CHECK(hc == 0 || most <= kmin.size(2), "block_select: a query may select among ", most,
              " cold blocks but only ", kmin.size(2), " have summaries");
  const int64_t words = std::max<int64_t>(1, (most + 63) / 64);
  auto select = at::empty({q.size(0), q.size(1), q_pos.size(0), words}, q.options().dtype(at::kLong));
  auto scored = at::empty({q.size(0), q.size(1), q_pos.size(0)}, q.options().dtype(at::kLong));
  if (q.scalar_type() == at::kFloat) {
    run<float>(q, kmin, kmax, q_pos, window, sink, block, topks, cold_head, select, scored);
  } else {
    run<c10::BFloat16>(q, kmin, kmax, q_pos, window, sink, block, topks, cold_head, select, scored);
  }
  return {select, scored};
}

// The sparse step's tripwire, on the counts the attention kernel kept in its own loops (kakeya::sparse_attention's
// `seen` (B, Hk, R, 2): hot, cold): every query row saw exactly its sinks and hot range, and min(topk, scored)
// whole cold blocks. Raises otherwise. Returns the step's counters, int64 (6,): query tokens x KV heads, blocks
// scored, blocks selected, keys attended and keys causally visible (first query head of each group, summed), and
// the keys the newest token attended summed over batch and KV heads.
at::Tensor sparse_check(const at::Tensor& seen, const at::Tensor& scored, const at::Tensor& q_pos, int64_t window,
                        int64_t sink, int64_t block, const at::Tensor& head_topk) {
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
      const int64_t topk = tks[bh % H], n = sc[bh * T + t], want_cold = std::min(n, topk) * block;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t* row = sn + ((bh * R) + g * T + t) * 2;
        TORCH_CHECK(row[0] == want_hot, "the query at position ", p, " saw ", row[0],
                    " keys of its sinks and hot range, not ", want_hot);
        TORCH_CHECK(row[1] == want_cold, "the indexer's blocks were not attended: the query at position ", p, " saw ",
                    row[1], " cold keys, not ", want_cold, " (top-", topk, " of ", n, " blocks of ", block, ")");
      }
      scored_sum += n;
      selected += want_cold / block;
      attended += want_hot + want_cold;
      visible += p + 1;
      if (t == T - 1) newest += want_hot + want_cold;
    }
  auto out = at::empty({6}, seen.options());
  int64_t* o = out.data_ptr<int64_t>();
  o[0] = B * H * T, o[1] = scored_sum, o[2] = selected, o[3] = attended, o[4] = visible, o[5] = newest;
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kakeya, m) {
  m.def("block_select(Tensor q, Tensor kmin, Tensor kmax, Tensor q_pos, int window, int sink, int block, "
        "Tensor head_topk) -> (Tensor, Tensor)");
  m.def("sparse_check(Tensor seen, Tensor scored, Tensor q_pos, int window, int sink, int block, Tensor head_topk) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(kakeya, CPU, m) {
  m.impl("block_select", &block_select);
  m.impl("sparse_check", &sparse_check);
}
