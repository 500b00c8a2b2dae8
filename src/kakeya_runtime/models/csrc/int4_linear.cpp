// y = x W^T (+ b) for weight-only int4 W in PyTorch's CPU int4 layout (aten._convert_weight_to_int4pack_for_cpu),
// bf16 x, on AVX512-BF16 dot products: kakeya::int4_linear. Each output element by one fixed sequence of
// operations, whatever the number of rows in the call (a decode step, a verifier step, a prefill chunk).
//
// Layout read (engine/weights.py _unpack_int4): W's rows in blocks of 64; a block is (K, 32) bytes, byte [k][j]
// holding row j's code at k in its low nibble and row j + 32's in its high nibble. scales_zeros (K/G, N, 2) bf16:
// w[n][k] = (q - 8) * s + z for the group g = k / G. Per output element n, for each group in order:
//   acc_g = sum over k in g, in pairs (k, k+1) in order, of (128 + q) * x[k]   (vdpbf16ps into a zeroed lane:
//           128 + q is bf16 0x4300 | q, exact, so the codes become bf16 with two bit operations)
//   y += s * acc_g;  y += (z - 136 s) * xsum_g                                  (xsum_g: x's group sum, fp32, in order)
// since (q - 8) = (128 + q) - 136. Bias is added in fp32, then one rounding to bf16.
// Rows of the output are lanes (16 per vector, 64 per block); threads split the blocks, never K. Calls of more
// than one row decode a block's codes once into a buffer and run every row of x over it (the same bf16 operands,
// the same instruction sequence per element as one row).

#include "common.h"

namespace {

#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
constexpr bool kInt4Native = true;

constexpr int64_t kBlock = 64;  // output rows per block of the packed layout

// vpermb indices: from the 64 bytes of k and k+1 (a_j = byte j, b_j = byte 32 + j), dword j = (a_j, a_j, b_j, b_j) for
// the 16 j of one half (j0 = 0 or 16). The low nibbles of a dword's words are then row j's codes at (k, k+1), the
// high nibbles row j + 32's.
inline __m512i pair_index(int j0) {
  alignas(64) uint8_t idx[64];
  for (int j = 0; j < 16; ++j) {
    idx[4 * j] = idx[4 * j + 1] = static_cast<uint8_t>(j0 + j);
    idx[4 * j + 2] = idx[4 * j + 3] = static_cast<uint8_t>(32 + j0 + j);
  }
  return _mm512_load_si512(idx);
}

// Four vectors of bf16 pairs (128 + q at k, 128 + q at k+1) for the 64 rows of a block, from its 64 bytes at k
// (k even): w[0] rows 0-15, w[1] rows 32-47, w[2] rows 16-31, w[3] rows 48-63.
struct Decoder {
  __m512i lo_idx = pair_index(0), hi_idx = pair_index(16);
  __m512i mask = _mm512_set1_epi32(0x000F000F), base = _mm512_set1_epi32(0x43004300);

  inline void operator()(const uint8_t* bytes, __m512i* w) const {
    const __m512i v = _mm512_loadu_si512(bytes);
    const __m512i a = _mm512_permutexvar_epi8(lo_idx, v), b = _mm512_permutexvar_epi8(hi_idx, v);
    // (v & mask) | base in one vpternlogd: imm 0xF8 = A | (B & C) with A = base
    w[0] = _mm512_ternarylogic_epi32(base, a, mask, 0xF8);
    w[1] = _mm512_ternarylogic_epi32(base, _mm512_srli_epi32(a, 4), mask, 0xF8);
    w[2] = _mm512_ternarylogic_epi32(base, b, mask, 0xF8);
    w[3] = _mm512_ternarylogic_epi32(base, _mm512_srli_epi32(b, 4), mask, 0xF8);
  }
};

constexpr int kLaneRow[4] = {0, 32, 16, 48};  // first row of the block each decoded vector's lanes hold

// One x row over one block: y[64] (fp32, natural row order) = sum over groups of s * acc_g + (z - 136 s) * xsum_g.
// `decoded` (multi-row calls): the block's decoded pairs, 4 vectors per k pair; else decode from `codes`.
template <bool kDecoded>
inline void block_row(const uint8_t* codes, const __m512i* decoded, const Decoder& dec, const uint32_t* sz,
                      int64_t N, int64_t n0, const c10::BFloat16* x, const float* xsum, int64_t K, int64_t G,
                      float* y) {
  __m512 total[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  const __m512 c136 = _mm512_set1_ps(136.f);
  const auto* xp = reinterpret_cast<const uint32_t*>(x);
  for (int64_t g = 0; g < K / G; ++g) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t k = g * G; k < (g + 1) * G; k += 2) {
      __m512i w[4];
      if constexpr (kDecoded) {
        const __m512i* d = decoded + (k / 2) * 4;
        w[0] = _mm512_load_si512(d);
        w[1] = _mm512_load_si512(d + 1);
        w[2] = _mm512_load_si512(d + 2);
        w[3] = _mm512_load_si512(d + 3);
      } else {
        dec(codes + k * 32, w);
      }
      const __m512bh xx = (__m512bh)_mm512_set1_epi32(static_cast<int>(xp[k / 2]));
      for (int i = 0; i < 4; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)w[i], xx);
    }
    const __m512 xs = _mm512_set1_ps(xsum[g]);
    const uint32_t* szg = sz + g * N + n0;
    for (int i = 0; i < 4; ++i) {
      const __m512i p = _mm512_loadu_si512(szg + kLaneRow[i]);
      const __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(p, 16));
      const __m512 z = _mm512_castsi512_ps(_mm512_and_si512(p, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
      total[i] = _mm512_fmadd_ps(acc[i], s, total[i]);
      total[i] = _mm512_fmadd_ps(_mm512_fnmadd_ps(c136, s, z), xs, total[i]);
    }
  }
  for (int i = 0; i < 4; ++i) _mm512_storeu_ps(y + kLaneRow[i], total[i]);
}

void int4_rows(const c10::BFloat16* xp, int64_t x_row, const uint8_t* packed, const uint32_t* sz, const float* bias,
               c10::BFloat16* yp, int64_t M, int64_t N, int64_t K, int64_t G) {
  // xsum (M, K/G): each row's group sums in fp32, in order
  std::vector<float> xsum(M * (K / G));
  for (int64_t m = 0; m < M; ++m) {
    const c10::BFloat16* row = xp + m * x_row;
    for (int64_t g = 0; g < K / G; ++g) {
      float s = 0.f;
      for (int64_t k = g * G; k < (g + 1) * G; ++k) s += static_cast<float>(row[k]);
      xsum[m * (K / G) + g] = s;
    }
  }
  const int64_t blocks = N / kBlock;
  static const int64_t grain = std::getenv("KAKEYA_INT4_GRAIN") ? std::atoll(std::getenv("KAKEYA_INT4_GRAIN")) : 1;
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    const Decoder dec;
    std::vector<__m512i> decoded(M > 1 ? K * 2 : 0);  // K/2 pairs x 4 vectors
    alignas(64) float y[kBlock];
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * kBlock;
      const uint8_t* codes = packed + n0 * K / 2;
      if (M > 1) {
        for (int64_t k = 0; k < K; k += 2) dec(codes + k * 32, decoded.data() + (k / 2) * 4);
      }
      for (int64_t m = 0; m < M; ++m) {
        if (M > 1) {
          block_row<true>(codes, decoded.data(), dec, sz, N, n0, xp + m * x_row, xsum.data() + m * (K / G), K, G, y);
        } else {
          block_row<false>(codes, nullptr, dec, sz, N, n0, xp + m * x_row, xsum.data() + m * (K / G), K, G, y);
        }
        for (int i = 0; i < kBlock / 16; ++i) {
          __m512 v = _mm512_load_ps(y + 16 * i);
          if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + n0 + 16 * i));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(yp + m * N + n0 + 16 * i), (__m256i)_mm512_cvtneps_pbh(v));
        }
      }
    }
  });
}
#else
constexpr bool kInt4Native = false;
#endif

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales_zeros, int64_t group,
                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(kInt4Native, "int4_linear: built without AVX512-BF16 / VBMI");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1,
              "int4_linear: x (M, K) bf16 with contiguous rows");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(scales_zeros.dim() == 3 && scales_zeros.size(2) == 2 && scales_zeros.scalar_type() == at::kBFloat16 &&
                  scales_zeros.is_contiguous(), "int4_linear: scales_zeros (K/G, N, 2) bf16, contiguous");
  const int64_t N = scales_zeros.size(1);
  TORCH_CHECK(group > 0 && group % 2 == 0 && K % group == 0 && scales_zeros.size(0) == K / group,
              "int4_linear: K must be a multiple of the (even) group size");
  TORCH_CHECK(N % 64 == 0, "int4_linear: N must be a multiple of 64 (whole blocks of the packed layout)");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.numel() == N * K / 2,
              "int4_linear: packed (N, K/2) uint8");
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  at::Tensor b32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "int4_linear: bias must be (N,)");
    b32 = bias->to(at::kFloat).contiguous();
  }
#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
  int4_rows(x.const_data_ptr<c10::BFloat16>(), x.stride(0), packed.const_data_ptr<uint8_t>(),
            reinterpret_cast<const uint32_t*>(scales_zeros.const_data_ptr<c10::BFloat16>()),
            bias.has_value() ? b32.const_data_ptr<float>() : nullptr, y.data_ptr<c10::BFloat16>(), M, N, K, group);
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kakeya, m) {
  m.def("int4_linear(Tensor x, Tensor packed, Tensor scales_zeros, int group, Tensor? bias) -> Tensor");
  m.def("int4_native() -> bool", [] { return kInt4Native; });
}

TORCH_LIBRARY_IMPL(kakeya, CPU, m) { m.impl("int4_linear", &int4_linear); }
