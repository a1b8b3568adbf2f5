/* One fused iteration of a BERT-family text encoder (flover/models/bert.py) in one native call
 * (CPU): every input of the iteration whole, each token a row. The forward reads top to bottom
 * (flover_encode, at the end); it shares the decoder's kernels (project.c's projections on
 * blocked weights or a GGUF file's codes, attention.c's blocked prompt attention, row_ops.c).
 *
 * An encoder keeps no KV: a layer's keys and values go to scratch rows of this iteration, and
 * each input's rows attend to all of that input's rows (both ways): blocks of up to
 * MAX_BLOCK_QUERIES rows of one input take attend_prompt with the input's end as every row's last
 * key. A row's result depends on its own input only, so fusion changes no bit.
 *
 * Rounding follows the PyTorch path step by step, as llama_forward.c's: in bfloat16 every
 * intermediate PyTorch rounds (the embeddings' sums, each projection with its bias, each residual
 * add, each LayerNorm, the GELU) is rounded here at the same point.
 */
#include <omp.h>
#include <string.h>

#include "native.h"

/* The float scratch of an iteration, as offsets into `work`: the residual rows, a projection's
 * output rows (qkv, o, up, down), attention out / GELU, the kernels' operand copies, the layer's
 * keys and values ([2][heads][rows][head_dim], model dtype), the grids' group sums, per thread the
 * blocked attention's scratch, the attention blocks (first row, rows, the input's first row:
 * int64) and each row's input's length (int64). */
typedef struct {
    int64_t hidden, wide, mid, xb, kv, xsum, scores, per_thread, blocks, ends, end;
} EncoderWork;

static inline int64_t larger(int64_t a, int64_t b) { return a > b ? a : b; }

static EncoderWork encoder_work(const Model *md, int64_t rows, int nt) {
    const int64_t h = md->hidden, widest = larger(3 * h, 2 * md->inter), inner = larger(h, md->inter);
    EncoderWork w;
    w.hidden = 0;
    w.wide = w.hidden + rows * h;
    w.mid = w.wide + rows * widest;
    w.xb = w.mid + rows * inner;
    w.kv = w.xb + rows * widest; /* (the operand copies, or int8 inputs: 1.375 bytes an input, fit) */
    w.xsum = w.kv + 2 * rows * h;
    w.scores = w.xsum + rows * (widest / 16 + 1);
    w.per_thread = MAX_BLOCK_QUERIES * (md->head_dim + md->max_seq) + 6 * md->head_dim; /* attend_prompt's */
    w.blocks = w.scores + nt * w.per_thread;
    w.ends = w.blocks + 6 * rows; /* 3 int64 per block, at most one block per row */
    w.end = w.ends + 2 * rows;
    return w;
}

API int64_t flover_encode_floats(const Model *md, int rows, int nt) { return encoder_work(md, rows, nt).end; }

/* What flover_encode assumes of the model, checked once before any call (a model file is not
 * trusted): 0, or which assumption fails (flover/native/encoder.py names it). */
API int flover_check_encoder(const Model *md, const Encoder *en, const EncoderLayer *layers) {
    if (md->layers <= 0 || md->hidden <= 0 || md->heads <= 0 || md->head_dim <= 0 || md->inter <= 0 ||
        md->vocab <= 0 || md->max_seq <= 0 || !md->embed)
        return 1;
    if (md->heads * md->head_dim != md->hidden || md->kv_heads != md->heads || md->kv_pos != md->head_dim) return 2;
    if (md->head_dim % 2 || md->head_dim > MAX_HEAD_DIM || md->hidden % 2 || md->inter % 2) return 3;
    const int table = en->positions && en->position_offset >= 0 && en->position_rows >= md->max_seq + en->position_offset;
    if (!(en->positions ? table : en->cos && en->sin) || !en->token_types || en->type_rows <= 0 || !en->norm ||
        !en->norm_bias || en->act < ENC_GELU || en->act > ENC_SWIGLU)
        return 4;
    for (int64_t l = 0; l < md->layers; l++) {
        const EncoderLayer *ly = &layers[l];
        if (!(ly->qkv || ly->qkv_grid) || !(ly->o || ly->o_grid) || !(ly->up || ly->up_grid) ||
            !(ly->down || ly->down_grid) || !ly->attn_norm || !ly->attn_norm_bias || !ly->mlp_norm || !ly->mlp_norm_bias)
            return 5;
    }
    return 0;
}

/* Rows into the residual stream: word + position (where a table holds them) + token type (each sum
 * rounded, as PyTorch's adds), then the embeddings' LayerNorm. */
static void embed_rows(const Model *md, const Encoder *en, const int64_t *tokens, const int64_t *positions,
                       const int64_t *types, int rows, float *hidden, float eps, int bf, int nt) {
    const int64_t h = md->hidden;
#pragma omp parallel for num_threads(nt) schedule(static) if (rows >= 16)
    for (int r = 0; r < rows; r++) {
        float *x = hidden + r * h;
        const int64_t t = tokens[r], p = positions[r] + en->position_offset, ty = types ? types[r] : 0;
        for (int64_t i = 0; i < h; i += 16) {
            const int64_t n = h - i;
            v16 sum = v_loadx((const void *)md->embed, t * h + i, bf, n);
            if (en->positions) sum = v_rnd(v_add(sum, v_loadx((const void *)en->positions, p * h + i, bf, n)), bf);
            v_storen(x + i, v_rnd(v_add(sum, v_loadx((const void *)en->token_types, ty * h + i, bf, n)), bf), n);
        }
        layer_norm(x, (const void *)en->norm, (const void *)en->norm_bias, eps, h, bf, x);
    }
}

/* hidden = LayerNorm(hidden + out) for every row (the add rounded, as PyTorch's). */
static void add_and_norm(float *hidden, const float *out, int64_t weight, int64_t bias, int rows, int64_t h, float eps,
                         int bf, int nt) {
#pragma omp parallel for num_threads(nt) schedule(static) if (rows >= 16)
    for (int r = 0; r < rows; r++) {
        float *x = hidden + r * h;
        for (int64_t i = 0; i < h; i += 16)
            v_storen(x + i, v_rnd(v_add(v_loadn(x + i, h - i), v_loadn(out + r * h + i, h - i)), bf), h - i);
        layer_norm(x, (const void *)weight, (const void *)bias, eps, h, bf, x);
    }
}

/* The attention blocks of the inputs (spans: [n_spans][first row, rows]): up to MAX_BLOCK_QUERIES
 * rows of one input each, as (first row, rows, the input's first row); and each row's input's
 * length in `ends` (every row sees the input's every key).
 * Returns the blocks, or -1 where the spans do not cover the rows one after another, or one is
 * longer than max_seq or does not run from position 0. */
static int64_t attention_blocks(const Model *md, const int64_t *spans, int n_spans, const int64_t *positions, int rows,
                                int64_t *blocks, int64_t *ends) {
    int64_t n = 0, next = 0; /* (the spans cover the rows in order: at most one block per row) */
    for (int s = 0; s < n_spans; s++) {
        const int64_t first = spans[2 * s], len = spans[2 * s + 1];
        if (first != next || len <= 0 || len > md->max_seq || first + len > rows) return -1;
        next = first + len;
        for (int64_t r = first; r < first + len; r++) {
            if (positions[r] != r - first) return -1; /* (an input comes whole, from position 0) */
            ends[r] = len;
        }
        for (int64_t r = first; r < first + len; r += MAX_BLOCK_QUERIES) {
            blocks[3 * n] = r, blocks[3 * n + 1] = first + len - r < MAX_BLOCK_QUERIES ? first + len - r : MAX_BLOCK_QUERIES;
            blocks[3 * n + 2] = first, n++;
        }
    }
    return next == rows ? n : -1;
}

/* One iteration: `rows` tokens, token r at positions[r] of its input with token type types[r]
 * (NULL: all 0); the inputs are `spans` ([n_spans][first row, rows], each input's rows
 * consecutive from position 0). Every row's residual after the last layer goes to hidden_out
 * [rows, hidden] float32. Returns 0, or -1 where a token, position, type or span is out of range. */
API int flover_encode(const Model *md, const Encoder *en, const EncoderLayer *layers, int rows, const int64_t *tokens,
                      const int64_t *positions, const int64_t *types, const int64_t *spans, int n_spans,
                      float *hidden_out, float *work, double eps_d, int nt) {
    for (int r = 0; r < rows; r++)
        if (tokens[r] < 0 || tokens[r] >= md->vocab || positions[r] < 0 || positions[r] >= md->max_seq ||
            (types && (types[r] < 0 || types[r] >= en->type_rows)))
            return -1;
    const int bf = md->dtype == DT_BF16;
    const float eps = (float)eps_d;
    const int64_t h = md->hidden, heads = md->heads, d = md->head_dim, es = bf ? 2 : 4;
    const EncoderWork at = encoder_work(md, rows, nt);
    float *hidden = work + at.hidden, *wide = work + at.wide, *mid = work + at.mid, *xsum = work + at.xsum;
    float *scores = work + at.scores;
    void *xb = work + at.xb;
    char *keys = (char *)(work + at.kv), *values = keys + rows * h * es; /* [heads][rows][d] each */
    int64_t *blocks = (int64_t *)(work + at.blocks), *ends = (int64_t *)(work + at.ends);
    const int64_t n_blocks = attention_blocks(md, spans, n_spans, positions, rows, blocks, ends);
    if (n_blocks < 0) return -1;
#define PROJECT(W, X, N, K, Y)                                                                             \
    if (ly->W##_grid)                                                                                      \
        project_grid((const Grid *)ly->W##_grid, bf, ly->W##_bias, X, xb, xsum, rows, N, K, Y, nt);       \
    else                                                                                                   \
        project(md, ly->W, ly->W##_bias, X, xb, rows, N, K, Y, nt);

    embed_rows(md, en, tokens, positions, types, rows, hidden, eps, bf, nt);
    for (int64_t l = 0; l < md->layers; l++) {
        const EncoderLayer *ly = &layers[l];
        PROJECT(qkv, hidden, 3 * h, h, wide)
#pragma omp parallel for num_threads(nt) schedule(static) if (rows >= 8)
        for (int r = 0; r < rows; r++) { /* (nomic-bert: q and k turned), each head's key and value rows */
            for (int64_t hh = 0; en->cos && hh < 2 * heads; hh++)
                rope(wide + r * 3 * h + hh * d, (const char *)en->cos + positions[r] * d * es,
                     (const char *)en->sin + positions[r] * d * es, d, bf);
            for (int64_t g = 0; g < heads; g++) {
                to_model_dtype(wide + r * 3 * h + h + g * d, keys + (g * rows + r) * d * es, d, bf);
                to_model_dtype(wide + r * 3 * h + 2 * h + g * d, values + (g * rows + r) * d * es, d, bf);
            }
        }
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
        for (int64_t task = 0; task < n_blocks * heads; task++) {
            const int64_t *b = blocks + 3 * (task / heads), g = task % heads, base = (g * rows + b[2]) * d * es;
            attend_prompt(md, wide, 3 * h, h, b[0], b[1], g, positions, ends, 0, 0, keys + base, values + base, 0,
                          scores + (int64_t)omp_get_thread_num() * at.per_thread, mid);
        }
        PROJECT(o, mid, h, h, wide)
        add_and_norm(hidden, wide, ly->attn_norm, ly->attn_norm_bias, rows, h, eps, bf, nt);
        const int64_t inter = md->inter, up_n = en->act == ENC_SWIGLU ? 2 * inter : inter;
        PROJECT(up, hidden, up_n, h, wide)
#pragma omp parallel for num_threads(nt) schedule(static) if (rows >= 8)
        for (int r = 0; r < rows; r++) {
            if (en->act == ENC_SWIGLU) silu_mul(wide + r * up_n, inter, bf, mid + r * inter);
            else gelu_row(wide + r * inter, inter, en->act == ENC_GELU_TANH, bf, mid + r * inter);
        }
        PROJECT(down, mid, h, md->inter, wide)
        add_and_norm(hidden, wide, ly->mlp_norm, ly->mlp_norm_bias, rows, h, eps, bf, nt);
    }
#undef PROJECT
    memcpy(hidden_out, hidden, rows * h * sizeof(float));
    return 0;
}
