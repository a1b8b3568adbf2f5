"""The command line, run as a user runs it (a real subprocess)."""

from __future__ import annotations

import json
import subprocess
import sys


def flover(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flover.apps.cli", *args], capture_output=True, text=True, timeout=120)


def test_generate_prints_results_and_kv_figure(llama_dir):
    run = flover(
        "generate",
        "--model",
        llama_dir,
        "--max-new-tokens",
        "5",
        "--ignore-eos",
        "--json",
        "--max-seq-len",
        "64",
        "Hello",
        "the cat",
    )
    assert run.returncode == 0, run.stderr
    lines = [json.loads(line) for line in run.stdout.splitlines()]
    assert [line["prompt"] for line in lines] == ["Hello", "the cat"]
    assert all(len(line["token_ids"]) == 5 and line["finish_reason"] == "length" for line in lines)
    assert "KV cache: " in run.stderr and "MiB allocated" in run.stderr


def test_errors_are_one_clear_line(llama_dir, tmp_path):
    run = flover("generate", "--model", str(tmp_path), "x")
    assert run.returncode == 2 and "config.json: not found" in run.stderr and "Traceback" not in run.stderr
    run = flover("generate", "--model", llama_dir, "--max-seq-len", "8", "--max-new-tokens", "10", "x")
    assert run.returncode == 2 and "exceeds max_seq_len=8" in run.stderr


def test_openmp_workers_stop_spinning_soon_unless_the_caller_says():
    """main() sets libgomp's spin count before anything loads torch (libgomp reads it once, at
    load); a caller's own GOMP_SPINCOUNT or OMP_WAIT_POLICY is left alone."""
    import os

    probe = (
        "import os, sys, flover.apps.cli\n"
        "torch_before = 'torch' in sys.modules\n"
        "try:\n    flover.apps.cli.main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print(os.environ.get('GOMP_SPINCOUNT'), torch_before)"
    )

    def run(**env) -> str:
        base = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
        done = subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, env={**base, **env}
        )
        assert done.returncode == 0, done.stderr
        return done.stdout.splitlines()[-1].split()  # after --help's usage text

    from flover.apps.cli import OPENMP_SPIN_COUNT

    assert run() == [OPENMP_SPIN_COUNT, "False"]
    assert run(GOMP_SPINCOUNT="77") == ["77", "False"]
    assert run(OMP_WAIT_POLICY="active") == ["None", "False"]


def test_the_prefix_pool_is_taken_at_start_up_only_when_a_server_asks():
    from flover.apps.cli import build_parser
    from flover.apps.flags import engine_config

    parse = build_parser().parse_args
    assert not engine_config(parse(["serve", "--model", "m"])).prefault_prefix_cache
    assert engine_config(parse(["serve", "--model", "m", "--prefault-prefix-cache"])).prefault_prefix_cache
    assert not engine_config(parse(["run", "--model", "m", "--prompts", "p", "--out", "o"])).prefault_prefix_cache
    assert not engine_config(parse(["generate", "--model", "m", "x"])).prefault_prefix_cache
