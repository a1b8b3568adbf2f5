/* Generic C, the reference: float[16] and plain loops: simd.h's 16 float lanes (included by simd.h only, which chose this family; on arch/common.h). */
#ifndef FLOVER_ARCH_GENERIC_H
#define FLOVER_ARCH_GENERIC_H

#include "common.h"

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
static inline v16 v_min(v16 a, v16 b) { return VG(a.f[_i] < b.f[_i] ? a.f[_i] : b.f[_i]); }
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
static inline v16 v_load_nibbles(const uint8_t *p, int high) { return VG((float)(high ? p[_i] >> 4 : p[_i] & 15)); }
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
