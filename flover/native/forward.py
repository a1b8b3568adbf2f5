"""A whole fused iteration in one native call (CPU, models/decoder.py's families, float32/bfloat16 and quantized
codes; under tensor parallelism each rank's shard, all-reducing through the communicator).

`native/llama_forward.c` runs the forward of an iteration (decode tokens and prompt chunks alike)
as loops over a blocked weight layout (weights.py): one row streams the weights at the read
bandwidth, many rows share each weight load, and norms, RoPE, KV writes, attention (each row over
its own slot's keys) and residuals are a few vector loops per row. Every output is summed in the
same order whatever else shares the iteration, so fusion changes no bit. Quantized projections run
kernels of their own on their codes (grids.py). Why it pays, with figures: docs/design_notes.md.

Around it: build.py compiles the C files for this CPU, abi.py loads the build and checks its
structs against Python's, weights.py lays out the copies of the weights.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from flover.models.attention import ForwardBatch
from flover.models.decoder import DecoderForCausalLM
from flover.models.kv_codes import QuantizedKV
from flover.native import abi, recurrent
from flover.native.abi import ALL_REDUCE, kernels_of, load_library
from flover.native.build import NativeUnavailable
from flover.native.grids import Run, check_runs, grid_struct, runs_of
from flover.native.sampling import NativeSampler
from flover.native.weights import HeadScreen, WeightArena, block_weight, blocked_shape


class KVSlots(Protocol):
    """What the native step reads of the runner's KV buffer (runner/kv_buffer.SlotBuffer)."""

    layers: Sequence[torch.Tensor]  # per layer [2, slots, kv_heads, positions, head_dim] (or a QuantizedKV)
    kv_kinds: tuple[str, str] | None  # --kv-dtype's K and V blocks (models/kv_codes.py), None: the dtype's
    max_seq_len: int
    window_base: torch.Tensor | None  # int64 [slots]: each slot's window base, where layers slide
    window: object | None  # the windowed layers (runner/kv_window.WindowedKV: .layers), or None


log = logging.getLogger(__name__)

PROJECTIONS = ("qkv", "o", "gate_up", "down", "pl_gate", "pl_proj")  # (pl_*: Gemma 4's per-layer input)
DTYPE_CODES = {torch.float32: abi.DT_F32, torch.bfloat16: abi.DT_BF16}
ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1, "gelu_new": 1, "gelu_fast": 1}  # Model.act (native.h)
SCREEN_INT8_ROWS = 8  # a bfloat16 model's greedy rows go through its int8 head screen up to this many

# flover_check_model's codes
SHAPE_CHECKS = {
    1: "every size must be positive",
    2: "heads must be a multiple of kv_heads",
    3: "head_dim and rotary_dim must be even, head_dim at most 512, rotary_dim at most head_dim",
    4: "hidden and intermediate sizes must be even",
    5: "the KV cache's rows are narrower than head_dim",
    6: "a layer's KV strides overlap, or its positions exceed max_seq_len",
    7: "the experts' sizes are not positive (top k within the experts, an even width), or a layer lacks its MLP",
    8: "the activation's code or the clamped SwiGLU's limit and alpha",
    9: "the Gated DeltaNet layers' heads (value heads a multiple of key heads), dims (at most 512) or conv taps "
    "(2 to 64), or a layer of them lacks its weights or states",
    10: "a layer's per-layer input lacks its projection or norm, or the model its width",
    11: "attention both ways runs in the blocked prompt kernel only (at most 16 query heads per kv head, "
    "heads of at most 512 dims, KV rows of head_dim)",
    12: "--kv-dtype's codes need heads of a multiple of 32 dims read by the vector attention (at most 16 query "
    "heads per kv head, heads of at most 512 dims)",
}
CLAMPED_SWIGLU = 2  # Model.act of gpt-oss's experts (native.h)


def _kv_rows(kv) -> torch.Tensor | None:
    """A layer's KV tensor (--kv-dtype's codes: its bytes), None for a recurrent layer's state."""
    return kv if isinstance(kv, torch.Tensor) else kv.rows if isinstance(kv, QuantizedKV) else None


def _kv_types(buffer: KVSlots) -> dict:
    kinds = buffer.kv_kinds
    codes = {"q8_0": abi.KV_Q8_0, "q4_0": abi.KV_Q4_0}
    return {} if kinds is None else dict(k_type=codes[kinds[0]], v_type=codes[kinds[1]])


def argmax(lib: ctypes.CDLL, logits: torch.Tensor, threads: int, out=None) -> list[int]:
    """logits.argmax(-1).tolist() ([B, vocab] float32 or bfloat16 on CPU, rows contiguous): the
    same ids (the first maximum; NaN counts as the maximum), in vector loops, without a tensor
    operation. `out`: a ctypes int64 array of at least B to write them to (else a new one)."""
    rows = logits.shape[0]
    out = (ctypes.c_int64 * rows)() if out is None else out
    assert logits.dtype in DTYPE_CODES and logits.device.type == "cpu" and logits.stride(1) == 1 and len(out) >= rows
    lib.flover_argmax(
        logits.data_ptr(), rows, logits.shape[1], logits.stride(0), DTYPE_CODES[logits.dtype], out, threads
    )
    return out[:rows]


def unsupported(model: torch.nn.Module, dtype: torch.dtype) -> str | None:
    """Why `model` cannot take the native step, or None. (The device is the engine's to check:
    it decides before loading whether to keep the dense weights.)"""
    if not isinstance(model, DecoderForCausalLM):
        return f"{type(model).__name__} is not models/decoder.py's graph"
    cfg = model.cfg
    if dtype not in DTYPE_CODES:
        return f"dtype {dtype} (float32 and bfloat16 only)"
    if cfg.norm_layout == "post" and (cfg.o_bias or cfg.mlp_bias):
        return "norms after attention and the MLP with o / down biases"
    if cfg.hidden_act not in ACTIVATIONS and not (cfg.moe is not None and cfg.moe.swiglu_limit is not None):
        return f"activation {cfg.hidden_act!r} ({', '.join(ACTIVATIONS)} only)"
    if model.rotary.interleaved or max(cfg.head_dim, cfg.global_head_dim or 0) > 512:
        return "rotary embedding other than rotate-half over heads of at most 512 dims"
    sizes = {
        "hidden size": cfg.hidden_size,
        "attention width": model.tp.heads * cfg.head_dim,
        "intermediate size": model.tp.intermediate,
        "expert intermediate size": model.tp.expert_intermediate,
    }
    odd = [f"{name} {size}" for name, size in sizes.items() if size % 2]
    if odd:
        return f"{', '.join(odd)} odd (input pairs feed the bfloat16 kernel)"
    missing = [
        name
        for name, m in model.named_modules()
        if hasattr(m, "packed")
        and m.weight is None
        and not (name == "lm_head" and cfg.tie_word_embeddings and m.quantized is None)
    ]
    if missing:
        return f"dense weights were not kept ({missing[0]}, ...)"
    return None


def layer_linears(model: DecoderForCausalLM) -> list:
    """Every projection of the layers: the dense ones, and each expert's pair where a layer has experts."""
    linears = []
    for layer in model.layers:
        linears += [getattr(layer, name) for name in PROJECTIONS if getattr(layer, name) is not None]
        linears += [layer.linear.in_proj, layer.linear.out] if layer.linear is not None else []
        linears += layer.experts.linears() if layer.experts is not None else []
    return linears


def projection_runs(linears: list, packed: bool, heads: list = ()) -> dict[int, list[Run]]:
    """id(linear) -> its runs of codes, for the linears (and `heads`) that run on codes (int4's only
    where its codes were kept); NativeUnavailable where the layers' kernels cannot take a linear's."""
    runs = {
        id(lin): runs_of(lin.quantized, packed)
        for lin in [*linears, *heads]
        if lin.quantized is not None and (lin.quantized.mode != "int4" or lin.quantized.codes is not None)
    }
    for lin in linears:
        why = check_runs(runs.get(id(lin), []))
        if why is not None:
            raise NativeUnavailable(why)
    return runs


@dataclass
class WeightPlan:
    """What the native step copies, and how: projections with codes as runs of them (grids.py: no
    16-bit copy, their kernels at every row count), the others blocked in the model's dtype, and
    greedy rows' screen of a dense head (not under TP: a rank knows only its vocabulary block)."""

    head: (
        torch.Tensor | None
    )  # [vocab block, hidden]: the LM head's weight, or the tied embedding (None: a later pipeline stage)
    runs: dict[int, list[Run]]  # id(linear) -> its runs of output rows
    quantized: list  # the linears (layers' and head) that run on codes
    dense: list[torch.Tensor]  # the weights blocked in the model's dtype
    screen: HeadScreen | None

    @classmethod
    def of(cls, model: DecoderForCausalLM, packed: bool, screened: bool) -> "WeightPlan":
        ends = [model.lm_head] if model.lm_head is not None else []  # (not on a later pipeline stage)
        tied = model.cfg.tie_word_embeddings and ends and model.lm_head.quantized is None
        head = model.embed if tied else model.lm_head.weight if ends else None
        linears = layer_linears(model)
        runs = projection_runs(linears, packed, ends)
        head_runs = id(model.lm_head) in runs
        dense = ([] if head_runs or head is None else [head]) + [lin.weight for lin in linears if id(lin) not in runs]
        dense += [layer.experts.router for layer in model.layers if layer.experts is not None]
        dense += [model.per_layer.projection] if model.per_layer is not None else []  # (Gemma 4)
        screen = HeadScreen.of(head) if screened and not head_runs and head is not None else None
        return cls(head, runs, [lin for lin in linears + ends if id(lin) in runs], dense, screen)

    @classmethod
    def of_projections(cls, linears: list, packed: bool) -> "WeightPlan":
        """The plan of projections alone (an encoder's: no head, no screen)."""
        runs = projection_runs(linears, packed)
        dense = [lin.weight for lin in linears if id(lin) not in runs]
        return cls(None, runs, [lin for lin in linears if id(lin) in runs], dense, None)

    def arena(self, dtype: torch.dtype) -> WeightArena:
        shapes = [(blocked_shape(w), dtype) for w in self.dense] + (self.screen.shapes if self.screen else [])
        shapes += [shape for lin in self.quantized for run in self.runs[id(lin)] for shape in run.shapes]
        nbytes = WeightArena.size(shapes)
        try:
            return WeightArena(nbytes)
        except (OSError, MemoryError) as e:
            raise NativeUnavailable(f"no memory for the blocked weights ({nbytes / 2**20:.0f} MiB): {e}") from e


class PlacedWeights:
    """The native step's copies of a plan's weights in one arena: blocked dense weights, and each
    projection on codes as its runs with a Grid, referenced while the C code runs."""

    def __init__(self, plan: WeightPlan, dtype: torch.dtype):
        self.plan, self.dtype, self.arena = plan, dtype, plan.arena(dtype)
        self.grids: list[abi.Grid] = []

    def address(self, weight: torch.Tensor | None, block: bool = False) -> int:
        """A weight's address for the C code (0: none); `block`: of its blocked copy in the arena."""
        if weight is None:
            return 0
        if block:
            weight = block_weight(weight, self.arena.take(blocked_shape(weight), self.dtype))
        assert weight.is_contiguous() and weight.dtype == self.dtype
        return weight.data_ptr()

    def placed(self, runs: list[Run]) -> list[tuple[torch.Tensor, ...]]:
        return [tuple(self.arena.take(shape, kind) for shape, kind in run.shapes) for run in runs]

    def projection(self, lin) -> tuple[int, int]:
        """(blocked weight, Grid) addresses: a projection on codes has no weight here."""
        if id(lin) not in self.plan.runs:
            return self.address(lin.weight, block=True), 0
        self.grids.append(grid_struct(self.plan.runs[id(lin)], self.placed(self.plan.runs[id(lin)])))
        return 0, ctypes.addressof(self.grids[-1])


class NativeForward:
    def __init__(
        self,
        model: DecoderForCausalLM,
        buffer: KVSlots,
        dtype: torch.dtype,
        threads: int,
        max_rows: int,
        release: bool = False,
        comm=None,
        kernels: str = "auto",
    ):
        """Reads the model's dense (row-major) weights once, into blocked copies of its own.
        `release`: release each projection (Linear.release) as soon as its copy is made, so that
        memory never holds two copies of the model (every NativeUnavailable comes before the
        first). `max_rows`: the most tokens an iteration has. `comm` (tensor parallelism): this
        rank's shard runs natively, and the C code calls back into comm.all_reduce at the points
        the PyTorch path all-reduces (the embedding, after the o and down projections), with the
        same buffers in float32, so ranks stay in step whichever path each one takes."""
        why = unsupported(model, dtype)
        if why is not None:
            raise NativeUnavailable(why)
        self.lib = load_library(kernels)
        self.kernels = kernels_of(self.lib)
        self.sampler = NativeSampler(self.lib, threads)  # the sampler's filters and draw, in C
        self.model, self.dtype, self.threads, self.max_rows = model, dtype, threads, max_rows
        plan = WeightPlan.of(model, bool(self.lib.flover_packed_codes()), screened=comm is None)
        self.screens_greedy = plan.screen is not None
        # int8's screen (bfloat16 models) pays at a few rows only; beyond them the whole head,
        # its argmax taken as its tiles come out; float32's pays at every row count (design notes)
        self.screen_rows = max_rows if dtype == torch.float32 else SCREEN_INT8_ROWS
        self.vocab = plan.head.shape[0] if plan.head is not None else model.tp.vocab
        layer_modes = {lin.quantized.mode for lin in plan.quantized if lin is not model.lm_head}  # (before release)
        self.quantization = next(iter(sorted(layer_modes)), None)
        self._weights = PlacedWeights(plan, dtype)
        # float32 copies held while C reads them: norms (Gemma 3, OLMo 2), gpt-oss's sink logits
        self._norm_weights: list[torch.Tensor] = []
        self._expert_tables: list[torch.Tensor] = []  # each layer of experts' address arrays, likewise
        self._buffer = buffer  # the structs below point into its KV: it lives as long as they may be read
        self._model_struct = self._model_struct_of(plan, buffer, comm)
        if release and model.lm_head is not None:
            model.lm_head.release()  # a tied head's embedding stays: it is the token lookup ...
            if self._model_struct.embed_grid:  # ... unless the head's codes are
                model.embed.data = torch.empty(0, dtype=dtype)
        self._layer_structs = self._layer_structs_of(release, buffer)
        plan.head = None  # (its copy, codes or screen are in the arena: a released head's weight goes now)
        failed = self.lib.flover_check_layers(self._model_struct, self._layer_structs)
        if failed:
            raise ValueError(f"native step: {SHAPE_CHECKS[failed]}")
        floats = self.lib.flover_work_floats(self._model_struct, max_rows, threads)
        # on 2 MiB pages as the weights: a prompt chunk's outputs are written 16 columns a row at a
        # time, rows tens of KiB apart, and on 4 KiB pages each such store missed the TLB
        self._work = WeightArena(floats * 4).take((floats,), torch.float32)
        self.eps = float(model.cfg.norm_eps)
        self._ids = (ctypes.c_int64 * max_rows)()  # greedy's output
        self._screen_scores = torch.empty(0, self.vocab, dtype=torch.float32)  # the screen's scratch, kept
        self.quantized_projections = len(plan.quantized)
        self.int8_input_projections = sum(1 for lin in plan.quantized if any(run.x8 for run in plan.runs[id(lin)]))
        self.iterations = 0  # iterations run natively (stats, tests)
        self.screened_rows = self.full_head_rows = 0  # greedy rows whose ids came back; of them, with every logit

    def _address(self, weight: torch.Tensor | None, block: bool = False) -> int:
        return self._weights.address(weight, block)

    def _norm_address(self, weight: torch.Tensor | None) -> int:
        """A norm weight's address: as it is, or a float32 copy of its own where the norm rounds
        once (offset + weight)."""
        cfg = self.model.cfg
        if weight is None or not (cfg.norm_float32 or cfg.norm_offset):
            return self._address(weight)
        self._norm_weights.append((cfg.norm_offset + weight.detach().float()).contiguous())
        return self._norm_weights[-1].data_ptr()

    def _feature_fields(self) -> dict:
        """Model's fields that vary by feature: the activation, the norms, the scales, local RoPE."""
        model, cfg = self.model, self.model.cfg
        norm_f32 = int(cfg.norm_float32 or bool(cfg.norm_offset))
        fields = dict(act=ACTIVATIONS[cfg.hidden_act], norm_f32=norm_f32, attn_scale=cfg.attn_scale or 0.0)
        fields["bidirectional"] = int(cfg.bidirectional)  # (EmbeddingGemma)
        if model.embed_scale is not None:  # as the PyTorch forward rounds it
            fields["embed_scale"] = float(model.embed_scale)
        if cfg.residual_scale is not None:
            fields["residual_scale"] = float(cfg.residual_scale)
        if model.local_rotary is not None:
            fields.update(local_cos=model.local_rotary.cos.data_ptr(), local_sin=model.local_rotary.sin.data_ptr())
        return fields

    def _experts_fields(self) -> dict:
        """Model's fields of a mixture of experts (none: experts 0)."""
        moe = self.model.cfg.moe
        if moe is None:
            return {}
        fields = dict(
            experts=moe.experts,
            top_k=moe.top_k,
            expert_inter=self.model.tp.expert_intermediate,
            norm_topk=int(moe.norm_topk_prob),
            weights_f32=int(moe.weights_float32),
            topk_softmax=int(moe.softmax_after_topk),
        )
        if moe.swiglu_limit is not None:  # (gpt-oss's experts)
            fields.update(act=CLAMPED_SWIGLU, swiglu_limit=moe.swiglu_limit, swiglu_alpha=moe.swiglu_alpha)
        return fields

    def _experts_layer_fields(self, experts, release: bool) -> dict:
        """Layer's fields of a layer of experts: its blocked router, and per expert the address of
        its blocked gate_up / down weight or of their Grid, in int64 arrays."""
        tables = {}
        for kind, linears in (("gate_up", experts.gate_up), ("down", experts.down)):
            placed = [self._weights.projection(lin) for lin in linears]
            for lin in linears if release else ():
                lin.release()
            biases = [self._address(lin.bias) for lin in linears]  # (gpt-oss; else zeros)
            for field, column in ((f"expert_{kind}", 0), (f"expert_{kind}_grid", 1), (f"expert_{kind}_bias", None)):
                values = biases if column is None else [p[column] for p in placed]
                self._expert_tables.append(torch.tensor(values, dtype=torch.int64))
                tables[field] = self._expert_tables[-1].data_ptr() if any(values) else 0
        shared = recurrent.shared_expert_fields(experts, self._weights.projection, self._address)
        for lin in (experts.shared_gate_up, experts.shared_down) if shared and release else ():
            lin.release()
        return dict(
            router=self._address(experts.router, block=True),
            router_bias=self._address(experts.router_bias),
            expert_load=experts.load.data_ptr(),
            **tables,
            **shared,
        )

    def _head_fields(self, plan: WeightPlan) -> dict[str, int]:
        """The head's addresses: a GGUF file's codes (a Grid, which a tied embedding shares), int8
        rows (--quantization int4 / int8), or a blocked dense head; and its greedy screen's."""
        lm_head, tied = self.model.lm_head, self.model.cfg.tie_word_embeddings
        fields = dict(head=0, head_scales=0, head_grid=0, embed_grid=0)
        if lm_head is None:  # a later pipeline stage: no head
            return fields
        if id(lm_head) in plan.runs and lm_head.quantized.mode == "file":
            fields["head_grid"] = self._weights.projection(lm_head)[1]
            fields["embed_grid"] = fields["head_grid"] if tied else 0  # looked up in the same codes
        elif id(lm_head) in plan.runs:
            ((codes, scales),) = self._weights.placed(plan.runs[id(lm_head)])
            plan.runs[id(lm_head)][0].fill_once(codes, scales)
            fields.update(head=codes.data_ptr(), head_scales=scales.data_ptr())
        else:
            fields["head"] = self._address(plan.head, block=True)
        screen = plan.screen.place(self._weights.arena) if plan.screen is not None else (0, 0, 0)
        return fields | dict(zip(("head_screen", "head_screen_scales", "head_bounds"), screen))

    def _model_struct_of(self, plan: WeightPlan, buffer: KVSlots, comm) -> abi.Model:
        """native.h's Model, checked by the C code's own assumptions."""
        model, cfg = self.model, self.model.cfg
        struct = abi.Model(
            layers=len(model.layers),
            hidden=cfg.hidden_size,
            heads=model.tp.heads,
            kv_heads=model.tp.kv_heads,
            head_dim=cfg.head_dim,
            inter=model.tp.intermediate,
            vocab=self.vocab,
            dtype=DTYPE_CODES[self.dtype],
            max_seq=buffer.max_seq_len,
            kv_pos=next(_kv_rows(kv) for kv in buffer.layers if _kv_rows(kv) is not None).stride(3),
            **_kv_types(buffer),
            window_base=buffer.window_base.data_ptr() if buffer.window_base is not None else 0,
            embed=model.embed.data_ptr() if model.embed is not None else 0,
            final_norm=self._norm_address(model.norm),
            cos=model.rotary.cos.data_ptr(),
            sin=model.rotary.sin.data_ptr(),
            rotary_dim=model.rotary.rotary_dim if not cfg.global_head_dim else cfg.head_dim,
            vocab_start=model.tp.vocab_start,
            all_reduce=self._all_reduce_hook(comm),
            screen_rows=self.screen_rows,
            **(self._feature_fields() | self._experts_fields() | recurrent.model_fields(model)),
            **self._head_fields(plan),
            **self._layer_shape_fields(),
        )
        failed = self.lib.flover_check_model(struct)
        if failed:
            shape = ", ".join(f"{name}={getattr(struct, name)}" for name, _ in abi.Model._fields_[:9])
            raise ValueError(f"native step: the model's shape breaks its assumptions: {SHAPE_CHECKS[failed]} ({shape})")
        return struct

    def _layer_shape_fields(self) -> dict:
        """(Gemma 4) Model's widest layer geometry, the value norm's ones, the per-layer inputs' width."""
        model, cfg = self.model, self.model.cfg
        attention = [layer for layer in model.layers if layer.qkv is not None]
        fields = dict(
            max_head_dim=max((layer.head_dim for layer in attention), default=0),
            max_kv_heads=max((layer.tp.kv_heads for layer in attention), default=0),
            max_inter=max((layer.wide * model.tp.intermediate for layer in model.layers), default=0),
            per_layer_width=cfg.per_layer_input.width if cfg.per_layer_input is not None else 0,
        )
        if model.per_layer is not None:
            fields["per_layer_proj"] = self._address(model.per_layer.projection, block=True)
            fields["per_layer_norm"] = self._norm_address(model.per_layer.norm)
        if cfg.v_norm:  # (a norm without weight: times float32 ones; the router's input is as wide as hidden)
            self._norm_weights.append(torch.ones(max(fields["max_head_dim"], cfg.hidden_size), dtype=torch.float32))
            fields["v_norm"] = self._norm_weights[-1].data_ptr()
        return fields

    def _gemma4_layer_fields(self, layer, blocked: dict, kv: dict) -> dict:
        """Layer's own head shape, KV readers and per-layer input (Gemma 4; the model's otherwise)."""
        if layer.qkv is None:  # (a DeltaNet layer)
            return {}
        fields = dict(
            head_dim=layer.head_dim,
            kv_heads=layer.tp.kv_heads,
            kv_pos=kv.get("kv_pos", 0),
            inter=layer.wide * self.model.tp.intermediate if layer.gate_up is not None else 0,
            q_only=int(not layer.reads_kv),
            v_from_k=int(layer.v_from_k),
            pl_gate=blocked["pl_gate"][0],
            pl_proj=blocked["pl_proj"][0],
            pl_norm=self._norm_address(layer.pl_norm),
        )
        if layer.scalar is not None:
            fields["scalar"] = float(layer.scalar)
        if layer.beside is not None:  # (experts beside the MLP: their norms, the router's scales)
            names = ("beside_pre", "beside_post_mlp", "beside_post_experts")
            fields.update({name: self._norm_address(w) for name, w in zip(names, layer.beside)})
            for name in ("router_scale", "expert_scale"):
                self._norm_weights.append(getattr(layer.experts, name).detach().float().contiguous())
                fields[name] = self._norm_weights[-1].data_ptr()
        return fields

    def _layer_structs_of(self, release: bool, buffer: KVSlots) -> ctypes.Array:
        """native.h's Layer of every layer, in one array; `release`: each projection once copied."""
        layers = (abi.Layer * len(self.model.layers))()
        for i, (layer, window) in enumerate(zip(self.model.layers, self.model.windows)):
            # (a DeltaNet layer: no qkv / o, its states in the buffer instead of KV, native/recurrent.py)
            present = [name for name in PROJECTIONS if getattr(layer, name) is not None]  # (experts: no MLP)
            blocked = {name: self._weights.projection(getattr(layer, name)) for name in present}
            blocked.update({name: (0, 0) for name in PROJECTIONS if name not in present})
            if release:
                for name in present:
                    getattr(layer, name).release()
            experts = {} if layer.experts is None else self._experts_layer_fields(layer.experts, release)
            if layer.sinks is not None:  # (gpt-oss) a float32 copy of its heads' sink logits
                self._norm_weights.append(layer.sinks.detach().float().contiguous())
                experts["sinks"] = self._norm_weights[-1].data_ptr()
            if layer.linear is not None:
                state = self._delta_fields(layer.linear, buffer.layers[i], release)
            else:
                state = self._kv_fields(buffer, i)
            layers[i] = abi.Layer(
                input_norm=self._norm_address(layer.input_norm),
                qkv=blocked["qkv"][0],
                qkv_bias=self._address(layer.qkv.bias if layer.qkv is not None else None),
                o=blocked["o"][0],
                o_bias=self._address(layer.o_bias),
                post_norm=self._norm_address(layer.post_norm),
                gate_up=blocked["gate_up"][0],
                gate_up_bias=self._address(layer.gate_up.bias if layer.gate_up is not None else None),
                down=blocked["down"][0],
                down_bias=self._address(layer.down_bias),
                window=window or 0,
                q_norm=self._norm_address(layer.q_norm),
                k_norm=self._norm_address(layer.k_norm),
                no_rope=int(not layer.rope),
                qk_norm_whole=int(self.model.cfg.qk_norm == "projection"),
                ffn_norm_after=self._norm_address(layer.ffn_norm_after),
                attn_norm_after=self._norm_address(layer.attn_norm_after),
                local_rope=int(layer.local_rope),
                **self._gemma4_layer_fields(layer, blocked, state),
                **{k: v for k, v in state.items() if k != "kv_pos"},
                **{f"{name}_grid": blocked[name][1] for name in PROJECTIONS},
                **experts,
            )
        return layers

    def _kv_fields(self, buffer: KVSlots, i: int) -> dict:
        """An attention layer's KV: its address and strides in elements (codes: in bytes, V's row
        kv_kind after K's), positions a slot keeps."""
        kv = _kv_rows(buffer.layers[i])  # [2, slots, kv_heads, positions, head_dim] (codes: [1, ..., bytes])
        assert kv.is_contiguous() and kv.dtype == (self.dtype if buffer.kv_kinds is None else torch.uint8)
        return dict(
            kv=kv.data_ptr(),
            kv_kind=kv.stride(0) if buffer.kv_kinds is None else buffer.layers[i].v.start,
            kv_slot=kv.stride(1),
            kv_head=kv.stride(2),
            kv_len=kv.shape[3],
            windowed_kv=int(buffer.window is not None and i in buffer.window.layers),
            kv_pos=kv.stride(3),
        )

    def _delta_fields(self, linear, state, release: bool) -> dict:
        """A DeltaNet layer's projections, small tensors and states (native/recurrent.py)."""
        fields = recurrent.layer_fields(linear, state, self._weights.projection, self._address, self._norm_weights)
        if release:
            linear.in_proj.release()
            linear.out.release()
        return fields

    def greedy(self, logits: torch.Tensor) -> list[int]:
        """Greedy ids of the iteration's logits [B, vocab] (the sampler's `greedy`), through a
        buffer of its own: after a forward has streamed the weights through the caches, every
        first tensor operation pays cache misses, so none runs here."""
        return argmax(self.lib, logits, self.threads, self._ids)

    def _all_reduce_hook(self, comm) -> int:
        """The address of a C-callable in-place float32 sum over the ranks, or 0 without TP."""
        if comm is None:
            return 0

        def all_reduce(address: int, n: int) -> None:
            comm.all_reduce(torch.frombuffer((ctypes.c_float * n).from_address(address), dtype=torch.float32))

        self._all_reduce = ALL_REDUCE(all_reduce)  # referenced for as long as the C code may call it
        return ctypes.cast(self._all_reduce, ctypes.c_void_p).value

    def describe(self) -> str:
        """What runs, for the start-up line: e.g. "AVX2+FMA kernels, bfloat16 weights widened to float32"."""
        dot = "bfloat16 dot products" in self.kernels
        if self.dtype == torch.float32:
            weights = "float32 weights"
        elif self.quantization == "file" and self.int8_input_projections == self.quantized_projections:
            weights = "the file's own codes on int8 inputs"
        elif self.quantization == "file":  # Q8_0's bytes meet the 16-bit inputs
            weights = (
                f"the file's own codes ({self.int8_input_projections} of {self.quantized_projections} "
                f"projections on int8 inputs, the others {'in dot products' if dot else 'widened to float32'})"
            )
        else:
            weights = f"{self.quantization or 'bfloat16'} weights" + (
                " in dot products" if dot else " widened to float32"
            )
        return f"{self.kernels} kernels, {weights}"

    def run(self, batch: ForwardBatch, greedy: bool = False) -> torch.Tensor | list[int] | None:
        """[sampled rows, vocab block] float32 logits of the iteration, or None when it has more tokens
        than max_rows (the caller runs PyTorch). `greedy` (every sampled row is plain greedy):
        where this model screens its head (screens_greedy), the rows' ids instead of logits:
        through the screen up to screen_rows rows, beyond them (bfloat16) from the whole head,
        its argmax taken as its tiles come out."""
        rows = batch.input_ids.shape[0]
        if not 0 < rows <= self.max_rows:
            return None
        out_rows = batch.sample_rows.contiguous()  # (named: a contiguous copy lives until the call returns)
        n_out = out_rows.shape[0]
        ids_back, logits = self._head_output(n_out, greedy)
        # embeddings: every row's residual after the last layer, of which the pooled ones are normed here
        hidden = None if batch.pool_rows is None else torch.empty(rows, self.model.cfg.hidden_size, dtype=torch.float32)
        full = self._call(
            batch,
            n_out,
            out_rows.data_ptr(),
            logits.data_ptr(),
            self._ids if ids_back else None,
            hidden_out=None if hidden is None else hidden.data_ptr(),
        )
        if hidden is not None:
            batch.pooled = self.model.final_norm(hidden[batch.pool_rows])
        return self._head_result(ids_back, logits, n_out, full)

    def _head_output(self, n_out: int, greedy: bool) -> tuple[bool, torch.Tensor]:
        """Whether the rows' greedy ids come back instead of logits (`greedy`, where this model
        screens its head), and the [n_out, vocab] float32 logits, or the screen's scratch."""
        ids_back = greedy and self.screens_greedy and n_out > 0
        if not ids_back:
            return False, torch.empty(n_out, self.vocab, dtype=torch.float32)  # float32 whatever the dtype
        # scratch: the screen's [n_out, vocab] float scores (beyond screen_rows none are used)
        if n_out <= self.screen_rows and self._screen_scores.shape[0] < n_out:
            self._screen_scores = torch.empty(n_out, self.vocab, dtype=torch.float32)
        return True, self._screen_scores

    def _head_result(self, ids_back: bool, logits: torch.Tensor, n_out: int, full: int) -> torch.Tensor | list[int]:
        if not ids_back:  # (greedy ids: a positive logit scale, a soft cap change no argmax)
            scale, cap = self.model.cfg.logit_scale, self.model.cfg.final_softcap
            logits = logits if scale is None else logits.div_(scale)
            return logits if cap is None else logits.div_(cap).tanh_().mul_(cap)
        self.screened_rows += n_out
        self.full_head_rows += full
        return self._ids[:n_out]

    def _call(self, batch: ForwardBatch, n_out: int, out_rows, logits, ids, hidden_in=None, hidden_out=None) -> int:
        """flover_forward over the batch's rows (addresses, or None, for the rest)."""
        # named, so that a contiguous copy (if one is made) lives until the call returns
        tokens, positions = batch.input_ids.contiguous(), batch.positions.contiguous()
        slots = batch.write_slots.contiguous()
        self._model_struct.snapshot_rows = self._snapshot_rows(batch)
        self._model_struct.per_layer_inputs = self._per_layer_inputs(batch)
        full = self.lib.flover_forward(
            self._model_struct,
            self._layer_structs,
            tokens.shape[0],
            batch.num_decode,
            tokens.data_ptr(),
            positions.data_ptr(),
            slots.data_ptr(),
            n_out,
            out_rows,
            logits,
            ids,
            hidden_in,
            hidden_out,
            self._work.data_ptr(),
            self.eps,
            self.threads,
        )
        if full < 0:
            raise RuntimeError(
                "native step: a row's position or token id is out of range "
                "(or, attention both ways, an input not whole in the iteration)"
            )
        self.iterations += 1
        return full

    def _per_layer_inputs(self, batch: ForwardBatch) -> int:
        """(Gemma 4) the address of this iteration's per-layer table rows, float32 [rows, layers,
        width] of the model dtype's values, scaled, or 0."""
        model = self.model
        if model.per_layer is None:
            return 0
        with torch.no_grad():  # (the table's part, a lookup; the projection's runs in the step, batch-invariant)
            self._inputs = model.per_layer.by_token(batch.input_ids).float().contiguous()  # (kept until the call)
        return self._inputs.data_ptr()

    def _snapshot_rows(self, batch: ForwardBatch) -> int:
        """The address of each row's prefix-cache snapshot row (-1: none), or 0 without any."""
        if not batch.snapshots:
            return 0
        self._snapshots = torch.full((batch.input_ids.shape[0],), -1, dtype=torch.int64)
        for row, snapshot in batch.snapshots.items():
            self._snapshots[row] = snapshot
        return self._snapshots.data_ptr()

    def run_stage(self, batch: ForwardBatch, hidden_in: torch.Tensor | None) -> torch.Tensor | None:
        """A pipeline stage's layers: [rows, hidden] float32 residual rows after them, from the
        previous stage's (`hidden_in`, float32) or, on the first stage, from the tokens; None when
        the iteration has more tokens than max_rows (the caller runs PyTorch)."""
        rows = batch.input_ids.shape[0]
        if not 0 < rows <= self.max_rows:
            return None
        hidden_in = hidden_in.contiguous() if hidden_in is not None else None
        out = torch.empty(rows, self.model.cfg.hidden_size, dtype=torch.float32)
        self._call(batch, 0, None, None, None, hidden_in.data_ptr() if hidden_in is not None else None, out.data_ptr())
        return out

    def head(self, hidden: torch.Tensor, greedy: bool = False) -> torch.Tensor | list[int]:
        """The first pipeline stage's end of an iteration: the last stage's residual rows
        [B, hidden] float32 of the sampled rows -> [B, vocab block] float32 logits, or their greedy
        ids where `greedy` and the head is screened (as run())."""
        hidden = hidden.contiguous()
        n_out = hidden.shape[0]
        ids_back, logits = self._head_output(n_out, greedy)
        full = self.lib.flover_head(
            self._model_struct,
            hidden.data_ptr(),
            n_out,
            logits.data_ptr(),
            self._ids if ids_back else None,
            self._work.data_ptr(),
            self.eps,
            self.threads,
        )
        return self._head_result(ids_back, logits, n_out, full)
