// Quantized linears (GGUF blocks, int8 rows) and their activation quantizers: quant.cpp. The
// functions bindings.cpp exposes.
#pragma once
#include "vec.h"  // ATen, lean

#include <string>
#include <vector>

std::vector<at::Tensor> quantize_blocks(const at::Tensor& x);
void quant_matmul(const at::Tensor& x, const std::vector<at::Tensor>& ws,
                  const std::vector<int64_t>& types, const std::vector<at::Tensor>& scales,
                  const std::vector<int64_t>& cols, at::Tensor y, bool invariant,
                  int64_t rotation);  // rotation: the parts' Hadamard block (rotate_rows) or 0
at::Tensor rotate_rows(const at::Tensor& x, int64_t block);  // models/int8.py's rotation
void dequantize_rows(const at::Tensor& w, int64_t type, const at::Tensor& ids, at::Tensor out,
                     const c10::optional<at::Tensor>& scale, int64_t rotation);
at::Tensor moe_quant_swiglu(const at::Tensor& x, const at::Tensor& ids,
                            const at::Tensor& weights, const at::Tensor& gate, int64_t gate_type,
                            const at::Tensor& up, int64_t up_type, const at::Tensor& down,
                            int64_t down_type);
std::string quant_isa();
// IQ2_XXS's, IQ3_XXS's and IQ3_S's grids (uint8 256 x 8, 256 x 4, 512 x 4), from gguf-py: set
// once, before parts of those types (quant.py's IQ2_XXS_32, IQ3_XXS_32, IQ3_S_32) are kernel
// types.
void set_iq_grids(const at::Tensor& iq2xxs, const at::Tensor& iq3xxs, const at::Tensor& iq3s,
                  const at::Tensor& iq2xs, const at::Tensor& iq2s);
bool quant_r16();  // whether quant_matmul takes parts repacked by 16 rows (quant.py's R16_OF)
bool set_quant_amx(bool on);  // repacked parts on AMX from 16 rows; returns whether it now is
// From how many rows a call of parts of this type (repacked: -3 .. -8; Q4_0, Q5_0) runs
// dequantized on AMX-BF16 (not batch-invariant; a call of several types: the largest); 0: never
int64_t quant_bf16_min_rows(int64_t type);
int64_t quant_bf16_gemm_rows();
// From how many rows a call of rotated int8 rows (repacked) quantizes its activations per token
// and sums over all of K on AMX-INT8 (not batch-invariant); 0: never, here
int64_t quant_token_min_rows();  // from how many of those rows torch's GEMM multiplies; 0: never
