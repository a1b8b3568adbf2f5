/* A layer's mixture of experts over an iteration's rows (Qwen3-MoE, Mixtral, gpt-oss), as
 * flover/models/moe.py computes it: the router's logits, each row's top k of a float32 softmax
 * (renormalised where the model says), then each expert that some row chose runs once, as one
 * projection over the rows that chose it; experts no row chose are not read. A decode-sized
 * iteration over a GGUF file's experts runs them all in one parallel region (experts_fused).
 *
 * A row's result does not depend on the other rows: a projection's output row is summed in the
 * same order whatever rows share the tile (project.c), and each row's sum adds its experts'
 * weighted outputs in ascending expert index, starting from zero, rounded after every add as
 * PyTorch's index_add_ in the model dtype. */
#include <omp.h>

#include "native.h"

/* Row r's top k of its logits: softmax in float32, the k largest probabilities (the first index
 * among equals), renormalised by their sum (taken largest first, as torch.topk orders them); or
 * (gpt-oss, topk_softmax) the k largest logits, then the softmax of those k, rounded to the model dtype. */
static void route_row(const Model *md, const float *logits, int64_t *picked, float *weight, const float *scales) {
    const int64_t n = md->experts, k = md->top_k;
    float top = logits[0], sum = 0.f;
    for (int64_t e = 1; e < n; e++) top = logits[e] > top ? logits[e] : top;
    for (int64_t e = 0; e < n && !md->topk_softmax; e++) sum += expf(logits[e] - top);
    for (int64_t j = 0; j < k; j++) {
        int64_t best = -1;
        for (int64_t e = 0; e < n; e++) {
            int taken = 0;
            for (int64_t i = 0; i < j; i++) taken |= picked[i] == e;
            if (!taken && (best < 0 || logits[e] > logits[best])) best = e;
        }
        picked[j] = best, weight[j] = expf(logits[best] - top);
    }
    for (int64_t j = 0; j < k && md->topk_softmax; j++) sum += weight[j]; /* (the top k's own sum) */
    for (int64_t j = 0; j < k; j++) weight[j] /= sum;
    if (md->norm_topk) {
        float chosen = 0.f;
        for (int64_t j = 0; j < k; j++) chosen += weight[j];
        for (int64_t j = 0; j < k; j++) weight[j] /= chosen;
    }
    for (int64_t j = 0; j < k && scales; j++) weight[j] *= scales[picked[j]]; /* (Gemma 4) each expert's scale */
    if (!md->weights_f32)
        for (int64_t j = 0; j < k; j++) weight[j] = rnd(weight[j], md->dtype == DT_BF16);
}

/* expert e's Grid in a layer's table of them (0: its weight is not in codes) */
static inline const Grid *expert_grid(int64_t grids, int64_t e) { return (const Grid *)((const int64_t *)grids)[e]; }

/* y = x W^T (+ b) for expert e's weight of one kind: its Grid where it has codes, else its blocked
 * weight; its bias where the experts have them (gpt-oss) */
static void expert_project(const Model *md, int64_t grids, int64_t dense, int64_t biases, int64_t e, const float *x,
                           void *xb, float *xsum, int rows, int64_t n_out, int64_t k, float *y, int nt) {
    const Grid *grid = grids ? expert_grid(grids, e) : 0;
    const int64_t bias = biases ? ((const int64_t *)biases)[e] : 0;
    if (grid)
        project_grid(grid, md->dtype == DT_BF16, bias, x, xb, xsum, rows, n_out, k, y, nt);
    else
        project(md, ((const int64_t *)dense)[e], bias, x, xb, rows, n_out, k, y, nt);
}

/* an entry's activation: the gate_up outputs [2 inter] -> mid [inter], the model's act */
static void activate(const Model *md, const float *wide, int64_t inter, int bf, float *mid) {
    if (md->act == 2) swiglu_clamped_mul(wide, inter, bf, (float)md->swiglu_limit, (float)md->swiglu_alpha, mid);
    else if (md->act) gelu_mul(wide, inter, bf, mid);
    else silu_mul(wide, inter, bf, mid);
}

/* a row's sum += rnd(output * weight), in the model dtype */
static void add_weighted(float *sum, const float *out, float weight, int64_t h, int bf) {
    const v16 w = v_set1(weight);
    for (int64_t c = 0; c < h; c += 16) {
        const v16 added = v_add(v_loadn(sum + c, h - c), v_rnd(v_mul(v_loadn(out + c, h - c), w), bf));
        v_storen(sum + c, v_rnd(added, bf), h - c);
    }
}

/* Whether every expert's gate_up and down are codes that take int8 inputs (a GGUF file's), in the
 * same blocks as the first expert's (one quantization of the inputs serves them all) */
static int experts_take_int8(const Model *md, const Layer *ly) {
    if (!ly->expert_gate_up_grid || !ly->expert_down_grid) return 0;
    const Grid *first[2] = {expert_grid(ly->expert_gate_up_grid, 0), expert_grid(ly->expert_down_grid, 0)};
    if (!first[0] || !first[1]) return 0;
    for (int64_t e = 0; e < md->experts; e++) {
        const Grid *grids[2] = {expert_grid(ly->expert_gate_up_grid, e), expert_grid(ly->expert_down_grid, e)};
        for (int i = 0; i < 2; i++) {
            if (!grids[i]) return 0;
            for (int64_t p = 0; p < grids[i]->parts; p++)
                if (!grids[i]->part[p].x8) return 0;
            if (x8_block(grids[i]) != x8_block(first[i])) return 0;
        }
    }
    return 1;
}

/* Thread t of T's share of one projection kind (gate_up or down) over every chosen expert: the
 * experts' blocks of 16 outputs in a row, a block of expert e costing its m_e rows plus one (the
 * unpacking of its codes, which the rows share); the thread takes the blocks whose cost starts in
 * its T-th of the total. in: the entries' int8 inputs (k each); y: [entries, n_out] floats. */
static void experts_share(const Model *md, int64_t grids, int64_t biases, const int64_t *start, const Int8Rows *in,
                          int64_t k, int64_t n_out, float *y, int t, int T) {
    const int64_t n = md->experts, blocks = (n_out + 15) / 16;
    int64_t total = 0;
    for (int64_t e = 0; e < n; e++)
        if (start[e + 1] > start[e]) total += (start[e + 1] - start[e] + 1) * blocks;
    const int64_t lo = total * t / T, hi = total * (t + 1) / T;
    for (int64_t e = 0, at = 0; e < n && at < hi; e++) {
        const int64_t m = start[e + 1] - start[e], cost = m + 1;
        if (!m) continue;
        const int64_t j0 = lo > at ? (lo - at + cost - 1) / cost : 0, j1_all = (hi - at + cost - 1) / cost;
        const int64_t j1 = j1_all < blocks ? j1_all : blocks;
        at += cost * blocks;
        if (j0 >= j1) continue;
        const Grid *grid = expert_grid(grids, e);
        const char *bias = biases ? (const char *)((const int64_t *)biases)[e] : 0;
        const Int8Rows xe = int8_rows_from(in, start[e], k);
        float *ye = y + start[e] * n_out;
        /* blocks j of the expert: blocks of its grid's runs (every run but the last whole blocks), a run at a time */
        int64_t p = 0, first = 0, columns = 0;
        for (int64_t j = j0; j < j1;) {
            while (j - first >= (grid->part[p].rows + 15) / 16)
                first += (grid->part[p].rows + 15) / 16, columns += grid->part[p].rows, p++;
            const int64_t run_end = first + (grid->part[p].rows + 15) / 16, end = j1 < run_end ? j1 : run_end;
            blocks_x8(&grid->part[p], j - first, end - first, k, &xe, (int)m,
                      bias ? bias + columns * (md->dtype == DT_BF16 ? 2 : 4) : 0, ye + columns, n_out,
                      md->dtype == DT_BF16);
            j = end;
        }
    }
}

/* The chosen experts over their entries in one parallel region (an iteration of up to
 * fused_expert_rows rows, experts in codes that take int8 inputs): per expert two regions and
 * their waits cost more than its few rows' work. The same tiles, sums and order as the loop in
 * experts_step, so the same bits. */
static void experts_fused(const Model *md, const float *x, int rows, float *y, const ExpertsWork *w, void *xb,
                          float *xsum, const Layer *ly, int nt) {
    const int bf = md->dtype == DT_BF16;
    const int64_t h = md->hidden, k = md->top_k, inter = md->expert_inter, entries = rows * k;
    const int64_t *start = w->start;
    /* (the first expert's blocks are every expert's: experts_take_int8) */
    const int64_t in_block = x8_block(expert_grid(ly->expert_gate_up_grid, 0));
    const int64_t act_block = x8_block(expert_grid(ly->expert_down_grid, 0));
    const Int8Rows x8 = int8_rows_at(xb, xsum, rows, h, in_block);
    const Int8Rows in = int8_rows_at(w->entry_x8, w->entry_ds16, entries, h, in_block);
    const Int8Rows act = int8_rows_at(w->entry_x8, w->entry_ds16, entries, inter, act_block);
#pragma omp parallel num_threads(nt)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        int8_rows(x, &x8, rows, h, t, T);
#pragma omp barrier
        for (int64_t i = entries * t / T; i < entries * (t + 1) / T; i++) /* each entry's row's int8 inputs */
            copy_int8_row(&x8, w->members[i], &in, i, h);
#pragma omp barrier
        experts_share(md, ly->expert_gate_up_grid, ly->expert_gate_up_bias, start, &in, h, 2 * inter, w->entry_wide, t,
                      T);
#pragma omp barrier
        for (int64_t i = entries * t / T; i < entries * (t + 1) / T; i++)
            activate(md, w->entry_wide + i * 2 * inter, inter, bf, w->entry_mid + i * inter);
        int8_rows(w->entry_mid, &act, (int)entries, inter, t, T); /* (this thread's entries, as above) */
#pragma omp barrier
        experts_share(md, ly->expert_down_grid, ly->expert_down_bias, start, &act, inter, h, w->entry_out, t, T);
#pragma omp barrier
        for (int r = rows * t / T; r < rows * (t + 1) / T; r++) { /* each row's experts, ascending */
            memset(y + r * h, 0, h * sizeof(float));
            for (int64_t j = 0; j < k; j++) {
                const int64_t i = w->row_entries[r * k + j];
                add_weighted(y + r * h, w->entry_out + i * h, w->member_weight[i], h, bf);
            }
        }
    }
}

void experts_step(const Model *md, const Layer *ly, const float *x, int rows, float *y, const ExpertsWork *w,
                  void *xb, float *xsum, float *wide, float *mid, int nt, const float *route_x) {
    const int bf = md->dtype == DT_BF16;
    const int64_t h = md->hidden, n = md->experts, k = md->top_k, inter = md->expert_inter;
    int64_t *load = (int64_t *)ly->expert_load;
    int64_t *start = w->start;
    /* [rows, experts], rounded; (Gemma 4) from rows of their own */
    project(md, ly->router, ly->router_bias, route_x ? route_x : x, xb, rows, n, h, w->logits, nt);
    for (int64_t e = 0; e <= n; e++) start[e] = 0;
    for (int r = 0; r < rows; r++) {
        route_row(md, w->logits + r * n, w->picked + r * k, w->weight + r * k, (const float *)ly->expert_scale);
        for (int64_t j = 0; j < k; j++) start[w->picked[r * k + j] + 1]++;
    }
    for (int64_t e = 0; e < n; e++) load[e] += start[e + 1], start[e + 1] += start[e];
    /* each (row, pick) into its expert's entries, rows ascending (start[e] counts up to the end of
     * e's entries, then every start moves back one expert) */
    const int fused = rows <= fused_expert_rows(md) && experts_take_int8(md, ly);
    for (int r = 0; r < rows; r++)
        for (int64_t j = 0; j < k; j++) {
            const int64_t at = start[w->picked[r * k + j]]++;
            w->members[at] = r, w->member_weight[at] = w->weight[r * k + j];
            if (!fused) continue;
            int64_t i = j, *mine = w->row_entries + r * k; /* the row's entries, ascending (so by expert) */
            for (; i > 0 && mine[i - 1] > at; i--) mine[i] = mine[i - 1];
            mine[i] = at;
        }
    for (int64_t e = n; e > 0; e--) start[e] = start[e - 1];
    start[0] = 0;
    if (fused) {
        experts_fused(md, x, rows, y, w, xb, xsum, ly, nt);
        return;
    }
    memset(y, 0, rows * h * sizeof(float));
    for (int64_t e = 0; e < n; e++) {
        const int m = (int)(start[e + 1] - start[e]); /* the rows that chose e, and their weights for it */
        const int64_t *members = w->members + start[e];
        const float *member_weight = w->member_weight + start[e];
        if (!m) continue;
        for (int i = 0; i < m; i++) memcpy(w->gathered + i * h, x + members[i] * h, h * sizeof(float));
        expert_project(md, ly->expert_gate_up_grid, ly->expert_gate_up, ly->expert_gate_up_bias, e, w->gathered, xb,
                       xsum, m, 2 * inter, h, wide, nt);
        for (int i = 0; i < m; i++) activate(md, wide + i * 2 * inter, inter, bf, mid + i * inter);
        expert_project(md, ly->expert_down_grid, ly->expert_down, ly->expert_down_bias, e, mid, xb, xsum, m, h, inter,
                       w->out, nt);
        for (int i = 0; i < m; i++) add_weighted(y + members[i] * h, w->out + i * h, member_weight[i], h, bf);
    }
}
