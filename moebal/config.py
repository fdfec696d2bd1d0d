"""moebal's one typed configuration schema.

Nested frozen dataclasses are the schema; YAML is only their serialisation. Precedence: dataclass
defaults < YAML file < `a.b.c=value` overrides. The defaults *are* the embedded default run
(`configs/default.yaml` is their dump, and a test keeps the two equal).

Every user mistake raises `ConfigError` naming the file, the key, the bad value and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

from moebal.errors import ConfigError
from moebal.fileio import write_text_whole

__all__ = [
    "Config",
    "ConfigError",
    "DataConfig",
    "DynamicMicroBatchConfig",
    "DynamismConfig",
    "FeedbackConfig",
    "HFConfig",
    "ModelConfig",
    "MoEConfig",
    "ParallelConfig",
    "PipelineConfig",
    "PlannerConfig",
    "SchedulerConfig",
    "SpikeConfig",
    "TrainConfig",
    "apply_override",
    "build_schema",
    "dump",
    "from_dict",
    "load",
    "load_data",
    "read_yaml",
    "refuse_cpu_only",
    "resolve_path",
    "tied_wire",
    "to_dict",
]

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
SUBSET_SCHEMES = ("mod", "early_exit")
MAX_INT = 2**62
"""The largest integer a config takes (a step count or seed beyond it overflows deques, torch and numpy)."""
MAX_THREADS = 4096
"""Dynamism schemes whose layers run a subset of the tokens (a token skips a block, or leaves the network): a
token's path over the MoE layers breaks there, so what follows every token through them (routing records, Lina's
path estimates) cannot run with them."""
T = TypeVar("T")


@dataclass(kw_only=True, frozen=True)
class RopeScalingConfig:
    """YaRN rotary scaling (Peng et al. 2023), as DeepSeek-V2/V3 and transformers' `rope_type: yarn` define it."""

    type: Literal["yarn"] = "yarn"
    """The scaling method; only yarn is implemented."""
    factor: float = 40.0
    """Context extension factor (HF `factor`)."""
    original_max_seq_len: int = 4096
    """Pretraining context the frequencies were fitted to (HF `original_max_position_embeddings`)."""
    beta_fast: float = 32.0
    """Rotations above which a frequency is extrapolated (kept as it is)."""
    beta_slow: float = 1.0
    """Rotations below which a frequency is interpolated (divided by factor)."""
    mscale: float | None = None
    """Numerator scale of the rotary attention factor (HF `mscale`); null as HF leaves it."""
    mscale_all_dim: float | None = None
    """Denominator of that factor, and the softmax scale's extra mscale(factor, this)^2 (DeepSeek)."""
    attention_factor: float | None = None
    """Explicit factor on cos/sin; null derives it from factor, mscale and mscale_all_dim as HF does."""
    truncate: bool = True
    """Round the correction range to whole dimensions (HF `truncate`, default true)."""


@dataclass(kw_only=True, frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2 section 2.1): compressed q and kv, decoupled rotary part."""

    q_lora_rank: int | None = None
    """Rank of the compressed query (q_a_proj, q_a_layernorm, q_b_proj); null: one q_proj (DeepSeek-V2-Lite)."""
    kv_lora_rank: int = 512
    """Rank of the compressed key/value latent (kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj)."""
    qk_nope_head_dim: int = 128
    """Per-head query/key width without rotary embedding."""
    qk_rope_head_dim: int = 64
    """Per-head query/key width with rotary embedding (the key's part is shared by all heads)."""
    v_head_dim: int = 128
    """Per-head value width."""
    rope_interleave: bool = True
    """Rotate interleaved pairs (x0, x1), (x2, x3), ... as DeepSeek's weights expect; false: rotate-half pairs."""


@dataclass(kw_only=True, frozen=True)
class ModelConfig:
    """The decoder's shape (Mixtral family; names follow HF Mixtral where a field exists there)."""

    vocab_size: int = 256
    """Vocabulary size; 256 for the byte tokenizer, the tokenizer's size otherwise."""
    dim: int = 256
    """Hidden size (HF `hidden_size`)."""
    n_layers: int = 4
    """Number of decoder layers (HF `num_hidden_layers`)."""
    n_heads: int = 8
    """Attention query heads."""
    n_kv_heads: int = 4
    """Key/value heads for grouped-query attention; must divide `n_heads`."""
    head_dim: int | None = None
    """Per-head width; null means dim / n_heads."""
    ffn_dim: int = 768
    """Hidden width of a dense SwiGLU MLP (layers that are not MoE)."""
    max_seq_len: int = 512
    """Longest sequence the rotary tables are built for (HF `max_position_embeddings`)."""
    rope_theta: float = 10000.0
    """Rotary base."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    tie_embeddings: bool = False
    """Share the input embedding with the LM head (with pipeline stages, or on a scheme's one stage under
    parallel.shard full, the head holds a copy that follows the embedding: docs/pipeline.md)."""
    attention_bias: bool = False
    """Biases on the query, key and value projections (Qwen2-MoE); none on the output projection. With model.mla:
    on q_a_proj, kv_a_proj_with_mqa and o_proj (DeepSeek's `attention_bias`)."""
    qk_norm: Literal["none", "head", "full"] = "none"
    """RMSNorm on queries and keys before rotary: per head over head_dim (Qwen3-MoE), over the whole q and k
    projections (OLMoE), or none."""
    sliding_window: int | None = None
    """Each token attends to itself and the sliding_window - 1 tokens before it (Mixtral's `sliding_window`);
    null: full causal attention."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation of linear and embedding weights; residual output projections
    (attention's o_proj, a dense MLP's down_proj, the routed experts' w2; not the shared expert's) take init_std /
    sqrt(2 * n_layers) (GPT-2)."""
    rope_scaling: RopeScalingConfig | None = None
    """YaRN rotary scaling (DeepSeek-V2/V3); null: plain RoPE. Implemented for multi-head latent attention."""
    mla: MLAConfig | None = None
    """Multi-head latent attention (DeepSeek) instead of grouped-query attention; null: grouped-query."""


@dataclass(kw_only=True, frozen=True)
class MoEConfig:
    """Mixture-of-Experts blocks: which layers, the experts, and how tokens are routed."""

    num_experts: int = 8
    """Experts per MoE layer; 0 makes every layer a dense MLP."""
    top_k: int = 2
    """Experts per token (the maximum under adaptive gating)."""
    expert_ffn_dim: int | None = 512
    """Hidden width of one expert; null means model.ffn_dim."""
    every: int = 1
    """Layer i (0-based) is an MoE layer when (i + 1) % every == 0 (HF `decoder_sparse_step`)."""
    first_dense: int = 0
    """The first N layers are dense MLPs whatever `every` says (DeepSeek `first_k_dense_replace`)."""
    dense_layers: tuple[int, ...] = ()
    """Layers (0-based) that are dense MLPs whatever `every` says (HF `mlp_only_layers`)."""
    shared_experts: int = 0
    """Always-on shared experts added to the routed output (Qwen-MoE style)."""
    shared_ffn_dim: int | None = None
    """Hidden width of the shared expert block; null means shared_experts * expert_ffn_dim."""
    shared_gate: bool = False
    """Scale the shared expert's output by sigmoid(w . x), one learned gate per token (Qwen2-MoE)."""
    router: Literal["linear", "mlp_tanh"] = "linear"
    """Router network: one bias-free linear (Mixtral) or Linear-tanh-Linear (LLaMA-MoE v1)."""
    gate: Literal["softmax_topk", "topk_softmax", "sigmoid_topk"] = "softmax_topk"
    """Mixtral order (softmax over all experts, top-k, renormalise), top-k of logits then softmax (LLaMA-MoE), or
    sigmoid of each logit then top-k (DeepSeek-V3)."""
    norm_topk: bool = True
    """Renormalise the top-k scores to sum to one; false keeps the chosen experts' own softmax or sigmoid values
    (Qwen2-MoE and DeepSeek `norm_topk_prob: false`; not with topk_softmax)."""
    n_group: int = 1
    """Expert groups for group-limited routing (DeepSeek `n_group`); must divide num_experts; 1: no groups."""
    topk_group: int | None = None
    """Groups a token may pick its experts from, the best by group score (DeepSeek `topk_group`); null: all."""
    group_score: Literal["max", "top2_sum"] = "max"
    """A group's score: its best expert's (DeepSeek-V2 group_limited_greedy) or its two best summed (V3)."""
    router_fp32: bool = False
    """Compute router logits in fp32 whatever the autocast, from a weight kept in fp32 by HF exports (DeepSeek)."""
    selection_bias: bool = False
    """Keep a per-expert selection bias even with bias_update_rate 0 (a loaded DeepSeek-V3
    `e_score_correction_bias`, used as it is); it changes the choice only, never the weights."""
    router_noise: float | None = None
    """Noisy top-k gating while training (LLaMA-MoE v1): logits += N(0, 1) * (softplus(W_noise x) + this);
    null disables it (and the noise projection)."""
    adaptive_threshold: float | None = None
    """Adaptive top-k: a token takes its next expert only when the probability gap is <= this. null: fixed k."""
    capacity_factor: float | None = None
    """Per-expert capacity = ceil(factor * tokens * k / experts), tokens counted per MoE call (a rank's, a
    micro-batch's); null is dropless."""
    drop_policy: Literal["probs", "position"] = "probs"
    """Which assignments an over-full expert keeps: the highest gate probabilities, or by choice rank then position
    (every token's first choice before any second choice, earliest positions first; docs/moe-layer.md)."""
    jitter: float = 0.0
    """Multiplicative input jitter epsilon during training (Switch); 0 disables it."""
    score_scale: float = 1.0
    """Factor on the combined expert output (LLaMA-MoE `score_scale_factor`, DeepSeek `routed_scaling_factor`)."""
    aux_loss_coef: float = 0.01
    """Weight of the Switch/GShard load-balancing loss."""
    aux_loss_scope: Literal["layer", "pooled", "sequence"] = "layer"
    """What the balancing loss measures: layer, each MoE layer's batch (balance gives 1; the layers' losses
    summed, Megatron's); pooled, one loss over every layer's batch (transformers' Mixtral, Qwen2/3-MoE and OLMoE
    loss, balance gives top_k); sequence, each layer's loss per sequence, averaged
    (DeepSeek's seq_aux; not with dynamism mod or early_exit)."""
    z_loss_coef: float = 0.0
    """Weight of the router z-loss (ST-MoE)."""
    bias_update_rate: float = 0.0
    """Auxiliary-loss-free balancing: per-expert selection bias step size (DeepSeek-V3); 0 disables it."""
    kernel: Literal["auto", "grouped_mm", "loop"] = "auto"
    """Grouped expert GEMM implementation; auto: the loop on CPU, grouped_mm on accelerators (a fixed rule, settled
    once per run and kept in its checkpoints, so a seed gives the same losses in every run and resume)."""


@dataclass(kw_only=True, frozen=True)
class DataConfig:
    """Where text comes from and how it becomes training samples."""

    source: str = "stdlib"
    """'stdlib' (this Python's standard-library sources) or a path to a .txt/.jsonl file or directory."""
    tokenizer: str = "byte"
    """'byte' (vocab 256) or a path to a HF tokenizer.json."""
    text_key: str = "text"
    """Field holding the text in .jsonl records."""
    add_special_tokens: bool = False
    """Let a tokenizer.json add its special tokens to every document (LLaMA's and Mixtral's <s>), as the model
    saw them in pretraining; the byte tokenizer has none."""
    seq_len: int = 128
    """Tokens per packed block (the longest sample in document mode)."""
    batch_size: int = 16
    """Sequences per optimizer step."""
    samples: Literal["packed", "documents"] = "packed"
    """Fixed-length packed blocks, or variable-length documents cut at seq_len."""
    units: Literal["files", "blocks"] = "files"
    """What one document is: a whole text file, or each of its top-level blocks (a blank line then an unindented
    line: Python definitions, text paragraphs; natural, long-tailed lengths). A .jsonl line is always one."""
    mixture: dict[str, float] | None = None
    """Sources and sampling weights, e.g. {stdlib: 0.8, chat.jsonl: 0.2}; replaces data.source when set."""
    val_fraction: float = 0.05
    """Share of documents held out for validation (chosen by a hash of the document's path; where the hash leaves
    one side empty, the last share of every document's tokens, docs/data.md)."""
    max_bytes: int | None = None
    """Read at most this many bytes of the corpus; null reads everything."""
    order: Literal["shuffle", "complexity"] = "shuffle"
    """Sample order of an epoch: shuffled, or Adaptive Gating's curriculum (from the second epoch on, samples by
    the similarity (`order_metric`) of their per-layer two-expert token shares to the sample with the fewest
    two-expert tokens; needs moe.adaptive_threshold; moebal/data/curriculum.py)."""
    order_metric: Literal["distance", "cosine"] = "distance"
    """Similarity of `order: complexity`: Euclidean distance to the anchor, nearest first, or the thesis's cosine
    (which ignores how many tokens take two experts; see moebal/data/curriculum.py)."""


@dataclass(kw_only=True, frozen=True)
class SpikeConfig:
    """What a step whose loss or gradient norm is not finite, or whose loss spikes, does to the run
    (moebal/train/spikes.py, docs/training.md "Loss spikes")."""

    action: Literal["stop", "rollback"] = "stop"
    """stop: end the run at that step (exit code 2), its checkpoints untouched. rollback: go back to the run's
    newest checkpoint (`back`), skip the data batches trained since it (and `skip_extra` more), and go on (PaLM's
    recovery), at most `max_rollbacks` times; every rollback is a line of `rollbacks.jsonl` in the run
    directory, which a resume from that checkpoint honours."""
    factor: float = 0.0
    """A step whose loss is above this many times the median loss of the previous `window` steps is a spike;
    0 (the default): only a non-finite loss or gradient norm is."""
    grad_factor: float = 0.0
    """A step whose gradient norm (the whole model's, before clipping) is above this many times the median norm
    of the previous `window` steps is a spike too; 0 (the default): the norm counts only when it is not finite.
    Clipping absorbs most gradient spikes: on healthy runs (no loss spike) this test fires at 3 in every run
    measured, at 5 in most (docs/training.md); replay a finished run first (`scripts/spike_replay.py`)."""
    window: int = 20
    """Steps of loss (and gradient norm) history the spike tests compare with (no spike is called before that many
    steps)."""
    back: int = 0
    """Roll back to the newest checkpoint at least this many steps before the bad step (PaLM went about 100 steps
    back, before the spike began to build): pruning keeps one that old beside the newest `train.keep_checkpoints`
    (two more at most; a rollback lands between `back` and about 2 `back` plus two checkpoint intervals back),
    and the oldest while none is that old yet. The checkpoints after the one gone back to move to
    `rolled-back/<n>/` in the run directory, out of a restart's reach. 0: the newest."""
    skip_extra: int = 0
    """Batches skipped beyond those trained since the checkpoint (PaLM skipped some after the spike too)."""
    max_rollbacks: int = 3
    """Rollbacks a run may make; the next bad step stops it as `action: stop` would."""


@dataclass(kw_only=True, frozen=True)
class TrainConfig:
    """The optimisation loop, logging and checkpoints."""

    steps: int = 400
    """Optimizer steps."""
    lr: float = 2e-3
    """Peak learning rate (AdamW)."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a share of the peak (the decay's floor)."""
    warmup_steps: int = 30
    """Linear warm-up steps."""
    schedule: Literal["cosine", "linear", "wsd", "constant"] = "cosine"
    """The learning rate after the warm-up: cosine or linear decay to lr * min_lr_ratio at the last step;
    wsd (warm-up, stable, decay): lr until the last `decay_fraction` of the steps after the warm-up, which
    descend linearly to lr * min_lr_ratio, so extending `--steps` of a run still in its stable phase changes
    no step already trained; constant: lr to the end (moebal/train/optim.py `lr_at`)."""
    decay_fraction: float = 0.2
    """wsd: the share of the steps after the warm-up that decay (at least one step)."""
    weight_decay: float = 0.1
    """AdamW weight decay on matrices (not on norms, biases or router bias)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    adam_eps: float = 1e-8
    """AdamW epsilon, added to the root of the second moment (torch's default). A resume takes the config's
    betas and epsilon, not the checkpoint's: the optimizer is built from the config and loads only its state."""
    grad_clip: float = 1.0
    """Global gradient-norm clip; 0 disables it."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """Compute precision: fp32, or bf16 autocast with fp32 master weights; auto: bf16 where the device computes
    it natively (CUDA since Ampere, AVX-512/AMX CPUs), else fp32 (moebal/train/precision.py)."""
    seed: int = 0
    """Seed of the model init, data order and every random choice of the run."""
    eval_every: int = 200
    """Validation every N steps (and at the end); 0 only at the end."""
    eval_batches: int = 8
    """Batches per validation."""
    log_every: int = 1
    """Write a metrics line every N steps (and the expert planner's plans.jsonl and comm/ lines)."""
    ckpt_every: int = 200
    """Checkpoint every N steps (and at the end); 0 only at the end."""
    keep_checkpoints: int = 2
    """How many checkpoints to keep (the newest; an older one is deleted only once a newer one is complete). With
    `spike.action: rollback` and `spike.back` N, up to two more, so that one at least N steps old is kept."""
    ckpt_async: bool = False
    """Write checkpoints in a background thread: training waits only while tensors are copied to CPU memory."""
    threads: int | None = None
    """torch intra-op threads per process; null means cores / processes."""
    out_dir: str = "runs"
    """Parent folder of run directories."""
    progress: Literal["auto", "bar", "plain"] = "auto"
    """Progress display: a bar on a terminal and plain lines otherwise (auto)."""
    time_limit_min: float | None = 4.5
    """Safety guard: after this many minutes (from start-up) stop early, validate, checkpoint; null: no limit."""
    recompute: Literal["none", "moe", "attention", "full"] = "none"
    """Activation recomputation per decoder layer (torch's checkpoint utilities): none; moe: the layer's MoE/MLP
    part is recomputed in the backward pass; attention: its attention part; full: the whole layer (only its
    input is kept). Exact in fp32: the same loss and gradients as none. A MoE block that exchanges tokens with
    other ranks recomputes its rank-local compute only (expert GEMMs, shared expert; docs/training.md)."""
    grad_accum: int = 1
    """Gradient accumulation without a pipeline: each rank's rows of the global batch run as this many equal
    micro-batches (forward and backward each), their gradients add up, and the step synchronises, clips and
    updates once. The same global batch and learning-rate schedule at 1/grad_accum of the activation memory.
    The loss is weighted by each micro-batch's share of the rank's tokens, the auxiliary losses are the mean of
    the micro-batches' (computed per forward, as a data-parallel rank computes its own); capacity applies per
    micro-batch. A pipeline accumulates over pipeline.micro_batches instead (docs/training.md)."""
    spike: SpikeConfig = field(default_factory=SpikeConfig)
    """Non-finite steps and loss spikes: stop, or roll back and skip the batches (moebal/train/spikes.py)."""
    record_routing_every: int = 0
    """Every N steps write the step's routing (each token's top-k experts in every MoE layer, last micro-batch,
    this rank's tokens on rank 0) to `routing/step_NNNNNN.npz` in the run directory, the input of Lina's path
    profile (`moebal paths`); 0: never. In a pipeline the stages' routing is gathered along rank 0's chain
    (moebal/train/routing_log.py)."""


@dataclass(kw_only=True, frozen=True)
class ParallelConfig:
    """How ranks are split into data-, expert- and pipeline-parallel groups."""

    nproc: int | None = None
    """Processes `moebal train` spawns on this machine; null: one per visible GPU on CUDA, 2 on a CPU (torchrun
    sets the world size itself)."""
    timeout_min: float = 30.0
    """Process-group timeout in minutes (NCCL's watchdog): how long one rank may keep the others waiting in a
    collective (a checkpoint, a weight load); the scheduler's own waits use scheduler.timeout_s."""
    ep: int | None = None
    """Expert-parallel size; null: every rank of a pipeline stage. Must divide moe.num_experts."""
    pp: int = 1
    """Pipeline-parallel stages."""
    shard: Literal["none", "optimizer", "full", "auto"] = "auto"
    """Sharded model state: auto, the default (the least sharding the memory plan says fits this job's ranks
    and devices: none, else optimizer, else full; settled at start-up, before anything is built, by `moebal
    train` and by every entry point of a run, and config.yaml keeps the result: moebal/train/memory.py
    `settle_shard`); none (every rank keeps full fp32 weights, gradients and AdamW state
    of what it holds); optimizer: gradients and AdamW state partitioned over the data-parallel ranks (dense parameters)
    and the expert-data-parallel ranks (expert parameters), weights replicated (ZeRO-2; docs/sharding.md); full:
    weights too (dense ones by FSDP2 `fully_shard` over the data-parallel ranks, expert ones over their
    expert-data-parallel ranks: gathered a MoE layer at a time; docs/sharding.md). With parallel.pp > 1 per
    stage (a migrated layer's state is re-sharded)."""
    param_dtype: Literal["fp32", "bf16"] = "fp32"
    """The dtype weights are computed in (bf16 needs train.precision: bf16): under shard full FSDP2 all-gathers
    the dense ones in it; under shard optimizer (parallel.pp 1) every rank keeps its replicated weights in it and
    only its shard of them in fp32. Without a pipeline the expert-parallel weights too where more than one rank
    holds each expert shard (under full gathered at rest in it). Master weights and AdamW state stay fp32."""
    reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    """Under shard full or optimizer, the dtype gradients are reduce-scattered in (dense by FSDP2 or the sharded
    optimizer, expert parts by the sharded optimizer); the optimizer receives fp32 gradients."""
    accumulate: Literal["sharded", "whole"] = "sharded"
    """Under shard full with several micro-batches per step (train.grad_accum > 1, or a pipeline's), where the
    dense gradients add up over them:
    sharded, the default (FSDP2 reduce-scatters each micro-batch's gradients into the shards in its backward pass:
    A reduce-scatters per step, one unit's whole gradients held at a time); whole (they add up whole, in
    reduce_dtype, and are reduce-scattered once, in the last micro-batch's backward: 1 / A of the traffic, at the
    cost of every dense gradient held whole between the micro-batches; docs/sharding.md). Other settings already
    send once per step (none, optimizer: whole gradients; the expert-parallel experts: after Agg). With a pipeline
    (parallel.pp > 1) the same over pipeline.micro_batches in each stage."""
    reshard: Literal["micro_batch", "step"] = "micro_batch"
    """Under shard full with several micro-batches per step, when FSDP2 frees a unit's gathered dense weights:
    micro_batch, the default (after each micro-batch's forward and again after its backward pass: two
    all-gathers per unit and micro-batch, one unit whole at a time); step (gathered by the step's first forward
    and kept until its last backward pass: one all-gather per unit and step, at the cost of every dense weight
    whole in param_dtype through the step; docs/sharding.md). Not with pipeline.schedule zb (its W ops need the
    shards back between the backward passes)."""


@dataclass(kw_only=True, frozen=True)
class FeedbackConfig:
    """How a balancer checks its plans against measured time (moebal/balance/feedback.py)."""

    enabled: bool = False
    """True: back off from plans that measure slower. False (the default): apply every plan the planner makes
    (the open loop), as the arm follows measured time, so a run's placements (hence the summation order, the
    last bits of its losses) would depend on the machine's load and a resumed run would not repeat the
    uninterrupted one bit for bit."""
    tolerance: float = 0.02
    """Largest measured slowdown of the plan against the base accepted before backing off (0.02: 2 %)."""
    window: int = 4
    """Steps measured per arm before a comparison (the first step of each run is not counted: warm-up)."""
    hold: int = 32
    """Steps on the base arm after a failed trial; doubled after each consecutive failure ..."""
    max_hold: int = 512
    """... up to this many."""
    recheck: int = 100
    """Steps between re-checks of a kept plan (a new trial); 0: never."""
    interleave: bool = True
    """Trials alternate the arms step by step (pairs: base plan, plan base, ...) and compare pair by pair, so a
    change of the machine's load between steps weighs on both arms alike; false: a window of base steps, then a
    window of plan steps, compared by their medians."""

    def __post_init__(self) -> None:
        if not 0 <= self.tolerance < 1 or self.window < 1 or self.hold < 1 or self.max_hold < self.hold \
                or self.recheck < 0:
            raise ConfigError(f"feedback: tolerance must be in [0, 1), window and hold >= 1, max_hold >= hold, "
                              f"recheck >= 0; got tolerance={self.tolerance}, window={self.window}, "
                              f"hold={self.hold}, max_hold={self.max_hold}, recheck={self.recheck}")


@dataclass(kw_only=True, frozen=True)
class PlannerConfig:
    """Per-step expert placement (observe counts, plan the next step, apply it) under expert parallelism."""

    policy: Literal["static", "prophet", "fastermoe", "broadcast_topk"] = "prophet"
    """Placement policy: plain expert parallelism, Pro-Prophet, FasterMoE shadowing, or replicate the hottest."""
    every: int = 1
    """Re-plan every N steps (the plan is kept in between)."""
    ema: float | None = None
    """Forecast counts as an exponential moving average with this weight on the past; null: last step only."""
    hysteresis: float = 0.05
    """Adopt a new plan only when its predicted gain exceeds this share of the current plan's time."""
    overlap: bool = False
    """Cost plans with Pro-Prophet's eq. 8 (Trans/Agg hidden under compute) instead of eq. 6."""
    costs: str = "measure"
    """Performance-model coefficients: 'measure' (on the running job at start-up) or a hardware profile."""
    max_replicas: int | None = None
    """The most replicas (experts it does not own) a rank receives per MoE layer under a replicating policy; the
    memory plan bounds the replica term by it. null: no cap (up to every expert the rank does not own)."""
    feedback: FeedbackConfig = field(default_factory=FeedbackConfig)
    """Closed loop: measure the step time under the plan and under static placement (the maximum over the
    expert-parallel group) and run static placement while the plan does not pay (docs/expert-parallel.md)."""
    plan_ahead: Literal["off", "path"] = "off"
    """'path': plan MoE layer i+1's placement during layer i from the tokens' sample paths (Lina's estimate) and
    issue its Trans before its gate runs; layers before planner.path_len, and every layer until a profile exists,
    keep the previous-iteration plan (docs/expert-parallel.md, "Placement ahead of the gate")."""
    path_profile: str | None = None
    """Path profile for plan_ahead (`moebal paths RUN_DIR -o FILE`); null: built online from the run's routing."""
    path_len: int = 3
    """Sample path length l of plan_ahead: layer j >= l is planned from the experts of layers j-l .. j-1."""
    path_refresh: int = 10
    """Online profile (no path_profile): rebuilt every N steps from the last path_window steps' routing."""
    path_window: int = 40
    """Online profile: steps of routing it is built from (each rank its own tokens)."""


@dataclass(kw_only=True, frozen=True)
class DynamicMicroBatchConfig:
    """DynaPipe micro-batching: cost table, memory budget, DP thinning, schedules, planning ahead."""

    costs: str = "measure"
    """Per-stage micro-batch costs: 'measure' (profile each stage at start-up), a cost table JSON path, or a
    hardware profile name (analytic model)."""
    max_tokens: int | None = None
    """Largest micro-batch (tokens) the cost table covers; null: 4 x data.seq_len."""
    memory: float | None = None
    """Activation bytes a stage may hold; null: no limit."""
    thin: float = 0.01
    """Thinning of the DP's time limits: the plan is at most this share worse than the exact DP (0: exact)."""
    pad_multiple: int = 8
    """Round a micro-batch's padded length up to a multiple of this."""
    schedules: str = "1f1b,adaptive"
    """Schedules simulated per iteration (the faster is run): any of 1f1b, adaptive."""
    workers: int = 1
    """Background planning processes (0: plan inline on rank 0)."""
    lookahead: int = 2
    """Iterations planned ahead of the one training."""


@dataclass(kw_only=True, frozen=True)
class SchedulerConfig:
    """Communication scheduling under expert parallelism: priorities, chunked collectives, overlap."""

    mode: Literal["off", "ddp", "lina"] = "lina"
    """Gradient sync: after the backward pass (off), bucketed and concurrent with the all-to-alls (ddp), or in
    chunks issued only while no all-to-all is queued or in flight (lina)."""
    chunk_mb: float | None = None
    """Gradient all-reduce chunk in MB (lina); null: from the measured or profiled all-reduce latency."""
    bucket_mb: float = 25.0
    """Bucket size of the ddp mode in MB (10^6 bytes; PyTorch DDP's default figure, which it reads in MiB)."""
    inflight: int = 1
    """Gradient chunks in flight at once (lina)."""
    lookahead: bool = True
    """Hold gradient chunks from the start of a backward combine, when an all-to-all is imminent (lina)."""
    predict: bool = True
    """Also hold a gradient chunk that would still be in flight when the next all-to-all (or other critical
    collective) arrives, predicted from the last step's event log (lina)."""
    a2a_chunks: int | None = None
    """Token chunks per all-to-all, expert compute pipelined with them; null: per layer from the cost model."""
    block_overlap: bool = False
    """Pro-Prophet: Trans of the next MoE layer under this layer's compute, Agg under the backward (eq. 8)."""
    timeout_s: float = 120.0
    """A collective not finished after this many seconds stops the run on every rank with an error."""
    trace_step: int = 3
    """Write comm_trace.json (Chrome trace of every rank) for this step; 0: none."""
    events: bool = True
    """Write every collective of every step to comm/rank<r>.jsonl in the run directory."""
    dilate: float = 1.0
    """> 1: the compute between two collectives lasts this many times its CPU time (emulates devices that much
    slower than a core when ranks outnumber cores; CPU benchmarks only, moebal/distributed/dilate.py). 1: off."""
    expert_packing: Literal["off", "lina"] = "off"
    """lina: more experts per rank (a smaller expert-parallel group, experts replicated over the rest) while an
    expert computation is shorter than its all-to-all and the saved all-to-all time exceeds the added
    expert-gradient all-reduce; decided once at start-up from measurements or the profile
    (moebal/balance/packing.py)."""


@dataclass(kw_only=True, frozen=True)
class PipelineConfig:
    """Pipeline stages (parallel.pp > 1, or a dynamism scheme's one stage): schedule, micro-batches and
    per-iteration layer rebalancing."""

    schedule: Literal["1f1b", "gpipe", "zb"] = "1f1b"
    """Pipeline schedule: 1f1b, gpipe, or zb (zero bubble: weight gradients deferred into the bubbles)."""
    micro_batches: int = 4
    """Micro-batches per iteration (capped at the rows of a data-parallel shard)."""
    rebalance: Literal["off", "partition", "diffusion"] = "off"
    """Layer rebalancing: static, exact min-max partition by measured time, or DynMo diffusion (adjacent moves)."""
    initial: Literal["uniform", "params"] = "uniform"
    """Starting partition: equal layer counts (Megatron) or equal parameter counts (DeepSpeed)."""
    split_layers: bool = False
    """Let a stage boundary fall between a dense layer's attention and FFN halves (finer partition units for
    rebalancing; MoE layers, and layers the dynamism scheme runs specially beyond their attention, stay whole).
    The start stays whole."""
    every: int = 10
    """Profile one iteration and plan every N steps."""
    ema: float = 0.5
    """Weight of the newest profile in the smoothed per-layer costs."""
    min_gain: float = 0.05
    """Adopt a plan only when it shortens the predicted iteration by at least this share (hysteresis)."""
    confirm: int = 2
    """Adopt a plan gaining less than min_gain (at least confirm_fraction of it) once proposed at this many
    consecutive plan points (0: never)."""
    confirm_fraction: float = 0.2
    """Share of min_gain that a plan proposed at `confirm` consecutive plan points must still gain, in [0, 1]."""
    repack: bool = False
    """Merge stages onto fewer ranks when fewer run nearly as fast; the freed ranks leave (exit 0)."""
    repack_slack: float = 0.1
    """Largest predicted slowdown accepted to release ranks."""
    min_stages: int = 2
    """Never re-pack below this many stages."""
    memory_cap: float | None = None
    """Bytes a stage may hold (parameters, gradients, optimizer state, in-flight activations); null: no cap."""
    wait: Literal["block", "spin"] = "block"
    """Receives sleep (block) or busy-wait (spin: emulates dedicated devices on a shared CPU, benchmarks only)."""
    dilate: float = 1.0
    """> 1: each forward/backward op lasts this many times its CPU time (emulates devices that much slower than
    a core when ranks outnumber cores; benchmarks only). 1: off."""
    microbatching: Literal["fixed", "dynamic", "padding", "packing"] = "fixed"
    """'fixed': micro_batches equal row splits; 'dynamic': DynaPipe (variable-size micro-batches by DP on a cost
    model, adaptive or 1F1B schedule, planned communication); 'padding'/'packing': its baselines, planned alike."""
    dynamic: DynamicMicroBatchConfig = field(default_factory=DynamicMicroBatchConfig)
    """Settings of planned micro-batching (microbatching dynamic, padding or packing)."""
    feedback: FeedbackConfig = field(default_factory=lambda: FeedbackConfig(enabled=True))
    """The layer balancer's closed loop (on by default: a migration keeps the losses bit for bit, so resume stays
    exact): an adopted partition runs `window` measured steps and is migrated back when slower than the one it
    replaced by more than `tolerance` (`balance/feedback.py`; always in windows: `interleave` and `recheck` do
    not apply, a partition cannot alternate step by step)."""


@dataclass(kw_only=True, frozen=True)
class EarlyExitConfig:
    """Early exit by hidden-state saturation (CALM): a token stops when cos(h_in, h_out) > threshold."""

    threshold: float = 0.99
    """Cosine similarity above which a token exits."""
    first_layer: int | None = None
    """First layer after which tokens may exit, at most n_layers - 2 (the last layer always runs); null:
    max(1, n_layers // 4)."""
    start: int = 0
    """Step at which the threshold starts to fall from 1 (nobody exits)."""
    ramp_steps: int = 0
    """Steps over which it falls to `threshold`."""


@dataclass(kw_only=True, frozen=True)
class MoDConfig:
    """Mixture-of-Depths: routed blocks process only the top `capacity` share of tokens."""

    capacity: float = 0.125
    """Share of a row's tokens a routed block keeps."""
    every: int = 2
    """Route every N-th layer ..."""
    first_layer: int = 1
    """... starting with this one."""
    start: int = 0
    """Step at which the capacity starts to fall from 1 (dense)."""
    ramp_steps: int = 0
    """Steps over which it falls to `capacity`."""
    subset_precision: Literal["auto", "autocast", "fp32"] = "auto"
    """Precision of a routed block under bf16 autocast: auto = fp32 on a CPU when it keeps at most half the
    tokens (small bf16 kernels are slower there), the run's autocast otherwise."""
    predictor: int = 0
    """Hidden width of each routed layer's causal predictor (0: none), a small MLP trained beside the run on
    whether a token is in its layer's top-capacity share, from the token's own state (detached: training's
    losses are unchanged). With one, `moebal generate` routes each token by its predictor (causal, KV-cached)."""


@dataclass(kw_only=True, frozen=True)
class FreezingConfig:
    """Front-to-back layer freezing on low parameter change."""

    threshold: float = 0.01
    """A layer freezes when its parameters moved less than this (relative) over a check window."""
    check_every: int = 10
    """Window length in steps."""
    max_fraction: float = 0.5
    """Freeze at most this share of the layers."""
    start: int = 0
    """First step at which layers may freeze."""


@dataclass(kw_only=True, frozen=True)
class PruningConfig:
    """Gradual global magnitude pruning (Zhu-Gupta cubic schedule)."""

    final_sparsity: float = 0.9
    """Target sparsity of the prunable matrices at the last pruning step."""
    initial_sparsity: float = 0.0
    """Sparsity at `start` (pruned after that step when above 0)."""
    start: int = 10
    """t0 of the schedule; pruning steps are start + k * every, k = 1..steps (and `start` itself when
    initial_sparsity is above 0)."""
    every: int = 10
    """Steps between pruning steps."""
    steps: int = 4
    """Number of pruning steps (n)."""
    kernel: Literal["auto", "dense", "csr"] = "auto"
    """Masked dense, CSR, or whichever was measured faster per matrix (auto: fastest, but a timing choice, so two
    runs of one seed may differ in the last bits; dense and csr are bitwise reproducible)."""


@dataclass(kw_only=True, frozen=True)
class MoECostConfig:
    """MoE routing as the per-layer cost source."""

    ep_size: int = 1
    """Ranks the experts are spread over (>1: the busiest expert sets a layer's time)."""


@dataclass(kw_only=True, frozen=True)
class SparseAttentionConfig:
    """Dynamic block-sparse attention: each layer keeps a moving share of its causal attention blocks."""

    budget: Literal["coverage", "random_walk"] = "coverage"
    """How each layer's density moves: coverage = the share of blocks that covered `coverage` of the pooled
    block-score mass last step; random_walk = DynMo's bounded random walk (a benchmark driver)."""
    block: int = 64
    """Tokens per attention block (must divide data.seq_len into at least 2 blocks)."""
    coverage: float = 0.9
    """Softmax mass of the pooled block scores the kept blocks must cover (budget coverage)."""
    min_density: float = 0.1
    """Lowest density a layer may run at."""
    max_density: float = 1.0
    """Highest density (1: dense)."""
    walk_step: float = 0.1
    """Largest per-step change of a layer's density (budget random_walk)."""
    start: int = 0
    """Layers run dense up to this step."""
    costs: Literal["measure", "given"] = "measure"
    """The cost prediction's two constants: measure = fit them on the job at start-up (every rank times its device,
    one agreed fit; the given values stay when the times cannot be fitted), given = attn_weight and overhead as set."""
    attn_weight: float = 1.6
    """Time per multiply-add of the attention core relative to the GEMMs, for the cost prediction (costs: given)."""
    overhead: float = 0.22
    """Fixed extra time of the sparse path as a share of the dense attention core, for the cost prediction (costs:
    given)."""
    seed: int = 0
    """Seed of the random walk."""
    depth_tilt: float = 0.0
    """Budget random_walk: 0 = every layer walks in [min_density, max_density]; t in (0, 1] = layer i walks in a
    band of width (1 - t) (max - min) that slides linearly from the top (first layer) to the bottom (last layer):
    densities correlated with depth (1: a fixed ramp)."""


@dataclass(kw_only=True, frozen=True)
class DynamismConfig:
    """Which dynamism scheme trains the model (and drifts per-layer cost), with each scheme's settings."""

    scheme: Literal["none", "pruning", "freezing", "early_exit", "mod", "moe", "sparse_attention"] = "none"
    """The scheme in use."""
    early_exit: EarlyExitConfig = field(default_factory=EarlyExitConfig)
    """Settings of `early_exit`."""
    mod: MoDConfig = field(default_factory=MoDConfig)
    """Settings of `mod`."""
    freezing: FreezingConfig = field(default_factory=FreezingConfig)
    """Settings of `freezing`."""
    pruning: PruningConfig = field(default_factory=PruningConfig)
    """Settings of `pruning`."""
    moe: MoECostConfig = field(default_factory=MoECostConfig)
    """Settings of `moe`."""
    sparse_attention: SparseAttentionConfig = field(default_factory=SparseAttentionConfig)
    """Settings of `sparse_attention`."""


@dataclass(kw_only=True, frozen=True)
class HFConfig:
    """Start from a Hugging Face checkpoint and export back to one (docs/hf-interop.md)."""

    init_from: str | None = None
    """HF checkpoint directory (Mixtral, LLaMA-MoE v1, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V2/V3): model.* and
    moe.* shape fields come from its config.json and its weights replace the random initialisation."""
    export_to: str | None = None
    """At the end of training, write the final weights here as a HF checkpoint (a relative path is inside
    the run directory); null: no export."""
    export_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """dtype of the exported weights; auto: that of hf.init_from's checkpoint (float32 without one)."""
    shard_gb: float = 5.0
    """Largest safetensors file of an export, in GB (above it the weights are sharded with an index)."""


def pipelined(pp: int, scheme: str) -> bool:
    """Whether `pp` stages under dynamism scheme `scheme` train on the pipeline engine: several stages, or a
    scheme's one stage (`Config.pipelined`; the memory plan's layouts ask the same)."""
    return pp > 1 or scheme != "none"


def tied_wire(par: ParallelConfig) -> str:
    """The precision ("fp32" or "bf16") in which a pipeline's tied embedding's stepped weight travels to the last
    stage's head copy: the sharded optimizer's compute copies' (`parallel.param_dtype`; the embedding is one of
    them), else fp32 (the weight itself; under `full` the gathered fp32 shards). Pure, so that `moebal simulate`
    prices the message without importing torch (`moebal.pipeline.tied.wire_dtype` is its torch dtype)."""
    return par.param_dtype if par.shard == "optimizer" else "fp32"


@dataclass(kw_only=True, frozen=True)
class Config:
    """A whole moebal run."""

    name: str = "default"
    """Run name; the run directory is out_dir/name-<timestamp> unless --out is given."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Model shape."""
    moe: MoEConfig = field(default_factory=MoEConfig)
    """MoE blocks and routing."""
    data: DataConfig = field(default_factory=DataConfig)
    """Corpus and samples."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Optimisation."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Parallel layout."""
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    """Expert placement planning (used when parallel.ep > 1)."""
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    """Communication scheduling (used when parallel.ep > 1)."""
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    """Pipeline schedule and layer rebalancing (used when the run is pipelined: parallel.pp > 1, or a dynamism
    scheme's one-stage pipeline)."""
    dynamism: DynamismConfig = field(default_factory=DynamismConfig)
    """Dynamic-model scheme (pruning, freezing, early exit, Mixture-of-Depths, MoE routing cost)."""
    hf: HFConfig = field(default_factory=HFConfig)
    """Hugging Face checkpoints to start from and export to."""

    def __post_init__(self) -> None:
        _check_whole(self)

    # ---- derived values (never written back into the config) ----
    @property
    def head_dim(self) -> int:
        return self.model.head_dim or self.model.dim // self.model.n_heads

    @property
    def expert_ffn_dim(self) -> int:
        return self.moe.expert_ffn_dim or self.model.ffn_dim

    @property
    def shared_expert_ffn_dim(self) -> int:
        """Width of an MoE layer's shared expert block: moe.shared_ffn_dim, else shared_experts x expert_ffn_dim;
        0 without shared experts."""
        moe = self.moe
        return (moe.shared_ffn_dim or moe.shared_experts * self.expert_ffn_dim) if moe.shared_experts else 0

    @property
    def microbatch_max_tokens(self) -> int:
        """The largest micro-batch (tokens) planned micro-batching's cost table covers: pipeline.dynamic.max_tokens,
        else 4 x data.seq_len."""
        return self.pipeline.dynamic.max_tokens or 4 * self.data.seq_len

    def is_moe_layer(self, i: int) -> bool:
        return (self.moe.num_experts > 0 and (i + 1) % self.moe.every == 0 and i >= self.moe.first_dense
                and i not in self.moe.dense_layers)

    @property
    def pipelined(self) -> bool:
        """The run trains on the pipeline engine (moebal.pipeline): parallel.pp > 1, or a dynamism scheme, which
        runs there only (with parallel.pp 1 as a one-stage pipeline: its micro-batches, `pipeline.micro_batches`,
        are the accumulation, and the trainer without a pipeline's own options, `train.grad_accum` among them, do
        not apply; docs/dynamism.md)."""
        return pipelined(self.parallel.pp, self.dynamism.scheme)


# --------------------------------------------------------------------------------------------
# loading


def load(path: str | Path | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """Config from a YAML file (a path or a preset name in configs/) plus `a.b=value` overrides.

    With `hf.init_from`, the model's shape comes from the checkpoint's config.json, which this module does not
    read: `moebal.interop.hf_config.load` fills it in (what the commands call). Here such a config loads only
    when it states the shape itself (`model.dim`, `model.n_layers` and `model.vocab_size`: a run's resolved
    config.yaml)."""
    data, source = load_data(path, overrides)
    hf = data.get("hf")
    init = hf.get("init_from") if isinstance(hf, dict) else None
    model = data.get("model")
    shaped = isinstance(model, dict) and all(k in model for k in ("dim", "n_layers", "vocab_size"))
    if isinstance(init, str) and init and not shaped:
        raise ConfigError(f"{source}: hf.init_from is set, so model.* and moe.* come from {init}/config.json: "
                          f"load this config with moebal.interop.hf_config.load (as `moebal train` does)")
    return from_dict(data, source=source)


def load_data(path: str | Path | None = None, overrides: typing.Sequence[str] = ()) -> tuple[dict[str, Any], str]:
    """The plain data of a config file (a path or a preset name; None: the defaults) with `a.b=value` overrides
    applied, and the name of its source (for messages)."""
    data: dict[str, Any] = {}
    source = "the defaults"
    if path is not None:
        p = resolve_path(path)
        source = str(p)
        data = _read_yaml(p)
    for item in overrides:
        _apply_override(data, item)
    # a refusal may come from either: the message says both were read
    return data, f"{source} + overrides" if overrides else source


def resolve_path(path: str | Path) -> Path:
    """A config path as given, or a preset name (`mixtral-8x7b`) looked up in configs/."""
    p = Path(path)
    if p.is_file():
        return p
    for cand in (CONFIG_DIR / f"{path}.yaml", CONFIG_DIR / str(path)):
        if cand.is_file():
            return cand
    presets = sorted(q.stem for q in CONFIG_DIR.glob("*.yaml") if not q.stem.startswith("cluster-"))
    hint = f"; presets: {', '.join(presets)}" if presets else ""
    raise ConfigError(f"config file '{path}' not found: give a YAML path or a preset name{hint}")


class _NumberLoader(yaml.SafeLoader):
    """yaml.safe_load with YAML 1.2's numbers and no dates. PyYAML reads YAML 1.1, where a leading zero is octal
    and a colon base 60: `train.seed=010` was seed 8 (as was 008) and `train.time_limit_min=4:30` 270 minutes.
    Here an integer is decimal (leading zeros allowed: 010 is 10), `0x`/`0o`/`0b` name their base, a float needs
    no dot for its exponent (1e-4), and `4:30` or `2024-01-01` stay strings, which a number field then refuses
    and a string field takes as written. Booleans keep YAML 1.1's words (on/off/yes/no), which the choice fields'
    checks explain."""

    def construct_yaml_int(self, node: yaml.Node) -> int:
        text = str(self.construct_scalar(node)).replace("_", "")
        sign, digits = (-1, text[1:]) if text[:1] == "-" else (1, text.lstrip("+"))
        base = {"0x": 16, "0o": 8, "0b": 2}.get(digits[:2].lower(), 10)
        return sign * int(digits[2:] if base != 10 else digits, base)


_NumberLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers
            if tag not in ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float", "tag:yaml.org,2002:timestamp")]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_NumberLoader.add_implicit_resolver(
    "tag:yaml.org,2002:int", re.compile(r"^(?:[-+]?[0-9][0-9_]*|0[xX][0-9a-fA-F_]+|0[oO][0-7_]+|0[bB][01_]+)$"),
    list("-+0123456789"))
_NumberLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^(?:[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)(?:[eE][-+]?[0-9]+)?"
                                          r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+0123456789."))
_NumberLoader.add_constructor("tag:yaml.org,2002:int", _NumberLoader.construct_yaml_int)


class _UniqueKeyLoader(_NumberLoader):
    """yaml.safe_load that refuses a key given twice in one mapping (PyYAML silently keeps the last one, so a
    second `lr:` further down a section would quietly win). Keys brought in by a `<<` merge may be overridden."""

    def construct_mapping(self, node: yaml.Node, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value if isinstance(node, yaml.MappingNode) else ():
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, typing.Hashable) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice in one mapping (first on line {seen[key] + 1}): "
                                f"keep one", key_node.start_mark)
            if isinstance(key, typing.Hashable):
                seen[key] = key_node.start_mark.line
        mapping: dict[Any, Any] = super().construct_mapping(node, deep=deep)  # PyYAML has no stubs: Any
        return mapping


def _read_yaml(p: Path) -> dict[str, Any]:
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{p}: cannot read config ({e})") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {_one_line(e)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the top level must be a mapping of sections (model:, moe:, ...), "
                          f"got {type(data).__name__}")
    return data


def _apply_override(data: dict[str, Any], item: str) -> None:
    if not isinstance(item, str) or "=" not in item:
        raise ConfigError(f"override {item!r} must look like section.key=value, e.g. train.steps=100")
    key, _, raw = item.partition("=")
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override {item!r}: empty key segment in '{key}'")
    try:
        value = yaml.load(raw, Loader=_NumberLoader) if raw.strip() else ""  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError:
        value = raw
    node = data
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override {item!r}: '{part}' is a value, not a section")
        node = child
    node[parts[-1]] = value


def from_dict(data: Any, source: str = "<dict>") -> Config:
    """Build and validate a Config from plain data (the parsed YAML)."""
    return typing.cast(Config, _build(Config, data, source, ""))


def build_schema(cls: type[T], data: Any, source: str = "<dict>") -> T:
    """Build any schema dataclass (the run's Config, a cluster description, ...) from plain data, with the
    same checks and messages as the run config: unknown keys, types, and the class's own validation."""
    return typing.cast(T, _build(cls, data, source, ""))


def read_yaml(path: str | Path) -> dict[str, Any]:
    """A YAML file's top-level mapping; ConfigError naming the file when it cannot be read or parsed."""
    return _read_yaml(Path(path))


def apply_override(data: dict[str, Any], item: str) -> None:
    """Apply one `a.b=value` override (the value read as YAML) to nested plain data, in place."""
    _apply_override(data, item)


def _build(cls: type, data: Any, source: str, prefix: str) -> Any:
    where = prefix.rstrip(".") or "the top level"
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: '{where}' must be a mapping, got {_show(data)}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if not isinstance(key, str) or key not in names:
            close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.5)
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else f"; valid keys: {', '.join(names)}"
            raise ConfigError(f"{source}: unknown key '{prefix}{key}'{hint}")
        kwargs[key] = _coerce(hints[key], value, source, f"{prefix}{key}")
    missing = [f.name for f in dataclasses.fields(cls) if f.name not in kwargs
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{source}: missing required key(s) {', '.join(prefix + k for k in missing)}")
    try:
        return cls(**kwargs)
    except ConfigError as e:  # a section's own check: named, unless its message names its keys already
        said = str(e) if not prefix or prefix in str(e) else f"'{where}': {e}"
        raise ConfigError(f"{source}: {said}") from None


def _coerce(tp: Any, value: Any, source: str, key: str) -> Any:
    """Check (and gently convert: YAML reads 3e-4 as a string) one value against its type."""
    if dataclasses.is_dataclass(tp):
        return _build(typing.cast(type, tp), value, source, key + ".")
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if origin is tuple:  # tuple[X, ...]: a YAML list (tuples keep the frozen sections hashable)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{source}: '{key}' must be a list; got {_show(value)}")
        item = typing.get_args(tp)[0]
        return tuple(_coerce(item, v, source, f"{key}[{i}]") for i, v in enumerate(value))
    if origin is dict:  # dict[str, X]: a YAML mapping
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: '{key}' must be a mapping; got {_show(value)}")
        item = typing.get_args(tp)[1]
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ConfigError(f"{source}: '{key}' keys must be strings; got {_show(k)}")
            if v is None and ":" in k:  # `{a.txt:0.5}`: YAML needs a space after a mapping's colon
                raise ConfigError(f"{source}: '{key}' entry {k!r} has no value: write a space after the colon, "
                                  f"e.g. {{{k.replace(':', ': ', 1)}}}")
            out[k] = _coerce(item, v, source, f"{key}.{k}")
        return out
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        errors = []
        for a in inner:
            try:
                return _coerce(a, value, source, key)
            except ConfigError as e:
                errors.append(e)
        raise errors[0]
    if origin is Literal:
        choices = typing.get_args(tp)
        if isinstance(value, bool) and ("off" if not value else "on") in choices:
            # YAML 1.1 reads an unquoted off/on (and no/yes) as a bool: `scheduler.mode=off` means the choice
            return "off" if not value else "on"
        if value in choices:
            return value
        close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        shown = (f"{value} (YAML's reading of an unquoted {'on, yes or true' if value else 'off, no or false'})"
                 if isinstance(value, bool) else _show(value))
        raise ConfigError(f"{source}: '{key}' must be one of {', '.join(map(str, choices))}; got {shown}{hint}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{source}: '{key}' must be true or false; got {_show(value)}")
    if tp is int:
        if isinstance(value, str):
            value = _parse_number(value)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, int) and not isinstance(value, bool):
            if abs(value) > MAX_INT:  # a count this size overflows torch and the standard library far into a run
                raise ConfigError(f"{source}: '{key}' is {value}, beyond any run (at most 2**62): lower it")
            return value
        raise ConfigError(f"{source}: '{key}' must be an integer; got {_show(value)}")
    if tp is float:
        if isinstance(value, str):
            value = _parse_number(value)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
        raise ConfigError(f"{source}: '{key}' must be a finite number; got {_show(value)}")
    if tp is str:
        if isinstance(value, str):
            return value
        kind = "true/false" if isinstance(value, bool) else "a number"
        quote = (f" (YAML reads it as {kind}: quote the value as you meant it, in a file {key.split('.')[-1]}: "
                 f"'...', on a command line {key}=\"'...'\")" if isinstance(value, (bool, int, float)) else "")
        raise ConfigError(f"{source}: '{key}' must be a string; got {_show(value)}{quote}")
    raise TypeError(f"config field {key} has an unsupported type {tp!r}")  # a schema bug, not user input


def _parse_number(s: str) -> Any:
    try:
        return int(s)
    except ValueError:
        pass
    try:
        return float(s)
    except ValueError:
        return s


def _show(value: Any) -> str:
    text = repr(value)
    return (text[:60] + "...") if len(text) > 63 else text


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())


# --------------------------------------------------------------------------------------------
# validation: every impossible combination says what to change


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _divisors(n: int, most: int = 24) -> str:
    """The divisors of `n` for an error message: the first `most` of them, found up to sqrt(n) within a bounded
    search (a mistyped count of 1e30 experts must not hang the loader)."""
    small: list[int] = []
    k = 1
    while k * k <= n and k <= 10**6:
        if n % k == 0:
            small.append(k)
        k += 1
    found = sorted(set(small) | {n // k for k in small})
    return ", ".join(map(str, found[:most])) + (", ..." if len(found) > most or k * k <= n else "")


REFUSE_REBALANCE_PP1 = ("pipeline.rebalance and pipeline.repack move layers between pipeline stages, and parallel.pp "
                        "1 has one stage: set parallel.pp >= 2, or pipeline.rebalance=off and pipeline.repack=false")
REFUSE_PLANNED_REPACK = ("planned micro-batching (pipeline.microbatching dynamic, padding or packing) with "
                         "re-packing and a micro-batch cost table file (pipeline.dynamic.costs *.json) is not "
                         "supported: a re-pack plans the micro-batches again for fewer stages, and the file's table "
                         "describes the launch's stages; set pipeline.dynamic.costs measure or a hardware profile, "
                         "or pipeline.repack=false")


def planned_moe_losses(c: Config) -> bool:
    """Whether the model's MoE layers sum routing statistics over a stage's ranks (for the load-balancing or
    the z-loss) at every micro-batch: planned micro-batches then run every rank of a stage in lockstep."""
    return c.moe.num_experts > 0 and (c.moe.aux_loss_coef > 0 or c.moe.z_loss_coef > 0)


def _check_whole(c: Config) -> None:
    m, moe, d, t, par = c.model, c.moe, c.data, c.train, c.parallel
    for key, v in [("model.vocab_size", m.vocab_size), ("model.dim", m.dim), ("model.n_layers", m.n_layers),
                   ("model.n_heads", m.n_heads), ("model.n_kv_heads", m.n_kv_heads), ("model.ffn_dim", m.ffn_dim),
                   ("model.max_seq_len", m.max_seq_len), ("data.seq_len", d.seq_len),
                   ("data.batch_size", d.batch_size), ("moe.top_k", moe.top_k), ("moe.every", moe.every),
                   ("parallel.nproc", 1 if par.nproc is None else par.nproc),
                   ("parallel.ep", 1 if par.ep is None else par.ep), ("parallel.pp", par.pp)]:
        _need(v >= 1, f"'{key}' must be at least 1; got {v}")
    for key, fv in [("model.rope_theta", m.rope_theta), ("model.norm_eps", m.norm_eps),
                    ("model.init_std", m.init_std), ("train.lr", t.lr), ("parallel.timeout_min", par.timeout_min)]:
        _need(fv > 0, f"'{key}' must be positive; got {fv}")
    _need(par.shard in ("full", "auto", "optimizer") or (par.param_dtype, par.reduce_dtype) == ("fp32", "fp32"),
          f"'parallel.param_dtype: {par.param_dtype}' / 'parallel.reduce_dtype: {par.reduce_dtype}' are the sharded "
          f"state's mixed-precision policy: set parallel.shard=full or optimizer, or leave both fp32")
    _need(par.param_dtype == "fp32" or t.precision == "bf16",
          "'parallel.param_dtype: bf16' computes dense layers in bf16 beside fp32 expert weights, which needs bf16 "
          "autocast: set train.precision=bf16, or parallel.param_dtype=fp32")
    _need(par.param_dtype == "fp32" or not c.moe.router_fp32,
          "'moe.router_fp32' computes the router from an fp32 weight, and 'parallel.param_dtype: bf16' keeps every "
          "dense weight's compute copy, the router's included, in bf16: set parallel.param_dtype=fp32 (bf16 "
          "autocast still computes the layers in bf16), or moe.router_fp32=false")
    _need(m.n_heads % m.n_kv_heads == 0,
          f"'model.n_kv_heads' ({m.n_kv_heads}) must divide 'model.n_heads' ({m.n_heads})")
    _need(m.head_dim is not None or m.dim % m.n_heads == 0,
          f"'model.dim' ({m.dim}) is not divisible by 'model.n_heads' ({m.n_heads}): change one or set model.head_dim")
    _need(m.head_dim is None or (m.head_dim >= 2 and m.head_dim % 2 == 0),
          f"'model.head_dim' must be an even number >= 2 for rotary embeddings; got {m.head_dim}")
    _need(m.head_dim is not None or (m.dim // m.n_heads) % 2 == 0,
          f"model.dim / model.n_heads = {m.dim // m.n_heads} must be even for rotary embeddings")
    _need(d.seq_len <= m.max_seq_len, _seq_len_advice(c))
    _need(m.sliding_window is None or m.sliding_window >= 1,
          f"'model.sliding_window' must be at least 1 (or null for full attention); got {m.sliding_window}")
    _need(d.tokenizer != "byte" or m.vocab_size >= 256,
          f"the byte tokenizer needs 'model.vocab_size' >= 256; got {m.vocab_size}")
    _need(0.0 <= d.val_fraction < 1.0, f"'data.val_fraction' must be in [0, 1); got {d.val_fraction}")
    _need(d.max_bytes is None or d.max_bytes > 0, f"'data.max_bytes' must be positive or null; got {d.max_bytes}")
    for src, w in (d.mixture or {}).items():
        _need(w > 0, f"'data.mixture.{src}' is a sampling weight and must be positive; got {w}")
    # an empty path (an unset shell variable) would read as the working directory
    for key, text in [("data.source", d.source), ("data.tokenizer", d.tokenizer), ("data.text_key", d.text_key),
                      *((f"data.mixture key {k!r}", k) for k in d.mixture or {})]:
        _need(bool(text.strip()), f"'{key}' is empty: name a path (or set the key's default back)")
    for key, opt in [("hf.init_from", c.hf.init_from), ("planner.path_profile", c.planner.path_profile)]:
        _need(opt is None or bool(opt.strip()), f"'{key}' is empty: name a path, or null for none")
    if d.order == "complexity":
        _need(c.moe.num_experts > 0 and c.moe.top_k > 1 and c.moe.adaptive_threshold is not None,
              "'data.order: complexity' orders samples by how many tokens the adaptive gate sends to two experts: "
              "it needs an MoE model with moe.top_k >= 2 and moe.adaptive_threshold set (e.g. 0.1)")
        _need(not d.mixture, "'data.order: complexity' with a data.mixture is not supported: use one data.source")
        _check_whole_routing(c, "'data.order: complexity'", "use data.order shuffle")
    _check_moe(c)
    _check_mla(m)
    _need(m.mla is None or c.dynamism.scheme not in ("mod", "early_exit", "sparse_attention"),
          f"'dynamism.scheme: {c.dynamism.scheme}' runs attention on token subsets with grouped-query attention's "
          f"projections; with model.mla (multi-head latent attention) use another scheme")
    # the per-sequence balancing loss: a token subset's rows are gone
    _need(c.moe.num_experts == 0 or c.moe.aux_loss_scope != "sequence" or c.dynamism.scheme not in SUBSET_SCHEMES,
          f"'moe.aux_loss_scope: sequence' balances each sequence's routing, but 'dynamism.scheme: "
          f"{c.dynamism.scheme}' routes token subsets that hold no whole sequence: set moe.aux_loss_scope=layer")
    _check_train(t)
    _check_grad_accum(c)
    _check_step_hold(par, c)
    if t.record_routing_every:
        _need(c.moe.num_experts > 0, "'train.record_routing_every' records the routing of the MoE layers: it "
              "needs an MoE model (moe.num_experts > 0); set it to 0")
        _check_whole_routing(c, "'train.record_routing_every'", "set it to 0")
    _need(c.planner.every >= 1, f"'planner.every' must be at least 1; got {c.planner.every}")
    _need(c.planner.ema is None or 0.0 <= c.planner.ema < 1.0,
          f"'planner.ema' is a weight in [0, 1) (or null); got {c.planner.ema}")
    _need(c.planner.hysteresis >= 0, f"'planner.hysteresis' must be >= 0; got {c.planner.hysteresis}")
    _need(c.planner.max_replicas is None or c.planner.max_replicas >= 0,
          f"'planner.max_replicas' must be >= 0 or null (no cap); got {c.planner.max_replicas}")
    _check_plan_ahead(c)

    _check_pipeline(c.pipeline)
    _need(par.pp > 1 or (c.pipeline.rebalance == "off" and not c.pipeline.repack), REFUSE_REBALANCE_PP1)
    _need(c.hf.shard_gb > 0, f"'hf.shard_gb' must be positive; got {c.hf.shard_gb}")
    if c.pipeline.microbatching != "fixed":
        mb = f"pipeline.microbatching={c.pipeline.microbatching}"
        _need(par.pp > 1, f"{mb} plans the micro-batches of a pipeline: set parallel.pp > 1 (or microbatching fixed)")
        _need(not c.pipeline.repack or not c.pipeline.dynamic.costs.endswith(".json"), REFUSE_PLANNED_REPACK)
        from moebal.planner.microbatch_cost import MIN_GRID_LEN

        cap = c.pipeline.dynamic.max_tokens
        tokens = f"{cap}" if cap is not None else f"null: 4 x data.seq_len = {c.microbatch_max_tokens}"
        _need(c.microbatch_max_tokens >= max(c.data.seq_len, MIN_GRID_LEN),
              f"{mb} plans from a cost table of micro-batches of up to pipeline.dynamic.max_tokens tokens ({tokens}), "
              f"which must hold one row of data.seq_len ({c.data.seq_len}) and of the table's smallest length "
              f"({MIN_GRID_LEN}): set pipeline.dynamic.max_tokens to at least {max(c.data.seq_len, MIN_GRID_LEN)}")
        # every scheme runs on planned micro-batches: freezing's frozen prefix skips the gradient messages at a
        # boundary on both sides, early exit's active mask travels with the activations, and MoD and early exit
        # know each padded row's real tokens (`dynamism.scheme.ROW_TOKENS`)
        block = c.dynamism.sparse_attention.block
        _need(c.dynamism.scheme != "sparse_attention" or c.pipeline.dynamic.pad_multiple % block == 0,
              f"{mb} pads each micro-batch to a multiple of pipeline.dynamic.pad_multiple "
              f"({c.pipeline.dynamic.pad_multiple}), and dynamic sparse attention needs whole blocks of "
              f"dynamism.sparse_attention.block ({block}): set pipeline.dynamic.pad_multiple to a multiple of {block}")
    _check_scheduler(c.scheduler)
    if c.scheduler.expert_packing != "off":
        _need(c.moe.num_experts > 0,
              "'scheduler.expert_packing: lina' chooses the expert-parallel size of an MoE model: set "
              "moe.num_experts > 0, or scheduler.expert_packing off")
    _need(par.pp <= m.n_layers,
          f"'parallel.pp' ({par.pp}) is larger than 'model.n_layers' ({m.n_layers}): a stage needs a layer")


def _seq_len_advice(c: Config) -> str:
    m, d = c.model, c.data
    head = f"'data.seq_len' ({d.seq_len}) exceeds 'model.max_seq_len' ({m.max_seq_len})"
    if c.hf.init_from:  # max_seq_len is the checkpoint's max_position_embeddings: only one side may move
        return (f"{head}, the longest sequence of hf.init_from's checkpoint (max_position_embeddings): lower "
                f"data.seq_len to at most {m.max_seq_len}")
    return f"{head}: lower one or raise the other"


def _check_moe(c: Config) -> None:
    moe, par = c.moe, c.parallel
    _need(moe.num_experts >= 0, f"'moe.num_experts' must be >= 0 (0 = dense model); got {moe.num_experts}")
    if moe.num_experts == 0:
        return
    _need(moe.top_k <= moe.num_experts,
          f"'moe.top_k' ({moe.top_k}) is larger than 'moe.num_experts' ({moe.num_experts}): lower top_k")
    _need(moe.expert_ffn_dim is None or moe.expert_ffn_dim >= 1,
          f"'moe.expert_ffn_dim' must be at least 1 or null; got {moe.expert_ffn_dim}")
    _need(moe.shared_ffn_dim is None or moe.shared_ffn_dim >= 1,
          f"'moe.shared_ffn_dim' must be at least 1, or null for shared_experts x expert_ffn_dim; got "
          f"{moe.shared_ffn_dim}")
    if par.ep is not None and moe.num_experts % par.ep:  # the divisors listed only then (a huge count is cheap)
        raise ConfigError(f"'moe.num_experts' ({moe.num_experts}) is not divisible by 'parallel.ep' ({par.ep}): "
                          f"choose ep among {_divisors(moe.num_experts)}")
    _need(moe.capacity_factor is None or moe.capacity_factor > 0,
          f"'moe.capacity_factor' must be positive, or null for dropless; got {moe.capacity_factor}")
    _need(moe.adaptive_threshold is None or 0.0 <= moe.adaptive_threshold <= 1.0,
          f"'moe.adaptive_threshold' is a probability gap in [0, 1] (or null); got {moe.adaptive_threshold}")
    _need(moe.shared_experts >= 0, f"'moe.shared_experts' must be >= 0; got {moe.shared_experts}")
    negative = [f"moe.{k}={getattr(moe, k)}" for k in ("jitter", "aux_loss_coef", "z_loss_coef", "bias_update_rate")
                if not getattr(moe, k) >= 0.0]
    _need(not negative, f"{', '.join(negative)}: must be >= 0")
    _need(moe.jitter < 1.0, f"'moe.jitter' scales the router's input by a factor in [1 - jitter, 1 + jitter]: it must "
                            f"be below 1; got {moe.jitter}")
    _need(moe.norm_topk or moe.gate != "topk_softmax",
          "'moe.norm_topk: false' keeps the chosen experts' own scores, which 'moe.gate: topk_softmax' never computes: "
          "set moe.gate=softmax_topk (or sigmoid_topk)")
    _check_groups(moe)
    _need(0 <= moe.first_dense < c.model.n_layers,
          f"'moe.first_dense' ({moe.first_dense}) must be in 0..model.n_layers - 1 ({c.model.n_layers - 1}): "
          f"at least one layer must be MoE")
    _need(moe.router_noise is None or moe.router_noise >= 0.0,
          f"'moe.router_noise' is the noise floor epsilon, >= 0 (or null to disable); got {moe.router_noise}")
    _need(not moe.shared_gate or moe.shared_experts > 0,
          "'moe.shared_gate: true' gates the shared expert, but moe.shared_experts is 0: set shared_experts >= 1")
    _need(moe.every <= c.model.n_layers,
          f"'moe.every' ({moe.every}) is larger than 'model.n_layers' ({c.model.n_layers}): no layer would be MoE")
    bad = [i for i in moe.dense_layers if not 0 <= i < c.model.n_layers]
    _need(not bad, f"'moe.dense_layers' names layers {bad} outside 0..{c.model.n_layers - 1}: remove them")
    _need(any(c.is_moe_layer(i) for i in range(c.model.n_layers)),
          f"moe.every ({moe.every}), moe.first_dense ({moe.first_dense}) and moe.dense_layers "
          f"({list(moe.dense_layers)}) leave none of the {c.model.n_layers} layers MoE: keep at least one, or set "
          "moe.num_experts=0 for a dense model")


def _check_mla(m: ModelConfig) -> None:
    a, r = m.mla, m.rope_scaling
    _need(r is None or a is not None, "'model.rope_scaling' (yarn) is implemented for multi-head latent attention "
                                      "only: set model.mla, or remove model.rope_scaling")
    if r is not None:
        _need(r.factor >= 1.0 and r.original_max_seq_len >= 1 and r.beta_fast > 0 and r.beta_slow > 0,
              f"'model.rope_scaling' needs factor >= 1, original_max_seq_len >= 1 and positive betas; got {r}")
    if a is None:
        return
    _need(m.qk_norm == "none" and m.sliding_window is None,
          "multi-head latent attention has no q/k norm option and no sliding window: set model.qk_norm=none and "
          "model.sliding_window=null, or remove model.mla")
    for key, v in (("kv_lora_rank", a.kv_lora_rank), ("qk_nope_head_dim", a.qk_nope_head_dim),
                   ("v_head_dim", a.v_head_dim), ("q_lora_rank", 1 if a.q_lora_rank is None else a.q_lora_rank)):
        _need(v >= 1, f"'model.mla.{key}' must be at least 1; got {v}")
    _need(a.qk_rope_head_dim >= 2 and a.qk_rope_head_dim % 2 == 0,
          f"'model.mla.qk_rope_head_dim' must be an even number >= 2 (rotary pairs); got {a.qk_rope_head_dim}")
    _need(m.n_kv_heads == m.n_heads, f"multi-head latent attention expands the latent into every head: set "
                                     f"'model.n_kv_heads' to model.n_heads ({m.n_heads}); got {m.n_kv_heads}")


def _check_groups(moe: MoEConfig) -> None:
    E, G, tg = moe.num_experts, moe.n_group, moe.topk_group
    if G < 1 or E % G:
        raise ConfigError(f"'moe.n_group' ({G}) must be a positive divisor of 'moe.num_experts' ({E}): choose among "
                          f"{_divisors(E)}")
    _need(tg is None or 1 <= tg <= G, f"'moe.topk_group' must be in 1..moe.n_group ({G}), or null for every group; "
                                      f"got {tg}")
    allowed = (tg or G) * (E // G)
    _need(moe.top_k <= allowed, f"'moe.top_k' ({moe.top_k}) is more than the {allowed} experts of moe.topk_group={tg} "
                                f"groups of {E // G}: raise moe.topk_group or lower moe.top_k")
    _need(moe.group_score != "top2_sum" or G == 1 or E // G >= 2,
          f"'moe.group_score: top2_sum' sums each group's two best scores, but moe.n_group={G} leaves one expert per "
          f"group: use group_score max or fewer groups")
    _need(moe.adaptive_threshold is None or moe.norm_topk or moe.gate != "sigmoid_topk",
          "'moe.adaptive_threshold' compares normalised top-k scores: with moe.gate sigmoid_topk set "
          "moe.norm_topk=true")


def _check_plan_ahead(c: Config) -> None:
    pl = c.planner
    _need(pl.plan_ahead in ("off", "path"), f"'planner.plan_ahead' must be off or path; got {pl.plan_ahead!r}")
    _need(pl.path_len >= 1 and pl.path_refresh >= 1 and pl.path_window >= pl.path_refresh,
          f"'planner.path_len' ({pl.path_len}) and 'planner.path_refresh' ({pl.path_refresh}) must be at least 1 and "
          f"'planner.path_window' ({pl.path_window}) at least path_refresh")
    if pl.plan_ahead == "off":
        return
    _need(pl.policy != "static", "'planner.plan_ahead: path' plans replicas; with planner.policy static there is "
          "nothing to plan: set planner.policy to prophet (or plan_ahead off)")
    par = c.parallel
    stage_ep = par.ep if par.ep is not None else (par.nproc // par.pp if par.nproc else None)  # null: the stage
    _need(not c.pipelined or stage_ep != 1, "'planner.plan_ahead: path' places experts; a pipeline "
          "(parallel.pp > 1, or a dynamism scheme's one stage) with parallel.ep 1 has no expert-parallel group to "
          "place them in: set parallel.ep > 1 (or plan_ahead off)")
    _need(c.pipelined or stage_ep != 1, "'planner.plan_ahead: path' places experts over expert-parallel ranks; "
          f"{'parallel.nproc 1 (one process)' if par.ep is None else 'parallel.ep 1'} has none: launch at least 2 "
          "ranks with parallel.ep > 1 (or plan_ahead off)")
    _need(c.dynamism.scheme not in SUBSET_SCHEMES,
          f"'planner.plan_ahead: path' follows every token through every MoE layer; dynamism.scheme "
          f"{c.dynamism.scheme} runs layers on token subsets: set plan_ahead off")
    _need(pl.path_profile is None or Path(pl.path_profile).is_file(),
          f"'planner.path_profile' {pl.path_profile!r} is not a file: build one with `moebal paths RUN_DIR -o FILE`, "
          f"or set it to null to build the profile online")
    n_moe = sum(1 for i in range(c.model.n_layers) if c.is_moe_layer(i))
    _need(pl.path_len < n_moe, f"'planner.plan_ahead: path' plans MoE layer j from the path through the "
          f"planner.path_len ({pl.path_len}) MoE layers before it, so only layers path_len.. of the model's {n_moe} "
          f"MoE layers: none here; set planner.path_len below {n_moe} (or plan_ahead off)")


def _check_pipeline(p: PipelineConfig) -> None:
    dyn = p.dynamic
    hints = typing.get_type_hints(PipelineConfig)  # a Config built in code skips the loader's choice checks
    for key in ("schedule", "rebalance", "initial", "wait", "microbatching"):
        allowed, value = typing.get_args(hints[key]), getattr(p, key)
        _need(value in allowed, f"'pipeline.{key}' must be one of {', '.join(allowed)}; got {value!r}")
    _need(p.dilate >= 1.0, f"'pipeline.dilate' must be >= 1 (1: off); got {p.dilate}")
    _need(not p.split_layers or p.microbatching == "fixed",
          f"'pipeline.split_layers: true' runs fixed micro-batches; planned micro-batching ({p.microbatching!r}) "
          "profiles and plans whole layers: set pipeline.split_layers to false, or pipeline.microbatching to fixed")
    _need(p.schedule != "zb" or p.microbatching == "fixed",
          f"'pipeline.schedule: zb' runs fixed micro-batches; planned micro-batching ({p.microbatching!r}) chooses "
          "its own schedules from 'pipeline.dynamic.schedules': set pipeline.schedule to 1f1b, or "
          "pipeline.microbatching to fixed")
    _need(dyn.thin >= 0, f"'pipeline.dynamic.thin' must be >= 0 (0: exact DP); got {dyn.thin}")
    _need(dyn.pad_multiple >= 1 and dyn.workers >= 0 and dyn.lookahead >= 1,
          f"'pipeline.dynamic.pad_multiple' and 'lookahead' must be >= 1 and 'workers' >= 0; got "
          f"{dyn.pad_multiple}, {dyn.lookahead}, {dyn.workers}")
    _need(dyn.memory is None or dyn.memory > 0, f"'pipeline.dynamic.memory' must be positive or null; got {dyn.memory}")
    _need(dyn.max_tokens is None or dyn.max_tokens >= 1,
          f"'pipeline.dynamic.max_tokens' must be positive or null; got {dyn.max_tokens}")
    bad = [x for x in dyn.schedules.split(",") if x.strip() not in ("1f1b", "adaptive")]
    _need(not bad and dyn.schedules.strip() != "",
          f"'pipeline.dynamic.schedules' is a comma list of 1f1b, adaptive; got {dyn.schedules!r}")
    _need(p.micro_batches >= 1 and p.every >= 1,
          f"'pipeline.micro_batches' ({p.micro_batches}) and 'pipeline.every' ({p.every}) must be at least 1")
    _need(0.0 < p.ema <= 1.0, f"'pipeline.ema' is the newest profile's weight, in (0, 1]; got {p.ema}")
    _need(p.repack_slack >= 0.0 and p.min_gain >= 0.0 and p.confirm >= 0,
          f"'pipeline.repack_slack', 'pipeline.min_gain' and 'pipeline.confirm' must be >= 0; got {p.repack_slack}, "
          f"{p.min_gain}, {p.confirm}")
    _need(0.0 <= p.confirm_fraction <= 1.0, f"'pipeline.confirm_fraction' is a share of pipeline.min_gain, in "
                                            f"[0, 1]; got {p.confirm_fraction}")
    _need(p.min_stages >= 2, f"'pipeline.min_stages' must be at least 2 (embedding and head keep their ranks); "
                             f"got {p.min_stages}")
    _need(p.memory_cap is None or p.memory_cap > 0, f"'pipeline.memory_cap' must be positive or null; "
                                                    f"got {p.memory_cap}")


def refuse_cpu_only(c: Config, device_type: str) -> None:
    """Refuse, in one line, the benchmark modes that emulate dedicated devices on a shared CPU (busy-wait
    receives, dilated compute) when the run's device is not a CPU: on a GPU they would measure nothing real."""
    if device_type == "cpu":
        return
    on = [name for name, set_ in (("pipeline.wait: spin", c.pipeline.wait == "spin"),
                                  (f"pipeline.dilate: {c.pipeline.dilate:g}", c.pipeline.dilate != 1.0),
                                  (f"scheduler.dilate: {c.scheduler.dilate:g}", c.scheduler.dilate != 1.0)) if set_]
    _need(not on, f"{', '.join(on)}: CPU benchmark mode(s) emulating devices on a shared CPU, refused on "
                  f"{device_type}; use pipeline.wait: block and dilate 1 (the defaults)")


def _check_whole_routing(c: Config, option: str, off: str) -> None:
    """`option` reads every MoE layer's routing of the same tokens (the routing samples, the curriculum's sample
    complexities): every layer must route the whole micro-batch. Planned micro-batches are read by their real
    tokens (each stage knows them from the plan)."""
    _need(c.dynamism.scheme not in SUBSET_SCHEMES,
          f"{option} reads every MoE layer's routing of the same tokens; 'dynamism.scheme: {c.dynamism.scheme}' "
          f"routes a subset of the tokens in some layers: {off}")


def _check_scheduler(s: SchedulerConfig) -> None:
    # a floor of 1 kB: below it a chunk is a few elements, one all-reduce each (1e-9 MB: one per element, a step
    # of a 23k-parameter model 26 s against 0.08 s)
    _need(s.chunk_mb is None or s.chunk_mb >= 1e-3,
          f"'scheduler.chunk_mb' must be at least 0.001 (1 kB) or null (the cost model's choice); got {s.chunk_mb}")
    _need(s.bucket_mb >= 1e-3, f"'scheduler.bucket_mb' must be at least 0.001 (1 kB); got {s.bucket_mb}")
    _need(s.inflight >= 1, f"'scheduler.inflight' must be at least 1; got {s.inflight}")
    _need(s.a2a_chunks is None or 1 <= s.a2a_chunks <= 64,
          f"'scheduler.a2a_chunks' must be in 1..64 or null (chosen per layer); got {s.a2a_chunks}")
    _need(s.timeout_s > 0, f"'scheduler.timeout_s' must be positive; got {s.timeout_s}")
    _need(s.trace_step >= 0, f"'scheduler.trace_step' must be >= 0 (0: no trace); got {s.trace_step}")
    _need(s.dilate >= 1.0, f"'scheduler.dilate' must be >= 1 (1: off); got {s.dilate}")


def _check_step_hold(par: ParallelConfig, c: Config) -> None:
    """What FSDP2 may hold through a step (`parallel.accumulate`, `parallel.reshard`): only where it is built."""
    _need(par.accumulate in ("sharded", "whole"),
          f"'parallel.accumulate' must be sharded or whole; got {par.accumulate!r}")
    _need(par.reshard in ("micro_batch", "step"),
          f"'parallel.reshard' must be micro_batch or step; got {par.reshard!r}")
    _need(par.reshard == "micro_batch" or not c.pipelined or c.pipeline.schedule != "zb"
          or par.shard not in ("full", "auto"),
          "'parallel.reshard: step' keeps a fully sharded stage's weights gathered through the step, and "
          "pipeline.schedule zb's W ops need the shards back between the backward passes; set "
          "parallel.reshard=micro_batch or pipeline.schedule 1f1b or gpipe")


def _check_grad_accum(c: Config) -> None:
    """`train.grad_accum` > 1: the trainer without a pipeline, rows that split evenly."""
    A, par = c.train.grad_accum, c.parallel
    if A == 1:
        return
    where = (f"parallel.pp {par.pp}" if par.pp > 1 else
             f"dynamism.scheme {c.dynamism.scheme} runs as a one-stage pipeline")
    _need(not c.pipelined, f"'train.grad_accum' ({A}) accumulates without a pipeline; a pipeline ({where}) "
          f"accumulates over its micro-batches: set train.grad_accum 1 and raise pipeline.micro_batches")
    _need(c.data.batch_size % A == 0, f"data.batch_size ({c.data.batch_size}) does not split into "
          f"train.grad_accum={A} micro-batches: use a batch size that is a multiple of {A} (times the ranks)")


def _check_train(t: TrainConfig) -> None:
    _need(t.steps >= 1, f"'train.steps' must be at least 1; got {t.steps}")
    _need(t.warmup_steps >= 0, f"'train.warmup_steps' must be >= 0; got {t.warmup_steps}")
    _need(0.0 <= t.min_lr_ratio <= 1.0, f"'train.min_lr_ratio' must be in [0, 1]; got {t.min_lr_ratio}")
    _need(0.0 < t.decay_fraction <= 1.0, f"'train.decay_fraction' (the share of the steps a wsd schedule decays "
          f"over) must be in (0, 1]; got {t.decay_fraction}")
    _need(0.0 <= t.beta1 < 1.0 and 0.0 <= t.beta2 < 1.0,
          f"train.beta1 and train.beta2 (AdamW's betas) must be in [0, 1); got {t.beta1}, {t.beta2}")
    _need(math.isfinite(t.adam_eps) and t.adam_eps > 0, f"'train.adam_eps' (AdamW's epsilon) must be a positive "
          f"number, e.g. 1e-8; got {t.adam_eps}")
    for key, v in [("train.weight_decay", t.weight_decay), ("train.grad_clip", t.grad_clip)]:
        _need(v >= 0, f"'{key}' must be >= 0; got {v}")
    for key, iv in [("train.eval_every", t.eval_every), ("train.ckpt_every", t.ckpt_every)]:
        _need(iv >= 0, f"'{key}' must be >= 0 (0: never); got {iv}")
    for key, iv in [("train.eval_batches", t.eval_batches), ("train.log_every", t.log_every),
                    ("train.keep_checkpoints", t.keep_checkpoints)]:
        _need(iv >= 1, f"'{key}' must be at least 1; got {iv}")
    _need(0 <= t.seed < 2 ** 32, f"'train.seed' must be in 0 .. 2**32 - 1 (numpy's seed range); got {t.seed}")
    _need(t.threads is None or 1 <= t.threads <= MAX_THREADS,
          f"'train.threads' must be from 1 to {MAX_THREADS} (torch's intra-op threads per process) or null; "
          f"got {t.threads}")
    _need(t.time_limit_min is None or t.time_limit_min > 0,
          f"'train.time_limit_min' must be positive or null; got {t.time_limit_min}")
    _need(t.record_routing_every >= 0,
          f"'train.record_routing_every' must be >= 0 (0: never); got {t.record_routing_every}")
    _need(t.grad_accum >= 1, f"'train.grad_accum' (micro-batches per step) must be at least 1; got {t.grad_accum}")
    sp = t.spike
    _need(sp.factor == 0 or sp.factor > 1, f"'train.spike.factor' must be above 1 (a loss that many times the "
          f"recent median is a spike) or 0 (only non-finite steps); got {sp.factor}")
    _need(sp.grad_factor == 0 or sp.grad_factor > 1, f"'train.spike.grad_factor' must be above 1 (a gradient norm "
          f"that many times the recent median is a spike) or 0 (off); got {sp.grad_factor}")
    _need(sp.window >= 1, f"'train.spike.window' (steps of loss history) must be at least 1; got {sp.window}")
    for key, iv in [("train.spike.back", sp.back), ("train.spike.skip_extra", sp.skip_extra),
                    ("train.spike.max_rollbacks", sp.max_rollbacks)]:
        _need(iv >= 0, f"'{key}' must be >= 0; got {iv}")


# --------------------------------------------------------------------------------------------
# serialisation


def to_dict(c: Any) -> dict[str, Any]:
    """Plain nested dict (YAML/JSON-ready) of a config or any of its sections."""
    return dataclasses.asdict(c)


RESUME_QUIET = ("name", "train.steps", "train.lr", "train.min_lr_ratio", "train.warmup_steps", "train.schedule",
                "train.decay_fraction", "train.eval_every", "train.eval_batches", "train.ckpt_every",
                "train.keep_checkpoints", "train.ckpt_async", "train.progress", "train.threads", "train.time_limit_min",
                "train.record_routing_every", "train.spike", "hf.export_to", "hf.export_dtype", "hf.shard_gb",
                "parallel", "planner", "scheduler", "pipeline")
"""Settings a resume does not list as changed (`config_changes`): the run's bookkeeping (its length, what it
writes and when), the learning-rate schedule (`optim.schedule_change` says what a change of it does), and the
layout and the placement and scheduling policies, which carry a run over to other ranks (docs/checkpoints.md)."""


def config_changes(saved: dict[str, Any], c: Config) -> list[str]:
    """`key old -> new` for each setting of `c` whose value differs from `saved` (a checkpoint's config.yaml as
    plain data), outside `RESUME_QUIET`: a resume's overrides that change what the run computes from the next
    step on (a precision, the routing, the model's maths, the optimizer's hyperparameters), said rather than
    taken silently. Keys `saved` lacks (a checkpoint of an older version) are not compared."""
    def leaves(d: Any, prefix: str = "") -> dict[str, Any]:
        if isinstance(d, dict):
            return {k: v for key, sub in d.items() for k, v in leaves(sub, f"{prefix}{key}.").items()}
        return {prefix[:-1]: d}

    old, new = leaves(saved), leaves(to_dict(c))
    return [f"{k} {old[k]!r} -> {v!r}" for k, v in new.items()
            if k in old and _plain_value(old[k]) != _plain_value(v)
            and not any(k == q or k.startswith(q + ".") for q in RESUME_QUIET)]


def _plain_value(v: Any) -> Any:
    """A setting as YAML holds it (tuples are lists there)."""
    return [_plain_value(x) for x in v] if isinstance(v, (list, tuple)) else v


def dump(c: Config, path: str | Path | None = None) -> str:
    """YAML text of a config; written whole to `path` when given (beside it, then renamed over it: a run's
    config.yaml is what `--resume` starts from)."""
    text: str = yaml.safe_dump(to_dict(c), sort_keys=False, default_flow_style=False)
    if path is not None:
        write_text_whole(path, text)
    return text


def with_overrides(c: Config, overrides: typing.Sequence[str]) -> Config:
    """A copy of `c` with `a.b=value` overrides applied (and validated)."""
    data = to_dict(c)
    for item in overrides:
        _apply_override(data, item)
    return from_dict(data, source="<overrides>")


def refuse_flag_and_override(args: Any, overrides: typing.Sequence[str],
                             pairs: typing.Sequence[tuple[str, str]]) -> None:
    """A command's flag and an override of the key it sets, both given, would leave one silently ignored: refuse
    them. `pairs` are (the argparse attribute, the config key); a flag left at None is not given."""
    given = {item.partition("=")[0].strip(): item for item in overrides}
    for flag, key in pairs:
        if getattr(args, flag, None) is not None and key in given:
            raise ConfigError(f"--{flag.replace('_', '-')} and the override {given[key]} both set {key}: give one "
                              f"of them")


def absolute_inputs(c: Config) -> Config:
    """`c` with the input paths that exist relative to the working directory made absolute: data.source,
    data.tokenizer, data.mixture's sources, hf.init_from and planner.path_profile. `moebal train` applies it
    before the run's config.yaml is written, so a resume (`--resume`, a restart, `--resume-from` into another
    run) finds its inputs from any working directory. A path that does not exist is left as given, for the data
    loader's error to name it; names that are not paths ('stdlib', 'byte') are left alone."""

    def fix(p: str | None, names: tuple[str, ...] = ()) -> str | None:
        if not p or p in names or Path(p).expanduser().is_absolute() or not Path(p).expanduser().exists():
            return p
        return str(Path(p).expanduser().resolve())

    d = c.data
    mixture = {str(fix(k)): w for k, w in d.mixture.items()} if d.mixture else d.mixture
    data = dataclasses.replace(d, source=str(fix(d.source, ("stdlib",))), tokenizer=str(fix(d.tokenizer, ("byte",))),
                               mixture=mixture)
    return dataclasses.replace(c, data=data, hf=dataclasses.replace(c.hf, init_from=fix(c.hf.init_from)),
                               planner=dataclasses.replace(c.planner, path_profile=fix(c.planner.path_profile)))
