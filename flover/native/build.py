"""Compiling the native step: the kernel families and their compiler flags, and the build cache.

The C sources are compiled on first use with the system compiler for this CPU (`-march=native`,
so AVX-512 BF16's dot-product instruction where the CPU has it) into `~/.cache/flover/native/`,
keyed by the sources, the flags, the compiler and the CPU's flags. No compiler or a failed build:
NativeUnavailable, and the engine says why and runs PyTorch.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from flover.config import NATIVE_KERNELS
from flover.hardware import cpu_flags

log = logging.getLogger(__name__)

SOURCES = Path(__file__).parent  # the C files and headers (native.h lists what each file holds)
CFLAGS = ("-O3", "-fopenmp", "-fPIC", "-shared", "-fvisibility=hidden")
# Kernel families (simd.h, one header each under arch/): the compiler flags that select each, and
# the CPU flags it needs (/proc/cpuinfo's names). "auto" builds for this CPU (-march=native).
X86_V3 = {"avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"}
X86_V4 = X86_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
KERNELS_ENV = "FLOVER_NATIVE_KERNELS"  # overrides "auto" (tests, side-by-side runs)


class NativeUnavailable(RuntimeError):
    """Why the native step cannot run here (the engine logs it and runs PyTorch)."""


@dataclass(frozen=True)
class KernelFamily:
    flags: tuple[str, ...]
    needs: frozenset[str]
    machine: str  # platform.machine() it runs on ("" any)


KERNEL_FAMILIES = {
    "avx512bf16": KernelFamily(
        ("-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16", "-mtune=native"),
        frozenset(X86_V4 | {"avx512_vnni", "avx512_bf16"}),
        "x86_64",
    ),  # Zen 4+, SPR+
    "avx512vnni": KernelFamily(
        ("-march=x86-64-v4", "-mavx512vnni", "-mtune=native"), frozenset(X86_V4 | {"avx512_vnni"}), "x86_64"
    ),  # Cascade Lake, Ice Lake
    "avx512": KernelFamily(("-march=x86-64-v4", "-mtune=native"), frozenset(X86_V4), "x86_64"),  # Skylake-SP
    "avx2": KernelFamily(("-march=x86-64-v3", "-mtune=native"), frozenset(X86_V3), "x86_64"),
    "neon": KernelFamily(("-march=armv8-a",), frozenset({"asimd"}), "aarch64"),
    "generic": KernelFamily(("-DFLOVER_GENERIC",), frozenset(), ""),  # portable C: the reference
}
assert set(NATIVE_KERNELS) == {"auto", *KERNEL_FAMILIES}, "config.NATIVE_KERNELS names these families"


def source_files(root: Path = SOURCES) -> list[Path]:
    """Every file the compile reads: the C files (compiled) and the headers under them (included)."""
    return sorted(p for p in root.rglob("*") if p.suffix in (".c", ".h") and "__pycache__" not in p.parts)


def c_files(root: Path = SOURCES) -> list[Path]:
    return sorted(root.glob("*.c"))


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
        why = (
            f"lacks {', '.join(missing)}"
            if missing and platform.machine() == kind.machine
            else f"is {platform.machine()}"
        )
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


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "flover" / "native"


def build_library(family: str = "auto", root: Path = SOURCES) -> Path:
    """Compile the native step's sources (those under `root`) for `family` unless a build of the
    same inputs is cached; the path of the library."""
    family = os.environ.get(KERNELS_ENV, "auto") if family == "auto" else family
    flags = (*CFLAGS, *kernel_flags(family))
    compiler = os.environ.get("CC", "cc")
    version = _compiler_version(compiler)
    sources = "\0".join(f"{p.relative_to(root)}\0{p.read_text()}" for p in source_files(root))
    key = hashlib.sha256(
        "\0".join([sources, " ".join(flags), version, " ".join(sorted(cpu_flags()))]).encode()
    ).hexdigest()[:16]
    path = cache_dir() / f"llama_forward-{family}-{key}.so"
    stamp = path.with_name(f"{path.name}.sha256")  # written after a complete build: what the file must hash to
    if path.is_file():
        if _intact(path, stamp):
            return path
        log.warning(
            "the cached native build %s is damaged or unfinished (its checksum does not match): rebuilding it", path
        )
        for stale in (path, stamp):
            stale.unlink(missing_ok=True)
    started = time.perf_counter()
    _compile(compiler, flags, c_files(root), path, stamp)
    log.info("native step (%s kernels) compiled in %.1f s: %s", family, time.perf_counter() - started, path)
    return path


def _compiler_version(compiler: str) -> str:
    if shutil.which(compiler) is None:
        raise NativeUnavailable(f"no C compiler: {compiler!r} is not on PATH (set CC, or install gcc)")
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise NativeUnavailable(f"{compiler} --version failed: {e}") from e


def _compile(compiler: str, flags: tuple[str, ...], sources: list[Path], path: Path, stamp: Path) -> None:
    """Build into `path`, then stamp it with its checksum: a build cut off between the two is rebuilt.
    Concurrent builds never meet (each writes a file of its own, then renames it)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise NativeUnavailable(f"cannot create the build cache {path.parent}: {e}") from e
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    objects = path.with_name(f"{path.name}.{os.getpid()}.objects")
    try:
        objects.mkdir(exist_ok=True)
        # each source on a core of its own (the largest file bounds the wait), then one link
        with ThreadPoolExecutor(len(os.sched_getaffinity(0)) or 1) as pool:
            built = list(pool.map(lambda source: _compile_one(compiler, flags, source, objects), sources))
        _run_compiler([compiler, *flags, "-o", str(partial), *map(str, built), "-lm"], compiler)
    except NativeUnavailable:
        partial.unlink(missing_ok=True)
        raise
    except OSError as e:
        partial.unlink(missing_ok=True)
        raise NativeUnavailable(f"cannot build in {path.parent}: {e}") from e
    finally:
        shutil.rmtree(objects, ignore_errors=True)
    try:
        os.replace(partial, path)
        stamp_partial = stamp.with_name(f"{stamp.name}.{os.getpid()}.partial")
        stamp_partial.write_text(_sha256(path))
        os.replace(stamp_partial, stamp)
    except OSError as e:
        raise NativeUnavailable(f"cannot store the build in {path.parent}: {e}") from e


def _compile_one(compiler: str, flags: tuple[str, ...], source: Path, objects: Path) -> Path:
    obj = objects / f"{source.stem}.o"
    _run_compiler([compiler, *(f for f in flags if f != "-shared"), "-c", "-o", str(obj), str(source)], compiler)
    return obj


def _run_compiler(command: list[str], compiler: str) -> None:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as e:
        raise NativeUnavailable(f"compiling the native step failed: {e}") from e
    if done.returncode != 0:
        raise NativeUnavailable(
            f"compiling the native step failed ({compiler} exit {done.returncode}): {done.stderr.strip()[-2000:]}"
        )


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _intact(path: Path, stamp: Path) -> bool:
    """Whether a cached build is the one its build stamped (a truncated library kills the process
    with SIGBUS when loaded; a foreign one lacks our symbols)."""
    try:
        return stamp.read_text().strip() == _sha256(path)
    except OSError:
        return False
