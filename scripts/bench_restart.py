"""Recovery time after a rank is SIGKILLed: from the kill to the first training step completed after the restart.

Each run trains with `--max-restarts 1`, waits for a checkpoint, SIGKILLs one rank, and times the recovery from
the job's own records: the kill (taken here), the restart notice and the "resumed at step" line (arrival
times of the job's log lines) and the first step after the kill (the `time` field of metrics.jsonl). It
also checks that the run's losses equal those of the same run uninterrupted, bit for bit.

Settings (`--setting`, repeatable; default: all that can run here):
  tiny-local     `moebal train --nproc 2` on a 0.1M-parameter model (the restart test's job)
  default-local  `moebal train --nproc 2` on the default model (4 layers, 8 experts, bf16, the full corpus)
  tiny-netns     `moebal launch` on two network-namespace nodes, 2 ranks each (needs root and iproute2)

    python scripts/bench_restart.py [--setting S] [--repeats 3] [--json FILE] [--png FILE]

On a shared machine run one benchmark at a time (a lock file), and keep `uptime` with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import yaml

from moebal.commands.bench import add_device_argument, at_least, script_device
from moebal.distributed.testing import kill_rank_when
from moebal.launch.netns import NamespacePair, unavailable

CPU_ONLY = "its jobs run on this machine's cores, tiny-netns in network namespaces"
"""Why `--device` accepts cpu only here."""

TINY = {"model": {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 96},
        "moe": {"num_experts": 4, "expert_ffn_dim": 64},
        "data": {"seq_len": 64, "batch_size": 4, "max_bytes": 400000},
        "train": {"precision": "fp32", "eval_every": 10, "eval_batches": 2, "warmup_steps": 2, "ckpt_every": 10,
                  "threads": 1, "steps": 60, "seed": 0, "time_limit_min": None},
        "planner": {"costs": "a100"}}
# moe.kernel: loop, not auto: auto times the kernels in every process and may pick another one in another run
# (two uninterrupted default runs differ from step 2 on), which would hide what the restart does to the losses
DEFAULT = {"train": {"steps": 40, "ckpt_every": 10, "eval_every": 0, "seed": 0, "time_limit_min": None},
           "moe": {"kernel": "loop"}, "planner": {"costs": "a100"}}
SETTINGS = ("tiny-local", "default-local", "tiny-netns")


def _flat(d: dict[str, Any], prefix: str = "") -> list[str]:
    out = []
    for k, v in d.items():
        if isinstance(v, dict):
            out += _flat(v, f"{prefix}{k}.")
        else:
            out.append(f"{prefix}{k}={'null' if v is None else v}")
    return out


def _metrics(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


class Lines:
    """A process's output lines with their arrival times (time.time())."""

    def __init__(self, stream: Any) -> None:
        self.lines: list[tuple[float, str]] = []
        self._t = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._t.start()

    def _read(self, stream: Any) -> None:
        for line in iter(stream.readline, ""):
            self.lines.append((time.time(), line.rstrip("\n")))

    def first(self, pattern: str, after: float) -> float | None:
        return next((t for t, s in self.lines if t >= after and re.search(pattern, s)), None)

    def join(self) -> None:
        self._t.join(timeout=10)


def _command(setting: str, out: Path, tmp: Path, pair: NamespacePair | None, restarts: int) -> list[str]:
    overrides = TINY if setting.startswith("tiny") else DEFAULT
    if setting.endswith("local"):
        return [sys.executable, "-m", "moebal.cli", "train", "--nproc", "2", "--out", str(out),
                "--max-restarts", str(restarts), *_flat(overrides)]
    assert pair is not None
    cluster = {"name": "bench-restart", "max_restarts": restarts,
               "nodes": [{"host": ns, "addr": a, "slots": 2} for ns, a in zip(pair.names, pair.addrs)],
               "rendezvous": {"join_timeout_s": 120}, "env": {"GLOO_SOCKET_IFNAME": pair.ifname},
               "ssh": {"command": "ip netns exec {host} sh -c {command}", "stop_grace_s": 5},
               "train": {"overrides": overrides, "out": str(out)}}
    path = tmp / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(cluster), encoding="utf-8")
    return [sys.executable, "-m", "moebal.cli", "launch", str(path)]


def run_once(setting: str, tmp: Path, pair: NamespacePair | None, kill: bool) -> dict[str, Any]:
    out = tmp / f"{setting}-{uuid.uuid4().hex[:8]}"
    marker = uuid.uuid4().hex
    env = {**os.environ, "MOEBAL_BENCH_JOB": marker}
    t0 = time.time()
    proc = subprocess.Popen(_command(setting, out, tmp, pair, 1 if kill else 0), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    lines = Lines(proc.stdout)
    rec: dict[str, Any] = {"setting": setting, "killed": kill}
    try:
        if kill:
            world = 4 if setting.endswith("netns") else 2
            victim = world - 1
            ckpt = out / "ckpt-0000010"  # complete once every rank's shard is in
            rec["kill_time"] = kill_rank_when(ckpt.is_dir, victim,
                                              f"MOEBAL_BENCH_JOB={marker}",
                                              alive=lambda: proc.poll() is None)
        proc.wait(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines.join()
    rec["returncode"], rec["wall_s"] = proc.returncode, round(time.time() - t0, 2)
    if proc.returncode != 0:
        rec["tail"] = [s for _, s in lines.lines[-30:]]
        return rec
    rows = _metrics(out)
    rec["losses"], rec["val_losses"] = [r["loss"] for r in rows], [r.get("val_loss") for r in rows]
    if kill:
        tk = rec["kill_time"]
        resumed = [int(s) for _, line in lines.lines for s in re.findall(r"resumed at step (\d+)", line)]
        first_after = next(r for r in rows if r["time"] > tk)
        last_before = max((r for r in rows if r["time"] <= tk), key=lambda r: r["time"], default=None)
        t_header = lines.first(r"resumed at step", tk)
        rec.update(resumed_at=resumed[-1] if resumed else None,
                   steps_done_at_kill=None if last_before is None else last_before["step"],
                   recovery_s=round(first_after["time"] - tk, 3),
                   kill_to_resumed_line_s=None if t_header is None else round(t_header - tk, 3),
                   resumed_line_to_first_step_s=None if t_header is None else round(first_after["time"] - t_header,
                                                                                      3))
        restart_line = lines.first(r"restarting every rank|Sending process .* closing signal", tk)
        rec["kill_to_restart_notice_s"] = None if restart_line is None else round(restart_line - tk, 3)
    return rec


def plot(records: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in records if r.get("killed") and r.get("recovery_s") is not None]
    if not runs:
        return
    fig, ax = plt.subplots(figsize=(8, 0.5 + 0.45 * len(runs)))
    for i, r in enumerate(runs):
        a = r.get("kill_to_resumed_line_s") or 0.0
        ax.barh(i, a, color="tab:orange", label="kill -> resumed (detect, stop, start, load)" if i == 0 else None)
        ax.barh(i, r["recovery_s"] - a, left=a, color="tab:blue", label="resumed -> first step" if i == 0 else None)
    ax.set_yticks(range(len(runs)), [f"{r['setting']} #{i}" for i, r in enumerate(runs)])
    ax.set_xlabel("seconds from the SIGKILL")
    ax.set_title("recovery after a killed rank (target: under 60 s)")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--setting", action="append", choices=SETTINGS, help="repeatable; default: all that can run")
    ap.add_argument("--repeats", type=at_least(1), default=3, help="killed runs per setting (interleaved)")
    ap.add_argument("--json", type=Path, help="write the records here")
    ap.add_argument("--png", type=Path, help="write the recovery chart here (default: next to --json)")
    add_device_argument(ap, cpu_only=CPU_ONLY)
    args = ap.parse_args(argv)
    script_device(args.device, cpu_only=CPU_ONLY)
    why = unavailable()
    settings = args.setting or [s for s in SETTINGS if not (s.endswith("netns") and why)]
    if any(s.endswith("netns") for s in settings) and why:
        ap.error(f"tiny-netns needs network namespaces: {why}")
    records: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="moebal-bench-restart-") as tmp_name:
        tmp = Path(tmp_name)
        pair = NamespacePair(tag=f"b{os.getpid()}") if any(s.endswith("netns") for s in settings) else None
        try:
            if pair is not None:
                pair.__enter__()
            reference = {s: run_once(s, tmp, pair, kill=False) for s in settings}
            for rep in range(args.repeats):
                for s in settings:
                    r = run_once(s, tmp, pair, kill=True)
                    ref = reference[s]
                    r["repeat"] = rep
                    r["losses_equal_uninterrupted"] = (r.get("losses") is not None and r["losses"] == ref.get("losses")
                                                       and r["val_losses"] == ref.get("val_losses"))
                    pairs = zip(r.get("losses") or [], ref.get("losses") or [])
                    r["first_different_step"] = next((i + 1 for i, (x, y) in enumerate(pairs) if x != y), None)
                    records.append(r)
                    print(f"{s} #{rep}: recovery {r.get('recovery_s')} s (resumed at step {r.get('resumed_at')}, "
                          f"kill -> resumed line {r.get('kill_to_resumed_line_s')} s), losses equal "
                          f"{r['losses_equal_uninterrupted']}", flush=True)
        finally:
            if pair is not None:
                pair.close()
    summary = {s: {"median_recovery_s": statistics.median(x["recovery_s"] for x in records
                                                          if x["setting"] == s and x.get("recovery_s") is not None)
                   if any(x["setting"] == s and x.get("recovery_s") is not None for x in records) else None,
                   "all_losses_equal": all(x["losses_equal_uninterrupted"] for x in records if x["setting"] == s)}
               for s in settings}
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    result = {"summary": summary, "records": [{k: v for k, v in r.items() if k not in ("losses", "val_losses")}
                                              for r in records],
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "loadavg_end": load,
                          "python": platform.python_version()}}
    print(json.dumps(summary, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
        plot(records, args.png or args.json.with_suffix(".png"))
    return 0 if all(v["all_losses_equal"] for v in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
