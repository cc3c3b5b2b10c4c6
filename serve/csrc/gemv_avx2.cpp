// Small-batch matrix products for the serving engine's CPU path (AVX2 + FMA).
//
// Why: a decode step multiplies 1-16 activation rows by every weight matrix once, so it is
// bound by reading the weights. On CPUs without native bf16 (AVX2 only), torch's bf16 matrix-
// vector product and its int4 kernel are bound by their own arithmetic instead: measured on a
// 2-core Zen 3, a bf16 5632 x 1024 product ran at half of memory speed and the int4 kernel at
// a quarter. Here each weight block is widened to float32 once (bf16: a 16-bit shift; int4: a
// byte-to-float conversion and one FMA with the group's scale and zero) and then used by every
// activation row, so R rows cost about one pass over the weights. Float32 accumulation, as a
// native bf16 GEMM does; the caller rounds once.
//
// int4 layout (built by serve/cpu_kernels.py from the GPTQ checkpoint): uint8 [N, K/2]; for
// output n and input block b of 32 features, byte j of the block's 16 bytes holds feature
// 32b+j in its low nibble and 32b+16+j in its high nibble. scales, zeros: float32 [N, K/G];
// w[n, k] = q * scale + zero (zero already holds -scale * zero_point).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <cmath>
#include <type_traits>
#include <vector>

#include "bf16.h"

namespace {

using warsha::bf16_to_float;
using warsha::float_to_bf16;

constexpr int64_t kBlock = 32;   // weights handled per inner iteration (4 AVX2 vectors)
constexpr int kMaxRows = 8;       // activation rows per pass over the weights
constexpr int64_t kChunk = 256;  // granularity of feature chunks (a multiple of kBlock and of any int4 group)

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256 widen_bf16(const uint16_t* p) {
  __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// Four float32 vectors of 32 consecutive bf16 weights of row `n`, from input feature k.
struct Bf16Rows {
  const uint16_t* w;
  int64_t K;
  inline void block(int64_t n, int64_t k, __m256 out[4]) const {
    const uint16_t* p = w + n * K + k;
    for (int j = 0; j < 4; ++j) out[j] = widen_bf16(p + 8 * j);
  }
  inline float scalar(int64_t n, int64_t k) const { return bf16_to_float(w[n * K + k]); }
  // a block is one 64-byte cache line
  inline void prefetch(int64_t n, int64_t k) const { _mm_prefetch(reinterpret_cast<const char*>(w + n * K + k), _MM_HINT_T1); }
  static constexpr int64_t bytes(int64_t features) { return 2 * features; }
};

// Four float32 vectors of 32 consecutive float32 weights of row `n` (read as they are).
struct F32Rows {
  const float* w;
  int64_t K;
  inline void block(int64_t n, int64_t k, __m256 out[4]) const {
    const float* p = w + n * K + k;
    for (int j = 0; j < 4; ++j) out[j] = _mm256_loadu_ps(p + 8 * j);
  }
  inline float scalar(int64_t n, int64_t k) const { return w[n * K + k]; }
  // a block is two 64-byte cache lines
  inline void prefetch(int64_t n, int64_t k) const {
    const char* p = reinterpret_cast<const char*>(w + n * K + k);
    _mm_prefetch(p, _MM_HINT_T1);
    _mm_prefetch(p + 64, _MM_HINT_T1);
  }
  static constexpr int64_t bytes(int64_t features) { return 4 * features; }
};

// Four float32 vectors of 32 int8 weights of row `n`, from input feature k (the row's scale is
// applied to the finished sum).
struct Int8Rows {
  const int8_t* q;
  int64_t K;
  inline void block(int64_t n, int64_t k, __m256 out[4]) const {
    const int8_t* p = q + n * K + k;
    for (int j = 0; j < 4; ++j)
      out[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * j))));
  }
  inline float scalar(int64_t n, int64_t k) const { return static_cast<float>(q[n * K + k]); }
  // two blocks share a 64-byte cache line: one prefetch per line
  inline void prefetch(int64_t n, int64_t k) const {
    if ((k & 63) == 0) _mm_prefetch(reinterpret_cast<const char*>(q + n * K + k), _MM_HINT_T1);
  }
  static constexpr int64_t bytes(int64_t features) { return features; }
};

// Four float32 vectors of 32 dequantized int4 weights of row `n`, from input feature k.
struct Int4Rows {
  const uint8_t* q;
  const float* scales;
  const float* zeros;
  int64_t K, groups;
  int gshift;  // log2 of the group size (a power of two)
  inline void block(int64_t n, int64_t k, __m256 out[4]) const {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + n * (K / 2) + k / 2));
    const __m128i low = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(v, low);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), low);
    const int64_t g = n * groups + (k >> gshift);
    const __m256 s = _mm256_set1_ps(scales[g]);
    const __m256 z = _mm256_set1_ps(zeros[g]);
    const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int j = 0; j < 4; ++j) {
      __m256 qf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[j]));
      out[j] = _mm256_fmadd_ps(qf, s, z);
    }
  }
  inline float scalar(int64_t, int64_t) const { return 0.f; }  // K is a multiple of 32: no tail
  // four blocks share a 64-byte cache line: one prefetch per line
  inline void prefetch(int64_t n, int64_t k) const {
    if ((k & 127) == 0) _mm_prefetch(reinterpret_cast<const char*>(q + n * (K / 2) + k / 2), _MM_HINT_T1);
  }
  static constexpr int64_t bytes(int64_t features) { return features / 2; }
};

// y[r, n] = sum_k x[r, k] * W[n, k] for R rows and outputs [n0, n1). A independent
// accumulators per row hide FMA latency when R is small.
// With two or more rows the loop does enough arithmetic per cache line that the hardware
// prefetchers alone no longer keep enough reads in flight: time became memory time plus
// arithmetic time instead of the larger of the two. Each block therefore asks for the same block
// of the output `ahead` rows on, into L2, about kL2Ahead bytes ahead of the reads (on a 278k x 640
// float32 head, Zen 4: 5 rows went from 1.5x to 1.05x one row's time; prefetching into L1, or
// only one row ahead, as before, left 3-5 rows at 1.3-1.7x). A single row keeps the hardware
// prefetcher alone: it streams one weight row at memory speed.
// Input features are walked in chunks when the R activation rows being reused would not stay in
// L1 (5 rows x 2816 float32 features: the down projection ran slower than MKL); a single row
// keeps whole weight rows, which the prefetcher streams best (chunking it cost up to 2x).
constexpr int64_t kL2Ahead = 32 * 1024;  // bytes of weights between a prefetch and its use

inline int64_t feature_chunk(int R, int64_t K) {
  constexpr int64_t kL1Budget = 24 * 1024;
  if (R * K * 4 <= kL1Budget) return K;
  return std::max<int64_t>(kChunk, (kL1Budget / (4 * R)) / kChunk * kChunk);
}

template <int R, int A, typename Weights>
void rows_kernel(const Weights& W, const float* x, int64_t K, int64_t N, int64_t n0, int64_t n1, float* y) {
  const int64_t chunk = feature_chunk(R, K);
  const int64_t ahead = (kL2Ahead + Weights::bytes(chunk) - 1) / Weights::bytes(chunk);  // rows
  for (int64_t k0 = 0; k0 < K; k0 += chunk) {
    const int64_t k1 = std::min(K, k0 + chunk);
    for (int64_t n = n0; n < n1; ++n) {
      __m256 acc[R][A];
      for (int r = 0; r < R; ++r)
        for (int a = 0; a < A; ++a) acc[r][a] = _mm256_setzero_ps();
      const bool prefetch = R >= 2 && n + ahead < N;
      int64_t k = k0;
      for (; k + kBlock <= k1; k += kBlock) {
        __m256 w[4];
        if (prefetch) W.prefetch(n + ahead, k);
        W.block(n, k, w);
        for (int r = 0; r < R; ++r) {
          const float* xr = x + r * K + k;
          for (int j = 0; j < 4; ++j) acc[r][j % A] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(xr + 8 * j), acc[r][j % A]);
        }
      }
      float tail[R] = {};
      for (; k < k1; ++k) {
        const float wk = W.scalar(n, k);
        for (int r = 0; r < R; ++r) tail[r] += wk * x[r * K + k];
      }
      for (int r = 0; r < R; ++r) {
        __m256 s = acc[r][0];
        for (int a = 1; a < A; ++a) s = _mm256_add_ps(s, acc[r][a]);
        const float part = hsum(s) + tail[r];
        y[r * N + n] = k0 == 0 ? part : y[r * N + n] + part;
      }
    }
  }
}

template <typename Weights>
void dispatch_rows(int rows, const Weights& W, const float* x, int64_t K, int64_t N, int64_t n0, int64_t n1, float* y) {
  switch (rows) {
    case 1: return rows_kernel<1, 4>(W, x, K, N, n0, n1, y);
    case 2: return rows_kernel<2, 4>(W, x, K, N, n0, n1, y);
    case 3: return rows_kernel<3, 2>(W, x, K, N, n0, n1, y);
    case 4: return rows_kernel<4, 2>(W, x, K, N, n0, n1, y);
    case 5: return rows_kernel<5, 2>(W, x, K, N, n0, n1, y);
    case 6: return rows_kernel<6, 1>(W, x, K, N, n0, n1, y);
    case 7: return rows_kernel<7, 1>(W, x, K, N, n0, n1, y);
    default: return rows_kernel<8, 1>(W, x, K, N, n0, n1, y);
  }
}

// Float32 weights at 2 rows: two accumulators per row (four, as for bf16, ran 2 rows at 0.86x of
// this on a wide float32 head).
void dispatch_f32_rows(int rows, const F32Rows& W, const float* x, int64_t K, int64_t N, int64_t n0, int64_t n1, float* y) {
  if (rows == 2) return rows_kernel<2, 2>(W, x, K, N, n0, n1, y);
  dispatch_rows(rows, W, x, K, N, n0, n1, y);
}

// The activations as float32 without a torch op (bf16 widened here): per-op dispatch costs more
// than the conversion for a decode row.
struct FloatRows {
  std::vector<float> storage;
  const float* data;
  explicit FloatRows(const torch::Tensor& x) : data(nullptr) {
    const torch::Tensor c = x.contiguous();
    if (c.scalar_type() == torch::kFloat32 && c.is_same(x)) {
      data = x.data_ptr<float>();
      return;
    }
    storage.resize(c.numel());
    if (c.scalar_type() == torch::kBFloat16) {
      const uint16_t* p = reinterpret_cast<const uint16_t*>(c.data_ptr());
      for (int64_t i = 0; i < c.numel(); ++i) storage[i] = bf16_to_float(p[i]);
    } else {
      const torch::Tensor f = c.to(torch::kFloat32);
      std::memcpy(storage.data(), f.data_ptr<float>(), sizeof(float) * c.numel());
    }
    data = storage.data();
  }
};

// A float32 result buffer written out as `out_dtype` (bf16 rounded here, once).
torch::Tensor emit(const std::vector<float>& y, int64_t M, int64_t N, at::ScalarType out_dtype) {
  if (out_dtype == torch::kBFloat16) {
    torch::Tensor out = torch::empty({M, N}, torch::kBFloat16);
    uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr());
    for (int64_t i = 0; i < M * N; ++i) o[i] = float_to_bf16(y[i]);
    return out;
  }
  torch::Tensor out = torch::empty({M, N}, torch::kFloat32);
  std::memcpy(out.data_ptr<float>(), y.data(), sizeof(float) * M * N);
  return out_dtype == torch::kFloat32 ? out : out.to(out_dtype);
}

// Runs W over x [M, K] in chunks of up to kMaxRows rows, outputs split across torch's threads.
template <typename Dispatch>
torch::Tensor run(const Dispatch& dispatch, const torch::Tensor& x_in, int64_t N, at::ScalarType out_dtype) {
  const FloatRows x(x_in);
  const int64_t M = x_in.size(0), K = x_in.size(1);
  std::vector<float> y(M * N);
  for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, M - m0));
    at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
      dispatch(rows, x.data + m0 * K, K, N, n0, n1, y.data() + m0 * N);
    });
  }
  return emit(y, M, N, out_dtype);
}

// ---- int4 weights x int8 activations (dynamic, quantized per 32 input features of each row).
// Why: widening int4 to float costs three vector ops per 8 weights, which keeps the float
// kernel above compute-bound speed on AVX2; with activations quantized per block the products
// run as u8 x s8 integer dot products (maddubs: 32 products in one instruction), as llama.cpp's
// Q4 x Q8 path does. The zero-point term uses the exact float sums of each activation group.
//
// Block scales are integer multiples of one scale per row: s_b = S * m_b, with S = max_b(a_b) /
// (127 * M) and m_b = ceil(a_b / (127 * S)) for a block's max |x| a_b (so |round(x / s_b)| <=
// 127, and s_b exceeds a_b / 127 by at most S). The multiplier m_b then joins the integer dot
// product (`madd` by m_b instead of by 1) and a weight group's blocks add up in int32: one
// conversion and one FMA per weight group instead of one per block. Each int32 lane gains at most
// 8 * 15 * 127 * M per 64 features, so a group's sum stays below 238.125 * M * group < 2^31
// while M * group <= 2^23.

// One decode row: the integer step is now light enough that the hardware prefetcher alone left
// each core waiting on weight loads (measured on Zen 1: 15-25% slower without this prefetch).
constexpr int64_t kPrefetchAhead = 2048;
constexpr int64_t kMultBudget = int64_t{1} << 23;  // M * group: int32 group sums cannot overflow
constexpr int64_t kMaxMult = 4096;                  // M: s_b is a_b / 127 rounded up by <= 1/4096 of the row's largest

int64_t multiplier_range(int64_t group) { return std::max<int64_t>(1, std::min(kMaxMult, kMultBudget / group)); }

struct QuantRows {
  std::vector<int8_t> q;       // [R, K]
  std::vector<int16_t> mult;   // [R, K/32]: m_b
  std::vector<float> row_scale;  // [R]: S
  std::vector<float> gsum;     // [R, K/group]: exact float sums of x per weight group
};

QuantRows quantize_rows(const float* x, int R, int64_t K, int64_t group) {
  const int64_t blocks = K / kBlock, range = multiplier_range(group);
  QuantRows out{std::vector<int8_t>(R * K), std::vector<int16_t>(R * blocks), std::vector<float>(R, 0.f),
                std::vector<float>(R * (K / group), 0.f)};
  std::vector<float> amax(blocks);
  for (int r = 0; r < R; ++r) {
    float top = 0.f;
    for (int64_t b = 0; b < blocks; ++b) {
      const float* xb = x + r * K + b * kBlock;
      float a = 0.f, sum = 0.f;
      for (int j = 0; j < kBlock; ++j) { a = std::max(a, std::fabs(xb[j])); sum += xb[j]; }
      amax[b] = a;
      top = std::max(top, a);
      out.gsum[r * (K / group) + (b * kBlock) / group] += sum;
    }
    const float S = top / (127.f * static_cast<float>(range));
    out.row_scale[r] = S;
    for (int64_t b = 0; b < blocks; ++b) {
      const float m = S > 0.f ? std::ceil(amax[b] / (127.f * S)) : 0.f;
      out.mult[r * blocks + b] = static_cast<int16_t>(std::min<float>(m, static_cast<float>(range)));
      const float scale = S * static_cast<float>(out.mult[r * blocks + b]);
      const float inv = scale > 0.f ? 1.f / scale : 0.f;
      const float* xb = x + r * K + b * kBlock;
      int8_t* qb = out.q.data() + r * K + b * kBlock;
      for (int j = 0; j < kBlock; ++j) qb[j] = static_cast<int8_t>(std::max(-127.f, std::min(127.f, std::nearbyint(xb[j] * inv))));
    }
  }
  return out;
}

// Calls f(std::integral_constant<int, R>) for a chunk of `rows` activation rows (1-8).
template <typename F>
void by_rows(int rows, F&& f) {
  switch (rows) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 7: return f(std::integral_constant<int, 7>{});
    default: return f(std::integral_constant<int, 8>{});
  }
}

// One 32-weight block per step (group 32, or K not a multiple of 64): integer dot products of
// an output row's block against R quantized rows, times m_b, into int32 group sums.
struct BlockStep {
  static constexpr int64_t kWidth = kBlock;
  const QuantRows& xq;
  int64_t K;
  template <int R>
  inline void apply(const uint8_t* qn, int64_t b, __m256i* acc) const {
    const __m128i low = _mm_set1_epi8(0x0F);
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qn + b * (kBlock / 2)));
    const __m256i w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), low), _mm_and_si128(v, low));
    const int64_t blocks = K / kBlock;
    for (int r = 0; r < R; ++r) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.q.data() + r * K + b * kBlock));
      const __m256i m = _mm256_set1_epi16(xq.mult[r * blocks + b]);
      acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(_mm256_maddubs_epi16(w, xv), m));
    }
  }
};

// ---- two blocks per step (K a multiple of 64, groups of 64 or more).
// Why: per 32 weights the one-block step spends four vector ops unpacking nibbles into feature
// order. Loading two blocks' 32 bytes at once, one mask gives the low nibbles of both (features
// 0-15 of each block) and one shift and mask the high nibbles (features 16-31). The activations
// are laid out once per call in that order, so no weight is ever shuffled; the two u8 x s8
// products add in 16 bits (|sum| <= 4 * 15 * 127 fits), and one `madd` by the blocks'
// multipliers (16-bit lanes 0-7 block 2p's, 8-15 block 2p+1's) widens them to int32.

struct PairRows {
  std::vector<int8_t> q;     // [R, K]: per 64 features, x[0:16] x[32:48] x[16:32] x[48:64]
  std::vector<int16_t> m16;  // [R, K/64, 16]: m_{2p} in lanes 0-7, m_{2p+1} in lanes 8-15
};

PairRows pair_rows(const QuantRows& xq, int R, int64_t K) {
  const int64_t blocks = K / kBlock, pairs = K / (2 * kBlock);
  PairRows out{std::vector<int8_t>(R * K), std::vector<int16_t>(R * pairs * 16)};
  for (int r = 0; r < R; ++r) {
    for (int64_t p = 0; p < pairs; ++p) {
      const int8_t* src = xq.q.data() + r * K + p * 64;
      int8_t* dst = out.q.data() + r * K + p * 64;
      std::memcpy(dst, src, 16);
      std::memcpy(dst + 16, src + 32, 16);
      std::memcpy(dst + 32, src + 16, 16);
      std::memcpy(dst + 48, src + 48, 16);
      for (int l = 0; l < 16; ++l) out.m16[(r * pairs + p) * 16 + l] = xq.mult[r * blocks + 2 * p + l / 8];
    }
  }
  return out;
}

// One load, three ops to unpack, two maddubs and one madd per 64 weights.
struct PairStep {
  static constexpr int64_t kWidth = 2 * kBlock;
  const PairRows& xp;
  int64_t K;
  template <int R>
  inline void apply(const uint8_t* qn, int64_t p, __m256i* acc) const {
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qn + p * kBlock));
    const __m256i lo = _mm256_and_si256(v, low);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    const int64_t pairs = K / kWidth;
    for (int r = 0; r < R; ++r) {
      const int8_t* x = xp.q.data() + r * K + p * 64;
      const __m256i m = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp.m16.data() + (r * pairs + p) * 16));
      const __m256i d16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))),
                                           _mm256_maddubs_epi16(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32))));
      acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(d16, m));
    }
  }
};

// sum over groups of zeros[g] * gsum[g]: the zero-point term of one output and one row
inline float zero_term(const float* zeros, const float* gsum, int64_t groups) {
  __m256 acc = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= groups; g += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(zeros + g), _mm256_loadu_ps(gsum + g), acc);
  float total = hsum(acc);
  for (; g < groups; ++g) total += zeros[g] * gsum[g];
  return total;
}

// Per weight group: the steps' integer sums (exact), converted once and scaled by the group's
// weight scale into a float accumulator (indexing two by the group's parity kept them on the
// stack: a store and reload per group); the row scale S multiplies the total
// and the zero-point term comes last from the exact activation sums.
// PER: steps per group known at compile time (1, 2 or 4; 0 reads it at run time), so a group's
// steps unroll.
template <int R, int PER, typename Step>
void w4a8_kernel(const Step& step, const QuantRows& xq, const uint8_t* q, const float* scales, const float* zeros, int64_t K,
                 int64_t group, int64_t N, int64_t n0, int64_t n1, float* y) {
  const int64_t groups = K / group, per_group = PER > 0 ? PER : group / Step::kWidth;
  for (int64_t n = n0; n < n1; ++n) {
    __m256 acc[R];  // one accumulator: a group's integer work hides the FMA's latency
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    const uint8_t* qn = q + n * (K / 2);
    if (R >= 2 && n + 1 < N) {  // the next output's weights, as rows_kernel does
      for (int64_t off = 0; off < K / 2; off += 64) _mm_prefetch(reinterpret_cast<const char*>(qn + K / 2 + off), _MM_HINT_T0);
    }
    for (int64_t g = 0; g < groups; ++g) {
      if (R == 1) {  // the weights kPrefetchAhead bytes on (rows are contiguous: on into the next outputs)
        const char* at = reinterpret_cast<const char*>(qn + g * (group / 2)) + kPrefetchAhead;
        for (int64_t off = 0; off < group / 2; off += 64) _mm_prefetch(at + off, _MM_HINT_T0);
      }
      __m256i gi[R];
      for (int r = 0; r < R; ++r) gi[r] = _mm256_setzero_si256();
      for (int64_t u = g * per_group; u < (g + 1) * per_group; ++u) step.template apply<R>(qn, u, gi);
      const __m256 s = _mm256_set1_ps(scales[n * groups + g]);
      for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(gi[r]), s, acc[r]);
    }
    for (int r = 0; r < R; ++r)
      y[r * N + n] = xq.row_scale[r] * hsum(acc[r]) + zero_term(zeros + n * groups, xq.gsum.data() + r * groups, groups);
  }
}

void check_x(const torch::Tensor& x, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "x must be [rows, ", K, "], got ", x.sizes());
  TORCH_CHECK(x.device().is_cpu(), "x must be on the CPU");
}

void check_int4(const torch::Tensor& q, const torch::Tensor& scales, const torch::Tensor& zeros, int64_t group) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kUInt8 && q.is_contiguous(), "q must be a contiguous uint8 [N, K/2] tensor");
  const int64_t N = q.size(0), K = q.size(1) * 2;
  TORCH_CHECK(K % kBlock == 0 && group % kBlock == 0 && K % group == 0 && (group & (group - 1)) == 0,
              "int4 kernel needs a power-of-two group size of at least 32 that divides K");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat32 && zeros.scalar_type() == torch::kFloat32, "scales and zeros must be float32");
  TORCH_CHECK(scales.is_contiguous() && zeros.is_contiguous() && scales.numel() == N * (K / group) && zeros.numel() == scales.numel(),
              "scales and zeros must be contiguous [N, K/group]");
}

}  // namespace

torch::Tensor gemv_bf16(const torch::Tensor& x, const torch::Tensor& w, at::ScalarType out_dtype) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kBFloat16 && w.is_contiguous(), "w must be a contiguous bf16 [N, K] tensor");
  check_x(x, w.size(1));
  const Bf16Rows W{reinterpret_cast<const uint16_t*>(w.data_ptr()), w.size(1)};
  const auto dispatch = [&W](int rows, const float* xr, int64_t K, int64_t N, int64_t n0, int64_t n1, float* y) {
    dispatch_rows(rows, W, xr, K, N, n0, n1, y);
  };
  return run(dispatch, x, w.size(0), out_dtype);
}

// The float32 weight read in place: at one to a few rows oneDNN's prepacked kernel pays a fixed
// cost per call that exceeds a small layer's whole product, and MKL's gemv streams below memory
// speed on wide LM heads.
torch::Tensor gemv_f32(const torch::Tensor& x, const torch::Tensor& w, at::ScalarType out_dtype) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kFloat32 && w.is_contiguous(), "w must be a contiguous float32 [N, K] tensor");
  check_x(x, w.size(1));
  const F32Rows W{w.data_ptr<float>(), w.size(1)};
  const auto dispatch = [&W](int rows, const float* xr, int64_t K, int64_t N, int64_t n0, int64_t n1, float* y) {
    dispatch_f32_rows(rows, W, xr, K, N, n0, n1, y);
  };
  return run(dispatch, x, w.size(0), out_dtype);
}

torch::Tensor gemv_int4(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scales, const torch::Tensor& zeros,
                        int64_t group, at::ScalarType out_dtype) {
  const int64_t N = q.size(0), K = q.size(1) * 2;
  check_int4(q, scales, zeros, group);
  check_x(x, K);
  const Int4Rows W{q.data_ptr<uint8_t>(), scales.data_ptr<float>(), zeros.data_ptr<float>(), K, K / group, __builtin_ctzll(static_cast<unsigned long long>(group))};
  const auto dispatch = [&W](int rows, const float* xr, int64_t K, int64_t N, int64_t n0, int64_t n1, float* y) {
    dispatch_rows(rows, W, xr, K, N, n0, n1, y);
  };
  return run(dispatch, x, N, out_dtype);
}

// y = (x @ q.T) * scale[n]: an int8 weight with one float32 scale per output row.
torch::Tensor gemv_int8(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scales, at::ScalarType out_dtype) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kInt8 && q.is_contiguous(), "q must be a contiguous int8 [N, K] tensor");
  const int64_t N = q.size(0);
  TORCH_CHECK(scales.scalar_type() == torch::kFloat32 && scales.is_contiguous() && scales.numel() == N,
              "scales must be a contiguous float32 tensor of one value per output row");
  check_x(x, q.size(1));
  const Int8Rows W{q.data_ptr<int8_t>(), q.size(1)};
  const float* s = scales.data_ptr<float>();
  const auto dispatch = [&W, s](int rows, const float* xr, int64_t K, int64_t N, int64_t n0, int64_t n1, float* y) {
    dispatch_rows(rows, W, xr, K, N, n0, n1, y);
    for (int r = 0; r < rows; ++r)
      for (int64_t n = n0; n < n1; ++n) y[r * N + n] *= s[n];
  };
  return run(dispatch, x, N, out_dtype);
}

torch::Tensor gemv_int4_a8(const torch::Tensor& x_in, const torch::Tensor& q, const torch::Tensor& scales, const torch::Tensor& zeros,
                           int64_t group, at::ScalarType out_dtype) {
  const int64_t N = q.size(0), K = q.size(1) * 2;
  check_int4(q, scales, zeros, group);
  check_x(x_in, K);
  const FloatRows x(x_in);
  const int64_t M = x_in.size(0);
  std::vector<float> y(M * N);
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* zp = zeros.data_ptr<float>();
  for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, M - m0));
    const QuantRows xq = quantize_rows(x.data + m0 * K, rows, K, group);
    float* yp = y.data() + m0 * N;
    const auto run_step = [&](const auto& step) {
      at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
        by_rows(rows, [&](auto R) {
          constexpr int kR = decltype(R)::value;
          using S = std::decay_t<decltype(step)>;
          switch (group / S::kWidth) {
            case 1: return w4a8_kernel<kR, 1>(step, xq, qp, sp, zp, K, group, N, n0, n1, yp);
            case 2: return w4a8_kernel<kR, 2>(step, xq, qp, sp, zp, K, group, N, n0, n1, yp);
            case 4: return w4a8_kernel<kR, 4>(step, xq, qp, sp, zp, K, group, N, n0, n1, yp);
            default: return w4a8_kernel<kR, 0>(step, xq, qp, sp, zp, K, group, N, n0, n1, yp);
          }
        });
      });
    };
    if (K % PairStep::kWidth == 0 && group >= PairStep::kWidth) {
      const PairRows xp = pair_rows(xq, rows, K);
      run_step(PairStep{xp, K});
    } else {
      run_step(BlockStep{xq, K});
    }
  }
  return emit(y, M, N, out_dtype);
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
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* xr = xp + r * H;
    float sum = 0.f;
    for (int64_t i = 0; i < H; ++i) {
      const float v = bf16_to_float(xr[i]);
      sum += v * v;
    }
    const float inv = 1.f / std::sqrt(sum / static_cast<float>(H) + static_cast<float>(eps));
    for (int64_t i = 0; i < H; ++i) {
      const float h = bf16_to_float(float_to_bf16(bf16_to_float(xr[i]) * inv));
      op[r * H + i] = float_to_bf16(bf16_to_float(wp[i]) * h);
    }
  }
  return out;
}

// How many threads at::parallel_for really ran on: 1 when the library was built without OpenMP
// (the pragma in torch's header is then ignored and every kernel silently runs serially).
int64_t parallel_threads() {
  std::vector<int> seen(at::get_num_threads() + 1, 0);
  at::parallel_for(0, 1 << 12, 1, [&](int64_t, int64_t) { seen[std::min<int64_t>(at::get_thread_num(), seen.size() - 1)] = 1; });
  int64_t used = 0;
  for (int v : seen) used += v;
  return used;
}
