/* 16 float lanes, whatever the instruction set: the native step's kernels are written once
 * against this mapping (as ggml's simd-mappings.h), and each family implements it in its own header under arch/:
 *
 *   AVX-512F      one __m512                  (avx512bf16 and avx512 builds)
 *   AVX2 + FMA    two __m256
 *   NEON          four float32x4_t            (aarch64)
 *   generic       float[16] and plain loops   (the reference; also -DFLOVER_GENERIC anywhere)
 *
 * The layouts of the weights are the same for every family (16 output rows per block), so one
 * v16 is one block's outputs. Lane masks (m16) are bit masks, lane i in bit i. Partial loads and
 * stores (`n` lanes, n < 16) never touch memory past the n-th element. Every operation is
 * element-wise or reduces in a fixed order, so a row's numbers never depend on other rows.
 */
#ifndef FLOVER_SIMD_H
#define FLOVER_SIMD_H

#include "arch/common.h"

/* ---- the family's mapping ------------------------------------------------------------------- */
#if defined(V_AVX512)
#include "arch/x86/avx512.h"
#elif defined(V_AVX2)
#include "arch/x86/avx2.h"
#elif defined(V_NEON)
#include "arch/arm/neon.h"
#else
#include "arch/generic.h"
#endif
#if defined(V_AVX2) || defined(V_NEON)
#include "arch/buffered_tails.h"
#endif

/* ---- on every family ------------------------------------------------------------------------- */
/* `n` lanes from p + i, float32 or bfloat16 (bf), widened */
static inline v16 v_loadx(const void *p, int64_t i, int bf, int64_t n) {
    return bf ? v_load_bf16n((const uint16_t *)p + i, n) : v_loadn((const float *)p + i, n);
}
/* store lanes holding model-dtype values */
static inline void v_storex(void *p, int64_t i, v16 v, int bf, int64_t n) {
    if (bf) v_store_bf16n((uint16_t *)p + i, v, n);
    else v_storen((float *)p + i, v, n);
}
static inline v16 v_rnd(v16 v, int bf) { return bf ? v_round_bf16(v) : v; }

/* The value a PyTorch op of the model's dtype would store. */
static inline float rnd(float f, int bf) { return bf ? bf2f(f2bf(f)) : f; }
static inline float load(const void *p, int64_t i, int bf) {
    return bf ? bf2f(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

#endif
