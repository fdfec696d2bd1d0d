"""One pipeline stage: a contiguous, ordered range of the decoder's layers, sliced from the single-device model.

Shape legend: B = micro-batch rows, T = sequence, D = model dim, V = vocabulary.

Parameter names are the full model's (`model.layers.5.self_attn.q_proj.weight`, `model.embed_tokens.weight`,
`lm_head.weight`): layers sit in a ModuleDict keyed by their global index, so a stage's state dict is a slice
of the model's, a checkpoint loads under any partition, and a migrated layer keeps its name. The embedding
is pinned to the first stage and the final norm and LM head to the last (DynMo's repository pins them too;
their cost counts toward those stages in the planner).

Layers are always held and run in ascending global index: migration inserts a received layer at its place
in that order, never appends it (the DynMo prototype appends, which reorders the network).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moebal.config import Config
from moebal.models.transformer import DecoderLayer, MoebalForCausalLM, Rotary

__all__ = ["PipelineStage", "build_layer_skeleton"]


class _Body(nn.Module):
    """Mirrors the model's `model.` prefix: embed_tokens (first stage), layers, norm (last stage)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens: nn.Embedding | None = None
        self.layers = nn.ModuleDict()
        self.norm: nn.Module | None = None


class PipelineStage(nn.Module):
    """Layers [start, end) of a causal LM, plus the embedding on the first stage and the head on the last."""

    def __init__(self, cfg: Config, layers: dict[int, DecoderLayer], first: bool, last: bool,
                 embed: nn.Embedding | None = None, norm: nn.Module | None = None,
                 lm_head: nn.Linear | None = None) -> None:
        super().__init__()
        self.cfg, self.first, self.last = cfg, first, last
        self.model = _Body()
        self.model.embed_tokens = embed if first else None
        self.model.norm = norm if last else None
        self.lm_head = lm_head if last else None
        m = cfg.model
        self.rotary = Rotary(cfg.head_dim, m.max_seq_len, m.rope_theta)
        self._set_layers(layers)

    @classmethod
    def from_model(cls, model: MoebalForCausalLM, start: int, end: int, first: bool, last: bool) -> PipelineStage:
        """Slice layers [start, end) (shared modules, no copy) out of a full model."""
        if model.config.model.tie_embeddings and not (first and last):
            from moebal.errors import ConfigError

            raise ConfigError("pipeline parallelism needs model.tie_embeddings=false: the embedding lives on the "
                              "first stage and the LM head on the last, and a tied copy would need its gradient "
                              "summed across the two stages, which moebal does not do")
        layers = {i: model.model.layers[i] for i in range(start, end)}
        return cls(model.config, layers, first, last, model.model.embed_tokens, model.model.norm, model.lm_head)

    # ---- the layer set ----
    def _set_layers(self, layers: dict[int, nn.Module]) -> None:
        self.model.layers = nn.ModuleDict({str(i): layers[i] for i in sorted(layers)})

    @property
    def layer_ids(self) -> list[int]:
        return [int(k) for k in self.model.layers]

    def layer(self, i: int) -> nn.Module:
        return self.model.layers[str(i)]

    def add_layer(self, i: int, layer: nn.Module) -> None:
        layers = {int(k): v for k, v in self.model.layers.items()}
        layers[i] = layer
        self._set_layers(layers)

    def remove_layer(self, i: int) -> nn.Module:
        layers = {int(k): v for k, v in self.model.layers.items()}
        layer = layers.pop(i)
        self._set_layers(layers)
        return layer

    def check_contiguous(self) -> None:
        ids = self.layer_ids
        assert ids == list(range(ids[0], ids[0] + len(ids))), f"stage layers are not contiguous: {ids}"

    def num_layers_slot(self) -> int:
        """Index of the embedding's cost slot (the head's is this + 1): the model's layer count."""
        return self.cfg.model.n_layers

    def slot_modules(self) -> dict[int, nn.Module]:
        """Cost/bucket slots this stage holds: its layers, then L (embedding) and L + 1 (norm and head)."""
        L = self.cfg.model.n_layers
        out: dict[int, nn.Module] = {}
        if self.model.embed_tokens is not None:
            out[L] = self.model.embed_tokens
        out.update({i: self.layer(i) for i in self.layer_ids})
        if self.model.norm is not None:
            out[L + 1] = nn.ModuleList([self.model.norm, self.lm_head])
        return out

    def moe_layers(self) -> list[nn.Module]:
        return [layer.block_sparse_moe for layer in self.model.layers.values() if layer.is_moe]

    def pinned_modules(self) -> dict[str, nn.Module]:
        """The embedding / final norm / head this stage holds (they never migrate)."""
        out: dict[str, nn.Module] = {}
        if self.model.embed_tokens is not None:
            out["embed"] = self.model.embed_tokens
        if self.model.norm is not None:
            out["head"] = nn.ModuleList([self.model.norm, self.lm_head])
        return out

    # ---- compute pieces (the engine runs them; dynamism schemes wrap the layer step) ----
    def embed(self, ids_BT: torch.Tensor) -> torch.Tensor:
        assert self.model.embed_tokens is not None
        return self.model.embed_tokens(ids_BT)

    def rope(self, T: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary(T, dtype)

    def head_loss_sum(self, h_BTD: torch.Tensor, labels_BT: torch.Tensor) -> torch.Tensor:
        """Sum of next-token cross-entropy over labels != -100 (the engine divides by the batch's count)."""
        assert self.lm_head is not None and self.model.norm is not None
        logits_BTV = self.lm_head(self.model.norm(h_BTD))
        return F.cross_entropy(logits_BTV.float().flatten(0, 1), labels_BT.flatten(), ignore_index=-100,
                               reduction="sum")

    def moe_aux(self) -> torch.Tensor | None:
        """Sum of the last forward's auxiliary losses of this stage's MoE layers (None without MoE layers)."""
        aux = [layer.block_sparse_moe.aux_loss for layer in self.model.layers.values() if layer.is_moe]
        return torch.stack([a.float() for a in aux]).sum() if aux else None


def build_layer_skeleton(cfg: Config, i: int, device: torch.device | str) -> DecoderLayer:
    """An uninitialised DecoderLayer i on `device`, built without touching any random generator (a received
    layer's values come from the sender; consuming RNG here would change later random draws)."""
    with torch.device("meta"):
        layer = DecoderLayer(cfg, i)
    return layer.to_empty(device=device)
