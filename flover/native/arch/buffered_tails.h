/* AVX2 and NEON: partial loads and stores through a buffer of 16 (tails only), horizontal sums one vector at a time: simd.h's 16 float lanes (included by simd.h only, which chose this family; on arch/common.h). */
#ifndef FLOVER_ARCH_BUFFERED_TAILS_H
#define FLOVER_ARCH_BUFFERED_TAILS_H

#include "common.h"

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
