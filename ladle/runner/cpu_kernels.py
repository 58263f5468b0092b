"""A fused paged-attention kernel for decoding on CPU, compiled once on first use.

Decode attention is memory bound: each step must read every cached key and value once. In torch
ops the paged cache first has to be gathered into a padded copy, which costs more than the
attention itself. This kernel reads the blocks in place (one thread per sequence and KV head,
online softmax in float32) so a step reads the cache once. When the compiler or the build is not
available, ladle falls back to the torch path in attention.py, which computes the same thing."""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
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

#ifdef __AVX512F__
#include <immintrin.h>
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const at::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
#endif

// dots[g] = q[g] . k for the G query heads sharing one KV head (q: G rows of D floats).
template <typename T>
static inline void dots(const float* q, const T* k, int64_t G, int64_t D, float* out) {
#ifdef __AVX512F__
  if (D % 16 == 0 && G <= 8) {
    __m512 acc[8];
    for (int64_t g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
      const __m512 kv = load16(k + d);
      for (int64_t g = 0; g < G; ++g) acc[g] = _mm512_fmadd_ps(load16(q + g * D + d), kv, acc[g]);
    }
    for (int64_t g = 0; g < G; ++g) out[g] = _mm512_reduce_add_ps(acc[g]);
    return;
  }
#endif
  for (int64_t g = 0; g < G; ++g) {
    float dot = 0.f;
    for (int64_t d = 0; d < D; ++d) dot += q[g * D + d] * to_f(k[d]);
    out[g] = dot;
  }
}

// acc[g] += p[g] * v for the G query heads.
template <typename T>
static inline void axpys(float* acc, const float* p, const T* v, int64_t G, int64_t D) {
#ifdef __AVX512F__
  if (D % 16 == 0) {
    for (int64_t d = 0; d < D; d += 16) {
      const __m512 vv = load16(v + d);
      for (int64_t g = 0; g < G; ++g) {
        float* a = acc + g * D + d;
        _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_set1_ps(p[g]), vv, _mm512_loadu_ps(a)));
      }
    }
    return;
  }
#endif
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; ++d) acc[g * D + d] += p[g] * to_f(v[d]);
}

template <typename T>
static void decode_kernel(const T* q, const T* kc, const T* vc, const int64_t* bt,
                          const int64_t* ctx, T* out, int64_t B, int64_t H, int64_t KVH,
                          int64_t D, int64_t bs, int64_t max_blocks, float scale) {
  const int64_t G = H / KVH;
  // Cache layout: (num_blocks, KVH, bs, D); one block of one head is bs*D contiguous values.
  // Two passes per (sequence, KV head): scores for every cached key (stored token-major as
  // scores[t * G + g]), then the softmax-weighted sum of values. Each key and value is read
  // once.
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), scores, mx(G), sum(G);
    for (int64_t job = begin; job < end; ++job) {
      const int64_t b = job / KVH, h = job % KVH;
      const int64_t n = ctx[b];
      scores.resize(G * n);
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          qf[g * D + d] = to_f(q[(b * H + h * G + g) * D + d]) * scale;
      for (int64_t t = 0; t < n; ++t) {
        const T* k = kc + ((bt[b * max_blocks + t / bs] * KVH + h) * bs + t % bs) * D;
        dots(qf.data(), k, G, D, &scores[t * G]);
      }
      for (int64_t g = 0; g < G; ++g) { mx[g] = -INFINITY; sum[g] = 0.f; }
      for (int64_t t = 0; t < n; ++t)
        for (int64_t g = 0; g < G; ++g) mx[g] = std::max(mx[g], scores[t * G + g]);
      for (int64_t t = 0; t < n; ++t)
        for (int64_t g = 0; g < G; ++g) {
          const float e = std::exp(scores[t * G + g] - mx[g]);
          scores[t * G + g] = e;
          sum[g] += e;
        }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < n; ++t) {
        const T* v = vc + ((bt[b * max_blocks + t / bs] * KVH + h) * bs + t % bs) * D;
        axpys(acc.data(), &scores[t * G], v, G, D);
      }
      for (int64_t g = 0; g < G; ++g) {
        const float inv = 1.f / sum[g];
        for (int64_t d = 0; d < D; ++d)
          out[(b * H + h * G + g) * D + d] = static_cast<T>(acc[g * D + d] * inv);
      }
    }
  });
}

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_table, torch::Tensor ctx_lens,
                                     double scale) {
  // q: (B, H, D); caches: (num_blocks, KVH, bs, D); block_table: (B, max_blocks) int64.
  auto out = torch::empty_like(q);
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = k_cache.size(1), bs = k_cache.size(2);
  if (q.scalar_type() == at::kBFloat16) {
    decode_kernel<at::BFloat16>(q.data_ptr<at::BFloat16>(), k_cache.data_ptr<at::BFloat16>(),
                                v_cache.data_ptr<at::BFloat16>(), block_table.data_ptr<int64_t>(),
                                ctx_lens.data_ptr<int64_t>(), out.data_ptr<at::BFloat16>(), B, H,
                                KVH, D, bs, block_table.size(1), (float)scale);
  } else {
    decode_kernel<float>(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                         block_table.data_ptr<int64_t>(), ctx_lens.data_ptr<int64_t>(),
                         out.data_ptr<float>(), B, H, KVH, D, bs, block_table.size(1),
                         (float)scale);
  }
  return out;
}
"""

_module = None
_tried = False


def load_cpu_kernels():
    """The compiled module, or None when it cannot be built here (then torch ops are used).
    LADLE_DISABLE_CPU_KERNELS=1 forces the torch path."""
    global _module, _tried
    if _tried:
        return _module
    _tried = True
    if os.environ.get("LADLE_DISABLE_CPU_KERNELS") == "1":
        return None
    try:
        from torch.utils.cpp_extension import load_inline

        _module = load_inline(
            name="ladle_cpu_kernels_v4",
            cpp_sources=_SOURCE,
            functions=["paged_decode_attention"],
            # Reassociation lets the dot products vectorise; no finite-math (softmax uses -inf).
            extra_cflags=["-O3", "-march=native", "-fno-math-errno", "-fassociative-math",
                          "-fno-signed-zeros", "-fno-trapping-math", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as e:  # no compiler, no headers, read-only cache: all mean "use torch"
        logger.warning("CPU attention kernel unavailable (%s); using the torch path", e)
        _module = None
    return _module


def supports(q: torch.Tensor) -> bool:
    return q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float32)
