"""The block arithmetic of block-sparse causal attention, shared by its kernel (moebal/kernels/sparse_attention.py)
and the pure planners (cost factors, the memory plan), which import no torch.

A sequence of T tokens in blocks of b has N = ceil(T / b) blocks and a causal grid of N (N + 1) / 2 (query block,
key block) pairs. Query block n keeps k_n = round(density x (n + 1)) key blocks within [1, n + 1], so the kept
share of the grid is a function of the density alone.
"""

from __future__ import annotations

import math

__all__ = ["SPLIT_MIN_ROWS", "kept_counts", "kept_fraction", "shares_masks", "sparse_block_advice", "sparse_block_fits"]


def kept_counts(n_blocks: int, density: float) -> list[int]:
    """Key blocks kept per query block n: round(density x (n + 1)) within [1, n + 1]."""
    return [min(n + 1, max(1, round(density * (n + 1)))) for n in range(n_blocks)]


def kept_fraction(seq_len: int, block: int, density: float) -> float:
    """The kept share of the causal block grid at `density` (what the attention core costs relative to dense)."""
    n = max(1, math.ceil(seq_len / block))
    return sum(kept_counts(n, density)) / (n * (n + 1) / 2)


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
