/* Element-wise steps over one row, rounded as the PyTorch path (flover/models/llama.py) rounds:
 * in bfloat16 every intermediate PyTorch stores is rounded here at the same point. */
#include <omp.h>

#include <string.h>

#include "native.h"

/* RMSNorm as flover's rms_norm: float32 inside; in bfloat16 normalised, rounded, then scaled
 * and rounded again (weight * F.rms_norm(x)); in float32 x * rstd * weight. */
void rms_norm(const float *x, const void *weight, float eps, int64_t h, int bf, float *out) {
    v16 acc = v_zero();
    for (int64_t i = 0; i < h; i += 16) {
        const v16 v = v_loadn(x + i, h - i);
        acc = v_fmadd(v, v, acc);
    }
    const v16 r = v_set1(1.f / sqrtf(v_reduce_add(acc) / (float)h + eps));
    for (int64_t i = 0; i < h; i += 16) {
        const v16 w = v_loadx(weight, i, bf, h - i), v = v_loadn(x + i, h - i);
        v_storen(out + i, bf ? v_round_bf16(v_mul(w, v_round_bf16(v_mul(v, r)))) : v_mul(v_mul(v, r), w), h - i);
    }
}

/* Gemma's RMSNorm: `weight` is float32 (1 + w); normalized and scaled in float32, rounded once. */
static void rms_norm_f32w(const float *x, const float *weight, float eps, int64_t h, int bf, float *out) {
    v16 acc = v_zero();
    for (int64_t i = 0; i < h; i += 16) {
        const v16 v = v_loadn(x + i, h - i);
        acc = v_fmadd(v, v, acc);
    }
    const v16 r = v_set1(1.f / sqrtf(v_reduce_add(acc) / (float)h + eps));
    for (int64_t i = 0; i < h; i += 16)
        v_storen(out + i, v_rnd(v_mul(v_mul(v_loadn(x + i, h - i), r), v_loadn(weight + i, h - i)), bf), h - i);
}

/* The model's norm of one row (float32 weights, rounded once, where md->norm_f32); `weight` an address. */
void norm_row(const Model *md, const float *x, int64_t weight, float eps, int64_t h, int bf, float *out) {
    if (md->norm_f32) rms_norm_f32w(x, (const float *)weight, eps, h, bf, out);
    else rms_norm(x, (const void *)weight, eps, h, bf, out);
}

/* Rotate one head in place: x * cos + roll(x, d / 2) * sin_signed (the sign folded into the
 * table, as flover's Rotary), rounded as PyTorch's mul then addcmul. */
void rope(float *x, const void *cos_row, const void *sin_row, int64_t d, int bf) {
    const int64_t half = d / 2;
    for (int64_t i = 0; i < half; i += 16) {
        const int64_t n = half - i;
        const v16 lo = v_loadn(x + i, n), hi = v_loadn(x + half + i, n);
        const v16 new_lo = v_rnd(v_fmadd(hi, v_loadx(sin_row, i, bf, n), v_rnd(v_mul(lo, v_loadx(cos_row, i, bf, n)), bf)), bf);
        const v16 new_hi =
            v_rnd(v_fmadd(lo, v_loadx(sin_row, half + i, bf, n), v_rnd(v_mul(hi, v_loadx(cos_row, half + i, bf, n)), bf)), bf);
        v_storen(x + i, new_lo, n);
        v_storen(x + half + i, new_hi, n);
    }
}

/* hidden += rnd(rnd(out + bias) * scale): a residual add after a row-parallel projection (scale
 * 0: none), rounded where PyTorch rounds. */
static void add_residual(float *hidden, const float *out, const void *bias, int64_t h, int bf, float scale) {
    for (int64_t i = 0; i < h; i += 16) {
        v16 o = v_loadn(out + i, h - i);
        if (bias) o = v_rnd(v_add(o, v_loadx(bias, i, bf, h - i)), bf);
        if (scale != 0.f) o = v_rnd(v_mul(o, v_set1(scale)), bf);
        v_storen(hidden + i, v_rnd(v_add(v_loadn(hidden + i, h - i), o), bf), h - i);
    }
}

/* hidden += out (+ bias) for every row, then (unless norm is 0) normed = rms_norm(hidden): in one
 * pass per row (out is read before normed overwrites it: they may be the same rows). */
void residual_and_norm(const Model *md, float *hidden, float *out, int rows, int64_t bias, int64_t norm, float eps, int64_t h, int bf,
                       int nt) {
#pragma omp parallel for num_threads(nt) schedule(static) if (rows >= 16)
    for (int r = 0; r < rows; r++) {
        add_residual(hidden + r * h, out + r * h, (const void *)bias, h, bf, (float)md->residual_scale);
        if (norm) norm_row(md, hidden + r * h, norm, eps, h, bf, out + r * h);
    }
}

/* The layout with norms after attention and the MLP (OLMo 2): hidden += rms_norm(out, norm) for
 * every row, then out = the next input: rms_norm(hidden, next_norm), or hidden itself (0). */
void norm_then_residual(const Model *md, float *hidden, float *out, int rows, int64_t norm, int64_t next_norm, float eps, int64_t h,
                        int bf, int nt) {
#pragma omp parallel for num_threads(nt) schedule(static) if (rows >= 16)
    for (int r = 0; r < rows; r++) {
        norm_row(md, out + r * h, norm, eps, h, bf, out + r * h);
        add_residual(hidden + r * h, out + r * h, 0, h, bf, (float)md->residual_scale);
        if (next_norm) norm_row(md, hidden + r * h, next_norm, eps, h, bf, out + r * h);
        else memcpy(out + r * h, hidden + r * h, h * sizeof(float));
    }
}

/* out = rnd(rnd(silu(gate)) * up) over gate_up = [gate | up], as F.silu then the product. */
void silu_mul(const float *gate_up, int64_t inter, int bf, float *out) {
    const float *up = gate_up + inter;
    for (int64_t i = 0; i < inter; i += 16) {
        const int64_t n = inter - i;
        v_storen(out + i, silu_times(v_loadn(gate_up + i, n), v_loadn(up + i, n), bf), n);
    }
}

/* gpt-oss's clamped SwiGLU, rounded where PyTorch rounds (transformers' GptOssExperts): g = min(gate,
 * limit), u = clamp(up, -limit, limit), out = rnd(rnd(u + 1) * rnd(g * rnd(sigmoid(rnd(alpha g))))). */
void swiglu_clamped_mul(const float *gate_up, int64_t inter, int bf, float limit, float alpha, float *out) {
    const float *up = gate_up + inter;
    for (int64_t i = 0; i < inter; i += 16) {
        const int64_t n = inter - i;
        /* (the bound first: a NaN input stays NaN, as in torch.clamp) */
        const v16 g = v_min(v_set1(limit), v_loadn(gate_up + i, n));
        const v16 u = v_max(v_set1(-limit), v_min(v_set1(limit), v_loadn(up + i, n)));
        const v16 a = v_rnd(v_mul(g, v_set1(alpha)), bf);
        const v16 sig = v_rnd(v_div(v_set1(1.f), v_add(v_set1(1.f), v_exp(v_sub(v_zero(), a)))), bf);
        const v16 glu = v_rnd(v_mul(g, sig), bf);
        v_storen(out + i, v_rnd(v_mul(v_rnd(v_add(u, v_set1(1.f)), bf), glu), bf), n);
    }
}

/* F.gelu(approximate="tanh"), unrounded: 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))),
 * tanh(y) = 1 - 2 / (exp(2y) + 1). */
static inline v16 v_gelu_tanh(v16 g) {
    const v16 y = v_mul(v_set1(0.7978845608028654f), v_fmadd(v_mul(v_set1(0.044715f), v_mul(g, g)), g, g));
    const v16 t = v_sub(v_set1(1.f), v_div(v_set1(2.f), v_add(v_exp(v_add(y, y)), v_set1(1.f))));
    return v_mul(v_mul(v_set1(0.5f), g), v_add(v_set1(1.f), t));
}

/* out = rnd(rnd(gelu_tanh(gate)) * up), as F.gelu(approximate="tanh") then the product (Gemma's GeGLU). */
void gelu_mul(const float *gate_up, int64_t inter, int bf, float *out) {
    const float *up = gate_up + inter;
    for (int64_t i = 0; i < inter; i += 16) {
        const int64_t n = inter - i;
        const v16 act = v_rnd(v_gelu_tanh(v_loadn(gate_up + i, n)), bf);
        v_storen(out + i, v_rnd(v_mul(act, v_loadn(up + i, n)), bf), n);
    }
}

/* LayerNorm of one row as F.layer_norm (BERT's): mean and variance in float32, then
 * (x - mean) * rstd * weight + bias, rounded once; weight and bias in the model dtype. In place
 * is allowed (out == x). */
void layer_norm(const float *x, const void *weight, const void *bias, float eps, int64_t h, int bf, float *out) {
    v16 acc = v_zero();
    for (int64_t i = 0; i < h; i += 16) acc = v_add(acc, v_loadn(x + i, h - i));
    const v16 mean = v_set1(v_reduce_add(acc) / (float)h);
    v16 var = v_zero();
    for (int64_t i = 0; i < h; i += 16) {
        const v16 d = v_select(lanes(h - i), v_sub(v_loadn(x + i, h - i), mean), v_zero());
        var = v_fmadd(d, d, var);
    }
    const v16 r = v_set1(1.f / sqrtf(v_reduce_add(var) / (float)h + eps));
    for (int64_t i = 0; i < h; i += 16) {
        const int64_t n = h - i;
        const v16 y = v_fmadd(v_mul(v_sub(v_loadn(x + i, n), mean), r), v_loadx(weight, i, bf, n), v_loadx(bias, i, bf, n));
        v_storen(out + i, v_rnd(y, bf), n);
    }
}

/* erf as PyTorch's vectorized CPU kernels compute it (Abramowitz and Stegun 7.1.26: |error| below
 * 1.5e-7): sign(x) (1 - r(t) t exp(-x^2)), t = 1 / (1 + 0.3275911 |x|). */
static inline v16 v_erf(v16 x) {
    const v16 one = v_set1(1.f), t = v_div(one, v_fmadd(v_set1(0.3275911f), v_abs(x), one));
    v16 r = v_fmadd(v_set1(1.061405429f), t, v_set1(-1.453152027f));
    r = v_fmadd(r, t, v_set1(1.421413741f));
    r = v_fmadd(r, t, v_set1(-0.284496736f));
    r = v_fmadd(r, t, v_set1(0.254829592f));
    const v16 e = v_fnmadd(v_mul(v_exp(v_sub(v_zero(), v_mul(x, x))), t), r, one);
    return v_select(v_gt(v_zero(), x), v_sub(v_zero(), e), e);
}

/* out = rnd(gelu(x)) over n values, as F.gelu: erf's form (x / 2 (1 + erf(x / sqrt 2))), or with
 * tanh_form the tanh approximation (gelu_mul's). */
void gelu_row(const float *x, int64_t n, int tanh_form, int bf, float *out) {
    for (int64_t i = 0; i < n; i += 16) {
        const int64_t m = n - i;
        const v16 g = v_loadn(x + i, m);
        const v16 act = tanh_form ? v_gelu_tanh(g)
                                  : v_mul(v_mul(v_set1(0.5f), g), v_add(v_set1(1.f), v_erf(v_mul(g, v_set1(0.70710678118654752f)))));
        v_storen(out + i, v_rnd(act, bf), m);
    }
}
