"""The prefix cache on disk (engine/prefix_disk.py): blocks written as they are stored, found by a
later engine of the same model, dtype and layout (exactly the tokens a run without any cache
gives), and every bad file (truncated, changed, another model's) ignored with one warning."""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest

from flover.config import EngineConfig, SamplingParams
from flover.engine.engine import LLM, Engine
from flover.engine.prefix_cache import PrefixCache
from flover.engine.prefix_disk import PrefixDisk, chain_key
from tests.helpers import Server, flover_run_ok

GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True)


def conversations(seed: int, count: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(40, 90))] for _ in range(count)]


def engine_options(directory, dtype: str = "float64", **more) -> dict:
    return dict(
        dtype=dtype,
        max_slots=3,
        max_seq_len=256,
        max_batch_tokens=64,
        speculate=0,
        prefix_cache_dir=str(directory),
        **more,
    )


def tokens_of(outputs) -> list[list[int]]:
    return [list(o.token_ids) for o in outputs]


def run_without_cache(model: str, prompts, dtype: str = "float64") -> list[list[int]]:
    options = engine_options(None, dtype, prefix_cache_mib=0)
    del options["prefix_cache_dir"]
    return tokens_of(LLM(model, **options).generate(prompts, GREEDY))


@pytest.mark.parametrize("variant,dtype", [("llama", "float64"), ("llama", "bfloat16"), ("gemma3", "float64")])
def test_a_restarted_engine_starts_the_next_turns_from_the_blocks_on_disk(make_model, tmp_path, variant, dtype):
    """Three conversations' first turns in one engine, shut down; a new engine on the same
    directory takes the next turns' resent history from disk (float64: the PyTorch forward;
    bfloat16: the native step; Gemma 3's sliding-window layers: blocks saved partial before a
    slot's window) and gives exactly the tokens of an engine without any cache."""
    model = make_model(variant)
    first = conversations(0)
    before = LLM(model, **engine_options(tmp_path, dtype))
    answers = before.generate(first, GREEDY)
    before.engine.shutdown()
    files = list(tmp_path.glob("*/*.block"))
    assert len(files) == sum((len(p) + 6 - 1) // 16 for p in first)  # every whole block of every sequence

    turns = [p + list(a.token_ids) + [7, 8, 9] for p, a in zip(first, answers)]
    after = LLM(model, **engine_options(tmp_path, dtype))
    got = after.generate(turns, GREEDY)
    stats = after.engine.stats().prefix_cache
    assert stats["disk_hits"] == 3 and stats["disk_files_ignored"] == 0
    assert [o.cached_tokens for o in got] == [(len(p) + 6 - 1) // 16 * 16 for p in first]
    assert tokens_of(got) == run_without_cache(model, turns, dtype)


@pytest.mark.parametrize("damage", ["truncated", "changed", "another model's"])
def test_a_bad_cache_file_is_ignored_with_a_warning_and_never_read(llama_dir, tmp_path, caplog, damage):
    """Each way a file can be wrong: the next engine reads no block of it (no hit, nothing in the
    pool), warns once per file, deletes it, and computes the prompt's tokens as without a cache."""
    prompt = conversations(1, 1)
    writer_dir = tmp_path / "other" if damage == "another model's" else tmp_path
    writer = llama_dir
    if damage == "another model's":  # the same shapes, another model: its norms' epsilon differs
        writer = shutil.copytree(llama_dir, tmp_path / "model-b")
        config = json.loads((writer / "config.json").read_text())
        (writer / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-3}))
    LLM(writer, **engine_options(writer_dir)).engine.shutdown()  # (an empty directory of its own)
    before = LLM(writer, **engine_options(writer_dir))
    before.generate(prompt, GREEDY)
    before.engine.shutdown()
    files = sorted(writer_dir.glob("*/*.block"))
    assert files
    if damage == "another model's":  # one of its files where this model's engine looks first
        probe = Engine(EngineConfig(llama_dir, **engine_options(tmp_path)))
        disk = probe.prefix_cache.disk
        files = [files[0].rename(disk.dir / f"{chain_key(disk.root(None), prompt[0][:16]).hex()}.block")]
        probe.shutdown()
    for f in files:
        data = bytearray(f.read_bytes())
        if damage == "truncated":
            data = data[: len(data) // 2]
        elif damage == "changed":
            data[len(data) // 2] ^= 1
        f.write_bytes(bytes(data))
    caplog.set_level(logging.WARNING)
    after = LLM(llama_dir, **engine_options(tmp_path))
    got = after.generate(prompt, GREEDY)
    stats = after.engine.stats().prefix_cache
    assert got[0].cached_tokens == 0 and stats["disk_blocks_read"] == 0 and stats["disk_hits"] == 0
    warned = [r.getMessage() for r in caplog.records if "ignoring" in r.getMessage()]
    assert len(warned) == 1  # (the chain stops at its first block, deleted, then written anew from this run)
    reason = {"truncated": "truncated", "changed": "checksum", "another model's": "another model"}[damage]
    assert reason in warned[0], warned
    assert tokens_of(got) == run_without_cache(llama_dir, prompt)


def test_recurrent_layers_resume_from_a_state_snapshot_on_disk(make_model, tmp_path):
    """Qwen3.5's Gated DeltaNet layers keep a state, not KV: the prompt's last block edge carries
    a snapshot of it, written beside its block; the next engine resumes there."""
    model = make_model("qwen3_5")
    first = conversations(2, 2)
    before = LLM(model, **engine_options(tmp_path, "float32"))
    answers = before.generate(first, GREEDY)
    before.engine.shutdown()
    assert list(tmp_path.glob("*/*.state"))
    turns = [p + list(a.token_ids) + [5, 6] for p, a in zip(first, answers)]
    after = LLM(model, **engine_options(tmp_path, "float32"))
    got = after.generate(turns, GREEDY)
    stats = after.engine.stats().prefix_cache
    assert stats["disk_hits"] == 2 and stats["disk_states_read"] >= 2
    assert all(o.cached_tokens > 0 for o in got)
    assert tokens_of(got) == run_without_cache(model, turns, "float32")


def test_the_directory_keeps_its_bound_least_recently_used_first(tmp_path):
    """Files past the byte bound go oldest first, where a read makes a file the newest; a new
    process finds the survivors in the same order."""
    fingerprint, payload = bytes(32), bytes(1000)
    disk = PrefixDisk(tmp_path, fingerprint, max_bytes=3 * 1200)
    keys = []
    for n in range(3):
        previous = disk.root(None)
        keys.append(chain_key(previous, [n] * 16))
        disk.write_block(keys[-1], previous, [n] * 16, True, payload)
        disk.flush()
    assert disk.read_block(keys[0], disk.root(None), [0] * 16, len(payload)).payload == payload
    previous = disk.root(None)
    disk.write_block(chain_key(previous, [9] * 16), previous, [9] * 16, True, payload)
    disk.flush()
    assert disk.files == 3 and not disk.has(keys[1]) and disk.has(keys[0]) and disk.has(keys[2])
    assert disk.nbytes == sum(f.stat().st_size for f in disk.dir.iterdir()) <= 3 * 1200
    disk.close()
    again = PrefixDisk(tmp_path, fingerprint, max_bytes=2 * 1200)  # a smaller bound: the oldest goes
    assert again.files == 2 and not again.has(keys[2]) and again.has(keys[0])
    again.close()


def test_writes_wait_for_the_writer_within_a_bound_and_the_rest_are_counted(tmp_path):
    disk = PrefixDisk(tmp_path, bytes(32), max_bytes=2**30, queue_bytes=2500)
    previous = disk.root("salt")
    for n in range(40):
        disk.write_block(chain_key(previous, [n]), previous, [n], True, bytes(1000))
    disk.close()
    assert disk.stats.blocks_written + disk.stats.writes_dropped == 40 and disk.files == disk.stats.blocks_written
    assert not [p for p in Path(disk.dir).iterdir() if ".tmp-" in p.name]


def test_the_disk_is_refused_beside_other_ranks_and_said_unused_without_a_cache(llama_dir, tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    engine = Engine(EngineConfig(llama_dir, **engine_options(tmp_path, prefix_cache_mib=0)))
    assert engine.prefix_cache is None and "not used, the prefix cache is off" in caplog.text
    assert not os.listdir(tmp_path)
    with pytest.raises(ValueError, match="one rank only"):  # (a tensor-parallel pair's leader, before any message)
        Engine(EngineConfig(llama_dir, **engine_options(tmp_path)), comm=SimpleNamespace(size=2, rank=0))
    with pytest.raises(ValueError, match="prefix_cache_disk_mib"):
        EngineConfig(llama_dir, prefix_cache_dir=str(tmp_path), prefix_cache_disk_mib=0).validate()


def test_flover_serve_restarted_on_its_directory_takes_a_repeated_prompt_from_disk(llama_dir, tmp_path):
    """A real daemon: SIGTERM drains it and its engine writes what it stored; the next daemon on
    the same directory reports the prompt's whole blocks cached (usage, stats, /metrics' source)."""
    prompt = [(11 * i) % 500 + 1 for i in range(70)]  # 4 whole blocks within the first 69 tokens
    first = Server(llama_dir, "--prefix-cache-dir", str(tmp_path))
    try:
        with first.client() as c:
            before = c.generate(input_ids=prompt, max_new_tokens=4, ignore_eos=True)
    finally:
        code, err = first.stop()
    assert code == 0, err
    second = Server(llama_dir, "--prefix-cache-dir", str(tmp_path))
    try:
        with second.client() as c:
            after = c.generate(input_ids=prompt, max_new_tokens=4, ignore_eos=True)
            stats = c.stats()
    finally:
        second.stop(signal.SIGKILL)
    assert before["usage"]["cached_tokens"] == 0 and after["usage"]["cached_tokens"] == 64
    assert after["token_ids"] == before["token_ids"]  # float64: the disk changes nothing
    cache = stats["prefix_cache"]
    assert cache["disk_hits"] == 1 and cache["disk_blocks_read"] == 4 and cache["disk_files"] >= 4
    assert stats["kv_bytes_per_token"] == cache["block_bytes"] // cache["block_tokens"]


def test_flover_run_again_on_the_same_directory_reads_the_prompts_blocks_from_disk(llama_dir, tmp_path):
    prompts = tmp_path / "in.jsonl"
    prompts.write_text(json.dumps({"id": "a", "input_ids": [(7 * i) % 500 + 1 for i in range(70)]}) + "\n")
    cache = ("--prefix-cache-dir", str(tmp_path / "cache"), "--max-new-tokens", "3")
    flover_run_ok(1, llama_dir, prompts, tmp_path / "one.jsonl", *cache)
    flover_run_ok(1, llama_dir, prompts, tmp_path / "two.jsonl", *cache)
    (one,) = map(json.loads, (tmp_path / "one.jsonl").read_text().splitlines())
    (two,) = map(json.loads, (tmp_path / "two.jsonl").read_text().splitlines())
    assert one["usage"]["cached_tokens"] == 0 and two["usage"]["cached_tokens"] == 64
    assert one["token_ids"] == two["token_ids"]


def test_a_block_read_from_disk_never_takes_a_row_this_plans_loads_read(tmp_path):
    """A full pool: one request's lookup loads rows from memory, the next one's reads blocks from
    disk; those bytes land before the loads run, so they may only take other rows (an evicted row
    that a load still reads would give the first request the second one's KV)."""
    disk = PrefixDisk(tmp_path, bytes(32), max_bytes=2**30)
    cache = PrefixCache(3, 16, disk=disk, nbytes=(8, 0))
    kept, stored = [1] * 16 + [2] * 16 + [0], [5] * 16 + [6] * 16 + [0]
    cache.store(kept, 32, slot=0)  # rows of the pool: kept's two blocks, one free
    previous = disk.root(None)
    for n in range(2):  # the other sequence's two blocks only on disk
        key = chain_key(previous, stored[16 * n : 16 * n + 16])
        disk.write_block(key, previous, stored[16 * n : 16 * n + 16], True, bytes([n]) * 8)
        previous = key
    disk.flush()
    cache.take_fills(), cache.take_writes()
    loads = cache.lookup(kept, 32, slot=1)
    assert len(loads) == 2
    assert len(cache.lookup(stored, 32, slot=2)) == 1  # the free row only: the others are loaded from
    fills, _ = cache.take_fills()
    assert [row for row, _ in fills] == [2] and not {c.block for c in loads} & {row for row, _ in fills}
    assert len(cache.lookup(stored, 32, slot=0)) == 2  # the next plan may evict them
    disk.close()
