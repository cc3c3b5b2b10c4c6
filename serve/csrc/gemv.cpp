// Small-batch matrix products for the serving engine's CPU path: the ISA-free parts and the
// exported entry points, which run the variant chosen at load (serve/cpu_kernels.py, set_isa).
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
// ISA variants: gemv_impl.h holds the kernels once; this file includes it four times, each in
// its own namespace under `#pragma GCC target`: avx2 (256-bit, the baseline flags), avx512
// (512-bit vectors: one weight block of 32 is two vectors), avx512_vnni (int4 x int8: the
// multiplier `madd` and the int32 add fused into vpdpwssd) and avx512_bf16 (bf16 weights times
// bf16 activations with vdpbf16ps: 32 products per instruction, no widening). One build holds
// all four; a CPU only ever runs the one its flags allow (checked again in set_isa).
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
#include <string>
#include <type_traits>
#include <vector>

#include "bf16.h"
#include "rows.h"

namespace {

using warsha::bf16_to_float;
using warsha::float_to_bf16;

constexpr int64_t kBlock = 32;   // weights handled per inner iteration (4 AVX2 or 2 AVX-512 vectors)
constexpr int kMaxRows = 8;       // activation rows per pass over the weights
constexpr int64_t kChunk = 256;  // granularity of feature chunks (a multiple of kBlock and of any int4 group)

// How a one-row product walks the weights (set_isa picks it from the CPU's vendor; set_row_order
// overrides it for tests and benchmarks). Interleaved: a group of output rows block by block, with
// the next group asked for in software; on a 2-core Sapphire Rapids VM the hardware prefetchers
// alone left a 270k x 640 head at 14-16 GB/s and this order reached 24-27. Streamed: one output row
// after another, whole, in memory order; on a 2-core Zen 4 VM the interleaved order read that head
// at 23-24 GB/s (14 ms) and K = 640-2048 layers at 22-34, the streamed one every shape at read
// speed (33-35 GB/s: 9.6 ms; a load-only pass: 9.9). The per-row sums are the same either way.
bool g_stream_rows = false;

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Input features are walked in chunks when the R activation rows being reused would not stay in
// L1 (5 rows x 2816 float32 features: the down projection ran slower than MKL); a single row
// keeps whole weight rows, which the prefetcher streams best (chunking it cost up to 2x).
constexpr int64_t kL2Ahead = 32 * 1024;  // bytes of weights between a prefetch and its use (rows_kernel)

inline int64_t feature_chunk(int R, int64_t K) {
  constexpr int64_t kL1Budget = 24 * 1024;
  if (R * K * 4 <= kL1Budget) return K;
  return std::max<int64_t>(kChunk, (kL1Budget / (4 * R)) / kChunk * kChunk);
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

// The float32 sums of a product, allocated without a fill: every kernel assigns each element it
// owns (a fill was a pass over 1 MB per decode step on a 262k-row head). It is the result itself
// when the caller asks for float32.
torch::Tensor sums_buffer(int64_t M, int64_t N) { return torch::empty({M, N}, torch::kFloat32); }

// The float32 sums as `out_dtype` (bf16 rounded here, once).
torch::Tensor emit(const torch::Tensor& y, at::ScalarType out_dtype) {
  if (out_dtype == torch::kFloat32) return y;
  if (out_dtype != torch::kBFloat16) return y.to(out_dtype);
  torch::Tensor out = torch::empty(y.sizes(), torch::kBFloat16);
  const float* s = y.data_ptr<float>();
  uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr());
  for (int64_t i = 0; i < y.numel(); ++i) o[i] = float_to_bf16(s[i]);
  return out;
}

// Each float32 value of y [n] rounded to bf16 and widened back, in place: the numbers a bf16
// product widened afterwards gives, without the bf16 copy and the widening pass.
void round_through_bf16(float* y, int64_t n) {
  at::parallel_for(0, n, 16384, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) y[i] = bf16_to_float(float_to_bf16(y[i]));
  });
}

// The float32 [M, N] output a caller hands in (the engine's logits buffer), checked.
float* out_rows(const torch::Tensor& out, int64_t M, int64_t N) {
  TORCH_CHECK(out.scalar_type() == torch::kFloat32 && out.is_contiguous() && out.dim() == 2 && out.size(0) == M &&
                  out.size(1) == N,
              "out must be a contiguous float32 [", M, ", ", N, "] tensor, got ", out.scalar_type(), " ", out.sizes());
  return out.data_ptr<float>();
}

// Runs W over x [M, K] in chunks of up to kMaxRows rows into y [M, N], outputs split across torch's threads.
template <typename Dispatch>
void run_into(const Dispatch& dispatch, const torch::Tensor& x_in, int64_t N, float* y) {
  const FloatRows x(x_in);
  const int64_t M = x_in.size(0), K = x_in.size(1);
  for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, M - m0));
    at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
      dispatch(rows, x.data + m0 * K, K, N, n0, n1, y + m0 * N);
    });
  }
}

template <typename Dispatch>
torch::Tensor run(const Dispatch& dispatch, const torch::Tensor& x_in, int64_t N, at::ScalarType out_dtype) {
  torch::Tensor y = sums_buffer(x_in.size(0), N);
  run_into(dispatch, x_in, N, y.data_ptr<float>());
  return emit(y, out_dtype);
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
  warsha::with_rows<kMaxRows>(rows, std::forward<F>(f));
}

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

// ---- four blocks per step (K and the group multiples of 128; 512-bit VNNI variants only).
// The activations of each 128 features in the order one 64-byte weight load unpacks to: the low
// nibbles (features 0-15 of blocks 0-3) then the high ones (16-31 of blocks 0-3); the
// multipliers as int16 pairs (m_b, 0) per int32 lane, lanes 4b..4b+3 for block b.
struct QuadRows {
  std::vector<int8_t> q;     // [R, K]: per 128 features, x[0:16] x[32:48] x[64:80] x[96:112] x[16:32] ... x[112:128]
  std::vector<int16_t> m32;  // [R, K/128, 32]
};

QuadRows quad_rows(const QuantRows& xq, int R, int64_t K) {
  const int64_t blocks = K / kBlock, steps = K / (4 * kBlock);
  QuadRows out{std::vector<int8_t>(R * K), std::vector<int16_t>(R * steps * 32, 0)};
  for (int r = 0; r < R; ++r) {
    for (int64_t s = 0; s < steps; ++s) {
      const int8_t* src = xq.q.data() + r * K + s * 128;
      int8_t* dst = out.q.data() + r * K + s * 128;
      for (int b = 0; b < 4; ++b) {
        std::memcpy(dst + 16 * b, src + 32 * b, 16);
        std::memcpy(dst + 64 + 16 * b, src + 32 * b + 16, 16);
      }
      for (int l = 0; l < 16; ++l) out.m32[(r * steps + s) * 32 + 2 * l] = xq.mult[r * blocks + 4 * s + l / 4];
    }
  }
  return out;
}

// ---- int16 activations for int8 weights (512-bit VNNI variants; gemv_int8 on K <= kInt16MaxK).
// Each row is rounded once to int16 with one scale, S = max|x| / 32767 (float32), q = round(x / S)
// (half to even): an error of at most S / 2 per element, 1.5e-5 of the row's largest value,
// against the int8 weights' own rounding of 1/254 of their row's. Rows are zero-padded to a
// multiple of 32 features so the kernel reads whole vectors of them.
constexpr int64_t kInt16MaxK = 8192;  // a lane gains <= 2 x 127 x 32767 per step: K / 32 steps stay < 2^31

struct Int16Rows {
  std::vector<int16_t> q;     // [R, Kp]
  std::vector<float> scale;   // [R]: S
  int64_t Kp;                 // K rounded up to 32
};

Int16Rows quantize_rows_int16(const float* x, int R, int64_t K) {
  const int64_t Kp = (K + 31) / 32 * 32;
  Int16Rows out{std::vector<int16_t>(R * Kp, 0), std::vector<float>(R, 0.f), Kp};
  for (int r = 0; r < R; ++r) {
    const float* xr = x + r * K;
    float amax = 0.f;
    for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(xr[k]));
    const float S = amax / 32767.f;
    out.scale[r] = S;
    if (S == 0.f) continue;
    for (int64_t k = 0; k < K; ++k)
      out.q[r * Kp + k] = static_cast<int16_t>(std::max(-32767.f, std::min(32767.f, std::nearbyint(xr[k] / S))));
  }
  return out;
}

// sum over groups of zeros[g] * gsum[g]: the zero-point term of one output and one row
inline float zero_term(const float* zeros, const float* gsum, int64_t groups) {
  __m256 acc = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= groups; g += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(zeros + g), _mm256_loadu_ps(gsum + g), acc);
  float total = hsum(acc);
  for (; g < groups; ++g) total += zeros[g] * gsum[g];
  return total;
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

// ---- the variants: gemv_impl.h once per ISA (see the header comment)
namespace isa_avx2 {
#define WARSHA_VEC 256
#define WARSHA_VNNI 0
#define WARSHA_BF16DOT 0
#include "gemv_impl.h"
#undef WARSHA_VEC
#undef WARSHA_VNNI
#undef WARSHA_BF16DOT
}  // namespace isa_avx2

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")
namespace isa_avx512 {
#define WARSHA_VEC 512
#define WARSHA_VNNI 0
#define WARSHA_BF16DOT 0
#include "gemv_impl.h"
#undef WARSHA_VEC
#undef WARSHA_VNNI
#undef WARSHA_BF16DOT
}  // namespace isa_avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")
namespace isa_avx512_vnni {
#define WARSHA_VEC 512
#define WARSHA_VNNI 1
#define WARSHA_BF16DOT 0
#include "gemv_impl.h"
#undef WARSHA_VEC
#undef WARSHA_VNNI
#undef WARSHA_BF16DOT
}  // namespace isa_avx512_vnni
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16")
namespace isa_avx512_bf16 {
#define WARSHA_VEC 512
#define WARSHA_VNNI 1
#define WARSHA_BF16DOT 1
#include "gemv_impl.h"
#undef WARSHA_VEC
#undef WARSHA_VNNI
#undef WARSHA_BF16DOT
}  // namespace isa_avx512_bf16
#pragma GCC pop_options

// The variant every entry point runs: set once at load by serve/cpu_kernels.py (set_isa).
// kAmx: the avx512_bf16 kernels here, and serve/csrc/amx.cpp's tile GEMM for larger batches.
enum class Isa { kAvx2, kAvx512, kAvx512Vnni, kAvx512Bf16, kAmx };
Isa g_isa = Isa::kAvx2;

}  // namespace

#define WARSHA_DISPATCH(fn, ...)                                           \
  switch (g_isa) {                                                         \
    case Isa::kAvx512: return isa_avx512::fn(__VA_ARGS__);                 \
    case Isa::kAvx512Vnni: return isa_avx512_vnni::fn(__VA_ARGS__);        \
    case Isa::kAvx512Bf16: return isa_avx512_bf16::fn(__VA_ARGS__);        \
    case Isa::kAmx: return isa_avx512_bf16::fn(__VA_ARGS__);               \
    default: return isa_avx2::fn(__VA_ARGS__);                             \
  }

bool amx_enable();  // serve/csrc/amx.cpp: the OS grants the tile state (once)

// Choose the variant by name ("avx2", "avx512", "avx512_vnni", "avx512_bf16", "amx"); the CPU must
// report every extension it uses (checked here too: a wrong choice would be an illegal
// instruction, not an error).
void set_isa(const std::string& name) {
  __builtin_cpu_init();
  g_stream_rows = !__builtin_cpu_is("intel");
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  const bool vnni = avx512 && __builtin_cpu_supports("avx512vnni");
  const bool bf16 = vnni && __builtin_cpu_supports("avx512bf16");
  if (name == "avx2") {
    g_isa = Isa::kAvx2;
  } else if (name == "avx512") {
    TORCH_CHECK(avx512, "this CPU lacks AVX-512 F/BW/VL/DQ: the avx512 kernels cannot run here");
    g_isa = Isa::kAvx512;
  } else if (name == "avx512_vnni") {
    TORCH_CHECK(vnni, "this CPU lacks AVX-512 VNNI: the avx512_vnni kernels cannot run here");
    g_isa = Isa::kAvx512Vnni;
  } else if (name == "avx512_bf16") {
    TORCH_CHECK(bf16, "this CPU lacks AVX-512 BF16: the avx512_bf16 kernels cannot run here");
    g_isa = Isa::kAvx512Bf16;
  } else if (name == "amx") {
    TORCH_CHECK(bf16 && amx_enable(), "this CPU or its OS gives no AMX tiles: the amx kernels cannot run here");
    g_isa = Isa::kAmx;
  } else {
    TORCH_CHECK(false, "unknown ISA '", name, "': one of avx2, avx512, avx512_vnni, avx512_bf16, amx");
  }
}

// "stream" or "interleave" (see g_stream_rows); set_row_order("") goes back to the vendor's default.
void set_row_order(const std::string& order) {
  TORCH_CHECK(order.empty() || order == "stream" || order == "interleave", "row order must be 'stream' or 'interleave', got '", order, "'");
  __builtin_cpu_init();
  g_stream_rows = order.empty() ? !__builtin_cpu_is("intel") : order == "stream";
}

std::string row_order() { return g_stream_rows ? "stream" : "interleave"; }

std::string current_isa() {
  switch (g_isa) {
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx512Vnni: return "avx512_vnni";
    case Isa::kAvx512Bf16: return "avx512_bf16";
    case Isa::kAmx: return "amx";
    default: return "avx2";
  }
}

torch::Tensor gemv_bf16(const torch::Tensor& x, const torch::Tensor& w, at::ScalarType out_dtype) {
  WARSHA_DISPATCH(gemv_bf16, x, w, out_dtype)
}

void gemv_bf16_out(const torch::Tensor& x, const torch::Tensor& w, torch::Tensor out, bool round_bf16) {
  WARSHA_DISPATCH(gemv_bf16_out, x, w, out, round_bf16)
}

torch::Tensor gemv_f32(const torch::Tensor& x, const torch::Tensor& w, at::ScalarType out_dtype) {
  WARSHA_DISPATCH(gemv_f32, x, w, out_dtype)
}

torch::Tensor gemv_int4(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scales, const torch::Tensor& zeros,
                        int64_t group, at::ScalarType out_dtype) {
  WARSHA_DISPATCH(gemv_int4, x, q, scales, zeros, group, out_dtype)
}

torch::Tensor gemv_int8(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scales, at::ScalarType out_dtype) {
  WARSHA_DISPATCH(gemv_int8, x, q, scales, out_dtype)
}

// x [M, K] @ w.T at the pairs (rows[p], cols[p]) only, rounded through bf16, into out [P]
// (avx512_bf16 and amx variants: the batch head screen runs only there).
void gemv_bf16_pairs(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& rows, const torch::Tensor& cols,
                     torch::Tensor out) {
  TORCH_CHECK(g_isa == Isa::kAvx512Bf16 || g_isa == Isa::kAmx, "gemv_bf16_pairs needs the avx512_bf16 or amx variant");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.is_contiguous(), "x must be a contiguous bf16 [M, K] tensor");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kBFloat16 && w.is_contiguous() && w.size(1) == x.size(1),
              "w must be a contiguous bf16 [N, K] tensor with x's K");
  const int64_t P = rows.numel();
  for (const auto* t : {&rows, &cols})
    TORCH_CHECK(t->scalar_type() == torch::kLong && t->is_contiguous() && t->numel() == P, "rows and cols must be int64 [P]");
  TORCH_CHECK(out.scalar_type() == torch::kFloat32 && out.is_contiguous() && out.numel() == P, "out must be float32 [P]");
  if (P == 0) return;
  const auto lo_hi = [](const torch::Tensor& t) { return std::make_pair(t.min().item<int64_t>(), t.max().item<int64_t>()); };
  const auto [r0, r1] = lo_hi(rows);
  const auto [c0, c1] = lo_hi(cols);
  TORCH_CHECK(r0 >= 0 && r1 < x.size(0) && c0 >= 0 && c1 < w.size(0), "pair indices out of range");
  isa_avx512_bf16::gemv_bf16_pairs(x, w, rows, cols, out);
}

// Whether gemv_int8 rounds activations to int16 for this K under the running variant.
bool int8_rounds_activations(int64_t K) {
  return (g_isa == Isa::kAvx512Vnni || g_isa == Isa::kAvx512Bf16 || g_isa == Isa::kAmx) && K <= kInt16MaxK;
}

// x [M, K] float32 rounded as gemv_int8 rounds it there (S * round(x / S) per row): what a
// larger batch multiplies so that every batch size computes the same head.
torch::Tensor round_rows_int16(const torch::Tensor& x_in) {
  TORCH_CHECK(x_in.dim() == 2, "x must be [rows, features]");
  const FloatRows x(x_in);
  const int64_t M = x_in.size(0), K = x_in.size(1);
  const Int16Rows xq = quantize_rows_int16(x.data, static_cast<int>(M), K);
  torch::Tensor out = torch::empty({M, K}, torch::kFloat32);
  float* o = out.data_ptr<float>();
  for (int64_t r = 0; r < M; ++r)
    for (int64_t k = 0; k < K; ++k) o[r * K + k] = static_cast<float>(xq.q[r * xq.Kp + k]) * xq.scale[r];
  return out;
}

torch::Tensor gemv_int4_a8(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scales, const torch::Tensor& zeros,
                           int64_t group, at::ScalarType out_dtype) {
  WARSHA_DISPATCH(gemv_int4_a8, x, q, scales, zeros, group, out_dtype)
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
