"""`moebal convert hf-to-moebal|moebal-to-hf SRC DST`: checkpoints between Hugging Face and moebal, streamed
tensor by tensor (docs/hf-interop.md).

    hf-to-moebal SRC DST   SRC: a HF model directory (Mixtral, LLaMA-MoE v1, Qwen2-MoE; config.json plus one
                           safetensors file or a sharded index). DST: a moebal weights directory (moebal names,
                           experts stacked by logical id), usable as `hf.init_from`.
    moebal-to-hf SRC DST   SRC: a moebal weights directory, a training checkpoint (`ckpt-<step>`, any
                           expert-parallel layout: the shards are consolidated) or a run directory (its newest
                           checkpoint). DST: a HF model directory `transformers` loads.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from moebal.errors import ConfigError
from moebal.fileio import make_folder_of, refuse_replacing

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("direction", choices=["hf-to-moebal", "moebal-to-hf"], help="which way to convert")
    p.add_argument("src", metavar="SRC", help="source directory")
    p.add_argument("dst", metavar="DST", help="destination directory (written whole, then renamed into place)")
    from moebal.interop.hf import ARCHITECTURES

    p.add_argument("--arch", choices=sorted(set(ARCHITECTURES.values())),
                   help="HF layout to write (moebal-to-hf; default: the source's, else the one that expresses the "
                        "model)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="dtype of the written weights (default: the source's)")
    p.add_argument("--shard-gb", type=float, default=None,
                   help="moebal-to-hf: largest safetensors file in GB before sharding (default: hf.shard_gb, 5)")
    p.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    p.add_argument("--json", action="store_true", help="print a JSON summary")


def _moebal_to_hf(args: argparse.Namespace) -> Path:
    from moebal.interop.hf import BASE_CONFIG, DTYPE_NAMES, is_moebal_dir, write_hf
    from moebal.interop.tensor_io import FileSource

    src = Path(args.src)
    if not is_moebal_dir(src):
        from moebal.train.export import export_checkpoint

        return export_checkpoint(src, args.dst, arch=args.arch, dtype=args.dtype, shard_gb=args.shard_gb,
                                 overwrite=args.overwrite)
    from moebal.config import load
    from moebal.interop.hf import verify_manifest

    verify_manifest(src)
    cfg = load(src / "config.yaml")
    base = json.loads((src / BASE_CONFIG).read_text(encoding="utf-8")) if (src / BASE_CONFIG).is_file() else None
    source = FileSource(src / "model.safetensors")
    try:
        dtype = args.dtype
        if dtype == "auto":
            dtype = next(k for k, v in DTYPE_NAMES.items() if v == source.info()["model.embed_tokens.weight"].dtype)
        gb = cfg.hf.shard_gb if args.shard_gb is None else args.shard_gb
        return write_hf(source, cfg, args.dst, arch=args.arch, dtype=DTYPE_NAMES[dtype], shard_bytes=int(gb * 1e9),
                        base=base, copy_from=src, overwrite=args.overwrite)
    finally:
        source.close()


def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    if args.shard_gb is not None and not (math.isfinite(args.shard_gb) and args.shard_gb > 0):
        raise ConfigError(f"--shard-gb must be a positive number of GB (the largest safetensors file); got "
                          f"{args.shard_gb}")
    # DST is written beside itself, then renamed into place: its folder must exist. Folders made here are taken
    # away again when the conversion fails (a SRC that is not a checkpoint leaves nothing behind).
    refuse_replacing(args.dst, "DST", {"SRC": args.src})
    made = [d for d in Path(args.dst).absolute().parents if not d.exists()]
    make_folder_of(args.dst, "DST")
    try:
        if args.direction == "hf-to-moebal":
            from moebal.interop.hf import hf_to_moebal

            out = hf_to_moebal(args.src, args.dst, dtype=args.dtype, overwrite=args.overwrite)
        else:
            out = _moebal_to_hf(args)
    except BaseException as e:
        for d in made:  # deepest first; one that is not empty (something else wrote there) stays
            try:
                d.rmdir()
            except OSError:
                break
        if isinstance(e, OSError) and _written_beside(e, Path(args.dst)):
            raise ConfigError(f"DST {args.dst}: cannot write there ({e.strerror or e}): give a writable path") from e
        raise
    files = sorted(p for p in out.iterdir() if p.is_file())
    size = sum(p.stat().st_size for p in files)
    summary = {"direction": args.direction, "src": str(args.src), "dst": str(out), "files": len(files),
               "bytes": size, "seconds": round(time.perf_counter() - t0, 3)}
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"moebal convert: wrote {out} ({len(files)} files, {size / 1e6:.1f} MB) in {summary['seconds']:.1f} s",
              file=sys.stderr)
    return 0


def _written_beside(e: OSError, dst: Path) -> bool:
    """Whether `e` is about a file the conversion writes: DST, something in it, or its temporary sibling (DST is
    written beside itself and renamed into place), not a file of SRC."""
    if not e.filename:
        return False
    where, dst = Path(str(e.filename)).absolute(), dst.absolute()
    return where == dst or dst in where.parents or (where.parent == dst.parent
                                                     and where.name.startswith(f".{dst.name}.tmp"))

