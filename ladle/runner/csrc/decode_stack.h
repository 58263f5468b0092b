// A dense decoder's layers for one decode step in one call (decode_stack.cpp): the Llama /
// Qwen2 / Qwen3 layer of models/llama.py run as that Python path runs it, kernel by kernel in
// the same order, so the result is the same bit for bit; what it saves is the ~0.2 ms of Python
// per layer around the kernels (module calls, dispatch checks, views). cpu_kernels.py's
// decode_stack_for decides where it applies and builds it once per model.
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

struct StackLayer {
  at::Tensor input_norm, post_norm;
  c10::optional<at::Tensor> q_norm, k_norm;  // Qwen3's per-head norms (both or neither)
  StackLinear qkv, o, gate_up, down;  // gate_up / down unused when moe is set
  int64_t window = 0;  // 0: full attention
  c10::optional<StackMoe> moe;
};

class DecodeStack {
 public:
  DecodeStack(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, double scale)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), eps_(eps), scale_(scale) {}
  void add_layer(StackLayer layer) { layers_.push_back(std::move(layer)); }
  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
  // x (T, hidden): the embedded tokens, every row a decode row. Returns (x, residual) after the
  // last layer, as decoder_forward's loop leaves them for the final norm.
  std::vector<at::Tensor> run(at::Tensor x, const at::Tensor& positions, const at::Tensor& cos,
                              const at::Tensor& sin, const at::Tensor& block_table,
                              const at::Tensor& ctx_lens, const at::Tensor& slot_blocks,
                              const at::Tensor& slot_offsets,
                              const std::vector<at::Tensor>& k_caches,
                              const std::vector<at::Tensor>& v_caches, bool invariant) const;

 private:
  int64_t heads_, kv_heads_, head_dim_;
  double eps_, scale_;
  std::vector<StackLayer> layers_;
};
