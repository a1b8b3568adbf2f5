"""The native step's build cache is input too: what is loaded from it is checked first."""

from __future__ import annotations

import os
import subprocess
import sys

from flover.native.build import KERNELS_ENV, _intact, _sha256


def test_a_damaged_or_foreign_cached_build_is_rebuilt_not_loaded(tmp_path):
    """A truncated library in the build cache killed every start with SIGBUS (exit -7, no
    message); a foreign one ended in an AttributeError. Each start checks the build's stamp first:
    a damaged one is rebuilt, with a warning, and the process runs; one without our symbols is a
    NativeUnavailable naming it."""
    # the quickest build: generic kernels, unoptimized (-O0 after the build's -O3: what is checked
    # here is the cache, not the code), by a compiler wrapper found through $CC
    quick = tmp_path / "quick-cc"
    quick.write_text('#!/bin/sh\nexec cc "$@" -O0\n')
    quick.chmod(0o755)
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), KERNELS_ENV: "generic", "CC": str(quick)}
    probe = [
        sys.executable,
        "-c",
        "from flover.native.abi import load_library, kernels_of; print(kernels_of(load_library()))",
    ]
    first = subprocess.run(probe, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    (built,) = (tmp_path / "flover" / "native").glob("*.so")
    built.write_bytes(built.read_bytes()[:4096])  # truncated, as by a full disk or a killed copy
    again = subprocess.run(probe, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and again.stdout == first.stdout, again.stderr[-2000:]
    assert "damaged or unfinished" in again.stderr
    # a foreign library in its place (say, copied over it) fails the stamp too: rebuilt the same way
    stamp = built.with_name(built.name + ".sha256")
    foreign = tmp_path / "foreign.c"
    foreign.write_text("int not_flover(void) { return 1; }\n")
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(built), str(foreign)], check=True)
    assert not _intact(built, stamp)
    # and one whose stamp was forged as well is refused by its symbols, not a traceback
    stamp.write_text(_sha256(built))
    forged = subprocess.run(probe, env=env, capture_output=True, text=True, timeout=300)
    assert forged.returncode != 0 and "is not a build of flover's native step" in forged.stderr
    assert "AttributeError" not in forged.stderr.splitlines()[-1]
