/* Projection tiles: y[m, n] = W[n, :] . x[m, :] for a few rows and blocks, written once on the
 * 16-lane mapping (simd.h).
 *
 * Weights come blocked by flover/native/forward.py (`block_weight`): 16 output rows at a time,
 * interleaved so that one load holds all 16 rows' weights for the next input step. float32:
 * [n / 16][k][16]; bfloat16: [n / 16][k / 2][16][2] (pairs of inputs: the operand of AVX-512
 * BF16's dot-product instruction; other families widen a pair into the even and the odd
 * input's 16 values); int8: bfloat16's pairs, a byte each. n is padded with zero rows. A tile
 * multiplies MT input rows by NT blocks with MT x NT accumulators of 16 outputs each, so each
 * weight load serves MT rows and no horizontal sums are needed; the family sets how many
 * accumulators its registers hold (simd.h: V_TILE_*).
 *
 * Every output is summed in the same order (input by input, one accumulator) whatever the tile:
 * a row's result does not depend on which other rows share its iteration, so fusing requests
 * changes no bit of any of them.
 */
#include <stdio.h>

#include "native.h"

#define ROW_TILES(TILE, NT) TILE(6, NT) TILE(4, NT) TILE(2, NT) TILE(1, NT)
#define ALL_TILES(TILE) ROW_TILES(TILE, 4) ROW_TILES(TILE, 3) ROW_TILES(TILE, 2) ROW_TILES(TILE, 1)

#define TILE_F32(MT, NT)                                                                                   \
    static void tile_f32_##MT##_##NT(const float *w, int64_t k, const float *x, float *out, const char *pf) { \
        v16 acc[MT][NT];                                                                                   \
        for (int i = 0; i < MT; i++)                                                                       \
            for (int j = 0; j < NT; j++) acc[i][j] = v_zero();                                             \
        for (int64_t kk = 0; kk < k; kk++) {                                                               \
            if (pf) v_prefetch(pf + kk * 64);                                                              \
            v16 wv[NT];                                                                                    \
            for (int j = 0; j < NT; j++) wv[j] = v_load(w + j * 16 * k + kk * 16);                         \
            for (int i = 0; i < MT; i++) {                                                                 \
                const v16 xv = v_set1(x[i * k + kk]);                                                      \
                for (int j = 0; j < NT; j++) acc[i][j] = v_fmadd(wv[j], xv, acc[i][j]);                    \
            }                                                                                              \
        }                                                                                                  \
        for (int i = 0; i < MT; i++)                                                                       \
            for (int j = 0; j < NT; j++) v_store(out + (i * NT + j) * 16, acc[i][j]);                      \
    }

/* Weights in input pairs (WIDEN: a block's 16 rows at one pair -> the even and odd inputs'
 * values); x: float rows, each input added in turn. */
#define TILE_PAIRS(KIND, WTYPE, WIDEN, MT, NT)                                                             \
    static void tile_##KIND##_##MT##_##NT(const WTYPE *w, int64_t k, const float *x, float *out,          \
                                          const char *pf) {                                                \
        v16 acc[MT][NT];                                                                                   \
        for (int i = 0; i < MT; i++)                                                                       \
            for (int j = 0; j < NT; j++) acc[i][j] = v_zero();                                             \
        for (int64_t kp = 0; kp < k / 2; kp++) {                                                           \
            if (pf) v_prefetch(pf + kp * 64);                                                              \
            v16 even[NT], odd[NT];                                                                         \
            for (int j = 0; j < NT; j++) WIDEN(w + j * 16 * k + kp * 32, &even[j], &odd[j]);              \
            for (int i = 0; i < MT; i++) {                                                                 \
                const v16 xe = v_set1(x[i * k + 2 * kp]), xo = v_set1(x[i * k + 2 * kp + 1]);              \
                for (int j = 0; j < NT; j++) acc[i][j] = v_fmadd(odd[j], xo, v_fmadd(even[j], xe, acc[i][j])); \
            }                                                                                              \
        }                                                                                                  \
        for (int i = 0; i < MT; i++)                                                                       \
            for (int j = 0; j < NT; j++) v_store(out + (i * NT + j) * 16, acc[i][j]);                      \
    }
#define TILE_BF16(MT, NT) TILE_PAIRS(bf16, uint16_t, v_widen_bf16_pairs, MT, NT)
#define TILE_Q8(MT, NT) TILE_PAIRS(q8, int8_t, v_widen_q8_pairs, MT, NT)

ALL_TILES(TILE_F32)
ALL_TILES(TILE_BF16)
ALL_TILES(TILE_Q8)

/* Tile shapes: as many accumulators as the family's registers hold (simd.h: V_TILE_*). Blocks
 * first: all 4 for a row or two (independent sums to hide the FMA latency), fewer as rows share
 * them (each weight load then serves more rows). */
static int budget(int kind) { return kind == W_F32 ? V_TILE_F32 : has_bf16_dot() ? 24 : V_TILE_PAIRS; }

int tile_blocks(int kind, int rows) {
    const int most = budget(kind) / (rows < 6 ? rows : 6);
    return most >= 4 ? 4 : most >= 1 ? most : 1;
}

int tile_rows(int kind, int left, int nt_blocks) {
    const int most = budget(kind) / nt_blocks, n = left < most ? left : most;
    return n >= 6 ? 6 : n >= 4 ? 4 : n >= 2 ? 2 : 1;
}

/* mt: 6, 4, 2 or 1; nt_blocks 1 to 4 (every shape exists; the budget picks those that fit) */
void tile(const void *w, int64_t nb, int64_t k, const void *x, int64_t m0, int mt, int nt_blocks, int kind,
          float *out, const char *pf) {
    const int64_t es = weight_bytes(kind), xs = operand_is_bf16(kind) ? 2 : 4;
    const char *wb = (const char *)w + nb * 16 * k * es, *xr = (const char *)x + m0 * k * xs;
    if (operand_is_bf16(kind) && tile_bf16_dot(wb, k, xr, mt, nt_blocks, kind, out, pf)) return;
#define CALL(KIND, TYPE, XTYPE, MT, NT)                                                                    \
    if (mt == MT && nt_blocks == NT) return tile_##KIND##_##MT##_##NT((const TYPE *)wb, k, (const XTYPE *)xr, out, pf);
#define CALLS(KIND, TYPE, XTYPE, NT)                                                                      \
    CALL(KIND, TYPE, XTYPE, 6, NT) CALL(KIND, TYPE, XTYPE, 4, NT) CALL(KIND, TYPE, XTYPE, 2, NT) CALL(KIND, TYPE, XTYPE, 1, NT)
#define KIND_CALLS(KIND, TYPE, XTYPE)                                                                     \
    CALLS(KIND, TYPE, XTYPE, 4) CALLS(KIND, TYPE, XTYPE, 3) CALLS(KIND, TYPE, XTYPE, 2) CALLS(KIND, TYPE, XTYPE, 1)
    if (kind == W_F32) { KIND_CALLS(f32, float, float) }
    if (kind == W_BF16) { KIND_CALLS(bf16, uint16_t, float) }
    if (kind == W_Q8) { KIND_CALLS(q8, int8_t, float) }
#undef KIND_CALLS
#undef CALLS
#undef CALL
}

/* ---- 4-bit tiles (--quantization int4, GGUF's Q4_0 / Q4_1 / Q4_K) ----------------------------------
 * Weights on the grid w = scale * (q - 8) + zero, q in 0..15, per group of 32 inputs. Blocked by
 * flover/native/grids.py: per block of 16 output rows and group, 16 input pairs x 16 rows bytes
 * (low nibble: the even input, high: the odd one); the groups' scales and zeros either stored
 * (native.h: Q4_SCALES, float32) or from Q4_K's super-blocks (Q4_K_SCALES: per 256 inputs the
 * rows' d and -dmin in float32, and per group their 6-bit sc and m as bytes: scale = d sc,
 * zero = 8 scale - dmin m, the float32 values the stored form holds, a quarter of its bytes).
 * The group's sum is scale * sum((q - 8) x) + zero * sum(x), xsum holding each row's sum(x). */
#define TILE_Q4(NAME, MT, GROUP_SCALES)                                                                    \
    static void NAME##_##MT(const uint8_t *codes, const void *scales, int64_t k, const float *x,          \
                            const float *xsum, float *out) {                                               \
        const int64_t groups = k / 32;                                                                     \
        v16 acc[MT];                                                                                       \
        for (int i = 0; i < MT; i++) acc[i] = v_zero();                                                    \
        for (int64_t g = 0; g < groups; g++) {                                                             \
            v16 part[MT];                                                                                  \
            for (int i = 0; i < MT; i++) part[i] = v_zero();                                               \
            const uint8_t *c = codes + g * 256;                                                            \
            prefetch_ahead(c, 256);                                                                        \
            for (int kp = 0; kp < 16; kp++) {                                                              \
                v16 even, odd;                                                                             \
                v_widen_q4_pairs(c + kp * 16, &even, &odd);                                                \
                for (int i = 0; i < MT; i++) {                                                             \
                    const float *xp = x + i * k + g * 32 + 2 * kp;                                         \
                    part[i] = v_fmadd(odd, v_set1(xp[1]), v_fmadd(even, v_set1(xp[0]), part[i]));          \
                }                                                                                          \
            }                                                                                              \
            v16 scale, zero;                                                                               \
            GROUP_SCALES(scales, g, &scale, &zero);                                                        \
            for (int i = 0; i < MT; i++)                                                                   \
                acc[i] = v_fmadd(scale, part[i], v_fmadd(zero, v_set1(xsum[i * groups + g]), acc[i]));     \
        }                                                                                                  \
        for (int i = 0; i < MT; i++) v_store(out + i * 16, acc[i]);                                        \
    }
#define Q4_TILES(NAME, GROUP_SCALES)                                                                       \
    TILE_Q4(NAME, 12, GROUP_SCALES) TILE_Q4(NAME, 8, GROUP_SCALES) TILE_Q4(NAME, 4, GROUP_SCALES)          \
    TILE_Q4(NAME, 2, GROUP_SCALES) TILE_Q4(NAME, 1, GROUP_SCALES)
Q4_TILES(tile_q4, q4_group_scales)
Q4_TILES(tile_q4k, q4k_group_scales)

int group_tile_rows(int left) {
    const int most = has_bf16_dot() ? 12 : V_Q4_ROWS, n = left < most ? left : most;
    return n >= 12 ? 12 : n >= 8 ? 8 : n >= 4 ? 4 : n >= 2 ? 2 : 1;
}

void tile_q4(int mt, int kind, const uint8_t *codes, const void *scales, int64_t k, const void *operand,
             const float *xsum, float *out) {
    if (operand_is_bf16(W_Q8) && tile_q4_bf16_dot(mt, kind, codes, scales, k, operand, xsum, out)) return;
    const float *x = operand;
    if (kind == G_INT4_K) GROUP_TILE(tile_q4k, mt, codes, scales, k, x, xsum, out);
    else GROUP_TILE(tile_q4, mt, codes, scales, k, x, xsum, out);
}

/* ---- 8-bit grouped tiles (GGUF's Q8_0, Q5_0, Q5_1, Q5_K, Q6_K, read as they are) -----------------
 * Weights on the grid w = scale * q (+ low) per group of `group` inputs (16 or 32), q a signed
 * byte. Blocked by flover/native/forward.py: codes as int8's pairs ([n / 16][k / 2][16][2]),
 * then per block of 16 output rows and group the 16 scales (and, with lows, the 16 minimums) in
 * float32. The group's sum is scale * sum(q x) (+ low * sum(x), xsum holding each row's sum(x)
 * per group). */
#define TILE_Q8G(MT)                                                                                       \
    static void tile_q8g_##MT(const int8_t *codes, const float *scales, int64_t k, int group, int lows,   \
                              const float *x, const float *xsum, float *out) {                             \
        const int64_t groups = k / group;                                                                  \
        v16 acc[MT];                                                                                       \
        for (int i = 0; i < MT; i++) acc[i] = v_zero();                                                    \
        for (int64_t g = 0; g < groups; g++) {                                                             \
            v16 part[MT];                                                                                  \
            for (int i = 0; i < MT; i++) part[i] = v_zero();                                               \
            const int8_t *c = codes + g * group * 16;                                                      \
            prefetch_ahead(c, group * 16);                                                                 \
            for (int kp = 0; kp < group / 2; kp++) {                                                       \
                v16 even, odd;                                                                             \
                v_widen_q8_pairs(c + kp * 32, &even, &odd);                                                \
                for (int i = 0; i < MT; i++) {                                                             \
                    const float *xp = x + i * k + g * group + 2 * kp;                                      \
                    part[i] = v_fmadd(odd, v_set1(xp[1]), v_fmadd(even, v_set1(xp[0]), part[i]));          \
                }                                                                                          \
            }                                                                                              \
            add_group(acc, part, MT, scales, g, lows, xsum, groups);                                       \
        }                                                                                                  \
        for (int i = 0; i < MT; i++) v_store(out + i * 16, acc[i]);                                        \
    }
TILE_Q8G(12)
TILE_Q8G(8)
TILE_Q8G(4)
TILE_Q8G(2)
TILE_Q8G(1)

void tile_q8g(int mt, const int8_t *codes, const float *scales, int64_t k, int group, int lows, const void *operand,
              const float *xsum, float *out) {
    if (operand_is_bf16(W_Q8) && tile_q8g_bf16_dot(mt, codes, scales, k, group, lows, operand, xsum, out)) return;
    const float *x = operand;
    GROUP_TILE(tile_q8g, mt, codes, scales, k, group, lows, x, xsum, out);
}

API const char *flover_kernels(void) {
    static char name[96]; /* the same text every call: e.g. "AVX-512F, VNNI and bfloat16 dot products" */
    const char *int8 = int8_dot_name();
    if (*int8 && has_bf16_dot()) snprintf(name, sizeof name, "%s, %s and bfloat16 dot products", V_FAMILY_SIMD, int8);
    else if (*int8 || has_bf16_dot())
        snprintf(name, sizeof name, "%s, %s dot products", V_FAMILY_SIMD, *int8 ? int8 : "bfloat16");
    else snprintf(name, sizeof name, "%s", V_FAMILY_SIMD);
    return name;
}
