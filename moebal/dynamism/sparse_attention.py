"""Dynamic block-sparse attention (DynMo section 2.4): each layer's attention keeps a moving share of its blocks.

Shape legend: B = rows, T = sequence, D = model dim, H = query heads, G = key/value heads, K = head dim.

A layer runs its attention core as `moebal.kernels.sparse_attention`: per key/value head and query block of
`block` tokens, the top-scoring key blocks by causal pooled q.k (the diagonal always kept), k_n =
round(density_i x (n + 1)) of them for query block n. The projections, rotary embedding, output projection and
FFN are the layer's own, unchanged. At density 1 the layer runs its plain dense path.

DynMo builds on hashed sparse FlashAttention (Pagliardini et al. 2023) and only says that the share of non-zero
blocks s_i moves per layer and iteration; it gives no rule for it. Its gaps, settled here:
- Which blocks: the top key blocks by a cheap score (the group's mean query over the `block` rows ending at the
  query block's first row x the key block's mean key), not hashing, so the kept share is exactly the budget (the
  cost is predictable) and the choice is deterministic (the same on any partition: migration changes no maths).
  The query side reads no row after the block's first, so no token's output depends on a later token (its own
  next-token target included), as with DynMo's per-token hashing.
- How the budget moves (`budget`):
  - `coverage` (the sparsity rule): after each step, a layer's next density is the share of causal blocks it
    needed, on that step's data, for its kept blocks to cover `coverage` of the softmax mass of the pooled block
    scores (averaged over rows, heads and query blocks, micro-batches summed along the pipeline), within
    [min_density, max_density]. A layer whose attention is peaked keeps fewer blocks.
  - `random_walk` (DynMo's benchmark driver, its extraction section 8.1): each layer starts at a density drawn
    uniformly in [min_density, max_density] and moves every step by a uniform step in [-walk_step, walk_step],
    clipped to the bounds. Drawn from a generator seeded by (seed, step): every rank draws the same numbers with
    no message, and a resume continues the same walk. `depth_tilt` t in [0, 1] correlates the densities with
    depth (DynMo gives no rule; docs/dynamism.md): layer i of L walks in its own band of width (1 - t) (hi - lo),
    from [lo + t (hi - lo), hi] for the first layer down to [lo, hi - t (hi - lo)] for the last (linear in
    i / (L - 1)). t = 0 is the walk above (the same draws); t = 1 a fixed ramp from hi to lo. Independent walks
    average out over the layers of a stage; a tilt leaves each stage its own mean density.
- When it sets in: layers run dense before `start` (continual training of a dense model, as DynMo runs it).
- Cost (DynMo: c_i = s_i c_i, the whole layer scaled): only the attention core scales. Layer i's cost relative to
  its dense self is (q_o + kv + ffn + w attn (o + f_i)) / (q_o + kv + ffn + w attn) below density 1 (1 at
  density 1: the plain layer), f_i the kept share of the causal block grid (`kept_fraction`: a function of the
  density alone), from `layer_token_flops` at the run's sequence. w (`attn_weight`, 1.6) is the time per
  multiply-add of the dense attention core relative to the GEMMs, o (`overhead`, 0.22) the sparse path's fixed
  extra (scores, selection, gathers, smaller kernel calls) as a share of the dense core. Both belong to the device
  and the shape more than to the model (`scripts/bench_sparse_attention.py --layer`: a CPU with AVX2 only fits w
  1.6-2.1, o 0). `costs: measure` (the default) therefore fits them on the job at start-up
  (`measure_attention_factors`): every rank times its device's fwd+bwd of one attention module of the model's
  shape at the run's micro-batch rows, dense and at densities 0.75 / 0.5 / 0.25 / 0.1 (interleaved, medians; CPU
  time on a CPU, synchronised wall time on a GPU), the factors are averaged over every rank of the job and
  fitted once (`fit_cost_constants`), so every rank plans with the same bits. The module is built under a forked
  RNG: measuring draws nothing from the run's random streams, so the losses do not depend on it. A fit that
  fails (times that do not fall with the kept share: a tiny shape, where fixed costs dominate) keeps the given
  constants and says so. `costs: given` uses `attn_weight` and `overhead` as set (the defaults were fitted to a
  dim-128 layer at 2,048 tokens on an Intel Xeon CPU). The constants in use are in the checkpoint: a resumed run
  plans with them, wherever it resumes. The density a step runs at is fixed before the step (`update` sets the
  next step's), so the planner's prediction for the coming step is exact in its inputs.
- Layer halves (`pipeline.split_layers`, not in DynMo): only the attention changes, so every dense layer may split
  into its attention half (run here, `attention_half`) and its plain FFN half. The planner then sees the
  attention half's own factor (the formula above without the FFN's multiply-adds) and factor 1 for the FFN half
  (`unit_cost_factors`): a stage boundary can fall between the part that moves and the part that does not.
- Frequency: the scheme changes every iteration and the balancer re-plans after every step (`replan_every_step`,
  DynMo's Figure 3 caption).
- Recomputation (`train.recompute`, moebal/models/recompute.py): the scheme runs the attention itself, so it
  recomputes it itself, with the decoder layer's rules: `attention` replays the attention region (norm,
  projections, block scores and selection, the sparse core, residual), `full` the whole layer from its input
  (the attention region and the FFN part in one region when the FFN may run twice, else the attention region,
  with the MoE block's own rank-local recomputation), `moe` the FFN part. The replay recomputes the same
  selection (the scores come from the same q and k, the density is the step's), and under `coverage` it does
  not add to the step's statistics a second time (`_replaying`).
- Precision: once active, every layer runs this path, and under bf16 autocast on a CPU its attention core
  (dense at density 1, or sparse) computes in fp32 (measured, 1,024 tokens, 1 thread: the dense core 0.090 s
  in bf16 against 0.039 s in fp32; the sparse one at density 0.5 1.25x the dense bf16 core in bf16, 0.92x in
  fp32). Projections and FFN keep the run's precision.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moebal.dynamism.scheme import (
    Dynamism,
    SchemeContext,
    as_decoder,
    check_steps,
    layer_token_flops,
    register,
    run_as_forward,
)
from moebal.errors import ConfigError
from moebal.kernels.bench import time_interleaved
from moebal.kernels.sparse_attention import (
    block_scores,
    block_sparse_attention,
    coverage_density,
    kept_fraction,
    select_from_scores,
)
from moebal.models.recompute import recompute_call
from moebal.models.transformer import Attention, DecoderLayer, apply_rotary, attention_for, grouped_sdpa, rotary_for
from moebal.pipeline.units import FFN, LAYER, UnitMap
from moebal.planner.sparse_blocks import fit_cost_constants, sparse_block_advice, sparse_block_fits
from moebal.sync import to_host
from moebal.train.precision import autocast_dtype

__all__ = ["COST_DENSITIES", "DynamicSparseAttention", "fit_attention_factors", "measure_attention_factors",
           "sparse_attention_forward"]

COST_DENSITIES = (0.75, 0.5, 0.25, 0.1)
"""The densities `costs: measure` times beside the dense core (the kept share spans 0.13-0.75 at 2,048 tokens)."""


def sparse_attention_forward(attn: Attention, x_BTD: torch.Tensor, cos_TK: torch.Tensor, sin_TK: torch.Tensor,
                             density: float, block: int, fp32_core: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`attn`'s forward with the block-sparse core at `density`; also the pooled block scores [B, G, N, N] (for
    the coverage rule). Density 1 runs the dense causal core. `fp32_core`: the attention core (dense or sparse)
    computes in fp32 outside autocast, the projections keep the run's precision."""
    B, T, _ = x_BTD.shape
    q_BHTK = apply_rotary(attn.project(x_BTD, attn.q_proj, attn.n_heads, "q_norm"), cos_TK, sin_TK)
    k_BGTK = apply_rotary(attn.project(x_BTD, attn.k_proj, attn.n_kv_heads, "k_norm"), cos_TK, sin_TK)
    v_BGTK = attn.v_proj(x_BTD).view(B, T, attn.n_kv_heads, attn.head_dim).transpose(1, 2)
    pad = -T % block
    if pad:
        # A prefix being generated (`moebal generate`; training and validation rows hold whole blocks): zero rows
        # complete the last block. They come after every real query, so causal attention never reads them; the
        # pooled queries read no row after a block's first, and the last block's pooled key ranks nothing (no
        # query block comes after it; its own, the diagonal, is kept anyway), so the selection is the one the
        # whole row's forward makes. The padded rows' outputs are dropped below.
        q_BHTK, k_BGTK, v_BGTK = (F.pad(t, (0, 0, 0, pad)) for t in (q_BHTK, k_BGTK, v_BGTK))
    s_BGNN = block_scores(q_BHTK, k_BGTK, block)
    dtype = q_BHTK.dtype
    with torch.autocast(x_BTD.device.type, enabled=False) if fp32_core else contextlib.nullcontext():
        if fp32_core:
            q_BHTK, k_BGTK, v_BGTK = q_BHTK.float(), k_BGTK.float(), v_BGTK.float()
        if density >= 1.0:
            o_BHTK = grouped_sdpa(q_BHTK, k_BGTK, v_BGTK, is_causal=True)
        else:
            o_BHTK = block_sparse_attention(q_BHTK, k_BGTK, v_BGTK, select_from_scores(s_BGNN, block, density))
    o_BHTK = o_BHTK[:, :, :T].to(dtype)
    out_BTD: torch.Tensor = attn.o_proj(o_BHTK.transpose(1, 2).reshape(B, T, attn.n_heads * attn.head_dim))
    return out_BTD, s_BGNN


def measure_attention_factors(cfg: Any, block: int, rows: int, device: torch.device, repeats: int = 5,
                              densities: tuple[float, ...] = COST_DENSITIES) -> list[float]:
    """Fwd+bwd time of one attention module of `cfg`'s shape (projections, block selection, the core) on `rows`
    tokens in rows of data.seq_len, at each of `densities` over its time dense (the causal SDPA core the layer
    runs at density 1), under the run's autocast on `device`: interleaved rounds, medians of `repeats`; process
    CPU time on a CPU (robust to other ranks sharing the cores), synchronised wall time on a GPU. The module and
    its input are drawn under a forked RNG (the run's random streams are untouched)."""
    T, D = cfg.data.seq_len, cfg.model.dim
    B = max(1, rows // T)
    forked = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=forked):
        torch.manual_seed(0)
        attn = attention_for(cfg).to(device)
        if not isinstance(attn, Attention):  # programmer invariant: the scheme's constructor refused model.mla
            raise TypeError("sparse_attention needs grouped-query Attention")
        x_BTD = torch.randn(B, T, D, device=device).requires_grad_(True)
    cos_TK, sin_TK = (t.to(device) for t in rotary_for(cfg)(T, torch.float32))
    dtype = autocast_dtype(cfg, device)
    fp32 = device.type == "cpu" and dtype is not None  # as `_attention` runs it under CPU autocast

    def at(d: float) -> Any:
        def run() -> None:
            attn.zero_grad(set_to_none=True)
            x_BTD.grad = None
            out_BTD, _ = sparse_attention_forward(attn, x_BTD, cos_TK, sin_TK, d, block, fp32_core=fp32)
            out_BTD.float().sum().backward()
        return run

    t = time_interleaved({str(d): at(d) for d in (1.0, *densities)}, warmup=1, repeats=repeats, device=device,
                         autocast=dtype)

    def secs(d: float) -> float:
        return t[str(d)].cpu_median if device.type == "cpu" else t[str(d)].median

    return [secs(d) / secs(1.0) for d in densities]


def fit_attention_factors(cfg: Any, block: int, factors: list[float]) -> tuple[float, float]:
    """(attn_weight, overhead) fitted to an attention module's measured factors at COST_DENSITIES
    (`measure_attention_factors`): the scheme's cost model without the FFN, so the GEMMs outside the core are the
    query, key, value and output projections. Raises ValueError where `fit_cost_constants` does."""
    T = cfg.data.seq_len
    f = layer_token_flops(cfg, 0, T)
    return fit_cost_constants([(kept_fraction(T, block, d), m) for d, m in zip(COST_DENSITIES, factors)],
                              f["q_o"] + f["kv"], f["attn"])


def walk_bands(n_layers: int, lo: float, hi: float, tilt: float,
               depth_scale: float | None = None) -> list[tuple[float, float]]:
    """Each layer's (lower, upper) bound of the random walk under `depth_tilt` `tilt`: [lo, hi] for every layer
    at tilt 0 (exactly: the walk's numbers do not depend on the option's existence), a band (1 - tilt) (hi - lo)
    wide sliding linearly from the top (the first layer) to the bottom (the last), one point at tilt 1.
    `depth_scale` D (the Table 1 simulation's candidates; None: the scheme's rule) slides the band by absolute
    depth instead: layer i sits at min(1, i / D) of the way down, so a model shallower than D layers spans only
    the top of the range."""
    span = hi - lo
    out = []
    for i in range(n_layers):
        x = i / max(1, n_layers - 1) if depth_scale is None else min(1.0, i / depth_scale)
        top = hi - tilt * span * x
        out.append((min(lo + tilt * span * (1.0 - x), top), top))  # equal at tilt 1, up to rounding
    return out


@register("sparse_attention")
class DynamicSparseAttention(Dynamism):
    name = "sparse_attention"
    replan_every_step = True
    changes_outputs = True

    def __init__(self, cfg: Any, budget: str = "coverage", block: int = 64, coverage: float = 0.9,
                 min_density: float = 0.1, max_density: float = 1.0, walk_step: float = 0.1, start: int = 0,
                 attn_weight: float = 1.6, overhead: float = 0.22, seed: int = 0, depth_tilt: float = 0.0,
                 costs: str = "measure") -> None:
        super().__init__(cfg)
        m, T = cfg.model, cfg.data.seq_len
        if budget not in ("coverage", "random_walk"):
            raise ConfigError(f"dynamism sparse_attention: budget must be coverage or random_walk; got {budget!r}")
        if not 0 < min_density <= max_density <= 1:
            raise ConfigError(f"dynamism sparse_attention: need 0 < min_density ({min_density}) <= max_density "
                              f"({max_density}) <= 1")
        if not sparse_block_fits(T, block):
            raise ConfigError(sparse_block_advice(T, block))
        if not 0 < coverage <= 1 or walk_step < 0 or attn_weight <= 0 or overhead < 0:
            raise ConfigError(f"dynamism sparse_attention: need coverage in (0, 1] (got {coverage}), walk_step >= 0 "
                              f"(got {walk_step}), attn_weight > 0 (got {attn_weight}) and overhead >= 0 "
                              f"(got {overhead})")
        if costs not in ("measure", "given"):
            raise ConfigError(f"dynamism sparse_attention: costs must be measure (fit attn_weight and overhead on the "
                              f"job at start-up) or given (use them as set); got {costs!r}")
        if not 0 <= depth_tilt <= 1:
            raise ConfigError(f"dynamism sparse_attention: depth_tilt must be in [0, 1] (0: independent walks, 1: a "
                              f"fixed ramp by depth); got {depth_tilt}")
        if m.mla is not None or (m.sliding_window is not None and m.sliding_window < T):
            raise ConfigError("dynamism sparse_attention runs grouped-query causal attention over the whole row: "
                              "unset model.mla and model.sliding_window (or use another scheme)")
        self.L, self.T, self.block, self.budget = m.n_layers, T, block, budget
        self.coverage, self.lo, self.hi, self.walk_step = coverage, min_density, max_density, walk_step
        check_steps("sparse_attention", start=start)
        self.start, self.attn_weight, self.overhead, self.seed = start, attn_weight, overhead, seed
        self.costs = costs
        self.cost_source = "given"
        """Where `attn_weight` and `overhead` come from: given, measured (on this job, or the checkpoint's job), or
        given because the measurement could not be fitted (with why)."""
        self.bands = walk_bands(self.L, min_density, max_density, depth_tilt)
        self.flops = [layer_token_flops(cfg, i, T) for i in range(self.L)]
        self.density = [1.0] * self.L
        """The density each layer runs at in the coming step (agreed: every rank computes the same)."""
        self.ran = list(self.density)
        """The densities the current (last begun) step runs at."""
        self.needed = torch.zeros(2 * self.L, dtype=torch.float64)
        """This step's coverage statistics (host): per layer the summed needed share, then the count of samples."""
        self._needed_dev: torch.Tensor | None = None
        """The step's needed shares as measured, on the device (per layer), until `_settle` adds them to `needed`
        in one counted host read: measuring inside the schedule reads nothing back."""
        self._replaying = False
        """Inside a recomputation's replay (`_replay`): the forward adds nothing to the statistics."""

    # ---- the cost constants ----
    def on_start(self, ctx: SchemeContext) -> None:
        if self.costs == "measure" and self.cost_source == "given" and ctx.device is not None and ctx.rows:
            self.measure_costs(ctx)

    def measure_costs(self, ctx: SchemeContext, factors: list[float] | None = None) -> None:
        """Fit `attn_weight` and `overhead` to this device (module docstring). Collective: every rank of the job
        calls it at the same point (its stage's data-parallel copies and expert shards, then the chain).
        `factors`: this rank's measured factors at COST_DENSITIES (None: `measure_attention_factors` times them)."""
        assert ctx.device is not None and ctx.rows is not None
        mine = factors if factors is not None else measure_attention_factors(self.cfg, self.block, ctx.rows,
                                                                            ctx.device)
        vec = torch.tensor([*mine, 1.0], dtype=torch.float64)
        if ctx.shard_sum is not None:  # a host tensor over gloo, like the profiles (`LayerBalancer.observe`)
            vec = ctx.shard_sum(vec)
        if ctx.dp > 1:
            dist.all_reduce(vec, group=ctx.dp_group)
        tot = ctx.chain.allreduce_sum(vec)  # the same bits on every rank
        mean = (tot[:-1] / tot[-1]).tolist()
        try:
            w, o = fit_attention_factors(self.cfg, self.block, mean)
        except ValueError as e:
            self.cost_source = f"given (the measurement was not fitted: {e})"
        else:
            self.attn_weight, self.overhead, self.cost_source = w, o, "measured"
        if not dist.is_initialized() or dist.get_rank() == 0:
            got = ", ".join(f"{d}: {m:.3f}" for d, m in zip(COST_DENSITIES, mean))
            sys.stderr.write(f"moebal: sparse attention cost constants {self.cost_source}: attn_weight "
                             f"{self.attn_weight:.3f}, overhead {self.overhead:.3f} (attention fwd+bwd over dense, "
                             f"by density: {got})\n")
            sys.stderr.flush()

    # ---- the budget ----
    def _walk(self, step: int) -> list[float]:
        """The random walk's densities for `step` from the current ones (the first active step draws a start)."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        u = torch.rand(self.L, generator=g, dtype=torch.float64).tolist()
        if step == self.start + 1:
            return [lo + (hi - lo) * x for (lo, hi), x in zip(self.bands, u)]
        return [min(hi, max(lo, d + self.walk_step * (2 * x - 1)))
                for (lo, hi), d, x in zip(self.bands, self.density, u)]

    def begin_step(self, step: int) -> None:
        super().begin_step(step)
        self.needed.zero_()
        self._needed_dev = None
        if step == self.start + 1 and self.budget == "random_walk":  # the walk's first active step
            self.density = self._walk(step)
        self.ran = list(self.density)

    def update(self, ctx: SchemeContext) -> bool:
        """Set the next step's densities (from this step's coverage, or the walk)."""
        nxt = ctx.step + 1
        if nxt <= self.start:
            return False
        if self.budget == "random_walk":
            self.density = self._walk(nxt)
        else:
            self._settle()  # without a chain (nothing summed the statistics) the shares are still on the device
            self.density = [min(self.hi, max(self.lo, float(self.needed[i] / self.needed[self.L + i])))
                            if self.needed[self.L + i] > 0 else d for i, d in enumerate(self.density)]
        return True

    def served_as(self) -> str:
        if not self._path()[0]:
            return f"sparse attention before its start: dense attention (step {self.step})"
        return (f"block-sparse attention ({self.block}-token blocks) at the densities of the run's validation: "
                f"{', '.join(f'{d:.3f}' for d in self.density)}")

    # ---- the layer ----
    def layer_forward(self, i: int, layer: nn.Module, h_BTD: torch.Tensor, cos_TK: torch.Tensor,
                      sin_TK: torch.Tensor, carry: dict[str, torch.Tensor]) -> torch.Tensor:
        active, measure = self._path()
        if not active:
            out_BTD: torch.Tensor = layer(h_BTD, cos_TK, sin_TK)
            return out_BTD
        return run_as_forward(layer, lambda h, cos, sin: self._sparse(i, layer, h, cos, sin, measure), h_BTD, cos_TK,
                              sin_TK)

    def _path(self) -> tuple[bool, bool]:
        """(whether this step's layers run the scheme's attention, whether it measures the coverage statistics):
        the plain layer before `start`, except that `coverage` measures at density 1 from step `start` on."""
        measure = self.budget == "coverage" and self.step >= self.start
        return self.step > self.start or measure, measure

    def _sparse(self, i: int, layer: nn.Module, h_BTD: torch.Tensor, cos_TK: torch.Tensor, sin_TK: torch.Tensor,
                measure: bool) -> torch.Tensor:
        """Layer i with its block-sparse attention core (and, under `coverage`, this step's needed density),
        recomputed as `train.recompute` says (module docstring)."""
        block = as_decoder(layer)
        if block.recomputes("full") and block.ffn_replayable():
            return recompute_call(lambda h, cos, sin: block.ffn_part(self._attention_region(i, block, h, cos, sin,
                                                                                            measure), plain=True),
                                  block.moe_block(), h_BTD, cos_TK, sin_TK, replay=self._replay)
        return block.ffn_part(self._attention_part(i, block, h_BTD, cos_TK, sin_TK, measure))

    def _attention_part(self, i: int, block: DecoderLayer, h_BTD: torch.Tensor, cos_TK: torch.Tensor,
                        sin_TK: torch.Tensor, measure: bool) -> torch.Tensor:
        """h + the sparse attention of layer i's normed h, a recomputed region under `attention` and `full`."""
        if block.recomputes("attention", "full"):
            return recompute_call(lambda h, cos, sin: self._attention_region(i, block, h, cos, sin, measure), None,
                                  h_BTD, cos_TK, sin_TK, replay=self._replay)
        return self._attention_region(i, block, h_BTD, cos_TK, sin_TK, measure)

    def _attention_region(self, i: int, block: DecoderLayer, h_BTD: torch.Tensor, cos_TK: torch.Tensor,
                          sin_TK: torch.Tensor, measure: bool) -> torch.Tensor:
        """h + the sparse attention of layer i's normed h. Under `parallel.shard: full` with split layers the
        norm and the attention are FSDP2 units of their own: the norm is called, the sparse core runs as the
        attention module's forward (a no-op wrapper otherwise)."""
        attn = block.self_attn
        x_BTD = block.input_layernorm(h_BTD)
        out_BTD: torch.Tensor = h_BTD + run_as_forward(
            attn, lambda x, cos, sin: self._attention(i, attn, x, cos, sin, measure), x_BTD, cos_TK, sin_TK)
        return out_BTD

    @contextlib.contextmanager
    def _replay(self) -> Iterator[None]:
        """A recomputation's replay: the same forward again, without adding to the step's statistics."""
        self._replaying = True
        try:
            yield
        finally:
            self._replaying = False

    def _attention(self, i: int, attn: nn.Module, x_BTD: torch.Tensor, cos_TK: torch.Tensor, sin_TK: torch.Tensor,
                   measure: bool) -> torch.Tensor:
        """Layer i's attention output on its normed input `x_BTD`, with the block-sparse core."""
        if not isinstance(attn, Attention):  # programmer invariant: the constructor refused model.mla
            raise TypeError("sparse_attention needs grouped-query Attention")
        # under CPU autocast the core computes in fp32: torch's bf16 attention kernels on a CPU are 2.3x slower
        # than fp32 (dense, 1,024 tokens) and the sparse path's small calls slower still (the mod scheme's finding)
        fp32 = x_BTD.device.type == "cpu" and torch.is_autocast_enabled("cpu")
        a_BTD, s_BGNN = sparse_attention_forward(attn, x_BTD, cos_TK, sin_TK, self.density[i], self.block,
                                                 fp32_core=fp32)
        if measure and not self._replaying:
            share = coverage_density(s_BGNN, self.coverage) * x_BTD.shape[0]
            if self._needed_dev is None:
                self._needed_dev = torch.zeros(self.L, dtype=torch.float64, device=share.device)
            self._needed_dev[i] += share
            self.needed[self.L + i] += x_BTD.shape[0]  # a host count: no device value
        return a_BTD

    def _settle(self) -> None:
        """Add the step's device-side shares to `needed`: one host read per step (`moebal.sync.to_host`)."""
        if self._needed_dev is not None:
            self.needed[:self.L] += torch.tensor(to_host(self._needed_dev, "sparse attention: coverage"),
                                                 dtype=torch.float64)
            self._needed_dev = None

    # ---- layer halves (`pipeline.split_layers`) ----
    def splittable(self, i: int) -> bool:
        """Every dense layer: only its attention changes, and it keeps no per-layer state (the densities are
        job-wide; the coverage sums add up along the chain wherever a layer's attention half runs)."""
        return True

    def attention_half(self, i: int, layer: nn.Module, h_BTD: torch.Tensor, cos_TK: torch.Tensor,
                       sin_TK: torch.Tensor) -> torch.Tensor:
        """The attention half of split layer i: `layer_forward`'s attention, op for op (the FFN half runs plain),
        recomputed under `attention` and `full` as the plain layer's attention half is."""
        active, measure = self._path()
        block = as_decoder(layer)
        if not active:
            return block.attention_part(h_BTD, cos_TK, sin_TK)
        return self._attention_part(i, block, h_BTD, cos_TK, sin_TK, measure)

    # ---- statistics along the chain (coverage) ----
    def stats_size(self, num_layers: int) -> int:
        return 2 * self.L if self.budget == "coverage" else 0

    def local_stats(self) -> torch.Tensor:
        self._settle()
        return self.needed.clone()

    def set_global_stats(self, vec: torch.Tensor) -> None:
        self.needed = vec.clone()

    # ---- predictions ----
    def cost_factors(self, num_layers: int) -> list[float]:
        """(other + w attn (o + f_i)) / (other + w attn) below density 1, else 1 (module docstring)."""
        return [self._factor(i, LAYER) for i in range(self.L)]

    def unit_cost_factors(self, units: UnitMap) -> list[float]:
        """A split layer's attention half scales as the layer's attention (the same formula without the FFN's
        multiply-adds); its FFN half runs plain (factor 1)."""
        return [self._factor(i, kind) for i, kind in units.parts]

    def _factor(self, i: int, kind: str) -> float:
        """Layer i's (LAYER) or its attention half's (ATTN) time at its density relative to dense; FFN: 1."""
        d, f = self.density[i], self.flops[i]
        if d >= 1.0 or kind == FFN:
            return 1.0
        other = f["q_o"] + f["kv"] + (f["ffn"] if kind == LAYER else 0.0)
        attn = f["attn"] * self.attn_weight
        return float((other + attn * (self.overhead + kept_fraction(self.T, self.block, d))) / (other + attn))

    def metrics(self) -> dict[str, Any]:
        """The step's densities; the next step's predicted costs (what the balancer planned with)."""
        return {"attention_density": [round(d, 4) for d in self.ran],
                "predicted_cost": [round(c, 4) for c in self.cost_factors(self.L)],
                "attention_cost_constants": [round(self.attn_weight, 4), round(self.overhead, 4)]}

    # ---- checkpoints: the coming step's densities (the walk continues from them), the cost constants ----
    def state_dict(self) -> dict[str, Any]:
        return {"density": list(self.density), "attn_weight": self.attn_weight, "overhead": self.overhead,
                "cost_source": self.cost_source}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.density = [float(d) for d in state.get("density", [1.0] * self.L)]
        if self.costs == "measure" and state.get("cost_source") == "measured":  # the job's own fit, kept
            self.attn_weight, self.overhead = float(state["attn_weight"]), float(state["overhead"])
            self.cost_source = "measured"
