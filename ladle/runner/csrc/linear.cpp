// Small-M linear (decode's one to a few rows times every weight matrix).
#include <type_traits>

#include "kernels.h"
#include "vec.h"

#if defined(__AVX512F__) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define LADLE_LINEAR_AMX 1  // bfloat16 linears on the tile unit (vec.h asks Linux for the tiles)
#include <atomic>
#include <memory>
#endif

// ---------------------------------------------------------------------------------------------
// Small-M linear: y (M, N) = x (M, K) @ w (N, K)^T + b. Decode multiplies one (or a few) rows by
// every weight matrix, so the cost is streaming the weights once; torch's bf16 path reaches a
// fraction of the memory bandwidth for a single row. Threads split N; each block of 4 weight rows
// is used for every row of x while it is in L1, so the weights are read from memory once.

template <typename T>
static inline void dot_block_scalar(const T* x, const T* w, int64_t M, int64_t K, int64_t ldx,
                                    int64_t nb, float* out /* (M, nb) */) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < nb; ++j) {
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc += to_f(x[m * ldx + k]) * to_f(w[j * K + k]);
      out[m * nb + j] = acc;
    }
}

#if defined(__AVX512F__)
// The blocks of 4 weight rows ahead whose same offset is prefetched into L2 while this block is
// multiplied: the streams from memory then run ahead of the loads. Measured on a Zen 4 at 8 rows
// of x: 2 blocks ahead into L2 reads 1.2-1.5x faster than 1 block ahead into L1 (which is no
// better than no prefetch); more distance changes nothing.
constexpr int64_t kPrefetchBlocks = 2;

// One step over K of one (x row, weight row) product: S values of each loaded (load_step) and
// multiplied into a float32 accumulator (fma_step). dot4_lanes and dot4_seq below both take
// these steps, the same hsum4 and the same tail (dot4_finish), so they give the same bits.
#if defined(__AVX512BF16__)
// vdpbf16ps: 32 bf16 products per instruction, summed in pairs into 16 float lanes.
constexpr bool kBf16Dot = true;
static inline __m512i load_step(const at::BFloat16* p) {
  return _mm512_loadu_si512(reinterpret_cast<const void*>(p));
}
static inline __m512 fma_step(__m512 acc, __m512i x, __m512i w) {
  return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)w);
}
#else
constexpr bool kBf16Dot = false;
static inline __m512 load_step(const at::BFloat16* p) { return load16(p); }
#endif
static inline __m512 load_step(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 fma_step(__m512 acc, __m512 x, __m512 w) { return _mm512_fmadd_ps(x, w, acc); }
template <typename T>
constexpr int64_t step_len() { return std::is_same_v<T, at::BFloat16> && kBf16Dot ? 32 : 16; }

// out[m * 4 + j] += the products of K's tail [k, K), one after another. Out of line, so that
// every caller runs the very same compiled loop (inlined copies were vectorised differently, and
// float32 sums then differed in the last bit).
template <typename T>
__attribute__((noinline)) static void add_tail4(const T* x, const T* w, int64_t MB, int64_t K,
                                                int64_t ldx, int64_t k, float* out) {
  for (int64_t m = 0; m < MB; ++m)
    for (int j = 0; j < 4; ++j)
      for (int64_t kk = k; kk < K; ++kk)
        out[m * 4 + j] += to_f(x[m * ldx + kk]) * to_f(w[j * K + kk]);
}

// out[m * 4 + j] = the horizontal sums of acc[m][j] plus the products of K's tail from k on.
template <int MB, typename T>
static inline void dot4_finish(const __m512 (&acc)[MB][4], const T* x, const T* w, int64_t K,
                               int64_t ldx, int64_t k, float* out) {
  for (int m = 0; m < MB; ++m) _mm_storeu_ps(out + m * 4, hsum4(acc[m]));
  if (k < K) add_tail4(x, w, MB, K, ldx, k, out);
}

// out[m * 4 + j] = x[m] . w[j] for MB rows of x (up to 6: 24 accumulators + 4 weight vectors +
// one x vector fit the 32 registers) and 4 rows of w, the four rows side by side; the weights PF
// blocks ahead are prefetched with HINT (dot4 below chooses; bfloat16 without vdpbf16ps
// prefetches nothing, as measured before).
template <int MB, int PF = kPrefetchBlocks, int HINT = _MM_HINT_T1, typename T>
static inline void dot4_lanes(const T* x, const T* w, int64_t K, int64_t ldx, float* out) {
  constexpr int64_t S = step_len<T>();
  constexpr bool prefetch = std::is_same_v<T, float> || kBf16Dot;
  __m512 acc[MB][4];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + S <= K; k += S) {
    decltype(load_step(w)) wv[4];
    for (int j = 0; j < 4; ++j) {
      if constexpr (prefetch)
        _mm_prefetch(reinterpret_cast<const char*>(w + (j + 4 * PF) * K + k),
                     static_cast<_mm_hint>(HINT));
      wv[j] = load_step(w + j * K + k);
    }
    for (int m = 0; m < MB; ++m) {
      const auto xv = load_step(x + m * ldx + k);
      for (int j = 0; j < 4; ++j) acc[m][j] = fma_step(acc[m][j], xv, wv[j]);
    }
  }
  dot4_finish<MB>(acc, x, w, K, ldx, k, out);
}

// dot4_seq issues no software prefetch: the hardware's stream prefetcher alone reads fastest.
// A 2 KB-ahead L2 prefetch for one row of x measured 1.035-1.088x in process on a Zen 4 on
// 2026-12-06, but on 2026-12-07 (a Zen 4 again; weights and KV cache on 2 MiB pages) every
// distance slowed it: 0.6B bf16 single-stream decode, the distance flipped step by step in one
// engine, against none: 512 B 0.99x, 1 KB 0.97-1.00x, 1.5 KB 0.99x, 2 KB 0.85-0.91x (0.97x with
// the weights on 4 KiB pages), 2.5 KB 0.92x, 3 KB 0.93x, 8 KB 0.98x; the linears alone at the
// 0.6B's shapes (two threads, 2 MiB pages) read 1.12-1.30x faster without it in bf16, 1.02-1.26x
// in float32. The non-temporal hint ran 0.88x the day before.

// dot4_lanes' products, each weight row's to the end before the next row's: a thread then reads
// its share of the weights as one sequential stream (four rows side by side are four streams
// 2K bytes apart, which Zen 4's prefetcher follows less well). One accumulator per pair is one
// dependency chain, yet fast enough: a standalone loop over 512 MB of bf16 weights (Zen 4, one
// row of x) read 29-31 GB/s on one core this way, 19-24 side by side, 29-31 with dot_row's four
// interleaved accumulators (which this replaced); 54-60 against 35-47 on two cores. The same
// steps, sums and tail as dot4_lanes, so the same bits: batch-invariant mode takes it too.
template <int MB, typename T>
static inline void dot4_seq(const T* x, const T* w, int64_t K, int64_t ldx, float* out) {
  constexpr int64_t S = step_len<T>();
  __m512 acc[MB][4];
  int64_t k = 0;
  for (int j = 0; j < 4; ++j) {
    const T* wj = w + j * K;
    for (int m = 0; m < MB; ++m) acc[m][j] = _mm512_setzero_ps();
    for (k = 0; k + S <= K; k += S) {
      const auto wv = load_step(wj + k);
      for (int m = 0; m < MB; ++m) acc[m][j] = fma_step(acc[m][j], load_step(x + m * ldx + k), wv);
    }
  }
  dot4_finish<MB>(acc, x, w, K, ldx, k, out);
}

// One row of x (single-stream decode, where the weights are streamed once per token) on Intel's
// cores prefetches the next block into L1 rather than two blocks ahead into L2 (bfloat16). On a
// 2-core Xeon with AMX (KVM, 2026-12-06), the 0.6B's 112 bf16 linears (0.88 GB, two threads, a
// standalone loop alternating the variants, two runs): 2 blocks into L2 25.8-26.8 ms, 1 into
// L1 25.5-25.7, 2 into L1 25.8-26.3, 3 into L1 26.6-26.8, none 31.9-32.6; plain reads of the
// same bytes 25.0-25.6. Zen 4 measured the L1 prefetch no better than none (above).
template <int MB, typename T>
static inline void dot4(const T* x, const T* w, int64_t K, int64_t ldx, float* out) {
  if (std::is_same_v<T, at::BFloat16> && MB == 1 && intel_cpu())
    dot4_lanes<MB, 1, _MM_HINT_T0>(x, w, K, ldx, out);
  else
    dot4_lanes<MB>(x, w, K, ldx, out);
}
#endif

// Rows of x per register block: 6 x 4 accumulators + 4 weight vectors + one x vector = 29 of
// the 32 vector registers (AVX-512); 3 in AVX2 builds (dot4 there: 12 + 3 + 1 of 16).
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kRowBlock = 3;
#else
constexpr int64_t kRowBlock = 6;
#endif

// Up to this many rows of x, weight rows are read one after another instead of four at a time.
// Each thread then reads its share of the weights as one sequential stream; the four-row blocks
// above read four streams 2*K bytes apart, which the hardware prefetcher follows less well.
// Measured on a Zen 4 at the Qwen3-0.6B shapes, one row of x: 1.1-1.6x the bandwidth of the
// four-row blocks (the machine's bandwidth varies from run to run; never slower). From 4 rows
// on, the four-row blocks win: they load each weight vector once for up to 24 products. In
// AVX-512 builds float32 takes one row only: two rows of float32 (0.6B shapes, Zen 4, two
// threads, builds alternating) read 29-31 GB/s sequentially against 33-34 in the blocks, while
// bfloat16's two rows read 31-35 against 30-32.
constexpr int64_t kSequentialRows = 2;
#if defined(__AVX512F__)
template <typename T>
constexpr int64_t sequential_rows() { return std::is_same_v<T, float> ? 1 : kSequentialRows; }
#endif

// Whether 1-2 rows take the sequential path: on AMD's cores, where it was measured faster, and
// not on Intel's. On a 2-core Sapphire Rapids-class Xeon (KVM,
// 2026-12-04), one row against 28 layers of the 0.6B's weights (0.88 GB, two threads): the
// sequential path read 22.4-22.6 GB/s, with software prefetch 16-32 KB ahead and two to four
// rows in flight at most 25.1, and the four-row blocks 25.0-26.8 (end to end, single-stream
// decode of the 0.6B 18.6 against 21.9 tok/s). Decided once per process from the CPU's vendor
// (vec.h's intel_cpu), so a machine always takes the same path (and the same bits).
static bool sequential_rows_preferred() {
#if defined(__AVX512F__)
  return !intel_cpu();
#else
  return true;
#endif
}


#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// AVX2 + FMA (8 float lanes, 16 vector registers), for CPUs without AVX-512 (Zen 2/3, most
// client Intel parts): the same two shapes as above. bfloat16 is widened to float on load.
#define LADLE_LINEAR_AVX2 1
#include <immintrin.h>
static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 16 values as two vectors of 8 floats. bfloat16 is widened by interleaving with zeros, which
// puts values 0-3, 8-11 in the first vector and 4-7, 12-15 in the second: x and w are widened
// alike, so the products pair up, and one load and two unpacks serve 16 values (the per-8
// widening costs two loads and four shuffles, and the single-row dot is bound by them).
static inline void widen16(const float* p, __m256& a, __m256& b) {
  a = _mm256_loadu_ps(p);
  b = _mm256_loadu_ps(p + 8);
}
static inline void widen16(const at::BFloat16* p, __m256& a, __m256& b) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i zero = _mm256_setzero_si256();
  a = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, raw));
  b = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, raw));
}

// out[m * 4 + j] = x[m] . w[j] for MB (up to 3) rows of x and 4 rows of w, bfloat16: 16 values
// of K per step (widen16), each x and w half widened once for its 4 (or MB) products. Measured
// in cache on one core of this AVX2 EPYC: 1.08-1.27x the per-8 widening from 1 to 32 rows.
template <int MB>
static inline void dot4(const at::BFloat16* x, const at::BFloat16* w, int64_t K, int64_t ldx,
                        float* out) {
  __m256 acc[MB][4];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < 4; ++j) acc[m][j] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m256 xa[MB], xb[MB];
    for (int m = 0; m < MB; ++m) widen16(x + m * ldx + k, xa[m], xb[m]);
    for (int j = 0; j < 4; ++j) {
      __m256 wa, wb;
      widen16(w + j * K + k, wa, wb);
      for (int m = 0; m < MB; ++m) {
        acc[m][j] = _mm256_fmadd_ps(xa[m], wa, acc[m][j]);
        acc[m][j] = _mm256_fmadd_ps(xb[m], wb, acc[m][j]);
      }
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < 4; ++j) {
      float v = hsum8(acc[m][j]);
      for (int64_t kk = k; kk < K; ++kk) v += to_f(x[m * ldx + kk]) * to_f(w[j * K + kk]);
      out[m * 4 + j] = v;
    }
}

// The same for float32, 8 values per step: 12 accumulators, 3 x vectors and one weight vector
// fill the 16 registers (the 16-value step spills there and ran 0.7-0.8x as fast).
template <int MB>
static inline void dot4(const float* x, const float* w, int64_t K, int64_t ldx, float* out) {
  __m256 acc[MB][4];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < 4; ++j) acc[m][j] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 xv[MB];
    for (int m = 0; m < MB; ++m) xv[m] = _mm256_loadu_ps(x + m * ldx + k);
    for (int j = 0; j < 4; ++j) {
      const __m256 wv = _mm256_loadu_ps(w + j * K + k);
      for (int m = 0; m < MB; ++m) acc[m][j] = _mm256_fmadd_ps(xv[m], wv, acc[m][j]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < 4; ++j) {
      float v = hsum8(acc[m][j]);
      for (int64_t kk = k; kk < K; ++kk) v += x[m * ldx + kk] * w[j * K + kk];
      out[m * 4 + j] = v;
    }
}

// out[m] = x[m] . w for MB rows of x and one weight row: U chunks of 16 values in flight, each
// half with its own accumulator (2U independent FMA chains per row).
template <int MB, int U, typename T>
static inline void dot_row(const T* x, const T* w, int64_t K, int64_t ldx, float* out) {
  __m256 acc[2 * U][MB];
  for (int u = 0; u < 2 * U; ++u)
    for (int m = 0; m < MB; ++m) acc[u][m] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 16 * U <= K; k += 16 * U)
    for (int u = 0; u < U; ++u) {
      __m256 wa, wb;
      widen16(w + k + 16 * u, wa, wb);
      for (int m = 0; m < MB; ++m) {
        __m256 xa, xb;
        widen16(x + m * ldx + k + 16 * u, xa, xb);
        acc[2 * u][m] = _mm256_fmadd_ps(xa, wa, acc[2 * u][m]);
        acc[2 * u + 1][m] = _mm256_fmadd_ps(xb, wb, acc[2 * u + 1][m]);
      }
    }
  for (; k + 16 <= K; k += 16) {
    __m256 wa, wb;
    widen16(w + k, wa, wb);
    for (int m = 0; m < MB; ++m) {
      __m256 xa, xb;
      widen16(x + m * ldx + k, xa, xb);
      acc[0][m] = _mm256_fmadd_ps(xa, wa, acc[0][m]);
      acc[1][m] = _mm256_fmadd_ps(xb, wb, acc[1][m]);
    }
  }
  for (int m = 0; m < MB; ++m) {
    __m256 s = acc[0][m];
    for (int u = 1; u < 2 * U; ++u) s = _mm256_add_ps(s, acc[u][m]);
    float v = hsum8(s);
    for (int64_t kk = k; kk < K; ++kk) v += to_f(x[m * ldx + kk]) * to_f(w[kk]);
    out[m] = v;
  }
}
#endif

// invariant: a row's result is the same bits whatever M. Each (row, weight row) pair
// accumulates over K in one fixed order in the four-row blocks (one accumulator per pair, step
// after step, the same horizontal sum), and which weight rows form a block depends on N only.
// AVX-512's sequential path (dot4_seq) computes the very same pairs, so it serves both modes;
// AVX2's (dot_row) sums interleaved accumulators instead, so that build sends every M through
// the blocks in this mode. The portable build has one loop (dot_block_scalar) for both.

#if defined(__AVX512F__) || defined(LADLE_LINEAR_AVX2)
// The register block of mb (1 .. kRowBlock) rows of x against 4 weight rows.
template <typename T>
static inline void dot4_block(int64_t mb, const T* xm, const T* w4, int64_t K, int64_t ldx,
                              float* out) {
  switch (mb) {
    case 1: dot4<1>(xm, w4, K, ldx, out); break;
    case 2: dot4<2>(xm, w4, K, ldx, out); break;
    default:
      if constexpr (kRowBlock > 3) {
        switch (mb) {
          case 3: dot4<3>(xm, w4, K, ldx, out); break;
          case 4: dot4<4>(xm, w4, K, ldx, out); break;
          case 5: dot4<5>(xm, w4, K, ldx, out); break;
          default: dot4<kRowBlock>(xm, w4, K, ldx, out); break;
        }
      } else {
        dot4<kRowBlock>(xm, w4, K, ldx, out);
      }
  }
}
#endif

// Output columns [n_begin, n_end) of y (M, N) on the calling thread; n_begin is a multiple of 4.
// Which path and which register blocks a column gets depend on M, N and `invariant` only, so a
// column's bits do not depend on how the columns are shared between threads (or with the other
// experts' columns in moe.cpp).
// Out of line (noinline), so that linear and moe.cpp run the very same compiled loops: inlined
// copies may be vectorised differently, and float32 sums would then differ in the last bit.
template <typename T>
__attribute__((noinline)) void linear_cols(const T* x, const T* w, const T* b, T* y, int64_t M,
                                           int64_t N, int64_t K, int64_t ldx, bool invariant,
                                           int64_t n_begin, int64_t n_end) {
#if defined(LADLE_LINEAR_AVX2)
  if (M <= kSequentialRows && !invariant && sequential_rows_preferred()) {
    float out[kSequentialRows];
    for (int64_t n = n_begin; n < n_end; ++n) {
      if (M == 1) dot_row<1, 4>(x, w + n * K, K, ldx, out);
      else dot_row<2, 2>(x, w + n * K, K, ldx, out);
      for (int64_t m = 0; m < M; ++m) {
        float v = out[m];
        if (b != nullptr) v += to_f(b[n]);  // in float32, one rounding to T
        y[m * N + n] = static_cast<T>(v);
      }
    }
    return;
  }
#elif defined(__AVX512F__)
  const bool sequential = M <= sequential_rows<T>() && sequential_rows_preferred();
#endif
  // Each block of 4 weight rows is read once from memory and then used from L1 for every row
  // of x, in register blocks of up to kRowBlock rows (sizes balanced: 8 rows = 4 + 4).
  const int64_t row_blocks = (M + kRowBlock - 1) / kRowBlock;
  float out[kRowBlock * 4];
  for (int64_t n0 = n_begin; n0 < n_end; n0 += 4) {
    const int64_t nb = std::min<int64_t>(4, N - n0);
    for (int64_t rb = 0, m0 = 0; m0 < M; ++rb) {
      const int64_t mb = (M - m0 + (row_blocks - rb) - 1) / (row_blocks - rb);
      const T* xm = x + m0 * ldx;
#if defined(__AVX512F__) || defined(LADLE_LINEAR_AVX2)
      if (nb == 4) {
#if defined(__AVX512F__)
        if (sequential && mb == 1) dot4_seq<1>(xm, w + n0 * K, K, ldx, out);
        else if (sequential) dot4_seq<2>(xm, w + n0 * K, K, ldx, out);
        else
#endif
          dot4_block(mb, xm, w + n0 * K, K, ldx, out);
      } else {
        dot_block_scalar(xm, w + n0 * K, mb, K, ldx, nb, out);
        // dot_block_scalar writes (mb, nb); spread to the (mb, 4) layout used below.
        for (int64_t m = mb - 1; m >= 0; --m)
          for (int64_t j = nb - 1; j >= 0; --j) out[m * 4 + j] = out[m * nb + j];
      }
#else
      float tmp[kRowBlock * 4];
      dot_block_scalar(xm, w + n0 * K, mb, K, ldx, nb, tmp);
      for (int64_t m = 0; m < mb; ++m)
        for (int64_t j = 0; j < nb; ++j) out[m * 4 + j] = tmp[m * nb + j];
#endif
      for (int64_t m = 0; m < mb; ++m)
        for (int64_t j = 0; j < nb; ++j) {
          float v = out[m * 4 + j];
          if (b != nullptr) v += to_f(b[n0 + j]);  // in float32, one rounding to T
          y[(m0 + m) * N + n0 + j] = static_cast<T>(v);
        }
      m0 += mb;
    }
  }
}
template void linear_cols<float>(const float*, const float*, const float*, float*, int64_t,
                                 int64_t, int64_t, int64_t, bool, int64_t, int64_t);
template void linear_cols<at::BFloat16>(const at::BFloat16*, const at::BFloat16*,
                                        const at::BFloat16*, at::BFloat16*, int64_t, int64_t,
                                        int64_t, int64_t, bool, int64_t, int64_t);

#if defined(LADLE_LINEAR_AMX)
// ---------------------------------------------------------------------------------------------
// Batch-invariant bfloat16 on AMX (CPUs with AMX-BF16: Sapphire Rapids and later). In
// batch-invariant mode the dense kernel above serves every row count, and a prefill runs it at a
// fraction of the tile unit's speed that torch's GEMM reaches. Here every row count runs one tile
// program instead: y^T = W . x^T, the A tiles 16 weight rows x 32 of K read in place, the B tiles
// 16 rows of x as pairs of K (packed once per call), the C tiles 16 outputs x 16 rows summed over
// K in order, 32 values at a time. An output's sum is then the same instructions on the same
// values whatever M is (rows past M are zeros in their own tile columns): batch-invariant by
// construction, with no vector fallback for small M. Threads split N by 32 weight rows.
namespace {

std::atomic<bool> g_linear_amx{true};  // set_linear_amx: tests and benchmarks compare both

// Rows 16 mb .. 16 mb + 15 of x (zeros past M) as B tiles, one per 32 values of K: 16 rows of K
// pairs x 16 rows of x (one 32-bit pair each), at out + kb * 256.
void pack_block(const at::BFloat16* x, int64_t M, int64_t K, int64_t ldx, int64_t mb,
                uint32_t* out) {
  for (int64_t kb = 0; kb < K / 32; ++kb) {
    __m512 r[16];
    for (int64_t i = 0; i < 16; ++i)
      r[i] = mb * 16 + i < M ? _mm512_loadu_ps(reinterpret_cast<const float*>(
                                   x + (mb * 16 + i) * ldx + kb * 32))
                             : _mm512_setzero_ps();
    transpose16(r);
    for (int i = 0; i < 16; ++i)
      _mm512_storeu_ps(reinterpret_cast<float*>(out + kb * 256 + i * 16), r[i]);
  }
}

// C tile cb (16 outputs n0.. x 16 rows m0..) into y with the bias, rows m0 .. m0 + rows.
inline void store_tile(const float* cb, const at::BFloat16* b, at::BFloat16* y, int64_t N,
                       int64_t n0, int64_t m0, int64_t rows) {
  __m512 r[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_load_ps(cb + 16 * i);
  transpose16(r);  // r[m]: row m's 16 outputs
  const __m512 bias = b != nullptr ? load16(b + n0) : _mm512_setzero_ps();
  for (int64_t m = 0; m < rows; ++m) {
    const __m512 v = b != nullptr ? _mm512_add_ps(r[m], bias) : r[m];  // one rounding, as above
    store_round(y + (m0 + m) * N + n0, v);
  }
}

}  // namespace

// Columns [32 u, 32 u + 32) of one product's y, all its rows: xt its packed rows (MB blocks of
// KB tiles). The tile configuration is loaded by the caller.
static void amx_unit(const uint32_t* xt, const AmxRows& g, int64_t N, int64_t K, int64_t u,
                     float (*cb)[256]) {
  const int64_t KB = K / 32, MB = (g.M + 15) / 16, n0 = 32 * u;
  const bool two_a = n0 + 16 < N;
  const at::BFloat16* a0 = g.w + n0 * K;
  const at::BFloat16* a1 = a0 + 16 * K;
  for (int64_t mb = 0; mb < MB; mb += 2) {
    const bool two_b = mb + 1 < MB;
    const uint32_t* b0 = xt + mb * KB * 256;
    const uint32_t* b1 = b0 + KB * 256;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kb = 0; kb < KB; ++kb) {  // tile t: C 0-3, A 4-5, B 6-7 (literal numbers)
      _tile_loadd(4, a0 + kb * 32, K * 2);
      _tile_loadd(6, b0 + kb * 256, 64);
      _tile_dpbf16ps(0, 4, 6);
      if (two_b) {
        _tile_loadd(7, b1 + kb * 256, 64);
        _tile_dpbf16ps(1, 4, 7);
      }
      if (two_a) {
        _tile_loadd(5, a1 + kb * 32, K * 2);
        _tile_dpbf16ps(2, 5, 6);
        if (two_b) _tile_dpbf16ps(3, 5, 7);
      }
    }
    const int64_t rows0 = std::min<int64_t>(16, g.M - mb * 16);
    const int64_t rows1 = two_b ? std::min<int64_t>(16, g.M - mb * 16 - 16) : 0;
    _tile_stored(0, cb[0], 64);
    store_tile(cb[0], g.b, g.y, N, n0, mb * 16, rows0);
    if (two_b) {
      _tile_stored(1, cb[1], 64);
      store_tile(cb[1], g.b, g.y, N, n0, mb * 16 + 16, rows1);
    }
    if (two_a) {
      _tile_stored(2, cb[2], 64);
      store_tile(cb[2], g.b, g.y, N, n0 + 16, mb * 16, rows0);
      if (two_b) {
        _tile_stored(3, cb[3], 64);
        store_tile(cb[3], g.b, g.y, N, n0 + 16, mb * 16 + 16, rows1);
      }
    }
  }
}

// y = x @ w^T + b for G products of one weight shape (N, K), N % 16 == 0, K % 32 == 0, in two
// parallel regions: packing every product's rows, then every (product, 32 columns) unit. A
// product's bits are the same alone or among others (the MoE kernel's experts).
void amx_linear_many(const AmxRows* g, int64_t G, int64_t N, int64_t K) {
  const int64_t KB = K / 32, units = (N + 31) / 32;
  std::vector<int64_t> off(G + 1, 0);
  std::vector<std::pair<int64_t, int64_t>> blocks;  // (product, block of 16 rows)
  int64_t rows = 0;
  for (int64_t i = 0; i < G; ++i) {
    const int64_t MB = (g[i].M + 15) / 16;
    off[i + 1] = off[i] + MB * KB * 256;
    for (int64_t mb = 0; mb < MB; ++mb) blocks.emplace_back(i, mb);
    rows += g[i].M;
  }
  // Not zeroed first: pack_block writes every value (zeros past M).
  std::unique_ptr<uint32_t[]> xp(new uint32_t[off[G]]);
  at::parallel_for(0, static_cast<int64_t>(blocks.size()), grain_for(16 * K * kElementWork),
                   [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const auto [i, mb] = blocks[j];
      pack_block(g[i].x, g[i].M, K, g[i].ldx, mb, xp.get() + off[i] + mb * KB * 256);
    }
  });
  const int64_t avg_rows = std::max<int64_t>(1, rows / std::max<int64_t>(1, G));
  at::parallel_for(0, G * units, grain_for(32 * K * avg_rows), [&](int64_t begin, int64_t end) {
    TileShapes shapes;
    _tile_loadconfig(&shapes);
    alignas(64) float cb[4][256];
    for (int64_t j = begin; j < end; ++j)
      amx_unit(xp.get() + off[j / units], g[j / units], N, K, j % units, cb);
    _tile_release();
  });
}
#endif

#if !defined(LADLE_LINEAR_AMX)
void amx_linear_many(const AmxRows*, int64_t, int64_t, int64_t) {
  TORCH_CHECK(false, "amx_linear_many: this build has no AMX-BF16 (amx_linear_serves says so)");
}
#endif

// Whether a bfloat16 linear of M rows and an (N, K) weight runs on the tile unit (the caller has
// chosen the kernel over torch): where the shapes fit its tiles, in batch-invariant mode for
// every row count (which path a weight takes then depends on its shape only, never on M);
// otherwise from 2 rows, where it beats the four-row blocks (one 4096 x 1024 weight, two
// threads, 32 rows: 0.19 against 1.27 ms; 0.6B decode of 32 rows 143 -> 409 tok/s), while one
// row stays on the blocks, which stream the weights 3-15% faster. linear and moe.cpp both ask.
bool amx_linear_serves(int64_t M, int64_t N, int64_t K, bool invariant) {
#if defined(LADLE_LINEAR_AMX)
  return (invariant || M >= 2) && N % 16 == 0 && K % 32 == 0 &&
         g_linear_amx.load(std::memory_order_relaxed) && amx_permitted();
#else
  (void)M, (void)N, (void)K, (void)invariant;
  return false;
#endif
}

bool linear_amx_available() {
#if defined(LADLE_LINEAR_AMX)
  return amx_permitted();
#else
  return false;
#endif
}

bool set_linear_amx(bool on) {
#if defined(LADLE_LINEAR_AMX)
  g_linear_amx.store(on);
  return on && amx_permitted();
#else
  (void)on;
  return false;
#endif
}

// Threads split N in blocks of 4 columns, each thread one contiguous share. Measured against the
// alternatives (Zen 4, 0.6B bf16 single-stream decode, the variants alternating step by step):
// shares taken from a counter in 64 / 256 KB chunks ran 0.74x / 0.94x; contiguous shares whose
// idle thread then takes the other's last 16-64 KB 1.003-1.006x (the threads end 5-13% of a
// linear's time apart, but the one still reading has the bandwidth to itself meanwhile); each
// thread prefetching the start of its share of the next linear after its own 0.99-1.00x.
template <typename T>
static void linear_kernel(const T* x, const T* w, const T* b, T* y, int64_t M, int64_t N,
                          int64_t K, int64_t ldx, bool invariant) {
  at::parallel_for(0, (N + 3) / 4, grain_for(4 * K * M), [&](int64_t begin, int64_t end) {
    linear_cols(x, w, b, y, M, N, K, ldx, invariant, 4 * begin, std::min(N, 4 * end));
  });
}

at::Tensor linear(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> b,
                  bool invariant) {
  // x: (M, K) with unit stride in K; w: (N, K) contiguous; b: (N,) or None. Returns (M, N).
  // invariant: each row's result independent of M (see linear_kernel).
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "linear: shapes");
  TORCH_CHECK(x.stride(1) == 1 && w.is_contiguous(), "linear: layout");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "linear: dtypes");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = at::empty({M, N}, x.options());
  const bool has_b = b.has_value() && b->defined();
  if (x.scalar_type() == at::kBFloat16) {
#if defined(LADLE_LINEAR_AMX)
    if (amx_linear_serves(M, N, K, invariant)) {
      const AmxRows one{x.data_ptr<at::BFloat16>(), x.stride(0), w.data_ptr<at::BFloat16>(),
                        has_b ? b->data_ptr<at::BFloat16>() : nullptr,
                        y.data_ptr<at::BFloat16>(), M};
      amx_linear_many(&one, 1, N, K);
      return y;
    }
#endif
    linear_kernel<at::BFloat16>(x.data_ptr<at::BFloat16>(), w.data_ptr<at::BFloat16>(),
                                has_b ? b->data_ptr<at::BFloat16>() : nullptr,
                                y.data_ptr<at::BFloat16>(), M, N, K, x.stride(0),
                                invariant);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "linear: bfloat16 or float32");
    linear_kernel<float>(x.data_ptr<float>(), w.data_ptr<float>(),
                         has_b ? b->data_ptr<float>() : nullptr, y.data_ptr<float>(), M, N, K,
                         x.stride(0), invariant);
  }
  return y;
}
