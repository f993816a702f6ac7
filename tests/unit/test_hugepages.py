"""`model_runtime.kernels.hugepages.empty_huge`: a usable tensor, 2 MB-aligned when large."""

from __future__ import annotations

import sys

import torch

from model_runtime.kernels.hugepages import HUGE_PAGE, empty_huge


def test_large_tensor_starts_on_a_huge_page_and_holds_data() -> None:
    t = empty_huge((3, 1000, 1000), torch.bfloat16)
    assert t.shape == (3, 1000, 1000) and t.dtype == torch.bfloat16 and t.is_contiguous()
    if sys.platform.startswith("linux"):
        assert t.data_ptr() % HUGE_PAGE == 0
    src = torch.randn(3, 1000, 1000).bfloat16()
    t.copy_(src)
    assert torch.equal(t, src)


def test_small_tensor_is_ordinary() -> None:
    t = empty_huge((7, 5), torch.float32)
    assert t.shape == (7, 5) and t.untyped_storage().nbytes() == 7 * 5 * 4
