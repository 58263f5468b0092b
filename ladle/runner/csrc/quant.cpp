// Quantized linears: y (M, N) = x (M, K) @ W (N, K)^T where W's rows are parts, each in GGUF
// blocks (Q8_0, Q4_0, Q5_0, MXFP4, Q4_K, Q6_K) or int8 with a scale per row, and x is quantized
// to int8 once per call for all parts. One call, one parallel region: a decode step's small
// matmuls (0.2-2 MB of weights, 10-100 us) would otherwise spend a third of their time in Python
// and in the threads' wake-ups and joins. The pure-torch twin is in ladle/runner/quant.py; the
// tests compare the two.
//
// The scheme (ggml's, written afresh): the activations are int8 per block of 32 values with a
// float scale (d = max|x| / 127); a weight block of 32 is unpacked in registers to 32 int8
// values; the 32 products are summed in integers (AVX2 vpmaddubsw + vpmaddwd, or VNNI vpdpbusd),
// converted once and scaled by d_w * d_x. vpmaddubsw multiplies unsigned by signed bytes, so the
// signed weights of Q8_0, Q4_0, Q5_0 and MXFP4 go in as |w| with the sign moved onto x
// (vpsignb). The K-quants' values go in unsigned (Q4_K's nibbles, Q6_K's q before its -32), their
// sub-block scales multiply the integer sums in the vpmaddwd, and what the unsigned form adds
// (Q4_K's mins, Q6_K's offset) is taken off once per super-block from the activations' integer
// sums kept beside their scales. An int8 row is read as Q8_0 blocks with scale 1, and its row
// scale multiplies the sum at the end. Everything is exact in integers up to the float32 scaling:
// the result equals the float64 product of the dequantized weights and activations to ~1e-6
// relative.
//
// The K-quants' activations stay in blocks of 32, not ggml's super-blocks of 256 (Q8_K, whose
// integer sums over a super-block save the per-block float scaling): measured on the Gemma file,
// Q8_K activations took KL(f32 || ladle) from 0.0031 to 0.0056 (llama.cpp's own: 0.0049).
//
// Threads split N. Each task multiplies a tile of NR weight rows by MR activation rows while the
// weight blocks are in registers, so for decode (M <= 4) the weights are read once at memory
// speed, and for prefill every unpacked weight block serves MR rows. AVX-512 VNNI builds run
// 12 or more rows in panels instead (below: 16 weight rows unpacked once per call, 64
// products per instruction into 16 outputs), except in batch-invariant mode.
#include "quant.h"
#include "kernels.h"
#include "moe.h"
#include "vec.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define LADLE_QUANT_AVX2 1
#include <immintrin.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define LADLE_QUANT_512 1  // the panels (prefill, batched decode)
#endif
#endif

namespace {

constexpr int kQ4_0 = 2, kQ5_0 = 6, kQ8_0 = 8, kQ4_K = 12, kQ6_K = 14, kMXFP4 = 39;
constexpr int kI8 = -1;  // int8 rows with a float scale per row (quant.py's INT8_ROW)

// (values per block, bytes per block), as gguf's GGML_QUANT_SIZES.
inline int64_t block_values(int type) { return (type == kQ4_K || type == kQ6_K) ? 256 : 32; }
inline int64_t block_bytes(int type) {
  switch (type) {
    case kQ4_0: return 18;
    case kQ5_0: return 22;
    case kQ8_0: return 34;
    case kMXFP4: return 17;
    case kQ4_K: return 144;
    case kQ6_K: return 210;
    case kI8: return 32;
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

// One sub-block of 32 values of a weight row: w[i] = (i < 16 ? s0 : s1) * q[i] - minv.
struct Sub {
  int8_t q[32];  // signed, except Q4_K: 0..15
  float s0, s1, minv;
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
  } else if constexpr (TYPE == kMXFP4) {
    o.s0 = o.s1 = e8m0_half(row[sb * 17]);
  } else if constexpr (TYPE == kQ4_K) {
    const uint8_t* b = row + (sb >> 3) * 144;
    int sc, mn;
    k4_scale_min(b + 4, int(sb & 7), sc, mn);
    o.s0 = o.s1 = f16(b) * float(sc);
    o.minv = f16(b + 2) * float(mn);
  } else {  // Q6_K: ql[128], qh[64], int8 scales[16], d
    const uint8_t* b = row + (sb >> 3) * 210;
    const int j = int(sb & 7);
    const float d = f16(b + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192) + 2 * j;
    o.s0 = d * float(sc[0]);
    o.s1 = d * float(sc[1]);
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
  } else if constexpr (TYPE == kMXFP4) {
    const uint8_t* b = row + sb * 17;
    for (int i = 0; i < 16; i++) {
      o.q[i] = kMxfp4Values[b[1 + i] & 0xF];
      o.q[i + 16] = kMxfp4Values[b[1 + i] >> 4];
    }
  } else if constexpr (TYPE == kQ4_K) {
    const int j = int(sb & 7);
    const uint8_t* qs = row + (sb >> 3) * 144 + 16 + (j >> 1) * 32;
    for (int i = 0; i < 32; i++) o.q[i] = int8_t((j & 1) ? (qs[i] >> 4) : (qs[i] & 0xF));
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

inline void unpack_any(int type, const uint8_t* row, int64_t sb, Sub& o) {
  switch (type) {
    case kQ8_0: return unpack_scalar<kQ8_0>(row, sb, o);
    case kQ4_0: return unpack_scalar<kQ4_0>(row, sb, o);
    case kQ5_0: return unpack_scalar<kQ5_0>(row, sb, o);
    case kMXFP4: return unpack_scalar<kMXFP4>(row, sb, o);
    case kQ4_K: return unpack_scalar<kQ4_K>(row, sb, o);
    case kI8: return unpack_scalar<kI8>(row, sb, o);
    default: return unpack_scalar<kQ6_K>(row, sb, o);
  }
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
  int64_t K;
  Act from_row(int64_t m) const {
    return {q + m * K, d + m * (K / 32), s + m * (K / 32), h + m * (K / 16), K};
  }
};

#if defined(LADLE_QUANT_AVX2)
inline __m256i nibbles(const uint8_t* p) {  // 16 bytes -> low nibbles, then high nibbles
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

// Byte i (0..31) = 0x10 where bit i of `bits` is set, else 0.
inline __m256i bit_bytes(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(int(bits)),
      _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL, 0x0101010101010101LL, 0));
  const __m256i select = _mm256_set1_epi64x(int64_t(0x8040201008040201ULL));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select);
  return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

// A block of 32 values with one scale (Q8_0, Q4_0, Q5_0, MXFP4, and int8 rows as blocks of
// scale 1), its values unpacked to signed int8. (The K-quants have tiles of their own, below.)
template <int TYPE> constexpr int64_t kBlockBytes =
    TYPE == kI8 ? 32 : TYPE == kQ8_0 ? 34 : TYPE == kQ4_0 ? 18 : TYPE == kMXFP4 ? 17 : 22;

template <int TYPE>
inline float block_scale(const uint8_t* b) {
  if constexpr (TYPE == kI8) return 1.f;
  else if constexpr (TYPE == kMXFP4) return e8m0_half(b[0]);
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
  } else if constexpr (TYPE == kMXFP4) {  // the nibbles through the table, one vpshufb
    const __m128i table = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kMxfp4Values));
    return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(table), nibbles(b + 1));
  } else {  // Q5_0
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

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// out[m][n] = x[m] . w[n] for MR activation rows and NR weight rows. The accumulators' 8 lanes
// are partial sums added up at the end, so a lane may take any term: a sub-block's products
// (lane i: its values 4i..4i+3, scaled by the scale of that half), or (Q4_K) the eight
// sub-blocks' min terms of a super-block at once.
// Each weight row is a stream from memory; the hardware prefetcher alone kept a core at 5-9 GB/s
// on the K-quants (their unpacking leaves few loads in flight). Measured on an AVX2 EPYC, one
// activation row, 50-180 MB of weights: 4 KB ahead gives 11-13 GB/s for every type (1 KB:
// 9-13, 2 KB no better; L1 or L2 hint the same).
constexpr int64_t kPrefetchBytes = 4096;

// Q4_K: a super-block of 256 unsigned nibbles in eight sub-blocks of 32, each with a 6-bit
// scale and min (times the super-block's d and dmin). Its header is decoded in vector registers:
// the eight scales as int16, which the integer sum of a sub-block is multiplied by in the same
// vpmaddwd that sums its pairs (instead of a float multiply per sub-block), and the eight
// mins times dmin as one float vector, whose terms (lane j: -min_j * d_x * sum(q_x) of
// sub-block j) take one FMA per super-block. With one activation row (decode) the sub-blocks'
// sums, scaled by d_x, are added up per super-block and times d once.
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

// Sub-block sb of a K-quant tile: the NR weight rows' 32 unsigned values q with their scales as
// int16 (s16), times the MR activation rows. q * x pairs fit int16 (Q4_K <= 3810, Q6_K <=
// 16002); times the scale and summed in pairs, int32 (<= 4.1M). One activation row adds into
// part (the super-block's sum before its d), more rows into acc with d applied.
template <int NR>
inline void add_super_block(const __m256* part, const __m256* d, __m256* acc) {
  for (int n = 0; n < NR; n++) acc[n] = _mm256_fmadd_ps(part[n], d[n], acc[n]);
}

template <int MR, int NR>
inline void tile_sums(__m256 (*acc)[NR], float (*out)[NR]) {
  for (int m = 0; m < MR; m++)
    for (int n = 0; n < NR; n++) out[m][n] = hsum(acc[m][n]);
}

template <int MR, int NR, bool FOLD>
inline void ksub_products(const __m256i* q, const __m256i* s16, const int8_t* qx, const float* dx,
                          int64_t K, int64_t sb, const __m256* d, __m256* part,
                          __m256 (*acc)[NR]) {
  for (int m = 0; m < MR; m++) {
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + m * K + sb * 32));
    const __m256 dxj = _mm256_broadcast_ss(dx + m * (K / 32) + sb);
    for (int n = 0; n < NR; n++) {
      const __m256 p = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(q[n], xv), s16[n]));
      if constexpr (FOLD) part[n] = _mm256_fmadd_ps(p, dxj, part[n]);
      else acc[m][n] = _mm256_fmadd_ps(p, _mm256_mul_ps(dxj, d[n]), acc[m][n]);
    }
  }
}

template <int MR, int NR, bool FOLD>
inline void tile_q4k(const uint8_t* const* w, const int8_t* qx, const float* dx, const float* sx,
                     int64_t K, float (*out)[NR]) {
  __m256 acc[MR][NR];
  for (int m = 0; m < MR; m++)
    for (int n = 0; n < NR; n++) acc[m][n] = _mm256_setzero_ps();
  const int64_t nsub = K / 32, nblocks = K / 256;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int64_t blk = 0; blk < nblocks; blk++) {
    const uint8_t* b[NR];
    __m256i sc16[NR];  // the eight scales as int16, in both 128-bit lanes
    __m256 d[NR];
    for (int n = 0; n < NR; n++) {
      b[n] = w[n] + blk * 144;
      for (int64_t off = 0; off < 144; off += 64)  // the row's stream, kPrefetchBytes ahead
        _mm_prefetch(reinterpret_cast<const char*>(b[n]) + kPrefetchBytes + off, _MM_HINT_T0);
      uint64_t sc, mn;
      k4_scales(b[n] + 4, sc, mn);
      sc16[n] = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(int64_t(sc))));
      const __m256 mins = _mm256_mul_ps(
          _mm256_set1_ps(f16(b[n] + 2)),
          _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(int64_t(mn)))));
      d[n] = _mm256_set1_ps(f16(b[n]));
      for (int m = 0; m < MR; m++)
        acc[m][n] = _mm256_fnmadd_ps(mins, _mm256_loadu_ps(sx + m * nsub + blk * 8), acc[m][n]);
    }
    __m256 part[NR];  // one activation row: this super-block's sum before d
    if constexpr (FOLD)
      for (int n = 0; n < NR; n++) part[n] = _mm256_setzero_ps();
#pragma GCC unroll 8  // every j's constants (shuffle picks, shifts) fixed at compile time
    for (int j = 0; j < 8; j++) {
      const int64_t sb = blk * 8 + j;
      // vpshufb picks bytes 2j, 2j+1 (scale j as int16) into every int16 lane.
      const __m256i pick = _mm256_set1_epi16(int16_t(((2 * j + 1) << 8) | (2 * j)));
      __m256i q[NR], s16[NR];
      for (int n = 0; n < NR; n++) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b[n] + 16 + (j >> 1) * 32));
        q[n] = _mm256_and_si256((j & 1) ? _mm256_srli_epi16(raw, 4) : raw, low4);
        s16[n] = _mm256_shuffle_epi8(sc16[n], pick);
      }
      ksub_products<MR, NR, FOLD>(q, s16, qx, dx, K, sb, d, part, acc);
    }
    if constexpr (FOLD) add_super_block<NR>(part, d, acc[0]);
  }
  tile_sums<MR, NR>(acc, out);
}

template <int TYPE, int MR, int NR>
inline void tile_blocks(const uint8_t* const* w, const int8_t* qx, const float* dx, int64_t K,
                        float (*out)[NR]) {
  constexpr int64_t BB = kBlockBytes<TYPE>;
  __m256 acc[MR][NR];
  for (int m = 0; m < MR; m++)
    for (int n = 0; n < NR; n++) acc[m][n] = _mm256_setzero_ps();
  const int64_t nblocks = K / 32;
  for (int64_t blk = 0; blk < nblocks; blk++) {
    __m256i q[NR], aq[NR];
    __m256 s[NR];
    for (int n = 0; n < NR; n++) {
      const uint8_t* b = w[n] + blk * BB;
      _mm_prefetch(reinterpret_cast<const char*>(b) + kPrefetchBytes, _MM_HINT_T0);
      q[n] = block_quants<TYPE>(b);
      aq[n] = _mm256_sign_epi8(q[n], q[n]);  // |w| for vpmaddubsw
      s[n] = _mm256_set1_ps(block_scale<TYPE>(b));
    }
    for (int m = 0; m < MR; m++) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + m * K + blk * 32));
      const __m256 d = _mm256_broadcast_ss(dx + m * nblocks + blk);
      for (int n = 0; n < NR; n++) {
        // Signed weights: the sign moves onto x, so |w| (unsigned) times sign(w) * x.
        const __m256i xs = _mm256_sign_epi8(xv, q[n]);
        const __m256 p = _mm256_cvtepi32_ps(dot_u8s8(aq[n], xs));
        acc[m][n] = _mm256_fmadd_ps(p, _mm256_mul_ps(s[n], d), acc[m][n]);
      }
    }
  }
  tile_sums<MR, NR>(acc, out);
}

// Q6_K: a super-block of 256 six-bit values (q - 32) in eight sub-blocks of 32, each half of
// 16 with a signed int8 scale. As for Q4_K, the scales multiply the integer sums in vpmaddwd,
// here with q read unsigned (0..63: no sign moves) and the offset taken off per super-block
// as 32 * sum(scale * sum of x's 16 values), from the activations' int16 sums per 16 (one
// vpmaddwd gives the eight sub-blocks' terms). Measured against the sign-moving tile on an
// AVX2 EPYC: see rows_per_tile.
template <int MR, int NR, bool FOLD>
inline void tile_q6k(const uint8_t* const* w, const int8_t* qx, const float* dx,
                     const int16_t* hx, int64_t K, float (*out)[NR]) {
  __m256 acc[MR][NR];
  for (int m = 0; m < MR; m++)
    for (int n = 0; n < NR; n++) acc[m][n] = _mm256_setzero_ps();
  const int64_t nsub = K / 32, nblocks = K / 256;
  const __m256i low4 = _mm256_set1_epi8(0x0F), low2 = _mm256_set1_epi8(3);
  for (int64_t blk = 0; blk < nblocks; blk++) {
    const uint8_t* b[NR];
    __m256i sc16[NR][2];  // scales 0-7 and 8-15 as int16, each in both 128-bit lanes
    __m256 d[NR];
    for (int n = 0; n < NR; n++) {
      b[n] = w[n] + blk * 210;
      for (int64_t off = 0; off < 210; off += 64)  // the row's stream, kPrefetchBytes ahead
        _mm_prefetch(reinterpret_cast<const char*>(b[n]) + kPrefetchBytes + off, _MM_HINT_T0);
      const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b[n] + 192));
      sc16[n][0] = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(sc));
      sc16[n][1] = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(_mm_srli_si128(sc, 8)));
      d[n] = _mm256_set1_ps(f16(b[n] + 208));
      const __m256i all16 = _mm256_cvtepi8_epi16(sc);
      const __m256 d32 = _mm256_mul_ps(d[n], _mm256_set1_ps(32.f));
      for (int m = 0; m < MR; m++) {
        // lane j: scale_2j * sum(x of half 2j) + scale_2j+1 * sum(x of half 2j+1)
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hx + m * 2 * nsub + blk * 16));
        const __m256 off = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(all16, h)),
                                         _mm256_loadu_ps(dx + m * nsub + blk * 8));
        acc[m][n] = _mm256_fnmadd_ps(off, d32, acc[m][n]);
      }
    }
    __m256 part[NR];  // one activation row: this super-block's sum before d
    if constexpr (FOLD)
      for (int n = 0; n < NR; n++) part[n] = _mm256_setzero_ps();
#pragma GCC unroll 8  // every j's constants (shuffle picks, shifts) fixed at compile time
    for (int j = 0; j < 8; j++) {
      const int64_t sb = blk * 8 + j;
      const int half = j >> 2, g = j & 3;
      // vpshufb picks scale 2j (as int16) into the low 128-bit lane's int16s, 2j + 1 into the
      // high lane's: the two halves of the sub-block.
      const int lo = (2 * j) & 7, hi = (2 * j + 1) & 7;
      const __m256i pick = _mm256_set_m128i(_mm_set1_epi16(int16_t(((2 * hi + 1) << 8) | (2 * hi))),
                                            _mm_set1_epi16(int16_t(((2 * lo + 1) << 8) | (2 * lo))));
      __m256i q[NR], s16[NR];
      for (int n = 0; n < NR; n++) {
        const __m256i ql = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(b[n] + half * 64 + (g & 1) * 32));
        const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b[n] + 128 + half * 32));
        const __m256i l = _mm256_and_si256(_mm256_srli_epi16(ql, (g >> 1) * 4), low4);
        const __m256i h = _mm256_and_si256(_mm256_srli_epi16(qh, g * 2), low2);
        q[n] = _mm256_or_si256(l, _mm256_slli_epi16(h, 4));  // 0..63
        s16[n] = _mm256_shuffle_epi8(sc16[n][half], pick);
      }
      ksub_products<MR, NR, FOLD>(q, s16, qx, dx, K, sb, d, part, acc);
    }
    if constexpr (FOLD) add_super_block<NR>(part, d, acc[0]);
  }
  tile_sums<MR, NR>(acc, out);
}

// FOLD (the K-quants, one activation row): a super-block's sub-block sums are added up before
// its d multiplies them (one multiply fewer per sub-block: decode speed). Without it every
// sub-block's sum is scaled by d_x * d on its own, as in a tile of several rows, so a row's
// result does not depend on the rows beside it (batch-invariant mode; every row of a
// multi-row call).
template <int TYPE, int MR, int NR, bool FOLD>
inline void tile(const uint8_t* const* w, const Act& a, float (*out)[NR]) {
  static_assert(!FOLD || MR == 1, "a folded tile has one activation row");
  if constexpr (TYPE == kQ4_K) tile_q4k<MR, NR, FOLD>(w, a.q, a.d, a.s, a.K, out);
  else if constexpr (TYPE == kQ6_K) tile_q6k<MR, NR, FOLD>(w, a.q, a.d, a.h, a.K, out);
  else tile_blocks<TYPE, MR, NR>(w, a.q, a.d, a.K, out);
}
#else
template <int TYPE, int MR, int NR, bool FOLD>  // one order for every tile here
inline void tile(const uint8_t* const* w, const Act& a, float (*out)[NR]) {
  const int8_t* qx = a.q;
  const float *dx = a.d, *sx = a.s;
  const int64_t K = a.K;
  float acc[MR][NR] = {};
  const int64_t nsub = K / 32;
  for (int64_t sb = 0; sb < nsub; sb++) {
    Sub ws[NR];
    for (int n = 0; n < NR; n++) unpack_scalar<TYPE>(w[n], sb, ws[n]);
    for (int m = 0; m < MR; m++) {
      const int8_t* x = qx + m * K + sb * 32;
      for (int n = 0; n < NR; n++) {
        int32_t lo = 0, hi = 0;
        for (int i = 0; i < 16; i++) lo += int32_t(ws[n].q[i]) * x[i];
        for (int i = 16; i < 32; i++) hi += int32_t(ws[n].q[i]) * x[i];
        acc[m][n] += dx[m * nsub + sb] * (ws[n].s0 * float(lo) + ws[n].s1 * float(hi)) -
                     ws[n].minv * sx[m * nsub + sb];
      }
    }
  }
  for (int m = 0; m < MR; m++)
    for (int n = 0; n < NR; n++) out[m][n] = acc[m][n];
}
#endif

// One part of the weight: `rows` rows of `type` (row_bytes each) that give the output columns
// col .. col + rows - 1, times scale[n] per row where the part has one (int8 rows). Its tiles
// are tile0 .. tile0 + tiles - 1 of the call's one range.
struct Part {
  const uint8_t* w;
  int type;
  int64_t rows, row_bytes, col;
  const float* scale;
  int64_t tile0, tiles;
};

// Weight rows per tile, and activation rows: AVX2 has 16 vector registers, so MR x NR
// accumulators plus NR unpacked blocks (and their scales) must fit: 4 x 2 for prefill. For a
// single activation row (decode) the tile is the weight rows read side by side, chosen per type
// by measurement (AVX2 EPYC, both cores, one activation row, the 0.6B Q4_K_M and Q8_0 files'
// tensors, GB/s at 1 / 2 / 4 rows): Q4_K 19.1 / 22.0 / 18.7, Q6_K (the 152k-row lm_head) 24.8 /
// 19.6 / -, Q8_0 near the 29.7 GB/s read bandwidth at 1; one core, earlier: Q5_0 13.7 / 14.0 /
// 13.9. A byte-dense type streams fastest as one row at a time; a 4-bit one needs more rows'
// work to hide its unpacking.
constexpr int kNR = 2, kMR = 4;
template <int TYPE> constexpr int kDecodeRows =
    (TYPE == kQ8_0 || TYPE == kI8 || TYPE == kQ6_K) ? 1 : TYPE == kQ4_K ? 2 : 4;
inline int64_t rows_per_tile(int type, int64_t M) {
  if (M > 1) return kNR;
  switch (type) {
    case kQ4_K: return kDecodeRows<kQ4_K>;
    case kQ4_0: return kDecodeRows<kQ4_0>;
    case kQ5_0: return kDecodeRows<kQ5_0>;
    case kMXFP4: return kDecodeRows<kMXFP4>;
    default: return 1;
  }
}
// grain_for counts bf16 multiply-adds; a quantized one also unpacks its weight (nibbles, high
// bits, sign): measured on an AVX2 EPYC at one activation row, Q5_0 ran ~10 G/s per core
// against the bf16 kernel's ~70. Counting each as this many units keeps the tasks of a
// decode-sized matmul (0.5-2 M multiply-adds) on both cores instead of one.
constexpr int64_t kQuantWork = 4;

// y[m][p.col + n] for MR activation rows from m0 and the NR weight rows from n0.
template <int TYPE, int MR, int NR, bool FOLD = false, typename T>
inline void store_tile(const Part& p, const Act& a, int64_t m0, int64_t n0, T* y, int64_t ldy) {
  const uint8_t* wr[NR];
  for (int n = 0; n < NR; n++) wr[n] = p.w + (n0 + n) * p.row_bytes;
  float out[MR][NR];
  tile<TYPE, MR, NR, FOLD>(wr, a.from_row(m0), out);
  for (int m = 0; m < MR; m++)
    for (int n = 0; n < NR; n++)
      y[(m0 + m) * ldy + p.col + n0 + n] = T(p.scale ? out[m][n] * p.scale[n0 + n] : out[m][n]);
}

// Tiles t0 .. t1 - 1 (local to the part) for all M activation rows; fold: M is 1 and the call
// is not batch-invariant (tile's FOLD).
template <int TYPE, bool FOLD, typename T>
void row_tiles(const Part& p, int64_t t0, int64_t t1, const Act& a, T* y, int64_t ldy) {
  constexpr int NR1 = kDecodeRows<TYPE>;
  for (int64_t t = t0; t < t1; t++) {
    const int64_t n0 = t * NR1;
    if (n0 + NR1 <= p.rows) {
      store_tile<TYPE, 1, NR1, FOLD>(p, a, 0, n0, y, ldy);
    } else {
      for (int64_t n = n0; n < p.rows; n++) store_tile<TYPE, 1, 1, FOLD>(p, a, 0, n, y, ldy);
    }
  }
}

template <int TYPE, typename T>
void part_tiles(const Part& p, int64_t t0, int64_t t1, const Act& a, int64_t M, T* y,
                int64_t ldy, bool fold) {
  const int64_t nr_tile = rows_per_tile(TYPE, M);
  if (M == 1) {
    if constexpr (TYPE == kQ4_K || TYPE == kQ6_K)
      if (fold) return row_tiles<TYPE, true>(p, t0, t1, a, y, ldy);
    return row_tiles<TYPE, false>(p, t0, t1, a, y, ldy);
  }
  for (int64_t t = t0; t < t1; t++) {
    const int64_t n0 = t * nr_tile;
    const bool full = n0 + kNR <= p.rows;
    int64_t m = 0;
    for (; m + kMR <= M; m += kMR) {
      if (full) store_tile<TYPE, kMR, kNR>(p, a, m, n0, y, ldy);
      else store_tile<TYPE, kMR, 1>(p, a, m, n0, y, ldy);
    }
    for (; m < M; m++) {
      if (full) store_tile<TYPE, 1, kNR>(p, a, m, n0, y, ldy);
      else store_tile<TYPE, 1, 1>(p, a, m, n0, y, ldy);
    }
  }
}

template <typename T>
void part_tiles_any(const Part& p, int64_t t0, int64_t t1, const Act& a, int64_t M, T* y,
                    int64_t ldy, bool fold) {
  switch (p.type) {
    case kQ8_0: return part_tiles<kQ8_0>(p, t0, t1, a, M, y, ldy, fold);
    case kQ4_0: return part_tiles<kQ4_0>(p, t0, t1, a, M, y, ldy, fold);
    case kQ5_0: return part_tiles<kQ5_0>(p, t0, t1, a, M, y, ldy, fold);
    case kMXFP4: return part_tiles<kMXFP4>(p, t0, t1, a, M, y, ldy, fold);
    case kQ4_K: return part_tiles<kQ4_K>(p, t0, t1, a, M, y, ldy, fold);
    case kQ6_K: return part_tiles<kQ6_K>(p, t0, t1, a, M, y, ldy, fold);
    default: return part_tiles<kI8>(p, t0, t1, a, M, y, ldy, fold);
  }
}

#if defined(LADLE_QUANT_512)
// Prefill and batched decode (M >= kPanelMinRows, 12; not in batch-invariant mode, where a row's sum
// must not depend on M): panels. A tile above multiplies MR x NR (row, weight row) pairs each
// as its own dot product, so every 32 products cost a sign move, a vpdpbusd, a conversion and
// two float multiplies: ~6 instructions per 32 multiply-adds, a sixth of the int8 peak (Zen 4,
// 0.6B Q8_0 shapes, 128 rows: 138 of 831 GOPS). A panel is 16 weight rows unpacked once per
// call into unsigned bytes (w + bias), interleaved by 4 (dword t of the 16 rows side by side:
// one zmm), so one vpdpbusd with 4 bytes of an activation row broadcast adds 64 products into
// 16 outputs' int32 sums: a sub-block of 32 takes 8 of them, then one conversion and two float
// operations for all 16 outputs. The bias (Q8_0, int8 rows and MXFP4: 128 with the sign bit
// flipped; Q4_0 8; Q5_0 16; Q6_K 32; Q4_K's nibbles need none) makes the weights unsigned for
// vpdpbusd; what it adds, bias * sum(x), starts each sub-block's integer sum negated, from the
// activations' int16 sums per 16. Per sub-block and row a panel keeps the float scale of each
// half (only Q6_K's halves differ) and Q4_K's min, so a row's result is the same float64
// reference as the tiles' up to float32 rounding.
constexpr int64_t kPanelRows = 16;
// From this many rows the panel's packing pays (Zen 4, 0.6B Q8_0 layer shapes, ms per layer,
// tiles / panels: 8 rows 1.86 / 2.24, 16 rows 3.53 / 2.98, 32: 8.3 / 4.0, 128: 29.2 / 11.0).
constexpr int64_t kPanelMinRows = 12;

template <int TYPE> constexpr int kPanelBias =
    (TYPE == kQ8_0 || TYPE == kI8 || TYPE == kMXFP4) ? 128 : TYPE == kQ4_0 ? 8
    : TYPE == kQ5_0 ? 16 : TYPE == kQ6_K ? 32 : 0;

// Sub-block sb of a row as 32 unsigned bytes w + bias.
template <int TYPE>
inline __m256i panel_bytes(const uint8_t* row, int64_t sb) {
  const __m256i flip = _mm256_set1_epi8(char(0x80));
  if constexpr (TYPE == kQ4_K) {
    const uint8_t* b = row + (sb >> 3) * 144;
    const int j = int(sb & 7);
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 + (j >> 1) * 32));
    return _mm256_and_si256((j & 1) ? _mm256_srli_epi16(raw, 4) : raw, _mm256_set1_epi8(0x0F));
  } else if constexpr (TYPE == kQ6_K) {
    const uint8_t* b = row + (sb >> 3) * 210;
    const int j = int(sb & 7), half = j >> 2, g = j & 3;
    const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + half * 64 + (g & 1) * 32));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + half * 32));
    const __m256i l = _mm256_and_si256(_mm256_srl_epi16(ql, _mm_cvtsi32_si128((g >> 1) * 4)),
                                       _mm256_set1_epi8(0x0F));
    const __m256i h = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(g * 2)),
                                       _mm256_set1_epi8(3));
    return _mm256_or_si256(l, _mm256_slli_epi16(h, 4));
  } else if constexpr (TYPE == kQ4_0) {
    return nibbles(row + sb * 18 + 2);
  } else if constexpr (TYPE == kQ5_0) {
    const uint8_t* b = row + sb * 22;
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    return _mm256_or_si256(nibbles(b + 6), bit_bytes(qh));
  } else {  // signed bytes (Q8_0, int8 rows, MXFP4's values): + 128 is the sign bit flipped
    return _mm256_xor_si256(block_quants<TYPE>(row + sb * kBlockBytes<TYPE>), flip);
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

// Weight rows n0 .. n0 + 15 of part p (rows past its end: zero) into a panel: v (K/32 sub-blocks
// x 8 dwords x 16 rows), sc (K/32 x 2 halves x 16 rows: the halves' scales, times an int8
// row's scale), mn (K/32 x 16: Q4_K's min).
template <int TYPE>
void pack_panel(const Part& p, int64_t n0, int64_t K, uint8_t* v, float* sc, float* mn) {
  const int64_t nsub = K / 32, rows = std::min(kPanelRows, p.rows - n0);
  const uint8_t* row[kPanelRows];
  float rs[kPanelRows];
  for (int64_t r = 0; r < kPanelRows; r++) {
    row[r] = r < rows ? p.w + (n0 + r) * p.row_bytes : nullptr;
    rs[r] = r < rows && p.scale ? p.scale[n0 + r] : 1.f;
  }
  Sub scales;
  for (int64_t sb = 0; sb < nsub; sb++) {
    __m256i b[kPanelRows];
    for (int64_t r = 0; r < kPanelRows; r++) {
      if (row[r]) {
        b[r] = panel_bytes<TYPE>(row[r], sb);
        sub_scales<TYPE>(row[r], sb, scales);
      } else {
        b[r] = _mm256_setzero_si256();
        scales.s0 = scales.s1 = scales.minv = 0.f;
      }
      sc[sb * 32 + r] = scales.s0 * rs[r];
      sc[sb * 32 + 16 + r] = scales.s1 * rs[r];
      mn[sb * 16 + r] = scales.minv;
    }
    __m512i z[8], out[8];
    for (int k = 0; k < 8; k++)
      z[k] = _mm512_inserti64x4(_mm512_castsi256_si512(b[k]), b[k + 8], 1);
    transpose_panel(z, out);
    for (int t = 0; t < 8; t++) _mm512_storeu_si512(v + sb * 512 + t * 64, out[t]);
  }
}

// out (MR x 16) = MR activation rows from m0 times a packed panel. SPLIT: the halves of a
// sub-block have their own scales (Q6_K); MIN: a min per sub-block (Q4_K). The bias comes off
// in float: dx * (sum((w + bias) x) - bias * sum(x)), with dx * sum(x) per half (sh) from the
// call's activations (exact integer sums below 2^24 in float32).
template <bool SPLIT, bool MIN, int MR>
inline void panel_rows(const uint8_t* v, const float* sc, const float* mn, float bias,
                       const Act& a, const float* sh, int64_t m0, float (*out)[16]) {
  const int64_t K = a.K, nsub = K / 32;
  const __m512 bv = _mm512_set1_ps(bias);
  __m512 acc[MR];
  for (int m = 0; m < MR; m++) acc[m] = _mm512_setzero_ps();
  for (int64_t sb = 0; sb < nsub; sb++) {
    __m512i w[8];
    for (int t = 0; t < 8; t++) w[t] = _mm512_loadu_si512(v + sb * 512 + t * 64);
    constexpr int kHalves = SPLIT ? 2 : 1;
    for (int hf = 0; hf < kHalves; hf++) {
      const __m512 s = _mm512_loadu_ps(sc + sb * 32 + hf * 16);
      __m512i i[MR];
      for (int m = 0; m < MR; m++) i[m] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int t = hf * 8 / kHalves; t < (hf + 1) * 8 / kHalves; t++)
        for (int m = 0; m < MR; m++) {
          int32_t x4;
          std::memcpy(&x4, a.q + (m0 + m) * K + sb * 32 + 4 * t, 4);
          i[m] = _mm512_dpbusd_epi32(i[m], w[t], _mm512_set1_epi32(x4));
        }
      for (int m = 0; m < MR; m++) {
        const int64_t row = m0 + m;
        const float xsum = SPLIT ? sh[row * (K / 16) + sb * 2 + hf] : a.s[row * nsub + sb];
        const __m512 f = _mm512_fnmadd_ps(bv, _mm512_set1_ps(xsum),
                                          _mm512_mul_ps(_mm512_cvtepi32_ps(i[m]),
                                                        _mm512_set1_ps(a.d[row * nsub + sb])));
        acc[m] = _mm512_fmadd_ps(f, s, acc[m]);
      }
    }
    if constexpr (MIN) {
      const __m512 mv = _mm512_loadu_ps(mn + sb * 16);
      for (int m = 0; m < MR; m++)
        acc[m] = _mm512_fnmadd_ps(mv, _mm512_set1_ps(a.s[(m0 + m) * nsub + sb]), acc[m]);
    }
  }
  for (int m = 0; m < MR; m++) _mm512_storeu_ps(out[m], acc[m]);
}

template <bool SPLIT, bool MIN, typename T>
void panel_all_rows(const uint8_t* v, const float* sc, const float* mn, float bias, const Act& a,
                    const float* sh, int64_t M, const Part& p, int64_t n0, T* y, int64_t ldy) {
  float out[8][16];
  const int64_t valid = std::min(kPanelRows, p.rows - n0);
  for (int64_t m0 = 0; m0 < M;) {
    const int64_t left = M - m0;
    const int mr = left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
    switch (mr) {
      case 8: panel_rows<SPLIT, MIN, 8>(v, sc, mn, bias, a, sh, m0, out); break;
      case 4: panel_rows<SPLIT, MIN, 4>(v, sc, mn, bias, a, sh, m0, out); break;
      case 2: panel_rows<SPLIT, MIN, 2>(v, sc, mn, bias, a, sh, m0, out); break;
      default: panel_rows<SPLIT, MIN, 1>(v, sc, mn, bias, a, sh, m0, out); break;
    }
    for (int m = 0; m < mr; m++)
      for (int64_t n = 0; n < valid; n++) y[(m0 + m) * ldy + p.col + n0 + n] = T(out[m][n]);
    m0 += mr;
  }
}

// Panel `i` (local to the part) for all M rows; the buffers hold one panel of this K.
template <int TYPE, typename T>
void panel(const Part& p, int64_t i, const Act& a, const float* sh, int64_t M, T* y, int64_t ldy,
           uint8_t* v, float* sc, float* mn) {
  const int64_t n0 = i * kPanelRows;
  pack_panel<TYPE>(p, n0, a.K, v, sc, mn);
  panel_all_rows<TYPE == kQ6_K, TYPE == kQ4_K>(v, sc, mn, float(kPanelBias<TYPE>), a, sh, M, p,
                                               n0, y, ldy);
}

template <typename T>
void panel_any(const Part& p, int64_t i, const Act& a, const float* sh, int64_t M, T* y,
               int64_t ldy, uint8_t* v, float* sc, float* mn) {
  switch (p.type) {
    case kQ8_0: return panel<kQ8_0>(p, i, a, sh, M, y, ldy, v, sc, mn);
    case kQ4_0: return panel<kQ4_0>(p, i, a, sh, M, y, ldy, v, sc, mn);
    case kQ5_0: return panel<kQ5_0>(p, i, a, sh, M, y, ldy, v, sc, mn);
    case kMXFP4: return panel<kMXFP4>(p, i, a, sh, M, y, ldy, v, sc, mn);
    case kQ4_K: return panel<kQ4_K>(p, i, a, sh, M, y, ldy, v, sc, mn);
    case kQ6_K: return panel<kQ6_K>(p, i, a, sh, M, y, ldy, v, sc, mn);
    default: return panel<kI8>(p, i, a, sh, M, y, ldy, v, sc, mn);
  }
}

// A task's panel of this K (one at a time).
struct PanelBuffers {
  std::vector<uint8_t> v;
  std::vector<float> sc, mn;
  explicit PanelBuffers(int64_t K) : v(K / 32 * 512), sc(K / 32 * 32), mn(K / 32 * 16) {}
  template <typename T>
  void run(const Part& p, int64_t i, const Act& a, const float* sh, int64_t M, T* y,
           int64_t ldy) {
    panel_any(p, i, a, sh, M, y, ldy, v.data(), sc.data(), mn.data());
  }
};

// dx * sum(x) per half block, (M, K/16): Q6_K's offset per half (the others use s, per block).
inline std::vector<float> half_sums(const Act& a, int64_t M) {
  std::vector<float> sh(M * (a.K / 16));
  for (int64_t j = 0; j < M * (a.K / 16); j++) sh[j] = a.d[j / 2] * float(a.h[j]);
  return sh;
}
#endif

bool is_kernel_type(int64_t t) {
  return t == kQ4_0 || t == kQ5_0 || t == kQ8_0 || t == kMXFP4 || t == kQ4_K || t == kQ6_K ||
         t == kI8;
}

// Per block of 32 of x (M, K): d = max|x| / 127, q = round-half-even(x * (127 / max|x|)) (0 for
// an all-zero block), s = d * sum(q). The same float32 operations as the twin, so q is
// bit-identical.
template <typename scalar_t>
void quantize_into(const scalar_t* xp, int64_t M, int64_t K, int8_t* qp, float* dp, float* sp,
                   int16_t* hp) {
  const int64_t nb = K / 32;
  at::parallel_for(0, M * nb, grain_for(32 * kElementWork), [&](int64_t b0, int64_t b1) {
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
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "quantize_blocks", [&] {
    quantize_into(x.data_ptr<scalar_t>(), M, K, q.data_ptr<int8_t>(), d.data_ptr<float>(),
                  s.data_ptr<float>(), h.data_ptr<int16_t>());
  });
  return {q, d, s};
}

// y (M, N) (a view: unit column stride, any row stride) = x @ W^T for the weight parts
// ws[i] of types[i] (a GGUF block type, or -1: int8 rows times scales[i] (rows,) float32;
// other parts pass an empty scale), whose rows give y's columns cols[i] ... Columns no part
// covers are left as they are (the caller's dense parts).
void quant_matmul(const at::Tensor& x, const std::vector<at::Tensor>& ws,
                  const std::vector<int64_t>& types, const std::vector<at::Tensor>& scales,
                  const std::vector<int64_t>& cols, at::Tensor y, bool invariant) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 32 == 0,
              "x must be contiguous (M, K) with K a multiple of 32");
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
    if (type == kI8) {
      TORCH_CHECK(scales[i].scalar_type() == at::kFloat && scales[i].is_contiguous() &&
                      scales[i].numel() == w.size(0), "int8 part ", i, " needs a float32 scale per row");
      sc = scales[i].data_ptr<float>();
    }
    const int64_t nr_tile = rows_per_tile(int(type), M);
    const int64_t t = (w.size(0) + nr_tile - 1) / nr_tile;
    parts.push_back({static_cast<const uint8_t*>(w.data_ptr()), int(type), w.size(0), row_bytes,
                     cols[i], sc, tiles, t});
    tiles += t;
  }
  if (M == 0 || tiles == 0) return;
  auto q = at::empty({M, K}, x.options().dtype(at::kChar));
  auto d = at::empty({M, K / 32}, x.options().dtype(at::kFloat));
  auto s = at::empty({M, K / 32}, x.options().dtype(at::kFloat));
  auto h = at::empty({M, K / 16}, x.options().dtype(at::kShort));
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "quant_matmul_x", [&] {
    quantize_into(x.data_ptr<scalar_t>(), M, K, q.data_ptr<int8_t>(), d.data_ptr<float>(),
                  s.data_ptr<float>(), h.data_ptr<int16_t>());
  });
  const Act a{q.data_ptr<int8_t>(), d.data_ptr<float>(), s.data_ptr<float>(),
              h.data_ptr<int16_t>(), K};
  const int64_t ldy = y.stride(0);
#if defined(LADLE_QUANT_512)
  if (M >= kPanelMinRows && !invariant) {
    std::vector<int64_t> first;  // each part's first panel in the call's one range
    int64_t panels = 0;
    for (const Part& p : parts) {
      first.push_back(panels);
      panels += (p.rows + kPanelRows - 1) / kPanelRows;
    }
    const std::vector<float> sh = half_sums(a, M);
    AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, y.scalar_type(), "quant_matmul_panels", [&] {
      scalar_t* yp = y.data_ptr<scalar_t>();
      at::parallel_for(0, panels, 1, [&](int64_t i0, int64_t i1) {
        PanelBuffers buf(K);
        for (size_t j = 0; j < parts.size(); j++) {
          const int64_t n = (parts[j].rows + kPanelRows - 1) / kPanelRows;
          const int64_t lo = std::max(i0, first[j]), hi = std::min(i1, first[j] + n);
          for (int64_t i = lo; i < hi; i++) buf.run(parts[j], i - first[j], a, sh.data(), M, yp, ldy);
        }
      });
    });
    return;
  }
#endif
  const bool fold = M == 1 && !invariant;
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, y.scalar_type(), "quant_matmul", [&] {
    scalar_t* yp = y.data_ptr<scalar_t>();
    // A task's work: tiles of up to 4 weight rows (decode) or 2 (prefill) by M rows.
    at::parallel_for(0, tiles, grain_for(M * K * (M == 1 ? 4 : kNR) * kQuantWork),
                     [&](int64_t t0, int64_t t1) {
      for (const Part& p : parts) {
        const int64_t lo = std::max(t0, p.tile0), hi = std::min(t1, p.tile0 + p.tiles);
        if (lo < hi) part_tiles_any(p, lo - p.tile0, hi - p.tile0, a, M, yp, ldy, fold);
      }
    });
  });
}

// y rows of each expert = its rows of a (the activations, quantized) times its weight rows:
// expert e's parts (gate and up into columns 0 and I, or down) from the stacked tensors, tiled
// as quant_matmul tiles one expert's call (rows_per_tile by the expert's row count), all
// experts' tiles in one parallel region.
template <typename T>
static void experts_quant(const Act& a, const std::vector<const at::Tensor*>& ws,
                          const std::vector<int64_t>& types, const ExpertRows& r, int64_t K,
                          T* y, int64_t ldy, bool invariant) {
  struct Job {
    Part part;
    int64_t row0, rows;
    bool panels;  // part.tiles counts panels (quant_matmul's rule for this many rows)
  };
#if defined(LADLE_QUANT_512)
  const std::vector<float> sh = half_sums(a, static_cast<int64_t>(r.slot.size()));
  auto panels_for = [&](int64_t rows) { return rows >= kPanelMinRows && !invariant; };
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
      const int64_t nr_tile = panels ? kPanelRows : rows_per_tile(type, r.count[e]);
#else
      const int64_t nr_tile = rows_per_tile(type, r.count[e]);
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
    for (const Job& j : jobs) {
      const Part& p = j.part;
      const int64_t lo = std::max(t0, p.tile0), hi = std::min(t1, p.tile0 + p.tiles);
      if (lo >= hi) continue;
#if defined(LADLE_QUANT_512)
      if (j.panels) {
        PanelBuffers buf(K);
        for (int64_t i = lo; i < hi; i++)
          buf.run(p, i - p.tile0, a.from_row(j.row0), sh.data() + j.row0 * (K / 16), j.rows,
                  y + j.row0 * ldy, ldy);
        continue;
      }
#endif
      part_tiles_any(p, lo - p.tile0, hi - p.tile0, a.from_row(j.row0), j.rows,
                     y + j.row0 * ldy, ldy, j.rows == 1 && !invariant);
    }
  });
}

template <typename T>
static void moe_quant_kernel(const at::Tensor& x, const at::Tensor& ids,
                             const at::Tensor& weights, const at::Tensor& gate,
                             int64_t gate_type, const at::Tensor& up, int64_t up_type,
                             const at::Tensor& down, int64_t down_type, at::Tensor& y,
                             bool invariant) {
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
  // gate | up: the gathered rows quantized once for both.
  quantize_into(rows.data_ptr<T>(), P, H, q.data_ptr<int8_t>(), d.data_ptr<float>(),
                s.data_ptr<float>(), h.data_ptr<int16_t>());
  experts_quant<T>({q.data_ptr<int8_t>(), d.data_ptr<float>(), s.data_ptr<float>(),
                    h.data_ptr<int16_t>(), H}, {&gate, &up}, {gate_type, up_type}, r, H,
                   gu.data_ptr<T>(), 2 * I, invariant);
  silu_mul_kernel(static_cast<const T*>(gu.data_ptr<T>()), act.data_ptr<T>(), P, I, 2 * I);
  quantize_into(act.data_ptr<T>(), P, I, q.data_ptr<int8_t>(), d.data_ptr<float>(),
                s.data_ptr<float>(), h.data_ptr<int16_t>());
  experts_quant<T>({q.data_ptr<int8_t>(), d.data_ptr<float>(), s.data_ptr<float>(),
                    h.data_ptr<int16_t>(), I}, {&down}, {down_type}, r, I, out.data_ptr<T>(), H,
                   invariant);
  combine(static_cast<const T*>(out.data_ptr<T>()), id, weights.data_ptr<float>(),
          r.slot.data(), y.data_ptr<T>(), Tn, k, H);
}

// A mixture-of-experts block's SwiGLU experts held in GGUF blocks, in one call: moe_swiglu's
// scheme (moe.cpp) with quant_matmul's per-expert products. x (T, H) float32/bfloat16; ids
// (T, k) int64; weights (T, k) float32; gate and up (E, I, row bytes) and down (E, H, row
// bytes) uint8 of their types. Equal bit for bit to one quant_matmul per expert and
// projection (RoutedExperts' loop): the same rows, quantized the same way, tiled (or put in
// panels) the same way, under the same batch-invariant flag.
at::Tensor moe_quant_swiglu(const at::Tensor& x, const at::Tensor& ids,
                            const at::Tensor& weights, const at::Tensor& gate, int64_t gate_type,
                            const at::Tensor& up, int64_t up_type, const at::Tensor& down,
                            int64_t down_type, bool invariant) {
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
    TORCH_CHECK(is_kernel_type(type) && type != kI8, "moe_quant_swiglu: type ", type);
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
                                   down_type, y, invariant);
  else
    moe_quant_kernel<float>(x, ids, weights, gate, gate_type, up, up_type, down, down_type, y,
                            invariant);
  return y;
}

// out (T, K) = rows ids (T,) of w (N, row bytes) of `type`, dequantized: the embedding lookup.
void dequantize_rows(const at::Tensor& w, int64_t type, const at::Tensor& ids, at::Tensor out) {
  TORCH_CHECK(is_kernel_type(type) && type != kI8, "dequantize_rows: unsupported ggml type ", type);
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.scalar_type() == at::kByte, "w");
  TORCH_CHECK(ids.dim() == 1 && ids.is_contiguous() && ids.scalar_type() == at::kLong, "ids");
  const int64_t T = ids.size(0), K = out.size(1), N = w.size(0);
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.size(0) == T &&
                  w.size(1) == K / block_values(int(type)) * block_bytes(int(type)), "out");
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; t++)
    TORCH_CHECK(id[t] >= 0 && id[t] < N, "row id ", id[t], " out of range [0, ", N, ")");
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t row_bytes = w.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, out.scalar_type(), "dequantize_rows", [&] {
    scalar_t* op = out.data_ptr<scalar_t>();
    for (int64_t t = 0; t < T; t++) {
      const uint8_t* row = wp + id[t] * row_bytes;
      for (int64_t sb = 0; sb < K / 32; sb++) {
        Sub s;
        unpack_any(int(type), row, sb, s);
        for (int i = 0; i < 32; i++)
          op[t * K + sb * 32 + i] = scalar_t((i < 16 ? s.s0 : s.s1) * float(s.q[i]) - s.minv);
      }
    }
  });
}

std::string quant_isa() {
#if defined(LADLE_QUANT_512) && defined(__AVX512VL__)
  return "avx512-vnni (256-bit tiles, 512-bit panels from 12 rows)";
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
