"""The memory plan: each rank's peak memory for a config and a layout, as named terms. Pure (no torch).

A rank's peak is modelled in phases, each a sum of terms, and the plan is their maximum:

    peak = runtime + (1 + slack) * max(start-up, max(fwd/bwd, later, sync, migration) + start-up leftovers)
    state   = parameters + optimizer state + persistent gradient buffers
    fwd/bwd = state + compute-dtype weight copies + activations (saved for backward, in-flight micro-batches,
              one layer's backward working set) + logits/loss + all-to-all buffers + pipeline p2p buffers
              + Pro-Prophet replicas + FSDP2 reduce-scatter buffers (+ its whole gradient sums under
              `parallel.accumulate: whole`)
    later   = (micro-batches: a pipeline's, gradient accumulation's) fwd/bwd with the activations beside
              gradients (the micro-batches in flight after the first backward pass: the steady state's under
              1F1B and zero bubble, one fewer under GPipe or when there is none) and the accumulated gradients
              (the earlier passes', fp32: whole, or a rank's shards under `shard: full`)
    sync    = state + gradients + the gradient all-reduce's transient flat copy (or ZeRO's one-layer bucket)
    migration = state + (`shard: optimizer` with a pipeline whose layers can move) the stage's AdamW moments
              gathered whole and the rebuilt optimizer's new flats (moebal/pipeline/migrate.py); (`shard: full`)
              the moved layers' weights and moments whole, bounded by the stage's layers (dense parts;
              with ep > 1 plus every expert's moments gathered whole and the new expert flats)
    start-up = the whole model in fp32, built on every rank before it keeps its share (today's
              initialisation; `init="local"` models rank-local initialisation, which holds its share only)
    start-up leftovers = a share (the device's `startup_retained`: a CPU's malloc keeps some) of what the
              start-up built and freed

Within one backward pass activations and gradients are not added: it frees each layer's activations as it
creates that layer's gradients, so its two ends (all activations, no gradients; all gradients, no activations)
bound it. Across micro-batches they are (the later phase): the first backward pass's gradients stay while the
next micro-batches' forwards build their activations. The terms (bytes, per rank, the worst pipeline stage)
and the code they model:

- parameters: fp32 master weights of what the rank holds (dense over its stage, experts / ep); `shard: full`
  (moebal/distributed/fsdp.py) divides the dense ones by the stage's ranks and the expert-parallel experts by
  the expert-data-parallel ranks (sharded at rest: `_expert_weight_bytes`, plus one MoE layer's experts gathered,
  two with a replicating policy's block-overlapped or planned-ahead Trans; in a pipeline stage too), plus the
  weights FSDP2 gathers in `parallel.param_dtype`: the root unit's (embedding, final norm, head: gathered for the
  whole forward and backward) and two decoder layers' dense weights (current and prefetched). In a pipeline
  stage every layer, the embedding and the head is an FSDP2 root of its own, resharded after its forward: the
  shards, the expert-parallel experts' parts and gathered layer as above (ep > 1; with ep 1 they are FSDP2's),
  plus the largest unit gathered.
- FSDP2 reduce-scatter buffers: `shard: full`: a unit's backward pass holds its unsharded gradients (compute
  dtype) and FSDP2's flat reduce-scatter input (fp32) that they are copied into before they are freed, beside
  the earlier layers' activations (torch fsdp/_fully_shard/_fsdp_collectives.py `foreach_reduce`).
- compute-dtype weight copies: under bf16 autocast every matmul weight is cast once per forward and the cast
  is kept until the backward pass has used it (autocast's weight cache and the saved tensors): 2 bytes each;
  under `shard: full` too when FSDP2 gathers fp32 (`parallel.param_dtype: fp32`, the default), none when it
  gathers bf16 (nothing left to cast).
- gradients: fp32, as autograd creates them (`.grad`); `shard: optimizer|full` keeps only the shard,
  reduce-scattered layer by layer, plus full-size gradients in flight: under `full` one layer's, under
  `optimizer` two layers' (one layer's gradients waiting for their buckets, the previous layer's send buffers
  until their collective completes); the expert-parallel experts' gradients are whole until the backward pass
  and Agg are over (they are reduce-scattered after them); with a pipeline `shard: optimizer` keeps them whole
  (micro-batches accumulate them) plus one 16 MB bucket in flight.
- persistent gradient buffers: `moebal/scheduler/grads.py` (`GradSync`, expert parallelism without a pipeline)
  keeps one flat fp32 buffer of every gradient across steps; plain data parallelism (`moebal/distributed/autograd.py`
  `sum_gradients`) concatenates the gradients into one flat copy at the sync; a pipeline (a dynamism scheme's one
  stage too: `MemoryLayout.pipelined`) sums one layer's bucket at a time (`moebal/pipeline/runner.py`). With
  sharding the reduce-scatter output is the shard itself.
- optimizer state: AdamW's exp_avg and exp_avg_sq in fp32 (`moebal/train/optim.py`), divided by the shard
  degree under `shard: optimizer|full`.
- activations: per decoder layer and token, the tensors autograd saves (RMSNorm input and output, q/k after
  rotary, v, attention output and its reshaped copy, the softmax statistics; per routed row the expert's input,
  both projections, the SiLU output, their product and the expert's output; a dense MLP's four F-wide
  tensors), times the tokens of the micro-batches in flight (1F1B: stage s holds min(pp - s, M); GPipe: M).
  Recomputation keeps a part's input instead of its saved tensors (`full`: the layer's input only) and adds one
  layer's activations, rebuilt in the backward pass.
- logits/loss: the last stage's [tokens, vocab] logits, fp32 log-probabilities and their two gradients.
- all-to-all buffers: one MoE layer's dispatched rows sent and received (forward or backward), in compute dtype.
- pipeline p2p buffers: one micro-batch's boundary activations and gradients, sent and received.
- Pro-Prophet replicas: per MoE layer, the replicas a rank may hold (static: 0; broadcast_topk: k; prophet and
  fastermoe: every expert it does not own, the search's own limit: it selects at most every expert once; at
  most `planner.max_replicas`, the planner's cap), each
  with its gradient and its row of the per-step stacked weights, in the compute dtype
  (`moebal/distributed/expert_parallel.py`: `_trans_ops`, `_local_weights`).
- runtime: what a process holds before the model (CUDA context, cuBLAS and NCCL workspaces; on a CPU the
  Python interpreter, torch, gloo and the data pipeline), from the hardware profile (`memory_reserved_bytes`).
- allocator slack: the caching allocator's fragmentation, a share of everything above (`allocator_slack`); a
  CPU host's own share under `shard: full` (CPU_FULL_SHARD_SLACK).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from moebal.config import pipelined
from moebal.errors import ConfigError
from moebal.planner.sparse_blocks import SPLIT_MIN_ROWS, kept_counts, shares_masks, sparse_block_fits

if TYPE_CHECKING:
    from moebal.config import Config
    from moebal.planner.hardware import HardwareProfile

__all__ = ["CPU_RUNTIME_BYTES", "DeviceMemory", "MemoryLayout", "MemoryPlan", "RANK_LOCAL_INIT",
           "SHARDS", "RECOMPUTES", "choose_shard", "fit_layout", "plan_memory", "refusal_line"]

SHARDS = ("none", "optimizer", "full")
RECOMPUTES = ("none", "moe", "attention", "full")
SCHEDULES = ("1f1b", "gpipe", "zb")
RANK_LOCAL_INIT = True
"""Whether `moebal train` builds only what a rank holds (moebal/models/local_init.py: expert-parallel ranks their
experts, pipeline stages their layers). False would model every rank building the whole fp32 model first."""

CPU_RUNTIME_BYTES = 359e6
"""A CPU rank's resident memory before its model: Python, torch, gloo, the byte corpus (its first 2 MB in the
runs) and the training loop's own buffers. Fitted on separate runs (`python scripts/bench_memory.py
--fit-baseline`: the median peak RSS of 4 gloo ranks training two 0.1M-parameter models, ep 4 and dp 4, minus
their model terms, which are below 10 MB; docs/memory.md)."""
CPU_STARTUP_RETAINED = 0.044
"""Share of the start-up's freed bytes that stays resident on a CPU host: glibc malloc raises its mmap threshold
when the whole model's large tensors are freed, so later tensors below it come from heap pages that are not
returned. Fitted with CPU_ALLOCATOR_SLACK (below)."""
CPU_ALLOCATOR_SLACK = 0.216
"""A CPU host's allocator slack: freed heap blocks that stay resident, a share of the modelled bytes. Fitted with
CPU_STARTUP_RETAINED by least squares over every rank of three calibration runs (`scripts/bench_memory.py
--fit-baseline`: a d 384, 3-layer, 8-expert model, not the validation's, trained as ep 4, dp 4 and pp 2 x dp 2 on
4 gloo ranks; docs/memory.md)."""
CPU_FULL_SHARD_SLACK = 0.254
"""A CPU host's allocator slack under `parallel.shard: full` (FSDP2). Fitted by least squares over the 4 ranks of
one calibration run of the calibration model as dp 4 with `shard: full` (`scripts/bench_memory.py
--fit-full-slack`; not the validation's model), with the runtime and start-up constants above; docs/memory.md."""

_STATE = ("parameters", "optimizer state", "persistent gradient buffers")
PHASE_TERMS = {
    "forward/backward": (*_STATE, "compute-dtype weight copies", "activations", "logits/loss", "all-to-all buffers",
                         "pipeline p2p buffers", "replicas (Pro-Prophet)", "Agg receive buffers (Pro-Prophet)",
                         "FSDP2 reduce-scatter buffers",
                         "whole gradient sums (FSDP2)"),
    "later micro-batches": (*_STATE, "compute-dtype weight copies", "activations beside gradients",
                            "accumulated gradients", "logits/loss", "all-to-all buffers", "pipeline p2p buffers",
                            "replicas (Pro-Prophet)", "Agg receive buffers (Pro-Prophet)",
                            "FSDP2 reduce-scatter buffers", "whole gradient sums (FSDP2)"),
    "gradient sync": (*_STATE, "gradients", "gradient all-reduce copy", "tied head gradient (full)",
                      "replicas (Pro-Prophet)"),
    "migration": (*_STATE, "migration: whole moments + new flats", "migration: moved layers whole"),
    "start-up": ("start-up (whole model built)",),
}
"""The terms each phase adds up."""
_SHARD_BUCKET_ELEMS = 1 << 22
"""`shard: optimizer`'s reduce-scatter bucket (moebal/distributed/sharded.py DEFAULT_BUCKET_ELEMS): one send buffer
of it is in flight beside a pipeline's whole gradients."""
_SHARD_COST = {"none": 0.0, "optimizer": 0.02, "full": 0.1}
_PARAM_DTYPE_COST = 0.01
"""What --fit prices FSDP2 gathering bf16 weights at where the configuration gathers fp32 (`overhead`)."""
_HOLD_COST = 0.05
"""What --fit prices giving up one of FSDP2's holds at (`overhead`)."""
_RECOMPUTE_COST = {"none": 0.0, "attention": 0.1, "moe": 0.2, "full": 0.33}
_TERM_SETTING = {
    "optimizer state": "parallel.shard=optimizer", "gradients": "parallel.shard=optimizer",
    "persistent gradient buffers": "parallel.shard=optimizer", "parameters": "parallel.shard=full",
    "compute-dtype weight copies": "parallel.shard=full", "activations": "train.recompute=full",
    "logits/loss": "a smaller data.batch_size (or train.grad_accum above 8)",
    "whole gradient sums (FSDP2)": "parallel.accumulate=sharded",
    "accumulated gradients": "parallel.shard=full",
    "replicas (Pro-Prophet)": "planner.max_replicas=1 (or planner.policy=static)",
    "Agg receive buffers (Pro-Prophet)": "planner.policy=static",
    "migration: whole moments + new flats": "pipeline.rebalance=off",
    "migration: moved layers whole": "pipeline.rebalance=off",
}


@dataclass(frozen=True, kw_only=True)
class DeviceMemory:
    """What one rank may use: its device's capacity, what the runtime takes first, the allocator's slack."""

    name: str
    capacity_bytes: float
    runtime_bytes: float
    slack: float
    startup_retained: float = 0.0
    """Share of what the start-up built and freed that stays resident (a CPU host's malloc keeps freed heap
    pages once the whole model's large frees have raised its mmap threshold; a GPU's caching allocator reuses
    them: 0)."""
    full_shard_slack: float | None = None
    """The allocator slack under `shard: full`, where it differs from `slack` (None: the same). A CPU host's
    malloc keeps more freed heap under FSDP2, which allocates and frees every unit's unsharded weights and
    gradients in each forward and backward pass between longer-lived tensors (CPU_FULL_SHARD_SLACK)."""
    cuda: bool = False
    """A CUDA device: fp32 grouped-query attention there expands keys and values to every query head before
    SDPA (moebal.models.transformer.expand_kv_heads), so they are saved at H heads, not G."""

    @classmethod
    def from_profile(cls, p: HardwareProfile, ranks: int = 1) -> DeviceMemory:
        """One rank's device of profile `p` in a job of `ranks` ranks. A GPU profile's device is a GPU. A CPU
        profile's (`moebal calibrate` writes one) is a process: the node's ranks share its RAM (`memory_bytes`),
        with the fitted CPU constants, as `cpu`."""
        if p.device == "cpu":
            host = cls.cpu(p.memory_bytes, min(max(ranks, 1), p.gpus_per_node))
            return dataclasses.replace(host, name=f"{p.name} (cpu): {host.name}")
        return cls(name=f"{p.name} ({p.device or 'device'})", capacity_bytes=p.memory_bytes,
                   runtime_bytes=p.memory_reserved_bytes, slack=p.allocator_slack, cuda=True)

    @classmethod
    def cpu(cls, ram_bytes: float, local_ranks: int) -> DeviceMemory:
        """A CPU host's RAM shared by `local_ranks` ranks, with the fitted CPU constants."""
        return cls(name=f"CPU host RAM / {local_ranks} rank(s)", capacity_bytes=ram_bytes / max(local_ranks, 1),
                   runtime_bytes=CPU_RUNTIME_BYTES, slack=CPU_ALLOCATOR_SLACK, startup_retained=CPU_STARTUP_RETAINED,
                   full_shard_slack=CPU_FULL_SHARD_SLACK)

    def slack_for(self, shard: str) -> float:
        """The allocator slack of a layout with this `shard` setting."""
        return self.full_shard_slack if shard == "full" and self.full_shard_slack is not None else self.slack


@dataclass(frozen=True, kw_only=True)
class MemoryLayout:
    """A parallel layout and the settings that change memory."""

    ranks: int
    pp: int = 1
    ep: int = 1
    shard: str = "none"
    recompute: str = "none"
    micro_batches: int = 1
    """Micro-batches per iteration: a pipeline's (`pipelined`), else `train.grad_accum` (gradient accumulation)."""
    scheme: str = "none"
    """`dynamism.scheme`: with a scheme, one stage trains on the pipeline engine too (`Config.pipelined`)."""
    accumulate: str = "sharded"
    """`parallel.accumulate`: whole (with `shard: full` and micro-batches, a pipeline's or accumulation's) holds
    every FSDP2 gradient of the stage whole between the micro-batches."""
    reshard: str = "micro_batch"
    """`parallel.reshard`: step (with `shard: full`) keeps every FSDP2 unit's weights gathered through the step."""
    schedule: str = "1f1b"
    precision: str = "fp32"
    """fp32, or bf16 (autocast over fp32 master weights)."""
    policy: str = "static"
    """Expert placement policy: how many replicas a rank may hold."""
    max_replicas: int | None = None
    """A cap on the replicas a rank receives per MoE layer, below the config's `planner.max_replicas` (what --fit
    proposes instead of giving up the policy); None: the config's cap alone."""
    init: str = "full"
    """full: every rank builds the whole model first (today); local: rank-local initialisation."""
    routing_skew: float = 1.0
    """Busiest rank's routed rows / the mean (1: balanced); multiplies the expert activations and buffers."""
    param_dtype: str = "fp32"
    """`parallel.param_dtype`: under `shard: optimizer`, bf16 keeps the weights in bf16 and
    their fp32 masters sharded (moebal/distributed/sharded.py, "Compute copies"; expert-parallel ones where more
    than one rank holds each expert shard); under `full` the same for the expert-parallel experts (FSDP2 gathers
    the dense ones in it)."""

    @property
    def stage_ranks(self) -> int:
        return self.ranks // self.pp

    @property
    def edp(self) -> int:
        """Expert-data-parallel ranks: copies of one expert shard in a stage."""
        return self.stage_ranks // self.ep

    @property
    def pipelined(self) -> bool:
        """Whether the layout trains on the pipeline engine (several stages, or a dynamism scheme's one stage)."""
        return pipelined(self.pp, self.scheme)

    def describe(self) -> str:
        mb = (f" M={self.micro_batches} {self.schedule}" if self.pipelined else
              f" accum={self.micro_batches}" if self.micro_batches > 1 else "")
        weights = " bf16-weights" if self.bf16_copies or (self.shard == "full" and self.param_dtype == "bf16") else ""
        if self.shard == "full" and self.micro_batches > 1 and self.accumulate == "whole":
            mb += " whole-sums"
        if self.shard == "full" and self.reshard == "step":
            mb += " gathered-per-step"
        if self.max_replicas is not None and self.policy != "static":
            mb += f" max_replicas={self.max_replicas}"
        return (f"{self.ranks} ranks pp={self.pp} ep={self.ep} dp={self.edp}{mb} shard={self.shard}{weights} "
                f"recompute={self.recompute} {self.precision}")

    @property
    def bf16_copies(self) -> bool:
        """bf16 compute copies with fp32 masters sharded (`param_dtype`)."""
        return self.shard == "optimizer" and self.param_dtype == "bf16"

    @property
    def bf16_experts(self) -> bool:
        """Expert-parallel experts kept as bf16 compute copies of fp32 masters split over "dp" (`param_dtype` bf16,
        more than one rank per expert shard)."""
        return self.shard in ("optimizer", "full") and self.param_dtype == "bf16" and self.ep > 1 and self.edp > 1

    def settings(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True, kw_only=True)
class MemoryPlan:
    """Per-rank peak memory of the worst stage, by term, and the verdict."""

    layout: MemoryLayout
    device: DeviceMemory
    terms: dict[str, float]
    """Every term in bytes (the worst stage's)."""
    phases: dict[str, float]
    """Bytes of each phase before runtime and slack: state + fwd/bwd, state + sync, start-up."""
    peak_bytes: float
    stage: int
    """The stage whose peak is the largest (0 without a pipeline)."""
    stage_peaks: tuple[float, ...] = field(default=())
    stage_train: tuple[float, ...] = field(default=())
    """Per stage: its largest training phase (bytes, before runtime and slack)."""
    stage_freed: tuple[float, ...] = field(default=())
    """Per stage: what its start-up built and freed (bytes)."""

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.device.capacity_bytes

    @property
    def largest_term(self) -> tuple[str, float]:
        """The largest term of the phase that sets the peak."""
        phase = max(self.phases, key=lambda k: self.phases[k])
        name = max(PHASE_TERMS[phase], key=lambda k: self.terms[k])
        return name, self.terms[name]

    def to_dict(self) -> dict[str, Any]:
        return {"layout": self.layout.settings(), "device": dataclasses.asdict(self.device),
                "terms": {k: round(v) for k, v in self.terms.items()},
                "phases": {k: round(v) for k, v in self.phases.items()}, "peak_bytes": round(self.peak_bytes),
                "capacity_bytes": round(self.device.capacity_bytes), "fits": self.fits, "stage": self.stage,
                "stage_peaks": [round(x) for x in self.stage_peaks], "largest_term": self.largest_term[0]}


# ---- the model's sizes ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Layer:
    dense: int
    """Parameters replicated over the stage (attention, norms, router, shared expert, dense MLP)."""
    expert: int
    """Parameters of all routed experts of the layer (0: dense layer)."""
    matmul: int
    """Parameters used as matmul weights (cast to the compute dtype under autocast)."""
    moe: bool


def _layers(cfg: Config) -> list[_Layer]:
    from moebal.planner.cost import ModelShape

    shape = ModelShape.from_config(cfg)
    return [_layer(cfg, shape, i) for i in range(cfg.model.n_layers)]


def _layer(cfg: Config, s: Any, i: int) -> _Layer:
    D, moe = s.dim, cfg.moe
    attn = s.attn_params
    if not cfg.is_moe_layer(i):
        return _Layer(attn + s.dense_mlp_params, 0, attn - 2 * D + s.dense_mlp_params, False)
    shared_f = cfg.shared_expert_ffn_dim
    extra = 3 * D * shared_f + (D if moe.shared_gate else 0) + (D * moe.num_experts if moe.router_noise is not None
                                                                 else 0)
    dense = attn + s.router_params + extra
    expert = moe.num_experts * s.expert_params
    return _Layer(dense, expert, dense - 2 * D + expert, True)


def _stage_layers(n_layers: int, pp: int) -> list[range]:
    """Equal layer counts, the remainder on the first stages (moebal.planner.partition.partition_uniform)."""
    base, extra = divmod(n_layers, pp)
    out, start = [], 0
    for s in range(pp):
        n = base + (1 if s < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


def _norm_bytes(D: int, a: int) -> int:
    """Bytes an RMSNorm over D keeps per token: its input and output, and in fp32 also the normalised copy its
    weight's gradient reads and the reciprocal root (measured on a CPU: counting two of the four left fp32 layers
    7-10 % under)."""
    return 4 * 2 * D + (4 * D + 4 if a == 4 else 0)


def _act_per_token(cfg: Config, moe_layer: bool, a: int, skew: float, expand_kv: bool,
                   cuda: bool = True) -> tuple[float, float]:
    """(attention part, FFN part) bytes saved for backward per token of one decoder layer; `expand_kv`: keys and
    values are saved at every query head (fp32 grouped-query attention on CUDA); `cuda`: the attention core of
    multi-head latent attention is a fused kernel (elsewhere its q/k and v head widths differ, so SDPA takes the
    math path, which keeps the [H, T, T] probabilities)."""
    # the residual stream stays fp32 (fp32 embeddings, fp32 + bf16 sums); bf16 under parallel.param_dtype bf16
    # (a bf16 embedding copy), where counting it at fp32 errs high
    m = cfg.model
    D, H, G, hd = m.dim, m.n_heads, m.n_kv_heads, cfg.head_dim
    norm = _norm_bytes(D, a)
    extra = 0.0
    if m.mla is not None:
        q = H * (m.mla.qk_nope_head_dim + m.mla.qk_rope_head_dim)
        kv, o = q + H * m.mla.v_head_dim, H * m.mla.v_head_dim
        # the latent and its norm (and the query's low-rank path), fp32 norms
        extra = _norm_bytes(m.mla.kv_lora_rank, 4) + (_norm_bytes(m.mla.q_lora_rank, 4) if m.mla.q_lora_rank else 0)
        if not cuda:
            extra += 4 * H * cfg.data.seq_len  # the math path's probabilities, per query row
    else:
        q, kv, o = H * hd, 2 * (H if expand_kv else G) * hd, H * hd
        if m.qk_norm != "none":  # the query and key norms: their fp32 input and normalised copy, and the roots
            extra = 2 * 4 * (H + G) * hd + 4 * ((H + G) if m.qk_norm == "head" else 2)
    casts = 3 * a * D if a == 2 else 0  # autocast casts the norm output once per projection
    attn = norm + casts + a * (q + kv + 2 * o) + 4 * H + extra
    ffn_cast = a * D if a == 2 else 0
    if not moe_layer:
        return attn, norm + ffn_cast + a * 4 * m.ffn_dim
    moe, F = cfg.moe, cfg.expert_ffn_dim
    routed = moe.top_k * skew * (a * (2 * D + 4 * F) + 3 * 8)  # rows: x, h1, h3, silu, product, output; indices
    shared_f = cfg.shared_expert_ffn_dim
    return attn, norm + ffn_cast + 4 * 3 * moe.num_experts + routed + a * 4 * shared_f


def _moe_kept_without_replay(cfg: Config, a: int, skew: float) -> float:
    """Bytes per token an expert-parallel MoE block keeps under `recompute: moe|full`: it is never replayed whole
    (its all-to-alls; moebal/models/recompute.py), only its expert GEMMs are checkpointed, so the FFN norm, the
    router's probabilities and the routed rows stay, each row's input and output counted on both sides of the
    exchange (sent and received), with its indices and weight."""
    moe, D = cfg.moe, cfg.model.dim
    ffn_cast = a * D if a == 2 else 0
    return _norm_bytes(D, a) + ffn_cast + 4 * 3 * moe.num_experts + moe.top_k * skew * (4 * a * D + 3 * 8)


def _layer_acts(cfg: Config, i: int, a: int, skew: float, recompute: str, expand_kv: bool,
                sparse: float = 0.0, ep: int = 1, cuda: bool = True) -> tuple[float, float]:
    """(kept across the forward pass, full) activation bytes per token of layer i under `recompute`; `sparse`: what
    a block-sparse attention core keeps beyond the dense one (`sparse_core_extra`), part of the attention region;
    `ep` > 1: its MoE block is expert-parallel, never replayed whole (`_moe_kept_without_replay`)."""
    attn, ffn = _act_per_token(cfg, cfg.is_moe_layer(i), a, skew, expand_kv, cuda)
    attn += sparse
    inp = 4 * cfg.model.dim
    if ep > 1 and cfg.is_moe_layer(i) and recompute in ("moe", "full"):
        ffn_kept = _moe_kept_without_replay(cfg, a, skew)
        kept = attn + ffn_kept if recompute == "moe" else inp + ffn_kept
    else:
        kept = {"none": attn + ffn, "attention": inp + ffn, "moe": attn + inp, "full": inp}[recompute]
    return kept, attn + ffn


def sparse_core_extra(cfg: Config, a: int, cuda: bool) -> float:
    """Bytes per token that dynamic sparse attention's core (`dynamism.scheme: sparse_attention`,
    moebal/kernels/sparse_attention.py) keeps for the backward pass beyond the dense core's, at its densest sparse
    step: `max_density`, or just below 1 where that is 1 (the sparse path with every causal block kept), one row
    per micro-batch (the masked path's masks are per call: more rows share them, so this bounds them from above).

    From the kernel's saved tensors, c_n the kept key blocks of query block n, b the block, K the head dim, ac the
    core's bytes per element (fp32 under CPU autocast, the run's otherwise); per row:
    - flex path (CUDA): FlexAttention keeps what a fused dense core keeps (q, k, v, output, log-sum-exp) and the
      block mask: three [H, N, N] int32 tables (the diagonal one serves both directions), three [H, N] counts and
      the [G, N, N] bool grid of kept blocks.
      Measured on an H200 at 4,096 tokens x 2 rows, 16 / 4 heads of 64, density 0.5: activation peak over a
      forward and backward 41 MB against 105 MB for the dense flash call (docs/gpu.md), so nothing beyond the
      dense core's is planned but the tables;
    - masked path (CPU below `SPLIT_MIN_ROWS` folded rows): the gathered key and value blocks
      2 G sum(c_n) b K ac, the call's one [b, max(c_n) b] additive mask (every run's mask a view of it; where
      b ac is not a multiple of 16 bytes, a [b, c b] mask per run), the block-major query copy H T K ac; the
      input keys and values are not kept (the gather's backward needs its indices only);
    - split path (CPU): the gathered off-diagonal blocks 2 G sum(c_n - 1) b K ac, the block-major diagonal keys
      and values 2 G T K ac and the folded query copy H T K ac, in place of the input keys and values.
    Checked against the saved tensors measured on a CPU (tests/unit/test_memory_plan.py)."""
    if cfg.dynamism.scheme != "sparse_attention":
        return 0.0
    sa, m = cfg.dynamism.sparse_attention, cfg.model
    T, b = cfg.data.seq_len, sa.block
    if not sparse_block_fits(T, b):
        return 0.0  # no sparse core: the scheme refuses this block when it is built (sparse_block_advice)
    H, G, K = m.n_heads, m.n_kv_heads, cfg.head_dim
    N = T // b
    counts = kept_counts(N, sa.max_density if sa.max_density < 1 else 1.0 - 1e-9)
    ac = 4 if (not cuda and a == 2) else a
    q_copy, kv_in = H * T * K * ac, 2 * G * T * K * ac
    if cuda:
        return (3 * 4 * H * N * N + 3 * 4 * H * N + G * N * N) / T
    if (H // G) * b < SPLIT_MIN_ROWS:
        if max(counts) == 1:
            masks = 0
        elif shares_masks(b, ac):  # one mask per call, every run's a view of it
            masks = b * max(counts) * b * ac
        else:  # a mask per run
            masks = sum(b * c * b * ac for c in set(counts) if c > 1)
        extra = 2 * G * sum(counts) * b * K * ac + masks + q_copy - kv_in
    else:
        extra = 2 * G * (sum(counts) - N) * b * K * ac + q_copy
    return extra / T


# ---- the plan ---------------------------------------------------------------------------------------------------
def _check_layout(cfg: Config, lay: MemoryLayout) -> None:
    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise ConfigError(msg)

    E = cfg.moe.num_experts
    need(lay.ranks >= 1 and lay.pp >= 1 and lay.ep >= 1 and lay.micro_batches >= 1,
         f"ranks, pp, ep and micro-batches must be >= 1; got {lay.describe()}")
    need(lay.ranks % lay.pp == 0, f"{lay.ranks} ranks do not split into {lay.pp} pipeline stages: use a multiple")
    need(lay.pp <= cfg.model.n_layers, f"pp={lay.pp} stages for {cfg.model.n_layers} layers: a stage needs a layer")
    need(lay.stage_ranks % lay.ep == 0, f"ep={lay.ep} must divide the {lay.stage_ranks} ranks of a stage")
    need(lay.ep == 1 or (E > 0 and E % lay.ep == 0), f"ep={lay.ep} must divide moe.num_experts ({E})")
    need(lay.shard in SHARDS, f"shard must be one of {', '.join(SHARDS)}; got {lay.shard!r}")
    need(lay.recompute in RECOMPUTES, f"recompute must be one of {', '.join(RECOMPUTES)}; got {lay.recompute!r}")
    need(lay.schedule in SCHEDULES, f"schedule must be one of {', '.join(SCHEDULES)}; got {lay.schedule!r}")
    need(lay.precision in ("fp32", "bf16"), f"precision must be fp32 or bf16; got {lay.precision!r}")
    need(lay.init in ("full", "local"), f"init must be full or local; got {lay.init!r}")
    need(cfg.data.batch_size % lay.stage_ranks == 0,
         f"data.batch_size ({cfg.data.batch_size}) is not divisible by the {lay.stage_ranks} ranks of a stage")
    rows = cfg.data.batch_size // lay.stage_ranks
    cut = lay.pipelined  # a pipeline's micro-batches may differ by a row; accumulation's may not
    need(lay.micro_batches <= rows and (cut or rows % lay.micro_batches == 0),
         f"{lay.micro_batches} micro-batches of {rows} rows per rank: use at most {rows}"
         + ("" if cut else ", a divisor of it"))


def _replicas(cfg: Config, lay: MemoryLayout) -> int:
    """Most replicas one rank may hold per MoE layer under the placement policy (the planner's own limit), at
    most `planner.max_replicas` and the layout's own cap (`MemoryLayout.max_replicas`)."""
    E = cfg.moe.num_experts
    if lay.ep == 1 or E == 0 or lay.policy == "static":
        return 0
    others = E - E // lay.ep
    bound = min(2, others) if lay.policy == "broadcast_topk" else others
    return min([bound, *(c for c in (cfg.planner.max_replicas, lay.max_replicas) if c is not None)])


def _stage_terms(cfg: Config, all_specs: list[_Layer], lay: MemoryLayout, s: int, layers: range, cuda: bool
                 ) -> tuple[dict[str, float], dict[str, float]]:
    """The terms of one stage's ranks and their phases (before runtime and slack)."""
    a = 2 if lay.precision == "bf16" else 4
    m, D, V = cfg.model, cfg.model.dim, cfg.model.vocab_size
    specs = [all_specs[i] for i in layers]
    first, last = s == 0, s == lay.pp - 1
    # tied embeddings across stages: the last stage's head is a copy of the embedding, fp32 weights and a whole
    # fp32 gradient, which the first stage's optimizer steps: no moments, no master, no shard; a fully sharded
    # one-stage pipeline's head too (FSDP2 shards its embedding and head apart: moebal/pipeline/tied.py)
    one_stage_copy = first and lay.shard == "full" and lay.pipelined and lay.ranks > 1
    tied_copy = V * D if m.tie_embeddings and last and (not first or one_stage_copy) else 0
    shared_head = m.tie_embeddings and first and not tied_copy  # the head's weight is the embedding's tensor
    dense = sum(x.dense for x in specs) + (V * D if first else 0) + ((D + (0 if shared_head else V * D)) if last
                                                                     else 0)
    expert = sum(x.expert for x in specs) // lay.ep
    # the LM head's weight is a matmul's whether tied or not: autocast keeps its bf16 cast for the backward
    matmul = sum(x.matmul for x in specs) + (V * D if last else 0)
    held = dense + expert
    d_dense, d_expert = lay.stage_ranks, lay.edp
    sharded = (dense - tied_copy) / d_dense + expert / d_expert
    biggest = max((x.dense + x.expert / lay.ep for x in specs), default=0.0)
    t: dict[str, float] = {}
    # full: FSDP2 shards what expert parallelism does not split (with ep 1 the experts too); expert-parallel
    # experts stay whole (replicated over their expert-data-parallel ranks) until Agg has run
    fsdp_ep1 = lay.ep == 1
    whole = 0.0 if fsdp_ep1 else expert
    fsdp = dense + expert - whole
    pa = 2 if lay.param_dtype == "bf16" else 4  # FSDP2 gathers its units in parallel.param_dtype, whatever autocast
    if lay.shard == "full" and lay.pipelined:  # in a stage every layer, the embedding and the head are FSDP2 roots
        # (a tied head copy is none: whole fp32 on every rank of the last stage)
        gathered = [x.dense + (x.expert if fsdp_ep1 else 0) for x in specs] + [V * D] * (first + (last and
                                                                                          not tied_copy))
        held_whole = sum(gathered) if lay.reshard == "step" else max(gathered, default=0.0)  # or one at a time
        t["parameters"] = (4 * (fsdp - tied_copy) / d_dense + 4 * tied_copy
                           + _expert_weight_bytes(cfg, lay, specs, whole) + held_whole * pa)
        unit = max(gathered, default=0.0)
    elif lay.shard == "full":  # the shards, the experts (at rest: parts), the root unit and two layers gathered
        root = dense - sum(x.dense for x in specs)
        layer_units = [x.dense + (x.expert if fsdp_ep1 else 0) for x in specs]
        unit = max(layer_units, default=0.0)
        gathered_layers = sum(layer_units) if lay.reshard == "step" else 2 * unit  # every layer, or two at a time
        t["parameters"] = (4 * fsdp / d_dense + _expert_weight_bytes(cfg, lay, specs, whole)
                           + (root + gathered_layers) * pa)
    elif lay.bf16_copies:  # bf16 copies, their fp32 masters sharded (dense over the stage, experts over "dp")
        copies = dense - tied_copy + (expert if lay.ep == 1 else 0)
        copies_e = expert if lay.bf16_experts else 0.0
        t["parameters"] = (2.0 * (copies + copies_e) + 4.0 * (held - copies - copies_e) + 4.0 * copies / d_dense
                           + 4.0 * copies_e / d_expert)
        unit = 0.0
    else:
        t["parameters"], unit = 4.0 * held, 0.0
    # full: FSDP2's post-backward of a unit holds its unsharded gradients (compute dtype) and the reduce-scatter's
    # flat input they are copied into (fp32, parallel.reduce_dtype's default) at once, while the earlier layers'
    # activations are still held (torch fsdp/_fully_shard/_fsdp_collectives.py foreach_reduce frees the gradients
    # only after the copy-in); measured on CPU: docs/memory.md, "Where a fully sharded CPU rank's memory goes"
    t["FSDP2 reduce-scatter buffers"] = (pa + 4) * unit if lay.shard == "full" else 0.0
    # parallel.accumulate whole: FSDP2 adds each unit's gradients up whole, in reduce_dtype, from the first
    # micro-batch's backward to the last one's reduce-scatter, beside the later micro-batches' activations
    # (torch fsdp/_fully_shard/_fsdp_param.py `to_accumulated_grad_if_needed`)
    r = 2 if cfg.parallel.reduce_dtype == "bf16" else 4
    t["whole gradient sums (FSDP2)"] = (r * fsdp if lay.shard == "full" and lay.micro_batches > 1
                                        and lay.accumulate == "whole" else 0.0)
    # autocast's bf16 cast of every matmul weight the rank computes with (the expert-parallel experts at its share),
    # kept for the backward pass
    every_cast = 2.0 * (matmul - (sum(x.expert for x in specs) - expert))
    if a == 4:
        t["compute-dtype weight copies"] = 0.0
    elif lay.bf16_copies:  # autocast casts only the fp32 expert-parallel experts (and a tied head copy)
        t["compute-dtype weight copies"] = 2.0 * ((expert if lay.ep > 1 and not lay.bf16_experts else 0) + tied_copy)
    elif lay.shard == "full" and pa == 2:  # FSDP2 gathers bf16: nothing left to cast but a tied head copy (no unit)
        t["compute-dtype weight copies"] = 2.0 * tied_copy
    else:  # fp32 weights (none, optimizer, or full gathering fp32, its default): every layer's cast
        t["compute-dtype weight copies"] = every_cast
    t["optimizer state"] = 8.0 * (held - tied_copy if lay.shard == "none" else sharded)
    # optimizer and full keep each rank's part of the sharded gradients, and expert-parallel experts' gradients
    # whole until Agg (their buckets go out after it, in `reduce`)
    grads_kept = (fsdp - tied_copy) / d_dense + whole + tied_copy
    # optimizer (moebal/distributed/sharded.py): buckets go out in one order, by the position of their last
    # gradient, so a layer's full-size gradients wait until its last one has arrived (one layer), while the
    # previous layer's send buffers are held until their collective reports completion, polled in the hooks
    # (one more layer when a layer's reduction takes no longer than a layer's backward pass): two layers of the
    # flats the backward pass sends (the expert-parallel experts' are counted whole above)
    in_flight = 2 * max((x.dense + (x.expert if fsdp_ep1 else 0) for x in specs), default=0.0) \
        if lay.shard == "optimizer" else biggest
    t["gradients"] = 4.0 * held if lay.shard == "none" else 4 * grads_kept + 4 * in_flight
    if lay.shard == "optimizer" and lay.micro_batches > 1:  # micro-batches accumulate whole gradients; then one
        # bucket out
        t["gradients"] = 4.0 * held + 4.0 * min(held, _SHARD_BUCKET_ELEMS)
    # a pipeline's migration gathers a sharded stage's AdamW moments whole, and the rebuilt optimizer's new flats
    # (a copy of the stage's weights) exist beside the old ones until it returns (moebal/pipeline/migrate.py)
    moves = lay.pp > 1 and (cfg.pipeline.rebalance != "off" or cfg.pipeline.repack)
    t["migration: whole moments + new flats"] = 12.0 * (held - tied_copy) if lay.shard == "optimizer" and moves else 0.0
    # `full`: the layers that leave a stage are gathered whole (weights and moments) and arrive whole; bounded by
    # the stage's own layers whole beside its shards (moebal/distributed/fsdp.py StageShardedAdamW.full_state)
    t["migration: moved layers whole"] = (12.0 * (sum(x.dense for x in specs) + expert)
                                          if lay.shard == "full" and moves else 0.0)
    grad_sync = lay.stage_ranks > 1 or lay.ep > 1
    persistent = lay.shard == "none" and not lay.pipelined and lay.ep > 1 and cfg.moe.num_experts > 0
    t["persistent gradient buffers"] = 4.0 * held if persistent else 0.0
    # micro-batches (a pipeline's, gradient accumulation's): the gradients of the first backward pass stay beside
    # the later micro-batches' activations (`_activations`: "activations beside gradients"): fp32 and whole
    # (none; optimizer's fp32 sums of the passes), a rank's reduce-scattered shards (full, accumulate sharded:
    # FSDP2 adds each pass's into .grad) or the FSDP2 units' whole sums ("whole gradient sums (FSDP2)") with the
    # expert-parallel experts' and a tied head copy's whole
    if lay.micro_batches == 1:  # (GradSync's persistent buffers take the last pass's sums only: not these)
        accumulated = 0.0
    elif lay.shard == "full":
        accumulated = 4.0 * grads_kept if lay.accumulate == "sharded" else 4.0 * (whole + tied_copy)
    else:
        accumulated = 4.0 * held
    t["accumulated gradients"] = accumulated
    transient = 0.0
    if lay.shard == "none" and grad_sync and not persistent:
        transient = 4.0 * (biggest if lay.pipelined else held)  # a pipeline's per-layer bucket; DP's flat copy
    t["gradient all-reduce copy"] = transient
    # tied embeddings across stages under `full`: after the backward pass the first stage receives the head's
    # whole fp32 gradient and reduce-scatters it into the embedding's shards through a zero-padded copy and the
    # concatenated send buffer, both in reduce_dtype (moebal/pipeline/tied.py sum_grads, DeferredGradReducer);
    # after the step it gathers the stepped weight whole (fp32, the all-gather's padded output): 4 + 2r >= 8
    # bytes per element bounds both
    tied_full = m.tie_embeddings and first and (not last or tied_copy > 0) and lay.shard == "full" and lay.pipelined
    t["tied head gradient (full)"] = (4 + 2 * r) * V * D if tied_full else 0.0
    _activations(cfg, lay, s, layers, a, t, expand_kv=cuda and a == 4, cuda=cuda)
    t["start-up (whole model built)"] = (4.0 * _total_params(cfg, all_specs) + 4.0 * expert * (lay.ep > 1)
                                         if lay.init == "full" else 4.0 * held)
    return t, {phase: sum(t[k] for k in names) for phase, names in PHASE_TERMS.items()}


def _activations(cfg: Config, lay: MemoryLayout, s: int, layers: range, a: int, t: dict[str, float], *,
                 expand_kv: bool, cuda: bool = False) -> None:
    """Activation, logits, buffer and replica terms of stage s (added to `t`)."""
    m, D = cfg.model, cfg.model.dim
    rows = cfg.data.batch_size // lay.stage_ranks
    M = lay.micro_batches  # a pipeline's, or gradient accumulation's (one micro-batch's activations at a time)
    tok = rows * cfg.data.seq_len / M
    inflight = 1 if not lay.pipelined else M if lay.schedule == "gpipe" else min(lay.pp - s, M)
    sparse = sparse_core_extra(cfg, a, cuda)
    kept_full = [_layer_acts(cfg, i, a, lay.routing_skew, lay.recompute, expand_kv, sparse, lay.ep, cuda)
                 for i in layers]
    kept = sum(k for k, _ in kept_full) + (8 if s == 0 else 0) + (_norm_bytes(D, a) if s == lay.pp - 1 else 0)
    one_layer = max((f for _, f in kept_full), default=0.0)
    t["activations"] = tok * (inflight * kept + one_layer)
    # after a stage's (or an accumulating rank's) first backward pass, beside the gradients: under 1F1B and zero
    # bubble the steady state's forwards keep the micro-batches in flight when there are more than in flight, else
    # one fewer is left; GPipe's backward passes come after every forward (one fewer); gradient accumulation runs
    # its micro-batches one at a time (the next one's)
    if M == 1:
        later = 0
    elif not lay.pipelined:
        later = 1
    elif lay.schedule != "gpipe" and lay.pp - s < M:
        later = inflight
    else:
        later = inflight - 1
    t["activations beside gradients"] = tok * (later * kept + one_layer) if M > 1 else 0.0
    logit = (4 + 4 + 4 + 4) if a == 4 else (2 + 4 + 4 + 4)
    t["logits/loss"] = tok * m.vocab_size * logit if s == lay.pp - 1 else 0.0
    moe_here = any(cfg.is_moe_layer(i) for i in layers)
    t["all-to-all buffers"] = (2 * tok * cfg.moe.top_k * lay.routing_skew * D * a
                               if lay.ep > 1 and moe_here else 0.0)
    t["pipeline p2p buffers"] = 2 * 2 * tok * D * 4 if lay.pp > 1 else 0.0
    n_moe = sum(1 for i in layers if cfg.is_moe_layer(i))
    expert_params = 3 * D * cfg.expert_ffn_dim
    reps = _replicas(cfg, lay)
    local = cfg.moe.num_experts // lay.ep if cfg.moe.num_experts else 0
    # per layer: each replica buffer, its gradient and its row of the stacked weights, plus the owned rows stacked
    t["replicas (Pro-Prophet)"] = (n_moe * expert_params * a * (3 * reps + local) if reps else 0.0)
    # Agg's receive buffers on the owner, one per (replicated expert it owns, holder), each other rank holding at
    # most `reps` replicas of the rank's `local` experts (`ExpertParallel._agg_issue`): all of them at once
    t["Agg receive buffers (Pro-Prophet)"] = n_moe * expert_params * a * min(local, reps) * (lay.ep - 1)


def _expert_weight_bytes(cfg: Config, lay: MemoryLayout, specs: list[_Layer], whole: float) -> float:
    """Bytes of the `whole` expert-parallel expert weight elements a rank holds under `shard: full` (a stage's, in a
    pipeline): fp32 and whole when they are replicated over the expert-data-parallel ranks (one of them, the
    pruning or freezing scheme), else sharded at rest (moebal/distributed/fsdp.py `ExpertsAtRest`): the fp32 1/edp
    parts plus the MoE layers gathered at once (fp32, or bf16 compute copies: `bf16_experts`): one, two when a
    replicating policy's Trans of the next layer is issued as a layer starts (`scheduler.block_overlap`) or
    inside it (`planner.plan_ahead`: prefetched as the layer starts). A checkpoint's write and load gather one
    layer at a time."""
    if whole == 0 or lay.edp == 1 or cfg.dynamism.scheme in ("pruning", "freezing"):
        return 4.0 * whole
    early = cfg.scheduler.block_overlap or cfg.planner.plan_ahead != "off"
    layers = 2 if early and lay.policy != "static" else 1
    gathered = 2.0 if lay.bf16_experts else 4.0
    return 4.0 * whole / lay.edp + gathered * layers * max((x.expert / lay.ep for x in specs), default=0.0)


def _total_params(cfg: Config, specs: list[_Layer]) -> int:
    m = cfg.model
    return (sum(x.dense + x.expert for x in specs) + m.vocab_size * m.dim * (1 if m.tie_embeddings else 2)
            + m.dim)


def plan_memory(cfg: Config, layout: MemoryLayout, device: DeviceMemory) -> MemoryPlan:
    """Each rank's peak memory (the worst pipeline stage's), by term, against `device`."""
    return _plan(cfg, _layers(cfg), layout, device)


def _plan(cfg: Config, specs: list[_Layer], layout: MemoryLayout, device: DeviceMemory) -> MemoryPlan:
    layout = dataclasses.replace(layout, scheme=cfg.dynamism.scheme)  # the config's scheme, whoever built the layout
    _check_layout(cfg, layout)
    best: tuple[float, int, dict[str, float], dict[str, float]] | None = None
    peaks, trains, freeds = [], [], []
    for s, layers in enumerate(_stage_layers(cfg.model.n_layers, layout.pp)):
        terms, phases = _stage_terms(cfg, specs, layout, s, layers, device.cuda)
        train = max(v for k, v in phases.items() if k != "start-up")
        freed = max(0.0, phases["start-up"] - terms["parameters"])
        terms["start-up leftovers"] = device.startup_retained * freed
        body = max(phases["start-up"], train + terms["start-up leftovers"])
        peak = device.runtime_bytes + (1 + device.slack_for(layout.shard)) * body
        peaks.append(peak)
        trains.append(train)
        freeds.append(freed)
        if best is None or peak > best[0]:
            best = (peak, s, terms, phases)
    assert best is not None
    peak, s, terms, phases = best
    slack = device.slack_for(layout.shard)
    body = (peak - device.runtime_bytes) / (1 + slack)
    terms = {**terms, "runtime": device.runtime_bytes, "allocator slack": slack * body}
    return MemoryPlan(layout=layout, device=device, terms=terms, phases=phases, peak_bytes=peak, stage=s,
                      stage_peaks=tuple(peaks), stage_train=tuple(trains), stage_freed=tuple(freeds))


# ---- the smallest layout that fits ------------------------------------------------------------------------------
def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _candidates(cfg: Config, ranks: int, base: MemoryLayout, shards: tuple[str, ...],
                recomputes: tuple[str, ...], built: bool = False) -> Iterator[MemoryLayout]:
    """`built`: only combinations this build runs (those moebal/config.py takes: `_refused`)."""
    E = cfg.moe.num_experts
    for pp in [p for p in _divisors(ranks) if p <= cfg.model.n_layers]:
        stage = ranks // pp
        if cfg.data.batch_size % stage:
            continue
        rows = cfg.data.batch_size // stage
        eps = [e for e in _divisors(stage) if E and E % e == 0] if E else [1]
        mbs = sorted({mb for mb in ((1, 2, 4, 8) if pp == 1 else (pp, 2 * pp, 4 * pp, rows))
                      if mb <= rows and rows % mb == 0})
        for ep in eps:
            for mb in mbs:
                for shard in shards:
                    for rc in recomputes:
                        lay = dataclasses.replace(base, ranks=ranks, pp=pp, ep=ep, shard=shard, recompute=rc,
                                                  micro_batches=mb)
                        for held in _holds(cfg, lay):
                            yield from (p for p in _placements(cfg, held) if not (built and _refused(cfg, p)))


def _holds(cfg: Config, lay: MemoryLayout) -> Iterator[MemoryLayout]:
    """Each of `_fsdp_holds`, and under bf16 autocast with FSDP2 gathering fp32 weights, the same gathering bf16
    (`parallel.param_dtype: bf16`: no fp32 gathers, no autocast copies of them) where the config takes it (not
    with `train.precision: auto` or `moe.router_fp32`, which a bf16 param_dtype refuses)."""
    for held in _fsdp_holds(lay):
        yield held
        if held.shard == "full" and held.precision == "bf16" and held.param_dtype == "fp32":
            bf16 = dataclasses.replace(held, param_dtype="bf16")
            if not _refused(cfg, bf16):
                yield bf16


def _fsdp_holds(lay: MemoryLayout) -> Iterator[MemoryLayout]:
    """`lay`, then (`shard: full`) without each of FSDP2's holds it has, and without both: whole gradient sums
    (`parallel.accumulate: whole`, with micro-batches) and weights gathered through the step (`parallel.reshard:
    step`)."""
    yield lay
    if lay.shard != "full":
        return
    whole = lay.micro_batches > 1 and lay.accumulate == "whole"
    step = lay.reshard == "step"
    if whole:
        yield dataclasses.replace(lay, accumulate="sharded")
    if step:
        yield dataclasses.replace(lay, reshard="micro_batch")
    if whole and step:
        yield dataclasses.replace(lay, accumulate="sharded", reshard="micro_batch")


def _placements(cfg: Config, lay: MemoryLayout) -> Iterator[MemoryLayout]:
    """`lay` under its placement policy, then (ep > 1, a replicating policy) under each cap on the replicas per rank
    and MoE layer (`planner.max_replicas`: powers of two below the policy's bound), then under static placement."""
    yield lay
    if lay.ep == 1 or lay.policy == "static" or not cfg.moe.num_experts:
        return
    bound, cap = _replicas(cfg, lay), 1
    while cap < bound:
        yield dataclasses.replace(lay, max_replicas=cap)
        cap *= 2
    yield dataclasses.replace(lay, policy="static", max_replicas=None)


def _refused(cfg: Config, lay: MemoryLayout) -> bool:
    """Whether moebal/config.py refuses `lay` (its stages, expert-parallel size, sharding, FSDP2 holds,
    recomputation, micro-batches and placement, as `_changes` names them) with this config's other settings: the
    config's own checks decide, so a proposed fix is one a run takes (a scheme's refusals under a sharded optimizer,
    layer rebalancing at one stage, options of the trainer without a pipeline)."""
    piped = pipelined(lay.pp, cfg.dynamism.scheme)
    held: dict[str, Any] = {"shard": lay.shard, "accumulate": lay.accumulate, "reshard": lay.reshard,
                            "param_dtype": lay.param_dtype}
    par = dataclasses.replace(cfg.parallel, pp=lay.pp, ep=lay.ep, nproc=lay.ranks, **held)
    rc: dict[str, Any] = {"recompute": lay.recompute}
    train = dataclasses.replace(cfg.train, grad_accum=1 if piped else lay.micro_batches, **rc)
    pipe = dataclasses.replace(cfg.pipeline, micro_batches=lay.micro_batches) if piped else cfg.pipeline
    placed: dict[str, Any] = {"policy": lay.policy}
    if lay.max_replicas is not None:
        placed["max_replicas"] = lay.max_replicas
    try:
        dataclasses.replace(cfg, parallel=par, train=train, pipeline=pipe,
                            planner=dataclasses.replace(cfg.planner, **placed))
    except ConfigError:
        return True
    return False


def overhead(lay: MemoryLayout, policy: str = "static",
             holds: tuple[str, str, str] = ("sharded", "micro_batch", "fp32")) -> tuple[float, int, int, int]:
    """The order --fit prefers among layouts of one rank count: the least estimated throughput overhead, then
    the fewest stages, the largest expert-parallel size (fewest experts per rank), the fewest micro-batches.

    The estimate (a share of the step time, deliberately rough): recomputation repeats a forward part, one of
    the three forward-units of a step (full 0.33; moe 0.2 and attention 0.1, the parts' usual FLOP shares in
    an MoE decoder); sharding adds communication (optimizer 0.02: reduce-scatter plus all-gather moves what
    the all-reduce moved; full 0.1: the weights are gathered again for the backward pass); a 1F1B pipeline
    idles (pp - 1) / (M + pp - 1) of the step (GPipe's bubble is the same share); giving up the configured
    placement policy for static placement 0.1 (what Pro-Prophet saves under skewed routing), capping its
    replicas at c per rank and MoE layer (below the configured cap) 0.02 / c: the hottest experts' first replicas
    carry most of the gain (the simulated 1,024-rank Mixtral-8x7B step is 8.59 s at one replica per rank and
    layer and 8.47 s uncapped, 1.4 % slower, docs/simulator.md), so a cap costs at most what optimizer sharding
    does, and fewer replicas more than more; giving up one of FSDP2's holds the configuration asks for (`holds`: its
    `parallel.accumulate` and `parallel.reshard`) 0.05: the collectives a hold saves are those of the default
    `full` layout, which `full`'s 0.1 already prices (its re-gathered weights), so a hold is worth part of it,
    taken as half; dropping one is preferred to recomputation and to a pipeline (the default FSDP2 behaviour
    costs no FLOPs), a replica cap to dropping one (the measured gains of the holds are CPU ones, docs/memory.md:
    1.3x and 2.3x throughput on 4 gloo ranks time-slicing 2 cores; none is measured on GPUs, where FSDP2 overlaps
    its collectives); FSDP2 gathering bf16 weights instead of the configured fp32 ones (`parallel.param_dtype`,
    the third of `holds`) 0.01: the same bf16 products autocast computes, the sharded fp32 masters kept, and half
    the gathered bytes, but a change of numerics the configuration did not ask for. Micro-batches themselves are not
    priced, a pipeline's or gradient accumulation's
    (`train.grad_accum`, pp 1): the same FLOPs in smaller products, whose per-pass fixed costs (launches, the
    all-to-alls' latency) this estimate leaves out alike for both; among equal scores the fewest stages, then the
    fewest micro-batches win, so accumulation is preferred to a pipeline that fits only by its micro-batches."""
    score = (_RECOMPUTE_COST[lay.recompute] + _SHARD_COST[lay.shard]
             + ((lay.pp - 1) / (lay.micro_batches + lay.pp - 1) if lay.pp > 1 else 0.0)
             + (0.1 if lay.policy != policy else 0.0)
             + (0.02 / max(lay.max_replicas, 1) if lay.max_replicas is not None and lay.policy != "static" else 0.0)
             + _HOLD_COST * (lay.shard == "full" and lay.micro_batches > 1 and holds[0] == "whole"
                             and lay.accumulate != "whole")
             + _HOLD_COST * (lay.shard == "full" and holds[1] == "step" and lay.reshard != "step")
             + _PARAM_DTYPE_COST * (lay.param_dtype != holds[2]))
    return (round(score, 6), lay.pp, -lay.ep, lay.micro_batches)


def rank_counts(max_ranks: int, per_node: int) -> list[int]:
    """Rank counts --fit tries: powers of two below a node, then whole nodes in powers of two, up to max_ranks."""
    out = {1 << k for k in range(64) if (1 << k) <= min(per_node, max_ranks)}
    n = per_node
    while n <= max_ranks:
        out.add(n)
        n *= 2
    return sorted(out)


def fit_layout(cfg: Config, device: DeviceMemory, base: MemoryLayout, max_ranks: int, per_node: int = 8,
               shards: tuple[str, ...] = SHARDS, recomputes: tuple[str, ...] = RECOMPUTES, built: bool = False
               ) -> MemoryPlan | None:
    """The smallest layout that fits: the fewest ranks (of `rank_counts`), then the least `overhead`. None
    when nothing up to `max_ranks` fits. `built`: only combinations this build runs."""
    specs = _layers(cfg)
    for ranks in rank_counts(max_ranks, per_node):
        fitting = [p for lay in _candidates(cfg, ranks, base, shards, recomputes, built)
                   if (p := _plan(cfg, specs, lay, device)).fits]
        if fitting:
            return min(fitting, key=lambda p: (overhead(p.layout, base.policy, _held(base)), p.peak_bytes))
    return None


def fix_for(cfg: Config, plan: MemoryPlan, shards: tuple[str, ...] = SHARDS,
            recomputes: tuple[str, ...] = RECOMPUTES, built: bool = False) -> MemoryPlan | None:
    """The least-overhead change of shard, recompute, ep, pp and micro-batches on the same ranks that fits
    (`built`: only combinations this build runs)."""
    specs = _layers(cfg)
    fitting = [p for lay in _candidates(cfg, plan.layout.ranks, plan.layout, shards, recomputes, built)
               if (p := _plan(cfg, specs, lay, plan.device)).fits]
    return min(fitting, key=lambda p: (overhead(p.layout, plan.layout.policy, _held(plan.layout)), p.peak_bytes)
               ) if fitting else None


def _held(lay: MemoryLayout) -> tuple[str, str, str]:
    return lay.accumulate, lay.reshard, lay.param_dtype


def _changes(old: MemoryLayout, new: MemoryLayout) -> str:
    """The overrides that turn `old` into `new`. Micro-batches are a pipeline's (pipeline.micro_batches, under a
    dynamism scheme at one stage too: `MemoryLayout.pipelined`) or, without one, gradient accumulation's
    (train.grad_accum, which a pipeline refuses: set back to 1 when one is proposed)."""
    keys = {"pp": "parallel.pp", "ep": "parallel.ep", "shard": "parallel.shard", "recompute": "train.recompute",
            "policy": "planner.policy", "accumulate": "parallel.accumulate", "reshard": "parallel.reshard",
            "param_dtype": "parallel.param_dtype"}
    out = [f"{k}={getattr(new, f)}" for f, k in keys.items() if getattr(new, f) != getattr(old, f)]
    if new.max_replicas is not None and new.policy != "static" and new.max_replicas != old.max_replicas:
        out.append(f"planner.max_replicas={new.max_replicas}")
    piped = (old.pipelined, new.pipelined)
    accum = (1 if piped[0] else old.micro_batches, 1 if piped[1] else new.micro_batches)
    if piped[1] and (not piped[0] or new.micro_batches != old.micro_batches):
        out.append(f"pipeline.micro_batches={new.micro_batches}")
    if accum[0] != accum[1]:
        out.append(f"train.grad_accum={accum[1]}")
    return " ".join(out)


def refusal_line(cfg: Config, plan: MemoryPlan, built: tuple[tuple[str, ...], tuple[str, ...]] | None = None) -> str:
    """One line: the predicted peak against the capacity, the largest term, and a setting that fits (the least
    overhead on the same ranks, else the fewest ranks `fit_layout` finds up to 64 times the layout's ranks).
    `built`: the shard and recompute values this build runs (the rest are only planned)."""
    gb = 1e9
    name, size = plan.largest_term
    head = (f"will not fit: {plan.peak_bytes / gb:.1f} GB per rank predicted against "
            f"{plan.device.capacity_bytes / gb:.1f} GB ({plan.device.name}; {plan.layout.describe()}); largest term: "
            f"{name} {size / gb:.1f} GB")
    shards, recomputes = built or (SHARDS, RECOMPUTES)
    if plan.layout.init == "full" and plan.device.runtime_bytes + plan.phases["start-up"] > plan.device.capacity_bytes:
        return (f"{head}; the start-up alone needs {plan.phases['start-up'] / gb:.1f} GB: every rank builds the whole "
                f"model before keeping its share, so no layout fits with a whole-model start-up: use rank-local "
                f"initialisation (what `moebal train` does; `moebal plan memory --init local` plans with it)")
    fix = fix_for(cfg, plan, shards, recomputes, built is not None)
    if fix is not None:
        return f"{head}; fits with {_changes(plan.layout, fix.layout)} ({fix.peak_bytes / gb:.1f} GB)"
    more = fit_layout(cfg, plan.device, plan.layout, max_ranks=max(plan.layout.ranks, 1) * 64, shards=shards,
                      recomputes=recomputes, built=built is not None)
    if more is not None:
        return (f"{head}; fits on {more.layout.ranks} ranks with "
                f"{_changes(plan.layout, more.layout) or 'this layout'}"
                f" ({more.peak_bytes / gb:.1f} GB)")
    hint = _TERM_SETTING.get(name, "a smaller model")
    return f"{head}; no layout fits up to {64 * plan.layout.ranks} ranks: try {hint} or a smaller model"


def choose_shard(cfg: Config, ranks: int, device: DeviceMemory, precision: str,
                 shards: tuple[str, ...] = SHARDS, **changes: Any) -> tuple[Config, str]:
    """`parallel.shard: auto`: `cfg` with the least sharding this plan says fits a rank on `ranks` ranks of
    `device` (in the order of `shards`: none, then optimizer, then full, each costing communication the one
    before does not), among the values the config's own checks accept (a pipeline's scheme may refuse one; a
    bf16 `parallel.param_dtype` needs a sharded state), and a line saying what was chosen and why. Where none
    fits: the one with the smallest planned peak, which the plan's check then refuses with its line (and the
    settings that would make it fit); where the plan cannot
    describe the layout: the first accepted one. `changes`: as `layout_from_config`'s (its shard is ignored)."""
    changes = {k: v for k, v in changes.items() if k != "shard"}
    gb = 1e9
    tried: list[str] = []
    refused: list[str] = []
    closest: tuple[float, Config] | None = None
    for shard in shards:
        try:
            cand = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, shard=shard))  # type: ignore[arg-type]
        except ConfigError as e:  # this config's checks refuse that value
            refused.append(f"{shard}: {e}")
            continue
        try:
            plan = plan_memory(cand, layout_from_config(cand, ranks, **{**changes, "precision": precision}), device)
        except ConfigError:
            return cand, f"parallel.shard auto: {shard} (the memory plan does not describe this layout)"
        if plan.fits:
            not_ = f"; {', '.join(tried)} would not" if tried else ""
            return cand, (f"parallel.shard auto: {shard} (the memory plan: {plan.peak_bytes / gb:.1f} GB per rank of "
                          f"{device.capacity_bytes / gb:.1f} GB{not_})")
        tried.append(f"{shard} {plan.peak_bytes / gb:.1f} GB")
        if closest is None or plan.peak_bytes < closest[0]:
            closest = (plan.peak_bytes, cand)
    if closest is None:
        raise ConfigError(f"parallel.shard auto: this config's checks refuse every value ({'; '.join(refused)})")
    return closest[1], (f"parallel.shard auto: {closest[1].parallel.shard}, the closest to fitting, though nothing "
                        f"fits ({', '.join(tried)})")


def layout_from_config(cfg: Config, ranks: int, **changes: Any) -> MemoryLayout:
    """The layout a config describes on `ranks` ranks (null parallel.ep: every rank of a stage, capped at the
    experts), with `changes` (None values ignored) applied."""
    par = cfg.parallel
    pp = changes.get("pp") or par.pp
    E = cfg.moe.num_experts
    ep = changes.get("ep") or par.ep or (math.gcd(E, ranks // max(pp, 1)) if E else 1)
    prec = cfg.train.precision.replace("auto", "bf16")
    staged = pipelined(pp, cfg.dynamism.scheme)
    base = MemoryLayout(ranks=ranks, pp=pp, ep=ep if E else 1, shard=par.shard, recompute=cfg.train.recompute,
                        micro_batches=cfg.pipeline.micro_batches if staged else cfg.train.grad_accum,
                        accumulate=cfg.parallel.accumulate, reshard=cfg.parallel.reshard,
                        schedule=cfg.pipeline.schedule,
                        precision=prec, policy=cfg.planner.policy, init="local" if RANK_LOCAL_INIT else "full",
                        param_dtype=cfg.parallel.param_dtype, scheme=cfg.dynamism.scheme)
    rest = {k: v for k, v in changes.items() if v is not None and k not in ("pp", "ep")}
    lay = dataclasses.replace(base, **rest)
    if lay.shard == "auto":  # one rank has nothing to shard; more are the memory plan's choice to make first
        if lay.ranks > 1:
            raise ConfigError("parallel.shard auto describes no layout until it is settled: settle it with "
                              "choose_shard (moebal/planner/memory.py) or name none, optimizer or full")
        lay = dataclasses.replace(lay, shard="none")
    if staged and "micro_batches" not in rest:
        rows = cfg.data.batch_size // max(lay.stage_ranks, 1)
        lay = dataclasses.replace(lay, micro_batches=max(1, min(lay.micro_batches, rows)))
    return lay
