"""Plans are data: frozen dataclasses that serialise to JSON, print, diff and replay.

Shape legend: R = ranks in the expert-parallel group, E = logical experts.

`ExpertPlacement` follows Pro-Prophet's lightweight placement: every expert has one owner (the only rank
that keeps its optimizer state and applies its update); a plan may give some experts temporary replicas on
other ranks. A rank holding a replica of expert e computes its *own* tokens for e locally; every other
rank's tokens for e still travel to the owner. Replicas carry parameters only (sent by Trans before the
layer runs) and their gradients are summed back to the owner (Agg) before the optimizer step.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["ExpertPlacement", "default_owners"]


def default_owners(num_experts: int, num_ranks: int) -> tuple[int, ...]:
    """Plain expert parallelism: experts sharded by logical id in contiguous blocks (E/R per rank)."""
    if num_ranks < 1 or num_experts < 1 or num_experts % num_ranks:
        raise ValueError(f"{num_experts} experts cannot be sharded evenly over {num_ranks} ranks: "
                         f"choose an expert-parallel size that divides the number of experts")
    per = num_experts // num_ranks
    return tuple(e // per for e in range(num_experts))


@dataclass(frozen=True)
class ExpertPlacement:
    """Where each expert's tokens are computed for one MoE layer.

    owner[e]     rank that holds expert e's parameters and optimizer state
    replicas[e]  sorted ranks (never the owner) that receive a temporary replica of expert e
    """

    num_ranks: int
    owner: tuple[int, ...]
    replicas: tuple[tuple[int, ...], ...]
    policy: str = "static"
    predicted_time: float | None = None
    """Seconds for the layer under this plan, from the planner's cost model (None: not costed)."""
    meta: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    """Free-form planner facts (search steps, baseline time, ...); not part of plan identity."""

    def __post_init__(self) -> None:
        R, E = self.num_ranks, len(self.owner)
        if len(self.replicas) != E:
            raise ValueError(f"placement has {E} owners but {len(self.replicas)} replica lists")
        for e, (o, reps) in enumerate(zip(self.owner, self.replicas)):
            if not 0 <= o < R:
                raise ValueError(f"expert {e}: owner rank {o} outside 0..{R - 1}")
            # sorted-and-unique first, so the range check needs only the ends (planners build ~R*E entries)
            if list(reps) != sorted(set(reps)) or o in reps or (reps and not 0 <= reps[0] <= reps[-1] < R):
                raise ValueError(f"expert {e}: replicas {reps} must be sorted, unique, in 0..{R - 1}, "
                                 f"and must not include the owner {o}")

    # ---- constructors ----
    @classmethod
    def static(cls, num_experts: int, num_ranks: int, owner: Sequence[int] | None = None) -> ExpertPlacement:
        """Plain expert parallelism: no replicas."""
        own = tuple(owner) if owner is not None else default_owners(num_experts, num_ranks)
        return cls(num_ranks=num_ranks, owner=own, replicas=tuple(() for _ in own))

    # ---- queries ----
    @property
    def num_experts(self) -> int:
        return len(self.owner)

    def holders(self, e: int) -> tuple[int, ...]:
        """Ranks that hold expert e's parameters during the layer (owner first)."""
        return (self.owner[e], *self.replicas[e])

    def compute_rank(self, src: int, e: int) -> int:
        """Rank that computes the tokens of rank `src` routed to expert `e`."""
        return src if src == self.owner[e] or src in self.replicas[e] else self.owner[e]

    def local_experts(self, rank: int) -> tuple[int, ...]:
        """Experts whose parameters are present on `rank` (owned or replicated), ascending."""
        return tuple(e for e in range(self.num_experts) if rank == self.owner[e] or rank in self.replicas[e])

    @property
    def replicated(self) -> tuple[int, ...]:
        """Experts that have at least one replica."""
        return tuple(e for e, reps in enumerate(self.replicas) if reps)

    @property
    def num_replicas(self) -> int:
        return sum(len(r) for r in self.replicas)

    # ---- serialisation ----
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["owner"] = list(self.owner)
        d["replicas"] = [list(r) for r in self.replicas]
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ExpertPlacement:
        return cls(num_ranks=int(d["num_ranks"]), owner=tuple(int(o) for o in d["owner"]),
                   replicas=tuple(tuple(int(r) for r in reps) for reps in d["replicas"]),
                   policy=str(d.get("policy", "static")), predicted_time=d.get("predicted_time"),
                   meta=dict(d.get("meta", {})))

    @classmethod
    def from_json(cls, text: str) -> ExpertPlacement:
        return cls.from_dict(json.loads(text))
