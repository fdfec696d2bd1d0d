"""Block-sparse causal attention: each query block attends to its top-scoring key blocks only.

Shape legend: B = rows, H = query heads, G = key/value heads, T = sequence, K = head dim, N = blocks along the
sequence (T / b), b = block size, S = kept key blocks of one query block, M = kept (query, key) block pairs.

Selection (`select_blocks`, no gradient): the causal block grid of a sequence has N (N + 1) / 2 (query block,
key block) pairs with key block <= query block. Per head and query block n, the kept key blocks are the
k_n = clamp(round(density x (n + 1)), 1, n + 1) highest by a cheap score, the dot product of the block's
mean-pooled query and mean-pooled key (scaled by 1 / sqrt(K)); the diagonal block is always kept (it holds the
token itself, so no row is empty). Every head keeps the same count per query block (so one query block's work
is one batched call), which also makes the kept share of the grid a function of the density and T alone
(`kept_fraction`): the cost a planner predicts is exact, whatever the data.

Kernel (`block_sparse_attention`): the kept key and value blocks of every query block are gathered in one
`torch.gather` each (M blocks: its backward is one scatter-add into a zero tensor of the keys' size), split per
query block (one concatenation in backward), and each query block runs one fused `scaled_dot_product_attention`
over its S kept blocks, the diagonal block last under a lower-triangular mask. Work: M / (N (N + 1) / 2) of the
dense causal attention core, plus O(T K) for the gathers, the pooling and the scores (N^2 K), so on a CPU its
time follows the kept share (measured in docs/dynamism.md; `scripts/bench_sparse_attention.py`).

The dense reference with the same mask is `dense_block_attention` (the full T x T boolean mask from the same
selection, one masked SDPA): tested equal in forward and backward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["BlockSelection", "block_mask", "block_scores", "block_sparse_attention", "coverage_density",
           "dense_block_attention", "kept_counts", "kept_fraction", "select_blocks", "select_from_scores"]


def kept_counts(n_blocks: int, density: float) -> list[int]:
    """Key blocks kept per query block n: round(density x (n + 1)) within [1, n + 1]."""
    return [min(n + 1, max(1, round(density * (n + 1)))) for n in range(n_blocks)]


def kept_fraction(seq_len: int, block: int, density: float) -> float:
    """The kept share of the causal block grid at `density` (what the attention core costs relative to dense)."""
    n = max(1, math.ceil(seq_len / block))
    return sum(kept_counts(n, density)) / (n * (n + 1) / 2)


@dataclass(frozen=True)
class BlockSelection:
    """Kept key blocks: `index_BGM` lists, per key/value head, query block after query block, each one's kept key
    blocks (its diagonal block last); `counts[n]` of them belong to query block n."""

    index_BGM: torch.Tensor
    counts: tuple[int, ...]
    block: int

    @property
    def kept(self) -> int:
        return sum(self.counts)


@torch.no_grad()
def block_scores(q_BHTK: torch.Tensor, k_BGTK: torch.Tensor, block: int) -> torch.Tensor:
    """[B, G, N, N] pooled block scores: a group's mean-pooled query block (averaged over the group's heads) dot
    the mean-pooled key block, over sqrt(K); -inf where the key block is after the query block. T must be a
    multiple of `block`."""
    B, H, T, K = q_BHTK.shape
    G, N = k_BGTK.shape[1], T // block
    qm_BGNK = q_BHTK.float().view(B, G, H // G, N, block, K).mean(dim=(2, 4))
    km_BGNK = k_BGTK.float().view(B, G, N, block, K).mean(3)
    s_BGNN = qm_BGNK @ km_BGNK.transpose(-1, -2) / math.sqrt(K)
    idx = torch.arange(N, device=q_BHTK.device)
    return s_BGNN.masked_fill(idx[None, :] > idx[:, None], float("-inf"))


@torch.no_grad()
def select_from_scores(s_BGNN: torch.Tensor, block: int, density: float) -> BlockSelection:
    """Per key/value head and query block, the top key blocks of `block_scores` (the diagonal always kept)."""
    N = s_BGNN.shape[-1]
    counts = kept_counts(N, density)
    s_BGNN = s_BGNN.masked_fill(torch.eye(N, dtype=torch.bool, device=s_BGNN.device), float("inf"))
    top_BGNS = torch.topk(s_BGNN, max(counts), dim=-1, sorted=True).indices  # the diagonal first (score +inf)
    parts = []
    for n, c in enumerate(counts):
        # the others in ascending block order, then the diagonal (masked lower-triangular in the kernel)
        others = top_BGNS[:, :, n, 1:c].sort(dim=-1).values
        parts.append(torch.cat([others, top_BGNS[:, :, n, :1]], dim=-1))
    return BlockSelection(torch.cat(parts, dim=-1), tuple(counts), block)


def select_blocks(q_BHTK: torch.Tensor, k_BGTK: torch.Tensor, block: int, density: float) -> BlockSelection:
    """Per key/value head and query block, the top key blocks by pooled q.k score (the diagonal always kept,
    causal). A group's query heads share its selection, so the kernel reads each kept block once per group."""
    return select_from_scores(block_scores(q_BHTK, k_BGTK, block), block, density)


@torch.no_grad()
def coverage_density(s_BGNN: torch.Tensor, coverage: float) -> float:
    """The share of the causal block grid needed so that, per head and query block, the highest-scoring key
    blocks cover `coverage` of the softmax mass of the block scores (mean over rows and heads)."""
    N = s_BGNN.shape[-1]
    p_BGNN = torch.softmax(s_BGNN.double(), dim=-1).sort(dim=-1, descending=True).values
    short_BGNN = p_BGNN.cumsum(-1) < coverage - 1e-12  # blocks before the mass is reached
    need_BGN = (short_BGNN.sum(-1) + 1).clamp(max=torch.arange(1, N + 1, device=s_BGNN.device))
    return float(need_BGN.sum(-1).double().mean()) / (N * (N + 1) / 2)


def _diag_mask(c: int, block: int, like: torch.Tensor) -> torch.Tensor:
    """[b, c b] additive mask in `like`'s dtype: 0 on the c - 1 other blocks, the diagonal block (last) causal
    (-inf above its diagonal). Additive, not bool: SDPA would convert a bool mask on every call."""
    m = torch.zeros(block, c * block, dtype=like.dtype, device=like.device)
    upper = torch.ones(block, block, dtype=torch.bool, device=like.device).triu(1)
    m[:, (c - 1) * block:].masked_fill_(upper, float("-inf"))
    return m


def _runs(counts: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """(first query block, how many, kept count) of each run of consecutive query blocks that keep as many key
    blocks (counts never decrease along the sequence, so equal counts are consecutive)."""
    runs: list[tuple[int, int, int]] = []
    for n, c in enumerate(counts):
        if runs and runs[-1][2] == c:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1, c)
        else:
            runs.append((n, 1, c))
    return runs


def _run_rows(sel: BlockSelection, runs: list[tuple[int, int, int]], B: int, G: int, N: int) -> torch.Tensor:
    """Rows of the [B G N, b K] block table to gather, run after run, each run ordered (query block, row, group,
    kept block): a run's gathered blocks are then directly its [R B, G, c b, K] key tensor."""
    dev = sel.index_BGM.device
    base_BG1 = (torch.arange(B * G, device=dev) * N).view(B, G, 1)
    rows_BGM = base_BG1 + sel.index_BGM
    parts, off = [], 0
    for _, r, c in runs:
        parts.append(rows_BGM[:, :, off:off + r * c].reshape(B, G, r, c).permute(2, 0, 1, 3).reshape(-1))
        off += r * c
    return torch.cat(parts)


def block_sparse_attention(q_BHTK: torch.Tensor, k_BGTK: torch.Tensor, v_BGTK: torch.Tensor,
                           sel: BlockSelection) -> torch.Tensor:
    """Causal attention of each query block over its selected key blocks only (differentiable in q, k, v).

    Query blocks that keep as many key blocks (a run: R consecutive query blocks) run as one SDPA call, stacked
    along the batch dimension. Queries are laid out block-major once ([N B, H, b, K]: one copy), and the key and
    value blocks are gathered in each run's order, so every run's tensors are views, with no copy per run."""
    B, H, T, K = q_BHTK.shape
    G, b = k_BGTK.shape[1], sel.block
    N, gqa = T // b, G != H
    runs = _runs(sel.counts)
    rows = _run_rows(sel, runs, B, G, N)
    k_all = k_BGTK.reshape(B * G * N, b * K).index_select(0, rows)
    v_all = v_BGTK.reshape(B * G * N, b * K).index_select(0, rows)
    sizes = [r * c * B * G for _, r, c in runs]
    q_NBHbK = q_BHTK.view(B, H, N, b, K).permute(2, 0, 1, 3, 4).contiguous()
    outs = []
    for (n0, r, c), k_rows, v_rows in zip(runs, torch.split(k_all, sizes), torch.split(v_all, sizes)):
        q_XHbK = q_NBHbK[n0:n0 + r].view(r * B, H, b, K)
        k_XGSK, v_XGSK = k_rows.view(r * B, G, c * b, K), v_rows.view(r * B, G, c * b, K)
        if c == 1:  # the diagonal block alone: plain causal
            outs.append(F.scaled_dot_product_attention(q_XHbK, k_XGSK, v_XGSK, is_causal=True, enable_gqa=gqa))
        else:
            outs.append(F.scaled_dot_product_attention(q_XHbK, k_XGSK, v_XGSK, attn_mask=_diag_mask(c, b, q_BHTK),
                                                       enable_gqa=gqa))
    o_NBHbK = torch.cat(outs).view(N, B, H, b, K)
    return o_NBHbK.permute(1, 2, 0, 3, 4).reshape(B, H, T, K)


def block_mask(sel: BlockSelection, T: int) -> torch.Tensor:
    """[B, G, T, T] bool: the token-level mask the selection means (kept blocks, causal inside the diagonal)."""
    B, G, _ = sel.index_BGM.shape
    b, N, dev = sel.block, T // sel.block, sel.index_BGM.device
    keep_BGNN = torch.zeros(B, G, N, N, dtype=torch.bool, device=dev)
    rows_M = torch.repeat_interleave(torch.arange(N, device=dev), torch.tensor(sel.counts, device=dev))
    bi, gi = torch.arange(B, device=dev)[:, None, None], torch.arange(G, device=dev)[None, :, None]
    keep_BGNN[bi, gi, rows_M[None, None, :], sel.index_BGM] = True
    m_BGTT = keep_BGNN.repeat_interleave(b, dim=2).repeat_interleave(b, dim=3)
    return m_BGTT & torch.ones(T, T, dtype=torch.bool, device=dev).tril()


def dense_block_attention(q_BHTK: torch.Tensor, k_BGTK: torch.Tensor, v_BGTK: torch.Tensor,
                          sel: BlockSelection) -> torch.Tensor:
    """The reference: dense attention under `block_mask(sel)` (one masked SDPA over the whole sequence; a
    group's query heads share its mask)."""
    H, G, T = q_BHTK.shape[1], k_BGTK.shape[1], q_BHTK.shape[2]
    mask_BHTT = block_mask(sel, T).repeat_interleave(H // G, dim=1)
    return F.scaled_dot_product_attention(q_BHTK, k_BGTK, v_BGTK, attn_mask=mask_BHTT, enable_gqa=G != H)
