"""The CUDA IPC plane between real processes on one GPU (`kvtransfer.cuda_ipc`): NCCL cannot
run two ranks on one device, so this is the only way two workers sharing a GPU move KV. The
workers are `tests.fakes.kv_workers` processes with their caches on the GPU and the same-host
plane on; every transfer must be exact (digest of the sender's blocks), the sender must report
the receiver as a same-host peer (no NCCL group was built), and every block must be free again.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.fakes.kv_workers import BLOCK, Peer, assert_all_free, check_exact, start_transfer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[Peer, Peer]]:
    d = Peer("decode", "d0", shm=True, device="cuda")
    p = Peer("prefill", "p0", seed=1, shm=True, device="cuda")
    for peer in (d, p):
        peer.wait_ready()
    yield d, p
    for peer in (d, p):
        peer.stop()


def test_transfers_on_one_gpu_are_exact_and_use_cuda_ipc(pair: tuple[Peer, Peer]):
    d, p = pair
    cases = [
        (1, [3]),
        (BLOCK, [9]),
        (7 * BLOCK + 2, [20, 5, 31, 2, 37, 8, 13, 30]),
        (3 * BLOCK, [10, 11, 12]),
    ]
    started = [
        (*start_transfer(d, p, n, src, ascending=k % 2 == 0),) for k, (n, src) in enumerate(cases)
    ]
    for tid, digest in started:
        check_exact(d, p, tid, digest)
    assert p.call("shm_peers", "shm_peers")["peers"] == ["d0"]
    assert_all_free(d, p)
