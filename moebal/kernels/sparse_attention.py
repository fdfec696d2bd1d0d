"""Block-sparse causal attention: each query block attends to its top-scoring key blocks only.

Shape legend: B = rows, H = query heads, G = key/value heads, T = sequence, K = head dim, N = blocks along the
sequence (T / b), b = block size, S = kept key blocks of one query block, M = kept (query, key) block pairs,
X = the batch of one kernel call (query blocks x rows), L = a call's query length (a group's heads folded in).

Selection (`select_blocks`, no gradient): the causal block grid of a sequence has N (N + 1) / 2 (query block,
key block) pairs with key block <= query block. Per head and query block n, the kept key blocks are the
k_n = clamp(round(density x (n + 1)), 1, n + 1) highest by a cheap score, the dot product of the block's
mean-pooled query and mean-pooled key (scaled by 1 / sqrt(K)); the diagonal block is always kept (it holds the
token itself, so no row is empty). Every head keeps the same count per query block (so one query block's work
is one batched call), which also makes the kept share of the grid a function of the density and T alone
(`kept_fraction`): the cost a planner predicts is exact, whatever the data.

Kernel (`block_sparse_attention`), two paths computing the same attention; `default_path` picks one per device
and shape:
- "split" (CPU, torch's CPU flash-attention ops `_scaled_dot_product_flash_attention_for_cpu` and its backward,
  private aten ops that return and take the log-sum-exp): no mask anywhere. The diagonal blocks of all query
  blocks run as one causal (`is_causal`) call; the off-diagonal kept blocks are gathered once (one
  `index_select` each for keys and values, in run order) and query blocks that keep as many blocks (a run) run
  as one mask-free call, a group's query heads folded into the query length; the two parts are merged by their
  log-sum-exps. Backward calls the flash backward per part with the merged output and log-sum-exp (see
  `_SplitBlocks`). An additive mask makes the CPU flash kernel's forward about 1.7x slower per block pair
  (docs/dynamism.md), hence the split.
- "masked" (any device, public `scaled_dot_product_attention` only; CUDA's path): the kept blocks gathered once,
  each run one SDPA call over its c kept blocks, the diagonal block last under an additive lower-triangular
  mask.
Work: M / (N (N + 1) / 2) of the dense causal attention core, plus O(T K) for the gathers, the pooling and the
scores (N^2 K), so on a CPU its time follows the kept share (measured in docs/dynamism.md;
`scripts/bench_sparse_attention.py`).

The dense reference with the same mask is `dense_block_attention` (the full T x T boolean mask from the same
selection, one masked SDPA): tested equal in forward and backward.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

__all__ = ["PATHS", "SPLIT_MIN_ROWS", "BlockSelection", "block_mask", "block_scores", "block_sparse_attention",
           "coverage_density", "default_path", "dense_block_attention", "kept_counts", "kept_fraction",
           "masked_block_attention", "select_blocks", "select_from_scores", "split_block_attention"]


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
    # summed over the block first (contiguous), then averaged: a strided mean over both is ~2x slower
    qm_BGNK = q_BHTK.float().view(B, G, H // G, N, block, K).sum(4).mean(2) / block
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
    # each query block's first c_n of them, in ascending block order: its others (all before it, causal), then
    # its diagonal block last; the blocks past c_n are pushed to the end (id N) and dropped
    dev = s_BGNN.device
    keep_NS = torch.arange(top_BGNS.shape[-1], device=dev) < torch.tensor(counts, device=dev)[:, None]
    ids_BGNS = top_BGNS.masked_fill(~keep_NS, N).sort(dim=-1).values
    B, G = s_BGNN.shape[:2]
    return BlockSelection(ids_BGNS.masked_select(keep_NS).view(B, G, sum(counts)), tuple(counts), block)


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


@functools.lru_cache(maxsize=64)
def _run_order(counts: tuple[int, ...], B: int, G: int, diagonal: bool) -> torch.Tensor:
    """Positions in a flattened [B, G, M] index of the blocks the kernel gathers, run after run, each run ordered
    (query block, row, group, kept block); `diagonal=False` leaves each query block's diagonal (its last) out. A
    function of the counts alone (cached: the counts repeat whenever the density does)."""
    M, parts, off = sum(counts), [], 0
    base_BG = (torch.arange(B)[:, None] * G + torch.arange(G)[None, :]) * M
    for _, r, c in _runs(counts):
        kept = c if diagonal else c - 1
        pos_rj = off + torch.arange(r)[:, None] * c + torch.arange(kept)[None, :]
        parts.append((base_BG[None, :, :, None] + pos_rj[:, None, None, :]).reshape(-1))
        off += r * c
    return torch.cat(parts)


def _run_rows(sel: BlockSelection, B: int, G: int, N: int, diagonal: bool = True) -> torch.Tensor:
    """Rows of the [B G N, b K] block table to gather, run after run, each run ordered (query block, row, group,
    kept block): a run's gathered blocks are then directly its [R B, G, c b, K] key tensor (`_run_order`)."""
    dev = sel.index_BGM.device
    rows_BGM = (torch.arange(B * G, device=dev) * N).view(B, G, 1) + sel.index_BGM
    return rows_BGM.view(-1)[_run_order(sel.counts, B, G, diagonal).to(dev)]


def masked_block_attention(q_BHTK: torch.Tensor, k_BGTK: torch.Tensor, v_BGTK: torch.Tensor,
                           sel: BlockSelection) -> torch.Tensor:
    """The "masked" path (any device, public SDPA only): query blocks that keep as many key blocks (a run: R
    consecutive query blocks) run as one `scaled_dot_product_attention` call, stacked along the batch
    dimension, over their kept blocks with the diagonal block last under an additive lower-triangular mask.
    Queries are laid out block-major once ([N B, H, b, K]: one copy), and the key and value blocks are gathered
    in each run's order, so every run's tensors are views, with no copy per run."""
    B, H, T, K = q_BHTK.shape
    G, b = k_BGTK.shape[1], sel.block
    N, gqa = T // b, G != H
    runs = _runs(sel.counts)
    rows = _run_rows(sel, B, G, N)
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


# torch's CPU flash-attention kernel, which also returns the log-sum-exp of every query row, and its backward,
# which takes the output and the log-sum-exp as inputs. Private ops: absent (None) in a torch without them, and
# CPU only, so the "split" path is chosen only where they exist (`default_path`).
_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_BWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)

PATHS = ("split", "masked")


SPLIT_MIN_ROWS = 192
"""The split path's mask-free calls fold a group's query heads into the query length, (H / G) x block rows: from
192 rows torch's CPU flash kernel works in 64-row query chunks instead of 32-row ones, and only there did the
split path measure faster than the masked one (docs/dynamism.md: blocks of 128 and 256 with 2 query heads per
group, faster; blocks of 64, 128 rows, slower below density 0.5)."""


def default_path(device: torch.device, block: int = 128, group: int = 2) -> str:
    """"split" on a CPU whose torch has the CPU flash-attention ops, where a group's folded query rows (`group`
    = H / G query heads per key/value head, times `block`) reach `SPLIT_MIN_ROWS`; "masked" anywhere else (CUDA
    included: the private CPU ops do not run there, and its public SDPA kernels are the tested path)."""
    if device.type != "cpu" or _FLASH is None or _FLASH_BWD is None:
        return "masked"
    return "split" if group * block >= SPLIT_MIN_ROWS else "masked"


def _diag_kv(t_BGTK: torch.Tensor, H: int, b: int) -> torch.Tensor:
    """[N B, H, b, K]: each query block's diagonal key (or value) block, block-major, copied once per query head
    of the group (the flash op has no grouped-query heads)."""
    B, G, T, K = t_BGTK.shape
    N = T // b
    t_BGhNbK = t_BGTK.reshape(B, G, 1, N, b, K).expand(B, G, H // G, N, b, K)
    return t_BGhNbK.permute(3, 0, 1, 2, 4, 5).reshape(N * B, H, b, K)


def _off_views(q_NBHbK: torch.Tensor, k_off: torch.Tensor, v_off: torch.Tensor, runs: list[tuple[int, int, int]],
               G: int) -> list[tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per run with off-diagonal blocks (c > 1): (first query block, how many, q, k, v) as views, the group's
    H / G query heads folded into the query length ([R B, G, (H / G) b, K]): no mask, so a query row's head
    does not matter, and each gathered key block is read once per group."""
    N, B, H, b, K = q_NBHbK.shape
    sizes = [r * (c - 1) * B * G for _, r, c in runs]
    out = []
    for (n0, r, c), k_rows, v_rows in zip(runs, torch.split(k_off, sizes), torch.split(v_off, sizes)):
        if c > 1:
            q_XGLK = q_NBHbK[n0:n0 + r].view(r * B, G, (H // G) * b, K)
            out.append((n0, r, q_XGLK, k_rows.view(r * B, G, (c - 1) * b, K), v_rows.view(r * B, G, (c - 1) * b, K)))
    return out


class _SplitBlocks(torch.autograd.Function):
    """The "split" path: each query block's attention in two parts without a mask tensor, merged by their
    log-sum-exps.

    1. Diagonal part: every query block against its own key block, causal (`is_causal`), all N blocks in one
       call ([N B, H, b, K]).
    2. Off-diagonal part: per run, the query blocks against their c - 1 gathered earlier key blocks, no mask.
    3. Merge (FlashAttention's rescaling), in place on the diagonal part's output: with w = e^(lse_o - lse) =
       sigmoid(lse_o - lse_d), o = o_d + w (o_o - o_d) and lse = logaddexp(lse_d, lse_o). Query blocks with
       c = 1 have the diagonal part alone.
    Backward (as ring attention does): given the FINAL output and log-sum-exp, each part's flash backward gives
    exactly its share of the gradients (its probabilities are exp(s - lse), and D = rowsum(dO o) is the whole
    row's), so dQ is the sum of the parts' and each key block's gradient comes from the part that read it."""

    @staticmethod
    def forward(ctx: Any, q_BHTK: torch.Tensor, k_BGTK: torch.Tensor, v_BGTK: torch.Tensor, rows: torch.Tensor,
                runs: list[tuple[int, int, int]], b: int) -> torch.Tensor:
        assert _FLASH is not None
        B, H, T, K = q_BHTK.shape
        G, N, scale = k_BGTK.shape[1], T // b, 1.0 / math.sqrt(K)
        q_NBHbK = q_BHTK.reshape(B, H, N, b, K).permute(2, 0, 1, 3, 4).contiguous()
        kd, vd = _diag_kv(k_BGTK, H, b), _diag_kv(v_BGTK, H, b)
        o_XHbK, lse_XHb = _FLASH(q_NBHbK.view(N * B, H, b, K), kd, vd, 0.0, True, scale=scale)
        o_NBHbK, lse_NBHb = o_XHbK.contiguous().view(N, B, H, b, K), lse_XHb.contiguous().view(N, B, H, b)
        k_off = k_BGTK.reshape(B * G * N, b * K).index_select(0, rows)
        v_off = v_BGTK.reshape(B * G * N, b * K).index_select(0, rows)
        for n0, r, q_p, k_p, v_p in _off_views(q_NBHbK, k_off, v_off, runs, G):
            o_p, lse_p = _FLASH(q_p, k_p, v_p, 0.0, False, scale=scale)
            o_d, lse_d = o_NBHbK[n0:n0 + r].view(o_p.shape), lse_NBHb[n0:n0 + r].view(lse_p.shape)
            o_d.lerp_(o_p, torch.sigmoid(lse_p - lse_d).unsqueeze(-1).to(o_d.dtype))  # lse: fp32 always
            torch.logaddexp(lse_d, lse_p, out=lse_d)
        ctx.save_for_backward(q_NBHbK, kd, vd, k_off, v_off, rows, o_NBHbK, lse_NBHb)
        ctx.runs, ctx.shape = runs, (B, H, G, T, K, b)
        o_BHTK: torch.Tensor = o_NBHbK.permute(1, 2, 0, 3, 4).reshape(B, H, T, K)
        return o_BHTK

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, do_BHTK: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        assert _FLASH_BWD is not None
        q_NBHbK, kd, vd, k_off, v_off, rows, o_NBHbK, lse_NBHb = ctx.saved_tensors
        B, H, G, T, K, b = ctx.shape
        N, hg, scale = T // b, H // G, 1.0 / math.sqrt(K)
        do_NBHbK = do_BHTK.reshape(B, H, N, b, K).permute(2, 0, 1, 3, 4).contiguous()
        X = N * B
        dq_XHbK, dkd, dvd = _FLASH_BWD(do_NBHbK.view(X, H, b, K), q_NBHbK.view(X, H, b, K), kd, vd,
                                       o_NBHbK.view(X, H, b, K), lse_NBHb.view(X, H, b), 0.0, True, scale=scale)
        # written straight into [B, H, T, K] order through a block-major view (no extra copy at the end)
        dq_BHTK = torch.empty_like(q_NBHbK).view(B, H, T, K)
        dq_NBGhbK = dq_BHTK.view(B, G, hg, N, b, K).permute(3, 0, 1, 2, 4, 5)
        dq_NBGhbK.copy_(dq_XHbK.view(N, B, G, hg, b, K))
        dk_BGTK, dv_BGTK = _diag_grad(dkd, B, G, T, b), _diag_grad(dvd, B, G, T, b)
        dk_rows, dv_rows = dk_BGTK.view(B * G * N, b * K), dv_BGTK.view(B * G * N, b * K)
        at = 0
        for n0, r, q_p, k_p, v_p in _off_views(q_NBHbK, k_off, v_off, ctx.runs, G):
            L = hg * b
            dq_p, dk_p, dv_p = _FLASH_BWD(do_NBHbK[n0:n0 + r].view(r * B, G, L, K), q_p, k_p, v_p,
                                          o_NBHbK[n0:n0 + r].view(r * B, G, L, K),
                                          lse_NBHb[n0:n0 + r].view(r * B, G, L), 0.0, False, scale=scale)
            dq_NBGhbK[n0:n0 + r].add_(dq_p.view(r, B, G, hg, b, K))
            # the gathered blocks' gradients added at their rows (the gather's backward, without a zero tensor)
            at = _index_add_rows(dk_rows, dv_rows, rows, at, dk_p, dv_p, b * K)
        return dq_BHTK, dk_BGTK, dv_BGTK, None, None, None


def _diag_grad(dd_XHbK: torch.Tensor, B: int, G: int, T: int, b: int) -> torch.Tensor:
    """[B, G, T, K]: the diagonal part's key (or value) gradient, summed over each group's query heads."""
    X, H, _, K = dd_XHbK.shape
    N = X // B
    d_BGTK = torch.empty(B, G, T, K, dtype=dd_XHbK.dtype, device=dd_XHbK.device)
    d_NBGbK, dd_NBGhbK = d_BGTK.view(B, G, N, b, K).permute(2, 0, 1, 3, 4), dd_XHbK.view(N, B, G, H // G, b, K)
    d_NBGbK.copy_(dd_NBGhbK[:, :, :, 0])  # copy and add: a strided sum over the heads is ~3x slower
    for j in range(1, H // G):
        d_NBGbK.add_(dd_NBGhbK[:, :, :, j])
    return d_BGTK


def _index_add_rows(dk_rows: torch.Tensor, dv_rows: torch.Tensor, rows: torch.Tensor, at: int, dk_p: torch.Tensor,
                    dv_p: torch.Tensor, width: int) -> int:
    """Add one run's gathered-block gradients at their table rows (`rows[at:]`); the next run's offset."""
    n = dk_p.numel() // width
    dk_rows.index_add_(0, rows[at:at + n], dk_p.reshape(n, width))
    dv_rows.index_add_(0, rows[at:at + n], dv_p.reshape(n, width))
    return at + n


def split_block_attention(q_BHTK: torch.Tensor, k_BGTK: torch.Tensor, v_BGTK: torch.Tensor,
                          sel: BlockSelection) -> torch.Tensor:
    """The "split" path (CPU, torch's CPU flash-attention ops; see `_SplitBlocks`): no mask anywhere. Raises
    where the ops are missing or the tensors are not on a CPU (the "masked" path runs there)."""
    if _FLASH is None or _FLASH_BWD is None or q_BHTK.device.type != "cpu":
        raise RuntimeError(f"the split block-sparse attention path needs torch's CPU flash-attention ops on a CPU "
                           f"tensor (device {q_BHTK.device}, ops present: {_FLASH is not None}); use "
                           f"path='masked'")
    B, H, T, K = q_BHTK.shape
    G, b = k_BGTK.shape[1], sel.block
    runs = _runs(sel.counts)
    rows = _run_rows(sel, B, G, T // b, diagonal=False)
    with torch.autocast("cpu", enabled=False):  # computes in its inputs' dtype, whatever autocast casts
        out: torch.Tensor = _SplitBlocks.apply(q_BHTK, k_BGTK, v_BGTK, rows, runs, b)
    return out


def block_sparse_attention(q_BHTK: torch.Tensor, k_BGTK: torch.Tensor, v_BGTK: torch.Tensor,
                           sel: BlockSelection, path: str | None = None) -> torch.Tensor:
    """Causal attention of each query block over its selected key blocks only (differentiable in q, k, v).

    `path`: "split" (mask-free parts merged by log-sum-exp, CPU only) or "masked" (public SDPA with an additive
    mask on the diagonal block, any device); None takes `default_path` for q's device and shape. Both compute the same
    attention (tested against each other and against `dense_block_attention`)."""
    if path is None:
        path = default_path(q_BHTK.device, sel.block, q_BHTK.shape[1] // k_BGTK.shape[1])
    if path == "split":
        return split_block_attention(q_BHTK, k_BGTK, v_BGTK, sel)
    if path == "masked":
        return masked_block_attention(q_BHTK, k_BGTK, v_BGTK, sel)
    raise ValueError(f"block_sparse_attention: path must be one of {PATHS} or None; got {path!r}")


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
