// A 16 x 16 transpose of 32-bit elements (AVX-512), shared by our kernels: moves bits, computes nothing.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

namespace {

// out = in^T for 16 x 16 floats (rows 16 floats apart).
inline void transpose16(const float* in, float* out) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(in + 16 * i);
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
    _mm512_storeu_ps(out + 16 * j, _mm512_shuffle_f32x4(t[j], t[8 + j], 0x88));          // column j
    _mm512_storeu_ps(out + 16 * (j + 8), _mm512_shuffle_f32x4(t[j], t[8 + j], 0xdd));    // column j + 8
    _mm512_storeu_ps(out + 16 * (j + 4), _mm512_shuffle_f32x4(t[4 + j], t[12 + j], 0x88));  // column j + 4
    _mm512_storeu_ps(out + 16 * (j + 12), _mm512_shuffle_f32x4(t[4 + j], t[12 + j], 0xdd)); // column j + 12
  }
}

}  // namespace
#endif
