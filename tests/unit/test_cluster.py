"""`moebal launch`: the cluster schema, its errors, the exact per-node commands (ssh and Slurm) and the local
side of running them (prefixed output, every node stopped when one fails), with hostile values throughout.

The commands are executed for real through `sh -c` with a stand-in "python" that records the argv and
environment it receives, so a value that escaped its quoting would show up as a changed argument or a file
created by injected shell code.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from moebal.cli import main
from moebal.config import CONFIG_DIR
from moebal.errors import ConfigError
from moebal.launch.cluster import load_cluster, node_commands, sbatch_script, train_argv

HOSTILE = "x'; touch PWNED; echo '$(touch PWNED2) `touch PWNED3` \"q\" \\ ${HOME}"


def _write(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


def _fake_python(tmp: Path) -> Path:
    """A stand-in interpreter: records argv and environment in $FAKE_OUT/<node>.json, then sleeps $FAKE_SLEEP
    seconds and exits with $FAKE_EXIT."""
    script = tmp / "fake-python"
    script.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import json, os, sys, time
        print("hello from", os.environ["FAKE_NODE"], flush=True)
        print("to stderr", file=sys.stderr, flush=True)
        with open(os.path.join(os.environ["FAKE_OUT"], os.environ["FAKE_NODE"] + ".json"), "w") as f:
            json.dump({{"argv": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd(), "pid": os.getpid()}}, f)
        time.sleep(float(os.environ.get("FAKE_SLEEP", "0")))
        sys.exit(int(os.environ.get("FAKE_EXIT", "0")))
        """), encoding="utf-8")
    script.chmod(0o755)
    return script


def _cluster(tmp: Path, **extra: object) -> dict:
    work = tmp / "work dir 'quoted'"
    work.mkdir(exist_ok=True)
    (tmp / "rec").mkdir(exist_ok=True)
    data = {
        "name": "t",
        "nodes": [{"host": "n1", "addr": "127.0.0.1", "slots": 2, "env": {"FAKE_NODE": "n1"}},
                  {"host": "n2", "addr": "127.0.0.2", "slots": 2, "env": {"FAKE_NODE": "n2"}}],
        "rendezvous": {"port": 29999},
        "env": {"FAKE_OUT": str(tmp / "rec"), "EVIL": HOSTILE, "GLOO_SOCKET_IFNAME": "lo"},
        "python": str(_fake_python(tmp)),
        "workdir": str(work),
        "ssh": {"command": "sh -c {command} {host}", "stop_grace_s": 5},
        "train": {"overrides": {"data.source": HOSTILE, "train": {"steps": 3, "lr": 1e-3},
                                "pipeline.rebalance": "off"},
                  "out": f"runs/out dir; {HOSTILE}"},
    }
    data.update(extra)
    return data


def test_example_cluster_file_loads_and_dry_runs(capsys):
    path = CONFIG_DIR / "cluster-example.yaml"
    c = load_cluster(path)
    assert [n.slots for n in c.nodes] == [8, 8] and c.max_restarts == 2
    assert main(["launch", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    cmds = [line for line in out.splitlines() if not line.startswith("#")]
    assert len(cmds) == 2
    first = shlex.split(cmds[0])
    assert first[:4] == ["ssh", "-tt", "-o", "BatchMode=yes"] and first[4] == "gpu-01"
    remote = shlex.split(first[5])  # what the node's login shell runs
    assert remote[:3] == ["cd", os.getcwd(), "&&"] and remote[3:5] == ["exec", "env"]
    assert "NCCL_DEBUG=WARN" in remote and "--nproc-per-node=8" in remote
    assert not [w for w in remote if "IFNAME" in w]  # interfaces are commented choices, not a guessed eth0
    assert "--rdzv-endpoint=10.0.0.1:29500" in remote and "--local-addr=10.0.0.1" in remote
    assert "--rdzv-conf=join_timeout=600,is_host=1" in remote and "--max-restarts=2" in remote
    assert "--rdzv-conf=join_timeout=600,is_host=0" in shlex.split(shlex.split(cmds[1])[5])
    i = remote.index("moebal.cli")
    assert remote[i + 1:] == ["train", "default", "train.steps=2000", "train.ckpt_every=100",
                              "train.time_limit_min=null", "data.batch_size=64", "parallel.ep=8",
                              "--out", "runs/moe-2x8", "--auto-resume"]


def test_the_store_host_is_named_when_hosts_carry_an_ssh_user(tmp_path):
    """`user@host` nodes without addr: the rendezvous endpoint strips the user, and so does the store's host test,
    so that node 0 is told it hosts the store (torch would guess it from the hostname)."""
    data = {"nodes": [{"host": "alice@gpu-01", "slots": 2}, {"host": "alice@gpu-02", "slots": 2}]}
    c = load_cluster(_write(tmp_path / "c.yaml", data))
    assert c.endpoint == "gpu-01:29500"
    confs = [next(w for w in shlex.split(cmd.remote) if w.startswith("--rdzv-conf="))
             for cmd in node_commands(c, train_argv(c, "runs/x"), "runs/x")]
    assert ["is_host=1" in w for w in confs] == [True, False], confs


def test_launch_resume_without_a_checkpoint_is_refused_before_any_node_starts(tmp_path, capsys):
    data = _cluster(tmp_path, train={"out": str(tmp_path / "run")})
    (tmp_path / "run").mkdir()
    assert main(["launch", str(_write(tmp_path / "c.yaml", data)), "--resume"]) == 2
    assert "nothing to resume in" in capsys.readouterr().err
    assert not list((tmp_path / "rec").iterdir())  # no node's command ran


def test_hostile_values_arrive_intact_through_a_shell(tmp_path, capsys):
    """The per-node commands, run for real through `sh -c`: every value reaches the program as one argument."""
    path = _write(tmp_path / "c.yaml", _cluster(tmp_path))
    c = load_cluster(path)
    out = c.train.out
    assert main(["launch", str(path)]) == 0
    assert not list(tmp_path.rglob("PWNED*"))  # no injected command ran
    got = {n: json.loads((tmp_path / "rec" / f"{n}.json").read_text()) for n in ("n1", "n2")}
    for i, n in enumerate(("n1", "n2")):
        argv, env = got[n]["argv"], got[n]["env"]
        assert argv[:2] == ["-m", "torch.distributed.run"]
        assert argv[argv.index("moebal.cli") + 1:] == ["train", f"data.source={HOSTILE}", "train.steps=3",
                                                       "train.lr=0.001", "pipeline.rebalance='off'", "--out", out]
        assert f"--local-addr=127.0.0.{i + 1}" in argv and "--nproc-per-node=2" in argv
        assert env["EVIL"] == HOSTILE and env["FAKE_NODE"] == n and env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
        assert abs(float(env["MOEBAL_JOB_START"]) - time.time()) < 120  # the node's clock at its start
        assert got[n]["cwd"] == c.workdir
    captured = capsys.readouterr()
    assert "[n1] hello from n1" in captured.out and "[n2] hello from n2" in captured.out
    assert "[n2] to stderr" in captured.err and "finished on all 2 nodes" in captured.err
    # the override string `pipeline.rebalance='off'` reads back as the string off (not YAML's false)
    from moebal.config import load
    assert load(None, ["pipeline.rebalance='off'"]).pipeline.rebalance == "off"


def test_dry_run_prints_exactly_what_runs(tmp_path, capsys):
    path = _write(tmp_path / "c.yaml", _cluster(tmp_path))
    assert main(["launch", str(path), "--dry-run"]) == 0
    printed = [shlex.split(x) for x in capsys.readouterr().out.splitlines() if not x.startswith("#")]
    c = load_cluster(path)
    assert printed == [cmd.argv for cmd in node_commands(c, train_argv(c, str(c.train.out)), str(c.train.out))]
    assert not (tmp_path / "rec" / "n1.json").exists()  # nothing started


def test_a_failing_node_stops_the_others(tmp_path, capsys):
    data = _cluster(tmp_path)
    data["nodes"][0]["env"].update(FAKE_SLEEP=60)
    data["nodes"][1]["env"].update(FAKE_SLEEP=0.5, FAKE_EXIT=3)
    path = _write(tmp_path / "c.yaml", data)
    t0 = time.monotonic()
    assert main(["launch", str(path)]) == 3
    assert time.monotonic() - t0 < 30  # node n1 (sleeping 60 s) was stopped
    err = capsys.readouterr().err
    assert "node n2 failed (exit code 3); stopped the other nodes" in err


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] not in "ZX"
    except OSError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_signalled_launcher_stops_its_nodes_before_it_exits(tmp_path, sig):
    # what a job scheduler does to `moebal launch`: the nodes (sessions of their own) must not be orphaned
    data = _cluster(tmp_path)
    for node in data["nodes"]:
        node["env"].update(FAKE_SLEEP=120)
    path = _write(tmp_path / "c.yaml", data)
    launcher = subprocess.Popen([sys.executable, "-m", "moebal.cli", "launch", str(path)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
    recs = [tmp_path / "rec" / f"{n}.json" for n in ("n1", "n2")]
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not all(r.is_file() and r.stat().st_size for r in recs) and time.monotonic() < deadline:
            time.sleep(0.1)
        pids = [json.loads(r.read_text())["pid"] for r in recs]
        launcher.send_signal(sig)
        _, err = launcher.communicate(timeout=60)
        assert launcher.returncode == 128 + sig, err
        assert f"moebal launch: interrupted ({signal.Signals(sig).name})" in err
        assert not [pid for pid in pids if _running(pid)]  # stopped, and waited for
    finally:
        launcher.kill()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_missing_launcher_program_is_one_clear_error(tmp_path, capsys):
    data = _cluster(tmp_path, ssh={"command": "no-such-ssh-program {host} {command}"})
    assert main(["launch", str(_write(tmp_path / "c.yaml", data))]) == 2
    assert "cannot start node n1: 'no-such-ssh-program'" in capsys.readouterr().err


def test_a_host_inside_a_template_word_cannot_run_code(tmp_path, capsys):
    # the placeholder is part of a word that `sh -c` runs as a script: the host must stay one literal word there
    evil = f"n0;touch${{IFS}}{tmp_path}/x"
    data = _cluster(tmp_path, nodes=[{"host": evil, "addr": "127.0.0.1", "slots": 1}],
                    ssh={"command": "sh -c 'echo node={host}; exit 3' {command}", "stop_grace_s": 5})
    path = _write(tmp_path / "c.yaml", data)
    c = load_cluster(path)
    [cmd] = node_commands(c, train_argv(c, "runs/o"), "runs/o")
    assert cmd.argv[:3] == ["sh", "-c", f"echo node={shlex.quote(evil)}; exit 3"]
    done = subprocess.run(cmd.argv, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (3, f"node={evil}\n")
    assert not (tmp_path / "x").exists()
    assert main(["launch", str(path), "--dry-run"]) == 0  # the dry run shows the quoted word
    assert shlex.quote(f"echo node={shlex.quote(evil)}; exit 3") in capsys.readouterr().out


@pytest.mark.parametrize("template", ["sh -c 'echo \"node={host}\"' {command}", "sh -c \"echo 'n={node}'\" {command}",
                                      "sh -c \"echo \\\"{command}\\\"\""])
def test_a_placeholder_inside_quotes_of_a_template_word_is_refused(tmp_path, template):
    data = _cluster(tmp_path, ssh={"command": template})
    with pytest.raises(ConfigError, match=r"is inside a .-quoted string in .*put the placeholder outside"):
        load_cluster(_write(tmp_path / "c.yaml", data))


@pytest.mark.parametrize("change, message", [
    ({"nodez": []}, "unknown key 'nodez'; did you mean 'nodes'"),
    ({"nodes": [{"host": "a", "slotz": 2}]}, "unknown key 'nodes[0].slotz'; did you mean 'nodes[0].slots'"),
    ({"nodes": []}, "'nodes' is empty"),
    ({"nodes": [{"slots": 2}]}, "'nodes[0].host' is missing"),
    ({"nodes": [{"host": "-oProxyCommand=x", "slots": 1}]}, "must not start with '-'"),
    ({"nodes": [{"host": "a b", "slots": 1}]}, "one word"),
    ({"nodes": [{"host": "a", "slots": 0}]}, "'nodes[0].slots' must be at least 1"),
    ({"nodes": [{"host": "a"}, {"host": "a"}]}, "listed twice"),
    ({"nodes": [{"host": "a", "addr": "10.0.0.1"}, {"host": "b", "addr": "10.0.0.1"}]},
     "addr '10.0.0.1' is given to two nodes"),
    ({"nodes": [{"host": "a", "slots": "two"}]}, "'nodes[0].slots' must be an integer"),
    ({"env": {"BAD-NAME": "1"}}, "not an environment variable name"),
    ({"env": ["A=1"]}, "'env' must be a mapping"),
    ({"ssh": {"command": "ssh {host}"}}, "must contain {command}"),
    ({"ssh": {"command": "ssh {hots} {command}"}}, "unknown placeholder {hots}"),
    ({"ssh": {"command": "ssh '{host} {command}"}}, "not a valid command line"),
    ({"rendezvous": {"endpoint": "10.0.0.1"}}, "must look like HOST:PORT"),
    ({"launcher": "slrum"}, "did you mean 'slurm'"),
    ({"launcher": "slurm", "nodes": [{"slots": 2}, {"slots": 4}]}, "the same slots"),
    ({"launcher": "slurm", "nodes": [{"slots": 2}], "slurm": {"partition": "a\n#SBATCH --x"}}, "one word"),
    ({"launcher": "slurm", "nodes": [{"slots": 2}], "slurm": {"options": ["--qos=a b"]}}, "one option word"),
    ({"train": {"overrides": {"train.steps; rm": 1}}}, "is not a config key"),
    ({"max_restarts": -1}, "'max_restarts' must be >= 0"),
    ({"train": {"overrides": {"parallel": {"nproc": 4}}}}, "parallel.nproc=4 but the cluster file's nodes run 2 ranks"),
])
def test_bad_cluster_files_name_the_key_and_the_fix(tmp_path, change, message):
    data = {"nodes": [{"host": "a", "slots": 2}], **change}
    path = _write(tmp_path / "c.yaml", data)
    with pytest.raises(ConfigError, match="c.yaml") as e:
        load_cluster(path)
    assert message in str(e.value)


def test_training_config_is_checked_before_anything_starts(tmp_path, capsys):
    base = {"nodes": [{"host": "a", "slots": 2}, {"host": "b", "slots": 1}]}
    path = _write(tmp_path / "c.yaml", {**base, "train": {"overrides": {"train.stpes": 3}}})
    assert main(["launch", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "c.yaml: train:" in err and "did you mean 'train.steps'" in err
    path = _write(tmp_path / "c.yaml", base)  # 3 ranks cannot split 8 experts
    assert main(["launch", str(path), "--dry-run"]) == 2
    assert "not divisible by the expert-parallel size 3" in capsys.readouterr().err
    path = _write(tmp_path / "c.yaml", {**base, "train": {"overrides": {"parallel.ep": 1, "data.batch_size": 16}}})
    assert main(["launch", str(path), "--dry-run"]) == 2
    assert "data.batch_size (16) is not divisible by the 3 ranks" in capsys.readouterr().err
    accum = {"parallel.ep": 1, "data.batch_size": 12, "train.grad_accum": 2}  # 3 ranks x 2 micro-batches: 6 | 12
    path = _write(tmp_path / "c.yaml", {**base, "train": {"overrides": accum}})
    assert main(["launch", str(path), "--dry-run"]) == 0
    path = _write(tmp_path / "c.yaml", {**base, "train": {"overrides": {**accum, "train.grad_accum": 3}}})
    assert main(["launch", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "3 ranks x train.grad_accum=3 micro-batches: choose a batch size that is a multiple of 9" in err


def test_an_existing_run_is_not_overwritten(tmp_path, capsys):
    data = _cluster(tmp_path)
    out = Path(data["workdir"]) / "runs" / "old"
    out.mkdir(parents=True)
    (out / "metrics.jsonl").write_text("{}\n")
    path = _write(tmp_path / "c.yaml", data)
    assert main(["launch", str(path), "--out", "runs/old"]) == 2
    assert "already holds a run: pass --resume" in capsys.readouterr().err
    assert not (tmp_path / "rec" / "n1.json").exists()


def _slurm_cluster(tmp_path: Path) -> dict:
    data = _cluster(tmp_path, launcher="slurm", max_restarts=1)
    for n in data["nodes"]:
        del n["addr"], n["env"], n["host"]
    data["env"]["FAKE_NODE"] = "slurm-task"
    data["slurm"] = {"partition": "gpu", "time": "02:00:00", "gpus_per_node": 8, "cpus_per_task": 96,
                     "options": ["--exclusive"], "submit": str(tmp_path / "fake-sbatch")}
    return data


def test_slurm_script_runs_torchrun_on_every_node_with_intact_values(tmp_path, capsys):
    data = _slurm_cluster(tmp_path)
    path = _write(tmp_path / "c.yaml", data)
    assert main(["launch", str(path), "--dry-run"]) == 0
    printed = capsys.readouterr().out
    c = load_cluster(path)
    out = str(c.train.out)
    script = sbatch_script(c, train_argv(c, out), out)
    assert script in printed and not (Path(c.workdir) / out).exists()  # a dry run writes nothing
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --partition=gpu",
                 "#SBATCH --time=02:00:00", "#SBATCH --gpus-per-node=8", "#SBATCH --cpus-per-task=96",
                 "#SBATCH --exclusive"):
        assert line in script.splitlines()
    # srun does not inherit --cpus-per-task from sbatch (Slurm >= 22.05): the step asks for it itself
    srun = [ln for ln in script.splitlines() if ln.startswith("srun ")]
    assert len(srun) == 1 and " --cpus-per-task=96 " in srun[0]
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    # run the script with stand-ins for srun (runs its command) and scontrol (names the job's nodes)
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "srun").write_text('#!/bin/sh\nwhile [ "${1#--}" != "$1" ]; do shift; done\nexec "$@"\n')
    (bin_ / "scontrol").write_text("#!/bin/sh\necho head-node\necho other-node\n")
    for f in bin_.iterdir():
        f.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "x[1-2]",
           "SLURM_JOB_ID": "4242"}
    done = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert not list(tmp_path.rglob("PWNED*"))
    rec = json.loads((tmp_path / "rec" / "slurm-task.json").read_text())
    argv = rec["argv"]
    assert "--rdzv-endpoint=head-node:29999" in argv and "--rdzv-id=4242" in argv and "--max-restarts=1" in argv
    assert argv[argv.index("moebal.cli") + 1:] == ["train", f"data.source={HOSTILE}", "train.steps=3",
                                                   "train.lr=0.001", "pipeline.rebalance='off'", "--out", out,
                                                   "--auto-resume"]
    assert rec["env"]["EVIL"] == HOSTILE and rec["cwd"] == c.workdir
    assert abs(float(rec["env"]["MOEBAL_JOB_START"]) - time.time()) < 120  # exported once, for every attempt


def test_slurm_submission_writes_the_script_and_calls_sbatch(tmp_path, capsys):
    data = _slurm_cluster(tmp_path)
    sbatch = tmp_path / "fake-sbatch"
    sbatch.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {shlex.quote(str(tmp_path / "sbatch-args"))}\n'
                      'echo "Submitted batch job 42"\n')
    sbatch.chmod(0o755)
    path = _write(tmp_path / "c.yaml", data)
    assert main(["launch", str(path)]) == 0
    c = load_cluster(path)
    out = str(c.train.out)
    script = Path(c.workdir) / out / "launch.sbatch"
    assert script.read_text() == sbatch_script(c, train_argv(c, out), out)
    args = (tmp_path / "sbatch-args").read_text().splitlines()
    assert args == [f"--output={out}/slurm-%j.out", f"{out}/launch.sbatch"]
    assert "Submitted batch job 42" in capsys.readouterr().out


def test_slurm_srun_leaves_cpus_to_slurm_when_unset(tmp_path):
    data = _slurm_cluster(tmp_path)
    data["slurm"]["cpus_per_task"] = None
    c = load_cluster(_write(tmp_path / "c.yaml", data))
    out = str(c.train.out)
    script = sbatch_script(c, train_argv(c, out), out)
    assert "--cpus-per-task" not in script


def test_the_default_rendezvous_address_is_the_first_hosts_name_without_its_ssh_user(tmp_path):
    data = _cluster(tmp_path)
    data["nodes"] = [{"host": "alice@gpu-07", "slots": 2}, {"host": "alice@gpu-08", "slots": 2}]
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    assert load_cluster(path).endpoint == "gpu-07:29999"  # torchrun cannot resolve alice@gpu-07
    data["nodes"][0]["addr"] = "10.1.2.3"
    path.write_text(yaml.safe_dump(data))
    assert load_cluster(path).endpoint == "10.1.2.3:29999"
