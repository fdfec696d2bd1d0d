"""Router randomness keyed by where it is drawn: (seed, step, micro-batch, layer), not by the draws before it.

Switch jitter and noisy top-k gating (`MoELayer.router_logits`) draw random numbers while training. From the
process's global generator, a layer's draws would depend on how many numbers the layers before it on the same
rank drew first: moving a layer to another pipeline stage (a migration, a re-pack) would give it another rank's
stream and change the losses. Inside `step_key` (the trainer, around each step) and `micro_batch_key` (each
micro-batch's forward: the local step's accumulation loop, a pipeline stage's forward op) a MoE layer draws from
a generator seeded by (train.seed, step, micro-batch, its model-wide layer index) instead, so its noise is the
same whichever rank holds it, and a draw has no side effect on any other (a plan-ahead estimate or a replay may
draw again and gets the same numbers). Every rank of a step draws the same numbers for the same layer and
micro-batch, as every rank seeded the global generator alike did before.

A recomputed region's replay (moebal/models/recompute.py) runs under the key its forward ran under
(`current_key` captured, `keyed` restored): the backward of micro-batch j comes while another micro-batch's key
is set. Outside a key (a layer called on its own, a test, start-up calibration) the global generator is used.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["current_key", "generator", "keyed", "micro_batch_key", "step_key"]

_MASK = (1 << 64) - 1
_step: tuple[int, int] | None = None
_key: tuple[int, int, int] | None = None


@contextmanager
def step_key(seed: int, step: int) -> Iterator[None]:
    """Training step `step` of a run seeded `seed` (the trainer enters it around each step)."""
    global _step
    before, _step = _step, (seed, step)
    try:
        yield
    finally:
        _step = before


@contextmanager
def micro_batch_key(j: int) -> Iterator[None]:
    """Micro-batch `j` of the step (0 when the step is one forward); no key outside `step_key`."""
    with keyed(None if _step is None else (*_step, j)):
        yield


@contextmanager
def keyed(key: tuple[int, int, int] | None) -> Iterator[None]:
    """Draws under `key` inside (a replay restores its forward's `current_key`)."""
    global _key
    before, _key = _key, key
    try:
        yield
    finally:
        _key = before


def current_key() -> tuple[int, int, int] | None:
    return _key


def generator(device: torch.device, layer: int) -> torch.Generator | None:
    """A generator for layer `layer`'s draws under the current key (seeded afresh: the same numbers on every
    call), or None outside a key (draw from the global generator)."""
    if _key is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(mixed_seed(*_key, layer))
    return g


def mixed_seed(*parts: int) -> int:
    """A non-negative 63-bit seed mixing `parts` (splitmix64 over each in turn): every part changes all its bits."""
    h = 0
    for x in parts:
        h = _splitmix64((h ^ x) & _MASK)
    return h >> 1


def _splitmix64(x: int) -> int:
    """One step of splitmix64 (Steele et al. 2014): a full-avalanche 64-bit mix of the key's parts."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)
