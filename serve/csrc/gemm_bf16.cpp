// bf16 x bf16 products of 5-96 activation rows (a decode step's batch) with vdpbf16ps, reading the
// weight in place ([N, K] row-major, as the one-row kernels read it) and asking for it ahead.
//
// Why: oneDNN's prepacked bf16 GEMM runs compute-bound batches at this project's Zen 4 hosts'
// vdpbf16ps rate (about 430 GFLOP/s on 2 cores), but a decode step of 33 rows over Gemma 3 270M's
// 18 layers took 19.8 ms where the same product on weights already in L3 took 16.4: its time is
// the weights' read from DRAM plus the arithmetic, not the larger of the two. Here each tile of 4
// weight rows is asked for two tiles ahead (one prefetch per 64-byte line, spread over the first
// row group's blocks), so the read hides under the arithmetic of the tiles before it.
//
// Arithmetic: a tile of 4 weight rows times a group of up to 6 activation rows keeps 24 float32
// accumulators of 16 lanes (4 weight vectors and one activation vector live beside them: 29 of
// the 32 registers); each vdpbf16ps adds 32 exact bf16 products pairwise into 16 lanes, rounding
// to nearest even as an FMA does (denormal inputs and outputs flushed to zero). A row's tail (K
// not a multiple of 32) is one masked block. The 4 accumulators of an activation row are summed
// across lanes together (two unpack rounds, then the 128-bit quarters), the bias added in float32,
// and the 4 outputs rounded once to bf16 as torch rounds. Summation order differs from oneDNN's,
// so results agree with it within float32 accumulation error, then one bf16 step.
//
// Only the avx512_bf16 and amx variants run it (the caller checks `current_isa`).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "bf16.h"
#include "rows.h"

std::string current_isa();  // gemv.cpp: the ISA variant chosen at load

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")

namespace {

constexpr int kTileRows = 4;    // weight rows per tile
constexpr int kGroupRows = 6;   // activation rows per register block
constexpr int64_t kBlock = 32;  // bf16 features per vector
constexpr int kAhead = 2;       // tiles between a prefetch and its use

// Four vectors' lane sums as one 128-bit vector (lane j: the sum of v[j]).
inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));  // a b a b per quarter
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xEE));  // a b c d
  const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd), _mm512_extractf32x8_ps(abcd, 1));
  return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}

// R activation rows (x, row stride K) times the tile of 4 weight rows at w: out[r * N + j], rounded
// to bf16 after `bias` (4 values or null). `ahead`, if not null, is the tile to ask for (its rows K apart).
template <int R>
void tile_group(const uint16_t* w, const uint16_t* x, int64_t K, int64_t N, const float* bias, const uint16_t* ahead,
                int ahead_rows, uint16_t* out) {
  __m512 acc[R][kTileRows];
  _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r)
    _Pragma("GCC unroll 4") for (int j = 0; j < kTileRows; ++j) acc[r][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + kBlock <= K; k += kBlock) {
    if (ahead != nullptr)
      _Pragma("GCC unroll 4") for (int j = 0; j < kTileRows; ++j) if (ahead_rows >> j & 1)
        _mm_prefetch(reinterpret_cast<const char*>(ahead + j * K + k), _MM_HINT_T0);
    __m512i wv[kTileRows];
    _Pragma("GCC unroll 4") for (int j = 0; j < kTileRows; ++j) wv[j] = _mm512_loadu_si512(w + j * K + k);
    _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + r * K + k);
      _Pragma("GCC unroll 4") for (int j = 0; j < kTileRows; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, (__m512bh)wv[j]);
    }
  }
  if (k < K) {
    const __mmask32 tail = static_cast<__mmask32>((uint64_t{1} << (K - k)) - 1);
    __m512i wv[kTileRows];
    _Pragma("GCC unroll 4") for (int j = 0; j < kTileRows; ++j) wv[j] = _mm512_maskz_loadu_epi16(tail, w + j * K + k);
    _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(tail, x + r * K + k);
      _Pragma("GCC unroll 4") for (int j = 0; j < kTileRows; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, (__m512bh)wv[j]);
    }
  }
  const __m128 b = bias != nullptr ? _mm_loadu_ps(bias) : _mm_setzero_ps();
  _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) {
    const __m128 s = _mm_add_ps(sum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]), b);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out + r * N), warsha::bf16x4_bits(s));
  }
}

// One weight row (the last N % 4) times R activation rows, as tile_group without the tile.
template <int R>
void row_group(const uint16_t* w, const uint16_t* x, int64_t K, int64_t N, const float* bias, uint16_t* out) {
  __m512 acc[R];
  _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += kBlock) {
    const __mmask32 m = K - k >= kBlock ? ~__mmask32{0} : static_cast<__mmask32>((uint64_t{1} << (K - k)) - 1);
    const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(m, w + k);
    _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_maskz_loadu_epi16(m, x + r * K + k), wv);
  }
  _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) out[r * N] = warsha::float_to_bf16(_mm512_reduce_add_ps(acc[r]) + (bias ? *bias : 0.f));
}

// Which rows of the tile ahead row group g of `groups` asks for: row j goes to group j % groups,
// so the tile's 64-byte lines are asked for once each, spread over the tile's whole pass (asking
// for all four rows in the first group left a 33-row step 2 ms slower on Gemma 3 270M's layers).
inline int ahead_rows_of(int64_t g, int64_t groups) {
  int mask = 0;
  for (int j = 0; j < kTileRows; ++j) mask |= (j % groups == g) << j;
  return mask;
}

// Weight rows [n0, n1) (n0 a multiple of 4) for every activation row: tile by tile, each tile
// through every row group while its rows sit in L1, the tile kAhead later asked for meanwhile.
// The M rows split into the fewest groups of at most 6, as even as can be (33: 6 6 6 5 5 5).
void rows_range(const uint16_t* w, const uint16_t* x, int64_t M, int64_t K, int64_t N, const float* bias, int64_t n0,
                int64_t n1, uint16_t* y) {
  const int64_t groups = (M + kGroupRows - 1) / kGroupRows, base = M / groups, larger = M % groups;
  const auto group_start = [&](int64_t g) { return g * base + std::min(g, larger); };
  const int64_t full = n0 + (n1 - n0) / kTileRows * kTileRows;
  for (int64_t n = n0; n < full; n += kTileRows) {
    const int64_t next = n + kAhead * kTileRows;
    const uint16_t* ahead = next + kTileRows <= n1 ? w + next * K : nullptr;
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t m = group_start(g);
      warsha::with_rows<kGroupRows>(static_cast<int>(group_start(g + 1) - m), [&](auto R) {
        tile_group<decltype(R)::value>(w + n * K, x + m * K, K, N, bias ? bias + n : nullptr, ahead,
                                       ahead_rows_of(g, groups), y + m * N + n);
      });
    }
  }
  for (int64_t n = full; n < n1; ++n)
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t m = group_start(g);
      warsha::with_rows<kGroupRows>(static_cast<int>(group_start(g + 1) - m), [&](auto R) {
        row_group<decltype(R)::value>(w + n * K, x + m * K, K, N, bias ? bias + n : nullptr, y + m * N + n);
      });
    }
}

}  // namespace

// x [M, K] bf16 @ w [N, K].T (+ bias, float32 [N]) -> bf16 [M, N], float32 sums rounded once.
torch::Tensor gemm_bf16_rows(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias) {
  const std::string isa = current_isa();
  TORCH_CHECK(isa == "avx512_bf16" || isa == "amx", "gemm_bf16_rows needs the avx512_bf16 or amx variant, running ", isa);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.is_contiguous() && x.device().is_cpu(),
              "x must be a contiguous bf16 CPU [M, K] tensor");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kBFloat16 && w.is_contiguous() && w.size(1) == x.size(1),
              "w must be a contiguous bf16 [N, K] tensor with x's K");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == N, "bias must be float32 [N]");
    b = bias->data_ptr<float>();
  }
  torch::Tensor y = torch::empty({M, N}, torch::kBFloat16);
  if (M == 0 || N == 0) return y;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const int64_t tiles = (N + kTileRows - 1) / kTileRows;
  at::parallel_for(0, tiles, 16, [&](int64_t t0, int64_t t1) {
    rows_range(wp, xp, M, K, N, b, t0 * kTileRows, std::min(N, t1 * kTileRows), yp);
  });
  return y;
}

#pragma GCC pop_options
