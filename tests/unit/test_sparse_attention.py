"""Block-sparse causal attention against dense attention under the same block mask (forward and backward)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from moebal.kernels import sparse_attention as sa
from moebal.kernels.sparse_attention import (
    PATHS,
    block_mask,
    block_sparse_attention,
    default_path,
    dense_block_attention,
    kept_counts,
    kept_fraction,
    select_blocks,
)


def _qkv(B: int, H: int, G: int, T: int, K: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, n, T, K, generator=g, dtype=torch.float32).requires_grad_(True) for n in (H, G, G)]


def _out_and_grads(fn: Callable[..., torch.Tensor], qkv: list[torch.Tensor], sel: sa.BlockSelection,
                   g_out: torch.Tensor) -> list[torch.Tensor]:
    out = fn(*qkv, sel)
    return [out, *torch.autograd.grad(out, qkv, g_out)]


@pytest.mark.parametrize("path", sa.trainable_paths(torch.device("cpu")))
@pytest.mark.parametrize("density", [1.0, 0.6, 0.5, 0.25, 0.05])
@pytest.mark.parametrize("heads", [(4, 2), (2, 2), (4, 1)])
def test_parity_with_dense_under_same_mask(path: str, density: float, heads: tuple[int, int]) -> None:
    H, G = heads
    qkv = _qkv(2, H, G, 128, 16)
    sel = select_blocks(qkv[0], qkv[1], 16, density)
    g_out = torch.randn(2, H, 128, 16, generator=torch.Generator().manual_seed(1))
    got = _out_and_grads(lambda *a: block_sparse_attention(*a, path=path), qkv, sel, g_out)
    ref = _out_and_grads(dense_block_attention, qkv, sel, g_out)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("density", [1.0, 0.5, 0.1])
@pytest.mark.parametrize("heads", [(4, 2), (2, 2), (4, 1)])
def test_flex_path_forward_equals_dense_under_same_mask(density: float, heads: tuple[int, int]) -> None:
    """The flex path's block mask (full off-diagonal blocks, the diagonal partial) and its mask function give the
    dense reference's attention. On a CPU FlexAttention runs eager and forward only; `scripts/gpu_check.py`
    checks the compiled kernel's forward and backward on CUDA."""
    H, G = heads
    q, k, v = (t.detach() for t in _qkv(2, H, G, 128, 16, seed=2))
    sel = select_blocks(q, k, 16, density)
    got = block_sparse_attention(q, k, v, sel, path="flex")
    torch.testing.assert_close(got, dense_block_attention(q, k, v, sel), rtol=1e-5, atol=1e-5)


def test_flex_path_block_tables_hold_exactly_the_selection() -> None:
    """The block mask's tables: per (row, head, query block) one partial block, the diagonal, and the kept
    off-diagonal blocks as full blocks, ascending; a group's query heads share their group's tables; the key-block
    side (what the backward walks) is what torch derives from the query-block side."""
    from torch.nn.attention.flex_attention import BlockMask

    q, k, _ = (t.detach() for t in _qkv(2, 4, 2, 128, 8, seed=9))
    sel = select_blocks(q, k, 16, 0.4)
    mask = sa.flex_block_mask(sel, 4, 128)
    N = 8
    assert mask.kv_num_blocks.tolist() == [[[1] * N] * 4] * 2
    assert mask.kv_indices[..., 0].tolist() == [[list(range(N))] * 4] * 2
    assert mask.full_kv_num_blocks[0, 0].tolist() == [c - 1 for c in sel.counts]
    for b in range(2):
        for h in range(4):
            off = 0
            for n, c in enumerate(sel.counts):
                want = sel.index_BGM[b, h // 2, off:off + c].tolist()
                assert want[-1] == n  # the diagonal last
                assert mask.full_kv_indices[b, h, n, :c - 1].tolist() == want[:-1]
                off += c
    ref = BlockMask.from_kv_blocks(mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks,
                                   mask.full_kv_indices, BLOCK_SIZE=16)
    for num, idx in (("q_num_blocks", "q_indices"), ("full_q_num_blocks", "full_q_indices")):
        got_n, want_n = getattr(mask, num), getattr(ref, num)
        assert got_n.equal(want_n)
        for row in zip(*[t.reshape(-1, N).tolist() for t in (getattr(mask, idx), getattr(ref, idx))],
                       got_n.reshape(-1).tolist()):
            assert row[0][:row[2]] == row[1][:row[2]]


def test_flex_block_mask_falls_back_to_torchs_derivation_where_blockmask_takes_other_arguments(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch whose `BlockMask` constructor refuses the arguments the fast build passes: the mask comes from
    `BlockMask.from_kv_blocks` instead, with the same query-block tables and the same key-block tables."""
    from torch.nn.attention import flex_attention as fa

    class Older(fa.BlockMask):
        inside = False

        def __init__(self, *a: object, **kw: object) -> None:
            if not Older.inside:
                raise TypeError("__init__() got an unexpected keyword argument 'seq_lengths'")
            super().__init__(*a, **kw)  # type: ignore[arg-type]

        @classmethod
        def from_kv_blocks(cls, *a: object, **kw: object) -> fa.BlockMask:  # type: ignore[override]
            Older.inside = True
            try:
                return super().from_kv_blocks(*a, **kw)  # type: ignore[arg-type]
            finally:
                Older.inside = False

    q, k, _ = (t.detach() for t in _qkv(1, 4, 2, 128, 8, seed=4))
    sel = select_blocks(q, k, 16, 0.5)
    fast = sa.flex_block_mask(sel, 4, 128)
    monkeypatch.setattr(fa, "BlockMask", Older)
    slow = sa.flex_block_mask(sel, 4, 128)
    assert isinstance(slow, Older) and not isinstance(fast, Older)
    for num, idx in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices"),
                     ("q_num_blocks", "q_indices"), ("full_q_num_blocks", "full_q_indices")):
        n = getattr(fast, num)
        assert n.equal(getattr(slow, num)), num
        for a, b, c in zip(getattr(fast, idx).reshape(-1, 8).tolist(), getattr(slow, idx).reshape(-1, 8).tolist(),
                           n.reshape(-1).tolist()):
            assert a[:c] == b[:c], idx


@pytest.mark.parametrize("block,shared", [(16, True), (6, False)], ids=["aligned-views", "unaligned-per-run"])
def test_masked_path_masks_are_aligned_views_of_one_tensor_or_one_per_run(
        monkeypatch: pytest.MonkeyPatch, block: int, shared: bool) -> None:
    """The masks the masked path hands to SDPA: with blocks whose mask row fills whole 16-byte words (fp32:
    a multiple of 4), views of one tensor per call, each starting on a 16-byte boundary with a row stride of
    whole 16-byte words (what CUDA's efficient attention takes without a copy); otherwise a contiguous mask per
    run. Either way the attention equals the dense reference under the same block mask."""
    assert sa.shares_masks(block, 4) is shared
    masks: list[torch.Tensor] = []
    sdpa = F.scaled_dot_product_attention

    def spy(*args: object, **kw: object) -> torch.Tensor:
        if isinstance(kw.get("attn_mask"), torch.Tensor):
            masks.append(kw["attn_mask"])  # type: ignore[arg-type]
        return sdpa(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(sa.F, "scaled_dot_product_attention", spy)
    T = 16 * block
    qkv = _qkv(1, 4, 2, T, 8)
    sel = select_blocks(qkv[0], qkv[1], block, 0.9)
    g_out = torch.randn(1, 4, T, 8, generator=torch.Generator().manual_seed(1))
    got = _out_and_grads(lambda *a: sa.masked_block_attention(*a), qkv, sel, g_out)
    assert len(masks) >= 2  # several runs keep more than the diagonal block
    storages = {m.untyped_storage().data_ptr() for m in masks}
    if shared:
        assert len(storages) == 1
        for m in masks:
            assert m.stride(1) == 1 and (m.stride(0) * 4) % 16 == 0 and m.data_ptr() % 16 == 0
    else:
        assert len(storages) == len(masks) and all(m.is_contiguous() and m.storage_offset() == 0 for m in masks)
    monkeypatch.setattr(sa.F, "scaled_dot_product_attention", sdpa)
    ref = _out_and_grads(dense_block_attention, qkv, sel, g_out)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("density", [0.75, 0.5, 0.1])
def test_split_path_matches_masked_fallback(density: float) -> None:
    """The CPU split path (mask-free parts merged by log-sum-exp) and the masked path CUDA runs agree, forward
    and backward, on a non-contiguous value tensor (as the model's transposed projection gives) and a batch."""
    qkv = _qkv(3, 4, 2, 192, 8, seed=5)
    v = torch.randn(3, 192, 2, 8, generator=torch.Generator().manual_seed(6)).transpose(1, 2).requires_grad_(True)
    qkv[2] = v
    sel = select_blocks(qkv[0], qkv[1], 32, density)
    g_out = torch.randn(3, 4, 192, 8, generator=torch.Generator().manual_seed(7))
    split = _out_and_grads(sa.split_block_attention, qkv, sel, g_out)
    masked = _out_and_grads(sa.masked_block_attention, qkv, sel, g_out)
    for a, b in zip(split, masked):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("B, G, N", [(2, 2, 3), (1, 2, 4)])
def test_split_path_with_blocks_of_one_token(B: int, G: int, N: int) -> None:
    """Blocks of 1 with several query blocks keeping several key blocks: the diagonal gradient's reshape is then
    a strided view, which the backward must still add the gathered blocks' gradients into."""
    qkv = _qkv(B, 2 * G, G, N, 8, seed=3)
    sel = select_blocks(qkv[0], qkv[1], 1, 1.0)
    g_out = torch.randn(B, 2 * G, N, 8, generator=torch.Generator().manual_seed(4))
    split = _out_and_grads(lambda *a: block_sparse_attention(*a, path="split"), qkv, sel, g_out)
    ref = _out_and_grads(dense_block_attention, qkv, sel, g_out)
    for a, b in zip(split, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads", [(4, 2), (4, 1), (2, 2)])
def test_masked_path_with_expanded_keys_and_values_equals_grouped(heads: tuple[int, int]) -> None:
    """`expand_kv` (keys and values repeated to every query head in the masked calls, instead of `enable_gqa`)
    gives the grouped form's output and gradients; without groups it changes nothing."""
    H, G = heads
    qkv = _qkv(2, H, G, 192, 8, seed=3)
    sel = select_blocks(qkv[0], qkv[1], 32, 0.6)
    g_out = torch.randn(2, H, 192, 8, generator=torch.Generator().manual_seed(4))
    grouped = _out_and_grads(sa.masked_block_attention, qkv, sel, g_out)
    expanded = _out_and_grads(lambda *a: sa.masked_block_attention(*a, expand_kv=True), qkv, sel, g_out)
    for a, b in zip(expanded, grouped):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_path_choice_and_its_errors() -> None:
    assert default_path(torch.device("cpu"), 128, 2) == "split"  # torch 2.13 has the CPU flash ops
    assert default_path(torch.device("cpu"), 64, 2) == "masked"  # 128 folded rows: the kernel's 32-row chunks
    assert default_path(torch.device("cuda"), 128, 2) == "flex"
    assert default_path(torch.device("meta"), 128, 2) == "masked"
    assert sa.trainable_paths(torch.device("cpu")) == ("split", "masked")
    assert sa.trainable_paths(torch.device("cuda")) == ("masked", "flex")
    qkv = _qkv(1, 2, 2, 32, 4)
    sel = select_blocks(qkv[0], qkv[1], 16, 0.5)
    with pytest.raises(ValueError, match="path must be one of"):
        block_sparse_attention(*qkv, sel, path="flash")
    meta = [t.detach().to("meta") for t in qkv]
    with pytest.raises(RuntimeError, match="use path='masked'"):
        sa.split_block_attention(*meta, sel)


def test_split_path_falls_back_where_the_private_ops_are_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch without the CPU flash ops: the default is the masked path, which still matches dense."""
    monkeypatch.setattr(sa, "_FLASH", None)
    assert default_path(torch.device("cpu"), 256, 4) == "masked"
    qkv = _qkv(1, 4, 2, 64, 8)
    sel = select_blocks(qkv[0], qkv[1], 16, 0.5)
    torch.testing.assert_close(block_sparse_attention(*qkv, sel), dense_block_attention(*qkv, sel),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="ops present: False"):
        sa.split_block_attention(*qkv, sel)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("path", PATHS)
def test_full_density_is_causal_attention(path: str) -> None:
    q, k, v = (t.detach() for t in _qkv(1, 4, 2, 64, 8))  # no gradients: FlexAttention has no CPU backward
    sel = select_blocks(q, k, 16, 1.0)
    dense = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(block_sparse_attention(q, k, v, sel, path=path), dense, rtol=1e-5, atol=1e-5)
    assert block_mask(sel, 64).all(dim=(0, 1)).equal(torch.ones(64, 64, dtype=torch.bool).tril())


def test_selection_keeps_diagonal_top_scores_and_counts() -> None:
    q, k, _ = _qkv(1, 2, 1, 96, 8, seed=3)
    sel = select_blocks(q, k, 16, 0.5)
    assert list(sel.counts) == kept_counts(6, 0.5) == [1, 1, 2, 2, 2, 3]
    # the causal pooled query: the mean of the 16 queries ending at each block's first row (zeros before row 0)
    qm = F.pad(q.detach(), (0, 0, 15, 0))[:, :, :96].reshape(1, 1, 2, 6, 16, 8).mean(dim=(2, 4))
    km = k.detach().view(1, 1, 6, 16, 8).mean(3)
    s = (qm @ km.transpose(-1, -2))[0, 0]
    pos = 0
    for n, c in enumerate(sel.counts):
        kept = sel.index_BGM[0, 0, pos:pos + c].tolist()
        pos += c
        assert kept[-1] == n and all(j < n for j in kept[:-1])  # diagonal last, causal
        others = sorted(range(n), key=lambda j: -float(s[n, j]))[:c - 1]
        assert sorted(kept[:-1]) == sorted(others)
    assert kept_fraction(96, 16, 0.5) == pytest.approx(11 / 21)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_split_path_in_half_precision(dtype: torch.dtype) -> None:
    """bf16/fp16 inputs: the split path (its diagonal mask in the inputs' dtype, fp32 log-sum-exps) stays within
    half-precision rounding of the fp32 dense reference, forward and backward, and returns the inputs' dtype."""
    qkv = _qkv(2, 4, 2, 128, 16, seed=9)
    sel = select_blocks(qkv[0], qkv[1], 32, 0.5)
    g_out = torch.randn(2, 4, 128, 16, generator=torch.Generator().manual_seed(2))
    low = [t.detach().to(dtype).requires_grad_(True) for t in qkv]
    got = _out_and_grads(sa.split_block_attention, low, sel, g_out.to(dtype))
    ref = _out_and_grads(dense_block_attention, qkv, sel, g_out)
    assert all(t.dtype == dtype for t in got)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a.float(), b, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("v_layout", ["transposed", "strided_along_K"])
def test_split_path_single_group_views(v_layout: str) -> None:
    """One row and one key/value head: the split path's diagonal keys and values are views of the inputs (no
    copy), read at their strides; a value tensor strided along K is copied first. Equal to dense, fwd and bwd."""
    qkv = _qkv(1, 4, 1, 96, 8, seed=11)
    g = torch.Generator().manual_seed(12)
    if v_layout == "transposed":  # [B, T, G, K] projection output seen as [B, G, T, K]
        v = torch.randn(1, 96, 1, 8, generator=g).transpose(1, 2)
    else:
        v = torch.randn(1, 1, 8, 96, generator=g).transpose(2, 3)
    qkv[2] = v.requires_grad_(True)
    sel = select_blocks(qkv[0], qkv[1], 32, 0.5)
    g_out = torch.randn(1, 4, 96, 8, generator=g)
    got = _out_and_grads(sa.split_block_attention, qkv, sel, g_out)
    ref = _out_and_grads(dense_block_attention, qkv, sel, g_out)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
