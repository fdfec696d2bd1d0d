"""scripts/eval_scheme_scale.py: the report of plans on a scheme's scaled costs against plans on the dense ones."""

from __future__ import annotations

import json

import pytest

from tests.cli_util import load_script


@pytest.fixture(scope="module")
def script():
    return load_script("eval_scheme_scale")


def test_report_prices_both_plans_on_the_scaled_costs(script, tmp_path):
    out = tmp_path / "r.json"
    assert script.main(["--batches", "2", "--max-len", "512", "--scenarios", "mod,tilt", "--json", str(out)]) == 0
    rows = {r["scenario"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"mod", "tilt"}
    for r in rows.values():
        assert len(r["dense_over_scaled"]) == r["batches"] == 2 and 0 <= r["plans_differ"] <= 2
        assert r["min"] <= r["median"] <= r["max"]
    # one factor on every stage scales Eq1 and every stage time alike: the plans cost the same (within the DP's
    # 1 % candidate thinning, which can break a tie the other way)
    assert all(abs(x - 1.0) <= 0.01 for x in rows["mod"]["dense_over_scaled"])


def test_the_replay_is_the_planners_own_simulation(script):
    # evaluate() raises when replaying the scaled plan does not give its predicted time: here it must not
    rows = script.evaluate({"early_exit": script.SCENARIOS["early_exit"]}, batches=1, max_len=512)
    assert rows[0]["scenario"] == "early_exit" and rows[0]["batches"] == 1


def test_unknown_scenario_is_refused(script, capsys):
    with pytest.raises(SystemExit):
        script.main(["--scenarios", "nope"])
    assert "unknown ['nope']" in capsys.readouterr().err
