"""Load-balancing terms: Switch/GShard auxiliary loss, router z-loss, auxiliary-loss-free selection bias.

Shape legend: T tokens, E experts, K = top_k.
"""

from __future__ import annotations

import torch


def assignment_counts(indices_TK: torch.Tensor, taken_TK: torch.Tensor | None, num_experts: int) -> torch.Tensor:
    """int64 counts_E of the gate's assignments (before capacity drops); no host sync."""
    ones_N = torch.ones(indices_TK.numel(), dtype=torch.int64, device=indices_TK.device)
    if taken_TK is not None:
        ones_N = taken_TK.reshape(-1).to(torch.int64)
    return torch.zeros(num_experts, dtype=torch.int64, device=indices_TK.device).scatter_add_(
        0, indices_TK.reshape(-1), ones_N)


def load_balancing_loss(probs_TE: torch.Tensor, counts_E: torch.Tensor, real_T: torch.Tensor | None = None
                        ) -> torch.Tensor:
    """E * sum_e f_e * P_e (Switch Eq. 4 / GShard): f_e = counts_e / sum(counts) (a constant), P_e = mean gate
    probability of expert e over all tokens (carries the gradient). Equals 1 under perfect balance.

    The caller chooses what `counts_E` counts: every taken choice for a fixed top-k (HF Mixtral, here
    normalised so balance gives 1 for any k), or each token's first choice only for adaptive gating
    (Adaptive Gating Eq. 5.4, f^1 read as "every token's top-1 decision"). `real_T` (bool [T]): P_e over these
    tokens only (padding left out: moebal/models/padding.py; `counts_E` then counts them only too), by a masked
    sum with no host sync; none real gives 0.
    """
    num_experts = probs_TE.shape[-1]
    f_E = counts_E.to(probs_TE.dtype) / counts_E.sum().clamp(min=1).to(probs_TE.dtype)
    if real_T is None:
        return num_experts * torch.sum(f_E * probs_TE.mean(dim=0))
    w_T = real_T.to(probs_TE.dtype)
    P_E = (probs_TE * w_T.unsqueeze(1)).sum(dim=0) / w_T.sum().clamp(min=1)
    return num_experts * torch.sum(f_E * P_E)


def router_z_loss(logits_TE: torch.Tensor, real_T: torch.Tensor | None = None) -> torch.Tensor:
    """ST-MoE router z-loss: mean over tokens of logsumexp(logits)^2 (keeps router logits small); over the
    tokens `real_T` (bool [T]) marks only when given (0 when none is)."""
    z_T = torch.logsumexp(logits_TE.float(), dim=-1).square()
    if real_T is None:
        return z_T.mean()
    w_T = real_T.to(z_T.dtype)
    return (z_T * w_T).sum() / w_T.sum().clamp(min=1)


@torch.no_grad()
def update_selection_bias(bias_E: torch.Tensor, counts_E: torch.Tensor, rate: float) -> None:
    """DeepSeek-V3 auxiliary-loss-free balancing, in place: bias_e += rate * sign(mean load - load_e).

    Overloaded experts lose selection bias, underloaded ones gain it. `counts_E` should be the step's
    globally reduced gate assignments, so every rank applies the same update.
    """
    load_E = counts_E.to(bias_E.device, torch.float32)
    bias_E.add_(rate * torch.sign(load_E.mean() - load_E).to(bias_E.dtype))
