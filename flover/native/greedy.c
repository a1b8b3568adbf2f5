/* Greedy ids without the engine's tensor operations: argmax of stored logits, and (greedy rows
 * of a forward) the id straight from the LM head, through a screen or as its tiles come out. */
#include <omp.h>

#include "native.h"

/* 16 values of a row from i on, -inf past its end and where `allowed`'s bit is clear */
static inline v16 allowed_lanes(const void *row, int64_t i, int64_t vocab, int bf, const uint16_t *allowed) {
    const m16 live = lanes(vocab - i) & (allowed ? allowed[i / 16] : M16_ALL);
    return v_select(live, v_loadx(row, i, bf, vocab - i), v_set1(-INFINITY));
}

/* Greedy sampling: the index of the first maximum of a row of `vocab` values of the model dtype,
 * NaN counting as the maximum: torch.argmax's answer, without its scalar loop over a large
 * vocabulary. `allowed` (or NULL): structured output's
 * bitmask, 16 tokens a half-word; a token whose bit is clear counts as -inf (the argmax of the
 * masked row). flover_argmax: rows `stride` elements apart, no mask. */
int64_t argmax_row(const void *row, int64_t vocab, int bf, const uint16_t *allowed) {
    v16 top = v_set1(-INFINITY);
    m16 nan = 0;
    for (int64_t i = 0; i < vocab && !nan; i += 16) {
        const v16 v = allowed_lanes(row, i, vocab, bf, allowed);
        nan = v_nan(v);
        top = v_max(v, top); /* a NaN lane keeps top's value: NaN is found above */
    }
    const v16 most = v_set1(v_reduce_max(top));
    for (int64_t i = 0; i < vocab; i += 16) {
        const v16 v = allowed_lanes(row, i, vocab, bf, allowed);
        const m16 hit = lanes(vocab - i) & (nan ? v_nan(v) : v_eq(v, most));
        if (hit) return i + __builtin_ctz(hit);
    }
    return 0;
}

API void flover_argmax(const void *logits, int rows, int64_t vocab, int64_t stride, int bf, int64_t *ids, int nt) {
#pragma omp parallel for num_threads(nt) schedule(static) if (rows >= 4)
    for (int r = 0; r < rows; r++)
        ids[r] = argmax_row((const char *)logits + (int64_t)r * stride * (bf ? 2 : 4), vocab, bf, NULL);
}

/* ---- greedy through a screen of the LM head -------------------------------------------------
 * A greedy row needs the index of its largest logit, not the logits, and the head is a fifth of
 * a token's bytes and FLOPs (SmolLM2: 49152 x 576). So a cheaper copy of the head scores every
 * vocabulary row first: bfloat16 for a float32 model (half the bytes), int8 with one scale per
 * row for a bfloat16 model (half the bytes). With a bound B_j >= |s_j - f_j| between the
 * screen's s_j and the exact logit f_j (float32, whatever the model dtype), only rows whose
 * s_j + B_j reaches lo = max_k (s_k - B_k) can hold the maximum. Those few are summed again by
 * the model's own tile, so the id is the one the whole head's argmax gives, bit for bit.
 * B_j = |x| * bounds[j], |x| the L2 norm (bfloat16 screen) or the L1 norm (int8), and bounds[j]
 * from flover/native/forward.py (`HeadScreen`; docs/design_notes.md derives the error terms),
 * plus 2^-10 of margin for the float rounding of |x| and B_j, 2^-20 |s_j| for that of s_j -+ B_j,
 * and 1e-30 for denormals (the dot-product instruction flushes them). Rows with a non-finite
 * value, or too many candidates (near-uniform logits), take the whole head. */
enum { SCREEN_MAX_CANDIDATES = 256 };

/* ids[r] for the final-normed rows x [rows, h]; scores: [rows, vocab] floats of scratch; xb: the
 * projections' operand scratch. Returns the rows that took the whole head. */
int screened_greedy(const Model *md, const float *x, void *xb, int rows, float *scores, int64_t *ids, int nt) {
    if (rows <= 0) return 0;
    const int bf = md->dtype == DT_BF16, exact_kind = bf ? W_BF16 : W_F32;
    const int64_t h = md->hidden, vocab = md->vocab;
    const float *bounds = (const float *)md->head_bounds;
    if (bf) { /* int8 codes, row scales; the operand is x's bfloat16 values (exact), as the head's */
        project_kind(W_Q8, 0, md->head_screen, md->head_screen_scales, 0, x, xb, rows, vocab, h, scores, vocab, 0, nt, 0);
    } else { /* bfloat16 of x to nearest, then bfloat16 weights */
        for (int64_t i = 0; i < rows * h; i++)
            if (operand_is_bf16(W_BF16)) ((uint16_t *)xb)[i] = f2bf(x[i]);
            else ((float *)xb)[i] = rnd(x[i], 1);
        project_kind(W_BF16, 0, md->head_screen, 0, 0, 0, xb, rows, vocab, h, scores, vocab, 0, nt, 0);
    }
    int full[rows], n_full = 0;
#pragma omp parallel for num_threads(nt) schedule(static) if (rows >= 2) reduction(+ : n_full)
    for (int r = 0; r < rows; r++) {
        const float *a = x + r * h, *s = scores + r * vocab;
        double norm = 0.;
        int finite = 1;
        for (int64_t i = 0; i < h; i++) norm += bf ? fabs((double)a[i]) : (double)a[i] * a[i], finite &= isfinite(a[i]);
        const float scale = (float)((bf ? norm : sqrt(norm)) * (1 + 0x1p-10)), rel = 0x1p-20f, tiny = 1e-30f;
        int64_t cand[SCREEN_MAX_CANDIDATES], n = 0;
#define BOUND(v, j, count) v_fmadd(v_set1(scale), v_loadn(bounds + (j), count), v_fmadd(v_set1(rel), v_abs(v), v_set1(tiny)))
        v16 low = v_set1(-INFINITY);
        m16 bad = 0;
        for (int64_t j = 0; j < vocab; j += 16) {
            const m16 m = lanes(vocab - j);
            const v16 v = v_loadn(s + j, vocab - j), b = BOUND(v, j, vocab - j);
            bad |= v_nan(v_sub(v, v)) & m; /* NaN, inf */
            low = v_select(m, v_max(low, v_sub(v, b)), low);
        }
        finite &= !bad;
        const v16 threshold = v_set1(v_reduce_max(low)); /* lo */
        for (int64_t j = 0; j < vocab && finite && n <= SCREEN_MAX_CANDIDATES; j += 16) {
            const v16 v = v_loadn(s + j, vocab - j);
            m16 hit = v_ge(v_add(v, BOUND(v, j, vocab - j)), threshold) & lanes(vocab - j);
            for (; hit && n < SCREEN_MAX_CANDIDATES; hit &= hit - 1) cand[n++] = j + __builtin_ctz(hit);
            if (hit) n = SCREEN_MAX_CANDIDATES + 1;
        }
#undef BOUND
        full[r] = !finite || !isfinite(scale) || n > SCREEN_MAX_CANDIDATES;
        if (full[r]) {
            n_full++;
            continue;
        }
        /* the candidates' exact logits: their blocks of the head, tiled as the whole head is */
        const void *operand = operand_is_bf16(exact_kind) ? (const void *)((const uint16_t *)xb + r * h) : (const void *)a;
        float out[16], best = 0.f;
        for (int64_t q = 0; q < n; q++) {
            tile((const void *)md->head, cand[q] / 16, h, operand, 0, 1, 1, exact_kind, out, 0);
            const float f = out[cand[q] % 16];
            if (q == 0 || f > best) best = f, ids[r] = cand[q];
        }
    }
    for (int r = 0; r < rows; r++)
        if (full[r]) {
            project_kind(exact_kind, 0, md->head, 0, 0, x + r * h, xb, 1, vocab, h, scores + r * vocab, vocab, 0, nt, 0);
            flover_argmax(scores + r * vocab, 1, vocab, vocab, 0, ids + r, nt);
        }
    return n_full;
}

/* ---- greedy through the whole head ------------------------------------------------------------
 * Rows beyond the screen's (bfloat16 above screen_rows: there the head is compute-bound and the
 * int8 screen no longer pays) take every logit, but none is stored: each tile's outputs (float32
 * logits, as stored ones are) go straight into the row's running maximum
 * (project_kind with a RowMax). The threads' blocks are in order, so the first maximum is the
 * smallest index among the largest values, the lower thread's on a tie, and the first NaN wins:
 * torch.argmax's answer, without writing [rows, vocab] logits and reading them again. Returns
 * the rows (all of them took the whole head). */
int head_greedy(const Model *md, const float *x, void *xb, int rows, int64_t *ids, int nt) {
    float top[nt * rows];
    int64_t at[nt * rows], nan_at[nt * rows];
    for (int i = 0; i < nt * rows; i++) top[i] = -INFINITY, at[i] = nan_at[i] = -1; /* (threads not started) */
    RowMax most = {top, at, nan_at};
    const int bf = md->dtype == DT_BF16;
    project_kind(bf ? W_BF16 : W_F32, 0, md->head, 0, 0, x, xb, rows, md->vocab, md->hidden, 0, 0, 0, nt, &most);
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
