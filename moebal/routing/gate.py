"""Token-choice gates: softmax top-k in two orders, sigmoid top-k, group-limited choice, adaptive top-k,
capacity drops, and the routing decision.

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
from moebal.routing.groups import GROUP_SCORES, GroupScore, group_limit

GateOrder = Literal["softmax_topk", "topk_softmax", "sigmoid_topk"]
DropPolicy = Literal["probs", "position"]
GATE_ORDERS = ("softmax_topk", "topk_softmax", "sigmoid_topk")
# DeepSeek-V3's normalisation adds this to the sum of the chosen sigmoid scores (HF DeepseekV3TopkRouter)
SIGMOID_NORM_EPS = 1e-20
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
    n_group: int = 1
    topk_group: int | None = None
    group_score: GroupScore = "max"

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
        if not self.norm_topk and self.gate == "topk_softmax":
            raise ValueError("norm_topk=False keeps the unnormalised scores of the chosen experts, which "
                             "gate='topk_softmax' never computes: use gate='softmax_topk' or 'sigmoid_topk'")
        if self.adaptive_threshold is not None and self.gate == "sigmoid_topk" and not self.norm_topk:
            raise ValueError("adaptive_threshold compares normalised top-k scores: with gate='sigmoid_topk' set "
                             "norm_topk=True")
        self._check_groups()

    def _check_groups(self) -> None:
        G, E = self.n_group, self.num_experts
        if not isinstance(G, int) or G < 1 or E % G:
            raise ValueError(f"n_group must be a positive divisor of num_experts={E}; got {G!r}")
        tg = self.topk_group
        if tg is not None and not (isinstance(tg, int) and 1 <= tg <= G):
            raise ValueError(f"topk_group must be in [1, n_group={G}] (or None for every group); got {tg!r}")
        if self.group_score not in GROUP_SCORES:
            raise ValueError(f"group_score must be one of {', '.join(GROUP_SCORES)}; got {self.group_score!r}")
        if self.limits_groups:
            if self.top_k > (tg or G) * (E // G):
                raise ValueError(f"top_k={self.top_k} is more than the {(tg or G) * (E // G)} experts of "
                                 f"topk_group={tg} groups of {E // G}: raise topk_group or lower top_k")
            if self.group_score == "top2_sum" and E // G < 2:
                raise ValueError(f"group_score='top2_sum' sums each group's two best scores, but groups have "
                                 f"{E // G} expert: use group_score='max' or fewer groups")

    @property
    def limits_groups(self) -> bool:
        """Whether the group limit can exclude an expert (some groups are left out)."""
        return self.n_group > 1 and self.topk_group is not None and self.topk_group < self.n_group


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
    """fp32 scores over all experts summing to one per token (input of the load-balancing loss): the softmax,
    or for sigmoid gates the sigmoid scores normalised to sum one (DeepSeek-V3 eq. 19's s')."""
    logits_TE: torch.Tensor
    """fp32 router logits (input of the z-loss)."""
    capacity: int | None
    """Per-expert capacity used for drops; None when dropless."""


def select_topk(logits_TE: torch.Tensor, k: int, gate: GateOrder, bias_E: torch.Tensor | None = None,
                norm_topk: bool = True, *, n_group: int = 1, topk_group: int | None = None,
                group_score: GroupScore = "max") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(indices_TK, probs_TK: the combine weights before scaling, probs_TE) from fp32 logits.

    `softmax_topk` is Mixtral's order (softmax over all experts in fp32, top-k, renormalise);
    `topk_softmax` takes the top-k logits and softmaxes over them (LLaMA-MoE). The two are the same maths
    (the full partition function cancels) but round differently, so both exist for bit-faithful parity.
    `sigmoid_topk` scores each expert alone by sigmoid(logit) and normalises over the chosen k (DeepSeek-V3
    eq. 15-16). `norm_topk=False` (not for topk_softmax) keeps the chosen experts' own scores (Qwen2-MoE's
    `norm_topk_prob: false`, DeepSeek-V2).

    A selection bias (auxiliary-loss-free balancing, DeepSeek-V3 eq. 16) changes the choice only; the
    weights come from the unbiased scores. It is added to what the gate ranks: the logits of softmax gates
    (so both orders select the same experts for the same bias) and the sigmoid scores of sigmoid gates (as
    DeepSeek-V3's `e_score_correction_bias`). With `n_group` groups and `topk_group` < n_group the choice is
    limited to each token's best groups (moebal/routing/groups.py), ranked on those same biased scores; with
    `top2_sum` a softmax gate's groups are ranked on the softmax of its biased logits instead (a sum of two best
    logits orders groups differently from a sum of two best probabilities: the orders and a zero bias would
    otherwise choose differently).
    """
    choice_TE, probs_TE, scores_TE = _choice_scores(logits_TE, gate, bias_E)
    if n_group > 1 and topk_group is not None and topk_group < n_group:
        rank_TE = None
        if group_score == "top2_sum" and gate != "sigmoid_topk":
            # a maximum ranks groups alike on logits or probabilities, a sum of two does not: softmax gates rank
            # their groups on the probabilities of the (biased) logits, whatever the order or a (zero) bias
            rank_TE = probs_TE if bias_E is None else torch.softmax(logits_TE + bias_E, dim=-1)
        choice_TE = group_limit(choice_TE, n_group, topk_group, group_score, rank_TE)
    indices_TK = choice_TE.topk(k, dim=-1).indices
    if gate == "topk_softmax":
        return indices_TK, torch.softmax(logits_TE.gather(1, indices_TK), dim=-1), probs_TE
    p_TK = scores_TE.gather(1, indices_TK)
    if norm_topk:
        sum_T1 = p_TK.sum(dim=-1, keepdim=True)
        if gate == "sigmoid_topk":
            p_TK = p_TK / (sum_T1 + SIGMOID_NORM_EPS)
        else:  # a selection bias can pick experts whose probabilities all round to 0: their log-space softmax
            p_TK = _divide_or(p_TK, sum_T1, torch.softmax(logits_TE.gather(1, indices_TK), dim=-1))
    return indices_TK, p_TK, probs_TE


def _divide_or(num_TK: torch.Tensor, den_T1: torch.Tensor, fallback: torch.Tensor | float) -> torch.Tensor:
    """num / den per row, and `fallback`'s row (or value) where den is 0 (every score rounded to 0: extreme
    logits), where the quotient would be 0/0 = NaN. Rows with den > 0 are the plain quotient, bit for bit, values
    and gradients; the gradient of a replaced row does not pass through the quotient (its denominator there is 1,
    not 0). No host sync: both branches are computed."""
    zero_T1 = den_T1 == 0
    return torch.where(zero_T1, fallback, num_TK / torch.where(zero_T1, torch.ones_like(den_T1), den_T1))


def _choice_scores(logits_TE: torch.Tensor, gate: GateOrder,
                   bias_E: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(what the top-k ranks, probs_TE summing to one, each expert's own score) of one gate."""
    if gate == "sigmoid_topk":
        scores_TE = torch.sigmoid(logits_TE)  # a row of logits below about -88.7 scores 0 everywhere: uniform
        probs_TE = _divide_or(scores_TE, scores_TE.sum(dim=-1, keepdim=True),
                              1.0 / scores_TE.shape[-1])
        return (scores_TE if bias_E is None else scores_TE + bias_E), probs_TE, scores_TE
    probs_TE = torch.softmax(logits_TE, dim=-1)
    if bias_E is not None:
        return logits_TE + bias_E, probs_TE, probs_TE
    # Mixtral ranks the probabilities, LLaMA-MoE the logits: the same order, kept for bit-faithful ties
    return (probs_TE if gate == "softmax_topk" else logits_TE), probs_TE, probs_TE


def adaptive_take(p_TK: torch.Tensor, threshold: float) -> torch.Tensor:
    """bool taken_TK: Adaptive Gating's rule, chained over consecutive choices.

    A token always takes its first choice; it takes choice j+1 only when it took choice j and
    p_j - p_{j+1} <= threshold, where p are the top-k probabilities renormalised to sum to one (the paper's
    "normalised" probabilities: for k = 2 the gap is (p1 - p2) / (p1 + p2), in [0, 1]). T = 0 gives top-1
    (exact ties aside) and T = 1 gives top-k, for either gate order (both yield the same p_TK). For k > 2 the
    gaps are over all k choices' sum, so a given T takes more experts as k grows. With a selection bias the
    choices are ranked on biased scores, and a choice more probable than the one before it (a negative gap)
    is always taken: the first choice does not dominate, so T = 0 is top-1 only where the bias kept the order.
    """
    gaps_ok = (p_TK[:, :-1] - p_TK[:, 1:]) <= threshold
    first = torch.ones_like(p_TK[:, :1], dtype=torch.bool)
    return torch.cat([first, gaps_ok.cumprod(dim=-1).bool()], dim=-1)


def route(logits_TE: torch.Tensor, spec: GateSpec, bias_E: torch.Tensor | None = None) -> Routing:
    """The routing decision for router logits [T, E]: choices, combine weights, active mask."""
    logits_TE = logits_TE.float()
    indices_TK, p_TK, probs_TE = select_topk(logits_TE, spec.top_k, spec.gate, bias_E, spec.norm_topk,
                                             n_group=spec.n_group, topk_group=spec.topk_group,
                                             group_score=spec.group_score)
    taken_TK = None
    weights_TK = p_TK
    if spec.adaptive_threshold is not None and spec.top_k > 1:
        # the rule compares normalised probabilities; with norm_topk off (softmax_topk: Qwen2-MoE's) the combine
        # weights are the raw ones, so the gaps are taken on them renormalised
        normalised = p_TK if spec.norm_topk else _divide_or(p_TK, p_TK.sum(dim=-1, keepdim=True), 0.0)
        taken_TK = adaptive_take(normalised, spec.adaptive_threshold)
        # Under norm_topk, renormalise over the taken experts (Mixtral convention, and what makes T=0 equal a
        # top-1 gate and T=1 a top-k gate); without it the taken experts keep their raw weights, so T=1 equals the
        # norm_topk=false top-k gate (the paper's Eq. 5.3 uses raw probabilities). It renormalised regardless.
        masked_TK = p_TK * taken_TK  # all 0 where every score rounded to 0: weights 0, as without adaptive k
        weights_TK = _divide_or(masked_TK, masked_TK.sum(dim=-1, keepdim=True), 0.0) if spec.norm_topk \
            else masked_TK
    active_TK = taken_TK
    capacity = None
    if spec.capacity_factor is not None:
        capacity = expert_capacity(spec.capacity_factor, logits_TE.shape[0], spec.top_k, spec.num_experts)
        # Priority for the `probs` policy: the assignment's top-k probability (before the adaptive
        # renormalisation; renormalised over the top k under norm_topk, raw without), which both gate orders share.
        active_TK = capacity_keep(indices_TK, taken_TK, p_TK, spec.num_experts, capacity, spec.drop_policy)
        # Dropped assignments lose their weight without renormalising the rest (GShard): the residual
        # connection carries a fully dropped token.
        weights_TK = weights_TK * active_TK
    elif taken_TK is not None:
        weights_TK = weights_TK * taken_TK
    if spec.score_scale != 1.0:
        # LLaMA-MoE's score_scale_factor, DeepSeek's routed_scaling_factor: after normalisation (DeepSeek-V3's
        # normalised sigmoid weights then sum to this factor)
        weights_TK = weights_TK * spec.score_scale
    return Routing(indices_TK=indices_TK, weights_TK=weights_TK, active_TK=active_TK, taken_TK=taken_TK,
                   probs_TE=probs_TE, logits_TE=logits_TE, capacity=capacity)
