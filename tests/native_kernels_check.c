/* Every kernel of the native step on fixed pseudo-random inputs, its outputs printed one number a
 * line: tests/test_native_families.py builds this with one kernel family (e.g. NEON, cross-compiled
 * and run under qemu-user) and with the portable one, and compares the two printouts. Covers each
 * operation of simd.h's mapping: projection tiles of every weight kind and size, 4-bit tiles,
 * 8-bit tiles with group scales (and minimums), tiles on int8 inputs, a row of a grid, norms, RoPE, SiLU, attention (decode rows and a prompt block, float32 and bfloat16 caches)
 * and argmax, with tails shorter than 16 lanes. */
#include <stdio.h>
#include <stdlib.h>

#include "native.h"

static uint64_t state = 0x9E3779B97F4A7C15ull;

static float uniform(void) { /* [-1, 1) */
    state ^= state << 13, state ^= state >> 7, state ^= state << 17;
    return (float)((state >> 40) & 0xffffff) / 8388608.f - 1.f;
}

static void fill(float *x, int64_t n, float scale) {
    for (int64_t i = 0; i < n; i++) x[i] = uniform() * scale;
}

static void fill_bf16(uint16_t *x, int64_t n, float scale) {
    for (int64_t i = 0; i < n; i++) x[i] = f2bf(uniform() * scale);
}

static void print(const char *what, const float *x, int64_t n) {
    printf("# %s\n", what);
    for (int64_t i = 0; i < n; i++) printf("%.9g\n", x[i]);
}

/* each row's sum of x over every group of `group` inputs: xsum [rows][k / group] (the grouped tiles take it) */
static void group_sums(const float *x, int rows, int k, int group, float *xsum) {
    for (int i = 0; i < rows * (k / group); i++) {
        xsum[i] = 0.f;
        for (int j = 0; j < group; j++) xsum[i] += x[(i / (k / group)) * k + (i % (k / group)) * group + j];
    }
}

static void check_tiles(void) {
    enum { K = 96, BLOCKS = 4, ROWS = 6 };
    static float wf[BLOCKS * 16 * K], xf[ROWS * K], xbf[ROWS * K], out[6 * 4 * 16];
    static uint16_t wb[BLOCKS * 16 * K], xb[ROWS * K];
    static int8_t wq[BLOCKS * 16 * K];
    fill(wf, BLOCKS * 16 * K, 1.f), fill(xf, ROWS * K, 1.f);
    fill_bf16(wb, BLOCKS * 16 * K, 1.f), fill_bf16(xb, ROWS * K, 1.f);
    for (int i = 0; i < ROWS * K; i++) xbf[i] = bf2f(xb[i]); /* the same operand as floats */
    const void *pairs_operand = operand_is_bf16(W_BF16) ? (const void *)xb : (const void *)xbf;
    for (int i = 0; i < BLOCKS * 16 * K; i++) wq[i] = (int8_t)(uniform() * 127.f);
    const int rows[4] = {1, 2, 4, 6};
    char name[64];
    for (int r = 0; r < 4; r++)
        for (int nt = 1; nt <= BLOCKS; nt++) {
            snprintf(name, sizeof name, "tile f32 %dx%d", rows[r], nt);
            tile(wf, 0, K, xf, 0, rows[r], nt, W_F32, out, 0);
            print(name, out, rows[r] * nt * 16);
            snprintf(name, sizeof name, "tile bf16 %dx%d", rows[r], nt);
            tile(wb, 0, K, pairs_operand, 0, rows[r], nt, W_BF16, out, 0);
            print(name, out, rows[r] * nt * 16);
            snprintf(name, sizeof name, "tile q8 %dx%d", rows[r], nt);
            tile(wq, 0, K, pairs_operand, 0, rows[r], nt, W_Q8, out, 0);
            print(name, out, rows[r] * nt * 16);
        }
}

static void check_q4(void) {
    enum { K = 64, GROUPS = K / 32, ROWS = 12 };
    static uint8_t codes[GROUPS * 256];
    static uint16_t x[ROWS * K];
    static float scales[GROUPS * 32], xf[ROWS * K], xsum[ROWS * GROUPS], out[12 * 16];
    for (int i = 0; i < GROUPS * 256; i++) codes[i] = (uint8_t)((int)((uniform() + 1.f) * 128.f) & 0xff);
    fill(scales, GROUPS * 32, 0.1f), fill_bf16(x, ROWS * K, 1.f);
    for (int i = 0; i < ROWS * K; i++) xf[i] = bf2f(x[i]);
    group_sums(xf, ROWS, K, 32, xsum);
    const int rows[5] = {1, 2, 4, 8, 12};
    char name[64];
    for (int r = 0; r < 5; r++) {
        snprintf(name, sizeof name, "tile q4 %d", rows[r]);
        tile_q4(rows[r], G_INT4, codes, scales, K, operand_is_bf16(W_Q8) ? (const void *)x : (const void *)xf, xsum, out);
        print(name, out, rows[r] * 16);
    }
}

/* 4-bit tiles whose scales come from Q4_K's super-blocks (native.h: q4k_group_scales), and a row
 * of such a grid and of a stored-scales one */
static void check_q4_k(void) {
    enum { K = 512, GROUPS = K / 32, SUPERS = K / 256, ROWS = 12 };
    static uint8_t codes[GROUPS * 256], supers[SUPERS * Q4K_SUPER_BYTES];
    static uint16_t x[ROWS * K];
    static float xf[ROWS * K], xsum[ROWS * GROUPS], out[12 * 16], row[K], flat[GROUPS * 32];
    for (int i = 0; i < GROUPS * 256; i++) codes[i] = (uint8_t)((int)((uniform() + 1.f) * 128.f) & 0xff);
    for (int s = 0; s < SUPERS; s++) {
        float *f = (float *)(supers + s * Q4K_SUPER_BYTES);
        fill(f, 16, 0.01f), fill(f + 16, 16, 0.01f); /* d, -dmin */
        for (int i = 128; i < Q4K_SUPER_BYTES; i++) supers[s * Q4K_SUPER_BYTES + i] = (uint8_t)((uniform() + 1.f) * 31.9f);
    }
    fill_bf16(x, ROWS * K, 1.f);
    for (int i = 0; i < ROWS * K; i++) xf[i] = bf2f(x[i]);
    group_sums(xf, ROWS, K, 32, xsum);
    const int rows[5] = {1, 2, 4, 8, 12};
    char name[64];
    for (int r = 0; r < 5; r++) {
        snprintf(name, sizeof name, "tile q4 k %d", rows[r]);
        tile_q4(rows[r], G_INT4_K, codes, supers, K, operand_is_bf16(W_Q8) ? (const void *)x : (const void *)xf, xsum,
                out);
        print(name, out, rows[r] * 16);
    }
    Grid grid = {1, {{G_INT4_K, 16, 32, 1, (int64_t)codes, (int64_t)supers}}};
    grid_row(&grid, 7, K, row);
    print("grid row q4 k", row, K);
    fill(flat, GROUPS * 32, 0.1f);
    Grid stored = {1, {{G_INT4, 16, 32, 1, (int64_t)codes, (int64_t)flat}}};
    grid_row(&stored, 9, K, row);
    print("grid row q4", row, K);
}

static void check_q8_groups(void) {
    enum { K = 64, ROWS = 12 };
    static int8_t codes[16 * K];
    static uint16_t x[ROWS * K];
    static float scales[(K / 16) * 2 * 16], xf[ROWS * K], xsum[ROWS * (K / 16)], out[12 * 16], row[K];
    for (int i = 0; i < 16 * K; i++) codes[i] = (int8_t)(uniform() * 127.f);
    fill(scales, (K / 16) * 2 * 16, 0.1f), fill_bf16(x, ROWS * K, 1.f);
    for (int i = 0; i < ROWS * K; i++) xf[i] = bf2f(x[i]);
    const int rows[5] = {1, 2, 4, 8, 12};
    char name[64];
    for (int group = 16; group <= 32; group += 16)
        for (int lows = 0; lows < 2; lows++) {
            group_sums(xf, ROWS, K, group, xsum);
            for (int r = 0; r < 5; r++) {
                snprintf(name, sizeof name, "tile q8 groups of %d, lows %d, %d rows", group, lows, rows[r]);
                tile_q8g(rows[r], codes, scales, K, group, lows, operand_is_bf16(W_Q8) ? (const void *)x : (const void *)xf,
                         xsum, out);
                print(name, out, rows[r] * 16);
            }
            Grid grid = {1, {{G_INT8_GROUPS, 16, group, lows, (int64_t)codes, (int64_t)scales}}};
            grid_row(&grid, 5, K, row);
            print("grid row", row, K);
        }
}

/* int8 inputs (tiles_int8.c): the rows quantized, and the tiles of every code kind (4-bit with
 * stored scales or Q4_K's, bytes with groups of 16 or 32, with and without minimums, signed bytes
 * of the whole range: Q8_0's, Q6_K's 6-bit and Q5_K's 5-bit codes, and those two as bytes with their
 * super-blocks' scales, MXFP4's, Q2_K's 2-bit and Q3_K's 3-bit codes, the IQ4 types' table indexes, and
 * Q4_K's on inputs in blocks of 256), each with
 * its "reference": the sums of its grid_row weights times the dequantized inputs, in double (the
 * test holds every family's tiles to it) */
static void check_x8(void) {
    enum { K = 512, GROUPS = K / 32, SUPERS = K / 256, ROWS = 12 };
    static float x[ROWS * K], d[ROWS * GROUPS], ds16[ROWS * K / 16], ds32[ROWS * GROUPS], qf[ROWS * K], qsf[ROWS * GROUPS];
    static int32_t qs32[ROWS * GROUPS];
    static float out[12 * 16], ref[ROWS * 16], w[16 * K], flat[GROUPS * 32], scales[(K / 16) * 2 * 16];
    static int8_t q[ROWS * K];
    static uint8_t nibbles[GROUPS * 256], bytes[16 * K], signed_bytes[16 * K], supers[SUPERS * Q4K_SUPER_BYTES];
    static uint8_t six_bits[GROUPS * 384], supers6[SUPERS * Q6K_SUPER_BYTES];
    static uint8_t five_bits[GROUPS * 320], bytes5[16 * K];
    static uint8_t crumbs[GROUPS * 192], supers2[SUPERS * Q2K_SUPER_BYTES], supers_iq4[SUPERS * IQ4XS_SUPER_BYTES];
    fill(x, ROWS * K, 2.f);
    for (int j = 0; j < 32; j++) x[3 * K + 64 + j] = 0.f; /* a block of zeros: d = 0 */
    x[0] = x[1] = -2.f, x[2] = x[3] = 2.f;
    const Int8Rows rows = {q, d, ds16, ds32, qs32, 0, 0, 32};
    int8_rows(x, &rows, ROWS, K, 0, 1);
    for (int i = 0; i < ROWS * K; i++) qf[i] = q[i];
    for (int i = 0; i < ROWS * GROUPS; i++) qsf[i] = (float)qs32[i];
    print("int8 codes", qf, ROWS * K), print("int8 d", d, ROWS * GROUPS);
    print("int8 d sums of 16", ds16, ROWS * K / 16), print("int8 d sums of 32", ds32, ROWS * GROUPS);
    print("int8 sums of 32", qsf, ROWS * GROUPS);

    for (int i = 0; i < GROUPS * 256; i++) nibbles[i] = (uint8_t)((int)((uniform() + 1.f) * 128.f) & 0xff);
    for (int i = 0; i < 16 * K; i++) bytes[i] = (uint8_t)((uniform() + 1.f) * 31.99f); /* 0..63 */
    for (int i = 0; i < 16 * K; i++) signed_bytes[i] = (uint8_t)(int)((uniform() + 1.f) * 127.99f); /* -128..127 */
    /* the ends against the inputs' (row 0's first four: -127, -127, 127, 127): maddubs's pairs at
     * their largest, 2 x 128 x 127 */
    for (int i = 0; i < 64; i++) signed_bytes[i] = i < 32 ? 0x80 : 0x7f;
    for (int s = 0; s < SUPERS; s++) {
        float *f = (float *)(supers + s * Q4K_SUPER_BYTES);
        fill(f, 16, 0.01f), fill(f + 16, 16, 0.01f);
        for (int i = 128; i < Q4K_SUPER_BYTES; i++) supers[s * Q4K_SUPER_BYTES + i] = (uint8_t)((uniform() + 1.f) * 31.9f);
    }
    for (int i = 0; i < 16 * K; i++) bytes5[i] = i < 64 ? 31 : bytes[i] & 31; /* Q5_K's 0..31, u = 31 against row 0's ends */
    for (int i = 0; i < GROUPS * 320; i++) five_bits[i] = (uint8_t)((int)((uniform() + 1.f) * 128.f) & 0xff);
    for (int i = 0; i < 64; i++) five_bits[i] = 0xff, five_bits[256 + i] = 0xff; /* u = 31 against row 0's ends */
    for (int i = 0; i < GROUPS * 384; i++) six_bits[i] = (uint8_t)((int)((uniform() + 1.f) * 128.f) & 0xff);
    for (int i = 0; i < 64; i++) six_bits[i] = 0xff, six_bits[256 + i] = 0xff; /* u = 63 against row 0's ends */
    for (int s = 0; s < SUPERS; s++) {
        fill((float *)(supers6 + s * Q6K_SUPER_BYTES), 16, 0.01f);
        for (int i = 64; i < Q6K_SUPER_BYTES; i++) supers6[s * Q6K_SUPER_BYTES + i] = (uint8_t)(int)((uniform() + 1.f) * 127.99f);
    }
    for (int i = 0; i < GROUPS * 192; i++) crumbs[i] = (uint8_t)((int)((uniform() + 1.f) * 128.f) & 0xff);
    for (int i = 0; i < 64; i++) crumbs[i] = 0xff, crumbs[128 + i] = 0xff; /* u = 3 (Q3_K: 7) against row 0's ends */
    for (int s = 0; s < SUPERS; s++) {
        float *f = (float *)(supers2 + s * Q2K_SUPER_BYTES);
        fill(f, 16, 0.01f), fill(f + 16, 16, 0.01f);
        for (int i = 128; i < Q2K_SUPER_BYTES; i++) supers2[s * Q2K_SUPER_BYTES + i] = (uint8_t)((uniform() + 1.f) * 127.99f);
        fill((float *)(supers_iq4 + s * IQ4XS_SUPER_BYTES), 16, 0.01f);
        for (int i = 64; i < IQ4XS_SUPER_BYTES; i++) /* the file's 6-bit scales less 32 */
            supers_iq4[s * IQ4XS_SUPER_BYTES + i] = (uint8_t)(int8_t)((int)((uniform() + 1.f) * 31.99f) - 32);
    }
    fill(flat, GROUPS * 32, 0.1f), fill(scales, (K / 16) * 2 * 16, 0.1f);
    const GridPart parts[16] = {
        {G_INT4, 16, 32, 1, (int64_t)nibbles, (int64_t)flat, 1, 8},
        {G_INT4_K, 16, 32, 1, (int64_t)nibbles, (int64_t)supers, 1, 8},
        {G_INT8_GROUPS, 16, 16, 0, (int64_t)bytes, (int64_t)scales, 1, 32},
        {G_INT8_GROUPS, 16, 16, 1, (int64_t)bytes, (int64_t)scales, 1, 32},
        {G_INT8_GROUPS, 16, 32, 0, (int64_t)bytes, (int64_t)scales, 1, 16},
        {G_INT8_GROUPS, 16, 32, 1, (int64_t)bytes, (int64_t)scales, 1, 0},
        {G_INT8_GROUPS, 16, 32, 0, (int64_t)signed_bytes, (int64_t)scales, 2, 0},
        {G_INT6_K, 16, 16, 0, (int64_t)six_bits, (int64_t)supers6, 1, 32},
        {G_INT5_K, 16, 32, 1, (int64_t)five_bits, (int64_t)supers, 1, 0},
        {G_INT8_K5, 16, 32, 1, (int64_t)bytes5, (int64_t)supers, 1, 0},
        {G_INT8_K6, 16, 16, 0, (int64_t)bytes, (int64_t)supers6, 1, 32},
        {G_MXFP4, 16, 32, 1, (int64_t)nibbles, (int64_t)flat, 1, 12}, /* (each code through MXFP4_U) */
        {G_Q2_K, 16, 16, 1, (int64_t)crumbs, (int64_t)supers2, 1, 0},
        {G_Q3_K, 16, 16, 0, (int64_t)crumbs, (int64_t)supers6, 1, 4},
        {G_IQ4_NL, 16, 32, 0, (int64_t)nibbles, (int64_t)flat, 2, 0}, /* (each code through IQ4_VALUES) */
        {G_IQ4_XS, 16, 32, 0, (int64_t)nibbles, (int64_t)supers_iq4, 2, 0},
    };
    /* the same rows in blocks of 256 (Q8_K's), for the K-quant tiles that take them (x8_block):
     * row 0's first group all at 127 against codes of 15, the int16 pairs' largest sum (16 x 15 x
     * 127), against Q5_K's codes of 31 (8 x 31 x 127) and Q6_K's of 63 (2 x 2 x 63 x 127) */
    static float x256[ROWS * K], d256[ROWS * SUPERS], q256f[ROWS * K], s16f[ROWS * K / 16], s32f[ROWS * GROUPS];
    static int8_t q256[ROWS * K];
    static int16_t s16[ROWS * K / 16], s32[ROWS * GROUPS];
    static uint8_t nibbles256[GROUPS * 256], bytes6_256[16 * K], five256[GROUPS * 320], bytes5_256[16 * K];
    memcpy(x256, x, sizeof x256);
    for (int j = 0; j < 32; j++) x256[j] = 2.f;
    const Int8Rows rows256 = {q256, d256, 0, 0, 0, s16, s32, 256};
    int8_rows(x256, &rows256, ROWS, K, 0, 1);
    for (int i = 0; i < ROWS * K; i++) q256f[i] = q256[i];
    for (int i = 0; i < ROWS * K / 16; i++) s16f[i] = s16[i];
    for (int i = 0; i < ROWS * GROUPS; i++) s32f[i] = s32[i];
    print("int8 codes (256)", q256f, ROWS * K), print("int8 d (256)", d256, ROWS * SUPERS);
    print("int8 sums of 16 (256)", s16f, ROWS * K / 16), print("int8 sums of 32 (256)", s32f, ROWS * GROUPS);
    memcpy(nibbles256, nibbles, sizeof nibbles256);
    memset(nibbles256, 0xff, 256);
    memcpy(bytes6_256, bytes, sizeof bytes6_256);
    memset(bytes6_256, 63, 128);
    memcpy(five256, five_bits, sizeof five256), memset(five256, 0xff, 128); /* inputs 0..7, 16..23: 31 */
    memcpy(bytes5_256, bytes5, sizeof bytes5_256), memset(bytes5_256, 31, 256); /* inputs 0..15: 31 */
    const GridPart k256[5] = {
        {G_INT4_K, 16, 32, 1, (int64_t)nibbles256, (int64_t)supers, 1, 8},
        parts[7], /* (six_bits: u = 63 against row 0's ends already) */
        {G_INT8_K6, 16, 16, 0, (int64_t)bytes6_256, (int64_t)supers6, 1, 32},
        {G_INT5_K, 16, 32, 1, (int64_t)five256, (int64_t)supers, 1, 0},
        {G_INT8_K5, 16, 32, 1, (int64_t)bytes5_256, (int64_t)supers, 1, 0},
    };

    const int mts[5] = {1, 2, 4, 8, 12};
    char name[64];
    for (int p = 0; p < 21; p++) {
        const GridPart *part = p < 16 ? &parts[p] : &k256[p - 16];
        const Int8Rows *in = p < 16 ? &rows : &rows256;
        const Grid grid = {1, {*part}};
        const int k_quant = p == 1 || (p >= 7 && p <= 10); /* Q4_K, Q5_K, Q6_K: blocks of 256 on their own */
        if (x8_block(&grid) != (p < 16 && !k_quant ? 32 : 256)) printf("# x8_block wrong for %d\n", p);
        for (int n = 0; n < 16; n++) grid_row(&grid, n, K, w + n * K);
        for (int i = 0; i < ROWS; i++)
            for (int n = 0; n < 16; n++) {
                double sum = 0.;
                for (int j = 0; j < K; j++)
                    sum += (double)w[n * K + j] * (p < 16 ? (double)d[i * GROUPS + j / 32] * q[i * K + j]
                                                          : (double)d256[i * SUPERS + j / 256] * q256[i * K + j]);
                ref[i * 16 + n] = (float)sum;
            }
        snprintf(name, sizeof name, "x8 reference %d", p);
        print(name, ref, ROWS * 16);
        for (int r = 0; r < 5; r++) {
            tile_x8(mts[r], part, (const uint8_t *)part->codes, (const void *)part->scales, K, in, out);
            snprintf(name, sizeof name, "x8 tile %d, %d rows", p, mts[r]);
            print(name, out, mts[r] * 16);
        }
    }
}

static void check_rows(void) {
    enum { H = 37, D = 40, INTER = 37 };
    float x[H], out[H], w[H], head[D], cos_row[D], sin_row[D], gate_up[2 * INTER], act[INTER];
    uint16_t wb[H], cb[D], sb[D];
    fill(x, H, 3.f), fill(w, H, 1.f), fill_bf16(wb, H, 1.f);
    for (int bf = 0; bf < 2; bf++) {
        rms_norm(x, bf ? (const void *)wb : (const void *)w, 1e-5f, H, bf, out);
        print(bf ? "rms_norm bf16" : "rms_norm f32", out, H);
        fill(head, D, 2.f), fill(cos_row, D, 1.f), fill(sin_row, D, 1.f), fill_bf16(cb, D, 1.f), fill_bf16(sb, D, 1.f);
        if (bf)
            for (int i = 0; i < D; i++) head[i] = rnd(head[i], 1);
        rope(head, bf ? (const void *)cb : (const void *)cos_row, bf ? (const void *)sb : (const void *)sin_row, D, bf);
        print(bf ? "rope bf16" : "rope f32", head, D);
        fill(gate_up, 2 * INTER, 30.f); /* exp of large values: overflow to inf, underflow to 0 */
        gate_up[3] = 200.f, gate_up[4] = -200.f;
        silu_mul(gate_up, INTER, bf, act);
        print(bf ? "silu bf16" : "silu f32", act, INTER);
        gate_up[5] = gate_up[INTER + 6] = NAN; /* (clamps keep a NaN) */
        swiglu_clamped_mul(gate_up, INTER, bf, 7.f, 1.702f, act);
        print(bf ? "clamped swiglu bf16" : "clamped swiglu f32", act, INTER);
    }
}

static void check_attention(void) {
    enum { HEADS = 6, KV = 2, D = 40, SEQ = 70, ROWS = 5, Q_SIZE = HEADS * D, QKV_N = Q_SIZE + 2 * KV * D };
    const int64_t group = HEADS / KV, q_size = Q_SIZE, qkv_n = QKV_N;
    static float kf[SEQ * D], vf[SEQ * D], q[HEADS * D], scores[MAX_BLOCK_QUERIES * (D + SEQ) + HEADS * SEQ];
    static uint16_t kb[SEQ * D], vb[SEQ * D];
    static float wide[ROWS * QKV_N], mid[ROWS * Q_SIZE], out[HEADS * D];
    fill(kf, SEQ * D, 1.f), fill(vf, SEQ * D, 1.f), fill_bf16(kb, SEQ * D, 1.f), fill_bf16(vb, SEQ * D, 1.f);
    for (int bf = 0; bf < 2; bf++) {
        Model md;
        memset(&md, 0, sizeof md);
        md.heads = HEADS, md.kv_heads = KV, md.head_dim = D, md.kv_pos = D, md.max_seq = SEQ, md.dtype = bf;
        fill(q, HEADS * D, 1.f);
        if (bf)
            for (int i = 0; i < HEADS * D; i++) q[i] = rnd(q[i], 1);
        const void *k = bf ? (const void *)kb : (const void *)kf, *v = bf ? (const void *)vb : (const void *)vf;
        attend(&md, q, group, k, v, 3, 61, NULL, scores, out); /* keys 3..60: a window, a tail of 13 */
        print(bf ? "attend bf16" : "attend f32", out, group * D);
        const float sinks[HEADS] = {0.5f, -3.f, 40.f, 1.f, -1.f, 0.f}; /* (40: a sink above every score) */
        attend(&md, q, group, k, v, 3, 61, sinks, scores, out);
        print(bf ? "attend bf16 sinks" : "attend f32 sinks", out, group * D);
        const int64_t positions[ROWS] = {50, 51, 52, 53, 54};
        fill(wide, ROWS * qkv_n, 1.f);
        if (bf)
            for (int i = 0; i < ROWS * qkv_n; i++) wide[i] = rnd(wide[i], 1);
        memset(mid, 0, sizeof mid);
        attend_prompt(&md, wide, qkv_n, q_size, 0, ROWS, 1, positions, NULL, 0, 20, k, v, NULL, scores, mid);
        print(bf ? "attend_prompt bf16" : "attend_prompt f32", mid, ROWS * q_size);
        memset(mid, 0, sizeof mid);
        attend_prompt(&md, wide, qkv_n, q_size, 0, ROWS, 1, positions, NULL, 0, 20, k, v, sinks + group, scores, mid);
        print(bf ? "attend_prompt bf16 sinks" : "attend_prompt f32 sinks", mid, ROWS * q_size);
        /* the same queries over a slot whose window rows start at position 16 (they read keys 31..54) */
        const int64_t es = bf ? 2 : 4;
        memset(mid, 0, sizeof mid);
        attend_prompt(&md, wide, qkv_n, q_size, 0, ROWS, 1, positions, NULL, 16, 20, (const char *)k + 16 * D * es,
                      (const char *)v + 16 * D * es, NULL, scores, mid);
        print(bf ? "attend_prompt bf16 based" : "attend_prompt f32 based", mid, ROWS * q_size);
        /* both ways: an input of 70 positions, keys less than 18 away on either side (the first
         * rows' window stops short of the input's end, the last rows' reaches it) */
        const int64_t ends[ROWS] = {SEQ, SEQ, SEQ, SEQ, SEQ};
        memset(mid, 0, sizeof mid);
        attend_prompt(&md, wide, qkv_n, q_size, 0, ROWS, 1, positions, ends, 0, 18, k, v, NULL, scores, mid);
        print(bf ? "attend_prompt bf16 both ways" : "attend_prompt f32 both ways", mid, ROWS * q_size);
    }
}

static void check_argmax(void) {
    enum { VOCAB = 1001, ROWS = 3 };
    static float logits[ROWS * VOCAB];
    for (int i = 0; i < ROWS * VOCAB; i++) logits[i] = (float)(int)(uniform() * 20.f); /* many ties */
    logits[VOCAB + 500] = NAN;
    logits[2 * VOCAB + VOCAB - 1] = 100.f; /* the maximum in the tail */
    int64_t ids[ROWS];
    flover_argmax(logits, ROWS, VOCAB, VOCAB, 0, ids, 1);
    float as_float[ROWS];
    for (int r = 0; r < ROWS; r++) as_float[r] = (float)ids[r];
    print("argmax", as_float, ROWS);
}

int main(void) {
    printf("# kernels: %s\n", flover_kernels());
    check_tiles();
    check_q4();
    check_q8_groups();
    check_q4_k();
    check_x8();
    check_rows();
    check_attention();
    check_argmax();
    return 0;
}
