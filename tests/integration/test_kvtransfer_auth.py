"""The KV rendezvous closed by the cluster secret: only signed records count.

A prefill and a decode `TorchDistTransport` in this process share a `RecordSeal` (real gloo
pairs over 127.0.0.1, shared memory on). Peers without the secret — another process speaking
to the decode worker's store directly, and a transport holding another cluster's secret — try
to join, announce and cancel: every record is refused, and the real pair's transfers still
arrive intact.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from kvtransfer import rendezvous as rdv
from kvtransfer.torch_dist import TorchDistTransport
from kvtransfer.types import new_ticket
from security.kvseal import RecordSeal
from security.secret import ClusterSecret
from tests.integration.test_kvtransfer_contract import (
    BLOCKS,
    LAYERS,
    LONG,
    assert_same_kv,
    drive,
    make_cache,
    transfer,
)

# What a peer without the secret can do with the store: push records of its own making (a
# join offering a fake shared cache, an announce and a cancel naming a live transfer, a join
# signed with a made-up key) and read the verdicts. Runs in its own process.
ATTACKER = textwrap.dedent(
    """
    import json, sys
    from datetime import timedelta
    from torch._C._distributed_c10d import TCPStore
    host, port, layout, transfer_id, epoch = json.loads(sys.argv[1])
    store = TCPStore(host, port, is_master=False, wait_for_workers=False,
                     timeout=timedelta(seconds=20))
    offer = {"pid": 1, "fd": 3, "boot_id": "x", "token": "00", "shape": [1], "itemsize": 4}
    records = [
        {"kind": "join", "sender": "evil", "gen": 1, "layout": layout, "shm": offer},
        {"kind": "join", "sender": "evil", "gen": 2, "layout": layout, "mac": "00" * 32},
        {"kind": "xfer", "sender": "prefill-0", "gen": 1, "transfer_id": transfer_id,
         "epoch": epoch, "tag": 7, "num_tokens": 4, "timeout_ms": 5000},
        {"kind": "cancel", "sender": "prefill-0", "transfer_id": transfer_id, "epoch": epoch},
        {"kind": "stop"},
    ]
    for rec in records:
        store.queue_push("kvx/ctl", json.dumps(rec))
    verdicts = {}
    for gen in (1, 2):
        key = f"kvx/join/evil/{gen}"
        store.wait([key], timedelta(seconds=20))
        verdicts[gen] = store.get(key).decode()
    print(json.dumps(verdicts))
    """
)


@pytest.fixture
def pair() -> tuple[TorchDistTransport, TorchDistTransport, RecordSeal]:
    seal = RecordSeal(ClusterSecret.generate())
    kw = {"connect_timeout_s": LONG, "shared_memory": True, "seal": seal}
    sender = TorchDistTransport(make_cache(1), "prefill-0", **kw)  # type: ignore[arg-type]
    receiver = TorchDistTransport(make_cache(None), "decode-0", **kw)  # type: ignore[arg-type]
    yield sender, receiver, seal
    sender.close()
    receiver.close()


def test_records_are_signed_and_the_offer_is_sealed() -> None:
    seal = RecordSeal(ClusterSecret.generate())
    layout = make_cache(None).layout
    offer = {"pid": 42, "fd": 7, "boot_id": "b", "token": "ab" * 16, "shape": [1], "itemsize": 4}
    text = rdv.join_record("p", 3, layout, offer, seal)
    assert '"pid"' not in text and "ab" * 16 not in text  # the offer is not readable
    assert rdv.decode(text, seal)["shm"] == offer
    for forged in (
        text.replace('"gen":3', '"gen":4'),  # contents changed after signing
        rdv.join_record("p", 3, layout, offer, RecordSeal(ClusterSecret.generate())),
        rdv.join_record("p", 3, layout, offer),  # not signed at all
    ):
        with pytest.raises(rdv.RecordRejected):
            rdv.decode(forged, seal)
    verdict = rdv.verdict_text(rdv.JOIN_OK_SHM, "p", 3, seal)
    assert rdv.read_verdict(verdict.encode(), "p", 3, seal) == rdv.JOIN_OK_SHM
    assert rdv.read_verdict(verdict.encode(), "p", 4, seal) == rdv.UNSIGNED_VERDICT
    assert rdv.read_verdict(b"ok", "p", 3, seal) == rdv.UNSIGNED_VERDICT
    assert rdv.pair_prefix("p", 3, seal) != rdv.pair_prefix("p", 3)
    assert "p/3" not in rdv.pair_prefix("p", 3, seal)


def test_peers_without_the_secret_cannot_join_announce_or_cancel(
    pair: tuple[TorchDistTransport, TorchDistTransport, RecordSeal],
) -> None:
    sender, receiver, _ = pair
    src, dst = list(range(0, 6)), list(range(10, 16))
    ticket = transfer(sender, receiver, src, dst, 6 * 4)  # connects the real pair, shm on
    assert all(r.ok for r in drive([sender, receiver], 2))
    assert sender.shared_memory_peers() == ["decode-0"]

    # A live transfer the attacker will try to hijack and cancel.
    live = new_ticket(receiver.endpoint, receiver.layout, "req", [20, 21], 8, LONG)
    receiver.expect(live)
    ep = receiver.endpoint
    args = [ep.host, ep.port, json.loads(rdv.join_record("x", 0, receiver.layout))["layout"]]
    out = subprocess.run(
        [sys.executable, "-c", ATTACKER, json.dumps([*args, live.transfer_id, live.epoch])],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    verdicts = json.loads(out.stdout)
    assert all(v.startswith("reject:") and "secret" in v for v in verdicts.values()), verdicts
    assert receiver.rejected_records == 5
    sender.open(live, [30, 31])
    for layer in range(LAYERS):
        sender.send_layer(live.transfer_id, layer)
    results = drive([sender, receiver], 2)
    assert all(r.ok for r in results), results  # not cancelled, not hijacked, not stopped
    assert_same_kv(sender._cache, [30, 31], receiver._cache, [20, 21])
    assert_same_kv(sender._cache, src, receiver._cache, dst)
    assert ticket.transfer_id != live.transfer_id


def test_a_transport_with_another_clusters_secret_is_refused(
    pair: tuple[TorchDistTransport, TorchDistTransport, RecordSeal],
) -> None:
    sender, receiver, _ = pair
    stranger = TorchDistTransport(
        make_cache(2),
        "prefill-9",
        connect_timeout_s=LONG,
        seal=RecordSeal(ClusterSecret.generate()),
    )
    try:
        transfer(stranger, receiver, [1, 2], [BLOCKS - 4, BLOCKS - 3], 8)
        results = drive([stranger, receiver], 1)  # the stranger's send fails at its join
        assert not results[0].ok and "secret" in (results[0].error or ""), results
        assert receiver.rejected_records >= 1
        receiver.cancel(next(iter(receiver._recvs)))  # the receiver's side gives up too
        assert not drive([receiver], 1)[0].ok
    finally:
        stranger.close()
    transfer(sender, receiver, [3, 4], [BLOCKS - 2, BLOCKS - 1], 8)
    assert all(r.ok for r in drive([sender, receiver], 2))
    assert_same_kv(sender._cache, [3, 4], receiver._cache, [BLOCKS - 2, BLOCKS - 1])
