// Paged decode attention: one query token per row against its sequence's paged KV cache, with
// an optional sliding window, score soft-cap and per-head sink logit (gpt-oss). Its twin is
// decode_attention's torch path in ladle/runner/attention.py.
//
// A query's result depends only on its query, its context length and the cached keys and
// values: every query reduces over its keys in one fixed order (scores four keys at a time from
// the first, softmax over its own length, values summed token by token). Batch-invariant mode
// sends every token of a prefill chunk here as a row of its own (the query at position p over
// positions 0..p); consecutive rows of one sequence then form a group whose keys and values are
// loaded once for all its queries, each query still summing exactly as it would alone. Jobs
// (a group of rows x a KV head) run in parallel; a step with fewer jobs than threads (one
// sequence of a model with one KV head) splits each job's key scores and value sums between
// the threads instead, every score and sum computed by the same instructions (Attend). With
// AVX512-BF16, bfloat16 keys are scored by vdpbf16ps against the unscaled query (key_step).
// Outside batch-invariant mode (the caller's `tiles`), on AVX512-BF16 CPUs, a prefill chunk's
// run of 16 or more rows attends in tiles instead (tile_run), a product per 16 queries, on the
// tile unit where the CPU has AMX-BF16.
#include <atomic>

#include "kernels.h"
#include "vec.h"

#if defined(__AVX512F__)
// Cached rows this many tokens ahead are prefetched into L1, and those kFarBytes ahead into L2;
// each job prefetches the first kFarBytes of the next job's keys and values into L2. A
// sequence's blocks lie anywhere in the cache, so the hardware prefetcher loses the stream at
// every block boundary. Measured on a Zen 4 at 32 sequences x 192 tokens (Qwen3-0.6B heads),
// with the vector softmax, L1 prefetch and all of the next job's rows: 1.98 -> 1.35 ms per layer.
// One sequence (0.6B heads, 2 threads, a cold cache, consecutive blocks), us per layer, that /
// with the L2 stream and the next job's first rows only: 512 tokens 136 / 108, 1024 333 / 206,
// 4096 1137 / 881 (prefetching a whole next job that outgrows L2 fetched it twice). Later (one
// sequence, 192 tokens, one cache on 2 MiB pages, consecutive blocks, 2 threads): 40-46 us per
// layer cold against 14-16 with the layer's keys and values in L2; a burst prefetch of each
// job's keys and values before it runs, and kFarBytes 4-32 KB, all left it at 38-47; all of the
// next job's keys and values prefetched 8-32 lines per step of this job's loops, at 31-34
// against 33-37 without (200 KB jobs at 512 tokens: 74-79 against 76).
constexpr int64_t kPrefetchTokens = 8;
constexpr int64_t kFarBytes = 8192;

// Rows [begin, end) into L1 (_MM_HINT_T0) or L2 (_MM_HINT_T1).
template <auto kHint, typename T>
static inline void prefetch_rows(const T* const* rows, int64_t begin, int64_t end, int64_t D) {
  for (int64_t t = begin; t < end; ++t)
    for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(T)); b += 64)
      _mm_prefetch(reinterpret_cast<const char*>(rows[t]) + b, kHint);
}
// The L2 stream's distance in rows of D values of T.
template <typename T>
static inline int64_t far_rows(int64_t D) {
  return std::max<int64_t>(2 * kPrefetchTokens, kFarBytes / (D * static_cast<int64_t>(sizeof(T))));
}

// The score of a key: q . key over d in vector steps, times `scale` after the sum. Q is float
// (the query scaled already, scale 1; the keys converted to float32, 16 values a step) or, with
// AVX512-BF16 and bfloat16 keys, at::BFloat16 (the model's unscaled query; vdpbf16ps, 32 exact
// products a step summed pairwise into float32 lanes: the float32 steps were FMA-bound at half
// rate on a Zen 4, half of the kernel's time).
static inline __m512 key_step(__m512 a, const float* q, __m512 k) {
  return _mm512_fmadd_ps(_mm512_loadu_ps(q), k, a);
}
template <typename Q, typename T>
static inline auto key_vec(const T* k) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<Q, at::BFloat16>)
    return (__m512bh)_mm512_loadu_si512(k);
  else
#endif
    return load16(k);
}
#if defined(__AVX512BF16__)
static inline __m512 key_step(__m512 a, const at::BFloat16* q, __m512bh k) {
  return _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(q), k);
}
#endif
template <typename Q>
constexpr int64_t kKeyStep = std::is_same_v<Q, float> ? 16 : 32;

// scores[t] = scale * (q . keys[t]) for n keys (row pointers), four keys per shuffle-tree
// reduction, the last n % 4 alone.
template <typename Q, typename T>
static inline void key_scores(const Q* q, const T* const* keys, int64_t n, int64_t D,
                              float scale, float* scores) {
  const int64_t far = far_rows<T>(D);
  const __m128 s4 = _mm_set1_ps(scale);
  int64_t t = 0;
  for (; t + 4 <= n; t += 4) {
    prefetch_rows<_MM_HINT_T0>(keys, t + kPrefetchTokens, std::min(n, t + kPrefetchTokens + 4), D);
    prefetch_rows<_MM_HINT_T1>(keys, t + far, std::min(n, t + far + 4), D);
    __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                   _mm512_setzero_ps()};
    for (int64_t d = 0; d < D; d += kKeyStep<Q>)
      for (int j = 0; j < 4; ++j) a[j] = key_step(a[j], q + d, key_vec<Q>(keys[t + j] + d));
    _mm_storeu_ps(scores + t, _mm_mul_ps(hsum4(a), s4));
  }
  for (; t < n; ++t) {
    __m512 a = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += kKeyStep<Q>) a = key_step(a, q + d, key_vec<Q>(keys[t] + d));
    scores[t] = _mm512_reduce_add_ps(a) * scale;
  }
}

// Keys [0, n) (n a multiple of 4) scored for HN query heads: each group of four keys is loaded
// once for the HN heads, and each (head, key) gets key_scores' own chain over d and hsum4
// tree, so the scores are bit-equal to key_scores' for each head alone.
template <int HN, typename Q, typename T>
static inline void key_scores_shared(const Q* const* q, const T* const* keys, int64_t n,
                                     int64_t D, float scale, float* const* scores) {
  const int64_t far = far_rows<T>(D);
  const __m128 s4 = _mm_set1_ps(scale);
  for (int64_t t = 0; t < n; t += 4) {
    prefetch_rows<_MM_HINT_T0>(keys, t + kPrefetchTokens, std::min(n, t + kPrefetchTokens + 4), D);
    prefetch_rows<_MM_HINT_T1>(keys, t + far, std::min(n, t + far + 4), D);
    __m512 a[HN][4];
    for (int i = 0; i < HN; ++i)
      for (int j = 0; j < 4; ++j) a[i][j] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += kKeyStep<Q>) {
      decltype(key_vec<Q>(keys[t])) kv[4];
      for (int j = 0; j < 4; ++j) kv[j] = key_vec<Q>(keys[t + j] + d);
      for (int i = 0; i < HN; ++i)
        for (int j = 0; j < 4; ++j) a[i][j] = key_step(a[i][j], q[i] + d, kv[j]);
    }
    for (int i = 0; i < HN; ++i) _mm_storeu_ps(scores[i] + t, _mm_mul_ps(hsum4(a[i]), s4));
  }
}

// out[i][d0 + 16c] = sum_{t < n[i]} p[i][t] * values[t][d0 + 16c] for HN query heads and P
// chunks of 16 dims: each value chunk is loaded once for the HN heads (while t < n[i] for all
// of them, then for those still summing), and each (head, chunk) accumulates over t in order
// from zero, one fma per token.
template <int HN, int P, typename T>
static inline void weighted_values_shared(const float* const* p, const int64_t* n,
                                          const T* const* values, int64_t d0, int64_t D,
                                          float* const* out) {
  int64_t lo = n[0], hi = n[0];
  for (int i = 1; i < HN; ++i) {
    lo = std::min(lo, n[i]);
    hi = std::max(hi, n[i]);
  }
  __m512 a[HN][P];
  for (int i = 0; i < HN; ++i)
    for (int c = 0; c < P; ++c) a[i][c] = _mm512_setzero_ps();
  const int64_t far = far_rows<T>(D);
  for (int64_t t = 0; t < lo; ++t) {
    if (t + kPrefetchTokens < hi)
      prefetch_rows<_MM_HINT_T0>(values, t + kPrefetchTokens, t + kPrefetchTokens + 1, D);
    if (t + far < hi) prefetch_rows<_MM_HINT_T1>(values, t + far, t + far + 1, D);
    __m512 pi[HN];
    for (int i = 0; i < HN; ++i) pi[i] = _mm512_set1_ps(p[i][t]);
    for (int c = 0; c < P; ++c) {
      const __m512 vv = load16(values[t] + d0 + 16 * c);
      for (int i = 0; i < HN; ++i) a[i][c] = _mm512_fmadd_ps(pi[i], vv, a[i][c]);
    }
  }
  for (int64_t t = lo; t < hi; ++t)
    for (int c = 0; c < P; ++c) {
      const __m512 vv = load16(values[t] + d0 + 16 * c);
      for (int i = 0; i < HN; ++i)
        if (t < n[i]) a[i][c] = _mm512_fmadd_ps(_mm512_set1_ps(p[i][t]), vv, a[i][c]);
    }
  for (int i = 0; i < HN; ++i)
    for (int c = 0; c < P; ++c) _mm512_storeu_ps(out[i] + d0 + 16 * c, a[i][c]);
}

// F(std::integral_constant<int, N>{}) for a head count 1 <= N <= 8 (the shared kernels'
// register blocks).
template <typename F>
static inline void with_heads(int64_t n, F&& f) {
  switch (n) {
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
#endif

// x[0..n) = softmax(x), in float32; 16 lanes at a time with the vector exp where available.
// `sink` (-inf: none) is one more logit in the denominator whose probability is dropped.
static inline void softmax_in_place(float* x, int64_t n, float sink) {
  float mx = sink, sum = 0.f;
  int64_t t = 0;
#if defined(__AVX512F__)
  __m512 vm = _mm512_set1_ps(-INFINITY);
  for (; t + 16 <= n; t += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(x + t));
  mx = std::max(mx, _mm512_reduce_max_ps(vm));
#endif
  for (; t < n; ++t) mx = std::max(mx, x[t]);
  t = 0;
#if defined(__AVX512F__)
  __m512 vs = _mm512_setzero_ps();
  const __m512 vmx = _mm512_set1_ps(mx);
  for (; t + 16 <= n; t += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(x + t), vmx));
    _mm512_storeu_ps(x + t, e);
    vs = _mm512_add_ps(vs, e);
  }
  sum = _mm512_reduce_add_ps(vs);
#endif
  for (; t < n; ++t) {
    x[t] = std::exp(x[t] - mx);
    sum += x[t];
  }
  sum += std::exp(sink - mx);  // 0 without a sink
  const float inv = 1.f / sum;
  for (t = 0; t < n; ++t) x[t] *= inv;
}

// x[0..n) = cap * tanh(x / cap): soft-capped attention scores (Gemma 2), before the softmax.
// 16 lanes at a time: tanh(y) = 1 - 2 / (exp(2y) + 1) with the vector exp, and for
// |y| < 0.375, where that difference cancels, the odd series to y^11: within 5e-7 relative of
// tanh everywhere (float32 tanh itself is within 1.1e-7).
static inline void softcap_in_place(float* x, int64_t n, float cap) {
  const float inv = 1.f / cap;
  int64_t t = 0;
#if defined(__AVX512F__)
  const __m512 vinv = _mm512_set1_ps(inv), vcap = _mm512_set1_ps(cap);
  const __m512 one = _mm512_set1_ps(1.f), two = _mm512_set1_ps(2.f);
  for (; t + 16 <= n; t += 16) {
    const __m512 y = _mm512_mul_ps(_mm512_loadu_ps(x + t), vinv);
    const __m512 e = exp16(_mm512_mul_ps(two, y));  // inf for large y: tanh = 1 - 0
    const __m512 big = _mm512_sub_ps(one, _mm512_div_ps(two, _mm512_add_ps(e, one)));
    const __m512 y2 = _mm512_mul_ps(y, y);
    __m512 p = _mm512_set1_ps(-1382.f / 155925.f);
    p = _mm512_fmadd_ps(p, y2, _mm512_set1_ps(62.f / 2835.f));
    p = _mm512_fmadd_ps(p, y2, _mm512_set1_ps(-17.f / 315.f));
    p = _mm512_fmadd_ps(p, y2, _mm512_set1_ps(2.f / 15.f));
    p = _mm512_fmadd_ps(p, y2, _mm512_set1_ps(-1.f / 3.f));
    const __m512 small = _mm512_fmadd_ps(_mm512_mul_ps(p, y2), y, y);
    const __mmask16 is_small =
        _mm512_cmp_ps_mask(_mm512_abs_ps(y), _mm512_set1_ps(0.375f), _CMP_LT_OQ);
    _mm512_storeu_ps(x + t, _mm512_mul_ps(vcap, _mm512_mask_mov_ps(big, is_small, small)));
  }
#endif
  for (; t < n; ++t) x[t] = cap * std::tanh(x[t] * inv);
}

#if defined(__AVX512F__)
// The register block of the value sum for HN heads at head dim D: as many 16-dim chunks per
// pass over the tokens as 16 accumulators allow.
static inline int value_chunks(int64_t HN, int64_t D) {
  if (HN <= 2 && D % 128 == 0) return 8;
  if (HN <= 4 && D % 64 == 0) return 4;
  if (D % 32 == 0) return 2;
  return 1;
}

// weighted_values_shared with P chosen at run time (P <= value_chunks(HN, D)).
template <int HN, typename T>
static inline void values_pass(int P, const float* const* p, const int64_t* n,
                               const T* const* values, int64_t d0, int64_t D, float* const* o) {
  if constexpr (HN <= 2)
    if (P == 8) return weighted_values_shared<HN, 8>(p, n, values, d0, D, o);
  if constexpr (HN <= 4)
    if (P == 4) return weighted_values_shared<HN, 4>(p, n, values, d0, D, o);
  if (P == 2) return weighted_values_shared<HN, 2>(p, n, values, d0, D, o);
  weighted_values_shared<HN, 1>(p, n, values, d0, D, o);
}
#endif

// One job's attention for QN query heads sharing one KV head, in three phases that one thread runs
// one after the other (Attend::run) or several threads share (Attend::run_split, for a step with
// fewer jobs than threads): the keys every head scores in whole groups of four (any range of
// those groups), each head's own tail and softmax, then the value sums (any range of units,
// a unit being up to 8 heads x `chunks` 16-dim chunks). Every score and every (head, chunk)
// accumulator is computed by the same instructions in the same order however the work is
// split, so the result is the same bit for bit.
template <typename T>
struct Attend {
  const float* qf;  // (QN, D), scaled
  const int64_t* n;
  const T* const* keys;
  const T* const* values;
  int64_t QN, D;
  float* scores;  // (QN, hi)
  float* acc;     // (QN, D)
  float softcap;
  const float* sinks;
  // The queries unscaled in the model's bfloat16 (QN, D) and the scale, for key_scores' bf16
  // steps; or null: the scaled float32 qf scores.
  const at::BFloat16* qb;
  float scale;
  int64_t lo, hi;

  Attend(const float* qf_, const int64_t* n_, const T* const* keys_, const T* const* values_,
         int64_t QN_, int64_t D_, float* scores_, float* acc_, float softcap_,
         const float* sinks_, const at::BFloat16* qb_ = nullptr, float scale_ = 1.f)
      : qf(qf_), n(n_), keys(keys_), values(values_), QN(QN_), D(D_), scores(scores_),
        acc(acc_), softcap(softcap_), sinks(sinks_), qb(qb_), scale(scale_), lo(n_[0]),
        hi(n_[0]) {
    for (int64_t i = 1; i < QN; ++i) {
      lo = std::min(lo, n[i]);
      hi = std::max(hi, n[i]);
    }
  }
#if defined(__AVX512F__)
  bool vector() const { return D % 16 == 0; }
  int64_t shared_groups() const { return lo / 4; }  // groups of four keys every head scores
  // Scores of the shared keys [4 g0, 4 g1).
  void shared_scores(int64_t g0, int64_t g1) const {
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, at::BFloat16>)
      if (qb != nullptr) return shared_scores_of(qb, scale, g0, g1);
#endif
    shared_scores_of(qf, 1.f, g0, g1);
  }
  template <typename Q>
  void shared_scores_of(const Q* qs, float sc, int64_t g0, int64_t g1) const {
    const int64_t t0 = 4 * g0, len = 4 * (g1 - g0);
    for (int64_t i0 = 0; i0 < QN; i0 += 4) {
      const Q* q[4];
      float* s[4];
      const int64_t hn = std::min<int64_t>(4, QN - i0);
      for (int64_t i = 0; i < hn; ++i) {
        q[i] = qs + (i0 + i) * D;
        s[i] = scores + (i0 + i) * hi + t0;
      }
      with_heads(hn, [&](auto c) {
        constexpr int HN = decltype(c)::value;
        if constexpr (HN <= 4) key_scores_shared<HN>(q, keys + t0, len, D, sc, s);
      });
    }
  }
  void tails_and_softmax() const {  // each head's own last groups and tail
    const int64_t shared = 4 * shared_groups();
    for (int64_t i = 0; i < QN; ++i) {
      float* si = scores + i * hi;
      bool done = false;
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, at::BFloat16>)
        if (qb != nullptr) {
          key_scores(qb + i * D, keys + shared, n[i] - shared, D, scale, si + shared);
          done = true;
        }
#endif
      if (!done) key_scores(qf + i * D, keys + shared, n[i] - shared, D, 1.f, si + shared);
      if (softcap > 0.f) softcap_in_place(si, n[i], softcap);
      softmax_in_place(si, n[i], sinks != nullptr ? sinks[i] : -INFINITY);
    }
  }
  // Units of the value sum at `chunks` 16-dim chunks per pass (at most value_chunks(8, D)):
  // head blocks of 8 x passes.
  int64_t value_units(int chunks) const { return (QN + 7) / 8 * (D / (16 * chunks)); }
  void value_sums(int chunks, int64_t u0, int64_t u1) const {
    const int64_t passes = D / (16 * chunks);
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t i0 = u / passes * 8, d0 = u % passes * 16 * chunks;
      const int64_t hn = std::min<int64_t>(8, QN - i0);
      const float* p[8];
      float* o[8];
      for (int64_t i = 0; i < hn; ++i) {
        p[i] = scores + (i0 + i) * hi;
        o[i] = acc + (i0 + i) * D;
      }
      with_heads(hn, [&](auto c) {
        constexpr int HN = decltype(c)::value;
        const int P = std::min(chunks, value_chunks(HN, D));  // this block's register block
        for (int64_t d = d0; d < d0 + 16 * chunks; d += 16 * P)
          values_pass<HN>(P, p, n + i0, values, d, D, o);
      });
    }
  }
#endif

  // out[i] = softmax(q[i] . K[0, n[i])^T) V[0, n[i]), in float32, on this thread.
  void run() const {
#if defined(__AVX512F__)
    if (vector()) {
      shared_scores(0, shared_groups());
      tails_and_softmax();
      // Each head block at its own register block (value_chunks(hn, D) <= value_chunks(8, D)
      // only when hn > 4, so the widest is asked and each block clamps it).
      const int chunks = value_chunks(1, D);
      value_sums(chunks, 0, value_units(chunks));
      return;
    }
#endif
    for (int64_t i = 0; i < QN; ++i) {
      float* si = scores + i * hi;
      for (int64_t t = 0; t < n[i]; ++t) {
        float dot = 0.f;
        for (int64_t d = 0; d < D; ++d) dot += qf[i * D + d] * to_f(keys[t][d]);
        si[t] = dot;
      }
      if (softcap > 0.f) softcap_in_place(si, n[i], softcap);
      softmax_in_place(si, n[i], sinks != nullptr ? sinks[i] : -INFINITY);
      float* ai = acc + i * D;
      std::fill(ai, ai + D, 0.f);
      for (int64_t t = 0; t < n[i]; ++t)
        for (int64_t d = 0; d < D; ++d) ai[d] += si[t] * to_f(values[t][d]);
    }
  }

  // run()'s result with the shared scores and the value sums split between `threads` threads
  // (called outside a parallel region).
  void run_split(int64_t threads) const {
#if defined(__AVX512F__)
    if (vector()) {
      const int64_t groups = shared_groups();
      at::parallel_for(0, groups, std::max<int64_t>(1, (groups + threads - 1) / threads),
                       [&](int64_t g0, int64_t g1) { shared_scores(g0, g1); });
      tails_and_softmax();
      int chunks = value_chunks(1, D);  // narrower passes until every thread has a unit
      while (chunks > 1 && value_units(chunks) < threads) chunks /= 2;
      const int64_t units = value_units(chunks);
      at::parallel_for(0, units, std::max<int64_t>(1, (units + threads - 1) / threads),
                       [&](int64_t u0, int64_t u1) { value_sums(chunks, u0, u1); });
      return;
    }
#endif
    (void)threads;
    run();
  }
};

// A job's work (decode_kernel's job_work units) from which a job alone splits between threads:
// Gemma 3's one KV head (4 query heads, D 256) from 256 tokens of context. Measured on a Zen 4
// (2 threads, a cold cache): 64 and 128 tokens about even, 256 75 -> 56 us, 512 111 -> 66,
// 1024 195 -> 103, 4096 800 -> 391.
constexpr int64_t kSplitJobWork = int64_t(1) << 21;

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define LADLE_ATTENTION_TILES 1
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define LADLE_ATTENTION_AMX 1
#endif
// Prefill in tiles, outside batch-invariant mode: a run of at least kTileRunRows consecutive
// rows of one sequence (a prefill chunk sent here as rows, each row the next position) attends
// as blocks of 16 queries. Per KV head its keys become B tiles of 16 keys (pack_keys) and its
// values B tiles of 16 dimensions (pack_values), once for all its query heads; per (query head,
// 16 queries) the scores S = Q K^T come from the tiles in float32, each query's softmax over its
// own context is taken in float32, and O = P V comes from the tiles again, divided by the
// softmax's sum. Two units run the products:
// - the tile unit (AMX-BF16), where the CPU has one and set_attention_amx allows it: P as two
//   bfloat16 parts, both multiplied by the V tiles;
// - else AVX512-BF16 (a Zen 4): S by vdpbf16ps over the same packed keys, a tile row at a time
//   (vector_scores), and O by float32 fmas of P with each packed row of V widened
//   (vector_values).
// The row kernel above sums each query's keys in its own fixed order; here the products are a
// unit's, so a query's value depends on the run it came in and the unit: the decode rows and
// batch-invariant mode keep the row kernel. Measured on a 2-core Sapphire Rapids-class Xeon
// (KVM), Qwen3-0.6B heads (16 query, 8 KV, D 128), one fresh causal prompt, ms per layer, row
// kernel / tile unit: 128 tokens 0.85-1.07 / 0.30-0.35, 512 8.9 / 2.1, 1024 33 / 7.0, 2048 147 /
// 31 (torch's SDPA: 1024 7.6, 2048 22, 4096 79: past ~1500 tokens each query block's pass over
// the packed keys and values runs from L3, where SDPA's blocks stay in L2, so chunks past
// cpu_kernels.PREFILL_KERNEL_MAX_CTX keep SDPA). P as one bfloat16 part ran 128 tokens in 0.16
// against the rows' 0.63 but moved Gemma 3 270M's int8 top-1 agreement with bf16 (gguf_accuracy)
// from 95.3% to 94.9%; with two parts it is 96.1%. The 0.6B's TTFT in process, tiles off / on
// (alternating): bf16 128 tokens 128 / 115 ms, int8 88 / 77, bf16 1000 tokens 1447 / 715. The
// vector unit on that Xeon (its tile unit off; benchmarks/attention_tiles.py, rows / vector /
// tile unit, ms per layer): the 0.6B's heads 128 tokens 0.48 / 0.36 / 0.17, 1024 24.7 / 16.4 /
// 5.5; Gemma 3's one KV head 128 0.37 / 0.17 / 0.07, 1024 21.9 / 9.4 / 3.4 (the two-part P by
// vdpbf16ps there: 0.58 ms at the 0.6B's 128 tokens, slower than the rows' 0.46).
constexpr int64_t kTileRunRows = 16;
// Runs past this context keep the row kernel: the packed keys and values of a run take 4 bytes
// per key, dimension and KV head (8 MiB for the 0.6B's 8 heads of 128 at 2048), and SDPA,
// which takes prefill chunks past cpu_kernels.PREFILL_KERNEL_MAX_CTX, is faster there anyway
// (what still arrives: speculative verification rows of 16 or more drafts).
constexpr int64_t kTileMaxContext = 2048;

// Token t's row of KV head h in a cache (num_blocks, KVH, bs, D) through a sequence's blocks.
static inline const at::BFloat16* cache_row(const at::BFloat16* cache, const int64_t* blocks,
                                            int64_t t, int64_t bs, int64_t KVH, int64_t D,
                                            int64_t h) {
  return cache + ((blocks[t / bs] * KVH + h) * bs + t % bs) * D;
}

// Keys 0 .. n - 1 of head h as B tiles of S = Q K^T: tile (kb, c) holds keys 16 kb .. 16 kb + 15
// by dimensions 32 c .. 32 c + 31, row p the pair of dimensions 2p, 2p + 1 of each key (dword
// t: key 16 kb + t); keys past n are zero.
static void pack_keys(const at::BFloat16* kc, const int64_t* blocks, int64_t n, int64_t bs,
                      int64_t KVH, int64_t D, int64_t h, uint32_t* out) {
  const int64_t chunks = D / 32;
  for (int64_t kb = 0; kb < (n + 15) / 16; kb++) {
    const at::BFloat16* rows[16];
    for (int i = 0; i < 16; i++)
      rows[i] = 16 * kb + i < n ? cache_row(kc, blocks, 16 * kb + i, bs, KVH, D, h) : nullptr;
    for (int64_t c = 0; c < chunks; c++) {
      __m512 r[16];  // (16 dwords of a key: pairs of bfloat16, moved as floats' bits)
      for (int i = 0; i < 16; i++)
        r[i] = rows[i] ? _mm512_loadu_ps(reinterpret_cast<const float*>(rows[i] + 32 * c))
                       : _mm512_setzero_ps();
      transpose16(r);
      uint32_t* tile = out + (kb * chunks + c) * 256;
      for (int p = 0; p < 16; p++) _mm512_store_ps(reinterpret_cast<float*>(tile + 16 * p), r[p]);
    }
  }
}

// Values 0 .. n - 1 of head h as B tiles of O = P V: tile (kc, g) holds keys 32 kc .. 32 kc + 31
// by dimensions 16 g .. 16 g + 15, row p keys 32 kc + 2p and + 1 (dword d: dimension 16 g + d of
// the pair, the first key in the low half); keys past n are zero.
static void pack_values(const at::BFloat16* vc, const int64_t* blocks, int64_t n, int64_t bs,
                        int64_t KVH, int64_t D, int64_t h, uint32_t* out) {
  const int64_t groups = D / 16;
  for (int64_t kc = 0; kc < (n + 31) / 32; kc++)
    for (int p = 0; p < 16; p++) {
      const int64_t t0 = 32 * kc + 2 * p, t1 = t0 + 1;
      const at::BFloat16* r0 = t0 < n ? cache_row(vc, blocks, t0, bs, KVH, D, h) : nullptr;
      const at::BFloat16* r1 = t1 < n ? cache_row(vc, blocks, t1, bs, KVH, D, h) : nullptr;
      for (int64_t g = 0; g < groups; g++) {
        const __m512i lo = r0 ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                    reinterpret_cast<const __m256i*>(r0 + 16 * g)))
                              : _mm512_setzero_si512();
        const __m512i hi = r1 ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                    reinterpret_cast<const __m256i*>(r1 + 16 * g)))
                              : _mm512_setzero_si512();
        _mm512_store_si512(out + ((kc * groups + g) * 16 + p) * 16,
                           _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
      }
    }
}

static std::atomic<bool> g_attention_amx{true};
static std::atomic<int64_t> g_tile_rows{0};  // attention_tile_rows()

// Whether tile_run takes the tile unit: the CPU has one, the process may use it, and
// set_attention_amx did not turn it off.
static bool attention_amx() {
#if defined(LADLE_ATTENTION_AMX)
  return g_attention_amx.load(std::memory_order_relaxed) && amx_permitted();
#else
  return false;
#endif
}

// The vector unit's scores: rows [0, nq) of qb (16 x D; nq a multiple of 4, rows past the
// block's zero) against key blocks kb0 .. kb0 + NB - 1 of the packed keys kp into s (row
// stride L floats), 4 queries x NB blocks of 16 keys per pass, one vdpbf16ps per (query, block,
// pair of dimensions) with the query's pair broadcast.
template <int NB>
static inline void vector_scores(const at::BFloat16* qb, const uint32_t* kp, int64_t kb0,
                                 int64_t nq, int64_t chunks, int64_t D, float* s, int64_t L) {
  for (int64_t i0 = 0; i0 < nq; i0 += 4) {
    __m512 acc[4][NB];
    for (int j = 0; j < 4; j++)
      for (int k = 0; k < NB; k++) acc[j][k] = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; c++) {
      const uint32_t* qd[4];
      for (int j = 0; j < 4; j++)
        qd[j] = reinterpret_cast<const uint32_t*>(qb + (i0 + j) * D + 32 * c);
      const uint32_t* kt = kp + (kb0 * chunks + c) * 256;
      for (int p = 0; p < 16; p++) {
        __m512bh b[4];
        for (int j = 0; j < 4; j++) b[j] = (__m512bh)_mm512_set1_epi32(qd[j][p]);
        for (int k = 0; k < NB; k++) {
          const __m512bh row = (__m512bh)_mm512_load_si512(kt + k * chunks * 256 + 16 * p);
          for (int j = 0; j < 4; j++) acc[j][k] = _mm512_dpbf16_ps(acc[j][k], b[j], row);
        }
      }
    }
    for (int j = 0; j < 4; j++)
      for (int k = 0; k < NB; k++) _mm512_storeu_ps(s + (i0 + j) * L + 16 * (kb0 + k), acc[j][k]);
  }
}

// The vector unit's O for groups g0 .. g0 + NG - 1 of 16 dimensions: rows [0, nr) of the
// softmax's float32 numerators e (16 x L, zero past each row's keys) times the packed values vp,
// 4 queries x NG groups per pass: each packed row (two keys' values) widened to float32 and
// summed by one fma per (query, group, key); each row scaled by inv and stored as bfloat16.
template <int NG>
static inline void vector_values(const float* e, const uint32_t* vp, int64_t g0, int64_t groups,
                                 int64_t L, int64_t nr, const float* inv,
                                 at::BFloat16* const* outs) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t i0 = 0; i0 < nr; i0 += 4) {
    __m512 acc[4][NG];
    for (int j = 0; j < 4; j++)
      for (int g = 0; g < NG; g++) acc[j][g] = _mm512_setzero_ps();
    for (int64_t kc = 0; kc < L / 32; kc++) {
      const uint32_t* vt = vp + (kc * groups + g0) * 256;
      for (int pp = 0; pp < 16; pp++) {
        const int64_t t = 32 * kc + 2 * pp;  // keys t (low halves) and t + 1 (high halves)
        __m512 a0[4], a1[4];
        for (int j = 0; j < 4; j++) {
          a0[j] = _mm512_set1_ps(e[(i0 + j) * L + t]);
          a1[j] = _mm512_set1_ps(e[(i0 + j) * L + t + 1]);
        }
        for (int g = 0; g < NG; g++) {
          const __m512i row = _mm512_load_si512(vt + 256 * g + 16 * pp);
          const __m512 v0 = _mm512_castsi512_ps(_mm512_slli_epi32(row, 16));
          const __m512 v1 = _mm512_castsi512_ps(_mm512_and_si512(row, high));
          for (int j = 0; j < 4; j++) {
            acc[j][g] = _mm512_fmadd_ps(a0[j], v0, acc[j][g]);
            acc[j][g] = _mm512_fmadd_ps(a1[j], v1, acc[j][g]);
          }
        }
      }
    }
    for (int j = 0; j < 4 && i0 + j < nr; j++) {
      const __m512 sc = _mm512_set1_ps(inv[i0 + j]);
      for (int g = 0; g < NG; g++)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(outs[i0 + j] + 16 * (g0 + g)),
                            reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(
                                _mm512_mul_ps(acc[j][g], sc))));
    }
  }
}

#if defined(LADLE_ATTENTION_AMX)
// Scores of 16 queries (qb: 16 x D) against one block of 16 packed keys kt into C tile 4, or 5
// when `odd` (consecutive blocks alternate, so one's store overlaps the next one's products),
// then to out (row stride ld floats); A tiles 0 / 1 and B tiles 2 / 3 by chunk of 32 dimensions.
// (The tile intrinsics take their tile numbers as literals.)
static inline void tile_scores(const at::BFloat16* qb, const uint32_t* kt, int64_t chunks,
                               int64_t D, float* out, int64_t ld, bool odd) {
  if (odd) _tile_zero(5); else _tile_zero(4);
  for (int64_t c = 0; c < chunks; c += 2) {
    _tile_loadd(0, qb + 32 * c, D * 2);
    _tile_loadd(2, kt + c * 256, 64);
    if (odd) _tile_dpbf16ps(5, 0, 2); else _tile_dpbf16ps(4, 0, 2);
    if (c + 1 < chunks) {
      _tile_loadd(1, qb + 32 * (c + 1), D * 2);
      _tile_loadd(3, kt + (c + 1) * 256, 64);
      if (odd) _tile_dpbf16ps(5, 1, 3); else _tile_dpbf16ps(4, 1, 3);
    }
  }
  if (odd) _tile_stored(5, out, ld * 4); else _tile_stored(4, out, ld * 4);
}
#endif

// One block of up to 16 queries of query head hq: rows b0 .. b0 + nr - 1, row i attending keys
// 0 .. ctx[b0 + i] - 1 of the packed keys and values kp, vp; on the tile unit (kAmx: the tile
// configuration loaded) or the vector unit.
struct TileScratch {
  std::vector<float> s;                 // 16 x L scores
  std::vector<at::BFloat16> p, lo, qb;  // 16 x L probabilities, high and low parts; 16 x D queries
};

template <bool kAmx>
static void tile_query_block(const at::BFloat16* q, at::BFloat16* out, const int64_t* ctx,
                             int64_t b0, int64_t nr, int64_t H, int64_t hq, int64_t D,
                             const uint32_t* kp, const uint32_t* vp, float scale,
                             TileScratch& w) {
  const int64_t n = ctx[b0 + nr - 1];   // the block's longest context (its last row)
  const int64_t L = (n + 31) / 32 * 32, kbs = (n + 15) / 16, chunks = D / 32, groups = D / 16;
  w.s.resize(16 * L);
  w.p.resize(16 * L);
  w.lo.resize(16 * L);
  w.qb.resize(16 * D);
  at::BFloat16* qb = w.qb.data();
  for (int64_t i = 0; i < 16; i++) {
    if (i < nr)
      std::memcpy(qb + i * D, q + ((b0 + i) * H + hq) * D, sizeof(at::BFloat16) * D);
    else
      std::memset(qb + i * D, 0, sizeof(at::BFloat16) * D);
  }
  float* s = w.s.data();
  if constexpr (kAmx) {
#if defined(LADLE_ATTENTION_AMX)
    // S, 16 keys at a time: C tiles 4 / 5 by key block parity.
    for (int64_t kb = 0; kb < kbs; kb++)
      tile_scores(qb, kp + kb * chunks * 256, chunks, D, s + 16 * kb, L, kb & 1);
#endif
  } else {  // S, 4 blocks of 16 keys at a time, then the last 1-3
    const int64_t nq = (nr + 3) / 4 * 4;
    int64_t kb = 0;
    for (; kb + 4 <= kbs; kb += 4) vector_scores<4>(qb, kp, kb, nq, chunks, D, s, L);
    for (; kb < kbs; kb++) vector_scores<1>(qb, kp, kb, nq, chunks, D, s, L);
  }
  // P: each row's softmax numerators e over its own keys (zero past them); for the tile unit as
  // two bfloat16 parts, hi = bf16(e) and lo = bf16(e - hi), whose products with V the C tiles
  // add: P to ~16 bits (bfloat16 alone, 8, cost Gemma 3 270M one of 256 int8 top-1 agreements
  // with bf16); for the vector unit e in float32, in place of the scores. O is divided by the
  // float32 sum of e.
  float inv[16];
  at::BFloat16* p = w.p.data();
  at::BFloat16* lo = w.lo.data();
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < 16; i++) {
    uint16_t* pi = reinterpret_cast<uint16_t*>(p + i * L);
    uint16_t* li = reinterpret_cast<uint16_t*>(lo + i * L);
    if (i >= nr) {
      inv[i] = 0.f;
      if constexpr (!kAmx) {  // (vector_values reads rows in fours)
        std::memset(s + i * L, 0, sizeof(float) * L);
        continue;
      }
      std::memset(pi, 0, sizeof(uint16_t) * L);
      std::memset(li, 0, sizeof(uint16_t) * L);
      continue;
    }
    float* si = s + i * L;
    const int64_t len = ctx[b0 + i];
    __m512 vm = _mm512_set1_ps(-INFINITY);
    int64_t t = 0;
    for (; t + 16 <= len; t += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(si + t));
    const __mmask16 tail = static_cast<__mmask16>((1u << (len - t)) - 1);
    if (t < len) vm = _mm512_mask_max_ps(vm, tail, vm, _mm512_maskz_loadu_ps(tail, si + t));
    const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(vm));
    __m512 sum = _mm512_setzero_ps();
    auto put = [&](int64_t at, __m512 e) {
      sum = _mm512_add_ps(sum, e);
      if constexpr (!kAmx) {  // the vector unit sums float32 e
        _mm512_storeu_ps(si + at, e);
        return;
      }
      const __m256i hi = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(e));
      const __m512 back = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pi + at), hi);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(li + at),
                          reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_sub_ps(e, back))));
    };
    for (t = 0; t + 16 <= len; t += 16)
      put(t, exp16(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(si + t), mx), vscale)));
    if (t < len) {
      put(t, _mm512_maskz_mov_ps(tail, exp16(_mm512_mul_ps(
                                           _mm512_sub_ps(_mm512_loadu_ps(si + t), mx), vscale))));
      t += 16;
    }
    for (; t < L; t += 16) {
      if constexpr (!kAmx) {
        _mm512_storeu_ps(si + t, _mm512_setzero_ps());
        continue;
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pi + t), _mm256_setzero_si256());
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(li + t), _mm256_setzero_si256());
    }
    inv[i] = 1.f / _mm512_reduce_add_ps(sum);
  }
  if constexpr (!kAmx) {  // O, 4 groups of 16 dimensions at a time (D / 16 is even)
    at::BFloat16* outs[16];
    for (int64_t i = 0; i < nr; i++) outs[i] = out + ((b0 + i) * H + hq) * D;
    int64_t g0 = 0;
    for (; g0 + 4 <= groups; g0 += 4) vector_values<4>(s, vp, g0, groups, L, nr, inv, outs);
    if (g0 < groups) vector_values<2>(s, vp, g0, groups, L, nr, inv, outs);
    return;
  }
#if defined(LADLE_ATTENTION_AMX)
  // O, four groups of 16 dimensions at a time in C tiles 4 .. 7; A (P's parts) in 0 and 1, B in
  // 2 / 3, each V tile used by both parts.
  alignas(64) float o[4][16][16];
  for (int64_t g0 = 0; g0 < groups; g0 += 4) {
    const int64_t ng = std::min<int64_t>(4, groups - g0);
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    for (int64_t kc = 0; kc < L / 32; kc++) {
      const uint32_t* vt = vp + (kc * groups + g0) * 256;
      _tile_loadd(0, p + 32 * kc, L * 2);
      _tile_loadd(1, lo + 32 * kc, L * 2);
// Group j's V tile (at vt + 256 j) into B tile TB, times both parts of P into C tile TC. (A
// macro: the tile intrinsics take their tile numbers as literals.)
#define LADLE_PV_GROUP(TC, TB, j)           \
  do {                                      \
    _tile_loadd(TB, vt + 256 * (j), 64);    \
    _tile_dpbf16ps(TC, 0, TB);              \
    _tile_dpbf16ps(TC, 1, TB);              \
  } while (0)
      LADLE_PV_GROUP(4, 2, 0);
      if (ng > 1) LADLE_PV_GROUP(5, 3, 1);
      if (ng > 2) LADLE_PV_GROUP(6, 2, 2);
      if (ng > 3) LADLE_PV_GROUP(7, 3, 3);
#undef LADLE_PV_GROUP
    }
    _tile_stored(4, o[0], 64);  // (a vector load waits behind a pending tile store: all first)
    if (ng > 1) _tile_stored(5, o[1], 64);
    if (ng > 2) _tile_stored(6, o[2], 64);
    if (ng > 3) _tile_stored(7, o[3], 64);
    for (int64_t i = 0; i < nr; i++) {
      const __m512 sc = _mm512_set1_ps(inv[i]);
      at::BFloat16* oi = out + ((b0 + i) * H + hq) * D + 16 * g0;
      for (int64_t j = 0; j < ng; j++)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(oi + 16 * j),
                            reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(
                                _mm512_mul_ps(_mm512_load_ps(o[j][i]), sc))));
    }
  }
#endif
}

// Rows b0 .. b0 + rows - 1: one sequence's consecutive positions (ctx[b0 + i] = ctx[b0] + i, the
// blocks of row b0 + rows - 1 hold them all), no window cutting them, no soft-cap or sinks.
static void tile_run(const at::BFloat16* q, const at::BFloat16* kc, const at::BFloat16* vc,
                     const int64_t* blocks, const int64_t* ctx, at::BFloat16* out, int64_t b0,
                     int64_t rows, int64_t H, int64_t KVH, int64_t D, int64_t bs, float scale) {
  const int64_t n = ctx[b0 + rows - 1], G = H / KVH;
  const int64_t kstride = (n + 15) / 16 * (D / 32) * 256, vstride = (n + 31) / 32 * (D / 16) * 256;
  auto packed = at::empty({KVH * (kstride + vstride)}, at::kInt);
  uint32_t* kp = reinterpret_cast<uint32_t*>(packed.data_ptr<int32_t>());
  uint32_t* vp = kp + KVH * kstride;
  at::parallel_for(0, KVH, 1, [&](int64_t h0, int64_t h1) {
    for (int64_t h = h0; h < h1; h++) {
      pack_keys(kc, blocks, n, bs, KVH, D, h, kp + h * kstride);
      pack_values(vc, blocks, n, bs, KVH, D, h, vp + h * vstride);
    }
  });
  const int64_t qblocks = (rows + 15) / 16;
  const bool amx = attention_amx();
  at::parallel_for(0, H * qblocks, 1, [&](int64_t u0, int64_t u1) {
#if defined(LADLE_ATTENTION_AMX)
    static const TileShapes shapes;
    if (amx) _tile_loadconfig(&shapes);
#endif
    TileScratch w;
    for (int64_t u = u0; u < u1; u++) {
      const int64_t hq = u / qblocks, qb = u % qblocks, h = hq / G;
      const int64_t nr = std::min<int64_t>(16, rows - 16 * qb);
      if (amx)
        tile_query_block<true>(q, out, ctx, b0 + 16 * qb, nr, H, hq, D, kp + h * kstride,
                               vp + h * vstride, scale, w);
      else
        tile_query_block<false>(q, out, ctx, b0 + 16 * qb, nr, H, hq, D, kp + h * kstride,
                                vp + h * vstride, scale, w);
    }
#if defined(LADLE_ATTENTION_AMX)
    if (amx) _tile_release();
#endif
  });
}
#endif

template <typename T>
static void decode_kernel(const T* q, const T* kc, const T* vc, const int64_t* bt,
                          const int64_t* ctx, T* out, int64_t B, int64_t H, int64_t KVH,
                          int64_t D, int64_t bs, int64_t max_blocks, float scale, int64_t window,
                          float softcap, const float* sinks, bool tiles) {
  const int64_t G = H / KVH;
#if defined(LADLE_ATTENTION_TILES)
  // `tiles`: runs of kTileRunRows or more rows attend on the tile unit (tile_run), the other
  // rows below, gathered into a call of their own.
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (tiles && softcap == 0.f && sinks == nullptr && D % 32 == 0 && D <= 256) {
      std::vector<std::pair<int64_t, int64_t>> runs;  // (first row, rows)
      std::vector<int64_t> rest;
      for (int64_t b = 0; b < B;) {
        int64_t r = 1;  // as the groups below: row b + r's blocks begin with row b's
        while (b + r < B && ctx[b + r] == ctx[b] + r &&
               std::memcmp(bt + b * max_blocks, bt + (b + r) * max_blocks,
                           sizeof(int64_t) * ((ctx[b + r] + bs - 1) / bs)) == 0)
          ++r;
        const int64_t n = ctx[b + r - 1];
        if (r >= kTileRunRows && n <= kTileMaxContext && (window <= 0 || n <= window))
          runs.emplace_back(b, r);
        else
          for (int64_t i = b; i < b + r; i++) rest.push_back(i);
        b += r;
      }
      if (!runs.empty()) {
        for (const auto& [b0, rows] : runs) {
          g_tile_rows.fetch_add(rows, std::memory_order_relaxed);
          tile_run(q, kc, vc, bt + (b0 + rows - 1) * max_blocks, ctx, out, b0, rows, H, KVH, D,
                   bs, scale);
        }
        const int64_t R = static_cast<int64_t>(rest.size()), row = H * D;
        if (R == 0) return;
        std::vector<T> q2(R * row), out2(R * row);
        std::vector<int64_t> bt2(R * max_blocks), ctx2(R);
        for (int64_t i = 0; i < R; i++) {
          std::memcpy(q2.data() + i * row, q + rest[i] * row, sizeof(T) * row);
          std::memcpy(bt2.data() + i * max_blocks, bt + rest[i] * max_blocks,
                      sizeof(int64_t) * max_blocks);
          ctx2[i] = ctx[rest[i]];
        }
        decode_kernel<T>(q2.data(), kc, vc, bt2.data(), ctx2.data(), out2.data(), R, H, KVH, D,
                         bs, max_blocks, scale, window, softcap, sinks, false);
        for (int64_t i = 0; i < R; i++)
          std::memcpy(out + rest[i] * row, out2.data() + i * row, sizeof(T) * row);
        return;
      }
    }
  }
#else
  (void)tiles;
#endif
  // Cache layout: (num_blocks, KVH, bs, D); one block of one head is bs*D contiguous values.
  // Per (group of rows, KV head): the scores of every cached key for the query heads sharing it,
  // the softmax, then the weighted sum of the values. With a sliding window (window > 0) a row
  // reads only its last `window` tokens: the walk starts in the block holding the first of them.
  auto first_token = [&](int64_t n) {
    return window > 0 ? std::max<int64_t>(0, n - window) : int64_t(0);
  };
  // Groups: rows r + 1 .. of one sequence (context one longer each, the same blocks) join row
  // r's group while every row reads from token 0 and the group has at most 8 query heads per KV
  // head; a decode step's rows are groups of one. groups[i] is group i's first row; follows[i]:
  // group i reads the keys of group i - 1 and more (the same sequence, the next rows).
  std::vector<int64_t> groups;
  std::vector<char> follows;
  const int64_t max_rows = std::max<int64_t>(1, 8 / G);
  auto same_blocks = [&](int64_t a, int64_t b) {  // row b's blocks start with row a's
    return std::memcmp(bt + a * max_blocks, bt + b * max_blocks,
                       sizeof(int64_t) * ((ctx[a] + bs - 1) / bs)) == 0;
  };
  for (int64_t b = 0; b < B;) {
    follows.push_back(b > 0 && same_blocks(b - 1, b));
    groups.push_back(b);
    int64_t r = 1;
    while (b + r < B && r < max_rows && ctx[b + r] == ctx[b] + r && first_token(ctx[b + r]) == 0 &&
           std::memcmp(bt + b * max_blocks, bt + (b + r) * max_blocks,
                       sizeof(int64_t) * ((ctx[b + r] + bs - 1) / bs)) == 0)
      ++r;
    b += r;
  }
  const int64_t num_groups = static_cast<int64_t>(groups.size());
  groups.push_back(B);
  // Work per job in grain_for's units (a multiply-add streaming weights from memory): each
  // multiply-add here also reads a cached key or value that is usually not in cache, about 4x
  // the cost (measured: 8 heads x 160 tokens x G=2, D=128 take ~55 us with a cold cache).
  int64_t total_ctx = 0;
  for (int64_t b = 0; b < B; ++b) total_ctx += ctx[b] - first_token(ctx[b]);
  const int64_t job_work =
      std::max<int64_t>(1, total_ctx / std::max<int64_t>(1, num_groups)) * G * D * 2 * 4;
  struct Scratch {
    std::vector<float> qf, acc, scores;
    std::vector<at::BFloat16> qb;
    std::vector<int64_t> lens;
    std::vector<const T*> keys, values;
  };
  // One job; `split`: its attention's phases shared by that many threads (Attend::run_split),
  // else on this thread, prefetching job `next`'s keys and values (-1: none) into L2 meanwhile.
  auto run_job = [&](int64_t job, int64_t next, int64_t split, Scratch& w) {
    const int64_t grp = job % num_groups, h = job / num_groups;
    const int64_t b0 = groups[grp], rows = groups[grp + 1] - b0, QN = rows * G;
    // The group's rows share the blocks of its longest context n (its last row).
    const int64_t n = ctx[b0 + rows - 1], start = first_token(n), m = n - start;
#if defined(__AVX512F__)
    // The first keys and values of the next job into L2 while this one runs (the L2 stream
    // takes it from there), unless they are this job's.
    if (next >= 0 && !(grp + 1 < num_groups && follows[grp + 1])) {
      const int64_t g2 = next % num_groups, h2 = next / num_groups;
      const int64_t b2 = groups[g2 + 1] - 1;
      const int64_t bytes = bs * D * static_cast<int64_t>(sizeof(T));
      const int64_t start2 = first_token(ctx[b2]);
      const int64_t stop2 = std::min(ctx[b2], start2 + far_rows<T>(D));
      for (int64_t t0 = start2 - start2 % bs; t0 < stop2; t0 += bs) {
        const int64_t base = (bt[b2 * max_blocks + t0 / bs] * KVH + h2) * bs * D;
        const int64_t len = std::min<int64_t>(bytes, (ctx[b2] - t0) * D * sizeof(T));
        for (int64_t o = 0; o < len; o += 64) {
          _mm_prefetch(reinterpret_cast<const char*>(kc + base) + o, _MM_HINT_T1);
          _mm_prefetch(reinterpret_cast<const char*>(vc + base) + o, _MM_HINT_T1);
        }
      }
    }
#endif
    w.qf.resize(max_rows * G * D);
    w.acc.resize(max_rows * G * D);
    w.lens.resize(max_rows * G);
    w.scores.resize(QN * m);
    w.keys.resize(m);
    w.values.resize(m);
    // Block by block (no division per token); keys[i] is token start + i.
    const int64_t b = b0 + rows - 1;
    for (int64_t t0 = start - start % bs; t0 < n; t0 += bs) {
      const int64_t first = std::max(t0, start);
      const int64_t base = (bt[b * max_blocks + t0 / bs] * KVH + h) * bs * D;
      for (int64_t t = first, row = base + (first - t0) * D; t < std::min(n, t0 + bs);
           ++t, row += D) {
        w.keys[t - start] = kc + row;
        w.values[t - start] = vc + row;
      }
    }
    float head_sinks[8];
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t g = 0; g < G; ++g) {
        const int64_t i = r * G + g;
        w.lens[i] = m - (rows - 1 - r);  // row r's context, from the same first token
        if (sinks != nullptr && QN <= 8) head_sinks[i] = sinks[h * G + g];
        for (int64_t d = 0; d < D; ++d)
          w.qf[i * D + d] = to_f(q[((b0 + r) * H + h * G + g) * D + d]) * scale;
      }
    const float* sk = sinks == nullptr ? nullptr : QN <= 8 ? head_sinks : sinks + h * G;
    const at::BFloat16* qb = nullptr;
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      if (D % 32 == 0) {  // (key_scores' bf16 steps: 32 values)
        w.qb.resize(max_rows * G * D);
        for (int64_t r = 0; r < rows; ++r)
          std::memcpy(w.qb.data() + r * G * D, q + ((b0 + r) * H + h * G) * D,
                      sizeof(T) * G * D);
        qb = w.qb.data();
      }
    }
#endif
    const Attend<T> a(w.qf.data(), w.lens.data(), w.keys.data(), w.values.data(), QN, D,
                      w.scores.data(), w.acc.data(), softcap, sk, qb, scale);
    if (split > 1)
      a.run_split(split);
    else
      a.run();
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          out[((b0 + r) * H + h * G + g) * D + d] = static_cast<T>(w.acc[(r * G + g) * D + d]);
  };
  const int64_t jobs = num_groups * KVH, threads = at::get_num_threads();
  // Fewer jobs than threads (one sequence of a model with one or a few KV heads, e.g. Gemma 3's
  // one): each job's key scores and value sums are shared between the threads instead, job
  // after job, where a job is long enough to pay for the two parallel regions.
  if (2 * jobs <= threads && job_work >= kSplitJobWork && !at::in_parallel_region()) {
    Scratch w;
    for (int64_t job = 0; job < jobs; ++job) run_job(job, -1, threads, w);
    return;
  }
  // Jobs run head by head (job = h * num_groups + group): the groups of one prefill chunk then
  // follow each other on one KV head, whose keys and values stay in L2 between them.
  at::parallel_for(0, jobs, grain_for(job_work), [&](int64_t begin, int64_t end) {
    Scratch w;
    for (int64_t job = begin; job < end; ++job) run_job(job, job + 1 < end ? job + 1 : -1, 1, w);
  });
}

bool attention_tiles_available() {
#if defined(LADLE_ATTENTION_TILES)
  return true;
#else
  return false;
#endif
}

std::string attention_tiles_unit() {
#if defined(LADLE_ATTENTION_TILES)
  return attention_amx() ? "amx" : "avx512-bf16";
#else
  return "";
#endif
}

int64_t attention_tile_rows() {
#if defined(LADLE_ATTENTION_TILES)
  return g_tile_rows.load(std::memory_order_relaxed);
#else
  return 0;
#endif
}

bool set_attention_amx(bool on) {
#if defined(LADLE_ATTENTION_TILES)
  g_attention_amx.store(on);
  return attention_amx();
#else
  (void)on;
  return false;
#endif
}

at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                  at::Tensor block_table, at::Tensor ctx_lens,
                                  double scale, int64_t window, double softcap,
                                  c10::optional<at::Tensor> sinks, bool tiles) {
  // q: (B, H, D); caches: (num_blocks, KVH, bs, D); block_table: (B, max_blocks) int64.
  // window: attend to the last `window` tokens only (0: all); softcap: cap * tanh(s / cap) on
  // the scores (0: off); sinks: (H,) float32 logits joining each head's softmax (None: off).
  // tiles: runs of a prefill chunk's rows may attend on the tile unit (decode_kernel); false in
  // batch-invariant mode.
  auto out = at::empty_like(q);
  const float* sk = nullptr;
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->is_contiguous() &&
                    sinks->numel() == q.size(1), "paged_decode_attention: sinks must be (H,) float32");
    sk = sinks->data_ptr<float>();
  }
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = k_cache.size(1), bs = k_cache.size(2);
  if (q.scalar_type() == at::kBFloat16) {
    decode_kernel<at::BFloat16>(q.data_ptr<at::BFloat16>(), k_cache.data_ptr<at::BFloat16>(),
                                v_cache.data_ptr<at::BFloat16>(), block_table.data_ptr<int64_t>(),
                                ctx_lens.data_ptr<int64_t>(), out.data_ptr<at::BFloat16>(), B, H,
                                KVH, D, bs, block_table.size(1), (float)scale, window,
                                (float)softcap, sk, tiles);
  } else {
    decode_kernel<float>(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                         block_table.data_ptr<int64_t>(), ctx_lens.data_ptr<int64_t>(),
                         out.data_ptr<float>(), B, H, KVH, D, bs, block_table.size(1),
                         (float)scale, window, (float)softcap, sk, tiles);
  }
  return out;
}
