"""Will the model fit? A lower bound on a training rank's memory, checked before anything is allocated.

An absurd size (`model.dim=1e24`) would otherwise fail deep inside `torch.empty` on every rank, with a
MemoryError or a long traceback each. The bound counts parameters from the config alone (embeddings,
attention, dense MLPs, experts and routers; shared experts and activations left out, so it never refuses a
model that fits) at 16 bytes each: fp32 weights, gradients and AdamW's two moments. A job spreads them over
its ranks at best evenly, so one rank needs at least the total / world size, against what one rank has: its
GPU's memory, or on the CPU this machine's RAM shared by the ranks it runs.

Then the memory plan (`check_plan`, moebal/planner/memory.py) predicts each rank's peak by term and refuses,
in one line naming the largest term and a setting that fits, a job that will not fit (`moebal train
--no-memory-check` starts it anyway).
"""

from __future__ import annotations

import os

import torch

from moebal.config import Config
from moebal.errors import ConfigError
from moebal.planner.cost import ModelShape
from moebal.planner.memory import DeviceMemory

__all__ = ["BYTES_PER_PARAM", "check_fits", "check_fits_here", "check_plan", "check_plan_here", "param_count",
           "resolve_shard", "resolve_shard_here", "settle_shard"]

BYTES_PER_PARAM = 16  # fp32 weight + gradient + AdamW exp_avg + exp_avg_sq


def param_count(cfg: Config) -> int:
    """Parameters of the model the config describes (shared experts left out: a lower bound)."""
    s = ModelShape.from_config(cfg)
    layers = sum(s.attn_params + (s.num_experts * s.expert_params + s.router_params if s.is_moe(i)
                                  else s.dense_mlp_params) for i in range(s.n_layers))
    return s.embed_params + layers + s.dim


def _available(device: torch.device, local_ranks: int) -> tuple[int, str]:
    """Bytes one rank can use at most, and where they are."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory), f"{device} memory"
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # no sysconf (not POSIX): nothing to check against
        return 1 << 62, "host memory"
    return ram // max(local_ranks, 1), f"host memory / {local_ranks} ranks" if local_ranks > 1 else "host memory"


def check_fits(cfg: Config, device: torch.device, world_size: int, local_ranks: int) -> None:
    """ConfigError, naming the model's size and the memory it needs, when it cannot fit on `world_size`
    ranks (`local_ranks` of them on this machine)."""
    n = param_count(cfg)
    need = n * BYTES_PER_PARAM // max(world_size, 1)
    have, where = _available(device, local_ranks)
    if need > have:
        raise ConfigError(f"the model has {n:.3g} parameters (model.dim={cfg.model.dim}, model.n_layers="
                          f"{cfg.model.n_layers}, moe.num_experts={cfg.moe.num_experts}): training it needs at "
                          f"least {need / 2**30:.3g} GiB per rank on {world_size} rank(s) (weights, gradients and "
                          f"AdamW state), but a rank has {have / 2**30:.3g} GiB ({where}): make the model smaller "
                          f"or use more ranks")


def _here(local_ranks: int) -> tuple[torch.device, int, int]:
    """(device, world size, ranks on this machine) of this process: a rank (WORLD_SIZE, LOCAL_WORLD_SIZE from its
    launcher), or the launcher or single process of `moebal train`, which runs `local_ranks` ranks, all on this
    machine."""
    from moebal.distributed.groups import pick_device

    world = int(os.environ.get("WORLD_SIZE", local_ranks))
    return pick_device(int(os.environ.get("LOCAL_RANK", 0))), world, int(os.environ.get("LOCAL_WORLD_SIZE", world))


def check_fits_here(cfg: Config, local_ranks: int) -> None:
    """`check_fits` for this process (`_here`)."""
    check_fits(cfg, *_here(local_ranks))


def _device_memory(device: torch.device, local_ranks: int, costs: str) -> DeviceMemory:
    """One rank's memory: its GPU's capacity with the runtime and slack of the hardware profile named by
    `planner.costs` (else of the h100 profile's assumptions), or this machine's RAM shared by its ranks."""
    from moebal.planner.hardware import list_profiles, load_profile

    if device.type != "cuda":
        have, _ = _available(device, local_ranks)
        return DeviceMemory.cpu(float(have) * max(local_ranks, 1), local_ranks)
    profile = load_profile(costs if costs in list_profiles() else "h100")
    total = float(torch.cuda.get_device_properties(device).total_memory)
    return DeviceMemory(name=f"{torch.cuda.get_device_name(device)} ({total / 1e9:.1f} GB)", capacity_bytes=total,
                        runtime_bytes=profile.memory_reserved_bytes, slack=profile.allocator_slack, cuda=True)


def check_plan(cfg: Config, device: torch.device, world_size: int, local_ranks: int) -> None:
    """ConfigError in one line when the memory plan (moebal/planner/memory.py) says a rank of this job will not
    fit: the predicted peak, the largest term and a setting that fits. A layout the plan cannot describe is
    left to the trainer's own checks (which name what is wrong)."""
    from moebal.planner.memory import layout_from_config, plan_memory, refusal_line

    mem = _device_memory(device, local_ranks, cfg.planner.costs)
    precision = "bf16" if cfg.train.precision == "bf16" else "fp32"
    try:
        plan = plan_memory(cfg, layout_from_config(cfg, world_size, precision=precision), mem)
    except ConfigError:
        return
    if not plan.fits:
        raise ConfigError(f"{refusal_line(cfg, plan, built=BUILT)}; to start anyway: "
                          f"--no-memory-check")


def resolve_shard(cfg: Config, device: torch.device, world_size: int, local_ranks: int) -> tuple[Config, str | None]:
    """`cfg` with `parallel.shard: auto` settled for this job's ranks and device (`choose_shard`, the memory
    plan's rule), and a line saying what was chosen and why (None when the config named a value). A function of
    the config, the world size and the device's memory only, so every rank and the launcher settle it alike; the
    run directory's config.yaml keeps the result for a resume."""
    from moebal.planner.memory import choose_shard

    if cfg.parallel.shard != "auto":
        return cfg, None
    precision = "bf16" if cfg.train.precision == "bf16" else "fp32"
    chosen, line = choose_shard(cfg, world_size, _device_memory(device, local_ranks, cfg.planner.costs), precision,
                                shards=BUILT[0])
    return chosen, line


def settle_shard(cfg: Config, device: torch.device | None = None) -> Config:
    """`cfg` with `parallel.shard: auto` settled as `moebal train` settles it (`resolve_shard`) for this
    process's job: its world size (the process group's, else WORLD_SIZE, else 1), the ranks on this machine
    (LOCAL_WORLD_SIZE, else the world) and `device` (else this rank's). The entry points a library caller builds
    a run from (the trainer, the local step, `setup_parallel`, the pipeline runner) call it first, so a config
    never reaches the code that reads `parallel.shard` unsettled; on a config that names a value (or one
    `moebal train` settled) it returns `cfg` itself. Every rank of a job of like devices settles alike (a
    function of the config, the world size and the devices' memory, no message); a job over unlike devices
    names the value."""
    if cfg.parallel.shard != "auto":
        return cfg
    import torch.distributed as dist

    here, world, local = _here(1)
    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return resolve_shard(cfg, device or here, world, local)[0]


def resolve_shard_here(cfg: Config, local_ranks: int) -> tuple[Config, str | None]:
    """`resolve_shard` for this process (`_here`)."""
    return resolve_shard(cfg, *_here(local_ranks))


BUILT: tuple[tuple[str, ...], tuple[str, ...]] = (("none", "optimizer", "full"), ("none", "moe", "attention", "full"))
"""The parallel.shard and train.recompute values this build runs: a refusal proposes only these."""


def check_plan_here(cfg: Config, local_ranks: int) -> None:
    """`check_plan` for this process (`_here`)."""
    check_plan(cfg, *_here(local_ranks))
