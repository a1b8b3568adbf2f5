/* One fused iteration of a Llama-family model in one native call (CPU; under tensor parallelism
 * one rank's shard): decode tokens and prompt chunks alike, each token a row with its own slot
 * and position. The forward reads top to bottom (flover_forward, at the end); the kernels it
 * calls live beside it (native.h lists the files).
 *
 * In eager PyTorch an iteration is hundreds of small operations (norms, RoPE, KV writes,
 * residuals, the decode attention's casts and masks) that cost as much as reading the weights on
 * a small model (docs/design_notes.md). Here each projection is one pass over a blocked weight layout (tiles.c:
 * one row streams the weights at the read bandwidth, many rows share each load), and everything
 * else is a few vector loops per row; attention runs per (row, kv head) over the row's own slot
 * and length, so no padding to the longest sequence.
 *
 * Rounding follows the PyTorch path (flover/models/llama.py) step by step: in bfloat16 every
 * intermediate that PyTorch rounds to bfloat16 is rounded here at the same point (RNE), and
 * accumulations are float32 as in oneDNN, so the two paths differ only by summation order (and
 * exp, a polynomial within float32's rounding).
 *
 * Built by flover/native/forward.py with the system C compiler (-O3 -fopenmp, -march for the
 * kernel family chosen) into a cache directory and loaded with ctypes; it shares PyTorch's
 * OpenMP runtime (same soname).
 */
#include <math.h>
#include <omp.h>

#include "kv_codes.h"
#include "native.h"

/* The bytes of a KV stride's unit: the model dtype's element, or a byte where K and V are codes */
static inline int64_t kv_unit(const Model *md) { return md->k_type ? 1 : md->dtype == DT_BF16 ? 2 : 4; }

/* Where kv head g of `slot` keeps its keys (v = 0) or values (v = 1) in layer ly's cache. */
static inline char *kv_head_base(const Model *md, const Layer *ly, int v, int64_t slot, int64_t g) {
    return (char *)ly->kv + (v * ly->kv_kind + slot * ly->kv_slot + g * ly->kv_head) * kv_unit(md);
}

/* A row of d values (float32 of the model dtype's) into the cache at dst: that dtype, or codes */
static inline void kv_store(const float *x, char *dst, int64_t d, int type, int bf) {
    if (type) kv_quantize_row(x, (uint8_t *)dst, d, type);
    else to_model_dtype(x, dst, d, bf);
}

/* The position row 0 of `slot` holds in layer ly's cache: its window base for a windowed layer
 * (flover/runner/kv_window.py), else 0. */
static inline int64_t row_base(const Model *md, const Layer *ly, int64_t slot) {
    return ly->windowed_kv ? ((const int64_t *)md->window_base)[slot] : 0;
}

typedef void (*AllReduce)(float *buffer, int64_t n);

/* Sum a [rows, h] partial result over the ranks (row-parallel projections, the vocabulary-split
 * embedding); in bfloat16 the sum is rounded back, as PyTorch's bfloat16 all-reduce does. */
static void reduce_rows(const Model *md, float *x, int64_t n) {
    if (!md->all_reduce) return;
    ((AllReduce)md->all_reduce)(x, n);
    if (md->dtype == DT_BF16)
        for (int64_t i = 0; i < n; i++) x[i] = rnd(x[i], 1);
}

/* The float scratch of an iteration, as offsets into `work`: hidden and normed rows, qkv /
 * gate_up outputs, attention out / activation, the model-dtype copies that feed the kernels, per
 * thread the attention scratch (a decode row's scores of one kv head's query heads, or a prompt
 * block's blocked queries and scores: `per_thread` floats), per row and group of 16 or 32
 * inputs their sum (grids with minimums), the prompt blocks (first row and row count, int64), a
 * recurrent layer's runs and a bidirectional model's input lengths (int64). `end`: the floats the
 * caller allocates (flover_work_floats). */
typedef struct {
    int64_t hidden, normed, wide, mid, xb, scores, per_thread, xsum, blocks, runs, ends, experts, fused, per_layer, end;
} Work;

static inline int64_t max3(int64_t a, int64_t b, int64_t c) { return a > b ? (a > c ? a : c) : (b > c ? b : c); }

/* q's rows per head: the query, and with attn_gate its gate after it */
static inline int64_t q_rows(const Model *md) { return (md->attn_gate ? 2 : 1) * md->heads * md->head_dim; }

/* The model as layer ly sees it (Gemma 4: its own head size, kv heads, KV row stride, RoPE tables'
 * width and MLP width); for other models the model itself. */
static inline Model layer_view(const Model *md, const Layer *ly) {
    Model v = *md;
    if (ly->head_dim && ly->head_dim != md->head_dim) v.head_dim = ly->head_dim, v.rotary_dim = ly->head_dim;
    if (ly->kv_heads) v.kv_heads = ly->kv_heads;
    if (ly->kv_pos) v.kv_pos = ly->kv_pos;
    if (ly->inter) v.inter = ly->inter;
    return v;
}

/* The widest layer's geometry (the scratch is laid out for it). */
static inline Model widest_view(const Model *md) {
    Model v = *md;
    if (md->max_head_dim > v.head_dim) v.head_dim = md->max_head_dim;
    if (md->max_kv_heads > v.kv_heads) v.kv_heads = md->max_kv_heads;
    if (md->max_inter > v.inter) v.inter = md->max_inter;
    return v;
}

static Work work_layout(const Model *model, int64_t rows, int64_t nt) {
    const Model wv = widest_view(model), *md = &wv;
    const int64_t h = md->hidden, qkv = q_rows(md) + 2 * md->kv_heads * md->head_dim;
    const int64_t delta = md->delta_value_heads ? delta_in_width(md) : 0, shared = 2 * md->shared_inter;
    const int64_t pl = md->per_layer_width; /* (Gemma 4) a per-layer input's gate, then [gate | input] pairs */
    const int64_t widest =
        max3(max3(qkv, 2 * md->inter, 2 * md->expert_inter), max3(delta, shared, h), max3(3 * pl, md->layers * pl, 0));
    /* mid: the MLP's inner rows, and attention's output (heads x head_dim: wider than hidden and the
     * MLP where heads are wide and the MLP narrow, e.g. Qwen3-MoE's) */
    const int64_t inner = max3(max3(md->inter, h, md->expert_inter), md->delta_value_heads * md->delta_dv,
                               max3(pl, md->heads * md->head_dim, 0));
    Work w;
    w.hidden = 0;
    w.normed = w.hidden + rows * h;
    w.wide = w.normed + rows * h;
    w.mid = w.wide + rows * widest;
    w.xb = w.mid + rows * inner;
    w.scores = w.xb + rows * widest; /* the model-dtype copies (or int8 inputs: 1.375 bytes an input) fit */
    const int64_t decode = md->heads * md->max_seq, prompt = MAX_BLOCK_QUERIES * (md->head_dim + md->max_seq) + 6 * md->head_dim;
    /* (also: a row's q and gates while they are reordered; a DeltaNet head's q, k, and two dv rows) */
    const int64_t other = max3(qkv, 2 * md->delta_dk + 2 * md->delta_dv, 0);
    w.per_thread = max3(decode, prompt, other);
    w.xsum = w.scores + nt * w.per_thread;
    w.blocks = w.xsum + rows * (widest / 16 + 1);
    w.runs = w.blocks + 4 * rows;      /* 2 int64 per block, at most one block per row */
    w.ends = w.runs + 4 * rows;        /* DeltaNet: 2 int64 per run of one sequence's rows */
    w.experts = w.ends + 2 * rows;     /* (attention both ways) each row's input's length, int64 */
    /* a layer of experts: logits, picks (int64) and weights, each expert's first entry (int64), the
     * entries' rows (int64) and weights, an expert's rows' inputs and outputs, the rows' sums (ExpertsWork) */
    w.fused = w.experts + (md->experts ? rows * (md->experts + 6 * md->top_k + 5 * h) + 2 * (md->experts + 1) : 0);
    /* the experts' single region: per entry its int8 inputs (1.625 bytes an input, codes rounded to
     * whole floats) and its gate_up, activation and output floats; each row's entries (int64) */
    const int64_t entries = fused_expert_entries(md, rows), widest_in = h > md->expert_inter ? h : md->expert_inter;
    w.per_layer = w.fused + entries * ((widest_in + 3) / 4 + widest_in * 5 / 32 + 3 * md->expert_inter + h + 2);
    w.end = w.per_layer + rows * md->layers * pl; /* (Gemma 4) the rows' per-layer inputs */
    return w;
}

/* The largest group of query heads a kv head serves over the attention layers, where every one
 * of them takes the blocked prompt kernel (keys stored as rows of head_dim), else 0. */
static int64_t prompt_blocks_group(const Model *md, const Layer *layers) {
    int64_t most = 0;
    for (int64_t l = 0; l < md->layers; l++) {
        if (layers[l].delta) continue;
        const Model v = layer_view(md, &layers[l]);
        if (!vector_attention(&v) || (v.kv_pos != v.head_dim && !md->k_type)) return 0; /* (codes: score_codes reads rows of any stride) */
        if (v.heads / v.kv_heads > most) most = v.heads / v.kv_heads;
    }
    return most;
}

/* (Gemma 4) the end of a layer after its per-layer input: the output times the layer's scalar
 * (rounded as PyTorch's product), then the next layer's input norm (0: the rows themselves). */
static void finish_layer(const Model *md, const Layer *ly, float *hidden, float *normed, int rows, int64_t next_norm,
                         float eps, int bf, int nt) {
    const int64_t h = md->hidden;
#pragma omp parallel for num_threads(nt) schedule(static) if (rows >= 16)
    for (int r = 0; r < rows; r++) {
        float *x = hidden + r * h;
        if (ly->scalar != 0)
            for (int64_t i = 0; i < h; i++) x[i] = rnd(x[i] * (float)ly->scalar, bf);
        if (next_norm) norm_row(md, x, next_norm, eps, h, bf, normed + r * h);
        else memcpy(normed + r * h, x, h * sizeof(float));
    }
}

/* (Gemma 4) What the router reads of the residual rows (normed without weight, times its scale,
 * times hidden^-0.5) and what the experts read (the residual normed by beside_pre), rounded where
 * PyTorch rounds. */
static void beside_inputs(const Model *md, const Layer *ly, const float *hidden, int rows, float *route_in,
                          float *input, float eps, int bf, int nt) {
    const int64_t h = md->hidden;
    const float *scale = (const float *)ly->router_scale, root = (float)(1.0 / sqrt((double)h));
#pragma omp parallel for num_threads(nt) schedule(static) if (rows >= 8)
    for (int r = 0; r < rows; r++) {
        float *x = route_in + r * h;
        norm_row(md, hidden + r * h, md->v_norm, eps, h, bf, x); /* (ones: no weight) */
        for (int64_t i = 0; i < h; i++) x[i] = rnd(rnd(x[i] * scale[i], bf) * root, bf);
        norm_row(md, hidden + r * h, ly->beside_pre, eps, h, bf, input + r * h);
    }
}

/* (Gemma 4) normed = norm(the MLP's output) + norm(the experts' sum), rounded as PyTorch's add. */
static void beside_sum(const Model *md, const Layer *ly, float *normed, float *experts, int rows, float eps, int bf,
                       int nt) {
    const int64_t h = md->hidden;
#pragma omp parallel for num_threads(nt) schedule(static) if (rows >= 8)
    for (int r = 0; r < rows; r++) {
        float *a = normed + r * h, *b = experts + r * h;
        norm_row(md, a, ly->beside_post_mlp, eps, h, bf, a);
        norm_row(md, b, ly->beside_post_experts, eps, h, bf, b);
        for (int64_t i = 0; i < h; i++) a[i] = rnd(a[i] + b[i], bf);
    }
}

static ExpertsWork experts_work(float *work, const Work *at, const Model *md, int64_t rows) {
    float *p = work + at->experts;
    ExpertsWork w;
    w.logits = p, p += rows * md->experts;
    w.picked = (int64_t *)p, p += 2 * rows * md->top_k;
    w.weight = p, p += rows * md->top_k;
    w.start = (int64_t *)p, p += 2 * (md->experts + 1);
    w.members = (int64_t *)p, p += 2 * rows * md->top_k;
    w.member_weight = p, p += rows * md->top_k;
    w.gathered = p, p += rows * md->hidden;
    w.out = p, p += rows * md->hidden;
    w.sum = p, p += rows * md->hidden;
    w.route_in = p, p += rows * md->hidden;
    w.input = p;
    const int64_t entries = fused_expert_entries(md, rows), h = md->hidden;
    const int64_t widest_in = h > md->expert_inter ? h : md->expert_inter;
    p = work + at->fused;
    w.entry_x8 = p, p += entries * ((widest_in + 3) / 4 + widest_in * 3 / 32);
    w.entry_ds16 = p, p += entries * (widest_in / 16);
    w.entry_wide = p, p += entries * 2 * md->expert_inter;
    w.entry_mid = p, p += entries * md->expert_inter;
    w.entry_out = p, p += entries * h;
    w.row_entries = (int64_t *)p;
    return w;
}

API int64_t flover_work_floats(const Model *md, int rows, int nt) { return work_layout(md, rows, nt).end; }

/* A row of a gated q projection, per head [query, gate] then k and v, reordered in place to
 * [queries | k | v | gates] (`tmp`: the row's first 2 q_size floats). */
static void split_gates(float *row, float *tmp, int64_t heads, int64_t kv_size, int64_t d) {
    const int64_t q_size = heads * d;
    memcpy(tmp, row, 2 * q_size * sizeof(float));
    memmove(row + q_size, row + 2 * q_size, 2 * kv_size * sizeof(float));
    for (int64_t hh = 0; hh < heads; hh++) {
        memcpy(row + hh * d, tmp + 2 * hh * d, d * sizeof(float));
        memcpy(row + q_size + 2 * kv_size + hh * d, tmp + 2 * hh * d + d, d * sizeof(float));
    }
}

/* Attention's output rows mid [rows, q_size] times sigmoid of their gates (at `gates` in each
 * qkv row), rounded as PyTorch's sigmoid then product. */
static void apply_gates(float *mid, const float *wide, int rows, int64_t q_size, int64_t qkv_n, int64_t gates, int bf,
                        int nt) {
#pragma omp parallel for num_threads(nt) schedule(static) if (rows >= 8)
    for (int r = 0; r < rows; r++)
        for (int64_t i = 0; i < q_size; i++) {
            const float g = wide[r * qkv_n + gates + i];
            mid[r * q_size + i] = rnd(mid[r * q_size + i] * rnd(sigmoid1(g), bf), bf);
        }
}

/* sum += sigmoid(gate . x) * shared, per row: the shared expert's output `shared` [rows, h] on the
 * routed experts' sum, rounded as PyTorch's linear, sigmoid, product and add. */
static void add_shared(const Model *md, const Layer *ly, const float *x, const float *shared, float *sum, int rows,
                       int bf, int nt) {
    const int64_t h = md->hidden;
#pragma omp parallel for num_threads(nt) schedule(static) if (rows >= 8)
    for (int r = 0; r < rows; r++) {
        float dot = 0.f;
        for (int64_t i = 0; i < h; i++) dot += x[r * h + i] * load((const void *)ly->shared_gate, i, bf);
        const float gate = rnd(sigmoid1(rnd(dot, bf)), bf);
        for (int64_t i = 0; i < h; i++) sum[r * h + i] = rnd(sum[r * h + i] + rnd(gate * shared[r * h + i], bf), bf);
    }
}

/* What flover_forward assumes of a model's shape, checked once before any call (a model file
 * is not trusted): 0, or which assumption fails (native_forward.py names it). */
API int flover_check_model(const Model *md) {
    if (md->layers <= 0 || md->hidden <= 0 || md->heads <= 0 || md->kv_heads <= 0 || md->head_dim <= 0 ||
        md->inter <= 0 || md->vocab <= 0 || md->max_seq <= 0)
        return 1;
    if (md->heads % md->kv_heads) return 2; /* every kv head serves a whole group of query heads */
    if (md->head_dim % 2 || md->head_dim > 512 || md->rotary_dim % 2 || md->rotary_dim <= 0 || md->rotary_dim > md->head_dim ||
        md->max_head_dim % 2 || md->max_head_dim > 512)
        return 3;
    if (md->hidden % 2 || md->inter % 2) return 4;
    if (md->kv_pos < md->head_dim) return 5; /* a KV row holds a head's head_dim values */
    if (md->experts < 0 || (md->experts && (md->top_k <= 0 || md->top_k > md->experts || md->expert_inter <= 0 ||
                                            md->expert_inter % 2)))
        return 7;
    if (md->act < 0 || md->act > 2 || (md->act == 2 && !(md->swiglu_limit > 0 && md->swiglu_alpha > 0))) return 8;
    if (md->delta_value_heads && (md->delta_key_heads <= 0 || md->delta_value_heads % md->delta_key_heads ||
                                  md->delta_dk <= 0 || md->delta_dk > 512 || md->delta_dv <= 0 || md->delta_dv > 512 ||
                                  md->delta_conv < 2 || md->delta_conv > 64))
        return 9;
    return 0;
}

/* A layer's K and V codes: both of llama.cpp's kinds, heads of whole blocks that the vector
 * attention reads (no scalar fallback reads codes), V's row after K's within a position's */
static int kv_codes_fit(const Model *md, const Layer *ly) {
    const Model v = layer_view(md, ly);
    if (md->k_type < KV_Q8_0 || md->k_type > KV_Q4_0 || md->v_type < KV_Q8_0 || md->v_type > KV_Q4_0) return 0;
    const int64_t k_bytes = v.head_dim / 32 * kv_block_bytes((int)md->k_type);
    const int64_t v_bytes = v.head_dim / 32 * kv_block_bytes((int)md->v_type);
    return vector_attention(&v) && v.head_dim % 32 == 0 && ly->kv_kind >= k_bytes && v.kv_pos >= ly->kv_kind + v_bytes;
}

/* What flover_forward assumes of each layer's KV, checked once as the model is: 0, or 6. */
API int flover_check_layers(const Model *md, const Layer *layers) {
    if (md->bidirectional && !prompt_blocks_group(md, layers))
        return 11; /* attention both ways runs in the blocked prompt kernel only */
    for (int64_t l = 0; l < md->layers; l++) {
        const Layer *ly = &layers[l];
        if (ly->delta) { /* a DeltaNet layer: its projections and states instead of KV */
            if (!md->delta_value_heads || !(ly->delta_in || ly->delta_in_grid) || !(ly->delta_out || ly->delta_out_grid) ||
                !ly->delta_conv_w || !ly->delta_dt_bias || !ly->delta_a || !ly->delta_norm || !ly->conv_state ||
                !ly->ssm_state)
                return 9;
        } else if (!ly->kv || ly->kv_len <= 0 || ly->kv_len > md->max_seq ||
                   ly->kv_head < ly->kv_len * layer_view(md, ly).kv_pos ||
                   ly->kv_slot < layer_view(md, ly).kv_heads * ly->kv_head || ly->kv_kind <= 0 ||
                   (ly->windowed_kv && !md->window_base) || layer_view(md, ly).kv_pos < layer_view(md, ly).head_dim ||
                   md->heads % layer_view(md, ly).kv_heads || layer_view(md, ly).head_dim % 2 ||
                   layer_view(md, ly).head_dim > widest_view(md).head_dim ||
                   layer_view(md, ly).kv_heads > widest_view(md).kv_heads || layer_view(md, ly).inter > widest_view(md).inter)
            return 6; /* a slot's rows and heads must not overlap one another */
        if (!ly->delta && (md->k_type || md->v_type) && !kv_codes_fit(md, ly))
            return 12; /* --kv-dtype's codes: whole blocks, read by the vector attention */
        if ((ly->pl_gate || ly->pl_gate_grid) && (!md->per_layer_width || !(ly->pl_proj || ly->pl_proj_grid) || !ly->pl_norm))
            return 10; /* a per-layer input: its gate, projection and norm */
        if (ly->router ? !md->experts || !ly->expert_load || !(ly->expert_gate_up || ly->expert_gate_up_grid) ||
                             !(ly->expert_down || ly->expert_down_grid)
                       : !ly->gate_up && !ly->gate_up_grid)
            return 7; /* a layer has its experts where the model has them, or its dense MLP */
    }
    return 0;
}

/* The embedding of `rows` token ids into hidden [rows, h] (summed over the ranks under TP; Gemma 3
 * scales it by sqrt(hidden)). */
static void embed_rows(const Model *md, const int64_t *tokens, int rows, float *hidden, int bf) {
    const int64_t h = md->hidden;
    for (int r = 0; r < rows; r++) { /* under TP: ids outside this rank's block are zero rows */
        const int64_t t = tokens[r] - md->vocab_start;
        if (md->embed_grid && t >= 0 && t < md->vocab) { /* the head's codes, rounded as the embedding's values */
            grid_row((const Grid *)md->embed_grid, t, h, hidden + r * h);
            for (int64_t i = 0; i < h; i++) hidden[r * h + i] = rnd(hidden[r * h + i], bf);
            continue;
        }
        for (int64_t i = 0; i < h; i++)
            hidden[r * h + i] = t >= 0 && t < md->vocab ? load((const void *)md->embed, t * h + i, bf) : 0.f;
    }
    reduce_rows(md, hidden, rows * h);
    if (md->embed_scale != 0) /* (Gemma 3) times sqrt(hidden), that factor already in the model dtype */
        for (int64_t i = 0; i < rows * h; i++) hidden[i] = rnd(hidden[i] * (float)md->embed_scale, bf);
}

/* (Gemma 4) The rows' per-layer inputs [rows, layers, width] into `out`: the embedding's projection
 * [rows, layers x width] times hidden^-0.5, each layer's part RMS-normed, plus the table's rows
 * (md->per_layer_inputs), times 1/sqrt(2), rounded where PyTorch rounds. `emb`: [rows, hidden]
 * scratch for the embedding; `proj`: [rows, layers x width] scratch. */
static void per_layer_inputs(const Model *md, const int64_t *tokens, int rows, float *emb, float *proj, void *xb,
                             float *out, float eps, int bf, int nt) {
    const int64_t w = md->per_layer_width, lw = md->layers * w, h = md->hidden;
    embed_rows(md, tokens, rows, emb, bf);
    project(md, md->per_layer_proj, 0, emb, xb, rows, lw, h, proj, nt);
    const float *table = (const float *)md->per_layer_inputs;
    const float scale = (float)(1.0 / sqrt((double)h)), half = (float)(1.0 / sqrt(2.0));
#pragma omp parallel for num_threads(nt) schedule(static) if (rows >= 8)
    for (int r = 0; r < rows; r++)
        for (int64_t l = 0; l < md->layers; l++) {
            float *x = proj + r * lw + l * w, *y = out + r * lw + l * w;
            for (int64_t i = 0; i < w; i++) x[i] = rnd(x[i] * scale, bf);
            norm_row(md, x, md->per_layer_norm, eps, w, bf, y);
            for (int64_t i = 0; i < w; i++) y[i] = rnd(rnd(y[i] + table[r * lw + l * w + i], bf) * half, bf);
        }
}

/* The final norm of the rows whose logits are wanted (out_rows of hidden, or rows 0..n_out-1
 * where out_rows is 0), then the LM head writes them straight into `logits`, in float32 whatever
 * the model dtype (as llama.cpp's): rounded to bfloat16, near ties became exact ties, which the
 * first index won (SmolLM2's first answer token). */
static int head_rows(const Model *md, const Work *at, float *work, const float *hidden, int n_out,
                     const int64_t *out_rows, void *logits, int64_t *greedy_ids, float eps, int nt) {
    const int bf = md->dtype == DT_BF16;
    const int64_t h = md->hidden;
    float *mid = work + at->mid, *xsum = work + at->xsum;
    void *xb = work + at->xb;
    for (int o = 0; o < n_out; o++)
        norm_row(md, hidden + (out_rows ? out_rows[o] : o) * h, md->final_norm, eps, h, bf, mid + o * h);
    if (greedy_ids && n_out > md->screen_rows) return head_greedy(md, mid, xb, n_out, greedy_ids, nt);
    if (greedy_ids && md->head_screen) return screened_greedy(md, mid, xb, n_out, (float *)logits, greedy_ids, nt);
    if (n_out > 0 && md->head_grid) {
        project_grid((const Grid *)md->head_grid, 0, 0, mid, xb, xsum, n_out, md->vocab, h, logits, nt);
        return 0;
    }
    const int head_kind = md->head_scales ? W_Q8 : bf ? W_BF16 : W_F32;
    if (n_out > 0)
        project_kind(head_kind, 0, md->head, md->head_scales, 0, mid, xb, n_out, md->vocab, h, logits, md->vocab, 0, nt, 0);
    return 0;
}

/* The first pipeline stage, once the last one's residual rows [n_out, hidden] came back: their
 * logits (or greedy ids), as flover_forward's tail. */
API int flover_head(const Model *md, const float *hidden, int n_out, void *logits, int64_t *greedy_ids, float *work,
                    double eps_d, int nt) {
    const Work at = work_layout(md, n_out, nt);
    return head_rows(md, &at, work, hidden, n_out, 0, logits, greedy_ids, (float)eps_d, nt);
}

/* (attention both ways) Each row's input's length into ends[r]: an input is a run of consecutive
 * rows of one slot from position 0, whole in this iteration. Nonzero where a row is a decode row
 * or an input does not start at position 0. */
static int input_ends(const int64_t *slots, const int64_t *positions, int decode_rows, int rows, int64_t *ends) {
    if (decode_rows) return 1;
    for (int r = 0; r < rows;) {
        int n = 1;
        while (r + n < rows && slots[r + n] == slots[r] && positions[r + n] == positions[r + n - 1] + 1) n++;
        if (positions[r] != 0) return 1;
        for (int i = r; i < r + n; i++) ends[i] = n;
        r += n;
    }
    return 0;
}

/* One iteration: `rows` tokens, token r at position positions[r] of slot slots[r] (decode tokens
 * and prompt tokens alike: its K/V are written there, and it attends to its slot's keys up to
 * its own position, which this iteration's earlier prompt tokens have written). Logits of the
 * rows listed in out_rows: [n_out, vocab] float32; or, with greedy_ids (models with
 * head_screen), those rows' greedy ids, `logits` serving as [n_out, vocab] float32 scratch. Returns 0, or with greedy_ids the rows that took the whole head.
 * A pipeline stage (flover/runner/pipeline.py) runs its layers only: with hidden_in [rows, hidden]
 * float32 (the previous stage's residual rows) in place of the token embedding, and with
 * hidden_out the residual rows after its last layer are written there instead of any logits (n_out 0).
 * Embeddings ask for both: hidden_out gets every row's residual, then the head its out_rows. */
API int flover_forward(const Model *md, const Layer *layers, int rows, int decode_rows, const int64_t *tokens,
                   const int64_t *positions, const int64_t *slots, int n_out, const int64_t *out_rows, void *logits,
                   int64_t *greedy_ids, const float *hidden_in, float *hidden_out, float *work, double eps_d, int nt) {
    for (int r = 0; r < rows; r++) /* a row past its slot's positions would touch another slot's */
        if (positions[r] < 0 || positions[r] >= md->max_seq || (!hidden_in && tokens[r] < 0)) return -1;
    for (int64_t l = 0; l < md->layers; l++) /* and in a windowed layer, one outside its slot's window rows */
        for (int r = 0; layers[l].windowed_kv && !layers[l].delta && r < rows; r++) {
            const int64_t at = positions[r] - row_base(md, &layers[l], slots[r]);
            if (at < 0 || at >= layers[l].kv_len) return -1;
        }
    const int bf = md->dtype == DT_BF16;
    const float eps = (float)eps_d;
    const int64_t h = md->hidden, heads = md->heads;
    const Work at = work_layout(md, rows, nt);
    float *hidden = work + at.hidden, *normed = work + at.normed, *wide = work + at.wide, *mid = work + at.mid;
    float *scores = work + at.scores, *xsum = work + at.xsum;
    void *xb = work + at.xb;
    const int64_t es = bf ? 2 : 4; /* bytes per element of the model dtype */
#define PROJECT(W, BIAS, X, N, K, Y)                                                                       \
    if (ly->W##_grid)                                                                                      \
        project_grid((const Grid *)ly->W##_grid, bf, BIAS, X, xb, xsum, rows, N, K, Y, nt);              \
    else                                                                                                   \
        project(md, ly->W, BIAS, X, xb, rows, N, K, Y, nt);

    if (hidden_in) /* a later pipeline stage: the residual rows as the stage before left them */
        memcpy(hidden, hidden_in, rows * h * sizeof(float));
    else
        embed_rows(md, tokens, rows, hidden, bf);
    float *pl_inputs = work + at.per_layer; /* (Gemma 4; embedding and projection in normed and wide, free here) */
    if (md->per_layer_width) per_layer_inputs(md, tokens, rows, normed, wide, xb, pl_inputs, eps, bf, nt);

    /* Attention tasks: prompt rows in blocks (consecutive positions of one slot, up to
     * MAX_BLOCK_QUERIES queries per kv head) where the blocked kernel applies to every attention
     * layer (blocks sized for the largest group of query heads); decode rows (the first
     * decode_rows), and prompt rows otherwise, one by one. */
    int64_t *blocks = (int64_t *)(work + at.blocks), n_blocks = 0, single_from = decode_rows;
    const int64_t group_most = prompt_blocks_group(md, layers);
    if (group_most) {
        const int64_t per_block = MAX_BLOCK_QUERIES / group_most;
        for (int64_t r = decode_rows; r < rows;) {
            int64_t n = 1;
            while (r + n < rows && n < per_block && slots[r + n] == slots[r] && positions[r + n] == positions[r + n - 1] + 1)
                n++;
            blocks[2 * n_blocks] = r, blocks[2 * n_blocks + 1] = n, n_blocks++;
            r += n;
        }
        single_from = rows;
    }
    int64_t *ends = md->bidirectional ? (int64_t *)(work + at.ends) : 0; /* attention both ways */
    if (ends && input_ends(slots, positions, decode_rows, rows, ends)) return -1;
    int64_t *runs = (int64_t *)(work + at.runs); /* DeltaNet: each sequence's rows */
    const int64_t n_runs = md->delta_value_heads ? delta_runs(slots, positions, rows, runs) : 0;

#pragma omp parallel for num_threads(nt) schedule(static) if (rows >= 16)
    for (int r = 0; r < rows; r++) {
        if (layers[0].input_norm) norm_row(md, hidden + r * h, layers[0].input_norm, eps, h, bf, normed + r * h);
        else memcpy(normed + r * h, hidden + r * h, h * sizeof(float)); /* (OLMo 2: no norm before attention) */
    }
    for (int64_t l = 0; l < md->layers; l++) {
        const Layer *ly = &layers[l];
        const Model view = layer_view(md, ly), *lmd = &view; /* (Gemma 4: the layer's own head shape) */
        const int64_t d = lmd->head_dim, kvh = lmd->kv_heads, inter = lmd->inter, group = heads / kvh;
        const int64_t q_size = heads * d, kv_size = kvh * d, qkv_n = q_rows(lmd) + (ly->q_only ? 0 : 2 * kv_size);
        const int64_t single_tasks = (decode_rows + rows - single_from) * kvh;
        /* normed: the input norm of the hidden rows (of the embedding, or by the last layer's
         * residual pass) */
        if (ly->delta) { /* (Qwen3.5) a Gated DeltaNet layer in place of attention: its output lands in normed */
            const int64_t in_n = delta_in_width(md), v_n = md->delta_value_heads * md->delta_dv;
            PROJECT(delta_in, 0, normed, in_n, h, wide)
            delta_conv(md, ly, wide, in_n, slots, positions, runs, n_runs, bf, nt);
            delta_heads(md, ly, wide, in_n, mid, slots, positions, runs, n_runs, eps, bf, scores, at.per_thread, nt);
            PROJECT(delta_out, 0, mid, h, v_n, normed)
        } else {
        if (ly->v_from_k) { /* (Gemma 4) q and k projected: each row spread to [q | k | v], v filled below */
            PROJECT(qkv, ly->qkv_bias, normed, q_size + kv_size, h, wide)
            for (int r = rows - 1; r >= 0; r--) memmove(wide + r * qkv_n, wide + r * (q_size + kv_size), (q_size + kv_size) * sizeof(float));
        } else {
            PROJECT(qkv, ly->qkv_bias, normed, qkv_n, h, wide)
        }

#pragma omp parallel for num_threads(nt) schedule(static) if (rows >= 8)
        for (int r = 0; r < rows; r++) {
            float *row = wide + r * qkv_n;
            const int64_t p = positions[r];
            if (md->attn_gate) /* per head [query, gate] -> [queries | k | v | gates] */
                split_gates(row, scores + (int64_t)omp_get_thread_num() * at.per_thread, heads, kv_size, d);
            if (ly->v_from_k) memcpy(row + q_size + kv_size, row + q_size, kv_size * sizeof(float));
            const int64_t rot = lmd->rotary_dim, turned = heads + (ly->q_only ? 0 : kvh); /* heads q (and k) */
            const int64_t cos_base = ly->local_rope ? md->local_cos : md->cos, sin_base = ly->local_rope ? md->local_sin : md->sin;
            const void *cos_row = (const char *)cos_base + p * rot * es, *sin_row = (const char *)sin_base + p * rot * es;
            if (ly->q_norm && ly->qk_norm_whole) { /* (OLMo 2) all of q, then all of k: in place */
                norm_row(md, row, ly->q_norm, eps, q_size, bf, row);
                norm_row(md, row + q_size, ly->k_norm, eps, kv_size, bf, row + q_size);
            } else if (ly->q_norm) /* (Qwen3) each head of q, then of k, alone: in place */
                for (int64_t hh = 0; hh < turned; hh++)
                    norm_row(md, row + hh * d, hh < heads ? ly->q_norm : ly->k_norm, eps, d, bf, row + hh * d);
            if (!ly->no_rope)
                for (int64_t hh = 0; hh < turned; hh++) rope(row + hh * d, cos_row, sin_row, rot, bf);
            if (ly->q_only) continue; /* (Gemma 4) an earlier layer wrote this row's keys and values */
            const int64_t at = p - row_base(md, ly, slots[r]); /* its row in the layer's cache */
            for (int64_t g = 0; g < kvh; g++) {
                float *v = row + q_size + kv_size + g * d;
                if (md->v_norm) norm_row(md, v, md->v_norm, eps, d, bf, v); /* (Gemma 4) ones: no weight */
                const int64_t row_at = at * lmd->kv_pos * kv_unit(md);
                kv_store(row + q_size + g * d, kv_head_base(md, ly, 0, slots[r], g) + row_at, d, (int)md->k_type, bf);
                kv_store(v, kv_head_base(md, ly, 1, slots[r], g) + row_at, d, (int)md->v_type, bf);
            }
        }
        const float *sinks = (const float *)ly->sinks; /* (gpt-oss) each query head's sink logit, or none */
        /* attention: one task per (prompt block, kv head) first (the larger tasks), then per (row, kv head) */
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
        for (int64_t task = 0; task < n_blocks * kvh + single_tasks; task++) {
            float *scratch = scores + (int64_t)omp_get_thread_num() * at.per_thread;
            if (task < n_blocks * kvh) {
                const int64_t *b = blocks + 2 * (task / kvh), g = task % kvh;
                attend_prompt(lmd, wide, qkv_n, q_size, b[0], b[1], g, positions, ends, row_base(md, ly, slots[b[0]]),
                              ly->window, kv_head_base(md, ly, 0, slots[b[0]], g),
                              kv_head_base(md, ly, 1, slots[b[0]], g), sinks ? sinks + g * group : 0, scratch, mid);
                continue;
            }
            const int64_t single = task - n_blocks * kvh, nth = single / kvh, g = single % kvh;
            const int r = (int)(nth < decode_rows ? nth : single_from + nth - decode_rows);
            const int64_t len = positions[r] + 1, base = row_base(md, ly, slots[r]); /* keys: rows from 0 at base */
            const int64_t first = first_key(len, ly->window) - base;
            attend(lmd, wide + r * qkv_n + g * group * d, group, kv_head_base(md, ly, 0, slots[r], g),
                   kv_head_base(md, ly, 1, slots[r], g), first > 0 ? first : 0, len - base,
                   sinks ? sinks + g * group : 0, scratch, mid + r * q_size + g * group * d);
        }
        if (md->attn_gate) /* (Qwen3.5) attention's output times sigmoid(gate) */
            apply_gates(mid, wide, rows, q_size, qkv_n, q_size + 2 * kv_size, bf, nt);
        PROJECT(o, 0, mid, h, q_size, normed)
        }
        reduce_rows(md, normed, rows * h);
        if (ly->attn_norm_after) /* Gemma 3: attention's output normed, added, the sum normed for the MLP */
            norm_then_residual(md, hidden, normed, rows, ly->attn_norm_after, ly->post_norm, eps, h, bf, nt);
        else if (ly->ffn_norm_after) /* OLMo 2: attention's output normed, then added; the MLP reads the sum */
            norm_then_residual(md, hidden, normed, rows, ly->post_norm, 0, eps, h, bf, nt);
        else
            residual_and_norm(md, hidden, normed, rows, ly->o_bias, ly->post_norm, eps, h, bf, nt);
        if (ly->router && ly->beside_pre) { /* (Gemma 4) experts beside the MLP: both normed, then added */
            const ExpertsWork ew = experts_work(work, &at, md, rows);
            beside_inputs(md, ly, hidden, rows, ew.route_in, ew.input, eps, bf, nt);
            experts_step(md, ly, ew.input, rows, ew.sum, &ew, xb, xsum, wide, mid, nt, ew.route_in);
            reduce_rows(md, ew.sum, rows * h);
            PROJECT(gate_up, ly->gate_up_bias, normed, 2 * inter, h, wide)
#pragma omp parallel for num_threads(nt) schedule(static) if (rows >= 8)
            for (int r = 0; r < rows; r++) gelu_mul(wide + r * 2 * inter, inter, bf, mid + r * inter);
            PROJECT(down, 0, mid, h, inter, normed)
            reduce_rows(md, normed, rows * h);
            beside_sum(md, ly, normed, ew.sum, rows, eps, bf, nt);
        } else if (ly->router) { /* experts in place of the MLP: their sum lands in normed, as the down projection's */
            const ExpertsWork ew = experts_work(work, &at, md, rows);
            experts_step(md, ly, normed, rows, ew.sum, &ew, xb, xsum, wide, mid, nt, 0);
            if (ly->shared_gate) { /* (Qwen3.5-MoE) the shared expert, gated, added to the routed ones' sum */
                const int64_t si = md->shared_inter;
                PROJECT(shared_gate_up, 0, normed, 2 * si, h, wide)
#pragma omp parallel for num_threads(nt) schedule(static) if (rows >= 8)
                for (int r = 0; r < rows; r++) silu_mul(wide + r * 2 * si, si, bf, mid + r * si);
                PROJECT(shared_down, 0, mid, h, si, wide)
                add_shared(md, ly, normed, wide, ew.sum, rows, bf, nt);
            }
            memcpy(normed, ew.sum, rows * h * sizeof(float));
        } else {
            const int fused = ly->gate_up_grid && !ly->gate_up_bias && !md->act &&
                              project_swiglu((const Grid *)ly->gate_up_grid, normed, xb, xsum, rows, inter, h, mid, bf, nt);
            if (!fused) {
                PROJECT(gate_up, ly->gate_up_bias, normed, 2 * inter, h, wide)
#pragma omp parallel for num_threads(nt) schedule(static) if (rows >= 8)
                for (int r = 0; r < rows; r++) {
                    if (md->act) gelu_mul(wide + r * 2 * inter, inter, bf, mid + r * inter);
                    else silu_mul(wide + r * 2 * inter, inter, bf, mid + r * inter);
                }
            }
            PROJECT(down, 0, mid, h, inter, normed)
        }
        if (!ly->beside_pre) reduce_rows(md, normed, rows * h); /* (beside: each part reduced before its norm) */
        const int64_t next_norm = l + 1 < md->layers ? layers[l + 1].input_norm : 0;
        const int tail = ly->pl_gate || ly->pl_gate_grid || ly->scalar != 0; /* (Gemma 4) after the residual add */
        if (ly->ffn_norm_after)
            norm_then_residual(md, hidden, normed, rows, ly->ffn_norm_after, tail ? 0 : next_norm, eps, h, bf, nt);
        else
            residual_and_norm(md, hidden, normed, rows, ly->down_bias, tail ? 0 : next_norm, eps, h, bf, nt);
        if (tail) {
            if (ly->pl_gate || ly->pl_gate_grid) { /* hidden += norm(proj(gelu(gate(hidden)) x the layer's input)) */
                const int64_t w = md->per_layer_width;
                const float *inputs = pl_inputs;
                PROJECT(pl_gate, 0, hidden, w, h, wide)
#pragma omp parallel for num_threads(nt) schedule(static) if (rows >= 8)
                for (int r = 0; r < rows; r++) { /* [gate | input] rows for gelu_mul: act(gate) x input */
                    float *pair = wide + rows * w + r * 2 * w;
                    memcpy(pair, wide + r * w, w * sizeof(float));
                    memcpy(pair + w, inputs + (r * md->layers + l) * w, w * sizeof(float));
                    gelu_mul(pair, w, bf, mid + r * w);
                }
                PROJECT(pl_proj, 0, mid, h, w, normed)
                norm_then_residual(md, hidden, normed, rows, ly->pl_norm, 0, eps, h, bf, nt);
            }
            finish_layer(md, ly, hidden, normed, rows, next_norm, eps, bf, nt);
        }
    }
#undef PROJECT
    if (hidden_out) { /* a pipeline stage before the head (n_out 0), or rows to pool: the residual rows */
        memcpy(hidden_out, hidden, rows * h * sizeof(float));
        if (!n_out) return 0;
    }
    return head_rows(md, &at, work, hidden, n_out, out_rows, logits, greedy_ids, eps, nt);
}
