// The D4 lattice codec's decode up to the rotation: kakeya::d4_points turns packed codes (N, nbytes) uint8 (code
// j in bits [j * bits, (j + 1) * bits) of a little-endian stream per vector) and their fp16 scales (N, 2) =
// (norm, qmax) into the scaled lattice points y_hat (N, 4 * K) fp32: index -> 2 * index in radix 2Q + 1, four
// digits, most significant first -> digit - Q -> * (qmax / Q). Integer math and the two fp32 operations of
// kv/lattice.py (LatticeCodec.point, dequantize), so the same bits; the Hadamard rotation stays in Python.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

namespace {

// Into out (N, 4 * K) fp32, contiguous: a caller that keeps its own buffer.
void d4_points_into(const at::Tensor& code, const at::Tensor& scales, int64_t q, int64_t bits, int64_t codes,
                    at::Tensor& out) {
  TORCH_CHECK(code.dim() == 2 && code.scalar_type() == at::kByte && code.is_contiguous() && code.is_cpu(),
              "d4_points: code must be contiguous uint8 (N, nbytes) on the CPU");
  TORCH_CHECK(scales.dim() == 2 && scales.scalar_type() == at::kHalf && scales.is_contiguous() &&
                  scales.size(0) == code.size(0) && scales.size(1) == 2,
              "d4_points: scales must be contiguous fp16 (N, 2)");
  TORCH_CHECK(q >= 1 && bits >= 1 && bits <= 62 && codes >= 1 && code.size(1) == (codes * bits + 7) / 8,
              "d4_points: need q >= 1, 1 <= bits <= 62 and (codes * bits + 7) / 8 bytes per vector");
  const int64_t n = code.size(0), nbytes = code.size(1), m = 2 * q + 1;
  TORCH_CHECK(out.dim() == 2 && out.size(0) == n && out.size(1) == 4 * codes && out.scalar_type() == at::kFloat &&
                  out.is_contiguous(), "d4_points: out must be contiguous fp32 (N, 4 * codes)");
  const uint8_t* c = code.const_data_ptr<uint8_t>();
  const at::Half* s = scales.const_data_ptr<at::Half>();
  float* o = out.data_ptr<float>();
  const uint64_t mask = (uint64_t{1} << bits) - 1;
  // The digits by multiplication instead of division (a hardware divide per digit bounded the decode at ~170 ns a
  // 64-dim row): floor(v / m) == (v * inv) >> 40 with inv = floor(2^40 / m) + 1, exactly, for every v < 2^40 / m
  // (the product's excess over v / m is below v / 2^40 < 1 / m, so it never reaches the next integer) whose
  // product fits in 64 bits; every v a code of `bits` bits gives (v < 2^(bits + 1)) qualifies for q = 38's 25 bits.
  using u128 = unsigned __int128;
  const uint64_t inv = (uint64_t{1} << 40) / static_cast<uint64_t>(m) + 1;
  const bool by_inverse = bits + 1 < 40 && (u128{1} << (bits + 1)) * static_cast<uint64_t>(m) <= (u128{1} << 40) &&
                          (u128{inv} << (bits + 1)) < (u128{1} << 64);
  at::parallel_for(0, n, 64, [&](int64_t lo, int64_t hi) {
    if (by_inverse) {  // (bits < 39: a code and its offset in its first byte fit one 8-byte word)
      for (int64_t i = lo; i < hi; ++i) {
        const uint8_t* row = c + i * nbytes;
        const float scale = static_cast<float>(s[2 * i + 1]) / static_cast<float>(q);
        for (int64_t j = 0; j < codes; ++j) {
          const int64_t start = j * bits, first = start / 8;
          uint64_t word = 0;  // the 8 bytes from the code's first (fewer at the row's end), little-endian
          if (first + 8 <= nbytes) std::memcpy(&word, row + first, 8);
          else std::memcpy(&word, row + first, static_cast<size_t>(nbytes - first));
          uint64_t v = ((word >> (start % 8)) & mask) << 1;
          float* p = o + i * 4 * codes + 4 * j;
          for (int d = 3; d >= 0; --d) {
            const uint64_t next = (v * inv) >> 40;
            p[d] = static_cast<float>(static_cast<int64_t>(v - next * static_cast<uint64_t>(m)) - q) * scale;
            v = next;
          }
        }
      }
      return;
    }
    for (int64_t i = lo; i < hi; ++i) {
      const uint8_t* row = c + i * nbytes;
      const float scale = static_cast<float>(s[2 * i + 1]) / static_cast<float>(q);
      for (int64_t j = 0; j < codes; ++j) {
        const int64_t start = j * bits;
        unsigned __int128 acc = 0;  // the bytes holding the code (at most 9 of them)
        const int64_t first = start / 8, last = (start + bits - 1) / 8;
        for (int64_t b = last; b >= first; --b) acc = (acc << 8) | row[b];
        int64_t v = static_cast<int64_t>(static_cast<uint64_t>(acc >> (start % 8)) & mask) << 1;
        float* p = o + i * 4 * codes + 4 * j;
        for (int d = 3; d >= 0; --d) {
          p[d] = static_cast<float>(v % m - q) * scale;
          v /= m;
        }
      }
    }
  });
}

at::Tensor d4_points(const at::Tensor& code, const at::Tensor& scales, int64_t q, int64_t bits, int64_t codes) {
  auto out = at::empty({code.size(0), 4 * codes}, code.options().dtype(at::kFloat));
  d4_points_into(code, scales, q, bits, codes, out);
  return out;
}

}  // namespace

namespace kakeya_ops {
at::Tensor d4_points(const at::Tensor& code, const at::Tensor& scales, int64_t q, int64_t bits, int64_t codes) {
  return ::d4_points(code, scales, q, bits, codes);
}
void d4_points_into(const at::Tensor& code, const at::Tensor& scales, int64_t q, int64_t bits, int64_t codes,
                    at::Tensor& out) {
  ::d4_points_into(code, scales, q, bits, codes, out);
}
}  // namespace kakeya_ops

TORCH_LIBRARY_FRAGMENT(kakeya, m) {
  m.def("d4_points(Tensor code, Tensor scales, int q, int bits, int codes) -> Tensor");
}

TORCH_LIBRARY_IMPL(kakeya, CPU, m) { m.impl("d4_points", &d4_points); }
