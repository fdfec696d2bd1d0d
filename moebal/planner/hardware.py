"""Hardware profiles: what one accelerator computes, how fast its links move bytes, how nodes are wired.

A profile is a YAML file in `configs/hardware/` (or any path). Every datasheet figure carries its source in a
comment or in the `source:` list; every figure that is a modelling assumption (achievable fraction of a peak,
a per-message latency) says so. Load one by short name (`h100`, `a100`, `rtx3090`, `rtx3090-nvlink`,
`rtx2080ti`, `h100-ndr400`) or by path with `load_profile`.

Units: FLOP/s, bytes/s per direction, seconds, bytes. A link's usable capacity is `bandwidth * efficiency`.

Topology (used by `Topology.route_bytes`): rank r sits on node r // gpus_per_node. Inside a node, traffic crosses the
sender's and receiver's fabric ports (`intra`: an NVSwitch port or the GPU's PCIe link), or a dedicated
NVLink bridge when the two GPUs are a bridged pair (`pair`). Across nodes it crosses the sender's and
receiver's NICs (`inter`, `nics_per_node` per node, GPUs spread evenly over them); on a PCIe fabric the GPU's
PCIe link carries that traffic too. An optional node `backplane` caps the sum of intra-node traffic (a PCIe
root complex, or the memory bus of a CPU host running gloo).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

from moebal.config import build_schema, read_yaml
from moebal.errors import ConfigError
from moebal.fileio import write_text_whole

_D = TypeVar("_D")

__all__ = [
    "CollectiveSpec",
    "GemmSpec",
    "HardwareProfile",
    "LinkSpec",
    "PROFILE_DIR",
    "dump_profile",
    "list_profiles",
    "load_profile",
    "profile_from_dict",
    "profile_to_dict",
]

PROFILE_DIR = Path(__file__).resolve().parent.parent.parent / "configs" / "hardware"

DTYPE_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2}
COLLECTIVES = ("all_to_all", "all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "p2p")


@dataclass(kw_only=True, frozen=True)
class LinkSpec:
    """One kind of link, per direction."""

    bandwidth: float
    """Peak bytes/s per direction (datasheet)."""
    latency_s: float
    """Seconds per message (alpha of the alpha-beta model): software + wire latency."""
    efficiency: float = 1.0
    """Achievable fraction of `bandwidth` for large transfers (a modelling assumption unless calibrated)."""
    kind: str = ""
    """Free text: pcie3, nvlink4, ib-edr, loopback, ..."""

    @property
    def capacity(self) -> float:
        return self.bandwidth * self.efficiency


@dataclass(kw_only=True, frozen=True)
class GemmSpec:
    """Shape-dependent GEMM efficiency: eff(m, n, k) = max_efficiency * prod_d d / (d + half_dim)."""

    max_efficiency: float
    """Fraction of peak reached by large GEMMs."""
    half_dim: float
    """A dimension this small halves the efficiency (small GEMMs are far below peak)."""
    launch_s: float = 0.0
    """Fixed seconds per kernel (launch and tail)."""
    cache_bytes: float = 0.0
    """Operand bytes (m k + k n + m n) at which the rate falls halfway to `out_of_cache_efficiency`; 0 disables
    the term (GPUs). A CPU core runs cache-resident GEMMs about twice as fast as streaming ones."""
    out_of_cache_efficiency: float = 1.0
    """Multiplier on efficiency for operands far larger than `cache_bytes`."""


@dataclass(kw_only=True, frozen=True)
class CollectiveSpec:
    """Per-collective corrections of the link model (fitted by calibration; defaults change nothing)."""

    latency_s: float | None = None
    """Seconds per algorithm step, replacing the links' latency; null keeps the links' value."""
    efficiency: float = 1.0
    """Multiplier on link capacity for this collective's traffic."""
    latency_by_world: dict[str, float] = field(default_factory=dict)
    """Seconds per step by group size (a CPU host: latency grows once processes outnumber cores); the nearest
    listed size applies; empty: `latency_s`."""

    efficiency_by_world: dict[str, float] = field(default_factory=dict)
    """Capacity multiplier by group size (a CPU host: processes share cores); the nearest size applies."""

    def latency_for(self, world: int) -> float | None:
        return _nearest(self.latency_by_world, world, self.latency_s)

    def efficiency_for(self, world: int) -> float:
        return float(_nearest(self.efficiency_by_world, world, self.efficiency))


@dataclass(kw_only=True, frozen=True)
class HardwareProfile:
    """A cluster of identical nodes of identical accelerators."""

    name: str
    """Short name (`h100`); the file is configs/hardware/<name>.yaml."""
    description: str = ""
    """One line on what the profile models."""
    source: tuple[str, ...] = ()
    """Where each datasheet figure comes from."""
    device: str = ""
    """Accelerator model (H100 SXM5 80GB, ...)."""
    gpus_per_node: int
    """Accelerators per node."""
    flops: dict[str, float]
    """Dense peak FLOP/s of matrix multiplies by dtype (fp32, tf32, bf16, fp16)."""
    gemm: GemmSpec
    """Efficiency curve of GEMMs."""
    memory_bandwidth: float
    """Device memory bytes/s (peak)."""
    memory_efficiency: float = 0.8
    """Achievable fraction of memory bandwidth for elementwise kernels (assumption unless calibrated)."""
    memory_bytes: float
    """Device memory capacity in bytes."""
    attention_efficiency: float = 1.0
    """Multiplier on GEMM efficiency for attention's batched matmuls (fused kernels; calibration fits it). 1.0 on
    the GPU profiles is an assumption (attention's matmuls run as well as the GEMM curve of their shape), not a
    measurement."""
    causal_attention_factor: float = 0.5
    """Share of the full T x T attention FLOPs a causal kernel computes (0.5: flash-style skips the masked half)."""
    grouped_gemm_efficiency: float = 1.0
    """Multiplier on GEMM efficiency inside the grouped expert kernel (1 where grouped GEMMs run like plain
    ones; a CPU loop over small per-expert slices runs well below; calibration measures moebal's kernel)."""
    op_overhead_s: float = 5e-6
    """Seconds of fixed cost per elementwise kernel (launch, dispatcher, autograd bookkeeping); GEMMs carry
    gemm.launch_s instead. 5 us is a GPU kernel-launch assumption; calibration measures a CPU host's."""
    optimizer_bytes_per_param: float = 32.0
    """Memory traffic of one AdamW step per parameter: fp32 param, m and v read and written (24 bytes), the
    gradient read and written (8: foreach AdamW's in-place work on it); calibration measures it."""
    attention_backward_factor: float = 2.5
    """SDPA backward / forward (flash-style backward recomputes the scores: 2.5 is the FLOP ratio)."""
    intra: LinkSpec
    """A GPU's port into the intra-node fabric."""
    fabric: Literal["switch", "pcie"] = "switch"
    """switch: NVSwitch-like, NIC traffic does not use the GPU port; pcie: the GPU's PCIe link carries NIC traffic."""
    pair: LinkSpec | None = None
    """NVLink bridge between GPUs 2i and 2i+1 of a node (None: no bridges)."""
    backplane: LinkSpec | None = None
    """Node-wide cap on the sum of intra-node traffic (None: no cap)."""
    inter: LinkSpec
    """One network interface (per direction)."""
    nics_per_node: int = 1
    """Network interfaces per node; GPUs are spread over them evenly."""
    collectives: dict[str, CollectiveSpec] = field(default_factory=dict)
    """Per-collective corrections by name (all_to_all, all_reduce, broadcast, reduce, all_gather, reduce_scatter,
    p2p)."""
    calibration: dict[str, Any] = field(default_factory=dict)
    """Free-form facts of how a calibrated profile was measured (host, versions, fit residuals)."""
    memory_reserved_bytes: float = 0.0
    """Device bytes a training process holds before its model (CUDA context, cuBLAS and NCCL workspaces): the
    memory plan's runtime term (moebal/planner/memory.py)."""
    allocator_slack: float = 0.0
    """Share of the planned bytes the caching allocator loses to fragmentation (the memory plan's slack)."""

    def __post_init__(self) -> None:
        _check_profile(self)

    def peak_flops(self, dtype: str) -> float:
        if dtype not in self.flops:
            raise ConfigError(f"hardware profile '{self.name}' has no matmul rate for dtype '{dtype}'; "
                              f"it has {', '.join(sorted(self.flops))}: add flops.{dtype} or pick another dtype")
        return self.flops[dtype]

    def collective(self, kind: str) -> CollectiveSpec:
        return self.collectives.get(kind, _NO_CORRECTION)


_NO_CORRECTION = CollectiveSpec()


def _nearest(table: dict[str, float], world: int, default: _D) -> float | _D:
    if not table:
        return default
    near = min((int(w) for w in table), key=lambda w: (abs(w - world), -w))
    return table[str(near)]


def _need(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


def _positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def _non_negative(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0


def _check_link(where: str, link: LinkSpec) -> None:
    _need(_positive(link.bandwidth), f"{where}.bandwidth must be > 0 bytes/s; got {link.bandwidth!r}")
    _need(link.latency_s >= 0 and math.isfinite(link.latency_s),
          f"{where}.latency_s must be >= 0 seconds; got {link.latency_s!r}")
    _need(0 < link.efficiency <= 1, f"{where}.efficiency must be in (0, 1]; got {link.efficiency!r}")


def _check_profile(p: HardwareProfile) -> None:
    n = p.name or "<unnamed>"
    _need(isinstance(p.gpus_per_node, int) and p.gpus_per_node >= 1,
          f"profile '{n}': gpus_per_node must be an integer >= 1; got {p.gpus_per_node!r}")
    _need(isinstance(p.nics_per_node, int) and 1 <= p.nics_per_node <= p.gpus_per_node,
          f"profile '{n}': nics_per_node must be in 1..gpus_per_node ({p.gpus_per_node}); got {p.nics_per_node!r}")
    _need(bool(p.flops), f"profile '{n}': flops needs at least one dtype rate, e.g. flops: {{fp32: 19.5e12}}")
    for dt, v in p.flops.items():
        _need(dt in DTYPE_BYTES, f"profile '{n}': flops.{dt}: unknown dtype; use {', '.join(DTYPE_BYTES)}")
        _need(_positive(v), f"profile '{n}': flops.{dt} must be > 0 FLOP/s; got {v!r}")
    _need(0 < p.gemm.max_efficiency <= 1, f"profile '{n}': gemm.max_efficiency must be in (0, 1]; "
          f"got {p.gemm.max_efficiency!r}")
    _need(p.gemm.half_dim >= 0 and p.gemm.launch_s >= 0 and p.gemm.cache_bytes >= 0,
          f"profile '{n}': gemm.half_dim, gemm.launch_s and gemm.cache_bytes must be >= 0")
    _need(0 < p.gemm.out_of_cache_efficiency <= 1, f"profile '{n}': gemm.out_of_cache_efficiency must be in (0, 1]")
    for key in ("memory_bandwidth", "memory_bytes", "attention_efficiency",
                "causal_attention_factor", "attention_backward_factor", "grouped_gemm_efficiency",
                "optimizer_bytes_per_param"):
        _need(_positive(getattr(p, key)), f"profile '{n}': {key} must be > 0; got {getattr(p, key)!r}")
    _need(0 < p.memory_efficiency <= 1, f"profile '{n}': memory_efficiency must be in (0, 1]")
    _need(p.memory_reserved_bytes >= 0 and 0 <= p.allocator_slack < 1,
          f"profile '{n}': memory_reserved_bytes must be >= 0 and allocator_slack in [0, 1); got "
          f"{p.memory_reserved_bytes!r}, {p.allocator_slack!r}")
    _need(p.op_overhead_s >= 0, f"profile '{n}': op_overhead_s must be >= 0 seconds; got {p.op_overhead_s!r}")
    _check_link(f"profile '{n}': intra", p.intra)
    _check_link(f"profile '{n}': inter", p.inter)
    if p.pair is not None:
        _check_link(f"profile '{n}': pair", p.pair)
        _need(p.gpus_per_node % 2 == 0, f"profile '{n}': NVLink pairs need an even gpus_per_node")
    if p.backplane is not None:
        _check_link(f"profile '{n}': backplane", p.backplane)
    for kind, spec in p.collectives.items():
        _need(kind in COLLECTIVES, f"profile '{n}': collectives.{kind}: unknown collective; "
              f"use {', '.join(COLLECTIVES)}")
        _need(spec.efficiency > 0 and (spec.latency_s is None or spec.latency_s >= 0),
              f"profile '{n}': collectives.{kind}: efficiency must be > 0 and latency_s >= 0")
        for table, ok, what in (("latency_by_world", _non_negative, ">= 0 seconds"),
                                ("efficiency_by_world", _positive, "> 0")):
            for world, v in getattr(spec, table).items():
                where = f"profile '{n}': collectives.{kind}.{table}"
                _need(str(world).isdigit() and int(world) >= 1,
                      f"{where}: keys are group sizes (integers >= 1); got {world!r}")
                _need(ok(v), f"{where}.{world} must be {what}; got {v!r}")


# ---------------------------------------------------------------------------------------------------------
# YAML


def list_profiles() -> list[str]:
    """Short names of the profiles shipped in configs/hardware/."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml")) if PROFILE_DIR.is_dir() else []


def load_profile(name_or_path: str | Path | HardwareProfile) -> HardwareProfile:
    """A profile by short name (`a100`) or YAML path; a HardwareProfile passes through."""
    if isinstance(name_or_path, HardwareProfile):
        return name_or_path
    p = Path(name_or_path)
    if not p.is_file():
        cand = PROFILE_DIR / f"{name_or_path}.yaml"
        if not cand.is_file():
            names = list_profiles()
            close = difflib.get_close_matches(str(name_or_path), names, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(f"hardware profile '{name_or_path}' not found{hint}: give a YAML path or one of "
                              f"{', '.join(names)}; `moebal calibrate` writes one for this machine")
        p = cand
    return profile_from_dict(read_yaml(p), source=str(p))


RETIRED_KEYS = {"backward_factor": "no planner read it (the cost model prices each backward part itself)"}
"""Keys profiles once had, refused with why they went."""


def profile_from_dict(data: Any, source: str = "<dict>") -> HardwareProfile:
    """Build and validate a profile from parsed YAML with the run config's rules and messages
    (`moebal.config.build_schema`): unknown keys fail naming the closest valid one, retired ones saying why."""
    for key, why in RETIRED_KEYS.items():
        if isinstance(data, dict) and key in data:
            raise ConfigError(f"{source}: '{key}' is no longer a profile key: {why}; delete the line")
    return build_schema(HardwareProfile, data, source=source)


def _plain(x: Any) -> Any:
    """YAML-safe copy: numpy scalars become Python numbers, tuples lists."""
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, str):
        return str(x)
    if hasattr(x, "item") and callable(x.item):
        return x.item()
    return x


def profile_to_dict(p: HardwareProfile) -> dict[str, Any]:
    d: dict[str, Any] = _plain(dataclasses.asdict(p))
    d["source"] = list(p.source)
    for key in ("pair", "backplane"):
        if d[key] is None:
            del d[key]
    return d


def dump_profile(p: HardwareProfile, path: str | Path | None = None, header: str = "") -> str:
    """YAML text of a profile (written to `path` when given); `header` becomes leading comment lines."""
    text: str = yaml.safe_dump(profile_to_dict(p), sort_keys=False, default_flow_style=False)
    if header:
        text = "".join(f"# {line}\n" for line in header.splitlines()) + text
    if path is not None:  # whole or not at all: a calibration killed mid-write keeps the old profile
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        write_text_whole(path, text)
    return text
