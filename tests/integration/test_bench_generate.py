"""scripts/bench_generate.py in its quick form: every mode in every round, rotated, and the tokens each pair must
share (no speed is asserted: the figures are the benchmark's, docs/generate.md)."""

from __future__ import annotations

import json

from tests.cli_util import load_script


def test_quick_run_times_every_mode_in_rotated_rounds_and_checks_the_tokens(tmp_path) -> None:
    bench = load_script("bench_generate")
    out = tmp_path / "g.json"
    assert bench.main(["--quick", "--prompt-len", "16", "--prompts", "3", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["settings"]["new"] == 24 and report["settings"]["prompts"] == [8, 12, 16]
    assert [r["order"][0] for r in report["rounds"]] == ["cache", "no_cache"]
    for r in report["rounds"]:
        assert all(r[m]["tokens_per_s"] > 0 and r[m]["first_token_s"] > 0 for m in bench.MODES)
    assert report["equal"] == {"cache_no_cache": True, "batch_one_by_one": True, "mla_latent_per_head": True}
    # 4 layers x (C 64 + R 16) against 4 layers x 8 heads x (N 32 + R 16 + V 32), fp32
    assert report["mla_cache_bytes_per_position"] == {"mla_latent": 4 * 80 * 4, "mla_per_head": 4 * 640 * 4}
    assert report["cache_over_no_cache"] > 0 and report["environment"]["torch"]
