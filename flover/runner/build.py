"""What one rank holds to run iterations, built once: its shard of the model, the slot buffer (KV
cache and prefix pool), and the fastest forward the device offers (CUDA graphs for decode
iterations, or the native CPU step), behind a ModelRunner."""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import torch

from flover.config import EngineConfig, kv_kinds
from flover.hardware import return_freed_heap
from flover.models import ModelConfig, load_model, pack_projections, release_projections, runs_natively
from flover.models.gated_deltanet import state_dtype, state_shapes
from flover.models.stage_layout import StageLayout
from flover.models.tp_layout import TPLayout
from flover.native.build import NativeUnavailable
from flover.native.encoder import NativeEncoder
from flover.native.forward import NativeForward
from flover.parallel.comm import Communicator
from flover.parallel.pipeline import StageLink
from flover.runner.cuda_graphs import DecodeGraphs
from flover.runner.kv_buffer import RecurrentLayout, SlotBuffer, kv_cache_bytes
from flover.runner.kv_window import WindowedKV
from flover.runner.pipeline import PipelineRunner
from flover.runner.runner import ModelRunner

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankSetup:
    """The engine's decisions the runner is built from."""

    config: EngineConfig  # dtype resolved
    cfg: ModelConfig
    tp: TPLayout
    dtype: torch.dtype
    device: torch.device
    max_seq_len: int
    prefix_blocks: int
    block_tokens: int
    comm: Communicator | None  # several ranks only
    is_leader: bool
    window: WindowedKV | None = None  # the sliding-window layers' bound (None: they keep every position)
    stage: StageLayout | None = None  # pipeline stages: this rank's layers (None: all)
    link: StageLink | None = None  # and its links to the other stages
    snapshots: int = 0  # rows of the recurrent layers' state snapshots (prefix cache)


def build_runner(checkpoint, s: RankSetup) -> ModelRunner:
    config, cfg = s.config, s.cfg
    native_wanted = (
        config.native_forward == "auto"
        and runs_natively(cfg)  # (its family file says whether the native step knows its features)
        and s.device.type == "cpu"
        and s.dtype in (torch.float32, torch.bfloat16)
    )
    model = load_model(
        checkpoint,
        s.dtype,
        s.device,
        s.max_seq_len,
        cfg,
        tp=s.tp,
        comm=s.comm,
        pack_hint=config.max_slots,
        quantization=config.quantization,
        pack=not native_wanted,
        stage=s.stage,
    )
    static_decode = _static_decode(s)
    buffer = _slot_buffer(s, scratch_slots=1 if static_decode else 0)
    if s.is_leader:
        _log_memory(s, buffer)
    graphs = _decode_graphs(model, buffer, config) if static_decode else None
    native = _native_forward(model, buffer, s) if native_wanted else None
    return_freed_heap()  # loading's dequantized tensors and dense copies
    if s.link is not None:
        return PipelineRunner(
            model,
            buffer,
            cfg.vocab_size,
            s.device,
            s.comm,
            config.seed,
            graphs,
            native,
            link=s.link,
            timeout=config.stage_timeout,
        )
    return ModelRunner(model, buffer, cfg.vocab_size, s.device, s.comm, config.seed, graphs, native)


def _static_decode(s: RankSetup) -> bool:
    """Static decode batches (CUDA graphs) pad with rows that write a scratch slot. (Not with
    windowed KV: a static batch has no window bases; those iterations run eagerly. Nor for
    mixtures of experts: which experts run, on how many rows, depends on the rows' values. Nor
    for recurrent layers, whose padding rows would step a real slot's state.)"""
    config = s.config
    return (
        s.comm is None
        and s.link is None
        and s.window is None
        and s.cfg.moe is None
        and s.cfg.linear_attention is None
        and (config.cuda_graphs == "eager" or (config.cuda_graphs == "auto" and s.device.type == "cuda"))
    )


def _slot_buffer(s: RankSetup, scratch_slots: int) -> SlotBuffer:
    """This rank's KV: its stage's layers (numbered as its buffer's), its kv heads."""
    config, cfg = s.config, s.cfg
    layers = s.stage.layers if s.stage is not None else range(0 if cfg.encoder else cfg.num_layers)  # (encoders: no KV)
    window = s.window
    if window is not None and s.stage is not None:  # this stage's windowed layers, numbered as its buffer's
        window = dataclasses.replace(window, layers=frozenset(n - layers.start for n in window.layers if n in layers))
    return SlotBuffer(
        len(layers),
        config.max_slots,
        s.tp.kv_heads,
        s.max_seq_len,
        cfg.head_dim,
        s.dtype,
        s.device,
        prefix_blocks=s.prefix_blocks,
        block_tokens=s.block_tokens,
        scratch_slots=scratch_slots,
        prefault_pool=config.prefault_prefix_cache,
        window=window,
        recurrent=recurrent_layout(cfg, s.tp, s.dtype, layers, s.snapshots),
        shapes=kv_shapes(cfg, s.tp, layers),
        kv_sources=[cfg.kv_source(n) - layers.start for n in layers] if cfg.kv_sources else None,
        kv_kinds=kv_kinds(config.kv_dtype),
    )


def kv_shapes(cfg: ModelConfig, tp: TPLayout, layers: range) -> list[tuple[int, int]] | None:
    """Per layer of `layers`, this rank's (kv heads, head_dim) where layers differ in them (Gemma
    4's full-attention layers), else None."""
    if not cfg.global_head_dim and not cfg.global_kv_heads:
        return None
    return [(tp.with_kv_heads(cfg.layer_kv_heads(n)).kv_heads, cfg.layer_head_dim(n)) for n in layers]


def kv_bytes_per_position(
    cfg: ModelConfig, tp: TPLayout, dtype: torch.dtype, kinds: tuple[str, str] | None = None
) -> int:
    """This rank's KV bytes of one position over every layer that keeps KV (`kinds`: --kv-dtype's)."""
    shapes = kv_shapes(cfg, tp, range(cfg.num_layers)) or [(tp.kv_heads, cfg.head_dim)] * cfg.num_layers
    return sum(kv_cache_bytes(1, 1, shapes[n][0], 1, shapes[n][1], dtype, kinds) for n in cfg.kv_layers())


def recurrent_layout(
    cfg: ModelConfig, tp: TPLayout, dtype: torch.dtype, layers: range, snapshots: int = 0
) -> RecurrentLayout | None:
    """This rank's recurrent layers among `layers` (numbered from layers.start, as its buffer's)
    and their per-slot state, or None where it has none."""
    la = cfg.linear_attention
    if la is None or not la.layers & set(layers):
        return None
    conv, state = state_shapes(la, tp)
    own = frozenset(n - layers.start for n in la.layers if n in layers)
    return RecurrentLayout(own, conv, state, state_dtype(dtype), snapshots)


def _decode_graphs(model, buffer: SlotBuffer, config) -> DecodeGraphs:
    graphs = DecodeGraphs(model, buffer, capture=config.cuda_graphs == "auto")
    log.info(
        "CUDA graphs: %d decode shapes (rows <= %d, keys <= %d) %s in %.2f s",
        graphs.count,
        config.max_slots,
        buffer.max_seq_len,
        "captured" if config.cuda_graphs == "auto" else "prepared (eager)",
        graphs.capture_s,
    )
    return graphs


def _native_forward(model: torch.nn.Module, buffer: SlotBuffer, s: RankSetup) -> NativeForward | NativeEncoder | None:
    """The native step over the model's row-major weights (loaded unpacked for it). It runs
    every iteration (at most max_batch_tokens rows; Engine.score chunks longer sequences), so
    PyTorch's copies of the projections are released, unless the config keeps them; without it
    the model packs them for PyTorch."""
    config, started = s.config, time.perf_counter()
    release, threads = not config.keep_pytorch_weights, torch.get_num_threads()
    try:
        if s.cfg.encoder:  # (BERT-family: a step of its own, attention both ways)
            native = NativeEncoder(
                model, s.dtype, threads, config.max_batch_tokens, s.max_seq_len, release, config.native_kernels
            )
        else:
            native = NativeForward(
                model,
                buffer,
                s.dtype,
                threads,
                config.max_batch_tokens,
                release=release,
                comm=s.comm,
                kernels=config.native_kernels,
            )
    except NativeUnavailable as e:
        log.warning("native step off, iterations run on PyTorch only: %s", e)
        pack_projections(model, config.max_slots)
        return None
    if config.keep_pytorch_weights:
        pack_projections(model, config.max_slots)
    else:
        release_projections(model)
    log.info(
        "native step: %s (iterations run as one native call, ready in %.2f s)",
        native.describe(),
        time.perf_counter() - started,
    )
    return native


def _log_memory(s: RankSetup, buffer: SlotBuffer) -> None:
    config, ranks = s.config, s.comm.size if s.comm else 1
    per_rank = f" per rank x {ranks} ranks" if ranks > 1 else ""
    if s.stage is not None and s.stage.count > 1:  # (the leader's; every stage holds its own layers')
        per_rank += f" on the first stage (its {len(s.stage.layers)} layers)"
    window = s.window
    log.info(
        "KV cache: %.1f MiB allocated%s (%d slots x %d positions%s, %s%s)",
        buffer.nbytes / 2**20,
        per_rank,
        config.max_slots,
        s.max_seq_len,
        f"; {len(window.layers)} sliding-window layers x {window.capacity}" if window else "",
        config.dtype if buffer.kv_kinds is None else "K {} and V {} blocks".format(*buffer.kv_kinds),
        f", weights {config.quantization}" if config.quantization != "none" else "",
    )
    log.info(
        "prefix cache: %s",
        f"{buffer.pool_nbytes / 2**20:.1f} MiB{per_rank}, {s.prefix_blocks} blocks of "
        f"{s.block_tokens} tokens ({s.prefix_blocks * s.block_tokens} tokens), LRU"
        f"{', taken at start-up' if config.prefault_prefix_cache else ''}"
        if s.prefix_blocks
        else "off",
    )
