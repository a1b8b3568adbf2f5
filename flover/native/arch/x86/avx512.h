/* AVX-512F: one __m512: simd.h's 16 float lanes (included by simd.h only, which chose this family; on arch/common.h). */
#ifndef FLOVER_ARCH_AVX512_H
#define FLOVER_ARCH_AVX512_H

#include "../common.h"

#include <immintrin.h>

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
static inline v16 v_min(v16 a, v16 b) { return _mm512_min_ps(a, b); } /* likewise */
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
static inline v16 v_load_nibbles(const uint8_t *p, int high) { /* 16 bytes' low (or high) nibbles */
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm512_cvtepi32_ps(_mm512_and_si512(high ? _mm512_srli_epi32(b, 4) : b, _mm512_set1_epi32(15)));
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

#endif
