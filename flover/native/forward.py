"""A whole fused iteration in one native call (CPU, Llama family, float32/bfloat16/int4/int8; under
tensor parallelism each rank's shard, all-reducing through the communicator).

One request decoding alone reads every weight once per token and computes little: the token's
time is the weights' bytes over the memory bandwidth, plus whatever the framework adds. In eager
PyTorch that addition dominates on a small model (SmolLM2-135M, 2 cores: ~1,000 operations of a
few µs each, and oneDNN's packed GEMM streaming weights at ~15 GB/s where the machine reads at
~28-39). `native/llama_forward.c` runs the forward of an iteration (decode tokens and prompt
chunks alike) as loops over a blocked weight layout: one row streams the weights at the read
bandwidth, many rows share each weight load (at 64-256 rows 340-400 GFLOP/s in bfloat16 on the
dev machine, where oneDNN's packed GEMM reached 300-345), and norms, RoPE, KV writes, attention
(each row over its own slot's keys) and residuals are a few vector loops per row. Every output
is summed in the same order whatever else shares the iteration, so fusion changes no bit. With
`--quantization int4` or `int8` the projections run kernels of their own on the quantizer's codes,
with `file` on a GGUF file's own (native/grids.py: the layouts of each kind of codes).

The C file is compiled on first use with the system compiler for this CPU (`-march=native`, so
AVX-512 BF16's dot-product instruction where the CPU has it) into `~/.cache/flover/native/`,
keyed by the source, the flags, the compiler and the CPU's flags, and loaded with ctypes. No
compiler, a failed build, or a model it does not cover: the engine says why and runs PyTorch.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import math
import mmap
import os
import platform
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from flover.config import NATIVE_KERNELS
from flover.hardware import cpu_flags
from flover.models.attention import ForwardBatch
from flover.models.llama import LlamaForCausalLM
from flover.models.quant import QuantizedWeight, quantize
from flover.native.grids import Run, check_runs, grid_struct, int8_rows_run, runs_of
from flover.native.sampling import NativeSampler

if TYPE_CHECKING:  # the runner's buffer (a type only: the runner imports this module)
    from flover.runner.kv_buffer import SlotBuffer

log = logging.getLogger(__name__)

SOURCES = tuple(sorted(Path(__file__).parent.glob("*.c")))  # native.h lists what each holds
HEADERS = tuple(sorted(Path(__file__).parent.glob("*.h")))
CFLAGS = ("-O3", "-fopenmp", "-fPIC", "-shared", "-fvisibility=hidden")
# Kernel families (simd.h): the compiler flags that select each, and the CPU flags it needs
# (/proc/cpuinfo's names). "auto" builds for this CPU (-march=native: its widest family).
X86_V3 = {"avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"}
X86_V4 = X86_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


@dataclass(frozen=True)
class KernelFamily:
    flags: tuple[str, ...]
    needs: frozenset[str]
    machine: str  # platform.machine() it runs on ("" any)


KERNEL_FAMILIES = {
    "avx512bf16": KernelFamily(("-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16", "-mtune=native"),
                               frozenset(X86_V4 | {"avx512_vnni", "avx512_bf16"}), "x86_64"),  # Zen 4+, Sapphire Rapids+
    "avx512vnni": KernelFamily(("-march=x86-64-v4", "-mavx512vnni", "-mtune=native"),
                               frozenset(X86_V4 | {"avx512_vnni"}), "x86_64"),  # Cascade Lake, Ice Lake
    "avx512": KernelFamily(("-march=x86-64-v4", "-mtune=native"), frozenset(X86_V4), "x86_64"),  # Skylake-SP
    "avx2": KernelFamily(("-march=x86-64-v3", "-mtune=native"), frozenset(X86_V3), "x86_64"),
    "neon": KernelFamily(("-march=armv8-a",), frozenset({"asimd"}), "aarch64"),
    "generic": KernelFamily(("-DFLOVER_GENERIC",), frozenset(), ""),  # portable C: the reference
}
assert set(NATIVE_KERNELS) == {"auto", *KERNEL_FAMILIES}, "config.NATIVE_KERNELS names these families"
KERNELS_ENV = "FLOVER_NATIVE_KERNELS"  # overrides "auto" (tests, side-by-side runs)


def kernel_flags(family: str) -> tuple[str, ...]:
    """The compiler flags of `family` ("auto": this CPU's), or NativeUnavailable if this CPU
    cannot run it."""
    if family == "auto":
        return ("-march=native",) if platform.machine() in ("x86_64", "aarch64") else ()
    if family not in KERNEL_FAMILIES:
        raise NativeUnavailable(f"unknown kernel family {family!r}: choose auto or one of {', '.join(KERNEL_FAMILIES)}")
    kind = KERNEL_FAMILIES[family]
    missing = sorted(kind.needs - cpu_flags())
    if kind.machine and platform.machine() != kind.machine or missing:
        why = f"lacks {', '.join(missing)}" if missing and platform.machine() == kind.machine else \
            f"is {platform.machine()}"
        raise NativeUnavailable(f"kernel family {family} cannot run here: this CPU {why}")
    return kind.flags


def runnable_families() -> list[str]:
    """The kernel families this CPU can execute (tests build and check each)."""
    families = []
    for name in KERNEL_FAMILIES:
        try:
            kernel_flags(name)
        except NativeUnavailable:
            continue
        families.append(name)
    return families


MODEL_FIELDS = ("layers", "hidden", "heads", "kv_heads", "head_dim", "inter", "vocab", "dtype", "max_seq",
                "kv", "kv_layer", "kv_kind", "kv_slot", "kv_head", "kv_pos",
                "embed", "final_norm", "head", "head_scales", "cos", "sin", "head_grid", "embed_grid", "vocab_start",
                "all_reduce",
                "head_screen", "head_screen_scales", "head_bounds", "screen_rows")
PROJECTIONS = ("qkv", "o", "gate_up", "down")
LAYER_FIELDS = ("input_norm", "qkv", "qkv_bias", "o", "o_bias", "post_norm", "gate_up", "gate_up_bias",
                "down", "down_bias", "window") + tuple(f"{p}_grid" for p in PROJECTIONS)
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
SCREEN_INT8_ROWS = 8  # a bfloat16 model's greedy rows go through its int8 head screen up to this many
ALL_REDUCE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64)  # llama_forward.c: AllReduce


# flover_check_model's codes
SHAPE_CHECKS = {1: "every size must be positive", 2: "heads must be a multiple of kv_heads",
                3: "head_dim must be even and at most 512", 4: "hidden and intermediate sizes must be even",
                5: "the KV cache's strides overlap"}


class NativeUnavailable(RuntimeError):
    """Why the native step cannot run here (the engine logs it and runs PyTorch)."""


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "flover" / "native"


def build_library(family: str = "auto") -> Path:
    """Compile the native step's sources for `family` unless a build of the same inputs is cached."""
    family = os.environ.get(KERNELS_ENV, "auto") if family == "auto" else family
    flags = (*CFLAGS, *kernel_flags(family))
    compiler = os.environ.get("CC", "cc")
    if shutil.which(compiler) is None:
        raise NativeUnavailable(f"no C compiler: {compiler!r} is not on PATH (set CC, or install gcc)")
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise NativeUnavailable(f"{compiler} --version failed: {e}") from e
    sources = "\0".join(f"{p.name}\0{p.read_text()}" for p in SOURCES + HEADERS)
    key = hashlib.sha256("\0".join([sources, " ".join(flags), version,
                                    " ".join(sorted(cpu_flags()))]).encode()).hexdigest()[:16]
    path = cache_dir() / f"llama_forward-{family}-{key}.so"
    stamp = path.with_name(f"{path.name}.sha256")  # written after a complete build: what the file must hash to
    if path.is_file():
        if _intact(path, stamp):
            return path
        log.warning("the cached native build %s is damaged or unfinished (its checksum does not match): "
                    "rebuilding it", path)
        for stale in (path, stamp):
            stale.unlink(missing_ok=True)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise NativeUnavailable(f"cannot create the build cache {path.parent}: {e}") from e
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")  # concurrent builds never meet
    started = time.perf_counter()
    try:
        done = subprocess.run([compiler, *flags, "-o", str(partial), *map(str, SOURCES), "-lm"], capture_output=True,
                              text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as e:
        raise NativeUnavailable(f"compiling the native step failed: {e}") from e
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        raise NativeUnavailable(f"compiling the native step failed ({compiler} exit {done.returncode}): "
                                f"{done.stderr.strip()[-2000:]}")
    try:  # the library, then its checksum: a build cut off between the two is rebuilt
        os.replace(partial, path)
        stamp_partial = stamp.with_name(f"{stamp.name}.{os.getpid()}.partial")
        stamp_partial.write_text(_sha256(path))
        os.replace(stamp_partial, stamp)
    except OSError as e:
        raise NativeUnavailable(f"cannot store the build in {path.parent}: {e}") from e
    log.info("native step (%s kernels) compiled in %.1f s: %s", family, time.perf_counter() - started, path)
    return path


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _intact(path: Path, stamp: Path) -> bool:
    """Whether a cached build is the one its build stamped (a truncated library kills the process
    with SIGBUS when loaded; a foreign one lacks our symbols)."""
    try:
        return stamp.read_text().strip() == _sha256(path)
    except OSError:
        return False


def load_library(family: str = "auto") -> ctypes.CDLL:
    path = build_library(family)
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise NativeUnavailable(f"cannot load {path}: {e}") from e
    try:
        return _bind(lib)
    except AttributeError as e:  # (its checksum matched its stamp: both were replaced by hand)
        raise NativeUnavailable(f"{path} is not a build of flover's native step ({e}); delete it") from e


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.flover_work_floats.argtypes = [p, ctypes.c_int, ctypes.c_int]
    lib.flover_work_floats.restype = i64
    lib.flover_forward.argtypes = [p, p, ctypes.c_int, ctypes.c_int, p, p, p, ctypes.c_int, p, p, p, p,
                                   ctypes.c_double, ctypes.c_int]
    lib.flover_forward.restype = ctypes.c_int
    lib.flover_kernels.restype = ctypes.c_char_p
    lib.flover_check_model.argtypes = [p]
    lib.flover_check_model.restype = ctypes.c_int
    lib.flover_argmax.argtypes = [p, ctypes.c_int, i64, i64, ctypes.c_int, p, ctypes.c_int]
    lib.flover_argmax.restype = None
    lib.flover_packed_codes.restype = ctypes.c_int
    return lib


def kernels_of(lib: ctypes.CDLL) -> str:
    """The kernel family a loaded build runs, e.g. "AVX2+FMA" or "AVX-512F, bfloat16 dot products"."""
    return lib.flover_kernels().decode()


def argmax(lib: ctypes.CDLL, logits: torch.Tensor, threads: int, out=None) -> list[int]:
    """logits.argmax(-1).tolist() ([B, vocab] float32 or bfloat16 on CPU, rows contiguous): the
    same ids (the first maximum; NaN counts as the maximum), in vector loops, without a tensor
    operation. `out`: a ctypes int64 array of at least B to write them to (else a new one)."""
    rows = logits.shape[0]
    out = (ctypes.c_int64 * rows)() if out is None else out
    assert logits.dtype in DTYPE_CODES and logits.device.type == "cpu" and logits.stride(1) == 1 and len(out) >= rows
    lib.flover_argmax(logits.data_ptr(), rows, logits.shape[1], logits.stride(0), DTYPE_CODES[logits.dtype], out,
                      threads)
    return out[:rows]


def unsupported(model: torch.nn.Module, dtype: torch.dtype) -> str | None:
    """Why `model` cannot take the native step, or None. (The device is the engine's to check:
    it decides before loading whether to keep the dense weights.)"""
    if not isinstance(model, LlamaForCausalLM):
        return f"{type(model).__name__} is not of the Llama family"
    cfg = model.cfg
    if dtype not in DTYPE_CODES:
        return f"dtype {dtype} (float32 and bfloat16 only)"
    if cfg.hidden_act != "silu":
        return f"activation {cfg.hidden_act!r} (silu only)"
    if model.rotary.interleaved or model.rotary.rotary_dim != cfg.head_dim or cfg.head_dim > 512:
        return "rotary embedding other than rotate-half over whole heads of at most 512 dims"
    sizes = {"hidden size": cfg.hidden_size, "attention width": model.tp.heads * cfg.head_dim,
             "intermediate size": model.tp.intermediate}
    odd = [f"{name} {size}" for name, size in sizes.items() if size % 2]
    if odd:
        return f"{', '.join(odd)} odd (input pairs feed the bfloat16 kernel)"
    missing = [name for name, m in model.named_modules() if hasattr(m, "packed") and m.weight is None
               and not (name == "lm_head" and cfg.tie_word_embeddings and m.quantized is None)]
    if missing:
        return f"dense weights were not kept ({missing[0]}, ...)"
    return None


def blocked_shape(weight: torch.Tensor) -> tuple[int, ...]:
    """The kernels' layout of an [n, k] weight (llama_forward.c, "projections"): output rows in
    blocks of 16 (zero rows pad the last), interleaved so that one 64-byte load holds the 16 rows'
    weights for the next input (float32: [n / 16, k, 16]) or input pair (bfloat16: [n / 16, k / 2, 16, 2])."""
    n, k = weight.shape
    blocks = -(-n // 16)
    return (blocks, k // 2, 16, 2) if weight.dtype == torch.bfloat16 else (blocks, k, 16)


def block_weight(weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Write `weight` [n, k] into `out` (of blocked_shape) in the blocked layout: input pairs where
    `out` has four dimensions, single inputs where it has three."""
    n, k = weight.shape
    padded = torch.zeros(out.shape[0] * 16, k, dtype=weight.dtype)
    padded[:n] = weight.detach()
    if out.dim() == 4:
        return out.copy_(padded.view(-1, 16, k // 2, 2).permute(0, 2, 1, 3))
    return out.copy_(padded.view(-1, 16, k).permute(0, 2, 1))


@dataclass
class HeadScreen:
    """A cheaper copy of a dense LM head that scores a greedy row's vocabulary first (llama_forward.c,
    "greedy through a screen of the LM head"), and per vocabulary row the factor of a bound on how
    far its score can be from the exact logit (the proof: docs/design_notes.md, "head screen")."""

    shapes: list[tuple[tuple[int, ...], torch.dtype]]  # in the arena: the copy's tensors, then the bounds
    fill: Callable[[list[torch.Tensor]], None]  # writes the copy's tensors (blocked)
    bounds: torch.Tensor  # float32 [vocab]

    @classmethod
    def of(cls, head: torch.Tensor) -> "HeadScreen":
        vocab, k = head.shape
        head = head.detach()
        gamma = k * 2.0 ** -24 / (1 - k * 2.0 ** -24)
        margin = 1 + 2.0 ** -12
        if head.dtype == torch.float32:
            copy = head.to(torch.bfloat16)
            factor = (2.0 ** -7 + 2.0 ** -16 + 2 * gamma * (1 + 2.0 ** -7)) * margin
            bounds = torch.linalg.vector_norm(head, dim=1) * factor
            return cls([(blocked_shape(copy), torch.bfloat16), ((vocab,), torch.float32)],
                       lambda out: block_weight(copy, out[0]), bounds)
        codes, scales, bounds = [], [], []
        for part in head.split(2048):  # a part at a time: its float32 temporaries stay in cache (0.1 s, not 0.7)
            quantized, _ = quantize(part, "int8")
            w, scale = part.float(), quantized.scales.float()
            error = (w - quantized.data.float() * scale[:, None]).abs().amax(1)
            largest = torch.maximum(w.abs().amax(1), quantized.data.abs().amax(1).float() * scale)
            bounds.append((error + (2 * gamma + 2.0 ** -23) * largest) * margin)
            codes.append(quantized.data)
            scales.append(quantized.scales)
        run = int8_rows_run(QuantizedWeight("int8", torch.cat(codes), torch.cat(scales), 0))
        return cls(run.shapes + [((vocab,), torch.float32)], lambda out: run.fill(*out), torch.cat(bounds))

    def place(self, arena: "WeightArena") -> tuple[int, int, int]:
        """Into the arena: (copy, its row scales or 0, bounds) addresses."""
        tensors = [arena.take(shape, dtype) for shape, dtype in self.shapes]
        self.fill(tensors[:-1])
        tensors[-1].copy_(self.bounds)
        scales = tensors[1].data_ptr() if len(tensors) == 3 else 0
        return tensors[0].data_ptr(), scales, tensors[-1].data_ptr()


class WeightArena:
    """One anonymous mapping for all blocked weights, advised to use 2 MiB pages: a token of one
    request streams every weight once, and with 4 KiB pages that is ~65,000 TLB misses for
    SmolLM2-135M (2 MiB pages read 4-5% faster on the dev machine)."""

    HUGE = 2 << 20

    def __init__(self, nbytes: int):
        # private: a shared anonymous mapping is shmem, which takes huge pages only if shmem does
        self._map = mmap.mmap(-1, nbytes + self.HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        whole = torch.frombuffer(self._map, dtype=torch.uint8)
        start = -whole.data_ptr() % self.HUGE  # the first 2 MiB boundary inside the mapping
        if hasattr(self._map, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
            self._map.madvise(mmap.MADV_HUGEPAGE, start, nbytes)
        self._bytes, self._used = whole[start: start + nbytes], 0

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        size = math.prod(shape) * dtype.itemsize
        chunk = self._bytes[self._used: self._used + size]
        self._used += self._pages(shape, dtype)
        return chunk.view(dtype).view(shape)

    @staticmethod
    def _pages(shape: tuple[int, ...], dtype: torch.dtype) -> int:
        """Bytes a tensor takes here: every one starts on a 4 KiB page."""
        return -(-math.prod(shape) * dtype.itemsize // 4096) * 4096

    @classmethod
    def size(cls, shapes: list[tuple[tuple[int, ...], torch.dtype]]) -> int:
        return sum(cls._pages(shape, dtype) for shape, dtype in shapes)


class NativeForward:
    def __init__(self, model: LlamaForCausalLM, buffer: "SlotBuffer", dtype: torch.dtype, threads: int,
                 max_rows: int, release: bool = False, comm=None, kernels: str = "auto"):
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
        self.model, self.dtype, self.threads = model, dtype, threads
        self.max_rows = max_rows
        cfg, kv = model.cfg, buffer.kv  # kv: [layers, 2, slots, kv_heads, seq, head_dim]
        assert kv.is_contiguous() and kv.dtype == dtype
        # [vocab block, hidden]; quantized modes quantize the head to int8 (int4 too): its kernel
        # reads half of bfloat16's bytes, a large share of a single stream's
        tied = cfg.tie_word_embeddings and model.lm_head.quantized is None
        head = model.embed if tied else model.lm_head.weight
        linears = [getattr(layer, name) for layer in model.layers for name in PROJECTIONS]
        # Quantized projections run the kernels of their codes at every row count (no bfloat16
        # copy): id(linear) -> its runs of output rows (native/grids.py)
        packed = bool(self.lib.flover_packed_codes())
        runs = {id(lin): runs_of(lin.quantized, packed) for lin in linears + [model.lm_head]
                if lin.quantized is not None and (lin.quantized.mode != "int4" or lin.quantized.codes is not None)}
        for lin in linears:
            why = check_runs(runs.get(id(lin), []))
            if why is not None:
                raise NativeUnavailable(why)
        layer_modes = {lin.quantized.mode for lin in linears if id(lin) in runs}
        quantized = [lin for lin in linears + [model.lm_head] if id(lin) in runs]
        dense = ([] if id(model.lm_head) in runs else [head]) + [lin.weight for lin in linears if id(lin) not in runs]
        # greedy rows find their id through a cheaper copy of a dense head (llama_forward.c,
        # "greedy through a screen of the LM head"): exact, and the head is a fifth of a token.
        # Not under TP (each rank would only know its vocabulary block's best).
        self.screens_greedy = comm is None and id(model.lm_head) not in runs
        screen = HeadScreen.of(head) if self.screens_greedy else None
        # int8's screen (bfloat16 models) pays at a few rows only; beyond them the whole head,
        # its argmax taken as its tiles come out; float32's pays at every row count (design notes)
        self.screen_rows = max_rows if dtype == torch.float32 else SCREEN_INT8_ROWS
        shapes = [(blocked_shape(w), dtype) for w in dense] + (screen.shapes if screen else [])
        shapes += [shape for lin in quantized for run in runs[id(lin)] for shape in run.shapes]
        nbytes = WeightArena.size(shapes)
        try:
            self._arena = WeightArena(nbytes)
        except (OSError, MemoryError) as e:
            raise NativeUnavailable(f"no memory for the blocked weights ({nbytes / 2**20:.0f} MiB): {e}") from e

        def address(weight: torch.Tensor | None, block: bool = False) -> int:
            if weight is None:
                return 0
            if block:
                weight = block_weight(weight, self._arena.take(blocked_shape(weight), dtype))
            assert weight.is_contiguous() and weight.dtype == dtype
            return weight.data_ptr()

        self._grids = []  # native.h's Grid of each quantized projection, referenced while the C code runs

        def placed(lin_runs: list[Run]) -> list[tuple[torch.Tensor, torch.Tensor]]:
            return [tuple(self._arena.take(shape, kind) for shape, kind in run.shapes) for run in lin_runs]

        def projection(lin) -> tuple[int, int]:
            """(blocked weight, Grid) addresses: a quantized projection has no weight here."""
            if id(lin) not in runs:
                return address(lin.weight, block=True), 0
            self._grids.append(grid_struct(runs[id(lin)], placed(runs[id(lin)])))
            return 0, self._grids[-1].data_ptr()

        self.vocab = head.shape[0]
        head_grid = embed_grid = 0
        if id(model.lm_head) in runs and model.lm_head.quantized.mode == "file":  # a GGUF file's codes
            _, head_grid = projection(model.lm_head)
            head_addr = head_scales = 0
            # a tied embedding is looked up in the same codes: its 16-bit copy goes with the head's
            embed_grid = head_grid if cfg.tie_word_embeddings else 0
        elif id(model.lm_head) in runs:  # int8 rows (quantize_projections)
            (codes, scales), = placed(runs[id(model.lm_head)])
            runs[id(model.lm_head)][0].fill(codes, scales)
            head_addr, head_scales = codes.data_ptr(), scales.data_ptr()
        else:
            head_addr, head_scales = address(head, block=True), 0
        head_screen = head_screen_scales = head_bounds = 0
        if screen is not None:
            head_screen, head_screen_scales, head_bounds = screen.place(self._arena)
        fields = dict(
            layers=cfg.num_layers, hidden=cfg.hidden_size, heads=model.tp.heads, kv_heads=model.tp.kv_heads,
            head_dim=cfg.head_dim, inter=model.tp.intermediate, vocab=self.vocab, dtype=DTYPE_CODES[dtype],
            max_seq=kv.shape[4], kv=kv.data_ptr(), kv_layer=kv.stride(0), kv_kind=kv.stride(1),
            kv_slot=kv.stride(2), kv_head=kv.stride(3), kv_pos=kv.stride(4), embed=model.embed.data_ptr(),
            final_norm=model.norm.data_ptr(), head=head_addr, head_scales=head_scales, cos=model.rotary.cos.data_ptr(),
            sin=model.rotary.sin.data_ptr(), head_grid=head_grid, embed_grid=embed_grid,
            vocab_start=model.tp.vocab_start, all_reduce=self._all_reduce_hook(comm), head_screen=head_screen,
            head_screen_scales=head_screen_scales, head_bounds=head_bounds, screen_rows=self.screen_rows)
        self._model_struct = torch.tensor([fields[f] for f in MODEL_FIELDS], dtype=torch.int64)
        failed = self.lib.flover_check_model(self._model_struct.data_ptr())
        if failed:
            raise ValueError(f"native step: the model's shape breaks its assumptions: {SHAPE_CHECKS[failed]} "
                             f"({', '.join(f'{f}={fields[f]}' for f in MODEL_FIELDS[:9])})")
        if release:
            model.lm_head.release()  # a tied head's embedding stays: it is the token lookup ...
            if embed_grid:  # ... unless the head's codes are
                model.embed.data = torch.empty(0, dtype=dtype)
        rows = []
        for layer, window in zip(model.layers, cfg.sliding_windows):
            blocked = {name: projection(getattr(layer, name)) for name in PROJECTIONS}
            if release:
                for name in PROJECTIONS:
                    getattr(layer, name).release()
            row = [address(layer.input_norm), blocked["qkv"][0], address(layer.qkv.bias), blocked["o"][0],
                   address(layer.o_bias), address(layer.post_norm), blocked["gate_up"][0],
                   address(layer.gate_up.bias), blocked["down"][0], address(layer.down_bias), window or 0]
            rows.append(row + [blocked[name][1] for name in PROJECTIONS])
        self._layer_structs = torch.tensor(rows, dtype=torch.int64)  # [layers, len(LAYER_FIELDS)]
        floats = self.lib.flover_work_floats(self._model_struct.data_ptr(), max_rows, threads)
        self._work = torch.empty(floats, dtype=torch.float32)
        self.eps = float(cfg.norm_eps)
        self._ids = (ctypes.c_int64 * max_rows)()  # greedy's output
        self._screen_scores = torch.empty(0, self.vocab, dtype=torch.float32)  # the screen's scratch, kept
        self.quantized_projections = len(quantized)
        self.int8_input_projections = sum(1 for lin in quantized if any(run.x8 for run in runs[id(lin)]))
        self.quantization = next(iter(sorted(layer_modes)), None)
        self.iterations = 0  # iterations run natively (stats, tests)
        self.screened_rows = self.full_head_rows = 0  # greedy rows whose ids came back; of them, with every logit

    def greedy(self, logits: torch.Tensor) -> list[int]:
        """Greedy ids of the iteration's logits [B, vocab] (the sampler's `greedy`), through a
        buffer of its own: after a forward has streamed the weights through the caches, every
        first tensor operation pays ~0.1 ms of cache misses (a few % of a single stream's
        token), so none runs here."""
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
            weights = (f"the file's own codes ({self.int8_input_projections} of {self.quantized_projections} "
                       f"projections on int8 inputs, the others {'in dot products' if dot else 'widened to float32'})")
        else:
            weights = (f"{self.quantization or 'bfloat16'} weights"
                       + (" in dot products" if dot else " widened to float32"))
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
        # named, so that a contiguous copy (if one is made) lives until the call returns
        tokens, positions = batch.input_ids.contiguous(), batch.positions.contiguous()
        slots, out_rows = batch.write_slots.contiguous(), batch.sample_rows.contiguous()
        n_out = out_rows.shape[0]
        ids_back = greedy and self.screens_greedy and n_out > 0  # the rows' ids come back, not logits
        if not ids_back:
            logits = torch.empty(n_out, self.vocab, dtype=torch.float32)  # float32 whatever the dtype
        else:  # scratch: the screen's [n_out, vocab] float scores (beyond screen_rows none are used)
            if n_out <= self.screen_rows and self._screen_scores.shape[0] < n_out:
                self._screen_scores = torch.empty(n_out, self.vocab, dtype=torch.float32)
            logits = self._screen_scores
        full = self.lib.flover_forward(self._model_struct.data_ptr(), self._layer_structs.data_ptr(), rows,
                                       batch.num_decode, tokens.data_ptr(), positions.data_ptr(), slots.data_ptr(),
                                       n_out, out_rows.data_ptr(), logits.data_ptr(),
                                       self._ids if ids_back else None, self._work.data_ptr(), self.eps, self.threads)
        if full < 0:
            raise RuntimeError("native step: a row's position or token id is out of range")
        self.iterations += 1
        if not ids_back:
            return logits
        self.screened_rows += n_out
        self.full_head_rows += full
        return self._ids[:n_out]
