"""Expert placement ahead of the gate in training (`planner.plan_ahead: path`): layer i+1's placement is planned
during layer i from Lina's sample-path estimate, so Trans (replica weights) for layer i+1 is issued before layer
i+1's gate runs. Neither Lina (inference only, every expert on every device) nor Pro-Prophet (previous
iteration's counts, planned between steps) does this.

Shape legend: T local tokens, K = top_k, E experts, R ranks of the "ep" group, P profiled paths, m path length,
L MoE layers.

One step on rank r, once `ExpertParallel.apply` armed the planner (the plan arm of the feedback):
  0. at apply, every layer planned ahead ("ahead layers": j >= l while a profile exists) starts from static
     placement and gets no Trans; the others take their previous-iteration placement and Trans as without this
     option;
  layer i's forward (`ExpertParallelDispatcher.forward`), when layer i+1 is an ahead layer:
  1. the gate has run; the tokens' first choices of layer i join their paths (device tensors, no host sync);
  2. the estimate of layer i+1 from the paths of layers i-l+1 .. i (`DevicePaths.estimate`, the profile looked up
     on the device: no host sync);
  3. the estimate travels in layer i's count all-to-all (E more int64 columns, fixed point 1/SCALE), so the
     layer's one host sync (the split sizes) brings every rank's estimate: est_RE (source rank x expert), the
     matrix Pro-Prophet's planner takes;
  4. every rank plans the same placement from est_RE (`plan_experts`, the balancer's policy and coefficients)
     and issues layer i+1's Trans now (async); layer i+1's forward waits for it before its token exchange.
Later forwards of the step (micro-batches, recomputation) keep the step's placements; Agg after the backward
pass uses them, as for any placement.

Gaps settled (docs/expert-parallel.md, "Placement ahead of the gate"):
- **First l layers**: layer j < l has no full path; it takes the previous-iteration (Pro-Prophet) placement and
  its Trans at step start. The profile's back-off would give layers 1 .. l-1 an estimate from shorter paths, but
  on training-sized batches the shorter paths forecast worse than the previous iteration (docs, accuracy table).
- **No profile**: `planner.path_profile` names a file built by `moebal paths` (loaded at start-up, refused with
  the reason when it does not fit the model); without one the profile is built online from the run's own
  routing (each rank's tokens, the last `path_window` steps, rebuilt every `path_refresh` steps). Until the first
  build every layer takes the previous-iteration placement. Ranks rebuild on the same steps, so they agree on the
  ahead layers; their profiles differ (each its own tokens) but the plan is made from every rank's estimate, so
  the placements agree.
- **Inside pipeline stages** (`StageExperts`, moebal/balance/experts.py): one `PlanAhead` per stage over the MoE
  layers it holds (indices local to the stage). Paths stop at the stage boundary: a stage's first l MoE layers take
  the previous-iteration placement. The estimate is made on the step's first micro-batch and scaled to the step
  (`set_step_scale`), one plan per step. A migration rebuilds the stage's `PlanAhead` (loaded profile: cut to the
  new layers, `PathProfile.layers`; online profile: empty again).
- **Resume**: the online profile's state (each MoE layer's routing window of this rank's tokens, the refresh
  counter, the samples taken since the last build) is checkpointed by MoE layer and token shard
  (`window_tensors`); the profile in use is rebuilt from its samples on load (`load_window`), so a resumed run
  plans what the uninterrupted one plans. Under another token-shard count, or when a planned layer's window is
  missing or was taken over other steps (`window_misfit`), the profile starts empty on every rank.
- **Placement never changes the maths**: a placement only decides where an expert's rows are computed; the
  losses equal static expert parallelism's and the gradients equal it up to the summation order of Agg
  (tests/distributed/test_plan_ahead.py).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from moebal.errors import CheckpointError
from moebal.planner.paths import PathProfile, build_profile, estimate_accuracy
from moebal.planner.plan import ExpertPlacement
from moebal.sync import to_host, upload

__all__ = ["ACCURACY_KEYS", "SCALE", "DevicePaths", "PlanAhead", "SavedWindow", "mean_accuracy", "read_windows",
           "window_name"]

SCALE = 256
"""Fixed point of the estimate in the count exchange (int64): 1/256 of an assignment."""

ACCURACY_KEYS = ("path_overlap", "path_rel_mae", "prev_overlap", "prev_rel_mae")
"""The forecast figures of one ahead layer (`PlanAhead.layer_accuracy`), in record order."""

PlanFn = Callable[[int, np.ndarray], ExpertPlacement]
"""(layer, est_RE) -> that layer's placement: the same on every rank for the same matrix."""
IssueFn = Callable[[int, ExpertPlacement], None]
"""Adopt a layer's placement and issue its Trans (ExpertParallel.place_ahead)."""


class DevicePaths:
    """A `PathProfile` on the device: per layer j >= 1 and path length m, the observed paths as sorted base-E codes
    [P], each path's distribution of layer j's assignments [P, E] (dense) and its token count [P]. `estimate` gives what
    `PathProfile.estimate` gives (up to float summation order) without leaving the device."""

    def __init__(self, profile: PathProfile, device: torch.device, path_len: int | None = None) -> None:
        """`path_len`: the longest path used (planner.path_len), at most the profile's; None: the profile's. A
        profile of longer paths is cut to it, so a loaded profile estimates as one built online at that length."""
        E = profile.num_experts
        used = profile.path_len if path_len is None else min(path_len, profile.path_len)
        if E ** max(used, 1) >= 2 ** 62:
            raise ValueError(f"planner.path_len {used} with {E} experts: paths do not fit an int64 code "
                             f"(E^l < 2^62); use a shorter planner.path_len")
        self.E, self.path_len, self.num_layers = E, used, profile.num_layers
        self.tables: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]] = [[]]
        for tabs in profile.tables[1:]:
            layer = []
            for m, t in enumerate(tabs[:used + 1]):
                weights = E ** np.arange(m - 1, -1, -1, dtype=np.int64)
                codes_P = t.keys_Pm.astype(np.int64) @ weights if m else np.zeros(len(t.tokens_P), dtype=np.int64)
                psi_PE = t.psi(np.arange(len(t.tokens_P)))  # the profile's sparse counts, dense here
                layer.append((upload(codes_P, device, torch.int64), upload(psi_PE, device, torch.float64),
                              upload(t.tokens_P, device, torch.int64), upload(weights, device, torch.int64)))
            self.tables.append(layer)

    def estimate(self, top1_TL: list[torch.Tensor], layer: int, min_tokens: int = 1) -> torch.Tensor:
        """est_E (float64): the expected assignments to each expert of `layer` of the tokens whose first choices
        in layers 0 .. layer-1 are `top1_TL` ([T] each), backing off to the longest observed suffix."""
        tabs = self.tables[layer]
        dev = top1_TL[0].device
        T = top1_TL[0].shape[0]
        # Tokens of one path share its distribution: per path length, count the tokens each path answers
        # (scatter_add_, sized by the table: no host sync, where bincount would read the largest index) and take
        # the [P] x [P, E] product, instead of gathering a [T, E] distribution per token.
        est_E = torch.zeros(self.E, dtype=torch.float64, device=dev)
        todo_T = torch.ones(T, dtype=torch.bool, device=dev)
        for m in range(len(tabs) - 1, -1, -1):  # longest path first
            codes_P, psi_PE, tokens_P, w_m = tabs[m]
            if m == 0:  # the layer's marginal: every token left
                marginal_E = psi_PE[0] if psi_PE.shape[0] == 1 else psi_PE.sum(0)
                est_E += todo_T.sum().to(torch.float64) * marginal_E
                break
            # a product and a sum, not `@`: CUDA has no integer matmul (int64 addmv is CPU-only)
            codes_T = (torch.stack(top1_TL[layer - m:layer], dim=1) * w_m).sum(dim=1)
            pos_T = torch.searchsorted(codes_P, codes_T).clamp(max=codes_P.shape[0] - 1)
            hit_T = todo_T & (codes_P[pos_T] == codes_T) & (tokens_P[pos_T] >= min_tokens)
            per_path_P = torch.zeros(codes_P.shape[0], dtype=torch.float64, device=dev)
            est_E += per_path_P.scatter_add_(0, pos_T, hit_T.to(torch.float64)) @ psi_PE
            todo_T = todo_T & ~hit_T
        return est_E


class PlanAhead:
    """The step's plan-ahead state of one "ep" group's MoE layers (see the module docstring).

    `plan(j, est_RE)` plans layer j from an estimated count matrix; `profile` is a loaded profile or None (built
    online from this rank's routing: `refresh`, `window` in steps)."""

    def __init__(self, num_layers: int, num_experts: int, path_len: int, plan: PlanFn, device: torch.device,
                 profile: PathProfile | None = None, *, top_k: int | None = None, refresh: int = 10, window: int = 40,
                 min_tokens: int = 1) -> None:
        """`top_k`: the model's; a loaded profile recorded at another k is scaled to it (its distributions sum to
        its own k: a top-1 profile on a top-2 model would plan from half the assignments), as Lina's inference
        scheduler scales it (`LinaInference.profile_scale`). None: the profile's own k."""
        if num_experts ** path_len >= 2 ** 62:
            raise ValueError(f"planner.path_len {path_len} with {num_experts} experts: paths do not fit an int64 code "
                             f"(E^l < 2^62); use a shorter planner.path_len")
        if profile is not None and (profile.num_layers != num_layers or profile.num_experts != num_experts):
            raise ValueError(f"planner.path_profile describes {profile.num_layers} MoE layers of "
                             f"{profile.num_experts} experts; the model has {num_layers} of {num_experts}: build it "
                             f"from this model's routing (`moebal paths RUN_DIR`) or set planner.path_profile null "
                             f"(built online)")
        if profile is not None and profile.path_len < path_len:
            raise ValueError(f"planner.path_profile holds paths of up to {profile.path_len} layers, planner.path_len "
                             f"is {path_len}: rebuild it with `moebal paths --path-len {path_len}` or lower "
                             f"planner.path_len")
        self.L, self.E, self.path_len, self.device = num_layers, num_experts, path_len, device
        self.plan_fn, self.online = plan, profile is None
        self.refresh, self.window, self.min_tokens = refresh, window, min_tokens
        # [L, T, K] routing of this rank, one per step that routed every layer; a profile is built from the last
        # `window`, and the (at most refresh - 1) samples taken since are kept beside them, so the profile in use
        # can be rebuilt from the samples alone (`window_tensors` / `load_window`: resume)
        self.samples: deque[np.ndarray] = deque(maxlen=window + refresh - 1)
        self.fresh = 0  # samples taken since the last build
        self.paths: DevicePaths | None = None if profile is None else DevicePaths(profile, device, path_len)
        self.profile_scale = 1.0 if profile is None or top_k is None else top_k / profile.top_k
        self.steps = 0
        self.scale = 1.0  # the step's tokens over its first forward's (`set_step_scale`)
        self._issue: IssueFn | None = None
        self.pending: set[int] = set()  # ahead layers not planned yet this step
        self.armed: list[int] = []
        self.placed: dict[int, ExpertPlacement] = {}  # this step's ahead placements
        self.estimates: dict[int, np.ndarray] = {}  # this step's est_RE per ahead layer
        self._top1: list[torch.Tensor] = []  # this forward's first choices per layer
        self._ids: list[torch.Tensor] = []  # this step's first forward's routing per layer (online profile)

    # ---- which layers ----
    def ahead_layers(self) -> list[int]:
        """Layers planned ahead now: j >= l (a full path before j), while a profile exists."""
        if self.paths is None:
            return []
        return [j for j in range(max(self.path_len, 1), self.L)]

    # ---- the step ----
    def arm(self, issue: IssueFn | None) -> list[int]:
        """Start a step: on the plan arm (`issue` given) the ahead layers become pending (returned); None: a
        step without plan-ahead (the feedback's static arm), nothing pending."""
        self._issue = issue
        self.pending = set(self.ahead_layers()) if issue is not None else set()
        self.armed = sorted(self.pending)  # the step's ahead layers (static unless planned)
        self.placed, self.estimates, self._top1, self._ids = {}, {}, [], []
        return sorted(self.pending)

    def set_step_scale(self, scale: float) -> None:
        """The step's forwards carry `scale` times the tokens of its first forward (pipeline micro-batches: the
        step's rows over the first micro-batch's). The estimate is made on the first forward and multiplied by
        it, so the plan weighs the step's expert compute, paid on every micro-batch, against Trans and Agg, paid
        once per step: the counts Pro-Prophet's planner steps on are the step's too. 1 (the default): one
        forward per step (the expert-parallel trainer)."""
        if not scale > 0:
            raise ValueError(f"plan-ahead step scale must be positive; got {scale}")
        self.scale = float(scale)

    def disarm(self) -> None:
        self._issue, self.pending = None, set()

    def on_gate(self, i: int, indices_TK: torch.Tensor) -> torch.Tensor | None:
        """Layer i's gate ran: its first choices join the paths; the estimate of layer i+1 in fixed point [E]
        (int64, device) when layer i+1 is pending, else None."""
        if self._issue is None:
            return None
        if i == 0:
            self._top1 = []
        if len(self._top1) != i:  # a later forward of the step (micro-batch) or a recomputation: plan nothing
            return None
        if self._top1 and self._top1[0].shape[0] != indices_TK.shape[0]:
            raise RuntimeError("plan-ahead follows each token through every MoE layer: layer "
                               f"{i} saw {indices_TK.shape[0]} tokens, layer 0 {self._top1[0].shape[0]}")
        self._top1.append(indices_TK[:, 0].detach())
        if i == len(self._ids):
            self._ids.append(indices_TK.detach())
        if i + 1 not in self.pending or self.paths is None:
            return None
        est_E = self.paths.estimate(self._top1, i + 1, self.min_tokens)
        return (est_E * (self.scale * self.profile_scale * SCALE)).round().to(torch.int64)

    def on_counts(self, i: int, est_RE: list[list[int]]) -> None:
        """Layer i's count exchange brought every rank's fixed-point estimate of layer i+1: plan it, issue Trans."""
        j = i + 1
        assert self._issue is not None and j in self.pending, "plan-ahead: an estimate nobody asked for"
        est = np.asarray(est_RE, dtype=np.float64) / SCALE
        placement = self.plan_fn(j, est)
        self.pending.discard(j)
        self.placed[j], self.estimates[j] = placement, est
        self._issue(j, placement)

    def end_step(self) -> None:
        """After the step: the online profile takes this step's routing (one host read of every layer's ids) and
        is rebuilt every `refresh` steps from the last `window`."""
        self.disarm()
        self.steps += 1
        if not self.online or self.L == 0 or len(self._ids) != self.L:
            return
        self.samples.append(np.asarray(to_host(torch.stack(self._ids), "plan-ahead routing"), dtype=np.int64))
        self.fresh += 1
        if self.steps % self.refresh == 0:
            self._build(list(self.samples)[-self.window:])

    def _build(self, samples: list[np.ndarray]) -> None:
        self.paths = DevicePaths(build_profile(samples, self.E, self.path_len), self.device)
        self.profile_scale = 1.0  # this model's own routing, at its own k
        self.fresh = 0

    def layer_accuracy(self, counts: dict[int, np.ndarray], previous: dict[int, np.ndarray | None],
                       top_n: int) -> dict[int, dict[str, float]]:
        """Per ahead layer planned this step: its forecasts against the real counts (R x E each), the path
        estimate the plan ran with ("path_*") and the previous-iteration forecast, Pro-Prophet's ("prev_*", absent
        without one): top-n overlap and relative MAE (`estimate_accuracy`, which scales a forecast to the real
        total first, so the step scale does not enter)."""
        out: dict[int, dict[str, float]] = {}
        for j, est_RE in self.estimates.items():
            actual_E = counts[j].sum(axis=0)
            a = estimate_accuracy(est_RE.sum(axis=0), actual_E, top_n)
            out[j] = {"path_overlap": a["overlap"], "path_rel_mae": a["rel_mae"]}
            prev = previous.get(j)
            if prev is not None:
                b = estimate_accuracy(prev.sum(axis=0), actual_E, top_n)
                out[j].update(prev_overlap=b["overlap"], prev_rel_mae=b["rel_mae"])
        return out

    def accuracy(self, counts: dict[int, np.ndarray], previous: dict[int, np.ndarray | None],
                 top_n: int) -> dict[str, float]:
        """`layer_accuracy`'s figures, means over the layers planned ahead; empty when none was."""
        return mean_accuracy(self.layer_accuracy(counts, previous, top_n).values())

    def state(self) -> dict[str, Any]:
        return {"steps": self.steps, "online": self.online, "ahead_layers": self.ahead_layers()}

    # ---- checkpoints: the online profile's state, per MoE layer and token shard ----
    def window_tensors(self, first: int, shard: int, shards: int) -> dict[str, torch.Tensor]:
        """The online profile's state by checkpoint name (none with a loaded profile): for each MoE layer
        `first + j` (its ordinal among the model's MoE layers) of this rank's token shard `shard` of `shards` (the
        rank's place in its stage's data x expert group), `meta` [steps, built, fresh, shards, N, T_1 .. T_N]
        (int64) and, with N > 0 samples, `ids` [T_1 + .. + T_N, K] (int32): the layer's routing of the samples,
        oldest first. The profile itself is not saved: `load_window` rebuilds it from the samples."""
        if not self.online:
            return {}
        tokens = [int(s.shape[1]) for s in self.samples]
        meta_M = torch.tensor([self.steps, int(self.paths is not None), self.fresh, shards, len(tokens), *tokens],
                              dtype=torch.int64)
        out: dict[str, torch.Tensor] = {}
        for j in range(self.L):
            out[window_name(shard, first + j, "meta")] = meta_M.clone()
            if tokens:
                ids_TK = np.concatenate([s[j] for s in self.samples], axis=0).astype(np.int32)
                out[window_name(shard, first + j, "ids")] = torch.from_numpy(ids_TK)
        return out

    def window_misfit(self, saved: dict[int, SavedWindow], first: int, shards: int) -> str | None:
        """Why the saved windows (`read_windows`) cannot continue this planner's online profile (MoE layers
        `first` ..., token shard of `shards`), or None when they can: every layer has one, saved with as many
        token shards, over the same steps (one stage's windows: the same counter and samples), of E experts."""
        if not self.online or self.L == 0:
            return None
        missing = [first + j for j in range(self.L) if first + j not in saved]
        if missing:
            return f"the checkpoint holds no online path profile of MoE layer {missing[0]} for this rank's tokens"
        ws = [saved[first + j] for j in range(self.L)]
        if ws[0].shards != shards:
            return (f"it was saved with {ws[0].shards} token shards per stage (data x expert-parallel ranks), this "
                    f"run has {shards}: each rank's tokens are another slice of the batch")
        if any((w.steps, w.built, w.fresh, w.tokens) != (ws[0].steps, ws[0].built, ws[0].fresh, ws[0].tokens)
               for w in ws):
            return "its MoE layers' windows were taken over different steps (a migration restarted one stage's)"
        if any(w.ids is not None and w.ids.size and int(w.ids.max()) >= self.E for w in ws):
            return f"it routed to more than the model's {self.E} experts"
        if len({w.ids.shape[1] for w in ws if w.ids is not None}) > 1:
            return "its MoE layers' windows hold different numbers of choices per token"
        return None

    def load_window(self, saved: dict[int, SavedWindow], first: int) -> None:
        """Continue the online profile from the saved windows (`window_misfit` said they fit): the samples, the
        refresh counter, and the profile in use rebuilt from the samples it was built from (all but the
        `fresh` newest, the last `window` of those), so the resumed run plans what the uninterrupted one plans."""
        if not self.online or self.L == 0:
            return
        w0 = saved[first]
        bounds = np.cumsum([0, *w0.tokens])
        samples = []
        for n in range(len(w0.tokens)):
            layers = [saved[first + j].ids for j in range(self.L)]
            samples.append(np.stack([np.asarray(ids[bounds[n]:bounds[n + 1]], dtype=np.int64)
                                     for ids in layers if ids is not None]))
        self.steps = w0.steps
        self.paths = None
        built_from = samples[:len(samples) - w0.fresh][-self.window:]
        if w0.built and built_from:
            self._build(built_from)
        self.samples = deque(samples, maxlen=self.window + self.refresh - 1)
        self.fresh = w0.fresh


@dataclass(frozen=True)
class SavedWindow:
    """One MoE layer's saved online-profile state of one token shard (`PlanAhead.window_tensors`)."""

    steps: int
    built: bool
    fresh: int
    shards: int
    tokens: tuple[int, ...]
    ids: np.ndarray | None  # [sum(tokens), K] int32


class ExtraReader(Protocol):
    """What `read_windows` needs of a checkpoint (moebal.train.checkpoint.CheckpointReader)."""

    @property
    def path(self) -> Path: ...

    def extra_names(self) -> list[str]: ...

    def read_extra(self, name: str) -> torch.Tensor: ...


def window_name(shard: int, layer: int, key: str) -> str:
    """Checkpoint name of MoE layer `layer`'s online-profile state `key` (meta, ids) of token shard `shard`."""
    return f"plan_ahead.shard{shard}.moe{layer}.{key}"


def read_windows(reader: ExtraReader, shard: int) -> dict[int, SavedWindow]:
    """Every MoE layer's saved online-profile state of token shard `shard` in checkpoint `reader`, by MoE layer
    ordinal, read and checked (files verified by the reader): nothing is applied. A malformed entry raises
    CheckpointError naming it."""
    prefix, out = f"plan_ahead.shard{shard}.moe", {}
    for name in reader.extra_names():
        if not (name.startswith(prefix) and name.endswith(".meta")):
            continue
        layer = int(name[len(prefix):-len(".meta")])
        meta = [int(v) for v in reader.read_extra(name).tolist()]
        n = meta[4] if len(meta) >= 5 else -1
        ids = reader.read_extra(window_name(shard, layer, "ids")).numpy() if n > 0 else None
        if n < 0 or len(meta) != 5 + n or (ids is not None and (ids.ndim != 2 or ids.shape[0] != sum(meta[5:]))):
            raise CheckpointError(f"{reader.path}: the plan-ahead state '{name}' is malformed (meta {meta[:5]}..., "
                                  f"ids {None if ids is None else tuple(ids.shape)}); resume with "
                                  f"planner.plan_ahead off, or from an earlier checkpoint")
        out[layer] = SavedWindow(steps=meta[0], built=bool(meta[1]), fresh=meta[2], shards=meta[3],
                                 tokens=tuple(meta[5:]), ids=ids)
    return out


def mean_accuracy(layers: Iterable[dict[str, float]]) -> dict[str, float]:
    """Means over layers of each of `ACCURACY_KEYS` that some layer has (NaN entries skipped)."""
    rows: dict[str, list[float]] = {k: [] for k in ACCURACY_KEYS}
    for acc in layers:
        for k, v in acc.items():
            if not math.isnan(v):
                rows[k].append(v)
    return {k: float(np.mean(v)) for k, v in rows.items() if v}
