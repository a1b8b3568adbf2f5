/* The sampler beside the native step: the tokens of flover/runner/sampler.py's definition
 * (docs/sampling.md), in two calls around PyTorch's softmax, whose float32 values the definition
 * takes as they are. flover_sample_scale: logits / temperature, the refusals, top-k;
 * flover_sample_draw: top-p, min-p and the draw, without sorting the vocabulary.
 * Every sum the definition rounds is rounded here the same way: PyTorch's CPU cumsum of float32
 * adds in double, one value after the other, and stores each sum as float32. */
#include <math.h>
#include <omp.h>
#include <string.h>

#include "native.h"

/* Per thread, per vocabulary entry (SAMPLE_SCRATCH_BYTES_PER_TOKEN): the first pass's tokens,
 * candidates' ids and values, two sort orders and a keep flag; top-k's heap reuses the values. */
typedef struct {
    int32_t *pool_id, *id;
    float *pool_value, *value;
    uint32_t *order, *spare;
    uint8_t *keep;
} Scratch;

static Scratch scratch_of(void *base, int64_t vocab) {
    char *p = (char *)base + (int64_t)omp_get_thread_num() * vocab * SAMPLE_SCRATCH_BYTES_PER_TOKEN;
    return (Scratch){.id = (int32_t *)p, .value = (float *)(p + 4 * vocab), .order = (uint32_t *)(p + 8 * vocab),
                     .spare = (uint32_t *)(p + 12 * vocab), .pool_id = (int32_t *)(p + 16 * vocab),
                     .pool_value = (float *)(p + 20 * vocab), .keep = (uint8_t *)(p + 24 * vocab)};
}

/* splitmix64(seed, counter) in [0, 1), float64: sampler.counter_uniform */
static double counter_uniform(uint64_t seed, uint64_t counter) {
    uint64_t z = seed ^ (counter * 0x9E3779B97F4A7C15ull);
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (double)(z >> 11) / 9007199254740992.0; /* 2^53 */
}

/* ---- top-k: the k-th largest value (counted with repeats), through a min-heap of the k largest */
static void sift_down(float *heap, int64_t size, int64_t i) {
    for (;;) {
        int64_t least = i, l = 2 * i + 1, r = l + 1;
        if (l < size && heap[l] < heap[least]) least = l;
        if (r < size && heap[r] < heap[least]) least = r;
        if (least == i) return;
        const float t = heap[i];
        heap[i] = heap[least], heap[least] = t, i = least;
    }
}

static void sift_up(float *heap, int64_t i) {
    while (i > 0 && heap[(i - 1) / 2] > heap[i]) {
        const int64_t up = (i - 1) / 2;
        const float t = heap[i];
        heap[i] = heap[up], heap[up] = t, i = up;
    }
}

static float kth_largest(const float *x, int64_t n, int64_t k, float *heap) {
    int64_t size = 0;
    for (int64_t i = 0; i < n; i += 16) {
        const m16 live = lanes(n - i); /* once the heap is full, only values above its least */
        m16 above = size < k ? live : v_gt(v_loadn(x + i, n - i), v_set1(heap[0])) & live;
        for (; above; above &= above - 1) {
            const float v = x[i + __builtin_ctz(above)];
            if (size < k) heap[size] = v, sift_up(heap, size++);
            else if (v > heap[0]) heap[0] = v, sift_down(heap, size, 0);
        }
    }
    return heap[0];
}

/* scaled[j] = logits[r] / temperature[r] for the j-th row with a temperature (at[j] = r), with
 * top_k[r] > 0: values below the row's k-th largest set to -inf (ties stay); rows with
 * temperature 0 get ids[r] = their argmax. `allowed` (or NULL): per row, `words` 32-bit words
 * of structured output's bitmask; a token whose bit is clear counts as -inf. Returns the number
 * of scaled rows, or -1 - r for the first row r whose scaled values hold NaN or +inf, or no
 * finite value (refused). */
API int flover_sample_scale(const float *logits, int rows, int64_t vocab, int64_t stride, const float *temperature,
                            const int64_t *top_k, const uint32_t *allowed, int64_t words, float *scaled, int64_t *at,
                            int64_t *ids, void *scratch, int nt) {
    int n = 0, refused = rows;
    for (int r = 0; r < rows; r++)
        if (temperature[r] != 0) at[n++] = r;
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1) reduction(min : refused) if (rows >= 2)
    for (int r = 0; r < rows; r++) {
        const float *x = logits + r * stride;
        const uint16_t *mask = allowed ? (const uint16_t *)(allowed + r * words) : NULL; /* 16 tokens a half-word */
        if (temperature[r] == 0) {
            ids[r] = argmax_row(x, vocab, 0, mask);
            continue;
        }
        int j = 0;
        while (at[j] != r) j++;
        float *out = scaled + j * vocab;
        const v16 t = v_set1(temperature[r]);
        v16 top = v_set1(-INFINITY);
        m16 nan = 0;
        for (int64_t i = 0; i < vocab; i += 16) {
            v16 v = v_div(v_loadn(x + i, vocab - i), t);
            if (mask) v = v_select(mask[i / 16], v, v_set1(-INFINITY));
            nan |= v_nan(v) & lanes(vocab - i);
            top = v_max(v_select(lanes(vocab - i), v, v_set1(-INFINITY)), top);
            v_storen(out + i, v, vocab - i);
        }
        if (nan || !isfinite(v_reduce_max(top))) {
            refused = r < refused ? r : refused;
            continue;
        }
        const int64_t k = top_k[r] < vocab ? top_k[r] : vocab;
        if (k <= 0) continue;
        const v16 kth = v_set1(kth_largest(out, vocab, k, scratch_of(scratch, vocab).value));
        for (int64_t i = 0; i < vocab; i += 16) {
            const v16 v = v_loadn(out + i, vocab - i);
            v_storen(out + i, v_select(v_gt(kth, v), v_set1(-INFINITY), v), vocab - i);
        }
    }
    return refused < rows ? -1 - refused : n;
}

/* ---- the draw ---------------------------------------------------------------------------------
 * Over tokens in id order, the kept ones' probabilities added in double, each sum stored as
 * float32 (the definition's cumsum; a token left out adds 0, which changes no sum): the first
 * token whose sum passes u x the total, or, where float32 rounded u up to 1, the first whose sum
 * reaches the total (the last that adds mass). */
enum { GROUP = 4, MARKS = 256 }; /* rows drawn together: four independent chains of additions, not one */

/* Two passes in all: the sums (each row's running sum kept at MARKS points), then only the span
 * where the row's sum passes its mark is added again, from the sum before it. */
static void draw_dense(const float *const p[GROUP], int64_t n, const float floor[GROUP], const float u[GROUP],
                       int64_t out[GROUP]) {
    const int64_t span = n / MARKS + 1;
    double acc[GROUP] = {0}, before[GROUP][MARKS + 1]; /* before[q][b]: row q's sum before span b */
    int spans = 0;
    for (int64_t start = 0; start < n; start += span, spans++) {
        const int64_t end = start + span < n ? start + span : n;
        for (int q = 0; q < GROUP; q++) before[q][spans] = acc[q];
        for (int64_t i = start; i < end; i++)
            for (int q = 0; q < GROUP; q++) acc[q] += p[q][i] < floor[q] ? 0.f : p[q][i];
    }
    for (int q = 0; q < GROUP; q++) {
        before[q][spans] = acc[q];
        const float total = (float)acc[q], at = u[q] * total;
        int b = 0;
        for (; b < spans - 1; b++) { /* the first span whose end passes the mark */
            const float end = (float)before[q][b + 1];
            if (end > at || end >= total) break;
        }
        double sum = before[q][b];
        out[q] = n - 1;
        for (int64_t i = b * span; i < n; i++) {
            sum += p[q][i] < floor[q] ? 0.f : p[q][i];
            const float running = (float)sum;
            if (running > at || running >= total) {
                out[q] = i;
                break;
            }
        }
    }
}

static float row_max(const float *p, int64_t n) {
    v16 top = v_zero(); /* probabilities: >= 0 */
    for (int64_t i = 0; i < n; i += 16) top = v_max(v_loadn(p + i, n - i), top);
    return v_reduce_max(top);
}

/* ---- top-p ------------------------------------------------------------------------------------
 * The nucleus: the most probable tokens (ties: the lower id first) while the mass strictly above
 * a token, `before` = float32(cumsum) - p, is at most top_p. The candidates are every token with
 * p >= t for a threshold t: a whole prefix of that order, ties included, so their sums are the
 * sort's own. Once some candidate's `before`, or the candidates' whole mass, passes top_p +
 * NUCLEUS_MARGIN, no later token is kept (docs/sampling.md); else t is lowered, down to 0 (the
 * whole vocabulary). t starts at the highest level whose mass, summed over the first pass's
 * tokens, holds top_p. */
#define NUCLEUS_MARGIN 1e-6f
#define LEVELS 8       /* thresholds 2^-3, 2^-6, ... 2^-24, then 0 */
#define FIRST_LEVELS 5 /* those down to 2^-15 come from the first pass's tokens */

/* order[0..n): the candidates sorted by value, largest first, stable (the lower id first among
 * equals, as they were collected): a radix sort of the float32 bits (values >= 0 sort as their
 * bits do), 8 bits a pass, skipping passes where every key has the same digit. */
static uint32_t *sort_descending(const float *value, int64_t n, uint32_t *order, uint32_t *spare) {
    const uint32_t *bits = (const uint32_t *)value;
    for (int64_t i = 0; i < n; i++) order[i] = (uint32_t)i;
    if (n <= 16) { /* insertion sort: stable */
        for (int64_t i = 1; i < n; i++) {
            const uint32_t o = order[i];
            int64_t j = i;
            for (; j > 0 && value[order[j - 1]] < value[o]; j--) order[j] = order[j - 1];
            order[j] = o;
        }
        return order;
    }
    for (int shift = 0; shift < 32; shift += 8) {
        int64_t count[257] = {0};
        for (int64_t i = 0; i < n; i++) count[1 + 255 - ((bits[i] >> shift) & 255)]++;
        if (count[1 + 255 - ((bits[0] >> shift) & 255)] == n) continue;
        for (int d = 0; d < 256; d++) count[d + 1] += count[d];
        for (int64_t i = 0; i < n; i++) {
            const uint32_t o = order[i];
            spare[count[255 - ((bits[o] >> shift) & 255)]++] = o;
        }
        uint32_t *t = order;
        order = spare, spare = t;
    }
    return order;
}

/* Every token of p[0..n) with p >= t, in id order, into id / value; returns how many. */
static int64_t collect(const float *p, int64_t n, float t, int32_t *id, float *value) {
    int64_t c = 0;
    for (int64_t i = 0; i < n; i += 16) {
        for (m16 hit = v_ge(v_loadn(p + i, n - i), v_set1(t)) & lanes(n - i); hit; hit &= hit - 1) {
            const int64_t at = i + __builtin_ctz(hit);
            id[c] = (int32_t)at, value[c++] = p[at];
        }
    }
    return c;
}

static int64_t draw_nucleus(const float *p, int64_t n, float top_p, float min_p, float u, Scratch s) {
    /* one pass over the row: every token of at least the first levels' lowest (a few hundred in a
     * trained model's row; at most 2^15), in id order, and the mass above each of those levels */
    const int64_t pooled = collect(p, n, ldexpf(1.f, -3 * FIRST_LEVELS), s.pool_id, s.pool_value);
    double mass[FIRST_LEVELS] = {0};
    for (int64_t j = 0; j < pooled; j++)
        for (int l = FIRST_LEVELS - 1; l >= 0 && s.pool_value[j] >= ldexpf(1.f, -3 * (l + 1)); l--) mass[l] += s.pool_value[j];
    int l = 0; /* the masses are rounded: a small slack, and the exact test below decides */
    while (l < FIRST_LEVELS && mass[l] < top_p + 1e-4f) l++;
    for (;; l++) {
        const float t = l < LEVELS ? ldexpf(1.f, -3 * (l + 1)) : 0.f;
        int64_t c = 0; /* candidates (every token >= t), in id order */
        if (l < FIRST_LEVELS) {
            for (int64_t j = 0; j < pooled; j++)
                if (s.pool_value[j] >= t) s.id[c] = s.pool_id[j], s.value[c++] = s.pool_value[j];
        } else {
            c = collect(p, n, t, s.id, s.value);
        }
        const uint32_t *order = sort_descending(s.value, c, s.order, s.spare);
        memset(s.keep, 0, c);
        double sum = 0;
        int settled = 0;
        for (int64_t j = 0; j < c && !settled; j++) {
            const float v = s.value[order[j]];
            sum += v;
            const float before = (float)sum - v;
            settled = before > top_p + NUCLEUS_MARGIN;
            s.keep[order[j]] = !(before > top_p);
        }
        /* the mass above the first token left out is the candidates' (within rounding): past
         * top_p + NUCLEUS_MARGIN, no token outside them is kept either */
        settled = settled || (float)sum > top_p + NUCLEUS_MARGIN;
        if (!settled && c < n && l < LEVELS) continue; /* the candidates may not hold the nucleus */
        /* min-p on the nucleus (its largest probability comes first), then the draw over it */
        const float floor = min_p * s.value[order[0]];
        double acc = 0;
        for (int64_t j = 0; j < c; j++) acc += s.keep[j] && !(s.value[j] < floor) ? s.value[j] : 0.f;
        const float total = (float)acc, at = u * total;
        acc = 0;
        int64_t last = 0;
        for (int64_t j = 0; j < c; j++) {
            if (!s.keep[j] || s.value[j] < floor) continue;
            acc += s.value[j];
            const float running = (float)acc;
            last = s.id[j];
            if (running > at || running >= total) return last;
        }
        return last;
    }
}

/* ids[at[j]] for the j-th row of probs [n, vocab] (softmax of flover_sample_scale's rows); the
 * parameters are indexed by batch row at[j]. Rows without top-p are drawn GROUP at a time. */
API void flover_sample_draw(const float *probs, int n, int64_t vocab, const int64_t *at, const float *top_p,
                            const float *min_p, const int64_t *seed, const int64_t *counter, int64_t *ids,
                            void *scratch, int nt) {
    int nucleus[n], dense[n], n_nucleus = 0, n_dense = 0;
    for (int j = 0; j < n; j++) {
        if (top_p[at[j]] < 1) nucleus[n_nucleus++] = j;
        else dense[n_dense++] = j;
    }
    const int groups = (n_dense + GROUP - 1) / GROUP;
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1) if (n >= 2)
    for (int item = 0; item < groups + n_nucleus; item++) {
        if (item >= groups) {
            const int j = nucleus[item - groups];
            const int64_t r = at[j];
            const float u = (float)counter_uniform((uint64_t)seed[r], (uint64_t)counter[r]);
            ids[r] = draw_nucleus(probs + j * vocab, vocab, top_p[r], min_p[r], u, scratch_of(scratch, vocab));
            continue;
        }
        const float *p[GROUP];
        float floor[GROUP], u[GROUP];
        int64_t out[GROUP];
        for (int q = 0; q < GROUP; q++) { /* a short group repeats its first row */
            const int j = dense[item * GROUP + q < n_dense ? item * GROUP + q : item * GROUP];
            const int64_t r = at[j];
            p[q] = probs + j * vocab;
            floor[q] = min_p[r] > 0 ? min_p[r] * row_max(p[q], vocab) : 0.f;
            u[q] = (float)counter_uniform((uint64_t)seed[r], (uint64_t)counter[r]);
        }
        draw_dense(p, vocab, floor, u, out);
        for (int q = 0; q < GROUP && item * GROUP + q < n_dense; q++) ids[at[dense[item * GROUP + q]]] = out[q];
    }
}
