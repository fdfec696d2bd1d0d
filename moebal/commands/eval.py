"""`moebal eval`: a trained run's model forward on validation batches with expert parallelism on N local gloo ranks,
under Lina's inference scheduling or plain expert parallelism (moebal/distributed/lina_inference.py).

Example: moebal eval runs/default-2026... --nproc 2 --policy all --top-k 1
(`--policy all` runs static, lina, phase1 and oracle on the same batches, checks that their logits equal the
static run's bit for bit, and reports each one's MoE-layer time, the slowest rank's, per forward; a single
policy runs after static on the same batches, for the same check.)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moebal.config import SUBSET_SCHEMES
from moebal.errors import ConfigError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="a run directory with a checkpoint (moebal train --out RUN_DIR): its newest; or "
                   "one of its checkpoints (RUN_DIR/ckpt-NNNNNNN)")
    p.add_argument("--nproc", type=int, default=2, help="expert-parallel gloo ranks on this machine (default 2)")
    p.add_argument("--policy", default="all", choices=("static", "lina", "phase1", "oracle", "all"),
                   help="static expert parallelism, Lina (phases 1 and 2), phase 1 only, FFD on the real counts "
                        "(each after static, whose logits it must equal); all: each of them on the same batches "
                        "(default)")
    p.add_argument("--profile", default=None, help="path profile (default RUN_DIR/paths.npz; build it with "
                   "`moebal paths RUN_DIR`)")
    p.add_argument("--top-k", type=int, default=None, help="experts per token at inference (default: the model's)")
    p.add_argument("--batches", type=int, default=None, help="validation batches (default: the run's "
                   "train.eval_batches, so that the loss is over the samples its validation read)")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per batch over all ranks "
                   "(default: data.batch_size)")
    p.add_argument("--precision", default="run", choices=("run", "fp32", "bf16"),
                   help="compute precision: the run's train.precision (default: bf16 autocast after a bf16 run, as "
                        "its validation computed), or fp32 / bf16 autocast")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")


@dataclass(frozen=True)
class Served:
    """How a dynamism scheme's run is served (`Dynamism.serve`)."""

    scheme: str
    step: int
    """The checkpoint's step: the model runs as the run's validation after it."""
    line: str
    """How the model runs, in a line."""
    mod_capacity: float | None = None
    """A Mixture-of-Depths run's capacity at the checkpoint's step."""


@dataclass
class ServeJob:
    """What every rank of an inference job needs (pickled to the spawned ranks)."""

    model: Any  # the full model (every rank holds every expert: Lina's host-DRAM copy)
    batches: list[Any]  # global batches of token ids [B, T]; rank r takes rows [r * B/R, (r + 1) * B/R)
    policies: list[list[str]]  # per round, the policies in the order they run
    profile: Any = None
    labels: list[Any] = field(default_factory=list)  # next-token labels per batch (optional: the loss)
    threads: int = 1
    dilate: float = 1.0  # > 1: emulated devices this many times slower than a core (CPU benchmarks only)
    bf16: bool = False  # the forwards under bf16 autocast (fp32 weights), as a bf16 run's validation computed


def pack(job: ServeJob) -> bytes:
    """The job as bytes for `serve_worker` (tensors pickled by value: spawned ranks share no file descriptors)."""
    import io

    import torch

    buf = io.BytesIO()
    torch.save(job, buf)
    return buf.getvalue()


def serve_worker(rank: int, world: int, packed: bytes) -> dict[str, Any]:
    """Run every round's policies over the batches on this rank; per (round, policy) the per-forward MoE layer
    records, whether the logits equal the static run's, and the summed loss of this rank's labelled tokens."""
    import io

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from moebal.distributed.lina_inference import LinaInference

    job: ServeJob = torch.load(io.BytesIO(packed), weights_only=False)
    torch.set_num_threads(job.threads)
    model = job.model.eval()
    static_logits: dict[int, Any] = {}
    out: dict[str, Any] = {"rounds": []}
    for order in job.policies:
        rnd: dict[str, Any] = {}
        for policy in order:
            sched = LinaInference(model, dist.group.WORLD, policy, job.profile if policy in ("lina", "phase1")
                                  else None, dilate=job.dilate)
            fwd, equal, diff, loss, n = [], True, 0.0, 0.0, 0
            for b, ids in enumerate(job.batches):
                # near-equal rows per rank: a validation split shorter than one batch need not divide evenly
                mine = ids.tensor_split(world)[rank]
                lab = job.labels[b].tensor_split(world)[rank] if job.labels else None
                # a padded row's real tokens, as the run's validation gives a served scheme (`served_forward`)
                real_B = (lab != -100).sum(dim=1) if lab is not None else None
                sched.begin()
                with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=job.bf16):
                    logits = model(mine, row_tokens=real_B).logits
                fwd.append([dataclasses.asdict(r) for r in sched.records])
                if policy == "static":
                    static_logits[b] = logits
                elif b in static_logits:
                    equal = equal and bool(torch.equal(logits, static_logits[b]))
                    diff = max(diff, float((logits - static_logits[b]).abs().max()))
                if lab is not None:
                    loss += F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), lab.reshape(-1),
                                            reduction="sum").item()
                    n += int((lab != -100).sum())  # labelled tokens: a documents batch pads with -100
            rnd[policy] = {"forwards": fwd, "equal_static": equal if static_logits else None,
                           "max_diff_static": diff, "loss": loss,
                           "tokens": n}
        out["rounds"].append(rnd)
    return out


def moe_times(results: list[dict[str, Any]], rnd: int, policy: str) -> list[float]:
    """Per forward: the MoE layers' time, each layer the slowest rank's, summed over the layers."""
    from moebal.distributed.lina_inference import slowest_rank_times

    return slowest_rank_times([r["rounds"][rnd][policy]["forwards"] for r in results])


def run_of(source: Path) -> Path:
    """The run directory of `source`: itself, or the run that holds it when it is one of a run's checkpoints
    (RUN_DIR/ckpt-NNNNNNN), where a run's other files (its path profile) are."""
    from moebal.train.checkpoint import NAME_RE

    return source.parent if NAME_RE.match(source.name) and (source / "manifest.json").is_file() else source


def load_run_model(run_dir: Path, top_k: int | None = None) -> tuple[Any, Any, Served | None]:
    """(config, model, how its scheme serves it) of a run's newest checkpoint, or of the checkpoint `run_dir` names
    when it is one of a run's (RUN_DIR/ckpt-NNNNNNN: `run_of`), served with `top_k` experts per token (None:
    trained). A run whose dynamism scheme changes its outputs (Mixture-of-Depths, early exit, sparse attention)
    is served as its training validated after the checkpoint's step: the scheme's job-wide state is the
    checkpoint's, and every layer runs through the scheme (`Dynamism.serve`). None: the plain model."""
    from moebal.config import load
    from moebal.dynamism.mod import MixtureOfDepths
    from moebal.models import build_model
    from moebal.pipeline.runner import PipelineRunner
    from moebal.train.checkpoint import apply_checkpoint, find_checkpoints, read_checkpoint
    from moebal.train.pipelined import scheme_from_config

    if not (run_dir / "config.yaml").exists():
        raise ConfigError(f"{run_dir}: no config.yaml: give a run directory of `moebal train` or one of its "
                          f"checkpoints")
    # one checkpoint of a run: its own config (the one it trained with; a resumed run may have changed the run's)
    ckpts = [run_dir] if run_of(run_dir) != run_dir else find_checkpoints(run_dir)
    if not ckpts and (run_dir / "hf_config.json").is_file():  # written by `moebal convert hf-to-moebal`
        raise ConfigError(f"{run_dir}: a converted weights directory, not a training run: start a run from it "
                          f"with hf.init_from={run_dir} (docs/hf-interop.md) and evaluate that run's directory")
    if not ckpts:
        raise ConfigError(f"{run_dir}: no checkpoint: train with train.ckpt_every or let the run finish")
    cfg = load(run_dir / "config.yaml")
    model = build_model(cfg, "cpu", load_weights=False)
    scheme = scheme_from_config(cfg)
    scheme.prepare_model(model)  # structural changes the checkpoint holds (Mixture-of-Depths' routers)
    reader = read_checkpoint(ckpts[-1])
    apply_checkpoint(reader, model, None)
    served = None
    if scheme.changes_outputs:
        ranks = {k: v["pipeline"] for k, v in reader.state.get("ranks", {}).items() if "pipeline" in v}
        job = PipelineRunner.job_state(ranks)
        if job.get("scheme_name") == scheme.name:
            scheme.load_state_dict(job["scheme"])
        line = scheme.serve(model, reader.step)
        assert line is not None  # a scheme that changes outputs serves through itself
        served = Served(scheme.name, reader.step, line, scheme.current_capacity() if isinstance(scheme, MixtureOfDepths)
                        else None)
    if top_k is not None:
        set_top_k(model, top_k)
    return cfg, model.eval(), served


def set_top_k(model: Any, k: int) -> None:
    """Serve every MoE layer with k experts per token."""
    for layer in model.moe_layers():
        if not 1 <= k <= layer.num_experts:
            raise ConfigError(f"--top-k must be in 1..{layer.num_experts}; got {k}")
        layer.spec = dataclasses.replace(layer.spec, top_k=k)
        layer.top_k = k


def policies_and_profile(policy: str, profile_arg: str | None, source: Path, scheme: str,
                         model: Any) -> tuple[list[str], Any]:
    """(the policies to run, static first: its outputs are the reference the others must equal bit for bit; the
    path profile Lina's policies plan from, None for the others), for `--policy` and `--profile` (default
    SOURCE/paths.npz) of `model`, trained with dynamism scheme `scheme`; a profile of another model is refused
    here, before any rank starts."""
    from moebal.distributed.lina_inference import check_profile
    from moebal.planner.paths import PathProfile

    policies = ["static", "lina", "phase1", "oracle"] if policy == "all" else list(dict.fromkeys(["static", policy]))
    if scheme in SUBSET_SCHEMES and {"lina", "phase1"} & set(policies):  # (moebal.config's)
        what = "its routed layers skip tokens" if scheme == "mod" else "its tokens leave early"
        raise ConfigError(f"{source} trained with dynamism scheme {scheme}: {what}, so a token has no path over the "
                          f"layers for Lina to estimate from (and its training could not record one); use --policy "
                          f"static or oracle")
    if not {"lina", "phase1"} & set(policies):
        return policies, None
    path = Path(profile_arg) if profile_arg else source / "paths.npz"
    if not path.exists():
        raise ConfigError(f"{path}: no path profile: build one with `moebal paths {source}` (record the routing "
                          f"with train.record_routing_every=N), or use --policy static")
    try:
        profile = PathProfile.load(path)
        check_profile(model, profile)
    except ValueError as e:
        raise ConfigError(f"{path}: {e}" if str(path) not in str(e) else str(e)) from e
    return policies, profile


def run(args: argparse.Namespace) -> int:
    import torch

    from moebal.data import build_data, eval_batches
    from moebal.distributed.ep_generate import check_expert_parallel
    from moebal.distributed.testing import run_ranks
    from moebal.train.precision import compute_precision

    run_dir = Path(args.run_dir)
    if args.nproc < 1 or (args.batches is not None and args.batches < 1) or (args.batch_size is not None
                                                                              and args.batch_size < 1):
        raise ConfigError(f"--nproc, --batches and --batch-size must be >= 1; got {args.nproc}, {args.batches}, "
                          f"{args.batch_size}")
    cfg, model, served = load_run_model(run_dir, args.top_k)
    try:
        check_expert_parallel(model, args.nproc, "its validation loss is in the run's metrics.jsonl")
    except ValueError as e:
        raise ConfigError(f"{run_dir}: {e}") from None
    policies, profile = policies_and_profile(args.policy, args.profile, run_of(run_dir), cfg.dynamism.scheme,
                                             model)
    bs = args.batch_size or cfg.data.batch_size
    if bs % args.nproc:
        raise ConfigError(f"--batch-size {bs} must be a multiple of --nproc {args.nproc}")
    data = build_data(cfg)
    # the run's own count by default: a different one spreads its samples over the split otherwise (linspace)
    batches = args.batches if args.batches is not None else cfg.train.eval_batches
    val = eval_batches(data.corpus.val, cfg.data.samples, cfg.data.seq_len, bs, batches)
    pairs = [(b.ids_BT, b.labels_BT) for b in val if b.ids_BT.shape[0] == bs]
    if not pairs:  # a validation split shorter than one batch: all its rows, split near-evenly over the ranks
        if val[0].ids_BT.shape[0] < args.nproc:
            raise ConfigError(f"{run_dir}: the validation split holds {val[0].ids_BT.shape[0]} rows, fewer than "
                              f"--nproc {args.nproc}: use fewer ranks")
        pairs = [(val[0].ids_BT, val[0].labels_BT)]
    precision = compute_precision(cfg.train.precision, torch.device("cpu")) if args.precision == "run" \
        else args.precision
    job = ServeJob(model=model, batches=[ids for ids, _ in pairs], labels=[labels for _, labels in pairs],
                   policies=[policies], profile=profile, bf16=precision == "bf16")
    try:
        results = run_ranks(serve_worker, args.nproc, pack(job), timeout_s=1800)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    summary: dict[str, Any] = {"run_dir": str(run_dir), "nproc": args.nproc, "batches": len(pairs),
                               "top_k": model.moe_layers().__next__().top_k, "torch": torch.__version__,
                               "precision": precision,
                               "served": dataclasses.asdict(served) if served else None}
    for p in policies:
        rs = [r["rounds"][0][p] for r in results]
        times = moe_times(results, 0, p)
        loss = sum(r["loss"] for r in rs) / max(sum(r["tokens"] for r in rs), 1)
        summary[p] = {"moe_s_median": statistics.median(times), "val_loss": loss, "ppl": math.exp(min(loss, 50)),
                      "equal_static": all(r["equal_static"] for r in rs) if p != "static" else None,
                      "replans": sum(sum(x["replanned"] for x in f) for f in rs[0]["forwards"])}
    if args.json:
        print(json.dumps(summary))
    else:
        if served is not None:
            print(f"served as the run validated after step {served.step}: {served.line}")
        for p in policies:
            s = summary[p]
            eq = "" if s["equal_static"] is None else f", logits equal static: {s['equal_static']}"
            print(f"{p:7s} MoE layers {s['moe_s_median'] * 1e3:.1f} ms per forward (slowest rank, median), "
                  f"val loss {s['val_loss']:.4f}{eq}")
    return 0
