"""Deferred weight gradients (the zero-bubble schedule's W): bit-identical to autograd's, and only when run."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moebal.pipeline.zero_bubble import WeightGradQueue


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.a = nn.Linear(8, 12, bias=True)
        self.b = nn.Linear(12, 8, bias=False)
        self.norm = nn.LayerNorm(12)
        self.frozen = nn.Linear(8, 8, bias=False)
        self.frozen.weight.requires_grad_(False)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.b(torch.relu(self.norm(self.a(x))))
        return self.frozen(h) + h


def _grads(net: Net) -> dict[str, torch.Tensor | None]:
    return {n: (p.grad.clone() if p.grad is not None else None) for n, p in net.named_parameters()}


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("shape", [(5, 8), (2, 7, 8)])
def test_deferred_weight_gradients_equal_autograds_bit_for_bit(bf16, shape):
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(shape, generator=g, requires_grad=True) for _ in range(3)]  # three micro-batches
    gys = [torch.randn(shape, generator=g) for _ in range(3)]
    ref, net = Net(), Net()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        outs = [ref(x) for x in xs]
    for y, gy in zip(outs, gys):
        y.backward(gy)
    ref_x = [x.grad.clone() for x in xs]
    for x in xs:
        x.grad = None

    q = WeightGradQueue()
    with q.installed(net):
        outs = []
        for j, x in enumerate(xs):
            with q.capture(j), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                outs.append(net(x))
        for y, gy in zip(outs, gys):
            y.backward(gy)
        # after B: input gradients and the norm's are there, the Linear weights' wait for W
        assert all(torch.equal(x.grad, r) for x, r in zip(xs, ref_x))
        assert net.norm.weight.grad is not None and net.a.weight.grad is None and net.b.weight.grad is None
        assert q.pending() == 2 * 3  # a and b per micro-batch; the frozen Linear defers nothing
        for j in range(3):
            for _slot, fn in q.pop(j):
                fn()
    assert "forward" not in net.a.__dict__  # uninstalled
    got, want = _grads(net), _grads(ref)
    assert got.keys() == want.keys()
    for name in want:
        if want[name] is None:
            assert got[name] is None, name
        else:
            assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name


def test_outside_a_capture_or_without_grad_the_linear_is_plain():
    net, q = Net(), WeightGradQueue()
    x = torch.randn(3, 8, requires_grad=True)
    with q.installed(net):
        net(x).sum().backward()  # no capture: autograd as usual
        assert net.a.weight.grad is not None and q.pending() == 0
        with q.capture(0), torch.no_grad():
            net(x)
        assert q.pending() == 0


def test_a_replaced_forward_is_left_alone():
    net, q = Net(), WeightGradQueue()
    replacement = lambda x: x[..., :8] * 2.0  # noqa: E731 (e.g. a pruned layer's own kernel)
    net.b.forward = replacement
    with q.installed(net):
        with q.capture(0):
            y = net(torch.randn(2, 8, requires_grad=True))
        y.sum().backward()
        assert [slot for slot, _ in q.pop(0)] == [-1]  # only `a` deferred (slot: none set)
    assert net.b.forward is replacement  # kept through and after the block


@pytest.mark.parametrize("bf16", [False, True])
def test_run_micro_batches_leave_no_graph_behind(bf16):
    # Each deferred Linear's node once held its micro-batch's closure list, and a closure held its input with
    # that input's grad_fn: a cycle through C++ graph nodes that the collector cannot free. A benchmark rank
    # grew to 6 GB in 45 steps before the fix.
    import gc

    net, q = Net(), WeightGradQueue()

    def nodes() -> int:
        gc.collect()
        return sum(type(o).__name__ == "_DeferredLinearBackward" for o in gc.get_objects())

    def iteration() -> None:
        with q.installed(net), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            outs = []
            for j in range(3):
                with q.capture(j):
                    outs.append(net(torch.randn(4, 8, requires_grad=True)))
            for y in outs:
                y.float().sum().backward()
            outs.clear()
            for j in range(3):
                for _, fn in q.pop(j):
                    fn()

    iteration()
    before = nodes()
    for _ in range(3):
        iteration()
    assert nodes() == before == 0
