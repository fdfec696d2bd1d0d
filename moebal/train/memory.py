"""Will the model fit? A lower bound on a training rank's memory, checked before anything is allocated.

An absurd size (`model.dim=1e24`) would otherwise fail deep inside `torch.empty` on every rank, with a
MemoryError or a long traceback each. The bound counts parameters from the config alone (embeddings,
attention, dense MLPs, experts and routers; shared experts and activations left out, so it never refuses a
model that fits) at 16 bytes each: fp32 weights, gradients and AdamW's two moments. A job spreads them over
its ranks at best evenly, so one rank needs at least the total / world size, against what one rank has: its
GPU's memory, or on the CPU this machine's RAM shared by the ranks it runs.
"""

from __future__ import annotations

import os

import torch

from moebal.config import Config
from moebal.errors import ConfigError
from moebal.planner.cost import ModelShape

__all__ = ["BYTES_PER_PARAM", "check_fits", "check_fits_here", "param_count"]

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


def check_fits_here(cfg: Config, local_ranks: int) -> None:
    """`check_fits` for this process: a rank (WORLD_SIZE, LOCAL_WORLD_SIZE from its launcher), or the launcher
    or single process of `moebal train`, which runs `local_ranks` ranks, all on this machine."""
    from moebal.distributed.groups import pick_device

    world = int(os.environ.get("WORLD_SIZE", local_ranks))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    check_fits(cfg, pick_device(int(os.environ.get("LOCAL_RANK", 0))), world, local)
