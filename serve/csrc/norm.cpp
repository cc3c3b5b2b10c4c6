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

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "bf16.h"
#include "norm.h"

using warsha::inv_rms;

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

namespace {

// Row r of the fused residual step (add_rms_norm_bf16): n = norm_y(y) (or y), x' = x + n, h = norm_x(x').
struct AddNormRow {
  const float* wy;       // the branch output's norm weight (float32, Gemma's 1 + w), or null: add y as is
  const float* wx32;     // the next norm's weight: float32 (one rounding) ...
  const uint16_t* wx16;  // ... or bf16 (transformers' two roundings); both null: no next norm
  float eps;
  int64_t H;

  void operator()(const uint16_t* x, const uint16_t* y, uint16_t* xo, uint16_t* h) const {
    const float iy = wy != nullptr ? inv_rms(y, H, eps) : 0.f;
    int64_t i = 0;
    for (; i + 8 <= H; i += 8) {
      __m256 n = warsha::bf16x8_load(y + i);
      if (wy != nullptr) n = warsha::bf16x8_round(_mm256_mul_ps(_mm256_mul_ps(n, _mm256_set1_ps(iy)), _mm256_loadu_ps(wy + i)));
      warsha::bf16x8_store(xo + i, _mm256_add_ps(warsha::bf16x8_load(x + i), n));
    }
    for (; i < H; ++i) {
      float n = warsha::bf16_to_float(y[i]);
      if (wy != nullptr) n = warsha::bf16_to_float(warsha::float_to_bf16(n * iy * wy[i]));
      xo[i] = warsha::float_to_bf16(warsha::bf16_to_float(x[i]) + n);
    }
    if (h == nullptr) return;
    const float ix = inv_rms(xo, H, eps);
    const __m256 iv = _mm256_set1_ps(ix);
    for (i = 0; i + 8 <= H; i += 8) {
      const __m256 v = _mm256_mul_ps(warsha::bf16x8_load(xo + i), iv);
      if (wx32 != nullptr)
        warsha::bf16x8_store(h + i, _mm256_mul_ps(v, _mm256_loadu_ps(wx32 + i)));
      else
        warsha::bf16x8_store(h + i, _mm256_mul_ps(warsha::bf16x8_load(wx16 + i), warsha::bf16x8_round(v)));
    }
    for (; i < H; ++i) {
      const float v = warsha::bf16_to_float(xo[i]) * ix;
      h[i] = wx32 != nullptr ? warsha::float_to_bf16(v * wx32[i])
                             : warsha::float_to_bf16(warsha::bf16_to_float(wx16[i]) * warsha::bf16_to_float(warsha::float_to_bf16(v)));
    }
  }
};

}  // namespace

// The residual step between a layer's branches, in one pass over each row: x' = x + norm_y(y)
// (Gemma's post-attention / post-MLP norm of the branch output y; y itself where w_y is None),
// then h = norm_x(x') (the next pre-attention / pre-MLP norm; none where w_x is None), with each
// value rounded to bf16 where torch's separate ops round it: norm_y's output, the sum, norm_x's
// output (a float32 w_x: Gemma's one rounding; a bf16 w_x: transformers' two). What torch did in
// three calls, two of them through a [rows, hidden] tensor in memory. Returns (x', h or empty).
std::vector<torch::Tensor> add_rms_norm_bf16(const torch::Tensor& x_in, const torch::Tensor& y_in,
                                             const c10::optional<torch::Tensor>& w_y, const c10::optional<torch::Tensor>& w_x,
                                             double eps) {
  TORCH_CHECK(x_in.scalar_type() == torch::kBFloat16 && y_in.scalar_type() == torch::kBFloat16 && x_in.device().is_cpu(),
              "add_rms_norm_bf16 takes bf16 CPU x and y");
  TORCH_CHECK(x_in.sizes() == y_in.sizes() && x_in.dim() >= 1, "x and y must have one shape, got ", x_in.sizes(), " and ", y_in.sizes());
  const torch::Tensor x = x_in.contiguous(), y = y_in.contiguous();
  const int64_t H = x.size(-1), rows = x.numel() / std::max<int64_t>(H, 1);
  torch::Tensor wy, wx;
  if (w_y.has_value()) {
    wy = w_y->contiguous();
    TORCH_CHECK(wy.scalar_type() == torch::kFloat32 && wy.numel() == H, "w_y must be float32 [", H, "]");
  }
  if (w_x.has_value()) {
    wx = w_x->contiguous();
    TORCH_CHECK((wx.scalar_type() == torch::kFloat32 || wx.scalar_type() == torch::kBFloat16) && wx.numel() == H,
                "w_x must be float32 or bf16 [", H, "]");
  }
  torch::Tensor xo = torch::empty_like(x);
  torch::Tensor h = w_x.has_value() ? torch::empty_like(x) : torch::empty({0}, x.options());
  const AddNormRow row{wy.defined() ? wy.data_ptr<float>() : nullptr,
                       wx.defined() && wx.scalar_type() == torch::kFloat32 ? wx.data_ptr<float>() : nullptr,
                       wx.defined() && wx.scalar_type() == torch::kBFloat16 ? reinterpret_cast<const uint16_t*>(wx.data_ptr()) : nullptr,
                       static_cast<float>(eps), H};
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* yp = reinterpret_cast<const uint16_t*>(y.data_ptr());
  auto* op = reinterpret_cast<uint16_t*>(xo.data_ptr());
  auto* hp = w_x.has_value() ? reinterpret_cast<uint16_t*>(h.data_ptr()) : nullptr;
  at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) row(xp + r * H, yp + r * H, op + r * H, hp ? hp + r * H : nullptr);
  });
  return {xo, h};
}
