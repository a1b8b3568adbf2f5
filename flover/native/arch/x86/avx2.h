/* AVX2 + FMA: two __m256: simd.h's 16 float lanes (included by simd.h only, which chose this family; on arch/common.h). */
#ifndef FLOVER_ARCH_AVX2_H
#define FLOVER_ARCH_AVX2_H

#include "../common.h"

#include <immintrin.h>

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
static inline v16 v_min(v16 a, v16 b) { return V2(_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)); }
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
static inline v16 v_load_nibbles(const uint8_t *p, int high) { /* 16 bytes' low (or high) nibbles */
    const __m256i m = _mm256_set1_epi32(15), lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)),
                  hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8)));
    return V2(_mm256_cvtepi32_ps(_mm256_and_si256(high ? _mm256_srli_epi32(lo, 4) : lo, m)),
              _mm256_cvtepi32_ps(_mm256_and_si256(high ? _mm256_srli_epi32(hi, 4) : hi, m)));
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

#endif
