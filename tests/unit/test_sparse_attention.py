"""Block-sparse causal attention against dense attention under the same block mask (forward and backward)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moebal.kernels.sparse_attention import (
    block_mask,
    block_sparse_attention,
    dense_block_attention,
    kept_counts,
    kept_fraction,
    select_blocks,
)


def _qkv(B: int, H: int, G: int, T: int, K: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, n, T, K, generator=g, dtype=torch.float32).requires_grad_(True) for n in (H, G, G)]


@pytest.mark.parametrize("density", [1.0, 0.6, 0.5, 0.25, 0.05])
@pytest.mark.parametrize("heads", [(4, 2), (2, 2)])
def test_parity_with_dense_under_same_mask(density: float, heads: tuple[int, int]) -> None:
    H, G = heads
    q, k, v = _qkv(2, H, G, 128, 16)
    sel = select_blocks(q, k, 16, density)
    g_out = torch.randn(2, H, 128, 16, generator=torch.Generator().manual_seed(1))
    out = block_sparse_attention(q, k, v, sel)
    grads = torch.autograd.grad(out, (q, k, v), g_out)
    ref = dense_block_attention(q, k, v, sel)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g_out)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_full_density_is_causal_attention() -> None:
    q, k, v = _qkv(1, 4, 2, 64, 8)
    sel = select_blocks(q, k, 16, 1.0)
    dense = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(block_sparse_attention(q, k, v, sel), dense, rtol=1e-5, atol=1e-5)
    assert block_mask(sel, 64).all(dim=(0, 1)).equal(torch.ones(64, 64, dtype=torch.bool).tril())


def test_selection_keeps_diagonal_top_scores_and_counts() -> None:
    q, k, _ = _qkv(1, 2, 1, 96, 8, seed=3)
    sel = select_blocks(q, k, 16, 0.5)
    assert list(sel.counts) == kept_counts(6, 0.5) == [1, 1, 2, 2, 2, 3]
    qm = q.detach().view(1, 1, 2, 6, 16, 8).mean(dim=(2, 4))
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
