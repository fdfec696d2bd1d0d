"""The CostModel: seconds for every compute op and collective of a training iteration, from a hardware profile.

The planners and the cluster simulator share it: a planner asks for a closed-form time (`time_of`), the
simulator replays the same collectives as fluid flows over the links they cross (`Collective.phases`), so the
two agree exactly when nothing overlaps and the simulator adds contention when things do.

Shape legend: R = ranks (of a group), E = experts, T = tokens, D = model dim, F = FFN hidden width,
V = vocabulary, L = links.

Models (each a deliberate simplification, see docs/cost-model.md):
- GEMM: 2 m n k FLOPs at peak * eff(m, n, k), eff = max_eff * prod_d d / (d + half_dim) (small GEMMs are far
  below peak), never faster than streaming its operands from memory (roofline), plus a launch cost.
- Elementwise work (norms, activations, permutes, optimizer): bytes / achievable memory bandwidth.
- Collectives: alpha-beta per algorithm. Pairwise all-to-all ((R-1) message latencies, every byte on its own
  route), ring all-reduce (2(R-1) steps, 2(R-1)/R * S per ring edge), hierarchical all-reduce when the group
  spans nodes with several members per node (intra reduce-scatter, inter-node ring per local rank, intra
  all-gather), pipelined-chain broadcast/reduce (S per chain edge, (R-1) latencies), ring all-gather.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from moebal.errors import ConfigError
from moebal.planner.hardware import DTYPE_BYTES, HardwareProfile, load_profile

if TYPE_CHECKING:
    from moebal.config import Config
    from moebal.planner.perf import GroupLinks, MoELayerCosts

__all__ = ["Collective", "CostModel", "ModelShape", "Phase", "Topology"]



# ---------------------------------------------------------------------------------------------------------
# model shape


@dataclass(frozen=True, kw_only=True)
class MLAShape:
    """Multi-head latent attention's widths (DeepSeek-V2 section 2.1; `moebal.config.MLAConfig`)."""

    q_lora_rank: int
    """0: one query projection (DeepSeek-V2-Lite)."""
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The dimensions the cost model needs (a Config has them; paper models are built directly)."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    num_experts: int = 0
    top_k: int = 1
    expert_ffn_dim: int = 0
    moe_every: int = 1
    moe_first_dense: int = 0
    """The first N layers are dense whatever moe_every says (DeepSeek's first_k_dense_replace)."""
    dense_layers: tuple[int, ...] = ()
    """Layers that are dense whatever moe_every says (HF mlp_only_layers)."""
    expert_matrices: int = 3
    """3: SwiGLU (w1, w3, w2); 2: a two-layer (ReLU/GeLU) MLP as in the GPT-style paper models."""
    router_hidden: int = 0
    """Hidden width of a Linear-tanh-Linear router (LLaMA-MoE); 0 for one linear."""
    tie_embeddings: bool = False
    mla: MLAShape | None = None
    """Multi-head latent attention's widths (None: grouped-query attention of `head_dim` per head)."""
    qk_norm: int = 0
    """Parameters of the query/key norms per layer (Qwen3-MoE: per head, OLMoE: over the projections)."""

    @classmethod
    def from_config(cls, cfg: Config) -> ModelShape:
        m, moe = cfg.model, cfg.moe
        mla = None
        if m.mla is not None:
            a = m.mla
            mla = MLAShape(q_lora_rank=a.q_lora_rank or 0, kv_lora_rank=a.kv_lora_rank,
                           qk_nope_head_dim=a.qk_nope_head_dim, qk_rope_head_dim=a.qk_rope_head_dim,
                           v_head_dim=a.v_head_dim)
        hd = cfg.head_dim
        qk_norm = {"none": 0, "head": 2 * hd, "full": (m.n_heads + m.n_kv_heads) * hd}[m.qk_norm]
        return cls(dim=m.dim, n_layers=m.n_layers, n_heads=m.n_heads, n_kv_heads=m.n_kv_heads,
                   head_dim=hd, ffn_dim=m.ffn_dim, vocab_size=m.vocab_size, num_experts=moe.num_experts,
                   top_k=moe.top_k, expert_ffn_dim=cfg.expert_ffn_dim, moe_every=moe.every,
                   moe_first_dense=moe.first_dense, dense_layers=moe.dense_layers,
                   router_hidden=moe.num_experts if moe.router == "mlp_tanh" else 0,
                   tie_embeddings=m.tie_embeddings, mla=mla, qk_norm=qk_norm)

    def is_moe(self, layer: int) -> bool:
        return (self.num_experts > 0 and (layer + 1) % self.moe_every == 0 and layer >= self.moe_first_dense
                and layer not in self.dense_layers)

    @property
    def attn_params(self) -> int:
        """Projections, the layer's two norms, and q/k norms (MLA: its compressions and their norms)."""
        if self.mla is not None:
            a, H = self.mla, self.n_heads
            q = (self.dim * a.q_lora_rank + a.q_lora_rank + a.q_lora_rank * H * a.qk_head_dim if a.q_lora_rank
                 else self.dim * H * a.qk_head_dim)
            kv = (self.dim * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank
                  + a.kv_lora_rank * H * (a.qk_nope_head_dim + a.v_head_dim))
            return q + kv + H * a.v_head_dim * self.dim + 2 * self.dim
        q = self.n_heads * self.head_dim
        kv = self.n_kv_heads * self.head_dim
        return self.dim * (q + 2 * kv) + q * self.dim + 2 * self.dim + self.qk_norm  # projections + norms

    @property
    def expert_params(self) -> int:
        return self.expert_matrices * self.dim * self.expert_ffn_dim

    @property
    def router_params(self) -> int:
        if self.router_hidden:
            return self.dim * self.router_hidden + self.router_hidden * self.num_experts
        return self.dim * self.num_experts

    @property
    def dense_mlp_params(self) -> int:
        return 3 * self.dim * self.ffn_dim

    @property
    def embed_params(self) -> int:
        return self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)


# ---------------------------------------------------------------------------------------------------------
# links and collectives


@dataclass(frozen=True)
class Phase:
    """One step of a collective: a fluid transfer of `nbytes[i]` over link `links[i]` after `latency_s`."""

    links: np.ndarray
    nbytes: np.ndarray
    latency_s: float
    efficiency: float = 1.0
    """Collective-specific multiplier on link capacity (from calibration)."""


@dataclass(frozen=True)
class Collective:
    """A collective (or point-to-point transfer) as consecutive phases over a topology's links."""

    kind: str
    ranks: tuple[int, ...]
    phases: tuple[Phase, ...]
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def total_bytes(self) -> float:
        return float(sum(p.nbytes.sum() for p in self.phases))


class Topology:
    """Links of `num_ranks` ranks laid out on nodes of a profile, and the route of every byte."""

    def __init__(self, profile: HardwareProfile, num_ranks: int) -> None:
        if num_ranks < 1:
            raise ConfigError(f"the simulated cluster needs at least 1 rank; got {num_ranks}")
        p = self.profile = profile
        self.num_ranks = R = num_ranks
        g = p.gpus_per_node
        self.num_nodes = N = -(-R // g)
        self.node_R = np.arange(R) // g
        self.nic_R = self.node_R * p.nics_per_node + (np.arange(R) % g) * p.nics_per_node // g
        caps: list[np.ndarray] = []
        names: list[str] = []

        def block(count: int, link: Any, label: str) -> int:
            start = sum(len(c) for c in caps)
            caps.append(np.full(count, link.capacity))
            names.append(label)
            self._block_ranges.append((start, start + count, label))
            return start

        self._block_ranges: list[tuple[int, int, str]] = []
        self.gpu_out0 = block(R, p.intra, "intra_out")
        self.gpu_in0 = block(R, p.intra, "intra_in")
        self.pair0 = block(R, p.pair, "pair") if p.pair is not None else -1
        self.nic_out0 = block(N * p.nics_per_node, p.inter, "nic_out")
        self.nic_in0 = block(N * p.nics_per_node, p.inter, "nic_in")
        self.backplane0 = block(N, p.backplane, "backplane") if p.backplane is not None else -1
        self.capacity_L = np.concatenate(caps)

    @property
    def num_links(self) -> int:
        return int(self.capacity_L.shape[0])

    def link_classes(self) -> list[tuple[int, int, str]]:
        return list(self._block_ranges)

    def spans_nodes(self, ranks: Sequence[int] | np.ndarray) -> bool:
        nodes = self.node_R[np.asarray(ranks, dtype=np.int64)]
        return bool(nodes.min() != nodes.max())

    def latency(self, ranks: Sequence[int] | np.ndarray) -> float:
        """Per-message latency of the slowest link class a group's messages cross."""
        if self.spans_nodes(ranks):
            return self.profile.inter.latency_s
        return self.profile.intra.latency_s

    def route_bytes(self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Aggregate bytes per link for transfers src[i] -> dst[i] of nbytes[i] (vectorised routing)."""
        b = np.asarray(nbytes, np.float64)
        keep = b > 0
        idx, links = self.route(np.asarray(src, np.int64)[keep], np.asarray(dst, np.int64)[keep])
        if links.size == 0:
            return links, np.zeros(0)
        per_L = np.bincount(links, weights=b[keep][idx], minlength=self.num_links)
        used = np.flatnonzero(per_L)
        return used, per_L[used]

    def route(self, src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The links of transfers src[i] -> dst[i]: (i, link) pairs, one per link a transfer crosses (a rank's
        transfer to itself crosses none)."""
        src, dst = np.asarray(src, np.int64), np.asarray(dst, np.int64)
        idx = np.flatnonzero(src != dst)
        src, dst = src[idx], dst[idx]
        same = self.node_R[src] == self.node_R[dst]
        parts_i, parts_l = [], []
        if self.pair0 >= 0:
            bridged = same & ((src ^ 1) == dst) & ((src // 2) == (dst // 2))
            parts_i.append(idx[bridged])
            parts_l.append(self.pair0 + src[bridged])
            switched = same & ~bridged
        else:
            switched = same
        uses_port = switched | (~same if self.profile.fabric == "pcie" else np.zeros_like(same))
        parts_i += [idx[uses_port], idx[uses_port]]
        parts_l += [self.gpu_out0 + src[uses_port], self.gpu_in0 + dst[uses_port]]
        if self.backplane0 >= 0:
            parts_i.append(idx[switched])
            parts_l.append(self.backplane0 + self.node_R[src[switched]])
        cross = ~same
        parts_i += [idx[cross], idx[cross]]
        parts_l += [self.nic_out0 + self.nic_R[src[cross]], self.nic_in0 + self.nic_R[dst[cross]]]
        return np.concatenate(parts_i), np.concatenate(parts_l)


# ---------------------------------------------------------------------------------------------------------
# the cost model


class CostModel:
    """Times of compute ops and collectives on `profile` in `dtype` (fp32, tf32, bf16, fp16)."""

    def __init__(self, profile: HardwareProfile | str, dtype: str = "bf16") -> None:
        self.profile = load_profile(profile)
        if dtype not in DTYPE_BYTES:
            raise ConfigError(f"cost model dtype must be one of {', '.join(DTYPE_BYTES)}; got {dtype!r}")
        self.dtype = dtype
        self.act_bytes = DTYPE_BYTES[dtype]
        self.peak = self.profile.peak_flops(dtype)
        self.mem_rate = self.profile.memory_bandwidth * self.profile.memory_efficiency
        self._topos: dict[int, Topology] = {}

    def topology(self, num_ranks: int) -> Topology:
        if num_ranks not in self._topos:
            self._topos[num_ranks] = Topology(self.profile, num_ranks)
        return self._topos[num_ranks]

    # ---- compute ----
    def gemm_s(self, m: Any, n: Any, k: Any, efficiency: float = 1.0) -> Any:
        """Seconds of an (m x k) @ (k x n) GEMM; dimensions may be arrays (broadcast); an empty GEMM costs 0."""
        g = self.profile.gemm
        m, n, k = (np.asarray(x, dtype=np.float64) for x in (m, n, k))
        h = g.half_dim
        with np.errstate(divide="ignore", invalid="ignore"):  # an empty GEMM (0 / 0 when half_dim is 0)
            eff = g.max_efficiency * efficiency * (m / (m + h)) * (n / (n + h)) * (k / (k + h))
        ws = (m * k + k * n + m * n) * self.act_bytes
        if g.cache_bytes > 0:
            # Operands that outgrow the cache run at a lower rate (CPU hosts: L2-resident vs streaming).
            c = g.out_of_cache_efficiency
            eff = eff * (c + (1.0 - c) * g.cache_bytes / (g.cache_bytes + ws))
        live = (m > 0) & (n > 0) & (k > 0)
        with np.errstate(divide="ignore", invalid="ignore"):
            t_flop = np.where(live, 2.0 * m * n * k / (self.peak * eff), 0.0)
        t = np.where(live, np.maximum(t_flop, ws / self.mem_rate) + g.launch_s, 0.0)
        return float(t) if t.ndim == 0 else t

    def linear_s(self, m: Any, n: float, k: float, backward: bool = False, efficiency: float = 1.0) -> Any:
        """y[m, n] = x[m, k] W[n, k]^T; its backward is dgrad dx = dy W (m x n @ n x k) plus wgrad
        dW = dy^T x (n x m @ m x k): the same FLOPs twice over, in other shapes."""
        if not backward:
            return self.gemm_s(m, n, k, efficiency)
        return self.gemm_s(m, k, n, efficiency) + self.gemm_s(n, k, m, efficiency)

    def mem_s(self, nbytes: Any) -> Any:
        """Seconds to stream `nbytes` through device memory (elementwise kernels)."""
        return np.asarray(nbytes, dtype=np.float64) / self.mem_rate if np.ndim(nbytes) else nbytes / self.mem_rate

    def _elementwise(self, nbytes: Any, ops: float, backward: bool) -> Any:
        """`ops` elementwise kernels moving `nbytes` in the forward; the backward reads the saved input and
        the output gradient and writes the input gradient (about 2x the bytes and the kernels)."""
        k = 2.0 if backward else 1.0
        return k * (self.mem_s(nbytes) + ops * self.profile.op_overhead_s)

    def _mla_projections_s(self, shape: ModelShape, T: int, backward: bool) -> float:
        """MLA's projections: query (compressed or not), the kv compression with the shared rotary key, its
        expansion to per-head keys and values, the output projection."""
        a, H, D = shape.mla, shape.n_heads, shape.dim
        assert a is not None
        if a.q_lora_rank:
            q = self.linear_s(T, a.q_lora_rank, D, backward) + self.linear_s(T, H * a.qk_head_dim, a.q_lora_rank,
                                                                             backward)
        else:
            q = self.linear_s(T, H * a.qk_head_dim, D, backward)
        kv = (self.linear_s(T, a.kv_lora_rank + a.qk_rope_head_dim, D, backward)
              + self.linear_s(T, H * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank, backward))
        return float(q + kv + self.linear_s(T, D, H * a.v_head_dim, backward))

    def attention_s(self, shape: ModelShape, batch: int, seq: int, backward: bool = False) -> float:
        """Norm, QKV, rotary, causal SDPA, output projection, residual and the second norm of one layer."""
        T = batch * seq
        p = self.profile
        if shape.mla is None:
            q, kv = shape.n_heads * shape.head_dim, shape.n_kv_heads * shape.head_dim
            proj = self.linear_s(T, q + 2 * kv, shape.dim, backward) + self.linear_s(T, shape.dim, q, backward)
            qk_dim = v_dim = shape.head_dim
        else:
            qk_dim, v_dim = shape.mla.qk_head_dim, shape.mla.v_head_dim
            q = kv = shape.n_heads * qk_dim
            proj = self._mla_projections_s(shape, T, backward)
        # SDPA as two GEMMs per head (QK^T and PV), of which a causal kernel computes a share; its backward
        # recomputes the scores (flash attention): attention_backward_factor x the forward.
        per_head = (self.gemm_s(seq, seq, qk_dim, efficiency=p.attention_efficiency)
                    + self.gemm_s(seq, seq, v_dim, efficiency=p.attention_efficiency) - 2 * p.gemm.launch_s)
        sdpa = p.causal_attention_factor * batch * shape.n_heads * per_head + p.gemm.launch_s
        if backward:
            sdpa *= p.attention_backward_factor
        # Passes over the activations: two RMSNorms in fp32 (~6 read+write passes each), rotary on q and k
        # (~6 passes), two residual adds, the head transposes; about 32 kernels.
        nbytes = T * (2 * 6 * 2 * shape.dim * 4 + 6 * 2 * (q + kv) * self.act_bytes + 3 * 3 * shape.dim
                      * self.act_bytes + 2 * 2 * q * self.act_bytes)
        return float(proj + sdpa + self._elementwise(nbytes, 32, backward))

    def router_s(self, shape: ModelShape, tokens: int, backward: bool = False) -> float:
        """Gate GEMM(s), softmax/top-k/renormalise, the balancing losses, and the sort-based permute."""
        if shape.router_hidden:
            gate = (self.linear_s(tokens, shape.router_hidden, shape.dim, backward)
                    + self.linear_s(tokens, shape.num_experts, shape.router_hidden, backward))
        else:
            gate = self.linear_s(tokens, shape.num_experts, shape.dim, backward)
        rows = tokens * shape.top_k
        # the permute reads the token rows and writes their k copies; the [T, E] fp32 logits and probabilities
        # pass through softmax, top-k, renormalisation, the losses and the statistics: about ten passes in about
        # 16 kernels, an estimate rather than an op-by-op count (calibration's fit takes up the difference)
        nbytes = 2.0 * rows * shape.dim * self.act_bytes + 10.0 * tokens * shape.num_experts * 4
        return float(gate + self._elementwise(nbytes, 16, backward))

    def combine_s(self, shape: ModelShape, tokens: int, backward: bool = False) -> float:
        """Weighted scatter-add of the expert outputs back to token order."""
        return float(self._elementwise(3.0 * tokens * shape.top_k * shape.dim * self.act_bytes, 3, backward))

    def experts_s(self, shape: ModelShape, tokens_per_expert: Any, backward: bool = False) -> Any:
        """Expert MLPs for row counts per expert; the last axis is summed (experts run one by one)."""
        m = np.asarray(tokens_per_expert, dtype=np.float64)
        D, F = shape.dim, shape.expert_ffn_dim
        eff = self.profile.grouped_gemm_efficiency
        up = (shape.expert_matrices - 1) * self.linear_s(m, F, D, backward, eff)
        down = self.linear_s(m, D, F, backward, eff)
        gemms = (up + down).sum(axis=-1)
        rows = m.sum(axis=-1)
        act = self._elementwise(rows * F * self.act_bytes * (3.0 if shape.expert_matrices == 3 else 2.0), 4, backward)
        t = gemms + np.where(rows > 0, act, 0.0)
        return float(t) if np.ndim(t) == 0 else t

    def experts_fwd_s(self, shape: ModelShape, tokens_per_expert: Any) -> Any:
        return self.experts_s(shape, tokens_per_expert)

    def dense_mlp_s(self, shape: ModelShape, tokens: int, backward: bool = False) -> float:
        D, F = shape.dim, shape.ffn_dim
        return float(2 * self.linear_s(tokens, F, D, backward) + self.linear_s(tokens, D, F, backward)
                     + self._elementwise(3.0 * tokens * F * self.act_bytes, 2, backward))

    def head_s(self, shape: ModelShape, tokens: int, backward: bool = False) -> float:
        """Final norm, LM head GEMM and cross-entropy (fp32 logits)."""
        V = shape.vocab_size
        # fp32 logits written, then read by the log-softmax and by its backward's gather (3 passes over [T, V]);
        # the norm's reads and writes of [T, D] in fp32 (about 12 passes with its statistics); 11 kernels: an
        # estimate rather than an op-by-op count
        nbytes = 3.0 * tokens * V * 4 + 12.0 * tokens * shape.dim * 4
        return float(self.linear_s(tokens, V, shape.dim, backward) + self._elementwise(nbytes, 11, backward))

    def embed_s(self, shape: ModelShape, tokens: int, backward: bool = False) -> float:
        return float(self._elementwise(2.0 * tokens * shape.dim * self.act_bytes, 1, backward))

    def optimizer_s(self, params: float, tensors: int = 0) -> float:
        """One AdamW step: its memory traffic plus ~10 kernels per parameter tensor (single-tensor loop)."""
        return float(self.mem_s(self.profile.optimizer_bytes_per_param * params)
                     + 10 * tensors * self.profile.op_overhead_s)

    # ---- collectives ----
    def _lat(self, kind: str, topo: Topology, ranks: Sequence[int] | np.ndarray) -> float:
        lat = self.profile.collective(kind).latency_for(len(ranks))
        return topo.latency(ranks) if lat is None else lat

    def _phase(self, kind: str, topo: Topology, src: Any, dst: Any, nbytes: Any, latency: float,
               world: int | None = None) -> Phase:
        src, dst = np.asarray(src), np.asarray(dst)
        links, b = topo.route_bytes(src, dst, np.asarray(nbytes, dtype=np.float64))
        n = world if world is not None else len(np.union1d(src, dst))
        eff = self.profile.collective(kind).efficiency_for(n)
        return Phase(links=links, nbytes=b, latency_s=latency, efficiency=eff)

    def p2p(self, topo: Topology, src: int, dst: int, nbytes: float) -> Collective:
        lat = self._lat("p2p", topo, [src, dst])
        return Collective("p2p", (src, dst), (self._phase("p2p", topo, [src], [dst], [nbytes], lat),))

    def all_to_all(self, topo: Topology, ranks: Sequence[int] | np.ndarray, bytes_RR: np.ndarray) -> Collective:
        """Pairwise exchange: bytes_RR[i, j] from ranks[i] to ranks[j]; R-1 message latencies."""
        r = np.asarray(ranks, dtype=np.int64)
        n = len(r)
        b = np.asarray(bytes_RR, dtype=np.float64)
        if b.shape != (n, n):
            raise ValueError(f"all_to_all over {n} ranks needs an {n} x {n} byte matrix; got {b.shape}")
        src, dst = np.repeat(r, n), np.tile(r, n)
        lat = (n - 1) * self._lat("all_to_all", topo, r)
        return Collective("all_to_all", tuple(r.tolist()), (self._phase("all_to_all", topo, src, dst, b.ravel(), lat),))

    def all_reduce(self, topo: Topology, ranks: Sequence[int], nbytes: float) -> Collective:
        r = np.sort(np.asarray(ranks, dtype=np.int64))
        n = len(r)
        if n <= 1 or nbytes <= 0:
            return Collective("all_reduce", tuple(r.tolist()), ())
        nodes, per_node = np.unique(topo.node_R[r], return_counts=True)
        if len(nodes) == 1 or per_node.max() == 1 or per_node.min() != per_node.max():
            return Collective("all_reduce", tuple(r.tolist()), (self._ring(topo, "all_reduce", r, nbytes, 2.0),))
        g, N = int(per_node[0]), len(nodes)
        local = r.reshape(N, g)  # sorted ranks: row = node, column = local member
        intra_src, intra_dst = local.ravel(), np.roll(local, -1, axis=1).ravel()
        inter_src, inter_dst = local.ravel(), np.roll(local, -1, axis=0).ravel()
        lat_i = self._lat("all_reduce", topo, local[0])
        lat_e = self._lat("all_reduce", topo, local[:, 0])
        rs = self._phase("all_reduce", topo, intra_src, intra_dst, np.full(n, (g - 1) / g * nbytes), (g - 1) * lat_i)
        ar = self._phase("all_reduce", topo, inter_src, inter_dst, np.full(n, 2.0 * (N - 1) / N * nbytes / g),
                         2 * (N - 1) * lat_e)
        ag = self._phase("all_reduce", topo, intra_src, intra_dst, np.full(n, (g - 1) / g * nbytes), (g - 1) * lat_i)
        return Collective("all_reduce", tuple(r.tolist()), (rs, ar, ag), {"algorithm": "hierarchical"})

    def _ring(self, topo: Topology, kind: str, r: np.ndarray, nbytes: float, factor: float) -> Phase:
        n = len(r)
        order = r[np.lexsort((r, topo.node_R[r]))]
        per_edge = factor * (n - 1) / n * nbytes
        steps = int(round(factor * (n - 1)))
        return self._phase(kind, topo, order, np.roll(order, -1), np.full(n, per_edge),
                           steps * self._lat(kind, topo, r))

    def all_gather(self, topo: Topology, ranks: Sequence[int], nbytes_total: float) -> Collective:
        r = np.asarray(ranks, dtype=np.int64)
        if len(r) <= 1:
            return Collective("all_gather", tuple(r.tolist()), ())
        return Collective("all_gather", tuple(r.tolist()), (self._ring(topo, "all_gather", r, nbytes_total, 1.0),))

    def broadcast(self, topo: Topology, root: int, ranks: Sequence[int], nbytes: float,
                  kind: str = "broadcast") -> Collective:
        """Pipelined chain from `root` through the others (node by node): S on every chain edge."""
        others = np.asarray([x for x in ranks if x != root], dtype=np.int64)
        if others.size == 0 or nbytes <= 0:
            return Collective(kind, (root,), ())
        others = others[_chain_order(topo, root, others)]
        chain = np.concatenate([[root], others])
        src, dst = (chain[:-1], chain[1:]) if kind == "broadcast" else (chain[1:], chain[:-1])
        lat = len(others) * self._lat(kind, topo, chain)
        return Collective(kind, tuple(chain.tolist()),
                          (self._phase(kind, topo, src, dst, np.full(len(others), float(nbytes)), lat),))

    def broadcast_many(self, topo: Topology, groups: Sequence[tuple[int, Sequence[int]]], nbytes: float,
                       kind: str = "broadcast", algorithm: str = "chain") -> Collective:
        """Several broadcasts (or reduces) of `nbytes` each, (root, members) per group, issued together: the
        same as grouped() of the single ones, routed in one vectorised pass; the latency is the longest chain's
        (or fan-out's) step count times the per-message latency of the union of the members."""
        srcs, dsts, ranks, steps = [], [], set(), 0
        for root, members in groups:
            others = np.asarray([x for x in members if x != root], dtype=np.int64)
            if others.size == 0:
                continue
            if algorithm == "fanout":
                a, b = np.full(others.size, root), others
            else:
                others = others[_chain_order(topo, root, others)]
                chain = np.concatenate([[root], others])
                a, b = chain[:-1], chain[1:]
            steps = max(steps, int(others.size))
            srcs.append(a if kind == "broadcast" else b)
            dsts.append(b if kind == "broadcast" else a)
            ranks.update([int(root), *others.tolist()])
        if not srcs or nbytes <= 0:
            return Collective(kind, tuple(sorted(ranks)), ())
        src, dst = np.concatenate(srcs), np.concatenate(dsts)
        ck = "p2p" if algorithm == "fanout" else kind
        lat = steps * self._lat(ck, topo, sorted(ranks))
        ph = self._phase(ck, topo, src, dst, np.full(src.size, float(nbytes)), lat, world=len(ranks))
        return Collective(kind, tuple(sorted(ranks)), (ph,))

    def reduce(self, topo: Topology, root: int, ranks: Sequence[int], nbytes: float) -> Collective:
        return self.broadcast(topo, root, ranks, nbytes, kind="reduce")

    def fanout(self, topo: Topology, root: int, ranks: Sequence[int], nbytes: float,
               kind: str = "broadcast") -> Collective:
        """Point-to-point fan-out (broadcast) or fan-in (reduce): the root sends S to (receives S from) every
        other member directly, so its link carries (R-1) * S (moebal's own Trans/Agg on gloo)."""
        others = np.asarray([x for x in ranks if x != root], dtype=np.int64)
        if others.size == 0 or nbytes <= 0:
            return Collective(kind, (root,), ())
        root_arr = np.full(others.size, root)
        src, dst = (root_arr, others) if kind == "broadcast" else (others, root_arr)
        lat = others.size * self._lat("p2p", topo, [root, *others.tolist()])
        return Collective(kind, (root, *others.tolist()),
                          (self._phase("p2p", topo, src, dst, np.full(others.size, float(nbytes)), lat),))

    @staticmethod
    def grouped(colls: Sequence[Collective], kind: str) -> Collective:
        """Single-phase collectives issued together (an NCCL group, batched point-to-point) as one: their bytes
        add up per link, the slowest latency counts once."""
        phases = [c.phases[0] for c in colls if c.phases]
        if any(len(c.phases) > 1 for c in colls):
            raise ValueError("grouped() takes single-phase collectives only")
        ranks = tuple(sorted({r for c in colls for r in c.ranks}))
        if not phases:
            return Collective(kind, ranks, ())
        links = np.concatenate([p.links for p in phases])
        nbytes = np.concatenate([p.nbytes for p in phases])
        uniq, inv = np.unique(links, return_inverse=True)
        merged = Phase(links=uniq, nbytes=np.bincount(inv, weights=nbytes, minlength=uniq.shape[0]),
                       latency_s=max(p.latency_s for p in phases), efficiency=min(p.efficiency for p in phases))
        return Collective(kind, ranks, (merged,))

    def time_of(self, coll: Collective, topo: Topology) -> float:
        """Uncontended seconds: per phase, latency + the slowest link's bytes / capacity."""
        t = 0.0
        for ph in coll.phases:
            bw = 0.0
            if ph.links.size:
                bw = float(np.max(ph.nbytes / (topo.capacity_L[ph.links] * ph.efficiency)))
            t += ph.latency_s + bw
        return t

    # ---- Pro-Prophet / FasterMoE coefficients ----
    def group_links(self, topo: Topology, ranks: Sequence[int], trans_algorithm: str = "fanout") -> GroupLinks:
        """The links of a group's transfers with this profile's latencies and efficiencies, for the expert
        planner to price its exchanges (`all_to_all`) and Trans/Agg (`broadcast_many` with `trans_algorithm`)
        as this model does."""
        from moebal.planner.perf import TRANS_ALGORITHMS, GroupLinks

        if trans_algorithm not in TRANS_ALGORITHMS:
            raise ConfigError(f"trans algorithm {trans_algorithm!r}: one of {', '.join(TRANS_ALGORITHMS)}")
        r = np.asarray(ranks, dtype=np.int64)
        R = r.size
        pair_P, link_P = topo.route(np.repeat(r, R), np.tile(r, R))  # as all_to_all routes an exchange
        used, link_P = np.unique(link_P, return_inverse=True)
        p = self.profile

        def per_world(kind: str) -> tuple[np.ndarray, np.ndarray]:
            """[R + 1, 2] latency (within a node, across nodes) and [R + 1] efficiency by ranks taking part."""
            c = p.collective(kind)
            lat = np.array([[p.intra.latency_s, p.inter.latency_s] if c.latency_for(n) is None
                             else [c.latency_for(n)] * 2 for n in range(R + 1)], dtype=np.float64)
            return lat, np.array([c.efficiency_for(max(n, 1)) for n in range(R + 1)], dtype=np.float64)

        trans_kind, agg_kind = ("p2p", "p2p") if trans_algorithm == "fanout" else ("broadcast", "reduce")
        t_lat, t_eff = per_world(trans_kind)
        a_lat, a_eff = per_world(agg_kind)
        return GroupLinks(num_ranks=R, ranks=r, node_R=topo.node_R[r], pair_P=pair_P,
                          link_P=link_P.astype(np.int64), capacity_L=topo.capacity_L[used],
                          a2a_latency_s=(R - 1) * self._lat("all_to_all", topo, r) if R > 1 else 0.0,
                          a2a_efficiency=p.collective("all_to_all").efficiency_for(R),
                          trans_algorithm=trans_algorithm, trans_latency=t_lat, trans_efficiency=t_eff,
                          agg_latency=a_lat, agg_efficiency=a_eff)

    def moe_layer_costs(self, shape: ModelShape, ep_ranks: Sequence[int], tokens_per_rank: int, seq: int,
                        num_ranks: int | None = None, trans_algorithm: str = "fanout") -> MoELayerCosts:
        """perf.MoELayerCosts for one MoE layer of `shape` on the expert-parallel group `ep_ranks`.

        token_bytes/param sizes from the shape; t from the expert MLP at the average rows per local expert; the
        group's links (`links`), with which the planner prices every exchange as `all_to_all` does here, skewed
        ones included, and a layer's Trans and Agg as `broadcast_many` does with `trans_algorithm` ("fanout":
        moebal's executor; "chain"); the A2A bandwidth (eq. 1, for the callers that want one figure) is a
        callable whose value at b bytes is b / (time of a uniform all-to-all in which each rank receives b bytes);
        Trans/Agg bandwidth (eq. 4, 5) = expert bytes / chain broadcast time over the group; the non-MoE
        forward/backward are this layer's attention + router times; backward_factor is the experts' backward /
        forward time in this model (2 when GEMM efficiency does not depend on the layout).
        """
        from moebal.planner.perf import MoELayerCosts

        ranks = list(ep_ranks)
        R = len(ranks)
        topo = self.topology(num_ranks or (max(ranks) + 1))
        E = shape.num_experts
        rows = max(1.0, tokens_per_rank * shape.top_k / max(1, E // R))
        t_tok = self.experts_s(shape, [rows]) / rows
        param_bytes = shape.expert_params * self.act_bytes
        bcast = self.time_of(self.broadcast(topo, ranks[0], ranks, param_bytes), topo) if R > 1 else 1.0
        links = self.group_links(topo, ranks, trans_algorithm)

        known: dict[float, float] = {}

        def a2a_bw(nbytes: float) -> float:
            if nbytes <= 0 or R <= 1:
                return math.inf
            if nbytes not in known:  # a placement search asks for the same sizes many times (once routed: kept)
                per_pair = nbytes / (R - 1)
                mat = np.full((R, R), per_pair)
                np.fill_diagonal(mat, 0.0)
                known[nbytes] = nbytes / self.time_of(self.all_to_all(topo, ranks, mat), topo)
            return known[nbytes]

        batch = max(1, tokens_per_rank // seq)
        fwd = self.attention_s(shape, batch, seq) + self.router_s(shape, tokens_per_rank)
        bwd = self.attention_s(shape, batch, seq, True) + self.router_s(shape, tokens_per_rank, True)
        backward = self.experts_s(shape, [rows], True) / (t_tok * rows)
        return MoELayerCosts(token_bytes=shape.dim * self.act_bytes, expert_param_bytes=param_bytes,
                             expert_grad_bytes=param_bytes, expert_tokens_per_s=1.0 / t_tok,
                             a2a_bandwidth=a2a_bw, trans_bandwidth=param_bytes / bcast,
                             agg_bandwidth=param_bytes / bcast, nonmoe_fwd_s=fwd,
                             nonmoe_bwd_s=bwd, backward_factor=float(backward),
                             num_ranks=R, links=links)


def _chain_order(topo: Topology, root: int, others: np.ndarray) -> np.ndarray:
    """The order of a broadcast chain's members after `root` (`perf.chain_order`)."""
    from moebal.planner.perf import chain_order

    return chain_order(topo.node_R[others], others, int(topo.node_R[root]))
