// bf16 <-> float32 for serve's CPU kernels, bit-exact with torch's conversions (a 16-bit shift
// one way, round to nearest even the other), shared so every kernel rounds the same way.
#pragma once

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

}  // namespace warsha
