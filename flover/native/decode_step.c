/* One decode iteration of a Llama-family model for a few rows, in one native call (CPU, TP=1).
 *
 * A decode iteration of one request reads every weight once and does little else, so it is
 * bound by memory bandwidth, and in eager PyTorch by ~1,000 small operations on top (norms,
 * RoPE, KV writes, residuals, attention: ~8 ms a token for SmolLM2-135M on 2 cores). Here the
 * whole forward of up to `max_rows` decode tokens runs as plain loops: each projection reads its
 * weight rows once (one row at a time, contiguous per thread: the pattern that streams at the
 * machine's read bandwidth; blocks of 2-8 rows read half as fast on the dev machine), and every
 * other step is a loop over a few hundred floats.
 *
 * Rounding follows the PyTorch path (flover/models/llama.py) step by step: in bfloat16 every
 * intermediate that PyTorch rounds to bfloat16 is rounded here at the same point (RNE), and
 * accumulations are float32 as in oneDNN, so the two paths differ only by summation order.
 *
 * Built by flover/native_decode.py with the system C compiler (-O3 -march=native -fopenmp) into
 * a cache directory and loaded with ctypes; it shares PyTorch's OpenMP runtime (same soname).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

enum { DT_F32 = 0, DT_BF16 = 1 };

/* Mirrors MODEL_FIELDS in flover/native_decode.py: int64 fields, pointers as addresses. */
typedef struct {
    int64_t layers, hidden, heads, kv_heads, head_dim, inter, vocab, dtype, max_seq;
    int64_t kv, kv_layer, kv_kind, kv_slot, kv_head, kv_pos; /* KV base address, strides in elements */
    int64_t embed, final_norm, head, cos, sin;                /* rotary tables [max_seq, head_dim] */
} Model;

/* Mirrors LAYER_FIELDS: weight addresses of one layer, 0 where the model has no such bias; the
 * layer's sliding window (0: none). */
typedef struct {
    int64_t input_norm, qkv, qkv_bias, o, o_bias, post_norm, gate_up, gate_up_bias, down, down_bias, window;
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

/* ---- dot products: weights row-major [n, k], k a multiple of 32 (checked in Python) ------ */
static inline float dot_bf16(const uint16_t *w, const uint16_t *x, int64_t k) {
#if defined(__AVX512BF16__)
    __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 64 <= k; j += 64) {
        a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(w + j), (__m512bh)_mm512_loadu_si512(x + j));
        b = _mm512_dpbf16_ps(b, (__m512bh)_mm512_loadu_si512(w + j + 32), (__m512bh)_mm512_loadu_si512(x + j + 32));
    }
    for (; j < k; j += 32)
        a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(w + j), (__m512bh)_mm512_loadu_si512(x + j));
    return _mm512_reduce_add_ps(_mm512_add_ps(a, b));
#else
    float s = 0.f;
    for (int64_t j = 0; j < k; j++) s += bf2f(w[j]) * bf2f(x[j]);
    return s;
#endif
}

static inline float dot_f32(const float *w, const float *x, int64_t k) {
#if defined(__AVX512F__)
    __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 32 <= k; j += 32) {
        a = _mm512_fmadd_ps(_mm512_loadu_ps(w + j), _mm512_loadu_ps(x + j), a);
        b = _mm512_fmadd_ps(_mm512_loadu_ps(w + j + 16), _mm512_loadu_ps(x + j + 16), b);
    }
    for (; j < k; j += 16) a = _mm512_fmadd_ps(_mm512_loadu_ps(w + j), _mm512_loadu_ps(x + j), a);
    return _mm512_reduce_add_ps(_mm512_add_ps(a, b));
#else
    float s = 0.f;
    for (int64_t j = 0; j < k; j++) s += w[j] * x[j];
    return s;
#endif
}

/* y[m, n] = rnd(W[n, :] . x[m, :] + bias[n]) for m < rows; W [n_out, k] in the model dtype.
 * x: float rows [rows, k] already holding model-dtype values; xb: scratch for their bf16 copy.
 * Each thread takes a contiguous block of weight rows and reads each row once for all m. */
static void project(const Model *md, int64_t w_addr, int64_t b_addr, const float *x, uint16_t *xb, int rows,
                    int64_t n_out, int64_t k, float *y, int nt) {
    const int bf = md->dtype == DT_BF16;
    if (bf)
        for (int64_t i = 0; i < rows * k; i++) xb[i] = f2bf(x[i]); /* exact: x holds bf16 values */
    const void *w = (const void *)w_addr, *bias = (const void *)b_addr;
#pragma omp parallel num_threads(nt)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        const int64_t n0 = n_out * t / T, n1 = n_out * (t + 1) / T;
        for (int64_t n = n0; n < n1; n++) {
            const float b = bias ? load(bias, n, bf) : 0.f;
            for (int m = 0; m < rows; m++) {
                const float acc = bf ? dot_bf16((const uint16_t *)w + n * k, xb + m * k, k)
                                     : dot_f32((const float *)w + n * k, x + m * k, k);
                y[m * n_out + n] = rnd(acc + b, bf);
            }
        }
    }
}

/* ---- elementwise steps over one row -------------------------------------------------------- */
/* RMSNorm as flover's rms_norm: float32 inside; in bfloat16 normalised, rounded, then scaled
 * and rounded again (weight * F.rms_norm(x)); in float32 x * rstd * weight. */
static void rms_norm(const float *x, const void *weight, float eps, int64_t h, int bf, float *out) {
    float ss = 0.f;
    for (int64_t i = 0; i < h; i++) ss += x[i] * x[i];
    const float rstd = 1.f / sqrtf(ss / (float)h + eps);
    for (int64_t i = 0; i < h; i++) {
        const float w = load(weight, i, bf);
        out[i] = bf ? rnd(w * rnd(x[i] * rstd, 1), 1) : x[i] * rstd * w;
    }
}

/* Rotate one head in place: x * cos + roll(x, d / 2) * sin_signed (the sign folded into the
 * table, as flover's Rotary), rounded as PyTorch's mul then addcmul. */
static void rope(float *x, const void *cos_row, const void *sin_row, int64_t d, int bf) {
    float rolled[512];
    const int64_t half = d / 2;
    for (int64_t i = 0; i < d; i++) rolled[i] = x[i < half ? i + half : i - half];
    for (int64_t i = 0; i < d; i++)
        x[i] = rnd(rnd(x[i] * load(cos_row, i, bf), bf) + rolled[i] * load(sin_row, i, bf), bf);
}

static inline float silu(float g) { return g / (1.f + expf(-g)); }

/* ---- attention of one query head over its slot's cached keys -------------------------------- */
static void attend(const Model *md, const float *q, const void *k_base, const void *v_base, int64_t first,
                   int64_t len, float *scores, float *out) {
    const int bf = md->dtype == DT_BF16;
    const int64_t d = md->head_dim, pos = md->kv_pos;
    const float scale = 1.f / sqrtf((float)d);
    float best = -INFINITY;
    for (int64_t t = first; t < len; t++) {
        float s = 0.f;
#if defined(__AVX512F__)
        if (d % 16 == 0) {
            __m512 a = _mm512_setzero_ps();
            for (int64_t i = 0; i < d; i += 16) {
                __m512 kv = bf ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                                     _mm256_loadu_si256((const __m256i *)((const uint16_t *)k_base + t * pos + i))), 16))
                               : _mm512_loadu_ps((const float *)k_base + t * pos + i);
                a = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), kv, a);
            }
            s = _mm512_reduce_add_ps(a);
        } else
#endif
            for (int64_t i = 0; i < d; i++) s += q[i] * load(k_base, t * pos + i, bf);
        scores[t] = s * scale;
        if (scores[t] > best) best = scores[t];
    }
    float total = 0.f;
    for (int64_t t = first; t < len; t++) {
        scores[t] = expf(scores[t] - best);
        total += scores[t];
    }
    for (int64_t i = 0; i < d; i++) out[i] = 0.f;
    for (int64_t t = first; t < len; t++) {
        const float p = scores[t] / total;
#if defined(__AVX512F__)
        if (d % 16 == 0) {
            const __m512 pv = _mm512_set1_ps(p);
            for (int64_t i = 0; i < d; i += 16) {
                __m512 vv = bf ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                                     _mm256_loadu_si256((const __m256i *)((const uint16_t *)v_base + t * pos + i))), 16))
                               : _mm512_loadu_ps((const float *)v_base + t * pos + i);
                _mm512_storeu_ps(out + i, _mm512_fmadd_ps(pv, vv, _mm512_loadu_ps(out + i)));
            }
            continue;
        }
#endif
        for (int64_t i = 0; i < d; i++) out[i] += p * load(v_base, t * pos + i, bf);
    }
    for (int64_t i = 0; i < d; i++) out[i] = rnd(out[i], bf);
}

/* Sizes of the float scratch `work` the caller provides (flover/native_decode.py allocates it). */
int64_t flover_work_floats(const Model *md, int rows) {
    const int64_t h = md->hidden, qkv = (md->heads + 2 * md->kv_heads) * md->head_dim;
    const int64_t widest = qkv > 2 * md->inter ? qkv : 2 * md->inter;
    const int64_t inner = md->inter > h ? md->inter : h;
    /* hidden, normed, qkv / gate_up, attention out / activation, bf16 copies, attention scores */
    return rows * (2 * h + widest + inner + widest) + (int64_t)rows * md->heads * md->max_seq;
}

/* One decode iteration: rows tokens, token r at position positions[r] of slot slots[r] (its
 * K/V are written there, it attends to keys [0, positions[r]]). logits: [rows, vocab] in the
 * model dtype. Returns 0. */
int flover_decode(const Model *md, const Layer *layers, int rows, const int64_t *tokens, const int64_t *positions,
                  const int64_t *slots, void *logits, float *work, double eps_d, int nt) {
    const int bf = md->dtype == DT_BF16;
    const float eps = (float)eps_d;
    const int64_t h = md->hidden, d = md->head_dim, heads = md->heads, kvh = md->kv_heads, inter = md->inter;
    const int64_t q_size = heads * d, kv_size = kvh * d, qkv_n = q_size + 2 * kv_size;
    const int64_t widest = qkv_n > 2 * inter ? qkv_n : 2 * inter;
    const int64_t inner = inter > h ? inter : h;
    float *hidden = work, *normed = hidden + rows * h, *wide = normed + rows * h, *mid = wide + rows * widest;
    float *xb_f = mid + rows * inner;
    uint16_t *xb = (uint16_t *)xb_f; /* bf16 copies of projection inputs (fits in rows * widest floats) */
    float *scores = xb_f + rows * widest;
    const int64_t es = bf ? 2 : 4; /* bytes per element of the model dtype */

    for (int r = 0; r < rows; r++)
        for (int64_t i = 0; i < h; i++) hidden[r * h + i] = load((const void *)md->embed, tokens[r] * h + i, bf);

    for (int64_t l = 0; l < md->layers; l++) {
        const Layer *ly = &layers[l];
        for (int r = 0; r < rows; r++) rms_norm(hidden + r * h, (const void *)ly->input_norm, eps, h, bf, normed + r * h);
        project(md, ly->qkv, ly->qkv_bias, normed, xb, rows, qkv_n, h, wide, nt);

        char *kv_layer = (char *)md->kv + l * md->kv_layer * es;
        for (int r = 0; r < rows; r++) {
            float *row = wide + r * qkv_n;
            const int64_t p = positions[r];
            const void *cos_row = (const char *)md->cos + p * d * es, *sin_row = (const char *)md->sin + p * d * es;
            for (int64_t hh = 0; hh < heads + kvh; hh++) rope(row + hh * d, cos_row, sin_row, d, bf);
            for (int64_t g = 0; g < kvh; g++) {
                void *k_dst = kv_layer + (slots[r] * md->kv_slot + g * md->kv_head + p * md->kv_pos) * es;
                void *v_dst = kv_layer + (md->kv_kind + slots[r] * md->kv_slot + g * md->kv_head + p * md->kv_pos) * es;
                for (int64_t i = 0; i < d; i++) {
                    store(k_dst, i, row[q_size + g * d + i], bf);
                    store(v_dst, i, row[q_size + kv_size + g * d + i], bf);
                }
            }
        }
        /* attention: one task per (row, query head) */
#pragma omp parallel for num_threads(nt) schedule(static)
        for (int64_t task = 0; task < rows * heads; task++) {
            const int r = (int)(task / heads);
            const int64_t head = task % heads, g = head / (heads / kvh);
            const int64_t len = positions[r] + 1;
            const int64_t first = ly->window > 0 && len > ly->window ? len - ly->window : 0;
            const char *k_base = kv_layer + (slots[r] * md->kv_slot + g * md->kv_head) * es;
            const char *v_base = kv_layer + (md->kv_kind + slots[r] * md->kv_slot + g * md->kv_head) * es;
            attend(md, wide + r * qkv_n + head * d, k_base, v_base, first, len, scores + task * md->max_seq,
                   mid + r * q_size + head * d);
        }
        project(md, ly->o, 0, mid, xb, rows, h, q_size, normed, nt);
        for (int r = 0; r < rows; r++)
            for (int64_t i = 0; i < h; i++) {
                float o = normed[r * h + i];
                if (ly->o_bias) o = rnd(o + load((const void *)ly->o_bias, i, bf), bf);
                hidden[r * h + i] = rnd(hidden[r * h + i] + o, bf);
            }

        for (int r = 0; r < rows; r++) rms_norm(hidden + r * h, (const void *)ly->post_norm, eps, h, bf, normed + r * h);
        project(md, ly->gate_up, ly->gate_up_bias, normed, xb, rows, 2 * inter, h, wide, nt);
        for (int r = 0; r < rows; r++)
            for (int64_t i = 0; i < inter; i++)
                mid[r * inter + i] = rnd(rnd(silu(wide[r * 2 * inter + i]), bf) * wide[r * 2 * inter + inter + i], bf);
        project(md, ly->down, 0, mid, xb, rows, h, inter, normed, nt);
        for (int r = 0; r < rows; r++)
            for (int64_t i = 0; i < h; i++) {
                float o = normed[r * h + i];
                if (ly->down_bias) o = rnd(o + load((const void *)ly->down_bias, i, bf), bf);
                hidden[r * h + i] = rnd(hidden[r * h + i] + o, bf);
            }
    }
    for (int r = 0; r < rows; r++) rms_norm(hidden + r * h, (const void *)md->final_norm, eps, h, bf, normed + r * h);
    /* the LM head writes the model dtype straight into `logits` */
    const int64_t v = md->vocab;
    if (bf) {
        for (int64_t i = 0; i < rows * h; i++) xb[i] = f2bf(normed[i]);
    }
#pragma omp parallel num_threads(nt)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        const int64_t n0 = v * t / T, n1 = v * (t + 1) / T;
        for (int64_t n = n0; n < n1; n++)
            for (int r = 0; r < rows; r++) {
                const float acc = bf ? dot_bf16((const uint16_t *)md->head + n * h, xb + r * h, h)
                                     : dot_f32((const float *)md->head + n * h, normed + r * h, h);
                store(logits, r * v + n, acc, bf);
            }
    }
    return 0;
}
