/* A whole projection y = x W^T (+ bias): the threads split the weight blocks (each reads its
 * share of the weight once, from memory, and the rows' tiles again from its cache); the tiles
 * (tiles.c) sum; here the outputs get their bias, their rounding to the model dtype, and a
 * place in y (or, for greedy rows, in a running maximum). */
#include <omp.h>

#include "native.h"

/* x (float values of the model dtype) -> the model dtype: the kernels' operand. Exact. */
void to_model_dtype(const float *x, void *dst, int64_t n, int bf) {
    if (!bf) {
        memcpy(dst, x, n * sizeof(float));
        return;
    }
    for (int64_t i = 0; i < n; i += 16) v_store_bf16n((uint16_t *)dst + i, v_loadn(x + i, n - i), n - i);
}

/* Thread t of T converts its share of the rows of x [rows, k] to the kernels' operand xb (the
 * caller waits for all threads before any tile reads xb). */
static void operand_rows(const float *x, void *xb, int rows, int64_t k, int bf, int t, int T) {
    const int64_t m0 = (int64_t)rows * t / T, m1 = (int64_t)rows * (t + 1) / T;
    to_model_dtype(x + m0 * k, (char *)xb + m0 * k * (bf ? 2 : 4), (m1 - m0) * k, bf);
}

/* 16 outputs of a tile (lanes of outputs n0..n0+15, those below n_out) -> rnd(acc + bias), as
 * floats or in the model dtype, at y[at + n]. */
static inline void store_outputs(const float *acc, const void *bias, int64_t n0, int64_t n_out, void *y, int64_t at,
                                 int in_model_dtype, int bf) {
    const int64_t n = n_out - n0;
    v16 v = v_load(acc);
    if (bias) v = v_add(v, v_loadx(bias, n0, bf, n));
    v = v_rnd(v, bf);
    if (in_model_dtype) v_storex(y, at + n0, v, bf, n);
    else v_storen((float *)y + at + n0, v, n);
}

/* 16 outputs of a tile (as store_outputs) into one row's per-lane running maximum: `best` [16]
 * the largest value of each lane, `where` [16] the index where it was first seen (strictly larger
 * values replace: this thread's blocks come in order), `first_nan` the row's first NaN. */
static inline void keep_max(const float *acc, const void *bias, int64_t n0, int64_t n_out, int bf, float *best,
                            int32_t *where, int64_t *first_nan) {
    const m16 m = lanes(n_out - n0);
    v16 v = v_load(acc);
    if (bias) v = v_add(v, v_loadx(bias, n0, bf, n_out - n0));
    v = v_rnd(v, bf);
    const m16 nan = v_nan(v) & m;
    if (nan && *first_nan < 0) *first_nan = n0 + __builtin_ctz(nan);
    const v16 top = v_load(best);
    const m16 larger = v_gt(v, top) & m;
    v_store(best, v_select(larger, v, top));
    for (m16 l = larger; l; l &= l - 1) where[__builtin_ctz(l)] = (int32_t)(n0 + __builtin_ctz(l));
}

/* A row's per-lane maxima -> its largest value and the smallest index holding it (-1 if none
 * is above -inf). */
static void lanes_max(const float *best, const int32_t *where, float *top, int64_t *at) {
    float most = -INFINITY;
    for (int lane = 0; lane < 16; lane++) most = best[lane] > most ? best[lane] : most;
    int64_t first = -1;
    for (int lane = 0; lane < 16; lane++)
        if (most != -INFINITY && best[lane] == most && (first < 0 || where[lane] < first)) first = where[lane];
    *top = most, *at = first;
}

/* Each row's sum of x over every group of `group` inputs: xsum [rows][k / group] (thread t of T
 * sums its share of the rows; the caller waits before the tiles read them). */
static void group_sums(const float *x, float *xsum, int rows, int64_t k, int group, int t, int T) {
    const int64_t groups = k / group;
    for (int m = rows * t / T; m < rows * (t + 1) / T; m++)
        for (int64_t g = 0; g < groups; g++) {
            v16 sum = v_load(x + m * k + g * group);
            for (int i = 16; i < group; i += 16) sum = v_add(sum, v_load(x + m * k + g * group + i));
            xsum[m * groups + g] = v_reduce_add(sum);
        }
}

/* Where block nb (16 output rows) of a run keeps its codes and its scales (stored, or the
 * K-quants' super-blocks), for k inputs */
static const uint8_t *block_codes(const GridPart *part, int64_t nb, int64_t k) {
    const int kind = (int)part->kind, bytes = kind == G_INT8_GROUPS || kind == G_INT8_K5 || kind == G_INT8_K6;
    const int64_t code_bytes = bytes ? 16 * k : kind == G_INT6_K ? 12 * k : kind == G_INT5_K ? 10 * k
                               : kind == G_Q3_K ? 6 * k : kind == G_Q2_K ? 4 * k : 8 * k;
    return (const uint8_t *)part->codes + nb * code_bytes;
}
static const char *block_scales(const GridPart *part, int64_t nb, int64_t k) {
    const int kind = (int)part->kind;
    const int64_t scale_bytes = kind == G_INT4_K || kind == G_INT5_K || kind == G_INT8_K5 ? (k / 256) * Q4K_SUPER_BYTES
                                : kind == G_INT6_K || kind == G_INT8_K6 || kind == G_Q3_K ? (k / 256) * Q6K_SUPER_BYTES
                                : kind == G_Q2_K ? (k / 256) * Q2K_SUPER_BYTES
                                : kind == G_IQ4_XS ? (k / 256) * IQ4XS_SUPER_BYTES
                                                                        : (k / part->group) * 16 * (1 + part->lows) * 4;
    return (const char *)part->scales + nb * scale_bytes;
}

/* blocks of a panel (1 up to X8_PANEL_ROWS rows) */
static int64_t x8_panel(const GridPart *part, int64_t k, int rows) {
    const int64_t block_bytes = block_codes(part, 1, k) - block_codes(part, 0, k);
    return rows > X8_PANEL_ROWS && block_bytes < X8_PANEL_BYTES ? X8_PANEL_BYTES / block_bytes : 1;
}

/* Blocks nb0..nb1-1 for rows of x, a panel of blocks at a time: a row tile's inputs (8 rows: 8k
 * bytes) stay in L1 or L2 over the panel while the panel's codes stay in L2. Block by block, every
 * block read all the rows' inputs again (a 512-token chunk's are 1-4 MiB: from L3; docs/journal.md
 * (v)). The same tiles and sums, so the same bits. */
void blocks_x8(const GridPart *part, int64_t nb0, int64_t nb1, int64_t k, const Int8Rows *x, int rows,
               const void *bias, float *y, int64_t ldy, int bf) {
    const int64_t panel = x8_panel(part, k, rows);
    float out[12 * 16];
    for (int64_t p0 = nb0; p0 < nb1; p0 += panel) {
        const int64_t p1 = p0 + panel < nb1 ? p0 + panel : nb1;
        for (int m0 = 0; m0 < rows;) {
            const int mt = x8_tile_rows(rows - m0);
            const Int8Rows xr = int8_rows_from(x, m0, k);
            for (int64_t nb = p0; nb < p1; nb++) {
                tile_x8(mt, part, block_codes(part, nb, k), block_scales(part, nb, k), k, &xr, out);
                for (int i = 0; i < mt; i++)
                    store_outputs(out + i * 16, bias, nb * 16, part->rows, y, (m0 + i) * ldy, 0, bf);
            }
            m0 += mt;
        }
    }
}

/* The run holding output row *row of a grid (the last one past its end), *row made that run's own */
static const GridPart *grid_run(const Grid *grid, int64_t *row) {
    const GridPart *part = grid->part;
    while (*row >= part->rows && part < grid->part + grid->parts - 1) *row -= part->rows, part++;
    return part;
}

/* gate's block j and up's block j of each row tile one after the other, in panels handed to
 * whichever thread is free (as blocks_x8): gate_up's outputs are never stored (a 512-token chunk's
 * are 32 MiB of floats) nor read back by a silu_mul pass. The same tiles, roundings (store_outputs
 * without bias: rnd) and silu_times as project_grid then silu_mul: the same bits. */
int project_swiglu(const Grid *grid, const float *x, void *xb, float *xsum, int rows, int64_t inter, int64_t k,
                   float *out, int bf, int nt) {
    if (rows <= X8_PANEL_ROWS || inter % 16) return 0;
    int64_t total = 0; /* (gate's and up's blocks below are within the grid's 2 inter rows) */
    for (int64_t p = 0; p < grid->parts; p++) {
        if (!grid->part[p].x8 || grid->part[p].kind == G_INT8_ROWS || grid->part[p].rows % 16) return 0;
        total += grid->part[p].rows;
    }
    if (total != 2 * inter) return 0;
    const Int8Rows x8 = int8_rows_at(xb, xsum, rows, k, x8_block(grid));
    const int64_t blocks = inter / 16, half = x8_panel(grid->part, k, rows) / 2, panel = half > 1 ? half : 1;
#pragma omp parallel num_threads(nt)
    {
        int8_rows(x, &x8, rows, k, omp_get_thread_num(), omp_get_num_threads());
#pragma omp barrier
#pragma omp for schedule(dynamic, 1) nowait
        for (int64_t j0 = 0; j0 < blocks; j0 += panel) {
            float gate[12 * 16], up[12 * 16];
            for (int m0 = 0; m0 < rows;) {
                const int mt = x8_tile_rows(rows - m0);
                const Int8Rows xr = int8_rows_from(&x8, m0, k);
                for (int64_t j = j0; j < j0 + panel && j < blocks; j++) {
                    int64_t g = 16 * j, u = inter + 16 * j; /* (runs hold whole blocks: checked above) */
                    const GridPart *gp = grid_run(grid, &g), *up_part = grid_run(grid, &u);
                    tile_x8(mt, gp, block_codes(gp, g / 16, k), block_scales(gp, g / 16, k), k, &xr, gate);
                    tile_x8(mt, up_part, block_codes(up_part, u / 16, k), block_scales(up_part, u / 16, k), k, &xr, up);
                    for (int i = 0; i < mt; i++)
                        v_store(out + (m0 + i) * inter + 16 * j,
                                silu_times(v_rnd(v_load(gate + i * 16), bf), v_rnd(v_load(up + i * 16), bf), bf));
                }
                m0 += mt;
            }
        }
    }
    return 1;
}

/* Block nb for rows of x (float rows of bfloat16 values, or their operand copy in xb) through
 * tiles.c's 4-bit or byte tiles; xsum: their group sums where the run has minimums */
static void block_groups(const GridPart *part, int64_t nb, int64_t k, const float *x, const void *xb,
                         const float *xsum, int rows, const void *bias, float *y, int64_t ldy, int bf) {
    const int kind = (int)part->kind, group = (int)part->group;
    const uint8_t *c = block_codes(part, nb, k);
    const char *sc = block_scales(part, nb, k);
    float out[12 * 16];
    for (int m0 = 0; m0 < rows;) {
        const int mt = group_tile_rows(rows - m0);
        const void *operand = operand_is_bf16(W_Q8) ? (const void *)((const uint16_t *)xb + m0 * k)
                                                    : (const void *)(x + m0 * k);
        if (kind == G_INT8_GROUPS)
            tile_q8g(mt, (const int8_t *)c, (const float *)sc, k, group, (int)part->lows, operand,
                     xsum + m0 * (k / group), out);
        else
            tile_q4(mt, kind, c, sc, k, operand, xsum + m0 * (k / group), out);
        for (int i = 0; i < mt; i++) store_outputs(out + i * 16, bias, nb * 16, part->rows, y, (m0 + i) * ldy, 0, bf);
        m0 += mt;
    }
}

/* y = x W^T (+ bias) through a run of codes with group scales (tiles.c: 4-bit, or bytes; or
 * tiles_int8.c's on int8 inputs); x: float rows [rows, k] of bfloat16 values; y: float rows with
 * a stride of ldy. One row reads a quarter (4-bit) or half of bfloat16's bytes. xb and xsum:
 * the operand's scratch (int8 inputs, in blocks of x8_inputs: their codes and scales in xb, their
 * sums in xsum; x8_ready: an earlier run of the projection has put them there). */
static void project_groups(const GridPart *part, const void *bias, const float *x, void *xb, float *xsum, int rows,
                           int64_t k, float *y, int64_t ldy, int bf, int nt, int x8_ready, int x8_inputs) {
    const int group = (int)part->group, lows = (int)part->lows;
    const int64_t blocks = (part->rows + 15) / 16;
    const Int8Rows x8 = int8_rows_at(xb, xsum, rows, k, x8_inputs);
#pragma omp parallel num_threads(nt)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        if (part->x8) {
            if (!x8_ready) int8_rows(x, &x8, rows, k, t, T);
        } else if (operand_is_bf16(W_Q8))
            operand_rows(x, xb, rows, k, 1, t, T);
        if (lows && !part->x8) group_sums(x, xsum, rows, k, group, t, T);
#pragma omp barrier
        if (part->x8 && rows > X8_PANEL_ROWS) { /* panels to whichever thread is free: one slowed by a
                                                     * neighbour no longer holds the other at the end */
            const int64_t panel = x8_panel(part, k, rows);
#pragma omp for schedule(dynamic, 1) nowait
            for (int64_t p0 = 0; p0 < blocks; p0 += panel)
                blocks_x8(part, p0, p0 + panel < blocks ? p0 + panel : blocks, k, &x8, rows, bias, y, ldy, bf);
        } else if (part->x8) blocks_x8(part, blocks * t / T, blocks * (t + 1) / T, k, &x8, rows, bias, y, ldy, bf);
        else
            for (int64_t nb = blocks * t / T; nb < blocks * (t + 1) / T; nb++)
                block_groups(part, nb, k, x, xb, xsum, rows, bias, y, ldy, bf);
    }
}

/* y = x W^T (+ bias) for weights held as codes: each run of output rows (GridPart) through its
 * own kernels, into its columns of y [rows, n_out] (floats). */
void project_grid(const Grid *grid, int bf, int64_t b_addr, const float *x, void *xb, float *xsum, int rows,
                  int64_t n_out, int64_t k, float *y, int nt) {
    int64_t at = 0;
    const int block = x8_block(grid);
    for (int64_t p = 0; p < grid->parts; p++) {
        const GridPart *part = &grid->part[p];
        const void *bias = b_addr ? (const char *)b_addr + at * (bf ? 2 : 4) : 0;
        if (part->kind != G_INT8_ROWS) /* the runs of a projection all take int8 inputs, or none (quant.py) */
            project_groups(part, bias, x, xb, xsum, rows, k, y + at, n_out, bf, nt, p > 0 && grid->part[p - 1].x8, block);
        else
            project_kind(W_Q8, bf, part->codes, part->scales, (int64_t)bias, x, xb, rows, part->rows, k, y + at, n_out,
                         0, nt, 0);
        at += part->rows;
    }
}

/* grid_row of a Q2_K, Q3_K or IQ4 run (tiles_int8.c's 2-bit, 3-bit and 4-bit layouts): row `lane` of block `block` */
static void packed_row(const GridPart *part, int64_t block, int64_t lane, int64_t k, float *out) {
    const int kind = (int)part->kind, iq4 = kind == G_IQ4_NL || kind == G_IQ4_XS;
    const uint8_t *c = block_codes(part, block, k);
    const char *s = block_scales(part, block, k);
    const int64_t group_bytes = iq4 ? 256 : kind == G_Q3_K ? 192 : 128;
    for (int64_t j16 = 0; j16 < k; j16 += 16) { /* 16 inputs: one scale (and low) */
        const int64_t g = j16 / 32, half = (j16 % 32) / 16;
        v16 scale, low = v_zero();
        if (kind == G_IQ4_XS) scale = iq4xs_group_scale(s, g);
        else if (kind == G_IQ4_NL) scale = v_load((const float *)s + g * 16);
        else if (kind == G_Q3_K) scale = q6k_group_scale(s, j16 / 16);
        else q2k_group_scale_low(s, j16 / 16, &scale, &low);
        float sc[16], lw[16];
        v_store(sc, scale), v_store(lw, low);
        const uint8_t *gc = c + g * group_bytes;
        for (int64_t i = 0; i < 16; i++) {
            const int64_t quad = i / 4, at = lane * 4 + i % 4;
            float u;
            if (iq4) {
                const uint8_t nibbles = gc[quad * 64 + at];
                u = (float)IQ4_VALUES[half ? nibbles >> 4 : nibbles & 15];
            } else {
                int code = (gc[half * 64 + at] >> (2 * quad)) & 3;
                if (kind == G_Q3_K) code |= ((gc[128 + at] >> (4 * half + quad)) & 1) << 2;
                u = (float)(kind == G_Q3_K ? code - 4 : code);
            }
            out[j16 + i] = sc[lane] * u + lw[lane];
        }
    }
}

/* Row `row` of a grid's weights (k inputs) -> out, floats: a tied embedding's lookup where the
 * head's codes are its only copy. Reads the blocked layouts of tiles.c and tiles_int8.c lane by lane. */
void grid_row(const Grid *grid, int64_t row, int64_t k, float *out) {
    const GridPart *part = grid_run(grid, &row);
    const int64_t block = row / 16, lane = row % 16;
    if (part->kind == G_INT4 || part->kind == G_INT4_K || part->kind == G_MXFP4) {
        const int k_super = part->kind == G_INT4_K;
        const uint8_t *c = (const uint8_t *)part->codes + block * 16 * k / 2;
        const char *s = (const char *)part->scales + block * (k_super ? (k / 256) * Q4K_SUPER_BYTES : (k / 32) * 128);
        for (int64_t g = 0; g < k / 32; g++) {
            v16 scale, zero;
            float sc[16], zr[16];
            if (k_super) q4k_group_scales(s, g, &scale, &zero);
            else q4_group_scales(s, g, &scale, &zero);
            v_store(sc, scale), v_store(zr, zero);
            for (int64_t j = 0; j < 32; j++) { /* tiles_int8.c's quads, or tiles.c's pairs */
                const uint8_t byte = part->x8 ? c[g * 256 + ((j % 16) / 4) * 64 + lane * 4 + j % 4]
                                              : c[(g * 16 + j / 2) * 16 + lane];
                const int high = part->x8 ? j >= 16 : j % 2, code = high ? byte >> 4 : byte & 15;
                const int u = part->kind == G_MXFP4 ? MXFP4_U[code] : code; /* (MXFP4: its value + 12; zero -4 scale) */
                out[g * 32 + j] = sc[lane] * (float)(u - 8) + zr[lane];
            }
        }
        return;
    }
    if (part->kind >= G_Q2_K) {
        packed_row(part, block, lane, k, out);
        return;
    }
    if (part->kind == G_INT6_K) {
        const uint8_t *c = (const uint8_t *)part->codes + block * 12 * k;
        const char *s = (const char *)part->scales + block * (k / 256) * Q6K_SUPER_BYTES;
        for (int64_t g = 0; g < k / 32; g++) {
            float sc[2][16];
            v_store(sc[0], q6k_group_scale(s, 2 * g)), v_store(sc[1], q6k_group_scale(s, 2 * g + 1));
            for (int64_t j = 0; j < 32; j++) { /* tiles_int8.c's 6-bit layout */
                const int64_t quad = (j % 16) / 4, at = lane * 4 + j % 4;
                const uint8_t nibbles = c[g * 384 + quad * 64 + at], high = c[g * 384 + (j < 16 ? 256 : 320) + at];
                const int u = (j < 16 ? nibbles & 15 : nibbles >> 4) | ((high >> (2 * quad)) & 3) << 4;
                out[g * 32 + j] = sc[j / 16][lane] * (float)(u - 32);
            }
        }
        return;
    }
    if (part->kind == G_INT5_K) {
        const uint8_t *c = (const uint8_t *)part->codes + block * 10 * k;
        const char *s = (const char *)part->scales + block * (k / 256) * Q4K_SUPER_BYTES;
        for (int64_t g = 0; g < k / 32; g++) {
            v16 scale, low;
            float sc[16], lw[16];
            k_group_scale_low(s, g, &scale, &low);
            v_store(sc, scale), v_store(lw, low);
            for (int64_t j = 0; j < 32; j++) { /* tiles_int8.c's 5-bit layout */
                const int64_t quad = (j % 16) / 4, at = lane * 4 + j % 4;
                const uint8_t nibbles = c[g * 320 + quad * 64 + at], fifth = c[g * 320 + 256 + at];
                const int u = (j < 16 ? nibbles & 15 : nibbles >> 4) | ((fifth >> (quad + (j < 16 ? 0 : 4))) & 1) << 4;
                out[g * 32 + j] = sc[lane] * (float)u + lw[lane];
            }
        }
        return;
    }
    const int8_t *c = (const int8_t *)part->codes + block * 16 * k;
    const float *s = (const float *)part->scales;
    if (part->kind == G_INT8_K5 || part->kind == G_INT8_K6) { /* bytes with super-block scales: u = q + offset */
        const int q5 = part->kind == G_INT8_K5, group = q5 ? 32 : 16;
        const char *supers = (const char *)part->scales + block * (k / 256) * (q5 ? Q4K_SUPER_BYTES : Q6K_SUPER_BYTES);
        for (int64_t g = 0; g < k / group; g++) {
            v16 scale, low = v_zero();
            float sc[16], lw[16];
            if (q5) k_group_scale_low(supers, g, &scale, &low);
            else scale = q6k_group_scale(supers, g);
            v_store(sc, scale), v_store(lw, low);
            for (int64_t i = g * group; i < (g + 1) * group; i++) {
                const float q = (float)(((const uint8_t *)c)[(i / 4) * 64 + lane * 4 + i % 4] - (int)part->offset);
                out[i] = q5 ? sc[lane] * q + lw[lane] : sc[lane] * q;
            }
        }
        return;
    }
    for (int64_t i = 0; i < k; i++) {
        const int64_t at = (i / 4) * 64 + lane * 4 + i % 4; /* tiles_int8.c's lanes of four */
        const float q = part->x8 == X8_SIGNED ? (float)c[at]
                        : part->x8 ? (float)(((const uint8_t *)c)[at] - (int)part->offset)
                                   : (float)c[(i / 2) * 32 + lane * 2 + i % 2];
        if (part->kind == G_INT8_ROWS) {
            out[i] = s[block * 16 + lane] * q;
            continue;
        }
        const int64_t per = 1 + part->lows, g = i / part->group;
        const float *gs = s + (block * (k / part->group) + g) * per * 16;
        out[i] = part->lows ? gs[lane] * q + gs[16 + lane] : gs[lane] * q;
    }
}

/* y[m, n] = W[n, :] . x[m, :] + bias[n] for m < rows, n < n_out, rounded to the model dtype and
 * stored as floats. x: float rows [rows, k] holding model-dtype values; xb: scratch for their
 * model-dtype copy (the kernels' operand); W: the dense weight, blocked. */
void project(const Model *md, int64_t w_addr, int64_t b_addr, const float *x, void *xb, int rows, int64_t n_out,
             int64_t k, float *y, int nt) {
    const int bf = md->dtype == DT_BF16;
    project_kind(bf, bf, w_addr, 0, b_addr, x, xb, rows, n_out, k, y, n_out, 0, nt, 0);
}

/* project() through weights of `kind`, outputs rounded (and stored) as bfloat16 if bf, row m at
 * y + m * ldy; x NULL: xb already holds the operand (operand_is_bf16's type), else x's rows are
 * it or give it. `most`: nothing is stored; each thread keeps its running maximum of every row
 * there instead (keep_max). */
void project_kind(int kind, int bf, int64_t w_addr, int64_t scales_addr, int64_t b_addr, const float *x, void *xb,
                  int rows, int64_t n_out, int64_t k, void *y, int64_t ldy, int y_in_model_dtype, int nt, RowMax *most) {
    const float *scales = (const float *)scales_addr;
    const void *w = (const void *)w_addr, *bias = (const void *)b_addr;
    const int64_t blocks = (n_out + 15) / 16;
    const int per_tile = tile_blocks(kind, rows);
#pragma omp parallel num_threads(nt)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        const void *operand = x && !operand_is_bf16(kind) ? (const void *)x : xb;
        if (x && operand_is_bf16(kind)) operand_rows(x, xb, rows, k, 1, t, T);
#pragma omp barrier
        const int64_t b0 = blocks * t / T, b1 = blocks * (t + 1) / T;
        float out[6 * 4 * 16];
        const int64_t es = weight_bytes(kind);
        const int kept = most ? rows : 1; /* this thread's running maxima (keep_max) */
        float best[kept * 16];
        int32_t where[kept * 16];
        int64_t first_nan[kept];
        for (int r = 0; most && r < rows; r++) {
            first_nan[r] = -1;
            for (int lane = 0; lane < 16; lane++) best[r * 16 + lane] = -INFINITY, where[r * 16 + lane] = -1;
        }
        for (int64_t nb = b0; nb < b1;) {
            const int nt_blocks = b1 - nb >= per_tile ? per_tile : (int)(b1 - nb);
            for (int m0 = 0, tiles = 0; m0 < rows; tiles++) {
                const int mt = tile_rows(kind, rows - m0, nt_blocks);
                /* the first row tile of these blocks reads them from memory, the others from cache:
                 * with a few row tiles (decode), those ask for the next blocks' weights, a block each */
                const int64_t next = nb + nt_blocks + tiles - 1;
                const char *pf =
                    rows <= 64 && tiles > 0 && tiles <= 4 && next < b1 ? (const char *)w + next * 16 * k * es : 0;
                tile(w, nb, k, operand, m0, mt, nt_blocks, kind, out, pf);
                for (int j = 0; j < nt_blocks; j++) {
                    const int64_t n0 = (nb + j) * 16;
                    for (int i = 0; i < mt; i++) {
                        float *acc = out + (i * nt_blocks + j) * 16;
                        if (scales) v_store(acc, v_mul(v_load(acc), v_load(scales + n0)));
                        if (most)
                            keep_max(acc, bias, n0, n_out, bf, best + (m0 + i) * 16, where + (m0 + i) * 16,
                                     first_nan + m0 + i);
                        else
                            store_outputs(acc, bias, n0, n_out, y, (m0 + i) * ldy, y_in_model_dtype, bf);
                    }
                }
                m0 += mt;
            }
            nb += nt_blocks;
        }
        for (int r = 0; most && r < rows; r++) {
            lanes_max(best + r * 16, where + r * 16, most->top + t * rows + r, most->at + t * rows + r);
            most->nan_at[t * rows + r] = first_nan[r];
        }
    }
}
