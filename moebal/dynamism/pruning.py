"""Gradual global magnitude pruning (Zhu & Gupta 2017) across pipeline stages, with a measured sparse kernel.

Shape legend: F = output features, D = input features, N = rows (tokens), Z = kept weights of one matrix.

Schedule: s_t = s_f + (s_i - s_f) (1 - (t - t0) / (n dt))^3, applied at t = t0 + k dt for k = 1..n (at t0 itself
s = s_i). With s_i = 0, s_f = 0.9, n = 4 the steps reach 0.5203, 0.7875, 0.8859, 0.9 (the papers' "52%, 79%,
90%" rounds or skips the third). Each step sets the cumulative target sparsity of the original prunable
weights; already-pruned weights are zero and are never kept again (no regrowth).

Prunable: each layer's attention projections (q, k, v, o) and FFN matrices (dense gate/up/down, or the MoE
experts' stacked w1/w2/w3 and shared experts); never norms, routers, the embedding or the head (DynMo's
code prunes the four linear weights per block; the embedding and head must stay dense or they dominate).

Global top-k over stages and expert shards (DynMo Algorithm 2's goal, by sums instead of its gather of every
stage's local top-k, which would send (1 - sparsity) of the weights to every rank): the global threshold is the
exact k-th largest magnitude, found by a radix select whose histograms are summed over the expert shards and
along the chain (`_kth_largest`); ties at the threshold are kept in model order (layer, parameter, flat index,
an expert matrix's rows being its shards' blocks in order) from tie counts per layer, parameter and shard, so
the kept set equals the single-process `global_magnitude_masks` exactly. A stage's expert shards hold the same
dense matrices: shard 0 counts them, and every shard derives the same mask.

Masks are applied to weights at each pruning step and after every optimizer step, to gradients after every
backward, and pruned entries of the AdamW moments are zeroed. Kernel: masked dense (the same GEMM as before:
no speed-up) or CSR (`torch.sparse` SpMM forward and input gradient, sampled dense-dense product for the
weight gradient: all three at the kept entries only). `kernel="auto"` times both on the layer's real shape,
density and rows at each pruning step and keeps the faster (GPU kernels only beat dense from ~75% sparsity,
and CPU crossovers differ again), so the sparse kernel runs only where it was measured faster.

Reproducibility: the two kernels add the kept products in different orders (a 384 x 128 matrix at 90%
sparsity: forward outputs differ by up to 3e-6), and `auto`'s choice is a timing race: two runs of the same
seed and partition can choose differently near the crossover and then differ in the last bits (measured:
two static runs of one job). Migration itself changes nothing: the choice travels with the layer, and with
`dense` or `csr` any partition and any migration give bit-identical losses (tested). Like cuDNN's
benchmark mode, `auto` trades bitwise run-to-run reproducibility for speed; choose `dense` or `csr` to keep it.
"""

from __future__ import annotations

import time
import types
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moebal.distributed.expert_parallel import is_expert_param
from moebal.distributed.fsdp import mask_rows_, whole_tensor
from moebal.dynamism.scheme import Dynamism, SchemeContext, check_steps, register
from moebal.errors import ConfigError
from moebal.kernels.bench import time_fn
from moebal.sync import count_ids

if TYPE_CHECKING:
    from moebal.models.transformer import MoebalForCausalLM

__all__ = ["CSRStructure", "ExpertShards", "GradualPruning", "csr_linear", "global_magnitude_masks", "prunable_params",
           "zhu_gupta_schedule"]

warnings.filterwarnings("ignore", message=".*Sparse CSR tensor support is in beta.*")

_PRUNABLE_SUFFIXES = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "gate_proj.weight",
                      "up_proj.weight", "down_proj.weight", "experts.w1", "experts.w2", "experts.w3")


def prunable_params(layer: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The layer's prunable matrices in `named_parameters` order (the tie-breaking order)."""
    return [(n, p) for n, p in layer.named_parameters() if n.endswith(_PRUNABLE_SUFFIXES) and "mod_router" not in n]


def _logical_numel(layer: nn.Module) -> int:
    """Entries of the layer's prunable matrices in the whole model: an expert-stacked matrix counts every expert
    of the layer, also where this rank built only its shard's rows (a stage's own layers under expert
    parallelism are materialised that way; the others are still whole, on the meta device)."""
    from moebal.train.checkpoint import stacked_experts

    stacked = stacked_experts(layer)
    n = 0
    for name, p in prunable_params(layer):
        # rows of one expert each, E of them in the whole layer (`expert_ids` may already name a shard's experts
        # on a layer still whole on the meta device: the rows held are what counts)
        n += p.numel() // p.shape[0] * stacked[name][1] if name in stacked else p.numel()
    return n


def zhu_gupta_schedule(final: float, initial: float = 0.0, start: int = 0, every: int = 1,
                       steps: int = 4) -> list[tuple[int, float]]:
    """[(step, cumulative target sparsity)] of the cubic schedule: t0 + k dt for k = 1..n, and t0 itself (k = 0,
    the sparsity s_i) when s_i > 0, as Zhu & Gupta prune at t in {t0, ..., t0 + n dt}; with s_i = 0 step t0 prunes
    nothing. A step prunes after it trains, so a pruning at t0 needs t0 >= 1."""
    if not 0 <= initial <= final < 1 or every < 1 or steps < 1:
        raise ConfigError(f"pruning schedule: need 0 <= initial ({initial}) <= final ({final}) < 1, every ({every}) "
                          f">= 1 and steps ({steps}) >= 1")
    if initial > 0 and start < 1:
        raise ConfigError(f"pruning schedule: initial_sparsity {initial} is reached after step `start`, the first "
                          f"pruning step, which must be at least 1; got start {start}")
    first = 0 if initial > 0 else 1
    return [(start + k * every, final + (initial - final) * (1 - k / steps) ** 3) for k in range(first, steps + 1)]


def global_magnitude_masks(layers: list[list[torch.Tensor]], keep: int) -> list[list[torch.Tensor]]:
    """Single-process reference: keep the `keep` largest |w| over all matrices, ties in model order."""
    flat = torch.cat([w.detach().abs().reshape(-1) for ws in layers for w in ws])
    mask = torch.zeros(flat.numel(), dtype=torch.bool, device=flat.device)
    if keep > 0:
        order = torch.sort(-flat, stable=True).indices[:keep]
        mask[order] = True
    out, pos = [], 0
    for ws in layers:
        row = []
        for w in ws:
            row.append(mask[pos:pos + w.numel()].view(w.shape))
            pos += w.numel()
        out.append(row)
    return out


@dataclass(frozen=True)
class ExpertShards:
    """This rank's place among its stage's expert shards (`parallel.ep` > 1 inside pipeline stages), for the
    global top-k: the shards hold the same dense matrices and each its block of experts' rows."""

    index: int
    """This rank's shard: it holds experts [index x E / count, (index + 1) x E / count) of every MoE layer."""
    count: int
    width: int
    """Prunable matrices per layer, the model's most (every rank lays its tie counts out alike)."""
    stacked: Mapping[int, Sequence[bool]]
    """Per layer held here: which of its prunable matrices are expert shards (the rest are dense)."""
    sum: Callable[[torch.Tensor], torch.Tensor]
    """Sum of a host vector over the shards (every shard gets the same bits)."""


def _kth_largest(mags: Sequence[torch.Tensor], k: int, total: Callable[[torch.Tensor], torch.Tensor]) -> float:
    """The k-th largest of every rank's `mags` (non-negative float32), exactly: a radix select on the bit
    patterns (for non-negative floats the order of the int32 patterns is the order of the values), 8 bits a
    round, each round one 256-bin histogram of the entries that share the prefix found so far, summed over the
    ranks by `total`. 4 rounds of 256 numbers, whatever the model's size (gathering every stage's local top-k
    instead would send (1 - sparsity) of the weights to every rank)."""
    prefix = known = 0
    device = mags[0].device if mags else torch.device("cpu")
    for shift in (24, 16, 8, 0):
        hist = torch.zeros(256, dtype=torch.int64, device=device)
        for m in mags:
            bits = m.view(torch.int32)
            match = (bits & known) == prefix
            hist += count_ids((bits >> shift) & 255, 256, match)
        hist = total(hist.cpu().double())  # one device read a round: pruning steps are rare
        above = 0.0
        for digit in range(255, -1, -1):  # the bin holding the k-th largest, counting from the top
            if above + float(hist[digit]) >= k:
                break
            above += float(hist[digit])
        k -= int(above)
        prefix |= digit << shift
        known = (known | 255 << shift) & 0x7FFFFFFF  # the sign bit is 0 in every pattern: int32-safe
    return float(torch.tensor([prefix], dtype=torch.int32).view(torch.float32))


def distributed_keep_masks(local: Mapping[int, Sequence[torch.Tensor]], keep: int, chain: Any,
                           num_layers: int, shards: ExpertShards | None = None) -> dict[int, list[torch.Tensor]]:
    """The same kept set as `global_magnitude_masks` over every stage's layers (and every expert shard's rows),
    computed with sums along the chain (and over the shards): the threshold by `_kth_largest`, then the ties at
    it kept in model order (layer, matrix, flat index, where an expert matrix's rows are its shards' blocks in
    order) from tie counts per (layer, matrix, shard). A dense matrix is counted on shard 0 only: every shard
    holds the same one and derives the same mask."""
    S, W = (shards.count, shards.width) if shards is not None else (1, 1)
    me = shards.index if shards is not None else 0
    mags = {i: [w.detach().abs().reshape(-1).float() for w in ws] for i, ws in sorted(local.items())}

    def total(v: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = chain.allreduce_sum(shards.sum(v) if shards is not None else v)
        return out

    def slot(i: int, j: int) -> tuple[int, bool]:
        """(tie-count slot of layer i's matrix j here, whether this rank counts it)."""
        if shards is None:  # one slot per layer: its matrices in order are its model order
            return i, True
        expert = bool(shards.stacked[i][j])
        return (i * W + j) * S + (me if expert else 0), expert or me == 0

    counted = [m for i, ms in mags.items() for j, m in enumerate(ms) if slot(i, j)[1]]
    n = int(total(torch.tensor([float(sum(m.numel() for m in counted))], dtype=torch.float64))[0])
    if keep <= 0 or keep > n:
        thr = float("inf") if keep <= 0 else -1.0
    else:
        thr = _kth_largest(counted, keep, total)
    counts = torch.zeros(num_layers + num_layers * W * S, dtype=torch.float64)
    where: list[int] = []  # each count's entry in `counts`, read from the device together
    found: list[torch.Tensor] = []
    for i, ms in mags.items():
        for j, m in enumerate(ms):
            at, mine = slot(i, j)
            if mine:
                where += [i, num_layers + at]
                found += [(m > thr).sum(), (m == thr).sum()]
    if found:
        counts.index_add_(0, torch.tensor(where), torch.stack(found).cpu().double())
    tot = total(counts)
    need = keep - int(tot[:num_layers].sum())
    quota = []
    for c in tot[num_layers:].tolist():  # the slots in model order
        quota.append(max(0, min(int(c), need)))
        need -= quota[-1]
    out: dict[int, list[torch.Tensor]] = {}
    for i, ms in mags.items():
        out[i] = []
        for j, m in enumerate(ms):
            at, _ = slot(i, j)
            mask = m > thr
            if quota[at]:
                ties = torch.nonzero(m == thr).squeeze(1)[:quota[at]]
                mask[ties] = True
                quota[at] -= ties.numel()  # the slot's later matrices take the rest (one slot per layer)
            out[i].append(mask.view(local[i][j].shape))
    return out


@dataclass
class CSRStructure:
    """Where the kept entries of an [F, D] mask are, in CSR order and in the transposed CSR order."""

    shape: tuple[int, int]
    nz: torch.Tensor
    crow: torch.Tensor
    col: torch.Tensor
    crow_t: torch.Tensor
    col_t: torch.Tensor
    perm_t: torch.Tensor

    @classmethod
    def from_mask(cls, mask_FD: torch.Tensor) -> CSRStructure:
        Fo, D = mask_FD.shape
        nz = torch.nonzero(mask_FD.reshape(-1)).squeeze(1)
        crow = torch.zeros(Fo + 1, dtype=torch.int64, device=mask_FD.device)
        crow[1:] = torch.cumsum(mask_FD.sum(dim=1), 0)
        col = nz % D
        slot = torch.full((Fo * D,), -1, dtype=torch.int64, device=mask_FD.device)
        slot[nz] = torch.arange(nz.numel(), device=mask_FD.device)
        nz_t = torch.nonzero(mask_FD.t().reshape(-1)).squeeze(1)  # row-major over [D, F]
        d, f = nz_t // Fo, nz_t % Fo
        crow_t = torch.zeros(D + 1, dtype=torch.int64, device=mask_FD.device)
        crow_t[1:] = torch.cumsum(mask_FD.sum(dim=0), 0)
        return cls((Fo, D), nz, crow, col, crow_t, f, slot[f * D + d])


class _CSRLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x_ND: torch.Tensor, w_FD: torch.Tensor, st: CSRStructure) -> torch.Tensor:
        vals_Z = w_FD.reshape(-1)[st.nz]
        A = torch.sparse_csr_tensor(st.crow, st.col, vals_Z, size=st.shape, check_invariants=False)
        ctx.save_for_backward(x_ND, vals_Z)
        ctx.st = st
        y_NF: torch.Tensor = torch.sparse.mm(A, x_ND.t()).t()
        return y_NF

    @staticmethod
    def backward(ctx: Any, dy_NF: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x_ND, vals_Z = ctx.saved_tensors
        st: CSRStructure = ctx.st
        dx = dw = None
        if ctx.needs_input_grad[0]:
            At = torch.sparse_csr_tensor(st.crow_t, st.col_t, vals_Z[st.perm_t], size=(st.shape[1], st.shape[0]),
                                         check_invariants=False)
            dx = torch.sparse.mm(At, dy_NF.t().contiguous()).t()
        if ctx.needs_input_grad[1]:
            A = torch.sparse_csr_tensor(st.crow, st.col, vals_Z, size=st.shape, check_invariants=False)
            g = torch.sparse.sampled_addmm(A, dy_NF.t().contiguous(), x_ND, beta=0.0)
            dw = torch.zeros(st.shape[0] * st.shape[1], dtype=vals_Z.dtype, device=vals_Z.device)
            dw[st.nz] = g.values()
            dw = dw.view(st.shape)
        return dx, dw, None


def csr_linear(x: torch.Tensor, weight_FD: torch.Tensor, st: CSRStructure) -> torch.Tensor:
    """x @ W^T computed with W's kept entries only (CSR)."""
    x_ND = x.reshape(-1, x.shape[-1])
    y_NF: torch.Tensor = _CSRLinear.apply(x_ND, weight_FD, st)
    return y_NF.reshape(*x.shape[:-1], st.shape[0])


def _csr_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if x.dtype != self.weight.dtype or torch.is_autocast_enabled(x.device.type):
        # CPU sparse kernels have no bf16 path; the pruned weight is zero off the mask, so the dense product is
        # the same maths (the kernel choice was timed in fp32, where the CSR path exists).
        return F.linear(x, self.weight)
    st: CSRStructure = self.__dict__["_moebal_csr"]  # a plain attribute: nn.Module keeps it in __dict__
    return csr_linear(x, self.weight, st)


def _install_csr(module: nn.Module, mask: torch.Tensor | None) -> None:
    """Make an nn.Linear run the CSR kernel for `mask` (None restores the dense forward)."""
    if mask is None:
        module.__dict__.pop("forward", None)
        module.__dict__.pop("_moebal_csr", None)
        return
    module.__dict__["_moebal_csr"] = CSRStructure.from_mask(mask)  # where nn.Module keeps a plain attribute
    module.forward = types.MethodType(_csr_forward, module)


def _time_kernels(weight: torch.Tensor, mask: torch.Tensor, rows: int, repeats: int = 3) -> tuple[float, float]:
    """Median forward+backward seconds of (masked dense, CSR) for this matrix at `rows` input rows: CPU time of
    the calling thread on a CPU (the machine may be shared), wall time between syncs on a GPU."""
    w = (weight.detach() * mask).requires_grad_(True)
    # a private generator: how many matrices a rank times depends on the partition, and drawing from the global
    # generator would make a migration change later random draws (router jitter, say)
    g = torch.Generator(device=weight.device).manual_seed(0)
    x = torch.randn(rows, weight.shape[1], generator=g, device=weight.device).requires_grad_(True)
    st = CSRStructure.from_mask(mask)

    def run(fn: Any) -> float:
        times = []
        with torch.enable_grad():  # pruning steps run under no_grad
            if weight.device.type != "cpu":  # asynchronous kernels, and the backward runs on autograd's device
                # thread: the calling thread's CPU time would be launch cost only. Wall time between device syncs
                return time_fn(lambda: fn(x, w).sum().backward(), warmup=1, repeats=repeats,
                               device=weight.device).median
            for _ in range(repeats + 1):
                t0 = time.thread_time()  # CPU time: the machine may be shared, the choice must not be noise
                fn(x, w).sum().backward()
                times.append(time.thread_time() - t0)
        return sorted(times[1:])[len(times[1:]) // 2]

    return run(lambda a, b: F.linear(a, b)), run(lambda a, b: csr_linear(a, b, st))


def mask_moments(optimizer: torch.optim.Optimizer | None, p: torch.Tensor, mask: torch.Tensor) -> None:
    """Multiply parameter `p`'s AdamW moments by `mask` wherever the optimizer keeps them: a sharded optimizer's
    parts or shards (its `mask_state`), torch's AdamW's per-parameter state otherwise."""
    mask_state = getattr(optimizer, "mask_state", None)
    if mask_state is not None:
        mask_state(p, mask)
        return
    for v in (optimizer.state.get(p, {}) if optimizer is not None else {}).values():
        if isinstance(v, torch.Tensor) and v.shape == p.shape:
            v.mul_(mask)


@register("pruning")
class GradualPruning(Dynamism):
    name = "pruning"

    def __init__(self, cfg: Any, final_sparsity: float = 0.9, initial_sparsity: float = 0.0, start: int = 10,
                 every: int = 10, steps: int = 4, kernel: str = "auto") -> None:
        if kernel not in ("auto", "dense", "csr"):
            raise ConfigError(f"dynamism pruning: kernel must be auto, dense or csr; got {kernel!r}")
        check_steps("pruning", start=start)
        self.schedule = zhu_gupta_schedule(final_sparsity, initial_sparsity, start, every, steps)
        self.L, self.kernel = cfg.model.n_layers, kernel
        self.rows = max(1, cfg.data.batch_size) * cfg.data.seq_len  # refined by the runner (micro-batch rows)
        self.level = 0.0
        self.total = 0
        self.width = 0
        self.masks: dict[int, dict[str, torch.Tensor]] = {}
        self.kernels: dict[int, dict[str, int]] = {}
        self.density: list[float] = [1.0] * self.L
        self.csr: list[bool] = [False] * self.L
        """Per layer: does any of its matrices run the CSR kernel (agreed along the chain: every rank predicts
        every layer's cost alike, whichever layers it holds)."""

    def prepare_model(self, model: MoebalForCausalLM) -> None:
        self.total = sum(_logical_numel(layer) for layer in model.model.layers)
        self.width = max(len(prunable_params(layer)) for layer in model.model.layers)

    def on_start(self, ctx: SchemeContext) -> None:
        if ctx.rows is not None:  # a micro-batch's token rows: what kernels are timed at
            self.rows = ctx.rows

    def update(self, ctx: SchemeContext) -> bool:
        due = [s for t, s in self.schedule if t == ctx.step]
        if not due or due[0] <= 0.0:  # `final_sparsity: 0` (a control run): every weight kept, nothing to mask
            return False
        self.prune(ctx, due[0])
        return True

    @torch.no_grad()
    def prune(self, ctx: SchemeContext, sparsity: float) -> None:
        stage = ctx.stage
        # whole weights: FSDP2's shards gathered (collective over the stage, layers in order; every rank of the
        # stage then computes the same masks), any other weight as it is
        local = {i: [whole_tensor(p) for _, p in prunable_params(stage.layer(i))] for i in stage.layer_ids}
        keep = round((1.0 - sparsity) * self.total)
        shards = self._shards(ctx)
        masks = distributed_keep_masks(local, keep, ctx.chain, self.L, shards)
        for i in stage.layer_ids:
            named = prunable_params(stage.layer(i))
            self.masks[i] = {n: m for (n, _), m in zip(named, masks[i])}
            for (_, p), m in zip(named, masks[i]):
                mask_rows_(p, m)
                mask_moments(ctx.optimizer, p, m)
            self._choose_kernels(i, stage.layer(i), dict(zip((n for n, _ in named), local[i])))
        if self.kernel == "auto" and (ctx.dp > 1 or shards is not None):
            self._agree_kernels(ctx)
        self.level = sparsity
        dens = torch.zeros(3 * self.L, dtype=torch.float64)
        for i in stage.layer_ids:
            # every matrix once over the stage: a dense one on shard 0, an expert one on every shard (its rows)
            held = [m for j, m in enumerate(self.masks[i].values())
                    if shards is None or shards.index == 0 or shards.stacked[i][j]]
            dens[i] = float(sum(int(m.sum()) for m in held))
            dens[self.L + i] = float(sum(m.numel() for m in held))
            dens[2 * self.L + i] = float(any(self.kernels[i].values()))  # agreed over the stage: a flag
        if shards is not None:
            dens[:2 * self.L] = shards.sum(dens[:2 * self.L].clone())
        tot = ctx.chain.allreduce_sum(dens)
        self.density = [float(tot[i] / tot[self.L + i]) if tot[self.L + i] > 0 else 1.0 for i in range(self.L)]
        # a layer counts as CSR when any of its matrices runs it (the data-parallel copies agreed on each matrix's
        # kernel above; the MAX keeps every rank's answer the same under `dense` and `csr` too)
        csr = tot[2 * self.L:].clone()
        if ctx.dp > 1:  # a CPU tensor: host bookkeeping over gloo
            dist.all_reduce(csr, op=dist.ReduceOp.MAX, group=ctx.dp_group)
        self.csr = [bool(c > 0) for c in csr.tolist()]

    def _shards(self, ctx: SchemeContext) -> ExpertShards | None:
        """This rank's place among the stage's expert shards (None: the stage's experts are not sharded)."""
        if ctx.ep <= 1:
            return None
        assert ctx.shard_sum is not None, "expert shards without their sum"
        stacked = {i: [is_expert_param(p) for _, p in prunable_params(ctx.stage.layer(i))]
                   for i in ctx.stage.layer_ids}
        return ExpertShards(index=ctx.ep_index, count=ctx.ep, width=self.width, stacked=stacked, sum=ctx.shard_sum)

    def _agree_kernels(self, ctx: SchemeContext) -> None:
        """The ranks of a stage run each matrix on one kernel: CSR where any of them timed it faster (a MAX
        all-reduce over the data-parallel copies, the matrices in layer and parameter order, then a sum of the
        flags over the expert shards, which hold the same dense matrices). Under `parallel.shard: full` FSDP2
        gathers and reduce-scatters each layer over these ranks, and the zero-bubble schedule defers a dense
        Linear's weight gradient to W but not the CSR kernel's: every rank of the stage must make the same calls."""
        order = [(i, n) for i in ctx.stage.layer_ids for n in self.kernels[i]]
        v = torch.tensor([float(self.kernels[i][n]) for i, n in order], dtype=torch.float64)
        if ctx.dp > 1:
            dist.all_reduce(v, op=dist.ReduceOp.MAX, group=ctx.dp_group)  # a CPU tensor: host bookkeeping (gloo)
        if ctx.ep > 1 and ctx.shard_sum is not None:
            v = ctx.shard_sum(v)
        for (i, n), c in zip(order, v.tolist()):
            self.kernels[i][n] = int(c > 0)
        for i in ctx.stage.layer_ids:
            self._install(i, ctx.stage.layer(i))

    def _choose_kernels(self, i: int, layer: nn.Module, whole: dict[str, torch.Tensor]) -> None:
        """Each prunable Linear's kernel (timed on its whole weight, `whole` by name, under `auto`)."""
        modules = dict(layer.named_modules())
        self.kernels[i] = {}
        for n, p in prunable_params(layer):
            mod = modules.get(n.rsplit(".", 1)[0])
            use_csr = 0
            if isinstance(mod, nn.Linear) and p.dtype == torch.float32:
                if self.kernel == "csr":
                    use_csr = 1
                elif self.kernel == "auto":
                    dense_s, csr_s = _time_kernels(whole[n], self.masks[i][n], self.rows)
                    use_csr = int(csr_s < dense_s)
            self.kernels[i][n] = use_csr
        self._install(i, layer)

    def _install(self, i: int, layer: nn.Module) -> None:
        modules = dict(layer.named_modules())
        for n, _ in prunable_params(layer):
            mod = modules.get(n.rsplit(".", 1)[0])
            if isinstance(mod, nn.Linear):
                _install_csr(mod, self.masks[i][n] if self.kernels.get(i, {}).get(n) else None)

    def after_backward(self, ctx: SchemeContext) -> None:
        mask_grad = getattr(ctx.optimizer, "mask_grad", None)
        for i in ctx.stage.layer_ids:
            for n, p in prunable_params(ctx.stage.layer(i)):
                if i not in self.masks:
                    continue
                # bf16 compute copies under the sharded optimizer: their micro-batches' gradients are summed in
                # its fp32 buffers, not in `.grad`
                if mask_grad is not None and mask_grad(p, self.masks[i][n]):
                    continue
                if p.grad is not None:
                    mask_rows_(p.grad, self.masks[i][n])  # under `full` FSDP2's summed shard: its rows

    @torch.no_grad()
    def after_optimizer_step(self, ctx: SchemeContext) -> None:
        for i in ctx.stage.layer_ids:
            if i in self.masks:
                for n, p in prunable_params(ctx.stage.layer(i)):
                    mask_rows_(p, self.masks[i][n])

    # ---- migration: masks and kernel choices travel with the layer ----
    def layer_state(self, i: int) -> dict[str, torch.Tensor]:
        # the receiver sizes its buffers by `layer_state_spec`, which only knows the job-wide level: send masks on
        # the same condition (every rank reaches each pruning step, so a level above 0 means every layer has them)
        if self.level == 0.0 or i not in self.masks:
            return {}
        out = {f"mask:{n}": m.to(torch.uint8) for n, m in self.masks[i].items()}
        out["kernels"] = torch.tensor([self.kernels[i][n] for n in self.masks[i]], dtype=torch.int64)
        return out

    def layer_state_spec(self, i: int, layer: nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        if self.level == 0.0:
            return {}
        named = prunable_params(layer)
        spec: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
            f"mask:{n}": (tuple(p.shape), torch.uint8) for n, p in named}
        spec["kernels"] = ((len(named),), torch.int64)
        return spec

    def load_layer_state(self, i: int, layer: nn.Module, state: dict[str, torch.Tensor]) -> None:
        if not state:
            return
        names = [k[5:] for k in state if k.startswith("mask:")]
        self.masks[i] = {n: state[f"mask:{n}"].bool() for n in names}
        self.kernels[i] = dict(zip(names, state["kernels"].tolist()))
        self._install(i, layer)

    def drop_layer(self, i: int) -> None:
        self.masks.pop(i, None)
        self.kernels.pop(i, None)

    # ---- predictions ----
    def cost_factors(self, num_layers: int) -> list[float]:
        """Masked dense costs what dense costs; a CSR layer's linear work scales with its density."""
        return [d if csr else 1.0 for d, csr in zip(self.density, self.csr)]

    def metrics(self) -> dict[str, Any]:
        csr = sum(v for k in self.kernels.values() for v in k.values())
        return {"sparsity_target": round(self.level, 4), "layer_density": [round(d, 4) for d in self.density],
                "csr_matrices_here": int(csr), "predicted_cost": [round(c, 4) for c in self.cost_factors(self.L)]}

    # ---- checkpoints: the schedule position and the per-layer figures; masks and kernel choices go by
    # `layer_state` (the checkpoint keys them by layer), so a resume re-times nothing ----
    def state_dict(self) -> dict[str, Any]:
        return {"level": self.level, "density": self.density, "csr": self.csr}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.level = float(state.get("level", 0.0))
        self.density = [float(d) for d in state.get("density", [1.0] * self.L)]
        self.csr = [bool(c) for c in state.get("csr", [False] * self.L)]
