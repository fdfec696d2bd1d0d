"""Checkpoints: atomic, verified, and loaded without unpickling anything.

A checkpoint is a directory `ckpt-<step>` holding

    model.safetensors      weights (tied tensors stored once, their aliases in the metadata)
    optimizer.safetensors  the optimizer's per-parameter tensors (AdamW moments and step counts)
    state.json             step, optimizer hyper-parameters, data-loader position, RNG states (torch, CUDA,
                           numpy, python), hook states
    config.yaml            the resolved config of the run
    manifest.json          written last: size and sha256 of every file above

It is written under a temporary name, every file and the directory are fsync'ed, and only then renamed to
its final name, so a crash leaves either a whole checkpoint or an ignorable `.tmp` directory. Loading
verifies the manifest before reading a byte of state and checks every tensor's name and shape against the
live model and optimizer before changing either, so a bad checkpoint never half-loads. Tensors go through
safetensors and everything else through JSON: nothing is unpickled.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moebal.errors import CheckpointError

__all__ = [
    "CheckpointState",
    "apply_checkpoint",
    "find_checkpoints",
    "latest_good_checkpoint",
    "prune_checkpoints",
    "read_checkpoint",
    "restore_rng",
    "rng_state",
    "save_checkpoint",
    "verify_checkpoint",
]

FORMAT = 1
NAME_RE = re.compile(r"^ckpt-(\d+)$")
FILES = ("model.safetensors", "optimizer.safetensors", "state.json", "config.yaml")


# ---------------------------------------------------------------------------------------------
# RNG state as JSON-ready data


def rng_state() -> dict[str, Any]:
    """Every RNG the run draws from, as plain data."""
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state().tolist(),
        "numpy": [np_state[0], np_state[1].tolist(), *(x.item() if hasattr(x, "item") else x for x in np_state[2:])],
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
    }
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), *rest))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


# ---------------------------------------------------------------------------------------------
# writing


def _fsync_write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # platforms without directory handles (Windows): rename is still atomic
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _model_tensors(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """State dict with tied tensors stored once: (tensors, alias -> stored name)."""
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[int, tuple[int, ...], tuple[int, ...]], str] = {}
    for name, t in model.state_dict().items():
        key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()))
        if t.numel() and key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        tensors[name] = t.detach().to("cpu").contiguous()
    return tensors, aliases


def _optimizer_payload(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    sd = opt.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for idx, per_param in sd["state"].items():
        for key, value in per_param.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{idx}.{key}"] = value.detach().to("cpu").contiguous()
            else:
                scalars.setdefault(str(idx), {})[key] = value
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def save_checkpoint(run_dir: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    extra: dict[str, Any], config_yaml: str) -> Path:
    """Write ckpt-<step> atomically; `extra` (loader state, RNG, hooks) must be JSON-serialisable."""
    from safetensors.torch import save_file

    final = run_dir / f"ckpt-{step:07d}"
    tmp = run_dir / f".ckpt-{step:07d}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    weights, aliases = _model_tensors(model)
    save_file(weights, str(tmp / "model.safetensors"), metadata={"aliases": json.dumps(aliases)})
    opt_tensors, opt_meta = _optimizer_payload(optimizer)
    save_file(opt_tensors, str(tmp / "optimizer.safetensors"))
    state = {"format": FORMAT, "step": step, "optimizer": opt_meta, **extra}
    _fsync_write(tmp / "state.json", json.dumps(state).encode("utf-8"))
    _fsync_write(tmp / "config.yaml", config_yaml.encode("utf-8"))
    for name in ("model.safetensors", "optimizer.safetensors"):
        with open(tmp / name, "rb+") as f:
            os.fsync(f.fileno())
    files = {name: {"bytes": (tmp / name).stat().st_size, "sha256": _sha256(tmp / name)} for name in FILES}
    _fsync_write(tmp / "manifest.json", json.dumps({"format": FORMAT, "step": step, "files": files},
                                                   indent=1).encode("utf-8"))
    _fsync_dir(tmp)
    if final.exists():  # re-saving the same step (a resumed run's final step): replace it whole
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(run_dir)
    return final


def find_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoint directories of a run, oldest first (temporary ones are not checkpoints)."""
    if not run_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in run_dir.iterdir() if p.is_dir() and (m := NAME_RE.match(p.name))]
    return [p for _, p in sorted(found)]


def prune_checkpoints(run_dir: Path, keep: int) -> None:
    """Delete all but the newest `keep` checkpoints and any temporary leftovers of crashed saves."""
    for p in find_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(p, ignore_errors=True)
    for p in run_dir.glob(".ckpt-*.tmp-*"):
        if p.is_dir() and str(os.getpid()) != p.name.rsplit("-", 1)[-1]:
            shutil.rmtree(p, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# reading


def verify_checkpoint(path: Path) -> dict[str, Any]:
    """The manifest, after checking every file's presence, size and sha256; CheckpointError otherwise."""
    manifest_path = path / "manifest.json"
    if not manifest_path.is_file():
        raise CheckpointError(f"{manifest_path} is missing: the checkpoint is incomplete")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        files = manifest["files"]
        if manifest.get("format") != FORMAT:
            raise CheckpointError(f"{manifest_path}: format {manifest.get('format')!r}, expected {FORMAT}")
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{manifest_path} is corrupt ({e.__class__.__name__})") from None
    for name in FILES:
        f = path / name
        if name not in files:
            raise CheckpointError(f"{manifest_path} does not list {name}")
        if not f.is_file():
            raise CheckpointError(f"{f} is missing")
        size = f.stat().st_size
        if size != files[name]["bytes"]:
            raise CheckpointError(f"{f} has {size} bytes, the manifest says {files[name]['bytes']} (truncated?)")
        if _sha256(f) != files[name]["sha256"]:
            raise CheckpointError(f"{f} is corrupt: its sha256 does not match the manifest")
    return dict(manifest)


def latest_good_checkpoint(run_dir: Path, before: Path | None = None) -> Path | None:
    """The newest checkpoint that verifies (older than `before` when given)."""
    for p in reversed(find_checkpoints(run_dir)):
        if before is not None and _step_of(p) >= _step_of(before):
            continue
        try:
            verify_checkpoint(p)
        except CheckpointError:
            continue
        return p
    return None


def _step_of(path: Path) -> int:
    m = NAME_RE.match(path.name)
    return int(m.group(1)) if m else -1


@dataclass
class CheckpointState:
    """A verified checkpoint read into memory, not yet applied to anything."""

    path: Path
    step: int
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    state: dict[str, Any]
    config_yaml: str


def read_checkpoint(path: Path) -> CheckpointState:
    """Verify and read a checkpoint; a failure names the file and the newest older checkpoint that is good."""
    try:
        verify_checkpoint(path)
        return _read_verified(path)
    except CheckpointError as e:
        previous = latest_good_checkpoint(path.parent, before=path)
        hint = (f"; the previous good checkpoint is {previous}: move {path.name} aside (or pass "
                f"--resume-from {previous}) to continue from it") if previous else "; no older good checkpoint exists"
        raise CheckpointError(f"{e}{hint}") from None


def _read_verified(path: Path) -> CheckpointState:
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file

    try:
        model = load_file(str(path / "model.safetensors"))
        with safe_open(str(path / "model.safetensors"), framework="pt") as f:
            aliases = json.loads((f.metadata() or {}).get("aliases", "{}"))
        opt_tensors = load_file(str(path / "optimizer.safetensors"))
        state = json.loads((path / "state.json").read_text(encoding="utf-8"))
    except (SafetensorError, json.JSONDecodeError, UnicodeDecodeError, OSError) as e:
        raise CheckpointError(f"{path}: unreadable although its checksums match ({e})") from None
    for alias, target in aliases.items():
        model[alias] = model[target]
    meta = state.pop("optimizer")
    opt_state: dict[int, dict[str, Any]] = {}
    for key, t in opt_tensors.items():
        _, idx, name = key.split(".", 2)
        opt_state.setdefault(int(idx), {})[name] = t
    for idx, scalars in meta["scalars"].items():
        opt_state.setdefault(int(idx), {}).update(scalars)
    groups = [{**g, "betas": tuple(g["betas"])} if "betas" in g else g for g in meta["param_groups"]]
    return CheckpointState(path=path, step=int(state["step"]), model=model,
                           optimizer={"state": opt_state, "param_groups": groups}, state=state,
                           config_yaml=(path / "config.yaml").read_text(encoding="utf-8"))


def _check_shapes(ckpt: CheckpointState, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    live = model.state_dict()
    missing = sorted(set(live) - set(ckpt.model))
    unexpected = sorted(set(ckpt.model) - set(live))
    wrong = sorted(k for k in set(live) & set(ckpt.model) if tuple(live[k].shape) != tuple(ckpt.model[k].shape))
    if missing or unexpected or wrong:
        def show(xs: list[str]) -> str:
            return ", ".join(xs[:3]) + (" ..." if len(xs) > 3 else "")

        raise CheckpointError(f"{ckpt.path} does not match this model (missing: {show(missing) or '-'}; "
                              f"unexpected: {show(unexpected) or '-'}; other shape: {show(wrong) or '-'}): "
                              f"resume with the config the checkpoint was written with")
    params = [p for g in optimizer.param_groups for p in g["params"]]
    saved_sizes = [len(g["params"]) for g in ckpt.optimizer["param_groups"]]
    if saved_sizes != [len(g["params"]) for g in optimizer.param_groups]:
        raise CheckpointError(f"{ckpt.path}: optimizer parameter groups {saved_sizes} do not match this run's")
    for idx, per_param in ckpt.optimizer["state"].items():
        if not 0 <= idx < len(params):
            raise CheckpointError(f"{ckpt.path}: optimizer state for parameter {idx} of {len(params)}")
        for name, t in per_param.items():
            if isinstance(t, torch.Tensor) and t.dim() > 0 and tuple(t.shape) != tuple(params[idx].shape):
                raise CheckpointError(f"{ckpt.path}: optimizer state {idx}.{name} has shape {tuple(t.shape)}, "
                                      f"the parameter has {tuple(params[idx].shape)}")


def apply_checkpoint(ckpt: CheckpointState, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load weights and optimizer state, after checking everything fits (never a partial load)."""
    _check_shapes(ckpt, model, optimizer)
    model.load_state_dict(ckpt.model, strict=True)
    optimizer.load_state_dict(ckpt.optimizer)
