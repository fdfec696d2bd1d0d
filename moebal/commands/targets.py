"""Commands made of targets (`moebal plan TARGET`, `moebal bench TARGET`).

A command registers its targets as name -> (module, help). A target's module defines
`add_<name>_arguments(parser)` and `run_<name>(args) -> int`; it is imported only to build the parser, and a
target whose module is not installed is left out.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

__all__ = ["add_target_parsers", "run_target"]


def add_target_parsers(parser: argparse.ArgumentParser, targets: dict[str, tuple[str, str]]) -> None:
    """One sub-parser per target of `targets` under `parser`."""
    parser.set_defaults(_targets_parser=parser)
    sub = parser.add_subparsers(dest="target", metavar="TARGET")
    for name, (module, help_) in targets.items():
        if importlib.util.find_spec(module) is None:
            continue
        p = sub.add_parser(name, help=help_, description=help_)
        p.set_defaults(_target=(module, name))
        getattr(importlib.import_module(module), f"add_{name}_arguments")(p)


def run_target(args: argparse.Namespace) -> int:
    """The chosen target's `run_<name>(args)`; without a target, the command's help and exit code 2."""
    target = getattr(args, "_target", None)
    if target is None:
        args._targets_parser.print_help(sys.stderr)
        return 2
    module, name = target
    return int(getattr(importlib.import_module(module), f"run_{name}")(args) or 0)
