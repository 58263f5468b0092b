// The extension module: every kernel's binding (declared in kernels.h) and the quantized
// kernels' (quant.h).
// torch's pybind11 type casters (Tensor, optional, vectors), not torch/extension.h: that header
// also pulls the whole C++ frontend, ~50 s of compiler time against ~15 s.
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "decode_stack.h"
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

// (weight or None, bias or None, quantized parts, their types, scales, first columns, N,
//  the parts' rotation block or 0)
using LinearSpec = std::tuple<c10::optional<at::Tensor>, c10::optional<at::Tensor>,
                              std::vector<at::Tensor>, std::vector<int64_t>,
                              std::vector<at::Tensor>, std::vector<int64_t>, int64_t, int64_t>;

static StackLinear stack_linear(const LinearSpec& s) {
  StackLinear l;
  if (std::get<0>(s)) l.weight = *std::get<0>(s);
  l.bias = std::get<1>(s);
  l.parts = std::get<2>(s);
  l.types = std::get<3>(s);
  l.scales = std::get<4>(s);
  l.cols = std::get<5>(s);
  l.out_features = std::get<6>(s);
  l.rotation = std::get<7>(s);
  TORCH_CHECK(l.weight.defined() || !l.parts.empty(), "decode_stack: a linear has no weight");
  return l;
}

// (router, top_k, norm_topk_prob, float32_weights, dense gate_up or None, dense down or None,
//  max_kernel_rows, [gate, up, down] blocks, their types): models/moe.py's SparseMoeBlock
using MoeSpec = std::tuple<LinearSpec, int64_t, bool, bool, c10::optional<at::Tensor>,
                           c10::optional<at::Tensor>, int64_t, std::vector<at::Tensor>,
                           std::vector<int64_t>>;

static StackMoe stack_moe(const MoeSpec& s) {
  StackMoe e;
  e.router = stack_linear(std::get<0>(s));
  e.top_k = std::get<1>(s);
  e.norm_topk = std::get<2>(s);
  e.float32_weights = std::get<3>(s);
  if (std::get<4>(s)) e.gate_up = *std::get<4>(s);
  if (std::get<5>(s)) e.down = *std::get<5>(s);
  e.max_kernel_rows = std::get<6>(s);
  e.blocks = std::get<7>(s);
  e.block_types = std::get<8>(s);
  TORCH_CHECK(e.gate_up.defined() == e.down.defined() &&
                  (e.gate_up.defined() || (e.blocks.size() == 3 && e.block_types.size() == 3)),
              "decode_stack: experts are dense stacks or three block stacks");
  return e;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // module_local: a process that imported a cached build and then builds again (the kernel
  // tests build their own cache directory after a test module loaded the shared one) imports a
  // second copy under the same name; with a globally registered type that import failed
  // ("generic_type: type DecodeStack is already registered") and the process ran torch.
  py::class_<DecodeStack>(m, "DecodeStack", py::module_local(),
                          "a dense decoder's layers for one decode step")
      .def(py::init<int64_t, int64_t, int64_t, double, double>(), py::arg("heads"),
           py::arg("kv_heads"), py::arg("head_dim"), py::arg("eps"), py::arg("scale"))
      .def("add_layer",
           [](DecodeStack& s, at::Tensor input_norm, at::Tensor post_norm,
              c10::optional<at::Tensor> attn_out_norm, c10::optional<at::Tensor> mlp_out_norm,
              c10::optional<at::Tensor> q_norm, c10::optional<at::Tensor> k_norm, bool qk_fused,
              int64_t rope, int64_t window, double softcap, int64_t activation,
              const LinearSpec& qkv, const LinearSpec& o,
              const c10::optional<LinearSpec>& gate_up, const c10::optional<LinearSpec>& down,
              const c10::optional<MoeSpec>& moe) {
             TORCH_CHECK(q_norm.has_value() == k_norm.has_value(),
                         "decode_stack: q_norm and k_norm come together");
             TORCH_CHECK(moe.has_value() != (gate_up.has_value() && down.has_value()),
                         "decode_stack: a layer has a gated MLP or experts");
             TORCH_CHECK(activation >= kSilu && activation <= kGelu,
                         "decode_stack: activation ", activation);
             StackLayer L;
             L.input_norm = input_norm;
             L.post_norm = post_norm;
             L.attn_out_norm = attn_out_norm;
             L.mlp_out_norm = mlp_out_norm;
             L.q_norm = q_norm;
             L.k_norm = k_norm;
             L.qk_fused = qk_fused;
             L.rope = rope;
             L.qkv = stack_linear(qkv);
             L.o = stack_linear(o);
             L.window = window;
             L.softcap = softcap;
             L.activation = activation;
             if (moe) {
               L.moe = stack_moe(*moe);
             } else {
               L.gate_up = stack_linear(*gate_up);
               L.down = stack_linear(*down);
             }
             s.add_layer(std::move(L));
           },
           py::arg("input_norm"), py::arg("post_norm"), py::arg("attn_out_norm"),
           py::arg("mlp_out_norm"), py::arg("q_norm"), py::arg("k_norm"), py::arg("qk_fused"),
           py::arg("rope"), py::arg("window"), py::arg("softcap"), py::arg("activation"),
           py::arg("qkv"), py::arg("o"), py::arg("gate_up"), py::arg("down"), py::arg("moe"))
      .def("set_final_norm", &DecodeStack::set_final_norm, py::arg("weight"))
      .def("num_layers", &DecodeStack::num_layers)
      // No Python object is touched inside: the grammar-bitmask thread runs meanwhile.
      .def("run", &DecodeStack::run, py::call_guard<py::gil_scoped_release>());
  m.def("paged_decode_attention", &paged_decode_attention,
        "paged decode attention, optionally windowed, soft-capped and with sink logits",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_table"),
        py::arg("ctx_lens"), py::arg("scale"), py::arg("window"), py::arg("softcap"),
        py::arg("sinks") = py::none(), py::arg("tiles") = false);
  m.def("attention_tiles_available", &attention_tiles_available,
        "whether prefill runs of paged_decode_attention can attend in tiles (AMX or AVX512-BF16)");
  m.def("attention_tiles_unit", &attention_tiles_unit,
        "the unit prefill tiles run on: 'amx', 'avx512-bf16', or '' (none)");
  m.def("attention_tile_rows", &attention_tile_rows,
        "rows attended in tiles since the process started (for tests)");
  m.def("set_attention_amx", &set_attention_amx,
        "prefill tiles on AMX where the CPU allows (on) or on AVX512-BF16; returns whether they "
        "now run on AMX", py::arg("on"));
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
  m.def("gated_delta_decode", &gated_delta_decode,
        "a decode token of a Gated DeltaNet layer between its projections, fused");
  m.def("gated_delta_conv_prefill", &gated_delta_conv_prefill,
        "a prompt's causal conv, SiLU and q/k norms for a Gated DeltaNet layer");
  m.def("isa", &isa, "instruction set this build uses");
  m.def("copy_rows", &copy_rows, "dst[rows[i]] = src[i], a memcpy per row");
  m.def("to_huge_pages", &to_huge_pages,
        "storages moved in place into memory advised for 2 MiB pages (zero: zeroed, not copied)",
        py::arg("tensors"), py::arg("zero") = false);
  m.def("quantize_blocks", &quantize_blocks, "activations to int8 per block of 32");
  m.def("moe_quant_swiglu", &moe_quant_swiglu,
        "a mixture-of-experts block's SwiGLU experts in GGUF blocks and the weighted sum",
        py::arg("x"), py::arg("ids"), py::arg("weights"), py::arg("gate"), py::arg("gate_type"),
        py::arg("up"), py::arg("up_type"), py::arg("down"), py::arg("down_type"));
  m.def("quant_matmul", &quant_matmul,
        "x @ weight parts (GGUF blocks, int8 rows)^T into out, x quantized per block of 32",
        py::arg("x"), py::arg("weights"), py::arg("types"), py::arg("scales"), py::arg("cols"),
        py::arg("out"), py::arg("invariant"), py::arg("rotation") = 0);
  m.def("rotate_rows", &rotate_rows,
        "each block of `block` values of x's rows times the Hadamard matrix, scaled by "
        "2^-(log2(block) // 2): --quantization int8's rotation", py::arg("x"), py::arg("block"));
  m.def("dequantize_rows", &dequantize_rows,
        "rows of GGUF-block weights or int8 rows (their scale, rotated back), dequantized",
        py::arg("w"), py::arg("type"), py::arg("ids"), py::arg("out"),
        py::arg("scale") = py::none(), py::arg("rotation") = 0);
  m.def("quant_isa", &quant_isa, "instruction set of the quantized kernels");
  m.def("set_iq_grids", &set_iq_grids,
        "IQ2_XXS's, IQ3_XXS's, IQ3_S's, IQ2_XS's and IQ2_S's grids (uint8 256 x 8, 256 x 4, "
        "512 x 4, 512 x 8, 1024 x 8), once per process", py::arg("iq2xxs"), py::arg("iq3xxs"),
        py::arg("iq3s"), py::arg("iq2xs"), py::arg("iq2s"));
  m.def("quant_r16", &quant_r16, "whether quant_matmul takes types repacked by 16 rows");
  m.def("quant_bf16_min_rows", &quant_bf16_min_rows,
        "from how many bfloat16 rows quant_matmul runs parts of this type (repacked, Q4_0, Q5_0) "
        "dequantized on AMX-BF16 outside batch-invariant mode (a call of several types: the largest; 0: never, "
        "here)", py::arg("type"));
  m.def("quant_token_min_rows", &quant_token_min_rows,
        "from how many rows quant_matmul runs rotated int8 rows with per-token activations on "
        "AMX-INT8 outside batch-invariant mode (0: never, here)");
  m.def("quant_bf16_gemm_rows", &quant_bf16_gemm_rows,
        "from how many of those rows the dequantized weights go to torch's GEMM (0: never)");
  m.def("set_linear_amx", &set_linear_amx,
        "batch-invariant bfloat16 linears on AMX tiles (on: where the CPU allows); returns whether "
        "they now run there", py::arg("on"));
  m.def("linear_amx_available", &linear_amx_available,
        "whether this build and CPU run bfloat16 linears on AMX tiles");
  m.def("set_quant_amx", &set_quant_amx,
        "run repacked parts on AMX from 16 rows where the CPU has it (default on); returns "
        "whether AMX is now in use");
}
