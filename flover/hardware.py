"""What this machine computes natively (picks the default dtype, `--dtype auto`), and what its C
library needs told."""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

# CPU flags (Linux /proc/cpuinfo) of instructions that compute bfloat16 dot products natively:
# AVX-512 BF16 (AMD Zen 4+, Intel Cooper Lake+) and AMX (Intel Sapphire Rapids+); Arm's BF16.
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str]:
    try:
        text = Path(cpuinfo).read_text()
    except OSError:  # not Linux: no flags known, so no native bfloat16 assumed
        return set()
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):  # x86, Arm
            flags.update(value.split())
    return flags


def native_bfloat16(device: str, flags: set[str] | None = None) -> bool:
    if device.startswith("cuda"):
        import torch

        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return bool((cpu_flags() if flags is None else flags) & NATIVE_BF16_FLAGS)


def widened_bfloat16(flags: set[str] | None = None) -> bool:
    """Whether the native step has vector kernels here that widen bfloat16 weights to float32 in
    registers (flover/native/simd.h: x86-64 with AVX2 and FMA, or AArch64): half the bytes of
    float32 to read per token, the same arithmetic rate."""
    flags = cpu_flags() if flags is None else flags
    return {"avx2", "fma"} <= flags or "asimd" in flags


def resolve_dtype(dtype: str, device: str, native_step: bool = True, flags: set[str] | None = None) -> str:
    """`auto`: bfloat16 where the device computes it natively, or on a CPU where the native step
    runs the model (`native_step`) with kernels that widen bfloat16 weights; else float32.
    `flags`: the CPU's (default: this one's)."""
    if dtype != "auto":
        return dtype
    if native_bfloat16(device, flags) or device == "cpu" and native_step and widened_bfloat16(flags):
        return "bfloat16"
    return "float32"


def return_freed_heap() -> None:
    """Give the heap pages freed after a start-up step back to the system: glibc keeps them (SmolLM2
    from its Q4_1 file held 1.56 GB after loading, 0.78 GB after malloc_trim). Elsewhere (another
    libc) nothing is done."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


# Tokenizer threads yield the cores to the engine: a running iteration's threads wait for one
# another at every layer, so a tokenizer taking a core from one of them stalls them all.
TOKENIZER_NICE = int(os.environ.get("FLOVER_TOKENIZER_NICE", "19"))


def background_thread() -> None:
    """A worker thread's initializer: lowest CPU priority (Linux: nice is per thread), and the
    `tokenizers` library's own thread pool off (it would take every core for one long text)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), TOKENIZER_NICE)
    except (AttributeError, OSError):  # not Linux, or not allowed: full priority
        pass
