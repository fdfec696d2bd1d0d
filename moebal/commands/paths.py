"""`moebal paths`: build Lina's sample-path profile from a run's recorded routing (train.record_routing_every).

Example: moebal paths runs/default-2026... -o profile.npz --path-len 3
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from moebal.errors import ConfigError
from moebal.fileio import output_path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="a run directory with routing/step_*.npz (train with train.record_routing_every=N)")
    p.add_argument("-o", "--out", default=None, help="profile file (default: RUN_DIR/paths.npz)")
    p.add_argument("--path-len", type=int, default=3, help="l: the layers of a token's path (default 3)")
    p.add_argument("--share", type=float, default=1.0,
                   help="use the first SHARE of the samples in step order (keep the rest for held-out checks)")
    p.add_argument("--top-k", type=int, default=None,
                   help="profile the first K choices of each recorded token (default: all the run recorded): the k "
                        "the model will be served at (`moebal eval/generate --top-k`)")
    p.add_argument("--num-experts", type=int, default=None,
                   help="experts per layer (default: moe.num_experts of RUN_DIR/config.yaml)")


def run(args: argparse.Namespace) -> int:
    from moebal.planner.paths import build_profile
    from moebal.train.routing_log import load_routing

    run_dir = Path(args.run_dir)
    if not 0.0 < args.share <= 1.0:
        raise ConfigError(f"--share must be in (0, 1]; got {args.share}")
    if args.path_len < 1:
        raise ConfigError(f"--path-len must be >= 1; got {args.path_len}")
    try:
        samples = load_routing(run_dir)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    used = samples[:max(1, int(round(len(samples) * args.share)))]
    if args.num_experts is not None and args.num_experts < 1:
        raise ConfigError(f"--num-experts must be >= 1; got {args.num_experts}")
    E = args.num_experts or _num_experts(run_dir)
    top = max(int(s.max()) for s in used) + 1
    if top > E:
        raise ConfigError(f"{run_dir}/routing holds expert ids up to {top - 1}, more than {E} experts per layer: "
                          f"pass --num-experts {top} or more, or leave it out to read the run's config.yaml")
    recorded = int(used[0].shape[2])
    if args.top_k is not None:
        if not 1 <= args.top_k <= recorded:
            raise ConfigError(f"--top-k must be in 1..{recorded} (the run recorded {recorded} choices per token); "
                              f"got {args.top_k}")
        used = [s[:, :, :args.top_k] for s in used]  # column 0 is the first choice (`build_profile`)
    prof = build_profile(used, E, args.path_len)
    out = output_path(args.out, "--out") if args.out else run_dir / "paths.npz"
    prof.save(out)
    paths = [sum(t.keys_Pm.shape[0] for t in tabs[-1:]) for tabs in prof.tables[1:]]
    print(json.dumps({"profile": str(out), "samples": len(used), "layers": prof.num_layers, "top_k": prof.top_k,
                      "path_len": prof.path_len, "full_paths_per_layer": paths, "bytes": out.stat().st_size}),
          file=sys.stdout)
    return 0


def _num_experts(run_dir: Path) -> int:
    from moebal.config import load

    cfg_file = run_dir / "config.yaml"
    if not cfg_file.exists():
        raise ConfigError(f"{cfg_file} not found: pass --num-experts")
    return int(load(cfg_file).moe.num_experts)
