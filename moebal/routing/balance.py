"""Load-balancing terms: Switch/GShard auxiliary loss, router z-loss, auxiliary-loss-free selection bias.

Shape legend: T tokens, E experts, K = top_k.
"""

from __future__ import annotations

from typing import Literal

import torch

AuxLossScope = Literal["layer", "pooled", "sequence"]
"""What one balancing loss measures: each layer's batch (Switch, summed over the layers: Megatron's), every
layer's batch at once (transformers' `load_balancing_loss_func`) or each layer's each sequence (DeepSeek's
`seq_aux`)."""


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


def balance_sums(probs_TE: torch.Tensor, counts_E: torch.Tensor, real_T: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """fp32 [1 + 2E]: (tokens, counts_E, the probabilities summed over the tokens) of one layer, over the tokens
    `real_T` (bool [T]) marks only when given, for `pooled_balancing_loss`. The sums carry the gradient; summing
    them over ranks keeps them sums."""
    probs_TE = probs_TE.float()
    if real_T is not None:
        probs_TE = probs_TE * real_T.to(torch.float32).unsqueeze(1)
    return torch.cat([token_count(probs_TE, real_T), counts_E.to(torch.float32), probs_TE.sum(dim=0)])


def token_count(x_T: torch.Tensor, real_T: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 [1]: the tokens of `x_T` (its first dimension), or those `real_T` (bool [T]) marks. No host sync."""
    if real_T is None:
        return torch.full((1,), float(x_T.shape[0]), dtype=torch.float32, device=x_T.device)
    return real_T.to(torch.float32).sum().reshape(1)


def pooled_balancing_loss(sums: list[torch.Tensor]) -> torch.Tensor:
    """transformers' `load_balancing_loss_func` (Mixtral, Qwen2/3-MoE, OLMoE) from each layer's `balance_sums`:
    E * sum_e F_e * P_e with F_e the counts summed over the layers over the tokens summed over the layers (a
    constant) and P_e the probabilities' sum over both, over the same count. One token's k choices all count, so
    perfect balance gives k (1 when the counts hold first choices only: adaptive gating). The sums add up in layer
    order, one at a time: a pipeline's stages add theirs to the running sums they receive, so every partition
    gives the same bits."""
    total = sums[0]
    for part in sums[1:]:
        total = total + part
    E = (total.shape[0] - 1) // 2
    tokens = total[0].detach().clamp(min=1.0)  # no token anywhere: 0, not NaN
    F_E, P_E = total[1:1 + E].detach() / tokens, total[1 + E:] / tokens
    return E * torch.sum(F_E * P_E)


def sequence_balancing_loss(probs_TE: torch.Tensor, indices_TK: torch.Tensor, counted_TK: torch.Tensor | None,
                            rows: int, real_T: torch.Tensor | None = None) -> torch.Tensor:
    """DeepSeek's per-sequence balance loss (`seq_aux`, DeepSeek-V3 eq. 17-20) for T tokens in `rows` equal rows
    (row-major): each row's E * sum_e f_e * P_e, f_e its counted choices of e over all its counted choices (a
    constant), P_e the mean over the row's tokens of e's probability; the mean over the rows holding a token.
    `real_T` (bool [T]): only these tokens (padding left out); `counted_TK` (bool): the choices counted, which
    leave the padding out already when both are given (None: every choice of the real tokens). Perfect balance in
    every row gives 1. Sums over each row's tokens in a fixed order (no atomics: the same bits on every run), no
    host sync."""
    T, E = probs_TE.shape
    if T == 0:
        return probs_TE.sum() * 0.0
    probs_TE = probs_TE.float()
    if real_T is None:
        tokens_R = torch.full((rows,), float(T // rows), dtype=torch.float32, device=probs_TE.device)
    else:
        w_T = real_T.to(torch.float32)
        probs_TE = probs_TE * w_T.unsqueeze(1)
        tokens_R = w_T.view(rows, -1).sum(dim=1)
        if counted_TK is None:
            counted_TK = real_T.unsqueeze(1).expand_as(indices_TK)
    row_T1 = (torch.arange(T, device=probs_TE.device) // (T // rows)).unsqueeze(1)
    counts_RE = assignment_counts(indices_TK + row_T1 * E, counted_TK, rows * E).view(rows, E).to(torch.float32)
    P_RE = probs_TE.view(rows, -1, E).sum(dim=1) / tokens_R.clamp(min=1.0).unsqueeze(1)
    f_RE = counts_RE / counts_RE.sum(dim=1, keepdim=True).clamp(min=1.0)
    loss_R = E * (f_RE * P_RE).sum(dim=1)
    held_R = (tokens_R > 0).to(torch.float32)
    return (loss_R * held_R).sum() / held_R.sum().clamp(min=1.0)


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
