"""`moebal bench layer`'s third-party methods: a method that raises in any phase is recorded as failed and the
run still writes its JSON; Tutel's path, run against a stand-in package with Tutel's interface
(tests/fake_tutel: Tutel installs from source and is not installed here), loads moebal's weights and matches
moebal's output dropless, and records its dropped fraction at capacity factor 1.0 and its version."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from moebal.cli import main
from moebal.commands import bench

FAKE_TUTEL = Path(__file__).resolve().parents[1] / "fake_tutel"
TINY = ["bench", "layer", "--tokens", "32", "--dim", "16", "--ffn", "16", "--experts", "4", "--repeats", "2",
        "--threads", "1", "--dtypes", "fp32"]


def _raises_in_warmup(case: bench.Case) -> dict[str, bench.ThirdPartyMethod]:
    def step() -> None:
        raise RuntimeError("boom in warm-up\nsecond line is not recorded")

    def broken() -> tuple:
        raise ImportError("no such kernel")

    return {"boom": bench.ThirdPartyMethod(build=lambda: (step, None), info={"version": "1.0"}),
            "unbuilt": bench.ThirdPartyMethod(build=broken)}


def test_third_party_failing_in_warmup_is_recorded_and_json_written(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(bench, "THIRD_PARTY", {"fake": _raises_in_warmup})
    out = tmp_path / "bench.json"
    assert main([*TINY, "--warmup", "1", "--routings", "balanced", "--json", str(out)]) == 0
    records = {r["method"]: r for r in json.loads(out.read_text())["records"]}
    assert records["boom"]["failed"] == "warm-up 1: RuntimeError: boom in warm-up"
    assert records["boom"]["version"] == "1.0" and "median_s" not in records["boom"]
    assert records["unbuilt"]["failed"] == "construction: ImportError: no such kernel"
    for name in ("dense", "moebal", "loop"):  # the others were timed in full
        assert records[name]["median_s"] > 0 and records[name]["repeats"] == 2


def test_failed_result_check_drops_the_timing(tmp_path: Path, monkeypatch) -> None:
    def provider(case: bench.Case) -> dict[str, bench.ThirdPartyMethod]:
        def check() -> dict:
            raise ValueError("output differs")

        return {"checked": bench.ThirdPartyMethod(build=lambda: ((lambda: None), check))}

    monkeypatch.setattr(bench, "THIRD_PARTY", {"fake": provider})
    out = tmp_path / "bench.json"
    assert main([*TINY, "--warmup", "0", "--routings", "balanced", "--json", str(out)]) == 0
    (rec,) = [r for r in json.loads(out.read_text())["records"] if r["method"] == "checked"]
    assert rec["failed"] == "result check: ValueError: output differs" and "median_s" not in rec


@pytest.fixture
def stand_in_tutel(monkeypatch) -> Iterator[None]:
    monkeypatch.syspath_prepend(str(FAKE_TUTEL))
    yield
    for name in [m for m in sys.modules if m == "tutel" or m.startswith("tutel.")]:
        del sys.modules[name]


def test_tutel_path_against_stand_in(tmp_path: Path, stand_in_tutel: None) -> None:
    out = tmp_path / "bench.json"
    assert main([*TINY, "--warmup", "1", "--json", str(out)]) == 0
    records = {(r["method"], r["routing"]): r for r in json.loads(out.read_text())["records"]}
    for routing in ("balanced", "skewed"):
        dropless, capped = records[("tutel", routing)], records[("tutel_cf1", routing)]
        assert dropless["median_s"] > 0 and capped["median_s"] > 0
        assert dropless["matches_moebal"] and dropless["max_abs_diff_vs_moebal"] < 1e-5  # same weights, routing
        assert dropless["dropped_fraction"] == 0.0 and dropless["capacity_factor"] == 0.0
        assert capped["capacity_factor"] == 1.0 and capped["capacity_rows_per_expert"] == 2 * 8  # K * T / E
        assert dropless["tutel"]["version"] == "0.0.0+stand-in" and dropless["tutel"]["commit"] == "unknown"
        assert "llama_ffn" in dropless["expert"]
    # skewed routing overfills the busiest experts: capacity 1.0 drops rows there
    assert records[("tutel_cf1", "skewed")]["dropped_fraction"] > records[("tutel_cf1", "balanced")]["dropped_fraction"]


def test_tutel_is_not_imported_at_module_load() -> None:
    # a fresh interpreter with the stand-in importable: loading the benchmarks must not import it
    code = ("import sys; sys.path[:0] = [sys.argv[1], sys.argv[2]]; "
            "import moebal.commands.bench, bench_expert_parallel; "
            "from moebal.commands.third_party import tutel_importable; "
            "assert tutel_importable() and 'tutel' not in sys.modules, sorted(sys.modules)")
    root = FAKE_TUTEL.parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", code, str(FAKE_TUTEL), str(root / "scripts")], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_drop_stats_follow_tutels_capacity_rule() -> None:
    import torch

    from moebal.commands.third_party import drop_stats

    counts_E = torch.tensor([10, 4, 1, 1])  # 8 tokens x top-2 over 4 experts
    capped = drop_stats(1.0, tokens=8, top_k=2, counts_E=counts_E)  # capacity 2 * int(1.0 * ceil(8 / 4)) = 4
    assert capped == {"capacity_rows_per_expert": 4, "routed_rows": 16, "computed_rows": 16, "dropped_fraction": 6 / 16}
    dropless = drop_stats(0.0, tokens=8, top_k=2, counts_E=counts_E)  # every expert padded to the largest load
    assert dropless["dropped_fraction"] == 0.0 and dropless["computed_rows"] == 40


def test_commit_comes_only_from_the_packages_own_checkout(tmp_path: Path) -> None:
    from moebal.commands.third_party import _checkout_commit

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(tmp_path), *args], capture_output=True, text=True, check=True,
                              env={**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
                                   "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}).stdout.strip()

    (tmp_path / "tutel").mkdir()
    (tmp_path / "tutel" / "__init__.py").write_text("")
    (tmp_path / "site" / "tutel").mkdir(parents=True)
    git("init", "-q")
    git("add", ".")
    git("commit", "-qm", "x")
    assert _checkout_commit(tmp_path / "tutel") == git("rev-parse", "HEAD")
    # installed inside some other repository (a site-packages in a checkout): not that repository's commit
    assert _checkout_commit(tmp_path / "site" / "tutel") == "unknown"
