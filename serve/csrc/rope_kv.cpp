// RoPE on the new tokens' queries and keys, and their keys and values written into the paged
// cache, in one call (the CPU path of a decoder layer, every step).
//
// Why: in torch this is a split, a reshape, a concatenation with a negation, three products, a
// sum and two index copies: about ten op launches per layer for a decode step whose data is a
// few kilobytes, so the launches cost more than the arithmetic. The arithmetic is torch's own,
// rounding for rounding: out = x * cos + rotate_half(x) * sin, each product and the sum rounded
// to the input's dtype (bf16 rounds three times, as the unfused ops do; no FMA contraction:
// the extension builds with -ffp-contract=off). Outputs equal torch's bit for bit (tested).
// Eight values at a time on AVX2 (scalar for a head width that is not a multiple of 16): the
// scalar loop, with a bf16 rounding per product, took 2.9 ms per layer for a 512-token chunk of
// Gemma 3 270M (8 ms of a mixed serving step), the data being 1.3 MB.
//
// Gemma's q/k norms may come along (`qk_weight`, float32 [H + Hkv, D], its 1 + w): each head is
// then normalised first, as `serve.layers.Norm` does in its own call (csrc/norm.cpp's statistic,
// times the weight row, one bf16 rounding), and rotated from that; bf16 rows only.
//
// Layouts: qk rows [T, (H + Hkv) * D] (query heads then key heads, each head's D values
// contiguous; rows may be strided, e.g. a split of the fused q|k|v output), v rows [T, Hkv * D]
// likewise; cos, sin [T, D]; k_cache, v_cache [Hkv, slots, D]; slots [T] int64.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <type_traits>
#include <vector>

#include "bf16.h"
#include "norm.h"

namespace {

constexpr int64_t kTokensPerTask = 16;

struct F32 {  // float32 values: products and sums in float32, no rounding step
  using T = float;
  static float load(float v) { return v; }
  static float round(float v) { return v; }
  static float store(float v) { return v; }
  static __m256 vload(const float* p) { return _mm256_loadu_ps(p); }
  static __m256 vround(__m256 v) { return v; }
  static void vstore(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
};

struct Bf16 {  // bf16 values: each product and sum rounded to bf16, as torch's bf16 ops do
  using T = uint16_t;
  static float load(uint16_t v) { return warsha::bf16_to_float(v); }
  static float round(float v) { return warsha::bf16_to_float(warsha::float_to_bf16(v)); }
  static uint16_t store(float v) { return warsha::float_to_bf16(v); }
  static __m256 vload(const uint16_t* p) { return warsha::bf16x8_load(p); }
  static __m256 vround(__m256 v) { return warsha::bf16x8_round(v); }
  static void vstore(uint16_t* p, __m256 v) { warsha::bf16x8_store(p, v); }
};

// One head of D values rotated: out[i] = x[i] cos[i] + r[i] sin[i], r = (-x[D/2:], x[:D/2]).
template <typename N>
inline void rotate_head(const typename N::T* x, const typename N::T* c, const typename N::T* s, int64_t D, typename N::T* out) {
  const int64_t half = D / 2;
  const int64_t vec_end = half % 8 == 0 ? half : 0;
  for (int64_t i = 0; i < vec_end; i += 8) {  // the same expression, eight lanes at a time
    const __m256 lo = N::vload(x + i), hi = N::vload(x + i + half);
    const __m256 neg_hi = _mm256_xor_ps(hi, _mm256_set1_ps(-0.0f));
    const __m256 a = N::vround(_mm256_mul_ps(lo, N::vload(c + i)));
    const __m256 b = N::vround(_mm256_mul_ps(neg_hi, N::vload(s + i)));
    N::vstore(out + i, _mm256_add_ps(a, b));
    const __m256 e = N::vround(_mm256_mul_ps(hi, N::vload(c + i + half)));
    const __m256 f = N::vround(_mm256_mul_ps(lo, N::vload(s + i + half)));
    N::vstore(out + i + half, _mm256_add_ps(e, f));
  }
  for (int64_t i = vec_end; i < half; ++i) {
    const float lo = N::load(x[i]), hi = N::load(x[i + half]);
    out[i] = N::store(N::round(lo * N::load(c[i])) + N::round(-hi * N::load(s[i])));
    out[i + half] = N::store(N::round(hi * N::load(c[i + half])) + N::round(lo * N::load(s[i + half])));
  }
}

struct Dims {
  int64_t H, Hkv, D, slots, qk_stride, v_stride;
  const float* norm;  // float32 [H + Hkv, D] q/k norm weights (bf16 rows), or null
  float eps;
};

// One head of D bf16 values normalised into `out`: round(x * inv_rms(x) * w), as rms_norm_bf16_scaled.
inline void norm_head(const uint16_t* x, const float* w, int64_t D, float eps, uint16_t* out) {
  const float inv = warsha::inv_rms(x, D, eps);
  const __m256 iv = _mm256_set1_ps(inv);
  int64_t i = 0;
  for (; i + 8 <= D; i += 8)
    warsha::bf16x8_store(out + i, _mm256_mul_ps(_mm256_mul_ps(warsha::bf16x8_load(x + i), iv), _mm256_loadu_ps(w + i)));
  for (; i < D; ++i) out[i] = warsha::float_to_bf16(warsha::bf16_to_float(x[i]) * inv * w[i]);
}

// Head h of a token's q|k row, normalised into `scratch` where the call brought q/k norms.
template <typename N>
inline const typename N::T* head_in(const typename N::T* row, int64_t h, const Dims& d, typename N::T* scratch) {
  if constexpr (std::is_same_v<typename N::T, uint16_t>) {
    if (d.norm != nullptr) {
      norm_head(row + h * d.D, d.norm + h * d.D, d.D, d.eps, scratch);
      return scratch;
    }
  }
  return row + h * d.D;
}

template <typename N>
void rope_tokens(const torch::Tensor& qk, const torch::Tensor& v, const torch::Tensor& cos, const torch::Tensor& sin,
                 const int64_t* slot, const Dims& d, torch::Tensor& q_out, torch::Tensor& k_out, torch::Tensor& k_cache,
                 torch::Tensor& v_cache, int64_t t0, int64_t t1) {
  using T = typename N::T;
  const T* qkp = reinterpret_cast<const T*>(qk.data_ptr());
  const T* vp = reinterpret_cast<const T*>(v.data_ptr());
  const T* cp = reinterpret_cast<const T*>(cos.data_ptr());
  const T* sp = reinterpret_cast<const T*>(sin.data_ptr());
  T* qo = reinterpret_cast<T*>(q_out.data_ptr());
  T* ko = reinterpret_cast<T*>(k_out.data_ptr());
  T* kc = reinterpret_cast<T*>(k_cache.data_ptr());
  T* vc = reinterpret_cast<T*>(v_cache.data_ptr());
  const int64_t D = d.D;
  std::vector<T> scratch(d.norm != nullptr ? D : 0);
  for (int64_t t = t0; t < t1; ++t) {
    const T* row = qkp + t * d.qk_stride;
    const T* c = cp + t * D;
    const T* s = sp + t * D;
    for (int64_t h = 0; h < d.H; ++h) rotate_head<N>(head_in<N>(row, h, d, scratch.data()), c, s, D, qo + (t * d.H + h) * D);
    for (int64_t h = 0; h < d.Hkv; ++h) {
      T* k = ko + (t * d.Hkv + h) * D;
      rotate_head<N>(head_in<N>(row, d.H + h, d, scratch.data()), c, s, D, k);
      std::memcpy(kc + (h * d.slots + slot[t]) * D, k, sizeof(T) * D);
      std::memcpy(vc + (h * d.slots + slot[t]) * D, vp + t * d.v_stride + h * D, sizeof(T) * D);
    }
  }
}

// Rows of a [T, width] or [T, heads, D] tensor whose `width` values per token are contiguous.
int64_t row_stride(const torch::Tensor& x, int64_t width, const char* name) {
  TORCH_CHECK(x.dim() == 2 || x.dim() == 3, name, " must be [T, heads * D] or [T, heads, D]");
  const bool packed = x.dim() == 2 ? x.stride(1) == 1 : (x.stride(2) == 1 && x.stride(1) == x.size(2));
  TORCH_CHECK(packed && x.numel() == x.size(0) * width, name, ": each token's ", width, " values must be contiguous");
  return x.stride(0);
}

}  // namespace

std::vector<torch::Tensor> rope_write_kv(const torch::Tensor& qk, const torch::Tensor& v, const torch::Tensor& cos_in,
                                         const torch::Tensor& sin_in, const torch::Tensor& slots_in, torch::Tensor k_cache,
                                         torch::Tensor v_cache, int64_t num_heads, const c10::optional<torch::Tensor>& qk_weight,
                                         double eps) {
  const auto dtype = qk.scalar_type();
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16, "rope_write_kv takes float32 or bf16");
  for (const torch::Tensor* t : std::initializer_list<const torch::Tensor*>{&v, &cos_in, &sin_in, &k_cache, &v_cache})
    TORCH_CHECK(t->scalar_type() == dtype, "rope_write_kv: every tensor must share qk's dtype");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes(),
              "rope_write_kv: caches must be contiguous [Hkv, slots, D] of one shape");
  const torch::Tensor cos = cos_in.contiguous(), sin = sin_in.contiguous();
  const torch::Tensor slots = slots_in.to(torch::kInt64).contiguous();
  Dims d{num_heads, k_cache.size(0), k_cache.size(2), k_cache.size(1), 0, 0, nullptr, static_cast<float>(eps)};
  torch::Tensor norm_w;
  if (qk_weight.has_value()) {
    norm_w = qk_weight->contiguous();
    TORCH_CHECK(dtype == torch::kBFloat16 && norm_w.scalar_type() == torch::kFloat32 && norm_w.numel() == (d.H + d.Hkv) * d.D,
                "rope_write_kv: qk_weight must be float32 [H + Hkv, D] (1 + w) with bf16 rows");
    d.norm = norm_w.data_ptr<float>();
  }
  const int64_t T = qk.size(0);
  TORCH_CHECK(d.D % 2 == 0 && cos.dim() == 2 && cos.size(0) == T && cos.size(1) == d.D && sin.sizes() == cos.sizes(),
              "rope_write_kv: cos/sin must be [T, D] with an even D");
  TORCH_CHECK(slots.numel() == T && v.size(0) == T, "rope_write_kv: one slot and one v row per token");
  d.qk_stride = row_stride(qk, (d.H + d.Hkv) * d.D, "qk");
  d.v_stride = row_stride(v, d.Hkv * d.D, "v");
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(slot[t] >= 0 && slot[t] < d.slots, "rope_write_kv: slot ", slot[t], " is outside the cache");
  torch::Tensor q_out = torch::empty({T, d.H, d.D}, qk.options());
  torch::Tensor k_out = torch::empty({T, d.Hkv, d.D}, qk.options());
  at::parallel_for(0, T, kTokensPerTask, [&](int64_t t0, int64_t t1) {
    if (dtype == torch::kFloat32)
      rope_tokens<F32>(qk, v, cos, sin, slot, d, q_out, k_out, k_cache, v_cache, t0, t1);
    else
      rope_tokens<Bf16>(qk, v, cos, sin, slot, d, q_out, k_out, k_cache, v_cache, t0, t1);
  });
  torch::Tensor v_rows = v.as_strided({T, d.Hkv, d.D}, {d.v_stride, d.D, 1});
  return {q_out, k_out, v_rows};
}
