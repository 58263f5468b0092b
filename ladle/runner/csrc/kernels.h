// CPU kernels for ladle's decode path, built once per (sources, flags, CPU) by cpu_kernels.py
// into one extension module. Each kernel has a pure-torch twin in ladle/runner/cpu_kernels.py
// (paged decode attention's: decode_attention in ladle/runner/attention.py) that tests compare it
// with. Built with -march=native: the AVX-512 (and AVX512-BF16) paths are chosen by the compiler
// macros of the CPU the build is for; every function also has a portable scalar loop.
//
// The kernels by file: attention.cpp (paged decode attention), linear.cpp (small-M linear),
// elementwise.cpp (RMSNorm, rotary, q/k norm + rotary, KV-cache write, silu * up), moe.cpp
// (the experts of a mixture-of-experts block), deltanet.cpp (Gated DeltaNet's recurrent
// step), sampler.cpp
// (the sampler's passes); vec.h holds the helpers they share, bindings.cpp the module, and
// quant.h / quant.cpp the quantized linears. These are the functions bindings.cpp exposes.
#pragma once
#include <torch/types.h>
#include <vector>

// deltanet.cpp: Gated DeltaNet's recurrent step, (output (D, H, dv), new states (D, H, dk, dv))
std::vector<torch::Tensor> gated_delta_step(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                            torch::Tensor g, torch::Tensor beta,
                                            torch::Tensor state, torch::Tensor rows,
                                            torch::Tensor keep);

// attention.cpp
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_table, torch::Tensor ctx_lens,
                                     double scale, int64_t window, double softcap,
                                     c10::optional<torch::Tensor> sinks);

// linear.cpp
// Output columns [n_begin, n_end) of y (M, N) = x (M, K) @ w (N, K)^T + b on the calling thread
// (n_begin a multiple of 4); `linear` shares N among threads, moe.cpp shares the experts'.
template <typename T>
void linear_cols(const T* x, const T* w, const T* b, T* y, int64_t M, int64_t N, int64_t K,
                 int64_t ldx, bool invariant, int64_t n_begin, int64_t n_end);
torch::Tensor linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> b,
                     bool invariant);

// elementwise.cpp
torch::Tensor rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor w,
                       double eps);
void rotary(torch::Tensor q, torch::Tensor k, torch::Tensor positions, torch::Tensor cos,
            torch::Tensor sin);
std::vector<torch::Tensor> qk_norm_rotary(torch::Tensor q, torch::Tensor k, torch::Tensor wq,
                                          torch::Tensor wk, double eps, torch::Tensor positions,
                                          torch::Tensor cos, torch::Tensor sin);
void write_kv_cache(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
                    torch::Tensor slot_blocks, torch::Tensor slot_offsets);
torch::Tensor silu_mul(torch::Tensor x);
// out (R, I) = silu(x[:, :I]) * x[:, I:2I] for R rows of stride ldx (threads split the rows).
template <typename T>
void silu_mul_kernel(const T* x, T* out, int64_t R, int64_t I, int64_t ldx);
torch::Tensor gelu_mul(torch::Tensor x, bool tanh_approx);

// moe.cpp
torch::Tensor moe_swiglu(torch::Tensor x, torch::Tensor ids, torch::Tensor weights,
                         torch::Tensor gate_up, torch::Tensor down, int64_t max_kernel_rows,
                         bool invariant);

// sampler.cpp
void apply_bitmask(torch::Tensor logits, torch::Tensor rows, torch::Tensor bitmask);
void apply_penalties(torch::Tensor logits, torch::Tensor counts, torch::Tensor seen,
                     torch::Tensor repetition, torch::Tensor frequency, torch::Tensor presence,
                     bool use_rep, bool use_freq, bool use_pres);
std::vector<torch::Tensor> logprob_stats(torch::Tensor src, torch::Tensor chosen);
torch::Tensor logsumexp_rows(torch::Tensor src);
void min_p(torch::Tensor logits, torch::Tensor log_min_p);
void top_p_mask(torch::Tensor logits, torch::Tensor lse, torch::Tensor top_p);
std::vector<torch::Tensor> topk_rows(torch::Tensor x, int64_t k);
torch::Tensor argmax_rows(torch::Tensor x);
void noise_uniform(torch::Tensor token_key, torch::Tensor k1, torch::Tensor k2,
                   torch::Tensor out);
torch::Tensor seeded_race(torch::Tensor logits, torch::Tensor token_key, torch::Tensor k1,
                          torch::Tensor k2);
