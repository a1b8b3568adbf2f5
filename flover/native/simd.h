/* 16 float lanes, whatever the instruction set: the native step's kernels are written once
 * against this mapping (as ggml's simd-mappings.h), and each family implements it:
 *
 *   AVX-512F      one __m512                  (avx512bf16 and avx512 builds)
 *   AVX2 + FMA    two __m256
 *   NEON          four float32x4_t            (aarch64)
 *   generic       float[16] and plain loops   (the reference; also -DFLOVER_GENERIC anywhere)
 *
 * The layouts of the weights are the same for every family (16 output rows per block), so one
 * v16 is one block's outputs. Lane masks (m16) are bit masks, lane i in bit i. Partial loads and
 * stores (`n` lanes, n < 16) never touch memory past the n-th element. Every operation is
 * element-wise or reduces in a fixed order, so a row's numbers never depend on other rows.
 */
#ifndef FLOVER_SIMD_H
#define FLOVER_SIMD_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if !defined(FLOVER_GENERIC) && defined(__AVX512F__)
#define V_AVX512 1
#include <immintrin.h>
#elif !defined(FLOVER_GENERIC) && defined(__AVX2__) && defined(__FMA__)
#define V_AVX2 1
#include <immintrin.h>
#elif !defined(FLOVER_GENERIC) && defined(__ARM_NEON) && defined(__aarch64__)
#define V_NEON 1
#include <arm_neon.h>
#else
#define V_GENERIC 1
#endif

typedef uint32_t m16;
#define M16_ALL 0xffffu

static inline m16 lanes(int64_t n) { return n >= 16 ? M16_ALL : n <= 0 ? 0 : (m16)((1u << n) - 1u); }

/* ---- bfloat16 <-> float, one value ------------------------------------------------------------ */
static inline float bf2f(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f2bf(float f) { /* round to nearest even, as PyTorch's conversion */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline void v_prefetch(const void *p) { __builtin_prefetch(p, 0, 3); }
static inline void v_prefetch_l2(const void *p) { __builtin_prefetch(p, 0, 2); }

/* ===== AVX-512F ================================================================================ */
#if defined(V_AVX512)
#define V_FAMILY_SIMD "AVX-512F"
typedef __m512 v16;

static inline v16 v_zero(void) { return _mm512_setzero_ps(); }
static inline v16 v_set1(float f) { return _mm512_set1_ps(f); }
static inline v16 v_load(const float *p) { return _mm512_loadu_ps(p); }
static inline v16 v_loadn(const float *p, int64_t n) { return _mm512_maskz_loadu_ps((__mmask16)lanes(n), p); }
static inline void v_store(float *p, v16 v) { _mm512_storeu_ps(p, v); }
static inline void v_storen(float *p, v16 v, int64_t n) { _mm512_mask_storeu_ps(p, (__mmask16)lanes(n), v); }
static inline v16 v_load_bf16n(const uint16_t *p, int64_t n) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16((__mmask16)lanes(n), p)), 16));
}
/* lanes holding bfloat16 values (rounded already): truncation is exact */
static inline void v_store_bf16n(uint16_t *p, v16 v, int64_t n) {
    _mm256_mask_storeu_epi16(p, (__mmask16)lanes(n), _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16)));
}
static inline v16 v_add(v16 a, v16 b) { return _mm512_add_ps(a, b); }
static inline v16 v_sub(v16 a, v16 b) { return _mm512_sub_ps(a, b); }
static inline v16 v_mul(v16 a, v16 b) { return _mm512_mul_ps(a, b); }
static inline v16 v_div(v16 a, v16 b) { return _mm512_div_ps(a, b); }
static inline v16 v_fmadd(v16 a, v16 b, v16 c) { return _mm512_fmadd_ps(a, b, c); }  /* a b + c */
static inline v16 v_fnmadd(v16 a, v16 b, v16 c) { return _mm512_fnmadd_ps(a, b, c); } /* c - a b */
static inline v16 v_max(v16 a, v16 b) { return _mm512_max_ps(a, b); } /* b where either is NaN */
static inline v16 v_abs(v16 a) { return _mm512_abs_ps(a); }
static inline float v_reduce_add(v16 v) { return _mm512_reduce_add_ps(v); }
static inline float v_reduce_max(v16 v) { return _mm512_reduce_max_ps(v); }
static inline m16 v_gt(v16 a, v16 b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
static inline m16 v_ge(v16 a, v16 b) { return _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ); }
static inline m16 v_eq(v16 a, v16 b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
static inline m16 v_nan(v16 a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q); }
static inline v16 v_select(m16 m, v16 a, v16 b) { return _mm512_mask_blend_ps((__mmask16)m, b, a); } /* m ? a : b */
/* rnd() on 16 lanes: round to bfloat16 by the same integer steps (NaN stays NaN) */
static inline v16 v_round_bf16(v16 v) {
    const __m512i u = _mm512_castps_si512(v), high = _mm512_set1_epi32((int)0xffff0000u);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_and_si512(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), high);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_and_si512(_mm512_or_si512(u, _mm512_set1_epi32(0x400000)), high));
    return _mm512_castsi512_ps(r);
}
/* x = n ln2 + r, |r| <= ln2 / 2, e^r by its Taylor series to r^7, times 2^n by scalef (which
 * also gives 0 and inf beyond float's range) */
static inline v16 v_exp(v16 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-104.f), x); /* e^-104 is 0 in float; -inf gives 0, NaN stays */
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    static const float c[8] = {1.f / 5040.f, 1.f / 720.f, 1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f};
    __m512 p = _mm512_set1_ps(c[0]);
    for (int i = 1; i < 8; i++) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c[i]));
    return _mm512_scalef_ps(p, n);
}
/* 32 bfloat16 as 16 pairs (even input, odd input) -> the even and the odd inputs' 16 values */
static inline void v_widen_bf16_pairs(const uint16_t *p, v16 *even, v16 *odd) {
    const __m512i u = _mm512_loadu_si512(p);
    *even = _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
    *odd = _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32((int)0xffff0000u)));
}
static inline void v_widen_q8_pairs(const int8_t *p, v16 *even, v16 *odd) {
    const __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)); /* a pair in the low 16 bits */
    *even = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(u, 24), 24));
    *odd = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(u, 16), 24));
}
/* 16 bytes (unsigned) -> their 16 values */
static inline v16 v_load_u8(const uint8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static inline v16 v_load_i8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
/* 16 bytes, a pair of 4-bit codes each (low nibble even) -> q - 8 */
static inline void v_widen_q4_pairs(const uint8_t *p, v16 *even, v16 *odd) {
    const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)), eight = _mm512_set1_epi32(8);
    *even = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(d, _mm512_set1_epi32(15)), eight));
    *odd = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(d, 4), eight));
}
/* v[0..15] -> one vector of their 16 horizontal sums, in order: a transpose-and-add tree */
static inline v16 v_sum_each(const v16 v[16]) {
    __m512 quad[4];
    for (int q = 0; q < 4; q++) { /* keys 4q..4q+3 -> per 128-bit lane: [a, b, c, d] lane sums */
        const __m512 *x = v + 4 * q;
        const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(x[0], x[1]), _mm512_unpackhi_ps(x[0], x[1]));
        const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(x[2], x[3]), _mm512_unpackhi_ps(x[2], x[3]));
        quad[q] = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xEE));
    }
    const __m512 y01 = _mm512_add_ps(_mm512_shuffle_f32x4(quad[0], quad[1], 0x44), _mm512_shuffle_f32x4(quad[0], quad[1], 0xEE));
    const __m512 y23 = _mm512_add_ps(_mm512_shuffle_f32x4(quad[2], quad[3], 0x44), _mm512_shuffle_f32x4(quad[2], quad[3], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(y01, y23, 0x88), _mm512_shuffle_f32x4(y01, y23, 0xDD));
}
/* projection tiles: rows x blocks accumulators (v16) that the registers hold beside the weights
 * (float32, and widened pairs: 2 a block), and the 4-bit tiles' rows (accumulators and partial
 * sums); AVX-512 BF16's dot-product tiles take 24 in pairs too */
#define V_TILE_F32 24
#define V_TILE_PAIRS 16
#define V_Q4_ROWS 8

/* ===== AVX2 + FMA ============================================================================== */
#elif defined(V_AVX2)
#define V_FAMILY_SIMD "AVX2+FMA"
typedef struct {
    __m256 lo, hi;
} v16;
#define V2(EXPR_LO, EXPR_HI) ((v16){EXPR_LO, EXPR_HI})

static inline v16 v_zero(void) { return V2(_mm256_setzero_ps(), _mm256_setzero_ps()); }
static inline v16 v_set1(float f) { return V2(_mm256_set1_ps(f), _mm256_set1_ps(f)); }
static inline v16 v_load(const float *p) { return V2(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)); }
static inline void v_store(float *p, v16 v) { _mm256_storeu_ps(p, v.lo), _mm256_storeu_ps(p + 8, v.hi); }
static inline __m256 widen8_bf16(__m128i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }
static inline v16 v_load_bf16n(const uint16_t *p, int64_t n) {
    uint16_t t[16] = {0};
    if (n < 16 && n > 0) memcpy(t, p, n * 2);
    const __m256i u = _mm256_loadu_si256((const __m256i *)(n >= 16 ? p : t));
    return V2(widen8_bf16(_mm256_castsi256_si128(u)), widen8_bf16(_mm256_extracti128_si256(u, 1)));
}
static inline void v_store_bf16n(uint16_t *p, v16 v, int64_t n) {
    const __m256i lo = _mm256_srli_epi32(_mm256_castps_si256(v.lo), 16), hi = _mm256_srli_epi32(_mm256_castps_si256(v.hi), 16);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xD8);
    if (n >= 16) return _mm256_storeu_si256((__m256i *)p, packed);
    uint16_t t[16];
    _mm256_storeu_si256((__m256i *)t, packed);
    if (n > 0) memcpy(p, t, n * 2);
}
static inline v16 v_add(v16 a, v16 b) { return V2(_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)); }
static inline v16 v_sub(v16 a, v16 b) { return V2(_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)); }
static inline v16 v_mul(v16 a, v16 b) { return V2(_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)); }
static inline v16 v_div(v16 a, v16 b) { return V2(_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)); }
static inline v16 v_fmadd(v16 a, v16 b, v16 c) { return V2(_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)); }
static inline v16 v_fnmadd(v16 a, v16 b, v16 c) { return V2(_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)); }
static inline v16 v_max(v16 a, v16 b) { return V2(_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)); }
static inline v16 v_abs(v16 a) {
    const __m256 m = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    return V2(_mm256_and_ps(a.lo, m), _mm256_and_ps(a.hi, m));
}
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline float v_reduce_add(v16 v) { return hsum8(_mm256_add_ps(v.lo, v.hi)); }
static inline float v_reduce_max(v16 v) {
    const __m256 m8 = _mm256_max_ps(v.lo, v.hi);
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
#define V_CMP(NAME, PRED)                                                                                  \
    static inline m16 NAME(v16 a, v16 b) {                                                                 \
        return (m16)_mm256_movemask_ps(_mm256_cmp_ps(a.lo, b.lo, PRED)) |                                  \
               ((m16)_mm256_movemask_ps(_mm256_cmp_ps(a.hi, b.hi, PRED)) << 8);                            \
    }
V_CMP(v_gt, _CMP_GT_OQ)
V_CMP(v_ge, _CMP_GE_OQ)
V_CMP(v_eq, _CMP_EQ_OQ)
#undef V_CMP
static inline m16 v_nan(v16 a) {
    return (m16)_mm256_movemask_ps(_mm256_cmp_ps(a.lo, a.lo, _CMP_UNORD_Q)) |
           ((m16)_mm256_movemask_ps(_mm256_cmp_ps(a.hi, a.hi, _CMP_UNORD_Q)) << 8);
}
static inline __m256 mask8(unsigned bits) {
    const __m256i b = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    return _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)bits), b), b));
}
static inline v16 v_select(m16 m, v16 a, v16 b) {
    return V2(_mm256_blendv_ps(b.lo, a.lo, mask8(m & 0xff)), _mm256_blendv_ps(b.hi, a.hi, mask8(m >> 8)));
}
static inline __m256 round8_bf16(__m256 v) {
    const __m256i u = _mm256_castps_si256(v), high = _mm256_set1_epi32((int)0xffff0000u);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_and_si256(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), high);
    const __m256i quiet = _mm256_and_si256(_mm256_or_si256(u, _mm256_set1_epi32(0x400000)), high);
    return _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(quiet), _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}
static inline v16 v_round_bf16(v16 v) { return V2(round8_bf16(v.lo), round8_bf16(v.hi)); }
/* as AVX-512's, 2^n built from exponent bits in two halves (so that 0, denormals and inf come
 * out as multiplying by 2^n would give them) */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(_mm256_set1_ps(-104.f), x);
    x = _mm256_min_ps(_mm256_set1_ps(100.f), x); /* NaN -> 100 here: restored below */
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    static const float c[8] = {1.f / 5040.f, 1.f / 720.f, 1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f};
    __m256 p = _mm256_set1_ps(c[0]);
    for (int i = 1; i < 8; i++) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c[i]));
    const __m256i ni = _mm256_cvtps_epi32(n), half = _mm256_srai_epi32(ni, 1), rest = _mm256_sub_epi32(ni, half);
    const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, _mm256_set1_epi32(127)), 23));
    const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(rest, _mm256_set1_epi32(127)), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
}
static inline v16 v_exp(v16 x) {
    const v16 e = V2(exp8(x.lo), exp8(x.hi));
    return v_select(v_nan(x), x, e);
}
static inline void v_widen_bf16_pairs(const uint16_t *p, v16 *even, v16 *odd) {
    const __m256i a = _mm256_loadu_si256((const __m256i *)p), b = _mm256_loadu_si256((const __m256i *)(p + 16));
    const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
    *even = V2(_mm256_castsi256_ps(_mm256_slli_epi32(a, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(b, 16)));
    *odd = V2(_mm256_castsi256_ps(_mm256_and_si256(a, high)), _mm256_castsi256_ps(_mm256_and_si256(b, high)));
}
static inline void v_widen_q8_pairs(const int8_t *p, v16 *even, v16 *odd) {
    const __m256i a = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    const __m256i b = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p + 16)));
    *even = V2(_mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(a, 24), 24)),
               _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(b, 24), 24)));
    *odd = V2(_mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(a, 16), 24)),
              _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(b, 16), 24)));
}
static inline v16 v_load_u8(const uint8_t *p) {
    return V2(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p))),
              _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8)))));
}
static inline v16 v_load_i8(const int8_t *p) {
    return V2(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p))),
              _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8)))));
}
static inline void v_widen_q4_pairs(const uint8_t *p, v16 *even, v16 *odd) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)p);
    const __m256i a = _mm256_cvtepu8_epi32(bytes), b = _mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8));
    const __m256i low = _mm256_set1_epi32(15), eight = _mm256_set1_epi32(8);
    *even = V2(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(a, low), eight)),
               _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(b, low), eight)));
    *odd = V2(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(a, 4), eight)),
              _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(b, 4), eight)));
}
/* 16 ymm registers: 6 x 1 accumulators (12) beside a weight and a broadcast input; 4 x 1 beside
 * a widened pair (4) and the rows' two inputs */
#define V_TILE_F32 6
#define V_TILE_PAIRS 4
#define V_Q4_ROWS 2

/* ===== NEON (aarch64) ========================================================================== */
#elif defined(V_NEON)
#define V_FAMILY_SIMD "NEON"
typedef struct {
    float32x4_t q[4];
} v16;
#define V4(EXPR) ({ v16 _r; for (int _i = 0; _i < 4; _i++) _r.q[_i] = (EXPR); _r; })

static inline v16 v_zero(void) { return V4(vdupq_n_f32(0.f)); }
static inline v16 v_set1(float f) { return V4(vdupq_n_f32(f)); }
static inline v16 v_load(const float *p) { return V4(vld1q_f32(p + 4 * _i)); }
static inline void v_store(float *p, v16 v) { for (int i = 0; i < 4; i++) vst1q_f32(p + 4 * i, v.q[i]); }
static inline v16 v_load_bf16n(const uint16_t *p, int64_t n) {
    uint16_t t[16] = {0};
    const uint16_t *s = n >= 16 ? p : t;
    if (n < 16 && n > 0) memcpy(t, p, n * 2);
    return V4(vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(s + 4 * _i), 16)));
}
static inline void v_store_bf16n(uint16_t *p, v16 v, int64_t n) {
    uint16_t t[16];
    for (int i = 0; i < 4; i++) vst1_u16(t + 4 * i, vshrn_n_u32(vreinterpretq_u32_f32(v.q[i]), 16));
    memcpy(p, t, (n >= 16 ? 16 : n > 0 ? n : 0) * 2);
}
static inline v16 v_add(v16 a, v16 b) { return V4(vaddq_f32(a.q[_i], b.q[_i])); }
static inline v16 v_sub(v16 a, v16 b) { return V4(vsubq_f32(a.q[_i], b.q[_i])); }
static inline v16 v_mul(v16 a, v16 b) { return V4(vmulq_f32(a.q[_i], b.q[_i])); }
static inline v16 v_div(v16 a, v16 b) { return V4(vdivq_f32(a.q[_i], b.q[_i])); }
static inline v16 v_fmadd(v16 a, v16 b, v16 c) { return V4(vfmaq_f32(c.q[_i], a.q[_i], b.q[_i])); }
static inline v16 v_fnmadd(v16 a, v16 b, v16 c) { return V4(vfmsq_f32(c.q[_i], a.q[_i], b.q[_i])); }
static inline m16 mask4(uint32x4_t m) {
    static const uint32_t bit[4] = {1, 2, 4, 8};
    return (m16)vaddvq_u32(vandq_u32(m, vld1q_u32(bit)));
}
static inline uint32x4_t unmask4(unsigned m) {
    static const uint32_t bit[4] = {1, 2, 4, 8};
    return vtstq_u32(vdupq_n_u32(m), vld1q_u32(bit));
}
static inline v16 v_select(m16 m, v16 a, v16 b) { return V4(vbslq_f32(unmask4(m >> (4 * _i)), a.q[_i], b.q[_i])); }
static inline m16 v_nan(v16 a) {
    m16 m = 0;
    for (int i = 0; i < 4; i++) m |= mask4(vmvnq_u32(vceqq_f32(a.q[i], a.q[i]))) << (4 * i);
    return m;
}
static inline v16 v_max(v16 a, v16 b) { /* as x86: b where either is NaN */
    const v16 m = V4(vbslq_f32(vcgtq_f32(a.q[_i], b.q[_i]), a.q[_i], b.q[_i]));
    return m;
}
static inline v16 v_abs(v16 a) { return V4(vabsq_f32(a.q[_i])); }
static inline float v_reduce_add(v16 v) {
    return vaddvq_f32(vaddq_f32(vaddq_f32(v.q[0], v.q[1]), vaddq_f32(v.q[2], v.q[3])));
}
static inline float v_reduce_max(v16 v) {
    float t[16], m;
    v_store(t, v);
    m = t[0];
    for (int i = 1; i < 16; i++) m = t[i] > m ? t[i] : m;
    return m;
}
#define V_CMP(NAME, OP)                                                                                    \
    static inline m16 NAME(v16 a, v16 b) {                                                                 \
        m16 m = 0;                                                                                         \
        for (int i = 0; i < 4; i++) m |= mask4(OP(a.q[i], b.q[i])) << (4 * i);                             \
        return m;                                                                                          \
    }
V_CMP(v_gt, vcgtq_f32)
V_CMP(v_ge, vcgeq_f32)
V_CMP(v_eq, vceqq_f32)
#undef V_CMP
static inline v16 v_round_bf16(v16 v) {
    v16 r;
    for (int i = 0; i < 4; i++) {
        const uint32x4_t u = vreinterpretq_u32_f32(v.q[i]), high = vdupq_n_u32(0xffff0000u);
        const uint32x4_t lsb = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
        const uint32x4_t rounded = vandq_u32(vaddq_u32(u, vaddq_u32(vdupq_n_u32(0x7fff), lsb)), high);
        const uint32x4_t quiet = vandq_u32(vorrq_u32(u, vdupq_n_u32(0x400000)), high);
        const uint32x4_t nan = vmvnq_u32(vceqq_f32(v.q[i], v.q[i]));
        r.q[i] = vreinterpretq_f32_u32(vbslq_u32(nan, quiet, rounded));
    }
    return r;
}
static inline float32x4_t exp4(float32x4_t x) {
    x = vmaxq_f32(x, vdupq_n_f32(-104.f));
    x = vminq_f32(x, vdupq_n_f32(100.f));
    const float32x4_t n = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(1.44269504088896341f)));
    float32x4_t r = vfmsq_f32(x, n, vdupq_n_f32(0.693359375f));
    r = vfmsq_f32(r, n, vdupq_n_f32(-2.12194440e-4f));
    static const float c[8] = {1.f / 5040.f, 1.f / 720.f, 1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f};
    float32x4_t p = vdupq_n_f32(c[0]);
    for (int i = 1; i < 8; i++) p = vfmaq_f32(vdupq_n_f32(c[i]), p, r);
    const int32x4_t ni = vcvtq_s32_f32(n), half = vshrq_n_s32(ni, 1), rest = vsubq_s32(ni, half);
    const float32x4_t s1 = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(half, vdupq_n_s32(127)), 23));
    const float32x4_t s2 = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(rest, vdupq_n_s32(127)), 23));
    return vmulq_f32(vmulq_f32(p, s1), s2);
}
static inline v16 v_exp(v16 x) {
    const v16 e = V4(exp4(x.q[_i]));
    return v_select(v_nan(x), x, e);
}
static inline void v_widen_bf16_pairs(const uint16_t *p, v16 *even, v16 *odd) {
    for (int i = 0; i < 4; i++) {
        const uint32x4_t u = vld1q_u32((const uint32_t *)(p + 8 * i));
        even->q[i] = vreinterpretq_f32_u32(vshlq_n_u32(u, 16));
        odd->q[i] = vreinterpretq_f32_u32(vandq_u32(u, vdupq_n_u32(0xffff0000u)));
    }
}
static inline void v_widen_q8_pairs(const int8_t *p, v16 *even, v16 *odd) {
    const int8x16x2_t pairs = vld2q_s8(p); /* val[0]: the even codes, val[1]: the odd ones */
    for (int h = 0; h < 2; h++) {
        const int16x8_t e = vmovl_s8(h ? vget_high_s8(pairs.val[0]) : vget_low_s8(pairs.val[0]));
        const int16x8_t o = vmovl_s8(h ? vget_high_s8(pairs.val[1]) : vget_low_s8(pairs.val[1]));
        even->q[2 * h] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(e)));
        even->q[2 * h + 1] = vcvtq_f32_s32(vmovl_s16(vget_high_s16(e)));
        odd->q[2 * h] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(o)));
        odd->q[2 * h + 1] = vcvtq_f32_s32(vmovl_s16(vget_high_s16(o)));
    }
}
static inline v16 v_load_u8(const uint8_t *p) {
    const uint8x16_t b = vld1q_u8(p);
    const uint16x8_t lo = vmovl_u8(vget_low_u8(b)), hi = vmovl_u8(vget_high_u8(b));
    v16 v;
    v.q[0] = vcvtq_f32_u32(vmovl_u16(vget_low_u16(lo))), v.q[1] = vcvtq_f32_u32(vmovl_u16(vget_high_u16(lo)));
    v.q[2] = vcvtq_f32_u32(vmovl_u16(vget_low_u16(hi))), v.q[3] = vcvtq_f32_u32(vmovl_u16(vget_high_u16(hi)));
    return v;
}
static inline v16 v_load_i8(const int8_t *p) {
    const int8x16_t b = vld1q_s8(p);
    const int16x8_t lo = vmovl_s8(vget_low_s8(b)), hi = vmovl_s8(vget_high_s8(b));
    v16 v;
    v.q[0] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo))), v.q[1] = vcvtq_f32_s32(vmovl_s16(vget_high_s16(lo)));
    v.q[2] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi))), v.q[3] = vcvtq_f32_s32(vmovl_s16(vget_high_s16(hi)));
    return v;
}
static inline void v_widen_q4_pairs(const uint8_t *p, v16 *even, v16 *odd) {
    const uint8x16_t b = vld1q_u8(p), eight = vdupq_n_u8(8);
    const int8x16_t e = vreinterpretq_s8_u8(vsubq_u8(vandq_u8(b, vdupq_n_u8(15)), eight));
    const int8x16_t o = vreinterpretq_s8_u8(vsubq_u8(vshrq_n_u8(b, 4), eight));
    for (int h = 0; h < 2; h++) {
        const int16x8_t e16 = vmovl_s8(h ? vget_high_s8(e) : vget_low_s8(e));
        const int16x8_t o16 = vmovl_s8(h ? vget_high_s8(o) : vget_low_s8(o));
        even->q[2 * h] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(e16)));
        even->q[2 * h + 1] = vcvtq_f32_s32(vmovl_s16(vget_high_s16(e16)));
        odd->q[2 * h] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(o16)));
        odd->q[2 * h + 1] = vcvtq_f32_s32(vmovl_s16(vget_high_s16(o16)));
    }
}
/* 32 q registers: 6 v16 of accumulators (24) beside a block's weights, 4 beside a widened pair */
#define V_TILE_F32 6
#define V_TILE_PAIRS 4
#define V_Q4_ROWS 2

/* ===== generic C: the reference ================================================================ */
#else
#define V_FAMILY_SIMD "generic C"
typedef struct {
    float f[16];
} v16;
#define VG(EXPR) ({ v16 _r; for (int _i = 0; _i < 16; _i++) _r.f[_i] = (EXPR); _r; })

static inline v16 v_zero(void) { return VG(0.f); }
static inline v16 v_set1(float x) { return VG(x); }
static inline v16 v_load(const float *p) { return VG(p[_i]); }
static inline v16 v_loadn(const float *p, int64_t n) { return VG(_i < n ? p[_i] : 0.f); }
static inline void v_store(float *p, v16 v) { memcpy(p, v.f, sizeof v.f); }
static inline void v_storen(float *p, v16 v, int64_t n) {
    for (int i = 0; i < 16 && i < n; i++) p[i] = v.f[i];
}
static inline v16 v_load_bf16n(const uint16_t *p, int64_t n) { return VG(_i < n ? bf2f(p[_i]) : 0.f); }
static inline void v_store_bf16n(uint16_t *p, v16 v, int64_t n) {
    for (int i = 0; i < 16 && i < n; i++) {
        uint32_t u;
        memcpy(&u, &v.f[i], 4);
        p[i] = (uint16_t)(u >> 16);
    }
}
static inline v16 v_add(v16 a, v16 b) { return VG(a.f[_i] + b.f[_i]); }
static inline v16 v_sub(v16 a, v16 b) { return VG(a.f[_i] - b.f[_i]); }
static inline v16 v_mul(v16 a, v16 b) { return VG(a.f[_i] * b.f[_i]); }
static inline v16 v_div(v16 a, v16 b) { return VG(a.f[_i] / b.f[_i]); }
/* a b + c (contracted to one rounding where the target has FMA: fmaf would be a library call) */
static inline v16 v_fmadd(v16 a, v16 b, v16 c) { return VG(a.f[_i] * b.f[_i] + c.f[_i]); }
static inline v16 v_fnmadd(v16 a, v16 b, v16 c) { return VG(c.f[_i] - a.f[_i] * b.f[_i]); }
static inline v16 v_max(v16 a, v16 b) { return VG(a.f[_i] > b.f[_i] ? a.f[_i] : b.f[_i]); }
static inline v16 v_abs(v16 a) { return VG(fabsf(a.f[_i])); }
static inline float v_reduce_add(v16 v) {
    float s = 0.f;
    for (int i = 0; i < 16; i++) s += v.f[i];
    return s;
}
static inline float v_reduce_max(v16 v) {
    float m = v.f[0];
    for (int i = 1; i < 16; i++) m = v.f[i] > m ? v.f[i] : m;
    return m;
}
#define V_CMP(NAME, TEST)                                                                                  \
    static inline m16 NAME(v16 a, v16 b) {                                                                 \
        m16 m = 0;                                                                                         \
        for (int i = 0; i < 16; i++) m |= (m16)(TEST) << i;                                                \
        return m;                                                                                          \
    }
V_CMP(v_gt, a.f[i] > b.f[i])
V_CMP(v_ge, a.f[i] >= b.f[i])
V_CMP(v_eq, a.f[i] == b.f[i])
#undef V_CMP
static inline m16 v_nan(v16 a) {
    m16 m = 0;
    for (int i = 0; i < 16; i++) m |= (m16)(a.f[i] != a.f[i]) << i;
    return m;
}
static inline v16 v_select(m16 m, v16 a, v16 b) { return VG((m >> _i) & 1 ? a.f[_i] : b.f[_i]); }
static inline v16 v_round_bf16(v16 v) { return VG(bf2f(f2bf(v.f[_i]))); }
static inline v16 v_exp(v16 x) { return VG(expf(x.f[_i])); }
static inline void v_widen_bf16_pairs(const uint16_t *p, v16 *even, v16 *odd) {
    *even = VG(bf2f(p[2 * _i]));
    *odd = VG(bf2f(p[2 * _i + 1]));
}
static inline void v_widen_q8_pairs(const int8_t *p, v16 *even, v16 *odd) {
    *even = VG((float)p[2 * _i]);
    *odd = VG((float)p[2 * _i + 1]);
}
static inline v16 v_load_u8(const uint8_t *p) { return VG((float)p[_i]); }
static inline v16 v_load_i8(const int8_t *p) { return VG((float)p[_i]); }
static inline void v_widen_q4_pairs(const uint8_t *p, v16 *even, v16 *odd) {
    *even = VG((float)((p[_i] & 15) - 8));
    *odd = VG((float)((p[_i] >> 4) - 8));
}
static inline v16 v_sum_each(const v16 v[16]) { return VG(v_reduce_add(v[_i])); }
#define V_TILE_F32 8
#define V_TILE_PAIRS 8
#define V_Q4_ROWS 4
#endif

/* ---- AVX2 and NEON: partial loads and stores through a buffer of 16 (tails only), horizontal
 * sums one vector at a time ------------------------------------------------------------------- */
#if defined(V_AVX2) || defined(V_NEON)
static inline v16 v_loadn(const float *p, int64_t n) {
    if (n >= 16) return v_load(p);
    float t[16] = {0};
    if (n > 0) memcpy(t, p, n * sizeof(float));
    return v_load(t);
}
static inline void v_storen(float *p, v16 v, int64_t n) {
    if (n >= 16) return v_store(p, v);
    float t[16];
    v_store(t, v);
    if (n > 0) memcpy(p, t, n * sizeof(float));
}
static inline v16 v_sum_each(const v16 v[16]) {
    float t[16];
    for (int i = 0; i < 16; i++) t[i] = v_reduce_add(v[i]);
    return v_load(t);
}
#endif

/* ---- on every family ------------------------------------------------------------------------- */
/* `n` lanes from p + i, float32 or bfloat16 (bf), widened */
static inline v16 v_loadx(const void *p, int64_t i, int bf, int64_t n) {
    return bf ? v_load_bf16n((const uint16_t *)p + i, n) : v_loadn((const float *)p + i, n);
}
/* store lanes holding model-dtype values */
static inline void v_storex(void *p, int64_t i, v16 v, int bf, int64_t n) {
    if (bf) v_store_bf16n((uint16_t *)p + i, v, n);
    else v_storen((float *)p + i, v, n);
}
static inline v16 v_rnd(v16 v, int bf) { return bf ? v_round_bf16(v) : v; }

/* The value a PyTorch op of the model's dtype would store. */
static inline float rnd(float f, int bf) { return bf ? bf2f(f2bf(f)) : f; }
static inline float load(const void *p, int64_t i, int bf) {
    return bf ? bf2f(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

#endif
