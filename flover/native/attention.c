/* Attention of the native step: a decode row's query heads over their slot's cached keys
 * (attend), and a block of consecutive prompt rows of one slot (attend_prompt). Float32 softmax
 * and weighted sum of values, as the PyTorch path's attention; outputs rounded to the model
 * dtype. A row's result depends only on its own slot and position. --kv-dtype's codes are read
 * as llama.cpp reads them: keys against int8 queries (score_codes), each value block's scale in
 * the weights (pv_block). */
#include "kv_codes.h"
#include "native.h"
#include "simd_int8.h"

/* The weighted sum of values: PV_QUERIES queries at a time, over PV_CHUNKS x 16 dimensions, the
 * accumulators in registers (AVX-512: 4 x 4 of 32; the narrower families take fewer). */
#if defined(V_AVX512)
#define PV_QUERIES 4
#define PV_CHUNKS 4
#else
#define PV_QUERIES 2
#define PV_CHUNKS 2
#endif
#define PV_DIMS (16 * PV_CHUNKS)

int vector_attention(const Model *md) {
    const int64_t group = md->heads / md->kv_heads, d = md->head_dim;
    return group <= MAX_GROUP && d <= MAX_HEAD_DIM && d % 2 == 0;
}

/* G queries of one kv head over C x 16 dimensions from i0: each value row is loaded (and widened
 * from bfloat16) once for the G queries. Query g's weight of key t is sc[g * qs + t * ts], its
 * output outs[g] (divided by total[g], rounded to the model dtype). Per output, keys are added in
 * order first..len-1 (so C changes no result, only the work done on lanes past head_dim). */
#define PV_BLOCK(G, C)                                                                                     \
    static void pv_block_##G##_##C(const void *v_base, int64_t pos, int bf, int vt, int64_t i0, int64_t d, \
                                   int64_t first, int64_t len, const float *sc, int64_t qs, int64_t ts,   \
                                   const float *total, float *const *outs) {                             \
        int64_t n[C];                                                                                      \
        v16 acc[G][C];                                                                                     \
        for (int c = 0; c < C; c++) n[c] = d - i0 - 16 * c;                                                \
        for (int g = 0; g < G; g++)                                                                        \
            for (int c = 0; c < C; c++) acc[g][c] = v_zero();                                              \
        for (int64_t t = first; t < len; t++) {                                                            \
            const uint8_t *row = (const uint8_t *)v_base + t * pos;                                        \
            v16 v[C];                                                                                      \
            float scales[C]; /* (codes: each chunk's block scale, taken into the weight) */                \
            for (int c = 0; c < C; c++) {                                                                  \
                v[c] = n[c] <= 0 ? v_zero()                                                                \
                       : vt  ? kv_codes16(row, i0 + 16 * c, vt)                                            \
                             : v_loadx(v_base, t * pos + i0 + 16 * c, bf, n[c]);                           \
                scales[c] = vt && n[c] > 0 ? kv_scale(row, i0 + 16 * c, vt) : 1.f;                         \
            }                                                                                              \
            for (int g = 0; g < G; g++) {                                                                  \
                const float s = sc[g * qs + t * ts];                                                       \
                for (int c = 0; c < C; c++)                                                                \
                    acc[g][c] = v_fmadd(v_set1(vt ? s * scales[c] : s), v[c], acc[g][c]);                  \
            }                                                                                              \
        }                                                                                                  \
        /* (unrolled whole: a loop here kept acc in memory, stored at every key) */                     \
        _Pragma("GCC unroll 32") for (int g = 0; g < G; g++)                                               \
            _Pragma("GCC unroll 4") for (int c = 0; c < C; c++)                                            \
                if (n[c] > 0) v_storen(outs[g] + i0 + 16 * c, v_rnd(v_div(acc[g][c], v_set1(total[g])), bf), n[c]); \
    }
#define HALF_CHUNKS (PV_CHUNKS / 2)
PV_BLOCK(1, PV_CHUNKS)
PV_BLOCK(2, PV_CHUNKS)
PV_BLOCK(3, PV_CHUNKS)
PV_BLOCK(4, PV_CHUNKS)
PV_BLOCK(1, HALF_CHUNKS)
PV_BLOCK(2, HALF_CHUNKS)
PV_BLOCK(3, HALF_CHUNKS)
PV_BLOCK(4, HALF_CHUNKS)
PV_BLOCK(8, HALF_CHUNKS)
#undef PV_BLOCK

/* pv_block over `queries` queries, PV_QUERIES at a time, and every PV_DIMS dimensions (the last
 * ones, where they fit, in half the chunks: heads of 32 dims on 64-dim blocks did twice the work). */
static void weigh_values(const void *v_base, int64_t pos, int bf, int vt, int64_t d, int64_t first, int64_t len,
                         const float *sc, int64_t qs, int64_t ts, int64_t queries, const float *total,
                         float *const *outs) {
#define PV_CALL(G, C) pv_block_##G##_##C(v_base, pos, bf, vt, i0, d, first, len, s, qs, ts, total + j0, outs + j0)
    int64_t j0 = 0;
    if (d <= 16 * HALF_CHUNKS) /* (small heads: twice the queries a value row is loaded for) */
        for (const int64_t i0 = 0; j0 + 8 <= queries; j0 += 8) {
            const float *s = sc + j0 * qs;
            PV_CALL(8, HALF_CHUNKS);
        }
    for (; j0 < queries; j0 += PV_QUERIES) {
        const int64_t n = queries - j0 < PV_QUERIES ? queries - j0 : PV_QUERIES;
        const float *s = sc + j0 * qs;
        for (int64_t i0 = 0; i0 < d; i0 += PV_DIMS) {
            if (d - i0 <= 16 * HALF_CHUNKS) {
                if (n == 4) PV_CALL(4, HALF_CHUNKS);
                else if (n == 3) PV_CALL(3, HALF_CHUNKS);
                else if (n == 2) PV_CALL(2, HALF_CHUNKS);
                else PV_CALL(1, HALF_CHUNKS);
            } else if (n == 4) PV_CALL(4, PV_CHUNKS);
            else if (n == 3) PV_CALL(3, PV_CHUNKS);
            else if (n == 2) PV_CALL(2, PV_CHUNKS);
            else PV_CALL(1, PV_CHUNKS);
        }
    }
#undef PV_CALL
}

/* Scores of keys [t0, t0 + keys) (keys <= 16) for one query head, scaled: 16 dot products,
 * summed across lanes together (v_sum_each). bfloat16 keys meet the query's bfloat16 copy qb
 * (exact: it holds bfloat16 values) in the dot-product instruction where the CPU has it. */
static inline void score_keys(const float *q, const uint16_t *qb, const void *k_base, int64_t pos, int64_t d,
                              int bf, int64_t t0, int64_t keys, float scale, float *sc) {
    v16 acc[16];
    if (!(bf && has_bf16_dot() && keys_bf16_dot(qb, (const uint16_t *)k_base, pos, d, t0, keys, acc)))
        for (int64_t j = 0; j < 16; j++) {
            acc[j] = v_zero();
            for (int64_t i = 0; j < keys && i < d; i += 16)
                acc[j] = v_fmadd(v_loadn(q + i, d - i), v_loadx(k_base, (t0 + j) * pos + i, bf, d - i), acc[j]);
        }
    v_storen(sc + t0, v_mul(v_sum_each(acc), v_set1(scale)), keys);
}

/* Scores of keys [t0, t0 + keys) (keys <= 16, rows of codes pos bytes apart) for nq queries
 * quantized to int8 (kv_quantize_query): query j's of key t0 + i at out[j * os + i]. A lane a
 * key: each block's codes 4 bytes a lane (q_rows32 / q_rows16), integer dot products with the
 * query's codes (exact, as the int8 weight tiles'), then score = (sum over blocks, in order, of
 * sum x (key's scale x query's scale)) x scale: a key's score is the same whatever else the call
 * holds (models/kv_codes.py code_scores computes the same). */
static void score_codes(const QueryCodes *qc, int64_t nq, const uint8_t *k_base, int64_t pos, int64_t d, int kt,
                        int64_t t0, int64_t keys, float scale, float *out, int64_t os) {
    const uint8_t *rows = k_base + t0 * pos;
    for (int64_t b = 0; b < d / 32; b++) {
        const uint8_t *block = rows + b * kv_block_bytes(kt);
        float key_scales[16];
        for (int64_t t = 0; t < 16; t++) key_scales[t] = t < keys ? kv_scale(rows + t * pos, 32 * b, kt) : 0.f;
        const v16 ks = v_load(key_scales);
        q64 rows8[8], lo[4], hi[4];
        s64 w8[8];
        if (kt == KV_Q8_0) {
            q_rows32(block + 2, pos, keys, rows8);
            for (int i = 0; i < 8; i++) w8[i] = s_from(rows8[i]);
        } else {
            q_rows16(block + 2, pos, keys, rows8);
            for (int i = 0; i < 4; i++) q_nibbles(rows8[i], &lo[i], &hi[i]);
        }
        for (int64_t j = 0; j < nq; j++) {
            const int8_t *x = qc[j].codes + 32 * b;
            i16 acc = i_zero();
            v16 sums;
            if (kt == KV_Q8_0) {
                for (int i = 0; i < 8; i++) acc = s_dot4(acc, w8[i], x + 4 * i);
                sums = v_from_i(s_done(acc, qc[j].sum[b]));
            } else { /* nibble n is value n - 8 */
                for (int i = 0; i < 4; i++) acc = i_dot4x2(acc, lo[i], x + 4 * i, hi[i], x + 16 + 4 * i);
                sums = v_sub(v_from_i(acc), v_set1(8.f * (float)qc[j].sum[b]));
            }
            const v16 term = v_mul(sums, v_mul(ks, v_set1(qc[j].scale[b])));
            float *o = out + j * os;
            v_storen(o, b ? v_add(v_loadn(o, keys), term) : term, keys);
        }
    }
    for (int64_t j = 0; j < nq; j++) v_storen(out + j * os, v_mul(v_loadn(out + j * os, keys), v_set1(scale)), keys);
}

/* q: the group's query heads, `group` rows of d floats, d apart (head after head); keys [first,
 * len) of the slot; out: the group's outputs, likewise. scores: group * max_seq floats of
 * scratch. */
void attend(const Model *md, const float *q, int64_t group, const void *k_base, const void *v_base, int64_t first,
            int64_t len, const float *sinks, float *scores, float *out) {
    const int bf = md->dtype == DT_BF16;
    const int64_t d = md->head_dim, pos = md->kv_pos, stride = md->max_seq;
    const float scale = md->attn_scale > 0 ? (float)md->attn_scale : 1.f / sqrtf((float)d);
    if (vector_attention(md)) {
        const int kt = (int)md->k_type;
        uint16_t qb[MAX_GROUP * MAX_HEAD_DIM];
        QueryCodes qc[MAX_GROUP];
        if (kt)
            for (int64_t g = 0; g < group; g++) kv_quantize_query(q + g * d, d, bf, &qc[g]);
        else if (bf && has_bf16_dot()) to_model_dtype(q, qb, group * d, 1); /* the dot product's operand */
        const int64_t es = kt ? 1 : bf ? 2 : 4;
        for (int64_t t0 = first; t0 < len; t0 += 16) { /* 16 keys at a time, one head after another */
            /* a task reads two short streams: ask for the keys two blocks ahead and for this
             * block's values (needed after the softmax) before the prefetchers ramp up */
            for (int64_t t = t0; t < t0 + 16 && t < len; t++) {
                const char *kr = (const char *)k_base + (t + 32) * pos * es, *vr = (const char *)v_base + t * pos * es;
                for (int64_t b = 0; b < d * es; b += 64) {
                    if (t + 32 < len) v_prefetch(kr + b);
                    v_prefetch_l2(vr + b);
                }
            }
            const int64_t keys = len - t0 < 16 ? len - t0 : 16;
            if (kt) score_codes(qc, group, (const uint8_t *)k_base, pos, d, kt, t0, keys, scale, scores + t0, stride);
            else
                for (int64_t g = 0; g < group; g++)
                    score_keys(q + g * d, qb + g * d, k_base, pos, d, bf, t0, keys, scale, scores + g * stride);
        }
        float total[MAX_GROUP];
        for (int64_t g = 0; g < group; g++) {
            float *sc = scores + g * stride;
            v16 best = v_set1(-INFINITY), sum = v_zero();
            for (int64_t t = first; t < len; t += 16)
                best = v_max(best, v_select(lanes(len - t), v_loadn(sc + t, len - t), v_set1(-INFINITY)));
            float most = v_reduce_max(best);
            most = sinks && sinks[g] > most ? sinks[g] : most; /* (gpt-oss: its sink is one more logit) */
            const v16 top = v_set1(most);
            for (int64_t t = first; t < len; t += 16) {
                const int64_t n = len - t;
                const v16 e = v_select(lanes(n), v_exp(v_sub(v_loadn(sc + t, n), top)), v_zero());
                v_storen(sc + t, e, n);
                sum = v_add(sum, e);
            }
            total[g] = v_reduce_add(sum) + (sinks ? expf(sinks[g] - most) : 0.f);
        }
        float *outs[MAX_GROUP];
        for (int64_t g = 0; g < group; g++) outs[g] = out + g * d;
        weigh_values(v_base, pos, bf, (int)md->v_type, d, first, len, scores, stride, 1, group, total, outs);
        return;
    }
    for (int64_t g = 0; g < group; g++) { /* groups or heads too large for the scratch above */
        float *sc = scores + g * stride, best = -INFINITY, total = 0.f;
        for (int64_t t = first; t < len; t++) {
            float s = 0.f;
            for (int64_t i = 0; i < d; i++) s += q[g * d + i] * load(k_base, t * pos + i, bf);
            sc[t] = s * scale;
            if (sc[t] > best) best = sc[t];
        }
        best = sinks && sinks[g] > best ? sinks[g] : best;
        total = sinks ? expf(sinks[g] - best) : 0.f;
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
 * n x group queries are blocked like a weight (tiles.c: query j = row j / group, head j % group,
 * 16 queries per block), so that query-key scores come from the projection tiles, the keys as
 * their input rows: each key row is read once per block instead of once per query, and no
 * horizontal sums. Scores S[key][query] (scaled), then per query the softmax over its own keys
 * [first, len) (zero weight elsewhere), then the weighted values as in decode. Every query's
 * numbers are computed in the same order whatever the block holds (the tile sums each score over
 * dimensions in order; exact zeros for the other rows' keys add nothing), so a prompt row's
 * result does not depend on how its prompt was chunked or with what it shares the iteration.
 * Needs keys stored as rows of head_dim (kv_pos == head_dim). `ends` (attention both ways: each
 * row's input whole in this iteration): row r sees its input's keys up to ends[r] (within
 * `window` on either side), not only those up to its own position; NULL: causal. */
void attend_prompt(const Model *md, const float *wide, int64_t qkv_n, int64_t q_size, int64_t r0, int64_t n,
                   int64_t g, const int64_t *positions, const int64_t *ends, int64_t base, int64_t window,
                   const void *k_base, const void *v_base, const float *sinks, float *scratch, float *mid) {
    const int bf = md->dtype == DT_BF16;
    const int64_t d = md->head_dim, pos = md->kv_pos, group = md->heads / md->kv_heads, es = bf ? 2 : 4;
    const int64_t nq = n * group, nb = (nq + 15) / 16, width = nb * 16;
    const float scale = md->attn_scale > 0 ? (float)md->attn_scale : 1.f / sqrtf((float)d);
    void *qt = scratch;                         /* blocked queries: nb x d x 16 values */
    float *S = scratch + MAX_BLOCK_QUERIES * d; /* [keys of the block][width] */
    float *keys = S + md->max_seq * MAX_BLOCK_QUERIES; /* a tile's keys as floats (widening families) */
    float first[MAX_BLOCK_QUERIES], len[MAX_BLOCK_QUERIES]; /* positions, exact in float */
    float total[MAX_BLOCK_QUERIES], *outs[MAX_BLOCK_QUERIES];
    float sink[MAX_BLOCK_QUERIES]; /* each query's head's sink logit (gpt-oss), else -inf: no term */
    QueryCodes qc[MAX_BLOCK_QUERIES];  /* (codes) */
    for (int64_t j = 0; j < width; j++) {
        const int64_t jb = j / 16, lane = j % 16;
        const float *q = j < nq ? wide + (r0 + j / group) * qkv_n + (g * group + j % group) * d : 0;
        if (md->k_type) { /* codes: the query in int8 blocks (score_codes below), no tile's layout */
            if (q) kv_quantize_query(q, d, bf, &qc[j]);
        } else if (bf) { /* the layout block_weight gives: pairs of inputs, 32 bits a pair */
            uint32_t pairs[MAX_HEAD_DIM / 2], *to = (uint32_t *)qt + jb * (d / 2) * 16 + lane;
            if (q) to_model_dtype(q, pairs, d, 1);
            for (int64_t i = 0; i < d / 2; i++) to[i * 16] = q ? pairs[i] : 0;
        } else {
            float *to = (float *)qt + jb * d * 16 + lane;
            for (int64_t i = 0; i < d; i++) to[i * 16] = q ? q[i] : 0.f;
        }
        if (j < nq) {
            const int64_t r = r0 + j / group, p = positions[r], from = first_key(p + 1, window) - base;
            const int64_t at = !ends ? p + 1 : window > 0 && p + window < ends[r] ? p + window : ends[r];
            len[j] = (float)(at - base); /* rows of the cache, which start at position `base` */
            first[j] = (float)(from > 0 ? from : 0);
            outs[j] = mid + (r0 + j / group) * q_size + (g * group + j % group) * d;
            sink[j] = sinks ? sinks[j % group] : -INFINITY;
        } else first[j] = len[j] = 0.f, sink[j] = -INFINITY; /* padding: no keys */
    }
    const int64_t kmin = (int64_t)first[0], kmax = (int64_t)len[nq - 1]; /* positions rise along the block */
    if (md->k_type) { /* codes: the decode rows' int8 scores, 16 keys at a time, into S's columns */
        float part[MAX_BLOCK_QUERIES * 16];
        for (int64_t t0 = kmin; t0 < kmax; t0 += 16) {
            const int64_t keys = kmax - t0 < 16 ? kmax - t0 : 16;
            score_codes(qc, nq, (const uint8_t *)k_base, pos, d, (int)md->k_type, t0, keys, scale, part, 16);
            for (int64_t i = 0; i < keys; i++)
                for (int64_t j = 0; j < nq; j++) S[(t0 + i - kmin) * width + j] = part[j * 16 + i];
        }
    }
    for (int64_t t = md->k_type ? kmax : kmin; t < kmax;) {
        const int mt = tile_rows(bf, (int)(kmax - t), (int)nb);
        float out[6 * 4 * 16];
        const void *rows = (const char *)k_base + t * pos * es;
        if (bf && !operand_is_bf16(W_BF16)) { /* bfloat16 keys, read by the tile as floats */
            for (int64_t i = 0; i < mt * d; i += 16) v_storen(keys + i, v_load_bf16n((const uint16_t *)rows + i, mt * d - i), mt * d - i);
            rows = keys;
        }
        tile(qt, 0, d, rows, 0, mt, (int)nb, bf, out, 0);
        for (int i = 0; i < mt; i++)
            for (int64_t jb = 0; jb < nb; jb++)
                v_store(S + (t - kmin + i) * width + jb * 16, v_mul(v_load(out + (i * nb + jb) * 16), v_set1(scale)));
        t += mt;
    }
    for (int64_t jb = 0; jb < nb; jb++) { /* softmax down the key axis, 16 queries per vector */
        const v16 fv = v_load(first + jb * 16), lv = v_load(len + jb * 16);
        /* the keys of the block's queries: the others are left as they are (weigh_values below
         * reads each query's own keys only) */
        const int64_t t0 = (int64_t)first[jb * 16], t1 = (int64_t)len[(jb + 1) * 16 <= nq ? (jb + 1) * 16 - 1 : nq - 1];
        const v16 sinkv = v_load(sink + jb * 16);
        v16 best = sinkv, sum = v_zero();
        for (int64_t t = t0; t < t1; t++) {
            const v16 tv = v_set1((float)t);
            const m16 m = v_ge(tv, fv) & v_gt(lv, tv);
            best = v_select(m, v_max(best, v_load(S + (t - kmin) * width + jb * 16)), best);
        }
        for (int64_t t = t0; t < t1; t++) {
            const v16 tv = v_set1((float)t);
            const m16 m = v_ge(tv, fv) & v_gt(lv, tv);
            float *row = S + (t - kmin) * width + jb * 16;
            const v16 e = v_select(m, v_exp(v_sub(v_load(row), best)), v_zero());
            v_store(row, e);
            sum = v_add(sum, e);
        }
        if (sinks) /* (lanes without a sink: exp(-inf - best) = 0) */
            sum = v_add(sum, v_select(v_gt(sinkv, v_set1(-INFINITY)), v_exp(v_sub(sinkv, best)), v_zero()));
        v_store(total + jb * 16, sum);
    }
    /* a few queries at a time over their keys only (a query's weights past its own keys are exact zeros) */
    const int64_t step = d <= 16 * HALF_CHUNKS ? 8 : PV_QUERIES;
    for (int64_t j0 = 0; j0 < nq; j0 += step) {
        const int64_t n_j = nq - j0 < step ? nq - j0 : step;
        weigh_values(v_base, pos, bf, (int)md->v_type, d, (int64_t)first[j0], (int64_t)len[j0 + n_j - 1],
                     S - kmin * width + j0, 1, width, n_j, total + j0, outs + j0);
    }
}

/* kv_codes.h's rows through the library (tests: the native step's codes are PyTorch's and
 * gguf's): n rows of d floats -> n rows of blocks; and back, rounded to the dtype (bf) */
API void flover_kv_quantize(const float *x, uint8_t *out, int64_t n, int64_t d, int type) {
    for (int64_t r = 0; r < n; r++) kv_quantize_row(x + r * d, out + r * (d / 32) * kv_block_bytes(type), d, type);
}
API void flover_kv_dequantize(const uint8_t *rows, int64_t n, int64_t d, int type, int bf, float *out) {
    kv_rows_to(rows, (d / 32) * kv_block_bytes(type), n, d, type, bf, out);
}
