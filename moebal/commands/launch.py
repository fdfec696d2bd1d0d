"""`moebal launch CLUSTER.yaml [--dry-run] [--max-restarts N] [--out DIR] [--resume] [key=value ...]`.

Reads the cluster file (`moebal/launch/cluster.py`), checks the training config and the parallel layout here,
before anything starts, then either prints the exact per-node commands (--dry-run), runs them (ssh: one
torchrun per node, output prefixed with the node's name and the rank, every node stopped when one fails),
or writes and submits the Slurm batch script. `key=value` overrides apply to the cluster file
(`max_restarts=2`, `train.overrides.train.steps=100`).
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from moebal.config import Config, resolve_path
from moebal.errors import ConfigError
from moebal.interop.hf_config import load
from moebal.launch.cluster import (
    ClusterConfig,
    load_cluster,
    node_commands,
    sbatch_script,
    script_path,
    submit_argv,
    train_argv,
    train_overrides,
)

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("cluster", metavar="CLUSTER.yaml", help="the cluster file (configs/cluster-example.yaml)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="overrides of the cluster file")
    p.add_argument("--dry-run", action="store_true",
                   help="print the per-node commands (Slurm: the batch script and its submission); start nothing")
    p.add_argument("--max-restarts", type=int, metavar="N",
                   help="restarts of failed ranks, each from the last checkpoint (max_restarts)")
    p.add_argument("--out", metavar="DIR", help="run directory as the nodes see it (train.out)")
    p.add_argument("--resume", action="store_true", help="continue the run in the run directory from its latest "
                                                         "checkpoint")


def _local(c: ClusterConfig, path: str) -> Path:
    """A path of the nodes' working directory, as seen from here."""
    p = Path(path)
    return p if p.is_absolute() else Path(c.workdir or os.getcwd()) / p


def check_training(c: ClusterConfig, source: str) -> Config:
    """The training config the ranks will load, with its overrides, and the layout's divisibility, checked here
    so that a mistake is one clear line instead of a failure on every rank of every node."""
    from moebal.distributed.groups import ParallelDims
    from moebal.train.distributed import RunContext

    config = c.train.config
    if config is not None and not Path(config).is_absolute() and _local(c, config).is_file():
        config = str(_local(c, config))
    try:
        cfg = load(resolve_path(config) if config is not None else None, train_overrides(c.train))
        world, pp = c.world_size, cfg.parallel.pp
        ep = 1 if cfg.moe.num_experts == 0 else (cfg.parallel.ep or world // pp)
        if cfg.moe.num_experts and cfg.moe.num_experts % ep:
            raise ConfigError(f"moe.num_experts ({cfg.moe.num_experts}) is not divisible by the expert-parallel "
                              f"size {ep} of {world} ranks: set train.overrides parallel.ep to a divisor of it")
        RunContext(ParallelDims(world_size=world, rank=0, ep=ep, pp=pp)).check_batch(cfg.data.batch_size,
                                                                                 cfg.train.grad_accum)
    except ConfigError as e:
        raise ConfigError(f"{source}: train: {e}") from None
    return cfg


def run_directory(c: ClusterConfig, cfg: Config, out: str | None) -> str:
    if out or c.train.out:
        return str(out or c.train.out)
    return str(Path(cfg.train.out_dir) / f"{c.name}-{time.strftime('%Y%m%d-%H%M%S')}")


def _overrides(args: argparse.Namespace) -> list[str]:
    items = list(args.overrides)
    if args.max_restarts is not None:
        items.append(f"max_restarts={args.max_restarts}")
    return items


def run(args: argparse.Namespace) -> int:
    c = load_cluster(args.cluster, _overrides(args))
    cfg = check_training(c, args.cluster)
    out = run_directory(c, cfg, args.out)
    if args.resume and not (args.out or c.train.out):
        raise ConfigError("--resume needs the run directory: pass --out DIR or set train.out in the cluster file")
    if not args.resume and not args.dry_run and (_local(c, out) / "metrics.jsonl").exists():
        raise ConfigError(f"{out} already holds a run: pass --resume to continue it, or choose another --out")
    from moebal.train.checkpoint import find_checkpoints

    if args.resume and not args.dry_run and _local(c, out).is_dir() and not find_checkpoints(_local(c, out)):
        # (a run directory this machine cannot see is the nodes' to check)
        raise ConfigError(f"nothing to resume in {out}: it holds no checkpoint (run without --resume to start, "
                          f"or point --out at the run)")
    train = train_argv(c, out, resume=args.resume)
    ranks = "+".join(str(n.slots) for n in c.nodes)
    header = (f"moebal launch: {c.name}, {len(c.nodes)} nodes ({ranks} = {c.world_size} ranks), "
              f"max_restarts {c.max_restarts}, run directory {out}")
    if c.launcher == "slurm":
        return _slurm(c, train, out, header, args.dry_run)
    commands = node_commands(c, train, out)
    if args.dry_run:
        print(f"# {header}\n# rendezvous c10d at {c.endpoint}")
        for cmd in commands:
            node = c.nodes[cmd.index]
            addr = f", addr {node.addr}" if node.addr else ""
            print(f"# node {cmd.index}: {cmd.name}{addr}, {node.slots} ranks\n{shlex.join(cmd.argv)}")
        return 0
    print(f"{header}; rendezvous at {c.endpoint}", file=sys.stderr, flush=True)
    from moebal.launch.spawn import run_nodes

    code = run_nodes([(cmd.name, cmd.argv) for cmd in commands], grace_s=c.ssh.stop_grace_s)
    if code == 0:
        print(f"moebal launch: {c.name} finished on all {len(c.nodes)} nodes; run directory {out}", file=sys.stderr)
    return code


def _slurm(c: ClusterConfig, train: list[str], out: str, header: str, dry_run: bool) -> int:
    script, submit = sbatch_script(c, train, out), submit_argv(c, out)
    if dry_run:
        print(f"# {header}\n# batch script {script_path(c, out)}:\n{script}# submitted with:\n{shlex.join(submit)}")
        return 0
    path = _local(c, script_path(c, out))
    path.parent.mkdir(parents=True, exist_ok=True)
    _local(c, out).mkdir(parents=True, exist_ok=True)
    path.write_text(script, encoding="utf-8")
    print(f"{header}; batch script {path}", file=sys.stderr, flush=True)
    try:
        done = subprocess.run(submit, cwd=c.workdir or None, capture_output=True, text=True)
    except OSError as e:
        raise ConfigError(f"cannot run {submit[0]!r} ({e.strerror or e}): is this a Slurm login node? "
                          f"(slurm.submit names the command)") from None
    sys.stdout.write(done.stdout)
    sys.stderr.write(done.stderr)
    if done.returncode == 0:
        print(f"moebal launch: submitted; logs in {Path(out) / 'slurm-<job id>.out'} and {Path(out) / 'logs'}",
              file=sys.stderr)
    return done.returncode
