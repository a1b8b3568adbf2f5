/* One fused iteration of a Llama-family model in one native call (CPU; under tensor parallelism
 * one rank's shard): decode tokens and prompt chunks alike, each token a row with its own slot
 * and position.
 *
 * In eager PyTorch an iteration is ~1,000 operations (norms, RoPE, KV writes, residuals, the
 * decode attention's casts and masks): ~8 ms a token for SmolLM2-135M on 2 cores, as much as
 * reading its weights. Here each projection is one pass over a blocked weight layout (see
 * "projections": one row streams the weights at the read bandwidth, many rows share each load),
 * and everything else is a few AVX-512 loops per row; attention runs per (row, kv head) over the
 * row's own slot and length, so no padding to the longest sequence.
 *
 * Rounding follows the PyTorch path (flover/models/llama.py) step by step: in bfloat16 every
 * intermediate that PyTorch rounds to bfloat16 is rounded here at the same point (RNE), and
 * accumulations are float32 as in oneDNN, so the two paths differ only by summation order (and
 * exp, here a polynomial within float32's rounding).
 *
 * Built by flover/native/forward.py with the system C compiler (-O3 -march=native -fopenmp) into
 * a cache directory and loaded with ctypes; it shares PyTorch's OpenMP runtime (same soname).
 * Without AVX-512 it compiles to portable loops (correct, slow).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

enum { DT_F32 = 0, DT_BF16 = 1 };

/* Mirrors MODEL_FIELDS in flover/native/forward.py: int64 fields, pointers as addresses. */
typedef struct {
    int64_t layers, hidden, heads, kv_heads, head_dim, inter, vocab, dtype, max_seq;
    int64_t kv, kv_layer, kv_kind, kv_slot, kv_head, kv_pos; /* KV base address, strides in elements */
    int64_t embed, final_norm, head, head_scales, cos, sin;   /* head_scales: int8 head (else 0);
                                                                 rotary tables [max_seq, head_dim] */
    int64_t quant; /* the layers' *_codes: 4 (int4 kernels), 8 (int8), 0 (none) */
    /* Tensor parallelism: this rank's vocabulary block starts at vocab_start (embed and head hold
     * `vocab` rows of it), and all_reduce (a void (*)(float *, int64_t) address; 0 at TP=1) sums
     * a float buffer over the ranks in place, as the PyTorch path's all-reduces do. */
    int64_t vocab_start, all_reduce;
    /* greedy through a screen of the head (see there): its copy (float32 models: bfloat16,
     * blocked as bfloat16's pairs; bfloat16 models: int8 codes, blocked so, and row scales) and
     * each vocabulary row's bound factor (float32); else 0 */
    int64_t head_screen, head_screen_scales, head_bounds;
    /* the screen takes up to this many greedy rows (float32 models: every row count); more take
     * the whole head, their argmax found as its tiles come out (head_greedy) */
    int64_t screen_rows;
} Model;


/* Mirrors LAYER_FIELDS: weight addresses of one layer, 0 where the model has no such bias; the
 * layer's sliding window (0: none); with --quantization int4 the projections' 4-bit codes and
 * group scales (see "4-bit projections"), with int8 their blocked codes and row scales (see
 * "int8 weights"), else 0. */
typedef struct {
    int64_t input_norm, qkv, qkv_bias, o, o_bias, post_norm, gate_up, gate_up_bias, down, down_bias, window;
    int64_t qkv_codes, qkv_scales, o_codes, o_scales, gate_up_codes, gate_up_scales, down_codes, down_scales;
} Layer;

/* ---- bfloat16 <-> float ------------------------------------------------------------------ */
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

/* The value a PyTorch op of the model's dtype would store. */
static inline float rnd(float f, int bf) { return bf ? bf2f(f2bf(f)) : f; }

static inline float load(const void *p, int64_t i, int bf) {
    return bf ? bf2f(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store(void *p, int64_t i, float f, int bf) {
    if (bf) ((uint16_t *)p)[i] = f2bf(f);
    else ((float *)p)[i] = f;
}

/* ---- 16 lanes at a time (AVX-512) ------------------------------------------------------------ */
#if defined(__AVX512F__)
static inline __mmask16 lanes(int64_t left) { return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u); }

static inline __m512 vload(const void *p, int64_t i, int bf, __mmask16 m) {
    if (bf)
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, (const uint16_t *)p + i)), 16));
    return _mm512_maskz_loadu_ps(m, (const float *)p + i);
}

/* rnd() on 16 lanes, by the same integer rounding (NaN stays NaN). */
static inline __m512 vrnd(__m512 v, int bf) {
    if (!bf) return v;
    const __m512i u = _mm512_castps_si512(v), high = _mm512_set1_epi32((int)0xffff0000u);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_and_si512(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), high);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_and_si512(_mm512_or_si512(u, _mm512_set1_epi32(0x400000)), high));
    return _mm512_castsi512_ps(r);
}

/* Store lanes holding model-dtype values (bf16: already rounded, so truncation is exact). */
static inline void vstore(void *p, int64_t i, __m512 v, int bf, __mmask16 m) {
    if (bf)
        _mm256_mask_storeu_epi16((uint16_t *)p + i, m,
                                 _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16)));
    else _mm512_mask_storeu_ps((float *)p + i, m, v);
}

/* exp: x = n ln2 + r, |r| <= ln2 / 2, e^r by its Taylor series to r^7 (below float's rounding),
 * times 2^n by scalef (which also gives 0 and inf beyond float's range). */
static inline __m512 vexp(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-104.f), x); /* e^-104 is 0 in float; -inf gives 0, NaN stays */
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.f / 5040.f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

/* v[0..15] -> one vector of their 16 horizontal sums, in order: a transpose-and-add tree (45
 * operations instead of 16 separate reductions of ~8). */
static inline __m512 sum_each(const __m512 v[16]) {
    __m512 quad[4];
    for (int q = 0; q < 4; q++) { /* keys 4q..4q+3 -> per 128-bit lane: [a, b, c, d] lane sums */
        const __m512 *x = v + 4 * q;
        const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(x[0], x[1]), _mm512_unpackhi_ps(x[0], x[1]));
        const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(x[2], x[3]), _mm512_unpackhi_ps(x[2], x[3]));
        quad[q] = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xEE));
    }
    const __m512 y01 = _mm512_add_ps(_mm512_shuffle_f32x4(quad[0], quad[1], 0x44), _mm512_shuffle_f32x4(quad[0], quad[1], 0xEE));
    const __m512 y23 = _mm512_add_ps(_mm512_shuffle_f32x4(quad[2], quad[3], 0x44), _mm512_shuffle_f32x4(quad[2], quad[3], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(y01, y23, 0x88), _mm512_shuffle_f32x4(y01, y23, 0xDD));
}
#endif

/* ---- projections: y[m, n] = W[n, :] . x[m, :] ----------------------------------------------
 * Weights come blocked by flover/native/forward.py (`block_weight`): 16 output rows at a time,
 * interleaved so that one 64-byte load holds all 16 rows' weights for the next input step.
 * bfloat16: [n / 16][k / 2][16][2] (pairs of inputs: the operand of AVX-512 BF16's dot-product
 * instruction); float32: [n / 16][k][16]. n is padded to whole blocks with zero rows. A tile
 * multiplies MT input rows by NT blocks with MT x NT accumulators of 16 outputs each (up to 6 x 4:
 * 24 of the 32 vector registers), so each weight load serves MT rows and no horizontal sums are
 * needed (6 x 4 beat 8 x 2, 8 x 3 and 12 x 2 by 4-7% on the dev machine, at 8 to 256 rows).
 * Every output is summed in the same order (input by input, one accumulator) whatever the tile:
 * a row's result does not depend on which other rows share its iteration, so fusing requests
 * changes no bit of any of them. */
#define TILES_OF_ROWS(TILE, MT) TILE(MT, 4) TILE(MT, 3) TILE(MT, 2) TILE(MT, 1)
#if defined(__AVX512BF16__)
#define PAIR(x, kp) ((__m512bh)_mm512_set1_epi32(((const int32_t *)(x))[kp]))
/* A tile over weights blocked in input pairs; LOAD(w, kp): block w's 16 rows at input pair kp
 * as bfloat16 pairs (bfloat16 weights: one load; int8: widened, see "int8 weights"). */
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
/* pf: 0, or a weight stream to ask the cache for meanwhile, 64 bytes per input pair */
#define TILE_PAIRS(KIND, WTYPE, LOAD, MT, NT)                                                              \
    static void tile_##KIND##_##MT##_##NT(const WTYPE *w, int64_t k, const uint16_t *x, float *out,       \
                                          const char *pf) {                                                \
        __m512 acc[MT][NT];                                                                                \
        for (int i = 0; i < MT; i++)                                                                       \
            for (int j = 0; j < NT; j++) acc[i][j] = _mm512_setzero_ps();                                  \
        if (pf) PAIRS_LOOP(LOAD, MT, NT, _mm_prefetch(pf + kp * 64, _MM_HINT_T0))                         \
        else PAIRS_LOOP(LOAD, MT, NT, (void)0)                                                             \
        for (int i = 0; i < MT; i++)                                                                       \
            for (int j = 0; j < NT; j++) _mm512_storeu_ps(out + (i * NT + j) * 16, acc[i][j]);            \
    }
#define LOAD_BF16(w, kp) ((__m512bh)_mm512_loadu_si512((w) + (kp) * 32))
#define TILE_BF16(MT, NT) TILE_PAIRS(bf16, uint16_t, LOAD_BF16, MT, NT)
TILES_OF_ROWS(TILE_BF16, 6)
TILES_OF_ROWS(TILE_BF16, 4)
TILES_OF_ROWS(TILE_BF16, 2)
TILES_OF_ROWS(TILE_BF16, 1)

/* int8 weights (--quantization int8: w = scale[n] * q, q in -127..127, one scale per output
 * row), blocked as bfloat16's pairs but a byte each: [n / 16][k / 2][16][2]. 32 codes widen to
 * floats and narrow to bfloat16 (exact: 8 bits) for the same dot-product instruction; the
 * scale multiplies the sum (project). */
static inline __m512bh q8_pairs(const int8_t *codes) {
    const __m256i c = _mm256_loadu_si256((const __m256i *)codes);
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(c)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(c, 1)));
    return _mm512_cvtne2ps_pbh(hi, lo);
}
#define LOAD_Q8(w, kp) q8_pairs((w) + (kp) * 32)
#define TILE_Q8(MT, NT) TILE_PAIRS(q8, int8_t, LOAD_Q8, MT, NT)
TILES_OF_ROWS(TILE_Q8, 6)
TILES_OF_ROWS(TILE_Q8, 4)
TILES_OF_ROWS(TILE_Q8, 2)
TILES_OF_ROWS(TILE_Q8, 1)

#endif

#if defined(__AVX512F__)
#define F32_LOOP(MT, NT, PREFETCH)                                                                         \
    for (int64_t kk = 0; kk < k; kk++) {                                                                   \
        PREFETCH;                                                                                          \
        __m512 wv[NT];                                                                                     \
        for (int j = 0; j < NT; j++) wv[j] = _mm512_loadu_ps(w + j * 16 * k + kk * 16);                   \
        for (int i = 0; i < MT; i++) {                                                                     \
            const __m512 xv = _mm512_set1_ps(x[i * k + kk]);                                               \
            for (int j = 0; j < NT; j++) acc[i][j] = _mm512_fmadd_ps(wv[j], xv, acc[i][j]);                \
        }                                                                                                  \
    }
/* pf: as in TILE_PAIRS, 64 bytes per input */
#define TILE_F32(MT, NT)                                                                                   \
    static void tile_f32_##MT##_##NT(const float *w, int64_t k, const float *x, float *out,               \
                                     const char *pf) {                                                     \
        __m512 acc[MT][NT];                                                                                \
        for (int i = 0; i < MT; i++)                                                                       \
            for (int j = 0; j < NT; j++) acc[i][j] = _mm512_setzero_ps();                                  \
        if (pf) F32_LOOP(MT, NT, _mm_prefetch(pf + kk * 64, _MM_HINT_T0))                                 \
        else F32_LOOP(MT, NT, (void)0)                                                                     \
        for (int i = 0; i < MT; i++)                                                                       \
            for (int j = 0; j < NT; j++) _mm512_storeu_ps(out + (i * NT + j) * 16, acc[i][j]);            \
    }
TILES_OF_ROWS(TILE_F32, 6)
TILES_OF_ROWS(TILE_F32, 4)
TILES_OF_ROWS(TILE_F32, 2)
TILES_OF_ROWS(TILE_F32, 1)

#endif

/* What a projection's weights are: the model dtype's values, or int8 codes (inputs bfloat16). */
enum { W_F32 = DT_F32, W_BF16 = DT_BF16, W_Q8 = 2 };

static inline int64_t weight_bytes(int kind) { return kind == W_Q8 ? 1 : kind == W_BF16 ? 2 : 4; }

/* Portable fallback (no AVX-512): MT rows times NT blocks, plain loops. */
static void tile_any(const void *w, int64_t k, const void *x, int mt, int nt_blocks, int kind, float *out) {
    const int bf = kind != W_F32; /* the inputs' dtype */
    for (int i = 0; i < mt; i++)
        for (int j = 0; j < nt_blocks; j++)
            for (int lane = 0; lane < 16; lane++) {
                float s = 0.f;
                for (int64_t kk = 0; kk < k; kk++) {
                    const int64_t at = bf ? j * 16 * k + (kk / 2) * 32 + lane * 2 + kk % 2 : j * 16 * k + kk * 16 + lane;
                    const float wv = kind == W_Q8 ? (float)((const int8_t *)w)[at] : load(w, at, bf);
                    s += wv * load(x, i * k + kk, bf);
                }
                out[(i * nt_blocks + j) * 16 + lane] = s;
            }
}

/* MT rows x NT blocks starting at block nb, row m0; out: [MT][NT][16] floats. kind: W_*. */
static void tile(const void *w, int64_t nb, int64_t k, const void *x, int64_t m0, int mt, int nt_blocks, int kind,
                 float *out, const char *pf) {
    const int bf = kind != W_F32;
    const int64_t es = weight_bytes(kind), xs = bf ? 2 : 4;
    const char *wb = (const char *)w + nb * 16 * k * es, *xr = (const char *)x + m0 * k * xs;
#define CALL(KIND, TYPE, MT, NT)                                                                           \
    if (mt == MT && nt_blocks == NT) return tile_##KIND##_##MT##_##NT((const TYPE *)wb, k, (const void *)xr, out, pf);
#define CALLS(KIND, TYPE, MT) CALL(KIND, TYPE, MT, 4) CALL(KIND, TYPE, MT, 3) CALL(KIND, TYPE, MT, 2) CALL(KIND, TYPE, MT, 1)
#if defined(__AVX512BF16__)
    if (kind == W_BF16) {
        CALLS(bf16, uint16_t, 6) CALLS(bf16, uint16_t, 4) CALLS(bf16, uint16_t, 2) CALLS(bf16, uint16_t, 1)
    }
    if (kind == W_Q8) {
        CALLS(q8, int8_t, 6) CALLS(q8, int8_t, 4) CALLS(q8, int8_t, 2) CALLS(q8, int8_t, 1)
    }
#endif
#if defined(__AVX512F__)
    if (kind == W_F32) {
        CALLS(f32, float, 6) CALLS(f32, float, 4) CALLS(f32, float, 2) CALLS(f32, float, 1)
    }
#endif
#undef CALL
#undef CALLS
    tile_any(wb, k, xr, mt, nt_blocks, kind, out);
}

/* x (float values of the model dtype) -> the model dtype: the kernels' operand. Exact. */
static void to_model_dtype(const float *x, void *dst, int64_t n, int bf) {
    if (!bf) {
        memcpy(dst, x, n * sizeof(float));
        return;
    }
#if defined(__AVX512F__)
    for (int64_t i = 0; i < n; i += 16) vstore(dst, i, _mm512_maskz_loadu_ps(lanes(n - i), x + i), 1, lanes(n - i));
#else
    for (int64_t i = 0; i < n; i++) ((uint16_t *)dst)[i] = f2bf(x[i]);
#endif
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
#if defined(__AVX512F__)
    const __mmask16 m = lanes(n_out - n0);
    __m512 v = _mm512_loadu_ps(acc);
    if (bias) v = _mm512_add_ps(v, vload(bias, n0, bf, m));
    v = vrnd(v, bf);
    if (in_model_dtype) vstore(y, at + n0, v, bf, m);
    else _mm512_mask_storeu_ps((float *)y + at + n0, m, v);
#else
    for (int64_t lane = 0; lane < 16 && n0 + lane < n_out; lane++) {
        const float v = rnd(acc[lane] + (bias ? load(bias, n0 + lane, bf) : 0.f), bf);
        if (in_model_dtype) store(y, at + n0 + lane, v, bf);
        else ((float *)y)[at + n0 + lane] = v;
    }
#endif
}

/* Greedy ids straight from the head's tiles (head_greedy): each thread's running maximum of
 * each of its rows, [nt][rows] each: the largest value, its first index (-1: none above -inf),
 * the first NaN (-1: none). */
typedef struct {
    float *top;
    int64_t *at, *nan_at;
} RowMax;

/* 16 outputs of a tile (as store_outputs: lanes of outputs n0..n0+15 below n_out, rnd(acc +
 * bias)) into one row's per-lane running maximum: `best` [16] the largest value of each lane,
 * `where` [16] the index where it was first seen (strictly larger values replace: this thread's
 * blocks come in order), `first_nan` the row's first NaN. */
static inline void keep_max(const float *acc, const void *bias, int64_t n0, int64_t n_out, int bf, float *best,
                            int32_t *where, int64_t *first_nan) {
#if defined(__AVX512F__)
    const __mmask16 m = lanes(n_out - n0);
    __m512 v = _mm512_loadu_ps(acc);
    if (bias) v = _mm512_add_ps(v, vload(bias, n0, bf, m));
    v = vrnd(v, bf);
    const __mmask16 nan = _mm512_mask_cmp_ps_mask(m, v, v, _CMP_UNORD_Q);
    if (nan && *first_nan < 0) *first_nan = n0 + __builtin_ctz(nan);
    const __m512 top = _mm512_loadu_ps(best);
    const __mmask16 larger = _mm512_mask_cmp_ps_mask(m, v, top, _CMP_GT_OQ);
    _mm512_storeu_ps(best, _mm512_mask_mov_ps(top, larger, v));
    const __m512i index = _mm512_add_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32((int)n0));
    _mm512_storeu_si512(where, _mm512_mask_mov_epi32(_mm512_loadu_si512(where), larger, index));
#else
    for (int64_t lane = 0; lane < 16 && n0 + lane < n_out; lane++) {
        const float v = rnd(acc[lane] + (bias ? load(bias, n0 + lane, bf) : 0.f), bf);
        if (v != v && *first_nan < 0) *first_nan = n0 + lane;
        if (v > best[lane]) best[lane] = v, where[lane] = (int32_t)(n0 + lane);
    }
#endif
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

/* ---- 4-bit projections (--quantization int4) ------------------------------------------------
 * Weights on the grid w = scale * (q - 8) + zero, q in 0..15, per group of 32 inputs (GGUF's
 * Q4_1, as flover/models/quant.py makes them). Blocked by flover/native/forward.py: per block of
 * 16 output rows and group, 16 input pairs x 16 rows bytes (low nibble: the even input, high: the
 * odd one), then the group's 16 scales and 16 zeros in bfloat16. A byte becomes a bfloat16 pair
 * (q - 8 is exact) by one table lookup, and the group's sum is
 * scale * sum((q - 8) x) + zero * sum(x). Used at every row count: one row reads a quarter of
 * bfloat16's bytes (SmolLM2: 4.6 ms a token against 9), 32 rows run as fast as the bfloat16 tiles
 * on the dequantized weights (34 ms), 512 prompt rows 16% slower; and as with the other tiles a
 * row's result does not depend on the rest of its iteration. */
#if defined(__AVX512BF16__)
/* bfloat16 of q - 8 for q = 0..15 (twice: the lookup takes 5-bit indices) */
static const uint16_t Q4_VALUES[32] = {0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80,
                                       0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
                                       0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80,
                                       0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0};
#define TILE_Q4(MT)                                                                                        \
    static void tile_q4_##MT(const uint8_t *codes, const uint16_t *scales, int64_t k, const uint16_t *x,  \
                             const float *xsum, float *out) {                                              \
        const int64_t groups = k / 32;                                                                     \
        const __m512i lut = _mm512_loadu_si512(Q4_VALUES);                                                 \
        __m512 acc[MT];                                                                                    \
        for (int i = 0; i < MT; i++) acc[i] = _mm512_setzero_ps();                                         \
        for (int64_t g = 0; g < groups; g++) {                                                             \
            __m512 part[MT];                                                                               \
            for (int i = 0; i < MT; i++) part[i] = _mm512_setzero_ps();                                    \
            const uint8_t *c = codes + g * 256;                                                            \
            for (int kp = 0; kp < 16; kp++) {                                                              \
                const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(c + kp * 16)));  \
                const __m512i pair = _mm512_or_si512(_mm512_and_si512(d, _mm512_set1_epi32(0x0f)),        \
                                     _mm512_and_si512(_mm512_slli_epi32(d, 12), _mm512_set1_epi32(0xf0000))); \
                const __m512bh w = (__m512bh)_mm512_permutexvar_epi16(pair, lut);                        \
                for (int i = 0; i < MT; i++) part[i] = _mm512_dpbf16_ps(part[i], w, PAIR(x + i * k, g * 16 + kp)); \
            }                                                                                              \
            const __m512 scale = vload(scales + g * 32, 0, 1, 0xffff), zero = vload(scales + g * 32 + 16, 0, 1, 0xffff); \
            for (int i = 0; i < MT; i++)                                                                   \
                acc[i] = _mm512_fmadd_ps(scale, part[i],                                                  \
                                         _mm512_fmadd_ps(zero, _mm512_set1_ps(xsum[i * groups + g]), acc[i])); \
        }                                                                                                  \
        for (int i = 0; i < MT; i++) _mm512_storeu_ps(out + i * 16, acc[i]);                               \
    }
TILE_Q4(12)
TILE_Q4(8)
TILE_Q4(4)
TILE_Q4(2)
TILE_Q4(1)
#endif

/* y = x W^T (+ bias) through the 4-bit weights; x: float rows [rows, k] of bfloat16 values. */
static void project_int4(int64_t codes_addr, int64_t scales_addr, int64_t b_addr, const float *x,
                         void *xb, float *xsum, int rows, int64_t n_out, int64_t k, void *y, int y_in_model_dtype,
                         int nt) {
#if defined(__AVX512BF16__)
    const int64_t groups = k / 32;
    const uint8_t *codes = (const uint8_t *)codes_addr;
    const uint16_t *scales = (const uint16_t *)scales_addr;
    const void *bias = (const void *)b_addr;
    const int64_t blocks = (n_out + 15) / 16;
#pragma omp parallel num_threads(nt)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        operand_rows(x, xb, rows, k, 1, t, T);
        for (int m = rows * t / T; m < rows * (t + 1) / T; m++) /* each group's input sum, once per row */
            for (int64_t g = 0; g < groups; g++) {
                __m512 a = _mm512_add_ps(_mm512_loadu_ps(x + m * k + g * 32), _mm512_loadu_ps(x + m * k + g * 32 + 16));
                xsum[m * groups + g] = _mm512_reduce_add_ps(a);
            }
#pragma omp barrier
        const int64_t b0 = blocks * t / T, b1 = blocks * (t + 1) / T;
        float out[12 * 16];
        for (int64_t nb = b0; nb < b1; nb++) {
            const uint8_t *c = codes + nb * 16 * k / 2;
            const uint16_t *sc = scales + nb * groups * 32;
            for (int m0 = 0; m0 < rows;) {
                const int left = rows - m0;
                const int mt = left >= 12 ? 12 : left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
                const uint16_t *xr = (const uint16_t *)xb + m0 * k;
                const float *xs = xsum + m0 * groups;
                if (mt == 12) tile_q4_12(c, sc, k, xr, xs, out);
                else if (mt == 8) tile_q4_8(c, sc, k, xr, xs, out);
                else if (mt == 4) tile_q4_4(c, sc, k, xr, xs, out);
                else if (mt == 2) tile_q4_2(c, sc, k, xr, xs, out);
                else tile_q4_1(c, sc, k, xr, xs, out);
                for (int i = 0; i < mt; i++)
                    store_outputs(out + i * 16, bias, nb * 16, n_out, y, (m0 + i) * n_out, y_in_model_dtype, 1);
                m0 += mt;
            }
        }
    }
#else
    (void)codes_addr; (void)scales_addr; (void)b_addr; (void)x; (void)xb; (void)xsum; (void)rows;
    (void)n_out; (void)k; (void)y; (void)y_in_model_dtype; (void)nt;
#endif
}

/* y[m, n] = rnd(W[n, :] . x[m, :] + bias[n]) for m < rows, n < n_out. x: float rows [rows, k]
 * holding model-dtype values; xb: scratch for their model-dtype copy (the kernels' operand).
 * With `scales_addr` (int8: float32 [blocks * 16]) W holds int8 codes and W[n, :] is
 * scales[n] * codes[n, :]. Threads split the weight blocks: each reads its share of the weight
 * once (from memory) and the rows' tiles again from its cache. */
static void project_kind(int kind, int bf, int64_t w_addr, int64_t scales_addr, int64_t b_addr, const float *x,
                         void *xb, int rows, int64_t n_out, int64_t k, void *y, int y_in_model_dtype, int nt,
                         RowMax *most);

static void project(const Model *md, int64_t w_addr, int64_t scales_addr, int64_t b_addr, const float *x, void *xb,
                    int rows, int64_t n_out, int64_t k, void *y, int y_in_model_dtype, int nt) {
    const int bf = md->dtype == DT_BF16;
    project_kind(scales_addr ? W_Q8 : bf, bf, w_addr, scales_addr, b_addr, x, xb, rows, n_out, k, y, y_in_model_dtype,
                 nt, 0);
}

/* project() through weights of `kind`, outputs rounded (and stored) as bfloat16 if bf; x NULL:
 * xb already holds the operand. `most`: nothing is stored; each thread keeps its running
 * maximum of every row there instead (keep_max). */
static void project_kind(int kind, int bf, int64_t w_addr, int64_t scales_addr, int64_t b_addr, const float *x,
                         void *xb, int rows, int64_t n_out, int64_t k, void *y, int y_in_model_dtype, int nt,
                         RowMax *most) {
    const float *scales = (const float *)scales_addr;
    const void *w = (const void *)w_addr, *bias = (const void *)b_addr;
    const int64_t blocks = (n_out + 15) / 16;
#pragma omp parallel num_threads(nt)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        if (x) operand_rows(x, xb, rows, k, kind != W_F32, t, T);
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
            const int nt_blocks = b1 - nb >= 4 ? 4 : (int)(b1 - nb);
            for (int m0 = 0, tiles = 0; m0 < rows; tiles++) {
                const int left = rows - m0, mt = left >= 6 ? 6 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
                /* the first row tile of these blocks reads them from memory, the others from cache:
                 * with a few row tiles (decode), those ask for the next blocks' weights, a block each */
                const int64_t next = nb + nt_blocks + tiles - 1;
                const char *pf =
                    rows <= 64 && tiles > 0 && tiles <= 4 && next < b1 ? (const char *)w + next * 16 * k * es : 0;
                tile(w, nb, k, xb, m0, mt, nt_blocks, kind, out, pf);
                for (int j = 0; j < nt_blocks; j++) {
                    const int64_t n0 = (nb + j) * 16;
                    for (int i = 0; i < mt; i++) {
                        float *acc = out + (i * nt_blocks + j) * 16;
                        if (scales)
                            for (int lane = 0; lane < 16; lane++) acc[lane] *= scales[n0 + lane];
                        if (most)
                            keep_max(acc, bias, n0, n_out, bf, best + (m0 + i) * 16, where + (m0 + i) * 16,
                                     first_nan + m0 + i);
                        else
                            store_outputs(acc, bias, n0, n_out, y, (m0 + i) * n_out, y_in_model_dtype, bf);
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

/* ---- elementwise steps over one row -------------------------------------------------------- */
/* RMSNorm as flover's rms_norm: float32 inside; in bfloat16 normalised, rounded, then scaled
 * and rounded again (weight * F.rms_norm(x)); in float32 x * rstd * weight. */
static void rms_norm(const float *x, const void *weight, float eps, int64_t h, int bf, float *out) {
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < h; i += 16) {
        const __m512 v = _mm512_maskz_loadu_ps(lanes(h - i), x + i);
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    const float rstd = 1.f / sqrtf(_mm512_reduce_add_ps(acc) / (float)h + eps);
    const __m512 r = _mm512_set1_ps(rstd);
    for (int64_t i = 0; i < h; i += 16) {
        const __mmask16 m = lanes(h - i);
        const __m512 w = vload(weight, i, bf, m), v = _mm512_maskz_loadu_ps(m, x + i);
        _mm512_mask_storeu_ps(out + i, m, bf ? vrnd(_mm512_mul_ps(w, vrnd(_mm512_mul_ps(v, r), 1)), 1)
                                             : _mm512_mul_ps(_mm512_mul_ps(v, r), w));
    }
#else
    float ss = 0.f;
    for (int64_t i = 0; i < h; i++) ss += x[i] * x[i];
    const float rstd = 1.f / sqrtf(ss / (float)h + eps);
    for (int64_t i = 0; i < h; i++) {
        const float w = load(weight, i, bf);
        out[i] = bf ? rnd(w * rnd(x[i] * rstd, 1), 1) : x[i] * rstd * w;
    }
#endif
}

/* Rotate one head in place: x * cos + roll(x, d / 2) * sin_signed (the sign folded into the
 * table, as flover's Rotary), rounded as PyTorch's mul then addcmul. */
static void rope(float *x, const void *cos_row, const void *sin_row, int64_t d, int bf) {
    const int64_t half = d / 2;
#if defined(__AVX512F__)
    if (half % 16 == 0) {
        for (int64_t i = 0; i < half; i += 16) {
            const __m512 lo = _mm512_loadu_ps(x + i), hi = _mm512_loadu_ps(x + half + i);
            const __m512 new_lo = vrnd(_mm512_fmadd_ps(hi, vload(sin_row, i, bf, 0xffff),
                                                       vrnd(_mm512_mul_ps(lo, vload(cos_row, i, bf, 0xffff)), bf)), bf);
            const __m512 new_hi = vrnd(_mm512_fmadd_ps(lo, vload(sin_row, half + i, bf, 0xffff),
                                                       vrnd(_mm512_mul_ps(hi, vload(cos_row, half + i, bf, 0xffff)), bf)), bf);
            _mm512_storeu_ps(x + i, new_lo);
            _mm512_storeu_ps(x + half + i, new_hi);
        }
        return;
    }
#endif
    float rolled[512];
    for (int64_t i = 0; i < d; i++) rolled[i] = x[i < half ? i + half : i - half];
    for (int64_t i = 0; i < d; i++)
        x[i] = rnd(rnd(x[i] * load(cos_row, i, bf), bf) + rolled[i] * load(sin_row, i, bf), bf);
}

/* hidden += rnd(out + bias): a residual add after a row-parallel projection. */
static void add_residual(float *hidden, const float *out, const void *bias, int64_t h, int bf) {
#if defined(__AVX512F__)
    for (int64_t i = 0; i < h; i += 16) {
        const __mmask16 m = lanes(h - i);
        __m512 o = _mm512_maskz_loadu_ps(m, out + i);
        if (bias) o = vrnd(_mm512_add_ps(o, vload(bias, i, bf, m)), bf);
        _mm512_mask_storeu_ps(hidden + i, m, vrnd(_mm512_add_ps(_mm512_maskz_loadu_ps(m, hidden + i), o), bf));
    }
#else
    for (int64_t i = 0; i < h; i++) {
        float o = out[i];
        if (bias) o = rnd(o + load(bias, i, bf), bf);
        hidden[i] = rnd(hidden[i] + o, bf);
    }
#endif
}

/* out = rnd(rnd(silu(gate)) * up) over gate_up = [gate | up], as F.silu then the product. */
/* hidden += out (+ bias) for every row, then (unless norm is 0) normed = rms_norm(hidden): in one
 * pass per row (out is read before normed overwrites it: they may be the same rows). */
static void residual_and_norm(float *hidden, float *out, int rows, int64_t bias, int64_t norm, float eps, int64_t h,
                              int bf, int nt) {
#pragma omp parallel for num_threads(nt) schedule(static) if (rows >= 16)
    for (int r = 0; r < rows; r++) {
        add_residual(hidden + r * h, out + r * h, (const void *)bias, h, bf);
        if (norm) rms_norm(hidden + r * h, (const void *)norm, eps, h, bf, out + r * h);
    }
}

static void silu_mul(const float *gate_up, int64_t inter, int bf, float *out) {
    const float *up = gate_up + inter;
#if defined(__AVX512F__)
    for (int64_t i = 0; i < inter; i += 16) {
        const __mmask16 m = lanes(inter - i);
        const __m512 g = _mm512_maskz_loadu_ps(m, gate_up + i);
        const __m512 act = vrnd(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), vexp(_mm512_sub_ps(_mm512_setzero_ps(), g)))), bf);
        _mm512_mask_storeu_ps(out + i, m, vrnd(_mm512_mul_ps(act, _mm512_maskz_loadu_ps(m, up + i)), bf));
    }
#else
    for (int64_t i = 0; i < inter; i++) out[i] = rnd(rnd(gate_up[i] / (1.f + expf(-gate_up[i])), bf) * up[i], bf);
#endif
}

/* ---- attention of one kv head's query heads over their slot's cached keys -------------------- */
/* q: the group's query heads, `group` rows of d floats, d apart (head after head); keys [first,
 * len) of the slot; out: the group's outputs, likewise. scores: group * max_seq floats of
 * scratch. Float32 softmax and weighted sum of values, as the PyTorch path's decode attention;
 * the output rounded to the model dtype. A row's result depends only on its own slot. */
#define MAX_GROUP 16
#define MAX_HEAD_DIM 256

/* Whether the vector attention kernels take this model (else scalar loops, or row by row). */
static inline int vector_attention(const Model *md) {
#if defined(__AVX512F__)
    const int64_t group = md->heads / md->kv_heads, d = md->head_dim;
    return group <= MAX_GROUP && d <= MAX_HEAD_DIM && d % 2 == 0;
#else
    (void)md;
    return 0;
#endif
}

/* The first key a query at position len - 1 sees: a sliding window hides the older ones. */
static inline int64_t first_key(int64_t len, int64_t window) { return window > 0 && len > window ? len - window : 0; }

/* Where kv head g of `slot` keeps its keys (v = 0) or values (v = 1) in one layer's cache. */
static inline char *kv_head_base(const Model *md, char *kv_layer, int v, int64_t slot, int64_t g) {
    return kv_layer + (v * md->kv_kind + slot * md->kv_slot + g * md->kv_head) * (md->dtype == DT_BF16 ? 2 : 4);
}
#if defined(__AVX512F__)
/* The weighted sum of values for G queries of one kv head over 64 dimensions [i0, i0 + 64):
 * each value row is loaded (and widened from bfloat16) once for the G queries, and the G x 4
 * accumulators stay in registers. Query g's weight of key t is sc[g * qs + t * ts], its output
 * outs[g] (divided by total[g], rounded to the model dtype). Per output, keys are added in order
 * first..len-1. */
#define PV_BLOCK(G)                                                                                        \
    static void pv_block_##G(const void *v_base, int64_t pos, int bf, int64_t i0, int64_t d, int64_t first, \
                             int64_t len, const float *sc, int64_t qs, int64_t ts, const float *total,  \
                             float *const *outs) {                                                     \
        __mmask16 m[4];                                                                                    \
        __m512 acc[G][4];                                                                                  \
        for (int c = 0; c < 4; c++) m[c] = d - i0 - 16 * c > 0 ? lanes(d - i0 - 16 * c) : 0;              \
        for (int g = 0; g < G; g++)                                                                        \
            for (int c = 0; c < 4; c++) acc[g][c] = _mm512_setzero_ps();                                   \
        for (int64_t t = first; t < len; t++) {                                                            \
            __m512 v[4];                                                                                   \
            for (int c = 0; c < 4; c++) v[c] = vload(v_base, t * pos + i0 + 16 * c, bf, m[c]);             \
            for (int g = 0; g < G; g++) {                                                                  \
                const __m512 p = _mm512_set1_ps(sc[g * qs + t * ts]);                                      \
                for (int c = 0; c < 4; c++) acc[g][c] = _mm512_fmadd_ps(p, v[c], acc[g][c]);               \
            }                                                                                              \
        }                                                                                                  \
        for (int g = 0; g < G; g++)                                                                        \
            for (int c = 0; c < 4; c++)                                                                    \
                if (m[c])                                                                                  \
                    _mm512_mask_storeu_ps(outs[g] + i0 + 16 * c, m[c],                                     \
                                          vrnd(_mm512_div_ps(acc[g][c], _mm512_set1_ps(total[g])), bf));   \
    }
PV_BLOCK(1)
PV_BLOCK(2)
PV_BLOCK(3)
PV_BLOCK(4)
#undef PV_BLOCK

/* pv_block over `queries` queries, 4 at a time, and every 64 dimensions. */
static void weigh_values(const void *v_base, int64_t pos, int bf, int64_t d, int64_t first, int64_t len,
                         const float *sc, int64_t qs, int64_t ts, int64_t queries, const float *total,
                         float *const *outs) {
    for (int64_t j0 = 0; j0 < queries; j0 += 4) {
        const int64_t n = queries - j0 < 4 ? queries - j0 : 4;
        const float *s = sc + j0 * qs;
        for (int64_t i0 = 0; i0 < d; i0 += 64) {
            if (n == 4) pv_block_4(v_base, pos, bf, i0, d, first, len, s, qs, ts, total + j0, outs + j0);
            else if (n == 3) pv_block_3(v_base, pos, bf, i0, d, first, len, s, qs, ts, total + j0, outs + j0);
            else if (n == 2) pv_block_2(v_base, pos, bf, i0, d, first, len, s, qs, ts, total + j0, outs + j0);
            else pv_block_1(v_base, pos, bf, i0, d, first, len, s, qs, ts, total + j0, outs + j0);
        }
    }
}

/* Scores of keys [t0, t0 + keys) (keys <= 16) for one query head, scaled: 16 dot products at
 * once, summed across lanes by one transpose-and-add tree. bfloat16 keys meet the query's
 * bfloat16 copy qb (exact: it holds bfloat16 values) in the dot-product instruction, two
 * dimensions per step; float32 keys in FMAs. */
static inline void score_keys(const float *q, const uint16_t *qb, const void *k_base, int64_t pos, int64_t d,
                              int bf, int64_t t0, int64_t keys, float scale, float *sc) {
    __m512 acc[16];
    for (int64_t j = 0; j < 16; j++) {
        acc[j] = _mm512_setzero_ps();
        if (j >= keys) continue;
#if defined(__AVX512BF16__)
        if (bf) {
            const uint16_t *k = (const uint16_t *)k_base + (t0 + j) * pos;
            for (int64_t i = 0; i < d; i += 32) {
                const __mmask16 m = lanes((d - i) / 2);
                acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)_mm512_maskz_loadu_epi32(m, qb + i),
                                          (__m512bh)_mm512_maskz_loadu_epi32(m, k + i));
            }
            continue;
        }
#endif
        for (int64_t i = 0; i < d; i += 16) {
            const __mmask16 m = lanes(d - i);
            acc[j] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, q + i), vload(k_base, (t0 + j) * pos + i, bf, m), acc[j]);
        }
    }
    _mm512_mask_storeu_ps(sc + t0, lanes(keys), _mm512_mul_ps(sum_each(acc), _mm512_set1_ps(scale)));
}
#endif

static void attend(const Model *md, const float *q, int64_t group, const void *k_base, const void *v_base,
                   int64_t first, int64_t len, float *scores, float *out) {
    const int bf = md->dtype == DT_BF16;
    const int64_t d = md->head_dim, pos = md->kv_pos, stride = md->max_seq;
    const float scale = 1.f / sqrtf((float)d);
#if defined(__AVX512F__)
    if (vector_attention(md)) {
        uint16_t qb[MAX_GROUP * MAX_HEAD_DIM];
        if (bf) to_model_dtype(q, qb, group * d, 1);
        const int64_t es = bf ? 2 : 4;
        for (int64_t t0 = first; t0 < len; t0 += 16) { /* 16 keys at a time, one head after another */
            /* a task reads two short streams: ask for the keys two blocks ahead and for this
             * block's values (needed after the softmax) before the prefetchers ramp up */
            for (int64_t t = t0; t < t0 + 16 && t < len; t++) {
                const char *kr = (const char *)k_base + (t + 32) * pos * es, *vr = (const char *)v_base + t * pos * es;
                for (int64_t b = 0; b < d * es; b += 64) {
                    if (t + 32 < len) _mm_prefetch(kr + b, _MM_HINT_T0);
                    _mm_prefetch(vr + b, _MM_HINT_T1);
                }
            }
            for (int64_t g = 0; g < group; g++)
                score_keys(q + g * d, qb + g * d, k_base, pos, d, bf, t0, len - t0 < 16 ? len - t0 : 16, scale,
                           scores + g * stride);
        }
        float total[MAX_GROUP];
        for (int64_t g = 0; g < group; g++) {
            float *sc = scores + g * stride;
            __m512 best = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
            for (int64_t t = first; t < len; t += 16)
                best = _mm512_max_ps(best, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), lanes(len - t), sc + t));
            const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(best));
            for (int64_t t = first; t < len; t += 16) {
                const __mmask16 m = lanes(len - t);
                const __m512 e = vexp(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, sc + t), top));
                _mm512_mask_storeu_ps(sc + t, m, e);
                sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(m, e));
            }
            total[g] = _mm512_reduce_add_ps(sum);
        }
        float *outs[MAX_GROUP];
        for (int64_t g = 0; g < group; g++) outs[g] = out + g * d;
        weigh_values(v_base, pos, bf, d, first, len, scores, stride, 1, group, total, outs);
        return;
    }
#endif
    for (int64_t g = 0; g < group; g++) {
        float *sc = scores + g * stride, best = -INFINITY, total = 0.f;
        for (int64_t t = first; t < len; t++) {
            float s = 0.f;
            for (int64_t i = 0; i < d; i++) s += q[g * d + i] * load(k_base, t * pos + i, bf);
            sc[t] = s * scale;
            if (sc[t] > best) best = sc[t];
        }
        for (int64_t t = first; t < len; t++) {
            sc[t] = expf(sc[t] - best);
            total += sc[t];
        }
        for (int64_t i = 0; i < d; i++) {
            float acc = 0.f;
            for (int64_t t = first; t < len; t++) acc += sc[t] * load(v_base, t * pos + i, bf);
            out[g * d + i] = rnd(acc / total, bf);
        }
    }
}

/* ---- attention of a block of prompt rows ------------------------------------------------------
 * Consecutive prompt rows r0..r0+n-1 of one slot (consecutive positions) and kv head g: the
 * n x group queries are blocked like a weight (see "projections": query j = row j / group, head
 * j % group, 16 queries per block), so that query-key scores come from the projection tiles, the
 * keys as their input rows: each key row is read once per block instead of once per query, and
 * no horizontal sums. Scores S[key][query] (scaled), then per query the softmax over its own
 * keys [first, len) (zero weight elsewhere), then the weighted values as in decode. Every
 * query's numbers are computed in the same order whatever the block holds (the tile sums each
 * score over dimensions in order; exact zeros for the other rows' keys add nothing), so a
 * prompt row's result does not depend on how its prompt was chunked or with what it shares the
 * iteration. Needs keys stored as rows of head_dim (kv_pos == head_dim). */
#define MAX_BLOCK_QUERIES 64
#if defined(__AVX512F__)
static void attend_prompt(const Model *md, const float *wide, int64_t qkv_n, int64_t q_size, int64_t r0,
                          int64_t n, int64_t g, const int64_t *positions, int64_t window, const void *k_base,
                          const void *v_base, float *scratch, float *mid) {
    const int bf = md->dtype == DT_BF16;
    const int64_t d = md->head_dim, pos = md->kv_pos, group = md->heads / md->kv_heads, es = bf ? 2 : 4;
    const int64_t nq = n * group, nb = (nq + 15) / 16, width = nb * 16;
    const float scale = 1.f / sqrtf((float)d);
    void *qt = scratch;                              /* blocked queries: nb x d x 16 values */
    float *S = scratch + MAX_BLOCK_QUERIES * d;      /* [keys of the block][width] */
    int32_t first[MAX_BLOCK_QUERIES], len[MAX_BLOCK_QUERIES];
    float total[MAX_BLOCK_QUERIES], *outs[MAX_BLOCK_QUERIES];
    for (int64_t j = 0; j < width; j++) {
        const int64_t jb = j / 16, lane = j % 16;
        const float *q = j < nq ? wide + (r0 + j / group) * qkv_n + (g * group + j % group) * d : 0;
        if (bf) { /* the layout block_weight gives: pairs of inputs, 32 bits a pair */
            uint32_t pairs[MAX_HEAD_DIM / 2], *to = (uint32_t *)qt + jb * (d / 2) * 16 + lane;
            if (q) to_model_dtype(q, pairs, d, 1);
            for (int64_t i = 0; i < d / 2; i++) to[i * 16] = q ? pairs[i] : 0;
        } else {
            float *to = (float *)qt + jb * d * 16 + lane;
            for (int64_t i = 0; i < d; i++) to[i * 16] = q ? q[i] : 0.f;
        }
        if (j < nq) {
            const int64_t at = positions[r0 + j / group] + 1;
            len[j] = (int32_t)at;
            first[j] = (int32_t)first_key(at, window);
            outs[j] = mid + (r0 + j / group) * q_size + (g * group + j % group) * d;
        } else first[j] = len[j] = 0; /* padding: no keys */
    }
    const int64_t kmin = first[0], kmax = len[nq - 1]; /* positions rise along the block */
    for (int64_t t = kmin; t < kmax;) {
        const int64_t left = kmax - t;
        const int mt = left >= 6 ? 6 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
        float out[6 * 4 * 16];
        tile(qt, 0, d, (const char *)k_base + t * pos * es, 0, mt, (int)nb, bf, out, 0);
        for (int i = 0; i < mt; i++)
            for (int64_t jb = 0; jb < nb; jb++)
                _mm512_storeu_ps(S + (t - kmin + i) * width + jb * 16,
                                 _mm512_mul_ps(_mm512_loadu_ps(out + (i * nb + jb) * 16), _mm512_set1_ps(scale)));
        t += mt;
    }
    for (int64_t jb = 0; jb < nb; jb++) { /* softmax down the key axis, 16 queries per vector */
        const __m512i fv = _mm512_loadu_si512(first + jb * 16), lv = _mm512_loadu_si512(len + jb * 16);
        /* the keys of the block's queries: the others are left as they are (weigh_values below
         * reads each query's own keys only) */
        const int64_t t0 = first[jb * 16], t1 = len[(jb + 1) * 16 <= nq ? (jb + 1) * 16 - 1 : nq - 1];
        __m512 best = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
        for (int64_t t = t0; t < t1; t++) {
            const __m512i tv = _mm512_set1_epi32((int32_t)t);
            const __mmask16 m = _mm512_cmpge_epi32_mask(tv, fv) & _mm512_cmplt_epi32_mask(tv, lv);
            best = _mm512_mask_max_ps(best, m, best, _mm512_loadu_ps(S + (t - kmin) * width + jb * 16));
        }
        for (int64_t t = t0; t < t1; t++) {
            const __m512i tv = _mm512_set1_epi32((int32_t)t);
            const __mmask16 m = _mm512_cmpge_epi32_mask(tv, fv) & _mm512_cmplt_epi32_mask(tv, lv);
            float *row = S + (t - kmin) * width + jb * 16;
            const __m512 e = _mm512_maskz_mov_ps(m, vexp(_mm512_sub_ps(_mm512_loadu_ps(row), best)));
            _mm512_storeu_ps(row, e);
            sum = _mm512_add_ps(sum, e);
        }
        _mm512_storeu_ps(total + jb * 16, sum);
    }
    for (int64_t j0 = 0; j0 < nq; j0 += 4) { /* 4 queries at a time over their keys only */
        const int64_t n_j = nq - j0 < 4 ? nq - j0 : 4;
        weigh_values(v_base, pos, bf, d, first[j0], len[j0 + n_j - 1], S - kmin * width + j0, 1, width, n_j,
                     total + j0, outs + j0);
    }
}
#endif

typedef void (*AllReduce)(float *buffer, int64_t n);

/* Sum a [rows, h] partial result over the ranks (row-parallel projections, the vocabulary-split
 * embedding); in bfloat16 the sum is rounded back, as PyTorch's bfloat16 all-reduce does. */
static void reduce_rows(const Model *md, float *x, int64_t n) {
    if (!md->all_reduce) return;
    ((AllReduce)md->all_reduce)(x, n);
    if (md->dtype == DT_BF16)
        for (int64_t i = 0; i < n; i++) x[i] = rnd(x[i], 1);
}

/* Greedy sampling: ids[r] = the index of the first maximum of logits row r (`vocab` values of
 * the model dtype, rows `stride` elements apart), NaN counting as the maximum: torch.argmax's
 * answer, without its scalar loop over a large vocabulary (~1 ms for 32 x 49152 on 2 cores). */
void flover_argmax(const void *logits, int rows, int64_t vocab, int64_t stride, int bf, int64_t *ids, int nt) {
#pragma omp parallel for num_threads(nt) schedule(static) if (rows >= 4)
    for (int r = 0; r < rows; r++) {
        const char *row = (const char *)logits + (int64_t)r * stride * (bf ? 2 : 4);
        int64_t best = 0;
#if defined(__AVX512F__)
        __m512 top = _mm512_set1_ps(-INFINITY);
        __mmask16 nan = 0;
        for (int64_t i = 0; i < vocab && !nan; i += 16) {
            const __mmask16 m = lanes(vocab - i);
            const __m512 v = _mm512_mask_blend_ps(m, _mm512_set1_ps(-INFINITY), vload(row, i, bf, m));
            nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            top = _mm512_max_ps(v, top); /* a NaN lane keeps top's value: NaN is found above */
        }
        const float most = _mm512_reduce_max_ps(top);
        for (int64_t i = 0; i < vocab; i += 16) {
            const __m512 v = vload(row, i, bf, lanes(vocab - i));
            const __mmask16 hit = lanes(vocab - i) & (nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)
                                                          : _mm512_cmp_ps_mask(v, _mm512_set1_ps(most), _CMP_EQ_OQ));
            if (hit) {
                best = i + __builtin_ctz(hit);
                break;
            }
        }
#else
        float most = load(row, 0, bf);
        for (int64_t i = 1; i < vocab && most == most; i++) {
            const float v = load(row, i, bf);
            if (v > most || v != v) most = v, best = i;
        }
#endif
        ids[r] = best;
    }
}

/* ---- greedy through a screen of the LM head -------------------------------------------------
 * A greedy row needs the index of its largest logit, not the logits, and the head is a fifth of
 * a token's bytes and FLOPs (SmolLM2: 49152 x 576). So a cheaper copy of the head scores every
 * vocabulary row first: bfloat16 for a float32 model (half the bytes, twice the FMA rate), int8
 * with one scale per row for a bfloat16 model (half the bytes). With a bound B_j >= |s_j - f_j|
 * between the screen's s_j and the exact logit f_j, only rows whose s_j + B_j reaches
 * lo = max_k (s_k - B_k) can hold the maximum (bfloat16 logits: lo lowered by their rounding, so
 * that rows rounding to the same maximum are kept, and the first of them wins). Those few are
 * summed again by the model's own tile, so the id is the one the whole head's argmax gives, bit
 * for bit. B_j = |x| * bounds[j], |x| the L2 norm (bfloat16 screen) or the L1 norm (int8), and
 * bounds[j] from flover/native/forward.py (`HeadScreen`, where the error terms are derived),
 * plus 2^-10 of margin for the float rounding of |x| and B_j, 2^-20 |s_j| for that of s_j -+ B_j,
 * and 1e-30 for denormals (the dot-product instruction flushes them). Rows with a non-finite
 * value, or too many candidates (near-uniform logits), take the whole head. */
enum { SCREEN_MAX_CANDIDATES = 256 };

/* ids[r] for the final-normed rows x [rows, h]; scores: [rows, vocab] floats of scratch; xb: the
 * projections' operand scratch. Returns the rows that took the whole head. */
static int screened_greedy(const Model *md, const float *x, void *xb, int rows, float *scores, int64_t *ids,
                           int nt) {
    if (rows <= 0) return 0;
    const int bf = md->dtype == DT_BF16, exact_kind = bf ? W_BF16 : W_F32;
    const int64_t h = md->hidden, vocab = md->vocab;
    const float *bounds = (const float *)md->head_bounds;
    if (bf) { /* int8 codes, row scales; the operand is x's bfloat16 values (exact), as the head's */
        project_kind(W_Q8, 0, md->head_screen, md->head_screen_scales, 0, x, xb, rows, vocab, h, scores, 0, nt, 0);
    } else { /* bfloat16 of x to nearest, then bfloat16 weights */
        for (int64_t i = 0; i < rows * h; i++) ((uint16_t *)xb)[i] = f2bf(x[i]);
        project_kind(W_BF16, 0, md->head_screen, 0, 0, 0, xb, rows, vocab, h, scores, 0, nt, 0);
    }
    int full[rows], n_full = 0;
#pragma omp parallel for num_threads(nt) schedule(static) if (rows >= 2) reduction(+ : n_full)
    for (int r = 0; r < rows; r++) {
        const float *a = x + r * h, *s = scores + r * vocab;
        double norm = 0.;
        int finite = 1;
        for (int64_t i = 0; i < h; i++) norm += bf ? fabs((double)a[i]) : (double)a[i] * a[i], finite &= isfinite(a[i]);
        const float scale = (float)((bf ? norm : sqrt(norm)) * (1 + 0x1p-10)), rel = 0x1p-20f, tiny = 1e-30f;
        float lo = -INFINITY, hi = -INFINITY;
        int64_t cand[SCREEN_MAX_CANDIDATES], n = 0;
#if defined(__AVX512F__)
#define BOUND(v, j, m) _mm512_fmadd_ps(_mm512_set1_ps(scale), _mm512_maskz_loadu_ps(m, bounds + (j)),              \
                                       _mm512_fmadd_ps(_mm512_set1_ps(rel), _mm512_abs_ps(v), _mm512_set1_ps(tiny)))
        __m512 low = _mm512_set1_ps(-INFINITY), high = _mm512_set1_ps(-INFINITY);
        __mmask16 bad = 0;
        for (int64_t j = 0; j < vocab; j += 16) {
            const __mmask16 m = lanes(vocab - j);
            const __m512 v = _mm512_maskz_loadu_ps(m, s + j), b = BOUND(v, j, m);
            bad |= _mm512_mask_cmp_ps_mask(m, _mm512_sub_ps(v, v), _mm512_setzero_ps(), _CMP_NEQ_UQ); /* NaN, inf */
            low = _mm512_mask_max_ps(low, m, low, _mm512_sub_ps(v, b));
            high = _mm512_mask_max_ps(high, m, high, _mm512_add_ps(v, b));
        }
        lo = _mm512_reduce_max_ps(low), hi = _mm512_reduce_max_ps(high);
        finite &= !bad;
#else
        for (int64_t j = 0; j < vocab; j++) {
            const float b = fmaf(scale, bounds[j], fmaf(rel, fabsf(s[j]), tiny));
            finite &= isfinite(s[j]);
            if (s[j] - b > lo) lo = s[j] - b;
            if (s[j] + b > hi) hi = s[j] + b;
        }
#endif
        /* bfloat16 logits: a row whose logit rounds to the same maximum may lie below lo by the
         * rounding of both (each at most 2^-8 of a value within max(|lo|, |hi|), with margin) */
        const float top = fabsf(lo) > fabsf(hi) ? fabsf(lo) : fabsf(hi);
        const float threshold = bf ? lo - 0x1p-7f * top * (1 + 0x1p-6f) : lo;
#if defined(__AVX512F__)
        for (int64_t j = 0; j < vocab && finite && n <= SCREEN_MAX_CANDIDATES; j += 16) {
            const __mmask16 m = lanes(vocab - j);
            const __m512 v = _mm512_maskz_loadu_ps(m, s + j);
            __mmask16 hit = _mm512_mask_cmp_ps_mask(m, _mm512_add_ps(v, BOUND(v, j, m)), _mm512_set1_ps(threshold),
                                                    _CMP_GE_OQ);
            for (; hit && n < SCREEN_MAX_CANDIDATES; hit &= hit - 1) cand[n++] = j + __builtin_ctz(hit);
            if (hit) n = SCREEN_MAX_CANDIDATES + 1;
        }
#undef BOUND
#else
        for (int64_t j = 0; j < vocab && finite && n <= SCREEN_MAX_CANDIDATES; j++)
            if (s[j] + fmaf(scale, bounds[j], fmaf(rel, fabsf(s[j]), tiny)) >= threshold) {
                if (n == SCREEN_MAX_CANDIDATES) n++;
                else cand[n++] = j;
            }
#endif
        full[r] = !finite || !isfinite(scale) || n > SCREEN_MAX_CANDIDATES;
        if (full[r]) {
            n_full++;
            continue;
        }
        /* the candidates' exact logits: their blocks of the head, tiled as the whole head is */
        const void *operand = bf ? (const void *)((const uint16_t *)xb + r * h) : (const void *)a;
        float out[16], best = 0.f;
        for (int64_t q = 0; q < n; q++) {
            tile((const void *)md->head, cand[q] / 16, h, operand, 0, 1, 1, exact_kind, out, 0);
            const float f = rnd(out[cand[q] % 16], bf);
            if (q == 0 || f > best) best = f, ids[r] = cand[q];
        }
    }
    for (int r = 0; r < rows; r++)
        if (full[r]) {
            project(md, md->head, 0, 0, x + r * h, xb, 1, vocab, h, scores + r * vocab, 1, nt);
            flover_argmax(scores + r * vocab, 1, vocab, vocab, bf, ids + r, nt);
        }
    return n_full;
}

/* ---- greedy through the whole head ------------------------------------------------------------
 * Rows beyond the screen's (bfloat16 above screen_rows: there the head is compute-bound and the
 * int8 screen no longer pays) take every logit, but none is stored: each tile's outputs, rounded
 * to the model dtype as the logits would be, go straight into the row's running maximum
 * (project_kind with a RowMax). The threads' blocks are in order, so the first maximum is the
 * smallest index among the largest values, the lower thread's on a tie, and the first NaN wins:
 * torch.argmax's answer, without writing [rows, vocab] logits and reading them again. Returns
 * the rows (all of them took the whole head). */
static int head_greedy(const Model *md, const float *x, void *xb, int rows, int64_t *ids, int nt) {
    float top[nt * rows];
    int64_t at[nt * rows], nan_at[nt * rows];
    for (int i = 0; i < nt * rows; i++) top[i] = -INFINITY, at[i] = nan_at[i] = -1; /* (threads not started) */
    RowMax most = {top, at, nan_at};
    const int bf = md->dtype == DT_BF16;
    project_kind(bf ? W_BF16 : W_F32, bf, md->head, 0, 0, x, xb, rows, md->vocab, md->hidden, 0, 0, nt, &most);
    for (int r = 0; r < rows; r++) {
        int64_t id = -1, nan_id = -1;
        float largest = -INFINITY;
        for (int t = 0; t < nt; t++) {
            if (nan_id < 0 && nan_at[t * rows + r] >= 0) nan_id = nan_at[t * rows + r];
            if (at[t * rows + r] >= 0 && (id < 0 || top[t * rows + r] > largest))
                largest = top[t * rows + r], id = at[t * rows + r];
        }
        ids[r] = nan_id >= 0 ? nan_id : id >= 0 ? id : 0; /* every logit -inf: the first */
    }
    return rows;
}

/* Whether this build has AVX-512 BF16's dot product (the 4-bit kernels and the greedy screen
 * need it to be fast; without it they are not used). */
int flover_has_bf16_dot(void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

/* The float scratch of an iteration, as offsets into `work`: hidden and normed rows, qkv /
 * gate_up outputs, attention out / activation, the model-dtype copies that feed the kernels, per
 * thread the attention scratch (a decode row's scores of one kv head's query heads, or a prompt
 * block's blocked queries and scores: `per_thread` floats), per row and group of 32 inputs their
 * sum (int4), and the prompt blocks (first row and row count, int64). `end`: the floats the
 * caller allocates (flover_work_floats). */
typedef struct {
    int64_t hidden, normed, wide, mid, xb, scores, per_thread, xsum, blocks, end;
} Work;

static Work work_layout(const Model *md, int64_t rows, int64_t nt) {
    const int64_t h = md->hidden, qkv = (md->heads + 2 * md->kv_heads) * md->head_dim;
    const int64_t widest = qkv > 2 * md->inter ? qkv : 2 * md->inter;
    const int64_t inner = md->inter > h ? md->inter : h;
    Work w;
    w.hidden = 0;
    w.normed = w.hidden + rows * h;
    w.wide = w.normed + rows * h;
    w.mid = w.wide + rows * widest;
    w.xb = w.mid + rows * inner;
    w.scores = w.xb + rows * widest; /* the model-dtype copies fit in rows * widest floats */
    const int64_t decode = md->heads * md->max_seq, prompt = MAX_BLOCK_QUERIES * (md->head_dim + md->max_seq);
    w.per_thread = decode > prompt ? decode : prompt;
    w.xsum = w.scores + nt * w.per_thread;
    w.blocks = w.xsum + rows * (widest / 32 + 1);
    w.end = w.blocks + 4 * rows; /* 2 int64 per block, at most one block per row */
    return w;
}

int64_t flover_work_floats(const Model *md, int rows, int nt) { return work_layout(md, rows, nt).end; }

/* What flover_forward assumes of a model's shape, checked once before any call (a model file
 * is not trusted): 0, or which assumption fails (native_forward.py names it). */
int flover_check_model(const Model *md) {
    if (md->layers <= 0 || md->hidden <= 0 || md->heads <= 0 || md->kv_heads <= 0 || md->head_dim <= 0 ||
        md->inter <= 0 || md->vocab <= 0 || md->max_seq <= 0)
        return 1;
    if (md->heads % md->kv_heads) return 2; /* every kv head serves a whole group of query heads */
    if (md->head_dim % 2 || md->head_dim > 512) return 3;
    if (md->hidden % 2 || md->inter % 2) return 4;
    if (md->kv_pos < md->head_dim || md->kv_head < md->max_seq * md->kv_pos || md->kv_slot < md->kv_heads * md->kv_head)
        return 5; /* a slot's rows and heads must not overlap one another */
    return 0;
}

/* One iteration: `rows` tokens, token r at position positions[r] of slot slots[r] (decode tokens
 * and prompt tokens alike: its K/V are written there, and it attends to its slot's keys up to
 * its own position, which this iteration's earlier prompt tokens have written). Logits of the
 * rows listed in out_rows: [n_out, vocab] in the model dtype; or, with greedy_ids (models with
 * head_screen), those rows' greedy ids, `logits` serving as [n_out, vocab] float32 scratch. Returns 0, or with greedy_ids the rows that took the whole head. */
int flover_forward(const Model *md, const Layer *layers, int rows, int decode_rows, const int64_t *tokens,
                   const int64_t *positions, const int64_t *slots, int n_out, const int64_t *out_rows, void *logits,
                   int64_t *greedy_ids, float *work, double eps_d, int nt) {
    for (int r = 0; r < rows; r++) /* a row past its slot's positions would touch another slot's */
        if (positions[r] < 0 || positions[r] >= md->max_seq || tokens[r] < 0) return -1;
    const int bf = md->dtype == DT_BF16;
    const float eps = (float)eps_d;
    const int64_t h = md->hidden, d = md->head_dim, heads = md->heads, kvh = md->kv_heads, inter = md->inter;
    const int64_t group = heads / kvh;
    const int64_t q_size = heads * d, kv_size = kvh * d, qkv_n = q_size + 2 * kv_size;
    const Work at = work_layout(md, rows, nt);
    float *hidden = work + at.hidden, *normed = work + at.normed, *wide = work + at.wide, *mid = work + at.mid;
    float *scores = work + at.scores, *xsum = work + at.xsum;
    void *xb = work + at.xb;
    const int64_t es = bf ? 2 : 4; /* bytes per element of the model dtype */
#define PROJECT(W, BIAS, X, N, K, Y)                                                                       \
    if (ly->W##_codes && md->quant == 4)                                                                   \
        project_int4(ly->W##_codes, ly->W##_scales, BIAS, X, xb, xsum, rows, N, K, Y, 0, nt);          \
    else if (ly->W##_codes)                                                                                \
        project(md, ly->W##_codes, ly->W##_scales, BIAS, X, xb, rows, N, K, Y, 0, nt);                   \
    else                                                                                                   \
        project(md, ly->W, 0, BIAS, X, xb, rows, N, K, Y, 0, nt);

    for (int r = 0; r < rows; r++) { /* under TP: ids outside this rank's block are zero rows */
        const int64_t t = tokens[r] - md->vocab_start;
        for (int64_t i = 0; i < h; i++)
            hidden[r * h + i] = t >= 0 && t < md->vocab ? load((const void *)md->embed, t * h + i, bf) : 0.f;
    }
    reduce_rows(md, hidden, rows * h);

    /* Attention tasks: prompt rows in blocks (consecutive positions of one slot, up to
     * MAX_BLOCK_QUERIES queries per kv head) where the blocked kernel applies; decode rows (the
     * first decode_rows), and prompt rows otherwise, one by one. */
    int64_t *blocks = (int64_t *)(work + at.blocks), n_blocks = 0, single_from = decode_rows;
    if (vector_attention(md) && md->kv_pos == d) {
        const int64_t per_block = MAX_BLOCK_QUERIES / group;
        for (int64_t r = decode_rows; r < rows;) {
            int64_t n = 1;
            while (r + n < rows && n < per_block && slots[r + n] == slots[r] && positions[r + n] == positions[r + n - 1] + 1)
                n++;
            blocks[2 * n_blocks] = r, blocks[2 * n_blocks + 1] = n, n_blocks++;
            r += n;
        }
        single_from = rows;
    }
    const int64_t single_tasks = (decode_rows + rows - single_from) * kvh;

#pragma omp parallel for num_threads(nt) schedule(static) if (rows >= 16)
    for (int r = 0; r < rows; r++) rms_norm(hidden + r * h, (const void *)layers[0].input_norm, eps, h, bf, normed + r * h);
    for (int64_t l = 0; l < md->layers; l++) {
        const Layer *ly = &layers[l];
        /* normed: the input norm of the hidden rows (of the embedding, or by the last layer's
         * residual pass) */
        PROJECT(qkv, ly->qkv_bias, normed, qkv_n, h, wide)

        char *kv_layer = (char *)md->kv + l * md->kv_layer * es;
#pragma omp parallel for num_threads(nt) schedule(static) if (rows >= 8)
        for (int r = 0; r < rows; r++) {
            float *row = wide + r * qkv_n;
            const int64_t p = positions[r];
            const void *cos_row = (const char *)md->cos + p * d * es, *sin_row = (const char *)md->sin + p * d * es;
            for (int64_t hh = 0; hh < heads + kvh; hh++) rope(row + hh * d, cos_row, sin_row, d, bf);
            for (int64_t g = 0; g < kvh; g++) {
                to_model_dtype(row + q_size + g * d, kv_head_base(md, kv_layer, 0, slots[r], g) + p * md->kv_pos * es,
                               d, bf);
                to_model_dtype(row + q_size + kv_size + g * d,
                               kv_head_base(md, kv_layer, 1, slots[r], g) + p * md->kv_pos * es, d, bf);
            }
        }
        /* attention: one task per (prompt block, kv head) first (the larger tasks), then per (row, kv head) */
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
        for (int64_t task = 0; task < n_blocks * kvh + single_tasks; task++) {
            float *scratch = scores + (int64_t)omp_get_thread_num() * at.per_thread;
            if (task < n_blocks * kvh) {
#if defined(__AVX512F__)
                const int64_t *b = blocks + 2 * (task / kvh), g = task % kvh;
                attend_prompt(md, wide, qkv_n, q_size, b[0], b[1], g, positions, ly->window,
                              kv_head_base(md, kv_layer, 0, slots[b[0]], g), kv_head_base(md, kv_layer, 1, slots[b[0]], g),
                              scratch, mid);
#endif
                continue;
            }
            const int64_t single = task - n_blocks * kvh, nth = single / kvh, g = single % kvh;
            const int r = (int)(nth < decode_rows ? nth : single_from + nth - decode_rows);
            const int64_t len = positions[r] + 1;
            attend(md, wide + r * qkv_n + g * group * d, group, kv_head_base(md, kv_layer, 0, slots[r], g),
                   kv_head_base(md, kv_layer, 1, slots[r], g), first_key(len, ly->window), len, scratch,
                   mid + r * q_size + g * group * d);
        }
        PROJECT(o, 0, mid, h, q_size, normed)
        reduce_rows(md, normed, rows * h);
        residual_and_norm(hidden, normed, rows, ly->o_bias, ly->post_norm, eps, h, bf, nt);
        PROJECT(gate_up, ly->gate_up_bias, normed, 2 * inter, h, wide)
#pragma omp parallel for num_threads(nt) schedule(static) if (rows >= 8)
        for (int r = 0; r < rows; r++) silu_mul(wide + r * 2 * inter, inter, bf, mid + r * inter);
        PROJECT(down, 0, mid, h, inter, normed)
        reduce_rows(md, normed, rows * h);
        residual_and_norm(hidden, normed, rows, ly->down_bias, l + 1 < md->layers ? layers[l + 1].input_norm : 0, eps, h,
                          bf, nt);
    }
    /* the final norm of the rows whose logits are wanted, then the LM head writes the model
     * dtype straight into `logits` */
    for (int o = 0; o < n_out; o++)
        rms_norm(hidden + out_rows[o] * h, (const void *)md->final_norm, eps, h, bf, mid + o * h);
#undef PROJECT
    if (greedy_ids && n_out > md->screen_rows) return head_greedy(md, mid, xb, n_out, greedy_ids, nt);
    if (greedy_ids && md->head_screen) return screened_greedy(md, mid, xb, n_out, (float *)logits, greedy_ids, nt);
    if (n_out > 0) project(md, md->head, md->head_scales, 0, mid, xb, n_out, md->vocab, h, logits, 1, nt);
    return 0;
}
