"""Checkpoints: sharded by logical tensor, atomic, verified, loadable under any layout, never unpickled.

A checkpoint is a directory `ckpt-<step>` in the run directory (which every rank must see: a shared
filesystem on a multi-node job):

    model-r00000.safetensors   the model tensors rank 0 wrote (one file per writing rank)
    optim-r00000.safetensors   their optimizer state (AdamW moments and step counts)
    extra-r00000.safetensors   training state beyond model and optimizer that is made of tensors (a pipeline's
                               dynamism scheme: pruning masks, freezing snapshots), by the caller's names
    model-r00001.safetensors   ... rank 1's, and so on
    state.json                 step, tokens, data position, per-rank RNG and hook states, the layout
    config.yaml                the resolved config of the run
    manifest.json              written last: size and sha256 of every file above, and for every tensor its
                               file, dtype and shape

**Names are logical, never by rank.** A tensor is stored under the model's own parameter name; an
expert-stacked parameter (`model.layers.3.block_sparse_moe.experts.w1`, [E, F, D]) is stored as one tensor
per logical expert, `model.layers.3.block_sparse_moe.experts.<e>.w1` [F, D], whichever rank owns expert e.
Optimizer state is stored as `<logical name>:<key>` (`exp_avg`, `exp_avg_sq`, `step`), split the same way.
Which rank wrote a tensor matters only to find its file (the manifest says), so a checkpoint loads under
any data-, expert- or pipeline-parallel size: each rank reads the logical tensors it now holds, and the
optimizer state of an expert follows the expert to its new owner.

**Who writes what.** A rank writes the dense tensors it holds if it is the first rank of its stage's
data x expert-parallel group, and the expert tensors it owns if it is the first of its data-parallel group:
every logical tensor is written exactly once (rank 0 checks this when it completes the checkpoint). With
sharded optimizer state (`parallel.shard: optimizer`) the optimizer says what this rank writes
(`logical_state`): each logical tensor's state whole, by the owner of its first element, in the same format,
and reads back only the overlap with its parts (`read_logical_state`), so resuming works across shard sizes.
With FSDP2's shards (`parallel.shard: full`) each rank writes the rows it holds, no gather: a dense tensor as a
row piece of its logical name (the manifest lists the pieces, rank 0 checks that they tile the rows, readers
assemble them: `RowPiece`), stacked expert rows as whole logical experts; a rank loads only its rows.

**Atomicity.** Every rank writes its files into `.ckpt-<step>.<session>.tmp/`, fsyncs them, and then
publishes a small `rank-<r>.json` (its files' sizes and checksums, its tensors, its RNG and hook states)
by rename. Rank 0 waits for every rank's note, checks that every expert of every layer is there, writes
`state.json`, `config.yaml` and the manifest, fsyncs the directory and only then renames it to `ckpt-<step>`.
A crash at any point leaves the previous checkpoints untouched and at most an ignorable `.tmp` directory.
Only then are checkpoints beyond the newest `keep` deleted. No collective is involved, so the writing can
run in a background thread (`background=True`): the training loop is blocked only while tensors are copied
to CPU memory (see `Checkpointer`).

**Loading** verifies the manifest, then each file's size and sha256 before reading it, checks every tensor
this rank needs against the live model and optimizer (names, shapes, experts), agrees with the other ranks
that every one of them succeeded, and only then copies anything: a bad checkpoint never half-loads. An
integrity error (missing, truncated or corrupt file) names the file and the newest older checkpoint that
verifies, and how to resume from it. Tensors go through safetensors and everything else through JSON:
nothing is unpickled.

**Reading** a checkpoint outside training: `CheckpointReader(path)` lists the model's full logical state
dict (experts stacked again, [E, ...], under the model's parameter names) and reads it tensor by tensor, or
one expert's row of a stacked tensor, without assembling the model (see docs/checkpoints.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from moebal.errors import CheckpointError
from moebal.fileio import sha256_of
from moebal.interop.tensor_io import TensorInfo

if TYPE_CHECKING:
    from moebal.interop.tensor_io import FileSource

__all__ = [
    "Checkpointer",
    "CheckpointReader",
    "PendingLoad",
    "RowPiece",
    "TensorInfo",
    "apply_checkpoint",
    "expert_name",
    "stacked_experts",
    "find_checkpoints",
    "latest_good_checkpoint",
    "load_agreed",
    "open_for_resume",
    "load_checkpoint",
    "prune_checkpoints",
    "read_checkpoint",
    "restore_rng",
    "rng_state",
    "save_checkpoint",
    "supersede_newer",
    "verify_checkpoint",
]

FORMAT = 2
NAME_RE = re.compile(r"^ckpt-(\d+)$")
TMP_RE = re.compile(r"^\.ckpt-(\d+)\.(.+)\.(tmp|old)$")
STATE_FILES = ("state.json", "config.yaml")


# ---------------------------------------------------------------------------------------------
# RNG state as JSON-ready data


def rng_state() -> dict[str, Any]:
    """Every RNG the run draws from, as plain data."""
    np_state = np.random.get_state(legacy=True)
    assert isinstance(np_state, tuple)  # the global RandomState is MT19937: legacy=True gives its 5-tuple
    state: dict[str, Any] = {
        "torch": torch.get_rng_state().tolist(),
        "numpy": [np_state[0], np_state[1].tolist(), *(x.item() if hasattr(x, "item") else x for x in np_state[2:])],
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
    }
    if torch.cuda.is_available():  # this rank's device only: every rank sees every GPU of its node, and a
        # resume may see fewer (another --nproc, CUDA_VISIBLE_DEVICES), where a list of all of them cannot load
        state["cuda"] = torch.cuda.get_rng_state().tolist()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), *rest))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    cuda = state.get("cuda")
    if cuda and torch.cuda.is_available():
        if isinstance(cuda[0], list):  # older checkpoints: the state of every device the saving rank saw
            cuda = cuda[min(torch.cuda.current_device(), len(cuda) - 1)]
        torch.cuda.set_rng_state(torch.tensor(cuda, dtype=torch.uint8))  # the current device: the rank's own


# ---------------------------------------------------------------------------------------------
# logical names


def expert_name(stacked: str, e: int) -> str:
    """Logical name of expert `e`'s slice of an expert-stacked tensor: `...experts.w1` -> `...experts.<e>.w1`."""
    prefix, _, leaf = stacked.rpartition(".")
    return f"{prefix}.{e}.{leaf}" if prefix else f"{e}.{leaf}"


def _stacked(module: nn.Module) -> dict[str, tuple[tuple[int, ...], int]]:
    """State-dict name of every expert-stacked tensor -> (logical expert id of each row, experts in the layer).

    A module declares stacked tensors with `stacked_expert_params` (names of its tensors stacked on dim 0 by
    expert), `expert_ids` (the logical id of each row it holds) and `num_experts` (of the whole layer)."""
    out = {}
    for prefix, m in module.named_modules():
        for leaf in getattr(m, "stacked_expert_params", ()):
            ids = tuple(int(e) for e in m.expert_ids)
            out[f"{prefix}.{leaf}" if prefix else leaf] = (ids, int(m.num_experts))
    return out


def stacked_experts(module: nn.Module) -> dict[str, tuple[tuple[int, ...], int]]:
    """`module`'s expert-stacked tensors (names relative to it) -> (logical expert id of each row held, experts
    in the layer): what a caller splits its own per-parameter state by, to key it by logical expert."""
    return _stacked(module)


@dataclass(frozen=True)
class RowPiece:
    """Rows [first, first + len(tensor)) of a logical tensor of `shape`, written by the rank that holds them (a
    `parallel.shard: full` shard): the manifest lists the pieces under the logical name and readers assemble
    them, so the checkpoint reads as if the tensor had been written whole."""

    tensor: torch.Tensor
    first: int
    shape: tuple[int, ...]


@dataclass
class _LocalView:
    """What one rank holds, by logical name (views into the live tensors, nothing copied)."""

    tensors: dict[str, torch.Tensor]
    experts: dict[str, tuple[str, int, int]]  # logical name -> (stacked name, expert id, experts in the layer)
    aliases: dict[str, str]  # state-dict name -> the name its (tied) storage is kept under
    stacked: dict[str, tuple[tuple[int, ...], int]]
    pieces: dict[str, tuple[int, tuple[int, ...]]] = field(default_factory=dict)
    """Logical name -> (first row, logical shape) of a shard that holds only some rows."""
    owned: set[str] = field(default_factory=set)
    """Names this rank writes whatever its place in the layout: the rows of its DTensor shards."""
    at_rest: dict[str, tuple[torch.Tensor, int | None]] = field(default_factory=dict)
    """Logical name -> (its tensor, its row of it or None) for weights sharded at rest while they are freed (no
    view of them can be taken): copied by `_copy_model`, one gathered unit at a time; not in `tensors`."""
    linked: dict[str, torch.Tensor] = field(default_factory=dict)
    """Tensors whose values another rank keeps under another name (the module's `checkpoint_links`: a pipeline's
    tied head copy, kept as the first stage's embedding): written as aliases (`aliases`), loaded from them."""


def _local_view(module: nn.Module) -> _LocalView:
    """DTensors (`parallel.shard: full`) are this rank's rows (no communication): a stacked expert tensor's rows as
    whole logical experts, any other tensor as a row piece (whole where it holds every row); a checkpoint writes
    them from this rank and loads only them into it."""
    from torch.distributed.tensor import DTensor

    stacked = _stacked(module)
    view = _LocalView({}, {}, {}, stacked)
    seen: dict[tuple[int, tuple[int, ...], tuple[int, ...]], str] = {}
    links: dict[str, str] = getattr(module, "checkpoint_links", {})
    for name, t in module.state_dict().items():
        if name in links:  # the checkpoint keeps it as the tensor another rank writes, as one process's tie does
            view.aliases[name], view.linked[name] = links[name], t
            continue
        local = t.to_local() if isinstance(t, DTensor) else t
        key = (local.data_ptr(), tuple(t.shape), tuple(local.stride()))
        if not _released(local):  # weights at rest while freed have no address to compare (never tied)
            if t.numel() and key in seen:
                view.aliases[name] = seen[key]
                continue
            seen[key] = name
        if isinstance(t, DTensor):
            _add_shard(view, name, t)
            continue
        if name in stacked:
            ids, E = stacked[name]
            if t.shape[0] != len(ids):  # a module that kept some experts' rows must say which (expert_ids)
                raise RuntimeError(f"'{name}' holds {t.shape[0]} expert rows but its module's expert_ids lists "
                                   f"{len(ids)}: set expert_ids to the logical experts of its rows")
            for row, e in enumerate(ids):
                ln = expert_name(name, e)
                view.experts[ln] = (name, e, E)
                if _released(t):
                    view.at_rest[ln] = (t, row)
                else:
                    view.tensors[ln] = t[row]
        elif _released(t):
            view.at_rest[name] = (t, None)
        else:
            view.tensors[name] = t
    return view


def _add_shard(view: _LocalView, name: str, t: Any) -> None:
    """This rank's rows of DTensor `t` into `view` (see `_local_view`)."""
    from moebal.distributed.fsdp import shard_rows

    first, n = shard_rows(t)
    local = t.to_local()
    if name in view.stacked:
        ids, E = view.stacked[name]
        for row in range(n):
            ln = expert_name(name, ids[first + row])
            view.tensors[ln], view.experts[ln] = local[row], (name, ids[first + row], E)
            view.owned.add(ln)
    elif n:
        view.tensors[name] = local
        view.owned.add(name)
        if n != t.shape[0]:
            view.pieces[name] = (first, tuple(t.shape))


def _optimizer_view(module: nn.Module, optimizer: torch.optim.Optimizer | None,
                    stacked: dict[str, tuple[tuple[int, ...], int]]) -> tuple[dict[str, torch.Tensor],
                                                                              dict[str, Any]]:
    """Optimizer state by `<logical name>:<key>`: tensors (split per expert like their parameter; a scalar
    such as AdamW's step is repeated for every expert) and plain numbers."""
    tensors: dict[str, torch.Tensor] = {}
    numbers: dict[str, Any] = {}
    if optimizer is None:
        return tensors, numbers
    names = {id(p): n for n, p in module.named_parameters()}
    for p, state in optimizer.state.items():
        name = names.get(id(p))
        if name is None:
            raise CheckpointError("the optimizer holds state for a parameter the module does not have")
        rows = list(enumerate(stacked[name][0])) if name in stacked else [(None, None)]
        for row, e in rows:
            ln = name if e is None else expert_name(name, e)
            for key, v in state.items():
                if isinstance(v, torch.Tensor):
                    split = row is not None and v.dim() > 0 and v.shape[0] == p.shape[0]
                    tensors[f"{ln}:{key}"] = v[row] if split else v
                else:
                    numbers[f"{ln}:{key}"] = v
    return tensors, numbers


# ---------------------------------------------------------------------------------------------
# writing


def _fsync_write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
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


def _file_record(path: Path) -> dict[str, Any]:
    return {"bytes": path.stat().st_size, "sha256": sha256_of(path)}


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


@dataclass
class _Snapshot:
    """CPU copies of what one rank writes, taken while the training loop waits."""

    step: int
    model: dict[str, torch.Tensor]
    experts: dict[str, tuple[str, int, int]]
    aliases: dict[str, str]
    optim: dict[str, torch.Tensor]
    optim_numbers: dict[str, Any]
    extra: dict[str, torch.Tensor]
    rank_state: dict[str, Any]
    global_state: dict[str, Any]
    config_yaml: str
    layout: dict[str, Any]
    pieces: dict[str, tuple[int, tuple[int, ...]]] = field(default_factory=dict)
    """Model or optimizer key -> (first row, logical shape) of the row pieces among them."""
    ranks: list[int] = field(default_factory=list)
    """The ranks whose parts make this checkpoint, as `Checkpointer.ranks` said when it was taken: a later change
    (a released rank) must not change what a save still in flight waits for."""


def _cpu_copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True).contiguous()


def _released(t: torch.Tensor) -> bool:
    """A view of weights sharded at rest while they are freed (its storage holds no bytes)."""
    return t.numel() > 0 and t.untyped_storage().nbytes() == 0


def _copy_model(view: _LocalView, names: list[str], optimizer: torch.optim.Optimizer | None
                ) -> dict[str, torch.Tensor]:
    """CPU copies of the tensors `names` of `view`, in that order. Expert weights sharded at rest (`parallel.shard:
    full`, `view.at_rest`) are gathered one MoE layer at a time (`units_gathered`, collective) and freed before
    the next: the device holds one layer's experts whole beside the parts, as in the forward pass, not every
    layer's. The copy is synchronous, so a layer's storage is released only after its tensors are on the host."""
    from moebal.distributed.sharded import units_gathered

    out = {n: _cpu_copy(view.tensors[n]) for n in names if n in view.tensors}
    rest = {n: view.at_rest[n] for n in names if n in view.at_rest}
    for _ in units_gathered(optimizer):
        for n in [n for n, (t, _) in rest.items() if not _released(t)]:
            t, row = rest.pop(n)
            out[n] = _cpu_copy(t if row is None else t[row])
    if rest:
        raise RuntimeError(f"checkpoint: {len(rest)} tensors (first '{next(iter(rest))}') are freed weights that "
                           f"no unit of the optimizer's weights at rest gathered")
    return {n: out[n] for n in names}


class Checkpointer:
    """One rank's side of writing checkpoints (see the module docstring for the protocol).

    `save` copies what this rank writes to CPU memory, then writes it, inline or, with `background=True`,
    in a thread while training goes on; the next `save` (and `wait`/`close`) first waits for the previous one
    and re-raises its error. Rank 0 completes each checkpoint once every rank in `ranks` published its part,
    then keeps the newest `keep` (and with `reach`, one at least that many steps old). `session` names this job's
    temporary directories (the same on every rank)."""

    def __init__(self, run_dir: str | Path, *, rank: int = 0, ranks: list[int] | range | None = None,
                 write_dense: bool = True, write_experts: bool = True, keep: int = 2, background: bool = False,
                 session: str = "0", timeout_s: float = 600.0, reach: int = 0) -> None:
        self.run_dir, self.rank = Path(run_dir), rank
        self.ranks = list(ranks) if ranks is not None else [0]
        self.write_dense, self.write_experts = write_dense, write_experts
        self.keep, self.background, self.session, self.timeout_s = keep, background, session, timeout_s
        self.reach = reach
        """Steps back that a kept checkpoint must reach (`reach_anchors`; 0: only the newest `keep`)."""
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_blocked_s = 0.0
        """Seconds the last `save` call blocked its caller."""
        self.last_write_s = 0.0
        """Seconds the last write took (in the background thread, or inline)."""

    def save(self, step: int, module: nn.Module, optimizer: torch.optim.Optimizer | None, *,
             global_state: dict[str, Any], rank_state: dict[str, Any], config_yaml: str,
             layout: dict[str, Any] | None = None, extra: dict[str, torch.Tensor] | None = None) -> Path:
        """Checkpoint `step`; returns the final directory (complete once `wait` returns, or at once if inline).
        `global_state` (rank 0's is kept) and `rank_state` must be JSON-serialisable. `extra`: more tensors
        by name (`CheckpointReader.read_extra`), written as given: the callers see to it that each name is
        written by one rank only (rank 0 checks)."""
        t0 = time.perf_counter()
        self.wait()
        snap = self._snapshot(step, module, optimizer, global_state, rank_state, config_yaml, layout or {})
        snap.extra = {k: _cpu_copy(t) for k, t in (extra or {}).items()}
        snap.ranks = list(self.ranks)
        if self.background:
            self._thread = threading.Thread(target=self._run, args=(snap,), name=f"moebal-ckpt-{step}", daemon=True)
            self._thread.start()
        else:
            self._run(snap)
        self.last_blocked_s = time.perf_counter() - t0
        if not self.background:
            self.wait()
        return self.run_dir / f"ckpt-{step:07d}"

    def wait(self) -> None:
        """Wait for the save in flight, if any; raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    close = wait

    def wait_quietly(self) -> None:
        """`wait`, dropping the save's error (when another error is already on its way)."""
        with contextlib.suppress(Exception):
            self.wait()

    # ---- the parts ----
    def _snapshot(self, step: int, module: nn.Module, optimizer: torch.optim.Optimizer | None,
                  global_state: dict[str, Any], rank_state: dict[str, Any], config_yaml: str,
                  layout: dict[str, Any]) -> _Snapshot:
        view = _local_view(module)

        def mine(name: str) -> bool:
            if name in view.owned:
                return True
            return self.write_experts if name in view.experts else self.write_dense

        # weights kept in a compute dtype (`parallel.param_dtype` under `shard: optimizer`) are written from their
        # fp32 masters by the optimizer's owners (`logical_state`), not from the module's rounded copies
        masters = getattr(optimizer, "master_names", None)
        held = masters(module, view.stacked) if masters is not None else set()
        model = _copy_model(view, [n for n in [*view.tensors, *view.at_rest] if mine(n) and n not in held],
                            optimizer)
        pieces = {n: v for n, v in view.pieces.items() if n in model}
        sharded = getattr(optimizer, "logical_state", None)
        if sharded is not None:  # sharded state: each logical tensor's owner writes it (a collective)
            opt, numbers = sharded(module, view.stacked)
            optim = {}
            for k in list(opt):  # assembled tensors of the writer's own: copied to the host and dropped in turn
                v = opt.pop(k)
                if isinstance(v, RowPiece):
                    pieces[k] = (v.first, v.shape)
                    v = v.tensor
                if k in held:
                    model[k] = _cpu_copy(v)
                else:
                    optim[k] = _cpu_copy(v)
        else:
            opt, numbers = _optimizer_view(module, optimizer, view.stacked)
            optim = {k: _cpu_copy(t) for k, t in opt.items() if mine(k.rsplit(":", 1)[0])}
            numbers = {k: v for k, v in numbers.items() if mine(k.rsplit(":", 1)[0])}
        # a copy through JSON: fails here, in the caller, on anything not serialisable, and the writer never
        # sees a structure the training loop goes on mutating
        global_state, rank_state, layout = json.loads(json.dumps([global_state, rank_state, layout]))
        return _Snapshot(step, model, {n: view.experts[n] for n in model if n in view.experts},
                         view.aliases if self.write_dense else {}, optim, numbers, {}, rank_state, global_state,
                         config_yaml, layout, pieces)

    def _run(self, snap: _Snapshot) -> None:
        t0 = time.perf_counter()
        tmp = self.run_dir / f".ckpt-{snap.step:07d}.{self.session}.tmp"
        try:
            tmp.mkdir(parents=True, exist_ok=True)
            self._write_part(tmp, snap)
            if self.rank == 0:
                self._complete(tmp, snap)
        except BaseException as e:  # noqa: BLE001 - reported to the caller at the next wait()
            self._error = _as_input_error(e, snap.step, self.run_dir)
            _publish(tmp / f"rank-{self.rank:05d}.error", {"error": f"{type(e).__name__}: {e}"}, best_effort=True)
        self.last_write_s = time.perf_counter() - t0

    def _write_part(self, tmp: Path, snap: _Snapshot) -> None:
        from safetensors.torch import save_file

        files: dict[str, dict[str, Any]] = {}
        tensors: dict[str, dict[str, Any]] = {}
        extra: dict[str, dict[str, Any]] = {}
        for kind, payload in (("model", snap.model), ("optim", snap.optim), ("extra", snap.extra)):
            if not payload:
                continue
            name = f"{kind}-r{self.rank:05d}.safetensors"
            pieces = {} if kind == "extra" else {k: snap.pieces[k] for k in payload if k in snap.pieces}
            save_file({f"{k}@{pieces[k][0]}" if k in pieces else k: t for k, t in payload.items()}, str(tmp / name))
            _fsync_file(tmp / name)
            files[name] = _file_record(tmp / name)
            for k, t in payload.items():
                entry: dict[str, Any] = {"file": name, "dtype": _dtype_name(t), "shape": list(t.shape)}
                if k in pieces:  # a row piece: listed under its logical name, with the rows it holds
                    first, shape = pieces[k]
                    entry = {"dtype": _dtype_name(t), "shape": list(shape),
                             "pieces": [{"file": name, "key": f"{k}@{first}", "rows": [first, first + t.shape[0]]}]}
                (extra if kind == "extra" else tensors)[k] = entry
        note = {"rank": self.rank, "files": files, "tensors": tensors, "extra": extra,
                "experts": {n: list(v) for n, v in snap.experts.items()}, "aliases": snap.aliases,
                "optimizer_numbers": snap.optim_numbers, "state": snap.rank_state}
        _publish(tmp / f"rank-{self.rank:05d}.json", note)

    def _complete(self, tmp: Path, snap: _Snapshot) -> None:
        """Rank 0: gather the ranks' notes, write state, config and manifest, publish by rename, prune."""
        notes = self._await_notes(tmp, snap.step, snap.ranks)
        manifest = _merge_notes(notes, tmp)
        state = {"format": FORMAT, "step": snap.step, **snap.global_state, "layout": snap.layout,
                 "ranks": {str(n["rank"]): n["state"] for n in notes}}
        _fsync_write(tmp / "state.json", json.dumps(state).encode("utf-8"))
        _fsync_write(tmp / "config.yaml", snap.config_yaml.encode("utf-8"))
        for name in STATE_FILES:
            manifest["files"][name] = _file_record(tmp / name)
        for r in snap.ranks:
            (tmp / f"rank-{r:05d}.json").unlink()
        _fsync_write(tmp / "manifest.json", json.dumps({"format": FORMAT, "step": snap.step, **manifest},
                                                       indent=1).encode("utf-8"))
        _fsync_dir(tmp)
        final = self.run_dir / f"ckpt-{snap.step:07d}"
        old = None
        if final.exists():  # re-saving a step (a resumed run's final step): the old copy goes only after
            old = self.run_dir / f".ckpt-{snap.step:07d}.{self.session}.old"
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_dir(self.run_dir)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        prune_checkpoints(self.run_dir, self.keep, session=self.session, reach=self.reach)

    def _await_notes(self, tmp: Path, step: int, ranks: list[int]) -> list[dict[str, Any]]:
        deadline = time.monotonic() + self.timeout_s
        while True:
            for r in ranks:
                err = tmp / f"rank-{r:05d}.error"
                if err.is_file():
                    msg = json.loads(err.read_text(encoding="utf-8"))["error"]
                    raise CheckpointError(f"rank {r} could not write its part of checkpoint {step}: {msg}")
            missing = [r for r in ranks if not (tmp / f"rank-{r:05d}.json").is_file()]
            if not missing:
                return [json.loads((tmp / f"rank-{r:05d}.json").read_text(encoding="utf-8")) for r in ranks]
            if time.monotonic() > deadline:
                raise CheckpointError(f"checkpoint {step}: ranks {missing} did not write their part within "
                                      f"{self.timeout_s:.0f} s into {tmp} (every rank must see the run directory: "
                                      f"put it on a filesystem shared by all nodes)")
            time.sleep(0.02)


def _os_error_of(e: BaseException) -> BaseException:
    """safetensors' writer reports the operating system's error as its own (`SafetensorError: ... No space left on
    device (os error 28)`): the OSError it stands for, so that a full disk reads the same from every file."""
    m = re.search(r"\(os error (\d+)\)", str(e)) if type(e).__name__ == "SafetensorError" else None
    return OSError(int(m.group(1)), os.strerror(int(m.group(1)))) if m else e


def _as_input_error(e: BaseException, step: int, run_dir: Path) -> BaseException:
    """An operating-system error of the write (a full disk, a quota, a read-only or vanished run directory) is
    the user's to fix, so it becomes one line (CheckpointError); anything else is a bug and stays itself."""
    e = _os_error_of(e)
    if not isinstance(e, OSError) or e.errno is None:
        return e
    return CheckpointError(f"cannot write checkpoint {step} into {run_dir}: {e.strerror or e}"
                           f"{f' ({e.filename})' if e.filename else ''}; the previous checkpoints are intact: free "
                           f"space (or fix the directory) and continue with `moebal train --out {run_dir} --resume`")


def _publish(path: Path, obj: Any, best_effort: bool = False) -> None:
    """Write a small JSON file so that readers see all of it or nothing (temporary name, fsync, rename)."""
    part = path.with_name(path.name + ".part")
    try:
        _fsync_write(part, json.dumps(obj).encode("utf-8"))
        os.replace(part, path)
    except OSError:
        if not best_effort:
            raise


def _merge_notes(notes: list[dict[str, Any]], tmp: Path) -> dict[str, Any]:
    files: dict[str, Any] = {}
    tensors: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    experts: dict[str, Any] = {}
    aliases: dict[str, str] = {}
    numbers: dict[str, Any] = {}
    for note in notes:
        for into, entries in ((tensors, note["tensors"]), (extra, note.get("extra", {}))):
            for name, entry in entries.items():
                if name in into and not _more_pieces(into[name], entry):
                    raise CheckpointError(f"{tmp}: two ranks wrote '{name}' (a bug in the writer assignment)")
                if name in into:
                    into[name] = {**into[name], "pieces": [*into[name]["pieces"], *entry["pieces"]]}
                else:
                    into[name] = entry
        files.update(note["files"])
        experts.update(note["experts"])
        aliases.update(note["aliases"])
        numbers.update(note["optimizer_numbers"])
    for name, entry in tensors.items():
        _check_pieces(name, entry, tmp)
    stacked: dict[str, dict[str, Any]] = {}
    for name, (stk, e, E) in experts.items():
        s = stacked.setdefault(stk, {"num_experts": E, "experts": set(), "dtype": tensors[name]["dtype"],
                                     "shape": [E, *tensors[name]["shape"]]})
        s["experts"].add(e)
    for stk, s in stacked.items():
        if s["experts"] != set(range(s["num_experts"])):
            missing = sorted(set(range(s["num_experts"])) - s["experts"])
            raise CheckpointError(f"{tmp}: no rank wrote experts {missing} of '{stk}' (a bug in the writer "
                                  f"assignment)")
        s["experts"] = s["num_experts"]
    return {"files": files, "tensors": tensors, "experts": {n: v[:2] for n, v in experts.items()},
            "stacked": {k: {"num_experts": v["num_experts"], "dtype": v["dtype"], "shape": v["shape"]}
                        for k, v in stacked.items()},
            "aliases": aliases, "optimizer_numbers": numbers, "extra": extra}


def _more_pieces(have: dict[str, Any], entry: dict[str, Any]) -> bool:
    """Whether `entry` adds row pieces to the same logical tensor as `have`."""
    return ("pieces" in have and "pieces" in entry and have["dtype"] == entry["dtype"]
            and have["shape"] == entry["shape"])


def _check_pieces(name: str, entry: dict[str, Any], tmp: Path) -> None:
    """A pieced tensor's pieces, sorted, must cover its rows exactly once."""
    if "pieces" not in entry:
        return
    entry["pieces"].sort(key=lambda p: p["rows"][0])
    end = 0
    for p in entry["pieces"]:
        if p["rows"][0] != end:
            raise CheckpointError(f"{tmp}: the pieces of '{name}' {'overlap' if p['rows'][0] < end else 'leave a gap'}"
                                  f" at row {min(end, p['rows'][0])} (a bug in the writer assignment)")
        end = p["rows"][1]
    if end != entry["shape"][0]:
        raise CheckpointError(f"{tmp}: no rank wrote rows {end}.. of '{name}' (a bug in the writer assignment)")


def _entry_files(entry: dict[str, Any]) -> list[Any]:
    """The files a manifest entry's data lies in (one, or one per row piece)."""
    return [p["file"] for p in entry["pieces"]] if "pieces" in entry else [entry["file"]]


def save_checkpoint(run_dir: str | Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                    state: dict[str, Any], config_yaml: str, keep: int | None = None) -> Path:
    """One process writes ckpt-<step> synchronously (the whole model is its own); `state` must be
    JSON-serialisable. Keeps the newest `keep` checkpoints when given."""
    ck = Checkpointer(run_dir, keep=keep or 1 << 30, session=f"{os.getpid()}")
    return ck.save(step, model, optimizer, global_state=state, rank_state={}, config_yaml=config_yaml)


# ---------------------------------------------------------------------------------------------
# finding and pruning


def find_checkpoints(run_dir: str | Path) -> list[Path]:
    """Checkpoint directories of a run, oldest first (temporary ones are not checkpoints)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in run_dir.iterdir() if p.is_dir() and (m := NAME_RE.match(p.name))]
    return [p for _, p in sorted(found)]


def prune_checkpoints(run_dir: str | Path, keep: int, session: str | None = None, reach: int = 0) -> None:
    """Delete all but the newest `keep` checkpoints (and those `reach` keeps), and temporary directories of other
    sessions (crashed saves; this session's own may still be in flight)."""
    run_dir = Path(run_dir)
    found = find_checkpoints(run_dir)
    kept = set(found[-keep:]) | reach_anchors(found, reach)
    for p in found:
        if p not in kept:
            shutil.rmtree(p, ignore_errors=True)
    for p in run_dir.iterdir():
        m = TMP_RE.match(p.name)
        if not (p.is_dir() and m and m.group(2) != session):
            continue
        final = run_dir / f"ckpt-{m.group(1)}"
        if m.group(3) == "old" and not final.exists():
            os.replace(p, final)  # a crash between the two renames of a re-save: the old copy is the checkpoint
        else:
            shutil.rmtree(p, ignore_errors=True)


def reach_anchors(found: list[Path], reach: int) -> set[Path]:
    """The checkpoints kept beyond the newest ones so that one at least `reach` steps old is always there (a
    rollback's `train.spike.back`), two at most. With the newest checkpoint in window W of `reach` steps (its
    step // reach): the newest one in window W - 1, and the newest one before it (early in the run, while there
    is none before it, the oldest checkpoint). The second is at least `reach` steps older than the newest
    checkpoint, so older than any later step by as much; and when the newest checkpoint moves into window W + 1,
    the two new ones are among those kept now (the newest of window W was the newest checkpoint; the newest
    before window W is the kept one of window W - 1, or the older one), so pruning never loses the guarantee. A
    rollback lands between `reach` and about 2 `reach` plus two checkpoint intervals back. `found` oldest first
    (`find_checkpoints`)."""
    if reach <= 0 or not found:
        return set()
    steps = [step_of(p) for p in found]
    window = steps[-1] // reach
    before = [p for p, s in zip(found, steps) if s < (window - 1) * reach] or found[:1]
    previous = [p for p, s in zip(found, steps) if (window - 1) * reach <= s < window * reach]
    return {ps[-1] for ps in (before, previous) if ps}


def supersede_newer(run_dir: str | Path, step: int) -> None:
    """Resuming a run from one of its older checkpoints (--resume-from): the newer ones hold a line of the run this
    one replaces, which a later --resume (a crash, a launcher's restart) would otherwise continue. They move to
    `superseded/<n>/` in the run directory, kept, and a line says so."""
    run_dir = Path(run_dir)
    moved = retire_checkpoints(run_dir, step, "superseded")
    if moved:
        where = run_dir / Path(moved[0]).parent
        sys.stderr.write(f"moebal train: resuming {run_dir} from step {step}: its {len(moved)} newer "
                         f"checkpoint{'s' if len(moved) != 1 else ''} moved to {where} (a later --resume would "
                         f"have continued them)\n")
        sys.stderr.flush()


def retire_checkpoints(run_dir: str | Path, after: int, into: str) -> list[str]:
    """Move every checkpoint of the run newer than step `after` into `<into>/<n>/` under the run directory (n: one
    more than the largest number there, 1 first: later retirements sort after earlier ones even when a user has
    deleted some), out of reach of a resume and of pruning; their paths relative to the run
    directory ([] and no folder when there are none). A rollback to checkpoint `after` does this, and a resume from
    it: what was trained after it is a line of the run that a restart must not continue (moebal/train/spikes.py)."""
    run_dir = Path(run_dir)
    newer = [p for p in find_checkpoints(run_dir) if step_of(p) > after]
    if not newer:
        return []
    root = run_dir / into
    n = 1 + max((int(p.name) for p in root.iterdir() if p.name.isdigit()), default=0) if root.is_dir() else 1
    target = root / str(n)
    target.mkdir(parents=True)
    for p in newer:
        os.replace(p, target / p.name)
    _fsync_dir(target)
    _fsync_dir(run_dir)
    return [str((target / p.name).relative_to(run_dir)) for p in newer]


def step_of(path: Path) -> int:
    m = NAME_RE.match(path.name)
    return int(m.group(1)) if m else -1


# ---------------------------------------------------------------------------------------------
# verification


def _read_manifest(path: Path) -> dict[str, Any]:
    manifest_path = path / "manifest.json"
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a checkpoint directory (it does not exist)")
    if not manifest_path.is_file():
        raise CheckpointError(f"{manifest_path} is missing: the checkpoint is incomplete")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        fmt = manifest.get("format")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
        raise CheckpointError(f"{manifest_path} is corrupt ({e.__class__.__name__})") from None
    if fmt != FORMAT:
        raise CheckpointError(f"{manifest_path}: checkpoint format {fmt!r}, this moebal reads format {FORMAT}"
                              + (" (a format-1 checkpoint: resume it with the moebal version that wrote it)"
                                 if fmt == 1 else ""))
    try:
        for key in ("files", "tensors", "stacked", "aliases", "experts", "optimizer_numbers"):
            if not isinstance(manifest[key], dict):
                raise TypeError(key)
        step = int(manifest["step"])
        # the entries the reader indexes: a manifest that parses but lacks one is as corrupt as one that does not
        for rec in manifest["files"].values():
            if not (isinstance(rec["bytes"], int) and isinstance(rec["sha256"], str)):
                raise TypeError("files")
        for stk, index in manifest["experts"].values():
            if not (isinstance(stk, str) and isinstance(index, int)):
                raise TypeError("experts")
        for rec in manifest["stacked"].values():
            if not (isinstance(rec["num_experts"], int) and isinstance(rec["shape"], list)):
                raise TypeError("stacked")
        files = [*manifest["files"], *(f for k in ("tensors", "extra") for e in manifest.get(k, {}).values()
                                       for f in _entry_files(e))]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{manifest_path} is corrupt ({e.__class__.__name__}: {e})") from None
    if NAME_RE.match(path.name) and step_of(path) != step:  # a checkpoint of another step under this name
        raise CheckpointError(f"{manifest_path} is corrupt: it is step {step}'s, in the folder of step "
                              f"{step_of(path)}")
    for name in files:
        _check_inside(path, name)
    return dict(manifest)


def _check_inside(path: Path, name: Any) -> None:
    """A manifest names files of its own directory only: a path elsewhere (`../run/x`, `/abs/x`, a symlink out)
    would load another checkpoint's tensors into this one, however well its checksum matches."""
    plain = isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and os.sep not in name
    if not plain or not (path / name).resolve().is_relative_to(path.resolve()):
        raise CheckpointError(f"{path / 'manifest.json'} is corrupt: it lists {name!r}, which is not a file of "
                              f"the checkpoint directory (a manifest may only name files inside it)")


def _verify_file(path: Path, name: str, record: dict[str, Any] | None) -> None:
    f = path / name
    if record is None:
        raise CheckpointError(f"{path / 'manifest.json'} does not list {name}")
    if not f.is_file():
        raise CheckpointError(f"{f} is missing")
    size = f.stat().st_size
    if size != record["bytes"]:
        raise CheckpointError(f"{f} has {size} bytes, the manifest says {record['bytes']} (truncated?)")
    if sha256_of(f) != record["sha256"]:
        raise CheckpointError(f"{f} is corrupt: its sha256 does not match the manifest")


def verify_checkpoint(path: str | Path) -> dict[str, Any]:
    """The manifest, after checking every file's presence, size and sha256; CheckpointError otherwise."""
    path = Path(path)
    manifest = _read_manifest(path)
    for name in [*STATE_FILES, *sorted(set(manifest["files"]) - set(STATE_FILES))]:
        _verify_file(path, name, manifest["files"].get(name))
    return manifest


def latest_good_checkpoint(run_dir: str | Path, before: Path | None = None) -> Path | None:
    """The newest checkpoint that verifies (older than `before` when given)."""
    for p in reversed(find_checkpoints(run_dir)):
        if before is not None and step_of(p) >= step_of(before):
            continue
        try:
            verify_checkpoint(p)
        except CheckpointError:
            continue
        return p
    return None


def with_previous_hint(path: Path, err: CheckpointError) -> CheckpointError:
    """`err` plus the newest older checkpoint that verifies and how to resume from it."""
    previous = latest_good_checkpoint(path.parent, before=path)
    if previous is None:
        return CheckpointError(f"{err}; no older good checkpoint exists in {path.parent}")
    return CheckpointError(f"{err}; the previous good checkpoint is {previous}: resume from it with "
                           f"`moebal train --out {path.parent} --resume-from {previous}` (or move {path.name} "
                           f"aside and use --resume)")


# ---------------------------------------------------------------------------------------------
# reading: the public read API


def _torch_dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in a checkpoint manifest")
    return dt


class CheckpointReader:
    """A checkpoint's full logical state, read tensor by tensor (the public read API).

    `info()` lists every model tensor under the model's parameter names, expert-stacked ones whole
    ([E, ...], as the single-device model holds them); `read(name)` reads one, `read(name, index=e)` reads
    expert e's row of a stacked tensor alone; iterating yields `(name, tensor)` one at a time, so a consumer
    holds one tensor (one stacked tensor) at a time. Every file is checked (size, sha256) the first time it
    is read, so a corrupt checkpoint raises CheckpointError naming the file instead of returning bad data.
    `state` (step, data position, RNG...), `config_yaml` and `optimizer_state(name)` give the rest."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.manifest = _read_manifest(self.path)
        self.step = int(self.manifest["step"])
        self._verified: set[str] = set()
        self._handles: dict[str, FileSource] = {}
        self._state: dict[str, Any] | None = None
        self._by_stacked: dict[str, dict[int, str]] = {}
        for name, (stk, e) in self.manifest["experts"].items():
            self._by_stacked.setdefault(stk, {})[int(e)] = name
        self._optim: dict[str, dict[str, str]] = {}  # logical name -> {state key: manifest key}
        for k in [*self.manifest["tensors"], *self.manifest["optimizer_numbers"]]:
            if ":" in k:
                ln, key = k.rsplit(":", 1)
                self._optim.setdefault(ln, {})[key] = k

    # ---- files ----
    def _file(self, name: str) -> Path:
        if name not in self._verified:
            _verify_file(self.path, name, self.manifest["files"].get(name))
            self._verified.add(name)
        return self.path / name

    def _tensor(self, key: str, out: torch.Tensor | None = None, index: int | None = None,
                section: str = "tensors") -> torch.Tensor:
        """Stored tensor `key`, read with plain reads at its offsets (no memory map: pages a reader touched
        would count as its resident memory); a tensor written in row pieces is assembled from them."""
        entry = self.manifest.get(section, {}).get(key)
        if entry is None:
            raise CheckpointError(f"{self.path} holds no tensor '{key}'")
        if "pieces" not in entry:
            return self._stored(entry["file"], key, entry["shape"], out, index)
        shape = [int(n) for n in entry["shape"]]
        spans = [(int(p["rows"][0]), int(p["rows"][1]), p) for p in entry["pieces"]]
        if index is not None:  # one row: from the piece that holds it
            for a, b, p in spans:
                if a <= index < b:
                    return self._stored(p["file"], p["key"], [b - a, *shape[1:]], out, index - a)
            raise CheckpointError(f"{self.path}: tensor '{key}' {shape} has no row {index}")
        if out is not None and list(out.shape) != shape:
            raise CheckpointError(f"{self.path}: tensor '{key}' has shape {shape}, expected {list(out.shape)}")
        return self.read_rows(key, 0, shape[0], out)

    def _stored(self, file: str, key: str, shape: list[int], out: torch.Tensor | None = None,
                index: int | None = None) -> torch.Tensor:
        """Tensor `key` of `file`, which the manifest says has `shape`."""
        return self._source(file, key, shape).read(key, index, out)

    def _source(self, file: str, key: str, shape: list[int]) -> FileSource:
        """The open, verified `file`, after checking that it holds `key` at `shape`."""
        from moebal.interop.tensor_io import FileSource

        if file not in self._handles:
            self._handles[file] = FileSource(self._file(file))
        src = self._handles[file]
        if key not in src.entries:
            raise CheckpointError(f"{self.path / file} lacks '{key}', which the manifest places there")
        if list(src.entries[key].shape) != list(shape):
            raise CheckpointError(f"{self.path / file}: '{key}' has shape {tuple(src.entries[key].shape)}, the "
                                  f"manifest says {tuple(shape)}")
        return src

    def verify(self) -> CheckpointReader:
        """Check every file now (instead of on first use)."""
        for name in self.manifest["files"]:
            self._file(name)
        return self

    def close(self) -> None:
        for src in self._handles.values():
            src.close()
        self._handles.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the model's logical state dict ----
    def names(self) -> list[str]:
        """Model tensor names (stacked experts under their stacked name, tied aliases included), sorted."""
        plain = [n for n in self.manifest["tensors"] if ":" not in n and n not in self.manifest["experts"]]
        return sorted([*plain, *self.manifest["stacked"], *self.manifest["aliases"]])

    def info(self) -> dict[str, TensorInfo]:
        out = {}
        for name in self.names():
            target = self.manifest["aliases"].get(name, name)
            if target in self.manifest["stacked"]:
                s = self.manifest["stacked"][target]
                first = self.manifest["tensors"][self._by_stacked[target][0]]
                out[name] = TensorInfo(_torch_dtype(s["dtype"]), tuple(s["shape"]),
                                       str(self.path / _entry_files(first)[0]))
            else:
                e = self.manifest["tensors"][target]
                out[name] = TensorInfo(_torch_dtype(e["dtype"]), tuple(e["shape"]), str(self.path / _entry_files(e)[0]))
        return out

    def read(self, name: str, index: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Tensor `name` (or row `index` of a stacked expert tensor), into `out` when given."""
        target = self.manifest["aliases"].get(name, name)
        if target in self.manifest["stacked"]:
            experts = self._by_stacked[target]
            if index is None:  # assembled in place, expert by expert
                s = self.manifest["stacked"][target]
                whole = out if out is not None else torch.empty(s["shape"], dtype=_torch_dtype(s["dtype"]))
                for e in range(len(experts)):
                    self._tensor(experts[e], whole[e])
                return whole
            if index in experts:
                return self._tensor(experts[index], out)
            raise CheckpointError(f"{self.path}: '{name}' has no expert {index} (it has {len(experts)})")
        return self._tensor(target, out, index)

    def read_rows(self, name: str, first: int, rows: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows [first, first + rows) of plain tensor `name` (not a stacked one), from whichever pieces hold them."""
        target = self.manifest["aliases"].get(name, name)
        entry = self.manifest["tensors"].get(target)
        if entry is None or target in self.manifest["stacked"]:
            raise CheckpointError(f"{self.path} holds no plain tensor '{name}'")
        shape = [int(n) for n in entry["shape"]]
        if not shape or first < 0 or first + rows > shape[0]:
            raise CheckpointError(f"{self.path}: tensor '{name}' {shape} has no rows {first}..{first + rows}")
        whole = out if out is not None else torch.empty([rows, *shape[1:]], dtype=_torch_dtype(entry["dtype"]))
        spans = ([(int(p["rows"][0]), int(p["rows"][1]), p["file"], p["key"]) for p in entry["pieces"]]
                 if "pieces" in entry else [(0, shape[0], entry["file"], target)])
        for a, b, file, key in spans:
            lo, hi = max(a, first), min(b, first + rows)
            if lo < hi:
                self._source(file, key, [b - a, *shape[1:]]).read_rows(key, lo - a, whole[lo - first:hi - first])
        return whole

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self.names():
            yield name, self.read(name)

    tensors = __iter__

    def optimizer_state(self, name: str, index: int | None = None) -> dict[str, Any]:
        """Optimizer state of parameter `name` (of expert `index` for a stacked one): {key: tensor or number}."""
        ln = expert_name(name, index) if index is not None else name
        numbers = self.manifest["optimizer_numbers"]
        return {key: numbers[k] if k in numbers else self._tensor(k) for key, k in self._optim.get(ln, {}).items()}

    def optimizer_keys(self, logical: str) -> list[str]:
        """State keys saved for one logical tensor (`exp_avg`, ...); empty when it has no optimizer state."""
        return sorted(self._optim.get(logical, {}))

    def extra_names(self) -> list[str]:
        """Names of the extra tensors (`Checkpointer.save(extra=...)`), sorted."""
        return sorted(self.manifest.get("extra", {}))

    def read_extra(self, name: str) -> torch.Tensor:
        """Extra tensor `name`; CheckpointError when the checkpoint has none of that name."""
        return self._tensor(name, section="extra")

    # ---- the rest ----
    @property
    def state(self) -> dict[str, Any]:
        """state.json: step, tokens, data position, layout, per-rank RNG and hook states."""
        if self._state is None:
            try:
                self._state = json.loads(self._file("state.json").read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise CheckpointError(f"{self.path / 'state.json'} is unreadable although its checksum matches "
                                      f"({e})") from None
        return self._state

    @property
    def config_yaml(self) -> str:
        return self._file("config.yaml").read_text(encoding="utf-8")


def open_for_resume(run_dir: str | Path, resume: bool | str | Path,
                    gather: Callable[[Any], list[Any]] | None = None, require: bool = True) -> CheckpointReader | None:
    """The checkpoint a run resumes from (`resume`: True for the newest in `run_dir`, or a path), opened on
    every rank alike: the ranks check they see the same one (the run directory must be shared) and all raise
    the same error if any cannot open it. None when `resume` is False, or when there is none and not
    `require` (a restarted job that died before its first checkpoint starts over)."""
    if resume is False:
        return None
    run_dir = Path(run_dir)
    found = find_checkpoints(run_dir) if resume is True else [Path(resume)]
    error, reader = None, None
    if not found and require:
        error = (f"nothing to resume in {run_dir}: it holds no checkpoint (run without --resume to start, or point "
                 f"--out at the run)")
    elif found:
        try:
            reader = CheckpointReader(found[-1])
        except CheckpointError as e:
            error = str(with_previous_hint(found[-1], e))
    seen = [(str(found[-1]) if found else None, error)] if gather is None else gather(
        (str(found[-1]) if found else None, error))
    errors = [e for _, e in seen if e]
    if errors:
        raise CheckpointError(errors[0])
    if len({p for p, _ in seen}) > 1:
        newest = sorted({str(p) for p, _ in seen})  # str: a rank that sees none reports None
        raise CheckpointError(f"the ranks see different newest checkpoints ({newest}): the run directory must be on "
                              f"a filesystem every rank shares")
    return reader


def read_checkpoint(path: str | Path) -> CheckpointReader:
    """A reader of `path` after verifying every file; a failure names the file and the previous good checkpoint."""
    path = Path(path)
    try:
        return CheckpointReader(path).verify()
    except CheckpointError as e:
        raise with_previous_hint(path, e) from None


# ---------------------------------------------------------------------------------------------
# loading into a live model and optimizer


@dataclass
class PendingLoad:
    """Everything read and checked, nothing applied yet; `apply()` copies it in (cannot fail halfway on bad
    data: every shape was checked when it was read)."""

    module: nn.Module
    optimizer: torch.optim.Optimizer | None
    copies: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    optimizer_state: dict[str, Any] | None = None
    needed: list[str] = field(default_factory=list)
    at_rest: list[tuple[tuple[torch.Tensor, int | None], torch.Tensor]] = field(default_factory=list)
    """Weights sharded at rest ((tensor, row), source): written one gathered unit at a time, then their owned
    parts take them (`units_gathered(write=True)`, collective over the units' shard groups)."""

    def apply(self) -> None:
        from moebal.distributed.sharded import units_gathered

        with torch.no_grad():
            for dst, src in self.copies:  # a DTensor shard's rows are plain views (`_local_view`)
                dst.copy_(src)
            left = list(self.at_rest)
            for _ in units_gathered(self.optimizer, write=True):
                for (t, row), src in [x for x in left if not _released(x[0][0])]:
                    (t if row is None else t[row]).copy_(src)
                left = [x for x in left if _released(x[0][0])]
            if left:
                raise RuntimeError(f"checkpoint load: {len(left)} tensors are freed weights that no unit of the "
                                   f"optimizer's weights at rest gathered")
        if self.optimizer is not None and self.optimizer_state is not None:
            self.optimizer.load_state_dict(self.optimizer_state)


def _mismatch(reader: CheckpointReader, view: _LocalView) -> str | None:
    """The first way this rank's model differs from the checkpoint's, as a message; None when it fits."""
    m = reader.manifest
    fix = "resume with the model config the checkpoint was written with (its config.yaml)"
    for stk, (_, E) in view.stacked.items():
        saved = m["stacked"].get(stk)
        if saved is not None and saved["num_experts"] != E:
            return (f"{reader.path}: '{stk}' has {saved['num_experts']} experts in the checkpoint but {E} in this "
                    f"model (moe.num_experts): {fix}")
    shapes = {**{n: tuple(t.shape) for n, t in view.tensors.items()},
              **{n: tuple(t.shape[1:] if row is not None else t.shape) for n, (t, row) in view.at_rest.items()}}
    for name, own in shapes.items():
        entry = m["tensors"].get(name)
        if entry is None:
            if name in view.experts:
                stk, e, _ = view.experts[name]
                return (f"{reader.path} has no expert {e} of '{stk}' (layer tensor '{name}' is missing from the "
                        f"manifest): the checkpoint is incomplete; resume from an older checkpoint")
            return f"{reader.path} holds no tensor '{name}', which this model has: {_scheme_fix(name, fix)}"
        shape = view.pieces[name][1] if name in view.pieces else own
        if list(entry["shape"]) != list(shape):
            return (f"{reader.path}: '{name}' has shape {tuple(entry['shape'])} in the checkpoint but "
                    f"{tuple(shape)} in this model: {fix}")
    for name, t in view.linked.items():
        kept = m["aliases"].get(name)
        if kept != view.aliases[name]:
            return (f"{reader.path} does not keep '{name}' as '{view.aliases[name]}' (this model ties them, the "
                    f"checkpoint's did not): {fix}")
        entry = m["tensors"].get(kept)
        if entry is None or list(entry["shape"]) != list(t.shape):
            return f"{reader.path}: '{kept}' (which '{name}' is tied to) is missing or not {tuple(t.shape)}: {fix}"
    return None


def _scheme_fix(name: str, fix: str) -> str:
    """The fix for a tensor one side lacks: Mixture-of-Depths' routers (and predictors) are model parameters, so
    a resume that switches `dynamism.scheme` to or from mod changes the model."""
    if ".mod_router." in name or ".mod_predictor." in name:
        return ("Mixture-of-Depths' routers are model parameters, so dynamism.scheme cannot switch to or from mod "
                "on resume: resume with the checkpoint's dynamism.scheme (its config.yaml)")
    return fix


def load_checkpoint(reader: CheckpointReader, module: nn.Module, optimizer: torch.optim.Optimizer | None
                    ) -> PendingLoad:
    """Read and check everything this rank's `module` (and `optimizer`) needs from `reader`; apply nothing.

    Raises CheckpointError for a model that does not fit (names, shapes, expert counts) and for a missing,
    truncated or corrupt file (the message then offers the previous good checkpoint)."""
    view = _local_view(module)
    problem = _mismatch(reader, view)
    if problem is not None:
        raise CheckpointError(problem)
    pending = PendingLoad(module, optimizer, needed=sorted([*view.tensors, *view.at_rest]))
    try:
        _ = reader.state  # checked here, so that a bad state.json fails before anything is applied
        for name, dst in view.tensors.items():  # a shard's rows alone
            piece = view.pieces.get(name)
            src = reader.read(name) if piece is None else reader.read_rows(name, piece[0], dst.shape[0])
            pending.copies.append((dst, src))
        for name, at in view.at_rest.items():  # freed now: written when their unit is gathered (`apply`)
            pending.at_rest.append((at, reader.read(name)))
        for name, dst in view.linked.items():  # through the alias: the tensor it is tied to
            pending.copies.append((dst, reader.read(name)))
        sharded = getattr(optimizer, "read_logical_state", None)
        if sharded is not None:  # sharded state: the parts of the logical tensors this rank owns
            pending.optimizer_state = sharded(reader, module, view.stacked)
        elif optimizer is not None:
            pending.optimizer_state = _optimizer_state(reader, module, optimizer, view)
    except CheckpointError as e:
        raise with_previous_hint(reader.path, e) from None
    return pending


def _optimizer_state(reader: CheckpointReader, module: nn.Module, optimizer: torch.optim.Optimizer,
                     view: _LocalView) -> dict[str, Any]:
    """The optimizer's state dict (index-keyed, its own param groups) rebuilt from logical entries."""
    names = {id(p): n for n, p in module.named_parameters()}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state: dict[int, dict[str, Any]] = {}
    for idx, p in enumerate(params):
        name = names[id(p)]
        rows = view.stacked[name][0] if name in view.stacked else None
        lns = [name] if rows is None else [expert_name(name, e) for e in rows]
        have = [reader.optimizer_keys(ln) for ln in lns]
        if not any(have):
            continue  # no state saved (a parameter the optimizer never stepped)
        if any(h != have[0] for h in have):
            bad = [ln for ln, h in zip(lns, have) if h != have[0]]
            raise CheckpointError(f"{reader.path}: optimizer state of {bad[0]} is missing or differs from its "
                                  f"layer's other experts")
        per = [reader.optimizer_state(name, e) for e in rows] if rows is not None else [reader.optimizer_state(name)]
        state[idx] = {key: _join_rows([s[key] for s in per], p, rows is not None, f"{name}:{key}", reader.path)
                      for key in have[0]}
    return {"state": state, "param_groups": optimizer.state_dict()["param_groups"]}


def _join_rows(values: list[Any], p: torch.Tensor, stacked: bool, what: str, path: Path) -> Any:
    first = values[0]
    if not stacked:
        if isinstance(first, torch.Tensor) and first.dim() > 0 and tuple(first.shape) != tuple(p.shape):
            raise CheckpointError(f"{path}: optimizer state '{what}' has shape {tuple(first.shape)}, the "
                                  f"parameter has {tuple(p.shape)}")
        return first
    if isinstance(first, torch.Tensor) and first.dim() > 0:
        t = torch.stack(values)
        if tuple(t.shape) != tuple(p.shape):
            raise CheckpointError(f"{path}: optimizer state '{what}' stacks to {tuple(t.shape)}, the parameter "
                                  f"has {tuple(p.shape)}")
        return t
    if any(not _same(v, first) for v in values[1:]):  # a per-parameter scalar (AdamW's step): one value
        raise CheckpointError(f"{path}: optimizer state '{what}' differs between experts of one layer")
    return first


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return torch.equal(a, b)
    return bool(a == b)


def apply_checkpoint(reader: CheckpointReader, module: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """One process: load weights and optimizer state after checking everything fits (never a partial load)."""
    load_agreed(reader, module, optimizer).apply()


def load_agreed(reader: CheckpointReader, module: nn.Module, optimizer: torch.optim.Optimizer | None,
                gather: Callable[[Any], list[Any]] | None = None) -> PendingLoad:
    """`load_checkpoint` on every rank of a job, agreed: raises on every rank if any rank failed (so none
    applies a partial state), and checks that the ranks together need every model tensor the checkpoint
    holds (a checkpoint of a bigger model does not load into a smaller one). `gather(obj)` returns every
    rank's obj in rank order (an all-gather); None for one process."""
    pending, error = None, None
    try:
        pending = load_checkpoint(reader, module, optimizer)
    except CheckpointError as e:
        error = str(e)
    results = [(error, pending.needed if pending else [])] if gather is None else gather(
        (error, pending.needed if pending else []))
    for r, (err, _) in enumerate(results):
        if err:
            raise CheckpointError(err if err == error or gather is None else f"rank {r}: {err}")
    needed = {n for _, names in results for n in names}
    stored = {n for n in reader.manifest["tensors"] if ":" not in n}
    extra = sorted(stored - needed)
    if extra:
        fix = "resume with the model config the checkpoint was written with (its config.yaml)"
        raise CheckpointError(f"{reader.path} holds tensors this model does not have ({', '.join(extra[:3])}"
                              f"{' ...' if len(extra) > 3 else ''}): {_scheme_fix(extra[0], fix)}")
    assert pending is not None
    return pending
