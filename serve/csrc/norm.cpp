// RMSNorm of bf16 rows with a float32 weight and a single rounding: Gemma's `(1 + w)` norm as
// serve computes it in torch, (rms_norm(x.float()) * w32).to(bf16), in one call.
//
// Why: in torch that is four ops (a widening copy, the fused norm, a product, a narrowing copy),
// each allocating a [rows, hidden] tensor; a Gemma 3 layer runs five such norms (input, post-
// attention, pre- and post-MLP, and q/k per head), so a 512-token prefill chunk of an 18-layer
// model made 360 of them, and a decode step the same count of launches on a few kilobytes.
// The weight may hold several rows ([R, hidden]: q and k norms per head); row i of x takes
// weight row i % R. float32 mean of squares (summation order is the only difference from
// torch's), x * rsqrt(mean + eps) * w in float32, rounded once to bf16.
//
// Both norms here run eight features at a time (AVX2, the baseline of every variant): written
// one value at a time, the sum of squares (a float reduction) stayed scalar, and the mixed
// serving step of Gemma 3 270M (five norms a layer over [tokens, 640] and q/k per head) spent
// 11.8 ms in small ops against 10.1 after (Zen 4, 2 threads). The products and roundings are
// the scalar ones; only the order of the float32 sum of squares changes (eight partial sums).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>

#include "bf16.h"

namespace {

// sum of x[i]^2 over H bf16 values, in float32: eight lanes of partial sums, then the tail.
inline float sum_squares(const uint16_t* x, int64_t H) {
  __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= H; i += 16) {
    const __m256 u = warsha::bf16x8_load(x + i), v = warsha::bf16x8_load(x + i + 8);
    a = _mm256_fmadd_ps(u, u, a);
    b = _mm256_fmadd_ps(v, v, b);
  }
  if (i + 8 <= H) {
    const __m256 u = warsha::bf16x8_load(x + i);
    a = _mm256_fmadd_ps(u, u, a);
    i += 8;
  }
  a = _mm256_add_ps(a, b);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  float sum = _mm_cvtss_f32(s);
  for (; i < H; ++i) {
    const float v = warsha::bf16_to_float(x[i]);
    sum += v * v;
  }
  return sum;
}

inline float inv_rms(const uint16_t* x, int64_t H, float eps) {
  return 1.f / std::sqrt(sum_squares(x, H) / static_cast<float>(H) + eps);
}

}  // namespace

torch::Tensor rms_norm_bf16_scaled(const torch::Tensor& x_in, const torch::Tensor& w_in, double eps) {
  TORCH_CHECK(x_in.scalar_type() == torch::kBFloat16 && x_in.device().is_cpu(), "rms_norm_bf16_scaled takes bf16 CPU rows");
  TORCH_CHECK(w_in.scalar_type() == torch::kFloat32 && w_in.dim() >= 1, "rms_norm_bf16_scaled takes a float32 weight [..., hidden]");
  const torch::Tensor x = x_in.contiguous(), w = w_in.contiguous();
  const int64_t H = w.size(-1), R = w.numel() / H;
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == H, "x's last dim (", x.size(-1), ") must equal the weight's (", H, ")");
  const int64_t rows = x.numel() / H;
  TORCH_CHECK(rows % R == 0, "x's rows (", rows, ") must be a multiple of the weight's rows (", R, ")");
  torch::Tensor out = torch::empty_like(x);
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const float* wp = w.data_ptr<float>();
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const uint16_t* xr = xp + r * H;
      const float* wr = wp + (r % R) * H;
      uint16_t* orow = op + r * H;
      const float inv = inv_rms(xr, H, e);
      const __m256 iv = _mm256_set1_ps(inv);
      int64_t i = 0;
      for (; i + 8 <= H; i += 8)
        warsha::bf16x8_store(orow + i, _mm256_mul_ps(_mm256_mul_ps(warsha::bf16x8_load(xr + i), iv), _mm256_loadu_ps(wr + i)));
      for (; i < H; ++i) orow[i] = warsha::float_to_bf16(warsha::bf16_to_float(xr[i]) * inv * wr[i]);
    }
  });
  return out;
}

// RMSNorm of bf16 rows as transformers computes it: float32 mean of squares, x * rsqrt rounded
// to bf16, then times the bf16 weight (rounded again). One call instead of torch's seven ops.
torch::Tensor rms_norm_bf16(const torch::Tensor& x_in, const torch::Tensor& w_in, double eps) {
  TORCH_CHECK(x_in.scalar_type() == torch::kBFloat16 && w_in.scalar_type() == torch::kBFloat16, "rms_norm_bf16 takes bf16 x and weight");
  const torch::Tensor x = x_in.contiguous(), w = w_in.contiguous();
  const int64_t H = w.numel();
  TORCH_CHECK(x.size(-1) == H, "x's last dim (", x.size(-1), ") must equal the weight's size (", H, ")");
  torch::Tensor out = torch::empty_like(x);
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t rows = x.numel() / H;
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const uint16_t* xr = xp + r * H;
      uint16_t* orow = op + r * H;
      const float inv = inv_rms(xr, H, e);
      const __m256 iv = _mm256_set1_ps(inv);
      int64_t i = 0;
      for (; i + 8 <= H; i += 8) {
        const __m256 h = warsha::bf16x8_round(_mm256_mul_ps(warsha::bf16x8_load(xr + i), iv));
        warsha::bf16x8_store(orow + i, _mm256_mul_ps(warsha::bf16x8_load(wp + i), h));
      }
      for (; i < H; ++i) {
        const float h = warsha::bf16_to_float(warsha::float_to_bf16(warsha::bf16_to_float(xr[i]) * inv));
        orow[i] = warsha::float_to_bf16(warsha::bf16_to_float(wp[i]) * h);
      }
    }
  });
  return out;
}
