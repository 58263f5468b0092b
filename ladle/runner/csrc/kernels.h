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
// quant.h / quant.cpp the quantized linears, decode_stack.h / .cpp a decoder's layers in one
// call. These are the functions bindings.cpp exposes.
#pragma once
#include "vec.h"  // ATen, lean
#include <string>
#include <vector>

// deltanet.cpp: Gated DeltaNet's recurrent step, (output (D, H, dv), new states (D, H, dk, dv))
std::vector<at::Tensor> gated_delta_step(at::Tensor q, at::Tensor k, at::Tensor v,
                                         at::Tensor g, at::Tensor beta,
                                         at::Tensor state, at::Tensor rows,
                                         at::Tensor keep);
// and a whole decode token between a linear layer's projections: (y, new windows, states)
std::vector<at::Tensor> gated_delta_decode(at::Tensor conv_state, at::Tensor w, at::Tensor qkv,
                                           at::Tensor z, at::Tensor b, at::Tensor a,
                                           at::Tensor A_log, at::Tensor dt_bias,
                                           at::Tensor norm_w, double eps, at::Tensor state,
                                           at::Tensor rows, at::Tensor keep, int64_t nk,
                                           int64_t dk);
// and a prompt's conv part, q and k normalised: (mixed (L, C), the last window (C, K - 1))
std::vector<at::Tensor> gated_delta_conv_prefill(at::Tensor conv_state, at::Tensor w,
                                                 at::Tensor x, int64_t nk, int64_t dk);

// attention.cpp
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                  at::Tensor block_table, at::Tensor ctx_lens,
                                  double scale, int64_t window, double softcap,
                                  c10::optional<at::Tensor> sinks, bool tiles);
// Whether this build and CPU attend prefill runs of paged_decode_attention in tiles (AMX-BF16
// or AVX512-BF16), and on which unit ("amx", "avx512-bf16"; "" for none).
bool attention_tiles_available();
std::string attention_tiles_unit();
// Prefill tiles on AMX where the CPU allows (on, the default) or on AVX512-BF16's vdpbf16ps;
// returns whether they now run on AMX. For tests and benchmarks.
bool set_attention_amx(bool on);
// Rows attended in tiles since the process started (for tests: which rows took the tiles).
int64_t attention_tile_rows();

// linear.cpp
// Output columns [n_begin, n_end) of y (M, N) = x (M, K) @ w (N, K)^T + b on the calling thread
// (n_begin a multiple of 4); `linear` shares N among threads, moe.cpp shares the experts'.
template <typename T>
void linear_cols(const T* x, const T* w, const T* b, T* y, int64_t M, int64_t N, int64_t K,
                 int64_t ldx, bool invariant, int64_t n_begin, int64_t n_end);
at::Tensor linear(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> b,
                  bool invariant);
// Batch-invariant bfloat16 linears on AMX tiles (where built and permitted); returns whether
// they now run there. For tests and benchmarks.
bool set_linear_amx(bool on);
// Whether this build and CPU run bfloat16 linears on AMX tiles (set_linear_amx aside).
bool linear_amx_available();
// Whether linear runs a bfloat16 (M rows, (N, K) weight) product on AMX tiles, and that path
// itself for several products of one weight shape (built where the CPU has AMX-BF16; moe.cpp
// runs its experts by the same rule, in one call).
bool amx_linear_serves(int64_t M, int64_t N, int64_t K, bool invariant);
struct AmxRows {  // one product y (M, N) = x (M, K; row stride ldx) @ w (N, K)^T + b (or null)
  const at::BFloat16* x;
  int64_t ldx;
  const at::BFloat16* w;
  const at::BFloat16* b;
  at::BFloat16* y;
  int64_t M;
};
void amx_linear_many(const AmxRows* products, int64_t count, int64_t N, int64_t K);

// elementwise.cpp
at::Tensor rms_norm(at::Tensor x, c10::optional<at::Tensor> residual, at::Tensor w,
                    double eps);
void rotary(at::Tensor q, at::Tensor k, at::Tensor positions, at::Tensor cos,
            at::Tensor sin);
std::vector<at::Tensor> qk_norm_rotary(at::Tensor q, at::Tensor k, at::Tensor wq,
                                       at::Tensor wk, double eps, at::Tensor positions,
                                       at::Tensor cos, at::Tensor sin);
void write_kv_cache(at::Tensor k, at::Tensor v, at::Tensor k_cache, at::Tensor v_cache,
                    at::Tensor slot_blocks, at::Tensor slot_offsets);
at::Tensor silu_mul(at::Tensor x);
// out (R, I) = silu(x[:, :I]) * x[:, I:2I] for R rows of stride ldx (threads split the rows).
template <typename T>
void silu_mul_kernel(const T* x, T* out, int64_t R, int64_t I, int64_t ldx);
at::Tensor gelu_mul(at::Tensor x, bool tanh_approx);

// moe.cpp
at::Tensor moe_swiglu(at::Tensor x, at::Tensor ids, at::Tensor weights,
                      at::Tensor gate_up, at::Tensor down, int64_t max_kernel_rows,
                      bool invariant);

// sampler.cpp
void apply_bitmask(at::Tensor logits, at::Tensor rows, at::Tensor bitmask);
void apply_penalties(at::Tensor logits, at::Tensor counts, at::Tensor seen,
                     at::Tensor repetition, at::Tensor frequency, at::Tensor presence,
                     bool use_rep, bool use_freq, bool use_pres);
std::vector<at::Tensor> logprob_stats(at::Tensor src, at::Tensor chosen);
at::Tensor logsumexp_rows(at::Tensor src);
void min_p(at::Tensor logits, at::Tensor log_min_p);
void top_p_mask(at::Tensor logits, at::Tensor lse, at::Tensor top_p);
std::vector<at::Tensor> topk_rows(at::Tensor x, int64_t k);
at::Tensor argmax_rows(at::Tensor x);
void noise_uniform(at::Tensor token_key, at::Tensor k1, at::Tensor k2,
                   at::Tensor out);
at::Tensor seeded_race(at::Tensor logits, at::Tensor token_key, at::Tensor k1,
                       at::Tensor k2);

// memory.cpp
// Moves the CPU storages of these tensors (each once) into one mapping advised for 2 MiB pages,
// in place: every tensor and view keeps its object and offset. `zero`: the new memory is zeroed
// instead of copied (a KV cache allocated empty). Returns the bytes moved (0 where the mapping
// cannot be had).
int64_t to_huge_pages(const std::vector<at::Tensor>& tensors, bool zero);
// dst[rows[i]] = src[i], a memcpy per row
void copy_rows(at::Tensor dst, at::Tensor rows, at::Tensor src);
