"""How a Mixture-of-Depths run's causal predictors route, against the top-k routing it trained with
(moebal/dynamism/mod.py, docs/dynamism.md).

On the run's validation batches, the newest checkpoint served as its validation ran (`moebal eval`'s loader):
  - the loss per token with top-k routing (what training and its validation compute: the selection spans the row);
  - the loss per token routed by the causal predictors (what generation computes: each token by its own state);
  - per routed layer, the share of tokens its predictor sends through the block, against the capacity.

    python scripts/mod_predictor_check.py RUN_DIR [--batches 8] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from moebal.commands.bench import at_least


def check(run_dir: Path, batches: int) -> dict[str, Any]:
    from moebal.commands.eval import load_run_model
    from moebal.data import build_data, eval_batches
    from moebal.dynamism.mod import MixtureOfDepths
    from moebal.dynamism.scheme import served_scheme
    from moebal.models.generate import causal_routing

    cfg, model, served = load_run_model(run_dir)
    scheme = served_scheme(model.model)
    if not isinstance(scheme, MixtureOfDepths) or not scheme.predictor:
        raise SystemExit(f"{run_dir}: not a Mixture-of-Depths run with causal predictors (dynamism.mod.predictor)")
    data = build_data(cfg)
    val = eval_batches(data.corpus.val, cfg.data.samples, cfg.data.seq_len, cfg.data.batch_size, batches)
    runs: dict[int, list[float]] = {i: [] for i in sorted(scheme.routed)}
    hooks = [model.model.layers[i].mod_predictor.register_forward_hook(
        lambda _m, _inp, out, i=i: runs[i].append(float((out > 0).float().mean()))) for i in runs]
    loss = {"top_k": 0.0, "causal": 0.0}
    tokens = 0
    with torch.no_grad():
        for b in val:
            for how in loss:
                if how == "causal":
                    with causal_routing(model):
                        logits = model(b.ids_BT).logits
                else:
                    logits = model(b.ids_BT).logits
                loss[how] += F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), b.labels_BT.reshape(-1),
                                             reduction="sum").item()
            tokens += int((b.labels_BT != -100).sum())
    for h in hooks:
        h.remove()
    return {"run_dir": str(run_dir), "step": served.step if served else None, "batches": len(val), "tokens": tokens,
            "capacity": scheme.current_capacity(), "val_loss_top_k": loss["top_k"] / tokens,
            "val_loss_causal": loss["causal"] / tokens,
            "run_share": {i: sum(v) / len(v) for i, v in runs.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir")
    ap.add_argument("--batches", type=at_least(1), default=8, help="validation batches (default 8)")
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args(argv)
    out = check(Path(args.run_dir), args.batches)
    print(json.dumps(out), file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
