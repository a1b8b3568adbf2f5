/* NEON (aarch64): four float32x4_t: simd.h's 16 float lanes (included by simd.h only, which chose this family; on arch/common.h). */
#ifndef FLOVER_ARCH_NEON_H
#define FLOVER_ARCH_NEON_H

#include "../common.h"

#include <arm_neon.h>

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
static inline v16 v_min(v16 a, v16 b) { /* likewise */
    const v16 m = V4(vbslq_f32(vcltq_f32(a.q[_i], b.q[_i]), a.q[_i], b.q[_i]));
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
static inline v16 v_load_nibbles(const uint8_t *p, int high) { /* 16 bytes' low (or high) nibbles */
    const uint8x16_t b = vld1q_u8(p);
    uint8_t n[16];
    vst1q_u8(n, high ? vshrq_n_u8(b, 4) : vandq_u8(b, vdupq_n_u8(15)));
    return v_load_u8(n);
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

#endif
