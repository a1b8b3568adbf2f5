/* The native step's binary interface as Python must see it: the size of every struct that
 * crosses ctypes, each field's offset, and the value of every code both sides name. At load,
 * flover/native/abi.py compares its own declarations with this table and refuses a build that
 * differs, naming the first difference: one field added on one side never corrupts memory. */
#include <stddef.h>

#include "native.h"

typedef struct {
    const char *name; /* "Model" (its size), "Model.heads" (an offset), "G_INT4_K" (a code); NULL ends */
    int64_t value;
} AbiEntry;

#define SIZE(S) {#S, (int64_t)sizeof(S)}
#define AT(S, F) {#S "." #F, (int64_t)offsetof(S, F)}
#define CODE(C) {#C, (int64_t)(C)}

static const AbiEntry ABI[] = {
    SIZE(Model), AT(Model, layers), AT(Model, hidden), AT(Model, heads), AT(Model, kv_heads), AT(Model, head_dim),
    AT(Model, inter), AT(Model, vocab), AT(Model, dtype), AT(Model, max_seq), AT(Model, kv_pos), AT(Model, window_base),
    AT(Model, embed),
    AT(Model, final_norm), AT(Model, head), AT(Model, head_scales), AT(Model, cos), AT(Model, sin),
    AT(Model, head_grid), AT(Model, embed_grid), AT(Model, vocab_start), AT(Model, all_reduce),
    AT(Model, head_screen), AT(Model, head_screen_scales), AT(Model, head_bounds), AT(Model, screen_rows), AT(Model, rotary_dim),
    AT(Model, embed_scale), AT(Model, attn_scale), AT(Model, norm_f32), AT(Model, act), AT(Model, local_cos),
    AT(Model, local_sin), AT(Model, experts), AT(Model, top_k), AT(Model, expert_inter), AT(Model, norm_topk),
    AT(Model, weights_f32), AT(Model, topk_softmax), AT(Model, swiglu_limit), AT(Model, swiglu_alpha),
    AT(Model, residual_scale), AT(Model, delta_key_heads), AT(Model, delta_value_heads), AT(Model, delta_dk),
    AT(Model, delta_dv), AT(Model, delta_conv), AT(Model, delta_tiled), AT(Model, snapshot_rows), AT(Model, attn_gate),
    AT(Model, shared_inter), AT(Model, max_head_dim), AT(Model, max_kv_heads), AT(Model, max_inter), AT(Model, v_norm),
    AT(Model, per_layer_width), AT(Model, per_layer_inputs), AT(Model, per_layer_proj), AT(Model, per_layer_norm),
    AT(Model, bidirectional), AT(Model, k_type), AT(Model, v_type),

    SIZE(Layer), AT(Layer, input_norm), AT(Layer, qkv), AT(Layer, qkv_bias), AT(Layer, o), AT(Layer, o_bias),
    AT(Layer, post_norm), AT(Layer, gate_up), AT(Layer, gate_up_bias), AT(Layer, down), AT(Layer, down_bias),
    AT(Layer, window), AT(Layer, qkv_grid), AT(Layer, o_grid), AT(Layer, gate_up_grid), AT(Layer, down_grid),
    AT(Layer, q_norm), AT(Layer, k_norm), AT(Layer, no_rope), AT(Layer, qk_norm_whole), AT(Layer, attn_norm_after), AT(Layer, local_rope),
    AT(Layer, ffn_norm_after), AT(Layer, kv), AT(Layer, kv_kind), AT(Layer, kv_slot), AT(Layer, kv_head), AT(Layer, kv_len),
    AT(Layer, windowed_kv), AT(Layer, router), AT(Layer, expert_gate_up), AT(Layer, expert_down),
    AT(Layer, expert_gate_up_grid), AT(Layer, expert_down_grid), AT(Layer, expert_load), AT(Layer, router_bias),
    AT(Layer, expert_gate_up_bias), AT(Layer, expert_down_bias), AT(Layer, sinks), AT(Layer, delta), AT(Layer, delta_in),
    AT(Layer, delta_in_grid), AT(Layer, delta_out), AT(Layer, delta_out_grid), AT(Layer, delta_conv_w),
    AT(Layer, delta_dt_bias), AT(Layer, delta_a), AT(Layer, delta_norm), AT(Layer, conv_state), AT(Layer, ssm_state),
    AT(Layer, snap_conv), AT(Layer, snap_ssm), AT(Layer, shared_gate_up), AT(Layer, shared_gate_up_grid),
    AT(Layer, shared_down), AT(Layer, shared_down_grid), AT(Layer, shared_gate), AT(Layer, head_dim),
    AT(Layer, kv_heads), AT(Layer, kv_pos), AT(Layer, inter), AT(Layer, q_only), AT(Layer, v_from_k), AT(Layer, pl_gate),
    AT(Layer, pl_gate_grid), AT(Layer, pl_proj), AT(Layer, pl_proj_grid), AT(Layer, pl_norm), AT(Layer, scalar),
    AT(Layer, beside_pre), AT(Layer, beside_post_mlp), AT(Layer, beside_post_experts), AT(Layer, router_scale),
    AT(Layer, expert_scale),

    SIZE(Encoder), AT(Encoder, positions), AT(Encoder, position_rows), AT(Encoder, position_offset), AT(Encoder, cos),
    AT(Encoder, sin), AT(Encoder, token_types), AT(Encoder, type_rows), AT(Encoder, norm), AT(Encoder, norm_bias),
    AT(Encoder, act),
    SIZE(EncoderLayer), AT(EncoderLayer, qkv), AT(EncoderLayer, qkv_grid), AT(EncoderLayer, qkv_bias), AT(EncoderLayer, o),
    AT(EncoderLayer, o_grid), AT(EncoderLayer, o_bias), AT(EncoderLayer, attn_norm), AT(EncoderLayer, attn_norm_bias),
    AT(EncoderLayer, up), AT(EncoderLayer, up_grid), AT(EncoderLayer, up_bias), AT(EncoderLayer, down),
    AT(EncoderLayer, down_grid), AT(EncoderLayer, down_bias), AT(EncoderLayer, mlp_norm), AT(EncoderLayer, mlp_norm_bias),

    SIZE(GridPart), AT(GridPart, kind), AT(GridPart, rows), AT(GridPart, group), AT(GridPart, lows),
    AT(GridPart, codes), AT(GridPart, scales), AT(GridPart, x8), AT(GridPart, offset),
    SIZE(Grid), AT(Grid, parts), AT(Grid, part),

    CODE(DT_F32), CODE(DT_BF16), CODE(G_INT4), CODE(G_INT4_K), CODE(G_INT6_K), CODE(G_INT5_K), CODE(G_INT8_ROWS),
    CODE(G_INT8_GROUPS), CODE(G_INT8_K5), CODE(G_INT8_K6), CODE(G_MXFP4), CODE(G_Q2_K), CODE(G_Q3_K),
    CODE(G_IQ4_NL), CODE(G_IQ4_XS), CODE(X8_NONE), CODE(X8_SMALL), CODE(X8_SIGNED),
    CODE(MAX_PARTS), CODE(ENC_GELU), CODE(ENC_GELU_TANH), CODE(ENC_SWIGLU), CODE(Q4K_SUPER_BYTES), CODE(Q6K_SUPER_BYTES), CODE(Q2K_SUPER_BYTES), CODE(IQ4XS_SUPER_BYTES), CODE(SAMPLE_SCRATCH_BYTES_PER_TOKEN), CODE(KV_DTYPE), CODE(KV_Q8_0), CODE(KV_Q4_0),
    {NULL, 0},
};

API const AbiEntry *flover_abi(void) { return ABI; }
