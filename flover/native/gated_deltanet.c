/* Gated DeltaNet layers (Qwen3.5 / 3.6) in the native step; flover/models/gated_deltanet.py is
 * the reference and says what the layer computes. Here, over the iteration's rows after the
 * layer's fused input projection (q k v | z | b | a, `x` [rows, stride]):
 *
 *   delta_conv   the causal depthwise conv and SiLU of q, k and v, in place, per channel over each
 *                run of rows of one slot, from and back to the slot's conv state;
 *   delta_heads  per (run, value head): the delta rule one token at a time (the recurrence the
 *                chunked form equals), on the slot's float32 state in place, then the gated
 *                RMSNorm of the head's output into `out` [rows, value heads x dv].
 *
 * A run is the rows of one sequence in this iteration (a decode row alone, a prompt chunk, or a
 * prompt's two chunks around a prefix-cache snapshot): its rows go in order, runs and heads in
 * parallel, so a row's result depends on its own sequence only (fused = solo, bit for bit). A run
 * that starts at position 0 starts from zeros. After a row that md->snapshot_rows names, the
 * state goes to that snapshot row too (engine/prefix_cache.py).
 *
 * Rounding follows the reference: the conv's and SiLU's outputs, beta and the head outputs in the
 * model dtype; q, k, the decay and the state in float32. */
#include <math.h>
#include <omp.h>

#include "native.h"

static inline float silu1(float x) { return x / (1.f + expf(-x)); }
static inline float softplus1(float x) { return x > 20.f ? x : log1pf(expf(x)); } /* (PyTorch's threshold) */

static inline void store1(void *p, int64_t i, float v, int bf) {
    if (bf) ((uint16_t *)p)[i] = f2bf(v);
    else ((float *)p)[i] = v;
}

int64_t delta_channels(const Model *md) {
    return 2 * md->delta_key_heads * md->delta_dk + md->delta_value_heads * md->delta_dv;
}

int64_t delta_in_width(const Model *md) {
    return delta_channels(md) + md->delta_value_heads * md->delta_dv + 2 * md->delta_value_heads;
}

/* The iteration's runs: [first row, rows] pairs of consecutive rows of one slot at consecutive
 * positions. Their count. */
int64_t delta_runs(const int64_t *slots, const int64_t *positions, int rows, int64_t *runs) {
    int64_t n = 0;
    for (int r = 0; r < rows;) {
        int len = 1;
        while (r + len < rows && slots[r + len] == slots[r] && positions[r + len] == positions[r + len - 1] + 1) len++;
        runs[2 * n] = r, runs[2 * n + 1] = len, n++;
        r += len;
    }
    return n;
}

static inline int64_t snapshot_of(const Model *md, int64_t r) {
    return md->snapshot_rows ? ((const int64_t *)md->snapshot_rows)[r] : -1;
}

void delta_conv(const Model *md, const Layer *ly, float *x, int64_t stride, const int64_t *slots,
                const int64_t *positions, const int64_t *runs, int64_t n_runs, int bf, int nt) {
    const int64_t channels = delta_channels(md), taps = md->delta_conv, kept = taps - 1;
    const float *weights = (const float *)ly->delta_conv_w; /* [channels, taps] */
    void *state = (void *)ly->conv_state, *snaps = (void *)ly->snap_conv;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t c = 0; c < channels; c++) {
        const float *w = weights + c * taps;
        float prev[64];
        for (int64_t u = 0; u < n_runs; u++) {
            const int64_t r0 = runs[2 * u], n = runs[2 * u + 1], at = (slots[r0] * channels + c) * kept;
            for (int64_t j = 0; j < kept; j++) prev[j] = positions[r0] > 0 ? load(state, at + j, bf) : 0.f;
            for (int64_t r = r0; r < r0 + n; r++) {
                const float in = x[r * stride + c];
                float acc = 0.f;
                for (int64_t j = 0; j < kept; j++) acc += w[j] * prev[j];
                acc += w[kept] * in;
                for (int64_t j = 0; j + 1 < kept; j++) prev[j] = prev[j + 1];
                prev[kept - 1] = in;
                x[r * stride + c] = rnd(silu1(rnd(acc, bf)), bf);
                const int64_t snap = snapshot_of(md, r);
                for (int64_t j = 0; snap >= 0 && j < kept; j++) store1(snaps, (snap * channels + c) * kept + j, prev[j], bf);
            }
            for (int64_t j = 0; j < kept; j++) store1(state, at + j, prev[j], bf);
        }
    }
}

/* q (or k) of one key head, L2-normalised in float32 (times `scale`): into out [dk]. */
static void l2_normed(const float *x, int64_t dk, float scale, float *out) {
    float sum = 0.f;
    for (int64_t i = 0; i < dk; i++) sum += x[i] * x[i];
    const float inv = 1.f / sqrtf(sum + 1e-6f);
    for (int64_t i = 0; i < dk; i++) out[i] = x[i] * inv * scale;
}

/* One token of one head: S <- exp(g) S; S <- S + k (beta (v - S^T k))^T; o = S^T q. */
static void delta_token(float *s, const float *q, const float *k, const float *v, float g, float beta, int64_t dk,
                        int64_t dv, float *mem, float *o) {
    const float decay = expf(g);
    for (int64_t j = 0; j < dv; j++) mem[j] = 0.f;
    for (int64_t i = 0; i < dk; i++) {
        float *si = s + i * dv;
#pragma omp simd
        for (int64_t j = 0; j < dv; j++) {
            si[j] *= decay;
            mem[j] += si[j] * k[i];
        }
    }
    for (int64_t j = 0; j < dv; j++) mem[j] = (v[j] - mem[j]) * beta; /* the delta, times beta */
    for (int64_t j = 0; j < dv; j++) o[j] = 0.f;
    for (int64_t i = 0; i < dk; i++) {
        float *si = s + i * dv;
#pragma omp simd
        for (int64_t j = 0; j < dv; j++) {
            si[j] += k[i] * mem[j];
            o[j] += si[j] * q[i];
        }
    }
}

/* The head's output o [dv] (model-dtype values) RMS-normed, times the weight, times SiLU(z). */
static void gated_norm(const float *o, const float *z, const void *weight, float eps, int64_t dv, int bf, float *out) {
    float sum = 0.f;
    for (int64_t j = 0; j < dv; j++) sum += o[j] * o[j];
    const float inv = 1.f / sqrtf(sum / (float)dv + eps);
    for (int64_t j = 0; j < dv; j++) out[j] = rnd(rnd(load(weight, j, bf) * rnd(o[j] * inv, bf), bf) * silu1(z[j]), bf);
}

void delta_heads(const Model *md, const Layer *ly, const float *x, int64_t stride, float *out, const int64_t *slots,
                 const int64_t *positions, const int64_t *runs, int64_t n_runs, float eps, int bf, float *scratch,
                 int64_t per_thread, int nt) {
    const int64_t kh = md->delta_key_heads, vh = md->delta_value_heads, dk = md->delta_dk, dv = md->delta_dv;
    const int64_t channels = delta_channels(md), qk = kh * dk, group = vh / kh;
    const float *a_neg = (const float *)ly->delta_a;
    const void *dt_bias = (const void *)ly->delta_dt_bias, *norm_w = (const void *)ly->delta_norm; /* model dtype */
    float *states = (float *)ly->ssm_state, *snaps = (float *)ly->snap_ssm;
    const float q_scale = 1.f / sqrtf((float)dk);
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
    for (int64_t task = 0; task < n_runs * vh; task++) {
        const int64_t u = task / vh, hd = task % vh, key = md->delta_tiled ? hd % kh : hd / group;
        const int64_t r0 = runs[2 * u], n = runs[2 * u + 1];
        float *s = states + (slots[r0] * vh + hd) * dk * dv;
        float *q = scratch + (int64_t)omp_get_thread_num() * per_thread, *k = q + dk, *mem = k + dk, *o = mem + dv;
        if (positions[r0] == 0) memset(s, 0, dk * dv * sizeof(float));
        for (int64_t r = r0; r < r0 + n; r++) {
            const float *row = x + r * stride;
            l2_normed(row + key * dk, dk, q_scale, q);
            l2_normed(row + qk + key * dk, dk, 1.f, k);
            const float beta = rnd(sigmoid1(row[channels + vh * dv + hd]), bf);
            const float g = a_neg[hd] * softplus1(row[channels + vh * dv + vh + hd] + load(dt_bias, hd, bf));
            delta_token(s, q, k, row + 2 * qk + hd * dv, g, beta, dk, dv, mem, o);
            for (int64_t j = 0; j < dv; j++) o[j] = rnd(o[j], bf);
            gated_norm(o, row + channels + hd * dv, norm_w, eps, dv, bf, out + r * vh * dv + hd * dv);
            const int64_t snap = snapshot_of(md, r);
            if (snap >= 0) memcpy(snaps + (snap * vh + hd) * dk * dv, s, dk * dv * sizeof(float));
        }
    }
}
