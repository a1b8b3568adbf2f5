/* Integer dot products on 16 lanes (the int8 tiles: weights of up to 6 bits, or Q8_0's signed
 * bytes, times inputs quantized to int8), whatever the instruction set, beside simd.h's float
 * mapping:
 *
 *   q64   64 bytes: 16 lanes (a block's 16 output rows) of 4 unsigned codes, each below 64
 *   i16   16 int32 lanes
 *   i_dot4(acc, w, x)   acc[r] += w[4r] x[0] + w[4r + 1] x[1] + w[4r + 2] x[2] + w[4r + 3] x[3]
 *                       (x: 4 signed bytes): AVX-512 VNNI / AVX-VNNI vpdpbusd, AVX-512BW / AVX2
 *                       maddubs + madd (no saturation below 64 x 127 x 2), NEON sdot (or
 *                       widening multiplies without dotprod), plain loops
 *   i_dot4x2(acc, w0, x0, w1, x1)   two of them: maddubs adds both pairs in int16 before
 *                       widening (at most 4 x 63 x 127), one widening instead of two
 *   q_high2(&h)         the next 2 bits of each byte of h moved to bits 4-5 (h's lowest two, then
 *                       h shifts down by 2 for the next call); q_or joins them to 4-bit codes:
 *                       6-bit codes from nibbles and their high bits
 *   q_fifth(&h, &lo, &hi)  5-bit codes from nibbles: h's bit 0 joins lo at bit 4, its bit 4
 *                       joins hi there, then h shifts down by 1 for the next call
 *   s64   64 bytes of signed codes (-128..127: Q8_0's), as s_load prepares them
 *   s_dot4(acc, w, x)   i_dot4 for signed codes: VNNI adds (w + 128) x (its first operand is
 *                       unsigned), which s_done(acc, sum of the group's x) takes back once per
 *                       group; maddubs takes |w| times x with w's sign (at most 2 x 128 x 127);
 *                       NEON's sdot is signed already
 *
 * Every sum is exact (integers), so the families differ in no bit here.
 */
#ifndef FLOVER_SIMD_INT8_H
#define FLOVER_SIMD_INT8_H

#include "simd.h"

static inline int32_t x4_bytes(const int8_t *x) { /* 4 input bytes as one lane's worth */
    int32_t v;
    memcpy(&v, x, 4);
    return v;
}

#if defined(V_AVX512)
typedef __m512i q64;
typedef __m512i i16;
static inline q64 q_load(const uint8_t *p) { return _mm512_loadu_si512(p); }
static inline void q_nibbles(q64 b, q64 *lo, q64 *hi) {
    const __m512i m = _mm512_set1_epi8(15);
    *lo = _mm512_and_si512(b, m), *hi = _mm512_and_si512(_mm512_srli_epi16(b, 4), m);
}
static inline q64 q_high2(q64 *h) { /* 16-bit shifts: bits crossing into a neighbour byte are masked off */
    const q64 r = _mm512_and_si512(_mm512_slli_epi16(*h, 4), _mm512_set1_epi8(0x30));
    *h = _mm512_srli_epi16(*h, 2);
    return r;
}
static inline q64 q_or(q64 a, q64 b) { return _mm512_or_si512(a, b); }
static inline void q_fifth(q64 *h, q64 *lo, q64 *hi) { /* 16-bit shifts: bits 0 and 4 never cross bytes */
    const __m512i m = _mm512_set1_epi8(0x10);
    *lo = _mm512_or_si512(*lo, _mm512_and_si512(_mm512_slli_epi16(*h, 4), m));
    *hi = _mm512_or_si512(*hi, _mm512_and_si512(*h, m));
    *h = _mm512_srli_epi16(*h, 1);
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
#if defined(__AVX512VNNI__)
typedef __m512i s64;
static inline s64 s_load(const uint8_t *p) { return _mm512_xor_si512(_mm512_loadu_si512(p), _mm512_set1_epi8(-128)); }
static inline i16 s_dot4(i16 acc, s64 w, const int8_t *x) { return i_dot4(acc, w, x); }
static inline i16 s_done(i16 acc, int32_t xsum) { return _mm512_sub_epi32(acc, _mm512_set1_epi32(128 * xsum)); }
#else
typedef struct {
    __m512i abs;
    __mmask64 negative;
} s64;
static inline s64 s_load(const uint8_t *p) {
    const __m512i w = _mm512_loadu_si512(p);
    return (s64){_mm512_abs_epi8(w), _mm512_movepi8_mask(w)};
}
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

#elif defined(V_AVX2)
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
static inline q64 q_high2(q64 *h) {
    const __m256i m = _mm256_set1_epi8(0x30);
    const q64 r = {_mm256_and_si256(_mm256_slli_epi16(h->lo, 4), m), _mm256_and_si256(_mm256_slli_epi16(h->hi, 4), m)};
    *h = (q64){_mm256_srli_epi16(h->lo, 2), _mm256_srli_epi16(h->hi, 2)};
    return r;
}
static inline q64 q_or(q64 a, q64 b) { return (q64){_mm256_or_si256(a.lo, b.lo), _mm256_or_si256(a.hi, b.hi)}; }
static inline __m256i fifth_8(__m256i codes, __m256i bits) { return _mm256_or_si256(codes, _mm256_and_si256(bits, _mm256_set1_epi8(0x10))); }
static inline void q_fifth(q64 *h, q64 *lo, q64 *hi) {
    *lo = (q64){fifth_8(lo->lo, _mm256_slli_epi16(h->lo, 4)), fifth_8(lo->hi, _mm256_slli_epi16(h->hi, 4))};
    *hi = (q64){fifth_8(hi->lo, h->lo), fifth_8(hi->hi, h->hi)};
    *h = (q64){_mm256_srli_epi16(h->lo, 1), _mm256_srli_epi16(h->hi, 1)};
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
#if defined(__AVXVNNI__)
typedef q64 s64;
static inline s64 s_load(const uint8_t *p) {
    const q64 w = q_load(p);
    const __m256i flip = _mm256_set1_epi8(-128);
    return (s64){_mm256_xor_si256(w.lo, flip), _mm256_xor_si256(w.hi, flip)};
}
static inline i16 s_dot4(i16 acc, s64 w, const int8_t *x) { return i_dot4(acc, w, x); }
static inline i16 s_done(i16 acc, int32_t xsum) {
    const __m256i c = _mm256_set1_epi32(128 * xsum);
    return (i16){_mm256_sub_epi32(acc.lo, c), _mm256_sub_epi32(acc.hi, c)};
}
#else
typedef struct {
    __m256i abs_lo, abs_hi, lo, hi;
} s64;
static inline s64 s_load(const uint8_t *p) {
    const q64 w = q_load(p);
    return (s64){_mm256_abs_epi8(w.lo), _mm256_abs_epi8(w.hi), w.lo, w.hi};
}
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

#elif defined(V_NEON)
typedef struct {
    uint8x16_t q[4]; /* rows 4i..4i+3 */
} q64;
typedef struct {
    int32x4_t q[4];
} i16;
static inline q64 q_load(const uint8_t *p) {
    q64 b;
    for (int i = 0; i < 4; i++) b.q[i] = vld1q_u8(p + 16 * i);
    return b;
}
static inline void q_nibbles(q64 b, q64 *lo, q64 *hi) {
    for (int i = 0; i < 4; i++) lo->q[i] = vandq_u8(b.q[i], vdupq_n_u8(15)), hi->q[i] = vshrq_n_u8(b.q[i], 4);
}
static inline q64 q_high2(q64 *h) {
    q64 r;
    for (int i = 0; i < 4; i++) r.q[i] = vandq_u8(vshlq_n_u8(h->q[i], 4), vdupq_n_u8(0x30)), h->q[i] = vshrq_n_u8(h->q[i], 2);
    return r;
}
static inline q64 q_or(q64 a, q64 b) {
    for (int i = 0; i < 4; i++) a.q[i] = vorrq_u8(a.q[i], b.q[i]);
    return a;
}
static inline void q_fifth(q64 *h, q64 *lo, q64 *hi) {
    const uint8x16_t m = vdupq_n_u8(0x10);
    for (int i = 0; i < 4; i++) {
        lo->q[i] = vorrq_u8(lo->q[i], vandq_u8(vshlq_n_u8(h->q[i], 4), m));
        hi->q[i] = vorrq_u8(hi->q[i], vandq_u8(h->q[i], m));
        h->q[i] = vshrq_n_u8(h->q[i], 1);
    }
}
static inline i16 i_zero(void) {
    i16 a;
    for (int i = 0; i < 4; i++) a.q[i] = vdupq_n_s32(0);
    return a;
}
/* codes below 64 are the same bytes signed: s8 x s8 */
static inline int32x4_t dot4_4(int32x4_t acc, uint8x16_t w, int8x16_t x) {
#if defined(__ARM_FEATURE_DOTPROD)
    return vdotq_s32(acc, vreinterpretq_s8_u8(w), x);
#else
    const int8x16_t ws = vreinterpretq_s8_u8(w);
    const int32x4_t lo = vpaddlq_s16(vmull_s8(vget_low_s8(ws), vget_low_s8(x)));
    const int32x4_t hi = vpaddlq_s16(vmull_high_s8(ws, x));
    return vaddq_s32(acc, vpaddq_s32(lo, hi));
#endif
}
static inline i16 i_dot4(i16 acc, q64 w, const int8_t *x) {
    const int8x16_t xv = vreinterpretq_s8_s32(vdupq_n_s32(x4_bytes(x)));
    for (int i = 0; i < 4; i++) acc.q[i] = dot4_4(acc.q[i], w.q[i], xv);
    return acc;
}
static inline i16 i_dot4x2(i16 acc, q64 w0, const int8_t *x0, q64 w1, const int8_t *x1) {
    return i_dot4(i_dot4(acc, w0, x0), w1, x1);
}
typedef q64 s64; /* sdot and vmull_s8 take the bytes as signed */
static inline s64 s_load(const uint8_t *p) { return q_load(p); }
static inline i16 s_dot4(i16 acc, s64 w, const int8_t *x) { return i_dot4(acc, w, x); }
static inline i16 s_done(i16 acc, int32_t xsum) { return (void)xsum, acc; }
static inline v16 v_from_i(i16 a) {
    v16 v;
    for (int i = 0; i < 4; i++) v.q[i] = vcvtq_f32_s32(a.q[i]);
    return v;
}
static inline v16 v_round(v16 v) {
    for (int i = 0; i < 4; i++) v.q[i] = vrndnq_f32(v.q[i]);
    return v;
}
/* lanes holding whole numbers in -127..127 -> bytes (saturating, as AVX-512's) */
static inline void v_store_i8(int8_t *p, v16 v) {
    int16x8_t h[2];
    for (int i = 0; i < 2; i++)
        h[i] = vcombine_s16(vqmovn_s32(vcvtq_s32_f32(v.q[2 * i])), vqmovn_s32(vcvtq_s32_f32(v.q[2 * i + 1])));
    vst1q_s8(p, vcombine_s8(vqmovn_s16(h[0]), vqmovn_s16(h[1])));
}

#else
typedef struct {
    uint8_t b[64];
} q64;
typedef struct {
    int32_t i[16];
} i16;
static inline q64 q_load(const uint8_t *p) {
    q64 b;
    memcpy(b.b, p, 64);
    return b;
}
static inline void q_nibbles(q64 b, q64 *lo, q64 *hi) {
    for (int i = 0; i < 64; i++) lo->b[i] = b.b[i] & 15, hi->b[i] = b.b[i] >> 4;
}
static inline q64 q_high2(q64 *h) {
    q64 r;
    for (int i = 0; i < 64; i++) r.b[i] = (uint8_t)((h->b[i] & 3) << 4), h->b[i] >>= 2;
    return r;
}
static inline q64 q_or(q64 a, q64 b) {
    for (int i = 0; i < 64; i++) a.b[i] |= b.b[i];
    return a;
}
static inline void q_fifth(q64 *h, q64 *lo, q64 *hi) {
    for (int i = 0; i < 64; i++) lo->b[i] |= (uint8_t)((h->b[i] & 1) << 4), hi->b[i] |= h->b[i] & 0x10, h->b[i] >>= 1;
}
static inline i16 i_zero(void) { return (i16){{0}}; }
static inline i16 i_dot4(i16 acc, q64 w, const int8_t *x) {
    for (int r = 0; r < 16; r++)
        for (int j = 0; j < 4; j++) acc.i[r] += (int32_t)w.b[4 * r + j] * x[j];
    return acc;
}
static inline i16 i_dot4x2(i16 acc, q64 w0, const int8_t *x0, q64 w1, const int8_t *x1) {
    return i_dot4(i_dot4(acc, w0, x0), w1, x1);
}
typedef q64 s64;
static inline s64 s_load(const uint8_t *p) { return q_load(p); }
static inline i16 s_dot4(i16 acc, s64 w, const int8_t *x) {
    for (int r = 0; r < 16; r++)
        for (int j = 0; j < 4; j++) acc.i[r] += (int32_t)(int8_t)w.b[4 * r + j] * x[j];
    return acc;
}
static inline i16 s_done(i16 acc, int32_t xsum) { return (void)xsum, acc; }
static inline v16 v_from_i(i16 a) { return VG((float)a.i[_i]); }
static inline v16 v_round(v16 v) { return VG(nearbyintf(v.f[_i])); } /* to even, as the others */
/* lanes holding whole numbers in -127..127 -> bytes */
static inline void v_store_i8(int8_t *p, v16 v) {
    for (int i = 0; i < 16; i++) p[i] = (int8_t)(int32_t)fminf(fmaxf(v.f[i], -127.f), 127.f);
}
#endif

#endif
