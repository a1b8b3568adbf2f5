"""The native step's kernel families against the portable one, kernel by kernel
(tests/native_kernels_check.c): every family this CPU executes, and NEON cross-compiled for
aarch64 and run under qemu-user where Debian's gcc-aarch64-linux-gnu and qemu-user are installed
(correctness, not speed). The whole forward of each family this CPU runs is compared with
PyTorch's in test_native_forward.py."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from flover.native.build import CFLAGS, KERNEL_FAMILIES, SOURCES, c_files, kernel_flags, runnable_families

CHECK = Path(__file__).parent / "native_kernels_check.c"
NATIVE_DIR = SOURCES
CROSS_CC, QEMU, SYSROOT = "aarch64-linux-gnu-gcc", "qemu-aarch64", "/usr/aarch64-linux-gnu"


def build_check(compiler: str, flags: tuple[str, ...], out: Path) -> Path:
    """The check program with the native sources, each file compiled on its own core (the build's
    flags, one compiler call per file: twice as fast on 2 cores as one call for all), then linked."""
    cflags = [f for f in (*CFLAGS, *flags) if f not in ("-shared", "-fPIC", "-fvisibility=hidden")]

    def compile_one(source: Path) -> Path:
        obj = out.parent / f"{source.stem}.o"
        command = [compiler, *cflags, f"-I{NATIVE_DIR}", "-c", "-o", str(obj), str(source)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return obj

    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        objects = list(pool.map(compile_one, [CHECK, *c_files()]))
    done = subprocess.run(
        [compiler, *cflags, "-o", str(out), *map(str, objects), "-lm"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def printout(command: list[str]) -> dict[str, list[float]]:
    """native_kernels_check's output: section name -> numbers."""
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert done.returncode == 0, done.stderr[-3000:]
    sections: dict[str, list[float]] = {}
    for line in done.stdout.splitlines():
        if line.startswith("# "):
            name = line[2:]
            sections[name] = []
        else:
            sections[name].append(float(line))
    return sections


def assert_same_numbers(got: dict[str, list[float]], reference: dict[str, list[float]]) -> None:
    """Equal up to float32 summation order: the families sum in other orders (and AVX-512 BF16's
    dot product rounds its pairs its own way), never in other steps."""
    names = [n for n in reference if not n.startswith("kernels:")]
    assert [n for n in got if not n.startswith("kernels:")] == names
    for name in names:
        want, have = reference[name], got[name]
        assert len(have) == len(want), name
        scale = max([abs(v) for v in want if math.isfinite(v)] + [1.0])
        for i, (a, b) in enumerate(zip(have, want)):
            if math.isnan(b) or math.isinf(b):
                assert a == b or math.isnan(a) and math.isnan(b), (name, i, a, b)
            elif name == "argmax":
                assert a == b, (name, i, a, b)
            else:
                assert abs(a - b) <= 2e-5 * scale, (name, i, a, b, scale)


@pytest.fixture(scope="module")
def portable(tmp_path_factory) -> dict[str, list[float]]:
    path = build_check("cc", kernel_flags("generic"), tmp_path_factory.mktemp("generic") / "check")
    sections = printout([str(path)])
    assert next(iter(sections)) == "kernels: generic C"
    assert_tiles_match_their_reference(sections)
    return sections


def assert_tiles_match_their_reference(sections: dict[str, list[float]]) -> None:
    """Each int8-input tile against its reference (grid_row's weights times the dequantized
    inputs, in double): the same sums up to float32 rounding; a wrong code, scale or offset is
    off by the outputs' own size."""
    tiles = [name for name in sections if name.startswith("x8 tile ")]
    assert len(tiles) == 105  # 16 kinds of codes x 5 row counts, and the K-quants' (two layouts each) per 256
    for name in tiles:
        part = name.split()[2].rstrip(",")
        reference, got = sections[f"x8 reference {part}"], sections[name]
        scale = max(abs(v) for v in reference)
        for i, (a, b) in enumerate(zip(got, reference)):
            assert abs(a - b) <= 1e-5 * scale, (name, i, a, b, scale)
    codes = sections["int8 codes"]
    assert min(codes) == -127 and max(codes) == 127 and all(c == int(c) for c in codes)
    per_block = [sum(codes[i : i + 32]) for i in range(0, len(codes), 32)]
    assert sections["int8 sums of 32"] == per_block
    codes = sections["int8 codes (256)"]
    assert min(codes) == -127 and max(codes) == 127 and all(c == int(c) for c in codes)
    assert codes[:32] == [127.0] * 32  # (the int16 pairs' largest sum in the Q4_K tile: 16 x 15 x 127)
    assert sections["int8 sums of 16 (256)"] == [sum(codes[i : i + 16]) for i in range(0, len(codes), 16)]
    assert sections["int8 sums of 32 (256)"] == [sum(codes[i : i + 32]) for i in range(0, len(codes), 32)]
    assert not any(name.startswith("x8_block wrong") for name in sections)


@pytest.mark.parametrize("family", [f for f in runnable_families() if f != "generic"])
def test_every_kernel_of_a_family_this_cpu_runs_agrees_with_the_portable_ones(family, portable, tmp_path):
    got = printout([str(build_check("cc", kernel_flags(family), tmp_path / "check"))])
    assert_same_numbers(got, portable)
    assert_tiles_match_their_reference(got)


@pytest.mark.skipif(
    shutil.which(CROSS_CC) is None or shutil.which(QEMU) is None or not Path(SYSROOT).is_dir(),
    reason=f"the NEON kernels are checked under emulation: needs {CROSS_CC} and {QEMU} "
    "(Debian: apt-get install gcc-aarch64-linux-gnu qemu-user)",
)
@pytest.mark.parametrize("extra,name", [((), "NEON"), (("-march=armv8.2-a+dotprod",), "NEON, dotprod dot products")])
def test_neon_kernels_under_qemu_agree_with_the_portable_ones(portable, tmp_path, extra, name):
    """armv8-a, and armv8.2-a with the dot-product extension (Graviton 2+, Ampere, Apple M)."""
    flags = (*KERNEL_FAMILIES["neon"].flags, *extra)
    got = printout([QEMU, "-L", SYSROOT, str(build_check(CROSS_CC, flags, tmp_path / "check"))])
    assert next(iter(got)) == f"kernels: {name}"
    assert_same_numbers(got, portable)
    assert_tiles_match_their_reference(got)
