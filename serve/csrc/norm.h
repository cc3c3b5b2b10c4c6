// The RMS statistic of a row of bf16 values, shared by every kernel that normalises rows
// (csrc/norm.cpp's norms, csrc/rope_kv.cpp's q/k norm before RoPE) so that all of them compute it
// in one order and a fused call gives the bits of the separate ones.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "bf16.h"

namespace warsha {

// sum of x[i]^2 over H bf16 values, in float32: eight lanes of partial sums, then the tail.
inline float sum_squares(const uint16_t* x, int64_t H) {
  __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= H; i += 16) {
    const __m256 u = bf16x8_load(x + i), v = bf16x8_load(x + i + 8);
    a = _mm256_fmadd_ps(u, u, a);
    b = _mm256_fmadd_ps(v, v, b);
  }
  if (i + 8 <= H) {
    const __m256 u = bf16x8_load(x + i);
    a = _mm256_fmadd_ps(u, u, a);
    i += 8;
  }
  a = _mm256_add_ps(a, b);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  float sum = _mm_cvtss_f32(s);
  for (; i < H; ++i) {
    const float v = bf16_to_float(x[i]);
    sum += v * v;
  }
  return sum;
}

inline float inv_rms(const uint16_t* x, int64_t H, float eps) {
  return 1.f / std::sqrt(sum_squares(x, H) / static_cast<float>(H) + eps);
}

}  // namespace warsha
