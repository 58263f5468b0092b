// A mixture-of-experts block's experts in one call: SwiGLU experts (Qwen3-MoE, Mixtral) whose
// weights are stacked per layer, gate_up (E, 2I, H) and down (E, H, I). The Python twin is
// RoutedExperts' loop in ladle/models/moe.py (one GatedMLP call per expert), and this computes
// the same bits:
//
// - the T * k (token, choice) pairs are sorted by expert, stably (tokens in order), and each
//   token's row is copied once per choice, so an expert's rows are one contiguous matrix;
// - gate_up, silu * up and down run per expert with linear.cpp's column routine, the threads
//   sharing every expert's columns at once (one parallel region per projection, not one per
//   expert). An expert with more rows than max_kernel_rows (prefill) runs torch's GEMM instead,
//   as cpu_kernels.linear does, and those whose rows linear would put on AMX tiles
//   (amx_linear_serves) run there, all in one call;
// - each output row is scaled by its routing weight (in float32, rounded to T), and a token's k
//   rows are added in the order of their expert ids, rounding to T after each add, which is
//   transformers' sum over experts in order.
#include "kernels.h"
#include "moe.h"
#include "vec.h"

#include <type_traits>

// y (P, N) rows of expert e at [start[e], start[e] + count[e]) = x rows @ w[e]^T, for the
// experts in `small` together (threads split the concatenation of their column blocks).
template <typename T>
static void experts_linear(const T* x, const T* w, T* y, const std::vector<int64_t>& small,
                           const std::vector<int64_t>& start, const std::vector<int64_t>& count,
                           int64_t N, int64_t K, bool invariant) {
  if (small.empty()) return;
  const int64_t blocks = (N + 3) / 4;
  const int64_t units = blocks * static_cast<int64_t>(small.size());
  int64_t rows = 0;
  for (int64_t e : small) rows += count[e];
  const int64_t avg_rows = std::max<int64_t>(1, rows / static_cast<int64_t>(small.size()));
  at::parallel_for(0, units, grain_for(4 * K * avg_rows), [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end;) {
      const int64_t i = u / blocks, b0 = u % blocks;
      const int64_t b1 = std::min(blocks, b0 + (end - u));
      const int64_t e = small[i];
      linear_cols(x + start[e] * K, w + e * N * K, static_cast<const T*>(nullptr),
                  y + start[e] * N, count[e], N, K, K, invariant, 4 * b0, std::min(N, 4 * b1));
      u += b1 - b0;
    }
  });
}

template <typename T>
static void moe_kernel(at::Tensor x, at::Tensor ids, at::Tensor weights,
                       at::Tensor gate_up, at::Tensor down, at::Tensor y,
                       int64_t max_kernel_rows, bool invariant) {
  const int64_t Tn = x.size(0), H = x.size(1), k = ids.size(1), E = gate_up.size(0);
  const int64_t I2 = gate_up.size(1), I = I2 / 2, P = Tn * k;
  const int64_t* id = ids.data_ptr<int64_t>();
  const ExpertRows r = sort_by_expert(id, P, k, E, "moe_swiglu");
  const auto &count = r.count, &start = r.start, &slot = r.slot, &src = r.src;
  auto opts = x.options();
  auto rows = at::empty({P, H}, opts), gu = at::empty({P, I2}, opts);
  auto act = at::empty({P, I}, opts), out = at::empty({P, H}, opts);
  const T* xp = x.data_ptr<T>();
  T* rp = rows.data_ptr<T>();
  gather_rows(xp, src.data(), rp, P, H);
  std::vector<int64_t> small;
  std::vector<int64_t> big;
  for (int64_t e = 0; e < E; ++e) {
    if (count[e] == 0) continue;
    (count[e] <= max_kernel_rows || invariant ? small : big).push_back(e);
  }
  // Experts whose rows `linear` would run on AMX tiles (amx_linear_serves) run there here too,
  // one call each, so the fused kernel keeps the per-expert loop's bits.
  auto split = [&](int64_t N, int64_t K, std::vector<int64_t>& tiles) {
    std::vector<int64_t> rest;
    for (int64_t e : small) {
      bool t = false;
      if constexpr (std::is_same_v<T, at::BFloat16>)
        t = amx_linear_serves(count[e], N, K, invariant);
      (t ? tiles : rest).push_back(e);
    }
    return rest;
  };
  std::vector<int64_t> tiles_gu, tiles_down;
  const std::vector<int64_t> small_gu = split(I2, H, tiles_gu);
  const std::vector<int64_t> small_down = split(H, I, tiles_down);
  auto on_tiles = [&](const std::vector<int64_t>& tiles, const T* in, const T* w, T* o,
                      int64_t N, int64_t K) {
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      std::vector<AmxRows> products;
      for (int64_t e : tiles)
        products.push_back({in + start[e] * K, K, w + e * N * K, nullptr, o + start[e] * N,
                            count[e]});
      if (!products.empty())
        amx_linear_many(products.data(), static_cast<int64_t>(products.size()), N, K);
    }
  };
  for (int64_t e : big) {
    auto o = gu.narrow(0, start[e], count[e]);
    at::mm_out(o, rows.narrow(0, start[e], count[e]), gate_up[e].t());
  }
  on_tiles(tiles_gu, rp, gate_up.data_ptr<T>(), gu.data_ptr<T>(), I2, H);
  experts_linear(static_cast<const T*>(rp), gate_up.data_ptr<T>(), gu.data_ptr<T>(), small_gu,
                 start, count, I2, H, invariant);
  silu_mul_kernel(static_cast<const T*>(gu.data_ptr<T>()), act.data_ptr<T>(), P, I, I2);
  for (int64_t e : big) {
    auto o = out.narrow(0, start[e], count[e]);
    at::mm_out(o, act.narrow(0, start[e], count[e]), down[e].t());
  }
  on_tiles(tiles_down, act.data_ptr<T>(), down.data_ptr<T>(), out.data_ptr<T>(), H, I);
  experts_linear(static_cast<const T*>(act.data_ptr<T>()), down.data_ptr<T>(), out.data_ptr<T>(),
                 small_down, start, count, H, I, invariant);
  combine(static_cast<const T*>(out.data_ptr<T>()), id, weights.data_ptr<float>(), slot.data(),
          y.data_ptr<T>(), Tn, k, H);
}

at::Tensor moe_swiglu(at::Tensor x, at::Tensor ids, at::Tensor weights,
                      at::Tensor gate_up, at::Tensor down, int64_t max_kernel_rows,
                      bool invariant) {
  // x (T, H); ids (T, k) int64 expert ids; weights (T, k) float32 routing weights; gate_up
  // (E, 2I, H) and down (E, H, I) in x's dtype, contiguous. Returns (T, H).
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "moe_swiglu: x must be (T, H) contiguous");
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == x.size(0) && ids.scalar_type() == at::kLong &&
                  ids.is_contiguous(), "moe_swiglu: ids must be (T, k) int64");
  TORCH_CHECK(weights.sizes() == ids.sizes() && weights.scalar_type() == at::kFloat &&
                  weights.is_contiguous(), "moe_swiglu: weights must be (T, k) float32");
  TORCH_CHECK(gate_up.dim() == 3 && down.dim() == 3 && gate_up.is_contiguous() &&
                  down.is_contiguous() && gate_up.size(0) == down.size(0) &&
                  gate_up.size(2) == x.size(1) && down.size(1) == x.size(1) &&
                  gate_up.size(1) == 2 * down.size(2),
              "moe_swiglu: gate_up must be (E, 2I, H) and down (E, H, I)");
  TORCH_CHECK(gate_up.scalar_type() == x.scalar_type() && down.scalar_type() == x.scalar_type(),
              "moe_swiglu: dtypes");
  auto y = at::empty_like(x);
  if (x.size(0) == 0) return y;
  if (x.scalar_type() == at::kBFloat16) {
    moe_kernel<at::BFloat16>(x, ids, weights, gate_up, down, y, max_kernel_rows, invariant);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "moe_swiglu: bfloat16 or float32");
    moe_kernel<float>(x, ids, weights, gate_up, down, y, max_kernel_rows, invariant);
  }
  return y;
}
