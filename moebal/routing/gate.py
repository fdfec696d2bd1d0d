"""Token-choice gates: top-k in two orders, adaptive top-k, capacity drops, and the routing decision.

The routing decision (`Routing`) is plain tensors, so a dispatcher (local or expert-parallel) can reuse it:
gate -> `Routing` -> dispatch plan -> expert compute -> combine, each a separate step.

Shape legend: T tokens, E experts, K = top_k (the most experts a token may take).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from moebal.routing.capacity import capacity_keep, expert_capacity

GateOrder = Literal["softmax_topk", "topk_softmax"]
DropPolicy = Literal["probs", "position"]
GATE_ORDERS = ("softmax_topk", "topk_softmax")
DROP_POLICIES = ("probs", "position")


@dataclass(frozen=True)
class GateSpec:
    """How one layer routes: validated once at construction, then read by `route`."""

    num_experts: int
    top_k: int
    gate: GateOrder = "softmax_topk"
    adaptive_threshold: float | None = None
    capacity_factor: float | None = None
    drop_policy: DropPolicy = "probs"
    score_scale: float = 1.0
    norm_topk: bool = True

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise ValueError(f"num_experts must be at least 1; got {self.num_experts}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={self.num_experts}]; got {self.top_k}: "
                             "lower top_k or add experts")
        if self.gate not in GATE_ORDERS:
            raise ValueError(f"gate must be one of {', '.join(GATE_ORDERS)}; got {self.gate!r}")
        if self.drop_policy not in DROP_POLICIES:
            raise ValueError(f"drop_policy must be one of {', '.join(DROP_POLICIES)}; got {self.drop_policy!r}")
        t = self.adaptive_threshold
        if t is not None and not (isinstance(t, (int, float)) and 0.0 <= t <= 1.0):
            raise ValueError(f"adaptive_threshold is a gap of normalised probabilities in [0, 1] (or None for a "
                             f"fixed top-k); got {t!r}")
        cf = self.capacity_factor
        if cf is not None and not (isinstance(cf, (int, float)) and cf > 0 and math.isfinite(cf)):
            raise ValueError(f"capacity_factor must be a positive number, or None for dropless routing; got {cf!r}")
        if not math.isfinite(self.score_scale):
            raise ValueError(f"score_scale must be finite; got {self.score_scale}")
        if not self.norm_topk and self.gate != "softmax_topk":
            raise ValueError("norm_topk=False keeps the full-softmax probabilities, which only gate='softmax_topk' "
                             "computes: use gate='softmax_topk'")


@dataclass
class Routing:
    """One layer's routing decision for T tokens (all tensors on the tokens' device)."""

    indices_TK: torch.Tensor
    """int64 expert of each choice, best first."""
    weights_TK: torch.Tensor
    """fp32 combine weights (score_scale included); 0 where the assignment is not active."""
    active_TK: torch.Tensor | None
    """bool: taken by the gate and kept under capacity; None means every assignment is active."""
    taken_TK: torch.Tensor | None
    """bool: taken by the (adaptive) gate, before capacity drops; None means all K taken."""
    probs_TE: torch.Tensor
    """fp32 softmax over all experts (input of the load-balancing loss)."""
    logits_TE: torch.Tensor
    """fp32 router logits (input of the z-loss)."""
    capacity: int | None
    """Per-expert capacity used for drops; None when dropless."""


def select_topk(logits_TE: torch.Tensor, k: int, gate: GateOrder, bias_E: torch.Tensor | None = None,
                norm_topk: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(indices_TK, probs_TK normalised over the k choices, probs_TE) from fp32 logits.

    `softmax_topk` is Mixtral's order (softmax over all experts in fp32, top-k, renormalise);
    `topk_softmax` takes the top-k logits and softmaxes over them (LLaMA-MoE). The two are the same maths
    (the full partition function cancels) but round differently, so both exist for bit-faithful parity.
    A selection bias (auxiliary-loss-free balancing) is added to the logits for the choice only; the
    weights come from the unbiased scores (DeepSeek-V3). We add it to logits rather than to probabilities
    so both orders select the same experts for the same bias. `norm_topk=False` (softmax_topk only) keeps
    the full-softmax values of the chosen experts (Qwen2-MoE's `norm_topk_prob: false`).
    """
    probs_TE = torch.softmax(logits_TE, dim=-1)
    if bias_E is not None:
        indices_TK = (logits_TE + bias_E).topk(k, dim=-1).indices
    elif gate == "softmax_topk":
        indices_TK = probs_TE.topk(k, dim=-1).indices
    else:
        indices_TK = logits_TE.topk(k, dim=-1).indices
    if gate == "softmax_topk":
        p_TK = probs_TE.gather(1, indices_TK)
        if norm_topk:
            p_TK = p_TK / p_TK.sum(dim=-1, keepdim=True)
    else:
        p_TK = torch.softmax(logits_TE.gather(1, indices_TK), dim=-1)
    return indices_TK, p_TK, probs_TE


def adaptive_take(p_TK: torch.Tensor, threshold: float) -> torch.Tensor:
    """bool taken_TK: Adaptive Gating's rule, chained over consecutive choices.

    A token always takes its first choice; it takes choice j+1 only when it took choice j and
    p_j - p_{j+1} <= threshold, where p are the top-k probabilities renormalised to sum to one (the paper's
    "normalised" probabilities: for k = 2 the gap is (p1 - p2) / (p1 + p2), in [0, 1]). T = 0 gives top-1
    (exact ties aside) and T = 1 gives top-k, for either gate order (both yield the same p_TK).
    """
    gaps_ok = (p_TK[:, :-1] - p_TK[:, 1:]) <= threshold
    first = torch.ones_like(p_TK[:, :1], dtype=torch.bool)
    return torch.cat([first, gaps_ok.cumprod(dim=-1).bool()], dim=-1)


def route(logits_TE: torch.Tensor, spec: GateSpec, bias_E: torch.Tensor | None = None) -> Routing:
    """The routing decision for router logits [T, E]: choices, combine weights, active mask."""
    logits_TE = logits_TE.float()
    indices_TK, p_TK, probs_TE = select_topk(logits_TE, spec.top_k, spec.gate, bias_E, spec.norm_topk)
    taken_TK = None
    weights_TK = p_TK
    if spec.adaptive_threshold is not None and spec.top_k > 1:
        taken_TK = adaptive_take(p_TK, spec.adaptive_threshold)
        # Renormalise over the taken experts (Mixtral convention, and what makes T=0 equal a top-1 gate and
        # T=1 a top-k gate); the paper's Eq. 5.3 uses raw probabilities, which matches neither.
        masked_TK = p_TK * taken_TK
        weights_TK = masked_TK / masked_TK.sum(dim=-1, keepdim=True)
    active_TK = taken_TK
    capacity = None
    if spec.capacity_factor is not None:
        capacity = expert_capacity(spec.capacity_factor, logits_TE.shape[0], spec.top_k, spec.num_experts)
        # Priority for the `probs` policy: the assignment's normalised top-k probability (before the
        # adaptive renormalisation), which both gate orders share.
        active_TK = capacity_keep(indices_TK, taken_TK, p_TK, spec.num_experts, capacity, spec.drop_policy)
        # Dropped assignments lose their weight without renormalising the rest (GShard): the residual
        # connection carries a fully dropped token.
        weights_TK = weights_TK * active_TK
    elif taken_TK is not None:
        weights_TK = weights_TK * taken_TK
    if spec.score_scale != 1.0:
        weights_TK = weights_TK * spec.score_scale
    return Routing(indices_TK=indices_TK, weights_TK=weights_TK, active_TK=active_TK, taken_TK=taken_TK,
                   probs_TE=probs_TE, logits_TE=logits_TE, capacity=capacity)
