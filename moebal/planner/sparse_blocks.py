"""The block arithmetic of block-sparse causal attention, shared by its kernel (moebal/kernels/sparse_attention.py)
and the pure planners (cost factors, the memory plan), which import no torch.

A sequence of T tokens in blocks of b has N = ceil(T / b) blocks and a causal grid of N (N + 1) / 2 (query block,
key block) pairs. Query block n keeps k_n = round(density x (n + 1)) key blocks within [1, n + 1], so the kept
share of the grid is a function of the density alone.
"""

from __future__ import annotations

import math

__all__ = ["SPLIT_MIN_ROWS", "fit_cost_constants", "kept_counts", "kept_fraction", "shares_masks",
           "sparse_block_advice", "sparse_block_fits"]


def kept_counts(n_blocks: int, density: float) -> list[int]:
    """Key blocks kept per query block n: round(density x (n + 1)) within [1, n + 1]."""
    return [min(n + 1, max(1, round(density * (n + 1)))) for n in range(n_blocks)]


def kept_fraction(seq_len: int, block: int, density: float) -> float:
    """The kept share of the causal block grid at `density` (what the attention core costs relative to dense)."""
    n = max(1, math.ceil(seq_len / block))
    return sum(kept_counts(n, density)) / (n * (n + 1) / 2)


def fit_cost_constants(points: list[tuple[float, float]], other: float, attn: float) -> tuple[float, float]:
    """The sparse_attention scheme's two cost constants (w = `attn_weight`, o = `overhead`) fitted to a layer's
    measured times: `points` are (kept share f, measured time over the dense layer's m) below density 1, `other`
    and `attn` the layer's multiply-adds outside and inside the attention core (`layer_token_flops`).

    The scheme predicts m = (other + w attn (o + f)) / (other + w attn). With a = w attn / other this is
    m - 1 = a o + a (f - m): a line in x = f - m with slope a and intercept a o, fitted by least squares;
    w = a other / attn, o = intercept / a. o may not be negative (the scheme refuses it: a sparse path cheaper
    than the dense one at equal kept share is a kernel difference the model does not have), so a negative intercept
    is refitted through the origin (o = 0, a = sum(x y) / sum(x^2), the least-squares fit on that boundary).
    Refuses fewer than two distinct x, or a slope <= 0 (a layer whose time does not fall with the kept share has
    no attention weight to fit)."""
    xs = [f - m for f, m in points]
    ys = [m - 1.0 for _, m in points]
    n = len(points)
    if n < 2 or max(xs) - min(xs) < 1e-9:
        raise ValueError(f"fitting the cost constants needs at least two densities below 1 with different "
                         f"kept share minus measured factor; got {points}")
    mx, my = sum(xs) / n, sum(ys) / n
    a = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    c = my - a * mx
    if a > 0 and c < 0:
        a, c = sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs), 0.0
    if a <= 0:
        raise ValueError(f"the measured times do not fall with the kept share (slope {a:.3g} <= 0): no attention "
                         f"weight fits them; points {points}")
    return a * other / attn, c / a


def shares_masks(block: int, element_size: int) -> bool:
    """Whether the kernel's masked path lets its runs share one mask storage (each run's [b, c b] mask a view of
    one [b, c_max b] tensor): where a block's row of mask values fills whole 16-byte words, so that every view
    starts on a 16-byte boundary and its row stride is a multiple of 16 bytes. CUDA's memory-efficient attention
    needs both of a bias (it pads a bias whose strides are not aligned, and refuses a misaligned start). Other
    blocks (not a multiple of 8 in bf16, of 4 in fp32) get a contiguous mask per run."""
    return (block * element_size) % 16 == 0


SPLIT_MIN_ROWS = 192
"""The kernel's split path (CPU) folds a group's query heads into the query length, (H / G) x block rows: from 192
rows torch's CPU flash kernel works in 64-row query chunks instead of 32-row ones, and only there did the split path
measure faster than the masked one at every density (docs/dynamism.md: blocks of 128 and 256 with 2 query heads per
group, faster; blocks of 64, 128 rows, even at density 0.5 and slower at 0.25). Below it a CPU runs the masked
path (`moebal.kernels.sparse_attention.default_path`)."""


def sparse_block_fits(seq_len: int, block: int) -> bool:
    """Whether dynamic sparse attention's `block` cuts a row of `seq_len` tokens into at least 2 whole blocks."""
    return block >= 1 and seq_len % block == 0 and seq_len // block >= 2


def sparse_block_advice(seq_len: int, block: int) -> str:
    fit = 64  # the default block, halved until it cuts the row into at least 2 whole blocks
    while fit > 1 and not sparse_block_fits(seq_len, fit):
        fit //= 2
    return (f"dynamism sparse_attention: block ({block}) must divide data.seq_len ({seq_len}) into at least 2 "
            f"blocks: set dynamism.sparse_attention.block={fit}, or a longer data.seq_len")
