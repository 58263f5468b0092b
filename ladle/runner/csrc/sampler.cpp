// Sampler passes over (rows, vocab) logits: the grammar bitmask, penalties, logsumexp and rank,
// min-p, top-p by radix select, top-k, argmax, and the seeded noise and exponential race.
#include "kernels.h"
#include "vec.h"

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

void apply_bitmask(at::Tensor logits, at::Tensor rows, at::Tensor bitmask) {
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
// Sampler passes over (rows, vocab) float32 logits, one read of each row instead of one per
// torch op (each pass over 64 x 152k floats is ~40 MB of memory traffic).

void apply_penalties(at::Tensor logits, at::Tensor counts, at::Tensor seen, at::Tensor repetition, at::Tensor frequency,
                     at::Tensor presence, bool use_rep, bool use_freq, bool use_pres) {
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

std::vector<at::Tensor> logprob_stats(at::Tensor src, at::Tensor chosen) {
  // src: (N, V) float32 contiguous; chosen: (N,) int64. Returns (logsumexp (N,), src[chosen]
  // (N,), rank (N,) int64 = 1 + number of tokens with a larger value).
  TORCH_CHECK(src.is_contiguous() && src.scalar_type() == at::kFloat, "logprob_stats: src");
  const int64_t N = src.size(0), V = src.size(1);
  auto lse = at::empty({N}, src.options());
  auto val = at::empty({N}, src.options());
  auto rank = at::empty({N}, chosen.options());
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

void top_p_mask(at::Tensor logits, at::Tensor lse, at::Tensor top_p) {
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

at::Tensor logsumexp_rows(at::Tensor src) {
  // src: (N, V) float32 contiguous. logprob_stats' pass (its rank count costs nothing beside
  // the exp in a memory-bound loop).
  auto chosen = at::zeros({src.size(0)}, src.options().dtype(at::kLong));
  return logprob_stats(src, chosen)[0];
}

void min_p(at::Tensor logits, at::Tensor log_min_p) {
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

std::vector<at::Tensor> topk_rows(at::Tensor x, int64_t k) {
  // x: (R, V) float32 contiguous; the k largest of each row, sorted descending, and their ids.
  // One pass with a k-entry min-heap: most elements lose one comparison against its root, where
  // torch.topk on a wide row does several passes.
  TORCH_CHECK(x.is_contiguous() && x.scalar_type() == at::kFloat && x.dim() == 2, "topk_rows");
  const int64_t R = x.size(0), V = x.size(1);
  TORCH_CHECK(k >= 1 && k <= V, "topk_rows: k");
  auto vals = at::empty({R, k}, x.options());
  auto ids = at::empty({R, k}, x.options().dtype(at::kLong));
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

at::Tensor argmax_rows(at::Tensor x) {
  // x: (R, V) float32 or bfloat16, contiguous, V >= 1. Returns (R,) int64.
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) >= 1, "argmax_rows: layout");
  const int64_t R = x.size(0), V = x.size(1);
  auto out = at::empty({R}, x.options().dtype(at::kLong));
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

void noise_uniform(at::Tensor token_key, at::Tensor k1, at::Tensor k2,
                   at::Tensor out) {
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

at::Tensor seeded_race(at::Tensor logits, at::Tensor token_key, at::Tensor k1,
                       at::Tensor k2) {
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
  auto out = at::empty({R}, logits.options().dtype(at::kLong));
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
