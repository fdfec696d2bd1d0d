"""One pipeline stage: a contiguous, ordered range of the decoder's layers, sliced from the single-device model.

Shape legend: B = micro-batch rows, T = sequence, D = model dim, V = vocabulary.

Parameter names are the full model's (`model.layers.5.self_attn.q_proj.weight`, `model.embed_tokens.weight`,
`lm_head.weight`): layers sit in a ModuleDict keyed by their global index, so a stage's state dict is a slice
of the model's, a checkpoint loads under any partition, and a migrated layer keeps its name. The embedding
is pinned to the first stage and the final norm and LM head to the last (DynMo's repository pins them too;
their cost counts toward those stages in the planner). With `model.tie_embeddings` the last stage's head holds
a copy of the embedding that follows it (`tied.py`).

Layers are always held and run in ascending global index: migration inserts a received layer at its place
in that order, never appends it (the DynMo prototype appends, which reorders the network).

What a stage holds is a contiguous range of partition units (`units.py`): whole layers, or with
`pipeline.split_layers` also a layer's attention or FFN half. A half-held layer is the layer's module with
the other half's submodules set to None, so names stay the model's and its state dict is the half's slice.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from moebal.config import Config
from moebal.models.moe import MoELayer
from moebal.models.transformer import DecoderLayer, MoebalForCausalLM, rotary_for
from moebal.pipeline.units import ATTN, FFN, LAYER, UnitMap

__all__ = ["PipelineStage", "build_layer_skeleton", "half_modules", "held_halves", "keep_half", "merge_half",
           "same_halves"]

_HALF = {ATTN: ("input_layernorm", "self_attn"), FFN: ("post_attention_layernorm", "mlp")}
"""The submodules of each half of a dense decoder layer."""


class _Body(nn.Module):
    """Mirrors the model's `model.` prefix: embed_tokens (first stage), layers, norm (last stage)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens: nn.Embedding | None = None
        self.layers = nn.ModuleDict()
        self.norm: nn.Module | None = None


class PipelineStage(nn.Module):
    """Layers [start, end) of a causal LM, plus the embedding on the first stage and the head on the last."""

    def __init__(self, cfg: Config, layers: Mapping[int, nn.Module], first: bool, last: bool,
                 embed: nn.Embedding | None = None, norm: nn.Module | None = None,
                 lm_head: nn.Linear | None = None, units: UnitMap | None = None,
                 unit_ids: list[int] | None = None) -> None:
        """`units`: the run's partition units (default: whole layers); `unit_ids`: the units held here (default:
        every unit of `layers`)."""
        super().__init__()
        self.units = units or UnitMap.whole(cfg.model.n_layers)
        self._unit_ids = sorted(unit_ids if unit_ids is not None else
                                [u for i in layers for u in self.units.units_of(i)])
        self.cfg, self.first, self.last = cfg, first, last
        self.model = _Body()
        self.model.embed_tokens = embed if first else None
        self.model.norm = norm if last else None
        self.lm_head = lm_head if last else None
        self.rotary = rotary_for(cfg)
        self._set_layers(layers)

    @classmethod
    def from_model(cls, model: MoebalForCausalLM, start: int, end: int, first: bool, last: bool,
                   units: UnitMap | None = None) -> PipelineStage:
        """Slice units [start, end) (layers, under the default whole-layer units) out of a full model: shared
        modules, no copy; a layer held by one half loses the other half's submodules (the model is a
        throw-away copy per rank)."""
        units = units or UnitMap.whole(model.config.model.n_layers)
        held = list(range(start, end))
        layers = {}
        for i in units.layers_of(held):
            layer = model.model.layers[i]
            kinds = [units.kind(u) for u in units.units_of(i) if u in held]
            if LAYER not in kinds and len(kinds) == 1:
                keep_half(layer, kinds[0])
            layers[i] = layer
        return cls(model.config, layers, first, last, model.model.embed_tokens, model.model.norm, model.lm_head,
                   units, held)

    # ---- the layer set ----
    def _set_layers(self, layers: Mapping[int, nn.Module]) -> None:
        self.model.layers = nn.ModuleDict({str(i): layers[i] for i in sorted(layers)})

    @property
    def layer_ids(self) -> list[int]:
        """The layers held here, wholly or by one half, ascending."""
        return [int(k) for k in self.model.layers]

    @property
    def unit_ids(self) -> list[int]:
        """The partition units held here, ascending (the layer ids under whole-layer units)."""
        return list(self._unit_ids)

    def layer(self, i: int) -> DecoderLayer:
        """Layer i (whole, or the half held here)."""
        # the ModuleDict holds DecoderLayers (whole or half-held), typed as plain modules
        return cast(DecoderLayer, self.model.layers[str(i)])

    def unit_module(self, u: int) -> nn.Module:
        """What unit u runs: its layer, or the half's submodules."""
        i, kind = self.units.parts[u]
        return self.layer(i) if kind == LAYER else half_modules(self.layer(i), kind)

    def add_layer(self, i: int, layer: nn.Module) -> None:
        """Hold the whole layer i (every unit of it)."""
        for u in self.units.units_of(i):
            self.add_unit(u, layer)

    def remove_layer(self, i: int) -> nn.Module:
        """Stop holding layer i (every unit of it held here); returns its module."""
        layer = self.layer(i)
        for u in self.units.units_of(i):
            if u in self._unit_ids:
                self.remove_unit(u)
        return layer

    def add_unit(self, u: int, layer: nn.Module) -> None:
        """Hold unit u, carried by `layer` (a whole or half-held layer module); a half joins the other half
        when this stage holds that already."""
        i, kind = self.units.parts[u]
        layers = {int(k): v for k, v in self.model.layers.items()}
        if i in layers and layers[i] is not layer:
            assert kind != LAYER, f"layer {i} is held here already"
            merge_half(layers[i], layer, kind)
        else:
            layers[i] = layer
        self._set_layers(layers)
        self._unit_ids = sorted(set(self._unit_ids) | {u})

    def remove_unit(self, u: int) -> None:
        """Stop holding unit u: drop its layer, or strip the half off when the layer's other half stays."""
        i, kind = self.units.parts[u]
        self._unit_ids = [v for v in self._unit_ids if v != u]
        if any(self.units.layer(v) == i for v in self._unit_ids):
            keep_half(self.layer(i), FFN if kind == ATTN else ATTN)
            return
        layers = {int(k): v for k, v in self.model.layers.items()}
        layers.pop(i)
        self._set_layers(layers)

    def check_contiguous(self) -> None:
        ids = self._unit_ids
        assert ids == list(range(ids[0], ids[0] + len(ids))), f"stage units are not contiguous: {ids}"

    def num_layers_slot(self) -> int:
        """Index of the embedding's cost slot (the head's is this + 1): the number of units (of layers, under
        whole-layer units)."""
        return self.units.size

    def slot_modules(self) -> dict[int, nn.Module]:
        """Cost/bucket slots this stage holds: its units, then U (embedding) and U + 1 (norm and head)."""
        U = self.units.size
        out: dict[int, nn.Module] = {}
        if self.model.embed_tokens is not None:
            out[U] = self.model.embed_tokens
        out.update({u: self.unit_module(u) for u in self._unit_ids})
        if self.model.norm is not None:
            assert self.lm_head is not None  # the last stage holds both
            out[U + 1] = nn.ModuleList([self.model.norm, self.lm_head])
        return out

    @property
    def holds_tied_copy(self) -> bool:
        """Whether the LM head's weight is a copy of the embedding (`model.tie_embeddings` on a last stage without
        the embedding, or on a fully sharded one-stage pipeline: `tied.py`)."""
        embed = self.model.embed_tokens
        return (self.cfg.model.tie_embeddings and self.lm_head is not None
                and (embed is None or self.lm_head.weight is not embed.weight))

    @property
    def checkpoint_links(self) -> dict[str, str]:
        """Names a checkpoint keeps as another's (`moebal.train.checkpoint`): a last stage's tied head copy is
        kept as the first stage's embedding, one tensor, as the single-process tied model keeps it."""
        return {"lm_head.weight": "model.embed_tokens.weight"} if self.holds_tied_copy else {}

    @property
    def tied_head(self) -> torch.Tensor | None:
        """The LM head's weight when it is the embedding's (`model.tie_embeddings`; on a stage without the
        embedding, the copy that follows it: `tied.py`), else None."""
        return self.lm_head.weight if self.lm_head is not None and self.cfg.model.tie_embeddings else None

    def moe_layers(self) -> list[MoELayer]:
        """The MoE layers held here, in layer order."""
        return [layer.block_sparse_moe for layer in map(self.layer, self.layer_ids) if layer.is_moe]

    # ---- compute pieces (the engine runs them; dynamism schemes wrap the layer step) ----
    def embed(self, ids_BT: torch.Tensor) -> torch.Tensor:
        assert self.model.embed_tokens is not None
        h_BTD: torch.Tensor = self.model.embed_tokens(ids_BT)
        return h_BTD

    def rope(self, T: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        cos_sin: tuple[torch.Tensor, torch.Tensor] = self.rotary(T, dtype)
        return cos_sin

    def head_loss_sum(self, h_BTD: torch.Tensor, labels_BT: torch.Tensor) -> torch.Tensor:
        """Sum of next-token cross-entropy over labels != -100 (the engine divides by the batch's count)."""
        assert self.lm_head is not None and self.model.norm is not None
        logits_BTV = self.lm_head(self.model.norm(h_BTD))
        return F.cross_entropy(logits_BTV.float().flatten(0, 1), labels_BT.flatten(), ignore_index=-100,
                               reduction="sum")


def build_layer_skeleton(cfg: Config, i: int, device: torch.device | str) -> DecoderLayer:
    """An uninitialised DecoderLayer i on `device`, built without touching any random generator (a received
    layer's values come from the sender; consuming RNG here would change later random draws)."""
    with torch.device("meta"):
        layer = DecoderLayer(cfg, i)
    return layer.to_empty(device=device)


def keep_half(layer: nn.Module, kind: str) -> None:
    """Strip a dense layer down to its `kind` half (the other half's submodules become None)."""
    other = FFN if kind == ATTN else ATTN
    assert not getattr(layer, "is_moe", False), "an MoE layer is never split"
    for name in _HALF[other]:
        setattr(layer, name, None)


def half_modules(layer: nn.Module, kind: str) -> nn.ModuleList:
    """The submodules of a layer's `kind` half (shared, not copied)."""
    return nn.ModuleList([getattr(layer, name) for name in _HALF[kind]])


def merge_half(into: nn.Module, src: nn.Module, kind: str) -> None:
    """Give `into` the `kind` half of `src` (the same module objects)."""
    for name in _HALF[kind]:
        setattr(into, name, getattr(src, name))


def held_halves(layer: nn.Module) -> list[nn.Module]:
    """The submodules of a split layer's halves that it holds, in run order: what the engine calls
    (`attention_part`, `ffn_part` call them), never the layer itself."""
    return [m for kind in (ATTN, FFN) for name in _HALF[kind] if (m := getattr(layer, name)) is not None]


def same_halves(layer: nn.Module, like: nn.Module) -> None:
    """Strip from `layer` the halves' submodules that `like` does not hold (no-op for a whole layer)."""
    for kind in (ATTN, FFN):
        for name in _HALF[kind]:
            if getattr(like, name, None) is None and getattr(layer, name, None) is not None:
                setattr(layer, name, None)
