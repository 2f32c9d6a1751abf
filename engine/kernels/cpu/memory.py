"""Host memory backed by transparent huge pages, for the big tensors the CPU kernels stream.

A decode step reads every packed weight and, per layer, a few KV blocks scattered over a
large pool; with 4 KiB pages each block costs a TLB miss and a page walk (measured: one
layer's decode attention over 64 sequences ran 3x slower inside the engine, with 30
layers' KV pools, than on a single small pool). 2 MiB pages cover a block-sized pool
with a few hundred TLB entries. This machine's kernel hands out huge pages only to
regions that ask (`/sys/kernel/mm/transparent_hugepage/enabled` = madvise), so the
memory comes from an anonymous mapping with MADV_HUGEPAGE, aligned to 2 MiB. Where that
is unavailable, an ordinary tensor is returned.
"""
from __future__ import annotations

import math
import mmap

import torch

HUGE_PAGE = 2 << 20
MIN_BYTES = 2 << 20  # smaller tensors gain nothing


def huge_empty(nbytes: int, populate: bool = True) -> torch.Tensor:
    """A uint8 tensor of `nbytes` zeroed bytes whose start is 2 MiB aligned, in memory advised for huge pages.

    With `populate` every page is faulted in now, so the memory is held from the start; without it
    the pages stay unmapped until first touched (the kernel's zero-filled anonymous memory), so a
    caller that touches a fraction of a large buffer pays for that fraction only. The tensor keeps
    its mapping alive; the memory is returned when the tensor is freed."""
    if nbytes < MIN_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(nbytes, dtype=torch.uint8)
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE  # room to align the start
    try:
        mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mm.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError):
        return torch.zeros(nbytes, dtype=torch.uint8)
    buf = torch.frombuffer(mm, dtype=torch.uint8)
    off = (-buf.data_ptr()) % HUGE_PAGE
    out = buf[off: off + nbytes]
    if populate:
        out.zero_()  # fault every page in now (as torch.zeros would)
    return out


def huge_zeros(shape: tuple[int, ...], dtype: torch.dtype, populate: bool = True) -> torch.Tensor:
    """`torch.zeros(shape, dtype=dtype)` on the CPU, in huge-page memory (see `huge_empty`, which
    `populate` is passed to)."""
    n = math.prod(shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    return huge_empty(n * itemsize, populate).view(dtype).view(shape)
