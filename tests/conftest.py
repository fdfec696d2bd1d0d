"""Bounds for the whole suite: no distributed test hangs.

Every moebal process a test starts on its own (a `moebal train --nproc N` job's launcher and ranks, torchrun's
ranks) prints every thread's stack and exits once it has run MOEBAL_HANG_TIMEOUT_S seconds (moebal/cli.py), so
a hung job fails its test with the ranks' stacks in the job's stderr, before the tests' own 600 s subprocess
timeouts. `run_ranks` (moebal/distributed/testing.py) has the ranks print their stacks when it gives up on them.
Set MOEBAL_HANG_TIMEOUT_S yourself to change the bound (0: none).
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("MOEBAL_HANG_TIMEOUT_S", "540")
if os.environ["MOEBAL_HANG_TIMEOUT_S"] in ("", "0"):
    del os.environ["MOEBAL_HANG_TIMEOUT_S"]


@pytest.fixture
def one_thread():
    """Tiny tensors: one intra-op thread keeps a test fast on a shared machine (multi-threaded tiny ops wait for
    descheduled threads); a test of a threaded path sets its own count inside. Modules opt in with
    `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
