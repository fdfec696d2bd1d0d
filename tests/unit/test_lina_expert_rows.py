"""The expert loop of Lina's inference scheduling (`expert_rows`): running an expert's rows in blocks (the CPU
default, CPU_BLOCK_ROWS) gives the same bits as one GEMM per projection, whatever the group sizes, so the
blocks change the time of a large group and nothing else; a block under MIN_ROWS is refused; a small group is
padded to MIN_ROWS rows unless told not to."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from moebal.distributed.lina_inference import CPU_BLOCK_ROWS, MIN_ROWS, expert_rows


def _experts(E: int, D: int, Fw: int, dtype: torch.dtype) -> SimpleNamespace:
    g = torch.Generator().manual_seed(0)
    w = lambda *shape: (torch.randn(*shape, generator=g) / shape[-1] ** 0.5).to(dtype)  # noqa: E731
    return SimpleNamespace(w1=w(E, Fw, D), w3=w(E, Fw, D), w2=w(E, D, Fw))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_blocks_give_the_bits_of_whole_groups(dtype: torch.dtype) -> None:
    # two source ranks, an expert's group summed over both: 700 = 5 x 128 + 60 rows run as 5 parts of 140, 320 =
    # 2 x 128 + 64 as 2 of 160, 75 and 131 as one each, 6 padded to MIN_ROWS
    recv_SE = np.array([[300, 5, 130, 0, 3], [400, 70, 1, 2 * CPU_BLOCK_ROWS + MIN_ROWS, 3]])
    ex = _experts(5, 32, 160, dtype)
    x = torch.randn(int(recv_SE.sum()), 32, generator=torch.Generator().manual_seed(1)).to(dtype)
    whole = expert_rows(ex, x, recv_SE, block=0)
    blocked = expert_rows(ex, x, recv_SE, block=CPU_BLOCK_ROWS)
    assert torch.equal(whole, blocked)
    # and both are each row's SwiGLU through its expert
    expert_of_row = np.repeat(np.tile(np.arange(5), 2), recv_SE.reshape(-1))
    for e in range(5):
        rows = torch.as_tensor(np.flatnonzero(expert_of_row == e))
        xe = x[rows].float()
        ref = (F.silu(xe @ ex.w1[e].float().T) * (xe @ ex.w3[e].float().T)) @ ex.w2[e].float().T
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(blocked[rows].float(), ref, atol=tol, rtol=tol)


def test_a_block_under_min_rows_is_refused() -> None:
    ex = _experts(2, 8, 16, torch.float32)
    with pytest.raises(ValueError, match="MIN_ROWS"):
        expert_rows(ex, torch.zeros(4, 8), np.array([[2, 2]]), block=MIN_ROWS - 1)


def _swiglu(x: torch.Tensor, ex: SimpleNamespace, e: int) -> torch.Tensor:
    return (F.silu(x @ ex.w1[e].T) * (x @ ex.w3[e].T)) @ ex.w2[e].T


def test_a_small_group_is_one_min_rows_gemm_padded_and_its_own_size_unpadded() -> None:
    """`pad` (the default) computes a group under MIN_ROWS as the first rows of a MIN_ROWS-row product; `pad=False`
    (a layer every policy computes alike: `LinaDispatcher._unsplittable`) as a product of its own rows. Both bit for
    bit; a group of MIN_ROWS rows or more is the same either way."""
    recv_SE = np.array([[1, 3, 0, 40], [2, 0, 7, 30]])  # groups of 3, 3, 7 and 70 rows
    ex = _experts(4, 16, 48, torch.float32)
    x = torch.randn(int(recv_SE.sum()), 16, generator=torch.Generator().manual_seed(2))
    padded, unpadded = expert_rows(ex, x, recv_SE), expert_rows(ex, x, recv_SE, pad=False)
    expert_of_row = np.repeat(np.tile(np.arange(4), 2), recv_SE.reshape(-1))
    for e in range(4):
        rows = torch.as_tensor(np.flatnonzero(expert_of_row == e))
        xe, n = x[rows], len(rows)
        if n < MIN_ROWS:
            assert torch.equal(padded[rows], _swiglu(torch.cat([xe, xe.new_zeros(MIN_ROWS - n, 16)]), ex, e)[:n])
            assert torch.equal(unpadded[rows], _swiglu(xe, ex, e))
        else:
            assert torch.equal(padded[rows], unpadded[rows]) and torch.equal(unpadded[rows], _swiglu(xe, ex, e))
