/* NEON (sdot where present): simd_int8.h's integer dot products: simd.h's 16 float lanes (included by simd.h only, which chose this family; on arch/common.h). */
#ifndef FLOVER_ARCH_NEON_INT8_H
#define FLOVER_ARCH_NEON_INT8_H

#include "../common.h"

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
static inline q64 q_lut16(q64 b, const uint8_t *table) { /* each byte (below 16) -> table[byte] */
    const uint8x16_t t = vld1q_u8(table);
    for (int i = 0; i < 4; i++) b.q[i] = vqtbl1q_u8(t, b.q[i]);
    return b;
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
static inline q64 q_gather(const uint8_t *p, int64_t stride, int64_t n) { /* (rows n.. not read: zeros) */
    uint8_t b[64] = {0};
    for (int64_t r = 0; r < n && r < 16; r++) memcpy(b + 4 * r, p + r * stride, 4);
    return q_load(b);
}
static inline void q_fifth(q64 *h, q64 *lo, q64 *hi) {
    const uint8x16_t m = vdupq_n_u8(0x10);
    for (int i = 0; i < 4; i++) {
        lo->q[i] = vorrq_u8(lo->q[i], vandq_u8(vshlq_n_u8(h->q[i], 4), m));
        hi->q[i] = vorrq_u8(hi->q[i], vandq_u8(h->q[i], m));
        h->q[i] = vshrq_n_u8(h->q[i], 1);
    }
}
static inline q64 q_crumb(q64 *h) {
    q64 r;
    for (int i = 0; i < 4; i++) r.q[i] = vandq_u8(h->q[i], vdupq_n_u8(3)), h->q[i] = vshrq_n_u8(h->q[i], 2);
    return r;
}
static inline q64 q_bit2(q64 *h) {
    q64 r;
    for (int i = 0; i < 4; i++) r.q[i] = vandq_u8(vshlq_n_u8(h->q[i], 2), vdupq_n_u8(4)), h->q[i] = vshrq_n_u8(h->q[i], 1);
    return r;
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
/* A group's sums before its scale (the Q4_K super-block tiles, simd_int8.h): int32, scaled by a
 * multiply-accumulate */
#define G_INT32 1
typedef i16 g16;
static inline g16 g_zero(void) { return i_zero(); }
static inline g16 g_dot4x2(g16 g, q64 w0, const int8_t *x0, q64 w1, const int8_t *x1) { return i_dot4x2(g, w0, x0, w1, x1); }
static inline i16 g_scaled(i16 acc, g16 g, i16 sc) {
    for (int i = 0; i < 4; i++) acc.q[i] = vmlaq_s32(acc.q[i], g.q[i], sc.q[i]);
    return acc;
}
static inline i16 widen_s16(int16x8_t lo, int16x8_t hi) {
    return (i16){{vmovl_s16(vget_low_s16(lo)), vmovl_high_s16(lo), vmovl_s16(vget_low_s16(hi)), vmovl_high_s16(hi)}};
}
static inline i16 i_scales_u8(const uint8_t *s) {
    const uint8x16_t v = vld1q_u8(s);
    return widen_s16(vreinterpretq_s16_u16(vmovl_u8(vget_low_u8(v))), vreinterpretq_s16_u16(vmovl_high_u8(v)));
}
/* two groups' minimums per row (a, b: kept as two lanes' worth here), acc += a two[0] + b two[1] */
typedef struct {
    i16 a, b;
} i16x2;
static inline i16x2 i_pairs_u8(const uint8_t *a, const uint8_t *b) { return (i16x2){i_scales_u8(a), i_scales_u8(b)}; }
static inline i16 i_scales_i8(const int8_t *s) {
    const int8x16_t v = vld1q_s8(s);
    return widen_s16(vmovl_s8(vget_low_s8(v)), vmovl_high_s8(v));
}
static inline i16x2 i_pairs_i8(const int8_t *a, const int8_t *b) { return (i16x2){i_scales_i8(a), i_scales_i8(b)}; }
static inline i16 i_less32(i16 a, i16 b) {
    for (int i = 0; i < 4; i++) a.q[i] = vsubq_s32(a.q[i], vshlq_n_s32(b.q[i], 5));
    return a;
}
static inline i16 i_pairs_dot(i16 acc, i16x2 pairs, const int16_t *two) {
    for (int i = 0; i < 4; i++) acc.q[i] = vmlaq_n_s32(vmlaq_n_s32(acc.q[i], pairs.a.q[i], two[0]), pairs.b.q[i], two[1]);
    return acc;
}
typedef q64 s64; /* sdot and vmull_s8 take the bytes as signed */
static inline s64 s_from(q64 w) { return w; }
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

#endif
