// Paged attention for short query chunks on the CPU: decode steps and speculative verification,
// read straight from the heads-first paged cache. Two algorithms, chosen per call by the ISA
// variant serve's kernels run (serve/cpu_kernels.py, set_isa): the AVX2 one below, and the
// AVX-512 ones of attention_avx512.h (plain and with vdpbf16ps), included at the end of the
// anonymous namespace.
//
// Why: the torch path gathers whole blocks into a padded copy, widens a bf16 cache to float32 in
// another copy and then runs two batched matmuls and a softmax, about ten op launches per layer.
// For a decode step that work is tiny and the launches dominate (a batch-1 step of a 22-layer
// model spent more time in attention than in its output projection). Here one pass per
// (sequence, KV head) walks the sequence's blocks, keeps an online softmax in float32 for every
// query row that shares the KV head (GQA: the group's heads are rows, K/V are read once), and
// writes the output rounded once. Key positions past a row's own position or before its sliding
// window are skipped, never gathered.
//
// Layouts (serve/attention/interface.py): q [T, H, D]; k_cache, v_cache [Hkv, slots, D]; a
// sequence's position p lives at slot block_table[p / block_size] * block_size + p % block_size.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "amx_tiles.h"
#include "bf16.h"
#include "vmath.h"

std::string current_isa();  // gemv.cpp: the ISA variant chosen at load

namespace {

using warsha::bf16_to_float;
using warsha::float_to_bf16;

constexpr int64_t kTile = 64;  // keys scored before their softmax update and value pass

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// D consecutive values as float32 into `out` (bf16 widened, float32 copied).
template <typename T>
inline void load_row(const T* src, int64_t D, float* out);

template <>
inline void load_row<float>(const float* src, int64_t D, float* out) {
  std::memcpy(out, src, sizeof(float) * D);
}

template <>
inline void load_row<uint16_t>(const uint16_t* src, int64_t D, float* out) {
  for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(out + d, warsha::bf16x8_load(src + d));
}

inline void store_row(const float* src, int64_t D, float* dst) { std::memcpy(dst, src, sizeof(float) * D); }
inline void store_row(const float* src, int64_t D, uint16_t* dst) {
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) warsha::bf16x8_store(dst + d, _mm256_loadu_ps(src + d));
  for (; d < D; ++d) dst[d] = float_to_bf16(src[d]);
}

inline float dot(const float* a, const float* b, int64_t D) {
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), _mm256_loadu_ps(b + d + 8), s1);
  }
  if (d < D) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), s0);
  return hsum8(_mm256_add_ps(s0, s1));
}

// Scores of one query row against 8 consecutive float32 key rows (stride D): one accumulator
// per key, then a single transposing reduction instead of eight horizontal sums.
inline __m256 dot8(const float* q, const float* k, int64_t D) {
  __m256 a[8];
  for (int j = 0; j < 8; ++j) a[j] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    const __m256 qv = _mm256_loadu_ps(q + d);
    for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + j * D + d), a[j]);
  }
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

inline void axpy(float a, const float* x, float* y, int64_t D) {
  const __m256 av = _mm256_set1_ps(a);
  for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(y + d, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + d), _mm256_loadu_ps(y + d)));
}

inline void scale_row(float a, float* y, int64_t D) {
  const __m256 av = _mm256_set1_ps(a);
  for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(y + d, _mm256_mul_ps(av, _mm256_loadu_ps(y + d)));
}

// Scores of keys t0 .. t0 + n - 1 outside positions [lo, hi] set to -inf, and the largest score
// left (-inf when none is visible), eight keys at a time (a scalar max is a chain of dependent
// compares as long as the tile).
inline float mask_max8(float* s, int64_t n, int64_t t0, int64_t lo, int64_t hi) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 none = _mm256_set1_ps(neg_inf);
  __m256 mx = none;
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const auto rel = [&](int64_t pos) { return static_cast<int32_t>(std::clamp<int64_t>(pos - t0 - j, -1, 8)); };
    const __m256i hidden = _mm256_or_si256(_mm256_cmpgt_epi32(_mm256_set1_epi32(rel(lo)), lane),
                                           _mm256_cmpgt_epi32(lane, _mm256_set1_epi32(rel(hi))));
    const __m256 v = _mm256_blendv_ps(_mm256_loadu_ps(s + j), none, _mm256_castsi256_ps(hidden));
    _mm256_storeu_ps(s + j, v);
    mx = _mm256_max_ps(mx, v);
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  float m = std::max(_mm_cvtss_f32(m4), _mm_cvtss_f32(_mm_movehdup_ps(m4)));
  for (; j < n; ++j) {
    if (t0 + j > hi || t0 + j < lo) s[j] = neg_inf;
    m = std::max(m, s[j]);
  }
  return m;
}

// exp(s - m) in place over n scores, returning their sum (masked scores are -inf and give 0).
inline float exp_shift_sum(float* s, int64_t n, float m) {
  const __m256 mv = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 e = warsha::exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
    _mm256_storeu_ps(s + j, e);
    acc = _mm256_add_ps(acc, e);
  }
  float total = hsum8(acc);
  for (; j < n; ++j) {
    s[j] = std::exp(s[j] - m);
    total += s[j];
  }
  return total;
}

struct Plan {
  const int64_t* tables;  // [B, W]
  int64_t width;          // W
  const int64_t* ctx;     // [B]
  const int64_t* qstart;  // [B]
  const int64_t* qlen;    // [B]
  int64_t block_size, window;  // window <= 0: none
  int64_t H, Hkv, D;
  float scale;
};

// The first key any query row of sequence b can see (the start of its sliding window, or 0).
inline int64_t first_key(const Plan& p, int64_t b) {
  return p.window > 0 ? std::max<int64_t>(0, p.ctx[b] - p.qlen[b] - p.window + 1) : 0;
}

// Every 64-byte line of one cache row (D values) requested ahead of its use, at cache level Hint.
template <int Hint, typename T>
inline void prefetch_row(const T* row, int64_t D) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t line = 0; line < D * static_cast<int64_t>(sizeof(T)); line += 64) _mm_prefetch(p + line, static_cast<_mm_hint>(Hint));
}

// The cache slot of every key sequence b's task reads (positions key_lo .. ctx - 1) into `out`,
// walking block by block (no division per key).
inline void task_slots(const Plan& p, int64_t b, int64_t key_lo, std::vector<int64_t>& out) {
  const int64_t* table = p.tables + b * p.width;
  const int64_t n = p.ctx[b] - key_lo;
  if (static_cast<int64_t>(out.size()) < n) out.resize(n);
  for (int64_t j = 0, blk = key_lo / p.block_size, off = key_lo % p.block_size; j < n; ++j) {
    out[j] = table[blk] * p.block_size + off;
    if (++off == p.block_size) off = 0, ++blk;
  }
}

// Everything one (sequence, KV head) task needs as scratch: the group's queries, their running
// max / sum / accumulator, a tile of scores, the cache slots of its keys and a tile of K (then V) rows
// widened to float32.
struct Scratch {
  std::vector<float> q, acc, m, l, scores, tile;
  std::vector<int64_t> slots;
  Scratch(int64_t rows, int64_t D)
      : q(rows * D), acc(rows * D), m(rows), l(rows), scores(rows * kTile), tile(kTile * D) {}
};

// One (sequence, KV head) task; kc, vc are this KV head's planes of the cache ([slots, D]).
template <typename T>
void attend(const Plan& p, const T* q, const T* kc, const T* vc, T* out, int64_t b, int64_t h_kv, Scratch& s) {
  const int64_t G = p.H / p.Hkv, Q = p.qlen[b], D = p.D, rows = G * Q;
  const int64_t ctx = p.ctx[b], first_pos = ctx - Q;
  // row r = i * G + g: query token i (position first_pos + i), head h_kv * G + g
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = r / G, h = h_kv * G + r % G;
    load_row<T>(q + ((p.qstart[b] + i) * p.H + h) * D, D, s.q.data() + r * D);
    for (int64_t d = 0; d < D; ++d) s.q[r * D + d] *= p.scale;
  }
  std::fill(s.acc.begin(), s.acc.begin() + rows * D, 0.f);
  std::fill(s.m.begin(), s.m.begin() + rows, -std::numeric_limits<float>::infinity());
  std::fill(s.l.begin(), s.l.begin() + rows, 0.f);
  const int64_t key_lo = first_key(p, b);
  task_slots(p, b, key_lo, s.slots);
  for (int64_t t0 = key_lo; t0 < ctx; t0 += kTile) {
    const int64_t n = std::min(kTile, ctx - t0);
    const int64_t* slots = s.slots.data() + (t0 - key_lo);
    const int64_t n_next = std::max<int64_t>(0, std::min(kTile, ctx - t0 - kTile));
    for (int64_t j = 0; j < n; ++j) {  // key j widened; its value row to L1, the next tile's key j to L2
      prefetch_row<_MM_HINT_T0>(vc + slots[j] * D, D);
      if (j < n_next) prefetch_row<_MM_HINT_T1>(kc + slots[kTile + j] * D, D);
      load_row<T>(kc + slots[j] * D, D, s.tile.data() + j * D);
    }
    // scores of every row against the tile's keys
    for (int64_t r = 0; r < rows; ++r) {
      const float* qr = s.q.data() + r * D;
      float* sr = s.scores.data() + r * kTile;
      int64_t j = 0;
      for (; j + 8 <= n; j += 8) _mm256_storeu_ps(sr + j, dot8(qr, s.tile.data() + j * D, D));
      for (; j < n; ++j) sr[j] = dot(qr, s.tile.data() + j * D, D);
    }
    for (int64_t r = 0; r < rows; ++r) {
      float* sr = s.scores.data() + r * kTile;
      const int64_t qpos = first_pos + r / G;
      const int64_t lo = p.window > 0 ? qpos - p.window + 1 : 0;
      const float tile_max = mask_max8(sr, n, t0, lo, qpos);  // -inf outside the row's causal window
      if (tile_max == -std::numeric_limits<float>::infinity()) {  // nothing visible to this row here
        std::fill(sr, sr + n, 0.f);
        continue;
      }
      const float m_new = std::max(s.m[r], tile_max);
      if (s.m[r] != -std::numeric_limits<float>::infinity() && s.m[r] != m_new) {
        const float c = std::exp(s.m[r] - m_new);
        s.l[r] *= c;
        scale_row(c, s.acc.data() + r * D, D);
      }
      s.m[r] = m_new;
      s.l[r] += exp_shift_sum(sr, n, m_new);
    }
    for (int64_t j = 0; j < n; ++j) load_row<T>(vc + slots[j] * D, D, s.tile.data() + j * D);
    for (int64_t j = 0; j < n; ++j) {
      const float* vr = s.tile.data() + j * D;
      for (int64_t r = 0; r < rows; ++r) {
        const float w = s.scores[r * kTile + j];
        if (w != 0.f) axpy(w, vr, s.acc.data() + r * D, D);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = r / G, h = h_kv * G + r % G;
    float* a = s.acc.data() + r * D;
    scale_row(s.l[r] > 0.f ? 1.f / s.l[r] : 0.f, a, D);
    store_row(a, D, out + ((p.qstart[b] + i) * p.H + h) * D);
  }
}

// The (sequence, KV head) tasks, those with the most rows times keys first. Threads take them
// one at a time as they come free (longest processing time first): the tasks of one call differ
// a lot in size (a 512-token prefill chunk's 16-token pieces see 16 to 512 keys), and torch's
// split into contiguous ranges gave one thread of two the pieces that see the most keys. Ranges
// of equal rows times keys balanced a prefill chunk but not a mixed step, whose decode tasks
// cost more per key (the cache from DRAM) than a prefill piece's: taking tasks as threads come
// free needs no cost model. A task's arithmetic does not depend on which thread runs it, so
// results do not change.
inline std::vector<int64_t> largest_first(const Plan& p, int64_t B) {
  std::vector<int64_t> order(B * p.Hkv), cost(B);
  for (int64_t b = 0; b < B; ++b) cost[b] = p.qlen[b] * (p.ctx[b] - first_key(p, b) + kTile);
  for (int64_t t = 0; t < B * p.Hkv; ++t) order[t] = t;
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return cost[x / p.Hkv] > cost[y / p.Hkv]; });
  return order;
}

// Every (sequence, KV head) task of the batch over torch's threads, each thread with its own
// scratch; `attend_one` is one algorithm's per-task function (the AVX2 one below, or an AVX-512 one).
template <typename Scratch, typename T, typename Attend>
void run_tasks(const Plan& p, const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache, torch::Tensor& out,
               int64_t B, Attend attend_one) {
  const T* qp = reinterpret_cast<const T*>(q.data_ptr());
  const T* kp = reinterpret_cast<const T*>(k_cache.data_ptr());
  const T* vp = reinterpret_cast<const T*>(v_cache.data_ptr());
  T* op = reinterpret_cast<T*>(out.data_ptr());
  const int64_t slots = k_cache.size(1), max_q = *std::max_element(p.qlen, p.qlen + B);
  const std::vector<int64_t> order = largest_first(p, B);
  std::atomic<int64_t> next{0};
  const int64_t total = static_cast<int64_t>(order.size());
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), total), 1, [&](int64_t, int64_t) {
    Scratch s((p.H / p.Hkv) * max_q, p.D);
    for (int64_t i = next.fetch_add(1); i < total; i = next.fetch_add(1)) {
      const int64_t b = order[i] / p.Hkv, h = order[i] % p.Hkv;
      attend_one(p, qp, kp + h * slots * p.D, vp + h * slots * p.D, op, b, h, s);
    }
  });
}

template <typename T>
void run_all(const Plan& p, const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache, torch::Tensor& out,
             int64_t B) {
  run_tasks<Scratch, T>(p, q, k_cache, v_cache, out, B, attend<T>);
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")
namespace isa_avx512 {
#define WARSHA_BF16DOT 0
#include "attention_avx512.h"
#undef WARSHA_BF16DOT
}  // namespace isa_avx512
#pragma GCC pop_options

// AMX-BF16 in the target too: attention_amx.h (the amx variant's prefill pieces) reuses this copy's
// softmax; nothing here issues a tile instruction unless paged_attention picks that path.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")
namespace isa_avx512_bf16 {
#define WARSHA_BF16DOT 1
#include "attention_avx512.h"
#include "attention_amx.h"
#undef WARSHA_BF16DOT
}  // namespace isa_avx512_bf16
#pragma GCC pop_options

torch::Tensor as_long(const torch::Tensor& t, const char* name, int64_t n) {
  TORCH_CHECK(t.device().is_cpu() && t.numel() == n, name, " must be a CPU tensor of ", n, " values, got ", t.sizes());
  return t.to(torch::kLong).contiguous();
}

}  // namespace

// q [T, H, D] against the paged cache; every sequence b owns query rows [qstart[b], qstart[b] +
// qlen[b]) at positions [ctx[b] - qlen[b], ctx[b]); their K/V are already in the cache.
torch::Tensor paged_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                              const torch::Tensor& block_tables, const torch::Tensor& ctx_lens, const torch::Tensor& q_starts,
                              const torch::Tensor& q_lens, int64_t block_size, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.device().is_cpu(), "q must be a contiguous CPU tensor [tokens, heads, head_dim]");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes(),
              "k_cache and v_cache must be contiguous [kv_heads, slots, head_dim] of one shape");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "q and the cache must share a dtype");
  TORCH_CHECK(q.scalar_type() == torch::kBFloat16 || q.scalar_type() == torch::kFloat32, "paged_attention takes bf16 or float32");
  const int64_t H = q.size(1), D = q.size(2), Hkv = k_cache.size(0);
  TORCH_CHECK(k_cache.size(2) == D && D % 8 == 0, "head_dim must match the cache and be a multiple of 8");
  TORCH_CHECK(H % Hkv == 0, "query heads (", H, ") must be a multiple of KV heads (", Hkv, ")");
  TORCH_CHECK(block_tables.dim() == 2 && block_size > 0, "block_tables must be [sequences, max_blocks]");
  const int64_t B = block_tables.size(0);
  const torch::Tensor tables = block_tables.to(torch::kLong).contiguous();
  const torch::Tensor ctx = as_long(ctx_lens, "ctx_lens", B), qs = as_long(q_starts, "q_starts", B), ql = as_long(q_lens, "q_lens", B);
  const int64_t* c = ctx.data_ptr<int64_t>();
  const int64_t* s = qs.data_ptr<int64_t>();
  const int64_t* l = ql.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(l[b] >= 1 && c[b] >= l[b] && s[b] >= 0 && s[b] + l[b] <= q.size(0), "sequence ", b, ": rows or lengths out of range");
    TORCH_CHECK((c[b] + block_size - 1) / block_size <= tables.size(1), "sequence ", b, ": block table shorter than its context");
  }
  const Plan plan{tables.data_ptr<int64_t>(), tables.size(1), c, s, l, block_size, window, H, Hkv, D, static_cast<float>(scale)};
  int64_t covered = 0;
  for (int64_t b = 0; b < B; ++b) covered += l[b];
  // rows of other chunks (a prefill beside the decodes) stay zero until the caller fills them
  torch::Tensor out = covered == q.size(0) ? torch::empty_like(q) : torch::zeros_like(q);
  const std::string chosen = current_isa();
  const std::string isa = chosen == "amx" ? "avx512_bf16" : chosen;  // amx: the avx512_bf16 kernels beside its tiles
  const bool wide = isa.rfind("avx512", 0) == 0 && D % 64 == 0;
  const bool f32 = q.scalar_type() == torch::kFloat32;
  if (wide && !f32 && chosen == "amx" && amx_enable())  // prefill pieces on tiles, decode rows as avx512_bf16
    isa_avx512_bf16::run_all_amx(plan, q, k_cache, v_cache, out, B);
  else if (wide && isa == "avx512_bf16")
    f32 ? isa_avx512_bf16::run_all512<float>(plan, q, k_cache, v_cache, out, B)
        : isa_avx512_bf16::run_all512<uint16_t>(plan, q, k_cache, v_cache, out, B);
  else if (wide)
    f32 ? isa_avx512::run_all512<float>(plan, q, k_cache, v_cache, out, B)
        : isa_avx512::run_all512<uint16_t>(plan, q, k_cache, v_cache, out, B);
  else
    f32 ? run_all<float>(plan, q, k_cache, v_cache, out, B) : run_all<uint16_t>(plan, q, k_cache, v_cache, out, B);
  return out;
}
