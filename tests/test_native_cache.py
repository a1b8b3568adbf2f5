"""The native step's build cache is input too: what is loaded from it is checked first."""

from __future__ import annotations

import os
import subprocess
import sys

from flover.native.forward import KERNELS_ENV


def test_a_damaged_or_foreign_cached_build_is_rebuilt_not_loaded(tmp_path):
    """A truncated library in the build cache killed every start with SIGBUS (exit -7, no
    message); a foreign one ended in an AttributeError. Each start checks the build's stamp first:
    both are rebuilt, with a warning, and the next process runs."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), KERNELS_ENV: "generic"}  # (the quickest build)
    probe = [sys.executable, "-c", "from flover.native.forward import load_library, kernels_of; "
                                   "print(kernels_of(load_library()))"]
    first = subprocess.run(probe, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    (built,) = (tmp_path / "flover" / "native").glob("*.so")
    built.write_bytes(built.read_bytes()[:4096])  # truncated, as by a full disk or a killed copy
    again = subprocess.run(probe, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and again.stdout == first.stdout, again.stderr[-2000:]
    assert "damaged or unfinished" in again.stderr
    foreign = tmp_path / "foreign.c"
    foreign.write_text("int not_flover(void) { return 1; }\n")
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(built), str(foreign)], check=True)
    third = subprocess.run(probe, env=env, capture_output=True, text=True, timeout=300)
    assert third.returncode == 0 and third.stdout == first.stdout, third.stderr[-2000:]
    assert "damaged or unfinished" in third.stderr
