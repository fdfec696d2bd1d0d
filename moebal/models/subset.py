"""A decoder layer run on a subset of token positions, with the layer's own modules (no copy, no new maths).

Shape legend: B = rows, T = sequence, Q = selected positions per row (padded), D = model dim, H = query heads,
G = key/value heads, K = head dim, N = valid selected tokens over all rows.

Early exit and Mixture-of-Depths skip a layer's compute for some tokens. `subset_block` computes the layer for
the selected positions only: queries, attention output, the FFN (dense or MoE) and the residual, for those
rows; keys and values come either from every position (`keys="all"`: early exit, where an exited token's
frozen hidden state still serves as context, CALM's state propagation) or from the selected positions only
(`keys="subset"`: Mixture-of-Depths, where the block is a shorter sequence). Positions keep their rotary
angles and the causal order of the full sequence. When every position is selected the plain layer runs.

`skip_layer` is the layer with no position selected. Alone, it computes nothing. An MoE block whose experts
or routing statistics are shared with other ranks (expert parallelism, summed load-balancing statistics)
must still join their collectives, with no tokens of its own: the all-to-alls carry the other ranks' tokens
to the experts held here, and their backward must run too, so the empty output is tied into the graph.

Recomputation (`train.recompute`, moebal/models/recompute.py) follows the decoder layer's own rules on the
subset: "attention" recomputes the attention region (norms, projections, attention and residual of the
selected rows; with `keys="all"` the keys and values of every position, the larger part), "moe" the FFN region
of the selected rows, "full" the whole subset block, keeping its inputs. An MoE block that talks to other ranks
is never replayed whole: "moe" and "full" then recompute its rank-local expert compute (`recompute_local`) and
"full" recomputes the attention region. The replays restore the random generators' states, so fp32 losses and
gradients stay bit-identical to no recomputation (tests/unit/test_recompute.py).
"""

from __future__ import annotations

from typing import Any

import torch

from moebal.models.recompute import recompute_call
from moebal.models.transformer import Attention, DecoderLayer, apply_rotary, grouped_sdpa

__all__ = ["gather_rows", "skip_layer", "subset_block"]


def gather_rows(x_BTD: torch.Tensor, pos_BQ: torch.Tensor) -> torch.Tensor:
    return x_BTD.gather(1, pos_BQ.unsqueeze(-1).expand(-1, -1, x_BTD.shape[-1]))


def subset_block(layer: DecoderLayer, h_BTD: torch.Tensor, cos_TK: torch.Tensor, sin_TK: torch.Tensor,
                 pos_BQ: torch.Tensor, valid_BQ: torch.Tensor | None = None, keys: str = "all",
                 scale_BQ: torch.Tensor | None = None) -> torch.Tensor:
    """h with the rows at (b, pos_BQ[b, q]) for valid_BQ replaced by the layer's output there.

    `pos_BQ` must be ascending per row over its valid entries; invalid (padding) slots are ignored.
    `valid_BQ=None`: every slot is a real position (Mixture-of-Depths keeps C tokens in every row), which
    takes a cheaper path: no padding masks, no boolean gathers (host syncs), and on selected keys plain causal
    attention (ascending positions: causal among the selected tokens is the lower triangle).
    With `scale_BQ`, a selected row becomes h + scale * (layer(h) - h) (Mixture-of-Depths' router weight).
    """
    attn = layer.self_attn
    if not isinstance(attn, Attention):
        raise ValueError(f"subset_block: a token-subset layer (early exit, Mixture-of-Depths) needs grouped-query "
                         f"attention, not {type(attn).__name__}: unset model.mla or the dynamism scheme")
    if layer.recomputes("full") and layer.ffn_replayable():
        return recompute_call(lambda h, cos, sin, pos, valid, scale: _subset(layer, h, cos, sin, pos, valid, keys,
                                                                            scale, regions=False),
                              layer.moe_block(), h_BTD, cos_TK, sin_TK, pos_BQ, valid_BQ, scale_BQ)
    return _subset(layer, h_BTD, cos_TK, sin_TK, pos_BQ, valid_BQ, keys, scale_BQ, regions=True)


def _subset(layer: DecoderLayer, h_BTD: torch.Tensor, cos_TK: torch.Tensor, sin_TK: torch.Tensor,
            pos_BQ: torch.Tensor, valid_BQ: torch.Tensor | None, keys: str, scale_BQ: torch.Tensor | None,
            regions: bool) -> torch.Tensor:
    """`subset_block`'s computation. `regions`: recompute the attention region and the FFN region on their own as
    the layer's `recompute` mode says (the decoder layer's `attention_part` and `ffn_part` rules); false inside a
    whole-block recomputation, which replays everything."""
    B, T, D = h_BTD.shape
    Q = pos_BQ.shape[1]
    hq_BQD = gather_rows(h_BTD, pos_BQ)
    if regions and layer.recomputes("attention", "full"):
        r_BQD = recompute_call(lambda h, hq, cos, sin, pos, valid: _subset_attention(layer, h, hq, cos, sin, pos,
                                                                                     valid, keys),
                               None, h_BTD, hq_BQD, cos_TK, sin_TK, pos_BQ, valid_BQ)
    else:
        r_BQD = _subset_attention(layer, h_BTD, hq_BQD, cos_TK, sin_TK, pos_BQ, valid_BQ, keys)
    rows_B1 = torch.arange(B, device=h_BTD.device).unsqueeze(1)
    if valid_BQ is None:
        h_ND, r_ND = hq_BQD.reshape(B * Q, D), r_BQD.reshape(B * Q, D)
        flat_N = (rows_B1 * T + pos_BQ).reshape(-1)
        scale_N = scale_BQ.reshape(-1) if scale_BQ is not None else None
    else:  # the FFN sees valid rows only, packed, so an MoE router never routes padding
        h_ND, r_ND = hq_BQD[valid_BQ], r_BQD[valid_BQ]
        flat_N = (rows_B1 * T + pos_BQ)[valid_BQ]
        scale_N = scale_BQ[valid_BQ] if scale_BQ is not None else None
    # the layer's own FFN part on the selected rows: recomputed as its mode says (an MoE block that talks to other
    # ranks recomputes its rank-local experts itself), plain inside a whole-block recomputation
    out_ND = layer.ffn_part(r_ND, plain=not regions)
    if scale_N is not None:
        out_ND = h_ND + scale_N.unsqueeze(-1).to(out_ND.dtype) * (out_ND - h_ND)
    return h_BTD.reshape(B * T, D).index_copy(0, flat_N, out_ND.to(h_BTD.dtype)).view(B, T, D)


def _subset_attention(layer: DecoderLayer, h_BTD: torch.Tensor, hq_BQD: torch.Tensor, cos_TK: torch.Tensor,
                      sin_TK: torch.Tensor, pos_BQ: torch.Tensor, valid_BQ: torch.Tensor | None,
                      keys: str) -> torch.Tensor:
    """The selected rows `hq_BQD` (h at pos_BQ) after the attention and its residual: [B, Q, D]."""
    attn = layer.self_attn
    assert isinstance(attn, Attention)
    B, T, D = h_BTD.shape
    Q = pos_BQ.shape[1]
    H, G, K = attn.n_heads, attn.n_kv_heads, attn.head_dim
    xq_BQD = layer.input_layernorm(hq_BQD)
    if keys == "all":
        xk = layer.input_layernorm(h_BTD)
        posk = torch.arange(T, device=h_BTD.device).expand(B, T)
    else:
        xk, posk = xq_BQD, pos_BQ
    # the layer's own attention on the subset: its q/k norms (`Attention.project`) and its sliding window, which
    # counts the full sequence's positions (under keys="subset" too: Mixture-of-Depths' shorter sequence keeps
    # each token's position, for the window as for the rotary angles)
    window = attn.sliding_window if attn.sliding_window is not None and attn.sliding_window < T else None
    mask: torch.Tensor | None = None
    if keys == "all" or valid_BQ is not None or window is not None:
        diff_BQT = pos_BQ[:, :, None] - posk[:, None, :]
        mask = diff_BQT >= 0
        if window is not None:
            mask = mask & (diff_BQT < window)
        if valid_BQ is not None:
            if keys != "all":
                mask = mask & valid_BQ[:, None, :]
            mask = mask | ~valid_BQ[:, :, None]  # padding queries see every key: no all-masked row, no NaN
    Tk = xk.shape[1]
    q = attn.project(xq_BQD, attn.q_proj, H, "q_norm")
    k = attn.project(xk, attn.k_proj, G, "k_norm")
    v = attn.v_proj(xk).view(B, Tk, G, K).transpose(1, 2)
    q = apply_rotary(q, cos_TK[pos_BQ].unsqueeze(1), sin_TK[pos_BQ].unsqueeze(1))
    k = apply_rotary(k, cos_TK[posk].unsqueeze(1), sin_TK[posk].unsqueeze(1))
    if mask is None:
        o = grouped_sdpa(q, k, v, is_causal=True)
    else:
        o = grouped_sdpa(q, k, v, attn_mask=mask.unsqueeze(1))
    r_BQD: torch.Tensor = hq_BQD + attn.o_proj(o.transpose(1, 2).reshape(B, Q, H * K))
    return r_BQD


class _Tie(torch.autograd.Function):
    """h unchanged; `y` (an empty tensor) joins the graph: its backward runs, with a zero gradient."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        ctx.y_meta = (y.shape, y.dtype, y.device)
        return h.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape, dtype, device = ctx.y_meta
        return g, torch.zeros(shape, dtype=dtype, device=device)


def skip_layer(layer: DecoderLayer, h_BTD: torch.Tensor) -> torch.Tensor:
    """Layer `layer` with no token selected: h unchanged (see the module docstring for MoE blocks)."""
    if not getattr(layer, "is_moe", False):
        return h_BTD
    moe = layer.block_sparse_moe
    if moe.is_local():
        moe.aux_loss, moe.balance_sums = torch.zeros((), device=h_BTD.device), None  # nothing routed: no loss
        return h_BTD
    # the peers' MoE input needs a gradient whenever this layer trains (layers freeze whole): so must this one,
    # or the dispatch all-to-all would be missing from this rank's backward while the peers wait in theirs
    x_0D = h_BTD.new_empty(0, h_BTD.shape[-1])
    if torch.is_grad_enabled() and (h_BTD.requires_grad or any(p.requires_grad for p in layer.parameters())):
        x_0D.requires_grad_(True)
    tied_BTD: torch.Tensor = _Tie.apply(h_BTD, layer.ffn(x_0D))  # Function.apply is typed Any
    return tied_BTD
