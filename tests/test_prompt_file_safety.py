"""`flover run` never hangs, never loses a prompt silently, never mixes results: real `flover
run` processes, real daemons, real SIGKILL/SIGTERM."""

from __future__ import annotations

import fcntl
import signal
import subprocess
import sys
import time

import pytest

from flover.apps.results_file import ResultsFileError, open_results
from tests.helpers import ID_PROMPTS, Server, expected_outputs, flover_run, read_records, write_jsonl

CLI = [sys.executable, "-m", "flover.apps.cli"]


def run_connect(addr: str, prompts, out, *extra: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            *CLI,
            "run",
            "--connect",
            addr,
            "--prompts",
            str(prompts),
            "--out",
            str(out),
            "--max-new-tokens",
            "6",
            "--ignore-eos",
            "--token-ids",
            "--quiet",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_bad_ids_and_oversize_prompts_get_records_and_the_rest_runs(llama_dir, tmp_path):
    server = Server(llama_dir, "--max-message-bytes", "20000")
    try:
        prompts, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
        lines = [{"id": f"p{i}", "input_ids": p} for i, p in enumerate(ID_PROMPTS[:4])]
        lines += [
            {"id": "x" * 300, "input_ids": [1]},
            {"id": "", "input_ids": [2]},
            {"id": "huge", "prompt": "y" * 30_000},
        ]
        write_jsonl(prompts, lines)
        run = run_connect(server.addr, prompts, out, "--timeout", "30")
        assert run.returncode == 0, run.stderr
        records = {r["id"]: r for r in read_records(out)}
        expected = expected_outputs(llama_dir, [6] * len(ID_PROMPTS))
        assert [records[f"p{i}"]["token_ids"] for i in range(4)] == [e.token_ids for e in expected[:4]]
        assert records["5"]["error"]["code"] == records["6"]["error"]["code"] == "invalid_request"  # by line
        assert records["huge"]["error"]["code"] == "message_too_large"
        assert len(records) == 7
    finally:
        assert server.stop()[0] == 0


def test_a_killed_daemon_ends_the_run_and_a_resume_completes_it(llama_dir, tmp_path):
    prompts, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(prompts, [{"id": f"p{i}", "input_ids": [i + 1], "max_new_tokens": 400} for i in range(12)])
    server = Server(llama_dir, "--max-seq-len", "512", "--max-slots", "2")
    proc = subprocess.Popen(
        [
            *CLI,
            "run",
            "--connect",
            server.addr,
            "--prompts",
            str(prompts),
            "--out",
            str(out),
            "--ignore-eos",
            "--quiet",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 60
    while not (out.exists() and out.read_text().count("\n") >= 2) and time.time() < deadline:
        time.sleep(0.02)
    server.proc.kill()  # no --timeout: the lost connection alone must end the run
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 3, err
    assert "incomplete" in err and "connection_lost" in err and "re-run" in err
    done = {r["id"] for r in read_records(out)}
    assert 2 <= len(done) < 12 and all("error" not in r for r in read_records(out))

    server = Server(llama_dir, "--max-seq-len", "512")
    try:
        again = subprocess.run(
            [
                *CLI,
                "run",
                "--connect",
                server.addr,
                "--prompts",
                str(prompts),
                "--out",
                str(out),
                "--ignore-eos",
                "--quiet",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert again.returncode == 0, again.stderr
        ids = [r["id"] for r in read_records(out)]
        assert sorted(ids) == sorted(f"p{i}" for i in range(12))  # each exactly once
    finally:
        assert server.stop()[0] == 0


def test_sigterm_to_the_daemon_leaves_no_cancelled_records(llama_dir, tmp_path):
    prompts, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(prompts, [{"id": f"p{i}", "input_ids": [i + 1], "max_new_tokens": 480} for i in range(10)])
    server = Server(llama_dir, "--max-seq-len", "512", "--max-slots", "2", "--drain-timeout", "0.2")

    def command(addr: str) -> list[str]:
        flags = ["--prompts", str(prompts), "--out", str(out), "--ignore-eos", "--quiet", "--max-in-flight", "4"]
        return [*CLI, "run", "--connect", addr, *flags]

    proc = subprocess.Popen(command(server.addr), stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not (out.exists() and out.read_text().count("\n") >= 1) and time.time() < deadline:
        time.sleep(0.02)
    server.stop(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 3, err
    records = read_records(out)
    assert records and all(r["finish_reason"] == "length" for r in records)  # no cancelled/shutting_down
    server = Server(llama_dir, "--max-seq-len", "512")
    try:
        again = subprocess.run(command(server.addr), capture_output=True, text=True, timeout=120)
        assert again.returncode == 0, again.stderr
        assert sorted(r["id"] for r in read_records(out)) == sorted(f"p{i}" for i in range(10))
    finally:
        assert server.stop()[0] == 0


def test_resume_refuses_other_inputs_and_a_second_writer(llama_dir, tmp_path):
    prompts, other, out = tmp_path / "in.txt", tmp_path / "other.txt", tmp_path / "out.jsonl"
    prompts.write_text("one\ntwo\n")
    other.write_text("three\nfour\n")
    assert flover_run(llama_dir, prompts, out, "--max-new-tokens", "3", "--quiet").returncode == 0
    for what, args in (
        ("prompts_sha256", (other, "--max-new-tokens", "3")),
        ("params", (prompts, "--max-new-tokens", "4")),
    ):
        run = flover_run(llama_dir, args[0], out, *args[1:], "--quiet")
        assert run.returncode == 2 and f"changed: {what}" in run.stderr and "another --out" in run.stderr
    assert len(read_records(out)) == 2  # untouched
    with open(out, "a") as held:  # what another `flover run` on this file holds
        fcntl.flock(held, fcntl.LOCK_EX)
        run = flover_run(llama_dir, prompts, out, "--max-new-tokens", "3", "--quiet")
    assert run.returncode == 2 and "another flover run is writing to it" in run.stderr
    (tmp_path / "legacy.jsonl").write_text('{"id": "1", "text": "x"}\n')  # results of unknown origin
    run = flover_run(llama_dir, prompts, tmp_path / "legacy.jsonl", "--quiet")
    assert run.returncode == 2 and "not what produced them" in run.stderr
    sidecar = tmp_path / "out.jsonl.fingerprint.json"
    sidecar.write_text('{"parts": [1, 2]}')  # valid JSON that is not a fingerprint: refused, no traceback
    run = flover_run(llama_dir, prompts, out, "--max-new-tokens", "3", "--quiet")
    assert run.returncode == 2 and "not what produced them" in run.stderr and "Traceback" not in run.stderr
    for tampered in ("[]", "null", '"x"', "7", '{"sha256": "0", "parts": "x"}', "[" * 100000):  # (the same check)
        sidecar.write_text(tampered)
        with pytest.raises(ResultsFileError, match="not what produced them"):
            open_results(str(out), {"model": llama_dir})


def test_invalid_utf8_and_carriage_returns(llama_dir, tmp_path):
    data = b"good one\nbad \xff line\r\nstill \r inside\nlast\n"
    prompts = tmp_path / "in.txt"
    prompts.write_bytes(data)
    from_file, from_stdin = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    run = flover_run(llama_dir, prompts, from_file, "--max-new-tokens", "2", "--quiet", "--ordered")
    assert run.returncode == 0, run.stderr
    records = read_records(from_file)
    assert [r["id"] for r in records] == ["1", "2", "3", "4"]  # the lone \r did not split line 3
    assert records[1]["error"]["code"] == "malformed_line"
    assert "line 2: not valid UTF-8 (byte 0xff at column 5)" in records[1]["error"]["message"]
    stdin = subprocess.run(
        [
            *CLI,
            "run",
            "--model",
            llama_dir,
            "--prompts",
            "-",
            "--format",
            "txt",
            "--out",
            str(from_stdin),
            "--max-new-tokens",
            "2",
            "--quiet",
            "--ordered",
            "--max-seq-len",
            "128",
        ],
        input=data,
        capture_output=True,
        timeout=120,
    )
    assert stdin.returncode == 0, stdin.stderr
    assert [(r["id"], r.get("text")) for r in read_records(from_stdin)] == [(r["id"], r.get("text")) for r in records]


@pytest.mark.parametrize("target", ["/dev/full", "/nonexistent-dir/out.jsonl"])
def test_an_unwritable_output_is_one_clear_line(llama_dir, tmp_path, target):
    prompts = tmp_path / "in.txt"
    prompts.write_text("hello\n")
    run = flover_run(llama_dir, prompts, target, "--max-new-tokens", "2", "--quiet", timeout=120)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    errors = [line for line in run.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and target in errors[0], run.stderr


def test_out_of_range_values_in_a_local_prompt_file_are_error_records(llama_dir, tmp_path):
    prompts, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(
        prompts,
        [
            {"id": "a", "input_ids": [1, 2], "top_k": 2**63, "temperature": 1.0},
            {"id": "b", "input_ids": [3, 4], "repetition_penalty": 2**63},
            {"id": "c", "input_ids": [5, 6], "ignore_eos": "false"},
            {"id": "d", "input_ids": [7, 8]},
        ],
    )
    run = flover_run(llama_dir, prompts, out, "--max-new-tokens", "3", "--quiet", "--ordered")
    assert run.returncode == 0, run.stderr
    records = read_records(out)
    assert [r.get("error", {}).get("code") for r in records] == ["invalid_request"] * 3 + [None]
    assert records[3]["usage"]["completion_tokens"] == 3


def test_a_frozen_daemon_ends_the_run_within_its_timeout(llama_dir, tmp_path):
    """SIGSTOP: the connection stays up but nothing (not even a keepalive) comes back."""
    prompts, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(prompts, [{"id": f"p{i}", "input_ids": [i + 1], "max_new_tokens": 400} for i in range(6)])
    server = Server(llama_dir, "--max-seq-len", "512", "--max-slots", "2")
    try:
        proc = subprocess.Popen(
            [
                *CLI,
                "run",
                "--connect",
                server.addr,
                "--prompts",
                str(prompts),
                "--out",
                str(out),
                "--ignore-eos",
                "--quiet",
                "--timeout",
                "3",
            ],
            stderr=subprocess.PIPE,
            text=True,
        )
        with server.client() as c:  # stop it once the run's requests are in flight
            deadline = time.time() + 60
            while c.stats()["in_flight"] == 0 and time.time() < deadline:
                time.sleep(0.05)
        server.proc.send_signal(signal.SIGSTOP)
        stopped = time.time()
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 3 and "no reply from the server for 3 s" in err, err
        assert time.time() - stopped < 10
    finally:
        server.proc.send_signal(signal.SIGCONT)
        assert server.stop()[0] == 0
