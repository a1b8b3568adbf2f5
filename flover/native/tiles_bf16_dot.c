/* Tiles through AVX-512 BF16's dot-product instruction (Zen 4+, Sapphire Rapids+): a pair of
 * bfloat16 inputs times a pair of weights per lane and instruction, twice float32's rate. The
 * layouts are tiles.c's; elsewhere these return 0 and tiles.c's widening tiles run. */
#include "native.h"

#if defined(__AVX512BF16__) && !defined(FLOVER_GENERIC)

#define PAIR(x, kp) ((__m512bh)_mm512_set1_epi32(((const int32_t *)(x))[kp]))
/* LOAD(w, kp): block w's 16 rows at input pair kp as bfloat16 pairs (bfloat16 weights: one
 * load; int8: widened and narrowed, exact for 8 bits) */
#define PAIRS_LOOP(LOAD, MT, NT, PREFETCH)                                                                 \
    for (int64_t kp = 0; kp < k / 2; kp++) {                                                               \
        PREFETCH;                                                                                          \
        __m512bh wv[NT];                                                                                   \
        for (int j = 0; j < NT; j++) wv[j] = LOAD(w + j * 16 * k, kp);                                     \
        for (int i = 0; i < MT; i++) {                                                                     \
            const __m512bh xv = PAIR(x + i * k, kp);                                                       \
            for (int j = 0; j < NT; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv[j], xv);               \
        }                                                                                                  \
    }
#define TILE_DOT(KIND, WTYPE, LOAD, MT, NT)                                                                \
    static void dot_##KIND##_##MT##_##NT(const WTYPE *w, int64_t k, const uint16_t *x, float *out,        \
                                         const char *pf) {                                                 \
        __m512 acc[MT][NT];                                                                                \
        for (int i = 0; i < MT; i++)                                                                       \
            for (int j = 0; j < NT; j++) acc[i][j] = _mm512_setzero_ps();                                  \
        if (pf) PAIRS_LOOP(LOAD, MT, NT, _mm_prefetch(pf + kp * 64, _MM_HINT_T0))                         \
        else PAIRS_LOOP(LOAD, MT, NT, (void)0)                                                             \
        for (int i = 0; i < MT; i++)                                                                       \
            for (int j = 0; j < NT; j++) _mm512_storeu_ps(out + (i * NT + j) * 16, acc[i][j]);            \
    }
static inline __m512bh q8_pairs(const int8_t *codes) {
    const __m256i c = _mm256_loadu_si256((const __m256i *)codes);
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(c)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(c, 1)));
    return _mm512_cvtne2ps_pbh(hi, lo);
}
#define LOAD_BF16(w, kp) ((__m512bh)_mm512_loadu_si512((w) + (kp) * 32))
#define LOAD_Q8(w, kp) q8_pairs((w) + (kp) * 32)
#define TILE_BF16(MT, NT) TILE_DOT(bf16, uint16_t, LOAD_BF16, MT, NT)
#define TILE_Q8(MT, NT) TILE_DOT(q8, int8_t, LOAD_Q8, MT, NT)
#define ROW_TILES(TILE, NT) TILE(6, NT) TILE(4, NT) TILE(2, NT) TILE(1, NT)
#define ALL_TILES(TILE) ROW_TILES(TILE, 4) ROW_TILES(TILE, 3) ROW_TILES(TILE, 2) ROW_TILES(TILE, 1)
ALL_TILES(TILE_BF16)
ALL_TILES(TILE_Q8)

int tile_bf16_dot(const void *w, int64_t k, const void *x, int mt, int nt_blocks, int kind, float *out,
                  const char *pf) {
#define CALL(KIND, TYPE, MT, NT)                                                                           \
    if (mt == MT && nt_blocks == NT) return dot_##KIND##_##MT##_##NT((const TYPE *)w, k, x, out, pf), 1;
#define CALLS(KIND, TYPE, NT) CALL(KIND, TYPE, 6, NT) CALL(KIND, TYPE, 4, NT) CALL(KIND, TYPE, 2, NT) CALL(KIND, TYPE, 1, NT)
#define KIND_CALLS(KIND, TYPE) CALLS(KIND, TYPE, 4) CALLS(KIND, TYPE, 3) CALLS(KIND, TYPE, 2) CALLS(KIND, TYPE, 1)
    if (kind == W_BF16) { KIND_CALLS(bf16, uint16_t) }
    if (kind == W_Q8) { KIND_CALLS(q8, int8_t) }
#undef KIND_CALLS
#undef CALLS
#undef CALL
    return 0;
}

/* 4-bit tiles (tiles.c's layout): a byte becomes a bfloat16 pair (q - 8 is exact) by one table
 * lookup; bfloat16 of q - 8 for q = 0..15, twice (the lookup takes 5-bit indices) */
static const uint16_t Q4_VALUES[32] = {0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80,
                                       0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
                                       0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80,
                                       0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0};
#define TILE_Q4(NAME, MT, GROUP_SCALES)                                                                    \
    static void NAME##_##MT(const uint8_t *codes, const void *scales, int64_t k, const uint16_t *x,       \
                            const float *xsum, float *out) {                                               \
        const int64_t groups = k / 32;                                                                     \
        const __m512i lut = _mm512_loadu_si512(Q4_VALUES);                                                 \
        __m512 acc[MT];                                                                                    \
        for (int i = 0; i < MT; i++) acc[i] = _mm512_setzero_ps();                                         \
        for (int64_t g = 0; g < groups; g++) {                                                             \
            __m512 part[MT];                                                                               \
            for (int i = 0; i < MT; i++) part[i] = _mm512_setzero_ps();                                    \
            const uint8_t *c = codes + g * 256;                                                            \
            prefetch_ahead(c, 256);                                                                        \
            for (int kp = 0; kp < 16; kp++) {                                                              \
                const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(c + kp * 16)));  \
                const __m512i pair = _mm512_or_si512(_mm512_and_si512(d, _mm512_set1_epi32(0x0f)),        \
                                     _mm512_and_si512(_mm512_slli_epi32(d, 12), _mm512_set1_epi32(0xf0000))); \
                const __m512bh w = (__m512bh)_mm512_permutexvar_epi16(pair, lut);                        \
                for (int i = 0; i < MT; i++) part[i] = _mm512_dpbf16_ps(part[i], w, PAIR(x + i * k, g * 16 + kp)); \
            }                                                                                              \
            v16 scale, zero;                                                                               \
            GROUP_SCALES(scales, g, &scale, &zero);                                                        \
            for (int i = 0; i < MT; i++)                                                                   \
                acc[i] = _mm512_fmadd_ps(scale, part[i],                                                  \
                                         _mm512_fmadd_ps(zero, _mm512_set1_ps(xsum[i * groups + g]), acc[i])); \
        }                                                                                                  \
        for (int i = 0; i < MT; i++) _mm512_storeu_ps(out + i * 16, acc[i]);                               \
    }
#define Q4_TILES(NAME, GROUP_SCALES)                                                                       \
    TILE_Q4(NAME, 12, GROUP_SCALES) TILE_Q4(NAME, 8, GROUP_SCALES) TILE_Q4(NAME, 4, GROUP_SCALES)          \
    TILE_Q4(NAME, 2, GROUP_SCALES) TILE_Q4(NAME, 1, GROUP_SCALES)
Q4_TILES(dot_q4, q4_group_scales)
Q4_TILES(dot_q4k, q4k_group_scales)

int tile_q4_bf16_dot(int mt, int kind, const uint8_t *codes, const void *scales, int64_t k, const uint16_t *x,
                     const float *xsum, float *out) {
    if (kind == G_INT4_K) GROUP_TILE(dot_q4k, mt, codes, scales, k, x, xsum, out);
    else GROUP_TILE(dot_q4, mt, codes, scales, k, x, xsum, out);
    return 1;
}

/* 8-bit grouped tiles (tiles.c's layout): a pair of codes becomes a bfloat16 pair (q8_pairs,
 * exact), one dot product per row and input pair; each group's sum scaled as in tiles.c */
#define TILE_Q8G(MT)                                                                                       \
    static void dot_q8g_##MT(const int8_t *codes, const float *scales, int64_t k, int group, int lows,    \
                             const uint16_t *x, const float *xsum, float *out) {                           \
        const int64_t groups = k / group;                                                                  \
        __m512 acc[MT];                                                                                    \
        for (int i = 0; i < MT; i++) acc[i] = _mm512_setzero_ps();                                         \
        for (int64_t g = 0; g < groups; g++) {                                                             \
            __m512 part[MT];                                                                               \
            for (int i = 0; i < MT; i++) part[i] = _mm512_setzero_ps();                                    \
            const int8_t *c = codes + g * group * 16;                                                      \
            prefetch_ahead(c, group * 16);                                                                 \
            for (int kp = 0; kp < group / 2; kp++) {                                                       \
                const __m512bh w = q8_pairs(c + kp * 32);                                                  \
                for (int i = 0; i < MT; i++) part[i] = _mm512_dpbf16_ps(part[i], w, PAIR(x + i * k, g * group / 2 + kp)); \
            }                                                                                              \
            add_group(acc, part, MT, scales, g, lows, xsum, groups);                                       \
        }                                                                                                  \
        for (int i = 0; i < MT; i++) _mm512_storeu_ps(out + i * 16, acc[i]);                               \
    }
TILE_Q8G(12)
TILE_Q8G(8)
TILE_Q8G(4)
TILE_Q8G(2)
TILE_Q8G(1)

int tile_q8g_bf16_dot(int mt, const int8_t *codes, const float *scales, int64_t k, int group, int lows,
                      const uint16_t *x, const float *xsum, float *out) {
    GROUP_TILE(dot_q8g, mt, codes, scales, k, group, lows, x, xsum, out);
    return 1;
}

/* Attention scores: keys [t0, t0 + keys) of one query head, bfloat16 keys against the query's
 * bfloat16 copy qb, two dimensions per step; acc[j]: key j's 16 partial sums (attention.c) */
int keys_bf16_dot(const uint16_t *qb, const uint16_t *k_base, int64_t pos, int64_t d, int64_t t0, int64_t keys,
                  v16 acc[16]) {
    for (int64_t j = 0; j < 16; j++) {
        acc[j] = _mm512_setzero_ps();
        if (j >= keys) continue;
        const uint16_t *k = k_base + (t0 + j) * pos;
        for (int64_t i = 0; i < d; i += 32) {
            const __mmask16 m = (__mmask16)lanes((d - i) / 2);
            acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)_mm512_maskz_loadu_epi32(m, qb + i),
                                      (__m512bh)_mm512_maskz_loadu_epi32(m, k + i));
        }
    }
    return 1;
}

#else

int tile_bf16_dot(const void *w, int64_t k, const void *x, int mt, int nt_blocks, int kind, float *out,
                  const char *pf) {
    (void)w, (void)k, (void)x, (void)mt, (void)nt_blocks, (void)kind, (void)out, (void)pf;
    return 0;
}
int tile_q4_bf16_dot(int mt, int kind, const uint8_t *codes, const void *scales, int64_t k, const uint16_t *x,
                     const float *xsum, float *out) {
    (void)mt, (void)kind, (void)codes, (void)scales, (void)k, (void)x, (void)xsum, (void)out;
    return 0;
}

int tile_q8g_bf16_dot(int mt, const int8_t *codes, const float *scales, int64_t k, int group, int lows,
                      const uint16_t *x, const float *xsum, float *out) {
    (void)mt, (void)codes, (void)scales, (void)k, (void)group, (void)lows, (void)x, (void)xsum, (void)out;
    return 0;
}

int keys_bf16_dot(const uint16_t *qb, const uint16_t *k_base, int64_t pos, int64_t d, int64_t t0, int64_t keys,
                  v16 acc[16]) {
    (void)qb, (void)k_base, (void)pos, (void)d, (void)t0, (void)keys, (void)acc;
    return 0;
}

#endif
