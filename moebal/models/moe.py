"""The MoE block: router, top-k routing, sort-based dispatch, grouped SwiGLU experts, weighted combine.

Single-device code. The four steps (route -> plan -> experts -> combine) are separate methods so that an
expert-parallel dispatcher can run the all-to-alls between them and reuse the same routing decision.

Shape legend: T tokens (all leading dims flattened), D model dim, E experts, K = top_k, F expert hidden dim,
N dispatched rows (one per active assignment), S shared-expert hidden dim.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Literal, Protocol, get_args

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from moebal.kernels.dispatch import DispatchPlan, combine, dispatch, make_plan
from moebal.kernels.expert_ffn import KERNELS, KernelName, auto_kernel, grouped_mm_supports, swiglu_experts
from moebal.models import noise, padding
from moebal.models.mlp import MLP
from moebal.routing import (
    AuxLossScope,
    GateSpec,
    GroupScore,
    Routing,
    RoutingStats,
    assignment_counts,
    balance_sums,
    load_balancing_loss,
    route,
    router_z_loss,
    sequence_balancing_loss,
    token_count,
    update_selection_bias,
)

if TYPE_CHECKING:
    from moebal.config import Config

ROUTERS = ("linear", "mlp_tanh")


class Dispatcher(Protocol):
    """Runs a MoE layer's experts on its routed tokens: `LocalDispatcher` (every expert on this device, the
    default) or `moebal.distributed.expert_parallel.ExpertParallelDispatcher` (all-to-alls around the experts
    of an expert-parallel group), set from outside with `MoELayer.set_dispatcher`."""

    def forward(self, x_TD: torch.Tensor, routing: Routing) -> torch.Tensor:
        """out_TD: the weighted sum of each token's top-k experts' outputs (no shared expert)."""
        ...


class StatsReducer(Protocol):
    """Sums routing statistics over ranks (`moebal.distributed.expert_parallel.StatsReducer`)."""

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, no gradient."""
        ...

    def sum_grad(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over ranks whose backward sums the gradients too."""
        ...


class LocalDispatcher:
    """Every expert of `layer` on this device: gather the rows per expert, run them, combine (no communication)."""

    def __init__(self, layer: MoELayer) -> None:
        self.layer = layer

    def forward(self, x_TD: torch.Tensor, routing: Routing) -> torch.Tensor:
        layer, x_c = self.layer, x_TD
        if torch.is_autocast_enabled(x_TD.device.type):  # cast before the gather: half the bytes to move
            x_c = x_TD.to(torch.get_autocast_dtype(x_TD.device.type))
        # The loop kernel reads its row counts on the host anyway; grouped_mm keeps them on the device, so
        # dropped or untaken assignments stay as masked rows instead of a host read of the active count.
        plan = layer.plan(routing, trim=layer.experts.resolve_kernel(x_TD.shape[0], x_c.dtype) == "loop")
        x_ND = plan.mask_tail(dispatch(x_c, plan))
        if layer.recomputes_experts():
            y_ND: torch.Tensor = checkpoint(layer.expert_forward, x_ND, plan, use_reentrant=False)
        else:
            y_ND = layer.expert_forward(x_ND, plan)
        return combine(plan.mask_tail(y_ND), plan, routing.weights_TK)


class SwiGLUExperts(nn.Module):
    """E SwiGLU experts as stacked parameters: w1, w3 [E, F, D] (gate, up), w2 [E, D, F] (down).

    Under expert parallelism a rank holds some rows only: `expert_ids` gives the logical expert of each row
    (checkpoints store experts by logical id, so they load under any layout), `num_experts` the layer's total."""

    stacked_expert_params = ("w1", "w3", "w2")

    def __init__(self, num_experts: int, dim: int, ffn_dim: int, kernel: str = "auto") -> None:
        super().__init__()
        self.num_experts = num_experts
        self.expert_ids: tuple[int, ...] = tuple(range(num_experts))
        if kernel not in ("auto", *KERNELS):
            raise ValueError(f"kernel must be one of auto, {', '.join(KERNELS)}; got {kernel!r}")
        self.w1 = nn.Parameter(torch.empty(num_experts, ffn_dim, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, ffn_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, ffn_dim))
        # "auto" (`auto_kernel`'s rule) or the back end every call uses; a training run sets the one it settled
        # on at start-up (moebal/train/kernels.py)
        self.kernel = kernel

    def resolve_kernel(self, rows: int, dtype: torch.dtype) -> KernelName:
        """The back end of a call with `rows` rows in `dtype` (the same for every row count)."""
        _, F_, D = self.w1.shape
        if self.kernel == "grouped_mm" and not grouped_mm_supports(D, F_, dtype):
            raise ValueError(f"kernel='grouped_mm' needs dim and ffn_dim whose rows are multiples of 16 bytes in "
                             f"{dtype} (dim={D}, ffn_dim={F_}); use kernel='auto' or 'loop'")
        if self.kernel == "auto":
            return auto_kernel(self.w1.device, D, F_, dtype)
        for k in KERNELS:  # checked here too: a run sets `kernel` after construction (moebal/train/kernels.py)
            if k == self.kernel:
                return k
        raise ValueError(f"kernel must be one of auto, {', '.join(KERNELS)}; got {self.kernel!r}")

    def forward(self, x_ND: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        return self.compute(x_ND, self.w1, self.w3, self.w2, plan)

    def compute(self, x_ND: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                plan: DispatchPlan) -> torch.Tensor:
        """The grouped SwiGLU with given stacked weights (an expert-parallel dispatcher passes the experts
        present on its rank: owned slices and replicas)."""
        if torch.is_autocast_enabled(x_ND.device.type):
            x_ND = x_ND.to(torch.get_autocast_dtype(x_ND.device.type))
        if x_ND.dtype != w1.dtype:  # autocast or a low-precision input: compute in the rows' dtype
            w1, w3, w2 = w1.to(x_ND.dtype), w3.to(x_ND.dtype), w2.to(x_ND.dtype)
        kernel = self.resolve_kernel(x_ND.shape[0], x_ND.dtype)
        # The fused kernel writes into preallocated buffers (`out=`), which autocast would silently leave in
        # fp32: the dtype is decided above, explicitly, and autocast is off inside.
        with torch.autocast(x_ND.device.type, enabled=False):
            return swiglu_experts(x_ND, w1, w3, w2, plan, kernel)


# Qwen-MoE style always-on expert: the dense SwiGLU MLP under the HF names (mlp.shared_expert.gate_proj, ...).
SharedExpert = MLP


def _check_args(dim: int, ffn_dim: int, num_experts: int, top_k: int, router: str, jitter: float,
                shared_ffn_dim: int, aux_loss_coef: float, z_loss_coef: float, bias_update_rate: float,
                init_std: float, router_noise: float | None, shared_gate: bool) -> None:
    for name, v in (("dim", dim), ("ffn_dim", ffn_dim), ("num_experts", num_experts), ("top_k", top_k)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"MoELayer: {name} must be a positive integer; got {v!r}")
    if top_k > num_experts:
        raise ValueError(f"MoELayer: top_k ({top_k}) is larger than num_experts ({num_experts}): lower top_k")
    if router not in ROUTERS:
        raise ValueError(f"MoELayer: router must be one of {', '.join(ROUTERS)}; got {router!r}")
    if not 0.0 <= jitter < 1.0:
        raise ValueError(f"MoELayer: jitter is a multiplicative noise epsilon in [0, 1); got {jitter}")
    if shared_ffn_dim < 0:
        raise ValueError(f"MoELayer: shared_ffn_dim must be >= 0 (0 = no shared expert); got {shared_ffn_dim}")
    if shared_gate and shared_ffn_dim == 0:
        raise ValueError("MoELayer: shared_gate=True needs a shared expert (shared_ffn_dim > 0)")
    if router_noise is not None and not (router_noise >= 0.0 and math.isfinite(router_noise)):
        raise ValueError(f"MoELayer: router_noise is a noise floor epsilon >= 0 (or None); got {router_noise}")
    for name, f in (("aux_loss_coef", aux_loss_coef), ("z_loss_coef", z_loss_coef),
                    ("bias_update_rate", bias_update_rate)):
        if not (f >= 0.0 and math.isfinite(f)):
            raise ValueError(f"MoELayer: {name} must be a finite number >= 0; got {f}")
    if not init_std > 0:
        raise ValueError(f"MoELayer: init_std must be positive; got {init_std}")


class MoELayer(nn.Module):
    """Drop-in MoE block over (..., dim) tensors: top-k routed SwiGLU experts (+ optional shared expert).

    After each forward: `.aux_loss` (coefficient-weighted load-balancing + z loss, fp32 scalar) and
    `.last_stats` (`RoutingStats` of that forward). Training forwards also accumulate into the step's
    statistics, which the trainer reads once per step with `take_stats()`.
    """

    def __init__(self, dim: int, ffn_dim: int, num_experts: int, top_k: int, capacity_factor: float | None = None,
                 *, drop_policy: Literal["probs", "position"] = "probs",
                 gate: Literal["softmax_topk", "topk_softmax", "sigmoid_topk"] = "softmax_topk",
                 router: Literal["linear", "mlp_tanh"] = "linear", adaptive_threshold: float | None = None,
                 jitter: float = 0.0, score_scale: float = 1.0, shared_ffn_dim: int = 0,
                 aux_loss_coef: float = 0.01, z_loss_coef: float = 0.0, bias_update_rate: float = 0.0,
                 kernel: Literal["auto", "grouped_mm", "loop"] = "auto", init_std: float = 0.02,
                 norm_topk: bool = True, router_noise: float | None = None, shared_gate: bool = False,
                 n_group: int = 1, topk_group: int | None = None, group_score: GroupScore = "max",
                 selection_bias: bool = False, router_fp32: bool = False,
                 aux_loss_scope: AuxLossScope = "layer") -> None:
        super().__init__()
        _check_args(dim, ffn_dim, num_experts, top_k, router, jitter, shared_ffn_dim, aux_loss_coef,
                    z_loss_coef, bias_update_rate, init_std, router_noise, shared_gate)
        self.spec = GateSpec(num_experts=num_experts, top_k=top_k, gate=gate, adaptive_threshold=adaptive_threshold,
                             capacity_factor=capacity_factor, drop_policy=drop_policy, score_scale=score_scale,
                             norm_topk=norm_topk, n_group=n_group, topk_group=topk_group, group_score=group_score)
        self.dim, self.ffn_dim, self.num_experts, self.top_k = dim, ffn_dim, num_experts, top_k
        self.router, self.jitter, self.init_std, self.router_noise = router, jitter, init_std, router_noise
        self.noise_index = 0
        """The layer's model-wide index, which keys its router noise (the decoder layer sets it)."""
        self.router_fp32 = router_fp32
        self.aux_loss_coef, self.z_loss_coef, self.bias_update_rate = aux_loss_coef, z_loss_coef, bias_update_rate
        if aux_loss_scope not in get_args(AuxLossScope):
            raise ValueError(f"MoELayer: aux_loss_scope must be one of {get_args(AuxLossScope)}; got "
                             f"{aux_loss_scope!r}")
        self.aux_loss_scope = aux_loss_scope
        self.gate = nn.Linear(dim, num_experts, bias=False)
        if router == "mlp_tanh":
            self.gate_out = nn.Linear(num_experts, num_experts, bias=False)  # LLaMA-MoE v1: G2 tanh(G1 x)
        if router_noise is not None:
            self.gate_noise = nn.Linear(dim, num_experts, bias=False)  # noise scale W_noise (Shazeer et al. 2017)
        self.experts = SwiGLUExperts(num_experts, dim, ffn_dim, kernel)
        self.shared_expert = SharedExpert(dim, shared_ffn_dim) if shared_ffn_dim > 0 else None
        self.shared_expert_gate = nn.Linear(dim, 1, bias=False) if shared_gate else None  # Qwen2-MoE
        if bias_update_rate > 0 or selection_bias:
            # DeepSeek-V3's e_score_correction_bias: a buffer (no gradient), moved only by `update_bias`
            self.register_buffer("expert_bias", torch.zeros(num_experts))
        else:
            self.expert_bias = None
        self.dispatcher: Dispatcher = LocalDispatcher(self)
        self.stats_reducer: StatsReducer | None = None  # sums statistics over data-parallel ranks (None: this device)
        self.aux_loss: torch.Tensor = torch.zeros(())
        self.balance_sums: torch.Tensor | None = None
        """With `aux_loss_scope: pooled`: the last forward's (tokens, counts, probability sums) for the model's one
        loss over its layers (`pooled_balancing_loss`; not in `aux_loss`); None otherwise."""
        self.last_stats: RoutingStats | None = None
        self.last_routing: Routing | None = None
        self._step_stats: RoutingStats | None = None
        # activation recomputation (moebal/models/recompute.py): whether a block that talks to other ranks
        # recomputes its rank-local compute in the backward pass, and whether a replay is running now
        self.recompute_local = False
        self._replay = False
        self.records = True
        """Whether a forward records its routing statistics, balancing loss and `last_routing` (`_record`).
        Generation turns it off (`moebal.models.generate.dropless`): nothing reads them there, and they cost
        6-10 % of a decode step."""
        self.reset_parameters()

    @classmethod
    def from_config(cls, cfg: Config) -> MoELayer:
        """The block `cfg.moe` describes, at `cfg.model.dim`, experts `cfg.expert_ffn_dim` wide."""
        moe = cfg.moe
        shared = cfg.shared_expert_ffn_dim
        layer = cls(cfg.model.dim, cfg.expert_ffn_dim, moe.num_experts, moe.top_k, moe.capacity_factor,
                   drop_policy=moe.drop_policy, gate=moe.gate, router=moe.router,
                   adaptive_threshold=moe.adaptive_threshold, jitter=moe.jitter, score_scale=moe.score_scale,
                   shared_ffn_dim=shared, aux_loss_coef=moe.aux_loss_coef, z_loss_coef=moe.z_loss_coef,
                   bias_update_rate=moe.bias_update_rate, kernel=moe.kernel, init_std=cfg.model.init_std,
                   norm_topk=moe.norm_topk, router_noise=moe.router_noise, shared_gate=moe.shared_gate,
                   n_group=moe.n_group, topk_group=moe.topk_group, group_score=moe.group_score,
                   selection_bias=moe.selection_bias, router_fp32=moe.router_fp32,
                   aux_loss_scope=moe.aux_loss_scope)
        layer.recompute_local = cfg.train.recompute in ("moe", "full")
        return layer

    def reset_parameters(self) -> None:
        """Normal(0, init_std) for the router and every expert weight; the selection bias and the noise
        projection at zero (every token then starts with the same noise scale, as in Shazeer et al.)."""
        for p in self.parameters():
            nn.init.normal_(p, mean=0.0, std=self.init_std)
        if self.router_noise is not None:
            nn.init.zeros_(self.gate_noise.weight)
        if self.expert_bias is not None:
            self.expert_bias.zero_()

    # ---- the four steps -------------------------------------------------------------------------------

    def router_logits(self, x_TD: torch.Tensor) -> torch.Tensor:
        """Router logits [T, E] in the input's dtype (fp32 with `router_fp32`). While training: Switch jitter on
        the router input, and noisy top-k gating on the logits (noise scale from the unjittered input), drawn
        under the trainer's key for this layer (`noise_index`; moebal/models/noise.py), else from the global
        generator."""
        x_in = x_TD
        g = noise.generator(x_TD.device, self.noise_index) \
            if self.training and (self.jitter > 0 or self.router_noise is not None) else None
        if self.training and self.jitter > 0:
            jitter = torch.empty_like(x_TD).uniform_(1.0 - self.jitter, 1.0 + self.jitter, generator=g)
            x_TD = x_TD * jitter
        logits_TE = self._router_linear(self.gate, x_TD)
        if self.router == "mlp_tanh":
            logits_TE = self._router_linear(self.gate_out, torch.tanh(logits_TE))
        if self.training and self.router_noise is not None:
            std_TE = torch.nn.functional.softplus(self._router_linear(self.gate_noise, x_in)) + self.router_noise
            draw = torch.empty_like(logits_TE).normal_(generator=g)
            logits_TE = logits_TE + draw * std_TE
        return logits_TE

    def _router_linear(self, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """One of the router's bias-free linears: with `router_fp32` an fp32 input times an fp32 weight whatever
        the model's dtype or autocast (transformers' DeepSeek routers), every one of them (the tanh MLP's second
        linear and the noise scale too: the logits are fp32 throughout); else the module under the autocast."""
        if not self.router_fp32:
            out: torch.Tensor = layer(x)
            return out
        with torch.autocast(x.device.type, enabled=False):
            return torch.nn.functional.linear(x.float(), layer.weight.float())

    def route(self, x_TD: torch.Tensor) -> Routing:
        """The routing decision for tokens x_TD (selection bias applied to the choice only)."""
        return route(self.router_logits(x_TD), self.spec, self.expert_bias)

    def plan(self, r: Routing, trim: bool = True) -> DispatchPlan:
        """The dispatch plan of a routing decision; `trim=False` keeps inactive assignments as masked rows
        (no host sync: see `make_plan`)."""
        return make_plan(r.indices_TK, r.active_TK, self.num_experts, trim=trim)

    def expert_forward(self, x_ND: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        y_ND: torch.Tensor = self.experts(x_ND, plan)  # nn.Module.__call__ is typed Any
        return y_ND

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.dim:
            raise ValueError(f"MoELayer: expected input (..., {self.dim}); got shape {tuple(x.shape)}")
        x_TD = x.reshape(-1, self.dim)
        real_T = padding.real_mask(x.shape[:-1], x.device) if self.records else None  # the losses leave padding out
        r = self.route(x_TD)
        out_TD = self.dispatcher.forward(x_TD, r)  # expert parallel: all-to-alls around the experts
        if self.shared_expert is not None:
            if self.recomputes_experts():
                shared_TD = checkpoint(self.shared_expert, x_TD, use_reentrant=False)
            else:
                shared_TD = self.shared_expert(x_TD)
            if self.shared_expert_gate is not None:
                shared_TD = torch.sigmoid(self.shared_expert_gate(x_TD)) * shared_TD
            out_TD = out_TD + shared_TD
        self._record(r, real_T, math.prod(x.shape[:-2]) if x.dim() > 2 else 1)
        return out_TD.view(x.shape).to(x.dtype)

    # ---- losses and statistics --------------------------------------------------------------------------

    def _record(self, r: Routing, real_T: torch.Tensor | None = None, rows: int = 1) -> None:
        """The routing statistics (every position: the dispatched work) and the losses (`real_T`: bool [T], the
        real positions when rows end in padding, moebal/models/padding.py; None: every position; `rows`: the
        tokens' rows, for the per-sequence loss)."""
        if not self.records:
            return
        stats = RoutingStats.from_routing(r)
        aux, sums = self._losses(r, stats, real_T, rows)  # in a replay too: the backward unpacks its saved tensors
        if self._replay:
            return  # the forward recorded this step's statistics and loss already
        self.last_routing, self.last_stats, self.aux_loss, self.balance_sums = r, stats, aux, sums
        if self.training and torch.is_grad_enabled():
            self._step_stats = stats.clone() if self._step_stats is None else self._step_stats.add(stats)

    def _losses(self, r: Routing, stats: RoutingStats, real_T: torch.Tensor | None = None, rows: int = 1
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The coefficient-weighted balancing and z losses over the real positions (`real_T`, None: all) of the
        tokens' `rows` equal rows (row-major), and with
        `aux_loss_scope: pooled` the layer's `balance_sums` (its balancing term is then the model's, not here).

        Scopes: `layer` is each layer's Switch loss over the batch (global over the ranks with a reducer);
        `pooled` one loss over every layer's batch (transformers'); `sequence` each layer's loss per row
        (DeepSeek's `seq_aux`), a row's own routing and so never summed over ranks."""
        aux = r.logits_TE.new_zeros(())
        counts_E, sums = None, None
        if self.aux_loss_coef > 0:
            # the counted choices: every taken one (a fixed top-k, HF Mixtral), or each token's first under
            # adaptive gating (Adaptive Gating Eq. 5.4: f^1 is every token's top-1 decision); the real ones only
            adaptive = self.spec.adaptive_threshold is not None
            idx_TK, counted_TK = (r.indices_TK[:, :1], None) if adaptive else (r.indices_TK, r.taken_TK)
            if real_T is not None:
                real_TK = real_T.unsqueeze(1).expand_as(idx_TK)
                counted_TK = real_TK if counted_TK is None else counted_TK & real_TK
            if self.aux_loss_scope == "sequence":
                aux = aux + self.aux_loss_coef * sequence_balancing_loss(r.probs_TE, idx_TK, counted_TK, rows, real_T)
            else:  # every taken choice of every token: the step's statistics count them already
                counts_E = stats.routed_E if real_T is None and not adaptive else \
                    assignment_counts(idx_TK, counted_TK, self.num_experts)
        if self.stats_reducer is not None and (counts_E is not None or self.z_loss_coef > 0):
            return self._global_losses(r, counts_E, self.stats_reducer, real_T, aux)
        pooled = self.aux_loss_scope == "pooled"
        if counts_E is not None and pooled:
            sums = balance_sums(r.probs_TE, counts_E, real_T)  # no token: zero sums
        if r.probs_TE.shape[0] == 0:  # no token: no balancing or z loss (a mean over nothing is NaN), as skip_layer
            return aux, sums
        if counts_E is not None and not pooled:
            aux = aux + self.aux_loss_coef * load_balancing_loss(r.probs_TE, counts_E, real_T)
        if self.z_loss_coef > 0:
            aux = aux + self.z_loss_coef * router_z_loss(r.logits_TE, real_T)
        return aux, sums

    def _global_losses(self, r: Routing, counts_E: torch.Tensor | None, reducer: StatsReducer,
                       real_T: torch.Tensor | None, aux: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The balancing and z losses over every rank's tokens, from one all-reduce (forward and backward), added
        to `aux`; with `aux_loss_scope: pooled` the balancing term's global `balance_sums` instead of the term.

        Load balancing: f from the summed counts, P from the summed probabilities over the summed token count
        (a product of means is not a mean of products). Z-loss: the summed squares over the summed token count
        (a mean of per-rank means is not the mean when ranks hold different numbers of tokens, e.g. after early
        exits). Counts travel as fp32 (exact below 2^24 assignments per expert) beside the probability sums;
        the sum carries the gradient back to each rank's own tokens. `real_T`: only these positions count (padding
        left out: moebal/models/padding.py), by masked sums."""
        E = r.probs_TE.shape[1]
        parts = [token_count(r.probs_TE, real_T) if counts_E is None else balance_sums(r.probs_TE, counts_E, real_T)]
        if self.z_loss_coef > 0:
            z_T = torch.logsumexp(r.logits_TE.float(), dim=-1).square()
            parts.append((z_T if real_T is None else z_T * real_T.to(z_T.dtype)).sum().reshape(1))
        total = reducer.sum_grad(torch.cat(parts))
        tokens = total[0].clamp(min=1.0)  # no token anywhere: P = 0, not NaN
        sums = None
        if counts_E is not None and self.aux_loss_scope == "pooled":
            sums = total[:1 + 2 * E]
        elif counts_E is not None:
            counts, P_E = total[1:1 + E].detach(), total[1 + E:1 + 2 * E] / tokens
            f_E = counts / counts.sum().clamp(min=1.0)
            aux = aux + self.aux_loss_coef * (self.num_experts * torch.sum(f_E * P_E))
        if self.z_loss_coef > 0:
            aux = aux + self.z_loss_coef * (total[-1] / tokens)
        return aux, sums

    def take_stats(self) -> RoutingStats:
        """Statistics accumulated by training forwards since the last call (then reset); no host sync."""
        stats = self._step_stats
        self._step_stats = None
        if stats is None:
            stats = RoutingStats.zeros(self.num_experts, self.top_k, self.gate.weight.device)
        return stats

    @torch.no_grad()
    def update_bias(self, counts_E: torch.Tensor) -> None:
        """Auxiliary-loss-free balancing step (DeepSeek-V3); call once per optimizer step with the step's
        globally reduced gate assignments per expert (e.g. `take_stats().routed_E`, all-reduced)."""
        if self.expert_bias is None:
            raise ValueError("MoELayer.update_bias: the layer has no selection bias to update; build it with "
                             "bias_update_rate > 0")
        if counts_E.shape != (self.num_experts,):
            raise ValueError(f"MoELayer.update_bias: counts_E must have shape ({self.num_experts},); "
                             f"got {tuple(counts_E.shape)}")
        if self.bias_update_rate > 0:  # a loaded bias (selection_bias) with rate 0 stays as it is
            update_selection_bias(self.expert_bias, counts_E, self.bias_update_rate)

    # ---- activation recomputation (moebal/models/recompute.py) ----

    @contextmanager
    def replaying(self) -> Iterator[None]:
        """The block's forward runs again inside (a recomputation in the backward pass): no bookkeeping."""
        self._replay = True
        try:
            yield
        finally:
            self._replay = False

    def recomputes_experts(self) -> bool:
        """Whether this forward recomputes its rank-local expert compute in the backward pass on its own: with
        `recompute_local`, when the block talks to other ranks (a replay of the whole block, which the decoder
        layer does otherwise, would rerun the collectives) and gradients are on."""
        return self.recompute_local and not self.is_local() and torch.is_grad_enabled()

    # ---- parallelism hooks (set from outside by moebal.distributed; the layer itself stays single-device) ----------

    def set_dispatcher(self, dispatcher: Dispatcher) -> None:
        """Route tokens through `dispatcher.forward(x_TD, routing) -> out_TD` instead of the local experts."""
        self.dispatcher = dispatcher

    def is_local(self) -> bool:
        """Whether every expert runs here and statistics stay on this device (no peer waits on this layer)."""
        return isinstance(self.dispatcher, LocalDispatcher) and self.stats_reducer is None

    def set_stats_reducer(self, reducer: StatsReducer) -> None:
        """Compute the load-balancing loss from statistics summed over ranks (`reducer.sum(t)` without and
        `reducer.sum_grad(t)` with a gradient), so it equals the single-process loss over the global batch: a
        product of means is not a mean of products."""
        self.stats_reducer = reducer

    def __getstate__(self) -> dict[str, object]:
        # The last forward's loss and routing hold autograd graphs, which deepcopy/pickle cannot copy.
        state = self.__dict__.copy()
        state["aux_loss"], state["balance_sums"] = torch.zeros(()), None
        state["last_routing"] = None
        return state

    def extra_repr(self) -> str:
        s = self.spec
        return (f"dim={self.dim}, ffn_dim={self.ffn_dim}, experts={s.num_experts}, top_k={s.top_k}, gate={s.gate}, "
                f"router={self.router}, capacity_factor={s.capacity_factor}, adaptive={s.adaptive_threshold}"
                + (f", n_group={s.n_group}, topk_group={s.topk_group}, group_score={s.group_score}"
                   if s.limits_groups else ""))
