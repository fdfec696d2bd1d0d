"""The harness both sharding parity tests share (`test_sharded.py`: `parallel.shard: optimizer`, `test_fsdp.py`:
`full`): one tiny MoE config, a trainer run that returns its logged rows and full parameters, both runs of a
pair on the same ranks, the 1e-5 checks, checkpoint legs for resume across shard sizes; a counter of the
collectives FSDP2 and the sharded optimizers issue."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from moebal.config import Config, from_dict

STEPS = 10
COUNTED = ("reduce_scatter_single", "all_gather_single")
"""The collectives `counting_collectives` counts: FSDP2's, the zero-bubble reducer's and the sharded optimizers'."""


@contextmanager
def counting_collectives() -> Iterator[dict[str, int]]:
    """Count the calls of `COUNTED` inside (FSDP2 and moebal's sharded optimizers look them up on the
    `torch.distributed` module): yields the counts by name, restores the functions on the way out."""
    import torch.distributed as dist

    inner = {op: getattr(dist, op) for op in COUNTED}
    counts = dict.fromkeys(COUNTED, 0)

    def counting(op: str) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            counts[op] += 1
            return inner[op](*args, **kwargs)
        return counted

    for op in COUNTED:
        setattr(dist, op, counting(op))
    try:
        yield counts
    finally:
        for op, fn in inner.items():
            setattr(dist, op, fn)
RESUME_STEPS = 6
OPTIMIZER = {"none": "AdamW", "optimizer": "ShardedAdamW", "full": "FullyShardedAdamW"}
"""The optimizer class each `parallel.shard` value builds."""


def shard_cfg(shard: str, ep: int | None, policy: str = "static", steps: int = STEPS,
              parallel: dict[str, Any] | None = None, sections: dict[str, dict[str, Any]] | None = None,
              **train: Any) -> Config:
    """`sections`: more settings by section (`{"scheduler": {...}}`), merged over the ones here."""
    sections = sections or {}
    return from_dict({
        "model": {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 64, "max_seq_len": 32},
        "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_dim": 32, "kernel": "loop", "aux_loss_coef": 0.01},
        "data": {"seq_len": 16, "batch_size": 8, "max_bytes": 200_000},
        "train": {"steps": steps, "warmup_steps": 2, "lr": 3e-3, "eval_every": 0, "precision": "fp32",
                  "ckpt_every": 0, "progress": "plain", "threads": 1, "grad_clip": 0.5, **train},
        "parallel": {"ep": ep, "shard": shard, **(parallel or {})},
        # a fixed hardware profile and no hysteresis: the same plans in every run, and they replicate
        "planner": {"policy": policy, "costs": "rtx3090", "hysteresis": 0.0, **sections.get("planner", {})},
        **{k: v for k, v in sections.items() if k != "planner"}})


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor (FSDP2's shard) gathered whole; any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def train_run(cfg: Config, out: Path, resume: bool = False, stop: int | None = None) -> dict[str, Any]:
    """One trainer run: its logged rows (rank 0), every parameter whole, the optimizer's class name and the dtypes
    a dense weight had as the forward pass computed with it."""
    from moebal.distributed.expert_parallel import is_expert_param
    from moebal.distributed.sharded import weights_gathered
    from moebal.train.distributed import setup_parallel
    from moebal.train.trainer import Trainer

    ctx, model, hooks = setup_parallel(cfg, run_dir=out, resume=resume)
    trainer = Trainer(cfg, out, model=model, hooks=hooks, ctx=ctx, resume=resume)
    seen: set[str] = set()
    q_proj = next(m for n, m in trainer.model.named_modules() if n.endswith("q_proj"))
    q_proj.register_forward_pre_hook(lambda m, _: seen.add(str(m.weight.dtype)))
    trainer.train(stop_after=stop)
    # expert weights sharded at rest under `full` (ep > 1, dp > 1): the MoE layers whose weights hold no storage
    # between steps, then everything gathered to be read
    at_rest = sum(1 for n, p in trainer.model.named_parameters()
                  if is_expert_param(p) and n.endswith("experts.w1") and not p.untyped_storage().nbytes())
    assert at_rest == getattr(trainer.optimizer, "experts_at_rest", 0)
    with weights_gathered(trainer.optimizer):
        params = {n: full_tensor(p.detach()).clone() for n, p in trainer.model.state_dict().items()}
    trainer.close()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()] if ctx.is_main else []
    return {"rows": [r for r in rows if "loss" in r], "params": params, "optimizer": type(trainer.optimizer).__name__,
            "compute": sorted(seen), "at_rest": at_rest}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-12))


def pair(rank: int, world: int, root: str, ep: int | None, policy: str, shard: str, steps: int = STEPS,
         train: dict[str, Any] | None = None) -> dict[str, Any]:
    """Unsharded and `shard` runs on these ranks: the rows, and the worst relative difference of this rank's
    parameters (plain data: tensors do not cross the result queue)."""
    runs = {s: train_run(shard_cfg(s, ep, policy, steps, **(train or {})), Path(root) / s) for s in ("none", shard)}
    p, s = runs["none"]["params"], runs[shard]["params"]
    assert p.keys() == s.keys()
    assert (runs["none"]["optimizer"], runs[shard]["optimizer"]) == (OPTIMIZER["none"], OPTIMIZER[shard])
    return {"none": runs["none"]["rows"], shard: runs[shard]["rows"], "param_rel": max(rel(s[n], p[n]) for n in p),
            "at_rest": runs[shard]["at_rest"]}


def check_parity(out: list[dict[str, Any]], shard: str, steps: int = STEPS) -> None:
    """Losses and gradient norms of every step and the final parameters within 1e-5 relative; the clip acted."""
    plain, sharded = out[0]["none"], out[0][shard]
    assert [r["step"] for r in sharded] == list(range(1, steps + 1))
    for a, b in zip(plain, sharded):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5), (a["step"], a["loss"], b["loss"])
        assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-5), (a["step"], a["grad_norm"], b["grad_norm"])
    assert any(r["grad_norm"] > 0.5 for r in plain)  # the clip acted
    worst = max(r["param_rel"] for r in out)
    assert worst < 1e-5, worst


def leg(rank: int, world: int, root: str, shard: str, ep: int | None, resume: bool, stop: int | None,
        keep: int | None = None, sections: dict[str, dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """One leg of a resume chain: a checkpoint every 2 steps (the last `keep` kept, when given)."""
    extra = {"keep_checkpoints": keep} if keep is not None else {}
    cfg = shard_cfg(shard, ep, steps=RESUME_STEPS, ckpt_every=2, sections=sections, **extra)
    return list(train_run(cfg, Path(root), resume=resume, stop=stop)["rows"])


def checkpoint_state(path: Path) -> dict[str, torch.Tensor]:
    """Every logical tensor of a checkpoint and its AdamW moments, by name."""
    from moebal.train.checkpoint import read_checkpoint

    out: dict[str, torch.Tensor] = {}
    with read_checkpoint(path) as reader:
        for name in reader.names():
            out[name] = reader.read(name)
        for k in reader.manifest["tensors"]:
            ln, _, key = k.rpartition(":")
            if ln and key != "step":
                out[k] = reader.optimizer_state(ln)[key]
    return out


def clip_probe(opt: Any, grads: Callable[[], list[torch.Tensor]]) -> dict:
    """Clip at a max_norm above the norm (the gradients `grads` reads must stay bit for bit), then at a quarter of
    it; the norm, whether the gradients were kept, and the norm after the second clip."""
    before, above = grads(), 1e3
    norm = float(opt.clip_grad_norm(above))
    kept = len(before) > 0 and all(torch.equal(a, b) for a, b in zip(grads(), before))
    opt.clip_grad_norm(norm / 4)
    scaled = float(opt.clip_grad_norm(float("inf")))
    return {"norm": norm, "above": above, "kept": kept, "scaled": scaled}
