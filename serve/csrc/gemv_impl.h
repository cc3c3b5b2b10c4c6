// serve's small-batch CPU kernels, written once for every ISA variant. gemv.cpp includes this
// file once per variant, inside the variant's namespace and `#pragma GCC target` region, with
// WARSHA_VEC (256 or 512: the float vector width), WARSHA_VNNI (vpdpwssd for the int4 x int8
// path) and WARSHA_BF16DOT (vdpbf16ps for bf16 weights times bf16 activations) defined.
// No include guard: it is meant to be included several times. Shared, ISA-free helpers
// (FloatRows, emit, run, the int8 activation quantizer) live in gemv.cpp above the inclusions.

// ---- the float vector of this variant and the few operations the kernels need on it
#if WARSHA_VEC == 512
using vf = __m512;
constexpr int kLanes = 16;
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline vf vset1(float a) { return _mm512_set1_ps(a); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline float vsum(vf v) { return _mm512_reduce_add_ps(v); }
inline vf widen_bf16(const uint16_t* p) {  // 16 bf16 values: a 16-bit shift each
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline vf widen_i8(const int8_t* p) {  // 16 int8 values
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline vf widen_u8(__m128i v) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v)); }  // 16 bytes
#else
using vf = __m256;
constexpr int kLanes = 8;
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline vf vset1(float a) { return _mm256_set1_ps(a); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline float vsum(vf v) { return hsum(v); }
inline vf widen_bf16(const uint16_t* p) {  // 8 bf16 values
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline vf widen_i8(const int8_t* p) {  // 8 int8 values
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline vf widen_u8(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }  // the low 8 bytes
#endif
constexpr int kVecs = static_cast<int>(kBlock) / kLanes;  // vectors per block of 32 weights

// kVecs float32 vectors of 32 consecutive bf16 weights of row `n`, from input feature k.
struct Bf16Rows {
  const uint16_t* w;
  int64_t K;
  inline void block(int64_t n, int64_t k, vf out[kVecs]) const {
    const uint16_t* p = w + n * K + k;
    for (int j = 0; j < kVecs; ++j) out[j] = widen_bf16(p + kLanes * j);
  }
  inline float scalar(int64_t n, int64_t k) const { return bf16_to_float(w[n * K + k]); }
  // a block is one 64-byte cache line
  template <int Hint = _MM_HINT_T1>
  inline void prefetch(int64_t n, int64_t k) const { _mm_prefetch(reinterpret_cast<const char*>(w + n * K + k), static_cast<_mm_hint>(Hint)); }
  static constexpr int64_t bytes(int64_t features) { return 2 * features; }
};

// kVecs float32 vectors of 32 consecutive float32 weights of row `n` (read as they are).
struct F32Rows {
  const float* w;
  int64_t K;
  inline void block(int64_t n, int64_t k, vf out[kVecs]) const {
    const float* p = w + n * K + k;
    for (int j = 0; j < kVecs; ++j) out[j] = vload(p + kLanes * j);
  }
  inline float scalar(int64_t n, int64_t k) const { return w[n * K + k]; }
  // a block is two 64-byte cache lines
  template <int Hint = _MM_HINT_T1>
  inline void prefetch(int64_t n, int64_t k) const {
    const char* p = reinterpret_cast<const char*>(w + n * K + k);
    _mm_prefetch(p, static_cast<_mm_hint>(Hint));
    _mm_prefetch(p + 64, static_cast<_mm_hint>(Hint));
  }
  static constexpr int64_t bytes(int64_t features) { return 4 * features; }
};

// kVecs float32 vectors of 32 int8 weights of row `n`, from input feature k (the row's scale is
// applied to the finished sum).
struct Int8Rows {
  const int8_t* q;
  int64_t K;
  inline void block(int64_t n, int64_t k, vf out[kVecs]) const {
    const int8_t* p = q + n * K + k;
    for (int j = 0; j < kVecs; ++j) out[j] = widen_i8(p + kLanes * j);
  }
  inline float scalar(int64_t n, int64_t k) const { return static_cast<float>(q[n * K + k]); }
  // two blocks share a 64-byte cache line: one prefetch per line
  template <int Hint = _MM_HINT_T1>
  inline void prefetch(int64_t n, int64_t k) const {
    if ((k & 63) == 0) _mm_prefetch(reinterpret_cast<const char*>(q + n * K + k), static_cast<_mm_hint>(Hint));
  }
  static constexpr int64_t bytes(int64_t features) { return features; }
};

// kVecs float32 vectors of 32 dequantized int4 weights of row `n`, from input feature k.
struct Int4Rows {
  const uint8_t* q;
  const float* scales;
  const float* zeros;
  int64_t K, groups;
  int gshift;  // log2 of the group size (a power of two)
  inline void block(int64_t n, int64_t k, vf out[kVecs]) const {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + n * (K / 2) + k / 2));
    const __m128i low = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(v, low);                      // features 0-15 of the block
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), low);   // features 16-31
    const int64_t g = n * groups + (k >> gshift);
    const vf s = vset1(scales[g]);
    const vf z = vset1(zeros[g]);
#if WARSHA_VEC == 512
    out[0] = vfma(widen_u8(lo), s, z);
    out[1] = vfma(widen_u8(hi), s, z);
#else
    const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int j = 0; j < 4; ++j) out[j] = vfma(widen_u8(parts[j]), s, z);
#endif
  }
  inline float scalar(int64_t, int64_t) const { return 0.f; }  // K is a multiple of 32: no tail
  // four blocks share a 64-byte cache line: one prefetch per line
  template <int Hint = _MM_HINT_T1>
  inline void prefetch(int64_t n, int64_t k) const {
    if ((k & 127) == 0) _mm_prefetch(reinterpret_cast<const char*>(q + n * (K / 2) + k / 2), static_cast<_mm_hint>(Hint));
  }
  static constexpr int64_t bytes(int64_t features) { return features / 2; }
};

// y[r, n] = sum_k x[r, k] * W[n, k] for R rows and outputs [n0, n1). A independent
// accumulators per row (at most one per vector of a block) hide FMA latency when R is small.
// With two or more rows the loop does enough arithmetic per cache line that the hardware
// prefetchers alone no longer keep enough reads in flight: time became memory time plus
// arithmetic time instead of the larger of the two. Each block therefore asks for the same block
// of the output `ahead` rows on, into L2, about kL2Ahead bytes ahead of the reads (on a 278k x 640
// float32 head, Zen 4: 5 rows went from 1.5x to 1.05x one row's time; prefetching into L1, or
// only one row ahead, as before, left 3-5 rows at 1.3-1.7x). A single row takes the same
// prefetch: on a 2-core Sapphire Rapids VM the hardware prefetchers alone streamed a float32
// 270k x 640 head at 19 GB/s, with it 21 GB/s (int8 weights, bound by their widening, stay at 11-13).
// Input features are walked in chunks (feature_chunk, gemv.cpp).
template <int R, int A, typename Weights>
void rows_kernel(const Weights& W, const float* x, int64_t K, int64_t N, int64_t n0, int64_t n1, float* y) {
  constexpr int kA = A < kVecs ? A : kVecs;  // a block has only kVecs vectors to spread
  const int64_t chunk = feature_chunk(R, K);
  const int64_t ahead = (kL2Ahead + Weights::bytes(chunk) - 1) / Weights::bytes(chunk);  // rows
  for (int64_t k0 = 0; k0 < K; k0 += chunk) {
    const int64_t k1 = std::min(K, k0 + chunk);
    for (int64_t n = n0; n < n1; ++n) {
      vf acc[R][kA];
      for (int r = 0; r < R; ++r)
        for (int a = 0; a < kA; ++a) acc[r][a] = vzero();
      const bool prefetch = n + ahead < N;
      int64_t k = k0;
      for (; k + kBlock <= k1; k += kBlock) {
        vf w[kVecs];
        if (prefetch) W.template prefetch<>(n + ahead, k);
        W.block(n, k, w);
        for (int r = 0; r < R; ++r) {
          const float* xr = x + r * K + k;
          for (int j = 0; j < kVecs; ++j) acc[r][j % kA] = vfma(w[j], vload(xr + kLanes * j), acc[r][j % kA]);
        }
      }
      float tail[R] = {};
      for (; k < k1; ++k) {
        const float wk = W.scalar(n, k);
        for (int r = 0; r < R; ++r) tail[r] += wk * x[r * K + k];
      }
      for (int r = 0; r < R; ++r) {
        vf s = acc[r][0];
        for (int a = 1; a < kA; ++a) s = vadd(s, acc[r][a]);
        const float part = vsum(s) + tail[r];
        y[r * N + n] = k0 == 0 ? part : y[r * N + n] + part;
      }
    }
  }
}

// One activation row (decode at batch 1): kRowGroup output rows per pass, each with its own
// accumulators (the same kA and order as rows_kernel<1, A>, so the same bits), and each block asks
// for the same block of the next group's rows into L1. One output row at a time with the L2
// prefetch left the int8 head (270k x 640, 2-core Sapphire Rapids VM) at 11-13 GB/s, bound by
// the widening's latency chain; eight rows per pass with this prefetch ran 8-9.5 ms against 15.
// Whole rows only (feature_chunk keeps K whole for one row); the last n1 % kRowGroup rows go
// through rows_kernel.
constexpr int kRowGroup = WARSHA_VEC == 512 ? 8 : 2;  // AVX2: 2 rows x 4 accumulators fill the 16 registers

template <int kN, int A, typename Weights>
void row_group_kernel(const Weights& W, const float* x, int64_t K, int64_t n0, int64_t n1, float* y) {
  constexpr int kA = A < kVecs ? A : kVecs;
  int64_t n = n0;
  for (; n + kN <= n1; n += kN) {
    vf acc[kN][kA];
    for (int j = 0; j < kN; ++j)
      for (int a = 0; a < kA; ++a) acc[j][a] = vzero();
    const bool prefetch = n + 2 * kN <= n1;
    int64_t k = 0;
    for (; k + kBlock <= K; k += kBlock) {
      if (prefetch)
        for (int j = 0; j < kN; ++j) W.template prefetch<_MM_HINT_T0>(n + kN + j, k);
      for (int j = 0; j < kN; ++j) {
        vf w[kVecs];
        W.block(n + j, k, w);
        for (int i = 0; i < kVecs; ++i) acc[j][i % kA] = vfma(w[i], vload(x + k + kLanes * i), acc[j][i % kA]);
      }
    }
    for (int j = 0; j < kN; ++j) {
      float tail = 0.0f;
      for (int64_t t = k; t < K; ++t) tail += W.scalar(n + j, t) * x[t];
      vf s = acc[j][0];
      for (int a = 1; a < kA; ++a) s = vadd(s, acc[j][a]);
      y[n + j] = vsum(s) + tail;
    }
  }
  if (n < n1) rows_kernel<1, A>(W, x, K, n1, n, n1, y);  // N = n1: y[n] and prefetches within range
}

template <typename Weights>
void dispatch_rows(int rows, const Weights& W, const float* x, int64_t K, int64_t N, int64_t n0, int64_t n1, float* y) {
  switch (rows) {
    case 1:
      if (feature_chunk(1, K) == K && !g_stream_rows) return row_group_kernel<kRowGroup, 4>(W, x, K, n0, n1, y);
      return rows_kernel<1, 4>(W, x, K, N, n0, n1, y);
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

// acc + the int32 sums of adjacent int16 products a * b: one vpdpwssd with VNNI, madd + add without.
inline __m256i madd_add(__m256i acc, __m256i a, __m256i b) {
#if WARSHA_VNNI
  return _mm256_dpwssd_epi32(acc, a, b);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

// The vectors a w4a8 step accumulates in: int32 group sums, then float32 row sums (256-bit).
struct Acc256 {
  using IVec = __m256i;
  using FVec = __m256;
  static inline IVec izero() { return _mm256_setzero_si256(); }
  static inline FVec fzero() { return _mm256_setzero_ps(); }
  static inline FVec scale_add(IVec gi, float s, FVec acc) { return _mm256_fmadd_ps(_mm256_cvtepi32_ps(gi), _mm256_set1_ps(s), acc); }
  static inline float sum(FVec v) { return hsum(v); }
};

// One 32-weight block per step (group 32, or K not a multiple of 64): integer dot products of
// an output row's block against R quantized rows, times m_b, into int32 group sums.
struct BlockStep {
  using Acc = Acc256;
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
      acc[r] = madd_add(acc[r], _mm256_maddubs_epi16(w, xv), m);
    }
  }
};

// One load, three ops to unpack, two maddubs and one madd (VNNI: vpdpwssd) per 64 weights.
struct PairStep {
  using Acc = Acc256;
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
      acc[r] = madd_add(acc[r], d16, m);
    }
  }
};

#if WARSHA_VEC == 512 && WARSHA_VNNI
// ---- four blocks per step with 512-bit VNNI (K and the group multiples of 128).
// Why: the 256-bit pair step spends seven vector ops per 32 bytes of weights and reached only
// 23-30 GB/s on a 2-core Zen 4 VM whose bf16 kernels read at 45-47 (isa_gemv). One 64-byte load
// holds four blocks: one mask gives the low nibbles of all four (features 0-15 of each), one shift
// and mask the high nibbles (16-31), and vpdpbusd adds four u8 x s8 products into each int32 lane,
// so lanes 4b..4b+3 hold block b's partial sums. Two vpdpbusd (low, high) leave at most
// 8 * 15 * 127 = 15240 in a lane, which fits the lane's low 16 bits; vpdpwssd by (m_b, 0) per
// lane then multiplies by the block's multiplier and adds into the group sum: three ops per row
// per 128 weights. The integer sums are the pair step's exactly.
struct Acc512 {
  using IVec = __m512i;
  using FVec = __m512;
  static inline IVec izero() { return _mm512_setzero_si512(); }
  static inline FVec fzero() { return _mm512_setzero_ps(); }
  static inline FVec scale_add(IVec gi, float s, FVec acc) { return _mm512_fmadd_ps(_mm512_cvtepi32_ps(gi), _mm512_set1_ps(s), acc); }
  static inline float sum(FVec v) { return _mm512_reduce_add_ps(v); }
};

struct QuadStep {
  using Acc = Acc512;
  static constexpr int64_t kWidth = 4 * kBlock;
  const QuadRows& x4;
  int64_t K;
  template <int R>
  inline void apply(const uint8_t* qn, int64_t s, __m512i* acc) const {
    const __m512i low = _mm512_set1_epi8(0x0F);
    const __m512i v = _mm512_loadu_si512(qn + s * 2 * kBlock);
    const __m512i lo = _mm512_and_si512(v, low);
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    const int64_t steps = K / kWidth;
    for (int r = 0; r < R; ++r) {
      const int8_t* x = x4.q.data() + r * K + s * kWidth;
      __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(x));
      d = _mm512_dpbusd_epi32(d, hi, _mm512_loadu_si512(x + 64));
      acc[r] = _mm512_dpwssd_epi32(acc[r], d, _mm512_loadu_si512(x4.m32.data() + (r * steps + s) * 32));
    }
  }
};
#endif

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
    using Acc = typename Step::Acc;
    typename Acc::FVec acc[R];  // one accumulator: a group's integer work hides the FMA's latency
    for (int r = 0; r < R; ++r) acc[r] = Acc::fzero();
    const uint8_t* qn = q + n * (K / 2);
    if (R >= 2 && n + 1 < N) {  // the next output's weights, as rows_kernel does
      for (int64_t off = 0; off < K / 2; off += 64) _mm_prefetch(reinterpret_cast<const char*>(qn + K / 2 + off), _MM_HINT_T0);
    }
    for (int64_t g = 0; g < groups; ++g) {
      if (R == 1) {  // the weights kPrefetchAhead bytes on (rows are contiguous: on into the next outputs)
        const char* at = reinterpret_cast<const char*>(qn + g * (group / 2)) + kPrefetchAhead;
        for (int64_t off = 0; off < group / 2; off += 64) _mm_prefetch(at + off, _MM_HINT_T0);
      }
      typename Acc::IVec gi[R];
      for (int r = 0; r < R; ++r) gi[r] = Acc::izero();
      for (int64_t u = g * per_group; u < (g + 1) * per_group; ++u) step.template apply<R>(qn, u, gi);
      const float s = scales[n * groups + g];
      for (int r = 0; r < R; ++r) acc[r] = Acc::scale_add(gi[r], s, acc[r]);
    }
    for (int r = 0; r < R; ++r)
      y[r * N + n] = xq.row_scale[r] * Acc::sum(acc[r]) + zero_term(zeros + n * groups, xq.gsum.data() + r * groups, groups);
  }
}

#if WARSHA_BF16DOT
// ---- bf16 weights times bf16 activations with vdpbf16ps (AVX512_BF16).
// Why: the widening kernel spends two conversions and two FMAs per 32 weights; vdpbf16ps takes
// 32 bf16 weights and 32 bf16 activations and adds their products pairwise into 16 float32
// lanes in one instruction. The products of two bf16 values are exact in float32; the adds round
// to nearest even, as the widening kernel's FMAs do, but denormal inputs and outputs are flushed
// to zero (bf16 activations of a model are never that small). Only bf16 activations take this
// path: float32 ones would have to be rounded first, so they keep the widening kernel.
// A row's tail (K not a multiple of 32) is one masked block: the masked-off lanes load as zero.
template <int R>
void dot_bf16_kernel(const uint16_t* w, const uint16_t* x, int64_t K, int64_t N, int64_t n0, int64_t n1, float* y) {
  const int64_t chunk = feature_chunk(R, K);
  const int64_t ahead = (kL2Ahead + 2 * chunk - 1) / (2 * chunk);  // rows, as rows_kernel
  for (int64_t k0 = 0; k0 < K; k0 += chunk) {
    const int64_t k1 = std::min(K, k0 + chunk);
    const __mmask32 tail = static_cast<__mmask32>((uint64_t{1} << ((k1 - k0) % kBlock)) - 1);
    for (int64_t n = n0; n < n1; ++n) {
      __m512 acc[R];
      for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
      const bool prefetch = R >= 2 && n + ahead < N;
      const uint16_t* wn = w + n * K;
      int64_t k = k0;
      for (; k + kBlock <= k1; k += kBlock) {
        if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(wn + ahead * K + k), _MM_HINT_T1);
        const __m512i wv = _mm512_loadu_si512(wn + k);
        for (int r = 0; r < R; ++r)
          acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_loadu_si512(x + r * K + k), (__m512bh)wv);
      }
      if (k < k1) {
        const __m512i wv = _mm512_maskz_loadu_epi16(tail, wn + k);
        for (int r = 0; r < R; ++r)
          acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_maskz_loadu_epi16(tail, x + r * K + k), (__m512bh)wv);
      }
      for (int r = 0; r < R; ++r) {
        const float part = _mm512_reduce_add_ps(acc[r]);
        y[r * N + n] = k0 == 0 ? part : y[r * N + n] + part;
      }
    }
  }
}

// One activation row (decode at batch 1): kN output rows at a time, each with its own
// accumulator, sharing each activation block's load, and each block asks for the same block of
// the next group's rows into L1 (kN rows ahead: 10 KB for K = 640). The hardware prefetchers
// alone kept a single-row pass at 14-16 GB/s on a 2-core Sapphire Rapids VM (270k x 640 bf16
// head: 21.7-23.7 ms); with the software prefetch 12.7-14.1 ms, 24-27 GB/s, past what a torch sum
// reads (19.9 GB/s). More rows per group without it gained little (8: 20.9-22.6 ms).
// Whole rows only (feature_chunk keeps K whole for one row).
constexpr int kRow1Group = 8;  // output rows per group of dot_bf16_row1

template <int kN>
void dot_bf16_row1(const uint16_t* w, const uint16_t* x, int64_t K, int64_t n0, int64_t n1, float* y) {
  const __mmask32 tail = static_cast<__mmask32>((uint64_t{1} << (K % kBlock)) - 1);
  const int64_t full = K / kBlock * kBlock;
  int64_t n = n0;
  for (; n + kN <= n1; n += kN) {
    __m512 acc[kN];
    for (int j = 0; j < kN; ++j) acc[j] = _mm512_setzero_ps();
    const uint16_t* wn = w + n * K;
    const bool prefetch = n + 2 * kN <= n1;
    for (int64_t k = 0; k < full; k += kBlock) {
      if (prefetch)
        for (int j = 0; j < kN; ++j) _mm_prefetch(reinterpret_cast<const char*>(wn + (kN + j) * K + k), _MM_HINT_T0);
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + k);
      for (int j = 0; j < kN; ++j) acc[j] = _mm512_dpbf16_ps(acc[j], xv, (__m512bh)_mm512_loadu_si512(wn + j * K + k));
    }
    if (full < K) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(tail, x + full);
      for (int j = 0; j < kN; ++j)
        acc[j] = _mm512_dpbf16_ps(acc[j], xv, (__m512bh)_mm512_maskz_loadu_epi16(tail, wn + j * K + full));
    }
    for (int j = 0; j < kN; ++j) y[n + j] = _mm512_reduce_add_ps(acc[j]);
  }
  if (n < n1) dot_bf16_kernel<1>(w, x, K, n1, n, n1, y);  // the last rows one at a time (N = n1 here)
}

// x [M, K] bf16 (contiguous) @ w.T, in chunks of up to kMaxRows rows, outputs split across threads.
void gemv_bf16_dot(const torch::Tensor& x_in, const torch::Tensor& w, float* y) {
  const torch::Tensor xc = x_in.contiguous();
  const uint16_t* x = reinterpret_cast<const uint16_t*>(xc.data_ptr());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
  const int64_t M = xc.size(0), K = xc.size(1), N = w.size(0);
  for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, M - m0));
    const uint16_t* xr = x + m0 * K;
    float* yp = y + m0 * N;
    at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
      if (rows == 1 && feature_chunk(1, K) == K && !g_stream_rows) return dot_bf16_row1<kRow1Group>(wp, xr, K, n0, n1, yp);
      by_rows(rows, [&](auto R) { dot_bf16_kernel<decltype(R)::value>(wp, xr, K, N, n0, n1, yp); });
    });
  }
}

// Chosen (row, column) pairs of x [M, K] @ w.T, bf16 both, each rounded to bf16 and widened: the
// batch head screen's candidates (serve/head_screen_batch.py). Each pair runs dot_bf16_kernel<1>,
// whose arithmetic per row and column is every gemv_bf16 path's wherever feature_chunk keeps K
// whole (K <= 768 at 8 rows), so a candidate reads as it would in a decode batch of 1-8 rows.
void gemv_bf16_pairs(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& rows, const torch::Tensor& cols,
                     torch::Tensor out) {
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
  const int64_t K = x.size(1), P = rows.numel();
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* cp = cols.data_ptr<int64_t>();
  float* y = out.data_ptr<float>();
  at::parallel_for(0, P, 16, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      dot_bf16_kernel<1>(wp + cp[p] * K, xp + rp[p] * K, K, 1, 0, 1, y + p);
      y[p] = bf16_to_float(float_to_bf16(y[p]));
    }
  });
}
#endif

// ---- the entry points of this variant (gemv.cpp dispatches to them)

// x [M, K] @ w^T into the float32 sums y [M, N].
void gemv_bf16_into(const torch::Tensor& x, const torch::Tensor& w, float* y) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kBFloat16 && w.is_contiguous(), "w must be a contiguous bf16 [N, K] tensor");
  check_x(x, w.size(1));
#if WARSHA_BF16DOT
  if (x.scalar_type() == torch::kBFloat16) return gemv_bf16_dot(x, w, y);
#endif
  const Bf16Rows W{reinterpret_cast<const uint16_t*>(w.data_ptr()), w.size(1)};
  const auto dispatch = [&W](int rows, const float* xr, int64_t K, int64_t N, int64_t n0, int64_t n1, float* y) {
    dispatch_rows(rows, W, xr, K, N, n0, n1, y);
  };
  run_into(dispatch, x, w.size(0), y);
}

torch::Tensor gemv_bf16(const torch::Tensor& x, const torch::Tensor& w, at::ScalarType out_dtype) {
  torch::Tensor y = sums_buffer(x.size(0), w.size(0));
  gemv_bf16_into(x, w, y.data_ptr<float>());
  return emit(y, out_dtype);
}

// The sums straight into the caller's float32 `out` (the logits buffer of a decode step), rounded
// through bf16 when asked: what gemv_bf16 to bf16 and a widening copy give, in one pass.
void gemv_bf16_out(const torch::Tensor& x, const torch::Tensor& w, torch::Tensor out, bool round_bf16) {
  float* y = out_rows(out, x.size(0), w.size(0));
  gemv_bf16_into(x, w, y);
  if (round_bf16) round_through_bf16(y, out.numel());
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

#if WARSHA_VNNI && WARSHA_VEC == 512
// ---- int8 weights x int16 activations with vpdpwssd (512-bit VNNI variants; the int8 LM head).
// Why: widening int8 weights to float32 costs two conversions and an FMA per 16 weights, and kept
// a 262k x 640 int8 head at 25-30 GB/s on a 2-core Zen 4 VM where its bf16 twin streamed at 49.
// With the row rounded once to int16 (quantize_rows_int16), 32 weights widen to int16 in one op
// and one vpdpwssd adds their 32 products pairwise into 16 int32 lanes, exactly. Two accumulators
// per row halve the dependency chain; lanes are summed in float32 (their int32 total can
// overflow); the K % 32 tail is one masked load (the activations are zero-padded).
template <int R>
void int8_x16_kernel(const int8_t* q, const Int16Rows& xq, int64_t K, int64_t N, int64_t n0, int64_t n1, const float* s, float* y) {
  const int64_t Kp = xq.Kp, tail = K % 32;
  const __mmask32 tail_mask = static_cast<__mmask32>((uint64_t{1} << tail) - 1);
  const auto step = [&](const int8_t* w8, __m512i* acc, int64_t k) {
    const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w8)));
    for (int r = 0; r < R; ++r) acc[r] = _mm512_dpwssd_epi32(acc[r], w, _mm512_loadu_si512(xq.q.data() + r * Kp + k));
  };
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* qn = q + n * K;
    __m512i a0[R], a1[R];
    for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm512_setzero_si512();
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
      step(qn + k, a0, k);
      step(qn + k + 32, a1, k + 32);
    }
    if (k + 32 <= K) {
      step(qn + k, a0, k);
      k += 32;
    }
    if (tail) {
      const __m512i w = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(tail_mask, qn + k));
      for (int r = 0; r < R; ++r) a1[r] = _mm512_dpwssd_epi32(a1[r], w, _mm512_loadu_si512(xq.q.data() + r * Kp + k));
    }
    for (int r = 0; r < R; ++r) {
      const float sum = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_cvtepi32_ps(a0[r]), _mm512_cvtepi32_ps(a1[r])));
      y[r * N + n] = s[n] * xq.scale[r] * sum;
    }
  }
}

torch::Tensor gemv_int8_x16(const torch::Tensor& x_in, const torch::Tensor& q, const float* s, at::ScalarType out_dtype) {
  const FloatRows x(x_in);
  const int64_t M = x_in.size(0), K = x_in.size(1), N = q.size(0);
  torch::Tensor sums = sums_buffer(M, N);
  float* y = sums.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, M - m0));
    const Int16Rows xq = quantize_rows_int16(x.data + m0 * K, rows, K);
    float* yp = y + m0 * N;
    at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
      by_rows(rows, [&](auto R) { int8_x16_kernel<decltype(R)::value>(qp, xq, K, N, n0, n1, s, yp); });
    });
  }
  return emit(sums, out_dtype);
}
#endif

// y = (x @ q.T) * scale[n]: an int8 weight with one float32 scale per output row. On the 512-bit
// VNNI variants (K <= kInt16MaxK) the rows are rounded to int16 first (gemv_int8_x16).
torch::Tensor gemv_int8(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scales, at::ScalarType out_dtype) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kInt8 && q.is_contiguous(), "q must be a contiguous int8 [N, K] tensor");
  const int64_t N = q.size(0);
  TORCH_CHECK(scales.scalar_type() == torch::kFloat32 && scales.is_contiguous() && scales.numel() == N,
              "scales must be a contiguous float32 tensor of one value per output row");
  check_x(x, q.size(1));
#if WARSHA_VNNI && WARSHA_VEC == 512
  if (q.size(1) <= kInt16MaxK) return gemv_int8_x16(x, q, scales.data_ptr<float>(), out_dtype);
#endif
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
  torch::Tensor sums = sums_buffer(M, N);
  float* y = sums.data_ptr<float>();
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* zp = zeros.data_ptr<float>();
  for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, M - m0));
    const QuantRows xq = quantize_rows(x.data + m0 * K, rows, K, group);
    float* yp = y + m0 * N;
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
#if WARSHA_VEC == 512 && WARSHA_VNNI
    if (K % QuadStep::kWidth == 0 && group % QuadStep::kWidth == 0) {
      const QuadRows x4 = quad_rows(xq, rows, K);
      run_step(QuadStep{x4, K});
      continue;
    }
#endif
    if (K % PairStep::kWidth == 0 && group >= PairStep::kWidth) {
      const PairRows xp = pair_rows(xq, rows, K);
      run_step(PairStep{xp, K});
    } else {
      run_step(BlockStep{xq, K});
    }
  }
  return emit(sums, out_dtype);
}
