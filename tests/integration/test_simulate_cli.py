"""`moebal simulate` end to end (in-process: the CLI's own main)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from moebal.cli import main
from moebal.sim.routing import write_routing_log


def _json(capsys, argv: list[str]) -> dict:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_simulate_mixtral_json_and_trace(capsys, tmp_path) -> None:
    trace = tmp_path / "new folder" / "trace.json"  # a missing folder is made
    out = _json(capsys, ["simulate", "mixtral-8x7b", "--cluster", "h100-ndr400", "--ranks", "16", "--json",
                         "--trace", str(trace)])
    assert out["iteration_time_s"] > 0 and out["meta"]["ep"] == 8 and out["meta"]["dp"] == 8
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["pid"] for e in events if e["ph"] == "X"} == set(range(16))


@pytest.mark.parametrize("policy", ["static", "fastermoe", "prophet"])
def test_policies_run_on_llama_moe(capsys, policy: str) -> None:
    out = _json(capsys, ["simulate", "llama-moe-3.5b", "--cluster", "a100", "--ranks", "8", "--policy", policy,
                         "--seq-len", "1024", "--zipf", "1.2", "--json"])
    assert out["policy"] == policy and out["iteration_time_s"] > 0
    if policy == "static":
        assert out["placements"]["replicas"] == 0


def test_pipeline_and_lina_options(capsys) -> None:
    out = _json(capsys, ["simulate", "mixtral-8x7b", "--cluster", "h100", "--ranks", "32", "--pp", "4", "--lina",
                         "--schedule", "gpipe", "--seq-len", "1024", "--micro-batches", "8", "--micro-batch-size", "1",
                         "--json"])
    assert out["meta"]["micro_batches"] == 8 and out["meta"]["stage_layers"] == [8, 8, 8, 8]
    assert 0 < out["bubble_ratio"] < 1


def test_lina_with_the_fastermoe_policy_keeps_its_schedule(capsys) -> None:
    # --lina with --policy fastermoe handed SimSpec the MoE schedule twice (a TypeError)
    argv = ["simulate", "llama-moe-3.5b", "--cluster", "a100", "--ranks", "8", "--policy", "fastermoe",
            "--seq-len", "1024", "--json"]
    plain, lina = _json(capsys, argv), _json(capsys, [*argv, "--lina"])
    assert plain["meta"]["moe_schedule"] == lina["meta"]["moe_schedule"] == "fastermoe"
    assert lina["iteration_time_s"] != plain["iteration_time_s"]  # Lina's priority and chunking took part


def test_replayed_routing_log(capsys, tmp_path) -> None:
    rng = np.random.default_rng(0)
    log = tmp_path / "routing.jsonl"
    write_routing_log(log, [rng.integers(0, 100, size=(4, 2, 8)).astype(float) for _ in range(3)])
    out = _json(capsys, ["simulate", "--cluster", "a100", "--ranks", "8", "--ep", "8", "--routing", str(log),
                         "--policy", "prophet", "--json"])
    assert out["iteration_time_s"] > 0


def test_a_logged_step_replays_the_step_that_logged_it(capsys, tmp_path) -> None:
    # steps 10, 11, 12 of a log where only 11 is skewed: --step 11 replays 11 (it once replayed line 11 mod 3,
    # step 12), and the default is the log's second step, the first with a step before it
    uniform, skewed = np.full((4, 8, 8), 100.0), np.full((4, 8, 8), 100.0)
    skewed[..., 0] = 700.0
    log = tmp_path / "plans.jsonl"
    log.write_text("".join(json.dumps({"step": s, "counts": c.tolist()}) + "\n"
                           for s, c in ((10, uniform), (11, skewed), (12, uniform))))
    argv = ["simulate", "--cluster", "a100", "--ranks", "8", "--ep", "8", "--routing", str(log), "--json"]
    times = {k: _json(capsys, [*argv, *k])["iteration_time_s"] for k in ((), ("--step", "11"), ("--step", "12"))}
    assert times[()] == times[("--step", "11")] > times[("--step", "12")]
    for step, said in (("10", "step 10 is the routing log's first"), ("13", "step 13 is not in the routing log")):
        assert main([*argv, "--step", step]) == 2
        assert said in capsys.readouterr().err


def test_human_output(capsys) -> None:
    assert main(["simulate", "--cluster", "rtx3090", "--ranks", "4", "--ep", "4"]) == 0
    text = capsys.readouterr().out
    assert "iteration time" in text and "bubble ratio" in text


@pytest.mark.parametrize("argv, message", [
    (["--cluster", "h10"], "did you mean 'h100'"),
    (["--ranks", "12", "--ep", "8"], "must divide the data-parallel size"),
    (["--ranks", "6", "--ep", "3"], "--ep 3 does not divide the model's 8 experts: choose one of [1, 2, 4, 8]"),
    (["moe.top_kk=1"], "did you mean 'moe.top_k'"),
    (["--routing", "/nonexistent/routing.jsonl"], "cannot read it"),
    (["--ranks", "0"], "--ranks must be >= 1; got 0"),
    (["--ep", "0"], "--ep must be >= 1; got 0"),
    (["--micro-batches", "0"], "--micro-batches must be >= 1; got 0"),
    (["--seq-len", "0"], "--seq-len must be >= 1; got 0"),
    (["--zipf", "-1"], "must be >= 0; got -1.0"),
    (["--zipf", "nan"], "must be >= 0; got nan"),  # nan and inf once reached numpy's sampler (a traceback)
    (["--drift", "inf"], "must be >= 0; got 1.0, inf"),
    (["--ranks", "1", "--pp", "2"], "1 ranks cannot form 2 pipeline stages"),  # once a ZeroDivisionError
    (["--ranks", "3", "--pp", "4"], "3 ranks cannot form 4 pipeline stages"),
    (["--ep", "2", "parallel.ep=4"], "--ep and the override parallel.ep=4 both set parallel.ep: give one of them"),
    (["--trace", "/proc/no/such/t.json"], "--trace /proc/no/such/t.json: cannot make its folder"),
    (["--trace-ranks", "-1"], "--trace-ranks must be >= 0 (0: every rank); got -1"),
])
def test_bad_input_is_a_clear_error(capsys, argv: list[str], message: str) -> None:
    assert main(["simulate", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("table, message", [
    ({"efficiency_by_world": {"2": 0.0}}, "efficiency_by_world.2 must be > 0; got 0.0"),
    ({"efficiency_by_world": {"two": 0.5}}, "keys are group sizes (integers >= 1); got 'two'"),
    ({"latency_by_world": {"2": -1.0}}, "latency_by_world.2 must be >= 0 seconds; got -1.0"),
])
def test_a_profiles_per_group_size_tables_are_checked(capsys, tmp_path, table, message) -> None:
    # a zero efficiency divided by zero inside the engine, a word for a key failed int(), a negative latency
    # shortened the step; each is one line at load now
    import yaml

    from moebal.planner.hardware import PROFILE_DIR

    prof = yaml.safe_load((PROFILE_DIR / "a100.yaml").read_text())
    prof["collectives"] = {"all_to_all": table}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(prof))
    assert main(["simulate", "--cluster", str(path), "--ranks", "2", "--ep", "2"]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_calibrate_refits_recorded_timings_into_a_usable_profile(capsys, tmp_path, monkeypatch) -> None:
    """`moebal calibrate --from-records` (the fit without the minutes of measuring) writes a profile that
    `moebal simulate --cluster PATH` accepts."""
    rng = np.random.default_rng(0)
    gemm = [{"dtype": dt, "m": m, "n": n, "k": k, "s": (2 * m * n * k / rate + 1e-5) * rng.uniform(0.98, 1.02)}
            for dt, rate in (("fp32", 8e10), ("bf16", 3e11)) for m in (16, 256, 2048) for n, k in ((256, 256),
                                                                                                  (1024, 512))]
    coll = [{"kind": kind, "world": w, "bytes": b, "s": 2e-4 + b / 2e9}
            for kind in ("p2p", "all_to_all", "all_reduce", "broadcast") for w in (2, 3) for b in (65536, 1 << 20)]
    records = {"gemm": gemm, "memory": [{"op": "copy", "bytes": 1e7, "s": 5e-4}], "attention": [],
               "collective": coll, "experts": [], "optimizer": [{"params": 1 << 20, "tensors": 8, "s": 2e-3}],
               "overhead": [{"ops": 1, "s": 3e-5}, {"ops": 33, "s": 3.5e-4}]}
    rec_path, prof_path = tmp_path / "records.json", tmp_path / "local.yaml"
    rec_path.write_text(json.dumps(records))
    assert main(["calibrate", "--from-records", str(rec_path), "--out", str(prof_path)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["flops"]["fp32"] == pytest.approx(8e10, rel=0.1)
    out = _json(capsys, ["simulate", "--cluster", str(prof_path), "--ranks", "2", "--ep", "2", "--dtype", "fp32",
                         "--json"])
    assert out["meta"]["profile"] == "local" and out["iteration_time_s"] > 0
    from moebal.planner import hardware
    from moebal.planner.hardware import load_profile

    # records without their machine (an older calibrate's) say so; records with it name it, not this machine
    assert "the machine and settings it was measured with are not recorded" in load_profile(prof_path).source[0]
    taken = {"cpu": "Some CPU 9000", "logical_cores": 64, "threads": 4, "torch": "2.9.0", "date": "2026-01-02",
             "repeats": 5, "memory_bytes": 3e10}
    rec_path.write_text(json.dumps({**records, "meta": taken}))
    # without --out the profile goes where `--cluster NAME` looks for it
    monkeypatch.setattr(hardware, "PROFILE_DIR", tmp_path / "profiles")
    assert main(["calibrate", "--from-records", str(rec_path), "--name", "there"]) == 0
    capsys.readouterr()
    assert (tmp_path / "profiles" / "there.yaml").is_file()
    there = load_profile("there")
    assert there.source[0].startswith("measured by `moebal calibrate` on Some CPU 9000 (64 cores, 4 thread(s)")
    assert there.source[0].endswith(f"refit from {rec_path}") and there.memory_bytes == 3e10


def test_calibrate_names_bad_input_before_it_measures(capsys, tmp_path) -> None:
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "bad.json").write_text("{")
    (tmp_path / "a-file").write_text("")
    for argv, said in ((["--worlds", "1,x"], "--worlds: expected a comma list of gloo group sizes"),
                       (["--sizes", "-5"], "--sizes: expected a comma list of payload bytes per rank"),
                       (["--repeats", "0"], "--threads and --repeats must be >= 1"),
                       (["--out", str(tmp_path / "a-file" / "p.yaml")], "cannot make its folder"),
                       (["--records", str(tmp_path / "a-file" / "r.json")], "--records"),
                       (["--from-records", str(tmp_path / "none.json")], "cannot read it"),
                       (["--from-records", str(tmp_path / "bad.json")], "not valid JSON"),
                       (["--from-records", str(tmp_path / "list.json")], "not the timings `moebal calibrate")):
        assert main(["calibrate", "--quick", "--out", str(tmp_path / "p.yaml"), *argv]) == 2, argv
        err = capsys.readouterr().err
        assert said in err and len(err.strip().splitlines()) == 1, (argv, err)
    assert not (tmp_path / "p.yaml").exists()


def test_the_readme_row_of_the_1024_rank_simulation_is_what_its_command_prints(capsys) -> None:
    # the row names its command; the figures must be that command's (they once came from another --cluster)
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    row = next(line for line in readme.splitlines() if line.startswith("| 1,024-rank Mixtral-8x7B iteration"))
    static, prophet = (float(x) for x in re.search(r"\| ([\d.]+) s \(([\d.]+) s with Pro-Prophet", row).groups())
    command = re.search(r"`moebal (simulate [^`]+)`", row).group(1).split()
    assert command == ["simulate", "mixtral-8x7b", "--cluster", "h100", "--ranks", "1024"]
    assert round(_json(capsys, [*command, "--json"])["iteration_time_s"], 1) == static
    with_prophet = _json(capsys, [*command, "--policy", "prophet", "--json"])
    assert round(with_prophet["iteration_time_s"], 1) == prophet
    # the row says Pro-Prophet's replicas do not fit this layout, with the memory plan's figure
    memory = with_prophet["memory"]
    gb, of = (int(x) for x in re.search(r"do not fit this layout: (\d+) GB per rank of (\d+)", row).groups())
    assert not memory["fits"] and round(memory["peak_bytes"] / 1e9) == gb and memory["capacity_bytes"] / 1e9 == of
    # ... and that one replica per rank and layer (planner.max_replicas=1) does not fit either, at its time and peak
    capped_s, capped_gb, recv_gb = (float(x) for x in re.search(
        r"; ([\d.]+) s with them capped at one per rank and layer, `planner.max_replicas=1`, which does not fit "
        r"either: ([\d.]+) GB per rank, ([\d.]+) GB of it Agg's receive buffers", row).groups())
    capped = _json(capsys, [*command, "--policy", "prophet", "planner.max_replicas=1", "--json"])
    assert round(capped["iteration_time_s"], 1) == capped_s and not capped["memory"]["fits"]
    assert round(capped["memory"]["peak_bytes"] / 1e9, 1) == capped_gb
    assert round(capped["memory"]["terms"]["Agg receive buffers (Pro-Prophet)"] / 1e9, 1) == recv_gb



def test_micro_batches_default_to_the_configs_own_so_the_memory_line_is_plan_memorys(capsys) -> None:
    # the Mixtral preset: a stage's 8 ranks share 16 rows, 2 per rank, min(pipeline.micro_batches 4, 2) = 2
    # micro-batches of one; its own 4 x pp micro-batches once made this say "does not fit" (84.2 GB) where
    # `moebal plan memory` said 77.7 GB
    out = _json(capsys, ["simulate", "mixtral-8x7b", "--cluster", "h100-ndr400", "--json"])
    assert (out["meta"]["ranks"], out["meta"]["micro_batches"], out["meta"]["micro_batch_size"]) == (16, 2, 1)
    assert main(["plan", "memory", "mixtral-8x7b", "--cluster", "h100-ndr400", "--policy", "static", "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert out["memory"]["fits"] and out["memory"]["peak_bytes"] == planned["peak_bytes"]
    # the per-rank rows hold at any size (weak scaling); without a pipeline, accumulation's micro-batches
    out = _json(capsys, ["simulate", "mixtral-8x7b", "--ranks", "64", "--json"])
    assert (out["meta"]["micro_batches"], out["meta"]["micro_batch_size"]) == (2, 1)
    out = _json(capsys, ["simulate", "--ep", "2", "--json", "data.batch_size=8", "train.grad_accum=2"])
    assert (out["meta"]["micro_batches"], out["meta"]["micro_batch_size"]) == (2, 4)
    out = _json(capsys, ["simulate", "mixtral-8x7b", "--micro-batches", "8", "--micro-batch-size", "1", "--json"])
    assert (out["meta"]["micro_batches"], out["meta"]["micro_batch_size"]) == (8, 1)


def test_micro_batches_that_do_not_split_the_configs_rows_are_refused_with_the_fix(capsys) -> None:
    for argv, said in ((["mixtral-8x7b", "--micro-batches", "8"], "2 rows per rank do not split into 8"),
                       (["mixtral-8x7b", "data.batch_size=12"], "does not split over the 8 ranks")):
        assert main(["simulate", *argv]) == 2
        err = capsys.readouterr().err
        assert said in err and "--micro-batch-size" in err and len(err.strip().splitlines()) == 1, err
