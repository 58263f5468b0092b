// CPU kernels for ladle's decode path, built once per (source, flags, CPU) by cpu_kernels.py.
// Each function here has a pure-torch twin in ladle/runner/cpu_kernels.py that tests compare it
// with. Built with -march=native: the AVX-512 (and AVX512-BF16) paths are chosen by the compiler
// macros of the CPU the build is for; every function also has a portable scalar loop.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

static inline float to_f(float x) { return x; }
static inline float to_f(at::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// The grain (items per task) that gives each task at least kMinTaskWork units of work (about a
// multiply-add each; 2^20 is ~15 us on one core). A parallel region costs a wake-up of the other
// threads and a join: about 10 us on a quiet machine, but on a shared one a descheduled thread
// stalls the join for its scheduling delay (~8 ms per op measured at load 5: the tiny model's
// 16-row matmuls took 8 ms each). Weight-streaming ops (>= 1M multiply-adds) stay parallel.
constexpr int64_t kMinTaskWork = int64_t(1) << 20;
static inline int64_t grain_for(int64_t work_per_item) {
  return std::max<int64_t>(1, kMinTaskWork / std::max<int64_t>(1, work_per_item));
}
// Work units per element of an elementwise pass (norms, rotary, silu): widening, the float math
// and the rounding back to bfloat16 cost about a cycle per element against the dot products'
// ~1/32. Measured on a Zen 4 at 128 rows x 1024: RMSNorm ran 43 us on one thread when counted
// as 2 units per element.
constexpr int64_t kElementWork = 32;

#ifdef __AVX512F__
#include <immintrin.h>
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const at::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
#endif

#if defined(__AVX512F__)
// exp(x) for 16 floats within ~1 ulp: x = n ln2 + r with |r| <= ln2/2, a degree-6 polynomial
// for exp(r) (the Cephes expf coefficients), then scalef by 2^n, which gives inf above ~88.7,
// 0 below ~-103 and passes NaN through, as std::exp does.
static inline __m512 exp16(__m512 x) {
  // Clamped first so that +-inf give inf and 0 (not inf - inf in the reduction); the second
  // operand is returned for NaN, so NaN stays NaN.
  x = _mm512_min_ps(_mm512_set1_ps(89.f), _mm512_max_ps(_mm512_set1_ps(-104.f), x));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

// Round 16 floats to T's precision (bfloat16: to nearest even, NaN kept), returned as floats.
static inline __m512 round_to(__m512 x, const float*) { return x; }
static inline __m512 round_to(__m512 x, const at::BFloat16*) {
  const __m512i b = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  r = _mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_castsi512_ps(_mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc00000)));
}
static inline void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
static inline void store16(at::BFloat16* p, __m512 x) {  // x already rounded: the top halves
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(x), 16)));
}
#endif

#if defined(__AVX512F__)
// The four sums of a[0..3] in one __m128: one shuffle tree for four outputs instead of four
// full horizontal reductions (a reduction costs about a quarter of a K=1024 dot product).
static inline __m128 hsum4(const __m512* a) {
  const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(a[0], a[1]), _mm512_unpackhi_ps(a[0], a[1]));
  const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(a[2], a[3]), _mm512_unpackhi_ps(a[2], a[3]));
  // Each 128-bit lane now holds (a0, a1, a0, a1) and (a2, a3, a2, a3) partial sums.
  const __m512 s = _mm512_add_ps(_mm512_shuffle_ps(s01, s23, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(s01, s23, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(s),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

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
static inline void softmax_in_place(float* x, int64_t n) {
  float mx = -INFINITY, sum = 0.f;
  int64_t t = 0;
#if defined(__AVX512F__)
  __m512 vm = _mm512_set1_ps(-INFINITY);
  for (; t + 16 <= n; t += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(x + t));
  mx = _mm512_reduce_max_ps(vm);
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
// (G, n) scratch; acc: (G, D) result; softcap > 0 caps the scores before the softmax.
template <typename T>
static void attend(const float* qf, const T* const* keys, const T* const* values, int64_t n,
                   int64_t G, int64_t D, float* scores, float* acc, float softcap) {
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
    softmax_in_place(sg, n);
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
                          float softcap) {
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
      attend(qf.data(), keys.data(), values.data(), m, G, D, scores.data(), acc.data(), softcap);
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          out[(b * H + h * G + g) * D + d] = static_cast<T>(acc[g * D + d]);
    }
  });
}

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_table, torch::Tensor ctx_lens,
                                     double scale, int64_t window, double softcap) {
  // q: (B, H, D); caches: (num_blocks, KVH, bs, D); block_table: (B, max_blocks) int64.
  // window: attend to the last `window` tokens only (0: all); softcap: cap * tanh(s / cap) on
  // the scores (0: off).
  auto out = torch::empty_like(q);
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = k_cache.size(1), bs = k_cache.size(2);
  if (q.scalar_type() == at::kBFloat16) {
    decode_kernel<at::BFloat16>(q.data_ptr<at::BFloat16>(), k_cache.data_ptr<at::BFloat16>(),
                                v_cache.data_ptr<at::BFloat16>(), block_table.data_ptr<int64_t>(),
                                ctx_lens.data_ptr<int64_t>(), out.data_ptr<at::BFloat16>(), B, H,
                                KVH, D, bs, block_table.size(1), (float)scale, window,
                                (float)softcap);
  } else {
    decode_kernel<float>(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                         block_table.data_ptr<int64_t>(), ctx_lens.data_ptr<int64_t>(),
                         out.data_ptr<float>(), B, H, KVH, D, bs, block_table.size(1),
                         (float)scale, window, (float)softcap);
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Small-M linear: y (M, N) = x (M, K) @ w (N, K)^T + b. Decode multiplies one (or a few) rows by
// every weight matrix, so the cost is streaming the weights once; torch's bf16 path reaches a
// fraction of the memory bandwidth for a single row. Threads split N; each block of 4 weight rows
// is used for every row of x while it is in L1, so the weights are read from memory once.

template <typename T>
static inline void dot_block_scalar(const T* x, const T* w, int64_t M, int64_t K, int64_t ldx,
                                    int64_t nb, float* out /* (M, nb) */) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < nb; ++j) {
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc += to_f(x[m * ldx + k]) * to_f(w[j * K + k]);
      out[m * nb + j] = acc;
    }
}

#if defined(__AVX512F__)
// The blocks of 4 weight rows ahead whose same offset is prefetched into L2 while this block is
// multiplied: the streams from memory then run ahead of the loads. Measured on a Zen 4 at 8 rows
// of x: 2 blocks ahead into L2 reads 1.2-1.5x faster than 1 block ahead into L1 (which is no
// better than no prefetch); more distance changes nothing.
constexpr int64_t kPrefetchBlocks = 2;

// out[m * 4 + j] = x[m] . w[j] for MB (up to 6) rows of x and 4 rows of w.
template <int MB>
static inline void dot4_f32(const float* x, const float* w, int64_t K, int64_t ldx, float* out) {
  __m512 acc[MB][4];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 wv[4];
    for (int j = 0; j < 4; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (j + 4 * kPrefetchBlocks) * K + k),
                   _MM_HINT_T1);
      wv[j] = _mm512_loadu_ps(w + j * K + k);
    }
    for (int m = 0; m < MB; ++m) {
      const __m512 xv = _mm512_loadu_ps(x + m * ldx + k);
      for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_fmadd_ps(xv, wv[j], acc[m][j]);
    }
  }
  for (int m = 0; m < MB; ++m) {
    _mm_storeu_ps(out + m * 4, hsum4(acc[m]));
    for (int j = 0; j < 4; ++j)
      for (int64_t kk = k; kk < K; ++kk) out[m * 4 + j] += x[m * ldx + kk] * w[j * K + kk];
  }
}

// out[m * 4 + j] = x[m] . w[j] for MB rows of x (up to 6: 24 accumulators + 4 weight vectors +
// one x vector fit the 32 registers) and 4 rows of w.
template <int MB>
static inline void dot4_bf16(const at::BFloat16* x, const at::BFloat16* w, int64_t K,
                             int64_t ldx, float* out) {
  __m512 acc[MB][4];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_setzero_ps();
  int64_t k = 0;
#if defined(__AVX512BF16__)
  // vdpbf16ps: 32 bf16 products per instruction, summed in pairs into 16 float lanes.
  for (; k + 32 <= K; k += 32) {
    __m512i wv[4];
    for (int j = 0; j < 4; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (j + 4 * kPrefetchBlocks) * K + k),
                   _MM_HINT_T1);
      wv[j] = _mm512_loadu_si512(reinterpret_cast<const void*>(w + j * K + k));
    }
    for (int m = 0; m < MB; ++m) {
      const __m512i xv = _mm512_loadu_si512(reinterpret_cast<const void*>(x + m * ldx + k));
      for (int j = 0; j < 4; ++j)
        acc[m][j] = _mm512_dpbf16_ps(acc[m][j], (__m512bh)xv, (__m512bh)wv[j]);
    }
  }
#else
  for (; k + 16 <= K; k += 16) {
    __m512 wv[4];
    for (int j = 0; j < 4; ++j) wv[j] = load16(w + j * K + k);
    for (int m = 0; m < MB; ++m) {
      const __m512 xv = load16(x + m * ldx + k);
      for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_fmadd_ps(xv, wv[j], acc[m][j]);
    }
  }
#endif
  for (int m = 0; m < MB; ++m) {
    _mm_storeu_ps(out + m * 4, hsum4(acc[m]));
    for (int j = 0; j < 4; ++j)
      for (int64_t kk = k; kk < K; ++kk)
        out[m * 4 + j] += to_f(x[m * ldx + kk]) * to_f(w[j * K + kk]);
  }
}

template <int MB>
static inline void dot4(const float* x, const float* w, int64_t K, int64_t ldx, float* out) {
  dot4_f32<MB>(x, w, K, ldx, out);
}
template <int MB>
static inline void dot4(const at::BFloat16* x, const at::BFloat16* w, int64_t K, int64_t ldx,
                        float* out) {
  dot4_bf16<MB>(x, w, K, ldx, out);
}
#endif

// Rows of x per register block: 6 x 4 accumulators + 4 weight vectors + one x vector = 29 of
// the 32 vector registers.
constexpr int64_t kRowBlock = 6;

// Up to this many rows of x, weight rows are read one after another instead of four at a time.
// Each thread then reads its share of the weights as one sequential stream; the four-row blocks
// above read four streams 2*K bytes apart, which the hardware prefetcher follows less well.
// Measured on a Zen 4 at the Qwen3-0.6B shapes, one row of x: 1.1-1.6x the bandwidth of the
// four-row blocks (the machine's bandwidth varies from run to run; never slower). From 4 rows
// on, the four-row blocks win: they load each weight vector once for up to 24 products.
constexpr int64_t kSequentialRows = 2;

#if defined(__AVX512F__)
// acc += x . w over one chunk of 32 bf16 (vdpbf16ps where the CPU has it) or 16 floats.
static inline __m512 fma_chunk(__m512 acc, const at::BFloat16* x, const at::BFloat16* w) {
#if defined(__AVX512BF16__)
  return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(x)),
                          (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(w)));
#else
  acc = _mm512_fmadd_ps(load16(x), load16(w), acc);
  return _mm512_fmadd_ps(load16(x + 16), load16(w + 16), acc);
#endif
}
static inline __m512 fma_chunk(__m512 acc, const float* x, const float* w) {
  return _mm512_fmadd_ps(_mm512_loadu_ps(x), _mm512_loadu_ps(w), acc);
}
template <typename T> constexpr int64_t chunk_len() { return 64 / sizeof(T); }  // one cache line

// out[m] = x[m] . w for MB rows of x and one weight row; U chunks of each row in flight so that
// at least four accumulator chains hide the FMA latency.
template <int MB, int U, typename T>
static inline void dot_row(const T* x, const T* w, int64_t K, int64_t ldx, float* out) {
  constexpr int64_t C = chunk_len<T>();
  __m512 acc[U][MB];
  for (int u = 0; u < U; ++u)
    for (int m = 0; m < MB; ++m) acc[u][m] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + C * U <= K; k += C * U)
    for (int u = 0; u < U; ++u)
      for (int m = 0; m < MB; ++m)
        acc[u][m] = fma_chunk(acc[u][m], x + m * ldx + k + C * u, w + k + C * u);
  for (; k + C <= K; k += C)
    for (int m = 0; m < MB; ++m) acc[0][m] = fma_chunk(acc[0][m], x + m * ldx + k, w + k);
  for (int m = 0; m < MB; ++m) {
    __m512 s = acc[0][m];
    for (int u = 1; u < U; ++u) s = _mm512_add_ps(s, acc[u][m]);
    float v = _mm512_reduce_add_ps(s);
    for (int64_t kk = k; kk < K; ++kk) v += to_f(x[m * ldx + kk]) * to_f(w[kk]);
    out[m] = v;
  }
}
#endif

template <typename T>
static void linear_sequential(const T* x, const T* w, const T* b, T* y, int64_t M, int64_t N,
                              int64_t K, int64_t ldx) {
  at::parallel_for(0, N, grain_for(K * M), [&](int64_t begin, int64_t end) {
    float out[kSequentialRows];
    for (int64_t n = begin; n < end; ++n) {
#if defined(__AVX512F__)
      if (M == 1) dot_row<1, 4>(x, w + n * K, K, ldx, out);
      else dot_row<2, 2>(x, w + n * K, K, ldx, out);
#else
      dot_block_scalar(x, w + n * K, M, K, ldx, 1, out);
#endif
      for (int64_t m = 0; m < M; ++m) {
        float v = out[m];
        if (b != nullptr) v += to_f(b[n]);  // in float32, one rounding to T
        y[m * N + n] = static_cast<T>(v);
      }
    }
  });
}

template <typename T>
static void linear_kernel(const T* x, const T* w, const T* b, T* y, int64_t M, int64_t N,
                          int64_t K, int64_t ldx) {
  if (M <= kSequentialRows) return linear_sequential(x, w, b, y, M, N, K, ldx);
  // Each block of 4 weight rows is read once from memory and then used from L1 for every row
  // of x, in register blocks of up to kRowBlock rows (sizes balanced: 8 rows = 4 + 4).
  const int64_t row_blocks = (M + kRowBlock - 1) / kRowBlock;
  at::parallel_for(0, (N + 3) / 4, grain_for(4 * K * M), [&](int64_t begin, int64_t end) {
    float out[kRowBlock * 4];
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t n0 = blk * 4, nb = std::min<int64_t>(4, N - n0);
      for (int64_t rb = 0, m0 = 0; m0 < M; ++rb) {
        const int64_t mb = (M - m0 + (row_blocks - rb) - 1) / (row_blocks - rb);
        const T* xm = x + m0 * ldx;
#if defined(__AVX512F__)
        if (nb == 4) {
          switch (mb) {
            case 1: dot4<1>(xm, w + n0 * K, K, ldx, out); break;
            case 2: dot4<2>(xm, w + n0 * K, K, ldx, out); break;
            case 3: dot4<3>(xm, w + n0 * K, K, ldx, out); break;
            case 4: dot4<4>(xm, w + n0 * K, K, ldx, out); break;
            case 5: dot4<5>(xm, w + n0 * K, K, ldx, out); break;
            default: dot4<6>(xm, w + n0 * K, K, ldx, out); break;
          }
        } else {
          dot_block_scalar(xm, w + n0 * K, mb, K, ldx, nb, out);
          // dot_block_scalar writes (mb, nb); spread to the (mb, 4) layout used below.
          for (int64_t m = mb - 1; m >= 0; --m)
            for (int64_t j = nb - 1; j >= 0; --j) out[m * 4 + j] = out[m * nb + j];
        }
#else
        float tmp[kRowBlock * 4];
        dot_block_scalar(xm, w + n0 * K, mb, K, ldx, nb, tmp);
        for (int64_t m = 0; m < mb; ++m)
          for (int64_t j = 0; j < nb; ++j) out[m * 4 + j] = tmp[m * nb + j];
#endif
        for (int64_t m = 0; m < mb; ++m)
          for (int64_t j = 0; j < nb; ++j) {
            float v = out[m * 4 + j];
            if (b != nullptr) v += to_f(b[n0 + j]);  // in float32, one rounding to T
            y[(m0 + m) * N + n0 + j] = static_cast<T>(v);
          }
        m0 += mb;
      }
    }
  });
}

torch::Tensor linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> b) {
  // x: (M, K) with unit stride in K; w: (N, K) contiguous; b: (N,) or None. Returns (M, N).
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "linear: shapes");
  TORCH_CHECK(x.stride(1) == 1 && w.is_contiguous(), "linear: layout");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "linear: dtypes");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  const bool has_b = b.has_value() && b->defined();
  if (x.scalar_type() == at::kBFloat16) {
    linear_kernel<at::BFloat16>(x.data_ptr<at::BFloat16>(), w.data_ptr<at::BFloat16>(),
                                has_b ? b->data_ptr<at::BFloat16>() : nullptr,
                                y.data_ptr<at::BFloat16>(), M, N, K, x.stride(0));
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "linear: bfloat16 or float32");
    linear_kernel<float>(x.data_ptr<float>(), w.data_ptr<float>(),
                         has_b ? b->data_ptr<float>() : nullptr, y.data_ptr<float>(), M, N, K,
                         x.stride(0));
  }
  return y;
}

// ---------------------------------------------------------------------------------------------
// RMSNorm over the last dimension, optionally after adding a residual (in place), in one pass per
// row instead of eight torch ops. Numerics follow the HF reference: normalise in float32, round
// to T, then multiply by the weight in T.

// Sum of squares of D values in float32 (16 lanes, then the tail).
template <typename T>
static inline float sum_squares(const T* x, int64_t D) {
  int64_t d = 0;
  float ss = 0.f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; d + 16 <= D; d += 16) {
    const __m512 v = load16(x + d);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  ss = _mm512_reduce_add_ps(acc);
#endif
  for (; d < D; ++d) ss += to_f(x[d]) * to_f(x[d]);
  return ss;
}

// out[d] = w[d] * (x[d] * inv), each product rounded to T like the unfused layers (the norm in
// float32, cast to T, then the weight multiply in T). O is T, or float for values kept rounded
// to T's precision (the rotary that follows reads them).
template <typename T, typename O>
static inline void scale_row(const T* x, const T* w, float inv, int64_t D, O* out) {
  int64_t d = 0;
#if defined(__AVX512F__)
  const __m512 vinv = _mm512_set1_ps(inv);
  for (; d + 16 <= D; d += 16) {
    const __m512 n = round_to(_mm512_mul_ps(load16(x + d), vinv), x);
    store16(out + d, round_to(_mm512_mul_ps(load16(w + d), n), x));
  }
#endif
  for (; d < D; ++d)
    out[d] = static_cast<O>(static_cast<T>(to_f(w[d]) * to_f(static_cast<T>(to_f(x[d]) * inv))));
}

template <typename T>
static void rms_norm_kernel(const T* x, T* residual, const T* w, T* out, int64_t R, int64_t D,
                            int64_t inner, int64_t ld_outer, float eps) {
  // Row r of x starts at (r / inner) * ld_outer + (r % inner) * D: a (T, H, D) view of a wider
  // matrix (q or k heads inside the qkv output) is read in place.
  at::parallel_for(0, R, grain_for(kElementWork * D), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* src = x + (r / inner) * ld_outer + (r % inner) * D;
      if (residual != nullptr) {  // residual += x, rounded to T; the norm reads the sum
        T* rr = residual + r * D;
        int64_t d = 0;
#if defined(__AVX512F__)
        for (; d + 16 <= D; d += 16)
          store16(rr + d, round_to(_mm512_add_ps(load16(rr + d), load16(src + d)), rr));
#endif
        for (; d < D; ++d) rr[d] = static_cast<T>(to_f(rr[d]) + to_f(src[d]));
        src = rr;
      }
      const float inv = 1.f / std::sqrt(sum_squares(src, D) / D + eps);
      scale_row(src, w, inv, D, out + r * D);
    }
  });
}

torch::Tensor rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor w,
                       double eps) {
  // x: (R, D) or (T, H, D), unit stride in D and heads adjacent; residual: contiguous, same
  // number of rows, updated in place to residual + x; w: (D,). Returns a contiguous x's shape.
  TORCH_CHECK(x.dim() == 2 || x.dim() == 3, "rms_norm: 2 or 3 dims");
  const int64_t D = x.size(-1);
  const int64_t inner = x.dim() == 3 ? x.size(1) : 1;
  TORCH_CHECK(x.stride(-1) == 1 && (x.dim() == 2 || x.stride(1) == D) && w.is_contiguous(),
              "rms_norm: layout");
  const int64_t R = x.numel() / D;
  auto out = torch::empty(x.sizes(), x.options());
  const bool has_r = residual.has_value() && residual->defined();
  if (has_r) TORCH_CHECK(residual->is_contiguous() && residual->numel() == x.numel(),
                         "rms_norm: residual");
  if (x.scalar_type() == at::kBFloat16) {
    rms_norm_kernel<at::BFloat16>(x.data_ptr<at::BFloat16>(),
                                  has_r ? residual->data_ptr<at::BFloat16>() : nullptr,
                                  w.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), R, D,
                                  inner, x.stride(0), (float)eps);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "rms_norm: bfloat16 or float32");
    rms_norm_kernel<float>(x.data_ptr<float>(), has_r ? residual->data_ptr<float>() : nullptr,
                           w.data_ptr<float>(), out.data_ptr<float>(), R, D, inner, x.stride(0),
                           (float)eps);
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Neox rotary embedding applied in place to q (T, H, D) and k (T, KVH, D), one op for both.
// cos/sin tables are float32 (P, D/2); the rotation is computed in float32 and rounded to T.

template <typename T>
static void rotary_kernel(T* q, T* k, const int64_t* pos, const float* cos, const float* sin,
                          int64_t Tn, int64_t H, int64_t KVH, int64_t D, int64_t ldq,
                          int64_t ldk) {
  const int64_t half = D / 2;
  at::parallel_for(0, Tn, grain_for(kElementWork * (H + KVH) * D), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos + pos[t] * half;
      const float* s = sin + pos[t] * half;
      auto rot = [&](T* x) {
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = to_f(x[i]), x2 = to_f(x[i + half]);
          x[i] = static_cast<T>(x1 * c[i] - x2 * s[i]);
          x[i + half] = static_cast<T>(x2 * c[i] + x1 * s[i]);
        }
      };
      for (int64_t h = 0; h < H; ++h) rot(q + t * ldq + h * D);
      for (int64_t h = 0; h < KVH; ++h) rot(k + t * ldk + h * D);
    }
  });
}

void rotary(torch::Tensor q, torch::Tensor k, torch::Tensor positions, torch::Tensor cos,
            torch::Tensor sin) {
  // q: (T, H, D), k: (T, KVH, D), each head contiguous; positions: (T,) int64.
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "rotary: q layout");
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == k.size(2), "rotary: k layout");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous(),
              "rotary: tables");
  const int64_t Tn = q.size(0), H = q.size(1), KVH = k.size(1), D = q.size(2);
  if (q.scalar_type() == at::kBFloat16) {
    rotary_kernel<at::BFloat16>(q.data_ptr<at::BFloat16>(), k.data_ptr<at::BFloat16>(),
                                positions.data_ptr<int64_t>(), cos.data_ptr<float>(),
                                sin.data_ptr<float>(), Tn, H, KVH, D, q.stride(0), k.stride(0));
  } else {
    TORCH_CHECK(q.scalar_type() == at::kFloat, "rotary: bfloat16 or float32");
    rotary_kernel<float>(q.data_ptr<float>(), k.data_ptr<float>(), positions.data_ptr<int64_t>(),
                         cos.data_ptr<float>(), sin.data_ptr<float>(), Tn, H, KVH, D,
                         q.stride(0), k.stride(0));
  }
}

// ---------------------------------------------------------------------------------------------
// Grammar bitmask: logits[rows[i], t] = -inf where bit t % 32 of bitmask[i, t / 32] is clear.
// In place and without the (rows, vocab) temporaries that unpacking the bits in torch needs;
// words with every bit set (most of a permissive grammar's mask) are skipped.

template <typename T>
static void bitmask_kernel(T* logits, int64_t ld, const int64_t* rows, const int32_t* mask,
                           int64_t R, int64_t W, int64_t V) {
  const T neg_inf = static_cast<T>(-INFINITY);
  at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      T* row = logits + rows[i] * ld;
      const uint32_t* m = reinterpret_cast<const uint32_t*>(mask + i * W);
      int64_t w = 0;
#if defined(__AVX512F__)
      // Whole words inside the vocabulary: one masked store per 16 tokens instead of one store
      // per blocked token (a JSON grammar's mask blocks most of a 152k vocabulary).
      if (sizeof(T) == 4) {
        const __m512 ninf = _mm512_set1_ps(-INFINITY);
        for (; w < W && w * 32 + 32 <= V; ++w) {
          const uint32_t blocked = ~m[w];
          if (blocked == 0) continue;
          float* r = reinterpret_cast<float*>(row) + w * 32;
          _mm512_mask_storeu_ps(r, static_cast<__mmask16>(blocked & 0xffff), ninf);
          _mm512_mask_storeu_ps(r + 16, static_cast<__mmask16>(blocked >> 16), ninf);
        }
      }
#if defined(__AVX512BW__)
      if (sizeof(T) == 2) {  // bfloat16: a whole word in one masked store of 32 halves
        const __m512i ninf = _mm512_set1_epi16(static_cast<short>(0xFF80));
        for (; w < W && w * 32 + 32 <= V; ++w) {
          const uint32_t blocked = ~m[w];
          if (blocked != 0)
            _mm512_mask_storeu_epi16(reinterpret_cast<void*>(row + w * 32),
                                     static_cast<__mmask32>(blocked), ninf);
        }
      }
#endif
#endif
      for (; w < W; ++w) {
        uint32_t blocked = ~m[w];
        while (blocked) {
          const int64_t t = w * 32 + __builtin_ctz(blocked);
          if (t >= V) break;
          row[t] = neg_inf;
          blocked &= blocked - 1;
        }
      }
    }
  });
}

void apply_bitmask(torch::Tensor logits, torch::Tensor rows, torch::Tensor bitmask) {
  // logits: (N, V) unit stride in V; rows: (R,) int64 rows of logits; bitmask: (R, W) int32.
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, "apply_bitmask: logits layout");
  TORCH_CHECK(bitmask.is_contiguous() && bitmask.scalar_type() == at::kInt, "apply_bitmask: mask");
  TORCH_CHECK(rows.is_contiguous() && rows.scalar_type() == at::kLong, "apply_bitmask: rows");
  const int64_t R = bitmask.size(0), W = bitmask.size(1), V = logits.size(1);
  TORCH_CHECK(rows.numel() == R && W * 32 >= V, "apply_bitmask: shapes");
  if (logits.scalar_type() == at::kBFloat16) {
    bitmask_kernel<at::BFloat16>(logits.data_ptr<at::BFloat16>(), logits.stride(0),
                                 rows.data_ptr<int64_t>(), bitmask.data_ptr<int32_t>(), R, W, V);
  } else {
    TORCH_CHECK(logits.scalar_type() == at::kFloat, "apply_bitmask: bfloat16 or float32");
    bitmask_kernel<float>(logits.data_ptr<float>(), logits.stride(0), rows.data_ptr<int64_t>(),
                          bitmask.data_ptr<int32_t>(), R, W, V);
  }
}

// ---------------------------------------------------------------------------------------------
// Decode-path glue, one op each instead of several: Qwen3's per-head q/k RMSNorm followed by
// rotary, the KV-cache write, and SwiGLU's silu(gate) * up.

template <typename T>
static void qk_norm_rotary_kernel(const T* q, const T* k, T* q_out, T* k_out, const T* wq,
                                  const T* wk, const int64_t* pos, const float* cos,
                                  const float* sin, int64_t Tn, int64_t H, int64_t KVH, int64_t D,
                                  int64_t ldq, int64_t ldk, float eps) {
  const int64_t half = D / 2;
  at::parallel_for(0, Tn, grain_for(kElementWork * (H + KVH) * D), [&](int64_t begin, int64_t end) {
    std::vector<float> row(D);
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos + pos[t] * half;
      const float* s = sin + pos[t] * half;
      auto one = [&](const T* x, T* o, const T* w) {
        const float inv = 1.f / std::sqrt(sum_squares(x, D) / D + eps);
        // The norm's output is rounded to T (as the unfused layers store it), then rotated.
        scale_row(x, w, inv, D, row.data());
        int64_t i = 0;
#if defined(__AVX512F__)
        for (; i + 16 <= half; i += 16) {
          const __m512 x1 = _mm512_loadu_ps(row.data() + i);
          const __m512 x2 = _mm512_loadu_ps(row.data() + i + half);
          const __m512 ci = _mm512_loadu_ps(c + i), si = _mm512_loadu_ps(s + i);
          store16(o + i, round_to(_mm512_sub_ps(_mm512_mul_ps(x1, ci), _mm512_mul_ps(x2, si)), o));
          store16(o + i + half,
                  round_to(_mm512_add_ps(_mm512_mul_ps(x2, ci), _mm512_mul_ps(x1, si)), o));
        }
#endif
        for (; i < half; ++i) {
          const float x1 = row[i], x2 = row[i + half];
          o[i] = static_cast<T>(x1 * c[i] - x2 * s[i]);
          o[i + half] = static_cast<T>(x2 * c[i] + x1 * s[i]);
        }
      };
      for (int64_t h = 0; h < H; ++h) one(q + t * ldq + h * D, q_out + (t * H + h) * D, wq);
      for (int64_t h = 0; h < KVH; ++h) one(k + t * ldk + h * D, k_out + (t * KVH + h) * D, wk);
    }
  });
}

std::vector<torch::Tensor> qk_norm_rotary(torch::Tensor q, torch::Tensor k, torch::Tensor wq,
                                          torch::Tensor wk, double eps, torch::Tensor positions,
                                          torch::Tensor cos, torch::Tensor sin) {
  // q: (T, H, D), k: (T, KVH, D) with heads adjacent (views into the qkv output are fine).
  // Returns new contiguous (q, k): RMSNorm per head with wq / wk, then neox rotary.
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "qk_norm_rotary: q layout");
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == k.size(2), "qk_norm_rotary: k layout");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous(),
              "qk_norm_rotary: tables");
  const int64_t Tn = q.size(0), H = q.size(1), KVH = k.size(1), D = q.size(2);
  auto qo = torch::empty({Tn, H, D}, q.options());
  auto ko = torch::empty({Tn, KVH, D}, k.options());
  if (q.scalar_type() == at::kBFloat16) {
    using T = at::BFloat16;
    qk_norm_rotary_kernel<T>(q.data_ptr<T>(), k.data_ptr<T>(), qo.data_ptr<T>(), ko.data_ptr<T>(),
                             wq.data_ptr<T>(), wk.data_ptr<T>(), positions.data_ptr<int64_t>(),
                             cos.data_ptr<float>(), sin.data_ptr<float>(), Tn, H, KVH, D,
                             q.stride(0), k.stride(0), (float)eps);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kFloat, "qk_norm_rotary: bfloat16 or float32");
    qk_norm_rotary_kernel<float>(q.data_ptr<float>(), k.data_ptr<float>(), qo.data_ptr<float>(),
                                 ko.data_ptr<float>(), wq.data_ptr<float>(), wk.data_ptr<float>(),
                                 positions.data_ptr<int64_t>(), cos.data_ptr<float>(),
                                 sin.data_ptr<float>(), Tn, H, KVH, D, q.stride(0), k.stride(0),
                                 (float)eps);
  }
  return {qo, ko};
}

void write_kv_cache(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
                    torch::Tensor slot_blocks, torch::Tensor slot_offsets) {
  // k, v: (T, KVH, D) heads contiguous; caches: (num_blocks, KVH, bs, D) contiguous.
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(2) == 1 &&
              v.stride(1) == v.size(2), "write_kv_cache: k/v layout");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "write_kv_cache: caches");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == v_cache.scalar_type(),
              "write_kv_cache: dtypes");
  const int64_t Tn = k.size(0), KVH = k.size(1), D = k.size(2), bs = k_cache.size(2);
  const int64_t esz = k.element_size();
  const int64_t* blk = slot_blocks.data_ptr<int64_t>();
  const int64_t* off = slot_offsets.data_ptr<int64_t>();
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  for (int64_t t = 0; t < Tn; ++t)
    for (int64_t h = 0; h < KVH; ++h) {
      const int64_t dst = ((blk[t] * KVH + h) * bs + off[t]) * D * esz;
      std::memcpy(kc + dst, kp + (t * k.stride(0) + h * D) * esz, D * esz);
      std::memcpy(vc + dst, vp + (t * v.stride(0) + h * D) * esz, D * esz);
    }
}


template <typename T>
static void silu_mul_kernel(const T* x, T* out, int64_t R, int64_t I, int64_t ldx) {
  at::parallel_for(0, R, grain_for(kElementWork * I), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = x + r * ldx;
      const T* up = gate + I;
      T* o = out + r * I;
      int64_t i = 0;
#if defined(__AVX512F__)
      for (; i + 16 <= I; i += 16) {
        const __m512 g = load16(gate + i);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
        const __m512 sg = round_to(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e)), o);
        store16(o + i, round_to(_mm512_mul_ps(sg, load16(up + i)), o));
      }
#endif
      for (; i < I; ++i) {
        // Like torch: silu rounded to T, then the product rounded to T.
        const float g = to_f(gate[i]);
        const float sg = to_f(static_cast<T>(g / (1.f + std::exp(-g))));
        o[i] = static_cast<T>(sg * to_f(up[i]));
      }
    }
  });
}

torch::Tensor silu_mul(torch::Tensor x) {
  // x: (R, 2I) = [gate | up] per row, unit stride; returns silu(gate) * up, (R, I).
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0, "silu_mul: layout");
  const int64_t R = x.size(0), I = x.size(1) / 2;
  auto out = torch::empty({R, I}, x.options());
  if (x.scalar_type() == at::kBFloat16) {
    silu_mul_kernel<at::BFloat16>(x.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), R, I,
                                  x.stride(0));
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "silu_mul: bfloat16 or float32");
    silu_mul_kernel<float>(x.data_ptr<float>(), out.data_ptr<float>(), R, I, x.stride(0));
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Sampler passes over (rows, vocab) float32 logits, one read of each row instead of one per
// torch op (each pass over 64 x 152k floats is ~40 MB of memory traffic).

void apply_penalties(torch::Tensor logits, torch::Tensor counts, torch::Tensor seen, torch::Tensor repetition, torch::Tensor frequency,
                     torch::Tensor presence, bool use_rep, bool use_freq, bool use_pres) {
  // logits: (R, V) float32 contiguous, in place; counts: (>= R, V) float32; seen: (>= R, V)
  // bool; penalties: (R,) float32. Same arithmetic as PenaltyState.apply_torch: seen logits
  // times (1 / rep) if positive else rep, then minus freq * count, then minus pres where the
  // count is positive.
  TORCH_CHECK(logits.is_contiguous() && logits.scalar_type() == at::kFloat, "penalties: logits");
  TORCH_CHECK(counts.is_contiguous() && seen.is_contiguous(),
              "penalties: state layout");
  const int64_t R = logits.size(0), V = logits.size(1);
  float* L = logits.data_ptr<float>();
  const float* C = counts.data_ptr<float>();
  const bool* S = seen.data_ptr<bool>();
  const float* rep = repetition.data_ptr<float>();
  const float* freq = frequency.data_ptr<float>();
  const float* pres = presence.data_ptr<float>();
  at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* l = L + r * V;
      const float* c = C + r * V;
      const bool* sn = S + r * V;
      const float rp = rep[r], inv_rp = 1.f / rep[r], f = freq[r], pr = pres[r];
      const bool do_freq = use_freq && f != 0.f, do_pres = use_pres && pr != 0.f;
      // One pass over the row, the three penalties in the twin's order.
      for (int64_t v = 0; v < V; ++v) {
        float x = l[v];
        if (use_rep && sn[v]) x *= x > 0.f ? inv_rp : rp;
        if (do_freq) x -= c[v] * f;
        if (do_pres && c[v] > 0.f) x -= pr;
        l[v] = x;
      }
    }
  });
}

// The largest of x[0..V) with NaNs skipped; *has_nan, when asked for, tells whether one was seen.
template <typename T>
static inline float row_max(const T* x, int64_t V, bool* has_nan = nullptr) {
  float mx = -INFINITY;
  bool nan_seen = false;
  int64_t v = 0;
#if defined(__AVX512F__)
  __m512 vmx = _mm512_set1_ps(-INFINITY);
  __mmask16 nan = 0;
  for (; v + 16 <= V; v += 16) {
    const __m512 xv = load16(x + v);
    nan |= _mm512_cmp_ps_mask(xv, xv, _CMP_UNORD_Q);
    vmx = _mm512_max_ps(xv, vmx);  // the second operand where the first is NaN
  }
  mx = _mm512_reduce_max_ps(vmx);
  nan_seen = nan != 0;
#endif
  for (; v < V; ++v) {
    const float f = to_f(x[v]);
    nan_seen |= std::isnan(f);
    mx = std::max(mx, f);
  }
  if (has_nan != nullptr) *has_nan = nan_seen;
  return mx;
}

std::vector<torch::Tensor> logprob_stats(torch::Tensor src, torch::Tensor chosen) {
  // src: (N, V) float32 contiguous; chosen: (N,) int64. Returns (logsumexp (N,), src[chosen]
  // (N,), rank (N,) int64 = 1 + number of tokens with a larger value).
  TORCH_CHECK(src.is_contiguous() && src.scalar_type() == at::kFloat, "logprob_stats: src");
  const int64_t N = src.size(0), V = src.size(1);
  auto lse = torch::empty({N}, src.options());
  auto val = torch::empty({N}, src.options());
  auto rank = torch::empty({N}, chosen.options());
  const float* X = src.data_ptr<float>();
  const int64_t* ch = chosen.data_ptr<int64_t>();
  float* o_lse = lse.data_ptr<float>();
  float* o_val = val.data_ptr<float>();
  int64_t* o_rank = rank.data_ptr<int64_t>();
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const float* x = X + n * V;
      const float mx = row_max(x, V);
      const float c = x[ch[n]];
      int64_t above = 0;
      if (mx == -INFINITY) {
        o_lse[n] = -INFINITY;
      } else {
        int64_t v = 0;
        double total = 0.0;
#if defined(__AVX512F__)
        // 16 lanes: the vector exp (within an ulp of std::exp) and a mask count for the rank.
        // Every 64 chunks the float lanes are added into double ones: a float sum over a
        // 152k vocabulary drifts by ~1e-5 relative, enough to move a top-p boundary.
        __m512d vd = _mm512_setzero_pd();
        const __m512 vmx = _mm512_set1_ps(mx), vc = _mm512_set1_ps(c);
        while (v + 16 <= V) {
          __m512 vs = _mm512_setzero_ps();
          for (int i = 0; i < 64 && v + 16 <= V; ++i, v += 16) {
            const __m512 xv = _mm512_loadu_ps(x + v);
            vs = _mm512_add_ps(vs, exp16(_mm512_sub_ps(xv, vmx)));
            above += __builtin_popcount(_mm512_cmp_ps_mask(xv, vc, _CMP_GT_OQ));
          }
          vd = _mm512_add_pd(vd, _mm512_cvtps_pd(_mm512_castps512_ps256(vs)));
          vd = _mm512_add_pd(vd, _mm512_cvtps_pd(_mm256_castpd_ps(
                                     _mm512_extractf64x4_pd(_mm512_castps_pd(vs), 1))));
        }
        total = _mm512_reduce_add_pd(vd);
#endif
        for (; v < V; ++v) {
          total += std::exp(x[v] - mx);
          above += x[v] > c;
        }
        o_lse[n] = static_cast<float>(mx + std::log(total));
      }
      o_val[n] = c;
      o_rank[n] = above + 1;
    }
  });
  return {lse, val, rank};
}

// ---------------------------------------------------------------------------------------------
// Top-p without a sort: per row, the smallest set of the largest tokens whose probability
// exp(x - lse) reaches p (ties at the boundary kept in index order), everything else set to
// -inf in place. The boundary value is found by a radix select on the float's sortable bits
// (11, 11 and 10 bits), each level summing the probability of the tokens in each bucket (in
// double) from the top until the mass reaches p: four passes over the row instead of a sort.
// Its twin is the sorted cumsum of ops.mask_top_k_top_p; the two differ only where p falls
// within the float32 rounding of the sorted cumsum (this sums more exactly).

static inline uint32_t sortable_key(float f) {  // larger float -> larger key (non-NaN)
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

#if defined(__AVX512F__)
static inline __m512i sortable_keys16(__m512 x) {
  const __m512i b = _mm512_castps_si512(x);
  const __m512i neg = _mm512_srai_epi32(b, 31);  // all ones where the sign bit is set
  return _mm512_xor_si512(b, _mm512_or_si512(neg, _mm512_set1_epi32(static_cast<int>(0x80000000u))));
}
#endif

static void top_p_row(float* x, int64_t V, float lse, float p, double* hist) {
  constexpr int kShift[3] = {21, 10, 0};
  constexpr uint32_t kBuckets[3] = {2048, 2048, 1024};
  uint32_t prefix = 0, prefix_mask = 0;
  double above = 0.0;  // probability of the tokens with a key above the current range
  for (int level = 0; level < 3; ++level) {
    const int sh = kShift[level];
    const uint32_t nb = kBuckets[level];
    std::fill(hist, hist + nb, 0.0);
    int64_t j = 0;
#if defined(__AVX512F__)
    if (level == 0) {  // every live token: vector exp, then the bucket adds
      const __m512 vl = _mm512_set1_ps(lse), ninf = _mm512_set1_ps(-INFINITY);
      alignas(64) float e[16];
      alignas(64) uint32_t k[16];
      for (; j + 16 <= V; j += 16) {
        const __m512 xv = _mm512_loadu_ps(x + j);
        __mmask16 live = _mm512_cmp_ps_mask(xv, ninf, _CMP_NEQ_OQ);  // not -inf, not NaN
        if (!live) continue;
        _mm512_store_ps(e, exp16(_mm512_sub_ps(xv, vl)));
        _mm512_store_si512(reinterpret_cast<void*>(k), sortable_keys16(xv));
        for (; live; live &= live - 1) {
          const int l = __builtin_ctz(live);
          hist[k[l] >> sh] += e[l];
        }
      }
    } else {  // only the tokens inside the chosen range, found 16 at a time
      const __m512i vpm = _mm512_set1_epi32(static_cast<int>(prefix_mask));
      const __m512i vp = _mm512_set1_epi32(static_cast<int>(prefix));
      for (; j + 16 <= V; j += 16) {
        const __m512 xv = _mm512_loadu_ps(x + j);
        const __m512i kv = sortable_keys16(xv);
        __mmask16 in = _mm512_cmpeq_epi32_mask(_mm512_and_si512(kv, vpm), vp);
        for (; in; in &= in - 1) {
          const int64_t t = j + __builtin_ctz(in);
          if (x[t] == -INFINITY || std::isnan(x[t])) continue;
          hist[(sortable_key(x[t]) >> sh) & (nb - 1)] += std::exp(x[t] - lse);
        }
      }
    }
#endif
    for (; j < V; ++j) {
      if (x[j] == -INFINITY || std::isnan(x[j])) continue;
      const uint32_t k = sortable_key(x[j]);
      if ((k & prefix_mask) != prefix) continue;
      hist[(k >> sh) & (nb - 1)] += std::exp(x[j] - lse);
    }
    // From the top bucket down: the first whose mass brings the total to p. If rounding keeps
    // the total below p, the lowest bucket with any mass (every live token is kept).
    double cum = above;
    int64_t b = nb - 1, lowest = -1;
    for (; b >= 0; --b) {
      if (hist[b] == 0.0) continue;
      lowest = b;
      if (cum + hist[b] >= p) break;
      cum += hist[b];
    }
    if (b < 0) {
      if (lowest < 0) return;  // nothing live in range (cannot happen at level 0 unless all -inf)
      b = lowest;
      cum -= hist[b];
    }
    prefix |= static_cast<uint32_t>(b) << sh;
    prefix_mask |= (nb - 1) << sh;
    above = cum;
  }
  // prefix is the boundary token's key; tokens above it are kept, and of the tokens equal to
  // it the first m in index order, while the mass before each is below p.
  float tau;
  {
    const uint32_t u = (prefix & 0x80000000u) ? (prefix & 0x7FFFFFFFu) : ~prefix;
    std::memcpy(&tau, &u, sizeof(tau));
  }
  const double q = std::exp(tau - lse);
  int64_t m = 1;
  if (q > 0.0 && p - above > q) m = static_cast<int64_t>(std::ceil((p - above) / q));
  int64_t ties = 0;
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512 vt = _mm512_set1_ps(tau), ninf = _mm512_set1_ps(-INFINITY);
  for (; j + 16 <= V; j += 16) {
    const __m512 xv = _mm512_loadu_ps(x + j);
    _mm512_mask_storeu_ps(x + j, _mm512_cmp_ps_mask(xv, vt, _CMP_LT_OQ), ninf);
    for (__mmask16 eq = _mm512_cmp_ps_mask(xv, vt, _CMP_EQ_OQ); eq; eq &= eq - 1)
      if (ties++ >= m) x[j + __builtin_ctz(eq)] = -INFINITY;
  }
#endif
  for (; j < V; ++j) {
    if (x[j] < tau) x[j] = -INFINITY;
    else if (x[j] == tau && ties++ >= m) x[j] = -INFINITY;
  }
}

void top_p_mask(torch::Tensor logits, torch::Tensor lse, torch::Tensor top_p) {
  // logits: (R, V) float32 contiguous, in place; lse: (R,) float32 logsumexp of each row;
  // top_p: (R,) float32 in (0, 1].
  TORCH_CHECK(logits.is_contiguous() && logits.scalar_type() == at::kFloat && logits.dim() == 2,
              "top_p_mask: logits");
  TORCH_CHECK(lse.scalar_type() == at::kFloat && top_p.scalar_type() == at::kFloat &&
              lse.is_contiguous() && top_p.is_contiguous() && lse.numel() == logits.size(0) &&
              top_p.numel() == logits.size(0), "top_p_mask: lse / top_p");
  const int64_t R = logits.size(0), V = logits.size(1);
  float* X = logits.data_ptr<float>();
  const float* L = lse.data_ptr<float>();
  const float* P = top_p.data_ptr<float>();
  at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
    std::vector<double> hist(2048);
    for (int64_t r = begin; r < end; ++r)
      if (P[r] < 1.f && std::isfinite(L[r])) top_p_row(X + r * V, V, L[r], P[r], hist.data());
  });
}

torch::Tensor logsumexp_rows(torch::Tensor src) {
  // src: (N, V) float32 contiguous. logprob_stats' pass (its rank count costs nothing beside
  // the exp in a memory-bound loop).
  auto chosen = torch::zeros({src.size(0)}, src.options().dtype(at::kLong));
  return logprob_stats(src, chosen)[0];
}

void min_p(torch::Tensor logits, torch::Tensor log_min_p) {
  // logits: (R, V) float32 contiguous, in place: -inf where logit < row max + log_min_p[r].
  TORCH_CHECK(logits.is_contiguous() && logits.scalar_type() == at::kFloat, "min_p: logits");
  const int64_t R = logits.size(0), V = logits.size(1);
  float* L = logits.data_ptr<float>();
  const float* m = log_min_p.data_ptr<float>();
  at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* l = L + r * V;
      const float cutoff = row_max(l, V) + m[r];
      int64_t v = 0;
#if defined(__AVX512F__)
      const __m512 vc = _mm512_set1_ps(cutoff), ninf = _mm512_set1_ps(-INFINITY);
      for (; v + 16 <= V; v += 16) {
        const __mmask16 below = _mm512_cmp_ps_mask(_mm512_loadu_ps(l + v), vc, _CMP_LT_OQ);
        _mm512_mask_storeu_ps(l + v, below, ninf);
      }
#endif
      for (; v < V; ++v)
        if (l[v] < cutoff) l[v] = -INFINITY;
    }
  });
}

std::vector<torch::Tensor> topk_rows(torch::Tensor x, int64_t k) {
  // x: (R, V) float32 contiguous; the k largest of each row, sorted descending, and their ids.
  // One pass with a k-entry min-heap: most elements lose one comparison against its root, where
  // torch.topk on a wide row does several passes.
  TORCH_CHECK(x.is_contiguous() && x.scalar_type() == at::kFloat && x.dim() == 2, "topk_rows");
  const int64_t R = x.size(0), V = x.size(1);
  TORCH_CHECK(k >= 1 && k <= V, "topk_rows: k");
  auto vals = torch::empty({R, k}, x.options());
  auto ids = torch::empty({R, k}, x.options().dtype(at::kLong));
  const float* X = x.data_ptr<float>();
  float* ov = vals.data_ptr<float>();
  int64_t* oi = ids.data_ptr<int64_t>();
  at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
    std::vector<std::pair<float, int64_t>> heap;
    // Root = the smallest kept (value, then the larger id, so lower ids win ties).
    auto worse = [](const std::pair<float, int64_t>& a, const std::pair<float, int64_t>& b) {
      return a.first > b.first || (a.first == b.first && a.second < b.second);
    };
    for (int64_t r = begin; r < end; ++r) {
      const float* row = X + r * V;
      heap.clear();
      for (int64_t v = 0; v < k; ++v) heap.emplace_back(row[v], v);
      std::make_heap(heap.begin(), heap.end(), worse);
      for (int64_t v = k; v < V; ++v) {
        if (row[v] > heap.front().first) {
          std::pop_heap(heap.begin(), heap.end(), worse);
          heap.back() = {row[v], v};
          std::push_heap(heap.begin(), heap.end(), worse);
        }
      }
      std::sort_heap(heap.begin(), heap.end(), worse);  // best first
      for (int64_t j = 0; j < k; ++j) {
        ov[r * k + j] = heap[j].first;
        oi[r * k + j] = heap[j].second;
      }
    }
  });
  return {vals, ids};
}

// Greedy argmax per row: the first index of the row's maximum, a NaN counting as the maximum
// (torch.argmax's rule). One row runs on the calling thread: torch's reduction over a 152k row
// wakes every thread for a few microseconds of work.
template <typename T>
static int64_t row_argmax(const T* x, int64_t V) {
  bool has_nan = false;
  const float best = row_max(x, V, &has_nan);
  if (has_nan) {
    for (int64_t t = 0; t < V; ++t)
      if (std::isnan(to_f(x[t]))) return t;
  }
  int64_t v = 0;
#if defined(__AVX512F__)
  const __m512 bv = _mm512_set1_ps(best);
  for (; v + 16 <= V; v += 16) {
    const __mmask16 eq = _mm512_cmp_ps_mask(load16(x + v), bv, _CMP_EQ_OQ);
    if (eq) return v + __builtin_ctz(eq);
  }
#endif
  for (; v < V; ++v)
    if (to_f(x[v]) == best) return v;
  return 0;  // unreachable: best is one of the values
}

torch::Tensor argmax_rows(torch::Tensor x) {
  // x: (R, V) float32 or bfloat16, contiguous, V >= 1. Returns (R,) int64.
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) >= 1, "argmax_rows: layout");
  const int64_t R = x.size(0), V = x.size(1);
  auto out = torch::empty({R}, x.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  if (x.scalar_type() == at::kBFloat16) {
    const at::BFloat16* X = x.data_ptr<at::BFloat16>();
    at::parallel_for(0, R, grain_for(V), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) o[r] = row_argmax(X + r * V, V);
    });
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "argmax_rows: bfloat16 or float32");
    const float* X = x.data_ptr<float>();
    at::parallel_for(0, R, grain_for(V), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) o[r] = row_argmax(X + r * V, V);
    });
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Seeded noise (sample/noise.py): the uniform u[r, j] = (((fmix32((tk[r, j] ^ k1[r]) + k2[r])
// >> 9) & 0x7FFFFF) + 0.5) / 2^23 in one pass, in uint32 arithmetic, instead of ~14 int32 torch
// passes over (rows, vocab). The integer math is exact, so the values are bit-identical to the
// twin; the caller takes -log(u) in torch.

static inline uint32_t fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  return h ^ (h >> 16);
}

void noise_uniform(torch::Tensor token_key, torch::Tensor k1, torch::Tensor k2,
                   torch::Tensor out) {
  // token_key: (R, K) int32 with unit column stride (row stride 0 broadcasts one row);
  // k1, k2: (R,) int32; out: (R, K) float32 contiguous.
  TORCH_CHECK(token_key.scalar_type() == at::kInt && k1.scalar_type() == at::kInt &&
              k2.scalar_type() == at::kInt && out.scalar_type() == at::kFloat,
              "noise_uniform: dtypes");
  TORCH_CHECK(token_key.dim() == 2 && token_key.stride(1) == 1 && out.is_contiguous() &&
              k1.is_contiguous() && k2.is_contiguous(), "noise_uniform: layout");
  const int64_t R = out.size(0), K = out.size(1), ld = token_key.stride(0);
  TORCH_CHECK(token_key.size(0) == R && token_key.size(1) == K && k1.numel() == R &&
              k2.numel() == R, "noise_uniform: shapes");
  const uint32_t* tk = reinterpret_cast<const uint32_t*>(token_key.data_ptr<int32_t>());
  const uint32_t* a = reinterpret_cast<const uint32_t*>(k1.data_ptr<int32_t>());
  const uint32_t* b = reinterpret_cast<const uint32_t*>(k2.data_ptr<int32_t>());
  float* o = out.data_ptr<float>();
  at::parallel_for(0, R, grain_for(4 * K), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint32_t* t = tk + r * ld;
      const uint32_t x1 = a[r], x2 = b[r];
      float* orow = o + r * K;
      for (int64_t j = 0; j < K; ++j) {
        const uint32_t h = fmix32((t[j] ^ x1) + x2);
        orow[j] = (static_cast<float>((h >> 9) & 0x7FFFFFu) + 0.5f) * (1.f / 8388608.f);
      }
    }
  });
}

#if defined(__AVX512F__)
// log(x) for 16 positive normal floats within ~1 ulp: x = 2^e * m with m in [sqrt(1/2), sqrt(2)),
// then the Cephes logf polynomial for log(1 + f), f = m - 1.
static inline __m512 log16(__m512 x) {
  __m512 e = _mm512_getexp_ps(x);
  __m512 m = _mm512_getmant_ps(x, _MM_MANT_NORM_1_2, _MM_MANT_SIGN_src);  // [1, 2)
  const __mmask16 big = _mm512_cmp_ps_mask(m, _mm512_set1_ps(1.41421356237f), _CMP_GT_OQ);
  m = _mm512_mask_mul_ps(m, big, m, _mm512_set1_ps(0.5f));
  e = _mm512_mask_add_ps(e, big, e, _mm512_set1_ps(1.f));
  const __m512 f = _mm512_sub_ps(m, _mm512_set1_ps(1.f));
  const __m512 z = _mm512_mul_ps(f, f);
  __m512 p = _mm512_set1_ps(7.0376836292e-2f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(-1.1514610310e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.1676998740e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(-1.2420140846e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.4249322787e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(-1.6668057665e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.0000714765e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(-2.4999993993e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(3.3333331174e-1f));
  __m512 y = _mm512_mul_ps(_mm512_mul_ps(f, z), p);
  y = _mm512_fmadd_ps(e, _mm512_set1_ps(-2.12194440e-4f), y);
  y = _mm512_fnmadd_ps(z, _mm512_set1_ps(0.5f), y);
  return _mm512_fmadd_ps(e, _mm512_set1_ps(0.693359375f), _mm512_add_ps(f, y));
}
#endif

// The seeded exponential race over full rows, fused: the sampled token of row r is
// argmax_j exp(x[r, j] - max_r) / E[r, j] with E = -log(u), u the seeded uniform of
// noise_uniform. That is argmax softmax(x) / E (the per-row 1 / sum does not move the argmax),
// the sampler's race, without its (rows, V) probabilities, noise and quotient passes; tokens a
// mask or filter set to -inf are skipped without hashing. A row that is all -inf, or has a NaN
// or +inf, gives 0, as the twin's argmax over its NaN probabilities does.
static int64_t seeded_race_row(const float* x, const uint32_t* tk, uint32_t k1, uint32_t k2,
                               int64_t V) {
  bool bad = false;
  const float m = row_max(x, V, &bad);
  if (bad || !std::isfinite(m)) return 0;
  float best = -1.f;
  int64_t arg = 0;
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512 vm = _mm512_set1_ps(m), ninf = _mm512_set1_ps(-INFINITY);
  const __m512i vk1 = _mm512_set1_epi32(static_cast<int>(k1));
  const __m512i vk2 = _mm512_set1_epi32(static_cast<int>(k2));
  const __m512i c1 = _mm512_set1_epi32(static_cast<int>(0x85EBCA6Bu));
  const __m512i c2 = _mm512_set1_epi32(static_cast<int>(0xC2B2AE35u));
  __m512 vbest = _mm512_set1_ps(-1.f);
  __m512i vidx = _mm512_setzero_si512();
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (; j + 16 <= V; j += 16) {
    const __m512 xv = _mm512_loadu_ps(x + j);
    const __mmask16 live = _mm512_cmp_ps_mask(xv, ninf, _CMP_NEQ_OQ);
    if (!live) continue;  // every token of the chunk removed: no noise needed
    __m512i h = _mm512_add_epi32(
        _mm512_xor_si512(_mm512_loadu_si512(reinterpret_cast<const void*>(tk + j)), vk1), vk2);
    h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
    h = _mm512_mullo_epi32(h, c1);
    h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 13));
    h = _mm512_mullo_epi32(h, c2);
    h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
    h = _mm512_and_si512(_mm512_srli_epi32(h, 9), _mm512_set1_epi32(0x7FFFFF));
    const __m512 u = _mm512_mul_ps(_mm512_add_ps(_mm512_cvtepi32_ps(h), _mm512_set1_ps(0.5f)),
                                   _mm512_set1_ps(1.f / 8388608.f));
    const __m512 noise = _mm512_sub_ps(_mm512_setzero_ps(), log16(u));
    const __m512 score = _mm512_div_ps(exp16(_mm512_sub_ps(xv, vm)), noise);
    // Strictly greater keeps each lane's first index of its maximum.
    const __mmask16 win = _mm512_mask_cmp_ps_mask(live, score, vbest, _CMP_GT_OQ);
    vbest = _mm512_mask_mov_ps(vbest, win, score);
    vidx = _mm512_mask_mov_epi32(vidx, win,
                                 _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(j))));
  }
  alignas(64) float bl[16];
  alignas(64) int32_t il[16];
  _mm512_store_ps(bl, vbest);
  _mm512_store_si512(reinterpret_cast<void*>(il), vidx);
  for (int l = 0; l < 16; ++l)  // the largest score; among equal ones the first index
    if (bl[l] > best || (bl[l] == best && bl[l] >= 0.f && il[l] < arg)) {
      best = bl[l];
      arg = il[l];
    }
#endif
  for (; j < V; ++j) {
    if (x[j] == -INFINITY) continue;
    const uint32_t h = fmix32((tk[j] ^ k1) + k2);
    const float u = (static_cast<float>((h >> 9) & 0x7FFFFFu) + 0.5f) * (1.f / 8388608.f);
    const float score = std::exp(x[j] - m) / -std::log(u);
    if (score > best) {
      best = score;
      arg = j;
    }
  }
  return arg;
}

torch::Tensor seeded_race(torch::Tensor logits, torch::Tensor token_key, torch::Tensor k1,
                          torch::Tensor k2) {
  // logits: (R, V) float32 contiguous; token_key: (V,) int32; k1, k2: (R,) int32 row keys.
  // Returns (R,) int64 sampled token ids.
  TORCH_CHECK(logits.scalar_type() == at::kFloat && token_key.scalar_type() == at::kInt &&
              k1.scalar_type() == at::kInt && k2.scalar_type() == at::kInt,
              "seeded_race: dtypes");
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && token_key.is_contiguous() &&
              k1.is_contiguous() && k2.is_contiguous(), "seeded_race: layout");
  const int64_t R = logits.size(0), V = logits.size(1);
  TORCH_CHECK(token_key.numel() == V && k1.numel() == R && k2.numel() == R,
              "seeded_race: shapes");
  auto out = torch::empty({R}, logits.options().dtype(at::kLong));
  const float* X = logits.data_ptr<float>();
  const uint32_t* tk = reinterpret_cast<const uint32_t*>(token_key.data_ptr<int32_t>());
  const uint32_t* a = reinterpret_cast<const uint32_t*>(k1.data_ptr<int32_t>());
  const uint32_t* b = reinterpret_cast<const uint32_t*>(k2.data_ptr<int32_t>());
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, R, grain_for(kElementWork * V), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) o[r] = seeded_race_row(X + r * V, tk, a[r], b[r], V);
  });
  return out;
}

// What this build was compiled for, logged at engine start.
std::string isa() {
#if defined(__AVX512BF16__)
  return "avx512-bf16";
#elif defined(__AVX512F__)
  return "avx512";
#else
  return "portable";
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "paged decode attention, optionally windowed and soft-capped");
  m.def("linear", &linear, "small-M linear", py::arg("x"), py::arg("w"), py::arg("b"));
  m.def("rms_norm", &rms_norm, "RMSNorm with optional residual add", py::arg("x"),
        py::arg("residual"), py::arg("w"), py::arg("eps"));
  m.def("rotary", &rotary, "neox rotary embedding in place");
  m.def("apply_bitmask", &apply_bitmask, "grammar bitmask applied in place");
  m.def("qk_norm_rotary", &qk_norm_rotary, "per-head q/k RMSNorm then rotary");
  m.def("write_kv_cache", &write_kv_cache, "k and v into their cache slots");
  m.def("silu_mul", &silu_mul, "silu(gate) * up");
  m.def("apply_penalties", &apply_penalties, "repetition/frequency/presence in one pass");
  m.def("logprob_stats", &logprob_stats, "logsumexp, chosen value and rank per row");
  m.def("logsumexp_rows", &logsumexp_rows, "logsumexp per row");
  m.def("min_p", &min_p, "min-p filter in place");
  m.def("top_p_mask", &top_p_mask, "top-p by radix select, in place");
  m.def("topk_rows", &topk_rows, "k largest per row, sorted");
  m.def("argmax_rows", &argmax_rows, "first index of each row's maximum");
  m.def("noise_uniform", &noise_uniform, "seeded noise's uniforms, hashed in one pass");
  m.def("seeded_race", &seeded_race, "seeded exponential race over full rows, fused");
  m.def("isa", &isa, "instruction set this build uses");
}
