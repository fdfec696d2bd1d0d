"""What starting the ranks of `moebal train --nproc N` costs (moebal/launch/spawn.py): ranks forked from the
launcher's preloaded forkserver (the default) against every rank a fresh `python -m moebal.cli` interpreter
(MOEBAL_RANK_START=exec).

Each job is the whole command as a user runs it, a subprocess: the launcher's start, the ranks' start, `--steps`
steps of a tiny model (dim 64, 2 layers, 4 experts top-2, sequences of 32 x 4) and the end of the run, so the
difference between the two is the ranks' start. Each round runs `--repeats` jobs per (start, ranks), the starts'
order alternating by round; medians over every job, every round reported. Default: 1 step, 2 and 4 ranks.

    python scripts/bench_rank_start.py [--rounds 2] [--repeats 1] [--worlds 2 4] [--steps 1] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from moebal.commands.bench import at_least

STARTS = ("exec", "forkserver")
TINY = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=128",
        "model.max_seq_len=64", "moe.num_experts=4", "moe.top_k=2", "moe.expert_ffn_dim=64", "data.seq_len=32",
        "data.batch_size=4", "data.max_bytes=300000", "train.warmup_steps=1", "train.eval_every=0",
        "train.ckpt_every=0", "train.progress=plain", "train.precision=fp32"]


def _job(start: str, world: int, steps: int) -> float:
    """Seconds for one `moebal train --nproc world` job whose ranks start by `start`; fails if the job does."""
    env = {**os.environ, "MOEBAL_RANK_START": start}
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "moebal.cli", "train", "--nproc", str(world), "--steps", str(steps), "--out",
               str(Path(tmp) / "run"), *TINY]
        t0 = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        seconds = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"{start} job with {world} ranks failed:\n{r.stderr[-3000:]}")
    return seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=at_least(1), default=2)
    ap.add_argument("--repeats", type=at_least(1), default=1, help="jobs per start, world size and round")
    ap.add_argument("--worlds", type=at_least(1), nargs="+", default=[2, 4], help="ranks per job")
    ap.add_argument("--steps", type=at_least(1), default=1, help="training steps per job")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    load_before = os.getloadavg()
    times: dict[str, list[list[float]]] = {f"{s}/{w}": [] for s in STARTS for w in args.worlds}
    for r in range(args.rounds):
        for start in (STARTS if r % 2 == 0 else STARTS[::-1]):
            for w in args.worlds:
                times[f"{start}/{w}"].append([_job(start, w, args.steps) for _ in range(args.repeats)])
    result: dict[str, Any] = {
        "settings": vars(args), "load_average_before": load_before, "load_average_after": os.getloadavg(),
        "python": platform.python_version(), "cpus": os.cpu_count(),
        "rounds_s": {k: [[round(s, 2) for s in rnd] for rnd in v] for k, v in times.items()},
        "median_s": {k: round(statistics.median(s for rnd in v for s in rnd), 2) for k, v in times.items()}}
    for w in args.worlds:
        med = result["median_s"]
        result[f"saved_{w}_ranks_s"] = round(med[f"exec/{w}"] - med[f"forkserver/{w}"], 2)
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
