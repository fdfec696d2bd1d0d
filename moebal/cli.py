"""`moebal` command line: a thin dispatcher over `moebal.commands.<name>` modules.

Each command module defines `add_arguments(parser)` and `run(args) -> int`; it is imported only when its
command runs, so `moebal --help` stays fast and optional dependencies stay optional.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import faulthandler
import importlib
import importlib.util
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from moebal.errors import MoebalError

# name -> (module, one-line help). Add a command by adding a module and a line here.
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("moebal.commands.train", "train a model (no CONFIG: the embedded default run)"),
    "bench": ("moebal.commands.bench", "micro-benchmarks (MoE layer, calibration)"),
    "plan": ("moebal.commands.plan", "dry-run planners: experts | stages | microbatches | memory"),
    "simulate": ("moebal.commands.simulate", "simulate one training iteration on a modelled GPU cluster"),
    "calibrate": ("moebal.commands.calibrate", "measure this machine and write a hardware profile"),
    "convert": ("moebal.commands.convert", "convert checkpoints between HF and moebal"),
    "launch": ("moebal.commands.launch", "launch a multi-node job described in YAML"),
    "paths": ("moebal.commands.paths", "build Lina's sample-path profile from a run's recorded routing"),
    "generate": ("moebal.commands.generate", "text from a run's checkpoint or a HF checkpoint, with a KV cache"),
    "eval": ("moebal.commands.eval", "a run's model forward with expert parallelism under Lina's inference scheduling"),
}


def _available() -> dict[str, tuple[str, str]]:
    found = {}
    for name, (module, help_) in COMMANDS.items():
        if importlib.util.find_spec(module) is not None:
            found[name] = (module, help_)
    return found


def build_parser(requested: str | None = None) -> argparse.ArgumentParser:
    """The parser; only the requested command's module is imported to add its arguments."""
    parser = argparse.ArgumentParser(prog="moebal", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_) in _available().items():
        p = sub.add_parser(name, help=help_, description=help_)
        p.set_defaults(_module=module)
        if name == requested:
            importlib.import_module(module).add_arguments(p)
    return parser


HANG_ENV = "MOEBAL_HANG_TIMEOUT_S"


def _bound_the_process() -> None:
    """With MOEBAL_HANG_TIMEOUT_S set (the test suite sets it), a moebal process still running after that many
    seconds prints every thread's stack to stderr and exits 1, so that a hung job fails with its ranks' stacks
    instead of hanging. A launcher waits 30 s longer than its ranks: they dump first, then it reports them."""
    limit = os.environ.get(HANG_ENV)
    if limit:
        faulthandler.dump_traceback_later(float(limit) + (0 if "RANK" in os.environ else 30), exit=True)


TORCHRUN_ERROR_ENV = "TORCHELASTIC_ERROR_FILE"


def _tell_torchrun(line: str) -> None:
    """Under torchrun (`moebal launch`, or by hand), the error line in the rank's error file, in the format of
    torch's `ErrorHandler`: torchrun's failure summary then shows it as the failed rank's root cause instead
    of "error_file: <N/A>", also for a rank other than 0, whose line no stderr carries."""
    path = os.environ.get(TORCHRUN_ERROR_ENV)
    if not path:
        return
    import json
    import time

    with contextlib.suppress(OSError):
        Path(path).write_text(json.dumps({"message": {"message": line, "extraInfo": {
            "py_callstack": line, "timestamp": str(int(time.time()))}}}), encoding="utf-8")


def main(argv: Sequence[str] | None = None) -> int:
    if argv is None:  # a process of its own (not a test calling main() in its process)
        faulthandler.enable(all_threads=True)  # a crash below Python prints every thread's stack to stderr
        _bound_the_process()
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv[0] if argv else None)
    args, extra = parser.parse_known_args(argv)
    # argparse takes positionals in one run; `key=value` overrides may also follow options (train --nproc 2 a=b)
    stray = [x for x in extra if x.startswith("-") or "=" not in x or not hasattr(args, "overrides")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    args._argv = argv[1:]  # the command's own arguments (a local launcher re-runs them on every rank)
    if not getattr(args, "_module", None):
        parser.print_help()
        return 2
    if "MOEBAL_LAUNCHER_PID" in os.environ:  # a rank of `--nproc N`: never outlive the launcher
        from moebal.launch.spawn import die_with_launcher

        die_with_launcher()
    try:
        return int(importlib.import_module(args._module).run(args) or 0)
    except MoebalError as e:
        from moebal.launch.spawn import ERRORS_ENV

        rank = os.environ.get("RANK", "0")
        line = f"moebal {args.command}: error{'' if rank == '0' else f' (rank {rank})'}: {e}"
        # every rank sees the same bad input, and rank 0 reports it; a rank whose RANK is no rank number, or
        # one started by hand, without a launcher's error file to carry its line, reports it itself
        by_hand = not (os.environ.get(ERRORS_ENV) or os.environ.get(TORCHRUN_ERROR_ENV))
        if rank == "0" or not rank.isdigit() or by_hand:
            print(line, file=sys.stderr)
        elif os.environ.get(ERRORS_ENV):  # a local launcher says it should this rank fail alone
            with contextlib.suppress(OSError):
                Path(os.environ[ERRORS_ENV], f"rank-{rank}").write_text(line + "\n", encoding="utf-8")
        _tell_torchrun(line)
        return 2
    except BrokenPipeError:  # stdout's reader left (`moebal plan ... | head`): stop as a killed writer would
        if argv is None or sys.argv[1:] == argv:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes
        return 128 + signal.SIGPIPE
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
            raise
        # the disk, not a bug: one line from each rank that met it (checkpoints say more: CheckpointError)
        rank = os.environ.get("RANK", "0")
        print(f"moebal {args.command}: error{'' if rank == '0' else f' (rank {rank})'}: {e.strerror}"
              f"{f': {e.filename}' if e.filename else ''}; free space and "
              f"{'continue with --resume' if args.command in ('train', 'launch') else 'run it again'}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # Ctrl-C, or a launcher's SIGTERM/SIGHUP (moebal.launch.spawn.Stopped)
        signum = getattr(e, "signum", 2)
        print(f"moebal {args.command}: interrupted ({signal.Signals(signum).name})", file=sys.stderr)
        return 128 + signum


if __name__ == "__main__":
    sys.exit(main())
