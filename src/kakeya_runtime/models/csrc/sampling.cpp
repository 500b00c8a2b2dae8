// Sampling's vocabulary passes, for engine/sampling.py (its torch code is the reference these keep):
// - kakeya::sample_weights: e = exp((x - max x) / T) over a row (what a plain temperature draws from);
// - kakeya::sample_support: the candidates top-k and/or top-p keep, and their weights;
// - kakeya::sample_draw: the index a uniform u picks from nonnegative weights.
// A row of Gemma 3's 262,144 logits took ~1.8 ms through ~20 torch ops (a top-k of 256, then the candidates grown);
// here the row is read in three vector passes on one thread (max, weights with their float64 sum, a threshold).
// Every result is a function of the row alone, computed in one fixed order (no threads), so a token's draw does
// not depend on the rows beside it or on the machine's thread count.

#include "common.h"

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int VS = Vec::size();
constexpr int LANES = 16;  // float64 partial sums, one per element index mod LANES (a fixed order)
constexpr int64_t DRAW_BLOCK = 1024;  // sample_draw's blocks: their sums, then one block's running sum
// A top-p's first candidates: weights >= these (relative to the top token's 1), lowered until they hold top-p's mass
// with a margin for the sums' rounding; the last rung (the smallest positive float) keeps every drawable token.
constexpr float RUNGS[] = {0x1p-10f, 0x1p-20f, 0x1p-40f, std::numeric_limits<float>::denorm_min()};
constexpr double MASS_MARGIN = 1e-9;

void check_row(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 1 && x.stride(0) == 1 &&
                  x.size(0) > 0,
              op, ": x must be a CPU float32 (V,) row with V >= 1 and unit stride");
}

// The row's highest logit; a NaN anywhere or a non-finite maximum is an error (nothing could be drawn faithfully).
float row_peak(const float* x, int64_t n) {
  Vec best(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + VS <= n; j += VS) best = at::vec::maximum(best, Vec::loadu(x + j));  // propagates NaN
  if (j < n) best = at::vec::maximum(best, Vec::set(Vec(-std::numeric_limits<float>::infinity()),
                                                    Vec::loadu(x + j, n - j), n - j));
  const float peak = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, best);
  TORCH_CHECK(std::isfinite(peak), "sampling: the logits' maximum is ", peak);
  return peak;
}

// e[i] = exp((x[i] - peak) / t) in float32 (one vector exp for every element, the tail's too: an element's weight
// does not depend on where it sits); returns their float64 sum, lane by lane then the lanes in order.
double weights_into(const float* x, int64_t n, float peak, float t, float* e) {
  const Vec vp(peak), vt(t);
  int64_t j = 0;
  for (; j + VS <= n; j += VS) ((Vec::loadu(x + j) - vp) / vt).exp().store(e + j);
  if (j < n) ((Vec::loadu(x + j, n - j) - vp) / vt).exp().store(e + j, n - j);
  double acc[LANES] = {};
  j = 0;
  for (; j + LANES <= n; j += LANES)
    for (int l = 0; l < LANES; ++l) acc[l] += static_cast<double>(e[j + l]);
  for (int l = 0; j + l < n; ++l) acc[l] += static_cast<double>(e[j + l]);
  double total = 0;
  for (int l = 0; l < LANES; ++l) total += acc[l];
  return total;
}

// Indices i (ascending) with v[i] >= threshold, appended to out.
void at_least(const float* v, int64_t n, float threshold, std::vector<int64_t>& out) {
  const Vec vt(threshold);
  const int all = (1 << VS) - 1;
  int64_t j = 0;
  for (; j + VS <= n; j += VS) {
    const int below = (Vec::loadu(v + j) >= vt).zero_mask();  // lanes where the comparison is false
    for (int m = all & ~below; m; m &= m - 1) out.push_back(j + __builtin_ctz(m));
  }
  for (; j < n; ++j)
    if (v[j] >= threshold) out.push_back(j);
}

// The k-th highest of x (k >= 1, k <= n, no NaN): the values a running threshold lets through, cut back to the top k
// whenever they fill the buffer.
float kth_highest(const float* x, int64_t n, int64_t k, std::vector<float>& buf) {
  const size_t cap = static_cast<size_t>(std::max<int64_t>(4096, 4 * k));
  buf.clear();
  float threshold = -std::numeric_limits<float>::infinity();
  const auto cut = [&] {
    std::nth_element(buf.begin(), buf.begin() + (k - 1), buf.end(), std::greater<float>());
    threshold = buf[k - 1];
    buf.resize(k);
  };
  const int all = (1 << VS) - 1;
  int64_t j = 0;
  for (; j + VS <= n; j += VS) {
    const Vec v = Vec::loadu(x + j);
    const int below = (v >= Vec(threshold)).zero_mask();
    if ((all & ~below) == 0) continue;
    for (int m = all & ~below; m; m &= m - 1) buf.push_back(x[j + __builtin_ctz(m)]);
    if (buf.size() >= cap) cut();
  }
  for (; j < n; ++j)
    if (x[j] >= threshold) buf.push_back(x[j]);
  cut();
  return threshold;
}

// Top-p over candidates (ids ascending, weights e, the vocabulary's total): p = e / total in float64, ordered by p
// descending (ties: the lower id first), a token kept while the mass before it is under top_p (the first always).
// The mass before a token (the running sum, then minus its p, each rounded as torch's cumsum - p) never falls along
// that order (rounding is monotonic; the sum grows, p shrinks), so the first token that fails ends the nucleus: only
// the order's prefix up to it is needed. It is taken in rounds of growing size by partial sorts under the same strict
// order (p descending, then id), the same prefix a sort of every candidate gives (a flat row's ~26,000 candidates
// took ~0.9 ms sorted whole for a nucleus of a few hundred).
std::tuple<at::Tensor, at::Tensor> nucleus(const std::vector<int64_t>& ids, const std::vector<float>& e, double total,
                                           double top_p) {
  const int64_t n = static_cast<int64_t>(ids.size());
  thread_local std::vector<double> p;
  thread_local std::vector<int64_t> order;
  p.resize(n);
  order.resize(n);
  for (int64_t i = 0; i < n; ++i) p[i] = static_cast<double>(e[i]) / total;
  std::iota(order.begin(), order.end(), 0);
  const auto before = [&](int64_t a, int64_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); };
  int64_t keep = 0;  // the order's first `keep` tokens are in the nucleus; the next one (if any) is not
  bool open = true;
  double mass = 0;
  for (int64_t round = 256; open && keep < n; round *= 2) {
    const int64_t end = std::min(n, keep + round);
    std::partial_sort(order.begin() + keep, order.begin() + end, order.end(), before);
    for (; keep < end; ++keep) {
      const double pi = p[order[keep]];
      mass += pi;
      if (!((mass - pi) < top_p)) {
        open = false;
        break;
      }
    }
  }
  keep = std::max<int64_t>(1, keep);
  auto out_ids = at::empty({keep}, at::TensorOptions().dtype(at::kLong));
  auto out_p = at::empty({keep}, at::TensorOptions().dtype(at::kDouble));
  int64_t* oi = out_ids.data_ptr<int64_t>();
  double* op = out_p.data_ptr<double>();
  for (int64_t i = 0; i < keep; ++i) oi[i] = ids[order[i]], op[i] = p[order[i]];
  return {out_ids, out_p};
}

at::Tensor sample_weights(const at::Tensor& x, double temperature) {
  check_row(x, "sample_weights");
  TORCH_CHECK(temperature > 0, "sample_weights: temperature must be > 0");
  const float* xp = x.const_data_ptr<float>();
  const int64_t n = x.size(0);
  auto e = at::empty({n}, x.options());
  weights_into(xp, n, row_peak(xp, n), static_cast<float>(temperature), e.data_ptr<float>());
  return e;
}

// top_k 0: no top-k (else 1 <= top_k < V); top_p 1: no top-p (else in (0, 1)); one of them filters.
std::tuple<at::Tensor, at::Tensor> sample_support(const at::Tensor& x, double temperature, int64_t top_k,
                                                  double top_p) {
  check_row(x, "sample_support");
  const int64_t n = x.size(0);
  TORCH_CHECK(temperature > 0, "sample_support: temperature must be > 0");
  TORCH_CHECK(top_k >= 0 && top_k < n && top_p > 0 && top_p <= 1 && (top_k > 0 || top_p < 1),
              "sample_support: need 0 <= top_k < V, 0 < top_p <= 1 and one of them filtering");
  const float* xp = x.const_data_ptr<float>();
  const float peak = row_peak(xp, n), t = static_cast<float>(temperature);
  thread_local std::vector<int64_t> ids;
  thread_local std::vector<float> e, buf;
  ids.clear();
  if (top_k > 0) {  // every logit at or above the k-th highest, in id order, and their weights
    at_least(xp, n, kth_highest(xp, n, top_k, buf), ids);
    const int64_t m = static_cast<int64_t>(ids.size());
    buf.resize(m);
    e.resize(m);
    for (int64_t i = 0; i < m; ++i) buf[i] = xp[ids[i]];
    weights_into(buf.data(), m, peak, t, e.data());
    if (top_p >= 1) {
      auto out_ids = at::empty({m}, at::TensorOptions().dtype(at::kLong));
      auto out_e = at::empty({m}, x.options());
      std::copy(ids.begin(), ids.end(), out_ids.data_ptr<int64_t>());
      std::copy(e.begin(), e.end(), out_e.data_ptr<float>());
      return {out_ids, out_e};
    }
    double total = 0;
    for (int64_t i = 0; i < m; ++i) total += static_cast<double>(e[i]);
    return nucleus(ids, e, total, top_p);
  }
  // Top-p alone: the weights of the whole row, then the tokens above a threshold, lowered until they hold the
  // nucleus (every token outside is lighter than every one inside, so the nucleus is theirs: a prefix of them).
  thread_local std::vector<float> all;
  all.resize(n);
  const double total = weights_into(xp, n, peak, t, all.data());
  for (const float rung : RUNGS) {
    ids.clear();
    at_least(all.data(), n, rung, ids);
    double mass = 0;
    for (const int64_t i : ids) mass += static_cast<double>(all[i]);
    if (mass >= top_p * total * (1 + MASS_MARGIN) || rung == RUNGS[std::size(RUNGS) - 1]) break;
  }
  e.resize(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) e[i] = all[ids[i]];
  return nucleus(ids, e, total, top_p);
}

// The index u in [0, 1) picks: the first whose running sum passes u * total, the sums in float64 by blocks of
// DRAW_BLOCK (each block's in LANES lanes then in order; the blocks' in order), then one block's in order. Only a
// positive weight is picked. The weights must be nonnegative with a finite positive sum.
template <typename T>
int64_t draw_index(const T* w, int64_t n, double u) {
  const int64_t blocks = (n + DRAW_BLOCK - 1) / DRAW_BLOCK;
  thread_local std::vector<double> sums;
  sums.resize(blocks);
  double total = 0;
  for (int64_t b = 0; b < blocks; ++b) {
    double acc[LANES] = {};
    const int64_t lo = b * DRAW_BLOCK, hi = std::min(n, lo + DRAW_BLOCK);
    int64_t j = lo;
    for (; j + LANES <= hi; j += LANES)
      for (int l = 0; l < LANES; ++l) acc[l] += static_cast<double>(w[j + l]);
    for (int l = 0; j + l < hi; ++l) acc[l] += static_cast<double>(w[j + l]);
    double s = 0;
    for (int l = 0; l < LANES; ++l) s += acc[l];
    sums[b] = s;
    total += s;
  }
  TORCH_CHECK(std::isfinite(total) && total > 0, "sampling: the weights sum to ", total);
  const double target = u * total;
  double run = 0;
  int64_t last = -1;  // the last positive weight seen: u * total rounded up to the total picks it
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t lo = b * DRAW_BLOCK, hi = std::min(n, lo + DRAW_BLOCK);
    if (sums[b] > 0 && run + sums[b] <= target) {
      run += sums[b];
      for (int64_t i = hi - 1; i >= lo; --i)
        if (w[i] > 0) {
          last = i;
          break;
        }
      continue;
    }
    double r = run;
    for (int64_t i = lo; i < hi; ++i) {
      if (!(w[i] > 0)) continue;
      r += static_cast<double>(w[i]);
      last = i;
      if (r > target) return i;
    }
    run += sums[b];
  }
  return last;
}

int64_t sample_draw(const at::Tensor& w, double u) {
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 1 && w.stride(0) == 1 && w.size(0) > 0 &&
                  (w.scalar_type() == at::kFloat || w.scalar_type() == at::kDouble),
              "sample_draw: w must be a CPU float32 or float64 (n,) with n >= 1 and unit stride");
  TORCH_CHECK(u >= 0 && u < 1, "sample_draw: u must be in [0, 1)");
  if (w.scalar_type() == at::kFloat) return draw_index(w.const_data_ptr<float>(), w.size(0), u);
  return draw_index(w.const_data_ptr<double>(), w.size(0), u);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kakeya, m) {
  m.def("sample_weights(Tensor x, float temperature) -> Tensor");
  m.def("sample_support(Tensor x, float temperature, int top_k, float top_p) -> (Tensor, Tensor)");
  m.def("sample_draw(Tensor w, float u) -> int");
}

TORCH_LIBRARY_IMPL(kakeya, CPU, m) {
  m.impl("sample_weights", &sample_weights);
  m.impl("sample_support", &sample_support);
  m.impl("sample_draw", &sample_draw);
}
