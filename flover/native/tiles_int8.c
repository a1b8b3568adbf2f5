/* Tiles on int8 inputs: a GGUF file's codes of up to 6 bits (Q2_K / Q3_K / Q4_0 / Q4_1 / Q4_K /
 * Q5_* / Q6_K), Q8_0's signed bytes and the IQ4 types' table values times the rows quantized to
 * int8 per 32 inputs (as llama.cpp's Q8_0 rows), summed exactly in int32 by 4-byte dot products
 * (simd_int8.h), then scaled in float32 once per group.
 *
 * Inputs: each row's 32-input blocks x ~ d q, d = max|x| / 127, q = round-to-even(x / d) in
 * -127..127 (int8_rows; models/quant.py's int8_inputs is the same in PyTorch); 256-input blocks
 * for projections all in Q4_K, Q5_K and Q6_K (x8_block, the super-block tiles below). Weights: w =
 * scale (u - offset) + zero = scale u + low per group, u the stored unsigned code. So a group's
 * sum is (scale d) sum(u q) + low (d sum(q)), the integer sum exact, every float step per row in
 * the same order whatever the tile: fused rows give the bits they give alone.
 *
 * Layouts (flover/native/grids.py), per block of 16 output rows, 64 bytes = 16 lanes x 4 codes:
 *   4-bit: per group of 32 inputs 4 x 64 bytes; in the c-th, lane r's byte j holds input
 *          4c + j of row r in its low nibble and input 16 + 4c + j in its high one
 *   bytes: per 4 inputs 64 bytes, lane r's byte j input 4t + j (u = q + offset; Q8_0: q itself);
 *          their scales stored per group, or Q5_K's / Q6_K's super-blocks (native.h)
 *   6-bit: per group of 32 inputs the 4-bit layout of the low 4 bits (u = q + 32), then 2 x 64
 *          bytes of high bits: in the first, lane r's byte j holds those of input 4c + j at bits
 *          2c, 2c + 1 (c = 0..3); in the second, those of input 16 + 4c + j
 *   5-bit: per group of 32 inputs the 4-bit layout of the low 4 bits, then 64 bytes: lane r's
 *          byte j holds the fifth bit of input 4c + j at bit c and of 16 + 4c + j at bit 4 + c
 *   2-bit: per group of 32 inputs 2 x 64 bytes: in the h-th, lane r's byte j holds input
 *          16h + 4c + j at bits 2c, 2c + 1 (c = 0..3)
 *   3-bit: the 2-bit layout of the low 2 bits, then 64 bytes: lane r's byte j holds the third
 *          bit of input 16h + 4c + j at bit 4h + c
 */
#include <omp.h>

#include "native.h"
#include "simd_int8.h"

#define NO_UNROLL _Pragma("GCC unroll 1") /* (unrolled, the rows' partial sums spill: docs/journal.md (r)) */
/* a Q4_K group's 4 steps: unrolled where int32 sums and 32 registers hold 8 rows' sums without the
 * loop's copies of them (1.05x the tile on Zen 4); Q5_K's fifth bits, and maddubs families, spill
 * unrolled (0.98x, 0.78x: docs/journal.md (x)) */
#define PRAGMA(text) _Pragma(#text)
#if defined(V_AVX512) && defined(__AVX512VNNI__)
#define GROUP_STEPS(FIFTH) PRAGMA(GCC unroll (4 - 3 * (FIFTH)))
#else
#define GROUP_STEPS(FIFTH) NO_UNROLL
#endif

/* ---- inputs to int8 ---------------------------------------------------------------------------- */
/* one row's block of n inputs (32 or 256) from xb: codes, d and the codes' sums per 16 inputs */
static float int8_block(const float *xb, int64_t n, int8_t *q, float *sums16) {
    v16 most = v_zero();
    for (int64_t i = 0; i < n; i += 16) most = v_max(most, v_abs(v_load(xb + i)));
    const float d = v_reduce_max(most) / 127.f;
    const v16 inv = v_set1(d != 0.f ? 1.f / d : 0.f);
    for (int64_t i = 0; i < n; i += 16) {
        const v16 qv = v_round(v_mul(v_load(xb + i), inv));
        v_store_i8(q + i, qv);
        sums16[i / 16] = v_reduce_add(qv); /* whole numbers: exact */
    }
    return d;
}

void int8_rows(const float *x, const Int8Rows *out, int rows, int64_t k, int t, int T) {
    const int64_t n = out->block, blocks = k / n;
    for (int64_t m = (int64_t)rows * t / T; m < (int64_t)rows * (t + 1) / T; m++)
        for (int64_t b = 0; b < blocks; b++) {
            float sums[16];
            const float d = int8_block(x + m * k + b * n, n, (int8_t *)out->q + m * k + b * n, sums);
            ((float *)out->d)[m * blocks + b] = d;
            if (n == 256) {
                for (int i = 0; i < 16; i++) ((int16_t *)out->s16)[m * (k / 16) + b * 16 + i] = (int16_t)sums[i];
                for (int i = 0; i < 8; i++)
                    ((int16_t *)out->s32)[m * (k / 32) + b * 8 + i] = (int16_t)(sums[2 * i] + sums[2 * i + 1]);
                continue;
            }
            ((float *)out->ds16)[m * 2 * blocks + 2 * b] = d * sums[0], ((float *)out->ds16)[m * 2 * blocks + 2 * b + 1] = d * sums[1];
            ((float *)out->ds32)[m * blocks + b] = d * (sums[0] + sums[1]);
            ((int32_t *)out->qs32)[m * blocks + b] = (int32_t)(sums[0] + sums[1]);
        }
}

void copy_int8_row(const Int8Rows *from, int64_t r, const Int8Rows *to, int64_t i, int64_t k) {
    memcpy((int8_t *)to->q + i * k, from->q + r * k, k);
    memcpy((float *)to->d + i * (k / from->block), from->d + r * (k / from->block), k / from->block * sizeof(float));
    if (from->block == 256) {
        memcpy((int16_t *)to->s16 + i * (k / 16), from->s16 + r * (k / 16), k / 16 * sizeof(int16_t));
        memcpy((int16_t *)to->s32 + i * (k / 32), from->s32 + r * (k / 32), k / 32 * sizeof(int16_t));
        return;
    }
    memcpy((float *)to->ds16 + i * (k / 16), from->ds16 + r * (k / 16), k / 16 * sizeof(float));
    memcpy((float *)to->ds32 + i * (k / 32), from->ds32 + r * (k / 32), k / 32 * sizeof(float));
    memcpy((int32_t *)to->qs32 + i * (k / 32), from->qs32 + r * (k / 32), k / 32 * sizeof(int32_t));
}

/* A group's sums done: acc[i] += (scale d_i) dot_i + low (d sum)_i, where w = scale u + low (the
 * code's offset folded into low) */
static inline void add_group_x8(v16 *acc, const i16 *dot, int mt, v16 scale, v16 low, const float *d, const float *ds,
                                int64_t stride_d, int64_t stride_ds) {
    for (int i = 0; i < mt; i++)
        acc[i] = v_fmadd(v_mul(scale, v_set1(d[i * stride_d])), v_from_i(dot[i]),
                         v_fmadd(low, v_set1(ds[i * stride_ds]), acc[i]));
}

/* ---- 4-bit codes (offset 8), and Q5_K's 5-bit ones (offset 0: the 4-bit layout and a 64-byte
 * plane of fifth bits, FIFTH) ------------------------------------------------------------------- */
/* a group's scale and low (w = scale u + low): the 4-bit codes' zero form (the value at u = 8),
 * stored or from Q4_K's super-blocks; Q5_K's are k_group_scale_low (native.h) */
static inline void q4_scale_low(const void *scales, int64_t g, v16 *scale, v16 *low) {
    v16 zero;
    q4_group_scales(scales, g, scale, &zero);
    *low = v_fnmadd(v_set1(8.f), *scale, zero);
}
static inline void q4k_scale_low(const void *scales, int64_t g, v16 *scale, v16 *low) {
    v16 zero;
    q4k_group_scales(scales, g, scale, &zero);
    *low = v_fnmadd(v_set1(8.f), *scale, zero);
}
#define TILE_NIBBLES_X8(NAME, MT, FIFTH, LUT, GROUP_SCALE_LOW)                                             \
    static void NAME##_##MT(const uint8_t *codes, const void *scales, int64_t k, const Int8Rows *x, float *out) { \
        const int64_t groups = k / 32, group_bytes = 256 + 64 * (FIFTH);                                   \
        v16 acc[MT];                                                                                       \
        for (int i = 0; i < MT; i++) acc[i] = v_zero();                                                    \
        for (int64_t g = 0; g < groups; g++) {                                                             \
            const uint8_t *c = codes + g * group_bytes;                                                    \
            prefetch_ahead(c, (int)group_bytes);                                                           \
            q64 fifth;                                                                                     \
            if (FIFTH) fifth = q_load(c + 256);                                                            \
            i16 dot[MT];                                                                                   \
            for (int i = 0; i < MT; i++) dot[i] = i_zero();                                                \
            for (int q = 0; q < 4; q++) {                                                                  \
                q64 lo, hi;                                                                                \
                q_nibbles(q_load(c + q * 64), &lo, &hi);                                                   \
                if (FIFTH) q_fifth(&fifth, &lo, &hi);                                                      \
                if (LUT) lo = q_lut16(lo, MXFP4_U), hi = q_lut16(hi, MXFP4_U);                             \
                for (int i = 0; i < MT; i++) {                                                             \
                    const int8_t *xq = x->q + i * k + g * 32 + 4 * q;                                      \
                    dot[i] = i_dot4x2(dot[i], lo, xq, hi, xq + 16);                                       \
                }                                                                                          \
            }                                                                                              \
            v16 scale, low;                                                                                \
            GROUP_SCALE_LOW(scales, g, &scale, &low);                                                      \
            add_group_x8(acc, dot, MT, scale, low, x->d + g, x->ds32 + g, groups, groups);                 \
        }                                                                                                  \
        for (int i = 0; i < MT; i++) v_store(out + i * 16, acc[i]);                                        \
    }
#define NIBBLES_X8_TILES(NAME, FIFTH, LUT, GROUP_SCALE_LOW)                                                \
    TILE_NIBBLES_X8(NAME, 12, FIFTH, LUT, GROUP_SCALE_LOW) TILE_NIBBLES_X8(NAME, 8, FIFTH, LUT, GROUP_SCALE_LOW) \
    TILE_NIBBLES_X8(NAME, 4, FIFTH, LUT, GROUP_SCALE_LOW) TILE_NIBBLES_X8(NAME, 2, FIFTH, LUT, GROUP_SCALE_LOW) \
    TILE_NIBBLES_X8(NAME, 1, FIFTH, LUT, GROUP_SCALE_LOW)
NIBBLES_X8_TILES(q4_x8, 0, 0, q4_scale_low)
NIBBLES_X8_TILES(q4k_x8, 0, 0, q4k_scale_low)
NIBBLES_X8_TILES(q5k_x8, 1, 0, k_group_scale_low)
NIBBLES_X8_TILES(mxfp4_x8, 0, 1, q4_scale_low) /* (its codes' values + 12, the zero form's low: -12 scale) */

/* ---- byte codes below 64 (offset 0, 16 or 32), a scale (and a minimum: lows) per 16 or 32 inputs:
 * stored in float32, or from Q5_K's / Q6_K's super-blocks (w = scale u + low either way) */
static inline void stored_scales(const void *scales, int64_t g, int lows, int offset, v16 *scale, v16 *low) {
    const float *s = (const float *)scales + g * 16 * (1 + lows);
    *scale = v_load(s), *low = v_fnmadd(v_set1((float)offset), *scale, lows ? v_load(s + 16) : v_zero());
}
static inline void q5k_scales(const void *scales, int64_t g, int lows, int offset, v16 *scale, v16 *low) {
    (void)lows, (void)offset, k_group_scale_low(scales, g, scale, low);
}
static inline void q6k_scales(const void *scales, int64_t g, int lows, int offset, v16 *scale, v16 *low) {
    (void)lows, (void)offset, *scale = q6k_group_scale(scales, g), *low = v_mul(v_set1(-32.f), *scale);
}
#define TILE_BYTES_X8(NAME, MT, GROUP_SCALES)                                                              \
    static void NAME##_##MT(const uint8_t *codes, const void *scales, int64_t k, int group, int lows,      \
                            int offset, const Int8Rows *x, float *out) {                                   \
        const int64_t groups = k / group, blocks = k / 32;                                                 \
        const float *ds = group == 16 ? x->ds16 : x->ds32;                                                 \
        v16 acc[MT];                                                                                       \
        for (int i = 0; i < MT; i++) acc[i] = v_zero();                                                    \
        for (int64_t g = 0; g < groups; g++) {                                                             \
            i16 dot[MT];                                                                                   \
            for (int i = 0; i < MT; i++) dot[i] = i_zero();                                                \
            prefetch_ahead(codes + g * group * 16, group * 16);                                            \
            for (int t = 0; t < group / 4; t += 2) { /* group / 4: 4 or 8 */                               \
                const q64 w0 = q_load(codes + (g * group + 4 * t) * 16), w1 = q_load(codes + (g * group + 4 * t + 4) * 16); \
                for (int i = 0; i < MT; i++) {                                                             \
                    const int8_t *xq = x->q + i * k + g * group + 4 * t;                                   \
                    dot[i] = i_dot4x2(dot[i], w0, xq, w1, xq + 4);                                         \
                }                                                                                          \
            }                                                                                              \
            v16 scale, low;                                                                                \
            GROUP_SCALES(scales, g, lows, offset, &scale, &low);                                           \
            add_group_x8(acc, dot, MT, scale, low, x->d + g * group / 32, ds + g, blocks, groups);          \
        }                                                                                                  \
        for (int i = 0; i < MT; i++) v_store(out + i * 16, acc[i]);                                        \
    }
#define BYTES_X8_TILES(NAME, GROUP_SCALES)                                                                 \
    TILE_BYTES_X8(NAME, 12, GROUP_SCALES) TILE_BYTES_X8(NAME, 8, GROUP_SCALES)                             \
    TILE_BYTES_X8(NAME, 4, GROUP_SCALES) TILE_BYTES_X8(NAME, 2, GROUP_SCALES) TILE_BYTES_X8(NAME, 1, GROUP_SCALES)
BYTES_X8_TILES(bytes_x8, stored_scales)
BYTES_X8_TILES(bytes_q5k_x8, q5k_scales)
BYTES_X8_TILES(bytes_q6k_x8, q6k_scales)

/* ---- Q6_K's 6-bit codes (offset 32), a scale per 16 inputs from its super-blocks ------------------- */
/* the codes of inputs 4q..4q+7 of a group's half (0: inputs 0..15, the low nibbles; 1: 16..31),
 * high: the half's high bits, shifted on for the next call */
static inline void q6_codes(const uint8_t *group, int q, int half, q64 *high, q64 *w0, q64 *w1) {
    q64 unused;
    if (half) q_nibbles(q_load(group + q * 64), &unused, w0), q_nibbles(q_load(group + q * 64 + 64), &unused, w1);
    else q_nibbles(q_load(group + q * 64), w0, &unused), q_nibbles(q_load(group + q * 64 + 64), w1, &unused);
    *w0 = q_or(*w0, q_high2(high)), *w1 = q_or(*w1, q_high2(high));
}
#define TILE_Q6K_X8(MT)                                                                                    \
    static void q6k_x8_##MT(const uint8_t *codes, const void *scales, int64_t k, const Int8Rows *x, float *out) { \
        const int64_t groups = k / 32;                                                                     \
        v16 acc[MT];                                                                                       \
        for (int i = 0; i < MT; i++) acc[i] = v_zero();                                                    \
        for (int64_t g = 0; g < groups; g++) {                                                             \
            const uint8_t *c = codes + g * 384;                                                            \
            prefetch_ahead(c, 384);                                                                        \
            for (int half = 0; half < 2; half++) { /* inputs 0..15 (low nibbles), 16..31: a scale each */  \
                q64 high = q_load(c + 256 + 64 * half);                                                    \
                i16 dot[MT];                                                                               \
                for (int i = 0; i < MT; i++) dot[i] = i_zero();                                            \
                for (int q = 0; q < 4; q += 2) {                                                           \
                    q64 w0, w1;                                                                            \
                    q6_codes(c, q, half, &high, &w0, &w1);                                                 \
                    for (int i = 0; i < MT; i++) {                                                         \
                        const int8_t *xq = x->q + i * k + g * 32 + 16 * half + 4 * q;                      \
                        dot[i] = i_dot4x2(dot[i], w0, xq, w1, xq + 4);                                     \
                    }                                                                                      \
                }                                                                                          \
                const v16 scale = q6k_group_scale(scales, 2 * g + half);                                   \
                add_group_x8(acc, dot, MT, scale, v_mul(v_set1(-32.f), scale), x->d + g, x->ds16 + 2 * g + half, \
                             groups, 2 * groups);                                                          \
            }                                                                                              \
        }                                                                                                  \
        for (int i = 0; i < MT; i++) v_store(out + i * 16, acc[i]);                                        \
    }
TILE_Q6K_X8(12)
TILE_Q6K_X8(8)
TILE_Q6K_X8(4)
TILE_Q6K_X8(2)
TILE_Q6K_X8(1)

/* ---- Q2_K's 2-bit codes (offset 0, a scale and a minimum per 16 inputs) and Q3_K's 3-bit ones
 * (offset 4, a scale per 16: CRUMBS_HIGH), from their super-blocks -------------------------------- */
static inline void q3k_scale_low(const void *scales, int64_t g, v16 *scale, v16 *low) {
    *scale = q6k_group_scale(scales, g), *low = v_mul(v_set1(-4.f), *scale);
}
#define TILE_CRUMBS_X8(NAME, MT, HIGH, GROUP_SCALE_LOW)                                                    \
    static void NAME##_##MT(const uint8_t *codes, const void *scales, int64_t k, const Int8Rows *x, float *out) { \
        const int64_t groups = k / 32, group_bytes = 128 + 64 * (HIGH);                                    \
        v16 acc[MT];                                                                                       \
        for (int i = 0; i < MT; i++) acc[i] = v_zero();                                                    \
        for (int64_t g = 0; g < groups; g++) {                                                             \
            const uint8_t *c = codes + g * group_bytes;                                                    \
            prefetch_ahead(c, (int)group_bytes);                                                           \
            q64 high;                                                                                      \
            if (HIGH) high = q_load(c + 128);                                                              \
            for (int half = 0; half < 2; half++) { /* inputs 0..15, 16..31: a scale each */                \
                q64 crumbs = q_load(c + 64 * half);                                                        \
                i16 dot[MT];                                                                               \
                for (int i = 0; i < MT; i++) dot[i] = i_zero();                                            \
                for (int q = 0; q < 4; q += 2) {                                                           \
                    q64 w0 = q_crumb(&crumbs), w1 = q_crumb(&crumbs);                                      \
                    if (HIGH) w0 = q_or(w0, q_bit2(&high)), w1 = q_or(w1, q_bit2(&high));                  \
                    for (int i = 0; i < MT; i++) {                                                         \
                        const int8_t *xq = x->q + i * k + g * 32 + 16 * half + 4 * q;                      \
                        dot[i] = i_dot4x2(dot[i], w0, xq, w1, xq + 4);                                     \
                    }                                                                                      \
                }                                                                                          \
                v16 scale, low;                                                                            \
                GROUP_SCALE_LOW(scales, 2 * g + half, &scale, &low);                                       \
                add_group_x8(acc, dot, MT, scale, low, x->d + g, x->ds16 + 2 * g + half, groups, 2 * groups); \
            }                                                                                              \
        }                                                                                                  \
        for (int i = 0; i < MT; i++) v_store(out + i * 16, acc[i]);                                        \
    }
#define CRUMBS_X8_TILES(NAME, HIGH, GROUP_SCALE_LOW)                                                       \
    TILE_CRUMBS_X8(NAME, 12, HIGH, GROUP_SCALE_LOW) TILE_CRUMBS_X8(NAME, 8, HIGH, GROUP_SCALE_LOW)         \
    TILE_CRUMBS_X8(NAME, 4, HIGH, GROUP_SCALE_LOW) TILE_CRUMBS_X8(NAME, 2, HIGH, GROUP_SCALE_LOW)          \
    TILE_CRUMBS_X8(NAME, 1, HIGH, GROUP_SCALE_LOW)
CRUMBS_X8_TILES(q2k_x8, 0, q2k_group_scale_low)
CRUMBS_X8_TILES(q3k_x8, 1, q3k_scale_low)

/* ---- the IQ4 types: 4-bit indexes (the 4-bit layout) into IQ4_VALUES, signed bytes once looked
 * up; a scale per 32 inputs, stored (IQ4_NL) or from IQ4_XS's super-blocks ------------------------- */
static inline v16 stored_scale(const void *scales, int64_t g) { return v_load((const float *)scales + g * 16); }
#define TILE_IQ4_X8(NAME, MT, GROUP_SCALE)                                                                 \
    static void NAME##_##MT(const uint8_t *codes, const void *scales, int64_t k, const Int8Rows *x, float *out) { \
        const int64_t groups = k / 32;                                                                     \
        v16 acc[MT];                                                                                       \
        for (int i = 0; i < MT; i++) acc[i] = v_zero();                                                    \
        for (int64_t g = 0; g < groups; g++) {                                                             \
            const uint8_t *c = codes + g * 256;                                                            \
            prefetch_ahead(c, 256);                                                                        \
            i16 dot[MT];                                                                                   \
            for (int i = 0; i < MT; i++) dot[i] = i_zero();                                                \
            for (int q = 0; q < 4; q++) {                                                                  \
                q64 lo, hi;                                                                                \
                q_nibbles(q_load(c + q * 64), &lo, &hi);                                                   \
                const s64 w0 = s_from(q_lut16(lo, (const uint8_t *)IQ4_VALUES));                          \
                const s64 w1 = s_from(q_lut16(hi, (const uint8_t *)IQ4_VALUES));                          \
                for (int i = 0; i < MT; i++) {                                                             \
                    const int8_t *xq = x->q + i * k + g * 32 + 4 * q;                                      \
                    dot[i] = s_dot4(s_dot4(dot[i], w0, xq), w1, xq + 16);                                  \
                }                                                                                          \
            }                                                                                              \
            const v16 scale = GROUP_SCALE(scales, g);                                                      \
            for (int i = 0; i < MT; i++)                                                                   \
                acc[i] = v_fmadd(v_mul(scale, v_set1(x->d[i * groups + g])),                               \
                                 v_from_i(s_done(dot[i], x->qs32[i * groups + g])), acc[i]);               \
        }                                                                                                  \
        for (int i = 0; i < MT; i++) v_store(out + i * 16, acc[i]);                                        \
    }
#define IQ4_X8_TILES(NAME, GROUP_SCALE)                                                                    \
    TILE_IQ4_X8(NAME, 12, GROUP_SCALE) TILE_IQ4_X8(NAME, 8, GROUP_SCALE) TILE_IQ4_X8(NAME, 4, GROUP_SCALE) \
    TILE_IQ4_X8(NAME, 2, GROUP_SCALE) TILE_IQ4_X8(NAME, 1, GROUP_SCALE)
IQ4_X8_TILES(iq4nl_x8, stored_scale)
IQ4_X8_TILES(iq4xs_x8, iq4xs_group_scale)

/* ---- signed bytes (Q8_0: -128..127), a scale per 32 inputs --------------------------------------- */
#define TILE_SIGNED_X8(MT)                                                                                 \
    static void signed_x8_##MT(const uint8_t *codes, const float *scales, int64_t k, const Int8Rows *x, float *out) { \
        const int64_t groups = k / 32;                                                                     \
        v16 acc[MT];                                                                                       \
        for (int i = 0; i < MT; i++) acc[i] = v_zero();                                                    \
        for (int64_t g = 0; g < groups; g++) {                                                             \
            i16 dot[MT];                                                                                   \
            for (int i = 0; i < MT; i++) dot[i] = i_zero();                                                \
            prefetch_ahead(codes + g * 512, 512);                                                          \
            for (int t = 0; t < 8; t++) {                                                                  \
                const s64 w = s_load(codes + (g * 32 + 4 * t) * 16);                                       \
                for (int i = 0; i < MT; i++) dot[i] = s_dot4(dot[i], w, x->q + i * k + g * 32 + 4 * t);    \
            }                                                                                              \
            const v16 scale = v_load(scales + g * 16);                                                     \
            for (int i = 0; i < MT; i++)                                                                   \
                acc[i] = v_fmadd(v_mul(scale, v_set1(x->d[i * groups + g])),                               \
                                 v_from_i(s_done(dot[i], x->qs32[i * groups + g])), acc[i]);               \
        }                                                                                                  \
        for (int i = 0; i < MT; i++) v_store(out + i * 16, acc[i]);                                        \
    }
TILE_SIGNED_X8(12)
TILE_SIGNED_X8(8)
TILE_SIGNED_X8(4)
TILE_SIGNED_X8(2)
TILE_SIGNED_X8(1)

/* ---- Q4_K and Q5_K on inputs in blocks of 256 (x8_block: llama.cpp's Q8_K rows): a super-block's
 * sums weighted by each group's integer scale in int32 (g16 sums a group's 32 inputs before
 * g_scaled weighs them), its minimums' share from the inputs' sums per 32, then two float steps per
 * super-block and row where blocks of 32 take one per group. Exact integers, the same order for
 * every row. (Q2_K's and Q3_K's keep blocks of 32: their scales and minimums per 16 cost what the
 * float steps did, 0.95-1.06x on AVX2: docs/journal.md (r); Q5_K's and Q6_K's, 0.84-0.98x of the
 * per-32 iteration on AVX2 and AVX-512: (w).) */
/* a super-block done: acc[i] += d dx_i dot_i + low dx_i lows_i, where w = d sc u + low m per group */
static inline void add_super_x8(v16 *acc, const i16 *dot, const i16 *lows, int mt, v16 d, v16 low, const float *dx,
                                int64_t stride) {
    for (int i = 0; i < mt; i++) {
        const v16 x = v_set1(dx[i * stride]);
        acc[i] = v_fmadd(v_mul(d, x), v_from_i(dot[i]), v_fmadd(v_mul(low, x), v_from_i(lows[i]), acc[i]));
    }
}
/* lows[i] = sum over the super-block's 8 groups of m (pairs of groups' 16 rows, i_pairs_u8) times
 * the inputs' sum over the group (s32: a row's sums per 32, a row's stride apart) */
static inline void super_lows(i16 *lows, int mt, const i16x2 *pairs, const int16_t *s32, int64_t stride) {
    for (int i = 0; i < mt; i++) {
        lows[i] = i_zero();
        for (int j = 0; j < 4; j++) lows[i] = i_pairs_dot(lows[i], pairs[j], s32 + i * stride + 2 * j);
    }
}
/* the super-block's minimums' share and float steps (Q4_K's and Q5_K's super-blocks alike) */
static inline void add_super_k4(v16 *acc, const i16 *dot, int mt, const uint8_t *super, const Int8Rows *x, int64_t sb,
                                int64_t k) {
    i16x2 m[4];
    i16 lows[12];
    for (int j = 0; j < 4; j++) m[j] = i_pairs_u8(super + 256 + 32 * j, super + 272 + 32 * j);
    super_lows(lows, mt, m, x->s32 + sb * 8, k / 32);
    add_super_x8(acc, dot, lows, mt, v_load((const float *)super), v_load((const float *)super + 16), x->d + sb, k / 256);
}
/* int16 pairs hold 4 g_dot4x2 of 4-bit codes (4 x 4 x 15 x 127) or 2 of 5-bit ones: a group of 32
 * inputs is weighed once, or by halves (K5_HALVES: int16 families' Q5_K) */
#define K5_HALVES(FIFTH) (!G_INT32 && (FIFTH) ? 2 : 1)
/* A super-block tile NAME_MT: per row acc, per super-block dot, which GROUPS(MT, FIFTH) fills from
 * the super-block's codes (super: its scales), then ADD_SUPER takes it into acc */
#define K256_TILE(NAME, MT, SUPER_BYTES, GROUPS, FIFTH, ADD_SUPER)                                         \
    static void NAME##_##MT(const uint8_t *codes, const void *scales, int64_t k, const Int8Rows *x, float *out) { \
        v16 acc[MT];                                                                                       \
        for (int i = 0; i < MT; i++) acc[i] = v_zero();                                                    \
        for (int64_t sb = 0; sb < k / 256; sb++) {                                                         \
            const uint8_t *super = (const uint8_t *)scales + sb * SUPER_BYTES;                             \
            i16 dot[MT];                                                                                   \
            for (int i = 0; i < MT; i++) dot[i] = i_zero();                                                \
            GROUPS(MT, FIFTH)                                                                              \
            ADD_SUPER(acc, dot, MT, super, x, sb, k);                                                      \
        }                                                                                                  \
        for (int i = 0; i < MT; i++) v_store(out + i * 16, acc[i]);                                        \
    }
/* Q4_K's and Q5_K's 8 groups of 32 inputs in the 4-bit layout (FIFTH: and the plane of fifth bits) */
#define NIBBLES_K256_GROUPS(MT, FIFTH)                                                                     \
    for (int g = 0; g < 8; g++) {                                                                          \
        const int64_t group_bytes = 256 + 64 * (FIFTH);                                                    \
        const uint8_t *c = codes + (sb * 8 + g) * group_bytes;                                             \
        prefetch_ahead(c, (int)group_bytes);                                                               \
        q64 fifth;                                                                                         \
        if (FIFTH) fifth = q_load(c + 256);                                                                \
        for (int h = 0, calls = 4 / K5_HALVES(FIFTH); h < K5_HALVES(FIFTH); h++) {                        \
            g16 part[MT];                                                                                  \
            for (int i = 0; i < MT; i++) part[i] = g_zero();                                               \
            GROUP_STEPS(FIFTH) for (int q = h * calls; q < (h + 1) * calls; q++) {                         \
                q64 lo, hi;                                                                                \
                q_nibbles(q_load(c + q * 64), &lo, &hi);                                                   \
                if (FIFTH) q_fifth(&fifth, &lo, &hi);                                                      \
                for (int i = 0; i < MT; i++) {                                                             \
                    const int8_t *xq = x->q + i * k + sb * 256 + g * 32 + 4 * q;                           \
                    part[i] = g_dot4x2(part[i], lo, xq, hi, xq + 16);                                      \
                }                                                                                          \
            }                                                                                              \
            const i16 sc = i_scales_u8(super + 128 + g * 16); /* (after the loop: a register less) */      \
            for (int i = 0; i < MT; i++) dot[i] = g_scaled(dot[i], part[i], sc);                           \
        }                                                                                                  \
    }
/* Q5_K's codes as bytes (AVX2, NEON, generic): a group's 8 steps of 4 inputs */
#define BYTES_Q5K_GROUPS(MT, unused)                                                                       \
    for (int g = 0; g < 8; g++) {                                                                          \
        const uint8_t *c = codes + (sb * 256 + g * 32) * 16;                                               \
        prefetch_ahead(c, 512);                                                                            \
        for (int h = 0, steps = 8 / K5_HALVES(1); h < K5_HALVES(1); h++) {                                \
            g16 part[MT];                                                                                  \
            for (int i = 0; i < MT; i++) part[i] = g_zero();                                               \
            for (int t = h * steps; t < (h + 1) * steps; t += 2) {                                         \
                const q64 w0 = q_load(c + t * 64), w1 = q_load(c + t * 64 + 64);                           \
                for (int i = 0; i < MT; i++) {                                                             \
                    const int8_t *xq = x->q + i * k + sb * 256 + g * 32 + 4 * t;                           \
                    part[i] = g_dot4x2(part[i], w0, xq, w1, xq + 4);                                       \
                }                                                                                          \
            }                                                                                              \
            const i16 sc = i_scales_u8(super + 128 + g * 16);                                              \
            for (int i = 0; i < MT; i++) dot[i] = g_scaled(dot[i], part[i], sc);                           \
        }                                                                                                  \
    }

/* ---- Q6_K on inputs in blocks of 256: each 16 inputs' sum weighed by its int8 scale in int32
 * (g_scaled), the offset's share (32 sc times the inputs' sum per 16) taken back in integers, then
 * one float step per super-block and row where blocks of 32 take one per 16 inputs (1.2x the speed
 * on AVX-512 VNNI: docs/journal.md (w)). In the 6-bit layout (q6k_k256) or as bytes (bytes_q6k_k256). */
/* a 16-input group's 4 steps: int32 families sum the group in part, then weigh it once (k6_done);
 * int16 pairs hold one g_dot4x2 of 6-bit codes (2 x 2 x 63 x 127), weighed at once */
static inline void k6_step(g16 *part, i16 *dot, i16 sc, q64 w0, const int8_t *x0, q64 w1, const int8_t *x1) {
#if G_INT32
    (void)dot, (void)sc, *part = g_dot4x2(*part, w0, x0, w1, x1);
#else
    (void)part, *dot = g_scaled(*dot, g_dot4x2(g_zero(), w0, x0, w1, x1), sc);
#endif
}
static inline i16 k6_done(i16 dot, g16 part, i16 sc) {
#if G_INT32
    return g_scaled(dot, part, sc);
#else
    return (void)part, (void)sc, dot;
#endif
}
/* a super-block done: acc[i] += d dx_i (dot_i - 32 lows_i), lows_i = sum over its 16 groups of sc
 * times row i's inputs' sum (s16) */
static inline void add_super_k6(v16 *acc, const i16 *dot, int mt, const uint8_t *super, const Int8Rows *x, int64_t sb,
                                int64_t k) {
    const int8_t *sc = (const int8_t *)super + 64;
    i16 lows[12];
    for (int i = 0; i < mt; i++) lows[i] = i_zero();
    for (int j = 0; j < 8; j++) {
        const i16x2 pair = i_pairs_i8(sc + 32 * j, sc + 32 * j + 16);
        for (int i = 0; i < mt; i++) lows[i] = i_pairs_dot(lows[i], pair, x->s16 + i * (k / 16) + sb * 16 + 2 * j);
    }
    const v16 d = v_load((const float *)super);
    for (int i = 0; i < mt; i++)
        acc[i] = v_fmadd(v_mul(d, v_set1(x->d[i * (k / 256) + sb])), v_from_i(i_less32(dot[i], lows[i])), acc[i]);
}
/* Q6_K's 8 groups of 32 inputs in the 6-bit layout, two scales each */
#define Q6K_K256_GROUPS(MT, unused)                                                                        \
    for (int g = 0; g < 8; g++) {                                                                          \
        const uint8_t *c = codes + (sb * 8 + g) * 384;                                                     \
        prefetch_ahead(c, 384);                                                                            \
        NO_UNROLL for (int half = 0; half < 2; half++) { /* (as a loop: 1.05x, (x)) */                     \
            const i16 sc = i_scales_i8((const int8_t *)super + 64 + (2 * g + half) * 16);                  \
            q64 high = q_load(c + 256 + 64 * half);                                                        \
            g16 part[MT];                                                                                  \
            for (int i = 0; i < MT; i++) part[i] = g_zero();                                               \
            for (int q = 0; q < 4; q += 2) {                                                               \
                q64 w0, w1;                                                                                \
                q6_codes(c, q, half, &high, &w0, &w1);                                                     \
                for (int i = 0; i < MT; i++) {                                                             \
                    const int8_t *xq = x->q + i * k + sb * 256 + g * 32 + 16 * half + 4 * q;               \
                    k6_step(&part[i], &dot[i], sc, w0, xq, w1, xq + 4);                                    \
                }                                                                                          \
            }                                                                                              \
            for (int i = 0; i < MT; i++) dot[i] = k6_done(dot[i], part[i], sc);                            \
        }                                                                                                  \
    }
/* ... as bytes: 16 groups of 16 inputs */
#define BYTES_Q6K_GROUPS(MT, unused)                                                                       \
    for (int g = 0; g < 16; g++) {                                                                         \
        const uint8_t *c = codes + (sb * 256 + g * 16) * 16;                                               \
        const i16 sc = i_scales_i8((const int8_t *)super + 64 + g * 16);                                   \
        prefetch_ahead(c, 256);                                                                            \
        g16 part[MT];                                                                                      \
        for (int i = 0; i < MT; i++) part[i] = g_zero();                                                   \
        for (int t = 0; t < 4; t += 2) {                                                                   \
            const q64 w0 = q_load(c + t * 64), w1 = q_load(c + t * 64 + 64);                               \
            for (int i = 0; i < MT; i++) {                                                                 \
                const int8_t *xq = x->q + i * k + sb * 256 + g * 16 + 4 * t;                               \
                k6_step(&part[i], &dot[i], sc, w0, xq, w1, xq + 4);                                        \
            }                                                                                              \
        }                                                                                                  \
        for (int i = 0; i < MT; i++) dot[i] = k6_done(dot[i], part[i], sc);                                \
    }
#define K256_TILES(NAME, ...) \
    K256_TILE(NAME, 12, __VA_ARGS__) K256_TILE(NAME, 8, __VA_ARGS__) K256_TILE(NAME, 4, __VA_ARGS__) \
    K256_TILE(NAME, 2, __VA_ARGS__) K256_TILE(NAME, 1, __VA_ARGS__)
K256_TILES(q4k_k256, Q4K_SUPER_BYTES, NIBBLES_K256_GROUPS, 0, add_super_k4)
K256_TILES(q5k_k256, Q4K_SUPER_BYTES, NIBBLES_K256_GROUPS, 1, add_super_k4)
K256_TILES(bytes_q5k_k256, Q4K_SUPER_BYTES, BYTES_Q5K_GROUPS, 1, add_super_k4)
K256_TILES(q6k_k256, Q6K_SUPER_BYTES, Q6K_K256_GROUPS, 0, add_super_k6)
K256_TILES(bytes_q6k_k256, Q6K_SUPER_BYTES, BYTES_Q6K_GROUPS, 0, add_super_k6)

/* inputs in blocks of 256 where every run's codes have a super-block tile above (their K-quant
 * kinds), else 32; models/quant.py's int8_block decides the same */
int x8_block(const Grid *grid) {
    for (int64_t p = 0; p < grid->parts; p++) {
        const int kind = grid->part[p].kind;
        if (!grid->part[p].x8 || (kind != G_INT4_K && kind != G_INT5_K && kind != G_INT8_K5 && kind != G_INT6_K &&
                                  kind != G_INT8_K6))
            return 32;
    }
    return 256;
}

/* accumulators (v16) and dot sums (i16) of a tile's rows, beside the codes' registers (AVX2: 4
 * rows beat 2: docs/journal.md; NEON's 32 registers hold them too) */
#if defined(V_AVX512)
#define X8_ROWS 8
#else
#define X8_ROWS 4
#endif

int x8_tile_rows(int left) {
    const int n = left < X8_ROWS ? left : X8_ROWS;
    return n >= 12 ? 12 : n >= 8 ? 8 : n >= 4 ? 4 : n >= 2 ? 2 : 1;
}

void tile_x8(int mt, const GridPart *part, const uint8_t *codes, const void *scales, int64_t k, const Int8Rows *x,
             float *out) {
    if (x->block == 256 && part->kind == G_INT6_K) GROUP_TILE(q6k_k256, mt, codes, scales, k, x, out);
    else if (x->block == 256 && part->kind == G_INT8_K6) GROUP_TILE(bytes_q6k_k256, mt, codes, scales, k, x, out);
    else if (x->block == 256 && part->kind == G_INT5_K) GROUP_TILE(q5k_k256, mt, codes, scales, k, x, out);
    else if (x->block == 256 && part->kind == G_INT8_K5) GROUP_TILE(bytes_q5k_k256, mt, codes, scales, k, x, out);
    else if (x->block == 256) GROUP_TILE(q4k_k256, mt, codes, scales, k, x, out);
    else if (part->kind == G_INT4_K) GROUP_TILE(q4k_x8, mt, codes, scales, k, x, out);
    else if (part->kind == G_INT4) GROUP_TILE(q4_x8, mt, codes, scales, k, x, out);
    else if (part->kind == G_MXFP4) GROUP_TILE(mxfp4_x8, mt, codes, scales, k, x, out);
    else if (part->kind == G_INT6_K) GROUP_TILE(q6k_x8, mt, codes, scales, k, x, out);
    else if (part->kind == G_INT5_K) GROUP_TILE(q5k_x8, mt, codes, scales, k, x, out);
    else if (part->kind == G_Q2_K) GROUP_TILE(q2k_x8, mt, codes, scales, k, x, out);
    else if (part->kind == G_Q3_K) GROUP_TILE(q3k_x8, mt, codes, scales, k, x, out);
    else if (part->kind == G_IQ4_NL) GROUP_TILE(iq4nl_x8, mt, codes, scales, k, x, out);
    else if (part->kind == G_IQ4_XS) GROUP_TILE(iq4xs_x8, mt, codes, scales, k, x, out);
    else if (part->x8 == X8_SIGNED) GROUP_TILE(signed_x8, mt, codes, (const float *)scales, k, x, out);
    else if (part->kind == G_INT8_K5) GROUP_TILE(bytes_q5k_x8, mt, codes, scales, k, 32, 1, 0, x, out);
    else if (part->kind == G_INT8_K6) GROUP_TILE(bytes_q6k_x8, mt, codes, scales, k, 16, 0, 32, x, out);
    else GROUP_TILE(bytes_x8, mt, codes, scales, k, (int)part->group, (int)part->lows, (int)part->offset, x, out);
}

const char *int8_dot_name(void) { /* "" where int8 sums take multiply-and-add pairs (maddubs, widening) */
#if defined(__AVX512VNNI__)
    return "VNNI";
#elif defined(__AVXVNNI__)
    return "AVX-VNNI";
#elif defined(__ARM_FEATURE_DOTPROD)
    return "dotprod";
#else
    return "";
#endif
}

/* Q5_K's and Q6_K's codes packed in 5 and 6 bits (G_INT5_K, G_INT6_K) where unpacking them costs
 * less than the bytes it saves: on AVX-512; as bytes on AVX2 and NEON (docs/design_notes.md,
 * "measured choices") */
API int flover_packed_codes(void) {
#if defined(V_AVX512)
    return 1;
#else
    return 0;
#endif
}
