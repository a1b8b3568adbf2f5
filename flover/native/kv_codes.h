/* --kv-dtype's rows (Model.k_type / v_type): llama.cpp's blocks of 32 values behind a float16
 * scale, ggml's block_q8_0 {d, int8 qs[32]} and block_q4_0 {d, qs[16]: value j in the low nibble
 * of byte j, 16 + j in the high one}, byte for byte; quantized as ggml-quants.c's reference rows
 * (roundf; q4_0 by the value of largest magnitude over -8), written by llama_forward.c, read by
 * attention.c: keys against queries quantized alike (kv_quantize_query), values as codes with
 * their block's scale in the weights (kv_codes16, kv_scale). flover/models/kv_codes.py is the
 * same in PyTorch. */
#ifndef FLOVER_KV_CODES_H
#define FLOVER_KV_CODES_H

#include <math.h>
#include <string.h>

#include "native.h"

static inline int kv_block_bytes(int type) { return type == KV_Q8_0 ? 34 : 18; }

#if defined(__F16C__)
#include <immintrin.h>
static inline float f16_to_f32(uint16_t h) { return _cvtsh_ss(h); } /* (exact, subnormals too) */
#else
static inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 31, m = h & 1023;
    if (e == 0) { /* zero, or subnormal: m 2^-24, exact */
        const float v = (float)m * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    const uint32_t x = sign | (e == 31 ? 0x7f800000 | (m << 13) : ((e + 112) << 23) | (m << 13));
    float f;
    memcpy(&f, &x, 4);
    return f;
}
#endif

/* float32 -> float16, rounded to nearest even (as torch's and numpy's casts) */
static inline uint16_t f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000, ax = x & 0x7fffffff;
    if (ax >= 0x7f800000) return (uint16_t)(sign | 0x7c00 | (ax > 0x7f800000 ? 0x200 : 0)); /* inf, NaN */
    if (ax >= 0x477ff000) return (uint16_t)(sign | 0x7c00);                              /* >= 65520: inf */
    if (ax < 0x38800000) { /* below 2^-14: a subnormal's m = |f| 2^24, rounded (exact scaling) */
        float a;
        memcpy(&a, &ax, 4);
        return (uint16_t)(sign | (uint32_t)rintf(a * 16777216.f));
    }
    return (uint16_t)(sign | ((ax - 0x38000000 + 0xfff + ((ax >> 13) & 1)) >> 13));
}

/* a product kept apart from the add after it (gcc contracts a * b + c into an FMA, which
 * rounds once where PyTorch rounds twice) */
static inline float kept(float v) {
    volatile float w = v;
    return w;
}

/* q8_0's rule for 32 values: codes roundf(x / scale), scale = max |x| / 127 (returned in float32;
 * a cache row keeps it as float16, a query as it is). (A plain compare for the maximum: GCC 12
 * on aarch64 fails to compile a fmaxf reduction here.) */
static inline float q8_codes(const float *x, int8_t *codes) {
    float most = 0.f;
    for (int j = 0; j < 32; j++)
        if (most < fabsf(x[j])) most = fabsf(x[j]);
    const float scale = most / 127.f, inverse = scale != 0.f ? 1.f / scale : 0.f;
    for (int j = 0; j < 32; j++) codes[j] = (int8_t)roundf(x[j] * inverse);
    return scale;
}

/* One head's row of d values (float32, of the model dtype's values) -> d / 32 blocks at dst */
static inline void kv_quantize_row(const float *x, uint8_t *dst, int64_t d, int type) {
    for (int64_t b = 0; b < d / 32; b++, x += 32, dst += kv_block_bytes(type)) {
        uint16_t h;
        if (type == KV_Q8_0) {
            h = f32_to_f16(q8_codes(x, (int8_t *)dst + 2));
        } else { /* the value of largest magnitude (the first of them) over -8 */
            float most = 0.f, largest = 0.f;
            for (int j = 0; j < 32; j++)
                if (most < fabsf(x[j])) most = fabsf(x[j]), largest = x[j];
            const float scale = largest / -8.f, inverse = scale != 0.f ? 1.f / scale : 0.f;
            h = f32_to_f16(scale);
            for (int j = 0; j < 16; j++) {
                const int lo = (int)(kept(x[j] * inverse) + 8.5f), hi = (int)(kept(x[16 + j] * inverse) + 8.5f);
                dst[2 + j] = (uint8_t)((lo < 15 ? lo : 15) | (hi < 15 ? hi : 15) << 4);
            }
        }
        memcpy(dst, &h, 2);
    }
}

/* The codes of values i..i+15 (i a multiple of 16) of a row of blocks, as floats (q4_0: code - 8),
 * and the scale of their block (the weighted sum of values takes it into each weight) */
static inline v16 kv_codes16(const uint8_t *row, int64_t i, int type) {
    const uint8_t *block = row + (i / 32) * kv_block_bytes(type);
    if (type == KV_Q8_0) return v_load_i8((const int8_t *)block + 2 + i % 32);
    return v_sub(v_load_nibbles(block + 2, i % 32 != 0), v_set1(8.f));
}
static inline float kv_scale(const uint8_t *row, int64_t i, int type) {
    uint16_t h;
    memcpy(&h, row + (i / 32) * kv_block_bytes(type), 2);
    return f16_to_f32(h);
}

/* A query head against keys of codes (attention.c's score_codes): its d values (rounded to the
 * model dtype) in int8 blocks of 32 as llama.cpp's q8_0 activations, codes roundf(q / scale)
 * with scale = max |q| / 127 (kept in float32), and each block's sum of codes (q4_0's - 8 and
 * VNNI's + 128 on q8_0 keys are taken back with it). models/kv_codes.py quantize_queries is the
 * same. */
typedef struct {
    int8_t codes[MAX_HEAD_DIM];
    float scale[MAX_HEAD_DIM / 32];
    int32_t sum[MAX_HEAD_DIM / 32];
} QueryCodes;

static inline void kv_quantize_query(const float *q, int64_t d, int bf, QueryCodes *out) {
    for (int64_t b = 0; b < d / 32; b++) {
        float x[32];
        for (int j = 0; j < 32; j++) x[j] = rnd(q[32 * b + j], bf);
        out->scale[b] = q8_codes(x, out->codes + 32 * b);
        int32_t sum = 0;
        for (int j = 0; j < 32; j++) sum += out->codes[32 * b + j];
        out->sum[b] = sum;
    }
}

/* n rows of blocks (a row every `pos` bytes) -> n x d floats of the model dtype's values, scale
 * times code: what a cache of codes holds (tests compare them with PyTorch's; attention reads the
 * codes themselves) */
static inline void kv_rows_to(const uint8_t *rows, int64_t pos, int64_t n, int64_t d, int type, int bf, float *out) {
    for (int64_t t = 0; t < n; t++)
        for (int64_t i = 0; i < d; i += 16) {
            const uint8_t *row = rows + t * pos;
            v_store(out + t * d + i, v_rnd(v_mul(v_set1(kv_scale(row, i, type)), kv_codes16(row, i, type)), bf));
        }
}

#endif
