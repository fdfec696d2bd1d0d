"""Discrete-event cluster simulator over the CostModel; Chrome-trace (Perfetto) export."""

from moebal.sim.engine import Engine, EngineResult, SimulationError
from moebal.sim.layer import simulate_moe_layer
from moebal.sim.pipeline import PipelineResult, simulate_pipeline
from moebal.sim.program import Layout, SimSpec, build_program, pipeline_order, uniform_stages
from moebal.sim.routing import LoggedRouting, SyntheticRouting, read_routing_log, write_routing_log, zipf_exponent_for
from moebal.sim.simulate import SimResult, plan_placements, simulate, write_chrome_trace

__all__ = [
    "Engine", "EngineResult", "Layout", "LoggedRouting", "PipelineResult", "SimResult", "SimSpec", "SimulationError",
    "SyntheticRouting", "build_program", "pipeline_order", "plan_placements", "read_routing_log", "simulate",
    "simulate_moe_layer", "simulate_pipeline", "uniform_stages", "write_chrome_trace", "write_routing_log",
    "zipf_exponent_for",
]
