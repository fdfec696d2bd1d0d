"""`moebal bench TARGET`: micro-benchmarks that write JSON (and a PNG) next to the figures they print.

Targets are registered in TARGETS (name -> module, help; moebal/commands/targets.py).
`layer` (the MoE layer against the dense compute limit) lives here; more targets plug in with one line each.

`layer` times forward + backward of one MoE layer against
  dense    a SwiGLU MLP over the same K * T rows (the compute limit for the same work),
  moebal   `moebal.MoELayer` (sort-based dispatch, fused grouped SwiGLU experts),
  loop     a per-expert Python loop as in HF Mixtral's sparse block (index_select, MLP, index_add),
  tutel    Tutel's `moe_layer` when `tutel` is importable (recorded as skipped otherwise), with Tutel's SwiGLU
           expert (llama_ffn, explicit silu) and moebal's router and expert weights: dropless (`tutel`, capacity
           factor 0, checked against moebal's output) and at capacity factor 1.0 (`tutel_cf1`, its dropped
           fraction recorded); the Tutel version and commit are recorded (moebal/commands/third_party.py),
under balanced and skewed routing (router logits biased by -1.5 * log(expert rank)), dropless, in fp32 and bf16.
Methods run interleaved in one process, so ratios are measured side by side. Every phase of a third-party
method (construction, warm-up, timed calls, result check) is guarded: an exception records the method as
failed (phase, exception type, first line of the message) and the run goes on and still writes its JSON.

Shape legend: T tokens, D model dim, F expert hidden dim, E experts, K top_k.

Every benchmark (this command and `scripts/bench_*.py`) takes `--device` through `add_device_argument` and
`bench_device`: CUDA when one is visible, else the CPU; benchmarks that only mean something on a CPU (dilated
compute, network namespaces) accept `--device cpu` only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from moebal.commands.targets import add_target_parsers, run_target
from moebal.fileio import output_path, write_text_whole

TARGETS: dict[str, tuple[str, str]] = {
    "layer": ("moebal.commands.bench", "MoE layer forward+backward against a dense SwiGLU, a per-expert loop, Tutel"),
}

DTYPES = ("fp32", "bf16")
ROUTINGS = ("balanced", "skewed")
SKEW = 1.5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_target_parsers(parser, TARGETS)


def run(args: argparse.Namespace) -> int:
    return run_target(args)


# ---- moebal bench layer ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LayerShape:
    tokens: int = 2048
    dim: int = 512
    ffn: int = 1024
    experts: int = 8
    top_k: int = 2


QUICK = LayerShape(tokens=256, dim=128, ffn=256, experts=8, top_k=2)


def at_least(least: int) -> Callable[[str], int]:
    """An argparse `type` for a count: an integer of at least `least`; argparse names the option and the value
    otherwise (`argument --rounds: must be >= 1; got 0`), before a benchmark starts."""

    def parse(text: str) -> int:
        value = int(text)  # a ValueError: argparse says "invalid int value: 'x'"
        if value < least:
            raise argparse.ArgumentTypeError(f"must be >= {least}; got {value}")
        return value

    parse.__name__ = "int"
    return parse


def add_device_argument(p: argparse.ArgumentParser, cpu_only: str | None = None) -> None:
    """`--device`: cuda or cpu (default: cuda when visible). `cpu_only`: why this benchmark runs on a CPU only
    (then the default is cpu and any other device is refused)."""
    if cpu_only:
        p.add_argument("--device", default="cpu", help=f"cpu only: {cpu_only}")
    else:
        p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when a GPU is visible, else cpu)")


def bench_device(name: str | None, cpu_only: str | None = None) -> Any:
    """The torch device a benchmark runs on (see `add_device_argument`); one-line ConfigError otherwise."""
    import torch

    from moebal.errors import ConfigError

    try:
        device = torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError:
        raise ConfigError(f"--device {name!r}: expected cuda, cuda:N or cpu") from None
    if cpu_only and device.type != "cpu":
        raise ConfigError(f"--device {name}: this benchmark runs on a CPU only: {cpu_only}; use --device cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {name}: no CUDA device is visible here; use --device cpu")
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device {name}: expected cuda, cuda:N or cpu")
    return device


def script_device(name: str | None, cpu_only: str | None = None) -> Any:
    """`bench_device` for a script's main: a bad `--device` ends the script with its one-line message. A
    CPU-only benchmark also hides the GPUs from itself and the ranks it starts (CUDA_VISIBLE_DEVICES=""),
    which would otherwise pick CUDA on their own (`moebal train`, the trainer's default device)."""
    from moebal.errors import ConfigError

    try:
        device = bench_device(name, cpu_only)
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None
    if cpu_only:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    return device


def add_layer_arguments(p: argparse.ArgumentParser) -> None:
    full = LayerShape()
    p.add_argument("--quick", action="store_true",
                   help=f"small shapes ({QUICK.tokens} tokens, dim {QUICK.dim}, ffn {QUICK.ffn}) and few repeats")
    p.add_argument("--json", metavar="FILE", help="write the records as JSON")
    p.add_argument("--png", metavar="FILE", help="write a bar chart of the ratios to dense")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    p.add_argument("--tokens", type=int, default=None, help=f"tokens per call (default {full.tokens})")
    p.add_argument("--dim", type=int, default=None, help=f"model dim (default {full.dim})")
    p.add_argument("--ffn", type=int, default=None, help=f"expert hidden dim (default {full.ffn})")
    p.add_argument("--experts", type=int, default=None, help=f"experts (default {full.experts})")
    p.add_argument("--top-k", type=int, default=None, help=f"experts per token (default {full.top_k})")
    p.add_argument("--dtypes", default=",".join(DTYPES), help="comma list of fp32,bf16")
    p.add_argument("--routings", default=",".join(ROUTINGS), help="comma list of balanced,skewed")
    p.add_argument("--kernels", action="store_true",
                   help="also time moebal with each expert kernel forced (loop, grouped_mm)")
    p.add_argument("--repeats", type=int, default=None, help="timed calls per method (default 9, quick 3)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls per method first (default 2, quick 1)")
    p.add_argument("--seed", type=int, default=0)
    add_device_argument(p)


def _choices(text: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    from moebal.errors import ConfigError

    items = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in items if t not in allowed]
    if bad or not items:
        raise ConfigError(f"{flag}: expected a comma list of {', '.join(allowed)}; got {text!r}")
    return items


def run_layer(args: argparse.Namespace) -> int:
    import torch

    from moebal.errors import ConfigError
    from moebal.kernels.bench import environment

    base = QUICK if args.quick else LayerShape()
    given = {k: getattr(args, k) for k in ("tokens", "dim", "ffn", "experts", "top_k")}
    shape = dataclasses.replace(base, **{k: v for k, v in given.items() if v is not None})  # 0 is refused below
    if min(shape.tokens, shape.dim, shape.ffn, shape.experts, shape.top_k) < 1 or shape.top_k > shape.experts:
        raise ConfigError(f"bench layer: sizes must be >= 1 and top_k <= experts; got {shape}")
    if args.threads < 1 or (args.repeats is not None and args.repeats < 1):
        raise ConfigError(f"bench layer: --threads and --repeats must be >= 1; got {args.threads}, {args.repeats}")
    if args.warmup is not None and args.warmup < 0:
        raise ConfigError(f"bench layer: --warmup must be >= 0 (untimed calls first); got {args.warmup}")
    dtypes = _choices(args.dtypes, DTYPES, "--dtypes")
    routings = _choices(args.routings, ROUTINGS, "--routings")
    for flag, path in (("--json", args.json), ("--png", args.png)):  # named before the minutes of timing
        if path:
            output_path(path, flag)
    if args.png:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ConfigError("--png draws with matplotlib, which is not installed: pip install matplotlib (or the "
                              "'dev' extra), or leave out --png") from None
    args.device = bench_device(args.device)
    repeats = args.repeats or (3 if args.quick else 9)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    torch.set_num_threads(args.threads)
    records: list[dict[str, Any]] = []
    for dtype in dtypes:
        for routing in routings:
            records += _bench_case(shape, dtype, routing, args, repeats, warmup)
    result = {"benchmark": "moe_layer_fwd_bwd", "env": environment(), "device": str(args.device),
              "shape": shape.__dict__,
              "threads": args.threads, "repeats": repeats, "warmup": warmup, "records": records}
    _print_table(records)
    if args.json:
        write_text_whole(args.json, json.dumps(result, indent=2) + "\n")
    if args.png:
        _plot(records, shape, args.threads, args.png)
    return 0


def _bench_case(shape: LayerShape, dtype_name: str, routing: str, args: argparse.Namespace,
                repeats: int, warmup: int) -> list[dict[str, Any]]:
    """One (dtype, routing) group: every method interleaved in the same timing loop. Third-party methods
    run guarded in every phase (`_add_third_party`), so one that raises is recorded as failed and the others
    go on."""
    import torch

    from moebal.kernels.bench import time_interleaved

    dtype = torch.float32 if dtype_name == "fp32" else torch.bfloat16
    torch.manual_seed(args.seed)
    case = _build_methods(shape, dtype, routing, args.kernels, args.device)
    guarded = _add_third_party(case, warmup)
    load_before = _loadavg()
    timings = time_interleaved(case.methods, warmup=warmup, repeats=repeats, device=args.device)
    _finish_third_party(case, guarded, timings)
    dense = timings["dense"].median
    # The machine's 1-minute load around the timing: a shared machine's load is part of the evidence.
    common = {"routing": routing, "dtype": dtype_name, "threads": torch.get_num_threads(), **shape.__dict__,
              "capacity_factor": None, "loadavg_before": load_before, "loadavg_after": _loadavg()}
    records = []
    for name, t in timings.items():
        records.append({"method": name, **common, "median_s": t.median, "min_s": t.min, "max_s": t.max,
                        "repeats": t.repeats, "ratio_to_dense": t.median / dense,
                        "min_ratio_to_dense": t.min / timings["dense"].min, "cpu_median_s": t.cpu_median,
                        "cpu_ratio_to_dense": t.cpu_median / timings["dense"].cpu_median,
                        "samples_s": list(t.samples),  # every repeat, in round order
                        **case.info.get(name, {})})
    for name, reason in case.failed.items():
        records.append({"method": name, **common, **case.info.get(name, {}), "failed": reason})
    for name, reason in case.skipped.items():
        records.append({"method": name, **common, "skipped": reason})
    return records


def _loadavg() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return None


@dataclass
class Case:
    """One (dtype, routing) case: its inputs, the methods to time and what to record beside them. Third-party
    providers build their methods from the same inputs (`layer` holds the weights every method copies)."""

    shape: LayerShape
    dtype: Any
    device: Any
    layer: Any
    bias_E: Any
    x_TD: Any
    g_TD: Any
    methods: dict[str, Callable[[], None]] = field(default_factory=dict)
    info: dict[str, dict[str, Any]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)


def _build_methods(shape: LayerShape, dtype: Any, routing: str, with_kernels: bool, device: Any = "cpu") -> Case:
    import torch

    from moebal.models.moe import MoELayer

    T, D, F_, E, K = shape.tokens, shape.dim, shape.ffn, shape.experts, shape.top_k
    layer = MoELayer(D, F_, E, K, None, aux_loss_coef=0.0).to(dtype)
    bias_E = None
    if routing == "skewed":
        bias_E = torch.tensor([-SKEW * math.log(r + 1) for r in range(E)])
        layer.gate.register_forward_hook(lambda _m, _i, out: out + bias_E.to(out.device, out.dtype))
    # built on the CPU from the seed, then moved: the same weights and inputs on every device
    layer = layer.to(device)
    x_TD = torch.randn(T, D, dtype=dtype).to(device).requires_grad_()
    g_TD = torch.randn(T, D, dtype=dtype).to(device)
    case = Case(shape=shape, dtype=dtype, device=device, layer=layer, bias_E=bias_E, x_TD=x_TD, g_TD=g_TD)
    case.methods["dense"] = _dense_method(K * T, D, F_, dtype, device)
    case.methods["moebal"] = _module_method(layer, x_TD, g_TD)
    layer(x_TD)
    assert layer.last_stats is not None  # recorded by the forward just above
    stats = layer.last_stats.read()
    case.info["moebal"] = {"kernel": layer.experts.resolve_kernel(K * T, dtype), "imbalance": stats["imbalance"],
                           "max_load": stats["max_load"], "mean_load": stats["mean_load"]}
    if with_kernels:
        for kernel in ("loop", "grouped_mm"):
            forced = MoELayer(D, F_, E, K, None, aux_loss_coef=0.0, kernel=kernel).to(device, dtype)
            forced.load_state_dict(layer.state_dict())
            forced.gate = layer.gate  # same router, same skew hook
            case.methods[f"moebal_{kernel}"] = _module_method(forced, x_TD, g_TD)
    case.methods["loop"] = _module_method(HFLoopBlock(layer), x_TD, g_TD)
    return case


def _module_method(module: Any, x_TD: Any, g_TD: Any) -> Callable[[], None]:
    def step() -> None:
        module.zero_grad(set_to_none=True)
        x_TD.grad = None
        module(x_TD).backward(g_TD)

    return step


def _dense_method(rows: int, dim: int, ffn: int, dtype: Any, device: Any = "cpu") -> Callable[[], None]:
    """SwiGLU over the K * T dispatched rows with one weight set: the same FLOPs as the MoE experts."""
    import torch
    import torch.nn.functional as F

    w1, w3 = (torch.randn(ffn, dim) * 0.02).to(device, dtype), (torch.randn(ffn, dim) * 0.02).to(device, dtype)
    w2 = (torch.randn(dim, ffn) * 0.02).to(device, dtype)
    params = [p.requires_grad_() for p in (w1, w3, w2)]
    x_ND = torch.randn(rows, dim, dtype=dtype).to(device).requires_grad_()
    g_ND = torch.randn(rows, dim, dtype=dtype).to(device)

    def step() -> None:
        for p in (*params, x_ND):
            p.grad = None
        F.linear(F.silu(F.linear(x_ND, w1)) * F.linear(x_ND, w3), w2).backward(g_ND)

    return step


class HFLoopBlock:
    """HF Mixtral's sparse block: softmax, top-k, renormalise, then for each expert index the tokens, run
    its MLP and index_add the weighted output. Per-expert Linear weights, like HF's ModuleList."""

    def __init__(self, layer: Any) -> None:
        import torch
        from torch import nn

        self.gate, self.top_k, self.num_experts = layer.gate, layer.top_k, layer.num_experts
        ex = layer.experts
        self.experts = nn.ModuleList()
        self._mlps: list[tuple[nn.Linear, nn.Linear, nn.Linear]] = []  # the experts' (w1, w3, w2), typed
        for e in range(layer.num_experts):
            m = nn.Module()
            w1, w3, w2 = (nn.Linear(1, 1, bias=False) for _ in range(3))
            m.w1, m.w3, m.w2 = w1, w3, w2
            w1.weight, w3.weight = nn.Parameter(ex.w1[e].detach().clone()), nn.Parameter(ex.w3[e].detach().clone())
            w2.weight = nn.Parameter(ex.w2[e].detach().clone())
            self.experts.append(m)
            self._mlps.append((w1, w3, w2))
        self._torch = torch

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.gate.zero_grad(set_to_none=set_to_none)
        self.experts.zero_grad(set_to_none=set_to_none)

    def __call__(self, x_TD: Any) -> Any:
        torch = self._torch
        F = torch.nn.functional
        probs_TE = torch.softmax(self.gate(x_TD).float(), dim=-1)
        w_TK, idx_TK = probs_TE.topk(self.top_k, dim=-1)
        w_TK = (w_TK / w_TK.sum(dim=-1, keepdim=True)).to(x_TD.dtype)
        out_TD = torch.zeros_like(x_TD)
        mask_EKT = F.one_hot(idx_TK, self.num_experts).permute(2, 1, 0)
        for e, (w1, w3, w2) in enumerate(self._mlps):
            j, t = torch.where(mask_EKT[e])
            h = x_TD[t]
            y = w2(F.silu(w1(h)) * w3(h)) * w_TK[t, j, None]
            out_TD.index_add_(0, t, y)
        return out_TD


# ---- third-party methods: every phase guarded ------------------------------------------------------------

@dataclass(frozen=True)
class ThirdPartyMethod:
    """A third-party method of `moebal bench layer`. `build()` constructs it and returns its step (one
    forward + backward, timed with the others) and an optional result check, run once after the timing,
    whose fields are recorded; `info` is recorded beside its figures (the version it ran, its settings)."""

    build: Callable[[], tuple[Callable[[], None], Callable[[], dict[str, Any]] | None]]
    info: dict[str, Any] = field(default_factory=dict)


def failure(phase: str, e: BaseException) -> str:
    """How a failed phase is recorded: the phase, the exception type and its message's first line."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{phase}: {type(e).__name__}: {first}"


class GuardedStep:
    """A third-party step that keeps its first exception instead of raising it (and does nothing after it),
    so the interleaved timing of the other methods goes on. Calls up to `warmup` are the warm-up phase."""

    def __init__(self, step: Callable[[], None], warmup: int) -> None:
        self.step, self.warmup, self.calls = step, warmup, 0
        self.error: str | None = None

    def __call__(self) -> None:
        if self.error is not None:
            return
        self.calls += 1
        try:
            self.step()
        except Exception as e:  # a third-party method must not end the run: it is recorded as failed
            phase = "warm-up" if self.calls <= self.warmup else "timed call"
            self.error = failure(f"{phase} {self.calls}", e)


def _add_third_party(case: Case, warmup: int) -> dict[str, tuple[GuardedStep, Callable[[], dict[str, Any]] | None]]:
    """Build every provider's methods (construction guarded) and add their guarded steps to the case."""
    guarded: dict[str, tuple[GuardedStep, Callable[[], dict[str, Any]] | None]] = {}
    for provider_name, provider in THIRD_PARTY.items():
        try:
            built = provider(case)
        except Exception as e:  # e.g. the package imports but is broken: recorded, the run goes on
            case.failed[provider_name] = failure("construction", e)
            continue
        if isinstance(built, str):
            case.skipped[provider_name] = built
            continue
        for name, method in built.items():
            case.info[name] = dict(method.info)
            try:
                step, check = method.build()
            except Exception as e:
                case.failed[name] = failure("construction", e)
                continue
            guarded[name] = (GuardedStep(step, warmup), check)
            case.methods[name] = guarded[name][0]
    return guarded


def _finish_third_party(case: Case, guarded: dict[str, tuple[GuardedStep, Callable[[], dict[str, Any]] | None]],
                        timings: dict[str, Any]) -> None:
    """Run the result checks (guarded); a method that failed in any phase loses its timings (a partial
    figure would read as a real one) and is recorded as failed."""
    for name, (step, check) in guarded.items():
        if step.error is None and check is not None:
            try:
                case.info[name].update(check())
            except Exception as e:
                step.error = failure("result check", e)
        if step.error is not None:
            case.failed[name] = step.error
            timings.pop(name, None)


def _tutel_methods(case: Case) -> dict[str, ThirdPartyMethod] | str:
    """Tutel dropless (capacity factor 0) and at capacity factor 1.0, both with Tutel's SwiGLU expert and
    moebal's router and expert weights loaded, so routing and work per routed row equal moebal's."""
    from moebal.commands import third_party as tp

    if not tp.tutel_importable():
        return tp.NOT_IMPORTABLE
    info = {"tutel": tp.tutel_provenance(), "expert": f"Tutel {tp.EXPERT_TYPE} (SwiGLU), activation silu"}
    return {"tutel": ThirdPartyMethod(lambda: _tutel_build(case, 0.0), {**info, "capacity_factor": 0.0}),
            "tutel_cf1": ThirdPartyMethod(lambda: _tutel_build(case, 1.0), {**info, "capacity_factor": 1.0})}


def _tutel_build(case: Case, capacity_factor: float
                 ) -> tuple[Callable[[], None], Callable[[], dict[str, Any]]]:
    import torch

    from moebal.commands import third_party as tp

    s, moe = case.shape, case.layer
    layer = tp.tutel_layer(dim=s.dim, ffn=s.ffn, experts=s.experts, top_k=s.top_k,
                           capacity_factor=capacity_factor).to(case.device, case.dtype)
    tp.load_moebal_weights(layer, moe.gate.weight, moe.experts.w1, moe.experts.w3, moe.experts.w2)
    counts: list[Any] = []
    layer.gates[0].register_forward_hook(tp.routing_hook(lambda: case.bias_E, counts))
    x_TD = case.x_TD.detach().clone().requires_grad_()

    def step() -> None:
        layer.zero_grad(set_to_none=True)
        x_TD.grad = None
        layer(x_TD).backward(case.g_TD)

    def check() -> dict[str, Any]:
        with torch.no_grad():
            y_TD = layer(x_TD).float()
            out = tp.drop_stats(capacity_factor, s.tokens, s.top_k, counts[0])
            if capacity_factor == 0:  # dropless: the same function as moebal's layer
                ref_TD = moe(x_TD).float()
                diff, scale = (y_TD - ref_TD).abs().max().item(), ref_TD.abs().max().item()
                tol = 1e-4 if case.dtype == torch.float32 else 5e-2
                out |= {"max_abs_diff_vs_moebal": diff, "matches_moebal": diff <= tol * max(scale, 1e-30)}
        return out

    return step, check


THIRD_PARTY: dict[str, Callable[[Case], dict[str, ThirdPartyMethod] | str]] = {"tutel": _tutel_methods}
"""Providers of third-party methods: each returns its methods, or why it is skipped (not installed)."""


def _print_table(records: list[dict[str, Any]]) -> None:
    print(f"{'dtype':5} {'routing':9} {'method':18} {'median ms':>10} {'min ms':>8} {'max ms':>8} {'x dense':>8} "
          f"{'cpu x dense':>11}")
    for r in records:
        if "median_s" not in r:
            why = f"skipped: {r['skipped']}" if "skipped" in r else f"FAILED in {r['failed']}"
            print(f"{r['dtype']:5} {r['routing']:9} {r['method']:18} {why}")
            continue
        print(f"{r['dtype']:5} {r['routing']:9} {r['method']:18} {r['median_s'] * 1e3:10.1f} {r['min_s'] * 1e3:8.1f} "
              f"{r['max_s'] * 1e3:8.1f} {r['ratio_to_dense']:8.2f} {r['cpu_ratio_to_dense']:11.2f}")


def _plot(records: list[dict[str, Any]], shape: LayerShape, threads: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in records if "median_s" in r]
    groups = list(dict.fromkeys((r["dtype"], r["routing"]) for r in timed))
    methods = list(dict.fromkeys(r["method"] for r in timed))
    width = 0.8 / max(len(methods), 1)
    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(groups), 4.2))
    for i, method in enumerate(methods):
        xs, ys = [], []
        for g, (dt, rt) in enumerate(groups):
            hit = [r for r in timed if r["method"] == method and r["dtype"] == dt and r["routing"] == rt]
            if hit:
                xs.append(g + (i - (len(methods) - 1) / 2) * width)
                ys.append(hit[0]["ratio_to_dense"])
        bars = ax.bar(xs, ys, width, label=method)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(groups)), [f"{dt}\n{rt}" for dt, rt in groups])
    ax.set_ylabel("forward+backward time / dense SwiGLU")
    ax.set_title(f"MoE layer, {shape.tokens} tokens, dim {shape.dim}, ffn {shape.ffn}, "
                 f"{shape.experts} experts, top-{shape.top_k}, dropless, {threads} threads", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(output_path(path, "--png"), dpi=120)
    plt.close(fig)
