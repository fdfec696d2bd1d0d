"""Partition units: what the pipeline planner places on stages, whole decoder layers or their halves.

With `pipeline.split_layers: true`, each splittable layer becomes two units: its attention half (input norm,
attention, residual) and its FFN half (post-attention norm, FFN, residual). A stage boundary may then fall
inside such a layer: the first stage runs the attention half and sends the residual stream on, the next runs
the FFN half. Nothing else crosses the boundary, because the residual stream is the whole state between
the halves (`DecoderLayer.forward` is `ffn_part(attention_part(h))`, so the maths is the same op for op).

Why: a whole layer is a coarse unit when a stage holds only a few. In the Mixture-of-Depths benchmark a
dense layer at 512 tokens is a fifth of a stage and three quarters of it is attention. The best contiguous
partition of whole layers leaves max/mean stage load at 1.10; with halves it can go further
(docs/pipeline.md, "Partition units").

Which layers split is fixed for the run: a layer is splittable when it is dense (an MoE block stays whole:
its expert parallelism and placement planner work per layer) and the dynamism scheme says so
(`Dynamism.splittable`): its layer runs as the plain layer with no per-layer scheme state or statistics, or
the scheme changes only the layer's attention and runs that half itself (`Dynamism.attention_half`; dynamic
sparse attention), the FFN half staying plain. Everything the planner and the per-slot sums see (costs,
memory, migration moves, gradient-norm and data-parallel slots) is indexed by unit, the scheme's cost
prediction included (`Dynamism.unit_cost_factors`); what the schemes see stays indexed by layer.

Pure data; `UnitMap.whole(L)` is the identity (one unit per layer), the default.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["ATTN", "FFN", "LAYER", "UnitMap"]

LAYER, ATTN, FFN = "layer", "attn", "ffn"
"""Unit kinds: a whole layer, a layer's attention half, its FFN half."""


@dataclass(frozen=True)
class UnitMap:
    """The units of an L-layer model in model order: (layer, kind) per unit."""

    parts: tuple[tuple[int, str], ...]
    num_layers: int

    @classmethod
    def whole(cls, num_layers: int) -> UnitMap:
        return cls.build(num_layers, ())

    @classmethod
    def build(cls, num_layers: int, split: Iterable[int]) -> UnitMap:
        split = set(split)
        bad = sorted(i for i in split if not 0 <= i < num_layers)
        if bad:
            raise ValueError(f"layers {bad} to split are outside [0, {num_layers})")
        parts: list[tuple[int, str]] = []
        for i in range(num_layers):
            parts += [(i, ATTN), (i, FFN)] if i in split else [(i, LAYER)]
        return cls(tuple(parts), num_layers)

    @property
    def size(self) -> int:
        """U, the number of units (cost slots U and U + 1 are the embedding and the head)."""
        return len(self.parts)

    @property
    def split_layers(self) -> list[int]:
        return sorted({i for i, kind in self.parts if kind != LAYER})

    def layer(self, u: int) -> int:
        return self.parts[u][0]

    def kind(self, u: int) -> str:
        return self.parts[u][1]

    def units_of(self, i: int) -> list[int]:
        return [u for u, (j, _) in enumerate(self.parts) if j == i]

    def layers_of(self, units: Sequence[int]) -> list[int]:
        """The layers the units belong to, ascending, each once."""
        return sorted({self.parts[u][0] for u in units})

    def unit_sizes(self, layer_sizes: Sequence[int]) -> list[int]:
        """A partition of whole layers (layers per stage) as units per stage."""
        if sum(layer_sizes) != self.num_layers:
            raise ValueError(f"layer partition {list(layer_sizes)} does not cover {self.num_layers} layers")
        out, start = [], 0
        for n in layer_sizes:
            out.append(sum(len(self.units_of(i)) for i in range(start, start + n)))
            start += n
        return out

    def per_unit(self, per_layer: Sequence[float]) -> list[float]:
        """A per-layer quantity (a scheme's cost factor) for every unit: each half takes its layer's value."""
        return [per_layer[i] for i, _ in self.parts]

    def stage_layers(self, unit_sizes: Sequence[int]) -> list[float]:
        """Layers per stage for reports: a half counts 0.5."""
        out, start = [], 0
        for n in unit_sizes:
            out.append(sum(1.0 if k == LAYER else 0.5 for _, k in self.parts[start:start + n]))
            start += n
        return out
