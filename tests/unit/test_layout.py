"""The layers stay layered: the pure planners and the simulator import no torch and no runtime package, and
reading a config imports neither torch nor the HF interop."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PURE = ("planner", "sim")
RUNTIME = ("moebal.distributed", "moebal.pipeline", "moebal.train", "moebal.balance", "moebal.dynamism",
           "moebal.models", "moebal.kernels", "moebal.scheduler", "moebal.launch", "moebal.commands")


def _modules(package: str) -> list[str]:
    return sorted(f"moebal.{package}.{p.stem}".removesuffix(".__init__")
                  for p in (ROOT / "moebal" / package).glob("*.py"))


def _imports(path: Path) -> list[str]:
    """Every module `path` imports, at the top or inside a function."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return names


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_pure_packages_import_no_torch() -> None:
    mods = [m for pkg in PURE for m in _modules(pkg)]
    code = (f"import importlib, sys\nfor m in {mods!r}: importlib.import_module(m)\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = _run(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"torch imported by importing moebal.planner and moebal.sim: {out.stdout}"


@pytest.mark.parametrize("package", PURE)
def test_pure_packages_import_no_runtime_package(package: str) -> None:
    found = [f"{path.relative_to(ROOT)} imports {name}"
             for path in sorted((ROOT / "moebal" / package).glob("*.py")) for name in _imports(path)
             if any(name == r or name.startswith(r + ".") for r in RUNTIME)]
    assert found == []


def _run_configs() -> list[str]:
    return sorted(p.name for p in (ROOT / "configs").glob("*.yaml") if not p.stem.startswith("cluster-"))


@pytest.mark.parametrize("name", _run_configs())
def test_reading_a_config_imports_neither_torch_nor_interop(name: str) -> None:
    code = ("import sys\nimport moebal.config\nfrom moebal.errors import ConfigError\n"
            f"try:\n    moebal.config.load('configs/{name}')\nexcept ConfigError as e:\n"
            "    assert 'moebal.interop.hf_config.load' in str(e), e  # the shape is the checkpoint's\n"
            "bad = [m for m in sys.modules if m.split('.')[0] == 'torch' or m.startswith('moebal.interop')]\n"
            "assert not bad, bad\n")
    out = _run(code)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("argv", [
    ["simulate", "--pp", "2", "--ep", "2", "--ranks", "8", "--json"],
    ["simulate", "mixtral-8x7b", "--cluster", "h100", "--ranks", "16", "--pp", "2", "--policy", "prophet", "--lina",
     "model.tie_embeddings=true", "parallel.shard=optimizer", "parallel.param_dtype=bf16", "--json"],
    ["plan", "stages", "--costs", "1,1,0.5,0.5", "--stages", "2", "--json"],
    ["plan", "memory", "mixtral-8x7b", "--cluster", "h100-ndr400", "--ranks", "16"],
])
def test_the_planning_commands_run_without_torch(argv: list[str]) -> None:
    # they plan and predict GPU jobs on any machine: importing torch (about 3 s, and a CUDA build's libraries)
    # for one setting's precision once made every `moebal simulate` 4 s slower
    code = ("import contextlib, io, sys\nfrom moebal.cli import main\n"
            f"with contextlib.redirect_stdout(io.StringIO()):\n    rc = main({argv!r})\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'torch')\n"
            "assert rc == 0 and not bad, (rc, bad[:5])\n")
    out = _run(code)
    assert out.returncode == 0, out.stderr
