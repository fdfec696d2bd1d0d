"""Where a rank's resident memory goes, phase by phase: one `scripts/bench_memory.py` layout traced.

    python scripts/trace_rank_memory.py LAYOUT [--steps N] [--interval-ms 5] [--json FILE] [--env K=V ...]

Runs the layout as bench_memory does (4 rank processes, the torchrun environment, the same overrides), but each
rank runs `moebal train` under a sampling thread of its own. Every few milliseconds it records the rank's
resident set (/proc/self/statm), glibc malloc's own accounting (`mallinfo2`: bytes in use from the heaps,
`uordblks`, and from mmap, `hblkhd`; free bytes kept in the heaps, `fordblks`; the heaps' size, `arena`) and
the phase the main thread is in (the innermost known function on its stack: model build, FSDP2 wrapping,
optimizer set-up, forward, backward, FSDP2's all-gather / reduce-scatter, the optimizer step, evaluation,
checkpointing). It prints, per rank and phase, the resident peak and what malloc held at that moment, and
the process's `ru_maxrss` beside the sampled peak (a peak between two samples shows as a gap).

`--env MALLOC_ARENA_MAX=1` and the like set the ranks' environment (glibc tunables). Nothing here is a
validation row: it is where the memory plan's CPU terms are looked for (docs/memory.md).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from moebal.commands.bench import at_least

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))

PHASES = {  # a function on the main thread's stack (qualified name, or plain name) -> phase; innermost wins
    "build_model": "start-up: model build", "setup_parallel": "start-up: parallel set-up",
    "fully_shard_model": "start-up: FSDP2 wrap", "FullyShardedAdamW.__init__": "start-up: optimizer init",
    "Trainer.__init__": "start-up: trainer", "forward_backward": "forward", "backward": "backward",
    "foreach_all_gather": "fsdp all-gather", "foreach_reduce": "fsdp reduce-scatter",
    "after_backward": "after backward (hooks)", "FullyShardedAdamW.reduce": "optimizer: reduce",
    "ShardedAdamW.reduce": "optimizer: reduce",
    "clip_grad_norm": "optimizer: clip", "step": "optimizer: step", "zero_grad": "optimizer: zero_grad",
    "_routing_step": "routing stats", "Trainer.evaluate": "evaluation", "Trainer.save": "checkpoint save",
    "_train": "train loop (other)", "Trainer.train": "train loop (other)",
}


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]


def _mallinfo() -> Any:
    libc = ctypes.CDLL("libc.so.6")
    fn = libc.mallinfo2
    fn.restype = _MallInfo2
    return fn


def _phase(frame: Any) -> str:
    while frame is not None:  # innermost first
        code = frame.f_code
        hit = PHASES.get(code.co_qualname) or PHASES.get(code.co_name)
        if hit:
            return hit
        frame = frame.f_back
    return "other"


def sample(out: Path, interval_s: float) -> None:
    """In a rank: sample until exit, then write the trace to `out`."""
    import atexit

    mallinfo = _mallinfo()
    page = os.sysconf("SC_PAGE_SIZE")
    main_id = threading.main_thread().ident
    rows: list[tuple[float, int, int, int, int, int, str]] = []
    stop = threading.Event()
    t0 = time.perf_counter()

    def loop() -> None:
        with open("/proc/self/statm") as f:
            while not stop.is_set():
                f.seek(0)
                rss = int(f.read().split()[1]) * page
                m = mallinfo()
                frame = sys._current_frames().get(main_id)  # noqa: SLF001 - a sampler's way to the stack
                rows.append((time.perf_counter() - t0, rss, m.uordblks, m.hblkhd, m.fordblks, m.arena,
                             _phase(frame)))
                time.sleep(interval_s)

    th = threading.Thread(target=loop, daemon=True, name="rss-sampler")
    th.start()

    def dump() -> None:
        stop.set()
        th.join(1.0)
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        out.write_text(json.dumps({"ru_maxrss": maxrss, "columns": ["t", "rss", "heap_used", "mmap_used",
                                                                      "heap_free", "arena", "phase"],
                                   "rows": rows}))

    atexit.register(dump)


def _rank_main() -> int:
    out, interval = Path(os.environ["TRACE_OUT"]), float(os.environ["TRACE_INTERVAL_S"])
    sample(out, interval)
    from moebal.cli import main

    return main(sys.argv[1:])


def summarise(trace: dict[str, Any]) -> list[dict[str, Any]]:
    """Contiguous runs of one phase: the resident peak in each and malloc's figures at that sample (MB)."""
    out: list[dict[str, Any]] = []
    for t, rss, used, mm, free, arena, phase in trace["rows"]:
        if not out or out[-1]["phase"] != phase:
            out.append({"phase": phase, "t0": t, "rss0": rss / 1e6, "peak": 0.0})
        seg = out[-1]
        seg["t1"], seg["rss1"] = t, rss / 1e6
        if rss / 1e6 >= seg["peak"]:
            seg.update(peak=rss / 1e6, heap_used=used / 1e6, mmap_used=mm / 1e6, heap_free=free / 1e6,
                       arena=arena / 1e6)
    return out


def by_phase(trace: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per phase (over the whole run): the resident peak and malloc's figures at that sample (MB)."""
    out: dict[str, dict[str, float]] = {}
    for _t, rss, used, mm, free, arena, phase in trace["rows"]:
        if rss / 1e6 > out.get(phase, {}).get("peak", -1):
            out[phase] = {"peak": rss / 1e6, "heap_used": used / 1e6, "mmap_used": mm / 1e6,
                          "heap_free": free / 1e6, "arena": arena / 1e6, "live": (used + mm) / 1e6}
    return out


def run(layout: str, steps: int, interval_s: float, env_extra: dict[str, str], workdir: Path) -> dict[str, Any]:
    import bench_memory as bm

    case = next(c for c in bm.CASES if c.name == layout)
    traces = [workdir / f"trace{r}.json" for r in range(bm.RANKS)]
    script = str(Path(__file__).resolve())
    argv = [sys.executable, script, "--rank", "train", *bm.overrides(case, steps), "--out", str(workdir / "run")]
    base = {**os.environ, **env_extra, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(bm._port()),
            "WORLD_SIZE": str(bm.RANKS), "LOCAL_WORLD_SIZE": str(bm.RANKS), "OMP_NUM_THREADS": "1",
            "TRACE_INTERVAL_S": str(interval_s)}
    import subprocess

    from moebal.train.rundir import LOCK_ENV, LOCK_NAME, lock_run_dir

    out = workdir / "run"
    out.mkdir()
    base[LOCK_ENV] = str((out / LOCK_NAME).resolve())
    with lock_run_dir(out):
        logs = [open(workdir / f"rank{r}.log", "wb") for r in range(bm.RANKS)]  # noqa: SIM115 - closed below
        procs = [subprocess.Popen(argv, env={**base, "RANK": str(r), "LOCAL_RANK": str(r),
                                             "TRACE_OUT": str(traces[r])}, stdout=logs[r], stderr=subprocess.STDOUT)
                 for r in range(bm.RANKS)]
        codes = [p.wait() for p in procs]
        for f in logs:
            f.close()
    if any(codes):
        tails = {r: (workdir / f"rank{r}.log").read_text(errors="replace")[-1500:] for r, c in enumerate(codes) if c}
        return {"status": "failed", "codes": codes, "tails": tails}
    ranks = []
    for r, path in enumerate(traces):
        tr = json.loads(path.read_text())
        peak = max(row[1] for row in tr["rows"]) / 1e6
        ranks.append({"rank": r, "ru_maxrss_mb": tr["ru_maxrss"] / 1e6, "sampled_peak_mb": peak,
                      "by_phase": by_phase(tr), "segments": summarise(tr), "samples": len(tr["rows"])})
    pred = bm.predict(case, steps)
    return {"status": "ok", "layout": layout, "env": env_extra, "steps": steps, "interval_s": interval_s,
            "predicted_mb": pred["peak_bytes"] / 1e6,
            "predicted_terms_mb": {k: v / 1e6 for k, v in pred["terms"].items()}, "ranks": ranks,
            "load_avg": os.getloadavg()}


def _print(res: dict[str, Any]) -> None:
    if res["status"] != "ok":
        print(json.dumps(res, indent=1))
        return
    print(f"{res['layout']} {res['env']}: predicted {res['predicted_mb']:.0f} MB per rank")
    for r in res["ranks"]:
        print(f"rank {r['rank']}: ru_maxrss {r['ru_maxrss_mb']:.0f} MB, sampled peak {r['sampled_peak_mb']:.0f} MB "
              f"({r['samples']} samples)")
        for phase, v in sorted(r["by_phase"].items(), key=lambda kv: -kv[1]["peak"]):
            print(f"  {phase:<28} rss {v['peak']:7.0f}  malloc live {v['live']:7.0f} (heap {v['heap_used']:6.0f} "
                  f"mmap {v['mmap_used']:6.0f})  heap free {v['heap_free']:6.0f}  arenas {v['arena']:6.0f}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--rank":
        sys.argv = [sys.argv[0], *argv[1:]]
        return _rank_main()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("layout", help="a bench_memory.py layout name (dp4_shard_full, dp4, ...)")
    ap.add_argument("--steps", type=at_least(1), default=3)
    ap.add_argument("--interval-ms", type=float, default=5.0)
    ap.add_argument("--env", action="append", default=[], help="K=V for the ranks' environment")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    env = dict(e.split("=", 1) for e in args.env)
    with tempfile.TemporaryDirectory(prefix="trace_rank_memory-") as tmp:
        res = run(args.layout, args.steps, args.interval_ms / 1e3, env, Path(tmp))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n", encoding="utf-8")
    _print(res)
    return 0 if res["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
