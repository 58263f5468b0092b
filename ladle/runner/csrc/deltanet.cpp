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

// One decode token of D sequences through a whole linear layer's recurrent part (the torch ops
// of GatedDeltaNet._step in one call): the causal depthwise conv over each channel's window
// (the K - 1 inputs kept, then the new one), SiLU, the result rounded through the projection's
// dtype (transformers' conv returns it), q and k l2-normalised per key head (x / sqrt(sum x^2 +
// 1e-6)), q scaled by dk^-1/2, then the step above with each key head read by its r value heads.
// conv_state (D, C, K - 1) and w (C, K) float32, x (D, C) float32 or bfloat16 (C = 2 nk dk + H
// dv), g and beta (D, H), state (N, H, dk, dv). Returns (out (D, H, dv), the new windows
// (D, C, K - 1), the new states (D, H, dk, dv)).
std::vector<at::Tensor> gated_delta_conv_step(at::Tensor conv_state, at::Tensor w, at::Tensor x,
                                              at::Tensor g, at::Tensor beta, at::Tensor state,
                                              at::Tensor rows, at::Tensor keep, int64_t nk,
                                              int64_t dk) {
  TORCH_CHECK(conv_state.dim() == 3 && x.dim() == 2 && x.size(0) == conv_state.size(0) &&
                  x.size(1) == conv_state.size(1) && w.dim() == 2 &&
                  w.size(0) == x.size(1) && w.size(1) == conv_state.size(2) + 1,
              "gated_delta_conv_step: conv_state (D, C, K - 1), x (D, C), w (C, K)");
  TORCH_CHECK(state.dim() == 4, "gated_delta_conv_step: state (N, H, dk, dv)");
  const int64_t D = x.size(0), C = x.size(1), K = w.size(1);
  const int64_t H = state.size(1), dv = state.size(3);
  TORCH_CHECK(nk >= 1 && H % nk == 0 && state.size(2) == dk && C == 2 * nk * dk + H * dv,
              "gated_delta_conv_step: C = 2 nk dk + H dv, H a multiple of nk");
  TORCH_CHECK(g.dim() == 2 && g.size(0) == D && g.size(1) == H && beta.sizes() == g.sizes(),
              "gated_delta_conv_step: g and beta (D, H)");
  TORCH_CHECK(rows.numel() == D && keep.numel() == D, "gated_delta_conv_step: rows, keep (D,)");
  for (const auto& t : {conv_state, w, g, beta, state})
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous(),
                "gated_delta_conv_step: float32 contiguous conv_state, w, g, beta, state");
  TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  x.is_contiguous(), "gated_delta_conv_step: x float32 or bfloat16, contiguous");
  TORCH_CHECK(rows.scalar_type() == at::kLong && keep.scalar_type() == at::kBool,
              "gated_delta_conv_step: rows int64, keep bool");
  auto rows_c = rows.contiguous();
  auto keep_c = keep.contiguous();
  const int64_t* row = rows_c.data_ptr<int64_t>();
  const bool* keeps = keep_c.data_ptr<bool>();
  for (int64_t d = 0; d < D; ++d)
    TORCH_CHECK(!keeps[d] || (row[d] >= 0 && row[d] < state.size(0)),
                "gated_delta_conv_step: row out of range");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  auto windows = at::empty({D, C, K - 1}, conv_state.options());
  auto mixed = at::empty({D, C}, conv_state.options());
  const float *cs = conv_state.data_ptr<float>(), *wp = w.data_ptr<float>();
  float *wn = windows.data_ptr<float>(), *mx = mixed.data_ptr<float>();
  at::parallel_for(0, D * C, 2048, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t d = i / C, c = i % C;
      const float xi = bf16 ? float(x.data_ptr<at::BFloat16>()[i]) : x.data_ptr<float>()[i];
      const float* win = cs + i * (K - 1);
      const float* wc = wp + c * K;
      float acc = 0.f;
      for (int64_t t = 0; t < K - 1; ++t) acc += win[t] * wc[t];
      acc += xi * wc[K - 1];
      float y = acc / (1.f + std::exp(-acc));
      if (bf16) y = float(at::BFloat16(y));
      mx[d * C + c] = y;
      float* wo = wn + i * (K - 1);
      for (int64_t t = 0; t + 1 < K - 1; ++t) wo[t] = win[t + 1];
      wo[K - 2] = xi;
    }
  });
  // q and k normalised in place (each of the D x 2 nk heads of dk)
  const float q_scale = 1.f / std::sqrt(float(dk));
  at::parallel_for(0, D * 2 * nk, 16, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t d = p / (2 * nk), j = p % (2 * nk);
      float* h = mx + d * C + j * dk;
      float ss = 0.f;
      for (int64_t i = 0; i < dk; ++i) ss += h[i] * h[i];
      const float inv = 1.f / std::sqrt(ss + 1e-6f) * (j < nk ? q_scale : 1.f);
      for (int64_t i = 0; i < dk; ++i) h[i] *= inv;
    }
  });
  // row d of mixed: [q of nk heads | k of nk heads | v of H heads]
  auto out = at::empty({D, H, dv}, conv_state.options());
  auto next = at::empty({D, H, dk, dv}, conv_state.options());
  delta_pairs(mx, mx + nk * dk, C, H / nk, mx + 2 * nk * dk, C, g.data_ptr<float>(),
              beta.data_ptr<float>(), state.data_ptr<float>(), row, keeps, D, H, dk, dv,
              out.data_ptr<float>(), next.data_ptr<float>());
  return {out, windows, next};
}
