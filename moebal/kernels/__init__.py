"""Kernels: sort-based token permutation (dispatch/combine), grouped SwiGLU experts, the timing helper."""

from moebal.kernels.bench import Timing, environment, time_fn, time_interleaved
from moebal.kernels.dispatch import DispatchPlan, combine, dispatch, make_plan
from moebal.kernels.expert_ffn import KERNELS, auto_kernel, reference_experts, swiglu_experts

__all__ = [
    "KERNELS",
    "DispatchPlan",
    "Timing",
    "auto_kernel",
    "combine",
    "dispatch",
    "environment",
    "make_plan",
    "reference_experts",
    "swiglu_experts",
    "time_fn",
    "time_interleaved",
]
