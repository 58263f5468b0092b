// Paged decode attention: one query token per sequence against its paged KV cache, with an
// optional sliding window, score soft-cap and per-head sink logit (gpt-oss). Its twin is decode_attention's torch path in
// ladle/runner/attention.py.
#include "kernels.h"
#include "vec.h"

#if defined(__AVX512F__)
// Cached rows this many tokens ahead are prefetched into L1, and each job prefetches the next
// job's keys and values into L2: a sequence's blocks lie anywhere in the cache, so the hardware
// prefetcher loses the stream at every block boundary. Measured on a Zen 4 at 32 sequences x
// 192 tokens (Qwen3-0.6B heads), with the vector softmax: 1.98 -> 1.35 ms per layer.
constexpr int64_t kPrefetchTokens = 8;

template <typename T>
static inline void prefetch_rows(const T* const* rows, int64_t begin, int64_t end, int64_t D) {
  for (int64_t t = begin; t < end; ++t)
    for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(T)); b += 64)
      _mm_prefetch(reinterpret_cast<const char*>(rows[t]) + b, _MM_HINT_T0);
}

// scores[t] = q . keys[t] for n keys (row pointers), four keys per shuffle-tree reduction.
template <typename T>
static inline void key_scores(const float* q, const T* const* keys, int64_t n, int64_t D,
                              float* scores) {
  int64_t t = 0;
  for (; t + 4 <= n; t += 4) {
    prefetch_rows(keys, t + kPrefetchTokens, std::min(n, t + kPrefetchTokens + 4), D);
    __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                   _mm512_setzero_ps()};
    for (int64_t d = 0; d < D; d += 16) {
      const __m512 qv = _mm512_loadu_ps(q + d);
      for (int j = 0; j < 4; ++j) a[j] = _mm512_fmadd_ps(qv, load16(keys[t + j] + d), a[j]);
    }
    _mm_storeu_ps(scores + t, hsum4(a));
  }
  for (; t < n; ++t) {
    __m512 a = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) a = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), load16(keys[t] + d), a);
    scores[t] = _mm512_reduce_add_ps(a);
  }
}

// out[g][d] = sum_t p[g][t] * values[t][d] for GB (1 or 2) heads and P chunks of 16 dims starting
// at d0: the GB * P accumulators stay in registers across all n values.
template <int GB, int P, typename T>
static inline void weighted_values(const float* p, int64_t n, const T* const* values,
                                   int64_t d0, float* out, int64_t D) {
  __m512 a[GB][P];
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < P; ++c) a[g][c] = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; ++t) {
    if (t + kPrefetchTokens < n) prefetch_rows(values, t + kPrefetchTokens, t + kPrefetchTokens + 1, D);
    __m512 pg[GB];
    for (int g = 0; g < GB; ++g) pg[g] = _mm512_set1_ps(p[g * n + t]);
    for (int c = 0; c < P; ++c) {
      const __m512 vv = load16(values[t] + d0 + 16 * c);
      for (int g = 0; g < GB; ++g) a[g][c] = _mm512_fmadd_ps(pg[g], vv, a[g][c]);
    }
  }
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < P; ++c) _mm512_storeu_ps(out + g * D + d0 + 16 * c, a[g][c]);
}

template <int P, typename T>
static void weighted_values_all(const float* p, int64_t n, const T* const* values, int64_t G,
                                int64_t D, float* out) {
  for (int64_t g = 0; g < G; g += 2)
    for (int64_t d0 = 0; d0 < D; d0 += 16 * P) {
      if (G - g >= 2) weighted_values<2, P>(p + g * n, n, values, d0, out + g * D, D);
      else weighted_values<1, P>(p + g * n, n, values, d0, out + g * D, D);
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

// One (sequence, KV head): out[g] = softmax(q[g] . K^T) V for its G query heads, in float32.
// qf: (G, D) queries already scaled; keys/values: row pointers of the n cached tokens; scores:
// (G, n) scratch; acc: (G, D) result; softcap > 0 caps the scores before the softmax; sinks:
// the G heads' sink logits, or null.
template <typename T>
static void attend(const float* qf, const T* const* keys, const T* const* values, int64_t n,
                   int64_t G, int64_t D, float* scores, float* acc, float softcap,
                   const float* sinks) {
#if defined(__AVX512F__)
  const bool vec = D % 16 == 0;
#else
  const bool vec = false;
#endif
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * n;
#if defined(__AVX512F__)
    if (vec) key_scores(qf + g * D, keys, n, D, sg);
#endif
    if (!vec)
      for (int64_t t = 0; t < n; ++t) {
        float dot = 0.f;
        for (int64_t d = 0; d < D; ++d) dot += qf[g * D + d] * to_f(keys[t][d]);
        sg[t] = dot;
      }
    if (softcap > 0.f) softcap_in_place(sg, n, softcap);
    softmax_in_place(sg, n, sinks != nullptr ? sinks[g] : -INFINITY);
  }
#if defined(__AVX512F__)
  if (vec) {
    if (D % 128 == 0) return weighted_values_all<8>(scores, n, values, G, D, acc);
    if (D % 64 == 0) return weighted_values_all<4>(scores, n, values, G, D, acc);
    if (D % 32 == 0) return weighted_values_all<2>(scores, n, values, G, D, acc);
    return weighted_values_all<1>(scores, n, values, G, D, acc);
  }
#endif
  std::fill(acc, acc + G * D, 0.f);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t g = 0; g < G; ++g)
      for (int64_t d = 0; d < D; ++d) acc[g * D + d] += scores[g * n + t] * to_f(values[t][d]);
}

template <typename T>
static void decode_kernel(const T* q, const T* kc, const T* vc, const int64_t* bt,
                          const int64_t* ctx, T* out, int64_t B, int64_t H, int64_t KVH,
                          int64_t D, int64_t bs, int64_t max_blocks, float scale, int64_t window,
                          float softcap, const float* sinks) {
  const int64_t G = H / KVH;
  // Cache layout: (num_blocks, KVH, bs, D); one block of one head is bs*D contiguous values.
  // Per (sequence, KV head): the scores of every cached key for the G query heads sharing it,
  // the softmax, then the weighted sum of the values; each key and value is read once per pair
  // of query heads. With a sliding window (window > 0) a sequence reads only its last `window`
  // tokens: the walk starts in the block holding the first of them.
  auto first_token = [&](int64_t n) {
    return window > 0 ? std::max<int64_t>(0, n - window) : int64_t(0);
  };
  // Work per job in grain_for's units (a multiply-add streaming weights from memory): each
  // multiply-add here also reads a cached key or value that is usually not in cache, about 4x
  // the cost (measured: 8 heads x 160 tokens x G=2, D=128 take ~55 us with a cold cache).
  int64_t total_ctx = 0;
  for (int64_t b = 0; b < B; ++b) total_ctx += ctx[b] - first_token(ctx[b]);
  const int64_t job_work =
      std::max<int64_t>(1, total_ctx / std::max<int64_t>(1, B)) * G * D * 2 * 4;
  at::parallel_for(0, B * KVH, grain_for(job_work), [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), scores;
    std::vector<const T*> keys, values;
    for (int64_t job = begin; job < end; ++job) {
      const int64_t b = job / KVH, h = job % KVH;
      const int64_t n = ctx[b], start = first_token(n), m = n - start;
#if defined(__AVX512F__)
      if (job + 1 < end) {  // the next job's keys and values into L2 while this one runs
        const int64_t nb = job + 1, b2 = nb / KVH, h2 = nb % KVH;
        const int64_t bytes = bs * D * static_cast<int64_t>(sizeof(T));
        const int64_t start2 = first_token(ctx[b2]);
        for (int64_t t0 = start2 - start2 % bs; t0 < ctx[b2]; t0 += bs) {
          const int64_t base = (bt[b2 * max_blocks + t0 / bs] * KVH + h2) * bs * D;
          const int64_t len = std::min<int64_t>(bytes, (ctx[b2] - t0) * D * sizeof(T));
          for (int64_t o = 0; o < len; o += 64) {
            _mm_prefetch(reinterpret_cast<const char*>(kc + base) + o, _MM_HINT_T1);
            _mm_prefetch(reinterpret_cast<const char*>(vc + base) + o, _MM_HINT_T1);
          }
        }
      }
#endif
      scores.resize(G * m);
      keys.resize(m);
      values.resize(m);
      // Block by block (no division per token); keys[i] is token start + i.
      for (int64_t t0 = start - start % bs; t0 < n; t0 += bs) {
        const int64_t first = std::max(t0, start);
        const int64_t base = (bt[b * max_blocks + t0 / bs] * KVH + h) * bs * D;
        for (int64_t t = first, row = base + (first - t0) * D; t < std::min(n, t0 + bs);
             ++t, row += D) {
          keys[t - start] = kc + row;
          values[t - start] = vc + row;
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          qf[g * D + d] = to_f(q[(b * H + h * G + g) * D + d]) * scale;
      attend(qf.data(), keys.data(), values.data(), m, G, D, scores.data(), acc.data(), softcap,
             sinks != nullptr ? sinks + h * G : nullptr);
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          out[(b * H + h * G + g) * D + d] = static_cast<T>(acc[g * D + d]);
    }
  });
}

at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                  at::Tensor block_table, at::Tensor ctx_lens,
                                  double scale, int64_t window, double softcap,
                                  c10::optional<at::Tensor> sinks) {
  // q: (B, H, D); caches: (num_blocks, KVH, bs, D); block_table: (B, max_blocks) int64.
  // window: attend to the last `window` tokens only (0: all); softcap: cap * tanh(s / cap) on
  // the scores (0: off); sinks: (H,) float32 logits joining each head's softmax (None: off).
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
                                (float)softcap, sk);
  } else {
    decode_kernel<float>(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                         block_table.data_ptr<int64_t>(), ctx_lens.data_ptr<int64_t>(),
                         out.data_ptr<float>(), B, H, KVH, D, bs, block_table.size(1),
                         (float)scale, window, (float)softcap, sk);
  }
  return out;
}
