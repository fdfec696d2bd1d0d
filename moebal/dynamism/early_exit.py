"""Early exit: a token leaves the network once its hidden state has converged; later layers skip it.

Shape legend: B = rows, T = sequence, D = model dim, L = layers.

Confidence (per token, after each exit-eligible layer i): the cosine similarity of the token's hidden state
before and after the layer, CALM's "hidden-state saturation" measure (Schuster et al. 2022). It needs no
extra parameters and no LM head on intermediate stages (CALM's softmax measure would need the head on every
stage). A token with confidence above the threshold exits: later layers compute nothing for it except the
key/value projections its frozen state still provides as context to the tokens that continue (CALM's state
propagation), and the head reads its frozen state. DynMo inherits its rule from CALM/ADP-C without giving
one; this is it.

Settled: exits are allowed after layers first_layer .. L - 2 (the last layer always runs; before
`first_layer` every token runs, as DynMo assumes equal load before the first exit); the threshold sets in
gradually (1.0, i.e. nobody exits, until `start`, then linear to `threshold` over `ramp` steps), so the
dynamism builds up while training runs. The active mask travels forward with the activations.

On a padded micro-batch (planned micro-batching, the carry's `ROW_TOKENS`) padding runs and exits like a token,
(causal attention keeps it from every real position), but the survival statistics count real tokens only: the
cost prediction is a property of the data, not of how a plan padded it.

Cost prediction for layer i: kv + (1 - kv) x s_i, with s_i the share of tokens still active at layer i and
kv the key/value projections' share of the layer's per-token work (`layer_token_flops`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from moebal.distributed.expert_parallel import is_expert_param
from moebal.dynamism.scheme import (
    Dynamism,
    SchemeContext,
    as_decoder,
    check_steps,
    layer_token_flops,
    ramp,
    real_positions,
    register,
    row_tokens,
    run_as_forward,
)
from moebal.errors import ConfigError
from moebal.models.subset import skip_layer, subset_block
from moebal.sync import host_values, to_host

__all__ = ["EarlyExit", "pack_positions"]


def _zero_tie(layer: nn.Module, h_BTD: torch.Tensor) -> torch.Tensor:
    """The skipped layer (`skip_layer`) tied to every dense parameter of `layer` with weight 0 (its Linears run on
    no rows, the other parameters summed), so their gradients are zeros: a rank's part in its FSDP2 unit's
    gradient reduce-scatter when no token of its rows reaches the layer but a peer's do. Run as the layer's
    forward (`run_as_forward`): the parameters are the gathered weights. Expert-parallel experts are the expert
    optimizer's, which counts a missing gradient as zeros."""
    out_BTD = skip_layer(as_decoder(layer), h_BTD)
    # each Linear called on no rows: under the zero-bubble schedule its weight gradient is W's deferred one, as on
    # the peers, which reduce-scatter it in W (moebal/distributed/fsdp.py `DeferredGradReducer`), not in B
    linears = [m for m in layer.modules() if isinstance(m, nn.Linear)]
    tie = [m(h_BTD.new_zeros(0, m.in_features)).sum() for m in linears]
    held = {id(p) for m in linears for p in m.parameters()}
    tie += [p.sum() for p in layer.parameters() if p.requires_grad and not is_expert_param(p) and id(p) not in held]
    return out_BTD + 0.0 * torch.stack(tie).sum() if tie else out_BTD


def pack_positions(active_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(pos_BQ, valid_BQ): the active positions of each row, ascending, padded to the longest row with 0."""
    B, T = active_BT.shape
    counts = active_BT.sum(dim=1)
    Q = int(to_host(counts.max(), "early exit: padded width"))  # the gathered rows' shape
    # a stable sort of (not active) puts active positions first, in ascending order
    order = torch.sort((~active_BT).to(torch.int8), dim=1, stable=True).indices[:, :Q]
    valid = torch.arange(Q, device=active_BT.device).unsqueeze(0) < counts.unsqueeze(1)
    return torch.where(valid, order, torch.zeros_like(order)), valid


@register("early_exit")
class EarlyExit(Dynamism):
    name = "early_exit"
    carries = ("active",)
    lockstep_decisions = True
    changes_outputs = True

    def __init__(self, cfg: Any, threshold: float = 0.99, first_layer: int | None = None, start: int = 0,
                 ramp_steps: int = 0) -> None:
        L = cfg.model.n_layers
        self.first_layer = max(1, L // 4) if first_layer is None else int(first_layer)
        if not 0 <= self.first_layer <= L - 2:  # exits follow layers first_layer .. L - 2: none would be possible
            said = f"{first_layer}" if first_layer is not None else f"null, max(1, n_layers // 4) = {self.first_layer}"
            raise ConfigError(f"dynamism early_exit: first_layer must be in [0, {L - 2}] (the last of the "
                              f"{L} layers always runs); got {said}" + ("" if L >= 2 else ": use at least 2 layers"))
        if not -1.0 <= threshold <= 1.0:
            raise ConfigError(f"dynamism early_exit: threshold is a cosine similarity in [-1, 1]; got {threshold}")
        check_steps("early_exit", start=start, ramp_steps=ramp_steps)
        self.L, self.threshold, self.start, self.ramp_steps = L, float(threshold), int(start), int(ramp_steps)
        flops = [layer_token_flops(cfg, i, cfg.data.seq_len) for i in range(L)]
        self.kv_share = [f["kv"] / sum(f.values()) for f in flops]
        self.tokens_in = torch.zeros(L + 1, dtype=torch.float64)  # slot L: tokens entering the network
        self.survival = [1.0] * L
        self.stage_sum: Callable[[torch.Tensor], torch.Tensor] | None = None
        """Under `parallel.shard: full` (`SchemeContext.stage_sum`): whether a peer of the stage runs a layer
        that no token of this rank reaches."""
        self.whole_sums = False  # `SchemeContext.whole_sums`
        self._ran: set[int] = set()
        self._last = False  # the forward of the micro-batch whose backward is the stage's last (`last_pass`)

    def tau(self, step: int | None = None) -> float:
        return ramp(self.step if step is None else step, self.start, self.ramp_steps, 1.0, self.threshold)

    def served_as(self) -> str:
        tau = self.tau()
        if tau >= 1.0:
            return f"early exit before its start: every token runs every layer (threshold 1 at step {self.step})"
        return (f"early exit: a token leaves after layers {self.first_layer}..{self.L - 2} once the cosine "
                f"similarity of its hidden state across the layer exceeds {tau:.4g}")

    def begin_step(self, step: int) -> None:
        super().begin_step(step)
        self.tokens_in.zero_()
        self._ran = set()  # layers a rank of the stage ran in this step's micro-batches so far

    def last_pass(self, on: bool) -> None:
        self._last = on

    def init_carry(self, B: int, T: int, device: torch.device,
                   n_B: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        self.tokens_in[self.L] += B * T if n_B is None else sum(host_values(n_B))
        return {"active": torch.ones(B, T, dtype=torch.bool, device=device)}

    def on_start(self, ctx: SchemeContext) -> None:
        self.stage_sum = ctx.stage_sum
        self.whole_sums = ctx.whole_sums

    def idle_parameters(self) -> bool:
        return True  # a layer every token of a step has left

    def layer_forward(self, i: int, layer: nn.Module, h_BTD: torch.Tensor, cos_TK: torch.Tensor,
                      sin_TK: torch.Tensor, carry: dict[str, torch.Tensor]) -> torch.Tensor:
        active = carry["active"]
        n_B = row_tokens(carry)
        if n_B is None:
            n = int(to_host(active.sum(), "early exit: active tokens"))  # choose the full, subset or skip path
            self.tokens_in[i] += n
        else:  # padding runs like a token but is not counted in the survival statistics
            real = active & real_positions(n_B, active.shape[1], active.device)
            n, n_real = to_host(torch.stack([active.sum(), real.sum()]), "early exit: active tokens")
            self.tokens_in[i] += n_real
        stage_n = self._stage_tokens(i, n)
        if stage_n:
            self._ran.add(i)
        out: torch.Tensor
        if n == active.numel():
            out = layer(h_BTD, cos_TK, sin_TK)
        elif n == 0:
            if stage_n or (self.whole_sums and self._last and i in self._ran):
                # a peer runs the layer: FSDP2 reduce-scatters its gradients on every rank of the stage, so this
                # rank joins with zeros (its peers' sum, as the unsharded sum of theirs). Under whole sums the
                # step's last backward pass reduce-scatters the layer's sums of the earlier micro-batches: when no
                # rank runs the layer in that micro-batch, every rank joins with zeros, so the sums go out (a
                # layer no micro-batch of the step ran keeps no gradient, which AdamW skips, as unsharded)
                return run_as_forward(layer, lambda h, cos, sin: _zero_tie(layer, h), h_BTD, cos_TK, sin_TK)
            # an MoE block may still join its peers' collectives with no token (`skip_layer`), with its weights
            return run_as_forward(layer, lambda h, cos, sin: skip_layer(as_decoder(layer), h), h_BTD, cos_TK,
                                  sin_TK) if as_decoder(layer).is_moe else skip_layer(as_decoder(layer), h_BTD)
        else:
            pos, valid = pack_positions(active)
            out = run_as_forward(layer, lambda h, cos, sin: subset_block(as_decoder(layer), h, cos, sin, pos, valid,
                                                                         keys="all"), h_BTD, cos_TK, sin_TK)
        tau = self.tau()
        if self.first_layer <= i < self.L - 1 and tau < 1.0:
            with torch.no_grad():
                conf = F.cosine_similarity(out.float(), h_BTD.float(), dim=-1)
                carry["active"] = active & ~(conf > tau)
        return out

    def _stage_tokens(self, i: int, n: int) -> int | None:
        """Layer i's active tokens summed over the stage's ranks under `parallel.shard: full` (`stage_sum`: a host
        all-reduce, on every rank of the stage for the same layers: those after the first exit layer while exits
        are on), None where no rank can have lost every token."""
        if self.stage_sum is None or i <= self.first_layer or self.tau() >= 1.0:
            return None
        return int(self.stage_sum(torch.tensor([float(n)], dtype=torch.float64))[0])

    # ---- statistics and predictions ----
    def stats_size(self, num_layers: int) -> int:
        return num_layers + 1

    def local_stats(self) -> torch.Tensor:
        return self.tokens_in.clone()

    def set_global_stats(self, vec: torch.Tensor) -> None:
        total = float(vec[self.L]) if vec.numel() > self.L else 0.0
        if total > 0:
            self.survival = [float(v) / total for v in vec[:self.L]]

    def cost_factors(self, num_layers: int) -> list[float]:
        return [1.0 if s >= 1.0 else kv + (1 - kv) * s for kv, s in zip(self.kv_share, self.survival)]

    def metrics(self) -> dict[str, Any]:
        return {"exit_threshold": round(self.tau(), 6), "survival": [round(s, 4) for s in self.survival],
                "predicted_cost": [round(c, 4) for c in self.cost_factors(self.L)]}

    def state_dict(self) -> dict[str, Any]:
        return {"survival": self.survival}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.survival = list(state.get("survival", self.survival))
