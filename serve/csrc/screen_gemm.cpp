// The int8 screen of a large LM head for a batch of rows (serve/head_screen_batch.py says why and
// proves the bound): uint8 activations times the int8 head with vpdpbusd, 64 products per
// instruction (bf16's vdpbf16ps: 32), and a few wide ("tail") input channels as int16 with
// vpdpwssd. Each output column sits in a vector lane, so no sum crosses lanes.
//
// Layouts (serve/head_screen_batch.py builds them from the head's int8 copy, its input channels
// permuted so the tail channels come last; Vp rows, a multiple of 32, padded rows all zero):
//   main   int8  [Vp / 16, Km * 16]: block b, quad j, byte 4 * lane + i = q[16 b + lane, 4 j + i]
//   tail   int16 [Vp / 16, T * 16]:  block b, pair j, element 2 * lane + i = q[16 b + lane, Km + 2 j + i]
//   rowsum int32 [Vp]: each row's sum of main weights (the zero point's correction)
// Activations (screen_quantize): per row, the main channels as u = round(x / t) + z in [0, 255]
// (t = (max - min) / 255 over the main channels and 0, z the zero point), the tail channels as
// round(x / t2), t2 = max|x_tail| / 32767; every value moves by at most half its step.
// Logit: y[m, v] = s_v * (t_m * (A - z_m * rowsum_v) + t2_m * B), A and B exact int32 sums
// (|A| <= 255 * 127 * Km, |B| <= 32767 * 127 * T: below 2^31 for Km <= 66000, T <= 512).
//
// On AMX-INT8 (amx = true) A and B come from tiles instead (amx_groups): A by TDPBUSD on the main
// layout read in place as weight tiles (Km a multiple of 64), B as hi * 256 + lo of the int16 tail
// split into bytes, lo unsigned (TDPBUSD) and hi signed (TDPBSSD), against `tail8`, the tail's
// int8 quads [Vp / 16, ceil(T / 4) * 64] plus a spare KiB. The same integers, so the same logits;
// the epilogue (scales, bounds, tile maxima) is shared, and whole 16-lane stores of the logits
// are streamed around the caches.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <vector>

#include "amx_tiles.h"

float screen_floor(float lo, float hi, double step, double slack);  // screen.cpp

namespace {

constexpr int kLanes = 16;
constexpr int kRows = 12;  // activation rows per tile: 2 blocks x 12 rows = 24 accumulators
constexpr int64_t kGroupCols = 32;  // columns per tile (two blocks): their weights stay in L1
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline int32_t load4(const void* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

struct Gemm {
  const uint8_t* u;       // [M, Km]
  const int16_t* w16;     // [M, T]
  const float* params;    // [M, 3]: t, t2, z
  const int8_t* main;
  const int16_t* tail;
  const int32_t* rowsum;  // [Vp]
  const float* scale;     // [Vp]
  const float* scale_l1;  // [Vp]
  const float* a;         // [M]
  const float* c;         // [M]
  int64_t Km, T, V;
  float* out;             // [M, V]
  float* tile_hi;         // [M, groups]: each row's largest upper bound y + b over each tile's 32 columns
  int64_t groups;
  bool stream;            // whole 16-column stores of `out` go around the caches (aligned rows)
  uint8_t* written;       // [M, 2 * groups] or nullptr: sparse stores, which 16-column blocks hold logits
  float step, slack;      // the floor's terms (screen_floor), for sparse stores
};

}  // namespace

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")

namespace {

// acc + the products of u8 x and s8 w (vpdpbusd) / of int16 pairs (vpdpwssd), as inline assembly
// with the accumulator tied in and out: GCC 12 copies the accumulators of the intrinsics between
// two register sets every step and, at 24 of them, spills to the stack (half the rate measured).
#define WARSHA_DP(name)                                                               \
  inline __m512i name(__m512i acc, __m512i x, __m512i w) {                            \
    asm(#name " %[w], %[x], %[acc]" : [acc] "+v"(acc) : [x] "v"(x), [w] "v"(w));      \
    return acc;                                                                       \
  }
WARSHA_DP(vpdpbusd)
WARSHA_DP(vpdpwssd)
#undef WARSHA_DP


// a0 / a1 [R] += `dot` of each row's 4 bytes a step (broadcast; rows `xstride` bytes apart) and
// the two blocks' 64 weight bytes a step (the second block `steps` steps after the first). `ahead`:
// also prefetch the next tile's weights into L2, two lines a step (on the first rows of a tile,
// the later rows then find the weights in L1, and the next tile finds its own in L2 rather than
// in DRAM, which at 12 rows delivers them slower than the products consume them).
template <int R, typename Dot>
inline void accumulate(__m512i* a0, __m512i* a1, const char* w, const void* x_in, int64_t xstride, int64_t steps, bool ahead,
                       Dot dot) {
  const char* x = static_cast<const char*>(x_in);
  for (int64_t q = 0; q < steps; ++q) {
    if (ahead) {
      _mm_prefetch(w + (2 * steps + 2 * q) * 64, _MM_HINT_T1);
      _mm_prefetch(w + (2 * steps + 2 * q + 1) * 64, _MM_HINT_T1);
    }
    const __m512i w0 = _mm512_loadu_si512(w + q * 64), w1 = _mm512_loadu_si512(w + (steps + q) * 64);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512i xb = _mm512_set1_epi32(load4(x + r * xstride + 4 * q));
      a0[r] = dot(a0[r], xb, w0);
      a1[r] = dot(a1[r], xb, w1);
    }
  }
}

// a0 / a1 [R] = the two blocks' sums for R rows by `dot` (accumulate's arguments). One-dimensional
// accumulator arrays, fully unrolled: GCC keeps them in registers (a two-dimensional one it
// spilled on every product).
template <int R, typename Dot>
inline void sums_of(__m512i* a0, __m512i* a1, const char* w, const void* x, int64_t xstride, int64_t steps, bool ahead,
                    Dot dot) {
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm512_setzero_si512();
  accumulate<R>(a0, a1, w, x, xstride, steps, ahead, dot);
}

// The epilogue of rows m0 .. m0 + R - 1 by the 32 columns of blocks b0, b0 + 1, from their exact
// int32 sums: A (main channels) and B (tail channels), rows of [.][32] arrays. Each row's logits
// y = s * (t * (A - z * rowsum) + t2 * B) and bounds y -+ b, b = a * s + c * s_l1, folded into the
// row's 16 lanes of lo / hi and its tile maximum (g.tile_hi); the logits stored (streamed: whole
// aligned blocks) unless `Sparse`, where a block is stored only if one of its upper bounds reaches
// the row's floor so far (floors[m]; g.written says 1 stored or past V, 0 left). One row at a time
// with every value in registers and the row's lanes read and written once: the per-block version
// (store, reload, a store-forwarded lane update per block) took a third of the screen's time.
template <bool Sparse>
void rows_epilogue(const Gemm& g, int64_t m0, int64_t R, int64_t b0, const int32_t* A, const int32_t* B, float* lo, float* hi,
                   const float* floors) {
  const int64_t col = b0 * kLanes, V = g.V, groups = g.groups;
  const auto lane_mask = [](int64_t left) {
    if (left <= 0) return static_cast<__mmask16>(0);
    return left >= kLanes ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1);
  };
  const __mmask16 k0 = lane_mask(V - col), k1 = lane_mask(V - col - kLanes);
  const __m512i rs0 = _mm512_loadu_si512(g.rowsum + col), rs1 = _mm512_loadu_si512(g.rowsum + col + kLanes);
  const __m512 s0 = _mm512_loadu_ps(g.scale + col), s1 = _mm512_loadu_ps(g.scale + col + kLanes);
  const __m512 sl0 = _mm512_loadu_ps(g.scale_l1 + col), sl1 = _mm512_loadu_ps(g.scale_l1 + col + kLanes);
  const float* __restrict params = g.params;
  const float* __restrict pa = g.a;
  const float* __restrict pc = g.c;
  float* __restrict tile_hi = g.tile_hi;
  float* const out = g.out;
  uint8_t* const written = g.written;
  const bool stream = g.stream;
  const __m512 neg = _mm512_set1_ps(kNegInf);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t m = m0 + r;
    const __m512i z = _mm512_set1_epi32(static_cast<int32_t>(params[m * 3 + 2]));
    const __m512 t = _mm512_set1_ps(params[m * 3]), t2 = _mm512_set1_ps(params[m * 3 + 1]);
    const __m512 va = _mm512_set1_ps(pa[m]), vc = _mm512_set1_ps(pc[m]);
    const int32_t* ar = A + r * kGroupCols;
    const int32_t* br = B + r * kGroupCols;
    const auto logit = [&](const int32_t* a_sums, const int32_t* b_sums, __m512i rs, __m512 s) {
      const __m512 part = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_load_si512(a_sums), _mm512_mullo_epi32(z, rs))),
                                        _mm512_mul_ps(s, t));
      return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(b_sums)), _mm512_mul_ps(s, t2), part);
    };
    const __m512 y0 = logit(ar, br, rs0, s0), y1 = logit(ar + kLanes, br + kLanes, rs1, s1);
    const __m512 b0v = _mm512_fmadd_ps(vc, sl0, _mm512_mul_ps(va, s0)), b1v = _mm512_fmadd_ps(vc, sl1, _mm512_mul_ps(va, s1));
    const __m512 up0 = _mm512_add_ps(y0, b0v), up1 = _mm512_add_ps(y1, b1v);
    float* lr = lo + r * kLanes;
    float* hr = hi + r * kLanes;
    __m512 l = _mm512_loadu_ps(lr), h = _mm512_loadu_ps(hr);
    l = _mm512_mask_max_ps(l, k0, l, _mm512_sub_ps(y0, b0v));
    l = _mm512_mask_max_ps(l, k1, l, _mm512_sub_ps(y1, b1v));
    const __m512 first = _mm512_mask_mov_ps(neg, k0, up0);
    const __m512 top = _mm512_mask_max_ps(first, k1, first, up1);  // -inf in lanes past V
    h = _mm512_max_ps(h, top);
    _mm512_storeu_ps(lr, l);
    _mm512_storeu_ps(hr, h);
    tile_hi[m * groups + b0 / 2] = _mm512_reduce_max_ps(top);
    float* row = out + m * V + col;
    const auto put = [&](float* dst, __m512 y, __mmask16 k) {
      if (stream && k == 0xffff) _mm512_stream_ps(dst, y);
      else _mm512_mask_storeu_ps(dst, k, y);
    };
    if (Sparse) {
      const __m512 f = _mm512_set1_ps(floors[m]);
      const bool keep0 = _mm512_mask_cmp_ps_mask(k0, up0, f, _CMP_GE_OQ) != 0;
      const bool keep1 = _mm512_mask_cmp_ps_mask(k1, up1, f, _CMP_GE_OQ) != 0;
      if (keep0) put(row, y0, k0);
      if (keep1) put(row + kLanes, y1, k1);
      written[m * 2 * groups + b0] = keep0 || k0 == 0;
      written[m * 2 * groups + b0 + 1] = keep1 || k1 == 0;
    } else {
      if (k0) put(row, y0, k0);
      if (k1) put(row + kLanes, y1, k1);
    }
  }
}

// Rows m0 .. m0 + R - 1 by the 32 columns of blocks b0, b0 + 1 on VNNI: the main and tail
// channels' sums (vpdpbusd, vpdpwssd; `ahead`: prefetch the next tile's weights) into [R][32]
// arrays, then rows_epilogue; `floors` (per row, or nullptr: every block stored) as there.
template <int R>
void tile(const Gemm& g, int64_t m0, int64_t b0, float* lo, float* hi, bool ahead, const float* floors) {
  const int64_t Kq = g.Km / 4, Tp = g.T / 2;
  alignas(64) int32_t sums[R][kGroupCols], tails[R][kGroupCols];
  const auto keep = [](int32_t (*dst)[kGroupCols], const __m512i* a0, const __m512i* a1) {
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      _mm512_store_si512(dst[r], a0[r]);
      _mm512_store_si512(dst[r] + kLanes, a1[r]);
    }
  };
  {
    __m512i a0[R], a1[R];
    sums_of<R>(a0, a1, reinterpret_cast<const char*>(g.main + b0 * Kq * 64), g.u + m0 * g.Km, g.Km, Kq, ahead,
               [](__m512i acc, __m512i x, __m512i w) { return vpdpbusd(acc, x, w); });
    keep(sums, a0, a1);
  }
  __m512i a0[R], a1[R];
  sums_of<R>(a0, a1, reinterpret_cast<const char*>(g.tail + b0 * Tp * 32), g.w16 + m0 * g.T, g.T * 2, Tp, ahead,
             [](__m512i acc, __m512i x, __m512i w) { return vpdpwssd(acc, x, w); });
  keep(tails, a0, a1);
  if (floors != nullptr) rows_epilogue<true>(g, m0, R, b0, sums[0], tails[0], lo, hi, floors);
  else rows_epilogue<false>(g, m0, R, b0, sums[0], tails[0], lo, hi, floors);
}

void tile_any(int rows, const Gemm& g, int64_t m0, int64_t b0, float* lo, float* hi, bool ahead, const float* floors) {
  switch (rows) {
    case 1: return tile<1>(g, m0, b0, lo, hi, ahead, floors);
    case 2: return tile<2>(g, m0, b0, lo, hi, ahead, floors);
    case 3: return tile<3>(g, m0, b0, lo, hi, ahead, floors);
    case 4: return tile<4>(g, m0, b0, lo, hi, ahead, floors);
    case 5: return tile<5>(g, m0, b0, lo, hi, ahead, floors);
    case 6: return tile<6>(g, m0, b0, lo, hi, ahead, floors);
    case 7: return tile<7>(g, m0, b0, lo, hi, ahead, floors);
    case 8: return tile<8>(g, m0, b0, lo, hi, ahead, floors);
    case 9: return tile<9>(g, m0, b0, lo, hi, ahead, floors);
    case 10: return tile<10>(g, m0, b0, lo, hi, ahead, floors);
    case 11: return tile<11>(g, m0, b0, lo, hi, ahead, floors);
    default: return tile<kRows>(g, m0, b0, lo, hi, ahead, floors);
  }
}

// Sparse stores: each row's floor so far, from the best bounds this thread has seen (lane maxima
// lo / hi [M * 16]), refreshed every kRefresh tiles; floors[M + m] keeps the highest one used. A
// block skipped under a floor at or below the final one (every thread's bounds) holds no
// candidate. The final floor can lie lower (a larger |upper bound| later widens its margin):
// `refill` then computes that row's skipped blocks the final floor may reach.
constexpr int64_t kRefresh = 16;
void refresh_floors(const Gemm& g, int64_t M, const float* lo, const float* hi, float* floors) {
  for (int64_t m = 0; m < M; ++m) {
    floors[m] = screen_floor(_mm512_reduce_max_ps(_mm512_loadu_ps(lo + m * kLanes)),
                             _mm512_reduce_max_ps(_mm512_loadu_ps(hi + m * kLanes)), g.step, g.slack);
    floors[M + m] = std::max(floors[M + m], floors[m]);
  }
}

// Sparse stores, after the pass: for each row whose floor fell below one it skipped blocks under
// (`used`, per row), the tiles with a skipped block that the final floor (from the row's best
// bounds bp [M, 2]) may reach, computed again by the VNNI kernel (the same integers and epilogue,
// so the same logits as the AMX path's) and stored; their blocks marked 2 in g.written.
void refill(const Gemm& g, int64_t M, const float* bp, const float* used) {
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    alignas(64) float lo[kLanes], hi[kLanes];  // bounds already known: discarded
    std::fill(lo, lo + kLanes, kNegInf);
    std::fill(hi, hi + kLanes, kNegInf);
    for (int64_t m = m0; m < m1; ++m) {
      const float floor = screen_floor(bp[2 * m], bp[2 * m + 1], g.step, g.slack);
      if (!(used[m] > floor)) continue;
      uint8_t* w = g.written + m * 2 * g.groups;
      for (int64_t grp = 0; grp < g.groups; ++grp) {
        if ((w[2 * grp] && w[2 * grp + 1]) || g.tile_hi[m * g.groups + grp] < floor) continue;
        tile_any(1, g, m, 2 * grp, lo, hi, false, nullptr);
        w[2 * grp] = w[2 * grp + 1] = 2;
      }
    }
  });
  if (g.stream) _mm_sfence();
}

// The columns of one row of logits whose upper bound reaches `floor`, ascending, appended to
// `cols`; false (and `cols` left with at most `cap` more) when more than `cap` do. Tiles whose
// largest upper bound (`tile_hi`, screen_gemm_u8's, the same float32 sums) stays below `floor`
// are skipped unread: at 33 rows the pass read 35 MB of logits for about 30 candidates a row.
// A NaN maximum compares false, so its tile is read.
bool row_candidates(const float* y, const float* s, const float* sl, float a, float c, float floor, int64_t V, int64_t cap,
                    const float* tile_hi, const uint8_t* written, std::vector<int64_t>& cols) {
  const __m512 va = _mm512_set1_ps(a), vc = _mm512_set1_ps(c), vf = _mm512_set1_ps(floor);
  const size_t start = cols.size();
  for (int64_t v = 0; v < V; v += kLanes) {
    if (v % kGroupCols == 0 && tile_hi[v / kGroupCols] < floor) {  // no column of this tile reaches it
      v += kGroupCols - kLanes;
      continue;
    }
    if (written != nullptr && !written[v / kLanes]) continue;  // sparse stores left it: no candidate there
    const int64_t left = V - v;
    const __mmask16 mask = left >= kLanes ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1);
    const __m512 b = _mm512_fmadd_ps(vc, _mm512_maskz_loadu_ps(mask, sl + v), _mm512_mul_ps(va, _mm512_maskz_loadu_ps(mask, s + v)));
    const __m512 up = _mm512_add_ps(_mm512_maskz_loadu_ps(mask, y + v), b);
    for (unsigned hit = _mm512_mask_cmp_ps_mask(mask, up, vf, _CMP_GE_OQ); hit; hit &= hit - 1) {
      if (static_cast<int64_t>(cols.size() - start) >= cap) return false;
      cols.push_back(v + __builtin_ctz(hit));
    }
  }
  return true;
}

// x . w for one float32 row pair of length K: four 16-lane accumulators, a masked tail, summed in a
// fixed order (the batch screen's exact values for a float32 head).
float dot_f32(const float* x, const float* w, int64_t K) {
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  int64_t k = 0;
  for (; k + 64 <= K; k += 64)
    for (int j = 0; j < 4; ++j)
      acc[j] = _mm512_fmadd_ps(_mm512_loadu_ps(x + k + 16 * j), _mm512_loadu_ps(w + k + 16 * j), acc[j]);
  for (int j = 0; k < K; k += 16, ++j) {
    const int64_t left = K - k;
    const __mmask16 mask = left >= kLanes ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1);
    acc[j] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, x + k), _mm512_maskz_loadu_ps(mask, w + k), acc[j]);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
}

}  // namespace

#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,amx-tile,amx-int8")

namespace {

// The main channels of 16 or 32 (TwoM) uint8 rows u (stride Km) by the two packed blocks from w,
// into tiles 0, 1 (rows 0-15) and 2, 3 (rows 16-31): per 64 channels one TDPBUSD per 16 x 16
// block, the weights' quads read as the B tile in place (block b, quads 16 kc .. 16 kc + 15 are
// 1 KiB at kc * 1024). `next`: the following tile's weights, asked into L2 as these are used (the
// first row block only). Only issued: amx_main_store writes the sums once the products are done.
template <bool TwoM>
void amx_main_issue(const uint8_t* u, int64_t Km, const int8_t* w, const int8_t* next) {
  const int64_t block = Km * kLanes;
  _tile_zero(0);
  _tile_zero(1);
  if (TwoM) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t kc = 0; kc < Km / 64; ++kc) {
    const int8_t* w0 = w + kc * 1024;
    if (next)
      for (int line = 0; line < 1024; line += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(next + kc * 1024 + line), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(next + block + kc * 1024 + line), _MM_HINT_T1);
      }
    _tile_loadd(4, u + kc * 64, Km);
    _tile_loadd(6, w0, 64);
    _tile_loadd(7, w0 + block, 64);
    _tile_dpbusd(0, 4, 6);
    _tile_dpbusd(1, 4, 7);
    if (TwoM) {
      _tile_loadd(5, u + 16 * Km + kc * 64, Km);
      _tile_dpbusd(2, 5, 6);
      _tile_dpbusd(3, 5, 7);
    }
  }
}

// sums [32][32] int32 = amx_main_issue's tiles (rows 16-31 only when TwoM).
template <bool TwoM>
void amx_main_store(int32_t* sums) {
  _tile_stored(0, sums, kGroupCols * 4);
  _tile_stored(1, sums + kLanes, kGroupCols * 4);
  if (TwoM) {
    _tile_stored(2, sums + 16 * kGroupCols, kGroupCols * 4);
    _tile_stored(3, sums + 16 * kGroupCols + kLanes, kGroupCols * 4);
  }
}

// The tail channels of 16 rows by the two blocks from w, into tiles 0-3: the int16 values as
// bytes, lo (uint8, TDPBUSD) and hi (int8, TDPBSSD), so hi * 256 + lo is the vpdpwssd sum. A row
// of lo / hi holds the tail's quads then zeros to 64 bytes, so the weight tile's quads past a
// block's own (the next block's, or the spare KiB after the last) add nothing. Only issued.
void amx_tail_issue(const uint8_t* lo, const int8_t* hi, const int8_t* w, int64_t block) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_loadd(4, lo, 64);
  _tile_loadd(5, hi, 64);
  _tile_loadd(6, w, 64);
  _tile_loadd(7, w + block, 64);
  _tile_dpbusd(0, 4, 6);
  _tile_dpbusd(1, 4, 7);
  _tile_dpbssd(2, 5, 6);
  _tile_dpbssd(3, 5, 7);
}

// tails [16][32] int32 = hi * 256 + lo of amx_tail_issue's tiles.
void amx_tail_store(int32_t* tails) {
  alignas(64) int32_t part[2][16 * kGroupCols];
  _tile_stored(0, part[0], kGroupCols * 4);
  _tile_stored(1, part[0] + kLanes, kGroupCols * 4);
  _tile_stored(2, part[1], kGroupCols * 4);
  _tile_stored(3, part[1] + kLanes, kGroupCols * 4);
  for (int i = 0; i < 16 * kGroupCols; i += kLanes)
    _mm512_store_si512(tails + i, _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(part[1] + i), 8),
                                                   _mm512_load_si512(part[0] + i)));
}

// A row block's sums waiting for its epilogue: rows m0 .. m0 + rows - 1 of tile `grp`.
struct Pending {
  int64_t m0 = 0, rows = 0, grp = -1;
  alignas(64) int32_t sums[32 * kGroupCols];
  alignas(64) int32_t tails[32 * kGroupCols];
};

// Rows [r0, r1) of a pending block's epilogue (rows_epilogue); nothing when none is pending.
void pending_rows(const Gemm& g, const Pending& p, int64_t r0, int64_t r1, float* lo, float* hi, const float* floors) {
  r1 = std::min(r1, p.rows);
  if (p.grp < 0 || r0 >= r1) return;
  const int64_t m = p.m0 + r0;
  const int32_t* a = p.sums + r0 * kGroupCols;
  const int32_t* b = p.tails + r0 * kGroupCols;
  if (floors != nullptr) rows_epilogue<true>(g, m, r1 - r0, 2 * p.grp, a, b, lo + m * kLanes, hi + m * kLanes, floors);
  else rows_epilogue<false>(g, m, r1 - r0, 2 * p.grp, a, b, lo + m * kLanes, hi + m * kLanes, floors);
}

// Tiles [g0, g1) of every row with the sums on AMX tiles (u, lo, hi padded to whole 16-row blocks),
// the bounds as on AVX-512: the same integers, so the same logits and bounds. Software-pipelined
// by row block: the previous block's epilogue (AVX-512) runs in thirds while this block's
// products are in flight, each before the tile stores that would wait for them (perf put a sixth
// of the screen's time on those stores and on the tile loads queued behind them).
void amx_groups(const Gemm& g, const uint8_t* u, const uint8_t* tlo, const int8_t* thi, const int8_t* tail8, int64_t tq,
                int64_t M, int64_t g0, int64_t g1, int64_t groups, float* lo, float* hi, float* floors) {
  warsha::configure_tiles();
  Pending pend[2];
  int which = 0;
  const int64_t block = g.Km * kLanes, tblock = tq * 64;
  for (int64_t grp = g0; grp < g1; ++grp) {
    if (floors != nullptr && (grp - g0) % kRefresh == 0) refresh_floors(g, M, lo, hi, floors);
    const int8_t* w = g.main + 2 * grp * block;
    for (int64_t m0 = 0; m0 < M; m0 += 32) {
      Pending& now = pend[which];
      const Pending& prev = pend[which ^ 1];
      const int8_t* next = m0 == 0 && grp + 1 < groups ? w + 2 * block : nullptr;
      const bool two = m0 + 16 < M;
      const int64_t third = (prev.rows + 2) / 3;
      if (two) amx_main_issue<true>(u + m0 * g.Km, g.Km, w, next);
      else amx_main_issue<false>(u + m0 * g.Km, g.Km, w, next);
      pending_rows(g, prev, 0, third, lo, hi, floors);
      if (two) amx_main_store<true>(now.sums);
      else amx_main_store<false>(now.sums);
      for (int64_t h = 0; h < (two ? 2 : 1); ++h) {
        const int64_t m = m0 + 16 * h;
        amx_tail_issue(tlo + m * 64, thi + m * 64, tail8 + 2 * grp * tblock, tblock);
        pending_rows(g, prev, third * (h + 1), two && h == 0 ? 2 * third : prev.rows, lo, hi, floors);
        amx_tail_store(now.tails + 16 * h * kGroupCols);
      }
      now.m0 = m0;
      now.rows = std::min<int64_t>(32, M - m0);
      now.grp = grp;
      which ^= 1;
    }
  }
  pending_rows(g, pend[which ^ 1], 0, pend[which ^ 1].rows, lo, hi, floors);
  _tile_release();
  if (g.stream) _mm_sfence();  // the streamed logits reach memory before screen_pairs reads them
}

}  // namespace

#pragma GCC pop_options

namespace {

void check_f32(const torch::Tensor& t, int64_t n, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.is_contiguous() && t.numel() == n, name, " must be contiguous float32 with ",
              n, " values");
}

}  // namespace

// The head's int8 copy q [V, K] in the layouts above, its input channels in `perm`'s order (the
// main ones, then the T tail ones): fills main [Vp / 16, Km * 16] (channels past K - T and rows
// past V zero), tail_rows int16 [Vp, T] (row-major; Python packs it, it is small) and rowsum
// int32 [Vp]. One pass, each row gathered once: torch's index_select, sum and transposing copy
// of the same took 0.8 s for Gemma 3's 168 MB head, inside the first batch step that needed it.
void screen_pack(const torch::Tensor& q, const torch::Tensor& perm_in, torch::Tensor main, torch::Tensor tail_rows,
                 torch::Tensor rowsum) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kInt8 && q.is_contiguous(), "q must be contiguous int8 [V, K]");
  const int64_t V = q.size(0), K = q.size(1), T = tail_rows.size(1), Vp = rowsum.numel();
  const torch::Tensor perm = perm_in.to(torch::kLong).contiguous();
  TORCH_CHECK(perm.numel() == K && perm.min().item<int64_t>() >= 0 && perm.max().item<int64_t>() < K, "perm must order q's ", K,
              " channels");
  TORCH_CHECK(Vp >= V && Vp % kLanes == 0 && rowsum.scalar_type() == torch::kInt32 && rowsum.is_contiguous(),
              "rowsum must be int32 [Vp], Vp >= V a multiple of 16");
  TORCH_CHECK(main.scalar_type() == torch::kInt8 && main.is_contiguous() && main.dim() == 2 && main.size(0) == Vp / kLanes &&
                  main.size(1) % (4 * kLanes) == 0 && main.size(1) / kLanes >= K - T,
              "main must be int8 [Vp / 16, Km * 16], Km a multiple of 4 covering the main channels");
  TORCH_CHECK(tail_rows.scalar_type() == torch::kInt16 && tail_rows.is_contiguous() && tail_rows.size(0) == Vp && T <= K,
              "tail_rows must be int16 [Vp, T]");
  const int64_t Km = main.size(1) / kLanes, main_k = K - T;
  const int8_t* qp = q.data_ptr<int8_t>();
  const int64_t* pp = perm.data_ptr<int64_t>();
  int8_t* mp = main.data_ptr<int8_t>();
  int16_t* tp = tail_rows.data_ptr<int16_t>();
  int32_t* rp = rowsum.data_ptr<int32_t>();
  at::parallel_for(0, Vp / kLanes, 64, [&](int64_t b0, int64_t b1) {
    std::vector<int8_t> row(Km);
    for (int64_t b = b0; b < b1; ++b) {
      int8_t* block = mp + b * Km * kLanes;
      for (int64_t lane = 0; lane < kLanes; ++lane) {
        const int64_t r = b * kLanes + lane;
        std::fill(row.begin(), row.end(), 0);
        int32_t sum = 0;
        if (r < V) {
          const int8_t* src = qp + r * K;
          for (int64_t k = 0; k < main_k; ++k) sum += row[k] = src[pp[k]];
          for (int64_t k = 0; k < T; ++k) tp[r * T + k] = src[pp[main_k + k]];
        } else {
          std::fill(tp + r * T, tp + (r + 1) * T, 0);
        }
        rp[r] = sum;
        for (int64_t j = 0; j < Km / 4; ++j) std::memcpy(block + j * 4 * kLanes + 4 * lane, row.data() + 4 * j, 4);
      }
    }
  });
}

// x float32 [M, K], its last T channels the tail: {u uint8 [M, Km], w16 int16 [M, T], params
// float32 [M, 3] (t, t2, z)}; main channels K - T .. Km - 1 (padding) read as the zero point.
std::vector<torch::Tensor> screen_quantize(const torch::Tensor& x_in, int64_t Km, int64_t T) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == torch::kFloat32, "x must be float32 [rows, features]");
  const torch::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), main = K - T;
  TORCH_CHECK(T >= 0 && T % 2 == 0 && main >= 0 && Km >= main && Km % 4 == 0, "bad split: K ", K, ", Km ", Km, ", T ", T);
  torch::Tensor u = torch::empty({M, Km}, torch::kUInt8), w16 = torch::zeros({M, T}, torch::kInt16);
  torch::Tensor params = torch::empty({M, 3}, torch::kFloat32);
  const float* xp = x.data_ptr<float>();
  uint8_t* up = u.data_ptr<uint8_t>();
  int16_t* wp = w16.data_ptr<int16_t>();
  float* pp = params.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = xp + m * K;
    float lo = 0.f, hi = 0.f, top = 0.f;
    for (int64_t k = 0; k < main; ++k) lo = std::min(lo, xr[k]), hi = std::max(hi, xr[k]);
    for (int64_t k = main; k < K; ++k) top = std::max(top, std::fabs(xr[k]));
    const float t = (hi - lo) / 255.f, t2 = top / 32767.f;
    const float z = t > 0.f ? std::min(255.f, std::max(0.f, std::nearbyint(-lo / t))) : 0.f;
    uint8_t* ur = up + m * Km;
    for (int64_t k = 0; k < main; ++k)
      ur[k] = t > 0.f ? static_cast<uint8_t>(std::min(255.f, std::max(0.f, std::nearbyint(xr[k] / t) + z))) : 0;
    std::fill(ur + main, ur + Km, static_cast<uint8_t>(z));
    if (t2 > 0.f)
      for (int64_t k = 0; k < T; ++k)
        wp[m * T + k] = static_cast<int16_t>(std::min(32767.f, std::max(-32767.f, std::nearbyint(xr[main + k] / t2))));
    pp[m * 3] = t, pp[m * 3 + 1] = t2, pp[m * 3 + 2] = z;
  }
  return {u, w16, params};
}

// out [M, V] = the int8 logits of screen_quantize's rows (see the header); returns float32
// [M, 2]: each row's best lower and upper bound, max over v of y -+ (a * scale + c * scale_l1).
torch::Tensor screen_gemm_u8(const torch::Tensor& u, const torch::Tensor& w16, const torch::Tensor& params,
                             const torch::Tensor& main, const torch::Tensor& tail, const torch::Tensor& rowsum,
                             const torch::Tensor& scale, const torch::Tensor& scale_l1, const torch::Tensor& a,
                             const torch::Tensor& c, torch::Tensor out, torch::Tensor tile_hi, const torch::Tensor& tail8,
                             bool amx, double step, double slack, torch::Tensor written) {
  TORCH_CHECK(__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw"),
              "screen_gemm_u8 needs AVX-512 VNNI");
  TORCH_CHECK(!amx || amx_int8_enable(), "screen_gemm_u8: amx asked for, but this CPU or its OS gives no AMX-INT8 tiles");
  TORCH_CHECK(!amx || u.size(1) % 64 == 0, "screen_gemm_u8: amx needs the main channels (", u.size(1),
              ") padded to a multiple of 64");
  TORCH_CHECK(u.dim() == 2 && u.scalar_type() == torch::kUInt8 && u.is_contiguous(), "u must be uint8 [M, Km]");
  const int64_t M = u.size(0), Km = u.size(1), T = w16.size(1), V = out.size(1);
  TORCH_CHECK(w16.scalar_type() == torch::kInt16 && w16.is_contiguous() && w16.size(0) == M, "w16 must be int16 [M, T]");
  check_f32(params, M * 3, "params");
  TORCH_CHECK(main.scalar_type() == torch::kInt8 && main.is_contiguous() && main.dim() == 2 && main.size(1) == Km * kLanes,
              "main must be int8 [Vp / 16, Km * 16]");
  const int64_t Vp = main.size(0) * kLanes;
  TORCH_CHECK(Vp % kGroupCols == 0 && Vp >= V, "packed rows must be a multiple of 32 covering V");
  TORCH_CHECK(tail.scalar_type() == torch::kInt16 && tail.is_contiguous() && tail.numel() == Vp * T, "tail must be int16 [Vp / 16, T * 16]");
  TORCH_CHECK(rowsum.scalar_type() == torch::kInt32 && rowsum.is_contiguous() && rowsum.numel() == Vp, "rowsum must be int32 [Vp]");
  check_f32(scale, Vp, "scale");
  check_f32(scale_l1, Vp, "scale_l1");
  check_f32(a, M, "a");
  check_f32(c, M, "c");
  TORCH_CHECK(out.scalar_type() == torch::kFloat32 && out.is_contiguous() && out.dim() == 2 && out.size(0) == M,
              "out must be contiguous float32 [M, V]");
  const int64_t groups = (V + kGroupCols - 1) / kGroupCols;
  check_f32(tile_hi, M * groups, "tile_hi");
  const bool sparse = written.numel() > 0;
  TORCH_CHECK(!sparse || (written.scalar_type() == torch::kUInt8 && written.is_contiguous() && written.numel() == M * 2 * groups),
              "written must be uint8 [M, 2 * ceil(V / 32)] (sparse stores) or empty");
  std::vector<float> used(M, kNegInf);  // sparse: each row's highest floor any thread skipped under
  const Gemm g{u.data_ptr<uint8_t>(), w16.data_ptr<int16_t>(), params.data_ptr<float>(), main.data_ptr<int8_t>(),
               tail.data_ptr<int16_t>(), rowsum.data_ptr<int32_t>(), scale.data_ptr<float>(), scale_l1.data_ptr<float>(),
               a.data_ptr<float>(), c.data_ptr<float>(), Km, T, V, out.data_ptr<float>(), tile_hi.data_ptr<float>(), groups,
               amx && V % kLanes == 0 && reinterpret_cast<uintptr_t>(out.data_ptr()) % 64 == 0,
               sparse ? written.data_ptr<uint8_t>() : nullptr, static_cast<float>(step), static_cast<float>(slack)};
  std::vector<float> lo(M * kLanes, kNegInf), hi(M * kLanes, kNegInf);
  // AMX reads whole 16-row blocks (the rows past M as zeros) and the tail as 64-byte rows of bytes
  const int64_t Mp = (M + 15) / 16 * 16, tq = (T + 3) / 4;
  std::vector<uint8_t> padded, tail_lo;
  std::vector<int8_t> tail_hi;
  const uint8_t* up = g.u;
  if (amx) {
    TORCH_CHECK(T <= 64 && tail8.scalar_type() == torch::kInt8 && tail8.is_contiguous() &&
                    tail8.numel() == Vp / kLanes * tq * 64 + 1024,
                "screen_gemm_u8: amx needs the tail (at most 64 channels) as int8 quads plus a spare KiB");
    if (M % 16) {
      padded.assign(Mp * Km, 0);
      std::memcpy(padded.data(), g.u, M * Km);
      up = padded.data();
    }
    tail_lo.assign(Mp * 64, 0);
    tail_hi.assign(Mp * 64, 0);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < T; ++k) {
        const int32_t v = g.w16[m * T + k];
        tail_lo[m * 64 + k] = static_cast<uint8_t>(v & 0xff);
        tail_hi[m * 64 + k] = static_cast<int8_t>((v - (v & 0xff)) / 256);
      }
  }
  std::mutex merge;
  at::parallel_for(0, groups, 64, [&](int64_t g0, int64_t g1) {
    std::vector<float> tlo(M * kLanes, kNegInf), thi(M * kLanes, kNegInf), floors(sparse ? 2 * M : 0, kNegInf);
    float* fl = sparse ? floors.data() : nullptr;
    if (amx)  // fences its streamed stores
      amx_groups(g, up, tail_lo.data(), tail_hi.data(), tail8.data_ptr<int8_t>(), tq, M, g0, g1, groups, tlo.data(),
                 thi.data(), fl);
    else
      for (int64_t grp = g0; grp < g1; ++grp) {
        if (fl != nullptr && (grp - g0) % kRefresh == 0) refresh_floors(g, M, tlo.data(), thi.data(), fl);
        for (int64_t m0 = 0; m0 < M; m0 += kRows)
          tile_any(static_cast<int>(std::min<int64_t>(kRows, M - m0)), g, m0, grp * 2, tlo.data() + m0 * kLanes,
                   thi.data() + m0 * kLanes, m0 == 0 && grp + 1 < groups, fl);
      }
    const std::lock_guard<std::mutex> hold(merge);
    for (int64_t i = 0; i < M * kLanes; ++i) lo[i] = std::max(lo[i], tlo[i]), hi[i] = std::max(hi[i], thi[i]);
    if (sparse)
      for (int64_t m = 0; m < M; ++m) used[m] = std::max(used[m], floors[M + m]);
  });
  torch::Tensor bounds = torch::empty({M, 2}, torch::kFloat32);
  float* bp = bounds.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    bp[m * 2] = *std::max_element(lo.begin() + m * kLanes, lo.begin() + (m + 1) * kLanes);
    bp[m * 2 + 1] = *std::max_element(hi.begin() + m * kLanes, hi.begin() + (m + 1) * kLanes);
  }
  if (sparse) refill(g, M, bp, used.data());
  return bounds;
}

// Per row m of approx [M, V], the columns whose upper bound approx + a*scale + c*scale_l1 reaches
// the row's floor (screen_floor of its best bounds lohi [M, 2], as screen_candidates): {rows
// int64 [P], cols int64 [P]} in row-major order, and per-row counts int64 [M], -1 for a row with
// more than `cap` (its columns then left out).
std::vector<torch::Tensor> screen_pairs(const torch::Tensor& approx, const torch::Tensor& scale, const torch::Tensor& scale_l1,
                                        const torch::Tensor& a, const torch::Tensor& c, const torch::Tensor& lohi,
                                        const torch::Tensor& tile_hi, double step, double slack, int64_t cap,
                                        const torch::Tensor& written) {
  TORCH_CHECK(__builtin_cpu_supports("avx512f"), "screen_pairs needs AVX-512");
  TORCH_CHECK(approx.dim() == 2 && approx.scalar_type() == torch::kFloat32 && approx.is_contiguous(), "approx must be float32 [M, V]");
  const int64_t M = approx.size(0), V = approx.size(1);
  TORCH_CHECK(scale.numel() >= V && scale_l1.numel() >= V, "scales must cover V");
  check_f32(a, M, "a");
  check_f32(c, M, "c");
  check_f32(lohi, M * 2, "lohi");
  const int64_t groups = (V + kGroupCols - 1) / kGroupCols;
  check_f32(tile_hi, M * groups, "tile_hi");
  const float* th = tile_hi.data_ptr<float>();
  const bool sparse = written.numel() > 0;
  TORCH_CHECK(!sparse || (written.scalar_type() == torch::kUInt8 && written.is_contiguous() && written.numel() == M * 2 * groups),
              "written must be screen_gemm_u8's uint8 [M, 2 * groups] or empty");
  const uint8_t* wp = sparse ? written.data_ptr<uint8_t>() : nullptr;
  std::vector<std::vector<int64_t>> per(M);
  std::vector<int64_t> counts(M);
  const float *y = approx.data_ptr<float>(), *s = scale.data_ptr<float>(), *sl = scale_l1.data_ptr<float>();
  const float *pa = a.data_ptr<float>(), *pc = c.data_ptr<float>(), *pb = lohi.data_ptr<float>();
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float floor = screen_floor(pb[2 * m], pb[2 * m + 1], step, slack);
      const bool ok =
          row_candidates(y + m * V, s, sl, pa[m], pc[m], floor, V, cap, th + m * groups, sparse ? wp + m * 2 * groups : nullptr, per[m]);
      counts[m] = ok ? static_cast<int64_t>(per[m].size()) : -1;
      if (!ok) per[m].clear();
    }
  });
  int64_t P = 0;
  for (const auto& p : per) P += static_cast<int64_t>(p.size());
  torch::Tensor rows = torch::empty({P}, torch::kLong), cols = torch::empty({P}, torch::kLong);
  int64_t* rp = rows.data_ptr<int64_t>();
  int64_t* cp = cols.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m) {
    std::fill(rp, rp + per[m].size(), m);
    std::copy(per[m].begin(), per[m].end(), cp);
    rp += per[m].size();
    cp += per[m].size();
  }
  torch::Tensor count = torch::empty({M}, torch::kLong);
  std::copy(counts.begin(), counts.end(), count.data_ptr<int64_t>());
  return {rows, cols, count};
}

// float32 x [M, K] . w [N, K] at the pairs (rows[p], cols[p]) into out [P] (AVX-512).
void gemv_f32_pairs(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& rows, const torch::Tensor& cols,
                    torch::Tensor out) {
  TORCH_CHECK(__builtin_cpu_supports("avx512f"), "gemv_f32_pairs needs AVX-512");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x must be a contiguous float32 [M, K] tensor");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kFloat32 && w.is_contiguous() && w.size(1) == x.size(1),
              "w must be a contiguous float32 [N, K] tensor with x's K");
  const int64_t P = rows.numel(), K = x.size(1);
  for (const auto* t : {&rows, &cols})
    TORCH_CHECK(t->scalar_type() == torch::kLong && t->is_contiguous() && t->numel() == P, "rows and cols must be int64 [P]");
  check_f32(out, P, "out");
  if (P == 0) return;
  TORCH_CHECK(rows.min().item<int64_t>() >= 0 && rows.max().item<int64_t>() < x.size(0) && cols.min().item<int64_t>() >= 0 &&
                  cols.max().item<int64_t>() < w.size(0),
              "pair indices out of range");
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  const int64_t *rp = rows.data_ptr<int64_t>(), *cp = cols.data_ptr<int64_t>();
  float* y = out.data_ptr<float>();
  at::parallel_for(0, P, 16, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) y[p] = dot_f32(xp + rp[p] * K, wp + cp[p] * K, K);
  });
}
