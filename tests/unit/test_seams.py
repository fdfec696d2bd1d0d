"""Typed seams: the MoE layer's dispatcher and the dynamism schemes' context name what they hold."""

from __future__ import annotations

import inspect
import typing

import torch

from moebal.distributed.expert_parallel import ExpertParallelDispatcher
from moebal.dynamism.scheme import SchemeContext
from moebal.models.moe import Dispatcher, LocalDispatcher, MoELayer


def test_both_dispatchers_take_the_protocols_arguments() -> None:
    want = list(inspect.signature(Dispatcher.forward).parameters)
    for cls in (LocalDispatcher, ExpertParallelDispatcher):
        assert list(inspect.signature(cls.forward).parameters) == want, cls


class _Zeros:
    """A dispatcher whose experts output nothing: the layer's output is then zero (no shared expert)."""

    def __init__(self) -> None:
        self.calls = 0

    def forward(self, x_TD: torch.Tensor, routing: object) -> torch.Tensor:
        self.calls += 1
        return torch.zeros_like(x_TD)


def test_the_layer_runs_whatever_dispatcher_it_is_given() -> None:
    torch.manual_seed(0)
    layer = MoELayer(dim=8, ffn_dim=16, num_experts=4, top_k=2)
    x = torch.randn(2, 3, 8)
    assert isinstance(layer.dispatcher, LocalDispatcher) and layer.is_local()
    assert layer(x).abs().sum() > 0
    zeros = _Zeros()
    layer.set_dispatcher(zeros)
    assert torch.equal(layer(x), torch.zeros_like(x)) and zeros.calls == 1 and not layer.is_local()


def test_scheme_context_has_no_untyped_field() -> None:
    hints = typing.get_type_hints(SchemeContext)
    assert "extra" not in hints
    assert all(tp is not typing.Any for tp in hints.values()), hints
