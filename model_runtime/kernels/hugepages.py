"""CPU tensors backed by 2 MB pages, for weights that a decode step streams end to end. Runs in
worker processes, when weights are packed.

A batch-1 decode step reads every weight once, ~60 thousand 4 KB pages for the `small` model in
bf16: each new page is a TLB miss and a page walk in the middle of a memory stream. Linux backs
an anonymous mapping with transparent huge pages where it is asked to (`madvise(MADV_HUGEPAGE)`,
the only way when `/sys/kernel/mm/transparent_hugepage/enabled` is `madvise`, as on the dev
host) before the pages are first touched. Measured there: the bf16 model's 49 GEMVs at batch 1
went from 17.6 to 15.7 ms of CPU with about half of their 233 MB on huge pages.

`empty_huge` over-allocates by 2 MB, advises the 2 MB-aligned part, and returns a view of it;
the slack before the aligned start is never touched, so it takes no memory. Where madvise is
missing or refused (not Linux, THP disabled) the tensor is an ordinary one: same contents, same
speed as before.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
from collections.abc import Callable

import torch

HUGE_PAGE = 2 * 1024 * 1024
_MADV_HUGEPAGE = 14  # Linux <sys/mman.h>
_MIN_BYTES = HUGE_PAGE  # smaller tensors gain nothing


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    path = ctypes.util.find_library("c")
    if path is None:
        return None
    fn = ctypes.CDLL(path, use_errno=True).madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    advise: Callable[[int, int, int], int] = fn
    return advise


def empty_huge(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor whose pages Linux is asked to back with 2 MB
    pages (see the module doc); an ordinary `torch.empty` where that cannot be asked."""
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    madvise = _madvise()
    if madvise is None or nbytes < _MIN_BYTES:
        return torch.empty(shape, dtype=dtype)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    start = (-raw.data_ptr()) % HUGE_PAGE
    advised = (nbytes + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
    advised = min(advised, nbytes + HUGE_PAGE - start) // 4096 * 4096
    madvise(raw.data_ptr() + start, advised, _MADV_HUGEPAGE)  # a refusal changes nothing else
    return raw[start : start + nbytes].view(dtype).view(shape)
