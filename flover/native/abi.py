"""The native step's binary interface: the structs and codes Python shares with native.h, declared
once here as ctypes structures, and the library's functions. `load_library` builds (build.py),
loads, declares the functions and checks this file against the build's own table (abi.c): any
size, field offset or code that differs refuses the build with a message naming it."""

from __future__ import annotations

import ctypes
from pathlib import Path

from flover.native.build import SOURCES, NativeUnavailable, build_library

I64 = ctypes.c_int64

# codes (native.h): dtypes, the kinds of codes a run of output rows holds, how a run takes int8 inputs
DT_F32, DT_BF16 = 0, 1
(G_INT4, G_INT4_K, G_INT6_K, G_INT5_K, G_INT8_ROWS, G_INT8_GROUPS, G_INT8_K5, G_INT8_K6, G_MXFP4) = range(4, 13)
G_Q2_K, G_Q3_K, G_IQ4_NL, G_IQ4_XS = range(13, 17)
X8_NONE, X8_SMALL, X8_SIGNED = 0, 1, 2
MAX_PARTS = 4  # runs of codes per projection
ENC_GELU, ENC_GELU_TANH, ENC_SWIGLU = 0, 1, 2  # an encoder's MLP activation (Encoder.act)
Q4K_SUPER_BYTES, Q6K_SUPER_BYTES, Q2K_SUPER_BYTES, IQ4XS_SUPER_BYTES = 384, 320, 384, 192  # per 256 inputs, 16 rows
SAMPLE_SCRATCH_BYTES_PER_TOKEN = 28  # sampling.c: per thread, per vocabulary entry
KV_DTYPE, KV_Q8_0, KV_Q4_0 = 0, 1, 2  # Model.k_type / v_type: rows of the model's dtype, or llama.cpp's blocks
CODES = (
    "DT_F32",
    "DT_BF16",
    "G_INT4",
    "G_INT4_K",
    "G_INT6_K",
    "G_INT5_K",
    "G_INT8_ROWS",
    "G_INT8_GROUPS",
    "G_INT8_K5",
    "G_INT8_K6",
    "G_MXFP4",
    "G_Q2_K",
    "G_Q3_K",
    "G_IQ4_NL",
    "G_IQ4_XS",
    "X8_NONE",
    "X8_SMALL",
    "X8_SIGNED",
    "MAX_PARTS",
    "ENC_GELU",
    "ENC_GELU_TANH",
    "ENC_SWIGLU",
    "Q4K_SUPER_BYTES",
    "Q6K_SUPER_BYTES",
    "Q2K_SUPER_BYTES",
    "IQ4XS_SUPER_BYTES",
    "SAMPLE_SCRATCH_BYTES_PER_TOKEN",
    "KV_DTYPE",
    "KV_Q8_0",
    "KV_Q4_0",
)


def _int64_struct(name: str, fields: str, doc: str) -> type[ctypes.Structure]:
    """Fields in native.h's order: int64, or double where the name ends in ":d"."""
    layout = [(f[:-2], ctypes.c_double) if f.endswith(":d") else (f, I64) for f in fields.split()]
    return type(name, (ctypes.Structure,), {"_fields_": layout, "__doc__": doc})


Model = _int64_struct(
    "Model",
    """
    layers hidden heads kv_heads head_dim inter vocab dtype max_seq
    kv_pos window_base
    embed final_norm head head_scales cos sin head_grid embed_grid vocab_start all_reduce
    head_screen head_screen_scales head_bounds screen_rows rotary_dim
    embed_scale:d attn_scale:d norm_f32 act local_cos local_sin
    experts top_k expert_inter norm_topk weights_f32 topk_softmax swiglu_limit:d swiglu_alpha:d residual_scale:d
    delta_key_heads delta_value_heads delta_dk delta_dv delta_conv delta_tiled snapshot_rows attn_gate shared_inter
    max_head_dim max_kv_heads max_inter v_norm per_layer_width per_layer_inputs per_layer_proj per_layer_norm
    bidirectional k_type v_type""",
    "The model's shape and weight addresses (native.h: Model; pointers as addresses, KV strides in elements, "
    "in bytes where K and V are codes).",
)
Layer = _int64_struct(
    "Layer",
    """
    input_norm qkv qkv_bias o o_bias post_norm gate_up gate_up_bias down down_bias window
    qkv_grid o_grid gate_up_grid down_grid q_norm k_norm no_rope qk_norm_whole attn_norm_after local_rope
    ffn_norm_after kv kv_kind kv_slot kv_head kv_len windowed_kv
    router expert_gate_up expert_down expert_gate_up_grid expert_down_grid expert_load
    router_bias expert_gate_up_bias expert_down_bias sinks
    delta delta_in delta_in_grid delta_out delta_out_grid delta_conv_w delta_dt_bias delta_a delta_norm
    conv_state ssm_state snap_conv snap_ssm
    shared_gate_up shared_gate_up_grid shared_down shared_down_grid shared_gate
    head_dim kv_heads kv_pos inter q_only v_from_k pl_gate pl_gate_grid pl_proj pl_proj_grid pl_norm scalar:d
    beside_pre beside_post_mlp beside_post_experts router_scale expert_scale""",
    "One layer's weight addresses, 0 where absent; its sliding window; each projection's Grid or 0; its KV; "
    "its experts' tables.",
)
Encoder = _int64_struct(
    "Encoder",
    "positions position_rows position_offset cos sin token_types type_rows norm norm_bias act",
    "A BERT-family encoder's embedding tables (or RoPE's), LayerNorm and MLP activation (native.h: Encoder).",
)
EncoderLayer = _int64_struct(
    "EncoderLayer",
    """
    qkv qkv_grid qkv_bias o o_grid o_bias attn_norm attn_norm_bias
    up up_grid up_bias down down_grid down_bias mlp_norm mlp_norm_bias""",
    "One post-norm encoder block's projections (blocked weight or Grid), biases and LayerNorms.",
)
GridPart = _int64_struct(
    "GridPart",
    "kind rows group lows codes scales x8 offset",
    "One run of a projection's output rows in its own codes (native.h: GridPart).",
)


class Grid(ctypes.Structure):
    """A projection's output rows as up to MAX_PARTS runs of codes (native.h: Grid)."""

    _fields_ = [("parts", I64), ("part", GridPart * MAX_PARTS)]


STRUCTS = (Model, Layer, Encoder, EncoderLayer, GridPart, Grid)


class AbiEntry(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("value", I64)]


def expected_abi() -> dict[str, int]:
    """This file's side of abi.c's table: struct sizes, field offsets, codes."""
    table = {}
    for struct in STRUCTS:
        table[struct.__name__] = ctypes.sizeof(struct)
        for name, _ in struct._fields_:
            table[f"{struct.__name__}.{name}"] = getattr(struct, name).offset
    return table | {code: globals()[code] for code in CODES}


def abi_of(lib: ctypes.CDLL) -> dict[str, int]:
    """The build's side (abi.c), read from the library."""
    lib.flover_abi.restype = ctypes.POINTER(AbiEntry)
    entries, table = lib.flover_abi(), {}
    for i in range(1024):  # (a table without its end is a broken build, not a reason to run on)
        if entries[i].name is None:
            return table
        table[entries[i].name.decode()] = entries[i].value
    raise NativeUnavailable("the native build's ABI table has no end")


def abi_mismatches(ours: dict[str, int], theirs: dict[str, int]) -> list[str]:
    """Every entry on which the two sides differ, in words."""
    words = []
    for name in sorted(ours.keys() | theirs.keys()):
        if name not in theirs:
            words.append(f"{name} is declared in flover/native/abi.py but not in the C build")
        elif name not in ours:
            words.append(f"{name} is in the C build but not declared in flover/native/abi.py")
        elif ours[name] != theirs[name]:
            words.append(f"{name} is {theirs[name]} in the C build, {ours[name]} in flover/native/abi.py")
    return words


def check_abi(lib: ctypes.CDLL, path: Path | str) -> None:
    differ = abi_mismatches(expected_abi(), abi_of(lib))
    if differ:
        raise NativeUnavailable(
            f"{path} does not match flover/native/abi.py ({len(differ)} differences: "
            f"{'; '.join(differ[:5])}): rebuild after changing native.h and abi.py together"
        )


def load_library(family: str = "auto", root: Path = SOURCES) -> ctypes.CDLL:
    """The native step for `family`: built (or from the cache), loaded, its functions declared, its
    ABI checked."""
    path = build_library(family, root)
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise NativeUnavailable(f"cannot load {path}: {e}") from e
    try:
        _declare(lib)
    except AttributeError as e:  # (its checksum matched its stamp: both were replaced by hand)
        raise NativeUnavailable(f"{path} is not a build of flover's native step ({e}); delete it") from e
    check_abi(lib, path)
    return lib


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32 = ctypes.c_void_p, I64, ctypes.c_int
    lib.flover_abi.restype = ctypes.POINTER(AbiEntry)
    lib.flover_work_floats.argtypes = [ctypes.POINTER(Model), i32, i32]
    lib.flover_work_floats.restype = i64
    lib.flover_forward.argtypes = [
        ctypes.POINTER(Model),
        ctypes.POINTER(Layer),
        i32,
        i32,
        p,
        p,
        p,
        i32,
        p,
        p,
        p,
        p,
        p,
        p,
        ctypes.c_double,
        i32,
    ]
    lib.flover_forward.restype = i32
    lib.flover_head.argtypes = [ctypes.POINTER(Model), p, i32, p, p, p, ctypes.c_double, i32]
    lib.flover_head.restype = i32
    lib.flover_encode_floats.argtypes = [ctypes.POINTER(Model), i32, i32]
    lib.flover_encode_floats.restype = i64
    lib.flover_check_encoder.argtypes = [ctypes.POINTER(Model), ctypes.POINTER(Encoder), p]
    lib.flover_check_encoder.restype = i32
    lib.flover_encode.argtypes = [ctypes.POINTER(Model), ctypes.POINTER(Encoder), p, i32, p, p, p, p, i32, p, p]
    lib.flover_encode.argtypes += [ctypes.c_double, i32]
    lib.flover_encode.restype = i32
    lib.flover_kernels.restype = ctypes.c_char_p
    lib.flover_check_model.argtypes = [ctypes.POINTER(Model)]
    lib.flover_check_model.restype = i32
    lib.flover_check_layers.argtypes = [ctypes.POINTER(Model), p]
    lib.flover_check_layers.restype = i32
    lib.flover_argmax.argtypes = [p, i32, i64, i64, i32, p, i32]
    lib.flover_argmax.restype = None
    lib.flover_packed_codes.restype = i32
    lib.flover_kv_quantize.argtypes = [p, p, i64, i64, i32]
    lib.flover_kv_quantize.restype = None
    lib.flover_kv_dequantize.argtypes = [p, i64, i64, i32, i32, p]
    lib.flover_kv_dequantize.restype = None
    lib.flover_sample_scale.argtypes = [p, i32, i64, i64, p, p, p, i64, p, p, p, p, i32]
    lib.flover_sample_scale.restype = i32
    lib.flover_sample_draw.argtypes = [p, i32, i64, p, p, p, p, p, p, p, i32]
    lib.flover_sample_draw.restype = None


ALL_REDUCE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, I64)  # llama_forward.c: AllReduce


def kernels_of(lib: ctypes.CDLL) -> str:
    """The kernel family a loaded build runs, e.g. "AVX2+FMA" or "AVX-512F, bfloat16 dot products"."""
    return lib.flover_kernels().decode()
