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
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *gp = g.data_ptr<float>(), *bp = beta.data_ptr<float>();
  const float* sp = state.data_ptr<float>();
  float *op = out.data_ptr<float>(), *np = next.data_ptr<float>();
  at::parallel_for(0, D * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q_read(dv), delta(dv);
    for (int64_t p = begin; p < end; ++p) {
      const int64_t d = p / H, h = p % H;
      const float* qi = qp + p * dk;
      const float* ki = kp + p * dk;
      const float* vi = vp + p * dv;
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
  return {out, next};
}
