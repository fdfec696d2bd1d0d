"""Group-limited expert choice (DeepSeek-V2 and V3): a token may only pick experts from its best expert groups.

The E experts are split into `n_group` equal, contiguous groups (expert e is in group e // (E / n_group)). Each
token ranks the groups by a group score computed from its choice scores, keeps the best `topk_group` groups,
and its top-k is then taken among those groups' experts only. Under expert parallelism with one group per
device (or node), this bounds how many devices a token's experts span (DeepSeek-V2 section 2.1.3, "device-limited
routing"; DeepSeek-V3 section 2.1.2, "node-limited routing").

Shape legend: T tokens, E experts, G groups, M = E / G experts per group.
"""

from __future__ import annotations

from typing import Literal

import torch

GroupScore = Literal["max", "top2_sum"]
GROUP_SCORES = ("max", "top2_sum")


def group_scores(choice_TE: torch.Tensor, n_group: int, how: GroupScore) -> torch.Tensor:
    """[T, G] score of each group: its best expert's choice score (`max`, DeepSeek-V2's group-limited greedy)
    or the sum of its two best (`top2_sum`, DeepSeek-V3, which ranks groups on the bias-corrected scores)."""
    T, E = choice_TE.shape
    grouped_TGM = choice_TE.view(T, n_group, E // n_group)
    if how == "max":
        return grouped_TGM.max(dim=-1).values
    return grouped_TGM.topk(2, dim=-1).values.sum(dim=-1)


def group_limit(choice_TE: torch.Tensor, n_group: int, topk_group: int, how: GroupScore,
                rank_TE: torch.Tensor | None = None) -> torch.Tensor:
    """The choice scores with every expert outside the token's `topk_group` best groups set to -inf, so a
    following top-k can only pick inside them (no host sync: a mask, never an index list). The groups are ranked
    on `rank_TE` when given (scores in another space than the choice's), else on the choice scores."""
    T, E = choice_TE.shape
    ranked_TE = choice_TE if rank_TE is None else rank_TE
    best_TG = group_scores(ranked_TE, n_group, how).topk(topk_group, dim=-1).indices
    keep_TG = torch.zeros(T, n_group, dtype=torch.bool, device=choice_TE.device).scatter_(1, best_TG, True)
    keep_TE = keep_TG.unsqueeze(-1).expand(T, n_group, E // n_group).reshape(T, E)
    # -inf rather than HF V2's 0.0: the same choice for softmax probabilities (all > 0), and also right for
    # scores that may be negative (logits plus a selection bias)
    return choice_TE.masked_fill(~keep_TE, float("-inf"))
