// The rows a screened LM head must compute exactly (serve/head_screen.py says why and proves it).
//
// approx [M, V] holds each row's int8 logits; the exact logit of column v for row m lies within
// b = a[m] * scale[v] + c[m] * scale_l1[v] of it. A column is a candidate for row m when its
// upper bound reaches row m's best lower bound less a bf16 rounding step (`step` times the larger
// magnitude of the best lower and upper bounds, plus `slack`). Two passes over the logits at memory speed
// (AVX2): the best bounds, then the columns that reach them, ascending, for any row.

#include <torch/extension.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// The best lower and upper bounds of one row of logits.
void best_bounds(const float* x, const float* s, const float* sl, float a, float c, int64_t V, float* lo, float* hi) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  __m256 vlo = _mm256_set1_ps(neg_inf), vhi = vlo;
  const __m256 va = _mm256_set1_ps(a), vc = _mm256_set1_ps(c);
  int64_t v = 0;
  for (; v + 8 <= V; v += 8) {
    const __m256 b = _mm256_fmadd_ps(vc, _mm256_loadu_ps(sl + v), _mm256_mul_ps(va, _mm256_loadu_ps(s + v)));
    const __m256 y = _mm256_loadu_ps(x + v);
    vlo = _mm256_max_ps(vlo, _mm256_sub_ps(y, b));
    vhi = _mm256_max_ps(vhi, _mm256_add_ps(y, b));
  }
  float l = hmax8(vlo), h = hmax8(vhi);
  for (; v < V; ++v) {
    const float b = std::fma(c, sl[v], a * s[v]);
    l = std::max(l, x[v] - b);
    h = std::max(h, x[v] + b);
  }
  *lo = l;
  *hi = h;
}

}  // namespace

// The least exact logit a row's argmax can have, less a bf16 rounding step (`step` of the larger
// best bound) and `slack`: a column whose upper bound stays below it cannot win.
float screen_floor(float lo, float hi, double step, double slack) {
  return lo - std::max(std::fabs(lo), std::fabs(hi)) * static_cast<float>(step) - static_cast<float>(slack);
}

torch::Tensor screen_candidates(const torch::Tensor& approx, const torch::Tensor& scale, const torch::Tensor& scale_l1,
                                const torch::Tensor& a, const torch::Tensor& c, double step, double slack) {
  TORCH_CHECK(approx.dim() == 2 && approx.scalar_type() == torch::kFloat32 && approx.is_contiguous(),
              "approx must be contiguous float32 [rows, V]");
  const int64_t M = approx.size(0), V = approx.size(1);
  for (const auto* t : {&scale, &scale_l1})
    TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->is_contiguous() && t->numel() == V, "scales must be float32 [V]");
  for (const auto* t : {&a, &c})
    TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->is_contiguous() && t->numel() == M, "a, c must be float32 [rows]");
  const float* x = approx.data_ptr<float>();
  const float *s = scale.data_ptr<float>(), *sl = scale_l1.data_ptr<float>();
  const float *pa = a.data_ptr<float>(), *pc = c.data_ptr<float>();
  std::vector<float> floor(M);
  for (int64_t m = 0; m < M; ++m) {
    float lo, hi;
    best_bounds(x + m * V, s, sl, pa[m], pc[m], V, &lo, &hi);
    floor[m] = screen_floor(lo, hi, step, slack);
  }
  std::vector<int64_t> ids;
  for (int64_t v0 = 0; v0 < V; v0 += 8) {
    const int64_t n = std::min<int64_t>(8, V - v0);
    unsigned hit = 0;
    for (int64_t m = 0; m < M && hit != (1u << n) - 1; ++m) {
      const float* row = x + m * V;
      if (n == 8) {
        const __m256 b = _mm256_fmadd_ps(_mm256_set1_ps(pc[m]), _mm256_loadu_ps(sl + v0),
                                         _mm256_mul_ps(_mm256_set1_ps(pa[m]), _mm256_loadu_ps(s + v0)));
        const __m256 up = _mm256_add_ps(_mm256_loadu_ps(row + v0), b);
        hit |= static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(up, _mm256_set1_ps(floor[m]), _CMP_GE_OQ)));
      } else {
        for (int64_t j = 0; j < n; ++j)
          if (row[v0 + j] + std::fma(pc[m], sl[v0 + j], pa[m] * s[v0 + j]) >= floor[m]) hit |= 1u << j;
      }
    }
    for (; hit; hit &= hit - 1) ids.push_back(v0 + __builtin_ctz(hit));
  }
  torch::Tensor out = torch::empty({static_cast<int64_t>(ids.size())}, torch::kLong);
  std::copy(ids.begin(), ids.end(), out.data_ptr<int64_t>());
  return out;
}
