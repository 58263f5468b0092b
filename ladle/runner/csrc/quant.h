// Quantized linears (GGUF blocks, int8 rows) and their activation quantizers: quant.cpp. The
// functions bindings.cpp exposes.
#pragma once
#include <torch/types.h>

#include <string>
#include <vector>

std::vector<at::Tensor> quantize_blocks(const at::Tensor& x);
std::vector<at::Tensor> quantize_rows(const at::Tensor& x);
void quant_linear(const at::Tensor& qx, const at::Tensor& dx, const at::Tensor& sx,
                  const at::Tensor& w, int64_t type, at::Tensor y);
void int8_linear(const at::Tensor& qx, const at::Tensor& dx, const at::Tensor& w,
                 const at::Tensor& dw, at::Tensor y);
void dequantize_rows(const at::Tensor& w, int64_t type, const at::Tensor& ids, at::Tensor out);
std::string quant_isa();
