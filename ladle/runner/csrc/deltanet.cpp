// The recurrent step of Gated DeltaNet (ladle/models/gated_deltanet.py), one token of D
// sequences: for each (sequence, value head) pair, with S its (dk, dv) state,
//
//   read   = [q; k]^T S                        one pass over S
//   delta  = beta * (v - e^g * (k^T S))        the error the delta rule writes
//   out    = e^g * (q^T S) + (q . k) * delta   = q^T S_new, without reading S_new
//   S_new  = e^g * S + k delta^T               a second pass (S still in cache), one write
//
// so each state is read from memory once and written once, where the torch twin
// (recurrent_gated_delta_step) passes over it five times. The new states go to a fresh tensor:
// the engine applies them only when the step succeeds. Pairs are independent, so a sequence's
// numbers do not depend on the batch.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels.h"

// The step for every (sequence d, value head h) pair: its q and k at qp / kp + d * qk_row +
// (h / r) * dk (the r value heads of a key head read it in place), v at vp + d * v_row + h * dv,
// g and beta at d * H + h; sequence d starts from state[row[d]], or zeros where keeps[d] is
// false. out (D, H, dv) and the new states (D, H, dk, dv) at op and np.
static void delta_pairs(const float* qp, const float* kp, int64_t qk_row, int64_t r,
                        const float* vp, int64_t v_row, const float* gp, const float* bp,
                        const float* sp,
                        const int64_t* row, const bool* keeps, int64_t D, int64_t H, int64_t dk,
                        int64_t dv, float* op, float* np) {
  at::parallel_for(0, D * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q_read(dv), delta(dv);
    for (int64_t p = begin; p < end; ++p) {
      const int64_t d = p / H, h = p % H;
      const float* qi = qp + d * qk_row + h / r * dk;
      const float* ki = kp + d * qk_row + h / r * dk;
      const float* vi = vp + d * v_row + h * dv;
      const float decay = std::exp(gp[p]), b = bp[p];
      const float* s = keeps[d] ? sp + (row[d] * H + h) * dk * dv : nullptr;
      float* s_new = np + p * dk * dv;
      float qk = 0.f;
      for (int64_t i = 0; i < dk; ++i) qk += qi[i] * ki[i];
      std::fill(q_read.begin(), q_read.end(), 0.f);
      std::fill(delta.begin(), delta.end(), 0.f);  // k^T S first, then the delta in place
      float* qr = q_read.data();
      float* dl = delta.data();
      if (s != nullptr) {
        for (int64_t i = 0; i < dk; ++i) {
          const float a = qi[i], c = ki[i];
          const float* srow = s + i * dv;
          for (int64_t j = 0; j < dv; ++j) {
            qr[j] += a * srow[j];
            dl[j] += c * srow[j];
          }
        }
      }
      float* o = op + p * dv;
      for (int64_t j = 0; j < dv; ++j) {
        dl[j] = b * (vi[j] - decay * dl[j]);
        o[j] = decay * qr[j] + qk * dl[j];
      }
      for (int64_t i = 0; i < dk; ++i) {
        const float c = ki[i];
        float* nrow = s_new + i * dv;
        if (s != nullptr) {
          const float* srow = s + i * dv;
          for (int64_t j = 0; j < dv; ++j) nrow[j] = decay * srow[j] + c * dl[j];
        } else {
          for (int64_t j = 0; j < dv; ++j) nrow[j] = c * dl[j];
        }
      }
    }
  });
}

std::vector<at::Tensor> gated_delta_step(at::Tensor q, at::Tensor k, at::Tensor v,
                                         at::Tensor g, at::Tensor beta,
                                         at::Tensor state, at::Tensor rows,
                                         at::Tensor keep) {
  TORCH_CHECK(q.dim() == 3 && k.sizes() == q.sizes() && v.dim() == 3 &&
                  v.size(0) == q.size(0) && v.size(1) == q.size(1),
              "gated_delta_step: q, k (D, H, dk) and v (D, H, dv)");
  const int64_t D = q.size(0), H = q.size(1), dk = q.size(2), dv = v.size(2);
  TORCH_CHECK(state.dim() == 4 && state.size(1) == H && state.size(2) == dk &&
                  state.size(3) == dv,
              "gated_delta_step: state (N, H, dk, dv)");
  TORCH_CHECK(g.dim() == 2 && g.size(0) == D && g.size(1) == H && beta.sizes() == g.sizes(),
              "gated_delta_step: g and beta (D, H)");
  TORCH_CHECK(rows.numel() == D && keep.numel() == D, "gated_delta_step: rows and keep (D,)");
  for (const auto& t : {q, k, v, g, beta, state})
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous(),
                "gated_delta_step: float32 contiguous tensors");
  TORCH_CHECK(rows.scalar_type() == at::kLong && keep.scalar_type() == at::kBool,
              "gated_delta_step: rows int64, keep bool");
  auto rows_c = rows.contiguous();
  auto keep_c = keep.contiguous();
  const int64_t* row = rows_c.data_ptr<int64_t>();
  const bool* keeps = keep_c.data_ptr<bool>();
  const int64_t N = state.size(0);
  for (int64_t d = 0; d < D; ++d)
    TORCH_CHECK(!keeps[d] || (row[d] >= 0 && row[d] < N), "gated_delta_step: row out of range");

  auto out = at::empty({D, H, dv}, q.options());
  auto next = at::empty({D, H, dk, dv}, q.options());
  delta_pairs(q.data_ptr<float>(), k.data_ptr<float>(), H * dk, 1, v.data_ptr<float>(), H * dv,
              g.data_ptr<float>(), beta.data_ptr<float>(), state.data_ptr<float>(), row, keeps,
              D, H, dk, dv, out.data_ptr<float>(), next.data_ptr<float>());
  return {out, next};
}

// The conv part of a decode token for D rows (x: the projected q|k|v, row stride ldx): each
// channel's window (its K - 1 kept inputs, then the new one) times the conv weight w (C, K),
// SiLU, rounded through T (transformers' conv returns the model's dtype), into mixed (D, C);
// the new windows (D, C, K - 1) into wn; then q and k of each row l2-normalised per key head
// (x / sqrt(sum x^2 + 1e-6)), q scaled by dk^-1/2.
static void normalize_qk(float* mx, int64_t R, int64_t C, int64_t nk, int64_t dk);

template <typename T>
static void conv_heads(const float* cs, const float* wp, const T* x, int64_t ldx, int64_t D,
                       int64_t C, int64_t K, int64_t nk, int64_t dk, float* mx, float* wn) {
  at::parallel_for(0, D * C, 2048, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t d = i / C, c = i % C;
      const float xi = float(x[d * ldx + c]);
      const float* win = cs + i * (K - 1);
      const float* wc = wp + c * K;
      float acc = 0.f;
      for (int64_t t = 0; t < K - 1; ++t) acc += win[t] * wc[t];
      acc += xi * wc[K - 1];
      mx[i] = float(T(acc / (1.f + std::exp(-acc))));
      float* wo = wn + i * (K - 1);
      for (int64_t t = 0; t + 1 < K - 1; ++t) wo[t] = win[t + 1];
      wo[K - 2] = xi;
    }
  });
  normalize_qk(mx, D, C, nk, dk);
}

// q and k of each of the R rows of mixed (R, C) l2-normalised per key head in place (x /
// sqrt(sum x^2 + 1e-6)), q also scaled by dk^-1/2.
static void normalize_qk(float* mx, int64_t R, int64_t C, int64_t nk, int64_t dk) {
  const float q_scale = 1.f / std::sqrt(float(dk));
  at::parallel_for(0, R * 2 * nk, 16, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t d = p / (2 * nk), j = p % (2 * nk);
      float* h = mx + d * C + j * dk;
      float ss = 0.f;
      for (int64_t i = 0; i < dk; ++i) ss += h[i] * h[i];
      const float inv = 1.f / std::sqrt(ss + 1e-6f) * (j < nk ? q_scale : 1.f);
      for (int64_t i = 0; i < dk; ++i) h[i] *= inv;
    }
  });
}

static void check_step_args(const at::Tensor& conv_state, const at::Tensor& w,
                            const at::Tensor& x, const at::Tensor& state,
                            const at::Tensor& rows, const at::Tensor& keep, int64_t nk,
                            int64_t dk, const char* name) {
  TORCH_CHECK(conv_state.dim() == 3 && x.dim() == 2 && x.size(0) == conv_state.size(0) &&
                  x.size(1) == conv_state.size(1) && w.dim() == 2 &&
                  w.size(0) == x.size(1) && w.size(1) == conv_state.size(2) + 1,
              name, ": conv_state (D, C, K - 1), x (D, C), w (C, K)");
  TORCH_CHECK(state.dim() == 4, name, ": state (N, H, dk, dv)");
  const int64_t H = state.size(1), C = x.size(1), D = x.size(0);
  TORCH_CHECK(nk >= 1 && H % nk == 0 && state.size(2) == dk &&
                  C == 2 * nk * dk + H * state.size(3),
              name, ": C = 2 nk dk + H dv, H a multiple of nk");
  for (const auto& t : {conv_state, w, state})
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous(), name,
                ": float32 contiguous conv_state, w, state");
  TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  x.stride(1) == 1, name, ": x float32 or bfloat16, rows contiguous");
  TORCH_CHECK(rows.numel() == D && keep.numel() == D && rows.scalar_type() == at::kLong &&
                  keep.scalar_type() == at::kBool, name, ": rows int64 and keep bool, (D,)");
}

static std::vector<int64_t> checked_rows(const at::Tensor& rows, const at::Tensor& keep,
                                         std::vector<uint8_t>& keeps, int64_t N,
                                         const char* name) {
  auto r = rows.contiguous();
  auto k = keep.contiguous();
  std::vector<int64_t> out(r.data_ptr<int64_t>(), r.data_ptr<int64_t>() + r.numel());
  keeps.assign(k.data_ptr<bool>(), k.data_ptr<bool>() + k.numel());
  for (size_t d = 0; d < out.size(); ++d)
    TORCH_CHECK(!keeps[d] || (out[d] >= 0 && out[d] < N), name, ": row out of range");
  return out;
}

// The gated RMSNorm of each (row, head) output of a decode token: see gated_delta_decode.
template <typename T>
static void gated_norm_rows(const float* out, const T* z, int64_t ldz, const float* nw,
                            double eps, int64_t D, int64_t H, int64_t dv, T* y) {
  at::parallel_for(0, D * H, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> h(dv);
    for (int64_t p = begin; p < end; ++p) {
      const int64_t d = p / H, hd = p % H;
      const float* o = out + p * dv;
      float ss = 0.f;
      for (int64_t j = 0; j < dv; ++j) {
        h[j] = float(T(o[j]));
        ss += h[j] * h[j];
      }
      const float r = 1.f / std::sqrt(ss / float(dv) + float(eps));
      const T* zr = z + d * ldz + hd * dv;
      T* yr = y + d * H * dv + hd * dv;
      for (int64_t j = 0; j < dv; ++j) {
        const float n = float(T(nw[j] * float(T(h[j] * r))));
        const float gate = float(zr[j]);
        yr[j] = T(n * (gate / (1.f + std::exp(-gate))));
      }
    }
  });
}

// A whole decode token of D sequences between a linear layer's projections, in one call (the
// torch ops of GatedDeltaNet._step_torch, its twin): beta = sigmoid(b) and g = -exp(A_log)
// softplus(a + dt_bias) from the projected b and a; conv_heads; the step above, each key head
// read in place by its H / nk value heads; then the gated RMSNorm of each head's output with
// the model's roundings (the output rounded to T, normalised in float32, rounded, times the
// norm weight in T, times SiLU(z) in float32, rounded). conv_state (D, C, K - 1) float32, qkv
// (D, C), z (D, H dv), b and a (D, H): T, rows contiguous; A_log and dt_bias (H,), norm_w (dv,)
// in T; state (N, H, dk, dv) float32, sequence d reading row rows[d] (zeros where keep[d] is
// false). Returns (y (D, H dv) in T, the new windows (D, C, K - 1), the new states).
std::vector<at::Tensor> gated_delta_decode(at::Tensor conv_state, at::Tensor w, at::Tensor qkv,
                                           at::Tensor z, at::Tensor b, at::Tensor a,
                                           at::Tensor A_log, at::Tensor dt_bias,
                                           at::Tensor norm_w, double eps, at::Tensor state,
                                           at::Tensor rows, at::Tensor keep, int64_t nk,
                                           int64_t dk) {
  const char* name = "gated_delta_decode";
  check_step_args(conv_state, w, qkv, state, rows, keep, nk, dk, name);
  const int64_t D = qkv.size(0), C = qkv.size(1), K = w.size(1);
  const int64_t H = state.size(1), dv = state.size(3);
  const auto dt = qkv.scalar_type();
  TORCH_CHECK(z.dim() == 2 && z.size(0) == D && z.size(1) == H * dv && b.dim() == 2 &&
                  b.size(0) == D && b.size(1) == H && a.sizes() == b.sizes(),
              name, ": z (D, H dv), b and a (D, H)");
  for (const auto& t : {z, b, a})
    TORCH_CHECK(t.scalar_type() == dt && t.stride(1) == 1, name,
                ": z, b and a in qkv's dtype, rows contiguous");
  TORCH_CHECK(A_log.numel() == H && dt_bias.numel() == H && norm_w.numel() == dv &&
                  norm_w.scalar_type() == dt,
              name, ": A_log and dt_bias (H,), norm_w (dv,) in qkv's dtype");
  std::vector<uint8_t> keeps;
  const auto row = checked_rows(rows, keep, keeps, state.size(0), name);
  auto fopt = conv_state.options();
  auto A = A_log.to(at::kFloat).contiguous(), bias = dt_bias.to(at::kFloat).contiguous();
  auto nwf = norm_w.to(at::kFloat).contiguous();
  auto g = at::empty({D, H}, fopt), beta = at::empty({D, H}, fopt);
  float *gp = g.data_ptr<float>(), *bp = beta.data_ptr<float>();
  const float *Ap = A.data_ptr<float>(), *bias_p = bias.data_ptr<float>();
  auto windows = at::empty({D, C, K - 1}, fopt);
  auto mixed = at::empty({D, C}, fopt);
  float* mx = mixed.data_ptr<float>();
  auto out = at::empty({D, H, dv}, fopt);
  auto next = at::empty({D, H, dk, dv}, fopt);
  auto y = at::empty({D, H * dv}, qkv.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, dt, "gated_delta_decode", [&] {
    using T = scalar_t;
    const T *bb = b.data_ptr<T>(), *aa = a.data_ptr<T>();
    for (int64_t d = 0; d < D; ++d)
      for (int64_t h = 0; h < H; ++h) {
        const float bv = float(bb[d * b.stride(0) + h]);
        bp[d * H + h] = float(T(1.f / (1.f + std::exp(-bv))));  // sigmoid in T
        const float x = float(aa[d * a.stride(0) + h]) + bias_p[h];
        const float sp = x > 20.f ? x : std::log1p(std::exp(x));  // torch's softplus
        gp[d * H + h] = -std::exp(Ap[h]) * sp;
      }
    conv_heads(conv_state.data_ptr<float>(), w.data_ptr<float>(), qkv.data_ptr<T>(),
               qkv.stride(0), D, C, K, nk, dk, mx, windows.data_ptr<float>());
    delta_pairs(mx, mx + nk * dk, C, H / nk, mx + 2 * nk * dk, C, gp, bp,
                state.data_ptr<float>(), row.data(), reinterpret_cast<const bool*>(keeps.data()),
                D, H, dk, dv, out.data_ptr<float>(), next.data_ptr<float>());
    gated_norm_rows(out.data_ptr<float>(), z.data_ptr<T>(), z.stride(0), nwf.data_ptr<float>(),
                    eps, D, H, dv, y.data_ptr<T>());
  });
  return {y, windows, next};
}

// The conv part of a prompt's L tokens of one sequence: each channel's causal conv over the K - 1
// inputs kept before it (conv_state (C, K - 1)) and the new ones x (L, C, row stride ldx), SiLU,
// rounded through T, into mixed (L, C) with q and k normalised as conv_heads does; the window
// after the last token into wn (C, K - 1). Channels in blocks of 64, each a pass over the
// tokens (x read row by row, no transposes).
template <typename T>
static void conv_seq(const float* cs, const float* wp, const T* x, int64_t ldx, int64_t L,
                     int64_t C, int64_t K, float* mx, float* wn) {
  constexpr int64_t kBlock = 64;
  at::parallel_for(0, (C + kBlock - 1) / kBlock, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> hist(size_t((K - 1) * kBlock));  // [tap][channel]: oldest first
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t c0 = blk * kBlock, n = std::min(kBlock, C - c0);
      for (int64_t j = 0; j < n; ++j)
        for (int64_t t = 0; t < K - 1; ++t) hist[t * kBlock + j] = cs[(c0 + j) * (K - 1) + t];
      for (int64_t t = 0; t < L; ++t) {
        const T* xr = x + t * ldx + c0;
        float* out = mx + t * C + c0;
        for (int64_t j = 0; j < n; ++j) {
          const float* wc = wp + (c0 + j) * K;
          const float xi = float(xr[j]);
          float acc = 0.f;
          for (int64_t k = 0; k < K - 1; ++k) acc += hist[k * kBlock + j] * wc[k];
          acc += xi * wc[K - 1];
          out[j] = float(T(acc / (1.f + std::exp(-acc))));
          for (int64_t k = 0; k + 1 < K - 1; ++k) hist[k * kBlock + j] = hist[(k + 1) * kBlock + j];
          hist[(K - 2) * kBlock + j] = xi;
        }
      }
      for (int64_t j = 0; j < n; ++j)
        for (int64_t t = 0; t < K - 1; ++t) wn[(c0 + j) * (K - 1) + t] = hist[t * kBlock + j];
    }
  });
}

// A prompt's conv part (GatedDeltaNet._prefill's torch conv, SiLU, round trip and q/k norms):
// conv_state (C, K - 1) and w (C, K) float32, x (L, C) float32 or bfloat16 (rows contiguous).
// Returns (mixed (L, C) float32: q and k normalised, q scaled, then v; the window after the
// last token (C, K - 1)).
std::vector<at::Tensor> gated_delta_conv_prefill(at::Tensor conv_state, at::Tensor w,
                                                 at::Tensor x, int64_t nk, int64_t dk) {
  TORCH_CHECK(conv_state.dim() == 2 && w.dim() == 2 && x.dim() == 2 &&
                  w.size(0) == conv_state.size(0) && w.size(1) == conv_state.size(1) + 1 &&
                  x.size(1) == w.size(0) && w.size(1) >= 2,
              "gated_delta_conv_prefill: conv_state (C, K - 1), w (C, K), x (L, C)");
  TORCH_CHECK(conv_state.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat &&
                  conv_state.is_contiguous() && w.is_contiguous(),
              "gated_delta_conv_prefill: float32 contiguous conv_state and w");
  TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  x.stride(1) == 1, "gated_delta_conv_prefill: x float32 or bfloat16");
  const int64_t L = x.size(0), C = x.size(1), K = w.size(1);
  TORCH_CHECK(nk >= 1 && dk >= 1 && 2 * nk * dk <= C, "gated_delta_conv_prefill: 2 nk dk <= C");
  auto mixed = at::empty({L, C}, conv_state.options());
  auto window = at::empty({C, K - 1}, conv_state.options());
  if (x.scalar_type() == at::kBFloat16)
    conv_seq(conv_state.data_ptr<float>(), w.data_ptr<float>(), x.data_ptr<at::BFloat16>(),
             x.stride(0), L, C, K, mixed.data_ptr<float>(), window.data_ptr<float>());
  else
    conv_seq(conv_state.data_ptr<float>(), w.data_ptr<float>(), x.data_ptr<float>(),
             x.stride(0), L, C, K, mixed.data_ptr<float>(), window.data_ptr<float>());
  normalize_qk(mixed.data_ptr<float>(), L, C, nk, dk);
  return {mixed, window};
}
