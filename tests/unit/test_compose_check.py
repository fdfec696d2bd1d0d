"""scripts/compose_check.py: its draws name real options with valid values, and its verdicts."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time

import pytest

from moebal.config import load
from moebal.errors import ConfigError
from tests.cli_util import load_script


@pytest.fixture(scope="module")
def script():
    return load_script("compose_check")


def test_every_draw_names_real_options_and_most_pass_the_config_check(script, tmp_path):
    rng, accepted = random.Random(0), 0
    for _ in range(200):
        case = script.sample(rng)
        case["hf.init_from"] = None  # the draw's own checkpoint (`hf_base`), made when a case runs; its shape is TINY's
        argv = script.train_argv(case, tmp_path / "x", 3)
        overrides = argv[argv.index("--nproc") + 2:]  # TINY and the case's options
        overrides.append(f"parallel.nproc={case['nproc']}")
        try:
            load(None, overrides)
            accepted += 1
        except ConfigError as e:  # a refusal by design is fine; a key or value the schema does not know is not
            assert "unknown key" not in str(e) and "must be one of" not in str(e), str(e)
    assert accepted >= 150, accepted  # sample() sets aside the pairs the config check refuses


def test_fixed_options_hold_where_the_config_allows_and_the_rest_is_the_seed_s_draw(script):
    free = script.sample(random.Random(3))
    fixed = script.parse_fixed(["model.tie_embeddings=true", "parallel.pp=2", "nproc=4"], pytest.fail)
    assert fixed == {"model.tie_embeddings": True, "parallel.pp": 2, "nproc": 4}
    case = script.sample(random.Random(3), fixed)
    assert case["nproc"] == 4 and case["parallel.pp"] == 2
    assert case["hf.init_from"] and not case["model.tie_embeddings"]  # a continuation takes the checkpoint's shape
    # tied stages are built under every sharding: the fixed value holds in 20 draws but for continuations
    cases = [script.sample(random.Random(3 + k), fixed) for k in range(20)]
    assert all(c["model.tie_embeddings"] for c in cases if not c["hf.init_from"])
    assert {c["parallel.shard"] for c in cases if not c["hf.init_from"]} == {"none", "optimizer", "full", "auto"}
    # and on a scheme's one fully sharded stage (its head a copy of its own)
    one = script.parse_fixed(["model.tie_embeddings=true", "parallel.pp=1", "parallel.shard=full",
                              "dynamism.scheme=freezing"], pytest.fail)
    cases = [script.sample(random.Random(3 + k), one) for k in range(10)]
    assert all(c["model.tie_embeddings"] and c["parallel.shard"] == "full" for c in cases if not c["hf.init_from"])
    assert case["moe.gate"] == free["moe.gate"] and case["moe.top_k"] == free["moe.top_k"]
    errors = []
    script.parse_fixed(["model.tie_embedings=true", "parallel.pp=3", "nproc"], errors.append)
    assert errors[0].startswith("--fix model.tie_embedings=true: expected OPTION=VALUE with an option of the draw; "
                                "did you mean model.tie_embeddings?")
    assert errors[1] == "--fix parallel.pp=3: parallel.pp is drawn from [1, 2]"
    assert errors[2].startswith("--fix nproc: expected OPTION=VALUE")


def test_verdicts(script):
    assert script.verdict(0, "", "train") == "ok"
    assert script.verdict(2, "moebal train: error: a clear line\n", "train") == "refused"
    assert script.verdict(2, "moebal train: error: x\nmoebal: rank 0 failed (exit code 2); stopped", "train") == "BUG"
    assert script.verdict(1, "Traceback (most recent call last):\n", "train") == "BUG"
    assert script.verdict("timeout", "", "train") == "BUG"


def test_the_served_loss_is_checked_where_serving_is_the_validation_s_computation(script):
    case = {"eval.top_k1": False, "moe.capacity_factor": None, "train.precision": "fp32"}
    assert script.served_tolerance(case) == 1e-5
    assert script.served_tolerance({**case, "train.precision": "bf16"}) == 1e-3  # served under bf16 autocast too
    assert script.served_tolerance({**case, "eval.top_k1": True}) is None  # another model than the trained top-k
    assert script.served_tolerance({**case, "moe.capacity_factor": 1.25}) is None  # drops per the trainer's groups


def test_the_kill_verdict_asks_for_a_restart_the_same_losses_and_no_process_left(script):
    assert script.kill_verdict(True, 0, True, True, 0) == "ok"
    assert script.kill_verdict(True, 0, False, True, 0) == "BUG"  # exit 0 without a restart: the kill missed a rank
    assert script.kill_verdict(True, 0, True, False, 0) == "BUG"  # other losses than the uninterrupted run's
    assert script.kill_verdict(True, 0, True, True, 1) == "BUG"  # a process of the job outlived it
    assert script.kill_verdict(True, 1, True, True, 0) == "BUG"
    assert script.kill_verdict(False, 0, False, True, 0) == "unkilled"  # the run ended first: nothing tested
    assert script.kill_verdict(False, "timeout", False, False, 0) == "BUG"


def test_a_job_s_processes_are_found_by_its_marker(script):
    marker = f"{script.MARKER}=test{os.getpid()}"
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            env={**os.environ, script.MARKER: marker.partition("=")[2]})
    try:
        deadline = time.monotonic() + 10
        while proc.pid not in script.job_processes(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert script.job_processes(marker) == [proc.pid]
    finally:
        proc.kill()
        proc.wait()
    assert script.job_processes(marker) == []


def test_the_launch_leg_s_cluster_file_splits_the_case_s_ranks_over_two_local_nodes(script, tmp_path):
    import yaml

    from moebal.launch.cluster import flatten_overrides, load_cluster

    case = script.sample(random.Random(5), {"nproc": 4, "parallel.pp": 2})
    case["hf.init_from"] = None
    spec = tmp_path / "cluster.yaml"
    spec.write_text(yaml.safe_dump(script.cluster_file(case, tmp_path / "run", 29999, f"{script.MARKER}=x")))
    c = load_cluster(spec)  # the launcher's own checks of the file
    assert [n.slots for n in c.nodes] == [2, 2] and c.endpoint == "127.0.0.1:29999"
    assert c.ssh.command == "sh -c {command}" and c.env == {script.MARKER: "x"}
    overrides = flatten_overrides(c.train.overrides)
    assert overrides["train.steps"] == 3 and overrides["parallel.pp"] == 2 and overrides["model.dim"] == 32
    assert overrides["dynamism.scheme"] == case["dynamism.scheme"]  # the case's options, typed as YAML reads them


def test_the_generate_leg_compares_the_cached_decoder_with_the_forward(script, tmp_path, monkeypatch):
    """`--generate` on a tiny run: `moebal generate` runs, the KV-cached decoder's logits match the forward's and a
    batch's rows the sequences alone (ok); a decoder whose logits drift by 1e-2 is a bug, and so is a batch whose
    padding is a key."""
    from tests.cli_util import run_cli
    from tests.unit.test_train import TINY

    out = tmp_path / "run"
    tiny = [x for x in TINY if not x.startswith(("train.steps=", "train.ckpt_every="))]
    assert run_cli("train", "--out", str(out), *tiny, "train.steps=2", "train.ckpt_every=2",
                   "parallel.nproc=1").returncode == 0
    row, err = script.generate_check(out, 120.0)
    assert row["verdict"] == "ok" and row["cache"] and row["logits_diff"] < 1e-5 and row["argmax_gap"] == 0, (row, err)
    assert row["batch_diff"] < 1e-5, row
    # expert parallelism on 2 ranks (4 experts): the oracle's tokens equal static's and one process's
    assert row["ep"]["verdict"] == "ok" and row["ep"]["equal_static"] and row["ep"]["equal_one_process"], row
    assert row["ep"]["argmax_gap"] <= 1e-4, row
    real_run = script.run

    def wrong_tokens(argv, timeout, stdout=None, env=None):  # the expert-parallel run's first token off by one
        rc, err = real_run(argv, timeout, stdout, env)
        if "--nproc" in argv and stdout:
            lines = [json.loads(line) for line in stdout[-1].strip().splitlines()]
            lines[0]["tokens"][0] = (lines[0]["tokens"][0] + 1) % 256
            stdout[-1] = "\n".join(json.dumps(x) for x in lines)
        return rc, err

    with monkeypatch.context() as m:
        m.setattr(script, "run", wrong_tokens)
        bad, err = script.expert_parallel_check(out, 120.0, {**row, "ep": None})
    assert bad["verdict"] == "BUG" and "expert-parallel generation" in err and bad["ep"]["argmax_gap"] > 1e-4, bad

    import moebal.models.generate as gen

    real = gen.cached_forward
    with monkeypatch.context() as m:
        m.setattr(gen, "cached_forward", lambda *a: real(*a) + 1e-2)
        row, err = script.generate_check(out, 120.0)
    assert row["verdict"] == "BUG" and "of the largest away from the forward's" in err, row
    mask = gen.query_mask
    monkeypatch.setattr(gen, "query_mask", lambda start, new, window, device, pad_B=None: mask(start, new, window,
                                                                                                device))
    row, err = script.generate_check(out, 120.0)
    assert row["verdict"] == "BUG" and row["batch_diff"] > 1e-3 and row["logits_diff"] < 1e-5, row
