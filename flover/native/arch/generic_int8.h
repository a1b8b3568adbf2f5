/* Generic C: simd_int8.h's integer dot products: simd.h's 16 float lanes (included by simd.h only, which chose this family; on arch/common.h). */
#ifndef FLOVER_ARCH_GENERIC_INT8_H
#define FLOVER_ARCH_GENERIC_INT8_H

#include "common.h"

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
static inline q64 q_lut16(q64 b, const uint8_t *table) { /* each byte (below 16) -> table[byte] */
    for (int i = 0; i < 64; i++) b.b[i] = table[b.b[i]];
    return b;
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
static inline q64 q_gather(const uint8_t *p, int64_t stride, int64_t n) { /* (rows n.. not read: zeros) */
    uint8_t b[64] = {0};
    for (int64_t r = 0; r < n && r < 16; r++) memcpy(b + 4 * r, p + r * stride, 4);
    return q_load(b);
}
static inline void q_fifth(q64 *h, q64 *lo, q64 *hi) {
    for (int i = 0; i < 64; i++) lo->b[i] |= (uint8_t)((h->b[i] & 1) << 4), hi->b[i] |= h->b[i] & 0x10, h->b[i] >>= 1;
}
static inline q64 q_crumb(q64 *h) {
    q64 r;
    for (int i = 0; i < 64; i++) r.b[i] = h->b[i] & 3, h->b[i] >>= 2;
    return r;
}
static inline q64 q_bit2(q64 *h) {
    q64 r;
    for (int i = 0; i < 64; i++) r.b[i] = (uint8_t)((h->b[i] & 1) << 2), h->b[i] >>= 1;
    return r;
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
/* A group's sums before its scale (the Q4_K super-block tiles, simd_int8.h): int32 */
#define G_INT32 1
typedef i16 g16;
static inline g16 g_zero(void) { return i_zero(); }
static inline g16 g_dot4x2(g16 g, q64 w0, const int8_t *x0, q64 w1, const int8_t *x1) { return i_dot4x2(g, w0, x0, w1, x1); }
static inline i16 g_scaled(i16 acc, g16 g, i16 sc) {
    for (int r = 0; r < 16; r++) acc.i[r] += g.i[r] * sc.i[r];
    return acc;
}
static inline i16 i_scales_u8(const uint8_t *s) {
    i16 v;
    for (int r = 0; r < 16; r++) v.i[r] = s[r];
    return v;
}
typedef struct { /* two groups' minimums per row */
    i16 a, b;
} i16x2;
static inline i16x2 i_pairs_u8(const uint8_t *a, const uint8_t *b) { return (i16x2){i_scales_u8(a), i_scales_u8(b)}; }
static inline i16 i_scales_i8(const int8_t *s) {
    i16 v;
    for (int r = 0; r < 16; r++) v.i[r] = s[r];
    return v;
}
static inline i16x2 i_pairs_i8(const int8_t *a, const int8_t *b) { return (i16x2){i_scales_i8(a), i_scales_i8(b)}; }
static inline i16 i_less32(i16 a, i16 b) {
    for (int r = 0; r < 16; r++) a.i[r] -= 32 * b.i[r];
    return a;
}
static inline i16 i_pairs_dot(i16 acc, i16x2 pairs, const int16_t *two) {
    for (int r = 0; r < 16; r++) acc.i[r] += pairs.a.i[r] * two[0] + pairs.b.i[r] * two[1];
    return acc;
}
typedef q64 s64;
static inline s64 s_from(q64 w) { return w; }
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
