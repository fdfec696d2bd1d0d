"""Mixture-of-Depths (Raposo et al. 2024): a routed block processes only the top-capacity share of tokens.

Shape legend: B = rows, T = sequence, D = model dim, C = tokens a routed block keeps per row.

A routed layer gets a router, a bias-free Linear(D, 1) attached to the layer (`layer.mod_router`) before the
model is sliced, so it trains, migrates and checkpoints with its layer (initialised from its own seeded
generator: the model's random stream is untouched). Per row, the C = round(capacity x T) tokens with the
highest router scores run the whole block (attention among the selected tokens only, in their original
causal order, and the FFN); the others pass through unchanged. A selected token's output is
h + sigmoid(score) x (block(h) - h): the router weight puts the router on the gradient path (Raposo multiply
by the raw score; the sigmoid keeps the scale bounded). Selection is expert-choice top-k over the sequence,
as in training in the paper; equal scores go to the earlier position (a stable sort, here and in
`padded_selection`), so a row keeps the same tokens padded or not and on any device.

The causal predictor (`predictor` > 0: its hidden width). Top-k over the row needs the row's later tokens, which
sampling does not have. Raposo et al. (section 3.5) train "a small auxiliary MLP predictor (akin to a second
router) that receives the same inputs as the router (with a stop gradient)" and predicts whether the token is
among the top-k; DynMo gives every MoD block one "so that routing is causal" (its Appendix F.7). Here each routed
layer gets `layer.mod_predictor`, Linear(D, P), SiLU, Linear(P, 1), attached like the router (it trains,
migrates and checkpoints with the layer; drawn from the scheme's generator after every router, so the routers'
initial weights do not depend on it). At each routed forward in training it reads the detached input and its
binary cross-entropy against the selection (1 for the tokens the row keeps; a padded row's real tokens only), the
kept tokens weighted by (1 - c) / c with c the batch's kept share so that both classes weigh the same (unweighted,
the predictors of a default run fell to "skip" for every token within 9 steps at capacity 0.125: accuracy 1 - c,
recall 0), joins the backward through `_AuxGrad`, weighted as the MoE auxiliary losses (`Dynamism.aux_weight`: the
micro-batch's share of the step over the ranks that sum their gradients, so its gradient is one mean over the
batch however the step is split): it adds a gradient to the predictor's parameters only, so every other
gradient is that of a run without it, bit for bit, and so are the losses without gradient clipping; with
clipping (`train.grad_clip`) its gradient joins the global norm like any parameter's (tested both ways). The
reported loss is the language model's; `metrics()` gives each routed layer's predictor accuracy, recall (of the
kept tokens, the share it picks) and precision (of those it picks, the share kept) at its last training
forward. Training keeps routing by top-k (Raposo's rule; DynMo does not say): the predictor is what
generation routes by (`causal_routing`), a token running the block where its predictor's logit is positive.

A padded row (planned micro-batching: the carry's `ROW_TOKENS`) keeps the share of its real tokens, chosen among
them; padding fills the slots the longest row needs beyond it (`padded_selection`).

Which layers route: every `every`-th from `first_layer` (Raposo route every other block). The capacity
sets in from 1.0 (a dense model: the plain layer runs and the router is idle) at `start`, linearly to
`capacity` over `ramp_steps`: continual training of a dense model into an MoD one, as DynMo runs it.

Cost prediction for a routed layer at capacity c: (q_o + kv + ffn) x c + attn x c^2 (the attention core is
quadratic in the tokens kept), over the same sum at c = 1.

Precision of the routed block (`subset_precision`): under bf16 autocast on a CPU, torch's bf16 kernels for
the routed block's small shapes are slower than fp32 ones (measured here, 1 thread, dim 128, a 256-token row:
the routed block at 32 tokens takes 3.2 ms fwd+bwd in bf16 against 1.6 ms in fp32, at 128 tokens 5.3 against
4.6 ms; the weight-gradient GEMMs with 32-row reductions run at 70-75 us each in bf16 against 15-20 us forward,
and the flash-attention backward 330 us against 60 us), while the dense layer at 256 tokens is faster in bf16
(5.2 against 6.6 ms). So by default ("auto") a routed block that keeps at most half the row computes in fp32
on a CPU (a choice by device and shape, not by timing: reproducible; fp32 is the more precise of the two),
and under the run's autocast elsewhere. "autocast" keeps the run's precision, "fp32" always uses fp32.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from moebal.dynamism.scheme import (
    Dynamism,
    as_decoder,
    check_steps,
    layer_token_flops,
    ramp,
    register,
    row_tokens,
    run_as_forward,
)
from moebal.errors import ConfigError
from moebal.models.subset import skip_layer, subset_block
from moebal.sync import host_values, upload

if TYPE_CHECKING:
    from moebal.models.transformer import MoebalForCausalLM

__all__ = ["MixtureOfDepths", "padded_selection", "predictor_targets"]


class _AuxGrad(torch.autograd.Function):
    """h unchanged; `loss` (a scalar) receives gradient `weight` in the backward that reaches h: an auxiliary loss
    trained by the stage's own backward, wherever the layer runs (a pipeline stage, recomputation). The weight is
    the forward's (kept in ctx), so a recomputation's replay does not read another micro-batch's."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, loss: torch.Tensor, weight: float) -> torch.Tensor:
        ctx.loss_meta = (loss.dtype, loss.device, weight)
        return h.view_as(h)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        dtype, device, weight = ctx.loss_meta
        return g, torch.full((), weight, dtype=dtype, device=device), None


def predictor_targets(pos_BC: torch.Tensor, T: int, n_B: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(target_BT: 1.0 at the routed positions, the real-token mask_BT the predictor's loss counts): a padded
    row's padding slots are neither targets nor counted."""
    B = pos_BC.shape[0]
    target_BT = torch.zeros(B, T, device=pos_BC.device).scatter_(1, pos_BC, 1.0)
    if n_B is None:
        return target_BT, torch.ones(B, T, dtype=torch.bool, device=pos_BC.device)
    real_BT = torch.arange(T, device=pos_BC.device)[None, :] < upload(host_values(n_B), pos_BC.device)[:, None]
    return target_BT * real_BT, real_BT


def padded_selection(score_BT: torch.Tensor, c: float, n_B: torch.Tensor) -> torch.Tensor:
    """pos_BQ, ascending per row: the routed positions of right-padded rows holding n_B (host int64) real tokens.

    Row b keeps its C_b = max(1, round(c x n_b)) real tokens of highest score: the share of the row's real tokens,
    what the row would keep unpadded, so padding never takes a real token's place. Every row has Q = max C_b
    slots (one shape, the cheap all-valid path of `subset_block`, no host sync): a row with C_b < Q fills the
    rest with its first padding positions, which come after all its real ones, so causal attention keeps them
    from every real token and their outputs are never read (label -100). There are always enough: a rounding
    moves a value by at most 1/2, so the integer Q - C_b is at most c x (n_max - n_b) + 1, below
    n_max - n_b + 1 for c < 1: Q - C_b <= n_max - n_b <= T - n_b (the clamp to 1 only shrinks it).
    """
    B, T = score_BT.shape
    n = host_values(n_B)  # the plan's numbers
    keep = [max(1, round(c * k)) for k in n]
    Q = max(keep)
    assert all(Q - k <= T - m for k, m in zip(keep, n)), "MoD: a padded row has too few padding slots"
    dev = score_BT.device
    n_B1, keep_B1 = upload(n, dev).unsqueeze(1), upload(keep, dev).unsqueeze(1)
    pos_BT = torch.arange(T, device=dev).expand(B, T)
    real_BT = pos_BT < n_B1
    # each real token's rank by score within its row (padding ranks last; a stable sort breaks ties by position)
    order_BT = torch.sort(score_BT.masked_fill(~real_BT, float("-inf")), dim=1, descending=True, stable=True).indices
    rank_BT = torch.empty_like(order_BT).scatter_(1, order_BT, pos_BT)
    chosen_BT = (real_BT & (rank_BT < keep_B1)) | (~real_BT & (pos_BT - n_B1 < Q - keep_B1))
    # a stable sort of (not chosen) puts the Q chosen positions first, ascending
    return torch.sort((~chosen_BT).to(torch.int8), dim=1, stable=True).indices[:, :Q]


@register("mod")
class MixtureOfDepths(Dynamism):
    name = "mod"
    changes_outputs = True

    def __init__(self, cfg: Any, capacity: float = 0.125, every: int = 2, first_layer: int = 1, start: int = 0,
                 ramp_steps: int = 0, seed: int = 0, subset_precision: str = "auto", predictor: int = 0) -> None:
        L = cfg.model.n_layers
        if subset_precision not in ("auto", "autocast", "fp32"):
            raise ConfigError(f"dynamism mod: subset_precision must be auto, autocast or fp32; "
                              f"got {subset_precision!r}")
        if subset_precision == "fp32" and getattr(getattr(cfg, "parallel", None), "param_dtype", "fp32") != "fp32":
            raise ConfigError("dynamism mod: subset_precision fp32 computes the routed block in fp32, and "
                              f"parallel.param_dtype {cfg.parallel.param_dtype} keeps the weights in that dtype: set "
                              "dynamism.mod.subset_precision to auto or autocast, or parallel.param_dtype to fp32")
        self.subset_precision = subset_precision
        if predictor < 0:
            raise ConfigError(f"dynamism mod: predictor is the causal predictor's hidden width (0: none); got "
                              f"{predictor}")
        self.predictor = int(predictor)
        self.causal = False  # route by the predictors (`causal_routing`), not by top-k over the row
        self.accuracy: dict[int, torch.Tensor] = {}  # routed layer -> its predictor's last accuracy, recall, precision
        if not 0 < capacity <= 1:
            raise ConfigError(f"dynamism mod: capacity is the share of tokens a routed block keeps, in (0, 1]; "
                              f"got {capacity}")
        if every < 1 or not 0 <= first_layer < L:
            raise ConfigError(f"dynamism mod: every ({every}) must be >= 1 and first_layer ({first_layer}) in "
                              f"[0, {L - 1}]")
        self.cfg, self.L = cfg, L
        check_steps("mod", start=start, ramp_steps=ramp_steps)
        self.capacity, self.start, self.ramp_steps, self.seed = float(capacity), int(start), int(ramp_steps), seed
        self.routed = set(range(first_layer, L, every))
        self.flops = [layer_token_flops(cfg, i, cfg.data.seq_len) for i in range(L)]

    def current_capacity(self, step: int | None = None) -> float:
        return ramp(self.step if step is None else step, self.start, self.ramp_steps, 1.0, self.capacity)

    def prepare_model(self, model: MoebalForCausalLM) -> None:
        g = torch.Generator().manual_seed(self.seed)
        std = self.cfg.model.init_std
        for i in sorted(self.routed):
            layer = model.model.layers[i]
            with torch.device("meta"):  # nn.Linear's own init would draw from the global generator
                router = nn.Linear(self.cfg.model.dim, 1, bias=False)
            router = router.to_empty(device="cpu")
            with torch.no_grad():
                router.weight.copy_(torch.randn(router.weight.shape, generator=g) * std)
            layer.mod_router = router.to(next(layer.parameters()).device)
        for i in sorted(self.routed) if self.predictor else ():  # after every router: theirs stay as without
            layer = model.model.layers[i]
            predictor = self._predictor("cpu")
            with torch.no_grad():
                for p in predictor.parameters():
                    p.copy_(torch.randn(p.shape, generator=g) * std if p.dim() > 1 else torch.zeros(p.shape))
            layer.mod_predictor = predictor.to(next(layer.parameters()).device)

    def prepare_layer(self, i: int, layer: nn.Module) -> None:
        if i in self.routed:
            device = next(layer.parameters()).device
            with torch.device("meta"):
                router = nn.Linear(self.cfg.model.dim, 1, bias=False)
            layer.mod_router = router.to_empty(device=device)
            if self.predictor:
                layer.mod_predictor = self._predictor(device)

    def _predictor(self, device: torch.device | str) -> nn.Module:
        """An uninitialised predictor (module docstring) on `device`."""
        with torch.device("meta"):
            mlp = nn.Sequential(nn.Linear(self.cfg.model.dim, self.predictor), nn.SiLU(), nn.Linear(self.predictor, 1))
        return mlp.to_empty(device=device)

    def idle_parameters(self) -> bool:
        return self.start > 0 or self.capacity >= 1.0  # the routers idle while the capacity is 1

    def splittable(self, i: int) -> bool:
        """A routed block stays whole (its selection spans both halves); the other layers run plain."""
        return i not in self.routed

    def layer_forward(self, i: int, layer: nn.Module, h_BTD: torch.Tensor, cos_TK: torch.Tensor,
                      sin_TK: torch.Tensor, carry: dict[str, torch.Tensor]) -> torch.Tensor:
        c = self.current_capacity()
        if i not in self.routed or c >= 1.0:
            out_BTD: torch.Tensor = layer(h_BTD, cos_TK, sin_TK)
            return out_BTD
        n_B = row_tokens(carry)
        return run_as_forward(layer, lambda h, cos, sin: self._routed(layer, h, cos, sin, c, n_B), h_BTD, cos_TK,
                              sin_TK)

    def _routed(self, layer: nn.Module, h_BTD: torch.Tensor, cos_TK: torch.Tensor, sin_TK: torch.Tensor,
                c: float, n_B: torch.Tensor | None = None) -> torch.Tensor:
        """The routed block at capacity c < 1: the router's top-C tokens of each row run the block (of a padded
        row's real tokens, `n_B`: see `padded_selection`)."""
        B, T, _ = h_BTD.shape
        score_BT = layer.get_submodule("mod_router")(h_BTD).squeeze(-1)
        if self.causal:
            return self._causal(layer, h_BTD, cos_TK, sin_TK, score_BT)
        if n_B is None:
            C = max(1, round(c * T))
            # ties go to the earlier position, as in `padded_selection` (topk's order among ties is unspecified:
            # equal scores, e.g. a row's repeated first tokens in a small model, made a row's result differ padded)
            pos_BC = torch.sort(score_BT, dim=1, descending=True, stable=True).indices[:, :C].sort(dim=1).values
        else:
            pos_BC = padded_selection(score_BT, c, n_B)
            C = pos_BC.shape[1]
        weight_BC = torch.sigmoid(score_BT.gather(1, pos_BC))
        if self._fp32_subset(layer, h_BTD.device, C, T):
            with torch.autocast(h_BTD.device.type, enabled=False):
                out_BTD = subset_block(as_decoder(layer), h_BTD.float(), cos_TK.float(), sin_TK.float(), pos_BC,
                                       None, keys="subset", scale_BQ=weight_BC.float()).to(h_BTD.dtype)
        else:
            out_BTD = subset_block(as_decoder(layer), h_BTD, cos_TK, sin_TK, pos_BC, None, keys="subset",
                                   scale_BQ=weight_BC)
        if self.predictor and torch.is_grad_enabled():
            out_BTD = self._train_predictor(layer, h_BTD, out_BTD, pos_BC, n_B)
        return out_BTD

    def _train_predictor(self, layer: nn.Module, h_BTD: torch.Tensor, out_BTD: torch.Tensor, pos_BC: torch.Tensor,
                         n_B: torch.Tensor | None) -> torch.Tensor:
        """`out_BTD` carrying the predictor's loss into the backward (module docstring)."""
        logit_BT = layer.get_submodule("mod_predictor")(h_BTD.detach()).squeeze(-1).float()
        target_BT, real_BT = predictor_targets(pos_BC, h_BTD.shape[1], n_B)
        kept = target_BT[real_BT]
        share = kept.mean().clamp(1e-6, 1 - 1e-6)  # the capacity, as this batch's rows kept it
        loss = F.binary_cross_entropy_with_logits(logit_BT[real_BT], kept, pos_weight=(1 - share) / share)
        with torch.no_grad():
            said_BT, kept_BT = (logit_BT > 0) & real_BT, (target_BT > 0) & real_BT
            self.accuracy[as_decoder(layer).index] = torch.stack([
                (said_BT == kept_BT)[real_BT].float().mean(),  # accuracy over the real tokens
                (said_BT & kept_BT).sum() / kept_BT.sum().clamp(min=1),  # recall: of the kept, predicted
                (said_BT & kept_BT).sum() / said_BT.sum().clamp(min=1)])  # precision: of the predicted, kept
        tied: torch.Tensor = _AuxGrad.apply(out_BTD, loss, self.aux_weight)  # Function.apply is typed Any
        return tied

    def _causal(self, layer: nn.Module, h_BTD: torch.Tensor, cos_TK: torch.Tensor, sin_TK: torch.Tensor,
                score_BT: torch.Tensor) -> torch.Tensor:
        """The routed block under `causal_routing`: the tokens whose predictor's logit is positive run it, each
        row its own count (padded slots invalid), at their router weights."""
        run_BT = self.predicts(layer, h_BTD)
        Q = int(run_BT.sum(dim=1).max())  # (a host read: the rows' widths)
        if Q == 0:  # an expert-parallel MoE layer still joins the other ranks' exchanges
            return skip_layer(as_decoder(layer), h_BTD)
        # the running positions first, ascending (a stable sort of "does not run"), then the rest as padding
        pos_BQ = torch.sort((~run_BT).to(torch.int8), dim=1, stable=True).indices[:, :Q]
        valid_BQ = run_BT.gather(1, pos_BQ)
        weight_BQ = torch.sigmoid(score_BT.gather(1, pos_BQ))
        return subset_block(as_decoder(layer), h_BTD, cos_TK, sin_TK, pos_BQ, valid_BQ, keys="subset",
                            scale_BQ=weight_BQ)

    def predicts(self, layer: nn.Module, h_BTD: torch.Tensor) -> torch.Tensor:
        """bool [B, T]: the tokens routed layer `layer`'s predictor sends through the block."""
        if not self.predictor:
            raise ValueError("this Mixture-of-Depths run has no causal predictor (dynamism.mod.predictor 0)")
        logit_BT: torch.Tensor = layer.get_submodule("mod_predictor")(h_BTD).squeeze(-1)
        return logit_BT > 0

    def served_as(self) -> str:
        c = self.current_capacity()
        if c >= 1.0:
            return "Mixture-of-Depths at capacity 1: every layer runs every token"
        if self.causal:
            return ("Mixture-of-Depths: the routed layers run the tokens their causal predictors pick (at "
                    f"capacity {c:g} in training)")
        return (f"Mixture-of-Depths: the routed layers run their routers' top {c:g} of each row's tokens (the "
                f"selection spans the row, as in training: teacher-forced)")

    def _fp32_subset(self, layer: nn.Module, device: torch.device, kept: int, T: int) -> bool:
        """Whether the routed block leaves the run's autocast for fp32 (see the module docstring). Never with bf16
        weights (`parallel.param_dtype: bf16`): outside autocast they would meet fp32 activations."""
        if not torch.is_autocast_enabled(device.type) or self.subset_precision == "autocast":
            return False
        if layer.get_parameter("self_attn.q_proj.weight").dtype != torch.float32:
            return False
        return self.subset_precision == "fp32" or (device.type == "cpu" and 2 * kept <= T)

    def cost_factors(self, num_layers: int) -> list[float]:
        c = self.current_capacity()
        out = []
        for i, f in enumerate(self.flops):
            if i not in self.routed or c >= 1.0:
                out.append(1.0)
            else:
                out.append(((f["q_o"] + f["kv"] + f["ffn"]) * c + f["attn"] * c * c) / sum(f.values()))
        return out

    def drop_layer(self, i: int) -> None:
        self.accuracy.pop(i, None)  # a layer that migrated away: its predictor's figures are its new stage's

    def metrics(self) -> dict[str, Any]:
        out: dict[str, Any] = {"mod_capacity": round(self.current_capacity(), 6),
                               "predicted_cost": [round(c, 4) for c in self.cost_factors(self.L)]}
        if self.accuracy:  # this stage's routed layers, at their last training forward (one host read a step)
            figures = {i: [round(x, 4) for x in a.tolist()] for i, a in sorted(self.accuracy.items())}
            for k, name in enumerate(("accuracy", "recall", "precision")):
                out[f"predictor_{name}"] = {i: f[k] for i, f in figures.items()}
        return out
