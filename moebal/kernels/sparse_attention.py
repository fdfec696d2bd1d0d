"""Block-sparse causal attention: each query block attends to its top-scoring key blocks only.

Shape legend: B = rows, H = query heads, G = key/value heads, T = sequence, K = head dim, N = blocks along the
sequence (T / b), b = block size, S = kept key blocks of one query block, M = kept (query, key) block pairs,
X = the batch of one kernel call (query blocks x rows), L = a call's query length (a group's heads folded in).

Selection (`select_blocks`, no gradient): the causal block grid of a sequence has N (N + 1) / 2 (query block,
key block) pairs with key block <= query block. Per head and query block n, the kept key blocks are the
k_n = clamp(round(density x (n + 1)), 1, n + 1) highest by a cheap score, the dot product of a causal pooled
query and the block's mean-pooled key (scaled by 1 / sqrt(K)); the diagonal block is always kept (it holds the
token itself, so no row is empty). The pooled query of block n is the mean of the b queries ending at the
block's first row (block n - 1's rows but its first, then block n's first): every row of the block comes at or
after all of them, so a query's kept keys depend on no later token and the layer stays causal. (The block's own
mean query would let a row's selection depend on the rows after it, its own next-token target included: a leak
in training and validation that per-token selection, DynMo's hashing, does not have.) Every head keeps the same
count per query block (so one query block's work is one batched call), which also makes the kept share of the
grid a function of the density and T alone (`kept_fraction`): the cost a planner predicts is exact, whatever the
data.

Kernel (`block_sparse_attention`), three paths computing the same attention; `default_path` picks one per device
and shape:
- "split" (CPU, torch's CPU flash-attention ops `_scaled_dot_product_flash_attention_for_cpu` and its backward,
  private aten ops that return and take the log-sum-exp): every call's queries block-major with a group's query
  heads folded into the query length (one copy). The diagonal blocks of all query blocks run as one call under a
  small additive causal mask ([(H / G) b, b], the only mask); the off-diagonal kept blocks are gathered once
  (one `index_select` each for keys and values, in run order) and query blocks that keep as many blocks (a run)
  run as one mask-free call; the two parts are merged by their log-sum-exps in one pass. Backward calls the
  flash backward per part with the merged output and log-sum-exp and scatters the gathered blocks' gradients
  with one `index_add_` (see `_SplitBlocks`). An additive mask over a run's kept blocks makes the CPU flash
  kernel slower per block pair (docs/dynamism.md), hence the split.
- "masked" (any device, public `scaled_dot_product_attention` only; CUDA's path): the kept blocks gathered once,
  each run one SDPA call over its c kept blocks, the diagonal block last under an additive lower-triangular
  mask; every run's mask is a view of one [b, c_max b] tensor per call (O(T b) kept for the backward) where
  the views stay 16-byte aligned (`shares_masks`), else one mask per run. Under grouped-query attention the
  masked calls pass `enable_gqa` (CUDA takes them with cuDNN's kernel; `expand_kv` repeats keys and values per
  query head instead, which measured slower and in twice the memory on an H200, docs/gpu.md).
- "flex" (CUDA's default): torch's FlexAttention, compiled, under a `BlockMask` built from the selection (the
  kept off-diagonal blocks full, the diagonal partial), so the fused kernel visits only the kept blocks. On an
  H200 it beat "masked" at every measured shape, in a fifth of its memory; it beats dense attention from rows
  of about 16,384 tokens (docs/gpu.md). No CPU backward: not used on a CPU.
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

from moebal.planner.sparse_blocks import SPLIT_MIN_ROWS, kept_counts, kept_fraction, shares_masks

__all__ = ["PATHS", "SPLIT_MIN_ROWS", "BlockSelection", "block_mask", "block_scores", "block_sparse_attention",
           "coverage_density", "default_path", "dense_block_attention", "flex_block_attention", "flex_block_mask",
           "kept_counts", "kept_fraction", "kept_grid", "masked_block_attention", "select_blocks",
           "select_from_scores", "split_block_attention", "trainable_paths"]


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
    """[B, G, N, N] pooled block scores: a group's causal pooled query of each block (the mean of the `block`
    queries ending at the block's first row, averaged over the group's heads; module docstring) dot the
    mean-pooled key block, over sqrt(K); -inf where the key block is after the query block. T must be a multiple
    of `block`; a query block's score reads no row after its first."""
    B, H, T, K = q_BHTK.shape
    G, N = k_BGTK.shape[1], T // block
    q6 = q_BHTK.float().view(B, G, H // G, N, block, K)
    # summed over the block first (contiguous), then averaged: a strided mean over both is ~2x slower
    sum_BGNK, first_BGNK = q6.sum(4).mean(2), q6[:, :, :, :, 0].mean(2)
    window_BGNK = first_BGNK.clone()  # block 0: its first row alone (only its diagonal block is there to keep)
    window_BGNK[:, :, 1:] += sum_BGNK[:, :, :-1] - first_BGNK[:, :, :-1]
    qm_BGNK = window_BGNK / block
    km_BGNK = k_BGTK.float().view(B, G, N, block, K).mean(3)
    s_BGNN = qm_BGNK @ km_BGNK.transpose(-1, -2) / math.sqrt(K)
    return s_BGNN.masked_fill(_grid_masks(N, q_BHTK.device)[0], float("-inf"))


@functools.lru_cache(maxsize=32)
def _grid_masks(N: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, N] bool masks of the block grid, built once per shape and device: key block after the query block
    (not causal), and the diagonal."""
    idx = torch.arange(N, device=device)
    return idx[None, :] > idx[:, None], idx[None, :] == idx[:, None]


@functools.lru_cache(maxsize=64)
def _keep_masks(counts: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, max count] bool: which of a query block's top blocks it drops (past its first c_n), and the flat
    positions of the kept ones ([M], row-major). Built on the host and moved once per counts: a `masked_select` by
    the keep mask would read its output size back from a GPU at every call."""
    S = max(counts)
    keep_NS = torch.arange(S) < torch.tensor(counts)[:, None]
    flat = [n * S + j for n, c in enumerate(counts) for j in range(c)]  # host numbers: no tensor read back
    return (~keep_NS).to(device), torch.tensor(flat, dtype=torch.int64).to(device)


@torch.no_grad()
def select_from_scores(s_BGNN: torch.Tensor, block: int, density: float) -> BlockSelection:
    """Per key/value head and query block, the top key blocks of `block_scores` (the diagonal always kept)."""
    N = s_BGNN.shape[-1]
    counts = kept_counts(N, density)
    s_BGNN = s_BGNN.masked_fill(_grid_masks(N, s_BGNN.device)[1], float("inf"))
    top_BGNS = torch.topk(s_BGNN, max(counts), dim=-1, sorted=True).indices  # the diagonal first (score +inf)
    # each query block's first c_n of them, in ascending block order: its others (all before it, causal), then
    # its diagonal block last; the blocks past c_n are pushed to the end (id N) and dropped
    drop_NS, kept_M = _keep_masks(tuple(counts), s_BGNN.device)
    ids_BGNS = top_BGNS.masked_fill(drop_NS, N).sort(dim=-1).values
    return BlockSelection(ids_BGNS.flatten(2).index_select(2, kept_M), tuple(counts), block)


def select_blocks(q_BHTK: torch.Tensor, k_BGTK: torch.Tensor, block: int, density: float) -> BlockSelection:
    """Per key/value head and query block, the top key blocks by causal pooled q.k score (`block_scores`; the
    diagonal always kept). A group's query heads share its selection, so the kernel reads each kept block once per
    group."""
    return select_from_scores(block_scores(q_BHTK, k_BGTK, block), block, density)


@torch.no_grad()
def coverage_density(s_BGNN: torch.Tensor, coverage: float) -> torch.Tensor:
    """The share of the causal block grid needed so that, per head and query block, the highest-scoring key
    blocks cover `coverage` of the softmax mass of the block scores (mean over rows and heads): a float64
    scalar on the scores' device, so that measuring reads nothing back (the scheme reads a step's sums once)."""
    N = s_BGNN.shape[-1]
    p_BGNN = torch.softmax(s_BGNN.double(), dim=-1).sort(dim=-1, descending=True).values
    short_BGNN = p_BGNN.cumsum(-1) < coverage - 1e-12  # blocks before the mass is reached
    need_BGN = (short_BGNN.sum(-1) + 1).clamp(max=torch.arange(1, N + 1, device=s_BGNN.device))
    return need_BGN.sum(-1).double().mean() / (N * (N + 1) / 2)


def _diag_masks(c_max: int, block: int, like: torch.Tensor) -> torch.Tensor:
    """[b, c_max b] additive mask in `like`'s dtype: 0 on the first c_max - 1 blocks, the last (the diagonal
    block) causal (-inf above its diagonal). Additive, not bool: SDPA would convert a bool mask on every call.
    A run that keeps c blocks takes the view of its last c b columns (`_diag_mask_view`), so every run of a call
    shares this one storage: the masks autograd keeps for the backward are O(T b) per call, not one [b, c b]
    tensor per run (O(T^2) over the runs)."""
    m = torch.zeros(block, c_max * block, dtype=like.dtype, device=like.device)
    upper = torch.ones(block, block, dtype=torch.bool, device=like.device).triu(1)
    m[:, (c_max - 1) * block:].masked_fill_(upper, float("-inf"))
    return m


def _diag_mask_view(masks: torch.Tensor, c: int, block: int) -> torch.Tensor:
    """The [b, c b] mask of a run that keeps c blocks: a view of `_diag_masks`'s last c b columns (row stride
    c_max b, the last dimension contiguous)."""
    return masks[:, masks.shape[1] - c * block:]


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
                           sel: BlockSelection, expand_kv: bool = False) -> torch.Tensor:
    """The "masked" path (any device, public SDPA only): query blocks that keep as many key blocks (a run: R
    consecutive query blocks) run as one `scaled_dot_product_attention` call, stacked along the batch
    dimension, over their kept blocks with the diagonal block last under an additive lower-triangular mask.
    Queries are laid out block-major once ([N B, H, b, K]: one copy), and the key and value blocks are gathered
    in each run's order, so every run's tensors are views, with no copy per run.

    `expand_kv`: under grouped-query attention, the masked calls (runs keeping more than one block) get their
    gathered keys and values repeated to every query head instead of `enable_gqa` (one copy of the kept blocks
    per run). On CUDA, flash attention takes no mask and the memory-efficient kernel no `enable_gqa`, so a masked
    grouped call can only fall back; expanded, the memory-efficient kernel takes it (`scripts/gpu_check.py`
    times both forms). The results are the same either way (tested)."""
    B, H, T, K = q_BHTK.shape
    G, b = k_BGTK.shape[1], sel.block
    N, gqa = T // b, G != H
    runs = _runs(sel.counts)
    rows = _run_rows(sel, B, G, N)
    k_all = k_BGTK.reshape(B * G * N, b * K).index_select(0, rows)
    v_all = v_BGTK.reshape(B * G * N, b * K).index_select(0, rows)
    sizes = [r * c * B * G for _, r, c in runs]
    q_NBHbK = q_BHTK.view(B, H, N, b, K).permute(2, 0, 1, 3, 4).contiguous()
    c_max = max(c for _, _, c in runs)
    masks = _diag_masks(c_max, b, q_BHTK) if c_max > 1 and shares_masks(b, q_BHTK.element_size()) else None
    outs = []
    for (n0, r, c), k_rows, v_rows in zip(runs, torch.split(k_all, sizes), torch.split(v_all, sizes)):
        q_XHbK = q_NBHbK[n0:n0 + r].view(r * B, H, b, K)
        k_XGSK, v_XGSK = k_rows.view(r * B, G, c * b, K), v_rows.view(r * B, G, c * b, K)
        if c == 1:  # the diagonal block alone: plain causal
            outs.append(F.scaled_dot_product_attention(q_XHbK, k_XGSK, v_XGSK, is_causal=True, enable_gqa=gqa))
        else:
            mask = _diag_mask_view(masks, c, b) if masks is not None else _diag_masks(c, b, q_BHTK)
            if gqa and expand_kv:
                k_XGSK, v_XGSK = (t.repeat_interleave(H // G, dim=1) for t in (k_XGSK, v_XGSK))
            outs.append(F.scaled_dot_product_attention(q_XHbK, k_XGSK, v_XGSK, attn_mask=mask,
                                                       enable_gqa=gqa and not expand_kv))
    o_NBHbK = torch.cat(outs).view(N, B, H, b, K)
    return o_NBHbK.permute(1, 2, 0, 3, 4).reshape(B, H, T, K)


# torch's CPU flash-attention kernel, which also returns the log-sum-exp of every query row, and its backward,
# which takes the output and the log-sum-exp as inputs. Private ops: absent (None) in a torch without them, and
# CPU only, so the "split" path is chosen only where they exist (`default_path`).
# The `.default` overloads: called directly, without the packet's overload resolution on every call.
_FLASH = getattr(getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None), "default", None)
_FLASH_BWD = getattr(getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None), "default",
                     None)

PATHS = ("split", "masked", "flex")


@functools.cache
def _flex_attention(device_type: str) -> Any:
    """torch's FlexAttention, compiled (Triton) on CUDA; eager elsewhere (an unfused reference that supports no
    backward on a CPU: the CPU tests check its forward). Compiled with static shapes: each new (rows, length,
    dtype) compiles once (13.5 s for the first on an H200, forward and backward); past dynamo's recompile limit
    (8 shapes by default) torch runs the eager form instead, the same attention unfused. A run's shapes are
    fixed (`data.seq_len` and the micro-batch rows), so it compiles once or twice (training, validation)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False) if device_type == "cuda" else flex_attention


def flex_block_attention(q_BHTK: torch.Tensor, k_BGTK: torch.Tensor, v_BGTK: torch.Tensor,
                         sel: BlockSelection) -> torch.Tensor:
    """The "flex" path: torch's FlexAttention under a block mask built from the selection. Each query block's
    kept off-diagonal blocks are full blocks (no per-element mask) and its diagonal block the one partial block,
    so the fused kernel visits exactly the kept blocks. The mask function also reads the selection (kept block
    and causal), which makes the eager, unfused form (it ignores the block table) compute the same attention;
    the compiled kernel evaluates it on the diagonal blocks only. A group's query heads share its selection
    (head h reads group h // (H / G)). The block tables are built on the device from the selection (no host
    read); one compilation per shape and dtype, reused as the densities move."""
    H, G = q_BHTK.shape[1], k_BGTK.shape[1]
    mask = flex_block_mask(sel, H, q_BHTK.shape[2])
    o_BHTK: torch.Tensor = _flex_attention(q_BHTK.device.type)(q_BHTK, k_BGTK, v_BGTK, block_mask=mask,
                                                               enable_gqa=H != G)
    return o_BHTK


def flex_block_mask(sel: BlockSelection, H: int, T: int) -> Any:
    """The FlexAttention `BlockMask` of a selection for H query heads over sequences of T (`flex_block_attention`).

    All four block tables are built here from one [B, G, N, N] grid of kept blocks, on the device in a fixed
    number of small operations (no host read): per query block, its diagonal block (the partial one) and its
    kept off-diagonal blocks in ascending order (full); per key block, the same transposed, which the backward
    kernels walk. (`BlockMask.from_kv_blocks` would derive the second pair itself, through batched vmaps that
    cost more than the attention at 4,096 tokens on an H200, docs/gpu.md.) A group's query heads share its
    tables (head h reads group h // (H / G))."""
    from torch.nn.attention.flex_attention import BlockMask

    B, G, _ = sel.index_BGM.shape
    b, dev = sel.block, sel.index_BGM.device
    N, hg = T // b, H // G
    diag_NN = _flex_layout(sel.counts, dev)[1]
    keep_BGNN = kept_grid(sel)
    off_BGNN = (keep_BGNN & ~_grid_masks(N, dev)[1]).to(torch.int32)

    def ordered(dense_BGNN: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row, how many blocks and which (ascending, the rest after them), at every query head."""
        idx = torch.argsort(dense_BGNN, dim=-1, descending=True, stable=True).to(torch.int32)
        num = dense_BGNN.sum(-1, dtype=torch.int32)
        return num.repeat_interleave(hg, dim=1), idx.repeat_interleave(hg, dim=1)

    def kept(b_: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return (q_idx >= kv_idx) & keep_BGNN[b_, h // hg, q_idx // b, kv_idx // b]

    ones_BHN = torch.ones(B, H, N, dtype=torch.int32, device=dev)
    diag_BHNN = diag_NN.expand(B, H, N, N).contiguous()
    full_kv_num, full_kv_idx = ordered(off_BGNN)
    full_q_num, full_q_idx = ordered(off_BGNN.transpose(-1, -2))
    try:
        return BlockMask(seq_lengths=(T, T), kv_num_blocks=ones_BHN, kv_indices=diag_BHNN,
                         full_kv_num_blocks=full_kv_num, full_kv_indices=full_kv_idx, q_num_blocks=ones_BHN,
                         q_indices=diag_BHNN, full_q_num_blocks=full_q_num, full_q_indices=full_q_idx,
                         BLOCK_SIZE=(b, b), mask_mod=kept)
    except TypeError:  # a torch whose BlockMask takes other arguments (checked on 2.11 and 2.13): torch derives
        # the key-block tables itself, the same tables at a higher cost
        return BlockMask.from_kv_blocks(ones_BHN, diag_BHNN, full_kv_num, full_kv_idx, BLOCK_SIZE=b, mask_mod=kept)


@functools.lru_cache(maxsize=64)
def _flex_layout(counts: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """What `kept_grid` and a flex block mask take from the counts alone (cached, like `_run_order`): each kept
    block's query block (`rows_M`, [M]) and the diagonal table (`diag_NN`, int32: block n's one partial block is
    n, first)."""
    N = len(counts)
    diag_NN = torch.zeros(N, N, dtype=torch.int32)
    diag_NN[:, 0] = torch.arange(N, dtype=torch.int32)
    rows_M = torch.repeat_interleave(torch.arange(N), torch.tensor(counts))
    return rows_M.to(device), diag_NN.to(device)


def trainable_paths(device: torch.device) -> tuple[str, ...]:
    """The paths that run forward and backward on `device`: "split" on a CPU with torch's CPU flash ops,
    "masked" anywhere, "flex" on CUDA (FlexAttention has no CPU backward)."""
    split = device.type == "cpu" and _FLASH is not None and _FLASH_BWD is not None
    return tuple(p for p in PATHS if (p != "split" or split) and (p != "flex" or device.type == "cuda"))


def default_path(device: torch.device, block: int = 128, group: int = 2) -> str:
    """"flex" on CUDA (FlexAttention; measured faster than "masked" and in less memory on an H200, docs/gpu.md).
    On a CPU "split" where torch has the CPU flash-attention ops and a group's folded query rows (`group` = H / G
    query heads per key/value head, times `block`) reach `SPLIT_MIN_ROWS`; "masked" anywhere else."""
    if device.type == "cuda":
        return "flex"
    if device.type != "cpu" or _FLASH is None or _FLASH_BWD is None:
        return "masked"
    return "split" if group * block >= SPLIT_MIN_ROWS else "masked"


def _fold_heads(t_BHTK: torch.Tensor, G: int, b: int) -> torch.Tensor:
    """[N B G, 1, (H / G) b, K]: block-major, a group's query heads folded into the query length (one copy),
    the layout of every split-path call's queries (and of the output gradient). One head per call entry: the
    flash op allocates its outputs and gradients as [batch, length, heads, K], so with one head they come back
    contiguous in this same order (no strided copies of the parts' results)."""
    B, H, T, K = t_BHTK.shape
    N, hg = T // b, H // G
    # contiguous: a no-op after the copy the reshape makes, a copy where it is a view (B = H = 1)
    return t_BHTK.reshape(B, G, hg, N, b, K).permute(3, 0, 1, 2, 4, 5).reshape(N * B * G, 1, hg * b, K).contiguous()


def _unfold_heads(t_Y1LK: torch.Tensor, B: int, G: int, hg: int) -> torch.Tensor:
    """[B, H, T, K] from the folded block-major layout of `_fold_heads` (one copy)."""
    Y, _, L, K = t_Y1LK.shape
    N, b = Y // (B * G), L // hg
    return t_Y1LK.view(N, B, G, hg, b, K).permute(1, 2, 3, 0, 4, 5).reshape(B, G * hg, N * b, K)


def _block_major(t_BGTK: torch.Tensor, b: int) -> torch.Tensor:
    """[N B G, 1, b, K]: each query block's diagonal key (or value) block, in the order of `_fold_heads`."""
    B, G, T, K = t_BGTK.shape
    return t_BGTK.reshape(B, G, T // b, b, K).permute(2, 0, 1, 3, 4).reshape(T // b * B * G, 1, b, K)


@functools.lru_cache(maxsize=16)
def _folded_causal_mask(hg: int, b: int, dtype: torch.dtype) -> torch.Tensor:
    """[hg b, b] additive mask: the causal triangle of a diagonal block, once per folded query head (cached: a
    function of the shape alone, built on the CPU, the only device the split path runs on)."""
    return _diag_masks(1, b, torch.empty(0, dtype=dtype)).repeat(hg, 1)


def _off_views(q_Y1LK: torch.Tensor, k_off: torch.Tensor, v_off: torch.Tensor, runs: list[tuple[int, int, int]],
               BG: int) -> list[tuple[slice, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per run with off-diagonal blocks (c > 1): (its entries of the folded layout, q, k, v) as views
    ([R B G, 1, (H / G) b, K] queries, [R B G, 1, (c - 1) b, K] keys and values, `BG` = B G): no mask, so a
    query row's head does not matter, and each gathered key block is read once per group."""
    L, K = q_Y1LK.shape[2:]
    b = k_off.shape[1] // K
    sizes = [r * (c - 1) * BG for _, r, c in runs]
    out = []
    for (n0, r, c), k_rows, v_rows in zip(runs, torch.split(k_off, sizes), torch.split(v_off, sizes)):
        if c > 1:
            s, kv_shape = slice(n0 * BG, (n0 + r) * BG), (r * BG, 1, (c - 1) * b, K)
            out.append((s, q_Y1LK[s], k_rows.view(kv_shape), v_rows.view(kv_shape)))
    return out


def _merge(o_Y1LK: torch.Tensor, lse_Y1L: torch.Tensor, o_off: list[torch.Tensor], lse_off: list[torch.Tensor],
           y1: int) -> None:
    """Merge the off-diagonal parts (entries y1 onwards, run after run) into the diagonal part, in place and in
    one pass (FlashAttention's rescaling): with d = lse_o - lse_d, o = o_d + sigmoid(d) (o_o - o_d) and
    lse = lse_d + softplus(d) (= logaddexp(lse_d, lse_o))."""
    o_d, lse_d = o_Y1LK[y1:], lse_Y1L[y1:]
    assert sum(o.shape[0] for o in o_off) == o_d.shape[0], "the runs with c > 1 are not the last query blocks"
    d_Y1L = torch.cat(lse_off) - lse_d  # lse: fp32 always
    o_d.lerp_(torch.cat(o_off), torch.sigmoid(d_Y1L).unsqueeze(-1).to(o_d.dtype))
    lse_d.add_(F.softplus(d_Y1L))


class _SplitBlocks(torch.autograd.Function):
    """The "split" path: each query block's attention in two parts, merged by their log-sum-exps. Every call's
    queries are block-major with a group's H / G query heads folded into the query length ([N B G, 1,
    (H / G) b, K], `_fold_heads`: one copy), so each key block is read once per group and the CPU flash kernel
    gets (H / G) b rows (64-row query chunks from 192 rows on).

    1. Diagonal part: every query block against its own key block, all N blocks in one call. With folded heads
       the causal triangle is an additive [(H / G) b, b] mask (the kernel's `is_causal` is top-left aligned,
       wrong past the first head); measured faster than an unfolded `is_causal` call of b-row queries (the
       kernel's 32-row chunks), see docs/dynamism.md. With H = G there is nothing to fold: `is_causal`.
    2. Off-diagonal part: per run, the query blocks against their c - 1 gathered earlier key blocks, no mask.
    3. Merge (`_merge`), in place on the diagonal part's output, all runs at once. Query blocks with c = 1 have
       the diagonal part alone (counts never decrease, so the others are the entries from the first run with
       c > 1 on).
    Backward (as ring attention does): given the FINAL output and log-sum-exp, each part's flash backward gives
    exactly its share of the gradients (its probabilities are exp(s - lse), and D = rowsum(dO o) is the whole
    row's), so dQ is the sum of the parts' and each key block's gradient comes from the part that read it."""

    @staticmethod
    def forward(ctx: Any, q_BHTK: torch.Tensor, k_BGTK: torch.Tensor, v_BGTK: torch.Tensor, rows: torch.Tensor,
                runs: list[tuple[int, int, int]], b: int) -> torch.Tensor:
        assert _FLASH is not None
        B, H, T, K = q_BHTK.shape
        G, N, scale = k_BGTK.shape[1], T // b, 1.0 / math.sqrt(K)
        mask = None if H == G else _folded_causal_mask(H // G, b, q_BHTK.dtype)
        q_Y1LK, kd_Y1bK, vd_Y1bK = _fold_heads(q_BHTK, G, b), _block_major(k_BGTK, b), _block_major(v_BGTK, b)
        o_Y1LK, lse_Y1L = _FLASH(q_Y1LK, kd_Y1bK, vd_Y1bK, 0.0, mask is None, attn_mask=mask, scale=scale)
        k_off = k_BGTK.reshape(B * G * N, b * K).index_select(0, rows)
        v_off = v_BGTK.reshape(B * G * N, b * K).index_select(0, rows)
        views = _off_views(q_Y1LK, k_off, v_off, runs, B * G)
        parts = [_FLASH(q_p, k_p, v_p, 0.0, False, scale=scale) for _, q_p, k_p, v_p in views]
        if parts:
            _merge(o_Y1LK, lse_Y1L, [o for o, _ in parts], [lse for _, lse in parts], views[0][0].start)
        ctx.save_for_backward(q_Y1LK, kd_Y1bK, vd_Y1bK, k_off, v_off, rows, o_Y1LK, lse_Y1L)
        ctx.runs, ctx.shape, ctx.mask = runs, (B, H, G, b), mask
        return _unfold_heads(o_Y1LK, B, G, H // G)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, do_BHTK: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        assert _FLASH_BWD is not None
        q_Y1LK, kd_Y1bK, vd_Y1bK, k_off, v_off, rows, o_Y1LK, lse_Y1L = ctx.saved_tensors
        B, H, G, b = ctx.shape
        scale = 1.0 / math.sqrt(q_Y1LK.shape[-1])
        do_Y1LK = _fold_heads(do_BHTK, G, b)
        dq_Y1LK, dkd_Y1bK, dvd_Y1bK = _FLASH_BWD(do_Y1LK, q_Y1LK, kd_Y1bK, vd_Y1bK, o_Y1LK, lse_Y1L, 0.0,
                                                 ctx.mask is None, attn_mask=ctx.mask, scale=scale)
        dk_parts, dv_parts = [], []
        for s, q_p, k_p, v_p in _off_views(q_Y1LK, k_off, v_off, ctx.runs, B * G):
            dq_p, dk_p, dv_p = _FLASH_BWD(do_Y1LK[s], q_p, k_p, v_p, o_Y1LK[s], lse_Y1L[s], 0.0, False,
                                          scale=scale)
            dq_Y1LK[s].add_(dq_p)
            dk_parts.append(dk_p.reshape(-1, k_off.shape[1]))  # contiguous: views, in the gathered order
            dv_parts.append(dv_p.reshape(-1, v_off.shape[1]))
        dk_BGTK, dv_BGTK = _diag_grad(dkd_Y1bK, B, G), _diag_grad(dvd_Y1bK, B, G)
        if dk_parts:  # the gathered blocks' gradients added at their rows (the gather's backward), all runs at once
            dk_BGTK.view(-1, k_off.shape[1]).index_add_(0, rows, torch.cat(dk_parts))
            dv_BGTK.view(-1, v_off.shape[1]).index_add_(0, rows, torch.cat(dv_parts))
        return _unfold_heads(dq_Y1LK, B, G, H // G), dk_BGTK, dv_BGTK, None, None, None


def _diag_grad(dd_Y1bK: torch.Tensor, B: int, G: int) -> torch.Tensor:
    """[B, G, T, K]: the diagonal part's key (or value) gradient back in sequence order, contiguous (one copy: with
    blocks of 1 the reshape alone may return a strided view, which the gathered blocks' `index_add_` cannot use
    flat)."""
    Y, _, b, K = dd_Y1bK.shape
    N = Y // (B * G)
    return dd_Y1bK.view(N, B, G, b, K).permute(1, 2, 0, 3, 4).reshape(B, G, N * b, K).contiguous()


def split_block_attention(q_BHTK: torch.Tensor, k_BGTK: torch.Tensor, v_BGTK: torch.Tensor,
                          sel: BlockSelection) -> torch.Tensor:
    """The "split" path (CPU, torch's CPU flash-attention ops; see `_SplitBlocks`): mask-free off-diagonal calls,
    one diagonal call under a small causal mask. Raises
    where the ops are missing or the tensors are not on a CPU (the "masked" path runs there)."""
    if _FLASH is None or _FLASH_BWD is None or q_BHTK.device.type != "cpu":
        raise RuntimeError(f"the split block-sparse attention path needs torch's CPU flash-attention ops on a CPU "
                           f"tensor (device {q_BHTK.device}, ops present: {_FLASH is not None}); use "
                           f"path='masked'")
    # the flash kernel reads rows of K contiguous values at any other strides (the diagonal keys and values are
    # views of the inputs where B G = 1): a tensor strided along K is copied once
    k_BGTK, v_BGTK = (t if t.stride(-1) == 1 else t.contiguous() for t in (k_BGTK, v_BGTK))
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

    `path`: "split" (parts merged by log-sum-exp, CPU only), "masked" (public SDPA with an additive mask on the
    diagonal block, any device) or "flex" (flex attention's block mask, CUDA's default); None takes `default_path`
    for q's device and shape. All compute the same attention (tested against each other and against
    `dense_block_attention`; flex where a CUDA device runs it: scripts/gpu_check.py)."""
    if path is None:
        path = default_path(q_BHTK.device, sel.block, q_BHTK.shape[1] // k_BGTK.shape[1])
    if path == "split":
        return split_block_attention(q_BHTK, k_BGTK, v_BGTK, sel)
    if path == "masked":
        return masked_block_attention(q_BHTK, k_BGTK, v_BGTK, sel)
    if path == "flex":
        return flex_block_attention(q_BHTK, k_BGTK, v_BGTK, sel)
    raise ValueError(f"block_sparse_attention: path must be one of {PATHS} or None; got {path!r}")


def kept_grid(sel: BlockSelection) -> torch.Tensor:
    """[B, G, N, N] bool: which (query block, key block) pairs the selection keeps, built on the device."""
    B, G, _ = sel.index_BGM.shape
    N, dev = len(sel.counts), sel.index_BGM.device
    rows_M = _flex_layout(sel.counts, dev)[0]
    keep_BGX = torch.zeros(B, G, N * N, dtype=torch.bool, device=dev)
    keep_BGX.scatter_(2, rows_M * N + sel.index_BGM, True)
    return keep_BGX.view(B, G, N, N)


def block_mask(sel: BlockSelection, T: int) -> torch.Tensor:
    """[B, G, T, T] bool: the token-level mask the selection means (kept blocks, causal inside the diagonal)."""
    b, dev = sel.block, sel.index_BGM.device
    m_BGTT = kept_grid(sel).repeat_interleave(b, dim=2).repeat_interleave(b, dim=3)
    return m_BGTT & torch.ones(T, T, dtype=torch.bool, device=dev).tril()


def dense_block_attention(q_BHTK: torch.Tensor, k_BGTK: torch.Tensor, v_BGTK: torch.Tensor,
                          sel: BlockSelection) -> torch.Tensor:
    """The reference: dense attention under `block_mask(sel)` (one masked SDPA over the whole sequence; a
    group's query heads share its mask)."""
    H, G, T = q_BHTK.shape[1], k_BGTK.shape[1], q_BHTK.shape[2]
    mask_BHTT = block_mask(sel, T).repeat_interleave(H // G, dim=1)
    return F.scaled_dot_product_attention(q_BHTK, k_BGTK, v_BGTK, attn_mask=mask_BHTT, enable_gqa=G != H)
