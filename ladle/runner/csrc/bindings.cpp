// The extension module: every kernel's binding (declared in kernels.h) and the quantized
// kernels' (quant.h).
// torch's pybind11 type casters (Tensor, optional, vectors), not torch/extension.h: that header
// also pulls the whole C++ frontend, ~50 s of compiler time against ~15 s.
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "kernels.h"
#include "quant.h"

// What this build was compiled for, logged at engine start.
std::string isa() {
#if defined(__AVX512BF16__)
  return "avx512-bf16";
#elif defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
  return "avx2";
#else
  return "portable";
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "paged decode attention, optionally windowed, soft-capped and with sink logits",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_table"),
        py::arg("ctx_lens"), py::arg("scale"), py::arg("window"), py::arg("softcap"),
        py::arg("sinks") = py::none());
  m.def("linear", &linear, "small-M linear (any M when invariant)", py::arg("x"), py::arg("w"),
        py::arg("b"), py::arg("invariant") = false);
  m.def("rms_norm", &rms_norm, "RMSNorm with optional residual add", py::arg("x"),
        py::arg("residual"), py::arg("w"), py::arg("eps"));
  m.def("rotary", &rotary, "neox rotary embedding in place");
  m.def("apply_bitmask", &apply_bitmask, "grammar bitmask applied in place");
  m.def("qk_norm_rotary", &qk_norm_rotary, "per-head q/k RMSNorm then rotary");
  m.def("write_kv_cache", &write_kv_cache, "k and v into their cache slots");
  m.def("silu_mul", &silu_mul, "silu(gate) * up");
  m.def("moe_swiglu", &moe_swiglu,
        "a mixture-of-experts block's SwiGLU experts (stacked weights) and the weighted sum",
        py::arg("x"), py::arg("ids"), py::arg("weights"), py::arg("gate_up"), py::arg("down"),
        py::arg("max_kernel_rows"), py::arg("invariant"));
  m.def("gelu_mul", &gelu_mul, "gelu(gate) * up (tanh approximation or exact erf)");
  m.def("apply_penalties", &apply_penalties, "repetition/frequency/presence in one pass");
  m.def("logprob_stats", &logprob_stats, "logsumexp, chosen value and rank per row");
  m.def("logsumexp_rows", &logsumexp_rows, "logsumexp per row");
  m.def("min_p", &min_p, "min-p filter in place");
  m.def("top_p_mask", &top_p_mask, "top-p by radix select, in place");
  m.def("topk_rows", &topk_rows, "k largest per row, sorted");
  m.def("argmax_rows", &argmax_rows, "first index of each row's maximum");
  m.def("noise_uniform", &noise_uniform, "seeded noise's uniforms, hashed in one pass");
  m.def("seeded_race", &seeded_race, "seeded exponential race over full rows, fused");
  m.def("gated_delta_step", &gated_delta_step,
        "Gated DeltaNet's recurrent step: each state read once, the new one written once");
  m.def("isa", &isa, "instruction set this build uses");
  m.def("quantize_blocks", &quantize_blocks, "activations to int8 per block of 32");
  m.def("moe_quant_swiglu", &moe_quant_swiglu,
        "a mixture-of-experts block's SwiGLU experts in GGUF blocks and the weighted sum");
  m.def("quant_matmul", &quant_matmul,
        "x @ weight parts (GGUF blocks, int8 rows)^T into out, x quantized per block of 32");
  m.def("dequantize_rows", &dequantize_rows, "rows of GGUF-block weights, dequantized");
  m.def("quant_isa", &quant_isa, "instruction set of the quantized kernels");
}
