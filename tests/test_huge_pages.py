"""Host tensors in 2 MiB pages (flover/huge_pages.py): zeros, aligned, alive as long as a view is,
and backed by huge pages where the kernel's transparent huge pages allow them."""

import gc
from pathlib import Path

import pytest
import torch

from flover.huge_pages import HUGE_PAGE, huge_page_zeros
from flover.kv_buffer import SlotBuffer


def thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "unknown"
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else "unknown"


def anon_huge_kib(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds `address` (from smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def test_zeros_aligned_and_writable():
    t = huge_page_zeros((3, 5, 7), torch.bfloat16)
    assert t.shape == (3, 5, 7) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE == 0
    assert torch.count_nonzero(t) == 0
    t[1, 2, 3] = 4.0
    assert t.float().sum() == 4.0
    assert huge_page_zeros((0, 4), torch.float32).shape == (0, 4)


def test_a_view_keeps_the_mapping():
    view = huge_page_zeros((1 << 20,), torch.float32)[10:20]
    gc.collect()
    view += 1  # would fault if the mapping had gone with the parent tensor
    assert view.sum() == 10


@pytest.mark.skipif(thp_mode() not in ("madvise", "always"),
                    reason=f"transparent huge pages are {thp_mode()!r} here: the advice has no effect")
def test_backed_by_huge_pages():
    t = huge_page_zeros((4 * HUGE_PAGE,), torch.uint8)
    t.fill_(1)  # pages are taken on first touch
    assert anon_huge_kib(t.data_ptr()) >= 2048


@pytest.mark.skipif(thp_mode() not in ("madvise", "always"),
                    reason=f"transparent huge pages are {thp_mode()!r} here: the advice has no effect")
def test_kv_cache_is_in_huge_pages_and_zero():
    buf = SlotBuffer(num_layers=2, max_slots=4, kv_heads=2, max_seq_len=512, head_dim=64,
                     dtype=torch.float32, device=torch.device("cpu"))
    assert torch.count_nonzero(buf.kv) == 0
    assert anon_huge_kib(buf.kv.data_ptr()) >= 2048  # touched (zeroed) at creation, in 2 MiB pages
