"""Host tensors in 2 MiB pages.

The native step streams every weight once per iteration and every live slot's keys and values
once per layer; with 4 KiB pages each of those pages costs a TLB miss (a page walk, nested under
a hypervisor). An anonymous mapping advised with MADV_HUGEPAGE gets 2 MiB pages wherever the
kernel's transparent huge pages are `madvise` or `always` (elsewhere the advice is ignored and
the memory is plain). Its pages are zero and only take memory when first touched.
"""

from __future__ import annotations

import math
import mmap

import torch

HUGE_PAGE = 2 << 20


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero CPU tensor of `shape` that starts on a 2 MiB boundary of its own mapping (the
    tensor holds the mapping: it is unmapped with the last view)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    # private: a shared anonymous mapping is shmem, which takes huge pages only if shmem does
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(region, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE  # the first 2 MiB boundary inside the mapping
    if hasattr(region, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        region.madvise(mmap.MADV_HUGEPAGE, start, nbytes)
    return whole[start: start + nbytes].view(dtype).view(shape)
