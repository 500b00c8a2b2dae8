// What our kernels share: the vector ISA ATen's vec headers compile for, the headers, and two AVX-512 helpers
// that move or add lanes in one fixed pattern (transpose16, reduce16).
#pragma once

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
#include <ATen/ops/from_blob.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "amx.h"

// Ask for the cache line at p into L2 (timing only: a prefetch never faults). Inline asm, not _mm_prefetch: GCC 12
// vectorizes a loop of those and drops them (quant_dot_rows' once compiled to nothing on both machine kinds).
inline void prefetch_l2(const void* p) {
#if defined(__x86_64__)
  asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

#if defined(CPU_CAPABILITY_AVX2) && !defined(__AVX512F__)
// 8 elements widened to fp32 (bf16 -> fp32 is exact: the bits moved up 16).
template <typename T>
__attribute__((always_inline)) inline __m256 widen8(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_loadu_ps(p);
  } else {
    const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
  }
}

// Lane j: the sum of a[j]'s 8 lanes by at::vec's vec_reduce_all tree on AVX2, ((x0 + x4) + (x2 + x6)) +
// ((x1 + x5) + (x3 + x7)), the same bits, for 8 vectors in 13 operations instead of 8 x 6.
__attribute__((always_inline)) inline __m256 reduce8(const __m256* a) {
  __m256 t[4];  // t[i]: lanes k + (k + 4) of a[2i] (low half) and a[2i + 1] (high half)
  for (int i = 0; i < 4; ++i)
    t[i] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x20),
                         _mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x31));
  // u[i]: per half, (x0 + x2), (x1 + x3) of t[2i], then of t[2i + 1]
  const __m256 u0 = _mm256_add_ps(_mm256_shuffle_ps(t[0], t[1], 0x44), _mm256_shuffle_ps(t[0], t[1], 0xEE));
  const __m256 u1 = _mm256_add_ps(_mm256_shuffle_ps(t[2], t[3], 0x44), _mm256_shuffle_ps(t[2], t[3], 0xEE));
  // sums of a0, a2, a4, a6 | a1, a3, a5, a7, put in order
  return _mm256_permutevar8x32_ps(_mm256_hadd_ps(u0, u1), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// r (8 vectors of 8 lanes) transposed in place: lane j of r[i] becomes lane i of r[j] (values moved, not changed).
__attribute__((always_inline)) inline void transpose8(__m256* r) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i)
    for (int k = 0; k < 2; ++k) {
      u[4 * i + 2 * k] = _mm256_shuffle_ps(t[4 * i + k], t[4 * i + 2 + k], 0x44);
      u[4 * i + 2 * k + 1] = _mm256_shuffle_ps(t[4 * i + k], t[4 * i + 2 + k], 0xEE);
    }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x20);
    r[4 + i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x31);
  }
}

// linear_avx2's (invariant_linear.cpp) block, shared with quant_linear.cpp's many-row AVX2 path: per output element
// one fused multiply-add per K chunk of 8 in order from zero, K's last partial chunk from `pad`, at::vec's tree.
// RM x rows (fp32, zero-padded to whole chunks, `x_row` floats apart) against NJ consecutive W rows (`pad`: K's
// last partial chunk of each W row, zero-padded, at pad + j * 8); sums to out[r * out_row + j].
// `ahead` (decode rows): the next NJ W rows' bytes, asked for into L2 a slice per K chunk while these compute (timing
// only). Short row streams (18 cache lines for K = 576) leave the hardware prefetcher behind: a decode step read its
// weights at ~9 GB/s of the machine's ~17. Always inlined: called out of line, one W row block of a hot 1-row call
// took ~25% longer (1,536 x 576 bf16 on one thread: 67 -> 52 us inlined).
template <typename T, int RM, int NJ>
__attribute__((always_inline)) inline void avx2_block(const float* x, int64_t x_row, const T* w, int64_t K, const float* pad, float* out,
                       int64_t out_row, const char* ahead = nullptr) {
  using Vec = at::vec::Vectorized<float>;
  // The small loops unrolled by pragma and the prefetch a builtin: with loops and prefetch_l2's volatile asm in the
  // body, GCC kept acc in memory and stored every accumulator at every K chunk (8 stores bound an 8-chain loop).
  __m256 acc[RM][NJ];
#pragma GCC unroll 16
  for (int r = 0; r < RM; ++r)
#pragma GCC unroll 16
    for (int j = 0; j < NJ; ++j) acc[r][j] = _mm256_setzero_ps();
  const int64_t whole = K / 8 * 8;
  constexpr int64_t kAheadStep = NJ * 8 * static_cast<int64_t>(sizeof(T));  // the next rows' bytes per K chunk
  for (int64_t k = 0; k < whole; k += 8) {
    if (ahead != nullptr)
      for (int64_t c = 0; c < kAheadStep; c += 64) __builtin_prefetch(ahead + k / 8 * kAheadStep + c, 0, 2);
    __m256 wv[NJ];
#pragma GCC unroll 16
    for (int j = 0; j < NJ; ++j) wv[j] = widen8(w + j * K + k);
#pragma GCC unroll 16
    for (int r = 0; r < RM; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * x_row + k);
#pragma GCC unroll 16
      for (int j = 0; j < NJ; ++j) acc[r][j] = _mm256_fmadd_ps(xv, wv[j], acc[r][j]);
    }
  }
  if (whole < K) {
    for (int r = 0; r < RM; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * x_row + whole);
      for (int j = 0; j < NJ; ++j) acc[r][j] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(pad + j * 8), acc[r][j]);
    }
  }
  if constexpr (RM * NJ == 8) {  // at::vec's tree for 8 elements at once (reduce8: the same bits)
    __m256 flat[8];
    for (int r = 0; r < RM; ++r)
      for (int j = 0; j < NJ; ++j) flat[r * NJ + j] = acc[r][j];
    alignas(32) float sums[8];
    _mm256_store_ps(sums, reduce8(flat));
    for (int r = 0; r < RM; ++r)
      for (int j = 0; j < NJ; ++j) out[r * out_row + j] = sums[r * NJ + j];
    return;
  }
  for (int r = 0; r < RM; ++r)
    for (int j = 0; j < NJ; ++j)
      out[r * out_row + j] = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, Vec(acc[r][j]));
}
#endif

// kakeya::sparse_attention for the other kernels of the library (block_index.cpp's fused sparse step).
namespace kakeya_ops {
std::tuple<at::Tensor, at::Tensor> sparse_attention(const at::Tensor& q, const at::Tensor& hot_k,
                                                    const at::Tensor& hot_v, const at::Tensor& hot_pos,
                                                    const at::Tensor& cold_k, const at::Tensor& cold_v,
                                                    const std::optional<at::Tensor>& cold_k_scale,
                                                    const std::optional<at::Tensor>& cold_v_scale,
                                                    const at::Tensor& cold_slot, const at::Tensor& cold_head,
                                                    const at::Tensor& select, const at::Tensor& q_pos, int64_t window,
                                                    int64_t sink, int64_t block, double scale);
// kakeya::d4_points and kakeya::linear for the sparse step's decoded-block cache (block_index.cpp): the same
// functions the ops run, so a block decoded there is the bits kv/lattice.py's decode gives.
at::Tensor d4_points(const at::Tensor& code, const at::Tensor& scales, int64_t q, int64_t bits, int64_t codes);
void d4_points_into(const at::Tensor& code, const at::Tensor& scales, int64_t q, int64_t bits, int64_t codes,
                    at::Tensor& out);
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias, bool out_fp32);
// kakeya::linear into the caller's y (M, N): fp32 sums (+ bias), or rounded to x's dtype when y has it.
void linear_into(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias, at::Tensor& y);
// The ops one decoder layer's decode step runs, for decoder_layer.cpp (kakeya::decoder_layer): the same functions
// the ops run, called in the order layers.py calls the ops, so the layer's bits are the Python path's.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool unit_offset);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps, bool unit_offset);
std::tuple<at::Tensor, at::Tensor> qkv_rope(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                            int64_t heads, int64_t kv_heads, const std::optional<at::Tensor>& q_norm,
                                            const std::optional<at::Tensor>& k_norm, double eps, bool unit_offset);
at::Tensor gated_act(const at::Tensor& x, int64_t act);
// The sparse policy's decode step (block_index.cpp), for decoder_layer.cpp's kakeya::decoder_layer_sparse.
void ring_write(const at::Tensor& k_hot, const at::Tensor& v_hot, const at::Tensor& hot_pos, const at::Tensor& k,
                const at::Tensor& v, const at::Tensor& positions, int64_t slot);
std::tuple<at::Tensor, at::Tensor> sparse_step(
    const at::Tensor& q, const at::Tensor& hot_k, const at::Tensor& hot_v, const at::Tensor& hot_pos,
    const at::Tensor& cold_k, const at::Tensor& cold_v, const std::optional<at::Tensor>& cold_k_scale,
    const std::optional<at::Tensor>& cold_v_scale, const at::Tensor& cold_slot, const at::Tensor& cold_head,
    const at::Tensor& kmin, const at::Tensor& kmax, int64_t n_blocks, const at::Tensor& head_topk,
    const at::Tensor& q_pos, int64_t window, int64_t sink, int64_t block, double scale, const at::Tensor& counters,
    double budget, int64_t budget_topk);
std::tuple<at::Tensor, at::Tensor, int64_t, int64_t> sparse_step_decoded(
    const at::Tensor& q, const at::Tensor& hot_k, const at::Tensor& hot_v, const at::Tensor& hot_pos,
    const at::Tensor& cold_head, const at::Tensor& kmin, const at::Tensor& kmax, int64_t n_blocks,
    const at::Tensor& head_topk, const at::Tensor& q_pos, int64_t window, int64_t sink, int64_t block, double scale,
    const at::Tensor& counters, double budget, const at::Tensor& block_slot, const at::Tensor& slot_block,
    const at::Tensor& slot_used, int64_t step, const at::Tensor& k_code, const at::Tensor& k_scale,
    const at::Tensor& v_code, const at::Tensor& v_scale, const at::Tensor& rot, const at::Tensor& dec_k,
    const at::Tensor& dec_v, int64_t lattice_q, int64_t bits, int64_t codes,
    const std::optional<at::Tensor>& selected, int64_t budget_topk);
at::Tensor cached_attention_rows_append(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new,
                                        at::TensorList k, at::TensorList v, at::TensorList k_pos,
                                        at::IntArrayRef slot, at::IntArrayRef count, at::IntArrayRef write_pos,
                                        const at::Tensor& q_pos, at::IntArrayRef window, at::IntArrayRef sink,
                                        double scale);
at::Tensor cached_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& q_pos,
                            const at::Tensor& k_pos, int64_t window, int64_t sink, double scale);
// Whether this thread is inside a step whose ops reuse their outputs (ReuseScope, reusable_empty below): one flag
// for all the library's files (the helpers below are each file's own).
inline thread_local bool reusing = false;
}  // namespace kakeya_ops

namespace {

// Per-thread scratch kept across calls: slot `slot`'s buffer of at least n elements of T, 64-byte aligned (tile rows
// start on a cache line), contents unspecified. A decode step's work items took their staging buffers from the heap
// each (aligned_alloc walks a fragmented heap: a few percent of a step); a caller uses each slot for one buffer at
// a time and asks only for small sizes (the buffer is kept, at its largest, for the thread's life).
template <typename T>
inline T* scratch(int slot, size_t n) {
  struct Buf {
    void* p = nullptr;
    size_t bytes = 0;
    ~Buf() { std::free(p); }
  };
  thread_local Buf bufs[8];
  Buf& b = bufs[slot];
  const size_t need = std::max<size_t>(64, (n * sizeof(T) + 63) / 64 * 64);
  if (need > b.bytes) {
    std::free(b.p);
    b.p = std::aligned_alloc(64, need);
    TORCH_CHECK(b.p != nullptr, "scratch: out of memory for ", need, " bytes");
    b.bytes = need;
  }
  return static_cast<T*>(b.p);
}

// Rows a thread takes at least in a row-wise op (norm, RoPE, gated activation) of `width` elements a row: ~2k
// elements, so a batched step's 8 rows split evenly over two threads (they ran on one: an 8-row SmolLM2 step 1.6-3.1%
// faster, results/concurrent/row_grain_epyc) and a lone row stays on its thread. Rows are independent, so the split
// never changes a bit.
inline int64_t row_grain(int64_t width) { return std::max<int64_t>(1, 2048 / std::max<int64_t>(1, width)); }

constexpr size_t kScratchBytes = 1 << 20;  // a call's buffers up to this size come from scratch, larger ones not

// A buffer a thread keeps across calls (so a decode step calls no allocator) is let go after a call that grew it past
// kScratchBytes: a long prompt's buffers are not held for the thread's life.
template <typename V>
inline void release_if_large(V& v) {
  if (v.capacity() * sizeof(typename V::value_type) > kScratchBytes) V().swap(v);
}

// Inside a whole decode step in one native call (kakeya.DecoderStack), an op's output is kept by its call site
// (thread_local) and handed out again once nothing else holds it or a view of it: the step's outputs (a few rows of
// a projection's width) then cost no allocator call (posix_memalign, free and heap consolidation were ~3% of a
// SmolLM2 int4 step's main thread: 336 allocations a step, now none in its layers). Only there: a tensor handed to
// Python stays referenced by its Python object once dropped (PyTorch's preservation), so ops called from Python
// allocate as before. Only small outputs are kept, so no call site keeps megabytes alive. The caller gets a tensor
// no one else can see, as from at::empty: its contents are unspecified.
struct ReuseScope {  // the step's extent; nests
  bool before = kakeya_ops::reusing;
  ReuseScope() { kakeya_ops::reusing = true; }
  ~ReuseScope() { kakeya_ops::reusing = before; }
};
struct Reusable {
  static constexpr int kKept = 4;  // a layer's projections: qkv, o and down (alive at once), gate/up
  at::Tensor kept[kKept];
  int next = 0;  // the one let go when every kept output is held elsewhere
};
constexpr size_t kReusableBytes = 64 << 10;
inline at::Tensor reusable_empty(Reusable& site, at::IntArrayRef sizes, const at::TensorOptions& options) {
  size_t bytes = options.dtype().itemsize();
  for (const int64_t n : sizes) bytes *= static_cast<size_t>(n);
  if (!kakeya_ops::reusing || bytes > kReusableBytes) return at::empty(sizes, options);
  const bool inference = c10::InferenceMode::is_enabled();
  const auto unheld = [](const at::Tensor& t) { return t.use_count() == 1 && t.storage().use_count() == 1; };
  for (const at::Tensor& t : site.kept)
    if (t.defined() && unheld(t) && t.sizes() == sizes && t.dtype() == options.dtype() &&
        t.is_inference() == inference)
      return t;
  for (at::Tensor& t : site.kept)
    if (!t.defined() || unheld(t)) return t = at::empty(sizes, options);
  // every kept one is held elsewhere (a cache may keep an output as it is): the oldest is left to its holder
  at::Tensor& t = site.kept[site.next];
  site.next = (site.next + 1) % Reusable::kKept;
  return t = at::empty(sizes, options);
}

// n elements from src to dst: a copy when both are fp32, else at::vec::convert (bf16 <-> fp32, round to nearest
// even, as the scalar conversion does).
template <typename S, typename D>
inline void convert_row(const S* src, D* dst, int64_t n) {
  if constexpr (std::is_same_v<S, D>) {
    std::copy(src, src + n, dst);
  } else {
    at::vec::convert(src, dst, n);
  }
}

// kakeya::linear rounds a row's output in items of kLinearItemCols columns, at::vec's conversion taking them 32 at a
// time and the rest one by one (the two differ on NaN only). Kernels that produce the same elements 16 columns at a
// time round them alike: whether columns n0 .. n0 + 15 (n0 a multiple of 16) of N fall in a 32-wide step (then all
// 16 exist)...
constexpr int64_t kLinearItemCols = 64;
inline bool linear_rounds_wide(int64_t n0, int64_t N) {
  const int64_t item0 = n0 / kLinearItemCols * kLinearItemCols;
  return n0 - item0 < std::min<int64_t>(kLinearItemCols, N - item0) / 32 * 32;
}

// ... and their rounding: the 16 sums through the 32-wide conversion (wide), or the first n one by one.
template <typename D>
inline void round16_as_linear(const float* sum, D* dst, int64_t n, bool wide) {
  if (wide) {
    alignas(64) float pad[32] = {};
    alignas(64) D out[32];
    std::copy(sum, sum + 16, pad);
    convert_row(pad, out, 32);
    std::copy(out, out + 16, dst);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<D>(sum[i]);
  }
}

}  // namespace

#if defined(__AVX512F__)
namespace {

// r[c] = column c of the 16 x 16 floats whose row i is r[i], in registers (the unpack/shuffle network).
inline void transpose16_regs(__m512* r) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 2]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 1]), d = _mm512_castps_pd(t[4 * i + 3]);
    r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
  }
  // r[4i + j] holds, in 128-bit lane L, column j of rows 4i..4i+3 for columns 4L + j
  for (int j = 0; j < 4; ++j) {
    t[j] = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x88);       // lanes 0,2 of rows 0-3 | lanes 0,2 of rows 4-7
    t[4 + j] = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xdd);   // lanes 1,3
    t[8 + j] = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x88);
    t[12 + j] = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xdd);
  }
  for (int j = 0; j < 4; ++j) {
    r[j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0x88);            // column j
    r[j + 8] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0xdd);        // column j + 8
    r[j + 4] = _mm512_shuffle_f32x4(t[4 + j], t[12 + j], 0x88);   // column j + 4
    r[j + 12] = _mm512_shuffle_f32x4(t[4 + j], t[12 + j], 0xdd);  // column j + 12
  }
}

// out = in^T for 16 x 16 floats (rows 16 floats apart).
inline void transpose16(const float* in, float* out) {
  __m512 r[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(in + 16 * i);
  transpose16_regs(r);
  for (int c = 0; c < 16; ++c) _mm512_storeu_ps(out + 16 * c, r[c]);
}

// Sixteen vectors to one: lane j is the sum of a[j]'s lanes, every a[j] through the same tree of adds.
inline __m512 reduce16(const __m512* a) {
  __m512 b[8], c[4];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 e0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 e1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(e0, e1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(e0, e1, _MM_SHUFFLE(3, 1, 3, 1)));
}

}  // namespace
#endif

#if defined(KAKEYA_AMX)
namespace {
// x^T in pairs, zero-padded to whole 16-row blocks: (mblocks, K/2, 16) uint32 = (x[m][2p], x[m][2p+1]), built by
// 16 x 16 transposes of (rows, pairs) blocks.
inline void pack_x(const uint32_t* xp, int64_t x_row, int64_t M, int64_t pairs, uint32_t* xt) {
  alignas(64) uint32_t in[256], out[256];
  for (int64_t mb = 0; mb < (M + 15) / 16; ++mb) {
    const int64_t rows = std::min<int64_t>(16, M - mb * 16);
    for (int64_t p0 = 0; p0 < pairs; p0 += 16) {
      for (int64_t r = 0; r < 16; ++r) {
        if (r < rows) std::memcpy(in + r * 16, xp + (mb * 16 + r) * x_row + p0, 64);
        else std::memset(in + r * 16, 0, 64);
      }
      transpose16(reinterpret_cast<const float*>(in), reinterpret_cast<float*>(out));
      std::memcpy(xt + (mb * pairs + p0) * 16, out, sizeof(out));
    }
  }
}

// The many-row AMX GEMM step shared by kakeya::linear (invariant_linear.cpp) and kakeya::quant_linear
// (quant_linear.cpp), so both issue one tdpbf16ps sequence and a quantized weight gives linear's bits on W'.
// NM x NN C tiles: A tile s of x block im at a + im * a_block + 32s (rows a_stride bytes apart); B tile s of W
// block in at b + (in * steps + s) * 512. c: row-major [NM * 16][NN * 16].
template <int NM, int NN>
inline void amx_rows(const c10::BFloat16* a, int64_t a_block, int64_t a_stride, const c10::BFloat16* b,
                     int64_t steps, float* c) {
  _tile_zero(0);
  if constexpr (NN > 1) _tile_zero(1);
  if constexpr (NM > 1) _tile_zero(2);
  if constexpr (NM > 1 && NN > 1) _tile_zero(3);
  for (int64_t s = 0; s < steps; ++s) {
    _tile_loadd(4, b + s * 512, 64);
    if constexpr (NN > 1) _tile_loadd(5, b + (steps + s) * 512, 64);
    _tile_loadd(6, a + s * 32, a_stride);
    if constexpr (NM > 1) _tile_loadd(7, a + a_block + s * 32, a_stride);
    _tile_dpbf16ps(0, 6, 4);
    if constexpr (NN > 1) _tile_dpbf16ps(1, 6, 5);
    if constexpr (NM > 1) _tile_dpbf16ps(2, 7, 4);
    if constexpr (NM > 1 && NN > 1) _tile_dpbf16ps(3, 7, 5);
  }
  constexpr int64_t row = NN * 16;
  _tile_stored(0, c, row * 4);
  if constexpr (NN > 1) _tile_stored(1, c + 16, row * 4);
  if constexpr (NM > 1) _tile_stored(2, c + 16 * row, row * 4);
  if constexpr (NM > 1 && NN > 1) _tile_stored(3, c + 16 * row + 16, row * 4);
}
}  // namespace
#endif
