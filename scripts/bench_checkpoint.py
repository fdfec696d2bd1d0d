"""How long a checkpoint save blocks training: the default model on 2 expert-parallel gloo ranks.

One job (the default config: `moebal train`'s model, data, planner and 2 ranks) trains and, interleaved in
rounds, saves checkpoints in both modes:

  sync    the training loop writes the checkpoint itself (safetensors files, fsync, sha256, rank 0 completes
          the checkpoint once every rank's part is written);
  async   `train.ckpt_async`: the loop copies what it writes to CPU memory and a background thread writes it
          while training goes on.

Per save: the seconds the training loop was blocked (the slowest rank), against the time of 100 steps
(100 x the median step time of steps with no write in flight): the target is at most 10%. For the
background mode it also reports how long the write took and the median time of the steps that overlapped it
(the write competes with training for the same cores).

    python scripts/bench_checkpoint.py [--rounds 3] [--steps 12] [--json FILE]   (a PNG next to the JSON)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from moebal.commands.bench import add_device_argument, at_least, script_device
from moebal.distributed.testing import run_ranks

CPU_ONLY = "it times 2 gloo ranks of the default job on this machine's cores"
"""Why `--device` accepts cpu only here."""

MODES = ("sync", "async")


def _job(rank: int, world: int, rounds: int, steps: int, out: str) -> dict[str, Any]:
    from moebal.config import Config
    from moebal.train import Trainer
    from moebal.train.distributed import setup_parallel

    cfg = Config()  # the default run: `moebal train`
    ctx, model, hooks = setup_parallel(cfg)
    trainer = Trainer(cfg, Path(out), model=model, hooks=hooks, ctx=ctx)
    for h in hooks:
        h.on_start(trainer)
    ck = trainer.checkpointer
    rows: list[dict[str, Any]] = []
    plain: list[float] = []
    for _ in range(3):  # warm-up
        trainer.train_step()
    for r in range(rounds):
        for mode in (MODES if r % 2 == 0 else MODES[::-1]):
            ck.background = mode == "async"
            t0 = time.perf_counter()
            trainer.save()
            blocked = time.perf_counter() - t0
            overlapped: list[float] = []
            for _ in range(steps):
                in_flight = ck._thread is not None and ck._thread.is_alive()
                s0 = time.perf_counter()
                trainer.train_step()
                dt = time.perf_counter() - s0
                (overlapped if in_flight else plain).append(dt)
            ck.wait()
            rows.append({"mode": mode, "step": trainer.step, "blocked_s": blocked, "write_s": ck.last_write_s,
                         "overlapped_steps_s": overlapped})
    ck.wait()
    for h in hooks:
        h.on_end(trainer)
    newest = sorted(Path(out).glob("ckpt-*"))[-1] if rank == 0 else None
    size = sum(p.stat().st_size for p in newest.iterdir()) if newest is not None else 0
    params = sum(p.numel() for p in trainer.model.parameters())
    return {"rows": rows, "plain_steps_s": plain, "bytes_per_checkpoint": size, "params_on_rank": params}


def _plot(result: dict[str, Any], path: Path) -> None:
    """Seconds the loop was blocked per save in each mode, against the 10% target and a plain step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for i, (mode, m) in enumerate(result["modes"].items()):
        ax.scatter([i] * len(m["blocked_s"]), m["blocked_s"], label=f"{mode}: blocked per save", zorder=3)
    ax.axhline(0.1 * result["interval_100_steps_s"], color="red", ls="--", label="target: 10% of 100 steps")
    ax.axhline(result["median_step_s"], color="grey", ls=":", label="one training step (median)")
    over = result["modes"]["async"]["overlapped_step_median_s"]
    if over:
        ax.axhline(over, color="orange", ls=":", label="a step overlapping a background write (median)")
    ax.set_yscale("log")
    ax.set_xticks(range(len(result["modes"])), list(result["modes"]))
    ax.set_ylabel("seconds")
    ax.set_title(f"checkpoint save of the default model, 2 ranks ({result['bytes_per_checkpoint'] / 1e6:.0f} MB)")
    ax.legend(fontsize=7, loc="center right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=at_least(1), default=3, help="rounds; each saves once in each mode")
    ap.add_argument("--steps", type=at_least(1), default=12, help="training steps after each save")
    ap.add_argument("--json", help="write the results here")
    add_device_argument(ap, cpu_only=CPU_ONLY)
    args = ap.parse_args()
    script_device(args.device, cpu_only=CPU_ONLY)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        ranks = run_ranks(_job, 2, args.rounds, args.steps, tmp, timeout_s=1800, threads=1)
    step_s = statistics.median(s for rk in ranks for s in rk["plain_steps_s"])
    interval_s = 100 * step_s
    result: dict[str, Any] = {"load_average_before": load_before, "load_average_after": os.getloadavg(),
                              "median_step_s": step_s, "interval_100_steps_s": interval_s,
                              "bytes_per_checkpoint": ranks[0]["bytes_per_checkpoint"],
                              "params_per_rank": [rk["params_on_rank"] for rk in ranks],
                              "torch": torch.__version__, "python": platform.python_version(),
                              "cpus": os.cpu_count(), "modes": {}}
    for mode in MODES:
        blocked = [max(rk["rows"][i]["blocked_s"] for rk in ranks)
                   for i in range(len(ranks[0]["rows"])) if ranks[0]["rows"][i]["mode"] == mode]
        writes = [max(rk["rows"][i]["write_s"] for rk in ranks)
                  for i in range(len(ranks[0]["rows"])) if ranks[0]["rows"][i]["mode"] == mode]
        over = [s for rk in ranks for row in rk["rows"] if row["mode"] == mode for s in row["overlapped_steps_s"]]
        result["modes"][mode] = {
            "blocked_s": [round(b, 4) for b in blocked], "blocked_median_s": statistics.median(blocked),
            "blocked_share_of_100_steps": statistics.median(blocked) / interval_s,
            "blocked_max_share_of_100_steps": max(blocked) / interval_s,
            "write_s_median": statistics.median(writes),
            "overlapped_steps": len(over),
            "overlapped_step_median_s": statistics.median(over) if over else None}
    print(json.dumps(result, indent=1))
    for mode, m in result["modes"].items():
        print(f"{mode:>5}: blocked {m['blocked_median_s']:.3f} s median (max {max(m['blocked_s']):.3f} s) = "
              f"{100 * m['blocked_share_of_100_steps']:.2f}% of 100 steps ({interval_s:.1f} s; target <= 10%); "
              f"write {m['write_s_median']:.3f} s", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
        _plot(result, Path(args.json).with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
