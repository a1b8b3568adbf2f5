"""What `pip install flover` (not -e) gives a user: the wheel carries every file the native step's
compile needs, and from a fresh virtual environment a generation runs on the native step."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from flover.native.build import KERNELS_ENV, SOURCES, source_files

ROOT = Path(__file__).resolve().parent.parent


def clean_copy(to: Path) -> Path:
    """The files a clone holds (tracked, or new and not ignored): no build/ left by an earlier
    build, which setuptools would pack again whatever setup.cfg now says."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True, timeout=60
    )
    if listed.returncode != 0:
        pytest.skip(f"not a git checkout: {listed.stderr.decode()[-300:]}")
    for name in filter(None, listed.stdout.decode().split("\0")):
        if (ROOT / name).is_file():
            (to / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, to / name)
    return to


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    tree = clean_copy(tmp_path_factory.mktemp("tree"))
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(tree)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if built.returncode != 0 and "No module named pip" in built.stderr:
        pytest.skip("this interpreter has no pip to build the wheel with")
    assert built.returncode == 0, built.stderr[-2000:]
    (path,) = out.glob("flover-*.whl")
    return path


def test_the_wheel_carries_every_file_the_native_compile_reads(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    needed = {f"flover/native/{p.relative_to(SOURCES).as_posix()}" for p in source_files()}
    assert any(n.endswith(".h") for n in needed) and any(n.endswith(".c") for n in needed)
    assert not needed - names, f"missing from the wheel: {sorted(needed - names)}"


def test_a_fresh_non_editable_install_runs_the_native_step(wheel, tmp_path, llama_dir):
    """A venv of its own with the wheel installed (no -e); the dependencies come from this
    environment through a .pth file, which Python does not scan for further .pth files, so the
    editable finder of the source tree never loads. The build cache is empty: it compiles."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index", str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert installed.returncode == 0, installed.stderr[-2000:]
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    probe = (
        "import flover, sys\n"
        "from flover import LLM, SamplingParams\n"
        f"llm = LLM({llama_dir!r}, dtype='float32', max_slots=2, max_seq_len=64)\n"
        "out = llm.generate(['hello'], SamplingParams(max_new_tokens=4))\n"
        "print(flover.__file__); print(llm.engine.stats().native_kernels); print(out[0].token_ids)\n"
    )
    # the quickest build (-O0 after the build's -O3, by a compiler wrapper found through $CC): what
    # is checked is that the wheel's sources build and load, not their speed
    quick = tmp_path / "quick-cc"
    quick.write_text('#!/bin/sh\nexec cc "$@" -O0\n')
    quick.chmod(0o755)
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), KERNELS_ENV: "generic", "PYTHONPATH": ""}
    env["CC"] = str(quick)
    run = subprocess.run([str(python), "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    where, kernels, tokens = run.stdout.splitlines()[-3:]
    assert where.startswith(str(site)), f"flover came from {where}, not the installed wheel"
    assert kernels != "None", f"the PyTorch fallback ran: {run.stderr[-3000:]}"
    assert len(eval(tokens)) == 4
