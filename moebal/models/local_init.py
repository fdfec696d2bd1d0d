"""Rank-local initialisation: build the model on the meta device, materialise only what one rank holds.

Shape legend: E experts, F expert hidden dim, D model dim, n experts held here.

Today's random initialisation (`MoebalForCausalLM(cfg)` after seeding) is one stream of the global CPU
generator in construction order: every nn.Linear's own kaiming init, the embedding's normal init, each MoE
block's `reset_parameters`, then the model's `reset_parameters` redrawing most of them. A tensor's values
depend on everything drawn before it, so a rank cannot draw only its own tensors. Instead:

  1. build the model on the meta device under `_InitRecorder`, which notes every in-place initialisation
     call (`nn.init.normal_`, `kaiming_uniform_`, `Tensor.uniform_`, `zero_`, `fill_`, ...) with its target
     tensor and arguments; on meta nothing is drawn and nothing is allocated;
  2. replay the calls in order on the CPU generator: a call on a tensor the rank holds whole runs on that
     tensor; a call on any other tensor runs on a view of one reusable scratch buffer (as large as the largest
     tensor) and, for a tensor held in part (an expert-parallel rank's rows of the stacked experts), the held
     rows are copied out. Each call draws exactly what it drew in the full build (its draws depend on its
     shape only), so every held value is bit-identical to the full model's.

Host memory during start-up: what the rank holds plus the largest tensor (the scratch buffer), not the model.
Tensors without a recorded call (the rotary tables, computed) are rebuilt for real; every other held tensor
must have been initialised by a recorded call, else `materialise` says which one has none.

`Holding` names what a rank holds: its pipeline stage's layers, the embedding (first stage), the final norm
and LM head (last stage), and its experts' rows (expert parallelism).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from moebal.config import Config
from moebal.models.transformer import MoebalForCausalLM, rotary_for

__all__ = ["Holding", "InitProgram", "allocate_held", "build_local", "materialise", "meta_model"]

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.block_sparse_moe\.experts\.(w1|w2|w3)$")
_NOT_INIT = frozenset({"requires_grad_", "share_memory_", "retain_grad_"})
"""In-place methods that change no values."""
_OVERWRITE = frozenset({"normal_", "uniform_", "zero_", "zeros_", "ones_", "fill_", "constant_", "kaiming_uniform_",
                        "kaiming_normal_", "xavier_uniform_", "xavier_normal_", "trunc_normal_", "exponential_",
                        "bernoulli_", "random_"})
"""Calls whose result does not depend on the tensor's previous values: replayable on a scratch view."""


@dataclass(frozen=True)
class Holding:
    """What one rank holds: `layers` (None: every layer), the embedding, the final norm and LM head (`head`),
    and of each MoE layer's stacked experts the rows of logical experts `experts` (None: all, ascending)."""

    layers: frozenset[int] | None = None
    embed: bool = True
    head: bool = True
    experts: tuple[int, ...] | None = None

    def holds(self, name: str) -> bool:
        """Whether any part of the tensor `name` (a parameter or buffer name of the full model) is held."""
        m = _LAYER.match(name)
        if m:
            return self.layers is None or int(m.group(1)) in self.layers
        if name.startswith("model.embed_tokens."):
            return self.embed
        if name.startswith(("model.norm.", "lm_head.")):
            return self.head
        return True  # rotary tables

    def rows(self, name: str) -> tuple[int, ...] | None:
        """The held rows of a stacked expert tensor (None: the whole tensor)."""
        return self.experts if self.experts is not None and _EXPERT.search(name) else None


@dataclass
class _Call:
    func: Callable[..., Any]
    target: int  # id() of the tensor it initialises
    shape: tuple[int, ...]
    dtype: torch.dtype
    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    def run(self, t: torch.Tensor) -> None:
        """The call on `t` in place of its target."""
        sub: Callable[[Any], Any] = lambda a: t if id(a) == self.target else a  # noqa: E731
        with torch.no_grad():
            self.func(*map(sub, self.args), **{k: sub(v) for k, v in self.kwargs.items()})


@dataclass
class InitProgram:
    """The initialisation calls of a meta-built model, in the order they ran."""

    calls: list[_Call] = field(default_factory=list)


class _InitRecorder(TorchFunctionMode):
    """Notes in-place initialisation calls (a public function or method whose name ends in "_", whose first
    tensor argument is the target) and lets them run (on meta: no draw, no allocation)."""

    def __init__(self, program: InitProgram) -> None:
        super().__init__()
        self.program = program

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name.endswith("_") and not name.startswith("_") and name not in _NOT_INIT:
            target = args[0] if args else kwargs.get("tensor")
            if isinstance(target, torch.Tensor):
                self.program.calls.append(_Call(func, id(target), tuple(target.shape), target.dtype, tuple(args),
                                                dict(kwargs)))
        return func(*args, **kwargs)


def meta_model(cfg: Config) -> tuple[MoebalForCausalLM, InitProgram]:
    """The full model on the meta device and the initialisation calls its construction made."""
    program = InitProgram()
    with torch.device("meta"), _InitRecorder(program):
        model = MoebalForCausalLM(cfg)
    return model, program


def build_local(cfg: Config, holding: Holding) -> MoebalForCausalLM:
    """The model with only `holding` materialised (on the CPU), held values bit-identical to `build_model(cfg)`
    from the same global generator state (seed it first); everything else stays on the meta device."""
    model, program = meta_model(cfg)
    materialise(model, program, holding)
    return model


def materialise(model: MoebalForCausalLM, program: InitProgram, holding: Holding) -> None:
    """Give the held tensors of the meta-built `model` their values by replaying `program` (module docstring)."""
    if model.config.model.tie_embeddings and holding.head and not holding.embed:
        raise ValueError("with model.tie_embeddings the LM head's weight is the embedding's tensor: a holding of "
                         "the head holds the embedding too (a pipeline's last stage makes its copy from it)")
    named = _tensors(model)
    held = allocate_held(model, holding)
    scratch = _Scratch([c for c in program.calls if not _whole(held.get(named.get(c.target, "")))])
    for call in program.calls:
        name = named.get(call.target)
        real = held.get(name) if name is not None else None
        if real is not None and real[1] is None:
            call.run(real[0])  # held whole
            continue
        if call.func.__name__ not in _OVERWRITE:
            raise RuntimeError(f"initialisation call {call.func.__name__} on {name or 'a temporary tensor'} reads "
                               f"the tensor's previous values: it cannot be replayed rank-locally")
        view = scratch.view(call.shape, call.dtype)
        call.run(view)
        if real is not None:  # held in part: the rows of this rank's experts
            idx = real[1]
            assert idx is not None
            with torch.no_grad():
                for i, e in enumerate(idx.tolist()):  # row by row: no temporary as large as the rows
                    real[0][i].copy_(view[e])
    _finish(model, held, program, named)


def _whole(real: tuple[torch.Tensor, torch.Tensor | None] | None) -> bool:
    return real is not None and real[1] is None


def _tensors(model: nn.Module) -> dict[int, str]:
    """id of every parameter and buffer of the meta-built model -> its name (the first, for shared ones)."""
    out: dict[int, str] = {}
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        out.setdefault(id(t), name)
    return out


def allocate_held(model: nn.Module, holding: Holding, device: torch.device | str = "cpu",
                  slice_rows: bool = True) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """Replace every held parameter and buffer of a meta-built model by uninitialised storage on `device`
    (with `slice_rows`, stacked expert tensors by the held rows only; without, they are shards already); the
    rest stays on the meta device. name -> (new tensor, held row indices or None)."""
    out: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
    made: dict[int, torch.Tensor] = {}  # id of a meta tensor -> its replacement (a tied weight is made once)
    for mod_name, mod in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        stores: list[tuple[str, dict[str, Any]]] = [("_parameters", mod._parameters), ("_buffers", mod._buffers)]
        for attr, store in stores:
            for key, t in list(store.items()):
                name = prefix + key
                if t is None or not holding.holds(name) or ".rotary." in name:
                    continue
                if id(t) in made:
                    store[key] = made[id(t)]
                    continue
                rows = holding.rows(name) if slice_rows else None
                shape = (len(rows), *t.shape[1:]) if rows is not None else tuple(t.shape)
                new = torch.empty(shape, dtype=t.dtype, device=device)
                if attr == "_parameters":
                    new = nn.Parameter(new, requires_grad=t.requires_grad)
                store[key] = made[id(t)] = new
                idx = torch.tensor(rows, dtype=torch.int64) if rows is not None else None
                out[name] = (new, idx)
    return out


def _finish(model: MoebalForCausalLM, held: dict[str, tuple[torch.Tensor, torch.Tensor | None]],
            program: InitProgram, named: dict[int, str]) -> None:
    """Rebuild the computed buffers, tie the LM head, label expert rows; check every held tensor got a value."""
    cfg = model.config
    model.model.rotary = rotary_for(cfg)
    if cfg.model.tie_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    initialised = {named[c.target] for c in program.calls if c.target in named}
    missing = [n for n in held if n not in initialised and ".rotary." not in n]
    if missing:
        raise RuntimeError(f"no recorded initialisation for {missing[:3]}: initialise them in the module's "
                           f"constructor with torch.nn.init (or an in-place Tensor method)")
    for layer in model.moe_layers():
        layer.aux_loss = torch.zeros(())  # a plain attribute, made on the meta device
    experts = next((rows for n, (_, rows) in held.items() if rows is not None), None)
    if experts is not None:
        ids = tuple(int(e) for e in experts.tolist())
        for layer in model.moe_layers():
            layer.experts.expert_ids = ids


class _Scratch:
    """One reusable flat buffer per dtype, as large as the largest tensor `calls` replay on it (made at first use)."""

    def __init__(self, calls: list[_Call]) -> None:
        self.size: dict[torch.dtype, int] = {}
        for c in calls:
            self.size[c.dtype] = max(self.size.get(c.dtype, 0), _numel(c.shape))
        self.bufs: dict[torch.dtype, torch.Tensor] = {}

    def view(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        buf = self.bufs.get(dtype)
        if buf is None:
            self.bufs[dtype] = buf = torch.empty(self.size[dtype], dtype=dtype)
        return buf[:_numel(shape)].view(shape)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
