"""Bounds for the whole suite: no distributed test hangs.

Every moebal process a test starts on its own (a `moebal train --nproc N` job's launcher and ranks, torchrun's
ranks) prints every thread's stack and exits once it has run MOEBAL_HANG_TIMEOUT_S seconds (moebal/cli.py), so
a hung job fails its test with the ranks' stacks in the job's stderr, before the tests' own 600 s subprocess
timeouts. `run_ranks` (moebal/dist/testing.py) has the ranks print their stacks when it gives up on them.
Set MOEBAL_HANG_TIMEOUT_S yourself to change the bound (0: none).
"""

from __future__ import annotations

import os

os.environ.setdefault("MOEBAL_HANG_TIMEOUT_S", "540")
if os.environ["MOEBAL_HANG_TIMEOUT_S"] in ("", "0"):
    del os.environ["MOEBAL_HANG_TIMEOUT_S"]
