// Elementwise passes of the decode path: RMSNorm (with the residual add), rotary, q/k norm +
// rotary, the KV-cache write and silu * up.
#include "kernels.h"
#include "vec.h"

#include <type_traits>

// ---------------------------------------------------------------------------------------------
// RMSNorm over the last dimension, optionally after adding a residual (in place), in one pass per
// row instead of eight torch ops. Numerics follow the HF reference: normalise in float32, round
// to T, then multiply by the weight in T.

// Sums of squares of N rows of D values in float32, each row's in one order (16 lanes, then the
// tail): the rows' chains of dependent fmas interleave (one head of 128 values alone waits on 8
// fmas, a reduction and a square root before the next head starts).
template <int N, typename T>
static inline void sum_squares_n(const T* const* x, int64_t D, float* ss) {
  int64_t d = 0;
  for (int i = 0; i < N; ++i) ss[i] = 0.f;
#if defined(__AVX512F__)
  __m512 acc[N];
  for (int i = 0; i < N; ++i) acc[i] = _mm512_setzero_ps();
  for (; d + 16 <= D; d += 16)
    for (int i = 0; i < N; ++i) {
      const __m512 v = load16(x[i] + d);
      acc[i] = _mm512_fmadd_ps(v, v, acc[i]);
    }
  for (int i = 0; i < N; ++i) ss[i] = _mm512_reduce_add_ps(acc[i]);
#endif
  for (int i = 0; i < N; ++i)
    for (int64_t e = d; e < D; ++e) ss[i] += to_f(x[i][e]) * to_f(x[i][e]);
}

template <typename T>
static inline float sum_squares(const T* x, int64_t D) {  // one row
  float ss;
  sum_squares_n<1>(&x, D, &ss);
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
    const __m512 y = _mm512_mul_ps(load16(w + d), n);
    if constexpr (std::is_same_v<O, float>)
      store_round(out + d, round_to(y, x));  // (store_round to float keeps every bit)
    else
      store_round(out + d, y);
  }
#endif
  for (; d < D; ++d)
    out[d] = static_cast<O>(static_cast<T>(to_f(w[d]) * to_f(static_cast<T>(to_f(x[d]) * inv))));
}

// out[d] = x[d] * inv * w[d] in float32, rounded to T once: the weight given in float32 (Gemma's
// 1 + w, which HF computes and multiplies in float32 before its one cast).
template <typename T>
static inline void scale_row_f32(const T* x, const float* w, float inv, int64_t D, T* out) {
  int64_t d = 0;
#if defined(__AVX512F__)
  const __m512 vinv = _mm512_set1_ps(inv);
  for (; d + 16 <= D; d += 16)
    store_round(out + d, _mm512_mul_ps(_mm512_mul_ps(load16(x + d), vinv), load16(w + d)));
#endif
  for (; d < D; ++d) out[d] = static_cast<T>(to_f(x[d]) * inv * w[d]);
}

template <typename T, typename W>
static void rms_norm_kernel(const T* x, T* residual, const W* w, T* out, int64_t R, int64_t D,
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
          store_round(rr + d, _mm512_add_ps(load16(rr + d), load16(src + d)));
#endif
        for (; d < D; ++d) rr[d] = static_cast<T>(to_f(rr[d]) + to_f(src[d]));
        src = rr;
      }
      const float inv = 1.f / std::sqrt(sum_squares(src, D) / D + eps);
      if constexpr (std::is_same_v<W, T>)
        scale_row(src, w, inv, D, out + r * D);
      else
        scale_row_f32(src, w, inv, D, out + r * D);
    }
  });
}

at::Tensor rms_norm(at::Tensor x, c10::optional<at::Tensor> residual, at::Tensor w,
                    double eps) {
  // x: (R, D) or (T, H, D), unit stride in D and heads adjacent; residual: contiguous, same
  // number of rows, updated in place to residual + x; w: (D,). Returns a contiguous x's shape.
  TORCH_CHECK(x.dim() == 2 || x.dim() == 3, "rms_norm: 2 or 3 dims");
  const int64_t D = x.size(-1);
  const int64_t inner = x.dim() == 3 ? x.size(1) : 1;
  TORCH_CHECK(x.stride(-1) == 1 && (x.dim() == 2 || x.stride(1) == D) && w.is_contiguous(),
              "rms_norm: layout");
  const int64_t R = x.numel() / D;
  auto out = at::empty(x.sizes(), x.options());
  const bool has_r = residual.has_value() && residual->defined();
  if (has_r) TORCH_CHECK(residual->is_contiguous() && residual->numel() == x.numel(),
                         "rms_norm: residual");
  if (x.scalar_type() == at::kBFloat16) {
    at::BFloat16* r = has_r ? residual->data_ptr<at::BFloat16>() : nullptr;
    if (w.scalar_type() == at::kFloat)  // a float32 weight: multiplied in float32, one rounding
      rms_norm_kernel<at::BFloat16, float>(x.data_ptr<at::BFloat16>(), r, w.data_ptr<float>(),
                                           out.data_ptr<at::BFloat16>(), R, D, inner,
                                           x.stride(0), (float)eps);
    else
      rms_norm_kernel<at::BFloat16, at::BFloat16>(x.data_ptr<at::BFloat16>(), r,
                                                  w.data_ptr<at::BFloat16>(),
                                                  out.data_ptr<at::BFloat16>(), R, D, inner,
                                                  x.stride(0), (float)eps);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "rms_norm: bfloat16 or float32");
    rms_norm_kernel<float, float>(x.data_ptr<float>(), has_r ? residual->data_ptr<float>() : nullptr,
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

void rotary(at::Tensor q, at::Tensor k, at::Tensor positions, at::Tensor cos,
            at::Tensor sin) {
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
    std::vector<const T*> heads(H + KVH);
    std::vector<float> ss(H + KVH + 3);
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos + pos[t] * half;
      const float* s = sin + pos[t] * half;
      // Every head's sum of squares first, four heads interleaved.
      for (int64_t h = 0; h < H; ++h) heads[h] = q + t * ldq + h * D;
      for (int64_t h = 0; h < KVH; ++h) heads[H + h] = k + t * ldk + h * D;
      int64_t h4 = 0;
      for (; h4 + 4 <= H + KVH; h4 += 4) sum_squares_n<4>(heads.data() + h4, D, ss.data() + h4);
      for (; h4 < H + KVH; ++h4) ss[h4] = sum_squares(heads[h4], D);
      int64_t head = 0;
      auto one = [&](const T* x, T* o, const T* w) {
        const float inv = 1.f / std::sqrt(ss[head++] / D + eps);
        // The norm's output is rounded to T (as the unfused layers store it), then rotated.
        scale_row(x, w, inv, D, row.data());
        int64_t i = 0;
#if defined(__AVX512F__)
        for (; i + 16 <= half; i += 16) {
          const __m512 x1 = _mm512_loadu_ps(row.data() + i);
          const __m512 x2 = _mm512_loadu_ps(row.data() + i + half);
          const __m512 ci = _mm512_loadu_ps(c + i), si = _mm512_loadu_ps(s + i);
          store_round(o + i, _mm512_sub_ps(_mm512_mul_ps(x1, ci), _mm512_mul_ps(x2, si)));
          store_round(o + i + half, _mm512_add_ps(_mm512_mul_ps(x2, ci), _mm512_mul_ps(x1, si)));
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

std::vector<at::Tensor> qk_norm_rotary(at::Tensor q, at::Tensor k, at::Tensor wq,
                                       at::Tensor wk, double eps, at::Tensor positions,
                                       at::Tensor cos, at::Tensor sin) {
  // q: (T, H, D), k: (T, KVH, D) with heads adjacent (views into the qkv output are fine).
  // Returns new contiguous (q, k): RMSNorm per head with wq / wk, then neox rotary.
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "qk_norm_rotary: q layout");
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == k.size(2), "qk_norm_rotary: k layout");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous(),
              "qk_norm_rotary: tables");
  const int64_t Tn = q.size(0), H = q.size(1), KVH = k.size(1), D = q.size(2);
  auto qo = at::empty({Tn, H, D}, q.options());
  auto ko = at::empty({Tn, KVH, D}, k.options());
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

void write_kv_cache(at::Tensor k, at::Tensor v, at::Tensor k_cache, at::Tensor v_cache,
                    at::Tensor slot_blocks, at::Tensor slot_offsets) {
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
void silu_mul_kernel(const T* x, T* out, int64_t R, int64_t I, int64_t ldx) {
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
        store_round(o + i, _mm512_mul_ps(sg, load16(up + i)));
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

template void silu_mul_kernel<float>(const float*, float*, int64_t, int64_t, int64_t);
template void silu_mul_kernel<at::BFloat16>(const at::BFloat16*, at::BFloat16*, int64_t, int64_t,
                                            int64_t);

at::Tensor silu_mul(at::Tensor x) {
  // x: (R, 2I) = [gate | up] per row, unit stride; returns silu(gate) * up, (R, I).
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0, "silu_mul: layout");
  const int64_t R = x.size(0), I = x.size(1) / 2;
  auto out = at::empty({R, I}, x.options());
  if (x.scalar_type() == at::kBFloat16) {
    silu_mul_kernel<at::BFloat16>(x.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), R, I,
                                  x.stride(0));
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "silu_mul: bfloat16 or float32");
    silu_mul_kernel<float>(x.data_ptr<float>(), out.data_ptr<float>(), R, I, x.stride(0));
  }
  return out;
}

// gelu(gate) * up per row, rounded as torch rounds it: gelu to T, then the product to T.
// tanh_approx: HF's gelu_pytorch_tanh, 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))), computed
// as the equal g / (1 + exp(-2 sqrt(2/pi) (g + 0.044715 g^3))) (0.5 (1 + tanh u) is the
// logistic function of 2u): the vector exp of silu_mul, 16 at a time, where std::tanh per
// element (two libm calls) took a third of Gemma 3 270M's prefill. Else the exact
// 0.5 g (1 + erf(g / sqrt(2))), std::erf per element. Every element of a column is computed the
// same way wherever its row sits in the batch (torch's elementwise ops split the flat tensor
// across threads, and an element that falls in a chunk's tail takes a scalar path that can
// round differently from the vector one).
template <typename T>
static void gelu_mul_kernel(const T* x, T* out, int64_t R, int64_t I, int64_t ldx,
                            bool tanh_approx) {
  at::parallel_for(0, R, grain_for(kElementWork * I), [&](int64_t begin, int64_t end) {
    constexpr float kBeta2 = 2 * 0.7978845608028654f;  // 2 sqrt(2 / pi)
    constexpr float kCube = 0.044715f;
    constexpr float kInvSqrt2 = 0.7071067811865476f;
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = x + r * ldx;
      const T* up = gate + I;
      T* o = out + r * I;
      int64_t i = 0;
#if defined(__AVX512F__)
      if (tanh_approx) {
        for (; i + 16 <= I; i += 16) {
          const __m512 g = load16(gate + i);
          const __m512 u = _mm512_mul_ps(
              _mm512_fmadd_ps(_mm512_mul_ps(_mm512_mul_ps(g, g), g), _mm512_set1_ps(kCube), g),
              _mm512_set1_ps(-kBeta2));
          const __m512 ge = round_to(
              _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(u))), o);
          store_round(o + i, _mm512_mul_ps(ge, load16(up + i)));
        }
      }
#endif
      for (; i < I; ++i) {
        const float g = to_f(gate[i]);
        const float ge = tanh_approx
                             ? g / (1.f + std::exp(-kBeta2 * std::fma(g * g * g, kCube, g)))
                             : 0.5f * g * (1.f + std::erf(g * kInvSqrt2));
        o[i] = static_cast<T>(to_f(static_cast<T>(ge)) * to_f(up[i]));
      }
    }
  });
}

at::Tensor gelu_mul(at::Tensor x, bool tanh_approx) {
  // x: (R, 2I) = [gate | up] per row, unit stride; returns gelu(gate) * up, (R, I).
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0, "gelu_mul: layout");
  const int64_t R = x.size(0), I = x.size(1) / 2;
  auto out = at::empty({R, I}, x.options());
  if (x.scalar_type() == at::kBFloat16) {
    gelu_mul_kernel<at::BFloat16>(x.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), R, I,
                                  x.stride(0), tanh_approx);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "gelu_mul: bfloat16 or float32");
    gelu_mul_kernel<float>(x.data_ptr<float>(), out.data_ptr<float>(), R, I, x.stride(0),
                           tanh_approx);
  }
  return out;
}
