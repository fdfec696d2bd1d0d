"""Host syncs: the one helper every intentional read of a device value goes through, and an audit that counts.

On a GPU every read of a device tensor's value on the host (`.item()`, `.tolist()`, `int(t)`, `bool(t)`, a
pageable upload) blocks the CPU until the GPU has caught up, so the CPU can no longer queue work ahead of it
and communication can no longer overlap compute. moebal's MoE path therefore reads device values at a few
named points only, each through `to_host(t, why)`:

- per MoE layer forward under expert parallelism: one, the count matrix of the uneven all-to-all (the split
  sizes must be Python ints for `all_to_all_single`; inherent to dropless expert parallelism);
- per MoE layer forward on one device: none with `grouped_mm` (offsets stay on the device); the CPU `loop`
  kernel reads its per-expert row counts (one; free on a CPU);
- per step: the routing statistics, read once by the trainer.

A tensor already on the host is read with `host_values` (no sync, not counted). Host data goes to the device
with `upload` (pinned memory, non-blocking on CUDA: no sync), and per-expert
counts are made with `count_ids` (a scatter-add; `torch.bincount` on CUDA reads the input's maximum back).

`SyncAudit` counts the syncs of a block of code: the ones made through `to_host`, by reason, and every other
Python-level read of a tensor's value (`.item()`, `.tolist()`, `.numpy()`, `int()`, `float()`, `bool()`,
`__index__`, `nonzero`) or write of host data into one (`t[i] = 3`, `torch.tensor(x, device=d)`) as
`unaccounted`, with the file and line that made it. A test runs an MoE layer's
forward and backward inside an audit and fails when a sync appears that is not in the budget. On CPU this
sees what Python code reads; syncs inside C++ operators (a CUDA `bincount`, boolean-mask indexing) are only
visible on a GPU, where `scripts/gpu_check.py` counts them with `torch.cuda.set_sync_debug_mode`.
"""

from __future__ import annotations

import collections
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["SyncAudit", "count_ids", "host_values", "to_host", "upload"]

_audits: list[SyncAudit] = []
_lock = threading.Lock()
_inside = threading.local()


def to_host(t: torch.Tensor, why: str) -> Any:
    """`t.tolist()`: one intentional host sync, counted under `why` by any active `SyncAudit`."""
    for a in _audits:
        a._count(why)
    _inside.active = True
    try:
        return t.tolist()
    finally:
        _inside.active = False


def host_values(t: torch.Tensor) -> Any:
    """`t.tolist()` of a tensor already on the host: no device is involved, so it is no sync and no audit counts
    it. A device tensor is refused (read it with `to_host`, which names the sync)."""
    if t.device.type != "cpu":
        raise ValueError(f"host_values reads host tensors; this one is on {t.device}: use to_host(t, why)")
    _inside.active = True
    try:
        return t.tolist()
    finally:
        _inside.active = False


def upload(data: Any, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Host data (a list, a NumPy array) as a tensor on `device` without a host sync: on CUDA through pinned
    memory with a non-blocking copy (the caching host allocator keeps the pinned block until the copy is done),
    elsewhere a plain tensor."""
    t = torch.as_tensor(data, dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def count_ids(ids: torch.Tensor, n: int, weights: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [n]: how often each id in [0, n) occurs in `ids` (weighted by `weights` if given): `bincount`
    without its host read of the maximum on CUDA."""
    ones = torch.ones_like(ids, dtype=torch.int64) if weights is None else weights.to(torch.int64)
    return torch.zeros(n, dtype=torch.int64, device=ids.device).scatter_add_(0, ids.reshape(-1), ones.reshape(-1))


# ---- the audit ---------------------------------------------------------------------------------------------

_READS = ("item", "tolist", "numpy", "nonzero", "__int__", "__float__", "__bool__", "__index__")


class SyncAudit:
    """Counts host syncs made by the thread that entered it (see the module docstring)."""

    def __init__(self) -> None:
        self.counted: collections.Counter[str] = collections.Counter()
        self.unaccounted: list[str] = []
        self._thread = threading.get_ident()

    @property
    def syncs(self) -> int:
        """Every host sync seen: through `to_host` and not."""
        return sum(self.counted.values()) + len(self.unaccounted)

    def _count(self, why: str) -> None:
        if threading.get_ident() == self._thread:
            self.counted[why] += 1

    def _raw(self, name: str, depth: int = 2) -> None:
        if threading.get_ident() != self._thread or getattr(_inside, "active", False):
            return
        f = sys._getframe(depth)
        self.unaccounted.append(f"Tensor.{name} at {f.f_code.co_filename}:{f.f_lineno} ({f.f_code.co_name})")

    def reset(self) -> None:
        self.counted.clear()
        self.unaccounted.clear()

    def __repr__(self) -> str:
        return f"SyncAudit(counted={dict(self.counted)}, unaccounted={self.unaccounted})"


_originals: dict[tuple[Any, str], Any] = {}


def _patch() -> None:
    for name in _READS:
        orig = getattr(torch.Tensor, name)
        _originals[(torch.Tensor, name)] = orig

        def wrapper(self: torch.Tensor, *args: Any, _orig: Any = orig, _name: str = name, **kw: Any) -> Any:
            for a in _audits:
                a._raw(_name)
            return _orig(self, *args, **kw)

        setattr(torch.Tensor, name, wrapper)
    # Writes that are host-to-device copies on CUDA: a Python number stored into a tensor (`t[i] = 3`), and a
    # tensor built from host data straight on a device (`torch.tensor(x, device=d)`; `upload` is the sync-free way)
    setitem = torch.Tensor.__setitem__
    _originals[(torch.Tensor, "__setitem__")] = setitem

    def set_item(self: torch.Tensor, index: Any, value: Any) -> Any:
        if isinstance(value, (int, float, bool)):
            for a in _audits:
                a._raw("__setitem__ of a Python number")
        return setitem(self, index, value)

    # the audit patches torch itself (undone by its exit); a typed wrapper of the overloaded original is not worth it
    torch.Tensor.__setitem__ = set_item  # type: ignore[method-assign, assignment]
    for fn_name in ("tensor", "as_tensor"):
        fn = getattr(torch, fn_name)
        _originals[(torch, fn_name)] = fn

        def build(*args: Any, _fn: Any = fn, _name: str = fn_name, **kw: Any) -> Any:
            if kw.get("device") is not None:
                for a in _audits:
                    a._raw(f"{_name}(..., device=...)")
            return _fn(*args, **kw)

        setattr(torch, fn_name, build)


def _unpatch() -> None:
    for (owner, name), orig in _originals.items():
        setattr(owner, name, orig)
    _originals.clear()


@contextmanager
def audit() -> Iterator[SyncAudit]:
    """A `SyncAudit` active for the block (tests and `scripts/gpu_check.py`; never used in training)."""
    a = SyncAudit()
    with _lock:
        if not _audits:
            _patch()
        _audits.append(a)
    try:
        yield a
    finally:
        with _lock:
            _audits.remove(a)
            if not _audits:
                _unpatch()


def budget_report(a: SyncAudit, budget: int, where: str) -> Sequence[str]:
    """Problems with an audit against a budget of `budget` counted syncs (empty: within budget)."""
    out = [f"{where}: unaccounted host sync {u}" for u in a.unaccounted]
    n = sum(a.counted.values())
    if n > budget:
        out.append(f"{where}: {n} host syncs ({dict(a.counted)}), budget {budget}")
    return out
