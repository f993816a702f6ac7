"""The soak's blast-radius classifier (`tooling.soak.blast`) on fabricated records: every
failure must be explained by an overlapping fault on a worker it used, a role-wide outage, its
own deadline or cancel, or a shed burst; anything else is unexplained."""

from __future__ import annotations

from dataclasses import replace

from tooling.soak.blast import DETECT_GRACE_S, classify, fault_windows
from tooling.soak.check import Verdict
from tooling.soak.client import Outcome
from tooling.soak.faults import FaultRecord
from tooling.soak.workload import PlannedRequest

ROLES = {"p0": "prefill", "p1": "prefill", "d0": "decode", "d1": "decode"}
PLAIN = PlannedRequest(0, 0.0, "greedy", (5, 6, 7))


def out(
    code: str, sent: float, ended: float, workers: tuple[str, ...] = (), **kw: object
) -> Outcome:
    o = Outcome(0, sent, 30.0, ended, code, "details", workers=list(workers))
    return replace(o, **kw)  # type: ignore[arg-type]


def one(
    o: Outcome, records: list[FaultRecord], r: PlannedRequest = PLAIN, verdict: str = "status"
) -> Verdict:
    return classify([r], [o], [Verdict(0, verdict)], records, ROLES)[0]


KILL_D0 = FaultRecord(1, "kill-decode", 10.0, "d0", detail="SIGKILL pid 9", rejoined_s=14.0)
STOP_P1 = FaultRecord(2, "stop", 20.0, "p1", 3.0, detail="SIGSTOP pid 8 for 3.0 s")
STOP_D1 = FaultRecord(3, "stop", 11.0, "d1", 2.0, detail="SIGSTOP pid 7 for 2.0 s")
REDIS = FaultRecord(4, "redis", 30.0, "redis", 2.0, detail="SIGKILL, down 2.0 s")


def test_windows_run_to_rejoin_or_resume_plus_grace() -> None:
    skipped = FaultRecord(5, "kill-prefill", 1.0, "p0", detail="skipped: no live process")
    lost = FaultRecord(6, "kill-prefill", 40.0, "p0", detail="SIGKILL pid 3")
    w = {x.index: x for x in fault_windows([KILL_D0, STOP_P1, REDIS, skipped, lost], 50.0)}
    assert set(w) == {1, 2, 6}  # Redis restarts and skipped faults explain nothing
    assert (w[1].start_s, w[1].end_s) == (10.0, 14.0 + DETECT_GRACE_S)
    assert (w[2].start_s, w[2].end_s) == (20.0, 23.0 + DETECT_GRACE_S)
    assert w[6].end_s == 50.0 + DETECT_GRACE_S  # never rejoined: until the end of the run


def test_fault_on_a_worker_it_used_and_in_time_explains() -> None:
    v = one(out("UNAVAILABLE", 9.0, 10.5, ("p0", "d0")), [KILL_D0])
    assert (v.category, v.detail) == ("explained", "UNAVAILABLE: fault 1 (kill-decode d0)")
    assert one(out("UNAVAILABLE", 14.5, 14.8, ("d0",)), [KILL_D0]).category == "explained"
    # the same failure on another worker, or long after the rejoin: unexplained
    assert one(out("UNAVAILABLE", 9.0, 10.5, ("p0", "d1")), [KILL_D0]).category == "unexplained"
    late = one(out("UNAVAILABLE", 16.0, 16.2, ("p0", "d0")), [KILL_D0])
    assert late.category == "unexplained"
    assert "UNAVAILABLE at 16.00..16.20 s on p0, d0" in late.detail
    # a default-deadline expiry is a failure like any other
    assert one(out("DEADLINE_EXCEEDED", 0.0, 30.0, ("p1", "d0")), []).category == "unexplained"
    assert one(out("DEADLINE_EXCEEDED", 19.0, 24.0, ("p1", "d0")), [STOP_P1]).category == (
        "explained"
    )


def test_role_wide_outage_explains_requests_that_reached_no_worker() -> None:
    both = [KILL_D0, STOP_D1]  # d0 down 10..15, d1 11..14: no decode worker at 11..14
    v = one(out("UNAVAILABLE", 12.0, 12.1), both)
    assert v.detail == "UNAVAILABLE: outage of every decode worker"
    assert one(out("UNAVAILABLE", 12.0, 12.1), [KILL_D0]).category == "unexplained"  # d1 was up
    assert one(out("UNAVAILABLE", 8.0, 11.5), both).category == "explained"  # outage began inside


def test_own_deadline_and_cancel_and_nothing_else() -> None:
    storm = replace(PLAIN, kind="storm", timeout_s=0.025)
    assert one(out("DEADLINE_EXCEEDED", 5.0, 5.03), [], storm).detail == (
        "DEADLINE_EXCEEDED: own deadline"
    )
    cancelled = out("CANCELLED", 5.0, 5.1, client_cancelled=True)
    assert one(cancelled, []).detail == "CANCELLED: own cancel"
    # another request's deadline storm or Redis restart does not explain a failure
    assert one(out("UNAVAILABLE", 30.5, 31.0, ("p0", "d0")), [REDIS]).category == "unexplained"


def test_shed_only_in_a_burst_or_while_a_fault_holds_capacity() -> None:
    burst = replace(PLAIN, index=1, kind="burst", burst=0)
    reqs = [PLAIN, burst, replace(PLAIN, index=2)]
    outs = [
        out("RESOURCE_EXHAUSTED", 40.1, 40.1),  # while the burst runs
        replace(out("RESOURCE_EXHAUSTED", 40.0, 42.0), index=1),  # in the burst itself
        replace(out("RESOURCE_EXHAUSTED", 45.0, 45.0), index=2),  # nothing going on
    ]
    vs = classify(reqs, outs, [Verdict(i, "status") for i in range(3)], [], ROLES)
    assert [v.category for v in vs] == ["explained", "explained", "unexplained"]
    assert vs[0].detail == "RESOURCE_EXHAUSTED: shed in burst 0"
    v = one(out("RESOURCE_EXHAUSTED", 21.0, 21.0), [STOP_P1])
    assert v.detail == "RESOURCE_EXHAUSTED: shed during fault 2 (stop p1)"


def test_other_verdicts_pass_through() -> None:
    for cat in ("exact", "near_tie", "refused", "wrong", "hung", "unclear"):
        assert one(out("OK", 1.0, 2.0), [KILL_D0], verdict=cat).category == cat
