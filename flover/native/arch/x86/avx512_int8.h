/* AVX-512 (VNNI where present): simd_int8.h's integer dot products: simd.h's 16 float lanes (included by simd.h only, which chose this family; on arch/common.h). */
#ifndef FLOVER_ARCH_AVX512_INT8_H
#define FLOVER_ARCH_AVX512_INT8_H

#include "../common.h"

typedef __m512i q64;
typedef __m512i i16;
static inline q64 q_load(const uint8_t *p) { return _mm512_loadu_si512(p); }
static inline void q_nibbles(q64 b, q64 *lo, q64 *hi) {
    const __m512i m = _mm512_set1_epi8(15);
    *lo = _mm512_and_si512(b, m), *hi = _mm512_and_si512(_mm512_srli_epi16(b, 4), m);
}
static inline q64 q_lut16(q64 b, const uint8_t *table) { /* each byte (below 16) -> table[byte] */
    return _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)table)), b);
}
static inline q64 q_high2(q64 *h) { /* 16-bit shifts: bits crossing into a neighbour byte are masked off */
    const q64 r = _mm512_and_si512(_mm512_slli_epi16(*h, 4), _mm512_set1_epi8(0x30));
    *h = _mm512_srli_epi16(*h, 2);
    return r;
}
static inline q64 q_or(q64 a, q64 b) { return _mm512_or_si512(a, b); }
static inline q64 q_gather(const uint8_t *p, int64_t stride, int64_t n) { /* (rows n.. not read: zeros) */
    const __m512i at = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32((int32_t)stride));
    return _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), (__mmask16)lanes(n), at, p, 1);
}
static inline void q_fifth(q64 *h, q64 *lo, q64 *hi) { /* 16-bit shifts: bits 0 and 4 never cross bytes */
    const __m512i m = _mm512_set1_epi8(0x10);
    *lo = _mm512_or_si512(*lo, _mm512_and_si512(_mm512_slli_epi16(*h, 4), m));
    *hi = _mm512_or_si512(*hi, _mm512_and_si512(*h, m));
    *h = _mm512_srli_epi16(*h, 1);
}
static inline q64 q_crumb(q64 *h) { /* 16-bit shifts: only each byte's low 2 bits are kept */
    const q64 r = _mm512_and_si512(*h, _mm512_set1_epi8(3));
    *h = _mm512_srli_epi16(*h, 2);
    return r;
}
static inline q64 q_bit2(q64 *h) {
    const q64 r = _mm512_and_si512(_mm512_slli_epi16(*h, 2), _mm512_set1_epi8(4));
    *h = _mm512_srli_epi16(*h, 1);
    return r;
}
/* q_gather's lanes for 16 rows of 32 bytes (q_rows32: 8 vectors, bytes 4i..4i+3 of row r in lane
 * r of out[i]) or of 16 (q_rows16: 4), by loads and a transpose in registers: a gather costs by
 * element (8 of 16 elements cost more than the 24 shuffles here). Rows n.. read as zeros. */
#define HAVE_Q_ROWS 1
static inline const void *q_row(const uint8_t *p, int64_t stride, int64_t r, int64_t n) {
    static const uint8_t zeros[32];
    return r < n ? p + r * stride : zeros;
}
static inline void q_rows32(const uint8_t *p, int64_t stride, int64_t n, q64 out[8]) {
    __m512i a[8], t[8], u[8]; /* a[k]: rows (k, k + 4) for k < 4, (k + 4, k + 8) after */
    for (int k = 0; k < 8; k++) {
        const int64_t r = k < 4 ? k : k + 4;
        a[k] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)q_row(p, stride, r, n))),
                                  _mm256_loadu_si256((const __m256i *)q_row(p, stride, r + 4, n)), 1);
    }
    for (int g = 0; g < 8; g += 4) { /* 4 x 4 transposes in each 128-bit lane */
        t[g] = _mm512_unpacklo_epi32(a[g], a[g + 1]), t[g + 1] = _mm512_unpackhi_epi32(a[g], a[g + 1]);
        t[g + 2] = _mm512_unpacklo_epi32(a[g + 2], a[g + 3]), t[g + 3] = _mm512_unpackhi_epi32(a[g + 2], a[g + 3]);
        u[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]), u[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
        u[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]), u[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
    }
    for (int j = 0; j < 4; j++) { /* u[j] lanes: bytes 4j.. of rows 0-3, 4(j+4).. of rows 0-3, 4j.. of rows 4-7, ... */
        out[j] = _mm512_shuffle_i32x4(u[j], u[4 + j], _MM_SHUFFLE(2, 0, 2, 0));
        out[j + 4] = _mm512_shuffle_i32x4(u[j], u[4 + j], _MM_SHUFFLE(3, 1, 3, 1));
    }
}
static inline void q_rows16(const uint8_t *p, int64_t stride, int64_t n, q64 out[4]) {
    __m512i b[4]; /* b[k]: rows k, k + 4, k + 8, k + 12 */
    for (int k = 0; k < 4; k++) {
        b[k] = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)q_row(p, stride, k, n)));
        for (int l = 1; l < 4; l++) {
            const __m128i row = _mm_loadu_si128((const __m128i *)q_row(p, stride, k + 4 * l, n));
            b[k] = l == 1 ? _mm512_inserti32x4(b[k], row, 1) : l == 2 ? _mm512_inserti32x4(b[k], row, 2) : _mm512_inserti32x4(b[k], row, 3);
        }
    }
    const __m512i t0 = _mm512_unpacklo_epi32(b[0], b[1]), t1 = _mm512_unpackhi_epi32(b[0], b[1]);
    const __m512i t2 = _mm512_unpacklo_epi32(b[2], b[3]), t3 = _mm512_unpackhi_epi32(b[2], b[3]);
    out[0] = _mm512_unpacklo_epi64(t0, t2), out[1] = _mm512_unpackhi_epi64(t0, t2);
    out[2] = _mm512_unpacklo_epi64(t1, t3), out[3] = _mm512_unpackhi_epi64(t1, t3);
}
static inline i16 i_zero(void) { return _mm512_setzero_si512(); }
static inline i16 i_dot4(i16 acc, q64 w, const int8_t *x) {
#if defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(x4_bytes(x)));
#else
    const __m512i pairs = _mm512_maddubs_epi16(w, _mm512_set1_epi32(x4_bytes(x)));
    return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
#endif
}
static inline i16 i_dot4x2(i16 acc, q64 w0, const int8_t *x0, q64 w1, const int8_t *x1) {
#if defined(__AVX512VNNI__)
    return i_dot4(i_dot4(acc, w0, x0), w1, x1);
#else
    const __m512i pairs = _mm512_add_epi16(_mm512_maddubs_epi16(w0, _mm512_set1_epi32(x4_bytes(x0))),
                                           _mm512_maddubs_epi16(w1, _mm512_set1_epi32(x4_bytes(x1))));
    return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
#endif
}
/* A group's sums before its scale (the Q4_K super-block tiles, simd_int8.h): int32 with VNNI, times
 * each row's scale (mullo), else maddubs' int16 pairs, widened times the scale (madd) */
typedef __m512i g16;
static inline g16 g_zero(void) { return _mm512_setzero_si512(); }
#if defined(__AVX512VNNI__)
#define G_INT32 1
static inline g16 g_dot4x2(g16 g, q64 w0, const int8_t *x0, q64 w1, const int8_t *x1) { return i_dot4x2(g, w0, x0, w1, x1); }
static inline __m512i widen_scales(__m512i s) { return s; }
static inline i16 g_scaled(i16 acc, g16 g, i16 sc) { return _mm512_add_epi32(acc, _mm512_mullo_epi32(g, sc)); }
#else
#define G_INT32 0
static inline g16 g_dot4x2(g16 g, q64 w0, const int8_t *x0, q64 w1, const int8_t *x1) {
    return _mm512_add_epi16(g, _mm512_add_epi16(_mm512_maddubs_epi16(w0, _mm512_set1_epi32(x4_bytes(x0))),
                                                _mm512_maddubs_epi16(w1, _mm512_set1_epi32(x4_bytes(x1)))));
}
static inline __m512i widen_scales(__m512i s) { /* (-32768 <= s < 32768) */
    return _mm512_or_si512(_mm512_and_si512(s, _mm512_set1_epi32(0xffff)), _mm512_slli_epi32(s, 16));
}
static inline i16 g_scaled(i16 acc, g16 g, i16 sc) { return _mm512_add_epi32(acc, _mm512_madd_epi16(g, sc)); }
#endif
static inline __m512i u8_lanes(const uint8_t *s) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)s)); }
static inline __m512i i8_lanes(const int8_t *s) { return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)s)); }
static inline i16 i_scales_u8(const uint8_t *s) { return widen_scales(u8_lanes(s)); }
static inline i16 i_scales_i8(const int8_t *s) { return widen_scales(i8_lanes(s)); }
/* two groups' minimums per row as one lane's int16 pair (a, b), and acc += a two[0] + b two[1] */
typedef i16 i16x2;
static inline i16x2 i_pairs(__m512i a, __m512i b) {
    return _mm512_or_si512(_mm512_and_si512(a, _mm512_set1_epi32(0xffff)), _mm512_slli_epi32(b, 16));
}
static inline i16x2 i_pairs_u8(const uint8_t *a, const uint8_t *b) { return i_pairs(u8_lanes(a), u8_lanes(b)); }
static inline i16x2 i_pairs_i8(const int8_t *a, const int8_t *b) { return i_pairs(i8_lanes(a), i8_lanes(b)); }
static inline i16 i_less32(i16 a, i16 b) { return _mm512_sub_epi32(a, _mm512_slli_epi32(b, 5)); }
static inline i16 i_pairs_dot(i16 acc, i16x2 pairs, const int16_t *two) {
    return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_set1_epi32(x4_bytes((const int8_t *)two))));
}
#if defined(__AVX512VNNI__)
typedef __m512i s64;
static inline s64 s_from(q64 w) { return _mm512_xor_si512(w, _mm512_set1_epi8(-128)); }
static inline s64 s_load(const uint8_t *p) { return s_from(_mm512_loadu_si512(p)); }
static inline i16 s_dot4(i16 acc, s64 w, const int8_t *x) { return i_dot4(acc, w, x); }
static inline i16 s_done(i16 acc, int32_t xsum) { return _mm512_sub_epi32(acc, _mm512_set1_epi32(128 * xsum)); }
#else
typedef struct {
    __m512i abs;
    __mmask64 negative;
} s64;
static inline s64 s_from(q64 w) { return (s64){_mm512_abs_epi8(w), _mm512_movepi8_mask(w)}; }
static inline s64 s_load(const uint8_t *p) { return s_from(_mm512_loadu_si512(p)); }
static inline i16 s_dot4(i16 acc, s64 w, const int8_t *x) {
    const __m512i xv = _mm512_set1_epi32(x4_bytes(x));
    const __m512i pairs = _mm512_maddubs_epi16(w.abs, _mm512_mask_sub_epi8(xv, w.negative, _mm512_setzero_si512(), xv));
    return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
}
static inline i16 s_done(i16 acc, int32_t xsum) { return (void)xsum, acc; }
#endif
static inline v16 v_from_i(i16 a) { return _mm512_cvtepi32_ps(a); }
static inline v16 v_round(v16 v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline void v_store_i8(int8_t *p, v16 v) { _mm_storeu_si128((__m128i *)p, _mm512_cvtsepi32_epi8(_mm512_cvttps_epi32(v))); }

#endif
