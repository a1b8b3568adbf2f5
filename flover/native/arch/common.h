/* What every family's header under arch/ builds on (simd.h includes it first, then the one family's
 * header): which family this build is, lane masks, one value's bfloat16 <-> float, prefetch. */
#ifndef FLOVER_ARCH_COMMON_H
#define FLOVER_ARCH_COMMON_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if !defined(FLOVER_GENERIC) && defined(__AVX512F__)
#define V_AVX512 1
#elif !defined(FLOVER_GENERIC) && defined(__AVX2__) && defined(__FMA__)
#define V_AVX2 1
#elif !defined(FLOVER_GENERIC) && defined(__ARM_NEON) && defined(__aarch64__)
#define V_NEON 1
#else
#define V_GENERIC 1
#endif

typedef uint32_t m16;
#define M16_ALL 0xffffu

static inline m16 lanes(int64_t n) { return n >= 16 ? M16_ALL : n <= 0 ? 0 : (m16)((1u << n) - 1u); }

/* ---- bfloat16 <-> float, one value ------------------------------------------------------------ */
static inline float bf2f(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f2bf(float f) { /* round to nearest even, as PyTorch's conversion */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline void v_prefetch(const void *p) { __builtin_prefetch(p, 0, 3); }
static inline void v_prefetch_l2(const void *p) { __builtin_prefetch(p, 0, 2); }

/* AVX-512 BF16's dot-product instruction (tiles_bf16_dot.c): a compile-time fact of this build */
#if defined(__AVX512BF16__) && !defined(FLOVER_GENERIC)
#define has_bf16_dot() 1
#else
#define has_bf16_dot() 0
#endif

#endif
