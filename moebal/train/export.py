"""Consolidated weights of a training checkpoint, and their export as a HF checkpoint.

`checkpoint_weights(path)` presents a run's checkpoint as one `TensorSource` under moebal's names with every
expert of a layer stacked by logical expert id, whatever layout wrote it. It is a thin view of
`moebal.train.checkpoint.CheckpointReader`: checkpoints store every expert as its own tensor keyed by layer
and logical expert id, so each expert row is read from the rank file that holds it, one row at a time, and a
consolidated export of a sharded checkpoint never gathers the model in memory. Every file is verified
against the manifest (size, sha256) before it is read. `path` is a checkpoint directory (`ckpt-<step>`) or a
run directory (its newest checkpoint).

`ExportHook` writes `hf.export_to` at the end of training from the final checkpoint (`export_final`), in every
mode of the trainer.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from moebal.config import Config, from_dict
from moebal.errors import CheckpointError, TrainingError
from moebal.fileio import refuse_replacing
from moebal.interop.tensor_io import TensorInfo
from moebal.train.hooks import Hook

__all__ = ["CheckpointWeights", "ExportHook", "checkpoint_weights", "export_checkpoint", "export_final"]


def _resolve(path: Path) -> Path:
    from moebal.train.checkpoint import find_checkpoints

    if (path / "manifest.json").is_file():
        return path
    found = find_checkpoints(path)
    if not found:
        raise CheckpointError(f"{path} is neither a checkpoint directory (ckpt-<step>/ with manifest.json) nor a "
                              f"run directory holding one")
    return found[-1]


def _read_config(text: str, where: Path) -> Config:
    import yaml

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise CheckpointError(f"{where}: unreadable ({' '.join(str(e).split())})") from None
    return from_dict(data, source=str(where))


class CheckpointWeights:
    """A run checkpoint's model weights, consolidated over ranks (a `TensorSource`)."""

    def __init__(self, path: str | Path) -> None:
        from moebal.train.checkpoint import CheckpointReader, with_previous_hint

        self.path = _resolve(Path(path))
        try:
            self.reader = CheckpointReader(self.path)
            self.config = _read_config(self.reader.config_yaml, self.path / "config.yaml")
        except CheckpointError as e:
            raise with_previous_hint(self.path, e) from None

    def info(self) -> dict[str, TensorInfo]:
        return self.reader.info()

    def read(self, name: str, index: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.reader.read(name, index, out)

    def close(self) -> None:
        self.reader.close()


def checkpoint_weights(path: str | Path) -> CheckpointWeights:
    return CheckpointWeights(path)


def _base_of(cfg: Config) -> tuple[dict[str, Any] | None, Path | None]:
    """The config.json (and the directory) the run started from, when it is still there."""
    from moebal.interop.hf import hf_origin

    origin = hf_origin(cfg.hf.init_from)
    return (None, None) if origin is None else (origin.base, origin.path)


def export_checkpoint(path: str | Path, dst: str | Path, *, arch: str | None = None, dtype: str = "auto",
                      shard_gb: float | None = None, overwrite: bool = False) -> Path:
    """Write the checkpoint (or run directory) `path` as a HF checkpoint directory `dst`: config.json from the
    run's `hf.init_from` when there is one (every original key kept), its tokenizer and remote-code files."""
    from moebal.interop.hf import DTYPE_NAMES, write_hf

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


def check_export(cfg: Config, run_dir: Path) -> None:
    """Fail before training, not after it, when `hf.export_to` cannot be written."""
    from moebal.errors import ConfigError
    from moebal.interop.hf import check_exportable, choose_arch

    base, _ = _base_of(cfg)
    # the target as the export will write it: a relative hf.export_to is inside the run directory
    target = export_target(cfg, run_dir)
    if cfg.hf.init_from and target.resolve() == Path(cfg.hf.init_from).resolve():
        raise ConfigError("hf.export_to is the directory of hf.init_from: export somewhere else so the original "
                          "checkpoint is kept")
    # the export replaces its directory whole: never one holding the run (its checkpoints) or the origin
    refuse_replacing(target, "hf.export_to", {"the run directory": run_dir, "hf.init_from": cfg.hf.init_from})
    if target.is_file() or (target.is_dir() and any(target.iterdir()) and not (target / "config.json").is_file()):
        raise ConfigError(f"hf.export_to {target} holds files that are not a HF checkpoint (an earlier export): the "
                          f"export would replace them; give a new or empty directory")
    from moebal.interop.hf import fields_of

    arch = fields_of(base, "hf.init_from").arch if base else choose_arch(cfg)
    check_exportable(cfg, arch)


def export_final(cfg: Config, run_dir: Path) -> Path:
    """Export the run's newest checkpoint (complete: the writers wait for it before a run ends) to
    `hf.export_to`, replacing an earlier export of the same run."""
    from moebal.train.checkpoint import find_checkpoints

    found = find_checkpoints(run_dir)
    if not found:
        raise CheckpointError(f"{run_dir} holds no checkpoint to export to hf.export_to")
    written = export_checkpoint(found[-1], export_target(cfg, run_dir), overwrite=True)
    step = int(found[-1].name.split("-")[-1])
    print(f"moebal train: exported step {step} as a HF checkpoint to {written}", file=sys.stderr, flush=True)
    return written


class ExportHook(Hook):
    """At the end of training, write `hf.export_to` from the final checkpoint (rank 0, once every rank's shard
    is on disk)."""

    def __init__(self, cfg: Config, run_dir: Path) -> None:
        self.target = export_target(cfg, run_dir)
        self.written: Path | None = None
        check_export(cfg, run_dir)

    @property
    def name(self) -> str:
        return "hf_export"

    def on_end(self, trainer: Any) -> None:
        trainer.barrier()  # every training rank's final shard is written before rank 0 reads them
        failed: Exception | None = None
        if trainer.ctx.is_main:
            try:
                self.written = export_final(trainer.cfg, trainer.run_dir)
            except Exception as e:  # told to every rank below, then raised here: no rank waits on rank 0
                failed = e
        if trainer.strategy.agree_any(failed is not None):  # a collective over every rank still training
            if failed is not None:
                raise failed
            raise TrainingError(f"hf.export_to: rank 0 could not export the final checkpoint to {self.target} "
                                f"(its error says why); the checkpoint itself is written")
