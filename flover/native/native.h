/* What the native step's files share: the model as flover/native/forward.py describes it, the
 * kinds of weights, and the functions one file offers the others. Layout of the sources:
 *
 *   simd.h             16 float lanes on every instruction set (the mapping): a short dispatch
 *                      header; each family's header under arch/ (x86/avx512.h, x86/avx2.h,
 *                      arm/neon.h, generic.h: the reference), as ggml-cpu's arch/ split
 *   tiles.c            projection tiles written once on the mapping (float32, and bfloat16 /
 *                      int8 / int4 weights widened to float32 in registers)
 *   tiles_bf16_dot.c   the same tiles through AVX-512 BF16's dot-product instruction
 *   simd_int8.h        4-byte integer dot products on 16 lanes (the mapping, for int8 inputs;
 *                      an arch/ header per family, e.g. arch/x86/avx2_int8.h)
 *   tiles_int8.c       a GGUF file's codes (up to 6 bits, Q8_0's bytes, IQ4's table) times int8 inputs
 *   project.c          a whole projection: threads, tiles, bias and rounding of the outputs
 *   row_ops.c          norms, RoPE, residuals, SiLU: a few vector loops per row
 *   attention.c        decode rows over their slot's keys; blocks of prompt rows
 *   greedy.c           argmax, and greedy ids through a screen of the LM head
 *   sampling.c         the sampler's filters and draw around PyTorch's softmax
 *   experts.c          a layer's mixture of experts: routing, each chosen expert once over its rows
 *   gated_deltanet.c   Gated DeltaNet layers: the conv and the delta rule over each sequence's rows
 *   llama_forward.c    one fused iteration, top to bottom
 *   encoder_forward.c  one fused iteration of a BERT-family encoder (LayerNorms, GELU or SwiGLU,
 *                      absolute positions or RoPE, attention both ways within each input)
 *   abi.c              the sizes, offsets and codes below, for flover/native/abi.py to check
 *
 * A struct or code changed here changes in flover/native/abi.py too (and in abi.c's table): a
 * build that differs from Python is refused at load.
 */
#ifndef FLOVER_NATIVE_H
#define FLOVER_NATIVE_H

#include <math.h>
#include <stdint.h>

#include "simd.h"

#define API __attribute__((visibility("default"))) /* everything else stays inside the library */

enum { DT_F32 = 0, DT_BF16 = 1 };
enum { KV_DTYPE = 0, KV_Q8_0 = 1, KV_Q4_0 = 2 }; /* Model.k_type, v_type */

/* abi.py's Model: int64 fields, pointers as addresses. */
typedef struct {
    int64_t layers, hidden, heads, kv_heads, head_dim, inter, vocab, dtype, max_seq;
    /* kv_pos: a KV row's stride in elements (every layer's); window_base: with windowed KV, the
     * address of each slot's window base (int64 per slot: the position its windowed rows start at), else 0 */
    int64_t kv_pos, window_base;
    int64_t embed, final_norm, head, head_scales, cos, sin;   /* head_scales: int8 head (else 0);
                                                                 rotary tables [max_seq, head_dim] */
    /* a head in a GGUF file's own codes: its Grid (then head is 0), and, for a tied embedding
     * held only there, embed_grid = head_grid (the lookup dequantizes a row); else 0 */
    int64_t head_grid, embed_grid;
    /* Tensor parallelism: this rank's vocabulary block starts at vocab_start (embed and head hold
     * `vocab` rows of it), and all_reduce (a void (*)(float *, int64_t) address; 0 at TP=1) sums
     * a float buffer over the ranks in place, as the PyTorch path's all-reduces do. */
    int64_t vocab_start, all_reduce;
    /* greedy through a screen of the head (greedy.c): its copy (float32 models: bfloat16,
     * blocked as bfloat16's pairs; bfloat16 models: int8 codes, blocked so, and row scales) and
     * each vocabulary row's bound factor (float32); else 0 */
    int64_t head_screen, head_screen_scales, head_bounds;
    /* the screen takes up to this many greedy rows (float32 models: every row count); more take
     * the whole head, their argmax found as its tiles come out (head_greedy) */
    int64_t screen_rows;
    int64_t rotary_dim; /* RoPE turns the first rotary_dim dims of each head (tables [max_seq, rotary_dim]) */
    /* Gemma 3: embeddings times embed_scale (0: none); scores times attn_scale (0: 1 / sqrt(head_dim));
     * norm_f32: every norm weight is a float32 (Gemma 3's 1 + w, OLMo 2's w) and the norm rounds once; act 0 SiLU,
     * 1 GELU (tanh); the sliding-window layers' own RoPE tables (0: none) */
    double embed_scale, attn_scale;
    int64_t norm_f32, act, local_cos, local_sin;
    /* a mixture of experts (Qwen3-MoE, Mixtral; experts 0: none): per token top_k of `experts` MLPs
     * of expert_inter columns each (this rank's), the top k renormalised if norm_topk; the routing
     * weights multiply in float32 if weights_f32, else rounded to the model dtype first */
    int64_t experts, top_k, expert_inter, norm_topk, weights_f32;
    /* gpt-oss: topk_softmax 1: a softmax over the top k logits only, in the model dtype (else over all,
     * in float32); act 2: the clamped SwiGLU (gate clamped above at swiglu_limit, up on both sides;
     * (up + 1) gate sigmoid(swiglu_alpha gate)) */
    int64_t topk_softmax;
    double swiglu_limit, swiglu_alpha;
    /* each block's output times residual_scale before the residual add (0: none; Granite's) */
    double residual_scale;
    /* Gated DeltaNet layers (Qwen3.5; gated_deltanet.c; value heads 0: none): this rank's q/k and
     * value heads, their dims, the conv's taps, value head j reads q/k head j % key heads (tiled,
     * llama.cpp's order) or j / (value heads / key heads); snapshot_rows: the address of an int64
     * [rows] array, each row's prefix-cache snapshot row or -1 (0: none this iteration) */
    int64_t delta_key_heads, delta_value_heads, delta_dk, delta_dv, delta_conv, delta_tiled, snapshot_rows;
    /* attn_gate: q's projection holds per head the query, then a gate: attention's output times
     * sigmoid(gate) (Qwen3.5); shared_inter: a shared expert of that width beside the routed ones */
    int64_t attn_gate, shared_inter;
    /* Gemma 4: layers of other head shapes and widths (Layer.head_dim, kv_heads, inter): the widest
     * of them, for the scratch (0: the model's); v_norm: the address of float32 ones [max_head_dim]
     * where values are RMS-normed (no weight), else 0; per-layer inputs of per_layer_width a layer
     * (0: none): this iteration's table rows, float32 [rows, layers, width] of model-dtype values
     * already scaled (an address set per call), the projection [layers x width, hidden] of the
     * embedding (blocked) and the norm of its parts (float32 [width]) */
    int64_t max_head_dim, max_kv_heads, max_inter, v_norm, per_layer_width, per_layer_inputs;
    int64_t per_layer_proj, per_layer_norm;
    /* 1: attention both ways within each input, every input whole in its iteration from position 0
     * (EmbeddingGemma): a prompt row sees its input's keys after it too (within a window on either
     * side); it needs the blocked prompt kernel on every layer */
    int64_t bidirectional;
    /* --kv-dtype: K's and V's rows as llama.cpp's blocks (KV_Q8_0, KV_Q4_0: kv_codes.h; then every
     * KV stride above and in Layer is in bytes and a position's V row follows its K row at kv_kind),
     * else KV_DTYPE (both: rows of the model's dtype, strides in its elements) */
    int64_t k_type, v_type;
} Model;

/* abi.py's Layer: weight addresses of one layer, 0 where the model has no such bias; the
 * layer's sliding window (0: none); the address of each projection's Grid where its weights are
 * codes (a GGUF file's own, --quantization int4 / int8), else 0 (its weight is the dense one). */
typedef struct {
    int64_t input_norm, qkv, qkv_bias, o, o_bias, post_norm, gate_up, gate_up_bias, down, down_bias, window;
    int64_t qkv_grid, o_grid, gate_up_grid, down_grid;
    int64_t q_norm, k_norm; /* RMSNorm weights [head_dim] over each head of q and k before RoPE (Qwen3), else 0 */
    int64_t no_rope;        /* 1: the layer skips RoPE (SmolLM3's NoPE layers) */
    int64_t qk_norm_whole;  /* 1: q_norm / k_norm span all of q and of k (OLMo 2), 0: each head */
    int64_t attn_norm_after; /* Gemma 3: the norm of attention's output before the residual add (post_norm then
                              * normalizes the sum for the MLP), else 0 */
    int64_t local_rope;     /* 1: RoPE from the model's local tables (Gemma 3's sliding-window layers) */
    int64_t ffn_norm_after; /* OLMo 2: the norm of the MLP's output before the residual add (then input_norm is 0
                             * and post_norm normalizes attention's output likewise), else 0 */
    /* the layer's KV: its address, strides in elements (keys to values, slot to slot, kv head to kv
     * head), positions a slot keeps (kv_len), and windowed_kv 1 where a slot's rows start at its
     * window base (position p at row p - base), 0 where at position 0 */
    int64_t kv, kv_kind, kv_slot, kv_head, kv_len, windowed_kv;
    /* a layer of experts in place of the MLP (then gate_up and down are 0): the router [experts,
     * hidden] blocked in the model dtype; addresses of int64 [experts] arrays of each expert's
     * blocked gate_up and down weights, or of their Grids (0 where an expert's is the other kind);
     * expert_load: int64 [experts], the rows routed to each expert, added to by every iteration */
    int64_t router, expert_gate_up, expert_down, expert_gate_up_grid, expert_down_grid, expert_load;
    /* gpt-oss: the router's bias (model dtype), int64 [experts] arrays of each expert's gate_up and
     * down biases (model dtype), and each query head's sink logit (float32 [heads]); else 0 */
    int64_t router_bias, expert_gate_up_bias, expert_down_bias, sinks;
    /* a Gated DeltaNet layer in place of attention (delta 1; then the attention fields are 0): its
     * fused input and its output projections (blocked, or Grids), float32 copies of its conv taps
     * [channels, taps] and A = -exp(A_log) [value heads], its dt bias [value heads] and the gated
     * norm's weight [dv] (model dtype); the
     * slots' conv states [slots, channels, taps - 1] (model dtype) and recurrent states [slots,
     * value heads, dk, dv] (float32), and the prefix cache's snapshots of both (0: none) */
    int64_t delta, delta_in, delta_in_grid, delta_out, delta_out_grid, delta_conv_w, delta_dt_bias, delta_a, delta_norm;
    int64_t conv_state, ssm_state, snap_conv, snap_ssm;
    /* Qwen3.5-MoE's shared expert beside the routed ones (0: none): its gate_up and down, and its
     * gate [hidden] (model dtype): its output times sigmoid(gate . x) */
    int64_t shared_gate_up, shared_gate_up_grid, shared_down, shared_down_grid, shared_gate;
    /* Gemma 4: the layer's own head size, kv heads, KV row stride and MLP width (0: the model's);
     * q_only 1: it reads an earlier layer's KV (kv is that layer's): it projects queries only and
     * writes no KV; v_from_k 1: its values are its keys' projection (before the key norm); its
     * per-layer input's gate [width, hidden] and projection [hidden, width] (blocked, or Grids) and
     * the projection's norm; its output's scalar (0: none) */
    int64_t head_dim, kv_heads, kv_pos, inter, q_only, v_from_k;
    int64_t pl_gate, pl_gate_grid, pl_proj, pl_proj_grid, pl_norm;
    double scalar;
    /* Gemma 4's experts beside the MLP (0: none): the norms before the experts, after the MLP and
     * after the experts; the router input's scale [hidden] and each expert's scale [experts]
     * (float32 copies of the model-dtype values) */
    int64_t beside_pre, beside_post_mlp, beside_post_experts, router_scale, expert_scale;
} Layer;

/* abi.py's Encoder: a BERT-family encoder's embeddings (encoder_forward.c; the Model holds its
 * sizes and word embeddings): the position table (position_rows rows; position p at row p +
 * position_offset; 0: none, nomic-bert's RoPE instead, from the tables cos / sin [max_seq,
 * head_dim] in the model dtype, the sign folded in as llama_forward.c's) and the token-type table
 * (type_rows rows), in the model dtype; the embeddings' LayerNorm weight and bias; the MLP's act:
 * ENC_GELU (erf's), ENC_GELU_TANH, or ENC_SWIGLU (the up projection's rows [gate | up]). */
enum { ENC_GELU = 0, ENC_GELU_TANH = 1, ENC_SWIGLU = 2 };
typedef struct {
    int64_t positions, position_rows, position_offset, cos, sin, token_types, type_rows, norm, norm_bias, act;
} Encoder;

/* abi.py's EncoderLayer: one post-norm block (LayerNorm after each residual add): each
 * projection's blocked weight or Grid (the other 0) and its bias (model dtype, 0: none), and the
 * LayerNorms' weights and biases (model dtype). */
typedef struct {
    int64_t qkv, qkv_grid, qkv_bias, o, o_grid, o_bias, attn_norm, attn_norm_bias;
    int64_t up, up_grid, up_bias, down, down_grid, down_bias, mlp_norm, mlp_norm_bias;
} EncoderLayer;

/* Codes a projection's output rows are stored in (tiles.c): 4-bit codes with a scale and a zero
 * per 32 inputs (stored, or from Q4_K's super-blocks: G_INT4_K); Q6_K's 6-bit and Q5_K's 5-bit
 * codes with their super-blocks' scales (G_INT6_K, G_INT5_K: int8 inputs only); int8 codes with a
 * scale per row; int8 codes with a scale (and a minimum: lows) per group of 16 or 32 inputs
 * (GGUF's Q8_0, Q5_0, Q5_1); and where the CPU reads bytes faster than it unpacks bits, Q5_K's and
 * Q6_K's codes as bytes with their super-blocks' scales (G_INT8_K5, G_INT8_K6: int8 inputs only);
 * MXFP4's FP4 codes (G_MXFP4, below); Q2_K's 2-bit and Q3_K's 3-bit codes with their super-blocks'
 * scales per 16 inputs, the IQ4 types' 4-bit indexes into IQ4_VALUES with a scale per 32 inputs
 * (stored: G_IQ4_NL, or IQ4_XS's super-blocks: G_IQ4_XS) (int8 inputs only; tiles_int8.c). */
enum { G_INT4 = 4, G_INT4_K = 5, G_INT6_K = 6, G_INT5_K = 7, G_INT8_ROWS = 8, G_INT8_GROUPS = 9, G_INT8_K5 = 10,
       G_INT8_K6 = 11, G_MXFP4 = 12, G_Q2_K = 13, G_Q3_K = 14, G_IQ4_NL = 15, G_IQ4_XS = 16 };
/* the IQ4 types' 16 values (ggml's kvalues_iq4nl), as bytes for q_lut16 */
static const int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
/* G_MXFP4 (int8 inputs only): MXFP4's 4-bit codes of FP4 values in G_INT4's layout (its zero form:
 * the value at code 8 is 0, so zero = -4 scale), each code looked up as twice its FP4 value + 12
 * (0..24: MXFP4_U) before the dot products */
static const uint8_t MXFP4_U[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};
enum { X8_NONE = 0, X8_SMALL = 1, X8_SIGNED = 2 };
#define MAX_PARTS 4
/* abi.py's Grid and GridPart: a projection's output rows as up to MAX_PARTS runs of rows (every run but
 * the last a multiple of 16 rows), each in its own codes: a fused q/k/v whose v came in other
 * blocks than q and k (as in GGUF's Q4_K_M files) is three runs, or two. */
typedef struct {
    int64_t kind, rows, group, lows, codes, scales;
    /* x8: the run takes int8 inputs (tiles_int8.c: its codes in that file's layouts), X8_SMALL
     * codes below 64 (offset: the stored code that means 0; 4-bit codes: 8), X8_SIGNED bytes of
     * the whole int8 range (Q8_0's), groups of 32 without minimums */
    int64_t x8, offset;
} GridPart;
typedef struct {
    int64_t parts;
    GridPart part[MAX_PARTS];
} Grid;

/* What a projection's weights are: the model dtype's values, or int8 codes (inputs bfloat16). */
enum { W_F32 = DT_F32, W_BF16 = DT_BF16, W_Q8 = 2 };

static inline int64_t weight_bytes(int kind) { return kind == W_Q8 ? 1 : kind == W_BF16 ? 2 : 4; }

/* ---- tiles.c ----------------------------------------------------------------------------------- */
/* MT rows x NT blocks of 16 outputs, from block nb and row m0; out: [MT][NT][16] floats. pf: 0,
 * or a weight stream to prefetch meanwhile (64 bytes per input step). x: the operand rows, of
 * operand_is_bf16(kind) ? bfloat16 : float32. */
void tile(const void *w, int64_t nb, int64_t k, const void *x, int64_t m0, int mt, int nt_blocks, int kind,
          float *out, const char *pf);
int tile_blocks(int kind, int rows);              /* blocks per tile for an iteration of `rows` */
int tile_rows(int kind, int left, int nt_blocks); /* rows of the next tile over `left` rows */
/* 4-bit tiles: MT (group_tile_rows) rows x one block; kind G_INT4 or G_INT4_K; x: operand rows (as W_Q8's),
 * xsum: each row's group sums */
void tile_q4(int mt, int kind, const uint8_t *codes, const void *scales, int64_t k, const void *x, const float *xsum,
             float *out);
#define Q4K_SUPER_BYTES 384 /* per 256 inputs and block of 16 rows: d[16], -dmin[16] (float32), sc[8][16], m[8][16] */
/* group g's 16 scales and zeros: stored (float32 [groups][2][16]) or from Q4_K's super-blocks */
static inline void q4_group_scales(const void *scales, int64_t g, v16 *scale, v16 *zero) {
    *scale = v_load((const float *)scales + g * 32), *zero = v_load((const float *)scales + g * 32 + 16);
}
static inline void q4k_group_scales(const void *scales, int64_t g, v16 *scale, v16 *zero) {
    const uint8_t *super = (const uint8_t *)scales + (g / 8) * Q4K_SUPER_BYTES;
    *scale = v_mul(v_load((const float *)super), v_load_u8(super + 128 + (g % 8) * 16));
    *zero = v_fmadd(v_set1(8.f), *scale, v_mul(v_load((const float *)super + 16), v_load_u8(super + 256 + (g % 8) * 16)));
}
/* the same super-blocks' scale d sc and minimum -dmin m of group g (Q5_K's w = scale u + low, as the file's) */
static inline void k_group_scale_low(const void *scales, int64_t g, v16 *scale, v16 *low) {
    const uint8_t *super = (const uint8_t *)scales + (g / 8) * Q4K_SUPER_BYTES;
    *scale = v_mul(v_load((const float *)super), v_load_u8(super + 128 + (g % 8) * 16));
    *low = v_mul(v_load((const float *)super + 16), v_load_u8(super + 256 + (g % 8) * 16));
}
#define Q6K_SUPER_BYTES 320 /* per 256 inputs and block of 16 rows: d[16] (float32), sc[16][16] (int8) */
/* group g (of 16 inputs) of Q6_K's super-blocks: its 16 scales d sc (exact in float32) */
static inline v16 q6k_group_scale(const void *scales, int64_t g) {
    const uint8_t *super = (const uint8_t *)scales + (g / 16) * Q6K_SUPER_BYTES;
    return v_mul(v_load((const float *)super), v_load_i8((const int8_t *)super + 64 + (g % 16) * 16));
}
#define Q2K_SUPER_BYTES 384 /* per 256 inputs and block of 16 rows: d[16], -dmin[16] (float32), sc | m << 4 [16][16] */
/* group g (of 16 inputs) of Q2_K's super-blocks: its scales d sc and minimums -dmin m (w = scale u + low) */
static inline void q2k_group_scale_low(const void *scales, int64_t g, v16 *scale, v16 *low) {
    const uint8_t *super = (const uint8_t *)scales + (g / 16) * Q2K_SUPER_BYTES, *both = super + 128 + (g % 16) * 16;
    uint8_t sc[16], m[16];
    for (int r = 0; r < 16; r++) sc[r] = both[r] & 15, m[r] = both[r] >> 4;
    *scale = v_mul(v_load((const float *)super), v_load_u8(sc));
    *low = v_mul(v_load((const float *)super + 16), v_load_u8(m));
}
#define IQ4XS_SUPER_BYTES 192 /* per 256 inputs and block of 16 rows: d[16] (float32), sc[8][16] (int8) */
/* group g (of 32 inputs) of IQ4_XS's super-blocks: its 16 scales d sc */
static inline v16 iq4xs_group_scale(const void *scales, int64_t g) {
    const uint8_t *super = (const uint8_t *)scales + (g / 8) * IQ4XS_SUPER_BYTES;
    return v_mul(v_load((const float *)super), v_load_i8((const int8_t *)super + 64 + (g % 8) * 16));
}
/* The codes PREFETCH_AHEAD bytes past a group's (`bytes` of them) asked for while the grouped tiles
 * sum it: the hardware's own prefetch leaves the cores waiting (figures: docs/design_notes.md,
 * "measured choices"). A prefetch past the end of the codes never faults. */
#define PREFETCH_AHEAD 4096
static inline void prefetch_ahead(const void *group, int bytes) {
    for (int at = 0; at < bytes; at += 64) v_prefetch((const char *)group + PREFETCH_AHEAD + at);
}
int group_tile_rows(int left); /* rows of the next 4-bit or 8-bit grouped tile over `left` rows */
/* NAME_<mt>(...) for a grouped tile of mt rows (12, 8, 4, 2 or 1, as group_tile_rows gives) */
#define GROUP_TILE(NAME, mt, ...)                                                                          \
    ((mt) == 12 ? NAME##_12(__VA_ARGS__) : (mt) == 8 ? NAME##_8(__VA_ARGS__) : (mt) == 4 ? NAME##_4(__VA_ARGS__) \
     : (mt) == 2 ? NAME##_2(__VA_ARGS__) : NAME##_1(__VA_ARGS__))
/* An 8-bit grouped tile's group g done: acc[i] += scale * part[i] (+ low * the row's sum of x over
 * the group), scales [groups][1 + lows][16] (tiles.c's layout); the same order in every family */
static inline void add_group(v16 *acc, const v16 *part, int mt, const float *scales, int64_t g, int lows,
                             const float *xsum, int64_t groups) {
    const float *s = scales + g * 16 * (1 + lows);
    const v16 scale = v_load(s);
    if (!lows) {
        for (int i = 0; i < mt; i++) acc[i] = v_fmadd(scale, part[i], acc[i]);
        return;
    }
    const v16 low = v_load(s + 16);
    for (int i = 0; i < mt; i++) acc[i] = v_fmadd(scale, part[i], v_fmadd(low, v_set1(xsum[i * groups + g]), acc[i]));
}
/* 8-bit grouped tiles: MT (group_tile_rows) rows x one block; x: operand rows (as W_Q8's), xsum: their
 * group sums (lows) */
void tile_q8g(int mt, const int8_t *codes, const float *scales, int64_t k, int group, int lows, const void *x,
              const float *xsum, float *out);
/* ---- tiles_int8.c ------------------------------------------------------------------------------ */
/* rows quantized to int8, from a tile's first row: codes [rows][k] and, per block of 32 inputs (as
 * llama.cpp's Q8_0 rows), d [rows][k / 32] (max |x| / 127), d times the sum of the codes per 16
 * inputs [rows][k / 16] and per 32 [rows][k / 32], and the sums per 32 themselves [rows][k / 32];
 * or, per block of 256 (as llama.cpp's Q8_K rows: the K-quants' super-blocks, x8_block), d
 * [rows][k / 256] and the codes' sums per 16 inputs in s16 [rows][k / 16] and per 32 in s32 [rows][k / 32] */
typedef struct {
    const int8_t *q;
    const float *d, *ds16, *ds32;
    const int32_t *qs32;
    const int16_t *s16, *s32;
    int64_t block;
} Int8Rows;
/* thread t of T quantizes its share of x's rows [rows, k] into `out`'s arrays (from row 0) */
void int8_rows(const float *x, const Int8Rows *out, int rows, int64_t k, int t, int T);
/* the arrays of `rows` rows of k int8 inputs in blocks of `block`: codes, then (32) d, d sum(q) and
 * sum(q) per 32, and d sum(q) per 16 in ds16, or (256) d, sum(q) per 32 in the place of d sum(q) per
 * 32, and sum(q) per 16 in ds16's (a projection's xb and xsum scratch) */
static inline Int8Rows int8_rows_at(void *codes, float *ds16, int64_t rows, int64_t k, int64_t block) {
    const float *d = (const float *)((int8_t *)codes + rows * k);
    const Int8Rows x = {(const int8_t *)codes, d, ds16, d + rows * (k / 32), (const int32_t *)(d + 2 * rows * (k / 32)),
                        (const int16_t *)ds16, (const int16_t *)(d + rows * (k / 32)), block};
    return x;
}
/* the same arrays from row `first` on */
static inline Int8Rows int8_rows_from(const Int8Rows *x, int64_t first, int64_t k) {
    const Int8Rows from = {x->q + first * k, x->d + first * (k / x->block), x->ds16 + first * (k / 16),
                           x->ds32 + first * (k / 32), x->qs32 + first * (k / 32), x->s16 + first * (k / 16),
                           x->s32 + first * (k / 32), x->block};
    return from;
}
/* row r of `from` (k inputs) -> row i of `to` */
void copy_int8_row(const Int8Rows *from, int64_t r, const Int8Rows *to, int64_t i, int64_t k);
int x8_tile_rows(int left); /* rows of the next int8 tile over `left` rows */
/* The block of inputs a projection's int8 rows are quantized in: 256 where every run is Q4_K's,
 * Q5_K's or Q6_K's on int8 inputs (G_INT4_K, G_INT5_K / G_INT8_K5, G_INT6_K / G_INT8_K6: the
 * super-block tiles), else 32 (models/quant.py's int8_block, the same) */
int x8_block(const Grid *grid);
/* MT rows x one block of a run that takes int8 inputs (part->x8), in x's blocks */
void tile_x8(int mt, const GridPart *part, const uint8_t *codes, const void *scales, int64_t k, const Int8Rows *x,
             float *out);
const char *int8_dot_name(void); /* the dot-product instructions that sum them ("VNNI"), or "" */

/* the family this build runs, e.g. "AVX-512F, bfloat16 dot products" */
API const char *flover_kernels(void);

/* ---- tiles_bf16_dot.c (AVX-512 BF16 builds; elsewhere they return 0: not done) ---------------- */
int tile_bf16_dot(const void *w, int64_t k, const void *x, int mt, int nt_blocks, int kind, float *out,
                  const char *pf);
int tile_q4_bf16_dot(int mt, int kind, const uint8_t *codes, const void *scales, int64_t k, const uint16_t *x,
                     const float *xsum, float *out);
int tile_q8g_bf16_dot(int mt, const int8_t *codes, const float *scales, int64_t k, int group, int lows,
                      const uint16_t *x, const float *xsum, float *out);
int keys_bf16_dot(const uint16_t *qb, const uint16_t *k_base, int64_t pos, int64_t d, int64_t t0, int64_t keys,
                  v16 acc[16]);

/* The rows a tile of `kind` reads: bfloat16 for AVX-512 BF16's dot products; elsewhere float32
 * (widened pairs meet the rows' own values, which hold bfloat16 values in a bfloat16 model). */
static inline int operand_is_bf16(int kind) { return kind != W_F32 && has_bf16_dot(); }

/* ---- project.c --------------------------------------------------------------------------------- */
/* Greedy ids straight from the head's tiles: each thread's running maximum of each of its rows,
 * [nt][rows] each: the largest value, its first index (-1: none above -inf), the first NaN. */
typedef struct {
    float *top;
    int64_t *at, *nan_at;
} RowMax;

void to_model_dtype(const float *x, void *dst, int64_t n, int bf);
void project(const Model *md, int64_t w_addr, int64_t b_addr, const float *x, void *xb, int rows, int64_t n_out,
             int64_t k, float *y, int nt);
void project_kind(int kind, int bf, int64_t w_addr, int64_t scales_addr, int64_t b_addr, const float *x, void *xb,
                  int rows, int64_t n_out, int64_t k, void *y, int64_t ldy, int y_in_model_dtype, int nt, RowMax *most);
void project_grid(const Grid *grid, int bf, int64_t b_addr, const float *x, void *xb, float *xsum, int rows,
                  int64_t n_out, int64_t k, float *y, int nt);
void grid_row(const Grid *grid, int64_t row, int64_t k, float *out);
/* blocks nb0..nb1-1 (16 outputs each) of a run that takes int8 inputs, for `rows` rows of x:
 * rnd(x W^T + bias) as floats at y + row * ldy + 16 nb (outputs past the run's rows not stored);
 * above X8_PANEL_ROWS rows, X8_PANEL_BYTES of codes (an L2's share on every CPU seen) at a time
 * for each row tile (docs/journal.md (v)) */
#define X8_PANEL_ROWS 8
#define X8_PANEL_BYTES (256 * 1024)
void blocks_x8(const GridPart *part, int64_t nb0, int64_t nb1, int64_t k, const Int8Rows *x, int rows,
               const void *bias, float *y, int64_t ldy, int bf);
/* (SwiGLU) silu(gate) x up into out [rows, inter] straight from a gate_up grid's tiles ([gate | up],
 * inter rows each, no bias) where it qualifies (above X8_PANEL_ROWS rows, every run on int8
 * inputs in whole blocks); 0: it does not, nothing done */
int project_swiglu(const Grid *grid, const float *x, void *xb, float *xsum, int rows, int64_t inter, int64_t k,
                   float *out, int bf, int nt);

/* ---- row_ops.c --------------------------------------------------------------------------------- */
void rms_norm(const float *x, const void *weight, float eps, int64_t h, int bf, float *out);
void norm_row(const Model *md, const float *x, int64_t weight, float eps, int64_t h, int bf, float *out);
void rope(float *x, const void *cos_row, const void *sin_row, int64_t d, int bf);
void residual_and_norm(const Model *md, float *hidden, float *out, int rows, int64_t bias, int64_t norm, float eps, int64_t h, int bf,
                       int nt);
void norm_then_residual(const Model *md, float *hidden, float *out, int rows, int64_t norm, int64_t next_norm, float eps, int64_t h,
                        int bf, int nt);
/* rnd(rnd(silu(gate)) x up) on 16 lanes: silu_mul's step, and project_swiglu's */
static inline v16 silu_times(v16 gate, v16 up, int bf) {
    const v16 act = v_rnd(v_div(gate, v_add(v_set1(1.f), v_exp(v_sub(v_zero(), gate)))), bf);
    return v_rnd(v_mul(act, up), bf);
}
void silu_mul(const float *gate_up, int64_t inter, int bf, float *out);
void gelu_mul(const float *gate_up, int64_t inter, int bf, float *out);
void swiglu_clamped_mul(const float *gate_up, int64_t inter, int bf, float limit, float alpha, float *out);
void layer_norm(const float *x, const void *weight, const void *bias, float eps, int64_t h, int bf, float *out);
void gelu_row(const float *x, int64_t n, int tanh_form, int bf, float *out);

/* ---- experts.c --------------------------------------------------------------------------------- */
/* The scratch of a layer of experts (llama_forward.c's work layout places it). */
typedef struct {
    float *logits;           /* [rows, experts] */
    int64_t *picked;         /* [rows, top_k]: each row's experts, by descending probability */
    float *weight;           /* [rows, top_k]: their routing weights */
    int64_t *start;          /* [experts + 1]: where each expert's entries begin in members */
    int64_t *members;        /* [rows, top_k]: the rows, expert by expert (rows ascending within one) */
    float *member_weight;    /* [rows, top_k]: their weights for that expert */
    float *gathered, *out, *sum; /* [rows, hidden]: the inputs of the expert's rows, its outputs; the sums */
    float *route_in, *input;     /* [rows, hidden]: (Gemma 4) what the router reads, what the experts read */
    /* an iteration of at most fused_expert_rows rows whose experts take int8 inputs (experts.c):
     * every entry's int8 inputs ([entries, max(hidden, expert_inter)], int8_rows_at's arrays, the
     * sums per 16 in entry_ds16), gate_up outputs, activations and outputs; each row's entries in
     * ascending expert order [rows, top_k] */
    void *entry_x8;
    float *entry_ds16, *entry_wide, *entry_mid, *entry_out;
    int64_t *row_entries;
} ExpertsWork;
/* the rows an iteration may have for the experts' single parallel region (experts.c) */
static inline int64_t fused_expert_rows(const Model *md) {
    const int64_t rows = 512 / (md->top_k > 0 ? md->top_k : 1);
    return rows > 0 ? rows : 1;
}
/* the (row, expert) entries that region's scratch holds for an iteration of `rows` */
static inline int64_t fused_expert_entries(const Model *md, int64_t rows) {
    return md->experts ? (rows < fused_expert_rows(md) ? rows : fused_expert_rows(md)) * md->top_k : 0;
}
/* x [rows, hidden] (normed rows) -> y [rows, hidden]: the layer's experts' weighted sum per row.
 * xb, xsum, wide, mid: the projections' scratch (as the dense MLP's) */
void experts_step(const Model *md, const Layer *ly, const float *x, int rows, float *y, const ExpertsWork *w,
                  void *xb, float *xsum, float *wide, float *mid, int nt, const float *route_x);

/* ---- attention.c ------------------------------------------------------------------------------- */
#define MAX_GROUP 16
#define MAX_HEAD_DIM 512
#define MAX_BLOCK_QUERIES 64
int vector_attention(const Model *md);
static inline int64_t first_key(int64_t len, int64_t window) { return window > 0 && len > window ? len - window : 0; }
/* sinks: the group's query heads' sink logits (gpt-oss), or NULL */
void attend(const Model *md, const float *q, int64_t group, const void *k_base, const void *v_base, int64_t first,
            int64_t len, const float *sinks, float *scores, float *out);
void attend_prompt(const Model *md, const float *wide, int64_t qkv_n, int64_t q_size, int64_t r0, int64_t n,
                   int64_t g, const int64_t *positions, const int64_t *ends, int64_t base, int64_t window,
                   const void *k_base, const void *v_base, const float *sinks, float *scratch, float *mid);

/* ---- greedy.c ---------------------------------------------------------------------------------- */
int64_t argmax_row(const void *row, int64_t vocab, int bf, const uint16_t *allowed);
API void flover_argmax(const void *logits, int rows, int64_t vocab, int64_t stride, int bf, int64_t *ids, int nt);
/* A scalar's sigmoid in float32 (gates: Qwen3.5's attention output, its shared expert, DeltaNet's beta). */
static inline float sigmoid1(float x) { return 1.f / (1.f + expf(-x)); }

/* gated_deltanet.c */
int64_t delta_channels(const Model *md);
int64_t delta_in_width(const Model *md);
int64_t delta_runs(const int64_t *slots, const int64_t *positions, int rows, int64_t *runs);
void delta_conv(const Model *md, const Layer *ly, float *x, int64_t stride, const int64_t *slots,
                const int64_t *positions, const int64_t *runs, int64_t n_runs, int bf, int nt);
void delta_heads(const Model *md, const Layer *ly, const float *x, int64_t stride, float *out, const int64_t *slots,
                 const int64_t *positions, const int64_t *runs, int64_t n_runs, float eps, int bf, float *scratch,
                 int64_t per_thread, int nt);

int screened_greedy(const Model *md, const float *x, void *xb, int rows, float *scores, int64_t *ids, int nt);
int head_greedy(const Model *md, const float *x, void *xb, int rows, int64_t *ids, int nt);

/* ---- sampling.c -------------------------------------------------------------------------------- */
API int flover_sample_scale(const float *logits, int rows, int64_t vocab, int64_t stride, const float *temperature,
                            const int64_t *top_k, const uint32_t *allowed, int64_t words, float *scaled, int64_t *at,
                            int64_t *ids, void *scratch, int nt);
API void flover_sample_draw(const float *probs, int n, int64_t vocab, const int64_t *at, const float *top_p,
                            const float *min_p, const int64_t *seed, const int64_t *counter, int64_t *ids,
                            void *scratch, int nt);
#define SAMPLE_SCRATCH_BYTES_PER_TOKEN 28 /* per thread, per vocabulary entry */

#endif
