"""Tutel, the optional third-party MoE layer the benchmarks time beside moebal (`moebal bench layer`,
`scripts/bench_expert_parallel.py`). Tutel is never imported at module load: only the functions below import
it, and only when a benchmark runs its method.

What this module pins down, read from Tutel's source (github.com/microsoft/tutel, tutel/impls/moe_layer.py,
tutel/experts/llama_ffn.py, tutel/impls/fast_dispatch.py):
  - the layer: `tutel.moe.moe_layer(gate_type={"type": "top", "k": K, "capacity_factor": c}, model_dim=D,
    experts={...}, group=...)`; capacity_factor 0 is dropless (every expert padded to the largest load,
    taken over the group), c > 0 caps each expert at K * int(c * ceil(T / E)) rows and drops the rest;
  - the expert: "llama_ffn", Tutel's SwiGLU expert act(x W_fc1) * (x W_fc2) W_fc3, given an explicit
    `activation_fn` (silu), so that each routed row costs what moebal's SwiGLU costs (Tutel's "ffn" expert is
    a 2-matrix MLP, and its default activation raises NameError in some versions);
  - the weights: W_fc1, W_fc2 hold [local experts, D, F] and W_fc3 [local experts, F, D], flattened (Tutel
    shards them when an expert spans several devices); the gate is `gates[0].wg`, a bias-free Linear(D, E).

Shape legend: T tokens, D model dim, F expert hidden dim, E experts (global), L local experts, K top_k.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import subprocess
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

NOT_IMPORTABLE = ("tutel is not importable: not installed, and the package index has no 'tutel' distribution "
                  "(it installs from source: see docs/benchmarks.md)")
EXPERT_TYPE = "llama_ffn"
"""Tutel's SwiGLU expert (tutel/experts/llama_ffn.py)."""


def tutel_importable() -> bool:
    return importlib.util.find_spec("tutel") is not None


def tutel_provenance() -> dict[str, str]:
    """The Tutel a benchmark ran: version, commit and where it came from ("unknown" where nothing says).

    The commit comes from pip's record of a git install (direct_url.json), else from the source checkout the
    package is imported from (an editable install or a clone on sys.path)."""
    out = {"version": "unknown", "commit": "unknown", "source": "unknown"}
    try:
        dist = metadata.distribution("tutel")
    except metadata.PackageNotFoundError:
        dist = None
    if dist is not None:
        out["version"] = dist.version or "unknown"
        direct = json.loads(dist.read_text("direct_url.json") or "{}")
        out["source"] = direct.get("url", "unknown")
        out["commit"] = direct.get("vcs_info", {}).get("commit_id", "unknown")
    module = importlib.import_module("tutel")
    if out["version"] == "unknown":
        out["version"] = str(getattr(module, "__version__", "unknown"))
    file = getattr(module, "__file__", None)
    if out["commit"] == "unknown" and file:
        out["commit"] = _checkout_commit(Path(file).resolve().parent)
    return out


def _checkout_commit(package_dir: Path) -> str:
    """HEAD of the git checkout whose top level holds `package_dir` directly (a site-packages that happens to
    sit inside some other repository must not lend that repository's commit)."""
    try:
        top = subprocess.run(["git", "-C", str(package_dir), "rev-parse", "--show-toplevel", "HEAD"],
                             capture_output=True, text=True, timeout=10, check=True).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if len(top) == 2 and Path(top[0]).resolve() == package_dir.parent:
        return top[1]
    return "unknown"


def tutel_layer(*, dim: int, ffn: int, experts: int, top_k: int, capacity_factor: float, world: int = 1,
                group: Any = None) -> Any:
    """Tutel's `moe_layer` with its SwiGLU expert and an explicit silu, E / world experts on each rank."""
    import torch
    from tutel import moe as tutel_moe

    if experts % world:
        raise ValueError(f"Tutel holds the same number of experts on every rank: {experts} experts do not "
                         f"divide over {world} ranks; pick an expert count that is a multiple of the ranks")
    return tutel_moe.moe_layer(
        gate_type={"type": "top", "k": top_k, "capacity_factor": capacity_factor},
        model_dim=dim,
        experts={"type": EXPERT_TYPE, "count_per_node": experts // world, "hidden_size_per_expert": ffn,
                 "activation_fn": torch.nn.functional.silu},
        group=group,
    )


def load_moebal_weights(layer: Any, gate_ED: Any, w1_LFD: Any, w3_LFD: Any, w2_LDF: Any) -> None:
    """Copy a moebal router and its SwiGLU experts (w1, w3 [L, F, D], w2 [L, D, F]; this rank's L experts)
    into a Tutel layer, so both compute the same function and route the same way."""
    import torch

    targets = {"W_fc1": w1_LFD.transpose(1, 2), "W_fc2": w3_LFD.transpose(1, 2), "W_fc3": w2_LDF.transpose(1, 2)}
    with torch.no_grad():
        layer.gates[0].wg.weight.copy_(gate_ED)
        for name, w in targets.items():
            p = getattr(layer.experts, name)
            if p.numel() != w.numel():
                raise ValueError(f"Tutel's {EXPERT_TYPE} {name} holds {p.numel()} values, moebal's matching expert "
                                 f"weights {w.numel()}: this Tutel lays its SwiGLU expert out differently; update "
                                 f"load_moebal_weights in moebal/commands/third_party.py")
            p.copy_(w.reshape(p.shape))


def routing_hook(bias_E: Callable[[], Any], counts: list[Any] | None = None) -> Callable[..., Any]:
    """A forward hook for Tutel's gate: adds the benchmark's routing bias to the logits (so the expert
    choice equals moebal's under the same bias) and, given `counts`, keeps the last call's per-expert row
    counts. Tutel has no choice-only bias, so its combine weights see the bias too; that changes no work."""
    def hook(_module: Any, _inputs: Any, logits_TE: Any) -> Any:
        b = bias_E()
        if b is not None:
            logits_TE = logits_TE + b.to(logits_TE.device, logits_TE.dtype)
        if counts is not None:
            k = _module.top_k if hasattr(_module, "top_k") else 1
            idx = logits_TE.detach().topk(k, dim=-1).indices.flatten()
            counts[:] = [idx.bincount(minlength=logits_TE.shape[-1])]
        return logits_TE

    return hook


def capacity_rows(capacity_factor: float, tokens: int, experts: int, top_k: int, counts_E: Any) -> int:
    """Rows per expert Tutel computes (fast_dispatch.extract_critical): the largest load when dropless
    (capacity factor 0), else K * int(c * ceil(T / E))."""
    if capacity_factor > 0:
        return top_k * int(capacity_factor * math.ceil(tokens / experts))
    return int(counts_E.max())


def drop_stats(capacity_factor: float, tokens: int, top_k: int, counts_E: Any) -> dict[str, Any]:
    """Dropped and padded rows of one Tutel call with per-expert loads `counts_E` (rows past an expert's
    capacity are dropped; Tutel computes every expert's full capacity, so empty slots are padding)."""
    experts = int(counts_E.numel())
    cap = capacity_rows(capacity_factor, tokens, experts, top_k, counts_E)
    routed = tokens * top_k
    dropped = int((counts_E - cap).clamp(min=0).sum())
    return {"capacity_rows_per_expert": cap, "routed_rows": routed, "computed_rows": experts * cap,
            "dropped_fraction": dropped / routed}
