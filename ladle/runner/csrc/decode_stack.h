// A decoder's layers for one decode step in one call (decode_stack.cpp): the layers of
// models/llama.py (Llama, Qwen2, Qwen3, Mistral; gated MLPs or Qwen3-MoE / Mixtral experts) and
// models/gemma.py (Gemma 2 and 3: sandwich norms, per-layer rope tables and soft-caps) run as
// their Python forward runs them, kernel by kernel in the same order, so the result is the same
// bit for bit; what it saves is the ~0.2 ms of Python per layer around the kernels (module
// calls, dispatch checks, views). llama.py's decode_stack decides where it applies; each family
// builds its layers' specs once per model (build_decode_stack).
#pragma once
#include <vector>

#include "vec.h"  // ATen, lean

// One linear as cpu_kernels.linear runs it: the dense small-M kernel (weight defined) or the
// quantized parts in one quant_matmul call (runner/quant.py's QuantWeight._kernel_args).
struct StackLinear {
  at::Tensor weight;
  c10::optional<at::Tensor> bias;
  std::vector<at::Tensor> parts;
  std::vector<int64_t> types;
  std::vector<at::Tensor> scales;
  std::vector<int64_t> cols;
  int64_t out_features = 0;
  int64_t rotation = 0;  // QuantWeight.rotation: the parts' Hadamard block (rotate_rows), or 0
  at::Tensor operator()(const at::Tensor& x, bool invariant) const;
};

// A mixture-of-experts block as models/moe.py's SparseMoeBlock runs it: the router's float32
// softmax, top k, optional renormalisation, then the experts in one call (moe.cpp's moe_swiglu
// over stacked dense weights, or quant.cpp's moe_quant_swiglu over stacked GGUF blocks).
struct StackMoe {
  StackLinear router;
  int64_t top_k = 0;
  bool norm_topk = false, float32_weights = false;
  at::Tensor gate_up, down;  // dense stacks (E, 2I, H), (E, H, I); undefined for blocks
  int64_t max_kernel_rows = 0;
  std::vector<at::Tensor> blocks;  // gate, up, down blocks
  std::vector<int64_t> block_types;
  at::Tensor operator()(const at::Tensor& x, bool invariant) const;
};

// The gated MLP's activation (layers.py's GatedMLP).
enum StackActivation : int64_t { kSilu = 0, kGeluTanh = 1, kGelu = 2 };

struct StackLayer {
  // Llama: input_layernorm, post_attention_layernorm. Gemma: input_layernorm and
  // pre_feedforward_layernorm (its post-attention and post-feedforward norms are out_norms).
  // A norm weight is the model dtype's w, or Gemma's float32 scale 1 + w.
  at::Tensor input_norm, post_norm;
  c10::optional<at::Tensor> attn_out_norm, mlp_out_norm;  // Gemma's, on each output alone
  c10::optional<at::Tensor> q_norm, k_norm;  // per-head norms (both or neither)
  bool qk_fused = true;  // Qwen3: qk_norm_rotary; Gemma 3: each head's norm, then rotary
  int64_t rope = 0;      // which of run()'s two rotary tables this layer uses
  StackLinear qkv, o, gate_up, down;  // gate_up / down unused when moe is set
  int64_t window = 0;    // 0: full attention
  double softcap = 0.0;  // 0: none
  int64_t activation = kSilu;
  c10::optional<StackMoe> moe;
};

class DecodeStack {
 public:
  DecodeStack(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, double scale)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), eps_(eps), scale_(scale) {}
  void add_layer(StackLayer layer) { layers_.push_back(std::move(layer)); }
  // The model's final norm (a norm weight as StackLayer's), applied to the last layer's output
  // and the residual stream; without one, run() leaves that to the caller.
  void set_final_norm(at::Tensor weight) { final_norm_ = std::move(weight); }
  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
  // x (T, hidden): the embedded tokens, every row a decode row. Returns (final_norm(x +
  // residual)) after the last layer when the stack has the final norm, else (x, residual) as
  // decoder_forward's loop leaves them for it. `tables`: (cos, sin) of each rope the layers use.
  std::vector<at::Tensor> run(at::Tensor x, const at::Tensor& positions,
                              const std::vector<at::Tensor>& tables,
                              const at::Tensor& block_table, const at::Tensor& ctx_lens,
                              const at::Tensor& slot_blocks, const at::Tensor& slot_offsets,
                              const std::vector<at::Tensor>& k_caches,
                              const std::vector<at::Tensor>& v_caches, bool invariant) const;

 private:
  int64_t heads_, kv_heads_, head_dim_;
  double eps_, scale_;
  std::vector<StackLayer> layers_;
  c10::optional<at::Tensor> final_norm_;
};
