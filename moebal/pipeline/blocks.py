"""A decoder layer run on a subset of token positions, with the layer's own modules (no copy, no new maths).

Shape legend: B = rows, T = sequence, Q = selected positions per row (padded), D = model dim, H = query heads,
G = key/value heads, K = head dim, N = valid selected tokens over all rows.

Early exit and Mixture-of-Depths skip a layer's compute for some tokens. `subset_block` computes the layer for
the selected positions only: queries, attention output, the FFN (dense or MoE) and the residual, for those
rows; keys and values come either from every position (`keys="all"`: early exit, where an exited token's
frozen hidden state still serves as context, CALM's state propagation) or from the selected positions only
(`keys="subset"`: Mixture-of-Depths, where the block is a shorter sequence). Positions keep their rotary
angles and the causal order of the full sequence. When every position is selected the plain layer runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moebal.models.transformer import apply_rotary

__all__ = ["gather_rows", "subset_block"]


def gather_rows(x_BTD: torch.Tensor, pos_BQ: torch.Tensor) -> torch.Tensor:
    return x_BTD.gather(1, pos_BQ.unsqueeze(-1).expand(-1, -1, x_BTD.shape[-1]))


def subset_block(layer: nn.Module, h_BTD: torch.Tensor, cos_TK: torch.Tensor, sin_TK: torch.Tensor,
                 pos_BQ: torch.Tensor, valid_BQ: torch.Tensor, keys: str = "all",
                 scale_BQ: torch.Tensor | None = None) -> torch.Tensor:
    """h with the rows at (b, pos_BQ[b, q]) for valid_BQ replaced by the layer's output there.

    `pos_BQ` must be ascending per row over its valid entries; invalid (padding) slots are ignored.
    With `scale_BQ`, a selected row becomes h + scale * (layer(h) - h) (Mixture-of-Depths' router weight).
    """
    attn = layer.self_attn
    B, T, D = h_BTD.shape
    Q = pos_BQ.shape[1]
    H, G, K = attn.n_heads, attn.n_kv_heads, attn.head_dim
    hq_BQD = gather_rows(h_BTD, pos_BQ)
    xq_BQD = layer.input_layernorm(hq_BQD)
    if keys == "all":
        xk = layer.input_layernorm(h_BTD)
        posk = torch.arange(T, device=h_BTD.device).expand(B, T)
        allowed = posk[:, None, :] <= pos_BQ[:, :, None]
    else:
        xk, posk = xq_BQD, pos_BQ
        allowed = (posk[:, None, :] <= pos_BQ[:, :, None]) & valid_BQ[:, None, :]
    allowed = allowed | ~valid_BQ[:, :, None]  # padding queries see every key: no all-masked row, no NaN
    Tk = xk.shape[1]
    q = attn.q_proj(xq_BQD).view(B, Q, H, K).transpose(1, 2)
    k = attn.k_proj(xk).view(B, Tk, G, K).transpose(1, 2)
    v = attn.v_proj(xk).view(B, Tk, G, K).transpose(1, 2)
    q = apply_rotary(q, cos_TK[pos_BQ].unsqueeze(1), sin_TK[pos_BQ].unsqueeze(1))
    k = apply_rotary(k, cos_TK[posk].unsqueeze(1), sin_TK[posk].unsqueeze(1))
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed.unsqueeze(1), enable_gqa=G != H)
    r_BQD = hq_BQD + attn.o_proj(o.transpose(1, 2).reshape(B, Q, H * K))
    # the FFN sees valid rows only, packed, so an MoE router never routes padding
    h_ND = hq_BQD[valid_BQ]
    r_ND = r_BQD[valid_BQ]
    out_ND = r_ND + layer.ffn(layer.post_attention_layernorm(r_ND))
    if scale_BQ is not None:
        out_ND = h_ND + scale_BQ[valid_BQ].unsqueeze(-1).to(out_ND.dtype) * (out_ND - h_ND)
    rows_B1 = torch.arange(B, device=h_BTD.device).unsqueeze(1)
    flat_N = (rows_B1 * T + pos_BQ)[valid_BQ]
    return h_BTD.reshape(B * T, D).index_copy(0, flat_N, out_ND.to(h_BTD.dtype)).view(B, T, D)
