// What the mixture-of-experts kernels share (moe.cpp for dense stacked experts, quant.cpp's
// moe_quant_swiglu for experts in GGUF blocks): the (token, choice) pairs sorted by expert, the
// rows gathered per expert, and the weighted sum back per token in transformers' order.
#pragma once
#include <cstring>
#include <vector>

#include "vec.h"

// Counting sort of the T * k pairs (ids (T, k) flattened) by expert, stably (tokens in order):
// expert e's rows are [start[e], start[e] + count[e]); slot[p] is pair p's row, src[row] its
// token.
struct ExpertRows {
  std::vector<int64_t> count, start, slot, src;
};

inline ExpertRows sort_by_expert(const int64_t* id, int64_t P, int64_t k, int64_t E,
                                 const char* who) {
  ExpertRows r{std::vector<int64_t>(E, 0), std::vector<int64_t>(E, 0), std::vector<int64_t>(P),
               std::vector<int64_t>(P)};
  for (int64_t p = 0; p < P; ++p) {
    TORCH_CHECK(id[p] >= 0 && id[p] < E, who, ": expert id out of range");
    ++r.count[id[p]];
  }
  for (int64_t e = 1; e < E; ++e) r.start[e] = r.start[e - 1] + r.count[e - 1];
  std::vector<int64_t> next(r.start);
  for (int64_t p = 0; p < P; ++p) {
    r.slot[p] = next[id[p]]++;
    r.src[r.slot[p]] = p / k;
  }
  return r;
}

template <typename T>
inline void gather_rows(const T* x, const int64_t* src, T* out, int64_t P, int64_t H) {
  at::parallel_for(0, P, grain_for(kElementWork * H), [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      std::memcpy(out + p * H, x + src[p] * H, H * sizeof(T));
  });
}

template <typename T>
inline void combine(const T* out, const int64_t* ids, const float* wts, const int64_t* slot,
                    T* y, int64_t Tn, int64_t k, int64_t H) {
  at::parallel_for(0, Tn, grain_for(kElementWork * H * k), [&](int64_t begin, int64_t end) {
    std::vector<int64_t> order(k);
    std::vector<T> scaled(H);
    for (int64_t t = begin; t < end; ++t) {
      // This token's choices by expert id (stable: k is small, insertion sort).
      for (int64_t j = 0; j < k; ++j) {
        int64_t i = j;
        while (i > 0 && ids[t * k + order[i - 1]] > ids[t * k + j]) {
          order[i] = order[i - 1];
          --i;
        }
        order[i] = j;
      }
      T* yt = y + t * H;
      for (int64_t n = 0; n < k; ++n) {
        const int64_t p = t * k + order[n];
        const T* o = out + slot[p] * H;
        const float w = wts[p];
        T* dst = n == 0 ? yt : scaled.data();
        for (int64_t h = 0; h < H; ++h) dst[h] = static_cast<T>(to_f(o[h]) * w);
        // The product is stored, then added in a separate loop: the compiler cannot contract
        // the two into one fused multiply-add, which would skip the product's rounding (torch
        // multiplies, rounds, then adds).
        if (n > 0)
          for (int64_t h = 0; h < H; ++h) yt[h] = static_cast<T>(to_f(yt[h]) + to_f(scaled[h]));
      }
    }
  });
}

