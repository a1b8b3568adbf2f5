"""The two-step shuffle: the planner alone, then the batched copy on real tensors."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flover.runner.kv_buffer import Move, SlotBuffer, kv_cache_bytes, plan_compaction


def random_occupancy(rng: random.Random, size: int) -> list[bool]:
    density = rng.random()
    return [rng.random() < density for _ in range(size)]


@pytest.mark.parametrize("seed", range(200))
def test_plan_is_minimal_disjoint_and_compacts(seed):
    rng = random.Random(seed)
    occupied = random_occupancy(rng, rng.randint(0, 40))
    live = sum(occupied)
    moves = plan_compaction(occupied)

    # fewest moves: exactly the live slots that lie beyond the target range must move
    assert len(moves) == sum(occupied[live:])
    srcs, dsts = [m.src for m in moves], [m.dst for m in moves]
    assert all(occupied[s] and s >= live for s in srcs)
    assert all(not occupied[d] and d < live for d in dsts)
    assert len(set(srcs)) == len(srcs) and len(set(dsts)) == len(dsts)
    assert not set(srcs) & set(dsts)  # no copy reads a slot another writes

    after = list(occupied)
    for m in moves:
        after[m.dst], after[m.src] = True, False
    assert after == [True] * live + [False] * (len(occupied) - live)


def test_plan_keeps_admission_order():
    # holes at 1 and 3; live slots 5 and 6 fill them in order
    occupied = [True, False, True, False, True, True, True]
    assert plan_compaction(occupied) == [Move(5, 1), Move(6, 3)]


@pytest.mark.parametrize("seed", range(20))
def test_apply_moves_preserves_every_live_request(seed):
    """After the batched copy every live request finds exactly its own KV rows and state."""
    rng = random.Random(seed)
    layers, slots, heads, seq, dim = 3, 12, 2, 8, 4
    buf = SlotBuffer(layers, slots, heads, seq, dim, torch.float64, torch.device("cpu"))
    length = buf.add_state("length", torch.int64)
    buf.kv.copy_(torch.randn_like(buf.kv))
    length.copy_(torch.randint(0, seq, (slots,)))
    occupied = random_occupancy(rng, slots)
    before = {s: (buf.kv[:, :, s].clone(), int(length[s])) for s in range(slots) if occupied[s]}

    moves = plan_compaction(occupied)
    buf.apply_moves(moves)

    new_slot = {s: s for s in before}
    for m in moves:
        new_slot[m.src] = m.dst
    assert sorted(new_slot.values()) == list(range(len(before)))
    for old, (rows, n) in before.items():
        assert torch.equal(buf.kv[:, :, new_slot[old]], rows)
        assert int(length[new_slot[old]]) == n


def resident_bytes_at(address: int) -> int:
    """Resident bytes of this process's mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("Rss:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


def test_host_kv_pages_are_taken_as_positions_are_written():
    """A fresh CPU KV cache is all zeros but resident only where stores wrote (here 1 of 32
    slots), so an idle server does not hold its whole capacity."""
    layers, slots, heads, seq, dim = 8, 32, 2, 512, 64  # 64 MiB of bfloat16
    buf = SlotBuffer(layers, slots, heads, seq, dim, torch.bfloat16, torch.device("cpu"))
    address = buf.kv.data_ptr()
    fresh = resident_bytes_at(address)  # the mapping may have merged with a neighbour's pages
    assert fresh < buf.nbytes // 8
    buf.kv[:, :, 0, :, :100] = 1.0  # slot 0 writes 100 positions
    taken = resident_bytes_at(address) - fresh
    assert buf.kv[:, :, 0, :, :100].numel() * 2 <= taken < buf.nbytes // 16
    assert int(torch.count_nonzero(buf.kv)) == layers * 2 * heads * 100 * dim  # zeros everywhere else


def test_moves_can_copy_only_the_used_positions():
    buf = SlotBuffer(2, 6, 1, 16, 2, torch.float64, torch.device("cpu"))
    buf.kv.copy_(torch.randn_like(buf.kv))
    before = buf.kv.clone()
    buf.apply_moves(plan_compaction([False, True, False, False, True, True]), positions=5)
    assert torch.equal(buf.kv[:, :, 0, :, :5], before[:, :, 4, :, :5])  # slot 4 -> hole 0
    assert torch.equal(buf.kv[:, :, 2, :, :5], before[:, :, 5, :, :5])  # slot 5 -> hole 2
    assert torch.equal(buf.kv[:, :, 1], before[:, :, 1])  # stayed
    assert torch.equal(buf.kv[:, :, 0, :, 5:], before[:, :, 0, :, 5:])  # positions past 5 not copied
    # what the metrics report: 2 moves of 2 layers x K,V x 1 head x 5 positions x 2 dims of float64
    assert (buf.moves_done, buf.bytes_moved) == (2, 2 * 2 * 2 * 1 * 5 * 2 * 8)


def test_refuses_when_memory_does_not_fit():
    need = kv_cache_bytes(1000, 1000, 64, 100000, 128, torch.float32)
    with pytest.raises(MemoryError, match=r"KV cache needs .* MiB"):
        SlotBuffer(1000, 1000, 64, 100000, 128, torch.float32, torch.device("cpu"))
    assert need > 2**40


def resident_kib() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux's /proc/self/status")
def test_a_prefaulted_pool_is_resident_from_the_start_and_a_lazy_one_is_not():
    pool_kib = 4 * 2 * 768 * 2 * 16 * 64 * 4 // 1024  # 48 MiB of prefix blocks; the KV itself is 0.5 MiB

    def grows_by(prefault: bool) -> int:
        """In a fresh process: in a long test run, freed memory that is still resident would be
        reused by the pool, and a prefaulted pool would not seem to grow the process."""
        code = (
            "import torch\nfrom flover.runner.kv_buffer import SlotBuffer\n"
            "from tests.test_kv_buffer import resident_kib\nbefore = resident_kib()\n"
            "buf = SlotBuffer(num_layers=4, max_slots=2, kv_heads=2, max_seq_len=64, head_dim=64, "
            "dtype=torch.float32, device=torch.device('cpu'), prefix_blocks=768, block_tokens=16, "
            f"prefault_pool={prefault})\n"
            "print(resident_kib() - before)\n"
        )
        run = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=Path(__file__).resolve().parent.parent,
        )
        assert run.returncode == 0, run.stderr
        return int(run.stdout.split()[-1])

    assert grows_by(True) >= pool_kib
    assert grows_by(False) < pool_kib // 4
