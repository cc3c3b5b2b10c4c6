// bf16 matrix products on Intel AMX tiles for the CPU path's mid-sized batches (Sapphire Rapids
// and later: `amx_tile`, `amx_bf16` in /proc/cpuinfo).
//
// Why: a mixed serving step (a few dozen decode rows beside prefill chunks) multiplies 20-600
// activation rows by every weight. oneDNN runs these on AMX too, but at these sizes its fixed
// cost per call and its blocking leave most of the tiles' speed unused: measured on a 2-core
// Sapphire Rapids host, Gemma 3 270M's 4096 x 640 gate/up projection at 24-64 rows ran at 8-16
// GB/s of weights where memory gives about 20, and its 278k-row LM head at 30 rows at 46% of
// memory speed. The arithmetic is not the limit (one tile product is 16 x 16 x 32 multiply-adds;
// two cores do a 30-row head in about 4 ms of tile time against 15-18 ms to read it), so the
// product here streams each weight panel once per 32 rows, with software prefetch ahead of it.
//
// Layout (amx_pack_bf16): a weight [N, K] becomes [N/16][K/32][16][32] bf16: for 16 output rows
// and 32 input features, tile row p holds features 2p and 2p+1 of each of the 16 outputs
// side by side (the pair layout TDPBF16PS reads). One such 1 KiB tile is one load; a panel of
// 16 outputs is K/32 consecutive tiles, so the whole weight is one forward stream.
//
// Loop: each thread takes pairs of 16-output blocks; for every 32 activation rows it keeps four
// float32 accumulator tiles (2 row blocks x 2 output blocks), loads two activation tiles straight
// from x (row stride K) and two weight tiles per 32 features. Rows past M are zero padding
// (copied once); outputs are float32 sums rounded once (to bf16, or kept in float32), after the
// bias. The OS must grant the tile state first (Linux 5.16+: arch_prctl ARCH_REQ_XCOMP_PERM).
//
// Large float32 outputs (the LM head's logits: 53 MB at 48 rows of a 278k vocabulary) are written
// with non-temporal stores: a plain store first reads each line it writes (the write-allocate),
// and tens of megabytes of logits then push the weight stream and the activations out of cache.
// Measured on the head at 32-64 rows, 2 threads: 34.9 -> 30.6 ms at 48 rows, 45.0 -> 35.3 at 64.
// The numbers written are the same; only the path to memory differs.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx_tiles.h"
#include "bf16.h"

namespace {

using warsha::float_to_bf16;
using warsha::bf16_to_float;

constexpr int kArchReqXcompPerm = 0x1023;  // arch_prctl: ask for an extended state component
constexpr int kXfeatureXtiledata = 18;     // the AMX tile data component
constexpr int64_t kTileK = 32;             // bf16 features per tile row (64 bytes)
constexpr int64_t kTileN = 16;             // outputs per weight tile
constexpr int64_t kTileM = 16;             // activation rows per tile
constexpr int64_t kTileElems = kTileK * kTileN;
constexpr int64_t kPrefetchBytes = 8192;   // how far ahead of its use a weight line is requested
constexpr int64_t kSlabBytes = 512 * 1024;  // activation bytes per slab of rows (a quarter of L2)
constexpr int64_t kStreamBytes = 4 << 20;   // float32 outputs from this size go around the caches

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")

// Tiles 0-3 hold accumulators, 4-5 activations, 6-7 weights (warsha::configure_tiles).

inline void prefetch_tile(const uint16_t* tile) {
  const char* p = reinterpret_cast<const char*>(tile) + kPrefetchBytes;
  for (int line = 0; line < 1024; line += 64) _mm_prefetch(p + line, _MM_HINT_T0);
}

// c[32][32] float32 = a (32 rows, stride lda) x the weight panels b0, b1 (kblocks tiles each).
template <bool TwoM, bool TwoN>
void tile_block(const uint16_t* a, int64_t lda, const uint16_t* b0, const uint16_t* b1, int64_t kblocks, bool prefetch,
                float* c) {
  _tile_zero(0);
  if (TwoN) _tile_zero(1);
  if (TwoM) _tile_zero(2);
  if (TwoM && TwoN) _tile_zero(3);
  for (int64_t kb = 0; kb < kblocks; ++kb) {
    const uint16_t* w0 = b0 + kb * kTileElems;
    const uint16_t* w1 = b1 + kb * kTileElems;
    if (prefetch) {
      prefetch_tile(w0);
      if (TwoN) prefetch_tile(w1);
    }
    _tile_loadd(4, a + kb * kTileK, lda * 2);
    _tile_loadd(6, w0, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (TwoN) {
      _tile_loadd(7, w1, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if (TwoM) {
      _tile_loadd(5, a + kTileM * lda + kb * kTileK, lda * 2);
      _tile_dpbf16ps(2, 5, 6);
      if (TwoN) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, 128);
  if (TwoN) _tile_stored(1, c + 16, 128);
  if (TwoM) _tile_stored(2, c + 16 * 32, 128);
  if (TwoM && TwoN) _tile_stored(3, c + 16 * 32 + 16, 128);
}

// Rows [m0, m0 + rows) and 16 or 32 columns from n0 of the output from c, plus the bias, rounded.
// stream: non-temporal float32 stores (the caller checked that every row start is 64-byte aligned).
void store_block(const float* c, int64_t rows, int64_t cols, const float* bias, int64_t n0, bool out_bf16, bool round_bf16,
                 bool stream, char* out, int64_t ldo, int64_t m0) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t q = 0; q < cols; q += 16) {
      __m512 v = _mm512_load_ps(c + r * 32 + q);
      if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + n0 + q));
      if (out_bf16) {
        uint16_t* dst = reinterpret_cast<uint16_t*>(out) + (m0 + r) * ldo + n0 + q;
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), warsha::bf16x16_bits(v));
      } else {
        float* dst = reinterpret_cast<float*>(out) + (m0 + r) * ldo + n0 + q;
        if (round_bf16) v = warsha::bf16x16_round(v);
        if (stream) _mm512_stream_ps(dst, v);
        else _mm512_storeu_ps(dst, v);
      }
    }
  }
}

// Rows [s0, s1) of the (padded) activations against every weight panel, on all threads.
void gemm_slab(const uint16_t* a, int64_t M, int64_t s0, int64_t s1, int64_t K, const uint16_t* packed, int64_t kblocks,
               int64_t nblocks, int64_t npairs, const float* bias, bool out_bf16, bool round_bf16, bool stream, char* out,
               int64_t ldo) {
  at::parallel_for(0, npairs, 1, [&](int64_t p0, int64_t p1) {
    warsha::configure_tiles();
    alignas(64) float c[32 * 32];
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t nb = 2 * p;
      const bool two_n = nb + 1 < nblocks;
      const uint16_t* b0 = packed + nb * kblocks * kTileElems;
      const uint16_t* b1 = b0 + kblocks * kTileElems;
      for (int64_t m0 = s0; m0 < s1; m0 += 2 * kTileM) {
        const bool two_m = m0 + kTileM < s1;
        const uint16_t* am = a + m0 * K;
        const bool pf = m0 == s0;  // later row blocks find the panel in cache
        if (two_m && two_n) tile_block<true, true>(am, K, b0, b1, kblocks, pf, c);
        else if (two_m) tile_block<true, false>(am, K, b0, b1, kblocks, pf, c);
        else if (two_n) tile_block<false, true>(am, K, b0, b1, kblocks, pf, c);
        else tile_block<false, false>(am, K, b0, b1, kblocks, pf, c);
        const int64_t rows = std::min<int64_t>(M - m0, two_m ? 2 * kTileM : kTileM);
        store_block(c, rows, two_n ? 2 * kTileN : kTileN, bias, nb * kTileN, out_bf16, round_bf16, stream, out, ldo, m0);
      }
    }
    if (stream) _mm_sfence();  // the streamed lines reach memory before another thread reads them
    _tile_release();
  });
}

void run_gemm(const uint16_t* a, int64_t M, int64_t Mp, int64_t K, const uint16_t* packed, int64_t N, const float* bias,
              bool out_bf16, bool round_bf16, char* out, int64_t ldo) {
  const int64_t kblocks = K / kTileK, nblocks = N / kTileN, npairs = (nblocks + 1) / 2;
  const bool stream = !out_bf16 && M * N * 4 >= kStreamBytes && reinterpret_cast<uintptr_t>(out) % 64 == 0 && ldo % 16 == 0;
  // Rows are taken in slabs whose activations stay in L2 while every weight panel passes by
  // them; past that (2048 rows x 640 features is 2.6 MB) each panel pulled them from L3 again.
  const int64_t slab = std::max<int64_t>(2 * kTileM, kSlabBytes / (2 * K) / (2 * kTileM) * (2 * kTileM));
  for (int64_t s0 = 0; s0 < Mp; s0 += slab) {
    const int64_t s1 = std::min(Mp, s0 + slab);
    gemm_slab(a, M, s0, s1, K, packed, kblocks, nblocks, npairs, bias, out_bf16, round_bf16, stream, out, ldo);
  }
}

#pragma GCC pop_options

}  // namespace

// Ask the OS for the tile state once; false where the CPU or the kernel cannot give it.
bool amx_enable() {
  static const bool granted = [] {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx512bf16")) return false;
    unsigned eax, ebx, ecx, edx;
    __asm__("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(7), "c"(0));
    const bool tile = (edx >> 24) & 1, bf16 = (edx >> 22) & 1;
    return tile && bf16 && syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
}

// The tile state and AMX-INT8 (TDPBUSD: the head screen's uint8 x int8 sums, csrc/screen_gemm.cpp).
bool amx_int8_enable() {
  static const bool granted = [] {
    unsigned eax, ebx, ecx, edx;
    __asm__("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(7), "c"(0));
    return ((edx >> 25) & 1) && amx_enable();
  }();
  return granted;
}

// The tile layout of a bf16 weight [N, K] (see the header); N a multiple of 16, K of 32.
torch::Tensor amx_pack_bf16(const torch::Tensor& w_in) {
  TORCH_CHECK(w_in.dim() == 2 && w_in.scalar_type() == torch::kBFloat16, "amx_pack_bf16 takes a 2-D bf16 weight");
  const torch::Tensor w = w_in.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N % kTileN == 0 && K % kTileK == 0, "amx_pack_bf16: outputs (", N, ") must be a multiple of 16 and inputs (",
              K, ") of 32");
  torch::Tensor out = torch::empty({N / kTileN, K / kTileK, kTileN, kTileK}, w.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t kblocks = K / kTileK;
  at::parallel_for(0, N / kTileN, 64, [&](int64_t b0, int64_t b1) {
    for (int64_t nb = b0; nb < b1; ++nb)
      for (int64_t kb = 0; kb < kblocks; ++kb) {
        uint16_t* tile = dst + (nb * kblocks + kb) * kTileElems;
        for (int64_t p = 0; p < kTileK / 2; ++p)
          for (int64_t n = 0; n < kTileN; ++n)
            for (int64_t j = 0; j < 2; ++j) tile[p * 32 + n * 2 + j] = src[(nb * kTileN + n) * K + kb * kTileK + 2 * p + j];
      }
  });
  return out;
}

// out[M, N] (row stride out.stride(0)) = x[M, K] @ W^T (+ bias), W packed by amx_pack_bf16.
// out bf16: one rounding of the float32 sum; out float32: rounded through bf16 when round_bf16
// (the numbers a bf16 GEMM widened afterwards gives), else the float32 sums.
void amx_linear_bf16_out(const torch::Tensor& x_in, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias_in,
                         torch::Tensor out, bool round_bf16) {
  TORCH_CHECK(amx_enable(), "amx_linear_bf16: this CPU or OS gives no AMX tiles");
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == torch::kBFloat16, "amx_linear_bf16 takes 2-D bf16 rows");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kTileN && packed.size(3) == kTileK, "amx_linear_bf16: not a packed weight");
  const int64_t M = x_in.size(0), K = x_in.size(1), N = packed.size(0) * kTileN;
  TORCH_CHECK(packed.size(1) * kTileK == K, "amx_linear_bf16: x has ", K, " features, the weight ", packed.size(1) * kTileK);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == M && out.size(1) == N && out.stride(1) == 1, "amx_linear_bf16: out must be [",
              M, ", ", N, "] with unit column stride");
  const bool out_bf16 = out.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(out_bf16 || out.scalar_type() == torch::kFloat32, "amx_linear_bf16: out must be bf16 or float32");
  torch::Tensor bias;
  if (bias_in.has_value()) {
    bias = bias_in->to(torch::kFloat32).contiguous();
    TORCH_CHECK(bias.numel() == N, "amx_linear_bf16: bias has ", bias.numel(), " values for ", N, " outputs");
  }
  if (M == 0) return;
  const int64_t Mp = (M + kTileM - 1) / kTileM * kTileM;
  torch::Tensor x = x_in.contiguous();
  if (Mp != M) {  // zero rows up to the tile height: the tiles read whole 16-row blocks
    torch::Tensor padded = torch::empty({Mp, K}, x.options());
    padded.narrow(0, 0, M).copy_(x);
    padded.narrow(0, M, Mp - M).zero_();  // only the padding (a full zero fill cost a pass over x)
    x = padded;
  }
  run_gemm(reinterpret_cast<const uint16_t*>(x.data_ptr()), M, Mp, K, reinterpret_cast<const uint16_t*>(packed.data_ptr()), N,
           bias.defined() ? bias.data_ptr<float>() : nullptr, out_bf16, round_bf16, reinterpret_cast<char*>(out.data_ptr()),
           out.stride(0));
}

torch::Tensor amx_linear_bf16(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias) {
  torch::Tensor out = torch::empty({x.size(0), packed.size(0) * kTileN}, x.options().dtype(torch::kBFloat16));
  amx_linear_bf16_out(x, packed, bias, out, false);
  return out;
}
