/* Q4_K's int8 tiles on inputs in blocks of 32 against blocks of 256 (tiles_int8.c's x8_block), one
 * thread, paired: each round times one pass of the projection with each, back to back, and the
 * ratio of the pair is kept (a shared machine's speed drifts between rounds, not within a pair).
 * Built and run by scripts/bench/bench_tile_blocks.py:
 *
 *     tile_blocks ROWS N K ROUNDS   ->   "rows N K: 256 / 32 time median q1 q3"
 *
 * The codes and scales are random (their values do not change the instructions run). */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "native.h"

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

static int by_value(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double pass(const GridPart *part, int64_t k, const Int8Rows *x, int rows, float *y) {
    const double start = now();
    blocks_x8(part, 0, part->rows / 16, k, x, rows, 0, y, part->rows, 0); /* (the engine's panels above 8 rows) */
    return now() - start;
}

int main(int argc, char **argv) {
    if (argc != 5) return fprintf(stderr, "usage: tile_blocks ROWS N K ROUNDS\n"), 2;
    const int rows = atoi(argv[1]), rounds = atoi(argv[4]);
    const int64_t n = atol(argv[2]), k = atol(argv[3]);
    if (rows < 1 || rounds < 1 || n % 16 || k % 256) return fprintf(stderr, "N: 16s, K: 256s\n"), 2;
    uint8_t *codes = malloc(n * k / 2), *scales = malloc(n / 16 * (k / 256) * Q4K_SUPER_BYTES);
    /* the inputs' scratch as a projection lays it out (int8_rows_at): codes, then 3 floats per 32 */
    int8_t *xb = calloc(rows * k + rows * (k / 32) * 3 * sizeof(float), 1);
    float *xsum = calloc(rows * k / 16, sizeof(float));
    float *y = malloc(rows * n * sizeof(float));
    double *ratio = malloc(rounds * sizeof(double));
    for (int64_t i = 0; i < n * k / 2; i++) codes[i] = (uint8_t)rand();
    for (int64_t s = 0; s < n / 16 * (k / 256); s++) {
        float *f = (float *)(scales + s * Q4K_SUPER_BYTES);
        for (int i = 0; i < 32; i++) f[i] = 0.001f * (1 + rand() % 100) * (i < 16 ? 1 : -1);
        for (int i = 128; i < Q4K_SUPER_BYTES; i++) scales[s * Q4K_SUPER_BYTES + i] = (uint8_t)(rand() & 63);
    }
    for (int64_t i = 0; i < rows * k; i++) xb[i] = (int8_t)(rand() % 255 - 127);
    const GridPart part = {G_INT4_K, n, 32, 1, (int64_t)codes, (int64_t)scales, 1, 8};
    const Int8Rows x32 = int8_rows_at(xb, xsum, rows, k, 32), x256 = int8_rows_at(xb, xsum, rows, k, 256);
    for (int64_t i = 0; i < rows * k / 32; i++) ((float *)x32.d)[i] = 0.01f; /* (x256's d: its first floats) */
    pass(&part, k, &x32, rows, y), pass(&part, k, &x256, rows, y); /* (warm) */
    for (int r = 0; r < rounds; r++) {
        const double a = pass(&part, k, &x32, rows, y);
        ratio[r] = pass(&part, k, &x256, rows, y) / a;
    }
    qsort(ratio, rounds, sizeof(double), by_value);
    printf("%d rows, %ld x %ld: 256 / 32 time median %.3f, quartiles %.3f %.3f\n", rows, (long)n, (long)k,
           ratio[rounds / 2], ratio[rounds / 4], ratio[3 * rounds / 4]);
    free(codes), free(scales), free(xb), free(xsum), free(y), free(ratio);
    return 0;
}
