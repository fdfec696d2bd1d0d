"""Consolidated weights of a training checkpoint, and their export as a HF checkpoint.

`checkpoint_weights(path)` presents a run's checkpoint as one `TensorSource` under moebal's names with every
expert of a layer stacked by logical expert id, whatever expert-parallel layout wrote it: each expert row is
read from the rank file that holds it, one row at a time, so a consolidated export of a sharded checkpoint
never gathers the model in memory. `path` is a checkpoint directory (`ckpt-<step>`) or a run directory (its
newest checkpoint).

The format read here is `moebal/train/checkpoint.py`'s: rank 0's weights in `RUN/ckpt-N/model.safetensors`,
rank r's in `RUN/ranks/r/ckpt-N/model.safetensors`, experts sharded in contiguous blocks of logical ids
(`default_owners`) over the first `ep` ranks, every file verified against its manifest before it is read.

`ExportHook` writes `hf.export_to` at the end of training from the final checkpoint.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from moebal.config import Config, from_dict
from moebal.errors import CheckpointError
from moebal.models.tensor_io import FileSource, TensorInfo
from moebal.train.hooks import Hook

__all__ = ["CheckpointWeights", "ExportHook", "checkpoint_weights", "export_checkpoint"]

_EXPERT_SUFFIXES = (".experts.w1", ".experts.w3", ".experts.w2")


def _resolve(path: Path) -> Path:
    from moebal.train.checkpoint import find_checkpoints

    if (path / "manifest.json").is_file() and (path / "model.safetensors").is_file():
        return path
    found = find_checkpoints(path)
    if not found:
        raise CheckpointError(f"{path} is neither a checkpoint directory (ckpt-<step>/ with manifest.json) nor a "
                              f"run directory holding one")
    return found[-1]


def _read_config(ckpt: Path) -> Config:
    import yaml

    try:
        data = yaml.safe_load((ckpt / "config.yaml").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise CheckpointError(f"{ckpt}/config.yaml: unreadable ({' '.join(str(e).split())})") from None
    return from_dict(data, source=str(ckpt / "config.yaml"))


class CheckpointWeights:
    """A run checkpoint's model weights, consolidated over expert-parallel ranks (a `TensorSource`)."""

    def __init__(self, path: str | Path) -> None:
        from moebal.train.checkpoint import verify_checkpoint

        self.path = _resolve(Path(path))
        self.config = _read_config(self.path)
        if self.config.parallel.pp > 1:
            raise CheckpointError(f"{self.path} was written by a pipeline-parallel run (parallel.pp > 1), whose "
                                  f"stages keep their own layers; export its weights from a run with pp=1")
        verify_checkpoint(self.path)
        self.files = [FileSource(self.path / "model.safetensors")]
        self.aliases = self._aliases(self.files[0])
        E = self.config.moe.num_experts
        local = self._local_experts(self.files[0])
        self.ep = E // local if local else 1
        run = self.path.parent
        for r in range(1, self.ep):
            shard = run / "ranks" / str(r) / self.path.name
            if not shard.is_dir():
                raise CheckpointError(f"{shard} is missing: the checkpoint was written by {self.ep} expert-parallel "
                                      f"ranks and rank {r}'s shard holds experts {r * local}..{(r + 1) * local - 1}")
            verify_checkpoint(shard)
            self.files.append(FileSource(shard / "model.safetensors"))
        self.per_rank = local

    @staticmethod
    def _aliases(f: FileSource) -> dict[str, str]:
        import json

        return dict(json.loads(f.metadata.get("aliases", "{}")))

    def _local_experts(self, f: FileSource) -> int:
        rows = {e.shape[0] for n, e in f.entries.items() if n.endswith(_EXPERT_SUFFIXES)}
        if len(rows) > 1:
            raise CheckpointError(f"{f.path}: expert tensors hold different numbers of experts {sorted(rows)}")
        local = rows.pop() if rows else 0
        E = self.config.moe.num_experts
        if local and E % local:
            raise CheckpointError(f"{f.path}: {local} experts per rank do not divide moe.num_experts={E}")
        return local

    def _is_expert(self, name: str) -> bool:
        return name.endswith(_EXPERT_SUFFIXES)

    def info(self) -> dict[str, TensorInfo]:
        out = {}
        for name, t in self.files[0].info().items():
            shape = (self.config.moe.num_experts, *t.shape[1:]) if self._is_expert(name) else t.shape
            out[name] = TensorInfo(t.dtype, tuple(shape), t.where)
        for alias, target in self.aliases.items():
            out[alias] = out[target]
        return out

    def read(self, name: str, index: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        name = self.aliases.get(name, name)
        if not self._is_expert(name):
            return self.files[0].read(name, index, out)
        if index is None:  # the whole stacked tensor: rank by rank (only for callers that want it whole)
            parts = [f.read(name) for f in self.files]
            whole = torch.cat(parts)
            if out is not None:
                out.copy_(whole)
                return out
            return whole
        return self.files[index // self.per_rank].read(name, index % self.per_rank, out)

    def close(self) -> None:
        for f in self.files:
            f.close()


def checkpoint_weights(path: str | Path) -> CheckpointWeights:
    return CheckpointWeights(path)


def _base_of(cfg: Config) -> tuple[dict[str, Any] | None, Path | None]:
    """The config.json (and the directory) the run started from, when it is still there."""
    from moebal.models.hf import BASE_CONFIG, is_moebal_dir, read_hf_config

    init = cfg.hf.init_from
    if not init or not Path(init).is_dir():
        return None, None
    p = Path(init)
    if is_moebal_dir(p):
        import json

        base = p / BASE_CONFIG
        return (json.loads(base.read_text(encoding="utf-8")) if base.is_file() else None), p
    return read_hf_config(p), p


def export_checkpoint(path: str | Path, dst: str | Path, *, arch: str | None = None, dtype: str = "auto",
                      shard_gb: float | None = None, overwrite: bool = False) -> Path:
    """Write the checkpoint (or run directory) `path` as a HF checkpoint directory `dst`: config.json from the
    run's `hf.init_from` when there is one (every original key kept), its tokenizer and remote-code files."""
    from moebal.models.hf import DTYPE_NAMES, write_hf

    weights = checkpoint_weights(path)
    try:
        cfg = weights.config
        base, origin = _base_of(cfg)
        if dtype == "auto":
            dtype = cfg.hf.export_dtype
        if dtype == "auto":
            dtype = (base or {}).get("torch_dtype") or (base or {}).get("dtype") or "float32"
        if dtype not in DTYPE_NAMES:
            raise CheckpointError(f"export dtype '{dtype}' is not one of {', '.join(DTYPE_NAMES)}")
        gb = cfg.hf.shard_gb if shard_gb is None else shard_gb
        return write_hf(weights, cfg, dst, arch=arch, dtype=DTYPE_NAMES[dtype], shard_bytes=int(gb * 1e9),
                        base=base, copy_from=origin, overwrite=overwrite)
    finally:
        weights.close()


def export_target(cfg: Config, run_dir: Path) -> Path:
    target = Path(cfg.hf.export_to or "")
    return target if target.is_absolute() else run_dir / target


def check_export(cfg: Config) -> None:
    """Fail before training, not after it, when `hf.export_to` cannot be written."""
    from moebal.errors import ConfigError
    from moebal.models.hf import check_exportable, choose_arch

    if cfg.parallel.pp > 1:
        raise ConfigError("hf.export_to is not supported with parallel.pp > 1 (pipeline stages checkpoint their own "
                          "layers): train with pp=1, or drop hf.export_to")
    base, _ = _base_of(cfg)
    if cfg.hf.init_from and Path(cfg.hf.export_to or "").resolve() == Path(cfg.hf.init_from).resolve():
        raise ConfigError("hf.export_to is the directory of hf.init_from: export somewhere else so the original "
                          "checkpoint is kept")
    from moebal.models.hf import fields_of

    arch = fields_of(base, "hf.init_from").arch if base else choose_arch(cfg)
    check_exportable(cfg, arch)


class ExportHook(Hook):
    """At the end of training, write `hf.export_to` from the final checkpoint (rank 0, once every rank's shard
    is on disk)."""

    def __init__(self, cfg: Config, run_dir: Path) -> None:
        self.target = export_target(cfg, run_dir)
        self.written: Path | None = None
        check_export(cfg)

    @property
    def name(self) -> str:
        return "hf_export"

    def on_end(self, trainer: Any) -> None:
        import torch.distributed as dist

        if trainer.ctx.distributed:
            dist.barrier()  # every rank's final shard is written before rank 0 reads them
        if trainer.ctx.is_main:
            from moebal.train.checkpoint import find_checkpoints

            final = find_checkpoints(trainer.run_dir)[-1]
            self.written = export_checkpoint(final, self.target, overwrite=True)
            print(f"moebal train: exported step {trainer.step} as a HF checkpoint to {self.written}", file=sys.stderr,
                  flush=True)
        if trainer.ctx.distributed:
            dist.barrier()
