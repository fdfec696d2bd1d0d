"""`moebal launch` for real on two "nodes": network namespaces on this machine joined by a veth pair, each with
its own address, meeting through torchrun's c10d rendezvous across the link.

A 2 x 2-rank expert-parallel job has one rank SIGKILLed after a checkpoint; torchrun restarts every rank
(`max_restarts: 1`), they resume from the checkpoint, and the whole run's losses equal those of the same job
run uninterrupted on one node (`moebal train --nproc 4`), bit for bit. Its log lines carry node and rank.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from moebal.distributed.testing import kill_rank_when
from moebal.launch.netns import NamespacePair, unavailable
from tests.cli_util import run_cli

REASON = unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"the two-node launch test needs network namespaces: "
                                                           f"{REASON}")
TINY = {"model": {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 96},
        "moe": {"num_experts": 4, "expert_ffn_dim": 64},
        "data": {"seq_len": 64, "batch_size": 4, "max_bytes": 400000},
        "train": {"precision": "fp32", "eval_every": 4, "eval_batches": 2, "warmup_steps": 2, "ckpt_every": 4,
                  "threads": 1, "steps": 24, "seed": 0},
        "planner": {"costs": "a100"}}  # a profile: the two runs compared would measure different coefficients


def _flat(d: dict, prefix: str = "") -> list[str]:
    return [x for k, v in d.items() for x in (_flat(v, f"{prefix}{k}.") if isinstance(v, dict)
                                              else [f"{prefix}{k}={v}"])]


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def nodes():
    with NamespacePair(tag=str(os.getpid())) as pair:  # deleted (and emptied) however the test ends
        yield pair


@pytest.mark.slow
def test_two_namespace_nodes_survive_a_killed_rank_with_one_node_losses(tmp_path, nodes):
    ref = run_cli("train", "--nproc", "4", "--out", str(tmp_path / "ref"), *_flat(TINY))  # in this process
    assert ref.returncode == 0, ref.stderr[-2000:]
    marker = uuid.uuid4().hex
    cluster = {
        "name": "netns",
        "nodes": [{"host": ns, "addr": addr, "slots": 2} for ns, addr in zip(nodes.names, nodes.addrs)],
        "rendezvous": {"port": 29500, "join_timeout_s": 120},
        "env": {"GLOO_SOCKET_IFNAME": nodes.ifname, "MOEBAL_TEST_JOB": marker},
        "ssh": {"command": "ip netns exec {host} sh -c {command}", "stop_grace_s": 5},
        "max_restarts": 1,
        "train": {"overrides": TINY, "out": str(tmp_path / "run")},
    }
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump(cluster), encoding="utf-8")
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "moebal.cli", "launch", str(tmp_path / "cluster.yaml")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        kill_rank_when(lambda: (run / "ckpt-0000004").is_dir(),  # complete: every rank wrote its shard
                       rank=3, marker=f"MOEBAL_TEST_JOB={marker}", alive=lambda: proc.poll() is None)
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-4000:]
    a, b = _metrics(tmp_path / "ref"), _metrics(run)
    assert [x["step"] for x in b] == list(range(1, 25))
    assert [x["loss"] for x in b] == [x["loss"] for x in a]
    assert [x.get("val_loss") for x in b] == [x.get("val_loss") for x in a]
    assert len(re.findall(r"resumed at step \d+", err)) == 1  # rank 0 says so once, after the restart
    ranks: dict[str, set[int]] = {}
    for node, rank in re.findall(r"^\[(\S+)\] \[rank(\d+)\]: ", out + err, flags=re.M):
        ranks.setdefault(node, set()).add(int(rank))
    assert set(ranks) == set(nodes.names) and sorted(r for v in ranks.values() for r in v) == [0, 1, 2, 3]
