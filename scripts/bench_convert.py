"""Peak memory of streaming checkpoint conversion, measured on a synthetic multi-GB Mixtral-shaped checkpoint.

    python scripts/bench_convert.py --json c.json [--layers 4] [--workdir DIR]

Writes a random HF Mixtral checkpoint (bf16, realistic proportions: dim 2048, 8 experts of width 7168,
vocabulary 32000; `--layers 4` gives 3.1 GB in 1 GB shards with an index), then runs each conversion in a
fresh child process and reads that child's peak resident memory (the kernel's high-water mark, reset after
imports through /proc/self/clear_refs, so the figure is what the conversion itself added):

  hf-to-moebal      HF directory -> moebal weights directory (file to file)
  moebal-to-hf      moebal weights directory -> HF directory (file to file)
  from_hf           HF directory -> model in memory (bf16); the model is the allowance
  from_hf_fp32      the same into float32 parameters (training's master weights: a dtype conversion per tensor)
  to_hf             model in memory -> HF directory; peak over the loaded model
  to_hf_bf16        float32 model in memory -> bf16 HF directory (a dtype conversion per tensor)
  load_file (ref)   every shard read with safetensors.torch.load_file, experts stacked: what a conversion
                    that is not streamed holds

The target: peak at most about twice the largest tensor plus the model being built.
Writes JSON and a PNG next to it (and prints a table); run it under `flock /tmp/moebal-bench.lock` on a shared
machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from moebal.commands.bench import add_device_argument, at_least, script_device

CPU_ONLY = "it measures the host memory of checkpoint conversion"
"""Why `--device` accepts cpu only here."""

ROOT = Path(__file__).resolve().parents[1]
SHAPE = {"vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 7168, "num_attention_heads": 16,
         "num_key_value_heads": 4, "num_local_experts": 8, "num_experts_per_tok": 2}


def _rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # Linux >= 4.0: reset VmHWM to the current RSS
        return True
    except OSError:
        return False


def write_checkpoint(path: Path, layers: int) -> dict[str, int]:
    """A random bf16 Mixtral checkpoint written tensor by tensor (1 GB shards + index)."""
    from moebal.interop.tensor_io import OutTensor, iter_shards, write_safetensors

    s = SHAPE
    D, F, E, V = s["hidden_size"], s["intermediate_size"], s["num_local_experts"], s["vocab_size"]
    kv = D // s["num_attention_heads"] * s["num_key_value_heads"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, D)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
                       p + "self_attn.q_proj.weight": (D, D), p + "self_attn.k_proj.weight": (kv, D),
                       p + "self_attn.v_proj.weight": (kv, D), p + "self_attn.o_proj.weight": (D, D),
                       p + "block_sparse_moe.gate.weight": (E, D)})
        for e in range(E):
            q = f"{p}block_sparse_moe.experts.{e}."
            shapes.update({q + "w1.weight": (F, D), q + "w3.weight": (F, D), q + "w2.weight": (D, F)})
    shapes.update({"model.norm.weight": (D,), "lm_head.weight": (V, D)})
    gen = torch.Generator().manual_seed(0)

    def produce(shape: tuple[int, ...]) -> torch.Tensor:
        return (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)

    entries = [OutTensor(n, torch.bfloat16, sh, lambda sh=sh: produce(sh)) for n, sh in shapes.items()]
    path.mkdir(parents=True)
    shards = list(iter_shards(entries, 10**9))
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(path / name, shard, metadata={"format": "pt"})
        weight_map.update((t.name, name) for t in shard)
    total = sum(t.nbytes for t in entries)
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": weight_map}))
    config = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", **s, "num_hidden_layers": layers,
              "max_position_embeddings": 4096, "rope_theta": 1e6, "rms_norm_eps": 1e-5,
              "tie_word_embeddings": False, "torch_dtype": "bfloat16", "sliding_window": None}
    (path / "config.json").write_text(json.dumps(config, indent=1))
    largest = max(t.nbytes for t in entries)
    expert = 2 * F * D
    return {"bytes": total, "largest_tensor_bytes": largest, "expert_tensor_bytes": expert,
            "stacked_expert_bytes": E * expert, "files": len(shards)}


def child(op: str, src: str, dst: str) -> dict[str, float]:
    """Run one conversion; report its peak RSS above the post-import baseline."""
    import moebal.interop.hf as hf
    from moebal.interop.tensor_io import DirectorySource

    # Warm-up: the first use of the model code (lazy imports, allocator arenas) costs a fixed amount of memory
    # whatever the checkpoint's size; it is measured and reported apart from the conversion's own peak.
    before = _rss_kb("VmRSS")
    from moebal.models.transformer import MoebalForCausalLM

    with torch.device("meta"):
        MoebalForCausalLM(hf.config_from_hf(src))
    torch.zeros(4, dtype=torch.bfloat16).view(torch.uint8).numpy()
    warmup = _rss_kb("VmRSS") - before
    model = None
    if op == "to_hf":
        model = hf.from_hf(src, dtype="auto")
    elif op == "to_hf_bf16":
        model = hf.from_hf(src, dtype=torch.float32)
    reset = _reset_peak()
    base = _rss_kb("VmRSS")
    t0 = time.perf_counter()
    if op == "hf-to-moebal":
        hf.hf_to_moebal(src, dst)
    elif op == "moebal-to-hf":
        from moebal.commands.convert import _moebal_to_hf

        _moebal_to_hf(argparse.Namespace(src=src, dst=dst, arch=None, dtype="auto", shard_gb=1.0, overwrite=False))
    elif op == "from_hf":
        model = hf.from_hf(src, dtype="auto")
    elif op == "from_hf_fp32":
        model = hf.from_hf(src, dtype=torch.float32)
    elif op == "to_hf":
        hf.to_hf(model, dst, shard_bytes=10**9)
    elif op == "to_hf_bf16":
        hf.to_hf(model, dst, shard_bytes=10**9, dtype=torch.bfloat16)
    elif op == "load_file":
        # What a converter that is not streamed holds: every shard read (`load_file` maps the file; `clone`
        # reads it), then the experts stacked into moebal's layout before anything is written.
        from safetensors.torch import load_file

        held = {}
        for f in sorted(Path(src).glob("*.safetensors")):
            held.update({k: v.clone() for k, v in load_file(str(f)).items()})
        assert len(held) == len(DirectorySource(src).info())
        E = SHAPE["num_local_experts"]
        for key in [k for k in held if k.endswith("experts.0.w1.weight")]:
            for w in ("w1", "w2", "w3"):
                parts = [held.pop(key.replace("0.w1", f"{e}.{w}")) for e in range(E)]
                held[key.replace("experts.0.w1.weight", f"experts.{w}")] = torch.stack(parts)
                del parts
    else:
        raise SystemExit(f"unknown op {op}")
    seconds = time.perf_counter() - t0
    peak = _rss_kb("VmHWM") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"peak_extra_bytes": (peak - base) * 1024, "baseline_rss_bytes": base * 1024, "seconds": seconds,
            "peak_reset": reset, "warmup_bytes": warmup * 1024}


def _run_child(op: str, src: Path, dst: Path) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, __file__, "--child", op, str(src), str(dst)], capture_output=True,
                       text=True, env=env, timeout=3600)
    if r.returncode != 0:
        raise SystemExit(f"{op} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _plot(out: dict, path: Path) -> None:
    """Peak memory of each operation against its target (the PNG next to the JSON)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = list(out["results"])
    peak = [out["results"][o]["peak_extra_bytes"] / 1e9 for o in ops]
    target = [out["results"][o]["target_bytes"] / 1e9 for o in ops]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    x = range(len(ops))
    ax.bar([i - 0.2 for i in x], peak, width=0.4, label="peak memory above start")
    ax.bar([i + 0.2 for i in x], target, width=0.4, label="target: 2 x largest tensor (+ the model)", alpha=0.6)
    ax.set_xticks(list(x), ops, rotation=20)
    ax.set_ylabel("GB")
    ax.set_title(f"streaming conversion of a {out['checkpoint']['bytes'] / 1e9:.2f} GB checkpoint")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=at_least(1), default=4, help="decoder layers (4: a 3.1 GB checkpoint)")
    ap.add_argument("--workdir", help="where to write the checkpoints (default: a temporary directory)")
    ap.add_argument("--json", metavar="FILE", help="write the results here")
    ap.add_argument("--child", nargs=3, metavar=("OP", "SRC", "DST"), help=argparse.SUPPRESS)
    add_device_argument(ap, cpu_only=CPU_ONLY)
    args = ap.parse_args()
    script_device(args.device, cpu_only=CPU_ONLY)
    if args.child:
        print(json.dumps(child(*args.child)))
        return 0
    work = Path(args.workdir or tempfile.mkdtemp(prefix="moebal-bench-convert-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        src = work / "hf"
        shutil.rmtree(src, ignore_errors=True)
        t0 = time.perf_counter()
        ckpt = write_checkpoint(src, args.layers)
        ckpt["write_seconds"] = time.perf_counter() - t0
        model_bytes = ckpt["bytes"]  # bf16 model in memory holds exactly the checkpoint's tensors
        runs = [("hf-to-moebal", src, work / "moebal"), ("moebal-to-hf", work / "moebal", work / "hf-back"),
                ("from_hf", src, work / "unused"), ("from_hf_fp32", src, work / "unused"),
                ("to_hf", src, work / "hf-from-model"), ("to_hf_bf16", src, work / "hf-from-fp32"),
                ("load_file", src, work / "unused")]
        results = {}
        for op, a, b in runs:
            results[op] = _run_child(op, a, b)
            if op in ("moebal-to-hf", "to_hf", "to_hf_bf16"):
                shutil.rmtree(b, ignore_errors=True)
        largest = ckpt["largest_tensor_bytes"]
        allowance = {"hf-to-moebal": 2 * largest, "moebal-to-hf": 2 * largest, "from_hf": model_bytes + 2 * largest,
                     "from_hf_fp32": 2 * model_bytes + 2 * largest, "to_hf": 2 * largest,
                     "to_hf_bf16": 2 * largest, "load_file": 2 * largest}
        for op, r in results.items():
            r["target_bytes"] = allowance[op]
            r["ratio_to_target"] = r["peak_extra_bytes"] / allowance[op]
            r["peak_over_largest_tensor"] = r["peak_extra_bytes"] / largest
        out = {"checkpoint": ckpt, "model_bytes": model_bytes, "results": results, "loadavg": os.getloadavg(),
               "host": {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
                        "machine": platform.machine()},
               "note": "peak_extra = kernel peak RSS (VmHWM, reset after imports) minus the RSS before the "
                       "conversion; to_hf's model was loaded before the reset, so its figure is the export alone"}
        print(f"checkpoint {ckpt['bytes'] / 1e9:.2f} GB in {ckpt['files']} files, largest tensor "
              f"{largest / 1e6:.0f} MB, one expert {ckpt['expert_tensor_bytes'] / 1e6:.0f} MB, stacked experts "
              f"{ckpt['stacked_expert_bytes'] / 1e6:.0f} MB")
        print(f"{'operation':14} {'peak extra MB':>14} {'target MB':>10} {'ratio':>7} {'x largest':>10} {'s':>7}")
        for op, r in results.items():
            print(f"{op:14} {r['peak_extra_bytes'] / 1e6:14.0f} {r['target_bytes'] / 1e6:10.0f} "
                  f"{r['ratio_to_target']:7.2f} {r['peak_over_largest_tensor']:10.2f} {r['seconds']:7.1f}")
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
            _plot(out, Path(args.json).with_suffix(".png"))
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
