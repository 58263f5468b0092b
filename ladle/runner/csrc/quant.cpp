// Quantized linears: y (M, N) = x (M, K) @ W (N, K)^T where W's rows are parts, each in GGUF
// blocks (Q8_0, Q4_0, Q5_0, Q4_K, Q6_K) or int8 with a scale per row, and x is quantized to int8
// once per call for all parts. One call, one parallel region: a decode step's small matmuls
// (0.2-2 MB of weights, 10-100 us) would otherwise spend a third of their time in Python and in
// the threads' wake-ups and joins. The pure-torch twin is in ladle/runner/quant.py; the tests
// compare the two.
//
// The scheme (ggml's, written afresh): the activations are int8 per block of 32 values with a
// float scale (d = max|x| / 127); a weight block of 32 is unpacked in registers to 32 int8
// values with a float scale per 16 or 32 values (and, for Q4_K, a min); the 32 products are
// summed in integers (AVX2 vpmaddubsw + vpmaddwd, or VNNI vpdpbusd), converted once and scaled
// by d_w * d_x. vpmaddubsw multiplies unsigned by signed bytes, so signed weights go in as
// |w| with the sign moved onto x (vpsignb); Q4_K's unsigned nibbles go in directly and its min
// is subtracted per sub-block as min * d_x * sum(q_x), the activation block's sum kept beside
// its scale. An int8 row is read as Q8_0 blocks with scale 1, and its row scale multiplies the
// sum at the end. Everything is exact in integers up to the float32 scaling: the result equals
// the float64 product of the dequantized weights and activations to ~1e-6 relative.
//
// The K-quants' activations stay in blocks of 32, not ggml's super-blocks of 256 (Q8_K, whose
// integer sums over a super-block save the per-block float scaling): measured on the Gemma file,
// Q8_K activations took KL(f32 || ladle) from 0.0031 to 0.0056 (llama.cpp's own: 0.0049) with no
// gain in speed on this AVX2 machine, where decode is bound by memory and prefill by the
// multiplies both layouts share.
//
// Threads split N. Each task multiplies a tile of NR weight rows by MR activation rows while the
// weight blocks are in registers, so for decode (M <= 4) the weights are read once at memory
// speed, and for prefill every unpacked weight block serves MR rows.
#include "quant.h"
#include "vec.h"

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define LADLE_QUANT_AVX2 1
#include <immintrin.h>
#endif

namespace {

constexpr int kQ4_0 = 2, kQ5_0 = 6, kQ8_0 = 8, kQ4_K = 12, kQ6_K = 14;
constexpr int kI8 = -1;  // int8 rows with a float scale per row (quant.py's INT8_ROW)

// (values per block, bytes per block), as gguf's GGML_QUANT_SIZES.
inline int64_t block_values(int type) { return (type == kQ4_K || type == kQ6_K) ? 256 : 32; }
inline int64_t block_bytes(int type) {
  switch (type) {
    case kQ4_0: return 18;
    case kQ5_0: return 22;
    case kQ8_0: return 34;
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

// Sub-block `sb` (values 32*sb .. 32*sb+31) of a row of `type` blocks.
template <int TYPE>
inline void unpack_scalar(const uint8_t* row, int64_t sb, Sub& o) {
  o.minv = 0.f;
  if constexpr (TYPE == kI8) {
    o.s0 = o.s1 = 1.f;
    std::memcpy(o.q, row + sb * 32, 32);
  } else if constexpr (TYPE == kQ8_0) {
    const uint8_t* b = row + sb * 34;
    o.s0 = o.s1 = f16(b);
    std::memcpy(o.q, b + 2, 32);
  } else if constexpr (TYPE == kQ4_0) {
    const uint8_t* b = row + sb * 18;
    o.s0 = o.s1 = f16(b);
    for (int i = 0; i < 16; i++) {
      o.q[i] = int8_t((b[2 + i] & 0xF) - 8);
      o.q[i + 16] = int8_t((b[2 + i] >> 4) - 8);
    }
  } else if constexpr (TYPE == kQ5_0) {
    const uint8_t* b = row + sb * 22;
    o.s0 = o.s1 = f16(b);
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    for (int i = 0; i < 16; i++) {
      o.q[i] = int8_t(((b[6 + i] & 0xF) | (((qh >> i) & 1) << 4)) - 16);
      o.q[i + 16] = int8_t(((b[6 + i] >> 4) | (((qh >> (i + 16)) & 1) << 4)) - 16);
    }
  } else if constexpr (TYPE == kQ4_K) {
    const uint8_t* b = row + (sb >> 3) * 144;
    const int j = int(sb & 7);
    int sc, mn;
    k4_scale_min(b + 4, j, sc, mn);
    o.s0 = o.s1 = f16(b) * float(sc);
    o.minv = f16(b + 2) * float(mn);
    const uint8_t* qs = b + 16 + (j >> 1) * 32;
    for (int i = 0; i < 32; i++) o.q[i] = int8_t((j & 1) ? (qs[i] >> 4) : (qs[i] & 0xF));
  } else {  // Q6_K: ql[128], qh[64], int8 scales[16], d
    const uint8_t* b = row + (sb >> 3) * 210;
    const int j = int(sb & 7), half = j >> 2, g = j & 3;
    const uint8_t* ql = b + half * 64 + (g & 1) * 32;
    const uint8_t* qh = b + 128 + half * 32;
    const int shift_l = (g >> 1) * 4, shift_h = g * 2;
    const float d = f16(b + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192) + half * 8 + g * 2;
    o.s0 = d * float(sc[0]);
    o.s1 = d * float(sc[1]);
    for (int i = 0; i < 32; i++)
      o.q[i] = int8_t((((ql[i] >> shift_l) & 0xF) | (((qh[i] >> shift_h) & 3) << 4)) - 32);
  }
}

inline void unpack_any(int type, const uint8_t* row, int64_t sb, Sub& o) {
  switch (type) {
    case kQ8_0: return unpack_scalar<kQ8_0>(row, sb, o);
    case kQ4_0: return unpack_scalar<kQ4_0>(row, sb, o);
    case kQ5_0: return unpack_scalar<kQ5_0>(row, sb, o);
    case kQ4_K: return unpack_scalar<kQ4_K>(row, sb, o);
    case kI8: return unpack_scalar<kI8>(row, sb, o);
    default: return unpack_scalar<kQ6_K>(row, sb, o);
  }
}

// The activations, quantized once per call: int8 q (M, K), and per block of 32 the scale d and
// s = d * sum(q) (what Q4_K's mins need).
struct Act {
  const int8_t* q;
  const float* d;
  const float* s;
  int64_t K;
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

// A weight block of TYPE, read in two steps: its header once (the float scale of each half
// sub-block of 16 values, and for Q4_K the min of each sub-block), then each sub-block's 32
// values as int8 (signed; Q4_K's unsigned nibbles). A block is 32 values (Q8_0, Q4_0, Q5_0:
// one sub-block) or a super-block of 256 (Q4_K, Q6_K: eight), so the K-quants' 6-bit scales
// are decoded once per eight sub-blocks, not per sub-block.
template <int TYPE> constexpr int kSubs = (TYPE == kQ4_K || TYPE == kQ6_K) ? 8 : 1;

template <int TYPE>
inline void block_header(const uint8_t* b, float* sc /* 2 * kSubs */, float* mn /* kSubs */) {
  if constexpr (TYPE == kQ4_K) {
    const float d = f16(b), dmin = f16(b + 2);
    for (int j = 0; j < 8; j++) {
      int s, m;
      k4_scale_min(b + 4, j, s, m);
      sc[2 * j] = sc[2 * j + 1] = d * float(s);
      mn[j] = dmin * float(m);
    }
  } else if constexpr (TYPE == kQ6_K) {
    const float d = f16(b + 208);
    const int8_t* s = reinterpret_cast<const int8_t*>(b + 192);
    // Sub-block j (half j / 4, run j % 4) has the scales 8 * (j / 4) + 2 * (j % 4) + {0, 1}:
    // the same order as j's two halves, so the 16 scales are in sub-block order already.
    for (int i = 0; i < 16; i++) sc[i] = d * float(s[i]);
  } else if constexpr (TYPE == kI8) {
    sc[0] = sc[1] = 1.f;
  } else {
    sc[0] = sc[1] = f16(b);
  }
}

template <int TYPE>
inline __m256i block_quants(const uint8_t* b, int j) {
  if constexpr (TYPE == kI8) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));
  } else if constexpr (TYPE == kQ8_0) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
  } else if constexpr (TYPE == kQ4_0) {
    return _mm256_sub_epi8(nibbles(b + 2), _mm256_set1_epi8(8));
  } else if constexpr (TYPE == kQ5_0) {
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    return _mm256_sub_epi8(_mm256_or_si256(nibbles(b + 6), bit_bytes(qh)), _mm256_set1_epi8(16));
  } else if constexpr (TYPE == kQ4_K) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 + (j >> 1) * 32));
    return _mm256_and_si256((j & 1) ? _mm256_srli_epi16(raw, 4) : raw, _mm256_set1_epi8(0x0F));
  } else {  // Q6_K
    const int half = j >> 2, g = j & 3;
    const __m256i ql = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(b + half * 64 + (g & 1) * 32));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + half * 32));
    const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(ql, (g >> 1) * 4), _mm256_set1_epi8(0x0F));
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qh, g * 2), _mm256_set1_epi8(3));
    return _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), _mm256_set1_epi8(32));
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
// (lane i: its values 4i..4i+3, scaled by the scale of that half), and for Q4_K the eight
// sub-blocks' min terms of a super-block at once (lane j: -min_j * d_x * sum(q_x) of
// sub-block j).
// Each weight row is a stream from memory; the hardware prefetcher alone kept a core at 5-9 GB/s
// on the K-quants (their unpacking leaves few loads in flight). Measured on an AVX2 EPYC, one
// activation row, 50-180 MB of weights: 4 KB ahead gives 11-13 GB/s for every type (1 KB:
// 9-13, 2 KB no better; L1 or L2 hint the same).
constexpr int64_t kPrefetchBytes = 4096;

template <int TYPE, int MR, int NR>
inline void tile(const uint8_t* const* w, const int8_t* qx, const float* dx, const float* sx,
                 int64_t K, float (*out)[NR]) {
  constexpr int S = kSubs<TYPE>;
  constexpr int64_t BV = 32 * S, BB = TYPE == kI8 ? 32 : TYPE == kQ8_0 ? 34 : TYPE == kQ4_0 ? 18
                                     : TYPE == kQ5_0 ? 22 : TYPE == kQ4_K ? 144 : 210;
  __m256 acc[MR][NR];
  for (int m = 0; m < MR; m++)
    for (int n = 0; n < NR; n++) acc[m][n] = _mm256_setzero_ps();
  const int64_t nsub = K / 32, nblocks = K / BV;
  for (int64_t blk = 0; blk < nblocks; blk++) {
    float sc[NR][2 * S], mn[NR][S];
    const uint8_t* b[NR];
    for (int n = 0; n < NR; n++) {
      b[n] = w[n] + blk * BB;
      for (int64_t off = 0; off < BB; off += 64)  // the row's stream, kPrefetchBytes ahead
        _mm_prefetch(reinterpret_cast<const char*>(b[n]) + kPrefetchBytes + off, _MM_HINT_T0);
      block_header<TYPE>(b[n], sc[n], mn[n]);
    }
    if constexpr (TYPE == kQ4_K) {
      for (int m = 0; m < MR; m++) {
        const __m256 sum = _mm256_loadu_ps(sx + m * nsub + blk * 8);
        for (int n = 0; n < NR; n++)
          acc[m][n] = _mm256_fnmadd_ps(_mm256_loadu_ps(mn[n]), sum, acc[m][n]);
      }
    }
    for (int j = 0; j < S; j++) {
      const int64_t sb = blk * S + j;
      __m256i q[NR], aq[NR];
      __m256 s[NR];
      for (int n = 0; n < NR; n++) {
        q[n] = block_quants<TYPE>(b[n], j);
        aq[n] = TYPE == kQ4_K ? q[n] : _mm256_sign_epi8(q[n], q[n]);  // |w| for vpmaddubsw
        s[n] = _mm256_set_m128(_mm_set1_ps(sc[n][2 * j + 1]), _mm_set1_ps(sc[n][2 * j]));
      }
      for (int m = 0; m < MR; m++) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + m * K + sb * 32));
        const __m256 d = _mm256_broadcast_ss(dx + m * nsub + sb);
        for (int n = 0; n < NR; n++) {
          // Signed weights: the sign moves onto x, so |w| (unsigned) times sign(w) * x.
          const __m256i xs = TYPE == kQ4_K ? xv : _mm256_sign_epi8(xv, q[n]);
          const __m256 p = _mm256_cvtepi32_ps(dot_u8s8(aq[n], xs));
          acc[m][n] = _mm256_fmadd_ps(p, _mm256_mul_ps(s[n], d), acc[m][n]);
        }
      }
    }
  }
  for (int m = 0; m < MR; m++)
    for (int n = 0; n < NR; n++) out[m][n] = hsum(acc[m][n]);
}
#else
template <int TYPE, int MR, int NR>
inline void tile(const uint8_t* const* w, const int8_t* qx, const float* dx, const float* sx,
                 int64_t K, float (*out)[NR]) {
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
// by measurement (AVX2 EPYC, one activation row, 80-180 MB of weights, GB/s at 1 / 2 / 3 / 4
// rows): Q8_0 20.8 / 17.3 / 15.9 / 14.6, Q6_K 14.5 / 12.8 / 13.2 / 11.7, Q4_K 10.4 / 12.8 /
// 13.5 / 13.9, Q5_0 13.7 / 14.0 / 13.9 / 13.9. A byte-dense type streams fastest as one row at
// a time; the 4-bit ones need four rows' work to hide their unpacking.
constexpr int kNR = 2, kMR = 4;
template <int TYPE> constexpr int kDecodeRows =
    (TYPE == kQ8_0 || TYPE == kI8 || TYPE == kQ6_K) ? 1 : 4;
inline int64_t rows_per_tile(int type, int64_t M) {
  if (M > 1) return kNR;
  return (type == kQ8_0 || type == kI8 || type == kQ6_K) ? 1 : 4;
}
// grain_for counts bf16 multiply-adds; a quantized one also unpacks its weight (nibbles, high
// bits, sign): measured on an AVX2 EPYC at one activation row, Q5_0 ran ~10 G/s per core
// against the bf16 kernel's ~70. Counting each as this many units keeps the tasks of a
// decode-sized matmul (0.5-2 M multiply-adds) on both cores instead of one.
constexpr int64_t kQuantWork = 4;

// y[m][p.col + n] for MR activation rows from m0 and the NR weight rows from n0.
template <int TYPE, int MR, int NR, typename T>
inline void store_tile(const Part& p, const Act& a, int64_t m0, int64_t n0, T* y, int64_t ldy) {
  const uint8_t* wr[NR];
  for (int n = 0; n < NR; n++) wr[n] = p.w + (n0 + n) * p.row_bytes;
  const int64_t nsub = a.K / 32;
  float out[MR][NR];
  tile<TYPE, MR, NR>(wr, a.q + m0 * a.K, a.d + m0 * nsub, a.s + m0 * nsub, a.K, out);
  for (int m = 0; m < MR; m++)
    for (int n = 0; n < NR; n++)
      y[(m0 + m) * ldy + p.col + n0 + n] = T(p.scale ? out[m][n] * p.scale[n0 + n] : out[m][n]);
}

// Tiles t0 .. t1 - 1 (local to the part) for all M activation rows.
template <int TYPE, typename T>
void part_tiles(const Part& p, int64_t t0, int64_t t1, const Act& a, int64_t M, T* y,
                int64_t ldy) {
  constexpr int NR1 = kDecodeRows<TYPE>;
  const int64_t nr_tile = rows_per_tile(TYPE, M);
  for (int64_t t = t0; t < t1; t++) {
    const int64_t n0 = t * nr_tile;
    if (M == 1) {
      if (n0 + NR1 <= p.rows) {
        store_tile<TYPE, 1, NR1>(p, a, 0, n0, y, ldy);
      } else {
        for (int64_t n = n0; n < p.rows; n++) store_tile<TYPE, 1, 1>(p, a, 0, n, y, ldy);
      }
      continue;
    }
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
                    int64_t ldy) {
  switch (p.type) {
    case kQ8_0: return part_tiles<kQ8_0>(p, t0, t1, a, M, y, ldy);
    case kQ4_0: return part_tiles<kQ4_0>(p, t0, t1, a, M, y, ldy);
    case kQ5_0: return part_tiles<kQ5_0>(p, t0, t1, a, M, y, ldy);
    case kQ4_K: return part_tiles<kQ4_K>(p, t0, t1, a, M, y, ldy);
    case kQ6_K: return part_tiles<kQ6_K>(p, t0, t1, a, M, y, ldy);
    default: return part_tiles<kI8>(p, t0, t1, a, M, y, ldy);
  }
}

bool is_kernel_type(int64_t t) {
  return t == kQ4_0 || t == kQ5_0 || t == kQ8_0 || t == kQ4_K || t == kQ6_K || t == kI8;
}

// Per block of 32 of x (M, K): d = max|x| / 127, q = round-half-even(x * (127 / max|x|)) (0 for
// an all-zero block), s = d * sum(q). The same float32 operations as the twin, so q is
// bit-identical.
template <typename scalar_t>
void quantize_into(const scalar_t* xp, int64_t M, int64_t K, int8_t* qp, float* dp, float* sp) {
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
      int32_t sum = 0;
      for (int i = 0; i < 32; i++) {
        const int32_t r = int32_t(std::nearbyint(v[i] * inv));
        qp[b * 32 + i] = int8_t(r);
        sum += r;
      }
      dp[b] = amax / 127.f;
      sp[b] = dp[b] * float(sum);
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
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "quantize_blocks", [&] {
    quantize_into(x.data_ptr<scalar_t>(), M, K, q.data_ptr<int8_t>(), d.data_ptr<float>(),
                  s.data_ptr<float>());
  });
  return {q, d, s};
}

// y (M, N) (a view: unit column stride, any row stride) = x @ W^T for the weight parts
// ws[i] of types[i] (a GGUF block type, or -1: int8 rows times scales[i] (rows,) float32;
// other parts pass an empty scale), whose rows give y's columns cols[i] ... Columns no part
// covers are left as they are (the caller's dense parts).
void quant_matmul(const at::Tensor& x, const std::vector<at::Tensor>& ws,
                  const std::vector<int64_t>& types, const std::vector<at::Tensor>& scales,
                  const std::vector<int64_t>& cols, at::Tensor y) {
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
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "quant_matmul_x", [&] {
    quantize_into(x.data_ptr<scalar_t>(), M, K, q.data_ptr<int8_t>(), d.data_ptr<float>(),
                  s.data_ptr<float>());
  });
  const Act a{q.data_ptr<int8_t>(), d.data_ptr<float>(), s.data_ptr<float>(), K};
  const int64_t ldy = y.stride(0);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, y.scalar_type(), "quant_matmul", [&] {
    scalar_t* yp = y.data_ptr<scalar_t>();
    // A task's work: tiles of up to 4 weight rows (decode) or 2 (prefill) by M rows.
    at::parallel_for(0, tiles, grain_for(M * K * (M == 1 ? 4 : kNR) * kQuantWork),
                     [&](int64_t t0, int64_t t1) {
      for (const Part& p : parts) {
        const int64_t lo = std::max(t0, p.tile0), hi = std::min(t1, p.tile0 + p.tiles);
        if (lo < hi) part_tiles_any(p, lo - p.tile0, hi - p.tile0, a, M, yp, ldy);
      }
    });
  });
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
#if defined(LADLE_QUANT_AVX2) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return "avx512-vnni (256-bit)";
#elif defined(LADLE_QUANT_AVX2) && defined(__AVXVNNI__)
  return "avx-vnni";
#elif defined(LADLE_QUANT_AVX2)
  return "avx2";
#else
  return "portable";
#endif
}
