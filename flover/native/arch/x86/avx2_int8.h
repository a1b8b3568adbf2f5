/* AVX2 (AVX-VNNI where present): simd_int8.h's integer dot products: simd.h's 16 float lanes (included by simd.h only, which chose this family; on arch/common.h). */
#ifndef FLOVER_ARCH_AVX2_INT8_H
#define FLOVER_ARCH_AVX2_INT8_H

#include "../common.h"

typedef struct {
    __m256i lo, hi; /* rows 0-7, 8-15 */
} q64;
typedef q64 i16;
static inline q64 q_load(const uint8_t *p) {
    return (q64){_mm256_loadu_si256((const __m256i *)p), _mm256_loadu_si256((const __m256i *)(p + 32))};
}
static inline void q_nibbles(q64 b, q64 *lo, q64 *hi) {
    const __m256i m = _mm256_set1_epi8(15);
    *lo = (q64){_mm256_and_si256(b.lo, m), _mm256_and_si256(b.hi, m)};
    *hi = (q64){_mm256_and_si256(_mm256_srli_epi16(b.lo, 4), m), _mm256_and_si256(_mm256_srli_epi16(b.hi, 4), m)};
}
static inline q64 q_lut16(q64 b, const uint8_t *table) { /* each byte (below 16) -> table[byte] */
    const __m256i t = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)table));
    return (q64){_mm256_shuffle_epi8(t, b.lo), _mm256_shuffle_epi8(t, b.hi)};
}
static inline q64 q_high2(q64 *h) {
    const __m256i m = _mm256_set1_epi8(0x30);
    const q64 r = {_mm256_and_si256(_mm256_slli_epi16(h->lo, 4), m), _mm256_and_si256(_mm256_slli_epi16(h->hi, 4), m)};
    *h = (q64){_mm256_srli_epi16(h->lo, 2), _mm256_srli_epi16(h->hi, 2)};
    return r;
}
static inline q64 q_or(q64 a, q64 b) { return (q64){_mm256_or_si256(a.lo, b.lo), _mm256_or_si256(a.hi, b.hi)}; }
static inline q64 q_gather(const uint8_t *p, int64_t stride, int64_t n) { /* (rows n.. not read: zeros) */
    const __m256i at = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32((int32_t)stride));
    const __m256i r = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), zero = _mm256_setzero_si256();
    const __m256i m_lo = _mm256_cmpgt_epi32(_mm256_set1_epi32((int32_t)n), r), m_hi = _mm256_cmpgt_epi32(_mm256_set1_epi32((int32_t)n - 8), r);
    return (q64){_mm256_mask_i32gather_epi32(zero, (const int *)p, at, m_lo, 1),
                 _mm256_mask_i32gather_epi32(zero, (const int *)(p + 8 * stride), at, m_hi, 1)};
}
static inline __m256i fifth_8(__m256i codes, __m256i bits) { return _mm256_or_si256(codes, _mm256_and_si256(bits, _mm256_set1_epi8(0x10))); }
static inline void q_fifth(q64 *h, q64 *lo, q64 *hi) {
    *lo = (q64){fifth_8(lo->lo, _mm256_slli_epi16(h->lo, 4)), fifth_8(lo->hi, _mm256_slli_epi16(h->hi, 4))};
    *hi = (q64){fifth_8(hi->lo, h->lo), fifth_8(hi->hi, h->hi)};
    *h = (q64){_mm256_srli_epi16(h->lo, 1), _mm256_srli_epi16(h->hi, 1)};
}
static inline q64 q_crumb(q64 *h) { /* 16-bit shifts: only each byte's low 2 bits are kept */
    const __m256i m = _mm256_set1_epi8(3);
    const q64 r = {_mm256_and_si256(h->lo, m), _mm256_and_si256(h->hi, m)};
    *h = (q64){_mm256_srli_epi16(h->lo, 2), _mm256_srli_epi16(h->hi, 2)};
    return r;
}
static inline q64 q_bit2(q64 *h) {
    const __m256i m = _mm256_set1_epi8(4);
    const q64 r = {_mm256_and_si256(_mm256_slli_epi16(h->lo, 2), m), _mm256_and_si256(_mm256_slli_epi16(h->hi, 2), m)};
    *h = (q64){_mm256_srli_epi16(h->lo, 1), _mm256_srli_epi16(h->hi, 1)};
    return r;
}
static inline i16 i_zero(void) { return (i16){_mm256_setzero_si256(), _mm256_setzero_si256()}; }
static inline __m256i dot4_8(__m256i acc, __m256i w, __m256i x) {
#if defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, w, x);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
#endif
}
static inline i16 i_dot4(i16 acc, q64 w, const int8_t *x) {
    const __m256i xv = _mm256_set1_epi32(x4_bytes(x));
    return (i16){dot4_8(acc.lo, w.lo, xv), dot4_8(acc.hi, w.hi, xv)};
}
static inline i16 i_dot4x2(i16 acc, q64 w0, const int8_t *x0, q64 w1, const int8_t *x1) {
#if defined(__AVXVNNI__)
    return i_dot4(i_dot4(acc, w0, x0), w1, x1);
#else
    const __m256i a = _mm256_set1_epi32(x4_bytes(x0)), b = _mm256_set1_epi32(x4_bytes(x1)), one = _mm256_set1_epi16(1);
    const __m256i lo = _mm256_add_epi16(_mm256_maddubs_epi16(w0.lo, a), _mm256_maddubs_epi16(w1.lo, b));
    const __m256i hi = _mm256_add_epi16(_mm256_maddubs_epi16(w0.hi, a), _mm256_maddubs_epi16(w1.hi, b));
    return (i16){_mm256_add_epi32(acc.lo, _mm256_madd_epi16(lo, one)), _mm256_add_epi32(acc.hi, _mm256_madd_epi16(hi, one))};
#endif
}
/* A group's sums before its scale (the Q4_K super-block tiles, simd_int8.h): int16 pairs from
 * maddubs, which g_scaled widens times each row's scale (madd, the scale in both halves of a lane),
 * or int32 with VNNI, times the scale (mullo) */
#if defined(__AVXVNNI__)
#define G_INT32 1
typedef i16 g16;
static inline g16 g_zero(void) { return i_zero(); }
static inline g16 g_dot4x2(g16 g, q64 w0, const int8_t *x0, q64 w1, const int8_t *x1) { return i_dot4x2(g, w0, x0, w1, x1); }
static inline __m256i widen_scales(__m256i s) { return s; }
static inline i16 g_scaled(i16 acc, g16 g, i16 sc) {
    return (i16){_mm256_add_epi32(acc.lo, _mm256_mullo_epi32(g.lo, sc.lo)), _mm256_add_epi32(acc.hi, _mm256_mullo_epi32(g.hi, sc.hi))};
}
#else
#define G_INT32 0
typedef q64 g16;
static inline g16 g_zero(void) { return i_zero(); }
static inline g16 g_dot4x2(g16 g, q64 w0, const int8_t *x0, q64 w1, const int8_t *x1) {
    const __m256i a = _mm256_set1_epi32(x4_bytes(x0)), b = _mm256_set1_epi32(x4_bytes(x1));
    return (g16){_mm256_add_epi16(g.lo, _mm256_add_epi16(_mm256_maddubs_epi16(w0.lo, a), _mm256_maddubs_epi16(w1.lo, b))),
                 _mm256_add_epi16(g.hi, _mm256_add_epi16(_mm256_maddubs_epi16(w0.hi, a), _mm256_maddubs_epi16(w1.hi, b)))};
}
static inline __m256i widen_scales(__m256i s) { /* (-32768 <= s < 32768) */
    return _mm256_or_si256(_mm256_and_si256(s, _mm256_set1_epi32(0xffff)), _mm256_slli_epi32(s, 16));
}
static inline i16 g_scaled(i16 acc, g16 g, i16 sc) {
    return (i16){_mm256_add_epi32(acc.lo, _mm256_madd_epi16(g.lo, sc.lo)), _mm256_add_epi32(acc.hi, _mm256_madd_epi16(g.hi, sc.hi))};
}
#endif
static inline __m256i u8_lanes(const uint8_t *s) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)s)); }
static inline __m256i i8_lanes(const int8_t *s) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)s)); }
static inline i16 i_scales_u8(const uint8_t *s) { return (i16){widen_scales(u8_lanes(s)), widen_scales(u8_lanes(s + 8))}; }
static inline i16 i_scales_i8(const int8_t *s) { return (i16){widen_scales(i8_lanes(s)), widen_scales(i8_lanes(s + 8))}; }
/* two groups' minimums per row as one lane's int16 pair (a, b), and acc += a two[0] + b two[1] */
typedef i16 i16x2;
static inline __m256i i_pair(__m256i a, __m256i b) {
    return _mm256_or_si256(_mm256_and_si256(a, _mm256_set1_epi32(0xffff)), _mm256_slli_epi32(b, 16));
}
static inline i16x2 i_pairs_u8(const uint8_t *a, const uint8_t *b) {
    return (i16){i_pair(u8_lanes(a), u8_lanes(b)), i_pair(u8_lanes(a + 8), u8_lanes(b + 8))};
}
static inline i16x2 i_pairs_i8(const int8_t *a, const int8_t *b) {
    return (i16){i_pair(i8_lanes(a), i8_lanes(b)), i_pair(i8_lanes(a + 8), i8_lanes(b + 8))};
}
static inline i16 i_less32(i16 a, i16 b) {
    return (i16){_mm256_sub_epi32(a.lo, _mm256_slli_epi32(b.lo, 5)), _mm256_sub_epi32(a.hi, _mm256_slli_epi32(b.hi, 5))};
}
static inline i16 i_pairs_dot(i16 acc, i16x2 pairs, const int16_t *two) {
    const __m256i b = _mm256_set1_epi32(x4_bytes((const int8_t *)two));
    return (i16){_mm256_add_epi32(acc.lo, _mm256_madd_epi16(pairs.lo, b)), _mm256_add_epi32(acc.hi, _mm256_madd_epi16(pairs.hi, b))};
}
#if defined(__AVXVNNI__)
typedef q64 s64;
static inline s64 s_from(q64 w) {
    const __m256i flip = _mm256_set1_epi8(-128);
    return (s64){_mm256_xor_si256(w.lo, flip), _mm256_xor_si256(w.hi, flip)};
}
static inline s64 s_load(const uint8_t *p) { return s_from(q_load(p)); }
static inline i16 s_dot4(i16 acc, s64 w, const int8_t *x) { return i_dot4(acc, w, x); }
static inline i16 s_done(i16 acc, int32_t xsum) {
    const __m256i c = _mm256_set1_epi32(128 * xsum);
    return (i16){_mm256_sub_epi32(acc.lo, c), _mm256_sub_epi32(acc.hi, c)};
}
#else
typedef struct {
    __m256i abs_lo, abs_hi, lo, hi;
} s64;
static inline s64 s_from(q64 w) { return (s64){_mm256_abs_epi8(w.lo), _mm256_abs_epi8(w.hi), w.lo, w.hi}; }
static inline s64 s_load(const uint8_t *p) { return s_from(q_load(p)); }
static inline i16 s_dot4(i16 acc, s64 w, const int8_t *x) {
    const __m256i xv = _mm256_set1_epi32(x4_bytes(x)), one = _mm256_set1_epi16(1);
    const __m256i lo = _mm256_maddubs_epi16(w.abs_lo, _mm256_sign_epi8(xv, w.lo));
    const __m256i hi = _mm256_maddubs_epi16(w.abs_hi, _mm256_sign_epi8(xv, w.hi));
    return (i16){_mm256_add_epi32(acc.lo, _mm256_madd_epi16(lo, one)), _mm256_add_epi32(acc.hi, _mm256_madd_epi16(hi, one))};
}
static inline i16 s_done(i16 acc, int32_t xsum) { return (void)xsum, acc; }
#endif
static inline v16 v_from_i(i16 a) { return (v16){_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
static inline v16 v_round(v16 v) {
    return (v16){_mm256_round_ps(v.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                 _mm256_round_ps(v.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
/* lanes holding whole numbers in -127..127 -> bytes (saturating, as AVX-512's) */
static inline void v_store_i8(int8_t *p, v16 v) {
    const __m256i w = _mm256_packs_epi32(_mm256_cvttps_epi32(v.lo), _mm256_cvttps_epi32(v.hi)); /* 0-3 8-11 4-7 12-15 */
    const __m256i o = _mm256_permute4x64_epi64(w, 0xD8);
    _mm_storeu_si128((__m128i *)p, _mm_packs_epi16(_mm256_castsi256_si128(o), _mm256_extracti128_si256(o, 1)));
}

#endif
