"""What this machine computes natively: picks the default dtype (`--dtype auto`)."""

from __future__ import annotations

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


def native_bfloat16(device: str) -> bool:
    if device.startswith("cuda"):
        import torch

        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return bool(cpu_flags() & NATIVE_BF16_FLAGS)


def resolve_dtype(dtype: str, device: str) -> str:
    """`auto`: bfloat16 where the device computes it natively, else float32."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if native_bfloat16(device) else "float32"
