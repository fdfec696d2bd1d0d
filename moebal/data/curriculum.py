"""Adaptive Gating's curriculum: samples ordered by how many of their tokens take two experts (`data.order:
complexity`).

Under adaptive gating (`moe.adaptive_threshold`) a token takes its second expert only when the gate is unsure,
so some samples send many more rows through the experts than others, and a batch mixing the two waits for
its hardest sample. Li et al. (Adaptive Gating in MoE LLMs, chapter 5 of Li Jiamin's thesis) reorder the data
before every epoch: each sample d has a complexity vector C_d = [r_1, ..., r_L], r_i the share of d's tokens
that took two (or more) experts in MoE layer i during the last epoch; the anchor is the sample with the
fewest such tokens; the others follow by cosine similarity to the anchor, most similar first. Easy samples
come first and similar ones sit next to each other, so a batch (consecutive samples) is homogeneous. The
thesis reports 13.7 % less training time with it (the straggler effect of two-expert tokens).

Similarity (`data.order_metric`): the cosine discards the vector's length, which is how many tokens take two
experts: the very cost the reordering is about. Samples whose layers share the same profile at different
levels (measured: a sample twice as hard in every layer) all have cosine 1 to the anchor, and the order
among them is arbitrary; on such data a cosine-ordered batch is no more homogeneous than a shuffled one (the
test shows it). moebal's default is therefore the Euclidean distance to the anchor, nearest first, which keeps
the thesis's stated intent (easy samples first, similar samples together) for levels and profiles alike;
`cosine` is the thesis's rule as written.

Gaps of the thesis, settled here:
- "Fewest top-2 tokens" is a count (share x the sample's tokens), not a share, as the thesis's words say.
- (cosine) An anchor with no two-expert token at all has a zero vector and no cosine: the others then follow
  by the norm of their vector, smallest first (the distance to it). A sample with a zero vector against a
  non-zero anchor has similarity 0.
- Samples not seen in the last epoch (a run that resumed, the last samples of an epoch whose batch reached
  into the next one before it was recorded, and under planned micro-batching the last `lookahead + 1` batches
  of an epoch: their reader orders the next epoch before they train, and leaves them out of the order at any
  resume alike, `_Sampler.curriculum_lag`) use the newest vector they have; samples never seen keep the
  shuffled order, after the ordered ones.
- Ties keep the shuffled order (a stable sort), so the order is a pure function of the table and the seed.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["METRICS", "Curriculum", "complexity_order", "row_complexity", "sample_complexity"]


METRICS = ("distance", "cosine")


def complexity_order(ids: np.ndarray, C_NL: np.ndarray, tokens_N: np.ndarray, fallback: np.ndarray,
                     metric: str = "distance") -> np.ndarray:
    """The epoch's sample order: `fallback` (a permutation of every sample id) reordered so that the samples
    `ids` (with complexity vectors C_NL and token counts tokens_N) come first, anchor then by similarity
    (`metric`: distance or cosine), and the rest keep their fallback order (see the module docstring)."""
    if metric not in METRICS:
        raise ValueError(f"curriculum metric must be one of {', '.join(METRICS)}; got {metric!r}")
    if len(ids) == 0:
        return fallback
    rank = np.empty(int(fallback.max()) + 1, dtype=np.int64)
    rank[fallback] = np.arange(len(fallback))
    by_fallback = np.argsort(rank[ids], kind="stable")  # ties below keep the shuffled order
    ids, C_NL, tokens_N = ids[by_fallback], C_NL[by_fallback], tokens_N[by_fallback]
    two_N = (C_NL * tokens_N[:, None]).sum(axis=1)
    a = int(np.argmin(two_N))  # first of the fewest, in fallback order
    norms_N = np.linalg.norm(C_NL, axis=1)
    if metric == "distance" or norms_N[a] == 0:  # a zero anchor: the distance to it is the norm
        sim_N = -np.linalg.norm(C_NL - C_NL[a], axis=1)
    else:
        sim_N = (C_NL @ C_NL[a]) / (np.maximum(norms_N, 1e-300) * norms_N[a])
        sim_N[norms_N == 0] = 0.0
    sim_N[a] = np.inf
    ordered = ids[np.argsort(-sim_N, kind="stable")]
    seen = np.zeros(len(rank), dtype=bool)
    seen[ids] = True
    return np.concatenate([ordered, fallback[~seen[fallback]]])


def row_complexity(layers: list[Any], labels_BT: torch.Tensor) -> torch.Tensor:
    """[B, L] float64 on the routing's device: per row of the last forward, the share of its real tokens (label not
    -100) that took two or more experts in each MoE layer (their `last_routing`). No host read: the trainer reads
    a step's rows once."""
    valid = labels_BT != -100
    B, T = valid.shape
    rows_BT = torch.arange(B, device=labels_BT.device).unsqueeze(1).expand(B, T)
    return sample_complexity(layers, torch.where(valid, rows_BT, -1), B)  # each row one sample


def sample_complexity(layers: list[Any], seg_BT: torch.Tensor, n: int) -> torch.Tensor:
    """[n, L] float64 on the routing's device: `row_complexity` per sample of the last forward, for rows that hold
    several (packed) or are padded: `seg_BT` names each position's sample, 0 .. n - 1, or -1 for padding."""
    valid = seg_BT >= 0
    idx = seg_BT.clamp_min(0).reshape(-1)
    zeros = torch.zeros(n, dtype=torch.float64, device=seg_BT.device)
    count = zeros.scatter_add(0, idx, valid.reshape(-1).double()).clamp_min(1)
    out = []
    for layer in layers:
        taken = layer.last_routing.taken_TK
        if taken is None:  # every token took all top_k experts
            multi = valid if layer.top_k > 1 else torch.zeros_like(valid)
        else:
            multi = (taken.sum(dim=-1) > 1).view(valid.shape) & valid
        out.append(zeros.scatter_add(0, idx, multi.reshape(-1).double()) / count)
    return torch.stack(out, dim=1) if out else torch.zeros((n, 0), dtype=torch.float64, device=seg_BT.device)


class Curriculum:
    """Complexity vectors of the samples seen, and the order they give an epoch.

    Every entry carries the sampler position at which it was recorded (samples drawn so far over the run), and
    an epoch starting at position P is ordered from the newest entry of each sample recorded at or before P.
    The batch that crosses into a new epoch is recorded after the new epoch's order was taken, so its entries
    must not count for that order, also when a run resumes from a checkpoint taken later in the epoch (the
    table is in the checkpoint; the order is not). So a sample keeps the entry an order uses and those recorded
    after it until that order can be taken again: the crossing batch's (a sample of the epoch's last batch, drawn
    again in the new epoch before a checkpoint, has two entries newer than the order's, so two kept would lose the
    one the order used and a resume would order the epoch otherwise), the epoch's own, and one more per epoch a
    reader's lag (`_Sampler.curriculum_lag`) reaches back (`_Sampler.curriculum_keep`)."""

    def __init__(self, metric: str = "distance") -> None:
        self.metric = metric
        self.table: dict[int, list[tuple[int, list[float], int]]] = {}
        self.keep = 3
        """Entries kept per sample (the newest); the loader sets it for its batch size and lag."""

    def record(self, ids: list[int], C_BL: np.ndarray, tokens_B: list[int], at: int) -> None:
        for i, c, n in zip(ids, C_BL, tokens_B):
            entries = self.table.setdefault(int(i), [])
            entries.append((int(at), [float(x) for x in c], int(n)))
            del entries[:-self.keep]

    def order(self, fallback: np.ndarray, upto: int) -> np.ndarray:
        """`fallback` reordered from the entries recorded at or before position `upto`."""
        ids, C, n = [], [], []
        for i, entries in self.table.items():
            usable = [e for e in entries if e[0] <= upto]
            if usable:
                ids.append(i)
                C.append(usable[-1][1])
                n.append(usable[-1][2])
        if not ids:
            return fallback
        return complexity_order(np.asarray(ids, dtype=np.int64), np.asarray(C, dtype=np.float64),
                                np.asarray(n, dtype=np.float64), fallback, self.metric)

    def state_dict(self) -> dict[str, Any]:
        return {"entries": [[i, *e] for i in sorted(self.table) for e in self.table[i]]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.table = {}
        for i, at, c, n in state["entries"]:
            self.table.setdefault(int(i), []).append((int(at), [float(x) for x in c], int(n)))
