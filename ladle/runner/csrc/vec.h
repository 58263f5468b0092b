// Helpers shared by the CPU kernels (attention.cpp, linear.cpp, elementwise.cpp, sampler.cpp,
// quant.cpp): bfloat16 widening, the parallel grain, the AVX-512 loads, stores, rounding, exp and
// horizontal sums, and the request for AMX tile state. Every function is static inline, so each translation unit that includes this
// has its own copy. Built with -march=native: the AVX-512 (and AVX512-BF16) paths are chosen by
// the compiler macros of the CPU the build is for; every kernel also has a portable scalar loop.
#pragma once
// ATen's Tensor and only the operators the kernels call, not torch/types.h (all of ATen's
// operators) or torch/extension.h (the C++ frontend and pybind11, which only bindings.cpp needs):
// with the build's flags those headers alone cost ~19 s and ~50 s of compiler time per file,
// these ~8 s.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/topk.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

static inline float to_f(float x) { return x; }
static inline float to_f(at::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// The grain (items per task) that gives each task at least kMinTaskWork units of work (about a
// multiply-add each; 2^20 is ~15 us on one core). A parallel region costs a wake-up of the other
// threads and a join: about 10 us on a quiet machine, but on a shared one a descheduled thread
// stalls the join for its scheduling delay (~8 ms per op measured at load 5: the tiny model's
// 16-row matmuls took 8 ms each). Weight-streaming ops (>= 1M multiply-adds) stay parallel.
constexpr int64_t kMinTaskWork = int64_t(1) << 20;
static inline int64_t grain_for(int64_t work_per_item) {
  return std::max<int64_t>(1, kMinTaskWork / std::max<int64_t>(1, work_per_item));
}
// Work units per element of an elementwise pass (norms, rotary, silu): widening, the float math
// and the rounding back to bfloat16 cost about a cycle per element against the dot products'
// ~1/32. Measured on a Zen 4 at 128 rows x 1024: RMSNorm ran 43 us on one thread when counted
// as 2 units per element.
constexpr int64_t kElementWork = 32;

#ifdef __AVX512F__
#include <immintrin.h>
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const at::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
#endif

#if defined(__AVX512F__)
// exp(x) for 16 floats within ~1 ulp: x = n ln2 + r with |r| <= ln2/2, a degree-6 polynomial
// for exp(r) (the Cephes expf coefficients), then scalef by 2^n, which gives inf above ~88.7,
// 0 below ~-103 and passes NaN through, as std::exp does.
static inline __m512 exp16(__m512 x) {
  // Clamped first so that +-inf give inf and 0 (not inf - inf in the reduction); the second
  // operand is returned for NaN, so NaN stays NaN.
  x = _mm512_min_ps(_mm512_set1_ps(89.f), _mm512_max_ps(_mm512_set1_ps(-104.f), x));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

// Round 16 floats to T's precision (bfloat16: to nearest even, NaN kept), returned as floats.
static inline __m512 round_to(__m512 x, const float*) { return x; }
static inline __m512 round_to(__m512 x, const at::BFloat16*) {
  const __m512i b = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  r = _mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_castsi512_ps(_mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc00000)));
}
static inline void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
static inline void store16(at::BFloat16* p, __m512 x) {  // x already rounded: the top halves
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(x), 16)));
}
// store16(p, round_to(x, p)): with AVX512-BF16 one vcvtneps2bf16 (to nearest even, as round_to)
// where no lane is NaN or denormal (which it would quiet differently or flush to zero); round_to
// and store16 take about a dozen instructions, which bounded the elementwise kernels at 128 rows.
static inline void store_round(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
static inline void store_round(at::BFloat16* p, __m512 x) {
#if defined(__AVX512BF16__) && defined(__AVX512DQ__)
  if (!_mm512_fpclass_ps_mask(x, 0xA1)) {  // quiet NaN 0x01, denormal 0x20, signalling NaN 0x80
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x)));
    return;
  }
#endif
  store16(p, round_to(x, p));
}
// store_round of 32 values, lo then hi: with AVX512-BF16 one 64-byte store (a whole line of
// bfloat16 where p is aligned) instead of two halves.
static inline void store_round2(float* p, __m512 lo, __m512 hi) {
  _mm512_storeu_ps(p, lo);
  _mm512_storeu_ps(p + 16, hi);
}
static inline void store_round2(at::BFloat16* p, __m512 lo, __m512 hi) {
#if defined(__AVX512BF16__) && defined(__AVX512DQ__)
  if (!(_mm512_fpclass_ps_mask(lo, 0xA1) | _mm512_fpclass_ps_mask(hi, 0xA1))) {
    _mm512_storeu_si512(p, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
    return;
  }
#endif
  store_round(p, lo);
  store_round(p + 16, hi);
}
#endif

#if defined(__AVX512F__)
// The four sums of a[0..3] in one __m128: one shuffle tree for four outputs instead of four
// full horizontal reductions (a reduction costs about a quarter of a K=1024 dot product).
__attribute__((always_inline)) static inline __m128 hsum4(const __m512* a) {
  const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(a[0], a[1]), _mm512_unpackhi_ps(a[0], a[1]));
  const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(a[2], a[3]), _mm512_unpackhi_ps(a[2], a[3]));
  // Each 128-bit lane now holds (a0, a1, a0, a1) and (a2, a3, a2, a3) partial sums.
  const __m512 s = _mm512_add_ps(_mm512_shuffle_ps(s01, s23, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(s01, s23, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(s),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// r[i][j] -> r[j][i] for 16 vectors of 16 32-bit values: pairs within 128-bit lanes, then
// 64-bit pairs, then the 4 x 4 transpose of 128-bit lanes.
static inline void transpose16(__m512* r) {
  __m512 a[16], b[16];
  for (int p = 0; p < 8; ++p) {
    a[2 * p] = _mm512_unpacklo_ps(r[2 * p], r[2 * p + 1]);
    a[2 * p + 1] = _mm512_unpackhi_ps(r[2 * p], r[2 * p + 1]);
  }
  for (int q = 0; q < 4; ++q) {  // b[4q + s], lane L: rows 4q..4q+3 at column 4L + s
    const __m512d lo = _mm512_castps_pd(a[4 * q]), lo2 = _mm512_castps_pd(a[4 * q + 2]);
    const __m512d hi = _mm512_castps_pd(a[4 * q + 1]), hi2 = _mm512_castps_pd(a[4 * q + 3]);
    b[4 * q] = _mm512_castpd_ps(_mm512_unpacklo_pd(lo, lo2));
    b[4 * q + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(lo, lo2));
    b[4 * q + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(hi, hi2));
    b[4 * q + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(hi, hi2));
  }
  for (int s = 0; s < 4; ++s) {  // column 4L + s = lane L of b[s], b[4 + s], b[8 + s], b[12 + s]
    const __m512 c0 = _mm512_shuffle_f32x4(b[s], b[4 + s], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512 c1 = _mm512_shuffle_f32x4(b[s], b[4 + s], _MM_SHUFFLE(3, 2, 3, 2));
    const __m512 c2 = _mm512_shuffle_f32x4(b[8 + s], b[12 + s], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512 c3 = _mm512_shuffle_f32x4(b[8 + s], b[12 + s], _MM_SHUFFLE(3, 2, 3, 2));
    r[s] = _mm512_shuffle_f32x4(c0, c2, _MM_SHUFFLE(2, 0, 2, 0));
    r[4 + s] = _mm512_shuffle_f32x4(c0, c2, _MM_SHUFFLE(3, 1, 3, 1));
    r[8 + s] = _mm512_shuffle_f32x4(c1, c3, _MM_SHUFFLE(2, 0, 2, 0));
    r[12 + s] = _mm512_shuffle_f32x4(c1, c3, _MM_SHUFFLE(3, 1, 3, 1));
  }
}
#endif

// Whether this is an Intel CPU: the memory-bound one-row kernels (linear.cpp's bf16 rows,
// quant.cpp's repacked rows) choose their prefetches by vendor, as measured on each (their
// comments). Decided once per process, so a machine always takes the same path.
[[maybe_unused]] static inline bool intel_cpu() {
#if defined(__GNUC__) || defined(__clang__)
  static const bool intel = __builtin_cpu_is("intel");
  return intel;
#else
  return false;
#endif
}

// AMD's CPU family (0x19: Zen 3 and Zen 4, 0x1A: Zen 5), 0 on any other vendor or
// architecture: quant.cpp's one-row repacked kernels prefetch by it, as measured on each.
// Decided once per process.
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
[[maybe_unused]] static inline int amd_family() {
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
  static const int family = [] {
    unsigned a, b, c, d;
    if (!__builtin_cpu_is("amd") || !__get_cpuid(1, &a, &b, &c, &d)) return 0;
    const int base = (a >> 8) & 0xF;  // the extended family adds to a base family of 0xF
    return base == 0xF ? base + static_cast<int>((a >> 20) & 0xFF) : base;
  }();
  return family;
#else
  return 0;
#endif
}

#if defined(__AMX_TILE__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
// Linux hands out the tile registers' state only to a process that asks (ARCH_REQ_XCOMP_PERM
// for XFEATURE_XTILEDATA); without it the first tile instruction faults. Asked once per
// translation unit that uses the tiles (linear.cpp, quant.cpp); the answer is the process's.
static inline bool amx_permitted() {
  static const bool ok = [] {
    constexpr long kReqPerm = 0x1023, kGetPerm = 0x1022, kXtileData = 18;
    unsigned long bits = 0;
    if (syscall(SYS_arch_prctl, kReqPerm, kXtileData) != 0) return false;
    if (syscall(SYS_arch_prctl, kGetPerm, &bits) != 0) return false;
    return ((bits >> kXtileData) & 1) != 0;
  }();
  return ok;
}

// The LDTILECFG image of eight tiles of 16 rows x 64 bytes (the bfloat16 programs: linear.cpp's
// dense tiles, quant.cpp's dequantized ones).
struct alignas(64) TileShapes {
  uint8_t palette_id = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};
#endif
