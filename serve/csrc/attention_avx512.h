// The AVX-512 variants of paged attention for short query chunks (attention.cpp includes this
// file twice, each time inside its own namespace and `#pragma GCC target` region): plain AVX-512
// (WARSHA_BF16DOT 0: keys widened to float32 for the scores) and AVX-512 BF16 (WARSHA_BF16DOT 1:
// a bf16 cache scored with vdpbf16ps, 32 products per instruction, no widening). No include guard.
//
// Why a second algorithm rather than wider vectors in the AVX2 one: that one keeps every
// query row's accumulator in memory and updates it key by key (a load, an FMA and a store per
// vector), and widens each key and value row into a scratch tile first. Here the scores of four
// query rows come from each key row in place, the key loaded once for all four (bf16 dot
// products, or widened in registers), and the value pass holds a block of 64 output features of
// up to four query rows in registers across the whole tile: each value vector is widened once
// and used by every row, and the accumulators touch memory once per tile. Measured on a 2-core
// Sapphire Rapids host, 40 Gemma 3 270M sequences of ~430 keys, 18 layers, bf16 cache from DRAM:
// 59-71 ms per step (AVX2 algorithm), 33-38 (AVX-512), 30-38 (AVX-512 BF16); with the cache in
// L2 the BF16 variant is 4x the AVX2 one, so from DRAM the read itself is most of the time.
// The value pass reads each value row in four 128-byte pieces, one per block of 64 features,
// so without help every row's first piece waited on DRAM: while a key row is scored its value
// row is now requested into L1 and the next tile's key row into L2 (`prefetch_row`). On a 2-core
// Xeon with AMX (avx512_bf16 kernels), 32 sequences of 16-768 keys, 18 layers, 260 MB of cache:
// 25.0-25.4 -> 13.7 ms (10 -> 19 GB/s; a plain read of the same bytes 23-24 GB/s); a prefetch
// one key ahead had made no measurable difference.
//
// Same results as the AVX2 kernel up to float32 summation order: float32 scores and online
// softmax, float32 accumulation of probability times value, one rounding of the output; except
// that the AVX-512 BF16 variant on a bf16 cache rounds each tile's probabilities to bf16 for the
// value pass (value_block_dot below; float32 caches keep float32 probabilities).
// Requires D % 64 == 0 (checked by the caller; other head sizes take the AVX2 kernel).

constexpr int64_t kTile512 = 64;  // keys scored before their softmax update and value pass
constexpr int kRowBlock = 4;      // query rows sharing one pass over a tile's values
constexpr int kDVecs = 4;         // 16-float vectors of output features per register block

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) { return warsha::bf16x16_load(p); }

// Four float32 sums of 16 lanes each, as [sum a, sum b, sum c, sum d].
inline __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));  // per lane: a02 b02 a13 b13
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512 u = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xEE));  // per lane: a b c d
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(u), _mm512_extractf32x8_ps(u, 1));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// Scores of up to four query rows against key `k` (one cache row), sharing each load of the key:
// bf16 rows with vdpbf16ps where the variant has it, else float32 rows (`qf`, widened once) with FMAs.
template <typename T>
inline __m128 dots4(const T* const* q, const float* const* qf, const T* k, int64_t D) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
#if WARSHA_BF16DOT
  if constexpr (std::is_same_v<T, uint16_t>) {
    for (int64_t d = 0; d < D; d += 32) {
      const __m512bh kv = (__m512bh)_mm512_loadu_si512(k + d);
      a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(q[0] + d), kv);
      a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(q[1] + d), kv);
      a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_loadu_si512(q[2] + d), kv);
      a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_loadu_si512(q[3] + d), kv);
    }
    return reduce4(a0, a1, a2, a3);
  }
#endif
  for (int64_t d = 0; d < D; d += 16) {
    const __m512 kv = load16(k + d);
    a0 = _mm512_fmadd_ps(_mm512_loadu_ps(qf[0] + d), kv, a0);
    a1 = _mm512_fmadd_ps(_mm512_loadu_ps(qf[1] + d), kv, a1);
    a2 = _mm512_fmadd_ps(_mm512_loadu_ps(qf[2] + d), kv, a2);
    a3 = _mm512_fmadd_ps(_mm512_loadu_ps(qf[3] + d), kv, a3);
  }
  return reduce4(a0, a1, a2, a3);
}

// Scores of keys t0 .. t0 + n - 1 outside positions [lo, hi] set to -inf, and the largest
// score left (-inf when none is visible), 16 keys at a time: a scalar max over a tile is a
// chain of 64 dependent compares, which cost a row about as much as its scores' arithmetic.
inline float mask_max16(float* s, int64_t n, int64_t t0, int64_t lo, int64_t hi) {
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 none = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 mx = none;
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 tail = n - j >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - j)) - 1);
    const auto rel = [&](int64_t pos) { return static_cast<int32_t>(std::clamp<int64_t>(pos - t0 - j, -1, 16)); };
    const __mmask16 seen = _mm512_mask_cmpge_epi32_mask(tail, lane, _mm512_set1_epi32(rel(lo))) &
                           _mm512_cmple_epi32_mask(lane, _mm512_set1_epi32(rel(hi)));
    const __m512 v = _mm512_mask_blend_ps(seen, none, _mm512_maskz_loadu_ps(tail, s + j));
    _mm512_mask_storeu_ps(s + j, tail, v);
    mx = _mm512_max_ps(mx, v);
  }
  return _mm512_reduce_max_ps(mx);
}

// exp(s - m) in place over n scores, returning their sum (-inf scores give 0).
inline float exp_shift_sum16(float* s, int64_t n, float m) {
  const __m512 mv = _mm512_set1_ps(m);
  __m512 acc = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512 e = warsha::exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), mv));
    _mm512_storeu_ps(s + j, e);
    acc = _mm512_add_ps(acc, e);
  }
  if (j < n) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - j)) - 1);
    const __m512 e = _mm512_maskz_mov_ps(tail, warsha::exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + j), mv)));
    _mm512_mask_storeu_ps(s + j, tail, e);
    acc = _mm512_add_ps(acc, e);
  }
  return _mm512_reduce_add_ps(acc);
}

// One row's online-softmax step over a tile's n scores sr (keys t0 ..): masked to the row's view
// [lo, hi] (-inf outside, then 0), exponentiated in place against the running max m, the running
// sum l updated; returns the factor the row's accumulator must be scaled by (1 when nothing in the
// tile was visible, 0 on the first tile that was).
inline float softmax_step(float* sr, int64_t n, int64_t t0, int64_t lo, int64_t hi, float& m, float& l) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const float tile_max = mask_max16(sr, n, t0, lo, hi);
  if (tile_max == neg_inf) {
    std::fill(sr, sr + n, 0.f);
    return 1.f;
  }
  const float m_new = std::max(m, tile_max);
  const float rescale = m == neg_inf ? 0.f : std::exp(m - m_new);
  m = m_new;
  l = l * rescale + exp_shift_sum16(sr, n, m_new);
  return rescale;
}

// acc[r][f0 : f0 + 64] = acc * rescale[r] + sum_j p[r][j] v[j][f0 : f0 + 64] for rows r0..r0+nr.
template <typename T, int NR>
inline void value_block(const T* vc, const int64_t* slots, int64_t n, int64_t D, int64_t f0, const float* p, const float* rescale,
                        float* acc) {
  __m512 a[NR][kDVecs];
  for (int r = 0; r < NR; ++r) {
    const __m512 c = _mm512_set1_ps(rescale[r]);
    for (int v = 0; v < kDVecs; ++v) a[r][v] = _mm512_mul_ps(c, _mm512_loadu_ps(acc + r * D + f0 + 16 * v));
  }
  for (int64_t j = 0; j < n; ++j) {
    const T* row = vc + slots[j] * D + f0;
    __m512 x[kDVecs];
    for (int v = 0; v < kDVecs; ++v) x[v] = load16(row + 16 * v);
    for (int r = 0; r < NR; ++r) {
      const __m512 w = _mm512_set1_ps(p[r * kTile512 + j]);
      for (int v = 0; v < kDVecs; ++v) a[r][v] = _mm512_fmadd_ps(w, x[v], a[r][v]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int v = 0; v < kDVecs; ++v) _mm512_storeu_ps(acc + r * D + f0 + 16 * v, a[r][v]);
}

template <typename T>
inline void value_rows(const T* vc, const int64_t* slots, int64_t n, int64_t D, int64_t nr, const float* p, const float* rescale,
                       float* acc) {
  for (int64_t f0 = 0; f0 < D; f0 += 16 * kDVecs) {
    switch (nr) {
      case 1: value_block<T, 1>(vc, slots, n, D, f0, p, rescale, acc); break;
      case 2: value_block<T, 2>(vc, slots, n, D, f0, p, rescale, acc); break;
      case 3: value_block<T, 3>(vc, slots, n, D, f0, p, rescale, acc); break;
      default: value_block<T, 4>(vc, slots, n, D, f0, p, rescale, acc); break;
    }
  }
}

#if WARSHA_BF16DOT
// The value pass on a bf16 cache with vdpbf16ps, as FlashAttention multiplies P by V in 16 bits
// on GPUs: each row's tile probabilities are rounded to bf16 (relative error at most 2^-9 each;
// the running max, sum and the accumulator stay float32) and two keys' values are multiplied at
// once. Per pair of keys and 64 output features: four loads, four unpacks and, per query row,
// four vdpbf16ps, where the widening pass takes eight widening ops and eight FMAs per row.
// Accumulator lanes hold features in the unpacks' order (`unpair_row` puts them back).

// A tile's probabilities of row r as bf16 (`out`, kTile512 per row), zero from n to the next even key.
inline void probs_bf16(const float* p, int64_t n, uint16_t* out) {
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = n - j >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - j)) - 1);
    const __m256i h = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, p + j));
    _mm256_mask_storeu_epi16(out + j, m, h);
  }
  if (n % 2) out[n] = 0;
}

// acc[r] (pair order) = acc * rescale[r] + sum_j p16[r][j] v[j] over features f0 .. f0 + 63.
template <int NR>
inline void value_block_dot(const uint16_t* vc, const int64_t* slots, int64_t n, int64_t D, int64_t f0, const uint16_t* p16,
                            const float* rescale, float* acc) {
  __m512 a[NR][kDVecs];
  for (int r = 0; r < NR; ++r) {
    const __m512 c = _mm512_set1_ps(rescale[r]);
    for (int v = 0; v < kDVecs; ++v) a[r][v] = _mm512_mul_ps(c, _mm512_loadu_ps(acc + r * D + f0 + 16 * v));
  }
  for (int64_t j = 0; j < n; j += 2) {
    const uint16_t* r0 = vc + slots[j] * D + f0;
    const uint16_t* r1 = j + 1 < n ? vc + slots[j + 1] * D + f0 : nullptr;  // an odd tile's last key pairs with zeros
    __m512i b[kDVecs];
    for (int h = 0; h < kDVecs / 2; ++h) {
      const __m512i x0 = _mm512_loadu_si512(r0 + 32 * h);
      const __m512i x1 = r1 != nullptr ? _mm512_loadu_si512(r1 + 32 * h) : _mm512_setzero_si512();
      b[2 * h] = _mm512_unpacklo_epi16(x0, x1);
      b[2 * h + 1] = _mm512_unpackhi_epi16(x0, x1);
    }
    for (int r = 0; r < NR; ++r) {
      int32_t pair;
      std::memcpy(&pair, p16 + r * kTile512 + j, sizeof(pair));
      const __m512bh w = (__m512bh)_mm512_set1_epi32(pair);
      for (int v = 0; v < kDVecs; ++v) a[r][v] = _mm512_dpbf16_ps(a[r][v], w, (__m512bh)b[v]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int v = 0; v < kDVecs; ++v) _mm512_storeu_ps(acc + r * D + f0 + 16 * v, a[r][v]);
}

inline void value_rows_dot(const uint16_t* vc, const int64_t* slots, int64_t n, int64_t D, int64_t nr, const uint16_t* p16,
                           const float* rescale, float* acc) {
  for (int64_t f0 = 0; f0 < D; f0 += 16 * kDVecs) {
    switch (nr) {
      case 1: value_block_dot<1>(vc, slots, n, D, f0, p16, rescale, acc); break;
      case 2: value_block_dot<2>(vc, slots, n, D, f0, p16, rescale, acc); break;
      case 3: value_block_dot<3>(vc, slots, n, D, f0, p16, rescale, acc); break;
      default: value_block_dot<4>(vc, slots, n, D, f0, p16, rescale, acc); break;
    }
  }
}

// Features back in order: per 32, the unpacks left 0-3, 8-11, 16-19, 24-27 in the first 16
// lanes and 4-7, 12-15, 20-23, 28-31 in the next 16.
inline void unpair_row(float* a, int64_t D) {
  alignas(64) float tmp[32];
  for (int64_t g = 0; g < D; g += 32) {
    for (int q = 0; q < 4; ++q)
      for (int i = 0; i < 4; ++i) {
        tmp[8 * q + i] = a[g + 4 * q + i];
        tmp[8 * q + 4 + i] = a[g + 16 + 4 * q + i];
      }
    std::memcpy(a + g, tmp, sizeof(tmp));
  }
}
#endif

struct Scratch512 {
  std::vector<float> qf, acc, m, l, scores, rescale;
  std::vector<int64_t> slots;
  std::vector<uint16_t> p16;  // the tile's probabilities in bf16 (the vdpbf16ps value pass)
  Scratch512(int64_t rows, int64_t D)
      : qf(rows * D), acc(rows * D), m(rows), l(rows), scores(rows * kTile512), rescale(rows),
        p16(rows * kTile512) {}
};

// Whether this variant multiplies P by V with bf16 dot products (bf16 caches on AVX-512 BF16).
template <typename T>
constexpr bool kPairedValues = WARSHA_BF16DOT && std::is_same_v<T, uint16_t>;

// One (sequence, KV head) task, as the AVX2 kernel's `attend` (same Plan, same layouts).
template <typename T>
void attend512(const Plan& p, const T* q, const T* kc, const T* vc, T* out, int64_t b, int64_t h_kv, Scratch512& s) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t G = p.H / p.Hkv, Q = p.qlen[b], D = p.D, rows = G * Q;
  const int64_t ctx = p.ctx[b], first_pos = ctx - Q;
  std::fill(s.acc.begin(), s.acc.begin() + rows * D, 0.f);
  std::fill(s.m.begin(), s.m.begin() + rows, neg_inf);
  std::fill(s.l.begin(), s.l.begin() + rows, 0.f);
  const int64_t key_lo = first_key(p, b);
  // row r = i * G + g: query token i (position first_pos + i), head h_kv * G + g
  auto q_row = [&](int64_t r) { return q + ((p.qstart[b] + r / G) * p.H + h_kv * G + r % G) * D; };
  if (!WARSHA_BF16DOT || !std::is_same_v<T, uint16_t>)  // the FMA scores read float32 rows
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(s.qf.data() + r * D + d, load16(q_row(r) + d));
  task_slots(p, b, key_lo, s.slots);
  for (int64_t t0 = key_lo; t0 < ctx; t0 += kTile512) {
    const int64_t n = std::min(kTile512, ctx - t0);
    const int64_t* slots = s.slots.data() + (t0 - key_lo);
    const int64_t n_next = std::max<int64_t>(0, std::min(kTile512, ctx - t0 - kTile512));
    for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock) {  // scores, four rows per pass over the keys
      const T* qs[kRowBlock];
      const float* qfs[kRowBlock];
      for (int i = 0; i < kRowBlock; ++i) {  // a partial block repeats its last row
        const int64_t r = std::min<int64_t>(r0 + i, rows - 1);
        qs[i] = q_row(r);
        qfs[i] = s.qf.data() + r * D;
      }
      alignas(16) float four[4];
      for (int64_t j = 0; j < n; ++j) {
        if (r0 == 0) {  // while key j is scored: its value row to L1, the next tile's key j to L2
          prefetch_row<_MM_HINT_T0>(vc + slots[j] * D, D);
          if (j < n_next) prefetch_row<_MM_HINT_T1>(kc + slots[kTile512 + j] * D, D);
        }
        _mm_store_ps(four, dots4<T>(qs, qfs, kc + slots[j] * D, D));
        for (int64_t i = 0; i < kRowBlock && r0 + i < rows; ++i) s.scores[(r0 + i) * kTile512 + j] = four[i] * p.scale;
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t qpos = first_pos + r / G;
      const int64_t lo = p.window > 0 ? qpos - p.window + 1 : 0;  // the row's view: [lo, qpos]
      s.rescale[r] = softmax_step(s.scores.data() + r * kTile512, n, t0, lo, qpos, s.m[r], s.l[r]);
    }
    for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock) {
      const int64_t nr = std::min<int64_t>(kRowBlock, rows - r0);
#if WARSHA_BF16DOT
      if constexpr (kPairedValues<T>) {
        for (int64_t r = r0; r < r0 + nr; ++r) probs_bf16(s.scores.data() + r * kTile512, n, s.p16.data() + r * kTile512);
        value_rows_dot(vc, slots, n, D, nr, s.p16.data() + r0 * kTile512, s.rescale.data() + r0, s.acc.data() + r0 * D);
        continue;
      }
#endif
      value_rows(vc, slots, n, D, nr, s.scores.data() + r0 * kTile512, s.rescale.data() + r0, s.acc.data() + r0 * D);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = r / G, h = h_kv * G + r % G;
    float* a = s.acc.data() + r * D;
    const float inv = s.l[r] > 0.f ? 1.f / s.l[r] : 0.f;
    for (int64_t d = 0; d < D; ++d) a[d] *= inv;
#if WARSHA_BF16DOT
    if constexpr (kPairedValues<T>) unpair_row(a, D);
#endif
    store_row(a, D, out + ((p.qstart[b] + i) * p.H + h) * D);
  }
}

template <typename T>
void run_all512(const Plan& p, const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache, torch::Tensor& out,
                int64_t B) {
  run_tasks<Scratch512, T>(p, q, k_cache, v_cache, out, B, attend512<T>);
}
