"""Which steps of finished runs the spike tests would call bad, at several settings: choosing `train.spike.factor`
and `train.spike.grad_factor` on a run's own metrics instead of by trial.

Each run directory's `metrics.jsonl` (every step's line: `train.log_every=1`, the default) is replayed through the
trainer's own test (`moebal.train.spikes.replay_spikes`: the same medians over the same window, a bad step's
figures kept out of the histories) once per setting, the loss test alone at each `--factor` and the gradient-norm
test alone at each `--grad-factor`, as if each run had gone on past every bad step as it did. A non-finite loss
or norm is bad under every setting. Printed per run and setting: the first step called bad, how many, and the
first few; `--json` writes every step.

    python scripts/spike_replay.py RUN_DIR [RUN_DIR ...] [--factor 1.5 2 3] [--grad-factor 2 3 5] [--window 20]
                                   [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from moebal.config import SpikeConfig
from moebal.errors import MoebalError
from moebal.train.metrics import read_metrics
from moebal.train.spikes import replay_spikes

SHOWN = 8


def replay_run(run_dir: Path, factors: list[float], grad_factors: list[float], window: int) -> dict[str, Any]:
    """One run's replay under every setting: {"run", "steps", "settings": [{"test", "factor", "bad": [...]}]}."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise MoebalError(f"{path} does not exist: give the directory of a run `moebal train --out` wrote")
    records = [r for r in read_metrics(path) if "step" in r]
    if not records:
        raise MoebalError(f"{path} has no metrics lines")
    settings = [("loss", f, SpikeConfig(factor=f, window=window)) for f in factors]
    settings += [("grad_norm", g, SpikeConfig(grad_factor=g, window=window)) for g in grad_factors]
    out = []
    for test, factor, spike in settings:
        bad = replay_spikes(records, spike)
        out.append({"test": test, "factor": factor,
                    "bad": [{"step": s, "kind": k, "why": w} for s, k, w in bad]})
    return {"run": str(run_dir), "steps": [int(records[0]["step"]), int(records[-1]["step"])], "settings": out}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run directories (each with its metrics.jsonl)")
    ap.add_argument("--factor", type=float, nargs="*", default=[1.5, 2.0, 3.0],
                    help="loss-test factors to replay (train.spike.factor; each > 1)")
    ap.add_argument("--grad-factor", type=float, nargs="*", default=[2.0, 3.0, 5.0],
                    help="gradient-norm-test factors to replay (train.spike.grad_factor; each > 1)")
    ap.add_argument("--window", type=int, default=20, help="steps of history the tests compare with")
    ap.add_argument("--json", type=Path, default=None, help="write every bad step of every setting here")
    args = ap.parse_args(argv)
    for name, values in (("--factor", args.factor), ("--grad-factor", args.grad_factor)):
        if any(not v > 1 for v in values):
            ap.error(f"{name} values must be above 1 (a test at factor <= 1 calls about every step bad); "
                     f"got {values}")
    if args.window < 1:
        ap.error(f"--window must be at least 1; got {args.window}")
    if not args.factor and not args.grad_factor:
        ap.error("nothing to replay: give --factor or --grad-factor values")
    try:
        results = [replay_run(d, args.factor, args.grad_factor, args.window) for d in args.runs]
    except MoebalError as e:
        print(f"spike_replay: error: {e}", file=sys.stderr)
        return 2
    for res in results:
        print(f"{res['run']} (steps {res['steps'][0]}-{res['steps'][1]}, window {args.window})")
        for s in res["settings"]:
            steps = [b["step"] for b in s["bad"]]
            first = steps[0] if steps else "-"
            more = " ..." if len(steps) > SHOWN else ""
            print(f"  {s['test']:9s} x{s['factor']:<5g} first {first!s:>6}  bad steps {len(steps):4d}  "
                  f"{' '.join(map(str, steps[:SHOWN]))}{more}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"window": args.window, "runs": results}, indent=1) + "\n",
                             encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
