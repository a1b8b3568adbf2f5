/* A layer's mixture of experts over an iteration's rows (Qwen3-MoE, Mixtral, gpt-oss), as
 * flover/models/moe.py computes it: the router's logits, each row's top k of a float32 softmax
 * (renormalised where the model says), then each expert that some row chose runs once, as one
 * projection over the rows that chose it; experts no row chose are not read.
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
static void route_row(const Model *md, const float *logits, int64_t *picked, float *weight) {
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
    if (!md->weights_f32)
        for (int64_t j = 0; j < k; j++) weight[j] = rnd(weight[j], md->dtype == DT_BF16);
}

/* y = x W^T (+ b) for expert e's weight of one kind: its Grid where it has codes, else its blocked
 * weight; its bias where the experts have them (gpt-oss) */
static void expert_project(const Model *md, int64_t grids, int64_t dense, int64_t biases, int64_t e, const float *x,
                           void *xb, float *xsum, int rows, int64_t n_out, int64_t k, float *y, int nt) {
    const int64_t grid = grids ? ((const int64_t *)grids)[e] : 0, bias = biases ? ((const int64_t *)biases)[e] : 0;
    if (grid)
        project_grid((const Grid *)grid, md->dtype == DT_BF16, bias, x, xb, xsum, rows, n_out, k, y, nt);
    else
        project(md, ((const int64_t *)dense)[e], bias, x, xb, rows, n_out, k, y, nt);
}

void experts_step(const Model *md, const Layer *ly, const float *x, int rows, float *y, const ExpertsWork *w,
                  void *xb, float *xsum, float *wide, float *mid, int nt) {
    const int bf = md->dtype == DT_BF16;
    const int64_t h = md->hidden, n = md->experts, k = md->top_k, inter = md->expert_inter;
    int64_t *load = (int64_t *)ly->expert_load;
    int64_t *start = w->start;
    project(md, ly->router, ly->router_bias, x, xb, rows, n, h, w->logits, nt); /* [rows, experts], rounded */
    for (int64_t e = 0; e <= n; e++) start[e] = 0;
    for (int r = 0; r < rows; r++) {
        route_row(md, w->logits + r * n, w->picked + r * k, w->weight + r * k);
        for (int64_t j = 0; j < k; j++) start[w->picked[r * k + j] + 1]++;
    }
    for (int64_t e = 0; e < n; e++) load[e] += start[e + 1], start[e + 1] += start[e];
    /* each (row, pick) into its expert's entries, rows ascending (start[e] counts up to the end of
     * e's entries, then every start moves back one expert) */
    for (int r = 0; r < rows; r++)
        for (int64_t j = 0; j < k; j++) {
            const int64_t at = start[w->picked[r * k + j]]++;
            w->members[at] = r, w->member_weight[at] = w->weight[r * k + j];
        }
    for (int64_t e = n; e > 0; e--) start[e] = start[e - 1];
    start[0] = 0;
    memset(y, 0, rows * h * sizeof(float));
    for (int64_t e = 0; e < n; e++) {
        const int m = (int)(start[e + 1] - start[e]); /* the rows that chose e, and their weights for it */
        const int64_t *members = w->members + start[e];
        const float *member_weight = w->member_weight + start[e];
        if (!m) continue;
        for (int i = 0; i < m; i++) memcpy(w->gathered + i * h, x + members[i] * h, h * sizeof(float));
        expert_project(md, ly->expert_gate_up_grid, ly->expert_gate_up, ly->expert_gate_up_bias, e, w->gathered, xb,
                       xsum, m, 2 * inter, h, wide, nt);
        for (int i = 0; i < m; i++) {
            if (md->act == 2)
                swiglu_clamped_mul(wide + i * 2 * inter, inter, bf, (float)md->swiglu_limit, (float)md->swiglu_alpha,
                                   mid + i * inter);
            else if (md->act) gelu_mul(wide + i * 2 * inter, inter, bf, mid + i * inter);
            else silu_mul(wide + i * 2 * inter, inter, bf, mid + i * inter);
        }
        expert_project(md, ly->expert_down_grid, ly->expert_down, ly->expert_down_bias, e, mid, xb, xsum, m, h, inter,
                       w->out, nt);
        for (int i = 0; i < m; i++) { /* the row's sum += rnd(output * weight), in the model dtype */
            float *sum = y + members[i] * h;
            const float *out = w->out + i * h;
            const v16 weight = v_set1(member_weight[i]);
            for (int64_t c = 0; c < h; c += 16) {
                const v16 added = v_add(v_loadn(sum + c, h - c), v_rnd(v_mul(v_loadn(out + c, h - c), weight), bf));
                v_storen(sum + c, v_rnd(added, bf), h - c);
            }
        }
    }
}
