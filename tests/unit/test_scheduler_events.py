"""The scheduler's event log: step summaries, the order check, the Chrome trace, the dashboard panel."""

from __future__ import annotations

import json

import pytest

from moebal.scheduler.events import EventLog, check_order, chrome_trace, step_record
from moebal.train.dashboard import write_dashboard


def _log() -> EventLog:
    log = EventLog(rank=1)
    log.begin(7)
    t0 = log.t0
    a = log.event("a2a", "L0 dispatch0", 1000, layer=0, chunk=0)
    a.queued, a.started, a.finished = t0 + 0.0, t0 + 0.0, t0 + 1.0
    b = log.event("a2a", "L0 dispatch1", 1000, layer=0, chunk=1)
    b.queued, b.started, b.finished = t0 + 0.0, t0 + 0.0, t0 + 2.0
    r = log.event("allreduce", "dp_ep allreduce 0", 4000, chunk=0)
    r.queued, r.started, r.finished = t0 + 1.5, t0 + 2.5, t0 + 3.0
    t = log.event("trans", "L0 trans", 500, layer=0)
    t.queued, t.started, t.finished = t0 - 0.5, t0 - 0.5, t0 + 0.2
    log.span("compute", "L0 experts0", t0 + 1.0, t0 + 1.8)
    log.span("blocked", "L0 dispatch0", t0 + 0.0, t0 + 1.0)
    log.span("blocked", "L0 dispatch1", t0 + 0.5, t0 + 2.0)  # nested waits count once
    log.span("compute", "optimizer", t0 + 3.5, t0 + 4.0)
    return log


def test_step_summary_counts_waits_once_and_subtracts_hidden_transfers():
    c = _log().end()
    assert c.exposed_s == pytest.approx(2.0)
    # all-to-all in flight 0..2, experts computed 1..1.8 under it: 1.2 s on the critical path
    assert c.a2a_s == pytest.approx(1.2)
    assert c.allreduce_s == pytest.approx(0.5)
    assert c.a2a_shared_s == 0.0  # the chunk started after the last all-to-all finished
    assert c.collectives == 4 and c.bytes == 6500


def test_shared_link_time_is_the_overlap_of_all_to_alls_and_gradient_chunks():
    log = _log()
    t0 = log.t0
    for start, end in ((t0 + 1.6, t0 + 2.4), (t0 + 1.9, t0 + 2.2)):  # concurrent chunks count once
        r = log.event("allreduce", "dp_ep allreduce 1", 4000, chunk=1)
        r.queued, r.started, r.finished = start, start, end
    c = log.end()
    assert c.a2a_shared_s == pytest.approx(0.4)  # all-to-all until 2.0, chunks from 1.6
    assert c.allreduce_s == pytest.approx(0.8 + 0.5)


def test_check_order_accepts_lina_and_names_violations():
    rec = step_record(_log().end(), rank=1)
    check_order(rec, lina=True)
    bad = json.loads(json.dumps(rec))
    bad["events"][2]["started"] = 1.9  # a chunk issued while dispatch1 was still in flight
    with pytest.raises(AssertionError, match="allreduce 0 started"):
        check_order(bad, lina=True)
    check_order(bad, lina=False)  # the unscheduled modes promise no such thing
    late = json.loads(json.dumps(rec))
    late["events"][3]["finished"] = 1.5  # Trans after the layer's experts started
    with pytest.raises(AssertionError, match="L0 trans"):
        check_order(late)


def test_chrome_trace_has_a_track_per_kind_and_ranks_aligned():
    r1 = step_record(_log().end(), rank=1)
    r0 = dict(r1, rank=0, t0=r1["t0"] - 0.25)
    trace = chrome_trace([r0, r1])
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in xs} == {0, 1}
    assert {e["cat"] for e in xs} >= {"a2a", "allreduce", "trans", "blocked", "compute"}
    first = min(e["ts"] for e in xs if e["pid"] == 1 and e["name"] == "L0 dispatch0")
    assert first == pytest.approx(0.25e6)  # rank 1's clock starts 0.25 s after rank 0's


def test_dashboard_draws_the_communication_panel(tmp_path):
    recs = [{"step": i, "loss": 5.0 - 0.1 * i, "exposed_comm_s": 0.02, "a2a_s": 0.01, "allreduce_s": 0.005,
             "placement_comm_s": 0.0, "comm_window_s": 0.06} for i in range(1, 6)]
    out = write_dashboard(recs, tmp_path / "d.svg")
    text = out.read_text()
    assert "communication (mean over ranks)" in text and "exposed communication" in text
    # the loss twice (raw and smoothed), then the five communication series
    assert text.count("<polyline") == 2 + 5
