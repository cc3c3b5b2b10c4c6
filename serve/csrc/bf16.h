// bf16 <-> float32 for serve's CPU kernels, bit-exact with torch's conversions (a 16-bit shift
// one way, round to nearest even the other), shared so every kernel rounds the same way: one
// value at a time, eight at a time on AVX2 (the baseline every variant builds with), sixteen on
// AVX-512 (callable from code built for the AVX-512 variants only).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace warsha {

inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even; NaN stays a quiet NaN
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// Eight bf16 values widened to float32.
inline __m256 bf16x8_load(const uint16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// float_to_bf16 of eight values, each in the low 16 bits of its 32-bit lane.
inline __m256i bf16x8_bits(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i high = _mm256_srli_epi32(bits, 16);
  const __m256i bias = _mm256_add_epi32(_mm256_set1_epi32(0x7fff), _mm256_and_si256(high, _mm256_set1_epi32(1)));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, bias), 16);
  const __m256i quiet = _mm256_or_si256(high, _mm256_set1_epi32(0x40));
  return _mm256_blendv_epi8(rounded, quiet, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}

// float_to_bf16 of four values, packed into the low 64 bits.
inline __m128i bf16x4_bits(__m128 v) {
  const __m128i bits = _mm_castps_si128(v);
  const __m128i high = _mm_srli_epi32(bits, 16);
  const __m128i bias = _mm_add_epi32(_mm_set1_epi32(0x7fff), _mm_and_si128(high, _mm_set1_epi32(1)));
  const __m128i rounded = _mm_srli_epi32(_mm_add_epi32(bits, bias), 16);
  const __m128i quiet = _mm_or_si128(high, _mm_set1_epi32(0x40));
  const __m128i r = _mm_blendv_epi8(rounded, quiet, _mm_castps_si128(_mm_cmpunord_ps(v, v)));
  return _mm_packus_epi32(r, r);
}

// Eight values rounded to bf16 and widened back (what a bf16 op's result reads as).
inline __m256 bf16x8_round(__m256 v) { return _mm256_castsi256_ps(_mm256_slli_epi32(bf16x8_bits(v), 16)); }

// Eight values rounded to bf16 and stored.
inline void bf16x8_store(uint16_t* p, __m256 v) {
  const __m256i r = bf16x8_bits(v);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")

// Sixteen bf16 values widened to float32.
inline __m512 bf16x16_load(const uint16_t* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// float_to_bf16 of sixteen values, packed.
inline __m256i bf16x16_bits(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i high = _mm512_srli_epi32(bits, 16);
  const __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(high, _mm512_set1_epi32(1)));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(high, _mm512_set1_epi32(0x40)));
  return _mm512_cvtepi32_epi16(r);
}

// Sixteen values rounded to bf16 and widened back.
inline __m512 bf16x16_round(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16x16_bits(v)), 16));
}

#pragma GCC pop_options

}  // namespace warsha
