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

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>

#include "bf16.h"

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
      float sum = 0.f;
      for (int64_t i = 0; i < H; ++i) {
        const float v = warsha::bf16_to_float(xr[i]);
        sum += v * v;
      }
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(H) + e);
      for (int64_t i = 0; i < H; ++i) op[r * H + i] = warsha::float_to_bf16(warsha::bf16_to_float(xr[i]) * inv * wr[i]);
    }
  });
  return out;
}
