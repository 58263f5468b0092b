// Quantized linears: y (M, N) = x (M, K) @ W (N, K)^T where W's rows are parts, each in GGUF blocks
// (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, MXFP4, IQ4_NL, IQ4_XS, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S,
// Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) or int8 with a scale per row, and x is quantized to int8 once
// per call for all parts. One call, one parallel region: a decode step's small matmuls (0.2-2
// MB of weights, 10-100 us) would otherwise spend a third of their time in Python and in the
// threads' wake-ups and joins. The pure-torch twin is in ladle/runner/quant.py; the tests
// compare the two.
//
// The scheme (ggml's, written afresh): the activations are int8 per block of 32 values with a float
// scale (d = max|x| / 127); a weight block of 32 is unpacked in registers to 32 int8 values; the 32
// products are summed in integers (AVX2 vpmaddubsw + vpmaddwd, or VNNI vpdpbusd), converted once
// and scaled by d_w * d_x. vpmaddubsw multiplies unsigned by signed bytes, so the signed weights of
// Q8_0, MXFP4 and IQ4 go in as |w| with the sign moved onto x (vpsignb); Q4_0's and Q5_0's go in as
// q + 8 and q + 16, that bias times sum(x) taken off each block's integer sum. The K-quants' values
// go in unsigned (Q4_K's nibbles, Q6_K's q before its -32), their sub-block scales multiply the
// integer sums in the vpmaddwd, and what the unsigned form adds comes off per sub-block from the
// activations' sums kept beside their scales (Q6_K's offset in integers, Q4_K's and Q5_K's mins as
// one FMA; Q4_1's and Q5_1's values go in as stored, their min m per block of 32 the same FMA;
// Q2_K's mins per 16 values an integer of their own, then one FMA). An
// int8 row is read as Q8_0 blocks with scale 1, and its row scale multiplies the sum at the end.
// Everything is exact in integers up to the float32 scaling: the result equals the float64 product
// of the dequantized weights and activations to ~1e-6 relative.
//
// The K-quants' activations stay in blocks of 32, not ggml's super-blocks of 256 (Q8_K, whose
// integer sums over a super-block save the per-block float scaling): measured on the Gemma file,
// Q8_K activations took KL(f32 || ladle) from 0.0031 to 0.0056 (llama.cpp's own: 0.0049).
//
// Threads split N. Each task multiplies a tile of 8 weight rows by up to 4 activation rows
// while the weight blocks are in registers, so for decode the weights are read once at memory
// speed, and for prefill every unpacked weight block serves several rows. AVX-512 VNNI builds
// run 12 or more rows in panels instead (below: 16 weight rows unpacked once per call, 64
// products per instruction into 16 outputs), and the K-quants and Q8_0 repacked at load into
// that layout (r16_rows) for every row count. Tiles, panels and repacked rows sum every row in one order
// (see the tiles), so a row's result does not depend on the rows beside it: these paths are
// batch-invariant in every mode. The one exception, on AMX-BF16 CPUs outside batch-invariant
// mode: calls of enough bfloat16 rows (bf16_min_rows: 8 to 20 by type) of repacked, Q4_0 or
// Q5_0 parts run dequantized on the tile unit or torch's GEMM (bf16_group), a different product.
#include "quant.h"
#include "kernels.h"
#include "moe.h"
#include "vec.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <optional>
#include <type_traits>
#include <utility>
#if defined(__BMI2__)
#include <immintrin.h>  // _pdep_u64
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define LADLE_QUANT_AVX2 1
#include <immintrin.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define LADLE_QUANT_512 1  // the panels (prefill, batched decode)
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#define LADLE_QUANT_AMX 1  // repacked parts 16 rows at a time on the tile unit (vec.h asks Linux)
#endif
#endif
#endif

namespace {

constexpr int kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ2_K = 10, kQ3_K = 11,
              kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kIQ4NL = 20, kMXFP4 = 39;
constexpr int kI8 = -1;  // int8 rows with a float scale per row (quant.py's INT8_ROW)
// IQ4_XS's sub-blocks as blocks of 32 (quant.py's IQ4_XS_32): a float32 scale, d times the
// sub-block's 6-bit scale (exact), then IQ4_NL's 16 bytes of nibbles.
constexpr int kIQ4XS32 = -9;
// IQ4_NL and IQ4_XS: nibbles that index a table of 16 int8 values (kIq4Values), as MXFP4's index
// its e2m1 table; blocks of 32 with one float scale, so they run where MXFP4 does.
template <int TYPE> constexpr bool kLut4 =
    TYPE == kMXFP4 || TYPE == kIQ4NL || TYPE == kIQ4XS32;
// IQ2_XXS and IQ3_XXS (the bulk of IQ2_XXS / IQ3_XXS / IQ3_XS files): a super-block of 256
// values, d, then per 32 values grid indices and one 32-bit word of 4 x 7 sign bits and a 4-bit
// scale s; an index picks 8 (IQ2_XXS) or 4 (IQ3_XXS) magnitudes from a fixed table (the grid),
// the 7 bits the signs of 8 values (the 8th makes the count of minus signs even), and w = d *
// (s + 1/2) / 4 (IQ3_XXS: / 2) * grid * sign. IQ2_XXS runs as blocks of 32 (quant.py's
// IQ2_XXS_32): the float32 scale d * (s + 1/2) / 4 (exact), the grid indices as stored, then
// the 32 sign bits (bit i: value i negative), 12 bytes against the file's 8.25. Unpacking the
// scale and the eighth sign bits per block took as many instructions as the rest of the product
// (with d copied into each 32 instead, 10 bytes, the 0.6B's IQ2_XXS file decoded at 0.78x
// llama.cpp's speed). Signed values as Q8_0's, |w| <= 62.
// IQ3_S (IQ3_S / IQ3_M files' bulk) alike: 9-bit indices into a grid of 512 x 4, its signs
// stored as bits, a 4-bit scale s per 32 values, w = d * (2s + 1) * grid * sign. The IQ3 grids'
// magnitudes are 8 levels (IQ3_XXS 4, 12, .. 52, 62; IQ3_S 1, 3, .. 15), so IQ3_XXS_32 and
// IQ3_S_32 (one layout) hold each value's level as a 3-bit code instead of the indices: the
// float32 scale, the codes (value i's in bits 3i .. 3i + 2 of 12 bytes), the 32 sign bits; 20
// bytes against the file's 12.25 and 13.75. Codes become magnitudes in registers (a byte
// shuffle, one multishift, one table shuffle with AVX-512 VBMI) where indices took a gather of
// 8 grid entries per 32 values (IQ3_XXS: 16 bytes, 0.6B file 0.95x llama.cpp's decode).
// IQ2_XS and IQ2_S (IQ2_XS / IQ2_S / IQ2_M files' bulk, IQ3_XXS files' attn_q and attn_k): 8
// magnitudes per index as IQ2_XXS's, from grids of 512 and 1024 entries (9- and 10-bit
// indices), signs from a 7-bit index (IQ2_XS) or stored as bits (IQ2_S), and a 4-bit scale per
// 16 values: w = d * (s + 1/2) / 4 * grid * sign. As IQ2_XS_32 / IQ2_S_32 (one layout): the
// float32 d / 8, the indices' low bytes, the 32 sign bits, a byte of the indices' high bits
// (bits 2k, 2k + 1: index k's ninth and tenth), then the byte of the halves' scales (low nibble:
// values 0-15); 14 bytes against the file's 9.25 and 10.25. A half's integer sum is multiplied by
// its 2s + 1 (<= 31) in integers, so a block's sum stays one exact integer as for the other
// blocks of 32.
constexpr int kIQ2XXS32 = -12, kIQ3XXS32 = -13, kIQ3S32 = -14, kIQ2XS32 = -15, kIQ2S32 = -16;
template <int TYPE> constexpr bool kGridHalves = TYPE == kIQ2XS32 || TYPE == kIQ2S32;
template <int TYPE> constexpr bool kGrid =
    TYPE == kIQ2XXS32 || TYPE == kIQ3XXS32 || TYPE == kIQ3S32 || kGridHalves<TYPE>;
template <int TYPE> constexpr bool kGrid8 = TYPE == kIQ2XXS32 || kGridHalves<TYPE>;  // 8 a row
template <int TYPE> constexpr int kGridSigns = kGrid8<TYPE> ? 8 : 16;  // the bits' offset
constexpr int kGridHigh = 12, kGridScales = 13;  // IQ2_XS_32's, IQ2_S_32's bytes
// The grids, as gguf-py (ggml's iq2xxs_grid, iq2xs_grid, iq2s_grid) defines them: 256, 512 and
// 1024 entries of 8 magnitudes, one byte each; the IQ3 grids' 8 levels, ascending (the code's
// order), padded to 16 bytes. Set once per process by set_iq_grids (cpu_kernels.py, when the
// kernels load) before any part of those types can run; quant_matmul refuses them until then.
struct IqGrids {
  uint64_t g2[256];
  uint64_t g2xs[512];
  uint64_t g2s[1024];
  uint8_t l3[16];
  uint8_t l3s[16];
};
IqGrids g_iq;
std::atomic<bool> g_iq_ready{false};
template <int TYPE>
inline uint32_t grid_signs(const uint8_t* b) {
  uint32_t w;
  std::memcpy(&w, b + kGridSigns<TYPE>, 4);
  return w;
}
// The 4 indices of an IQ2_XS_32 (9 bits) / IQ2_S_32 (10 bits) block, index k in bits 16k ..
// 16k + 15: two bit deposits where the CPU has BMI2 (the 0.6B's linears at one row, 28 layers
// of random IQ2_XS blocks, Zen 4: 21.4 ms with the indices put together one at a time, 17.6).
template <int TYPE>
inline uint64_t grid8_indices(const uint8_t* b) {
  const uint32_t high = b[kGridHigh] & (TYPE == kIQ2XS32 ? 0x55 : 0xFF);
  uint32_t low;
  std::memcpy(&low, b + 4, 4);
#if defined(__BMI2__)
  return _pdep_u64(low, 0x00FF00FF00FF00FFULL) | _pdep_u64(high, 0x0300030003000300ULL);
#else
  uint64_t i = 0;
  for (int k = 0; k < 4; k++)
    i |= uint64_t(((low >> (8 * k)) & 0xFF) | ((high >> (2 * k)) & 3) << 8) << (16 * k);
  return i;
#endif
}
// Grid entry k (0..3) of an IQ2_XXS_32 / IQ2_XS_32 / IQ2_S_32 block (`i`: IQ2_XS's and IQ2_S's
// grid8_indices).
template <int TYPE>
inline uint64_t grid8_entry(const uint8_t* b, uint64_t i, int k) {
  if constexpr (TYPE == kIQ2XXS32) return g_iq.g2[b[4 + k]];
  else if constexpr (TYPE == kIQ2XS32) return g_iq.g2xs[(i >> (16 * k)) & 0xFFFF];
  else return g_iq.g2s[(i >> (16 * k)) & 0xFFFF];
}
// The halves' integer scales 2s + 1 of an IQ2_XS_32 / IQ2_S_32 block.
inline int half_scale(const uint8_t* b, int half) {
  return 2 * ((b[kGridScales] >> (4 * half)) & 0xF) + 1;
}
// The 32 magnitudes of a block, in order.
template <int TYPE>
inline void grid_magnitudes(const uint8_t* b, uint8_t* out) {
  if constexpr (kGrid8<TYPE>) {
    const uint64_t i = kGridHalves<TYPE> ? grid8_indices<TYPE>(b) : 0;
    for (int k = 0; k < 4; k++) {
      const uint64_t e = grid8_entry<TYPE>(b, i, k);
      std::memcpy(out + 8 * k, &e, 8);
    }
  } else {  // IQ3: 3-bit codes into the levels
    const uint8_t* levels = TYPE == kIQ3XXS32 ? g_iq.l3 : g_iq.l3s;
    for (int i = 0; i < 32; i++) {
      uint16_t two;
      std::memcpy(&two, b + 4 + 3 * i / 8, 2);
      out[i] = levels[(two >> (3 * i % 8)) & 7];
    }
  }
}
// Repacked at load by 16 rows (quant.py's Q4_K_R16, Q6_K_R16, Q8_0_R16, INT8_ROW_R16,
// Q5_0_R16, Q5_K_R16, Q3_K_R16, Q2_K_R16; AVX-512 VNNI builds).
constexpr int kQ4KR = -3, kQ6KR = -4, kQ8R = -5, kI8R = -6, kQ5R = -7, kQ5KR = -8, kQ3KR = -10,
              kQ2KR = -11;
inline bool is_r16(int type) {
  return type == kQ4KR || type == kQ6KR || type == kQ8R || type == kI8R || type == kQ5R ||
         type == kQ5KR || type == kQ3KR || type == kQ2KR;
}
// Q6_K and Q3_K repacked share the header (d, then the int8 scales by 16 values) and every
// path: a scale per half of a sub-block, their values unsigned with a bias (32, 4).
template <int TYPE> constexpr bool kS16R = TYPE == kQ6KR || TYPE == kQ3KR;
// The repacked types with a scale per half of a sub-block (two integer sums each): those, and
// Q2_K (its header d, dmin, then the scale | min << 4 bytes by 16 values; values unbiased).
template <int TYPE> constexpr bool kHalvesR = kS16R<TYPE> || TYPE == kQ2KR;
// Q4_K and Q5_K share a super-block's header (d, dmin, 12 bytes of 6-bit scales and mins) and
// the order of its nibbles; Q5_K adds each value's fifth bit (qh, 32 bytes before its 128 bytes
// of nibbles: bit j of byte l is value l of sub-block j's), so q is 0 .. 31 where Q4_K's is
// 0 .. 15, and every path below runs both with the same steps. Q4_K_M files hold Q5_K tensors
// where a model fuses q|k|v (Phi-3) or has 8 experts (Mixtral's attn_output), Q5_K_M files
// nearly all of theirs.
template <int TYPE> constexpr bool kK4 = TYPE == kQ4_K || TYPE == kQ5_K;
template <int TYPE> constexpr bool kK4R = TYPE == kQ4KR || TYPE == kQ5KR;
template <int TYPE> constexpr int64_t kK4Bytes = TYPE == kQ5_K ? 176 : 144;  // a super-block
template <int TYPE> constexpr int64_t kK4Qs = TYPE == kQ5_K ? 48 : 16;  // its nibbles' offset
// Q4_1 and Q5_1: Q4_0's and Q5_0's blocks of 32 with a float16 min m after the scale d, w = d q
// + m with q unsigned (0 .. 15, 0 .. 31): the fallback llama.cpp's quantizer writes for Q5_K
// (Q5_K_M files) where a row is not a multiple of 256 (Gemma 3 1B's 1152, Qwen2.5 0.5B's 896),
// and Q4_0 files' 8-expert ffn_down. Their min takes the K-quants' step, with -m as the min.
template <int TYPE> constexpr bool kMin32 = TYPE == kQ4_1 || TYPE == kQ5_1;
// Whether a type's sums take a min step (acc -= min * dx * sum(x)).
template <int TYPE> constexpr bool kHasMin = kK4<TYPE> || kMin32<TYPE>;
// Q2_K (Q2_K files' bulk, the 2-3 bit files of large MoE models): 84 bytes per 256 values,
// scales[16] (per 16 values a 4-bit scale, low nibble, and 4-bit min, high nibble), qs[64],
// d, dmin; w = d * sc * q - dmin * m, q 0 .. 3. Sub-block j (0 .. 7) of 32 values is bits 2(j %
// 4) of the 32 bytes qs[32 (j / 4) ..], its halves scales 2j and 2j + 1 (Q6_K's order). Its
// mins change every 16 values, so its min step is its own, in integers (below: Mi).
constexpr int64_t kQ2KBytes = 84;
// Q3_K (Q3_K_S/M/L files' bulk): 110 bytes per 256 values, hmask[32], qs[64] (the low 2 bits,
// laid out as Q2_K's), scales[12] (16 six-bit scales, stored + 32), d; w = d * sc * q with q
// -4 .. 3: its low 2 bits, minus 4 where its hmask bit (bit j of byte i for value 32j + i) is
// clear. Q6_K's form with q + 4 (0 .. 7) for Q6_K's q (0 .. 63) and 4 for its offset 32: the
// two share every path.
constexpr int64_t kQ3KBytes = 110;
// The scale-per-16 types, run alike: Q6_K and Q3_K (bytes per super-block, where d is, the
// offset of their unsigned values).
template <int TYPE> constexpr bool kS16 = TYPE == kQ6_K || TYPE == kQ3_K;
template <int TYPE> constexpr int64_t kS16Bytes = TYPE == kQ3_K ? kQ3KBytes : 210;
template <int TYPE> constexpr int64_t kS16D = TYPE == kQ3_K ? 108 : 208;
template <int TYPE> constexpr int kS16Shift = TYPE == kQ3_K ? 2 : 5;  // offset 4, 32

// Q3_K's 16 scales (signed) from its 12 bytes: the low 4 bits of scale i in the low nibble of
// byte i (i < 8) or the high nibble of byte i - 8, the high 2 bits at bits 2 (i / 4) of byte 8 +
// i % 4. Each 32-bit word of the result takes four of them at once.
inline void q3k_scales(const uint8_t* p, int8_t* sc) {
  uint32_t a[3], w[4];
  std::memcpy(a, p, 12);
  const uint32_t nib = 0x0F0F0F0F, two = 0x03030303;
  w[0] = (a[0] & nib) | ((a[2] & two) << 4);
  w[1] = (a[1] & nib) | (((a[2] >> 2) & two) << 4);
  w[2] = ((a[0] >> 4) & nib) | (((a[2] >> 4) & two) << 4);
  w[3] = ((a[1] >> 4) & nib) | (((a[2] >> 6) & two) << 4);
  std::memcpy(sc, w, 16);
  for (int i = 0; i < 16; i++) sc[i] = int8_t(sc[i] - 32);
}

// Q3_K's scale i alone (what a panel's sub-block needs: two of them).
inline int q3k_scale(const uint8_t* p, int i) {
  const int low = i < 8 ? p[i] & 0xF : p[i - 8] >> 4;
  return (low | (((p[8 + (i & 3)] >> (2 * (i >> 2))) & 3) << 4)) - 32;
}

// The scales of sub-block j's halves (2j, 2j + 1) of a Q6_K or Q3_K super-block b.
template <int TYPE>
inline void s16_pair(const uint8_t* b, int j, float& s0, float& s1) {
  if constexpr (TYPE == kQ3_K) {
    s0 = float(q3k_scale(b + 96, 2 * j));
    s1 = float(q3k_scale(b + 96, 2 * j + 1));
  } else {
    s0 = float(int8_t(b[192 + 2 * j]));
    s1 = float(int8_t(b[193 + 2 * j]));
  }
}

// The 16 int8 scales of a Q6_K or Q3_K super-block b (Q3_K's unpacked into tmp).
template <int TYPE>
inline const int8_t* s16_scales(const uint8_t* b, int8_t* tmp) {
  if constexpr (TYPE == kQ3_K) {
    q3k_scales(b + 96, tmp);
    return tmp;
  } else {
    return reinterpret_cast<const int8_t*>(b + 192);
  }
}
// The repacked types the tile unit's paths (AMX-INT8, AMX-BF16) take; Q5_0_R16 runs on the
// vector kernel only (quant.py repacks Q5_0 only where AMX-BF16 does not take its blocks).
inline bool tile_r16(int type) { return is_r16(type) && type != kQ5R; }
// Types not repacked whose 16-row panels can also become bfloat16 B tiles (bf16_group).
constexpr bool bf16_panel_type(int type) {
  return type == kQ4_0 || type == kQ5_0 || type == kQ4_1 || type == kQ5_1 || type == kIQ4NL ||
         type == kIQ4XS32;
}
inline int r16_base(int type) {
  return type == kQ4KR ? kQ4_K : type == kQ6KR ? kQ6_K : type == kQ5R ? kQ5_0
       : type == kQ5KR ? kQ5_K : type == kQ3KR ? kQ3_K : type == kQ2KR ? kQ2_K : kQ8_0;
}

// f(std::integral_constant<int, TYPE>{}) for a kernel type (checked by the caller): the one
// switch from a part's type to the code compiled for it.
template <typename F>
inline void with_type(int type, F&& f) {
  switch (type) {
    case kQ8_0: return f(std::integral_constant<int, kQ8_0>{});
    case kQ4_0: return f(std::integral_constant<int, kQ4_0>{});
    case kQ4_1: return f(std::integral_constant<int, kQ4_1>{});
    case kQ5_1: return f(std::integral_constant<int, kQ5_1>{});
    case kQ5_0: return f(std::integral_constant<int, kQ5_0>{});
    case kMXFP4: return f(std::integral_constant<int, kMXFP4>{});
    case kIQ4NL: return f(std::integral_constant<int, kIQ4NL>{});
    case kIQ4XS32: return f(std::integral_constant<int, kIQ4XS32>{});
    case kIQ2XXS32: return f(std::integral_constant<int, kIQ2XXS32>{});
    case kIQ3XXS32: return f(std::integral_constant<int, kIQ3XXS32>{});
    case kIQ3S32: return f(std::integral_constant<int, kIQ3S32>{});
    case kIQ2XS32: return f(std::integral_constant<int, kIQ2XS32>{});
    case kIQ2S32: return f(std::integral_constant<int, kIQ2S32>{});
    case kQ4_K: return f(std::integral_constant<int, kQ4_K>{});
    case kQ5_K: return f(std::integral_constant<int, kQ5_K>{});
    case kQ6_K: return f(std::integral_constant<int, kQ6_K>{});
    case kQ2_K: return f(std::integral_constant<int, kQ2_K>{});
    case kQ3_K: return f(std::integral_constant<int, kQ3_K>{});
    default: return f(std::integral_constant<int, kI8>{});
  }
}

// (values per block, bytes per block), as gguf's GGML_QUANT_SIZES.
inline int64_t block_values(int type) {
  return (type == kQ2_K || type == kQ3_K || type == kQ4_K || type == kQ5_K || type == kQ6_K ||
          type == kQ4KR || type == kQ5KR || type == kQ6KR || type == kQ3KR || type == kQ2KR)
      ? 256 : 32;
}
constexpr int64_t block_bytes(int type) {
  switch (type) {
    case kQ4_0: return 18;
    case kQ5_0: return 22;
    case kQ4_1: return 20;
    case kQ5_1: return 24;
    case kQ8_0: return 34;
    case kMXFP4: return 17;
    case kIQ4NL: return 18;
    case kIQ4XS32: return 20;
    case kIQ2XXS32: return 12;
    case kIQ3XXS32: return 20;
    case kIQ3S32: return 20;
    case kIQ2XS32: return 14;
    case kIQ2S32: return 14;
    case kQ4_K: return 144;
    case kQ5_K: return 176;
    case kQ6_K: return 210;
    case kQ2_K: return 84;
    case kQ3_K: return 110;
    case kI8: return 32;
    case kQ4KR: return 148;  // per row: 16 rows' 2368 bytes
    case kQ6KR: return 210;  // 16 rows' 3360
    case kQ3KR: return 114;  // 16 rows' 1824
    case kQ2KR: return 84;  // 16 rows' 1344
    case kQ8R: return 34;  // 16 rows' 544 per 32 values
    case kI8R: return 32;  // 16 rows' 512
    case kQ5R: return 22;  // 16 rows' 352
    case kQ5KR: return 180;  // 16 rows' 2880
  }
  return 0;
}

inline float f16(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(LADLE_QUANT_AVX2)
  return _cvtsh_ss(bits);  // one instruction (F16C); c10's conversion is a dozen
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// MXFP4 (gpt-oss's experts): 17 bytes, e (E8M0) then 16 bytes of nibbles in Q4_0's order (value
// i the low nibble of byte i, value i + 16 its high nibble). A nibble is an e2m1 code (sign,
// 2 exponent bits, 1 mantissa bit), whose value doubled is an integer of this table, and the
// block's scale is half of 2^(e - 127): 2^(e - 128), as ggml's GGML_E8M0_TO_FP32_HALF (for e = 0
// and 1 a float32 subnormal). So w = kMxfp4Values[q] * 2^(e - 128), an int8 times a float scale
// as Q4_0's (q - 8) * d: the same integer dot products (|w| <= 12). As in ggml, a block's sum is
// scaled by the float32 product 2^(e - 128) * d_x, which for e <= 1 and small activations is a
// subnormal with fewer bits (trained weights are far above that: |w| ~ 0.01 has e ~ 120).
constexpr int8_t kMxfp4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// The scale 2^(e - 128) of every E8M0 byte e, looked up: one load, where computing it from e's
// bits took 9 instructions per block (AVX2 EPYC, both cores, one activation row, 2048 x 2048:
// 126 us computed, 113 looked up, Q4_0 126). Halving and doubling are exact, subnormals included.
struct E8m0Half {
  float v[256];
  constexpr E8m0Half() : v() {
    v[128] = 1.f;
    for (int e = 129; e < 256; e++) v[e] = v[e - 1] * 2.f;
    for (int e = 127; e >= 0; e--) v[e] = v[e + 1] * 0.5f;
  }
};
constexpr E8m0Half kE8m0Half{};
static_assert(kE8m0Half.v[0] == 0x1p-128f && kE8m0Half.v[1] == 0x1p-127f &&
              kE8m0Half.v[127] == 0.5f && kE8m0Half.v[255] == 0x1p127f);

inline float e8m0_half(uint8_t e) { return kE8m0Half.v[e]; }

// ggml's kvalues_iq4nl: the 16 values of IQ4_NL's and IQ4_XS's nibbles (|w| <= 127, as Q8_0's,
// so the int16 pair sums of vpmaddubsw hold them).
constexpr int8_t kIq4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                   1,    13,   25,  38,  53,  69,  89,  113};

// The 16-value table and the offset of the nibbles in a block of a kLut4 type.
template <int TYPE> constexpr const int8_t* kLut4Table =
    TYPE == kMXFP4 ? kMxfp4Values : kIq4Values;
template <int TYPE> constexpr int kLut4Qs = TYPE == kMXFP4 ? 1 : TYPE == kIQ4NL ? 2 : 4;

inline float f32_at(const uint8_t* p) {
  float v;
  std::memcpy(&v, p, 4);
  return v;
}

// Q4_K's 6-bit scale and min of sub-block j (0..7) from its 12 packed bytes: sub-blocks 0-3
// keep them in the low 6 bits of bytes j and j+4; 4-7 have the low 4 bits in byte j+4 (scale
// low nibble, min high nibble) and the high 2 bits in the top bits of bytes j-4 and j.
inline void k4_scale_min(const uint8_t* s, int j, int& sc, int& mn) {
  if (j < 4) {
    sc = s[j] & 63;
    mn = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// One sub-block of 32 values of a weight row: w[i] = (i < 16 ? s0 : s1) * q[i] - (i < 16 ? minv
// : minv_hi) (minv_hi = minv except Q2_K's).
struct Sub {
  int8_t q[32];  // signed, except Q4_K, Q4_1: 0..15, Q5_K, Q5_1: 0..31, Q2_K: 0..3
  float s0, s1, minv, minv_hi;
};

// The scales of sub-block `sb` of a row of `type` blocks (Sub's s0, s1, minv; q untouched).
template <int TYPE>
inline void sub_scales(const uint8_t* row, int64_t sb, Sub& o) {
  o.minv = 0.f;
  if constexpr (TYPE == kI8) {
    o.s0 = o.s1 = 1.f;
  } else if constexpr (TYPE == kQ8_0) {
    o.s0 = o.s1 = f16(row + sb * 34);
  } else if constexpr (TYPE == kQ4_0) {
    o.s0 = o.s1 = f16(row + sb * 18);
  } else if constexpr (TYPE == kQ5_0) {
    o.s0 = o.s1 = f16(row + sb * 22);
  } else if constexpr (kMin32<TYPE>) {
    const uint8_t* b = row + sb * (TYPE == kQ4_1 ? 20 : 24);
    o.s0 = o.s1 = f16(b);
    o.minv = -f16(b + 2);
  } else if constexpr (TYPE == kMXFP4) {
    o.s0 = o.s1 = e8m0_half(row[sb * 17]);
  } else if constexpr (TYPE == kIQ4NL) {
    o.s0 = o.s1 = f16(row + sb * 18);
  } else if constexpr (TYPE == kIQ4XS32) {
    o.s0 = o.s1 = f32_at(row + sb * 20);
  } else if constexpr (kGridHalves<TYPE>) {
    const uint8_t* b = row + sb * block_bytes(TYPE);
    o.s0 = f32_at(b) * float(half_scale(b, 0));
    o.s1 = f32_at(b) * float(half_scale(b, 1));
  } else if constexpr (kGrid<TYPE>) {
    o.s0 = o.s1 = f32_at(row + sb * block_bytes(TYPE));
  } else if constexpr (kK4<TYPE>) {
    const uint8_t* b = row + (sb >> 3) * kK4Bytes<TYPE>;
    int sc, mn;
    k4_scale_min(b + 4, int(sb & 7), sc, mn);
    o.s0 = o.s1 = f16(b) * float(sc);
    o.minv = f16(b + 2) * float(mn);
  } else if constexpr (kS16<TYPE>) {  // Q6_K (ql[128], qh[64], int8 scales[16], d), Q3_K
    const uint8_t* b = row + (sb >> 3) * kS16Bytes<TYPE>;
    const int j = int(sb & 7);
    const float d = f16(b + kS16D<TYPE>);
    float s0, s1;
    s16_pair<TYPE>(b, j, s0, s1);
    o.s0 = d * s0;
    o.s1 = d * s1;
  }
  if constexpr (TYPE == kQ2_K) {
    const uint8_t* b = row + (sb >> 3) * kQ2KBytes;
    const uint8_t* sc = b + 2 * (sb & 7);
    const float d = f16(b + 80), dmin = f16(b + 82);
    o.s0 = d * float(sc[0] & 0xF);
    o.s1 = d * float(sc[1] & 0xF);
    o.minv = dmin * float(sc[0] >> 4);
    o.minv_hi = dmin * float(sc[1] >> 4);
  } else {
    o.minv_hi = o.minv;
  }
}

// Sub-block `sb` (values 32*sb .. 32*sb+31) of a row of `type` blocks.
template <int TYPE>
inline void unpack_scalar(const uint8_t* row, int64_t sb, Sub& o) {
  sub_scales<TYPE>(row, sb, o);
  if constexpr (TYPE == kI8) {
    std::memcpy(o.q, row + sb * 32, 32);
  } else if constexpr (TYPE == kQ8_0) {
    std::memcpy(o.q, row + sb * 34 + 2, 32);
  } else if constexpr (TYPE == kQ4_0) {
    const uint8_t* b = row + sb * 18;
    for (int i = 0; i < 16; i++) {
      o.q[i] = int8_t((b[2 + i] & 0xF) - 8);
      o.q[i + 16] = int8_t((b[2 + i] >> 4) - 8);
    }
  } else if constexpr (TYPE == kQ5_0) {
    const uint8_t* b = row + sb * 22;
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    for (int i = 0; i < 16; i++) {
      o.q[i] = int8_t(((b[6 + i] & 0xF) | (((qh >> i) & 1) << 4)) - 16);
      o.q[i + 16] = int8_t(((b[6 + i] >> 4) | (((qh >> (i + 16)) & 1) << 4)) - 16);
    }
  } else if constexpr (TYPE == kQ4_1) {
    const uint8_t* b = row + sb * 20;
    for (int i = 0; i < 16; i++) {
      o.q[i] = int8_t(b[4 + i] & 0xF);
      o.q[i + 16] = int8_t(b[4 + i] >> 4);
    }
  } else if constexpr (TYPE == kQ5_1) {
    const uint8_t* b = row + sb * 24;
    uint32_t qh;
    std::memcpy(&qh, b + 4, 4);
    for (int i = 0; i < 16; i++) {
      o.q[i] = int8_t((b[8 + i] & 0xF) | (((qh >> i) & 1) << 4));
      o.q[i + 16] = int8_t((b[8 + i] >> 4) | (((qh >> (i + 16)) & 1) << 4));
    }
  } else if constexpr (kGrid<TYPE>) {
    const uint8_t* b = row + sb * block_bytes(TYPE);
    uint8_t mag[32];
    grid_magnitudes<TYPE>(b, mag);
    const uint32_t neg = grid_signs<TYPE>(b);
    for (int i = 0; i < 32; i++) o.q[i] = int8_t((neg >> i) & 1 ? -mag[i] : mag[i]);
  } else if constexpr (kLut4<TYPE>) {
    constexpr int64_t bytes = TYPE == kMXFP4 ? 17 : TYPE == kIQ4NL ? 18 : 20;
    const uint8_t* b = row + sb * bytes + kLut4Qs<TYPE>;
    for (int i = 0; i < 16; i++) {
      o.q[i] = kLut4Table<TYPE>[b[i] & 0xF];
      o.q[i + 16] = kLut4Table<TYPE>[b[i] >> 4];
    }
  } else if constexpr (kK4<TYPE>) {
    const int j = int(sb & 7);
    const uint8_t* b = row + (sb >> 3) * kK4Bytes<TYPE>;
    const uint8_t* qs = b + kK4Qs<TYPE> + (j >> 1) * 32;
    for (int i = 0; i < 32; i++) {
      o.q[i] = int8_t((j & 1) ? (qs[i] >> 4) : (qs[i] & 0xF));
      if constexpr (TYPE == kQ5_K) o.q[i] = int8_t(o.q[i] | (((b[16 + i] >> j) & 1) << 4));
    }
  } else if constexpr (TYPE == kQ2_K) {
    const uint8_t* qs = row + (sb >> 3) * kQ2KBytes + 16 + ((sb & 7) >> 2) * 32;
    const int shift = 2 * int(sb & 3);
    for (int i = 0; i < 32; i++) o.q[i] = int8_t((qs[i] >> shift) & 3);
  } else if constexpr (TYPE == kQ3_K) {
    const uint8_t* b = row + (sb >> 3) * kQ3KBytes;
    const int j = int(sb & 7);
    const uint8_t* qs = b + 32 + (j >> 2) * 32;
    for (int i = 0; i < 32; i++)
      o.q[i] = int8_t(((qs[i] >> (2 * (j & 3))) & 3) - (((b[i] >> j) & 1) ? 0 : 4));
  } else {  // Q6_K
    const uint8_t* b = row + (sb >> 3) * 210;
    const int j = int(sb & 7), half = j >> 2, g = j & 3;
    const uint8_t* ql = b + half * 64 + (g & 1) * 32;
    const uint8_t* qh = b + 128 + half * 32;
    const int shift_l = (g >> 1) * 4, shift_h = g * 2;
    for (int i = 0; i < 32; i++)
      o.q[i] = int8_t((((ql[i] >> shift_l) & 0xF) | (((qh[i] >> shift_h) & 3) << 4)) - 32);
  }
}

// Row r of a repacked group g (kQ4KR, kQ5KR, kQ6KR, kQ3KR, kQ2KR, kQ8R, kQ5R; `nblocks` blocks)
// back in its GGUF blocks (quant.py's unpack_r16 for one row): what the embedding's row lookup
// reads.
inline void r16_row(int type, const uint8_t* g, int r, int64_t nblocks, uint8_t* out) {
  for (int64_t blk = 0; blk < nblocks; blk++) {
    if (type == kQ4KR || type == kQ5KR) {
      const bool q5 = type == kQ5KR;
      const uint8_t* b = g + blk * (q5 ? 2880 : 2368);
      uint8_t* o = out + blk * (q5 ? 176 : 144);
      uint8_t* qs = o + (q5 ? 48 : 16);
      std::memcpy(o, b + 2 * r, 2);
      std::memcpy(o + 2, b + 32 + 2 * r, 2);
      uint8_t sc[8], mn[8];
      for (int j = 0; j < 8; j++) {
        sc[j] = b[64 + j * 16 + r];
        mn[j] = b[192 + j * 16 + r];
      }
      for (int j = 0; j < 4; j++) {
        o[4 + j] = uint8_t(sc[j] | ((sc[j + 4] >> 4) << 6));
        o[8 + j] = uint8_t(mn[j] | ((mn[j + 4] >> 4) << 6));
        o[12 + j] = uint8_t((sc[j + 4] & 0xF) | ((mn[j + 4] & 0xF) << 4));
      }
      for (int p = 0; p < 4; p++)
        for (int t = 0; t < 8; t++)
          std::memcpy(qs + 32 * p + 4 * t, b + 320 + p * 512 + t * 64 + 4 * r, 4);
      if (q5) {  // qh[4t + p] bit j from bit t of the row's byte p of sub-block j's 64
        std::memset(o + 16, 0, 32);
        for (int j = 0; j < 8; j++)
          for (int p = 0; p < 4; p++)
            for (int t = 0; t < 8; t++)
              o[16 + 4 * t + p] |= uint8_t(((b[2368 + j * 64 + 4 * r + p] >> t) & 1) << j);
      }
    } else if (type == kQ2KR) {
      const uint8_t* b = g + blk * 1344;
      uint8_t* o = out + blk * kQ2KBytes;
      std::memcpy(o + 80, b + 2 * r, 2);
      std::memcpy(o + 82, b + 32 + 2 * r, 2);
      for (int h = 0; h < 16; h++) o[h] = b[64 + h * 16 + r];
      for (int t = 0; t < 8; t++)
        for (int half = 0; half < 2; half++)
          std::memcpy(o + 16 + half * 32 + 4 * t, b + 320 + t * 128 + half * 64 + 4 * r, 4);
    } else if (type == kQ3KR) {
      const uint8_t* b = g + blk * 1824;
      uint8_t* o = out + blk * kQ3KBytes;
      std::memcpy(o + 108, b + 2 * r, 2);
      uint8_t u[16];  // the scales + 32, 6 bits: packed back (q3k_scales' inverse)
      for (int h = 0; h < 16; h++) u[h] = uint8_t(int8_t(b[32 + h * 16 + r]) + 32);
      for (int i = 0; i < 8; i++) o[96 + i] = uint8_t((u[i] & 0xF) | ((u[i + 8] & 0xF) << 4));
      for (int k = 0; k < 4; k++)
        o[104 + k] = uint8_t((u[k] >> 4) | ((u[4 + k] >> 4) << 2) | ((u[8 + k] >> 4) << 4) |
                             ((u[12 + k] >> 4) << 6));
      for (int t = 0; t < 8; t++) {
        const uint8_t* q = b + 288 + t * 192 + 4 * r;
        for (int half = 0; half < 2; half++)
          std::memcpy(o + 32 + half * 32 + 4 * t, q + half * 64, 4);
        std::memcpy(o + 4 * t, q + 128, 4);
      }
    } else if (type == kQ6KR) {
      const uint8_t* b = g + blk * 3360;
      uint8_t* o = out + blk * 210;
      std::memcpy(o + 208, b + 2 * r, 2);
      for (int h = 0; h < 16; h++) o[192 + h] = b[32 + h * 16 + r];
      for (int half = 0; half < 2; half++)
        for (int t = 0; t < 8; t++) {
          const uint8_t* q = b + 288 + half * 1536 + t * 192 + 4 * r;
          for (int c = 0; c < 2; c++) std::memcpy(o + half * 64 + c * 32 + 4 * t, q + c * 64, 4);
          std::memcpy(o + 128 + half * 32 + 4 * t, q + 128, 4);
        }
    } else if (type == kQ5R) {
      const uint8_t* b = g + blk * 352;
      uint8_t* o = out + blk * 22;
      std::memcpy(o, b + 2 * r, 2);
      uint32_t qh = 0;  // bit 4t + p from bit t of the row's byte p
      for (int p = 0; p < 4; p++)
        for (int t = 0; t < 8; t++) qh |= uint32_t((b[32 + 4 * r + p] >> t) & 1) << (4 * t + p);
      std::memcpy(o + 2, &qh, 4);
      for (int t = 0; t < 4; t++) std::memcpy(o + 6 + 4 * t, b + 96 + t * 64 + 4 * r, 4);
    } else {
      const uint8_t* b = g + blk * 544;
      uint8_t* o = out + blk * 34;
      std::memcpy(o, b + 2 * r, 2);
      for (int t = 0; t < 8; t++)
        for (int i = 0; i < 4; i++) o[2 + 4 * t + i] = uint8_t(b[32 + t * 64 + 4 * r + i] ^ 0x80);
    }
  }
}

inline void unpack_any(int type, const uint8_t* row, int64_t sb, Sub& o) {
  with_type(type, [&](auto t) { unpack_scalar<decltype(t)::value>(row, sb, o); });
}

// The activations, quantized once per call: int8 q (M, K), and per block of 32 the scale d and
// s = d * sum(q) (what Q4_K's mins need).
// (h: the int16 sums of q per 16 values, for Q6_K's offset.) A tile gets the view from its
// first row.
struct Act {
  const int8_t* q;
  const float* d;
  const float* s;
  const int16_t* h;
  // Where a repacked part's integer sums start, one broadcast load each (computing them from h
  // in scalar code per row and block, or with a vpmaddwd beside the vpdpbusd, cost 28 layers of
  // the 0.6B at 128 rows 200 -> 183 ms in Q8_0, 340 -> 275 ms in Q6_K):
  const int32_t* b128;  // -128 * sum(q) per block of 32 (Q8_0, int8 rows: w + 128)
  const int32_t* b32;   // -32 * sum(q) per 16 values, h's (Q6_K: q, not q - 32)
  int64_t K;
  // The first rows' q again as AMX A tiles (tile_activations), or null: sixteen of rows r, sub-
  // block sb at qt + (r * K / 32 + sb) * 512, 32 bytes a row.
  const int8_t* qt = nullptr;
  // Rows q, d, s and h (and qt) hold: the call's M, or where the tile unit runs, M rounded up
  // to sixteens with zero rows (r16_group's padded last sixteen).
  int64_t rows = 0;
  Act from_row(int64_t m) const {
    return {q + m * K, d + m * (K / 32), s + m * (K / 32), h + m * (K / 16), b128 + m * (K / 32),
            b32 + m * (K / 16), K,
            qt && m % 16 == 0 ? qt + m / 16 * (K / 32) * 512 : nullptr, rows - m};
  }
};

#if defined(LADLE_QUANT_AVX2)
inline __m256i nibbles(const uint8_t* p) {  // 16 bytes -> low nibbles, then high nibbles
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

// Byte i (0..31) = 0xFF where bit i of `bits` is set, else 0.
inline __m256i bit_mask(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(int(bits)),
      _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL, 0x0101010101010101LL, 0));
  const __m256i select = _mm256_set1_epi64x(int64_t(0x8040201008040201ULL));
  return _mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select);
}
// Byte i (0..31) = 0x10 where bit i of `bits` is set, else 0.
inline __m256i bit_bytes(uint32_t bits) {
  return _mm256_and_si256(bit_mask(bits), _mm256_set1_epi8(0x10));
}

// A grid block's 32 magnitudes (unsigned, <= 62): IQ2's 4 grid entries loaded and inserted;
// IQ3's 3-bit codes through the levels. The 0.6B's linears at one row, 28 layers of random
// blocks, Zen 4, ms: IQ2_XXS 14.5-15 (its entries in one gather: 19.4); IQ3_XXS 29-30 with 8
// entries loaded, 29 gathered, 4x: codes.
template <int TYPE>
inline __m256i grid_mags(const uint8_t* b) {
  if constexpr (kGrid8<TYPE>) {
    const uint64_t i = kGridHalves<TYPE> ? grid8_indices<TYPE>(b) : 0;
    return _mm256_set_epi64x(
        int64_t(grid8_entry<TYPE>(b, i, 3)), int64_t(grid8_entry<TYPE>(b, i, 2)),
        int64_t(grid8_entry<TYPE>(b, i, 1)), int64_t(grid8_entry<TYPE>(b, i, 0)));
  } else {
#if defined(__AVX512VBMI__) && defined(__AVX512VL__)
    // Qword q (values 8q .. 8q + 7): the code bytes 3q .. 3q + 3, then byte j of it the 8 bits
    // from bit 3j (vpmultishiftqb), of which the low 3 are the code.
    const __m256i spread = _mm256_setr_epi8(0, 1, 2, 3, 0, 0, 0, 0, 3, 4, 5, 6, 0, 0, 0, 0,
                                            6, 7, 8, 9, 0, 0, 0, 0, 9, 10, 11, 12, 0, 0, 0, 0);
    const __m256i shifts = _mm256_set1_epi64x(0x15120F0C09060300LL);
    const __m256i raw = _mm256_broadcastsi128_si256(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4)));  // codes, signs
    const __m256i codes = _mm256_and_si256(
        _mm256_multishift_epi64_epi8(shifts, _mm256_shuffle_epi8(raw, spread)),
        _mm256_set1_epi8(7));
#else
    uint64_t q[4];
    for (int k = 0; k < 4; k++) {
      uint32_t w;
      std::memcpy(&w, b + 4 + 3 * k, 4);
#if defined(__BMI2__)
      q[k] = _pdep_u64(w, 0x0707070707070707ULL);
#else
      q[k] = 0;
      for (int j = 0; j < 8; j++) q[k] |= uint64_t((w >> (3 * j)) & 7) << (8 * j);
#endif
    }
    const __m256i codes = _mm256_setr_epi64x(int64_t(q[0]), int64_t(q[1]), int64_t(q[2]),
                                             int64_t(q[3]));
#endif
    const __m128i levels =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(TYPE == kIQ3XXS32 ? g_iq.l3 : g_iq.l3s));
    return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(levels), codes);
  }
}
// v's bytes negated where `bits` has their bit set.
inline __m256i negate_where(__m256i v, uint32_t bits) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  return _mm256_mask_sub_epi8(v, __mmask32(bits), _mm256_setzero_si256(), v);
#else
  const __m256i m = bit_mask(bits);
  return _mm256_sub_epi8(_mm256_xor_si256(v, m), m);
#endif
}
// Its signed values (what the panels take; tiles and rows put the signs onto x instead).
template <int TYPE>
inline __m256i grid_values(const uint8_t* b) {
  return negate_where(grid_mags<TYPE>(b), grid_signs<TYPE>(b));
}

// A block of 32 values with one scale (Q8_0, Q4_0, Q5_0, MXFP4, IQ4, IQ2_XXS, IQ3_XXS, IQ3_S,
// int8 rows as blocks of scale 1; Q4_1 and Q5_1 with a min too; IQ2_XS and IQ2_S with an
// integer scale per half too), its values unpacked to signed int8. (The K-quants have tiles of
// their own, below.)
template <int TYPE> constexpr int64_t kBlockBytes =
    TYPE == kI8 ? 32 : TYPE == kQ8_0 ? 34 : TYPE == kQ4_0 ? 18 : TYPE == kMXFP4 ? 17
    : TYPE == kQ4_1 ? 20 : TYPE == kQ5_1 ? 24 : TYPE == kIQ4NL ? 18 : TYPE == kIQ4XS32 ? 20
    : kGrid<TYPE> ? block_bytes(TYPE) : 22;

template <int TYPE>
inline float block_scale(const uint8_t* b) {
  if constexpr (TYPE == kI8) return 1.f;
  else if constexpr (TYPE == kMXFP4) return e8m0_half(b[0]);
  else if constexpr (TYPE == kIQ4XS32 || kGrid<TYPE>) return f32_at(b);
  else return f16(b);
}

template <int TYPE>
inline __m256i block_quants(const uint8_t* b) {
  if constexpr (TYPE == kI8) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));
  } else if constexpr (TYPE == kQ8_0) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
  } else if constexpr (TYPE == kQ4_0) {
    return _mm256_sub_epi8(nibbles(b + 2), _mm256_set1_epi8(8));
  } else if constexpr (kGrid<TYPE>) {
    return grid_values<TYPE>(b);
  } else if constexpr (kLut4<TYPE>) {  // the nibbles through the table, one vpshufb
    const __m128i table = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kLut4Table<TYPE>));
    return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(table), nibbles(b + kLut4Qs<TYPE>));
  } else {  // Q5_0
    static_assert(TYPE == kQ5_0);
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    return _mm256_sub_epi8(_mm256_or_si256(nibbles(b + 6), bit_bytes(qh)), _mm256_set1_epi8(16));
  }
}

// The 8 int32 sums of 4 products each of unsigned u and signed s bytes.
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// Q4_0 and Q5_0 (in a row and in tiles): their values unsigned (q + bias: Q4_0's nibble,
// Q5_0's nibble and high bit), so vpdpbusd takes them as they are, and bias * sum(x) comes off
// each block's sum in integers (the activations' int16 sums per 16 values): the same integer I
// as the signed form, in about half the instructions. One row, 28 layers of the 0.6B's four
// linears from memory, ms, medians of 3 alternating runs, tiles of 8 rows / rows signed / rows
// unsigned: Q5_0 26.5 / 23.8 / 21.1 (303 MB), Q4_0 19.2 / 19.3 / 17.9 (248 MB). Tiles of 4
// and 8 rows (the integer path): Q5_0 34.0 -> 29.3, 61.7 -> 49.8; Q4_0 30.8 -> 27.0, 51 -> 42.5.
// Q4_1's and Q5_1's values are unsigned as stored (no bias), their min a step of its own.
template <int TYPE> constexpr bool kUnsignedRow =
    TYPE == kQ4_0 || TYPE == kQ5_0 || TYPE == kQ4_1 || TYPE == kQ5_1;
template <int TYPE> constexpr bool kRowBias = TYPE == kQ4_0 || TYPE == kQ5_0;
template <int TYPE> constexpr int kRowBiasShift = TYPE == kQ4_0 ? 3 : 4;  // bias 8, 16
template <int TYPE>
inline __m256i block_unsigned(const uint8_t* b) {
  if constexpr (TYPE == kQ4_0 || TYPE == kQ4_1) {
    return nibbles(b + (TYPE == kQ4_0 ? 2 : 4));
  } else {
    constexpr int off = TYPE == kQ5_0 ? 2 : 4;  // qh, then the nibbles
    uint32_t qh;
    std::memcpy(&qh, b + off, 4);
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    const __m256i n = nibbles(b + off + 4);
    return _mm256_mask_add_epi8(n, __mmask32(qh), n, _mm256_set1_epi8(16));
#else
    return _mm256_or_si256(nibbles(b + off + 4), bit_bytes(qh));
#endif
  }
}
// One order of summation for every quantized product here, fixed by the row alone: a row's
// result is the same bits in a tile of any size, in a panel, or alone, so no batch needs a
// slower path to be batch-invariant. Per sub-block of 32 values, in order:
//   I   = the exact integer sum of the weights' integer values (times a K-quant's integer
//         sub-block scales; Q6_K's q - 32, Q4_K's q without its min) and the activations' int8
//         values;
//   acc = fma(float(I), dw * dx, acc)     dw: the block's float scale (a K-quant: its d)
//   acc = fnmadd(dmin * min, dx * sum(x), acc)   (Q4_K, Q5_K only)
// and an int8 row's scale multiplies acc at the end. |I| < 2^24 (Q6_K's bound: 32 * 32 * 128 *
// 127), so float(I) is exact however the integer sum was formed: a tile sums lanes and rows
// in integers, a panel per half or with a bias taken off, and they agree to the bit.
// Each weight row is a stream from memory; the hardware prefetcher alone kept a core at 5-9 GB/s
// on the K-quants (their unpacking leaves few loads in flight). Measured on an AVX2 EPYC, one
// activation row, 50-180 MB of weights: 4 KB ahead gives 11-13 GB/s for every type (1 KB:
// 9-13, 2 KB no better; L1 or L2 hint the same).
constexpr int64_t kPrefetchBytes = 4096;

// A tile: kNR weight rows (the 8 lanes of one float accumulator per activation row) by up to
// kMR activation rows, whose weight blocks are unpacked once for all of them.
constexpr int kNR = 8;
#if defined(__AVX512VL__)
constexpr int kMR = 4;  // 32 vector registers
#else
constexpr int kMR = 2;  // AVX2's 16
#endif

// Q4_K: a super-block of 256 unsigned nibbles in eight sub-blocks of 32, each with a 6-bit
// scale and min (times the super-block's d and dmin). Its header is decoded in vector
// registers: the eight scales as int16, which multiply the integer sums in the vpmaddwd that
// sums their pairs, and the eight mins times dmin as floats.
inline void k4_scales(const uint8_t* s, uint64_t& sc, uint64_t& mn) {
  // Bytes 0-3: scales 0-3 (low 6 bits); 4-7: mins 0-3; 8-11: the low 4 bits of scales 4-7
  // (low nibble) and mins 4-7 (high nibble), whose top 2 bits are the top bits of bytes 0-7.
  uint32_t a0, a1, a2;
  std::memcpy(&a0, s, 4);
  std::memcpy(&a1, s + 4, 4);
  std::memcpy(&a2, s + 8, 4);
  const uint32_t six = 0x3F3F3F3F, four = 0x0F0F0F0F, two = 0x03030303;
  sc = uint64_t(a0 & six) | uint64_t((a2 & four) | (((a0 >> 6) & two) << 4)) << 32;
  mn = uint64_t(a1 & six) | uint64_t(((a2 >> 4) & four) | (((a1 >> 6) & two) << 4)) << 32;
}

// p[0..7]: each row's 8 int32 partial sums -> lane n: row n's sum. Rows are paired as they are
// made (pair_sums(p[2k], p[2k+1]), AVX2's vphaddd), then row_sums of the four pairs.
inline __m256i pair_sums(__m256i a, __m256i b) { return _mm256_hadd_epi32(a, b); }
inline __m256i row_sums(const __m256i* h) {
  const __m256i lo = _mm256_hadd_epi32(h[0], h[1]), hi = _mm256_hadd_epi32(h[2], h[3]);
  return _mm256_add_epi32(_mm256_permute2x128_si256(lo, hi, 0x20),
                          _mm256_permute2x128_si256(lo, hi, 0x31));
}

// IQ2_XS_32 / IQ2_S_32, a scale per half: the 8 blocks b[n]'s 2s + 1 as int32 lanes (m0: their
// values 0-15, m1: 16-31), and row_sums with each half's integer sum times its scale (after the
// first vphaddd the halves are 128-bit lanes apart).
inline void half_scales8(const uint8_t* const* b, __m256i& m0, __m256i& m1) {
  const __m256i v = _mm256_setr_epi32(b[0][kGridScales], b[1][kGridScales], b[2][kGridScales],
                                      b[3][kGridScales], b[4][kGridScales], b[5][kGridScales],
                                      b[6][kGridScales], b[7][kGridScales]);
  const __m256i one = _mm256_set1_epi32(1);
  m0 = _mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0xF)), 1), one);
  m1 = _mm256_or_si256(_mm256_slli_epi32(_mm256_srli_epi32(v, 4), 1), one);
}
inline __m256i row_sums_halves(const __m256i* h, __m256i m0, __m256i m1) {
  const __m256i lo = _mm256_hadd_epi32(h[0], h[1]), hi = _mm256_hadd_epi32(h[2], h[3]);
  return _mm256_add_epi32(_mm256_mullo_epi32(_mm256_permute2x128_si256(lo, hi, 0x20), m0),
                          _mm256_mullo_epi32(_mm256_permute2x128_si256(lo, hi, 0x31), m1));
}

// r[n] lane j -> t[j] lane n (8 x 8 floats).
inline void transpose8(const __m256* r, __m256* t) {
  __m256 a[8], b[8];
  for (int k = 0; k < 4; k++) {
    a[2 * k] = _mm256_unpacklo_ps(r[2 * k], r[2 * k + 1]);
    a[2 * k + 1] = _mm256_unpackhi_ps(r[2 * k], r[2 * k + 1]);
  }
  for (int k = 0; k < 2; k++) {
    b[4 * k] = _mm256_shuffle_ps(a[4 * k], a[4 * k + 2], 0x44);
    b[4 * k + 1] = _mm256_shuffle_ps(a[4 * k], a[4 * k + 2], 0xEE);
    b[4 * k + 2] = _mm256_shuffle_ps(a[4 * k + 1], a[4 * k + 3], 0x44);
    b[4 * k + 3] = _mm256_shuffle_ps(a[4 * k + 1], a[4 * k + 3], 0xEE);
  }
  for (int j = 0; j < 4; j++) {
    t[j] = _mm256_permute2f128_ps(b[j], b[4 + j], 0x20);
    t[j + 4] = _mm256_permute2f128_ps(b[j], b[4 + j], 0x31);
  }
}

// The float16 at byte offset off of each of the 8 rows' blocks b[n], as 8 floats.
inline __m256 f16_rows(const uint8_t* const* b, int off) {
  uint16_t v[kNR];
  for (int n = 0; n < kNR; n++) std::memcpy(&v[n], b[n] + off, 2);
  __m128i h = _mm_cvtsi32_si128(v[0]);
  h = _mm_insert_epi16(h, v[1], 1);
  h = _mm_insert_epi16(h, v[2], 2);
  h = _mm_insert_epi16(h, v[3], 3);
  h = _mm_insert_epi16(h, v[4], 4);
  h = _mm_insert_epi16(h, v[5], 5);
  h = _mm_insert_epi16(h, v[6], 6);
  h = _mm_insert_epi16(h, v[7], 7);
  return _mm256_cvtph_ps(h);
}

template <int TYPE>
inline __m256 block_scales(const uint8_t* const* b) {
  if constexpr (TYPE == kI8) {
    return _mm256_set1_ps(1.f);
  } else if constexpr (TYPE == kMXFP4) {
    return _mm256_setr_ps(e8m0_half(b[0][0]), e8m0_half(b[1][0]), e8m0_half(b[2][0]),
                          e8m0_half(b[3][0]), e8m0_half(b[4][0]), e8m0_half(b[5][0]),
                          e8m0_half(b[6][0]), e8m0_half(b[7][0]));
  } else if constexpr (TYPE == kIQ4XS32 || kGrid<TYPE>) {
    return _mm256_setr_ps(f32_at(b[0]), f32_at(b[1]), f32_at(b[2]), f32_at(b[3]), f32_at(b[4]),
                          f32_at(b[5]), f32_at(b[6]), f32_at(b[7]));
  } else {
    return f16_rows(b, 0);
  }
}

// The blocks of 32 with one scale (Q8_0, Q4_0, Q5_0, MXFP4, IQ4, int8 rows): signed weights go into
// vpmaddubsw / vpdpbusd as |w| with the sign moved onto x (vpsignb); Q4_0 and Q5_0 unsigned.
template <int TYPE, int MR>
inline void tile_blocks(const uint8_t* const* w, const Act& a, __m256* acc) {
  constexpr int64_t BB = kBlockBytes<TYPE>;
  const int64_t K = a.K, nblocks = K / 32;
  for (int64_t blk = 0; blk < nblocks; blk++) {
    const uint8_t* b[kNR];
    for (int n = 0; n < kNR; n++) {
      b[n] = w[n] + blk * BB;
      _mm_prefetch(reinterpret_cast<const char*>(b[n]) + kPrefetchBytes, _MM_HINT_T0);
    }
    __m256i xv[MR], h[MR][4];
    for (int m = 0; m < MR; m++)
      xv[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + m * K + blk * 32));
    for (int k = 0; k < 4; k++) {
      if constexpr (kUnsignedRow<TYPE>) {
        const __m256i u0 = block_unsigned<TYPE>(b[2 * k]);
        const __m256i u1 = block_unsigned<TYPE>(b[2 * k + 1]);
        for (int m = 0; m < MR; m++)
          h[m][k] = pair_sums(dot_u8s8(u0, xv[m]), dot_u8s8(u1, xv[m]));
      } else if constexpr (kGrid<TYPE>) {  // the magnitudes as they are, the signs onto x
        const __m256i u0 = grid_mags<TYPE>(b[2 * k]), u1 = grid_mags<TYPE>(b[2 * k + 1]);
        const uint32_t n0 = grid_signs<TYPE>(b[2 * k]), n1 = grid_signs<TYPE>(b[2 * k + 1]);
        for (int m = 0; m < MR; m++)
          h[m][k] = pair_sums(dot_u8s8(u0, negate_where(xv[m], n0)),
                              dot_u8s8(u1, negate_where(xv[m], n1)));
      } else {
        const __m256i q0 = block_quants<TYPE>(b[2 * k]), q1 = block_quants<TYPE>(b[2 * k + 1]);
        const __m256i a0 = _mm256_sign_epi8(q0, q0), a1 = _mm256_sign_epi8(q1, q1);
        for (int m = 0; m < MR; m++)
          h[m][k] = pair_sums(dot_u8s8(a0, _mm256_sign_epi8(xv[m], q0)),
                              dot_u8s8(a1, _mm256_sign_epi8(xv[m], q1)));
      }
    }
    const __m256 s = block_scales<TYPE>(b);
    [[maybe_unused]] __m256 mins;  // Q4_1, Q5_1: -m of each row's block
    if constexpr (kMin32<TYPE>) mins = _mm256_sub_ps(_mm256_setzero_ps(), f16_rows(b, 2));
    [[maybe_unused]] __m256i hs0, hs1;  // IQ2_XS, IQ2_S: the halves' scales
    if constexpr (kGridHalves<TYPE>) half_scales8(b, hs0, hs1);
    for (int m = 0; m < MR; m++) {
      __m256i I;
      if constexpr (kGridHalves<TYPE>) I = row_sums_halves(h[m], hs0, hs1);
      else I = row_sums(h[m]);
      if constexpr (kRowBias<TYPE>) {  // - bias * sum(x) of row m's block
        const int16_t* hx = a.h + m * (K / 16) + blk * 2;
        const int32_t sum = int32_t(hx[0]) + hx[1];
        I = _mm256_sub_epi32(I, _mm256_set1_epi32(sum * (1 << kRowBiasShift<TYPE>)));
      }
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I),
                               _mm256_mul_ps(s, _mm256_broadcast_ss(a.d + m * nblocks + blk)),
                               acc[m]);
      if constexpr (kMin32<TYPE>)
        acc[m] = _mm256_fnmadd_ps(mins, _mm256_broadcast_ss(a.s + m * nblocks + blk), acc[m]);
    }
  }
}

// Bit j (0 .. 7) of each byte of v moved to bit 4, the rest cleared. (The 16-bit shifts carry
// bits across bytes only into bits the mask clears.)
inline __m256i bit_to_4(__m256i v, int j) {
  return _mm256_and_si256(j <= 4 ? _mm256_slli_epi16(v, 4 - j) : _mm256_srli_epi16(v, j - 4),
                          _mm256_set1_epi8(0x10));
}

// Sub-block j of the Q4_K or Q5_K super-block b: its 32 values q (Q4_K's nibbles 0..15; Q5_K's
// with their fifth bit, 0..31).
template <int TYPE>
inline __m256i k4_values(const uint8_t* b, int j) {
  const __m256i raw =
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + kK4Qs<TYPE> + (j >> 1) * 32));
  const __m256i q =
      _mm256_and_si256((j & 1) ? _mm256_srli_epi16(raw, 4) : raw, _mm256_set1_epi8(0x0F));
  if constexpr (TYPE == kQ5_K) {
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
    return _mm256_or_si256(q, bit_to_4(qh, j));
  }
  return q;
}

// Sub-block j of the Q6_K super-block b: its 32 values q (0..63; the weight is q - 32).
inline __m256i q6k_values(const uint8_t* b, int j) {
  const int half = j >> 2, g = j & 3;
  const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + half * 64 + (g & 1) * 32));
  const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + half * 32));
  const __m256i l = _mm256_and_si256(_mm256_srli_epi16(ql, (g >> 1) * 4), _mm256_set1_epi8(0x0F));
  const __m256i h = _mm256_and_si256(_mm256_srli_epi16(qh, g * 2), _mm256_set1_epi8(3));
  return _mm256_or_si256(l, _mm256_slli_epi16(h, 4));
}

// Sub-block j of the Q2_K super-block b: its 32 values q (0..3).
inline __m256i q2k_values(const uint8_t* b, int j) {
  const __m256i qs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 + (j >> 2) * 32));
  return _mm256_and_si256(_mm256_srli_epi16(qs, 2 * (j & 3)), _mm256_set1_epi8(3));
}

// Sub-block j of the Q3_K super-block b: its 32 values q + 4 (0..7): the low 2 bits (as Q2_K's,
// from byte 32 on) and bit j of hmask's bytes moved to bit 2.
inline __m256i q3k_values(const uint8_t* b, int j) {
  const __m256i qs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32 + (j >> 2) * 32));
  const __m256i hm = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));
  const __m256i low = _mm256_and_si256(_mm256_srli_epi16(qs, 2 * (j & 3)), _mm256_set1_epi8(3));
  const __m256i at2 = j >= 2 ? _mm256_srli_epi16(hm, j - 2) : _mm256_slli_epi16(hm, 2 - j);
  const __m256i high = _mm256_and_si256(at2, _mm256_set1_epi8(4));
  return _mm256_or_si256(low, high);
}

template <int TYPE>
inline __m256i s16_values(const uint8_t* b, int j) {
  if constexpr (TYPE == kQ3_K) return q3k_values(b, j);
  else return q6k_values(b, j);
}

// A Q2_K super-block's 16 scales (low nibbles) or mins (high nibbles) as int16.
inline __m256i q2k_nibbles16(const uint8_t* b, bool high) {
  const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
  return _mm256_cvtepu8_epi16(
      _mm_and_si128(high ? _mm_srli_epi16(sc, 4) : sc, _mm_set1_epi8(0x0F)));
}

// vpshufb's control that picks Q6_K scale 2j (as int16) into the low 128-bit lane's int16s and
// 2j + 1 into the high lane's (the two halves of sub-block j), from scales 8 * (j / 4) on.
inline __m256i q6k_pick(int j) {
  const int lo = (2 * j) & 7, hi = (2 * j + 1) & 7;
  return _mm256_set_m128i(_mm_set1_epi16(int16_t(((2 * hi + 1) << 8) | (2 * hi))),
                          _mm_set1_epi16(int16_t(((2 * lo + 1) << 8) | (2 * lo))));
}

// A K-quant tile's rows 2k and 2k + 1 (unsigned values q, int16 scales s16) times each
// activation row m: h[m][k], their lanes' products scaled in the vpmaddwd, paired.
template <int MR>
inline void kquant_pairs(const __m256i* q, const __m256i* s16, const __m256i* xv, int k,
                         __m256i (*h)[4]) {
  for (int m = 0; m < MR; m++)
    h[m][k] = pair_sums(_mm256_madd_epi16(_mm256_maddubs_epi16(q[0], xv[m]), s16[0]),
                        _mm256_madd_epi16(_mm256_maddubs_epi16(q[1], xv[m]), s16[1]));
}

// Sub-block j (sb of the row) of a K-quant tile's 8 super-blocks b[n], whose scales as int16
// are sc16[n] (Q4_K: [0], the eight in both 128-bit lanes; Q6_K, Q3_K, Q2_K: scales 0-7 and
// 8-15), times the MR activation rows: h[m], the lane sums of each row pair (row_sums adds them
// up).
template <int TYPE, int MR>
inline void ksub_tile(const uint8_t* const* b, const __m256i (*sc16)[2], int j, const Act& a,
                      int64_t sb, __m256i (*h)[4]) {
  // Q4_K, Q5_K: vpshufb picks bytes 2j, 2j+1 (scale j as int16) into every int16 lane.
  const __m256i pick = kK4<TYPE> ? _mm256_set1_epi16(int16_t(((2 * j + 1) << 8) | (2 * j)))
                                 : q6k_pick(j);
  __m256i xv[MR];
  for (int m = 0; m < MR; m++)
    xv[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + m * a.K + sb * 32));
  for (int k = 0; k < 4; k++) {
    __m256i q[2], s16[2];
    for (int r = 0; r < 2; r++) {
      if constexpr (kK4<TYPE>) q[r] = k4_values<TYPE>(b[2 * k + r], j);
      else if constexpr (TYPE == kQ2_K) q[r] = q2k_values(b[2 * k + r], j);
      else q[r] = s16_values<TYPE>(b[2 * k + r], j);
      s16[r] = _mm256_shuffle_epi8(sc16[2 * k + r][kK4<TYPE> ? 0 : j >> 2], pick);
    }
    kquant_pairs<MR>(q, s16, xv, k, h);
  }
}

// Q5_K: the same with q up to 31 (vpmaddubsw's pair sums at most 2 x 31 x 128, within int16).
template <int TYPE, int MR>
inline void tile_k4(const uint8_t* const* w, const Act& a, __m256* acc) {
  const int64_t K = a.K, nsub = K / 32, nblocks = K / 256;
  for (int64_t blk = 0; blk < nblocks; blk++) {
    const uint8_t* b[kNR];
    __m256i sc16[kNR][2];  // [0]: row n's eight scales as int16, in both 128-bit lanes
    __m256 mins[kNR];   // row n's eight mins times dmin
    for (int n = 0; n < kNR; n++) {
      b[n] = w[n] + blk * kK4Bytes<TYPE>;
      for (int64_t off = 0; off < kK4Bytes<TYPE>; off += 64)  // the row's stream, 4 KB ahead
        _mm_prefetch(reinterpret_cast<const char*>(b[n]) + kPrefetchBytes + off, _MM_HINT_T0);
      uint64_t sc, mn;
      k4_scales(b[n] + 4, sc, mn);
      sc16[n][0] = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(int64_t(sc))));
      mins[n] = _mm256_mul_ps(_mm256_set1_ps(f16(b[n] + 2)),
                              _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(int64_t(mn)))));
    }
    __m256 min_j[8];  // sub-block j's mins, lane n: row n
    transpose8(mins, min_j);
    const __m256 d = f16_rows(b, 0);
#pragma GCC unroll 8  // every j's constants (shuffle picks, shifts) fixed at compile time
    for (int j = 0; j < 8; j++) {
      const int64_t sb = blk * 8 + j;
      __m256i h[MR][4];
      ksub_tile<TYPE, MR>(b, sc16, j, a, sb, h);
      for (int m = 0; m < MR; m++) {
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(row_sums(h[m])),
                                 _mm256_mul_ps(d, _mm256_broadcast_ss(a.d + m * nsub + sb)), acc[m]);
        acc[m] = _mm256_fnmadd_ps(min_j[j], _mm256_broadcast_ss(a.s + m * nsub + sb), acc[m]);
      }
    }
  }
}

// Q6_K: a super-block of 256 six-bit values (q - 32) in eight sub-blocks of 32, each half of
// 16 with a signed int8 scale. q goes in unsigned (0..63: no sign moves), the scales multiply
// the integer sums in the vpmaddwd, and the offset 32 * (scale_lo * sum(x_lo) + scale_hi *
// sum(x_hi)) comes off each sub-block's integer sum, from the activations' int16 sums per 16.
// Q3_K the same with q + 4 and 4 (kS16Shift).
// Q2_K: q 0..3 and no offset, and a min per 16 values instead: per sub-block the integer Mi =
// m_lo * sum(x_lo) + m_hi * sum(x_hi) (the same int16 sums), so
//   acc = fma(float(I), d * dx, acc);  acc = fnmadd(float(Mi), dmin * dx, acc)
// in every path (|Mi| <= 2 x 15 x 16 x 127: exact as a float however it was summed).
template <int TYPE, int MR>
inline void tile_halves(const uint8_t* const* w, const Act& a, __m256* acc) {
  constexpr bool q2k = TYPE == kQ2_K;
  constexpr int64_t BB = q2k ? kQ2KBytes : kS16Bytes<TYPE>;
  const int64_t K = a.K, nsub = K / 32, nblocks = K / 256;
  // [m][sub-block j][row n]: the offset (int32 bits; Q2_K: float(Mi))
  alignas(32) float side[MR][8][kNR];
  for (int64_t blk = 0; blk < nblocks; blk++) {
    const uint8_t* b[kNR];
    __m256i sc16[kNR][2];  // scales 0-7 and 8-15 as int16, each in both 128-bit lanes
    __m256i all16[kNR];  // the 16 scales as int16 (Q2_K: its 16 mins)
    for (int n = 0; n < kNR; n++) {
      b[n] = w[n] + blk * BB;
      for (int64_t off = 0; off < BB; off += 64)  // the row's stream, kPrefetchBytes ahead
        _mm_prefetch(reinterpret_cast<const char*>(b[n]) + kPrefetchBytes + off, _MM_HINT_T0);
      __m256i sc;
      if constexpr (q2k) {
        sc = q2k_nibbles16(b[n], false);
        all16[n] = q2k_nibbles16(b[n], true);
      } else {
        int8_t tmp[16];
        sc = _mm256_cvtepi8_epi16(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(s16_scales<TYPE>(b[n], tmp))));
        all16[n] = sc;
      }
      sc16[n][0] = _mm256_permute2x128_si256(sc, sc, 0x00);
      sc16[n][1] = _mm256_permute2x128_si256(sc, sc, 0x11);
    }
    for (int m = 0; m < MR; m++) {
      // lane j of o[n]: bias * (scale_2j * sum(x of half 2j) + scale_2j+1 * sum(x of half
      // 2j+1)), or Q2_K's Mi
      const __m256i hx =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.h + m * 2 * nsub + blk * 16));
      __m256 o[kNR], t[8];
      for (int n = 0; n < kNR; n++) {
        const __m256i dot = _mm256_madd_epi16(all16[n], hx);
        if constexpr (q2k) o[n] = _mm256_cvtepi32_ps(dot);
        else o[n] = _mm256_castsi256_ps(_mm256_slli_epi32(dot, kS16Shift<TYPE>));
      }
      transpose8(o, t);
      for (int j = 0; j < 8; j++) _mm256_store_ps(side[m][j], t[j]);
    }
    const __m256 d = f16_rows(b, q2k ? 80 : kS16D<TYPE>);
    [[maybe_unused]] __m256 dmin;
    if constexpr (q2k) dmin = f16_rows(b, 82);
#pragma GCC unroll 8  // every j's constants (shuffle picks, shifts) fixed at compile time
    for (int j = 0; j < 8; j++) {
      const int64_t sb = blk * 8 + j;
      __m256i h[MR][4];
      ksub_tile<TYPE, MR>(b, sc16, j, a, sb, h);
      for (int m = 0; m < MR; m++) {
        const __m256 dx = _mm256_broadcast_ss(a.d + m * nsub + sb);
        __m256i I = row_sums(h[m]);
        if constexpr (!q2k)
          I = _mm256_sub_epi32(I, _mm256_castps_si256(_mm256_load_ps(side[m][j])));
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I), _mm256_mul_ps(d, dx), acc[m]);
        if constexpr (q2k)
          acc[m] = _mm256_fnmadd_ps(_mm256_load_ps(side[m][j]), _mm256_mul_ps(dmin, dx), acc[m]);
      }
    }
  }
}

// One activation row against one weight row at a time: the byte-dense types (Q8_0, int8 rows,
// Q6_K) stream fastest as a single row. Measured on a Zen 4, both cores, one activation row, 24
// layers of the 0.6B's four linears (380-550 MB), ms per pass, 8-row tile / one row: Q8_0
// 22.9-29.5 / 15.8-16.4, Q6_K 36.7-43.6 / 13.1-17.7 (Q4_K and Q4_0 ran as fast in the 8-row
// tile as in the old 2- and 4-row ones; Q4_0 and Q5_0 run in rows too since they go in
// unsigned, below). Eight sub-blocks' integer sums become the lanes of one
// vector, are scaled in one multiply, and enter the row's chain of FMAs in order: the same
// float steps as a tile's lane for that row.
inline __m128 chain8(__m128 acc, __m256 f, __m256 F) {
  alignas(32) float fv[8], Fv[8];
  _mm256_store_ps(fv, f);
  _mm256_store_ps(Fv, F);
  for (int j = 0; j < 8; j++) acc = _mm_fmadd_ss(_mm_set_ss(fv[j]), _mm_set_ss(Fv[j]), acc);
  return acc;
}

inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// Block j's integer sum of q * x (8 lanes to add), from its values and activations x.
template <int TYPE>
inline __m256i block_dot(const uint8_t* b, __m256i x) {
  if constexpr (kUnsignedRow<TYPE>) {
    return dot_u8s8(block_unsigned<TYPE>(b), x);
  } else if constexpr (kGrid<TYPE>) {  // the magnitudes as they are, the signs onto x
    return dot_u8s8(grid_mags<TYPE>(b), negate_where(x, grid_signs<TYPE>(b)));
  } else {
    const __m256i q = block_quants<TYPE>(b);
    return dot_u8s8(_mm256_sign_epi8(q, q), _mm256_sign_epi8(x, q));
  }
}

template <int TYPE>
inline float row_blocks(const uint8_t* w, const Act& a) {
  static_assert(!kMin32<TYPE>, "Q4_1 and Q5_1 rows run in tiles (their min step per block)");
  constexpr int64_t BB = kBlockBytes<TYPE>;
  const int64_t nblocks = a.K / 32;
  __m128 acc = _mm_setzero_ps();
  int64_t blk = 0;
  for (; blk + 8 <= nblocks; blk += 8) {
    const uint8_t* b[8];
    for (int j = 0; j < 8; j++) b[j] = w + (blk + j) * BB;
    for (int64_t off = 0; off < 8 * BB; off += 64)  // the row's stream, kPrefetchBytes ahead
      _mm_prefetch(reinterpret_cast<const char*>(b[0]) + kPrefetchBytes + off, _MM_HINT_T0);
    __m256i h[4];
    for (int k = 0; k < 4; k++) {
      __m256i p[2];
      for (int r = 0; r < 2; r++) {
        const int j = 2 * k + r;
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + (blk + j) * 32));
        p[r] = block_dot<TYPE>(b[j], x);
      }
      h[k] = pair_sums(p[0], p[1]);
    }
    __m256i I;
    if constexpr (kGridHalves<TYPE>) {
      __m256i hs0, hs1;
      half_scales8(b, hs0, hs1);
      I = row_sums_halves(h, hs0, hs1);
    } else {
      I = row_sums(h);
    }
    if constexpr (kRowBias<TYPE>) {  // - bias * sum(x) of each of the 8 blocks
      const __m256i hx = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.h + blk * 2));
      I = _mm256_sub_epi32(I, _mm256_slli_epi32(_mm256_madd_epi16(hx, _mm256_set1_epi16(1)),
                                                kRowBiasShift<TYPE>));
    }
    acc = chain8(acc, _mm256_cvtepi32_ps(I),
                 _mm256_mul_ps(block_scales<TYPE>(b), _mm256_loadu_ps(a.d + blk)));
  }
  for (; blk < nblocks; blk++) {  // K not a multiple of 256
    const uint8_t* b = w + blk * BB;
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + blk * 32));
    __m256i lanes = block_dot<TYPE>(b, x);
    if constexpr (kGridHalves<TYPE>) {  // lanes 0-3: values 0-15
      const int s0 = half_scale(b, 0), s1 = half_scale(b, 1);
      lanes = _mm256_mullo_epi32(lanes, _mm256_setr_epi32(s0, s0, s0, s0, s1, s1, s1, s1));
    }
    int32_t I = hsum_epi32(lanes);
    if constexpr (kRowBias<TYPE>)
      I -= (int32_t(a.h[2 * blk]) + a.h[2 * blk + 1]) * (1 << kRowBiasShift<TYPE>);
    const __m256 F = _mm256_mul_ps(_mm256_set1_ps(block_scale<TYPE>(b)), _mm256_set1_ps(a.d[blk]));
    acc = _mm_fmadd_ss(_mm_set_ss(float(I)), _mm256_castps256_ps128(F), acc);
  }
  return _mm_cvtss_f32(acc);
}

template <int TYPE>
inline float row_s16(const uint8_t* w, const Act& a) {
  constexpr int64_t BB = kS16Bytes<TYPE>;
  const int64_t nblocks = a.K / 256;
  __m128 acc = _mm_setzero_ps();
  for (int64_t blk = 0; blk < nblocks; blk++) {
    const uint8_t* b = w + blk * BB;
    for (int64_t off = 0; off < BB; off += 64)
      _mm_prefetch(reinterpret_cast<const char*>(b) + kPrefetchBytes + off, _MM_HINT_T0);
    int8_t tmp[16];
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s16_scales<TYPE>(b, tmp)));
    const __m256i sc16[2] = {_mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(sc)),
                             _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(_mm_srli_si128(sc, 8)))};
    const __m256i hx = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.h + blk * 16));
    const __m256i offset =
        _mm256_slli_epi32(_mm256_madd_epi16(_mm256_cvtepi8_epi16(sc), hx), kS16Shift<TYPE>);
    __m256i h[4], p[2];
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) {
      const __m256i q = s16_values<TYPE>(b, j);
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + (blk * 8 + j) * 32));
      p[j & 1] = _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), _mm256_shuffle_epi8(sc16[j >> 2], q6k_pick(j)));
      if (j & 1) h[j >> 1] = pair_sums(p[0], p[1]);
    }
    acc = chain8(acc, _mm256_cvtepi32_ps(_mm256_sub_epi32(row_sums(h), offset)),
                 _mm256_mul_ps(_mm256_set1_ps(f16(b + kS16D<TYPE>)),
                               _mm256_loadu_ps(a.d + blk * 8)));
  }
  return _mm_cvtss_f32(acc);
}

// The types whose one-row products take row_blocks / row_s16 (MXFP4, IQ4_NL, Q4_K, Q5_K, Q4_1,
// Q5_1 stay in tiles; so does Q2_K, whose two float steps per sub-block made a row a chain of 16
// dependent FMAs per super-block: the 0.6B's Q2_K file, decode ms a token, rows / tiles, 15.3 /
// 11.0; and Q3_K, whose values take more unpacking than Q6_K's: Q3_K_M file 19.3 / 14.8).
// IQ4_XS's blocks of 32, the 0.6B's IQ4_XS file, decode ms a token, processes alternating,
// tiles / rows: 20.0 / 18.5 (medians of 5); Gemma 3 270M's IQ4_XS file
// (mostly IQ4_NL, 640-value rows whose last blocks a row takes one at a time) 7.5 / 7.5, and
// with IQ4_NL in rows too 5.9-6.0 / 6.7-7.1. IQ2_XXS's blocks of 32, the 0.6B's IQ2_XXS file
// (Zen 4, processes alternating): 22.0-22.7 / 19.8-20.5.
template <int TYPE> constexpr bool kRowAtATime =
    TYPE == kQ8_0 || TYPE == kI8 || TYPE == kQ6_K || TYPE == kQ4_0 || TYPE == kQ5_0 ||
    TYPE == kIQ4XS32 || kGrid<TYPE>;
template <int TYPE>
inline float row_dot(const uint8_t* w, const Act& a) {
  if constexpr (kS16<TYPE>) return row_s16<TYPE>(w, a);
  else return row_blocks<TYPE>(w, a);
}

// out[m][n] = x[m] . w[n] for MR activation rows and the kNR weight rows w.
template <int TYPE, int MR>
inline void tile(const uint8_t* const* w, const Act& a, float (*out)[kNR]) {
  __m256 acc[MR];
  for (int m = 0; m < MR; m++) acc[m] = _mm256_setzero_ps();
  if constexpr (kK4<TYPE>) tile_k4<TYPE, MR>(w, a, acc);
  else if constexpr (kS16<TYPE> || TYPE == kQ2_K) tile_halves<TYPE, MR>(w, a, acc);
  else tile_blocks<TYPE, MR>(w, a, acc);
  for (int m = 0; m < MR; m++) _mm256_storeu_ps(out[m], acc[m]);
}
#else
constexpr int kNR = 8, kMR = 4;
template <int TYPE> constexpr bool kRowAtATime = false;
template <int TYPE>
inline float row_dot(const uint8_t*, const Act&) { return 0.f; }
// Portable: each (row, weight row) pair on its own, in one order for every tile (this build
// has no panels), within float32 rounding of the vector builds' order.
template <int TYPE, int MR>
inline void tile(const uint8_t* const* w, const Act& a, float (*out)[kNR]) {
  const int8_t* qx = a.q;
  const float *dx = a.d, *sx = a.s;
  const int64_t K = a.K;
  float acc[MR][kNR] = {};
  const int64_t nsub = K / 32;
  for (int64_t sb = 0; sb < nsub; sb++) {
    Sub ws[kNR];
    for (int n = 0; n < kNR; n++) unpack_scalar<TYPE>(w[n], sb, ws[n]);
    for (int m = 0; m < MR; m++) {
      const int8_t* x = qx + m * K + sb * 32;
      for (int n = 0; n < kNR; n++) {
        int32_t lo = 0, hi = 0;
        for (int i = 0; i < 16; i++) lo += int32_t(ws[n].q[i]) * x[i];
        for (int i = 16; i < 32; i++) hi += int32_t(ws[n].q[i]) * x[i];
        const float dxm = dx[m * nsub + sb];
        if constexpr (TYPE == kQ2_K) {  // a min per 16 values: the activations' sums per 16
          const int16_t* hx = a.h + m * (K / 16) + 2 * sb;
          acc[m][n] += dxm * (ws[n].s0 * float(lo) + ws[n].s1 * float(hi)) -
                       dxm * (ws[n].minv * float(hx[0]) + ws[n].minv_hi * float(hx[1]));
        } else {
          acc[m][n] += dxm * (ws[n].s0 * float(lo) + ws[n].s1 * float(hi)) -
                       ws[n].minv * sx[m * nsub + sb];
        }
      }
    }
  }
  for (int m = 0; m < MR; m++)
    for (int n = 0; n < kNR; n++) out[m][n] = acc[m][n];
}
#endif

// One part of the weight: `rows` rows of `type` (row_bytes each) that give the output columns
// col .. col + rows - 1, times scale[n] per row where the part has one (int8 rows). Its tiles
// (or panels) are tile0 .. tile0 + tiles - 1 of the call's one range.
struct Part {
  const uint8_t* w;
  int type;
  int64_t rows, row_bytes, col;
  const float* scale;
  int64_t tile0, tiles;
};

// grain_for counts bf16 multiply-adds; a quantized one also unpacks its weight (nibbles, high
// bits, sign): measured on an AVX2 EPYC at one activation row, Q5_0 ran ~10 G/s per core
// against the bf16 kernel's ~70. Counting each as this many units keeps the tasks of a
// decode-sized matmul (0.5-2 M multiply-adds) on both cores instead of one.
constexpr int64_t kQuantWork = 4;

// y[m][p.col + n] for MR activation rows from m0 and the tile's weight rows from n0 (past the
// part's end the tile reads its last row again and drops those results).
template <int TYPE, int MR, typename T>
inline void store_tile(const Part& p, const Act& a, int64_t m0, int64_t n0, T* y, int64_t ldy) {
  const int64_t valid = std::min<int64_t>(kNR, p.rows - n0);
  const uint8_t* wr[kNR];
  for (int n = 0; n < kNR; n++) wr[n] = p.w + (n0 + std::min<int64_t>(n, valid - 1)) * p.row_bytes;
  float out[MR][kNR];
  tile<TYPE, MR>(wr, a.from_row(m0), out);
  for (int m = 0; m < MR; m++)
    for (int64_t n = 0; n < valid; n++)
      y[(m0 + m) * ldy + p.col + n0 + n] = T(p.scale ? out[m][n] * p.scale[n0 + n] : out[m][n]);
}

// Tiles t0 .. t1 - 1 (local to the part) for all M activation rows.
template <int TYPE, typename T>
void part_tiles(const Part& p, int64_t t0, int64_t t1, const Act& a, int64_t M, T* y,
                int64_t ldy) {
  if constexpr (kRowAtATime<TYPE>) {
    if (M == 1) {
      for (int64_t n = t0 * kNR; n < std::min(p.rows, t1 * kNR); n++) {
        const float v = row_dot<TYPE>(p.w + n * p.row_bytes, a);
        y[p.col + n] = T(p.scale ? v * p.scale[n] : v);
      }
      return;
    }
  }
  for (int64_t t = t0; t < t1; t++) {
    const int64_t n0 = t * kNR;
    int64_t m = 0;
    if constexpr (kMR >= 4)
      for (; m + 4 <= M; m += 4) store_tile<TYPE, 4>(p, a, m, n0, y, ldy);
    for (; m + 2 <= M; m += 2) store_tile<TYPE, 2>(p, a, m, n0, y, ldy);
    for (; m < M; m++) store_tile<TYPE, 1>(p, a, m, n0, y, ldy);
  }
}

#if defined(LADLE_QUANT_512)
// Repacked at load (quant.py's repack_r16): Q2_K-Q6_K and Q8_0 rows by 16, in the panels'
// layout (below) with the values still in their bits. In a tile most of a row's instructions
// move sums across lanes and rows, not products: one activation row of Q4_K ran compute-bound
// at about half the read bandwidth, Q6_K's one-row stream at two thirds. Here one vpdpbusd
// with 4 activation bytes broadcast adds 4 products into each of 16 rows' sums, after an and
// and a shift or two per 64 values: a sub-block of 32 is 8 of them. Per 16 rows and block:
//   Q4_K (2368 bytes per 256 values, 148 per row against 144): d[16], dmin[16] float16;
//     scale[8][16], min[8][16] bytes (sub-block j's, row r's: the 6-bit values unpacked);
//     then per pair of sub-blocks (2p, 2p + 1) 8 x 64 bytes, dword r of the t-th 64 being row
//     r's bytes 4t .. 4t + 3 of the pair's 32 (low nibbles 2p's values, high 2p + 1's).
//   Q5_K (2880 per 256, 180 per row against 176): Q4_K's 2368, then per sub-block j 64 bytes
//     of fifth bits laid out as Q5_0's (byte 4r + p holds in bit t value 4t + p's, row r).
//   Q6_K (3360 per 256, as the rows' 16 x 210): d[16] float16; scale[16][16] int8 (16 values'
//     scale h, row r's); then per half of the block and dword slot t, 3 x 64 bytes: ql's
//     32-byte chunks c = 0, 1 (low nibbles: sub-block 4 half + c's values; high: 4 half + 2 +
//     c's) and qh (bits 2g, 2g + 1: sub-block 4 half + g's high bits), in the order read.
//   Q8_0 (544 per 32, as 16 x 34): d[16] float16; 8 x 64 bytes of the values + 128 (unsigned).
//   int8 rows (512 per 32, as 16 x 32): the values + 128 as Q8_0's; the rows' float scales stay
//     beside the part and multiply the sums at the end, as in a tile.
//   Q5_0 (352 per 32, as 16 x 22): d[16] float16; 64 bytes of high bits, byte 4r + p holding
//     in bit t value 4t + p's (row r); then 4 x 64 bytes, dword r of the t-th 64 being row r's
//     qs bytes 4t .. 4t + 3 (low nibbles: dword slot t's values, high: slot t + 4's). Its rows
//     run as Q8_0's, the values q (0 .. 31) unsigned with bias 16: nibble | high bit << 4, two
//     or three instructions per 64, where the 8-row tiles (not repacked) ran compute-bound at
//     ~15 G weights/s from cache against repacked Q8_0's ~64 (2 threads, 2048 x 640).
// A sub-block's int32 sums start at -bias * sum(x) (Q6_K 32 per half, Q8_0 128, Q5_0 16), and the float
// steps are the tiles' and panels' (the one order): a repacked part gives its blocks' bits.
constexpr int64_t kR16Rows = 16;
template <int TYPE> constexpr int64_t kR16Block =
    TYPE == kQ4KR ? 2368 : TYPE == kQ5KR ? 2880 : TYPE == kQ6KR ? 3360 : TYPE == kQ8R ? 544
    : TYPE == kQ5R ? 352 : TYPE == kQ3KR ? 1824 : TYPE == kQ2KR ? 1344 : 512;
template <int TYPE> constexpr int kR16Subs =  // per block
    TYPE == kQ8R || TYPE == kI8R || TYPE == kQ5R ? 1 : 8;
template <int TYPE> constexpr int32_t kR16Bias =
    TYPE == kQ8R || TYPE == kI8R ? 128 : TYPE == kQ6KR ? 32 : TYPE == kQ5R ? 16
    : TYPE == kQ3KR ? 4 : 0;

// The int32 sums of a sub-block of 32 for MR activation rows (i[m][h]: values 16h .. 16h + 15
// where Q6_K's halves have a scale each, else one sum) start at -bias * sum(x).
template <int TYPE, int MR, int H>
inline void r16_start(const Act& a, int64_t m0, int64_t sb, __m512i (*i)[H]) {
  constexpr int32_t bias = kR16Bias<TYPE>;
  const int64_t ld = a.K / 16;
  for (int m = 0; m < MR; m++) {
    if constexpr (H == 2 && bias == 0) {  // Q2_K's values
      i[m][0] = i[m][1] = _mm512_setzero_si512();
    } else if constexpr (H == 2) {  // b32: -32 x sum(x) per 16 (Q3_K's -4 x: an eighth, exact)
      static_assert(bias == 32 || bias == 4);
      i[m][0] = _mm512_set1_epi32(a.b32[(m0 + m) * ld + sb * 2] / (32 / bias));
      i[m][1] = _mm512_set1_epi32(a.b32[(m0 + m) * ld + sb * 2 + 1] / (32 / bias));
    } else if constexpr (bias == 128) {
      i[m][0] = _mm512_set1_epi32(a.b128[(m0 + m) * (a.K / 32) + sb]);
    } else if constexpr (bias == 16) {  // Q5_0: -128 x sum(x) / 8, exact
      i[m][0] = _mm512_set1_epi32(a.b128[(m0 + m) * (a.K / 32) + sb] / 8);
    } else {
      static_assert(bias == 0);  // Q4_K's and Q5_K's values
      i[m][0] = _mm512_setzero_si512();
    }
  }
}

// i[m] += v (the 16 rows' dword slot t) times activation row m0 + m's values 4t .. 4t + 3 of
// sub-block sb.
template <int MR, int H>
inline void r16_dot(const Act& a, int64_t m0, int64_t sb, int t, __m512i v, __m512i (*i)[H]) {
  for (int m = 0; m < MR; m++) {
    int32_t x4;
    std::memcpy(&x4, a.q + (m0 + m) * a.K + sb * 32 + 4 * t, 4);
    i[m][H == 2 ? t >> 2 : 0] = _mm512_dpbusd_epi32(i[m][H == 2 ? t >> 2 : 0], v,
                                                    _mm512_set1_epi32(x4));
  }
}

// Sub-block j (sb of the rows) of the block at b, its sums i done: the float steps of the one
// order into acc.
template <int TYPE, int MR, int H>
inline void r16_finish(const uint8_t* b, int j, const Act& a, int64_t m0, int64_t sb,
                       const __m512i (*i)[H], __m512* acc) {
  const int64_t nsub = a.K / 32;
  const __m512 d = TYPE == kI8R ? _mm512_set1_ps(1.f)  // (int8 rows: their scale at the end)
                   : _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)));
  __m512 f[MR];
  [[maybe_unused]] __m512 mlo, mhi;  // Q2_K: the halves' mins
  if constexpr (kHalvesR<TYPE>) {  // f = s_lo * I_lo + s_hi * I_hi, each product exact
    __m512 s0, s1;
    if constexpr (TYPE == kQ2KR) {  // scale | min << 4
      auto nib = [&](int h, bool high) {
        const __m512i v = _mm512_cvtepu8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 64 + (2 * j + h) * 16)));
        return _mm512_cvtepi32_ps(high ? _mm512_srli_epi32(v, 4)
                                       : _mm512_and_si512(v, _mm512_set1_epi32(0xF)));
      };
      s0 = nib(0, false);
      s1 = nib(1, false);
      mlo = nib(0, true);
      mhi = nib(1, true);
    } else {
      s0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 32 + (2 * j) * 16))));
      s1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 32 + (2 * j + 1) * 16))));
    }
    for (int m = 0; m < MR; m++)
      f[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i[m][H - 1]), s1,
                             _mm512_mul_ps(_mm512_cvtepi32_ps(i[m][0]), s0));
  } else if constexpr (kK4R<TYPE>) {
    const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 64 + j * 16))));
    for (int m = 0; m < MR; m++) f[m] = _mm512_mul_ps(_mm512_cvtepi32_ps(i[m][0]), sc);
  } else {
    for (int m = 0; m < MR; m++) f[m] = _mm512_cvtepi32_ps(i[m][0]);
  }
  for (int m = 0; m < MR; m++)
    acc[m] = _mm512_fmadd_ps(f[m], _mm512_mul_ps(d, _mm512_set1_ps(a.d[(m0 + m) * nsub + sb])),
                             acc[m]);
  if constexpr (TYPE == kQ2KR) {  // Mi = m_lo * sum(x_lo) + m_hi * sum(x_hi), exact
    const __m512 dmin =
        _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32)));
    for (int m = 0; m < MR; m++) {
      const int16_t* hx = a.h + (m0 + m) * (a.K / 16) + 2 * sb;
      const __m512 mi = _mm512_fmadd_ps(mhi, _mm512_set1_ps(float(hx[1])),
                                        _mm512_mul_ps(mlo, _mm512_set1_ps(float(hx[0]))));
      acc[m] = _mm512_fnmadd_ps(
          mi, _mm512_mul_ps(dmin, _mm512_set1_ps(a.d[(m0 + m) * nsub + sb])), acc[m]);
    }
  }
  if constexpr (kK4R<TYPE>) {
    const __m512 mn = _mm512_mul_ps(
        _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32))),
        _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192 + j * 16)))));
    for (int m = 0; m < MR; m++)
      acc[m] = _mm512_fnmadd_ps(mn, _mm512_set1_ps(a.s[(m0 + m) * nsub + sb]), acc[m]);
  }
}

// Q4_K repacked: dword slot t of the 16 rows for sub-block j of the block at b (nibbles).
inline __m512i q4k_r16_values(const uint8_t* b, int j, int t) {
  const __m512i z = _mm512_loadu_si512(b + 320 + (j >> 1) * 512 + t * 64);
  return _mm512_and_si512((j & 1) ? _mm512_srli_epi16(z, 4) : z, _mm512_set1_epi8(0x0F));
}

// Bit t of each byte of h moved to bit 4, the rest cleared: the fifth bits of dword slot t
// (Q5_0, Q5_K repacked).
inline __m512i high_bits(__m512i h, int t) {
#if defined(__GFNI__)  // one instruction
  return _mm512_gf2p8affine_epi64_epi8(h, _mm512_set1_epi64((1ll << t) << 24), 0);
#else
  return _mm512_and_si512(t <= 4 ? _mm512_slli_epi16(h, 4 - t) : _mm512_srli_epi16(h, t - 4),
                          _mm512_set1_epi8(0x10));
#endif
}

// Q5_0 repacked: dword slot t of the 16 rows of the block at b (nibble | high bit << 4), its
// high-bit bytes h (b + 32) loaded once per block.
inline __m512i q5_r16_values(const uint8_t* b, __m512i h, int t) {
  const __m512i z = _mm512_loadu_si512(b + 96 + (t & 3) * 64);
  const __m512i low = _mm512_and_si512(t < 4 ? z : _mm512_srli_epi16(z, 4), _mm512_set1_epi8(0x0F));
  return _mm512_or_si512(low, high_bits(h, t));
}

// Q4_K or Q5_K repacked: dword slot t of the 16 rows for sub-block j of the block at b; h: for
// Q5_K, sub-block j's fifth-bit bytes (b + 2368 + 64 j, loaded once per sub-block).
template <int TYPE>
inline __m512i k4_r16_values(const uint8_t* b, int j, int t, [[maybe_unused]] __m512i h) {
  if constexpr (TYPE == kQ5KR) return _mm512_or_si512(q4k_r16_values(b, j, t), high_bits(h, t));
  return q4k_r16_values(b, j, t);
}
// Sub-block j's fifth-bit bytes of a Q5_K block at b (Q4_K: unused).
template <int TYPE>
inline __m512i k4_r16_high(const uint8_t* b, int j) {
  if constexpr (TYPE == kQ5KR) return _mm512_loadu_si512(b + 2368 + j * 64);
  return _mm512_setzero_si512();
}

// Q6_K repacked: dword slot t of the 16 rows for the four sub-blocks of one half of the block
// at b, as unsigned q (0 .. 63).
#if defined(__GFNI__)
// The matrix of GF2P8AFFINEQB that moves bits 2j and 2j + 1 of each byte to bits 4 and 5 and
// clears the rest (row i of the matrix, byte 7 - i of the qword, picks output bit i's input).
constexpr long long q6k_high_bits(int j) {
  return (1ll << (2 * j)) << 24 | (1ll << (2 * j + 1)) << 16;
}
#endif
inline void q6k_r16_values(const uint8_t* b, int half, int t, __m512i* v) {
  const __m512i low4 = _mm512_set1_epi8(0x0F), bits45 = _mm512_set1_epi8(0x30);
  const uint8_t* q = b + 288 + half * 1536 + t * 192;
  const __m512i l0 = _mm512_loadu_si512(q), l1 = _mm512_loadu_si512(q + 64);
  const __m512i h = _mm512_loadu_si512(q + 128);  // bits 2j, 2j + 1: sub-block j's
#if defined(__GFNI__)
  // Each sub-block's two high bits put in place by one instruction, where the shifts move whole
  // 16-bit lanes and need a mask after them. One row, 20 layers of the 0.6B's four linears from
  // memory, ms, medians of 4 alternating runs: 16.2 -> 15.5.
  const __m512i lo0 = _mm512_and_si512(l0, low4), lo1 = _mm512_and_si512(l1, low4);
  const __m512i hi0 = _mm512_and_si512(_mm512_srli_epi16(l0, 4), low4);
  const __m512i hi1 = _mm512_and_si512(_mm512_srli_epi16(l1, 4), low4);
  auto high = [&](int j) {
    return _mm512_gf2p8affine_epi64_epi8(h, _mm512_set1_epi64(q6k_high_bits(j)), 0);
  };
  v[0] = _mm512_or_si512(lo0, high(0));
  v[1] = _mm512_or_si512(lo1, high(1));
  v[2] = _mm512_or_si512(hi0, _mm512_and_si512(h, bits45));  // (bits 4, 5 already)
  v[3] = _mm512_or_si512(hi1, high(3));
#else
  v[0] = _mm512_or_si512(_mm512_and_si512(l0, low4),
                         _mm512_and_si512(_mm512_slli_epi16(h, 4), bits45));
  v[1] = _mm512_or_si512(_mm512_and_si512(l1, low4),
                         _mm512_and_si512(_mm512_slli_epi16(h, 2), bits45));
  v[2] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l0, 4), low4),
                         _mm512_and_si512(h, bits45));
  v[3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l1, 4), low4),
                         _mm512_and_si512(_mm512_srli_epi16(h, 2), bits45));
#endif
}

// Q3_K repacked (1824 bytes per 16 rows, 114 a row against Q3_K's 110): d[16] float16, the
// int8 scales by 16 values as Q6_K's (unpacked from their 6 bits), then per dword slot t, 3 x 64
// bytes: qs's halves (bits 2g, 2g + 1: sub-block 4 half + g's low bits) and hmask (bit j:
// sub-block j's third bit), each as Q3_K stores them, interleaved by dword. Dword slot t of the
// four sub-blocks of one half as unsigned q + 4 (0 .. 7).
inline void q3k_r16_values(const uint8_t* b, int half, int t, __m512i* v) {
  const uint8_t* q = b + 288 + t * 192;
  const __m512i l = _mm512_loadu_si512(q + half * 64), h = _mm512_loadu_si512(q + 128);
  const __m512i three = _mm512_set1_epi8(3), four = _mm512_set1_epi8(4);
  for (int g = 0; g < 4; g++) {
    const int j = 4 * half + g;  // hmask bit j to bit 2
    const __m512i hb = j >= 2 ? _mm512_srli_epi16(h, j - 2) : _mm512_slli_epi16(h, 2 - j);
    v[g] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 2 * g), three),
                           _mm512_and_si512(hb, four));
  }
}

// Q2_K repacked (1344 bytes per 16 rows, 84 a row as Q2_K's): d[16], dmin[16] float16, the
// scale | min << 4 bytes by 16 values, then per dword slot t qs's two halves (bits 2g, 2g + 1:
// sub-block 4 half + g's values) as Q2_K stores them, interleaved by dword.
inline void q2k_r16_values(const uint8_t* b, int half, int t, __m512i* v) {
  const __m512i l = _mm512_loadu_si512(b + 320 + t * 128 + half * 64);
  for (int g = 0; g < 4; g++)
    v[g] = _mm512_and_si512(_mm512_srli_epi16(l, 2 * g), _mm512_set1_epi8(3));
}

template <int TYPE>
inline void s16_r16_values(const uint8_t* b, int half, int t, __m512i* v) {
  if constexpr (TYPE == kQ3KR) q3k_r16_values(b, half, t, v);
  else if constexpr (TYPE == kQ2KR) q2k_r16_values(b, half, t, v);
  else q6k_r16_values(b, half, t, v);
}

// out (MR x 16) = MR activation rows from m0 times the 16 repacked rows at g.
// kOnce: the call has one activation row (single-stream decode). On Zen 4 it issues no software
// prefetch: the hardware's stream prefetchers alone read a thread's groups (contiguous, in order)
// fastest there. On Intel's cores, and for the K-quants on Zen 5 (one_row_prefetch below), it
// prefetches a group ahead into L2 as from two rows. On Intel: the L2 streamer there does not run
// past a 4 KB page, and a group is 9-52 KB. On a 2-core Xeon with AMX (KVM, 2026-12-07), the 0.6B's
// 112 linears at one row, random blocks repacked, from memory (GB/s, none / a group ahead; two
// runs): Q4_K 20.1 / 27.7, Q8_0 25.3 / 29.1, Q6_K 16.0 / 25.2, Q5_K 15.5 / 26.7, and a Q6_K head of
// 151936 x 1024 19 / 40-60 (partly from L3); single-stream decode (ms a token, processes
// alternating): 0.6B Q4_K_M 21.2-22.1 -> 15.6-15.8, Q8_0 24.4-25.2 -> 21.2-22.1, Gemma 3 270M
// Q4_K_M (8 KB ahead) 10.6-11.6 -> 9.9-10.1; 1-16 KB into L1 or L2 measured no better than a group.
// Measured on a Zen 4 (2 cores, in process, the choice toggled every 4 steps, medians of 30
// alternations), the one-row step without prefetches against the group-ahead non-temporal ones it
// had: 0.6B Q8_0 1.08-1.10x (three runs; at 2000 tokens of context 1.03x), Q4_K_M 1.01-1.05x (three
// runs), Gemma 3 270M Q4_K_M 1.13x, the bf16 0.6B at --quantization int8 1.10x; short distances
// into L2 (512 B to 2 KB ahead) ran like none on Q8_0 and 0.87-1.01x on Q4_K_M, the non-temporal
// hint 1 KB ahead 1.02x. (A group ahead is 9-52 KB; AMD's optimization guides put a non-temporal
// prefetch in L1 only, 32 KB here, so the lines may be evicted before use and read twice: a likely
// cause, not measured.) From two rows the prefetches into L2 stay: without them Q8_0 ran 1.11x at 2
// rows but 0.91x at 3 and 0.76x at 8, and Q4_K_M 0.94x at 2. The Q8_0 numbers come from one process
// per run, so also (as the machine's phases go) from one bandwidth level each: 1.18x in a process
// of 14.7 ms steps, 1.02-1.06x in three of 20-21 ms.
// On a Zen 5 (2 cores, AMD family 0x1A, 2026-12-08) the group ahead into L2 is the faster
// choice for the K-quants: the 0.6B's single-stream decode step with it against none, flipped
// step by step in one engine (medians of 5-8 decodes): Q4_K_M 1.18-1.29x (its Q6_K parts alone
// 1.13x, its Q4_K parts alone 1.04x), Q5_K_M 1.19x, Q3_K_M 1.35x, Q2_K 1.30x, Gemma 3 270M
// Q4_K_M's Q4_K and Q6_K parts 1.02x; the 151936-row Q6_K head alone read 35 -> 47 GB/s. For
// Q8_0 and int8 rows it stays off there: 0.96x on the 0.6B Q8_0, 0.95x on Gemma's Q8_0 parts,
// 0.92x at --quantization int8 (Q5_0's 1.006x: off). (Zen 4's measurements above compared
// none against a non-temporal group ahead and short L2 distances, so it keeps none.)
template <int TYPE>
inline bool one_row_prefetch() {
  if (intel_cpu()) return true;
  return (kK4R<TYPE> || kHalvesR<TYPE>) && amd_family() >= 0x1A;
}

template <int TYPE, int MR, bool kOnce>
inline void r16_rows(const uint8_t* g, const Act& a, int64_t m0, float (*out)[16]) {
  const int64_t nsub = a.K / 32;
  // From two rows (from one on Intel and for Zen 5's K-quants: above), each block prefetches the
  // same block of the next group (the group this thread takes next) into L2: a group ahead, where 4
  // KB ahead (the tiles' distance) left a group's compute and its memory reads in turn (0.6B Q8_0
  // decode step, 1 row 31.1 -> 29.3 ms, 8 rows 59.4 -> 54.0; Q4_K_M 25.1 -> 24.3, 59.5 -> 57.1).
  // The prefetches are spread over the block's steps, a few lines each (Q4_K 37 lines over its 8
  // sub-blocks, Q6_K 53 over its 16 steps): issued all at the block's start they left the demand
  // loads waiting behind them. One row, the 0.6B's four linears x 28 layers from memory, ms,
  // medians of 4 alternating runs, at the start / spread: Q4_K 17.8 / 14.8 (248 MB: 17 GB/s of the
  // 22 measured), Q6_K (20 layers) 16.9 / 17.1. Both run at L3's ~30 GB/s when the weights are
  // there (4 layers), so what is left is waiting.
  const int64_t ahead = nsub / kR16Subs<TYPE> * kR16Block<TYPE>;
  const bool prefetch = !kOnce || one_row_prefetch<TYPE>();
  constexpr int64_t kLines = (kR16Block<TYPE> + 63) / 64;
  __m512 acc[MR];
  for (int m = 0; m < MR; m++) acc[m] = _mm512_setzero_ps();
  if constexpr (kHalvesR<TYPE>) {
    // Per half of a block, its four sub-blocks at once: each 64 bytes is read once, in order.
    for (int64_t sb0 = 0; sb0 < nsub; sb0 += 8) {
      const uint8_t* b = g + sb0 / 8 * kR16Block<TYPE>;
      for (int half = 0; half < 2; half++) {
        __m512i i[4][MR][2];
        for (int j = 0; j < 4; j++) r16_start<TYPE, MR, 2>(a, m0, sb0 + 4 * half + j, i[j]);
#pragma GCC unroll 8
        for (int t = 0; t < 8; t++) {
          const int s = half * 8 + t;  // (the next group's lines, spread over the 16 steps)
          if (prefetch)
            for (int64_t l = s * kLines / 16; l < (s + 1) * kLines / 16; l++)
              _mm_prefetch(reinterpret_cast<const char*>(b) + ahead + l * 64, _MM_HINT_T1);
          __m512i v[4];
          s16_r16_values<TYPE>(b, half, t, v);
          for (int j = 0; j < 4; j++) r16_dot<MR, 2>(a, m0, sb0 + 4 * half + j, t, v[j], i[j]);
        }
        for (int j = 0; j < 4; j++)
          r16_finish<TYPE, MR, 2>(b, 4 * half + j, a, m0, sb0 + 4 * half + j, i[j], acc);
      }
    }
  } else {
    constexpr int subs = kR16Subs<TYPE>;
    for (int64_t sb0 = 0; sb0 < nsub; sb0 += subs) {
      const uint8_t* b = g + sb0 / subs * kR16Block<TYPE>;
#pragma GCC unroll 8  // every j's offsets and shifts fixed at compile time
      for (int j = 0; j < subs; j++) {
        if (prefetch)
          for (int64_t l = j * kLines / subs; l < (j + 1) * kLines / subs; l++)  // (next group's)
            _mm_prefetch(reinterpret_cast<const char*>(b) + ahead + l * 64, _MM_HINT_T1);
        const int64_t sb = sb0 + j;
        __m512i i[MR][1];
        r16_start<TYPE, MR, 1>(a, m0, sb, i);
        [[maybe_unused]] __m512i h;
        if constexpr (TYPE == kQ5R) h = _mm512_loadu_si512(b + 32);
        if constexpr (kK4R<TYPE>) h = k4_r16_high<TYPE>(b, j);
#pragma GCC unroll 8
        for (int t = 0; t < 8; t++) {
          __m512i v;
          if constexpr (kK4R<TYPE>) {
            v = k4_r16_values<TYPE>(b, j, t, h);
          } else if constexpr (TYPE == kQ5R) {
            v = q5_r16_values(b, h, t);
          } else {
            v = _mm512_loadu_si512(b + (TYPE == kI8R ? 0 : 32) + t * 64);
          }
          r16_dot<MR, 1>(a, m0, sb, t, v, i);
        }
        r16_finish<TYPE, MR, 1>(b, j, a, m0, sb, i, acc);
      }
    }
  }
  for (int m = 0; m < MR; m++) _mm512_storeu_ps(out[m], acc[m]);
}

// Rows m0 .. m0 + mr - 1 of a repacked part's group g (its 16 outputs, o[m] for row m0 + m)
// into y: times the int8 rows' scales, rounded to T once.
template <typename T>
inline void store_rows16(const Part& p, int64_t g, int64_t m0, int64_t mr, const float (*o)[16],
                         T* y, int64_t ldy) {
  const int64_t n0 = g * kR16Rows;
  for (int64_t m = 0; m < mr; m++) {
    __m512 v = _mm512_loadu_ps(o[m]);
    if (p.scale) v = _mm512_mul_ps(v, _mm512_loadu_ps(p.scale + n0));
    T* dst = y + (m0 + m) * ldy + p.col + n0;
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16>) {
      store_round(dst, v);
    } else {  // (instantiated by the dispatch, refused by quant_matmul's checks)
      alignas(64) float f[16];
      _mm512_store_ps(f, v);
      for (int n = 0; n < 16; n++) dst[n] = T(f[n]);
    }
  }
}

#if defined(LADLE_QUANT_AMX)
// AMX (Intel Sapphire Rapids and later): 16 activation rows x 16 repacked weight rows per tile
// instruction. A repacked sub-block's bytes are already AMX's B-tile layout (dword t of the 16
// rows side by side, 64 bytes per tile row); they go through a 512-byte buffer as signed bytes
// (Q8_0's and int8 rows' sign bit flipped back, Q4_K's nibbles, Q6_K's q - 32). TDPBSSD (signed
// activations times signed weights) gives each sub-block's exact int32 sums for all 256 (row,
// output) pairs, the integers r16_rows reaches, and the float steps are r16_finish's: the
// result has the repacked rows' bits (which are the blocks' bits), so a row's numbers do not
// depend on whether it ran with 15 others on the tile unit or alone.
struct alignas(64) AmxConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  explicit AmxConfig(int k) {  // k: the bytes of an A row (Q6_K's halves: 16)
    const int shape[8][2] = {{16, k}, {k / 4, 64}, {16, 64}, {16, k},
                             {k / 4, 64}, {16, 64}, {16, 64}, {16, 64}};
    for (int t = 0; t < 8; t++) {
      rows[t] = uint8_t(shape[t][0]);
      colsb[t] = uint16_t(shape[t][1]);
    }
  }
};

std::atomic<bool> g_amx_on{true};  // set_quant_amx: tests and benchmarks compare both paths
bool amx_active() { return g_amx_on.load(std::memory_order_relaxed) && amx_permitted(); }

// x (M, K) as A tiles, 16 rows x 32 values each (int8, Act::qt: 32 bytes; bfloat16 for
// bf16_group: 64), by sixteen of rows then sub-block, a last partial sixteen padded with zero rows.
template <typename T>
void tile_activations(const T* x, int64_t M, int64_t K, T* xt) {
  const int64_t nsub = K / 32, sixteens = (M + 15) / 16;
  at::parallel_for(0, sixteens * nsub, grain_for(512 * kElementWork), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t++) {
      const int64_t r0 = t / nsub * 16;
      const T* src = x + r0 * K + (t % nsub) * 32;
      for (int r = 0; r < 16; r++) {
        T* dst = xt + t * 512 + r * 32;
        if (r0 + r < M) std::memcpy(dst, src + r * K, 32 * sizeof(T));
        else std::memset(dst, 0, 32 * sizeof(T));
      }
    }
  });
}

// Sub-block j's (block b) weights for the B tile, as signed bytes in buf: Q4_K's and Q5_K's
// values as they are, Q8_0's and int8 rows' unsigned w + 128 with the sign bit flipped back.
// (Signed weights: TDPBSSD's sums need no bias taken off.)
template <int TYPE>
inline const uint8_t* amx_weights(const uint8_t* b, int j, uint8_t* buf) {
  [[maybe_unused]] const __m512i h = k4_r16_high<TYPE>(b, j);
  for (int t = 0; t < 8; t++) {
    __m512i v;
    if constexpr (kK4R<TYPE>) {
      v = k4_r16_values<TYPE>(b, j, t, h);
    } else {
      v = _mm512_xor_si512(_mm512_loadu_si512(b + (TYPE == kI8R ? 0 : 32) + t * 64),
                           _mm512_set1_epi8(char(0x80)));
    }
    _mm512_storeu_si512(buf + t * 64, v);
  }
  return buf;
}

// Q6_K, Q3_K, Q2_K: the four sub-blocks of one half of the block at b, unpacked as r16_rows
// does, into bufs[j] (512 bytes each) as signed values.
template <int TYPE>
inline void amx_s16_half(const uint8_t* b, int half, uint8_t (*bufs)[512]) {
  for (int t = 0; t < 8; t++) {
    __m512i v[4];
    s16_r16_values<TYPE>(b, half, t, v);
    for (int j = 0; j < 4; j++)  // q - bias: the signed values
      _mm512_storeu_si512(bufs[j] + t * 64,
                          _mm512_sub_epi8(v[j], _mm512_set1_epi8(char(kR16Bias<TYPE>))));
  }
}

// Sub-block sb's int32 sums c[h] (16 x 16: activation row, output; the signed weights', so
// the sums r16_rows reaches after its bias start) done: the float steps, four activation rows at
// a time (for the registers).
template <int TYPE, int H>
inline void amx_finish(const uint8_t* b, int j, const Act& a, int64_t m0, int64_t sb,
                       const int32_t (*c)[256], __m512* acc) {
  for (int m = 0; m < 16; m += 4) {
    __m512i i[4][H];
    for (int r = 0; r < 4; r++)
      for (int h = 0; h < H; h++) i[r][h] = _mm512_load_si512(c[h] + (m + r) * 16);
    r16_finish<TYPE, 4, H>(b, j, a, m0 + m, sb, i, acc + m);
  }
}

// One sub-block's products: A tile TA (16 activation rows' bytes at x, row stride ld) times
// B tile TB (the weights at w) into C tile TC. (A macro: the tile intrinsics spell their
// register numbers into the assembly, so they must be literals.)
#define LADLE_AMX_DP(TA, TB, TC, x, ld, w) \
  do {                                      \
    _tile_zero(TC);                         \
    _tile_loadd(TA, x, ld);                 \
    _tile_loadd(TB, w, 64);                 \
    _tile_dpbssd(TC, TA, TB);               \
  } while (0)

// The B tiles of the 16 repacked rows at g, every sub-block's 512 bytes in order, as signed
// bytes into wb. Once per group for all its activation rows, and well before the tile loads:
// a tile load of bytes just written by vector stores stalls (one int8 4096 x 1024 linear, 128
// rows: 3.1 ms unpacked per sub-block beside its tile load, 2.5 ms unpacked ahead).
template <int TYPE>
void amx_unpack(const uint8_t* g, int64_t nsub, uint8_t* wb) {
  if constexpr (kHalvesR<TYPE>) {
    for (int64_t sb0 = 0; sb0 < nsub; sb0 += 8)
      for (int half = 0; half < 2; half++)
        amx_s16_half<TYPE>(g + sb0 / 8 * kR16Block<TYPE>, half,
                           reinterpret_cast<uint8_t(*)[512]>(wb + (sb0 + 4 * half) * 512));
  } else {
    constexpr int subs = kR16Subs<TYPE>;
    for (int64_t sb = 0; sb < nsub; sb++)
      amx_weights<TYPE>(g + sb / subs * kR16Block<TYPE>, int(sb % subs), wb + sb * 512);
  }
}

// The tiles of amx_block: A (16 activation rows x 32 bytes) in 0 and 1, B (one sub-block of 16
// repacked rows: 8 x 64 bytes) in 2 and 3, C (16 x 16 int32) in 4 .. 7.
struct alignas(64) AmxBlockConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {32, 32, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 8, 8, 16, 16, 16, 16};
};

// Q8_0, int8 rows, Q4_K and Q5_K (one C tile per sub-block): MB sixteens of activation rows (from
// r0) times NB groups of 16 repacked rows (g[j], their B tiles at wb[j]), sub-blocks sb0 to
// sb1 - 1, added to the float sums sums[j] (rows of 16 outputs, indexed by activation row) in
// sub-block order, as r16_rows adds them. Each sub-block's A and B tiles serve MB x NB products
// (2 x 2: 4 C tiles in flight, each tile load used twice), and the previous sub-block's float
// steps come between the products and their stores. Against one product at a time (as
// amx_s16_rows still runs the scale-per-16 types'): one int8 0.6B layer's four linears, 2
// threads, 128 rows 4.4 -> 3.8 ms, 256 rows 9.6 -> 8.0 ms (Sapphire Rapids class Xeon). What
// bounds it there: the tile unit and the vector unit did not overlap in a loop of only these
// steps (4 products of 16 x 16 x 32 with their loads and stores, 40 ns; the 64 rows' float steps,
// 50 ns; both, 85 ns), so the per-32 scales cost about as much as the products.
template <int TYPE, int MB, int NB>
void amx_block(const uint8_t* const* g, const uint8_t* const* wb, const Act& a, int64_t r0,
               int64_t sb0, int64_t sb1, float (*const* sums)[16]) {
  constexpr int subs = kR16Subs<TYPE>;
  const int8_t* x = a.q + r0 * a.K;
  alignas(64) int32_t c[2][MB][NB][256];  // [sub-block parity][A][B]
  __m512 acc[MB][NB][16];
  for (int i = 0; i < MB; i++)
    for (int j = 0; j < NB; j++)
      for (int m = 0; m < 16; m++) acc[i][j][m] = _mm512_loadu_ps(sums[j][r0 + 16 * i + m]);
  // A tiles: 512 bytes each from the tiled copy, else 16 rows K bytes apart (whose lines
  // share a few L1 sets: the loads then come from L2).
  const int64_t nsub = a.K / 32;
  const int8_t* xt = a.qt ? a.qt + r0 / 16 * nsub * 512 : nullptr;
  const int64_t lda = xt ? 32 : a.K;
  const int64_t step = xt ? 512 : 32, next = xt ? nsub * 512 : 16 * a.K;
  if (xt) x = xt;
  for (int64_t sb = sb0; sb <= sb1; sb++) {
    const int p = int(sb & 1);
    if (sb < sb1) {
      _tile_zero(4);
      if constexpr (NB > 1) _tile_zero(5);
      if constexpr (MB > 1) _tile_zero(6);
      if constexpr (MB > 1 && NB > 1) _tile_zero(7);
      _tile_loadd(0, x + sb * step, lda);
      _tile_loadd(2, wb[0] + sb * 512, 64);
      if constexpr (NB > 1) _tile_loadd(3, wb[1] + sb * 512, 64);
      if constexpr (MB > 1) _tile_loadd(1, x + next + sb * step, lda);
      _tile_dpbssd(4, 0, 2);
      if constexpr (NB > 1) _tile_dpbssd(5, 0, 3);
      if constexpr (MB > 1) _tile_dpbssd(6, 1, 2);
      if constexpr (MB > 1 && NB > 1) _tile_dpbssd(7, 1, 3);
    }
    if (sb > sb0) {
      const int64_t pb = sb - 1;
      for (int i = 0; i < MB; i++)
        for (int j = 0; j < NB; j++)
          amx_finish<TYPE, 1>(g[j] + pb / subs * kR16Block<TYPE>, int(pb % subs), a,
                              r0 + 16 * i, pb, c[pb & 1][i] + j, acc[i][j]);
    }
    if (sb < sb1) {
      _tile_stored(4, c[p][0][0], 64);
      if constexpr (NB > 1) _tile_stored(5, c[p][0][NB - 1], 64);
      if constexpr (MB > 1) _tile_stored(6, c[p][MB - 1][0], 64);
      if constexpr (MB > 1 && NB > 1) _tile_stored(7, c[p][MB - 1][NB - 1], 64);
    }
  }
  for (int i = 0; i < MB; i++)
    for (int j = 0; j < NB; j++)
      for (int m = 0; m < 16; m++) _mm512_storeu_ps(sums[j][r0 + 16 * i + m], acc[i][j][m]);
}

// Q8_0 and int8 rows, kAmxMinRows to 15 rows (one sixteen of Act::qt, padded with zero rows and
// zero scales) by NB groups g[j] into out[j]. TDPBSUD multiplies the signed activations by the
// repacked bytes as they lie in memory (unsigned w + 128; no unpacking, which is what made the
// tile unit slower than the vector kernel below 16 rows), and each row's integer sums start,
// as r16_rows' do, at -128 x the sum of its activations before the float steps: the vector
// kernel's integers, so its bits.
template <int TYPE, int NB>
void amx_small(const uint8_t* const* g, const Act& a, int rows, float (*const* out)[16]) {
  static_assert(TYPE == kQ8R || TYPE == kI8R);
  constexpr int64_t off = TYPE == kQ8R ? 32 : 0;  // the values after Q8_0's 16 scales
  const int64_t nsub = a.K / 32, ahead = nsub * kR16Block<TYPE>;
  const int rows4 = (rows + 3) / 4 * 4;
  alignas(64) int32_t c[2][NB][256];
  __m512 acc[NB][16];
  for (int j = 0; j < NB; j++)
    for (int m = 0; m < 16; m++) acc[j][m] = _mm512_setzero_ps();
  for (int64_t sb = 0; sb <= nsub; sb++) {
    const int p = int(sb & 1);
    if (sb < nsub) {
      const uint8_t* b0 = g[0] + sb * kR16Block<TYPE>;
      for (int64_t o = 0; o < kR16Block<TYPE>; o += 64)  // the next group's block, into L2
        _mm_prefetch(reinterpret_cast<const char*>(g[NB - 1] + sb * kR16Block<TYPE>) + ahead + o,
                     _MM_HINT_T1);
      _tile_zero(4);
      if constexpr (NB > 1) _tile_zero(5);
      _tile_loadd(0, a.qt + sb * 512, 32);
      _tile_loadd(2, b0 + off, 64);
      if constexpr (NB > 1) _tile_loadd(3, g[1] + sb * kR16Block<TYPE> + off, 64);
      _tile_dpbsud(4, 0, 2);
      if constexpr (NB > 1) _tile_dpbsud(5, 0, 3);
    }
    if (sb > 0) {
      const int64_t pb = sb - 1;
      for (int j = 0; j < NB; j++)
        for (int m = 0; m < rows4; m += 4) {
          __m512i i[4][1];
          r16_start<TYPE, 4, 1>(a, m, pb, i);
          for (int r = 0; r < 4; r++)
            i[r][0] = _mm512_add_epi32(i[r][0], _mm512_load_si512(c[pb & 1][j] + (m + r) * 16));
          r16_finish<TYPE, 4, 1>(g[j] + pb * kR16Block<TYPE>, 0, a, m, pb, i, acc[j] + m);
        }
    }
    if (sb < nsub) {
      _tile_stored(4, c[p][0], 64);
      if constexpr (NB > 1) _tile_stored(5, c[p][NB - 1], 64);
    }
  }
  for (int j = 0; j < NB; j++)
    for (int m = 0; m < rows; m++) _mm512_storeu_ps(out[j][m], acc[j][m]);
}

// Q6_K, Q3_K, Q2_K: out (16 x 16) = activation rows m0 .. m0 + 15 times the 16 repacked rows at g,
// whose B tiles (each sub-block's two halves) amx_unpack wrote to wb; the tile configuration is
// loaded (AmxConfig(16)). Software-pipelined: sub-block sb's tile products (alternate C tiles)
// run while sb - 1's sums take their float steps, and only then are stored (vector loads wait
// behind a pending tile store).
template <int TYPE>
void amx_s16_rows(const uint8_t* g, const uint8_t* wb, const Act& a, int64_t m0,
                  float (*out)[16]) {
  const int64_t nsub = a.K / 32;
  const int8_t* x = a.q + m0 * a.K;
  alignas(64) int32_t c[2][2][256];  // [sub-block parity][half]
  __m512 acc[16];
  for (int m = 0; m < 16; m++) acc[m] = _mm512_setzero_ps();
  for (int64_t sb = 0; sb <= nsub; sb++) {
    const int p = int(sb & 1);
    if (sb < nsub) {
      const uint8_t* w = wb + sb * 512;
      if (p) {
        LADLE_AMX_DP(0, 1, 5, x + sb * 32, a.K, w);
        LADLE_AMX_DP(3, 4, 7, x + sb * 32 + 16, a.K, w + 256);
      } else {
        LADLE_AMX_DP(0, 1, 2, x + sb * 32, a.K, w);
        LADLE_AMX_DP(3, 4, 6, x + sb * 32 + 16, a.K, w + 256);
      }
    }
    if (sb > 0) {
      const int64_t pb = sb - 1;
      amx_finish<TYPE, 2>(g + pb / 8 * kR16Block<TYPE>, int(pb % 8), a, m0, pb, c[pb & 1], acc);
    }
    if (sb < nsub) {
      if (p) {  // (tile numbers must be literals)
        _tile_stored(5, c[1][0], 64);
        _tile_stored(7, c[1][1], 64);
      } else {
        _tile_stored(2, c[0][0], 64);
        _tile_stored(6, c[0][1], 64);
      }
    }
  }
  for (int m = 0; m < 16; m++) _mm512_storeu_ps(out[m], acc[m]);
}
#endif

#if defined(LADLE_QUANT_AMX) && defined(__AMX_BF16__)
#define LADLE_QUANT_BF16 1
// Prefill and batched decode of repacked parts (Q4_K, Q5_K, Q6_K, Q8_0, int8 rows; Q4_0, Q5_0
// through their panels) on AMX-BF16, outside batch-invariant mode, from bf16_min_rows (below)
// bfloat16 activation rows, when every part of the call can. The int8 program above pays per-32 float steps for every activation row, output
// and sub-block: the activations' block scales differ per row, so no sub-block's integers can
// be summed with the next's, and on this tile unit those float steps cost as much as the
// products (amx_block). Here the weights are dequantized instead, once per call for all rows:
// each group's sub-blocks become bfloat16 B tiles (bf16_block: each weight formed exactly in
// float, then rounded to nearest even; int8 rows' q exactly, their row scale applied to the
// sum), and the activations stay in bfloat16 as the model gave them. The C tiles then sum over
// all of K in float, as the dense bfloat16 kernel's do: no float steps per sub-block, no
// activation quantization. Numerically this is the dequantized weight times the unquantized
// activation (closer to the float model than the int8 path), so a row's value depends on
// whether its call had that many rows, as dense bfloat16 linears' do on torch's GEMM;
// batch-invariant mode keeps the integer path for every row count.
// A 0.6B layer's four linears, 2 threads, ms, these tiles / the integer path / dense bfloat16
// weights on AMX-BF16, at 32, 64 and 128 rows: Q8_0 1.08 / 1.30 / 0.89, 1.51 / 2.19 / 1.31,
// 2.59 / 4.06 / 2.19; int8 rows 1.07 / 1.27, 1.45 / 1.96, 2.47 / 3.63; another run: Q4_K
// 1.32 / 1.72 / 1.07, 1.80 / 3.25 / 1.88, 3.03 / 6.18 / 3.23; Q6_K 1.54 / 2.36 / 1.24, 2.06 /
// 3.81 / 1.96, 3.97 / 6.90 / 3.36. What stays above dense bfloat16 is the dequantization
// (Q8_0: ~19 vector instructions per 64 weights per call), which the tile unit does not
// overlap. 0.6B TTFT of 128 tokens: Q8_0 187 -> 134 ms, int8 165 -> 127 ms (bfloat16 122).
//
// From how many rows a call takes this path: the largest of its parts' bf16_min_rows. Below
// it, the integer path's fixed cost per weight (none: it reads each weight once for all rows)
// beats the dequantization; above it, the integer path's cost per row wins over it. Measured
// on all 28 layers of the 0.6B (weights from memory, as a batched decode step reads them),
// ms, these tiles / the integer path: Q8_0 8 rows 52.5 / 36.1, 16 50.5 / 48.4, 20 58.1 /
// 59.0, 24 57.8 / 66.6, 31 59.4 / 77.9; Q4_K 8 40.8 / 30.4, 16 39.2 / 38.9, 20 41.5 / 46.0,
// 31 47.6 / 73.8; Q6_K (20 layers) 8 31.8 / 33.6, 16 31.3 / 41.0, 31 34.6 / 82.5; Q5_0 (its
// panels) 4 51.9 / 31.9, 16 57.0 / 72.9, 128 104.8 / 246.5; Q4_0 128 105.3 / 242.4. Since Q4_0
// and Q5_0 tiles take their values unsigned: Q5_0 8 59.2 / 49.4, 9 59.0 / 59.8, 11 59.3 / 69.9,
// 12 59.7 / 71.6; Q4_0 8 41.9 / 41.4, 12 56.9 / 65.1. Q3_K 8 26.8 / 19.4, 10 26.7 / 23.9, 11
// 27.0 / 26.9, 12 27.2 / 28.2, 16 27.3 / 33.9, 128 68.5 / 163.5; Q2_K 10 - / 23.8, 12 26.6 /
// 28.3, 16 27.0 / 44.4, 128 68.9 / 261.5.
constexpr int64_t bf16_min_rows(int type) {
  switch (type) {
    case kQ6KR: return 8;
    case kQ3KR: return 12;
    case kQ2KR: return 12;
    case kQ5_0: return 9;
    case kQ5_1: return 9;  // (as Q5_0, Q4_0: not measured apart)
    case kQ4_1: return 12;
    case kQ4_0: return 12;
    case kIQ4NL: return 12;  // (as Q4_0: not measured apart)
    case kIQ4XS32: return 12;
    case kQ4KR: return 16;
    case kQ5KR: return 16;  // (as Q4_K: not measured apart)
    default: return 20;  // Q8_0, int8 rows
  }
}
// From this many rows the dequantized weights go to torch's GEMM (oneDNN: AMX-BF16 with its own
// blocking of M) instead of the tile program above, as one bfloat16 weight of up to
// kBf16GemmBytes per GEMM (more rows: chunks of that many bytes; chunks of 1024 rows ran the
// GEMM at half its speed). A 0.6B layer's four linears, ms, tiles / GEMM (torch on dense bf16
// weights): Q8_0 512 rows 11.8 / 12.3 (10.7), 768 18.5 / 17.4 (14.2), 1024 23.6 / 20.4 (17.7),
// 2048 44.7 / 36.1 (33.8); Q4_K 512 10.9 / 12.7, 768 16.5 / 16.9, 1024 22.4 / 20.9, 2048 - / 34.9.
constexpr int64_t kBf16GemmRows = 768;
constexpr int64_t kBf16GemmBytes = 64 << 20;
// The tile program runs calls of many rows (below kBf16GemmRows, or K large) in chunks of about
// this many bytes of activations (rows a multiple of 32, at least 64): with every row at once,
// each group pair streamed all of them from L3 (0.6B Q8_0 layer's four linears at 2048 rows,
// before the GEMM took them: 60.5 ms; in chunks 44.7; 512 rows unchanged at 10.8).
constexpr int64_t kBf16ChunkBytes = 1 << 20;


// The weights as bfloat16 B tiles (16 rows of a pair of K values x 16 outputs: row p holds
// values 2p, 2p + 1 of each output), 512 values per sub-block of 32. A repacked slot t holds
// values 4t .. 4t + 3 of the 16 outputs (bytes 4n .. 4n + 3): B rows 2t and 2t + 1. Each
// weight is formed exactly in float and rounded once to bfloat16, so the tiles hold
// bf16(the dequantized weight), what `bf16_tiles_reference` multiplies: Q8_0 d * q (19 bits),
// Q6_K d * sc * (q - 32) (at most 24), Q4_K d * sc * q (21; Q5_K 22) - dmin * m (17, the one
// rounding of the difference), int8 rows q itself.

// Per-output scales s (lane n) as the four quarters' lanes: quarter j, lane 4n + k: output
// 4j + n (the layout of a slot's values converted 16 at a time).
inline void bf16_quarters(__m512 s, __m512* q) {
  const __m512i lane4 = _mm512_srli_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), 2);
  for (int j = 0; j < 4; j++)
    q[j] = _mm512_permutexvar_ps(_mm512_add_epi32(lane4, _mm512_set1_epi32(4 * j)), s);
}

// Slot t's values as floats (quarter j: outputs 4j .. 4j + 3) into B rows 2t and 2t + 1.
inline void bf16_slot(const __m512* f, int t, uint16_t* out) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  // dword 2n + h of lo (outputs 0-7) / hi (8-15): output n's values 4t + 2h, 4t + 2h + 1
  const __m512i lo = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(f[1], f[0]));
  const __m512i hi = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(f[3], f[2]));
  _mm512_storeu_si512(out + (2 * t) * 32, _mm512_permutex2var_epi32(lo, even, hi));
  _mm512_storeu_si512(out + (2 * t + 1) * 32, _mm512_permutex2var_epi32(lo, odd, hi));
}

// Quarter j of 64 bytes as 16 floats, unsigned or signed.
template <bool SIGNED>
inline __m512 bf16_bytes(__m512i v, int j) {
  __m128i x;
  switch (j) {  // (the lane index must be a constant)
    case 0: x = _mm512_extracti32x4_epi32(v, 0); break;
    case 1: x = _mm512_extracti32x4_epi32(v, 1); break;
    case 2: x = _mm512_extracti32x4_epi32(v, 2); break;
    default: x = _mm512_extracti32x4_epi32(v, 3); break;
  }
  return _mm512_cvtepi32_ps(SIGNED ? _mm512_cvtepi8_epi32(x) : _mm512_cvtepu8_epi32(x));
}

// One sub-block of 16 outputs in the slots' layout (v: 8 slots of 64 bytes, output n's values
// 4t .. 4t + 3 at bytes 4n .. 4n + 3 of slot t), each stored unsigned as u = (w - c) / d, with
// output n's scale d in lane n of d16 and its offset c in lane n of c16: f = u d + c, rounded
// once to bfloat16. With c = -bias d (a bias of 8 bits, d 11 for a half-precision scale) u d
// + c is exact; with a block's min m as c (Q4_1, Q5_1), u d is, and the sum rounds once.
inline void bf16_slots(const uint8_t* v, __m512 d16, __m512 c16, uint16_t* out) {
  __m512 d[4], c[4], f[4];
  bf16_quarters(d16, d);
  bf16_quarters(c16, c);
  for (int t = 0; t < 8; t++) {
    for (int j = 0; j < 4; j++) {
      const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(v + t * 64 + j * 16));
      f[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(x)), d[j], c[j]);
    }
    bf16_slot(f, t, out);
  }
}

// One repacked block of 16 rows at b (kR16Subs<TYPE> sub-blocks) into out.
template <int TYPE>
inline void bf16_block(const uint8_t* b, uint16_t* out) {
  __m512 d[4], c[4], f[4];
  auto f16x16 = [](const uint8_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  };
  auto bytes16 = [](const uint8_t* p, bool sign) {
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm512_cvtepi32_ps(sign ? _mm512_cvtepi8_epi32(x) : _mm512_cvtepu8_epi32(x));
  };
  if constexpr (TYPE == kQ8R) {  // stored u = w + 128
    const __m512 dd = f16x16(b);
    bf16_slots(b + 32, dd, _mm512_mul_ps(dd, _mm512_set1_ps(-128.f)), out);
  } else if constexpr (TYPE == kI8R) {  // (the row scale on the sums)
    bf16_slots(b, _mm512_set1_ps(1.f), _mm512_set1_ps(-128.f), out);
  } else if constexpr (kK4R<TYPE>) {  // f = (d * sc) * q - dmin * m
    const __m512 dd = f16x16(b), dmin = f16x16(b + 32);
    for (int sb = 0; sb < 8; sb++) {
      bf16_quarters(_mm512_mul_ps(dd, bytes16(b + 64 + sb * 16, false)), d);
      bf16_quarters(_mm512_mul_ps(dmin, bytes16(b + 192 + sb * 16, false)), c);
      const __m512i h = k4_r16_high<TYPE>(b, sb);
      for (int t = 0; t < 8; t++) {
        const __m512i v = k4_r16_values<TYPE>(b, sb, t, h);
        for (int j = 0; j < 4; j++) f[j] = _mm512_fmsub_ps(bf16_bytes<false>(v, j), d[j], c[j]);
        bf16_slot(f, t, out + sb * 512);
      }
    }
  } else if constexpr (TYPE == kQ2KR) {  // f = (d * sc) * q - dmin * m, per 16 values
    const __m512 dd = f16x16(b), dmin = f16x16(b + 32);
    for (int half = 0; half < 2; half++) {
      __m512 ds[4][2][4], cs[4][2][4];  // [sub-block of the half][its 16-value half][quarter]
      for (int i = 0; i < 4; i++)
        for (int h = 0; h < 2; h++) {
          const __m512i sm = _mm512_cvtepu8_epi32(_mm_loadu_si128(
              reinterpret_cast<const __m128i*>(b + 64 + (2 * (4 * half + i) + h) * 16)));
          const __m512 sc = _mm512_cvtepi32_ps(_mm512_and_si512(sm, _mm512_set1_epi32(0xF)));
          const __m512 mn = _mm512_cvtepi32_ps(_mm512_srli_epi32(sm, 4));
          bf16_quarters(_mm512_mul_ps(dd, sc), ds[i][h]);
          bf16_quarters(_mm512_mul_ps(dmin, mn), cs[i][h]);
        }
      for (int t = 0; t < 8; t++) {
        __m512i v[4];
        q2k_r16_values(b, half, t, v);
        for (int i = 0; i < 4; i++) {
          for (int j = 0; j < 4; j++)
            f[j] = _mm512_fmsub_ps(bf16_bytes<false>(v[i], j), ds[i][t >> 2][j], cs[i][t >> 2][j]);
          bf16_slot(f, t, out + (4 * half + i) * 512);
        }
      }
    }
  } else {  // Q6_K, Q3_K: f = (d * sc) * (q - bias), sc per 16 values (slots 0-3, 4-7)
    static_assert(kS16R<TYPE>);
    const __m512 dd = f16x16(b);
    for (int half = 0; half < 2; half++) {
      __m512 ds[4][2][4];  // [sub-block of the half][its 16-value half][quarter]
      for (int i = 0; i < 4; i++)
        for (int h = 0; h < 2; h++)
          bf16_quarters(_mm512_mul_ps(dd, bytes16(b + 32 + (2 * (4 * half + i) + h) * 16, true)),
                        ds[i][h]);
      for (int t = 0; t < 8; t++) {
        __m512i v[4];
        s16_r16_values<TYPE>(b, half, t, v);
        for (int i = 0; i < 4; i++) {
          const __m512i q = _mm512_sub_epi8(v[i], _mm512_set1_epi8(char(kR16Bias<TYPE>)));
          for (int j = 0; j < 4; j++) f[j] = _mm512_mul_ps(bf16_bytes<true>(q, j), ds[i][t >> 2][j]);
          bf16_slot(f, t, out + (4 * half + i) * 512);
        }
      }
    }
  }
}

// Groups g0, g0 + ng - 1 of part p (ng 1 or 2) for all M rows: both groups' B tiles written to
// this thread's buffer (2 x K/32 KB, in L2), then two sixteens of rows by the two groups at a
// time on 4 C tiles summed over all of K, stored with the int8 rows' scales and rounded to T
// once. (Dequantizing spans of 16 or 32 sub-blocks at a time, so the B tiles stay in L1, was
// 2-5% slower: the C tiles' stores and reloads between spans cost more than L2 reads.)
// While the tiles run, the weight bytes this thread dequantizes next (`next`, `next_bytes`; none
// for its last unit) are prefetched to L2, spread over the tile loop's steps: the dequantization
// then reads them from L2 instead of waiting on memory with the tile unit idle. A 0.6B model's
// 28 layers of four linears (the weights stream from memory, as in a model, not from L3 as in
// one layer's loop), ms, without / with this prefetch (dense bfloat16 on torch): Q8_0 64 rows
// 81.1 / 56.7 (63.0), 128 rows 115.4 / 85.0-92.9 (97-103), 512 rows 316 / 288 (265); Q4_K,
// whose dequantization waits less, 128 rows 88.3 / 85.1.
// Q4_0, Q5_0, Q4_1, Q5_1 and IQ4 (not repacked at load: bf16_panel_type) take this path too,
// their 16 rows unpacked into a panel (pack_panel: the slots' layout, u = q + bias, a scale and
// min per row and sub-block) and written as B tiles by bf16_panel (below, where the panels are).
template <int TYPE>
void bf16_panel(const Part& p, int64_t n0, int64_t K, uint16_t* out);

template <int TYPE, typename T>
void bf16_group(const Part& p, int64_t g0, int ng, const at::BFloat16* xt, int64_t M,
                int64_t K, T* y, int64_t ldy, const uint8_t* next, int64_t next_bytes) {
  const int64_t nsub = K / 32, sixteens = (M + 15) / 16;
  // Cache lines of `next` per step of the tile loop ((sixteens + 1) / 2 x nsub steps).
  const int64_t steps = (sixteens + 1) / 2 * nsub;
  const int64_t per_step = (next_bytes / 64 + steps - 1) / steps;
  int64_t pf = 0;
  thread_local std::vector<uint16_t> buf;  // B tiles, [group][sub-block] x 512
  buf.resize(size_t(2 * nsub * 512));
  const uint16_t* wb[2] = {buf.data(), buf.data() + (ng - 1) * nsub * 512};
  for (int j = 0; j < ng; j++) {
    if constexpr (bf16_panel_type(TYPE)) {
      bf16_panel<TYPE>(p, (g0 + j) * kR16Rows, K, buf.data() + j * nsub * 512);
    } else {
      const uint8_t* g = p.w + (g0 + j) * kR16Rows * p.row_bytes;
      for (int64_t sb = 0; sb < nsub; sb += kR16Subs<TYPE>)
        bf16_block<TYPE>(g + sb / kR16Subs<TYPE> * kR16Block<TYPE>, buf.data() + (j * nsub + sb) * 512);
    }
  }
  alignas(64) float c[16][16];
  auto store = [&](int j, int64_t m0) {
    store_rows16(p, g0 + j, m0, std::min<int64_t>(16, M - m0), c, y, ldy);
  };
  for (int64_t s = 0; s < sixteens; s += 2) {
    const bool two = s + 1 < sixteens;
    const at::BFloat16* a0 = xt + s * nsub * 512;
    const at::BFloat16* a1 = a0 + nsub * 512;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t sb = 0; sb < nsub; sb++) {  // tiles: C 0-3, A 4-5, B 6-7 (literal numbers)
      for (int64_t e = 0; e < per_step && pf < next_bytes; e++, pf += 64)
        _mm_prefetch(reinterpret_cast<const char*>(next) + pf, _MM_HINT_T1);
      _tile_loadd(4, a0 + sb * 512, 64);
      _tile_loadd(6, wb[0] + sb * 512, 64);
      _tile_dpbf16ps(0, 4, 6);
      if (ng == 2) {
        _tile_loadd(7, wb[1] + sb * 512, 64);
        _tile_dpbf16ps(1, 4, 7);
      }
      if (two) {
        _tile_loadd(5, a1 + sb * 512, 64);
        _tile_dpbf16ps(2, 5, 6);
        if (ng == 2) _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, c[0], 64);
    store(0, s * 16);
    if (ng == 2) {
      _tile_stored(1, c[0], 64);
      store(1, s * 16);
    }
    if (two) {
      _tile_stored(2, c[0], 64);
      store(0, s * 16 + 16);
      if (ng == 2) {
        _tile_stored(3, c[0], 64);
        store(1, s * 16 + 16);
      }
    }
  }
}

// Group g of part p dequantized to row-major bfloat16 (the B tiles' values, transposed):
// rows 16g .. 16g + 15 of the part into out (16 rows, ld ldo).
template <int TYPE>
void bf16_group_rows(const Part& p, int64_t g, int64_t K, at::BFloat16* out, int64_t ldo) {
  alignas(64) uint16_t b[8 * 512];  // one block's B tiles (K-quants: 8 sub-blocks)
  const uint8_t* gp = p.w + g * kR16Rows * p.row_bytes;
  for (int64_t sb = 0; sb < K / 32; sb += kR16Subs<TYPE>) {
    bf16_block<TYPE>(gp + sb / kR16Subs<TYPE> * kR16Block<TYPE>, b);
    for (int j = 0; j < kR16Subs<TYPE>; j++) {
      __m512 r[16];  // B row i: value pair i of the 16 outputs; transposed, output n's 16 pairs
      for (int i = 0; i < 16; i++)
        r[i] = _mm512_load_ps(reinterpret_cast<const float*>(b + j * 512 + i * 32));
      transpose16(r);
      for (int n = 0; n < 16; n++)
        _mm512_storeu_ps(reinterpret_cast<float*>(out + n * ldo + (sb + j) * 32), r[n]);
    }
  }
}
#endif

// Groups g .. g + ng - 1 (ng 1 or 2; rows 16g .., local to the part) of a repacked part for
// all M rows: a group's bytes stay in cache while the rows pass in fours (Q6_K: twos, for its
// registers), or with AMX in sixteens: Q6_K a sixteen at a time over all of K (amx_s16_rows), the
// others two sixteens by the two groups at a time (amx_block) in spans of kAmxSpan sub-blocks,
// whose B tiles (2 x 8 KB) stay in L1 while every row passes, the float sums kept between spans
// in a buffer of ng x M x 16.
constexpr int64_t kAmxSpan = 16;
// From this many rows (to 15) Q8_0 and int8 rows run on the tile unit too (amx_small). A 0.6B
// Q8_0 layer's four linears, 2 threads, us, tiles / vector kernel: 4 rows 489 / 399, 6 548 / 510,
// 8 565 / 587, 10 652 / 702, 12 670 / 783, 15 790 / 1007.
constexpr int64_t kAmxMinRows = 8;
// From this many rows in a last partial sixteen (M of 16 or more) r16_group runs it on the tile
// unit, padded, rather than on the vector kernel (the integer path: batch-invariant mode, or
// without AMX-BF16). All 28 layers of the 0.6B, ms, M rows / 32 rows: Q8_0 24 63.3 / 63.9, 28
// 69.9, 31 76.1; Q4_K 28 61.8 / 63.1, 31 70.9; Q6_K 20 72.9 / 81.1, 24 85.0, 28 96.6, 31 107.2.
template <int TYPE> constexpr int64_t kAmxPadMin = kHalvesR<TYPE> ? 8 : kK4R<TYPE> ? 13 : 10;

template <int TYPE, typename T>
void r16_group(const Part& p, int64_t g0, int ng, const Act& a, int64_t M, T* y, int64_t ldy) {
  constexpr int most = kHalvesR<TYPE> ? 2 : 4;
  alignas(64) float out[16][16];
  auto store = [&](int64_t g, int64_t m0, int64_t mr, const float (*o)[16]) {
    store_rows16(p, g, m0, mr, o, y, ldy);
  };
  auto group = [&](int64_t g) { return p.w + g * kR16Rows * p.row_bytes; };
  int64_t m0 = 0;
#if defined(LADLE_QUANT_AMX)
  if constexpr (TYPE == kQ8R || TYPE == kI8R) {
    if (M < 16 && M >= kAmxMinRows && a.qt && amx_active()) {
      static const AmxBlockConfig config;
      _tile_loadconfig(&config);
      alignas(64) float outs[2][16][16];
      float(*op[2])[16] = {outs[0], outs[1]};
      const uint8_t* gs[2] = {group(g0), group(g0 + ng - 1)};
      if (ng == 2) amx_small<TYPE, 2>(gs, a, int(M), op);
      else amx_small<TYPE, 1>(gs, a, int(M), op);
      _tile_release();
      for (int j = 0; j < ng; j++) store(g0 + j, 0, M, outs[j]);
      return;
    }
  }
  if constexpr (TYPE != kQ5R) if (M >= 16 && amx_active()) {
    // A last partial sixteen of at least kAmxPadMin rows runs on the tile unit too, padded with
    // the zero rows the call's activations hold (results dropped), instead of on the vector
    // kernel: the same integers and float steps, so the same bits.
    const int64_t rem = M % 16, full = M - rem;
    const int64_t mt = rem >= kAmxPadMin<TYPE> && a.rows >= full + 16 ? full + 16 : full;
    const int64_t nsub = a.K / 32;
    thread_local std::vector<uint8_t> buf;  // this thread's B tiles
    buf.resize(size_t(ng * nsub * 512));
    for (int j = 0; j < ng; j++) amx_unpack<TYPE>(group(g0 + j), nsub, buf.data() + j * nsub * 512);
    if constexpr (kHalvesR<TYPE>) {
      static const AmxConfig config(16);
      _tile_loadconfig(&config);
      for (int j = 0; j < ng; j++)
        for (int64_t r = 0; r < mt; r += 16) {
          amx_s16_rows<TYPE>(group(g0 + j), buf.data() + j * nsub * 512, a, r, out);
          store(g0 + j, r, std::min<int64_t>(16, M - r), out);
        }
    } else {
      static const AmxBlockConfig config;
      _tile_loadconfig(&config);
      thread_local std::vector<float> sums;  // this thread's float sums, ng x mt x 16
      sums.assign(size_t(ng * mt * 16), 0.f);
      float(*sp[2])[16] = {reinterpret_cast<float(*)[16]>(sums.data()),
                           reinterpret_cast<float(*)[16]>(sums.data()) + (ng - 1) * mt};
      const uint8_t* gs[2] = {group(g0), group(g0 + ng - 1)};
      const uint8_t* wbs[2] = {buf.data(), buf.data() + (ng - 1) * nsub * 512};
      for (int64_t sb = 0; sb < nsub; sb += kAmxSpan) {
        const int64_t se = std::min(nsub, sb + kAmxSpan);
        int64_t r = 0;
        for (; r + 32 <= mt; r += 32) {
          if (ng == 2) amx_block<TYPE, 2, 2>(gs, wbs, a, r, sb, se, sp);
          else amx_block<TYPE, 2, 1>(gs, wbs, a, r, sb, se, sp);
        }
        if (r < mt) {
          if (ng == 2) amx_block<TYPE, 1, 2>(gs, wbs, a, r, sb, se, sp);
          else amx_block<TYPE, 1, 1>(gs, wbs, a, r, sb, se, sp);
        }
      }
      for (int j = 0; j < ng; j++) store(g0 + j, 0, std::min(mt, M), sp[j]);
    }
    _tile_release();
    m0 = std::min(mt, M);
  }
#endif
  for (int j = 0; j < ng; j++) {
    if (m0 == 0 && M == 1) {  // one row: the group is read once (r16_rows' hint)
      r16_rows<TYPE, 1, true>(group(g0 + j), a, 0, out);
      store(g0 + j, 0, 1, out);
      continue;
    }
    for (int64_t m = m0; m < M;) {
      const int64_t left = M - m;
      const int mr = left >= most ? most : left >= 2 ? 2 : 1;
      switch (mr) {
        case 4: r16_rows<TYPE, most, false>(group(g0 + j), a, m, out); break;
        case 2: r16_rows<TYPE, 2, false>(group(g0 + j), a, m, out); break;
        default: r16_rows<TYPE, 1, false>(group(g0 + j), a, m, out); break;
      }
      store(g0 + j, m, mr, out);
      m += mr;
    }
  }
}

template <typename T>
void r16_group_any(const Part& p, int64_t g, int ng, const Act& a, int64_t M, T* y,
                   int64_t ldy) {
  switch (p.type) {
    case kQ4KR: return r16_group<kQ4KR>(p, g, ng, a, M, y, ldy);
    case kQ5KR: return r16_group<kQ5KR>(p, g, ng, a, M, y, ldy);
    case kQ6KR: return r16_group<kQ6KR>(p, g, ng, a, M, y, ldy);
    case kQ3KR: return r16_group<kQ3KR>(p, g, ng, a, M, y, ldy);
    case kQ2KR: return r16_group<kQ2KR>(p, g, ng, a, M, y, ldy);
    case kQ8R: return r16_group<kQ8R>(p, g, ng, a, M, y, ldy);
    case kQ5R: return r16_group<kQ5R>(p, g, ng, a, M, y, ldy);
    default: return r16_group<kI8R>(p, g, ng, a, M, y, ldy);
  }
}
#endif

// Tiles t0 .. t1 - 1 of part p (a repacked part's "tiles" are its groups of 16 rows).
template <typename T>
void part_tiles_any(const Part& p, int64_t t0, int64_t t1, const Act& a, int64_t M, T* y,
                    int64_t ldy) {
#if defined(LADLE_QUANT_512)
  if (is_r16(p.type)) {
    for (int64_t g = t0; g < t1; g += 2) r16_group_any(p, g, int(std::min<int64_t>(2, t1 - g)), a, M, y, ldy);
    return;
  }
#endif
  with_type(p.type, [&](auto t) { part_tiles<decltype(t)::value>(p, t0, t1, a, M, y, ldy); });
}

#if defined(LADLE_QUANT_512)
// Prefill and batched decode (M >= kPanelMinRows): panels. A tile multiplies each weight block
// into each row's lanes and sums lanes and rows per sub-block: ~6 instructions per 32
// multiply-adds per (row, weight row), a sixth of the int8 peak (Zen 4, 0.6B Q8_0 shapes, 128
// rows: 138 of 831 GOPS). A panel is 16 weight rows unpacked once per call into unsigned bytes
// (w + bias), interleaved by 4 (dword t of the 16 rows side by side: one zmm), so one vpdpbusd
// with 4 bytes of an activation row broadcast adds 64 products into 16 outputs' int32 sums: a
// sub-block of 32 takes 8 of them, then one conversion and two float operations for all 16
// outputs. The bias (Q8_0, int8 rows, MXFP4, IQ4: 128 with the sign bit flipped; Q4_0 8; Q5_0
// 16; Q6_K 32; Q4_K's and Q5_K's values need none) makes the weights unsigned for vpdpbusd;
// what it adds, bias * sum(x), starts each integer sum negated, so the sums are the tiles'
// integers and the float steps the tiles' (the order at the top of the tiles).
constexpr int64_t kPanelRows = 16;
// From this many rows the panel's packing pays (Zen 4, 0.6B Q8_0 layer shapes, ms per layer,
// tiles / panels: 8 rows 1.86 / 2.24, 16 rows 3.53 / 2.98, 32: 8.3 / 4.0, 128: 29.2 / 11.0).
constexpr int64_t kPanelMinRows = 12;

template <int TYPE> constexpr int kPanelBias =
    (TYPE == kQ8_0 || TYPE == kI8 || kLut4<TYPE> || kGrid<TYPE>) ? 128 : TYPE == kQ4_0 ? 8
    : TYPE == kQ5_0 ? 16 : TYPE == kQ6_K ? 32 : TYPE == kQ3_K ? 4 : 0;

// Sub-block sb of a row as 32 unsigned bytes w + bias.
template <int TYPE>
inline __m256i panel_bytes(const uint8_t* row, int64_t sb) {
  const __m256i flip = _mm256_set1_epi8(char(0x80));
  if constexpr (kK4<TYPE>) {
    return k4_values<TYPE>(row + (sb >> 3) * kK4Bytes<TYPE>, int(sb & 7));
  } else if constexpr (kS16<TYPE>) {
    return s16_values<TYPE>(row + (sb >> 3) * kS16Bytes<TYPE>, int(sb & 7));
  } else if constexpr (TYPE == kQ2_K) {
    return q2k_values(row + (sb >> 3) * kQ2KBytes, int(sb & 7));
  } else if constexpr (TYPE == kQ4_0) {
    return nibbles(row + sb * 18 + 2);
  } else if constexpr (TYPE == kQ5_0) {
    const uint8_t* b = row + sb * 22;
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    return _mm256_or_si256(nibbles(b + 6), bit_bytes(qh));
  } else if constexpr (kMin32<TYPE>) {  // unsigned as stored
    return block_unsigned<TYPE>(row + sb * kBlockBytes<TYPE>);
  } else {  // signed bytes (Q8_0, int8 rows, MXFP4, IQ4 and the grid types): + 128 is the
            // sign flipped
    return _mm256_xor_si256(block_quants<TYPE>(row + sb * kBlockBytes<TYPE>), flip);
  }
}

// Sub-block sb's float factors: dw (the block's scale; a K-quant's d), the integer scales of
// its halves as floats (K-quants; 1 otherwise) and the min (Q4_K's / Q5_K's dmin * min, Q4_1's /
// Q5_1's -m; Q2_K's dmin, its halves' integer mins in m0, m1): the tiles' values.
template <int TYPE>
inline void panel_scales(const uint8_t* row, int64_t sb, float& dw, float& s0, float& s1,
                         float& mn, float& m0, float& m1) {
  s0 = s1 = 1.f;
  mn = m0 = m1 = 0.f;
  if constexpr (kK4<TYPE>) {
    const uint8_t* b = row + (sb >> 3) * kK4Bytes<TYPE>;
    int sc, m;
    k4_scale_min(b + 4, int(sb & 7), sc, m);
    dw = f16(b);
    s0 = s1 = float(sc);
    mn = f16(b + 2) * float(m);
  } else if constexpr (kS16<TYPE>) {
    const uint8_t* b = row + (sb >> 3) * kS16Bytes<TYPE>;
    s16_pair<TYPE>(b, int(sb & 7), s0, s1);
    dw = f16(b + kS16D<TYPE>);
  } else if constexpr (kGridHalves<TYPE>) {
    const uint8_t* b = row + sb * kBlockBytes<TYPE>;
    dw = f32_at(b);
    s0 = float(half_scale(b, 0));
    s1 = float(half_scale(b, 1));
  } else if constexpr (TYPE == kQ2_K) {
    const uint8_t* b = row + (sb >> 3) * kQ2KBytes;
    const uint8_t* sc = b + 2 * (sb & 7);
    dw = f16(b + 80);
    mn = f16(b + 82);
    s0 = float(sc[0] & 0xF);
    s1 = float(sc[1] & 0xF);
    m0 = float(sc[0] >> 4);
    m1 = float(sc[1] >> 4);
  } else {
    dw = block_scale<TYPE>(row + sb * kBlockBytes<TYPE>);
    if constexpr (kMin32<TYPE>) mn = -f16(row + sb * kBlockBytes<TYPE> + 2);
  }
}

// Rows k and k + 8 of 16 rows of 8 dwords (lanes 0-7 and 8-15 of r[k]) -> out[t]: dword t of
// the 16 rows. The 8 x 8 dword transpose in both 256-bit halves at once.
inline void transpose_panel(const __m512i* r, __m512i* out) {
  __m512i t[8], u[8];
  for (int k = 0; k < 4; k++) {
    t[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
    t[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
  }
  for (int k = 0; k < 2; k++) {  // rows 4k .. 4k + 3: dwords 0|4, 1|5, 2|6, 3|7 per 128 bits
    u[4 * k] = _mm512_unpacklo_epi64(t[4 * k], t[4 * k + 2]);
    u[4 * k + 1] = _mm512_unpackhi_epi64(t[4 * k], t[4 * k + 2]);
    u[4 * k + 2] = _mm512_unpacklo_epi64(t[4 * k + 1], t[4 * k + 3]);
    u[4 * k + 3] = _mm512_unpackhi_epi64(t[4 * k + 1], t[4 * k + 3]);
  }
  const __m512i lo = _mm512_set_epi64(13, 12, 5, 4, 9, 8, 1, 0);
  const __m512i hi = _mm512_set_epi64(15, 14, 7, 6, 11, 10, 3, 2);
  for (int d = 0; d < 4; d++) {
    out[d] = _mm512_permutex2var_epi64(u[d], lo, u[4 + d]);
    out[d + 4] = _mm512_permutex2var_epi64(u[d], hi, u[4 + d]);
  }
}

// A task's panel (one at a time, of this K): v (K/32 sub-blocks x 8 dwords x 16 rows), per
// sub-block and row dw, the halves' integer scales s (K/32 x 2 x 16), Q4_K's min mn (Q2_K's
// dmin) and Q2_K's halves' integer mins m2 (as s); rs: the int8 rows' scales.
struct PanelBuffers {
  std::vector<uint8_t> v;
  std::vector<float> dw, s, mn, m2;
  float rs[kPanelRows];
  bool row_scale = false;
  explicit PanelBuffers(int64_t K)
      : v(K / 32 * 512), dw(K / 32 * 16), s(K / 32 * 32), mn(K / 32 * 16), m2(K / 32 * 32) {}
};

// Weight rows n0 .. n0 + 15 of part p (rows past its end: zero) into the buffers.
template <int TYPE>
void pack_panel(const Part& p, int64_t n0, int64_t K, PanelBuffers& pb) {
  const int64_t nsub = K / 32, rows = std::min(kPanelRows, p.rows - n0);
  const uint8_t* row[kPanelRows];
  pb.row_scale = p.scale != nullptr;
  for (int64_t r = 0; r < kPanelRows; r++) {
    row[r] = r < rows ? p.w + (n0 + r) * p.row_bytes : nullptr;
    pb.rs[r] = r < rows && p.scale ? p.scale[n0 + r] : 1.f;
  }
  for (int64_t sb = 0; sb < nsub; sb++) {
    __m256i b[kPanelRows];
    for (int64_t r = 0; r < kPanelRows; r++) {
      float dw = 0.f, s0 = 0.f, s1 = 0.f, mn = 0.f, m0 = 0.f, m1 = 0.f;
      if (row[r]) {
        b[r] = panel_bytes<TYPE>(row[r], sb);
        panel_scales<TYPE>(row[r], sb, dw, s0, s1, mn, m0, m1);
      } else {
        b[r] = _mm256_setzero_si256();
      }
      pb.dw[sb * 16 + r] = dw;
      pb.s[sb * 32 + r] = s0;
      pb.s[sb * 32 + 16 + r] = s1;
      pb.mn[sb * 16 + r] = mn;
      pb.m2[sb * 32 + r] = m0;
      pb.m2[sb * 32 + 16 + r] = m1;
    }
    __m512i z[8], out[8];
    for (int k = 0; k < 8; k++)
      z[k] = _mm512_inserti64x4(_mm512_castsi256_si512(b[k]), b[k + 8], 1);
    transpose_panel(z, out);
    for (int t = 0; t < 8; t++) _mm512_storeu_si512(pb.v.data() + sb * 512 + t * 64, out[t]);
  }
}

#if defined(LADLE_QUANT_BF16)
// Rows n0 .. n0 + 15 of a Q4_0, Q5_0, Q4_1 or Q5_1 part as bf16_group's B tiles: its panel (u = q
// + bias, the block scale per row; Q4_1's and Q5_1's -m as the panel's min), then each sub-block
// through bf16_slots.
template <int TYPE>
void bf16_panel(const Part& p, int64_t n0, int64_t K, uint16_t* out) {
  thread_local std::unique_ptr<PanelBuffers> pb;
  if (!pb || int64_t(pb->v.size()) != K / 32 * 512) pb = std::make_unique<PanelBuffers>(K);
  pack_panel<TYPE>(p, n0, K, *pb);
  for (int64_t sb = 0; sb < K / 32; sb++) {
    const __m512 d = _mm512_loadu_ps(pb->dw.data() + sb * 16);
    const __m512 mn = _mm512_loadu_ps(pb->mn.data() + sb * 16);  // (Q4_1, Q5_1: -m)
    const __m512 c = kMin32<TYPE> ? _mm512_sub_ps(_mm512_setzero_ps(), mn)
                                  : _mm512_mul_ps(d, _mm512_set1_ps(-float(kPanelBias<TYPE>)));
    bf16_slots(pb->v.data() + sb * 512, d, c, out + sb * 512);
  }
}
#endif

// out (MR x 16) = MR activation rows from m0 times the packed panel, in the tiles' order.
template <int TYPE, int MR>
inline void panel_rows(const PanelBuffers& pb, const Act& a, int64_t m0, float (*out)[16]) {
  constexpr int32_t bias = kPanelBias<TYPE>;
  const int64_t K = a.K, nsub = K / 32;
  const uint8_t* v = pb.v.data();
  __m512 acc[MR];
  for (int m = 0; m < MR; m++) acc[m] = _mm512_setzero_ps();
  for (int64_t sb = 0; sb < nsub; sb++) {
    __m512i w[8];
    for (int t = 0; t < 8; t++) w[t] = _mm512_loadu_si512(v + sb * 512 + t * 64);
    const int16_t* hx = a.h + m0 * (K / 16) + sb * 2;  // row m's: hx[m * K / 16], [.. + 1]
    __m512 f[MR];
    if constexpr (kS16<TYPE> || TYPE == kQ2_K || kGridHalves<TYPE>) {
      // f = s_lo * I_lo + s_hi * I_hi, exact
      for (int hf = 0; hf < 2; hf++) {
        __m512i i[MR];
        for (int m = 0; m < MR; m++) i[m] = _mm512_set1_epi32(-bias * hx[m * (K / 16) + hf]);
#pragma GCC unroll 4
        for (int t = hf * 4; t < hf * 4 + 4; t++)
          for (int m = 0; m < MR; m++) {
            int32_t x4;
            std::memcpy(&x4, a.q + (m0 + m) * K + sb * 32 + 4 * t, 4);
            i[m] = _mm512_dpbusd_epi32(i[m], w[t], _mm512_set1_epi32(x4));
          }
        const __m512 s = _mm512_loadu_ps(pb.s.data() + sb * 32 + hf * 16);
        for (int m = 0; m < MR; m++)
          f[m] = hf == 0 ? _mm512_mul_ps(_mm512_cvtepi32_ps(i[m]), s)
                         : _mm512_fmadd_ps(_mm512_cvtepi32_ps(i[m]), s, f[m]);
      }
    } else {
      __m512i i[MR];
      for (int m = 0; m < MR; m++)
        i[m] = _mm512_set1_epi32(-bias * (hx[m * (K / 16)] + hx[m * (K / 16) + 1]));
#pragma GCC unroll 8
      for (int t = 0; t < 8; t++)
        for (int m = 0; m < MR; m++) {
          int32_t x4;
          std::memcpy(&x4, a.q + (m0 + m) * K + sb * 32 + 4 * t, 4);
          i[m] = _mm512_dpbusd_epi32(i[m], w[t], _mm512_set1_epi32(x4));
        }
      for (int m = 0; m < MR; m++) {
        f[m] = _mm512_cvtepi32_ps(i[m]);
        if constexpr (kK4<TYPE>) f[m] = _mm512_mul_ps(f[m], _mm512_loadu_ps(pb.s.data() + sb * 32));
      }
    }
    const __m512 dw = _mm512_loadu_ps(pb.dw.data() + sb * 16);
    for (int m = 0; m < MR; m++) {
      const int64_t row = m0 + m;
      acc[m] = _mm512_fmadd_ps(f[m], _mm512_mul_ps(dw, _mm512_set1_ps(a.d[row * nsub + sb])),
                               acc[m]);
      if constexpr (kHasMin<TYPE>)
        acc[m] = _mm512_fnmadd_ps(_mm512_loadu_ps(pb.mn.data() + sb * 16),
                                  _mm512_set1_ps(a.s[row * nsub + sb]), acc[m]);
      if constexpr (TYPE == kQ2_K) {  // Mi = m_lo * sum(x_lo) + m_hi * sum(x_hi), exact
        const int16_t* hm = hx + m * (K / 16);
        const __m512 mi = _mm512_fmadd_ps(
            _mm512_loadu_ps(pb.m2.data() + sb * 32 + 16), _mm512_set1_ps(float(hm[1])),
            _mm512_mul_ps(_mm512_loadu_ps(pb.m2.data() + sb * 32), _mm512_set1_ps(float(hm[0]))));
        acc[m] = _mm512_fnmadd_ps(mi, _mm512_mul_ps(_mm512_loadu_ps(pb.mn.data() + sb * 16),
                                                    _mm512_set1_ps(a.d[row * nsub + sb])), acc[m]);
      }
    }
  }
  for (int m = 0; m < MR; m++) _mm512_storeu_ps(out[m], acc[m]);
}

// Panel `i` (local to the part) for all M rows.
template <int TYPE, typename T>
void panel(const Part& p, int64_t i, const Act& a, int64_t M, T* y, int64_t ldy,
           PanelBuffers& pb) {
  const int64_t n0 = i * kPanelRows;
  pack_panel<TYPE>(p, n0, a.K, pb);
  float out[8][16];
  const int64_t valid = std::min(kPanelRows, p.rows - n0);
  for (int64_t m0 = 0; m0 < M;) {
    const int64_t left = M - m0;
    const int mr = left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
    switch (mr) {
      case 8: panel_rows<TYPE, 8>(pb, a, m0, out); break;
      case 4: panel_rows<TYPE, 4>(pb, a, m0, out); break;
      case 2: panel_rows<TYPE, 2>(pb, a, m0, out); break;
      default: panel_rows<TYPE, 1>(pb, a, m0, out); break;
    }
    for (int m = 0; m < mr; m++)
      for (int64_t n = 0; n < valid; n++)
        y[(m0 + m) * ldy + p.col + n0 + n] = T(pb.row_scale ? out[m][n] * pb.rs[n] : out[m][n]);
    m0 += mr;
  }
}

template <typename T>
void panel_any(const Part& p, int64_t i, const Act& a, int64_t M, T* y, int64_t ldy,
               PanelBuffers& pb, int ng = 1) {
  if (is_r16(p.type)) return r16_group_any(p, i, ng, a, M, y, ldy);  // packed at load
  for (int k = 0; k < ng; k++)
    with_type(p.type, [&](auto t) { panel<decltype(t)::value>(p, i + k, a, M, y, ldy, pb); });
}
#endif

// This build runs the repacked types (quant.py repacks at load only where it does).
constexpr bool kHasR16 =
#if defined(LADLE_QUANT_512)
    true;
#else
    false;
#endif

bool is_kernel_type(int64_t t) {
  return t == kQ4_0 || t == kQ4_1 || t == kQ5_0 || t == kQ5_1 || t == kQ8_0 || t == kQ2_K ||
         t == kQ3_K || t == kMXFP4 || t == kIQ4NL || t == kIQ4XS32 || t == kQ4_K || t == kQ5_K ||
         t == kQ6_K || t == kI8 || (is_r16(int(t)) && kHasR16) ||
         ((t == kIQ2XXS32 || t == kIQ3XXS32 || t == kIQ3S32 || t == kIQ2XS32 ||
           t == kIQ2S32) &&
          g_iq_ready.load(std::memory_order_acquire));
}

// The Hadamard rotation of `--quantization int8` (models/int8.py): each block of B values of a
// row (B a power of two, 32 <= B <= 1024, dividing K) times the B x B Hadamard matrix of +-1,
// then times 2^-(log2(B) / 2, rounded down), into a new tensor of x's dtype. The butterflies
// in float32 in a fixed order, stage h = 1, 2, 4, ... B/2 taking (a, b) at (j, j + h) to
// (a + b, a - b): runner/quant.py's rotate_rows_torch does the same operations, so the bits
// are equal. Weights rotated at load by the same transform (scaled to undo B) give
// x W^T = rot(x) rot(W)^T exactly in real numbers, while an outlier channel of x is spread
// over its block, so int8 per block loses less.
#if defined(LADLE_QUANT_512)
// Stages h = 1 .. 8 inside each of N vectors of 16 values (the partner j ^ h by a lane permute;
// lanes with bit h set take partner - self, a - b, the others self + partner, a + b), then
// h = 16 .. 8N between the vectors: a chunk of 16N values in registers.
template <int N>
__attribute__((always_inline)) inline void rotate_in_registers(__m512* r) {
  const __m512i partner[4] = {
      _mm512_setr_epi32(1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14),
      _mm512_setr_epi32(2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13),
      _mm512_setr_epi32(4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11),
      _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7)};
  // r +- p as one fused r * (+-1) + p: the product is exact, so the sum rounds once, as r + p
  // and p - r do (two operations a vector and stage where add, sub and blend took four).
  const __m512 sign[4] = {
      _mm512_setr_ps(1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1),
      _mm512_setr_ps(1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1),
      _mm512_setr_ps(1, 1, 1, 1, -1, -1, -1, -1, 1, 1, 1, 1, -1, -1, -1, -1),
      _mm512_setr_ps(1, 1, 1, 1, 1, 1, 1, 1, -1, -1, -1, -1, -1, -1, -1, -1)};
  // Every loop unrolled, so r stays in registers (rolled, GCC kept r on the stack for the
  // stages across vectors: a load and a store per value and stage).
#pragma GCC unroll 4
  for (int s = 0; s < 4; s++)
#pragma GCC unroll 16
    for (int i = 0; i < N; i++)
      r[i] = _mm512_fmadd_ps(r[i], sign[s], _mm512_permutexvar_ps(partner[s], r[i]));
#pragma GCC unroll 4
  for (int h = 1; h < N; h *= 2)
#pragma GCC unroll 8
    for (int i = 0; i < N; i += 2 * h)
#pragma GCC unroll 8
      for (int j = i; j < i + h; j++) {
        const __m512 a = r[j], b = r[j + h];
        r[j] = _mm512_add_ps(a, b);
        r[j + h] = _mm512_sub_ps(a, b);
        // Each stage's sums as computed: unrolled, the build's -fassociative-math would
        // otherwise regroup a chain of stages (other bits than the twin's).
        asm("" : "+v"(r[j]), "+v"(r[j + h]));
      }
}

// 16 floats times `sc`, rounded to T (to nearest even, as T(float) rounds) and stored.
template <typename T>
__attribute__((always_inline)) inline void store_scaled(T* out, __m512 r, __m512 sc) {
  store_round(out, _mm512_mul_ps(r, sc));
}

// One block of B values of float32 or bfloat16: chunks of up to 256 in registers, the stages
// past 128 (B of 512, 1024) over a float32 copy.
template <typename T, typename O, int N>
void rotate_block_512(const T* x, O* out, int64_t B, float scale, float* v) {
  const __m512 sc = _mm512_set1_ps(scale);
  for (int64_t c = 0; c < B; c += 16 * N) {
    __m512 r[N];
    for (int i = 0; i < N; i++) r[i] = load16(x + c + 16 * i);
    rotate_in_registers<N>(r);
    for (int i = 0; i < N; i++) {
      if (B == 16 * N)
        store_scaled(out + c + 16 * i, r[i], sc);
      else
        _mm512_store_ps(v + c + 16 * i, r[i]);
    }
  }
  if (B == 16 * N) return;
  for (int64_t h = 16 * N; h < B; h *= 2)
    for (int64_t i = 0; i < B; i += 2 * h)
      for (int64_t j = i; j < i + h; j += 16) {
        const __m512 a = _mm512_load_ps(v + j), b = _mm512_load_ps(v + j + h);
        _mm512_store_ps(v + j, _mm512_add_ps(a, b));
        _mm512_store_ps(v + j + h, _mm512_sub_ps(a, b));
      }
  for (int64_t i = 0; i < B; i += 16) store_scaled(out + i, _mm512_load_ps(v + i), sc);
}
#endif

// The rotation's scale for blocks of B (a power of two): 2^-(log2(B) / 2) rounded down, a power
// of two, so exact (quant.py's rotate_rows).
inline float rotation_scale(int64_t B) {
  int log2b = 0;
  while ((int64_t(1) << log2b) < B) log2b++;
  return std::ldexp(1.f, -(log2b / 2));
}

template <typename T, typename O>
void rotate_row_blocks(const T* x, O* out, int64_t K, int64_t B, float scale) {
  alignas(64) float v[1024];
  for (int64_t b0 = 0; b0 < K; b0 += B) {
#if defined(LADLE_QUANT_512)
    if constexpr ((std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16>) &&
                  (std::is_same_v<O, float> || std::is_same_v<O, at::BFloat16>)) {
      switch (B) {
        case 32: rotate_block_512<T, O, 2>(x + b0, out + b0, B, scale, v); break;
        case 64: rotate_block_512<T, O, 4>(x + b0, out + b0, B, scale, v); break;
        case 128: rotate_block_512<T, O, 8>(x + b0, out + b0, B, scale, v); break;
        default: rotate_block_512<T, O, 16>(x + b0, out + b0, B, scale, v); break;
      }
      continue;
    }
#endif
    for (int64_t i = 0; i < B; i++) v[i] = static_cast<float>(x[b0 + i]);
    for (int64_t h = 1; h < B; h *= 2)
      for (int64_t i = 0; i < B; i += 2 * h)
        for (int64_t j = i; j < i + h; j++) {
          const float a = v[j], b = v[j + h];
          v[j] = a + b;
          v[j + h] = a - b;
        }
    for (int64_t i = 0; i < B; i++) out[b0 + i] = O(v[i] * scale);
  }
}

#if defined(LADLE_QUANT_512)
// Rotated int8 rows (`--quantization int8`) from kTokenMinRows activation rows, outside
// batch-invariant mode: the activations quantized per token (one scale per row over all of K,
// which the rotation makes nearly as accurate as per block of 32: Gemma 3 270M's top-1
// agreement with bf16 96.1% against 95.3% for the dequantizing path, mean KL 0.0052 against
// 0.0037), so each output is one int32 sum over K with no float step per sub-block (what bounds
// amx_block and r16_rows), the weights read as stored: signed activations times the repacked
// unsigned w + 128, the 128 x sum(q) of each row taken off after. On AMX-INT8 the C tiles
// accumulate all of K (TDPBSUD, 64 values per product; token_groups); on AVX-512 VNNI alone
// (Zen 4, Ice Lake) vpdpbusd does (token_groups_512). Both reach the same integers, then
// y = float(I) * (d_row * scale[n]) (token_out; quant.py's token_reference): the two
// paths give the same bits.
constexpr int64_t kTokenMinRows = 4;
// The int32 sums hold K x 255 x 127 at most: past this K the per-block paths run.
constexpr int64_t kTokenMaxK = 65536;

// Row `row`'s 16 outputs at out from their integer sums I (before the bias): the one float step,
// float(I) x (d_row x scale[n]). The build's -fassociative-math may reorder a product of three
// as it likes in each caller (the vector path had become I x (d x s), the tile path (I x d) x s:
// one float32 rounding apart), so the scales' product is made opaque to the optimizer first.
inline __m512 token_value(__m512i I, int32_t sum, float d, __m512 sw) {
  const __m512i v = _mm512_sub_epi32(I, _mm512_set1_epi32(128 * sum));
  __m512 ds = _mm512_mul_ps(_mm512_set1_ps(d), sw);
  asm("" : "+v"(ds));
  return _mm512_mul_ps(_mm512_cvtepi32_ps(v), ds);
}
template <typename T>
inline void token_out(__m512i I, int32_t sum, float d, __m512 sw, T* out) {
  store_round(out, token_value(I, sum, d, sw));
}

#if defined(LADLE_QUANT_AMX)
// A tiles 0, 1 (16 activation rows x 64 bytes), B tiles 2, 3 (64 values of 16 repacked rows:
// 16 x 64 bytes, two sub-blocks), C tiles 4 .. 7.
struct alignas(64) AmxTokenConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};
#endif

// Row x (K values) rotated in blocks of B (K a multiple of B) into v, without the rotation's
// scale (a power of two, which the caller applies to the max): rotate_block_512's stages in its
// order, the stages past the registers' (B of 512, 1024) in place in v, both of 1024's in one
// pass. Returns max |v| (NaN counting as 0), taken in the pass that writes v last: two passes
// over the row fewer for B = 1024 (with rotate_in_registers unrolled, 128 x 1024 of the 0.6B:
// 41 -> 32 us a call, alternating in one process).
template <typename T>
float rotate_row_unscaled(const T* x, float* v, int64_t K, int64_t B) {
  // max_ps(a, mx) returns mx where a is NaN (vmaxps gives its second operand then)
  __m512 mx = _mm512_setzero_ps();
  for (int64_t b0 = 0; b0 < K; b0 += B) {
    float* w = v + b0;
    auto chunks = [&](auto n) {
      constexpr int N = decltype(n)::value;
      for (int64_t c = 0; c < B; c += 16 * N) {
        __m512 r[N];
        for (int i = 0; i < N; i++) r[i] = load16(x + b0 + c + 16 * i);
        rotate_in_registers<N>(r);
        for (int i = 0; i < N; i++) _mm512_storeu_ps(w + c + 16 * i, r[i]);
      }
    };
    switch (B) {
      case 32: chunks(std::integral_constant<int, 2>{}); break;
      case 64: chunks(std::integral_constant<int, 4>{}); break;
      case 128: chunks(std::integral_constant<int, 8>{}); break;
      default: chunks(std::integral_constant<int, 16>{}); break;
    }
    int64_t h = 256;
    for (; 4 * h < B; h *= 2)  // the stages before the last one or two
      for (int64_t i = 0; i < B; i += 2 * h)
        for (int64_t j = i; j < i + h; j += 16) {
          const __m512 a = _mm512_loadu_ps(w + j), b = _mm512_loadu_ps(w + j + h);
          _mm512_storeu_ps(w + j, _mm512_add_ps(a, b));
          _mm512_storeu_ps(w + j + h, _mm512_sub_ps(a, b));
        }
    __m512 m = mx;
    if (4 * h == B) {  // stages h and 2h together: four values in registers
      for (int64_t j = 0; j < h; j += 16) {
        const __m512 a = _mm512_loadu_ps(w + j), b = _mm512_loadu_ps(w + j + h);
        const __m512 c = _mm512_loadu_ps(w + j + 2 * h), e = _mm512_loadu_ps(w + j + 3 * h);
        __m512 a1 = _mm512_add_ps(a, b), b1 = _mm512_sub_ps(a, b);
        __m512 c1 = _mm512_add_ps(c, e), e1 = _mm512_sub_ps(c, e);
        asm("" : "+v"(a1), "+v"(b1), "+v"(c1), "+v"(e1));  // (rotate_in_registers' barrier)
        const __m512 o0 = _mm512_add_ps(a1, c1), o2 = _mm512_sub_ps(a1, c1);
        const __m512 o1 = _mm512_add_ps(b1, e1), o3 = _mm512_sub_ps(b1, e1);
        _mm512_storeu_ps(w + j, o0);
        _mm512_storeu_ps(w + j + h, o1);
        _mm512_storeu_ps(w + j + 2 * h, o2);
        _mm512_storeu_ps(w + j + 3 * h, o3);
        m = _mm512_max_ps(_mm512_abs_ps(o0), m);
        m = _mm512_max_ps(_mm512_abs_ps(o1), m);
        m = _mm512_max_ps(_mm512_abs_ps(o2), m);
        m = _mm512_max_ps(_mm512_abs_ps(o3), m);
      }
    } else if (2 * h == B) {  // the last stage alone
      for (int64_t j = 0; j < h; j += 16) {
        const __m512 a = _mm512_loadu_ps(w + j), b = _mm512_loadu_ps(w + j + h);
        const __m512 o0 = _mm512_add_ps(a, b), o1 = _mm512_sub_ps(a, b);
        _mm512_storeu_ps(w + j, o0);
        _mm512_storeu_ps(w + j + h, o1);
        m = _mm512_max_ps(_mm512_abs_ps(o0), m);
        m = _mm512_max_ps(_mm512_abs_ps(o1), m);
      }
    } else {  // every stage was in the registers
      for (int64_t j = 0; j < B; j += 16)
        m = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(w + j)), m);
    }
    mx = m;
  }
  return _mm512_reduce_max_ps(mx);
}

// Per row of x (M, K) rotated in float32 (rotate_row_blocks, blocks of `block`: x'), the rule
// of quantize_into over the whole row: d = max|x'| / 127, q = round-half-even(x' * (127 /
// max|x'|)) (0 for an all-zero row; NaN counts as 0 in the max), sum = sum(q); q written
// straight into the A tiles' layout (sixteen r, chunk c of 64 values at (r * K / 64 + c) * 1024,
// 64 bytes a row), the rows past M up to a whole sixteen zero. The rotation's power-of-two scale
// s is not applied to each value: with v the unscaled rotation (x' = s v exactly), max|x'| = s
// max|v| and x' * c = v * (s c) exactly, so q, d and sum are those of x'.
template <typename T>
void token_activations(const T* x, int64_t M, int64_t K, int64_t block, int8_t* qt, float* d,
                       int32_t* sum) {
  const int64_t chunks = K / 64, Mp = (M + 15) / 16 * 16;
  const float scale = rotation_scale(block);
  at::parallel_for(0, Mp, grain_for(K * kElementWork), [&](int64_t m0, int64_t m1) {
    std::vector<float> buf(static_cast<size_t>(K));
    float* v = buf.data();
    for (int64_t m = m0; m < m1; m++) {
      int8_t* dst = qt + m / 16 * chunks * 1024 + m % 16 * 64;
      if (m >= M) {
        for (int64_t c = 0; c < chunks; c++) std::memset(dst + c * 1024, 0, 64);
        continue;
      }
      const float amax = rotate_row_unscaled(x + m * K, v, K, block) * scale;
      const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax * scale : 0.f);
      constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
      __m512i total = _mm512_setzero_si512();
      for (int64_t k = 0; k < K; k += 16) {
        const __m512i r =
            _mm512_cvt_roundps_epi32(_mm512_mul_ps(_mm512_loadu_ps(v + k), inv), kRound);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + k / 64 * 1024 + k % 64),
                         _mm512_cvtepi32_epi8(r));
        total = _mm512_add_epi32(total, r);
      }
      d[m] = amax / 127.f;
      sum[m] = _mm512_reduce_add_epi32(total);
    }
  });
}

#if defined(LADLE_QUANT_AMX)
// Groups g0 .. g1 - 1 of part p (16 rows each; the part's rows a multiple of 16) for all M rows
// of qt (tile_activations' layout with 64-byte rows: sixteen r, chunk c at (r * K / 64 + c) *
// 1024), two sixteens of rows by two groups per product. K in blocks of kTokenChunks chunks and
// rows in blocks of kTokenPairs pairs of sixteens: the two groups' weights of a K block (16 KB)
// stay in L1 while every pair of the row block passes, their C tiles parked in L1 between K
// blocks (from L2 on every pass, the tile loads bounded the products: 0.6B gate|up at 128 rows
// 0.57 ms, 28% of the tile unit's rate).
constexpr int64_t kTokenChunks = 8, kTokenPairs = 8;

template <typename T>
void token_groups(const Part& p, int64_t g0, int64_t g1, const int8_t* qt, const float* d,
                  const int32_t* sum, int64_t M, int64_t K, T* y, int64_t ldy,
                  const uint8_t* next) {
  const int64_t chunks = K / 64, sixteens = (M + 15) / 16, pairs = (sixteens + 1) / 2;
  alignas(64) int32_t parked[kTokenPairs][4][256];
  alignas(64) int32_t c[4][256];
  for (int64_t g = g0; g < g1; g += 2) {
    const int ng = int(std::min<int64_t>(2, g1 - g));
    const uint8_t* w0 = p.w + g * 16 * p.row_bytes;
    const uint8_t* w1 = ng > 1 ? w0 + 16 * p.row_bytes : w0;
    for (int64_t pr0 = 0; pr0 < pairs; pr0 += kTokenPairs) {
      const int64_t pr1 = std::min(pairs, pr0 + kTokenPairs);
      for (int64_t k0 = 0; k0 < chunks; k0 += kTokenChunks) {
        const int64_t k1 = std::min(chunks, k0 + kTokenChunks);
        const bool last = k1 == chunks;
        // The next K block's weights (or the next groups' first), spread over this block's
        // steps into L2: a tile load of bytes from memory stalls the products (into L2, not
        // L1: the 0.6B's 112 linears at 128 rows 38.6 -> 37.4 ms, alternating in one process).
        const uint8_t* pf0 = nullptr;
        const uint8_t* pf1 = nullptr;
        int64_t pf_lines = 0;
        if (!last) {
          pf0 = w0 + k1 * 1024, pf1 = w1 + k1 * 1024;
          pf_lines = std::min(kTokenChunks, chunks - k1) * 16;
        } else if (pr1 == pairs && next) {
          pf0 = next, pf1 = next + 16 * p.row_bytes;
          pf_lines = std::min(kTokenChunks, chunks) * 16;
        }
        const int64_t steps = (pr1 - pr0) * (k1 - k0);
        const int64_t per_step = (pf_lines + steps - 1) / steps;
        int64_t pf = 0;
        for (int64_t pr = pr0; pr < pr1; pr++) {
          const int64_t r = 2 * pr;
          const int nr = int(std::min<int64_t>(2, sixteens - r));
          const int8_t* a0 = qt + r * chunks * 1024;
          const int8_t* a1 = nr > 1 ? a0 + chunks * 1024 : a0;
          int32_t (*park)[256] = parked[pr - pr0];
          if (k0 == 0) {
            _tile_zero(4);
            _tile_zero(5);
            _tile_zero(6);
            _tile_zero(7);
          } else {
            _tile_loadd(4, park[0], 64);
            _tile_loadd(5, park[1], 64);
            _tile_loadd(6, park[2], 64);
            _tile_loadd(7, park[3], 64);
          }
          for (int64_t k = k0; k < k1; k++) {
            for (int64_t e = std::min(pf_lines, pf + per_step); pf < e; pf++) {
              _mm_prefetch(reinterpret_cast<const char*>(pf0 + pf * 64), _MM_HINT_T1);
              _mm_prefetch(reinterpret_cast<const char*>(pf1 + pf * 64), _MM_HINT_T1);
            }
            _tile_loadd(0, a0 + k * 1024, 64);
            _tile_loadd(2, w0 + k * 1024, 64);
            _tile_loadd(3, w1 + k * 1024, 64);
            _tile_loadd(1, a1 + k * 1024, 64);
            _tile_dpbsud(4, 0, 2);
            _tile_dpbsud(5, 0, 3);
            _tile_dpbsud(6, 1, 2);
            _tile_dpbsud(7, 1, 3);
          }
          int32_t (*to)[256] = last ? c : park;
          _tile_stored(4, to[0], 64);
          _tile_stored(5, to[1], 64);
          _tile_stored(6, to[2], 64);
          _tile_stored(7, to[3], 64);
          if (!last) continue;
          if (ng == 2) {  // two groups side by side: each row's 32 outputs in one store
            const int64_t n = g * 16;
            const __m512 sw0 = _mm512_loadu_ps(p.scale + n);
            const __m512 sw1 = _mm512_loadu_ps(p.scale + n + 16);
            T* out = y + p.col + n;
            for (int i = 0; i < nr; i++)
              for (int m = 0; m < 16; m++) {
                const int64_t row = (r + i) * 16 + m;
                if (row >= M) break;
                const int32_t* ci = c[2 * i] + 16 * m;
                const int32_t* cj = c[2 * i + 1] + 16 * m;
                store_round2(out + row * ldy,
                             token_value(_mm512_load_si512(ci), sum[row], d[row], sw0),
                             token_value(_mm512_load_si512(cj), sum[row], d[row], sw1));
              }
            continue;
          }
          for (int i = 0; i < nr; i++)
            for (int j = 0; j < ng; j++) {
              const int64_t n = (g + j) * 16;
              const __m512 sw = _mm512_loadu_ps(p.scale + n);
              T* out = y + p.col + n;
              for (int m = 0; m < 16; m++) {
                const int64_t row = (r + i) * 16 + m;
                if (row >= M) break;
                token_out(_mm512_load_si512(c[2 * i + j] + 16 * m), sum[row], d[row], sw,
                          out + row * ldy);
              }
            }
        }
      }
    }
  }
}

#endif

// Without the tile unit: a unit's NG groups by blocks of R activation rows (8, or 4 for a last
// block of 4 or fewer) in int32 accumulators over all of K, each dword slot of the repacked
// weights (64 bytes: 4 values of 16 rows) loaded once for the R rows, each row's 4 activation
// bytes broadcast once for the NG groups. A unit's weights (32 x K bytes: 96 KB for the 0.6B's
// down) stay in L2 while its row blocks pass; the next unit's are prefetched into L2 over this
// one's steps. Zen 4, 2 threads, weights in L3, 128 rows: the 0.6B's gate|up 403-421 G
// multiply-adds/s (torch._int_mm's int8 GEMM in the same run: 443), down 335-385.
template <int R, int NG, typename T>
void token_rows_512(const Part& p, int64_t g, const int8_t* qt, const float* d,
                    const int32_t* sum, int64_t M, int64_t K, int64_t m0, T* y, int64_t ldy,
                    const uint8_t* next, int64_t& pf, int64_t lines, int64_t per_step) {
  // Rows m0 .. m0 + R - 1, inside one sixteen of qt (rows past M are its zero padding).
  const int64_t chunks = K / 64;
  const int8_t* a = qt + m0 / 16 * chunks * 1024 + m0 % 16 * 64;
  const uint8_t* w[NG];
  for (int j = 0; j < NG; j++) w[j] = p.w + (g + j) * 16 * p.row_bytes;
  __m512i acc[R][NG];
  for (int m = 0; m < R; m++)
    for (int j = 0; j < NG; j++) acc[m][j] = _mm512_setzero_si512();
  for (int64_t c = 0; c < chunks; c++) {
    for (int64_t e = std::min(lines, pf + per_step); pf < e; pf++)
      _mm_prefetch(reinterpret_cast<const char*>(next + pf * 64), _MM_HINT_T1);
    const int8_t* ac = a + c * 1024;
#pragma GCC unroll 16
    for (int t = 0; t < 16; t++) {
      __m512i wv[NG];
      for (int j = 0; j < NG; j++) wv[j] = _mm512_loadu_si512(w[j] + c * 1024 + t * 64);
      for (int m = 0; m < R; m++) {
        int32_t x4;
        std::memcpy(&x4, ac + m * 64 + 4 * t, 4);
        const __m512i xb = _mm512_set1_epi32(x4);
        for (int j = 0; j < NG; j++) acc[m][j] = _mm512_dpbusd_epi32(acc[m][j], wv[j], xb);
      }
    }
  }
  for (int j = 0; j < NG; j++) {
    const int64_t n = (g + j) * 16;
    const __m512 sw = _mm512_loadu_ps(p.scale + n);
    T* out = y + p.col + n;
    for (int m = 0; m < R && m0 + m < M; m++)
      token_out(acc[m][j], sum[m0 + m], d[m0 + m], sw, out + (m0 + m) * ldy);
  }
}

template <int NG, typename T>
void token_groups_512(const Part& p, int64_t g, const int8_t* qt, const float* d,
                      const int32_t* sum, int64_t M, int64_t K, T* y, int64_t ldy,
                      const uint8_t* next, int64_t next_bytes) {
  const int64_t blocks = (M + 7) / 8, lines = next ? next_bytes / 64 : 0;
  const int64_t per_step = (lines + blocks * (K / 64) - 1) / (blocks * (K / 64));
  int64_t pf = 0;
  for (int64_t m0 = 0; m0 < M; m0 += 8) {
    if (M - m0 > 4)
      token_rows_512<8, NG>(p, g, qt, d, sum, M, K, m0, y, ldy, next, pf, lines, per_step);
    else
      token_rows_512<4, NG>(p, g, qt, d, sum, M, K, m0, y, ldy, next, pf, lines, per_step);
  }
}

// The call when every part is int8 rows repacked by 16 and the weights were rotated in blocks
// of `rotation` (x as given, not rotated): true if it ran.
template <typename T, typename X>
bool token_matmul(const std::vector<Part>& parts, const X* x, int64_t M, int64_t K,
                  int64_t rotation, T* y, int64_t ldy) {
  if (M < kTokenMinRows || K % 64 || K > kTokenMaxK ||
      !std::all_of(parts.begin(), parts.end(), [](const Part& p) { return p.type == kI8R; }))
    return false;
  const int64_t Mp = (M + 15) / 16 * 16;
  // Not zeroed here (token_activations writes every byte, the padding rows' too): a zeroing
  // std::vector cost a memset of 128-384 KB a call.
  std::unique_ptr<int8_t[]> qt_buf(new int8_t[static_cast<size_t>(Mp * K)]);
  int8_t* qt_data = qt_buf.get();
  std::vector<float> d(static_cast<size_t>(M));
  std::vector<int32_t> sum(static_cast<size_t>(M));
  token_activations(x, M, K, rotation, qt_data, d.data(), sum.data());
  std::vector<std::pair<const Part*, int64_t>> units;  // (part, first group of two)
  for (const Part& p : parts)
    for (int64_t g = 0; g < p.rows / 16; g += 2) units.emplace_back(&p, g);
  auto groups = [&](int64_t i) {  // unit i's: 2, or 1 at a part's odd end
    return int(std::min<int64_t>(2, units[size_t(i)].first->rows / 16 - units[size_t(i)].second));
  };
  auto first_row = [&](int64_t i) {  // unit i's first weight byte
    return units[size_t(i)].first->w + units[size_t(i)].second * 16 * units[size_t(i)].first->row_bytes;
  };
#if defined(LADLE_QUANT_AMX)
  const bool amx = amx_active();
#endif
  at::parallel_for(0, int64_t(units.size()), 1, [&](int64_t i0, int64_t i1) {
#if defined(LADLE_QUANT_AMX)
    if (amx) {
      static const AmxTokenConfig config;
      _tile_loadconfig(&config);
      for (int64_t i = i0; i < i1; i++) {
        const Part& p = *units[size_t(i)].first;
        const int64_t g = units[size_t(i)].second;
        token_groups(p, g, g + groups(i), qt_data, d.data(), sum.data(), M, K, y, ldy,
                     i + 1 < i1 ? first_row(i + 1) : nullptr);
      }
      _tile_release();
      return;
    }
#endif
    for (int64_t i = i0; i < i1; i++) {
      const Part& p = *units[size_t(i)].first;
      const int64_t g = units[size_t(i)].second;
      const uint8_t* next = i + 1 < i1 ? first_row(i + 1) : nullptr;
      const int64_t next_bytes = next ? groups(i + 1) * 16 * units[size_t(i + 1)].first->row_bytes : 0;
      if (groups(i) == 2)
        token_groups_512<2>(p, g, qt_data, d.data(), sum.data(), M, K, y, ldy, next, next_bytes);
      else
        token_groups_512<1>(p, g, qt_data, d.data(), sum.data(), M, K, y, ldy, next, next_bytes);
    }
  });
  return true;
}
#endif

// Per block of 32 of x (M, K): d = max|x| / 127, q = round-half-even(x * (127 / max|x|)) (0 for
// an all-zero block), s = d * sum(q). The same float32 operations as the twin, so q is
// bit-identical.
template <typename scalar_t>
void quantize_into(const scalar_t* xp, int64_t M, int64_t K, int8_t* qp, float* dp, float* sp,
                   int16_t* hp, int32_t* bp, int32_t* cp) {
  const int64_t nb = K / 32;
  at::parallel_for(0, M * nb, grain_for(32 * kElementWork), [&](int64_t b0, int64_t b1) {
#if defined(LADLE_QUANT_512)
    // 32 values in two vectors (1.19 -> 0.1 ms for a 0.6B layer's four inputs of 128 rows,
    // where the scalar loop below took a quarter of the int8 linears' time). NaN lanes count
    // as 0 in the max, as std::max skips them.
    if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, at::BFloat16>) {
      for (int64_t b = b0; b < b1; b++) {
        const scalar_t* xb = xp + b * 32;
        const __m512 v0 = load16(xb), v1 = load16(xb + 16);
        const __m512 a0 = _mm512_abs_ps(v0), a1 = _mm512_abs_ps(v1);
        const __m512 m = _mm512_max_ps(_mm512_maskz_mov_ps(_mm512_cmp_ps_mask(a0, a0, _CMP_ORD_Q), a0),
                                       _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(a1, a1, _CMP_ORD_Q), a1));
        const float amax = _mm512_reduce_max_ps(m);
        const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
        constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
        const __m512i r0 = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(v0, inv), kRound));
        const __m512i r1 = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(v1, inv), kRound));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(qp + b * 32), _mm512_cvtepi32_epi8(r0));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(qp + b * 32 + 16), _mm512_cvtepi32_epi8(r1));
        const int32_t h0 = _mm512_reduce_add_epi32(r0), h1 = _mm512_reduce_add_epi32(r1);
        hp[2 * b] = int16_t(h0);
        hp[2 * b + 1] = int16_t(h1);
        bp[b] = -128 * (h0 + h1);
        cp[2 * b] = -32 * h0;
        cp[2 * b + 1] = -32 * h1;
        dp[b] = amax / 127.f;
        sp[b] = dp[b] * float(h0 + h1);
      }
      return;
    }
#endif
    for (int64_t b = b0; b < b1; b++) {
      const scalar_t* xb = xp + b * 32;
      float v[32], amax = 0.f;
      for (int i = 0; i < 32; i++) {
        v[i] = to_f(xb[i]);
        amax = std::max(amax, std::fabs(v[i]));
      }
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      int32_t half[2] = {0, 0};
      for (int i = 0; i < 32; i++) {
        const int32_t r = int32_t(std::nearbyint(v[i] * inv));
        qp[b * 32 + i] = int8_t(r);
        half[i >> 4] += r;
      }
      hp[2 * b] = int16_t(half[0]);
      hp[2 * b + 1] = int16_t(half[1]);
      bp[b] = -128 * (half[0] + half[1]);
      cp[2 * b] = -32 * half[0];
      cp[2 * b + 1] = -32 * half[1];
      dp[b] = amax / 127.f;
      sp[b] = dp[b] * float(half[0] + half[1]);
    }
  });
}

}  // namespace

// x (M, K) float32/bfloat16 -> (q int8 (M, K), d (M, K/32), s (M, K/32)): the activations as
// quant_matmul quantizes them (quantize_into).
std::vector<at::Tensor> quantize_blocks(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 32 == 0,
              "x must be contiguous (M, K) with K a multiple of 32");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "x must be float32 or bfloat16");
  const int64_t M = x.size(0), K = x.size(1);
  auto q = at::empty({M, K}, x.options().dtype(at::kChar));
  auto d = at::empty({M, K / 32}, x.options().dtype(at::kFloat));
  auto s = at::empty({M, K / 32}, x.options().dtype(at::kFloat));
  auto h = at::empty({M, K / 16}, x.options().dtype(at::kShort));
  auto b = at::empty({M, K / 32}, x.options().dtype(at::kInt));
  auto c = at::empty({M, K / 16}, x.options().dtype(at::kInt));
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "quantize_blocks", [&] {
    quantize_into(x.data_ptr<scalar_t>(), M, K, q.data_ptr<int8_t>(), d.data_ptr<float>(),
                  s.data_ptr<float>(), h.data_ptr<int16_t>(), b.data_ptr<int32_t>(),
                  c.data_ptr<int32_t>());
  });
  return {q, d, s};
}

// y (M, N) (a view: unit column stride, any row stride) = x @ W^T for the weight parts
// ws[i] of types[i] (a GGUF block type, or -1: int8 rows times scales[i] (rows,) float32;
// other parts pass an empty scale), whose rows give y's columns cols[i] ... Columns no part
// covers are left as they are (the caller's dense parts).
void quant_matmul(const at::Tensor& x, const std::vector<at::Tensor>& ws,
                  const std::vector<int64_t>& types, const std::vector<at::Tensor>& scales,
                  const std::vector<int64_t>& cols, at::Tensor y, bool invariant,
                  int64_t rotation) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 32 == 0,
              "x must be contiguous (M, K) with K a multiple of 32");
  TORCH_CHECK(rotation == 0 || (rotation >= 32 && rotation <= 1024 &&
                                (rotation & (rotation - 1)) == 0 && x.size(1) % rotation == 0),
              "rotation must be 0 or a power of two in [32, 1024] dividing K ", x.size(1),
              ", got ", rotation);
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "x must be float32 or bfloat16");
  TORCH_CHECK(ws.size() == types.size() && ws.size() == scales.size() && ws.size() == cols.size(),
              "one type, scale and column per weight part");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(y.dim() == 2 && y.size(0) == M && y.stride(1) == 1,
              "out must be (M, N) with unit column stride");
  TORCH_CHECK(y.scalar_type() == at::kFloat || y.scalar_type() == at::kBFloat16,
              "out must be float32 or bfloat16");
  const int64_t N = y.size(1);
  std::vector<Part> parts;
  int64_t tiles = 0;
  for (size_t i = 0; i < ws.size(); i++) {
    const at::Tensor& w = ws[i];
    const int64_t type = types[i];
    TORCH_CHECK(is_kernel_type(type), "quant_matmul: unsupported weight type ", type);
    TORCH_CHECK(K % block_values(int(type)) == 0, "K must be a multiple of the block");
    const int64_t row_bytes = K / block_values(int(type)) * block_bytes(int(type));
    TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.element_size() == 1 &&
                    w.size(1) == row_bytes, "weight part ", i, " must be contiguous (rows, ",
                row_bytes, ") bytes");
    TORCH_CHECK(cols[i] >= 0 && cols[i] + w.size(0) <= N, "weight part ", i, " outside out");
    const float* sc = nullptr;
    if (type == kI8 || type == kI8R) {
      TORCH_CHECK(scales[i].scalar_type() == at::kFloat && scales[i].is_contiguous() &&
                      scales[i].numel() == w.size(0), "int8 part ", i, " needs a float32 scale per row");
      sc = scales[i].data_ptr<float>();
    }
    TORCH_CHECK(!is_r16(int(type)) || w.size(0) % 16 == 0, "weight part ", i,
                " (repacked by 16 rows) must have a multiple of 16 rows");
    const int64_t unit = is_r16(int(type)) ? 16 : kNR;  // a tile's rows (a repacked part: groups)
    const int64_t t = (w.size(0) + unit - 1) / unit;
    parts.push_back({static_cast<const uint8_t*>(w.data_ptr()), int(type), w.size(0), row_bytes,
                     cols[i], sc, tiles, t});
    tiles += t;
  }
  if (M == 0 || tiles == 0) return;
  const int64_t ldy = y.stride(0);
#if defined(LADLE_QUANT_512)
  if (rotation && !invariant) {
    auto run = [&](auto* yp) {  // (x and out: float32 or bfloat16, checked above)
      return x.scalar_type() == at::kBFloat16
                 ? token_matmul(parts, x.data_ptr<at::BFloat16>(), M, K, rotation, yp, ldy)
                 : token_matmul(parts, x.data_ptr<float>(), M, K, rotation, yp, ldy);
    };
    if (y.scalar_type() == at::kBFloat16 ? run(y.data_ptr<at::BFloat16>())
                                         : run(y.data_ptr<float>()))
      return;
  }
#endif
  // Rotated weights (quant.py's QuantWeight.rotation): the activations rotated the same way.
  if (rotation) {
    at::Tensor xr = rotate_rows(x, rotation);
    quant_matmul(xr, ws, types, scales, cols, y, invariant, 0);
    return;
  }
#if defined(LADLE_QUANT_BF16)
  if (!invariant && x.scalar_type() == at::kBFloat16 && amx_active() &&
      std::all_of(parts.begin(), parts.end(), [M](const Part& p) {
        return (tile_r16(p.type) || (bf16_panel_type(p.type) && p.rows % kR16Rows == 0)) &&
               M >= bf16_min_rows(p.type);
      })) {
    if (M >= kBf16GemmRows && std::all_of(parts.begin(), parts.end(), [](const Part& p) {
          return tile_r16(p.type) && p.col % kR16Rows == 0;
        })) {
      // The call's whole weight (its parts in their columns; columns of none, which the caller
      // fills, as zero rows) in chunks of rows of about kBf16GemmBytes, each one GEMM.
      const int64_t chunk = std::max<int64_t>(kR16Rows, kBf16GemmBytes / (2 * K) / kR16Rows * kR16Rows);
      for (int64_t n0 = 0; n0 < N; n0 += chunk) {
        const int64_t nr = std::min(chunk, N - n0);
        auto w = at::empty({nr, K}, x.options());
        at::BFloat16* wp = w.data_ptr<at::BFloat16>();
        std::vector<std::pair<const Part*, int64_t>> groups(size_t((nr + 15) / 16), {nullptr, 0});
        for (const Part& p : parts)
          for (int64_t g = 0; g < p.rows / kR16Rows; g++) {
            const int64_t r = p.col + g * kR16Rows - n0;
            if (r >= 0 && r < nr) groups[size_t(r / kR16Rows)] = {&p, g};
          }
        at::parallel_for(0, int64_t(groups.size()), 1, [&](int64_t i0, int64_t i1) {
          for (int64_t i = i0; i < i1; i++) {
            at::BFloat16* o = wp + i * kR16Rows * K;
            const auto [p, g] = groups[size_t(i)];
            if (!p) {
              std::memset(o, 0, size_t(std::min(kR16Rows, nr - i * kR16Rows) * K * 2));
              continue;
            }
            switch (p->type) {
              case kQ4KR: bf16_group_rows<kQ4KR>(*p, g, K, o, K); break;
              case kQ5KR: bf16_group_rows<kQ5KR>(*p, g, K, o, K); break;
              case kQ6KR: bf16_group_rows<kQ6KR>(*p, g, K, o, K); break;
              case kQ3KR: bf16_group_rows<kQ3KR>(*p, g, K, o, K); break;
              case kQ2KR: bf16_group_rows<kQ2KR>(*p, g, K, o, K); break;
              case kQ8R: bf16_group_rows<kQ8R>(*p, g, K, o, K); break;
              default: bf16_group_rows<kI8R>(*p, g, K, o, K); break;
            }
          }
        });
        auto dst = y.narrow(1, n0, nr);
        if (nr == N && y.is_contiguous() && y.scalar_type() == at::kBFloat16)
          at::mm_out(dst, x, w.t());  // straight into out
        else
          dst.copy_(at::mm(x, w.t()));  // (rounded to bfloat16)
      }
      for (const Part& p : parts)  // int8 rows: their scales on the rounded sums
        if (p.scale)
          y.narrow(1, p.col, p.rows).mul_(at::from_blob(const_cast<float*>(p.scale), {p.rows},
                                                        x.options().dtype(at::kFloat)));
      return;
    }
    auto xt = at::empty({(M + 15) / 16 * 16 * K}, x.options());
    tile_activations(x.data_ptr<at::BFloat16>(), M, K, xt.data_ptr<at::BFloat16>());
    std::vector<std::pair<size_t, int64_t>> units;  // (part, first group of two)
    for (size_t j = 0; j < parts.size(); j++)
      for (int64_t g = 0; g < parts[j].rows / kR16Rows; g += 2) units.emplace_back(j, g);
    AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, y.scalar_type(), "quant_matmul_bf16", [&] {
      // Rows in chunks of about kBf16ChunkBytes of activations, each chunk dequantizing the
      // weights again: a chunk's activations stay in L2 while every group passes.
      const int64_t chunk = std::max<int64_t>(64, kBf16ChunkBytes / (2 * K) / 32 * 32);
      for (int64_t m0 = 0; m0 < M; m0 += chunk) {
        const int64_t mc = std::min(chunk, M - m0);
        const at::BFloat16* a = xt.data_ptr<at::BFloat16>() + m0 / 16 * (K / 32) * 512;
        scalar_t* yp = y.data_ptr<scalar_t>() + m0 * ldy;
        at::parallel_for(0, int64_t(units.size()), 1, [&](int64_t i0, int64_t i1) {
          static const TileShapes config;  // (vec.h) C 0-3, A 4-5, B 6-7
          _tile_loadconfig(&config);
          auto groups = [&](int64_t i) {  // unit i's: 2, or 1 at a part's odd end
            return int(std::min<int64_t>(2, parts[units[i].first].rows / kR16Rows - units[i].second));
          };
          for (int64_t i = i0; i < i1; i++) {
            const Part& p = parts[units[i].first];
            const int64_t g = units[i].second;
            const int ng = groups(i);
            // the next unit's weight bytes (its groups' rows, one after the other)
            const uint8_t* nx = nullptr;
            int64_t nb = 0;
            if (i + 1 < i1) {
              const Part& q = parts[units[i + 1].first];
              nx = q.w + units[i + 1].second * kR16Rows * q.row_bytes;
              nb = groups(i + 1) * kR16Rows * q.row_bytes;
            }
            switch (p.type) {
              case kQ4KR: bf16_group<kQ4KR>(p, g, ng, a, mc, K, yp, ldy, nx, nb); break;
              case kQ5KR: bf16_group<kQ5KR>(p, g, ng, a, mc, K, yp, ldy, nx, nb); break;
              case kQ6KR: bf16_group<kQ6KR>(p, g, ng, a, mc, K, yp, ldy, nx, nb); break;
              case kQ3KR: bf16_group<kQ3KR>(p, g, ng, a, mc, K, yp, ldy, nx, nb); break;
              case kQ2KR: bf16_group<kQ2KR>(p, g, ng, a, mc, K, yp, ldy, nx, nb); break;
              case kQ8R: bf16_group<kQ8R>(p, g, ng, a, mc, K, yp, ldy, nx, nb); break;
              case kQ4_0: bf16_group<kQ4_0>(p, g, ng, a, mc, K, yp, ldy, nx, nb); break;
              case kQ5_0: bf16_group<kQ5_0>(p, g, ng, a, mc, K, yp, ldy, nx, nb); break;
              case kQ4_1: bf16_group<kQ4_1>(p, g, ng, a, mc, K, yp, ldy, nx, nb); break;
              case kQ5_1: bf16_group<kQ5_1>(p, g, ng, a, mc, K, yp, ldy, nx, nb); break;
              case kIQ4NL: bf16_group<kIQ4NL>(p, g, ng, a, mc, K, yp, ldy, nx, nb); break;
              case kIQ4XS32: bf16_group<kIQ4XS32>(p, g, ng, a, mc, K, yp, ldy, nx, nb); break;
              default: bf16_group<kI8R>(p, g, ng, a, mc, K, yp, ldy, nx, nb); break;
            }
          }
          _tile_release();
        });
      }
    });
    return;
  }
#else
  (void)invariant;
#endif
  // Where the tile unit will run, the activations are also copied into A-tile order
  // (Act::qt), and q, the scales and the sums are padded with zero rows to a whole sixteen:
  // below 16 rows (amx_small) so the float steps run in fours, from 16 for r16_group's padded
  // last sixteen.
  bool on_tiles = false;
#if defined(LADLE_QUANT_AMX)
  on_tiles = M >= kAmxMinRows && amx_active() &&
             std::any_of(parts.begin(), parts.end(), [](const Part& p) { return tile_r16(p.type); });
#endif
  const int64_t Mp = on_tiles ? std::max<int64_t>(16, (M + 15) / 16 * 16) : M;
  // q, d, s, h and the two sums (Act) in one allocation, each array from a 64-byte boundary
  // and rows M .. Mp zero: one allocator call per linear, not six (a one-row decode step of
  // Gemma 3 270M makes 72 of these calls, where the allocator was ~2.6% of the main thread).
  const int64_t row_bytes[6] = {K, K / 32 * 4, K / 32 * 4, K / 16 * 2, K / 32 * 4, K / 16 * 4};
  int64_t offset[6], total = 0;
  for (int i = 0; i < 6; i++) {
    offset[i] = total;
    total += (Mp * row_bytes[i] + 63) / 64 * 64;
  }
  auto act = at::empty({total}, x.options().dtype(at::kByte));
  uint8_t* base = act.data_ptr<uint8_t>();
  if (Mp > M)
    for (int i = 0; i < 6; i++)
      std::memset(base + offset[i] + M * row_bytes[i], 0, size_t((Mp - M) * row_bytes[i]));
  int8_t* qp = reinterpret_cast<int8_t*>(base + offset[0]);
  float* dp = reinterpret_cast<float*>(base + offset[1]);
  float* sp = reinterpret_cast<float*>(base + offset[2]);
  int16_t* hp = reinterpret_cast<int16_t*>(base + offset[3]);
  int32_t* bp = reinterpret_cast<int32_t*>(base + offset[4]);
  int32_t* cp = reinterpret_cast<int32_t*>(base + offset[5]);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "quant_matmul_x", [&] {
    quantize_into(x.data_ptr<scalar_t>(), M, K, qp, dp, sp, hp, bp, cp);
  });
  Act a{qp, dp, sp, hp, bp, cp, K, nullptr, Mp};
#if defined(LADLE_QUANT_AMX)
  at::Tensor qt;
  if (on_tiles) {
    qt = at::empty({(Mp + 15) / 16 * 16 * K}, x.options().dtype(at::kChar));
    tile_activations(a.q, M, K, qt.data_ptr<int8_t>());
    a.qt = qt.data_ptr<int8_t>();
  }
#endif
#if defined(LADLE_QUANT_512)
  if (M >= kPanelMinRows) {
    std::vector<int64_t> first;  // each part's first panel in the call's one range
    int64_t panels = 0;
    for (const Part& p : parts) {
      first.push_back(panels);
      panels += (p.rows + kPanelRows - 1) / kPanelRows;
    }
    AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, y.scalar_type(), "quant_matmul_panels", [&] {
      scalar_t* yp = y.data_ptr<scalar_t>();
      at::parallel_for(0, panels, 1, [&](int64_t i0, int64_t i1) {
        PanelBuffers buf(K);
        for (size_t j = 0; j < parts.size(); j++) {
          const int64_t n = (parts[j].rows + kPanelRows - 1) / kPanelRows;
          const int64_t lo = std::max(i0, first[j]), hi = std::min(i1, first[j] + n);
          for (int64_t i = lo; i < hi; i += 2)  // (repacked groups in twos: amx_block)
            panel_any(parts[j], i - first[j], a, M, yp, ldy, buf, int(std::min<int64_t>(2, hi - i)));
        }
      });
    });
    return;
  }
#endif
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, y.scalar_type(), "quant_matmul", [&] {
    scalar_t* yp = y.data_ptr<scalar_t>();
    // A task's work: tiles of kNR weight rows by M rows.
    at::parallel_for(0, tiles, grain_for(M * K * kNR * kQuantWork),
                     [&](int64_t t0, int64_t t1) {
      for (const Part& p : parts) {
        const int64_t lo = std::max(t0, p.tile0), hi = std::min(t1, p.tile0 + p.tiles);
        if (lo < hi) part_tiles_any(p, lo - p.tile0, hi - p.tile0, a, M, yp, ldy);
      }
    });
  });
}

// y rows of each expert = its rows of a (the activations, quantized) times its weight rows:
// expert e's parts (gate and up into columns 0 and I, or down) from the stacked tensors, tiled
// as quant_matmul tiles (or puts in panels) one expert's call, all
// experts' tiles in one parallel region.
template <typename T>
static void experts_quant(const Act& a, const std::vector<const at::Tensor*>& ws,
                          const std::vector<int64_t>& types, const ExpertRows& r, int64_t K,
                          T* y, int64_t ldy) {
  struct Job {
    Part part;
    int64_t row0, rows;
    bool panels;  // part.tiles counts panels (quant_matmul's rule for this many rows)
  };
#if defined(LADLE_QUANT_512)
  auto panels_for = [](int64_t rows) { return rows >= kPanelMinRows; };
#else
  auto panels_for = [](int64_t) { return false; };
#endif
  std::vector<Job> jobs;
  int64_t tiles = 0;
  const int64_t E = static_cast<int64_t>(r.count.size());
  for (int64_t e = 0; e < E; e++) {
    if (r.count[e] == 0) continue;
    int64_t col = 0;
    for (size_t i = 0; i < ws.size(); i++) {
      const at::Tensor& w = *ws[i];
      const int type = int(types[i]);
      const int64_t rows = w.size(1), row_bytes = w.size(2);
      const bool panels = panels_for(r.count[e]);
#if defined(LADLE_QUANT_512)
      const int64_t nr_tile = panels || is_r16(type) ? kPanelRows : kNR;
#else
      const int64_t nr_tile = kNR;
#endif
      const int64_t t = (rows + nr_tile - 1) / nr_tile;
      jobs.push_back({{static_cast<const uint8_t*>(w.data_ptr()) + e * rows * row_bytes, type,
                       rows, row_bytes, col, nullptr, tiles, t},
                      r.start[e], r.count[e], panels});
      tiles += t;
      col += rows;
    }
  }
  const int64_t avg = std::max<int64_t>(1, static_cast<int64_t>(r.slot.size()) /
                                               std::max<int64_t>(1, E));
  at::parallel_for(0, tiles, grain_for(avg * K * kNR * kQuantWork), [&](int64_t t0, int64_t t1) {
#if defined(LADLE_QUANT_512)
    std::optional<PanelBuffers> buf;  // the task's one panel, made at its first
#endif
    for (const Job& j : jobs) {
      const Part& p = j.part;
      const int64_t lo = std::max(t0, p.tile0), hi = std::min(t1, p.tile0 + p.tiles);
      if (lo >= hi) continue;
#if defined(LADLE_QUANT_512)
      if (j.panels) {
        if (!buf) buf.emplace(K);
        for (int64_t i = lo; i < hi; i++)
          panel_any(p, i - p.tile0, a.from_row(j.row0), j.rows, y + j.row0 * ldy, ldy, *buf);
        continue;
      }
#endif
      part_tiles_any(p, lo - p.tile0, hi - p.tile0, a.from_row(j.row0), j.rows,
                     y + j.row0 * ldy, ldy);
    }
  });
}

template <typename T>
static void moe_quant_kernel(const at::Tensor& x, const at::Tensor& ids,
                             const at::Tensor& weights, const at::Tensor& gate,
                             int64_t gate_type, const at::Tensor& up, int64_t up_type,
                             const at::Tensor& down, int64_t down_type, at::Tensor& y) {
  const int64_t Tn = x.size(0), H = x.size(1), k = ids.size(1), E = gate.size(0);
  const int64_t I = gate.size(1), P = Tn * k;
  const int64_t* id = ids.data_ptr<int64_t>();
  const ExpertRows r = sort_by_expert(id, P, k, E, "moe_quant_swiglu");
  auto opts = x.options();
  auto rows = at::empty({P, H}, opts), gu = at::empty({P, 2 * I}, opts);
  auto act = at::empty({P, I}, opts), out = at::empty({P, H}, opts);
  gather_rows(x.data_ptr<T>(), r.src.data(), rows.data_ptr<T>(), P, H);
  const int64_t Kmax = std::max(H, I);
  auto q = at::empty({P, Kmax}, opts.dtype(at::kChar));
  auto d = at::empty({P, Kmax / 32}, opts.dtype(at::kFloat));
  auto s = at::empty({P, Kmax / 32}, opts.dtype(at::kFloat));
  auto h = at::empty({P, Kmax / 16}, opts.dtype(at::kShort));
  auto b = at::empty({P, Kmax / 32}, opts.dtype(at::kInt));
  auto c = at::empty({P, Kmax / 16}, opts.dtype(at::kInt));
  // gate | up: the gathered rows quantized once for both.
  quantize_into(rows.data_ptr<T>(), P, H, q.data_ptr<int8_t>(), d.data_ptr<float>(),
                s.data_ptr<float>(), h.data_ptr<int16_t>(), b.data_ptr<int32_t>(),
                c.data_ptr<int32_t>());
  experts_quant<T>({q.data_ptr<int8_t>(), d.data_ptr<float>(), s.data_ptr<float>(),
                    h.data_ptr<int16_t>(), b.data_ptr<int32_t>(), c.data_ptr<int32_t>(), H}, {&gate, &up}, {gate_type, up_type}, r, H,
                   gu.data_ptr<T>(), 2 * I);
  silu_mul_kernel(static_cast<const T*>(gu.data_ptr<T>()), act.data_ptr<T>(), P, I, 2 * I);
  quantize_into(act.data_ptr<T>(), P, I, q.data_ptr<int8_t>(), d.data_ptr<float>(),
                s.data_ptr<float>(), h.data_ptr<int16_t>(), b.data_ptr<int32_t>(),
                c.data_ptr<int32_t>());
  experts_quant<T>({q.data_ptr<int8_t>(), d.data_ptr<float>(), s.data_ptr<float>(),
                    h.data_ptr<int16_t>(), b.data_ptr<int32_t>(), c.data_ptr<int32_t>(), I}, {&down}, {down_type}, r, I, out.data_ptr<T>(), H);
  combine(static_cast<const T*>(out.data_ptr<T>()), id, weights.data_ptr<float>(),
          r.slot.data(), y.data_ptr<T>(), Tn, k, H);
}

// A mixture-of-experts block's SwiGLU experts held in GGUF blocks, in one call: moe_swiglu's
// scheme (moe.cpp) with quant_matmul's per-expert products. x (T, H) float32/bfloat16; ids
// (T, k) int64; weights (T, k) float32; gate and up (E, I, row bytes) and down (E, H, row
// bytes) uint8 of their types. Equal bit for bit to one quant_matmul per expert and
// projection (RoutedExperts' loop): the same rows, quantized the same way, tiled (or put in
// panels) the same way.
at::Tensor moe_quant_swiglu(const at::Tensor& x, const at::Tensor& ids,
                            const at::Tensor& weights, const at::Tensor& gate, int64_t gate_type,
                            const at::Tensor& up, int64_t up_type, const at::Tensor& down,
                            int64_t down_type) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "moe_quant_swiglu: x must be contiguous (T, H) float32 or bfloat16");
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == x.size(0) && ids.scalar_type() == at::kLong &&
                  ids.is_contiguous(), "moe_quant_swiglu: ids must be (T, k) int64");
  TORCH_CHECK(weights.sizes() == ids.sizes() && weights.scalar_type() == at::kFloat &&
                  weights.is_contiguous(), "moe_quant_swiglu: weights must be (T, k) float32");
  const int64_t H = x.size(1), E = gate.size(0), I = gate.size(1);
  for (auto [w, type, n, kk] : {std::tuple{&gate, gate_type, I, H}, std::tuple{&up, up_type, I, H},
                                std::tuple{&down, down_type, H, I}}) {
    TORCH_CHECK(is_kernel_type(type) && type != kI8 && type != kI8R, "moe_quant_swiglu: type ",
                type);
    TORCH_CHECK(!is_r16(int(type)) || n % 16 == 0, "moe_quant_swiglu: repacked rows");
    TORCH_CHECK(kk % block_values(int(type)) == 0 && kk % 32 == 0,
                "moe_quant_swiglu: inputs of ", kk, " values do not fill type ", type, "'s blocks");
    TORCH_CHECK(w->dim() == 3 && w->is_contiguous() && w->scalar_type() == at::kByte &&
                    w->size(0) == E && w->size(1) == n &&
                    w->size(2) == kk / block_values(int(type)) * block_bytes(int(type)),
                "moe_quant_swiglu: weights must be (E, out, row bytes) uint8");
  }
  auto y = at::empty_like(x);
  if (x.size(0) == 0) return y;
  if (x.scalar_type() == at::kBFloat16)
    moe_quant_kernel<at::BFloat16>(x, ids, weights, gate, gate_type, up, up_type, down,
                                   down_type, y);
  else
    moe_quant_kernel<float>(x, ids, weights, gate, gate_type, up, up_type, down, down_type, y);
  return y;
}


at::Tensor rotate_rows(const at::Tensor& x, int64_t block) {
  TORCH_CHECK(block >= 32 && block <= 1024 && (block & (block - 1)) == 0,
              "rotate_rows: block must be a power of two in [32, 1024], got ", block);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % block == 0,
              "rotate_rows: x must be contiguous (M, K) with K a multiple of ", block);
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 ||
                  x.scalar_type() == at::kHalf, "rotate_rows: x must be float32, bfloat16 or float16");
  auto out = at::empty_like(x);
  const int64_t M = x.size(0), K = x.size(1);
  const float scale = rotation_scale(block);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotate_rows", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, M, grain_for(K * kElementWork), [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; m++) rotate_row_blocks(xp + m * K, op + m * K, K, block, scale);
    });
  });
  return out;
}

// out (T, K) = rows ids (T,) of w (N, row bytes) of `type`, dequantized: the embedding lookup.
// int8 rows (kI8, kI8R) take their float32 scale per row and the weight's Hadamard block (0: none):
// float(q) x scale in float32, rotated back (rotate_row_blocks), rounded to out's dtype once, as
// quant.py's _part_rows does with torch ops (128 rows of the 0.6B there: 2.1 ms, most of it fresh
// float32 buffers).
void dequantize_rows(const at::Tensor& w, int64_t type, const at::Tensor& ids, at::Tensor out,
                     const c10::optional<at::Tensor>& scale, int64_t rotation) {
  const bool int8 = type == kI8 || type == kI8R;
  TORCH_CHECK(is_kernel_type(type), "dequantize_rows: unsupported ggml type ", type);
  TORCH_CHECK(!is_r16(int(type)) || w.size(0) % 16 == 0, "dequantize_rows: repacked rows");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() &&
                  (w.scalar_type() == at::kByte || (type == kI8 && w.scalar_type() == at::kChar)),
              "w");
  TORCH_CHECK(ids.dim() == 1 && ids.is_contiguous() && ids.scalar_type() == at::kLong, "ids");
  const int64_t T = ids.size(0), K = out.size(1), N = w.size(0);
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.size(0) == T &&
                  w.size(1) == K / block_values(int(type)) * block_bytes(int(type)), "out");
  TORCH_CHECK(!int8 || (scale && scale->scalar_type() == at::kFloat && scale->is_contiguous() &&
                        scale->numel() == N),
              "dequantize_rows: int8 rows need their float32 scale per row (", N, " values)");
  TORCH_CHECK(rotation == 0 || (int8 && rotation >= 32 && rotation <= 1024 &&
                                (rotation & (rotation - 1)) == 0 && K % rotation == 0),
              "dequantize_rows: rotation must be 0, or for int8 rows a power of two in [32, 1024] "
              "dividing ", K, ", got ", rotation);
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; t++)
    TORCH_CHECK(id[t] >= 0 && id[t] < N, "row id ", id[t], " out of range [0, ", N, ")");
  const uint8_t* wp = static_cast<const uint8_t*>(w.data_ptr());
  const int64_t row_bytes = w.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, out.scalar_type(), "dequantize_rows", [&] {
    scalar_t* op = out.data_ptr<scalar_t>();
    if (int8) {
      const float* sp = scale->data_ptr<float>();
      const float rs = rotation ? rotation_scale(rotation) : 1.f;
      at::parallel_for(0, T, grain_for(K * kElementWork), [&](int64_t t0, int64_t t1) {
        std::vector<float> v(static_cast<size_t>(K));
        for (int64_t t = t0; t < t1; t++) {
          const float s = sp[id[t]];
          if (type == kI8) {
            const int8_t* q = reinterpret_cast<const int8_t*>(wp + id[t] * row_bytes);
            for (int64_t k = 0; k < K; k++) v[k] = float(q[k]) * s;
          } else {  // value 4j + i of block b at b x 512 + j x 64 + 4r + i of the group, + 128
            const uint8_t* g = wp + id[t] / 16 * 16 * row_bytes + id[t] % 16 * 4;
            for (int64_t k = 0; k < K; k++)
              v[k] = float(int8_t(g[k / 32 * 512 + k % 32 / 4 * 64 + k % 4] ^ 0x80)) * s;
          }
          scalar_t* o = op + t * K;
          if (rotation) rotate_row_blocks(v.data(), o, K, rotation, rs);
          else for (int64_t k = 0; k < K; k++) o[k] = scalar_t(v[k]);
        }
      });
      return;
    }
    const bool packed = is_r16(int(type));
    const int base = packed ? r16_base(int(type)) : int(type);
    std::vector<uint8_t> blocks(packed ? K / block_values(base) * block_bytes(base) : 0);
    for (int64_t t = 0; t < T; t++) {
      const uint8_t* row = wp + id[t] * row_bytes;
      if (packed) {  // the row's blocks, out of its group's
        r16_row(int(type), wp + id[t] / 16 * 16 * row_bytes, int(id[t] % 16),
                K / block_values(base), blocks.data());
        row = blocks.data();
      }
      for (int64_t sb = 0; sb < K / 32; sb++) {
        Sub s;
        unpack_any(base, row, sb, s);
        for (int i = 0; i < 32; i++)
          op[t * K + sb * 32 + i] =
              scalar_t((i < 16 ? s.s0 : s.s1) * float(s.q[i]) - (i < 16 ? s.minv : s.minv_hi));
      }
    }
  });
}

void set_iq_grids(const at::Tensor& iq2xxs, const at::Tensor& iq3xxs, const at::Tensor& iq3s,
                  const at::Tensor& iq2xs, const at::Tensor& iq2s) {
  auto fits = [](const at::Tensor& t, int64_t n) {
    return t.scalar_type() == at::kByte && t.is_contiguous() && t.numel() == n;
  };
  TORCH_CHECK(fits(iq2xxs, 256 * 8) && fits(iq3xxs, 256 * 4) && fits(iq3s, 512 * 4) &&
                  fits(iq2xs, 512 * 8) && fits(iq2s, 1024 * 8),
              "set_iq_grids: uint8 grids of 256 x 8 (IQ2_XXS), 256 x 4 (IQ3_XXS), 512 x 4 "
              "(IQ3_S), 512 x 8 (IQ2_XS) and 1024 x 8 (IQ2_S) values");
  // An IQ3 grid's distinct values, ascending: its 8 levels.
  auto levels = [](const at::Tensor& grid, uint8_t* out) {
    bool seen[256] = {};
    const uint8_t* g = grid.data_ptr<uint8_t>();
    for (int64_t i = 0; i < grid.numel(); i++) seen[g[i]] = true;
    int n = 0;
    std::memset(out, 0, 16);
    for (int v = 0; v < 256; v++)
      if (seen[v]) {
        TORCH_CHECK(n < 8, "set_iq_grids: an IQ3 grid of more than 8 distinct values");
        out[n++] = uint8_t(v);
      }
    TORCH_CHECK(n == 8, "set_iq_grids: an IQ3 grid of ", n, " distinct values, not 8");
  };
  IqGrids next{};
  std::memcpy(next.g2, iq2xxs.data_ptr(), sizeof next.g2);
  std::memcpy(next.g2xs, iq2xs.data_ptr(), sizeof next.g2xs);
  std::memcpy(next.g2s, iq2s.data_ptr(), sizeof next.g2s);
  levels(iq3xxs, next.l3);
  levels(iq3s, next.l3s);
  if (g_iq_ready.load(std::memory_order_acquire)) {  // once per process: running parts read them
    TORCH_CHECK(std::memcmp(&g_iq, &next, sizeof next) == 0,
                "set_iq_grids: the grids are already set, to other values");
    return;
  }
  g_iq = next;
  g_iq_ready.store(true, std::memory_order_release);
}

bool quant_r16() { return kHasR16; }

int64_t quant_bf16_min_rows(int64_t type) {
#if defined(LADLE_QUANT_BF16)
  return amx_active() && (tile_r16(int(type)) || bf16_panel_type(int(type)))
             ? bf16_min_rows(int(type)) : 0;
#else
  (void)type;
  return 0;
#endif
}

int64_t quant_token_min_rows() {
#if defined(LADLE_QUANT_512)
  return kTokenMinRows;
#else
  return 0;
#endif
}

int64_t quant_bf16_gemm_rows() {
#if defined(LADLE_QUANT_BF16)
  return amx_active() ? kBf16GemmRows : 0;
#else
  return 0;
#endif
}

bool set_quant_amx(bool on) {
#if defined(LADLE_QUANT_AMX)
  g_amx_on.store(on);
  return on && amx_permitted();
#else
  (void)on;
  return false;
#endif
}

std::string quant_isa() {
#if defined(LADLE_QUANT_AMX)
  if (amx_active())
    return "avx512-vnni (256-bit tiles, 512-bit panels from 12 rows, "
           "Q2_K/Q3_K/Q4_K/Q5_K/Q6_K/Q8_0/Q5_0 repacked) "
           "+ amx-int8 (repacked parts, 16 rows at a time; rotated int8 rows per token from 4 rows)"
#if defined(LADLE_QUANT_BF16)
           " + amx-bf16 (repacked, Q4_0, Q5_0 parts dequantized, from 8-20 rows)"
#endif
           ;
#endif
#if defined(LADLE_QUANT_512) && defined(__AVX512VL__)
  return "avx512-vnni (256-bit tiles, 512-bit panels from 12 rows, "
         "Q2_K/Q3_K/Q4_K/Q5_K/Q6_K/Q8_0/Q5_0 repacked; "
         "rotated int8 rows per token from 4 rows)";
#elif defined(LADLE_QUANT_AVX2) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return "avx512-vnni (256-bit)";
#elif defined(LADLE_QUANT_AVX2) && defined(__AVXVNNI__)
  return "avx-vnni";
#elif defined(LADLE_QUANT_AVX2)
  return "avx2";
#else
  return "portable";
#endif
}
