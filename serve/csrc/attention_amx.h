// Paged attention of bf16 prefill pieces on AMX tiles (TDPBF16PS: a 16 x 16 x 32 product per
// instruction), for the amx variant. attention.cpp includes this file after attention_avx512.h,
// inside the AVX-512 BF16 namespace and a `#pragma GCC target` region with AMX-BF16, so it uses
// that file's softmax helpers; no include guard.
//
// Why: a prefill chunk reaches the kernel as 16-token pieces (serve/attention/torch_ref.py), so a
// piece of Gemma 3 (4 query heads on one KV head) is 64 query rows against up to 512 keys, and
// the AVX-512 BF16 algorithm spends a vdpbf16ps (32 products) per 32 features of every row and
// key: on a 2-core Xeon with AMX a 512-token chunk took 64 ms over 18 layers, most of it those
// products, which the tiles make 16x denser. Decode tasks (1-15 rows) read the cache from DRAM
// and stay on attend512.
//
// Per task (a sequence's piece and KV head, rows padded to 16) and tile of 64 keys:
//   scores  S = Q K^T: A = 16 query rows x 32 features (bf16, copied once per task), B = 16 keys'
//           same 32 features as pairs (each key's 16 dwords transposed into a column: `pair_keys`);
//   softmax as attend512 does it (float32, online, masked), probabilities rounded to bf16;
//   values  O += P V: A = 16 rows x 32 keys of P, B = 16 key pairs x 16 features (two value rows
//           interleaved: `pair_values`); the float32 accumulators are rescaled in memory first.
// Keys past the tile's last one are zeros in the repacked K and V, never read from the cache.
// Results: attend512's float32 math (scores, softmax, float32 accumulation of bf16 probabilities
// times bf16 values) in another summation order.

constexpr int64_t kAmxKeys = 64;  // keys scored before their softmax update and value pass

// A 16 x 16 block of dwords transposed in registers: r[i] holds row i on entry, column i on exit.
inline void transpose16_epi32(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // r[4 i + j], lane L: column 4 L + j of rows 4 i .. 4 i + 3
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    const __m512i u0 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x44), u1 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xEE);
    const __m512i u2 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x44), u3 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xEE);
    t[j] = _mm512_shuffle_i32x4(u0, u2, 0x88);
    t[4 + j] = _mm512_shuffle_i32x4(u0, u2, 0xDD);
    t[8 + j] = _mm512_shuffle_i32x4(u1, u3, 0x88);
    t[12 + j] = _mm512_shuffle_i32x4(u1, u3, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// Keys j0 .. j0 + 15 of a tile (zeros from n on) as B tiles of the scores: per 32 features one
// KiB, row i = dword i (features 2i, 2i+1) of each of the 16 keys. Out: [D / 32][16][32] bf16.
inline void pair_keys(const uint16_t* kc, const int64_t* slots, int64_t j0, int64_t n, int64_t D, uint16_t* out) {
  for (int64_t f = 0; f < D; f += 32) {
    __m512i r[16];
    for (int64_t i = 0; i < 16; ++i)
      r[i] = j0 + i < n ? _mm512_loadu_si512(kc + slots[j0 + i] * D + f) : _mm512_setzero_si512();
    transpose16_epi32(r);
    for (int i = 0; i < 16; ++i) _mm512_storeu_si512(out + (f / 32) * 512 + i * 32, r[i]);
  }
}

// Keys j0 .. j0 + 31 of a tile (zeros from n on) as B tiles of the value product: per 16 features
// one KiB, row i = (value of key 2i, of key 2i + 1) for each feature. Out: [D / 16][16][32] bf16.
inline void pair_values(const uint16_t* vc, const int64_t* slots, int64_t j0, int64_t n, int64_t D, uint16_t* out) {
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37, 5, 36, 4,
                                      35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int64_t i = 0; i < 16; ++i) {
    const int64_t a = j0 + 2 * i, b = a + 1;
    const uint16_t* ra = a < n ? vc + slots[a] * D : nullptr;
    const uint16_t* rb = b < n ? vc + slots[b] * D : nullptr;
    for (int64_t f = 0; f < D; f += 32) {
      const __m512i x = ra ? _mm512_loadu_si512(ra + f) : _mm512_setzero_si512();
      const __m512i y = rb ? _mm512_loadu_si512(rb + f) : _mm512_setzero_si512();
      _mm512_storeu_si512(out + (f / 16) * 512 + i * 32, _mm512_permutex2var_epi16(x, lo, y));
      _mm512_storeu_si512(out + (f / 16 + 1) * 512 + i * 32, _mm512_permutex2var_epi16(x, hi, y));
    }
  }
}

struct ScratchAmx {
  std::vector<uint16_t> q, keys, values, p16;  // queries, repacked keys and values, probabilities
  std::vector<float> scores, acc, m, l, rescale;
  std::vector<int64_t> slots;
  Scratch512 small;  // tasks of fewer than 16 rows: attend512
  ScratchAmx(int64_t rows, int64_t D)
      : q((rows + 15) / 16 * 16 * D), keys(kAmxKeys * D), values(kAmxKeys * D), p16((rows + 15) / 16 * 16 * kAmxKeys),
        scores((rows + 15) / 16 * 16 * kAmxKeys), acc((rows + 15) / 16 * 16 * D), m(rows), l(rows), rescale(rows),
        small(std::min<int64_t>(rows, 15), D) {}
};

// S[rows, tile keys] of one tile: row blocks of 16 by up to four 16-key blocks (tiles 0-3),
// the queries in tile 4, the paired keys in tile 5.
inline void tile_scores(const ScratchAmx& s, int64_t rows_p, int64_t key_blocks, int64_t D, float* scores) {
  for (int64_t r0 = 0; r0 < rows_p; r0 += 16) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t f = 0; f < D; f += 32) {
      _tile_loadd(4, s.q.data() + r0 * D + f, D * 2);
      const uint16_t* kb = s.keys.data() + (f / 32) * 512;
      _tile_loadd(5, kb, 64);
      _tile_dpbf16ps(0, 4, 5);
      if (key_blocks > 1) {
        _tile_loadd(5, kb + (D / 32) * 512, 64);
        _tile_dpbf16ps(1, 4, 5);
      }
      if (key_blocks > 2) {
        _tile_loadd(5, kb + 2 * (D / 32) * 512, 64);
        _tile_dpbf16ps(2, 4, 5);
      }
      if (key_blocks > 3) {
        _tile_loadd(5, kb + 3 * (D / 32) * 512, 64);
        _tile_dpbf16ps(3, 4, 5);
      }
    }
    float* row = scores + r0 * kAmxKeys;
    _tile_stored(0, row, kAmxKeys * 4);
    if (key_blocks > 1) _tile_stored(1, row + 16, kAmxKeys * 4);
    if (key_blocks > 2) _tile_stored(2, row + 32, kAmxKeys * 4);
    if (key_blocks > 3) _tile_stored(3, row + 48, kAmxKeys * 4);
  }
}

// acc[rows, D] += P[rows, tile keys] V for `pair_steps` steps of 32 keys: per row block and 64
// features, four accumulator tiles loaded from acc, P in tile 4, paired values in tile 5.
inline void tile_values(ScratchAmx& s, int64_t rows_p, int64_t pair_steps, int64_t D) {
  for (int64_t r0 = 0; r0 < rows_p; r0 += 16)
    for (int64_t f = 0; f < D; f += 64) {
      float* a = s.acc.data() + r0 * D + f;
      _tile_loadd(0, a, D * 4);
      _tile_loadd(1, a + 16, D * 4);
      _tile_loadd(2, a + 32, D * 4);
      _tile_loadd(3, a + 48, D * 4);
      for (int64_t k = 0; k < pair_steps; ++k) {
        _tile_loadd(4, s.p16.data() + r0 * kAmxKeys + 32 * k, kAmxKeys * 2);
        const uint16_t* vb = s.values.data() + (k * (D / 16) + f / 16) * 512;
        _tile_loadd(5, vb, 64);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(5, vb + 512, 64);
        _tile_dpbf16ps(1, 4, 5);
        _tile_loadd(5, vb + 1024, 64);
        _tile_dpbf16ps(2, 4, 5);
        _tile_loadd(5, vb + 1536, 64);
        _tile_dpbf16ps(3, 4, 5);
      }
      _tile_stored(0, a, D * 4);
      _tile_stored(1, a + 16, D * 4);
      _tile_stored(2, a + 32, D * 4);
      _tile_stored(3, a + 48, D * 4);
    }
}

// One (sequence, KV head) task of a bf16 cache, as attend512 (same Plan, layouts and masks).
inline void attend_amx(const Plan& p, const uint16_t* q, const uint16_t* kc, const uint16_t* vc, uint16_t* out, int64_t b,
                       int64_t h_kv, ScratchAmx& s) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t G = p.H / p.Hkv, Q = p.qlen[b], D = p.D, rows = G * Q;
  if (rows < 16) return attend512<uint16_t>(p, q, kc, vc, out, b, h_kv, s.small);
  const int64_t rows_p = (rows + 15) / 16 * 16, ctx = p.ctx[b], first_pos = ctx - Q;
  // row r = i * G + g: query token i (position first_pos + i), head h_kv * G + g; padding rows zero
  for (int64_t r = 0; r < rows_p; ++r) {
    uint16_t* dst = s.q.data() + r * D;
    if (r < rows) std::memcpy(dst, q + ((p.qstart[b] + r / G) * p.H + h_kv * G + r % G) * D, D * 2);
    else std::memset(dst, 0, D * 2);
  }
  std::fill(s.acc.begin(), s.acc.begin() + rows_p * D, 0.f);
  std::fill(s.m.begin(), s.m.begin() + rows, neg_inf);
  std::fill(s.l.begin(), s.l.begin() + rows, 0.f);
  const int64_t key_lo = first_key(p, b);
  task_slots(p, b, key_lo, s.slots);
  warsha::configure_tiles();
  for (int64_t t0 = key_lo; t0 < ctx; t0 += kAmxKeys) {
    const int64_t n = std::min(kAmxKeys, ctx - t0), key_blocks = (n + 15) / 16, pair_steps = (n + 31) / 32;
    const int64_t* slots = s.slots.data() + (t0 - key_lo);
    for (int64_t kb = 0; kb < key_blocks; ++kb) pair_keys(kc, slots, 16 * kb, n, D, s.keys.data() + kb * (D / 32) * 512);
    for (int64_t k = 0; k < pair_steps; ++k) pair_values(vc, slots, 32 * k, n, D, s.values.data() + k * (D / 16) * 512);
    tile_scores(s, rows_p, key_blocks, D, s.scores.data());
    for (int64_t r = 0; r < rows; ++r) {
      float* sr = s.scores.data() + r * kAmxKeys;
      for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 mk = n - j >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - j)) - 1);
        _mm512_mask_storeu_ps(sr + j, mk, _mm512_mul_ps(_mm512_maskz_loadu_ps(mk, sr + j), _mm512_set1_ps(p.scale)));
      }
      const int64_t qpos = first_pos + r / G;
      s.rescale[r] = softmax_step(sr, n, t0, p.window > 0 ? qpos - p.window + 1 : 0, qpos, s.m[r], s.l[r]);
      uint16_t* pr = s.p16.data() + r * kAmxKeys;
      probs_bf16(sr, n, pr);
      std::fill(pr + n, pr + pair_steps * 32, static_cast<uint16_t>(0));
      if (s.rescale[r] != 1.f) {
        const __m512 c = _mm512_set1_ps(s.rescale[r]);
        float* a = s.acc.data() + r * D;
        for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(a + d, _mm512_mul_ps(c, _mm512_loadu_ps(a + d)));
      }
    }
    tile_values(s, rows_p, pair_steps, D);
  }
  _tile_release();
  for (int64_t r = 0; r < rows; ++r) {
    float* a = s.acc.data() + r * D;
    const float inv = s.l[r] > 0.f ? 1.f / s.l[r] : 0.f;
    for (int64_t d = 0; d < D; ++d) a[d] *= inv;
    store_row(a, D, out + ((p.qstart[b] + r / G) * p.H + h_kv * G + r % G) * D);
  }
}

inline void run_all_amx(const Plan& p, const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                        torch::Tensor& out, int64_t B) {
  run_tasks<ScratchAmx, uint16_t>(p, q, k_cache, v_cache, out, B, attend_amx);
}
