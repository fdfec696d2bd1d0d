"""`run_ranks` reports the failure that caused the others, not whichever arrived first."""

from __future__ import annotations

import queue

from moebal.distributed.testing import _failures


def test_the_cause_is_listed_before_the_broken_connections_it_caused():
    q: queue.Queue = queue.Queue()
    q.put((2, False, "RuntimeError: Connection closed by peer"))
    q.put((0, True, "a result"))
    q.put((3, False, "AssertionError: a deferred weight gradient was never run"))
    text = _failures(q, 1, "RuntimeError: Read error: Connection reset by peer", grace_s=0.2)
    assert text.index("rank 3 failed") < text.index("rank 1 failed") < text.index("rank 2 failed")
    assert "rank 0" not in text and "AssertionError" in text
