"""The engine, the adaptive schedule and the simulator run one 1F1B order (`planner.schedule.one_f_one_b`)."""

import pytest

from moebal.errors import ConfigError
from moebal.planner import adaptive_schedule, schedule
from moebal.sim.program import pipeline_order


@pytest.mark.parametrize(("stages", "micro"), [(1, 1), (2, 4), (3, 2), (4, 6), (4, 9)])
def test_engine_adaptive_schedule_and_simulator_agree_on_1f1b(stages, micro):
    engine = [schedule.make_schedule("1f1b", stages, p, micro) for p in range(stages)]
    assert adaptive_schedule.one_f_one_b(stages, list(range(micro))) == engine
    assert [pipeline_order("1f1b", p, stages, micro) for p in range(stages)] == engine
    assert [pipeline_order("gpipe", p, stages, micro) for p in range(stages)] == [
        schedule.gpipe(stages, p, micro) for p in range(stages)]


def test_injection_order_permutes_the_micro_batch_ids():
    order = [2, 0, 1]
    rename = dict(enumerate(order))
    plain = schedule.one_f_one_b(3, 0, 3)
    assert schedule.one_f_one_b(3, 0, 3, order) == [(kind, rename[j]) for kind, j in plain]
    with pytest.raises(ConfigError, match="permutation"):
        schedule.one_f_one_b(3, 0, 3, [0, 0, 1])
    with pytest.raises(ConfigError, match="simulated pipeline schedule"):
        pipeline_order("zb", 0, 2, 2)
