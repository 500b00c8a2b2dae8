// The decoder layers' row-wise work in one pass each: RMSNorm (kakeya::rms_norm, optionally after the residual add
// before it, kakeya::add_rms_norm) and rotate-half RoPE over the fused QKV projection's q and k heads, optionally
// after Gemma's per-head norms (kakeya::qkv_rope).
//
// Every value is computed in fp32 and rounded once to the activation dtype. A row (a token's hidden state, or one
// head of a token's q or k) goes through the same vector code whatever the call holds: the sum of squares in VS
// lanes chunk by chunk (a short tail through the same ops, masked to zeros), the lanes summed in one fixed order,
// and elementwise ops otherwise; threads take whole rows. So a row's result depends on its own inputs only: the same
// bits in a decode step, a batched step, a chunk or a prompt, at any thread count.

#include "common.h"

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int VS = Vec::size();

// 1 / sqrt(mean(h^2) + eps) over h[0..n).
float inv_rms(const float* h, int64_t n, float eps) {
  Vec acc(0.f);
  for (int64_t j = 0; j < n; j += VS) {
    const Vec a = Vec::loadu(h + j, std::min<int64_t>(VS, n - j));
    acc = acc + a * a;
  }
  alignas(64) float lanes[VS];
  acc.store(lanes);
  float ss = 0.f;
  for (int i = 0; i < VS; ++i) ss += lanes[i];
  return 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
}

// h[j] *= r * w[j] in place.
void scale_row(float* h, int64_t n, float r, const float* w) {
  const Vec rv(r);
  for (int64_t j = 0; j < n; j += VS) {
    const int64_t c = std::min<int64_t>(VS, n - j);
    (Vec::loadu(h + j, c) * rv * Vec::loadu(w + j, c)).store(h + j, c);
  }
}

// The norm's scale in fp32: w, or 1 + w where the checkpoint stores an offset (Gemma); the same values as
// converting w and adding 1 in fp32. In the calling thread's buffer `slot` (0, 1: a call's q and k norms), kept
// across calls: a decode step's ~100 norms each converted the weight as a tensor op and allocated twice.
const float* norm_scale(const at::Tensor& w, int64_t n, bool unit_offset, int slot = 0) {
  TORCH_CHECK(w.dim() == 1 && w.size(0) == n, "norm weight must be (", n, ",)");
  thread_local std::vector<float> bufs[2];
  std::vector<float>& out = bufs[slot];
  out.resize(n);
  const int64_t stride = w.stride(0);
  if (w.scalar_type() == at::kBFloat16) {
    const c10::BFloat16* p = w.const_data_ptr<c10::BFloat16>();
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(p[i * stride]);
  } else if (w.scalar_type() == at::kFloat) {
    const float* p = w.const_data_ptr<float>();
    for (int64_t i = 0; i < n; ++i) out[i] = p[i * stride];
  } else {
    const at::Tensor w32 = w.to(at::kFloat).contiguous();
    std::copy(w32.const_data_ptr<float>(), w32.const_data_ptr<float>() + n, out.begin());
  }
  if (unit_offset) {
    for (auto& v : out) v = 1.f + v;
  }
  return out.data();
}

// y = norm(s) for rows s = x (+ r, rounded to T and written to sp when r is given).
template <typename T>
void norm_rows(const T* xp, int64_t x_row, const T* rp, int64_t r_row, T* sp, T* yp, const float* w, int64_t C,
               int64_t M, float eps) {
  at::parallel_for(0, M, row_grain(C), [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> h, r;  // kept across calls: no heap call per norm
    h.resize(C);
    r.resize(rp ? C : 0);
    for (int64_t m = begin; m < end; ++m) {
      convert_row(xp + m * x_row, h.data(), C);
      if (rp) {
        convert_row(rp + m * r_row, r.data(), C);
        for (int64_t j = 0; j < C; j += VS) {
          const int64_t c = std::min<int64_t>(VS, C - j);
          (Vec::loadu(h.data() + j, c) + Vec::loadu(r.data() + j, c)).store(h.data() + j, c);
        }
        convert_row(h.data(), sp + m * C, C);
        convert_row(sp + m * C, h.data(), C);  // the norm reads the sum as stored
      }
      scale_row(h.data(), C, inv_rms(h.data(), C, eps), w);
      convert_row(h.data(), yp + m * C, C);
    }
  });
}

void check_rows(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.device().is_cpu(), what, ": CPU only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, what, ": x (M, C) with contiguous rows");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, what, ": float32 or bfloat16");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool unit_offset) {
  check_rows(x, "rms_norm");
  const int64_t M = x.size(0), C = x.size(1);
  thread_local Reusable out;
  auto y = reusable_empty(out, {M, C}, x.options());
  if (M == 0 || C == 0) return y;
  const float* w = norm_scale(weight, C, unit_offset);
  if (x.scalar_type() == at::kFloat) {
    norm_rows<float>(x.const_data_ptr<float>(), x.stride(0), nullptr, 0, nullptr, y.data_ptr<float>(), w, C, M,
                     static_cast<float>(eps));
  } else {
    norm_rows<c10::BFloat16>(x.const_data_ptr<c10::BFloat16>(), x.stride(0), nullptr, 0, nullptr,
                             y.data_ptr<c10::BFloat16>(), w, C, M, static_cast<float>(eps));
  }
  return y;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps, bool unit_offset) {
  check_rows(x, "add_rms_norm");
  check_rows(residual, "add_rms_norm");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(),
              "add_rms_norm: residual must match x");
  const int64_t M = x.size(0), C = x.size(1);
  thread_local Reusable sum_out, out;
  auto s = reusable_empty(sum_out, {M, C}, x.options());
  auto y = reusable_empty(out, {M, C}, x.options());
  if (M == 0 || C == 0) return {s, y};
  const float* w = norm_scale(weight, C, unit_offset);
  if (x.scalar_type() == at::kFloat) {
    norm_rows<float>(x.const_data_ptr<float>(), x.stride(0), residual.const_data_ptr<float>(), residual.stride(0),
                     s.data_ptr<float>(), y.data_ptr<float>(), w, C, M, static_cast<float>(eps));
  } else {
    norm_rows<c10::BFloat16>(x.const_data_ptr<c10::BFloat16>(), x.stride(0),
                             residual.const_data_ptr<c10::BFloat16>(), residual.stride(0),
                             s.data_ptr<c10::BFloat16>(), y.data_ptr<c10::BFloat16>(), w, C, M,
                             static_cast<float>(eps));
  }
  return {s, y};
}

// q and k heads of qkv (B, T, >= (H + 2 Hk) D) rows [q heads | k heads | v heads]: each head (optionally RMS-normed
// with qw / kw first) rotated by the (b, t) rows of cos / sin, written to q (B, H, T, D) and k (B, Hk, T, D).
template <typename T>
void rope_rows(const T* xp, int64_t xb, int64_t xt, const T* cp, const T* sp, int64_t cb, int64_t ct, T* qp, T* kp,
               int64_t B, int64_t Tn, int64_t H, int64_t Hk, int64_t D, const float* qw, const float* kw, float eps) {
  const int64_t half = D / 2;
  at::parallel_for(0, B * Tn, row_grain((H + Hk) * D), [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> c, s, h, o;  // kept across calls: no heap call per step
    c.resize(D), s.resize(D), h.resize(D), o.resize(D);
    for (int64_t bt = begin; bt < end; ++bt) {
      const int64_t b = bt / Tn, t = bt % Tn;
      convert_row(cp + b * cb + t * ct, c.data(), D);
      convert_row(sp + b * cb + t * ct, s.data(), D);
      const T* row = xp + b * xb + t * xt;
      for (int64_t head = 0; head < H + Hk; ++head) {
        const bool is_q = head < H;
        convert_row(row + head * D, h.data(), D);
        const float* w = is_q ? qw : kw;
        if (w) scale_row(h.data(), D, inv_rms(h.data(), D, eps), w);
        for (int64_t j = 0; j < half; j += VS) {  // [x1 | x2] -> [x1 c1 - x2 s1 | x2 c2 + x1 s2]
          const int64_t n = std::min<int64_t>(VS, half - j);
          const Vec x1 = Vec::loadu(h.data() + j, n), x2 = Vec::loadu(h.data() + half + j, n);
          (x1 * Vec::loadu(c.data() + j, n) - x2 * Vec::loadu(s.data() + j, n)).store(o.data() + j, n);
          (x2 * Vec::loadu(c.data() + half + j, n) + x1 * Vec::loadu(s.data() + half + j, n))
              .store(o.data() + half + j, n);
        }
        T* dst = is_q ? qp + ((b * H + head) * Tn + t) * D : kp + ((b * Hk + head - H) * Tn + t) * D;
        convert_row(o.data(), dst, D);
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> qkv_rope(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                            int64_t heads, int64_t kv_heads, const std::optional<at::Tensor>& q_norm,
                                            const std::optional<at::Tensor>& k_norm, double eps, bool unit_offset) {
  TORCH_CHECK(qkv.device().is_cpu(), "qkv_rope: CPU only");
  TORCH_CHECK(qkv.dim() == 3 && qkv.stride(2) == 1, "qkv_rope: qkv (B, T, C) with contiguous rows");
  TORCH_CHECK(qkv.scalar_type() == at::kFloat || qkv.scalar_type() == at::kBFloat16, "qkv_rope: float32 or bfloat16");
  const int64_t B = qkv.size(0), Tn = qkv.size(1), D = cos.size(-1);
  TORCH_CHECK(cos.dim() == 3 && cos.size(0) == B && cos.size(1) == Tn && cos.stride(2) == 1 &&
                  sin.sizes() == cos.sizes() && sin.strides() == cos.strides(),
              "qkv_rope: cos, sin (B, T, D) alike, contiguous rows (broadcast rows allowed)");
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(),
              "qkv_rope: cos and sin in qkv's dtype");
  TORCH_CHECK(D % 2 == 0 && qkv.size(2) >= (heads + 2 * kv_heads) * D, "qkv_rope: qkv holds (H + 2 Hk) heads of ",
              "even size D");
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "qkv_rope: q and k norms together");
  thread_local Reusable q_out, k_out;
  auto q = reusable_empty(q_out, {B, heads, Tn, D}, qkv.options());
  auto k = reusable_empty(k_out, {B, kv_heads, Tn, D}, qkv.options());
  if (q.numel() == 0 && k.numel() == 0) return {q, k};
  const float* qwp = q_norm.has_value() ? norm_scale(*q_norm, D, unit_offset, 0) : nullptr;
  const float* kwp = k_norm.has_value() ? norm_scale(*k_norm, D, unit_offset, 1) : nullptr;
  if (qkv.scalar_type() == at::kFloat) {
    rope_rows<float>(qkv.const_data_ptr<float>(), qkv.stride(0), qkv.stride(1), cos.const_data_ptr<float>(),
                     sin.const_data_ptr<float>(), cos.stride(0), cos.stride(1), q.data_ptr<float>(),
                     k.data_ptr<float>(), B, Tn, heads, kv_heads, D, qwp, kwp, static_cast<float>(eps));
  } else {
    using BF = c10::BFloat16;
    rope_rows<BF>(qkv.const_data_ptr<BF>(), qkv.stride(0), qkv.stride(1), cos.const_data_ptr<BF>(),
                  sin.const_data_ptr<BF>(), cos.stride(0), cos.stride(1), q.data_ptr<BF>(), k.data_ptr<BF>(), B, Tn,
                  heads, kv_heads, D, qwp, kwp, static_cast<float>(eps));
  }
  return {q, k};
}

}  // namespace

namespace kakeya_ops {
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool unit_offset) {
  return ::rms_norm(x, weight, eps, unit_offset);
}
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps, bool unit_offset) {
  return ::add_rms_norm(x, residual, weight, eps, unit_offset);
}
std::tuple<at::Tensor, at::Tensor> qkv_rope(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                            int64_t heads, int64_t kv_heads, const std::optional<at::Tensor>& q_norm,
                                            const std::optional<at::Tensor>& k_norm, double eps, bool unit_offset) {
  return ::qkv_rope(qkv, cos, sin, heads, kv_heads, q_norm, k_norm, eps, unit_offset);
}
}  // namespace kakeya_ops

TORCH_LIBRARY_FRAGMENT(kakeya, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, bool unit_offset) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps, bool unit_offset) -> (Tensor, Tensor)");
  m.def("qkv_rope(Tensor qkv, Tensor cos, Tensor sin, int heads, int kv_heads, Tensor? q_norm, Tensor? k_norm, "
        "float eps, bool unit_offset) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(kakeya, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("qkv_rope", &qkv_rope);
}
