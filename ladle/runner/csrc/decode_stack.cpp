// DecodeStack (decode_stack.h): models/llama.py's DecoderLayer.forward for an all-decode step,
// the same kernels called in the same order on the same tensors.
#include "decode_stack.h"

#include "kernels.h"
#include "quant.h"

at::Tensor StackLinear::operator()(const at::Tensor& x, bool invariant) const {
  if (weight.defined()) return linear(x, weight, bias, invariant);
  auto y = at::empty({x.size(0), out_features}, x.options());
  quant_matmul(x, parts, types, scales, cols, y, invariant, rotation);  // quant_linear's call
  if (bias) y.add_(*bias);  // quant_linear's `y += bias`
  return y;
}

at::Tensor StackMoe::operator()(const at::Tensor& x, bool invariant) const {
  // SparseMoeBlock.route
  auto logits = router(x, invariant);
  auto probs = at::softmax(logits, -1, at::kFloat);
  auto top = at::topk(probs, top_k, -1);
  auto weights = std::get<0>(top), ids = std::get<1>(top);
  if (norm_topk) weights = weights.div(weights.sum(-1, true));  // torch: w / w.sum(-1)
  if (!float32_weights) weights = weights.to(x.scalar_type());
  weights = weights.to(at::kFloat).contiguous();  // the fused kernels take float32 weights
  if (gate_up.defined())
    return moe_swiglu(x, ids.contiguous(), weights, gate_up, down, max_kernel_rows, invariant);
  return moe_quant_swiglu(x, ids.contiguous(), weights, blocks[0], block_types[0], blocks[1],
                          block_types[1], blocks[2], block_types[2]);
}

std::vector<at::Tensor> DecodeStack::run(at::Tensor x, const at::Tensor& positions,
                                         const std::vector<at::Tensor>& tables,
                                         const at::Tensor& block_table, const at::Tensor& ctx_lens,
                                         const at::Tensor& slot_blocks,
                                         const at::Tensor& slot_offsets,
                                         const std::vector<at::Tensor>& k_caches,
                                         const std::vector<at::Tensor>& v_caches,
                                         bool invariant) const {
  TORCH_CHECK(k_caches.size() == layers_.size() && v_caches.size() == layers_.size(),
              "decode_stack: ", layers_.size(), " layers but ", k_caches.size(), " caches");
  const int64_t T = x.size(0), q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_;
  at::Tensor residual;
  for (size_t i = 0; i < layers_.size(); ++i) {
    const StackLayer& L = layers_[i];
    TORCH_CHECK(2 * L.rope + 1 < static_cast<int64_t>(tables.size()),
                "decode_stack: layer ", i, " uses rope table ", L.rope);
    const at::Tensor &cos = tables[2 * L.rope], &sin = tables[2 * L.rope + 1];
    at::Tensor h;
    if (i == 0) {  // h, residual = input_layernorm(x), x
      h = rms_norm(x, c10::nullopt, L.input_norm, eps_);
      residual = x;
    } else {  // the previous layer's MLP output joins the residual stream in the norm
      h = rms_norm(x, residual, L.input_norm, eps_);
    }
    // Attention.forward / GemmaAttention.forward
    auto qkv = L.qkv(h, invariant);
    auto q = qkv.narrow(1, 0, q_size).view({T, heads_, head_dim_});
    auto k = qkv.narrow(1, q_size, kv_size).view({T, kv_heads_, head_dim_});
    auto v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, kv_heads_, head_dim_});
    if (L.q_norm && L.qk_fused) {
      auto qk = qk_norm_rotary(q, k, *L.q_norm, *L.k_norm, eps_, positions, cos, sin);
      q = qk[0];
      k = qk[1];
    } else {
      if (L.q_norm) {
        q = rms_norm(q, c10::nullopt, *L.q_norm, eps_);
        k = rms_norm(k, c10::nullopt, *L.k_norm, eps_);
      }
      rotary(q, k, positions, cos, sin);
    }
    write_kv_cache(k, v, k_caches[i], v_caches[i], slot_blocks, slot_offsets);
    auto attn = paged_decode_attention(q.contiguous(), k_caches[i], v_caches[i], block_table,
                                       ctx_lens, scale_, L.window, L.softcap, c10::nullopt,
                                       !invariant);
    auto o = L.o(attn.reshape({T, q_size}), invariant);
    if (L.attn_out_norm) o = rms_norm(o, c10::nullopt, *L.attn_out_norm, eps_);
    h = rms_norm(o, residual, L.post_norm, eps_);
    if (L.moe) {
      x = (*L.moe)(h, invariant);
    } else {  // GatedMLP.forward
      auto gate_up = L.gate_up(h, invariant);
      auto act = L.activation == kSilu ? silu_mul(gate_up)
                                       : gelu_mul(gate_up, L.activation == kGeluTanh);
      x = L.down(act, invariant);
    }
    if (L.mlp_out_norm) x = rms_norm(x, c10::nullopt, *L.mlp_out_norm, eps_);
  }
  if (final_norm_) return {rms_norm(x, residual, *final_norm_, eps_)};  // final_norm(x, residual)
  return {x, residual};
}
