"""Dynamism schemes: what makes per-layer cost drift while a model trains, seen by the pipeline engine.

A scheme is applied from outside the model (it wraps how a layer runs, masks or freezes parameters,
attaches small router modules before the model is sliced) and tells the planner what it predicts each
layer costs. The engine calls, per micro-batch and layer, `layer_forward`; per step `after_backward`,
`after_optimizer_step` and `update`; migration moves a layer's scheme state with `layer_state`, and a
checkpoint keeps it by global layer index (and a parameter-shaped entry `<kind>:<parameter name>` by logical
expert), with the job-wide `state_dict`, so a resume under any partition restores it.

Schemes (config `dynamism.scheme`): `none`, `pruning`, `freezing`, `early_exit`, `mod`, `moe`, `sparse_attention`.
Every decision that concerns more than one stage is taken from numbers all-reduced along the pipeline chain,
so every rank takes the same decision from the same bits.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
import torch.distributed as dist
from torch import nn

from moebal.errors import ConfigError
from moebal.models import padding
from moebal.models.padding import real_positions

if TYPE_CHECKING:
    from moebal.models.transformer import DecoderLayer, MoebalForCausalLM, MoebalModel
    from moebal.pipeline.units import UnitMap

__all__ = ["ROW_TOKENS", "SCHEMES", "Dynamism", "SchemeContext", "as_decoder", "build_dynamism", "check_steps",
           "layer_token_flops",
           "ramp", "real_positions", "register", "row_tokens", "run_as_forward", "served_forward", "served_scheme"]


class SchemeBody(Protocol):
    """What a scheme reads of a stage's body (`moebal.pipeline.stage`'s `model.`)."""

    @property
    def embed_tokens(self) -> nn.Embedding | None:
        """The embedding on the first stage, None elsewhere."""
        ...


class SchemeStage(Protocol):
    """What a scheme reads of this rank's pipeline stage (`moebal.pipeline.stage.PipelineStage`)."""

    @property
    def layer_ids(self) -> list[int]:
        """The decoder layers held here, ascending."""
        ...

    @property
    def model(self) -> SchemeBody:
        """The stage's body: `layers` and, on the first stage, `embed_tokens` (None elsewhere)."""
        ...

    def layer(self, i: int) -> nn.Module:
        """Decoder layer i (held here)."""
        ...

    @property
    def tied_head(self) -> torch.Tensor | None:
        """The LM head's weight on the last stage when it is the embedding's (`model.tie_embeddings`), else None."""
        ...


class SchemeChain(Protocol):
    """The pipeline chain a scheme agrees through (`moebal.pipeline.p2p.PipeChain`)."""

    def allreduce_sum(self, vec: torch.Tensor) -> torch.Tensor:
        """Sum of every member's CPU `vec`, the same bits on every member."""
        ...


@dataclass
class SchemeContext:
    """What a scheme may look at around a step (all of it local to this rank's stage)."""

    step: int
    stage: SchemeStage
    """The PipelineStage of this rank."""
    chain: SchemeChain
    """The PipeChain (for agreements along the pipeline)."""
    num_layers: int
    optimizer: torch.optim.Optimizer | None = None
    rows: int | None = None
    """Token rows of one micro-batch on this rank (what kernels are timed at); set when a scheme starts."""
    device: torch.device | None = None
    """The device this rank computes on (what kernels are timed on); set when a scheme starts."""
    dp: int = 1
    """Data-parallel copies of this stage."""
    dp_group: dist.ProcessGroup | None = None
    """The process group of those copies (None: the default group)."""
    ep: int = 1
    """Expert-parallel size of this stage's MoE layers (1: every expert on each rank)."""
    ep_index: int = 0
    """This rank's expert shard among those `ep` (it holds the shard's block of experts)."""
    shard_sum: Callable[[torch.Tensor], torch.Tensor] | None = None
    """Sums a per-rank quantity over this rank's expert shards (None: nothing is sharded)."""
    stage_sum: Callable[[torch.Tensor], torch.Tensor] | None = None
    """Sums a per-rank host quantity over the ranks of this stage, for a decision they must take alike because
    they run each layer in lockstep (`parallel.shard: full`: FSDP2 gathers and reduce-scatters per layer over
    them); None when they need not agree. Collective: every rank of the stage calls it at the same point."""
    whole_sums: bool = False
    """FSDP2 adds a step's gradients up whole and reduce-scatters them in the step's last backward pass only
    (`parallel.accumulate: whole`): a layer that pass does not reach keeps its sums unsent (`Dynamism.last_pass`)."""


ROW_TOKENS = "row_tokens"
"""Carry key of a padded micro-batch (planned micro-batching, `pipeline/planned.py`): the real tokens of each
row, a host int64 [B]; each row holds its real tokens first and padding after (right padding, label -100, which
causal attention keeps from every real position). Absent when every position is real. The planned engine sets it
on every stage from the plan, which every rank holds, so it never travels between stages."""


def row_tokens(carry: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The real tokens of each row (host int64 [B]), None when every position of the micro-batch is real."""
    return carry.get(ROW_TOKENS)


def served_forward(scheme: Dynamism, body: MoebalModel, ids_BT: torch.Tensor,
                   row_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """A served model body's forward (`Dynamism.serve`): the embedding, every decoder layer through the scheme's
    `layer_forward` with a carry begun per batch (the engine's forward of a one-stage pipeline), the final norm.
    `row_tokens`: each row's real tokens (host int64 [B]) when rows end in right padding, the carry's `ROW_TOKENS`
    as the engine sets it for the run's own validation (None, or every row full: no padding)."""
    B, T = ids_BT.shape
    n_B = padding.padded(row_tokens, T)  # the engine's rule
    h_BTD = body.embed_tokens(ids_BT)
    cos_TK, sin_TK = body.rotary(T, h_BTD.dtype)
    carry = scheme.init_carry(B, T, ids_BT.device, n_B)
    if n_B is not None:
        carry[ROW_TOKENS] = n_B
    with padding.rows(n_B, T):  # the MoE losses leave out the padding, as the engine's forward does
        for i, layer in enumerate(body.layers):
            h_BTD = scheme.layer_forward(i, layer, h_BTD, cos_TK, sin_TK, carry)
    out_BTD: torch.Tensor = body.norm(h_BTD)
    return out_BTD


def served_scheme(body: MoebalModel) -> Dynamism | None:
    """The scheme a model body is served through (`Dynamism.serve` made its forward `served_forward`), None for a
    plain body."""
    fwd = vars(body).get("forward")
    if isinstance(fwd, functools.partial) and fwd.func is served_forward:
        scheme: Dynamism = fwd.args[0]
        return scheme
    return None


class Dynamism:
    """The static model: every layer costs what it costs, nothing changes."""

    name = "none"
    step = 0
    carries: tuple[str, ...] = ()
    """Names of per-token bool [B, T] tensors that travel forward with the activations between stages. A carry
    may also hold `ROW_TOKENS`, which the engine sets on every stage and never sends (see `row_tokens`)."""
    lockstep_decisions = False
    """`layer_forward` takes a per-rank decision (which path a layer runs) that the ranks of a stage must take
    alike under `parallel.shard: full`: the runner then gives it `SchemeContext.stage_sum`."""
    replan_every_step = False
    """Plan a partition after every step from the latest `cost_factors` (not only after profiled steps): for
    schemes whose cost moves every iteration (MoE routing; DynMo fires those every iteration)."""
    uses_placement = False
    """Takes each MoE layer's rank imbalance under the expert placement the step ran (`observe_placement`)."""
    changes_outputs = False
    """`layer_forward` computes something other than the plain layer (tokens that leave or skip a block, a sparse
    attention core): a served model runs its forward through the scheme (`serve`)."""
    aux_weight = 1.0
    """The weight of the running forward's auxiliary losses in the backward, set by the pipeline engine before each
    forward: the micro-batch's share of the step (1/M, or its share of the batch's tokens under planned
    micro-batching) over the stage's ranks that sum their gradients. A scheme's own auxiliary loss enters with it,
    as the MoE layers' do, so its gradient is one mean over the batch whatever the split (micro-batches, ranks)."""

    def __init__(self, cfg: Any = None) -> None:
        self.cfg = cfg

    def serve(self, model: MoebalForCausalLM, step: int) -> str | None:
        """Serve the full `model` (built, `prepare_model` applied, weights and this scheme's job-wide `state_dict`
        loaded) as the run computed its validation after step `step`: when the scheme changes outputs, the decoder
        stack's forward becomes `served_forward` (every layer through `layer_forward`, the carry travelling as
        between stages), a `functools.partial` of a module function, so a model pickled to spawned ranks keeps it.
        Only the step is set (a scheme's own `begin_step` may draw the next densities: the loaded state already
        holds what the validation ran). Returns a line saying how the model is served (None: plainly)."""
        if not self.changes_outputs:
            return None
        Dynamism.begin_step(self, step)
        # an instance attribute: it shadows the class's forward
        model.model.forward = functools.partial(served_forward, self, model.model)  # type: ignore[method-assign]
        return self.served_as()

    def served_as(self) -> str:
        """How `serve` runs the model, in a line (for `moebal eval`)."""
        return f"through dynamism scheme {self.name}"

    def on_start(self, ctx: SchemeContext) -> None:
        """The stage exists and its optimizer too (take first snapshots here)."""

    def begin_step(self, step: int) -> None:
        """Before step `step` (1-based) runs its forwards: schedules that depend on the step update here."""
        self.step = step

    def prepare_model(self, model: MoebalForCausalLM) -> None:
        """Structural changes to the full model before it is sliced into stages (same on every rank)."""

    def prepare_layer(self, i: int, layer: nn.Module) -> None:
        """The same structural change on a freshly built skeleton of layer i (a migration receiver)."""

    def init_carry(self, B: int, T: int, device: torch.device,
                   n_B: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """The carries of a micro-batch entering the first stage; `n_B`: its rows' real tokens, as `ROW_TOKENS`
        (None: no padding)."""
        return {}

    def layer_forward(self, i: int, layer: nn.Module, h_BTD: torch.Tensor, cos_TK: torch.Tensor,
                      sin_TK: torch.Tensor, carry: dict[str, torch.Tensor]) -> torch.Tensor:
        out_BTD: torch.Tensor = layer(h_BTD, cos_TK, sin_TK)
        return out_BTD

    def splittable(self, i: int) -> bool:
        """Whether dense layer i may run as two partition units (`pipeline.split_layers`): when
        `layer_forward(i, ...)` is the plain layer and layer i has no scheme state or statistics, because the
        engine then runs the layer's halves as `attention_half` (by default the plain half) and the plain FFN
        half. A scheme that changes only a layer's attention says so here and runs that half in
        `attention_half` (`sparse_attention`)."""
        base = Dynamism  # a scheme that overrides none of these runs every layer plain and keeps nothing per layer
        return all(getattr(type(self), m) is getattr(base, m) for m in ("layer_forward", "layer_state", "stats_size"))

    def attention_half(self, i: int, layer: nn.Module, h_BTD: torch.Tensor, cos_TK: torch.Tensor,
                       sin_TK: torch.Tensor) -> torch.Tensor:
        """The attention half of split layer i (input norm, attention, residual; `splittable`): the plain half.
        `layer` holds this half at least (its other half's submodules may be None). The FFN half always runs
        plain, so `layer_forward(i)` must equal `layer.ffn_part(attention_half(i, ...))` op for op."""
        out_BTD: torch.Tensor = as_decoder(layer).attention_part(h_BTD, cos_TK, sin_TK)
        return out_BTD

    def last_pass(self, on: bool) -> None:
        """The engine's `last_pass`: `on` while the forward of the micro-batch whose backward is the stage's last
        runs (its backward reduce-scatters FSDP2's whole sums, `SchemeContext.whole_sums`)."""

    def idle_parameters(self) -> bool:
        """Whether a step may leave a parameter that trains without a gradient on every rank (a layer every token
        has left, an idle router). torch's AdamW skips such a parameter; a pipeline's `parallel.shard: optimizer`
        then keeps a step count per parameter and skips it too (`ShardedAdamW(skips=True)`), and the unsharded
        pipeline first exchanges which parameters have a gradient (`PipelineRunner._join_peers_grads`)."""
        return False

    def frozen_prefix(self) -> int:
        """Layers [0, n) are frozen (and the embedding with them when n > 0): forward only, no backward."""
        return 0

    def after_backward(self, ctx: SchemeContext) -> None:
        """Gradients of this stage exist and are not yet synchronised or clipped."""

    def after_optimizer_step(self, ctx: SchemeContext) -> None:
        """The optimizer has stepped this stage's parameters."""

    def update(self, ctx: SchemeContext) -> bool:
        """End of step: take this step's decisions; True when the model changed (a dynamism event)."""
        return False

    def stats_size(self, num_layers: int) -> int:
        """Length of the per-step statistics vector this scheme sums along the chain (0: none)."""
        return 0

    def local_stats(self) -> torch.Tensor:
        """This stage's share of the step's statistics (zeros in slots of layers it does not hold)."""
        return torch.zeros(0, dtype=torch.float64)

    def set_global_stats(self, vec: torch.Tensor) -> None:
        """The chain-summed statistics of the step (the same on every rank)."""

    def observe_placement(self, imbalance: list[float]) -> None:
        """Per layer, the busiest expert-parallel rank's computed rows over the mean under the expert placement
        the step ran (Pro-Prophet's replicas; 0 for a layer without experts), the largest over the data-parallel
        replicas, the same on every rank; called after `set_global_stats` where a replicating placement policy
        runs inside expert-parallel stages."""

    def cost_factors(self, num_layers: int) -> list[float]:
        """Predicted forward+backward time of each layer as a fraction of the same layer without dynamism."""
        return [1.0] * num_layers

    def unit_cost_factors(self, units: UnitMap) -> list[float]:
        """`cost_factors` per partition unit (`pipeline.split_layers`): each half of a split layer takes its
        layer's factor, which is exact for the layers a scheme runs plain. A scheme that splits a layer it runs
        specially (`splittable`) says here what each half costs."""
        return units.per_unit(self.cost_factors(units.num_layers))

    def layer_state(self, i: int) -> dict[str, torch.Tensor]:
        """Tensors of layer i's scheme state that must travel with the layer (same shapes on every rank)."""
        return {}

    def layer_state_spec(self, i: int, layer: nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Shapes and dtypes of `layer_state(i)`, known to a receiver that only holds the layer skeleton."""
        return {}

    def load_layer_state(self, i: int, layer: nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Install what `layer_state(i)` returned on the rank that now owns layer i (`layer`, rebuilt)."""

    def drop_layer(self, i: int) -> None:
        """Layer i left this rank."""

    def metrics(self) -> dict[str, Any]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        """The scheme's job-wide state as JSON (the same on every rank); per-layer tensors go by `layer_state`."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict` (from a checkpoint, before the held layers' `load_layer_state`)."""

    def on_resume(self, ctx: SchemeContext) -> None:
        """A checkpoint's state was loaded into this stage (job-wide state, then each held layer's): re-apply
        its effect on the live modules (frozen parameters, say)."""


def layer_token_flops(cfg: Any, i: int, seq_len: int) -> dict[str, float]:
    """Multiply-adds per token of decoder layer i, by part: "q_o" (query and output projections), "kv"
    (key/value projections), "attn" (scores and weighted sum, a causal sequence of `seq_len`: T/2 keys on
    average), "ffn" (dense SwiGLU, or the top_k experts' SwiGLU plus the router and the shared expert's SwiGLU, its
    width as `MoELayer.from_config` sets it). The schemes' cost predictions are ratios of these sums, so the unit
    does not matter."""
    m, hd = cfg.model, cfg.head_dim
    q_o = 2.0 * m.dim * m.n_heads * hd
    kv = 2.0 * m.dim * m.n_kv_heads * hd
    attn = 2.0 * (seq_len / 2.0) * m.n_heads * hd
    if cfg.is_moe_layer(i):
        ffn = cfg.moe.top_k * 3.0 * m.dim * cfg.expert_ffn_dim + m.dim * cfg.moe.num_experts
        shared = cfg.shared_expert_ffn_dim
        ffn += 3.0 * m.dim * shared + (m.dim if cfg.moe.shared_gate and shared else 0.0)
    else:
        ffn = 3.0 * m.dim * m.ffn_dim
    return {"q_o": q_o, "kv": kv, "attn": attn, "ffn": ffn}


SCHEMES: dict[str, Callable[..., Dynamism]] = {"none": Dynamism}


def register(name: str) -> Callable[[type[Dynamism]], type[Dynamism]]:
    def deco(cls: type[Dynamism]) -> type[Dynamism]:
        SCHEMES[name] = cls
        return cls

    return deco


def check_steps(scheme: str, **steps: int) -> None:
    """A scheme's step settings (`start`, `ramp_steps`) are step counts: ConfigError naming the key when one is
    negative (a negative `start` or ramp once read as 0)."""
    for key, value in steps.items():
        if int(value) < 0:
            raise ConfigError(f"dynamism.{scheme}.{key} is a step count, >= 0; got {value}")


def ramp(step: int, start: int, length: int, begin: float, end: float) -> float:
    """`begin` until `start`, then linear to `end` over `length` steps, then `end` (how a scheme sets in)."""
    if step < start:
        return begin
    if length <= 0 or step >= start + length:
        return end
    return begin + (end - begin) * (step - start) / length


def build_dynamism(name: str, options: dict[str, Any] | None = None, **context: Any) -> Dynamism:
    """The scheme `name` with its options (keyword arguments of its constructor)."""
    _load_schemes()
    if name not in SCHEMES:
        raise ConfigError(f"unknown dynamism scheme {name!r}; choose one of {', '.join(sorted(SCHEMES))}")
    try:
        return SCHEMES[name](**(options or {}), **context)
    except TypeError as e:
        raise ConfigError(f"dynamism scheme {name!r}: bad options {sorted(options or {})} ({e})") from None


def _load_schemes() -> None:
    """Import the scheme modules (each registers itself)."""
    from moebal.dynamism import early_exit, freezing, mod, moe_routing, pruning, sparse_attention  # noqa: F401


def as_decoder(layer: nn.Module) -> DecoderLayer:
    """`layer` typed as the DecoderLayer it is: models and stages keep their decoder layers in containers typed
    as plain modules (nn.ModuleList, nn.ModuleDict), and a scheme's hooks receive them from there."""
    return cast("DecoderLayer", layer)


def run_as_forward(layer: nn.Module, fn: Callable[..., torch.Tensor], *args: torch.Tensor) -> torch.Tensor:
    """`fn(*args)` computed as `layer`'s forward when `layer` is an FSDP2 unit (`parallel.shard: full`): between
    forwards its weights are shards, and only a call of the module runs FSDP2's hooks (all-gather the weights,
    register the backward's re-gather and gradient reduce-scatter, reshard), so a scheme that calls a layer's
    parts itself (token subsets, a router, a sparse attention core) runs them inside that call. `args` are what
    the layer's forward takes (FSDP2 registers its post-backward on them). A plain layer: `fn(*args)`."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(layer, FSDPModule):
        return fn(*args)
    layer.__dict__["forward"] = fn  # an instance attribute shadows the class's forward for this one call
    try:
        out: torch.Tensor = layer(*args)
    finally:
        layer.__dict__.pop("forward")
    return out
