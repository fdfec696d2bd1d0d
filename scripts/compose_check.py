"""Random compositions of `moebal train` options on a tiny model: each must train, or be refused in one line.

Every feature has its own tests; this script checks the ones nobody wrote, the combinations. Each case draws
one value per option (`OPTIONS`: processes, stages, expert parallelism, sharding, dynamism scheme, rebalancing,
micro-batching, schedule, recomputation, precision, accumulation, placement policy, communication scheduling,
plan-ahead, expert packing, selection bias, top-k, capacity, kernel, routing records, bf16 weights; and around
them the model's and router's variants (q/k norms, a sliding window, tied embeddings, gates, an MLP router, a
dense first layer, a shared expert, drop policy, jitter, z-loss, the adaptive gate), the data (documents, the
complexity order), the learning-rate schedule, asynchronous checkpoints, clipping, bf16 gradient sums,
re-packing, the initial partition, spin waits, the placement feedback, overlap and replica caps, chunked and
in-flight all-to-alls, pruning's kernels and sparse attention's budgets, a stage's memory cap, the micro-batch
planner's workers and lookahead; and a
continuation of a Mixtral-layout HF checkpoint, `hf.init_from`, which `hf_base` writes once per draw), then
`sample` sets aside the pairs the config check refuses by design (`pipeline.rebalance` without stages, ...), so
that most cases reach the ranks. Every case runs `moebal train --nproc N --steps 3` in a fresh directory and is
  ok        exit 0;
  refused   exit 2 with one `moebal train: error:` line and no traceback, said before any rank started;
  BUG       anything else: a traceback, another exit code, a hang past `--timeout`, or a refusal that only a
            rank made (the launcher reports "rank R failed"): its stderr is kept beside the report.
With `--resume`, an ok case is also resumed from its step-2 checkpoint (`--resume-from`, into another
directory): step 3's loss must equal the uninterrupted run's bit for bit (`BUG-resume` otherwise). (A run of
2 steps extended to 3 is another run: `train.steps` is the learning-rate schedule's horizon, and a wsd
schedule decays its last step.) With `--eval`, an ok MoE case
runs `moebal eval` on its checkpoint on 2 or 4 expert-parallel ranks, at the model's top-k or top-1: static
expert parallelism, or, when the case recorded its routing, `moebal paths` and then every policy (static, Lina,
phase 1, oracle: each must give static's logits) (`BUG-eval` when that neither runs nor refuses in a line, or
when a policy's logits differ from static's). The runs validate one batch after step 3; at the model's top-k and
without a capacity limit, the served static loss of that batch must equal the run's own validation, to 1e-5 in
fp32 and 5e-3 after bf16 training (`served_tolerance`; `BUG-eval` otherwise): the served model is the trained one,
scheme included. With `--spike`, an ok case also trains 7 steps under `train.spike.action=rollback` with a real
spike injected before step 5 (`MOEBAL_INJECT_SPIKE=5`: every weight x30): the run must roll back to its step-4
checkpoint in its own processes and train on, and its steps 5 to 7 must equal, bit for bit, those of the step-4
checkpoint resumed in a new job and directory that holds the rollback's record (so it skips the same batches)
(`BUG-spike` otherwise; a run that re-packed its stages onto fewer ranks stops at the spike by design, `refused`).
With `--kill`, an ok case of several processes also trains 7 steps under `--max-restarts 1` while one of its ranks
(drawn per case) is SIGKILLed as soon as the step-4 checkpoint is complete: the launcher must restart every rank
from the newest complete checkpoint, the 7 steps' losses and validations must equal, bit for bit, those of the same
7 steps uninterrupted, and no process of the job may outlive it (a rank, the forkserver, a micro-batch planner)
(`BUG-kill` otherwise; a run that ends before the rank could be killed is `unkilled`, no verdict).
With `--launch`, an ok case of several processes also runs as a two-node job of `moebal launch` on this machine
(two torchrun agents meeting through a c10d rendezvous on the loopback, half the ranks each, every rank a new
interpreter): its 3 steps' losses and validation must equal the `--nproc` run's bit for bit, and no process of
the job may outlive it (`BUG-launch` otherwise).
With `--generate`, an ok case's step-3 checkpoint also generates 8 greedy tokens after a 12-token prompt (`moebal
generate`), which must run or refuse in one line; then, in this process, the model loaded as the command loads it
decodes the prompt and those tokens with its KV cache: every position's logits within 1e-4 (of the largest logit)
of the model's forward over them all, and each generated token the forward's most likely one, or within 1e-4 of it;
and that sequence and its first 7 tokens as one left-padded batch, each row's logits within 1e-4 of the sequence's
own (`BUG-generate` otherwise; early exit's cached decoder with its exits against the served forward). A run served
through sparse attention, or Mixture-of-Depths without causal predictors, has no cached form: only the command
is checked (with predictors, `dynamism.mod.predictor`, the cached decoder is checked against the forward routed by
them). A model whose
experts split over 2 ranks then generates the prompt and its first 5 tokens with expert parallelism (`moebal
generate --nproc 2 --policy oracle --batch-size 2`: one prompt a rank, static first): the oracle's tokens must
equal static's, and each of the prompt's tokens must be the most likely one, or within 1e-4 of it, of the served
forward over its own prefix (a token can differ from one process's only at such a near tie: the dispatcher
computes an expert's rows in padded groups, the local layer in one).

Every cost a plan depends on is fixed: the expert planner's and the micro-batch planner's come from a hardware
profile (`planner.costs`, `pipeline.dynamic.costs`), sparse attention's constants are given. Measured ones
differ between two fresh runs, and so would their replicas, micro-batch splits and the last bits of their
losses (a resume reuses its run's measured figures; here the resumed run is compared with another run). The
layer balancer still plans on measured times: its migrations keep the losses bit for bit.

    python scripts/compose_check.py [--cases 40] [--seed 0] [--resume] [--eval] [--spike] [--kill] [--launch]
                                    [--generate] [--fix OPTION=VALUE ...] [--json OUT] [--keep DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import yaml

TINY = ["model.dim=32", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=64",
        "moe.expert_ffn_dim=32", "data.seq_len=32", "data.batch_size=8", "data.max_bytes=100000",
        "train.eval_every=3", "train.eval_batches=1", "train.threads=1", "train.warmup_steps=1", "train.ckpt_every=2",
        "planner.costs=rtx3090", "pipeline.dynamic.costs=rtx3090", "dynamism.sparse_attention.costs=given",
        "dynamism.sparse_attention.block=16", "dynamism.pruning.start=0", "dynamism.pruning.every=2",
        "dynamism.pruning.steps=3", "dynamism.freezing.threshold=10.0", "dynamism.freezing.check_every=2",
        "dynamism.early_exit.threshold=0.9", "dynamism.early_exit.first_layer=1"]
"""A tiny model, a checkpoint every 2 steps, a validation batch after step 3, every planner's costs fixed (module
docstring), and schemes that act within the few steps a case trains: pruning after steps 2, 4 and 6 (the defaults
start at step 10), freezing checked every 2 steps with a threshold that freezes (every 10 by default), early exit
at a confidence tiny models reach (0.99 by default: no token leaves)."""

OPTIONS: dict[str, list[Any]] = {
    "nproc": [1, 2, 4],
    "parallel.pp": [1, 2],
    "parallel.ep": [None, 1, 2],
    "moe.num_experts": [0, 4],
    "parallel.shard": ["none", "optimizer", "full", "auto"],
    "dynamism.scheme": ["none", "early_exit", "freezing", "mod", "pruning", "sparse_attention", "moe"],
    "pipeline.rebalance": ["off", "partition", "diffusion"],
    "pipeline.every": [1],
    "pipeline.microbatching": ["fixed", "fixed", "dynamic", "padding", "packing"],
    "pipeline.schedule": ["1f1b", "gpipe", "zb"],
    "pipeline.split_layers": [False, False, True],
    "train.recompute": ["none", "none", "full", "attention"],
    "train.precision": ["fp32", "bf16"],
    "train.grad_accum": [1, 1, 2],
    "train.record_routing_every": [0, 0, 1],
    "planner.policy": ["static", "prophet", "fastermoe"],
    "planner.plan_ahead": ["off", "off", "path"],
    "scheduler.mode": ["off", "lina"],
    "scheduler.block_overlap": [False, True],
    "scheduler.expert_packing": ["off", "off", "lina"],
    "parallel.accumulate": ["sharded", "whole"],
    "parallel.reshard": ["micro_batch", "step"],
    "parallel.param_dtype": ["fp32", "fp32", "bf16"],
    "moe.bias_update_rate": [0.0, 0.0, 0.01],
    "moe.top_k": [1, 2, 2],
    "moe.capacity_factor": [None, None, 1.25],
    "moe.kernel": ["auto", "loop", "grouped_mm"],
    # the model's and the router's variants, the data, the schedule and the planners' own switches
    "model.qk_norm": ["none", "none", "head", "full"],
    "model.sliding_window": [None, None, 16],
    "model.tie_embeddings": [False, False, True],
    "moe.gate": ["softmax_topk", "softmax_topk", "topk_softmax", "sigmoid_topk"],
    "moe.router": ["linear", "linear", "mlp_tanh"],
    "moe.first_dense": [0, 0, 1],
    "moe.shared_experts": [0, 0, 1],
    "moe.drop_policy": ["probs", "position"],
    "moe.jitter": [0.0, 0.0, 0.01],
    "moe.z_loss_coef": [0.0, 0.0, 0.001],
    "data.samples": ["packed", "packed", "documents"],
    "moe.adaptive_threshold": [None, None, 0.1],
    "data.order": ["shuffle", "shuffle", "complexity"],
    "train.schedule": ["cosine", "linear", "wsd", "constant"],
    "train.ckpt_async": [False, False, True],
    "train.grad_clip": [1.0, 1.0, 0.0],
    "parallel.reduce_dtype": ["fp32", "fp32", "bf16"],
    "pipeline.repack": [False, False, True],
    "pipeline.initial": ["uniform", "params"],
    "pipeline.wait": ["block", "block", "spin"],
    "planner.feedback.enabled": [False, False, True],
    "planner.overlap": [False, False, True],
    "planner.max_replicas": [None, None, 1],
    "scheduler.a2a_chunks": [None, None, 2],
    "scheduler.inflight": [1, 1, 2],
    # not `auto`: it times both kernels at the first pruning step, and two runs may choose differently (the last
    # bits of their losses then differ)
    "dynamism.pruning.kernel": ["dense", "dense", "csr"],
    "dynamism.sparse_attention.budget": ["coverage", "random_walk"],
    # a continuation of a Mixtral-layout checkpoint (`hf_base`): the model's shape comes from its config.json
    "hf.init_from": [None, None, None, "base"],
    # `moebal eval` of the checkpoint (`--eval`): its expert-parallel ranks, and top-1 instead of the model's k
    "eval.nproc": [2, 4],
    "eval.top_k1": [False, True],
    # a stage's memory cap on the layer planner: 4e5 bytes binds on the tiny model (a layer holds 1.5e5 to 2.5e5 of
    # weights, gradients and moments, the embedding 1.3e5), 2e6 does not
    "pipeline.memory_cap": [None, None, 4e5, 2e6],
    # planned micro-batches: planned in a background worker (the default) or inline when the step asks, and how
    # many steps ahead the batches are read (a migration or a resume plans the batches read ahead again)
    "pipeline.dynamic.workers": [1, 1, 0],
    "pipeline.dynamic.lookahead": [2, 1, 3],
    # MoD's causal predictors: with them its runs generate KV-cached (last: the earlier options keep their draws)
    "dynamism.mod.predictor": [0, 16],
    # what the balancing loss measures: pooled over the layers (its sums cross a pipeline's stages) or per row
    "moe.aux_loss_scope": ["layer", "layer", "pooled", "sequence"],
}
"""Each option's values, drawn uniformly (a value listed twice is drawn twice as often)."""

HF_SHAPE: dict[str, Any] = {"model.qk_norm": "none", "model.sliding_window": None, "model.tie_embeddings": False,
                            "moe.num_experts": 4, "moe.top_k": 2, "moe.gate": "softmax_topk", "moe.router": "linear",
                            "moe.first_dense": 0, "moe.shared_experts": 0}
"""The shape of the checkpoint `hf_base` writes (TINY's model with 4 experts, top-2: Mixtral's layout)."""


def hf_base(root: Path, timeout: float) -> Path:
    """A Mixtral-layout HF checkpoint of TINY's model (one trained step, `moebal convert moebal-to-hf`), made once
    per draw for the cases that continue it (`hf.init_from`)."""
    hf = root / "hf-base"
    if not hf.is_dir():
        run_dir = root / "hf-base-run"
        shutil.rmtree(run_dir, ignore_errors=True)
        argv = [sys.executable, "-m", "moebal.cli", "train", "--steps", "1", "--out", str(run_dir), "--nproc", "1",
                *TINY, "moe.num_experts=4", "train.ckpt_every=1"]
        for cmd in (argv, [sys.executable, "-m", "moebal.cli", "convert", "moebal-to-hf", "--arch", "mixtral",
                           str(run_dir / "ckpt-0000001"), str(hf)]):
            rc, err = run(cmd, timeout)
            if rc != 0:
                raise RuntimeError(f"the HF base checkpoint could not be made ({' '.join(cmd[2:4])}):\n{err}")
    return hf


def sample(rng: random.Random, fixed: dict[str, Any] | None = None) -> dict[str, Any]:
    """One case: a value per option (`fixed` overrides some after the draw, so the other options are the seed's
    draw all the same), then the pairs the config check refuses by design set aside (which may undo a fixed
    value: the report's options say what each case ran)."""
    c = {k: rng.choice(v) for k, v in OPTIONS.items()}
    c.update(fixed or {})
    if c["nproc"] == 1:
        c["parallel.pp"] = 1
    if c["parallel.pp"] == 1:
        c["pipeline.rebalance"], c["pipeline.microbatching"], c["pipeline.repack"] = "off", "fixed", False
    if c["parallel.pp"] > 1 or c["dynamism.scheme"] != "none":
        c["train.grad_accum"] = 1  # a pipeline, or a scheme's one stage, accumulates over its micro-batches
    if c["pipeline.microbatching"] != "fixed":
        c["pipeline.split_layers"] = False
        if c["pipeline.schedule"] == "zb":
            c["pipeline.schedule"] = "1f1b"
    if c["parallel.ep"] == 2 and (c["nproc"] // c["parallel.pp"]) % 2:
        c["parallel.ep"] = None
    if c["parallel.ep"] == 2 or c["dynamism.scheme"] == "moe":
        c["moe.num_experts"] = 4
    if c["parallel.param_dtype"] == "bf16":
        c["train.precision"] = "bf16"
        if c["parallel.shard"] in ("none", "auto"):
            c["parallel.shard"] = "optimizer"
    if c["parallel.reshard"] == "step" and c["pipeline.schedule"] == "zb":
        c["parallel.reshard"] = "micro_batch"
    if c["dynamism.scheme"] in ("early_exit", "mod"):
        c["train.record_routing_every"] = 0
        if c["moe.aux_loss_scope"] == "sequence":
            c["moe.aux_loss_scope"] = "layer"  # their MoE layers see token subsets, not rows
    if not c["moe.num_experts"]:
        c["parallel.ep"] = None if c["parallel.ep"] == 2 else c["parallel.ep"]
        c.update({"planner.policy": "static", "planner.plan_ahead": "off", "scheduler.expert_packing": "off",
                  "moe.bias_update_rate": 0.0, "train.record_routing_every": 0})
    if c["parallel.shard"] == "none":
        c["parallel.reduce_dtype"] = "fp32"  # the sharded state's mixed-precision policy
    if not c["moe.num_experts"] or c["moe.top_k"] < 2:
        c["moe.adaptive_threshold"] = None
    if c["moe.adaptive_threshold"] is None or c["dynamism.scheme"] in ("early_exit", "mod"):
        c["data.order"] = "shuffle"  # it orders by how many of every token the adaptive gate sends to two experts
    if c["dynamism.scheme"] == "sparse_attention":
        c["model.sliding_window"] = None  # it runs causal attention over the whole row
        if c["pipeline.microbatching"] != "fixed":
            c["pipeline.dynamic.pad_multiple"] = 16  # whole blocks of dynamism.sparse_attention.block
    if c["hf.init_from"]:  # the checkpoint's shape: a setting that disagrees with its config.json is refused
        c.update(HF_SHAPE)
    if c["planner.policy"] == "static" or c["parallel.pp"] > 1 or c["dynamism.scheme"] != "none":
        c["planner.plan_ahead"] = "off"  # it plans replicas, in the trainer without a pipeline
    if c["planner.plan_ahead"] == "path":
        c["planner.path_len"] = 1  # layers 1.. planned ahead: the default 3 leaves none of TINY's 3 or 4 MoE layers
    return c


def train_argv(case: dict[str, Any], out: Path, steps: int) -> list[str]:
    # a continuation reads the model's shape from the checkpoint (Mixtral's one FFN width stands for both)
    tiny = [x for x in TINY if not x.startswith(("model.", "moe.expert_ffn_dim"))] if case.get("hf.init_from") \
        else TINY
    argv = [sys.executable, "-m", "moebal.cli", "train", "--steps", str(steps), "--out", str(out),
            "--nproc", str(case["nproc"]), *tiny]
    for key, value in case.items():
        if key != "nproc" and not key.startswith("eval."):
            text = "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
            argv.append(f"{key}={text}")
    return argv


def run(argv: list[str], timeout: float, stdout: list[str] | None = None,
        env: dict[str, str] | None = None) -> tuple[int | str, str]:
    """(exit code or "timeout", stderr); the command's stdout appended to `stdout` when given; `env` added to this
    process's environment for the command."""
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                           env=None if env is None else {**os.environ, **env})
        if stdout is not None:
            stdout.append(p.stdout)
        return p.returncode, p.stderr
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        return "timeout", err


def verdict(rc: int | str, err: str, command: str) -> str:
    if rc == 0:
        return "ok"
    one_line = any(line.startswith(f"moebal {command}: error:") for line in err.splitlines())
    if rc == 2 and one_line and "Traceback" not in err and "failed (exit code" not in err:
        return "refused"
    return "BUG"


def served_tolerance(case: dict[str, Any]) -> float | None:
    """How close (relative) `moebal eval`'s static loss of the case's step-3 checkpoint must come to the run's own
    validation after step 3 (the same batch: `train.eval_batches` 1 of `data.batch_size` 8, and `--batch-size 8`):
    1e-5 in fp32; 1e-3 after bf16 training, which `moebal eval` serves under bf16 autocast as its validation
    computed, though on other ranks than the run's, whose rows group otherwise in bf16 (served in fp32 instead
    the two were 1e-4 apart in the draws; a model served without its scheme, or a loss over the wrong token count,
    is further off). None, no check: served at top-1 instead of the model's k, or under a capacity limit (which
    drops tokens per group of the trainer's own layout)."""
    if case["eval.top_k1"] or case["moe.capacity_factor"] is not None:
        return None
    return 1e-5 if case["train.precision"] == "fp32" else 1e-3


def val_loss(out: Path, step: int) -> float | None:
    path = out / "metrics.jsonl"
    if not path.is_file():
        return None
    return next((r["val_loss"] for r in map(json.loads, path.read_text().splitlines())
                 if r.get("step") == step and "val_loss" in r), None)


def losses(out: Path) -> dict[int, float]:
    path = out / "metrics.jsonl"
    if not path.is_file():
        return {}
    return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines()) if "loss" in r}


SPIKE = ["train.spike.action=rollback", "train.spike.factor=3", "train.spike.window=3", "train.spike.skip_extra=1",
         "train.keep_checkpoints=5"]
"""`--spike`'s run: a bad step rolls back (its loss above 3x the median of the 3 steps before), and every
checkpoint of 7 steps is kept (2, 4 and 6), so the step-4 one is there for the reference."""
SPIKE_STEP = 5


def spike_check(i: int, case: dict[str, Any], root: Path, timeout: float) -> tuple[dict[str, Any], str]:
    """(`--spike`'s row, the stderr to keep when it is a bug): 7 steps with a spike injected before step 5, then
    the step-4 checkpoint resumed elsewhere with the run's rollback record (module docstring)."""
    out, ref = root / f"case{i}-spike", root / f"case{i}-spike-ref"
    rc, err = run(train_argv(case, out, 7) + SPIKE, timeout, env={"MOEBAL_INJECT_SPIKE": str(SPIKE_STEP)})
    records = [json.loads(x) for x in (out / "rollbacks.jsonl").read_text().splitlines()] \
        if (out / "rollbacks.jsonl").is_file() else []
    row: dict[str, Any] = {"rc": rc, "rollbacks": [(r["step"], r["resume_step"]) for r in records]}
    if rc == 2 and "a re-pack released ranks" in err:
        row["verdict"] = "refused"  # a rollback cannot bring released ranks back: the run stops at the spike
        return row, ""
    if rc != 0 or row["rollbacks"] != [(SPIKE_STEP, SPIKE_STEP - 1)]:
        row["verdict"] = "BUG"
        return row, f"{err}\nrollbacks {row['rollbacks']}, expected one from step {SPIKE_STEP} to {SPIKE_STEP - 1}"
    ref.mkdir(parents=True)
    shutil.copy(out / "rollbacks.jsonl", ref / "rollbacks.jsonl")  # the resume skips the batches the run skipped
    rc2, err2 = run(train_argv(case, ref, 7) + SPIKE + ["--resume-from", str(out / f"ckpt-{SPIKE_STEP - 1:07d}")],
                    timeout)
    rolled, resumed = losses(out), losses(ref)
    row["bitwise"] = rc2 == 0 and sorted(resumed) == list(range(SPIKE_STEP, 8)) and \
        all(rolled.get(k) == v for k, v in resumed.items())
    row["verdict"] = "ok" if row["bitwise"] else "BUG"
    return row, "" if row["bitwise"] else f"{err2}\nlosses {rolled} against {resumed}"


KILL_AFTER = 4
"""`--kill`'s rank dies as soon as this step's checkpoint is complete (its directory renamed into place)."""
LEFT_BEHIND_S = 10.0
"""How long the processes of a `--kill` or `--launch` job may outlive its launcher before they count as left behind."""
MARKER = "MOEBAL_COMPOSE_JOB"
"""The environment variable that marks the processes of a `--kill` or `--launch` job (each job its own value)."""


def job_processes(marker: str) -> list[int]:
    """The live processes whose environment holds `marker` (NAME=value): every process a launcher started with it
    (forked ranks show the forkserver's environment, which holds it too)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if marker.encode() in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def wait_for_exit(marker: str) -> list[str]:
    """After a job's launcher returned: the job's processes still alive `LEFT_BEHIND_S` later (what it started may
    take a moment to exit on a busy machine), described, then killed."""
    deadline = time.monotonic() + LEFT_BEHIND_S
    while (left := job_processes(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    described = [describe_process(pid) for pid in left]
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 9)
    return described


def describe_process(pid: int) -> str:
    """PID, its name and command line, and its parent, as /proc has them (what a process left behind was)."""
    proc = Path("/proc") / str(pid)
    try:
        comm = (proc / "comm").read_text().strip()
        cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        parent = next(line.split()[1] for line in (proc / "status").read_text().splitlines()
                      if line.startswith("PPid:"))
    except (OSError, StopIteration):
        return f"{pid} (gone)"
    return f"{pid} {comm!r} parent {parent}: {cmd[:200]}"


def kill_verdict(killed: bool, rc: int | str, restarted: bool, bitwise: bool, left_behind: int) -> str:
    """`--kill`'s verdict: ok when the killed job restarted, exited 0 with the uninterrupted run's losses and left no
    process behind; `unkilled` (nothing tested) when it ended before the kill and is otherwise fine; else BUG."""
    if not killed:
        return "unkilled" if rc == 0 and bitwise and not left_behind else "BUG"
    return "ok" if rc == 0 and restarted and bitwise and not left_behind else "BUG"


def kill_check(i: int, case: dict[str, Any], root: Path, timeout: float, seed: int) -> tuple[dict[str, Any], str]:
    """(`--kill`'s row, the stderr to keep when it is a bug): 7 steps uninterrupted, then 7 steps in which one
    rank is SIGKILLed once the step-4 checkpoint is complete and the launcher restarts the job (module
    docstring)."""
    from moebal.distributed.testing import kill_rank_when

    rank = random.Random(seed * 100_003 + i).randrange(case["nproc"])
    ref, out = root / f"case{i}-kill-ref", root / f"case{i}-kill"
    row: dict[str, Any] = {"rank": rank}
    rc, err = run(train_argv(case, ref, 7), timeout)
    if rc != 0:
        row.update(verdict="BUG", rc=rc)
        return row, f"the uninterrupted 7 steps failed:\n{err}"
    marker = f"{MARKER}={uuid.uuid4().hex}"
    out.mkdir(parents=True)
    log = out.parent / f"case{i}-kill.stderr"
    with open(log, "w") as err_file:
        proc = subprocess.Popen(train_argv(case, out, 7) + ["--max-restarts", "1"], stdout=subprocess.DEVNULL,
                                stderr=err_file, env={**os.environ, MARKER: marker.partition("=")[2]})
        try:
            kill_rank_when(lambda: (out / f"ckpt-{KILL_AFTER:07d}").is_dir(), rank=rank, marker=marker,
                           timeout_s=timeout, alive=lambda: proc.poll() is None)
            row["killed"] = True
        except TimeoutError:
            row["killed"] = False
        try:
            row["rc"] = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            row["rc"] = "timeout"
    err = log.read_text()
    row["left"] = wait_for_exit(marker)
    a, b = losses(ref), losses(out)
    va, vb = ({s: val_loss(o, s) for s in (3, 6)} for o in (ref, out))
    row["bitwise"] = sorted(b) == list(range(1, 8)) and a == b and va == vb
    restarted = "restarting every rank from the last checkpoint (restart 1 of 1)" in err
    row["verdict"] = kill_verdict(row["killed"], row["rc"], restarted, row["bitwise"], len(row["left"]))
    return row, "" if row["verdict"] != "BUG" else (f"{err}\nrank {rank} killed: {row['killed']}, restarted: "
                                                    f"{restarted}, processes left behind: {row['left']}\n"
                                                    f"losses {a} {va} against {b} {vb}")


def cluster_file(case: dict[str, Any], out: Path, port: int, marker: str) -> dict[str, Any]:
    """`--launch`'s cluster file: two nodes on this machine (`sh -c`, no ssh), half of the case's ranks each, the
    case's options and TINY as the training overrides, 3 steps."""
    argv = train_argv(case, out, 3)
    overrides: dict[str, Any] = {"train.steps": 3}
    for item in argv[argv.index("--nproc") + 2:]:
        key, _, value = item.partition("=")
        overrides[key] = yaml.safe_load(value)
    half = case["nproc"] // 2
    return {"name": "compose",
            "nodes": [{"host": f"node{k}", "addr": "127.0.0.1", "slots": half} for k in range(2)],
            "rendezvous": {"port": port, "join_timeout_s": 120},
            "env": {MARKER: marker.partition("=")[2]},
            "ssh": {"command": "sh -c {command}", "stop_grace_s": 5},
            "train": {"overrides": overrides, "out": str(out)}}


def launch_check(i: int, case: dict[str, Any], root: Path, timeout: float) -> tuple[dict[str, Any], str]:
    """(`--launch`'s row, the stderr to keep when it is a bug): the case as a two-node `moebal launch` job against
    its own `--nproc` run (module docstring)."""
    from moebal.launch.spawn import free_port

    out, marker = root / f"case{i}-launch", f"{MARKER}={uuid.uuid4().hex}"
    spec = root / f"case{i}-cluster.yaml"
    spec.write_text(yaml.safe_dump(cluster_file(case, out, free_port(), marker)), encoding="utf-8")
    rc, err = run([sys.executable, "-m", "moebal.cli", "launch", str(spec)], timeout)
    left = wait_for_exit(marker)
    a, b = losses(root / f"case{i}"), losses(out)
    row: dict[str, Any] = {"rc": rc, "left": left,
                           "bitwise": sorted(b) == [1, 2, 3] and a == b and
                           val_loss(root / f"case{i}", 3) == val_loss(out, 3)}
    row["verdict"] = "ok" if rc == 0 and row["bitwise"] and not left else "BUG"
    return row, "" if row["verdict"] == "ok" else f"{err}\nprocesses left behind: {left}\nlosses {a} against {b}"


GEN_PROMPT = list(range(40, 52))
"""`--generate`'s prompt: 12 byte ids (a byte-tokenizer run's "()*+,-./0123"; ids of the HF base's vocabulary)."""
GEN_NEW = 8
GEN_TOL = 1e-4


def generate_check(out: Path, timeout: float) -> tuple[dict[str, Any], str]:
    """(`--generate`'s row, the stderr to keep when it is a bug): `moebal generate` of the run in `out`, then its
    KV-cached decoder against the model's forward (module docstring)."""
    printed: list[str] = []
    rc, err = run([sys.executable, "-m", "moebal.cli", "generate", str(out), "--prompt-ids",
                   ",".join(map(str, GEN_PROMPT)), "--max-new-tokens", str(GEN_NEW), "--stop-id", "-1", "--json"],
                  timeout, printed)
    row: dict[str, Any] = {"rc": rc, "verdict": verdict(rc, err, "generate")}
    if row["verdict"] != "ok":
        return row, err if row["verdict"] == "BUG" else ""
    got = json.loads(printed[0].strip().splitlines()[-1])
    row["cache"], row["tokens"] = got["cache"], got["tokens"]
    if got["cache"]:
        from moebal.commands.generate import load_source

        model = load_source(out).model
        row["logits_diff"], row["argmax_gap"] = cached_against_full(model, GEN_PROMPT, got["tokens"])
        seq = GEN_PROMPT + got["tokens"]
        row["batch_diff"] = batch_against_alone(model, [seq, seq[:7]])
        if not (row["logits_diff"] <= GEN_TOL and row["argmax_gap"] <= GEN_TOL and row["batch_diff"] <= GEN_TOL):
            row["verdict"] = "BUG"
            return row, (f"{printed[0]}\ncached logits {row['logits_diff']:.3g} of the largest away from the "
                         f"forward's; a generated token {row['argmax_gap']:.3g} below the forward's most likely; "
                         f"a batch's rows {row['batch_diff']:.3g} away from the same sequences alone")
    return expert_parallel_check(out, timeout, row)


def expert_parallel_check(out: Path, timeout: float, row: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """`generate_check`'s expert-parallel part (module docstring): `row` with `ep` added, and the stderr to keep when
    it is a bug. A model without MoE layers, or with experts that 2 ranks cannot share, skips it."""
    from moebal.commands.generate import load_source

    model = load_source(out).model
    layers = list(model.moe_layers())
    if not layers or layers[0].num_experts % 2:
        return row, ""
    printed: list[str] = []
    rc, err = run([sys.executable, "-m", "moebal.cli", "generate", str(out), "--prompt-ids",
                   ",".join(map(str, GEN_PROMPT)), "--prompt-ids", ",".join(map(str, GEN_PROMPT[:5])),
                   "--max-new-tokens", str(GEN_NEW), "--stop-id", "-1", "--json", "--nproc", "2", "--policy", "oracle",
                   "--batch-size", "2"], timeout, printed)
    ep: dict[str, Any] = {"rc": rc, "verdict": verdict(rc, err, "generate")}
    row["ep"] = ep
    if ep["verdict"] != "ok":
        if ep["verdict"] == "BUG":
            row["verdict"] = "BUG"
        return row, err if ep["verdict"] == "BUG" else ""
    lines = [json.loads(line) for line in printed[0].strip().splitlines()]
    tokens, summary = lines[0]["tokens"], lines[-1]["expert_parallel"]["policies"]
    ep["equal_static"] = summary["oracle"]["tokens_equal_static"]
    ep["equal_one_process"] = tokens == row.get("tokens")
    import torch

    from moebal.models.generate import causal_routing, dropless

    # the served forward as generation runs it, over each token's own prefix: a scheme's run without a cached form
    # (MoD by top-k, sparse attention) computes another function of a prefix inside a longer sequence
    seq = GEN_PROMPT + tokens
    with torch.no_grad(), dropless(model), causal_routing(model):
        gaps = [argmax_gap(model.eval()(torch.tensor([seq[:n]])).logits[0].float(), n, [seq[n]])
                for n in range(len(GEN_PROMPT), len(seq))]
    ep["argmax_gap"] = max(gaps)
    if not (ep["equal_static"] and ep["argmax_gap"] <= GEN_TOL):
        row["verdict"] = "BUG"
        return row, (f"{printed[0]}\nexpert-parallel generation: oracle tokens equal static's: {ep['equal_static']}; "
                     f"a token {ep['argmax_gap']:.3g} below the forward's most likely")
    return row, ""


def cached_against_full(model: Any, prompt: list[int], tokens: list[int]) -> tuple[float, float]:
    """(the largest difference between the KV-cached decoder's logits and the forward's over `prompt` + `tokens`,
    the largest margin by which a generated token falls short of the forward's most likely one at its position),
    both relative to the largest logit; `model` loaded as `moebal generate` loads it."""
    import torch

    from moebal.models.generate import KVCache, cached_forward, causal_routing, dropless

    ids = torch.tensor([prompt + tokens])
    n, total = len(prompt), ids.shape[1]
    cache = KVCache.empty(len(model.model.layers), total)
    with torch.no_grad(), dropless(model), causal_routing(model):  # (MoD with predictors: routed by them)
        full = model(ids).logits[0].float()
        parts = [cached_forward(model, ids[:, :n], cache)]
        parts += [cached_forward(model, ids[:, t:t + 1], cache) for t in range(n, total)]
    cached = torch.cat(parts, dim=1)[0].float()
    return float((cached - full).abs().max()) / float(full.abs().max()), argmax_gap(full, n, tokens)


def argmax_gap(full: Any, n: int, tokens: list[int]) -> float:
    """The largest margin by which a token generated after an `n`-token prompt falls short of the most likely one
    of the forward's logits `full` [positions, V] at its position, relative to the largest logit."""
    import torch

    at = full[n - 1:n - 1 + len(tokens)]  # the logits each generated token was chosen from
    gap = at.max(-1).values - at[torch.arange(len(tokens)), torch.tensor(tokens)]
    return float(gap.max()) / float(full.abs().max())


def batch_against_alone(model: Any, seqs: list[list[int]]) -> float:
    """The largest difference, relative to the largest logit, between the KV-cached logits of `seqs` as one
    left-padded batch (`moebal generate`'s batches) and of each sequence alone, at its real positions."""
    import torch

    from moebal.models.generate import KVCache, cached_forward, dropless

    longest, layers = max(map(len, seqs)), len(model.model.layers)
    pad = torch.tensor([longest - len(q) for q in seqs])
    ids = torch.tensor([[0] * int(k) + q for k, q in zip(pad, seqs)])
    with torch.no_grad(), dropless(model):
        batch = cached_forward(model, ids, KVCache.empty(layers, longest), pad).float()
        alone = [cached_forward(model, torch.tensor([q]), KVCache.empty(layers, len(q)))[0].float() for q in seqs]
    scale = max(float(a.abs().max()) for a in alone)
    return max(float((batch[b, int(pad[b]):] - a).abs().max()) for b, a in enumerate(alone)) / scale


def check_case(i: int, case: dict[str, Any], root: Path, args: argparse.Namespace) -> dict[str, Any]:
    out = root / f"case{i}"
    if case.get("hf.init_from"):
        case = {**case, "hf.init_from": str(hf_base(root, args.timeout))}
    t0 = time.perf_counter()
    rc, err = run(train_argv(case, out, 3), args.timeout)
    row: dict[str, Any] = {"case": i, "options": case, "rc": rc, "verdict": verdict(rc, err, "train"),
                           "line": next((x for x in err.splitlines() if "error:" in x), "")[:300]}
    bad = {"train": err} if row["verdict"] == "BUG" else {}
    if row["verdict"] == "ok" and args.resume:
        # the same run (train.steps 3: the learning-rate schedule's horizon) resumed from its step-2 checkpoint
        half = root / f"case{i}-resumed"
        rc2, err2 = run(train_argv(case, half, 3) + ["--resume-from", str(out / "ckpt-0000002")], args.timeout)
        whole, resumed = losses(out), losses(half)
        row["resume"] = {"rc": rc2, "bitwise": 3 in resumed and all(whole.get(k) == v for k, v in resumed.items())}
        if not row["resume"]["bitwise"]:
            row["verdict"] = "BUG-resume"
            bad["resume"] = f"{err2}\nlosses {whole} against {resumed}"
    if row["verdict"] == "ok" and args.eval and case["moe.num_experts"]:
        # with recorded routing, Lina's path profile (`moebal paths`) and every policy, whose logits must equal
        # static expert parallelism's; else static alone
        lina = case["train.record_routing_every"] > 0
        rc3, err3, command = 0, "", "eval"
        if lina:
            rc3, err3 = run([sys.executable, "-m", "moebal.cli", "paths", str(out)], args.timeout)
            command = "paths" if rc3 else command
        printed: list[str] = []
        if rc3 == 0:
            rc3, err3 = run([sys.executable, "-m", "moebal.cli", "eval", str(out), "--nproc", str(case["eval.nproc"]),
                             "--policy", "all" if lina else "static", "--batches", "1", "--batch-size", "8", "--json",
                             *(["--top-k", "1"] if case["eval.top_k1"] else [])], args.timeout, printed)
        row["eval"] = {"rc": rc3, "policy": "all" if lina else "static", "verdict": verdict(rc3, err3, command)}
        if row["eval"]["verdict"] == "ok" and command == "eval":
            res = json.loads(printed[0].strip().splitlines()[-1])
            unequal = [p for p in res if isinstance(res[p], dict) and res[p].get("equal_static") is False]
            trained, served = val_loss(out, 3), res["static"]["val_loss"]
            row["eval"]["val_loss"] = [trained, served]
            if unequal:
                row["eval"]["verdict"], err3 = "BUG", f"logits unequal to static under {unequal}\n{printed[0]}"
            elif (tol := served_tolerance(case)) is not None and (trained is None or
                                                                   abs(served - trained) > tol * trained):
                row["eval"]["verdict"] = "BUG"
                err3 = (f"served static val loss {served} against the run's validation after step 3: {trained} "
                        f"(tolerance {tol:g})")
        if row["eval"]["verdict"] == "BUG":
            row["verdict"] = "BUG-eval"
            bad["eval"] = err3
    if row["verdict"] == "ok" and args.generate:
        row["generate"], err7 = generate_check(out, args.timeout)
        if row["generate"]["verdict"] == "BUG":
            row["verdict"] = "BUG-generate"
            bad["generate"] = err7
    if row["verdict"] == "ok" and args.spike:
        row["spike"], err4 = spike_check(i, case, root, args.timeout)
        if row["spike"]["verdict"] == "BUG":
            row["verdict"] = "BUG-spike"
            bad["spike"] = err4
    if row["verdict"] == "ok" and args.kill and case["nproc"] > 1:  # one process has no launcher to restart it
        row["kill"], err5 = kill_check(i, case, root, args.timeout, args.seed)
        if row["kill"]["verdict"] == "BUG":
            row["verdict"] = "BUG-kill"
            bad["kill"] = err5
    if row["verdict"] == "ok" and args.launch and case["nproc"] > 1:
        row["launch"], err6 = launch_check(i, case, root, args.timeout)
        if row["launch"]["verdict"] == "BUG":
            row["verdict"] = "BUG-launch"
            bad["launch"] = err6
    row["seconds"] = round(time.perf_counter() - t0, 1)
    for what, text in bad.items():
        keep = Path(args.keep or root)
        keep.mkdir(parents=True, exist_ok=True)
        (keep / f"case{i}.{what}.stderr").write_text(text)
    return row


def parse_fixed(items: list[str], error: Any) -> dict[str, Any]:
    """`--fix OPTION=VALUE` items as options (values read as YAML scalars: true, 2, null, bf16); `error` is called
    with a line naming what is wrong (an unknown option, or a value the draw never takes)."""
    fixed: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or key not in OPTIONS:
            close = difflib.get_close_matches(key, OPTIONS, n=1)
            error(f"--fix {item}: expected OPTION=VALUE with an option of the draw"
                  + (f"; did you mean {close[0]}?" if close else f" ({', '.join(sorted(OPTIONS))})"))
            continue
        value = yaml.safe_load(raw)
        if value not in OPTIONS[key]:
            error(f"--fix {item}: {key} is drawn from {OPTIONS[key]}")
            continue
        fixed[key] = value
    return fixed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=40, help="cases to draw (default 40)")
    ap.add_argument("--seed", type=int, default=0, help="the draw's seed (default 0)")
    ap.add_argument("--resume", action="store_true", help="also resume each ok case from its step-2 checkpoint")
    ap.add_argument("--eval", action="store_true", help="also run moebal eval on each ok MoE case")
    ap.add_argument("--spike", action="store_true",
                    help="also train each ok case 7 steps with a spike before step 5 that must roll back bit for bit")
    ap.add_argument("--kill", action="store_true",
                    help="also train each ok case of several processes 7 steps with a rank SIGKILLed after the "
                         "step-4 checkpoint, restarted by the launcher: the losses must equal an uninterrupted run's")
    ap.add_argument("--launch", action="store_true",
                    help="also run each ok case of several processes as a two-node moebal launch job on this machine: "
                         "the losses must equal the --nproc run's")
    ap.add_argument("--generate", action="store_true",
                    help="also generate from each ok case's checkpoint: the KV-cached decoder must give the forward's "
                         "logits")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per command (default 300)")
    ap.add_argument("--fix", action="append", default=[], metavar="OPTION=VALUE",
                    help="give an option one value in every case (a YAML scalar; repeatable), to aim a draw at a "
                         "feature: --fix model.tie_embeddings=true")
    ap.add_argument("--json", help="write the report here")
    ap.add_argument("--keep", help="directory for the stderr of each BUG (default: the runs' temporary directory, "
                                   "kept when a case fails)")
    args = ap.parse_args(argv)
    if args.cases < 1:
        ap.error(f"--cases must be at least 1; got {args.cases}")
    fixed = parse_fixed(args.fix, ap.error)
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="moebal-compose-"))
    rows = []
    for i in range(args.cases):
        rows.append(check_case(i, sample(rng, fixed), root, args))
        r = rows[-1]
        kill = "".join(f"{leg} {r[leg]['verdict']}  " for leg in ("kill", "launch") if leg in r)
        print(f"case {i:>3} {r['verdict']:<10} {r['seconds']:>6.1f} s  {kill}{r['line'][:100]}", file=sys.stderr,
              flush=True)
    counts = {v: sum(r["verdict"] == v for r in rows)
              for v in ("ok", "refused", "BUG", "BUG-resume", "BUG-eval", "BUG-generate", "BUG-spike", "BUG-kill",
                        "BUG-launch")}
    failed = sum(v for k, v in counts.items() if k.startswith("BUG"))
    print(f"{args.cases} cases (seed {args.seed}): " + ", ".join(f"{k} {v}" for k, v in counts.items()),
          file=sys.stderr)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"seed": args.seed, "cases": args.cases, "resume": args.resume, "eval": args.eval,
                       "generate": args.generate, "spike": args.spike, "kill": args.kill,
                       "launch": args.launch, "fixed": fixed, "counts": counts, "rows": rows}, f,
                      indent=1)
    if failed and not args.keep:
        print(f"the failing cases' stderr is in {root}", file=sys.stderr)
    else:
        shutil.rmtree(root, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
