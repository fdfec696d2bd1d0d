"""Which positions of the micro-batch being computed are padding, for the MoE layers' losses.

Under `data.samples: documents` (and planned micro-batching, which pads rows to its micro-batches' lengths) a row
holds its real tokens first and right padding after (label -100). Causal attention keeps the padding from every
real position, but each MoE layer routes it like a token. Its load-balancing and z losses leave the padding out
(transformers' `load_balancing_loss_func` masks it with the attention mask too): inside `rows(n_B)` a MoE layer
whose input is the micro-batch's whole [B, T] rows computes both losses over the real positions only
(`MoELayer._losses`), so a padded row adds to them exactly what the same row unpadded adds.

What still counts the padding, deliberately: the routing statistics (`RoutingStats`: the dispatched work, which
the expert planner places and the selection-bias update balances) and the capacity (padding is dispatched and
computed). A MoE layer called on a subset of the positions (Mixture-of-Depths' routed tokens, an early exit's
remaining ones: `moebal/models/subset.py`) does not see the rows' shape and counts every position it gets.

The trainer (each micro-batch of the accumulation loop), the pipeline engine (each stage's forward op, from the
`ROW_TOKENS` every stage knows) and a served forward given `row_tokens` set it; a recomputed region's replay runs
under the rows its forward ran under (`current` captured and restored by `moebal.models.recompute`), as router
noise's key does. Outside `rows` every position is real.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass

import torch

from moebal.sync import upload

__all__ = ["Rows", "current", "padded", "real_mask", "real_positions", "restored", "rows", "rows_of_labels"]


@dataclass(frozen=True)
class Rows:
    """A micro-batch of rows T positions wide, holding `n_B` (host int64 [B]) real tokens each, then padding."""

    n_B: torch.Tensor
    T: int


_rows: Rows | None = None


@contextmanager
def restored(r: Rows | None) -> Iterator[None]:
    """Inside: the rows `r` (None: every position is real)."""
    global _rows
    before, _rows = _rows, r
    try:
        yield
    finally:
        _rows = before


def rows(n_B: torch.Tensor | None, T: int) -> AbstractContextManager[None]:
    """Inside: the micro-batch's rows, T positions wide, hold `n_B` (host int64 [B]) real tokens each, then
    padding; None: every position is real."""
    return restored(None if n_B is None else Rows(n_B, T))


def current() -> Rows | None:
    """The rows set by the innermost `rows` (None: every position is real)."""
    return _rows


def padded(n_B: torch.Tensor | None, T: int) -> torch.Tensor | None:
    """`n_B` (host int64 [B], each row's real tokens of T) when a row of it is padded, else None (none given, no
    row, or every row full): the one rule the trainer, the pipeline engine and a served forward apply."""
    return None if n_B is None or n_B.numel() == 0 or int(n_B.min()) == T else n_B


def rows_of_labels(labels_BT: torch.Tensor) -> torch.Tensor | None:
    """Each row's real tokens from host labels (the loader labels only padding -100: moebal/data/loader.py), None
    when no row is padded."""
    return padded((labels_BT != -100).sum(dim=1), labels_BT.shape[1])


def real_mask(lead: torch.Size | tuple[int, ...], device: torch.device) -> torch.Tensor | None:
    """bool [B * T]: the real positions of an input whose leading dimensions `lead` are the current rows' [B, T];
    None when every position is real, or the input is not the rows' whole [B, T] (a subset of positions). No
    host sync: the counts go up to the device."""
    r = _rows
    if r is None or tuple(lead) != (r.n_B.shape[0], r.T):
        return None
    B, T = lead
    return real_positions(r.n_B, T, device).reshape(B * T)


def real_positions(n_B: torch.Tensor, T: int, device: torch.device) -> torch.Tensor:
    """bool [B, T]: True at the real positions of rows holding `n_B` (host) real tokens each, then padding. No
    host sync: the counts go up to the device (`upload`)."""
    return torch.arange(T, device=device) < upload(n_B, device).unsqueeze(1)
